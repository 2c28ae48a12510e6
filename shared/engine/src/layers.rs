//! The weight-holding building blocks the decoder is made of: projections ([`Linear`]) and the
//! token embedding ([`Embedding`]), each in the representation the device computes with.
//! `weights` builds them from files; `model` composes them into blocks.

use std::sync::Arc;

use candle_core::{Device, Module, Tensor};

use super::qmatmul::{QKernel, QMatMulOp};

/// A projection `y = x · Wᵀ`.
#[derive(Debug, Clone)]
pub(crate) enum Linear {
    /// Quantized weights on the CPU, multiplied by our row-batched kernel.
    CpuQuant(Arc<dyn QKernel>),
    /// Quantized weights on a GPU (candle's kernels).
    Quantized(candle_core::quantized::QMatMul),
    /// Dense weights `(out, in)` in the compute dtype.
    Dense(Tensor),
}

impl Linear {
    /// `x`: `(rows, in)` → `(rows, out)`.
    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Linear::CpuQuant(k) => x.apply_op1_no_bwd(&QMatMulOp(k.as_ref())),
            Linear::Quantized(q) => q.forward(x),
            Linear::Dense(w) => x.matmul(&w.t()?),
        }
    }

    pub(crate) fn out_features(&self) -> candle_core::Result<usize> {
        Ok(match self {
            Linear::CpuQuant(k) => k.out_features(),
            Linear::Quantized(q) => match q {
                candle_core::quantized::QMatMul::QTensor(t) => t.shape().dims2()?.0,
                candle_core::quantized::QMatMul::Tensor(t)
                | candle_core::quantized::QMatMul::TensorF16(t) => t.dims2()?.0,
            },
            Linear::Dense(w) => w.dims2()?.0,
        })
    }
}

/// Token embedding lookup.
#[derive(Debug, Clone)]
pub(crate) enum Embedding {
    /// Quantized table on the CPU: only the looked-up rows are expanded.
    CpuQuant(Arc<dyn QKernel>),
    /// Dense `(vocab, hidden)` table.
    Dense(Tensor),
}

impl Embedding {
    pub(crate) fn forward(&self, tokens: &[u32], device: &Device) -> candle_core::Result<Tensor> {
        match self {
            Embedding::CpuQuant(k) => {
                let h = k.in_features();
                let mut out = vec![0f32; tokens.len() * h];
                for (t, row) in tokens.iter().zip(out.chunks_exact_mut(h)) {
                    k.dequantize_row(*t as usize, row);
                }
                Tensor::from_vec(out, (tokens.len(), h), device)
            }
            Embedding::Dense(w) => {
                let ids = Tensor::new(tokens, device)?;
                w.index_select(&ids, 0)
            }
        }
    }
}
