//! The conventions of a model's chat template that its generated text follows, and parsing that
//! text back into an answer: how the model calls tools (Qwen2.5 / Qwen3 write JSON inside
//! `<tool_call>` tags, Qwen3.5 / Qwen3.6 an XML `<function=NAME>` block with one
//! `<parameter=KEY>` per argument), and whether it reasons in a `<think>` block before it answers.
//!
//! The conventions are read from the template source, so the model's own template decides; the
//! parsers accept both tool-call forms whatever the template says, since a model may drift.

pub mod python_literal;
pub mod reasoning;
pub mod tool_calls;
pub mod tool_grammar;
mod xml_tool_call;

use crate::tokenizer::Tokenizer;

pub use reasoning::{ReasoningPart, ReasoningSplitter};
pub use tool_calls::{OutputPiece, ParsedToolCall, ToolCallParser, ToolSchemas};

/// How a template asks the model to call tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallSyntax {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Qwen2.5, Qwen3).
    Json,
    /// `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`
    /// (Qwen3.5, Qwen3.6, Qwen3-Coder).
    Xml,
}

/// What the chat template tells about the text the model generates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatFormat {
    pub tool_calls: ToolCallSyntax,
    /// The template knows `<think>` blocks: the model may reason before its answer.
    pub thinking: bool,
}

impl Default for ChatFormat {
    fn default() -> Self {
        ChatFormat { tool_calls: ToolCallSyntax::Json, thinking: false }
    }
}

impl ChatFormat {
    /// The conventions of one template source.
    pub fn from_template(source: &str) -> Self {
        let tool_calls = if source.contains("<function=") { ToolCallSyntax::Xml } else { ToolCallSyntax::Json };
        ChatFormat { tool_calls, thinking: source.contains("<think>") }
    }

    /// The conventions of the template `tokenizer` renders a conversation with (or without)
    /// tools by; the defaults when it has none.
    pub fn of(tokenizer: &Tokenizer, has_tools: bool) -> Self {
        tokenizer.chat_template_source(has_tools).map(Self::from_template).unwrap_or_default()
    }
}

/// Whether a rendered prompt leaves the model inside a `<think>` block (Qwen3.5's generation
/// prompt opens one unless thinking is turned off), so that its output starts as reasoning.
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    match (prompt.rfind(reasoning::THINK_OPEN), prompt.rfind(reasoning::THINK_CLOSE)) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syntax_and_thinking_come_from_the_template() {
        let qwen35 = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<think>\\n' }}";
        assert_eq!(ChatFormat::from_template(qwen35), ChatFormat { tool_calls: ToolCallSyntax::Xml, thinking: true });
        let qwen25 = "{{- '<tool_call>\\n{\"name\": \"' }}";
        assert_eq!(ChatFormat::from_template(qwen25), ChatFormat { tool_calls: ToolCallSyntax::Json, thinking: false });
    }

    #[test]
    fn an_open_think_block_at_the_end_of_the_prompt_is_found() {
        assert!(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!prompt_opens_reasoning("<|im_start|>assistant\n"));
        assert!(prompt_opens_reasoning("<think>a</think> user <|im_start|>assistant\n<think>\n"));
    }
}
