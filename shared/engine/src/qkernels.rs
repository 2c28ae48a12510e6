//! Quantized dot-product kernels that serve several input rows per pass over a weight row.
//!
//! Why our own: candle's CPU kernels compute one (input row, weight row) dot product at a time,
//! re-decoding the weight block for every input row, and Q5_0 (the bulk of Qwen2.5-0.5B's
//! weights) has no SIMD path at all. Tree verification multiplies 8..128 rows by every matrix,
//! so here one weight block is decoded once (nibbles split, scales expanded) and then dotted with
//! up to [`ROW_TILE`] input rows while it sits in registers; the per-row work is just
//! `maddubs → madd(scale) → add` per 32 weights. The rows' integer sums are folded together
//! (`hadd`) before the one float multiply-add per block, so the per-block float work is shared
//! too. A row's result is bit-identical whatever the batch size and whichever rows share its
//! tile (one code path for every row count), so with the batch-invariant attention a tree node's
//! logits equal those of decoding it alone, bit for bit.
//!
//! Formats: the weight blocks are GGML's on-disk layouts (Q4_K, Q6_K, Q5_0, Q8_0), read as is.
//! Inputs are quantized per call to int8: per 256 values with 16-value sums ([`ActK`], for the
//! K-quants) or per 32 values ([`Act32`]), and stored as row tiles ([`TileBlock`]: the tile's
//! rows side by side per block, so a kernel reaches every row from one pointer). Integer
//! products are exact; each block's sum is scaled in f32.
//!
//! Every format has a portable scalar path with the same math (used when the CPU lacks
//! AVX2/FMA/F16C, and as the reference in tests).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;

/// Values per K-quant super-block.
pub(crate) const QK_K: usize = 256;

/// GGML Q4_K: 8 sub-blocks of 32 4-bit values with 6-bit scales and mins.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockQ4K {
    d: u16,
    dmin: u16,
    scales: [u8; 12],
    qs: [u8; 128],
}

/// GGML Q6_K: 16 sub-blocks of 16 6-bit values (low 4 bits in `ql`, high 2 in `qh`), i8 scales.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockQ6K {
    ql: [u8; 128],
    qh: [u8; 64],
    scales: [i8; 16],
    d: u16,
}

/// GGML Q5_0: 32 5-bit values (low nibbles in `qs`, fifth bits in `qh`), offset 16.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockQ5_0 {
    d: u16,
    qh: [u8; 4],
    qs: [u8; 16],
}

/// GGML Q8_0: 32 int8 values and a scale.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockQ8_0 {
    d: u16,
    qs: [i8; 32],
}

const _: () = {
    assert!(std::mem::size_of::<BlockQ4K>() == 144);
    assert!(std::mem::size_of::<BlockQ6K>() == 210);
    assert!(std::mem::size_of::<BlockQ5_0>() == 22);
    assert!(std::mem::size_of::<BlockQ8_0>() == 34);
};

/// 256 input values as int8 with one scale, plus the sums the K-quant offsets need.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActK {
    qs: [i8; 256],
    /// Σ qs over each 16 values (Q6_K's offset of 32).
    bsums16: [i16; 16],
    /// `d · Σ qs` over each 32 values (Q4_K's mins).
    dbs32: [f32; 8],
    d: f32,
}

/// 32 input values as int8 with one scale; `sum = Σ qs` (Q5_0's offset of 16 is applied in
/// integers, before any rounding: with the large activation outliers of Qwen-style models a
/// float offset would cancel catastrophically).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Act32 {
    qs: [i8; 32],
    d: f32,
    sum: i32,
}

/// Input rows per kernel call (a row tile).
pub(crate) const ROW_TILE: usize = 8;

/// One block position of a row tile: the input blocks of the tile's rows side by side, and
/// their scales (`d`) and Act32 sums (`s`) as vectors. Missing rows of a partial tile are zero.
#[repr(C, align(32))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileBlock<A> {
    a: [A; ROW_TILE],
    d: [f32; ROW_TILE],
    s: [i32; ROW_TILE],
}

