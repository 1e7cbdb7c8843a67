//! The parts of `tokenizer_config.json` that generation needs: the chat
//! template, the BOS/EOS tokens and the added-token table.
//!
//! The file is written by transformers from Python objects, so the same field
//! comes in several shapes (a token is a string or an `AddedToken` dict, the
//! template is a string or a list of named templates). Each field is read by
//! hand so that a wrong shape names the field instead of failing serde-style.

use std::path::Path;

use serde_json::Value as Json;

use super::chat_template::{ChatTemplateSources, DEFAULT_TEMPLATE_NAME};
use super::TokenizerError;

/// An entry of `added_tokens_decoder`: a token the config declares at a fixed id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeclaredAddedToken {
    pub id: u32,
    pub content: String,
    pub special: bool,
    pub lstrip: bool,
    pub rstrip: bool,
    pub single_word: bool,
    pub normalized: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct TokenizerConfig {
    pub chat_template: Option<ChatTemplateSources>,
    pub bos_token: Option<String>,
    /// Usually one token; a list is accepted because some configs give several.
    pub eos_tokens: Vec<String>,
    /// Sorted by id, so adding them in order reproduces the declared ids.
    pub added_tokens: Vec<DeclaredAddedToken>,
}

impl TokenizerConfig {
    pub fn parse(bytes: &[u8], origin: &Path) -> Result<Self, TokenizerError> {
        let invalid = |message: String| TokenizerError::InvalidTokenizerConfig {
            file: origin.to_path_buf(),
            message,
        };
        let root: Json = serde_json::from_slice(bytes).map_err(|err| invalid(err.to_string()))?;
        let Json::Object(fields) = &root else {
            return Err(invalid(format!(
                "expected a JSON object, found {}",
                json_kind(&root)
            )));
        };

        let chat_template = match fields.get("chat_template") {
            Some(field) => parse_chat_template_field(field, origin)?,
            None => None,
        };
        let bos_token = match fields.get("bos_token") {
            Some(field) => special_token_content(field, "bos_token").map_err(invalid)?,
            None => None,
        };
        let eos_tokens = match fields.get("eos_token") {
            Some(Json::Array(entries)) => {
                let mut tokens = Vec::new();
                for (index, entry) in entries.iter().enumerate() {
                    let field = format!("eos_token[{index}]");
                    tokens.extend(special_token_content(entry, &field).map_err(invalid)?);
                }
                tokens
            }
            Some(field) => special_token_content(field, "eos_token")
                .map_err(invalid)?
                .into_iter()
                .collect(),
            None => Vec::new(),
        };
        let added_tokens = match fields.get("added_tokens_decoder") {
            Some(field) => parse_added_tokens_decoder(field).map_err(invalid)?,
            None => Vec::new(),
        };

        Ok(TokenizerConfig {
            chat_template,
            bos_token,
            eos_tokens,
            added_tokens,
        })
    }
}

/// A special token is written as `"<s>"`, as `{"content": "<s>", ...}` (a
/// serialized `AddedToken`), or as `null` when the model has none.
fn special_token_content(field: &Json, name: &str) -> Result<Option<String>, String> {
    match field {
        Json::Null => Ok(None),
        Json::String(content) => Ok(Some(content.clone())),
        Json::Object(token) => match token.get("content") {
            Some(Json::String(content)) => Ok(Some(content.clone())),
            _ => Err(format!(
                "{name} is an object without a string \"content\" field"
            )),
        },
        other => Err(format!(
            "{name} must be a string or an object with \"content\", found {}",
            json_kind(other)
        )),
    }
}

/// Reads the `chat_template` field of `tokenizer_config.json`: a string, or a
/// list of `{"name", "template"}` objects.
fn parse_chat_template_field(
    field: &Json,
    origin: &Path,
) -> Result<Option<ChatTemplateSources>, TokenizerError> {
    let invalid = |message: String| TokenizerError::InvalidTokenizerConfig {
        file: origin.to_path_buf(),
        message,
    };
    match field {
        Json::Null => Ok(None),
        Json::String(source) => Ok(Some(ChatTemplateSources {
            templates: vec![(DEFAULT_TEMPLATE_NAME.to_string(), source.clone())],
            origin: origin.to_path_buf(),
        })),
        Json::Array(entries) => {
            let mut templates = Vec::new();
            for (index, entry) in entries.iter().enumerate() {
                let name = entry.get("name").and_then(|v| v.as_str());
                let source = entry.get("template").and_then(|v| v.as_str());
                match (name, source) {
                    (Some(name), Some(source)) => templates.push((name.to_string(), source.to_string())),
                    _ => {
                        return Err(invalid(format!(
                            "chat_template[{index}] must be an object with string fields \"name\" and \"template\""
                        )))
                    }
                }
            }
            if templates.is_empty() {
                return Ok(None);
            }
            Ok(Some(ChatTemplateSources {
                templates,
                origin: origin.to_path_buf(),
            }))
        }
        other => Err(invalid(format!(
            "chat_template must be a string or a list of {{name, template}} objects, found {}",
            json_kind(other)
        ))),
    }
}

