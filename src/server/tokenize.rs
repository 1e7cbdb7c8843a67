//! `POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt (or a conversation,
//! through the chat template) to token ids, and ids back to text.

use super::error::{ApiError, ApiJson, RequestBody};
use super::protocol::RequestMessage;
use super::ServerState;
use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    /// Text to tokenize; or `messages`, rendered by the chat template first.
    pub prompt: Option<String>,
    pub messages: Option<Vec<RequestMessage>>,
    /// With `messages`: end with the assistant's generation prompt (default true).
    pub add_generation_prompt: Option<bool>,
    /// Add the tokenizer's special tokens (a BOS token, for models that use one).
    pub add_special_tokens: Option<bool>,
    pub tools: Option<Vec<Value>>,
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Also return each token's text.
    #[serde(default)]
    pub return_token_strs: bool,
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

impl RequestBody for TokenizeRequest {
    fn locate_error(_body: &Value) -> Option<String> {
        None
    }
}

impl RequestBody for DetokenizeRequest {
    fn locate_error(_body: &Value) -> Option<String> {
        None
    }
}

pub async fn tokenize(State(state): State<ServerState>, ApiJson(body): ApiJson<TokenizeRequest>) -> Result<Json<Value>, ApiError> {
    if let Some(model) = &body.model {
        state.check_model(model)?;
    }
    let tokenizer = &state.files.tokenizer;
    let (text, add_special) = match (&body.prompt, &body.messages) {
        (Some(_), Some(_)) => return Err(ApiError::invalid_param("messages", "give either prompt or messages, not both")),
        (Some(prompt), None) => (prompt.clone(), body.add_special_tokens.unwrap_or(true)),
        (None, Some(messages)) => {
            let messages = messages.iter().enumerate().map(|(i, m)| m.to_chat_message(i)).collect::<Result<Vec<_>, _>>()?;
            let tools = body.tools.clone().filter(|t| !t.is_empty()).map(Value::Array);
            let kwargs = body.chat_template_kwargs.clone().unwrap_or_default();
            let text = tokenizer
                .apply_chat_template_with(&messages, body.add_generation_prompt.unwrap_or(true), tools.as_ref(), &kwargs)
                .map_err(|err| ApiError::invalid_param("messages", format!("cannot apply the chat template: {err}")))?;
            // The template writes the special tokens itself.
            (text, body.add_special_tokens.unwrap_or(false))
        }
        (None, None) => return Err(ApiError::invalid_param("prompt", "give a prompt or messages")),
    };
    let tokens = tokenizer.encode(&text, add_special).map_err(|err| ApiError::invalid_param("prompt", format!("cannot tokenize: {err}")))?;
    let token_strs = body.return_token_strs.then(|| tokens.iter().map(|&t| String::from_utf8_lossy(&tokenizer.token_bytes(t)).into_owned()).collect::<Vec<_>>());
    Ok(Json(json!({"count": tokens.len(), "max_model_len": state.engine.info().max_model_len, "tokens": tokens, "token_strs": token_strs})))
}

pub async fn detokenize(State(state): State<ServerState>, ApiJson(body): ApiJson<DetokenizeRequest>) -> Result<Json<Value>, ApiError> {
    if let Some(model) = &body.model {
        state.check_model(model)?;
    }
    let prompt = state.files.tokenizer.decode(&body.tokens, false).map_err(|err| ApiError::invalid_param("tokens", err.to_string()))?;
    Ok(Json(json!({ "prompt": prompt })))
}
