//! Random weights of a real shape (`sequoia_engine::random`), on the CPU: the in-memory model
//! loads like a quantized GGUF file, is deterministic in its seed, and keeps the engine's
//! guarantees on both kernel paths: exact on our CPU kernels, within rounding on the portable
//! path (candle's quantized matmul and candle-op attention: the code a GPU runs).

mod common;

use common::*;
use sequoia_engine::random::{RandomQuant, RandomSpec};
use sequoia_engine::{Kernels, LoadOptions, Model};

fn tiny(seed: u64, quant: RandomQuant) -> RandomSpec {
    RandomSpec {
        seed,
        quant,
        ..RandomSpec::named("tiny").unwrap()
    }
}

fn load(spec: &RandomSpec, kernels: Kernels) -> Model {
    Model::random(spec, &LoadOptions::default(), kernels).unwrap()
}

#[test]
fn random_model_has_the_shape_and_is_batch_invariant_on_cpu_kernels() {
    let spec = tiny(1, RandomQuant::Q4KM);
    let model = load(&spec, Kernels::Native);
    let info = model.info();
    let s = &spec.shape;
    assert_eq!(
        (info.n_layers, info.hidden_size, info.intermediate_size),
        (s.layers, s.hidden, s.intermediate)
    );
    assert_eq!((info.n_heads, info.n_kv_heads, info.head_dim), (4, 2, 64));
    assert_eq!(info.vocab_size, s.vocab_size);
    assert_eq!(
        (info.architecture.as_str(), info.weights.as_str()),
        ("qwen2", "Q4KM")
    );
    assert!(info.batch_invariant, "quantized weights on our CPU kernels");
    // Exactly equal: the CPU kernels do the same arithmetic for a node whatever the batch.
    assert_eq!(tree_vs_sequential(&model), 0.0);
    assert_eq!(compaction_vs_sequential(&model), 0.0);
    assert_eq!(interleaved_sessions(&model), 0.0);
    let div = greedy_divergences(&model, 3, 12);
    assert!(div.is_empty(), "{div:?}");
}

#[test]
fn random_weights_are_deterministic_in_the_seed() {
    let prefix = tokens(8, 1, 512);
    let a = sequential(
        &load(&tiny(5, RandomQuant::Q4KM), Kernels::Native),
        &prefix,
        &[],
    );
    let b = sequential(
        &load(&tiny(5, RandomQuant::Q4KM), Kernels::Native),
        &prefix,
        &[],
    );
    let c = sequential(
        &load(&tiny(6, RandomQuant::Q4KM), Kernels::Native),
        &prefix,
        &[],
    );
    assert_eq!(a, b);
    assert!(max_diff(&a, &c) > 1e-2, "another seed, other weights");
    // Not degenerate: logits spread out (a flat distribution would hide attention bugs).
    let sd = {
        let m = a.iter().sum::<f32>() / a.len() as f32;
        (a.iter().map(|x| (x - m) * (x - m)).sum::<f32>() / a.len() as f32).sqrt()
    };
    assert!(sd > 0.1 && a.iter().all(|x| x.is_finite()), "logit sd {sd}");
}

/// The relative tolerance between different kernels over the same quantized weights: both
/// round the activations to 8 bits per block, in different groupings.
const KERNEL_TOL: f32 = 0.05;
/// candle's attention and matmul over different batch shapes: f32 rounding only.
const BATCH_TOL: f32 = 1e-3;

#[test]
fn portable_path_agrees_with_the_cpu_kernels_and_with_itself() {
    for quant in [RandomQuant::Q4KM, RandomQuant::Q8_0] {
        let spec = tiny(2, quant);
        let native = load(&spec, Kernels::Native);
        let portable = load(&spec, Kernels::Portable);
        assert!(
            !portable.info().batch_invariant,
            "candle kernels: not guaranteed"
        );
        for salt in 0..3 {
            let prefix = tokens(6 + salt as usize, salt, 512);
            let d = rel_diff(
                &sequential(&portable, &prefix, &[]),
                &sequential(&native, &prefix, &[]),
            );
            eprintln!("{quant:?}: portable vs native, relative {d:.2e}");
            assert!(d < KERNEL_TOL, "{quant:?}: portable vs native {d}");
        }
        let t = tree_vs_sequential(&portable);
        let c = compaction_vs_sequential(&portable);
        let s = interleaved_sessions(&portable);
        eprintln!("{quant:?}: portable tree {t:.2e}, compaction {c:.2e}, sessions {s:.2e}");
        assert!(
            t < BATCH_TOL && c < BATCH_TOL && s < BATCH_TOL,
            "{quant:?}: {t} {c} {s}"
        );
        for d in greedy_divergences(&portable, 4, 12) {
            eprintln!("{quant:?}: near-tie divergence {d:?}");
            assert!(d.gap < 1e-2, "{quant:?}: not a near-tie: {d:?}");
        }
    }
}

#[test]
fn unknown_shapes_and_formats_are_errors() {
    assert!(RandomSpec::named("qwen2.5-3b").is_err());
    assert!("q2_k".parse::<RandomQuant>().is_err());
    assert_eq!("Q8_0".parse::<RandomQuant>().unwrap(), RandomQuant::Q8_0);
}

#[test]
fn portable_attention_matches_the_cpu_attention_kernel_on_dense_weights() {
    // Dense f32 weights take the same matmul on both paths, so this isolates attention (candle
    // ops with an additive mask vs our kernel): equal up to f32 rounding.
    use sequoia_engine::testing::{write_tiny_model, TinyArch, TinySpec};
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec {
        arch: TinyArch::Qwen2,
        seed: 21,
        ..TinySpec::default()
    };
    let path = write_tiny_model(&dir.path().join("m"), &spec).unwrap();
    let opts = LoadOptions::default();
    let native = Model::load_with(&path, &opts, Kernels::Native).unwrap();
    let portable = Model::load_with(&path, &opts, Kernels::Portable).unwrap();
    let vocab = spec.vocab_size;
    let tree = sequoia_core::tree::Tree::from_parents(&[-1, 0, 0, 1, 2, 2]).unwrap();
    let prefix = tokens(9, 7, vocab);
    let nodes = tokens(tree.len(), 8, vocab);
    let run = |m: &Model| {
        let mut cache = m.new_cache();
        m.forward_chain_last(&mut cache, &prefix).unwrap();
        m.forward_tree(&mut cache, &nodes, &tree)
            .unwrap()
            .into_vec()
    };
    let d = rel_diff(&run(&portable), &run(&native));
    assert!(d < 1e-5, "attention paths differ by {d}");
    assert!(tree_vs_sequential(&portable) < 1e-5);
}
