//! `kestrel run`: the text on stdout, statistics on stderr, the prompt from the argument or stdin.
//! The scripted chat model continues any prompt that ends in a newline with `CHAT_REPLY`.

mod frontend_support;

use frontend_support::*;
use std::process::{Command, Output};
use std::time::Duration;

fn kestrel_run(args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kestrel"));
    command.args(["run", "--device", "cpu", "--model"]).arg(chat_model()).args(args).env("RAYON_NUM_THREADS", "2");
    run_with_deadline(&mut command, Duration::from_secs(120))
}

/// Runs a shell pipeline with `$KESTREL` set to the binary and `$MODEL` to the chat model.
fn pipeline(script: &str) -> Output {
    let mut command = Command::new("bash");
    command.args(["-o", "pipefail", "-c", script]).env("KESTREL", env!("CARGO_BIN_EXE_kestrel")).env("MODEL", chat_model()).env("RAYON_NUM_THREADS", "2");
    run_with_deadline(&mut command, Duration::from_secs(120))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn prompt_argument_streams_exactly_the_text_and_stats_go_to_stderr() {
    let output = kestrel_run(&["-n", &CHAT_REPLY_TOKENS.to_string(), "say something\n"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(text(&output.stdout), CHAT_REPLY, "stdout holds the generated text and nothing else");
    let stderr = text(&output.stderr);
    assert!(stderr.contains(&format!("3 prompt + {CHAT_REPLY_TOKENS} generated tokens (max tokens)")), "{stderr}");
    assert!(stderr.contains("TTFT") && stderr.contains("tokens/s") && stderr.contains("no speculation"), "{stderr}");
}

#[test]
fn prompt_from_stdin() {
    let output = pipeline("printf 'say something\\n' | \"$KESTREL\" run --device cpu --model \"$MODEL\" -n 26");
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(text(&output.stdout), CHAT_REPLY.repeat(2));
}

#[test]
fn chat_template_and_json_output() {
    let output = kestrel_run(&["--chat", "--json", "-n", &CHAT_REPLY_TOKENS.to_string(), "--spec", "ngram", "hello"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("stdout is one JSON object");
    assert_eq!(json["text"], CHAT_REPLY);
    assert_eq!(json["finish_reason"], "length");
    assert_eq!(json["usage"]["completion_tokens"], CHAT_REPLY_TOKENS);
    assert_eq!(json["token_ids"].as_array().map(Vec::len), Some(CHAT_REPLY_TOKENS));
    assert!(json["usage"]["prompt_tokens"].as_u64().is_some_and(|n| n > 5), "the chat template wrapped the prompt: {json}");
    assert_eq!(json["spec"]["method"], "ngram");
    assert!(json["timing"]["ttft_ms"].as_f64().is_some());
}

#[test]
fn speculation_statistics_are_reported() {
    let output = kestrel_run(&["--spec", "ngram", "-n", "52", "say something\n"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(text(&output.stdout), CHAT_REPLY.repeat(4), "speculation never changes the text");
    let stderr = text(&output.stderr);
    assert!(stderr.contains("ngram k=4: acceptance") && !stderr.contains("acceptance 0.0%"), "{stderr}");
}

#[test]
fn a_closed_pipe_stops_generation_quietly() {
    let output = pipeline("\"$KESTREL\" run --device cpu --model \"$MODEL\" -n 3500 $'say something\\n' | head -c 20");
    assert!(output.status.success(), "kestrel run failed on a closed pipe: {}", text(&output.stderr));
    assert_eq!(text(&output.stdout), CHAT_REPLY[..20]);
    let stderr = text(&output.stderr);
    assert!(stderr.contains("(output closed)") && !stderr.contains("Error"), "{stderr}");
}

#[test]
fn an_empty_prompt_is_a_clear_error() {
    let output = pipeline("printf '  \\n' | \"$KESTREL\" run --device cpu --model \"$MODEL\"");
    assert!(!output.status.success());
    assert!(text(&output.stderr).contains("empty prompt"), "{}", text(&output.stderr));
}

fn kestrel_run_with(model: &std::path::Path, args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kestrel"));
    command.args(["run", "--device", "cpu", "--model"]).arg(model).args(args).env("RAYON_NUM_THREADS", "2");
    run_with_deadline(&mut command, Duration::from_secs(120))
}

#[test]
fn chat_prints_a_thinking_models_reasoning_only_when_asked() {
    let output = kestrel_run_with(thinking_model(), &["--chat", "-n", "200", "what is the weather?"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(text(&output.stdout), THINKING_ANSWER, "without --show-reasoning only the answer");
    let output = kestrel_run_with(thinking_model(), &["--chat", "--show-reasoning", "-n", "200", "what is the weather?"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(text(&output.stdout), format!("{THINKING_REASONING}\n\n{THINKING_ANSWER}"));
    let output = kestrel_run_with(thinking_model(), &["--chat", "--json", "-n", "200", "what is the weather?"]);
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert_eq!(json["reasoning"], THINKING_REASONING);
    assert_eq!(json["content"], THINKING_ANSWER);
}

#[test]
fn json_schema_grammar_and_logprobs_flags() {
    let dir = tempfile::tempdir().expect("temp dir");
    let schema = dir.path().join("schema.json");
    std::fs::write(&schema, r#"{"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}}, "required": ["ok", "n"], "additionalProperties": false}"#).expect("written");
    let output = kestrel_run(&["--json", "--json-schema", schema.to_str().expect("utf-8"), "--temperature", "0.9", "--seed", "5", "-n", "60", "--logprobs", "2", "say something\n"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    let value: serde_json::Value = serde_json::from_str(json["text"].as_str().expect("text")).expect("the output is JSON");
    assert!(value["ok"].is_boolean() && [1, 2, 3].contains(&value["n"].as_i64().expect("n")), "{value}");
    let logprobs = json["logprobs"].as_array().expect("log probabilities");
    assert_eq!(logprobs.len(), json["token_ids"].as_array().expect("ids").len());
    assert!(logprobs.iter().zip(json["token_ids"].as_array().expect("ids")).all(|(l, id)| l["token_id"] == *id && l["top_logprobs"].as_array().is_some_and(|t| t.len() == 2)));

    let grammar = dir.path().join("answer.lark");
    std::fs::write(&grammar, "start: (\"yes\" | \"no\") \".\"").expect("written");
    let output = kestrel_run(&["--grammar", grammar.to_str().expect("utf-8"), "-n", "10", "say something\n"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(["yes.", "no."].contains(&text(&output.stdout).as_str()), "{}", text(&output.stdout));

    std::fs::write(&schema, r#"{"type": "strng"}"#).expect("written");
    let output = kestrel_run(&["--json-schema", schema.to_str().expect("utf-8"), "x"]);
    assert!(!output.status.success() && text(&output.stderr).contains("--json-schema: cannot compile"), "{}", text(&output.stderr));
    let output = kestrel_run(&["--logprobs", "3", "x"]);
    assert!(!output.status.success() && text(&output.stderr).contains("--json"), "{}", text(&output.stderr));
    let output = kestrel_run(&["--presence-penalty", "5", "x"]);
    assert!(!output.status.success() && text(&output.stderr).contains("presence_penalty"), "{}", text(&output.stderr));
}
