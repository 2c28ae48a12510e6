//! CPU matrix multiply against GGUF-quantized weights.
//!
//! candle's own `QMatMul` on the CPU loops over the input rows outside and the weight rows
//! inside, so every input row streams the whole (hundreds of MB) weight matrix from memory and
//! re-decodes every block: a 16-node tree costs about as much as 16 single-token decodes. Tree
//! verification lives on batches of 8..128 rows, so here each task owns a range of weight rows
//! (output columns) and serves every input row from it while it is in cache.
//!
//! - Q4_K, Q6_K, Q5_0, Q8_0 and Q4_1 (everything in the default models) are repacked at load
//!   into the column-interleaved layout of [`super::qkernels`] (same size as the file) and run
//!   `vpdpbusd`-style kernels (AVX-512 VNNI with AMX tiles, AVX-512 VNNI with or without
//!   GFNI, AVX-VNNI, AVX2 or scalar, chosen at run time, `SEQUOIA_KERNEL_ISA` to force one; all bit-identical);
//! - the other GGML types use candle's per-pair `vec_dot` with the same loop order.
//!
//! The weights are owned by the kernel, and the token embedding reuses them:
//! [`QKernel::dequantize_row`] expands only the rows a step looks up, instead of a full f32
//! copy of a 150k-token embedding table.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::quantized::{k_quants, GgmlDType, GgmlType};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape};
use rayon::prelude::*;

use super::qkernels::{self, Act32, ActBlock, ActK, Format, Isa, OutPtr, Packed};
use super::EngineError;

/// An input quantized once for several matmuls that read it (Q/K/V, gate/up):
/// [`QKernel::quantize_input`] then [`QKernel::matmul_quantized`], or all at once through
/// [`matmul_fused`]. Valid for kernels with the same `in_features` and the same activation
/// format ([`ActFormat`]: the K-quants Q4_K/Q6_K share one, the 32-value formats
/// Q5_0/Q8_0/Q4_1 another; other types keep the f32 rows).
#[derive(Debug)]
pub(crate) enum QuantizedInput {
    K {
        m: usize,
        k: usize,
        acts: Vec<ActK>,
    },
    B32 {
        m: usize,
        k: usize,
        acts: Vec<Act32>,
    },
    Raw {
        m: usize,
        k: usize,
        x: Vec<f32>,
    },
}

impl QuantizedInput {
    #[allow(dead_code)] // tests
    pub(crate) fn rows(&self) -> usize {
        match self {
            QuantizedInput::K { m, .. }
            | QuantizedInput::B32 { m, .. }
            | QuantizedInput::Raw { m, .. } => *m,
        }
    }
}

/// Which quantized form of the input a kernel reads: kernels of one format can share one
/// [`QuantizedInput`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ActFormat {
    /// Int8 per 256 values with block sums ([`ActK`]).
    K,
    /// Int8 per 32 values ([`Act32`]).
    B32,
    /// The f32 rows themselves (kernels without a repacked layout).
    Raw,
}

/// Activation block types that live in a [`QuantizedInput`].
pub(crate) trait InputActs: ActBlock {
    const FORMAT: ActFormat;
    fn wrap(acts: Vec<Self>, m: usize, k: usize) -> QuantizedInput;
    fn unwrap(q: &QuantizedInput) -> Option<(&[Self], usize, usize)>;
}

impl InputActs for ActK {
    const FORMAT: ActFormat = ActFormat::K;
    fn wrap(acts: Vec<Self>, m: usize, k: usize) -> QuantizedInput {
        QuantizedInput::K { m, k, acts }
    }
    fn unwrap(q: &QuantizedInput) -> Option<(&[Self], usize, usize)> {
        match q {
            QuantizedInput::K { m, k, acts } => Some((acts, *m, *k)),
            _ => None,
        }
    }
}

impl InputActs for Act32 {
    const FORMAT: ActFormat = ActFormat::B32;
    fn wrap(acts: Vec<Self>, m: usize, k: usize) -> QuantizedInput {
        QuantizedInput::B32 { m, k, acts }
    }
    fn unwrap(q: &QuantizedInput) -> Option<(&[Self], usize, usize)> {
        match q {
            QuantizedInput::B32 { m, k, acts } => Some((acts, *m, *k)),
            _ => None,
        }
    }
}

/// A quantized weight matrix `W` of shape `(out_features, in_features)` with `y = x · Wᵀ`.
pub(crate) trait QKernel: Send + Sync + std::fmt::Debug {
    fn out_features(&self) -> usize;
    fn in_features(&self) -> usize;
    /// Bytes of weights a matmul reads.
    fn weight_bytes(&self) -> usize;
    /// `dst (m × out) = lhs (m × in) · Wᵀ`, both row-major.
    fn matmul(&self, m: usize, lhs: &[f32], dst: &mut [f32]);
    /// The first `n_out` output columns only: `dst (m × n_out)`, each value bit-identical to the
    /// same column of [`Self::matmul`] (columns are independent). A vocabulary-pruned LM head
    /// is this product over the first `n_out` token ids.
    fn matmul_prefix(&self, m: usize, lhs: &[f32], dst: &mut [f32], n_out: usize) {
        let n = self.out_features();
        assert!(
            n_out <= n,
            "prefix of {n_out} columns of a {n}-column matrix"
        );
        if n_out == n {
            return self.matmul(m, lhs, dst);
        }
        assert_eq!(dst.len(), m * n_out, "matmul output size");
        let mut full = vec![0f32; m * n];
        self.matmul(m, lhs, &mut full);
        for (d, f) in dst.chunks_exact_mut(n_out).zip(full.chunks_exact(n)) {
            d.copy_from_slice(&f[..n_out]);
        }
    }
    /// Expand row `row` of `W` into `dst` (`in_features` values).
    fn dequantize_row(&self, row: usize, dst: &mut [f32]);
    /// Quantize `lhs` (`m × in`) once for [`Self::matmul_quantized`] on this or compatible
    /// kernels (see [`QuantizedInput`]).
    /// `dst (m × out) = silu(g) ⊙ u · Wᵀ` for the gate and up outputs `g`, `u` (`m × in`
    /// each): bit for bit [`Self::matmul`] of [`crate::vecmath::silu_mul`]`(g, u)`.
    fn matmul_silu_mul(&self, m: usize, g: &[f32], u: &[f32], dst: &mut [f32]) {
        self.matmul(m, &crate::vecmath::silu_mul(g, u), dst);
    }
    fn quantize_input(&self, m: usize, lhs: &[f32]) -> QuantizedInput {
        assert_eq!(lhs.len(), m * self.in_features(), "matmul input size");
        QuantizedInput::Raw {
            m,
            k: self.in_features(),
            x: lhs.to_vec(),
        }
    }
    /// `matmul` on an input from [`Self::quantize_input`] of a compatible kernel: the same
    /// result, bit for bit, as `matmul` on the original rows.
    ///
    /// # Panics
    /// If `q` was quantized for an incompatible format or width.
    #[allow(dead_code)] // tests; the model goes through `matmul_fused`
    fn matmul_quantized(&self, q: &QuantizedInput, dst: &mut [f32]) {
        match q {
            QuantizedInput::Raw { m, k, x } if *k == self.in_features() => self.matmul(*m, x, dst),
            _ => panic!("quantized input does not fit {self:?}"),
        }
    }
    /// The input form this kernel reads.
    fn act_format(&self) -> ActFormat {
        ActFormat::Raw
    }
    /// How many independent column tasks this kernel splits into inside [`matmul_fused`];
    /// 0 = it cannot take part (it then runs on its own, after the fused pass).
    fn fused_tasks(&self) -> usize {
        0
    }
    /// Task `task` of [`Self::fused_tasks`]: its columns of `q · Wᵀ` into `out`.
    ///
    /// # Safety
    /// `out` wraps a live `m × out_features` output whose columns of this task no other thread
    /// writes meanwhile; `q` has this kernel's [`Self::act_format`] and width.
    unsafe fn run_fused_task(&self, _q: &QuantizedInput, _task: usize, _out: OutPtr) {
        unreachable!("{self:?} takes no part in fused passes")
    }
}

