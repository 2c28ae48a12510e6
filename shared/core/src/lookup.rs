//! Prompt lookup (docs/ALGORITHMS.md §9): a continuation copied from earlier in the context,
//! proposed as an extra branch of the tree at no draft-model cost. Code edits, summaries and
//! retrieval answers repeat long spans of their input; where the newest tokens occurred before,
//! what followed them then is a cheap guess at what follows now.

/// How continuations are looked up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupParams {
    /// Shortest suffix of the context that must match an earlier span.
    pub min_ngram: usize,
    /// Longest suffix tried (longer matches are tried first: they predict better).
    pub max_ngram: usize,
    /// Most tokens proposed; 0 turns lookup off.
    pub max_tokens: usize,
}

impl LookupParams {
    pub fn enabled(&self) -> bool {
        self.max_tokens > 0 && self.min_ngram > 0 && self.max_ngram >= self.min_ngram
    }
}

/// The tokens that followed the most recent earlier occurrence of the context's longest
/// matching suffix (between `min_ngram` and `max_ngram` tokens long), at most `max_tokens` of
/// them; empty when nothing matches or lookup is off. O(context × max_ngram) per call.
pub fn continuation<'c>(context: &'c [u32], p: &LookupParams) -> &'c [u32] {
    if !p.enabled() {
        return &[];
    }
    let len = context.len();
    for n in (p.min_ngram..=p.max_ngram.min(len.saturating_sub(1))).rev() {
        let suffix = &context[len - n..];
        // Most recent first: nearby text predicts best. An occurrence must leave at least one
        // token after it (the one that followed), so it starts at most at len - n - 1.
        for start in (0..len - n).rev() {
            if &context[start..start + n] == suffix {
                let from = start + n;
                let to = (from + p.max_tokens).min(len);
                return &context[from..to];
            }
        }
    }
    &[]
}

/// What lookup guesses would have been worth, position by position, counted after every greedy
/// step whether or not the guess was sent: at T = 0 a step commits exactly the target's greedy
/// tokens, so comparing the guess made before the step with the tokens the step committed says
/// how many of its tokens verification would have accepted. Position `i` of a guess is known
/// once the first `i` tokens matched and either the step committed more than `i` tokens or the
/// guess already failed there; past the committed tokens nothing is known and nothing is
/// counted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LookupRecord {
    /// `tried[i]`: steps whose guess matched its first `i` tokens with position `i` known.
    tried: Vec<u64>,
    /// `right[i]`: those whose token `i` matched too.
    right: Vec<u64>,
}

/// Prior of every position's conditional rate: one right in two tries (0.5), so that a few steps
/// of evidence decide and untried deep positions are neither free nor worthless.
const PRIOR_RIGHT: f64 = 1.0;
const PRIOR_TRIED: f64 = 2.0;

impl LookupRecord {
    /// Count the guess looked up before a step against the tokens the step committed (its
    /// accepted path, then the correction or bonus token).
    pub fn record(&mut self, guess: &[u32], committed: &[u32]) {
        for (i, &g) in guess.iter().enumerate() {
            let Some(&c) = committed.get(i) else {
                break; // past what the step committed: unknown
            };
            if self.tried.len() <= i {
                self.tried.resize(i + 1, 0);
                self.right.resize(i + 1, 0);
            }
            self.tried[i] += 1;
            if g != c {
                break;
            }
            self.right[i] += 1;
        }
    }

    /// Estimated probability that a guess's first `i + 1` tokens are all right: the product of
    /// the positions' conditional rates (each with the prior).
    pub fn reach(&self, i: usize) -> f64 {
        (0..=i)
            .map(|j| {
                let tried = self.tried.get(j).copied().unwrap_or(0) as f64;
                let right = self.right.get(j).copied().unwrap_or(0) as f64;
                (right + PRIOR_RIGHT) / (tried + PRIOR_TRIED)
            })
            .product()
    }
}

