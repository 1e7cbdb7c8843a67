//! Prompt-lookup (ngram) proposer.
//!
//! The drafts for a request are the tokens that followed an earlier occurrence of the context's own
//! suffix. The context is everything committed so far, prompt and generated tokens together, with no
//! window. Among suffix lengths in `[min_n, max_n]` the longest match wins; among matches of that
//! length the earliest occurrence wins, as in vLLM, so both engines propose the same drafts.
//!
//! The search is a KMP prefix-function scan over the reversed context, O(len) time and O(max_n)
//! memory: in reversed order the suffix becomes a prefix, and "the longest prefix of the reversed
//! context ending at index i" is the length of the suffix match whose earlier occurrence ends there.

use thiserror::Error;

/// Why an ngram configuration was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum NgramConfigError {
    #[error("ngram min_n must be at least 1, got {0}")]
    MinTooSmall(usize),
    #[error("ngram min_n ({min_n}) must not exceed max_n ({max_n})")]
    MinAboveMax { min_n: usize, max_n: usize },
    #[error("ngram proposals need k >= 1 draft tokens, got {0}")]
    NoDraftTokens(usize),
}

/// Suffix lengths searched and the most drafts proposed per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramConfig {
    pub min_n: usize,
    pub max_n: usize,
    pub k: usize,
}

impl NgramConfig {
    pub fn validate(&self) -> Result<(), NgramConfigError> {
        if self.min_n < 1 {
            return Err(NgramConfigError::MinTooSmall(self.min_n));
        }
        if self.min_n > self.max_n {
            return Err(NgramConfigError::MinAboveMax { min_n: self.min_n, max_n: self.max_n });
        }
        if self.k < 1 {
            return Err(NgramConfigError::NoDraftTokens(self.k));
        }
        Ok(())
    }
}

/// Drafts for the next step of a request whose committed tokens are `context`.
///
/// At most `min(cfg.k, max_new)` tokens, fewer when the match sits near the end of the context;
/// empty when no suffix of length `min_n..=max_n` occurs earlier. `max_new` is the caller's cap from
/// the remaining token budget and `max_model_len`. A configuration that fails
/// [`NgramConfig::validate`] proposes nothing.
pub fn propose_ngram(context: &[u32], cfg: &NgramConfig, max_new: usize) -> Vec<u32> {
    let draft_cap = cfg.k.min(max_new);
    if draft_cap == 0 || cfg.validate().is_err() || context.len() < cfg.min_n {
        return Vec::new();
    }
    match follow_of_longest_suffix_match(context, cfg.min_n, cfg.max_n) {
        Some(follow_start) => {
            let end = context.len().min(follow_start.saturating_add(draft_cap));
            context[follow_start..end].to_vec()
        }
        None => Vec::new(),
    }
}

