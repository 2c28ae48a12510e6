//! Pipelined drafting (docs/ALGORITHMS.md §10): while tree k is being verified, grow tree k+1
//! for the likeliest verdicts, so that when the verdict confirms one of them the next tree is
//! ready (or partly grown) instead of starting from nothing.
//!
//! A verdict is an accepted path ending at some node v of tree k plus one more token (the
//! correction or bonus). For each candidate v the drafter forwards a copy of v (its logits
//! give the guess b for that token: the draft's likeliest token that is not one of v's
//! children, since those were rejected if the path ends at v), then grows tree k+1 below b level
//! by level, all candidates in one forward per level. These nodes go into the cache after tree
//! k's, as a forest the attention mask keeps apart. When the verdict comes, a candidate whose
//! (v, b) matches is a hit: the cache keeps the accepted path, v's copy and that candidate's
//! nodes, and the next `grow` finishes it. Anything else is a miss: every speculative entry is
//! dropped and the step continues exactly as without pipelining.
//!
//! Exactness does not depend on any of this: a tree grown ahead is the same proposal the
//! drafter would have made after the verdict (same context, same per-position random stream,
//! same shape), and verification is unchanged.

use super::{check_path, DraftError, DraftSession, DraftedTree, Growth};
use crate::{EngineError, Model};
use sequoia_core::tree::Tree;
use std::sync::atomic::{AtomicBool, Ordering};

/// What was grown ahead while one tree was verified; give it back with the verdict to
/// [`DraftSession::commit_speculated`].
#[derive(Debug)]
pub struct Speculation {
    /// Cache entries appended after the verified tree's forwarded nodes.
    appended: usize,
    candidates: Vec<Candidate>,
    /// Draft forwards run (one per level, all candidates together).
    pub forwards: usize,
}

#[derive(Debug)]
struct Candidate {
    /// The node of the tree as drafted that the accepted path would end at.
    end: usize,
    /// Index among the appended entries of `end`'s copy, once forwarded.
    copy: Option<usize>,
    /// The next tree, rooted at the guessed token, once the copy's logits chose it.
    growth: Option<Growth>,
    /// Index among the appended entries of each forwarded node of `growth`.
    slots: Vec<usize>,
    /// The complete tree was handed to the caller to send ahead.
    handed_out: bool,
}

/// How a verdict met the speculation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpeculationOutcome {
    /// A candidate matched: the next tree is ready (or partly grown) for [`DraftSession::grow`].
    Hit,
    /// No candidate matched: everything grown ahead was dropped.
    Miss,
}

impl Speculation {
    /// Nothing grown ahead (the tree had no drafted part, or speculation was not possible).
    fn empty() -> Self {
        Self {
            appended: 0,
            candidates: Vec::new(),
            forwards: 0,
        }
    }

    /// The (end node, guessed token) pairs grown ahead, end nodes in indices of the tree as
    /// drafted (before lookup grafts); the guess is None where the stop came first.
    pub fn candidates(&self) -> Vec<(usize, Option<u32>)> {
        self.candidates
            .iter()
            .map(|c| (c.end, c.growth.as_ref().map(|g| g.tokens[0])))
            .collect()
    }
}

/// The `n` nodes of `tree` whose verdicts are likeliest to be guessed right, likeliest first:
/// the candidates pipelined drafting grows the next tree for (docs/ALGORITHMS.md §10).
///
/// The draft's own probabilities stand for the target's: a node is accepted with its
/// `confidence` (its token's draft probability at its parent), so the path reaches v with the
/// product f(v) along it. A verdict that ends at v is guessed right when the target's next token
/// is the draft's guess there: for a node the draft expanded, the likeliest token that is not
/// one of its children, with probability `runner_up[v]`; for one it did not, the draft's
/// likeliest token, right with probability `top` (the rank-1 acceptance rate). The score of v is
/// f(v) times that. Unlike a rank-based acceptance vector, this follows the tree at hand: a node
/// the draft was unsure of is a likely end, one it was sure of an unlikely one.
pub fn likeliest_hits(
    tree: &Tree,
    confidence: &[f32],
    runner_up: &[f32],
    top: f64,
    n: usize,
) -> Vec<usize> {
    let mut reach = vec![0.0f64; tree.len()];
    reach[0] = 1.0;
    for v in 0..tree.len() {
        for &c in tree.children(v) {
            let q = confidence.get(c as usize).copied().unwrap_or(0.0) as f64;
            reach[c as usize] = reach[v] * q.clamp(0.0, 1.0);
        }
    }
    let mut scored: Vec<(f64, usize)> = (0..tree.len())
        .map(|v| {
            let guess = match runner_up.get(v) {
                Some(&r) if r.is_finite() => r as f64,
                _ => top,
            };
            (reach[v] * guess.clamp(0.0, 1.0), v)
        })
        .collect();
    // Likeliest first; ties to the lower index, so the choice is deterministic.
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    scored.into_iter().take(n).map(|(_, v)| v).collect()
}

