//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod conversation;
pub mod mtp_rounds;

use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::{Backend, BatchLayout, CacheSpec, KvDtype, RowKind, RowLayout};
use kestrel::engine::request::{Request, RequestEvent, RequestId, SpecMethod};
use kestrel::backend::sampling::SamplingParams;
use kestrel::engine::{Engine, EngineConfig};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::ModelFiles;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub mod invariance;

pub const FIXTURES: [&str; 3] = ["qwen35-dense", "qwen35-moe", "qwen3-next"];

pub fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

pub struct Reference {
    pub prompt_ids: Vec<u32>,
    /// [T, vocab]
    pub logits: Vec<f32>,
    pub greedy_ids: Vec<u32>,
}

fn i64s(t: &safetensors::tensor::TensorView) -> Vec<u32> {
    t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
}

/// transformers' f32 forward of fixture `name` (scripts/make_fixtures.py).
pub fn reference(name: &str) -> Reference {
    reference_file(name, "reference.safetensors")
}

/// transformers' forward of fixture `name` under the precision contract of the GPU and the
/// default CPU backend: every linear layer's input rounded to bf16, all else f32
/// (scripts/make_bf16_activation_references.py).
pub fn reference_bf16_activations(name: &str) -> Reference {
    reference_file(name, "reference-bf16-activations.safetensors")
}

fn reference_file(name: &str, file: &str) -> Reference {
    let bytes = std::fs::read(fixture_dir(name).join(file)).unwrap_or_else(|e| panic!("{name}/{file}: {e}"));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid reference file");
    let logits = st.tensor("logits").unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    Reference { prompt_ids: i64s(&st.tensor("prompt_ids").unwrap()), logits, greedy_ids: i64s(&st.tensor("greedy_ids").unwrap()) }
}

