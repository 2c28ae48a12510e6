//! Which tree to draft: either a fixed Sequoia tree for a configured acceptance vector and
//! budget, or (auto mode, the default) the tree the hardware- and network-aware planner
//! (`sequoia_core::planner::cost`) picks from measured costs: the verify node's t_v(n) from its
//! `Profile` RPC, the draft's own t_d(w), and RTT/bandwidth from `Ping`. The acceptance vector is
//! a running estimate from verdicts (separately for greedy and sampled generations), and the
//! plan is recomputed as it and the observed step times move.

use crate::config::{FallbackConfig, TreeConfig};
use sequoia_core::limits;
use sequoia_core::planner::cost::{
    choose_with_fallback, decode_tokens, tree_draft_ms, CostCurve, LookupGain, NetworkProfile,
    NodeCosts, Prediction, Profile, LOADED_SESSIONS,
};
use sequoia_core::planner::{validate_acceptance, PlanError, SequoiaDp};
use sequoia_core::stats::{AcceptanceSpread, RankCounts};
use sequoia_core::tree::Tree;
use sequoia_core::types::TreeMode;
use sequoia_engine::profiling;
use sequoia_engine::Model;
use sequoia_proto::v1::{PingRequest, ProfileRequest, TreePlan};
use std::sync::Mutex;
use std::time::Instant;
use tonic::Status;

/// Weight of the configured acceptance vector in the running estimate, in pseudo-trials.
const PRIOR_TRIALS: f64 = 20.0;

/// Weight of the node-wide estimate in a generation's own, in pseudo-trials, until the node has
/// seen enough generations to measure how much they differ: after about this many verdicts at
/// a rank, a generation's own acceptance counts as much as everyone's. Tasks differ (two-host
/// bench, T = 0: 2.1 tokens per step for role-play and translation, 4.3 for math with the same
/// trees), and one prompt's text is most like its own continuation.
const OWN_PRIOR_TRIALS: f64 = 16.0;

/// Bounds of the weight measured from the spread between generations
/// ([`AcceptanceSpread::prior_trials`]): never so light that two verdicts decide a plan, never
/// so heavy that a prompt unlike the rest keeps the node's trees for most of a short answer.
const OWN_PRIOR_TRIALS_MIN: f64 = 4.0;
const OWN_PRIOR_TRIALS_MAX: f64 = 32.0;

/// Standard errors added to the acceptance estimate when deciding whether probing could pay.
const PROBE_CONFIDENCE_Z: f64 = 2.0;

/// The tree shapes of one plan: the DP solved for the chosen budget, so smaller trees are at
/// hand when the context is nearly full.
pub struct ActivePlan {
    dp: SequoiaDp,
    nodes: usize,
    levels: usize,
    /// `shape(usize::MAX).len()`, computed once (the DP may use fewer than `nodes`).
    full_size: usize,
    pub acceptance: Vec<f64>,
    pub prediction: Option<Prediction>,
    pub mode: TreeMode,
    /// Auto mode chose no speculation, but a tree would pay at an optimistic acceptance (upper
    /// confidence bound): worth probing now and then to learn more. False once the data rule
    /// it out, e.g. when verification costs grow so fast that no acceptance can pay.
    pub probe: bool,
    /// No speculation, served by the decode fallback: the verify node decodes up to this many
    /// tokens per round trip (docs/ALGORITHMS.md §5.5). None: trees (root-only ones included).
    pub decode_tokens: Option<usize>,
    /// Pipelined drafting: the tree sent when none was grown ahead for the verdict (its
    /// budget is `nodes`, `levels`) and its prediction (docs/ALGORITHMS.md §10). None: the
    /// planned tree either way.
    pub miss_prediction: Option<Prediction>,
}

impl ActivePlan {
    /// Whether the auto planner made this plan (so probing applies).
    pub fn is_auto(&self) -> bool {
        self.mode == TreeMode::Auto
    }

    fn fixed(p: &[f64], nodes: usize, levels: usize) -> Result<Self, PlanError> {
        Self::with_miss(p, nodes, levels, None)
    }

    /// [`fixed`](Self::fixed), with a separate tree for pipelined misses.
    fn with_miss(
        p: &[f64],
        nodes: usize,
        levels: usize,
        miss: Option<Prediction>,
    ) -> Result<Self, PlanError> {
        let (nodes, levels) = (nodes.max(1), levels.max(1));
        let (mn, ml) = miss.as_ref().map_or((1, 1), |m| (m.nodes, m.levels));
        let dp = SequoiaDp::solve(p, nodes.max(mn), levels.max(ml))?;
        let full_size = dp.tree(nodes, levels).len();
        Ok(Self {
            dp,
            nodes,
            levels,
            full_size,
            acceptance: p.to_vec(),
            prediction: None,
            mode: TreeMode::Fixed,
            probe: false,
            decode_tokens: None,
            miss_prediction: miss,
        })
    }

    /// The planned tree, shrunk to at most `room` nodes.
    pub fn shape(&self, room: usize) -> Tree {
        self.dp.tree(room.clamp(1, self.nodes), self.levels)
    }

    /// Pipelined drafting: the tree to draft when none was grown ahead for this step (a
    /// miss), shrunk to at most `room` nodes; the planned tree when the plan has no separate
    /// one.
    pub fn miss_shape(&self, room: usize) -> Tree {
        match &self.miss_prediction {
            Some(m) => self.dp.tree(room.clamp(1, m.nodes.max(1)), m.levels.max(1)),
            None => self.shape(room),
        }
    }

    /// The tree to draft for a step whose tree would be `planned` when the draft holds none
    /// grown ahead for it: the miss tree if `planned` is this plan's own tree (with `room`
    /// left), else `planned` itself (a probe, or a tree the request forced).
    pub fn on_miss(&self, planned: Tree, room: usize) -> Tree {
        if self.miss_prediction.is_some() && planned == self.shape(room) {
            self.miss_shape(room)
        } else {
            planned
        }
    }

    /// Nodes of the full-size tree (what `shape` gives when the context has room).
    pub fn full_size(&self) -> usize {
        self.full_size
    }

    pub fn expected_tokens(&self) -> f64 {
        self.dp.expected(self.nodes, self.levels)
    }

    pub fn to_proto(&self, replans: u32) -> TreePlan {
        let t = self.shape(usize::MAX);
        TreePlan {
            parents: t.parents().to_vec(),
            nodes: t.len() as u32,
            levels: t.levels() as u32,
            // A decode plan's step is one decode of K tokens, a pipelined plan's step is a hit
            // with the planned tree or a miss with the miss tree, and an auto plan's tokens
            // include what lookup branches add and the learned acceptance bias: their
            // predictions say so, where the planned tree's G alone would not.
            expected_tokens_per_step: match &self.prediction {
                Some(p) => p.expected_tokens,
                None => self.expected_tokens(),
            },
            mode: self.mode.as_str().into(),
            predicted_speedup: self.prediction.as_ref().map_or(0.0, |p| p.speedup),
            predicted_step_ms: self.prediction.as_ref().map_or(0.0, |p| p.step_ms),
            acceptance: self.acceptance.clone(),
            replans,
        }
    }
}

/// Observed/profiled ratios, smoothed, so the plan follows drift in the real step times.
#[derive(Debug, Clone, Copy)]
struct Drift {
    /// Observed over profiled verify time of single-row forwards (decodes, root-only steps).
    verify_one: f64,
    /// The same for forwards of several rows (trees). Kept apart from `verify_one`: a factor
    /// learned on trees scaled the profile's t_v(1) with it, and plain decoding, priced at
    /// that t_v(1), looked slower than it was. In the two-host emulation the trees ran 1.6×
    /// their profile (the draft, running ahead on the other core, shares the memory bus)
    /// while decodes ran at theirs, so the planner predicted 1.24× where 1.05× came, and
    /// kept trees in categories where they lost to decoding (0.75×).
    verify_tree: f64,
    draft: f64,
}