/// Quantize the `m` rows of `x` (`m × k`, row-major) into row tiles: `kb` blocks per tile.
pub(crate) fn quantize_tiles<F: QFormat>(x: &[f32], m: usize, k: usize) -> Vec<TileBlock<F::Act>> {
    use rayon::prelude::*;
    assert_eq!(x.len(), m * k, "matmul input size");
    let kb = k / F::BLOCK;
    let zero = TileBlock {
        a: [F::act_zero(); ROW_TILE],
        d: [0.0; ROW_TILE],
        s: [0; ROW_TILE],
    };
    let mut tiles = vec![zero; m.div_ceil(ROW_TILE) * kb];
    let fill = |t: usize, tile: &mut [TileBlock<F::Act>]| {
        for i in 0..ROW_TILE.min(m - t * ROW_TILE) {
            let row = &x[(t * ROW_TILE + i) * k..][..k];
            for (tb, xb) in tile.iter_mut().zip(row.chunks_exact(F::BLOCK)) {
                let a = F::quantize_block(xb);
                (tb.d[i], tb.s[i]) = F::act_scales(&a);
                tb.a[i] = a;
            }
        }
    };
    if m > ROW_TILE {
        tiles
            .par_chunks_mut(kb)
            .enumerate()
            .for_each(|(t, tile)| fill(t, tile));
    } else {
        fill(0, &mut tiles);
    }
    tiles
}

#[inline]
fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Quantize `x` to int8 with a symmetric scale: returns `d` (values ≈ d · q).
#[inline]
fn quantize_i8(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || !amax.is_finite() {
        q.fill(0);
        return if amax.is_finite() { 0.0 } else { f32::NAN };
    }
    let id = 127.0 / amax;
    for (o, v) in q.iter_mut().zip(x) {
        *o = (v * id).round_ties_even() as i8;
    }
    amax / 127.0
}

/// A GGML weight block type with a multi-row kernel.
pub(crate) trait QFormat: Copy + Send + Sync + std::fmt::Debug + 'static {
    type Act: Copy + Send + Sync + std::fmt::Debug + 'static;
    /// Values per block.
    const BLOCK: usize;
    const NAME: &'static str;
    fn act_zero() -> Self::Act;
    /// Quantize one block of `BLOCK` input values.
    fn quantize_block(x: &[f32]) -> Self::Act;
    /// The (`d`, `s`) pair a [`TileBlock`] carries for one input block.
    fn act_scales(a: &Self::Act) -> (f32, i32);
    /// Expand `w` into `out` (`w.len() * BLOCK` values).
    fn dequantize(w: &[Self], out: &mut [f32]);
    /// Dot products of weight row `w` with the first `R` rows of a row tile (portable).
    fn dot_scalar<const R: usize>(w: &[Self], tile: &[TileBlock<Self::Act>]) -> [f32; R];
    /// The same with AVX2 (`R <= ROW_TILE`). A row's result does not depend on `R` or on the
    /// other rows, bit for bit.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2<const R: usize>(w: &[Self], tile: &[TileBlock<Self::Act>]) -> [f32; R];
}

fn quantize_k(x: &[f32]) -> ActK {
    let mut a = ActK {
        qs: [0; 256],
        bsums16: [0; 16],
        dbs32: [0.0; 8],
        d: 0.0,
    };
    a.d = quantize_i8(x, &mut a.qs);
    for (s, q) in a.bsums16.iter_mut().zip(a.qs.chunks_exact(16)) {
        *s = q.iter().map(|&v| v as i16).sum();
    }
    for i in 0..8 {
        a.dbs32[i] = a.d * (a.bsums16[2 * i] + a.bsums16[2 * i + 1]) as f32;
    }
    a
}

fn quantize_32(x: &[f32]) -> Act32 {
    let mut a = Act32 {
        qs: [0; 32],
        d: 0.0,
        sum: 0,
    };
    a.d = quantize_i8(x, &mut a.qs);
    a.sum = a.qs.iter().map(|&v| v as i32).sum();
    a
}

/// Q4_K's packed 6-bit (scale, min) for sub-block `j`.
#[inline]
fn q4k_scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// All eight Q4_K (scales, mins) at once, branch-free, as four little-endian words:
/// bytes `[s0..s7, m0..m7]`.
#[inline]
fn q4k_scales_mins_u32(q: &[u8; 12]) -> [u32; 4] {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let rd = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (u0, u1, u2) = (rd(0), rd(1), rd(2));
    let mins_hi = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let mins_lo = u1 & KMASK1;
    let sc_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let sc_lo = u0 & KMASK1;
    [sc_lo, sc_hi, mins_lo, mins_hi]
}

