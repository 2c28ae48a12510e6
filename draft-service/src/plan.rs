//! Which tree to draft: either a fixed Sequoia tree for a configured acceptance vector and
//! budget, or (auto mode, the default) the tree the hardware- and network-aware planner
//! (`sequoia_core::planner::cost`) picks from measured costs: the verify node's t_v(n) from its
//! `Profile` RPC, the draft's own t_d(w), and RTT/bandwidth from `Ping`. The acceptance vector is
//! a running estimate from verdicts (separately for greedy and sampled generations), and the
//! plan is recomputed as it and the observed step times move.

use crate::config::{FallbackConfig, TreeConfig};
use sequoia_core::limits;
use sequoia_core::planner::cost::{
    choose_with_fallback, decode_tokens, CostCurve, NetworkProfile, NodeCosts, Prediction, Profile,
};
use sequoia_core::planner::{validate_acceptance, PlanError, SequoiaDp};
use sequoia_core::stats::RankCounts;
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

/// Weight of the node-wide estimate in a generation's own, in pseudo-trials: after about this
/// many verdicts at a rank, a generation's own acceptance counts as much as everyone's. Tasks
/// differ (two-host bench, T = 0: 2.1 tokens per step for role-play and translation, 4.3 for
/// math with the same trees), and one prompt's text is most like its own continuation.
const OWN_PRIOR_TRIALS: f64 = 16.0;

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
}

impl ActivePlan {
    /// Whether the auto planner made this plan (so probing applies).
    pub fn is_auto(&self) -> bool {
        self.mode == TreeMode::Auto
    }

    fn fixed(p: &[f64], nodes: usize, levels: usize) -> Result<Self, PlanError> {
        let (nodes, levels) = (nodes.max(1), levels.max(1));
        let dp = SequoiaDp::solve(p, nodes, levels)?;
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
        })
    }

    /// The planned tree, shrunk to at most `room` nodes.
    pub fn shape(&self, room: usize) -> Tree {
        self.dp.tree(room.clamp(1, self.nodes), self.levels)
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
            // A decode plan's step is one decode of K tokens: its prediction says so, where
            // the tree (the root alone) would say 1.
            expected_tokens_per_step: match (&self.prediction, self.decode_tokens) {
                (Some(p), Some(_)) => p.expected_tokens,
                _ => self.expected_tokens(),
            },
            mode: self.mode.as_str().into(),
            predicted_speedup: self.prediction.as_ref().map_or(0.0, |p| p.speedup),
            predicted_step_ms: self.prediction.as_ref().map_or(0.0, |p| p.step_ms),
            acceptance: self.acceptance.clone(),
            replans,
        }
    }
}

/// Observed/predicted ratios, smoothed, so the plan follows drift in the real step times.
#[derive(Debug, Clone, Copy)]
struct Drift {
    verify: f64,
    draft: f64,
}

#[derive(Debug)]
pub struct Planner {
    cfg: TreeConfig,
    wire_top_k: usize,
    auto: bool,
    draft_curve: Mutex<Option<CostCurve>>,
    greedy: Mutex<RankCounts>,
    sampled: Mutex<RankCounts>,
    drift: Mutex<Drift>,
    /// The decode fallback's settings; None = off.
    fallback: Option<FallbackConfig>,
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
        Ok(Self {
            cfg: cfg.clone(),
            wire_top_k,
            auto,
            draft_curve: Mutex::new(None),
            greedy: Mutex::new(RankCounts::default()),
            sampled: Mutex::new(RankCounts::default()),
            drift: Mutex::new(Drift {
                verify: 1.0,
                draft: 1.0,
            }),
            fallback: None,
        })
    }

    /// Serve "no speculation" with the decode fallback where the verify node takes it.
    pub fn with_fallback(mut self, fallback: &FallbackConfig) -> Self {
        self.fallback = fallback.enabled.then(|| fallback.clone());
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
    pub async fn measure_node(
        &self,
        mut client: crate::nodes::VerifyClient,
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
        })
    }

    fn counts(&self, greedy: bool) -> &Mutex<RankCounts> {
        if greedy {
            &self.greedy
        } else {
            &self.sampled
        }
    }

    /// Fold a finished (or ongoing) generation's verdict statistics into the running estimate.
    pub fn observe_acceptance(&self, greedy: bool, counts: &RankCounts) {
        self.counts(greedy).lock().unwrap().add(counts);
    }

    /// Fold observed step times into the drift factors (exponential smoothing).
    pub fn observe_times(&self, predicted: &Prediction, verify_ms: f64, draft_ms: f64) {
        let mut d = self.drift.lock().unwrap();
        let smooth = |old: f64, obs: f64, pred: f64| {
            if pred > 0.0 && obs > 0.0 {
                (0.8 * old + 0.2 * obs / pred).clamp(0.2, 5.0)
            } else {
                old
            }
        };
        d.verify = smooth(d.verify, verify_ms, predicted.verify_ms / d.verify);
        d.draft = smooth(d.draft, draft_ms, predicted.draft_ms / d.draft);
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
    /// (see [`OWN_PRIOR_TRIALS`]). They are already folded into the node-wide counts, so those
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
            .counts(greedy)
            .lock()
            .unwrap()
            .since(own)
            .estimate(&self.cfg.acceptance, PRIOR_TRIALS);
        let p = own.estimate(&others, OWN_PRIOR_TRIALS);
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
        let loaded = |c: &CostCurve| CostCurve {
            sizes: c.sizes.clone(),
            ms: c
                .sizes
                .iter()
                .map(|&s| c.at((s as f64 * load_sessions.max(1.0)).round() as usize))
                .collect(),
        };
        let profile = Profile {
            verify: loaded(&scale(&costs.verify, d.verify)),
            draft: scale(&draft, d.draft),
            network: costs.network,
            overhead_ms: 0.5,
            context: self.cfg.profile_context,
            note: String::new(),
        };
        let q = if greedy { 0 } else { self.wire_top_k };
        let (nodes, levels) = (self.cfg.nodes, self.cfg.max_levels);
        let decode = fallback.map(|f| decode_tokens(&profile, f.max_tokens, f.rtt_share));
        let auto = choose_with_fallback(&profile, &p, nodes, levels, q, pipeline_hit, decode)
            .map_err(|e| e.to_string())?;
        let best = auto.best;
        let mut plan = ActivePlan::fixed(&p, best.nodes, best.levels).map_err(|e| e.to_string())?;
        if best.nodes == 1 {
            let optimistic = self.counts(greedy).lock().unwrap().upper_estimate(
                &self.cfg.acceptance,
                PRIOR_TRIALS,
                PROBE_CONFIDENCE_Z,
            );
            let hope = choose_with_fallback(
                &profile,
                &optimistic,
                nodes,
                levels,
                q,
                pipeline_hit,
                decode,
            )
            .map_err(|e| e.to_string())?;
            plan.probe = hope.best.nodes > 1;
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
    }
}
