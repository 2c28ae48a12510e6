//! From logits to the distributions both models sample from, and the random numbers they use.
//!
//! - [`probs_from_logits`]: temperature, top-k and top-p (nucleus) in a numerically stable way;
//! - [`SparseDist`]: a truncated distribution as (token, probability) pairs, the wire form of the
//!   draft's q;
//! - [`sample_without_replacement`]: the exponential race (Gumbel-top-k), returning tokens in
//!   rank order; [`greedy_top_k`] for T = 0;
//! - [`SessionRng`]: a counter-based ChaCha stream per (seed, stream id), so a (seed, session)
//!   pair reproduces a run exactly and every number is fresh.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha12Rng;
use serde::{Deserialize, Serialize};

/// Random-number streams: the draft and the verifier of one session never share numbers.
pub const DRAFT_STREAM: u64 = 1;
pub const VERIFY_STREAM: u64 = 2;

/// The draft's stream for the tree rooted after `position` committed tokens. Trees draw from
/// streams of their own (not one running stream), so a tree grown ahead of its verdict by
/// pipelined drafting draws exactly what the same tree grown afterwards would: seeded output
/// does not depend on pipelining (docs/ALGORITHMS.md §10). Distinct from the fixed streams
/// above for every position.
pub fn draft_tree_stream(position: u64) -> u64 {
    ((position + 1) << 8) | DRAFT_STREAM
}

/// A seeded random stream. Same (seed, stream) → same numbers.
#[derive(Debug, Clone)]
pub struct SessionRng(ChaCha12Rng);

impl SessionRng {
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut rng = ChaCha12Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        Self(rng)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.0.gen::<f64>()
    }

    /// Uniform in (0, 1), safe for logarithms.
    pub fn open_uniform(&mut self) -> f64 {
        loop {
            let u = self.0.gen::<f64>();
            if u > 0.0 {
                return u;
            }
        }
    }
}

/// How a model's next-token distribution is shaped before sampling.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = no top-k truncation.
    pub top_k: usize,
    /// 1 (or 0) = no nucleus truncation.
    pub top_p: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        }
    }
}

/// Invalid sampling settings.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be finite and ≥ 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in [0, 1], got {0}")]
    TopP(f32),
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(SamplingError::TopP(self.top_p));
        }
        Ok(())
    }

    fn nucleus(&self) -> Option<f32> {
        (self.top_p > 0.0 && self.top_p < 1.0).then_some(self.top_p)
    }
}

/// Index of the largest logit (lowest index on ties; NaNs are never chosen over numbers).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut top = f32::NEG_INFINITY;
    for (i, &x) in logits.iter().enumerate() {
        if x > top {
            top = x;
            best = i;
        }
    }
    best as u32
}

/// Candidates examined before a full sort when applying top-p: a nucleus almost always lies
/// within the few hundred most likely tokens.
const NUCLEUS_CANDIDATES: usize = 1024;

/// Dense probabilities from logits under `params` (temperature, then top-k, then top-p;
/// renormalized). Zero outside the kept set. At temperature 0, a one-hot on the argmax.
pub fn probs_from_logits(logits: &[f32], params: &SamplingParams) -> Vec<f32> {
    let mut probs = vec![0.0f32; logits.len()];
    if logits.is_empty() {
        return probs;
    }
    if params.is_greedy() {
        probs[argmax(logits) as usize] = 1.0;
        return probs;
    }
    let inv_t = 1.0 / params.temperature;
    // top-k threshold on logits (ties at the threshold are kept).
    let mut floor = f32::NEG_INFINITY;
    if params.top_k > 0 && params.top_k < logits.len() {
        let mut tmp: Vec<f32> = logits.iter().map(|&x| sanitize(x)).collect();
        let k = params.top_k;
        let (_, kth, _) = tmp.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        floor = *kth;
    }
    let max = logits
        .iter()
        .map(|&x| sanitize(x))
        .fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for (p, &x) in probs.iter_mut().zip(logits) {
        let x = sanitize(x);
        if x >= floor && x > f32::NEG_INFINITY {
            let e = (((x - max) * inv_t) as f64).exp();
            *p = e as f32;
            sum += e;
        }
    }
    if sum <= 0.0 || !sum.is_finite() {
        // All logits -inf or broken: fall back to greedy rather than emit NaNs.
        probs.fill(0.0);
        probs[argmax(logits) as usize] = 1.0;
        return probs;
    }
    let inv = (1.0 / sum) as f32;
    probs.iter_mut().for_each(|p| *p *= inv);
    if let Some(top_p) = params.nucleus() {
        apply_top_p(&mut probs, top_p);
    }
    probs
}