/// Column groups per task of a fused pass: small enough that a few matrices of a layer give
/// every thread many tasks to balance with, large enough that a task's prefetch stream runs.
const FUSED_TASK_GROUPS: usize = 4;

/// Several matrices that read the same input (Q, K and V; gate and up) multiplied in **one**
/// parallel pass: the input is quantized once per activation format, and all matrices' column
/// tasks share one fork-join, so threads balance across matrices instead of waiting at the end
/// of each. Every output column is computed by the same loop as [`QKernel::matmul`], so the
/// results are bit-identical to separate calls.
///
/// `jobs[i] = (kernel, out)` with `out` of `m × kernel.out_features()`; every kernel has
/// `in_features = lhs.len() / m`.
pub(crate) fn matmul_fused(jobs: &mut [(&dyn QKernel, &mut [f32])], m: usize, lhs: &[f32]) {
    if m == 0 {
        return;
    }
    let k = lhs.len() / m;
    for (kern, out) in jobs.iter() {
        assert_eq!(kern.in_features(), k, "fused matmul: input width");
        assert_eq!(
            out.len(),
            m * kern.out_features(),
            "fused matmul: output size"
        );
    }
    // One quantized input per activation format among the kernels that take part.
    let mut inputs: Vec<(ActFormat, QuantizedInput)> = Vec::new();
    for (kern, _) in jobs.iter() {
        let f = kern.act_format();
        if kern.fused_tasks() > 0 && !inputs.iter().any(|(g, _)| *g == f) {
            inputs.push((f, kern.quantize_input(m, lhs)));
        }
    }
    let input = |f: ActFormat| &inputs.iter().find(|(g, _)| *g == f).expect("quantized").1;
    let mut tasks: Vec<(usize, usize)> = Vec::new();
    let mut outs = Vec::with_capacity(jobs.len());
    for (j, (kern, out)) in jobs.iter_mut().enumerate() {
        tasks.extend((0..kern.fused_tasks()).map(|t| (j, t)));
        outs.push(OutPtr::new(out, kern.out_features()));
    }
    let kernels: Vec<&dyn QKernel> = jobs.iter().map(|(k, _)| *k).collect();
    crate::parallel::for_each(tasks.len(), |i| {
        let (j, t) = tasks[i];
        let kern = kernels[j];
        // SAFETY: tasks of one kernel cover disjoint columns of its own output, which the
        // caller keeps alive (borrowed by `jobs`) until this pass returns.
        unsafe { kern.run_fused_task(input(kern.act_format()), t, outs[j]) };
    });
    for (kern, out) in jobs.iter_mut() {
        if kern.fused_tasks() == 0 {
            kern.matmul(m, lhs, out);
        }
    }
}

/// Typed storage for one quantized matrix: `n` rows of `k / T::BLCK_SIZE` blocks each.
struct QWeight<T: GgmlType> {
    blocks: Vec<T>,
    n: usize,
    k: usize,
}

impl<T: GgmlType> std::fmt::Debug for QWeight<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QWeight<{:?}>({} x {})", T::DTYPE, self.n, self.k)
    }
}

/// Columns (weight rows) per parallel task, aiming at a few tasks per thread.
fn column_chunk(n: usize) -> usize {
    let tasks = rayon::current_num_threads().max(1) * 4;
    n.div_ceil(tasks).clamp(16, 512)
}

impl<T: GgmlType + 'static> QKernel for QWeight<T> {
    fn out_features(&self) -> usize {
        self.n
    }

    fn in_features(&self) -> usize {
        self.k
    }

    fn weight_bytes(&self) -> usize {
        std::mem::size_of_val(self.blocks.as_slice())
    }

    fn matmul(&self, m: usize, lhs: &[f32], dst: &mut [f32]) {
        let (n, k) = (self.n, self.k);
        assert_eq!(lhs.len(), m * k, "matmul input size");
        assert_eq!(dst.len(), m * n, "matmul output size");
        let kb = k / T::BLCK_SIZE;
        // Quantize the inputs once into the weight type's dot-product format.
        let mut q = vec![T::VecDotType::zeros(); m * kb];
        q.par_chunks_mut(kb)
            .zip(lhs.par_chunks(k))
            .for_each(|(qr, xr)| T::VecDotType::from_float(xr, qr));
        let w = &self.blocks;
        let chunk = column_chunk(n);
        let out = OutPtr::new(dst, n);
        (0..n.div_ceil(chunk)).into_par_iter().for_each(|ci| {
            for c in ci * chunk..((ci + 1) * chunk).min(n) {
                let wc = &w[c * kb..(c + 1) * kb];
                for r in 0..m {
                    let v = T::vec_dot(k, wc, &q[r * kb..(r + 1) * kb]);
                    // SAFETY: each task writes its own columns of the live `m × n` output.
                    unsafe { *out.at(r, c, 1) = v };
                }
            }
        });
    }

    fn dequantize_row(&self, row: usize, dst: &mut [f32]) {
        let kb = self.k / T::BLCK_SIZE;
        T::to_float(&self.blocks[row * kb..(row + 1) * kb], dst);
    }
}

/// One matrix repacked for our kernels.
struct PackedKernel<F: Format> {
    w: Packed<F>,
}

impl<F: Format> std::fmt::Debug for PackedKernel<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Packed<{}>({} x {})", F::NAME, self.w.n, self.w.k)
    }
}

