//! Tree shapes that maximize expected accepted tokens: the Sequoia dynamic program
//! (docs/ALGORITHMS.md §2), scoring of any tree under a positional acceptance vector, and the chain
//! and k×d (SpecInfer-style) baselines.
//!
//! Acceptance model: if a node is on the accepted path, its r-th child is the accepted one with
//! probability `p[r-1]`, independent of depth. A node's probability of being on the accepted path
//! is the product of its ancestors' ranks' probabilities; the expected tokens per step is the sum
//! of that over all nodes (the root counts 1: the correction/bonus token is always produced).
//!
//! [`cost`] turns this into a choice of tree size from measured hardware and network costs.

use crate::tree::{Tree, TreeLimits};
use serde::Serialize;

pub mod cost;

/// Levels used when the caller sets no depth limit. Deeper levels add at most p₁⁶⁴ per node.
pub const UNLIMITED_LEVELS: usize = 64;

/// Errors from planning inputs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("acceptance vector is empty")]
    EmptyAcceptance,
    #[error("acceptance[{index}] = {value} is not a probability in [0, 1]")]
    BadProbability { index: usize, value: f64 },
    #[error("acceptance vector sums to {0} > 1 (it is a distribution over the accepted rank)")]
    SumAboveOne(f64),
    #[error("node budget must be at least 1 (the root), got {0}")]
    NoNodes(usize),
    #[error("max levels must be at least 1 (the root), got {0}")]
    NoLevels(usize),
}

/// Check an acceptance vector: entries in [0, 1], sum ≤ 1 (+ rounding slack).
pub fn validate_acceptance(p: &[f64]) -> Result<(), PlanError> {
    if p.is_empty() {
        return Err(PlanError::EmptyAcceptance);
    }
    for (index, &value) in p.iter().enumerate() {
        if !(0.0..=1.0).contains(&value) {
            return Err(PlanError::BadProbability { index, value });
        }
    }
    let sum: f64 = p.iter().sum();
    if sum > 1.0 + 1e-6 {
        return Err(PlanError::SumAboveOne(sum));
    }
    Ok(())
}

/// Expected tokens per step of `tree` under acceptance vector `p` (ranks beyond `p.len()` never
/// accept).
pub fn expected_tokens(tree: &Tree, p: &[f64]) -> f64 {
    let mut f = vec![0.0f64; tree.len()];
    f[0] = 1.0;
    for v in 0..tree.len() {
        for (r, &c) in tree.children(v).iter().enumerate() {
            f[c as usize] = f[v] * p.get(r).copied().unwrap_or(0.0);
        }
    }
    f.iter().sum()
}

/// Expected tokens of a chain with `nodes` nodes (root + nodes−1 drafted tokens).
pub fn chain_expected(p: &[f64], nodes: usize) -> f64 {
    let p1 = p.first().copied().unwrap_or(0.0);
    (0..nodes).map(|i| p1.powi(i as i32)).sum()
}

/// Expected tokens of k independent chains of d drafted tokens: 1 + (Σ_{i≤k} p_i)(1 + p₁ + … + p₁^{d−1}).
pub fn k_by_d_expected(p: &[f64], k: usize, d: usize) -> f64 {
    if d == 0 || k == 0 {
        return 1.0;
    }
    let mass: f64 = p.iter().take(k).sum();
    1.0 + mass * chain_expected(p, d)
}

/// A baseline shape and its score.
#[derive(Debug, Clone, Serialize)]
pub struct Baseline {
    pub name: String,
    pub nodes: usize,
    pub levels: usize,
    pub expected_tokens: f64,
}

/// Best chain within the budget (the longest that fits both limits).
pub fn best_chain(p: &[f64], nodes: usize, max_levels: usize) -> Baseline {
    let n = nodes.min(max_levels).max(1);
    Baseline {
        name: format!("chain of {} drafted tokens", n - 1),
        nodes: n,
        levels: n,
        expected_tokens: chain_expected(p, n),
    }
}

/// Best k×d tree with 1 + k·d ≤ nodes and d + 1 ≤ max_levels (k ≥ 1, d ≥ 1).
pub fn best_k_by_d(p: &[f64], nodes: usize, max_levels: usize) -> Baseline {
    let mut best = Baseline {
        name: "root only".into(),
        nodes: 1,
        levels: 1,
        expected_tokens: 1.0,
    };
    for d in 1..max_levels.max(1) {
        for k in 1..=(nodes.saturating_sub(1) / d) {
            let g = k_by_d_expected(p, k, d);
            if g > best.expected_tokens + 1e-12 {
                best = Baseline {
                    name: format!("{k}x{d}"),
                    nodes: 1 + k * d,
                    levels: d + 1,
                    expected_tokens: g,
                };
            }
        }
    }
    best
}

