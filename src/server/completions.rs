//! `POST /v1/completions`: raw text (or token ids) in, a continuation out.

use super::error::{ApiError, ApiJson};
use super::generation;
use super::output_text::OutputText;
use super::protocol::{max_tokens, CompletionRequest, Prompt};
use super::tool_calls::OutputPiece;
use super::ServerState;
use crate::engine::request::Request;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// The legacy completions API generates 16 tokens unless told otherwise.
const DEFAULT_MAX_TOKENS: usize = 16;

struct CompletionResponse {
    id: String,
    created: u64,
    model: String,
}

impl CompletionResponse {
    fn chunk(&self, text: &str, finish_reason: Option<&str>) -> Value {
        json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason}],
        })
    }
}

pub async fn completions(State(state): State<ServerState>, ApiJson(body): ApiJson<CompletionRequest>) -> Result<Response, ApiError> {
    state.check_model(&body.fields.model)?;
    body.check_unsupported()?;
    let params = body.fields.sampling(rand::random(), &state.sampling_defaults)?;
    let stops = body.fields.stop_strings()?;
    let spec = body.fields.spec_method()?;
    let prompt_ids = match body.prompt.into_single()? {
        Prompt::Text(text) => state.files.tokenizer.encode(&text, false).map_err(|err| ApiError::invalid_param("prompt", format!("cannot tokenize the prompt: {err}")))?,
        Prompt::Tokens(ids) => ids,
    };
    let prompt_tokens = prompt_ids.len();
    let room = state.room_after(prompt_tokens, "prompt")?;
    let max_tokens = max_tokens(body.fields.max_tokens, "max_tokens", DEFAULT_MAX_TOKENS.min(room))?;

    let request = Request { prompt_ids, params, max_tokens, stop_token_ids: state.files.config.eos_token_ids.clone(), spec };
    let generation = generation::start(&state, request, "prompt").await?;
    let response = CompletionResponse { id: generation::response_id("cmpl"), created: generation::unix_seconds(), model: state.model_name.to_string() };

    if !body.fields.stream {
        let mut output = OutputText::new(&state.files.tokenizer, stops, false);
        let mut text = String::new();
        let emit = |piece: OutputPiece| {
            if let OutputPiece::Text(piece) = piece {
                text.push_str(&piece);
            }
        };
        let ending = generation::drive(generation, &mut output, std::future::pending(), emit).await?.ok_or_else(|| ApiError::internal("the generation ended early"))?;
        let mut whole = response.chunk(&text, Some(ending.finish_reason));
        whole["usage"] = generation::usage_json(prompt_tokens, &ending);
        return Ok(Json(whole).into_response());
    }

    let include_usage = body.fields.include_usage();
    let (events, events_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut output = OutputText::new(&state.files.tokenizer, stops, false);
        let emit = |piece: OutputPiece| {
            if let OutputPiece::Text(text) = piece {
                generation::send_json(&events, &response.chunk(&text, None));
            }
        };
        match generation::drive(generation, &mut output, events.closed(), emit).await {
            Ok(Some(ending)) => {
                generation::send_json(&events, &response.chunk("", Some(ending.finish_reason)));
                if include_usage {
                    let usage = json!({
                        "id": response.id, "object": "text_completion", "created": response.created, "model": response.model,
                        "choices": [], "usage": generation::usage_json(prompt_tokens, &ending),
                    });
                    generation::send_json(&events, &usage);
                }
                generation::send_done(&events);
            }
            Ok(None) => {}
            Err(err) => generation::send_error(&events, &err),
        }
    });
    Ok(generation::sse_response(events_rx))
}