impl Drift {
    /// The factor for a forward of `rows` rows: the decode one for a single row, else the
    /// tree one.
    fn verify(&self, rows: usize) -> f64 {
        if rows <= 1 {
            self.verify_one
        } else {
            self.verify_tree
        }
    }
}

/// One observation's weight in a drift factor (exponential smoothing).
const DRIFT_WEIGHT: f64 = 0.2;

/// Share of one step's prediction error added to the learned per-step extra. Steps vary a lot
/// (a pipelined step that hit costs about a verification, one that missed a draft more), so
/// each moves it a little.
const STEP_EXTRA_GAIN: f64 = 0.1;

/// Share of the per-step extra dropped after each decode of the fallback.
const STEP_EXTRA_RELAX: f64 = 0.2;

/// Upper bound of the per-step extra, ms: a stalled step must not put every plan off trees.
const MAX_STEP_EXTRA_MS: f64 = 250.0;

/// Per tree step, the weight left to the steps before it in the planner's decayed sums
/// ([`DecayedSums`]: the lookup averages and the acceptance bias): the latest ~50 steps count
/// most (two or three answers), so the sums follow a change of workload (code edits repeat
/// their prompt, chat does not).
const STEP_DECAY: f64 = 0.98;

/// Exponentially decayed sums over steps of two quantities and of the steps themselves.
/// Sums rather than smoothed averages, so the first steps already give an unbiased mean (no
/// climb from 0).
#[derive(Debug, Default, Clone, Copy)]
struct DecayedSums {
    a: f64,
    b: f64,
    steps: f64,
}

impl DecayedSums {
    fn add(&mut self, a: f64, b: f64) {
        self.a = STEP_DECAY * self.a + a;
        self.b = STEP_DECAY * self.b + b;
        self.steps = STEP_DECAY * self.steps + 1.0;
    }
}

/// What prompt-lookup branches added to the greedy tree steps of this node: decayed sums of the
/// tokens their accepted nodes committed (`a`) and of the verify time priced for the nodes they
/// added (`b`). Their means per step are [`Profile::lookup`].
#[derive(Debug, Default, Clone, Copy)]
struct LookupAverages(DecayedSums);

impl LookupAverages {
    fn add(&mut self, tokens: usize, ms: f64) {
        self.0.add(tokens as f64, ms.max(0.0));
    }

    fn gain(&self) -> LookupGain {
        let s = &self.0;
        if s.steps > 0.0 {
            LookupGain {
                tokens: s.a / s.steps,
                ms: s.b / s.steps,
            }
        } else {
            LookupGain::default()
        }
    }
}

/// `factor` moved `share` of the way back to the profile (1): `tree.drift_relax`, applied to a
/// factor each time the other mode runs instead (the decode factor at each verdict of a tree,
/// the tree and draft factors at each decode of the fallback). Nothing measures a mode while
/// the other runs, so without it a slow spell would price that mode for the rest of the node's
/// life (measured: a decode factor of 1.42 from 11 tokens, kept over the next 80 plans, every
/// prediction 42 % high; tree and draft factors of 1.3 and 1.4 from a slow start, then 60
/// tokens decoded where trees paid 1.1× in the next run). Toward the profile, not toward the
/// other factor: a mode priced too cheap is corrected by the steps it leads to, one priced too
/// dear by nothing.
///
/// The decode factor's way back stops lower when trees run *faster* than their profile
/// ([`relax_decode_drift`]).
fn relax_drift(factor: f64, share: f64) -> f64 {
    relax_drift_toward(factor, 1.0, share)
}

/// `factor` moved `share` of the way to `target`.
fn relax_drift_toward(factor: f64, target: f64, share: f64) -> f64 {
    target + (factor - target) * (1.0 - share)
}

/// The decode factor relaxed at a tree's verdict: toward the profile, or toward the tree
/// factor where that is lower. Trees running faster than their profile mean the profile was
/// taken in a slow spell (on a shared host one run's profile had t_v(1) at 102 ms where three
/// others measured 71–76), and plain decoding is then as much cheaper as the trees are, though
/// no decode runs to say so. Trees running slower than their profile say nothing about decodes
/// (the draft's work beside them can slow them, see
/// `a_slow_spell_of_trees_does_not_keep_the_plan_on_decodes`), so there the target stays the
/// profile. So a slow profile whose trees also run slow in service (that run: tree factor
/// 0.88–1.08) keeps decoding priced by the profile. Either way a decode priced too cheap is
/// corrected by the decodes it leads to.
fn relax_decode_drift(verify_one: f64, verify_tree: f64, share: f64) -> f64 {
    relax_drift_toward(verify_one, verify_tree.min(1.0), share)
}

/// `observed / profiled`, or None when either time is not a positive number (a bad
/// measurement, which must teach nothing).
fn drift_ratio(observed: f64, profiled: f64) -> Option<f64> {
    (profiled > 0.0 && observed > 0.0 && observed.is_finite()).then(|| observed / profiled)
}

/// `old` moved toward `ratio` by [`DRIFT_WEIGHT`], within 0.2..=5 (a stall or a bad
/// measurement must not make every plan absurd).
fn smooth_drift(old: f64, ratio: f64) -> f64 {
    ((1.0 - DRIFT_WEIGHT) * old + DRIFT_WEIGHT * ratio).clamp(0.2, 5.0)
}

/// One kind of generation's verdicts (greedy or sampled), node-wide.
#[derive(Debug, Default)]
struct Verdicts {
    /// Accepted and tried, by rank: the running acceptance estimate.
    counts: RankCounts,
    /// How much finished generations' first-rank acceptance differed: the weight of the
    /// node-wide estimate in a generation's own.
    spread: AcceptanceSpread,
    /// Observed against predicted drafted tokens of the plan's own trees.
    bias: AcceptanceBias,
}

/// Pseudo-steps of no bias in [`AcceptanceBias`]: a few steps cannot move the scale far.
const BIAS_PRIOR_STEPS: f64 = 10.0;

/// Bounds of the drafted-token scale: a run of lucky or unlucky steps must not make trees look
/// free or worthless.
const BIAS_SCALE_RANGE: (f64, f64) = (0.5, 2.0);

/// Decayed sums, over tree steps of the plan's own tree, of the drafted tokens the steps
/// committed (`a`; tokens through lookup nodes and the bonus token not counted) and of the
/// drafted tokens the acceptance model predicted for the tree, `G − 1` (`b`)
/// (docs/ALGORITHMS.md §5.4, "Acceptance bias").
#[derive(Debug, Default, Clone, Copy)]
struct AcceptanceBias(DecayedSums);

impl AcceptanceBias {
    fn add(&mut self, predicted: f64, observed: f64) {
        self.0.add(observed.max(0.0), predicted.max(0.0));
    }

    /// Observed over predicted, with [`BIAS_PRIOR_STEPS`] steps of no bias at the average
    /// prediction.
    fn scale(&self) -> f64 {
        let DecayedSums {
            a: observed,
            b: predicted,
            steps,
        } = self.0;
        if !(steps > 0.0 && predicted > 0.0) {
            return 1.0;
        }
        let prior = BIAS_PRIOR_STEPS * predicted / steps;
        ((observed + prior) / (predicted + prior)).clamp(BIAS_SCALE_RANGE.0, BIAS_SCALE_RANGE.1)
    }
}