impl<F: Format> PackedKernel<F>
where
    F::Act: InputActs,
{
    /// `dst = X · Wᵀ` for the quantized rows `acts`, on path `isa` (must be available).
    fn matmul_acts(&self, isa: Isa, acts: &[F::Act], m: usize, dst: &mut [f32]) {
        self.matmul_acts_prefix(isa, acts, m, dst, self.w.n);
    }

    /// [`Self::matmul_acts`] over the first `n` columns (all of them, or whole groups).
    fn matmul_acts_prefix(&self, isa: Isa, acts: &[F::Act], m: usize, dst: &mut [f32], n: usize) {
        assert!(
            n == self.w.n || (n < self.w.n && n.is_multiple_of(qkernels::G)),
            "column prefix {n} of {}: all columns or whole groups of {}",
            self.w.n,
            qkernels::G
        );
        assert_eq!(dst.len(), m * n, "matmul output size");
        if m == 0 {
            return;
        }
        let groups = n.div_ceil(qkernels::G);
        let tasks = rayon::current_num_threads().max(1) * 4;
        let chunk = groups.div_ceil(tasks).max(1);
        let out = OutPtr::new(dst, n);
        crate::parallel::for_each(groups.div_ceil(chunk), |ci| {
            let g = ci * chunk..((ci + 1) * chunk).min(groups);
            // SAFETY: each task writes the columns of its own groups of the live output.
            unsafe { self.w.columns(isa, acts, m, g, out) };
        });
    }

    /// [`QKernel::matmul`] on a chosen path (tests, benchmarks).
    pub(crate) fn matmul_isa(&self, isa: Isa, m: usize, lhs: &[f32], dst: &mut [f32]) {
        let acts = qkernels::quantize_rows::<F::Act>(lhs, m, self.w.k);
        self.matmul_acts(isa, &acts, m, dst);
    }
}

impl<F: Format> QKernel for PackedKernel<F>
where
    F::Act: InputActs,
{
    fn out_features(&self) -> usize {
        self.w.n
    }

    fn in_features(&self) -> usize {
        self.w.k
    }

    fn weight_bytes(&self) -> usize {
        self.w.size_bytes()
    }

    fn matmul(&self, m: usize, lhs: &[f32], dst: &mut [f32]) {
        self.matmul_isa(qkernels::isa(), m, lhs, dst);
    }

    fn matmul_prefix(&self, m: usize, lhs: &[f32], dst: &mut [f32], n_out: usize) {
        if n_out != self.w.n && !n_out.is_multiple_of(qkernels::G) {
            // Not whole groups: compute the covering groups, keep the prefix.
            let cover = n_out.next_multiple_of(qkernels::G).min(self.w.n);
            let mut wide = vec![0f32; m * cover];
            self.matmul_prefix(m, lhs, &mut wide, cover);
            for (d, f) in dst.chunks_exact_mut(n_out).zip(wide.chunks_exact(cover)) {
                d.copy_from_slice(&f[..n_out]);
            }
            return;
        }
        let acts = qkernels::quantize_rows::<F::Act>(lhs, m, self.w.k);
        self.matmul_acts_prefix(qkernels::isa(), &acts, m, dst, n_out);
    }

    fn dequantize_row(&self, row: usize, dst: &mut [f32]) {
        self.w.dequantize_row(row, dst);
    }

    fn matmul_silu_mul(&self, m: usize, g: &[f32], u: &[f32], dst: &mut [f32]) {
        let acts = qkernels::quantize_silu_mul_rows::<F::Act>(g, u, m, self.w.k);
        self.matmul_acts(qkernels::isa(), &acts, m, dst);
    }

    fn quantize_input(&self, m: usize, lhs: &[f32]) -> QuantizedInput {
        let acts = qkernels::quantize_rows::<F::Act>(lhs, m, self.w.k);
        F::Act::wrap(acts, m, self.w.k)
    }

    fn matmul_quantized(&self, q: &QuantizedInput, dst: &mut [f32]) {
        match F::Act::unwrap(q) {
            Some((acts, m, k)) if k == self.w.k => self.matmul_acts(qkernels::isa(), acts, m, dst),
            _ => match q {
                QuantizedInput::Raw { m, k, x } if *k == self.w.k => self.matmul(*m, x, dst),
                _ => panic!("quantized input does not fit {self:?}"),
            },
        }
    }

    fn act_format(&self) -> ActFormat {
        F::Act::FORMAT
    }

    fn fused_tasks(&self) -> usize {
        self.w.n.div_ceil(qkernels::G).div_ceil(FUSED_TASK_GROUPS)
    }

    unsafe fn run_fused_task(&self, q: &QuantizedInput, task: usize, out: OutPtr) {
        let Some((acts, m, k)) = F::Act::unwrap(q) else {
            panic!("quantized input does not fit {self:?}");
        };
        assert_eq!(k, self.w.k, "quantized input width");
        let groups = self.w.n.div_ceil(qkernels::G);
        let g = task * FUSED_TASK_GROUPS..((task + 1) * FUSED_TASK_GROUPS).min(groups);
        // SAFETY: the caller's contract (disjoint columns of a live output).
        unsafe { self.w.columns(qkernels::isa(), acts, m, g, out) };
    }
}

static REPACK_NS: AtomicU64 = AtomicU64::new(0);
static REPACK_BYTES: AtomicU64 = AtomicU64::new(0);

/// Total wall time spent repacking weights at load in this process, and the bytes repacked
/// (for the loader's log line).
pub fn repack_stats() -> (std::time::Duration, u64) {
    (
        std::time::Duration::from_nanos(REPACK_NS.load(Ordering::Relaxed)),
        REPACK_BYTES.load(Ordering::Relaxed),
    )
}

fn packed<F: Format>(n: usize, k: usize, bytes: &[u8]) -> Result<Arc<dyn QKernel>, EngineError>
where
    F::Act: InputActs,
{
    if !k.is_multiple_of(F::BLOCK) {
        return Err(EngineError::Load(format!(
            "{} matrix with {k} columns: not a multiple of the block size {}",
            F::NAME,
            F::BLOCK
        )));
    }
    let want = n * (k / F::BLOCK) * std::mem::size_of::<F::Raw>();
    if bytes.len() != want {
        return Err(EngineError::Load(format!(
            "{} matrix {n} x {k}: expected {want} bytes, found {}",
            F::NAME,
            bytes.len()
        )));
    }
    let t = std::time::Instant::now();
    let w = Packed::<F>::from_bytes(bytes, n, k);
    REPACK_NS.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    REPACK_BYTES.fetch_add(bytes.len() as u64, Ordering::Relaxed);
    Ok(Arc::new(PackedKernel { w }))
}

/// Copy raw GGUF block bytes into a typed block vector.
fn blocks_from_bytes<T: GgmlType>(bytes: &[u8]) -> Result<Vec<T>, EngineError> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) {
        return Err(EngineError::Load(format!(
            "{:?} data of {} bytes is not a whole number of {size}-byte blocks",
            T::DTYPE,
            bytes.len()
        )));
    }
    let count = bytes.len() / size;
    let mut blocks = vec![T::zeros(); count];
    // SAFETY: the GGML block types are `#[repr(C)]` aggregates of integers, `f16` and `f32`
    // without padding, for which every bit pattern is a valid value; `blocks` owns exactly
    // `count * size == bytes.len()` bytes and does not overlap `bytes`. This is the same
    // reinterpretation candle performs when it loads a GGUF tensor.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), blocks.as_mut_ptr() as *mut u8, bytes.len());
    }
    Ok(blocks)
}

