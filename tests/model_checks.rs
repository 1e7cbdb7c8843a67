//! Models that are broken or carry more than the weights: NaN logits end a request with an error
//! (the others go on), configurations that cannot be right are refused at load naming the field,
//! `tokenizer.json` truncation is ignored, and `generation_config.json` gives stop ids and
//! sampling defaults.

mod common;

use common::*;
use kestrel::backend::sampling::SamplingParams;
use kestrel::engine::request::{RequestEvent, RequestFailure, SpecMethod};
use kestrel::engine::EngineConfig;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};

const FIXTURE: &str = "qwen35-dense";
const EMBEDDING: &str = "model.language_model.embed_tokens.weight";

fn kestrel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kestrel")).args(args).env("RAYON_NUM_THREADS", "2").output().expect("kestrel runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn run_json(model: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["run", "--device", "cpu", "--json", "--model", model.to_str().expect("utf-8 path")];
    args.extend_from_slice(extra);
    let out = kestrel(&args);
    assert!(out.status.success(), "kestrel {args:?}: {}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn fails_with(args: &[&str], needles: &[&str]) -> String {
    let out = kestrel(args);
    assert!(!out.status.success(), "kestrel {args:?} should fail");
    let err = stderr(&out);
    for needle in needles {
        assert!(err.contains(needle), "kestrel {args:?}: stderr lacks `{needle}`:\n{err}");
    }
    err
}

fn ids(v: &Value) -> Vec<u32> {
    v["token_ids"].as_array().expect("token_ids").iter().map(|x| x.as_u64().expect("an id") as u32).collect()
}

/// Sets the bf16 row `row` of the embedding to NaN (all rows with `None`).
fn nan_embedding(dir: &Path, row: Option<usize>) {
    rewrite_weights(dir, |name, dtype, shape, mut bytes| {
        if name == EMBEDDING {
            assert_eq!(dtype, safetensors::Dtype::BF16);
            let width = shape[1] * 2;
            let rows = row.map_or(0..shape[0], |r| r..r + 1);
            for r in rows {
                for value in bytes[r * width..(r + 1) * width].chunks_exact_mut(2) {
                    value.copy_from_slice(&half::bf16::NAN.to_le_bytes());
                }
            }
        }
        Some((dtype, shape, bytes))
    });
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut value: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("readable")).expect("JSON");
    edit(&mut value);
    std::fs::write(path, serde_json::to_string_pretty(&value).expect("serializes")).expect("writable");
}

#[test]
fn a_request_that_meets_nan_logits_fails_alone_and_the_others_go_on() {
    let r = reference(FIXTURE);
    let (_, clean) = load_model(&fixture_dir(FIXTURE));
    let prompts: Vec<Vec<u32>> = vec![r.prompt_ids.clone(), vec![5, 9, 14, 3, 5, 9, 14, 3, 5, 9], vec![40, 41, 42, 43, 44, 45, 46]];
    let mut alone = Vec::new();
    let mut e = engine(clean, EngineConfig { max_num_seqs: 1, ..EngineConfig::default() });
    for p in &prompts {
        alone.push(run_staggered(&mut e, vec![request(p, 24, SamplingParams::greedy(), Some(SpecMethod::None))], &[0]).remove(0));
    }
    // The first request generates the poisoned token as its 5th: its 6th draw sees only NaN.
    let poison = alone[0][4];
    assert!(!alone[0][..4].contains(&poison) && !prompts[0].contains(&poison), "pick a token that first appears 5th");
    for (p, out) in prompts.iter().zip(&alone).skip(1) {
        assert!(!p.contains(&poison) && !out.contains(&poison), "the other requests must not meet token {poison}");
    }
    let dir = scratch_copy(FIXTURE);
    nan_embedding(dir.path(), Some(poison as usize));
    for spec in [SpecMethod::None, SpecMethod::Ngram, SpecMethod::Mtp] {
        let (_, model) = load_model(dir.path());
        let mut e = engine(model, EngineConfig { max_num_seqs: 4, spec_tokens: 3, ..EngineConfig::default() });
        let mut names = HashMap::new();
        for (i, p) in prompts.iter().enumerate() {
            names.insert(e.add_request(request(p, 24, SamplingParams::greedy(), Some(spec))).expect("accepted"), i);
        }
        let mut finished = HashMap::new();
        let mut failed = HashMap::new();
        while e.has_unfinished() {
            for event in e.step() {
                match event {
                    RequestEvent::Finished { id, output, .. } => {
                        finished.insert(names[&id], output.generated);
                    }
                    RequestEvent::Failed { id, error, output } => {
                        failed.insert(names[&id], (error, output.generated));
                    }
                    RequestEvent::Tokens { .. } => {}
                }
            }
        }
        let (error, generated) = failed.remove(&0).unwrap_or_else(|| panic!("{spec:?}: the poisoned request did not fail"));
        assert_eq!(error, RequestFailure::NonFiniteLogits { position: 5 }, "{spec:?}");
        assert_eq!(generated, alone[0][..5], "{spec:?}: the tokens before the failure are kept");
        assert!(error.to_string().contains("no finite logit"), "{error}");
        assert!(failed.is_empty(), "{spec:?}: other requests failed: {failed:?}");
        for i in 1..prompts.len() {
            assert_eq!(finished[&i], alone[i], "{spec:?}: request {i} changed next to a failing one");
        }
        assert_eq!(e.cache_usage().0 .0, 0, "{spec:?}: the failed request's blocks were not freed");
    }
}

