//! The verify node's use of a session's wait for its next tree (docs/ALGORITHMS.md §10, "The
//! verify node decodes while it waits"): whether a forward of the latest verdict's next token
//! runs in the wait ([`Waiting`]), and, when a message comes during that forward, whether the
//! forward stops or finishes ([`Interrupt`], [`finish_from_layer`]).
//!
//! Plain rules over the session's timings, its record and the node's measured forward costs;
//! the gRPC loop in [`crate::service`] drives them and [`crate::session`] runs the forward.

use crate::service::VerifyState;
use crate::session::VerifySession;
use sequoia_core::planner::cost::CostCurve;
use sequoia_engine::Stop;
use sequoia_proto::v1::{session_request, SessionRequest};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;
use tonic::Status;

/// A session's wait for its next tree (docs/ALGORITHMS.md §10, "The verify node
/// decodes while it waits"): how long trees took to come after their verdicts, and whether one
/// is worth a forward of its own meanwhile.
#[derive(Default)]
pub(crate) struct Waiting {
    /// The draft node runs on this node's CPUs (`OpenSession.draft_shares_cpus`): a forward
    /// while it drafts would take its cores, so none runs.
    draft_shares_cpus: bool,
    /// What the session answered last, until the next message it acts on.
    answered: Answered,
    /// Smoothed wait from a verdict to the next message the session acts on, in ms (one that
    /// was there before the verdict went out does not count).
    pub(crate) wait_ms: Option<f64>,
    /// A message that was already there when a forward was considered.
    pub(crate) early: Option<(Instant, Result<Option<SessionRequest>, Status>)>,
}

/// What a session answered last: what its wait can be used for.
#[derive(Default, Clone, Copy)]
enum Answered {
    /// Nothing since the last message it acts on.
    #[default]
    Nothing,
    /// A tree's verdict went out at this instant; its verification took these ms.
    Verdict(Instant, f64),
    /// A `decode` ended, on a next token that the next message starts from whatever it is
    /// (another decode, or a tree rooted there).
    Decode,
}

impl Waiting {
    /// A session's wait, for a draft node that runs on this node's CPUs or not.
    pub(crate) fn new(draft_shares_cpus: bool) -> Self {
        Self {
            draft_shares_cpus,
            ..Self::default()
        }
    }

    pub(crate) fn answered(&mut self, verify_ms: f64) {
        self.answered = Answered::Verdict(Instant::now(), verify_ms);
    }

    /// A `decode` was served. Its last token's forward is wanted by the next message whatever
    /// it is: a decode starts with it and finishes it when it comes mid-forward, a tree rooted
    /// there settles its root from it (docs/ALGORITHMS.md §5.5, "The verify node keeps
    /// decoding"). So a forward in the wait pays however soon that message comes: the round trip
    /// it fills would otherwise leave the node idle between two decodes.
    pub(crate) fn decoded(&mut self) {
        self.answered = Answered::Decode;
    }

    /// The session acts on a message that came at `at` (not a tree sent ahead and dropped).
    /// Only one that came after the verdict counts: one already there (a tree sent ahead in
    /// time) is taken without a forward, and counting its zero wait made the waits a forward
    /// could fill look short.
    pub(crate) fn arrived(&mut self, at: Instant) {
        if let Answered::Verdict(sent, _) = std::mem::take(&mut self.answered) {
            if at <= sent {
                return;
            }
            let ms = (at - sent).as_secs_f64() * 1e3;
            self.wait_ms = Some(match self.wait_ms {
                Some(w) => 0.5 * w + 0.5 * ms,
                None => ms,
            });
        }
    }

    /// A forward while waiting pays where the trees have been taking longer to come than half
    /// the latest verification took (a forward that a tree interrupts stops within a layer, or
    /// finishes where that is cheaper, so a wrong guess costs little; the half keeps the node
    /// from starting forwards that mostly stop where trees come right behind their verdicts, as
    /// near a draft node) and the session is alone on the node (a forward of its own would
    /// delay the others' batches).
    pub(crate) fn worth_decoding(&self, state: &VerifyState, session: &VerifySession) -> bool {
        self.wants_forward(
            state.config.decode_while_waiting,
            state.admission.active() == 1 && !session.has_root_ahead(),
        )
    }

