//! Acceptance statistics: what the verifier accepted, by rank and by depth.
//!
//! The convention (docs/ALGORITHMS.md §6): at every node on the accepted path, including the
//! root and the node where the path stops, each of its `c` children was a *trial* for ranks
//! 1..=c (the verifier tries children in rank order and each rank is reached only if all lower
//! ones were rejected, so counting a trial for every rank the node has is what makes
//! `accepted[r] / trials[r]` the probability the Sequoia DP needs: the chance that rank r+1 is
//! accepted given the node was reached). The child that was accepted, if any, adds one to
//! `accepted[rank - 1]`. Generation summaries, the acceptance measurement, the benchmark report
//! and the planner's running estimate all count with [`AcceptanceCounts::record_step`].

use serde::{Deserialize, Serialize};

use crate::tree::Tree;

/// Accepted and tried counts per rank (index 0 = the draft's most likely child).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankCounts {
    pub accepted: Vec<u64>,
    pub trials: Vec<u64>,
}

impl RankCounts {
    pub fn new(accepted: Vec<u64>, trials: Vec<u64>) -> Self {
        let mut c = RankCounts { accepted, trials };
        c.fit(c.accepted.len().max(c.trials.len()));
        c
    }

    fn fit(&mut self, ranks: usize) {
        if self.trials.len() < ranks {
            self.trials.resize(ranks, 0);
        }
        if self.accepted.len() < ranks {
            self.accepted.resize(ranks, 0);
        }
    }

    /// Add another set of counts (ranks beyond this one's are appended).
    pub fn add(&mut self, other: &RankCounts) {
        self.fit(other.accepted.len().max(other.trials.len()));
        for (a, b) in self.accepted.iter_mut().zip(&other.accepted) {
            *a += b;
        }
        for (a, b) in self.trials.iter_mut().zip(&other.trials) {
            *a += b;
        }
    }

    /// What was counted since `earlier` (a previous snapshot of the same counter).
    pub fn since(&self, earlier: &RankCounts) -> RankCounts {
        let sub = |now: &[u64], before: &[u64]| -> Vec<u64> {
            now.iter()
                .enumerate()
                .map(|(i, &x)| x.saturating_sub(before.get(i).copied().unwrap_or(0)))
                .collect()
        };
        RankCounts {
            accepted: sub(&self.accepted, &earlier.accepted),
            trials: sub(&self.trials, &earlier.trials),
        }
    }

    /// Whether any trial was counted.
    pub fn is_empty(&self) -> bool {
        self.trials.iter().all(|&t| t == 0)
    }

    /// Estimate p_r for the ranks of `prior`, shrunk towards `prior` with the weight of
    /// `prior_trials` pseudo-trials (so few observations move it little); sums to ≤ 1.
    pub fn estimate(&self, prior: &[f64], prior_trials: f64) -> Vec<f64> {
        let p = prior
            .iter()
            .enumerate()
            .map(|(r, &pr)| {
                let acc = self.accepted.get(r).copied().unwrap_or(0) as f64;
                let tri = self.trials.get(r).copied().unwrap_or(0) as f64;
                (acc + prior_trials * pr) / (tri + prior_trials)
            })
            .collect();
        normalized_acceptance(p)
    }

    /// An optimistic acceptance vector: each p_r of [`estimate`](Self::estimate) raised by `z`
    /// standard errors (prior pseudo-trials counted), so it tightens as verdicts accumulate.
    pub fn upper_estimate(&self, prior: &[f64], prior_trials: f64, z: f64) -> Vec<f64> {
        let up = self
            .estimate(prior, prior_trials)
            .iter()
            .enumerate()
            .map(|(r, &p)| {
                let n = self.trials.get(r).copied().unwrap_or(0) as f64 + prior_trials;
                (p + z * (p * (1.0 - p) / n).sqrt()).min(1.0)
            })
            .collect();
        normalized_acceptance(up)
    }

    /// `accepted[r] / trials[r]` for the first `ranks` ranks (0 where nothing was tried).
    pub fn rates(&self, ranks: usize) -> Vec<f64> {
        (0..ranks)
            .map(|r| {
                let t = self.trials.get(r).copied().unwrap_or(0);
                let a = self.accepted.get(r).copied().unwrap_or(0);
                ratio(a, t)
            })
            .collect()
    }
}

/// `a / t`, 0 when `t` is 0.
pub fn ratio(a: u64, t: u64) -> f64 {
    if t == 0 {
        0.0
    } else {
        a as f64 / t as f64
    }
}

/// Counts per depth and rank, plus steps and committed tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AcceptanceCounts {
    /// `by_depth[d]`: trials and acceptances of the children of path nodes at depth `d`.
    pub by_depth: Vec<RankCounts>,
    /// Verification steps recorded.
    pub steps: u64,
    /// Tokens committed by those steps (accepted nodes plus the corrected/bonus token).
    pub tokens: u64,
}