/// [`q4k_scales_mins_u32`] as bytes.
#[inline]
fn q4k_scales_mins(q: &[u8; 12]) -> [u8; 16] {
    let w = q4k_scales_mins_u32(q);
    let mut out = [0u8; 16];
    for (o, w) in out.chunks_exact_mut(4).zip(w) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn f16x1(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn hsum8(x: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Four rows' 8-lane i32 sums → `[r0 r1 r2 r3 | r0 r1 r2 r3]` partial sums as f32 (each
    /// row's lanes are added only among themselves, so a row's result ignores the others),
    /// minus `off[r] << shift` from the first half (exact integer offsets, if any).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn reduce4(s: [__m256i; 4], off: Option<(&[i32], i32)>) -> __m256 {
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
        let h = match off {
            Some((o, shift)) => {
                assert!(o.len() >= 4);
                // SAFETY: at least 16 readable bytes.
                let o = unsafe { _mm_loadu_si128(o.as_ptr() as *const __m128i) };
                let o = _mm_sll_epi32(o, _mm_cvtsi32_si128(shift));
                _mm256_sub_epi32(h, _mm256_zextsi128_si256(o))
            }
            None => h,
        };
        _mm256_cvtepi32_ps(h)
    }

    /// `[v0 v1 v2 v3 | v0 v1 v2 v3]` from `v[0..4]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn bcast4(v: &[f32; 4]) -> __m256 {
        // SAFETY: `v` is 16 readable bytes.
        unsafe { _mm256_broadcast_ps(&*(v.as_ptr() as *const __m128)) }
    }

    /// Fold rows `0..R` of `s` into the `[r0..r3 | r0..r3]`-style accumulators (rows 0..4 in
    /// `acc[0]`, 4..8 in `acc[1]`), minus the integer offsets `off[r] << shift` if given, and
    /// scaled by `d · dv[r]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn fold<const R: usize>(
        s: &[__m256i; 8],
        off: Option<(&[i32; 8], i32)>,
        d: f32,
        dv: &[f32; 8],
        acc: &mut [__m256; 2],
    ) {
        let d = _mm256_set1_ps(d);
        let (lo, hi) = dv.split_at(4);
        let lo: &[f32; 4] = lo.try_into().expect("4");
        let hi: &[f32; 4] = hi.try_into().expect("4");
        let scale = _mm256_mul_ps(d, bcast4(lo));
        let o = off.map(|(o, sh)| (&o[0..4], sh));
        acc[0] = _mm256_fmadd_ps(reduce4([s[0], s[1], s[2], s[3]], o), scale, acc[0]);
        if R > 4 {
            let scale = _mm256_mul_ps(d, bcast4(hi));
            let o = off.map(|(o, sh)| (&o[4..8], sh));
            acc[1] = _mm256_fmadd_ps(reduce4([s[4], s[5], s[6], s[7]], o), scale, acc[1]);
        }
    }

    /// Per-row results of the accumulators of [`fold`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn rows<const R: usize>(acc: &[__m256; 2]) -> [f32; R] {
        let mut all = [0f32; 8];
        for (h, a) in acc.iter().enumerate() {
            let s = _mm_add_ps(_mm256_extractf128_ps(*a, 1), _mm256_castps256_ps128(*a));
            // SAFETY: 16 writable bytes at 4h.
            unsafe { _mm_storeu_ps(all.as_mut_ptr().add(4 * h), s) };
        }
        std::array::from_fn(|r| all[r])
    }

    /// Unaligned 32-byte load.
    ///
    /// # Safety
    /// `p` must point to 32 readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn load32<T>(p: *const T) -> __m256i {
        unsafe { _mm256_loadu_si256(p as *const __m256i) }
    }

    /// 32 nibbles of 16 bytes: low nibbles then high nibbles.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn nibbles32(p: &[u8; 16]) -> __m256i {
        // SAFETY: 16 readable bytes.
        let t = unsafe { _mm_loadu_si128(p.as_ptr() as *const __m128i) };
        let b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
        _mm256_and_si256(b, _mm256_set1_epi8(0x0F))
    }

    /// Byte `e` = 0xFF if bit `e` of `bits` is set, else 0.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn bits32(bits: u32) -> __m256i {
        let t = _mm256_set1_epi32(bits as i32);
        let shuf = _mm256_setr_epi64x(
            0x0000_0000_0000_0000,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        );
        let b = _mm256_shuffle_epi8(t, shuf);
        let mask = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64);
        _mm256_cmpeq_epi8(_mm256_or_si256(b, mask), _mm256_set1_epi64x(-1))
    }
}

const KZERO: ActK = ActK {
    qs: [0; 256],
    bsums16: [0; 16],
    dbs32: [0.0; 8],
    d: 0.0,
};

const ZERO32: Act32 = Act32 {
    qs: [0; 32],
    d: 0.0,
    sum: 0,
};

#[allow(clippy::needless_range_loop)] // rows indexed in lockstep across arrays
impl QFormat for BlockQ4K {
    type Act = ActK;
    const BLOCK: usize = QK_K;
    const NAME: &'static str = "Q4K";

    fn act_zero() -> ActK {
        KZERO
    }

    fn quantize_block(x: &[f32]) -> ActK {
        quantize_k(x)
    }

    fn act_scales(a: &ActK) -> (f32, i32) {
        (a.d, 0)
    }

