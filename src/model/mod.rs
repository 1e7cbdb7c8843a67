//! Model configuration, weights and forward definitions, and opening a model from disk.

pub mod arch;
pub mod config;
pub mod default_model;
pub mod dummy;
pub mod gguf;
pub mod weights;

use crate::tokenizer::{Tokenizer, TokenizerError};
use config::{ConfigError, ModelConfig};
use std::path::{Path, PathBuf};
use weights::{WeightError, WeightStore};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model path {0} does not exist")]
    NotFound(PathBuf),
    #[error("{0} is not a model directory (expected config.json inside)")]
    NotADirectory(PathBuf),
    #[error(transparent)]
    Gguf(#[from] gguf::GgufModelError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Everything read from a model's files, before any weight is uploaded.
pub struct ModelFiles {
    /// Where the model came from, for messages.
    pub source: String,
    pub config: ModelConfig,
    pub store: WeightStore,
    pub tokenizer: Tokenizer,
}

impl ModelFiles {
    /// Opens an HF model directory or a GGUF file, or the embedded default model when `path`
    /// is `None`.
    pub fn open(path: Option<&Path>) -> Result<Self, ModelError> {
        match path {
            None => default_model::open(),
            Some(p) if p.is_file() => Self::open_gguf(p),
            Some(p) => Self::open_dir(p),
        }
    }

    /// Opens a single-file GGUF checkpoint (llama.cpp's conventions, see [`gguf`]).
    pub fn open_gguf(path: &Path) -> Result<Self, ModelError> {
        if !path.exists() {
            return Err(ModelError::NotFound(path.to_path_buf()));
        }
        let gguf::GgufModel { mut config, store, vocab } = gguf::open(path)?;
        let tokenizer = Tokenizer::from_bpe_vocab(&vocab, path)?;
        merge_eos(&mut config, &tokenizer);
        Ok(ModelFiles { source: path.display().to_string(), config, store, tokenizer })
    }

    /// The tokens that end an assistant turn: the model's end-of-sequence tokens, and ChatML's
    /// `<|im_end|>` when the vocabulary has it (a model trained on plain text may not list it as
    /// end-of-sequence, yet its chat template closes every turn with it).
    pub fn chat_stop_token_ids(&self) -> Vec<u32> {
        let mut stops = self.config.eos_token_ids.clone();
        if let Some(end_of_turn) = self.tokenizer.token_to_id("<|im_end|>") {
            if !stops.contains(&end_of_turn) {
                stops.push(end_of_turn);
            }
        }
        stops
    }

    pub fn open_dir(dir: &Path) -> Result<Self, ModelError> {
        if !dir.exists() {
            return Err(ModelError::NotFound(dir.to_path_buf()));
        }
        let config_path = dir.join("config.json");
        if !dir.is_dir() || !config_path.exists() {
            return Err(ModelError::NotADirectory(dir.to_path_buf()));
        }
        let mut config = ModelConfig::from_file(&config_path)?;
        let store = weights::safetensors::open_dir(dir)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        merge_eos(&mut config, &tokenizer);
        Ok(ModelFiles { source: dir.display().to_string(), config, store, tokenizer })
    }
}

/// The tokenizer of a model without its weights: from a GGUF file (a vocab-only one is enough),
/// an HF directory's tokenizer files, or the embedded default model when `path` is `None`.
pub fn open_tokenizer(path: Option<&Path>) -> Result<Tokenizer, ModelError> {
    match path {
        None => default_model::tokenizer(),
        Some(p) if !p.exists() => Err(ModelError::NotFound(p.to_path_buf())),
        Some(p) if p.is_file() => Ok(Tokenizer::from_bpe_vocab(&gguf::open_vocab(p)?, p)?),
        Some(p) => Ok(Tokenizer::from_dir(p)?),
    }
}

/// Stop tokens are the union of config.json's and the tokenizer config's.
pub(crate) fn merge_eos(config: &mut ModelConfig, tokenizer: &Tokenizer) {
    for id in tokenizer.eos_token_ids() {
        if !config.eos_token_ids.contains(&id) {
            config.eos_token_ids.push(id);
        }
    }
}

/// Quick check that a store holds what the config promises (used by `info`).
pub fn mtp_tensor_names(store: &WeightStore) -> Vec<&str> {
    store.names().into_iter().filter(|n| n.starts_with("mtp.")).collect()
}
