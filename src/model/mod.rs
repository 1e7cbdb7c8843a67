//! Model configuration, weights and forward definitions, and opening a model from disk.

pub mod arch;
pub mod config;
pub mod default_model;
pub mod dummy;
pub mod generation_config;
pub mod perplexity;
pub mod tensor_parallel;
pub mod gguf;
pub mod weights;

use crate::tokenizer::{Tokenizer, TokenizerError};
use config::{ConfigError, ModelConfig};
use generation_config::{GenerationConfig, GenerationConfigError, SamplingDefaults};
use std::path::{Path, PathBuf};
use weights::{WeightError, WeightStore};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model path {0} does not exist")]
    NotFound(PathBuf),
    #[error("{0} is not a model directory (expected config.json inside)")]
    NotADirectory(PathBuf),
    #[error("{} is one file of a model directory: pass the directory itself ({}), or a GGUF file", file.display(), dir.display())]
    FileOfADirectory { file: PathBuf, dir: PathBuf },
    #[error(transparent)]
    Gguf(#[from] gguf::GgufModelError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    GenerationConfig(#[from] GenerationConfigError),
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
    /// The sampling the model's makers recommend (generation_config.json), for requests that
    /// leave it unset.
    pub sampling_defaults: SamplingDefaults,
}

impl ModelFiles {
    /// Opens an HF model directory or a GGUF file, or the embedded default model when `path`
    /// is `None`.
    pub fn open(path: Option<&Path>) -> Result<Self, ModelError> {
        match path {
            None => default_model::open(),
            Some(p) if p.is_file() && is_file_of_a_directory(p) => {
                let dir = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
                Err(ModelError::FileOfADirectory { file: p.to_path_buf(), dir: dir.to_path_buf() })
            }
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
        let tokenizer = Tokenizer::from_bpe_vocab(&vocab, path)?.with_model_vocab_size(config.vocab_size);
        merge_eos(&mut config, &tokenizer.eos_token_ids());
        Ok(ModelFiles { source: path.display().to_string(), config, store, tokenizer, sampling_defaults: SamplingDefaults::default() })
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
        let generation = GenerationConfig::from_dir(dir, config.vocab_size)?;
        let store = weights::safetensors::open_dir(dir)?;
        let tokenizer = Tokenizer::from_dir(dir)?.with_model_vocab_size(config.vocab_size);
        merge_eos(&mut config, &tokenizer.eos_token_ids());
        merge_eos(&mut config, &generation.eos_token_ids);
        Ok(ModelFiles { source: dir.display().to_string(), config, store, tokenizer, sampling_defaults: generation.sampling })
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

/// Stop tokens are the union of config.json's, the tokenizer config's and generation_config.json's.
pub(crate) fn merge_eos(config: &mut ModelConfig, ids: &[u32]) {
    for &id in ids {
        if !config.eos_token_ids.contains(&id) {
            config.eos_token_ids.push(id);
        }
    }
}

/// A file that belongs inside a Hugging Face model directory (weights, configs, tokenizer),
/// given where the directory was meant.
fn is_file_of_a_directory(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    name.ends_with(".safetensors")
        || name.ends_with(".safetensors.index.json")
        || ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"].contains(&name)
}

/// Quick check that a store holds what the config promises (used by `info`).
pub fn mtp_tensor_names(store: &WeightStore) -> Vec<&str> {
    let mut names: Vec<&str> = store.names().into_iter().chain(store.int_names()).filter(|n| n.starts_with("mtp.")).collect();
    names.sort_unstable();
    names
}
