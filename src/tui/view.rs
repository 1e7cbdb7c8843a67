//! Layout and drawing: the conversation (scrollable), the side panel, the message editor and the
//! status line. Everything is laid out from the frame size on every draw, so a resize is just
//! the next draw.

use super::panel::{draw_panel, PANEL_WIDTH};
use super::state::{ChatView, Speaker, Status};
use crate::engine::worker::EngineSnapshot;
use ratatui::layout::{Constraint, Direction, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph};
use ratatui::Frame;
use unicode_width::{UnicodeWidthChar, UnicodeWidthStr};

/// Below this width the panel would squeeze the conversation unreadably, so it is left out.
pub const MIN_WIDTH_FOR_PANEL: u16 = PANEL_WIDTH + 24;
/// Most editor lines shown at once.
const MAX_INPUT_LINES: usize = 6;

pub fn draw(frame: &mut Frame, view: &mut ChatView, snapshot: &EngineSnapshot) {
    let area = frame.area();
    let input_lines = view.input.lines().len().clamp(1, MAX_INPUT_LINES) as u16;
    let rows = Layout::default().direction(Direction::Vertical).constraints([Constraint::Min(3), Constraint::Length(input_lines + 2), Constraint::Length(1)]).split(area);
    let (chat_area, panel_area) = if area.width >= MIN_WIDTH_FOR_PANEL {
        let columns = Layout::default().direction(Direction::Horizontal).constraints([Constraint::Min(20), Constraint::Length(PANEL_WIDTH)]).split(rows[0]);
        (columns[0], Some(columns[1]))
    } else {
        (rows[0], None)
    };
    draw_transcript(frame, chat_area, view);
    if let Some(panel_area) = panel_area {
        draw_panel(frame, panel_area, view.reply.as_ref(), view.settings.spec_tokens, view.settings.spec, snapshot);
    }
    draw_input(frame, rows[1], view);
    draw_status(frame, rows[2], view);
}

fn speaker_line(speaker: Speaker) -> Line<'static> {
    let (name, color) = match speaker {
        Speaker::User => ("you", Color::Cyan),
        Speaker::Assistant => ("kestrel", Color::Green),
        Speaker::Note => ("note", Color::DarkGray),
        Speaker::Error => ("error", Color::Red),
    };
    Line::from(Span::styled(name, Style::default().fg(color).add_modifier(Modifier::BOLD)))
}

/// The whole conversation as screen lines of at most `width` cells.
pub fn transcript_lines(view: &ChatView, width: usize) -> Vec<Line<'static>> {
    let mut lines = Vec::new();
    let count = view.transcript.len();
    for (index, entry) in view.transcript.iter().enumerate() {
        if index > 0 {
            lines.push(Line::default());
        }
        // Notes speak for the app: their grey text needs no name above it.
        if entry.speaker != Speaker::Note {
            lines.push(speaker_line(entry.speaker));
        }
        let style = match entry.speaker {
            Speaker::Note => Style::default().fg(Color::Gray),
            Speaker::Error => Style::default().fg(Color::Red),
            _ => Style::default(),
        };
        let replying = view.generating && index + 1 == count;
        if !entry.reasoning.is_empty() {
            lines.extend(reasoning_lines(&entry.reasoning, width, view.show_reasoning || (replying && entry.text.is_empty())));
        }
        let text = if entry.text.is_empty() && replying && entry.reasoning.is_empty() { "…" } else { entry.text.as_str() };
        if !text.is_empty() || entry.reasoning.is_empty() {
            lines.extend(wrap(text, width).into_iter().map(|line| Line::from(Span::styled(line, style))));
        }
        if let Some(ending) = entry.ending {
            lines.push(Line::from(Span::styled(format!("[{ending}]"), Style::default().fg(Color::DarkGray).add_modifier(Modifier::ITALIC))));
        }
    }
    lines
}

/// A reply's reasoning: dimmed in full while the model is still thinking or when asked for,
/// otherwise folded into one line.
fn reasoning_lines(reasoning: &str, width: usize, unfolded: bool) -> Vec<Line<'static>> {
    let dim = Style::default().fg(Color::DarkGray).add_modifier(Modifier::DIM);
    let wrapped = wrap(reasoning, width.saturating_sub(2).max(1));
    if !unfolded {
        let summary = format!("▸ reasoning, {} lines (/reasoning shows it)", wrapped.len());
        return vec![Line::from(Span::styled(truncate_to_width(&summary, width), dim.add_modifier(Modifier::ITALIC)))];
    }
    let mut lines = vec![Line::from(Span::styled("▾ reasoning", dim.add_modifier(Modifier::ITALIC)))];
    lines.extend(wrapped.into_iter().map(|line| Line::from(Span::styled(format!("│ {line}"), dim))));
    lines
}

