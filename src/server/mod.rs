//! The local OpenAI-compatible HTTP server (axum): `/v1/models`, `/v1/completions`,
//! `/v1/chat/completions` (SSE streaming or whole), vLLM's `/tokenize` and `/detokenize`,
//! `/health` and `/metrics`.
//!
//! Handlers run on the tokio runtime and never touch the engine directly: they submit requests to
//! the engine's worker thread ([`crate::engine::worker`]), which batches everything in flight, and receive the tokens back
//! over channels.

mod chat;
mod completions;
pub mod cors;
pub mod error;
mod generation;
pub mod generation_options;
mod logprobs_json;
mod output_text;
pub mod protocol;
mod routes;
mod tokenize;

use crate::engine::logits::grammar::{Grammar, GrammarCompiler, GrammarSpec};
use crate::engine::worker::EngineHandle;
use crate::model::generation_config::SamplingDefaults;
use crate::model::ModelFiles;
use error::{ApiError, BodyLimit};
use std::future::Future;
use std::sync::{Arc, OnceLock};

/// The default request body limit: far above any prompt that fits a context, far below memory trouble.
pub const DEFAULT_BODY_LIMIT: usize = 4 * 1024 * 1024;

/// What every handler can reach.
#[derive(Clone)]
pub struct ServerState {
    pub engine: EngineHandle,
    /// The tokenizer, chat template and stop tokens of the served model.
    pub files: Arc<ModelFiles>,
    /// The id clients put in `"model"`.
    pub model_name: Arc<str>,
    /// When set, `/v1/*` and `/metrics` need `Authorization: Bearer <key>`.
    pub api_key: Option<Arc<str>>,
    pub body_limit: BodyLimit,
    /// Unix seconds, reported as the model's `created`.
    pub started_at: u64,
    /// Built on the first request with a grammar (the token table takes a moment).
    grammars: Arc<OnceLock<Result<Arc<GrammarCompiler>, String>>>,
    /// What requests that leave temperature, top_p, top_k or min_p unset get (the model's
    /// generation_config.json, unless the server ignores it).
    pub sampling_defaults: SamplingDefaults,
    /// Origins browsers may call from (CORS); `*` for any, empty for none.
    pub allowed_origins: Vec<String>,
}

impl axum::extract::FromRef<ServerState> for BodyLimit {
    fn from_ref(state: &ServerState) -> BodyLimit {
        state.body_limit
    }
}

impl ServerState {
    pub fn new(engine: EngineHandle, files: Arc<ModelFiles>, model_name: &str, api_key: Option<&str>) -> Self {
        let sampling_defaults = files.sampling_defaults.clone();
        ServerState {
            engine,
            files,
            model_name: Arc::from(model_name),
            api_key: api_key.map(Arc::from),
            body_limit: BodyLimit(DEFAULT_BODY_LIMIT),
            started_at: generation::unix_seconds(),
            grammars: Arc::new(OnceLock::new()),
            sampling_defaults,
            allowed_origins: Vec::new(),
        }
    }

    /// Compiles a request's grammar (`param` names the field it came from) for a request that
    /// ends at `end_tokens`. With `after_reasoning` it applies from the end of the `<think>`
    /// block the prompt opened. Runs off the async threads: the first grammar builds the token
    /// table, and a large schema takes a while to compile.
    async fn compile_grammar(&self, spec: GrammarSpec, param: &'static str, end_tokens: Vec<u32>, after_reasoning: bool) -> Result<Grammar, ApiError> {
        let (files, grammars) = (self.files.clone(), self.grammars.clone());
        let compiled = tokio::task::spawn_blocking(move || {
            let compiler = grammars
                .get_or_init(|| GrammarCompiler::new(&files.tokenizer, files.config.vocab_size, &files.chat_stop_token_ids()).map(Arc::new).map_err(|e| e.to_string()))
                .clone()
                .map_err(|message| ApiError::internal(format!("grammars are unavailable for this model: {message}")))?;
            let grammar = compiler.compile(&spec, &end_tokens).map_err(|err| ApiError::invalid_param(param, format!("the {param} cannot be compiled: {err}")))?;
            Ok(match compiler.single_token(crate::chat_format::reasoning::THINK_CLOSE).filter(|_| after_reasoning) {
                Some(think_end) => grammar.starting_after(think_end),
                None => grammar,
            })
        })
        .await;
        compiled.map_err(|err| ApiError::internal(format!("the grammar compiler failed: {err}")))?
    }

    fn check_model(&self, requested: &str) -> Result<(), ApiError> {
        if requested == &*self.model_name {
            Ok(())
        } else {
            Err(ApiError::unknown_model(requested, &self.model_name))
        }
    }

    /// Tokens left in the context after a prompt; refuses a prompt that leaves none.
    fn room_after(&self, prompt_tokens: usize, prompt_param: &str) -> Result<usize, ApiError> {
        let context = self.engine.info().max_model_len;
        if prompt_tokens >= context {
            return Err(ApiError {
                param: Some(prompt_param.to_string()),
                ..ApiError::context_length_exceeded(format!(
                    "the prompt is {prompt_tokens} tokens long, but the context holds {context} tokens, the generated ones included"
                ))
            });
        }
        Ok(context - prompt_tokens)
    }
}

/// The application: every route, the API-key check, the body limit and CORS.
pub fn router(state: ServerState) -> axum::Router {
    routes::router(state)
}

/// Serves until `shutdown` resolves, then finishes the requests in flight.
pub async fn serve(listener: tokio::net::TcpListener, state: ServerState, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await
}
