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
    fails_with_text(args, needle);
}

/// Like [`fails_with`], returning stderr.
fn fails_with_text(args: &[&str], needle: &str) -> String {
    let out = kestrel(args);
    assert!(!out.status.success(), "kestrel {args:?} should fail");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(err.contains(needle), "kestrel {args:?}: stderr lacks `{needle}`:\n{err}");
    err
}

fn eval_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(root().join("models/kestrel-coder/eval.json")).unwrap()).unwrap()
}

#[test]
fn default_model_writes_python_from_any_directory() {
    let v = ok_json(&["run", "def fib(n):", "-n", "64", "--json", "--temperature", "0"]);
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

/// `run` samples with llama.cpp's defaults and a fixed seed (greedy decoding of a small model
/// repeats itself), and `--json` names the sampling so the run can be repeated.
#[test]
fn the_first_command_samples_with_llama_cpp_defaults() {
    // tests/first_run.rs runs the README's command itself and checks that its text does not loop.
    let v = ok_json(&["run", "def fib(n):", "-n", "64", "--json"]);
    assert_eq!(v["sampling"], serde_json::json!({"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 0}), "{v}");
    assert_eq!(v["token_ids"].as_array().unwrap().len(), 64, "{v}");
    // The same command again gives the same text (the default seed is fixed).
    assert_eq!(ok_json(&["run", "def fib(n):", "-n", "64", "--json"])["token_ids"], v["token_ids"]);
    // Greedy on request; the model's generation_config.json would come before llama.cpp's.
    let greedy = ok_json(&["run", "def fib(n):", "-n", "8", "--json", "--temp", "0"]);
    assert_eq!(greedy["sampling"]["temperature"], 0.0);
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
    // The default model stores its linears in int4 (packed weights, zero points, scales) and its
    // norms in bf16: every stored tensor is listed, the integer ones too.
    for name in ["mtp.fc.qweight", "mtp.fc.qzeros", "mtp.fc.scales", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.qweight", "mtp.pre_fc_norm_hidden.weight"] {
        assert!(mtp.contains(&name), "{name} not listed: {mtp:?}");
    }
    assert_eq!(v["family"], "qwen3.5");
    assert_eq!(v["quantization"], "int4 in groups of 128 (GPTQ packing)");
    let text = kestrel(&["info"]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("mtp.fc.qweight"));
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
    // Lines are written as their requests finish: find them by id.
    let mut lines: Vec<Value> = std::fs::read_to_string(&output).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    let ids = [serde_json::json!("a"), serde_json::json!(7), serde_json::json!("c")];
    let order = |v: &Value| ids.iter().position(|id| v["id"] == *id).expect("a known id");
    lines.sort_by_key(order);
    assert_eq!(lines[2]["spec"]["method"], "ngram");
    assert_eq!(lines[0]["spec"]["method"], "mtp");
    for l in &lines {
        assert_eq!(l["usage"]["completion_tokens"].as_u64().unwrap() as usize, l["token_ids"].as_array().unwrap().len());
        assert!(l["finish_reason"] == "length" || l["finish_reason"] == "stop");
    }
    // The same prompt alone gives the same tokens (batching never changes text; batch lines
    // are greedy unless they say otherwise).
    let alone = ok_json(&["run", "def add(a, b):", "-n", "12", "--json", "--temperature", "0"]);
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
        // How often the back-off (on by default) offered fewer drafts: not a thing without speculation.
        match r["method"].as_str().unwrap() {
            "none" => assert!(r["backed_off_fraction"].is_null()),
            _ => assert!((0.0..=1.0).contains(&r["backed_off_fraction"].as_f64().unwrap()), "{}", r["backed_off_fraction"]),
        }
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

/// `--cpu-matmul int8` runs llama.cpp's Q4_K_M file on the integer path: its text does not
/// depend on the thread count either, and perplexity takes the flag too. Without the flag
/// (auto) the file's Q4_K and Q6_K weights take the integer path as well: not exact mode's
/// figure, and the same as `--cpu-matmul auto`.
#[test]
fn the_int8_cpu_matmul_runs_a_quantized_file_and_keeps_the_thread_invariance() {
    let gguf = root().join("tests/fixtures/peer/kc-Q4_K_M.gguf");
    let model = gguf.to_str().unwrap();
    let run = |threads: &str| ok_json(&["run", "def fib(n):", "-n", "24", "--json", "--model", model, "--device", "cpu", "--cpu-matmul", "int8", "-t", threads]);
    let one = run("1");
    assert_eq!(one["token_ids"].as_array().map(Vec::len), Some(24));
    assert_eq!(run("3")["token_ids"], one["token_ids"], "-t 3 changed the int8 text");
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(&text, std::fs::read_to_string(root().join("models/kestrel-coder/heldout.txt")).unwrap().chars().take(3000).collect::<String>()).unwrap();
    let ppl = |mode: &str| ok_json(&["perplexity", "--model", model, "--file", text.to_str().unwrap(), "--context", "256", "--device", "cpu", "--cpu-matmul", mode, "--json"])["perplexity"].as_f64().expect("a perplexity");
    let (exact, int8, auto) = (ppl("exact"), ppl("int8"), ppl("auto"));
    assert!(exact.is_finite() && exact > 1.0 && exact != int8 && (int8 / exact - 1.0).abs() < 0.01, "perplexity exact {exact}, int8 {int8}");
    assert!(auto != exact && (auto / exact - 1.0).abs() < 0.01, "perplexity exact {exact}, auto {auto}");
    let default = ok_json(&["perplexity", "--model", model, "--file", text.to_str().unwrap(), "--context", "256", "--device", "cpu", "--json"])["perplexity"].as_f64();
    assert_eq!(default, Some(auto), "the default CPU matmul mode is not auto");
}

/// A real-size model with random weights runs on the CPU (the values the GPU would make).
#[test]
fn dummy_weights_at_a_real_size_run_on_the_cpu() {
    let v = ok_json(&["run", "def", "-n", "2", "--json", "--device", "cpu", "--load-format", "dummy", "--model", "qwen3.5-0.8b", "--max-model-len", "64"]);
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert_eq!(v["token_ids"].as_array().map(Vec::len), Some(2));
}

/// Dummy weights have no stop tokens: the bench's grammar ends at the borrowed tokenizer's, so
/// a schema can be measured on a preset's shapes.
#[test]
fn the_bench_takes_a_json_schema_on_dummy_weights() {
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("schema.json");
    std::fs::write(&schema, r#"{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}"#).unwrap();
    let out = kestrel(&["bench", "--num-prompts", "1", "--max-tokens", "3", "--spec", "none", "--json", "--json-schema", schema.to_str().unwrap(), "--load-format", "dummy", "--model", "qwen3.5-0.8b", "--device", "cpu", "--max-model-len", "256"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let result: serde_json::Value = stdout.lines().find(|l| l.starts_with('{')).and_then(|l| serde_json::from_str(l).ok()).expect("a JSON result line");
    assert_eq!(result["method"], "none", "{result}");
}

#[test]
fn bad_input_gets_a_clear_error() {
    fails_with(&["run", "--model", "/nonexistent/model", "hi"], "does not exist");
    fails_with(&["run", ""], "empty prompt");
    fails_with(&["run", "hi", "-n", "0"], "max_tokens must be at least 1");
    fails_with(&["run", "hi", "--temperature=-1"], "temperature");
    fails_with(&["run", "hi", "-n", "-5"], "max_tokens must be at least 1");
    fails_with(&["run", "hi", "--spec", "medusa"], "unknown speculation method");
    fails_with(&["run", "hi", "--spec", "none,ngram"], "one method");
    fails_with(&["run", "hi", "-n", "5000"], "exceeds the context length");
    fails_with(&["perplexity", "--file", "/nonexistent.txt"], "cannot read");
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"id\": 1, \"prompt\": \"x\"}\n{not json}\n").unwrap();
    let empty_dir = tempfile::tempdir().unwrap();
    fails_with(&["info", "--model", empty_dir.path().to_str().unwrap()], "not a model directory");
    // Dummy weights need a preset that exists.
    fails_with(&["run", "hi", "--load-format", "dummy", "--model", "qwen9-huge", "--device", "cpu"], "unknown model preset `qwen9-huge`");
    fails_with(&["run", "hi", "--threads", "0"], "--threads must be at least 1");
    fails_with(&["bench", "-t", "0", "--num-prompts", "1"], "--threads must be at least 1");
    fails_with(&["run", "hi", "--load-format", "dummy"], "needs --model PRESET");
    fails_with(&["run", "hi", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]");
    fails_with(&["run", "hi", "--cpu-matmul", "fast"], "unknown CPU matmul mode `fast`; expected one of: exact, int8, auto");
    fails_with(&["perplexity", "--cpu-matmul", "int4"], "unknown CPU matmul mode `int4`");
    fails_with(&["run", "hi", "--device", "cuda", "--cpu-matmul", "int8"], "--cpu-matmul int8 applies to the CPU backend, not to --device cuda");
    assert!(Path::new(env!("CARGO_BIN_EXE_kestrel")).exists());
}

fn stderr_of(args: &[&str]) -> String {
    String::from_utf8_lossy(&kestrel(args).stderr).into_owned()
}

#[test]
fn negative_numbers_are_values_and_ranges_are_those_of_the_server() {
    for (flag, value) in [("--temperature", "-1"), ("--temp", "1e9"), ("--temperature", "2.5"), ("--top-p", "-0.5"), ("--top-p", "0"), ("--min-p", "-0.1"), ("--min-p", "2"), ("--top-k", "-2")] {
        let canonical = if flag == "--temp" { "--temperature" } else { flag };
        let err = stderr_of(&["run", "hi", flag, value]);
        assert!(err.contains(&format!("invalid value for {canonical}")) && !err.contains("unexpected argument"), "{flag} {value}: {err}");
    }
    fails_with(&["run", "hi", "--seed", "-1.5"], "a seed is a whole number");
    // -1 means something: a random seed, no top-k limit, as many tokens as the context holds.
    let v = ok_json(&["run", "def f(x):", "--temperature", "0.8", "--seed", "-1", "--top-k", "-1", "-n", "4", "--json"]);
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let v = ok_json(&["run", "def f(x):", "-c", "40", "-n", "-1", "--json"]);
    let used = v["usage"]["prompt_tokens"].as_u64().unwrap() + v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(used == 40 || v["finish_reason"] == "stop", "-n -1 should fill the context of 40: {v}");
    // The top of the range is the server's and the chat's: 2.
    ok_json(&["run", "def f(x):", "--temperature", "2", "-n", "2", "--json"]);
}

#[test]
fn the_names_llama_cpp_and_vllm_users_try_first() {
    let prompt = "def add(a, b):";
    let base = ok_json(&["run", prompt, "-n", "12", "--json"]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, prompt).unwrap();
    for args in [&["-f", file.to_str().unwrap()][..], &["--file", file.to_str().unwrap()], &[prompt, "--temp", "0.8", "-c", "512"], &[prompt, "--ctx-size", "512"]] {
        let mut all = vec!["run", "-n", "12", "--json"];
        all.extend_from_slice(args);
        assert_eq!(ok_json(&all)["token_ids"], base["token_ids"], "{args:?}");
    }
    fails_with(&["run", prompt, "-c", "8", "-n", "6"], "exceeds the context length of 8");
    fails_with(&["run", prompt, "--ctx-size", "8", "-n", "6"], "exceeds the context length of 8");
    fails_with(&["run", "-f", "/nonexistent/prompt.txt"], "cannot read the prompt from /nonexistent/prompt.txt");
    fails_with(&["run", prompt, "-f", file.to_str().unwrap()], "cannot be used with");
    // --stop ends the text before the stop string.
    let text = base["text"].as_str().unwrap();
    let stop: String = text.trim().chars().last().unwrap().to_string();
    let cut = &text[..text.find(&stop).unwrap()];
    let stopped = ok_json(&["run", prompt, "-n", "12", "--json", "--stop", &stop, "--stop", "\u{1}never"]);
    assert_eq!(stopped["text"], cut, "stop {stop:?}");
    assert_eq!(stopped["finish_reason"], "stop");
    let out = kestrel(&["run", prompt, "-n", "12", "--stop", &stop]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), cut);
    assert!(String::from_utf8_lossy(&out.stderr).contains("(stop string)"));
    fails_with(&["run", prompt, "--stop", "a", "--stop", "b", "--stop", "c", "--stop", "d", "--stop", "e"], "at most 4 --stop strings");
}

/// The options of `kestrel SUB --help`, and whether each has a line of help under it.
fn options_with_help(sub: &str) -> Vec<(String, bool)> {
    let out = kestrel(&[sub, "--help"]);
    assert!(out.status.success(), "{sub} --help failed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    let mut options = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        // Options sit at most 6 columns in; deeper lines are their help (lists of values included).
        if !(trimmed.starts_with('-') && line.len() - trimmed.len() <= 6) {
            continue;
        }
        let long = trimmed.split([' ', ',']).find(|w| w.starts_with("--")).unwrap_or(trimmed).to_string();
        // Short help puts the text beside the flag, two spaces on; long help on the next line.
        let beside = trimmed.split("  ").skip(1).any(|s| !s.trim().is_empty());
        let next = lines.get(i + 1).map_or("", |l| l.trim());
        options.push((long, beside || (!next.is_empty() && !next.starts_with('[') && !next.starts_with('-'))));
    }
    options
}

#[test]
fn each_subcommand_lists_only_the_flags_it_uses_each_with_a_help_line() {
    let cases: [(&str, &[&str], &[&str]); 7] = [
        ("run", &["--temperature", "--min-p", "--stop", "--file", "--spec", "--max-model-len", "--device", "--cpu-matmul", "--ignore-generation-config"], &["--input", "--port", "--context", "--max-num-seqs"]),
        ("info", &["--model", "--json", "--load-format"], &["--spec", "--device", "--cpu-matmul", "--max-model-len", "--temperature", "--kv-blocks", "--gpu-memory-utilization", "--kv-cache-dtype"]),
        ("perplexity", &["--file", "--context", "--device", "--cpu-matmul", "--allow-long-context", "--kv-cache-dtype"], &["--spec", "--temperature", "--max-model-len", "--kv-blocks", "--no-cuda-graphs", "--cuda-graph-sizes", "--prefix-cache-memory"]),
        ("serve", &["--host", "--max-num-seqs", "--allowed-origins", "--spec", "--no-spec-backoff", "--max-model-len", "--prefix-cache-memory", "--no-prefix-cache"], &["--temperature", "--input", "--json"]),
        ("batch", &["--input", "--max-num-seqs", "--spec", "--ignore-generation-config"], &["--temperature", "--port", "--json"]),
        ("chat", &["--system", "--temperature", "--spec", "--max-model-len"], &["--json", "--port", "--input"]),
        ("bench", &["--concurrency", "--cpu-matmul", "--spec", "--no-spec-backoff", "--temperature", "--dataset", "--turns", "--turn-len", "--no-prefix-cache", "--cuda-graph-sizes", "--max-cuda-graph-size"], &["--port", "--input", "--ignore-generation-config"]),
    ];
    for (sub, present, absent) in cases {
        let options = options_with_help(sub);
        let names: Vec<&str> = options.iter().map(|(name, _)| name.as_str()).collect();
        for flag in present {
            assert!(names.contains(flag), "{sub} --help lacks {flag}: {names:?}");
        }
        for flag in absent {
            assert!(!names.contains(flag), "{sub} --help lists {flag}, which it does not use");
        }
        let bare: Vec<&str> = options.iter().filter(|(_, helped)| !helped).map(|(name, _)| name.as_str()).collect();
        assert!(bare.is_empty(), "{sub}: options without a help line: {bare:?}");
    }
    // A flag that does not apply is refused, not ignored.
    fails_with(&["info", "--spec", "mtp"], "unexpected argument '--spec'");
    fails_with(&["perplexity", "--file", "x", "--temperature", "1"], "unexpected argument '--temperature'");
}

#[test]
fn hints_point_at_the_fix() {
    // `gpu` is another name of `cuda`: it needs a GPU, and runs where there is one.
    let out = kestrel(&["run", "hi", "--device", "gpu", "-n", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() || err.contains("--device cuda"), "{err}");
    assert!(!err.contains("invalid value"), "{err}");
    let weights = root().join("models/kestrel-coder/model.safetensors");
    fails_with(&["run", "hi", "-m", weights.to_str().unwrap()], "pass the directory itself");
    fails_with(&["info", "--model", root().join("models/kestrel-coder/config.json").to_str().unwrap()], "pass the directory itself");
    fails_with(&["run", "hi", "--kv-cache-dtype", "q4_0"], "[possible values: auto, f32, bf16, fp8, tq3]");
    fails_with(&["run", "hi", "--quantization", "q2_k"], "invalid value 'q2_k'");
}

#[test]
fn bad_cuda_graph_sizes_are_refused_with_the_reason() {
    fails_with(&["run", "hi", "--cuda-graph-sizes", "1,0,8"], "capture size `0` is not a positive whole number");
    fails_with(&["run", "hi", "--cuda-graph-sizes", "1,eight"], "capture size `eight`");
    fails_with(&["run", "hi", "--cuda-graph-sizes", ","], "no capture sizes given");
    fails_with(&["run", "hi", "--max-cuda-graph-size", "0"], "--max-cuda-graph-size must be at least 1");
    fails_with(&["run", "hi", "--no-cuda-graphs", "--cuda-graph-sizes", "1,2"], "cannot be used with");
    // Sizes on the CPU, which replays no graphs: accepted, and the text is the same.
    let plain = ok_json(&["run", "def f(x):", "--device", "cpu", "-n", "4", "--temperature", "0", "--json"]);
    let sized = ok_json(&["run", "def f(x):", "--device", "cpu", "-n", "4", "--temperature", "0", "--json", "--cuda-graph-sizes", "1,2", "--max-cuda-graph-size", "2"]);
    assert_eq!(plain["text"], sized["text"]);
    assert!(plain["text"].as_str().is_some_and(|t| !t.is_empty()), "{plain}");
}

/// `--quantization` quantizes the float weights at load (and makes dummy weights in its format);
/// `info` counts the bytes the GPU keeps: for 9B shapes in q4_k within 10% of the 5.2 GiB of
/// llama.cpp's Q4_K_M file of them, about a quarter of bf16's.
#[test]
fn quantization_at_load_runs_and_info_counts_the_gpu_bytes() {
    let v = ok_json(&["run", "def f(x):", "--quantization", "q4_k", "--device", "cpu", "-n", "4", "--json"]);
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    let gib = |args: &[&str]| -> f64 { ok_json(args)["gpu_weight_bytes"].as_f64().unwrap() / (1u64 << 30) as f64 };
    let bf16 = gib(&["info", "--load-format", "dummy", "--model", "qwen3.5-9b", "--json"]);
    let q4_k = gib(&["info", "--load-format", "dummy", "--model", "qwen3.5-9b", "--quantization", "q4_k", "--json"]);
    assert!((bf16 - 16.68).abs() < 0.05, "bf16 9b: {bf16} GiB");
    assert!(q4_k > 5.2 * 0.9 && q4_k < 5.2 * 1.1, "q4_k 9b: {q4_k} GiB");
    let v = ok_json(&["info", "--quantization", "int4", "--json"]);
    assert!(v["online_quantization"].as_str().unwrap().starts_with("int4"), "{v}");
    assert!(v["gpu_bytes_per_weight"].as_f64().unwrap() < 1.0, "{v}");
}

#[test]
fn limits_are_documented_and_enforced() {
    for k in ["0", "17", "100000"] {
        fails_with(&["run", "hi", "--spec", "ngram", "--spec-tokens", k], "from 1 to 16");
    }
    ok_json(&["run", "def f(x):", "--spec", "ngram", "--spec-tokens", "16", "-n", "4", "--json"]);
    // Past the model's trained length (4096) only when asked for.
    fails_with(&["run", "hi", "-c", "8192"], "--allow-long-context");
    fails_with(&["run", "hi", "--max-model-len", "8192"], "max_position_embeddings (4096)");
    ok_json(&["run", "def f(x):", "-c", "8192", "--allow-long-context", "-n", "2", "--json"]);
    // One window of about 5.8k tokens: past the trained length, and short enough to score quickly.
    let text: String = std::fs::read_to_string(root().join("models/kestrel-coder/heldout.txt")).unwrap().chars().take(20000).collect();
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), text).unwrap();
    let path = file.path().to_str().unwrap();
    fails_with(&["perplexity", "--file", path, "--context", "8192"], "--allow-long-context");
    let v = ok_json(&["perplexity", "--file", path, "--context", "8192", "--allow-long-context", "--json"]);
    assert!(v["perplexity"].as_f64().unwrap().is_finite(), "{v}");
    assert!(v["tokens"].as_u64().unwrap() > 4096, "the window goes past the trained length: {v}");
}

#[test]
fn a_bad_batch_line_gets_an_error_line_and_the_others_run() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let lines = [
        // A byte-order mark before line 1 is not part of it.
        "\u{feff}{\"id\": \"a\", \"prompt\": \"def add(a, b):\", \"max_tokens\": 4}",
        "{not json}",
        r#"{"id": 3, "messages": [{"role": "wizard", "content": "x"}]}"#,
        "",
        r#"{"id": "d", "prompt": "x", "max_tokens": 2, "temperature": "hot"}"#,
        r#"{"id": "e", "promt": "x"}"#,
        r#"{"id": "f", "prompt": "x", "messages": []}"#,
        r#"{"id": "g", "prompt": "class A:", "max_tokens": 5000}"#,
        r#"{"id": "h", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0.9, "min_p": 0.2, "seed": -1}"#,
        r#"{"id": "i", "prompt": "x", "top_p": 7}"#,
        r#"{"prompt": "no id"}"#,
    ];
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = kestrel(&["batch", "--input", input.to_str().unwrap(), "--max-num-seqs", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let results: Vec<Value> = String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(results.len(), 10, "one line per request: {results:?}");
    let by_line = |line: u64| results.iter().find(|r| r["line"] == line).unwrap_or_else(|| panic!("no error line for input line {line}: {results:?}"));
    for (line, id, needle) in [
        (2, Value::Null, "column"),
        (3, serde_json::json!(3), "unknown role `wizard`"),
        (5, serde_json::json!("d"), "`temperature`"),
        (6, serde_json::json!("e"), "unknown field `promt`"),
        (7, serde_json::json!("f"), "exactly one of `prompt` and `messages`"),
        (8, serde_json::json!("g"), "exceeds the context length"),
        (10, serde_json::json!("i"), "top_p"),
        (11, Value::Null, "missing field `id`"),
    ] {
        let r = by_line(line);
        assert_eq!(r["id"], id, "{r}");
        let message = r["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(&format!("line {line}: ")) && message.contains(needle), "line {line}: {message}");
        assert!(r.get("text").is_none(), "{r}");
    }
    for id in ["a", "h"] {
        let r = results.iter().find(|r| r["id"] == id).unwrap_or_else(|| panic!("no result for {id}"));
        assert!(r.get("error").is_none() && r["text"].is_string(), "{r}");
    }
    assert!(String::from_utf8_lossy(&out.stderr).contains("8 of the requests failed"));
}

#[test]
fn batch_results_are_written_as_requests_finish() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, "{\"id\": \"long\", \"prompt\": \"import os\", \"max_tokens\": 600}\n{\"id\": \"short\", \"prompt\": \"def f(x):\", \"max_tokens\": 2}\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["batch", "--device", "cpu", "--max-num-seqs", "2", "--input", input.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    let still_running = child.try_wait().unwrap().is_none();
    let first: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(first["id"], "short", "{first}");
    assert!(still_running, "the short request's line only came when the whole batch was done");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert!(child.wait().unwrap().success());
    let second: Value = serde_json::from_str(rest.trim()).unwrap();
    assert_eq!(second["id"], "long");
}

#[test]
fn batch_help_documents_the_input_format() {
    let out = kestrel(&["batch", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in ["one JSON object per line", "\"prompt\"", "messages", "max_tokens", "min_p", "\"error\"", "in the order requests finish"] {
        assert!(help.contains(needle), "batch --help lacks {needle:?}:\n{help}");
    }
}

/// Every KV cache format runs end to end on the CPU; `info` gives each one's bytes per token, and
/// `perplexity` scores with the chosen one.
#[test]
fn every_kv_cache_dtype_runs_and_info_gives_its_size() {
    let mut texts = Vec::new();
    for dtype in ["auto", "bf16", "fp8", "tq3", "f32"] {
        let v = ok_json(&["run", "def add(a, b):", "-n", "12", "--json", "--device", "cpu", "--kv-cache-dtype", dtype]);
        assert_eq!(v["usage"]["completion_tokens"], 12, "{dtype}");
        texts.push(v["token_ids"].clone());
    }
    assert_eq!(texts[0], texts[1], "auto is bf16");
    let info = ok_json(&["info", "--json"]);
    let per_token = &info["kv_bytes_per_token"];
    // The default model: 3 full-attention layers and the MTP head's, 2 kv heads of 64.
    assert_eq!(per_token["bf16"], 4 * 2 * 2 * 2 * 64, "{info}");
    assert_eq!(per_token["f32"], 4 * 2 * 2 * 4 * 64, "{info}");
    assert_eq!(per_token["fp8"], 4 * 2 * 2 * (64 + 2), "{info}");
    assert_eq!(per_token["tq3"], 4 * 2 * 2 * (24 + 2), "{info}");
    let text = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(text.path(), "def square(x):\n    return x * x\n\n\ndef cube(x):\n    return x * x * x\n").unwrap();
    let ppl = |dtype: &str| ok_json(&["perplexity", "--file", text.path().to_str().unwrap(), "--json", "--device", "cpu", "--kv-cache-dtype", dtype])["perplexity"].as_f64().unwrap();
    let (bf16, tq3) = (ppl("bf16"), ppl("tq3"));
    assert!(bf16.is_finite() && tq3.is_finite() && bf16 != tq3, "bf16 {bf16}, tq3 {tq3}: the format must reach the cache");
}

#[test]
fn prefix_cache_flags_and_cached_tokens() {
    fails_with(&["run", "hi", "--prefix-cache-memory", "1KiB"], "holds no checkpoint");
    fails_with(&["run", "hi", "--prefix-cache-memory", "lots"], "a memory size is a number");
    fails_with(&["run", "hi", "--no-prefix-cache", "--prefix-cache-memory", "1GiB"], "cannot be used with");
    let out = kestrel(&["run", "def fib(n):", "-n", "4", "--json", "--prefix-cache-memory", "64MiB"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prefix cache up to") && err.contains("checkpoints of"), "the checkpoint size is printed at start-up: {err}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let out = kestrel(&["run", "def fib(n):", "-n", "4", "--no-prefix-cache"]);
    assert!(out.status.success() && !String::from_utf8_lossy(&out.stderr).contains("prefix cache"));

    // A batch whose second request begins with the first one's prompt, one at a time.
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let code = "import os\nimport sys\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f]\n\n\ndef count_words(lines):\n    total = 0\n    for line in lines:\n        total += len(line.split())\n    return total\n\n\ndef longest_line(lines):\n    best = \"\"\n    for line in lines:\n        if len(line) > len(best):\n            best = line\n    return best\n";
    let lines = [serde_json::json!({"id": 1, "prompt": code, "max_tokens": 4}), serde_json::json!({"id": 2, "prompt": format!("{code}\n\ndef main():\n"), "max_tokens": 4})];
    std::fs::write(&input, lines.iter().map(|l| l.to_string()).collect::<Vec<_>>().join("\n")).unwrap();
    let out = kestrel(&["batch", "--input", input.to_str().unwrap(), "--max-batch", "1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Value> = String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let cached = |id: u64| rows.iter().find(|r| r["id"] == id).unwrap()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let first_prompt = rows.iter().find(|r| r["id"] == 1).unwrap()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(first_prompt > 64, "the first prompt must be long enough to cache: {first_prompt} tokens");
    assert_eq!((cached(1), cached(2)), (0, (first_prompt - 1) / 64 * 64));
}

#[test]
fn bench_multiturn_measures_each_turn_without_and_with_the_cache() {
    let v = kestrel(&["bench", "--dataset", "multiturn", "--num-prompts", "2", "--turns", "3", "--turn-len", "80", "--max-tokens", "8", "--concurrency", "2", "--json"]);
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stderr));
    let rows: Vec<Value> = String::from_utf8_lossy(&v.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2, "one run without the prefix cache, one with it");
    assert_eq!((rows[0]["prefix_cache"].as_bool(), rows[1]["prefix_cache"].as_bool()), (Some(false), Some(true)));
    for r in &rows {
        assert_eq!(r["num_requests"], 6);
        assert_eq!(r["ttft_ms_by_turn"].as_array().unwrap().len(), 3);
        let prompts: Vec<f64> = r["prompt_tokens_by_turn"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        // Each turn resends the history: 80 new tokens and the 8-token reply.
        assert_eq!(prompts, vec![80.0, 168.0, 256.0]);
    }
    let cached = |r: &Value| r["cached_tokens_by_turn"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect::<Vec<_>>();
    assert_eq!(cached(&rows[0]), vec![0.0, 0.0, 0.0]);
    assert_eq!(cached(&rows[1]), vec![0.0, 64.0, 128.0], "each turn resumes at the last multiple of 64 below the previous prompt's end");
    assert!(rows[1]["cached_prompt_fraction"].as_f64().unwrap() > 0.0);
    let text = kestrel(&["bench", "--dataset", "multiturn", "--num-prompts", "1", "--turns", "2", "--turn-len", "70", "--max-tokens", "4", "--concurrency", "1"]);
    let table = String::from_utf8_lossy(&text.stdout);
    assert!(table.contains("time to first token per turn") && table.contains("no cache"), "{table}");
}
