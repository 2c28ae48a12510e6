//! The llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Qwen2) with tree attention.
//!
//! Qwen2 is Llama plus biases on the Q, K and V projections (and usually tied embeddings); both
//! are one code path: a bias is applied when the weights have one. The structs mirror the math:
//!
//! ```text
//! x = embed(tokens)
//! for each block:  x = x + Wo·attn(rope(Wq·n(x)+bq), rope(Wk·n(x)+bk), Wv·n(x)+bv, mask)
//!                  x = x + Wdown·(silu(Wgate·n(x)) ⊙ Wup·n(x))          n = RMSNorm
//! logits = Wout · n(x)
//! ```
//!
//! The only departure from a stock decoder is the batch: `n` new tokens get arbitrary positions
//! (`prefix + depth` for tree nodes) and a mask over `[cache prefix | new tokens]` built from
//! the tree's ancestor relation (a bitset, [`Visibility`]; an additive float mask only for
//! candle's ops on a GPU). A single token (decode) needs no mask at all. Grouped
//! query attention folds the query heads of a group into the row dimension, so K and V are never
//! repeated per head.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use candle_core::{DType, Device, Tensor};
use serde::Serialize;

use super::attention::Visibility;
use super::cache::KvCache;
use super::layers::{Embedding, Linear};
use super::weights::{rope_inv_freqs, HParams, Loader, W};
use super::{init_threads, EngineError, LoadOptions, Logits};
use sequoia_core::tree::Tree;

/// Longest chunk of a sequential prefill in one forward (bounds the attention score matrix).
const PREFILL_CHUNK: usize = 512;

/// What a loaded model is.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelInfo {
    /// `general.name` (GGUF), `_name_or_path` (HF) or the file name.
    pub name: String,
    /// "llama" or "qwen2".
    pub architecture: String,
    pub vocab_size: usize,
    /// Context limit of this engine instance (the cache capacity).
    pub max_context: usize,
    /// Context length the model was trained for.
    pub trained_context: usize,
    pub n_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Weight type of the bulk of the matrices ("Q4K", "Q4_1", "F32", ...).
    pub weights: String,
    /// "cpu" or "cuda".
    pub device: String,
    /// A node's logits are bit-identical whatever else shares its forward pass, so a tree
    /// forward reproduces sequential decoding exactly and greedy speculative decoding returns
    /// exactly the target's greedy tokens. True for quantized weights on our CPU kernels. False
    /// on a GPU (candle's CUDA matmul switches kernels with the batch size, and cuBLAS blocking
    /// depends on the shape) and for dense weights on the CPU: logits then agree up to rounding,
    /// and where two tokens are within rounding of each other (a near-tie) greedy decoding can
    /// take either. The output is still a valid greedy decoding of the target's distribution.
    pub batch_invariant: bool,
}

/// Which matmul and attention kernels a model on the CPU uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    /// Our batch-invariant CPU kernels on the CPU; candle's (the only choice) on a GPU.
    #[default]
    Native,
    /// candle's quantized matmul and candle-op attention on every device: the code path a GPU
    /// runs, so tests can exercise it on a machine without one.
    Portable,
}

#[derive(Debug, Clone)]
struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if x.device().is_cpu() && x.dtype() == DType::F32 && self.weight.dtype() == DType::F32 {
            // On the engine's threads: candle's op sends every call through rayon's pool (a
            // wake-up per call, twice per layer). The same arithmetic, so the same bits.
            let y = super::attention::with_f32(x, |xs| {
                super::attention::with_f32(&self.weight, |w| {
                    super::vecmath::rms_norm_rows(xs, w, self.eps)
                })
            })??;
            return Tensor::from_vec(y, x.shape(), x.device());
        }
        candle_nn::ops::rms_norm(x, &self.weight, self.eps)
    }
}

#[derive(Debug, Clone)]
struct Attention {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    bq: Option<Tensor>,
    bk: Option<Tensor>,
    bv: Option<Tensor>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

/// Per-forward inputs shared by every layer.
struct Step<'a> {
    /// Rotary tables gathered at the new tokens' positions, `(rows, head_dim / 2)`.
    cos: &'a Tensor,
    sin: &'a Tensor,
    /// The sequences sharing this forward, in row order (one for a plain forward).
    segments: &'a [SegmentStep<'a>],
    /// Use the CPU attention kernel (else candle ops, as on a GPU).
    cpu_attention: bool,
}

/// One sequence's rows of a forward: they attend to that sequence's cache only.
struct SegmentStep<'a> {
    /// First row of this sequence among the forward's rows.
    offset: usize,
    /// Rows (new tokens) of this sequence.
    n: usize,
    /// Cache entries before the new tokens.
    prefix: usize,
    /// Additive `(n, prefix + n)` mask for candle's ops (GPU path only); `None` when every new
    /// token sees everything (n = 1) or on the CPU path.
    mask: Option<Tensor>,
    /// What each row sees, for the CPU attention kernel; `None` = everything.
    visible: Option<&'a Visibility>,
}

/// A sequence's new tokens before they become rows of a forward: where they sit and what they
/// may see.
struct Segment {
    positions: Vec<u32>,
    /// What each new token sees; `None` for a single token (it sees everything).
    visible: Option<Visibility>,
}

