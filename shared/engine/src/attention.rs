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

use crate::vecmath::{exp_nonpositive, sum8};
use candle_core::{Result, Storage, Tensor};
use std::sync::OnceLock;

/// Fixed-order dot product: eight running sums (lane `l` takes elements `l, l + 8, ...`, each a
/// multiply then an add), combined in a fixed order.
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

/// [`dot`] of `q` with four keys at once, each result bit-identical to `dot(q, k)`: the four
/// accumulations are independent chains, so they hide each other's add latency (one chain alone
/// waits on every add). `wide`: the CPU has AVX-512 F ([`crate::qkernels::Isa::has_avx512`]).
#[inline]
fn dot4(q: &[f32], k: [&[f32]; 4], wide: bool) -> [f32; 4] {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = wide;
    #[cfg(target_arch = "x86_64")]
    if q.len().is_multiple_of(8) && k.iter().all(|k| k.len() == q.len()) && wide {
        // SAFETY: `wide` only where the CPU has AVX-512 F (caller); lengths checked.
        return unsafe { dot4_avx512(q, k) };
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if q.len().is_multiple_of(8) && k.iter().all(|k| k.len() == q.len()) {
        use std::arch::x86_64::*;
        // SAFETY: AVX2 is enabled at compile time; every load reads 8 floats inside `q` or a
        // key of the same length.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            for c in (0..q.len()).step_by(8) {
                let x = _mm256_loadu_ps(q.as_ptr().add(c));
                for (a, k) in acc.iter_mut().zip(&k) {
                    let y = _mm256_loadu_ps(k.as_ptr().add(c));
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(x, y));
                }
            }
            return acc.map(|a| {
                let mut l = [0f32; 8];
                _mm256_storeu_ps(l.as_mut_ptr(), a);
                // Same combination as `dot` (its tail is empty here: 0 + x = x exactly).
                ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7])) + 0.0
            });
        }
    }
    k.map(|k| dot(q, k))
}

/// [`dot4`] on 512-bit vectors, the same bits: each register holds two keys' eight running
/// sums (one key per 256-bit half, the query's eight values in both), and the sums combine in
/// registers in [`dot`]'s order: `(l0 + l4, l1 + l5, l2 + l6, l3 + l7)` by swapping 128-bit
/// halves, then the first two and the last two of those, then the two results.
///
/// # Safety
/// The CPU has AVX-512 F; `q` is a multiple of 8 long and every key as long as `q`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot4_avx512(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    // SAFETY: every load reads 8 floats inside `q` or a key of the same length (caller).
    unsafe {
        let mut acc = [_mm512_setzero_ps(); 2];
        for c in (0..q.len()).step_by(8) {
            // (The f32x8 forms of the broadcast and insert are AVX-512 DQ; the f64x4 ones
            // move the same bits and need only F.)
            let x = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(
                q.as_ptr().add(c),
            ))));
            for (p, a) in acc.iter_mut().enumerate() {
                let lo = _mm256_loadu_ps(k[2 * p].as_ptr().add(c));
                let hi = _mm256_loadu_ps(k[2 * p + 1].as_ptr().add(c));
                let y = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                    _mm512_castps_pd(_mm512_castps256_ps512(lo)),
                    _mm256_castps_pd(hi),
                ));
                // A multiply, then an add (not fused), as in `dot`.
                *a = _mm512_add_ps(*a, _mm512_mul_ps(x, y));
            }
        }
        let mut out = [0f32; 4];
        for (p, a) in acc.iter().enumerate() {
            // Lanes 0–3 of each half: l0 + l4, l1 + l5, l2 + l6, l3 + l7.
            let t = _mm512_add_ps(*a, _mm512_shuffle_f32x4::<0b10_11_00_01>(*a, *a));
            // Lanes 0 and 2: (l0 + l4) + (l1 + l5) and (l2 + l6) + (l3 + l7).
            let u = _mm512_add_ps(t, _mm512_movehdup_ps(t));
            // Lane 0: their sum; then `dot`'s empty tail (0 + x, which turns −0 into +0).
            let v = _mm512_add_ps(u, _mm512_permute_ps::<0b10>(u));
            let v = _mm512_add_ps(v, _mm512_setzero_ps());
            let mut l = [0f32; 16];
            _mm512_storeu_ps(l.as_mut_ptr(), v);
            out[2 * p] = l[0];
            out[2 * p + 1] = l[8];
        }
        out
    }
}