fn sanitize(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// Keep the smallest set of most likely tokens whose mass reaches `top_p`; renormalize.
fn apply_top_p(probs: &mut [f32], top_p: f32) {
    let order_desc = |a: &(usize, f32), b: &(usize, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let nonzero: Vec<(usize, f32)> = probs
        .iter()
        .enumerate()
        .filter(|(_, &p)| p > 0.0)
        .map(|(i, &p)| (i, p))
        .collect();
    let mut cand = nonzero;
    if cand.len() > NUCLEUS_CANDIDATES {
        cand.select_nth_unstable_by(NUCLEUS_CANDIDATES - 1, order_desc);
        let head_mass: f64 = cand[..NUCLEUS_CANDIDATES].iter().map(|c| c.1 as f64).sum();
        if head_mass >= top_p as f64 {
            cand.truncate(NUCLEUS_CANDIDATES);
        }
    }
    cand.sort_unstable_by(order_desc);
    let mut mass = 0.0f64;
    let mut keep = cand.len();
    for (i, &(_, p)) in cand.iter().enumerate() {
        mass += p as f64;
        if mass >= top_p as f64 {
            keep = i + 1;
            break;
        }
    }
    let kept_mass: f64 = cand[..keep].iter().map(|c| c.1 as f64).sum();
    probs.fill(0.0);
    for &(i, p) in &cand[..keep] {
        probs[i] = (p as f64 / kept_mass) as f32;
    }
}

/// Sample one index from dense probabilities (need not be exactly normalized).
pub fn sample_dense(probs: &[f32], rng: &mut SessionRng) -> u32 {
    let total: f64 = probs.iter().map(|&p| p.max(0.0) as f64).sum();
    if total <= 0.0 || !total.is_finite() {
        return argmax(probs);
    }
    let mut r = rng.uniform() * total;
    let mut last = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            last = i;
            r -= p as f64;
            if r < 0.0 {
                return i as u32;
            }
        }
    }
    last as u32
}

/// A truncated distribution: `tokens[i]` has probability `probs[i]`; all others 0.
/// Kept sorted by probability, most likely first.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SparseDist {
    pub tokens: Vec<u32>,
    pub probs: Vec<f32>,
}

