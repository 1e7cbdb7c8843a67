//! What the completion endpoints share: submitting to the engine worker, turning its events into
//! response pieces, and the SSE body of a streamed response.

use super::error::ApiError;
use super::generation_options::choice_seed;
use super::output_text::OutputText;
use super::ServerState;
use crate::chat_format::OutputPiece;
use crate::engine::logits::logprobs::TokenLogprob;
use crate::engine::worker::{Generation, GenerationEvent};
use crate::engine::request::{FinishReason, Request};
use crate::engine::EngineError;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use std::convert::Infallible;
use std::future::Future;
use tokio::sync::mpsc::UnboundedSender;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

/// Queues `choices` copies of `request` (choice `i` with its own seed, choice 0 with the
/// request's) so that they share the engine's steps, and waits until every one was accepted, so
/// that a refusal becomes an HTTP error before any streamed byte is sent.
pub async fn start_choices(state: &ServerState, request: Request, choices: usize, prompt_param: &str) -> Result<Vec<Generation>, ApiError> {
    let mut pending = Vec::with_capacity(choices);
    for index in 0..choices {
        let mut choice = request.clone();
        choice.params.seed = choice_seed(request.params.seed, index);
        pending.push(state.engine.submit(choice).map_err(|_| ApiError::engine_unavailable())?);
    }
    let mut started = Vec::with_capacity(choices);
    for mut generation in pending {
        match generation.next().await {
            Some(GenerationEvent::Accepted) => started.push(generation),
            Some(GenerationEvent::Rejected(err)) => return Err(refusal(err, prompt_param)),
            Some(_) | None => return Err(ApiError::engine_unavailable()),
        }
    }
    Ok(started)
}

/// The engine's reasons for refusing a request, as the API reports them.
fn refusal(err: EngineError, prompt_param: &str) -> ApiError {
    let message = err.to_string();
    match err {
        // The prompt fits, so the requested completion length is what does not.
        EngineError::ContextExceeded { prompt, context, .. } if prompt < context => {
            ApiError { param: Some("max_tokens".to_string()), ..ApiError::context_length_exceeded(message) }
        }
        EngineError::ContextExceeded { .. } | EngineError::CacheTooSmall { .. } => {
            ApiError { param: Some(prompt_param.to_string()), ..ApiError::context_length_exceeded(message) }
        }
        EngineError::EmptyPrompt | EngineError::TokenOutOfRange { .. } => ApiError::invalid_param(prompt_param, message),
        EngineError::ZeroMaxTokens => ApiError::invalid_param("max_tokens", message),
        EngineError::Sampling(_) => ApiError::invalid_request(message),
        EngineError::NoMtpHead => ApiError::invalid_param("spec", message),
        EngineError::Config(_) | EngineError::UnknownRequest(_) => ApiError::internal(message),
    }
}

/// How a generation ended, in API terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ending {
    pub finish_reason: &'static str,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// What one engine event added to a choice: its pieces, and the log probabilities of the
/// tokens that made them (when asked for; tokens after a stop string are not counted).
#[derive(Debug, Default)]
pub struct Emitted {
    pub pieces: Vec<OutputPiece>,
    pub logprobs: Vec<TokenLogprob>,
}