impl AcceptanceCounts {
    /// Record one verified step: `accepted` are the accepted node indices (root excluded, in
    /// path order) and `ranks` the 1-based rank of each accepted node among its siblings;
    /// `tokens` what the step committed. Ranks that do not name a child of the path node
    /// (possible only from a faulty peer) are ignored rather than trusted.
    pub fn record_step(
        &mut self,
        tree: &Tree,
        accepted: &[usize],
        ranks: impl IntoIterator<Item = usize>,
        tokens: usize,
    ) {
        let path = std::iter::once(0usize).chain(accepted.iter().copied());
        let mut ranks = ranks.into_iter();
        for v in path {
            let rank = ranks.next();
            if v >= tree.len() {
                break;
            }
            let c = tree.children(v).len();
            let d = tree.depth(v);
            if self.by_depth.len() <= d {
                self.by_depth.resize(d + 1, RankCounts::default());
            }
            let row = &mut self.by_depth[d];
            row.fit(c);
            for t in &mut row.trials[..c] {
                *t += 1;
            }
            if let Some(rank) = rank {
                if (1..=c).contains(&rank) {
                    row.accepted[rank - 1] += 1;
                }
            }
        }
        self.steps += 1;
        self.tokens += tokens as u64;
    }

    /// All depths together.
    pub fn by_rank(&self) -> RankCounts {
        let mut all = RankCounts::default();
        for row in &self.by_depth {
            all.add(row);
        }
        all
    }

    /// Mean committed tokens per step (0 before the first step).
    pub fn tokens_per_step(&self) -> f64 {
        ratio(self.tokens, self.steps)
    }

    /// Acceptance vector over `ranks` ranks, all depths together, as the DP takes it: nodes
    /// where q offered fewer than `ranks` tokens try fewer ranks, which can push the rates' sum
    /// over 1; then they are scaled to sum to 1.
    pub fn acceptance_vector(&self, ranks: usize) -> Vec<f64> {
        normalized_acceptance(self.by_rank().rates(ranks))
    }
}

/// Scale an acceptance vector down to sum at most 1 (the DP's precondition).
pub fn normalized_acceptance(mut p: Vec<f64>) -> Vec<f64> {
    let sum: f64 = p.iter().sum();
    if sum > 1.0 {
        p.iter_mut().for_each(|x| *x /= sum);
    }
    p
}

/// How far the first-rank acceptance of single generations spreads around the node's mean, and
/// so how much a generation's own verdicts should count against everyone's (docs/ALGORITHMS.md
/// §6, "How much a generation's own verdicts count"). Prompts differ: a translation's draft may
/// be accepted half as often as a math answer's, and a short answer is over before a fixed,
/// heavy prior lets its own verdicts speak. The weight is the beta-binomial method of moments:
/// a node-wide prior Beta(k·m, k·(1 − m)) whose spread matches the spread between generations
/// has k = m(1 − m)/τ² − 1, where τ² is the variance of the generations' rates less the
/// binomial noise their trial counts explain.
#[derive(Debug, Clone, Default)]
pub struct AcceptanceSpread {
    /// (accepted, trials) at rank 1 of recent finished generations, oldest first.
    recent: std::collections::VecDeque<(u64, u64)>,
}

impl AcceptanceSpread {
    /// Generations remembered.
    pub const KEEP: usize = 64;
    /// First-rank trials a generation needs to be counted (fewer say little about its rate).
    pub const MIN_TRIALS: u64 = 8;
    /// Generations needed before the spread replaces the default weight.
    pub const MIN_GENERATIONS: usize = 5;

    /// Remember a finished generation's counts (ignored below [`Self::MIN_TRIALS`]).
    pub fn record(&mut self, own: &RankCounts) {
        let (a, t) = (
            own.accepted.first().copied().unwrap_or(0),
            own.trials.first().copied().unwrap_or(0),
        );
        if t < Self::MIN_TRIALS {
            return;
        }
        if self.recent.len() == Self::KEEP {
            self.recent.pop_front();
        }
        self.recent.push_back((a.min(t), t));
    }

    /// Generations remembered.
    pub fn len(&self) -> usize {
        self.recent.len()
    }

    pub fn is_empty(&self) -> bool {
        self.recent.is_empty()
    }

