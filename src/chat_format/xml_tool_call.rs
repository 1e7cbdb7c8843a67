//! The XML tool-call body of Qwen3.5 / Qwen3.6 (and Qwen3-Coder):
//!
//! ```text
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! <parameter=days>
//! 3
//! </parameter>
//! </function>
//! ```
//!
//! Every value is text; its JSON type comes from the tool's parameter schema, as vLLM's
//! `qwen3_coder` parser does: strings stay as written (several lines included), integers,
//! numbers and booleans are parsed, objects and arrays are read as JSON or, failing that, as a
//! Python literal; `null` (or Python's `None`) is null whatever the schema says. A value that does
//! not parse as its type is kept as text rather than lost. A missing `</parameter>` ends at the
//! next parameter or at `</function>`, as models sometimes leave it out.

use super::python_literal;
use serde_json::{Map, Value};

const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAMETER_OPEN: &str = "<parameter=";
const PARAMETER_CLOSE: &str = "</parameter>";

/// The function name and its arguments, or `None` if `body` is not a `<function=...>` block.
pub fn parse(body: &str, parameters_schema: impl Fn(&str) -> Option<Value>) -> Option<(String, Map<String, Value>)> {
    let rest = body.trim_start().strip_prefix(FUNCTION_OPEN)?;
    let name_end = rest.find('>')?;
    let name = rest[..name_end].trim().to_string();
    if name.is_empty() || name.contains('\n') {
        return None;
    }
    let mut rest = &rest[name_end + 1..];
    let function_end = rest.find(FUNCTION_CLOSE).unwrap_or(rest.len());
    if !rest[function_end..].is_empty() && !rest[function_end + FUNCTION_CLOSE.len()..].trim().is_empty() {
        // Text after `</function>` inside the call: not this format.
        return None;
    }
    rest = &rest[..function_end];
    let schema = parameters_schema(&name);
    let mut arguments = Map::new();
    while let Some(start) = rest.find(PARAMETER_OPEN) {
        if !rest[..start].trim().is_empty() {
            return None;
        }
        let after = &rest[start + PARAMETER_OPEN.len()..];
        let key_end = after.find('>')?;
        let key = after[..key_end].trim().to_string();
        let value_and_more = &after[key_end + 1..];
        let value_end = [value_and_more.find(PARAMETER_CLOSE), value_and_more.find(PARAMETER_OPEN)].into_iter().flatten().min().unwrap_or(value_and_more.len());
        let raw = &value_and_more[..value_end];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        arguments.insert(key.clone(), convert(raw, schema.as_ref().and_then(|s| property_type(s, &key))));
        rest = value_and_more[value_end..].strip_prefix(PARAMETER_CLOSE).unwrap_or(&value_and_more[value_end..]);
    }
    rest.trim().is_empty().then_some((name, arguments))
}

/// The first non-null JSON type a parameter's schema names (`type`, a list of types, or the
/// first branch of `anyOf` / `oneOf` that has one).
fn property_type(parameters: &Value, key: &str) -> Option<String> {
    let property = parameters.get("properties")?.get(key)?;
    schema_type(property)
}

fn schema_type(schema: &Value) -> Option<String> {
    match schema.get("type") {
        Some(Value::String(t)) => return Some(t.clone()),
        Some(Value::Array(types)) => {
            if let Some(t) = types.iter().filter_map(Value::as_str).find(|t| *t != "null") {
                return Some(t.to_string());
            }
        }
        _ => {}
    }
    if schema.get("enum").and_then(Value::as_array).is_some_and(|values| values.iter().all(Value::is_string)) {
        return Some("string".into());
    }
    ["anyOf", "oneOf"].iter().filter_map(|k| schema.get(*k)?.as_array()).flatten().find_map(|branch| schema_type(branch).filter(|t| t != "null"))
}

/// A parameter's text as the JSON value its schema type asks for.
fn convert(raw: &str, schema_type: Option<String>) -> Value {
    let trimmed = raw.trim();
    if trimmed.eq_ignore_ascii_case("null") || trimmed == "None" {
        return Value::Null;
    }
    let as_text = || Value::String(raw.to_string());
    match schema_type.as_deref() {
        None | Some("string" | "str" | "text") => as_text(),
        Some("integer" | "int") => trimmed.parse::<i64>().map(|n| Value::Number(n.into())).unwrap_or_else(|_| python_literal::number(trimmed).filter(Value::is_number).unwrap_or_else(as_text)),
        Some("number" | "float") => python_literal::number(trimmed).unwrap_or_else(as_text),
        Some("boolean" | "bool") => match trimmed.to_ascii_lowercase().as_str() {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ => as_text(),
        },
        Some(_) => serde_json::from_str(trimmed).ok().or_else(|| python_literal::parse(trimmed)).unwrap_or_else(as_text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Value {
        json!({"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
            "hourly": {"type": "boolean"}, "filters": {"type": "object"}, "tags": {"type": ["array", "null"]},
            "unit": {"enum": ["c", "f"]}, "note": {"anyOf": [{"type": "null"}, {"type": "string"}]}
        }})
    }

    fn parse_with_schema(body: &str) -> Option<(String, Map<String, Value>)> {
        parse(body, |name| (name == "get_weather").then(schema))
    }

    #[test]
    fn values_take_the_types_of_the_schema() {
        let body = "\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=hourly>\nTrue\n</parameter>\n<parameter=filters>\n{\"rain\": {\"min\": 1}, \"wind\": [1, 2]}\n</parameter>\n<parameter=tags>\n['a', None]\n</parameter>\n<parameter=unit>\nc\n</parameter>\n<parameter=note>\nNone\n</parameter>\n</function>\n";
        let (name, args) = parse_with_schema(body).expect("parses");
        assert_eq!(name, "get_weather");
        assert_eq!(Value::Object(args), json!({"city": "New York", "days": 3, "ratio": 0.5, "hourly": true, "filters": {"rain": {"min": 1}, "wind": [1, 2]}, "tags": ["a", null], "unit": "c", "note": null}));
    }

    #[test]
    fn multi_line_strings_keep_their_inner_newlines() {
        let body = "<function=write>\n<parameter=text>\nline one\n\n  line three\n</parameter>\n</function>";
        let (_, args) = parse(body, |_| Some(json!({"properties": {"text": {"type": "string"}}}))).expect("parses");
        assert_eq!(args["text"], json!("line one\n\n  line three"));
    }

    #[test]
    fn unknown_tools_and_parameters_stay_text_and_bad_values_are_kept() {
        let (_, args) = parse("<function=other>\n<parameter=x>\n42\n</parameter>\n</function>", |_| None).expect("parses");
        assert_eq!(args["x"], json!("42"));
        let (_, args) = parse_with_schema("<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=filters>\n{oops\n</parameter>\n</function>").expect("parses");
        assert_eq!(Value::Object(args), json!({"days": "three", "filters": "{oops"}));
    }

    #[test]
    fn missing_parameter_close_tags_end_at_the_next_tag() {
        let (_, args) = parse_with_schema("<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>").expect("parses");
        assert_eq!(Value::Object(args), json!({"city": "Rome", "days": 2}));
    }

    #[test]
    fn no_parameters_is_an_empty_object() {
        assert_eq!(parse("<function=now>\n</function>", |_| None), Some(("now".to_string(), Map::new())));
    }

    #[test]
    fn other_bodies_are_not_this_format() {
        assert_eq!(parse("{\"name\": \"f\"}", |_| None), None);
        assert_eq!(parse("<function=>\n</function>", |_| None), None);
        assert_eq!(parse("<function=f>\nstray text\n</function>", |_| None), None);
    }
}
