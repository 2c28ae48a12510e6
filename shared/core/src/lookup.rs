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

#[cfg(test)]
mod tests {
    use super::*;

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