impl DraftSession {
    /// Grow the next tree (of `shape`) ahead for the `ends` of `drafted` (node indices of the
    /// tree as drafted, e.g. from [`likeliest_hits`]), one draft forward per level, until
    /// every candidate's tree is complete or `stop` is set (checked before each forward and
    /// between its layers, where it drops the level in progress; the verdict's arrival sets it)
    /// or `max_forwards` forwards ran. Call right after `grow` returned `drafted`, before its
    /// commit. Stops early, with what it has, when the cache has no room.
    ///
    /// `complete`, if given, receives each candidate's next tree as soon as it is fully grown:
    /// the candidate's end node (as in [`Speculation::candidates`]) and the tree exactly as
    /// [`grow`](Self::grow) will give it after a verdict that confirms the candidate (so it can
    /// be sent ahead of that verdict, docs/ALGORITHMS.md §10). Without it no tree is built.
    #[allow(clippy::too_many_arguments)]
    pub fn speculate(
        &mut self,
        model: &Model,
        drafted: &DraftedTree,
        shape: &Tree,
        ends: &[usize],
        max_forwards: usize,
        stop: &AtomicBool,
        mut complete: Option<&mut dyn FnMut(usize, DraftedTree)>,
    ) -> Result<Speculation, EngineError> {
        let f = drafted.forwarded;
        if f == 0 || shape.len() < 2 || self.ready.is_some() || !self.pending.is_empty() {
            return Ok(Speculation::empty());
        }
        let tree = &drafted.drafted;
        // The forest forwarded so far: tree k's cached nodes, then the appended entries.
        let mut parents: Vec<i32> = tree.parents()[..f].to_vec();
        let mut tokens: Vec<u32> = drafted.drafted_tokens[..f].to_vec();
        let mut spec = Speculation::empty();
        spec.candidates = ends
            .iter()
            .filter(|&&v| v < tree.len())
            .map(|&end| Candidate {
                end,
                copy: None,
                growth: None,
                slots: Vec::new(),
                handed_out: false,
            })
            .collect();
        while spec.forwards < max_forwards && !stop.load(Ordering::Relaxed) {
            let start = parents.len();
            // (candidate, first row, nodes to expand (growth indices); empty = the copy)
            let mut jobs: Vec<(usize, usize, Vec<usize>)> = Vec::new();
            let mut rows = Vec::new();
            for (ci, c) in spec.candidates.iter_mut().enumerate() {
                match (&c.copy, &c.growth) {
                    (None, _) => {
                        c.copy = Some(parents.len() - f);
                        jobs.push((ci, rows.len(), Vec::new()));
                        rows.push(parents.len());
                        parents.push(tree.parents()[c.end]);
                        tokens.push(drafted.drafted_tokens[c.end]);
                    }
                    (Some(copy), Some(g)) => {
                        let expand = g.to_expand();
                        if expand.is_empty() {
                            continue;
                        }
                        for u in g.level_start..g.parents.len() {
                            let parent = match g.parents[u] {
                                -1 => f + copy,
                                p => f + c.slots[p as usize],
                            };
                            c.slots.push(parents.len() - f);
                            parents.push(parent as i32);
                            tokens.push(g.tokens[u]);
                        }
                        jobs.push((ci, rows.len(), expand.clone()));
                        rows.extend(expand.iter().map(|&u| f + c.slots[u]));
                    }
                    (Some(_), None) => {}
                }
            }
            if rows.is_empty() {
                break;
            }
            // Keep what was grown before this level, as if it had never been started.
            let drop_level = |spec: &mut Speculation| {
                for (ci, _, expand) in &jobs {
                    let c = &mut spec.candidates[*ci];
                    if expand.is_empty() {
                        c.copy = None;
                    } else {
                        let g = c.growth.as_ref().expect("expanding a growth");
                        c.slots
                            .truncate(c.slots.len() - (g.parents.len() - g.level_start));
                    }
                }
            };
            if self.cache.len() + (parents.len() - start) > self.cache.capacity() {
                // No room for this level.
                drop_level(&mut spec);
                break;
            }
            // The verdict's arrival stops the forward in progress within a layer: the step
            // waits for it (it needs the drafter back), and finishing the level took up to a
            // whole draft forward (two one-core hosts, RTT 10 ms: median 3-node miss steps
            // 200 → 189 ms, 5-node hits 216 → 193 ms with the stop, BENCHMARKS.md session 15).
            let logits = match model.forward_forest_extend_until(
                &mut self.cache,
                &tokens,
                &parents,
                start,
                &rows,
                self.head_vocab,
                Some(crate::Stop::at_any_layer(stop)),
            ) {
                Ok(logits) => logits,
                Err(EngineError::Stopped) => {
                    drop_level(&mut spec);
                    break;
                }
                Err(e) => return Err(e),
            };
            spec.appended = parents.len() - f;
            spec.forwards += 1;
            for (ci, first, expand) in jobs {
                let c = &mut spec.candidates[ci];
                if expand.is_empty() {
                    // The token after a path ending at `end`: not one of its children (they
                    // were all rejected if the path stops there).
                    let kids: Vec<u32> = tree
                        .children(c.end)
                        .iter()
                        .map(|&k| drafted.drafted_tokens[k as usize])
                        .collect();
                    let guess = super::greedy_top_k(logits.row(first), kids.len() + 1)
                        .into_iter()
                        .find(|t| !kids.contains(t));
                    if let Some(b) = guess {
                        let position = drafted.position + 1 + tree.depth(c.end);
                        c.growth = Some(Growth::new(b, shape.clone(), self.seed, position));
                    }
                } else {
                    let g = c.growth.as_mut().expect("expanding a growth");
                    g.add_children(&expand, &logits, first, &self.params, self.wire_top_k);
                }
            }
            let Some(complete) = complete.as_mut() else {
                continue;
            };
            for c in spec.candidates.iter_mut().filter(|c| !c.handed_out) {
                if let Some(g) = c.growth.as_ref().filter(|g| g.to_expand().is_empty()) {
                    c.handed_out = true;
                    let mut done = g.clone();
                    done.forwarded = c.slots.len();
                    let mut tree = done.into_drafted();
                    tree.resumed = true;
                    complete(c.end, tree);
                }
            }
        }
        Ok(spec)
    }

