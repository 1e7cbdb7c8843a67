//! Tokenizer, chat templates and streaming detokenization.
//!
//! A model directory carries `tokenizer.json` (the `tokenizers` crate's format:
//! normalizer, pre-tokenizer, model, decoder, added tokens) and usually
//! `tokenizer_config.json` (chat template, BOS/EOS, added-token table).
//! [`Tokenizer`] joins the two; [`StreamDecoder`] turns generated ids into
//! UTF-8-safe text deltas.

pub mod bpe_vocab;
mod chat_template;
mod config;
mod python_json;
pub mod stop_strings;
mod stream;
mod token_bytes;
mod strftime;

#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod tiny_bpe_fixture;

use std::io;
use std::path::{Path, PathBuf};

use tokenizers::AddedToken;

pub use bpe_vocab::BpeVocab;
pub use chat_template::ChatMessage;
pub use stream::StreamDecoder;
pub use token_bytes::TokenBytes;

use chat_template::{ChatTemplate, ChatTemplateSources, DEFAULT_TEMPLATE_NAME};
use config::TokenizerConfig;

const TOKENIZER_JSON: &str = "tokenizer.json";
const TOKENIZER_CONFIG_JSON: &str = "tokenizer_config.json";
/// Newer transformers versions save the template beside the config instead of
/// inside it; when present it is the template transformers would use.
const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("no {TOKENIZER_JSON} in {}", dir.display())]
    MissingTokenizerJson { dir: PathBuf },

    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },

    #[error("{} is not a valid tokenizer: {message}", file.display())]
    InvalidTokenizerJson { file: PathBuf, message: String },

    #[error("{} is not a valid tokenizer config: {message}", file.display())]
    InvalidTokenizerConfig { file: PathBuf, message: String },

    #[error("{}: {field} is {token:?}, which is not a token of this tokenizer", file.display())]
    UnknownSpecialToken {
        file: PathBuf,
        field: String,
        token: String,
    },

    #[error(
        "{}: added_tokens_decoder puts {token:?} at id {declared_id}, but the tokenizer has it at id {actual_id}",
        file.display()
    )]
    AddedTokenIdMismatch {
        file: PathBuf,
        token: String,
        declared_id: u32,
        actual_id: u32,
    },

    #[error("{}: {message}", origin.display())]
    InvalidVocab { origin: PathBuf, message: String },

    #[error("chat template {template:?} from {} does not compile: {message}", file.display())]
    ChatTemplateSyntax {
        file: PathBuf,
        template: String,
        message: String,
    },

    #[error("the model has no chat template; send a plain prompt instead of messages")]
    NoChatTemplate,

    #[error("chat template failed: {message}")]
    ChatTemplate { message: String },

    /// The template called `raise_exception`: it refuses this conversation
    /// (wrong role order, unsupported feature). `message` is the template's own.
    #[error("chat template rejected the conversation: {message}")]
    ChatTemplateRaised { message: String },

    #[error("cannot encode text: {message}")]
    Encode { message: String },

    #[error("cannot decode token ids: {message}")]
    Decode { message: String },

    #[error("token id {id} is outside the vocabulary of {vocab_size} tokens")]
    UnknownTokenId { id: u32, vocab_size: usize },

    #[error("streaming decode failed at token id {id}: {message}")]
    StreamDecode { id: u32, message: String },
}

/// A model's tokenizer with its chat template. Immutable after loading, so one
/// instance behind an `Arc` serves every request.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Counted once: `tokenizers` rebuilds the whole vocabulary map to count it.
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
    chat_template: Option<ChatTemplate>,
    /// Ids below this that the vocabulary lacks decode as nothing: the rows a model's embedding
    /// has beyond its tokenizer (a padded vocabulary, llama.cpp's `[PAD…]` entries).
    model_vocab_size: usize,
}

