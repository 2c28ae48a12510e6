//! Tiny random-weight models for tests: a Hugging Face folder (config.json + model.safetensors)
//! that [`Model::load`](super::Model::load) reads like any real checkpoint.
//!
//! The default vocabulary matches the tiny test tokenizer
//! ([`crate::tokenizer::testing::write_tiny_tokenizer`]): write both into one folder to get a
//! model that `generate-local` and the services can run end to end.
//!
//! Weights are a pure function of (seed, tensor name), so two specs with the same shape and seed
//! write identical models. For a **draft-like** model, set `perturb_of: Some(target_seed)` and a
//! `noise` level: every tensor becomes the target's tensor plus `noise` times fresh Gaussian
//! noise drawn from `seed`, so the draft agrees with the target often but not always (realistic
//! acceptance rates in integration tests; `noise` 0.0 gives an exact copy).
//!
//! ```no_run
//! use sequoia_engine::testing::{write_tiny_model, TinyArch, TinySpec};
//! let dir = tempfile::tempdir().unwrap();
//! let target = TinySpec { arch: TinyArch::Qwen2, seed: 1, ..TinySpec::default() };
//! let draft = TinySpec { seed: 2, perturb_of: Some(1), noise: 0.2, ..target.clone() };
//! let t = write_tiny_model(&dir.path().join("target"), &target).unwrap();
//! let d = write_tiny_model(&dir.path().join("draft"), &draft).unwrap();
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::tokenizer::testing::{TINY_EOS_ID, TINY_VOCAB_SIZE};

/// Which architecture's config and tensor set to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TinyArch {
    /// LlamaForCausalLM: no biases.
    Llama,
    /// Qwen2ForCausalLM: Q/K/V biases.
    Qwen2,
}

/// Shape and randomness of a tiny model.
#[derive(Debug, Clone, PartialEq)]
pub struct TinySpec {
    pub arch: TinyArch,
    /// Seed of the weights (or of the noise, with `perturb_of`).
    pub seed: u64,
    /// Default: the tiny test tokenizer's vocabulary.
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
    /// `max_position_embeddings`: also the engine's context limit for this model.
    pub max_position: usize,
    pub rope_theta: f32,
    pub rms_eps: f64,
    /// Omit `lm_head.weight` and reuse the embedding as the output projection.
    pub tie_embeddings: bool,
    /// Write the weights of the model with this seed plus `noise` × N(0, 1) drawn from `seed`.
    pub perturb_of: Option<u64>,
    /// Relative noise level for `perturb_of` (noise is scaled like the tensor's own values).
    pub noise: f32,
    /// Storage dtype of the safetensors file (f32, f16 or bf16).
    pub dtype: DType,
    /// Standard deviation of the logits, roughly: larger = peakier next-token distributions.
    pub logit_scale: f32,
}

impl Default for TinySpec {
    fn default() -> Self {
        Self {
            arch: TinyArch::Llama,
            seed: 0,
            vocab_size: TINY_VOCAB_SIZE,
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate: 128,
            max_position: 4096,
            rope_theta: 10_000.0,
            rms_eps: 1e-5,
            tie_embeddings: false,
            perturb_of: None,
            noise: 0.0,
            dtype: DType::F32,
            logit_scale: 4.0,
        }
    }
}

/// A deterministic RNG per (seed, tensor name).
fn rng_for(seed: u64, name: &str) -> ChaCha8Rng {
    // FNV-1a over the name, mixed with the seed.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    ChaCha8Rng::seed_from_u64(h)
}

