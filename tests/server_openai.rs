//! `kestrel serve` driven by the official `openai` Python client (tests/openai/server_checks.py),
//! on scripted test models with the real Qwen3 tokenizer and chat template.

#[allow(dead_code)]
mod common;
mod frontend_support;

use frontend_support::*;
use kestrel::tokenizer::{ChatMessage, Tokenizer};

fn reply_args() -> Vec<String> {
    vec!["--expect-reply".into(), CHAT_REPLY.into(), "--expect-reply-tokens".into(), CHAT_REPLY_TOKENS.to_string()]
}

fn run_checks(server: &ServerProcess, extra: &[String], checks: &[&str]) {
    let mut args: Vec<&str> = extra.iter().map(String::as_str).collect();
    args.extend_from_slice(checks);
    run_openai_script(server, "server_checks.py", &args, checks);
}

#[test]
fn chat_and_completions_streamed_and_whole() {
    let server = ServerProcess::start(chat_model(), &[]);
    run_checks(&server, &reply_args(), &["models", "chat", "chat_stream", "stop_strings", "completion"]);
}

#[test]
fn tool_calls_are_parsed_into_tool_calls() {
    // The prompt the server should build: the user message with the tool rendered by the template.
    let tokenizer = Tokenizer::from_dir(tool_model()).expect("tokenizer loads");
    let tools = serde_json::json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for the coming days",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]}}}]);
    let prompt = tokenizer.apply_chat_template(&[ChatMessage::user("Weather for the next 3 days?")], true, Some(&tools)).expect("template renders tools");
    assert!(prompt.contains("<tools>") && prompt.contains("\"get_weather\""), "{prompt}");
    let prompt_tokens = tokenizer.encode(&prompt, false).expect("encodes").len();

    let server = ServerProcess::start(tool_model(), &[]);
    let args = vec!["--expect-tool-text".to_string(), TOOL_CALL_TEXT.to_string(), "--expect-tool-prompt-tokens".to_string(), prompt_tokens.to_string()];
    run_checks(&server, &args, &["tool_call"]);
}

#[test]
fn every_error_case_is_an_openai_error_and_the_server_keeps_serving() {
    let server = ServerProcess::start(chat_model(), &["--max-request-bytes", "65536"]);
    run_checks(&server, &["--body-limit".into(), "65536".into()], &["errors"]);
    let mut server = server;
    assert!(server.is_running(), "the server exited after bad requests");
}

#[test]
fn a_request_that_meets_nan_logits_fails_alone_and_the_others_go_on() {
    let server = ServerProcess::start(nan_chat_model(), &["--max-num-seqs", "4"]);
    let mut args = reply_args();
    args.extend(["--poison-word".to_string(), POISON_WORD.to_string()]);
    run_checks(&server, &args, &["nonfinite"]);
    let mut server = server;
    assert!(server.is_running(), "the server exited after a failed request");
}

#[test]
fn browsers_of_allowed_origins_get_cors_headers() {
    let server = ServerProcess::start(chat_model(), &["--allowed-origins", "http://localhost:5173,http://app.example"]);
    run_checks(&server, &["--allowed-origin".into(), "http://app.example".into()], &["cors"]);
}

#[test]
fn serve_takes_the_model_as_an_argument_a_host_name_and_the_max_batch_alias() {
    let args: Vec<String> = vec![chat_model().display().to_string(), "--host".into(), "localhost".into(), "--max-batch".into(), "2".into()];
    let server = ServerProcess::start_with(&args);
    assert!(server.address.ip().is_loopback(), "localhost listens on loopback: {}", server.address);
    run_checks(&server, &reply_args(), &["models", "chat"]);
}

