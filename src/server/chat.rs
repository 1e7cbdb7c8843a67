//! `POST /v1/chat/completions`: the conversation goes through the model's chat template; output
//! streams as `chat.completion.chunk` events or returns as one `chat.completion`, with `n`
//! choices generated side by side.
//!
//! A thinking model's reasoning comes back as `reasoning_content`, apart from its answer; tool
//! calls in the answer come back as `tool_calls`. `tool_choice` "required" or a named function,
//! `response_format` and `grammar` hold the output to a grammar.

use super::error::{ApiError, ApiJson};
use super::generation::{self, Emitted, Ending};
use super::generation_options::ToolChoice;
use super::logprobs_json::{self, TokenNames};
use super::output_text::{OutputParsing, OutputText};
use super::protocol::{max_tokens, ChatCompletionRequest};
use super::ServerState;
use crate::chat_format::tool_grammar::forced_call_grammar;
use crate::chat_format::{prompt_opens_reasoning, ChatFormat, OutputPiece, ParsedToolCall, ToolSchemas};
use crate::engine::logits::grammar::GrammarSpec;
use crate::engine::logits::logprobs::TokenLogprob;
use crate::engine::logits::LogitsOptions;
use crate::engine::request::Request;
use crate::engine::worker::Generation;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedSender;

/// Everything about one chat response that its chunks repeat, and how its text is read.
#[derive(Clone)]
struct ChatResponse {
    id: String,
    created: u64,
    model: String,
    stops: Vec<String>,
    /// Split reasoning off (`Some(opened_in_prompt)`) for a thinking model.
    reasoning: Option<bool>,
    tools: Option<ToolSchemas>,
    logprobs: bool,
    token_ids: bool,
}

impl ChatResponse {
    fn chunk(&self, index: usize, delta: Value, logprobs: Option<Value>, finish_reason: Option<&str>) -> Value {
        let logprobs = logprobs.map(|content| json!({"content": content}));
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        })
    }

    fn usage_chunk(&self, usage: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": [], "usage": usage})
    }

    fn names<'t>(&self, state: &'t ServerState) -> TokenNames<'t> {
        TokenNames { tokenizer: &state.files.tokenizer, as_ids: self.token_ids }
    }

    fn output<'t>(&self, state: &'t ServerState) -> OutputText<'t> {
        OutputText::new(&state.files.tokenizer, self.stops.clone(), OutputParsing { reasoning: self.reasoning, tool_calls: self.tools.clone() })
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
    let choices = body.fields.choices()?;
    let params = body.fields.sampling(rand::random(), &state.sampling_defaults)?;
    let stops = body.fields.stop_strings()?;
    let spec = body.fields.spec_method()?;
    let tool_choice = body.tool_choice()?;
    let tools = body.active_tools();
    let messages = body.chat_messages()?;
    let kwargs = body.chat_template_kwargs.clone().unwrap_or_default();

    let tokenizer = &state.files.tokenizer;
    let prompt = tokenizer
        .apply_chat_template_with(&messages, true, tools.as_ref(), &kwargs)
        .map_err(|err| ApiError::invalid_param("messages", format!("cannot apply the chat template: {err}")))?;
    let format = ChatFormat::of(tokenizer, tools.is_some());
    let reasoning_open = format.thinking && prompt_opens_reasoning(&prompt);
    let prompt_ids = tokenizer.encode(&prompt, false).map_err(|err| ApiError::invalid_param("messages", format!("cannot tokenize the conversation: {err}")))?;
    let prompt_tokens = prompt_ids.len();
    let requested = body.max_completion_tokens.or(body.fields.max_tokens);
    let param = if body.max_completion_tokens.is_some() { "max_completion_tokens" } else { "max_tokens" };
    let max_tokens = max_tokens(requested, param, state.room_after(prompt_tokens, "messages")?)?;

    let ignore_eos = body.fields.ignore_eos == Some(true);
    let stop_token_ids = if ignore_eos { Vec::new() } else { state.files.chat_stop_token_ids() };
    let forced = matches!(tool_choice, ToolChoice::Required | ToolChoice::Function(_));
    let grammar = match (body.fields.grammar_spec()?, forced) {
        (Some((_, param)), true) => return Err(ApiError::invalid_param(param, "a forced tool call (tool_choice) cannot be combined with response_format or grammar")),
        (Some((spec, param)), false) => Some((spec, param)),
        (None, true) => Some((GrammarSpec::Lark(forced_call_grammar(format.tool_calls, &body.forced_tools(&tool_choice))), "tool_choice")),
        (None, false) => None,
    };
    let grammar = match grammar {
        Some((_, param)) if ignore_eos => return Err(ApiError::invalid_param("ignore_eos", format!("ignore_eos cannot be combined with {param}: the grammar ends the output"))),
        Some((spec, param)) => Some(state.compile_grammar(spec, param, stop_token_ids.clone(), reasoning_open).await?),
        None => None,
    };
    let logits = LogitsOptions {
        penalties: body.fields.penalties()?,
        logit_bias: body.fields.logit_bias(state.files.config.vocab_size)?,
        logprobs: body.logprobs_top()?,
        grammar,
    };

    let request = Request { spec, logits, ..Request::new(prompt_ids, params, max_tokens, stop_token_ids) };
    let generations = generation::start_choices(&state, request, choices, "messages").await?;
    let response = ChatResponse {
        id: generation::response_id("chatcmpl"),
        created: generation::unix_seconds(),
        model: state.model_name.to_string(),
        stops,
        reasoning: format.thinking.then_some(reasoning_open),
        tools: tools.as_ref().map(ToolSchemas::from_tools),
        logprobs: body.logprobs == Some(true),
        token_ids: body.fields.return_tokens_as_token_ids,
    };
    if body.fields.stream {
        Ok(stream_response(state, generations, response, prompt_tokens, body.fields.include_usage()))
    } else {
        whole_response(state, generations, response, prompt_tokens).await
    }
}

