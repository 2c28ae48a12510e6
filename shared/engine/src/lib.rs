//! `sequoia-engine`: the model side of Sequoia — a llama-family decoder (Llama, Qwen2) that can
//! verify a token tree, its quantized CPU kernels and KV caches, tokenizers and chat templates,
//! tree drafting with a draft model ([`drafting`]) and cost profiling for the planner
//! ([`profiling`]).
//!
//! Depends on `sequoia-core` (trees, sampling) and candle; **must not depend on** tonic, tokio,
//! axum or the services. Unit tests live beside the code; `tests/engine_tree.rs` checks tree
//! attention against sequential decoding on tiny models, `tests/engine_real.rs` and
//! `tests/tokenizer_real_models.rs` on the real default models (fetched on first use).
//!
//!
//! Why not candle-transformers' stock models: they assume one causal chain (consecutive
//! positions, a fixed triangular mask), return only the last token's logits and keep a KV cache
//! that can only grow. Tree speculative decoding needs the opposite on every point:
//!
//! - **tree attention**: a batch of new tokens (tree nodes in BFS order) gets arbitrary position
//!   ids (`prefix_len + depth`) and an explicit mask (the committed prefix plus the node's own
//!   ancestors), see [`Model::forward_tree`];
//! - **logits for every node** (or chosen rows, [`Model::forward_tree_rows`]): the verifier needs
//!   the target distribution wherever the accepted path may stop;
//! - **a KV cache that rolls back**: after verification only the accepted path survives
//!   ([`KvCache::keep_newest`]); a failed step is undone with [`KvCache::truncate`].
//!
//! Layout:
//! - [`model`]: the decoder itself (plain structs that mirror the math, one `forward` per block,
//!   in the style of candle-transformers' `quantized_qwen2.rs`);
//! - [`cache`]: the per-session KV cache (grown in chunks up to the context limit, written in
//!   place, narrowed to the live length for attention: no copy of the whole cache per step);
//! - `weights`: GGUF (quantized) and Hugging Face safetensors loading;
//! - `qmatmul` + `qkernels`: the CPU matrix multiply against quantized weights. candle's own
//!   kernel re-reads and re-decodes the whole weight matrix for every input row (a 16-node tree
//!   cost 21 decodes) and has no SIMD path for Q5_0; ours repack the weights at load into
//!   column-interleaved groups and use each weight byte for every row of the batch (AVX-512
//!   VNNI with AMX tiles for many rows / AVX-512 VNNI / AVX-VNNI / AVX2 / scalar, picked at run
//!   time or by `SEQUOIA_KERNEL_ISA`);
//! - `attention`: the CPU attention kernel (fixed-order loops over each node's visible keys);
//! - [`testing`]: tiny random-weight models for tests, including "draft-like" perturbed copies.
//!
//! **Batch invariance.** On the CPU with quantized weights, a node's logits are bit-identical
//! whatever else shares its forward pass: the matmul kernels give each input row the same
//! instruction sequence for any batch size, and attention visits a node's keys in a fixed order.
//! So a tree forward reproduces sequential decoding exactly, and greedy speculative decoding
//! produces exactly the target's greedy output (tests/engine_real.rs checks this on real
//! weights). Dense f32 weights (the tiny test models) go through candle's gemm, whose blocking
//! depends on the batch shape: equal up to rounding (~1e-6) there.
//!
//! Threads: candle's CPU backend runs on rayon's global pool. [`LoadOptions::threads`] sizes that
//! pool once per process (see [`init_threads`]); later calls with a different count only warn.
//! The engine's own parallel loops (matmuls, attention) run on `parallel`'s spinning pool of the
//! same size, falling back to rayon when another loop holds it.

mod attention;
pub mod cache;
pub mod drafting;
mod layers;
pub mod model;
mod parallel;
pub mod prefix;
pub mod profiling;
mod qkernels;
mod qmatmul;
pub mod random;
pub mod roofline;
pub mod testing;
pub mod tokenizer;
mod vecmath;
mod weights;

/// Helpers the engine's unit tests share.
#[cfg(test)]
pub(crate) mod test_util {
    /// `got` and `want` hold the same floats bit for bit (−0 and +0 differ); `what` names the
    /// case in the failure message.
    #[track_caller]
    pub(crate) fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            panic!("{what}, element {i}: {} vs {}", got[i], want[i]);
        }
    }
}

use std::sync::OnceLock;

pub use cache::KvCache;
pub use model::{BatchEntry, BatchShape, Kernels, Model, ModelInfo, Stop};

/// The CPU quantized-matmul kernels as a benchmark sees them (`sequoia engine-bench --kernels`):
/// the ISA paths, one timed kernel by format name, and the load-time repack cost.
pub mod kernels {
    pub use crate::qkernels::Isa;
    pub use crate::qmatmul::{kernel_report, repack_stats, KernelTiming};

