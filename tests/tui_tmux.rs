//! `kestrel chat` driven in tmux: keys in with send-keys, the screen read back with capture-pane.
//! The model is the scripted chat model, whose every reply is `CHAT_REPLY` repeated.

mod frontend_support;

use frontend_support::*;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A tmux server of our own (its own socket), with `kestrel chat` in its only pane.
struct ChatInTmux {
    socket: String,
    /// Where the shell running the chat writes its exit status.
    status_file: std::path::PathBuf,
}

impl ChatInTmux {
    fn start(width: u16, height: u16, chat_args: &[&str]) -> ChatInTmux {
        Self::start_with(chat_model(), width, height, chat_args)
    }

    fn start_with(model: &std::path::Path, width: u16, height: u16, chat_args: &[&str]) -> ChatInTmux {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let socket = format!("kestrel-test-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
        let status_file = std::env::temp_dir().join(format!("{socket}.status"));
        let _ = std::fs::remove_file(&status_file);
        let tmux = ChatInTmux { socket, status_file };
        let mut command = vec![env!("CARGO_BIN_EXE_kestrel").to_string(), "chat".into(), "--device".into(), "cpu".into(), "--model".into()];
        command.push(model.display().to_string());
        command.extend(chat_args.iter().map(|s| s.to_string()));
        let quoted: Vec<String> = command.iter().map(|arg| format!("'{}'", arg.replace('\'', "'\\''"))).collect();
        // The pane stays after the program exits, so its last screen and exit status can be read.
        tmux.run(&["-u", "new-session", "-d", "-s", "chat", "-x", &width.to_string(), "-y", &height.to_string(), "-e", "RAYON_NUM_THREADS=2", &format!("{}; echo $? > '{}'", quoted.join(" "), tmux.status_file.display())]);
        tmux.run(&["set-option", "-t", "chat", "remain-on-exit", "on"]);
        tmux.wait_for_screen("the chat screen", |screen| screen.contains(" Message ") && screen.contains(" Stats "));
        tmux
    }

    fn run(&self, args: &[&str]) -> String {
        let output = run_with_deadline(Command::new("tmux").args(["-L", &self.socket]).args(args).env("LANG", "C.UTF-8"), Duration::from_secs(30));
        assert!(output.status.success(), "tmux {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "chat"])
    }

    /// Types text literally, then presses Enter.
    fn send_line(&self, text: &str) {
        self.run(&["send-keys", "-t", "chat", "-l", text]);
        self.run(&["send-keys", "-t", "chat", "Enter"]);
    }

    fn send_key(&self, key: &str) {
        self.run(&["send-keys", "-t", "chat", key]);
    }

    fn wait_for_screen(&self, what: &str, ready: impl Fn(&str) -> bool) -> String {
        let mut last = String::new();
        let found = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_for(Duration::from_secs(90), what, || {
                last = self.screen();
                ready(&last).then(|| last.clone())
            })
        }));
        match found {
            Ok(screen) => screen,
            Err(_) => panic!("timed out waiting for {what}; the screen was:\n{last}"),
        }
    }

    fn pane_dead(&self) -> bool {
        self.run(&["display-message", "-p", "-t", "chat", "#{pane_dead}"]).trim() == "1"
    }
}

impl Drop for ChatInTmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux").args(["-L", &self.socket, "kill-server"]).output();
    }
}

/// The number after `label` on a panel line, e.g. `acceptance   87.5%` -> 87.5.
fn panel_number(screen: &str, label: &str) -> Option<f64> {
    screen.lines().find_map(|line| {
        let rest = line.split(label).nth(1)?;
        let number: String = rest.trim_start().chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
        number.parse().ok()
    })
}

fn count(screen: &str, needle: &str) -> usize {
    screen.matches(needle).count()
}

fn assert_layout(screen: &str, width: usize) {
    for line in screen.lines() {
        assert!(line.chars().count() <= width, "a line is wider than {width} columns:\n{screen}");
    }
    for needle in [" kestrel chat · ", " Stats ", "Speculation", "Engine", " Message "] {
        assert!(screen.contains(needle), "{needle:?} missing after resizing to width {width}:\n{screen}");
    }
    let lines: Vec<&str> = screen.lines().collect();
    let stats_row = lines.iter().position(|l| l.contains(" Stats ")).expect("panel title");
    assert!(lines[stats_row].starts_with('┌') && lines[stats_row].trim_end().ends_with('┐'), "panel border: {:?}", lines[stats_row]);
}

