//! CPU matrix multiply against GGUF-quantized weights.
//!
//! candle's own `QMatMul` on the CPU loops over the input rows outside and the weight rows
//! inside, so every input row streams the whole (hundreds of MB) weight matrix from memory: a
//! 16-node tree costs about as much as 16 single-token decodes. Tree verification lives on
//! batches of 8..128 rows, so this kernel swaps the loops: each weight row is loaded once (into
//! L1) and dotted with every input row (tiled so a tile of quantized inputs stays in L2). The dot
//! products themselves are candle's SIMD `vec_dot` kernels (AVX2 on x86-64-v3), with the input
//! rows quantized once per call to the weight type's dot-product format (Q8_K / Q8_0 / Q8_1),
//! exactly like ggml.
//!
//! The weights are kept as typed block vectors (`Vec<BlockQ4K>`, ...) owned by the kernel, and
//! the token embedding reuses them: [`QKernel::dequantize_row`] expands only the rows a step
//! looks up, instead of a full f32 copy of a 150k-token embedding table.

use std::sync::Arc;

use candle_core::quantized::{k_quants, GgmlDType, GgmlType};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape};
use rayon::prelude::*;

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

/// Input rows per tile: keep a tile of quantized inputs within ~256 KiB (L2).
fn row_tile(bytes_per_row: usize) -> usize {
    (256 * 1024 / bytes_per_row.max(1)).clamp(1, 64)
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
        debug_assert_eq!(lhs.len(), m * k);
        debug_assert_eq!(dst.len(), m * n);
        let kb = k / T::BLCK_SIZE;
        // Quantize the inputs once into the weight type's dot-product format.
        let mut q = vec![T::VecDotType::zeros(); m * kb];
        q.par_chunks_mut(kb)
            .zip(lhs.par_chunks(k))
            .for_each(|(qr, xr)| T::VecDotType::from_float(xr, qr));
        let w = &self.blocks;
        let chunk = column_chunk(n);
        if m == 1 {
            dst.par_chunks_mut(chunk).enumerate().for_each(|(ci, out)| {
                let c0 = ci * chunk;
                for (j, o) in out.iter_mut().enumerate() {
                    let c = c0 + j;
                    *o = T::vec_dot(k, &w[c * kb..(c + 1) * kb], &q);
                }
            });
            return;
        }
        // Column-major scratch (`tmp[c * m + r]`) so each task owns a contiguous slice.
        let tile = row_tile(kb * std::mem::size_of::<T::VecDotType>());
        let mut tmp = vec![0f32; n * m];
        tmp.par_chunks_mut(chunk * m)
            .enumerate()
            .for_each(|(ci, out)| {
                let c0 = ci * chunk;
                let cols = out.len() / m;
                for r0 in (0..m).step_by(tile) {
                    let r1 = (r0 + tile).min(m);
                    for j in 0..cols {
                        let c = c0 + j;
                        let wc = &w[c * kb..(c + 1) * kb];
                        let o = &mut out[j * m..(j + 1) * m];
                        for r in r0..r1 {
                            o[r] = T::vec_dot(k, wc, &q[r * kb..(r + 1) * kb]);
                        }
                    }
                }
            });
        for (c, col) in tmp.chunks_exact(m).enumerate() {
            for (r, v) in col.iter().enumerate() {
                dst[r * n + c] = *v;
            }
        }
    }

    fn dequantize_row(&self, row: usize, dst: &mut [f32]) {
        let kb = self.k / T::BLCK_SIZE;
        T::to_float(&self.blocks[row * kb..(row + 1) * kb], dst);
    }
}

/// Copy raw GGUF block bytes into a typed block vector.
fn blocks_from_bytes<T: GgmlType>(bytes: &[u8]) -> Result<Vec<T>, EngineError> {
    let size = std::mem::size_of::<T>();
    if bytes.len() % size != 0 {
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
    if k % T::BLCK_SIZE != 0 {
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
        GgmlDType::Q5_0 => typed::<BlockQ5_0>(n, k, bytes),
        GgmlDType::Q5_1 => typed::<BlockQ5_1>(n, k, bytes),
        GgmlDType::Q8_0 => typed::<BlockQ8_0>(n, k, bytes),
        GgmlDType::Q8_1 => typed::<BlockQ8_1>(n, k, bytes),
        GgmlDType::Q2K => typed::<BlockQ2K>(n, k, bytes),
        GgmlDType::Q3K => typed::<BlockQ3K>(n, k, bytes),
        GgmlDType::Q4K => typed::<BlockQ4K>(n, k, bytes),
        GgmlDType::Q5K => typed::<BlockQ5K>(n, k, bytes),
        GgmlDType::Q6K => typed::<BlockQ6K>(n, k, bytes),
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

    /// Our kernel must give exactly what candle's reference quantized matmul gives.
    #[test]
    fn matches_candle_qmatmul() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for dtype in [
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q8_0,
            GgmlDType::Q4_1,
        ] {
            let (n, k) = (96, 512);
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
            let qt = QTensor::quantize(&w, dtype)?;
            let bytes = qt.data()?.to_vec();
            let kern = kernel_from_bytes(dtype, n, k, &bytes).unwrap();
            let reference = candle_core::quantized::QMatMul::from_qtensor(qt)?;
            for m in [1usize, 3, 17] {
                let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
                let want = candle_core::Module::forward(&reference, &x)?;
                let got = x.apply_op1_no_bwd(&QMatMulOp(kern.as_ref()))?;
                let diff = (want - got)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(diff < 1e-4, "{dtype:?} m={m}: diff {diff}");
            }
            let mut row = vec![0f32; k];
            kern.dequantize_row(5, &mut row);
            let deq = QTensor::quantize(&w, dtype)?.dequantize(&dev)?;
            let want: Vec<f32> = deq.get(5)?.to_vec1()?;
            assert_eq!(row, want);
        }
        Ok(())
    }
}
