//! Batched forwards across sessions (`Model::forward_batch`, used by the verify node's batch
//! scheduler): every entry's logits and cache must be bit-identical to the same step run alone,
//! whatever else shares the forward, and a failed batch must leave every cache as it was.

mod common;

use common::tokens;
use sequoia_core::tree::Tree;
use sequoia_engine::random::{RandomQuant, RandomSpec};
use sequoia_engine::{BatchEntry, BatchShape, Kernels, KvCache, LoadOptions, Model};

fn model(quant: RandomQuant) -> Model {
    let spec = RandomSpec {
        seed: 11,
        quant,
        ..RandomSpec::named("tiny").unwrap()
    };
    Model::random(&spec, &LoadOptions::default(), Kernels::Native).unwrap()
}

/// A cache holding `len` prefix tokens (salted so sessions differ).
fn session(model: &Model, len: usize, salt: u64) -> KvCache {
    let mut c = model.new_cache();
    if len > 0 {
        model
            .forward_chain(&mut c, &tokens(len, salt, model.info().vocab_size))
            .unwrap();
    }
    c
}

/// The next token's logits after the cache (probes that two caches hold the same thing).
fn probe(model: &Model, cache: &KvCache) -> Vec<f32> {
    let mut c = cache.fork().unwrap();
    model.forward_chain_last(&mut c, &[5]).unwrap()
}

#[test]
fn batched_entries_match_each_entry_alone_bit_for_bit() {
    let model = model(RandomQuant::Q4KM);
    assert!(
        model.info().batch_invariant,
        "the test needs batch-invariant kernels"
    );
    let vocab = model.info().vocab_size;
    let trees = [
        Tree::from_parents(&[-1, 0, 0, 1, 1, 2, 3]).unwrap(),
        Tree::chain(1),
        Tree::k_by_d(2, 3),
    ];
    let prefixes = [17, 3, 40];
    let chain = tokens(9, 99, vocab); // a prefill chunk of a fourth session, 12 tokens in
    let toks: Vec<Vec<u32>> = trees
        .iter()
        .enumerate()
        .map(|(i, t)| tokens(t.len(), 50 + i as u64, vocab))
        .collect();

    // Each alone.
    let mut alone = Vec::new();
    let mut alone_caches = Vec::new();
    for ((tree, t), &p) in trees.iter().zip(&toks).zip(&prefixes) {
        let mut c = session(&model, p, p as u64);
        alone.push(model.forward_tree(&mut c, t, tree).unwrap());
        alone_caches.push(c);
    }
    let mut chain_alone = session(&model, 12, 4);
    model.forward_chain(&mut chain_alone, &chain).unwrap();

    // All in one forward, in a different order, with a prefill chunk among them.
    let mut caches: Vec<KvCache> = prefixes
        .iter()
        .map(|&p| session(&model, p, p as u64))
        .collect();
    let mut chain_cache = session(&model, 12, 4);
    let all_rows: Vec<Vec<usize>> = trees.iter().map(|t| (0..t.len()).collect()).collect();
    let (c0, rest) = caches.split_at_mut(1);
    let (c1, c2) = rest.split_at_mut(1);
    let mut entries = vec![
        BatchEntry {
            cache: &mut c2[0],
            tokens: &toks[2],
            shape: BatchShape::Tree(&trees[2]),
            rows: &all_rows[2],
        },
        BatchEntry {
            cache: &mut chain_cache,
            tokens: &chain,
            shape: BatchShape::Chain,
            rows: &[],
        },
        BatchEntry {
            cache: &mut c0[0],
            tokens: &toks[0],
            shape: BatchShape::Tree(&trees[0]),
            rows: &all_rows[0],
        },
        BatchEntry {
            cache: &mut c1[0],
            tokens: &toks[1],
            shape: BatchShape::Tree(&trees[1]),
            rows: &all_rows[1],
        },
    ];
    let out = model.forward_batch(&mut entries).unwrap();
    drop(entries);
    assert_eq!(out.len(), 4);
    assert_eq!(out[1].rows(), 0, "a prefill chunk asks for no logits");
    for (got, want) in [
        (&out[2], &alone[0]),
        (&out[3], &alone[1]),
        (&out[0], &alone[2]),
    ] {
        assert_eq!(got.rows(), want.rows());
        assert_eq!(
            got.as_slice(),
            want.as_slice(),
            "batched logits differ from alone"
        );
    }
    for (c, a) in caches.iter().zip(&alone_caches) {
        assert_eq!(c.len(), a.len());
        assert_eq!(
            probe(&model, c),
            probe(&model, a),
            "batched cache differs from alone"
        );
    }
    assert_eq!(chain_cache.len(), 21);
    assert_eq!(probe(&model, &chain_cache), probe(&model, &chain_alone));
}

