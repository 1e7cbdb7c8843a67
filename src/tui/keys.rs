//! Keys to actions, and the slash commands. Both are pure functions of their input, so every
//! binding is tested without a terminal.

use crate::backend::sampling::{SamplingParams, MAX_TEMPERATURE};
use crate::engine::request::SpecMethod;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Submit,
    Newline,
    Insert(char),
    Backspace,
    Delete,
    Left,
    Right,
    Home,
    End,
    Up,
    Down,
    ScrollUp,
    ScrollDown,
    /// Ctrl-C while a reply is being generated.
    StopReply,
    /// Esc, Ctrl-D, or Ctrl-C when idle: the app asks before it quits.
    Quit,
    Ignore,
}

pub fn action_for(key: KeyEvent, generating: bool) -> Action {
    let control = key.modifiers.contains(KeyModifiers::CONTROL);
    let alt = key.modifiers.contains(KeyModifiers::ALT);
    let shift = key.modifiers.contains(KeyModifiers::SHIFT);
    match key.code {
        KeyCode::Char('c') if control => {
            if generating {
                Action::StopReply
            } else {
                Action::Quit
            }
        }
        KeyCode::Char('d') if control => Action::Quit,
        // Ctrl-J is a line feed: the one newline key every terminal sends.
        KeyCode::Char('j') if control => Action::Newline,
        KeyCode::Char('a') if control => Action::Home,
        KeyCode::Char('e') if control => Action::End,
        KeyCode::Esc => Action::Quit,
        KeyCode::Enter if alt || shift || control => Action::Newline,
        KeyCode::Enter => Action::Submit,
        KeyCode::Char(c) if !control && !alt => Action::Insert(c),
        KeyCode::Tab => Action::Insert('\t'),
        KeyCode::Backspace => Action::Backspace,
        KeyCode::Delete => Action::Delete,
        KeyCode::Left => Action::Left,
        KeyCode::Right => Action::Right,
        KeyCode::Home => Action::Home,
        KeyCode::End => Action::End,
        KeyCode::Up => Action::Up,
        KeyCode::Down => Action::Down,
        KeyCode::PageUp => Action::ScrollUp,
        KeyCode::PageDown => Action::ScrollDown,
        _ => Action::Ignore,
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    Clear,
    Spec(SpecMethod),
    Temperature(f32),
    /// Show or fold replies' reasoning.
    Reasoning,
    Help,
    Quit,
}

/// `None` when the text is a message, not a command; `Some(Err(..))` for a malformed command.
pub fn parse_command(text: &str) -> Option<Result<Command, String>> {
    let text = text.trim();
    let rest = text.strip_prefix('/')?;
    let mut words = rest.split_whitespace();
    let name = words.next().unwrap_or_default();
    let argument = words.next();
    if words.next().is_some() {
        return Some(Err(format!("/{name} takes at most one argument")));
    }
    let command = match (name, argument) {
        ("clear", None) => Ok(Command::Clear),
        ("reasoning", None) | ("think", None) => Ok(Command::Reasoning),
        ("help", None) | ("?", None) => Ok(Command::Help),
        ("quit", None) | ("exit", None) => Ok(Command::Quit),
        ("spec", Some(method)) => method.parse().map(Command::Spec),
        ("spec", None) => Err("usage: /spec none|ngram|mtp".to_string()),
        // The range every front end accepts (the sampler's own check).
        ("temp", Some(value)) => match value.parse::<f32>() {
            Ok(t) if (SamplingParams { temperature: t, ..SamplingParams::greedy() }).validate().is_ok() => Ok(Command::Temperature(t)),
            _ => Err(format!("temperature must be a number from 0 to {MAX_TEMPERATURE}, got `{value}`")),
        },
        ("temp", None) => Err("usage: /temp T (0 = greedy)".to_string()),
        (name, _) => Err(format!("unknown command /{name} (try /help)")),
    };
    Some(command)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(code: KeyCode, modifiers: KeyModifiers) -> KeyEvent {
        KeyEvent::new(code, modifiers)
    }

    #[test]
    fn ctrl_c_stops_a_reply_and_quits_when_idle() {
        let ctrl_c = key(KeyCode::Char('c'), KeyModifiers::CONTROL);
        assert_eq!(action_for(ctrl_c, true), Action::StopReply);
        assert_eq!(action_for(ctrl_c, false), Action::Quit);
        assert_eq!(action_for(key(KeyCode::Char('d'), KeyModifiers::CONTROL), true), Action::Quit);
        assert_eq!(action_for(key(KeyCode::Esc, KeyModifiers::NONE), false), Action::Quit);
    }

    #[test]
    fn enter_sends_and_modified_enter_breaks_the_line() {
        assert_eq!(action_for(key(KeyCode::Enter, KeyModifiers::NONE), false), Action::Submit);
        for modifiers in [KeyModifiers::ALT, KeyModifiers::SHIFT, KeyModifiers::CONTROL] {
            assert_eq!(action_for(key(KeyCode::Enter, modifiers), false), Action::Newline);
        }
        assert_eq!(action_for(key(KeyCode::Char('j'), KeyModifiers::CONTROL), false), Action::Newline);
        assert_eq!(action_for(key(KeyCode::Char('J'), KeyModifiers::SHIFT), false), Action::Insert('J'));
    }

    #[test]
    fn commands_parse_and_refuse_bad_arguments() {
        assert_eq!(parse_command("hello"), None);
        assert_eq!(parse_command("/clear"), Some(Ok(Command::Clear)));
        assert_eq!(parse_command(" /spec ngram "), Some(Ok(Command::Spec(SpecMethod::Ngram))));
        assert_eq!(parse_command("/temp 0.7"), Some(Ok(Command::Temperature(0.7))));
        assert_eq!(parse_command("/reasoning"), Some(Ok(Command::Reasoning)));
        for bad in ["/temp hot", "/temp 3", "/temp NaN", "/spec fast", "/spec", "/frobnicate", "/clear now please"] {
            assert!(matches!(parse_command(bad), Some(Err(_))), "{bad}");
        }
    }
}
