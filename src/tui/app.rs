//! The chat session: the conversation sent to the model, the reply being generated, and what
//! keys and commands do to them.

use super::keys::{action_for, parse_command, Action, Command};
use super::state::{ChatView, Entry, ReplyStats, Settings, Speaker, Status, GENERATING_HINT, HELP_TEXT, IDLE_HINT, QUIT_HINT};
use crate::chat_format::{prompt_opens_reasoning, ChatFormat, ReasoningPart, ReasoningSplitter};
use crate::engine::request::{FinishReason, Request, SpecMethod};
use crate::backend::sampling::SamplingParams;
use crate::model::ModelFiles;
use crate::engine::worker::{EngineHandle, Generation, GenerationEvent, WorkerError};
use crate::tokenizer::ChatMessage;
use ratatui::crossterm::event::KeyEvent;
use std::sync::Arc;
use std::time::Instant;

/// How the session starts.
#[derive(Debug, Clone)]
pub struct ChatOptions {
    pub model_name: String,
    pub max_tokens: usize,
    /// Base sampling parameters; `/temp` changes the temperature, and each reply uses its own seed.
    pub sampling: SamplingParams,
    pub spec: SpecMethod,
    pub system_prompt: Option<String>,
}

struct ActiveReply {
    generation: Generation,
    generated: Vec<u32>,
    /// Index of the reply's entry in the transcript.
    entry: usize,
    /// A thinking model's reply: `Some(opened_in_prompt)`, its reasoning is split off.
    reasoning: Option<bool>,
}

pub struct App {
    pub view: ChatView,
    engine: EngineHandle,
    files: Arc<ModelFiles>,
    options: ChatOptions,
    /// What the model sees: user and assistant turns (notes and errors are not part of it).
    conversation: Vec<ChatMessage>,
    active: Option<ActiveReply>,
    replies_started: u64,
    /// The last key asked to quit: the next one that does quits.
    quit_asked: bool,
    quit: bool,
}

/// Lines one PgUp/PgDn moves.
const SCROLL_STEP: usize = 10;

impl App {
    pub fn new(engine: EngineHandle, files: Arc<ModelFiles>, options: ChatOptions) -> Self {
        let settings = Settings { spec: options.spec, spec_tokens: engine.info().spec_tokens, temperature: options.sampling.temperature, max_tokens: options.max_tokens };
        let mut view = ChatView::new(options.model_name.clone(), settings);
        view.note(format!("Chatting with {}. Type a message and press Enter; /help lists the commands.", options.model_name));
        App { view, engine, files, options, conversation: Vec::new(), active: None, replies_started: 0, quit_asked: false, quit: false }
    }