#[test]
fn selected_rows_of_a_batch_are_the_full_rows() {
    let model = model(RandomQuant::Q8_0);
    let vocab = model.info().vocab_size;
    let tree = Tree::star(5);
    let t = tokens(tree.len(), 8, vocab);
    let mut a = session(&model, 6, 1);
    let mut b = session(&model, 6, 1);
    let full = model.forward_tree(&mut a, &t, &tree).unwrap();
    let rows = [4, 0, 4];
    let out = model
        .forward_batch(&mut [BatchEntry {
            cache: &mut b,
            tokens: &t,
            shape: BatchShape::Tree(&tree),
            rows: &rows,
        }])
        .unwrap();
    for (r, &node) in rows.iter().enumerate() {
        assert_eq!(out[0].row(r), full.row(node));
    }
}

#[test]
fn a_bad_entry_fails_the_batch_and_changes_no_cache() {
    let model = model(RandomQuant::Q4KM);
    let vocab = model.info().vocab_size;
    let tree = Tree::chain(3);
    let good = tokens(3, 2, vocab);
    let mut a = session(&model, 5, 1);
    let mut b = session(&model, 7, 2);
    let (la, lb) = (a.len(), b.len());
    let before = probe(&model, &a);
    // Out-of-vocabulary token in the second entry.
    let bad = vec![1, vocab as u32, 2];
    let err = model
        .forward_batch(&mut [
            BatchEntry {
                cache: &mut a,
                tokens: &good,
                shape: BatchShape::Tree(&tree),
                rows: &[0],
            },
            BatchEntry {
                cache: &mut b,
                tokens: &bad,
                shape: BatchShape::Tree(&tree),
                rows: &[0],
            },
        ])
        .unwrap_err();
    assert!(err.to_string().contains("out of vocabulary"), "{err}");
    // Tokens that do not match the tree.
    let err = model
        .forward_batch(&mut [BatchEntry {
            cache: &mut a,
            tokens: &good[..2],
            shape: BatchShape::Tree(&tree),
            rows: &[],
        }])
        .unwrap_err();
    assert!(err.to_string().contains("batch entry 0"), "{err}");
    assert_eq!((a.len(), b.len()), (la, lb));
    assert_eq!(probe(&model, &a), before);
}

#[test]
fn portable_kernels_batch_sessions_too() {
    // The candle-op path (what a GPU runs) is not batch invariant, so only near agreement.
    let spec = RandomSpec {
        seed: 3,
        quant: RandomQuant::Q8_0,
        ..RandomSpec::named("tiny").unwrap()
    };
    let model = Model::random(&spec, &LoadOptions::default(), Kernels::Portable).unwrap();
    let vocab = model.info().vocab_size;
    let (ta, tb) = (Tree::k_by_d(2, 2), Tree::chain(2));
    let (xa, xb) = (tokens(ta.len(), 1, vocab), tokens(tb.len(), 2, vocab));
    let mut a1 = session(&model, 4, 1);
    let mut b1 = session(&model, 9, 2);
    let la = model.forward_tree(&mut a1, &xa, &ta).unwrap();
    let lb = model.forward_tree(&mut b1, &xb, &tb).unwrap();
    let mut a2 = session(&model, 4, 1);
    let mut b2 = session(&model, 9, 2);
    let (ra, rb): (Vec<usize>, Vec<usize>) = ((0..ta.len()).collect(), (0..tb.len()).collect());
    let out = model
        .forward_batch(&mut [
            BatchEntry {
                cache: &mut a2,
                tokens: &xa,
                shape: BatchShape::Tree(&ta),
                rows: &ra,
            },
            BatchEntry {
                cache: &mut b2,
                tokens: &xb,
                shape: BatchShape::Tree(&tb),
                rows: &rb,
            },
        ])
        .unwrap();
    assert!(common::rel_diff(out[0].as_slice(), la.as_slice()) < 1e-3);
    assert!(common::rel_diff(out[1].as_slice(), lb.as_slice()) < 1e-3);
}
