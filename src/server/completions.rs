//! `POST /v1/completions`: raw text (or token ids) in, a continuation out, with `n` choices,
//! `echo` (the prompt before the continuation) and the legacy `logprobs`.

use super::error::{ApiError, ApiJson};
use super::generation::{self, Emitted, Ending};
use super::logprobs_json::{self, TokenNames};
use super::output_text::{OutputParsing, OutputText};
use super::protocol::{max_tokens, CompletionRequest, Prompt};
use super::ServerState;
use crate::chat_format::OutputPiece;
use crate::engine::logits::logprobs::TokenLogprob;
use crate::engine::logits::LogitsOptions;
use crate::engine::request::Request;
use crate::engine::worker::Generation;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// The legacy completions API generates 16 tokens unless told otherwise.
const DEFAULT_MAX_TOKENS: usize = 16;

#[derive(Clone)]
struct CompletionResponse {
    id: String,
    created: u64,
    model: String,
    stops: Vec<String>,
    /// `echo`: the prompt's text, put before each choice's continuation.
    echo: Option<String>,
    logprobs: bool,
    token_ids: bool,
}

impl CompletionResponse {
    fn chunk(&self, index: usize, text: &str, logprobs: Option<Value>, finish_reason: Option<&str>) -> Value {
        json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        })
    }
}

fn text_of(pieces: Vec<OutputPiece>) -> String {
    pieces.into_iter().filter_map(|piece| if let OutputPiece::Text(text) = piece { Some(text) } else { None }).collect()
}

pub async fn completions(State(state): State<ServerState>, ApiJson(body): ApiJson<CompletionRequest>) -> Result<Response, ApiError> {
    state.check_model(&body.fields.model)?;
    body.check_unsupported()?;
    let choices = body.fields.choices()?;
    let params = body.fields.sampling(rand::random(), &state.sampling_defaults)?;
    let stops = body.fields.stop_strings()?;
    let spec = body.fields.spec_method()?;
    let logprobs = body.logprobs_top()?;
    let echo = body.echo == Some(true);
    let tokenizer = &state.files.tokenizer;
    let (prompt_ids, prompt_text) = match body.prompt.into_single()? {
        Prompt::Text(text) => (tokenizer.encode(&text, false).map_err(|err| ApiError::invalid_param("prompt", format!("cannot tokenize the prompt: {err}")))?, text),
        Prompt::Tokens(ids) => {
            let text = if echo { tokenizer.decode(&ids, false).map_err(|err| ApiError::invalid_param("prompt", format!("cannot decode the prompt: {err}")))? } else { String::new() };
            (ids, text)
        }
    };
    let prompt_tokens = prompt_ids.len();
    let room = state.room_after(prompt_tokens, "prompt")?;
    let max_tokens = max_tokens(body.fields.max_tokens, "max_tokens", DEFAULT_MAX_TOKENS.min(room))?;

    let ignore_eos = body.fields.ignore_eos == Some(true);
    let stop_token_ids = if ignore_eos { Vec::new() } else { state.files.config.eos_token_ids.clone() };
    let grammar = match body.fields.grammar_spec()? {
        Some((_, param)) if ignore_eos => return Err(ApiError::invalid_param("ignore_eos", format!("ignore_eos cannot be combined with {param}: the grammar ends the output"))),
        Some((spec, param)) => Some(state.compile_grammar(spec, param, stop_token_ids.clone(), false).await?),
        None => None,
    };
    let logits = LogitsOptions {
        penalties: body.fields.penalties()?,
        logit_bias: body.fields.logit_bias(state.files.config.vocab_size)?,
        logprobs,
        grammar,
    };
    let request = Request { spec, logits, ..Request::new(prompt_ids, params, max_tokens, stop_token_ids) };
    let generations = generation::start_choices(&state, request, choices, "prompt").await?;
    let response = CompletionResponse {
        id: generation::response_id("cmpl"),
        created: generation::unix_seconds(),
        model: state.model_name.to_string(),
        stops,
        echo: echo.then_some(prompt_text),
        logprobs: logprobs.is_some(),
        token_ids: body.fields.return_tokens_as_token_ids,
    };
    if body.fields.stream {
        Ok(stream_response(state, generations, response, prompt_tokens, body.fields.include_usage()))
    } else {
        whole_response(state, generations, response, prompt_tokens).await
    }
}