#[test]
fn a_message_gets_an_answer_and_ngram_fills_the_panel_and_resize_keeps_the_layout() {
    // With the back-off on (the default). The second reply's prompt holds the first, so its
    // drafts are accepted from its first step, and a verify step of 5 tokens costs less than 5
    // plain ones on any machine: the back-off's first offers are full (nothing measured, then
    // measured twice), and what they learn keeps them so, whatever the step costs here.
    let chat = ChatInTmux::start(100, 30, &["-n", "26"]);
    chat.send_line("hello kestrel");
    let screen = chat.wait_for_screen("the first reply", |s| s.contains("[token limit]"));
    assert!(screen.contains("hello kestrel"), "{screen}");
    assert!(screen.contains(CHAT_REPLY.trim_end()), "the reply is missing:\n{screen}");
    assert!(screen.contains("method       none"), "{screen}");
    assert!(panel_number(&screen, "TTFT").is_some(), "no TTFT in the panel:\n{screen}");

    chat.send_line("/spec ngram");
    chat.wait_for_screen("the /spec note", |s| s.contains("Speculation for the next replies: ngram"));
    chat.send_line("tell me again");
    let screen = chat.wait_for_screen("the second reply", |s| count(s, "[token limit]") == 2 || (s.contains("tell me again") && s.contains("[token limit]") && !s.contains("hello kestrel")));
    assert!(screen.contains("method       ngram (k=4)"), "{screen}");
    let acceptance = panel_number(&screen, "acceptance").unwrap_or_else(|| panic!("no acceptance figure:\n{screen}"));
    assert!(acceptance > 50.0, "the repeating reply should be mostly accepted, got {acceptance}%:\n{screen}");
    let mean_length = panel_number(&screen, "mean length").expect("mean acceptance length");
    assert!(mean_length > 1.5, "mean acceptance length {mean_length}:\n{screen}");
    let bars = screen.lines().filter(|l| l.contains('█') && l.contains('%')).count();
    assert_eq!(bars, 4, "one acceptance bar per draft position (k=4):\n{screen}");
    assert_layout(&screen, 100);

    chat.run(&["resize-window", "-t", "chat", "-x", "80", "-y", "24"]);
    let screen = chat.wait_for_screen("the 80x24 redraw", |s| s.lines().all(|l| l.chars().count() <= 80) && s.lines().count() <= 24 && s.contains(" Message "));
    assert_layout(&screen, 80);
    assert!(panel_number(&screen, "acceptance").is_some_and(|a| a == acceptance), "the figures survive the resize:\n{screen}");

    chat.run(&["resize-window", "-t", "chat", "-x", "120", "-y", "36"]);
    // Wait for the whole redraw (the capture can catch the top rows drawn and the rest not yet).
    let screen = chat.wait_for_screen("the 120x36 redraw", |s| s.lines().any(|l| l.trim_end().chars().count() > 100) && s.contains("Engine") && s.contains(" Message "));
    assert_layout(&screen, 120);
    assert!(!chat.pane_dead(), "the chat exited");
}

#[test]
fn ctrl_c_stops_a_reply_without_quitting_and_errors_stay_in_the_app() {
    let chat = ChatInTmux::start(100, 30, &["-n", "4000"]);
    chat.send_line("talk for a long time");
    chat.wait_for_screen("the reply to start", |s| count(s, CHAT_REPLY.trim_end()) >= 2);
    chat.send_key("C-c");
    let screen = chat.wait_for_screen("the stopped reply", |s| s.contains("[stopped]"));
    assert!(!chat.pane_dead(), "Ctrl-C during a reply must not quit:\n{screen}");
    assert!(screen.contains("batch        0 running"), "the stopped request still runs:\n{screen}");

    // The scripted model has an MTP head; an unknown method is an error.
    chat.send_line("/spec mtp");
    chat.wait_for_screen("MTP for the next replies", |s| s.contains("Speculation for the next replies: mtp"));
    chat.send_line("/spec telepathy");
    chat.wait_for_screen("the method error", |s| s.contains("unknown speculation method"));
    chat.send_line("/temp hot");
    chat.wait_for_screen("the temperature error", |s| s.contains("temperature must be a number"));
    chat.send_line("/frobnicate");
    let screen = chat.wait_for_screen("the unknown command error", |s| s.contains("unknown command /frobnicate"));
    assert!(!chat.pane_dead(), "an error quit the chat:\n{screen}");

    // A second message after the stop is answered; multi-line input goes in one message.
    chat.run(&["send-keys", "-t", "chat", "-l", "first line"]);
    chat.send_key("M-Enter");
    chat.run(&["send-keys", "-t", "chat", "-l", "second line"]);
    chat.send_key("Enter");
    chat.wait_for_screen("the second reply", |s| s.contains("second line") && s.contains("first line") && count(s, "The kestrel hovers") >= 1 && s.contains("generating"));
    chat.send_key("C-c");
    chat.wait_for_screen("the second stop", |s| count(s, "[stopped]") >= 1 && !s.contains("(generating…)"));

    chat.send_line("/clear");
    chat.wait_for_screen("the cleared conversation", |s| s.contains("Conversation cleared.") && !s.contains("second line"));
    // Ctrl-C when idle asks first; a second one quits.
    chat.send_key("C-c");
    chat.wait_for_screen("the question before quitting", |s| s.contains("again to quit"));
    assert!(!chat.pane_dead(), "one Ctrl-C when idle quit at once");
    chat.send_key("C-c");
    wait_for(Duration::from_secs(20), "the chat to quit on a second Ctrl-C when idle", || chat.pane_dead().then_some(()));
    // The shell around the chat writes its exit status to a file once it has reaped it.
    let status = wait_for(Duration::from_secs(20), "the exit status", || {
        std::fs::read_to_string(&chat.status_file).ok().filter(|s| s.ends_with('\n')).map(|s| s.trim().to_string())
    });
    assert_eq!(status, "0", "kestrel chat exited with status {status}");
}