#[derive(Debug)]
pub struct Planner {
    cfg: TreeConfig,
    wire_top_k: usize,
    auto: bool,
    draft_curve: Mutex<Option<CostCurve>>,
    /// What greedy and what sampled generations' verdicts have taught (their acceptance
    /// differs, so each kind learns apart).
    greedy: Mutex<Verdicts>,
    sampled: Mutex<Verdicts>,
    drift: Mutex<Drift>,
    /// Learned per tree step: the draft side's time the cost model has no term for
    /// (`Profile::step_extra_ms`).
    step_extra_ms: Mutex<f64>,
    /// What lookup branches added to greedy tree steps (they go to greedy requests only).
    lookup: Mutex<LookupAverages>,
    /// The decode fallback's settings; None = off.
    fallback: Option<FallbackConfig>,
    /// Pipelined generations send their trees ahead of the verdicts (`pipeline.send_ahead`),
    /// growing them for `pipeline.candidates` verdicts at once: hit steps are priced accordingly
    /// (`cost::sent_ahead_hit_ms`, `cost::ahead_draft_ms`).
    sends_ahead: bool,
    ahead_candidates: usize,
}

impl Planner {
    pub fn new(cfg: &TreeConfig, wire_top_k: usize) -> Result<Self, String> {
        validate_acceptance(&cfg.acceptance).map_err(|e| format!("tree.acceptance: {e}"))?;
        let auto = cfg.mode.parse::<TreeMode>()? == TreeMode::Auto;
        if cfg.nodes == 0 || cfg.nodes > limits::MAX_TREE_NODES {
            return Err(format!(
                "tree.nodes must be in 1..={}, got {}",
                limits::MAX_TREE_NODES,
                cfg.nodes
            ));
        }
        if cfg.max_levels == 0 || cfg.max_levels > limits::MAX_TREE_LEVELS {
            return Err(format!(
                "tree.max_levels must be in 1..={}, got {}",
                limits::MAX_TREE_LEVELS,
                cfg.max_levels
            ));
        }
        if !(0.0..=1.0).contains(&cfg.drift_relax) {
            return Err(format!(
                "tree.drift_relax must be in 0..=1 (a share), got {}",
                cfg.drift_relax
            ));
        }
        Ok(Self {
            cfg: cfg.clone(),
            wire_top_k,
            auto,
            draft_curve: Mutex::new(None),
            greedy: Mutex::new(Verdicts::default()),
            sampled: Mutex::new(Verdicts::default()),
            drift: Mutex::new(Drift {
                verify_one: 1.0,
                verify_tree: 1.0,
                draft: 1.0,
            }),
            step_extra_ms: Mutex::new(0.0),
            lookup: Mutex::new(LookupAverages::default()),
            fallback: None,
            sends_ahead: false,
            ahead_candidates: 0,
        })
    }

    /// Serve "no speculation" with the decode fallback where the verify node takes it.
    pub fn with_fallback(mut self, fallback: &FallbackConfig) -> Self {
        self.fallback = fallback.enabled.then(|| fallback.clone());
        self
    }

    /// Price pipelined hit steps for trees grown ahead for `candidates` verdicts at once and,
    /// with `send_ahead`, sent ahead of their verdicts (verify nodes older than protocol version
    /// 4 take none, and are then priced optimistically).
    pub fn pipelining(mut self, candidates: usize, send_ahead: bool) -> Self {
        self.ahead_candidates = candidates;
        self.sends_ahead = send_ahead;
        self
    }

    pub fn is_auto(&self) -> bool {
        self.auto
    }

    /// Measure t_d(w) on this node once (blocking; call off the async threads):
    /// the draft's t_d(w) with its LM head over `draft_vocab` tokens (0 = all), measured once.
    pub fn measure_draft(&self, model: &Model, draft_vocab: usize) -> Result<CostCurve, String> {
        if let Some(c) = self.draft_curve.lock().unwrap().clone() {
            return Ok(c);
        }
        let sizes: Vec<u32> = [1u32, 2, 4, 8, 16]
            .into_iter()
            .filter(|&w| w as usize <= self.cfg.nodes.max(1))
            .collect();
        let head = sequoia_engine::drafting::head_vocab(model, draft_vocab);
        let ms = profiling::measure_draft(model, &sizes, self.cfg.profile_context, 3, head)
            .map_err(|e| e.to_string())?;
        let curve = CostCurve::new(sizes, ms).map_err(|e| e.to_string())?;
        *self.draft_curve.lock().unwrap() = Some(curve.clone());
        Ok(curve)
    }

    /// Profile a verify node: its t_v(n) over the sizes the search may use, RTT and bandwidth.
    /// `decodes_while_waiting` as its `Info` says.
    pub async fn measure_node(
        &self,
        mut client: crate::nodes::VerifyClient,
        decodes_while_waiting: bool,
    ) -> Result<NodeCosts, Status> {
        let sizes: Vec<u32> = profiling::DEFAULT_SIZES
            .iter()
            .copied()
            .filter(|&n| n as usize <= self.cfg.nodes)
            .collect();
        let sizes = if sizes.is_empty() { vec![1] } else { sizes };
        let prof = client
            .profile(ProfileRequest {
                tree_sizes: sizes,
                context_length: self.cfg.profile_context as u32,
                repeats: 3,
            })
            .await?
            .into_inner();
        let verify = CostCurve::new(prof.tree_sizes, prof.forward_ms)
            .map_err(|e| Status::internal(e.to_string()))?;
        let mut rtts = Vec::new();
        for _ in 0..5 {
            let t0 = Instant::now();
            client
                .ping(PingRequest {
                    payload: vec![],
                    reply_bytes: 0,
                })
                .await?;
            rtts.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        rtts.sort_by(f64::total_cmp);
        let rtt_ms = rtts[rtts.len() / 2];
        const BIG: usize = 1 << 20;
        let t0 = Instant::now();
        client
            .ping(PingRequest {
                payload: vec![0u8; BIG],
                reply_bytes: 0,
            })
            .await?;
        let big_ms = t0.elapsed().as_secs_f64() * 1e3;
        let bytes_per_ms = BIG as f64 / (big_ms - rtt_ms).max(0.05);
        Ok(NodeCosts {
            verify,
            network: NetworkProfile {
                rtt_ms,
                bytes_per_ms,
            },
            decodes_while_waiting,
        })
    }

    fn verdicts(&self, greedy: bool) -> std::sync::MutexGuard<'_, Verdicts> {
        let verdicts = if greedy { &self.greedy } else { &self.sampled };
        verdicts.lock().unwrap()
    }

    /// Fold a finished (or ongoing) generation's verdict statistics into the running estimate.
    pub fn observe_acceptance(&self, greedy: bool, counts: &RankCounts) {
        self.verdicts(greedy).counts.add(counts);
    }

    /// A generation ended with `own` verdicts (all of its own): they join the spread that
    /// weighs the node-wide estimate against the next generations' own.
    pub fn observe_generation(&self, greedy: bool, own: &RankCounts) {
        self.verdicts(greedy).spread.record(own);
    }

    /// The node-wide estimate's weight in a generation's own, in pseudo-trials.
    pub fn own_prior_trials(&self, greedy: bool) -> f64 {
        self.verdicts(greedy).spread.prior_trials(
            OWN_PRIOR_TRIALS,
            OWN_PRIOR_TRIALS_MIN,
            OWN_PRIOR_TRIALS_MAX,
        )
    }

    /// Fold a verify time the node reported into a verify drift factor: `forwards` forwards
    /// of `rows` rows each (a tree: one forward of its batch's rows; a decode message: one
    /// forward per token) took `observed_ms`, against the profile's t_v(rows) per forward.
    /// Single rows teach the decode factor, several rows the tree factor ([`Drift`]). Every
    /// tree counts whatever its size, not only the plan's own shape, and the probes the
    /// fallback sends keep the tree factor learning while the plan is to decode.
    pub fn observe_verify(
        &self,
        costs: &NodeCosts,
        rows: usize,
        forwards: usize,
        observed_ms: f64,
    ) {
        let profiled = forwards as f64 * costs.verify.at(rows.max(1));
        let Some(ratio) = drift_ratio(observed_ms, profiled) else {
            return;
        };
        let mut d = self.drift.lock().unwrap();
        if rows <= 1 {
            d.verify_one = smooth_drift(d.verify_one, ratio);
        } else {
            d.verify_tree = smooth_drift(d.verify_tree, ratio);
            d.verify_one = relax_decode_drift(d.verify_one, d.verify_tree, self.cfg.drift_relax);
        }
    }

