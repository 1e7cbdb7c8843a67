//! GGUF checkpoints in llama.cpp's conventions (archs `qwen35`, `qwen35moe`, `qwen3next`): the
//! configuration from the metadata, the tensors under the Hugging Face names the forward reads,
//! and the tokenizer from `tokenizer.ggml.*`.
//!
//! Tensors are zero-copy views of the memory map wherever llama.cpp's layout is the Hugging Face
//! one. llama.cpp's converter (convert_hf_to_gguf.py) changes a few tensors, and only those are
//! copied, to undo the change:
//! - zero-centred RMSNorm weights are stored as `1 + w` (`Qwen3NextModel.modify_tensors`); the
//!   forward adds the 1 itself, so it is taken off again;
//! - `A_log` is stored as `ssm_a = -exp(A_log)`; it is read back as `ln(-ssm_a)`;
//! - Qwen3.5 / Qwen3.5-MoE store value heads tiled (`[k0v0, k1v0, .., k0v1, ..]`) instead of
//!   grouped by key head (`_LinearAttentionVReorderBase`), because ggml broadcasts key heads
//!   that way; rows and vectors are put back in grouped order, and the delta rule writes its
//!   output heads in the tiled order of the output projection's columns (heads.rs);
//! - Qwen3-Next files from the current converter split `in_proj_ba` into its beta and alpha
//!   rows here, so the forward takes them like Qwen3.5's.
//!
//! Sharded files (`split.count` > 1) are not supported.

mod config;
mod heads;
mod tensors;
mod vocab;

use crate::model::config::ModelConfig;
use crate::model::weights::gguf::{GgufError, GgufFile, OptionalKey};
use crate::model::weights::WeightStore;
use crate::tokenizer::BpeVocab;
use std::path::{Path, PathBuf};

/// The GGUF architectures this loader reads.
pub const SUPPORTED_ARCHITECTURES: [&str; 3] = ["qwen35", "qwen35moe", "qwen3next"];

#[derive(Debug, thiserror::Error)]
pub enum GgufModelError {
    #[error(transparent)]
    File(#[from] GgufError),
    #[error("{}: architecture `{arch}` is not supported (supported: qwen35, qwen35moe, qwen3next)", path.display())]
    UnsupportedArchitecture { path: PathBuf, arch: String },
    #[error("{}: split GGUF files are not supported (this is part {part} of {count}); merge them with llama-gguf-split --merge", path.display())]
    Split { path: PathBuf, part: u64, count: u64 },
    #[error("{}: metadata `{key}`: {reason}", path.display())]
    Metadata { path: PathBuf, key: String, reason: String },
    #[error("{}: missing tensor `{tensor}` (read as `{hf_name}`)", path.display())]
    MissingTensor { path: PathBuf, tensor: String, hf_name: String },
    #[error("{}: tensor `{tensor}` has ggml type {ggml_type}, which is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)", path.display())]
    UnsupportedType { path: PathBuf, tensor: String, ggml_type: String },
    #[error("{}: tensor `{tensor}` has shape {got:?}, expected {want:?}", path.display())]
    Shape { path: PathBuf, tensor: String, got: Vec<usize>, want: Vec<usize> },
    #[error("{}: tensor `{tensor}`: {reason}", path.display())]
    Unsupported { path: PathBuf, tensor: String, reason: String },
    #[error("{}: tensor `{tensor}`: {reason}", path.display())]
    BadValues { path: PathBuf, tensor: String, reason: String },
}

/// What a GGUF checkpoint holds, before any weight is uploaded.
pub struct GgufModel {
    pub config: ModelConfig,
    pub store: WeightStore,
    pub vocab: BpeVocab,
}

/// Reads only the vocabulary of `path`: enough to tokenize, and all a vocab-only file (such as
/// llama.cpp's models/ggml-vocab-*.gguf) holds.
pub fn open_vocab(path: &Path) -> Result<BpeVocab, GgufModelError> {
    vocab::read(&GgufFile::open(path)?)
}

/// Maps `path` and reads its configuration, tensors and vocabulary.
pub fn open(path: &Path) -> Result<GgufModel, GgufModelError> {
    let file = GgufFile::open(path)?;
    let count = file.get_u64("split.count").optional()?.unwrap_or(1);
    if count > 1 {
        let part = file.get_u64("split.no").optional()?.unwrap_or(0) + 1;
        return Err(GgufModelError::Split { path: path.to_path_buf(), part, count });
    }
    let arch = file.architecture()?.to_string();
    if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
        return Err(GgufModelError::UnsupportedArchitecture { path: path.to_path_buf(), arch });
    }
    let vocab = vocab::read(&file)?;
    let mut config = config::read(&file, &arch)?;
    if let Some(&id) = vocab.eos_token_ids.iter().find(|&&id| id as usize >= config.vocab_size) {
        return Err(GgufModelError::Metadata {
            path: path.to_path_buf(),
            key: "tokenizer.ggml.eos_token_id".into(),
            reason: format!("end-of-generation token {id} is outside the model's {} embedding rows", config.vocab_size),
        });
    }
    config.eos_token_ids = vocab.eos_token_ids.clone();
    config.bos_token_id = vocab.bos_token_id;
    let store = tensors::build_store(&file, &config)?;
    Ok(GgufModel { config, store, vocab })
}
