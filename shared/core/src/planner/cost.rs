//! The hardware- and network-aware planner (docs/ALGORITHMS.md §5): pick the tree size and depth that
//! maximize predicted speedup over target-only decoding from *measured* costs, and fall back to
//! no speculation when nothing beats it.
//!
//! Step time of a tree with n nodes and level widths w₀ … w_{l−1}:
//!
//! ```text
//! step = Σ_{d < l−1} t_d(w_d)           draft forwards, one per level that grows children
//!      + P(path reaches the last level) · t_d(1)   catching the draft up on an accepted leaf
//!      + RTT + bytes(n) / bandwidth     the network
//!      + t_v(n) + overhead              the target's tree forward and the rest
//! speedup = G(n, l) · t_v(1) / step
//! ```
//!
//! With pipelined drafting (§10) the draft grows the next tree while this one is verified, so
//! with probability `hit` (the verdict was one it speculated on) the step costs the longer of the
//! two, else their sum: see [`pipelined_step_ms`].

use super::{expected_tokens, validate_acceptance, PlanError, SequoiaDp};
use crate::tree::Tree;
use serde::{Deserialize, Serialize};

/// A measured cost curve: milliseconds at some sizes (strictly increasing), linear in between
/// and extrapolated from the last two points beyond.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostCurve {
    pub sizes: Vec<u32>,
    pub ms: Vec<f64>,
}

impl CostCurve {
    pub fn new(sizes: Vec<u32>, ms: Vec<f64>) -> Result<Self, ProfileError> {
        let c = Self { sizes, ms };
        c.validate("curve")?;
        Ok(c)
    }

    fn validate(&self, what: &str) -> Result<(), ProfileError> {
        let bad = |m: String| Err(ProfileError(format!("{what}: {m}")));
        if self.sizes.is_empty() || self.sizes.len() != self.ms.len() {
            return bad(format!(
                "needs matching non-empty sizes and ms (got {} and {})",
                self.sizes.len(),
                self.ms.len()
            ));
        }
        if self.sizes[0] == 0 || self.sizes.windows(2).any(|w| w[0] >= w[1]) {
            return bad("sizes must be ≥ 1 and strictly increasing".into());
        }
        if self.ms.iter().any(|m| !m.is_finite() || *m < 0.0) {
            return bad("times must be finite and ≥ 0".into());
        }
        Ok(())
    }

    /// Interpolated time at size `n`.
    pub fn at(&self, n: usize) -> f64 {
        let n = n as f64;
        let (s, m) = (&self.sizes, &self.ms);
        if s.len() == 1 {
            return m[0] * n / s[0] as f64;
        }
        let k = match s.iter().position(|&x| x as f64 >= n) {
            Some(0) => 1,
            Some(k) => k,
            None => s.len() - 1,
        };
        let (x0, x1) = (s[k - 1] as f64, s[k] as f64);
        let t = m[k - 1] + (m[k] - m[k - 1]) * (n - x0) / (x1 - x0);
        t.max(0.0)
    }

    /// Largest measured size.
    pub fn max_size(&self) -> usize {
        *self.sizes.last().unwrap_or(&1) as usize
    }
}

/// The network between draft and verify node.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NetworkProfile {
    pub rtt_ms: f64,
    /// Bytes per millisecond (1 Gbit/s = 125_000).
    pub bytes_per_ms: f64,
}

/// Measured costs of one verify node as seen from one draft node: its t_v(n) curve and the
/// network between them.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeCosts {
    pub verify: CostCurve,
    pub network: NetworkProfile,
    /// The node decodes while a session waits for its tree ([`Profile::decodes_while_waiting`]).
    pub decodes_while_waiting: bool,
}

/// Everything the planner needs to know about the hardware: saved, loaded and shown as JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Target forward time over a tree of n nodes, t_v(n), on the verify node.
    pub verify: CostCurve,
    /// Draft forward time over one level of w nodes, t_d(w), on the draft node.
    pub draft: CostCurve,
    pub network: NetworkProfile,
    /// Per-message time outside forwards and the network (sampling, serialization), ms.
    pub overhead_ms: f64,
    /// Per tree step, the draft side's time besides its forwards and the round trip (following
    /// the verdict, the draft forward in flight when it arrived, grafting lookup branches), ms:
    /// learned in service from observed steps (docs/ALGORITHMS.md §5.4, per-step extra); 0 in offline profiles.
    /// Decodes of the fallback do not pay it.
    #[serde(default)]
    pub step_extra_ms: f64,
    /// Pipelined trees go to the verify node ahead of the verdict they assume (docs/ALGORITHMS.md
    /// §10, "Trees sent ahead"), so a hit step costs [`sent_ahead_hit_ms`].
    #[serde(default)]
    pub sends_ahead: bool,
    /// Pipelined drafting: verdicts whose next tree is grown ahead at once (`pipeline.candidates`),
    /// so a hit's tree costs [`ahead_draft_ms`]; 0 = priced as one tree drafted after a verdict.
    #[serde(default)]
    pub ahead_candidates: usize,
    /// The verify node decodes a verdict's next token while it waits for the tree that starts
    /// there (docs/ALGORITHMS.md §10, "The verify node decodes while it waits"), so a tree drafted after its
    /// verdict costs [`waited_verify_ms`] there, not a whole forward. Its own session only:
    /// false where the node batches other sessions.
    #[serde(default)]
    pub decodes_while_waiting: bool,
    /// What prompt-lookup branches add to a tree step on average (§9): learned in service from
    /// the steps taken; none in offline profiles.
    #[serde(default)]
    pub lookup: LookupGain,
    /// Observed over predicted drafted tokens per step (§5.4, "Acceptance bias"): G(n, l)'s
    /// drafted part, `G − 1`, is scaled by it. Learned in service; 1 in offline profiles.
    #[serde(default = "one")]
    pub drafted_scale: f64,
    /// Context length the forwards were measured at.
    pub context: usize,
    /// Free-form description (models, machine).
    #[serde(default)]
    pub note: String,
}

/// The average effect of prompt-lookup branches on a tree step (docs/ALGORITHMS.md §9, "In the
/// prediction"): the tokens their accepted nodes commit beyond the drafted tree, and the verify
/// time of the nodes they add. Averaged over every tree step, with and without a branch, so it
/// is added as is to the prediction of any tree that grows a draft (more than the root).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LookupGain {
    pub tokens: f64,
    pub ms: f64,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid profile: {0}")]
pub struct ProfileError(pub String);

impl Profile {
    pub fn validate(&self) -> Result<(), ProfileError> {
        self.verify.validate("verify")?;
        self.draft.validate("draft")?;
        let n = &self.network;
        if !(n.rtt_ms.is_finite() && n.rtt_ms >= 0.0) || !(n.bytes_per_ms > 0.0) {
            return Err(ProfileError(
                "network: rtt_ms must be ≥ 0 and bytes_per_ms > 0".into(),
            ));
        }
        if !(self.overhead_ms.is_finite() && self.overhead_ms >= 0.0) {
            return Err(ProfileError("overhead_ms must be ≥ 0".into()));
        }
        if !(self.step_extra_ms.is_finite() && self.step_extra_ms >= 0.0) {
            return Err(ProfileError("step_extra_ms must be ≥ 0".into()));
        }
        if !(self.drafted_scale.is_finite() && self.drafted_scale > 0.0) {
            return Err(ProfileError("drafted_scale must be > 0".into()));
        }
        let l = &self.lookup;
        if !(l.tokens.is_finite() && l.tokens >= 0.0 && l.ms.is_finite() && l.ms >= 0.0) {
            return Err(ProfileError("lookup: tokens and ms must be ≥ 0".into()));
        }
        Ok(())
    }
}

