//! Qwen-style tool calls in generated text, parsed incrementally so that a streamed response can
//! carry `tool_calls` deltas. The body of a `<tool_call>` tag is either JSON
//! (`{"name": ..., "arguments": {...}}`, Qwen2.5 / Qwen3) or an XML `<function=NAME>` block
//! (Qwen3.5 / Qwen3.6, see [`super::xml_tool_call`]); both are recognised.
//!
//! Text outside the tags passes through. A tag's body that is neither form is not a tool call: it
//! is returned as the text it was, so nothing the model wrote is lost. Whitespace around tool calls
//! is formatting between them, not content, and is dropped.

use super::reasoning::partial_suffix;
use super::xml_tool_call;
use serde_json::Value;
use std::collections::HashMap;

const OPEN_TAG: &str = "<tool_call>";
const CLOSE_TAG: &str = "</tool_call>";

/// The parameter schemas of the tools a request offers, by function name: the XML form's values
/// are typed by them.
#[derive(Debug, Clone, Default)]
pub struct ToolSchemas {
    parameters: HashMap<String, Value>,
}

impl ToolSchemas {
    /// From an OpenAI `tools` array (`[{"type": "function", "function": {"name", "parameters"}}]`);
    /// entries without a name are skipped.
    pub fn from_tools(tools: &Value) -> Self {
        let parameters = tools
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|tool| {
                let function = tool.get("function").unwrap_or(tool);
                let name = function.get("name")?.as_str()?;
                Some((name.to_string(), function.get("parameters").cloned().unwrap_or(Value::Null)))
            })
            .collect();
        ToolSchemas { parameters }
    }

    pub fn parameters(&self, name: &str) -> Option<&Value> {
        self.parameters.get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.parameters.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.parameters.keys().map(String::as_str)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedToolCall {
    pub name: String,
    /// The arguments as JSON text (the OpenAI API carries them as a string).
    pub arguments: String,
}

/// A piece of a chat response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputPiece {
    Text(String),
    /// Text of a thinking model's reasoning block.
    Reasoning(String),
    ToolCall(ParsedToolCall),
}

#[derive(Debug, Default)]
pub struct ToolCallParser {
    schemas: ToolSchemas,
    /// Outside a call: text that may be the start of `<tool_call>`. Inside: the call's body so far.
    buffer: String,
    inside: bool,
    /// Whitespace-only text not yet emitted: it is dropped if a tool call follows.
    pending_whitespace: String,
    calls_seen: usize,
}

impl ToolCallParser {
    pub fn new(schemas: ToolSchemas) -> Self {
        ToolCallParser { schemas, ..Self::default() }
    }

    /// Tool calls parsed so far.
    pub fn calls_seen(&self) -> usize {
        self.calls_seen
    }

    pub fn push(&mut self, delta: &str) -> Vec<OutputPiece> {
        let mut out = Vec::new();
        self.buffer.push_str(delta);
        loop {
            if self.inside {
                let Some(end) = self.buffer.find(CLOSE_TAG) else { break };
                let body: String = self.buffer[..end].to_string();
                self.buffer.drain(..end + CLOSE_TAG.len());
                self.inside = false;
                self.emit_call(&body, &mut out);
            } else if let Some(start) = self.buffer.find(OPEN_TAG) {
                let before: String = self.buffer[..start].to_string();
                self.buffer.drain(..start + OPEN_TAG.len());
                self.inside = true;
                self.emit_text(before, &mut out);
            } else {
                let keep = partial_suffix(&self.buffer, &[OPEN_TAG]);
                let text: String = self.buffer[..self.buffer.len() - keep].to_string();
                self.buffer.drain(..self.buffer.len() - keep);
                self.emit_text(text, &mut out);
                break;
            }
        }
        out
    }

    /// Generation ended: an unterminated call and any held text are returned as text.
    pub fn finish(&mut self) -> Vec<OutputPiece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buffer);
        if std::mem::take(&mut self.inside) {
            // A model may stop right after `</function>` without closing the call.
            match parse_call(&rest, &self.schemas).filter(|_| rest.contains("</function>")) {
                Some(call) => {
                    self.pending_whitespace.clear();
                    self.calls_seen += 1;
                    out.push(OutputPiece::ToolCall(call));
                }
                None => self.emit_text(format!("{OPEN_TAG}{rest}"), &mut out),
            }
        } else {
            self.emit_text(rest, &mut out);
        }
        if self.calls_seen == 0 && !self.pending_whitespace.is_empty() {
            out.push(OutputPiece::Text(std::mem::take(&mut self.pending_whitespace)));
        }
        out
    }

    /// Trailing whitespace waits: before a tool call it is formatting and goes.
    fn emit_text(&mut self, text: String, out: &mut Vec<OutputPiece>) {
        let body_len = text.trim_end().len();
        if body_len == 0 {
            self.pending_whitespace.push_str(&text);
            return;
        }
        let mut whole = std::mem::take(&mut self.pending_whitespace);
        whole.push_str(&text[..body_len]);
        out.push(OutputPiece::Text(whole));
        self.pending_whitespace.push_str(&text[body_len..]);
    }

    fn emit_call(&mut self, body: &str, out: &mut Vec<OutputPiece>) {
        match parse_call(body, &self.schemas) {
            Some(call) => {
                self.pending_whitespace.clear();
                self.calls_seen += 1;
                out.push(OutputPiece::ToolCall(call));
            }
            None => self.emit_text(format!("{OPEN_TAG}{body}{CLOSE_TAG}"), out),
        }
    }
}

