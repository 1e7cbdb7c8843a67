//! Per-request sampling parameters and the one place their ranges are defined, so that the
//! command line, the server, batch lines and the chat's `/temp` accept exactly the same values.

use thiserror::Error;

/// The highest temperature accepted anywhere (OpenAI's limit).
pub const MAX_TEMPERATURE: f32 = 2.0;

/// Why a sampling parameter was refused. [`SamplingError::field`] names the parameter, so that each
/// front end can point at its own spelling of it (`--top-p`, `"top_p"`).
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SamplingError {
    #[error("temperature must be a number from 0 to {MAX_TEMPERATURE} (0 is greedy), got {0}")]
    InvalidTemperature(f32),
    #[error("top_p must be greater than 0 and at most 1, got {0}")]
    InvalidTopP(f32),
    #[error("top_k must be at least 1, or 0 or -1 for no limit; got {0}")]
    InvalidTopK(i64),
    #[error("min_p must be from 0 to 1 (0 turns it off), got {0}")]
    InvalidMinP(f32),
}

impl SamplingError {
    /// The parameter at fault, as the OpenAI API spells it.
    pub fn field(&self) -> &'static str {
        match self {
            SamplingError::InvalidTemperature(_) => "temperature",
            SamplingError::InvalidTopP(_) => "top_p",
            SamplingError::InvalidTopK(_) => "top_k",
            SamplingError::InvalidMinP(_) => "min_p",
        }
    }
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
    /// Keeps tokens at least this fraction as probable as the most probable one; 0 turns it off.
    pub min_p: f32,
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
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0 }
    }

    /// True when the draw is a plain argmax. Anything that is not a positive temperature counts,
    /// so that unvalidated parameters still sample something well defined.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }

    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(0.0..=MAX_TEMPERATURE).contains(&self.temperature) {
            return Err(SamplingError::InvalidTemperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::InvalidTopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::InvalidMinP(self.min_p));
        }
        Ok(())
    }

    /// True when a sampled (non-greedy) draw filters the vocabulary with top-k, top-p or min-p.
    pub fn filters(&self, vocab: usize) -> bool {
        self.top_k_active(vocab) || self.top_p_active() || self.min_p_active()
    }

    pub(super) fn top_k_active(&self, vocab: usize) -> bool {
        self.top_k > 0 && self.top_k < vocab
    }

    pub(super) fn top_p_active(&self) -> bool {
        // NaN and values >= 1 leave the distribution unfiltered; validate() refuses them earlier.
        self.top_p < 1.0
    }

    pub(super) fn min_p_active(&self) -> bool {
        // NaN and values <= 0 leave the distribution unfiltered; validate() refuses them earlier.
        self.min_p > 0.0
    }
}

/// `top_k` as llama.cpp and vLLM users write it: 0 or -1 mean no limit.
pub fn top_k_from_signed(top_k: i64) -> Result<usize, SamplingError> {
    match top_k {
        -1 | 0 => Ok(0),
        k if k > 0 => Ok(usize::try_from(k).unwrap_or(usize::MAX)),
        k => Err(SamplingError::InvalidTopK(k)),
    }
}

/// A seed as llama.cpp users write it: -1 asks for a random one (`None`); any other value is
/// taken as its 64 bits, so negative seeds are valid seeds, not errors.
pub fn seed_from_signed(seed: i64) -> Option<u64> {
    (seed != -1).then_some(seed as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams { temperature, top_p, min_p, ..SamplingParams::greedy() }
    }

    #[test]
    fn validate_refuses_values_out_of_range_and_names_the_field() {
        assert!(SamplingParams::default().validate().is_ok());
        assert!(params(0.7, 0.95, 0.05).validate().is_ok());
        assert!(params(MAX_TEMPERATURE, 1.0, 1.0).validate().is_ok());
        for (bad, field) in [
            (params(-0.1, 1.0, 0.0), "temperature"),
            (params(2.5, 1.0, 0.0), "temperature"),
            (params(1e9, 1.0, 0.0), "temperature"),
            (params(f32::NAN, 1.0, 0.0), "temperature"),
            (params(f32::INFINITY, 1.0, 0.0), "temperature"),
            (params(1.0, 0.0, 0.0), "top_p"),
            (params(1.0, 1.5, 0.0), "top_p"),
            (params(1.0, f32::NAN, 0.0), "top_p"),
            (params(1.0, 1.0, -0.5), "min_p"),
            (params(1.0, 1.0, 1.5), "min_p"),
            (params(1.0, 1.0, f32::NAN), "min_p"),
        ] {
            let err = bad.validate().expect_err("out of range");
            assert_eq!(err.field(), field, "{bad:?}");
            assert!(err.to_string().starts_with(field), "{err}");
        }
    }

    #[test]
    fn signed_top_k_and_seed() {
        assert_eq!(top_k_from_signed(-1), Ok(0));
        assert_eq!(top_k_from_signed(0), Ok(0));
        assert_eq!(top_k_from_signed(40), Ok(40));
        assert_eq!(top_k_from_signed(-5).map_err(|e| e.field()), Err("top_k"));
        assert_eq!(seed_from_signed(-1), None);
        assert_eq!(seed_from_signed(7), Some(7));
        assert_eq!(seed_from_signed(-2), Some(u64::MAX - 1));
    }

    #[test]
    fn filters_counts_min_p() {
        let sampled = params(1.0, 1.0, 0.0);
        assert!(!sampled.filters(100));
        assert!(params(1.0, 1.0, 0.1).filters(100));
        assert!(params(1.0, 0.9, 0.0).filters(100));
        assert!(SamplingParams { top_k: 5, ..sampled.clone() }.filters(100));
        assert!(!SamplingParams { top_k: 100, ..sampled }.filters(100));
    }

    #[test]
    fn defaults_and_serde() {
        assert!(SamplingParams::default().is_greedy() && SamplingParams::default() == SamplingParams::greedy());
        let parsed: SamplingParams = serde_json::from_str(r#"{"temperature": 0.8, "seed": 3, "min_p": 0.1}"#).expect("valid json");
        assert_eq!(parsed, SamplingParams { temperature: 0.8, seed: 3, min_p: 0.1, ..SamplingParams::greedy() });
        let json = serde_json::to_string(&parsed).expect("serializable");
        assert_eq!(serde_json::from_str::<SamplingParams>(&json).expect("round trip"), parsed);
    }
}
