//! Device-independent consistency checks, shared by the CPU tests (`random_weights.rs`) and the
//! CUDA tests (`engine_cuda.rs`): each returns the worst deviation it saw, and the caller decides
//! what is acceptable (0 for the batch-invariant CPU kernels, a tolerance elsewhere).
#![allow(dead_code)]

use sequoia_core::tree::Tree;
use sequoia_engine::Model;

/// Deterministic pseudo-random token ids.
pub fn tokens(n: usize, salt: u64, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| {
            let x = (i + 1)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add(salt.wrapping_mul(0xbf58_476d_1ce4_e5b9));
            ((x >> 17) % vocab as u64) as u32
        })
        .collect()
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// `max |a − b|` relative to the spread of `b` (its largest magnitude, at least 1).
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1.0f32, |m, x| m.max(x.abs()));
    max_diff(a, b) / scale
}

/// Logits after `prefix` then `seq` decoded one token at a time on a fresh cache.
pub fn sequential(model: &Model, prefix: &[u32], seq: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache();
    let mut last = model.forward_chain_last(&mut cache, prefix).unwrap();
    for &t in seq {
        last = model.forward_chain_last(&mut cache, &[t]).unwrap();
    }
    assert_eq!(cache.len(), prefix.len() + seq.len());
    last
}

pub fn trees() -> Vec<Tree> {
    vec![
        Tree::chain(1),
        Tree::chain(5),
        Tree::star(6),
        Tree::from_parents(&[-1, 0, 0, 1, 1, 2, 3, 3, 5, 6]).unwrap(),
        Tree::k_by_d(3, 3),
    ]
}

/// Every tree node's logits against decoding its root-to-node path one token at a time: the
/// worst relative difference.
pub fn tree_vs_sequential(model: &Model) -> f32 {
    let vocab = model.info().vocab_size;
    let mut worst = 0.0f32;
    for (ti, tree) in trees().iter().enumerate() {
        let prefix = tokens(7, 100 + ti as u64, vocab);
        let nodes = tokens(tree.len(), 200 + ti as u64, vocab);
        let mut cache = model.new_cache();
        model.forward_chain_last(&mut cache, &prefix).unwrap();
        let logits = model.forward_tree(&mut cache, &nodes, tree).unwrap();
        assert_eq!(cache.len(), prefix.len() + tree.len());
        assert_eq!((logits.rows(), logits.vocab()), (tree.len(), vocab));
        for i in 0..tree.len() {
            let path: Vec<u32> = tree.path_to(i).iter().map(|&j| nodes[j]).collect();
            let want = sequential(model, &prefix, &path);
            assert!(
                logits.row(i).iter().all(|x| x.is_finite()),
                "tree #{ti} node {i}"
            );
            worst = worst.max(rel_diff(logits.row(i), &want));
        }
    }
    worst
}

/// A tree step, compaction to one root-to-leaf path, further decoding and a second tree step,
/// against fresh sequential runs: the worst relative difference.
pub fn compaction_vs_sequential(model: &Model) -> f32 {
    let vocab = model.info().vocab_size;
    let tree = Tree::from_parents(&[-1, 0, 0, 0, 1, 1, 2, 4, 4, 6]).unwrap();
    let prefix = tokens(9, 31, vocab);
    let nodes = tokens(tree.len(), 32, vocab);
    let more = tokens(4, 33, vocab);
    let mut worst = 0.0f32;
    for leaf in [0, 3, 8, 9] {
        let path = tree.path_to(leaf);
        let mut cache = model.new_cache();
        model.forward_chain_last(&mut cache, &prefix).unwrap();
        model.forward_tree(&mut cache, &nodes, &tree).unwrap();
        cache.keep_newest(tree.len(), &path).unwrap();
        assert_eq!(cache.len(), prefix.len() + path.len());
        let l1 = model.forward_chain_last(&mut cache, &more[..1]).unwrap();
        let l2 = model.forward_chain_last(&mut cache, &more[1..]).unwrap();
        let mut seq: Vec<u32> = path.iter().map(|&j| nodes[j]).collect();
        seq.push(more[0]);
        worst = worst.max(rel_diff(&l1, &sequential(model, &prefix, &seq)));
        seq.extend_from_slice(&more[1..]);
        worst = worst.max(rel_diff(&l2, &sequential(model, &prefix, &seq)));
        let tree2 = Tree::star(3);
        let nodes2 = tokens(tree2.len(), 34 + leaf as u64, vocab);
        let logits = model.forward_tree(&mut cache, &nodes2, &tree2).unwrap();
        for i in 0..tree2.len() {
            let mut s = seq.clone();
            s.extend(tree2.path_to(i).iter().map(|&j| nodes2[j]));
            worst = worst.max(rel_diff(logits.row(i), &sequential(model, &prefix, &s)));
        }
    }
    worst
}

