//! Seeded, position-keyed sampling (DESIGN Invariant 3).
//!
//! The token chosen at output position `p` of a request depends only on the logits of that position,
//! the sampling parameters and `(seed, p)`. There is no generator state that advances as tokens are
//! drawn, so a verify step that samples positions `p..p+n` in one go picks exactly the tokens that
//! `n + 1` ordinary decode steps would pick. That is what lets speculation change speed but never text.
//!
//! # The draw
//!
//! Greedy (`temperature == 0`): the argmax of the logits, ties to the lowest token id.
//!
//! Otherwise, with `s_i = logit_i / T` computed in f64:
//! 1. top-k (when `top_k > 0`): keep the `top_k` largest logits, ties to the lower token id;
//! 2. top-p (when `top_p < 1`): over the kept tokens, with probabilities `softmax(s)` renormalised to the
//!    kept set, sort by probability (descending, ties to the lower id) and keep the shortest prefix
//!    whose cumulative probability reaches `top_p`, always at least one token;
//! 3. Gumbel-max: return the kept token `i` maximising `s_i + G(seed, p, i)`, ties to the lower id.
//!    Since `G` is standard Gumbel noise, token `i` wins with probability `softmax(s)_i` over the kept
//!    set, which is the ordinary filtered softmax distribution.
//!
//! NaN logits count as negative infinity everywhere, so they are never preferred over a real logit.
//! The shortcuts below (a heap for small top-k, dropping tokens too light to reach the nucleus,
//! skipping the noise of tokens that cannot win) only save work; a test checks them against the
//! definition written plainly.
//!
//! # The noise, exactly (so that a GPU kernel can reproduce it)
//!
//! All integer arithmetic is on u64 and wraps.
//!
//! ```text
//! mix(z)   = z ^= z >> 30; z *= 0xbf58476d1ce4e5b9; z ^= z >> 27; z *= 0x94d049bb133111eb; z ^ (z >> 31)
//! step(x)  = mix(x + 0x9e3779b97f4a7c15)                  (one SplitMix64 output for state x)
//! h        = step(step(step(seed) ^ position) ^ token_id)
//! u        = ((h >> 12) as f64 + 0.5) * 2^-52             (exact in f64, strictly inside (0, 1))
//! G        = -ln(-ln(u))                                   (f64 natural logarithm)
//! ```
//!
//! The integer part and `u` are bit-exact on any IEEE machine. The logarithms are the platform's f64
//! `ln`, which libraries may round differently in the last bit; that can only matter where two scores
//! agree to about 1e-16, and both the speculative and the plain path of one engine use this same code.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use thiserror::Error;

/// Why a set of sampling parameters was refused.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    InvalidTemperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    InvalidTopP(f32),
}

/// Per-request sampling parameters. Missing fields in a serialized form take the defaults (greedy).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 selects greedy decoding.
    pub temperature: f32,
    /// 0 turns top-k filtering off.
    pub top_k: usize,
    /// 1.0 turns nucleus filtering off.
    pub top_p: f32,
    /// Key of the position-keyed noise; requests with the same seed and logits draw the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }
    }

    /// True when the draw is a plain argmax. Anything that is not a positive temperature counts,
    /// so that unvalidated parameters still sample something well defined.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }

    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::InvalidTemperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::InvalidTopP(self.top_p));
        }
        Ok(())
    }

    /// True when a sampled (non-greedy) draw filters the vocabulary with top-k or top-p.
    pub fn filters(&self, vocab: usize) -> bool {
        self.top_k_active(vocab) || self.top_p_active()
    }

    fn top_k_active(&self, vocab: usize) -> bool {
        self.top_k > 0 && self.top_k < vocab
    }

    fn top_p_active(&self) -> bool {
        // NaN and values >= 1 leave the distribution unfiltered; validate() refuses them earlier.
        self.top_p < 1.0
    }
}

const SPLITMIX_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

fn splitmix64_mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn splitmix64_step(state: u64) -> u64 {
    splitmix64_mix(state.wrapping_add(SPLITMIX_GAMMA))
}

