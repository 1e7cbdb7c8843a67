//! The whole forward on the GPU: fixture models against Hugging Face transformers and the CPU
//! backend, and batch invariance of a row's logits. Runs where a GPU is present.

mod common;
mod cuda_support;

use common::invariance::{run_invariance, Prefill, STEP_TOKENS};
use cuda_support::*;
use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::cuda::CudaBackend;
use kestrel::model::dummy;
use kestrel::backend::{Backend, BatchLayout, KvDtype, RowKind, RowLayout};
use kestrel::engine::request::{Request, RequestEvent, SpecMethod};
use kestrel::backend::sampling::SamplingParams;
use kestrel::engine::{Engine, EngineConfig};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::config::ModelConfig;
use kestrel::model::weights::online::OnlineQuantization;
use kestrel::model::ModelFiles;
use std::path::{Path, PathBuf};

const FIXTURES: [&str; 3] = ["qwen35-dense", "qwen35-moe", "qwen3-next"];
const GREEDY_TOKENS: usize = 40;

fn fixture_dir(name: &str) -> PathBuf {
    let root = std::env::var_os("KESTREL_FIXTURES_DIR").map(PathBuf::from).unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"));
    root.join(name)
}

struct Reference {
    prompt_ids: Vec<u32>,
    logits: Vec<f32>,
}

fn reference(name: &str) -> Reference {
    // transformers under the GPU's contract: linear inputs rounded to bf16
    // (scripts/make_bf16_activation_references.py).
    let bytes = std::fs::read(fixture_dir(name).join("reference-bf16-activations.safetensors")).expect("reference-bf16-activations.safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid reference file");
    let ids = st.tensor("prompt_ids").expect("prompt_ids").data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect();
    let logits = st.tensor("logits").expect("logits").data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    Reference { prompt_ids: ids, logits }
}