/// Bytes on the wire for one step: the tree (parent + token per node), the sparse q of each
/// expanded node (token + probability per entry), the verdict, and framing.
pub fn step_bytes(tree: &Tree, q_entries: usize) -> f64 {
    let expanded = tree.expanded_nodes().count();
    (tree.len() * 8 + expanded * q_entries * 8 + 64 + 48) as f64
}

/// Predicted cost and benefit of one tree.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    pub nodes: usize,
    pub levels: usize,
    pub expected_tokens: f64,
    pub draft_ms: f64,
    pub network_ms: f64,
    pub verify_ms: f64,
    pub overhead_ms: f64,
    pub step_ms: f64,
    pub speedup: f64,
    /// Of `expected_tokens` and of every step time: what lookup branches add on average
    /// ([`Profile::lookup`]); 0 for the root alone.
    #[serde(skip_serializing_if = "is_zero")]
    pub lookup_tokens: f64,
    #[serde(skip_serializing_if = "is_zero")]
    pub lookup_ms: f64,
    pub parents: Vec<i32>,
    /// Pipelined drafting: the hit probability the step time assumed (None = not pipelined).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_hit: Option<f64>,
    /// Pipelined drafting: the time of a step whose tree was grown ahead (a hit), the longer
    /// of the next tree's draft and this tree's round trip. `step_ms` is the expectation over
    /// hits and misses.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hit_step_ms: Option<f64>,
    /// The verification the tree costs when it is drafted only after the verdict before it
    /// (every step without pipelining, a miss with it): `verify_ms`, or less on a node that
    /// decodes while waiting ([`waited_verify_ms`]). Such a step costs `draft_ms + network_ms +
    /// arrival_verify_ms + overhead_ms`.
    pub arrival_verify_ms: f64,
}