async fn whole_response(state: ServerState, generations: Vec<Generation>, response: CompletionResponse, prompt_tokens: usize) -> Result<Response, ApiError> {
    let mut tasks = tokio::task::JoinSet::new();
    for (index, generation) in generations.into_iter().enumerate() {
        let (state, response) = (state.clone(), response.clone());
        tasks.spawn(async move {
            let mut output = OutputText::new(&state.files.tokenizer, response.stops.clone(), OutputParsing::default());
            let (mut text, mut logprobs) = (response.echo.clone().unwrap_or_default(), Vec::<TokenLogprob>::new());
            let emit = |emitted: Emitted| {
                text.push_str(&text_of(emitted.pieces));
                logprobs.extend(emitted.logprobs);
            };
            let ending = generation::drive(generation, &mut output, std::future::pending(), emit).await?.ok_or_else(|| ApiError::internal("the generation ended early"))?;
            Ok::<_, ApiError>((index, text, logprobs, ending))
        });
    }
    let mut finished = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        finished.push(joined.map_err(|err| ApiError::internal(format!("a choice failed: {err}")))??);
    }
    finished.sort_by_key(|(index, ..)| *index);
    let usage = generation::usage_json(prompt_tokens, finished.iter().map(|(.., ending)| ending));
    let echo_chars = response.echo.as_deref().map_or(0, |e| e.chars().count());
    let choices: Vec<Value> = finished
        .into_iter()
        .map(|(index, text, logprobs, ending)| {
            let logprobs = response.logprobs.then(|| logprobs_json::completion(TokenNames { tokenizer: &state.files.tokenizer, as_ids: response.token_ids }, &logprobs, echo_chars));
            json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": ending.finish_reason})
        })
        .collect();
    Ok(Json(json!({
        "id": response.id, "object": "text_completion", "created": response.created, "model": response.model,
        "choices": choices,
        "usage": usage,
    }))
    .into_response())
}

fn stream_response(state: ServerState, generations: Vec<Generation>, response: CompletionResponse, prompt_tokens: usize, include_usage: bool) -> Response {
    let (events, events_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut tasks = tokio::task::JoinSet::new();
        for (index, generation) in generations.into_iter().enumerate() {
            let (state, response, events) = (state.clone(), response.clone(), events.clone());
            tasks.spawn(async move { stream_choice(&state, index, generation, &response, &events).await });
        }
        let Some(endings) = generation::finish_choices(tasks, &events).await else { return };
        if include_usage {
            let usage = json!({
                "id": response.id, "object": "text_completion", "created": response.created, "model": response.model,
                "choices": [], "usage": generation::usage_json(prompt_tokens, &endings),
            });
            generation::send_json(&events, &usage);
        }
        generation::send_done(&events);
    });
    generation::sse_response(events_rx)
}

/// Streams one choice; log probabilities ride on the chunk of the text their tokens made.
async fn stream_choice(state: &ServerState, index: usize, generation: Generation, response: &CompletionResponse, events: &tokio::sync::mpsc::UnboundedSender<axum::response::sse::Event>) -> Result<Option<Ending>, ApiError> {
    let tokenizer = &state.files.tokenizer;
    let mut output = OutputText::new(tokenizer, response.stops.clone(), OutputParsing::default());
    let mut offset = 0;
    if let Some(echo) = response.echo.as_deref().filter(|e| !e.is_empty()) {
        generation::send_json(events, &response.chunk(index, echo, None, None));
        offset = echo.chars().count();
    }
    let names = TokenNames { tokenizer, as_ids: response.token_ids };
    let mut pending: Vec<TokenLogprob> = Vec::new();
    let emit = |emitted: Emitted| {
        pending.extend(emitted.logprobs);
        let text = text_of(emitted.pieces);
        if text.is_empty() {
            return;
        }
        let logprobs = response.logprobs.then(|| logprobs_json::completion(names, &std::mem::take(&mut pending), offset));
        offset += text.chars().count();
        generation::send_json(events, &response.chunk(index, &text, logprobs, None));
    };
    let ending = generation::drive(generation, &mut output, events.closed(), emit).await?;
    if let Some(ending) = ending {
        let logprobs = response.logprobs.then(|| logprobs_json::completion(names, &pending, offset));
        generation::send_json(events, &response.chunk(index, "", logprobs, Some(ending.finish_reason)));
    }
    Ok(ending)
}
