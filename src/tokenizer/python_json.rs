//! The `tojson` filter as Hugging Face chat templates expect it.
//!
//! transformers renders templates with a `tojson` that calls Python's
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
//! minijinja's builtin differs in ways a model notices: it writes compact JSON
//! (`{"a":1}` instead of `{"a": 1}`) and HTML-escapes `<`, `>`, `&` and `'`.
//! Tool schemas go into the prompt through this filter, so it must reproduce
//! Python byte for byte: separators, string escapes, float spelling and key order.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// How `json.dumps` was asked to lay out its output.
#[derive(Debug, Clone)]
pub(crate) struct PythonJsonStyle {
    /// `None` writes everything on one line; `Some(unit)` puts each item on its
    /// own line, indented by `unit` once per nesting level.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub ensure_ascii: bool,
    pub sort_keys: bool,
}

impl Default for PythonJsonStyle {
    fn default() -> Self {
        PythonJsonStyle {
            indent: None,
            item_separator: ", ".to_string(),
            key_separator: ": ".to_string(),
            ensure_ascii: false,
            sort_keys: false,
        }
    }
}

impl PythonJsonStyle {
    /// Reads the keyword arguments transformers' `tojson` accepts:
    /// `indent`, `separators`, `ensure_ascii`, `sort_keys`.
    fn from_kwargs(kwargs: &Kwargs) -> Result<Self, Error> {
        let mut style = PythonJsonStyle::default();
        if let Some(indent) = kwargs.get::<Option<Value>>("indent")? {
            style.indent = python_indent_unit(&indent)?;
        }
        // Python switches the item separator to a bare "," once output is
        // indented, since the newline already separates items.
        if style.indent.is_some() {
            style.item_separator = ",".to_string();
        }
        if let Some(separators) = kwargs.get::<Option<Value>>("separators")? {
            if !separators.is_none() {
                let (item, key) = separator_pair(&separators)?;
                style.item_separator = item;
                style.key_separator = key;
            }
        }
        if let Some(ensure_ascii) = kwargs.get::<Option<bool>>("ensure_ascii")? {
            style.ensure_ascii = ensure_ascii;
        }
        if let Some(sort_keys) = kwargs.get::<Option<bool>>("sort_keys")? {
            style.sort_keys = sort_keys;
        }
        kwargs.assert_all_used()?;
        Ok(style)
    }
}

/// `indent=None` is compact, an integer is that many spaces (Python treats a
/// negative count as zero), and a string is used as the indent unit itself.
fn python_indent_unit(indent: &Value) -> Result<Option<String>, Error> {
    match indent.kind() {
        ValueKind::None | ValueKind::Undefined => Ok(None),
        ValueKind::String => Ok(indent.as_str().map(str::to_string)),
        ValueKind::Number if indent.is_integer() => {
            let spaces = indent.as_i64().unwrap_or(0).max(0);
            Ok(Some(" ".repeat(spaces as usize)))
        }
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "tojson: indent must be an integer or a string, not {}",
                indent.kind()
            ),
        )),
    }
}

fn separator_pair(separators: &Value) -> Result<(String, String), Error> {
    let wrong_shape = || {
        Error::new(
            ErrorKind::InvalidOperation,
            "tojson: separators must be a pair of strings (item_separator, key_separator)",
        )
    };
    if separators.len() != Some(2) {
        return Err(wrong_shape());
    }
    let item = separators.get_item_by_index(0)?;
    let key = separators.get_item_by_index(1)?;
    match (item.as_str(), key.as_str()) {
        (Some(item), Some(key)) => Ok((item.to_string(), key.to_string())),
        _ => Err(wrong_shape()),
    }
}

/// The `tojson` filter registered in the chat template environment.
///
/// The result is marked safe so that no auto-escaping can touch it afterwards.
pub(crate) fn tojson_filter(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let style = PythonJsonStyle::from_kwargs(&kwargs)?;
    let mut out = String::new();
    write_python_json(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

/// Serializes `value` the way `json.dumps` with `style` would.
pub(crate) fn write_python_json(
    out: &mut String,
    value: &Value,
    style: &PythonJsonStyle,
    depth: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value)?,
        ValueKind::String => {
            write_string(out, value.as_str().unwrap_or_default(), style.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => write_sequence(out, value, style, depth)?,
        ValueKind::Map => write_mapping(out, value, style, depth)?,
        // Python raises TypeError for these; an undefined value usually means a
        // template read a field the message does not have, which is worth seeing.
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: a value of type {} is not JSON serializable",
                    value.kind()
                ),
            ))
        }
    }
    Ok(())
}

fn write_number(out: &mut String, value: &Value) -> Result<(), Error> {
    if value.is_integer() {
        // Integers of any width print as plain decimal digits, as in Python.
        out.push_str(&value.to_string());
        return Ok(());
    }
    let float = f64::try_from(value.clone())?;
    out.push_str(&python_float_repr(float));
    Ok(())
}

