//! The `kestrel` binary end to end: the default model out of the box, every subcommand's
//! output contract, and clear errors for bad input.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the binary from a scratch directory, so nothing depends on the working directory.
fn kestrel(args: &[&str]) -> Output {
    let cwd = tempfile::tempdir().unwrap();
    Command::new(env!("CARGO_BIN_EXE_kestrel")).args(args).current_dir(cwd.path()).output().expect("kestrel runs")
}

fn ok_json(args: &[&str]) -> Value {
    let out = kestrel(args);
    assert!(out.status.success(), "kestrel {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("kestrel {args:?}: not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn fails_with(args: &[&str], needle: &str) {
    let out = kestrel(args);
    assert!(!out.status.success(), "kestrel {args:?} should fail");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(needle), "kestrel {args:?}: stderr lacks `{needle}`:\n{err}");
}

fn eval_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("models/kestrel-coder/eval.json")).unwrap()).unwrap()
}

#[test]
fn default_model_writes_python_from_any_directory() {
    let v = ok_json(&["run", "def fib(n):", "-n", "64", "--json"]);
    let want: Vec<u64> = eval_json()["fib_greedy_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    let got: Vec<u64> = v["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert_eq!(got, want, "greedy continuation differs from the training script's");
    let text = v["text"].as_str().unwrap();
    assert!(text.contains("return") || text.contains("def") || text.contains('('), "not code-like: {text}");
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 64);
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert!(v["timing"]["ttft_ms"].as_f64().unwrap() > 0.0);
    for key in ["method", "k", "draft_steps", "drafted", "accepted", "acceptance_rate", "mean_acceptance_length", "per_position"] {
        assert!(v["spec"].get(key).is_some(), "spec.{key} missing");
    }
}

#[test]
fn speculation_keeps_the_cli_output() {
    let none = ok_json(&["run", "import os\nimport sys\n", "-n", "48", "--json"]);
    for spec in ["ngram", "mtp"] {
        let v = ok_json(&["run", "import os\nimport sys\n", "-n", "48", "--json", "--spec", spec, "--spec-tokens", "3"]);
        assert_eq!(v["token_ids"], none["token_ids"], "--spec {spec} changed the text");
        assert!(v["spec"]["drafted"].as_u64().unwrap() > 0, "--spec {spec} never drafted");
    }
}

#[test]
fn perplexity_agrees_with_the_training_script() {
    let heldout = root().join("models/kestrel-coder/heldout.txt");
    let v = ok_json(&["perplexity", "--file", heldout.to_str().unwrap(), "--json"]);
    let want = eval_json()["heldout_sample_loss"].as_f64().unwrap();
    let got = v["mean_nll"].as_f64().unwrap();
    assert!((got - want).abs() / want < 0.02, "mean NLL {got} vs script {want}");
    assert_eq!(v["tokens"], eval_json()["heldout_sample_tokens"]);
    assert!((v["perplexity"].as_f64().unwrap() - got.exp()).abs() < 1e-9);
}

#[test]
fn info_lists_the_mtp_tensors() {
    let v = ok_json(&["info", "--json"]);
    let mtp: Vec<&str> = v["mtp_tensors"].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
    for name in ["mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.pre_fc_norm_hidden.weight"] {
        assert!(mtp.contains(&name), "{name} not listed");
    }
    assert_eq!(v["family"], "qwen3.5");
    let text = kestrel(&["info"]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("mtp.fc.weight"));
}

#[test]
fn fixture_model_runs_from_the_readme_command() {
    let dense = root().join("tests/fixtures/qwen35-dense");
    let v = ok_json(&["run", "--model", dense.to_str().unwrap(), "hello", "-n", "16", "--json"]);
    assert_eq!(v["token_ids"].as_array().unwrap().len(), 16);
}

#[test]
fn batch_writes_one_line_per_request_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let output = dir.path().join("out.jsonl");
    std::fs::write(
        &input,
        [
            r#"{"id": "a", "prompt": "def add(a, b):", "max_tokens": 12}"#,
            r#"{"id": 7, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0.8, "seed": 3}"#,
            r#"{"id": "c", "prompt": "class Foo:", "max_tokens": 9, "spec": "ngram"}"#,
        ]
        .join("\n"),
    )
    .unwrap();
    let out = kestrel(&["batch", "--input", input.to_str().unwrap(), "--output", output.to_str().unwrap(), "--max-batch", "2", "--spec", "mtp"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<Value> = std::fs::read_to_string(&output).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["id"], "a");
    assert_eq!(lines[1]["id"], 7);
    assert_eq!(lines[2]["id"], "c");
    assert_eq!(lines[2]["spec"]["method"], "ngram");
    assert_eq!(lines[0]["spec"]["method"], "mtp");
    for l in &lines {
        assert_eq!(l["usage"]["completion_tokens"].as_u64().unwrap() as usize, l["token_ids"].as_array().unwrap().len());
        assert!(l["finish_reason"] == "length" || l["finish_reason"] == "stop");
    }
    // The same prompt alone gives the same tokens (batching never changes text).
    let alone = ok_json(&["run", "def add(a, b):", "-n", "12", "--json"]);
    assert_eq!(alone["token_ids"], lines[0]["token_ids"]);
}