    /// Fold the time the draft took to grow a tree of `shape` (its own forwards only: not the
    /// catch-up over committed tokens it had not run, nor work done ahead) into the draft drift
    /// factor, against the profile's t_d over the shape's levels.
    pub fn observe_draft(&self, shape: &Tree, observed_ms: f64) {
        let Some(curve) = self.draft_curve.lock().unwrap().clone() else {
            return;
        };
        let Some(ratio) = drift_ratio(observed_ms, tree_draft_ms(&curve, shape)) else {
            return;
        };
        let mut d = self.drift.lock().unwrap();
        d.draft = smooth_drift(d.draft, ratio);
    }

    /// A tree of `nodes` nodes on `costs`' node as the planner prices it now: a forward of
    /// `nodes × load_sessions` rows (as in [`Self::plan`]), on the profile times the drift factor
    /// that observed verifies taught.
    pub fn verify_ms(&self, costs: &NodeCosts, nodes: usize, load_sessions: f64) -> f64 {
        let rows = ((nodes as f64 * load_sessions.max(1.0)).round() as usize).max(1);
        costs.verify.at(rows) * self.drift.lock().unwrap().verify(nodes)
    }

    /// A tree step of the plan's own shape took `observed_ms` (from drafting it to having its
    /// verdict followed) where the plan predicted `predicted_ms`: the learned per-step extra
    /// moves by a share of the error, so that on average the predicted step is the observed
    /// one. What it absorbs is real cost the cost model has no term for: following the
    /// verdict, overheads of the wire and the services. (The verify time of lookup nodes is
    /// priced when they are grafted, and the caller adds it to `predicted_ms`.) Without it, a
    /// task whose trees barely pay in the model loses to plain decoding in fact.
    pub fn observe_step(&self, predicted_ms: f64, observed_ms: f64) {
        if !(predicted_ms.is_finite() && observed_ms.is_finite()) {
            return;
        }
        // One step moves it by at most half its prediction's worth: a stall is not a trend.
        let error = (observed_ms - predicted_ms).clamp(-predicted_ms / 2.0, predicted_ms / 2.0);
        let mut extra = self.step_extra_ms.lock().unwrap();
        *extra = (*extra + STEP_EXTRA_GAIN * error).clamp(0.0, MAX_STEP_EXTRA_MS);
    }

    /// A decode of the fallback ran: a stretch without tree steps observes nothing of the
    /// per-step extra, the tree verify factor or the draft factor, so each relaxes (the extra
    /// toward zero, the factors toward the profile), and a spell of slow steps does not keep
    /// the planner off trees for good; the next trees measure them again.
    pub fn relax_after_decode(&self) {
        *self.step_extra_ms.lock().unwrap() *= 1.0 - STEP_EXTRA_RELAX;
        let mut d = self.drift.lock().unwrap();
        d.verify_tree = relax_drift(d.verify_tree, self.cfg.drift_relax);
        d.draft = relax_drift(d.draft, self.cfg.drift_relax);
    }

    /// A greedy tree step ran: its accepted lookup nodes committed `tokens` tokens beyond the
    /// drafted tree, and the nodes its branch added were priced at `ms` of verify time (both 0
    /// for a step without a branch, which counts too: the average is over every tree step).
    pub fn observe_lookup(&self, tokens: usize, ms: f64) {
        self.lookup.lock().unwrap().add(tokens, ms);
    }

    /// What lookup branches add to a greedy tree step on average (tokens, verify ms).
    pub fn lookup_gain(&self) -> LookupGain {
        self.lookup.lock().unwrap().gain()
    }

    /// A step of the plan's own tree, whose acceptance model predicted `predicted` tokens
    /// (G, the bonus token included), committed `observed` tokens from its drafted nodes (the
    /// bonus included, tokens of lookup nodes not).
    pub fn observe_tree_tokens(&self, greedy: bool, predicted: f64, observed: usize) {
        if predicted.is_finite() && predicted >= 1.0 && observed >= 1 {
            self.verdicts(greedy)
                .bias
                .add(predicted - 1.0, observed as f64 - 1.0);
        }
    }

    /// Observed over predicted drafted tokens per step of greedy or sampled generations
    /// ([`Profile::drafted_scale`]).
    pub fn drafted_scale(&self, greedy: bool) -> f64 {
        self.verdicts(greedy).bias.scale()
    }

    /// The learned per-tree-step extra, ms.
    pub fn step_extra_ms(&self) -> f64 {
        *self.step_extra_ms.lock().unwrap()
    }

    /// The current drift factors (verify of one row, verify of several, draft): observed over
    /// profiled times, smoothed.
    pub fn drift(&self) -> (f64, f64, f64) {
        let d = *self.drift.lock().unwrap();
        (d.verify_one, d.verify_tree, d.draft)
    }

