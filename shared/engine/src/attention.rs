//! Batch-invariant attention for the CPU.
//!
//! Exactness at T = 0 means the service pair must pick the same token as plain decoding even at
//! near-ties in the target's logits, so a node's logits must not depend on how many other nodes
//! share its forward pass. A general matrix multiply blocks its work by the shape of the whole
//! batch, which changes the order of floating-point additions from one tree size to the next.
//! Here every (query row, head) is computed by the same fixed-order loops whatever the batch:
//! scores against every visible key in key order, a softmax, and the weighted sum of values in
//! key order.
//!
//! What is shared is only the *loading*: one task takes a KV head and a tile of the queries that
//! read it (every row × every query head of its GQA group), and walks the keys in blocks, so each
//! key and value row comes from memory once per tile instead of once per (row, head). At long
//! contexts that is most of the memory traffic of a forward.
//!
//! Visibility (the tree or causal mask) is a bitset over the new tokens ([`Visibility`]), never
//! an `n × (prefix + n)` float matrix.

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
pub(crate) fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
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

/// Which cache entries each new row of a segment sees: every entry before `dense`, and entry
/// `dense + t` exactly when bit `t` of the row's bitset is set (`span` such entries follow
/// `dense`; `dense + span` is the segment's live length).
///
/// A tree after a committed prefix: `dense` = the prefix, bit `t` = node `t` is an ancestor of
/// the row's node or the node itself. A chain: causal bits. A forest grown across several
/// forwards: `dense` is where the forest starts, and the bits cover its nodes already cached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Visibility {
    dense: usize,
    span: usize,
    words: usize,
    bits: Vec<u64>,
}

impl Visibility {
    /// `rows` rows that see the first `dense` entries and none of the `span` after them yet.
    pub(crate) fn new(rows: usize, dense: usize, span: usize) -> Self {
        let words = span.div_ceil(64);
        Visibility {
            dense,
            span,
            words,
            bits: vec![0; rows * words],
        }
    }

    /// Causal visibility of `n` chained tokens after `prefix` entries.
    pub(crate) fn causal(n: usize, prefix: usize) -> Self {
        let mut v = Visibility::new(n, prefix, n);
        for i in 0..n {
            for t in 0..=i {
                v.set(i, t);
            }
        }
        v
    }

    /// Let `row` see entry `dense + t`.
    pub(crate) fn set(&mut self, row: usize, t: usize) {
        assert!(
            t < self.span,
            "visibility bit {t} out of span {}",
            self.span
        );
        self.bits[row * self.words + t / 64] |= 1 << (t % 64);
    }

    /// Whether `row` sees entry `j`.
    #[inline]
    pub(crate) fn sees(&self, row: usize, j: usize) -> bool {
        match j.checked_sub(self.dense) {
            None => true,
            Some(t) => t < self.span && self.bits[row * self.words + t / 64] >> (t % 64) & 1 == 1,
        }
    }

    /// Live length this visibility describes (`dense + span`).
    pub(crate) fn len(&self) -> usize {
        self.dense + self.span
    }

    /// The additive `rows × len` mask (0 where seen, −∞ elsewhere) for candle's attention ops.
    pub(crate) fn additive(&self, rows: usize) -> Vec<f32> {
        let len = self.len();
        let mut m = vec![f32::NEG_INFINITY; rows * len];
        for (r, row) in m.chunks_exact_mut(len).enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                if self.sees(r, j) {
                    *v = 0.0;
                }
            }
        }
        m
    }
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

/// Queries (row × head pairs of one KV group) per task: their scores for a block of keys stay
/// in L1 while each key row is reused by all of them.
const QUERY_TILE: usize = 16;
/// Keys per block of the score and value passes (a block of K or V rows stays in L1/L2 while
/// every query of the tile reads it).
const KEY_BLOCK: usize = 64;