    fn dequantize(w: &[Self], out: &mut [f32]) {
        for (b, y) in w.iter().zip(out.chunks_exact_mut(QK_K)) {
            let d = f16_to_f32(b.d);
            let dmin = f16_to_f32(b.dmin);
            for j in 0..4 {
                let (s1, m1) = q4k_scale_min(2 * j, &b.scales);
                let (s2, m2) = q4k_scale_min(2 * j + 1, &b.scales);
                let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
                let (d2, m2) = (d * s2 as f32, dmin * m2 as f32);
                for l in 0..32 {
                    let q = b.qs[32 * j + l];
                    y[64 * j + l] = d1 * (q & 0xF) as f32 - m1;
                    y[64 * j + 32 + l] = d2 * (q >> 4) as f32 - m2;
                }
            }
        }
    }

    fn dot_scalar<const R: usize>(w: &[Self], tile: &[TileBlock<ActK>]) -> [f32; R] {
        let mut out = [0f32; R];
        for (b, t) in w.iter().zip(tile) {
            let d = f16_to_f32(b.d);
            let dmin = f16_to_f32(b.dmin);
            let sm = q4k_scales_mins(&b.scales);
            for (o, a) in out.iter_mut().zip(&t.a) {
                let mut sumi = 0i32;
                for j in 0..4 {
                    let (mut lo, mut hi) = (0i32, 0i32);
                    for l in 0..32 {
                        let q = b.qs[32 * j + l];
                        lo += (q & 0xF) as i32 * a.qs[64 * j + l] as i32;
                        hi += (q >> 4) as i32 * a.qs[64 * j + 32 + l] as i32;
                    }
                    sumi += sm[2 * j] as i32 * lo + sm[2 * j + 1] as i32 * hi;
                }
                let mins: f32 = (0..8).map(|j| sm[8 + j] as f32 * a.dbs32[j]).sum();
                *o += d * a.d * sumi as f32 - dmin * mins;
            }
        }
        out
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_avx2<const R: usize>(w: &[Self], tile: &[TileBlock<ActK>]) -> [f32; R] {
        use x86::*;
        assert!(tile.len() >= w.len());
        let m4 = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut accm = [_mm256_setzero_ps(); R];
        for (b, t) in w.iter().zip(tile) {
            let d = f16x1(b.d);
            let dmin = f16x1(b.dmin);
            let [w0, w1, w2, w3] = q4k_scales_mins_u32(&b.scales);
            let sm = _mm_setr_epi32(w0 as i32, w1 as i32, w2 as i32, w3 as i32);
            // Scales as i16 in both 128-bit halves; lane j picked per sub-block by a shuffle.
            let sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(sm, sm));
            let minf = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sm, sm))),
                _mm256_set1_ps(dmin),
            );
            let mut s = [_mm256_setzero_si256(); 8];
            for j in 0..4 {
                // SAFETY: qs has 128 bytes; 32 * j + 32 <= 128.
                let q = unsafe { load32(b.qs.as_ptr().add(32 * j)) };
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                let pick = |i: usize| _mm256_set1_epi16((((2 * i + 1) << 8) | (2 * i)) as i16);
                let s_lo = _mm256_shuffle_epi8(sc, pick(2 * j));
                let s_hi = _mm256_shuffle_epi8(sc, pick(2 * j + 1));
                for r in 0..R {
                    let a = &t.a[r];
                    // SAFETY: a.qs has 256 bytes; 64 * j + 64 <= 256.
                    let (yl, yh) = unsafe {
                        (
                            load32(a.qs.as_ptr().add(64 * j)),
                            load32(a.qs.as_ptr().add(64 * j + 32)),
                        )
                    };
                    let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, yl), s_lo);
                    let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, yh), s_hi);
                    s[r] = _mm256_add_epi32(s[r], _mm256_add_epi32(pl, ph));
                }
            }
            fold::<R>(&s, None, d, &t.d, &mut acc);
            for r in 0..R {
                // SAFETY: dbs32 is 8 floats.
                let bs = unsafe { _mm256_loadu_ps(t.a[r].dbs32.as_ptr()) };
                accm[r] = _mm256_fmadd_ps(minf, bs, accm[r]);
            }
        }
        let mut out = rows::<R>(&acc);
        for r in 0..R {
            out[r] -= hsum8(accm[r]);
        }
        out
    }
}

#[allow(clippy::needless_range_loop)] // rows indexed in lockstep across arrays
impl QFormat for BlockQ6K {
    type Act = ActK;
    const BLOCK: usize = QK_K;
    const NAME: &'static str = "Q6K";

    fn act_zero() -> ActK {
        KZERO
    }

