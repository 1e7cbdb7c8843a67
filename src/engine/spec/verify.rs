//! Verification of drafts by position-keyed sampling.
//!
//! A verify row for one request is `[x0, d1, .., dn]`: its last committed token followed by `n` drafts.
//! The target forward gives one logits row after each input token. Row `i` is the distribution of the
//! token at output position `first_position + i`, given that drafts `d1..di` were right.
//!
//! The rule: sample position `first_position + i` from row `i` with [`sample_at_position`]; if the
//! token equals draft `i`, accept it and go on, otherwise emit the sampled token and stop. If every
//! draft is accepted, row `n` gives one bonus token. Every emitted token is exactly the token that
//! plain decoding would have sampled at that position from the same logits, so with batch-invariant
//! logits the text is identical with speculation on or off (DESIGN Invariant 3).
//!
//! For a drafter without a distribution of its own (ngram, argmax MTP) this accepts draft `d` with
//! probability `p(d)` and otherwise emits a token distributed as `p` restricted to tokens other than
//! `d`, which is what standard rejection sampling does for a one-hot draft distribution.
//!
//! Stop conditions are the caller's: this function does not know about stop tokens or `max_tokens`.
//! A caller cuts `tokens` after the first stop token or at the token budget, and the positions past
//! the cut are never committed (their recurrent-state snapshots are simply not chosen).

use thiserror::Error;

use crate::backend::sampling::{sample_at_position, SamplingParams};

/// Why a verify row could not be checked. Each is a shape error in what the caller handed over,
/// typically padded rows that were not sliced off (DESIGN Invariant 2).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum VerifyError {
    #[error("a verify row with {drafts} drafts needs {expected} logits rows, got {got}")]
    RowCount { drafts: usize, expected: usize, got: usize },
    #[error("logits row {row} is empty")]
    EmptyRow { row: usize },
    #[error("logits row {row} has {got} entries, row 0 has {expected}")]
    RaggedRows { row: usize, expected: usize, got: usize },
}

/// The result of verifying one request's drafts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyOutcome {
    /// Drafts accepted, `0..=drafts.len()`; always a prefix of the drafts.
    pub accepted: usize,
    /// The accepted drafts followed by one bonus or corrected token: `accepted + 1` tokens.
    pub tokens: Vec<u32>,
}

impl VerifyOutcome {
    /// Drafts that were scored but not accepted.
    pub fn rejected(&self, drafted: usize) -> usize {
        drafted.saturating_sub(self.accepted)
    }
}

/// Verify `drafts` against the target logits of their verify row.
///
/// `row_logits[i]` are the target logits after input token `i` of the row `[x0, d1..dn]`
/// (`n = drafts.len()`, so `row_logits.len() == n + 1`). `first_position` is the output position of
/// the token sampled from `row_logits[0]`. With no drafts this is one ordinary decode step. A draft
/// that is not a token of the vocabulary (a placeholder, say) is simply never accepted.
pub fn verify_drafts(
    row_logits: &[&[f32]],
    drafts: &[u32],
    params: &SamplingParams,
    first_position: u64,
) -> Result<VerifyOutcome, VerifyError> {
    check_row_shape(row_logits, drafts.len())?;
    let mut tokens = Vec::with_capacity(drafts.len() + 1);
    for (offset, (&logits, &draft)) in row_logits.iter().zip(drafts).enumerate() {
        let sampled = sample_at_position(logits, params, first_position + offset as u64);
        tokens.push(sampled);
        if sampled != draft {
            return Ok(VerifyOutcome { accepted: offset, tokens });
        }
    }
    let bonus_row = row_logits[drafts.len()];
    tokens.push(sample_at_position(bonus_row, params, first_position + drafts.len() as u64));
    Ok(VerifyOutcome { accepted: drafts.len(), tokens })
}

/// Verify `drafts` against tokens already sampled at every position of their verify row
/// (`sampled[i]` drawn from logits row `i`, as [`crate::backend::Backend::sample_rows`] does on
/// the device). The same rule as [`verify_drafts`]: accept the longest prefix of drafts equal to
/// the sampled tokens, then emit the sampled token after it.
pub fn accept_drafts(sampled: &[u32], drafts: &[u32]) -> Result<VerifyOutcome, VerifyError> {
    if sampled.len() != drafts.len() + 1 {
        return Err(VerifyError::RowCount { drafts: drafts.len(), expected: drafts.len() + 1, got: sampled.len() });
    }
    let accepted = drafts.iter().zip(sampled).take_while(|(d, s)| d == s).count();
    Ok(VerifyOutcome { accepted, tokens: sampled[..=accepted].to_vec() })
}