fn json_kind(value: &Json) -> &'static str {
    match value {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

fn parse_added_tokens_decoder(field: &Json) -> Result<Vec<DeclaredAddedToken>, String> {
    let Json::Object(entries) = field else {
        return Err(format!(
            "added_tokens_decoder must be an object keyed by token id, found {}",
            json_kind(field)
        ));
    };
    let mut tokens = Vec::with_capacity(entries.len());
    for (key, entry) in entries {
        let id: u32 = key
            .parse()
            .map_err(|_| format!("added_tokens_decoder key {key:?} is not a token id"))?;
        let Json::Object(entry) = entry else {
            return Err(format!(
                "added_tokens_decoder[{key}] must be an object, found {}",
                json_kind(entry)
            ));
        };
        let Some(Json::String(content)) = entry.get("content") else {
            return Err(format!(
                "added_tokens_decoder[{key}] has no string \"content\""
            ));
        };
        let flag = |name: &str, default: bool| -> Result<bool, String> {
            match entry.get(name) {
                None | Some(Json::Null) => Ok(default),
                Some(Json::Bool(value)) => Ok(*value),
                Some(other) => Err(format!(
                    "added_tokens_decoder[{key}].{name} must be a boolean, found {}",
                    json_kind(other)
                )),
            }
        };
        tokens.push(DeclaredAddedToken {
            id,
            content: content.clone(),
            special: flag("special", false)?,
            lstrip: flag("lstrip", false)?,
            rstrip: flag("rstrip", false)?,
            single_word: flag("single_word", false)?,
            // transformers' AddedToken defaults `normalized` to the opposite of `special`.
            normalized: flag("normalized", !flag("special", false)?)?,
        });
    }
    tokens.sort_by_key(|token| token.id);
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn origin() -> PathBuf {
        PathBuf::from("model/tokenizer_config.json")
    }

    #[test]
    fn reads_tokens_in_every_shape_transformers_writes() {
        let config = TokenizerConfig::parse(
            br#"{
                "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
                "eos_token": ["</s>", {"content": "<|eot|>"}],
                "chat_template": "{{ messages }}",
                "added_tokens_decoder": {
                    "7": {"content": "<|eot|>", "special": true},
                    "3": {"content": "</s>", "special": true, "lstrip": true}
                }
            }"#,
            &origin(),
        )
        .expect("config parses");
        assert_eq!(config.bos_token.as_deref(), Some("<s>"));
        assert_eq!(
            config.eos_tokens,
            vec!["</s>".to_string(), "<|eot|>".to_string()]
        );
        let templates = config.chat_template.expect("template present").templates;
        assert_eq!(
            templates,
            vec![("default".to_string(), "{{ messages }}".to_string())]
        );
        let ids: Vec<u32> = config.added_tokens.iter().map(|token| token.id).collect();
        assert_eq!(ids, vec![3, 7], "added tokens are sorted by id");
        assert!(config.added_tokens[0].lstrip && config.added_tokens[0].special);
        assert!(
            !config.added_tokens[0].normalized,
            "special tokens default to not normalized"
        );
    }

    #[test]
    fn reads_named_templates_and_null_tokens() {
        let config = TokenizerConfig::parse(
            br#"{"bos_token": null, "chat_template": [
                {"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]}"#,
            &origin(),
        )
        .expect("config parses");
        assert_eq!(config.bos_token, None);
        assert!(config.eos_tokens.is_empty());
        let names: Vec<String> = config
            .chat_template
            .expect("templates")
            .templates
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        assert_eq!(names, vec!["default".to_string(), "tool_use".to_string()]);
    }

    #[test]
    fn wrong_field_shapes_name_the_field_and_file() {
        let cases: [(&[u8], &str); 5] = [
            (br#"{"eos_token": 5}"#, "eos_token must be a string"),
            (
                br#"{"chat_template": 1}"#,
                "chat_template must be a string or a list",
            ),
            (
                br#"{"chat_template": [{"name": "x"}]}"#,
                "chat_template[0] must be an object",
            ),
            (
                br#"{"added_tokens_decoder": {"abc": {"content": "x"}}}"#,
                "key \"abc\" is not a token id",
            ),
            (br#"[1, 2]"#, "expected a JSON object, found a list"),
        ];
        for (bytes, expected) in cases {
            let err = TokenizerConfig::parse(bytes, &origin()).expect_err("shape is wrong");
            let message = err.to_string();
            assert!(
                matches!(err, TokenizerError::InvalidTokenizerConfig { .. }),
                "{message}"
            );
            assert!(
                message.contains(expected),
                "{message:?} should contain {expected:?}"
            );
            assert!(message.contains("model/tokenizer_config.json"), "{message}");
        }
    }
}
