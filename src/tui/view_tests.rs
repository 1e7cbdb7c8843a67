//! The layout on a headless terminal (ratatui's TestBackend).

use super::panel::PANEL_WIDTH;
use super::state::{ChatView, Entry, ReplyStats, Settings, Speaker};
use super::view::{draw, wrap, MIN_WIDTH_FOR_PANEL};
use crate::engine::cache::PrefixCacheStats;
use crate::engine::metrics::SpecStats;
use crate::engine::request::SpecMethod;
use crate::engine::worker::EngineSnapshot;
use ratatui::backend::TestBackend;
use ratatui::Terminal;
use std::time::{Duration, Instant};

fn view_with_reply() -> ChatView {
    let settings = Settings { spec: SpecMethod::Ngram, spec_tokens: 3, temperature: 0.0, max_tokens: 64 };
    let mut view = ChatView::new("test-model".into(), settings);
    view.transcript.push(Entry::new(Speaker::User, "hello there"));
    view.transcript.push(Entry::new(Speaker::Assistant, "The kestrel hovers and waits; then it dives."));
    let mut spec = SpecStats::default();
    for (drafted, accepted) in [(3, 3), (3, 2), (3, 1), (3, 0)] {
        spec.record_step(drafted, accepted).expect("consistent step");
    }
    let start = Instant::now();
    let mut reply = ReplyStats::new(SpecMethod::Ngram, 12, start);
    reply.first_token_at = Some(start + Duration::from_millis(40));
    reply.finished_at = Some(start + Duration::from_millis(1040));
    reply.tokens = 11;
    reply.spec = spec;
    view.reply = Some(reply);
    view
}

fn snapshot() -> EngineSnapshot {
    EngineSnapshot { alive: true, running: 1, kv_blocks_used: 3, kv_blocks_total: 257, state_slots_used: 1, state_slots_total: 1, tokens_per_second: 42.0, ..Default::default() }
}

fn render(view: &mut ChatView, width: u16, height: u16) -> Vec<String> {
    render_with(view, width, height, &snapshot())
}

fn render_with(view: &mut ChatView, width: u16, height: u16, snapshot: &EngineSnapshot) -> Vec<String> {
    let mut terminal = Terminal::new(TestBackend::new(width, height)).expect("test terminal");
    terminal.draw(|frame| draw(frame, view, snapshot)).expect("draws");
    let buffer = terminal.backend().buffer();
    (0..height).map(|y| (0..width).map(|x| buffer.cell((x, y)).map_or(" ", |cell| cell.symbol())).collect::<String>()).collect()
}

fn find(screen: &[String], needle: &str) -> Option<(usize, usize)> {
    screen.iter().enumerate().find_map(|(row, line)| line.find(needle).map(|byte| (row, line[..byte].chars().count())))
}

#[test]
fn wide_screen_has_conversation_panel_editor_and_status() {
    let mut view = view_with_reply();
    let screen = render(&mut view, 100, 32);
    let text = screen.join("\n");
    for needle in [" kestrel chat · test-model ", " Stats ", "Speculation", " Message ", "hello there", "The kestrel hovers", "spec ngram"] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    let (_, stats_column) = find(&screen, " Stats ").expect("panel title");
    assert!(stats_column >= 100 - PANEL_WIDTH as usize, "the panel is on the right: column {stats_column}");
    // The editor sits under the conversation, the status line is the last row.
    let (message_row, _) = find(&screen, " Message ").expect("editor");
    assert!(message_row > find(&screen, "hello there").expect("user message").0);
    assert!(screen[31].contains("spec ngram"), "status line: {:?}", screen[31]);
}

#[test]
fn panel_shows_acceptance_and_one_bar_per_position() {
    let mut view = view_with_reply();
    let text = render(&mut view, 100, 32).join("\n");
    // 6 accepted of 12 drafted over 4 draft steps; positions accepted in 3, 2 and 1 steps.
    assert!(text.contains("acceptance   50.0%"), "{text}");
    assert!(text.contains("mean length  2.50"), "{text}");
    assert!(text.contains("accepted     6/12"), "{text}");
    assert!(text.contains(" 1 ") && text.contains("75%") && text.contains("50%") && text.contains("25%"), "{text}");
    assert!(text.contains("TTFT         40 ms"), "{text}");
    assert!(text.contains("reply tok/s  10.0"), "{text}");
    assert!(text.contains("KV cache     3/257 blocks"), "{text}");
    assert!(text.contains("state slots  1/1"), "{text}");
    assert!(text.contains("batch        1 running") && text.contains("queued       0"), "{text}");
}

#[test]
fn resizing_keeps_the_panel_until_the_screen_is_too_narrow() {
    let mut view = view_with_reply();
    for (width, height) in [(120, 40), (80, 24), (MIN_WIDTH_FOR_PANEL, 20)] {
        let screen = render(&mut view, width, height);
        let text = screen.join("\n");
        assert!(text.contains(" Stats ") && text.contains(" Message "), "{width}x{height}:\n{text}");
    }
    let text = render(&mut view, MIN_WIDTH_FOR_PANEL - 1, 20).join("\n");
    assert!(!text.contains(" Stats ") && text.contains(" Message ") && text.contains("hello there"), "{text}");
}