    pub fn should_quit(&self) -> bool {
        self.quit
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    pub fn handle_key(&mut self, key: KeyEvent) {
        let action = action_for(key, self.active.is_some());
        if action != Action::Quit {
            self.carry_on();
        }
        let input = &mut self.view.input;
        match action {
            Action::Submit => self.submit(),
            Action::Newline => input.insert_newline(),
            Action::Insert(c) => input.insert_char(c),
            Action::Backspace => input.backspace(),
            Action::Delete => input.delete(),
            Action::Left => input.move_left(),
            Action::Right => input.move_right(),
            Action::Home => input.home(),
            Action::End => input.end(),
            Action::Up => input.up(),
            Action::Down => input.down(),
            Action::ScrollUp => self.view.scroll_from_bottom += SCROLL_STEP,
            Action::ScrollDown => self.view.scroll_from_bottom = self.view.scroll_from_bottom.saturating_sub(SCROLL_STEP),
            Action::StopReply => {
                if let Some(active) = &self.active {
                    active.generation.cancel();
                }
            }
            Action::Quit => self.ask_to_quit(),
            Action::Ignore => {}
        }
    }

    pub fn paste(&mut self, text: &str) {
        self.carry_on();
        self.view.input.insert_str(text);
    }

    /// A quit key quits only when pressed twice in a row: one stray Esc must not lose the
    /// conversation.
    fn ask_to_quit(&mut self) {
        if self.quit_asked {
            self.quit = true;
        } else {
            self.quit_asked = true;
            self.view.status = Status::Hint(QUIT_HINT.into());
        }
    }

    /// Any other key withdraws a pending quit.
    fn carry_on(&mut self) {
        if std::mem::take(&mut self.quit_asked) && self.view.status == Status::Hint(QUIT_HINT.into()) {
            self.view.status = Status::Hint(if self.active.is_some() { GENERATING_HINT } else { IDLE_HINT }.into());
        }
    }

    fn submit(&mut self) {
        if self.view.input.text().trim().is_empty() {
            return;
        }
        if let Some(command) = parse_command(&self.view.input.text()) {
            self.view.input.take();
            match command {
                Ok(command) => self.run_command(command),
                Err(message) => self.view.error(message),
            }
            return;
        }
        if self.active.is_some() {
            self.view.status = Status::Error("a reply is still being generated: wait, or press Ctrl-C to stop it".into());
            return;
        }
        let text = self.view.input.take();
        self.view.transcript.push(Entry::new(Speaker::User, text.clone()));
        self.view.scroll_from_bottom = 0;
        self.conversation.push(ChatMessage::user(text));
        if let Err(message) = self.start_reply() {
            // The message got no answer: it must not stay in the conversation the model sees.
            self.conversation.pop();
            self.view.error(message);
        }
    }

    fn run_command(&mut self, command: Command) {
        match command {
            Command::Clear => {
                if let Some(active) = self.active.take() {
                    active.generation.cancel();
                }
                self.conversation.clear();
                self.view.transcript.clear();
                self.view.reply = None;
                self.view.generating = false;
                self.view.scroll_from_bottom = 0;
                self.view.status = Status::Hint(IDLE_HINT.into());
                self.view.note("Conversation cleared.");
            }
            Command::Spec(SpecMethod::Mtp) if !self.engine.info().has_mtp_head => {
                self.view.error("this model has no MTP head (mtp.* tensors); use /spec ngram or /spec none");
            }
            Command::Spec(method) => {
                self.view.settings.spec = method;
                self.view.note(format!("Speculation for the next replies: {} (k = {}).", method.name(), self.view.settings.spec_tokens));
            }
            Command::Temperature(t) => {
                self.view.settings.temperature = t;
                self.view.note(if t == 0.0 { "Temperature 0: greedy decoding.".to_string() } else { format!("Temperature {t}.") });
            }
            Command::Reasoning => {
                self.view.show_reasoning = !self.view.show_reasoning;
                self.view.note(if self.view.show_reasoning { "Reasoning is shown." } else { "Reasoning is folded." });
            }
            Command::Help => self.view.note(HELP_TEXT),
            Command::Quit => self.quit = true,
        }
    }

    /// Renders the conversation, dropping the oldest turns if it outgrew the context, and queues
    /// the reply.
    fn start_reply(&mut self) -> Result<(), String> {
        let context = self.engine.info().max_model_len;
        let mut first_turn = 0;
        let (prompt_ids, dropped, opened) = loop {
            let mut messages: Vec<ChatMessage> = self.options.system_prompt.iter().map(ChatMessage::system).collect();
            messages.extend_from_slice(&self.conversation[first_turn..]);
            let text = self.files.tokenizer.apply_chat_template(&messages, true, None).map_err(|err| format!("cannot apply the chat template: {err}"))?;
            let ids = self.files.tokenizer.encode(&text, false).map_err(|err| format!("cannot tokenize the conversation: {err}"))?;
            if ids.len() < context {
                break (ids, first_turn, prompt_opens_reasoning(&text));
            }
            // Keep the newest message; older turns go in user/assistant pairs.
            if self.conversation.len() - first_turn <= 1 {
                return Err(format!("the message is {} tokens long, more than the context of {context} tokens", ids.len()));
            }
            first_turn += 2.min(self.conversation.len() - first_turn - 1);
        };
        if dropped > 0 {
            self.conversation.drain(..dropped);
            self.view.note(format!("The conversation outgrew the context of {context} tokens: the {dropped} oldest messages are forgotten."));
        }
        let max_tokens = self.options.max_tokens.min(context - prompt_ids.len());
        let prompt_tokens = prompt_ids.len();
        self.replies_started += 1;
        let params = SamplingParams {
            temperature: self.view.settings.temperature,
            // Each reply draws its own noise, so asking again gives another answer when sampling.
            seed: self.options.sampling.seed.wrapping_add(self.replies_started),
            ..self.options.sampling.clone()
        };
        let request = Request { spec: Some(self.view.settings.spec), ..Request::new(prompt_ids, params, max_tokens, self.files.chat_stop_token_ids()) };
        let generation = self.engine.submit(request).map_err(|err| err.to_string())?;
        self.view.transcript.push(Entry::new(Speaker::Assistant, ""));
        let reasoning = ChatFormat::of(&self.files.tokenizer, false).thinking.then_some(opened);
        self.active = Some(ActiveReply { generation, generated: Vec::new(), entry: self.view.transcript.len() - 1, reasoning });
        self.view.reply = Some(ReplyStats::new(self.view.settings.spec, prompt_tokens, Instant::now()));
        self.view.generating = true;
        self.view.status = Status::Hint(GENERATING_HINT.into());
        Ok(())
    }

    /// Takes what the engine produced since the last call. Returns true when something changed.
    pub fn poll_generation(&mut self) -> bool {
        let mut changed = false;
        loop {
            let Some(active) = self.active.as_mut() else { return changed };
            let event = match active.generation.try_next() {
                Ok(Some(event)) => event,
                Ok(None) => return changed,
                Err(WorkerError::Stopped) | Err(_) => {
                    self.end_reply(None);
                    self.view.error("the engine stopped; restart kestrel chat");
                    return true;
                }
            };
            changed = true;
            match event {
                GenerationEvent::Accepted => {}
                GenerationEvent::Rejected(err) => {
                    self.active = None;
                    self.view.transcript.pop();
                    self.conversation.pop();
                    self.view.generating = false;
                    self.view.error(format!("the engine refused the message: {err}"));
                }
                GenerationEvent::Tokens { tokens, spec, cached_tokens, .. } => {
                    active.generated.extend_from_slice(&tokens);
                    if let Some(stats) = self.view.reply.as_mut() {
                        stats.first_token_at.get_or_insert_with(Instant::now);
                        stats.tokens = active.generated.len();
                        stats.spec = spec;
                        stats.cached_tokens = Some(cached_tokens);
                    }
                    self.refresh_reply_text();
                }
                GenerationEvent::Finished { reason, summary } => {
                    if let Some(stats) = self.view.reply.as_mut() {
                        stats.spec = summary.spec;
                        stats.tokens = summary.generated.len();
                        stats.cached_tokens = Some(summary.cached_tokens);
                    }
                    self.end_reply(Some(reason));
                }
                GenerationEvent::Failed { error, .. } => {
                    // The reply is not an answer: the message leaves the conversation with it.
                    self.end_reply(None);
                    self.view.error(format!("the reply failed: {error}"));
                }
            }
        }
    }

    /// The reply's text so far, its reasoning apart. Decoding everything again each time keeps
    /// multi-token characters right; a character still incomplete shows up on the next token.
    fn refresh_reply_text(&mut self) {
        let Some(active) = self.active.as_ref() else { return };
        let text = match self.files.tokenizer.decode(&active.generated, true) {
            Ok(text) => text.trim_end_matches('\u{FFFD}').to_string(),
            Err(err) => {
                self.view.status = Status::Error(format!("cannot decode the reply: {err}"));
                return;
            }
        };
        let entry = &mut self.view.transcript[active.entry];
        match active.reasoning {
            None => entry.text = text,
            Some(opened) => {
                let mut splitter = ReasoningSplitter::new(opened);
                let mut parts = splitter.push(&text);
                parts.extend(splitter.finish());
                (entry.reasoning, entry.text) = (String::new(), String::new());
                for part in parts {
                    match part {
                        ReasoningPart::Reasoning(t) => entry.reasoning.push_str(&t),
                        ReasoningPart::Content(t) => entry.text.push_str(&t),
                    }
                }
            }
        }
    }

    fn end_reply(&mut self, reason: Option<FinishReason>) {
        self.refresh_reply_text();
        let Some(active) = self.active.take() else { return };
        let text = self.view.transcript[active.entry].text.clone();
        let reasoning = self.view.transcript[active.entry].reasoning.clone();
        self.view.transcript[active.entry].ending = match reason {
            Some(FinishReason::Abort) => Some("stopped"),
            Some(FinishReason::Length) => Some("token limit"),
            _ => None,
        };
        // A stopped or cut reply stays in the conversation: the next message follows what was shown.
        if reason.is_some() {
            let mut reply = ChatMessage::assistant(text);
            reply.reasoning_content = (!reasoning.is_empty()).then_some(reasoning);
            self.conversation.push(reply);
        } else {
            self.conversation.pop();
        }
        if let Some(stats) = self.view.reply.as_mut() {
            stats.finished_at = Some(Instant::now());
        }
        self.view.generating = false;
        self.view.status = Status::Hint(IDLE_HINT.into());
    }
}