/// The part of the noise key shared by every token of one position, computed once per draw
/// (`noise_hash(seed, position, token) = step(position_key(seed, position) ^ token)`).
pub fn position_key(seed: u64, position: u64) -> u64 {
    splitmix64_step(splitmix64_step(seed) ^ position)
}

/// The 64-bit key of the noise for one (seed, position, token). See the module docs for the formula.
pub fn noise_hash(seed: u64, position: u64, token_id: u32) -> u64 {
    splitmix64_step(position_key(seed, position) ^ u64::from(token_id))
}

fn uniform_from_hash(hash: u64) -> f64 {
    const TWO_POW_MINUS_52: f64 = 1.0 / 4_503_599_627_370_496.0;
    ((hash >> 12) as f64 + 0.5) * TWO_POW_MINUS_52
}

fn gumbel_from_uniform(u: f64) -> f64 {
    -(-u.ln()).ln()
}

/// The uniform draw in (0, 1) for one (seed, position, token); exact in f64.
pub fn uniform_at(seed: u64, position: u64, token_id: u32) -> f64 {
    uniform_from_hash(noise_hash(seed, position, token_id))
}

/// Standard Gumbel noise for one (seed, position, token).
pub fn gumbel_at(seed: u64, position: u64, token_id: u32) -> f64 {
    gumbel_from_uniform(uniform_at(seed, position, token_id))
}

/// A logit as used for ranking: NaN is treated as negative infinity.
fn rank_value(logit: f32) -> f32 {
    if logit.is_nan() {
        f32::NEG_INFINITY
    } else {
        logit
    }
}

/// `logit / T` in f64, where f32 logits cannot overflow. Masked (-inf) and NaN logits stay -inf even
/// at an infinite temperature, so they are never sampled.
fn scaled_logit(logit: f32, inverse_temperature: f64) -> f64 {
    let value = rank_value(logit);
    if value == f32::NEG_INFINITY {
        f64::NEG_INFINITY
    } else {
        f64::from(value) * inverse_temperature
    }
}

/// A candidate token with its ranking value (the logit, NaN as -inf), kept together so that selection
/// and sorting compare local data instead of indexing into the logits.
///
/// Candidates order *best first*: a larger value is smaller in this order, equal values go to the
/// lower id. So an ascending sort lists the best first, and a max-heap keeps the worst on top.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    value: f32,
    token: u32,
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        // Values are never NaN, so partial_cmp always answers; -0.0 and 0.0 compare equal.
        other.value.partial_cmp(&self.value).unwrap_or(Ordering::Equal).then(self.token.cmp(&other.token))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

/// Argmax with ties to the lowest index; NaN never wins over a number.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best_index = 0usize;
    let mut best_value = f32::NEG_INFINITY;
    for (index, &logit) in logits.iter().enumerate() {
        let value = rank_value(logit);
        if value > best_value {
            best_value = value;
            best_index = index;
        }
    }
    best_index as u32
}

/// The token sampled for output position `position` (0 = first generated token) of a request.
///
/// A pure function of `(logits, params, position)`: no state, no threads, the same answer every time.
/// Parameters should have passed [`SamplingParams::validate`]; unvalidated ones still give a defined
/// answer (non-positive temperature is greedy, a top_p outside (0, 1) keeps one token or all).
///
/// # Panics
/// If `logits` is empty: a vocabulary always has at least one token.
pub fn sample_at_position(logits: &[f32], params: &SamplingParams, position: u64) -> u32 {
    assert!(!logits.is_empty(), "sample_at_position needs at least one logit");
    if params.is_greedy() {
        return argmax(logits);
    }
    let noise = NoiseRace {
        key: position_key(params.seed, position),
        inverse_temperature: 1.0 / f64::from(params.temperature),
    };
    if !params.filters(logits.len()) {
        return noise.winner(logits, argmax(logits), 0..logits.len() as u32);
    }
    let kept = kept_tokens(logits, params, noise.inverse_temperature);
    // `kept` is best first and holds at least one token.
    let best_ranked = kept.first().map_or(0, |candidate| candidate.token);
    noise.winner(logits, best_ranked, kept.iter().map(|candidate| candidate.token))
}

