//! Exact tree verification (docs/ALGORITHMS.md §4).
//!
//! Given a drafted tree (shape, tokens, and the draft distribution q each expanded node's
//! children were sampled from), walk down from the root: at each node try its children in rank
//! order, accepting child c with probability min(1, p(c)/q(c)); after a rejection replace p by the
//! normalized residual max(p − q, 0) and drop the rejected token from q (the children were drawn
//! without replacement). When no child is accepted, or at a leaf, emit one token from the current
//! p. The emitted sequence is distributed exactly as the target's own sampling. At T = 0 the rule
//! is simply: follow the child equal to the target's argmax, then emit the argmax.
//!
//! Everything here treats its inputs as untrusted: [`Step::new`] checks a tree, its tokens and
//! its q's and names the problem; verification itself never panics and never produces NaN.

use crate::sampling::{
    argmax, probs_from_logits, sample_dense, SamplingParams, SessionRng, SparseDist,
};
use crate::tree::Tree;
use serde::Serialize;

/// Slack allowed on a q's total mass (f32 rounding on the wire).
const MASS_SLACK: f64 = 1e-3;

/// Residual mass below which it is treated as zero (only reachable when p ≈ q).
const DEGENERATE_MASS: f64 = 1e-9;

/// Why a step's input cannot be verified.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StepError {
    #[error("tokens has {got} entries but the tree has {nodes} nodes")]
    TokenCount { got: usize, nodes: usize },
    #[error("tokens[{index}] = {token} is outside the vocabulary (size {vocab})")]
    TokenOutOfVocab {
        index: usize,
        token: u32,
        vocab: usize,
    },
    #[error("draft_dists has {got} entries but the tree has {expected} nodes with children")]
    DistCount { got: usize, expected: usize },
    #[error("draft_dists[{index}]: tokens has {tokens} entries but probs has {probs}")]
    DistLengths {
        index: usize,
        tokens: usize,
        probs: usize,
    },
    #[error("draft_dists[{index}]: token {token} is outside the vocabulary (size {vocab})")]
    DistTokenOutOfVocab {
        index: usize,
        token: u32,
        vocab: usize,
    },
    #[error("draft_dists[{index}]: token {token} appears twice")]
    DistDuplicate { index: usize, token: u32 },
    #[error("draft_dists[{index}]: probability {value} is not finite and ≥ 0")]
    DistBadProb { index: usize, value: f32 },
    #[error("draft_dists[{index}]: probabilities sum to {sum}, expected a total in (0, 1]")]
    DistMass { index: usize, sum: f64 },
    #[error("node {child}: token {token} has probability 0 under its parent's draft distribution, so it cannot have been sampled from it")]
    ChildNotInDist { child: usize, token: u32 },
    #[error("node {child}: token {token} repeats a sibling's token (children are drawn without replacement)")]
    DuplicateSibling { child: usize, token: u32 },
}

/// A validated verification input.
#[derive(Debug)]
pub struct Step<'a> {
    tree: &'a Tree,
    tokens: &'a [u32],
    dists: &'a [SparseDist],
    /// dist_of[v] = index into `dists` of node v's q (expanded nodes only).
    dist_of: Vec<Option<usize>>,
}