/// How many tokens of a guess of `len` tokens to graft onto a tree: the first `merged` follow
/// drafted nodes (free: they add no node), each later one adds a node. Token `i` (0-based) of
/// the guess commits one more token than the tree would with probability
/// [`LookupRecord::reach`]`(i)`, worth `ms_per_token` (what a committed token costs at the
/// plan's rate); the `j`-th added node (1-based) costs `node_ms(j)` of verify time. Returns the
/// prefix length with the largest expected saving, `merged` when no added node pays (the
/// merged part costs nothing either way). On a node where extra rows are nearly free (memory-
/// bound verification) every guess is sent whole; where each row costs ~15 ms (a one-core CPU)
/// only guesses that are usually right are.
pub fn worth_grafting(
    record: &LookupRecord,
    len: usize,
    merged: usize,
    ms_per_token: f64,
    node_ms: impl Fn(usize) -> f64,
) -> usize {
    let merged = merged.min(len);
    let (mut best, mut best_len, mut total) = (0.0f64, merged, 0.0f64);
    for i in merged..len {
        total += record.reach(i) * ms_per_token - node_ms(i - merged + 1);
        if total > best {
            (best, best_len) = (total, i + 1);
        }
    }
    best_len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_counts_what_each_position_would_have_earned() {
        let mut r = LookupRecord::default();
        // Matched 2, failed at position 2 (known: the step committed 4 tokens).
        r.record(&[1, 2, 3, 4], &[1, 2, 9, 9]);
        // Matched everything the step committed: positions 2.. are unknown.
        r.record(&[1, 2, 3, 4], &[1, 2]);
        assert_eq!(r.tried, vec![2, 2, 1]);
        assert_eq!(r.right, vec![2, 2, 0]);
        // Position 0: (2 + 1) / (2 + 2); position 2 adds (0 + 1) / (1 + 2).
        assert!((r.reach(0) - 0.75).abs() < 1e-12);
        assert!((r.reach(2) - 0.75 * 0.75 / 3.0).abs() < 1e-12);
        // An untried position keeps the prior.
        assert!((r.reach(3) - r.reach(2) * 0.5).abs() < 1e-12);
    }

    #[test]
    fn guesses_are_grafted_only_as_far_as_they_pay() {
        let mut sure = LookupRecord::default();
        let mut wrong = LookupRecord::default();
        for _ in 0..50 {
            sure.record(&[1, 2, 3, 4, 5, 6], &[1, 2, 3, 4, 5, 6, 7]);
            wrong.record(&[1, 2, 3, 4, 5, 6], &[8, 2, 3, 4, 5, 6, 7]);
        }
        // Rows nearly free: everything, whatever the record.
        assert_eq!(worth_grafting(&wrong, 6, 0, 80.0, |_| 0.01), 6);
        // 15 ms a row, 80 ms a token: the sure guess whole, the wrong one not at all.
        assert_eq!(worth_grafting(&sure, 6, 0, 80.0, |_| 15.0), 6);
        assert_eq!(worth_grafting(&wrong, 6, 0, 80.0, |_| 15.0), 0);
        // The part that follows drafted nodes is kept either way.
        assert_eq!(worth_grafting(&wrong, 6, 2, 80.0, |_| 15.0), 2);
        // The prior alone (0.5, 0.25, 0.125, ...) at 80 ms a token: two nodes at 15 ms pay
        // (40 − 15, 20 − 15), the third (10 − 15) does not.
        let fresh = LookupRecord::default();
        assert_eq!(worth_grafting(&fresh, 6, 0, 80.0, |_| 15.0), 2);
        assert_eq!(worth_grafting(&fresh, 0, 0, 80.0, |_| 15.0), 0);
    }

    const P: LookupParams = LookupParams {
        min_ngram: 2,
        max_ngram: 4,
        max_tokens: 3,
    };

    #[test]
    fn copies_what_followed_the_longest_match() {
        // "1 2 3" occurred before, followed by 4 5 6 7.
        let ctx = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3];
        assert_eq!(continuation(&ctx, &P), &[4, 5, 6]);
    }

    #[test]
    fn prefers_the_most_recent_occurrence() {
        let ctx = [8, 9, 1, 8, 9, 2, 8, 9];
        assert_eq!(continuation(&ctx, &P), &[2, 8, 9]);
    }

    #[test]
    fn longer_matches_win_over_recent_short_ones() {
        // Suffix 5 6 7: the 3-gram occurs at the start; the 2-gram "6 7" more recently.
        let ctx = [5, 6, 7, 1, 1, 6, 7, 2, 5, 6, 7];
        assert_eq!(continuation(&ctx, &P), &[1, 1, 6]);
    }

    #[test]
    fn stops_at_the_end_of_the_context() {
        // The continuation may run into the suffix itself, but not past the context.
        let ctx = [1, 2, 1, 2];
        assert_eq!(continuation(&ctx, &P), &[1, 2]);
    }

    #[test]
    fn nothing_without_a_match_or_when_off() {
        assert!(continuation(&[1, 2, 3, 4, 5], &P).is_empty());
        assert!(continuation(&[], &P).is_empty());
        assert!(continuation(&[7], &P).is_empty());
        let off = LookupParams { max_tokens: 0, ..P };
        assert!(continuation(&[1, 2, 3, 1, 2], &off).is_empty());
        let below_min = [3, 1, 4, 1];
        assert!(
            continuation(&below_min, &P).is_empty(),
            "a 1-gram is below min_ngram"
        );
    }
}
