//! Quantized matmul kernels on weights repacked at load into column-interleaved groups.
//!
//! **Layout.** The `n` weight rows (output columns) are cut into groups of [`G`] = 16. Within a
//! group, one 64-byte line holds 4 consecutive k-values of each of the 16 columns (byte
//! `4·col + i` is value `4·g + i` of column `col` for k-group `g`), so a vector register holds
//! 16 (512-bit) or 8 (256-bit, half a line) columns × 4 k-values and `vpdpbusd` against a
//! broadcast 4-byte group of int8 activations adds one int32 per column per lane: no horizontal
//! sums, and every weight byte pulled from memory serves every row of the batch. Bits stay as
//! packed as in the file: 4-bit values share a line as low and high nibbles (k-groups `c` and
//! `c + NK/2` of a block), Q6_K's top two bits and Q5_0's fifth bit live in their own bit
//! planes, and the per-block scales (`f16`), 6-bit sub-block scales and mins (`u8`) of the 16
//! columns sit next to each other. (The AVX2 path keeps Q6_K and Q5_0 in layouts of their own,
//! [`Q6KLines`] and [`Q5_0Lines`], chosen at load: whole 6- and 5-bit values, which it unpacks
//! in fewer operations.)
//! Per group: `kb` blocks of 64-byte-aligned "main" data (quants, sub-block scales), then the
//! `kb` blocks' float scales ("aux"). The last group is padded with zero columns.
//!
//! **Activations** are quantized once per row to int8 ([`ActK`] per 256 values with the sums the
//! K-quant offsets need, [`Act32`] per 32); the unsigned-weight offsets (Q6_K −32, Q5_0 −16,
//! Q8_0 stored as `w + 128`) are applied in integers by starting the block's accumulator at
//! `−offset · Σx`, Q4_K's mins through one `vpdpwssd` per pair of sub-blocks. Where sums run in
//! i32 lanes, the K-quants' sub-block scales are applied by one `vpdpwssd` per accumulator,
//! which needs the accumulator in i16 range: Q6_K's accumulators span half a sub-block and
//! Q4_K's start at `−8 · Σx` (see [`scale_chains`]), unless the block's activations are small
//! enough for whole Q6_K sub-blocks and raw Q4_K weights ([`ActK::fits`]). All integer sums
//! are exact on every path; the float epilogue (one or two FMAs per block and row, blocks in k
//! order) is the same sequence of operations on every ISA, so a row's result is bit-identical
//! for any batch size, any position in its row tile and any ISA path.
//!
//! **ISA paths** (chosen once at run time, see [`Isa`]): AVX-512 VNNI (16 columns per
//! register; where the CPU has GFNI, `vgf2p8affineqb` moves the 4-bit and 2-bit weight fields
//! in one instruction instead of a shift and a mask: [`Simd::hi_nibbles`], [`Simd::q6k_field`]),
//! AMX (the AVX-512 path, with Q4_K from 9 rows and Q6_K from 32 on AMX-INT8 tiles:
//! [`amx`]), AVX-VNNI and AVX2 (8 columns, the two halves of a group one after the other) and
//! a portable scalar model of the same lanes (the reference in tests). AVX2 has no `vpdpbusd`:
//! it sums the `maddubs` products of a whole sub-block in i16 lanes and widens them once, with
//! the sub-block scale as the other operand of the widening `madd` ([`Simd::I16_SUMS`]; the
//! 4..6-bit weights keep every sum inside i16, and the offsets start the i16 sums so that only
//! the final value must fit); Q8_0 uses the sign trick.
//!
//! **Loop order** ([`Packed::run`]): per column group, K chunks of 1,024 values; per chunk,
//! row tiles (8 rows on 512-bit and AVX2, 4 on AVX-VNNI; 16 for Q4_K and Q6_K on 512-bit,
//! [`Format::WIDE_ROWS`]) and the group's halves, so the chunk's
//! weights and a tile's activations stay in L1 while every tile passes over them. Partial sums
//! wait in the output between chunks, and each output still adds its blocks in k order.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
pub(crate) use amx::peak_gmacs as amx_peak_gmacs;

use half::f16;

/// Columns per interleaved group.
pub(crate) const G: usize = 16;
/// Values per K-quant super-block.
pub(crate) const QK_K: usize = 256;

// ---------------------------------------------------------------------------------------------
// GGML on-disk blocks (read once, at repack time).

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

/// GGML Q4_1: 32 4-bit values, `w = d · q + m`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockQ4_1 {
    d: u16,
    m: u16,
    qs: [u8; 16],
}

const _: () = {
    assert!(std::mem::size_of::<BlockQ4K>() == 144);
    assert!(std::mem::size_of::<BlockQ6K>() == 210);
    assert!(std::mem::size_of::<BlockQ5_0>() == 22);
    assert!(std::mem::size_of::<BlockQ8_0>() == 34);
    assert!(std::mem::size_of::<BlockQ4_1>() == 20);
};

/// One column's block, decoded: unsigned quants and the integer/float scales.
#[derive(Clone, Copy)]
pub(crate) struct ColBlock {
    /// Unsigned quant values (first `BLOCK` used).
    q: [u8; QK_K],
    /// Sub-block scales (Q4_K: u8 6-bit, Q6_K: i8 as u8 bits).
    sc: [u8; 16],
    /// Q4_K sub-block mins.
    mins: [u8; 8],
    /// f16 bits: the block scale, and Q4_K's `dmin` / Q4_1's `m`.
    d: u16,
    d2: u16,
}

impl ColBlock {
    const ZERO: ColBlock = ColBlock {
        q: [0; QK_K],
        sc: [0; 16],
        mins: [0; 8],
        d: 0,
        d2: 0,
    };
}