/// `q`: (n, heads, d) contiguous, already rotated; `k`, `v`: full cache tensors
/// (kv_heads, cap, d); `visible`: which entries each row sees (`None`: all of them, as for a
/// single new token). Returns (n, heads · d).
pub(crate) fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    visible: Option<&Visibility>,
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
    if let Some(vis) = visible {
        if vis.len() != len {
            candle_core::bail!("attention: visibility of {} entries for {len}", vis.len());
        }
    }
    let group = heads / kv_heads;
    let queries = n * group;
    let tiles = queries.div_ceil(QUERY_TILE);
    let outs: Vec<Vec<f32>> = with_f32(q, |q| {
        with_f32(k, |k| {
            with_f32(v, |v| {
                (0..kv_heads * tiles)
                    .into_par_iter()
                    .map(|task| {
                        let (g, tile) = (task / tiles, task % tiles);
                        let range = tile * QUERY_TILE..((tile + 1) * QUERY_TILE).min(queries);
                        let keys = &k[g * cap * d..g * cap * d + len * d];
                        let vals = &v[g * cap * d..g * cap * d + len * d];
                        attend_tile(q, keys, vals, visible, g, range, group, heads, d, len)
                    })
                    .collect()
            })
        })
    })???;
    // Scatter each tile's (row, head) outputs into (n, heads · d).
    let mut out = vec![0f32; n * heads * d];
    for (task, o) in outs.iter().enumerate() {
        let (g, tile) = (task / tiles, task % tiles);
        for (t, qi) in (tile * QUERY_TILE..((tile + 1) * QUERY_TILE).min(queries)).enumerate() {
            let (i, h) = (qi / group, g * group + qi % group);
            out[(i * heads + h) * d..(i * heads + h + 1) * d]
                .copy_from_slice(&o[t * d..(t + 1) * d]);
        }
    }
    Ok(out)
}

