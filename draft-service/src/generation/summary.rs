//! The final chunk's statistics: tokens, steps, acceptance by rank (counted by
//! `sequoia_core::stats`), timings, finish reason, seed, verify node and tree plan.

use super::Generation;
use sequoia_core::types::FinishReason;
use sequoia_proto::v1::{GenerateSummary, Timings, TreePlan};
use sequoia_server::metrics::Metrics;
use std::time::{Duration, Instant};

/// Record a finished generation (its final summary) in the metrics.
pub fn record_summary(metrics: &Metrics, s: &GenerateSummary) {
    let round_trip_ms = s
        .timings
        .as_ref()
        .map_or(0.0, |t| t.verify_ms + t.network_ms);
    metrics.generation(
        s.generated_tokens as u64,
        s.steps as u64,
        &s.accepted_by_rank,
        &s.trials_by_rank,
        Duration::from_secs_f64(round_trip_ms.max(0.0) / 1e3),
    );
    metrics.fallback_tokens(s.fallback_tokens as u64);
}

/// Where one generation's time went.
#[derive(Debug, Default)]
pub(super) struct StepTimes {
    pub prefill_ms: f64,
    /// Drafting, all steps.
    pub draft: Duration,
    /// Target forward time as the verify node measured it.
    pub verify_ms: f64,
    /// Send tree → receive verdict, as this node measured it (verify time included).
    pub roundtrip: Duration,
}

impl Generation<'_> {
    pub(super) fn summary(
        &self,
        finish: FinishReason,
        t_start: Instant,
        generating: Duration,
    ) -> GenerateSummary {
        let n = self.generated.len();
        let steps = self.steps();
        let by_rank = self.counts.by_rank();
        let gen_secs = generating.as_secs_f64();
        let t = &self.times;
        GenerateSummary {
            prompt_tokens: self.prep.prompt_tokens.len() as u32,
            generated_tokens: n as u32,
            steps,
            mean_tokens_per_step: if steps > 0 {
                n as f64 / steps as f64
            } else {
                0.0
            },
            accepted_by_rank: by_rank.accepted,
            trials_by_rank: by_rank.trials,
            timings: Some(Timings {
                total_ms: t_start.elapsed().as_secs_f64() * 1e3,
                prefill_ms: t.prefill_ms,
                draft_ms: t.draft.as_secs_f64() * 1e3,
                verify_ms: t.verify_ms,
                network_ms: (t.roundtrip.as_secs_f64() * 1e3 - t.verify_ms).max(0.0),
                tokens_per_second: if gen_secs > 0.0 {
                    n as f64 / gen_secs
                } else {
                    0.0
                },
            }),
            finish_reason: finish.as_str().into(),
            seed: self.prep.seed,
            verify_node: self.link.addr().to_string(),
            failovers: self.link.failovers(),
            lookup_proposed: self.lookup_proposed,
            lookup_accepted: self.lookup_accepted,
            drafted_tokens: self.drafted,
            plan: Some(self.plan_message()),
            pipeline_hits: self.pipeline_hits,
            pipeline_misses: self.pipeline_misses,
            pipeline_wasted_ms: self.pipeline_wasted.as_secs_f64() * 1e3,
            fallback_tokens: self.fallback_tokens,
            first_tree_early: self.first_tree_early,
            first_tree_with_open: self.first_tree_with_open,
            trees_sent_ahead: self.link.ahead_sent(),
            trees_taken_ahead: self.ahead_taken,
        }
    }

    /// The plan the summary reports: the planner's, or the tree the request forced.
    fn plan_message(&self) -> TreePlan {
        match &self.prep.forced_tree {
            None => self.plan.to_proto(self.replans),
            Some(t) => TreePlan {
                parents: t.parents().to_vec(),
                nodes: t.len() as u32,
                levels: t.levels() as u32,
                expected_tokens_per_step: sequoia_core::planner::expected_tokens(
                    t,
                    &self.plan.acceptance,
                ),
                mode: "request".into(),
                acceptance: self.plan.acceptance.clone(),
                ..Default::default()
            },
        }
    }
}
