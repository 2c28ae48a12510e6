//! Batch-invariant attention for the CPU.
//!
//! Exactness at T = 0 means the service pair must pick the same token as plain decoding even at
//! near-ties in the target's logits, so a node's logits must not depend on how many other nodes
//! share its forward pass. A general matrix multiply blocks its work by the shape of the whole
//! batch, which changes the order of floating-point additions from one tree size to the next.
//! Here every (query row, head) is computed by the same fixed-order loops whatever the batch:
//! scores against every visible key, a softmax, and the weighted sum of values.

use candle_core::{Result, Storage, Tensor};
use rayon::prelude::*;

/// Fixed-order dot product: eight running sums, combined in a fixed order.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Borrow a contiguous f32 CPU tensor's data (offset applied) and hand it to `f`.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("batch-invariant attention runs on the CPU only");
    };
    let data = cpu.as_slice::<f32>()?;
    if !layout.is_contiguous() {
        candle_core::bail!("batch-invariant attention needs contiguous inputs");
    }
    let start = layout.start_offset();
    Ok(f(&data[start..start + layout.shape().elem_count()]))
}

/// Shapes of one attention call.
pub(crate) struct Dims {
    pub n: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Live cache length (prefix + n).
    pub len: usize,
    /// Allocated rows per KV head in the cache tensors.
    pub cap: usize,
}

/// `q`: (n, heads, d) contiguous, already rotated; `k`, `v`: full cache tensors
/// (kv_heads, cap, d); `mask`: additive (n, len) or none. Returns (n, heads · d).
pub(crate) fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&[f32]>,
    dims: &Dims,
) -> Result<Vec<f32>> {
    let Dims {
        n,
        heads,
        kv_heads,
        head_dim: d,
        len,
        cap,
    } = *dims;
    let group = heads / kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; n * heads * d];
    with_f32(q, |q| {
        with_f32(k, |k| {
            with_f32(v, |v| {
                out.par_chunks_mut(d).enumerate().for_each(|(row_head, o)| {
                    let (i, h) = (row_head / heads, row_head % heads);
                    let g = h / group;
                    let qv = &q[(i * heads + h) * d..(i * heads + h + 1) * d];
                    let keys = &k[g * cap * d..];
                    let vals = &v[g * cap * d..];
                    let mut scores = vec![0f32; len];
                    let mut max = f32::NEG_INFINITY;
                    for (j, s) in scores.iter_mut().enumerate() {
                        let m = mask.map_or(0.0, |m| m[i * len + j]);
                        *s = if m == f32::NEG_INFINITY {
                            f32::NEG_INFINITY
                        } else {
                            dot(qv, &keys[j * d..(j + 1) * d]) * scale + m
                        };
                        max = max.max(*s);
                    }
                    let mut sum = 0f32;
                    for s in scores.iter_mut() {
                        *s = if *s == f32::NEG_INFINITY {
                            0.0
                        } else {
                            (*s - max).exp()
                        };
                        sum += *s;
                    }
                    let inv = 1.0 / sum;
                    for (j, &p) in scores.iter().enumerate() {
                        if p != 0.0 {
                            let w = p * inv;
                            for (o, &x) in o.iter_mut().zip(&vals[j * d..(j + 1) * d]) {
                                *o += w * x;
                            }
                        }
                    }
                });
            })
        })
    })???;
    Ok(out)
}