    /// The plan for a new generation (or a re-plan), given the node's costs in auto mode.
    /// `pipeline_hit`: the generation drafts pipelined, with this estimated hit probability
    /// (the step time then overlaps drafting with verification, docs/ALGORITHMS.md §5.2).
    /// `load_sessions`: sessions in the node's recent batches (1 = alone). A tree of n nodes is
    /// priced as a forward of n × load_sessions rows, as if every session in the batch sent a
    /// tree like this one (docs/ALGORITHMS.md §11): the size that is best for each session under
    /// that assumption is also best for the node's throughput. Trees shrink when the node is
    /// busy and grow back when it is idle.
    /// `can_decode`: the verify node takes the decode fallback (and it is configured on), so
    /// "no speculation" costs one round trip per decode rather than one per token.
    /// `own`: the generation's verdicts so far, blended into the node-wide acceptance estimate
    /// (weighed by [`Self::own_prior_trials`]). They are already folded into the node-wide counts, so those
    /// are taken without them here: a generation's verdicts count once.
    pub fn plan(
        &self,
        costs: Option<&NodeCosts>,
        greedy: bool,
        own: &RankCounts,
        pipeline_hit: Option<f64>,
        load_sessions: f64,
        can_decode: bool,
    ) -> Result<ActivePlan, String> {
        let others = self
            .verdicts(greedy)
            .counts
            .since(own)
            .estimate(&self.cfg.acceptance, PRIOR_TRIALS);
        let p = own.estimate(&others, self.own_prior_trials(greedy));
        let fallback = self.fallback.as_ref().filter(|_| can_decode);
        let (Some(costs), true) = (costs, self.auto) else {
            let mut plan =
                ActivePlan::fixed(&self.cfg.acceptance, self.cfg.nodes, self.cfg.max_levels)
                    .map_err(|e| e.to_string())?;
            // Fixed mode without speculation: no costs to size decodes from, so the most.
            if plan.full_size == 1 {
                plan.decode_tokens = fallback.map(|f| f.max_tokens);
            }
            return Ok(plan);
        };
        let draft = self
            .draft_curve
            .lock()
            .unwrap()
            .clone()
            .ok_or("draft costs not measured yet")?;
        let d = *self.drift.lock().unwrap();
        let scale = |c: &CostCurve, f: f64| CostCurve {
            sizes: c.sizes.clone(),
            ms: c.ms.iter().map(|m| m * f).collect(),
        };
        let verify = CostCurve {
            sizes: costs.verify.sizes.clone(),
            ms: (costs.verify.sizes.iter().zip(&costs.verify.ms))
                .map(|(&s, m)| m * d.verify(s as usize))
                .collect(),
        };
        let loaded = |c: &CostCurve| CostCurve {
            sizes: c.sizes.clone(),
            ms: c
                .sizes
                .iter()
                .map(|&s| c.at((s as f64 * load_sessions.max(1.0)).round() as usize))
                .collect(),
        };
        let profile = Profile {
            verify: loaded(&verify),
            draft: scale(&draft, d.draft),
            network: costs.network,
            overhead_ms: 0.5,
            step_extra_ms: self.step_extra_ms(),
            sends_ahead: self.sends_ahead,
            ahead_candidates: self.ahead_candidates,
            // The node decodes while waiting only for a session alone on it.
            decodes_while_waiting: costs.decodes_while_waiting && load_sessions < LOADED_SESSIONS,
            // Lookup branches go to greedy requests only.
            lookup: if greedy {
                self.lookup_gain()
            } else {
                LookupGain::default()
            },
            drafted_scale: self.drafted_scale(greedy),
            context: self.cfg.profile_context,
            note: String::new(),
        };
        let q = if greedy { 0 } else { self.wire_top_k };
        let (nodes, levels) = (self.cfg.nodes, self.cfg.max_levels);
        let decode = fallback.map(|f| decode_tokens(&profile, f.max_tokens, f.rtt_share));
        // Under load, a tree must win by a margin (`LOAD_MARGIN`).
        let auto = choose_with_fallback(&profile, &p, nodes, levels, q, pipeline_hit, decode)
            .map_err(|e| e.to_string())?
            .with_load_margin(load_sessions);
        let best = auto.best;
        let mut plan = ActivePlan::with_miss(&p, best.nodes, best.levels, auto.miss)
            .map_err(|e| e.to_string())?;
        if best.nodes == 1 {
            let optimistic = self.verdicts(greedy).counts.upper_estimate(
                &self.cfg.acceptance,
                PRIOR_TRIALS,
                PROBE_CONFIDENCE_Z,
            );
            // Probing pays if a tree would at the optimistic acceptance, with the costs as
            // observed or as profiled: a slow spell that inflated the drift factors must not
            // stop the probes that would show it has passed.
            let as_profiled = Profile {
                verify: loaded(&costs.verify),
                draft: draft.clone(),
                step_extra_ms: 0.0,
                ..profile.clone()
            };
            for costs in [&profile, &as_profiled] {
                let hope = choose_with_fallback(
                    costs,
                    &optimistic,
                    nodes,
                    levels,
                    q,
                    pipeline_hit,
                    decode,
                )
                .map_err(|e| e.to_string())?;
                if hope.best.nodes > 1 {
                    plan.probe = true;
                    break;
                }
            }
            plan.decode_tokens = decode;
        }
        plan.prediction = Some(best);
        plan.mode = TreeMode::Auto;
        Ok(plan)
    }