#[test]
fn run_and_perplexity_fail_on_nan_logits() {
    let dir = scratch_copy(FIXTURE);
    nan_embedding(dir.path(), None);
    let model = dir.path().to_str().expect("utf-8");
    let err = fails_with(&["run", "--device", "cpu", "--model", model, "hello", "-n", "4"], &["generation failed", "no finite logit"]);
    assert!(!err.contains("panicked"), "{err}");
    fails_with(&["run", "--device", "cpu", "--model", model, "hello", "-n", "4", "--json", "--temperature", "0.8", "--top-k", "5"], &["no finite logit"]);
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "hello world, hello kestrel, hello again").expect("writable");
    fails_with(&["perplexity", "--device", "cpu", "--model", model, "--file", text.to_str().expect("utf-8")], &["not a finite number", "token 1"]);
    // A batch writes the failure on the request's own line.
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, "{\"id\": \"x\", \"prompt\": \"hello\", \"max_tokens\": 3}\n").expect("writable");
    let out = kestrel(&["batch", "--device", "cpu", "--model", model, "--input", input.to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", stderr(&out));
    let line: Value = serde_json::from_slice(&out.stdout).expect("one line");
    assert_eq!(line["id"], "x");
    assert_eq!(line["error"]["type"], "generation_failed", "{line}");
}

#[test]
fn configurations_that_cannot_be_right_are_refused_at_load() {
    for (field, value) in [("rms_norm_eps", serde_json::json!(-1)), ("num_hidden_layers", serde_json::json!(0)), ("eos_token_id", serde_json::json!([2, 99999]))] {
        let dir = scratch_copy(FIXTURE);
        edit_json(&dir.path().join("config.json"), |c| c["text_config"][field] = value.clone());
        let model = dir.path().to_str().expect("utf-8");
        fails_with(&["run", "--device", "cpu", "--model", model, "hello"], &[&format!("`{field}`"), "config.json"]);
        fails_with(&["info", "--model", model], &[&format!("`{field}`")]);
    }
    let dir = scratch_copy(FIXTURE);
    edit_json(&dir.path().join("config.json"), |c| c["text_config"]["rope_parameters"]["rope_theta"] = serde_json::json!(0));
    fails_with(&["run", "--device", "cpu", "--model", dir.path().to_str().expect("utf-8"), "hello"], &["`rope_theta`"]);
}

#[test]
fn tokenizer_json_truncation_never_cuts_a_prompt() {
    let text = "hello world and more words to make a prompt longer than four tokens, hello again";
    let whole = run_json(&fixture_dir(FIXTURE), &[text, "-n", "4"]);
    let prompt_tokens = whole["usage"]["prompt_tokens"].as_u64().expect("count");
    assert!(prompt_tokens > 8, "{whole}");
    let dir = scratch_copy(FIXTURE);
    edit_json(&dir.path().join("tokenizer.json"), |t| {
        t["truncation"] = serde_json::json!({"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0});
        t["padding"] = serde_json::json!({"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"});
    });
    let cut = run_json(dir.path(), &[text, "-n", "4"]);
    assert_eq!(cut["usage"]["prompt_tokens"], prompt_tokens, "the prompt was cut or padded");
    assert_eq!(cut["token_ids"], whole["token_ids"]);
    // A prompt past the context is an error, never a cut.
    fails_with(&["run", "--device", "cpu", "--model", dir.path().to_str().expect("utf-8"), text, "--max-model-len", "8", "-n", "1"], &["exceeds the context length"]);
}

#[test]
fn generation_config_gives_stop_ids_and_sampling_defaults() {
    let prompt = "hello world";
    let greedy = ids(&run_json(&fixture_dir(FIXTURE), &[prompt, "-n", "16", "--temperature", "0"]));
    // Without generation_config.json, run samples with llama.cpp's defaults (seed 0).
    let llama_cpp_defaults = ids(&run_json(&fixture_dir(FIXTURE), &[prompt, "-n", "16"]));
    let explicit_llama_cpp = ids(&run_json(&fixture_dir(FIXTURE), &[prompt, "-n", "16", "--temp", "0.8", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05", "--seed", "0"]));
    assert_eq!(llama_cpp_defaults, explicit_llama_cpp);
    assert!(greedy.len() >= 3, "the fixture should say a few tokens: {greedy:?}");
    let stop_at = (1..greedy.len()).find(|&i| !greedy[..i].contains(&greedy[i])).expect("a token not seen before");
    let stop_id = greedy[stop_at];

    // Stop ids join the model's; do_sample false asks for greedy decoding.
    let dir = scratch_copy(FIXTURE);
    std::fs::write(dir.path().join("generation_config.json"), format!(r#"{{"do_sample": false, "eos_token_id": [2, {stop_id}], "temperature": 0.7}}"#)).expect("writable");
    let model = dir.path();
    let stopped = run_json(model, &[prompt, "-n", "16"]);
    assert_eq!(ids(&stopped), greedy[..stop_at], "{stopped}");
    assert_eq!(stopped["finish_reason"], "stop");
    // Ignoring the sampling defaults keeps the stop ids.
    assert_eq!(ids(&run_json(model, &[prompt, "-n", "16", "--ignore-generation-config", "--temperature", "0"])), greedy[..stop_at]);

    // Sampling defaults: what the flags would say, unless a flag or --ignore-generation-config says otherwise.
    let dir = scratch_copy(FIXTURE);
    std::fs::write(dir.path().join("generation_config.json"), r#"{"do_sample": true, "temperature": 1.3, "top_k": 50, "top_p": 0.97, "min_p": 0.01}"#).expect("writable");
    let model = dir.path();
    let info = kestrel(&["info", "--json", "--model", model.to_str().expect("utf-8")]);
    let info: Value = serde_json::from_slice(&info.stdout).expect("info JSON");
    assert_eq!(info["sampling_defaults"]["top_k"], 50, "{info}");
    let text = String::from_utf8_lossy(&kestrel(&["info", "--model", model.to_str().expect("utf-8")]).stdout).into_owned();
    assert!(text.contains("temperature 1.3") && text.contains("top_k 50") && text.contains("min_p 0.01"), "{text}");
    let defaulted = ids(&run_json(model, &[prompt, "-n", "16", "--seed", "5"]));
    let explicit = ids(&run_json(&fixture_dir(FIXTURE), &[prompt, "-n", "16", "--seed", "5", "--temp", "1.3", "--top-k", "50", "--top-p", "0.97", "--min-p", "0.01"]));
    assert_eq!(defaulted, explicit, "the defaults were not applied");
    assert_ne!(defaulted, greedy, "sampling at 1.3 gave the greedy text");
    assert_eq!(ids(&run_json(model, &[prompt, "-n", "16", "--ignore-generation-config"])), llama_cpp_defaults);
    assert_eq!(ids(&run_json(model, &[prompt, "-n", "16", "--temperature", "0"])), greedy);

    // A recommendation no request may carry is refused at load.
    std::fs::write(dir.path().join("generation_config.json"), r#"{"temperature": 7}"#).expect("writable");
    fails_with(&["run", "--device", "cpu", "--model", model.to_str().expect("utf-8"), prompt], &["generation_config.json", "`temperature`"]);
}
