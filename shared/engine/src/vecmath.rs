//! Elementwise float functions of the forward pass and fixed-order sums, written as
//! straight-line f32 arithmetic so that loops over them vectorize, and so a value's result never
//! depends on which lane or which batch it is computed in (the batch-invariance promise covers
//! these too). Attention, the MLP and the drafter's softmax use them.

/// `e^x` for `x ≤ 0` (in attention: a score minus the row's max), within about one ulp of `expf`; 0 below
/// the smallest normal result (and for −∞). Straight-line f32 arithmetic, so a loop over a
/// row's scores vectorizes (a scalar `expf` call per key was most of the attention time at
/// long contexts). Range reduction by ln 2 in two parts, then a degree-6 polynomial on
/// [−ln2/2, ln2/2], the classic single-precision scheme.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MIN: f32 = -87.0;
    let xc = x.max(MIN);
    let n = (xc * LOG2E + 0.5).floor();
    let r = xc - n * LN2_HI - n * LN2_LO;
    let z = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 5.000_000_1e-1;
    let y = p * z + r + 1.0;
    // n is an integer in [−126, 0]: adding 1.5 · 2²³ moves it exactly into the low mantissa
    // bits, which spares the float-to-int cast the compiler keeps scalar (saturation).
    const MAGIC: f32 = 12_582_912.0;
    let ni = (n + MAGIC).to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    if x < MIN {
        0.0
    } else {
        y * scale
    }
}

/// Sum in a fixed order: eight running sums by position, combined in a fixed order. The
/// position of every term is the same for a query whatever else shares its forward (the
/// scores are compacted to the visible keys first), so the sum is too.
#[inline]
pub(crate) fn sum8(xs: &[f32]) -> f32 {
    sum8_of(xs, |x| x)
}

/// [`sum8`] of `f` applied to every element, without storing the results.
#[inline(always)]
fn sum8_of(xs: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = xs.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += f(xs[c * 8 + l]);
        }
    }
    let mut tail = 0f32;
    for &x in &xs[chunks * 8..] {
        tail += f(x);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Σ e^(x − max) over the finite `xs` (non-finite ones count as 0), with `max` at least every
/// finite x: a softmax's normalizer, computed like attention's (vectorizable exponential,
/// eight running sums).
pub(crate) fn sum_exp(xs: &[f32], max: f32) -> f32 {
    sum8_of(xs, |x| {
        if x.is_finite() {
            exp_nonpositive(x - max)
        } else {
            0.0
        }
    })
}

/// `silu(g) · u` for each pair: `g · σ(g) · u` with `σ(g) = 1 / (1 + e^−g)`, through
/// [`exp_nonpositive`] of `−|g|` (for `g < 0`, `σ(g) = t / (1 + t)` with `t = e^g`), so no
/// exponential overflows and the loop vectorizes: a scalar `expf` per value was about 5 % of a
/// tree forward.
pub(crate) fn silu_mul(g: &[f32], u: &[f32]) -> Vec<f32> {
    assert_eq!(g.len(), u.len(), "silu_mul: gate and up widths differ");
    g.iter().zip(u).map(|(&g, &u)| silu_times(g, u)).collect()
}

/// [`silu_mul`] into `out` (the same values, element by element).
pub(crate) fn silu_mul_into(g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(
        g.len() == u.len() && u.len() == out.len(),
        "silu_mul: gate, up and output widths differ"
    );
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = silu_times(g, u);
    }
}

/// RMS norm of each row of `x` (rows of `w.len()` values), times `w`: candle's CPU
/// `rms_norm`, the same operations in the same order (a sequential sum of squares, then
/// `x / sqrt(mean + eps) · w` per element), so the same bits. Rows go over the engine's
/// threads from 8 of them.
pub(crate) fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let dim = w.len();
    assert!(
        dim > 0 && x.len().is_multiple_of(dim),
        "rms_norm: rows of {dim}"
    );
    let rows = x.len() / dim;
    let mut out = vec![0f32; x.len()];
    let norm_row = |src: &[f32], dst: &mut [f32]| {
        let sum2 = src.iter().map(|&v| v * v).sum::<f32>();
        let m = (sum2 / dim as f32 + eps).sqrt();
        for ((d, s), a) in dst.iter_mut().zip(src).zip(w) {
            *d = *s / m * *a
        }
    };
    if rows < 8 {
        for (src, dst) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            norm_row(src, dst);
        }
        return out;
    }
    let dst = crate::qkernels::OutPtr::new(&mut out, dim);
    crate::parallel::for_each(rows, |r| {
        // SAFETY: row `r` of `out`, which outlives the loop, written by this task only.
        let row = unsafe { std::slice::from_raw_parts_mut(dst.at(r, 0, dim), dim) };
        norm_row(&x[r * dim..(r + 1) * dim], row);
    });
    out
}

