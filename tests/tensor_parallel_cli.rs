//! `--tensor-parallel-size` (`-tp`) on the command line: `kestrel info` prints a model's split
//! and the memory per GPU; sizes a model cannot be split by are refused naming the reason; and a
//! split run, which this build cannot do yet, is refused on every subcommand that runs a model
//! rather than run on one GPU.

use serde_json::Value;
use std::process::{Command, Output};

fn kestrel(args: &[&str]) -> Output {
    let cwd = tempfile::tempdir().unwrap();
    Command::new(env!("CARGO_BIN_EXE_kestrel")).args(args).current_dir(cwd.path()).output().expect("kestrel runs")
}

fn ok_stdout(args: &[&str]) -> String {
    let out = kestrel(args);
    assert!(out.status.success(), "kestrel {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn fails_with(args: &[&str], needles: &[&str]) {
    let out = kestrel(args);
    assert!(!out.status.success(), "kestrel {args:?} should fail");
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in needles {
        assert!(err.contains(needle), "kestrel {args:?}: stderr lacks `{needle}`:\n{err}");
    }
}

const DUMMY_9B: [&str; 4] = ["--load-format", "dummy", "--model", "qwen3.5-9b"];

#[test]
fn info_prints_the_split_and_the_memory_per_gpu() {
    let text = ok_stdout(&[&["info"][..], &DUMMY_9B, &["-tp", "2"]].concat());
    assert!(text.contains("over 2 GPUs: each holds 8 of 16 attention heads, 2 of 4 kv heads, 8 of 16 delta-rule key heads and 16 of 32 value heads"), "{text}");
    assert!(text.contains("GPU 0") && text.contains("GPU 1") && !text.contains("GPU 2"), "{text}");
    let line = |kind: &str| text.lines().find(|l| l.trim_start().starts_with(kind)).unwrap_or_else(|| panic!("no {kind} line:\n{text}")).to_string();
    let q = line("self_attn.q_proj.weight");
    assert!(q.contains("column") && q.contains("8192x4096") && q.contains("4096x4096"), "{q}");
    let down = line("mlp.down_proj.weight");
    assert!(down.contains("row") && down.contains("4096x12288") && down.contains("4096x6144"), "{down}");
    let embed = line("embed_tokens.weight");
    assert!(embed.contains("vocab") && embed.contains("124160x4096"), "{embed}");
    assert!(line("input_layernorm.weight").contains("replicated"));
    // Without the flag, no split is shown.
    assert!(!ok_stdout(&[&["info"][..], &DUMMY_9B].concat()).contains("GPU 0"));
}

#[test]
fn info_json_has_the_split_of_each_size() {
    for (n, flag) in [(1, "--tensor-parallel-size"), (4, "--tensor-parallel-size"), (8, "--tp")] {
        let out = ok_stdout(&[&["info", "--json"][..], &DUMMY_9B, &[flag, &n.to_string()]].concat());
        let v: Value = serde_json::from_str(&out).unwrap();
        let tp = &v["tensor_parallel"];
        assert_eq!(tp["size"], n);
        let gpus = tp["gpus"].as_array().unwrap();
        assert_eq!(gpus.len(), n);
        let total = v["gpu_weight_bytes"].as_f64().unwrap();
        for gpu in gpus {
            let bytes = gpu["weight_bytes"].as_f64().unwrap();
            assert!(bytes >= total / n as f64 && bytes < total / n as f64 * 1.05, "{n} GPUs: {bytes} of {total}");
            // 8 attention layers of 4 kv heads x 256 x 2 (k and v) x 2 bytes, over min(n, 4) GPUs.
            assert_eq!(gpu["kv_bytes_per_token_bf16"], 8 * 4 * 256 * 2 * 2 / n.min(4));
        }
        let o = tp["tensors"].as_array().unwrap().iter().find(|t| t["tensor"] == "self_attn.o_proj.weight").expect("o_proj");
        assert_eq!(o["split"], "row");
        assert_eq!(o["shard_shape"], serde_json::json!([4096, 4096 / n]));
        assert_eq!(tp["heads_per_gpu"]["kv"], (4 / n).max(1));
    }
    // Without the flag the key is null.
    let v: Value = serde_json::from_str(&ok_stdout(&[&["info", "--json"][..], &DUMMY_9B].concat())).unwrap();
    assert!(v["tensor_parallel"].is_null());
}

#[test]
fn the_moe_presets_split_their_experts() {
    let out = ok_stdout(&["info", "--json", "--load-format", "dummy", "--model", "qwen3-next-80b-a3b", "-tp", "4"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    let tensors = v["tensor_parallel"]["tensors"].as_array().unwrap();
    let find = |kind: &str| tensors.iter().find(|t| t["tensor"] == kind).unwrap_or_else(|| panic!("{kind}"));
    assert_eq!(find("mlp.experts.gate_up_proj")["shard_shape"], serde_json::json!([512, 256, 2048]));
    assert_eq!(find("mlp.experts.down_proj")["shard_shape"], serde_json::json!([512, 2048, 128]));
    assert_eq!(find("mlp.gate.weight")["split"], "replicated");
    assert_eq!(find("linear_attn.in_proj_qkvz.weight")["shard_shape"], serde_json::json!([3072, 2048]));
    // qwen3-next-80b-a3b in bf16 is about 150 GiB: about a quarter of it per GPU.
    let gib = v["tensor_parallel"]["gpus"][0]["weight_bytes"].as_f64().unwrap() / (1u64 << 30) as f64;
    assert!((35.0..42.0).contains(&gib), "{gib} GiB per GPU");
}

#[test]
fn sizes_that_cannot_split_the_model_are_refused() {
    fails_with(&[&["info"][..], &DUMMY_9B, &["-tp", "3"]].concat(), &["cannot split dummy qwen3.5-9b over 3 GPUs", "--tensor-parallel-size 3 is not supported: use 1, 2, 4 or 8"]);
    fails_with(&[&["info"][..], &DUMMY_9B, &["-tp=16"]].concat(), &["--tensor-parallel-size 16 is not supported"]);
    fails_with(&[&["info"][..], &DUMMY_9B, &["-tp", "two"]].concat(), &["invalid value 'two'"]);
    // The default model's int4 groups are 128 inputs wide: its 512-wide row-parallel inputs are
    // not 8 slices of whole groups.
    fails_with(&["info", "-tp", "2"], &["over 2 GPUs", "layers.0.linear_attn.out_proj.weight: its input width 512 is not 8 equal slices of 128-wide units"]);
    fails_with(&["run", "hi", "--device", "cpu", "-tp", "2"], &["layers.0.linear_attn.out_proj.weight: its input width 512"]);
    // A Qwen3.5 GGUF stores the delta rule's output columns in llama.cpp's tiled head order.
    let gguf = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gguf/qwen35-dense.gguf");
    fails_with(&["info", "--model", gguf, "-tp", "2"], &["cannot split", "llama.cpp's tiled order", "needs a Hugging Face checkpoint"]);
    assert!(ok_stdout(&["info", "--model", gguf, "-tp", "1"]).contains("split       over 1 GPU: each holds 4 of 4 attention heads"));
    // In Q4_K the reduction runs in 128-wide units: the 0.8b's 3584-wide MLP no longer splits.
    assert!(ok_stdout(&["info", "--load-format", "dummy", "--model", "qwen3.5-0.8b", "-tp", "2"]).contains("over 2 GPUs"));
    fails_with(&["info", "--load-format", "dummy", "--model", "qwen3.5-0.8b", "--quantization", "q4_k", "-tp", "2"], &["input width 3584 is not 8 equal slices of 128-wide units"]);
}

/// Every subcommand that runs a model refuses a split it cannot run, before loading anything,
/// whichever device it was asked for.
#[test]
fn a_split_run_is_refused_on_every_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let jsonl = dir.path().join("in.jsonl");
    std::fs::write(&jsonl, "{\"id\":\"a\",\"prompt\":\"hi\",\"max_tokens\":2}\n").unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "def f(x):\n    return x\n").unwrap();
    let (jsonl, text) = (jsonl.to_str().unwrap(), text.to_str().unwrap());
    // `chat` takes the same path (EngineArgs::open_model) but first refuses to run without a terminal.
    let commands: [&[&str]; 5] = [
        &["run", "hi", "-n", "2"],
        &["batch", "--input", jsonl],
        &["bench", "--num-prompts", "1", "--max-tokens", "2"],
        &["perplexity", "--file", text],
        &["serve", "--port", "0"],
    ];
    for command in commands {
        for (device, backend) in [("cpu", "not available on the CPU backend, which runs on one device"), ("cuda", "not available on the CUDA backend yet")] {
            let args = [command, &DUMMY_9B, &["--device", device, "--tensor-parallel-size", "2"]].concat();
            fails_with(&args, &["--tensor-parallel-size 2: dummy qwen3.5-9b splits over 2 GPUs", backend, "run with --tensor-parallel-size 1"]);
        }
    }
    fails_with(&[&["run", "hi"][..], &DUMMY_9B, &["--device", "cuda", "-tp", "8"]].concat(), &["splits over 8 GPUs", "GiB of weights on the fullest"]);
}

#[test]
fn one_gpu_runs_as_before_and_the_short_flag_stops_at_the_prompt_separator() {
    // `-tp=1` is the flag; the `-tp` after `--` is the prompt.
    let out = ok_stdout(&["run", "--json", "-n", "2", "--temperature", "0", "--device", "cpu", "-tp=1", "--", "-tp"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() >= 1);
    let help = ok_stdout(&["run", "--help"]);
    assert!(help.contains("--tensor-parallel-size <N>") && help.contains("[alias: --tp]"), "{help}");
    assert!(ok_stdout(&["info", "--help"]).contains("--tensor-parallel-size <N>"));
}