#[test]
fn long_conversations_follow_the_newest_line_and_scroll_back() {
    let mut view = view_with_reply();
    for i in 0..40 {
        view.transcript.push(Entry::new(Speaker::User, format!("message number {i}")));
    }
    let text = render(&mut view, 100, 24).join("\n");
    assert!(text.contains("message number 39") && !text.contains("message number 0\n"), "{text}");
    view.scroll_from_bottom = 10_000;
    let text = render(&mut view, 100, 24).join("\n");
    assert!(text.contains("hello there") && !text.contains("message number 39"), "{text}");
    assert!(view.scroll_from_bottom < 10_000, "the scroll offset is clamped to the conversation");
    assert!(text.contains("lines up (PgDn)"), "{text}");
}

#[test]
fn editor_grows_with_lines_and_keeps_the_cursor_inside() {
    let mut view = view_with_reply();
    view.input.insert_str("first line\nsecond line\nthird");
    let mut terminal = Terminal::new(TestBackend::new(90, 24)).expect("test terminal");
    let snapshot = snapshot();
    terminal.draw(|frame| draw(frame, &mut view, &snapshot)).expect("draws");
    let cursor = terminal.get_cursor_position().expect("cursor");
    assert_eq!(cursor.y, 24 - 1 - 1 - 1, "the cursor is on the editor's last line");
    assert_eq!(cursor.x, 1 + "third".len() as u16);
}

#[test]
fn wrapping_respects_width_words_and_newlines() {
    assert_eq!(wrap("the quick brown fox", 10), vec!["the quick", "brown fox"]);
    assert_eq!(wrap("a\n\nb", 10), vec!["a", "", "b"]);
    assert_eq!(wrap("abcdefghij", 4), vec!["abcd", "efgh", "ij"]);
    assert_eq!(wrap("日本語の文", 4), vec!["日本", "語の", "文"]);
    for line in wrap("def fibonacci(n):    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)", 16) {
        assert!(unicode_width::UnicodeWidthStr::width(line.as_str()) <= 16, "{line:?}");
    }
}

#[test]
fn a_short_panel_keeps_acceptance_speed_and_cache_figures() {
    let mut view = view_with_reply();
    let text = render(&mut view, 80, 20).join("\n");
    for needle in ["acceptance   50.0%", " 3 ", "TTFT", "KV cache", "state slots"] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[test]
fn reasoning_is_dimmed_and_folded_unless_asked_for() {
    let mut view = view_with_reply();
    view.transcript[1].reasoning = "The user greets me.\nI should greet back.".into();
    let text = render(&mut view, 100, 32).join("\n");
    assert!(text.contains("▸ reasoning, 2 lines (/reasoning shows it)"), "{text}");
    assert!(!text.contains("I should greet back") && text.contains("The kestrel hovers"), "{text}");
    view.show_reasoning = true;
    let text = render(&mut view, 100, 32).join("\n");
    assert!(text.contains("▾ reasoning") && text.contains("│ I should greet back."), "{text}");
    // While the model is still thinking (no answer yet) the reasoning shows as it streams.
    view.show_reasoning = false;
    view.transcript[1].text.clear();
    view.generating = true;
    let text = render(&mut view, 100, 32).join("\n");
    assert!(text.contains("│ The user greets me."), "{text}");
}

#[test]
fn panel_shows_the_prompt_tokens_served_from_the_prefix_cache() {
    let mut view = view_with_reply();
    let text = render(&mut view, 100, 40).join("\n");
    assert!(text.contains("cached       —"), "not yet admitted: {text}");
    assert!(text.contains("prefix cache off"), "{text}");
    view.reply.as_mut().expect("a reply").cached_tokens = Some(9);
    let stats = PrefixCacheStats { queries: 4, hits: 2, queried_tokens: 1000, cached_tokens: 600, checkpoints: 3, checkpoint_capacity: 64, ..Default::default() };
    let text = render_with(&mut view, 100, 40, &EngineSnapshot { prefix_cache: Some(stats), ..snapshot() }).join("\n");
    assert!(text.contains("cached       9 (75%)"), "{text}");
    assert!(text.contains("prefix cache 60% hit, 3 ckpt"), "{text}");
}

#[test]
fn panel_shows_the_cuda_graph_sizes_and_their_padding() {
    let mut view = view_with_reply();
    let text = render(&mut view, 100, 40).join("\n");
    assert!(text.contains("CUDA graphs  off"), "{text}");
    let mut padding = crate::engine::padding::PaddingStats::default();
    padding.record(
        crate::backend::RealShape { rows: crate::backend::Real(17), tokens: crate::backend::Real(17) },
        crate::backend::PaddedShape { rows: crate::backend::Padded(24), tokens: crate::backend::Padded(24) },
    );
    let sizes = vec![1, 2, 4, 8, 16, 24, 32, 48, 64];
    let text = render_with(&mut view, 100, 40, &EngineSnapshot { capture_sizes: sizes, padding, ..snapshot() }).join("\n");
    assert!(text.contains("CUDA graphs  to 64, pad 1.41x"), "{text}");
}