/// Finds the longest suffix (length `min_n..=max_n`) with an earlier occurrence, ties to the
/// earliest, and returns the index of the token right after that occurrence (always `< len`).
///
/// Walks the reversed context `r` (so `r[j] = context[len - 1 - j]`) keeping `matched`, the length of
/// the longest prefix of `r`, capped at `max_n`, that ends at index `i`. The scan starts at `i = 1`,
/// so the suffix never matches itself. `border[j]` is the KMP failure value of `r[..=j]`; only the first
/// `max_n` entries are ever needed because `matched` never exceeds `max_n`.
fn follow_of_longest_suffix_match(context: &[u32], min_n: usize, max_n: usize) -> Option<usize> {
    let len = context.len();
    let reversed = |j: usize| context[len - 1 - j];
    let border_len = max_n.min(len);
    let mut border = vec![0usize; border_len];
    let mut matched = 0usize;
    let mut best_length = 0usize;
    let mut best_end = 0usize;
    let mut i = 1usize;
    while i < len {
        if reversed(matched) == reversed(i) {
            matched += 1;
            // `>=` keeps the largest i, which is the earliest occurrence in the original order.
            if matched >= best_length {
                best_length = matched;
                best_end = i;
            }
            if i < border_len {
                border[i] = matched;
            }
            if matched == max_n {
                // Cap the match so that longer repeats still count as length max_n at every end point.
                matched = border[max_n - 1];
            }
            i += 1;
        } else if matched != 0 {
            matched = border[matched - 1];
        } else {
            i += 1;
        }
    }
    if best_length < min_n {
        return None;
    }
    // The occurrence covers reversed[best_end + 1 - best_length ..= best_end], which in the original
    // order starts at len - 1 - best_end; the drafts begin right after it.
    Some(len - 1 - best_end + best_length)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn config(min_n: usize, max_n: usize, k: usize) -> NgramConfig {
        NgramConfig { min_n, max_n, k }
    }

    /// The definition, written directly: for each length from max_n down to min_n, the earliest start
    /// `s < len - n` where `context[s..s+n]` equals the suffix of length n.
    fn brute_force(context: &[u32], cfg: &NgramConfig, max_new: usize) -> Vec<u32> {
        let len = context.len();
        let cap = cfg.k.min(max_new);
        if cap == 0 || cfg.validate().is_err() {
            return Vec::new();
        }
        for n in (cfg.min_n..=cfg.max_n.min(len)).rev() {
            let suffix = &context[len - n..];
            if let Some(start) = (0..len - n).find(|&s| &context[s..s + n] == suffix) {
                let follow = start + n;
                return context[follow..len.min(follow + cap)].to_vec();
            }
        }
        Vec::new()
    }

    #[test]
    fn reference_example() {
        assert_eq!(propose_ngram(&[1, 2, 3, 4, 2, 3], &config(2, 3, 4), 100), vec![4, 2, 3]);
    }

    #[test]
    fn no_match_proposes_nothing() {
        assert!(propose_ngram(&[1, 2, 3, 4, 5], &config(1, 3, 4), 100).is_empty());
        // The suffix [4, 5] occurs only as the suffix itself.
        assert!(propose_ngram(&[4, 5, 1, 4, 5], &config(3, 3, 4), 100).is_empty());
        assert!(propose_ngram(&[], &config(1, 3, 4), 100).is_empty());
    }

    #[test]
    fn suffix_never_matches_itself() {
        assert!(propose_ngram(&[7], &config(1, 1, 3), 10).is_empty());
        assert!(propose_ngram(&[1, 2, 3], &config(1, 3, 3), 10).is_empty());
        // A run of one token matches a shifted copy of itself, never the suffix at its own place.
        assert_eq!(propose_ngram(&[5, 5, 5, 5], &config(2, 2, 5), 10), vec![5, 5]);
    }

    #[test]
    fn max_n_caps_the_match_length() {
        // The suffix [1, 2, 3, 4, 5] recurs at index 3. Capped at length 2, the suffix [4, 5] occurs
        // first at index 0, and the earliest occurrence wins.
        let context = [4, 5, 9, 1, 2, 3, 4, 5, 8, 1, 2, 3, 4, 5];
        assert_eq!(propose_ngram(&context, &config(1, 5, 3), 100), vec![8, 1, 2]);
        assert_eq!(propose_ngram(&context, &config(1, 2, 3), 100), vec![9, 1, 2]);
        assert_eq!(propose_ngram(&context, &config(1, 4, 3), 100), vec![8, 1, 2]);
    }

    #[test]
    fn equal_lengths_go_to_the_earliest_occurrence() {
        // [1, 2] occurs at 0 (followed by 7) and at 3 (followed by 8).
        assert_eq!(propose_ngram(&[1, 2, 7, 1, 2, 8, 1, 2], &config(2, 2, 1), 100), vec![7]);
        // Longer beats earlier: [0, 1, 2] only occurs at 3.
        assert_eq!(propose_ngram(&[1, 2, 7, 0, 1, 2, 8, 0, 1, 2], &config(2, 3, 1), 100), vec![8]);
    }

    #[test]
    fn k_and_max_new_cap_the_drafts() {
        let context = [1, 2, 3, 4, 5, 6, 1, 2];
        assert_eq!(propose_ngram(&context, &config(2, 2, 10), 100), vec![3, 4, 5, 6, 1, 2]);
        assert_eq!(propose_ngram(&context, &config(2, 2, 3), 100), vec![3, 4, 5]);
        assert_eq!(propose_ngram(&context, &config(2, 2, 10), 2), vec![3, 4]);
        assert!(propose_ngram(&context, &config(2, 2, 10), 0).is_empty());
        assert_eq!(propose_ngram(&context, &config(2, 2, usize::MAX), usize::MAX), vec![3, 4, 5, 6, 1, 2]);
    }

    #[test]
    fn context_shorter_than_min_n_proposes_nothing() {
        assert!(propose_ngram(&[1, 1], &config(3, 4, 2), 10).is_empty());
        assert!(propose_ngram(&[1, 1, 1], &config(3, 4, 2), 10).is_empty());
        assert_eq!(propose_ngram(&[1, 1, 1, 1], &config(3, 4, 2), 10), vec![1]);
    }

    #[test]
    fn invalid_configs_are_refused_and_propose_nothing() {
        assert_eq!(config(0, 2, 1).validate(), Err(NgramConfigError::MinTooSmall(0)));
        assert_eq!(config(3, 2, 1).validate(), Err(NgramConfigError::MinAboveMax { min_n: 3, max_n: 2 }));
        assert_eq!(config(1, 2, 0).validate(), Err(NgramConfigError::NoDraftTokens(0)));
        assert!(config(5, 5, 3).validate().is_ok());
        let context = [1, 2, 1, 2, 1, 2];
        assert!(propose_ngram(&context, &config(0, 2, 3), 10).is_empty());
        assert!(propose_ngram(&context, &config(3, 2, 3), 10).is_empty());
    }

    #[test]
    fn long_max_n_on_a_short_context() {
        let context = [3, 1, 3, 1, 3];
        assert_eq!(propose_ngram(&context, &config(1, 1000, 5), 10), vec![1, 3]);
    }

    #[test]
    fn agrees_with_brute_force_on_random_contexts() {
        let mut rng = StdRng::seed_from_u64(0x006e_6772_616d);
        for case in 0..2000 {
            let len = rng.random_range(0..40usize);
            let context: Vec<u32> = (0..len).map(|_| rng.random_range(0..4u32)).collect();
            let min_n = rng.random_range(1..=5usize);
            let max_n = rng.random_range(min_n..=8usize);
            let cfg = config(min_n, max_n, rng.random_range(1..=6usize));
            let max_new = rng.random_range(0..=8usize);
            assert_eq!(
                propose_ngram(&context, &cfg, max_new),
                brute_force(&context, &cfg, max_new),
                "case {case}: context {context:?} cfg {cfg:?} max_new {max_new}"
            );
        }
    }

    #[test]
    fn agrees_with_brute_force_on_repetitive_contexts() {
        // Long runs and periodic text stress the max_n cap and the border fallbacks.
        let mut rng = StdRng::seed_from_u64(17);
        for case in 0..1000 {
            let period = rng.random_range(1..=4usize);
            let pattern: Vec<u32> = (0..period).map(|_| rng.random_range(0..3u32)).collect();
            let len = rng.random_range(0..60usize);
            let context: Vec<u32> = (0..len)
                .map(|i| if rng.random_bool(0.1) { rng.random_range(0..3u32) } else { pattern[i % period] })
                .collect();
            let min_n = rng.random_range(1..=3usize);
            let cfg = config(min_n, rng.random_range(min_n..=10usize), rng.random_range(1..=8usize));
            assert_eq!(
                propose_ngram(&context, &cfg, 100),
                brute_force(&context, &cfg, 100),
                "case {case}: context {context:?} cfg {cfg:?}"
            );
        }
    }
}
