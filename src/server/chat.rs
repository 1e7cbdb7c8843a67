//! `POST /v1/chat/completions`: the conversation goes through the model's chat template; output
//! streams as `chat.completion.chunk` events or returns as one `chat.completion`.

use super::error::{ApiError, ApiJson};
use super::generation;
use super::output_text::OutputText;
use super::protocol::{max_tokens, ChatCompletionRequest};
use super::tool_calls::{OutputPiece, ParsedToolCall};
use super::ServerState;
use crate::engine::request::Request;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// Everything about one chat response that its chunks repeat.
struct ChatResponse {
    id: String,
    created: u64,
    model: String,
}

impl ChatResponse {
    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Value {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
        })
    }

    fn usage_chunk(&self, usage: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": [], "usage": usage})
    }
}

fn tool_call_json(index: usize, call: &ParsedToolCall) -> Value {
    json!({
        "index": index,
        "id": generation::response_id("call"),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    })
}

pub async fn chat_completions(State(state): State<ServerState>, ApiJson(body): ApiJson<ChatCompletionRequest>) -> Result<Response, ApiError> {
    state.check_model(&body.fields.model)?;
    body.check_unsupported()?;
    let params = body.fields.sampling(rand::random(), &state.sampling_defaults)?;
    let stops = body.fields.stop_strings()?;
    let spec = body.fields.spec_method()?;
    let tools = body.active_tools();
    let messages = body.chat_messages()?;

    let tokenizer = &state.files.tokenizer;
    let prompt = tokenizer.apply_chat_template(&messages, true, tools.as_ref()).map_err(|err| ApiError::invalid_param("messages", format!("cannot apply the chat template: {err}")))?;
    let prompt_ids = tokenizer.encode(&prompt, false).map_err(|err| ApiError::invalid_param("messages", format!("cannot tokenize the conversation: {err}")))?;
    let prompt_tokens = prompt_ids.len();
    let requested = body.max_completion_tokens.or(body.fields.max_tokens);
    let param = if body.max_completion_tokens.is_some() { "max_completion_tokens" } else { "max_tokens" };
    let max_tokens = max_tokens(requested, param, state.room_after(prompt_tokens, "messages")?)?;

    let request = Request { prompt_ids, params, max_tokens, stop_token_ids: state.files.chat_stop_token_ids(), spec };
    let generation = generation::start(&state, request, "messages").await?;
    let response = ChatResponse { id: generation::response_id("chatcmpl"), created: generation::unix_seconds(), model: state.model_name.to_string() };
    let parse_tools = tools.is_some();

    if !body.fields.stream {
        return whole_response(&state, generation, response, stops, parse_tools, prompt_tokens).await;
    }
    let include_usage = body.fields.include_usage();
    let (events, events_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut output = OutputText::new(&state.files.tokenizer, stops, parse_tools);
        generation::send_json(&events, &response.chunk(json!({"role": "assistant", "content": ""}), None));
        let mut tool_index = 0;
        let emit = |piece: OutputPiece| match piece {
            OutputPiece::Text(text) => generation::send_json(&events, &response.chunk(json!({"content": text}), None)),
            OutputPiece::ToolCall(call) => {
                generation::send_json(&events, &response.chunk(json!({"tool_calls": [tool_call_json(tool_index, &call)]}), None));
                tool_index += 1;
            }
        };
        match generation::drive(generation, &mut output, events.closed(), emit).await {
            Ok(Some(ending)) => {
                generation::send_json(&events, &response.chunk(json!({}), Some(ending.finish_reason)));
                if include_usage {
                    generation::send_json(&events, &response.usage_chunk(generation::usage_json(prompt_tokens, &ending)));
                }
                generation::send_done(&events);
            }
            Ok(None) => {}
            Err(err) => generation::send_error(&events, &err),
        }
    });
    Ok(generation::sse_response(events_rx))
}

async fn whole_response(
    state: &ServerState,
    generation: crate::engine::worker::Generation,
    response: ChatResponse,
    stops: Vec<String>,
    parse_tools: bool,
    prompt_tokens: usize,
) -> Result<Response, ApiError> {
    let mut output = OutputText::new(&state.files.tokenizer, stops, parse_tools);
    let mut content = String::new();
    let mut tool_calls = Vec::new();
    let emit = |piece: OutputPiece| match piece {
        OutputPiece::Text(text) => content.push_str(&text),
        OutputPiece::ToolCall(call) => tool_calls.push(tool_call_json(tool_calls.len(), &call)),
    };
    let ending = generation::drive(generation, &mut output, std::future::pending(), emit).await?.ok_or_else(|| ApiError::internal("the generation ended early"))?;
    let mut message = json!({"role": "assistant", "content": content});
    if !tool_calls.is_empty() {
        if content.trim().is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = Value::Array(tool_calls);
    }
    Ok(Json(json!({
        "id": response.id, "object": "chat.completion", "created": response.created, "model": response.model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": ending.finish_reason}],
        "usage": generation::usage_json(prompt_tokens, &ending),
    }))
    .into_response())
}