    pub fn replan_every(&self) -> u32 {
        self.cfg.replan_every_steps.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_estimate_is_optimistic_and_tightens_with_data() {
        let prior = [0.6, 0.1];
        let mut c = RankCounts::default();
        let gap = |c: &RankCounts| {
            c.upper_estimate(&prior, PRIOR_TRIALS, 2.0)[0] - c.estimate(&prior, PRIOR_TRIALS)[0]
        };
        let before = gap(&c);
        assert!(
            before > 0.1,
            "20 pseudo-trials leave a wide bound: {before}"
        );
        c.add(&RankCounts::new(vec![600, 50], vec![1000, 600]));
        let after = gap(&c);
        assert!(after > 0.0 && after < before / 5.0, "{before} -> {after}");
        assert!(
            c.upper_estimate(&prior, PRIOR_TRIALS, 2.0)
                .iter()
                .sum::<f64>()
                <= 1.0 + 1e-12
        );
    }

    #[test]
    fn estimate_moves_from_prior_to_data() {
        let prior = [0.5, 0.2];
        let mut c = RankCounts::default();
        assert_eq!(c.estimate(&prior, PRIOR_TRIALS), vec![0.5, 0.2]);
        c.add(&RankCounts::new(vec![90, 0], vec![100, 10]));
        let e = c.estimate(&prior, PRIOR_TRIALS);
        assert!((e[0] - (90.0 + 10.0) / 120.0).abs() < 1e-12);
        assert!(e[1] < 0.2);
        assert!(e.iter().sum::<f64>() <= 1.0 + 1e-12);
    }

    /// An auto planner of up to 32 nodes with the draft cost `draft` (ms per level at 1 and 16
    /// nodes) in front of a verify node with the cost curve `verify` and a fast network.
    fn auto_planner(draft: [f64; 2], verify: CostCurve) -> (Planner, NodeCosts) {
        let cfg = TreeConfig {
            mode: "auto".into(),
            nodes: 32,
            ..TreeConfig::default()
        };
        let planner = Planner::new(&cfg, 8).unwrap();
        *planner.draft_curve.lock().unwrap() =
            Some(CostCurve::new(vec![1, 16], draft.to_vec()).unwrap());
        let costs = NodeCosts {
            verify,
            network: NetworkProfile {
                rtt_ms: 0.5,
                bytes_per_ms: 125_000.0,
            },
            decodes_while_waiting: false,
        };
        (planner, costs)
    }

    /// A verify node whose forward costs 20 ms up to 16 rows, then 2.5 ms per row (memory-bound,
    /// then compute-bound), and a cheap draft.
    fn loaded_planner() -> (Planner, NodeCosts) {
        let verify = CostCurve::new(
            vec![1, 16, 32, 64, 128],
            vec![20.0, 20.0, 60.0, 140.0, 300.0],
        )
        .unwrap();
        auto_planner([0.5, 0.6], verify)
    }

    /// A pipelined plan carries a miss tree; its reported tokens per step are the expectation
    /// over hits and misses, and the miss tree is a tree (never the root alone).
    #[test]
    fn pipelined_plans_carry_a_miss_tree_and_report_the_mix() {
        let (planner, costs) = loaded_planner();
        let plan = planner
            .plan(
                Some(&costs),
                true,
                &RankCounts::default(),
                Some(0.4),
                1.0,
                true,
            )
            .unwrap();
        let pred = plan.prediction.as_ref().unwrap();
        let miss = plan.miss_prediction.as_ref().expect("a miss tree");
        assert!(plan.full_size() > 1 && plan.miss_shape(usize::MAX).len() > 1);
        assert_eq!(plan.miss_shape(usize::MAX).len(), miss.nodes);
        assert!(
            plan.miss_shape(3).len() <= 3,
            "the miss tree shrinks to the room left"
        );
        assert_eq!(
            plan.to_proto(0).expected_tokens_per_step,
            pred.expected_tokens
        );
        // Only the plan's own tree is swapped after a miss: a probe (or a forced tree) is
        // drafted as it is.
        let own = plan.shape(usize::MAX);
        assert_eq!(plan.on_miss(own, usize::MAX), plan.miss_shape(usize::MAX));
        assert_eq!(plan.on_miss(Tree::chain(2), usize::MAX), Tree::chain(2));
        let plain = planner
            .plan(Some(&costs), true, &RankCounts::default(), None, 1.0, true)
            .unwrap();
        assert!(plain.miss_prediction.is_none());
        assert_eq!(plain.miss_shape(usize::MAX), plain.shape(usize::MAX));
        assert_eq!(plain.on_miss(Tree::chain(2), 5), Tree::chain(2));
    }

    #[test]
    fn trees_shrink_when_the_node_is_busy_and_grow_back_when_idle() {
        let (planner, costs) = loaded_planner();
        let nodes = |load: u32| {
            planner
                .plan(
                    Some(&costs),
                    true,
                    &RankCounts::default(),
                    None,
                    load as f64,
                    true,
                )
                .unwrap()
                .full_size()
        };
        let (idle, busy, idle_again) = (nodes(1), nodes(8), nodes(1));
        // At 16 sessions every row is priced at its full share (the curve is linear from 32
        // rows): no tree pays at all.
        assert_eq!(nodes(16), 1, "a saturated node gets no trees");
        assert!(
            idle >= 8,
            "an idle node's flat region pays for a big tree: {idle}"
        );
        assert!(
            busy < idle,
            "a busy node ({busy}) must get smaller trees than an idle one ({idle})"
        );
        assert_eq!(idle_again, idle);
    }

    #[test]
    fn a_generations_own_verdicts_resize_its_tree() {
        // Each node costs the target 3 ms on top of a 20 ms forward; drafting a level 2 ms. The
        // other generations' drafts are usually right; this one's verdicts are folded into the
        // node-wide counts before it plans, as the generation loop does.
        let nodes = |own: &RankCounts| {
            let (planner, costs) = auto_planner(
                [2.0, 3.0],
                CostCurve::new(vec![1, 32], vec![20.0, 113.0]).unwrap(),
            );
            planner.observe_acceptance(true, &RankCounts::new(vec![180, 10], vec![200, 20]));
            planner.observe_acceptance(true, own);
            planner
                .plan(Some(&costs), true, own, None, 1.0, true)
                .unwrap()
                .full_size()
        };
        let fresh = nodes(&RankCounts::default());
        // This prompt's drafts are rarely accepted at any rank.
        let hard = nodes(&RankCounts::new(vec![4, 1, 0, 0], vec![40, 36, 35, 35]));
        assert!(
            fresh >= 4,
            "the node-wide estimate pays for a tree: {fresh}"
        );
        assert!(
            hard < fresh,
            "a generation whose drafts fail gets a smaller tree ({hard}) than a fresh one ({fresh})"
        );
        // A few verdicts move the plan only a little: the node-wide estimate is the prior.
        let one_miss = nodes(&RankCounts::new(vec![0], vec![1]));
        assert!(
            one_miss > hard,
            "one miss ({one_miss}) weighs less than forty ({hard})"
        );
    }

    #[test]
    fn own_verdicts_count_more_where_generations_have_differed() {
        // The same node-wide estimate (0.8 at the first rank) and the same three rejected first
        // drafts of this generation; the nodes differ only in the generations they have seen.
        let first_rank = |history: &[u64]| {
            let (planner, costs) = auto_planner(
                [2.0, 3.0],
                CostCurve::new(vec![1, 32], vec![20.0, 113.0]).unwrap(),
            );
            planner.observe_acceptance(true, &RankCounts::new(vec![160, 10], vec![200, 20]));
            for &a in history {
                planner.observe_generation(true, &RankCounts::new(vec![a], vec![50]));
            }
            let own = RankCounts::new(vec![0], vec![3]);
            planner.observe_acceptance(true, &own);
            let plan = planner
                .plan(Some(&costs), true, &own, None, 1.0, true)
                .unwrap();
            (plan.acceptance[0], planner.own_prior_trials(true))
        };
        let (fresh, w_fresh) = first_rank(&[]);
        let (alike, w_alike) = first_rank(&[40, 41, 39, 40, 42, 38, 40, 40]);
        let (apart, w_apart) = first_rank(&[20, 48, 25, 47, 30, 46, 22, 49]);
        assert_eq!(
            w_fresh, OWN_PRIOR_TRIALS,
            "no generations seen: the default weight"
        );
        assert_eq!(w_alike, OWN_PRIOR_TRIALS_MAX, "alike generations");
        assert!(w_apart < 8.0, "generations that differ: {w_apart}");
        assert!(
            apart < fresh && fresh < alike,
            "three rejections move the estimate most where generations differ: {apart} {fresh} {alike}"
        );
        assert!(apart < 0.6, "{apart}");
    }

    /// An auto planner with the decode fallback on, where trees pay at the profiled costs (3 ms
    /// per draft level, 20 ms + 3 ms per node to verify) with a draft that is usually right,
    /// and the verify node's costs.
    fn fallback_planner() -> (Planner, NodeCosts) {
        let (planner, costs) = auto_planner(
            [3.0, 4.5],
            CostCurve::new(vec![1, 32], vec![20.0, 113.0]).unwrap(),
        );
        let planner = planner.with_fallback(&FallbackConfig::default());
        planner.observe_acceptance(true, &RankCounts::new(vec![450, 20], vec![500, 50]));
        (planner, costs)
    }

    fn plan_of(planner: &Planner, costs: &NodeCosts) -> ActivePlan {
        plan_of_kind(planner, costs, true)
    }

    /// [`plan_of`] for a greedy or a sampled generation.
    fn plan_of_kind(planner: &Planner, costs: &NodeCosts, greedy: bool) -> ActivePlan {
        planner
            .plan(Some(costs), greedy, &RankCounts::default(), None, 1.0, true)
            .unwrap()
    }

    #[test]
    fn slow_drafts_move_the_plan_to_decodes_and_probes_bring_it_back() {
        let (planner, costs) = fallback_planner();
        assert!(plan_of(&planner, &costs).full_size() > 1);
        // A slow spell: every draft level takes five times its profiled time (a three-node
        // chain is two forwards of one node).
        let chain = Tree::chain(3);
        for _ in 0..20 {
            planner.observe_draft(&chain, 5.0 * 2.0 * 3.0);
        }
        assert!(planner.drift().2 > 4.0, "{:?}", planner.drift());
        let slow = plan_of(&planner, &costs);
        assert_eq!(slow.full_size(), 1, "no tree pays with drafts this slow");
        assert!(slow.decode_tokens.is_some());
        // The drift says no tree pays, but the profile says one would: keep probing, or the
        // planner would never see the spell end.
        assert!(slow.probe, "a slow spell must not stop the probes");
        // Probes (a two-node chain: one draft forward of one node) at the profiled speed.
        for _ in 0..20 {
            planner.observe_draft(&Tree::chain(2), 3.0);
        }
        assert!(plan_of(&planner, &costs).full_size() > 1);
    }

    #[test]
    fn decodes_and_trees_each_learn_their_own_verify_drift() {
        let (planner, costs) = fallback_planner();
        // Decode messages of 8 tokens at twice the profiled t(1).
        for _ in 0..30 {
            planner.observe_verify(&costs, 1, 8, 8.0 * 40.0);
        }
        let (one, tree, _) = planner.drift();
        assert!(
            (one - 2.0).abs() < 0.01 && tree == 1.0,
            "{:?}",
            planner.drift()
        );
        // Trees of 11 rows (a lookup branch on top of the plan's tree) at 1.5× the profile
        // teach the tree factor; the decode factor, which they do not measure, returns toward
        // the profile, a tenth of the way per verdict.
        planner.observe_verify(&costs, 11, 1, 1.5 * costs.verify.at(11));
        let (one, _, _) = planner.drift();
        assert!((one - 1.9).abs() < 0.01, "{:?}", planner.drift());
        for _ in 0..29 {
            planner.observe_verify(&costs, 11, 1, 1.5 * costs.verify.at(11));
        }
        let (one, tree, _) = planner.drift();
        assert!(one > 1.0 && one < 1.05, "{:?}", planner.drift());
        assert!((tree - 1.5).abs() < 0.01, "{:?}", planner.drift());
        // Nonsense times are ignored by both.
        let before = planner.drift();
        planner.observe_verify(&costs, 4, 1, f64::NAN);
        planner.observe_verify(&costs, 4, 1, 0.0);
        planner.observe_verify(&costs, 1, 1, f64::NAN);
        assert_eq!(planner.drift(), before);
    }

    /// Trees and drafts caught in a slow spell (here 2.5× their profile) put the plan on
    /// decodes, which measure neither: each decode moves both factors back toward the profile,
    /// so trees return after a few decodes instead of never.
    #[test]
    fn a_slow_spell_of_trees_does_not_keep_the_plan_on_decodes() {
        let (planner, costs) = fallback_planner();
        assert!(plan_of(&planner, &costs).full_size() > 1);
        let chain = Tree::chain(3);
        for _ in 0..30 {
            planner.observe_verify(&costs, 4, 1, 2.5 * costs.verify.at(4));
            planner.observe_draft(&chain, 2.5 * 2.0 * 3.0);
        }
        assert_eq!(
            plan_of(&planner, &costs).full_size(),
            1,
            "{:?}",
            planner.drift()
        );
        let mut decodes = 0;
        while plan_of(&planner, &costs).full_size() == 1 {
            planner.relax_after_decode();
            decodes += 1;
            assert!(decodes < 30, "trees never came back: {:?}", planner.drift());
        }
        assert!(decodes > 1, "{decodes}");
        let (_, tree, draft) = planner.drift();
        assert!(tree > 1.0 && draft > 1.0, "{:?}", planner.drift());
    }

    /// A slow spell caught by a few decode tokens (here, at 1.5× the profile) prices plain
    /// decoding dearly and sends the plan to trees; the trees' verdicts then bring that price
    /// back toward the profile, so a task on which trees do not pay returns to decoding rather
    /// than keeping trees for good on a price nothing measures any more.
    #[test]
    fn a_slow_spell_of_decodes_does_not_price_decoding_for_good() {
        let (planner, costs) = fallback_planner();
        // Trees at 2.5× their profile: decoding, at its profile, is the plan.
        for _ in 0..30 {
            planner.observe_verify(&costs, 4, 1, 2.5 * costs.verify.at(4));
        }
        let plan = plan_of(&planner, &costs);
        assert_eq!(plan.full_size(), 1, "{:?}", planner.drift());
        // Eleven decode tokens at 1.5× the profile make trees look better.
        for _ in 0..11 {
            planner.observe_verify(&costs, 1, 1, 1.5 * costs.verify.at(1));
        }
        assert!(planner.drift().0 > 1.4, "{:?}", planner.drift());
        assert!(plan_of(&planner, &costs).full_size() > 1);
        // The trees that follow, still at 2.5×, bring decoding back.
        for _ in 0..20 {
            planner.observe_verify(&costs, 4, 1, 2.5 * costs.verify.at(4));
        }
        assert_eq!(
            plan_of(&planner, &costs).full_size(),
            1,
            "{:?}",
            planner.drift()
        );
    }

    /// A verify profile taken in a slow spell (every time 1.35× what the node does later):
    /// trees then run at 0.74× it, and the price of plain decoding follows them down although
    /// no decode runs, so the plan's predicted speedup comes back to what the node's real
    /// costs give (here, the same planner with a profile of the real costs). With the decode
    /// factor left at the profile, decoding would stay priced 1.35× too dear and the
    /// prediction too high by as much as that.
    #[test]
    fn a_profile_from_a_slow_spell_is_corrected_by_faster_trees() {
        let (planner, costs) = fallback_planner();
        let mut slow = costs.clone();
        slow.verify = CostCurve::new(
            costs.verify.sizes.clone(),
            costs.verify.ms.iter().map(|ms| 1.35 * ms).collect(),
        )
        .unwrap();
        let (fair, _) = fallback_planner();
        let want = plan_of(&fair, &costs).prediction.unwrap().speedup;
        for _ in 0..40 {
            let plan = plan_of(&planner, &slow);
            let n = plan.full_size().max(2);
            planner.observe_verify(&slow, n, 1, costs.verify.at(n));
        }
        let (one, tree, _) = planner.drift();
        assert!((tree - 1.0 / 1.35).abs() < 0.02, "{:?}", planner.drift());
        assert!(
            one < 0.8,
            "decodes priced from the trees: {:?}",
            planner.drift()
        );
        let after = plan_of(&planner, &slow).prediction.unwrap().speedup;
        assert!((after / want - 1.0).abs() < 0.05, "{after} vs {want}");
    }

    /// Trees that run four times slower than their profile (while decodes run at theirs) make
    /// decoding the plan: scaling the profile's t_v(1) by the trees' factor too would have made
    /// plain decoding look four times slower as well, and kept the trees.
    #[test]
    fn trees_slower_than_profiled_lose_to_decodes_that_are_not() {
        let (planner, costs) = fallback_planner();
        assert!(plan_of(&planner, &costs).full_size() > 1);
        for _ in 0..30 {
            planner.observe_verify(&costs, 4, 1, 4.0 * costs.verify.at(4));
            planner.observe_verify(&costs, 1, 8, 8.0 * costs.verify.at(1));
        }
        let plan = plan_of(&planner, &costs);
        assert_eq!(plan.full_size(), 1, "trees at 4× their cost do not pay");
        assert!(plan.decode_tokens.is_some());
        // Back at the profiled speed, trees return.
        for _ in 0..40 {
            planner.observe_verify(&costs, 4, 1, costs.verify.at(4));
        }
        assert!(plan_of(&planner, &costs).full_size() > 1);
    }

    /// Lookup branches that commit 0.5 tokens per tree step beyond the tree, for 2 ms of
    /// verify time, enter greedy predictions as that average (the steps without a branch count
    /// too) and leave sampled ones alone (lookup branches go to greedy requests only).
    #[test]
    fn greedy_predictions_count_what_lookup_branches_add() {
        let (planner, costs) = fallback_planner();
        let plan_for = |greedy: bool| plan_of_kind(&planner, &costs, greedy).prediction.unwrap();
        let (before, sampled_before) = (plan_for(true), plan_for(false));
        assert!(before.nodes > 1 && before.lookup_tokens == 0.0);
        // Already the mean from the first steps: no climb from zero.
        planner.observe_lookup(1, 4.0);
        planner.observe_lookup(0, 0.0);
        let gain = planner.lookup_gain();
        let first_two = STEP_DECAY / (1.0 + STEP_DECAY);
        assert!((gain.tokens - first_two).abs() < 1e-12, "{gain:?}");
        for _ in 0..500 {
            planner.observe_lookup(1, 4.0);
            planner.observe_lookup(0, 0.0);
        }
        let gain = planner.lookup_gain();
        assert!(
            (gain.tokens - 0.5).abs() < 0.02 && (gain.ms - 2.0).abs() < 0.1,
            "{gain:?}"
        );
        let after = plan_for(true);
        assert_eq!(
            (after.lookup_tokens, after.lookup_ms),
            (gain.tokens, gain.ms)
        );
        // The same tree is predicted with the gain's tokens and time; another tree only if it
        // is predicted faster still.
        if after.nodes == before.nodes {
            assert!((after.expected_tokens - before.expected_tokens - gain.tokens).abs() < 1e-9);
            assert!((after.step_ms - before.step_ms - gain.ms).abs() < 1e-9);
        }
        assert!(
            after.speedup > before.speedup,
            "{} vs {}",
            after.speedup,
            before.speedup
        );
        let sampled = plan_for(false);
        assert_eq!(sampled.lookup_tokens, 0.0);
        assert_eq!(sampled.speedup, sampled_before.speedup);
    }

    /// Steps that commit half again the drafted tokens the acceptance model predicted scale
    /// the drafted part of the next predictions toward 1.5 (greedy only: sampled generations
    /// keep their own), and the scale stays inside its bounds however lucky the steps.
    #[test]
    fn the_acceptance_bias_is_learned_from_steps() {
        let (planner, costs) = fallback_planner();
        let plan_for = |greedy: bool| plan_of_kind(&planner, &costs, greedy);
        let before = plan_for(true);
        assert!(before.full_size() > 1);
        assert_eq!(planner.drafted_scale(true), 1.0);
        let g = before.expected_tokens();
        // Observed tokens are whole: steps whose running total follows 1 + 1.5 (G − 1) each.
        let want = 1.0 + 1.5 * (g - 1.0);
        for i in 0..400 {
            let observed = (want * (i + 1) as f64).round() - (want * i as f64).round();
            planner.observe_tree_tokens(true, g, observed as usize);
        }
        let scale = planner.drafted_scale(true);
        assert!((scale - 1.5).abs() < 0.1, "{scale}");
        assert_eq!(planner.drafted_scale(false), 1.0);
        let after = plan_for(true).prediction.unwrap();
        let tree = Tree::from_parents(&after.parents).unwrap();
        let p = planner
            .verdicts(true)
            .counts
            .estimate(&planner.cfg.acceptance, PRIOR_TRIALS);
        let g_after = sequoia_core::planner::expected_tokens(&tree, &p);
        assert!((after.expected_tokens - (1.0 + scale * (g_after - 1.0))).abs() < 1e-9);
        for _ in 0..400 {
            planner.observe_tree_tokens(true, g, 40);
        }
        assert_eq!(planner.drafted_scale(true), BIAS_SCALE_RANGE.1);
    }

    #[test]
    fn the_step_extra_is_learned_from_steps_and_relaxes_on_decodes() {
        let (planner, costs) = fallback_planner();
        let plan = plan_of(&planner, &costs);
        let before = plan.prediction.as_ref().unwrap().clone();
        assert!(plan.full_size() > 1);
        // Every step takes 4 ms longer than predicted: the extra converges to it, and the
        // prediction (for the same tree) with it.
        for _ in 0..200 {
            let pred = plan_of(&planner, &costs);
            let p = pred.prediction.as_ref().unwrap();
            planner.observe_step(p.step_ms, p.step_ms - planner.step_extra_ms() + 4.0);
        }
        assert!(
            (planner.step_extra_ms() - 4.0).abs() < 0.05,
            "{}",
            planner.step_extra_ms()
        );
        let after = plan_of(&planner, &costs);
        let p = after.prediction.as_ref().unwrap();
        assert_eq!(
            after.full_size(),
            before.nodes,
            "4 ms do not change the tree here"
        );
        assert!(
            (p.step_ms - before.step_ms - 4.0).abs() < 0.1,
            "{p:?} vs {before:?}"
        );
        assert!(p.speedup < before.speedup);
        // A step extra larger than what trees gain puts the plan on decodes (fallback rather
        // than slow down); decodes then relax it, and trees come back.
        for _ in 0..200 {
            planner.observe_step(10.0, 200.0);
        }
        let off = plan_of(&planner, &costs);
        assert_eq!(off.full_size(), 1);
        assert!(off.probe);
        let mut decodes = 0;
        while plan_of(&planner, &costs).full_size() == 1 {
            planner.relax_after_decode();
            decodes += 1;
            assert!(decodes < 100, "the extra never relaxed");
        }
        assert!(decodes > 1, "{decodes}");
    }

    #[test]
    fn no_speculation_is_served_by_decodes_where_the_node_takes_them() {
        // A draft as slow as the target, 50 ms away: no tree pays.
        let cfg = TreeConfig {
            mode: "auto".into(),
            nodes: 16,
            ..TreeConfig::default()
        };
        let planner = Planner::new(&cfg, 8)
            .unwrap()
            .with_fallback(&FallbackConfig::default());
        *planner.draft_curve.lock().unwrap() =
            Some(CostCurve::new(vec![1, 16], vec![50.0, 800.0]).unwrap());
        let costs = NodeCosts {
            verify: CostCurve::new(vec![1, 16], vec![50.0, 800.0]).unwrap(),
            network: NetworkProfile {
                rtt_ms: 50.0,
                bytes_per_ms: 125_000.0,
            },
            decodes_while_waiting: false,
        };
        let plan = planner
            .plan(Some(&costs), true, &RankCounts::default(), None, 1.0, true)
            .unwrap();
        assert_eq!(plan.full_size(), 1);
        let k = plan
            .decode_tokens
            .expect("decodes where the node takes them");
        assert!((9..=32).contains(&k), "k = {k}");
        let pred = plan.prediction.as_ref().unwrap();
        assert!(pred.speedup > 0.85 && pred.speedup < 1.0, "{pred:?}");
        // The summary's plan states a decode's K tokens per step, not the root's one.
        assert_eq!(plan.to_proto(0).expected_tokens_per_step, k as f64);
        // An old node: root-only trees, priced at a round trip per token.
        let old = planner
            .plan(Some(&costs), true, &RankCounts::default(), None, 1.0, false)
            .unwrap();
        assert_eq!((old.full_size(), old.decode_tokens), (1, None));
        assert!(old.prediction.as_ref().unwrap().speedup < 0.6);
        // Fixed mode with one node decodes `max_tokens` at a time; off means never.
        let fixed = TreeConfig {
            mode: "fixed".into(),
            nodes: 1,
            ..TreeConfig::default()
        };
        let on = Planner::new(&fixed, 8)
            .unwrap()
            .with_fallback(&FallbackConfig::default());
        assert_eq!(
            on.plan(None, true, &RankCounts::default(), None, 1.0, true)
                .unwrap()
                .decode_tokens,
            Some(32)
        );
        let off = Planner::new(&fixed, 8)
            .unwrap()
            .with_fallback(&FallbackConfig {
                enabled: false,
                ..FallbackConfig::default()
            });
        assert_eq!(
            off.plan(None, true, &RankCounts::default(), None, 1.0, true)
                .unwrap()
                .decode_tokens,
            None
        );
    }

    #[test]
    fn bad_tree_settings_are_refused() {
        let cfg = TreeConfig {
            mode: "magic".into(),
            ..TreeConfig::default()
        };
        assert!(Planner::new(&cfg, 8).unwrap_err().contains("tree.mode"));
        let cfg = TreeConfig {
            acceptance: vec![0.9, 0.9],
            ..TreeConfig::default()
        };
        assert!(Planner::new(&cfg, 8)
            .unwrap_err()
            .contains("tree.acceptance"));
        for share in [-0.1, 1.5, f64::NAN] {
            let cfg = TreeConfig {
                drift_relax: share,
                ..TreeConfig::default()
            };
            assert!(Planner::new(&cfg, 8)
                .unwrap_err()
                .contains("tree.drift_relax"));
        }
    }

    /// A node that decodes while waiting makes the trees drafted after their verdict cheaper
    /// in the plan (40 ms away, a draft a fifth of the target), for a session alone on it; a
    /// node batching others does not, and the plan is priced as before.
    #[test]
    fn a_node_that_decodes_while_waiting_lowers_the_price_of_a_step_for_a_lone_session() {
        let verify = CostCurve::new(vec![1, 4, 8, 16], vec![80.0, 95.0, 120.0, 200.0]).unwrap();
        let (planner, mut costs) = auto_planner([16.0, 30.0], verify);
        costs.network.rtt_ms = 40.0;
        let step = |costs: &NodeCosts, load: f64| {
            let plan = planner
                .plan(Some(costs), true, &RankCounts::default(), None, load, true)
                .unwrap();
            assert!(plan.full_size() > 1, "trees pay here");
            let p = plan.prediction.unwrap();
            p.step_ms / p.expected_tokens
        };
        let (off_alone, off_loaded) = (step(&costs, 1.0), step(&costs, 4.0));
        costs.decodes_while_waiting = true;
        let (on_alone, on_loaded) = (step(&costs, 1.0), step(&costs, 4.0));
        assert!(on_alone < 0.9 * off_alone, "{on_alone} vs {off_alone}");
        assert_eq!(on_loaded, off_loaded);
    }
}
