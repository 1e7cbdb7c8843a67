//! Python literals as JSON: models trained on Python often write tool arguments as
//! `{'city': 'Paris', 'units': None, 'hourly': True}` instead of JSON. This reads the literal
//! forms `ast.literal_eval` accepts for data (dicts, lists, tuples, strings in either quote,
//! numbers, `True`, `False`, `None`), so such values keep their types.

use serde_json::{Map, Number, Value};

/// The JSON value of a Python literal, or `None` if `text` is not one.
pub fn parse(text: &str) -> Option<Value> {
    let mut parser = Parser { chars: text.chars().collect(), at: 0 };
    let value = parser.value()?;
    parser.skip_space();
    (parser.at == parser.chars.len()).then_some(value)
}

struct Parser {
    chars: Vec<char>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.at).copied()
    }

    fn skip_space(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.at += 1;
        }
    }

    fn eat(&mut self, c: char) -> bool {
        self.skip_space();
        if self.peek() == Some(c) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self) -> Option<Value> {
        self.skip_space();
        match self.peek()? {
            '{' => self.dict(),
            '[' => self.sequence('[', ']'),
            '(' => self.sequence('(', ')'),
            '\'' | '"' => self.string().map(Value::String),
            _ => self.word(),
        }
    }

    fn dict(&mut self) -> Option<Value> {
        self.at += 1;
        let mut map = Map::new();
        loop {
            if self.eat('}') {
                return Some(Value::Object(map));
            }
            let key = match self.value()? {
                Value::String(s) => s,
                // JSON keys are strings; Python's numbers and constants become their text.
                other => other.to_string(),
            };
            if !self.eat(':') {
                return None;
            }
            let value = self.value()?;
            map.insert(key, value);
            if !self.eat(',') {
                return self.eat('}').then_some(Value::Object(map));
            }
        }
    }

    fn sequence(&mut self, open: char, close: char) -> Option<Value> {
        debug_assert_eq!(self.peek(), Some(open));
        self.at += 1;
        let mut items = Vec::new();
        loop {
            if self.eat(close) {
                return Some(Value::Array(items));
            }
            items.push(self.value()?);
            if !self.eat(',') {
                return self.eat(close).then_some(Value::Array(items));
            }
        }
    }

    fn string(&mut self) -> Option<String> {
        let quote = self.peek()?;
        self.at += 1;
        let mut out = String::new();
        loop {
            let c = self.peek()?;
            self.at += 1;
            match c {
                c if c == quote => return Some(out),
                '\\' => {
                    let escaped = self.peek()?;
                    self.at += 1;
                    match escaped {
                        'n' => out.push('\n'),
                        't' => out.push('\t'),
                        'r' => out.push('\r'),
                        '0' => out.push('\0'),
                        'u' | 'x' => {
                            let digits = if escaped == 'u' { 4 } else { 2 };
                            let hex: String = self.chars.get(self.at..self.at + digits)?.iter().collect();
                            self.at += digits;
                            out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                        }
                        other => out.push(other),
                    }
                }
                c => out.push(c),
            }
        }
    }

    fn word(&mut self) -> Option<Value> {
        let start = self.at;
        while self.peek().is_some_and(|c| c.is_alphanumeric() || matches!(c, '.' | '-' | '+' | '_')) {
            self.at += 1;
        }
        let word: String = self.chars[start..self.at].iter().collect();
        match word.as_str() {
            "True" | "true" => Some(Value::Bool(true)),
            "False" | "false" => Some(Value::Bool(false)),
            "None" | "null" => Some(Value::Null),
            _ => number(&word),
        }
    }
}

/// A number as JSON writes it: integers stay integers.
pub fn number(text: &str) -> Option<Value> {
    let text = text.replace('_', "");
    if let Ok(n) = text.parse::<i64>() {
        return Some(Value::Number(n.into()));
    }
    let float: f64 = text.parse().ok()?;
    Number::from_f64(float).map(Value::Number)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn python_literals_become_json() {
        assert_eq!(parse("{'a': None, 'b': True, \"c\": [1, 2.5, (3, 'x')], 'd': {'e': False}}"), Some(json!({"a": null, "b": true, "c": [1, 2.5, [3, "x"]], "d": {"e": false}})));
        assert_eq!(parse("['it\\'s', \"tab\\there\"]"), Some(json!(["it's", "tab\there"])));
        assert_eq!(parse("  -12 "), Some(json!(-12)));
        assert_eq!(parse("1e3"), Some(json!(1000.0)));
        assert_eq!(parse("{}"), Some(json!({})));
        assert_eq!(parse("[1, 2,]"), Some(json!([1, 2])));
    }

    #[test]
    fn other_text_is_not_a_literal() {
        for text in ["hello world", "{'a': 1", "[1 2]", "{'a' 1}", "", "nan?", "'open"] {
            assert_eq!(parse(text), None, "{text:?}");
        }
    }
}
