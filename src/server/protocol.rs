//! The OpenAI request bodies this server accepts, and their checks.
//!
//! Fields the engine cannot honour (`best_of`, `suffix`, non-text content parts) are refused
//! with a 400 that names them, rather than ignored: a client that asked for them would otherwise
//! get an answer that silently differs from what it requested. What penalties, logit bias,
//! grammars and log probabilities turn into is in [`super::generation_options`].

use super::error::{ApiError, RequestBody};
use crate::backend::sampling::{seed_from_signed, top_k_from_signed, SamplingParams};
use crate::engine::request::SpecMethod;
use crate::model::generation_config::SamplingDefaults;
use crate::tokenizer::ChatMessage;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// `null` reads as the type's default, as OpenAI's API takes it (`"stream": null` is false).
fn null_as_default<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(deserializer: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// Fields shared by `/v1/completions` and `/v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct GenerationFields {
    pub model: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Not in the OpenAI API, but accepted by most local servers; 0 or -1 turns it off.
    pub top_k: Option<i64>,
    /// Not in the OpenAI API either (vLLM and llama.cpp take it); 0 turns it off.
    pub min_p: Option<f32>,
    /// -1 asks for a random seed, as in llama.cpp.
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

/// Where a type error lies among the shared fields, which the request types flatten in.
fn locate_in_generation_fields(body: &Value) -> Option<String> {
    let err = serde_path_to_error::deserialize::<_, GenerationFields>(body).err()?;
    let path = err.path().to_string();
    (path != ".").then_some(path)
}

impl RequestBody for ChatCompletionRequest {
    fn locate_error(body: &Value) -> Option<String> {
        locate_in_generation_fields(body)
    }
}

impl RequestBody for CompletionRequest {
    fn locate_error(body: &Value) -> Option<String> {
        locate_in_generation_fields(body)
    }
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
    /// Refuses what the engine cannot do and returns the sampling parameters: the request's,
    /// else the model's recommendation in `defaults`, else OpenAI's (temperature 1, no filter).
    /// `default_seed` is used when the request names none (or -1), so unseeded requests differ.
    pub fn sampling(&self, default_seed: u64, defaults: &SamplingDefaults) -> Result<SamplingParams, ApiError> {
        let refused = |err: crate::backend::sampling::SamplingError| ApiError::invalid_param(err.field(), err.to_string());
        let top_k = match self.top_k {
            Some(k) => top_k_from_signed(k).map_err(refused)?,
            None => defaults.top_k.unwrap_or(0),
        };
        let params = SamplingParams {
            // OpenAI's default temperature is 1.
            temperature: self.temperature.or(defaults.temperature).unwrap_or(1.0),
            top_p: self.top_p.or(defaults.top_p).unwrap_or(1.0),
            top_k,
            min_p: self.min_p.or(defaults.min_p).unwrap_or(0.0),
            // Any other 64-bit integer is a valid seed; negative ones are reinterpreted, not refused.
            seed: self.seed.and_then(seed_from_signed).unwrap_or(default_seed),
        };
        params.validate().map_err(refused)?;
        Ok(params)
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
        self.check_tools()
    }

    /// `tools` must be function definitions with a name, and `tool_choice` one of OpenAI's forms
    /// naming a listed function: a malformed one is refused, not taken as no tools.
    fn check_tools(&self) -> Result<(), ApiError> {
        let names = match &self.tools {
            None => Vec::new(),
            Some(tools) => tools.iter().enumerate().map(|(i, tool)| tool_name(i, tool)).collect::<Result<Vec<&str>, ApiError>>()?,
        };
        let choice = "tool_choice";
        match &self.tool_choice {
            None | Some(Value::Null) => Ok(()),
            Some(Value::String(mode)) if mode == "none" || mode == "auto" => Ok(()),
            Some(Value::String(mode)) if mode == "required" && names.is_empty() => Err(ApiError::invalid_param(choice, "tool_choice `required` needs `tools`")),
            Some(Value::String(mode)) if mode == "required" => Ok(()),
            Some(Value::Object(named)) => {
                let name = named.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
                match (named.get("type").and_then(Value::as_str), name) {
                    (Some("function"), Some(name)) if names.contains(&name) => Ok(()),
                    (Some("function"), Some(name)) => Err(ApiError::invalid_param(choice, format!("tool_choice names the function `{name}`, which is not in `tools`"))),
                    _ => Err(ApiError::invalid_param(choice, "a tool_choice object must be {\"type\": \"function\", \"function\": {\"name\": ...}}")),
                }
            }
            Some(other) => Err(ApiError::invalid_param(choice, format!("tool_choice must be \"none\", \"auto\", \"required\" or a function to call, got {other}"))),
        }
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

/// The name of `tools[index]`, which must be `{"type": "function", "function": {"name", ...}}`.
fn tool_name(index: usize, tool: &Value) -> Result<&str, ApiError> {
    let param = format!("tools[{index}]");
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::invalid_param(&param, "a tool must have \"type\": \"function\""));
    }
    let Some(function) = tool.get("function").filter(|f| f.is_object()) else {
        return Err(ApiError::invalid_param(&format!("{param}.function"), "a tool needs a `function` object"));
    };
    let name = function.get("name").and_then(Value::as_str).filter(|name| !name.is_empty());
    let Some(name) = name else {
        return Err(ApiError::invalid_param(&format!("{param}.function.name"), "a function needs a name"));
    };
    if function.get("parameters").is_some_and(|p| !p.is_null() && !p.is_object()) {
        return Err(ApiError::invalid_param(&format!("{param}.function.parameters"), "a function's parameters must be a JSON Schema object"));
    }
    Ok(name)
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
        let has_tool_calls = self.tool_calls.as_ref().is_some_and(|calls| !calls.is_null());
        let content = match &self.content {
            // Only an assistant turn that calls tools may come without text.
            None if role == "assistant" && has_tool_calls => String::new(),
            None => return Err(ApiError::invalid_param(&format!("{param}.content"), format!("a {} message needs `content`", self.role))),
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

    fn no_defaults() -> SamplingDefaults {
        SamplingDefaults::default()
    }

    #[test]
    fn defaults_follow_openai() {
        let params = fields(serde_json::json!({"model": "m"})).sampling(7, &no_defaults()).expect("valid");
        assert_eq!(params, SamplingParams { temperature: 1.0, seed: 7, ..SamplingParams::greedy() });
        // -1 asks for a random seed: the server's.
        let params = fields(serde_json::json!({"model": "m", "seed": -1, "min_p": 0.1})).sampling(9, &no_defaults()).expect("valid");
        assert_eq!((params.seed, params.min_p), (9, 0.1));
    }

    #[test]
    fn the_models_recommendation_fills_what_the_request_leaves_unset() {
        let defaults = SamplingDefaults { temperature: Some(0.6), top_p: Some(0.95), top_k: Some(20), min_p: Some(0.05) };
        let params = fields(serde_json::json!({"model": "m"})).sampling(1, &defaults).expect("valid");
        assert_eq!(params, SamplingParams { temperature: 0.6, top_p: 0.95, top_k: 20, min_p: 0.05, seed: 1 });
        let params = fields(serde_json::json!({"model": "m", "temperature": 0, "top_k": -1, "top_p": 1, "min_p": 0})).sampling(1, &defaults).expect("valid");
        assert_eq!(params, SamplingParams { seed: 1, ..SamplingParams::greedy() });
    }

    #[test]
    fn type_errors_name_the_field() {
        use crate::server::error::deserialize_named;
        let message = serde_json::json!([{"role": "user", "content": "hi"}]);
        for (body, param) in [
            (serde_json::json!({"model": "m", "messages": message, "temperature": "hot"}), "temperature"),
            (serde_json::json!({"model": "m", "messages": message, "max_tokens": "many"}), "max_tokens"),
            (serde_json::json!({"model": "m", "messages": message, "stream": "yes"}), "stream"),
            (serde_json::json!({"model": 5, "messages": message}), "model"),
            (serde_json::json!({"messages": message}), "model"),
            (serde_json::json!({"model": "m", "messages": "hi"}), "messages"),
            (serde_json::json!({"model": "m", "messages": [{"role": "user", "content": 5}]}), "messages[0].content"),
            (serde_json::json!({"model": "m", "messages": message, "tools": {"a": 1}}), "tools"),
        ] {
            let err = deserialize_named::<ChatCompletionRequest>(body.clone()).err().unwrap_or_else(|| panic!("{body} parsed"));
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
            assert!(err.message.contains(param), "{}", err.message);
        }
        let err = deserialize_named::<CompletionRequest>(serde_json::json!({"model": "m", "prompt": "x", "top_p": [1]})).expect_err("refused");
        assert_eq!(err.param.as_deref(), Some("top_p"));
    }

    #[test]
    fn stream_null_is_false() {
        assert!(!fields(serde_json::json!({"model": "m", "stream": null})).stream);
        assert!(fields(serde_json::json!({"model": "m", "stream": true})).stream);
    }

    #[test]
    fn out_of_range_values_name_their_field() {
        for (body, param) in [
            (serde_json::json!({"model": "m", "temperature": 3.0}), "temperature"),
            (serde_json::json!({"model": "m", "top_p": 0.0}), "top_p"),
            (serde_json::json!({"model": "m", "top_k": -5}), "top_k"),
            (serde_json::json!({"model": "m", "min_p": 1.5}), "min_p"),
        ] {
            let err = fields(body).sampling(0, &no_defaults()).expect_err("refused");
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

    fn chat(body: serde_json::Value) -> ChatCompletionRequest {
        serde_json::from_value(body).expect("parses")
    }

    #[test]
    fn a_message_without_content_is_refused_unless_it_calls_tools() {
        for message in [serde_json::json!({"role": "user"}), serde_json::json!({"role": "user", "content": null}), serde_json::json!({"role": "assistant"})] {
            let request = chat(serde_json::json!({"model": "m", "messages": [{"role": "system", "content": "s"}, message]}));
            let err = request.chat_messages().expect_err("no content");
            assert_eq!(err.param.as_deref(), Some("messages[1].content"), "{}", err.message);
        }
    }

    #[test]
    fn malformed_tools_and_tool_choice_are_refused() {
        let tool = serde_json::json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}});
        let message = serde_json::json!([{"role": "user", "content": "hi"}]);
        let ok = |extra: serde_json::Value| {
            let mut body = serde_json::json!({"model": "m", "messages": message, "tools": [tool]});
            body.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
            chat(body).check_unsupported()
        };
        for choice in ["none", "auto", "required"] {
            assert!(ok(serde_json::json!({"tool_choice": choice})).is_ok(), "{choice}");
        }
        assert!(ok(serde_json::json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}})).is_ok());
        for (extra, param) in [
            (serde_json::json!({"tool_choice": "sometimes"}), "tool_choice"),
            (serde_json::json!({"tool_choice": 5}), "tool_choice"),
            (serde_json::json!({"tool_choice": {"type": "function", "function": {"name": "other"}}}), "tool_choice"),
            (serde_json::json!({"tool_choice": {"type": "function"}}), "tool_choice"),
            (serde_json::json!({"tools": [{"type": "function"}]}), "tools[0].function"),
            (serde_json::json!({"tools": [{"function": {"name": "f"}}]}), "tools[0]"),
            (serde_json::json!({"tools": [{"type": "function", "function": {"description": "no name"}}]}), "tools[0].function.name"),
            (serde_json::json!({"tools": [tool, {"type": "function", "function": {"name": "f", "parameters": "x"}}]}), "tools[1].function.parameters"),
            (serde_json::json!({"tools": [], "tool_choice": "required"}), "tool_choice"),
        ] {
            let err = ok(extra.clone()).expect_err("malformed");
            assert_eq!(err.param.as_deref(), Some(param), "{extra}: {}", err.message);
        }
    }
}