impl<'a> Step<'a> {
    /// Check tokens and draft distributions against the tree. `dists` holds one q per node with
    /// children, in node order; it may be empty for greedy verification (`need_dists = false`).
    pub fn new(
        tree: &'a Tree,
        tokens: &'a [u32],
        dists: &'a [SparseDist],
        vocab: usize,
        need_dists: bool,
    ) -> Result<Self, StepError> {
        if tokens.len() != tree.len() {
            return Err(StepError::TokenCount {
                got: tokens.len(),
                nodes: tree.len(),
            });
        }
        if let Some((index, &token)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(StepError::TokenOutOfVocab {
                index,
                token,
                vocab,
            });
        }
        let expanded: Vec<usize> = tree.expanded_nodes().collect();
        let use_dists = need_dists || !dists.is_empty();
        let mut dist_of = vec![None; tree.len()];
        if use_dists {
            if dists.len() != expanded.len() {
                return Err(StepError::DistCount {
                    got: dists.len(),
                    expected: expanded.len(),
                });
            }
            for (index, q) in dists.iter().enumerate() {
                validate_dist(index, q, vocab)?;
            }
            for (i, &v) in expanded.iter().enumerate() {
                dist_of[v] = Some(i);
            }
        }
        // Siblings are distinct tokens, each possible under the parent's q.
        for &v in &expanded {
            let children = tree.children(v);
            for (r, &c) in children.iter().enumerate() {
                let token = tokens[c as usize];
                if children[..r].iter().any(|&s| tokens[s as usize] == token) {
                    return Err(StepError::DuplicateSibling {
                        child: c as usize,
                        token,
                    });
                }
                if let Some(i) = dist_of[v] {
                    if dists[i].prob(token) <= 0.0 {
                        return Err(StepError::ChildNotInDist {
                            child: c as usize,
                            token,
                        });
                    }
                }
            }
        }
        Ok(Self {
            tree,
            tokens,
            dists,
            dist_of,
        })
    }

    pub fn tree(&self) -> &Tree {
        self.tree
    }

    pub fn tokens(&self) -> &[u32] {
        self.tokens
    }
}

fn validate_dist(index: usize, q: &SparseDist, vocab: usize) -> Result<(), StepError> {
    if q.tokens.len() != q.probs.len() {
        return Err(StepError::DistLengths {
            index,
            tokens: q.tokens.len(),
            probs: q.probs.len(),
        });
    }
    let mut sum = 0.0f64;
    let mut seen = std::collections::HashSet::with_capacity(q.tokens.len());
    for (&token, &value) in q.tokens.iter().zip(&q.probs) {
        if token as usize >= vocab {
            return Err(StepError::DistTokenOutOfVocab {
                index,
                token,
                vocab,
            });
        }
        if !seen.insert(token) {
            return Err(StepError::DistDuplicate { index, token });
        }
        if !value.is_finite() || value < 0.0 {
            return Err(StepError::DistBadProb { index, value });
        }
        sum += value as f64;
    }
    if sum <= 0.0 || sum > 1.0 + MASS_SLACK {
        return Err(StepError::DistMass { index, sum });
    }
    Ok(())
}

/// The outcome of verifying one tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// Accepted non-root nodes, root to leaf.
    pub accepted: Vec<usize>,
    /// 1-based rank of each accepted node among its siblings.
    pub ranks: Vec<usize>,
    /// The correction or bonus token: the next tree's root.
    pub next_token: u32,
}

impl Verdict {
    /// Tokens this step commits: the accepted tokens, then the next token.
    pub fn emitted(&self, tokens: &[u32]) -> Vec<u32> {
        let mut out: Vec<u32> = self.accepted.iter().map(|&c| tokens[c]).collect();
        out.push(self.next_token);
        out
    }
}

/// Verify with the target's logits per node: greedy when `params` is greedy, else the exact
/// stochastic rule with the target distribution `probs_from_logits(row, params)`. Only rows on
/// the walked path are turned into distributions.
pub fn verify_with_logits<'r>(
    step: &Step<'_>,
    logits_row: impl Fn(usize) -> &'r [f32],
    params: &SamplingParams,
    rng: &mut SessionRng,
) -> Verdict {
    walk(|v| decide_with_logits(step, v, logits_row(v), params, rng))
}

/// What the rule decides at one node of the walk: one of its children accepted (the child's
/// index and its 1-based rank among the siblings), or the token that comes next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Accept { child: usize, rank: usize },
    Next(u32),
}

