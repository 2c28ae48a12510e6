//! The engine on a CUDA device (built only with `--features cuda`; run by scripts/gpu-check.sh
//! on a machine with an NVIDIA GPU). Without a usable device every test fails with a message
//! saying so: a GPU build that cannot reach its GPU is a failure, not a skip.
//!
//! On a GPU the engine is not batch invariant (`ModelInfo::batch_invariant` is false): candle's
//! CUDA quantized matmul quantizes the activations to 8 bits for small batches and dequantizes
//! the weights for cuBLAS on larger ones, so a tree row and the same token decoded alone agree
//! only up to that rounding. These tests bound the differences, print them, and print every
//! greedy divergence with how near a tie it was (failing when it is not near one).
#![cfg(feature = "cuda")]

mod common;

use common::*;
use sequoia_engine::random::{RandomQuant, RandomSpec};
use sequoia_engine::testing::{write_tiny_model, TinyArch, TinySpec};
use sequoia_engine::{Kernels, LoadOptions, Model};

/// GPU vs CPU, or GPU tree vs GPU sequential: different activation rounding over the same
/// quantized weights (the CPU tests see 1–2 % between candle's and our CPU kernels).
const KERNEL_TOL: f32 = 0.05;

fn opts(cuda: bool) -> LoadOptions {
    LoadOptions {
        cuda,
        ..LoadOptions::default()
    }
}

fn no_gpu(e: impl std::fmt::Display) -> ! {
    panic!(
        "these tests need CUDA device 0 (this binary was built with --features cuda): {e}; \
         scripts/gpu-check.sh runs them on a GPU machine"
    )
}

fn random(name: &str, quant: RandomQuant, cuda: bool) -> Model {
    let spec = RandomSpec {
        quant,
        seed: 3,
        ..RandomSpec::named(name).unwrap()
    };
    Model::random(&spec, &opts(cuda), Kernels::Native).unwrap_or_else(|e| {
        if cuda {
            no_gpu(e)
        } else {
            panic!("{e}")
        }
    })
}

#[test]
fn cuda_model_reports_its_device_and_no_batch_invariance() {
    let m = random("tiny", RandomQuant::Q4KM, true);
    assert_eq!(m.info().device, "cuda");
    assert!(!m.info().batch_invariant);
}

#[test]
fn cuda_logits_match_cpu_on_quantized_weights() {
    for (shape, quant) in [
        ("tiny", RandomQuant::Q4KM),
        ("tiny", RandomQuant::Q8_0),
        // The real draft shape: Q5_0/Q8_0 rows of 896, 14 query heads over 2 KV heads.
        ("qwen2.5-0.5b", RandomQuant::Q4KM),
    ] {
        let gpu = random(shape, quant, true);
        let cpu = random(shape, quant, false);
        let vocab = gpu.info().vocab_size;
        for salt in 0..2 {
            let prefix = tokens(5 + salt as usize, 70 + salt, vocab);
            let g = sequential(&gpu, &prefix, &[]);
            let c = sequential(&cpu, &prefix, &[]);
            assert!(g.iter().all(|x| x.is_finite()), "{shape} {quant:?}");
            let d = rel_diff(&g, &c);
            eprintln!("{shape} {quant:?}: GPU vs CPU logits, relative {d:.2e}");
            assert!(d < KERNEL_TOL, "{shape} {quant:?}: GPU vs CPU {d}");
        }
    }
}

#[test]
fn cuda_tree_compaction_and_sessions_match_sequential() {
    for quant in [RandomQuant::Q4KM, RandomQuant::Q8_0] {
        let m = random("tiny", quant, true);
        let t = tree_vs_sequential(&m);
        let c = compaction_vs_sequential(&m);
        let s = interleaved_sessions(&m);
        eprintln!("{quant:?} on GPU: tree {t:.2e}, compaction {c:.2e}, sessions {s:.2e}");
        assert!(t < KERNEL_TOL, "{quant:?}: tree vs sequential {t}");
        assert!(c < KERNEL_TOL, "{quant:?}: compaction {c}");
        assert!(s < KERNEL_TOL, "{quant:?}: interleaved sessions {s}");
    }
}

#[test]
fn cuda_greedy_divergences_are_near_ties() {
    let m = random("tiny", RandomQuant::Q4KM, true);
    let mut total = 0;
    for salt in 0..4 {
        for d in greedy_divergences(&m, 90 + salt, 16) {
            total += 1;
            eprintln!("near-tie divergence (prompt {salt}): {d:?}");
            assert!(d.rel_gap < KERNEL_TOL, "not a near-tie: {d:?}");
        }
    }
    eprintln!("{total} greedy divergences in 64 steps");
}

#[test]
fn cuda_half_precision_dense_model_matches_cpu() {
    // Safetensors in f16 stay f16 on a GPU: the half-precision mask and attention path.
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec {
        arch: TinyArch::Qwen2,
        seed: 8,
        dtype: candle_core::DType::F16,
        ..TinySpec::default()
    };
    let path = write_tiny_model(&dir.path().join("m"), &spec).unwrap();
    let gpu = Model::load(&path, &opts(true)).unwrap_or_else(|e| no_gpu(e));
    let cpu = Model::load(&path, &opts(false)).unwrap();
    let prefix = tokens(9, 5, spec.vocab_size);
    let d = rel_diff(
        &sequential(&gpu, &prefix, &[]),
        &sequential(&cpu, &prefix, &[]),
    );
    let t = tree_vs_sequential(&gpu);
    eprintln!("f16 dense on GPU: vs CPU f32 {d:.2e}, tree vs sequential {t:.2e}");
    assert!(d < KERNEL_TOL, "f16 GPU vs f32 CPU {d}");
    assert!(t < KERNEL_TOL, "f16 tree vs sequential {t}");
}
