//! CPU matrix multiply against GGUF-quantized weights.
//!
//! candle's own `QMatMul` on the CPU loops over the input rows outside and the weight rows
//! inside, so every input row streams the whole (hundreds of MB) weight matrix from memory and
//! re-decodes every block: a 16-node tree costs about as much as 16 single-token decodes. Tree
//! verification lives on batches of 8..128 rows, so here each task owns a range of weight rows
//! (output columns) and serves every input row from it while it is in cache.
//!
//! - Q4_K, Q6_K, Q5_0 and Q8_0 (everything in the default Qwen2.5-Coder models) use our
//!   multi-row AVX2 kernels ([`super::qkernels`]): a block is decoded once for four input rows;
//! - the other GGML types use candle's per-pair `vec_dot` with the same loop order.
//!
//! The weights are kept as typed block vectors owned by the kernel, and the token embedding
//! reuses them: [`QKernel::dequantize_row`] expands only the rows a step looks up, instead of a
//! full f32 copy of a 150k-token embedding table.

use std::sync::Arc;

use candle_core::quantized::{k_quants, GgmlDType, GgmlType};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape};
use rayon::prelude::*;

use super::qkernels::{self, OutPtr, QFormat};
use super::EngineError;

/// A quantized weight matrix `W` of shape `(out_features, in_features)` with `y = x · Wᵀ`.
pub(crate) trait QKernel: Send + Sync + std::fmt::Debug {
    fn out_features(&self) -> usize;
    fn in_features(&self) -> usize;
    /// `dst (m × out) = lhs (m × in) · Wᵀ`, both row-major.
    fn matmul(&self, m: usize, lhs: &[f32], dst: &mut [f32]);
    /// Expand row `row` of `W` into `dst` (`in_features` values).
    fn dequantize_row(&self, row: usize, dst: &mut [f32]);
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

/// Run `f(columns, out)` over disjoint column ranges of the `m × n` output in parallel.
fn for_column_chunks(
    n: usize,
    m: usize,
    dst: &mut [f32],
    f: impl Fn(std::ops::Range<usize>, OutPtr) + Sync,
) {
    assert_eq!(dst.len(), m * n, "matmul output size");
    let chunk = column_chunk(n);
    let out = OutPtr::new(dst, n);
    (0..n.div_ceil(chunk)).into_par_iter().for_each(|ci| {
        let c0 = ci * chunk;
        f(c0..(c0 + chunk).min(n), out)
    });
}

impl<T: GgmlType + 'static> QKernel for QWeight<T> {
    fn out_features(&self) -> usize {
        self.n
    }

    fn in_features(&self) -> usize {
        self.k
    }

    fn matmul(&self, m: usize, lhs: &[f32], dst: &mut [f32]) {
        let (n, k) = (self.n, self.k);
        assert_eq!(lhs.len(), m * k, "matmul input size");
        let kb = k / T::BLCK_SIZE;
        // Quantize the inputs once into the weight type's dot-product format.
        let mut q = vec![T::VecDotType::zeros(); m * kb];
        q.par_chunks_mut(kb)
            .zip(lhs.par_chunks(k))
            .for_each(|(qr, xr)| T::VecDotType::from_float(xr, qr));
        let w = &self.blocks;
        for_column_chunks(n, m, dst, |cols, out| {
            for c in cols {
                let wc = &w[c * kb..(c + 1) * kb];
                for r in 0..m {
                    let v = T::vec_dot(k, wc, &q[r * kb..(r + 1) * kb]);
                    // SAFETY: `for_column_chunks` hands each task its own columns of a live
                    // `m × n` output.
                    unsafe { out.store(r, c, &[v]) };
                }
            }
        });
    }

    fn dequantize_row(&self, row: usize, dst: &mut [f32]) {
        let kb = self.k / T::BLCK_SIZE;
        T::to_float(&self.blocks[row * kb..(row + 1) * kb], dst);
    }
}

/// One quantized matrix in a format with our own multi-row kernels.
struct FastQ<F: QFormat> {
    blocks: Vec<F>,
    n: usize,
    k: usize,
}

impl<F: QFormat> std::fmt::Debug for FastQ<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FastQ<{}>({} x {})", F::NAME, self.n, self.k)
    }
}