#[test]
fn bench_reports_consistent_metrics() {
    let out = kestrel(&["bench", "--spec", "none,ngram,mtp", "--dataset", "humaneval", "--num-prompts", "4", "--concurrency", "2", "--max-tokens", "16", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Value> = String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 3);
    let none_tps = rows[0]["output_tokens_per_s"].as_f64().unwrap();
    for r in &rows {
        for key in ["ttft_ms", "tpot_ms", "itl_ms"] {
            for stat in ["mean", "median", "p99"] {
                assert!(r[key][stat].as_f64().unwrap() >= 0.0, "{key}.{stat}");
            }
        }
        let s = &r["spec"];
        assert!(s["accepted"].as_u64().unwrap() <= s["drafted"].as_u64().unwrap());
        let pp: Vec<f64> = s["per_position"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        assert!(pp.windows(2).all(|w| w[0] >= w[1]), "per-position acceptance must not increase: {pp:?}");
        let speedup = r["speedup_vs_none"].as_f64().unwrap();
        let tps = r["output_tokens_per_s"].as_f64().unwrap();
        assert!((speedup - tps / none_tps).abs() < 1e-9, "speedup must be the throughput ratio");
        assert_eq!(r["output_tokens"], 64);
    }
}

#[test]
fn a_bench_sweep_that_stops_early_keeps_the_finished_results() {
    // The MoE fixture has no MTP head: `none` runs, then `mtp` cannot start.
    let model = root().join("tests/fixtures/qwen35-moe");
    let out = kestrel(&["bench", "--model", model.to_str().unwrap(), "--spec", "none,mtp", "--dataset", "random", "--input-len", "8", "--num-prompts", "2", "--max-tokens", "4", "--json"]);
    assert!(!out.status.success(), "the mtp run cannot start, so the sweep must fail");
    let rows: Vec<Value> = String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 1, "the finished `none` run is still reported");
    assert_eq!(rows[0]["method"], "none");
    assert_eq!(rows[0]["output_tokens"], 8);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("mtp at concurrency 8") && err.contains("MTP head"), "{err}");
}

/// The thread count changes speed, never text: every output row is computed in the same order
/// whichever thread runs it.
#[test]
fn the_thread_count_keeps_the_text() {
    let default = ok_json(&["run", "def fib(n):", "-n", "32", "--json", "--device", "cpu"]);
    for threads in ["1", "3"] {
        let v = ok_json(&["run", "def fib(n):", "-n", "32", "--json", "--device", "cpu", "-t", threads]);
        assert_eq!(v["token_ids"], default["token_ids"], "-t {threads} changed the text");
    }
}

/// A real-size model with random weights runs on the CPU (the values the GPU would make).
#[test]
fn dummy_weights_at_a_real_size_run_on_the_cpu() {
    let v = ok_json(&["run", "def", "-n", "2", "--json", "--device", "cpu", "--load-format", "dummy", "--model", "qwen3.5-0.8b", "--max-model-len", "64"]);
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert_eq!(v["token_ids"].as_array().map(Vec::len), Some(2));
}

#[test]
fn bad_input_gets_a_clear_error() {
    fails_with(&["run", "--model", "/nonexistent/model", "hi"], "does not exist");
    fails_with(&["run", ""], "empty prompt");
    fails_with(&["run", "hi", "-n", "0"], "max_tokens must be at least 1");
    fails_with(&["run", "hi", "--temperature=-1"], "temperature");
    fails_with(&["run", "hi", "--spec", "medusa"], "unknown speculation method");
    fails_with(&["run", "hi", "--spec", "none,ngram"], "one method");
    fails_with(&["run", "hi", "-n", "5000"], "exceeds the context length");
    fails_with(&["perplexity", "--file", "/nonexistent.txt"], "cannot read");
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"id\": 1, \"prompt\": \"x\"}\n{not json}\n").unwrap();
    fails_with(&["batch", "--input", bad.to_str().unwrap()], "line 2");
    std::fs::write(&bad, r#"{"id": 1, "prompt": "x", "messages": []}"#).unwrap();
    fails_with(&["batch", "--input", bad.to_str().unwrap()], "exactly one of `prompt` and `messages`");
    let empty_dir = tempfile::tempdir().unwrap();
    fails_with(&["info", "--model", empty_dir.path().to_str().unwrap()], "not a model directory");
    // Dummy weights need a preset that exists.
    fails_with(&["run", "hi", "--load-format", "dummy", "--model", "qwen9-huge", "--device", "cpu"], "unknown model preset `qwen9-huge`");
    fails_with(&["run", "hi", "--threads", "0"], "--threads must be at least 1");
    fails_with(&["bench", "-t", "0", "--num-prompts", "1"], "--threads must be at least 1");
    fails_with(&["run", "hi", "--load-format", "dummy"], "needs --model PRESET");
    fails_with(&["run", "hi", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]");
    fails_with(&["run", "hi", "--kv-cache-dtype", "tq3"], "only bf16");
    assert!(Path::new(env!("CARGO_BIN_EXE_kestrel")).exists());
}