/// One choice of a whole response, as it ends.
#[derive(Default)]
struct WholeChoice {
    content: String,
    reasoning: String,
    tool_calls: Vec<Value>,
    logprobs: Vec<TokenLogprob>,
}

async fn whole_response(state: ServerState, generations: Vec<Generation>, response: ChatResponse, prompt_tokens: usize) -> Result<Response, ApiError> {
    // Dropping the set (the client left) aborts every choice, which cancels its request.
    let mut tasks = tokio::task::JoinSet::new();
    for (index, generation) in generations.into_iter().enumerate() {
        let (state, response) = (state.clone(), response.clone());
        tasks.spawn(async move {
            let mut output = response.output(&state);
            let mut choice = WholeChoice::default();
            let emit = |emitted: Emitted| {
                choice.logprobs.extend(emitted.logprobs);
                for piece in emitted.pieces {
                    match piece {
                        OutputPiece::Text(text) => choice.content.push_str(&text),
                        OutputPiece::Reasoning(text) => choice.reasoning.push_str(&text),
                        OutputPiece::ToolCall(call) => choice.tool_calls.push(tool_call_json(choice.tool_calls.len(), &call)),
                    }
                }
            };
            let ending = generation::drive(generation, &mut output, std::future::pending(), emit).await?.ok_or_else(|| ApiError::internal("the generation ended early"))?;
            Ok::<_, ApiError>((index, choice, ending))
        });
    }
    let mut finished = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        finished.push(joined.map_err(|err| ApiError::internal(format!("a choice failed: {err}")))??);
    }
    finished.sort_by_key(|(index, _, _)| *index);
    let usage = generation::usage_json(prompt_tokens, finished.iter().map(|(.., ending)| ending));
    let names = response.names(&state);
    let choices: Vec<Value> = finished
        .into_iter()
        .map(|(index, choice, ending)| {
            let mut message = json!({"role": "assistant", "content": choice.content});
            if !choice.reasoning.is_empty() {
                message["reasoning_content"] = Value::String(choice.reasoning);
            }
            if !choice.tool_calls.is_empty() {
                if choice.content.trim().is_empty() {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = Value::Array(choice.tool_calls);
            }
            let logprobs = response.logprobs.then(|| json!({"content": logprobs_json::chat_content(names, &choice.logprobs)}));
            json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": ending.finish_reason})
        })
        .collect();
    Ok(Json(json!({
        "id": response.id, "object": "chat.completion", "created": response.created, "model": response.model,
        "choices": choices,
        "usage": usage,
    }))
    .into_response())
}

fn stream_response(state: ServerState, generations: Vec<Generation>, response: ChatResponse, prompt_tokens: usize, include_usage: bool) -> Response {
    let (events, events_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut tasks = tokio::task::JoinSet::new();
        for (index, generation) in generations.into_iter().enumerate() {
            generation::send_json(&events, &response.chunk(index, json!({"role": "assistant", "content": ""}), None, None));
            let (state, response, events) = (state.clone(), response.clone(), events.clone());
            tasks.spawn(async move { stream_choice(&state, index, generation, &response, &events).await });
        }
        let Some(endings) = generation::finish_choices(tasks, &events).await else { return };
        if include_usage {
            generation::send_json(&events, &response.usage_chunk(generation::usage_json(prompt_tokens, &endings)));
        }
        generation::send_done(&events);
    });
    generation::sse_response(events_rx)
}

/// Streams one choice's deltas. Log probabilities ride on the first chunk of the text their
/// tokens made; tokens that made no text yet (a partial character, a held-back tag) wait for
/// the next chunk, or the choice's last.
async fn stream_choice(state: &ServerState, index: usize, generation: Generation, response: &ChatResponse, events: &UnboundedSender<axum::response::sse::Event>) -> Result<Option<Ending>, ApiError> {
    let names = response.names(state);
    let mut output = response.output(state);
    let mut tool_index = 0;
    let mut pending_logprobs: Vec<TokenLogprob> = Vec::new();
    let emit = |emitted: Emitted| {
        pending_logprobs.extend(emitted.logprobs);
        for piece in emitted.pieces {
            let delta = match piece {
                OutputPiece::Text(text) => json!({"content": text}),
                OutputPiece::Reasoning(text) => json!({"reasoning_content": text}),
                OutputPiece::ToolCall(call) => {
                    tool_index += 1;
                    json!({"tool_calls": [tool_call_json(tool_index - 1, &call)]})
                }
            };
            let logprobs = response.logprobs.then(|| logprobs_json::chat_content(names, &std::mem::take(&mut pending_logprobs)));
            generation::send_json(events, &response.chunk(index, delta, logprobs, None));
        }
    };
    let ending = generation::drive(generation, &mut output, events.closed(), emit).await?;
    if let Some(ending) = ending {
        let logprobs = response.logprobs.then(|| logprobs_json::chat_content(names, &pending_logprobs));
        generation::send_json(events, &response.chunk(index, json!({}), logprobs, Some(ending.finish_reason)));
    }
    Ok(ending)
}