/// Standard normal samples (Box-Muller).
fn gaussian(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
        let u2: f64 = rng.gen();
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        out.push((r * t.cos()) as f32);
        out.push((r * t.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// How a tensor's values are drawn: `mean + std · N(0, 1)`.
#[derive(Clone, Copy)]
struct Init {
    mean: f32,
    std: f32,
}

fn values(spec: &TinySpec, name: &str, n: usize, init: Init) -> Vec<f32> {
    let base_seed = spec.perturb_of.unwrap_or(spec.seed);
    let mut v: Vec<f32> = gaussian(&mut rng_for(base_seed, name), n)
        .into_iter()
        .map(|z| init.mean + init.std * z)
        .collect();
    if spec.perturb_of.is_some() && spec.noise != 0.0 {
        let noise = gaussian(&mut rng_for(spec.seed ^ 0x5EED_D4AF, name), n);
        for (x, z) in v.iter_mut().zip(noise) {
            *x += spec.noise * init.std.max(0.1) * z;
        }
    }
    v
}

/// Write `config.json` and `model.safetensors` for `spec` into `dir` (created if missing) and
/// return `dir`.
pub fn write_tiny_model(dir: &Path, spec: &TinySpec) -> std::io::Result<PathBuf> {
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    if spec.heads == 0
        || spec.kv_heads == 0
        || !spec.heads.is_multiple_of(spec.kv_heads)
        || !spec.hidden.is_multiple_of(spec.heads)
        || !(spec.hidden / spec.heads).is_multiple_of(2)
    {
        return Err(invalid(format!("inconsistent tiny model shape {spec:?}")));
    }
    std::fs::create_dir_all(dir)?;
    let h = spec.hidden;
    let hd = h / spec.heads;
    let kvd = spec.kv_heads * hd;
    let fan = |k: usize| Init {
        mean: 0.0,
        std: 1.0 / (k as f32).sqrt(),
    };
    let norm = Init {
        mean: 1.0,
        std: 0.1,
    };
    let mut specs: Vec<(String, Vec<usize>, Init)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![spec.vocab_size, h],
            Init {
                mean: 0.0,
                std: if spec.tie_embeddings {
                    spec.logit_scale / (h as f32).sqrt()
                } else {
                    1.0
                },
            },
        ),
        ("model.norm.weight".into(), vec![h], norm),
    ];
    if !spec.tie_embeddings {
        specs.push((
            "lm_head.weight".into(),
            vec![spec.vocab_size, h],
            Init {
                mean: 0.0,
                std: spec.logit_scale / (h as f32).sqrt(),
            },
        ));
    }
    for i in 0..spec.layers {
        let p = format!("model.layers.{i}");
        specs.push((format!("{p}.input_layernorm.weight"), vec![h], norm));
        specs.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            norm,
        ));
        specs.push((format!("{p}.self_attn.q_proj.weight"), vec![h, h], fan(h)));
        specs.push((format!("{p}.self_attn.k_proj.weight"), vec![kvd, h], fan(h)));
        specs.push((format!("{p}.self_attn.v_proj.weight"), vec![kvd, h], fan(h)));
        specs.push((format!("{p}.self_attn.o_proj.weight"), vec![h, h], fan(h)));
        let mi = spec.intermediate;
        specs.push((format!("{p}.mlp.gate_proj.weight"), vec![mi, h], fan(h)));
        specs.push((format!("{p}.mlp.up_proj.weight"), vec![mi, h], fan(h)));
        specs.push((format!("{p}.mlp.down_proj.weight"), vec![h, mi], fan(mi)));
        if spec.arch == TinyArch::Qwen2 {
            let b = Init {
                mean: 0.0,
                std: 0.1,
            };
            specs.push((format!("{p}.self_attn.q_proj.bias"), vec![h], b));
            specs.push((format!("{p}.self_attn.k_proj.bias"), vec![kvd], b));
            specs.push((format!("{p}.self_attn.v_proj.bias"), vec![kvd], b));
        }
    }
    let mut tensors = HashMap::new();
    for (name, shape, init) in specs {
        let n = shape.iter().product();
        let t = Tensor::from_vec(values(spec, &name, n, init), shape, &Device::Cpu)
            .and_then(|t| t.to_dtype(spec.dtype))
            .map_err(|e| invalid(e.to_string()))?;
        tensors.insert(name, t);
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))
        .map_err(|e| std::io::Error::other(e.to_string()))?;

    let (architecture, model_type) = match spec.arch {
        TinyArch::Llama => ("LlamaForCausalLM", "llama"),
        TinyArch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
    };
    let config = serde_json::json!({
        "architectures": [architecture],
        "model_type": model_type,
        "_name_or_path": format!("tiny-{model_type}-seed{}", spec.seed),
        "vocab_size": spec.vocab_size,
        "hidden_size": h,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": spec.rms_eps,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": format!("{:?}", spec.dtype).to_lowercase(),
        "hidden_act": "silu",
        "eos_token_id": TINY_EOS_ID,
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).map_err(std::io::Error::other)?,
    )?;
    Ok(dir.to_path_buf())
}
