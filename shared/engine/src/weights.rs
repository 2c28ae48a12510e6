//! Loading weights and hyper-parameters from a GGUF file or a Hugging Face folder.
//!
//! Both formats are mapped onto one logical naming ([`W`]) and one set of hyper-parameters
//! ([`HParams`]), so `model.rs` never sees a file format. Two format quirks are absorbed here:
//!
//! - llama.cpp's converter permutes the Q and K projections of **llama**-architecture GGUF files
//!   so that ggml's interleaved ("GPT-J") rotary embedding matches Hugging Face's half-split
//!   ("NeoX") one. We undo that permutation on load (it only reorders whole weight rows, which
//!   is exact even for quantized blocks), so the model applies the half-split rotation for every
//!   source and the K cache always has one layout. Qwen2 GGUF files are not permuted.
//! - Quantized GGUF matrices stay quantized on the CPU (our kernel, `qmatmul`) or the GPU
//!   (candle's `QMatMul`); f32/f16/bf16 GGUF tensors and safetensors are converted to the
//!   compute dtype (f32 on the CPU; as stored on a GPU).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::{ggml_file, gguf_file, GgmlDType, QMatMul};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use super::layers::{Embedding, Linear};
use super::qmatmul;
use super::random::RandomSpec;
use super::EngineError;

/// The decoder families this engine implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arch {
    Llama,
    Qwen2,
}

impl Arch {
    fn parse(s: &str) -> Result<Self, EngineError> {
        match s {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            other => Err(EngineError::Unsupported(format!(
                "architecture {other:?} (supported: llama, qwen2)"
            ))),
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        }
    }
}

/// Rotary-embedding frequency scaling.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum RopeScaling {
    None,
    /// Positions divided by `factor` (all frequencies divided by `factor`).
    Linear(f32),
    /// Llama 3.x: low frequencies divided by `factor`, high ones kept, smooth in between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: f32,
    },
    /// Per-frequency divisors (GGUF `rope_freqs.weight`, how llama.cpp stores Llama 3 scaling).
    Factors(Vec<f32>),
}

/// Hyper-parameters of a llama-family decoder.
#[derive(Debug, Clone)]
pub(crate) struct HParams {
    pub arch: Arch,
    pub name: String,
    pub vocab_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f64,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub context_length: usize,
    /// The weight type of most matrices (e.g. "Q4K", "F32").
    pub weights: String,
}

/// Logical tensor names, mapped to each format's naming.
#[derive(Debug, Clone, Copy)]
pub(crate) enum W {
    Embed,
    OutputNorm,
    Output,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    QBias(usize),
    KBias(usize),
    VBias(usize),
    FfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
}

impl W {
    fn gguf(self) -> String {
        match self {
            W::Embed => "token_embd.weight".into(),
            W::OutputNorm => "output_norm.weight".into(),
            W::Output => "output.weight".into(),
            W::AttnNorm(i) => format!("blk.{i}.attn_norm.weight"),
            W::Q(i) => format!("blk.{i}.attn_q.weight"),
            W::K(i) => format!("blk.{i}.attn_k.weight"),
            W::V(i) => format!("blk.{i}.attn_v.weight"),
            W::O(i) => format!("blk.{i}.attn_output.weight"),
            W::QBias(i) => format!("blk.{i}.attn_q.bias"),
            W::KBias(i) => format!("blk.{i}.attn_k.bias"),
            W::VBias(i) => format!("blk.{i}.attn_v.bias"),
            W::FfnNorm(i) => format!("blk.{i}.ffn_norm.weight"),
            W::Gate(i) => format!("blk.{i}.ffn_gate.weight"),
            W::Up(i) => format!("blk.{i}.ffn_up.weight"),
            W::Down(i) => format!("blk.{i}.ffn_down.weight"),
        }
    }