    /// [`worth_decoding`](Self::worth_decoding) on the node's setting and whether the session
    /// is alone with no forward of its own done already.
    fn wants_forward(&self, enabled: bool, alone_without_root: bool) -> bool {
        let wait_pays = match self.answered {
            Answered::Verdict(_, verify_ms) => self.wait_ms.is_some_and(|w| w > 0.5 * verify_ms),
            Answered::Decode => true,
            Answered::Nothing => false,
        };
        enabled && !self.draft_shares_cpus && alone_without_root && wait_pays
    }
}

/// What a session's message reader and its loop share about the forward run in the wait.
/// The reader sets [`before_layer`](Self::before_layer), then [`pending`](Self::pending), for
/// each message the session will act on; the forward reads both through a
/// [`sequoia_engine::Stop`].
pub(crate) struct Interrupt {
    /// Set as a message comes that the session will act on: a forward in the wait stops for
    /// it or finishes. Cleared by the loop before it looks for a message.
    pub(crate) pending: AtomicBool,
    /// Before which layer that message stops the forward ([`before_layer_for`]).
    pub(crate) before_layer: AtomicUsize,
    /// The latest verdict's next token, the root the forward runs (`u64::MAX`: none known).
    /// A tree sent ahead with another root will be dropped, so it does not interrupt.
    expect: AtomicU64,
    /// The session's rate of trees with a child of the root accepted, as `f64` bits.
    root_accept: AtomicU64,
}

impl Default for Interrupt {
    fn default() -> Self {
        Self {
            pending: AtomicBool::new(false),
            before_layer: AtomicUsize::new(usize::MAX),
            expect: AtomicU64::new(u64::MAX),
            root_accept: AtomicU64::new(0.5f64.to_bits()),
        }
    }
}

impl Interrupt {
    /// The latest verdict's next token (None: none known, e.g. while a `decode` runs), and the
    /// session's rate of trees with a child of the root accepted.
    pub(crate) fn expect(&self, root: Option<u32>, root_accept: f64) {
        self.root_accept
            .store(root_accept.to_bits(), Ordering::Relaxed);
        self.expect
            .store(root.map_or(u64::MAX, u64::from), Ordering::Release);
    }

    /// The reader got `msg`: None for a tree sent ahead that will be dropped (it does not
    /// interrupt), else before which layer it stops a forward in the wait. The reader hands
    /// `msg` to the session, then [`raise`](Self::raise)s it: in that order, a loop that
    /// clears the flag and then finds no message can only miss one whose flag comes after.
    pub(crate) fn stops_before(
        &self,
        msg: &Result<Option<SessionRequest>, Status>,
        layers: usize,
        costs: Option<&CostCurve>,
    ) -> Option<usize> {
        let want = self.expect.load(Ordering::Acquire);
        let expect = u32::try_from(want).ok();
        if let Ok(Some(SessionRequest {
            msg: Some(session_request::Msg::Tree(t)),
        })) = msg
        {
            if t.assumes.is_some() && want != u64::MAX && t.tokens.first() != expect.as_ref() {
                return None;
            }
        }
        let p = f64::from_bits(self.root_accept.load(Ordering::Relaxed));
        Some(before_layer_for(msg, expect, layers, p, costs))
    }

    /// What a forward run in the wait checks before each layer.
    pub(crate) fn stop(&self) -> Stop<'_> {
        Stop {
            flag: &self.pending,
            before_layer: &self.before_layer,
        }
    }

    /// A message the session will act on came: a forward in the wait stops before
    /// `before_layer` ([`stops_before`](Self::stops_before)) or finishes.
    pub(crate) fn raise(&self, before_layer: usize) {
        self.before_layer.store(before_layer, Ordering::Relaxed);
        self.pending.store(true, Ordering::Release);
    }
}