fn one() -> f64 {
    1.0
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl Prediction {
    /// The step when the tree is drafted only after the verdict before it (every step without
    /// pipelining, a miss with it): nothing overlaps, and the node verifies it at
    /// [`arrival_verify_ms`](Self::arrival_verify_ms).
    pub fn after_verdict_step_ms(&self) -> f64 {
        self.draft_ms + self.network_ms + self.arrival_verify_ms + self.overhead_ms
    }
}

/// Prior hit probability of pipelined drafting before a generation has verified a step.
pub const PIPELINE_HIT_PRIOR: f64 = 0.5;

/// Estimated probability that the verdict is one of the speculated candidates: the
/// generation's running hit rate, or [`PIPELINE_HIT_PRIOR`] before its first counted step.
pub fn pipeline_hit_rate(hits: u32, misses: u32) -> f64 {
    match hits as u64 + misses as u64 {
        0 => PIPELINE_HIT_PRIOR,
        n => hits as f64 / n as f64,
    }
}

/// Step time with pipelined drafting.
///
/// `round_trip_ms` is everything between sending a tree and having its verdict (RTT, bytes on
/// the wire, t_v(n), overhead); `draft_ms` the time to draft a tree after a verdict and
/// `draft_next_ms` the time to draft the next one ahead, during the round trip. On a hit the
/// next tree is ready once both are done, so the step costs the longer of the two; on a miss
/// the speculation is wasted and the draft starts after the verdict, as without pipelining:
///
/// ```text
/// step = hit · max(t_draft_next, round_trip) + (1 − hit) · (round_trip + t_draft)
/// ```
pub fn pipelined_step_ms(hit: f64, draft_next_ms: f64, round_trip_ms: f64, draft_ms: f64) -> f64 {
    expected_step_ms(
        hit,
        hit_step_ms(draft_next_ms, round_trip_ms),
        round_trip_ms + draft_ms,
    )
}

/// A hit step's time when its tree is sent only after the verdict: the next tree is ready once
/// both its growth and the round trip are done.
fn hit_step_ms(draft_next_ms: f64, round_trip_ms: f64) -> f64 {
    draft_next_ms.max(round_trip_ms)
}

/// The step time expected at hit probability `hit` (clamped as [`hit_probability`] does) from
/// the time of a hit step and of a miss step.
fn expected_step_ms(hit: f64, hit_ms: f64, miss_ms: f64) -> f64 {
    let hit = hit_probability(hit);
    hit * hit_ms + (1.0 - hit) * miss_ms
}

/// A hit step's time when the next tree goes to the verify node as soon as it is grown, ahead
/// of the verdict it assumes, and the node verifies it right after that verdict.
///
/// Over a run of such steps the node starts each tree when the previous verdict is out, if the
/// tree has arrived: then a step is one verification, `round_trip − network`. The growth of the
/// tree after next starts only when that verdict reaches the draft, and it arrives after the
/// growth and the network; when that is the longer path, consecutive steps share it and settle
/// at `(draft + round_trip) / 2`. A growth that outlasts the round trip is not sent ahead (the
/// verdict comes first), so the step is the growth, as without sending ahead:
///
/// ```text
/// t_hit = max(round_trip − network, (draft + round_trip) / 2)   if draft < round_trip
///       = draft                                                   otherwise
/// ```
///
/// Never longer than `hit_step_ms`, the hit step without sending ahead.
pub fn sent_ahead_hit_ms(draft_next_ms: f64, round_trip_ms: f64, network_ms: f64) -> f64 {
    if draft_next_ms < round_trip_ms {
        (round_trip_ms - network_ms).max(0.5 * (draft_next_ms + round_trip_ms))
    } else {
        draft_next_ms
    }
}

/// A hit probability as the step model uses it: within 0..=1, [`PIPELINE_HIT_PRIOR`] if not
/// a number.
fn hit_probability(hit: f64) -> f64 {
    if hit.is_finite() {
        hit.clamp(0.0, 1.0)
    } else {
        PIPELINE_HIT_PRIOR
    }
}

/// The verification a tree costs when it reaches the verify node `gap_ms` after the verdict
/// before it (`verify_ms` = t_v(n) of the whole tree), under acceptance `p`.
///
/// A node that decodes while waiting ([`Profile::decodes_while_waiting`]) forwards the
/// verdict's next token, the tree's root, during the gap, when the gap is longer than half a
/// verification (its rule for starting). On arrival the rule decides at the root from that
/// forward: the root's child of rank `r` is accepted with probability `p[r]`, and only its
/// subtree is forwarded; with no child accepted, no forward. A tree that comes before the
/// root's forward ends waits for the rest of it, or has its own forward where that is cheaper
/// (the node stops the root's forward then):
///
/// ```text
/// t = min(t_v(n), max(t_v(1) − gap, 0) + Σ_r p[r] · t_v(|subtree(child r)|))
/// ```
pub fn waited_verify_ms(
    profile: &Profile,
    p: &[f64],
    tree: &Tree,
    gap_ms: f64,
    verify_ms: f64,
) -> f64 {
    if !profile.decodes_while_waiting || !(gap_ms > 0.5 * verify_ms) {
        return verify_ms;
    }
    // Subtree sizes: every node comes after its parent, so one backward pass sums them.
    let mut size = vec![1usize; tree.len()];
    for v in (1..tree.len()).rev() {
        if let Some(u) = tree.parent(v) {
            size[u] += size[v];
        }
    }
    let below: f64 = tree
        .children(0)
        .iter()
        .enumerate()
        .map(|(r, &c)| p.get(r).copied().unwrap_or(0.0) * profile.verify.at(size[c as usize]))
        .sum();
    let rest_of_root = (profile.verify.at(1) - gap_ms).max(0.0);
    (rest_of_root + below).min(verify_ms)
}

/// Draft time of growing `tree` from a root the draft has already run: one forward per level
/// that has children, over that level's nodes (the last level is sampled, not forwarded).
pub fn tree_draft_ms(draft: &CostCurve, tree: &Tree) -> f64 {
    levels_draft_ms(draft, tree, 1)
}

/// One draft forward per level of `tree` that has children, over `copies` times its nodes.
fn levels_draft_ms(draft: &CostCurve, tree: &Tree, copies: usize) -> f64 {
    let widths = tree.widths();
    widths[..widths.len().saturating_sub(1)]
        .iter()
        .map(|&w| draft.at(copies * w))
        .sum()
}

/// Draft time of growing `tree` ahead for `candidates` verdicts at once (§10): one forward over
/// the candidates' copies of their end nodes (whose logits guess the next root), then one per
/// level that has children over every candidate's nodes of that level.
pub fn ahead_draft_ms(draft: &CostCurve, tree: &Tree, candidates: usize) -> f64 {
    let c = candidates.max(1);
    draft.at(c) + levels_draft_ms(draft, tree, c)
}

/// Predict the step of `tree` under acceptance `p`, sending `q_entries` q entries per node
/// (0 at temperature 0).
pub fn predict(profile: &Profile, p: &[f64], tree: &Tree, q_entries: usize) -> Prediction {
    predict_pipelined(profile, p, tree, q_entries, None)
}

/// [`predict`], with pipelined drafting at hit probability `pipeline_hit` when it is Some: the
/// next tree (the same shape in steady state) is drafted ahead during the round trip.
pub fn predict_pipelined(
    profile: &Profile,
    p: &[f64],
    tree: &Tree,
    q_entries: usize,
    pipeline_hit: Option<f64>,
) -> Prediction {
    // Lookup branches are grafted onto trees that grow a draft; the root alone is the decode
    // fallback's business.
    let lookup = if tree.len() > 1 {
        profile.lookup
    } else {
        LookupGain::default()
    };
    // The bonus (or correction) token always comes; the drafted part is scaled by what the
    // acceptance model was seen to miss.
    let g = 1.0 + profile.drafted_scale * (expected_tokens(tree, p) - 1.0) + lookup.tokens;
    let levels = tree.levels();
    let mut draft_ms = tree_draft_ms(&profile.draft, tree);
    if levels > 1 {
        // The chance the accepted path ends on the last level, whose tokens the draft has not run.
        let mut f = vec![0.0f64; tree.len()];
        f[0] = 1.0;
        for v in 0..tree.len() {
            for (r, &c) in tree.children(v).iter().enumerate() {
                f[c as usize] = f[v] * p.get(r).copied().unwrap_or(0.0);
            }
        }
        let last: f64 = tree.level_range(levels - 1).map(|v| f[v]).sum();
        draft_ms += last * profile.draft.at(1);
    }
    let (network_ms, verify_ms) = (
        profile.network.rtt_ms + step_bytes(tree, q_entries) / profile.network.bytes_per_ms,
        profile.verify.at(tree.len()),
    );
    let round_trip = network_ms + verify_ms + profile.overhead_ms;
    // The root alone drafts nothing, so there is nothing to overlap.
    let pipeline_hit = pipeline_hit.filter(|_| tree.len() > 1);
    // The next tree, grown ahead during the round trip (a hit's).
    let ahead_ms = match profile.ahead_candidates {
        0 => draft_ms,
        c => ahead_draft_ms(&profile.draft, tree, c),
    };
    let hit_ms = if profile.sends_ahead {
        sent_ahead_hit_ms(ahead_ms, round_trip, network_ms)
    } else {
        hit_step_ms(ahead_ms, round_trip)
    };
    // Drafted after its verdict, the tree reaches the node a draft and a network trip later.
    let arrival_verify_ms = waited_verify_ms(profile, p, tree, draft_ms + network_ms, verify_ms);
    let after_verdict_ms = draft_ms + network_ms + arrival_verify_ms + profile.overhead_ms;
    let extra_ms = profile.step_extra_ms + lookup.ms;
    let step_ms = extra_ms
        + match pipeline_hit {
            Some(hit) => expected_step_ms(hit, hit_ms, after_verdict_ms),
            None => after_verdict_ms,
        };
    Prediction {
        nodes: tree.len(),
        levels,
        expected_tokens: g,
        draft_ms,
        network_ms,
        verify_ms,
        overhead_ms: profile.overhead_ms + extra_ms,
        step_ms,
        speedup: g * profile.verify.at(1) / step_ms,
        lookup_tokens: lookup.tokens,
        lookup_ms: lookup.ms,
        parents: tree.parents().to_vec(),
        pipeline_hit,
        hit_step_ms: pipeline_hit.map(|_| extra_ms + hit_ms),
        arrival_verify_ms,
    }
}

/// The planner's choice and what it beat.
#[derive(Debug, Clone, Serialize)]
pub struct AutoPlan {
    pub best: Prediction,
    /// False when no tree beats plain decoding through the pair: the plan is the root alone.
    pub speculate: bool,
    /// Best prediction for each node budget tried (the curve behind the choice).
    pub by_size: Vec<Prediction>,
    /// Pipelined drafting: the tree to send when no tree was grown ahead for the verdict (a
    /// miss, or a generation's first step), priced without overlap (its `step_ms` is the
    /// miss step's time). `best`'s `step_ms` and `expected_tokens` then average the hit
    /// step (`best`'s tree) and the miss step (this tree). None without pipelining or
    /// speculation.
    pub miss: Option<Prediction>,
}

/// Search sizes 1..=`max_nodes` and depths 1..=`max_levels` for the highest predicted speedup.
pub fn choose(
    profile: &Profile,
    p: &[f64],
    max_nodes: usize,
    max_levels: usize,
    q_entries: usize,
) -> Result<AutoPlan, PlanError> {
    choose_pipelined(profile, p, max_nodes, max_levels, q_entries, None, None)
}

/// [`choose`] for a generation that drafts pipelined with hit probability `pipeline_hit`
/// (None = not pipelined), with `plain` (the decode fallback) in the root alone's place when it
/// is Some, so the trees are weighed against how plain decoding will actually be served. The
/// root alone costs the same pipelined or not, so the rule that no tree predicted slower than
/// plain decoding is chosen holds here too.
pub fn choose_pipelined(
    profile: &Profile,
    p: &[f64],
    max_nodes: usize,
    max_levels: usize,
    q_entries: usize,
    pipeline_hit: Option<f64>,
    plain: Option<Prediction>,
) -> Result<AutoPlan, PlanError> {
    validate_acceptance(p)?;
    let max_nodes = max_nodes.clamp(1, crate::limits::MAX_PLANNED_NODES);
    let max_levels = max_levels.clamp(1, crate::limits::MAX_TREE_LEVELS);
    let dp = SequoiaDp::solve(p, max_nodes, max_levels)?;
    let mut by_size = best_by_size(
        profile,
        p,
        &dp,
        max_nodes,
        max_levels,
        q_entries,
        pipeline_hit,
    );
    if let (Some(plain), Some(root)) = (plain, by_size.iter_mut().find(|b| b.nodes == 1)) {
        *root = plain;
    }
    let mut best = by_size
        .iter()
        .max_by(|a, b| a.speedup.total_cmp(&b.speedup))
        .cloned()
        .expect("at least one size");
    let mut miss = None;
    if let (Some(hit), true) = (pipeline_hit, best.nodes > 1) {
        let plain = best_by_size(profile, p, &dp, max_nodes, max_levels, q_entries, None);
        if let Some((h, m)) = with_miss_tree(profile, hit, &by_size, &plain) {
            best = h;
            miss = Some(m);
        }
    }
    // The root alone is plain decoding through the pair; it wins whenever no tree pays for
    // itself (its predicted speedup is below 1 by exactly the network and overhead it adds).
    let speculate = best.nodes > 1;
    Ok(AutoPlan {
        best,
        speculate,
        by_size,
        miss,
    })
}

/// For each node budget 1..=`max_nodes`, the depth with the highest predicted speedup (for
/// n > 1 among the trees that speculate).
fn best_by_size(
    profile: &Profile,
    p: &[f64],
    dp: &SequoiaDp,
    max_nodes: usize,
    max_levels: usize,
    q_entries: usize,
    pipeline_hit: Option<f64>,
) -> Vec<Prediction> {
    let mut by_size: Vec<Prediction> = Vec::with_capacity(max_nodes);
    for n in 1..=max_nodes {
        let mut best_here: Option<Prediction> = None;
        let mut last_len = 0;
        // For n > 1 the curve shows the best *speculating* tree of that budget.
        for l in (if n > 1 { 2 } else { 1 })..=max_levels.min(n) {
            let tree = dp.tree(n, l);
            if tree.len() == last_len && l > 1 && tree.levels() < l {
                continue; // deeper limit changed nothing
            }
            last_len = tree.len();
            let pr = predict_pipelined(profile, p, &tree, q_entries, pipeline_hit);
            if best_here.as_ref().is_none_or(|b| pr.speedup > b.speedup) {
                best_here = Some(pr);
            }
        }
        if let Some(b) = best_here {
            by_size.push(b);
        }
    }
    by_size
}

/// Pipelined drafting sends two kinds of trees: after a hit, the tree grown ahead during the
/// last round trip (its draft time hidden); after a miss, one drafted from scratch while the
/// verify node waits. A large tree pays on hits and costs most on misses, so the two are
/// sized apart (docs/ALGORITHMS.md §10): over every pair (hit tree H from `pipelined`, miss
/// tree M from `plain`, each the best of its size) the pair with the highest expected rate
///
/// ```text
/// (hit · g(H) + (1 − hit) · g(M)) / (hit · t_hit(H) + (1 − hit) · t_miss(M))
/// ```
///
/// with `t_hit(H)` the longer of H's draft and its round trip and `t_miss(M)` M's step after
/// its verdict (its draft, the network, [`Prediction::arrival_verify_ms`] and the overhead: on a
/// node that decodes while waiting only what M costs on arrival). Returns H's prediction with that
/// expected step time, tokens and speedup, and M's own; None when the hit tree would be the
/// root alone. Taking M = H recovers the plan without a separate miss tree, so the result is
/// never predicted slower than it.
fn with_miss_tree(
    profile: &Profile,
    hit: f64,
    pipelined: &[Prediction],
    plain: &[Prediction],
) -> Option<(Prediction, Prediction)> {
    let hit = hit_probability(hit);
    let t1 = profile.verify.at(1);
    let mut best: Option<(f64, &Prediction, Prediction)> = None;
    for h in pipelined.iter().filter(|h| h.nodes > 1) {
        let t_hit = h.hit_step_ms?;
        // H itself after a miss: drafted after the verdict, nothing overlapped.
        let step_ms = h.after_verdict_step_ms();
        let same = Prediction {
            step_ms,
            speedup: h.expected_tokens * t1 / step_ms,
            pipeline_hit: None,
            hit_step_ms: None,
            ..h.clone()
        };
        // The root alone as the miss tree would never pipeline again (it drafts nothing to
        // grow the next tree from), so misses send trees.
        for m in plain.iter().filter(|m| m.nodes > 1).chain([&same]) {
            let tokens = hit * h.expected_tokens + (1.0 - hit) * m.expected_tokens;
            let ms = hit * t_hit + (1.0 - hit) * m.step_ms;
            let rate = tokens / ms;
            if rate.is_finite() && best.as_ref().is_none_or(|(r, _, _)| rate > *r) {
                best = Some((rate, h, m.clone()));
            }
        }
    }
    let (rate, h, m) = best?;
    let mut blended = h.clone();
    blended.expected_tokens = hit * h.expected_tokens + (1.0 - hit) * m.expected_tokens;
    blended.step_ms = blended.expected_tokens / rate;
    blended.speedup = rate * t1;
    Some((blended, m))
}

/// The decode fallback (docs/ALGORITHMS.md §5.5): when no tree pays, the verify node decodes
/// K tokens on its own per round trip. Tokens per decode that keep the round trip's share of
/// a decode's time at or below `rtt_share`: the smallest K with
/// `rtt / (K · t_v(1) + rtt) ≤ rtt_share`, `rtt` being everything a message costs besides the
/// target (network, bytes, overhead), bounded by 1..=`max_tokens`.
pub fn decode_tokens(profile: &Profile, max_tokens: usize, rtt_share: f64) -> usize {
    let max_tokens = max_tokens.max(1);
    let t1 = profile.verify.at(1);
    let rtt = decode_message_ms(profile);
    if !(rtt_share > 0.0 && rtt_share < 1.0) || !(t1 > 0.0) {
        return max_tokens;
    }
    let k = (rtt * (1.0 - rtt_share) / (rtt_share * t1)).ceil();
    if k.is_finite() && k >= 1.0 {
        (k as usize).min(max_tokens)
    } else {
        1
    }
}

/// What one decode costs besides the target's forwards: the round trip, the request and the
/// tokens on the wire, and the per-message overhead.
fn decode_message_ms(profile: &Profile) -> f64 {
    // Request (step, root, counts) and K token ids back, with framing: ~ one tree of one node.
    profile.network.rtt_ms
        + step_bytes(&Tree::chain(1), 0) / profile.network.bytes_per_ms
        + profile.overhead_ms
}

/// Predict the decode fallback with `k` tokens per decode: one "step" is the whole decode,
/// `k · t_v(1)` of target time plus one round trip, committing k tokens, so its speedup over the
/// target alone is `k · t_v(1) / (k · t_v(1) + rtt)`, just under 1.
pub fn predict_decode(profile: &Profile, k: usize) -> Prediction {
    let k = k.max(1);
    let t1 = profile.verify.at(1);
    let verify_ms = k as f64 * t1;
    let network_ms = decode_message_ms(profile) - profile.overhead_ms;
    let step_ms = verify_ms + network_ms + profile.overhead_ms;
    Prediction {
        nodes: 1,
        levels: 1,
        expected_tokens: k as f64,
        draft_ms: 0.0,
        network_ms,
        verify_ms,
        overhead_ms: profile.overhead_ms,
        step_ms,
        speedup: verify_ms / step_ms,
        lookup_tokens: 0.0,
        lookup_ms: 0.0,
        parents: vec![-1],
        pipeline_hit: None,
        hit_step_ms: None,
        arrival_verify_ms: verify_ms,
    }
}

/// Past this many sessions per batch (smoothed, from the verdicts), a tree must be predicted
/// [`LOAD_MARGIN`] faster than plain decoding to be chosen. Under load the forward is near
/// the point where every row costs its full share, the loaded prices of a tree and of plain
/// decoding come within a few percent of each other, and which one wins is the cost curve's
/// noise; the rows a tree adds also slow the prompts of sessions still being prefilled, which
/// the price does not count. (At 16 sessions on a 2-core Xeon, `sequoia bench capacity`:
/// 2-node trees at a predicted tie ran at 0.56× plain decoding; BENCHMARKS.md, session 21.)
pub const LOADED_SESSIONS: f64 = 1.5;

/// The predicted gain over plain decoding a tree needs under load (see [`LOADED_SESSIONS`]).
pub const LOAD_MARGIN: f64 = 0.1;

/// Whether a tree predicted at `tree_speedup` may be chosen over plain decoding predicted at
/// `plain_speedup` (both at the loaded prices) on a node batching `load_sessions` sessions:
/// by any gain alone, by [`LOAD_MARGIN`] under load.
pub fn tree_pays_under_load(load_sessions: f64, tree_speedup: f64, plain_speedup: f64) -> bool {
    if load_sessions > LOADED_SESSIONS {
        tree_speedup >= (1.0 + LOAD_MARGIN) * plain_speedup
    } else {
        tree_speedup > plain_speedup
    }
}

impl AutoPlan {
    /// This plan on a node batching `load_sessions` sessions: under load a tree that does not
    /// beat no speculation (`by_size`'s root entry) by [`LOAD_MARGIN`] gives way to it.
    pub fn with_load_margin(mut self, load_sessions: f64) -> Self {
        let root = self.by_size.iter().find(|b| b.nodes == 1).cloned();
        if let (true, Some(root)) = (self.speculate, root) {
            if !tree_pays_under_load(load_sessions, self.best.speedup, root.speedup) {
                self.best = root;
                self.speculate = false;
                self.miss = None;
            }
        }
        self
    }
}

/// [`choose_pipelined`] where "no speculation" means the decode fallback with `decode` tokens
/// per decode (None: root-only trees, one round trip per token, e.g. on a verify node too old
/// for it). A tree is chosen only when it is predicted faster than that fallback; the
/// fallback itself is the target alone but for one round trip per `decode` tokens.
pub fn choose_with_fallback(
    profile: &Profile,
    p: &[f64],
    max_nodes: usize,
    max_levels: usize,
    q_entries: usize,
    pipeline_hit: Option<f64>,
    decode: Option<usize>,
) -> Result<AutoPlan, PlanError> {
    let fallback = decode.map(|k| predict_decode(profile, k));
    let mut plan = choose_pipelined(
        profile,
        p,
        max_nodes,
        max_levels,
        q_entries,
        pipeline_hit,
        fallback.clone(),
    )?;
    let Some(fallback) = fallback else {
        return Ok(plan);
    };
    if plan.best.nodes == 1 || fallback.speedup >= plan.best.speedup {
        plan.best = fallback;
        plan.speculate = false;
        plan.miss = None;
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::EXAMPLE_ACCEPTANCE;

    #[test]
    fn under_load_a_tree_needs_the_margin() {
        // Alone, any predicted gain; under load, 10 %.
        assert!(tree_pays_under_load(1.0, 1.05, 1.0));
        assert!(!tree_pays_under_load(1.0, 1.0, 1.0));
        assert!(!tree_pays_under_load(8.0, 1.05, 1.0));
        assert!(!tree_pays_under_load(8.0, 1.09, 1.0));
        assert!(tree_pays_under_load(8.0, 1.1, 1.0));
        assert!(
            tree_pays_under_load(1.5, 1.05, 1.0),
            "1.5 sessions is not yet load"
        );
    }

    #[test]
    fn a_plan_under_load_gives_way_to_plain_decoding_within_the_margin() {
        // A tree 5 % better than the root: kept alone, dropped at 8 sessions.
        let pred = |nodes: usize, speedup: f64| Prediction {
            nodes,
            speedup,
            ..predict_decode(&profile(|_| 20.0, 1.0, 1.0), 1)
        };
        let plan = AutoPlan {
            best: pred(4, 1.05),
            speculate: true,
            by_size: vec![pred(1, 1.0), pred(4, 1.05)],
            miss: Some(pred(2, 1.0)),
        };
        let alone = plan.clone().with_load_margin(1.0);
        assert!(alone.speculate && alone.best.nodes == 4 && alone.miss.is_some());
        let loaded = plan.clone().with_load_margin(8.0);
        assert!(!loaded.speculate && loaded.best.nodes == 1 && loaded.miss.is_none());
        // A clear gain survives the load.
        let clear = AutoPlan {
            best: pred(4, 1.3),
            ..plan
        };
        assert_eq!(clear.with_load_margin(8.0).best.nodes, 4);
    }

    fn profile(verify: impl Fn(f64) -> f64, draft_per_token: f64, rtt: f64) -> Profile {
        profile_with(verify, |w| draft_per_token * (0.8 + 0.2 * w), rtt)
    }

    fn profile_with(verify: impl Fn(f64) -> f64, draft: impl Fn(f64) -> f64, rtt: f64) -> Profile {
        let sizes: Vec<u32> = vec![1, 2, 4, 8, 16, 32, 64, 128];
        Profile {
            verify: CostCurve::new(
                sizes.clone(),
                sizes.iter().map(|&n| verify(n as f64)).collect(),
            )
            .unwrap(),
            draft: CostCurve::new(
                sizes.clone(),
                sizes.iter().map(|&n| draft(n as f64)).collect(),
            )
            .unwrap(),
            network: NetworkProfile {
                rtt_ms: rtt,
                bytes_per_ms: 125_000.0,
            },
            overhead_ms: 0.5,
            step_extra_ms: 0.0,
            sends_ahead: false,
            ahead_candidates: 0,
            decodes_while_waiting: false,
            lookup: LookupGain::default(),
            drafted_scale: 1.0,
            context: 256,
            note: String::new(),
        }
    }

    /// A profile's lookup gain adds its tokens and its time to every tree that grows a draft,
    /// pipelined or not, and nothing to the root alone.
    #[test]
    fn lookup_gain_adds_to_trees_and_not_to_the_root() {
        let plain = profile(|n| 20.0 + 3.0 * n, 2.0, 5.0);
        let with = Profile {
            lookup: LookupGain {
                tokens: 0.4,
                ms: 3.0,
            },
            ..plain.clone()
        };
        let p = [0.7, 0.1];
        for hit in [None, Some(0.5)] {
            let tree = Tree::from_parents(&[-1, 0, 0, 1]).unwrap();
            let (a, b) = (
                predict_pipelined(&plain, &p, &tree, 0, hit),
                predict_pipelined(&with, &p, &tree, 0, hit),
            );
            assert!((b.expected_tokens - a.expected_tokens - 0.4).abs() < 1e-12);
            assert!((b.step_ms - a.step_ms - 3.0).abs() < 1e-12);
            assert_eq!((b.lookup_tokens, b.lookup_ms), (0.4, 3.0));
            if let (Some(x), Some(y)) = (a.hit_step_ms, b.hit_step_ms) {
                assert!((y - x - 3.0).abs() < 1e-12);
            }
            let root = Tree::chain(1);
            let (a, b) = (
                predict_pipelined(&plain, &p, &root, 0, hit),
                predict_pipelined(&with, &p, &root, 0, hit),
            );
            assert_eq!(
                (a.expected_tokens, a.step_ms),
                (b.expected_tokens, b.step_ms)
            );
            assert_eq!(b.lookup_tokens, 0.0);
        }
        let bad = Profile {
            lookup: LookupGain {
                tokens: -1.0,
                ms: 0.0,
            },
            ..plain.clone()
        };
        assert!(bad.validate().is_err());
        // The drafted-token scale multiplies G − 1, not the bonus token.
        let tree = Tree::from_parents(&[-1, 0, 0, 1]).unwrap();
        let scaled = Profile {
            drafted_scale: 1.5,
            ..plain.clone()
        };
        let (a, b) = (
            predict(&plain, &p, &tree, 0),
            predict(&scaled, &p, &tree, 0),
        );
        assert!((b.expected_tokens - 1.0 - 1.5 * (a.expected_tokens - 1.0)).abs() < 1e-12);
        assert_eq!(a.step_ms, b.step_ms);
        let zero = Profile {
            drafted_scale: 0.0,
            ..plain
        };
        assert!(zero.validate().is_err());
    }

    #[test]
    fn flat_verify_cost_picks_large_trees_steep_picks_small() {
        let p = EXAMPLE_ACCEPTANCE;
        // GPU-like: verifying 128 tokens costs 1.3× one token; a tiny draft, also flat.
        let gpu = choose(
            &profile_with(|n| 20.0 * (1.0 + 0.0025 * n), |w| 0.3 + 0.002 * w, 0.0),
            &p,
            128,
            12,
            0,
        )
        .unwrap();
        // CPU-like: t(n) grows almost linearly (t(16) ≈ 5 t(1)).
        let cpu = choose(
            &profile(|n| 60.0 * (0.75 + 0.27 * n), 0.5, 0.0),
            &p,
            128,
            12,
            0,
        )
        .unwrap();
        assert!(gpu.speculate && cpu.speculate);
        assert!(gpu.best.nodes >= 32, "gpu picked {}", gpu.best.nodes);
        assert!(cpu.best.nodes <= 8, "cpu picked {}", cpu.best.nodes);
        assert!(gpu.best.speedup > cpu.best.speedup);
    }

    #[test]
    fn network_latency_grows_the_tree() {
        let p = EXAMPLE_ACCEPTANCE;
        let curve = |n: f64| 20.0 * (1.0 + 0.02 * n);
        let near = choose(&profile(curve, 0.5, 0.0), &p, 128, 12, 0).unwrap();
        let far = choose(&profile(curve, 0.5, 50.0), &p, 128, 12, 0).unwrap();
        assert!(far.speculate && near.speculate);
        assert!(
            far.best.nodes > near.best.nodes,
            "{} vs {}",
            far.best.nodes,
            near.best.nodes
        );
        assert!(far.best.expected_tokens > near.best.expected_tokens);
    }

    #[test]
    fn a_draft_as_slow_as_the_target_turns_speculation_off() {
        let p = EXAMPLE_ACCEPTANCE;
        let plan = choose(&profile(|n| 20.0 * n, 20.0, 1.0), &p, 64, 8, 0).unwrap();
        assert!(!plan.speculate);
        assert_eq!(plan.best.nodes, 1);
        assert!(plan.best.speedup < 1.0);
    }

    #[test]
    fn prediction_adds_up() {
        let prof = profile(|n| 10.0 * n, 2.0, 3.0);
        let tree = Tree::from_parents(&[-1, 0, 0, 1]).unwrap();
        let pr = predict(&prof, &[0.5, 0.2], &tree, 4);
        // levels: widths [1, 2, 1]; draft = t_d(1) + t_d(2) + P(reach node 3) · t_d(1)
        let td = |w: f64| 2.0 * (0.8 + 0.2 * w);
        let expect_draft = td(1.0) + td(2.0) + 0.25 * td(1.0);
        assert!((pr.draft_ms - expect_draft).abs() < 1e-9);
        assert!((pr.expected_tokens - (1.0 + 0.5 + 0.2 + 0.25)).abs() < 1e-12);
        assert!((pr.step_ms - (pr.draft_ms + pr.network_ms + pr.verify_ms + 0.5)).abs() < 1e-9);
        assert!((pr.speedup - pr.expected_tokens * 10.0 / pr.step_ms).abs() < 1e-12);
    }

    #[test]
    fn pipelined_step_is_the_max_on_hits_and_the_sum_on_misses() {
        // hit = 1: the draft ahead hides behind the round trip, or the other way round.
        assert_eq!(pipelined_step_ms(1.0, 3.0, 10.0, 3.0), 10.0);
        assert_eq!(pipelined_step_ms(1.0, 12.0, 10.0, 3.0), 12.0);
        // hit = 0: the speculation is wasted, the step is what it is without pipelining.
        assert_eq!(pipelined_step_ms(0.0, 3.0, 10.0, 4.0), 14.0);
        // In between: the mix.
        let mid = pipelined_step_ms(0.25, 3.0, 10.0, 3.0);
        assert!((mid - (0.25 * 10.0 + 0.75 * 13.0)).abs() < 1e-12);
        // Out-of-range estimates are clamped; NaN falls back to the prior.
        assert_eq!(pipelined_step_ms(2.0, 3.0, 10.0, 3.0), 10.0);
        assert_eq!(pipelined_step_ms(-1.0, 3.0, 10.0, 3.0), 13.0);
        assert_eq!(pipelined_step_ms(f64::NAN, 3.0, 10.0, 3.0), 11.5);
    }

    #[test]
    fn trees_sent_ahead_take_the_round_trip_off_hit_steps() {
        // A quick growth: the step is the verification alone (round trip 100 = 90 + network 10).
        assert_eq!(sent_ahead_hit_ms(20.0, 100.0, 10.0), 90.0);
        // A growth that, with the network, outlasts the verification: shared over two steps.
        assert_eq!(sent_ahead_hit_ms(95.0, 100.0, 10.0), 97.5);
        // A growth longer than the round trip is not sent ahead: the growth, as before.
        assert_eq!(sent_ahead_hit_ms(120.0, 100.0, 10.0), 120.0);
        // Never longer than the hit step without sending ahead, continuous where they meet.
        for draft in [0.0, 30.0, 80.0, 99.9, 100.0, 150.0] {
            let t = sent_ahead_hit_ms(draft, 100.0, 10.0);
            assert!(t <= f64::max(draft, 100.0) + 1e-9, "draft {draft}");
        }
        assert!((sent_ahead_hit_ms(99.999, 100.0, 10.0) - 100.0).abs() < 1e-2);
        // In the prediction: the hit step and the expected step use it, misses are unchanged.
        let mut prof = profile(|n| 60.0 + 10.0 * n, 5.0, 20.0);
        let tree = Tree::from_parents(&[-1, 0, 1]).unwrap();
        let before = predict_pipelined(&prof, &[0.7, 0.2], &tree, 0, Some(0.5));
        prof.sends_ahead = true;
        let after = predict_pipelined(&prof, &[0.7, 0.2], &tree, 0, Some(0.5));
        let round_trip = after.network_ms + after.verify_ms + 0.5;
        let hit_ms = sent_ahead_hit_ms(after.draft_ms, round_trip, after.network_ms);
        assert!((after.hit_step_ms.unwrap() - hit_ms).abs() < 1e-9);
        let want = 0.5 * hit_ms + 0.5 * (round_trip + after.draft_ms);
        assert!((after.step_ms - want).abs() < 1e-9);
        assert!(after.step_ms < before.step_ms - 5.0);
        // Growing ahead for two verdicts: a forward over both copies, then one per level over
        // both candidates' nodes, and the hit step is priced with that.
        let chain = Tree::chain(3);
        let grown = ahead_draft_ms(&prof.draft, &chain, 2);
        let d = |w: usize| prof.draft.at(w);
        assert!((grown - (d(2) + d(2) + d(2))).abs() < 1e-9);
        prof.ahead_candidates = 2;
        let wide = predict_pipelined(&prof, &[0.7, 0.2], &chain, 0, Some(1.0));
        let round_trip = wide.network_ms + wide.verify_ms + 0.5;
        let want = sent_ahead_hit_ms(grown, round_trip, wide.network_ms);
        assert!((wide.hit_step_ms.unwrap() - want).abs() < 1e-9);
        assert!(
            (wide.draft_ms - tree_draft_ms(&prof.draft, &chain) - 0.7 * 0.7 * d(1)).abs() < 1e-9
        );
    }

    #[test]
    fn hit_rate_starts_at_the_prior() {
        assert_eq!(pipeline_hit_rate(0, 0), PIPELINE_HIT_PRIOR);
        assert_eq!(pipeline_hit_rate(3, 1), 0.75);
        assert_eq!(pipeline_hit_rate(0, 5), 0.0);
        assert_eq!(pipeline_hit_rate(u32::MAX, u32::MAX), 0.5);
    }

    #[test]
    fn pipelined_prediction_uses_the_formula() {
        let prof = profile(|n| 10.0 * n, 2.0, 3.0);
        let tree = Tree::from_parents(&[-1, 0, 0, 1]).unwrap();
        let plain = predict(&prof, &[0.5, 0.2], &tree, 4);
        assert_eq!(plain.pipeline_hit, None);
        let round_trip = plain.network_ms + plain.verify_ms + plain.overhead_ms;
        for hit in [0.0, 0.3, 1.0] {
            let pr = predict_pipelined(&prof, &[0.5, 0.2], &tree, 4, Some(hit));
            let want =
                hit * plain.draft_ms.max(round_trip) + (1.0 - hit) * (round_trip + plain.draft_ms);
            assert!((pr.step_ms - want).abs() < 1e-9, "hit {hit}");
            assert!(pr.speedup >= plain.speedup - 1e-12);
            assert_eq!(pr.pipeline_hit, Some(hit));
            // The parts are the same; only their overlap differs.
            assert_eq!(
                (pr.draft_ms, pr.verify_ms, pr.network_ms),
                (plain.draft_ms, plain.verify_ms, plain.network_ms)
            );
        }
        // The root alone has nothing to pipeline.
        let root = predict_pipelined(&prof, &[0.5, 0.2], &Tree::chain(1), 4, Some(1.0));
        assert_eq!(
            root.step_ms,
            predict(&prof, &[0.5, 0.2], &Tree::chain(1), 4).step_ms
        );
        assert_eq!(root.pipeline_hit, None);
    }

    #[test]
    fn pipelining_never_predicts_a_lower_speedup() {
        let p = EXAMPLE_ACCEPTANCE;
        for (verify, draft, rtt) in [(20.0, 0.5, 0.0), (20.0, 5.0, 10.0), (60.0, 20.0, 50.0)] {
            let prof = profile(|n| verify * (0.75 + 0.27 * n), draft, rtt);
            let without = choose(&prof, &p, 64, 8, 0).unwrap();
            for hit in [0.0, 0.5, 1.0] {
                let with = choose_pipelined(&prof, &p, 64, 8, 0, Some(hit), None).unwrap();
                assert!(
                    with.best.speedup >= without.best.speedup - 1e-12,
                    "hit {hit}: {} < {}",
                    with.best.speedup,
                    without.best.speedup
                );
            }
        }
        // A draft as slow as the target: even a certain hit does not make speculation pay
        // against plain decoding, and the planner keeps the root alone.
        let slow = profile(|n| 20.0 * n, 20.0, 1.0);
        let plan = choose_pipelined(&slow, &p, 64, 8, 0, Some(0.0), None).unwrap();
        assert!(!plan.speculate && plan.best.speedup < 1.0);
        // With pipelining and a high hit rate, drafting hides behind a long round trip: the
        // speedup grows, and a slow draft can pay where it did not.
        let far = profile(|n| 20.0 * (1.0 + 0.02 * n), 8.0, 40.0);
        let a = choose(&far, &p, 64, 8, 0).unwrap();
        let b = choose_pipelined(&far, &p, 64, 8, 0, Some(1.0), None).unwrap();
        assert!(
            b.best.speedup > a.best.speedup,
            "{} vs {}",
            b.best.speedup,
            a.best.speedup
        );
    }

    /// Pipelined plans price a hit with the planned tree and a miss with a tree of its own;
    /// taking the same tree for both is one of the choices, so the plan is never predicted
    /// slower than one tree for both, and with a costly draft the miss tree is the smaller.
    #[test]
    fn misses_send_a_tree_sized_for_a_step_without_overlap() {
        let p = EXAMPLE_ACCEPTANCE;
        // One core per host: verification grows with the tree, a level of drafting costs
        // a sixth of a decode, RTT 10 ms.
        let prof = profile_with(
            |n| 80.0 * (0.9 + 0.1 * n.powf(0.8)),
            |w| 13.0 + 0.5 * w,
            10.0,
        );
        for hit in [0.2, 0.45, 0.8] {
            let plan = choose_pipelined(&prof, &p, 32, 8, 0, Some(hit), None).unwrap();
            let miss = plan
                .miss
                .as_ref()
                .expect("a pipelined tree plan has a miss tree");
            // One tree for both: the best of `by_size` (pipelined predictions).
            let single = plan
                .by_size
                .iter()
                .map(|b| b.speedup)
                .fold(f64::MIN, f64::max);
            assert!(plan.best.speedup >= single - 1e-12, "hit {hit}");
            assert!(miss.nodes > 1 && miss.pipeline_hit.is_none());
            // The expectation is the mix of the two steps it names.
            let hit_ms = plan.best.hit_step_ms.unwrap();
            let want = hit * hit_ms + (1.0 - hit) * miss.step_ms;
            assert!((plan.best.step_ms - want).abs() < 1e-9 * want, "hit {hit}");
            if hit <= 0.45 {
                assert!(
                    miss.draft_ms < plan.best.draft_ms,
                    "hit {hit}: miss {} nodes / {} levels vs {} / {}",
                    miss.nodes,
                    miss.levels,
                    plan.best.nodes,
                    plan.best.levels
                );
            }
        }
        // Without pipelining there is no second tree.
        assert!(choose(&prof, &p, 32, 8, 0).unwrap().miss.is_none());
    }

    #[test]
    fn decode_fallback_amortizes_the_round_trip() {
        // t_v(1) = 50 ms, RTT 50 ms: one round trip per token would halve the speed.
        let prof = profile(|n| 50.0 * n, 40.0, 50.0);
        let rtt = decode_message_ms(&prof);
        let k = decode_tokens(&prof, 64, 0.1);
        // The smallest K that keeps the round trip at ≤ 10 % of a decode.
        let share = |k: usize| rtt / (k as f64 * 50.0 + rtt);
        assert!(share(k) <= 0.1 + 1e-12, "k {k}: share {}", share(k));
        assert!(share(k - 1) > 0.1, "k {k} is not the smallest");
        assert_eq!(decode_tokens(&prof, 4, 0.1), 4, "bounded by max_tokens");
        assert_eq!(decode_tokens(&profile(|n| 50.0 * n, 40.0, 0.0), 64, 0.1), 1);
        let d = predict_decode(&prof, k);
        assert!((d.step_ms - (k as f64 * 50.0 + rtt)).abs() < 1e-9);
        assert!((d.speedup - k as f64 * 50.0 / d.step_ms).abs() < 1e-12);
        assert!(d.speedup >= 0.9 - 1e-12 && d.speedup < 1.0);
        // No tree pays here (a draft almost as slow as the target): the plan is the decode,
        // priced far above a root-only tree per token.
        let p = EXAMPLE_ACCEPTANCE;
        let plain = choose(&prof, &p, 64, 8, 0).unwrap();
        let with = choose_with_fallback(&prof, &p, 64, 8, 0, None, Some(k)).unwrap();
        assert!(!plain.speculate && !with.speculate);
        assert_eq!(with.best.nodes, 1);
        assert_eq!(with.best.expected_tokens, k as f64);
        assert!(with.best.speedup > 1.5 * plain.best.speedup);
        // Where a tree beats the fallback it is still chosen, and never one predicted slower.
        let near = profile(|n| 20.0 * (1.0 + 0.02 * n), 0.5, 1.0);
        let kn = decode_tokens(&near, 64, 0.1);
        let t = choose_with_fallback(&near, &p, 64, 8, 0, None, Some(kn)).unwrap();
        assert!(t.speculate && t.best.nodes > 1);
        assert!(t.best.speedup > predict_decode(&near, kn).speedup);
        // Without the fallback (an old verify node) nothing changes.
        let none = choose_with_fallback(&prof, &p, 64, 8, 0, None, None).unwrap();
        assert_eq!(none.best.step_ms, plain.best.step_ms);
    }

    #[test]
    fn curves_interpolate_and_reject_bad_input() {
        let c = CostCurve::new(vec![1, 4], vec![10.0, 40.0]).unwrap();
        assert!((c.at(2) - 20.0).abs() < 1e-9);
        assert!((c.at(8) - 80.0).abs() < 1e-9);
        assert!(CostCurve::new(vec![2, 1], vec![1.0, 2.0]).is_err());
        assert!(CostCurve::new(vec![1], vec![f64::NAN]).is_err());
        assert!(CostCurve::new(vec![], vec![]).is_err());
        let json = serde_json::to_string(&profile(|n| n, 1.0, 0.0)).unwrap();
        let back: Profile = serde_json::from_str(&json).unwrap();
        back.validate().unwrap();
    }

    /// A tree that comes well after its verdict costs, on a node that decodes while waiting,
    /// the subtree of the root's accepted child weighted by the acceptance of its rank (nothing
    /// when none is accepted); one that comes before the root's forward ends adds the rest of
    /// that forward, and never costs more than its own forward.
    #[test]
    fn a_tree_that_comes_late_costs_the_subtree_of_the_accepted_child() {
        // Root 0; children 1 (rank 0, with child 3) and 2 (rank 1): subtrees of 2 and 1 nodes.
        let tree = Tree::from_parents(&[-1, 0, 0, 1]).unwrap();
        let p = [0.6, 0.2];
        let mut prof = profile(|n| 40.0 + 10.0 * n, 1.0, 0.0);
        let (t1, t2, t4) = (prof.verify.at(1), prof.verify.at(2), prof.verify.at(4));
        // Off: the whole tree, however late it comes.
        assert_eq!(waited_verify_ms(&prof, &p, &tree, 500.0, t4), t4);
        prof.decodes_while_waiting = true;
        let below = 0.6 * t2 + 0.2 * t1;
        assert!((waited_verify_ms(&prof, &p, &tree, 500.0, t4) - below).abs() < 1e-9);
        // Arriving 20 ms into the root's 50 ms forward: the other 30 first.
        let early = waited_verify_ms(&prof, &p, &tree, 20.0 + 0.5 * t4, t4);
        assert!((early - (t1 - 20.0 - 0.5 * t4).max(0.0) - below).abs() < 1e-9);
        // A gap under half the tree's forward: the node does not start one.
        assert_eq!(waited_verify_ms(&prof, &p, &tree, 0.4 * t4, t4), t4);
        // Certain acceptance of a deep child is never priced above the whole tree.
        let chain = Tree::chain(4);
        let sure = waited_verify_ms(&prof, &[1.0], &chain, 0.6 * t4, t4);
        assert!(sure <= t4 && sure > prof.verify.at(3) - 1e-9, "{sure}");
    }

    /// Steps drafted after their verdict get cheaper on a node that decodes while waiting, at
    /// an RTT long enough for the root's forward to fit in the wait, and nowhere else: the
    /// same tree without pipelining, and the miss side of a pipelined plan.
    #[test]
    fn decoding_while_waiting_shortens_the_steps_drafted_after_a_verdict() {
        let p = EXAMPLE_ACCEPTANCE;
        let tree = SequoiaDp::solve(&p, 8, 4).unwrap().tree(8, 4);
        let mut prof = profile(|n| 80.0 * (0.9 + 0.1 * n), 20.0, 50.0);
        let off = predict(&prof, &p, &tree, 0);
        prof.decodes_while_waiting = true;
        let on = predict(&prof, &p, &tree, 0);
        assert!(
            on.step_ms < off.step_ms - 10.0,
            "{} vs {}",
            on.step_ms,
            off.step_ms
        );
        assert!((on.step_ms - on.after_verdict_step_ms()).abs() < 1e-9);
        assert_eq!(on.expected_tokens, off.expected_tokens);
        let hit = Some(0.5);
        let (off_p, on_p) = (
            predict_pipelined(
                &Profile {
                    decodes_while_waiting: false,
                    ..prof.clone()
                },
                &p,
                &tree,
                0,
                hit,
            ),
            predict_pipelined(&prof, &p, &tree, 0, hit),
        );
        assert_eq!(off_p.hit_step_ms, on_p.hit_step_ms);
        assert!(on_p.arrival_verify_ms < off_p.arrival_verify_ms && on_p.step_ms < off_p.step_ms);
        // Near the node (RTT 0, a fast draft) the tree comes before half a verification: no change.
        let near = Profile {
            network: NetworkProfile {
                rtt_ms: 0.0,
                bytes_per_ms: 125_000.0,
            },
            draft: profile(|n| n, 0.5, 0.0).draft,
            ..prof.clone()
        };
        let near_off = Profile {
            decodes_while_waiting: false,
            ..near.clone()
        };
        assert_eq!(
            predict(&near, &p, &tree, 0).step_ms,
            predict(&near_off, &p, &tree, 0).step_ms
        );
    }

    /// On a node that decodes while waiting, root-only trees 50 ms away cost about one forward
    /// each and beat every tree; but that node serves plain decoding by the decode fallback,
    /// so the trees are weighed against the fallback, and one that beats it is chosen.
    #[test]
    fn trees_are_weighed_against_the_fallback_not_a_waiting_node_root() {
        let p = EXAMPLE_ACCEPTANCE;
        let mut prof = profile(|n| 70.0 + 9.0 * n, 30.0, 50.0);
        prof.decodes_while_waiting = true;
        let alone = choose(&prof, &p, 16, 6, 0).unwrap();
        let tree = alone.by_size.iter().filter(|b| b.nodes > 1);
        let tree = tree.max_by(|a, b| a.speedup.total_cmp(&b.speedup)).unwrap();
        let k = 4;
        let fallback = predict_decode(&prof, k);
        assert!(
            alone.best.nodes == 1 && tree.speedup > fallback.speedup,
            "the case: root {} > tree {} > fallback {}",
            alone.best.speedup,
            tree.speedup,
            fallback.speedup
        );
        let plan = choose_with_fallback(&prof, &p, 16, 6, 0, None, Some(k)).unwrap();
        assert!(
            plan.speculate && plan.best.nodes == tree.nodes,
            "{:?}",
            plan.best
        );
    }
}