    fn quantize_block(x: &[f32]) -> ActK {
        quantize_k(x)
    }

    fn act_scales(a: &ActK) -> (f32, i32) {
        (a.d, 0)
    }

    fn dequantize(w: &[Self], out: &mut [f32]) {
        for (b, y) in w.iter().zip(out.chunks_exact_mut(QK_K)) {
            let d = f16_to_f32(b.d);
            for h in 0..2 {
                let ql = &b.ql[64 * h..];
                let qh = &b.qh[32 * h..];
                let sc = &b.scales[8 * h..];
                let y = &mut y[128 * h..];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = d * sc[is] as f32 * q1 as f32;
                    y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                    y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                    y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
                }
            }
        }
    }

    fn dot_scalar<const R: usize>(w: &[Self], tile: &[TileBlock<ActK>]) -> [f32; R] {
        let mut out = [0f32; R];
        let mut q = [0u8; 256];
        for (b, t) in w.iter().zip(tile) {
            let d = f16_to_f32(b.d);
            // Unsigned 6-bit values (the offset of 32 is applied through the input sums).
            for h in 0..2 {
                for l in 0..32 {
                    let (ql0, ql1) = (b.ql[64 * h + l], b.ql[64 * h + 32 + l]);
                    let qh = b.qh[32 * h + l];
                    q[128 * h + l] = (ql0 & 0xF) | ((qh & 3) << 4);
                    q[128 * h + 32 + l] = (ql1 & 0xF) | (((qh >> 2) & 3) << 4);
                    q[128 * h + 64 + l] = (ql0 >> 4) | (((qh >> 4) & 3) << 4);
                    q[128 * h + 96 + l] = (ql1 >> 4) | (((qh >> 6) & 3) << 4);
                }
            }
            for (o, a) in out.iter_mut().zip(&t.a) {
                let mut sumi = 0i32;
                for s in 0..16 {
                    let dot: i32 = (0..16)
                        .map(|i| q[16 * s + i] as i32 * a.qs[16 * s + i] as i32)
                        .sum();
                    sumi += b.scales[s] as i32 * (dot - 32 * a.bsums16[s] as i32);
                }
                *o += d * a.d * sumi as f32;
            }
        }
        out
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_avx2<const R: usize>(w: &[Self], tile: &[TileBlock<ActK>]) -> [f32; R] {
        use x86::*;
        assert!(tile.len() >= w.len());
        let m4 = _mm256_set1_epi8(0x0F);
        let m3 = _mm256_set1_epi8(0x03);
        let mut acc = [_mm256_setzero_ps(); 2];
        for (b, t) in w.iter().zip(tile) {
            let d = f16x1(b.d);
            // SAFETY: scales has 16 bytes.
            let sc8 = unsafe { _mm_loadu_si128(b.scales.as_ptr() as *const __m128i) };
            let sc16 = _mm256_cvtepi8_epi16(sc8);
            let mut s = [_mm256_setzero_si256(); 8];
            for h in 0..2 {
                // SAFETY: ql has 128 bytes, qh 64: 64h + 64 <= 128, 32h + 32 <= 64.
                let (ql0, ql1, qh) = unsafe {
                    (
                        load32(b.ql.as_ptr().add(64 * h)),
                        load32(b.ql.as_ptr().add(64 * h + 32)),
                        load32(b.qh.as_ptr().add(32 * h)),
                    )
                };
                let hb = |v: __m256i| _mm256_slli_epi16(_mm256_and_si256(v, m3), 4);
                let q = [
                    _mm256_or_si256(_mm256_and_si256(ql0, m4), hb(qh)),
                    _mm256_or_si256(_mm256_and_si256(ql1, m4), hb(_mm256_srli_epi16(qh, 2))),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                        hb(_mm256_srli_epi16(qh, 4)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                        hb(_mm256_srli_epi16(qh, 6)),
                    ),
                ];
                for (u, qt) in q.iter().enumerate() {
                    // Scales of sub-blocks sb, sb + 1 as [sb ×8 | sb+1 ×8] i16 lanes.
                    let sb = (8 * h + 2 * u) as i8;
                    let (x, y) = (sb, sb + 1);
                    let pick = _mm_setr_epi8(x, x, x, x, x, x, x, x, y, y, y, y, y, y, y, y);
                    let scv = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
                    for r in 0..R {
                        // SAFETY: qs has 256 bytes; 128h + 32u + 32 <= 256.
                        let v = unsafe { load32(t.a[r].qs.as_ptr().add(128 * h + 32 * u)) };
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(*qt, v), scv);
                        s[r] = _mm256_add_epi32(s[r], p);
                    }
                }
            }
            for r in 0..R {
                // SAFETY: bsums16 has 32 bytes.
                let bs = unsafe { load32(t.a[r].bsums16.as_ptr()) };
                let off = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
                s[r] = _mm256_sub_epi32(s[r], off);
            }
            fold::<R>(&s, None, d, &t.d, &mut acc);
        }
        rows::<R>(&acc)
    }
}