/// Before which layer `msg` stops the forward of `expect` run in the wait; past it the forward
/// finishes. A `decode` starts with that very forward: always finish. A tree rooted at `expect`
/// ([`finish_from_layer`]) from its size and its likeliest child's subtree. Anything else (a
/// tree with another root, the end of the stream) makes the forward useless: stop at once.
pub(crate) fn before_layer_for(
    msg: &Result<Option<SessionRequest>, Status>,
    expect: Option<u32>,
    layers: usize,
    root_accept: f64,
    costs: Option<&CostCurve>,
) -> usize {
    match msg {
        Ok(Some(SessionRequest {
            msg: Some(session_request::Msg::Decode(_)),
        })) => 0,
        Ok(Some(SessionRequest {
            msg: Some(session_request::Msg::Tree(t)),
        })) if expect.is_some() && t.tokens.first() == expect.as_ref() => {
            let subtree = first_child_subtree(&t.parents);
            // A forward's cost against one row's; unmeasured, one forward whatever its size
            // (the bound that holds for any tree).
            let rel = |n: usize| match costs {
                Some(c) if c.at(1) > 0.0 => c.at(n) / c.at(1),
                _ => 1.0,
            };
            let sub = if subtree > 0 { rel(subtree) } else { 0.0 };
            finish_from_layer(layers, root_accept, rel(t.parents.len()), sub)
        }
        _ => usize::MAX,
    }
}

/// Before which of `layers` layers a tree that comes stops the root's forward, from the cost
/// of its own forward `tree` and of its likeliest root child's subtree `subtree` (in forwards
/// of one row) and the chance `root_accept` that a child of the root is accepted. With a share
/// `r` of the root's forward left, finishing costs `r`, then the subtree's forward if a child
/// is accepted; stopping costs the tree's forward. Finish where `r + root_accept · subtree <
/// tree`, i.e. from the layer past `L · (1 − tree + root_accept · subtree)`.
pub(crate) fn finish_from_layer(layers: usize, root_accept: f64, tree: f64, subtree: f64) -> usize {
    let bound = layers as f64 * (1.0 - tree + root_accept * subtree);
    // Below zero (or not a number): finishing pays at every layer.
    if bound.is_nan() || bound < 0.0 {
        return 0;
    }
    (bound.floor() as usize).saturating_add(1).min(layers)
}

/// Nodes in the subtree of the root's first child (the draft's likeliest), 0 where the root
/// has none. `parents` comes from the network: entries that do not point back (`p < i`) are
/// skipped here and refused by the verification.
fn first_child_subtree(parents: &[i32]) -> usize {
    let mut size = vec![1usize; parents.len()];
    for i in (1..parents.len()).rev() {
        if let Ok(p) = usize::try_from(parents[i]) {
            if p < i {
                size[p] += size[i];
            }
        }
    }
    (1..parents.len())
        .find(|&i| parents[i] == 0)
        .map_or(0, |i| size[i])
}

#[cfg(test)]
mod tests {
    use super::*;
    use sequoia_proto::v1::{DecodeTokens, VerifyTree};

    /// A session whose trees come late gets a forward in the wait, unless its draft node
    /// shares this node's CPUs, the node's setting is off, or it is not alone.
    #[test]
    fn a_draft_on_the_nodes_cpus_gets_no_forward_in_the_wait() {
        let late = |shares: bool| {
            let mut w = Waiting {
                draft_shares_cpus: shares,
                ..Waiting::default()
            };
            w.answered(100.0);
            w.wait_ms = Some(80.0);
            w
        };
        assert!(late(false).wants_forward(true, true));
        assert!(!late(true).wants_forward(true, true));
        assert!(!late(false).wants_forward(false, true));
        assert!(!late(false).wants_forward(true, false));
        // Trees that come right behind their verdicts get none either.
        let mut prompt = late(false);
        prompt.wait_ms = Some(20.0);
        assert!(!prompt.wants_forward(true, true));
    }

    /// After a decode the next message, however soon it comes, starts from the decode's next
    /// token: a forward in the wait is wanted whatever the waits for trees were, under the
    /// same conditions otherwise, until a message comes or a tree is answered.
    #[test]
    fn after_a_decode_the_wait_always_gets_a_forward() {
        let decoded = |shares: bool| {
            let mut w = Waiting::new(shares);
            w.wait_ms = Some(1.0); // trees came right behind their verdicts
            w.decoded();
            w
        };
        assert!(decoded(false).wants_forward(true, true));
        assert!(!decoded(true).wants_forward(true, true));
        assert!(!decoded(false).wants_forward(false, true));
        assert!(!decoded(false).wants_forward(true, false));
        let mut came = decoded(false);
        came.arrived(Instant::now());
        assert!(!came.wants_forward(true, true), "the message ends it");
        let mut tree = decoded(false);
        tree.answered(100.0);
        assert!(
            !tree.wants_forward(true, true),
            "a tree's verdict goes by the waits"
        );
    }