/// Several sessions (caches) on one model, their steps interleaved, against each session run
/// alone: the worst relative difference. Catches state leaking between caches.
pub fn interleaved_sessions(model: &Model) -> f32 {
    let vocab = model.info().vocab_size;
    let sessions = 3;
    let steps = 4;
    let tree = Tree::k_by_d(2, 2);
    let run = |s: usize, cache: &mut sequoia_engine::KvCache, step: usize| {
        if step == 0 {
            model
                .forward_chain_last(cache, &tokens(5 + s, 40 + s as u64, vocab))
                .unwrap()
        } else {
            let nodes = tokens(tree.len(), 50 + (s * 10 + step) as u64, vocab);
            let logits = model.forward_tree(cache, &nodes, &tree).unwrap();
            let keep = tree.path_to(tree.len() - 1);
            cache.keep_newest(tree.len(), &keep).unwrap();
            logits.into_vec()
        }
    };
    let mut alone = Vec::new();
    for s in 0..sessions {
        let mut cache = model.new_cache();
        alone.push(
            (0..steps)
                .map(|k| run(s, &mut cache, k))
                .collect::<Vec<_>>(),
        );
    }
    let mut caches: Vec<_> = (0..sessions).map(|_| model.new_cache()).collect();
    let mut worst = 0.0f32;
    for k in 0..steps {
        for (s, cache) in caches.iter_mut().enumerate() {
            worst = worst.max(rel_diff(&run(s, cache, k), &alone[s][k]));
        }
    }
    worst
}

fn argmax(xs: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best
}

/// A greedy step where verifying the chain as a tree picked another token than sequential
/// decoding did.
#[derive(Debug)]
pub struct Divergence {
    pub step: usize,
    pub sequential: u32,
    pub tree: u32,
    /// Sequential logit of its own choice minus that of the tree's choice: how near the tie.
    pub gap: f32,
    /// `gap` relative to the largest logit magnitude of that row (at least 1).
    pub rel_gap: f32,
}

/// Greedy-decode `steps` tokens one at a time, then verify them as one chain tree (what
/// speculative decoding does with a perfect draft): where the tree's argmax differs from the
/// sequential choice, report the step and how close the two logits were. Exact kernels give
/// none; on a GPU only near-ties may appear.
pub fn greedy_divergences(model: &Model, salt: u64, steps: usize) -> Vec<Divergence> {
    let vocab = model.info().vocab_size;
    let prefix = tokens(6, salt, vocab);
    let mut cache = model.new_cache();
    let mut logits = model.forward_chain_last(&mut cache, &prefix).unwrap();
    let mut chain = Vec::new();
    let mut seq_logits = Vec::new();
    for _ in 0..steps {
        let t = argmax(&logits) as u32;
        chain.push(t);
        logits = model.forward_chain_last(&mut cache, &[t]).unwrap();
        seq_logits.push(logits.clone());
    }
    let mut cache = model.new_cache();
    model.forward_chain_last(&mut cache, &prefix).unwrap();
    let tree = Tree::chain(steps);
    let rows = model.forward_tree(&mut cache, &chain, &tree).unwrap();
    let mut out = Vec::new();
    for i in 0..steps {
        let (s, t) = (argmax(&seq_logits[i]), argmax(rows.row(i)));
        if s != t {
            let gap = seq_logits[i][s] - seq_logits[i][t];
            let scale = seq_logits[i].iter().fold(1.0f32, |m, x| m.max(x.abs()));
            out.push(Divergence {
                step: i + 1,
                sequential: s as u32,
                tree: t as u32,
                gap,
                rel_gap: gap / scale,
            });
        }
    }
    out
}
