//! Conversions between the protobuf messages (`proto/sequoia/v1/sequoia.proto`, the API's single
//! source) and `sequoia-core` types, in one place so the draft and verify sides cannot drift.

use sequoia_core::sampling::{SamplingParams, SparseDist};
use sequoia_core::tree::Tree;
use sequoia_core::verify::Verdict;
use sequoia_proto::v1 as pb;

/// Sampling settings as both APIs send them: `top_p` of 0 (the protobuf default) means off,
/// like 1; `top_k` of 0 means off.
pub fn sampling_params(temperature: f32, top_p: f32, top_k: u32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k: top_k as usize,
        top_p: if top_p <= 0.0 { 1.0 } else { top_p },
    }
}

/// `open.sampling` of a verify session (absent = the protobuf defaults: T = 0, no truncation).
pub fn sampling_from_config(c: Option<pb::SamplingConfig>) -> SamplingParams {
    let c = c.unwrap_or_default();
    sampling_params(c.temperature, c.top_p, c.top_k)
}

pub fn sampling_config(p: &SamplingParams) -> pb::SamplingConfig {
    pb::SamplingConfig {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k as u32,
    }
}

/// The wire form of a drafted tree; its step number is set by the session it is sent on.
pub fn tree_message(tree: &Tree, tokens: &[u32], dists: &[SparseDist]) -> pb::VerifyTree {
    pb::VerifyTree {
        step: 0,
        parents: tree.parents().to_vec(),
        tokens: tokens.to_vec(),
        draft_dists: dists
            .iter()
            .map(|q| pb::SparseDist {
                tokens: q.tokens.clone(),
                probs: q.probs.clone(),
            })
            .collect(),
        assumes: None,
    }
}

/// The draft distributions of a received tree (checked later, by `verify::Step::new`).
pub fn dists_from_wire(dists: Vec<pb::SparseDist>) -> Vec<SparseDist> {
    dists
        .into_iter()
        .map(|d| SparseDist {
            tokens: d.tokens,
            probs: d.probs,
        })
        .collect()
}

/// `batch`: rows and sessions of the forward that verified the tree.
pub fn verdict_message(
    step: u64,
    v: &Verdict,
    verify_ms: f64,
    batch: (usize, usize),
) -> pb::Verdict {
    pb::Verdict {
        step,
        accepted_nodes: v.accepted.iter().map(|&i| i as u32).collect(),
        next_token: v.next_token,
        accepted_ranks: v.ranks.iter().map(|&r| r as u32).collect(),
        verify_ms,
        batch_rows: u32::try_from(batch.0).unwrap_or(u32::MAX),
        batch_sessions: u32::try_from(batch.1).unwrap_or(u32::MAX),
    }
}

/// Check a verdict against the tree it answers, before anything else reads it: the accepted
/// nodes are a root-to-leaf path of the tree, one rank per accepted node, each rank at most the
/// number of siblings, the next token in the vocabulary, and the reported time a finite
/// number of milliseconds ≥ 0.
pub fn check_verdict(v: &pb::Verdict, parents: &[i32], vocab: usize) -> Result<(), String> {
    let mut prev = 0usize;
    for (k, &node) in v.accepted_nodes.iter().enumerate() {
        let i = node as usize;
        let parent = parents.get(i).copied();
        if i == 0 || parent != Some(prev as i32) {
            return Err(format!(
                "accepted_nodes[{k}] = {node} is not a child of node {prev} in a tree of {} nodes",
                parents.len()
            ));
        }
        prev = i;
    }
    if v.accepted_ranks.len() != v.accepted_nodes.len() {
        return Err(format!(
            "{} accepted_ranks for {} accepted_nodes",
            v.accepted_ranks.len(),
            v.accepted_nodes.len()
        ));
    }
    if let Some(&r) = v
        .accepted_ranks
        .iter()
        .find(|&&r| r == 0 || r as usize > parents.len())
    {
        return Err(format!(
            "accepted rank {r} is impossible in a tree of {} nodes",
            parents.len()
        ));
    }
    if v.next_token as usize >= vocab {
        return Err(format!(
            "next_token {} is outside the vocabulary (size {vocab})",
            v.next_token
        ));
    }
    if !v.verify_ms.is_finite() || v.verify_ms < 0.0 {
        return Err(format!("verify_ms = {} is not a time", v.verify_ms));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_p_zero_means_off_and_round_trips() {
        let p = sampling_from_config(Some(pb::SamplingConfig {
            temperature: 0.7,
            top_p: 0.0,
            top_k: 5,
        }));
        assert_eq!((p.temperature, p.top_p, p.top_k), (0.7, 1.0, 5));
        assert_eq!(sampling_from_config(Some(sampling_config(&p))), p);
        assert!(sampling_from_config(None).is_greedy());
    }

    #[test]
    fn tree_and_verdict_messages_carry_every_field() {
        let tree = Tree::from_parents(&[-1, 0, 0, 1]).unwrap();
        let q = SparseDist {
            tokens: vec![4, 5],
            probs: vec![0.75, 0.25],
        };
        let m = tree_message(&tree, &[1, 4, 5, 6], &[q.clone()]);
        assert_eq!(m.parents, vec![-1, 0, 0, 1]);
        assert_eq!(m.tokens, vec![1, 4, 5, 6]);
        assert_eq!(dists_from_wire(m.draft_dists), vec![q]);
        let v = Verdict {
            accepted: vec![1, 3],
            ranks: vec![1, 1],
            next_token: 9,
        };
        let w = verdict_message(7, &v, 1.5, (9, 2));
        assert_eq!(
            (w.step, w.accepted_nodes, w.accepted_ranks, w.next_token),
            (7, vec![1, 3], vec![1, 1], 9)
        );
    }
}

/// Check one `decoded` message of a decode before anything reads it: it continues at `step`,
/// carries 1 ..= `left` tokens (what the decode may still send), all in the vocabulary, and a
/// time that is a finite number of milliseconds ≥ 0.
pub fn check_decoded(d: &pb::Decoded, step: u64, left: usize, vocab: usize) -> Result<(), String> {
    if d.step != step {
        return Err(format!("decoded step {} where {step} was next", d.step));
    }
    if d.tokens.is_empty() || d.tokens.len() > left {
        return Err(format!(
            "decoded {} tokens where 1..={left} could come",
            d.tokens.len()
        ));
    }
    if let Some(t) = d.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(format!(
            "decoded token {t} is outside the vocabulary (size {vocab})"
        ));
    }
    if !d.verify_ms.is_finite() || d.verify_ms < 0.0 {
        return Err(format!("verify_ms = {} is not a time", d.verify_ms));
    }
    Ok(())
}