#[test]
fn a_thinking_models_reasoning_is_folded_and_shown_on_request() {
    let chat = ChatInTmux::start_with(thinking_model(), 100, 30, &[]);
    chat.send_line("what is the weather?");
    let answer_start = THINKING_ANSWER.lines().next().expect("a line");
    let screen = chat.wait_for_screen("the answer", |s| s.contains(answer_start) && !s.contains("(generating…)"));
    assert!(screen.contains("▸ reasoning, 2 lines (/reasoning shows it)"), "{screen}");
    assert!(!screen.contains("I will call get_weather"), "folded reasoning is hidden:\n{screen}");
    chat.send_line("/reasoning");
    let screen = chat.wait_for_screen("the reasoning", |s| s.contains("│ I will call get_weather."));
    assert!(screen.contains("▾ reasoning") && screen.contains(answer_start), "{screen}");
}

/// The number after "of" on the panel's `session` line (drafts over the session), if shown.
fn session_drafted(screen: &str) -> Option<u64> {
    screen.lines().find_map(|line| {
        let rest = line.split("session").nth(1)?;
        let count: String = rest.split(" of ").nth(1)?.chars().take_while(char::is_ascii_digit).collect();
        count.parse().ok()
    })
}

#[test]
fn a_stopped_reply_keeps_its_figures_in_the_session_totals() {
    let chat = ChatInTmux::start(100, 30, &["-n", "4000", "--spec", "ngram"]);
    chat.send_line("talk for a long time");
    let screen = chat.wait_for_screen("session figures while the reply runs", |s| session_drafted(s).is_some_and(|n| n > 20));
    let during = session_drafted(&screen).expect("session drafts");
    chat.send_key("C-c");
    let screen = chat.wait_for_screen("the stopped reply", |s| s.contains("[stopped]") && s.contains("batch        0 running"));
    let after = session_drafted(&screen).unwrap_or_else(|| panic!("the session totals lost the stopped reply:\n{screen}"));
    assert!(after >= during, "session drafts fell from {during} to {after} when the reply stopped:\n{screen}");
}

#[test]
fn a_pasted_message_keeps_its_line_breaks_and_esc_asks_before_quitting() {
    let chat = ChatInTmux::start(100, 30, &["-n", "13"]);
    // Pasted as a terminal pastes: line breaks as carriage returns, inside bracketed-paste marks.
    chat.run(&["set-buffer", "-b", "pasted", "first pasted line\nsecond pasted line\nthird"]);
    chat.run(&["paste-buffer", "-p", "-b", "pasted", "-t", "chat"]);
    chat.wait_for_screen("the pasted text in the editor", |s| s.contains("second pasted line"));
    chat.send_key("Enter");
    let screen = chat.wait_for_screen("the reply", |s| s.contains("[token limit]"));
    let rows: Vec<&str> = screen.lines().collect();
    let first = rows.iter().position(|l| l.contains("first pasted line")).expect("the first line is shown");
    assert!(!rows[first].contains("second"), "the pasted lines ran together:\n{screen}");
    assert!(rows[first + 1].contains("second pasted line") && rows[first + 2].contains("third"), "the pasted lines lost their breaks:\n{screen}");
    assert_eq!(count(&screen, "[token limit]"), 1, "the paste was sent as more than one message:\n{screen}");

    // Esc asks before quitting; any other key carries on.
    chat.send_key("Escape");
    chat.wait_for_screen("the question before quitting", |s| s.contains("again to quit"));
    chat.run(&["send-keys", "-t", "chat", "-l", "x"]);
    chat.wait_for_screen("the question withdrawn", |s| !s.contains("again to quit"));
    assert!(!chat.pane_dead(), "Esc quit at once");
    chat.send_key("Escape");
    chat.wait_for_screen("the question before quitting", |s| s.contains("again to quit"));
    chat.send_key("Escape");
    wait_for(Duration::from_secs(20), "the chat to quit on a second Esc", || chat.pane_dead().then_some(()));
}
