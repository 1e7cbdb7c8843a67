//! Forced tool calls (`tool_choice: "required"` or a named function) as a grammar over the
//! model's own tool-call syntax, in llguidance's Lark dialect: the model must write exactly one
//! call, to one of the given tools, with arguments valid for the tool's parameter schema.
//!
//! JSON syntax (Qwen2.5 / Qwen3): `<tool_call>` `\n{"name": ..., "arguments": {...}}\n` `</tool_call>`,
//! the object held to a schema whose `name` is the tool's. XML syntax (Qwen3.5 / 3.6):
//! `<tool_call>` then `<function=NAME>` with one `<parameter=KEY>` block per property in schema
//! order, required ones mandatory; a string value is free text up to `</parameter>`, any other
//! value is JSON valid for the property's schema. The tags that are tokens of their own are
//! named as tokens, so the model writes them the way it was trained to.

use super::ToolCallSyntax;
use crate::engine::logits::grammar::with_bounded_whitespace;
use serde_json::{json, Value};

/// The Lark grammar that allows exactly one call to one of `tools` (name and parameter schema).
pub fn forced_call_grammar(syntax: ToolCallSyntax, tools: &[(String, Value)]) -> String {
    let mut rules = Vec::new();
    let mut alternatives = Vec::new();
    for (index, (name, parameters)) in tools.iter().enumerate() {
        let rule = format!("call_{index}");
        alternatives.push(rule.clone());
        match syntax {
            ToolCallSyntax::Json => {
                let arguments = if parameters.is_object() { parameters.clone() } else { json!({"type": "object"}) };
                let schema = json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": arguments},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                });
                rules.push(format!("{rule}: \"\\n\" %json {} \"\\n\"", with_bounded_whitespace(schema)));
            }
            ToolCallSyntax::Xml => rules.extend(xml_function_rules(&rule, name, parameters)),
        }
    }
    // A call ends at its closing tag: nothing may follow but the end of the turn.
    let mut grammar = format!("start: space? <tool_call> call </tool_call>\nspace: /[ \\t\\n]{{1,4}}/\ncall: {}\n", alternatives.join(" | "));
    if syntax == ToolCallSyntax::Xml {
        // A string value is any text without the tags that would end it early for a parser.
        grammar.push_str(&format!("TEXT: /(?s:.*)/ & ~/{FORBIDDEN_IN_TEXT}/\n"));
    }
    grammar.push_str(&rules.join("\n"));
    grammar.push('\n');
    grammar
}

/// Text that contains a tag which would end a string value early for a parser.
const FORBIDDEN_IN_TEXT: &str = r"(?s:.*(<parameter=|<\/parameter>|<\/function>).*)";

fn lark_string(text: &str) -> String {
    serde_json::to_string(text).expect("a string serializes")
}

/// `<function=NAME>\n` then the parameters, then `</function>\n`.
fn xml_function_rules(rule: &str, name: &str, parameters: &Value) -> Vec<String> {
    let properties: Vec<(&String, &Value)> = parameters.get("properties").and_then(Value::as_object).map(|p| p.iter().collect()).unwrap_or_default();
    let required: Vec<&str> = parameters.get("required").and_then(Value::as_array).map(|r| r.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    let mut rules = Vec::new();
    let mut body = vec![lark_string(&format!("\n<function={name}>\n"))];
    for (index, (key, schema)) in properties.iter().enumerate() {
        let param_rule = format!("{rule}_p{index}");
        let open = lark_string(&format!("<parameter={key}>\n"));
        let close = "\"\\n</parameter>\\n\"";
        let enum_strings: Option<Vec<&str>> = schema.get("enum").and_then(Value::as_array).and_then(|values| values.iter().map(Value::as_str).collect());
        if let Some(values) = enum_strings.filter(|v| !v.is_empty()) {
            let choices: Vec<String> = values.iter().map(|v| lark_string(v)).collect();
            rules.push(format!("{param_rule}: {open} ({}) {close}", choices.join(" | ")));
        } else if is_string_schema(schema) {
            // Free text up to the closing tag (a lazy match: it ends at the first one), at most
            // `maxLength` characters when the schema says.
            let text = match schema.get("maxLength").and_then(Value::as_u64) {
                Some(max) => {
                    let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0).min(max);
                    let terminal = format!("{}_TEXT", param_rule.to_uppercase());
                    rules.push(format!("{terminal}: /(?s:.{{{min},{max}}})/ & ~/{FORBIDDEN_IN_TEXT}/"));
                    terminal
                }
                None => "TEXT".to_string(),
            };
            rules.push(format!("{param_rule}: {open} {param_rule}_text"));
            rules.push(format!("{param_rule}_text[suffix={close}]: {text}"));
        } else {
            rules.push(format!("{param_rule}: {open} %json {} {close}", with_bounded_whitespace((*schema).clone())));
        }
        let optional = if required.contains(&key.as_str()) { "" } else { "?" };
        body.push(format!("{param_rule}{optional}"));
    }
    body.push(lark_string("</function>\n"));
    rules.insert(0, format!("{rule}: {}", body.join(" ")));
    rules
}

/// A schema whose values are strings (the XML form writes them unquoted).
fn is_string_schema(schema: &Value) -> bool {
    match schema.get("type") {
        Some(Value::String(t)) => t == "string",
        Some(Value::Array(types)) => types.iter().filter_map(Value::as_str).filter(|t| *t != "null").all(|t| t == "string"),
        _ => schema.get("enum").and_then(Value::as_array).is_some_and(|values| values.iter().all(Value::is_string)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_syntax_holds_the_name_and_the_arguments_schema() {
        let grammar = forced_call_grammar(ToolCallSyntax::Json, &[("get_weather".into(), json!({"type": "object", "properties": {"days": {"type": "integer"}}}))]);
        assert!(grammar.starts_with("start: space? <tool_call> call </tool_call>\n"), "{grammar}");
        assert!(grammar.contains(r#"call_0: "\n" %json {"type":"object","properties":{"name":{"const":"get_weather"}"#), "{grammar}");
    }

    #[test]
    fn xml_string_values_can_be_bounded_or_enumerated() {
        let parameters = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}}});
        let grammar = forced_call_grammar(ToolCallSyntax::Xml, &[("get_weather".into(), parameters)]);
        assert!(grammar.contains(r#"CALL_0_P0_TEXT: /(?s:.{0,20})/ & ~/"#), "{grammar}");
        assert!(grammar.contains(r#"call_0_p1: "<parameter=unit>\n" ("c" | "f") "\n</parameter>\n""#), "{grammar}");
    }

    #[test]
    fn xml_syntax_has_a_block_per_parameter() {
        let parameters = json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]});
        let grammar = forced_call_grammar(ToolCallSyntax::Xml, &[("get_weather".into(), parameters), ("now".into(), json!({}))]);
        assert!(grammar.contains("call: call_0 | call_1"), "{grammar}");
        assert!(grammar.contains(r#"call_0: "\n<function=get_weather>\n" call_0_p0 call_0_p1? "</function>\n""#), "{grammar}");
        assert!(grammar.contains(r#"call_0_p0_text[suffix="\n</parameter>\n"]: TEXT"#), "{grammar}");
        assert!(grammar.contains(r#"call_0_p1: "<parameter=days>\n" %json {"type":"integer","x-guidance":"#), "{grammar}");
        assert!(grammar.contains(r#"call_1: "\n<function=now>\n" "</function>\n""#), "{grammar}");
    }
}