    fn hf(self) -> String {
        match self {
            W::Embed => "model.embed_tokens.weight".into(),
            W::OutputNorm => "model.norm.weight".into(),
            W::Output => "lm_head.weight".into(),
            W::AttnNorm(i) => format!("model.layers.{i}.input_layernorm.weight"),
            W::Q(i) => format!("model.layers.{i}.self_attn.q_proj.weight"),
            W::K(i) => format!("model.layers.{i}.self_attn.k_proj.weight"),
            W::V(i) => format!("model.layers.{i}.self_attn.v_proj.weight"),
            W::O(i) => format!("model.layers.{i}.self_attn.o_proj.weight"),
            W::QBias(i) => format!("model.layers.{i}.self_attn.q_proj.bias"),
            W::KBias(i) => format!("model.layers.{i}.self_attn.k_proj.bias"),
            W::VBias(i) => format!("model.layers.{i}.self_attn.v_proj.bias"),
            W::FfnNorm(i) => format!("model.layers.{i}.post_attention_layernorm.weight"),
            W::Gate(i) => format!("model.layers.{i}.mlp.gate_proj.weight"),
            W::Up(i) => format!("model.layers.{i}.mlp.up_proj.weight"),
            W::Down(i) => format!("model.layers.{i}.mlp.down_proj.weight"),
        }
    }

    /// Heads whose rows llama.cpp permuted for interleaved RoPE (Q: all heads, K: KV heads).
    fn rope_permuted_heads(self, hp: &HParams) -> Option<usize> {
        match self {
            W::Q(_) | W::QBias(_) => Some(hp.n_heads),
            W::K(_) | W::KBias(_) => Some(hp.n_kv_heads),
            _ => None,
        }
    }
}

/// An open weight source.
pub(crate) struct Loader {
    pub hp: HParams,
    pub device: Device,
    /// Activation / KV-cache dtype.
    pub dtype: DType,
    /// Build candle's `QMatMul` (the GPU path) even on the CPU, instead of our CPU kernels.
    pub portable: bool,
    src: Src,
}

enum Src {
    Gguf {
        file: File,
        content: gguf_file::Content,
        /// llama-architecture files have permuted Q/K rows (see the module doc).
        unpermute_qk: bool,
    },
    SafeTensors(candle_core::safetensors::MmapedSafetensors),
    /// Made in memory under GGUF names (`random.rs`); loaded like a GGUF file from there on.
    Random(RandomSpec),
}

fn load_err(path: &Path, what: impl std::fmt::Display) -> EngineError {
    EngineError::Load(format!("{}: {what}", path.display()))
}

impl Loader {
    /// Open a `.gguf` file or a Hugging Face folder (config.json + *.safetensors).
    pub fn open(path: &Path, device: &Device) -> Result<Self, EngineError> {
        if path.is_dir() {
            Self::open_hf(path, device)
        } else if path.is_file() {
            Self::open_gguf(path, device)
        } else {
            Err(load_err(path, "no such file or directory"))
        }
    }

