//! A newcomer's first run: README.md's first command, run as written from a scratch directory (no
//! model files beside it, so only the embedded default model can answer), must print a completion
//! of at least 64 tokens that does not loop.

use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Splits a shell command line into words: whitespace-separated, with "double" and 'single'
/// quotes grouping (enough for the README's commands, which use no escapes or variables).
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quote: Option<char> = None;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.get_or_insert_with(String::new).push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                word.get_or_insert_with(String::new);
            }
            (None, c) if c.is_whitespace() => words.extend(word.take()),
            (None, c) => word.get_or_insert_with(String::new).push(c),
        }
    }
    assert!(quote.is_none(), "unbalanced quote in `{line}`");
    words.extend(word);
    words
}

/// The arguments the README's first command gives kestrel: the words after `cargo run --release --`.
fn readme_first_command_args() -> Vec<String> {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let line = readme.lines().find(|l| l.trim_start().starts_with("cargo run --release -- ")).expect("README.md has a `cargo run --release -- ...` command");
    let words = shell_words(line.trim());
    let dashes = words.iter().position(|w| w == "--").expect("a `--` before kestrel's arguments");
    words[dashes + 1..].to_vec()
}

/// The most times any window of `width` consecutive ids occurs in `ids`.
fn most_repeated_window(ids: &[u64], width: usize) -> usize {
    let mut counts: HashMap<&[u64], usize> = HashMap::new();
    for w in ids.windows(width) {
        *counts.entry(w).or_default() += 1;
    }
    counts.into_values().max().unwrap_or(0)
}

fn kestrel_in(dir: &std::path::Path, args: &[String]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kestrel")).args(args).current_dir(dir).output().expect("kestrel runs")
}

#[test]
fn shell_words_groups_quotes() {
    assert_eq!(shell_words(r#"cargo run --release -- run "def fib(n):" -n 64"#), ["cargo", "run", "--release", "--", "run", "def fib(n):", "-n", "64"]);
    assert_eq!(shell_words("a 'b c' \"\" d"), ["a", "b c", "", "d"]);
}

#[test]
fn repeated_windows_are_counted() {
    let looping: Vec<u64> = (0..64).map(|i| i % 8).collect();
    assert_eq!(most_repeated_window(&looping, 16), 7);
    let fresh: Vec<u64> = (0..64).collect();
    assert_eq!(most_repeated_window(&fresh, 16), 1);
    assert_eq!(most_repeated_window(&fresh[..10], 16), 0);
}

#[test]
fn readme_first_command_prints_code_that_does_not_loop() {
    let args = readme_first_command_args();
    assert_eq!(args.first().map(String::as_str), Some("run"), "the README's first command runs a prompt: {args:?}");
    let scratch = tempfile::tempdir().expect("a scratch directory");

    // As written: what a newcomer sees.
    let plain = kestrel_in(scratch.path(), &args);
    assert!(plain.status.success(), "`kestrel {}` failed: {}", args.join(" "), String::from_utf8_lossy(&plain.stderr));
    let shown = String::from_utf8(plain.stdout).expect("UTF-8 output");

    // The same run with --json, for its token ids: the default seed makes it the same completion.
    let mut json_args = args.clone();
    json_args.push("--json".into());
    let out = kestrel_in(scratch.path(), &json_args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let text = v["text"].as_str().expect("text");
    assert!(shown.contains(text), "the plain run printed\n{shown}\nbut the --json run's completion is\n{text}");
    assert!(v["sampling"]["temperature"].as_f64().unwrap_or(0.0) > 0.0, "run samples by default: {}", v["sampling"]);
    let ids: Vec<u64> = v["token_ids"].as_array().expect("token_ids").iter().map(|x| x.as_u64().expect("an id")).collect();
    eprintln!("{}{text}", args[1]);
    assert!(ids.len() >= 64, "{} tokens printed, want at least 64", ids.len());
    let most = most_repeated_window(&ids, 16);
    assert!(most <= 2, "a 16-token window repeats {most} times in the first run's completion:\n{text}");
}
