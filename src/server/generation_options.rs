//! Request fields that become engine options: the number of choices, penalties, logit bias, the
//! grammar (`response_format`, `grammar`, forced tool calls) and log probabilities. Each check
//! refuses a bad value with a 400 that names its field.

use super::error::ApiError;
use super::protocol::{ChatCompletionRequest, CompletionRequest, GenerationFields};
use crate::engine::logits::grammar::GrammarSpec;
use crate::engine::logits::logprobs::MAX_TOP_LOGPROBS;
use crate::engine::logits::penalties::Penalties;
use serde_json::Value;

/// The most choices (`n`) one request may ask for.
pub const MAX_CHOICES: usize = 16;

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// The model decides (the default with tools).
    Auto,
    /// No tool calls: the tools are not shown to the model.
    None,
    /// Exactly one call, to any of the tools.
    Required,
    /// Exactly one call, to this tool.
    Function(String),
}

impl GenerationFields {
    /// `n`: how many choices to generate.
    pub fn choices(&self) -> Result<usize, ApiError> {
        match self.n {
            None => Ok(1),
            Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => Ok(n as usize),
            Some(n) => Err(ApiError::invalid_param("n", format!("n must be between 1 and {MAX_CHOICES}, got {n}"))),
        }
    }

    pub fn penalties(&self) -> Result<Penalties, ApiError> {
        let penalties = Penalties {
            presence: self.presence_penalty.unwrap_or(0.0),
            frequency: self.frequency_penalty.unwrap_or(0.0),
            repetition: self.repetition_penalty.or(self.repeat_penalty).unwrap_or(1.0),
        };
        let field = if self.repetition_penalty.is_some() { "repetition_penalty" } else { "repeat_penalty" };
        for (name, value, ok) in [
            ("presence_penalty", penalties.presence, (-2.0..=2.0).contains(&penalties.presence)),
            ("frequency_penalty", penalties.frequency, (-2.0..=2.0).contains(&penalties.frequency)),
        ] {
            if !ok {
                return Err(ApiError::invalid_param(name, format!("{name} must be between -2 and 2, got {value}")));
            }
        }
        if !(penalties.repetition.is_finite() && penalties.repetition > 0.0) {
            return Err(ApiError::invalid_param(field, format!("{field} must be a positive number (1 turns it off), got {}", penalties.repetition)));
        }
        Ok(penalties)
    }

    /// `logit_bias`: token ids (as strings, the JSON object keys) to a bias in [-100, 100].
    pub fn logit_bias(&self, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
        let bad = |message: String| ApiError::invalid_param("logit_bias", message);
        let map = match &self.logit_bias {
            None | Some(Value::Null) => return Ok(Vec::new()),
            Some(Value::Object(map)) => map,
            Some(other) => return Err(bad(format!("logit_bias must be an object of token ids to numbers, got {other}"))),
        };
        let mut bias = Vec::with_capacity(map.len());
        for (key, value) in map {
            let token: u32 = key.trim().parse().map_err(|_| bad(format!("logit_bias key `{key}` is not a token id")))?;
            if token as usize >= vocab_size {
                return Err(bad(format!("logit_bias names token {token}, outside the vocabulary of {vocab_size} tokens")));
            }
            let value = value.as_f64().ok_or_else(|| bad(format!("the logit_bias of token {token} must be a number, got {value}")))?;
            if !(-100.0..=100.0).contains(&value) {
                return Err(bad(format!("the logit_bias of token {token} must be between -100 and 100, got {value}")));
            }
            bias.push((token, value as f32));
        }
        bias.sort_by_key(|&(token, _)| token);
        Ok(bias)
    }

    /// The grammar the output must follow, from `response_format` or `grammar`.
    pub fn grammar_spec(&self) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
        let from_format = match &self.response_format {
            None | Some(Value::Null) => None,
            Some(format) => response_format_grammar(format)?,
        };
        match (from_format, &self.grammar) {
            (Some(_), Some(_)) => Err(ApiError::invalid_param("grammar", "give either response_format or grammar, not both")),
            (Some(spec), None) => Ok(Some((spec, "response_format"))),
            (None, Some(lark)) if lark.trim().is_empty() => Err(ApiError::invalid_param("grammar", "the grammar is empty")),
            (None, Some(lark)) => Ok(Some((GrammarSpec::Lark(lark.clone()), "grammar"))),
            (None, None) => Ok(None),
        }
    }
}

