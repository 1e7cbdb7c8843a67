//! The sampler against its definition: distributions, filters, masked and extreme logits.
use std::collections::BTreeSet;

use super::*;

fn seeded(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p, min_p: 0.0, seed }
}

fn with_min_p(min_p: f32, params: SamplingParams) -> SamplingParams {
    SamplingParams { min_p, ..params }
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
}

#[test]
fn a_row_without_a_finite_logit_draws_the_no_finite_logit_signal() {
    let rows: [&[f32]; 4] = [
        &[f32::NEG_INFINITY; 3],
        &[f32::NAN; 5],
        &[f32::NAN, f32::INFINITY, f32::NEG_INFINITY],
        &[f32::INFINITY, f32::INFINITY],
    ];
    for row in rows {
        for params in [SamplingParams::greedy(), seeded(1.0, 0, 1.0, 1), seeded(1.0, 2, 0.5, 1), with_min_p(0.1, seeded(0.7, 0, 1.0, 1))] {
            assert_eq!(sample_at_position(row, &params, 3), NO_FINITE_LOGIT, "{row:?} {params:?}");
        }
    }
    // One finite logit is enough to draw a real token.
    assert_eq!(sample_at_position(&[f32::NAN, -3.0, f32::NAN], &seeded(1.0, 0, 0.9, 4), 0), 1);
    assert_eq!(sample_at_position(&[f32::NAN, -3.0, f32::NAN], &SamplingParams::greedy(), 0), 1);
}

#[test]
fn min_p_keeps_tokens_near_the_best() {
    // Probabilities at T=1 are roughly 0.64, 0.24, 0.09, 0.03 and 0.01 for ids 4, 3, 2, 1, 0: relative
    // to the best, 1, 0.37, 0.14, 0.05, 0.02.
    let logits = [-2.0f32, -1.0, 0.0, 1.0, 2.0];
    assert_eq!(drawn(&logits, &with_min_p(0.1, seeded(1.0, 0, 1.0, 5)), 3000), BTreeSet::from([2, 3, 4]));
    assert_eq!(drawn(&logits, &with_min_p(0.3, seeded(1.0, 0, 1.0, 5)), 3000), BTreeSet::from([3, 4]));
    assert_eq!(drawn(&logits, &with_min_p(1.0, seeded(1.0, 0, 1.0, 5)), 300), BTreeSet::from([4]));
    // The temperature sharpens what min-p sees: at T=0.5 the ratios square (0.14, 0.02, ...).
    assert_eq!(drawn(&logits, &with_min_p(0.1, seeded(0.5, 0, 1.0, 5)), 3000), BTreeSet::from([3, 4]));
    // Over the survivors of top-k and top-p: top_k = 2 leaves ids 3 and 4, min_p 0.3 keeps both.
    assert_eq!(drawn(&logits, &with_min_p(0.3, seeded(1.0, 2, 1.0, 6)), 3000), BTreeSet::from([3, 4]));
    // The kept tokens keep their relative probabilities.
    let p3 = 1.0 / (1.0 + 1.0f64.exp());
    assert_frequencies_near(&frequencies(&logits, &with_min_p(0.3, seeded(1.0, 0, 1.0, 7)), 20_000), &[0.0, 0.0, 0.0, p3, 1.0 - p3], 0.01);
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
    if logits.iter().all(|l| !l.is_finite()) {
        return NO_FINITE_LOGIT;
    }
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
    if params.min_p > 0.0 && scaled(kept[0]) > f64::NEG_INFINITY {
        let best = scaled(kept[0]);
        kept.retain(|&t| scaled(t) == best || scaled(t) - best >= f64::from(params.min_p).ln());
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
    // Covers the skipped logarithms, the heap top-k, the light-token drop, the widening nucleus and min-p.
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
        let min_p = [0.0, 0.0, 0.05, 0.5][(case as usize / 7) % 4];
        let params = with_min_p(min_p, seeded(temperature, top_k, top_p, case));
        for position in 0..20 {
            assert_eq!(
                sample_at_position(&logits, &params, position),
                naive_sample(&logits, &params, position),
                "case {case} position {position} params {params:?}"
            );
        }
    }
}