fn draw_transcript(frame: &mut Frame, area: Rect, view: &mut ChatView) {
    let block = Block::default().borders(Borders::ALL);
    let inner = block.inner(area);
    let lines = transcript_lines(view, inner.width.max(1) as usize);
    let visible = inner.height as usize;
    let max_scroll = lines.len().saturating_sub(visible);
    view.scroll_from_bottom = view.scroll_from_bottom.min(max_scroll);
    let top = max_scroll - view.scroll_from_bottom;
    let mut title = format!(" kestrel chat · {} ", view.model_name);
    if view.scroll_from_bottom > 0 {
        title.push_str(&format!("· ↑ {} lines up (PgDn) ", view.scroll_from_bottom));
    }
    let shown: Vec<Line> = lines.into_iter().skip(top).take(visible).collect();
    frame.render_widget(Paragraph::new(shown).block(block.title(title)), area);
}

fn draw_input(frame: &mut Frame, area: Rect, view: &ChatView) {
    let title = if view.generating { " Message (generating…) " } else { " Message " };
    let block = Block::default().borders(Borders::ALL).title(title);
    let inner = block.inner(area);
    let (row, column) = view.input.cursor();
    let lines = view.input.lines();
    let height = inner.height.max(1) as usize;
    let first_row = (row + 1).saturating_sub(height);
    let cursor_line = &lines[row];
    let cursor_x: usize = cursor_line.chars().take(column).map(|c| c.width().unwrap_or(0)).sum();
    let width = inner.width.max(1) as usize;
    // Scroll sideways so the cursor stays visible on a long line.
    let x_offset = (cursor_x + 1).saturating_sub(width);
    let shown: Vec<Line> = lines.iter().skip(first_row).take(height).map(|line| Line::from(skip_cells(line, x_offset))).collect();
    frame.render_widget(Paragraph::new(shown).block(block), area);
    frame.set_cursor_position((inner.x + (cursor_x - x_offset) as u16, inner.y + (row - first_row) as u16));
}

fn draw_status(frame: &mut Frame, area: Rect, view: &ChatView) {
    let settings = &view.settings;
    let right = format!(" spec {} · temp {} · max {} ", settings.spec.name(), settings.temperature, settings.max_tokens);
    let (text, style) = match &view.status {
        Status::Hint(text) => (text.as_str(), Style::default().fg(Color::DarkGray)),
        Status::Error(text) => (text.as_str(), Style::default().fg(Color::Red)),
    };
    let room = (area.width as usize).saturating_sub(right.width());
    let left = truncate_to_width(text, room);
    let gap = room.saturating_sub(left.width());
    let line = Line::from(vec![Span::styled(left, style), Span::raw(" ".repeat(gap)), Span::styled(right, Style::default().fg(Color::Gray))]);
    frame.render_widget(Paragraph::new(line), area);
}

/// Word-wraps text to `width` cells; words longer than a line are split. Tabs become spaces.
pub fn wrap(text: &str, width: usize) -> Vec<String> {
    let width = width.max(1);
    let mut out = Vec::new();
    for paragraph in text.replace('\t', "    ").split('\n') {
        let mut line = String::new();
        let mut line_width = 0;
        for word in split_keeping_spaces(paragraph) {
            let word_width = word.width();
            if line_width + word_width > width && line_width > 0 {
                out.push(std::mem::take(&mut line).trim_end().to_string());
                line_width = 0;
                if word.trim().is_empty() {
                    continue;
                }
            }
            if word_width > width {
                for c in word.chars() {
                    let w = c.width().unwrap_or(0);
                    if line_width + w > width {
                        out.push(std::mem::take(&mut line));
                        line_width = 0;
                    }
                    line.push(c);
                    line_width += w;
                }
            } else {
                line.push_str(word);
                line_width += word_width;
            }
        }
        out.push(line);
    }
    out
}

/// Words with their trailing spaces, so that wrapping keeps the spacing inside a line.
fn split_keeping_spaces(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut in_space = false;
    for (i, c) in text.char_indices() {
        if c == ' ' {
            in_space = true;
        } else if in_space {
            pieces.push(&text[start..i]);
            start = i;
            in_space = false;
        }
    }
    if start < text.len() {
        pieces.push(&text[start..]);
    }
    pieces
}

fn truncate_to_width(text: &str, width: usize) -> String {
    let mut out = String::new();
    let mut used = 0;
    for c in text.chars() {
        let w = c.width().unwrap_or(0);
        if used + w > width {
            break;
        }
        out.push(c);
        used += w;
    }
    out
}

fn skip_cells(text: &str, cells: usize) -> String {
    let mut skipped = 0;
    text.chars()
        .skip_while(|c| {
            let skip = skipped < cells;
            skipped += c.width().unwrap_or(0);
            skip
        })
        .collect()
}
