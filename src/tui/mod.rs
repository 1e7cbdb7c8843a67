//! `kestrel chat`: a terminal chat (ratatui over crossterm) with a live speculation panel.
//!
//! The engine runs on its worker thread; this loop only polls keys and the reply's events and
//! redraws, so the screen stays responsive while a step runs. Every error after start-up is shown
//! in the app; the terminal is restored however the loop ends (the ratatui panic hook covers panics).

mod app;
mod input;
mod keys;
mod panel;
mod state;
mod view;
#[cfg(test)]
mod view_tests;

pub use app::{App, ChatOptions};

use ratatui::crossterm::event::{self, DisableBracketedPaste, EnableBracketedPaste, Event, KeyEventKind};
use ratatui::crossterm::execute;
use ratatui::DefaultTerminal;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum TuiError {
    #[error("terminal error: {0}")]
    Terminal(#[from] std::io::Error),
}

/// How long to wait for a key before looking at the engine again.
const INPUT_POLL: Duration = Duration::from_millis(25);
/// The panel's live figures (tokens/s, cache use) are redrawn at least this often.
const REFRESH: Duration = Duration::from_millis(250);

/// Takes over the terminal until the user quits.
pub fn run(mut app: App) -> Result<(), TuiError> {
    let mut terminal = ratatui::try_init()?;
    // Pasted text arrives as one event instead of keys, so a pasted newline does not send.
    let _ = execute!(std::io::stdout(), EnableBracketedPaste);
    let result = event_loop(&mut terminal, &mut app);
    let _ = execute!(std::io::stdout(), DisableBracketedPaste);
    ratatui::restore();
    result
}

fn event_loop(terminal: &mut DefaultTerminal, app: &mut App) -> Result<(), TuiError> {
    let mut dirty = true;
    let mut last_draw = Instant::now();
    while !app.should_quit() {
        dirty |= app.poll_generation();
        if dirty || last_draw.elapsed() >= REFRESH {
            let snapshot = app.engine().snapshot();
            terminal.draw(|frame| view::draw(frame, &mut app.view, &snapshot))?;
            last_draw = Instant::now();
            dirty = false;
        }
        if event::poll(INPUT_POLL)? {
            match event::read()? {
                Event::Key(key) if key.kind != KeyEventKind::Release => app.handle_key(key),
                Event::Paste(text) => app.paste(&text),
                _ => {}
            }
            dirty = true;
        }
    }
    Ok(())
}