#[allow(clippy::needless_range_loop)] // rows indexed in lockstep across arrays
impl QFormat for BlockQ5_0 {
    type Act = Act32;
    const BLOCK: usize = 32;
    const NAME: &'static str = "Q5_0";

    fn act_zero() -> Act32 {
        ZERO32
    }

    fn quantize_block(x: &[f32]) -> Act32 {
        quantize_32(x)
    }

    fn act_scales(a: &Act32) -> (f32, i32) {
        (a.d, a.sum)
    }

    fn dequantize(w: &[Self], out: &mut [f32]) {
        for (b, y) in w.iter().zip(out.chunks_exact_mut(32)) {
            let d = f16_to_f32(b.d);
            let qh = u32::from_le_bytes(b.qh);
            for j in 0..16 {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                let x0 = ((b.qs[j] as u32 & 0xF) | h0) as i32 - 16;
                let x1 = ((b.qs[j] as u32 >> 4) | h1) as i32 - 16;
                y[j] = d * x0 as f32;
                y[j + 16] = d * x1 as f32;
            }
        }
    }

    fn dot_scalar<const R: usize>(w: &[Self], tile: &[TileBlock<Act32>]) -> [f32; R] {
        let mut out = [0f32; R];
        for (b, t) in w.iter().zip(tile) {
            let d = f16_to_f32(b.d);
            let qh = u32::from_le_bytes(b.qh);
            let mut q = [0u8; 32];
            for j in 0..16 {
                q[j] = (b.qs[j] & 0xF) | ((((qh >> j) & 1) as u8) << 4);
                q[j + 16] = (b.qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
            }
            for (o, a) in out.iter_mut().zip(&t.a) {
                let dot: i32 = q
                    .iter()
                    .zip(&a.qs)
                    .map(|(&u, &v)| u as i32 * v as i32)
                    .sum();
                *o += d * a.d * (dot - 16 * a.sum) as f32;
            }
        }
        out
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_avx2<const R: usize>(w: &[Self], tile: &[TileBlock<Act32>]) -> [f32; R] {
        use x86::*;
        assert!(tile.len() >= w.len());
        let ones = _mm256_set1_epi16(1);
        let fifth = _mm256_set1_epi8(0x10);
        let unpack = |b: &BlockQ5_0| {
            let hi = _mm256_and_si256(bits32(u32::from_le_bytes(b.qh)), fifth);
            _mm256_or_si256(nibbles32(&b.qs), hi)
        };
        let mut acc = [_mm256_setzero_ps(); 2];
        for (b, t) in w.iter().zip(tile) {
            let d = f16x1(b.d);
            let q = unpack(b);
            let mut p = [_mm256_setzero_si256(); 8];
            for r in 0..R {
                // SAFETY: qs has 32 bytes.
                let y = unsafe { load32(t.a[r].qs.as_ptr()) };
                p[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), ones);
            }
            // Offset 16 · Σ y, exactly.
            fold::<R>(&p, Some((&t.s, 4)), d, &t.d, &mut acc);
        }
        rows::<R>(&acc)
    }
}

#[allow(clippy::needless_range_loop)] // rows indexed in lockstep across arrays
impl QFormat for BlockQ8_0 {
    type Act = Act32;
    const BLOCK: usize = 32;
    const NAME: &'static str = "Q8_0";

    fn act_zero() -> Act32 {
        ZERO32
    }

    fn quantize_block(x: &[f32]) -> Act32 {
        quantize_32(x)
    }

    fn act_scales(a: &Act32) -> (f32, i32) {
        (a.d, a.sum)
    }

    fn dequantize(w: &[Self], out: &mut [f32]) {
        for (b, y) in w.iter().zip(out.chunks_exact_mut(32)) {
            let d = f16_to_f32(b.d);
            for (o, &q) in y.iter_mut().zip(&b.qs) {
                *o = d * q as f32;
            }
        }
    }

