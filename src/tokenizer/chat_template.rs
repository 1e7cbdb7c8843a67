//! Chat templates: Jinja templates from `tokenizer_config.json` rendered with
//! minijinja, set up to behave like transformers' `apply_chat_template`.
//!
//! transformers renders with jinja2 (`trim_blocks`, `lstrip_blocks`, loop
//! controls) plus `raise_exception`, `strftime_now` and its own `tojson`.
//! Models are trained on exactly that output, so every difference here is a
//! prompt the model has never seen.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Deserializer, Serialize};

use super::python_json::tojson_filter;
use super::strftime::strftime_now;
use super::TokenizerError;

/// The template transformers uses when it has a choice and no tools are given.
pub(crate) const DEFAULT_TEMPLATE_NAME: &str = "default";
/// The template transformers prefers when the request carries tools.
const TOOL_USE_TEMPLATE_NAME: &str = "tool_use";

/// One message of a conversation, as the template sees it.
///
/// Optional fields are left out of the template's view when unset, so that
/// `message.name is defined` behaves as it does for a Python dict without the key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// OpenAI clients send `null` content on assistant tool-call turns; it reads as "".
    #[serde(default, deserialize_with = "null_as_empty_string")]
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The reasoning of an earlier assistant turn (thinking models' templates put it back
    /// between `<think>` tags, or leave it out, as they were trained).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The call a tool message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            name: None,
            reasoning_content: None,
            tool_call_id: None,
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

fn null_as_empty_string<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(deserializer)?.unwrap_or_default())
}

/// The template sources a model ships: either one template, or several by name
/// (transformers' list form, `[{"name": "default", "template": ...}, ...]`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ChatTemplateSources {
    pub templates: Vec<(String, String)>,
    /// The file the templates came from, for error messages.
    pub origin: PathBuf,
}

/// The error `raise_exception` raises, kept as the source of the minijinja
/// error so that rendering can tell a deliberate refusal from a broken template.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedByTemplate(message)))
}

/// A model's chat templates, compiled once, ready to render conversations.
#[derive(Clone)]
pub(crate) struct ChatTemplate {
    environment: Environment<'static>,
    template_names: Vec<String>,
    /// The source of each template, by the index of its name.
    sources: Vec<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("template_names", &self.template_names)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles every template; a syntax error fails here, at load time, with
    /// the file it came from, rather than on the first request.
    pub fn compile(
        sources: ChatTemplateSources,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TokenizerError> {
        let mut environment = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|err| TokenizerError::ChatTemplateSyntax {
                file: sources.origin.clone(),
                template: String::new(),
                message: err.to_string(),
            })?;
        environment.set_syntax(syntax);
        // Prompts are plain text: nothing may be HTML-escaped, whatever the name.
        environment.set_auto_escape_callback(|_| AutoEscape::None);
        environment
            .set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        environment.add_function("raise_exception", raise_exception);
        environment.add_function("strftime_now", |format: String| strftime_now(&format));
        environment.add_filter("tojson", tojson_filter);

        let mut template_names = Vec::new();
        let mut template_sources = Vec::new();
        for (name, source) in sources.templates {
            template_sources.push(source.clone());
            environment
                .add_template_owned(name.clone(), source)
                .map_err(|err| TokenizerError::ChatTemplateSyntax {
                    file: sources.origin.clone(),
                    template: name.clone(),
                    message: describe_template_error(&err),
                })?;
            template_names.push(name);
        }
        Ok(ChatTemplate {
            environment,
            template_names,
            sources: template_sources,
            bos_token,
            eos_token,
        })
    }

    /// transformers' choice among named templates: `tool_use` when tools are
    /// given and it exists, else `default`, else the only one there is.
    fn select_template_name(&self, has_tools: bool) -> Result<&str, TokenizerError> {
        let find = |wanted: &str| {
            self.template_names
                .iter()
                .find(|name| name.as_str() == wanted)
        };
        if has_tools {
            if let Some(name) = find(TOOL_USE_TEMPLATE_NAME) {
                return Ok(name);
            }
        }
        if let Some(name) = find(DEFAULT_TEMPLATE_NAME) {
            return Ok(name);
        }
        match self.template_names.as_slice() {
            [only] => Ok(only),
            _ => Err(TokenizerError::ChatTemplate {
                message: format!(
                    "the model has several chat templates ({}) and none is named \"default\"",
                    self.template_names.join(", ")
                ),
            }),
        }
    }

    /// The source of the template a conversation with (or without) tools is rendered by.
    pub fn source(&self, has_tools: bool) -> Result<&str, TokenizerError> {
        let name = self.select_template_name(has_tools)?;
        let index = self.template_names.iter().position(|n| n == name).expect("a selected name is one of the names");
        Ok(&self.sources[index])
    }

    /// Renders a conversation. `extra` holds further template variables (transformers'
    /// `chat_template_kwargs`, e.g. `enable_thinking`); they cannot replace the variables set
    /// here.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        let name = self.select_template_name(tools.is_some())?;
        let template =
            self.environment
                .get_template(name)
                .map_err(|err| TokenizerError::ChatTemplate {
                    message: describe_template_error(&err),
                })?;

        // transformers passes `tools=None` when there are none, so `tools` is
        // always defined; the special tokens appear only when the model has them.
        let mut variables: BTreeMap<&str, Value> = BTreeMap::new();
        for (key, value) in extra {
            variables.insert(key.as_str(), Value::from(Serde(value)));
        }
        variables.insert("messages", Value::from(Serde(messages)));
        variables.insert("add_generation_prompt", Value::from(add_generation_prompt));
        variables.insert(
            "tools",
            tools
                .map(|tools| Value::from(Serde(tools)))
                .unwrap_or(Value::from(())),
        );
        if let Some(bos_token) = &self.bos_token {
            variables.insert("bos_token", Value::from(bos_token.as_str()));
        }
        if let Some(eos_token) = &self.eos_token {
            variables.insert("eos_token", Value::from(eos_token.as_str()));
        }

        template
            .render(variables)
            .map_err(|err| match raised_message(&err) {
                Some(message) => TokenizerError::ChatTemplateRaised { message },
                None => TokenizerError::ChatTemplate {
                    message: describe_template_error(&err),
                },
            })
    }
}

/// The message given to `raise_exception`, if that is what stopped rendering.
fn raised_message(err: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(err);
    while let Some(current) = source {
        if let Some(raised) = current.downcast_ref::<RaisedByTemplate>() {
            return Some(raised.0.clone());
        }
        source = current.source();
    }
    None
}

/// minijinja's message with the template line, without the multi-line source dump.
fn describe_template_error(err: &Error) -> String {
    let mut message = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(current) = source {
        message.push_str(": ");
        message.push_str(&current.to_string());
        source = current.source();
    }
    message
}

#[cfg(test)]
#[path = "chat_template_tests.rs"]
mod tests;