/// Marker in `best_b`: the best tree within m nodes needs no more than m−1.
const FEWER: u16 = u16::MAX;

/// Solved Sequoia DP: the optimal expected tokens for every budget m ≤ `max_nodes` and level
/// limit l ≤ `max_levels`, and the trees that reach them.
pub struct SequoiaDp {
    max_nodes: usize,
    max_levels: usize,
    width: usize,
    /// best[l][m]: best expected tokens with at most m nodes and at most l levels (m ≥ 1).
    best: Vec<Vec<f64>>,
    /// best_b[l][m]: root degree achieving best[l][m], or [`FEWER`] when m−1 nodes do as well.
    best_b: Vec<Vec<u16>>,
    /// split[l][b][m]: argmax y (nodes kept by the root and its first b−1 subtrees) for T[m][l][b].
    split: Vec<Vec<Vec<u16>>>,
}

impl SequoiaDp {
    /// Run the DP for trees of up to `max_nodes` nodes and `max_levels` levels (root = 1 level)
    /// under acceptance vector `p` (its length is the widest rank considered).
    pub fn solve(p: &[f64], max_nodes: usize, max_levels: usize) -> Result<Self, PlanError> {
        validate_acceptance(p)?;
        if max_nodes == 0 {
            return Err(PlanError::NoNodes(0));
        }
        if max_levels == 0 {
            return Err(PlanError::NoLevels(0));
        }
        let n = max_nodes;
        let levels = max_levels.min(n);
        let width = p.len().min(n.saturating_sub(1)).max(1);
        let neg = f64::NEG_INFINITY;

        let mut best = vec![vec![neg; n + 1]; levels + 1];
        let mut best_b = vec![vec![0u16; n + 1]; levels + 1];
        let mut split = vec![vec![Vec::new(); width + 1]; levels + 1];
        // One level: the root alone, whatever the budget.
        best[1].iter_mut().skip(1).for_each(|g| *g = 1.0);
        best_b[1].iter_mut().skip(2).for_each(|b| *b = FEWER);
        // prev[m] = T[m][l][b−1]; cur[m] = T[m][l][b].
        let mut prev = vec![neg; n + 1];
        let mut cur = vec![neg; n + 1];
        let mut scaled = vec![0.0f64; n + 1];
        for l in 2..=levels {
            let (below, here) = best.split_at_mut(l);
            let child_best = &below[l - 1];
            let here_best = &mut here[0];
            let here_b = &mut best_b[l];
            prev.fill(neg);
            prev[1] = 1.0; // T[1][l][0]
            for b in 1..=width {
                let pb = p[b - 1];
                for (s, &c) in scaled.iter_mut().zip(child_best.iter()) {
                    *s = pb * c;
                }
                cur.fill(neg);
                let mut arg = vec![0u16; n + 1];
                // T[m][l][b] needs m ≥ b + 1: the root plus b children.
                for m in (b + 1)..=n {
                    let mut top = neg;
                    let mut top_y = 0usize;
                    // y = nodes of root + first b−1 subtrees (≥ b), rest = m − y ≥ 1 for child b.
                    for y in b..m {
                        let v = prev[y] + scaled[m - y];
                        if v > top {
                            top = v;
                            top_y = y;
                        }
                    }
                    cur[m] = top;
                    arg[m] = top_y as u16;
                }
                for m in (b + 1)..=n {
                    if cur[m] > here_best[m] + 1e-15 {
                        here_best[m] = cur[m];
                        here_b[m] = b as u16;
                    }
                }
                split[l][b] = arg;
                std::mem::swap(&mut prev, &mut cur);
            }
            // "At most m nodes": nodes worth nothing (ranks past W, or p = 0) are left out, so
            // a budget is never padded with dead weight and best[l] is monotone in m.
            here_best[1] = 1.0;
            for m in 2..=n {
                if here_best[m - 1] >= here_best[m] - 1e-12 {
                    here_best[m] = here_best[m - 1];
                    here_b[m] = FEWER;
                }
            }
        }
        Ok(Self {
            max_nodes: n,
            max_levels: levels,
            width,
            best,
            best_b,
            split,
        })
    }

    pub fn max_nodes(&self) -> usize {
        self.max_nodes
    }

    pub fn max_levels(&self) -> usize {
        self.max_levels
    }

    /// Best expected tokens with at most `nodes` nodes and at most `levels` levels.
    pub fn expected(&self, nodes: usize, levels: usize) -> f64 {
        let l = levels.min(self.max_levels).min(nodes);
        self.best[l][nodes]
    }