/// `o += w_j · v_j` for each `(w_j, v_j)` in order: per element of `o` the same sequence of
/// multiply-then-add as a plain loop, with `o` held in registers across the rows.
///
/// Each element's sequence does not depend on the vector width, so the 512-bit path (where the
/// kernels run AVX-512: [`crate::qkernels::isa`]) gives the same bits with half the
/// instructions; at long contexts this pass is about half of a tree forward's attention.
/// `wide`: the CPU has AVX-512 F ([`crate::qkernels::Isa::has_avx512`]).
#[inline]
fn axpy_rows<'v>(o: &mut [f32], rows: impl Iterator<Item = (f32, &'v [f32])> + Clone, wide: bool) {
    #[cfg(target_arch = "x86_64")]
    if o.len().is_multiple_of(128) && wide {
        // SAFETY: `wide` only where the CPU has AVX-512 F (caller).
        unsafe { axpy_rows_avx512(o, rows) };
        return;
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if o.len().is_multiple_of(64) {
        use std::arch::x86_64::*;
        for c0 in (0..o.len()).step_by(64) {
            // SAFETY: AVX2 is enabled at compile time; loads and stores cover `o[c0..c0 + 64]`
            // and the same range of each value row (asserted to be as long as `o`).
            unsafe {
                let mut acc: [__m256; 8] =
                    std::array::from_fn(|i| _mm256_loadu_ps(o.as_ptr().add(c0 + 8 * i)));
                for (w, v) in rows.clone() {
                    assert_eq!(v.len(), o.len());
                    let wv = _mm256_set1_ps(w);
                    for (i, a) in acc.iter_mut().enumerate() {
                        let x = _mm256_loadu_ps(v.as_ptr().add(c0 + 8 * i));
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, x));
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(o.as_mut_ptr().add(c0 + 8 * i), *a);
                }
            }
        }
        return;
    }
    for (w, v) in rows {
        for (o, &x) in o.iter_mut().zip(v) {
            *o += w * x;
        }
    }
}

