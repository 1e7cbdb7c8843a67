//! Generated tokens to response pieces: streaming detokenization, then stop strings, then (when the
//! request offered tools) tool-call parsing. The same path serves streamed and whole responses, so
//! both always say the same thing.

use crate::tokenizer::stop_strings::StopStringMatcher;
use super::tool_calls::{OutputPiece, ToolCallParser};
use crate::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

pub struct OutputText<'t> {
    decoder: StreamDecoder<'t>,
    stops: StopStringMatcher,
    tool_calls: Option<ToolCallParser>,
    /// Tokens that contributed to the output (those after a stop string do not).
    tokens_used: usize,
    stopped_by_string: bool,
}

impl<'t> OutputText<'t> {
    pub fn new(tokenizer: &'t Tokenizer, stop_strings: Vec<String>, parse_tool_calls: bool) -> Self {
        OutputText {
            decoder: tokenizer.stream_decoder(true),
            stops: StopStringMatcher::new(stop_strings),
            tool_calls: parse_tool_calls.then(ToolCallParser::new),
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
        match self.tool_calls.as_mut() {
            Some(parser) => {
                pieces.extend(parser.push(&held));
                pieces.extend(parser.finish());
            }
            None if !held.is_empty() => pieces.push(OutputPiece::Text(held)),
            None => {}
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
        match self.tool_calls.as_mut() {
            Some(parser) => pieces.extend(parser.push(&scan.text)),
            None => pieces.push(OutputPiece::Text(scan.text)),
        }
    }
}