fn check_row_shape(row_logits: &[&[f32]], drafts: usize) -> Result<(), VerifyError> {
    let expected = drafts + 1;
    if row_logits.len() != expected {
        return Err(VerifyError::RowCount { drafts, expected, got: row_logits.len() });
    }
    let vocab = row_logits[0].len();
    for (row, logits) in row_logits.iter().enumerate() {
        if logits.is_empty() {
            return Err(VerifyError::EmptyRow { row });
        }
        if logits.len() != vocab {
            return Err(VerifyError::RaggedRows { row, expected: vocab, got: logits.len() });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const VOCAB: usize = 16;

    /// A stand-in target model: logits are a fixed pseudo-random function of the whole context,
    /// peaked enough that sampling often repeats and drafts are sometimes right.
    fn toy_logits(context: &[u32]) -> Vec<f32> {
        let mut state = 0x1234_5678_9abc_def0u64;
        for &token in context {
            state = (state ^ u64::from(token)).wrapping_mul(0x0100_0000_01b3).rotate_left(17);
        }
        (0..VOCAB as u64)
            .map(|token| {
                let h = (state ^ token.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                let bonus = if token == u64::from(*context.last().unwrap_or(&0)) { 2.0 } else { 0.0 };
                ((h >> 40) as f32 / (1u64 << 24) as f32) * 4.0 + bonus
            })
            .collect()
    }

    /// Plain decoding: one position at a time.
    fn plain_decode(prompt: &[u32], params: &SamplingParams, count: usize) -> Vec<u32> {
        let mut context = prompt.to_vec();
        for position in 0..count as u64 {
            let token = sample_at_position(&toy_logits(&context), params, position);
            context.push(token);
        }
        context[prompt.len()..].to_vec()
    }

    /// The logits rows of a verify row `[last committed, drafts..]`.
    fn verify_rows(context: &[u32], drafts: &[u32]) -> Vec<Vec<f32>> {
        let mut extended = context.to_vec();
        let mut rows = vec![toy_logits(&extended)];
        for &draft in drafts {
            extended.push(draft);
            rows.push(toy_logits(&extended));
        }
        rows
    }

    fn verify(context: &[u32], drafts: &[u32], params: &SamplingParams, position: u64) -> VerifyOutcome {
        let rows = verify_rows(context, drafts);
        let row_refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        verify_drafts(&row_refs, drafts, params, position).expect("well-shaped verify row")
    }

    fn sampling_cases() -> Vec<SamplingParams> {
        vec![
            SamplingParams::greedy(),
            SamplingParams { temperature: 1.0, seed: 7, ..SamplingParams::greedy() },
            SamplingParams { temperature: 0.8, top_k: 5, top_p: 0.9, seed: 99, ..SamplingParams::greedy() },
        ]
    }

    #[test]
    fn oracle_drafts_are_all_accepted() {
        let prompt = [3, 1, 4, 1, 5];
        for params in sampling_cases() {
            let reference = plain_decode(&prompt, &params, 9);
            let outcome = verify(&prompt, &reference[..8], &params, 0);
            assert_eq!(outcome.accepted, 8);
            assert_eq!(outcome.tokens, reference);
        }
    }

    #[test]
    fn wrong_drafts_are_all_rejected_and_the_plain_token_is_emitted() {
        let prompt = [2, 7, 1, 8];
        for params in sampling_cases() {
            let reference = plain_decode(&prompt, &params, 1);
            let wrong = [(reference[0] + 1) % VOCAB as u32, 0, 0, 0];
            let outcome = verify(&prompt, &wrong, &params, 0);
            assert_eq!(outcome.accepted, 0);
            assert_eq!(outcome.tokens, reference);
            assert_eq!(outcome.rejected(wrong.len()), 4);
        }
    }

    #[test]
    fn a_planted_prefix_of_length_j_accepts_exactly_j() {
        let prompt = [9, 9, 2, 6];
        let n = 6;
        for params in sampling_cases() {
            let reference = plain_decode(&prompt, &params, n + 1);
            for j in 0..=n {
                let mut drafts = reference[..n].to_vec();
                if j < n {
                    drafts[j] = (drafts[j] + 1) % VOCAB as u32;
                }
                let outcome = verify(&prompt, &drafts, &params, 0);
                assert_eq!(outcome.accepted, j, "params {params:?}");
                assert_eq!(outcome.tokens, reference[..=j].to_vec());
            }
        }
    }

    #[test]
    fn zero_drafts_is_one_plain_decode_step() {
        let prompt = [5, 3];
        for params in sampling_cases() {
            for position in [0u64, 1, 17, 1000] {
                let logits = toy_logits(&prompt);
                let outcome = verify_drafts(&[&logits], &[], &params, position).expect("one row for zero drafts");
                assert_eq!(outcome.accepted, 0);
                assert_eq!(outcome.tokens, vec![sample_at_position(&logits, &params, position)]);
            }
        }
    }

    #[test]
    fn speculative_generation_equals_plain_generation() {
        // Random drafts of random length (0..=k), mixed with correct prefixes, over a long generation:
        // the emitted sequence must equal plain position-keyed sampling token for token.
        let prompt = [1, 2, 3, 1, 2];
        let total = 200;
        for params in sampling_cases() {
            let reference = plain_decode(&prompt, &params, total);
            let mut rng = StdRng::seed_from_u64(params.seed ^ 0xfeed);
            let mut context = prompt.to_vec();
            let mut generated: Vec<u32> = Vec::new();
            let mut accepted_total = 0;
            while generated.len() < total {
                let k = rng.random_range(0..=5usize);
                let correct_prefix = rng.random_range(0..=k);
                let drafts: Vec<u32> = (0..k)
                    .map(|i| match reference.get(generated.len() + i) {
                        Some(&right) if i < correct_prefix => right,
                        _ => rng.random_range(0..VOCAB as u32),
                    })
                    .collect();
                let outcome = verify(&context, &drafts, &params, generated.len() as u64);
                accepted_total += outcome.accepted;
                context.extend_from_slice(&outcome.tokens);
                generated.extend_from_slice(&outcome.tokens);
            }
            generated.truncate(total);
            assert_eq!(generated, reference, "params {params:?}");
            assert!(accepted_total > 0, "the test should exercise accepted drafts");
        }
    }

    #[test]
    fn seeded_sampling_with_filters_matches_plain_sampling() {
        let params = SamplingParams { temperature: 0.8, top_k: 6, top_p: 0.85, seed: 2024, ..SamplingParams::greedy() };
        let prompt = [4, 4, 4];
        let reference = plain_decode(&prompt, &params, 60);
        // Draft with an oracle for whole chunks at varying offsets: every chunk must reproduce the reference.
        let mut context = prompt.to_vec();
        let mut produced = Vec::new();
        for chunk in [3usize, 0, 5, 1, 7, 2, 4] {
            let start = produced.len();
            let drafts = reference[start..start + chunk].to_vec();
            let outcome = verify(&context, &drafts, &params, start as u64);
            assert_eq!(outcome.accepted, chunk);
            context.extend_from_slice(&outcome.tokens);
            produced.extend_from_slice(&outcome.tokens);
        }
        assert_eq!(produced, reference[..produced.len()].to_vec());
    }

    #[test]
    fn acceptance_rate_follows_target_probability() {
        // A fixed draft d at a fixed context is accepted with probability p(d) over many seeds.
        let logits = [0.0f32, 1.0, 2.0, 0.5];
        let params_for = |seed| SamplingParams { temperature: 1.0, seed, ..SamplingParams::greedy() };
        let weights: Vec<f64> = logits.iter().map(|&l| f64::from(l).exp()).collect();
        let p_draft = weights[1] / weights.iter().sum::<f64>();
        let trials = 20_000u64;
        let accepted = (0..trials)
            .filter(|&seed| {
                let outcome = verify_drafts(&[&logits, &logits], &[1], &params_for(seed), 3).expect("shape");
                outcome.accepted == 1
            })
            .count();
        let rate = accepted as f64 / trials as f64;
        assert!((rate - p_draft).abs() < 0.01, "accept rate {rate}, p(d) {p_draft}");
    }

    #[test]
    fn malformed_rows_are_refused() {
        let row = [0.0f32, 1.0];
        let short = [0.0f32];
        let params = SamplingParams::greedy();
        assert_eq!(
            verify_drafts(&[&row], &[1, 0], &params, 0),
            Err(VerifyError::RowCount { drafts: 2, expected: 3, got: 1 })
        );
        assert_eq!(
            verify_drafts(&[&row, &row, &row], &[1], &params, 0),
            Err(VerifyError::RowCount { drafts: 1, expected: 2, got: 3 })
        );
        assert_eq!(verify_drafts(&[&row, &[]], &[1], &params, 0), Err(VerifyError::EmptyRow { row: 1 }));
        assert_eq!(
            verify_drafts(&[&row, &short], &[1], &params, 0),
            Err(VerifyError::RaggedRows { row: 1, expected: 2, got: 1 })
        );
    }

    /// The engine samples every position of a verify row first (on the device) and then calls
    /// `accept_drafts`: the outcome must be the one `verify_drafts` gives from the logits.
    #[test]
    fn accepting_pre_sampled_tokens_equals_verifying_logits() {
        let mut rng = StdRng::seed_from_u64(11);
        for params in sampling_cases() {
            for trial in 0..200u64 {
                let context: Vec<u32> = (0..1 + trial % 5).map(|_| rng.random_range(0..VOCAB as u32)).collect();
                let reference = plain_decode(&context, &params, 6);
                // Drafts: a random-length prefix of the plain continuation, then random tokens.
                let n = rng.random_range(0..6usize);
                let right = rng.random_range(0..=n);
                let drafts: Vec<u32> = (0..n).map(|i| if i < right { reference[i] } else { rng.random_range(0..VOCAB as u32) }).collect();
                let rows = verify_rows(&context, &drafts);
                let sampled: Vec<u32> = rows.iter().enumerate().map(|(i, r)| sample_at_position(r, &params, i as u64)).collect();
                assert_eq!(accept_drafts(&sampled, &drafts).unwrap(), verify(&context, &drafts, &params, 0));
            }
        }
        assert_eq!(accept_drafts(&[1, 2], &[1, 2, 3]), Err(VerifyError::RowCount { drafts: 3, expected: 4, got: 2 }));
    }
}
