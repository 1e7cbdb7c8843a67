//! Log probabilities of generated tokens, for clients that read them (`logprobs` /
//! `top_logprobs` in the OpenAI API).
//!
//! They are the model's own distribution: `log_softmax` of the logits row the token was drawn
//! from, before temperature, penalties, logit bias or a grammar mask (vLLM's default,
//! `raw_logprobs`). That row is the one sampling uses, so log probabilities are as unchanged by
//! speculation and batching as the tokens are. The sums run in f64.

/// The most alternatives a request may ask for per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A generated token's log probability, and the most likely tokens at its position.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// `(token, logprob)`, most likely first (ties to the lower id).
    pub top: Vec<(u32, f32)>,
}

/// A logit as a real number: NaN counts as negative infinity, as in sampling.
fn value(logit: f32) -> f64 {
    if logit.is_nan() {
        f64::NEG_INFINITY
    } else {
        f64::from(logit)
    }
}

/// `log(sum(exp(logits)))`, shifted by the maximum so that nothing overflows.
fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().map(|&l| value(l)).fold(f64::NEG_INFINITY, f64::max);
    if !max.is_finite() {
        return max;
    }
    max + logits.iter().map(|&l| (value(l) - max).exp()).sum::<f64>().ln()
}

/// The log probability of `token` and of the `top` most likely tokens under `logits`.
pub fn token_logprob(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let normaliser = log_sum_exp(logits);
    // A row with no finite logit draws no token of the vocabulary (the sampler's sentinel).
    let logprob = |t: u32| logits.get(t as usize).map_or(f32::NEG_INFINITY, |&l| (value(l) - normaliser) as f32);
    let mut best: Vec<u32> = Vec::new();
    if top > 0 {
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let order = |a: &u32, b: &u32| value(logits[*b as usize]).total_cmp(&value(logits[*a as usize])).then(a.cmp(b));
        let keep = top.min(ids.len());
        if keep < ids.len() {
            ids.select_nth_unstable_by(keep - 1, order);
            ids.truncate(keep);
        }
        ids.sort_unstable_by(order);
        best = ids;
    }
    TokenLogprob { token, logprob: logprob(token), top: best.into_iter().map(|t| (t, logprob(t))).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_probabilities_are_log_softmax() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        let entry = token_logprob(&logits, 2, 3);
        assert!((f64::from(entry.logprob) - (2.0 - z.ln())).abs() < 1e-6);
        assert_eq!(entry.top.iter().map(|(t, _)| *t).collect::<Vec<_>>(), vec![1, 3, 2], "ties go to the lower id");
        let total: f64 = logits.iter().enumerate().map(|(t, _)| f64::from(token_logprob(&logits, t as u32, 0).logprob).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn masked_and_nan_logits_have_no_probability_and_large_logits_do_not_overflow() {
        let logits = [f32::NEG_INFINITY, 1000.0, f32::NAN, 999.0];
        let entry = token_logprob(&logits, 1, 10);
        assert_eq!(entry.top.len(), 4);
        assert!(entry.logprob < 0.0 && entry.logprob > -1.0);
        assert_eq!(token_logprob(&logits, 0, 0).logprob, f32::NEG_INFINITY);
        assert_eq!(token_logprob(&logits, 2, 0).logprob, f32::NEG_INFINITY);
    }
}
