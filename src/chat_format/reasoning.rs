//! Splitting a thinking model's output into its reasoning and its answer, as it streams.
//!
//! Qwen3 and Qwen3.5 / 3.6 reason inside `<think> … </think>` before answering. The reasoning
//! starts either in the prompt (Qwen3.5's generation prompt opens the block) or at the very start
//! of the output. What vLLM's reasoning parsers learned is kept: a `<tool_call>` inside a block
//! that was never closed ends the reasoning (the model went on to act), and a block that is never
//! closed at all is reasoning to the end. The newlines the template puts around the reasoning
//! and before the answer are formatting, not text, and are dropped.

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";
const TOOL_CALL_OPEN: &str = "<tool_call>";

/// A piece of output, on one side of the split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReasoningPart {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: the output may still open a `<think>` block.
    Start,
    /// Inside the block; `at_start` until its first character of text.
    Reasoning { at_start: bool },
    /// The answer; `at_start` until its first character of text.
    Content { at_start: bool },
}

#[derive(Debug)]
pub struct ReasoningSplitter {
    state: State,
    /// Text not yet given out: a possible tag, or newlines that may end the reasoning.
    held: String,
}

impl ReasoningSplitter {
    /// `opened_in_prompt`: the prompt ends inside a `<think>` block
    /// ([`super::prompt_opens_reasoning`]).
    pub fn new(opened_in_prompt: bool) -> Self {
        let state = if opened_in_prompt { State::Reasoning { at_start: true } } else { State::Start };
        ReasoningSplitter { state, held: String::new() }
    }

    /// True while the output is (still) reasoning.
    pub fn in_reasoning(&self) -> bool {
        matches!(self.state, State::Reasoning { .. })
    }

    pub fn push(&mut self, delta: &str) -> Vec<ReasoningPart> {
        let mut out = Vec::new();
        self.held.push_str(delta);
        loop {
            match self.state {
                State::Start => {
                    let trimmed = self.held.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(THINK_OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Reasoning { at_start: true };
                    } else if THINK_OPEN.starts_with(trimmed) {
                        return out;
                    } else {
                        self.state = State::Content { at_start: false };
                    }
                }
                State::Reasoning { at_start } => {
                    let close = self.held.find(THINK_CLOSE).map(|at| (at, THINK_CLOSE.len(), true));
                    let call = self.held.find(TOOL_CALL_OPEN).map(|at| (at, 0, false));
                    let end = match (close, call) {
                        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
                        (a, b) => a.or(b),
                    };
                    match end {
                        Some((at, skip, closed)) => {
                            let reasoning = self.held[..at].to_string();
                            self.held.drain(..at + skip);
                            push_reasoning(&mut out, reasoning_text(&reasoning, at_start).trim_end_matches('\n'));
                            // After `</think>` the template's blank line goes; a tool call's tag stays.
                            self.state = State::Content { at_start: closed };
                        }
                        None => {
                            let keep = partial_suffix(&self.held, &[THINK_CLOSE, TOOL_CALL_OPEN]);
                            let ready_end = self.held.len() - keep;
                            // Newlines right before a possible `</think>` wait: they may be its formatting.
                            let ready_end = self.held[..ready_end].trim_end_matches('\n').len();
                            let ready: String = self.held.drain(..ready_end).collect();
                            let text = reasoning_text(&ready, at_start);
                            if !text.is_empty() {
                                self.state = State::Reasoning { at_start: false };
                            }
                            push_reasoning(&mut out, text);
                            return out;
                        }
                    }
                }
                State::Content { at_start } => {
                    let text = std::mem::take(&mut self.held);
                    let text = if at_start { text.trim_start().to_string() } else { text };
                    if !text.is_empty() {
                        self.state = State::Content { at_start: false };
                        out.push(ReasoningPart::Content(text));
                    }
                    return out;
                }
            }
        }
    }

    /// The output ended: gives out what was held back.
    pub fn finish(&mut self) -> Vec<ReasoningPart> {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Start if !held.is_empty() => vec![ReasoningPart::Content(held)],
            State::Reasoning { at_start } => {
                let text = reasoning_text(&held, at_start).trim_end_matches('\n').to_string();
                if text.is_empty() {
                    Vec::new()
                } else {
                    vec![ReasoningPart::Reasoning(text)]
                }
            }
            _ => Vec::new(),
        }
    }
}