/// Python's `float.__repr__`: the shortest digits that round-trip, in fixed
/// notation when the decimal exponent is in [-4, 16) and scientific otherwise
/// (`1e+16`, `1.5e-05`), always with a `.0` on integral fixed values.
/// `json.dumps` writes the non-finite values as `NaN`, `Infinity`, `-Infinity`.
pub(crate) fn python_float_repr(float: f64) -> String {
    if float.is_nan() {
        return "NaN".to_string();
    }
    if float.is_infinite() {
        return if float > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    // Rust's `{:e}` gives the shortest round-trip digits as `d.ddde[-]x`.
    let scientific = format!("{:e}", float);
    let (mantissa, exponent) = scientific
        .split_once('e')
        .unwrap_or((scientific.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();

    let mut repr = String::from(sign);
    if (-4..16).contains(&exponent) {
        if exponent >= 0 {
            let integer_len = exponent as usize + 1;
            if digits.len() <= integer_len {
                repr.push_str(&digits);
                repr.push_str(&"0".repeat(integer_len - digits.len()));
                repr.push_str(".0");
            } else {
                repr.push_str(&digits[..integer_len]);
                repr.push('.');
                repr.push_str(&digits[integer_len..]);
            }
        } else {
            repr.push_str("0.");
            repr.push_str(&"0".repeat((-exponent - 1) as usize));
            repr.push_str(&digits);
        }
    } else {
        repr.push_str(&digits[..1]);
        if digits.len() > 1 {
            repr.push('.');
            repr.push_str(&digits[1..]);
        }
        repr.push('e');
        repr.push(if exponent < 0 { '-' } else { '+' });
        repr.push_str(&format!("{:02}", exponent.unsigned_abs()));
    }
    repr
}

/// Escapes like Python's encoder: `ensure_ascii=False` escapes only quotes,
/// backslashes and control characters; `ensure_ascii=True` also writes every
/// non-ASCII character (and DEL) as `\uXXXX`, with surrogate pairs above U+FFFF.
fn write_string(out: &mut String, text: &str, ensure_ascii: bool) {
    out.push('"');
    for ch in text.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) >= 0x7f => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{:04x}", unit));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn push_newline_indent(out: &mut String, unit: &str, depth: usize) {
    out.push('\n');
    for _ in 0..depth {
        out.push_str(unit);
    }
}

fn write_sequence(
    out: &mut String,
    value: &Value,
    style: &PythonJsonStyle,
    depth: usize,
) -> Result<(), Error> {
    let items: Vec<Value> = value.try_iter()?.collect();
    if items.is_empty() {
        out.push_str("[]");
        return Ok(());
    }
    out.push('[');
    for (index, item) in items.iter().enumerate() {
        if index > 0 {
            out.push_str(&style.item_separator);
        }
        if let Some(unit) = &style.indent {
            push_newline_indent(out, unit, depth + 1);
        }
        write_python_json(out, item, style, depth + 1)?;
    }
    if let Some(unit) = &style.indent {
        push_newline_indent(out, unit, depth);
    }
    out.push(']');
    Ok(())
}

/// JSON object keys are strings; Python converts numbers, booleans and None
/// keys to their JSON spelling and rejects anything else.
fn python_json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::None => Ok("null".to_string()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::Number => {
            let mut spelled = String::new();
            write_number(&mut spelled, key)?;
            Ok(spelled)
        }
        other => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {other}"),
        )),
    }
}

fn write_mapping(
    out: &mut String,
    value: &Value,
    style: &PythonJsonStyle,
    depth: usize,
) -> Result<(), Error> {
    let mut entries = Vec::new();
    for key in value.try_iter()? {
        let item = value.get_item(&key)?;
        entries.push((python_json_key(&key)?, item));
    }
    if style.sort_keys {
        entries.sort_by(|a, b| a.0.cmp(&b.0));
    }
    if entries.is_empty() {
        out.push_str("{}");
        return Ok(());
    }
    out.push('{');
    for (index, (key, item)) in entries.iter().enumerate() {
        if index > 0 {
            out.push_str(&style.item_separator);
        }
        if let Some(unit) = &style.indent {
            push_newline_indent(out, unit, depth + 1);
        }
        write_string(out, key, style.ensure_ascii);
        out.push_str(&style.key_separator);
        write_python_json(out, item, style, depth + 1)?;
    }
    if let Some(unit) = &style.indent {
        push_newline_indent(out, unit, depth);
    }
    out.push('}');
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::python_float_repr;

    #[test]
    fn floats_are_spelled_like_python_repr() {
        // Pairs of (value, Python's repr(value)), from CPython 3.
        let cases: [(f64, &str); 16] = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (2.75, "2.75"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345.6, "123456789012345.6"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e100, "1e+100"),
            (1234567890123456789.0, "1.2345678901234568e+18"),
            (5e-324, "5e-324"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (value, python) in cases {
            assert_eq!(python_float_repr(value), python, "repr of {value:e}");
        }
    }
}