impl Tokenizer {
    /// Loads `tokenizer.json` (required), `tokenizer_config.json` (optional) and
    /// `chat_template.jinja` (optional; overrides the config's template) from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let tokenizer_json_path = dir.join(TOKENIZER_JSON);
        let tokenizer_json = match std::fs::read(&tokenizer_json_path) {
            Ok(bytes) => bytes,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Err(TokenizerError::MissingTokenizerJson {
                    dir: dir.to_path_buf(),
                })
            }
            Err(source) => {
                return Err(TokenizerError::Read {
                    path: tokenizer_json_path,
                    source,
                })
            }
        };
        let config_path = dir.join(TOKENIZER_CONFIG_JSON);
        let config_json = read_optional(&config_path)?;
        let template_path = dir.join(CHAT_TEMPLATE_JINJA);
        let template_override = read_optional(&template_path)?
            .map(|bytes| {
                String::from_utf8(bytes).map_err(|_| TokenizerError::ChatTemplateSyntax {
                    file: template_path.clone(),
                    template: CHAT_TEMPLATE_JINJA.to_string(),
                    message: "the file is not valid UTF-8".to_string(),
                })
            })
            .transpose()?
            .map(|source| ChatTemplateSources {
                templates: vec![(DEFAULT_TEMPLATE_NAME.to_string(), source)],
                origin: template_path.clone(),
            });

        Self::build(
            &tokenizer_json,
            &tokenizer_json_path,
            config_json
                .as_deref()
                .map(|bytes| (bytes, config_path.as_path())),
            template_override,
        )
    }

    /// Loads from file contents, e.g. a model embedded in the binary.
    pub fn from_bytes(
        tokenizer_json: &[u8],
        tokenizer_config_json: Option<&[u8]>,
    ) -> Result<Self, TokenizerError> {
        let json_origin = PathBuf::from(format!("<embedded {TOKENIZER_JSON}>"));
        let config_origin = PathBuf::from(format!("<embedded {TOKENIZER_CONFIG_JSON}>"));
        Self::build(
            tokenizer_json,
            &json_origin,
            tokenizer_config_json.map(|bytes| (bytes, config_origin.as_path())),
            None,
        )
    }

    fn build(
        tokenizer_json: &[u8],
        json_origin: &Path,
        config_json: Option<(&[u8], &Path)>,
        template_override: Option<ChatTemplateSources>,
    ) -> Result<Self, TokenizerError> {
        let (config, config_origin) = match config_json {
            Some((bytes, origin)) => (TokenizerConfig::parse(bytes, origin)?, origin.to_path_buf()),
            None => (
                TokenizerConfig::default(),
                PathBuf::from(TOKENIZER_CONFIG_JSON),
            ),
        };
        Self::build_with_config(tokenizer_json, json_origin, config, &config_origin, template_override)
    }

    /// [`Self::build`] with the tokenizer config already in hand (a GGUF vocabulary has no
    /// `tokenizer_config.json`; its fields come from the file's metadata).
    fn build_with_config(
        tokenizer_json: &[u8],
        json_origin: &Path,
        config: TokenizerConfig,
        config_origin: &Path,
        template_override: Option<ChatTemplateSources>,
    ) -> Result<Self, TokenizerError> {
        let mut inner = tokenizers::Tokenizer::from_bytes(tokenizer_json).map_err(|err| {
            TokenizerError::InvalidTokenizerJson {
                file: json_origin.to_path_buf(),
                message: err.to_string(),
            }
        })?;
        // A tokenizer.json may carry the truncation or padding its writer trained with (auto-round
        // leaves `max_length: 256`). A prompt is never cut or padded: one past the context is an
        // error for the engine to report, as in vLLM and llama.cpp.
        inner
            .with_truncation(None)
            .map_err(|err| TokenizerError::InvalidTokenizerJson { file: json_origin.to_path_buf(), message: err.to_string() })?;
        inner.with_padding(None);
        add_declared_tokens(&mut inner, &config, config_origin)?;

        let mut eos_token_ids = Vec::new();
        for token in &config.eos_tokens {
            let id =
                inner
                    .token_to_id(token)
                    .ok_or_else(|| TokenizerError::UnknownSpecialToken {
                        file: config_origin.to_path_buf(),
                        field: "eos_token".to_string(),
                        token: token.clone(),
                    })?;
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }

        let chat_template = match template_override.or(config.chat_template) {
            Some(sources) => Some(ChatTemplate::compile(
                sources,
                config.bos_token.clone(),
                config.eos_tokens.first().cloned(),
            )?),
            None => None,
        };

        let vocab_size = inner.get_vocab_size(true);
        Ok(Tokenizer {
            inner,
            vocab_size,
            eos_token_ids,
            chat_template,
            model_vocab_size: 0,
        })
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        // `encode_fast` skips the character offsets, which generation never uses.
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|err| TokenizerError::Encode {
                message: err.to_string(),
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Fails on an id outside the vocabulary instead of dropping it silently,
    /// as `tokenizers` would: such an id means the model's output and the
    /// tokenizer disagree, and silently missing text hides that.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        for &id in ids {
            self.check_id(id)?;
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|err| TokenizerError::Decode {
                message: err.to_string(),
            })
    }

    /// Number of distinct tokens, added tokens included. The model's embedding
    /// table may be larger (padded); ids beyond this are not tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token's text as the vocabulary spells it (byte-level BPE writes a
    /// leading space as `Ġ`), not the text it decodes to.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Ids that end generation, from `eos_token` in `tokenizer_config.json`.
    /// Empty when the model has no config.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_ids.clone()
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders a conversation into the prompt text the model was trained on.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        self.apply_chat_template_with(messages, add_generation_prompt, tools, &serde_json::Map::new())
    }

    /// [`Self::apply_chat_template`] with further template variables (`chat_template_kwargs`
    /// in the OpenAI-compatible API, e.g. `{"enable_thinking": false}`).
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or(TokenizerError::NoChatTemplate)?;
        template.render(messages, add_generation_prompt, tools, extra)
    }

    /// The source of the chat template a conversation with (or without) tools is rendered
    /// by; its conventions (tool-call syntax, reasoning blocks) are read from it.
    pub fn chat_template_source(&self, has_tools: bool) -> Option<&str> {
        self.chat_template.as_ref().and_then(|template| template.source(has_tools).ok())
    }

    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special_tokens)
    }

    /// Decodes every id below `rows`, the model's embedding rows, that the vocabulary lacks as
    /// nothing, as llama.cpp does: checkpoints pad their embedding beyond the tokenizer (a 9B
    /// GGUF has 248320 rows for 151669 tokens, the rest `[PAD…]`), and a model may generate
    /// such an id. Ids at or past `rows` still fail: the model cannot have produced them.
    pub fn with_model_vocab_size(mut self, rows: usize) -> Self {
        self.model_vocab_size = rows;
        self
    }

    fn check_id(&self, id: u32) -> Result<(), TokenizerError> {
        match self.inner.id_to_token(id) {
            Some(_) => Ok(()),
            None if (id as usize) < self.model_vocab_size => Ok(()),
            None => Err(TokenizerError::UnknownTokenId {
                id,
                vocab_size: self.vocab_size,
            }),
        }
    }
}

fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, TokenizerError> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Makes the tokenizer agree with `added_tokens_decoder`. Usually every entry
/// is already in `tokenizer.json`; one that is missing is added, and must land
/// on its declared id, since the model's embeddings are indexed by that id.
fn add_declared_tokens(
    inner: &mut tokenizers::Tokenizer,
    config: &TokenizerConfig,
    config_origin: &Path,
) -> Result<(), TokenizerError> {
    for declared in &config.added_tokens {
        if inner.token_to_id(&declared.content).is_none() {
            let token = AddedToken::from(declared.content.clone(), declared.special)
                .lstrip(declared.lstrip)
                .rstrip(declared.rstrip)
                .single_word(declared.single_word)
                .normalized(declared.normalized);
            if declared.special {
                inner.add_special_tokens(&[token]);
            } else {
                inner.add_tokens(&[token]);
            }
        }
        match inner.token_to_id(&declared.content) {
            Some(actual_id) if actual_id == declared.id => {}
            actual => {
                return Err(TokenizerError::AddedTokenIdMismatch {
                    file: config_origin.to_path_buf(),
                    token: declared.content.clone(),
                    declared_id: declared.id,
                    actual_id: actual.unwrap_or(u32::MAX),
                })
            }
        }
    }
    Ok(())
}