fn parse_call(body: &str, schemas: &ToolSchemas) -> Option<ParsedToolCall> {
    if body.trim_start().starts_with("<function=") {
        let (name, arguments) = xml_tool_call::parse(body, |name| schemas.parameters(name).cloned())?;
        return Some(ParsedToolCall { name, arguments: Value::Object(arguments).to_string() });
    }
    let value: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?.to_string();
    let arguments = match object.get("arguments").or_else(|| object.get("parameters")) {
        None | Some(serde_json::Value::Null) => "{}".to_string(),
        // Some models write the arguments already encoded as a string.
        Some(serde_json::Value::String(encoded)) => encoded.clone(),
        Some(other) => other.to_string(),
    };
    Some(ParsedToolCall { name, arguments })
}


#[cfg(test)]
mod tests {
    use super::*;

    fn parse_in_pieces(deltas: &[&str]) -> Vec<OutputPiece> {
        let mut parser = ToolCallParser::new(ToolSchemas::from_tools(&serde_json::json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "detail": {"type": "object"}}}}}
        ])));
        let mut out: Vec<OutputPiece> = deltas.iter().flat_map(|d| parser.push(d)).collect();
        out.extend(parser.finish());
        // Adjacent text pieces are one text for comparison purposes.
        let mut merged: Vec<OutputPiece> = Vec::new();
        for piece in out {
            match (merged.last_mut(), piece) {
                (Some(OutputPiece::Text(prev)), OutputPiece::Text(next)) => prev.push_str(&next),
                (_, piece) => merged.push(piece),
            }
        }
        merged
    }

    fn call(name: &str, arguments: &str) -> OutputPiece {
        OutputPiece::ToolCall(ParsedToolCall { name: name.into(), arguments: arguments.into() })
    }

    #[test]
    fn plain_text_passes_through() {
        assert_eq!(parse_in_pieces(&["Hello ", "world <b>"]), vec![OutputPiece::Text("Hello world <b>".into())]);
    }

    #[test]
    fn qwen_format_with_newlines_is_one_call() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        assert_eq!(parse_in_pieces(&[text]), vec![call("get_weather", r#"{"city":"Paris"}"#)]);
    }

    #[test]
    fn tags_split_across_every_character_still_parse() {
        let text = "Let me check.<tool_call>{\"name\":\"f\",\"arguments\":{\"x\":1}}</tool_call>";
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let deltas: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(parse_in_pieces(&deltas), vec![OutputPiece::Text("Let me check.".into()), call("f", r#"{"x":1}"#)]);
    }

    #[test]
    fn several_calls_drop_the_whitespace_between_them() {
        let text = "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\n<tool_call>{\"name\":\"b\",\"arguments\":\"{\\\"y\\\": 2}\"}</tool_call>\n";
        assert_eq!(parse_in_pieces(&[text]), vec![call("a", "{}"), call("b", r#"{"y": 2}"#)]);
    }

    #[test]
    fn invalid_body_is_returned_as_text() {
        let text = "<tool_call>not json</tool_call> after";
        assert_eq!(parse_in_pieces(&[text]), vec![OutputPiece::Text(text.into())]);
    }

    #[test]
    fn unterminated_call_is_returned_as_text_at_the_end() {
        let text = "<tool_call>{\"name\":\"f\"";
        assert_eq!(parse_in_pieces(&[text]), vec![OutputPiece::Text(text.into())]);
    }

    #[test]
    fn an_xml_call_left_open_at_the_end_is_still_a_call() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n";
        assert_eq!(parse_in_pieces(&[text]), vec![call("get_weather", r#"{"days":2}"#)]);
    }

    #[test]
    fn held_partial_tag_is_released_when_it_is_not_a_tag() {
        let mut parser = ToolCallParser::new(ToolSchemas::default());
        assert_eq!(parser.push("a <tool"), vec![OutputPiece::Text("a".into())]);
        assert_eq!(parser.push("box>"), vec![OutputPiece::Text(" <toolbox>".into())]);
    }

    #[test]
    fn xml_calls_stream_with_typed_arguments() {
        let text = "I will check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan\nFrancisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=detail>\n{'hourly': True, 'units': None}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>";
        let expected = vec![
            OutputPiece::Text("I will check.".into()),
            call("get_weather", r#"{"city":"San\nFrancisco","days":3,"detail":{"hourly":true,"units":null}}"#),
            call("get_weather", r#"{"city":"Oslo"}"#),
        ];
        assert_eq!(parse_in_pieces(&[text]), expected);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        assert_eq!(parse_in_pieces(&chars.iter().map(String::as_str).collect::<Vec<_>>()), expected);
    }

    #[test]
    fn whitespace_only_answer_without_calls_is_kept() {
        assert_eq!(parse_in_pieces(&["\n\n"]), vec![OutputPiece::Text("\n\n".into())]);
    }
}