    /// The optimal tree with at most `nodes` nodes and at most `levels` levels (fewer only when
    /// extra nodes would add nothing).
    pub fn tree(&self, nodes: usize, levels: usize) -> Tree {
        assert!(
            nodes >= 1 && nodes <= self.max_nodes,
            "nodes out of the solved range"
        );
        let l = levels.min(self.max_levels).min(nodes).max(1);
        // Nested form: children lists per node id, built recursively, then relabelled BFS.
        let mut kids: Vec<Vec<usize>> = vec![Vec::new()];
        let mut work = vec![(0usize, nodes, l)];
        while let Some((id, mut m, l)) = work.pop() {
            while m > 1 && self.best_b[l][m] == FEWER {
                m -= 1;
            }
            if m == 1 {
                continue;
            }
            let mut b = self.best_b[l][m] as usize;
            let mut rest = m;
            let mut subtrees = Vec::with_capacity(b);
            while b >= 1 {
                let y = self.split[l][b][rest] as usize;
                subtrees.push(rest - y);
                rest = y;
                b -= 1;
            }
            debug_assert_eq!(rest, 1);
            subtrees.reverse(); // rank order: subtree of child 1 first
            for size in subtrees {
                let child = kids.len();
                kids.push(Vec::new());
                kids[id].push(child);
                work.push((child, size, l - 1));
            }
        }
        // BFS relabel keeps children in rank order and levels contiguous.
        let mut parents = vec![-1i32];
        let mut queue = std::collections::VecDeque::from([(0usize, 0usize)]);
        while let Some((old, new)) = queue.pop_front() {
            for &c in &kids[old] {
                let idx = parents.len();
                parents.push(new as i32);
                queue.push_back((c, idx));
            }
        }
        let limits = TreeLimits {
            max_nodes: usize::MAX,
            max_levels: usize::MAX,
        };
        Tree::from_parents_limited(&parents, limits).expect("DP trees are valid")
    }

    /// The widest rank the DP considered.
    pub fn width(&self) -> usize {
        self.width
    }
}

/// A planned tree and its score, with the baselines at the same budget.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub expected_tokens: f64,
    pub nodes: usize,
    pub levels: usize,
    pub parents: Vec<i32>,
    pub widths: Vec<usize>,
    pub baselines: Baselines,
}

#[derive(Debug, Clone, Serialize)]
pub struct Baselines {
    pub chain: Baseline,
    pub k_by_d: Baseline,
}

/// Plan the best tree of `nodes` nodes within `max_levels` levels (None = unlimited, capped at
/// [`UNLIMITED_LEVELS`]).
pub fn plan(p: &[f64], nodes: usize, max_levels: Option<usize>) -> Result<Plan, PlanError> {
    let levels = max_levels.unwrap_or(UNLIMITED_LEVELS);
    let dp = SequoiaDp::solve(p, nodes, levels)?;
    let tree = dp.tree(nodes, levels);
    Ok(Plan {
        expected_tokens: dp.expected(nodes, levels),
        nodes: tree.len(),
        levels: tree.levels(),
        parents: tree.parents().to_vec(),
        widths: tree.widths().to_vec(),
        baselines: Baselines {
            chain: best_chain(p, nodes, levels),
            k_by_d: best_k_by_d(p, nodes, levels),
        },
    })
}

