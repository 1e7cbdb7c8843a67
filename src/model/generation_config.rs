//! `generation_config.json`: the stop tokens and the sampling a model's makers recommend, read as
//! Hugging Face transformers and vLLM read it.
//!
//! Its `eos_token_id` (a number or a list) joins the model's stop tokens: Qwen3.5 / Qwen3.6
//! checkpoints list `<|im_end|>` and `<|endoftext|>` there. Its `temperature`, `top_p`, `top_k` and
//! `min_p` become the defaults of requests that leave them unset. With `"do_sample": false` the
//! model asks for greedy decoding, as transformers reads it, so the default temperature is 0.

use crate::backend::sampling::{top_k_from_signed, SamplingParams};
use serde_json::Value;
use std::path::{Path, PathBuf};

pub const GENERATION_CONFIG_JSON: &str = "generation_config.json";

#[derive(Debug, thiserror::Error)]
pub enum GenerationConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is not valid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: `{field}` {reason}")]
    Field { path: PathBuf, field: String, reason: String },
}

/// Sampling defaults a model recommends; `None` where it says nothing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
}

impl SamplingDefaults {
    /// llama.cpp's sampling defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05): what
    /// `run` and `chat` use where neither a flag nor the model says otherwise.
    pub fn llama_cpp() -> Self {
        SamplingDefaults { temperature: Some(0.8), top_p: Some(0.95), top_k: Some(40), min_p: Some(0.05) }
    }

    /// Each value of `self`, else the one of `fallback`.
    pub fn or(&self, fallback: &SamplingDefaults) -> SamplingDefaults {
        SamplingDefaults {
            temperature: self.temperature.or(fallback.temperature),
            top_p: self.top_p.or(fallback.top_p),
            top_k: self.top_k.or(fallback.top_k),
            min_p: self.min_p.or(fallback.min_p),
        }
    }

    pub fn is_empty(&self) -> bool {
        *self == SamplingDefaults::default()
    }

    /// The recommended values that are set, as `name value` pairs in a fixed order.
    pub fn describe(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(t) = self.temperature {
            out.push(("temperature", t.to_string()));
        }
        if let Some(p) = self.top_p {
            out.push(("top_p", p.to_string()));
        }
        if let Some(k) = self.top_k {
            out.push(("top_k", k.to_string()));
        }
        if let Some(p) = self.min_p {
            out.push(("min_p", p.to_string()));
        }
        out
    }

    pub fn to_json(&self) -> Value {
        serde_json::json!({"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p})
    }
}

/// What `generation_config.json` holds that generation uses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    pub sampling: SamplingDefaults,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; a model without one has an empty configuration. Ids
    /// must be below `vocab_size` and values in the ranges requests accept.
    pub fn from_dir(dir: &Path, vocab_size: usize) -> Result<Self, GenerationConfigError> {
        let path = dir.join(GENERATION_CONFIG_JSON);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(GenerationConfig::default()),
            Err(source) => return Err(GenerationConfigError::Read { path, source }),
        };
        Self::from_json_str(&text, &path, vocab_size)
    }