/// Reasoning text with the newline after `<think>` dropped while the block has no text yet.
fn reasoning_text(text: &str, at_start: bool) -> &str {
    if at_start {
        text.trim_start_matches('\n')
    } else {
        text
    }
}

fn push_reasoning(out: &mut Vec<ReasoningPart>, text: &str) {
    if !text.is_empty() {
        out.push(ReasoningPart::Reasoning(text.to_string()));
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `tags`.
pub(crate) fn partial_suffix(text: &str, tags: &[&str]) -> usize {
    let longest = tags.iter().map(|t| t.len()).max().unwrap_or(0);
    (1..longest.min(text.len() + 1))
        .rev()
        .find(|&len| text.is_char_boundary(text.len() - len) && tags.iter().any(|tag| tag.len() > len && tag.starts_with(&text[text.len() - len..])))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reasoning and content of `text` fed in pieces of `size` characters, each side joined.
    fn split(opened: bool, text: &str, size: usize) -> (String, String) {
        let mut splitter = ReasoningSplitter::new(opened);
        let chars: Vec<char> = text.chars().collect();
        let mut parts = Vec::new();
        for piece in chars.chunks(size.max(1)) {
            parts.extend(splitter.push(&piece.iter().collect::<String>()));
        }
        parts.extend(splitter.finish());
        let (mut reasoning, mut content) = (String::new(), String::new());
        for part in parts {
            match part {
                ReasoningPart::Reasoning(t) => reasoning.push_str(&t),
                ReasoningPart::Content(t) => content.push_str(&t),
            }
        }
        (reasoning, content)
    }

    fn every_split(opened: bool, text: &str) -> (String, String) {
        let whole = split(opened, text, usize::MAX >> 8);
        for size in 1..8 {
            assert_eq!(split(opened, text, size), whole, "pieces of {size} characters");
        }
        whole
    }

    #[test]
    fn a_block_opened_by_the_prompt_is_reasoning_until_it_closes() {
        let (reasoning, content) = every_split(true, "\nThe user wants 2+2.\nIt is 4.\n</think>\n\nIt is 4.");
        assert_eq!(reasoning, "The user wants 2+2.\nIt is 4.");
        assert_eq!(content, "It is 4.");
    }

    #[test]
    fn a_block_at_the_start_of_the_output_is_reasoning() {
        assert_eq!(every_split(false, "<think>\nhmm\n</think>\n\nAnswer"), ("hmm".into(), "Answer".into()));
        assert_eq!(every_split(false, "\n<think>x</think>y"), ("x".into(), "y".into()));
        assert_eq!(every_split(false, "<think>\n\n</think>\n\nAnswer"), (String::new(), "Answer".into()));
    }

    #[test]
    fn output_without_a_block_is_all_content() {
        assert_eq!(every_split(false, "Plain <think> later is text"), (String::new(), "Plain <think> later is text".into()));
        assert_eq!(every_split(false, "\n\nHi"), (String::new(), "\n\nHi".into()));
        assert_eq!(every_split(false, "<thin"), (String::new(), "<thin".into()));
    }

    #[test]
    fn a_tool_call_inside_an_unclosed_block_ends_the_reasoning() {
        let text = "\nI should look it up.\n<tool_call>\n<function=f>\n</function>\n</tool_call>";
        let (reasoning, content) = every_split(true, text);
        assert_eq!(reasoning, "I should look it up.");
        assert_eq!(content, "<tool_call>\n<function=f>\n</function>\n</tool_call>");
    }

    #[test]
    fn a_block_that_never_closes_is_reasoning_to_the_end() {
        assert_eq!(every_split(true, "\nstill thinking\n\n"), ("still thinking".into(), String::new()));
        assert_eq!(every_split(true, "\nends in </thi"), ("ends in </thi".into(), String::new()));
    }

    #[test]
    fn newlines_inside_the_reasoning_are_kept() {
        assert_eq!(every_split(true, "a\n\nb\n</think>c"), ("a\n\nb".into(), "c".into()));
    }
}
