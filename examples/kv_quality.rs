//! Quality of each KV cache format on the embedded default model, on the CPU: perplexity of the
//! held-out file (windows of 256 tokens, as `kestrel perplexity`) and greedy agreement with the
//! bf16 cache over 32 HumanEval prompts x 128 tokens. Besides the formats `--kv-cache-dtype`
//! offers, vLLM's `turboquant_3bit_nc` recipe (keys as tq3, values unrotated with a uniform
//! 3-bit quantizer) shows what rotating and codebook-coding the values buys.
//!
//!     cargo run --release --example kv_quality [-- FORMAT ...]
//!
//! FORMAT is f32, bf16, fp8, tq3 or turboquant_3bit_nc (default: all of them).

use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::sampling::SamplingParams;
use kestrel::backend::{CacheSpec, KvDtype};
use kestrel::engine::request::{Request, RequestEvent, SpecMethod};
use kestrel::engine::{Engine, EngineConfig};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::perplexity::{window_nll, Scoring};
use kestrel::model::ModelFiles;
use std::collections::HashMap;
use std::path::Path;

const WINDOW: usize = 256;
const PROMPTS: usize = 32;
const TOKENS: usize = 128;

fn load() -> (ModelFiles, Qwen35<CpuBackend>) {
    let files = ModelFiles::open(None).expect("the embedded model opens");
    let model = Qwen35::load(&CpuBackend::new(), files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
    (files, model)
}

fn perplexity(model: &Qwen35<CpuBackend>, ids: &[u32], kv_dtype: KvDtype) -> f64 {
    let cpu = CpuBackend::new();
    let (mean_nll, _) = window_nll(model, &cpu, kv_dtype, ids, WINDOW, Scoring::EveryToken, cpu.threads(), &indicatif::ProgressBar::hidden()).expect("the held-out text scores");
    mean_nll.exp()
}

/// Greedy continuations of every prompt, 16 requests at a time.
fn greedy(model: Qwen35<CpuBackend>, prompts: &[Vec<u32>], kv_dtype: KvDtype) -> (Vec<Vec<u32>>, Qwen35<CpuBackend>) {
    let config = EngineConfig { max_num_seqs: 16, kv_dtype, ..EngineConfig::default() };
    let mut engine = Engine::new(CpuBackend::new(), model, config).expect("engine starts");
    let mut ids = HashMap::new();
    for (i, p) in prompts.iter().enumerate() {
        let id = engine.add_request(Request { spec: Some(SpecMethod::None), ..Request::new(p.clone(), SamplingParams::greedy(), TOKENS, Vec::new()) }).expect("request");
        ids.insert(id, i);
    }
    let mut out = vec![Vec::new(); prompts.len()];
    for ev in engine.run_to_completion() {
        if let RequestEvent::Finished { id, output, .. } = ev {
            out[ids[&id]] = output.generated;
        }
    }
    (out, engine.into_parts().1)
}

fn main() {
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    let formats: Vec<KvDtype> = KvDtype::ALL.into_iter().filter(|d| wanted.is_empty() || wanted.iter().any(|w| w == d.name())).collect();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (files, mut model) = load();
    let heldout = files.tokenizer.encode(&std::fs::read_to_string(root.join("models/kestrel-coder/heldout.txt")).expect("heldout.txt"), false).expect("tokenizes");
    let prompts: Vec<Vec<u32>> = include_str!("../data/humaneval/prompts.jsonl")
        .lines()
        .take(PROMPTS)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            files.tokenizer.encode(v["prompt"].as_str().expect("prompt"), false).expect("tokenizes")
        })
        .collect();
    let (reference, m) = greedy(model, &prompts, KvDtype::Bf16);
    model = m;
    println!("{:<20} {:>10} {:>9} {:>14} {:>14} {:>10}", "format", "bytes/tok", "ppl", "vs bf16", "agreement", "identical");
    let bf16_ppl = perplexity(&model, &heldout, KvDtype::Bf16);
    for dtype in formats {
        let ppl = if dtype == KvDtype::Bf16 { bf16_ppl } else { perplexity(&model, &heldout, dtype) };
        let (got, m) = greedy(model, &prompts, dtype);
        model = m;
        // Tokens equal to bf16's before the first difference, over all prompts.
        let agreeing: usize = got.iter().zip(&reference).map(|(a, b)| a.iter().zip(b).take_while(|(x, y)| x == y).count()).sum();
        let identical = got.iter().zip(&reference).filter(|(a, b)| a == b).count();
        let bytes = CacheSpec { kv_dtype: dtype, ..model.cache_spec(0, 16, 0, 0) }.kv_bytes_per_token();
        println!(
            "{:<20} {:>10} {:>9.4} {:>+13.2}% {:>13.1}% {:>7}/{}",
            dtype.name(),
            bytes,
            ppl,
            100.0 * (ppl / bf16_ppl - 1.0),
            100.0 * agreeing as f64 / (PROMPTS * TOKENS) as f64,
            identical,
            PROMPTS
        );
    }
    println!("({} held-out tokens in windows of {WINDOW}; greedy agreement: tokens before the first difference from the bf16 cache's continuation, over {PROMPTS} HumanEval prompts x {TOKENS} tokens)", heldout.len());
}