    /// Follow the verdict (accepted path `accepted` of the sent tree, then `next_token`) of a
    /// tree that was speculated on. On a hit the matching candidate becomes the tree the next
    /// [`grow`](Self::grow) from `next_token` with the same shape continues; on a miss this is
    /// [`commit`](Self::commit).
    pub fn commit_speculated(
        &mut self,
        drafted: &DraftedTree,
        accepted: &[usize],
        next_token: u32,
        spec: Speculation,
    ) -> Result<SpeculationOutcome, DraftError> {
        check_path(&drafted.tree, accepted)?;
        let f = drafted.forwarded;
        // The path in indices of the tree as drafted; None if it went through a lookup node.
        let mut path = vec![0usize];
        let mut drafted_path = true;
        for &v in accepted {
            match drafted.origin[v] {
                Some(o) => path.push(o),
                None => drafted_path = false,
            }
        }
        let end = *path.last().expect("the root");
        let candidate = spec
            .candidates
            .into_iter()
            .find(|c| drafted_path && c.end == end && c.copy.is_some());
        let c = match candidate {
            Some(c) if c.growth.as_ref().is_some_and(|g| g.tokens[0] == next_token) => c,
            other => {
                // Right end but another token: the end's copy still saves forwarding it.
                let copy = other.and_then(|c| c.copy);
                self.keep_path(drafted, accepted, spec.appended, copy)?;
                return Ok(SpeculationOutcome::Miss);
            }
        };
        let (copy, mut growth) = (c.copy.expect("checked"), c.growth.expect("checked"));
        // Every path node but the last was expanded, so it is among the forwarded ones.
        let mut keep: Vec<usize> = path[..path.len() - 1].to_vec();
        debug_assert!(keep.iter().all(|&v| v < f));
        keep.push(f + copy);
        keep.extend(c.slots.iter().map(|&s| f + s));
        self.cache.keep_newest(f + spec.appended, &keep)?;
        growth.forwarded = c.slots.len();
        self.ready = Some(growth);
        Ok(SpeculationOutcome::Hit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_are_ranked_by_the_drafts_own_probabilities() {
        // Root → a (sure, 0.95) → b (unsure, 0.3), a leaf the draft did not expand. The root's
        // runner-up is 0.03, a's 0.6.
        let tree = Tree::from_parents(&[-1, 0, 1]).unwrap();
        let confidence = [1.0, 0.95, 0.3];
        let runner_up = [0.03, 0.6, f32::NAN];
        // Scores: root 0.03; a 0.95 · 0.6 = 0.57; b 0.95 · 0.3 · 0.8 = 0.228.
        assert_eq!(
            likeliest_hits(&tree, &confidence, &runner_up, 0.8, 3),
            vec![1, 2, 0]
        );
        // A draft that is sure of b makes the leaf the likeliest verdict.
        let confidence = [1.0, 0.95, 0.9];
        assert_eq!(
            likeliest_hits(&tree, &confidence, &runner_up, 0.8, 2),
            vec![2, 1]
        );
        // Missing or nonsense figures count as impossible, never as certain.
        let none: [f32; 0] = [];
        let picked = likeliest_hits(&tree, &none, &[f32::NAN, 7.0, -1.0], 0.5, 3);
        assert_eq!(picked, vec![0, 1, 2]);
    }
}