impl<F: QFormat> QKernel for FastQ<F> {
    fn out_features(&self) -> usize {
        self.n
    }

    fn in_features(&self) -> usize {
        self.k
    }

    fn matmul(&self, m: usize, lhs: &[f32], dst: &mut [f32]) {
        let (n, k) = (self.n, self.k);
        assert_eq!(lhs.len(), m * k, "matmul input size");
        let kb = k / F::BLOCK;
        let tiles = qkernels::quantize_tiles::<F>(lhs, m, k);
        let w = &self.blocks;
        let avx2 = qkernels::has_avx2();
        for_column_chunks(n, m, dst, |cols, out| {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: `has_avx2` checked the CPU features; `for_column_chunks` gives each
                // task its own columns of a live `m × n` output.
                unsafe { qkernels::columns_avx2(w, kb, cols, &tiles, m, out) };
                return;
            }
            let _ = avx2;
            // SAFETY: as above.
            unsafe { qkernels::columns_scalar(w, kb, cols, &tiles, m, out) };
        });
    }

    fn dequantize_row(&self, row: usize, dst: &mut [f32]) {
        let kb = self.k / F::BLOCK;
        F::dequantize(&self.blocks[row * kb..(row + 1) * kb], dst);
    }
}

/// Plain-old-data block types: `#[repr(C)]` aggregates of integers, `f16` and `f32` without
/// padding, for which every bit pattern is a valid value.
///
/// # Safety
/// Only implement for such types.
unsafe trait Pod: Copy {}
// SAFETY: all four are `#[repr(C)]` integer aggregates without padding (sizes asserted in
// `qkernels`).
unsafe impl Pod for qkernels::BlockQ4K {}
unsafe impl Pod for qkernels::BlockQ6K {}
unsafe impl Pod for qkernels::BlockQ5_0 {}
unsafe impl Pod for qkernels::BlockQ8_0 {}

fn pod_from_bytes<T: Pod>(bytes: &[u8]) -> Result<Vec<T>, EngineError> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) {
        return Err(EngineError::Load(format!(
            "{} bytes is not a whole number of {size}-byte blocks",
            bytes.len()
        )));
    }
    let count = bytes.len() / size;
    let mut v: Vec<T> = Vec::with_capacity(count);
    // SAFETY: `T: Pod` accepts any bit pattern; the vector has room for exactly `bytes.len()`
    // bytes, which are all initialized by the copy before `set_len`.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr() as *mut u8, bytes.len());
        v.set_len(count);
    }
    Ok(v)
}