/// The rule's decision at node `v` from the target's logits there, drawing from `rng` exactly
/// what [`verify_with_logits`] draws at that node. Each node's decision needs only its own
/// row, so a caller that has the root's row before the rest of the tree (the verify node's
/// decode while it waits) can decide the root first and forward only the accepted child's
/// subtree, for the verdict the whole tree would get.
pub fn decide_with_logits(
    step: &Step<'_>,
    v: usize,
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut SessionRng,
) -> Decision {
    if params.is_greedy() {
        decide_greedy(step, v, argmax(logits))
    } else {
        decide_stochastic(step, v, || probs_from_logits(logits, params), rng)
    }
}

/// Walk down from the root, deciding at each node until a next token comes.
fn walk(mut decide: impl FnMut(usize) -> Decision) -> Verdict {
    let mut verdict = Verdict {
        accepted: Vec::new(),
        ranks: Vec::new(),
        next_token: 0,
    };
    let mut v = 0;
    loop {
        match decide(v) {
            Decision::Accept { child, rank } => {
                verdict.accepted.push(child);
                verdict.ranks.push(rank);
                v = child;
            }
            Decision::Next(token) => {
                verdict.next_token = token;
                return verdict;
            }
        }
    }
}

/// Greedy rule: follow the child whose token is the target's argmax at each node.
pub fn verify_greedy(step: &Step<'_>, mut target_argmax: impl FnMut(usize) -> u32) -> Verdict {
    walk(|v| decide_greedy(step, v, target_argmax(v)))
}

/// The greedy rule at node `v`: the child holding the target's argmax `best`, else `best`.
pub fn decide_greedy(step: &Step<'_>, v: usize, best: u32) -> Decision {
    let children = step.tree.children(v);
    match children
        .iter()
        .position(|&c| step.tokens[c as usize] == best)
    {
        Some(r) => Decision::Accept {
            child: children[r] as usize,
            rank: r + 1,
        },
        None => Decision::Next(best),
    }
}

/// Exact stochastic rule. `target_probs(v)` is the target's distribution at node v (after its
/// temperature/top-k/top-p); `step` must carry the q each expanded node's children came from.
pub fn verify_stochastic(
    step: &Step<'_>,
    mut target_probs: impl FnMut(usize) -> Vec<f32>,
    rng: &mut SessionRng,
) -> Verdict {
    walk(|v| decide_stochastic(step, v, || target_probs(v), rng))
}