    /// The path the kernels run on in this process (`SEQUOIA_KERNEL_ISA` or the best one).
    pub fn active_isa() -> Isa {
        crate::qkernels::isa()
    }
    use crate::EngineError;
    use candle_core::quantized::GgmlDType;

    /// The formats with repacked kernels (the default models use all of them).
    pub const FORMATS: [&str; 5] = ["Q4K", "Q6K", "Q5_0", "Q8_0", "Q4_1"];

    /// [`kernel_report`] by format name (one of [`FORMATS`]).
    pub fn bench(
        isa: Isa,
        format: &str,
        n: usize,
        k: usize,
        m: usize,
        copies: usize,
    ) -> Result<KernelTiming, EngineError> {
        let dtype = match format {
            "Q4K" => GgmlDType::Q4K,
            "Q6K" => GgmlDType::Q6K,
            "Q5_0" => GgmlDType::Q5_0,
            "Q8_0" => GgmlDType::Q8_0,
            "Q4_1" => GgmlDType::Q4_1,
            f => {
                return Err(EngineError::Load(format!(
                    "no repacked kernel for {f:?}; formats: {FORMATS:?}"
                )))
            }
        };
        kernel_report(isa, dtype, n, k, m, copies)
    }
}

/// Everything that can go wrong in the engine. Inputs that come from the network (tokens, trees,
/// compaction indices) are checked and reported here; the engine never panics on them.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The KV cache cannot hold the tokens of this call.
    #[error("context full: {needed} tokens needed, the limit is {limit}")]
    ContextFull { needed: usize, limit: usize },
    /// The model files could not be read or are inconsistent.
    #[error("cannot load model: {0}")]
    Load(String),
    /// A valid model of a kind this engine does not implement.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// Bad arguments to a forward or cache call (token out of vocabulary, tree/token count
    /// mismatch, compaction indices out of range, a cache from another model).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A forward given a stop flag saw it set between two layers and gave up; no cache
    /// changed.
    #[error("forward stopped before its end")]
    Stopped,
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// How to load a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOptions {
    /// Size of rayon's global thread pool (used by candle's CPU kernels and ours). `None` keeps
    /// rayon's default (`RAYON_NUM_THREADS` or the number of cores). Applied once per process.
    pub threads: Option<usize>,
    /// Put the model on the first CUDA device (needs the `cuda` cargo feature).
    pub cuda: bool,
    /// Longest sequence a KV cache may hold (prompt + generated + tree nodes). Clamped to the
    /// model's trained context length.
    pub max_context: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            threads: None,
            cuda: false,
            max_context: 4096,
        }
    }
}

/// The candle device for `cuda` (first GPU) or the CPU.
pub fn device(cuda: bool) -> Result<candle_core::Device, EngineError> {
    if !cuda {
        return Ok(candle_core::Device::Cpu);
    }
    if !candle_core::utils::cuda_is_available() {
        return Err(EngineError::Unsupported(
            "CUDA requested but this binary was built without the `cuda` feature".into(),
        ));
    }
    Ok(candle_core::Device::new_cuda(0)?)
}

static THREADS: OnceLock<usize> = OnceLock::new();

/// Size rayon's global pool to `threads` (once per process) and return the pool size in effect.
///
/// candle's CPU kernels and this engine's quantized matmul run on rayon's global pool, which can
/// only be configured before its first use. The first call wins; a later call asking for a
/// different count logs a warning and changes nothing. candle's dense matmul (gemm) reads its
/// thread count from `RAYON_NUM_THREADS`, so set that variable too when you need an exact count
/// for dense (safetensors) models.
pub fn init_threads(threads: usize) -> usize {
    let threads = threads.max(1);
    let got = *THREADS.get_or_init(|| {
        match rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()
        {
            Ok(()) => threads,
            // Someone else (candle, a test harness) already started the global pool.
            Err(_) => rayon::current_num_threads(),
        }
    });
    if got != threads {
        tracing::warn!(
            requested = threads,
            in_effect = got,
            "rayon's global pool was already sized; keeping it"
        );
    }
    got
}

/// Threads in the pool the engine's CPU kernels run on.
pub fn current_threads() -> usize {
    rayon::current_num_threads()
}

/// Logits for a batch of rows (tree nodes), row-major `rows × vocab`.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    rows: usize,
    vocab: usize,
    data: Vec<f32>,
}

impl Logits {
    pub(crate) fn new(rows: usize, vocab: usize, data: Vec<f32>) -> Self {
        debug_assert_eq!(rows * vocab, data.len());
        Self { rows, vocab, data }
    }

    /// Logits of row `i` (panics if `i >= rows()`, like slice indexing).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// All rows, row-major.
    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }
}