fn fast<F: QFormat + Pod>(
    n: usize,
    k: usize,
    bytes: &[u8],
) -> Result<Arc<dyn QKernel>, EngineError> {
    if !k.is_multiple_of(F::BLOCK) {
        return Err(EngineError::Load(format!(
            "{} matrix with {k} columns: not a multiple of the block size {}",
            F::NAME,
            F::BLOCK
        )));
    }
    let blocks = pod_from_bytes::<F>(bytes)?;
    if blocks.len() != n * (k / F::BLOCK) {
        return Err(EngineError::Load(format!(
            "{} matrix {n} x {k}: expected {} blocks, found {}",
            F::NAME,
            n * (k / F::BLOCK),
            blocks.len()
        )));
    }
    Ok(Arc::new(FastQ { blocks, n, k }))
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
        GgmlDType::Q4_1 => typed::<BlockQ4_1>(n, k, bytes),
        GgmlDType::Q5_0 => fast::<qkernels::BlockQ5_0>(n, k, bytes),
        GgmlDType::Q5_1 => typed::<BlockQ5_1>(n, k, bytes),
        GgmlDType::Q8_0 => fast::<qkernels::BlockQ8_0>(n, k, bytes),
        GgmlDType::Q8_1 => typed::<BlockQ8_1>(n, k, bytes),
        GgmlDType::Q2K => typed::<BlockQ2K>(n, k, bytes),
        GgmlDType::Q3K => typed::<BlockQ3K>(n, k, bytes),
        GgmlDType::Q4K => fast::<qkernels::BlockQ4K>(n, k, bytes),
        GgmlDType::Q5K => typed::<BlockQ5K>(n, k, bytes),
        GgmlDType::Q6K => fast::<qkernels::BlockQ6K>(n, k, bytes),
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
        let (n, k) = (70, 512);
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

    /// The AVX2 and portable kernels agree.
    #[test]
    fn avx2_matches_scalar() {
        if !qkernels::has_avx2() {
            return;
        }
        fn check<F: QFormat + Pod>(dtype: GgmlDType) {
            let (n, k, m) = (19, 512, 13);
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
            let bytes = QTensor::quantize(&w, dtype)
                .unwrap()
                .data()
                .unwrap()
                .to_vec();
            let blocks = pod_from_bytes::<F>(&bytes).unwrap();
            let x = inputs(m, k);
            let kb = k / F::BLOCK;
            let tiles = qkernels::quantize_tiles::<F>(&x, m, k);
            let mut fast = vec![0f32; m * n];
            let mut slow = vec![0f32; m * n];
            // SAFETY: features checked above; single-threaded, all columns.
            unsafe {
                let out = OutPtr::new(&mut fast, n);
                qkernels::columns_avx2(&blocks, kb, 0..n, &tiles, m, out);
                let out = OutPtr::new(&mut slow, n);
                qkernels::columns_scalar(&blocks, kb, 0..n, &tiles, m, out);
            }
            for (a, b) in fast.iter().zip(&slow) {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "{dtype:?}: {a} vs {b}"
                );
            }
        }
        check::<qkernels::BlockQ4K>(GgmlDType::Q4K);
        check::<qkernels::BlockQ6K>(GgmlDType::Q6K);
        check::<qkernels::BlockQ5_0>(GgmlDType::Q5_0);
        check::<qkernels::BlockQ8_0>(GgmlDType::Q8_0);
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
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    /// Nanoseconds this thread has spent on a CPU (robust to other processes on the machine).
    fn thread_cpu_ns() -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid out-pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    /// Single-thread kernel throughput, in CPU time:
    /// `cargo test --release -p sequoia-shared --lib qmatmul::bench -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn kernel_throughput() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let shape = std::env::var("QSHAPE").unwrap_or_else(|_| "4096x1536".into());
        let (n, k) = shape
            .split_once('x')
            .map(|(a, b)| (a.parse().unwrap(), b.parse().unwrap()))
            .unwrap();
        let types = std::env::var("QTYPES").unwrap_or_else(|_| "Q4K,Q6K,Q5_0,Q8_0".into());
        for dtype in [
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q5_0,
            GgmlDType::Q8_0,
        ] {
            if !types.split(',').any(|t| t == format!("{dtype:?}")) {
                continue;
            }
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
            let qt = QTensor::quantize(&w, dtype).unwrap();
            let bytes = qt.data().unwrap();
            // QCOPIES > 1: cycle through copies so the weights stream from DRAM, as in a model.
            let copies: usize = std::env::var("QCOPIES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1);
            let kerns: Vec<_> = (0..copies)
                .map(|_| kernel_from_bytes(dtype, n, k, &bytes).unwrap())
                .collect();
            for m in [1usize, 4, 8, 16, 32] {
                let x = inputs(m, k);
                let mut y = vec![0f32; m * n];
                let mut i = 0;
                let mut next = || {
                    i += 1;
                    &kerns[i % kerns.len()]
                };
                let ns = pool.install(|| {
                    next().matmul(m, &x, &mut y);
                    // Best of several batches: other processes only ever add time.
                    (0..7)
                        .map(|_| {
                            let reps = 10;
                            let t = thread_cpu_ns();
                            for _ in 0..reps {
                                next().matmul(m, &x, &mut y);
                            }
                            (thread_cpu_ns() - t) as f64 / reps as f64
                        })
                        .fold(f64::INFINITY, f64::min)
                });
                let gmacs = (m * n * k) as f64 / ns;
                println!(
                    "{dtype:?} m={m:3}: {:8.3} ms  {gmacs:6.1} GMAC/s/core  {:6.3} ms/row",
                    ns / 1e6,
                    ns / 1e6 / m as f64
                );
            }
        }
    }

    fn inputs(m: usize, k: usize) -> Vec<f32> {
        Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }
}