/// The stochastic rule at node `v`: its children in order, each accepted with probability
/// min(1, p/q) under the residual left by the ones before it (q without the rejected tokens:
/// sampling without replacement), else the next token drawn from the final residual.
/// `target_probs` gives the target's distribution at `v`.
pub fn decide_stochastic(
    step: &Step<'_>,
    v: usize,
    mut target_probs: impl FnMut() -> Vec<f32>,
    rng: &mut SessionRng,
) -> Decision {
    let tokens = step.tokens;
    // p is kept unnormalized with its mass, so a residual update touches only q's support.
    let mut p = target_probs();
    let mut mass: f64 = p.iter().map(|&x| x.max(0.0) as f64).sum();
    let children = step.tree.children(v);
    if let (false, Some(qi)) = (children.is_empty(), step.dist_of[v]) {
        let q = &step.dists[qi];
        let mut qw: Vec<f64> = q.probs.iter().map(|&x| x as f64).collect();
        let mut q_mass: f64 = qw.iter().sum();
        for (r, &c) in children.iter().enumerate() {
            let token = tokens[c as usize];
            let Some(j) = q.tokens.iter().position(|&t| t == token) else {
                break; // unreachable for a validated step
            };
            let q_t = qw[j] / q_mass;
            let p_t = p.get(token as usize).map_or(0.0, |&x| x.max(0.0) as f64) / mass;
            if rng.uniform() * q_t < p_t {
                return Decision::Accept {
                    child: c as usize,
                    rank: r + 1,
                };
            }
            // Residual: p ← max(p − q, 0), in p's unnormalized units.
            let mut removed = 0.0f64;
            for (k, &t) in q.tokens.iter().enumerate() {
                if let Some(slot) = p.get_mut(t as usize) {
                    let old = slot.max(0.0) as f64;
                    let new = (old - qw[k] / q_mass * mass).max(0.0);
                    *slot = new as f32;
                    removed += old - new;
                }
            }
            mass -= removed;
            // Drop the rejected token from q (sampling without replacement).
            q_mass -= qw[j];
            qw[j] = 0.0;
            if mass <= DEGENERATE_MASS {
                // p ≈ q made the residual vanish: sample from the target itself.
                p = target_probs();
                break;
            }
            if q_mass <= 0.0 {
                break; // q exhausted: no sibling can follow (validated), emit from the residual
            }
        }
    }
    Decision::Next(sample_dense(&p, rng))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::{SequoiaDp, EXAMPLE_ACCEPTANCE};
    use crate::sampling::{sample_without_replacement, SessionRng};
    use proptest::prelude::*;

    const V: usize = 5;

    /// Logits that depend deterministically on the context (a tiny "language model").
    fn logits(ctx: &[u32], salt: u64, base: Option<&[f32]>, noise: f32) -> Vec<f32> {
        let mut h: u64 = 0xcbf29ce484222325 ^ salt;
        for &t in ctx {
            h = (h ^ t as u64).wrapping_mul(0x100000001b3);
        }
        let mut rng = SessionRng::new(h, 7);
        (0..V)
            .map(|i| {
                let z = (rng.uniform() * 2.0 - 1.0) as f32 * 2.0;
                match base {
                    Some(b) => b[i] + noise * z,
                    None => z,
                }
            })
            .collect()
    }

    fn target_logits(ctx: &[u32]) -> Vec<f32> {
        logits(ctx, 1, None, 0.0)
    }

    fn draft_logits(ctx: &[u32]) -> Vec<f32> {
        let t = target_logits(ctx);
        logits(ctx, 2, Some(&t), 0.8)
    }

    /// Draft a tree of (at most) the given shape: SWOR at each node from the draft's q.
    fn draft_tree(
        shape: &Tree,
        ctx: &[u32],
        params: &SamplingParams,
        sparse_k: usize,
        rng: &mut SessionRng,
    ) -> (Tree, Vec<u32>, Vec<SparseDist>) {
        let mut parents = vec![-1i32];
        let mut tokens = vec![*ctx.last().unwrap()];
        let mut dists = Vec::new();
        let mut shape_of = vec![0usize]; // actual node -> shape node
        let mut contexts = vec![ctx.to_vec()];
        let mut v = 0;
        while v < parents.len() {
            let want = shape.children(shape_of[v]);
            if !want.is_empty() {
                let dense = probs_from_logits(&draft_logits(&contexts[v]), params);
                let q = SparseDist::top_k_of(&dense, sparse_k);
                let kids = sample_without_replacement(&q, want.len(), rng);
                for (r, &tok) in kids.iter().enumerate() {
                    parents.push(v as i32);
                    tokens.push(tok);
                    shape_of.push(want[r] as usize);
                    let mut c = contexts[v].clone();
                    c.push(tok);
                    contexts.push(c);
                }
                dists.push(q);
            }
            v += 1;
        }
        (Tree::from_parents(&parents).unwrap(), tokens, dists)
    }

    /// Run speculative steps until two tokens are emitted; return them.
    fn first_two(
        shape: &Tree,
        params: &SamplingParams,
        sparse_k: usize,
        rng: &mut SessionRng,
    ) -> (u32, u32) {
        let mut ctx = vec![0u32];
        let mut emitted = Vec::new();
        while emitted.len() < 2 {
            let (tree, tokens, dists) = draft_tree(shape, &ctx, params, sparse_k, rng);
            let step = Step::new(&tree, &tokens, &dists, V, true).unwrap();
            let node_ctx = |v: usize| {
                let mut c = ctx.clone();
                c.extend(tree.path_to(v).iter().skip(1).map(|&u| tokens[u]));
                c
            };
            let verdict = verify_stochastic(
                &step,
                |v| probs_from_logits(&target_logits(&node_ctx(v)), params),
                rng,
            );
            let out = verdict.emitted(&tokens);
            ctx.extend(&out);
            emitted.extend(out);
        }
        (emitted[0], emitted[1])
    }

    fn joint(
        ctx0: &[u32],
        params: &SamplingParams,
        model: impl Fn(&[u32]) -> Vec<f32>,
    ) -> Vec<f64> {
        let p1 = probs_from_logits(&model(ctx0), params);
        let mut out = vec![0.0; V * V];
        for a in 0..V {
            let mut c = ctx0.to_vec();
            c.push(a as u32);
            let p2 = probs_from_logits(&model(&c), params);
            for b in 0..V {
                out[a * V + b] = p1[a] as f64 * p2[b] as f64;
            }
        }
        out
    }

    /// Largest |empirical − expected| in units of the binomial standard deviation; cells with
    /// zero expected probability must never occur (returns infinity if they do).
    fn worst_sigma(counts: &[usize], expected: &[f64], n: usize) -> f64 {
        let mut worst = 0.0f64;
        for (&c, &p) in counts.iter().zip(expected) {
            let f = c as f64 / n as f64;
            if p <= 1e-12 {
                if c > 0 {
                    return f64::INFINITY;
                }
                continue;
            }
            let sd = (p * (1.0 - p) / n as f64).sqrt();
            worst = worst.max((f - p).abs() / sd);
        }
        worst
    }

    /// Monte-Carlo exactness. Bound: each of the 25 cells of the (x1, x2) joint is Binomial(N, p);
    /// we require |f − p| ≤ 5σ. Under a correct verifier a 5σ excursion has probability
    /// < 6e-7 per cell (normal approximation, N·p large), so over all 36 configurations × 25 cells
    /// the family-wise false-alarm rate is < 6e-4 — and seeds are fixed, so the test is
    /// deterministic. The power check below shows the same bound rejects the draft's own joint.
    #[test]
    fn emitted_tokens_follow_the_target_distribution() {
        const N: usize = 40_000;
        let dp = SequoiaDp::solve(&EXAMPLE_ACCEPTANCE, 8, 4).unwrap();
        let shapes = [
            ("chain", Tree::chain(4)),
            ("star", Tree::star(5)),
            ("sequoia", dp.tree(8, 4)),
        ];
        let mut worst_overall: f64 = 0.0;
        for (name, shape) in &shapes {
            for &t in &[0.3f32, 0.7, 1.0] {
                for &top_p in &[1.0f32, 0.8] {
                    for &sparse_k in &[0usize, 3] {
                        let params = SamplingParams {
                            temperature: t,
                            top_k: 0,
                            top_p,
                        };
                        let expected = joint(&[0], &params, target_logits);
                        let mut rng =
                            SessionRng::new(12345, (t * 10.0) as u64 * 100 + sparse_k as u64);
                        let mut counts = vec![0usize; V * V];
                        for _ in 0..N {
                            let (a, b) = first_two(shape, &params, sparse_k, &mut rng);
                            counts[a as usize * V + b as usize] += 1;
                        }
                        let s = worst_sigma(&counts, &expected, N);
                        assert!(
                            s <= 5.0,
                            "{name} T={t} top_p={top_p} sparse_k={sparse_k}: {s:.2}σ"
                        );
                        worst_overall = worst_overall.max(s);
                        // Power: the draft's own joint is far outside the same bound.
                        let draft = joint(&[0], &params, draft_logits);
                        let exp_counts: Vec<usize> = draft
                            .iter()
                            .map(|&p| (p * N as f64).round() as usize)
                            .collect();
                        assert!(
                            worst_sigma(&exp_counts, &expected, N) > 5.0,
                            "test has no power here"
                        );
                    }
                }
            }
        }
        eprintln!("worst deviation over all configurations: {worst_overall:.2}σ");
    }

    #[test]
    fn greedy_follows_the_target_argmax_path() {
        let params = SamplingParams::greedy();
        let dp = SequoiaDp::solve(&EXAMPLE_ACCEPTANCE, 12, 5).unwrap();
        for shape in [Tree::chain(5), Tree::star(4), dp.tree(12, 5)] {
            let mut ctx = vec![3u32];
            let mut rng = SessionRng::new(9, 0);
            let mut total_accepted = 0;
            while ctx.len() < 40 {
                // Greedy drafting: top-b of the draft at each node.
                let mut parents = vec![-1i32];
                let mut tokens = vec![*ctx.last().unwrap()];
                let mut map = vec![0usize];
                let mut v = 0;
                while v < parents.len() {
                    let want = shape.children(map[v]).len();
                    if want > 0 {
                        let mut c = ctx.clone();
                        let pt: Vec<usize> = {
                            let mut path = vec![v];
                            let mut u = v;
                            while u > 0 {
                                u = parents[u] as usize;
                                path.push(u);
                            }
                            path.into_iter().rev().skip(1).collect()
                        };
                        c.extend(pt.iter().map(|&u| tokens[u]));
                        for (r, tok) in crate::sampling::greedy_top_k(&draft_logits(&c), want)
                            .into_iter()
                            .enumerate()
                        {
                            parents.push(v as i32);
                            tokens.push(tok);
                            map.push(shape.children(map[v])[r] as usize);
                        }
                    }
                    v += 1;
                }
                let tree = Tree::from_parents(&parents).unwrap();
                let step = Step::new(&tree, &tokens, &[], V, false).unwrap();
                let node_logits: Vec<Vec<f32>> = (0..tree.len())
                    .map(|v| {
                        let mut c = ctx.clone();
                        c.extend(tree.path_to(v).iter().skip(1).map(|&u| tokens[u]));
                        target_logits(&c)
                    })
                    .collect();
                let verdict = verify_with_logits(&step, |v| &node_logits[v], &params, &mut rng);
                total_accepted += verdict.accepted.len();
                ctx.extend(verdict.emitted(&tokens));
            }
            // Plain greedy decoding of the target from the same start.
            let mut plain = vec![3u32];
            while plain.len() < ctx.len() {
                let next = argmax(&target_logits(&plain));
                plain.push(next);
            }
            assert_eq!(ctx, plain);
            assert!(total_accepted > 0, "the draft should sometimes agree");
        }
    }

    #[test]
    fn step_validation_names_the_problem() {
        let tree = Tree::from_parents(&[-1, 0, 0, 1]).unwrap();
        let q0 = SparseDist {
            tokens: vec![1, 2],
            probs: vec![0.6, 0.4],
        };
        let q1 = SparseDist {
            tokens: vec![3],
            probs: vec![1.0],
        };
        let dists = vec![q0.clone(), q1.clone()];
        assert!(Step::new(&tree, &[0, 1, 2, 3], &dists, 5, true).is_ok());
        let e = Step::new(&tree, &[0, 1, 2], &dists, 5, true).unwrap_err();
        assert_eq!(e, StepError::TokenCount { got: 3, nodes: 4 });
        let e = Step::new(&tree, &[0, 1, 9, 3], &dists, 5, true).unwrap_err();
        assert!(matches!(e, StepError::TokenOutOfVocab { index: 2, .. }));
        let e = Step::new(&tree, &[0, 1, 1, 3], &dists, 5, true).unwrap_err();
        assert!(matches!(e, StepError::DuplicateSibling { child: 2, .. }));
        let e = Step::new(&tree, &[0, 1, 4, 3], &dists, 5, true).unwrap_err();
        assert!(matches!(
            e,
            StepError::ChildNotInDist { child: 2, token: 4 }
        ));
        let e = Step::new(&tree, &[0, 1, 2, 3], &dists[..1], 5, true).unwrap_err();
        assert!(matches!(
            e,
            StepError::DistCount {
                got: 1,
                expected: 2
            }
        ));
        let bad = vec![
            SparseDist {
                tokens: vec![1, 2],
                probs: vec![0.9, 0.4],
            },
            q1.clone(),
        ];
        assert!(matches!(
            Step::new(&tree, &[0, 1, 2, 3], &bad, 5, true),
            Err(StepError::DistMass { .. })
        ));
        let bad = vec![
            SparseDist {
                tokens: vec![1, 2],
                probs: vec![f32::NAN, 0.4],
            },
            q1.clone(),
        ];
        assert!(matches!(
            Step::new(&tree, &[0, 1, 2, 3], &bad, 5, true),
            Err(StepError::DistBadProb { .. })
        ));
        let bad = vec![
            SparseDist {
                tokens: vec![1, 1],
                probs: vec![0.5, 0.4],
            },
            q1,
        ];
        assert!(matches!(
            Step::new(&tree, &[0, 1, 2, 3], &bad, 5, true),
            Err(StepError::DistDuplicate { .. })
        ));
        assert!(e.to_string().contains("draft_dists"));
        // Greedy needs no q.
        assert!(Step::new(&tree, &[0, 1, 2, 3], &[], 5, false).is_ok());
    }

    #[test]
    fn identical_p_and_q_accept_and_never_nan() {
        // p == q: the first child is always accepted (residual never needed).
        let tree = Tree::star(2);
        let q = vec![SparseDist {
            tokens: vec![0, 1],
            probs: vec![0.5, 0.5],
        }];
        let step = Step::new(&tree, &[2, 0, 1], &q, 3, true).unwrap();
        let mut rng = SessionRng::new(0, 0);
        for _ in 0..1000 {
            let v = verify_stochastic(&step, |_| vec![0.5, 0.5, 0.0], &mut rng);
            assert_eq!(v.accepted.len(), 1);
            assert!(v.next_token < 2);
        }
        // Target with all mass on a token the draft never proposes: both rejected, emit it.
        for _ in 0..100 {
            let v = verify_stochastic(&step, |_| vec![0.0, 0.0, 1.0], &mut rng);
            assert!(v.accepted.is_empty());
            assert_eq!(v.next_token, 2);
        }
        // A target row of zeros (broken logits) still yields a token, not a panic.
        let v = verify_stochastic(&step, |_| vec![0.0, 0.0, 0.0], &mut rng);
        assert!(v.next_token < 3);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn untrusted_steps_never_panic(
            parents in proptest::collection::vec(-3i32..20, 0..24),
            tokens in proptest::collection::vec(0u32..12, 0..24),
            qs in proptest::collection::vec(
                (proptest::collection::vec(0u32..12, 0..6), proptest::collection::vec(-0.5f32..1.5, 0..6)), 0..10),
            target in proptest::collection::vec(0.0f32..1.0, 10),
            seed in any::<u64>(),
        ) {
            let dists: Vec<SparseDist> = qs.into_iter().map(|(tokens, probs)| SparseDist { tokens, probs }).collect();
            if let Ok(tree) = Tree::from_parents(&parents) {
                for need in [true, false] {
                    if let Ok(step) = Step::new(&tree, &tokens, &dists, 10, need) {
                        let mut rng = SessionRng::new(seed, 0);
                        let v = verify_stochastic(&step, |_| target.clone(), &mut rng);
                        prop_assert!((v.next_token as usize) < 10);
                        let g = verify_greedy(&step, |n| (n % 10) as u32);
                        prop_assert!(g.accepted.iter().all(|&c| c < tree.len()));
                    }
                }
            }
        }

        #[test]
        fn parent_arrays_are_accepted_or_rejected_cleanly(parents in proptest::collection::vec(any::<i32>(), 0..40)) {
            match Tree::from_parents(&parents) {
                Ok(t) => {
                    prop_assert_eq!(t.len(), parents.len());
                    for i in 1..t.len() { prop_assert!((t.parents()[i] as usize) < i); }
                }
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }
    }
}
