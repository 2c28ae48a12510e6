//! Random weights of a real model's shape, made in memory: the planner's costs t_v(n) and t_d(w)
//! depend on the shapes and the weight format, not on the values, so a machine without network
//! access (a lent GPU node) can measure them without downloading a checkpoint.
//!
//! [`RandomSpec`] names a shape (the published hyper-parameters of a Qwen2.5 size, or a tiny one
//! for tests) and a format. The tensors are produced under their GGUF names and go through the
//! same loader path as a GGUF file (`weights.rs`), so the model is built exactly like a real
//! quantized one: custom kernels on the CPU, candle's `QMatMul` on a GPU.
//!
//! Formats ([`RandomQuant`]):
//! - `Q4KM`: what llama.cpp's Q4_K_M gives these models: Q4_K matrices, Q6_K for the LM head
//!   (the embedding too when tied) and for `attn_v` / `ffn_down` in llama.cpp's "more bits"
//!   layers; where a row length is not a multiple of 256 (Qwen2.5-0.5B's 896) the k-quants cannot
//!   be used and llama.cpp falls back to Q5_0 (for Q4_K) and Q8_0 (for Q6_K), and so do we.
//! - `Q8_0`: every matrix Q8_0.
//!
//! Values: the quant bytes are uniform random and each block's scale is set so that a matrix's
//! entries have a standard deviation of about `1/√in_features` (activations stay O(1) through the
//! layers); norms are ≈ 1, biases small. Deterministic in (seed, tensor name).

use candle_core::quantized::GgmlDType;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::EngineError;

/// Hyper-parameters of a Qwen2-architecture decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct RandomShape {
    pub name: &'static str,
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
    /// No `output.weight`: the embedding is the LM head (0.5B and 1.5B).
    pub tied: bool,
    pub context_length: usize,
    pub rope_theta: f32,
    pub rms_eps: f64,
}

/// The shapes [`shape`] knows (the Qwen2.5 sizes' config.json values; the Coder variants share
/// them and are accepted as aliases).
pub const SHAPES: [&str; 5] = [
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "qwen2.5-7b",
    "qwen2.5-14b",
    "tiny",
];

/// A named shape (`qwen2.5-coder-*` names are aliases of the base sizes).
pub fn shape(name: &str) -> Result<RandomShape, EngineError> {
    let base =
        |name, vocab_size, hidden, layers, heads, kv_heads, intermediate, tied| RandomShape {
            name,
            vocab_size,
            hidden,
            layers,
            heads,
            kv_heads,
            intermediate,
            tied,
            context_length: 32_768,
            rope_theta: 1_000_000.0,
            rms_eps: 1e-6,
        };
    Ok(match name.replace("-coder", "").as_str() {
        "qwen2.5-0.5b" => base("qwen2.5-0.5b", 151_936, 896, 24, 14, 2, 4_864, true),
        "qwen2.5-1.5b" => base("qwen2.5-1.5b", 151_936, 1_536, 28, 12, 2, 8_960, true),
        "qwen2.5-7b" => base("qwen2.5-7b", 152_064, 3_584, 28, 28, 4, 18_944, false),
        "qwen2.5-14b" => base("qwen2.5-14b", 152_064, 5_120, 48, 40, 8, 13_824, false),
        // Small enough for unit tests, with rows of 256 so the k-quant formats are exercised.
        "tiny" => RandomShape {
            context_length: 4_096,
            ..base("tiny", 512, 256, 2, 4, 2, 512, false)
        },
        _ => {
            return Err(EngineError::Unsupported(format!(
                "random-weights shape {name:?}; known: {SHAPES:?}"
            )))
        }
    })
}

/// Weight format of the random matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RandomQuant {
    /// llama.cpp Q4_K_M-like mix (see the module doc).
    Q4KM,
    /// Every matrix Q8_0.
    Q8_0,
}

impl std::str::FromStr for RandomQuant {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, EngineError> {
        match s.to_ascii_lowercase().as_str() {
            "q4_k_m" | "q4km" | "q4k" => Ok(RandomQuant::Q4KM),
            "q8_0" | "q8" => Ok(RandomQuant::Q8_0),
            _ => Err(EngineError::Unsupported(format!(
                "random-weights format {s:?} (q4_k_m or q8_0)"
            ))),
        }
    }
}

