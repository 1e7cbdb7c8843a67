//! Helpers shared by the integration tests.
#![allow(dead_code)]

use kestrel::backend::cpu::CpuBackend;
use kestrel::engine::request::{Request, RequestEvent, RequestId, SpecMethod};
use kestrel::engine::sampler::SamplingParams;
use kestrel::engine::{Engine, EngineConfig};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::ModelFiles;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

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

pub fn reference(name: &str) -> Reference {
    let bytes = std::fs::read(fixture_dir(name).join("reference.safetensors")).expect("reference.safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid reference file");
    let logits = st.tensor("logits").unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    Reference { prompt_ids: i64s(&st.tensor("prompt_ids").unwrap()), logits, greedy_ids: i64s(&st.tensor("greedy_ids").unwrap()) }
}

pub fn load_model(dir: &Path) -> (ModelFiles, Qwen35<CpuBackend>) {
    let files = ModelFiles::open_dir(dir).expect("model opens");
    let model = Qwen35::load(&CpuBackend::new(), files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
    (files, model)
}

pub fn default_model() -> (ModelFiles, Qwen35<CpuBackend>) {
    let files = ModelFiles::open(None).expect("embedded model opens");
    let model = Qwen35::load(&CpuBackend::new(), files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
    (files, model)
}

pub fn engine(model: Qwen35<CpuBackend>, config: EngineConfig) -> Engine<CpuBackend> {
    Engine::new(CpuBackend::new(), model, config).expect("engine starts")
}

pub fn request(prompt: &[u32], max_tokens: usize, params: SamplingParams, spec: Option<SpecMethod>) -> Request {
    Request { prompt_ids: prompt.to_vec(), params, max_tokens, stop_token_ids: Vec::new(), spec }
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