/// [`axpy_rows`] on 512-bit vectors: `o` (a multiple of 128 floats) 128 at a time in eight
/// registers.
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_rows_avx512<'v>(
    o: &mut [f32],
    rows: impl Iterator<Item = (f32, &'v [f32])> + Clone,
) {
    use std::arch::x86_64::*;
    for c0 in (0..o.len()).step_by(128) {
        // SAFETY: loads and stores cover `o[c0..c0 + 128]` and the same range of each value row
        // (asserted to be as long as `o`).
        unsafe {
            let mut acc: [__m512; 8] =
                std::array::from_fn(|i| _mm512_loadu_ps(o.as_ptr().add(c0 + 16 * i)));
            for (w, v) in rows.clone() {
                assert_eq!(v.len(), o.len());
                let wv = _mm512_set1_ps(w);
                for (i, a) in acc.iter_mut().enumerate() {
                    let x = _mm512_loadu_ps(v.as_ptr().add(c0 + 16 * i));
                    // A multiply, then an add (not fused), as in the plain loop.
                    *a = _mm512_add_ps(*a, _mm512_mul_ps(wv, x));
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(o.as_mut_ptr().add(c0 + 16 * i), *a);
            }
        }
    }
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
/// in L1 while each key row is reused by all of them. Every tile reads the group's whole K and
/// V, so at long contexts the tile count sets the memory traffic: 16 rows of a GQA group of 6
/// heads are 96 queries, 6 tiles of 16 against 2 of 48 (1.5B target, 4,096 tokens of context:
/// t(16) 9 % faster with the 512-bit passes below; BENCHMARKS.md, session 32).
const QUERY_TILE: usize = 48;
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
    let slots: Vec<OnceLock<Vec<f32>>> = (0..kv_heads * tiles).map(|_| OnceLock::new()).collect();
    with_f32(q, |q| {
        with_f32(k, |k| {
            with_f32(v, |v| {
                crate::parallel::for_each(kv_heads * tiles, |task| {
                    let (g, tile) = (task / tiles, task % tiles);
                    let range = tile * QUERY_TILE..((tile + 1) * QUERY_TILE).min(queries);
                    let keys = &k[g * cap * d..g * cap * d + len * d];
                    let vals = &v[g * cap * d..g * cap * d + len * d];
                    let o = attend_tile(q, keys, vals, visible, g, range, group, heads, d, len);
                    let _ = slots[task].set(o);
                })
            })
        })
    })???;
    let outs: Vec<Vec<f32>> = slots
        .into_iter()
        .map(|s| s.into_inner().unwrap_or_default())
        .collect();
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
/// `vals` (`len × d` each).
///
/// Each query's scores are **compacted** to the keys it sees, in key order: the shared dense
/// prefix, then its visible new tokens. For a tree node that is the committed prefix followed
/// by its ancestors and itself, exactly the cache a sequential decode of the same token reads,
/// in the same order, so every reduction below (max, the sum of exponentials, the weighted sum
/// of values) sees the same terms in the same positions and gives the same bits, whatever the
/// tile or the forward holds.
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
    let scale = 1.0 / (d as f32).sqrt();
    // Read once per tile, not per key: the 512-bit passes where the kernels run AVX-512.
    let wide = crate::qkernels::isa().has_avx512();
    let dense = visible.map_or(len, |v| v.dense.min(len));
    // Per query: its row, its vector, and the new tokens (after `dense`) it sees.
    let qs: Vec<(usize, &[f32], Vec<usize>)> = range
        .map(|qi| {
            let (i, h) = (qi / group, g * group + qi % group);
            let sparse = match visible {
                Some(vis) => (dense..len).filter(|&j| vis.sees(i, j)).collect(),
                None => Vec::new(),
            };
            (i, &q[(i * heads + h) * d..(i * heads + h + 1) * d], sparse)
        })
        .collect();
    let widths: Vec<usize> = qs.iter().map(|(_, _, sp)| dense + sp.len()).collect();
    let offsets: Vec<usize> = widths
        .iter()
        .scan(0, |o, &w| {
            let start = *o;
            *o += w;
            Some(start)
        })
        .collect();
    let mut scores = vec![0f32; widths.iter().sum()];
    // Scores of the shared prefix: each block of key rows is read once for the whole tile.
    for j0 in (0..dense).step_by(KEY_BLOCK) {
        let j1 = (j0 + KEY_BLOCK).min(dense);
        for (t, (_, qv, _)) in qs.iter().enumerate() {
            let s = &mut scores[offsets[t]..offsets[t] + dense];
            let key = |j: usize| &keys[j * d..(j + 1) * d];
            let mut j = j0;
            while j + 4 <= j1 {
                let dots = dot4(qv, [key(j), key(j + 1), key(j + 2), key(j + 3)], wide);
                for (x, v) in s[j..j + 4].iter_mut().zip(dots) {
                    *x = v * scale;
                }
                j += 4;
            }
            for j in j..j1 {
                s[j] = dot(qv, key(j)) * scale;
            }
        }
    }
    for (t, (_, qv, sparse)) in qs.iter().enumerate() {
        let s = &mut scores[offsets[t] + dense..offsets[t] + widths[t]];
        for (x, &j) in s.iter_mut().zip(sparse) {
            *x = dot(qv, &keys[j * d..(j + 1) * d]) * scale;
        }
    }
    // Softmax of each query's compacted scores.
    for (t, &w) in widths.iter().enumerate() {
        let s = &mut scores[offsets[t]..offsets[t] + w];
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        for x in s.iter_mut() {
            *x = exp_nonpositive(*x - max);
        }
        let inv = 1.0 / sum8(s);
        for x in s.iter_mut() {
            *x *= inv;
        }
    }
    // Weighted sums of values, in key order: the shared prefix blockwise, then each query's own.
    let mut out = vec![0f32; qs.len() * d];
    for j0 in (0..dense).step_by(KEY_BLOCK) {
        let j1 = (j0 + KEY_BLOCK).min(dense);
        for (t, o) in out.chunks_exact_mut(d).enumerate() {
            let p = &scores[offsets[t]..offsets[t] + dense];
            axpy_rows(o, (j0..j1).map(|j| (p[j], &vals[j * d..(j + 1) * d])), wide);
        }
    }
    for (t, o) in out.chunks_exact_mut(d).enumerate() {
        let p = &scores[offsets[t] + dense..offsets[t] + widths[t]];
        axpy_rows(
            o,
            p.iter()
                .zip(&qs[t].2)
                .map(|(&w, &j)| (w, &vals[j * d..(j + 1) * d])),
            wide,
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The reference: one (row, head) at a time, over the keys its additive mask lets it see,
    /// gathered in key order (what a sequential decode's cache holds).
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
                let seen: Vec<usize> = (0..len)
                    .filter(|&j| mask[i * len + j] != f32::NEG_INFINITY)
                    .collect();
                let key = |j: usize| &k[(g * cap + j) * d..(g * cap + j + 1) * d];
                let mut s: Vec<f32> = seen.iter().map(|&j| dot(qv, key(j)) * scale).collect();
                let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                for x in s.iter_mut() {
                    *x = exp_nonpositive(*x - max);
                }
                let inv = 1.0 / sum8(&s);
                let o = &mut out[(i * h + hh) * d..(i * h + hh + 1) * d];
                for (&p, &j) in s.iter().zip(&seen) {
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

    /// The 512-bit four-key dot product gives [`dot`]'s bits for each key, at head sizes of
    /// 8 to 256 and values of every magnitude (so a fused multiply-add or a sum combined in
    /// another order would show).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn dot4_avx512_equals_dot() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("dot4_avx512_equals_dot: not run, this CPU lacks AVX-512 F");
            return;
        }
        let scaled = |len: usize, seed: u64| -> Vec<f32> {
            rand(len, seed)
                .iter()
                .enumerate()
                .map(|(i, x)| x * 10f32.powi((i as i32 * 7 + seed as i32) % 11 - 5))
                .collect()
        };
        for d in [8, 16, 64, 128, 256] {
            for trial in 0..20u64 {
                let q = scaled(d, 100 + trial);
                let ks: Vec<Vec<f32>> = (0..4).map(|i| scaled(d, 7 * trial + i + 1)).collect();
                let k = [&ks[0][..], &ks[1][..], &ks[2][..], &ks[3][..]];
                // SAFETY: checked above; lengths equal and a multiple of 8.
                let got = unsafe { dot4_avx512(&q, k) };
                for (i, kv) in k.iter().enumerate() {
                    assert_eq!(
                        got[i].to_bits(),
                        dot(&q, kv).to_bits(),
                        "d = {d}, trial {trial}, key {i}"
                    );
                }
            }
        }
    }

    /// The 512-bit weighted sum of values gives the plain loop's bits, element by element,
    /// for 1 to 40 rows of 128 and 256 floats (weights and values of every magnitude, so a
    /// fused multiply-add or a reordered sum would show).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn axpy_rows_avx512_equals_the_plain_loop() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("axpy_rows_avx512_equals_the_plain_loop: not run, this CPU lacks AVX-512 F");
            return;
        }
        for d in [128, 256] {
            for rows in [1, 7, 40] {
                let w: Vec<f32> = rand(rows, 3 + rows as u64)
                    .iter()
                    .enumerate()
                    .map(|(i, x)| x * 10f32.powi(i as i32 % 7 - 3))
                    .collect();
                let v: Vec<f32> = rand(rows * d, 5 + d as u64)
                    .iter()
                    .enumerate()
                    .map(|(i, x)| x * 10f32.powi(i as i32 % 9 - 4))
                    .collect();
                let start = rand(d, 17);
                let it = (0..rows).map(|j| (w[j], &v[j * d..(j + 1) * d]));
                let mut want = start.clone();
                for (wj, vj) in it.clone() {
                    for (o, &x) in want.iter_mut().zip(vj) {
                        *o += wj * x;
                    }
                }
                let mut got = start.clone();
                // SAFETY: checked above.
                unsafe { axpy_rows_avx512(&mut got, it) };
                assert_eq!(
                    got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "d = {d}, {rows} rows"
                );
            }
        }
    }

    /// Tiles of shared key loads give every (row, head) exactly the single-query result, for
    /// trees, chains and whole-cache rows, across tile and key-block boundaries; and a row's
    /// output does not depend on the other rows of the call.
    #[test]
    fn tiled_attention_equals_one_query_at_a_time() {
        let (heads, kv_heads, cap) = (6, 2, 300);
        // d = 128 takes the vector paths of both passes, d = 20 the plain loops.
        for (n, prefix, d) in [
            (1, 0, 128),
            (1, 130, 20),
            (5, 70, 128),
            (23, 130, 128),
            (40, 3, 20),
        ] {
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