/// Rotary embedding of `x` (`rows × heads × d`, row-major) in place, with `cos`, `sin` the
/// `rows × d/2` tables at the rows' positions: candle's `rope_thd`, the same two products and
/// one sum or difference per element, so the same bits.
pub(crate) fn rope_in_place(x: &mut [f32], heads: usize, d: usize, cos: &[f32], sin: &[f32]) {
    let half = d / 2;
    assert!(
        d.is_multiple_of(2) && x.len().is_multiple_of(heads * d),
        "rope: rows of {heads} × {d}"
    );
    let rows = x.len() / (heads * d);
    assert!(
        cos.len() == rows * half && sin.len() == rows * half,
        "rope: tables for {rows} rows"
    );
    for (t, row) in x.chunks_exact_mut(heads * d).enumerate() {
        let (c, s) = (&cos[t * half..][..half], &sin[t * half..][..half]);
        for head in row.chunks_exact_mut(d) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x1 * s[i] + x2 * c[i];
            }
        }
    }
}

#[inline(always)]
fn silu_times(g: f32, u: f32) -> f32 {
    let t = exp_nonpositive(-g.abs());
    let num = if g >= 0.0 { g } else { g * t };
    num / (1.0 + t) * u
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::assert_same_bits;
    use candle_core::{Device, Tensor};

    fn randn(n: usize, scale: f32) -> Vec<f32> {
        let t = Tensor::randn(0f32, scale, n, &Device::Cpu).unwrap();
        t.to_vec1().unwrap()
    }

    /// Our RMS norm gives candle's CPU op's bits, on the calling thread (under 8 rows) and
    /// over the engine's threads.
    #[test]
    fn rms_norm_rows_equals_candles_bit_for_bit() {
        let dim = 1536;
        let w = randn(dim, 1.0);
        for rows in [1usize, 3, 8, 21] {
            let x = randn(rows * dim, 3.0);
            let want: Vec<f32> = candle_nn::ops::rms_norm(
                &Tensor::from_vec(x.clone(), (rows, dim), &Device::Cpu).unwrap(),
                &Tensor::from_vec(w.clone(), dim, &Device::Cpu).unwrap(),
                1e-6,
            )
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
            let got = rms_norm_rows(&x, &w, 1e-6);
            assert_same_bits(&got, &want, &format!("{rows} rows"));
        }
    }

    /// Our in-place rotary embedding gives candle's `rope_thd` bits.
    #[test]
    fn rope_in_place_equals_candles_bit_for_bit() {
        let (heads, d) = (6, 128);
        for rows in [1usize, 5, 16] {
            let x = randn(rows * heads * d, 2.0);
            let angles: Vec<f32> = (0..rows * d / 2).map(|i| 0.37 * i as f32).collect();
            let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
            let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
            let table = |v: &Vec<f32>| Tensor::from_vec(v.clone(), (rows, d / 2), &Device::Cpu);
            let want: Vec<f32> = candle_nn::rotary_emb::rope_thd(
                &Tensor::from_vec(x.clone(), (1, rows, heads, d), &Device::Cpu).unwrap(),
                &table(&cos).unwrap(),
                &table(&sin).unwrap(),
            )
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
            let mut got = x.clone();
            rope_in_place(&mut got, heads, d, &cos, &sin);
            assert_ne!(got, x, "rotated");
            assert_same_bits(&got, &want, &format!("{rows} rows"));
        }
    }

    /// The polynomial exponential stays within 2 ulp of the library's over the range scores
    /// minus their max take, and is 0 for −∞.
    #[test]
    fn exp_matches_the_library() {
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(0.0), 1.0);
        let mut x = 0f32;
        while x > -87.0 {
            let (got, want) = (exp_nonpositive(x), x.exp());
            let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
            assert!(ulps <= 2, "exp({x}) = {got}, library {want} ({ulps} ulp)");
            x -= 0.0137;
        }
    }

    /// A softmax normalizer over a logit row (as the drafter takes one): the library's sum of
    /// exponentials to float accuracy, with non-finite logits counting as nothing.
    #[test]
    fn sum_of_exponentials_matches_the_library() {
        let row: Vec<f32> = (0..1003)
            .map(|i| ((i * 37) % 101) as f32 * 0.13 - 6.0)
            .collect();
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let want: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
        let got = sum_exp(&row, max) as f64;
        assert!((got - want).abs() < 1e-5 * want, "{got} vs {want}");
        let mut broken = row.clone();
        broken.extend([f32::NAN, f32::NEG_INFINITY, f32::INFINITY]);
        assert_eq!(sum_exp(&broken, max), sum_exp(&row, max));
    }

    /// silu through the polynomial agrees with the library formula to a few ulp of its
    /// magnitude, at both signs and far into both tails.
    #[test]
    fn silu_mul_matches_the_library_formula() {
        let mut g = -90f32;
        while g < 90.0 {
            let got = silu_mul(&[g], &[1.5])[0];
            let want = g / (1.0 + (-g).exp()) * 1.5;
            // Below e^−87 the polynomial flushes to 0, where the library still has ~1e−38.
            let tol = (4.0 * f32::EPSILON * want.abs()).max(1e-30);
            assert!(
                (got - want).abs() <= tol,
                "silu({g}) · 1.5 = {got}, library {want}"
            );
            g += 0.0173;
        }
        assert_eq!(silu_mul(&[0.0], &[3.0])[0], 0.0);
        assert_eq!(silu_mul(&[-200.0], &[3.0])[0], 0.0);
        assert_eq!(silu_mul(&[200.0], &[3.0])[0], 600.0);
    }
}
