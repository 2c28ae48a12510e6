//! Tree attention and KV-cache compaction on tiny random-weight models (both architectures):
//! every tree node's logits must equal those of decoding its root-to-node path one token at a
//! time, and a compacted cache must behave exactly like a fresh sequential run.

use sequoia_core::tree::Tree;
use sequoia_engine::testing::{write_tiny_model, TinyArch, TinySpec};
use sequoia_engine::{EngineError, LoadOptions, Model};

const TOL: f32 = 1e-4;

fn load(spec: &TinySpec) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_tiny_model(&dir.path().join("m"), spec).unwrap();
    let model = Model::load(&path, &LoadOptions::default()).unwrap();
    (dir, model)
}

/// Deterministic pseudo-random token ids.
fn tokens(n: usize, salt: u64, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| {
            let x = (i + 1)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add(salt.wrapping_mul(0xbf58_476d_1ce4_e5b9));
            ((x >> 17) % vocab as u64) as u32
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Logits after `prefix` then `seq` decoded one token at a time on a fresh cache.
fn sequential(model: &Model, prefix: &[u32], seq: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache();
    let mut last = model.forward_chain_last(&mut cache, prefix).unwrap();
    for &t in seq {
        last = model.forward_chain_last(&mut cache, &[t]).unwrap();
    }
    assert_eq!(cache.len(), prefix.len() + seq.len());
    last
}

fn specs() -> Vec<TinySpec> {
    vec![
        TinySpec {
            arch: TinyArch::Llama,
            seed: 11,
            ..TinySpec::default()
        },
        TinySpec {
            arch: TinyArch::Qwen2,
            seed: 12,
            tie_embeddings: true,
            ..TinySpec::default()
        },
        // Multi-query attention (one KV head), untied Qwen2.
        TinySpec {
            arch: TinyArch::Qwen2,
            seed: 13,
            heads: 4,
            kv_heads: 1,
            ..TinySpec::default()
        },
    ]
}

fn trees() -> Vec<Tree> {
    vec![
        Tree::chain(1),
        Tree::chain(5),
        Tree::star(6),
        Tree::from_parents(&[-1, 0, 0, 1, 1, 2, 3, 3, 5, 6]).unwrap(),
        Tree::k_by_d(3, 3),
    ]
}

#[test]
fn engine_tree_logits_match_sequential_decoding() {
    for spec in specs() {
        let (_dir, model) = load(&spec);
        let vocab = model.info().vocab_size;
        assert_eq!(vocab, spec.vocab_size);
        for (ti, tree) in trees().iter().enumerate() {
            let prefix = tokens(7, 100 + ti as u64, vocab);
            let nodes = tokens(tree.len(), 200 + ti as u64, vocab);
            let mut cache = model.new_cache();
            model.forward_chain_last(&mut cache, &prefix).unwrap();
            let logits = model.forward_tree(&mut cache, &nodes, tree).unwrap();
            assert_eq!(cache.len(), prefix.len() + tree.len());
            assert_eq!(logits.rows(), tree.len());
            assert_eq!(logits.vocab(), vocab);
            for i in 0..tree.len() {
                let path: Vec<u32> = tree.path_to(i).iter().map(|&j| nodes[j]).collect();
                let want = sequential(&model, &prefix, &path);
                let d = max_diff(logits.row(i), &want);
                assert!(d < TOL, "{:?} tree #{ti} node {i}: max diff {d}", spec.arch);
            }
        }
    }
}

#[test]
fn engine_tree_without_prefix_and_chain_prefill() {
    let (_dir, model) = load(&specs()[0]);
    let vocab = model.info().vocab_size;
    let tree = Tree::from_parents(&[-1, 0, 0, 1, 2, 2]).unwrap();
    let nodes = tokens(tree.len(), 5, vocab);
    let mut cache = model.new_cache();
    let logits = model.forward_tree(&mut cache, &nodes, &tree).unwrap();
    for i in 0..tree.len() {
        let path: Vec<u32> = tree.path_to(i).iter().map(|&j| nodes[j]).collect();
        // Whole path as one chain forward (causal mask) vs the tree row.
        let mut c = model.new_cache();
        let want = model.forward_chain_last(&mut c, &path).unwrap();
        assert!(max_diff(logits.row(i), &want) < TOL, "node {i}");
    }
}

#[test]
fn engine_selected_rows_match_full_logits() {
    let (_dir, model) = load(&specs()[1]);
    let vocab = model.info().vocab_size;
    let tree = Tree::k_by_d(2, 3);
    let prefix = tokens(4, 9, vocab);
    let nodes = tokens(tree.len(), 10, vocab);
    let mut a = model.new_cache();
    model.forward_chain_last(&mut a, &prefix).unwrap();
    let mut b = a.fork().unwrap();
    let full = model.forward_tree(&mut a, &nodes, &tree).unwrap();
    let rows = [5, 0, 3, 3];
    let some = model
        .forward_tree_rows(&mut b, &nodes, &tree, &rows)
        .unwrap();
    assert_eq!(some.rows(), rows.len());
    for (r, &i) in rows.iter().enumerate() {
        assert!(max_diff(some.row(r), full.row(i)) < TOL);
    }
}

#[test]
fn engine_compaction_matches_fresh_sequential_run() {
    for spec in specs() {
        let (_dir, model) = load(&spec);
        let vocab = model.info().vocab_size;
        let tree = Tree::from_parents(&[-1, 0, 0, 0, 1, 1, 2, 4, 4, 6]).unwrap();
        let prefix = tokens(9, 31, vocab);
        let nodes = tokens(tree.len(), 32, vocab);
        let more = tokens(4, 33, vocab);
        for leaf in [0, 3, 5, 8, 9] {
            let path = tree.path_to(leaf);
            let mut cache = model.new_cache();
            model.forward_chain_last(&mut cache, &prefix).unwrap();
            model.forward_tree(&mut cache, &nodes, &tree).unwrap();
            cache.keep_newest(tree.len(), &path).unwrap();
            assert_eq!(cache.len(), prefix.len() + path.len());
            // Decode further, one token and then a short chain.
            let l1 = model.forward_chain_last(&mut cache, &more[..1]).unwrap();
            let l2 = model.forward_chain_last(&mut cache, &more[1..]).unwrap();

            let mut seq: Vec<u32> = path.iter().map(|&j| nodes[j]).collect();
            seq.push(more[0]);
            let want1 = sequential(&model, &prefix, &seq);
            seq.extend_from_slice(&more[1..]);
            let want2 = sequential(&model, &prefix, &seq);
            let (d1, d2) = (max_diff(&l1, &want1), max_diff(&l2, &want2));
            assert!(
                d1 < TOL && d2 < TOL,
                "{:?} leaf {leaf}: {d1} {d2}",
                spec.arch
            );

            // A second tree step on the compacted cache also matches.
            let tree2 = Tree::star(3);
            let nodes2 = tokens(tree2.len(), 34 + leaf as u64, vocab);
            let logits = model.forward_tree(&mut cache, &nodes2, &tree2).unwrap();
            for i in 0..tree2.len() {
                let mut s = seq.clone();
                s.extend(tree2.path_to(i).iter().map(|&j| nodes2[j]));
                let d = max_diff(logits.row(i), &sequential(&model, &prefix, &s));
                assert!(d < TOL, "second step node {i}: {d}");
            }
        }
    }
}

#[test]
fn engine_truncate_rolls_back() {
    let (_dir, model) = load(&specs()[0]);
    let vocab = model.info().vocab_size;
    let prefix = tokens(6, 41, vocab);
    let mut cache = model.new_cache();
    model.forward_chain_last(&mut cache, &prefix).unwrap();
    let tree = Tree::star(4);
    let nodes = tokens(5, 42, vocab);
    model.forward_tree(&mut cache, &nodes, &tree).unwrap();
    cache.truncate(prefix.len());
    let got = model.forward_chain_last(&mut cache, &[7]).unwrap();
    let want = sequential(&model, &prefix, &[7]);
    assert!(max_diff(&got, &want) < TOL);
}

#[test]
fn engine_cache_grows_across_chunks() {
    // Past the first allocation chunk, with a prefill longer than one prefill chunk.
    let spec = TinySpec {
        max_position: 2048,
        ..specs()[0].clone()
    };
    let (_dir, model) = load(&spec);
    let vocab = model.info().vocab_size;
    let prefix = tokens(700, 51, vocab);
    let mut cache = model.new_cache();
    let once = model.forward_chain_last(&mut cache, &prefix).unwrap();
    assert!(cache.allocated() >= 700);
    let mut c2 = model.new_cache();
    model.forward_chain_last(&mut c2, &prefix[..250]).unwrap();
    model
        .forward_chain_last(&mut c2, &prefix[250..699])
        .unwrap();
    let stepwise = model.forward_chain_last(&mut c2, &prefix[699..]).unwrap();
    assert!(max_diff(&once, &stepwise) < TOL);
}

#[test]
fn engine_context_full_is_an_error() {
    let spec = TinySpec {
        max_position: 16,
        ..specs()[1].clone()
    };
    let (_dir, model) = load(&spec);
    assert_eq!(model.info().max_context, 16);
    let mut cache = model.new_cache();
    assert_eq!(cache.capacity(), 16);
    model.forward_chain_last(&mut cache, &[1; 10]).unwrap();
    let tree = Tree::k_by_d(2, 4); // 9 nodes: 19 > 16
    let err = model.forward_tree(&mut cache, &[3; 9], &tree).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::ContextFull {
                needed: 19,
                limit: 16
            }
        ),
        "{err}"
    );
    assert_eq!(
        cache.len(),
        10,
        "a failed forward leaves the cache as it was"
    );
    let err = model.forward_chain_last(&mut cache, &[1; 7]).unwrap_err();
    assert!(matches!(err, EngineError::ContextFull { .. }), "{err}");
    assert_eq!(cache.len(), 10);
    // Exactly full is fine; one more is not.
    model.forward_chain_last(&mut cache, &[1; 6]).unwrap();
    assert_eq!(cache.len(), 16);
    let err = model.forward_chain_last(&mut cache, &[1]).unwrap_err();
    assert!(matches!(err, EngineError::ContextFull { .. }), "{err}");

    // A model-level limit below the trained context.
    let dir = tempfile::tempdir().unwrap();
    let p = write_tiny_model(dir.path(), &specs()[0]).unwrap();
    let small = Model::load(
        &p,
        &LoadOptions {
            max_context: 8,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let mut c = small.new_cache();
    let err = small.forward_chain_last(&mut c, &[1; 9]).unwrap_err();
    assert!(matches!(
        err,
        EngineError::ContextFull {
            needed: 9,
            limit: 8
        }
    ));
}

#[test]
fn engine_bad_inputs_are_errors() {
    let (_dir, model) = load(&specs()[0]);
    let vocab = model.info().vocab_size as u32;
    let mut cache = model.new_cache();
    assert!(matches!(
        model.forward_chain_last(&mut cache, &[]),
        Err(EngineError::InvalidInput(_))
    ));
    assert!(matches!(
        model.forward_chain_last(&mut cache, &[vocab]),
        Err(EngineError::InvalidInput(_))
    ));
    assert!(matches!(
        model.forward_tree(&mut cache, &[1, 2], &Tree::chain(3)),
        Err(EngineError::InvalidInput(_))
    ));
    assert!(matches!(
        model.forward_tree_rows(&mut cache, &[1, 2], &Tree::chain(2), &[2]),
        Err(EngineError::InvalidInput(_))
    ));
    assert_eq!(cache.len(), 0);
    model.forward_chain_last(&mut cache, &[1, 2, 3]).unwrap();
    for (n, keep) in [(4, vec![0]), (3, vec![1, 1]), (3, vec![2, 1]), (3, vec![3])] {
        assert!(
            matches!(
                cache.keep_newest(n, &keep),
                Err(EngineError::InvalidInput(_))
            ),
            "{n} {keep:?}"
        );
    }
    assert_eq!(cache.len(), 3);
    // A cache from another model is rejected.
    let other = TinySpec {
        layers: 3,
        ..specs()[0].clone()
    };
    let (_d2, m2) = load(&other);
    let mut foreign = m2.new_cache();
    assert!(matches!(
        model.forward_chain_last(&mut foreign, &[1]),
        Err(EngineError::InvalidInput(_))
    ));
}

#[test]
fn engine_half_precision_safetensors_load() {
    // f16/bf16 checkpoints are converted to f32 on the CPU; logits stay close to the f32 model.
    let base = specs()[1].clone();
    let (_d, f32_model) = load(&base);
    let prefix = tokens(5, 61, base.vocab_size);
    let want = sequential(&f32_model, &prefix, &[]);
    for dtype in [candle_core::DType::F16, candle_core::DType::BF16] {
        let (_d, m) = load(&TinySpec {
            dtype,
            ..base.clone()
        });
        let got = sequential(&m, &prefix, &[]);
        let d = max_diff(&got, &want);
        assert!(d < 0.2, "{dtype:?}: {d}");
    }
}

#[test]
fn engine_perturbed_draft_is_close_but_not_equal() {
    let target = specs()[0].clone();
    let copy = TinySpec {
        seed: 99,
        perturb_of: Some(target.seed),
        noise: 0.0,
        ..target.clone()
    };
    let draft = TinySpec {
        noise: 0.3,
        ..copy.clone()
    };
    let (_a, t) = load(&target);
    let (_b, c) = load(&copy);
    let (_c, d) = load(&draft);
    let prefix = tokens(6, 71, target.vocab_size);
    let lt = sequential(&t, &prefix, &[]);
    assert_eq!(lt, sequential(&c, &prefix, &[]), "noise 0 is an exact copy");
    let ld = sequential(&d, &prefix, &[]);
    let diff = max_diff(&lt, &ld);
    assert!(diff > 1e-3, "noise changes the logits");
}

#[test]
fn engine_tree_extend_level_by_level_matches_one_forward() {
    // The drafter grows a tree one level per call; the result must equal one tree forward.
    for spec in specs() {
        let (_dir, model) = load(&spec);
        let vocab = model.info().vocab_size;
        let tree = Tree::from_parents(&[-1, 0, 0, 1, 1, 2, 3, 3, 5, 6]).unwrap();
        let prefix = tokens(6, 81, vocab);
        let nodes = tokens(tree.len(), 82, vocab);
        let mut a = model.new_cache();
        model.forward_chain_last(&mut a, &prefix).unwrap();
        let mut b = a.fork().unwrap();
        let full = model.forward_tree(&mut a, &nodes, &tree).unwrap();
        let mut start = 0;
        for level in 0..tree.levels() {
            let range = tree.level_range(level);
            let rows: Vec<usize> = range.clone().collect();
            let end = range.end;
            let sub = Tree::from_parents(&tree.parents()[..end]).unwrap();
            let got = model
                .forward_tree_extend(&mut b, &nodes[..end], &sub, start, &rows, vocab)
                .unwrap();
            for (r, &i) in rows.iter().enumerate() {
                let d = max_diff(got.row(r), full.row(i));
                assert!(d < TOL, "{:?} level {level} node {i}: {d}", spec.arch);
            }
            start = end;
        }
        assert_eq!(b.len(), a.len());
    }
}

#[test]
fn engine_pruned_head_equals_the_full_heads_first_columns() {
    // A vocabulary-pruned draft scores ids 0..k only; each of those logits must be the full
    // head's, bit for bit, or drafting with pruning would change which tokens are proposed.
    for spec in specs() {
        let (_dir, model) = load(&spec);
        let vocab = model.info().vocab_size;
        let tree = Tree::from_parents(&[-1, 0, 0, 1, 2]).unwrap();
        let prefix = tokens(5, 91, vocab);
        let nodes = tokens(tree.len(), 92, vocab);
        let rows = [0usize, 1, 2, 3, 4];
        for k in [1, 16, vocab / 2, vocab - 1, vocab] {
            let mut a = model.new_cache();
            model.forward_chain(&mut a, &prefix).unwrap();
            let mut b = a.fork().unwrap();
            let full = model
                .forward_tree_extend(&mut a, &nodes, &tree, 0, &rows, vocab)
                .unwrap();
            let pruned = model
                .forward_tree_extend(&mut b, &nodes, &tree, 0, &rows, k)
                .unwrap();
            assert_eq!(pruned.vocab(), k);
            for r in 0..rows.len() {
                assert_eq!(pruned.row(r), &full.row(r)[..k], "k = {k}, row {r}");
            }
        }
        let mut c = model.new_cache();
        for bad in [0, vocab + 1] {
            assert!(model
                .forward_tree_extend(&mut c, &nodes, &tree, 0, &rows, bad)
                .is_err());
        }
    }
}

#[test]
fn engine_chain_without_head_leaves_the_same_cache() {
    // forward_chain skips the LM head; the cache it leaves must be the one forward_chain_last
    // leaves, so the next logits are identical.
    for spec in specs() {
        let (_dir, model) = load(&spec);
        let vocab = model.info().vocab_size;
        let prefix = tokens(9, 93, vocab);
        let mut a = model.new_cache();
        let mut b = model.new_cache();
        model.forward_chain_last(&mut a, &prefix).unwrap();
        model.forward_chain(&mut b, &prefix).unwrap();
        assert_eq!(a.len(), b.len());
        let next = tokens(1, 94, vocab);
        assert_eq!(
            model.forward_chain_last(&mut a, &next).unwrap(),
            model.forward_chain_last(&mut b, &next).unwrap()
        );
    }
}

#[test]
fn engine_tiny_model_works_with_the_tiny_tokenizer() {
    // One folder with both: what generate-local and the services load in end-to-end tests.
    use sequoia_engine::tokenizer::{testing::write_tiny_tokenizer, TextTokenizer};
    let dir = tempfile::tempdir().unwrap();
    let path = write_tiny_model(dir.path(), &TinySpec::default()).unwrap();
    write_tiny_tokenizer(&path).unwrap();
    let tok = TextTokenizer::load_for_model(&path).unwrap();
    let model = Model::load(&path, &LoadOptions::default()).unwrap();
    assert_eq!(model.info().vocab_size, tok.vocab_size());
    let ids = tok.encode("hello world", true).unwrap();
    let mut cache = model.new_cache();
    let mut logits = model.forward_chain_last(&mut cache, &ids).unwrap();
    for _ in 0..5 {
        let next = sequoia_core::sampling::argmax(&logits);
        logits = model.forward_chain_last(&mut cache, &[next]).unwrap();
    }
    assert_eq!(cache.len(), ids.len() + 5);
}