fn project(lin: &Linear, bias: &Option<Tensor>, x: &Tensor) -> candle_core::Result<Tensor> {
    let y = lin.forward(x)?;
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// Several CPU-quantized projections of the same `(rows, in)` input in one fused pass
/// ([`super::qmatmul::matmul_fused`]: one input quantization, one fork-join), each plus its
/// bias, as row-major `rows × out` vectors. `None` when a projection is not on our CPU kernels
/// (the caller then projects one by one). Each output equals [`project`]'s bit for bit: same
/// column loops, same bias add.
fn project_fused<const N: usize>(
    lins: [&Linear; N],
    biases: [&Option<Tensor>; N],
    x: &Tensor,
) -> candle_core::Result<Option<[Vec<f32>; N]>> {
    let mut outs: [Vec<f32>; N] = std::array::from_fn(|_| Vec::new());
    let done = project_fused_into(lins, biases, x, outs.each_mut())?;
    Ok(done.then_some(outs))
}

/// [`project_fused`] into the caller's buffers, resized to `rows × out` each (their old
/// values are all overwritten, so a reused buffer is not cleared first). False, with the
/// buffers untouched, when a projection is not on our CPU kernels.
fn project_fused_into<const N: usize>(
    lins: [&Linear; N],
    biases: [&Option<Tensor>; N],
    x: &Tensor,
    outs: [&mut Vec<f32>; N],
) -> candle_core::Result<bool> {
    let mut kernels = Vec::with_capacity(N);
    for lin in lins {
        match lin {
            Linear::CpuQuant(k) => kernels.push(k.as_ref()),
            _ => return Ok(false),
        }
    }
    let (rows, _) = x.dims2()?;
    let mut outs = outs;
    for (out, kern) in outs.iter_mut().zip(&kernels) {
        out.resize(rows * kern.out_features(), 0.0);
    }
    super::attention::with_f32(x, |xs| {
        let mut jobs: Vec<(&dyn super::qmatmul::QKernel, &mut [f32])> = kernels
            .iter()
            .zip(outs.iter_mut())
            .map(|(k, o)| (*k, o.as_mut_slice()))
            .collect();
        super::qmatmul::matmul_fused(&mut jobs, rows, xs);
    })?;
    for (out, bias) in outs.iter_mut().zip(biases) {
        if let Some(b) = bias {
            let b: Vec<f32> = b.to_vec1()?;
            for row in out.chunks_exact_mut(b.len()) {
                for (y, b) in row.iter_mut().zip(&b) {
                    *y += b;
                }
            }
        }
    }
    Ok(true)
}

impl Attention {
    /// Project every row of the forward at once (each weight is read once for all sequences),
    /// then attend per sequence: each segment's rows see only their own cache and mask.
    fn forward(
        &self,
        x: &Tensor,
        step: &Step,
        kvs: &mut [&mut super::cache::LayerKv],
    ) -> candle_core::Result<Tensor> {
        let (rows, _) = x.dims2()?;
        let (h, kvh, d) = (self.n_heads, self.n_kv_heads, self.head_dim);

        let (q, k, v) = match project_fused(
            [&self.wq, &self.wk, &self.wv],
            [&self.bq, &self.bk, &self.bv],
            x,
        )? {
            Some([mut q, mut k, v]) => {
                // Rotated in place, on this thread: candle's rotary op hands every call to
                // rayon's pool and waits (two wake-ups per layer, on cores our own pool's
                // workers are spinning on). The same products per element, so the same bits.
                super::attention::with_f32(step.cos, |cos| {
                    super::attention::with_f32(step.sin, |sin| {
                        super::vecmath::rope_in_place(&mut q, h, d, cos, sin);
                        super::vecmath::rope_in_place(&mut k, kvh, d, cos, sin);
                    })
                })??;
                (
                    Tensor::from_vec(q, (rows, h, d), x.device())?,
                    Tensor::from_vec(k, (rows, kvh, d), x.device())?,
                    Tensor::from_vec(v, (rows, kvh, d), x.device())?,
                )
            }
            None => {
                let q = project(&self.wq, &self.bq, x)?;
                let k = project(&self.wk, &self.bk, x)?;
                let v = project(&self.wv, &self.bv, x)?;
                // (1, rows, heads, d): the layout rope_thd rotates, no transpose needed first.
                let q = q.reshape((1, rows, h, d))?;
                let k = k.reshape((1, rows, kvh, d))?;
                let q = candle_nn::rotary_emb::rope_thd(&q, step.cos, step.sin)?.squeeze(0)?;
                let k = candle_nn::rotary_emb::rope_thd(&k, step.cos, step.sin)?.squeeze(0)?;
                (q, k, v.reshape((rows, kvh, d))?)
            }
        };

        let whole = step.segments.len() == 1;
        let mut cpu_out = Vec::new();
        let mut outs = Vec::new();
        for (seg, kv) in step.segments.iter().zip(kvs.iter_mut()) {
            let part = |t: &Tensor| {
                if whole {
                    Ok(t.clone())
                } else {
                    t.narrow(0, seg.offset, seg.n)
                }
            };
            let (q, k, v) = (part(&q)?, part(&k)?, part(&v)?);
            // Append the new keys/values in place, then attend over the live prefix (a view).
            let k = k.transpose(0, 1)?.contiguous()?; // (kvh, n, d)
            let v = v.transpose(0, 1)?.contiguous()?;
            kv.k.slice_set(&k, 1, seg.prefix)?;
            kv.v.slice_set(&v, 1, seg.prefix)?;
            if step.cpu_attention {
                // Same arithmetic for a row whatever else is in the forward: engine/attention.rs.
                let dims = super::attention::Dims {
                    n: seg.n,
                    heads: h,
                    kv_heads: kvh,
                    head_dim: d,
                    len: seg.prefix + seg.n,
                    cap: kv.k.dim(1)?,
                };
                let q = q.contiguous()?; // (n, h, d)
                let out = super::attention::attend(&q, &kv.k, &kv.v, seg.visible, &dims)?;
                if whole {
                    cpu_out = out;
                } else {
                    cpu_out.extend_from_slice(&out);
                }
            } else {
                outs.push(self.attend_candle(&q, kv, seg)?);
            }
        }
        let out = if step.cpu_attention {
            Tensor::from_vec(cpu_out, (rows, h * d), x.device())?
        } else if whole {
            outs.pop().expect("one segment")
        } else {
            Tensor::cat(&outs, 0)?
        };
        self.wo.forward(&out)
    }

    /// Attention of one segment with candle ops (the GPU path): `q` is `(n, heads, d)`.
    fn attend_candle(
        &self,
        q: &Tensor,
        kv: &super::cache::LayerKv,
        seg: &SegmentStep,
    ) -> candle_core::Result<Tensor> {
        let (h, kvh, d) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let (n, group, len) = (seg.n, h / kvh, seg.prefix + seg.n);
        let keys = kv.k.narrow(1, 0, len)?; // (kvh, len, d)
        let values = kv.v.narrow(1, 0, len)?;
        // Query heads of one KV group become rows: (kvh, group * n, d).
        let q = (q.transpose(0, 1)? * (1.0 / (d as f64).sqrt()))?.reshape((kvh, group * n, d))?;
        let scores = q.matmul(&keys.t()?)?; // (kvh, group * n, len)
        let scores = match &seg.mask {
            Some(mask) => scores
                .reshape((kvh, group, n, len))?
                .broadcast_add(mask)?
                .reshape((kvh, group * n, len))?,
            None => scores,
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs.matmul(&values)?; // (kvh, group * n, d)
        out.reshape((h, n, d))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((n, h * d))
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

thread_local! {
    /// The gate and up outputs of this thread's latest MLP, kept for the next one: filling
    /// them anew cleared 1.1 MB per layer of a 16-row forward (2–3 % of it, on the calling
    /// thread alone while the others waited).
    static GATE_UP: std::cell::RefCell<[Vec<f32>; 2]> = const {
        std::cell::RefCell::new([Vec::new(), Vec::new()])
    };
}

/// Gate/up buffers larger than this (bytes, both together) are freed after use, so that a
/// long prefill does not leave its outputs on the thread.
const GATE_UP_KEEP_BYTES: usize = 8 << 20;

impl Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if let Linear::CpuQuant(down) = &self.down {
            let rows = x.dims2()?.0;
            let y = GATE_UP.with(|kept| -> candle_core::Result<Option<Vec<f32>>> {
                // A forward nested in another on this thread (none is today: the engine's
                // parallel tasks never run one) would take buffers of its own, not panic.
                let mut fresh = [Vec::new(), Vec::new()];
                let mut kept = kept.try_borrow_mut();
                let [g, u] = match kept.as_deref_mut() {
                    Ok(bufs) => bufs,
                    Err(_) => &mut fresh,
                };
                if !project_fused_into([&self.gate, &self.up], [&None, &None], x, [g, u])? {
                    return Ok(None);
                }
                // silu(g) ⊙ u made and quantized block by block, on every thread.
                let mut y = vec![0f32; rows * down.out_features()];
                down.matmul_silu_mul(rows, g, u, &mut y);
                if 4 * (g.capacity() + u.capacity()) > GATE_UP_KEEP_BYTES {
                    (*g, *u) = (Vec::new(), Vec::new());
                }
                Ok(Some(y))
            })?;
            if let Some(y) = y {
                return Tensor::from_vec(y, (rows, down.out_features()), x.device());
            }
        }
        if let Some([g, u]) = project_fused([&self.gate, &self.up], [&None, &None], x)? {
            // silu(g) ⊙ u in one vectorized pass over the two outputs.
            let rows = x.dims2()?.0;
            let width = g.len() / rows.max(1);
            let h = super::vecmath::silu_mul(&g, &u);
            return self
                .down
                .forward(&Tensor::from_vec(h, (rows, width), x.device())?);
        }
        let g = candle_nn::ops::silu(&self.gate.forward(x)?)?;
        let u = self.up.forward(x)?;
        self.down.forward(&(g * u)?)
    }
}

#[derive(Debug, Clone)]
struct Block {
    attn_norm: RmsNorm,
    attn: Attention,
    mlp_norm: RmsNorm,
    mlp: Mlp,
}

/// A loaded decoder. Immutable after loading (all per-sequence state lives in a [`KvCache`]),
/// so one `Arc<Model>` serves every session; it is `Send + Sync`.
#[derive(Debug)]
pub struct Model {
    info: ModelInfo,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    /// `(max_context, head_dim / 2)` rotary tables.
    cos: Tensor,
    sin: Tensor,
    device: Device,
    dtype: DType,
    /// Attention through our CPU kernel (CPU, f32, native kernels).
    cpu_attention: bool,
}

/// When a forward in progress gives up ([`Model::forward_forest_extend_until`]): before a
/// layer below `before_layer` that finds `flag` set. Past that layer the forward runs to its
/// end whatever the flag says: for a forward whose result may still serve (the verify node's
/// decode while it waits, docs/ALGORITHMS.md §10), finishing its last layers can cost less
/// than the forward that would replace it. `before_layer` is read when the flag is seen, so
/// whoever sets the flag can first set the layer from what it knows then (the message that
/// interrupts the forward).
#[derive(Debug, Clone, Copy)]
pub struct Stop<'a> {
    pub flag: &'a AtomicBool,
    pub before_layer: &'a AtomicUsize,
}

/// `before_layer` for a forward that stops before any layer.
static ANY_LAYER: AtomicUsize = AtomicUsize::new(usize::MAX);

impl<'a> Stop<'a> {
    /// Stop before any layer once `flag` is set.
    pub fn at_any_layer(flag: &'a AtomicBool) -> Self {
        Self {
            flag,
            before_layer: &ANY_LAYER,
        }
    }

    /// Whether the forward stops before `layer`.
    fn now(&self, layer: usize) -> bool {
        // Acquire pairs with the setter's release of the flag, so the layer it stored before
        // is the one read here.
        self.flag.load(Ordering::Acquire) && layer < self.before_layer.load(Ordering::Relaxed)
    }
}

impl Model {
    /// Load a `.gguf` file or a Hugging Face folder (config.json + *.safetensors).
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Model, EngineError> {
        Self::load_with(path, opts, Kernels::Native)
    }

    /// [`load`](Self::load) with a choice of CPU kernels.
    pub fn load_with(
        path: &Path,
        opts: &LoadOptions,
        kernels: Kernels,
    ) -> Result<Model, EngineError> {
        if let Some(t) = opts.threads {
            init_threads(t);
        }
        let device = super::device(opts.cuda)?;
        let ld = Loader::open(path, &device)?;
        Self::build(ld, opts, kernels)
    }

    /// Random weights of a real model's shape, made in memory (no download): for measuring
    /// forward costs where no checkpoint is at hand. See [`crate::random`].
    pub fn random(
        spec: &crate::random::RandomSpec,
        opts: &LoadOptions,
        kernels: Kernels,
    ) -> Result<Model, EngineError> {
        if let Some(t) = opts.threads {
            init_threads(t);
        }
        let device = super::device(opts.cuda)?;
        let ld = Loader::random(spec, &device)?;
        Self::build(ld, opts, kernels)
    }

    fn build(mut ld: Loader, opts: &LoadOptions, kernels: Kernels) -> Result<Model, EngineError> {
        ld.portable = kernels == Kernels::Portable;
        let device = ld.device.clone();
        let repacked_before = super::qmatmul::repack_stats();
        let hp = ld.hp.clone();
        let max_context = opts.max_context.min(hp.context_length).max(1);

        let norm = |ld: &mut Loader, w: W| -> Result<RmsNorm, EngineError> {
            Ok(RmsNorm {
                weight: ld.vector(w)?,
                eps: hp.rms_eps as f32,
            })
        };
        let bias = |ld: &mut Loader, w: W| -> Result<Option<Tensor>, EngineError> {
            if ld.has(w) {
                Ok(Some(ld.vector(w)?))
            } else {
                Ok(None)
            }
        };
        let (embed, tied_head) = ld.embedding()?;
        let mut blocks = Vec::with_capacity(hp.n_layers);
        for i in 0..hp.n_layers {
            blocks.push(Block {
                attn_norm: norm(&mut ld, W::AttnNorm(i))?,
                attn: Attention {
                    wq: ld.linear(W::Q(i))?,
                    wk: ld.linear(W::K(i))?,
                    wv: ld.linear(W::V(i))?,
                    wo: ld.linear(W::O(i))?,
                    bq: bias(&mut ld, W::QBias(i))?,
                    bk: bias(&mut ld, W::KBias(i))?,
                    bv: bias(&mut ld, W::VBias(i))?,
                    n_heads: hp.n_heads,
                    n_kv_heads: hp.n_kv_heads,
                    head_dim: hp.head_dim,
                },
                mlp_norm: norm(&mut ld, W::FfnNorm(i))?,
                mlp: Mlp {
                    gate: ld.linear(W::Gate(i))?,
                    up: ld.linear(W::Up(i))?,
                    down: ld.linear(W::Down(i))?,
                },
            });
        }
        let norm = norm(&mut ld, W::OutputNorm)?;
        let lm_head = if ld.has(W::Output) {
            ld.linear(W::Output)?
        } else {
            tied_head
        };
        let vocab_size = lm_head.out_features()?;
        let (cos, sin) = rope_tables(&hp, max_context, ld.dtype, &device)?;
        let cpu_attention = device.is_cpu() && ld.dtype == DType::F32 && !ld.portable;
        let cpu_quant = |l: &Linear| matches!(l, Linear::CpuQuant(_));
        let batch_invariant = cpu_attention
            && cpu_quant(&lm_head)
            && blocks.iter().all(|b| {
                [&b.attn.wq, &b.attn.wk, &b.attn.wv, &b.attn.wo]
                    .into_iter()
                    .chain([&b.mlp.gate, &b.mlp.up, &b.mlp.down])
                    .all(cpu_quant)
            });
        let info = ModelInfo {
            name: hp.name.clone(),
            architecture: hp.arch.as_str().to_string(),
            vocab_size,
            max_context,
            trained_context: hp.context_length,
            n_layers: hp.n_layers,
            hidden_size: hp.hidden,
            intermediate_size: hp.intermediate,
            n_heads: hp.n_heads,
            n_kv_heads: hp.n_kv_heads,
            head_dim: hp.head_dim,
            weights: hp.weights.clone(),
            device: if device.is_cpu() { "cpu" } else { "cuda" }.to_string(),
            batch_invariant,
        };
        let repacked = super::qmatmul::repack_stats();
        tracing::info!(
            ?info,
            repack_ms = (repacked.0 - repacked_before.0).as_secs_f64() * 1e3,
            repacked_mb = (repacked.1 - repacked_before.1) as f64 / 1e6,
            "model loaded"
        );
        Ok(Model {
            info,
            embed,
            blocks,
            norm,
            lm_head,
            cos,
            sin,
            dtype: ld.dtype,
            device,
            cpu_attention,
        })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// What one forward row costs in the CPU kernels, for a roofline: the bytes of weights a
    /// forward reads and the multiply-adds per input row, over every layer's projections and the
    /// LM head (the token embedding is only looked up). None unless every one of them runs on
    /// the CPU quantized kernels.
    pub fn matmul_weights(&self) -> Option<(u64, u64)> {
        let mut linears: Vec<&Linear> = vec![&self.lm_head];
        for b in &self.blocks {
            let (a, m) = (&b.attn, &b.mlp);
            linears.extend([&a.wq, &a.wk, &a.wv, &a.wo, &m.gate, &m.up, &m.down]);
        }
        linears
            .iter()
            .try_fold((0u64, 0u64), |(bytes, macs), l| match l {
                Linear::CpuQuant(k) => Some((
                    bytes + k.weight_bytes() as u64,
                    macs + (k.out_features() * k.in_features()) as u64,
                )),
                _ => None,
            })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// An empty KV cache for this model (allocated lazily, up to `info().max_context`).
    pub fn new_cache(&self) -> KvCache {
        self.new_cache_limited(self.info.max_context)
    }

    /// An empty KV cache that never holds more than `limit` entries (at most the model's
    /// context), so its memory is bounded by `limit ×` [`kv_bytes_per_token`](Self::kv_bytes_per_token).
    pub fn new_cache_limited(&self, limit: usize) -> KvCache {
        KvCache::new(
            self.info.n_layers,
            self.info.n_kv_heads,
            self.info.head_dim,
            limit.clamp(1, self.info.max_context),
            self.dtype,
            &self.device,
        )
    }

    /// Bytes of KV cache one token takes (keys and values of every layer).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.info.n_layers
            * self.info.n_kv_heads
            * self.info.head_dim
            * self.dtype.size_in_bytes()
    }

    /// Forward `tokens` (tree nodes in BFS order, shape from `tree`) after the cache's committed
    /// prefix: node `i` gets position `cache.len() + tree.depth(i)` and attends to the whole
    /// prefix plus its tree ancestors and itself. Appends their K/V to the cache. Returns logits
    /// for every node.
    pub fn forward_tree(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        tree: &Tree,
    ) -> Result<Logits, EngineError> {
        let rows: Vec<usize> = (0..tokens.len()).collect();
        self.forward_tree_rows(cache, tokens, tree, &rows)
    }

    /// [`forward_tree`](Self::forward_tree), but computes the LM head only for `rows` (node
    /// indices, any order, repeats allowed): row `r` of the result is node `rows[r]`. The drafter
    /// needs logits only at the nodes it expands; the LM head is a large share of a small
    /// model's cost.
    pub fn forward_tree_rows(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        tree: &Tree,
        rows: &[usize],
    ) -> Result<Logits, EngineError> {
        let n = tokens.len();
        if n != tree.len() {
            return Err(EngineError::InvalidInput(format!(
                "{n} tokens for a tree of {} nodes",
                tree.len()
            )));
        }
        if let Some(&r) = rows.iter().find(|&&r| r >= n) {
            return Err(EngineError::InvalidInput(format!(
                "logit row {r} out of range 0..{n}"
            )));
        }
        let seg = tree_segment(tree, cache.len());
        let hidden = self.forward_hidden(cache, tokens, seg.positions, seg.visible)?;
        self.logits(&hidden, rows, self.info.vocab_size)
    }

    /// Continue a tree whose first `start` nodes are already the newest `start` cache entries
    /// (forwarded by earlier calls of the same step): forward nodes `start..tree.len()`, each at
    /// position `base + depth` (base = cache length before node 0) attending to the committed
    /// prefix and its tree ancestors. The drafter grows trees this way, one level per call.
    /// `rows` are absolute node indices (≥ `start`) whose logits are returned, in that order.
    ///
    /// `head_vocab` limits the LM head to token ids `0..head_vocab` (a vocabulary-pruned draft,
    /// docs/ALGORITHMS.md §8): the returned rows are that wide, each logit bit-identical to the
    /// full head's; `vocab_size` computes them all.
    pub fn forward_tree_extend(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        tree: &Tree,
        start: usize,
        rows: &[usize],
        head_vocab: usize,
    ) -> Result<Logits, EngineError> {
        self.forward_forest_extend(cache, tokens, tree.parents(), start, rows, head_vocab)
    }

    /// [`forward_tree_extend`](Self::forward_tree_extend) over a forest given by `parents`
    /// (−1 for a root at depth 0; otherwise a parent with a smaller index), in any topological
    /// order rather than BFS. Pipelined drafting (docs/ALGORITHMS.md §10) needs it: it hangs
    /// copies of a verified tree's nodes and the next trees below them after that tree's
    /// cached nodes, in the order it grows them. Node `i` sits at position `base + depth(i)`
    /// and attends to the committed prefix and its own ancestors, as in a tree.
    pub fn forward_forest_extend(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        parents: &[i32],
        start: usize,
        rows: &[usize],
        head_vocab: usize,
    ) -> Result<Logits, EngineError> {
        self.forward_forest_extend_until(cache, tokens, parents, start, rows, head_vocab, None)
    }

    /// [`forward_forest_extend`](Self::forward_forest_extend) that gives up with
    /// [`EngineError::Stopped`] (no cache changed) as soon as it sees `stop` set, checked
    /// before each layer ([`Stop`] says up to which one): work that has become useless (a draft
    /// growing trees ahead for a verdict that has just arrived) ends within one layer instead
    /// of one whole forward.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_forest_extend_until(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        parents: &[i32],
        start: usize,
        rows: &[usize],
        head_vocab: usize,
        stop: Option<Stop<'_>>,
    ) -> Result<Logits, EngineError> {
        if head_vocab == 0 || head_vocab > self.info.vocab_size {
            return Err(EngineError::InvalidInput(format!(
                "LM head over {head_vocab} tokens: expected 1..={}",
                self.info.vocab_size
            )));
        }
        let n = parents.len();
        if tokens.len() != n || start >= n || start > cache.len() {
            return Err(EngineError::InvalidInput(format!(
                "tree extension: {} tokens, {n} nodes, start {start}, cache {}",
                tokens.len(),
                cache.len()
            )));
        }
        if let Some(&r) = rows.iter().find(|&&r| r < start || r >= n) {
            return Err(EngineError::InvalidInput(format!(
                "logit row {r} out of range {start}..{n}"
            )));
        }
        let mut depth = vec![0usize; n];
        for (i, &p) in parents.iter().enumerate() {
            if p >= 0 {
                let p = p as usize;
                if p >= i {
                    return Err(EngineError::InvalidInput(format!(
                        "forest node {i} has parent {p}: parents must come first"
                    )));
                }
                depth[i] = depth[p] + 1;
            }
        }
        let base = cache.len() - start;
        let fresh = n - start;
        let positions: Vec<u32> = (start..n).map(|i| (base + depth[i]) as u32).collect();
        let visible = if start == 0 && fresh == 1 {
            None
        } else {
            // The forest's nodes already cached and the fresh ones follow `base`.
            let mut vis = Visibility::new(fresh, base, n);
            for (r, i) in (start..n).enumerate() {
                // Ancestors and self: walk up from the node.
                let mut a = i as i32;
                while a >= 0 {
                    vis.set(r, a as usize);
                    a = parents[a as usize];
                }
            }
            Some(vis)
        };
        let segment = Segment { positions, visible };
        let hidden =
            self.forward_hidden_batch_until(&mut [cache], &tokens[start..], &[segment], stop)?;
        let local: Vec<usize> = rows.iter().map(|&r| r - start).collect();
        self.logits(&hidden, &local, head_vocab)
    }

    /// Plain sequential forward (prefill or decode) of a chain of tokens after the cache's
    /// prefix; returns the logits of the last token only. Long inputs are processed in chunks.
    pub fn forward_chain_last(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
    ) -> Result<Vec<f32>, EngineError> {
        let hidden = self.forward_chain_hidden(cache, tokens)?;
        let n = hidden.dim(0)?;
        Ok(self
            .logits(&hidden, &[n - 1], self.info.vocab_size)?
            .into_vec())
    }

    /// [`forward_chain_last`](Self::forward_chain_last) without the LM head: for tokens whose
    /// logits nobody reads (a prefill, a draft catching up on committed tokens). The head is a
    /// large share of a small model's cost.
    pub fn forward_chain(&self, cache: &mut KvCache, tokens: &[u32]) -> Result<(), EngineError> {
        self.forward_chain_hidden(cache, tokens).map(drop)
    }

    /// The final-normed hidden state of the last chunk of a chained forward.
    fn forward_chain_hidden(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
    ) -> Result<Tensor, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::InvalidInput("no tokens to forward".into()));
        }
        // Fail before doing any work if the whole chain cannot fit.
        let needed = cache.len() + tokens.len();
        if needed > cache.capacity() {
            return Err(EngineError::ContextFull {
                needed,
                limit: cache.capacity(),
            });
        }
        let start = cache.len();
        let mut last = None;
        for chunk in tokens.chunks(PREFILL_CHUNK) {
            match self.forward_chain_chunk(cache, chunk) {
                Ok(h) => last = Some(h),
                Err(e) => {
                    cache.truncate(start);
                    return Err(e);
                }
            }
        }
        Ok(last.expect("at least one chunk"))
    }

    fn forward_chain_chunk(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
    ) -> Result<Tensor, EngineError> {
        let seg = chain_segment(cache.len(), tokens.len());
        self.forward_hidden(cache, tokens, seg.positions, seg.visible)
    }

    /// Run the blocks over `tokens` at `positions` with the given visibility (`n × (prefix +
    /// n)`, row-major) and return the final-normed hidden states `(n, hidden)`. The cache grows by
    /// `n` only if everything succeeds.
    fn forward_hidden(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        positions: Vec<u32>,
        visible: Option<Visibility>,
    ) -> Result<Tensor, EngineError> {
        self.forward_hidden_batch(&mut [cache], tokens, &[Segment { positions, visible }])
    }

    /// [`forward_hidden`](Self::forward_hidden) for several sequences in one pass: `tokens` holds
    /// every segment's tokens back to back, segment `s` continuing `caches[s]`. Every weight is
    /// read once for all rows; attention runs per segment. A row's result does not depend on the
    /// other segments (the kernels are batch invariant), which is what lets a verify node batch
    /// sessions without changing any verdict. Caches grow only if everything succeeds.
    fn forward_hidden_batch(
        &self,
        caches: &mut [&mut KvCache],
        tokens: &[u32],
        segments: &[Segment],
    ) -> Result<Tensor, EngineError> {
        self.forward_hidden_batch_until(caches, tokens, segments, None)
    }

    /// [`forward_hidden_batch`](Self::forward_hidden_batch), giving up before any layer that
    /// finds `stop` set (the caches' lengths move only at the end, so nothing changes).
    fn forward_hidden_batch_until(
        &self,
        caches: &mut [&mut KvCache],
        tokens: &[u32],
        segments: &[Segment],
        stop: Option<Stop<'_>>,
    ) -> Result<Tensor, EngineError> {
        let rows = tokens.len();
        if rows == 0 || segments.iter().any(|s| s.positions.is_empty()) {
            return Err(EngineError::InvalidInput("no tokens to forward".into()));
        }
        if caches.len() != segments.len()
            || segments.iter().map(|s| s.positions.len()).sum::<usize>() != rows
        {
            return Err(EngineError::InvalidInput(
                "batched forward: segments do not match the caches and tokens".into(),
            ));
        }
        let (layers, kv_heads, head_dim) =
            (self.info.n_layers, self.info.n_kv_heads, self.info.head_dim);
        if !caches.iter().all(|c| c.fits(layers, kv_heads, head_dim)) {
            return Err(EngineError::InvalidInput(
                "KV cache was created by a different model".into(),
            ));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.info.vocab_size) {
            return Err(EngineError::InvalidInput(format!(
                "token id {t} out of vocabulary (size {})",
                self.info.vocab_size
            )));
        }
        for (cache, seg) in caches.iter_mut().zip(segments) {
            cache.reserve(cache.len() + seg.positions.len())?;
        }
        let dev = &self.device;
        let positions: Vec<u32> = segments
            .iter()
            .flat_map(|s| s.positions.iter().copied())
            .collect();
        let pos = Tensor::new(positions.as_slice(), dev)?;
        let cos = self.cos.index_select(&pos, 0)?;
        let sin = self.sin.index_select(&pos, 0)?;
        // The CPU attention kernel reads the bitsets; only the candle path needs a float mask.
        let cpu_attention = self.cpu_attention;
        let mut steps = Vec::with_capacity(segments.len());
        let mut offset = 0;
        for (cache, seg) in caches.iter().zip(segments) {
            let (n, prefix) = (seg.positions.len(), cache.len());
            if let Some(vis) = &seg.visible {
                if vis.len() != prefix + n {
                    return Err(EngineError::InvalidInput(format!(
                        "mask covers {} cache entries, the step has {}",
                        vis.len(),
                        prefix + n
                    )));
                }
            }
            let mask = match &seg.visible {
                Some(vis) if !cpu_attention => Some(
                    Tensor::from_vec(vis.additive(n), (n, prefix + n), dev)?
                        .to_dtype(self.dtype)?,
                ),
                _ => None,
            };
            steps.push(SegmentStep {
                offset,
                n,
                prefix,
                mask,
                visible: seg.visible.as_ref(),
            });
            offset += n;
        }
        let step = Step {
            cos: &cos,
            sin: &sin,
            segments: &steps,
            cpu_attention,
        };
        let mut x = self.embed.forward(tokens, dev)?.to_dtype(self.dtype)?;
        for (layer, block) in self.blocks.iter().enumerate() {
            if stop.is_some_and(|s| s.now(layer)) {
                return Err(EngineError::Stopped);
            }
            let mut kvs: Vec<&mut super::cache::LayerKv> =
                caches.iter_mut().map(|c| &mut c.layers[layer]).collect();
            let a = block
                .attn
                .forward(&block.attn_norm.forward(&x)?, &step, &mut kvs)?;
            x = (x + a)?;
            let m = block.mlp.forward(&block.mlp_norm.forward(&x)?)?;
            x = (x + m)?;
        }
        for (cache, seg) in caches.iter_mut().zip(segments) {
            let len = cache.len() + seg.positions.len();
            cache.set_len(len);
        }
        Ok(self.norm.forward(&x)?)
    }

    /// Several sequences' steps in one forward pass: each entry's tokens continue its own cache
    /// (a tree after the committed prefix, or a chain such as a prefill chunk), and its `rows`
    /// get logits. Entry `e` of the result holds entry `e`'s rows, each bit-identical to what
    /// the same entry would get in a forward of its own on a batch-invariant model
    /// ([`ModelInfo::batch_invariant`]). On error no cache changes.
    pub fn forward_batch(
        &self,
        entries: &mut [BatchEntry<'_>],
    ) -> Result<Vec<Logits>, EngineError> {
        let mut tokens = Vec::new();
        let mut segments = Vec::with_capacity(entries.len());
        let mut rows = Vec::new();
        for (e, entry) in entries.iter().enumerate() {
            let n = entry.tokens.len();
            if let BatchShape::Tree(tree) = entry.shape {
                if tree.len() != n {
                    return Err(EngineError::InvalidInput(format!(
                        "batch entry {e}: {n} tokens for a tree of {} nodes",
                        tree.len()
                    )));
                }
            }
            if let Some(&r) = entry.rows.iter().find(|&&r| r >= n) {
                return Err(EngineError::InvalidInput(format!(
                    "batch entry {e}: logit row {r} out of range 0..{n}"
                )));
            }
            let prefix = entry.cache.len();
            segments.push(match entry.shape {
                BatchShape::Tree(tree) => tree_segment(tree, prefix),
                BatchShape::Chain => chain_segment(prefix, n),
            });
            rows.extend(entry.rows.iter().map(|&r| tokens.len() + r));
            tokens.extend_from_slice(entry.tokens);
        }
        let mut caches: Vec<&mut KvCache> = entries.iter_mut().map(|e| &mut *e.cache).collect();
        let hidden = self.forward_hidden_batch(&mut caches, &tokens, &segments)?;
        // One LM head pass for every entry's rows: the head is the largest matrix.
        let vocab = self.info.vocab_size;
        let mut all = self.logits(&hidden, &rows, vocab)?.into_vec();
        // Split from the end: each entry's rows move out once, and a lone entry's not at all.
        let mut out = Vec::with_capacity(entries.len());
        for entry in entries.iter().rev() {
            let k = entry.rows.len();
            let tail = all.split_off(all.len() - k * vocab);
            out.push(Logits::new(k, vocab, tail));
        }
        out.reverse();
        Ok(out)
    }

    /// LM head over the chosen rows of the final hidden states, for token ids `0..vocab`.
    fn logits(&self, hidden: &Tensor, rows: &[usize], vocab: usize) -> Result<Logits, EngineError> {
        if rows.is_empty() {
            return Ok(Logits::new(0, vocab, Vec::new()));
        }
        let n = hidden.dim(0)?;
        let selected = if rows.len() == n && rows.iter().enumerate().all(|(i, &r)| i == r) {
            hidden.clone()
        } else {
            let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            hidden.index_select(&Tensor::new(idx.as_slice(), &self.device)?, 0)?
        };
        let data = match &self.lm_head {
            // Straight into the output vector: the logits are the biggest tensor of a step.
            Linear::CpuQuant(k) => {
                let x: Vec<f32> = selected.flatten_all()?.to_vec1()?;
                let mut out = vec![0f32; rows.len() * vocab];
                k.matmul_prefix(rows.len(), &x, &mut out, vocab);
                out
            }
            head => {
                let all = head.forward(&selected)?;
                let all = if vocab < self.info.vocab_size {
                    all.narrow(1, 0, vocab)?
                } else {
                    all
                };
                all.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?
            }
        };
        Ok(Logits::new(rows.len(), vocab, data))
    }
}