#[inline]
fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// All eight Q4_K (scales, mins), bytes `[s0..s7, m0..m7]`.
fn q4k_scales_mins(q: &[u8; 12]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for j in 0..8 {
        let (s, m) = if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            (
                (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
                (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
            )
        };
        out[j] = s;
        out[8 + j] = m;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Activations.

/// 256 input values as int8 with one scale, plus the sums the K-quant offsets need.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActK {
    qs: [i8; 256],
    d: f32,
    /// `−32 · Σ qs` over each 8 values: Q6_K's accumulators start here, one per half
    /// sub-block, so each ends in i16 range (see [`scale_chains`]).
    init8: [i32; 32],
    /// `−32 · Σ qs` over each 16 values: Q6_K's accumulators start here, one per sub-block,
    /// where [`FITS_Q6K_WHOLE`] says a whole sub-block's sum stays in i16 range.
    init16: [i32; 16],
    /// [`FITS_Q4K_RAW`], [`FITS_Q6K_WHOLE`]: which shorter paths this block's values allow.
    fits: u32,
    /// `−8 · Σ qs` over each 32 values: Q4_K's sub-block accumulators start here (weights
    /// taken as `q − 8`, so each ends in i16 range), undone by [`Self::bs32p8`]; not used where
    /// [`FITS_Q4K_RAW`] holds.
    init32: [i32; 8],
    /// Σ qs over each 32 values as i16 pairs `(s[2p], s[2p+1])` in one i32 (Q4_K's mins).
    bs32p: [i32; 4],
    /// [`Self::bs32p`] times 8 (at most 8 · 32 · 127 = 32,512): Q4_K's `+8 · Σ scale · Σx`
    /// that gives back what [`Self::init32`] took.
    bs32p8: [i32; 4],
    /// Q6_K's `−32` offset for the i16 sums of [`Simd::I16_SUMS`]: over each 16 values,
    /// `−32 · Σ qs` of the values at `k ≡ 0, 1 (mod 4)` and of those at `k ≡ 2, 3`, as an i16
    /// pair in one i32 (the two halves of a `maddubs` lane).
    off16p: [i32; 16],
}

/// [`ActK::fits`]: every 32 values have `Σ |qs| ≤ 2184`, so a Q4_K sub-block's dot of raw
/// weights (0–15) stays within `15 · 2184 = 32,760`, inside i16: its chains need no `−8 · Σx`
/// start and the block no correction ([`q4k_pair`]).
const FITS_Q4K_RAW: u32 = 1;
/// [`ActK::fits`]: every 16 values have `Σ |qs| ≤ 1023`, so a whole Q6_K sub-block's dot of
/// `q − 32` stays within `32 · 1023 = 32,736`: one chain and one scale step per sub-block
/// instead of one per half ([`q6k_pair`], [`q6k_quad`]).
const FITS_Q6K_WHOLE: u32 = 2;

/// Whether every row of a tile has the [`ActK::fits`] bit `bit` for this block. The shorter
/// paths give the same integer sums, so which one a tile takes never changes a bit of the
/// result; a tile takes one only where all its rows allow it.
#[inline(always)]
unsafe fn all_fit<const R: usize>(acts: &[*const ActK; R], bit: u32) -> bool {
    // SAFETY: live activation blocks (caller).
    acts.iter().all(|&a| unsafe { (*a).fits } & bit != 0)
}

/// 32 input values as int8 with one scale.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Act32 {
    qs: [i8; 32],
    d: f32,
    /// `d · Σ qs` (Q4_1's mins).
    xs: f32,
    /// `−16 · Σ qs` (Q5_0's offset).
    n16: i32,
    /// `−128 · Σ qs` (Q8_0 stored as `w + 128`).
    n128: i32,
    /// Q5_0's `−16` offset for the i16 sums of [`Simd::I16_SUMS`]: `−16 · Σ qs` of the values
    /// at `k ≡ 0, 1 (mod 4)` and of those at `k ≡ 2, 3`, as an i16 pair in one i32.
    off16p: i32,
}

/// Quantize `x` (a multiple of 16 values) to int8 with a symmetric scale: returns `d` (values
/// ≈ d · q). Written as 16-lane loops the compiler vectorizes (the element-at-a-time form ran
/// scalar, a tenth of a 32-row forward): the maximum is exact in any order and every value
/// goes through the same multiply and round-to-nearest-even, so the result is the same bits
/// as [`quantize_i8_reference`]'s.
#[inline]
fn quantize_i8(x: &[f32], q: &mut [i8]) -> f32 {
    debug_assert!(x.len().is_multiple_of(16) && q.len() == x.len());
    let amax = abs_max(x);
    if amax == 0.0 || !amax.is_finite() {
        q.fill(0);
        return if amax.is_finite() { 0.0 } else { f32::NAN };
    }
    let id = 127.0 / amax;
    for (o, c) in q.chunks_exact_mut(16).zip(x.chunks_exact(16)) {
        round_16(c, id, o);
    }
    amax / 127.0
}

/// The largest |x| of `x` (a multiple of 16 values), NaNs skipped as `f32::max` skips them.
fn abs_max(x: &[f32]) -> f32 {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    // SAFETY: AVX2 is enabled at compile time; every load reads 8 of the values.
    unsafe {
        // `vmaxps(a, m)` gives `m` where `a` is NaN, and `m` never is (it starts at 0): the
        // same maxima as `m.max(|v|)`, without its NaN tests. Four chains, so the latency of
        // one `vmaxps` after the other no longer sets the pace (a 256-value block spent half
        // its quantizing time here).
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let mut m = [_mm256_setzero_ps(); 4];
        let chunks = x.chunks_exact(32);
        let rest = chunks.remainder();
        for c in chunks {
            for (i, mi) in m.iter_mut().enumerate() {
                let v = _mm256_and_ps(_mm256_loadu_ps(c.as_ptr().add(8 * i)), abs);
                *mi = _mm256_max_ps(v, *mi);
            }
        }
        for (i, c) in rest.chunks_exact(8).enumerate() {
            let v = _mm256_and_ps(_mm256_loadu_ps(c.as_ptr()), abs);
            m[i] = _mm256_max_ps(v, m[i]);
        }
        let v = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
        let v = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let v = _mm_max_ps(v, _mm_movehl_ps(v, v));
        let v = _mm_max_ss(v, _mm_shuffle_ps::<1>(v, v));
        _mm_cvtss_f32(v)
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// `o[i] = round_ties_even(c[i] · id)` for 16 values with `|c[i] · id| < 127.5` (`id` is
/// 127 / the block's maximum, so the product is at most 127 plus two roundings): every
/// conversion and narrowing is exact. Explicit AVX2 (the build's baseline), because the
/// compiler keeps Rust's saturating float-to-int casts scalar.
#[inline(always)]
fn round_16(c: &[f32], id: f32, o: &mut [i8]) {
    assert!(c.len() == 16 && o.len() == 16);
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    // SAFETY: AVX2 is enabled at compile time; 16 values are read and written (asserted).
    unsafe {
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let s = _mm256_set1_ps(id);
        // A NaN input becomes 0, as Rust's cast makes it.
        let scaled = |p: *const f32| {
            let v = _mm256_mul_ps(_mm256_loadu_ps(p), s);
            _mm256_round_ps::<NEAREST>(_mm256_and_ps(v, _mm256_cmp_ps::<_CMP_ORD_Q>(v, v)))
        };
        let (a, b) = (scaled(c.as_ptr()), scaled(c.as_ptr().add(8)));
        // i32 → i16 packs within 128-bit lanes: [a0..3 b0..3 | a4..7 b4..7]; put a before b.
        let w = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
        let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(w);
        let bytes = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w));
        _mm_storeu_si128(o.as_mut_ptr() as *mut __m128i, bytes);
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
    for (o, v) in o.iter_mut().zip(c) {
        *o = (v * id).round_ties_even() as i8;
    }
}

/// The element-at-a-time form of [`quantize_i8`] (the tests' reference).
#[cfg(test)]
fn quantize_i8_reference(x: &[f32], q: &mut [i8]) -> f32 {
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

/// An activation block type.
pub(crate) trait ActBlock: Copy + Send + Sync + std::fmt::Debug + 'static {
    const BLOCK: usize;
    fn quantize(x: &[f32]) -> Self;
    /// The block's scale: value = `d · q`.
    fn d(&self) -> f32;
}

#[cfg(test)]
impl ActK {
    /// Which shorter paths this block allows ([`FITS_Q4K_RAW`], [`FITS_Q6K_WHOLE`]).
    pub(crate) fn fits(&self) -> (bool, bool) {
        (
            self.fits & FITS_Q4K_RAW != 0,
            self.fits & FITS_Q6K_WHOLE != 0,
        )
    }

    /// Forbid the shorter paths: the kernels then take the long ones on this block.
    pub(crate) fn forbid_short_paths(&mut self) {
        self.fits = 0;
    }
}

impl ActBlock for ActK {
    fn d(&self) -> f32 {
        self.d
    }
    const BLOCK: usize = QK_K;
    fn quantize(x: &[f32]) -> ActK {
        let mut a = ActK {
            qs: [0; 256],
            d: 0.0,
            init8: [0; 32],
            init16: [0; 16],
            fits: 0,
            init32: [0; 8],
            bs32p: [0; 4],
            bs32p8: [0; 4],
            off16p: [0; 16],
        };
        a.d = quantize_i8(x, &mut a.qs);
        let BlockSums { s8, abs16, lo16 } = block_sums(&a.qs);
        for (i, s) in s8.iter().enumerate() {
            a.init8[i] = -32 * s;
        }
        for i in 0..16 {
            a.init16[i] = a.init8[2 * i] + a.init8[2 * i + 1];
        }
        // Σ|qs| over each 32 values as pairs of the sums over 16.
        if abs16.chunks_exact(2).all(|p| p[0] + p[1] <= 2184) {
            a.fits |= FITS_Q4K_RAW;
        }
        if abs16.iter().all(|&s| s <= 1023) {
            a.fits |= FITS_Q6K_WHOLE;
        }
        let pair = |lo: i32, hi: i32| ((lo as u16 as u32) | ((hi as u16 as u32) << 16)) as i32;
        for j in 0..16 {
            // `offset_pair(qs[16j..16j + 16], −32)`: the values at k ≡ 0, 1 (mod 4), the rest.
            let hi = s8[2 * j] + s8[2 * j + 1] - lo16[j];
            a.off16p[j] = pair(-32 * lo16[j], -32 * hi);
        }
        let s32: [i32; 8] = std::array::from_fn(|j| s8[4 * j..4 * j + 4].iter().sum());
        for j in 0..8 {
            a.init32[j] = -8 * s32[j];
        }
        for p in 0..4 {
            a.bs32p[p] = pair(s32[2 * p], s32[2 * p + 1]);
            a.bs32p8[p] = pair(8 * s32[2 * p], 8 * s32[2 * p + 1]);
        }
        a
    }
}

impl ActBlock for Act32 {
    fn d(&self) -> f32 {
        self.d
    }
    const BLOCK: usize = 32;
    fn quantize(x: &[f32]) -> Act32 {
        let mut a = Act32 {
            qs: [0; 32],
            d: 0.0,
            xs: 0.0,
            n16: 0,
            n128: 0,
            off16p: 0,
        };
        a.d = quantize_i8(x, &mut a.qs);
        let s: i32 = a.qs.iter().map(|&v| v as i32).sum();
        a.xs = a.d * s as f32;
        a.n16 = -16 * s;
        a.n128 = -128 * s;
        a.off16p = offset_pair(&a.qs, -16);
        a
    }
}

/// The integer sums of a K-quant activation block that [`ActK`] derives its fields from.
#[derive(Debug, PartialEq)]
struct BlockSums {
    /// Σ q over each 8 values.
    s8: [i32; 32],
    /// Σ |q| over each 16 values.
    abs16: [i32; 16],
    /// Σ q over the values `k ≡ 0, 1 (mod 4)` of each 16.
    lo16: [i32; 16],
}

/// [`BlockSums`] of 256 values, 32 at a time with `vpsadbw` (sums of 8 unsigned bytes): the
/// values plus 128 give the signed sums, their absolute values the Σ|q|, and the shifted values
/// with the bytes `k ≡ 2, 3 (mod 4)` masked off the `lo16` sums. Element by element these
/// sums cost 4 operations per value; quantizing the activations (these sums with the scaling
/// and rounding) was 4–5 % of a 16-row forward (2 threads, Xeon family 6 model 207).
fn block_sums(q: &[i8; 256]) -> BlockSums {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    // SAFETY: AVX2 is enabled at compile time; each load reads 32 of the 256 bytes.
    unsafe {
        let mut out = BlockSums {
            s8: [0; 32],
            abs16: [0; 16],
            lo16: [0; 16],
        };
        let zero = _mm256_setzero_si256();
        let bias = _mm256_set1_epi8(-128); // x ^ 0x80 = x + 128 as an unsigned byte
        let lo_bytes = _mm256_set1_epi32(0x0000_FFFF);
        let lanes = |v: __m256i| -> [i32; 4] {
            let mut u = [0u64; 4];
            _mm256_storeu_si256(u.as_mut_ptr() as *mut __m256i, v);
            u.map(|x| x as i32)
        };
        for c in 0..8 {
            let v = _mm256_loadu_si256(q.as_ptr().add(32 * c) as *const __m256i);
            let shifted = _mm256_xor_si256(v, bias);
            let s = lanes(_mm256_sad_epu8(shifted, zero));
            let a = lanes(_mm256_sad_epu8(_mm256_abs_epi8(v), zero));
            let l = lanes(_mm256_sad_epu8(_mm256_and_si256(shifted, lo_bytes), zero));
            for i in 0..4 {
                out.s8[4 * c + i] = s[i] - 8 * 128;
            }
            for h in 0..2 {
                out.abs16[2 * c + h] = a[2 * h] + a[2 * h + 1];
                // 4 kept bytes in each 8: 8 · 128 over the 16 values.
                out.lo16[2 * c + h] = l[2 * h] + l[2 * h + 1] - 8 * 128;
            }
        }
        out
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
    block_sums_reference(q)
}

/// [`block_sums`] element by element (the tests' reference, and the path without AVX2).
#[cfg_attr(
    all(target_arch = "x86_64", target_feature = "avx2", not(test)),
    allow(dead_code)
)]
fn block_sums_reference(q: &[i8; 256]) -> BlockSums {
    let sum = |r: std::ops::Range<usize>, f: &dyn Fn(usize, i32) -> i32| -> i32 {
        r.map(|k| f(k, q[k] as i32)).sum()
    };
    BlockSums {
        s8: std::array::from_fn(|i| sum(8 * i..8 * i + 8, &|_, v| v)),
        abs16: std::array::from_fn(|i| sum(16 * i..16 * i + 16, &|_, v| v.abs())),
        lo16: std::array::from_fn(|i| {
            sum(16 * i..16 * i + 16, &|k, v| if k % 4 < 2 { v } else { 0 })
        }),
    }
}

/// `c · Σ q[k]` over `k ≡ 0, 1 (mod 4)` and over `k ≡ 2, 3`, as the low and high i16 of one
/// i32. In range for the callers: 16 values at `c = −32` or 32 at `c = −16` reach at most
/// 8 · 32 · 127 = 32,512.
fn offset_pair(q: &[i8], c: i32) -> i32 {
    let (mut lo, mut hi) = (0i32, 0i32);
    for (k, &v) in q.iter().enumerate() {
        if k % 4 < 2 {
            lo += v as i32;
        } else {
            hi += v as i32;
        }
    }
    let (lo, hi) = (c * lo, c * hi);
    debug_assert!(i16::try_from(lo).is_ok() && i16::try_from(hi).is_ok());
    ((lo as u16 as u32) | ((hi as u16 as u32) << 16)) as i32
}

/// Quantize the `m` rows of `x` (`m × k`): `k / A::BLOCK` blocks per row, stored block-major
/// (block `b` of row `r` at `b · m + r`). A kernel tile then finds block `b` of all its rows at
/// constant offsets from one address, so its broadcasts need no per-row address arithmetic
/// (with rows one after the other, the compiler spent a `lea` and an indexed operand per row and
/// k-group).
pub(crate) fn quantize_rows<A: ActBlock>(x: &[f32], m: usize, k: usize) -> Vec<A> {
    assert_eq!(x.len(), m * k, "matmul input size");
    assert!(k.is_multiple_of(A::BLOCK));
    quantize_rows_by(m, k, |r, b| {
        A::quantize(&x[r * k + b * A::BLOCK..][..A::BLOCK])
    })
}

/// [`quantize_rows`] of the rows `silu(g) · u` (`m × k` each) without forming them: each block
/// of values is made on the stack from `g` and `u` ([`crate::vecmath::silu_mul_into`], the
/// same values element by element) and quantized there, so the down projection's input is one
/// pass over the gate and up outputs, on every thread, instead of a serial pass that writes a
/// third matrix and a second that reads it.
pub(crate) fn quantize_silu_mul_rows<A: ActBlock>(
    g: &[f32],
    u: &[f32],
    m: usize,
    k: usize,
) -> Vec<A> {
    assert!(
        g.len() == m * k && u.len() == m * k,
        "silu_mul input size: gate {}, up {}, expected {m} × {k}",
        g.len(),
        u.len()
    );
    assert!(k.is_multiple_of(A::BLOCK) && A::BLOCK <= 256);
    quantize_rows_by(m, k, |r, b| {
        let at = r * k + b * A::BLOCK;
        let mut h = [0f32; 256];
        let h = &mut h[..A::BLOCK];
        crate::vecmath::silu_mul_into(&g[at..][..A::BLOCK], &u[at..][..A::BLOCK], h);
        A::quantize(h)
    })
}

/// The block-major quantized rows of [`quantize_rows`], block `b` of row `r` made by
/// `block(r, b)`; rows in parallel from 8 of them.
fn quantize_rows_by<A: ActBlock>(
    m: usize,
    k: usize,
    block: impl Fn(usize, usize) -> A + Sync,
) -> Vec<A> {
    let kb = k / A::BLOCK;
    // Written in place, block-major: no per-row vectors to allocate and copy over afterwards
    // (that copy ran on the calling thread alone, between two parallel loops).
    let mut out: Vec<std::mem::MaybeUninit<A>> = Vec::with_capacity(m * kb);
    // SAFETY: `MaybeUninit` needs no initialization.
    unsafe { out.set_len(m * kb) };
    struct Slots<A>(*mut std::mem::MaybeUninit<A>);
    // SAFETY: every row writes only its own slots (`b · m + r`), and the buffer outlives the
    // loop.
    unsafe impl<A> Sync for Slots<A> {}
    let slots = Slots(out.as_mut_ptr());
    let quantize_row = |r: usize| {
        let slots = &slots;
        for b in 0..kb {
            // SAFETY: `b · m + r < m · kb`, written by row r only.
            unsafe { (*slots.0.add(b * m + r)).write(block(r, b)) };
        }
    };
    if m >= 8 {
        crate::parallel::for_each(m, quantize_row);
    } else {
        (0..m).for_each(quantize_row);
    }
    let mut out = std::mem::ManuallyDrop::new(out);
    let (ptr, len, cap) = (out.as_mut_ptr(), out.len(), out.capacity());
    // SAFETY: every one of the `m · kb` slots was written above (a panic in `quantize` would
    // have unwound past this point), and `MaybeUninit<A>` has `A`'s layout.
    unsafe { Vec::from_raw_parts(ptr as *mut A, len, cap) }
}

// ---------------------------------------------------------------------------------------------
// SIMD abstraction: `I` holds LANES i32 lanes (= 4·LANES bytes), `F` LANES f32.

/// [`Simd::hi_nibbles`] in two instructions: a 16-bit shift (which pulls in the next byte's
/// bits) and a mask.
#[inline(always)]
unsafe fn hi_nibbles_by_shift<S: Simd>(v: S::I) -> S::I {
    // SAFETY: the CPU supports `S` (caller).
    unsafe { S::and(S::shr16(v, 4), S::set1_i8(0x0F)) }
}

/// [`Simd::q6k_field`] by a mask and a shift (the mask alone for `q = 2`). Masking to the field
/// and the one two bits from it (0x33, 0xCC) leaves only zeros where the 16-bit shifts land in
/// bits 6–7.
#[inline(always)]
unsafe fn q6k_field_by_shift<S: Simd>(hv: S::I, q: usize) -> S::I {
    // SAFETY: the CPU supports `S` (caller).
    unsafe {
        let h = S::and(hv, S::set1_i8(if q % 2 == 0 { 0x33 } else { 0xCCu8 as i8 }));
        match q {
            0 => S::shl16(h, 4),
            1 => S::shl16(h, 2),
            2 => h,
            _ => S::shr16(h, 2),
        }
    }
}

/// One lane width of one ISA. The kernels are written once against this trait; every method is
/// exact in integers, and the float methods are the IEEE operations named (no reassociation).
pub(crate) trait Simd: Copy {
    const LANES: usize;
    /// Q8_0: `q8dot` adds `Σ (w + 128) · x` (true) or `Σ w · x` (false).
    const Q8_BIASED: bool;
    /// The kernels sum products in i16 lanes ([`Self::maddubs`] + [`Self::add16`]) and widen
    /// once per sub-block with the scale as the other operand of `madd`, instead of a
    /// [`Self::dpbusd`] per line and a 32-bit multiply by the scale. Set where `dpbusd` is
    /// emulated (AVX2: `maddubs` + `madd` + `add`): 9 multiplies per row and Q4_K sub-block
    /// instead of 17. Integer sums either way, so the results are the same bits; each caller
    /// shows its sums stay in i16 range.
    const I16_SUMS: bool;
    type I: Copy;
    type F: Copy;
    unsafe fn zero() -> Self::I;
    unsafe fn fzero() -> Self::F;
    /// `4·LANES` bytes.
    unsafe fn load(p: *const u8) -> Self::I;
    /// The i32 at `p` in every lane.
    unsafe fn bcast(p: *const u8) -> Self::I;
    unsafe fn set1_i8(v: i8) -> Self::I;
    unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
    unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
    /// [`Self::bitsel`] is one instruction (`vpternlogd`), not three.
    const TERNLOG: bool;
    /// Bitwise select: the bits of `a` where `m` has ones, those of `b` elsewhere.
    unsafe fn bitsel(m: Self::I, a: Self::I, b: Self::I) -> Self::I;
    /// Logical shifts of 16-bit lanes.
    unsafe fn shr16(a: Self::I, s: u32) -> Self::I;
    unsafe fn shl16(a: Self::I, s: u32) -> Self::I;
    /// Each byte's high nibble as its value, 0–15: [`hi_nibbles_by_shift`], or one
    /// instruction where GFNI moves bits within bytes.
    #[inline(always)]
    unsafe fn hi_nibbles(v: Self::I) -> Self::I {
        // SAFETY: the CPU supports `Self` (caller).
        unsafe { hi_nibbles_by_shift::<Self>(v) }
    }
    /// Q6_K's high-bit lines: field `q` (bits `2q`, `2q + 1`) of each byte at bits 4–5, zeros
    /// at bits 6–7; bits 0–3 are left unspecified, for a select that takes them from elsewhere
    /// ([`q6k_unpack`]). [`q6k_field_by_shift`], or one instruction with GFNI.
    #[inline(always)]
    unsafe fn q6k_field(hv: Self::I, q: usize) -> Self::I {
        // SAFETY: the CPU supports `Self` (caller).
        unsafe { q6k_field_by_shift::<Self>(hv, q) }
    }
    /// `acc + Σ₄ u8(a) · i8(b)` per i32 lane.
    unsafe fn dpbusd(acc: Self::I, a: Self::I, b: Self::I) -> Self::I;
    /// `acc + Σ₂ i16(a) · i16(b)` per i32 lane.
    unsafe fn dpwssd(acc: Self::I, a: Self::I, b: Self::I) -> Self::I;
    /// Per i16 lane: `u8(a) · i8(b)` summed over its two bytes (saturating; the callers stay
    /// below saturation: two products of at most 63 · 127).
    unsafe fn maddubs(a: Self::I, b: Self::I) -> Self::I;
    /// Wrapping i16 lane add (intermediate wraps cancel when the final sum is in range).
    unsafe fn add16(a: Self::I, b: Self::I) -> Self::I;
    /// Each i32 lane's low i16 as both of its i16 halves (a sign-extended i8 scale as the
    /// pair `(s, s)`).
    unsafe fn dup16(a: Self::I) -> Self::I;
    /// Q8_0 dot with `w` stored as `w + 128` (see [`Self::Q8_BIASED`]).
    unsafe fn q8dot(acc: Self::I, w: Self::I, x: Self::I) -> Self::I;
    unsafe fn add(a: Self::I, b: Self::I) -> Self::I;
    /// LANES bytes, zero- / sign-extended to i32.
    unsafe fn load_u8_i32(p: *const u8) -> Self::I;
    unsafe fn load_i8_i32(p: *const u8) -> Self::I;
    /// `2·LANES` bytes zero-extended to i16.
    unsafe fn load_u8_i16(p: *const u8) -> Self::I;
    /// Two rows of u8 scales 16 bytes apart as i16 pairs: lane `c` is `(p[c], p[16 + c])`.
    unsafe fn load_u8_pair16(p: *const u8) -> Self::I;
    /// LANES f16 values.
    unsafe fn load_f16(p: *const u8) -> Self::F;
    unsafe fn fbcast(v: f32) -> Self::F;
    unsafe fn cvt(a: Self::I) -> Self::F;
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// `a · b + c`, fused.
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `c − a · b`, fused.
    unsafe fn fnmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// Store all LANES values.
    unsafe fn store(p: *mut f32, v: Self::F);
    /// Load LANES values.
    unsafe fn fload(p: *const f32) -> Self::F;
}

/// Portable model of the 16 lanes.
#[derive(Clone, Copy)]
pub(crate) struct Scalar;

impl Simd for Scalar {
    const LANES: usize = 16;
    const Q8_BIASED: bool = true;
    const I16_SUMS: bool = false;
    type I = [u32; 16];
    type F = [f32; 16];
    #[inline(always)]
    unsafe fn zero() -> [u32; 16] {
        [0; 16]
    }
    #[inline(always)]
    unsafe fn fzero() -> [f32; 16] {
        [0.0; 16]
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> [u32; 16] {
        // SAFETY: caller: 64 readable bytes.
        std::array::from_fn(|i| unsafe { (p.add(4 * i) as *const u32).read_unaligned() })
    }
    #[inline(always)]
    unsafe fn bcast(p: *const u8) -> [u32; 16] {
        // SAFETY: caller: 4 readable bytes.
        [unsafe { (p as *const u32).read_unaligned() }; 16]
    }
    #[inline(always)]
    unsafe fn set1_i8(v: i8) -> [u32; 16] {
        [u32::from_ne_bytes([v as u8; 4]); 16]
    }
    #[inline(always)]
    unsafe fn and(a: [u32; 16], b: [u32; 16]) -> [u32; 16] {
        std::array::from_fn(|i| a[i] & b[i])
    }
    #[inline(always)]
    unsafe fn or(a: [u32; 16], b: [u32; 16]) -> [u32; 16] {
        std::array::from_fn(|i| a[i] | b[i])
    }
    // The scalar model keeps the and/or forms of the kernels: the tests compare the
    // `vpternlogd` forms of the AVX-512 path against them.
    const TERNLOG: bool = false;
    #[inline(always)]
    unsafe fn bitsel(m: [u32; 16], a: [u32; 16], b: [u32; 16]) -> [u32; 16] {
        std::array::from_fn(|i| (a[i] & m[i]) | (b[i] & !m[i]))
    }
    #[inline(always)]
    unsafe fn shr16(a: [u32; 16], s: u32) -> [u32; 16] {
        let keep = (0xFFFFu32 >> s) * 0x0001_0001;
        std::array::from_fn(|i| (a[i] >> s) & keep)
    }
    #[inline(always)]
    unsafe fn shl16(a: [u32; 16], s: u32) -> [u32; 16] {
        let keep = ((0xFFFFu32 << s) & 0xFFFF) * 0x0001_0001;
        std::array::from_fn(|i| (a[i] << s) & keep)
    }
    #[inline(always)]
    unsafe fn dpbusd(acc: [u32; 16], a: [u32; 16], b: [u32; 16]) -> [u32; 16] {
        std::array::from_fn(|i| {
            let (x, y) = (a[i].to_le_bytes(), b[i].to_le_bytes());
            let s: i32 = (0..4).map(|j| x[j] as i32 * y[j] as i8 as i32).sum();
            (acc[i] as i32).wrapping_add(s) as u32
        })
    }
    #[inline(always)]
    unsafe fn dpwssd(acc: [u32; 16], a: [u32; 16], b: [u32; 16]) -> [u32; 16] {
        std::array::from_fn(|i| {
            let lo = (a[i] as u16 as i16 as i32) * (b[i] as u16 as i16 as i32);
            let hi = ((a[i] >> 16) as u16 as i16 as i32) * ((b[i] >> 16) as u16 as i16 as i32);
            (acc[i] as i32).wrapping_add(lo).wrapping_add(hi) as u32
        })
    }
    #[inline(always)]
    unsafe fn maddubs(a: [u32; 16], b: [u32; 16]) -> [u32; 16] {
        std::array::from_fn(|i| {
            let (x, y) = (a[i].to_le_bytes(), b[i].to_le_bytes());
            let pair = |j: usize| {
                let s = x[j] as i32 * y[j] as i8 as i32 + x[j + 1] as i32 * y[j + 1] as i8 as i32;
                s.clamp(i16::MIN as i32, i16::MAX as i32) as i16 as u16 as u32
            };
            pair(0) | (pair(2) << 16)
        })
    }
    #[inline(always)]
    unsafe fn add16(a: [u32; 16], b: [u32; 16]) -> [u32; 16] {
        std::array::from_fn(|i| {
            let lo = (a[i] as u16).wrapping_add(b[i] as u16) as u32;
            let hi = ((a[i] >> 16) as u16).wrapping_add((b[i] >> 16) as u16) as u32;
            lo | (hi << 16)
        })
    }
    #[inline(always)]
    unsafe fn dup16(a: [u32; 16]) -> [u32; 16] {
        std::array::from_fn(|i| (a[i] & 0xFFFF) | (a[i] << 16))
    }
    #[inline(always)]
    unsafe fn q8dot(acc: [u32; 16], w: [u32; 16], x: [u32; 16]) -> [u32; 16] {
        // SAFETY: pure lane arithmetic.
        unsafe { Self::dpbusd(acc, w, x) }
    }
    #[inline(always)]
    unsafe fn add(a: [u32; 16], b: [u32; 16]) -> [u32; 16] {
        std::array::from_fn(|i| a[i].wrapping_add(b[i]))
    }
    #[inline(always)]
    unsafe fn load_u8_i32(p: *const u8) -> [u32; 16] {
        // SAFETY: caller: 16 readable bytes.
        std::array::from_fn(|i| unsafe { *p.add(i) } as u32)
    }
    #[inline(always)]
    unsafe fn load_i8_i32(p: *const u8) -> [u32; 16] {
        // SAFETY: caller: 16 readable bytes.
        std::array::from_fn(|i| unsafe { *p.add(i) } as i8 as i32 as u32)
    }
    #[inline(always)]
    unsafe fn load_u8_i16(p: *const u8) -> [u32; 16] {
        // SAFETY: caller: 32 readable bytes.
        std::array::from_fn(|i| unsafe {
            *p.add(2 * i) as u32 | ((*p.add(2 * i + 1) as u32) << 16)
        })
    }
    #[inline(always)]
    unsafe fn load_u8_pair16(p: *const u8) -> [u32; 16] {
        // SAFETY: caller: 32 readable bytes.
        std::array::from_fn(|i| unsafe { *p.add(i) as u32 | ((*p.add(16 + i) as u32) << 16) })
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> [f32; 16] {
        // SAFETY: caller: 32 readable bytes.
        std::array::from_fn(|i| {
            f16_to_f32(unsafe { (p.add(2 * i) as *const u16).read_unaligned() })
        })
    }
    #[inline(always)]
    unsafe fn fbcast(v: f32) -> [f32; 16] {
        [v; 16]
    }
    #[inline(always)]
    unsafe fn cvt(a: [u32; 16]) -> [f32; 16] {
        std::array::from_fn(|i| a[i] as i32 as f32)
    }
    #[inline(always)]
    unsafe fn mul(a: [f32; 16], b: [f32; 16]) -> [f32; 16] {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn fmadd(a: [f32; 16], b: [f32; 16], c: [f32; 16]) -> [f32; 16] {
        std::array::from_fn(|i| a[i].mul_add(b[i], c[i]))
    }
    #[inline(always)]
    unsafe fn fnmadd(a: [f32; 16], b: [f32; 16], c: [f32; 16]) -> [f32; 16] {
        std::array::from_fn(|i| (-a[i]).mul_add(b[i], c[i]))
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: [f32; 16]) {
        // SAFETY: caller: 16 writable floats.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), p, 16) };
    }
    #[inline(always)]
    unsafe fn fload(p: *const f32) -> [f32; 16] {
        // SAFETY: caller: 16 readable floats.
        std::array::from_fn(|i| unsafe { *p.add(i) })
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;

    /// AVX-512 VNNI: 16 columns per register. `GFNI`: moves bits within bytes with
    /// `vgf2p8affineqb` ([`Simd::hi_nibbles`], [`Simd::q6k_field`]), one instruction where
    /// shifts and masks take two.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx512<const GFNI: bool>;

    /// `vgf2p8affineqb` of every byte of `v` with the bit matrix `m` (byte `7 − i` of `m`
    /// selects the bits of `v` whose parity becomes bit `i`). Written as `asm!` so that the
    /// functions around it need no `gfni` target feature: only [`Avx512<true>`] calls it, and
    /// only where the CPU has GFNI ([`Isa::Avx512Gfni`]).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn gf2p8affine(v: __m512i, m: u64) -> __m512i {
        // SAFETY: AVX-512 registers only; the caller checked GFNI and AVX-512 F.
        unsafe {
            let m = _mm512_set1_epi64(m as i64);
            let out: __m512i;
            std::arch::asm!(
                "vgf2p8affineqb {out}, {v}, {m}, 0",
                out = lateout(zmm_reg) out,
                v = in(zmm_reg) v,
                m = in(zmm_reg) m,
                options(pure, nomem, nostack, preserves_flags),
            );
            out
        }
    }

    /// The bit matrix that moves bits 4–7 of a byte to bits 0–3 and clears bits 4–7.
    const HI_NIBBLE: u64 = 0x1020_4080_0000_0000;

    /// The bit matrix that moves bits `2q`, `2q + 1` of a byte to bits 4–5 and clears the rest.
    const fn field_to_bits45(q: usize) -> u64 {
        ((1u64 << (2 * q)) << 24) | ((1u64 << (2 * q + 1)) << 16)
    }

    impl<const GFNI: bool> Simd for Avx512<GFNI> {
        const LANES: usize = 16;
        const Q8_BIASED: bool = true;
        const I16_SUMS: bool = false;
        type I = __m512i;
        type F = __m512;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn zero() -> __m512i {
            _mm512_setzero_si512()
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn fzero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn load(p: *const u8) -> __m512i {
            unsafe { _mm512_loadu_si512(p as *const _) }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn bcast(p: *const u8) -> __m512i {
            _mm512_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn set1_i8(v: i8) -> __m512i {
            _mm512_set1_epi8(v)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn and(a: __m512i, b: __m512i) -> __m512i {
            _mm512_and_si512(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn or(a: __m512i, b: __m512i) -> __m512i {
            _mm512_or_si512(a, b)
        }
        const TERNLOG: bool = true;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn bitsel(m: __m512i, a: __m512i, b: __m512i) -> __m512i {
            // Truth table over (m, a, b): m ? a : b.
            _mm512_ternarylogic_epi32::<0xCA>(m, a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn shr16(a: __m512i, s: u32) -> __m512i {
            _mm512_srl_epi16(a, _mm_cvtsi32_si128(s as i32))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn shl16(a: __m512i, s: u32) -> __m512i {
            _mm512_sll_epi16(a, _mm_cvtsi32_si128(s as i32))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn hi_nibbles(v: __m512i) -> __m512i {
            // SAFETY: `Avx512<true>` runs only where the CPU has GFNI; AVX-512 checked.
            unsafe {
                if GFNI {
                    gf2p8affine(v, HI_NIBBLE)
                } else {
                    hi_nibbles_by_shift::<Self>(v)
                }
            }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn q6k_field(hv: __m512i, q: usize) -> __m512i {
            // SAFETY: as above.
            unsafe {
                if GFNI {
                    gf2p8affine(hv, field_to_bits45(q))
                } else {
                    q6k_field_by_shift::<Self>(hv, q)
                }
            }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn dpbusd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
            _mm512_dpbusd_epi32(acc, a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn dpwssd(mut acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
            // Written out: for its generic tuning LLVM turns `_mm512_dpwssd_epi32` into
            // `vpmaddwd` + `vpaddd`, two instructions on the ports the `vpdpbusd`s need (the
            // scale and offset steps of a Q4_K block then cost as much as before they used it).
            unsafe {
                std::arch::asm!(
                    "vpdpwssd {acc}, {a}, {b}",
                    acc = inout(zmm_reg) acc,
                    a = in(zmm_reg) a,
                    b = in(zmm_reg) b,
                    options(pure, nomem, nostack, preserves_flags),
                );
            }
            acc
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn maddubs(a: __m512i, b: __m512i) -> __m512i {
            _mm512_maddubs_epi16(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn add16(a: __m512i, b: __m512i) -> __m512i {
            _mm512_add_epi16(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn dup16(a: __m512i) -> __m512i {
            _mm512_mask_blend_epi16(0xAAAA_AAAA, a, _mm512_slli_epi32::<16>(a))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn q8dot(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
            _mm512_dpbusd_epi32(acc, w, x)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn add(a: __m512i, b: __m512i) -> __m512i {
            _mm512_add_epi32(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn load_u8_i32(p: *const u8) -> __m512i {
            _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) })
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn load_i8_i32(p: *const u8) -> __m512i {
            _mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(p as *const __m128i) })
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn load_u8_i16(p: *const u8) -> __m512i {
            _mm512_cvtepu8_epi16(unsafe { _mm256_loadu_si256(p as *const __m256i) })
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn load_u8_pair16(p: *const u8) -> __m512i {
            let (a, b) = unsafe {
                (
                    _mm_loadu_si128(p as *const __m128i),
                    _mm_loadu_si128(p.add(16) as *const __m128i),
                )
            };
            let bytes = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
            _mm512_cvtepu8_epi16(bytes)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn load_f16(p: *const u8) -> __m512 {
            _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p as *const __m256i) })
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn fbcast(v: f32) -> __m512 {
            _mm512_set1_ps(v)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn cvt(a: __m512i) -> __m512 {
            _mm512_cvtepi32_ps(a)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn fnmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fnmadd_ps(a, b, c)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn store(p: *mut f32, v: __m512) {
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        unsafe fn fload(p: *const f32) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
        }
    }

    /// The 256-bit paths: 8 columns per register. `VNNI` selects `vpdpbusd` (AVX-VNNI) over
    /// the AVX2 `maddubs` + `madd` emulation.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx256<const VNNI: bool>;

    macro_rules! impl256 {
        ($vnni:literal, $tf:literal, $dpbusd:expr, $dpwssd:expr, $q8:expr, $biased:expr) => {
            impl Simd for Avx256<$vnni> {
                const LANES: usize = 8;
                const Q8_BIASED: bool = $biased;
                const I16_SUMS: bool = !$vnni;
                type I = __m256i;
                type F = __m256;
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn zero() -> __m256i {
                    _mm256_setzero_si256()
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn fzero() -> __m256 {
                    _mm256_setzero_ps()
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn load(p: *const u8) -> __m256i {
                    unsafe { _mm256_loadu_si256(p as *const __m256i) }
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn bcast(p: *const u8) -> __m256i {
                    _mm256_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn set1_i8(v: i8) -> __m256i {
                    _mm256_set1_epi8(v)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn and(a: __m256i, b: __m256i) -> __m256i {
                    _mm256_and_si256(a, b)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn or(a: __m256i, b: __m256i) -> __m256i {
                    _mm256_or_si256(a, b)
                }
                const TERNLOG: bool = false;
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn bitsel(m: __m256i, a: __m256i, b: __m256i) -> __m256i {
                    _mm256_or_si256(_mm256_and_si256(a, m), _mm256_andnot_si256(m, b))
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn shr16(a: __m256i, s: u32) -> __m256i {
                    _mm256_srl_epi16(a, _mm_cvtsi32_si128(s as i32))
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn shl16(a: __m256i, s: u32) -> __m256i {
                    _mm256_sll_epi16(a, _mm_cvtsi32_si128(s as i32))
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn dpbusd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
                    $dpbusd(acc, a, b)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn dpwssd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
                    $dpwssd(acc, a, b)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn maddubs(a: __m256i, b: __m256i) -> __m256i {
                    _mm256_maddubs_epi16(a, b)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn add16(a: __m256i, b: __m256i) -> __m256i {
                    _mm256_add_epi16(a, b)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn dup16(a: __m256i) -> __m256i {
                    _mm256_blend_epi16::<0b1010_1010>(a, _mm256_slli_epi32::<16>(a))
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn q8dot(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
                    $q8(acc, w, x)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn add(a: __m256i, b: __m256i) -> __m256i {
                    _mm256_add_epi32(a, b)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn load_u8_i32(p: *const u8) -> __m256i {
                    _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) })
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn load_i8_i32(p: *const u8) -> __m256i {
                    _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) })
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn load_u8_i16(p: *const u8) -> __m256i {
                    _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(p as *const __m128i) })
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn load_u8_pair16(p: *const u8) -> __m256i {
                    let (a, b) = unsafe {
                        (
                            _mm_loadl_epi64(p as *const __m128i),
                            _mm_loadl_epi64(p.add(16) as *const __m128i),
                        )
                    };
                    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b))
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn load_f16(p: *const u8) -> __m256 {
                    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) })
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn fbcast(v: f32) -> __m256 {
                    _mm256_set1_ps(v)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn cvt(a: __m256i) -> __m256 {
                    _mm256_cvtepi32_ps(a)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn mul(a: __m256, b: __m256) -> __m256 {
                    _mm256_mul_ps(a, b)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
                    _mm256_fmadd_ps(a, b, c)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn fnmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
                    _mm256_fnmadd_ps(a, b, c)
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn store(p: *mut f32, v: __m256) {
                    unsafe { _mm256_storeu_ps(p, v) }
                }
                #[inline]
                #[target_feature(enable = $tf)]
                unsafe fn fload(p: *const f32) -> __m256 {
                    unsafe { _mm256_loadu_ps(p) }
                }
            }
        };
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dpbusd_avx2(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
        _mm256_add_epi32(acc, p)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dpwssd_avx2(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
    }

    /// `Σ w · x` for `w` stored as `w + 128`: |w| · sign(x, w) keeps `maddubs` from saturating.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn q8dot_avx2(acc: __m256i, wb: __m256i, x: __m256i) -> __m256i {
        let w = _mm256_xor_si256(wb, _mm256_set1_epi8(-128));
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
        _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    fn dpbusd_vnni(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(acc, a, b)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    fn dpwssd_vnni(mut acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        // Written out for the reason given at the 512-bit `dpwssd`.
        unsafe {
            std::arch::asm!(
                "{{vex}} vpdpwssd {acc}, {a}, {b}",
                acc = inout(ymm_reg) acc,
                a = in(ymm_reg) a,
                b = in(ymm_reg) b,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        acc
    }

    impl256!(
        false,
        "avx2,fma,f16c",
        dpbusd_avx2,
        dpwssd_avx2,
        q8dot_avx2,
        false
    );
    impl256!(
        true,
        "avx2,fma,f16c,avxvnni",
        dpbusd_vnni,
        dpwssd_vnni,
        dpbusd_vnni,
        true
    );
}

// ---------------------------------------------------------------------------------------------
// Formats: repacking, dequantization and the per-block kernel.

/// A weight format with a repacked layout and a kernel.
pub(crate) trait Format: Send + Sync + 'static {
    const NAME: &'static str;
    /// The GGML block on disk.
    type Raw: Copy;
    type Act: ActBlock;
    /// Values per block.
    const BLOCK: usize;
    /// Bytes of quant data per (group, block): a multiple of 64.
    const MAIN: usize;
    /// Bytes of float scales per (group, block).
    const AUX: usize;
    /// Up to this many input rows, no software prefetch on AMD Zen 4 and later: the kernel
    /// reads the group's lines in address order slowly enough that Zen 4's hardware
    /// prefetcher alone keeps up, and the prefetches only cost (Q4_K at one row, measured on
    /// 8960 × 1536 from DRAM). Zen 3's does not keep up (see [`cpu_is_amd_zen4_or_later`]).
    /// Intel's L2 streamer stops at every 4 KiB page, so there the prefetch pays at every row
    /// count (decode of the 1.5B target 12–13 → 15–16 tokens/s on a Xeon, family 6 model 207,
    /// alternated runs). See [`pf_dist`].
    const PF_OFF_MAX_M: usize = 0;
    /// Rows of the widest tile on the 512-bit paths: 8, or 16 where the format's kernel takes
    /// 16 rows in one pass over each line ([`q4k_rows`], [`q6k_rows`]). Two 8-row tiles read
    /// each line twice, the second time from cache with no memory traffic to overlap: one
    /// thread, 8960 × 1536 from DRAM, Q4_K 172 → 189 G MAC/s, Q6_K 127 → 146.
    const WIDE_ROWS: usize = 8;
    fn decode(raw: &Self::Raw) -> ColBlock;
    /// Write column `col`'s block into a zeroed (group, block) slot.
    fn write(main: &mut [u8], aux: &mut [u8], col: usize, b: &ColBlock);
    fn read(main: &[u8], aux: &[u8], col: usize) -> ColBlock;
    /// Candle's dequantization of one block.
    fn dequant(b: &ColBlock, out: &mut [f32]);
    /// Accumulate one block for `R` rows into `out` (lanes of half `half` of the group).
    ///
    /// # Safety
    /// `main`/`aux` point at a (group, block) slot, `acts[r]` at live activation blocks; the
    /// CPU supports `S`'s features.
    unsafe fn block<S: Simd, const R: usize>(
        main: *const u8,
        aux: *const u8,
        half: usize,
        acts: &[*const Self::Act; R],
        out: &mut [S::F; R],
        pf: Pf,
    );

    /// Output columns of groups `groups` for `m` rows on AMX tiles, where this format has such
    /// a kernel and `m` is large enough for it (else `false`, and nothing is written).
    ///
    /// # Safety
    /// As [`Packed::columns`], with [`Isa::Amx`] available.
    unsafe fn columns_amx(
        _p: &Packed<Self>,
        _acts: &[Self::Act],
        _m: usize,
        _groups: std::ops::Range<usize>,
        _out: OutPtr,
    ) -> bool
    where
        Self: Sized,
    {
        false
    }
}

/// Software prefetch of one (group, block) slot further ahead, issued by a format's kernel in
/// `parts` pieces between its sub-blocks: a burst of all of a K-quant block's 36–52 lines at
/// once fills the miss buffers and stalls the loads the arithmetic waits for.
#[derive(Clone, Copy)]
pub(crate) struct Pf {
    /// Address of the slot's quant data to prefetch (0: none).
    main: usize,
    /// Address of its scales.
    aux: usize,
    /// End of the weight buffer (nothing at or past it is prefetched).
    end: usize,
    /// Address of the quant data to bring into L1 (0: none): a second, nearer stream over lines
    /// the far one has brought to L2 ([`pf_near`]).
    near: usize,
}

impl Pf {
    const NONE: Pf = Pf {
        main: 0,
        aux: 0,
        end: 0,
        near: 0,
    };

    /// Piece `i` of `parts` of a slot with `main_bytes` of quant data (the scales with piece 0).
    #[inline(always)]
    fn part(self, i: usize, parts: usize, main_bytes: usize) {
        if self.main == 0 {
            return;
        }
        let lines = main_bytes / 64;
        for l in (i * lines / parts)..((i + 1) * lines / parts) {
            prefetch(self.main + 64 * l, self.end);
            if self.near != 0 {
                prefetch_l1(self.near + 64 * l, self.end);
            }
        }
        if i == 0 {
            prefetch(self.aux, self.end);
        }
    }
}

/// Byte of the 4-bit plane holding value `k` of column `col` (`nk` k-groups per block), and
/// whether it is the high nibble.
#[inline]
fn nib_pos(k: usize, col: usize, nk: usize) -> (usize, bool) {
    let g = k / 4;
    let half = nk / 2;
    ((g % half) * 64 + 4 * col + k % 4, g >= half)
}

/// Column `col`'s `4·nk` values `q` (low 4 bits of each) into the nibble plane, one k-group
/// pair per step (a value at a time, the index arithmetic made the repack take most of the
/// load time).
fn put_nibs(plane: &mut [u8], col: usize, nk: usize, q: &[u8]) {
    let half = nk / 2;
    for g in 0..half {
        let (lo, hi) = (&q[4 * g..4 * g + 4], &q[4 * (g + half)..4 * (g + half) + 4]);
        for (i, d) in plane[64 * g + 4 * col..][..4].iter_mut().enumerate() {
            *d |= (lo[i] & 0xF) | ((hi[i] & 0xF) << 4);
        }
    }
}

fn get_nib(plane: &[u8], k: usize, col: usize, nk: usize) -> u8 {
    let (i, hi) = nib_pos(k, col, nk);
    if hi {
        plane[i] >> 4
    } else {
        plane[i] & 0xF
    }
}

/// The 4-bit values of k-group `g` (`nk` per block) for the lanes of `half`.
#[inline(always)]
unsafe fn nibbles<S: Simd>(plane: *const u8, g: usize, nk: usize, half: usize, m4: S::I) -> S::I {
    // SAFETY: caller: `plane` covers `nk / 2` lines.
    unsafe {
        let v = S::load(plane.add((g % (nk / 2)) * 64 + 32 * half));
        if g >= nk / 2 {
            S::hi_nibbles(v)
        } else {
            S::and(v, m4)
        }
    }
}

#[inline(always)]
unsafe fn bcast_q<A>(a: *const A, byte: usize) -> *const u8 {
    // SAFETY: caller: inside the block's `qs` (at offset 0 of both activation types).
    unsafe { (a as *const u8).add(byte) }
}

/// The i16 pair `(1, 1)`: `madd` with it widens i16 sums to i32.
const ONES16: u32 = 0x0001_0001;

/// Float epilogue of a block's integer sums, shared by the formats: `out += cvt(acc) · (d · xd)`
/// with the weights' scales `d` and each row's activation scale `xd`.
#[inline(always)]
unsafe fn epi32<S: Simd, A: ActBlock, const R: usize>(
    d: S::F,
    acc: &[S::I; R],
    acts: &[*const A; R],
    out: &mut [S::F; R],
) {
    for r in 0..R {
        // SAFETY: caller: live activation blocks.
        unsafe {
            let xd = S::fbcast((*acts[r]).d());
            out[r] = S::fmadd(S::cvt(acc[r]), S::mul(d, xd), out[r]);
        }
    }
}

/// One weight line `w` against the 4 activation bytes at `byte` of every row of the tile: into
/// i16 sums where [`Simd::I16_SUMS`], else by `dpbusd`, with the `odd` lines in a second chain
/// `b` for tiles of up to 2 rows (`vpdpbusd` needs independent chains, see [`q4k_pair`]).
#[inline(always)]
unsafe fn dot_line<S: Simd, A, const R: usize>(
    a: &mut [S::I; R],
    b: &mut [S::I; R],
    w: S::I,
    acts: &[*const A; R],
    byte: usize,
    odd: bool,
) {
    for r in 0..R {
        // SAFETY: caller: `byte` lies inside the rows' activation blocks.
        let x = unsafe { S::bcast(bcast_q(acts[r], byte)) };
        // SAFETY: the CPU supports `S` (caller).
        unsafe {
            if S::I16_SUMS {
                a[r] = S::add16(a[r], S::maddubs(w, x));
            } else if R <= 2 && odd {
                b[r] = S::dpbusd(b[r], w, x);
            } else {
                a[r] = S::dpbusd(a[r], w, x);
            }
        }
    }
}

/// The [`dot_line`] sums of each row times the sub-block scales `sc` (i32 lanes), added to
/// `sumi`: one `madd` with the scale pairs from i16 sums, else one `vpdpwssd` of the chains'
/// total (an offset-started chain, in i16 range) with `sc` (the scale in each lane's low i16,
/// 0 in the high one), as [`scale_chains`] explains.
#[inline(always)]
unsafe fn add_scaled<S: Simd, const R: usize>(
    sumi: &mut [S::I; R],
    a: &[S::I; R],
    b: &[S::I; R],
    sc: S::I,
) {
    // SAFETY: the CPU supports `S` (caller).
    unsafe {
        if S::I16_SUMS {
            let sc = S::dup16(sc);
            for r in 0..R {
                sumi[r] = S::dpwssd(sumi[r], a[r], sc);
            }
        } else {
            let s: [S::I; R] =
                std::array::from_fn(|r| if R <= 2 { S::add(a[r], b[r]) } else { a[r] });
            scale_chains::<S, R>(sumi, &s, sc);
        }
    }
}

/// The [`dot_line`] sums of each row as i32 lanes, in `a`.
#[inline(always)]
unsafe fn widen<S: Simd, const R: usize>(a: &mut [S::I; R], b: &[S::I; R]) {
    // SAFETY: the CPU supports `S` (caller).
    unsafe {
        if S::I16_SUMS {
            let ones = S::bcast(&ONES16 as *const u32 as *const u8);
            for v in a.iter_mut() {
                *v = S::dpwssd(S::zero(), *v, ones);
            }
        } else if R <= 2 {
            for r in 0..R {
                a[r] = S::add(a[r], b[r]);
            }
        }
    }
}

/// `sumi += c · sc` per row, where every lane of `c` is in i16 range and `sc` holds a scale in
/// each lane's low i16 and 0 in its high one: then `vpdpwssd` multiplies exactly the chain by
/// the scale (the chain's high i16 is its sign, times 0). One instruction where a 32-bit
/// multiply and an add were three (`vpmulld` is two on Intel), with the same integer result.
/// The chains get into i16 range by starting at an offset (`init8`, `init32` of [`ActK`]):
/// Q4_K's 32 values of `q − 8` reach at most 32 · 8 · 127 = 32,512 and Q6_K's 8 values of
/// `q − 32` the same, where whole Q6_K sub-blocks (16 values) would reach 65,024.
#[inline(always)]
unsafe fn scale_chains<S: Simd, const R: usize>(sumi: &mut [S::I; R], c: &[S::I; R], sc: S::I) {
    for r in 0..R {
        // SAFETY: the CPU supports `S` (caller).
        sumi[r] = unsafe { S::dpwssd(sumi[r], c[r], sc) };
    }
}

/// The i32 `0x0000_FFFF`: keeps each lane's low i16.
const LO16: u32 = 0x0000_FFFF;

/// Q6_K sub-block `sb`'s scales for [`scale_chains`]: the i8 in the low i16, 0 above (`dup16`
/// makes the i16 pairs of [`Simd::I16_SUMS`] from the same).
#[inline(always)]
unsafe fn q6k_scale<S: Simd>(main: *const u8, sb: usize, half: usize) -> S::I {
    // SAFETY: inside the (group, block) slot (caller).
    unsafe {
        let sc = S::load_i8_i32(main.add(3072 + 16 * sb + S::LANES * half));
        S::and(sc, S::bcast(&LO16 as *const u32 as *const u8))
    }
}

/// The i32 accumulators of a tile, each starting at an i32 of its row's activation block at
/// `field` + `i` (the offset sums of [`ActK`]).
#[inline(always)]
unsafe fn start_at<S: Simd, const R: usize>(
    acts: &[*const ActK; R],
    field: impl Fn(&ActK) -> &[i32],
    i: usize,
) -> [S::I; R] {
    // SAFETY: live activation blocks (caller); `i` inside the field (callers' constants).
    std::array::from_fn(|r| unsafe { S::bcast(field(&*acts[r])[i..].as_ptr() as *const u8) })
}

/// Q4_K sub-block `4·HI + j` (k-groups `8j..8j+8` of the low or high nibbles): its integer
/// dot times its scale, added to `sumi`. With i32 chains, the weights count as `q − 8` (see
/// [`scale_chains`]); the block adds the `8 · Σ scale · Σx` back.
#[inline(always)]
unsafe fn q4k_sub<S: Simd, const R: usize, const HI: bool>(
    main: *const u8,
    j: usize,
    half: usize,
    acts: &[*const ActK; R],
    sumi: &mut [S::I; R],
) {
    // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
    unsafe {
        let m4 = S::set1_i8(0x0F);
        let sb = 4 * HI as usize + j;
        let sc = S::load_u8_i32(main.add(2048 + 16 * sb + S::LANES * half));
        // With i16 sums, each lane sums 16 products of at most 15 · 127: 30,480.
        let mut a = if S::I16_SUMS {
            [S::zero(); R]
        } else {
            start_at::<S, R>(acts, |a| &a.init32, sb)
        };
        let mut b = [S::zero(); R];
        // One base pointer per sub-block, so the unrolled lines below load at constant
        // displacements from it: written as `64 · (8j + t)`, the compiler spent a `lea` and a
        // shift per line (a third of the one-row loop's instructions; Zen 3, AVX2).
        let lines = main.add(512 * j + 32 * half);
        let acts_at = 4 * (32 * HI as usize + 8 * j);
        for t in 0..8 {
            let v = S::load(lines.add(64 * t));
            let w = if HI { S::hi_nibbles(v) } else { S::and(v, m4) };
            dot_line::<S, _, R>(&mut a, &mut b, w, acts, acts_at + 4 * t, t % 2 == 1);
        }
        add_scaled::<S, R>(sumi, &a, &b, sc);
    }
}

/// Q4_K sub-blocks `j` and `4 + j` at once: they are the low and high nibbles of the same 8
/// lines, so each line is loaded once for both, and every row gets two independent
/// accumulators. `vpdpbusd` has a latency of about 5–6 cycles and two ports, so it takes about
/// 12 independent chains to keep it busy: with one chain per row (the [`q4k_sub`] loop) a tile
/// of 4 rows ran at 29 % of the peak, paired at 40 % (8 rows: 40 → 47 %; Xeon family 6 model
/// 207, weights in cache). Integer sums only, so the result equals two [`q4k_sub`] calls
/// exactly. i32 chains only (weights as `q − 8`, see [`scale_chains`]).
///
/// `RAW` (every row [`FITS_Q4K_RAW`]): the chains start at 0 and take the weights as they are,
/// and the block adds nothing back ([`q4k_finish`]'s `offset`): the same sums, 4 `vpdpwssd` per
/// row and block fewer.
#[inline(always)]
unsafe fn q4k_pair<S: Simd, const R: usize, const RAW: bool>(
    main: *const u8,
    j: usize,
    half: usize,
    acts: &[*const ActK; R],
    sumi: &mut [S::I; R],
) {
    // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
    unsafe {
        let m4 = S::set1_i8(0x0F);
        let (mut lo, mut hi) = if RAW {
            ([S::zero(); R], [S::zero(); R])
        } else {
            (
                start_at::<S, R>(acts, |a| &a.init32, j),
                start_at::<S, R>(acts, |a| &a.init32, 4 + j),
            )
        };
        for t in 0..8 {
            let c = 8 * j + t;
            let v = S::load(main.add(64 * c + 32 * half));
            let wl = S::and(v, m4);
            let wh = S::hi_nibbles(v);
            for r in 0..R {
                let xl = S::bcast(bcast_q(acts[r], 4 * c));
                lo[r] = S::dpbusd(lo[r], wl, xl);
                let xh = S::bcast(bcast_q(acts[r], 4 * (32 + c)));
                hi[r] = S::dpbusd(hi[r], wh, xh);
            }
        }
        let scl = S::load_u8_i32(main.add(2048 + 16 * j + S::LANES * half));
        let sch = S::load_u8_i32(main.add(2048 + 16 * (4 + j) + S::LANES * half));
        scale_chains::<S, R>(sumi, &lo, scl);
        scale_chains::<S, R>(sumi, &hi, sch);
    }
}

/// Q4_K sub-block `4·HI + j` for a wide tile ([`Format::WIDE_ROWS`] rows): its eight lines are
/// unpacked once, then each row runs one chain over them and scales it into `sumi` at once, as
/// [`q6k_rows`] does for Q6_K. `RAW` as in [`q4k_pair`]; integer sums only, so the result
/// equals [`q4k_pair`]'s exactly.
#[inline(always)]
unsafe fn q4k_rows<S: Simd, const R: usize, const HI: bool, const RAW: bool>(
    main: *const u8,
    j: usize,
    half: usize,
    acts: &[*const ActK; R],
    sumi: &mut [S::I; R],
) {
    // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
    unsafe {
        let m4 = S::set1_i8(0x0F);
        let sb = 4 * HI as usize + j;
        // A loop, not `array::from_fn` (see [`q6k_lines`]).
        let mut w = [S::zero(); 8];
        for (t, wt) in w.iter_mut().enumerate() {
            let v = S::load(main.add(64 * (8 * j + t) + 32 * half));
            *wt = if HI { S::hi_nibbles(v) } else { S::and(v, m4) };
        }
        let sc = S::load_u8_i32(main.add(2048 + 16 * sb + S::LANES * half));
        let byte = |t: usize| 4 * (32 * HI as usize + 8 * j + t);
        // All rows' chains at once (16 registers; the 8-long chains need that many in flight
        // to keep `vpdpbusd` busy). The sums stay in memory (volatile: read and written once
        // per sub-block), else LLVM kept them in registers too and ran one chain at a time:
        // 157 against 197 G MAC/s in cache.
        let mut c = [S::zero(); R];
        if !RAW {
            for (r, cr) in c.iter_mut().enumerate() {
                let a = acts[r];
                *cr = S::bcast(std::ptr::addr_of!((*a).init32).cast::<i32>().add(sb) as *const u8);
            }
        }
        for (t, &wt) in w.iter().enumerate() {
            for (r, cr) in c.iter_mut().enumerate() {
                *cr = S::dpbusd(*cr, wt, S::bcast(bcast_q(acts[r], byte(t))));
            }
        }
        for (r, &cr) in c.iter().enumerate() {
            let p = &mut sumi[r] as *mut S::I;
            p.write_volatile(S::dpwssd(p.read_volatile(), cr, sc));
        }
    }
}

/// Quarter `q` of a Q6_K block as bytes of 6-bit values: the nibbles of line `v` (low ones for
/// quarters 0 and 1) with the 2-bit field `q` of the high-bit line `hv` as bits 4–5.
#[inline(always)]
unsafe fn q6k_unpack<S: Simd>(v: S::I, hv: S::I, q: usize) -> S::I {
    // SAFETY: the CPU supports `S` (caller).
    unsafe {
        let m4 = S::set1_i8(0x0F);
        if S::TERNLOG {
            // Two instructions fewer per line: bits 0–3 come from the nibbles and bits 4–7
            // from the field moved to bits 4–5 (zeros above it, [`Simd::q6k_field`]), in one
            // select, which drops whatever the 16-bit shifts carry into bits 0–3.
            let nib = if q >= 2 { S::shr16(v, 4) } else { v };
            S::bitsel(m4, nib, S::q6k_field(hv, q))
        } else {
            let lo = if q >= 2 {
                S::hi_nibbles(v)
            } else {
                S::and(v, m4)
            };
            let hb = match q {
                0 => S::shl16(hv, 4),
                1 => S::shl16(hv, 2),
                2 => hv,
                _ => S::shr16(hv, 2),
            };
            S::or(lo, S::and(hb, S::set1_i8(0x30)))
        }
    }
}

/// Q6_K sub-blocks `j`, `4 + j`, `8 + j`, `12 + j` (all four quarters) at once: each low-bit
/// line and each high-bit line is loaded once for all of them (3 loads per 4 k-groups, against
/// 8 in [`q6k_sub`]). The accumulators restart at each half sub-block ([`scale_chains`]).
/// Integer sums only, so the result equals [`q6k_sub`]'s exactly.
///
/// `WHOLE` (every row [`FITS_Q6K_WHOLE`]): one chain per sub-block, from [`ActK::init16`].
#[inline(always)]
unsafe fn q6k_quad<S: Simd, const R: usize, const WHOLE: bool>(
    main: *const u8,
    j: usize,
    half: usize,
    acts: &[*const ActK; R],
    sumi: &mut [S::I; R],
) {
    // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
    unsafe {
        let sc: [S::I; 4] = std::array::from_fn(|q| q6k_scale::<S>(main, 4 * q + j, half));
        // Chains over half a sub-block (2 lines) each, or over whole ones (4 lines).
        let (passes, lines) = if WHOLE { (1, 4) } else { (2, 2) };
        for h in 0..passes {
            let mut a: [[S::I; R]; 4] = std::array::from_fn(|q| {
                if WHOLE {
                    start_at::<S, R>(acts, |a| &a.init16, 4 * q + j)
                } else {
                    start_at::<S, R>(acts, |a| &a.init8, 2 * (4 * q + j) + h)
                }
            });
            for t in lines * h..lines * h + lines {
                let l = 4 * j + t;
                let hv = S::load(main.add(2048 + 64 * l + 32 * half));
                let va = S::load(main.add(64 * l + 32 * half));
                let vb = S::load(main.add(64 * (16 + l) + 32 * half));
                for (q, aq) in a.iter_mut().enumerate() {
                    let w = q6k_unpack::<S>(if q % 2 == 1 { vb } else { va }, hv, q);
                    let g = 16 * q + l;
                    for r in 0..R {
                        let x = S::bcast(bcast_q(acts[r], 4 * g));
                        aq[r] = S::dpbusd(aq[r], w, x);
                    }
                }
            }
            for (aq, &s) in a.iter().zip(&sc) {
                scale_chains::<S, R>(sumi, aq, s);
            }
        }
    }
}

/// Q6_K sub-blocks `4·P + j` and `4·(P + 2) + j` at once (quarters `P` and `P + 2`): the
/// low and high nibbles of the same low-bit lines and the same high-bit lines, loaded once for
/// both, with two independent accumulators per row (see [`q4k_pair`] for why that matters),
/// restarted at each half sub-block ([`scale_chains`]). Integer sums only, so the result
/// equals two [`q6k_sub`] calls exactly.
///
/// `WHOLE` (every row [`FITS_Q6K_WHOLE`]): one chain per sub-block, from [`ActK::init16`],
/// and one scale step where there were two.
#[inline(always)]
unsafe fn q6k_pair<S: Simd, const R: usize, const P: usize, const WHOLE: bool>(
    main: *const u8,
    j: usize,
    half: usize,
    acts: &[*const ActK; R],
    sumi: &mut [S::I; R],
) {
    // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
    unsafe {
        let (sa, sb) = (4 * P + j, 4 * (P + 2) + j);
        let (sca, scb) = (
            q6k_scale::<S>(main, sa, half),
            q6k_scale::<S>(main, sb, half),
        );
        let (passes, lines) = if WHOLE { (1, 4) } else { (2, 2) };
        for h in 0..passes {
            let (mut a, mut b) = if WHOLE {
                (
                    start_at::<S, R>(acts, |a| &a.init16, sa),
                    start_at::<S, R>(acts, |a| &a.init16, sb),
                )
            } else {
                (
                    start_at::<S, R>(acts, |a| &a.init8, 2 * sa + h),
                    start_at::<S, R>(acts, |a| &a.init8, 2 * sb + h),
                )
            };
            for t in lines * h..lines * h + lines {
                let l = 4 * j + t;
                let v = S::load(main.add(64 * (16 * P + l) + 32 * half));
                let hv = S::load(main.add(2048 + 64 * l + 32 * half));
                let wa = q6k_unpack::<S>(v, hv, P);
                let wb = q6k_unpack::<S>(v, hv, P + 2);
                let (ga, gb) = (16 * P + l, 16 * (P + 2) + l);
                for r in 0..R {
                    a[r] = S::dpbusd(a[r], wa, S::bcast(bcast_q(acts[r], 4 * ga)));
                    b[r] = S::dpbusd(b[r], wb, S::bcast(bcast_q(acts[r], 4 * gb)));
                }
            }
            scale_chains::<S, R>(sumi, &a, sca);
            scale_chains::<S, R>(sumi, &b, scb);
        }
    }
}

/// The four lines of Q6_K sub-block `4·Q + j` unpacked to 6-bit values ([`q6k_unpack`]).
#[inline(always)]
unsafe fn q6k_lines<S: Simd, const Q: usize>(main: *const u8, j: usize, half: usize) -> [S::I; 4] {
    // SAFETY: offsets inside the (group, block) slot (caller).
    unsafe {
        // Base pointers per sub-block, as in [`q4k_sub`].
        let lo_lines = main.add(64 * (16 * (Q % 2) + 4 * j) + 32 * half);
        let hi_lines = main.add(2048 + 256 * j + 32 * half);
        // A loop, not `array::from_fn`: from here its closure was not inlined (16 rows 121
        // against 154 G MAC/s in cache).
        let mut w = [S::zero(); 4];
        for (t, wt) in w.iter_mut().enumerate() {
            let (v, hv) = (S::load(lo_lines.add(64 * t)), S::load(hi_lines.add(64 * t)));
            *wt = q6k_unpack::<S>(v, hv, Q);
        }
        w
    }
}

/// Q6_K sub-block `4·Q + j` (k-groups `16Q + 4j ..+4`; quarter `Q` fixes the nibble and the
/// shift of the high bits): scale · (dot − 32 Σx), added to `sumi`.
#[inline(always)]
unsafe fn q6k_sub<S: Simd, const R: usize, const Q: usize>(
    main: *const u8,
    j: usize,
    half: usize,
    acts: &[*const ActK; R],
    sumi: &mut [S::I; R],
) {
    // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
    unsafe {
        let w = q6k_lines::<S, Q>(main, j, half);
        q6k_dot::<S, R>(&w, main, 4 * Q + j, half, acts, sumi);
    }
}

/// The dot of Q6_K sub-block `sb` (k-groups `4·sb..4·sb + 4`), its four lines `w` unpacked to
/// 6-bit values, with every row of the tile: scale · (dot − 32 Σx), added to `sumi`. The same
/// for both layouts ([`Q6K`], [`Q6KLines`]), which differ only in how the lines are unpacked.
#[inline(always)]
unsafe fn q6k_dot<S: Simd, const R: usize>(
    w: &[S::I; 4],
    main: *const u8,
    sb: usize,
    half: usize,
    acts: &[*const ActK; R],
    sumi: &mut [S::I; R],
) {
    // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
    unsafe {
        let g0 = 4 * sb;
        let sc = q6k_scale::<S>(main, sb, half);
        // The sums start at the −32 offset. With i16 sums each lane ends at the sum of 8
        // products (w − 32) · x, at most 32 · 127 each: 32,512; `maddubs` itself sees two
        // products of at most 63 · 127, and the wrapping adds in between cancel.
        if S::I16_SUMS {
            // Row by row: one row's i16 sums live at a time (two chains of two lines) instead
            // of all `R` across the lines, so the tile's i32 sums stay in registers (Zen 3,
            // AVX2: 8 rows spilled them on every sub-block). Wrapping i16 adds in any order
            // end at the same in-range value.
            let sc = S::dup16(sc);
            for r in 0..R {
                let x = |t: usize| S::bcast(bcast_q(acts[r], 4 * (g0 + t)));
                let init = S::bcast((*acts[r]).off16p.as_ptr().add(sb) as *const u8);
                let lo = S::add16(init, S::maddubs(w[0], x(0)));
                let hi = S::maddubs(w[1], x(1));
                let lo = S::add16(lo, S::maddubs(w[2], x(2)));
                let hi = S::add16(hi, S::maddubs(w[3], x(3)));
                sumi[r] = S::dpwssd(sumi[r], S::add16(lo, hi), sc);
            }
        } else {
            // i32 chains, one per half sub-block ([`scale_chains`]).
            for h in 0..2 {
                let mut a = start_at::<S, R>(acts, |a| &a.init8, 2 * sb + h);
                let mut b = [S::zero(); R];
                for t in 2 * h..2 * h + 2 {
                    dot_line::<S, _, R>(&mut a, &mut b, w[t], acts, 4 * (g0 + t), t % 2 == 1);
                }
                add_scaled::<S, R>(sumi, &a, &b, sc);
            }
        }
    }
}

/// Q6_K sub-block `4·Q + j` for a wide tile ([`Format::WIDE_ROWS`] rows): its four lines are
/// unpacked once, then each row runs one short chain over them (one per half sub-block unless
/// `WHOLE`) and scales it into `sumi` at once, so only the `R` sums stay live. [`q6k_pair`]
/// keeps two chains per row live and spilled them at 16 rows; two 8-row passes each unpacked
/// the same lines again (a sixth of the work on the 512-bit path). Integer sums only, so the
/// result equals [`q6k_sub`]'s exactly.
#[inline(always)]
unsafe fn q6k_rows<S: Simd, const R: usize, const Q: usize, const WHOLE: bool>(
    main: *const u8,
    j: usize,
    half: usize,
    acts: &[*const ActK; R],
    sumi: &mut [S::I; R],
) {
    // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
    unsafe {
        let w = q6k_lines::<S, Q>(main, j, half);
        let sb = 4 * Q + j;
        let sc = q6k_scale::<S>(main, sb, half);
        let x = |r: usize, t: usize| S::bcast(bcast_q(acts[r], 4 * (4 * sb + t)));
        // Four rows at a time: four independent chains, written out for each group of four
        // (R is 16 here; as a loop over the groups, LLVM kept the sums in memory). The chains
        // are short, so four in flight per group keep `vpdpbusd` busy; all 16 at once with the
        // sums in memory, as [`q4k_rows`] does, ran 2 % slower.
        let (passes, lines) = if WHOLE { (1, 4) } else { (2, 2) };
        macro_rules! rows_by {
            ($r4:literal) => {
                for h in 0..passes {
                    let mut c = [S::zero(); N];
                    for (i, ci) in c.iter_mut().enumerate() {
                        let a = acts[$r4 + i];
                        let init = if WHOLE {
                            std::ptr::addr_of!((*a).init16).cast::<i32>().add(sb)
                        } else {
                            std::ptr::addr_of!((*a).init8).cast::<i32>().add(2 * sb + h)
                        };
                        *ci = S::bcast(init as *const u8);
                    }
                    for t in lines * h..lines * h + lines {
                        for (i, ci) in c.iter_mut().enumerate() {
                            *ci = S::dpbusd(*ci, w[t], x($r4 + i, t));
                        }
                    }
                    for (i, &ci) in c.iter().enumerate() {
                        sumi[$r4 + i] = S::dpwssd(sumi[$r4 + i], ci, sc);
                    }
                }
            };
        }
        debug_assert_eq!(R, 16);
        const N: usize = 4;
        rows_by!(0);
        rows_by!(4);
        rows_by!(8);
        rows_by!(12);
    }
}

/// Row tiles up to this size (on 512-bit lanes; half on 256-bit) run Q6_K four quarters at a
/// time ([`q6k_quad`]): `4·R` accumulators.
const Q6K_QUAD_MAX_R: usize = 4;

pub(crate) struct Q4K;
pub(crate) struct Q6K;
pub(crate) struct Q5_0;
pub(crate) struct Q8_0;
pub(crate) struct Q4_1;

impl Format for Q4K {
    const NAME: &'static str = "Q4K";
    type Raw = BlockQ4K;
    type Act = ActK;
    const BLOCK: usize = QK_K;
    // 32 nibble lines, 8 × 16 scales, 4 × 32 mins.
    const MAIN: usize = 2048 + 128 + 128;
    const AUX: usize = 64;
    const WIDE_ROWS: usize = 16;
    const PF_OFF_MAX_M: usize = 1;

    #[cfg(target_arch = "x86_64")]
    unsafe fn columns_amx(
        p: &Packed<Q4K>,
        acts: &[ActK],
        m: usize,
        groups: std::ops::Range<usize>,
        out: OutPtr,
    ) -> bool {
        // SAFETY: the caller's contract.
        unsafe { amx::try_columns(p, acts, m, groups, out) }
    }

    fn decode(b: &BlockQ4K) -> ColBlock {
        let mut c = ColBlock::ZERO;
        let sm = q4k_scales_mins(&b.scales);
        c.sc[..8].copy_from_slice(&sm[..8]);
        c.mins.copy_from_slice(&sm[8..]);
        for j in 0..4 {
            for l in 0..32 {
                let q = b.qs[32 * j + l];
                c.q[64 * j + l] = q & 0xF;
                c.q[64 * j + 32 + l] = q >> 4;
            }
        }
        c.d = b.d;
        c.d2 = b.dmin;
        c
    }

    fn write(main: &mut [u8], aux: &mut [u8], col: usize, b: &ColBlock) {
        put_nibs(main, col, 64, &b.q);
        for j in 0..8 {
            main[2048 + 16 * j + col] = b.sc[j];
        }
        for p in 0..4 {
            main[2048 + 128 + 32 * p + 2 * col] = b.mins[2 * p];
            main[2048 + 128 + 32 * p + 2 * col + 1] = b.mins[2 * p + 1];
        }
        aux[2 * col..2 * col + 2].copy_from_slice(&b.d.to_le_bytes());
        aux[32 + 2 * col..32 + 2 * col + 2].copy_from_slice(&b.d2.to_le_bytes());
    }

    fn read(main: &[u8], aux: &[u8], col: usize) -> ColBlock {
        let mut c = ColBlock::ZERO;
        for k in 0..QK_K {
            c.q[k] = get_nib(main, k, col, 64);
        }
        for j in 0..8 {
            c.sc[j] = main[2048 + 16 * j + col];
        }
        for p in 0..4 {
            c.mins[2 * p] = main[2048 + 128 + 32 * p + 2 * col];
            c.mins[2 * p + 1] = main[2048 + 128 + 32 * p + 2 * col + 1];
        }
        c.d = u16::from_le_bytes([aux[2 * col], aux[2 * col + 1]]);
        c.d2 = u16::from_le_bytes([aux[32 + 2 * col], aux[33 + 2 * col]]);
        c
    }

    fn dequant(b: &ColBlock, y: &mut [f32]) {
        let d = f16_to_f32(b.d);
        let dmin = f16_to_f32(b.d2);
        for j in 0..8 {
            let d1 = d * b.sc[j] as f32;
            let m1 = dmin * b.mins[j] as f32;
            for l in 0..32 {
                y[32 * j + l] = d1 * b.q[32 * j + l] as f32 - m1;
            }
        }
    }

    #[inline(always)]
    unsafe fn block<S: Simd, const R: usize>(
        main: *const u8,
        aux: *const u8,
        half: usize,
        acts: &[*const ActK; R],
        out: &mut [S::F; R],
        pf: Pf,
    ) {
        // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
        unsafe {
            let mut sumi = [S::zero(); R];
            // Raw chains where every row's values allow it (the paired loop only).
            let raw = S::LANES == 16 && !S::I16_SUMS && all_fit(acts, FITS_Q4K_RAW);
            if S::LANES == 16 {
                // 32 registers hold two accumulators per row (16 for the 256-bit paths would
                // spill); a wide tile's 16 rows run one chain each instead.
                let wide = R > 8 && !S::I16_SUMS;
                let s = &mut sumi;
                for j in 0..4 {
                    pf.part(j, 4, Self::MAIN);
                    match (wide, raw) {
                        (true, true) => {
                            q4k_rows::<S, R, false, true>(main, j, half, acts, s);
                            q4k_rows::<S, R, true, true>(main, j, half, acts, s);
                        }
                        (true, false) => {
                            q4k_rows::<S, R, false, false>(main, j, half, acts, s);
                            q4k_rows::<S, R, true, false>(main, j, half, acts, s);
                        }
                        (false, true) => q4k_pair::<S, R, true>(main, j, half, acts, s),
                        (false, false) => q4k_pair::<S, R, false>(main, j, half, acts, s),
                    }
                }
            } else {
                for j in 0..4 {
                    pf.part(j, 8, Self::MAIN);
                    q4k_sub::<S, R, false>(main, j, half, acts, &mut sumi);
                }
                for j in 0..4 {
                    pf.part(4 + j, 8, Self::MAIN);
                    q4k_sub::<S, R, true>(main, j, half, acts, &mut sumi);
                }
            }
            q4k_finish::<S, R>(main, aux, half, acts, &sumi, out, !raw);
        }
    }
}

/// The end of a Q4_K block for a tile of `R` rows, shared by the `vpdpbusd` and AMX paths:
/// `sumi` holds `Σ_j scale_j · dot_j` with i32 chains that took the weights as `q − 8` (or,
/// with [`Simd::I16_SUMS`], as `q`); add back what the offset took, then the float epilogue
/// of the scales and the mins. The same operations in the same order on every path, so the
/// float result depends only on the integer sums.
#[inline(always)]
unsafe fn q4k_finish<S: Simd, const R: usize>(
    main: *const u8,
    aux: *const u8,
    half: usize,
    acts: &[*const ActK; R],
    sumi: &[S::I; R],
    out: &mut [S::F; R],
    offset: bool,
) {
    // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
    unsafe {
        let lanes = S::LANES;
        let mut sumi = *sumi;
        if offset && !S::I16_SUMS {
            // The i32 chains took the weights as `q − 8` ([`scale_chains`]): add back
            // `8 · Σ_j scale_j · Σx_j`, one `vpdpwssd` per pair of sub-blocks.
            for p in 0..4 {
                let sc = S::load_u8_pair16(main.add(2048 + 32 * p + lanes * half));
                for r in 0..R {
                    let bs = S::bcast((*acts[r]).bs32p8.as_ptr().add(p) as *const u8);
                    sumi[r] = S::dpwssd(sumi[r], sc, bs);
                }
            }
        }
        epi32::<S, _, R>(S::load_f16(aux.add(2 * lanes * half)), &sumi, acts, out);
        let mut summ = [S::zero(); R];
        for p in 0..4 {
            let mp = S::load_u8_i16(main.add(2048 + 128 + 32 * p + 2 * lanes * half));
            for r in 0..R {
                let bs = S::bcast((*acts[r]).bs32p.as_ptr().add(p) as *const u8);
                summ[r] = S::dpwssd(summ[r], mp, bs);
            }
        }
        let dmin = S::load_f16(aux.add(32 + 2 * lanes * half));
        for r in 0..R {
            let xd = S::fbcast((*acts[r]).d);
            out[r] = S::fnmadd(S::cvt(summ[r]), S::mul(dmin, xd), out[r]);
        }
    }
}

impl Format for Q6K {
    const NAME: &'static str = "Q6K";
    type Raw = BlockQ6K;
    type Act = ActK;
    const BLOCK: usize = QK_K;
    // 32 low-nibble lines, 16 lines of 2-bit high parts, 16 × 16 scales.
    const MAIN: usize = 2048 + 1024 + 256;
    const AUX: usize = 32;
    const WIDE_ROWS: usize = 16;

    #[cfg(target_arch = "x86_64")]
    unsafe fn columns_amx(
        p: &Packed<Q6K>,
        acts: &[ActK],
        m: usize,
        groups: std::ops::Range<usize>,
        out: OutPtr,
    ) -> bool {
        // SAFETY: the caller's contract.
        unsafe { amx::try_columns(p, acts, m, groups, out) }
    }

    fn decode(b: &BlockQ6K) -> ColBlock {
        let mut c = ColBlock::ZERO;
        for h in 0..2 {
            for l in 0..32 {
                let (ql0, ql1) = (b.ql[64 * h + l], b.ql[64 * h + 32 + l]);
                let qh = b.qh[32 * h + l];
                c.q[128 * h + l] = (ql0 & 0xF) | ((qh & 3) << 4);
                c.q[128 * h + 32 + l] = (ql1 & 0xF) | (((qh >> 2) & 3) << 4);
                c.q[128 * h + 64 + l] = (ql0 >> 4) | (((qh >> 4) & 3) << 4);
                c.q[128 * h + 96 + l] = (ql1 >> 4) | (((qh >> 6) & 3) << 4);
            }
        }
        for j in 0..16 {
            c.sc[j] = b.scales[j] as u8;
        }
        c.d = b.d;
        c
    }

    fn write(main: &mut [u8], aux: &mut [u8], col: usize, b: &ColBlock) {
        put_nibs(main, col, 64, &b.q);
        // Bits 4–5 of k-group `g + 16·quarter` at bits `2·quarter` of line `g`.
        for g in 0..16 {
            for (i, d) in main[2048 + 64 * g + 4 * col..][..4].iter_mut().enumerate() {
                for quarter in 0..4 {
                    *d |= ((b.q[4 * (g + 16 * quarter) + i] >> 4) & 3) << (2 * quarter);
                }
            }
        }
        for j in 0..16 {
            main[3072 + 16 * j + col] = b.sc[j];
        }
        aux[2 * col..2 * col + 2].copy_from_slice(&b.d.to_le_bytes());
    }

    fn read(main: &[u8], aux: &[u8], col: usize) -> ColBlock {
        let mut c = ColBlock::ZERO;
        for k in 0..QK_K {
            let g = k / 4;
            let h = (main[2048 + (g % 16) * 64 + 4 * col + k % 4] >> (2 * (g / 16))) & 3;
            c.q[k] = get_nib(main, k, col, 64) | (h << 4);
        }
        for j in 0..16 {
            c.sc[j] = main[3072 + 16 * j + col];
        }
        c.d = u16::from_le_bytes([aux[2 * col], aux[2 * col + 1]]);
        c
    }

    fn dequant(b: &ColBlock, y: &mut [f32]) {
        let d = f16_to_f32(b.d);
        for (k, o) in y.iter_mut().enumerate().take(QK_K) {
            let q = b.q[k] as i32 - 32;
            *o = d * (b.sc[k / 16] as i8) as f32 * q as f32;
        }
    }

    #[inline(always)]
    unsafe fn block<S: Simd, const R: usize>(
        main: *const u8,
        aux: *const u8,
        half: usize,
        acts: &[*const ActK; R],
        out: &mut [S::F; R],
        pf: Pf,
    ) {
        // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
        unsafe {
            let lanes = S::LANES;
            let mut sumi = [S::zero(); R];
            // Whole-sub-block chains where every row's values allow it.
            let whole = !S::I16_SUMS && all_fit(acts, FITS_Q6K_WHOLE);
            // Per quarter `q` (or pair of quarters, `q` and `q + 2`), its four sub-blocks with
            // their share of the prefetches.
            macro_rules! quarters {
                ($kernel:ident, $whole:literal, $parts:literal, $($q:literal)*) => {
                    $(for j in 0..4 {
                        pf.part(4 * $q + j, $parts, Self::MAIN);
                        $kernel::<S, R, $q, $whole>(main, j, half, acts, &mut sumi);
                    })*
                };
            }
            if R > 8 && S::LANES == 16 && !S::I16_SUMS {
                if whole {
                    quarters!(q6k_rows, true, 16, 0 1 2 3);
                } else {
                    quarters!(q6k_rows, false, 16, 0 1 2 3);
                }
            } else if R > Q6K_QUAD_MAX_R && S::LANES == 16 && !S::I16_SUMS {
                if whole {
                    quarters!(q6k_pair, true, 8, 0 1);
                } else {
                    quarters!(q6k_pair, false, 8, 0 1);
                }
            } else if R > Q6K_QUAD_MAX_R * S::LANES / 16 || S::I16_SUMS {
                for j in 0..4 {
                    pf.part(j, 8, Self::MAIN);
                    q6k_sub::<S, R, 0>(main, j, half, acts, &mut sumi);
                }
                for j in 0..4 {
                    pf.part(4 + j, 8, Self::MAIN);
                    q6k_sub::<S, R, 1>(main, j, half, acts, &mut sumi);
                }
                for j in 0..4 {
                    q6k_sub::<S, R, 2>(main, j, half, acts, &mut sumi);
                }
                for j in 0..4 {
                    q6k_sub::<S, R, 3>(main, j, half, acts, &mut sumi);
                }
            } else {
                for j in 0..4 {
                    pf.part(j, 4, Self::MAIN);
                    if whole {
                        q6k_quad::<S, R, true>(main, j, half, acts, &mut sumi);
                    } else {
                        q6k_quad::<S, R, false>(main, j, half, acts, &mut sumi);
                    }
                }
            }
            epi32::<S, _, R>(S::load_f16(aux.add(2 * lanes * half)), &sumi, acts, out);
        }
    }
}

/// Q6_K sub-block `s` (k-groups `4s..4s + 4`) in the [`Q6KLines`] layout: scale ·
/// (dot − 32 Σx), added to `sumi`.
#[inline(always)]
unsafe fn q6k_lines_sub<S: Simd, const R: usize>(
    main: *const u8,
    s: usize,
    half: usize,
    acts: &[*const ActK; R],
    sumi: &mut [S::I; R],
) {
    // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
    unsafe {
        let m3f = S::set1_i8(0x3F);
        let lines = main.add(192 * s + 32 * half);
        let (l0, l1, l2) = (
            S::load(lines),
            S::load(lines.add(64)),
            S::load(lines.add(128)),
        );
        // Bits 6–7 of line t are bits 2t, 2t + 1 of k-group 3's value; the 16-bit shifts
        // pull in the next byte's bits, which the masks drop.
        let top = S::or(
            S::or(
                S::and(S::shr16(l0, 6), S::set1_i8(0x03)),
                S::and(S::shr16(l1, 4), S::set1_i8(0x0C)),
            ),
            S::and(S::shr16(l2, 2), S::set1_i8(0x30)),
        );
        let w = [S::and(l0, m3f), S::and(l1, m3f), S::and(l2, m3f), top];
        q6k_dot::<S, R>(&w, main, s, half, acts, sumi);
    }
}

/// Q6_K in six-bit lines, the layout of the AVX2 path ([`q6k_in_lines`]). Per sub-block of
/// 16 values (4 k-groups), three 64-byte lines of the usual column interleave: byte `4·col + i`
/// of line `t` holds value `4·(4s + t) + i` in bits 0–5 and bits `2t, 2t + 1` of value
/// `4·(4s + 3) + i` in bits 6–7. Then the 16 × 16 sub-block scales, as in [`Q6K`]; the same
/// bytes in all. A sub-block unpacks in 3 loads and 11 logic operations, where [`Q6K`]'s bit
/// planes take 8 loads and 17–18 (fewer across quarters on the VNNI paths, which keep them).
pub(crate) struct Q6KLines;

impl Format for Q6KLines {
    const NAME: &'static str = "Q6K-lines";
    type Raw = BlockQ6K;
    type Act = ActK;
    const BLOCK: usize = QK_K;
    const MAIN: usize = 3072 + 256;
    const AUX: usize = 32;

    fn decode(b: &BlockQ6K) -> ColBlock {
        Q6K::decode(b)
    }

    fn write(main: &mut [u8], aux: &mut [u8], col: usize, b: &ColBlock) {
        for s in 0..16 {
            for t in 0..3 {
                for i in 0..4 {
                    let top = (b.q[4 * (4 * s + 3) + i] >> (2 * t)) & 3;
                    main[64 * (3 * s + t) + 4 * col + i] = b.q[4 * (4 * s + t) + i] | (top << 6);
                }
            }
        }
        for j in 0..16 {
            main[3072 + 16 * j + col] = b.sc[j];
        }
        aux[2 * col..2 * col + 2].copy_from_slice(&b.d.to_le_bytes());
    }

    fn read(main: &[u8], aux: &[u8], col: usize) -> ColBlock {
        let mut c = ColBlock::ZERO;
        for s in 0..16 {
            for t in 0..3 {
                for i in 0..4 {
                    let byte = main[64 * (3 * s + t) + 4 * col + i];
                    c.q[4 * (4 * s + t) + i] = byte & 0x3F;
                    c.q[4 * (4 * s + 3) + i] |= (byte >> 6) << (2 * t);
                }
            }
        }
        for j in 0..16 {
            c.sc[j] = main[3072 + 16 * j + col];
        }
        c.d = u16::from_le_bytes([aux[2 * col], aux[2 * col + 1]]);
        c
    }

    fn dequant(b: &ColBlock, y: &mut [f32]) {
        Q6K::dequant(b, y)
    }

    #[inline(always)]
    unsafe fn block<S: Simd, const R: usize>(
        main: *const u8,
        aux: *const u8,
        half: usize,
        acts: &[*const ActK; R],
        out: &mut [S::F; R],
        pf: Pf,
    ) {
        // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
        unsafe {
            let mut sumi = [S::zero(); R];
            for s in 0..16 {
                if s % 2 == 0 {
                    pf.part(s / 2, 8, Self::MAIN);
                }
                q6k_lines_sub::<S, R>(main, s, half, acts, &mut sumi);
            }
            epi32::<S, _, R>(S::load_f16(aux.add(2 * S::LANES * half)), &sumi, acts, out);
        }
    }
}

/// Whether kernel path `isa` keeps Q6_K in [`Q6KLines`]: AVX2, whose i16 sums leave the
/// unpacking a large share of the work (one thread, Zen 3). The others keep the bit planes of
/// [`Q6K`].
pub(crate) fn q6k_in_lines(isa: Isa) -> bool {
    isa == Isa::Avx2
}

impl Format for Q5_0 {
    const NAME: &'static str = "Q5_0";
    type Raw = BlockQ5_0;
    type Act = Act32;
    const BLOCK: usize = 32;
    // 4 nibble lines, 1 line of fifth bits (bit g of byte 4·col + i: value 4g + i).
    const MAIN: usize = 320;
    const AUX: usize = 32;

    fn decode(b: &BlockQ5_0) -> ColBlock {
        let mut c = ColBlock::ZERO;
        let qh = u32::from_le_bytes(b.qh);
        for j in 0..16 {
            c.q[j] = (b.qs[j] & 0xF) | ((((qh >> j) & 1) as u8) << 4);
            c.q[j + 16] = (b.qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        }
        c.d = b.d;
        c
    }

    fn write(main: &mut [u8], aux: &mut [u8], col: usize, b: &ColBlock) {
        put_nibs(main, col, 8, &b.q[..32]);
        for k in 0..32 {
            main[256 + 4 * col + k % 4] |= ((b.q[k] >> 4) & 1) << (k / 4);
        }
        aux[2 * col..2 * col + 2].copy_from_slice(&b.d.to_le_bytes());
    }

    fn read(main: &[u8], aux: &[u8], col: usize) -> ColBlock {
        let mut c = ColBlock::ZERO;
        for k in 0..32 {
            let h = (main[256 + 4 * col + k % 4] >> (k / 4)) & 1;
            c.q[k] = get_nib(main, k, col, 8) | (h << 4);
        }
        c.d = u16::from_le_bytes([aux[2 * col], aux[2 * col + 1]]);
        c
    }

    fn dequant(b: &ColBlock, y: &mut [f32]) {
        let d = f16_to_f32(b.d);
        for k in 0..32 {
            y[k] = d * (b.q[k] as i32 - 16) as f32;
        }
    }

    #[inline(always)]
    unsafe fn block<S: Simd, const R: usize>(
        main: *const u8,
        aux: *const u8,
        half: usize,
        acts: &[*const Act32; R],
        out: &mut [S::F; R],
        pf: Pf,
    ) {
        // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
        unsafe {
            pf.part(0, 1, Self::MAIN);
            let m4 = S::set1_i8(0x0F);
            let m10 = S::set1_i8(0x10);
            let hv = S::load(main.add(256 + 32 * half));
            let weights = |g: usize| {
                let lo = nibbles::<S>(main, g, 8, half, m4);
                let hb = if g < 4 {
                    S::shl16(hv, 4 - g as u32)
                } else {
                    S::shr16(hv, g as u32 - 4)
                };
                S::or(lo, S::and(hb, m10))
            };
            // The sums start at the −16 offset. With i16 sums each lane ends at the sum of 16
            // products (w − 16) · x, at most 16 · 127 each: 32,512 (wrapping adds in between
            // cancel).
            let mut a = [S::zero(); R];
            let mut b = [S::zero(); R];
            for r in 0..R {
                let x = &*acts[r];
                let init = if S::I16_SUMS { &x.off16p } else { &x.n16 };
                a[r] = S::bcast(init as *const i32 as *const u8);
            }
            for g in 0..8 {
                dot_line::<S, _, R>(&mut a, &mut b, weights(g), acts, 4 * g, g % 2 == 1);
            }
            widen::<S, R>(&mut a, &b);
            epi32::<S, _, R>(S::load_f16(aux.add(2 * S::LANES * half)), &a, acts, out);
        }
    }
}

/// Q5_0 in five lines of whole 5-bit values, the layout of the AVX2 path ([`q5_0_in_lines`]).
/// Byte `4·col + i` of line `t` (`t` < 5) holds value `4t + i` of column `col` in bits 0–4; the
/// top three bits of the five lines carry k-groups 5–7: lines 0, 2 and 4 bits 0–2 of groups 5,
/// 6 and 7, lines 1 and 3 bits 3–4 of groups 5 and 6 (bits 5–6) and bits 3 and 4 of group 7
/// (bit 7). The same 320 bytes as [`Q5_0`]'s nibble and fifth-bit planes; a block's half
/// unpacks in 23 logic operations where the planes take about 36, which on AVX2 (`maddubs` + an
/// `add` per line and row) is a quarter of the one-row loop's work.
pub(crate) struct Q5_0Lines;

impl Format for Q5_0Lines {
    const NAME: &'static str = "Q5_0-lines";
    type Raw = BlockQ5_0;
    type Act = Act32;
    const BLOCK: usize = 32;
    const MAIN: usize = 320;
    const AUX: usize = 32;

    fn decode(b: &BlockQ5_0) -> ColBlock {
        Q5_0::decode(b)
    }

    fn write(main: &mut [u8], aux: &mut [u8], col: usize, b: &ColBlock) {
        for i in 0..4 {
            let o = 4 * col + i;
            for t in 0..5 {
                main[64 * t + o] = b.q[4 * t + i] & 0x1F;
            }
            let (q5, q6, q7) = (b.q[20 + i], b.q[24 + i], b.q[28 + i]);
            main[o] |= (q5 & 7) << 5;
            main[64 + o] |= ((q5 >> 3) & 3) << 5 | ((q7 >> 3) & 1) << 7;
            main[128 + o] |= (q6 & 7) << 5;
            main[192 + o] |= ((q6 >> 3) & 3) << 5 | ((q7 >> 4) & 1) << 7;
            main[256 + o] |= (q7 & 7) << 5;
        }
        aux[2 * col..2 * col + 2].copy_from_slice(&b.d.to_le_bytes());
    }

    fn read(main: &[u8], aux: &[u8], col: usize) -> ColBlock {
        let mut c = ColBlock::ZERO;
        for i in 0..4 {
            let l: [u8; 5] = std::array::from_fn(|t| main[64 * t + 4 * col + i]);
            for (t, v) in l.iter().enumerate() {
                c.q[4 * t + i] = v & 0x1F;
            }
            c.q[20 + i] = (l[0] >> 5) | ((l[1] >> 5) & 3) << 3;
            c.q[24 + i] = (l[2] >> 5) | ((l[3] >> 5) & 3) << 3;
            c.q[28 + i] = (l[4] >> 5) | (l[1] >> 7) << 3 | (l[3] >> 7) << 4;
        }
        c.d = u16::from_le_bytes([aux[2 * col], aux[2 * col + 1]]);
        c
    }

    fn dequant(b: &ColBlock, y: &mut [f32]) {
        Q5_0::dequant(b, y)
    }

    #[inline(always)]
    unsafe fn block<S: Simd, const R: usize>(
        main: *const u8,
        aux: *const u8,
        half: usize,
        acts: &[*const Act32; R],
        out: &mut [S::F; R],
        pf: Pf,
    ) {
        // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
        unsafe {
            pf.part(0, 1, Self::MAIN);
            let l: [S::I; 5] = std::array::from_fn(|t| S::load(main.add(64 * t + 32 * half)));
            // The 16-bit shifts pull in the next byte's bits, which the masks drop.
            let top = |v: S::I, shift: u32, mask: i8| S::and(S::shr16(v, shift), S::set1_i8(mask));
            let m1f = S::set1_i8(0x1F);
            let w = [
                S::and(l[0], m1f),
                S::and(l[1], m1f),
                S::and(l[2], m1f),
                S::and(l[3], m1f),
                S::and(l[4], m1f),
                S::or(top(l[0], 5, 0x07), top(l[1], 2, 0x18)),
                S::or(top(l[2], 5, 0x07), top(l[3], 2, 0x18)),
                S::or(
                    S::or(top(l[4], 5, 0x07), top(l[1], 4, 0x08)),
                    top(l[3], 3, 0x10),
                ),
            ];
            let d = S::load_f16(aux.add(2 * S::LANES * half));
            // At most 4 rows at a time: the 8 unpacked lines, 8 rows' sums and their outputs
            // would need more than the 16 registers of AVX2 (8 rows at once ran 4 % slower
            // than the bit planes, 4 at a time 4 % faster; a loop over chunks of up to 4, one
            // code for every R, ran 5–10 % slower at 5 and 8 rows).
            if R <= 4 {
                q5_0_lines_rows::<S, R>(&w, acts, d, out);
            } else {
                let (head, tail) = out.split_at_mut(4);
                let head: &mut [S::F; 4] = head.try_into().expect("4 rows");
                q5_0_lines_rows::<S, 4>(&w, &std::array::from_fn(|r| acts[r]), d, head);
                macro_rules! rest {
                    ($($n:literal)*) => {
                        match R - 4 {
                            $($n => q5_0_lines_rows::<S, $n>(
                                &w,
                                &std::array::from_fn(|r| acts[4 + r]),
                                d,
                                tail.try_into().expect("the other rows"),
                            ),)*
                            _ => unreachable!("tiles have at most 8 rows"),
                        }
                    };
                }
                rest!(1 2 3 4);
            }
        }
    }
}

/// The dot products of `P` rows with a [`Q5_0Lines`] block's unpacked lines `w`, from the −16
/// offset as in [`Q5_0`]'s block, into `out` with the weights' scales `d`.
#[inline(always)]
unsafe fn q5_0_lines_rows<S: Simd, const P: usize>(
    w: &[S::I; 8],
    acts: &[*const Act32; P],
    d: S::F,
    out: &mut [S::F; P],
) {
    // SAFETY: live activation blocks (caller); the CPU supports `S`.
    unsafe {
        let mut a = [S::zero(); P];
        let mut b = [S::zero(); P];
        for r in 0..P {
            let x = &*acts[r];
            let init = if S::I16_SUMS { &x.off16p } else { &x.n16 };
            a[r] = S::bcast(init as *const i32 as *const u8);
        }
        for (g, &wg) in w.iter().enumerate() {
            dot_line::<S, _, P>(&mut a, &mut b, wg, acts, 4 * g, g % 2 == 1);
        }
        widen::<S, P>(&mut a, &b);
        epi32::<S, _, P>(d, &a, acts, out);
    }
}

/// Whether kernel path `isa` keeps Q5_0 in [`Q5_0Lines`]: AVX2, where unpacking the bit planes
/// took a large share of the loop (one thread, Zen 3). The others keep [`Q5_0`]'s planes.
pub(crate) fn q5_0_in_lines(isa: Isa) -> bool {
    isa == Isa::Avx2
}

impl Format for Q8_0 {
    const NAME: &'static str = "Q8_0";
    type Raw = BlockQ8_0;
    type Act = Act32;
    const BLOCK: usize = 32;
    // 8 lines of `w + 128`.
    const MAIN: usize = 512;
    const AUX: usize = 32;

    fn decode(b: &BlockQ8_0) -> ColBlock {
        let mut c = ColBlock::ZERO;
        for k in 0..32 {
            c.q[k] = (b.qs[k] as u8) ^ 0x80;
        }
        c.d = b.d;
        c
    }

    fn write(main: &mut [u8], aux: &mut [u8], col: usize, b: &ColBlock) {
        for k in 0..32 {
            main[(k / 4) * 64 + 4 * col + k % 4] = b.q[k];
        }
        aux[2 * col..2 * col + 2].copy_from_slice(&b.d.to_le_bytes());
    }

    fn read(main: &[u8], aux: &[u8], col: usize) -> ColBlock {
        let mut c = ColBlock::ZERO;
        for k in 0..32 {
            c.q[k] = main[(k / 4) * 64 + 4 * col + k % 4];
        }
        c.d = u16::from_le_bytes([aux[2 * col], aux[2 * col + 1]]);
        c
    }

    fn dequant(b: &ColBlock, y: &mut [f32]) {
        let d = f16_to_f32(b.d);
        for k in 0..32 {
            y[k] = d * ((b.q[k] ^ 0x80) as i8) as f32;
        }
    }

    #[inline(always)]
    unsafe fn block<S: Simd, const R: usize>(
        main: *const u8,
        aux: *const u8,
        half: usize,
        acts: &[*const Act32; R],
        out: &mut [S::F; R],
        pf: Pf,
    ) {
        // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
        unsafe {
            pf.part(0, 1, Self::MAIN);
            let mut a = [S::zero(); R];
            let mut b = [S::zero(); R];
            if S::Q8_BIASED {
                for r in 0..R {
                    a[r] = S::bcast(&(*acts[r]).n128 as *const i32 as *const u8);
                }
            }
            for g in 0..8 {
                let w = S::load(main.add(64 * g + 32 * half));
                for r in 0..R {
                    let x = S::bcast(bcast_q(acts[r], 4 * g));
                    if R <= 2 && g % 2 == 1 {
                        b[r] = S::q8dot(b[r], w, x);
                    } else {
                        a[r] = S::q8dot(a[r], w, x);
                    }
                }
            }
            if R <= 2 {
                for r in 0..R {
                    a[r] = S::add(a[r], b[r]);
                }
            }
            epi32::<S, _, R>(S::load_f16(aux.add(2 * S::LANES * half)), &a, acts, out);
        }
    }
}

impl Format for Q4_1 {
    const NAME: &'static str = "Q4_1";
    type Raw = BlockQ4_1;
    type Act = Act32;
    const BLOCK: usize = 32;
    const MAIN: usize = 256;
    // d, then m.
    const AUX: usize = 64;

    fn decode(b: &BlockQ4_1) -> ColBlock {
        let mut c = ColBlock::ZERO;
        for j in 0..16 {
            c.q[j] = b.qs[j] & 0xF;
            c.q[j + 16] = b.qs[j] >> 4;
        }
        c.d = b.d;
        c.d2 = b.m;
        c
    }

    fn write(main: &mut [u8], aux: &mut [u8], col: usize, b: &ColBlock) {
        put_nibs(main, col, 8, &b.q[..32]);
        aux[2 * col..2 * col + 2].copy_from_slice(&b.d.to_le_bytes());
        aux[32 + 2 * col..32 + 2 * col + 2].copy_from_slice(&b.d2.to_le_bytes());
    }

    fn read(main: &[u8], aux: &[u8], col: usize) -> ColBlock {
        let mut c = ColBlock::ZERO;
        for k in 0..32 {
            c.q[k] = get_nib(main, k, col, 8);
        }
        c.d = u16::from_le_bytes([aux[2 * col], aux[2 * col + 1]]);
        c.d2 = u16::from_le_bytes([aux[32 + 2 * col], aux[33 + 2 * col]]);
        c
    }

    fn dequant(b: &ColBlock, y: &mut [f32]) {
        let d = f16_to_f32(b.d);
        let m = f16_to_f32(b.d2);
        for k in 0..32 {
            y[k] = (b.q[k] as f32) * d + m;
        }
    }

    #[inline(always)]
    unsafe fn block<S: Simd, const R: usize>(
        main: *const u8,
        aux: *const u8,
        half: usize,
        acts: &[*const Act32; R],
        out: &mut [S::F; R],
        pf: Pf,
    ) {
        // SAFETY: offsets inside the (group, block) slot and the activation blocks (caller).
        unsafe {
            pf.part(0, 1, Self::MAIN);
            let m4 = S::set1_i8(0x0F);
            let mut a = [S::zero(); R];
            let mut b = [S::zero(); R];
            // With i16 sums each lane sums 16 products of at most 15 · 127: 30,480.
            for g in 0..8 {
                let w = nibbles::<S>(main, g, 8, half, m4);
                dot_line::<S, _, R>(&mut a, &mut b, w, acts, 4 * g, g % 2 == 1);
            }
            widen::<S, R>(&mut a, &b);
            epi32::<S, _, R>(S::load_f16(aux.add(2 * S::LANES * half)), &a, acts, out);
            let m = S::load_f16(aux.add(32 + 2 * S::LANES * half));
            for r in 0..R {
                out[r] = S::fmadd(m, S::fbcast((*acts[r]).xs), out[r]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Packed matrices.

/// Zeroed bytes for repacked weights, 64-byte aligned. On Linux they are cut from
/// `huge::take`'s chunks: fresh anonymous mappings hinted onto 2 MiB pages before their first
/// touch, each buffer after the previous one (elsewhere, and if a mapping fails, the heap).
///
/// Why not the allocator: heap memory is recycled, and pages that an earlier buffer (a tensor
/// read from the file, a scratch vector of the repack) already faulted in stay 4 KiB pages
/// whatever the hint says. With the allocator, 430 of 1,124 MB of the 1.5B model's weights
/// ended on 4 KiB pages (`AnonHugePages` in `/proc/PID/smaps`), and every 4 KiB of those costs
/// a page walk and restarts the hardware prefetcher, which stops at page boundaries. On huge
/// pages (1,116 of 1,160 MB), one-thread t(1) fell 1–8 % for the 1.5B model and 7 % for the
/// 0.5B draft (alternating runs, Zen 3).
///
/// Why chunks and not a mapping per matrix: a mapping rounds its matrix up to whole huge pages
/// (a 1.3 MB Q projection of the 1.5B model takes 2 MiB, a 2.5 MB FFN matrix of the 0.5B draft
/// 4 MiB), 7 % more resident memory for the 1.5B model; in shared chunks only the last huge
/// page of a chunk is partly unused.
struct WeightBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    /// How the bytes were obtained, and so how they are given back.
    source: BufSource,
}

enum BufSource {
    Heap(std::alloc::Layout),
    /// Part of a chunk, unmapped when its last buffer goes.
    #[cfg(target_os = "linux")]
    Chunk(#[allow(dead_code)] std::sync::Arc<huge::Mapping>),
}

/// The huge-page size the kernels' buffers are aligned to.
const HUGE_PAGE: usize = 2 << 20;

// SAFETY: `WeightBuf` owns its bytes exclusively, like a `Vec<u8>` (a chunk is shared, but each
// buffer's bytes are handed out once).
unsafe impl Send for WeightBuf {}
unsafe impl Sync for WeightBuf {}

impl WeightBuf {
    fn zeroed(len: usize) -> Self {
        #[cfg(target_os = "linux")]
        if let Some((ptr, chunk)) = huge::take(len) {
            return WeightBuf {
                ptr,
                len,
                source: BufSource::Chunk(chunk),
            };
        }
        let layout = std::alloc::Layout::from_size_align(len.max(64), 64).expect("weight size");
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        WeightBuf {
            ptr,
            len,
            source: BufSource::Heap(layout),
        }
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialized bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` initialized bytes owned exclusively by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for WeightBuf {
    fn drop(&mut self) {
        if let BufSource::Heap(layout) = self.source {
            // SAFETY: allocated in `zeroed` with this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
        // A chunk's part goes with the chunk, when its last buffer drops its `Arc`.
    }
}

/// Chunks of huge-page memory that the repacked weights are cut from (see [`WeightBuf`]).
#[cfg(target_os = "linux")]
mod huge {
    use super::HUGE_PAGE;
    use std::sync::{Arc, Mutex};

    /// Chunk size: 32 huge pages. A larger matrix gets a chunk of its own size.
    const CHUNK: usize = 64 << 20;

    /// A private anonymous mapping, unmapped on drop.
    pub(super) struct Mapping {
        base: *mut libc::c_void,
        len: usize,
    }

    // SAFETY: the mapping is plain memory; who writes which part is up to `WeightBuf`.
    unsafe impl Send for Mapping {}
    unsafe impl Sync for Mapping {}

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: mapped in `take` with this base and length, unmapped only here.
            unsafe { libc::munmap(self.base, self.len) };
        }
    }

    /// The chunk being filled: its mapping and the free range `next..end`.
    struct Open {
        chunk: Arc<Mapping>,
        next: usize,
        end: usize,
    }

    static OPEN: Mutex<Option<Open>> = Mutex::new(None);

    /// `len` zeroed bytes at a 64-byte boundary that no one else was given, in a chunk on huge
    /// pages, with the chunk to hold on to; `None` if the system refuses a mapping.
    pub(super) fn take(len: usize) -> Option<(std::ptr::NonNull<u8>, Arc<Mapping>)> {
        let need = len.max(1).next_multiple_of(64);
        let mut open = OPEN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if open.as_ref().is_none_or(|o| o.end - o.next < need) {
            let size = CHUNK.max(need.next_multiple_of(HUGE_PAGE));
            // One page of slack, so that a 2 MiB boundary lies inside with `size` bytes after it.
            let map_len = size + HUGE_PAGE;
            // SAFETY: a private anonymous mapping at an address the kernel picks.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    map_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                return None;
            }
            let start = (base as usize).next_multiple_of(HUGE_PAGE);
            // Fresh anonymous pages read as zero, and the hint goes before any write, so the
            // repack's first writes fault in huge pages: the weights stream from memory once per
            // token, and on 4 KiB pages every 4 KiB costs a page walk. A hint only: where the
            // kernel refuses, nothing changes.
            // SAFETY: `start..start + size` lies inside the mapping just made; MADV_HUGEPAGE
            // changes no contents, only how future faults are served.
            unsafe { libc::madvise(start as *mut libc::c_void, size, libc::MADV_HUGEPAGE) };
            *open = Some(Open {
                chunk: Arc::new(Mapping { base, len: map_len }),
                next: start,
                end: start + size,
            });
        }
        let o = open.as_mut()?;
        let p = o.next;
        o.next += need;
        Some((std::ptr::NonNull::new(p as *mut u8)?, Arc::clone(&o.chunk)))
    }
}

/// Software prefetch distance (bytes) when a group streams from memory for `m` rows of format
/// `F`: 16384 (into L2; on 8960 × 1536 from DRAM, one thread, Xeon family 6 model 207: 5–7 %
/// faster than 8192 at 4 and 8 rows and level at one, no better at 32768 or 65536), none
/// up to [`Format::PF_OFF_MAX_M`] rows on AMD Zen 4 and later; `SEQUOIA_KERNEL_PF` overrides
/// both (0 turns it off; read once).
fn pf_dist<F: Format>(m: usize) -> usize {
    use std::sync::OnceLock;
    static D: OnceLock<Option<usize>> = OnceLock::new();
    let env = *D.get_or_init(|| {
        std::env::var("SEQUOIA_KERNEL_PF")
            .ok()
            .and_then(|v| v.parse().ok())
    });
    env.unwrap_or(if m <= F::PF_OFF_MAX_M && cpu_is_amd_zen4_or_later() {
        0
    } else {
        16384
    })
}

/// Distance (bytes) of the second prefetch stream, into L1, that runs with the far one of
/// [`pf_dist`]: 4096 on Intel CPUs, none elsewhere; `SEQUOIA_KERNEL_PF_NEAR` overrides (0
/// turns it off; read once). The far stream leaves the lines in L2, so without it the pass
/// that streams a group waited on an L2 access per line; with it the lines are in L1 when
/// that pass gets to them. On 8960 × 1536 from DRAM, one thread (Xeon family 6 model 207):
/// Q4_K at one row 24.8 → 28.5 G MAC/s, 8 rows 144 → 151, 16 rows 168 → 171; Q6_K, Q5_0 and
/// Q8_0 gain 4–9 %; 2048 and 8192 bytes did less. A 2-thread decode of the 1.5B model went
/// from 38–41 ms to 35–36 ms. Not measured on AMD, where T0 prefetches have hurt before (see
/// [`prefetch`]), so off there until it is.
fn pf_near() -> usize {
    use std::sync::OnceLock;
    static D: OnceLock<usize> = OnceLock::new();
    *D.get_or_init(|| {
        std::env::var("SEQUOIA_KERNEL_PF_NEAR")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(if cpu_is_intel() { 4096 } else { 0 })
    })
}

/// Whether the CPU's vendor string is Intel's (read once).
fn cpu_is_intel() -> bool {
    use std::sync::OnceLock;
    static INTEL: OnceLock<bool> = OnceLock::new();
    *INTEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            &cpu_vendor() == b"GenuineIntel"
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// The CPU's vendor string (CPUID leaf 0).
#[cfg(target_arch = "x86_64")]
fn cpu_vendor() -> [u8; 12] {
    // SAFETY: CPUID leaf 0 exists on every x86-64 CPU. (A safe function since Rust 1.87;
    // `unsafe` keeps the crate's rust-version building.)
    #[allow(unused_unsafe)]
    let r = unsafe { std::arch::x86_64::__cpuid(0) };
    let mut v = [0u8; 12];
    v[..4].copy_from_slice(&r.ebx.to_le_bytes());
    v[4..8].copy_from_slice(&r.edx.to_le_bytes());
    v[8..].copy_from_slice(&r.ecx.to_le_bytes());
    v
}

/// Whether the CPU is an AMD Zen 4 or later (read once): family 19h models of Zen 4 (Genoa
/// 10h–1Fh, Raphael 60h–6Fh, Phoenix 70h–7Fh, Bergamo A0h–AFh) or any later family. Zen 3
/// (family 19h, other models) is not: there Q4_K at one row ran 1.3–1.5× faster *with* the
/// prefetch (8960 × 1536 from DRAM, one thread, EPYC family 19h model 01h).
fn cpu_is_amd_zen4_or_later() -> bool {
    use std::sync::OnceLock;
    static ZEN4: OnceLock<bool> = OnceLock::new();
    *ZEN4.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: CPUID leaf 1 (family and model) exists on every x86-64 CPU (see
            // `cpu_vendor`).
            #[allow(unused_unsafe)]
            let id = unsafe { std::arch::x86_64::__cpuid(1) };
            let base_family = (id.eax >> 8) & 0xF;
            let family = if base_family == 0xF {
                base_family + ((id.eax >> 20) & 0xFF)
            } else {
                base_family
            };
            let model = ((id.eax >> 12) & 0xF0) | ((id.eax >> 4) & 0xF);
            &cpu_vendor() == b"AuthenticAMD"
                && (family > 0x19
                    || (family == 0x19 && matches!(model, 0x10..=0x1F | 0x60..=0x7F | 0xA0..=0xAF)))
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Prefetch the line at address `p` into L2 if it lies before `end`. (Into L1, `T0`, the
/// prefetches of a whole block hold the L1 miss buffers the demand loads wait for: 2× slower
/// at 8 rows on Zen 4.)
#[inline(always)]
fn prefetch(p: usize, end: usize) {
    prefetch_to::<PF_L2>(p, end)
}

/// Prefetch the line at address `p` into L1 if it lies before `end` (the near stream of
/// [`pf_near`]).
#[inline(always)]
fn prefetch_l1(p: usize, end: usize) {
    prefetch_to::<PF_L1>(p, end)
}

/// `_mm_prefetch` strategies: `_MM_HINT_T1` (into L2) and `_MM_HINT_T0` (into L1).
const PF_L2: i32 = 2;
const PF_L1: i32 = 3;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(PF_L2 == _MM_HINT_T1 && PF_L1 == _MM_HINT_T0);

#[inline(always)]
fn prefetch_to<const HINT: i32>(p: usize, end: usize) {
    #[cfg(target_arch = "x86_64")]
    if p < end {
        // SAFETY: prefetch has no architectural effect; the address is inside the buffer.
        unsafe { _mm_prefetch::<HINT>(p as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, end);
}

/// An `n × k` matrix in the interleaved layout of format `F`.
pub(crate) struct Packed<F: Format> {
    data: WeightBuf,
    pub(crate) n: usize,
    pub(crate) k: usize,
    kb: usize,
    /// Bytes per group (a multiple of 64).
    gstride: usize,
    _f: std::marker::PhantomData<F>,
}

impl<F: Format> Packed<F> {
    fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// Heap bytes held.
    pub(crate) fn size_bytes(&self) -> usize {
        self.data.len
    }

    /// Repack `n` rows of `k / BLOCK` GGUF blocks each (`raw`: the tensor's bytes).
    pub(crate) fn from_bytes(raw: &[u8], n: usize, k: usize) -> Self {
        use rayon::prelude::*;
        assert!(k.is_multiple_of(F::BLOCK));
        let kb = k / F::BLOCK;
        let size = std::mem::size_of::<F::Raw>();
        assert_eq!(raw.len(), n * kb * size);
        // SAFETY: in bounds (asserted); the GGML block types are `#[repr(C)]` integer
        // aggregates for which every bit pattern is valid.
        let block = |i: usize| unsafe {
            std::ptr::read_unaligned(raw.as_ptr().add(i * size) as *const F::Raw)
        };
        let gstride = (kb * (F::MAIN + F::AUX)).div_ceil(64) * 64;
        let groups = n.div_ceil(G);
        let mut data = WeightBuf::zeroed(groups * gstride);
        let bytes = data.as_mut_slice();
        bytes
            .par_chunks_mut(gstride)
            .enumerate()
            .for_each(|(gi, gb)| {
                let (main, aux) = gb.split_at_mut(kb * F::MAIN);
                for col in 0..G.min(n - gi * G) {
                    let row = gi * G + col;
                    for b in 0..kb {
                        let cb = F::decode(&block(row * kb + b));
                        F::write(
                            &mut main[b * F::MAIN..(b + 1) * F::MAIN],
                            &mut aux[b * F::AUX..(b + 1) * F::AUX],
                            col,
                            &cb,
                        );
                    }
                }
            });
        Packed {
            data,
            n,
            k,
            kb,
            gstride,
            _f: std::marker::PhantomData,
        }
    }

    /// Candle's dequantization of row `row`.
    pub(crate) fn dequantize_row(&self, row: usize, dst: &mut [f32]) {
        assert!(row < self.n && dst.len() == self.k);
        let gb = &self.bytes()[(row / G) * self.gstride..][..self.gstride];
        let (main, aux) = gb.split_at(self.kb * F::MAIN);
        for (b, y) in dst.chunks_exact_mut(F::BLOCK).enumerate() {
            let cb = F::read(
                &main[b * F::MAIN..(b + 1) * F::MAIN],
                &aux[b * F::AUX..(b + 1) * F::AUX],
                row % G,
            );
            F::dequant(&cb, y);
        }
    }

    /// Output columns of groups `groups` for all `m` rows of `acts`, on path `S` with row tiles
    /// of up to `RT` rows.
    ///
    /// # Safety
    /// The CPU supports `S`'s features; `out` wraps a live `m × n` output whose columns of these
    /// groups no other thread writes meanwhile.
    #[inline(always)]
    unsafe fn run<S: Simd, const RT: usize>(
        &self,
        acts: &[F::Act],
        m: usize,
        groups: std::ops::Range<usize>,
        out: OutPtr,
    ) {
        assert_eq!(acts.len(), m * self.kb);
        // Rows per cache block: a group's weights are reused for this many rows from L1/L2.
        const RB: usize = 64;
        // Blocks per K chunk: every tile and half of a group passes over one chunk before the
        // next, so the chunk's weights (9–13 KB for the K-quants) and a tile's activations for
        // it (8 rows: 11 KB) stay in L1. Without chunks, a long row (the FFN's down projection,
        // k = 8960: 95 KB of activations per tile) came from L2 for every pass: 43 % of the
        // int8 peak at 32 rows against 89 % for k = 1536 (one thread, Zen 3, AVX2). Partial
        // sums wait in the output between chunks, and every output still adds its blocks in
        // order, so the result is the same bits.
        let kc = (1024 / F::BLOCK).max(1);
        let halves = G / S::LANES;
        let (dist, near) = (pf_dist::<F>(m), pf_near());
        for r0 in (0..m).step_by(RB) {
            let r1 = (r0 + RB).min(m);
            for gi in groups.clone() {
                for b0 in (0..self.kb).step_by(kc) {
                    let blocks = b0..(b0 + kc).min(self.kb);
                    let mut t0 = r0;
                    while t0 < r1 {
                        // Full wide tiles where the format has them (the 512-bit paths: 8-row
                        // tiles, 16 lanes), then tiles of `RT`.
                        let wide = RT == 8 && S::LANES == 16 && F::WIDE_ROWS == 16 && r1 - t0 >= 16;
                        let rows = if wide { 16 } else { (r1 - t0).min(RT) };
                        for half in 0..halves {
                            // The first pass over a group streams it from memory: prefetch
                            // ahead.
                            let pf = if t0 == 0 && half == 0 { dist } else { 0 };
                            let b = blocks.clone();
                            macro_rules! go {
                                ($($n:literal)*) => {
                                    match rows {
                                        $($n => unsafe { self.tile::<S, $n>(acts, m, t0, gi, half, b, out, pf, near) },)*
                                        _ => unreachable!(),
                                    }
                                };
                            }
                            if wide {
                                go!(16);
                            } else if RT == 8 {
                                go!(1 2 3 4 5 6 7 8);
                            } else {
                                go!(1 2 3 4);
                            }
                        }
                        t0 += rows;
                    }
                }
            }
        }
    }

    /// One row tile's pass over `blocks` of group `gi`. `pf` is the far prefetch distance where
    /// this pass streams the group from memory (0: it does not), `near` the near stream's
    /// ([`pf_near`]), used only with `pf`.
    #[inline(always)]
    unsafe fn tile<S: Simd, const R: usize>(
        &self,
        acts: &[F::Act],
        m: usize,
        t0: usize,
        gi: usize,
        half: usize,
        blocks: std::ops::Range<usize>,
        out: OutPtr,
        pf: usize,
        near: usize,
    ) {
        let base = self.bytes().as_ptr();
        let end = base as usize + self.size_bytes();
        let kb = self.kb;
        // SAFETY: group `gi` exists (caller), so its slot is inside `data`; rows `t0..t0 + R`
        // exist in `acts`.
        unsafe {
            let g = base.add(gi * self.gstride);
            let aux = g.add(kb * F::MAIN);

            let c0 = gi * G + half * S::LANES;
            let valid = S::LANES.min(self.n.saturating_sub(c0));
            // After the first chunk, the partial sums left in the output.
            let mut acc = [S::fzero(); R];
            if blocks.start > 0 && valid > 0 {
                for (r, v) in acc.iter_mut().enumerate() {
                    let p = out.at(t0 + r, c0, valid);
                    *v = if valid == S::LANES {
                        S::fload(p)
                    } else {
                        let mut tmp = [0f32; 16];
                        std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), valid);
                        S::fload(tmp.as_ptr())
                    };
                }
            }
            for b in blocks {
                let ahead = if pf > 0 {
                    Pf {
                        main: g.add(b * F::MAIN) as usize + pf,
                        aux: aux.add(b * F::AUX) as usize + pf,
                        end,
                        near: if near > 0 {
                            g.add(b * F::MAIN) as usize + near
                        } else {
                            0
                        },
                    }
                } else {
                    Pf::NONE
                };
                // Block-major activations (see `quantize_rows`): the tile's rows of block `b`
                // sit one after the other.
                let blk = acts.as_ptr().add(b * m + t0);
                let a: [*const F::Act; R] = std::array::from_fn(|r| blk.add(r));
                let (main, aux) = (g.add(b * F::MAIN), aux.add(b * F::AUX));
                F::block::<S, R>(main, aux, half, &a, &mut acc, ahead);
            }
            for (r, v) in acc.iter().enumerate() {
                if valid == S::LANES {
                    S::store(out.at(t0 + r, c0, valid), *v);
                } else if valid > 0 {
                    let mut tmp = [0f32; 16];
                    S::store(tmp.as_mut_ptr(), *v);
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), out.at(t0 + r, c0, valid), valid);
                }
            }
        }
    }

    /// See [`Self::run`]; `isa` must be available ([`Isa::available`]).
    ///
    /// # Safety
    /// As [`Self::run`].
    pub(crate) unsafe fn columns(
        &self,
        isa: Isa,
        acts: &[F::Act],
        m: usize,
        groups: std::ops::Range<usize>,
        out: OutPtr,
    ) {
        assert!(isa.available(), "{isa:?} kernels unavailable on this CPU");
        // SAFETY: features checked; the rest is the caller's contract.
        unsafe {
            match isa {
                Isa::Scalar => self.run::<Scalar, 4>(acts, m, groups, out),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => run_avx2(self, acts, m, groups, out),
                #[cfg(target_arch = "x86_64")]
                Isa::AvxVnni => run_avxvnni(self, acts, m, groups, out),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Vnni => run_avx512(self, acts, m, groups, out),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Gfni => run_avx512_gfni(self, acts, m, groups, out),
                #[cfg(target_arch = "x86_64")]
                Isa::Amx => {
                    // Tiles where they pay (`columns_amx` says), else the 512-bit path.
                    if !F::columns_amx(self, acts, m, groups.clone(), out) {
                        if Isa::Avx512Gfni.available() {
                            run_avx512_gfni(self, acts, m, groups, out)
                        } else {
                            run_avx512(self, acts, m, groups, out)
                        }
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                _ => unreachable!(),
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn run_avx512<F: Format>(
    p: &Packed<F>,
    acts: &[F::Act],
    m: usize,
    groups: std::ops::Range<usize>,
    out: OutPtr,
) {
    // SAFETY: caller.
    unsafe { p.run::<x86::Avx512<false>, 8>(acts, m, groups, out) }
}

/// [`run_avx512`] with GFNI's bit moves (`vgf2p8affineqb`, [`x86::Avx512<true>`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn run_avx512_gfni<F: Format>(
    p: &Packed<F>,
    acts: &[F::Act],
    m: usize,
    groups: std::ops::Range<usize>,
    out: OutPtr,
) {
    // SAFETY: caller (GFNI checked through `Isa::Avx512Gfni`).
    unsafe { p.run::<x86::Avx512<true>, 8>(acts, m, groups, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn run_avxvnni<F: Format>(
    p: &Packed<F>,
    acts: &[F::Act],
    m: usize,
    groups: std::ops::Range<usize>,
    out: OutPtr,
) {
    // SAFETY: caller.
    unsafe { p.run::<x86::Avx256<true>, 4>(acts, m, groups, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2<F: Format>(
    p: &Packed<F>,
    acts: &[F::Act],
    m: usize,
    groups: std::ops::Range<usize>,
    out: OutPtr,
) {
    // SAFETY: caller.
    unsafe { p.run::<x86::Avx256<false>, 8>(acts, m, groups, out) }
}

// ---------------------------------------------------------------------------------------------
// ISA selection.

/// A kernel path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable lanes (reference).
    Scalar,
    /// AVX2 + FMA + F16C (`maddubs` + `madd`).
    Avx2,
    /// 256-bit `vpdpbusd` (AVX-VNNI).
    AvxVnni,
    /// 512-bit `vpdpbusd` (AVX-512 F/BW/VNNI), with AMX-INT8 tiles for Q4_K from 9 rows and
    /// Q6_K from 32.
    Amx,
    /// 512-bit `vpdpbusd` (AVX-512 F/BW/VNNI).
    Avx512Vnni,
    /// [`Isa::Avx512Vnni`] with GFNI's `vgf2p8affineqb` for the 4-bit and 2-bit fields of
    /// the weights (one instruction where a shift and a mask take two).
    Avx512Gfni,
}

impl Isa {
    pub const ALL: [Isa; 6] = [
        Isa::Scalar,
        Isa::Avx2,
        Isa::AvxVnni,
        Isa::Avx512Vnni,
        Isa::Avx512Gfni,
        Isa::Amx,
    ];

    /// Whether this path runs AVX-512 (so the CPU has AVX-512 F).
    pub fn has_avx512(self) -> bool {
        matches!(self, Isa::Avx512Vnni | Isa::Avx512Gfni | Isa::Amx)
    }

    /// The instruction family whose measured peak this path's multiply-adds run at (the
    /// names of `roofline::Peaks::int8_gmacs_per_core`): GFNI changes only how the weights
    /// are unpacked, not the `vpdpbusd`s.
    pub fn peak_family(self) -> &'static str {
        match self {
            Isa::Avx512Gfni => Isa::Avx512Vnni.name(),
            other => other.name(),
        }
    }

    /// The name `SEQUOIA_KERNEL_ISA` takes.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avxvnni",
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Avx512Gfni => "avx512gfni",
            Isa::Amx => "amx",
        }
    }

    pub fn from_name(s: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name() == s.trim().to_ascii_lowercase())
    }

    /// Whether this CPU runs the path.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2,
                Isa::AvxVnni => avx2 && is_x86_feature_detected!("avxvnni"),
                Isa::Avx512Vnni => {
                    avx2 && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vnni")
                }
                Isa::Avx512Gfni => Isa::Avx512Vnni.available() && is_x86_feature_detected!("gfni"),
                Isa::Amx => Isa::Avx512Vnni.available() && amx::available(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Scalar
        }
    }

    /// The fastest available path.
    pub fn best() -> Isa {
        [
            Isa::Amx,
            Isa::Avx512Gfni,
            Isa::Avx512Vnni,
            Isa::AvxVnni,
            Isa::Avx2,
        ]
        .into_iter()
        .find(|i| i.available())
        .unwrap_or(Isa::Scalar)
    }
}

/// The path the kernels use: `SEQUOIA_KERNEL_ISA` (scalar|avx2|avxvnni|avx512vnni|avx512gfni|amx) if set
/// and available on this CPU, else [`Isa::best`]. Read once.
pub(crate) fn isa() -> Isa {
    use std::sync::OnceLock;
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let best = Isa::best();
        match std::env::var("SEQUOIA_KERNEL_ISA") {
            Ok(v) if !v.trim().is_empty() => match Isa::from_name(&v) {
                Some(i) if i.available() => i,
                Some(i) => {
                    tracing::warn!(
                        "SEQUOIA_KERNEL_ISA={v}: this CPU lacks {}; using {}",
                        i.name(),
                        best.name()
                    );
                    best
                }
                None => {
                    tracing::warn!(
                        "SEQUOIA_KERNEL_ISA={v}: unknown (scalar|avx2|avxvnni|avx512vnni|avx512gfni|amx); using {}",
                        best.name()
                    );
                    best
                }
            },
            _ => best,
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Output.

/// A row-major `m × n` output shared by parallel tasks that fill disjoint parts of it (a
/// matmul's column groups, a row-wise step's rows).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr {
    ptr: *mut f32,
    n: usize,
    len: usize,
}

// SAFETY: an `OutPtr` is only written through `at`, whose callers write disjoint elements.
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

    /// Pointer to element `(r, c)`, with `len` elements of the row writable from there.
    ///
    /// # Safety
    /// The wrapped slice must still be alive; the caller writes only elements no other thread
    /// writes.
    #[inline(always)]
    pub(crate) unsafe fn at(self, r: usize, c: usize, len: usize) -> *mut f32 {
        let idx = r * self.n + c;
        assert!(
            c + len <= self.n && idx + len <= self.len,
            "matmul output index out of range"
        );
        // SAFETY: in bounds (checked).
        unsafe { self.ptr.add(idx) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectorized_activation_quantization_matches_the_reference_bit_for_bit() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for len in [32usize, 48, 256] {
            for case in 0..200 {
                let scale = [1e-6f32, 1.0, 3.7, 1e4][case % 4];
                let mut x: Vec<f32> = (0..len).map(|_| next() * scale).collect();
                match case % 7 {
                    0 => x.fill(0.0),
                    1 => x[case % len] = f32::INFINITY,
                    2 => x[case % len] = f32::NAN,
                    3 => x[(case * 5) % len] = -scale, // ties at the maximum
                    _ => {}
                }
                let (mut a, mut b) = (vec![0i8; len], vec![0i8; len]);
                let (da, db) = (quantize_i8(&x, &mut a), quantize_i8_reference(&x, &mut b));
                assert_eq!(da.to_bits(), db.to_bits(), "case {case}: scale");
                assert_eq!(a, b, "case {case}: values");
            }
        }
    }

    #[test]
    fn vectorized_block_sums_match_the_reference() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for case in 0..300 {
            let q: [i8; 256] = std::array::from_fn(|k| match case % 5 {
                // The extremes of i8, and runs of one sign (the largest sums).
                0 => [-128i8, 127][k % 2],
                1 => -127,
                2 => 127,
                _ => {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    (seed >> 56) as i8
                }
            });
            assert_eq!(block_sums(&q), block_sums_reference(&q), "case {case}");
        }
        // ActK's offset pairs equal the element-by-element `offset_pair`.
        let x: Vec<f32> = (0..256).map(|k| ((k * 37) % 101) as f32 - 50.0).collect();
        let a = ActK::quantize(&x);
        for j in 0..16 {
            assert_eq!(
                a.off16p[j],
                offset_pair(&a.qs[16 * j..16 * (j + 1)], -32),
                "{j}"
            );
        }
    }

    #[test]
    fn weight_buffers_are_zeroed_aligned_and_writable_at_every_size() {
        // Around the chunk size too: a buffer that does not fit the open chunk starts a new one.
        let mut all = Vec::new();
        for len in [
            1,
            100,
            4096,
            (1 << 20) + 3,
            40 << 20,
            30 << 20,
            3 * HUGE_PAGE + 17,
            70 << 20,
        ] {
            let mut buf = WeightBuf::zeroed(len);
            assert_eq!(buf.as_slice().as_ptr() as usize % 64, 0, "{len} bytes");
            assert_eq!(buf.as_slice().len(), len);
            assert!(
                buf.as_slice().iter().all(|&b| b == 0),
                "{len} bytes not zeroed"
            );
            buf.as_mut_slice()[len - 1] = 7;
            buf.as_mut_slice()[0] = 3;
            assert_eq!(buf.as_slice()[0], 3);
            assert_eq!(buf.as_slice()[len - 1], if len > 1 { 7 } else { 3 });
            all.push(buf);
        }
        // No two buffers share a byte.
        let mut ranges: Vec<(usize, usize)> = all
            .iter()
            .map(|b| (b.as_slice().as_ptr() as usize, b.as_slice().len()))
            .collect();
        ranges.sort();
        for w in ranges.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "overlapping buffers {w:?}");
        }
    }

    #[test]
    fn scalar_shifts_match_16bit_lanes() {
        let v: [u32; 16] = std::array::from_fn(|i| 0x9abc_def1u32.wrapping_mul(i as u32 + 7));
        for s in 0..8 {
            // SAFETY: pure lane arithmetic.
            let (r, l) = unsafe { (Scalar::shr16(v, s), Scalar::shl16(v, s)) };
            for i in 0..16 {
                let (lo, hi) = (v[i] as u16, (v[i] >> 16) as u16);
                assert_eq!(r[i], ((lo >> s) as u32) | (((hi >> s) as u32) << 16));
                assert_eq!(l[i], ((lo << s) as u32) | (((hi << s) as u32) << 16));
            }
        }
    }

    /// The bit moves of the weight unpacking, on every byte value: the scalar model's shift
    /// and mask forms against their definitions, and the 512-bit ones (with and without GFNI,
    /// where this CPU has them) against the scalar model.
    #[test]
    fn bit_field_moves_match_their_definitions_on_every_byte() {
        // Four 64-byte lines: every byte value once, at every position within its 16-bit lane.
        let lines: Vec<[u8; 64]> = (0..4)
            .map(|l| std::array::from_fn(|i| (64 * l + i) as u8))
            .collect();
        let as_lanes = |b: &[u8; 64]| -> [u32; 16] {
            std::array::from_fn(|i| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()))
        };
        let bytes = |v: [u32; 16]| -> Vec<u8> { v.iter().flat_map(|w| w.to_le_bytes()).collect() };
        // Q6_K's field moves leave bits 0–3 to the select that follows: compare bits 4–7.
        let top = |b: Vec<u8>| -> Vec<u8> { b.iter().map(|x| x & 0xF0).collect() };
        for line in &lines {
            // SAFETY: pure lane arithmetic.
            let hi = bytes(unsafe { Scalar::hi_nibbles(as_lanes(line)) });
            assert!(
                line.iter().zip(&hi).all(|(x, h)| x >> 4 == *h),
                "scalar hi_nibbles"
            );
            for q in 0..4 {
                // SAFETY: as above.
                let f = top(bytes(unsafe { Scalar::q6k_field(as_lanes(line), q) }));
                let want: Vec<u8> = line.iter().map(|x| ((x >> (2 * q)) & 3) << 4).collect();
                assert_eq!(f, want, "scalar q6k_field({q})");
            }
        }
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
            unsafe fn moves<const GFNI: bool>(line: &[u8; 64]) -> (Vec<u8>, Vec<Vec<u8>>) {
                type S<const G: bool> = x86::Avx512<G>;
                let out = |v: __m512i| {
                    let mut b = [0u8; 64];
                    // SAFETY: 64 writable bytes.
                    unsafe { _mm512_storeu_si512(b.as_mut_ptr() as *mut _, v) };
                    b.to_vec()
                };
                // SAFETY: the caller checked the features.
                unsafe {
                    let v = S::<GFNI>::load(line.as_ptr());
                    let fields = (0..4).map(|q| out(S::<GFNI>::q6k_field(v, q))).collect();
                    (out(S::<GFNI>::hi_nibbles(v)), fields)
                }
            }
            for (isa, gfni) in [(Isa::Avx512Vnni, false), (Isa::Avx512Gfni, true)] {
                if !isa.available() {
                    eprintln!("{}: not on this CPU, not compared", isa.name());
                    continue;
                }
                for line in &lines {
                    // SAFETY: the path's features are available (checked above).
                    let (hi, fields) = unsafe {
                        if gfni {
                            moves::<true>(line)
                        } else {
                            moves::<false>(line)
                        }
                    };
                    // SAFETY: pure lane arithmetic.
                    let want_hi = bytes(unsafe { Scalar::hi_nibbles(as_lanes(line)) });
                    assert_eq!(hi, want_hi, "{} hi_nibbles", isa.name());
                    for (q, f) in fields.into_iter().enumerate() {
                        // SAFETY: as above.
                        let want = top(bytes(unsafe { Scalar::q6k_field(as_lanes(line), q) }));
                        assert_eq!(top(f), want, "{} q6k_field({q})", isa.name());
                    }
                }
            }
        }
    }
}