// The CPU backends here run matmuls over f32 activations: the references these tests meet
// (transformers' f32 forward, its greedy continuations) do not round them to bf16 as the
// default backend does for parity with the GPU. On the random fixture models that rounding
// alone moves the logits by 0.11 of their range (qwen35-dense) and the greedy continuations
// by their last tokens; the default model's perplexity stays within 0.05% of llama.cpp's with
// it (tests/peer_fixtures.rs runs the default backend).
pub fn load_model(dir: &Path) -> (ModelFiles, Qwen35<CpuBackend>) {
    let files = ModelFiles::open_dir(dir).expect("model opens");
    let model = Qwen35::load(&CpuBackend::new().with_f32_activations(), files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
    (files, model)
}

pub fn default_model() -> (ModelFiles, Qwen35<CpuBackend>) {
    let files = ModelFiles::open(None).expect("embedded model opens");
    let model = Qwen35::load(&CpuBackend::new().with_f32_activations(), files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
    (files, model)
}

pub fn engine(model: Qwen35<CpuBackend>, config: EngineConfig) -> Engine<CpuBackend> {
    Engine::new(CpuBackend::new().with_f32_activations(), model, config).expect("engine starts")
}

pub fn request(prompt: &[u32], max_tokens: usize, params: SamplingParams, spec: Option<SpecMethod>) -> Request {
    Request { spec, ..Request::new(prompt.to_vec(), params, max_tokens, Vec::new()) }
}

/// Runs requests through an engine, adding request `i` after `arrival_steps[i]` steps; returns
/// each request's generated tokens in input order.
pub fn run_staggered<B: kestrel::backend::Backend>(engine: &mut Engine<B>, requests: Vec<kestrel::engine::request::Request>, arrival_steps: &[usize]) -> Vec<Vec<u32>> {
    let n = requests.len();
    let mut pending: Vec<(usize, usize, kestrel::engine::request::Request)> = requests.into_iter().enumerate().map(|(i, r)| (arrival_steps[i], i, r)).collect();
    pending.sort_by_key(|p| (p.0, p.1));
    let mut pending = std::collections::VecDeque::from(pending);
    let mut ids: HashMap<RequestId, usize> = HashMap::new();
    let mut out = vec![None; n];
    let mut step = 0usize;
    while !pending.is_empty() || engine.has_unfinished() {
        while pending.front().is_some_and(|p| p.0 <= step) {
            let (_, i, r) = pending.pop_front().unwrap();
            ids.insert(engine.add_request(r).expect("request accepted"), i);
        }
        for ev in engine.step() {
            if let RequestEvent::Finished { id, output, .. } = ev {
                out[ids[&id]] = Some(output.generated);
            }
        }
        step += 1;
        assert!(step < 100_000, "engine did not finish");
    }
    out.into_iter().map(|o| o.expect("every request finished")).collect()
}

pub fn generate_alone(model_dir: Option<&Path>, prompt: &[u32], max_tokens: usize, params: SamplingParams) -> Vec<u32> {
    let (_, model) = match model_dir {
        Some(d) => load_model(d),
        None => default_model(),
    };
    let mut e = engine(model, EngineConfig { max_num_seqs: 1, ..EngineConfig::default() });
    run_staggered(&mut e, vec![request(prompt, max_tokens, params, Some(SpecMethod::None))], &[0]).remove(0)
}

/// [`generate_alone`] on the default CPU backend (bf16 linear inputs, as the GPU computes).
pub fn generate_alone_bf16_activations(model_dir: &Path, prompt: &[u32], max_tokens: usize, params: SamplingParams) -> Vec<u32> {
    let (_, model) = load_model(model_dir);
    let mut e = Engine::new(CpuBackend::new(), model, EngineConfig { max_num_seqs: 1, ..EngineConfig::default() }).expect("engine starts");
    run_staggered(&mut e, vec![request(prompt, max_tokens, params, Some(SpecMethod::None))], &[0]).remove(0)
}

/// Copies a fixture into a temp dir so a test can damage it.
pub fn scratch_copy(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture_dir(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

pub fn load_error(dir: &std::path::Path) -> String {
    let files = match ModelFiles::open_dir(dir) {
        Err(e) => return e.to_string(),
        Ok(f) => f,
    };
    match Qwen35::load(&CpuBackend::new().with_f32_activations(), files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("damaged model {} loaded without error", dir.display()),
    }
}

/// Rewrites a copied fixture's weights through `edit`, which may drop or change tensors.
pub fn rewrite_weights(dir: &std::path::Path, edit: impl Fn(&str, safetensors::Dtype, Vec<usize>, Vec<u8>) -> Option<(safetensors::Dtype, Vec<usize>, Vec<u8>)>) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, (safetensors::Dtype, Vec<usize>, Vec<u8>))> =
        st.tensors().into_iter().filter_map(|(n, t)| edit(&n, t.dtype(), t.shape().to_vec(), t.data().to_vec()).map(|v| (n, v))).collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        kept.iter().map(|(n, (d, s, b))| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

/// Prefill of `ids` in pieces of `piece` tokens over a full-precision cache; returns the logits
/// of every token. The references these logits meet (transformers) cache keys and values in
/// f32, and a bf16 cache's rounding would be most of the difference.
pub fn prefill_logits(model: &Qwen35<CpuBackend>, ids: &[u32], piece: usize) -> Vec<f32> {
    prefill_logits_cached_as(model, ids, piece, KvDtype::F32)
}

/// [`prefill_logits`] with keys and values cached as `kv_dtype`.
pub fn prefill_logits_cached_as(model: &Qwen35<CpuBackend>, ids: &[u32], piece: usize, kv_dtype: KvDtype) -> Vec<f32> {
    prefill_logits_on(&CpuBackend::new().with_f32_activations(), model, ids, piece, kv_dtype)
}

/// [`prefill_logits_cached_as`] on backend `b` (the default backend: what a server computes).
pub fn prefill_logits_on(b: &CpuBackend, model: &Qwen35<CpuBackend>, ids: &[u32], piece: usize, kv_dtype: KvDtype) -> Vec<f32> {
    let spec = CacheSpec { kv_dtype, ..model.cache_spec(64, 16, 1, 0) };
    let mut cache = b.alloc_cache(&spec).unwrap();
    b.reset_states(&mut cache, &[0]);
    let table: Vec<u32> = (0..64).collect();
    let mut all = Vec::new();
    for (n, chunk) in ids.chunks(piece).enumerate() {
        let layout = BatchLayout {
            rows: vec![RowLayout { kind: RowKind::Prefill, token_start: 0, num_tokens: chunk.len(), start_position: n * piece, block_table: table.clone(), state_slot: 0, snapshot_base: 0 }],
        };
        let rows: Vec<u32> = (0..chunk.len() as u32).collect();
        let out = model.forward(b, chunk, &layout, &rows, &mut cache);
        all.extend(b.to_host(&out.logits));
    }
    all
}

pub fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let max_ref = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_err = got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    max_err / max_ref
}

/// Logits of a 150-token prefill (pieces of 64: chunks of the delta rule, both attention paths)
/// followed by a 3-token generate row, every token's row, on `b`.
pub fn pieced_logit_bits(model: &Qwen35<CpuBackend>, b: &CpuBackend, vocab: usize) -> Vec<u32> {
    let ids: Vec<u32> = (0..153u32).map(|i| (i * 7919 + 13) % vocab as u32).collect();
    let spec = model.cache_spec(16, 16, 1, 3);
    let mut cache = b.alloc_cache(&spec).expect("cache");
    b.reset_states(&mut cache, &[0]);
    let table: Vec<u32> = (0..16).collect();
    let mut bits = Vec::new();
    let mut start = 0;
    for (kind, n) in [(RowKind::Prefill, 64), (RowKind::Prefill, 64), (RowKind::Prefill, 22), (RowKind::Generate, 3)] {
        let layout = BatchLayout { rows: vec![RowLayout { kind, token_start: 0, num_tokens: n, start_position: start, block_table: table.clone(), state_slot: 0, snapshot_base: 0 }] };
        let rows: Vec<u32> = (0..n as u32).collect();
        let out = model.forward(b, &ids[start..start + n], &layout, &rows, &mut cache);
        bits.extend(b.to_host(&out.logits).iter().map(|v| v.to_bits()));
        start += n;
    }
    bits
}