/// A random model: shape, format and seed.
#[derive(Debug, Clone, PartialEq)]
pub struct RandomSpec {
    pub shape: RandomShape,
    pub quant: RandomQuant,
    pub seed: u64,
}

impl RandomSpec {
    /// `shape(name)` in the Q4_K_M-like format, seed 0.
    pub fn named(name: &str) -> Result<Self, EngineError> {
        Ok(Self {
            shape: shape(name)?,
            quant: RandomQuant::Q4KM,
            seed: 0,
        })
    }

    pub(crate) fn head_dim(&self) -> usize {
        self.shape.hidden / self.shape.heads
    }

    /// Whether the tensor of this GGUF name exists in the model.
    pub(crate) fn has(&self, name: &str) -> bool {
        self.dims(name).is_some()
    }

    /// `(dims, is_matrix)` of a GGUF tensor name (candle order: rows first).
    fn dims(&self, name: &str) -> Option<(Vec<usize>, bool)> {
        let s = &self.shape;
        let hd = self.head_dim();
        let (q, kv) = (s.heads * hd, s.kv_heads * hd);
        match name {
            "token_embd.weight" => return Some((vec![s.vocab_size, s.hidden], true)),
            "output.weight" if !s.tied => return Some((vec![s.vocab_size, s.hidden], true)),
            "output_norm.weight" => return Some((vec![s.hidden], false)),
            _ => {}
        }
        let rest = name.strip_prefix("blk.")?;
        let (layer, tensor) = rest.split_once('.')?;
        if layer.parse::<usize>().ok()? >= s.layers {
            return None;
        }
        Some(match tensor {
            "attn_norm.weight" | "ffn_norm.weight" => (vec![s.hidden], false),
            "attn_q.weight" => (vec![q, s.hidden], true),
            "attn_k.weight" | "attn_v.weight" => (vec![kv, s.hidden], true),
            "attn_output.weight" => (vec![s.hidden, q], true),
            "attn_q.bias" => (vec![q], false),
            "attn_k.bias" | "attn_v.bias" => (vec![kv], false),
            "ffn_gate.weight" | "ffn_up.weight" => (vec![s.intermediate, s.hidden], true),
            "ffn_down.weight" => (vec![s.hidden, s.intermediate], true),
            _ => return None,
        })
    }

    /// The format llama.cpp's Q4_K_M would give this tensor (or Q8_0 throughout).
    fn format(&self, name: &str, cols: usize) -> GgmlDType {
        if self.quant == RandomQuant::Q8_0 {
            return GgmlDType::Q8_0;
        }
        let n = self.shape.layers;
        // llama.cpp's use_more_bits(i, n): the first and last eighth, and every third between.
        let more_bits =
            |i: usize| i < n / 8 || i >= 7 * n / 8 || (i >= n / 8 && (i - n / 8) % 3 == 2);
        let layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(l, _)| l.parse::<usize>().ok());
        let six = match name {
            "output.weight" => true,
            "token_embd.weight" => self.shape.tied,
            _ => {
                (name.ends_with("attn_v.weight") || name.ends_with("ffn_down.weight"))
                    && layer.is_some_and(more_bits)
            }
        };
        match (six, cols.is_multiple_of(256)) {
            (true, true) => GgmlDType::Q6K,
            (true, false) => GgmlDType::Q8_0,
            (false, true) => GgmlDType::Q4K,
            (false, false) => GgmlDType::Q5_0,
        }
    }

    /// The tensor of this GGUF name: format, dims and raw GGUF bytes.
    pub(crate) fn tensor(
        &self,
        name: &str,
    ) -> Result<(GgmlDType, Vec<usize>, Vec<u8>), EngineError> {
        let (dims, matrix) = self
            .dims(name)
            .ok_or_else(|| EngineError::Load(format!("tensor {name} missing")))?;
        let seed = tensor_seed(self.seed, name);
        if !matrix {
            // Norm weights ≈ 1, biases ≈ 0.
            let (mean, spread) = if name.ends_with("norm.weight") {
                (1.0, 0.1)
            } else {
                (0.0, 0.1)
            };
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let bytes = (0..dims[0])
                .flat_map(|_| (mean + spread * rng.gen_range(-1.0f32..1.0)).to_le_bytes())
                .collect();
            return Ok((GgmlDType::F32, dims, bytes));
        }
        let (rows, cols) = (dims[0], dims[1]);
        let dtype = self.format(name, cols);
        let std = 1.0 / (cols as f32).sqrt();
        Ok((dtype, dims, random_blocks(dtype, rows * cols, std, seed)?))
    }
}