    fn dot_scalar<const R: usize>(w: &[Self], tile: &[TileBlock<Act32>]) -> [f32; R] {
        let mut out = [0f32; R];
        for (b, t) in w.iter().zip(tile) {
            let d = f16_to_f32(b.d);
            for (o, a) in out.iter_mut().zip(&t.a) {
                let dot: i32 =
                    b.qs.iter()
                        .zip(&a.qs)
                        .map(|(&u, &v)| u as i32 * v as i32)
                        .sum();
                *o += d * a.d * dot as f32;
            }
        }
        out
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_avx2<const R: usize>(w: &[Self], tile: &[TileBlock<Act32>]) -> [f32; R] {
        use x86::*;
        assert!(tile.len() >= w.len());
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); 2];
        for (b, t) in w.iter().zip(tile) {
            let d = f16x1(b.d);
            // SAFETY: qs has 32 bytes.
            let q = unsafe { load32(b.qs.as_ptr()) };
            let aq = _mm256_sign_epi8(q, q);
            let mut p = [_mm256_setzero_si256(); 8];
            for r in 0..R {
                // SAFETY: qs has 32 bytes.
                let y = unsafe { load32(t.a[r].qs.as_ptr()) };
                p[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(y, q)), ones);
            }
            fold::<R>(&p, None, d, &t.d, &mut acc);
        }
        rows::<R>(&acc)
    }
}

/// Whether the AVX2 kernels can run here (checked once).
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Columns per cache tile (weight rows revisited for every row tile).
const COL_TILE: usize = 8;

/// The row-major `m × n` output of a matmul, shared by the tasks that fill disjoint columns.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr {
    ptr: *mut f32,
    n: usize,
    len: usize,
}

// SAFETY: an `OutPtr` is only written through `store`, whose callers write disjoint elements.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Wrap `dst` (`rows × n`, row-major).
    pub(crate) fn new(dst: &mut [f32], n: usize) -> Self {
        Self {
            ptr: dst.as_mut_ptr(),
            n,
            len: dst.len(),
        }
    }

    /// Write `vals[i]` to element `(r + i, c)`.
    ///
    /// # Safety
    /// The wrapped slice must still be alive and borrowed by nobody else, and no other thread
    /// may write these elements concurrently.
    #[inline(always)]
    pub(crate) unsafe fn store(self, r: usize, c: usize, vals: &[f32]) {
        for (i, v) in vals.iter().enumerate() {
            let idx = (r + i) * self.n + c;
            assert!(idx < self.len, "matmul output index out of range");
            // SAFETY: in bounds (checked) and exclusive (caller).
            unsafe { *self.ptr.add(idx) = *v };
        }
    }
}

/// The tiled loop over columns and row tiles shared by both paths; `$dot!(R, weight_row, tile)`
/// computes `R` dot products.
macro_rules! row_tiles {
    ($dot:ident, $F:ty, $w:expr, $kb:expr, $cols:expr, $tiles:expr, $m:expr, $out:expr) => {{
        let (w, kb, cols, tiles, m, out) = ($w, $kb, $cols, $tiles, $m, $out);
        let col = |c: usize| -> &[$F] { &w[c * kb..(c + 1) * kb] };
        macro_rules! tile {
            ($n:literal, $r:expr, $ct:expr, $ce:expr, $tb:expr) => {{
                for c in $ct..$ce {
                    let res = $dot!($n, col(c), $tb);
                    // SAFETY: this task owns columns `cols` (caller's contract).
                    unsafe { out.store($r, c, &res) };
                }
            }};
        }
        for ct in cols.clone().step_by(COL_TILE) {
            let ce = (ct + COL_TILE).min(cols.end);
            for t in 0..m.div_ceil(ROW_TILE) {
                let r = t * ROW_TILE;
                let tb: &[TileBlock<<$F as QFormat>::Act>] = &tiles[t * kb..(t + 1) * kb];
                match m - r {
                    1 => tile!(1, r, ct, ce, tb),
                    2 => tile!(2, r, ct, ce, tb),
                    3 => tile!(3, r, ct, ce, tb),
                    4 => tile!(4, r, ct, ce, tb),
                    5 => tile!(5, r, ct, ce, tb),
                    6 => tile!(6, r, ct, ce, tb),
                    7 => tile!(7, r, ct, ce, tb),
                    _ => tile!(8, r, ct, ce, tb),
                }
            }
        }
    }};
}

/// Output columns `cols` of `X · Wᵀ` for all `m` input rows (quantized into `tiles`), with the
/// AVX2 kernels.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`has_avx2`]); no other thread may write columns
/// `cols` of `out` meanwhile, and `out` must wrap a live `m × n` slice.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn columns_avx2<F: QFormat>(
    w: &[F],
    kb: usize,
    cols: std::ops::Range<usize>,
    tiles: &[TileBlock<F::Act>],
    m: usize,
    out: OutPtr,
) {
    macro_rules! avx2 {
        ($r:literal, $wc:expr, $tb:expr) => {
            // SAFETY: the caller of `columns_avx2` guarantees the CPU features.
            unsafe { F::dot_avx2::<$r>($wc, $tb) }
        };
    }
    row_tiles!(avx2, F, w, kb, cols, tiles, m, out);
}