/// The acceptance vector of docs/ALGORITHMS.md §2 (W = 32), used in tests and examples.
pub const EXAMPLE_ACCEPTANCE: [f64; 32] = [
    0.6342, 0.1079, 0.0570, 0.0225, 0.0195, 0.0150, 0.0045, 0.0030, 0.0120, 0.0045, 0.0075, 0.0045,
    0.0060, 0.0030, 0.0015, 0.0030, 0.0015, 0.0030, 0.0000, 0.0030, 0.0030, 0.0030, 0.0000, 0.0015,
    0.0000, 0.0015, 0.0000, 0.0000, 0.0000, 0.0015, 0.0015, 0.0015,
];

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn worked_numbers() {
        let p = EXAMPLE_ACCEPTANCE;
        let dp = SequoiaDp::solve(&p, 128, 14).unwrap();
        for (n, want) in [(16, 3.1303), (32, 3.5008), (64, 3.8524), (128, 4.1923)] {
            let got = dp.expected(n, 10);
            assert!((got - want).abs() < 1e-3, "n={n}: {got} vs {want}");
            let tree = dp.tree(n, 10);
            assert_eq!(
                tree.len(),
                n,
                "every node is worth something under this vector"
            );
            assert!(tree.levels() <= 10);
            assert!((expected_tokens(&tree, &p) - got).abs() < 1e-9);
        }
        assert!((dp.expected(128, 14) - 4.2022).abs() < 1e-3);
        assert!((chain_expected(&p, 10_000) - 1.0 / (1.0 - 0.6342)).abs() < 1e-3);
        let kd = k_by_d_expected(&p, 16, 8);
        assert!((kd - 3.41).abs() < 0.01, "{kd}");
        assert!((expected_tokens(&Tree::k_by_d(16, 8), &p) - kd).abs() < 1e-12);
        let plan = plan(&p, 128, Some(10)).unwrap();
        assert!((plan.expected_tokens - 4.1923).abs() < 1e-3);
        assert!(plan.baselines.k_by_d.expected_tokens < plan.expected_tokens);
        assert!(plan.baselines.chain.expected_tokens < plan.baselines.k_by_d.expected_tokens);
    }

    /// Every ordered tree shape with exactly n nodes, as canonical BFS parent arrays.
    fn all_trees(n: usize) -> Vec<Tree> {
        // Enumerate rooted ordered trees as nested child-count sequences via parent arrays where
        // parents are non-decreasing (BFS order with grouped children): every ordered tree has
        // exactly one such array.
        let mut out = Vec::new();
        let mut parents = vec![-1i32];
        fn rec(parents: &mut Vec<i32>, n: usize, out: &mut Vec<Tree>) {
            if parents.len() == n {
                if let Ok(t) = Tree::from_parents_limited(
                    parents,
                    TreeLimits {
                        max_nodes: 64,
                        max_levels: 64,
                    },
                ) {
                    out.push(t);
                }
                return;
            }
            let lo = if parents.len() == 1 {
                0
            } else {
                (*parents.last().unwrap()).max(0)
            };
            for p in lo..parents.len() as i32 {
                parents.push(p);
                rec(parents, n, out);
                parents.pop();
            }
        }
        rec(&mut parents, n, &mut out);
        out
    }

    #[test]
    fn dp_matches_brute_force() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for trial in 0..20 {
            let w = 1 + trial % 5;
            let mut p: Vec<f64> = (0..w).map(|_| rng.gen::<f64>()).collect();
            let s: f64 = p.iter().sum::<f64>() + rng.gen::<f64>() * 0.5;
            p.iter_mut().for_each(|x| *x /= s);
            let dp = SequoiaDp::solve(&p, 8, 8).unwrap();
            let trees: Vec<Vec<Tree>> = (0..=8)
                .map(|n| if n == 0 { vec![] } else { all_trees(n) })
                .collect();
            for n in 1..=8 {
                for l in 1..=n {
                    let brute = (1..=n)
                        .flat_map(|k| trees[k].iter())
                        .filter(|t| t.levels() <= l)
                        .map(|t| expected_tokens(t, &p))
                        .fold(f64::NEG_INFINITY, f64::max);
                    let got = dp.expected(n, l);
                    assert!(
                        (got - brute).abs() < 1e-9,
                        "n={n} l={l} p={p:?}: {got} vs {brute}"
                    );
                    let t = dp.tree(n, l);
                    assert!(t.len() <= n);
                    assert!(t.levels() <= l);
                    assert!((expected_tokens(&t, &p) - got).abs() < 1e-9);
                }
            }
        }
    }

    #[test]
    fn enumeration_counts_catalan() {
        // Ordered trees with n nodes: Catalan(n−1).
        let counts: Vec<usize> = (1..=7).map(|n| all_trees(n).len()).collect();
        assert_eq!(counts, vec![1, 1, 2, 5, 14, 42, 132]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert_eq!(
            SequoiaDp::solve(&[], 4, 4).err(),
            Some(PlanError::EmptyAcceptance)
        );
        assert!(matches!(
            SequoiaDp::solve(&[0.5, -0.1], 4, 4),
            Err(PlanError::BadProbability { index: 1, .. })
        ));
        assert!(matches!(
            SequoiaDp::solve(&[0.7, 0.7], 4, 4),
            Err(PlanError::SumAboveOne(_))
        ));
        assert!(matches!(
            SequoiaDp::solve(&[0.5], 0, 4),
            Err(PlanError::NoNodes(0))
        ));
        assert!(matches!(
            plan(&[f64::NAN], 4, None),
            Err(PlanError::BadProbability { .. })
        ));
    }

    #[test]
    fn large_budget_is_consistent() {
        let dp = SequoiaDp::solve(&EXAMPLE_ACCEPTANCE, 300, 20).unwrap();
        let mut last = 0.0;
        for n in [1, 2, 50, 100, 200, 300] {
            let g = dp.expected(n, 20);
            assert!(g >= last);
            last = g;
            let t = dp.tree(n, 20);
            assert!((expected_tokens(&t, &EXAMPLE_ACCEPTANCE) - g).abs() < 1e-9);
        }
    }
}
