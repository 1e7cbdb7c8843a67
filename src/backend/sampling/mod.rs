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
//! 3. min-p (when `min_p > 0`): of the tokens still kept, keep those at least `min_p` times as probable
//!    as the most probable one, i.e. with `s_i - s_max >= ln(min_p)` (the order of transformers'
//!    warpers: temperature, top-k, top-p, min-p);
//! 4. Gumbel-max: return the kept token `i` maximising `s_i + G(seed, p, i)`, ties to the lower id.
//!    Since `G` is standard Gumbel noise, token `i` wins with probability `softmax(s)_i` over the kept
//!    set, which is the ordinary filtered softmax distribution.
//!
//! NaN logits count as negative infinity everywhere, so they are never preferred over a real logit.
//! A row without a single finite logit (all NaN or infinite: broken weights or configuration) has
//! nothing to draw from; the draw is then [`NO_FINITE_LOGIT`], whatever the parameters, and the
//! caller ends the request with an error.
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

mod allowed;
mod params;
#[cfg(test)]
mod tests;

pub use allowed::{is_allowed, mask_disallowed, sample_allowed, AllowedTokens};
pub use params::{seed_from_signed, top_k_from_signed, SamplingError, SamplingParams, MAX_TEMPERATURE};

/// What [`sample_at_position`] (and every device sampler) returns for a logits row without a single
/// finite value: nothing can be drawn from NaN or infinities, and the request must end with an
/// error. The CUDA kernel writes -1, which reads back as this value.
pub const NO_FINITE_LOGIT: u32 = u32::MAX;

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
/// A row without a finite logit gives [`NO_FINITE_LOGIT`].
///
/// # Panics
/// If `logits` is empty: a vocabulary always has at least one token.
pub fn sample_at_position(logits: &[f32], params: &SamplingParams, position: u64) -> u32 {
    assert!(!logits.is_empty(), "sample_at_position needs at least one logit");
    // In a healthy row the first logit is finite, so this costs one comparison.
    if !logits.iter().any(|logit| logit.is_finite()) {
        return NO_FINITE_LOGIT;
    }
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

/// The candidates surviving top-k, top-p and min-p, the best one first.
fn kept_tokens(logits: &[f32], params: &SamplingParams, inverse_temperature: f64) -> Vec<Candidate> {
    let mut candidates = if params.top_k_active(logits.len()) {
        top_k_candidates(logits, params.top_k)
    } else {
        all_candidates(logits).collect()
    };
    if params.top_p_active() {
        truncate_to_nucleus(&mut candidates, params.top_p, inverse_temperature);
    }
    if params.min_p_active() {
        keep_min_p(&mut candidates, params.min_p, inverse_temperature);
    }
    candidates
}

/// Keeps the candidates at least `min_p` times as probable as the best one, and puts the best
/// first (the order of the others does not matter to the draw). The best candidate always stays.
fn keep_min_p(candidates: &mut Vec<Candidate>, min_p: f32, inverse_temperature: f64) {
    let Some(best) = candidates.iter().copied().min() else { return };
    let best_scaled = scaled_logit(best.value, inverse_temperature);
    if best_scaled == f64::NEG_INFINITY {
        // Every candidate is masked: there is no distribution to cut, keep the lowest id.
        candidates.clear();
        candidates.push(best);
        return;
    }
    let log_min_p = f64::from(min_p).ln();
    candidates.retain(|c| {
        let scaled = scaled_logit(c.value, inverse_temperature);
        // Compared first so that a +inf best keeps its ties rather than computing inf - inf.
        scaled == best_scaled || scaled - best_scaled >= log_min_p
    });
    if let Some(at) = candidates.iter().position(|c| c.token == best.token) {
        candidates.swap(0, at);
    }
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