/// Portable version of [`columns_avx2`].
///
/// # Safety
/// No other thread may write columns `cols` of `out` meanwhile, and `out` must wrap a live
/// `m × n` slice.
pub(crate) unsafe fn columns_scalar<F: QFormat>(
    w: &[F],
    kb: usize,
    cols: std::ops::Range<usize>,
    tiles: &[TileBlock<F::Act>],
    m: usize,
    out: OutPtr,
) {
    macro_rules! scalar {
        ($r:literal, $wc:expr, $tb:expr) => {
            F::dot_scalar::<$r>($wc, $tb)
        };
    }
    row_tiles!(scalar, F, w, kb, cols, tiles, m, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    fn randn(n: usize, seed: u64) -> Vec<f32> {
        // A cheap deterministic pseudo-normal (sum of uniforms).
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                let mut s = 0f32;
                for _ in 0..4 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    s += (x >> 40) as f32 / (1u64 << 24) as f32;
                }
                (s - 2.0) * 1.7
            })
            .collect()
    }

    fn deq_act_k(a: &ActK) -> Vec<f64> {
        a.qs.iter().map(|&q| a.d as f64 * q as f64).collect()
    }

    fn deq_act_32(a: &Act32) -> Vec<f64> {
        a.qs.iter().map(|&q| a.d as f64 * q as f64).collect()
    }

    /// Both kernels, every row count: the dot of the dequantized weights with the dequantized
    /// (int8) inputs, computed in f64, up to f32 rounding.
    fn check<F: QFormat>(dtype: GgmlDType, deq_act: fn(&F::Act) -> Vec<f64>) {
        let k = 512;
        let kb = k / F::BLOCK;
        let w = Tensor::from_vec(randn(k, 7), (1, k), &Device::Cpu).unwrap();
        let bytes = QTensor::quantize(&w, dtype)
            .unwrap()
            .data()
            .unwrap()
            .to_vec();
        assert_eq!(bytes.len(), kb * std::mem::size_of::<F>());
        let size = std::mem::size_of::<F>();
        // SAFETY: test-only reinterpretation of GGML block bytes as the matching repr(C) type.
        let blocks: Vec<F> = (0..kb)
            .map(|i| unsafe { std::ptr::read_unaligned(bytes.as_ptr().add(i * size) as *const F) })
            .collect();
        let mut wd = vec![0f32; k];
        F::dequantize(&blocks, &mut wd);
        let m = ROW_TILE;
        let x: Vec<f32> = (0..m).flat_map(|r| randn(k, 100 + r as u64)).collect();
        let tiles = quantize_tiles::<F>(&x, m, k);
        let want: Vec<f64> = (0..m)
            .map(|r| {
                let xr: Vec<f64> = tiles.iter().flat_map(|t| deq_act(&t.a[r])).collect();
                xr.iter().zip(&wd).map(|(x, w)| x * *w as f64).sum()
            })
            .collect();
        let tol = 1e-4 * want.iter().fold(1f64, |m, v| m.max(v.abs()));
        let close = |got: &[f32], what: &str| {
            for (r, g) in got.iter().enumerate() {
                let d = (*g as f64 - want[r]).abs();
                assert!(
                    d < tol,
                    "{dtype:?} {what} R={} row {r}: {g} vs {}",
                    got.len(),
                    want[r]
                );
            }
        };
        macro_rules! all_r {
            ($($n:literal),*) => {$(
                close(&F::dot_scalar::<$n>(&blocks, &tiles), "scalar");
                #[cfg(target_arch = "x86_64")]
                if has_avx2() {
                    // SAFETY: features checked.
                    close(&unsafe { F::dot_avx2::<$n>(&blocks, &tiles) }, "avx2");
                }
            )*};
        }
        all_r!(1, 2, 3, 4, 5, 6, 7, 8);
    }

    #[test]
    fn kernels_match_f64_reference() {
        check::<BlockQ4K>(GgmlDType::Q4K, deq_act_k);
        check::<BlockQ6K>(GgmlDType::Q6K, deq_act_k);
        check::<BlockQ5_0>(GgmlDType::Q5_0, deq_act_32);
        check::<BlockQ8_0>(GgmlDType::Q8_0, deq_act_32);
    }

    #[test]
    fn q4k_scale_unpacking_agrees() {
        for seed in 0..50u8 {
            let q: [u8; 12] =
                std::array::from_fn(|i| seed.wrapping_mul(37).wrapping_add(i as u8 * 91));
            let all = q4k_scales_mins(&q);
            for j in 0..8 {
                assert_eq!((all[j], all[8 + j]), q4k_scale_min(j, &q));
            }
        }
    }
}
