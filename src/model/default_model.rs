//! The embedded default model (models/kestrel-coder), compiled into the binary so that
//! `kestrel run "def fib(n):"` works from any directory with no download and no path to
//! resolve. The weights stay in the binary's read-only data and are used in place.

use super::config::ModelConfig;
use super::weights::{safetensors, SharedBytes};
use super::{merge_eos, ModelError, ModelFiles};
use crate::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

pub const NAME: &str = "kestrel-coder";

static CONFIG: &str = include_str!("../../models/kestrel-coder/config.json");
static WEIGHTS: &[u8] = include_bytes!("../../models/kestrel-coder/model.safetensors");
static TOKENIZER: &[u8] = include_bytes!("../../models/kestrel-coder/tokenizer.json");
static TOKENIZER_CONFIG: &[u8] = include_bytes!("../../models/kestrel-coder/tokenizer_config.json");

/// The embedded model's tokenizer alone.
pub fn tokenizer() -> Result<Tokenizer, ModelError> {
    Ok(Tokenizer::from_bytes(TOKENIZER, Some(TOKENIZER_CONFIG))?)
}

pub fn open() -> Result<ModelFiles, ModelError> {
    let source = format!("{NAME} (embedded)");
    let mut config = ModelConfig::from_json_str(CONFIG, Path::new("kestrel-coder/config.json"))?;
    let store = safetensors::from_buffers(vec![(PathBuf::from("kestrel-coder/model.safetensors"), SharedBytes::from_static(WEIGHTS))], source.clone())?;
    let tokenizer = Tokenizer::from_bytes(TOKENIZER, Some(TOKENIZER_CONFIG))?.with_model_vocab_size(config.vocab_size);
    merge_eos(&mut config, &tokenizer.eos_token_ids());
    Ok(ModelFiles { source, config, store, tokenizer, sampling_defaults: Default::default() })
}
