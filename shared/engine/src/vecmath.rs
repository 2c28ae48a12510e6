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
    g.iter()
        .zip(u)
        .map(|(&g, &u)| {
            let t = exp_nonpositive(-g.abs());
            let num = if g >= 0.0 { g } else { g * t };
            num / (1.0 + t) * u
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