fn typed<T: GgmlType + 'static>(
    n: usize,
    k: usize,
    bytes: &[u8],
) -> Result<Arc<dyn QKernel>, EngineError> {
    if !k.is_multiple_of(T::BLCK_SIZE) {
        return Err(EngineError::Load(format!(
            "{:?} matrix with {k} columns: not a multiple of the block size {}",
            T::DTYPE,
            T::BLCK_SIZE
        )));
    }
    let blocks = blocks_from_bytes::<T>(bytes)?;
    if blocks.len() != n * (k / T::BLCK_SIZE) {
        return Err(EngineError::Load(format!(
            "{:?} matrix {n} x {k}: expected {} blocks, found {}",
            T::DTYPE,
            n * (k / T::BLCK_SIZE),
            blocks.len()
        )));
    }
    Ok(Arc::new(QWeight { blocks, n, k }))
}

/// Whether [`kernel_from_bytes`] handles `dtype` (the block-quantized GGML types).
pub(crate) fn is_quantized(dtype: GgmlDType) -> bool {
    !matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

/// Build a CPU kernel for an `n × k` matrix stored as GGUF blocks of `dtype`.
pub(crate) fn kernel_from_bytes(
    dtype: GgmlDType,
    n: usize,
    k: usize,
    bytes: &[u8],
) -> Result<Arc<dyn QKernel>, EngineError> {
    use k_quants::*;
    match dtype {
        GgmlDType::Q4_0 => typed::<BlockQ4_0>(n, k, bytes),
        GgmlDType::Q4_1 => packed::<qkernels::Q4_1>(n, k, bytes),
        GgmlDType::Q5_0 if qkernels::q5_0_in_lines(qkernels::isa()) => {
            packed::<qkernels::Q5_0Lines>(n, k, bytes)
        }
        GgmlDType::Q5_0 => packed::<qkernels::Q5_0>(n, k, bytes),
        GgmlDType::Q5_1 => typed::<BlockQ5_1>(n, k, bytes),
        GgmlDType::Q8_0 => packed::<qkernels::Q8_0>(n, k, bytes),
        GgmlDType::Q8_1 => typed::<BlockQ8_1>(n, k, bytes),
        GgmlDType::Q2K => typed::<BlockQ2K>(n, k, bytes),
        GgmlDType::Q3K => typed::<BlockQ3K>(n, k, bytes),
        GgmlDType::Q4K => packed::<qkernels::Q4K>(n, k, bytes),
        GgmlDType::Q5K => typed::<BlockQ5K>(n, k, bytes),
        GgmlDType::Q6K if qkernels::q6k_in_lines(qkernels::isa()) => {
            packed::<qkernels::Q6KLines>(n, k, bytes)
        }
        GgmlDType::Q6K => packed::<qkernels::Q6K>(n, k, bytes),
        GgmlDType::Q8K => typed::<BlockQ8K>(n, k, bytes),
        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => Err(EngineError::Load(format!(
            "{dtype:?} is not a block-quantized type"
        ))),
    }
}

/// The kernel as a candle op on `(..., in_features)` f32 tensors, so it composes with the rest
/// of the forward pass.
pub(crate) struct QMatMulOp<'a>(pub &'a dyn QKernel);

impl CustomOp1 for QMatMulOp<'_> {
    fn name(&self) -> &'static str {
        "sequoia-qmatmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let k = self.0.in_features();
        let n = self.0.out_features();
        let dims = layout.shape().dims();
        if dims.last() != Some(&k) {
            candle_core::bail!("qmatmul: input {dims:?} does not end in {k}");
        }
        let src = match (storage, layout.contiguous_offsets()) {
            (CpuStorage::F32(data), Some((start, end))) => &data[start..end],
            (CpuStorage::F32(_), None) => candle_core::bail!("qmatmul: input is not contiguous"),
            _ => candle_core::bail!("qmatmul: input must be f32"),
        };
        let m = src.len() / k;
        let mut dst = vec![0f32; m * n];
        self.0.matmul(m, src, &mut dst);
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("rank >= 1") = n;
        Ok((CpuStorage::F32(dst), Shape::from(out_dims)))
    }
}

/// One kernel benchmark: single thread, thread CPU time, best of several batches.
#[derive(Clone, Copy, Debug)]
pub struct KernelTiming {
    /// Nanoseconds per matmul call (activation quantization included).
    pub ns: f64,
    /// Multiply-accumulates per nanosecond (`m · n · k / ns`), i.e. G MAC/s on one core.
    pub gmacs: f64,
    /// Weight bytes (repacked size) read per nanosecond, i.e. GB/s.
    pub gbps: f64,
    /// Nanoseconds per call of the kernel alone, on activations quantized beforehand (as
    /// every matmul after the first on the same input runs in a forward).
    pub kernel_ns: f64,
    /// `m · n · k / kernel_ns`: the kernel's own G MAC/s on one core.
    pub kernel_gmacs: f64,
    /// Bytes of one repacked weight matrix.
    pub weight_bytes: usize,
}

/// Nanoseconds the calling thread has run on a CPU (robust to other processes), or wall time
/// where that clock is unavailable.
fn thread_cpu_ns() -> u64 {
    #[cfg(target_os = "linux")]
    {
        #[repr(C)]
        struct Timespec {
            tv_sec: i64,
            tv_nsec: i64,
        }
        unsafe extern "C" {
            fn clock_gettime(clk: i32, ts: *mut Timespec) -> i32;
        }
        const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
        let mut ts = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid out-pointer of the C layout.
        if unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0 {
            return ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
        }
    }
    use std::sync::OnceLock;
    static T0: OnceLock<std::time::Instant> = OnceLock::new();
    T0.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64
}