/// Gaps at which a trailing token may skip its logarithms; see [`NoiseRace::winner`].
const NOISE_SKIP_GAPS: [f64; 5] = [32.0, 16.0, 8.0, 4.0, 2.0];

/// Gumbel-max for one position: the candidate maximising `logit / T + G`, ties to the lower id.
struct NoiseRace {
    key: u64,
    inverse_temperature: f64,
}

impl NoiseRace {
    /// `best_ranked`, the candidate with the largest logit, is scored first so that the running best
    /// is high from the start. A later token whose scaled logit trails the best score by more than
    /// `gap`, with a uniform draw below `exp(-exp(-(gap - 0.5)))`, has `G < gap - 0.5` and cannot reach
    /// the best score (rounding of `scaled + G` is monotone), so its two logarithms are skipped. The
    /// winner is exactly the one that scoring every token gives; the skip only saves time.
    fn winner(&self, logits: &[f32], best_ranked: u32, candidates: impl Iterator<Item = u32>) -> u32 {
        let skip_tiers = NOISE_SKIP_GAPS.map(|gap| (gap, (-(-(gap - 0.5)).exp()).exp()));
        let best_scaled = scaled_logit(logits[best_ranked as usize], self.inverse_temperature);
        if best_scaled == f64::NEG_INFINITY {
            // Every candidate is masked; the best ranked is the lowest id among them.
            return best_ranked;
        }
        let mut best_score = best_scaled + gumbel_from_uniform(self.uniform(best_ranked));
        let mut best_token = best_ranked;
        for token in candidates {
            let scaled = scaled_logit(logits[token as usize], self.inverse_temperature);
            if scaled == f64::NEG_INFINITY {
                continue;
            }
            let u = self.uniform(token);
            if skip_tiers.iter().any(|&(gap, bound)| scaled + gap < best_score && u < bound) {
                continue;
            }
            let score = scaled + gumbel_from_uniform(u);
            if score > best_score || (score == best_score && token < best_token) {
                best_score = score;
                best_token = token;
            }
        }
        best_token
    }

    fn uniform(&self, token: u32) -> f64 {
        uniform_from_hash(splitmix64_step(self.key ^ u64::from(token)))
    }
}

/// The candidates surviving top-k then top-p, best first.
fn kept_tokens(logits: &[f32], params: &SamplingParams, inverse_temperature: f64) -> Vec<Candidate> {
    let mut candidates = if params.top_k_active(logits.len()) {
        top_k_candidates(logits, params.top_k)
    } else {
        all_candidates(logits).collect()
    };
    if params.top_p_active() {
        truncate_to_nucleus(&mut candidates, params.top_p, inverse_temperature);
    }
    candidates
}

fn all_candidates(logits: &[f32]) -> impl Iterator<Item = Candidate> + '_ {
    logits.iter().enumerate().map(|(token, &logit)| Candidate { value: rank_value(logit), token: token as u32 })
}

/// The `k` best candidates, best first; `0 < k < logits.len()`.
fn top_k_candidates(logits: &[f32], k: usize) -> Vec<Candidate> {
    if k.saturating_mul(8) > logits.len() {
        let mut candidates: Vec<Candidate> = all_candidates(logits).collect();
        candidates.select_nth_unstable(k - 1);
        candidates.truncate(k);
        candidates.sort_unstable();
        return candidates;
    }
    // A heap of the best k so far with the worst on top: most tokens lose a single comparison against
    // it, so a small k costs one cheap pass over the vocabulary.
    let mut heap: BinaryHeap<Candidate> = BinaryHeap::with_capacity(k);
    for candidate in all_candidates(logits) {
        if heap.len() < k {
            heap.push(candidate);
        } else if let Some(mut worst) = heap.peek_mut() {
            if candidate < *worst {
                *worst = candidate;
            }
        }
    }
    let mut candidates = heap.into_vec();
    candidates.sort_unstable();
    candidates
}