    /// The old rule is the case of a tree that costs one forward and a subtree as much: finish
    /// once less than `1 − p` of the forward is left.
    #[test]
    fn finishing_pays_where_the_rest_costs_less_than_the_trees_forward() {
        assert_eq!(finish_from_layer(28, 0.75, 1.0, 1.0), 22);
        // A 3-node tree at 1.3 forwards, a 2-node subtree at 1.1: finish from layer 15.
        assert_eq!(finish_from_layer(28, 0.75, 1.3, 1.1), 15);
        // A subtree as costly as the tree's forward and sure to be needed: never finish.
        assert_eq!(finish_from_layer(28, 1.0, 1.0, 1.0), 28);
        // A root-only tree: the forward is the tree's own, finish from layer 1.
        assert_eq!(finish_from_layer(28, 0.75, 1.0, 0.0), 1);
        // A big tree: finish at any layer.
        assert_eq!(finish_from_layer(28, 0.75, 3.0, 1.0), 0);
        assert_eq!(finish_from_layer(28, f64::NAN, 1.0, 1.0), 0);
    }

    fn tree(tokens: Vec<u32>, parents: Vec<i32>) -> Result<Option<SessionRequest>, Status> {
        Ok(Some(SessionRequest {
            msg: Some(session_request::Msg::Tree(VerifyTree {
                tokens,
                parents,
                ..VerifyTree::default()
            })),
        }))
    }

    #[test]
    fn a_message_stops_the_forward_by_what_it_does_with_it() {
        let costs = CostCurve::new(vec![1, 2, 4], vec![100.0, 110.0, 140.0]).unwrap();
        let c = Some(&costs);
        // Root 7 with children 1 (subtree of 2) and 2; 4 nodes: 1.4 forwards against 1.1.
        let t = tree(vec![7, 8, 9, 10], vec![-1, 0, 0, 1]);
        assert_eq!(before_layer_for(&t, Some(7), 28, 0.75, c), 12);
        // Unmeasured: the old bound.
        assert_eq!(before_layer_for(&t, Some(7), 28, 0.75, None), 22);
        // Another root: the forward is of no use.
        assert_eq!(before_layer_for(&t, Some(5), 28, 0.75, c), usize::MAX);
        assert_eq!(before_layer_for(&t, None, 28, 0.75, c), usize::MAX);
        // A decode starts with this forward.
        let d = Ok(Some(SessionRequest {
            msg: Some(session_request::Msg::Decode(DecodeTokens::default())),
        }));
        assert_eq!(before_layer_for(&d, Some(7), 28, 0.75, c), 0);
        // The end of the stream, or an error.
        assert_eq!(
            before_layer_for(&Ok(None), Some(7), 28, 0.75, c),
            usize::MAX
        );
        // Malformed parents from the network do not panic.
        let bad = tree(vec![7, 8, 9], vec![-1, 5, -3]);
        assert_eq!(before_layer_for(&bad, Some(7), 28, 0.75, c), 0);
    }

    /// A tree sent ahead for another verdict is dropped: it neither interrupts nor sets the
    /// layer; one for this root does both.
    #[test]
    fn only_messages_the_session_acts_on_interrupt() {
        let i = Interrupt::default();
        i.expect(Some(7), 0.75);
        let mut ahead = tree(vec![5, 6], vec![-1, 0]);
        if let Ok(Some(SessionRequest {
            msg: Some(session_request::Msg::Tree(t)),
        })) = &mut ahead
        {
            t.assumes = Some(Default::default());
        }
        assert_eq!(i.stops_before(&ahead, 28, None), None);
        let own = i.stops_before(&tree(vec![7, 8], vec![-1, 0]), 28, None);
        assert_eq!(own, Some(22));
        assert!(
            !i.pending.load(Ordering::Acquire),
            "raised only once handed over"
        );
        i.raise(22);
        let stop = i.stop();
        assert!(stop.flag.load(Ordering::Acquire));
        assert_eq!(stop.before_layer.load(Ordering::Relaxed), 22);
    }
}