fn response_format_grammar(format: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    let bad = |message: &str| ApiError::invalid_param("response_format", message);
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            let schema = format.get("json_schema").and_then(|s| s.get("schema")).ok_or_else(|| bad("response_format json_schema needs `json_schema.schema`"))?;
            if !schema.is_object() && !schema.is_boolean() {
                return Err(bad("`json_schema.schema` must be a JSON schema object"));
            }
            Ok(Some(GrammarSpec::JsonSchema(schema.clone())))
        }
        Some(other) => Err(ApiError::invalid_param("response_format", format!("unknown response_format type `{other}` (expected text, json_object or json_schema)"))),
        None => Err(bad("response_format needs a `type`")),
    }
}

impl ChatCompletionRequest {
    /// Log probabilities with this many alternatives per token, when `logprobs` is true.
    pub fn logprobs_top(&self) -> Result<Option<usize>, ApiError> {
        let top = match self.top_logprobs {
            None => 0,
            Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => n as usize,
            Some(n) => return Err(ApiError::invalid_param("top_logprobs", format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"))),
        };
        match self.logprobs {
            Some(true) => Ok(Some(top)),
            _ if top > 0 => Err(ApiError::invalid_param("top_logprobs", "top_logprobs needs logprobs: true")),
            _ => Ok(None),
        }
    }

    /// `tool_choice`, checked against the tools offered.
    pub fn tool_choice(&self) -> Result<ToolChoice, ApiError> {
        let bad = |message: String| ApiError::invalid_param("tool_choice", message);
        let tools: Vec<&str> = self.tools.iter().flatten().filter_map(|t| t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str)).collect();
        let choice = match &self.tool_choice {
            None | Some(Value::Null) => return Ok(if tools.is_empty() { ToolChoice::None } else { ToolChoice::Auto }),
            Some(Value::String(s)) => match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                other => return Err(bad(format!("unknown tool_choice `{other}` (expected none, auto, required or a function)"))),
            },
            Some(object) => {
                let name = object.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).ok_or_else(|| bad("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}".into()))?;
                if !tools.contains(&name) {
                    return Err(bad(format!("tool_choice names the function `{name}`, which is not among the tools ({})", tools.join(", "))));
                }
                ToolChoice::Function(name.to_string())
            }
        };
        if matches!(choice, ToolChoice::Required) && tools.is_empty() {
            return Err(bad("tool_choice `required` needs tools".into()));
        }
        Ok(choice)
    }

    /// The tools a forced call may use, with their parameter schemas.
    pub fn forced_tools(&self, choice: &ToolChoice) -> Vec<(String, Value)> {
        let named = |name: &str| match choice {
            ToolChoice::Required => true,
            ToolChoice::Function(wanted) => wanted == name,
            ToolChoice::Auto | ToolChoice::None => false,
        };
        self.tools
            .iter()
            .flatten()
            .filter_map(|tool| {
                let function = tool.get("function")?;
                let name = function.get("name")?.as_str()?;
                named(name).then(|| (name.to_string(), function.get("parameters").cloned().unwrap_or(Value::Null)))
            })
            .collect()
    }
}

impl CompletionRequest {
    /// The legacy `logprobs`: an integer, the alternatives per token (0 for the token alone).
    pub fn logprobs_top(&self) -> Result<Option<usize>, ApiError> {
        match &self.logprobs {
            None | Some(Value::Null) => Ok(None),
            Some(value) => match value.as_i64() {
                Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Ok(Some(n as usize)),
                _ => Err(ApiError::invalid_param("logprobs", format!("logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}, got {value}"))),
            },
        }
    }
}

