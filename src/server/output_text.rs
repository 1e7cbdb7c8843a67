//! Generated tokens to response pieces: streaming detokenization, then stop strings, then (for a
//! thinking model) the reasoning split, then (when the request offered tools) tool-call parsing
//! of the answer. The same path serves streamed and whole responses, so both always say the
//! same thing.

use crate::chat_format::{OutputPiece, ReasoningPart, ReasoningSplitter, ToolCallParser, ToolSchemas};
use crate::tokenizer::stop_strings::StopStringMatcher;
use crate::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

/// How the text of a chat answer is read.
#[derive(Debug, Default)]
pub struct OutputParsing {
    /// Split reasoning off: `Some(opened_in_prompt)` for a thinking model.
    pub reasoning: Option<bool>,
    /// Parse tool calls in the answer, typed by these schemas.
    pub tool_calls: Option<ToolSchemas>,
}

pub struct OutputText<'t> {
    decoder: StreamDecoder<'t>,
    stops: StopStringMatcher,
    reasoning: Option<ReasoningSplitter>,
    tool_calls: Option<ToolCallParser>,
    /// Tokens that contributed to the output (those after a stop string do not).
    tokens_used: usize,
    stopped_by_string: bool,
}

impl<'t> OutputText<'t> {
    pub fn new(tokenizer: &'t Tokenizer, stop_strings: Vec<String>, parsing: OutputParsing) -> Self {
        OutputText {
            decoder: tokenizer.stream_decoder(true),
            stops: StopStringMatcher::new(stop_strings),
            reasoning: parsing.reasoning.map(ReasoningSplitter::new),
            tool_calls: parsing.tool_calls.map(ToolCallParser::new),
            tokens_used: 0,
            stopped_by_string: false,
        }
    }

    /// Adds generated tokens. After a stop string was found the rest is ignored; check
    /// [`stopped_by_string`](Self::stopped_by_string) to cancel the generation.
    pub fn push_tokens(&mut self, tokens: &[u32]) -> Result<Vec<OutputPiece>, TokenizerError> {
        let mut pieces = Vec::new();
        for &token in tokens {
            if self.stopped_by_string {
                break;
            }
            self.tokens_used += 1;
            if let Some(delta) = self.decoder.push(token)? {
                self.scan(&delta, &mut pieces);
            }
        }
        Ok(pieces)
    }

    /// Generation ended: releases everything held back.
    pub fn finish(&mut self) -> Result<Vec<OutputPiece>, TokenizerError> {
        let mut pieces = Vec::new();
        if !self.stopped_by_string {
            if let Some(delta) = self.decoder.flush()? {
                self.scan(&delta, &mut pieces);
            }
        }
        let held = if self.stopped_by_string { String::new() } else { self.stops.finish() };
        let mut parts = self.split_reasoning(&held);
        if let Some(splitter) = self.reasoning.as_mut() {
            parts.extend(splitter.finish());
        }
        self.parse_answer(parts, &mut pieces);
        if let Some(parser) = self.tool_calls.as_mut() {
            pieces.extend(parser.finish());
        }
        Ok(pieces)
    }

    pub fn stopped_by_string(&self) -> bool {
        self.stopped_by_string
    }

    pub fn tokens_used(&self) -> usize {
        self.tokens_used
    }

    pub fn tool_calls_seen(&self) -> usize {
        self.tool_calls.as_ref().map_or(0, ToolCallParser::calls_seen)
    }

    fn scan(&mut self, delta: &str, pieces: &mut Vec<OutputPiece>) {
        let scan = self.stops.push(delta);
        self.stopped_by_string = scan.stopped;
        if scan.text.is_empty() {
            return;
        }
        let parts = self.split_reasoning(&scan.text);
        self.parse_answer(parts, pieces);
    }

    fn split_reasoning(&mut self, text: &str) -> Vec<ReasoningPart> {
        match self.reasoning.as_mut() {
            Some(splitter) => splitter.push(text),
            None if text.is_empty() => Vec::new(),
            None => vec![ReasoningPart::Content(text.to_string())],
        }
    }

    fn parse_answer(&mut self, parts: Vec<ReasoningPart>, pieces: &mut Vec<OutputPiece>) {
        for part in parts {
            match part {
                ReasoningPart::Reasoning(text) => pieces.push(OutputPiece::Reasoning(text)),
                ReasoningPart::Content(text) => match self.tool_calls.as_mut() {
                    Some(parser) => pieces.extend(parser.push(&text)),
                    None => pieces.push(OutputPiece::Text(text)),
                },
            }
        }
    }
}