/// Runs a generation to its end, handing what each event adds to `emit`. Returns `None` when
/// `client_gone` resolved first; the request is then cancelled as `generation` is dropped.
pub async fn drive(
    mut generation: Generation,
    output: &mut OutputText<'_>,
    client_gone: impl Future<Output = ()>,
    mut emit: impl FnMut(Emitted),
) -> Result<Option<Ending>, ApiError> {
    tokio::pin!(client_gone);
    // Every way out of the loop that reaches the end sets it.
    let mut cached_tokens;
    let engine_reason = loop {
        let event = tokio::select! {
            event = generation.next() => event,
            () = &mut client_gone => return Ok(None),
        };
        match event {
            Some(GenerationEvent::Tokens { tokens, mut logprobs, cached_tokens: cached, .. }) => {
                cached_tokens = cached;
                let before = output.tokens_used();
                let pieces = output.push_tokens(&tokens).map_err(|err| ApiError::internal(format!("cannot decode the output: {err}")))?;
                logprobs.truncate(output.tokens_used() - before);
                emit(Emitted { pieces, logprobs });
                if output.stopped_by_string() {
                    // The rest would be thrown away: free the engine for other requests now.
                    generation.cancel();
                    break FinishReason::Stop;
                }
            }
            Some(GenerationEvent::Finished { reason, summary }) => {
                cached_tokens = summary.cached_tokens;
                break reason;
            }
            // The request alone failed: an error for this client, the server goes on.
            Some(GenerationEvent::Failed { error, .. }) => return Err(ApiError::generation_failed(error.to_string())),
            Some(GenerationEvent::Accepted) | Some(GenerationEvent::Rejected(_)) => {}
            None => return Err(ApiError::engine_unavailable()),
        }
    };
    let pieces = output.finish().map_err(|err| ApiError::internal(format!("cannot decode the output: {err}")))?;
    emit(Emitted { pieces, logprobs: Vec::new() });
    let finish_reason = match engine_reason {
        FinishReason::Length => "length",
        _ if output.tool_calls_seen() > 0 => "tool_calls",
        // Abort only comes from our own cancel after a stop string; a cancelled client is gone.
        FinishReason::Stop | FinishReason::Abort => "stop",
    };
    Ok(Some(Ending { finish_reason, completion_tokens: output.tokens_used(), cached_tokens }))
}

/// Waits for every choice of a streamed request and returns their endings, in the order they
/// ended. `None` means the stream is over: a choice found the client gone (nobody reads the
/// rest), or one failed, which is sent as the stream's error once all have ended.
pub async fn finish_choices(mut tasks: tokio::task::JoinSet<Result<Option<Ending>, ApiError>>, events: &UnboundedSender<Event>) -> Option<Vec<Ending>> {
    let mut endings = Vec::new();
    let mut failure = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(Some(ending))) => endings.push(ending),
            Ok(Ok(None)) => return None,
            Ok(Err(err)) => failure = failure.or(Some(err)),
            Err(err) => failure = failure.or(Some(ApiError::internal(format!("a choice failed: {err}")))),
        }
    }
    match failure {
        Some(err) => {
            send_error(events, &err);
            None
        }
        None => Some(endings),
    }
}

/// An SSE response fed by `events`; the body ends when the sender is dropped.
pub fn sse_response(events: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Response {
    let stream = UnboundedReceiverStream::new(events).map(Ok::<Event, Infallible>);
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

/// Sends one JSON chunk as an SSE `data:` line.
pub fn send_json(events: &UnboundedSender<Event>, value: &serde_json::Value) {
    // A send fails only when the client is gone, which the driver notices by itself.
    let _ = events.send(Event::default().data(value.to_string()));
}

/// The OpenAI end-of-stream marker.
pub fn send_done(events: &UnboundedSender<Event>) {
    let _ = events.send(Event::default().data("[DONE]"));
}

/// Tells a streaming client that the generation failed after the response started: the OpenAI
/// client raises an error on a chunk with an `error` key.
pub fn send_error(events: &UnboundedSender<Event>, error: &ApiError) {
    send_json(events, &error.body());
}

/// A new response id with the given prefix (`chatcmpl`, `cmpl`).
pub fn response_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

pub fn unix_seconds() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The `usage` object of a request whose choices ended as `endings`: the prompt counts once,
/// the completions add up, and `prompt_tokens_details.cached_tokens` is the prompt tokens every
/// choice took from the prefix cache (the fewest over the choices).
pub fn usage_json<'a>(prompt_tokens: usize, endings: impl IntoIterator<Item = &'a Ending>) -> serde_json::Value {
    let (mut completion_tokens, mut cached_tokens) = (0, None::<usize>);
    for ending in endings {
        completion_tokens += ending.completion_tokens;
        cached_tokens = Some(cached_tokens.map_or(ending.cached_tokens, |c| c.min(ending.cached_tokens)));
    }
    serde_json::json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens.unwrap_or(0)},
    })
}