/// One sequence's share of [`Model::forward_batch`].
pub struct BatchEntry<'a> {
    /// The sequence's cache; its new tokens are appended after what it holds.
    pub cache: &'a mut KvCache,
    pub tokens: &'a [u32],
    pub shape: BatchShape<'a>,
    /// Indices of the new tokens whose logits are wanted (none for a prefill chunk).
    pub rows: &'a [usize],
}

/// How an entry's new tokens relate to each other.
#[derive(Clone, Copy)]
pub enum BatchShape<'a> {
    /// Tree nodes in BFS order: node `i` at position `prefix + depth(i)`, seeing its ancestors.
    Tree(&'a Tree),
    /// A sequence: token `i` at position `prefix + i`, seeing the tokens before it.
    Chain,
}

/// Positions and visibility of a tree's nodes after `prefix` cached entries.
fn tree_segment(tree: &Tree, prefix: usize) -> Segment {
    let n = tree.len();
    let positions = (0..n).map(|i| (prefix + tree.depth(i)) as u32).collect();
    let visible = (n > 1).then(|| {
        let mut vis = Visibility::new(n, prefix, n);
        for i in 0..n {
            for j in 0..n {
                if tree.attends(i, j) {
                    vis.set(i, j);
                }
            }
        }
        vis
    });
    Segment { positions, visible }
}

/// Positions and causal visibility of `n` chained tokens after `prefix` cached entries.
fn chain_segment(prefix: usize, n: usize) -> Segment {
    let positions = (prefix..prefix + n).map(|p| p as u32).collect();
    let visible = (n > 1).then(|| Visibility::causal(n, prefix));
    Segment { positions, visible }
}

/// `cos` and `sin` of `position · θ_i` for every position below `max_context`.
fn rope_tables(
    hp: &HParams,
    max_context: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor), EngineError> {
    let inv = rope_inv_freqs(hp);
    let half = inv.len();
    let mut cos = Vec::with_capacity(max_context * half);
    let mut sin = Vec::with_capacity(max_context * half);
    for p in 0..max_context {
        for &f in &inv {
            // f64 keeps large positions accurate.
            let a = p as f64 * f as f64;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    let cos = Tensor::from_vec(cos, (max_context, half), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (max_context, half), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

// Sessions share one model across threads.
const _: () = {
    const fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<Model>();
    is_send_sync::<KvCache>();
};