/// Benchmark the repacked kernel for `dtype` (Q4K, Q6K, Q5_0, Q8_0, Q4_1) on an `n × k` matrix
/// of random weights with `m` input rows, on path `isa`, on one thread. `copies > 1` cycles
/// through that many copies of the matrix so the weights stream from DRAM as in a model
/// forward (use enough to exceed the last-level cache) — the decode (`m = 1`) bandwidth case.
pub fn kernel_report(
    isa: Isa,
    dtype: GgmlDType,
    n: usize,
    k: usize,
    m: usize,
    copies: usize,
) -> Result<KernelTiming, EngineError> {
    if !isa.available() {
        return Err(EngineError::Load(format!(
            "{} kernels unavailable on this CPU",
            isa.name()
        )));
    }
    let w = candle_core::Tensor::randn(0f32, 1.0, (n, k), &candle_core::Device::Cpu)
        .and_then(|w| candle_core::quantized::QTensor::quantize(&w, dtype))
        .and_then(|q| q.data().map(|d| d.to_vec()))
        .map_err(|e| EngineError::Load(format!("benchmark weights: {e}")))?;
    let x = candle_core::Tensor::randn(0f32, 1.0, (m * k,), &candle_core::Device::Cpu)
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| EngineError::Load(format!("benchmark inputs: {e}")))?;
    fn go<F: Format>(
        isa: Isa,
        bytes: &[u8],
        x: &[f32],
        n: usize,
        k: usize,
        m: usize,
        copies: usize,
    ) -> KernelTiming
    where
        F::Act: InputActs,
    {
        let kerns: Vec<PackedKernel<F>> = (0..copies.max(1))
            .map(|_| PackedKernel {
                w: Packed::<F>::from_bytes(bytes, n, k),
            })
            .collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("one-thread pool");
        let mut y = vec![0f32; m * n];
        // The activations quantized once, for the kernel alone: in a forward one quantization
        // serves every matmul that reads the same input (Q/K/V, gate/up), and at a few rows
        // and small shapes it is a large share of one call (a quarter of it at one row and
        // 128 × 1536).
        let (ns, kernel_ns) = pool.install(|| {
            // Inside the one-thread pool, as every call below: the engine's loops size their
            // threads by the pool they are first called from.
            let acts = qkernels::quantize_rows::<F::Act>(x, m, k);
            let mut i = 0;
            let mut call = |y: &mut [f32], alone: bool| {
                i += 1;
                let kern = &kerns[i % kerns.len()];
                if alone {
                    kern.matmul_acts(isa, &acts, m, y);
                } else {
                    kern.matmul_isa(isa, m, x, y);
                }
            };
            let t = thread_cpu_ns();
            call(&mut y, false);
            let once = (thread_cpu_ns() - t).max(1);
            let reps = (20_000_000 / once).clamp(2, 200) as usize;
            // Best of several batches, the two kinds alternated: other processes only ever add
            // time, and a slow spell hits both.
            let (mut with, mut alone) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..7 {
                for (best, kind) in [(&mut with, false), (&mut alone, true)] {
                    let t = thread_cpu_ns();
                    for _ in 0..reps {
                        call(&mut y, kind);
                    }
                    *best = best.min((thread_cpu_ns() - t) as f64 / reps as f64);
                }
            }
            (with, alone)
        });
        let weight_bytes = kerns[0].w.size_bytes();
        KernelTiming {
            ns,
            gmacs: (m * n * k) as f64 / ns,
            gbps: weight_bytes as f64 / ns,
            kernel_ns,
            kernel_gmacs: (m * n * k) as f64 / kernel_ns,
            weight_bytes,
        }
    }
    Ok(match dtype {
        GgmlDType::Q4K => go::<qkernels::Q4K>(isa, &w, &x, n, k, m, copies),
        GgmlDType::Q6K if qkernels::q6k_in_lines(isa) => {
            go::<qkernels::Q6KLines>(isa, &w, &x, n, k, m, copies)
        }
        GgmlDType::Q6K => go::<qkernels::Q6K>(isa, &w, &x, n, k, m, copies),
        GgmlDType::Q5_0 if qkernels::q5_0_in_lines(isa) => {
            go::<qkernels::Q5_0Lines>(isa, &w, &x, n, k, m, copies)
        }
        GgmlDType::Q5_0 => go::<qkernels::Q5_0>(isa, &w, &x, n, k, m, copies),
        GgmlDType::Q8_0 => go::<qkernels::Q8_0>(isa, &w, &x, n, k, m, copies),
        GgmlDType::Q4_1 => go::<qkernels::Q4_1>(isa, &w, &x, n, k, m, copies),
        _ => {
            return Err(EngineError::Load(format!(
                "{dtype:?} has no repacked kernel to benchmark"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    const TYPES: [GgmlDType; 6] = [
        GgmlDType::Q4K,
        GgmlDType::Q6K,
        GgmlDType::Q5_0,
        GgmlDType::Q8_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5K,
    ];

    fn setup(dtype: GgmlDType, n: usize, k: usize) -> (Arc<dyn QKernel>, Vec<f32>) {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
        let qt = QTensor::quantize(&w, dtype).unwrap();
        let kern = kernel_from_bytes(dtype, n, k, &qt.data().unwrap()).unwrap();
        let deq: Vec<f32> = qt
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        (kern, deq)
    }

    fn inputs(m: usize, k: usize) -> Vec<f32> {
        Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// Against an f32 matmul with the dequantized weights: only the int8 rounding of the inputs
    /// may differ (well under 1% of the output scale).
    #[test]
    fn matches_dequantized_f32_matmul() {
        // k spans several K chunks of the kernels, the last one partial.
        let (n, k) = (70, 2560);
        for dtype in TYPES {
            let (kern, deq) = setup(dtype, n, k);
            for m in [1usize, 2, 3, 4, 5, 8, 9, 19] {
                let x = inputs(m, k);
                let mut got = vec![0f32; m * n];
                kern.matmul(m, &x, &mut got);
                let mut scale = 0f32;
                let mut err = 0f32;
                for r in 0..m {
                    for c in 0..n {
                        let want: f32 = (0..k).map(|i| x[r * k + i] * deq[c * k + i]).sum();
                        scale = scale.max(want.abs());
                        err = err.max((want - got[r * n + c]).abs());
                    }
                }
                assert!(
                    err < 2e-2 * scale,
                    "{dtype:?} m={m}: error {err} vs scale {scale}"
                );
            }
        }
    }

    /// A row's result does not depend on how many rows share the call, bit for bit (so tree
    /// nodes get exactly the logits of decoding them alone), also with the large activation
    /// outliers of real models.
    #[test]
    fn rows_are_independent_of_batch() {
        // (13, 768): partial row tiles; (20, 2048): also the k-chunked loop (several tiles).
        for (m, k) in [(13, 768), (20, 2048)] {
            let n = 37;
            for dtype in TYPES {
                let (kern, _) = setup(dtype, n, k);
                let mut x = inputs(m, k);
                // Qwen-style outlier channels.
                for r in 0..m {
                    x[r * k + 5] = 300.0;
                    x[r * k + 400] = -250.0;
                }
                let mut all = vec![0f32; m * n];
                kern.matmul(m, &x, &mut all);
                for r in 0..m {
                    let mut one = vec![0f32; n];
                    kern.matmul(1, &x[r * k..(r + 1) * k], &mut one);
                    assert_eq!(one, &all[r * n..(r + 1) * n], "{dtype:?} m={m} row {r}");
                }
            }
        }
    }

    /// A column prefix (a pruned LM head) equals the full product's first columns bit for bit,
    /// for whole groups, partial groups and the whole matrix.
    #[test]
    fn column_prefix_equals_full_columns() {
        let (n, k) = (70, 512);
        for dtype in TYPES {
            let (kern, _) = setup(dtype, n, k);
            for m in [1usize, 3, 9] {
                let x = inputs(m, k);
                let mut full = vec![0f32; m * n];
                kern.matmul(m, &x, &mut full);
                for n_out in [1usize, 16, 17, 32, 64, 69, 70] {
                    let mut got = vec![0f32; m * n_out];
                    kern.matmul_prefix(m, &x, &mut got, n_out);
                    for r in 0..m {
                        assert_eq!(
                            &got[r * n_out..(r + 1) * n_out],
                            &full[r * n..r * n + n_out],
                            "{dtype:?} m={m} n_out={n_out} row {r}"
                        );
                    }
                }
            }
        }
    }

    /// The GGUF bytes of random `n × k` weights quantized to `dtype`.
    fn random_blocks(dtype: GgmlDType, n: usize, k: usize) -> Vec<u8> {
        let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
        QTensor::quantize(&w, dtype)
            .unwrap()
            .data()
            .unwrap()
            .to_vec()
    }

    fn packed_kernel<F: Format>(dtype: GgmlDType, n: usize, k: usize) -> PackedKernel<F> {
        PackedKernel {
            w: Packed::<F>::from_bytes(&random_blocks(dtype, n, k), n, k),
        }
    }

    /// Every available ISA path equals the scalar one bit for bit, for every format, row count
    /// and row position, with n not a multiple of the group and k spanning several K chunks
    /// (the last one partial), also with Qwen-style outlier activations; and a row's result
    /// does not depend on the batch.
    #[test]
    fn isa_paths_match_scalar_bit_for_bit() {
        fn check<F: Format>(dtype: GgmlDType)
        where
            F::Act: InputActs,
        {
            let (n, k) = (37, 2560);
            let kern = packed_kernel::<F>(dtype, n, k);
            let mut x = inputs(70, k);
            for r in (0..70).step_by(3) {
                x[r * k + 5] = 300.0;
                x[r * k + 700] = -250.0;
            }
            let mut alone = vec![0f32; 70 * n];
            for r in 0..70 {
                kern.matmul_isa(
                    Isa::Scalar,
                    1,
                    &x[r * k..(r + 1) * k],
                    &mut alone[r * n..][..n],
                );
            }
            for isa in Isa::ALL.into_iter().filter(|i| i.available()) {
                // 9+ and 32+ rows take the AMX tiles where the CPU has them (17, 33: a last tile
                // that starts early; 70: a second stripe of 64 rows); 17, 33 and 70 also the
                // 16-row tiles of the 512-bit paths (`Format::WIDE_ROWS`), each then one of
                // 1 or 6 rows.
                for m in [1usize, 2, 3, 5, 8, 13, 17, 33, 70] {
                    let mut got = vec![0f32; m * n];
                    kern.matmul_isa(isa, m, &x[..m * k], &mut got);
                    for r in 0..m {
                        for c in 0..n {
                            let (g, w) = (got[r * n + c], alone[r * n + c]);
                            assert!(
                                g.to_bits() == w.to_bits(),
                                "{dtype:?} {isa:?} m={m} row {r} col {c}: {g} vs scalar {w}"
                            );
                        }
                    }
                }
            }
        }
        check::<qkernels::Q4K>(GgmlDType::Q4K);
        check::<qkernels::Q6K>(GgmlDType::Q6K);
        check::<qkernels::Q6KLines>(GgmlDType::Q6K);
        check::<qkernels::Q5_0>(GgmlDType::Q5_0);
        check::<qkernels::Q5_0Lines>(GgmlDType::Q5_0);
        check::<qkernels::Q8_0>(GgmlDType::Q8_0);
        check::<qkernels::Q4_1>(GgmlDType::Q4_1);
    }

    /// The shorter Q4_K and Q6_K paths that activations with small enough sums allow (raw
    /// Q4_K chains without the `−8 · Σx` start and correction; whole-sub-block Q6_K chains)
    /// give the long paths' bits on every ISA path and row count. Normal inputs allow them on
    /// most blocks (checked, so the test exercises them); inputs at ±127 allow neither.
    #[test]
    fn short_k_quant_paths_equal_the_long_ones_bit_for_bit() {
        use qkernels::ActK;
        fn check<F: Format<Act = ActK>>(dtype: GgmlDType, want_q4: bool) {
            let (n, k) = (37, 2560);
            let kern = packed_kernel::<F>(dtype, n, k);
            // 16 and 33 rows: the wide tiles (`Format::WIDE_ROWS`) on the 512-bit paths.
            for m in [1usize, 3, 5, 8, 13, 16, 33] {
                let x = inputs(m, k);
                let short = qkernels::quantize_rows::<ActK>(&x, m, k);
                let allowed = short
                    .iter()
                    .filter(|a| if want_q4 { a.fits().0 } else { a.fits().1 })
                    .count();
                assert!(
                    2 * allowed > short.len(),
                    "{dtype:?}: only {allowed} of {} blocks take the short path",
                    short.len()
                );
                // A tile takes a short path only where all its rows allow it: some block's
                // first 16 rows must, so that the wide tiles exercise it too (block-major
                // activations: block `b`'s rows are `b·m ..`).
                if m >= 16 {
                    let fits = |a: &ActK| if want_q4 { a.fits().0 } else { a.fits().1 };
                    let wide = short.chunks(m).filter(|b| b[..16].iter().all(fits)).count();
                    assert!(
                        wide > 0,
                        "{dtype:?} m={m}: no 16-row tile takes the short path"
                    );
                }
                let mut long = short.clone();
                long.iter_mut().for_each(ActK::forbid_short_paths);
                for isa in Isa::ALL.into_iter().filter(|i| i.available()) {
                    let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
                    kern.matmul_acts(isa, &short, m, &mut a);
                    kern.matmul_acts(isa, &long, m, &mut b);
                    let what = format!("{dtype:?} {isa:?} m={m}, short path vs long");
                    crate::test_util::assert_same_bits(&a, &b, &what);
                }
            }
            let extreme: Vec<f32> = (0..k)
                .map(|i| if i % 3 == 0 { -4.0 } else { 4.0 })
                .collect();
            let acts = qkernels::quantize_rows::<ActK>(&extreme, 1, k);
            assert!(
                acts.iter().all(|a| a.fits() == (false, false)),
                "±127 inputs"
            );
        }
        check::<qkernels::Q4K>(GgmlDType::Q4K, true);
        check::<qkernels::Q6K>(GgmlDType::Q6K, false);
    }

    /// The MLP's fused down projection (`silu(g) ⊙ u` made and quantized block by block)
    /// equals the matmul of the product formed first, bit for bit, for every format and row
    /// count (1 row quantizes on the calling thread, 8 and more in parallel), with gate values
    /// of both signs and large magnitudes.
    #[test]
    fn fused_silu_mul_matmul_equals_the_matmul_of_the_product() {
        fn check<F: Format>(dtype: GgmlDType)
        where
            F::Act: InputActs,
        {
            let (n, k) = (37, 2560);
            let kern = packed_kernel::<F>(dtype, n, k);
            for m in [1usize, 3, 8, 13] {
                let mut g = inputs(m, k);
                for (i, v) in g.iter_mut().enumerate().step_by(97) {
                    *v = if i % 2 == 0 { 90.0 } else { -90.0 };
                }
                let u = inputs(m, k);
                let mut want = vec![0f32; m * n];
                kern.matmul(m, &crate::vecmath::silu_mul(&g, &u), &mut want);
                let mut got = vec![f32::NAN; m * n];
                kern.matmul_silu_mul(m, &g, &u, &mut got);
                let what = format!("{dtype:?} m={m}, fused vs formed product");
                crate::test_util::assert_same_bits(&got, &want, &what);
            }
        }
        check::<qkernels::Q4K>(GgmlDType::Q4K);
        check::<qkernels::Q6K>(GgmlDType::Q6K);
        check::<qkernels::Q5_0>(GgmlDType::Q5_0);
        check::<qkernels::Q8_0>(GgmlDType::Q8_0);
        check::<qkernels::Q4_1>(GgmlDType::Q4_1);
    }

    /// Weights and inputs at the extremes of their ranges (every quant at its largest or
    /// smallest value, every input at ±127 after quantization) give every ISA path the scalar
    /// result bit for bit: the i16 sums of the AVX2 path (`Simd::I16_SUMS`) reach their
    /// largest magnitudes here without overflowing.
    /// `count` GGUF blocks of `size` bytes filled with `fill`, with the f16 fields at `halves`
    /// set to 1 (finite scales whatever the fill).
    fn filled_blocks(count: usize, size: usize, fill: u8, halves: &[usize]) -> Vec<u8> {
        let mut b = vec![fill; count * size];
        for blk in b.chunks_exact_mut(size) {
            for &h in halves {
                blk[h..h + 2].copy_from_slice(&0x3C00u16.to_le_bytes());
            }
        }
        b
    }

    #[test]
    fn extreme_weights_and_inputs_match_scalar_bit_for_bit() {
        fn check<F: Format>(block_bytes: usize, halves: &[usize])
        where
            F::Act: InputActs,
        {
            let (n, k) = (16, 512);
            let signs: [&dyn Fn(usize) -> f32; 3] = [&|_| 1.0, &|_| -1.0, &|i| {
                if (i / 2) % 2 == 0 {
                    1.0
                } else {
                    -1.0
                }
            }];
            for fill in [0x00u8, 0xFF, 0x80, 0x7F] {
                let raw = filled_blocks(n * k / F::BLOCK, block_bytes, fill, halves);
                let kern = PackedKernel {
                    w: Packed::<F>::from_bytes(&raw, n, k),
                };
                // 33 rows: the AMX tiles of both K-quants where the CPU has them.
                for (sign, m) in signs.into_iter().flat_map(|s| [(s, 5), (s, 33)]) {
                    let x: Vec<f32> = (0..m * k).map(sign).collect();
                    let mut want = vec![0f32; m * n];
                    kern.matmul_isa(Isa::Scalar, m, &x, &mut want);
                    assert!(want.iter().all(|v| v.is_finite()), "{}", F::NAME);
                    for isa in Isa::ALL.into_iter().filter(|i| i.available()) {
                        let mut got = vec![0f32; m * n];
                        kern.matmul_isa(isa, m, &x, &mut got);
                        let same = got
                            .iter()
                            .zip(&want)
                            .all(|(g, w)| g.to_bits() == w.to_bits());
                        assert!(
                            same,
                            "{} {isa:?} fill {fill:#04x}: {got:?} vs {want:?}",
                            F::NAME
                        );
                    }
                }
            }
        }
        check::<qkernels::Q4K>(144, &[0, 2]);
        check::<qkernels::Q6K>(210, &[208]);
        check::<qkernels::Q6KLines>(210, &[208]);
        check::<qkernels::Q5_0>(22, &[0]);
        check::<qkernels::Q5_0Lines>(22, &[0]);
        check::<qkernels::Q8_0>(34, &[0]);
        check::<qkernels::Q4_1>(20, &[0, 2]);
    }

    /// The AVX2 path's own layouts hold the same weights as the bit planes the other paths
    /// use: on the same path (the scalar one, which runs on any CPU) a matmul gives the same
    /// bits in both, and every row dequantizes to the same values, for random weights and for
    /// every byte at its extremes (each bit of the packed fields set and clear).
    #[test]
    fn line_layouts_hold_the_plane_layouts_weights() {
        fn check<P: Format, L: Format<Raw = P::Raw, Act = P::Act>>(
            dtype: GgmlDType,
            block: usize,
            halves: &[usize],
        ) where
            P::Act: InputActs,
        {
            let (n, k) = (37, 512);
            let extremes = [0x00u8, 0xFF, 0xAA, 0x55]
                .map(|fill| filled_blocks(n * k / P::BLOCK, block, fill, halves));
            for raw in std::iter::once(random_blocks(dtype, n, k)).chain(extremes) {
                let planes = PackedKernel {
                    w: Packed::<P>::from_bytes(&raw, n, k),
                };
                let lines = PackedKernel {
                    w: Packed::<L>::from_bytes(&raw, n, k),
                };
                let (mut a, mut b) = (vec![0f32; k], vec![0f32; k]);
                for r in 0..n {
                    planes.dequantize_row(r, &mut a);
                    lines.dequantize_row(r, &mut b);
                    assert_eq!(a, b, "{} row {r}", L::NAME);
                }
                for m in [1usize, 3, 8] {
                    let x = inputs(m, k);
                    let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
                    planes.matmul_isa(Isa::Scalar, m, &x, &mut a);
                    lines.matmul_isa(Isa::Scalar, m, &x, &mut b);
                    let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{} m={m}", L::NAME);
                }
            }
        }
        check::<qkernels::Q5_0, qkernels::Q5_0Lines>(GgmlDType::Q5_0, 22, &[0]);
        check::<qkernels::Q6K, qkernels::Q6KLines>(GgmlDType::Q6K, 210, &[208]);
    }

    /// An input quantized once serves several kernels, with the same results as `matmul`.
    #[test]
    fn quantized_input_is_reusable() {
        let k = 512;
        let x = inputs(5, k);
        for group in [
            &[GgmlDType::Q4K, GgmlDType::Q6K][..],
            &[GgmlDType::Q5_0, GgmlDType::Q8_0, GgmlDType::Q4_1][..],
            &[GgmlDType::Q5K][..],
        ] {
            let kerns: Vec<_> = group.iter().map(|&d| setup(d, 21, k).0).collect();
            let q = kerns[0].quantize_input(5, &x);
            assert_eq!(q.rows(), 5);
            for kern in &kerns {
                let mut a = vec![0f32; 5 * 21];
                let mut b = vec![0f32; 5 * 21];
                kern.matmul(5, &x, &mut a);
                kern.matmul_quantized(&q, &mut b);
                assert_eq!(a, b, "{kern:?}");
            }
        }
    }

    /// One fused pass over matrices of mixed formats (both activation formats, and a type
    /// without a repacked kernel that runs on its own) gives every output bit for bit what
    /// its own `matmul` gives, for any number of rows.
    #[test]
    fn fused_pass_equals_separate_matmuls() {
        let k = 512;
        // Widths that are not multiples of a task (4 groups of 16 columns) or a group.
        let specs = [
            (GgmlDType::Q4K, 200),
            (GgmlDType::Q6K, 37),
            (GgmlDType::Q8_0, 64),
            (GgmlDType::Q5_0, 21),
            (GgmlDType::Q4_1, 130),
            (GgmlDType::Q5K, 19),
        ];
        let kerns: Vec<_> = specs.iter().map(|&(d, n)| setup(d, n, k).0).collect();
        for m in [1, 3, 8, 17] {
            let x = inputs(m, k);
            let mut fused: Vec<Vec<f32>> = kerns
                .iter()
                .map(|kern| vec![f32::NAN; m * kern.out_features()])
                .collect();
            let mut jobs: Vec<(&dyn QKernel, &mut [f32])> = kerns
                .iter()
                .zip(fused.iter_mut())
                .map(|(kern, o)| (kern.as_ref(), o.as_mut_slice()))
                .collect();
            matmul_fused(&mut jobs, m, &x);
            for (kern, got) in kerns.iter().zip(&fused) {
                let mut want = vec![0f32; m * kern.out_features()];
                kern.matmul(m, &x, &mut want);
                assert_eq!(
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{kern:?}, m = {m}"
                );
            }
        }
    }

    #[test]
    fn dequantized_rows_match_candle() {
        let (n, k) = (9, 512);
        for dtype in TYPES {
            let (kern, deq) = setup(dtype, n, k);
            let mut row = vec![0f32; k];
            for r in [0, 4, 8] {
                kern.dequantize_row(r, &mut row);
                for (a, b) in row.iter().zip(&deq[r * k..(r + 1) * k]) {
                    assert!(
                        (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                        "{dtype:?}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn candle_op_wrapper_shapes() {
        let (kern, _) = setup(GgmlDType::Q8_0, 16, 64);
        let x = Tensor::randn(0f32, 1.0, (2, 3, 64), &Device::Cpu).unwrap();
        let y = x.apply_op1_no_bwd(&QMatMulOp(kern.as_ref())).unwrap();
        assert_eq!(y.dims(), &[2, 3, 16]);
    }
}

#[cfg(test)]
mod bench {
    use super::*;

    /// Single-thread kernel throughput per format and ISA path, in CPU time:
    /// `cargo test --release -p sequoia-engine --lib qmatmul::bench -- --ignored --nocapture`
    /// (env: QSHAPE=NxK, QTYPES=Q4K,Q6K,Q5_0,Q8_0,Q4_1, QISAS=avx512vnni,..., QCOPIES=n to
    /// stream the weights from DRAM, QMS=1,4,8,...).
    /// 512-bit `vpdpbusd` peak of this core now (12 independent accumulators), G MAC/s in
    /// thread CPU time: the reference for the kernels measured in the same run.
    #[cfg(target_arch = "x86_64")]
    fn vnni512_peak() -> Option<f64> {
        if !Isa::Avx512Vnni.available() {
            return None;
        }
        let iters = 20_000_000u64;
        let t = thread_cpu_ns();
        // SAFETY: AVX-512 VNNI checked; only zmm registers are touched (declared clobbered).
        unsafe {
            std::arch::asm!(
                "vpxord zmm30, zmm30, zmm30",
                "vpxord zmm31, zmm31, zmm31",
                "2:",
                "vpdpbusd zmm0, zmm30, zmm31", "vpdpbusd zmm1, zmm30, zmm31",
                "vpdpbusd zmm2, zmm30, zmm31", "vpdpbusd zmm3, zmm30, zmm31",
                "vpdpbusd zmm4, zmm30, zmm31", "vpdpbusd zmm5, zmm30, zmm31",
                "vpdpbusd zmm6, zmm30, zmm31", "vpdpbusd zmm7, zmm30, zmm31",
                "vpdpbusd zmm8, zmm30, zmm31", "vpdpbusd zmm9, zmm30, zmm31",
                "vpdpbusd zmm10, zmm30, zmm31", "vpdpbusd zmm11, zmm30, zmm31",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) iters => _,
                out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                out("zmm30") _, out("zmm31") _,
            );
        }
        Some((iters * 12 * 64) as f64 / (thread_cpu_ns() - t) as f64)
    }

    #[test]
    #[ignore]
    fn kernel_throughput() {
        let shape = std::env::var("QSHAPE").unwrap_or_else(|_| "4096x1536".into());
        let (n, k) = shape
            .split_once('x')
            .map(|(a, b)| (a.parse().unwrap(), b.parse().unwrap()))
            .unwrap();
        let types = std::env::var("QTYPES").unwrap_or_else(|_| "Q4K,Q6K,Q5_0,Q8_0,Q4_1".into());
        let isas = std::env::var("QISAS").unwrap_or_else(|_| "avx512vnni,avxvnni,avx2".into());
        let ms: Vec<usize> = std::env::var("QMS")
            .unwrap_or_else(|_| "1,4,8,16,32,64".into())
            .split(',')
            .map(|v| v.parse().unwrap())
            .collect();
        let copies: usize = std::env::var("QCOPIES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        #[cfg(target_arch = "x86_64")]
        if let Some(p) = vnni512_peak() {
            println!("512-bit vpdpbusd peak now: {p:.0} GMAC/s/core");
        }
        {
            // Read bandwidth now (one thread, 512 MiB, thread CPU time).
            let buf = vec![1u64; 64 << 20];
            let mut best = f64::INFINITY;
            let mut sum = 0u64;
            for _ in 0..3 {
                let t = thread_cpu_ns();
                sum = sum.wrapping_add(buf.iter().fold(0u64, |a, &v| a.wrapping_add(v)));
                best = best.min((thread_cpu_ns() - t) as f64);
            }
            println!(
                "read bandwidth now: {:.1} GB/s ({sum})",
                (buf.len() * 8) as f64 / best
            );
        }
        for dtype in [
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q5_0,
            GgmlDType::Q8_0,
            GgmlDType::Q4_1,
        ] {
            if !types.split(',').any(|t| t == format!("{dtype:?}")) {
                continue;
            }
            for isa in isas.split(',').filter_map(Isa::from_name) {
                if !isa.available() {
                    println!("{dtype:?} {}: not available", isa.name());
                    continue;
                }
                let mut t1 = None;
                for &m in &ms {
                    let t = kernel_report(isa, dtype, n, k, m, copies).unwrap();
                    let base = *t1.get_or_insert(t.ns);
                    println!(
                        "{dtype:?} {:10} m={m:3}: {:8.3} ms {:6.1} GMAC/s/core {:6.1} GB/s  t/t(m=1) {:5.2}",
                        isa.name(),
                        t.ns / 1e6,
                        t.gmacs,
                        t.gbps,
                        t.ns / base
                    );
                }
            }
        }
    }
}