impl SparseDist {
    /// The `k` most likely tokens of a dense distribution, renormalized (k = 0: all nonzero).
    pub fn top_k_of(dense: &[f32], k: usize) -> Self {
        let mut pairs: Vec<(u32, f32)> = dense
            .iter()
            .enumerate()
            .filter(|(_, &p)| p > 0.0)
            .map(|(i, &p)| (i as u32, p))
            .collect();
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if k > 0 && pairs.len() > k {
            pairs.select_nth_unstable_by(k - 1, order);
            pairs.truncate(k);
        }
        pairs.sort_unstable_by(order);
        let sum: f64 = pairs.iter().map(|p| p.1 as f64).sum();
        let (tokens, probs) = pairs
            .into_iter()
            .map(|(t, p)| (t, (p as f64 / sum) as f32))
            .unzip();
        Self { tokens, probs }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Probability of `token` (0 when absent).
    pub fn prob(&self, token: u32) -> f32 {
        self.tokens
            .iter()
            .position(|&t| t == token)
            .map_or(0.0, |i| self.probs[i])
    }
}

/// Draw `b` distinct tokens without replacement from `q`, in rank (draw) order, by the
/// exponential race: the winners are the b largest ln(u)/q. Fewer when q has fewer nonzero tokens.
pub fn sample_without_replacement(q: &SparseDist, b: usize, rng: &mut SessionRng) -> Vec<u32> {
    let mut keys: Vec<(f64, u32)> = q
        .tokens
        .iter()
        .zip(&q.probs)
        .filter(|(_, &p)| p > 0.0)
        .map(|(&t, &p)| (rng.open_uniform().ln() / p as f64, t))
        .collect();
    keys.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
    keys.into_iter().take(b).map(|(_, t)| t).collect()
}

/// The `b` highest logits, best first (greedy drafting at T = 0).
pub fn greedy_top_k(logits: &[f32], b: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let order = |a: &u32, c: &u32| {
        sanitize(logits[*c as usize])
            .total_cmp(&sanitize(logits[*a as usize]))
            .then(a.cmp(c))
    };
    if b > 0 && b < idx.len() {
        idx.select_nth_unstable_by(b - 1, order);
        idx.truncate(b);
    }
    idx.sort_unstable_by(order);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, k: usize, p: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
        }
    }

    #[test]
    fn softmax_temperature_and_truncation() {
        let logits = [1000.0, 999.0, 998.0, -1e30];
        let p = probs_from_logits(&logits, &params(1.0, 0, 1.0));
        let z = 1.0 + (-1.0f64).exp() + (-2.0f64).exp();
        assert!((p[0] as f64 - 1.0 / z).abs() < 1e-6);
        assert!(p.iter().all(|x| x.is_finite()));
        let p = probs_from_logits(&logits, &params(1.0, 2, 1.0));
        assert_eq!(p[2], 0.0);
        assert!((p[0] + p[1] - 1.0).abs() < 1e-6);
        // top-p 0.7: token 0 has 0.665 < 0.7, so tokens 0 and 1 are kept.
        let p = probs_from_logits(&logits, &params(1.0, 0, 0.7));
        assert!(p[0] > 0.0 && p[1] > 0.0 && p[2] == 0.0);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let p = probs_from_logits(&logits, &params(0.0, 0, 1.0));
        assert_eq!(p, vec![1.0, 0.0, 0.0, 0.0]);
        // Low temperature sharpens.
        let cold = probs_from_logits(&logits, &params(0.1, 0, 1.0));
        assert!(cold[0] > 0.9999);
    }

    #[test]
    fn nan_logits_do_not_poison() {
        let p = probs_from_logits(&[f32::NAN, 1.0, 2.0], &params(1.0, 0, 0.9));
        assert_eq!(p[0], 0.0);
        assert!(p.iter().all(|x| x.is_finite()));
        let p = probs_from_logits(&[f32::NEG_INFINITY; 3], &params(1.0, 0, 1.0));
        assert_eq!(p.iter().sum::<f32>(), 1.0);
    }

    #[test]
    fn nucleus_over_a_large_vocabulary() {
        // Flat-ish distribution over 5000 tokens: the nucleus is larger than the candidate head.
        let logits: Vec<f32> = (0..5000).map(|i| -(i as f32) * 1e-4).collect();
        let p = probs_from_logits(&logits, &params(1.0, 0, 0.95));
        let kept = p.iter().filter(|&&x| x > 0.0).count();
        assert!(kept > 4000 && kept < 5000, "{kept}");
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-4);
    }

    #[test]
    fn rng_is_reproducible_and_streams_differ() {
        let a: Vec<f64> = (0..4)
            .map({
                let mut r = SessionRng::new(42, DRAFT_STREAM);
                move |_| r.uniform()
            })
            .collect();
        let mut r = SessionRng::new(42, DRAFT_STREAM);
        let b: Vec<f64> = (0..4).map(|_| r.uniform()).collect();
        let mut r = SessionRng::new(42, VERIFY_STREAM);
        let c: Vec<f64> = (0..4).map(|_| r.uniform()).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn swor_first_draw_follows_q_and_tokens_are_distinct() {
        let q = SparseDist {
            tokens: vec![5, 9, 2],
            probs: vec![0.5, 0.3, 0.2],
        };
        let mut rng = SessionRng::new(1, 0);
        let n = 200_000;
        let mut first = [0usize; 3];
        let mut second_given_5 = [0usize; 2];
        for _ in 0..n {
            let s = sample_without_replacement(&q, 3, &mut rng);
            assert_eq!(s.len(), 3);
            let mut sorted = s.clone();
            sorted.sort();
            assert_eq!(sorted, vec![2, 5, 9]);
            first[q.tokens.iter().position(|&t| t == s[0]).unwrap()] += 1;
            if s[0] == 5 {
                second_given_5[if s[1] == 9 { 0 } else { 1 }] += 1;
            }
        }
        for (i, &c) in first.iter().enumerate() {
            let f = c as f64 / n as f64;
            let p = q.probs[i] as f64;
            assert!(
                (f - p).abs() < 5.0 * (p * (1.0 - p) / n as f64).sqrt(),
                "{i}: {f}"
            );
        }
        // Given 5 first, the second is 9 with probability 0.3 / 0.5.
        let m = (second_given_5[0] + second_given_5[1]) as f64;
        let f = second_given_5[0] as f64 / m;
        assert!((f - 0.6).abs() < 5.0 * (0.24 / m).sqrt(), "{f}");
    }

    #[test]
    fn sparse_top_k_and_greedy_order() {
        let d = SparseDist::top_k_of(&[0.1, 0.5, 0.0, 0.4], 2);
        assert_eq!(d.tokens, vec![1, 3]);
        assert!((d.probs[0] - 5.0 / 9.0).abs() < 1e-6);
        assert_eq!(d.prob(0), 0.0);
        assert_eq!(greedy_top_k(&[0.1, 3.0, 2.0, f32::NAN], 3), vec![1, 2, 0]);
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
    }
}
