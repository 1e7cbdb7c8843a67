//! What the chat screen shows, separate from the engine session that fills it, so that the
//! drawing code can be tested on a headless terminal.

use super::input::InputEditor;
use crate::engine::metrics::SpecStats;
use crate::engine::request::SpecMethod;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speaker {
    User,
    Assistant,
    /// Help text and notices from the app itself; never sent to the model.
    Note,
    Error,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub speaker: Speaker,
    pub text: String,
    /// A thinking model's reasoning before its answer (shown dimmed, folded unless asked for).
    pub reasoning: String,
    /// Set on an assistant reply that Ctrl-C cut short, or that hit the token limit.
    pub ending: Option<&'static str>,
}

impl Entry {
    pub fn new(speaker: Speaker, text: impl Into<String>) -> Self {
        Entry { speaker, text: text.into(), reasoning: String::new(), ending: None }
    }
}

/// Per-request sampling and speculation settings, changed by `/spec` and `/temp`.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub spec: SpecMethod,
    /// Drafts per step, fixed when the engine starts.
    pub spec_tokens: usize,
    pub temperature: f32,
    pub max_tokens: usize,
}

/// Timing and speculation figures of the reply being generated (or the last one).
#[derive(Debug, Clone)]
pub struct ReplyStats {
    pub method: SpecMethod,
    pub submitted_at: Instant,
    pub first_token_at: Option<Instant>,
    pub finished_at: Option<Instant>,
    pub tokens: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache (known once the engine admitted the request).
    pub cached_tokens: Option<usize>,
    pub spec: SpecStats,
}

impl ReplyStats {
    pub fn new(method: SpecMethod, prompt_tokens: usize, submitted_at: Instant) -> Self {
        ReplyStats { method, submitted_at, first_token_at: None, finished_at: None, tokens: 0, prompt_tokens, cached_tokens: None, spec: SpecStats::default() }
    }

    pub fn ttft(&self) -> Option<Duration> {
        self.first_token_at.map(|t| t.duration_since(self.submitted_at))
    }

    /// Tokens per second after the first token (the decode rate), up to now or the end.
    pub fn decode_rate(&self, now: Instant) -> Option<f64> {
        let first = self.first_token_at?;
        let end = self.finished_at.unwrap_or(now);
        let seconds = end.duration_since(first).as_secs_f64();
        (self.tokens > 1 && seconds > 0.0).then(|| (self.tokens - 1) as f64 / seconds)
    }
}

/// The status line: a hint, or the latest error.
#[derive(Debug, Clone, PartialEq)]
pub enum Status {
    Hint(String),
    Error(String),
}

/// Everything drawn on the screen.
pub struct ChatView {
    pub model_name: String,
    pub transcript: Vec<Entry>,
    pub input: InputEditor,
    /// Lines scrolled up from the newest; 0 follows the conversation as it grows.
    pub scroll_from_bottom: usize,
    pub status: Status,
    pub reply: Option<ReplyStats>,
    pub settings: Settings,
    pub generating: bool,
    /// Unfold every reply's reasoning (`/reasoning` toggles it).
    pub show_reasoning: bool,
}

impl ChatView {
    pub fn new(model_name: String, settings: Settings) -> Self {
        ChatView {
            model_name,
            transcript: Vec::new(),
            input: InputEditor::new(),
            scroll_from_bottom: 0,
            status: Status::Hint(IDLE_HINT.to_string()),
            reply: None,
            settings,
            generating: false,
            show_reasoning: false,
        }
    }

    pub fn note(&mut self, text: impl Into<String>) {
        self.transcript.push(Entry::new(Speaker::Note, text));
        self.scroll_from_bottom = 0;
    }

    /// Shows an error in the conversation and on the status line.
    pub fn error(&mut self, text: impl Into<String>) {
        let text = text.into();
        self.status = Status::Error(text.clone());
        self.transcript.push(Entry::new(Speaker::Error, text));
        self.scroll_from_bottom = 0;
    }
}

pub const IDLE_HINT: &str = "Enter send · Alt-Enter newline · PgUp/PgDn scroll · /help";
pub const QUIT_HINT: &str = "Press Esc or Ctrl-C again to quit (the conversation is not kept); any other key carries on";
pub const GENERATING_HINT: &str = "generating… Ctrl-C stops the reply";

pub const HELP_TEXT: &str = "\
Commands:
  /clear               forget the conversation
  /spec none|ngram|mtp speculation method for the next replies
  /temp T              sampling temperature (0 = greedy)
  /reasoning           show or fold the reasoning of thinking models
  /help                this text
  /quit                leave (also Esc, Ctrl-D, or Ctrl-C when idle, pressed twice)
Keys:
  Enter send · Alt-Enter, Shift-Enter or Ctrl-J new line · ↑/↓ earlier messages
  PgUp/PgDn scroll · Ctrl-C stops a reply";
