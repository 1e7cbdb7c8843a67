//! What a request asks of its logits beyond the position-keyed draw of backend/sampling.rs:
//! penalties, a logit bias, a grammar mask, log probabilities.
//!
//! A grammar's mask goes with the row to the backend, which masks and draws it where the logits
//! are (only the mask's bits travel). The others read or change a row before its token is drawn,
//! so rows of such requests are copied to the host and drawn there (their masks applied there
//! too), with the same position-keyed rule the device uses. What a
//! row's distribution depends on (the tokens before it, where the grammar stands) is taken at
//! that row's position: in a verify row, as if the drafts before it had been generated. A
//! draft is accepted iff it equals the token drawn at its position, so the tokens (and their log
//! probabilities) are exactly those of decoding one token at a time (DESIGN Invariant 3).

pub mod grammar;
pub mod logprobs;
pub mod penalties;

use crate::backend::sampling::{sample_at_position, SamplingParams};
use crate::engine::spec::verify::VerifyOutcome;
use grammar::{apply_mask, Grammar, TokenMask};
use logprobs::{token_logprob, TokenLogprob, MAX_TOP_LOGPROBS};
use penalties::{Penalties, TokenHistory};

/// What a request asks of its logits; the default asks nothing (its rows are drawn on the device).
/// A grammar alone keeps the rows on the device, masked there.
#[derive(Debug, Clone, Default)]
pub struct LogitsOptions {
    pub penalties: Penalties,
    /// Added to the logits of these tokens before the draw (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Report each generated token's log probability with this many alternatives (0: none).
    pub logprobs: Option<usize>,
    /// Only tokens this grammar allows are drawn.
    pub grammar: Option<Grammar>,
}

impl LogitsOptions {
    /// Whether rows must come to the host: the device sampler knows penalties, biases and log
    /// probabilities not (it takes a grammar's mask with the row).
    pub fn needs_host(&self) -> bool {
        self.penalties.is_active() || !self.logit_bias.is_empty() || self.logprobs.is_some()
    }

    fn changes_distribution(&self) -> bool {
        self.penalties.is_active() || !self.logit_bias.is_empty() || self.grammar.is_some()
    }

    pub fn validate(&self, vocab_size: usize) -> Result<(), String> {
        self.penalties.validate()?;
        if let Some(&(token, _)) = self.logit_bias.iter().find(|(t, _)| *t as usize >= vocab_size) {
            return Err(format!("logit_bias names token {token}, outside the vocabulary of {vocab_size}"));
        }
        if let Some(&(token, bias)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Err(format!("logit_bias of token {token} must be between -100 and 100, got {bias}"));
        }
        if self.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return Err(format!("at most {MAX_TOP_LOGPROBS} top log probabilities per token, got {}", self.logprobs.unwrap_or(0)));
        }
        Ok(())
    }
}

/// A sequence's side of [`LogitsOptions`]: the tokens its penalties count, where its grammar
/// stands.
#[derive(Debug)]
pub struct LogitsState {
    pub options: LogitsOptions,
    history: Option<TokenHistory>,
}

impl LogitsState {
    pub fn new(options: LogitsOptions, prompt: &[u32]) -> Self {
        let history = options.penalties.is_active().then(|| TokenHistory::new(prompt));
        LogitsState { options, history }
    }

    pub fn needs_host(&self) -> bool {
        self.options.needs_host()
    }

    /// The grammar masks of a row's positions (see [`Grammar::masks`]); empty without a grammar.
    pub fn masks(&mut self, drafts: &[u32]) -> Vec<TokenMask> {
        match self.options.grammar.as_mut() {
            Some(grammar) => grammar.masks(drafts),
            None => Vec::new(),
        }
    }

    /// The time spent on the grammar (on any thread) since the last call.
    pub fn take_grammar_work(&mut self) -> std::time::Duration {
        self.options.grammar.as_mut().map_or(std::time::Duration::ZERO, Grammar::take_work)
    }

    /// How many of `drafts` are worth verifying.
    pub fn valid_drafts(&mut self, drafts: &[u32]) -> usize {
        self.options.grammar.as_mut().map_or(drafts.len(), |grammar| grammar.valid_drafts(drafts))
    }

    /// Records tokens a step committed.
    pub fn commit(&mut self, tokens: &[u32]) {
        if let Some(history) = self.history.as_mut() {
            tokens.iter().for_each(|&t| history.push(t));
        }
        if let Some(grammar) = self.options.grammar.as_mut() {
            grammar.commit(tokens);
        }
    }

    /// A row as it is drawn from: bias, then penalties (with `ahead`, the drafts before the
    /// row's position), then the grammar's mask.
    fn adjust(&self, logits: &mut [f32], ahead: &[u32], mask: Option<&TokenMask>) {
        for &(token, bias) in &self.options.logit_bias {
            if let Some(logit) = logits.get_mut(token as usize) {
                *logit += bias;
            }
        }
        if let Some(history) = &self.history {
            history.apply(&self.options.penalties, logits, ahead);
        }
        if let Some(Some(mask)) = mask {
            apply_mask(mask, logits);
        }
    }