    /// Parses a generation_config.json body; `path` names it in errors.
    pub fn from_json_str(text: &str, path: &Path, vocab_size: usize) -> Result<Self, GenerationConfigError> {
        let root: Value = serde_json::from_str(text).map_err(|source| GenerationConfigError::Json { path: path.into(), source })?;
        let bad = |field: &str, reason: String| GenerationConfigError::Field { path: path.into(), field: field.to_string(), reason };
        let Value::Object(fields) = &root else {
            return Err(bad("(top level)", "must be a JSON object".into()));
        };
        let get = |key: &str| fields.get(key).filter(|v| !v.is_null());

        let eos_token_ids = match get("eos_token_id") {
            None => Vec::new(),
            Some(Value::Array(list)) => list.iter().map(|v| token_id(v, vocab_size)).collect::<Result<Vec<u32>, String>>().map_err(|reason| bad("eos_token_id", reason))?,
            Some(one) => vec![token_id(one, vocab_size).map_err(|reason| bad("eos_token_id", reason))?],
        };
        let number = |key: &str| -> Result<Option<f64>, GenerationConfigError> {
            get(key).map(|v| v.as_f64().ok_or_else(|| bad(key, format!("must be a number, got {v}")))).transpose()
        };
        let greedy = get("do_sample").and_then(Value::as_bool) == Some(false);
        let temperature = if greedy { Some(0.0) } else { number("temperature")?.map(|t| t as f32) };
        let sampling = SamplingDefaults {
            temperature,
            top_p: number("top_p")?.map(|p| p as f32),
            top_k: match get("top_k") {
                None => None,
                Some(v) => {
                    let k = v.as_i64().ok_or_else(|| bad("top_k", format!("must be an integer, got {v}")))?;
                    Some(top_k_from_signed(k).map_err(|e| bad("top_k", e.to_string()))?)
                }
            },
            min_p: number("min_p")?.map(|p| p as f32),
        };
        // The ranges of a request: a recommendation no request may carry cannot be a default.
        let check = SamplingParams {
            temperature: sampling.temperature.unwrap_or(0.0),
            top_p: sampling.top_p.unwrap_or(1.0),
            min_p: sampling.min_p.unwrap_or(0.0),
            ..SamplingParams::greedy()
        };
        check.validate().map_err(|e| bad(e.field(), e.to_string()))?;
        Ok(GenerationConfig { eos_token_ids, sampling })
    }
}

fn token_id(value: &Value, vocab_size: usize) -> Result<u32, String> {
    match value.as_u64() {
        Some(id) if (id as usize) < vocab_size => Ok(id as u32),
        Some(id) => Err(format!("{id} is outside the vocabulary of {vocab_size} tokens")),
        None => Err(format!("must be a token id or a list of them, got {value}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<GenerationConfig, GenerationConfigError> {
        GenerationConfig::from_json_str(text, Path::new("m/generation_config.json"), 1000)
    }

    #[test]
    fn reads_stop_ids_and_sampling_defaults() {
        let c = parse(r#"{"bos_token_id": 1, "do_sample": true, "eos_token_id": [7, 9], "pad_token_id": 7, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "transformers_version": "4.57.0"}"#).expect("valid");
        assert_eq!(c.eos_token_ids, vec![7, 9]);
        assert_eq!(c.sampling, SamplingDefaults { temperature: Some(0.6), top_p: Some(0.95), top_k: Some(20), min_p: Some(0.0) });
        let one = parse(r#"{"eos_token_id": 3}"#).expect("valid");
        assert_eq!(one.eos_token_ids, vec![3]);
        assert!(one.sampling.is_empty());
        // do_sample false asks for greedy decoding whatever the temperature says.
        assert_eq!(parse(r#"{"do_sample": false, "temperature": 0.7}"#).expect("valid").sampling.temperature, Some(0.0));
        assert_eq!(parse(r#"{"top_k": -1}"#).expect("valid").sampling.top_k, Some(0));
    }

    #[test]
    fn values_that_cannot_be_right_name_the_field() {
        for (text, field) in [
            (r#"{"eos_token_id": [7, 5000]}"#, "eos_token_id"),
            (r#"{"eos_token_id": "x"}"#, "eos_token_id"),
            (r#"{"temperature": -1}"#, "temperature"),
            (r#"{"temperature": "hot"}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_k": -3}"#, "top_k"),
            (r#"{"min_p": 2}"#, "min_p"),
            ("[1]", "(top level)"),
        ] {
            let message = parse(text).expect_err(text).to_string();
            assert!(message.contains(&format!("`{field}`")) && message.contains("m/generation_config.json"), "{text}: {message}");
        }
        assert!(parse("{").expect_err("malformed").to_string().contains("not valid JSON"));
    }

    #[test]
    fn a_directory_without_the_file_has_none() {
        let dir = tempfile::tempdir().expect("temp dir");
        assert_eq!(GenerationConfig::from_dir(dir.path(), 10).expect("absent is fine"), GenerationConfig::default());
    }
}
