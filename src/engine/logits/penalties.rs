//! Repetition penalties, as OpenAI and vLLM define them:
//!
//! - `presence_penalty` p: `logit -= p` for every token generated at least once;
//! - `frequency_penalty` f: `logit -= f * count` for every token generated `count` times;
//! - `repetition_penalty` r (Hugging Face's, llama.cpp's `repeat_penalty`): for every token of
//!   the prompt or the output, a positive logit is divided by r and a negative one multiplied.
//!
//! Repetition is applied first, then presence and frequency (vLLM's order). Positive values
//! push the output away from what it already said; negative presence or frequency values (and
//! r < 1) pull it towards it. The counts a row uses are those of the tokens before its position,
//! drafts of the same verify row included, so a verify row is penalised exactly as the decode
//! steps it stands for.

use std::collections::{HashMap, HashSet};

/// The penalty strengths of a request; the default is no penalty.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    pub presence: f32,
    pub frequency: f32,
    /// 1 turns it off.
    pub repetition: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties { presence: 0.0, frequency: 0.0, repetition: 1.0 }
    }
}

impl Penalties {
    pub fn is_active(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0
    }

    /// OpenAI's ranges: presence and frequency in [-2, 2]; repetition positive.
    pub fn validate(&self) -> Result<(), String> {
        for (name, value) in [("presence_penalty", self.presence), ("frequency_penalty", self.frequency)] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(format!("{name} must be between -2 and 2, got {value}"));
            }
        }
        if !(self.repetition.is_finite() && self.repetition > 0.0) {
            return Err(format!("repetition_penalty must be a positive number, got {}", self.repetition));
        }
        Ok(())
    }
}

/// The tokens a penalty reads: the prompt's (for repetition) and how often each was generated.
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    prompt: HashSet<u32>,
    output: HashMap<u32, u32>,
}

impl TokenHistory {
    pub fn new(prompt: &[u32]) -> Self {
        TokenHistory { prompt: prompt.iter().copied().collect(), output: HashMap::new() }
    }

    pub fn push(&mut self, token: u32) {
        *self.output.entry(token).or_insert(0) += 1;
    }

    /// Applies `penalties` to one logits row, as if `ahead` (earlier drafts of the same verify
    /// row) had been generated too.
    pub fn apply(&self, penalties: &Penalties, logits: &mut [f32], ahead: &[u32]) {
        let mut counts = self.output.clone();
        for &token in ahead {
            *counts.entry(token).or_insert(0) += 1;
        }
        let vocab = logits.len();
        let in_vocab = |token: u32| (token as usize) < vocab;
        if penalties.repetition != 1.0 {
            let seen: HashSet<u32> = self.prompt.iter().chain(counts.keys()).copied().filter(|&t| in_vocab(t)).collect();
            for token in seen {
                let logit = &mut logits[token as usize];
                *logit = if *logit > 0.0 { *logit / penalties.repetition } else { *logit * penalties.repetition };
            }
        }
        if penalties.presence != 0.0 || penalties.frequency != 0.0 {
            for (&token, &count) in counts.iter().filter(|(&t, _)| in_vocab(t)) {
                logits[token as usize] -= penalties.frequency * count as f32 + penalties.presence;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_penalty_follows_its_definition() {
        let mut history = TokenHistory::new(&[0]);
        history.push(1);
        history.push(1);
        let base = [2.0f32, 2.0, -2.0, 2.0];

        let mut logits = base;
        history.apply(&Penalties { presence: 0.5, ..Penalties::default() }, &mut logits, &[2]);
        assert_eq!(logits, [2.0, 1.5, -2.5, 2.0], "presence: once per generated token, the prompt aside");

        let mut logits = base;
        history.apply(&Penalties { frequency: 0.25, ..Penalties::default() }, &mut logits, &[1]);
        assert_eq!(logits, [2.0, 1.25, -2.0, 2.0], "frequency: per occurrence, drafts ahead included");

        let mut logits = base;
        history.apply(&Penalties { repetition: 2.0, ..Penalties::default() }, &mut logits, &[2]);
        assert_eq!(logits, [1.0, 1.0, -4.0, 2.0], "repetition: prompt and output, divided or multiplied by sign");
    }

    #[test]
    fn no_penalty_changes_nothing_and_ranges_are_checked() {
        let history = TokenHistory::new(&[0, 1]);
        let mut logits = [1.0f32, -1.0];
        history.apply(&Penalties::default(), &mut logits, &[0]);
        assert_eq!(logits, [1.0, -1.0]);
        assert!(!Penalties::default().is_active());
        assert!(Penalties { presence: 2.5, ..Penalties::default() }.validate().is_err());
        assert!(Penalties { frequency: -2.1, ..Penalties::default() }.validate().is_err());
        assert!(Penalties { repetition: 0.0, ..Penalties::default() }.validate().is_err());
        assert!(Penalties { presence: -2.0, frequency: 2.0, repetition: 1.3 }.validate().is_ok());
    }
}
