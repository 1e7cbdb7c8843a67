//! The OpenAI request bodies this server accepts, and their checks.
//!
//! Fields the engine cannot honour (`best_of`, `suffix`, non-text content parts) are refused
//! with a 400 that names them, rather than ignored: a client that asked for them would otherwise
//! get an answer that silently differs from what it requested. What penalties, logit bias,
//! grammars and log probabilities turn into is in [`super::generation_options`].

use super::error::ApiError;
use crate::engine::request::SpecMethod;
use crate::backend::sampling::SamplingParams;
use crate::tokenizer::ChatMessage;
use serde::Deserialize;
use serde_json::Value;

/// Fields shared by `/v1/completions` and `/v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct GenerationFields {
    pub model: String,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Not in the OpenAI API, but accepted by most local servers; 0 or -1 turns it off.
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub n: Option<i64>,
    pub stop: Option<StopField>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// vLLM's and Hugging Face's name; `repeat_penalty` is llama.cpp's.
    pub repetition_penalty: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub logit_bias: Option<Value>,
    /// Keep generating past the end-of-sequence token (to `max_tokens`).
    pub ignore_eos: Option<bool>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`.
    pub response_format: Option<Value>,
    /// Extension: a grammar in llguidance's Lark syntax the output must follow.
    pub grammar: Option<String>,
    /// vLLM's: name tokens in log probabilities `token_id:ID` rather than by their text.
    #[serde(default)]
    pub return_tokens_as_token_ids: bool,
    /// Kestrel extension: the speculation method of this request (`none`, `ngram`, `mtp`).
    pub spec: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub messages: Vec<RequestMessage>,
    pub max_completion_tokens: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// Further chat-template variables, e.g. `{"enable_thinking": false}`.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(flatten)]
    pub fields: GenerationFields,
}

#[derive(Debug, Deserialize)]
pub struct RequestMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
    pub tool_calls: Option<Value>,
    pub name: Option<String>,
    pub reasoning_content: Option<String>,
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptField,
    pub echo: Option<bool>,
    pub logprobs: Option<Value>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub fields: GenerationFields,
}

/// A completion prompt: text or token ids, alone or in a list of one.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    TextList(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// A prompt after the checks: what to tokenize, or tokens already.
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

impl PromptField {
    pub fn into_single(self) -> Result<Prompt, ApiError> {
        let several = || ApiError::invalid_param("prompt", "only one prompt per request is supported (batch prompts into separate requests)");
        match self {
            PromptField::Text(text) => Ok(Prompt::Text(text)),
            PromptField::Tokens(ids) => Ok(Prompt::Tokens(ids)),
            PromptField::TextList(mut list) if list.len() == 1 => Ok(Prompt::Text(list.remove(0))),
            PromptField::TokenLists(mut list) if list.len() == 1 => Ok(Prompt::Tokens(list.remove(0))),
            PromptField::TextList(_) | PromptField::TokenLists(_) => Err(several()),
        }
    }
}

impl GenerationFields {
    /// Refuses what the engine cannot do and returns the sampling parameters.
    /// `default_seed` is used when the request names none, so unseeded requests differ.
    pub fn sampling(&self, default_seed: u64) -> Result<SamplingParams, ApiError> {
        // OpenAI's default temperature is 1.
        let temperature = self.temperature.unwrap_or(1.0);
        if !temperature.is_finite() || !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid_param("temperature", format!("temperature must be between 0 and 2, got {temperature}")));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid_param("top_p", format!("top_p must be in (0, 1], got {top_p}")));
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => return Err(ApiError::invalid_param("top_k", format!("top_k must be positive, or -1 or 0 for no limit; got {k}"))),
        };
        // Any 64-bit integer is a valid seed; negative ones are reinterpreted, not refused.
        let seed = self.seed.map(|s| s as u64).unwrap_or(default_seed);
        Ok(SamplingParams { temperature, top_k, top_p, seed })
    }

    pub fn stop_strings(&self) -> Result<Vec<String>, ApiError> {
        let stops = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(list)) => list.clone(),
        };
        if stops.len() > 4 {
            return Err(ApiError::invalid_param("stop", format!("at most 4 stop sequences are allowed, got {}", stops.len())));
        }
        Ok(stops)
    }

    pub fn spec_method(&self) -> Result<Option<SpecMethod>, ApiError> {
        self.spec.as_deref().map(|name| name.parse().map_err(|message: String| ApiError::invalid_param("spec", message))).transpose()
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|options| options.include_usage)
    }
}

/// `max_tokens` from the request, or `default` when it names none.
pub fn max_tokens(requested: Option<i64>, param: &str, default: usize) -> Result<usize, ApiError> {
    match requested {
        None => Ok(default),
        Some(n) if n >= 1 => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(n) => Err(ApiError::invalid_param(param, format!("{param} must be at least 1, got {n}"))),
    }
}

impl ChatCompletionRequest {
    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid_param("messages", "messages must not be empty"));
        }
        Ok(())
    }

    /// The tools to show the model, unless `tool_choice` is `"none"`.
    pub fn active_tools(&self) -> Option<Value> {
        let tools = self.tools.as_ref().filter(|tools| !tools.is_empty())?;
        if self.tool_choice.as_ref().and_then(Value::as_str) == Some("none") {
            return None;
        }
        Some(Value::Array(tools.clone()))
    }

    /// The conversation as the chat template sees it.
    pub fn chat_messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        self.messages.iter().enumerate().map(|(i, m)| m.to_chat_message(i)).collect()
    }
}

impl RequestMessage {
    pub fn to_chat_message(&self, index: usize) -> Result<ChatMessage, ApiError> {
        let param = format!("messages[{index}]");
        let role = match self.role.as_str() {
            "system" | "user" | "assistant" | "tool" => self.role.clone(),
            // The newer name of the system role.
            "developer" => "system".to_string(),
            other => return Err(ApiError::invalid_param(&param, format!("unknown role `{other}` (expected system, user, assistant or tool)"))),
        };
        let content = match &self.content {
            None => String::new(),
            Some(MessageContent::Text(text)) => text.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(piece)) => text.push_str(piece),
                        (kind, _) => return Err(ApiError::invalid_param(&param, format!("content parts of type `{kind}` are not supported (text only)"))),
                    }
                }
                text
            }
        };
        let tool_calls = self.tool_calls.clone().filter(|calls| !calls.is_null()).map(arguments_as_objects);
        Ok(ChatMessage { role, content, tool_calls, name: self.name.clone(), reasoning_content: self.reasoning_content.clone(), tool_call_id: self.tool_call_id.clone() })
    }
}

/// OpenAI clients send a call's arguments as a JSON string; chat templates (Qwen3.5's iterates
/// `arguments|items`) expect the object, as transformers passes it. Arguments that are not a
/// JSON object stay as they are.
fn arguments_as_objects(mut calls: Value) -> Value {
    for call in calls.as_array_mut().into_iter().flatten() {
        let function = call.get_mut("function").filter(|f| f.is_object());
        let Some(arguments) = function.and_then(|f| f.get_mut("arguments")) else { continue };
        if let Some(Value::Object(object)) = arguments.as_str().and_then(|text| serde_json::from_str(text).ok()) {
            *arguments = Value::Object(object);
        }
    }
    calls
}

impl CompletionRequest {
    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid_param("best_of", "best_of must be 1"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid_param("suffix", "suffix (fill-in-the-middle) is not supported"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: serde_json::Value) -> GenerationFields {
        serde_json::from_value(json).expect("valid fields")
    }

    #[test]
    fn defaults_follow_openai() {
        let params = fields(serde_json::json!({"model": "m"})).sampling(7).expect("valid");
        assert_eq!(params, SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 7 });
    }

    #[test]
    fn out_of_range_values_name_their_field() {
        for (body, param) in [
            (serde_json::json!({"model": "m", "temperature": 3.0}), "temperature"),
            (serde_json::json!({"model": "m", "top_p": 0.0}), "top_p"),
            (serde_json::json!({"model": "m", "top_k": -5}), "top_k"),
        ] {
            let err = fields(body).sampling(0).expect_err("refused");
            assert_eq!(err.param.as_deref(), Some(param));
        }
    }

    #[test]
    fn prompt_lists_of_one_are_accepted() {
        let prompt: PromptField = serde_json::from_value(serde_json::json!(["hi"])).expect("parses");
        assert!(matches!(prompt.into_single(), Ok(Prompt::Text(t)) if t == "hi"));
        let prompt: PromptField = serde_json::from_value(serde_json::json!([[1, 2]])).expect("parses");
        assert!(matches!(prompt.into_single(), Ok(Prompt::Tokens(t)) if t == vec![1, 2]));
        let prompt: PromptField = serde_json::from_value(serde_json::json!(["a", "b"])).expect("parses");
        assert!(prompt.into_single().is_err());
    }

    #[test]
    fn content_parts_are_joined_and_null_content_is_empty() {
        let request: ChatCompletionRequest = serde_json::from_value(serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
            ]
        }))
        .expect("parses");
        let messages = request.chat_messages().expect("valid");
        assert_eq!(messages[0].content, "ab");
        assert_eq!(messages[1].content, "");
        assert_eq!(messages[1].tool_calls, Some(serde_json::json!([{"type": "function", "function": {"name": "f", "arguments": {}}}])), "arguments reach the template as an object");
    }
}
