//! The side panel: speculation figures of the current reply (per-position acceptance as bars),
//! speed, and the engine's batch and cache occupancy.

use super::state::ReplyStats;
use crate::engine::request::SpecMethod;
use crate::engine::worker::EngineSnapshot;
use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph};
use ratatui::Frame;
use std::time::Instant;

/// Width of the panel, borders included.
pub const PANEL_WIDTH: u16 = 34;

const LABEL_WIDTH: usize = 13;

fn label(text: &str) -> Span<'static> {
    Span::styled(format!("{text:<LABEL_WIDTH$}"), Style::default().fg(Color::Gray))
}

fn value(text: String) -> Span<'static> {
    Span::styled(text, Style::default().add_modifier(Modifier::BOLD))
}

fn heading(text: &str) -> Line<'static> {
    Line::from(Span::styled(text.to_string(), Style::default().fg(Color::Cyan).add_modifier(Modifier::BOLD)))
}

/// A horizontal bar of `fraction` (0..=1) in `width` cells, with eighth-cell resolution.
pub fn bar(fraction: f64, width: usize) -> String {
    const PARTIAL: [char; 8] = [' ', '▏', '▎', '▍', '▌', '▋', '▊', '▉'];
    let eighths = (fraction.clamp(0.0, 1.0) * (width * 8) as f64).round() as usize;
    let mut text: String = "█".repeat(eighths / 8);
    if !eighths.is_multiple_of(8) {
        text.push(PARTIAL[eighths % 8]);
    }
    let used = text.chars().count();
    text.push_str(&"·".repeat(width.saturating_sub(used)));
    text
}

/// What a line is worth when the panel is too short for all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Keep {
    Always,
    /// Extra detail, dropped third.
    Detail,
    /// Figures about the engine's setup, dropped second.
    Setup,
    /// Blank lines between sections, dropped first.
    Spacer,
}