    /// Draws the positions of one row on the host: row `i` of `rows` predicts output position
    /// `first_position + i` after `drafts[..i]`; drafts are accepted while they equal the draw.
    /// Returns the outcome and the log probabilities of its tokens (when asked for).
    pub fn draw(&self, rows: &[&[f32]], drafts: &[u32], masks: &[TokenMask], params: &SamplingParams, first_position: u64) -> (VerifyOutcome, Vec<TokenLogprob>) {
        debug_assert_eq!(rows.len(), drafts.len() + 1, "a row with {} drafts has {} logits rows", drafts.len(), rows.len());
        let mut tokens = Vec::with_capacity(rows.len());
        let mut adjusted = Vec::new();
        for (i, raw) in rows.iter().enumerate() {
            let row: &[f32] = if self.options.changes_distribution() {
                adjusted.clear();
                adjusted.extend_from_slice(raw);
                self.adjust(&mut adjusted, &drafts[..i], masks.get(i));
                &adjusted
            } else {
                raw
            };
            let token = sample_at_position(row, params, first_position + i as u64);
            tokens.push(token);
            if drafts.get(i) != Some(&token) {
                break;
            }
        }
        let logprobs = match self.options.logprobs {
            Some(top) => tokens.iter().zip(rows).map(|(&token, raw)| token_logprob(raw, token, top)).collect(),
            None => Vec::new(),
        };
        (VerifyOutcome { accepted: tokens.len() - 1, tokens }, logprobs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy target: logits favour repeating the previous token.
    fn toy_rows(context: &[u32], drafts: &[u32]) -> Vec<Vec<f32>> {
        let mut extended = context.to_vec();
        let mut rows = Vec::new();
        for i in 0..=drafts.len() {
            let last = *extended.last().unwrap_or(&0) as usize;
            rows.push((0..8).map(|t| if t == last { 3.0 } else { (t as f32 * 0.37).sin() }).collect());
            if let Some(&d) = drafts.get(i) {
                extended.push(d);
            }
        }
        rows
    }

    fn options() -> LogitsOptions {
        LogitsOptions { penalties: Penalties { presence: 1.5, frequency: 0.5, repetition: 1.2 }, logit_bias: vec![(5, 2.0)], logprobs: Some(3), grammar: None }
    }

    /// One token at a time, then whole verify rows with oracle drafts: the same tokens and log
    /// probabilities.
    #[test]
    fn verify_rows_draw_what_single_steps_draw() {
        let params = SamplingParams { temperature: 0.9, top_k: 0, top_p: 1.0, min_p: 0.05, seed: 77 };
        let prompt = [1u32, 2, 3];
        let mut plain = LogitsState::new(options(), &prompt);
        let (mut context, mut reference, mut reference_logprobs) = (prompt.to_vec(), Vec::new(), Vec::new());
        for position in 0..40u64 {
            let rows = toy_rows(&context, &[]);
            let (outcome, logprobs) = plain.draw(&[&rows[0]], &[], &[], &params, position);
            plain.commit(&outcome.tokens);
            context.extend(&outcome.tokens);
            reference.extend(outcome.tokens);
            reference_logprobs.extend(logprobs);
        }

        let mut spec = LogitsState::new(options(), &prompt);
        let (mut context, mut produced, mut produced_logprobs) = (prompt.to_vec(), Vec::new(), Vec::new());
        for k in [3usize, 0, 2, 4, 1, 3, 5, 2, 4] {
            let start = produced.len();
            if start >= 30 {
                break;
            }
            // Right drafts, then one wrong one.
            let mut drafts: Vec<u32> = reference[start..start + k].to_vec();
            drafts.push((reference[start + k] + 1) % 8);
            let rows = toy_rows(&context, &drafts);
            let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
            let (outcome, logprobs) = spec.draw(&refs, &drafts, &[], &params, start as u64);
            assert_eq!(outcome.accepted, k);
            spec.commit(&outcome.tokens);
            context.extend(&outcome.tokens);
            produced.extend(outcome.tokens);
            produced_logprobs.extend(logprobs);
        }
        assert_eq!(produced, reference[..produced.len()]);
        assert_eq!(produced_logprobs, reference_logprobs[..produced.len()]);
    }

    #[test]
    fn options_are_checked() {
        assert!(options().validate(8).is_ok());
        assert!(LogitsOptions { logit_bias: vec![(8, 1.0)], ..LogitsOptions::default() }.validate(8).is_err());
        assert!(LogitsOptions { logit_bias: vec![(1, 101.0)], ..LogitsOptions::default() }.validate(8).is_err());
        assert!(LogitsOptions { logprobs: Some(21), ..LogitsOptions::default() }.validate(8).is_err());
        assert!(!LogitsOptions::default().needs_host());
        assert!(options().needs_host());
    }
}