/// Cuts `candidates` to the nucleus, sorted best first.
///
/// The probabilities are renormalised over `candidates` (the top-k survivors). Rather than sorting the
/// whole vocabulary, the best `m` candidates are selected and sorted for growing `m` until their
/// cumulative probability reaches `top_p`; peaked distributions finish in the first round.
fn truncate_to_nucleus(candidates: &mut Vec<Candidate>, top_p: f32, inverse_temperature: f64) {
    let max_scaled =
        candidates.iter().map(|c| scaled_logit(c.value, inverse_temperature)).fold(f64::NEG_INFINITY, f64::max);
    if max_scaled == f64::NEG_INFINITY {
        // Every candidate is masked: there is no distribution to cut, keep the lowest id.
        candidates.sort_unstable();
        candidates.truncate(1);
        return;
    }
    let weight = |candidate: &Candidate| {
        let scaled = scaled_logit(candidate.value, inverse_temperature);
        // Compared first so that a +inf maximum gives its tokens weight 1 rather than exp(NaN).
        if scaled == max_scaled {
            1.0
        } else {
            (scaled - max_scaled).exp()
        }
    };
    let normaliser: f64 = candidates.iter().map(weight).sum();
    let top_p = f64::from(top_p).max(0.0);
    let target = top_p * normaliser;

    // Tokens lighter than (1 - top_p) * Z / (2n) together weigh under half of (1 - top_p) * Z, so the
    // heavier tokens alone pass the target and the nucleus never reaches the light ones. Dropping them
    // first (by scaled logit, without a second exponential) changes nothing but the work left.
    let light_weight = 0.5 * (1.0 - top_p) * normaliser / candidates.len() as f64;
    let light_scaled = max_scaled + light_weight.ln();
    candidates.retain(|c| scaled_logit(c.value, inverse_temperature) >= light_scaled);

    let total = candidates.len();
    let mut prefix = total.min(64);
    loop {
        if prefix < total {
            candidates.select_nth_unstable(prefix - 1);
        }
        candidates[..prefix].sort_unstable();
        let mut cumulative = 0.0;
        for (index, candidate) in candidates[..prefix].iter().enumerate() {
            cumulative += weight(candidate);
            if cumulative >= target {
                candidates.truncate(index + 1);
                return;
            }
        }
        if prefix == total {
            // Rounding kept the sum just below the target: everything left stays.
            return;
        }
        prefix = total.min(prefix.saturating_mul(8));
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn seeded(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, seed }
    }

    fn softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
        let max = logits.iter().map(|&l| f64::from(l) / temperature).fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = logits.iter().map(|&l| (f64::from(l) / temperature - max).exp()).collect();
        let sum: f64 = weights.iter().sum();
        weights.iter().map(|w| w / sum).collect()
    }

    fn drawn(logits: &[f32], params: &SamplingParams, draws: u64) -> BTreeSet<u32> {
        (0..draws).map(|position| sample_at_position(logits, params, position)).collect()
    }

    fn frequencies(logits: &[f32], params: &SamplingParams, draws: u64) -> Vec<f64> {
        let mut counts = vec![0u64; logits.len()];
        for position in 0..draws {
            counts[sample_at_position(logits, params, position) as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    #[test]
    fn greedy_ties_go_to_the_lowest_index() {
        let logits = [0.5, 2.0, -1.0, 2.0, 2.0];
        assert_eq!(sample_at_position(&logits, &SamplingParams::greedy(), 0), 1);
        assert_eq!(argmax(&[f32::NAN, -3.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        // Seed and position play no part in a greedy draw.
        assert!((0..50).all(|p| sample_at_position(&[0.1, 0.3, 0.2], &seeded(0.0, 0, 1.0, p * 7), p) == 1));
    }

    #[test]
    fn draws_are_fixed_per_position_and_vary_across_positions_and_seeds() {
        let logits = [0.0f32; 8];
        let draw_all = |seed| -> Vec<u32> {
            (0..400).map(|p| sample_at_position(&logits, &seeded(1.0, 0, 1.0, seed), p)).collect()
        };
        let tokens_seed_1 = draw_all(1);
        let tokens_seed_2 = draw_all(2);
        assert_eq!(draw_all(1), tokens_seed_1, "the same seed and positions must repeat exactly");
        for token in 0..8u32 {
            assert!(tokens_seed_1.contains(&token), "token {token} never drawn over 400 positions");
        }
        let changes = tokens_seed_1.windows(2).filter(|w| w[0] != w[1]).count();
        assert!(changes > 300, "consecutive positions too often agree: {changes} changes");
        let agreements = tokens_seed_1.iter().zip(&tokens_seed_2).filter(|(a, b)| a == b).count();
        assert!(agreements < 100, "two seeds agree at {agreements} of 400 positions");
    }

    #[test]
    fn noise_is_pinned_and_inside_the_open_interval() {
        // Pins the documented formula so that another implementation can be checked against it.
        assert_eq!(splitmix64_step(0), 0xe220_a839_7b1d_cdaf);
        assert_eq!(noise_hash(7, 3, 11), splitmix64_step(splitmix64_step(splitmix64_step(7) ^ 3) ^ 11));
        assert!((0..1000).all(|p| (0.0..1.0).contains(&uniform_at(9, p, p as u32)) && gumbel_at(9, p, 5).is_finite()));
        // The extremes of the 52-bit draw stay strictly inside (0, 1).
        assert!(uniform_from_hash(0) > 0.0 && uniform_from_hash(u64::MAX) < 1.0);
    }

    fn assert_frequencies_near(observed: &[f64], expected: &[f64], tolerance: f64) {
        let max_diff = observed.iter().zip(expected).map(|(o, e)| (o - e).abs()).fold(0.0, f64::max);
        assert!(max_diff < tolerance, "observed {observed:?} expected {expected:?}");
    }

    #[test]
    fn temperature_one_matches_softmax() {
        let logits = [1.0f32, 0.2, -0.5, 2.0, 0.0];
        let expected = softmax(&logits, 1.0);
        for seed in [0u64, 12345] {
            let observed = frequencies(&logits, &seeded(1.0, 0, 1.0, seed), 20_000);
            assert_frequencies_near(&observed, &expected, 0.01);
            // Chi-square with 4 degrees of freedom; 18.5 is the 0.999 quantile.
            let chi_square: f64 = observed.iter().zip(&expected).map(|(o, e)| 20_000.0 * (o - e).powi(2) / e).sum();
            assert!(chi_square < 18.5, "seed {seed}: chi-square {chi_square}");
        }
    }

    #[test]
    fn low_temperature_sharpens_and_top_k_renormalises() {
        let logits = [1.0f32, 0.2, -0.5, 2.0, 0.0];
        assert_frequencies_near(&frequencies(&logits, &seeded(0.5, 0, 1.0, 3), 20_000), &softmax(&logits, 0.5), 0.01);
        // top_k = 2 keeps tokens 3 and 0 with probabilities renormalised between them.
        let p3 = 1.0 / (1.0 + (-1.0f64).exp());
        let expected = [1.0 - p3, 0.0, 0.0, p3, 0.0];
        assert_frequencies_near(&frequencies(&logits, &seeded(1.0, 2, 1.0, 4), 20_000), &expected, 0.01);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_equal_greedy() {
        // Many tied maxima: the lowest index must win on every path.
        let logits: Vec<f32> = (0..300).map(|i| ((i * 29) % 13) as f32 * 0.1).collect();
        let greedy = argmax(&logits);
        for position in 0..300 {
            assert_eq!(sample_at_position(&logits, &seeded(1.5, 1, 1.0, 8), position), greedy);
            assert_eq!(sample_at_position(&logits, &seeded(2.0, 0, 1e-6, 8), position), greedy);
        }
    }

    #[test]
    fn filters_never_sample_outside_the_kept_set() {
        // Probabilities at T=1 are roughly 0.64, 0.24, 0.09, 0.03 and 0.01 for ids 4, 3, 2, 1, 0.
        let logits = [-2.0f32, -1.0, 0.0, 1.0, 2.0];
        assert_eq!(drawn(&logits, &seeded(1.0, 3, 1.0, 5), 3000), BTreeSet::from([2, 3, 4]));
        // Cumulative 0.64, 0.88, 0.97: top_p = 0.8 keeps ids 4 and 3 only.
        assert_eq!(drawn(&logits, &seeded(1.0, 0, 0.8, 6), 3000), BTreeSet::from([3, 4]));
        // top_k = 4 then top_p = 0.95 over the renormalised four: cumulative 0.64, 0.88, 0.97.
        assert_eq!(drawn(&logits, &seeded(1.0, 4, 0.95, 7), 3000), BTreeSet::from([2, 3, 4]));
    }

    #[test]
    fn top_p_on_a_large_flat_vocabulary_grows_past_the_first_round() {
        // 1000 equal logits: top_p = 0.5 keeps the 500 lowest ids, so the selection must widen.
        let logits = vec![0.0f32; 1000];
        let tokens = drawn(&logits, &seeded(1.0, 0, 0.5, 11), 4000);
        assert!(tokens.iter().all(|&t| t < 500) && tokens.iter().any(|&t| t >= 400));
    }

    #[test]
    fn masked_tokens_are_never_sampled() {
        let logits = [f32::NEG_INFINITY, 0.0, f32::NAN, 0.0];
        assert_eq!(drawn(&logits, &seeded(1.0, 0, 0.9, 1), 500), BTreeSet::from([1, 3]));
        let all_masked = [f32::NEG_INFINITY; 3];
        assert_eq!(sample_at_position(&all_masked, &seeded(1.0, 0, 1.0, 1), 0), 0);
        assert_eq!(sample_at_position(&all_masked, &seeded(1.0, 2, 0.5, 1), 0), 0);
    }

    #[test]
    fn extreme_temperatures_and_logits_stay_defined() {
        let logits = [1.0f32, 3.0, 2.0];
        // A tiny temperature behaves like greedy without overflowing; a huge one is close to uniform.
        assert_eq!(drawn(&logits, &seeded(1e-30, 0, 1.0, 2), 100), BTreeSet::from([1]));
        let flat = frequencies(&logits, &seeded(1e6, 0, 1.0, 2), 9000);
        assert!(flat.iter().all(|&f| (f - 1.0 / 3.0).abs() < 0.03), "{flat:?}");
        // Unvalidated infinite temperature: uniform over unmasked tokens, masked ones still excluded.
        assert_eq!(
            drawn(&[f32::NEG_INFINITY, 1.0, 5.0], &seeded(f32::INFINITY, 0, 0.9, 2), 200),
            BTreeSet::from([1, 2])
        );
        // +inf logits take all the mass (their scores tie at +inf, so the lowest id wins), nucleus or not.
        let infinite = [1.0f32, f32::INFINITY, 3.0, f32::INFINITY];
        assert_eq!(drawn(&infinite, &seeded(1.0, 0, 0.7, 2), 200), BTreeSet::from([1]));
        assert_eq!(drawn(&infinite, &seeded(1.0, 0, 1.0, 2), 200), BTreeSet::from([1]));
    }

    /// The definition written plainly: sort everything, cut, then score every kept token.
    fn naive_sample(logits: &[f32], params: &SamplingParams, position: u64) -> u32 {
        let inverse_temperature = 1.0 / f64::from(params.temperature);
        let scaled = |token: u32| scaled_logit(logits[token as usize], inverse_temperature);
        let mut kept: Vec<u32> = (0..logits.len() as u32).collect();
        kept.sort_by(|&a, &b| scaled(b).partial_cmp(&scaled(a)).unwrap_or(Ordering::Equal).then(a.cmp(&b)));
        if params.top_k > 0 {
            kept.truncate(params.top_k);
        }
        if params.top_p < 1.0 && scaled(kept[0]) > f64::NEG_INFINITY {
            let weights: Vec<f64> = kept.iter().map(|&t| (scaled(t) - scaled(kept[0])).exp()).collect();
            let target = f64::from(params.top_p) * weights.iter().sum::<f64>();
            let mut cumulative = 0.0;
            let cut = weights.iter().position(|w| {
                cumulative += w;
                cumulative >= target
            });
            kept.truncate(cut.map_or(kept.len(), |index| index + 1));
        }
        let score = |token: u32| match scaled(token) {
            f64::NEG_INFINITY => f64::NEG_INFINITY,
            value => value + gumbel_at(params.seed, position, token),
        };
        let mut best = kept[0];
        for &token in &kept[1..] {
            if score(token) > score(best) || (score(token) == score(best) && token < best) {
                best = token;
            }
        }
        best
    }

    #[test]
    fn fast_paths_match_the_plain_definition() {
        // Covers the skipped logarithms, the heap top-k, the light-token drop and the widening nucleus.
        let mut state = 1u64;
        let mut next = || {
            state = splitmix64_step(state);
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        for case in 0..640u64 {
            let vocab = 1 + (next() * 600.0) as usize;
            let spread = [0.1, 3.0, 30.0, 300.0][case as usize % 4];
            let mut logits: Vec<f32> = (0..vocab).map(|_| ((next() - 0.5) * spread) as f32).collect();
            if case % 7 == 0 {
                logits[0] = f32::NEG_INFINITY;
                logits[vocab / 2] = f32::NAN;
            }
            let temperature = [0.05, 0.7, 1.0, 3.0][(case as usize / 4) % 4];
            let top_k = [0, 1, 5, 50, 400][(case as usize / 16) % 5];
            let top_p = [1.0, 0.9, 0.5, 0.999][(case as usize / 80) % 4];
            let params = seeded(temperature, top_k, top_p, case);
            for position in 0..20 {
                assert_eq!(
                    sample_at_position(&logits, &params, position),
                    naive_sample(&logits, &params, position),
                    "case {case} position {position} params {params:?}"
                );
            }
        }
    }

    #[test]
    fn validate_refuses_bad_parameters() {
        assert!(SamplingParams::default().validate().is_ok());
        assert!(seeded(0.7, 40, 0.95, 1).validate().is_ok());
        assert_eq!(seeded(-0.1, 0, 1.0, 0).validate(), Err(SamplingError::InvalidTemperature(-0.1)));
        assert!(matches!(seeded(f32::NAN, 0, 1.0, 0).validate(), Err(SamplingError::InvalidTemperature(_))));
        assert!(matches!(seeded(f32::INFINITY, 0, 1.0, 0).validate(), Err(SamplingError::InvalidTemperature(_))));
        assert_eq!(seeded(1.0, 0, 0.0, 0).validate(), Err(SamplingError::InvalidTopP(0.0)));
        assert_eq!(seeded(1.0, 0, 1.5, 0).validate(), Err(SamplingError::InvalidTopP(1.5)));
        assert!(matches!(seeded(1.0, 0, f32::NAN, 0).validate(), Err(SamplingError::InvalidTopP(_))));
    }

    #[test]
    fn defaults_and_serde() {
        assert!(SamplingParams::default().is_greedy() && SamplingParams::default() == SamplingParams::greedy());
        let parsed: SamplingParams = serde_json::from_str(r#"{"temperature": 0.8, "seed": 3}"#).expect("valid json");
        assert_eq!(parsed, seeded(0.8, 0, 1.0, 3));
        let json = serde_json::to_string(&parsed).expect("serializable");
        assert_eq!(serde_json::from_str::<SamplingParams>(&json).expect("round trip"), parsed);
    }
}