    fn open_gguf(path: &Path, device: &Device) -> Result<Self, EngineError> {
        let mut file = File::open(path).map_err(|e| load_err(path, e))?;
        let content = gguf_file::Content::read(&mut file)
            .map_err(|e| load_err(path, format!("not a readable GGUF file: {e}")))?;
        let md = |k: &str| content.metadata.get(k);
        let arch_name = md("general.architecture")
            .and_then(|v| v.to_string().ok())
            .ok_or_else(|| load_err(path, "general.architecture missing"))?
            .clone();
        let arch = Arch::parse(&arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let get_u = |k: &str| -> Result<usize, EngineError> {
            md(&key(k))
                .and_then(|v| v.to_u64().ok().or_else(|| v.to_u32().ok().map(u64::from)))
                .map(|v| v as usize)
                .ok_or_else(|| load_err(path, format!("metadata {} missing", key(k))))
        };
        let get_f = |k: &str| md(&key(k)).and_then(|v| v.to_f32().ok());

        let hidden = get_u("embedding_length")?;
        let n_heads = get_u("attention.head_count")?;
        let n_kv_heads = get_u("attention.head_count_kv").unwrap_or(n_heads);
        let head_dim = get_u("attention.key_length").unwrap_or(hidden / n_heads.max(1));
        let embd = content
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| load_err(path, "token_embd.weight missing"))?;
        let vocab_size = embd.shape.dims()[0];
        let rope_dims = get_u("rope.dimension_count").unwrap_or(head_dim);
        if rope_dims != head_dim {
            return Err(EngineError::Unsupported(format!(
                "partial rotary embedding ({rope_dims} of {head_dim} dims)"
            )));
        }
        let scaling_type = md(&key("rope.scaling.type")).and_then(|v| v.to_string().ok());
        let mut rope_scaling = match scaling_type.map(String::as_str) {
            None | Some("none") => RopeScaling::None,
            Some("linear") => match get_f("rope.scaling.factor") {
                Some(f) if f > 0.0 => RopeScaling::Linear(f),
                _ => RopeScaling::None,
            },
            Some(other) => {
                return Err(EngineError::Unsupported(format!(
                    "rope scaling {other:?} (supported: linear, llama3)"
                )))
            }
        };
        let weights = content
            .tensor_infos
            .get("blk.0.ffn_gate.weight")
            .map(|t| format!("{:?}", t.ggml_dtype))
            .unwrap_or_else(|| format!("{:?}", embd.ggml_dtype));
        let name = md("general.name")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_else(|| file_stem(path));
        let hp = HParams {
            arch,
            name,
            vocab_size,
            hidden,
            intermediate: get_u("feed_forward_length")?,
            n_layers: get_u("block_count")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6) as f64,
            rope_theta: get_f("rope.freq_base").unwrap_or(10_000.0),
            rope_scaling: RopeScaling::None,
            context_length: get_u("context_length").unwrap_or(4096),
            weights,
        };
        let dtype = DType::F32;
        let mut loader = Loader {
            hp,
            device: device.clone(),
            dtype,
            portable: false,
            src: Src::Gguf {
                file,
                content,
                unpermute_qk: arch == Arch::Llama,
            },
        };
        // Llama 3 files store their frequency scaling as per-frequency divisors.
        if loader.has_name("rope_freqs.weight") {
            let t = loader.raw_tensor_f32("rope_freqs.weight")?;
            rope_scaling = RopeScaling::Factors(t);
        }
        loader.hp.rope_scaling = rope_scaling;
        loader.validate(path)?;
        Ok(loader)
    }

    fn open_hf(dir: &Path, device: &Device) -> Result<Self, EngineError> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| load_err(&cfg_path, e))?;
        let cfg: Value = serde_json::from_str(&text).map_err(|e| load_err(&cfg_path, e))?;
        let model_type = cfg["model_type"].as_str().unwrap_or("");
        let arch = Arch::parse(model_type)?;
        let get_u = |k: &str| -> Result<usize, EngineError> {
            cfg[k]
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| load_err(&cfg_path, format!("{k} missing")))
        };
        let hidden = get_u("hidden_size")?;
        let n_heads = get_u("num_attention_heads")?;
        let rope_scaling = match &cfg["rope_scaling"] {
            Value::Null => RopeScaling::None,
            s => {
                let kind = s["rope_type"].as_str().or(s["type"].as_str()).unwrap_or("");
                let f = |k: &str| s[k].as_f64().map(|v| v as f32);
                match kind {
                    "default" => RopeScaling::None,
                    "linear" => RopeScaling::Linear(f("factor").unwrap_or(1.0)),
                    "llama3" => RopeScaling::Llama3 {
                        factor: f("factor").unwrap_or(8.0),
                        low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
                        high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
                        original_max_position: f("original_max_position_embeddings")
                            .unwrap_or(8192.0),
                    },
                    other => {
                        return Err(EngineError::Unsupported(format!(
                            "rope scaling {other:?} (supported: linear, llama3)"
                        )))
                    }
                }
            }
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| load_err(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(load_err(dir, "no *.safetensors files"));
        }
        // SAFETY: the files are memory-mapped read-only; like every mmap-based loader we rely
        // on nobody truncating them while the model loads (weights are copied out on load).
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }
            .map_err(|e| load_err(dir, e))?;
        let stored = st
            .get(&W::Embed.hf())
            .map_err(|e| load_err(dir, e))?
            .dtype();
        let stored = DType::try_from(stored).map_err(|e| load_err(dir, e))?;
        // CPU math runs in f32; a GPU keeps the stored half precision.
        let dtype = match (device, stored) {
            (Device::Cpu, _) => DType::F32,
            (_, DType::F16 | DType::BF16) => stored,
            _ => DType::F32,
        };
        let name = cfg["_name_or_path"]
            .as_str()
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .unwrap_or_else(|| file_stem(dir));
        let hp = HParams {
            arch,
            name,
            vocab_size: get_u("vocab_size")?,
            hidden,
            intermediate: get_u("intermediate_size")?,
            n_layers: get_u("num_hidden_layers")?,
            n_heads,
            n_kv_heads: get_u("num_key_value_heads").unwrap_or(n_heads),
            head_dim: get_u("head_dim").unwrap_or(hidden / n_heads.max(1)),
            rms_eps: cfg["rms_norm_eps"].as_f64().unwrap_or(1e-6),
            rope_theta: cfg["rope_theta"].as_f64().unwrap_or(10_000.0) as f32,
            rope_scaling,
            context_length: get_u("max_position_embeddings").unwrap_or(4096),
            weights: format!("{stored:?}").to_uppercase(),
        };
        let loader = Loader {
            hp,
            device: device.clone(),
            dtype,
            portable: false,
            src: Src::SafeTensors(st),
        };
        loader.validate(dir)?;
        Ok(loader)
    }

    /// Random weights of a real shape, made in memory (see `random.rs`).
    pub fn random(spec: &RandomSpec, device: &Device) -> Result<Self, EngineError> {
        let s = &spec.shape;
        let hp = HParams {
            arch: Arch::Qwen2,
            name: format!("random-{}-{:?}", s.name, spec.quant).to_lowercase(),
            vocab_size: s.vocab_size,
            hidden: s.hidden,
            intermediate: s.intermediate,
            n_layers: s.layers,
            n_heads: s.heads,
            n_kv_heads: s.kv_heads,
            head_dim: spec.head_dim(),
            rms_eps: s.rms_eps,
            rope_theta: s.rope_theta,
            rope_scaling: RopeScaling::None,
            context_length: s.context_length,
            weights: format!("{:?}", spec.quant),
        };
        let loader = Loader {
            hp,
            device: device.clone(),
            dtype: DType::F32,
            portable: false,
            src: Src::Random(spec.clone()),
        };
        loader.validate(Path::new(s.name))?;
        Ok(loader)
    }

    /// Our CPU kernels apply (quantized weights on the CPU, unless `portable`).
    fn native_cpu(&self) -> bool {
        self.device.is_cpu() && !self.portable
    }

    fn validate(&self, path: &Path) -> Result<(), EngineError> {
        let hp = &self.hp;
        let ok = hp.n_heads > 0
            && hp.n_kv_heads > 0
            && hp.n_heads.is_multiple_of(hp.n_kv_heads)
            && hp.head_dim > 0
            && hp.head_dim.is_multiple_of(2)
            && hp.n_layers > 0
            && hp.vocab_size > 0;
        if !ok {
            return Err(load_err(
                path,
                format!("inconsistent hyper-parameters {hp:?}"),
            ));
        }
        Ok(())
    }

    fn has_name(&self, name: &str) -> bool {
        match &self.src {
            Src::Gguf { content, .. } => content.tensor_infos.contains_key(name),
            Src::SafeTensors(st) => st.get(name).is_ok(),
            Src::Random(spec) => spec.has(name),
        }
    }

    /// Whether the source has tensor `w`.
    pub fn has(&self, w: W) -> bool {
        match &self.src {
            Src::Gguf { .. } | Src::Random(_) => self.has_name(&w.gguf()),
            Src::SafeTensors(_) => self.has_name(&w.hf()),
        }
    }

    /// Raw GGUF tensor: dtype, shape (candle order: rows first) and bytes.
    fn gguf_raw(&mut self, name: &str) -> Result<(GgmlDType, Vec<usize>, Vec<u8>), EngineError> {
        let (file, content) = match &mut self.src {
            Src::Gguf { file, content, .. } => (file, content),
            Src::Random(spec) => return spec.tensor(name),
            Src::SafeTensors(_) => unreachable!("gguf_raw on a safetensors source"),
        };
        let info = content
            .tensor_infos
            .get(name)
            .ok_or_else(|| EngineError::Load(format!("tensor {name} missing")))?;
        let dims = info.shape.dims().to_vec();
        let elems = info.shape.elem_count();
        let bs = info.ggml_dtype.block_size();
        if !elems.is_multiple_of(bs) {
            return Err(EngineError::Load(format!(
                "tensor {name}: {elems} elements is not a multiple of the block size {bs}"
            )));
        }
        let size = elems / bs * info.ggml_dtype.type_size();
        let mut bytes = vec![0u8; size];
        file.seek(SeekFrom::Start(content.tensor_data_offset + info.offset))?;
        file.read_exact(&mut bytes)?;
        Ok((info.ggml_dtype, dims, bytes))
    }

    fn raw_tensor_f32(&mut self, name: &str) -> Result<Vec<f32>, EngineError> {
        let (dtype, dims, bytes) = self.gguf_raw(name)?;
        let t = ggml_file::qtensor_from_ggml(dtype, &bytes, dims, &Device::Cpu)?
            .dequantize(&Device::Cpu)?;
        Ok(t.flatten_all()?.to_vec1()?)
    }

    /// A GGUF tensor's rows, with llama.cpp's Q/K RoPE permutation undone when needed.
    fn gguf_rows(&mut self, w: W) -> Result<(GgmlDType, Vec<usize>, Vec<u8>), EngineError> {
        let unpermute = matches!(
            self.src,
            Src::Gguf {
                unpermute_qk: true,
                ..
            }
        );
        let name = w.gguf();
        let (dtype, dims, bytes) = self.gguf_raw(&name)?;
        let heads = if unpermute {
            w.rope_permuted_heads(&self.hp)
        } else {
            None
        };
        let Some(heads) = heads else {
            return Ok((dtype, dims, bytes));
        };
        let rows = dims[0];
        let row_bytes = bytes.len() / rows;
        if !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
            return Err(EngineError::Load(format!(
                "tensor {name}: {rows} rows do not split into {heads} heads"
            )));
        }
        let hd = rows / heads;
        let mut out = vec![0u8; bytes.len()];
        // llama.cpp stored HF row (h, j, i) (j: half, i: index in half) at (h, i, j).
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..hd / 2 {
                    let hf = h * hd + j * (hd / 2) + i;
                    let gg = h * hd + 2 * i + j;
                    out[hf * row_bytes..(hf + 1) * row_bytes]
                        .copy_from_slice(&bytes[gg * row_bytes..(gg + 1) * row_bytes]);
                }
            }
        }
        Ok((dtype, dims, out))
    }

    /// A 1-D tensor (norm weight, bias) in the compute dtype on the device.
    pub fn vector(&mut self, w: W) -> Result<Tensor, EngineError> {
        let t = match &self.src {
            Src::Gguf { .. } | Src::Random(_) => {
                let (dtype, dims, bytes) = self.gguf_rows(w)?;
                ggml_file::qtensor_from_ggml(dtype, &bytes, dims, &Device::Cpu)?
                    .dequantize(&Device::Cpu)?
            }
            Src::SafeTensors(st) => st.load(&w.hf(), &Device::Cpu)?,
        };
        Ok(t.to_dtype(self.dtype)?.to_device(&self.device)?)
    }

    /// A projection matrix `(out, in)`.
    pub fn linear(&mut self, w: W) -> Result<Linear, EngineError> {
        match &self.src {
            Src::Gguf { .. } | Src::Random(_) => {
                let (dtype, dims, bytes) = self.gguf_rows(w)?;
                if dims.len() != 2 {
                    return Err(EngineError::Load(format!(
                        "tensor {} has shape {dims:?}, expected a matrix",
                        w.gguf()
                    )));
                }
                if self.native_cpu() {
                    if qmatmul::is_quantized(dtype) {
                        let k = qmatmul::kernel_from_bytes(dtype, dims[0], dims[1], &bytes)?;
                        return Ok(Linear::CpuQuant(k));
                    }
                    let t = ggml_file::qtensor_from_ggml(dtype, &bytes, dims, &Device::Cpu)?
                        .dequantize(&Device::Cpu)?;
                    return Ok(Linear::Dense(t));
                }
                let q = ggml_file::qtensor_from_ggml(dtype, &bytes, dims, &self.device)?;
                Ok(Linear::Quantized(QMatMul::from_qtensor(q)?))
            }
            Src::SafeTensors(st) => {
                let t = st.load(&w.hf(), &Device::Cpu)?;
                Ok(Linear::Dense(
                    t.to_dtype(self.dtype)?.to_device(&self.device)?,
                ))
            }
        }
    }

    /// The token embedding, plus the same matrix as an LM head for tied-embedding models.
    pub fn embedding(&mut self) -> Result<(Embedding, Linear), EngineError> {
        match &self.src {
            Src::Gguf { .. } | Src::Random(_) => {
                let (dtype, dims, bytes) = self.gguf_rows(W::Embed)?;
                if self.native_cpu() && qmatmul::is_quantized(dtype) {
                    let k = qmatmul::kernel_from_bytes(dtype, dims[0], dims[1], &bytes)?;
                    return Ok((Embedding::CpuQuant(k.clone()), Linear::CpuQuant(k)));
                }
                let q = ggml_file::qtensor_from_ggml(dtype, &bytes, dims, &self.device)?;
                let dense = q.dequantize(&self.device)?;
                let head = if self.native_cpu() {
                    Linear::Dense(dense.clone())
                } else {
                    Linear::Quantized(QMatMul::from_qtensor(q)?)
                };
                Ok((Embedding::Dense(dense), head))
            }
            Src::SafeTensors(st) => {
                let t = st
                    .load(&W::Embed.hf(), &Device::Cpu)?
                    .to_dtype(self.dtype)?
                    .to_device(&self.device)?;
                Ok((Embedding::Dense(t.clone()), Linear::Dense(t)))
            }
        }
    }
}

fn file_stem(path: &Path) -> String {
    path.file_stem()
        .or_else(|| path.file_name())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// Inverse rotary frequencies `θ_i = base^(-2i/d)`, with the model's scaling applied.
pub(crate) fn rope_inv_freqs(hp: &HParams) -> Vec<f32> {
    let d = hp.head_dim;
    let base: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / hp.rope_theta.powf(2.0 * i as f32 / d as f32))
        .collect();
    match &hp.rope_scaling {
        RopeScaling::None => base,
        RopeScaling::Linear(f) => base.iter().map(|x| x / f).collect(),
        RopeScaling::Factors(fs) => base
            .iter()
            .enumerate()
            .map(|(i, x)| x / fs.get(i).copied().unwrap_or(1.0))
            .collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            let low_wavelen = original_max_position / low_freq_factor;
            let high_wavelen = original_max_position / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (original_max_position / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}