    /// The node-wide estimate's weight in pseudo-trials, within `min..=max`: `default` until
    /// [`Self::MIN_GENERATIONS`] generations are remembered; `max` when the rates spread no
    /// more than their trial counts explain (all prompts alike), and smaller the more they do.
    pub fn prior_trials(&self, default: f64, min: f64, max: f64) -> f64 {
        let n = self.recent.len();
        if n < Self::MIN_GENERATIONS {
            return default.clamp(min, max);
        }
        let (acc, tri) = self
            .recent
            .iter()
            .fold((0u64, 0u64), |(a, t), &(x, y)| (a + x, t + y));
        let m = acc as f64 / tri as f64;
        let binomial = m * (1.0 - m);
        if binomial <= 0.0 {
            // Every draft accepted (or none): nothing to tell prompts apart by.
            return max;
        }
        let spread = self
            .recent
            .iter()
            .map(|&(a, t)| (a as f64 / t as f64 - m).powi(2))
            .sum::<f64>()
            / (n - 1) as f64;
        let noise = binomial
            * self
                .recent
                .iter()
                .map(|&(_, t)| 1.0 / t as f64)
                .sum::<f64>()
            / n as f64;
        let between = spread - noise;
        if between <= binomial / (max + 1.0) {
            return max;
        }
        (binomial / between - 1.0).clamp(min, max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Root with 3 children; child 1 (rank 2) has 2 children; its child (rank 1) is accepted.
    fn tree() -> Tree {
        Tree::from_parents(&[-1, 0, 0, 0, 2, 2]).unwrap()
    }

    #[test]
    fn records_trials_for_every_rank_of_every_path_node() {
        let t = tree();
        let mut c = AcceptanceCounts::default();
        // Path: root → node 2 (rank 2) → node 4 (rank 1); node 4 has no children.
        c.record_step(&t, &[2, 4], [2, 1], 3);
        assert_eq!(c.by_depth[0], RankCounts::new(vec![0, 1, 0], vec![1, 1, 1]));
        assert_eq!(c.by_depth[1], RankCounts::new(vec![1, 0], vec![1, 1]));
        // The leaf at depth 2 has no children: no trials there.
        assert!(c.by_depth.get(2).is_none_or(|r| r.is_empty()));
        assert_eq!(c.by_rank(), RankCounts::new(vec![1, 1, 0], vec![2, 2, 1]));
        assert_eq!(c.tokens_per_step(), 3.0);
    }

    #[test]
    fn rejection_at_root_counts_trials_only() {
        let t = tree();
        let mut c = AcceptanceCounts::default();
        c.record_step(&t, &[], [], 1);
        assert_eq!(c.by_rank(), RankCounts::new(vec![0, 0, 0], vec![1, 1, 1]));
        assert_eq!(c.by_rank().rates(4), vec![0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn bad_ranks_and_nodes_are_ignored() {
        let t = tree();
        let mut c = AcceptanceCounts::default();
        c.record_step(&t, &[2, 99], [7, 0], 1);
        assert_eq!(c.by_rank().accepted.iter().sum::<u64>(), 0);
        assert_eq!(c.steps, 1);
    }

    #[test]
    fn since_and_add_are_inverse() {
        let a = RankCounts::new(vec![3, 1], vec![4, 4]);
        let mut b = a.clone();
        b.add(&RankCounts::new(vec![1, 0, 1], vec![2, 2, 1]));
        assert_eq!(b.since(&a), RankCounts::new(vec![1, 0, 1], vec![2, 2, 1]));
        assert_eq!(b.rates(2), vec![4.0 / 6.0, 1.0 / 6.0]);
    }

    #[test]
    fn acceptance_vector_is_normalized() {
        let mut c = AcceptanceCounts::default();
        c.by_depth = vec![RankCounts::new(vec![9, 1], vec![10, 3])];
        let p = c.acceptance_vector(2);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!(p[0] > p[1]);
    }

    #[test]
    fn spread_weight_follows_how_much_generations_differ() {
        let gen = |a: u64, t: u64| RankCounts::new(vec![a], vec![t]);
        let mut alike = AcceptanceSpread::default();
        let mut apart = AcceptanceSpread::default();
        assert_eq!(
            alike.prior_trials(16.0, 4.0, 32.0),
            16.0,
            "default before any data"
        );
        // Alike: every generation near 0.8 at 100 trials (binomial noise only).
        for a in [79, 81, 80, 78, 82, 80, 81, 79] {
            alike.record(&gen(a, 100));
        }
        // Apart: 0.4 to 0.95, as translation against math.
        for a in [40, 95, 60, 90, 50, 85, 45, 92] {
            apart.record(&gen(a, 100));
        }
        let (k_alike, k_apart) = (
            alike.prior_trials(16.0, 4.0, 32.0),
            apart.prior_trials(16.0, 4.0, 32.0),
        );
        assert_eq!(
            k_alike, 32.0,
            "alike generations: the node-wide estimate weighs most"
        );
        // Rates 0.4..0.95 around m ≈ 0.71: τ² ≈ 0.048, so k ≈ 0.21 / 0.048 − 1 ≈ 3.3 → 4.
        assert!(k_apart < 6.0, "{k_apart}");
        // Too few trials to count, and too few generations for a spread.
        let mut few = AcceptanceSpread::default();
        few.record(&gen(1, 3));
        assert!(few.is_empty());
        for a in [40, 95, 60, 90] {
            few.record(&gen(a, 100));
        }
        assert_eq!(few.prior_trials(16.0, 4.0, 32.0), 16.0);
        // Only the latest KEEP are remembered.
        for _ in 0..AcceptanceSpread::KEEP {
            apart.record(&gen(80, 100));
        }
        assert_eq!(apart.len(), AcceptanceSpread::KEEP);
        assert_eq!(
            apart.prior_trials(16.0, 4.0, 32.0),
            32.0,
            "the spread forgot the old ones"
        );
    }
}