/// The seed of choice `index`: choice 0 keeps the request's, so it equals the same request with
/// `n = 1`; the others get seeds of their own.
pub fn choice_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        seed
    } else {
        crate::backend::sampling::position_key(seed, u64::MAX - index as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(body: Value) -> GenerationFields {
        serde_json::from_value(body).expect("valid fields")
    }

    fn chat(body: Value) -> ChatCompletionRequest {
        serde_json::from_value(body).expect("valid request")
    }

    #[test]
    fn bad_values_name_their_field() {
        let m = |extra: Value| {
            let mut body = json!({"model": "m"});
            body.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
            fields(body)
        };
        assert_eq!(m(json!({"n": 0})).choices().expect_err("n = 0").param.as_deref(), Some("n"));
        assert_eq!(m(json!({"n": 17})).choices().expect_err("n too large").param.as_deref(), Some("n"));
        assert_eq!(m(json!({"presence_penalty": 3.0})).penalties().expect_err("range").param.as_deref(), Some("presence_penalty"));
        assert_eq!(m(json!({"repeat_penalty": 0.0})).penalties().expect_err("zero").param.as_deref(), Some("repeat_penalty"));
        assert_eq!(m(json!({"logit_bias": {"abc": 1}})).logit_bias(10).expect_err("key").param.as_deref(), Some("logit_bias"));
        assert_eq!(m(json!({"logit_bias": {"12": 1}})).logit_bias(10).expect_err("outside").param.as_deref(), Some("logit_bias"));
        assert_eq!(m(json!({"logit_bias": {"2": 200}})).logit_bias(10).expect_err("large").param.as_deref(), Some("logit_bias"));
        assert_eq!(m(json!({"response_format": {"type": "xml"}})).grammar_spec().expect_err("type").param.as_deref(), Some("response_format"));
        assert_eq!(m(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})).grammar_spec().expect_err("no schema").param.as_deref(), Some("response_format"));
        assert_eq!(m(json!({"response_format": {"type": "json_object"}, "grammar": "start: \"a\""})).grammar_spec().expect_err("both").param.as_deref(), Some("grammar"));
    }

    #[test]
    fn good_values_become_options() {
        let f = fields(json!({"model": "m", "n": 3, "frequency_penalty": 0.5, "repeat_penalty": 1.1, "logit_bias": {"7": -100, "2": 5.5}, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}}}));
        assert_eq!(f.choices().expect("valid"), 3);
        assert_eq!(f.penalties().expect("valid"), Penalties { presence: 0.0, frequency: 0.5, repetition: 1.1 });
        assert_eq!(f.logit_bias(10).expect("valid"), vec![(2, 5.5), (7, -100.0)]);
        assert_eq!(f.grammar_spec().expect("valid"), Some((GrammarSpec::JsonSchema(json!({"type": "object"})), "response_format")));
    }

    #[test]
    fn tool_choice_and_logprobs_are_checked() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
        let request = |choice: Value| chat(json!({"model": "m", "messages": [], "tools": tools, "tool_choice": choice}));
        assert_eq!(request(json!("required")).tool_choice().expect("valid"), ToolChoice::Required);
        assert_eq!(request(json!({"type": "function", "function": {"name": "get_weather"}})).tool_choice().expect("valid"), ToolChoice::Function("get_weather".into()));
        assert_eq!(request(json!({"type": "function", "function": {"name": "nope"}})).tool_choice().expect_err("unknown").param.as_deref(), Some("tool_choice"));
        assert_eq!(request(json!("sometimes")).tool_choice().expect_err("unknown").param.as_deref(), Some("tool_choice"));
        let forced = request(json!("required"));
        assert_eq!(forced.forced_tools(&ToolChoice::Required), vec![("get_weather".to_string(), json!({"type": "object"}))]);
        let no_tools = chat(json!({"model": "m", "messages": [], "tool_choice": "required"}));
        assert_eq!(no_tools.tool_choice().expect_err("no tools").param.as_deref(), Some("tool_choice"));

        let logprobs = |extra: Value| {
            let mut body = json!({"model": "m", "messages": []});
            body.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
            chat(body).logprobs_top()
        };
        assert_eq!(logprobs(json!({"logprobs": true, "top_logprobs": 5})).expect("valid"), Some(5));
        assert_eq!(logprobs(json!({})).expect("valid"), None);
        assert_eq!(logprobs(json!({"logprobs": true, "top_logprobs": 21})).expect_err("too many").param.as_deref(), Some("top_logprobs"));
        assert_eq!(logprobs(json!({"top_logprobs": 2})).expect_err("without logprobs").param.as_deref(), Some("top_logprobs"));
    }

    #[test]
    fn choice_zero_keeps_the_seed_and_the_others_differ() {
        assert_eq!(choice_seed(42, 0), 42);
        let seeds: std::collections::HashSet<u64> = (0..8).map(|i| choice_seed(42, i)).collect();
        assert_eq!(seeds.len(), 8);
    }
}