/// `kestrel serve` with a model path that does not exist: whatever fails first was checked
/// before the model was opened.
fn serve_error(args: &[&str]) -> String {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"));
    command.args(["serve", "/nonexistent/model", "--device", "cpu"]).args(args);
    let output = run_with_deadline(&mut command, std::time::Duration::from_secs(60));
    assert!(!output.status.success(), "kestrel serve {args:?} should fail");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!stderr.contains("does not exist"), "kestrel serve {args:?} opened the model before refusing: {stderr}");
    stderr
}

#[test]
fn bad_flags_and_a_busy_port_are_refused_before_the_model_loads() {
    for (args, needle) in [
        (&["--api-key", ""][..], "--api-key is empty"),
        (&["--max-request-bytes", "0"], "--max-request-bytes must be at least 1"),
        (&["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
        (&["--allowed-origins", "example.com"], "not an origin"),
        (&["--host", "no-such-host.invalid"], "--host no-such-host.invalid"),
    ] {
        let stderr = serve_error(args);
        assert!(stderr.contains(needle), "kestrel serve {args:?}: stderr lacks {needle:?}: {stderr}");
    }
    let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let port = busy.local_addr().expect("bound").port().to_string();
    let stderr = serve_error(&["--port", &port]);
    assert!(stderr.contains("in use") && stderr.contains(&port), "{stderr}");
    // Both ways of naming the model at once is a mistake.
    let stderr = serve_error(&["--model", "/elsewhere"]);
    assert!(stderr.contains("cannot be used with"), "{stderr}");
}

#[test]
fn api_key_is_required_when_set() {
    let server = ServerProcess::start(chat_model(), &["--api-key", "sesame"]);
    run_checks(&server, &["--api-key".into(), "sesame".into()], &["api_key"]);
}

#[test]
fn eight_concurrent_streams_equal_the_same_requests_one_at_a_time() {
    let server = ServerProcess::start(chat_model(), &["--max-num-seqs", "8"]);
    run_checks(&server, &[], &["concurrency"]);
}

#[test]
fn a_client_that_disconnects_mid_stream_cancels_its_request() {
    let server = ServerProcess::start(chat_model(), &[]);
    run_checks(&server, &[], &["disconnect"]);
}

#[test]
fn metrics_report_speculation_per_position() {
    // Every step offered all drafts: this counts what verified drafts do to the metrics. With
    // the back-off on, few are offered here, rightly: on this model a verify row costs about
    // as much per token as a plain step on a CPU (its 151k-token lm_head runs for every row), so
    // drafts pay only once they are known to be nearly all accepted, and the reply repeats
    // for only its last 13 tokens. (The TUI's ngram panel test runs with the back-off on.)
    let server = ServerProcess::start(chat_model(), &["--spec", "ngram", "--spec-tokens", "3", "--no-spec-backoff"]);
    run_checks(&server, &reply_args(), &["chat_stream"]);
    let drafted = server.metric("kestrel_spec_drafted_total");
    let accepted = server.metric("kestrel_spec_accepted_total");
    assert!(drafted > 0.0 && accepted > 0.0, "ngram drafted {drafted}, accepted {accepted} on a repeating reply");
    let first = server.metric("kestrel_spec_accepted_per_position_total{position=\"0\"}");
    let third = server.metric("kestrel_spec_accepted_per_position_total{position=\"2\"}");
    assert!(first >= third && third > 0.0, "per-position acceptance {first} .. {third}");
    let rate = server.metric("kestrel_spec_acceptance_rate");
    assert!((rate - accepted / drafted).abs() < 1e-9, "acceptance rate {rate} != {accepted}/{drafted}");
    assert_eq!(server.metric("kestrel_requests_running"), 0.0);
    let metrics = server.get("/metrics");
    assert!(metrics.body.contains("# TYPE kestrel_spec_drafted_total counter"), "{}", metrics.body);
}

fn prompt_tokens(model: &std::path::Path, messages: &[ChatMessage], kwargs: serde_json::Value, tools: Option<&serde_json::Value>) -> usize {
    let tokenizer = Tokenizer::from_dir(model).expect("tokenizer loads");
    let prompt = tokenizer.apply_chat_template_with(messages, true, tools, kwargs.as_object().expect("an object")).expect("renders");
    tokenizer.encode(&prompt, false).expect("encodes").len()
}

#[test]
fn json_schemas_and_lark_grammars_hold_the_output() {
    let server = ServerProcess::start(chat_model(), &[]);
    run_checks(&server, &[], &["json_schema", "grammar"]);
}

#[test]
fn forced_tool_calls_follow_the_templates_syntax() {
    let server = ServerProcess::start(chat_model(), &[]);
    run_checks(&server, &[], &["forced_tool_calls"]);
    let server = ServerProcess::start(xml_tool_model(), &[]);
    run_checks(&server, &["--expect-reasoning".into(), XML_REASONING.into()], &["forced_xml_tool_call"]);
}

#[test]
fn several_choices_and_penalties() {
    let server = ServerProcess::start(chat_model(), &["--max-num-seqs", "4"]);
    run_checks(&server, &[], &["choices", "penalties"]);
}

/// The log probabilities the server reports are `log_softmax` of the logits this test computes
/// itself, with the model loaded here (a prefill over the prompt and the generated tokens).
#[test]
fn logprobs_are_log_softmax_of_the_logits() {
    let server = ServerProcess::start(chat_model(), &[]);
    let stdout = run_openai_script(&server, "server_checks.py", &["logprobs"], &["logprobs"]);
    let line = stdout.lines().find_map(|l| l.strip_prefix("LOGPROBS_JSON ")).expect("the check prints what it got");
    let got: serde_json::Value = serde_json::from_str(line).expect("JSON");
    let ids = |key: &str| -> Vec<u32> { got[key].as_array().expect("a list").iter().map(|v| v.as_u64().expect("an id") as u32).collect() };
    let (prompt, tokens) = (ids("prompt"), ids("tokens"));
    let files = kestrel::model::ModelFiles::open_dir(chat_model()).expect("model opens");
    let model = kestrel::model::arch::qwen35::Qwen35::load(&kestrel::backend::cpu::CpuBackend::new().with_f32_activations(), files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
    let vocab = files.config.vocab_size;
    let all: Vec<u32> = prompt.iter().chain(&tokens).copied().collect();
    // The server's backend (bf16 activations) and cache (the default KV format).
    let logits = common::prefill_logits_on(&kestrel::backend::cpu::CpuBackend::new(), &model, &all, 64, kestrel::backend::KvDtype::default());
    for (i, &token) in tokens.iter().enumerate() {
        let row = &logits[(prompt.len() - 1 + i) * vocab..][..vocab];
        let max = row.iter().map(|&l| f64::from(l)).fold(f64::NEG_INFINITY, f64::max);
        let normaliser = max + row.iter().map(|&l| (f64::from(l) - max).exp()).sum::<f64>().ln();
        let want = f64::from(row[token as usize]) - normaliser;
        let reported = got["token_logprobs"][i].as_f64().expect("a number");
        assert!((reported - want).abs() < 1e-3, "token {i} ({token}): reported {reported}, log_softmax {want}");
        let mut best: Vec<u32> = (0..vocab as u32).collect();
        best.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        for (rank, pair) in got["top_logprobs"][i].as_array().expect("alternatives").iter().enumerate() {
            let (alternative, logprob) = (pair[0].as_u64().expect("an id") as u32, pair[1].as_f64().expect("a number"));
            assert!((logprob - (f64::from(row[alternative as usize]) - normaliser)).abs() < 1e-3, "alternative {alternative} of token {i}");
            assert!((f64::from(row[best[rank] as usize]) - f64::from(row[alternative as usize])).abs() < 1e-4, "token {i}: alternative {rank} is not the {rank}-th most likely");
        }
    }
}

#[test]
fn reasoning_comes_back_apart_from_the_answer() {
    let user = [ChatMessage::user("What is the weather?")];
    let off = prompt_tokens(thinking_model(), &user, serde_json::json!({"enable_thinking": false}), None);
    assert!(off > prompt_tokens(thinking_model(), &user, serde_json::json!({}), None), "thinking off renders the empty think block");
    let server = ServerProcess::start(thinking_model(), &[]);
    let args = [
        "--expect-reasoning", THINKING_REASONING, "--expect-answer", THINKING_ANSWER, "--expect-off-answer", THINKING_OFF_ANSWER,
        "--expect-off-prompt-tokens", &off.to_string(),
    ];
    run_checks(&server, &args.map(String::from), &["reasoning"]);
}

#[test]
fn qwen35_xml_tool_calls_come_back_with_typed_arguments() {
    let server = ServerProcess::start(xml_tool_model(), &[]);
    let args = ["--expect-reasoning", XML_REASONING, "--expect-off-answer", XML_THINKING_OFF_ANSWER];
    run_checks(&server, &args.map(String::from), &["xml_tool_calls"]);
}

#[test]
fn tokenize_endpoints_and_generation_errors() {
    let hi = prompt_tokens(chat_model(), &[ChatMessage::user("Hi")], serde_json::json!({}), None);
    let server = ServerProcess::start(chat_model(), &[]);
    run_checks(&server, &["--expect-hi-prompt-tokens".into(), hi.to_string()], &["tokenize", "generation_errors"]);
    let mut server = server;
    assert!(server.is_running(), "the server exited after bad requests");
}

/// A chat request and its parsed response.
fn chat(server: &ServerProcess, messages: &serde_json::Value) -> serde_json::Value {
    let body = serde_json::json!({"model": "kestrel-chat-test", "messages": messages, "max_tokens": 8, "temperature": 0}).to_string();
    let response = http_request(server.address, "POST", "/v1/chat/completions", &[("Content-Type", "application/json")], body.as_bytes());
    assert_eq!(response.status, 200, "{}", response.body);
    serde_json::from_str(&response.body).expect("a JSON completion")
}

#[test]
fn the_next_turn_of_a_conversation_is_served_from_the_prefix_cache() {
    let system = "You answer questions about birds of prey. ".repeat(12);
    let mut messages = serde_json::json!([{"role": "system", "content": system}, {"role": "user", "content": "Tell me about kestrels."}]);
    for args in [&[][..], &["--no-prefix-cache"][..]] {
        let server = ServerProcess::start(chat_model(), args);
        let first = chat(&server, &messages);
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{first}");
        let mut next = messages.clone();
        let reply = first["choices"][0]["message"]["content"].clone();
        next.as_array_mut().expect("messages").extend([serde_json::json!({"role": "assistant", "content": reply}), serde_json::json!({"role": "user", "content": "And falcons?"})]);
        let second = chat(&server, &next);
        let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens");
        let prompt = second["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
        if args.is_empty() {
            // The first turn's prompt, cut to its last multiple of 64 tokens below its end.
            let first_prompt = first["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
            assert_eq!(cached, (first_prompt - 1) / 64 * 64, "{second}");
            assert!(cached > 0 && cached < prompt);
            assert_eq!(server.metric("kestrel_prefix_cache_cached_tokens_total"), cached as f64);
            assert_eq!(server.metric("kestrel_prefix_cache_hits_total"), 1.0);
            let rate = server.metric("kestrel_prefix_cache_hit_rate");
            assert!((rate - cached as f64 / (first_prompt + prompt) as f64).abs() < 1e-9, "hit rate {rate}");
            assert!(server.metric("kestrel_prefix_cache_checkpoints") > 0.0);
        } else {
            assert_eq!(cached, 0, "{second}");
            assert_eq!(server.metric("kestrel_prefix_cache_checkpoint_capacity"), 0.0);
        }
        messages = serde_json::json!([{"role": "system", "content": system}, {"role": "user", "content": "Tell me about kestrels."}]);
    }
}