/// Keeps the most important lines that fit `height`, in their order.
fn fit(lines: Vec<(Keep, Line<'static>)>, height: usize) -> Vec<Line<'static>> {
    let mut lines = lines;
    for drop in [Keep::Spacer, Keep::Setup, Keep::Detail] {
        if lines.len() <= height {
            break;
        }
        lines.retain(|(keep, _)| *keep < drop);
    }
    lines.into_iter().map(|(_, line)| line).take(height).collect()
}

pub fn panel_lines(reply: Option<&ReplyStats>, spec_tokens: usize, current_method: SpecMethod, snapshot: &EngineSnapshot, inner_width: usize, height: usize, now: Instant) -> Vec<Line<'static>> {
    let mut lines: Vec<(Keep, Line<'static>)> = vec![(Keep::Always, heading("Speculation"))];
    let method = reply.map_or(current_method, |r| r.method);
    let k = if method == SpecMethod::None { String::new() } else { format!(" (k={spec_tokens})") };
    lines.push((Keep::Always, Line::from(vec![label("method"), value(format!("{}{k}", method.name()))])));
    match reply.map(|r| &r.spec).filter(|spec| spec.draft_steps > 0) {
        Some(spec) => {
            lines.push((Keep::Always, Line::from(vec![label("acceptance"), value(format!("{:.1}%", 100.0 * spec.acceptance_rate()))])));
            lines.push((Keep::Always, Line::from(vec![label("mean length"), value(format!("{:.2}", spec.mean_acceptance_length()))])));
            lines.push((Keep::Detail, Line::from(vec![label("accepted"), value(format!("{}/{}", spec.accepted, spec.drafted))])));
            lines.push((Keep::Detail, Line::from(Span::styled("per position", Style::default().fg(Color::Gray)))));
            let mut per_position = spec.per_position();
            per_position.resize(per_position.len().max(spec_tokens), 0.0);
            let bar_width = inner_width.saturating_sub(9).max(4);
            for (position, fraction) in per_position.iter().enumerate() {
                let line = Line::from(vec![
                    Span::raw(format!("{:>2} ", position + 1)),
                    Span::styled(bar(*fraction, bar_width), Style::default().fg(Color::Green)),
                    Span::raw(format!("{:>4.0}%", 100.0 * fraction)),
                ]);
                lines.push((Keep::Always, line));
            }
        }
        None => {
            let why = if method == SpecMethod::None { "off (/spec ngram)" } else { "no drafts yet" };
            lines.push((Keep::Always, Line::from(vec![label("acceptance"), Span::styled(why.to_string(), Style::default().fg(Color::DarkGray))])));
        }
    }
    if snapshot.spec.draft_steps > 0 {
        lines.push((Keep::Detail, Line::from(vec![label("session"), value(format!("{:.1}% of {}", 100.0 * snapshot.spec.acceptance_rate(), snapshot.spec.drafted))])));
    }

    lines.push((Keep::Spacer, Line::default()));
    lines.push((Keep::Always, heading("Speed")));
    let ttft = reply.and_then(ReplyStats::ttft).map_or("—".to_string(), |d| format!("{:.0} ms", d.as_secs_f64() * 1e3));
    lines.push((Keep::Always, Line::from(vec![label("TTFT"), value(ttft)])));
    let rate = reply.and_then(|r| r.decode_rate(now)).map_or("—".to_string(), |r| format!("{r:.1}"));
    lines.push((Keep::Always, Line::from(vec![label("reply tok/s"), value(rate)])));
    lines.push((Keep::Detail, Line::from(vec![label("engine tok/s"), value(format!("{:.1}", snapshot.tokens_per_second))])));
    if let Some(r) = reply {
        lines.push((Keep::Detail, Line::from(vec![label("tokens"), value(format!("{} + {}", r.prompt_tokens, r.tokens))])));
        // The prompt tokens this turn did not compute again: the conversation so far, mostly.
        let cached = match r.cached_tokens {
            Some(n) if r.prompt_tokens > 0 => format!("{n} ({:.0}%)", 100.0 * n as f64 / r.prompt_tokens as f64),
            Some(n) => n.to_string(),
            None => "—".to_string(),
        };
        lines.push((Keep::Detail, Line::from(vec![label("cached"), value(cached)])));
    }

    lines.push((Keep::Spacer, Line::default()));
    lines.push((Keep::Always, heading("Engine")));
    lines.push((Keep::Always, Line::from(vec![label("batch"), value(format!("{} running", snapshot.running))])));
    lines.push((Keep::Detail, Line::from(vec![label("queued"), value(snapshot.waiting.to_string())])));
    lines.push((Keep::Always, Line::from(vec![label("KV cache"), value(format!("{}/{} blocks", snapshot.kv_blocks_used, snapshot.kv_blocks_total))])));
    let kv_fraction = if snapshot.kv_blocks_total == 0 { 0.0 } else { snapshot.kv_blocks_used as f64 / snapshot.kv_blocks_total as f64 };
    let kv_bar = bar(kv_fraction, inner_width.saturating_sub(LABEL_WIDTH).max(4));
    lines.push((Keep::Detail, Line::from(vec![Span::raw(" ".repeat(LABEL_WIDTH)), Span::styled(kv_bar, Style::default().fg(Color::Yellow))])));
    lines.push((Keep::Always, Line::from(vec![label("state slots"), value(format!("{}/{}", snapshot.state_slots_used, snapshot.state_slots_total))])));
    let prefix_cache = match &snapshot.prefix_cache {
        Some(c) => format!("{:.0}% hit, {} ckpt", 100.0 * c.hit_rate(), c.checkpoints),
        None => "off".to_string(),
    };
    lines.push((Keep::Detail, Line::from(vec![label("prefix cache"), value(prefix_cache)])));
    lines.push((Keep::Setup, Line::from(vec![label("CUDA graphs"), value(graph_line(snapshot))])));
    if !snapshot.alive {
        lines.insert(0, (Keep::Always, Line::from(Span::styled("engine stopped", Style::default().fg(Color::Red)))));
    }
    fit(lines, height)
}

/// "to 64, pad 1.18x": the largest capture size and the rows run per real row of the graphed
/// steps; or "off".
fn graph_line(snapshot: &EngineSnapshot) -> String {
    let Some(&largest) = snapshot.capture_sizes.last() else { return "off".to_string() };
    let pad = snapshot.padding.row_overhead().map(|x| format!(", pad {x:.2}x")).unwrap_or_default();
    format!("to {largest}{pad}")
}

pub fn draw_panel(frame: &mut Frame, area: Rect, reply: Option<&ReplyStats>, spec_tokens: usize, current_method: SpecMethod, snapshot: &EngineSnapshot) {
    let block = Block::default().borders(Borders::ALL).title(" Stats ");
    let inner = block.inner(area);
    let lines = panel_lines(reply, spec_tokens, current_method, snapshot, inner.width as usize, inner.height as usize, Instant::now());
    frame.render_widget(Paragraph::new(lines).block(block), area);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_fill_in_eighths() {
        assert_eq!(bar(0.0, 4), "····");
        assert_eq!(bar(1.0, 4), "████");
        assert_eq!(bar(0.5, 4), "██··");
        assert_eq!(bar(1.0 / 32.0, 4), "▏···");
        assert_eq!(bar(7.0, 3).chars().count(), 3);
    }
}