fn tensor_seed(seed: u64, name: &str) -> u64 {
    // FNV-1a over the name, mixed with the seed.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// `elems` weights in `dtype` blocks: random quant bytes, with each block's f16 scale(s) set so
/// the values have about standard deviation `std`. Filled in parallel chunks, each with its own
/// RNG stream, so a 7B model takes seconds, not minutes.
fn random_blocks(
    dtype: GgmlDType,
    elems: usize,
    std: f32,
    seed: u64,
) -> Result<Vec<u8>, EngineError> {
    let (bs, ts) = (dtype.block_size(), dtype.type_size());
    if !elems.is_multiple_of(bs) {
        return Err(EngineError::Load(format!(
            "{elems} weights do not fill {dtype:?} blocks of {bs}"
        )));
    }
    // Where each block's f16 scales live, and what they are. The divisors are the standard
    // deviation of (scale × quant) for uniform random bytes in each format:
    // Q4_K: w = d·sc·q − dmin·m with q ∈ 0..16, sc, m ∈ 0..64 (the mean cancels with dmin = 7.5 d);
    // Q6_K: w = d·sc·(q − 32), sc a random i8; Q5_0: w = d·(q − 16); Q8_0: w = d·q.
    let scales: Vec<(usize, f32)> = match dtype {
        GgmlDType::Q4K => {
            let d = std / 258.0;
            vec![(0, d), (2, 7.5 * d)]
        }
        GgmlDType::Q6K => vec![(208, std / 1360.0)],
        GgmlDType::Q5_0 => vec![(0, std / 9.2)],
        GgmlDType::Q8_0 => vec![(0, std / 73.6)],
        other => {
            return Err(EngineError::Unsupported(format!(
                "random weights in {other:?}"
            )))
        }
    };
    let scales: Vec<(usize, [u8; 2])> = scales
        .into_iter()
        .map(|(at, v)| (at, half::f16::from_f32(v).to_le_bytes()))
        .collect();
    let mut bytes = vec![0u8; elems / bs * ts];
    const CHUNK_BLOCKS: usize = 4096;
    bytes
        .par_chunks_mut(CHUNK_BLOCKS * ts)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng =
                ChaCha8Rng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0xa076_1d64_78bd_642f));
            rng.fill_bytes(chunk);
            for block in chunk.chunks_exact_mut(ts) {
                for &(at, v) in &scales {
                    block[at..at + 2].copy_from_slice(&v);
                }
            }
        });
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::ggml_file::qtensor_from_ggml;
    use candle_core::Device;

    /// The roofline's inputs count every projection and the LM head once, and not the token
    /// embedding (a separate matrix in this untied shape, only looked up).
    #[test]
    fn matmul_weights_count_the_projections_and_the_head_not_the_embedding() {
        let spec = RandomSpec::named("tiny").unwrap();
        let s = &spec.shape;
        assert!(!s.tied);
        let model = crate::Model::random(
            &spec,
            &crate::LoadOptions::default(),
            crate::Kernels::Native,
        )
        .unwrap();
        let (bytes, macs) = model
            .matmul_weights()
            .expect("every projection is quantized");
        let (h, kv) = (s.hidden, s.kv_heads * spec.head_dim());
        let per_layer = 2 * h * h + 2 * kv * h + 3 * s.intermediate * h;
        assert_eq!(macs, (s.layers * per_layer + s.vocab_size * h) as u64);
        // 4.5 to 8.5 bits per weight (Q4_K to Q8_0) plus scales, padding to whole groups.
        assert!(
            bytes > macs / 2 && bytes < macs + macs / 8,
            "{bytes} bytes for {macs} weights"
        );
    }

    #[test]
    fn real_shapes_have_the_published_sizes() {
        // Parameter counts from the Qwen2.5 model cards (incl. embeddings): 0.49B, 1.54B, 7.61B,
        // 14.7B.
        for (name, billions) in [
            ("qwen2.5-0.5b", 0.49),
            ("qwen2.5-1.5b", 1.54),
            ("qwen2.5-7b", 7.61),
            ("qwen2.5-coder-7b", 7.61),
            ("qwen2.5-14b", 14.7),
        ] {
            let spec = RandomSpec::named(name).unwrap();
            let s = &spec.shape;
            let mut params = 0usize;
            let mut names = vec!["token_embd.weight".to_string(), "output.weight".into()];
            for i in 0..s.layers {
                for t in [
                    "attn_q.weight",
                    "attn_k.weight",
                    "attn_v.weight",
                    "attn_output.weight",
                    "attn_q.bias",
                    "attn_k.bias",
                    "attn_v.bias",
                    "ffn_gate.weight",
                    "ffn_up.weight",
                    "ffn_down.weight",
                ] {
                    names.push(format!("blk.{i}.{t}"));
                }
            }
            for n in &names {
                if let Some((dims, _)) = spec.dims(n) {
                    params += dims.iter().product::<usize>();
                }
            }
            let got = params as f64 / 1e9;
            assert!(
                (got - billions).abs() / billions < 0.02,
                "{name}: {got:.3}B parameters, expected {billions}B"
            );
        }
        assert!(shape("qwen2.5-3b").is_err());
    }

    #[test]
    fn formats_follow_q4_k_m() {
        let small = RandomSpec::named("qwen2.5-0.5b").unwrap();
        // 896-wide rows cannot hold k-quant blocks: llama.cpp's fallbacks.
        assert_eq!(small.format("blk.3.attn_q.weight", 896), GgmlDType::Q5_0);
        assert_eq!(small.format("token_embd.weight", 896), GgmlDType::Q8_0);
        let big = RandomSpec::named("qwen2.5-7b").unwrap();
        assert_eq!(big.format("blk.3.attn_q.weight", 3584), GgmlDType::Q4K);
        assert_eq!(big.format("token_embd.weight", 3584), GgmlDType::Q4K);
        assert_eq!(big.format("output.weight", 3584), GgmlDType::Q6K);
        // 28 layers: layers 0..3 and 24.. get more bits, and every third between.
        assert_eq!(big.format("blk.0.ffn_down.weight", 18944), GgmlDType::Q6K);
        assert_eq!(big.format("blk.4.ffn_down.weight", 18944), GgmlDType::Q4K);
        assert_eq!(big.format("blk.5.attn_v.weight", 3584), GgmlDType::Q6K);
        assert_eq!(big.format("blk.27.attn_v.weight", 3584), GgmlDType::Q6K);
        let q8 = RandomSpec {
            quant: RandomQuant::Q8_0,
            ..big
        };
        assert_eq!(q8.format("output.weight", 3584), GgmlDType::Q8_0);
    }

    #[test]
    fn random_blocks_have_the_intended_spread_and_are_deterministic() {
        for dtype in [
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q5_0,
            GgmlDType::Q8_0,
        ] {
            let (rows, cols) = (64, 1024);
            let want = 1.0 / (cols as f32).sqrt();
            let bytes = random_blocks(dtype, rows * cols, want, 7).unwrap();
            assert_eq!(bytes, random_blocks(dtype, rows * cols, want, 7).unwrap());
            assert_ne!(bytes, random_blocks(dtype, rows * cols, want, 8).unwrap());
            let w: Vec<f32> = qtensor_from_ggml(dtype, &bytes, vec![rows, cols], &Device::Cpu)
                .unwrap()
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let n = w.len() as f32;
            let mean = w.iter().sum::<f32>() / n;
            let sd = (w.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n).sqrt();
            assert!(w.iter().all(|x| x.is_finite()), "{dtype:?}");
            assert!(mean.abs() < 0.2 * want, "{dtype:?}: mean {mean}, sd {want}");
            assert!(
                (sd / want - 1.0).abs() < 0.35,
                "{dtype:?}: sd {sd}, wanted {want}"
            );
        }
    }
}