/// The queries `range` (index `row · group + head-in-group`) of KV head `g`, over `keys` and
/// `vals` (`len × d` each). Per query the arithmetic is the same whatever the tile holds:
/// scores in key order, max, exponentials and their sum in key order, then the weighted sum
/// of values in key order.
#[allow(clippy::too_many_arguments)]
fn attend_tile(
    q: &[f32],
    keys: &[f32],
    vals: &[f32],
    visible: Option<&Visibility>,
    g: usize,
    range: std::ops::Range<usize>,
    group: usize,
    heads: usize,
    d: usize,
    len: usize,
) -> Vec<f32> {
    let tq = range.len();
    let scale = 1.0 / (d as f32).sqrt();
    // (row, query vector) of each query of the tile.
    let qs: Vec<(usize, &[f32])> = range
        .map(|qi| {
            let (i, h) = (qi / group, g * group + qi % group);
            (i, &q[(i * heads + h) * d..(i * heads + h + 1) * d])
        })
        .collect();
    let mut scores = vec![f32::NEG_INFINITY; tq * len];
    for j0 in (0..len).step_by(KEY_BLOCK) {
        let j1 = (j0 + KEY_BLOCK).min(len);
        for (t, &(i, qv)) in qs.iter().enumerate() {
            let s = &mut scores[t * len..(t + 1) * len];
            for j in j0..j1 {
                if visible.is_none_or(|vis| vis.sees(i, j)) {
                    s[j] = dot(qv, &keys[j * d..(j + 1) * d]) * scale;
                }
            }
        }
    }
    for s in scores.chunks_exact_mut(len) {
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0f32;
        for x in s.iter_mut() {
            *x = if *x == f32::NEG_INFINITY {
                0.0
            } else {
                (*x - max).exp()
            };
            sum += *x;
        }
        let inv = 1.0 / sum;
        for x in s.iter_mut() {
            *x *= inv;
        }
    }
    let mut out = vec![0f32; tq * d];
    for j0 in (0..len).step_by(KEY_BLOCK) {
        let j1 = (j0 + KEY_BLOCK).min(len);
        for (t, o) in out.chunks_exact_mut(d).enumerate() {
            let p = &scores[t * len..(t + 1) * len];
            for j in j0..j1 {
                let w = p[j];
                if w != 0.0 {
                    for (o, &x) in o.iter_mut().zip(&vals[j * d..(j + 1) * d]) {
                        *o += w * x;
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The reference: one (row, head) at a time over an additive mask.
    fn naive(q: &[f32], k: &[f32], v: &[f32], mask: &[f32], dims: &Dims) -> Vec<f32> {
        let (n, h, kvh, d, len, cap) = (
            dims.n,
            dims.heads,
            dims.kv_heads,
            dims.head_dim,
            dims.len,
            dims.cap,
        );
        let group = h / kvh;
        let scale = 1.0 / (d as f32).sqrt();
        let mut out = vec![0f32; n * h * d];
        for i in 0..n {
            for hh in 0..h {
                let g = hh / group;
                let qv = &q[(i * h + hh) * d..(i * h + hh + 1) * d];
                let mut s: Vec<f32> = (0..len)
                    .map(|j| {
                        if mask[i * len + j] == f32::NEG_INFINITY {
                            f32::NEG_INFINITY
                        } else {
                            dot(qv, &k[(g * cap + j) * d..(g * cap + j + 1) * d]) * scale
                        }
                    })
                    .collect();
                let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                let mut sum = 0f32;
                for x in s.iter_mut() {
                    *x = if *x == f32::NEG_INFINITY {
                        0.0
                    } else {
                        (*x - max).exp()
                    };
                    sum += *x;
                }
                let inv = 1.0 / sum;
                let o = &mut out[(i * h + hh) * d..(i * h + hh + 1) * d];
                for (j, &p) in s.iter().enumerate() {
                    if p != 0.0 {
                        let w = p * inv;
                        for (o, &x) in o
                            .iter_mut()
                            .zip(&v[(g * cap + j) * d..(g * cap + j + 1) * d])
                        {
                            *o += w * x;
                        }
                    }
                }
            }
        }
        out
    }

    fn rand(len: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2001) as f32 / 500.0 - 2.0
            })
            .collect()
    }

    /// Tiles of shared key loads give every (row, head) exactly the single-query result, for
    /// trees, chains and whole-cache rows, across tile and key-block boundaries; and a row's
    /// output does not depend on the other rows of the call.
    #[test]
    fn tiled_attention_equals_one_query_at_a_time() {
        let (heads, kv_heads, d, cap) = (6, 2, 16, 300);
        for (n, prefix) in [(1, 0), (1, 130), (5, 70), (23, 130), (40, 3)] {
            let len = prefix + n;
            let dims = Dims {
                n,
                heads,
                kv_heads,
                head_dim: d,
                len,
                cap,
            };
            let dev = Device::Cpu;
            let q = rand(n * heads * d, n as u64);
            let k = rand(kv_heads * cap * d, 7);
            let v = rand(kv_heads * cap * d, 11);
            // A tree: node i's parent is (i - 1) / 2.
            let mut vis = Visibility::new(n, prefix, n);
            for i in 0..n {
                let mut a = i as i64;
                while a >= 0 {
                    vis.set(i, a as usize);
                    a = if a == 0 { -1 } else { (a - 1) / 2 };
                }
            }
            let tq = Tensor::from_vec(q.clone(), (n, heads, d), &dev).unwrap();
            let tk = Tensor::from_vec(k.clone(), (kv_heads, cap, d), &dev).unwrap();
            let tv = Tensor::from_vec(v.clone(), (kv_heads, cap, d), &dev).unwrap();
            for vis in [Some(vis), Some(Visibility::causal(n, prefix)), None] {
                let got = attend(&tq, &tk, &tv, vis.as_ref(), &dims).unwrap();
                let mask = match &vis {
                    Some(vis) => vis.additive(n),
                    None => vec![0.0; n * len],
                };
                let want = naive(&q, &k, &v, &mask, &dims);
                assert_eq!(
                    got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "n = {n}, prefix = {prefix}, {vis:?}"
                );
            }
        }
    }

    #[test]
    fn visibility_bits() {
        let mut v = Visibility::new(2, 3, 70);
        v.set(1, 69);
        v.set(0, 0);
        assert!(v.sees(0, 2) && v.sees(1, 2));
        assert!(v.sees(0, 3) && !v.sees(1, 3));
        assert!(v.sees(1, 72) && !v.sees(0, 72));
        assert!(!v.sees(0, 73));
        assert_eq!(v.len(), 73);
        let c = Visibility::causal(3, 1);
        assert_eq!(
            c.additive(3),
            vec![
                0.0,
                0.0,
                f32::NEG_INFINITY,
                f32::NEG_INFINITY,
                0.0,
                0.0,
                0.0,
                f32::NEG_INFINITY,
                0.0,
                0.0,
                0.0,
                0.0
            ]
        );
    }
}