fn load<B: Backend>(b: &B, files: &ModelFiles) -> Qwen35<B> {
    Qwen35::load(b, files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load")
}

/// Logits of every prompt token, prefilled in one piece.
fn prefill_logits<B: Backend>(b: &B, model: &Qwen35<B>, ids: &[u32]) -> Vec<f32> {
    let blocks = ids.len().div_ceil(16);
    let mut cache = b.alloc_cache(&model.cache_spec(blocks, 16, 1, 1)).unwrap();
    b.reset_states(&mut cache, &[0]);
    let layout = BatchLayout { rows: vec![RowLayout { kind: RowKind::Prefill, token_start: 0, num_tokens: ids.len(), start_position: 0, block_table: (0..blocks as u32).collect(), state_slot: 0, snapshot_base: 0 }] };
    let rows: Vec<u32> = (0..ids.len() as u32).collect();
    b.to_host(&model.forward(b, ids, &layout, &rows, &mut cache).logits)
}

fn greedy<B: Backend>(backend: B, model: Qwen35<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut engine = Engine::new(backend, model, EngineConfig { max_num_seqs: 1, max_num_batched_tokens: 64, ..EngineConfig::default() }).expect("engine starts");
    engine.add_request(Request { spec: Some(SpecMethod::None), ..Request::new(prompt.to_vec(), SamplingParams::greedy(), n, Vec::new()) }).expect("request accepted");
    let mut out = None;
    while engine.has_unfinished() {
        for ev in engine.step() {
            if let RequestEvent::Finished { output, .. } = ev {
                out = Some(output.generated);
            }
        }
    }
    out.expect("request finished")
}

/// The GPU's precision contract (as the default CPU backend's): every linear layer's input is
/// rounded to bf16, products summed in f32, everything else f32. The GPU and the CPU sum in
/// different orders, which can flip a bf16 rounding; the random fixture models amplify any such
/// flip (a relative perturbation of 1e-6 on the linear inputs moves transformers' own logits by
/// 5-15% on them), so whole-prompt logits are held to LOGIT_BOUND of their range and greedy
/// continuations to [`assert_greedy_agrees`]. The trained default model is not chaotic and keeps
/// a tight bound (DEFAULT_MODEL_LOGIT_BOUND). The exact arithmetic of each op is checked against
/// the CPU on random inputs in tests/cuda_ops.rs and tests/cuda_quant.rs.
const LOGIT_BOUND: f32 = 0.1;
const DEFAULT_MODEL_LOGIT_BOUND: f32 = 5e-3;
/// Tokens every greedy continuation shares with the CPU's before they may part.
const MIN_AGREED: usize = 16;
/// Where two continuations part, the two tokens' logits in the CPU's row differ by at most this
/// share of the row's largest |logit|: a near tie that a rounding flip can turn over.
const NEAR_TIE: f32 = 0.05;

/// The GPU's greedy continuation against the CPU's: equal for MIN_AGREED tokens, and where they
/// part, the GPU's token is a near tie of the CPU's in the CPU's own logits after the shared
/// prefix. `cpu_last_logits(ids)` is the CPU's last-row logits after `ids`.
fn assert_greedy_agrees(what: &str, prompt: &[u32], on_gpu: &[u32], on_cpu: &[u32], cpu_last_logits: impl Fn(&[u32]) -> Vec<f32>) {
    assert_eq!(on_gpu.len(), on_cpu.len(), "{what}: continuation lengths differ");
    let Some(d) = on_gpu.iter().zip(on_cpu).position(|(g, c)| g != c) else {
        eprintln!("{what}: {} greedy tokens equal on GPU and CPU", on_gpu.len());
        return;
    };
    assert!(d >= MIN_AGREED, "{what}: GPU and CPU greedy continuations part at token {d} (GPU {on_gpu:?}, CPU {on_cpu:?})");
    let ids: Vec<u32> = prompt.iter().chain(&on_cpu[..d]).copied().collect();
    let row = cpu_last_logits(&ids);
    let scale = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let gap = (row[on_cpu[d] as usize] - row[on_gpu[d] as usize]) / scale;
    eprintln!("{what}: continuations part at token {d}, a tie within {gap:.2e} of the CPU's logit range");
    assert!(gap <= NEAR_TIE, "{what}: at token {d} the GPU chose {} where the CPU's logits put it {gap} of their range below {}", on_gpu[d], on_cpu[d]);
}

/// The last row of [`prefill_logits`].
fn last_logits<B: Backend>(b: &B, model: &Qwen35<B>, ids: &[u32]) -> Vec<f32> {
    let all = prefill_logits(b, model, ids);
    let vocab = model.config.vocab_size;
    all[all.len() - vocab..].to_vec()
}

/// Greedy on the GPU and on the default CPU backend from the same files, compared as
/// [`assert_greedy_agrees`] does.
fn compare_greedy(what: &str, files: &ModelFiles, prompt: &[u32]) {
    let Some(gpu) = gpu() else { return };
    let on_gpu = greedy(gpu_backend(), load(&gpu, files), prompt, GREEDY_TOKENS);
    let cpu = CpuBackend::new();
    let on_cpu = greedy(CpuBackend::new(), load(&cpu, files), prompt, GREEDY_TOKENS);
    let scorer = load(&cpu, files);
    assert_greedy_agrees(what, prompt, &on_gpu, &on_cpu, |ids| last_logits(&cpu, &scorer, ids));
}

#[test]
fn fixtures_match_transformers_and_cpu_greedy() {
    let Some(gpu) = gpu() else { return };
    for name in FIXTURES {
        let files = ModelFiles::open_dir(&fixture_dir(name)).expect("fixture opens");
        let r = reference(name);
        let model = load(&gpu, &files);
        let logits = prefill_logits(&gpu, &model, &r.prompt_ids);
        let err = relative_error(&logits, &r.logits);
        eprintln!("{name}: GPU logits vs transformers with bf16 linear inputs, relative error {err:.2e}");
        assert!(err < LOGIT_BOUND, "{name}: GPU logits off transformers' by {err}");
        compare_greedy(name, &files, &r.prompt_ids);
    }
}

/// Quantized checkpoints (int4, block FP8) on the GPU in their own bits: greedy continuations
/// agree with the CPU backend's, which dequantizes a row at a time.
#[test]
fn quantized_fixtures_match_cpu_greedy() {
    if gpu().is_none() {
        return;
    }
    let prompt = reference("qwen35-dense").prompt_ids;
    for name in ["qwen35-dense-int4", "qwen35-dense-fp8"] {
        let files = ModelFiles::open_dir(&fixture_dir(name)).expect("fixture opens");
        assert!(files.config.quantization.is_some(), "{name}: read as unquantized");
        compare_greedy(name, &files, &prompt);
    }
}

/// The embedded default model quantized at load (`--quantization int4|q4_k|fp8`): on the GPU in
/// the quantized bits, logits within DEFAULT_MODEL_LOGIT_BOUND of the CPU's (which dequantizes a
/// row at a time) and agreeing greedy continuations.
#[test]
fn online_quantized_default_model_matches_cpu_greedy() {
    let Some(gpu) = gpu() else { return };
    let prompt = reference("qwen35-dense").prompt_ids;
    for q in [OnlineQuantization::Int4, OnlineQuantization::Q4K, OnlineQuantization::Fp8] {
        let mut files = ModelFiles::open(None).expect("default model opens");
        files.config.online_quantization = Some(q);
        let ids: Vec<u32> = prompt.iter().map(|&t| t % files.config.vocab_size as u32).collect();
        let model = load(&gpu, &files);
        let cpu = CpuBackend::new();
        let cpu_model = load(&cpu, &files);
        let err = relative_error(&prefill_logits(&gpu, &model, &ids), &prefill_logits(&cpu, &cpu_model, &ids));
        eprintln!("default model, {q}: GPU logits vs CPU, relative error {err:.2e}");
        assert!(err < DEFAULT_MODEL_LOGIT_BOUND, "{q}: GPU logits off the CPU's by {err}");
        compare_greedy(&format!("default model, {q}"), &files, &ids);
    }
}

/// GGUF models (F32/F16/BF16 files and one with Q8_0 and Q4_K tensors) on the GPU: greedy
/// continuations agree with the CPU's.
#[test]
fn gguf_models_match_cpu_greedy() {
    if gpu().is_none() {
        return;
    }
    let prompt = reference("qwen35-dense").prompt_ids;
    for name in ["qwen35-dense", "qwen35-moe", "qwen3-next", "qwen35-moe-quant"] {
        let files = ModelFiles::open(Some(&fixture_dir("gguf").join(format!("{name}.gguf")))).expect("GGUF fixture opens");
        compare_greedy(&format!("{name}.gguf"), &files, &prompt);
    }
}

/// A second handle on the GPU for an engine (the first one owns the model's buffers; both
/// share the device's primary context).
fn gpu_backend() -> CudaBackend {
    CudaBackend::new(0).expect("CUDA backend starts")
}

fn tiny_config(model_type: &str) -> ModelConfig {
    let moe = r#""num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":64,"shared_expert_intermediate_size":64,"#;
    let json = format!(
        r#"{{"model_type":"{model_type}","vocab_size":512,"hidden_size":128,"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,"intermediate_size":192,{}"linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":32,"linear_value_head_dim":48,"linear_conv_kernel_dim":4,"rope_theta":10000000,"partial_rotary_factor":0.25}}"#,
        if model_type == "qwen3_5_text" { "" } else { moe }
    );
    ModelConfig::from_json_str(&json, Path::new("tiny")).expect("tiny config")
}

/// Widths that take the quantized formats' own kernels (Q4_K and Q6_K need rows of 256).
fn tiny_quantized_config(model_type: &str, q: OnlineQuantization) -> ModelConfig {
    let moe = r#""num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":256,"shared_expert_intermediate_size":256,"#;
    let json = format!(
        r#"{{"model_type":"{model_type}","vocab_size":512,"hidden_size":256,"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,"intermediate_size":512,{}"linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":32,"linear_value_head_dim":64,"linear_conv_kernel_dim":4,"rope_theta":10000000,"partial_rotary_factor":0.25}}"#,
        if model_type == "qwen3_5_text" { "" } else { moe }
    );
    let mut c = ModelConfig::from_json_str(&json, Path::new("tiny")).expect("tiny config");
    c.online_quantization = Some(q);
    c
}

#[test]
fn row_logits_are_batch_invariant() {
    let Some(gpu) = gpu() else { return };
    let mut models: Vec<(String, ModelConfig)> = ["qwen3_5_text", "qwen3_5_moe_text"].iter().map(|t| (t.to_string(), tiny_config(t))).collect();
    // Random weights in the quantized formats: their kernels, dense and in the experts.
    for q in [OnlineQuantization::Q4K, OnlineQuantization::Int4, OnlineQuantization::Fp8] {
        for t in ["qwen3_5_text", "qwen3_5_moe_text"] {
            models.push((format!("{t} {q}"), tiny_quantized_config(t, q)));
        }
    }
    for (model_type, config) in models {
        let model_type = model_type.as_str();
        let model = dummy::load_random(&gpu, config, 42, &indicatif::ProgressBar::hidden()).expect("random model");
        let alone = run_invariance(&gpu, &model, KvDtype::default(), 0, Prefill::OneChunk);
        assert_eq!(alone.len(), 1 + STEP_TOKENS.len(), "{model_type}: unexpected number of logit rows");
        assert!(alone.iter().flatten().all(|v| v.is_finite()), "{model_type}: non-finite logits");
        for (others, prefill, what) in [
            (7, Prefill::OneChunk, "among 7 others"),
            (63, Prefill::OneChunk, "among 63 others"),
            (0, Prefill::Pieces(64), "prefilled in pieces of 64"),
            (0, Prefill::Pieces(128), "prefilled in pieces of 128"),
            (7, Prefill::Pieces(64), "among 7 others, prefilled in pieces of 64"),
        ] {
            let got = run_invariance(&gpu, &model, KvDtype::default(), others, prefill);
            assert_eq!(got.len(), alone.len(), "{model_type} {what}: logit rows");
            for (i, (a, b)) in got.iter().zip(&alone).enumerate() {
                assert!(bitwise_equal(a, b), "{model_type}: logits row {i} {what} differ from the row alone (relative {})", relative_error(a, b));
            }
            eprintln!("{model_type}: request 0 bitwise equal {what}");
        }
    }
}
