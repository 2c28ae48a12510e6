//! The link between one generation and the verify side: a `Verifier.Session` stream on one
//! verify node (open → tree → verdict → ...), and [`VerifyLink`], which follows the generation
//! from node to node. When a node dies or drains mid-generation, the link re-opens the session
//! on another node with the committed tokens (that node prefills them) and re-sends the tree
//! it was verifying, so the caller sees one verdict per tree and no error.

use crate::nodes::{unavailable, Reservation, VerifyNode};
use crate::state::DraftState;
use sequoia_core::limits::{
    negotiate_protocol, AHEAD_PROTOCOL_VERSION, DECODE_PROTOCOL_VERSION, MAX_FAILOVERS,
    PROTOCOL_VERSION,
};
use sequoia_core::tree::Tree;
use sequoia_proto::v1::{
    session_request, session_response, DecodeTokens, Decoded, OpenSession, SamplingConfig,
    SessionOpened, SessionRequest, SessionResponse, Verdict, VerifyTree,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tonic::{Code, Status};

/// Where a generation's first tree arrives while its session opens: grown during the verify
/// node's prefill, it is sent right behind the `open` (docs/ALGORITHMS.md §10, "The first tree
/// goes with the open"), so the node starts it as soon as its prefill ends instead of after a
/// round trip. None until (unless) it is complete before the node answers.
pub(super) type FirstTreeRx = watch::Receiver<Option<VerifyTree>>;

/// The next tree, sent before the verdict it assumes has reached the draft node (pipelined
/// drafting, docs/ALGORITHMS.md §10, "Trees sent ahead"): the verify node verifies it right after
/// that verdict if the verdict is the assumed one, and drops it otherwise.
#[derive(Debug, Clone)]
pub(super) struct AheadTree {
    /// The tree, its `assumes` set (the step is set when it is sent).
    pub message: VerifyTree,
    /// The planned shape it was grown for (a node may have fewer children than planned).
    pub shape: Tree,
}

impl AheadTree {
    /// Whether `verdict` is the one this tree assumed.
    fn assumed(&self, verdict: &Verdict) -> bool {
        self.message.tokens.first() == Some(&verdict.next_token)
            && self
                .message
                .assumes
                .as_ref()
                .is_some_and(|a| a.accepted_nodes == verdict.accepted_nodes)
    }
}

/// One generation's verification session, wherever it currently lives.
pub(super) struct VerifyLink {
    link: Link,
    sampling: SamplingConfig,
    seed: u64,
    failovers: u32,
    /// The smallest context limit of the nodes this generation has used.
    context_limit: usize,
    /// The decode in progress (the verify node decodes on its own), if any.
    decoding: Option<Decoding>,
    /// Trees sent ahead on the nodes this generation left.
    ahead_sent: u32,
}

/// A decode in progress: what is left of it, so that a lost node's decode can be resumed on
/// another node from the tokens already received.
#[derive(Debug, Clone, Copy)]
struct Decoding {
    /// The newest committed token (the root of the next decoded token).
    root: u32,
    /// Tokens this decode may still send.
    left: usize,
    tokens_per_message: u32,
}

impl VerifyLink {
    /// Open the session on the best node that takes it. `prefix` is every committed token but
    /// the newest (the first tree's root). A tree arriving on `first` before the node has
    /// answered goes to it as step 0 ([`first_tree_sent`](Self::first_tree_sent)).
    pub(super) async fn open(
        state: &DraftState,
        prefix: Vec<u32>,
        sampling: SamplingConfig,
        seed: u64,
        max_new_tokens: usize,
        first: Option<FirstTreeRx>,
    ) -> Result<Self, Status> {
        let open = OpenSession {
            prefix_tokens: prefix,
            sampling: Some(sampling),
            seed,
            max_new_tokens: u32::try_from(max_new_tokens).unwrap_or(u32::MAX),
            protocol_version: PROTOCOL_VERSION,
            // Set per node by `open_anywhere`.
            draft_shares_cpus: false,
        };
        let link = open_anywhere(state, &open, &mut Vec::new(), first).await?;
        let context_limit = link.opened.context_limit as usize;
        Ok(VerifyLink {
            link,
            sampling,
            seed,
            failovers: 0,
            context_limit,
            decoding: None,
            ahead_sent: 0,
        })
    }

    /// Whether the first tree went to the node with the `open`: the node verifies it right
    /// after its prefill, and the first step takes it over instead of sending it.
    pub(super) fn first_tree_sent(&self) -> bool {
        self.link.next_step == 0 && self.link.in_flight.is_some()
    }

    /// Whether the current node takes `decode` (its session speaks protocol version 3 or
    /// later). Older nodes only ever see trees.
    pub(super) fn can_decode(&self) -> bool {
        self.link.version >= DECODE_PROTOCOL_VERSION
    }

    /// Ask the verify node to decode up to `max_tokens` tokens after `root` on its own; read
    /// them with [`decoded`](Self::decoded) until it reports the decode done. Only on nodes
    /// that [`can_decode`](Self::can_decode).
    pub(super) async fn start_decode(
        &mut self,
        root: u32,
        max_tokens: usize,
        tokens_per_message: u32,
    ) {
        let d = Decoding {
            root,
            left: max_tokens,
            tokens_per_message,
        };
        self.decoding = Some(d);
        // A failed send shows up as a lost node when the answer is read, which moves the
        // session like any other loss.
        let _ = self.link.send_decode(d).await;
    }

    /// The next tokens of the decode in progress (`done` set on the last). If the node
    /// is lost, the session moves to another node (`committed`: all committed tokens, the
    /// newest being the root; `remaining`: tokens the generation may still commit) and the rest
    /// of the decode continues there.
    pub(super) async fn decoded(
        &mut self,
        state: &DraftState,
        committed: impl Fn() -> Vec<u32>,
        remaining: usize,
    ) -> Result<Decoded, Status> {
        let Some(mut d) = self.decoding else {
            return Err(Status::internal("no decode in progress"));
        };
        let timeout = Duration::from_secs_f64(state.config.step_timeout_secs);
        let vocab = state.model.info().vocab_size;
        loop {
            match self.link.next_decoded(timeout, vocab, d.left).await {
                Ok(mut m) => {
                    d.left -= m.tokens.len();
                    d.root = *m.tokens.last().expect("checked: at least one token");
                    m.done |= d.left == 0;
                    self.decoding = (!m.done).then_some(d);
                    return Ok(m);
                }
                Err(e) if e.code() == Code::Unavailable && self.failovers < MAX_FAILOVERS => {
                    self.move_session(state, &e, &committed(), remaining)
                        .await?;
                    if !self.can_decode() {
                        // The new node is older: end this decode here; the generation goes on
                        // with trees there.
                        self.decoding = None;
                        return Ok(Decoded {
                            done: true,
                            ..Decoded::default()
                        });
                    }
                    let _ = self.link.send_decode(d).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub(super) fn node(&self) -> &Arc<VerifyNode> {
        self.link.node()
    }

    pub(super) fn addr(&self) -> &str {
        self.link.addr()
    }

    pub(super) fn failovers(&self) -> u32 {
        self.failovers
    }

    /// Trees sent ahead of their verdicts so far, on every node this generation used.
    pub(super) fn ahead_sent(&self) -> u32 {
        self.ahead_sent + self.link.ahead_sent
    }

    pub(super) fn context_limit(&self) -> usize {
        self.context_limit
    }

    /// Verify one tree (`message` builds its wire form, once per attempt) and return the
    /// verdict with the round-trip time of the attempt that answered. If the node is lost, the
    /// session moves to another node: `committed` are all committed tokens (prompt + generated;
    /// the newest is the tree's root) and `remaining` the tokens still allowed.
    ///
    /// `sent`: the tree went ahead of the previous verdict and that verdict confirmed it
    /// ([`Self::verify`] returned it), so it is not sent again (unless the session moves).
    /// While the verdict is awaited, trees arriving on `ahead` are sent ahead of it, on nodes
    /// that take them; the verdict comes back with the one it confirmed, which the node is
    /// verifying by then.
    pub(super) async fn verify(
        &mut self,
        state: &DraftState,
        message: impl Fn() -> VerifyTree,
        committed: impl Fn() -> Vec<u32>,
        remaining: usize,
        sent: bool,
        mut ahead: Option<&mut mpsc::UnboundedReceiver<AheadTree>>,
    ) -> Result<(Verdict, Duration, Option<AheadTree>), Status> {
        let timeout = Duration::from_secs_f64(state.config.step_timeout_secs);
        let mut tree = (!sent).then(&message);
        loop {
            let t_rt = Instant::now();
            let vocab = state.model.info().vocab_size;
            match self
                .link
                .verify(tree.take(), timeout, vocab, &mut ahead)
                .await
            {
                Ok((v, taken)) => return Ok((v, t_rt.elapsed(), taken)),
                Err(e) if e.code() == Code::Unavailable && self.failovers < MAX_FAILOVERS => {
                    // Trees sent ahead were lost with the node: this one is sent afresh.
                    self.move_session(state, &e, &committed(), remaining)
                        .await?;
                    tree = Some(message());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Continue on another node from the committed tokens after `error` on the current one.
    async fn move_session(
        &mut self,
        state: &DraftState,
        error: &Status,
        committed: &[u32],
        remaining: usize,
    ) -> Result<(), Status> {
        self.failovers += 1;
        self.ahead_sent += self.link.ahead_sent;
        state.metrics.failover();
        self.link.node().mark_unreachable();
        let lost = self.addr().to_string();
        tracing::warn!(node = %lost, error = ?error.message(), failovers = self.failovers, "verify node lost mid-generation; moving the session");
        let moved = OpenSession {
            prefix_tokens: committed[..committed.len().saturating_sub(1)].to_vec(),
            sampling: Some(self.sampling),
            seed: moved_seed(self.seed, self.failovers),
            max_new_tokens: u32::try_from(remaining).unwrap_or(u32::MAX),
            protocol_version: PROTOCOL_VERSION,
            draft_shares_cpus: false,
        };
        self.link = open_anywhere(state, &moved, &mut vec![lost.clone()], None)
            .await
            .map_err(|e2| {
                Status::unavailable(format!(
                    "verify node {lost} failed mid-generation ({}) and no other node could continue it: {}",
                    error.message(),
                    e2.message()
                ))
            })?;
        self.context_limit = self
            .context_limit
            .min(self.link.opened.context_limit as usize);
        tracing::info!(node = %self.addr(), "session moved");
        Ok(())
    }
}

/// Whether a failed verify call means "try another node" rather than "report it": the node is
/// unreachable, drains, died mid-session, or is at its session limit.
fn try_elsewhere(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::ResourceExhausted)
}

/// One open verification session on one verify node.
struct Link {
    reservation: Reservation,
    req_tx: mpsc::Sender<SessionRequest>,
    inbound: tonic::Streaming<SessionResponse>,
    /// Step number of the next tree on this session (each session counts from 0).
    next_step: u64,
    opened: SessionOpened,
    /// The protocol version this session runs.
    version: u32,
    /// Trees sent ahead of the verdict now awaited; and the shape (parents) of the one the
    /// latest verdict confirmed, which the node verifies next without being sent it again.
    ahead: Vec<AheadTree>,
    in_flight: Option<Vec<i32>>,
    ahead_sent: u32,
}

impl Link {
    pub(super) fn node(&self) -> &Arc<VerifyNode> {
        self.reservation.node()
    }

    pub(super) fn addr(&self) -> &str {
        &self.node().addr
    }

    /// Open a session on the reserved node and wait until it has prefilled `open.prefix_tokens`;
    /// a tree arriving on `first` meanwhile is sent behind the `open` as step 0 (the node reads
    /// it once its prefill is done) and becomes the tree in flight.
    async fn open(
        reservation: Reservation,
        open: OpenSession,
        timeout: Duration,
        mut first: Option<FirstTreeRx>,
    ) -> Result<Link, Status> {
        let asked = open.protocol_version;
        let node = reservation.node().clone();
        let addr = node.addr.clone();
        let (req_tx, req_rx) = mpsc::channel::<SessionRequest>(2);
        req_tx
            .send(SessionRequest {
                msg: Some(session_request::Msg::Open(open)),
            })
            .await
            .map_err(|_| Status::internal("session request channel closed"))?;
        let mut client = node.client();
        let mut inbound = tokio::time::timeout(
            timeout,
            client.session(tokio_stream::wrappers::ReceiverStream::new(req_rx)),
        )
        .await
        .map_err(|_| {
            Status::unavailable(format!(
                "verify node {addr} did not answer within {timeout:?}"
            ))
        })?
        .map_err(|s| unavailable(&addr, &s))?
        .into_inner();
        let mut in_flight = None;
        let response = loop {
            if let Some(rx) = first.as_mut() {
                let tree = rx.borrow_and_update().clone();
                if let Some(mut tree) = tree {
                    tree.step = 0;
                    let parents = tree.parents.clone();
                    // A failed send shows up as a lost node when the answer is read.
                    let _ = req_tx
                        .send(SessionRequest {
                            msg: Some(session_request::Msg::Tree(tree)),
                        })
                        .await;
                    in_flight = Some(parents);
                    first = None;
                }
            }
            tokio::select! {
                biased;
                r = next_response(&mut inbound, &addr, timeout) => break r?,
                changed = changed_or_pending(&mut first) => {
                    if changed.is_err() {
                        // No first tree will come.
                        first = None;
                    }
                }
            }
        };
        let Some(session_response::Msg::Opened(opened)) = response else {
            return Err(bad_node(&addr, "answered `open` with something else"));
        };
        node.set_reported(opened.active_sessions as usize);
        // Nodes from before versioning report 0 (= 1); never trust more than was asked for.
        let version = opened.protocol_version.max(1).min(asked);
        Ok(Link {
            reservation,
            req_tx,
            inbound,
            next_step: 0,
            opened,
            version,
            ahead: Vec::new(),
            in_flight,
            ahead_sent: 0,
        })
    }

    /// Send a `decode` for what is left of `d`, numbered from this session's next step.
    async fn send_decode(&mut self, d: Decoding) -> Result<(), Status> {
        let addr = self.addr().to_string();
        let req = DecodeTokens {
            step: self.next_step,
            root: d.root,
            max_tokens: u32::try_from(d.left).unwrap_or(u32::MAX),
            tokens_per_message: d.tokens_per_message,
        };
        self.req_tx
            .send(SessionRequest {
                msg: Some(session_request::Msg::Decode(req)),
            })
            .await
            .map_err(|_| Status::unavailable(format!("verify node {addr} closed the session")))
    }

    /// Read the next `decoded` message of a decode that may still send `left` tokens.
    async fn next_decoded(
        &mut self,
        timeout: Duration,
        vocab: usize,
        left: usize,
    ) -> Result<Decoded, Status> {
        let addr = self.addr().to_string();
        let Some(session_response::Msg::Decoded(d)) =
            next_response(&mut self.inbound, &addr, timeout).await?
        else {
            return Err(bad_node(&addr, "answered a decode with something else"));
        };
        sequoia_server::wire::check_decoded(&d, self.next_step, left, vocab)
            .map_err(|e| bad_node(&addr, &e))?;
        self.next_step += d.tokens.len() as u64;
        Ok(d)
    }

    /// Send one tree (numbered here, per session; None: the tree the latest verdict confirmed,
    /// already sent ahead) and wait for its verdict, sending the trees that arrive on `ahead`
    /// meanwhile (where the session takes them). Returns the verdict and the tree sent ahead
    /// that it confirmed, if any.
    async fn verify(
        &mut self,
        tree: Option<VerifyTree>,
        timeout: Duration,
        vocab: usize,
        ahead: &mut Option<&mut mpsc::UnboundedReceiver<AheadTree>>,
    ) -> Result<(Verdict, Option<AheadTree>), Status> {
        let step = self.next_step;
        let addr = self.addr().to_string();
        let parents = match tree {
            Some(mut tree) => {
                tree.step = step;
                let parents = tree.parents.clone();
                self.send(session_request::Msg::Tree(tree)).await?;
                parents
            }
            None => self
                .in_flight
                .take()
                .ok_or_else(|| Status::internal("no tree sent ahead is being verified"))?,
        };
        let takes_ahead = self.version >= AHEAD_PROTOCOL_VERSION;
        let response = loop {
            tokio::select! {
                biased;
                r = next_response(&mut self.inbound, &addr, timeout) => break r?,
                next = next_ahead(ahead) => match next {
                    Some(mut t) if takes_ahead => {
                        t.message.step = step + 1;
                        self.send(session_request::Msg::Tree(t.message.clone())).await?;
                        self.ahead.push(t);
                        self.ahead_sent += 1;
                    }
                    // An older node: nothing goes ahead.
                    Some(_) => {}
                    // Nothing more will come.
                    None => *ahead = None,
                },
            }
        };
        let Some(session_response::Msg::Verdict(verdict)) = response else {
            return Err(bad_node(&addr, "answered a tree with something else"));
        };
        if verdict.step != step {
            return Err(bad_node(
                &addr,
                &format!("answered step {} for step {step}", verdict.step),
            ));
        }
        sequoia_server::wire::check_verdict(&verdict, &parents, vocab)
            .map_err(|e| bad_node(&addr, &e))?;
        self.next_step += 1;
        // The node verifies the tree sent ahead for this verdict (at most one assumed it) next.
        let taken = std::mem::take(&mut self.ahead)
            .into_iter()
            .find(|t| t.assumed(&verdict));
        self.in_flight = taken.as_ref().map(|t| t.message.parents.clone());
        Ok((verdict, taken))
    }

    async fn send(&mut self, msg: session_request::Msg) -> Result<(), Status> {
        let addr = self.addr().to_string();
        self.req_tx
            .send(SessionRequest { msg: Some(msg) })
            .await
            .map_err(|_| Status::unavailable(format!("verify node {addr} closed the session")))
    }
}

/// The next change of the first tree's slot; pending forever when there is none to wait for.
async fn changed_or_pending(
    first: &mut Option<FirstTreeRx>,
) -> Result<(), watch::error::RecvError> {
    match first {
        Some(rx) => rx.changed().await,
        None => std::future::pending().await,
    }
}

/// The next tree to send ahead; None once the sender is done (or there is none).
async fn next_ahead(
    ahead: &mut Option<&mut mpsc::UnboundedReceiver<AheadTree>>,
) -> Option<AheadTree> {
    match ahead {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Open a session on the best verify node that takes it, trying the others (not in `tried`)
/// when one is unreachable, drains or is full. A node serving another tokenizer is an error.
async fn open_anywhere(
    state: &DraftState,
    open: &OpenSession,
    tried: &mut Vec<String>,
    first: Option<FirstTreeRx>,
) -> Result<Link, Status> {
    let timeout = Duration::from_secs_f64(state.config.step_timeout_secs);
    let connect = Duration::from_secs_f64(state.config.connect_timeout_secs);
    let mut last_err: Option<Status> = None;
    while let Some(reservation) = state.pool.reserve(tried).await {
        let node = reservation.node().clone();
        tried.push(node.addr.clone());
        let info = match node.info(connect).await {
            Ok(info) => info,
            Err(e) => {
                last_err = Some(e);
                continue;
            }
        };
        if info.tokenizer_fingerprint != state.tokenizer.fingerprint() {
            return Err(Status::failed_precondition(format!(
                "verify node {} serves {:?}, whose tokenizer differs from the draft model {:?} (fingerprints {} vs {}); draft and target must share a tokenizer",
                node.addr,
                info.model_name,
                state.model.info().name,
                short(&info.tokenizer_fingerprint),
                short(state.tokenizer.fingerprint())
            )));
        }
        let Some(version) = negotiate_protocol(info.min_protocol_version, info.protocol_version)
        else {
            // During a rolling upgrade other nodes may still speak our version: try them.
            let e = Status::failed_precondition(format!(
                "verify node {} speaks protocol versions {}..={}, this draft node {}..={}; upgrade the older side",
                node.addr,
                info.min_protocol_version.max(1),
                info.protocol_version.max(1),
                sequoia_core::limits::MIN_PROTOCOL_VERSION,
                PROTOCOL_VERSION
            ));
            tracing::warn!(node = %node.addr, error = ?e.message(), "verify node speaks no common protocol version; trying another");
            last_err = Some(e);
            continue;
        };
        // Open with the highest version both sides speak, so an older node is never asked for
        // more than it knows.
        let mut open = open.clone();
        open.protocol_version = version;
        open.draft_shares_cpus = node.shares_cpus().await;
        // Each node tried gets the first tree anew: a session that failed took it down with it.
        match Link::open(reservation, open, timeout, first.clone()).await {
            Ok(link) => return Ok(link),
            Err(e) if try_elsewhere(&e) => {
                if e.code() == Code::Unavailable {
                    node.mark_unreachable();
                }
                tracing::warn!(node = %node.addr, error = ?e.message(), "verify node did not take the session; trying another");
                last_err = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last_err.unwrap_or_else(|| {
        Status::unavailable(format!(
            "no verify node is available (configured: {}); check that verify-service runs and the names resolve",
            state.pool.describe()
        ))
    }))
}

/// The first 12 characters of a fingerprint (it comes from the network: may be any UTF-8).
fn short(s: &str) -> &str {
    let end = s.char_indices().nth(12).map_or(s.len(), |(i, _)| i);
    &s[..end]
}

/// A verify node that broke the protocol: treated as lost (UNAVAILABLE), so the session moves
/// to another node rather than trusting anything else it says.
fn bad_node(addr: &str, what: &str) -> Status {
    Status::unavailable(format!(
        "verify node {addr} broke the protocol ({what}); treating it as lost"
    ))
}

/// Seed of the verify side's random stream after the k-th move, so a moved session never
/// reuses the uniforms its earlier steps consumed.
fn moved_seed(seed: u64, k: u32) -> u64 {
    seed ^ (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

async fn next_response(
    inbound: &mut tonic::Streaming<sequoia_proto::v1::SessionResponse>,
    addr: &str,
    timeout: Duration,
) -> Result<Option<session_response::Msg>, Status> {
    match tokio::time::timeout(timeout, inbound.message()).await {
        Err(_) => Err(Status::unavailable(format!(
            "verify node {addr} did not answer within {timeout:?}"
        ))),
        Ok(Err(s)) => Err(unavailable(addr, &s)),
        Ok(Ok(None)) => Err(Status::unavailable(format!(
            "verify node {addr} ended the session unexpectedly"
        ))),
        Ok(Ok(Some(r))) => Ok(r.msg),
    }
}
