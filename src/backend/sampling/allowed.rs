//! Which tokens a row may draw: a grammar's mask as the samplers read it, so that a constrained
//! row is masked and drawn where its logits are (on the device) and only its token comes back.
//!
//! The layout is toktrie's (llguidance's masks): one bit per token, token `t` allowed when bit
//! `t % 32` of word `t / 32` is set; a token past the words is not allowed. A masked token is
//! drawn exactly as if its logit were negative infinity, on every backend.

use super::{sample_at_position, SamplingParams};

/// The tokens one row may draw (see the module docs); shared, since a row's mask is handed
/// from the thread that computed it to the backend's draw.
pub type AllowedTokens = std::sync::Arc<[u32]>;

/// Whether `allowed` lets `token` be drawn.
pub fn is_allowed(allowed: &[u32], token: usize) -> bool {
    allowed.get(token / 32).is_some_and(|word| word >> (token % 32) & 1 == 1)
}

/// Sets every logit that `allowed` does not allow to negative infinity.
pub fn mask_disallowed(allowed: &[u32], logits: &mut [f32]) {
    for (token, logit) in logits.iter_mut().enumerate() {
        if !is_allowed(allowed, token) {
            *logit = f32::NEG_INFINITY;
        }
    }
}

/// [`sample_at_position`] of `logits` with the tokens outside `allowed` (when given) masked.
pub fn sample_allowed(logits: &[f32], allowed: Option<&[u32]>, params: &SamplingParams, position: u64) -> u32 {
    match allowed {
        None => sample_at_position(logits, params, position),
        Some(allowed) => {
            let mut masked = logits.to_vec();
            mask_disallowed(allowed, &mut masked);
            sample_at_position(&masked, params, position)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sampling::NO_FINITE_LOGIT;

    fn bits(tokens: &[usize], words: usize) -> Vec<u32> {
        let mut w = vec![0u32; words];
        tokens.iter().for_each(|&t| w[t / 32] |= 1 << (t % 32));
        w
    }

    #[test]
    fn a_masked_draw_picks_only_allowed_tokens() {
        let logits: Vec<f32> = (0..70).map(|t| (t as f32 * 0.61).sin() * 3.0).collect();
        let allowed = bits(&[3, 33, 64, 69], 3);
        assert!(is_allowed(&allowed, 33) && !is_allowed(&allowed, 34) && !is_allowed(&allowed, 96), "past the words: not allowed");
        let params = [SamplingParams::greedy(), SamplingParams { temperature: 1.3, seed: 4, ..SamplingParams::greedy() }, SamplingParams { temperature: 0.9, top_k: 2, seed: 8, ..SamplingParams::greedy() }];
        for p in &params {
            let mut seen = std::collections::BTreeSet::new();
            for position in 0..200 {
                let token = sample_allowed(&logits, Some(&allowed), p, position);
                assert!(is_allowed(&allowed, token as usize), "{p:?} drew {token}");
                seen.insert(token);
            }
            if p.temperature > 0.0 && p.top_k == 0 {
                assert!(seen.len() > 1, "the draw is not degenerate: {seen:?}");
            }
            assert_eq!(sample_allowed(&logits, None, p, 7), sample_at_position(&logits, p, 7));
        }
        // Nothing allowed: nothing to draw from, as with a row of -inf.
        assert_eq!(sample_allowed(&logits, Some(&[0, 0, 0]), &params[0], 0), NO_FINITE_LOGIT);
    }
}
