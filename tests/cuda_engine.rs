//! The batch engine on the GPU: speculation changes speed, never text (DESIGN Invariant 3).
//!
//! Every request of a mixed, staggered workload must produce exactly the tokens it produces
//! alone with `--spec none` on the same GPU: ngram, MTP and a per-request mix of methods, k up
//! to 64, max batch 1 to 64, greedy and seeded sampling (drawn on the device, and filtered
//! top-k/top-p rows drawn on the host), with and without preemption, with decode steps
//! replayed as CUDA graphs against references run without them. Plus the device sampler
//! against the host sampler. Runs where a GPU is present.

mod common;
mod cuda_support;

use common::conversation::humaneval_tokens;
use common::{request, run_staggered};
use cuda_support::*;
use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::cuda::CudaBackend;
use kestrel::backend::{Backend, RowSampling};
use kestrel::engine::request::SpecMethod;
use kestrel::backend::sampling::SamplingParams;
use kestrel::engine::{Engine, EngineConfig};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::weights::online::OnlineQuantization;
use kestrel::model::ModelFiles;

/// Prompt lengths around the drafts-per-step and chunk boundaries (1, k, k+1, k+2, 63..66).
const LENGTHS: [usize; 18] = [1, 2, 3, 4, 5, 8, 9, 10, 17, 40, 63, 64, 65, 66, 100, 129, 200, 300];

/// HumanEval prompts (the default model was trained on Python, so drafts are often right)
/// cut to the lengths above, `n` of them.
fn code_prompts(files: &ModelFiles, n: usize) -> Vec<Vec<u32>> {
    let all = humaneval_tokens(&files.tokenizer);
    (0..n).map(|i| all[i * 131..i * 131 + LENGTHS[i % LENGTHS.len()]].to_vec()).collect()
}

/// Mostly short outputs; every ninth request long enough for 64-draft verify rows.
fn max_tokens(i: usize) -> usize {
    8 + (i * 5) % 17 + if i.is_multiple_of(9) { 72 } else { 0 }
}

#[derive(Clone, Copy, Debug)]
enum Draw {
    Greedy,
    /// Temperature only: drawn by the device kernel.
    Seeded,
    /// Top-k and top-p: drawn by the host sampler from the copied row.
    SeededFiltered,
}

fn sampling(draw: Draw, i: usize) -> SamplingParams {
    match draw {
        Draw::Greedy => SamplingParams::greedy(),
        Draw::Seeded => SamplingParams { temperature: 0.8, seed: 1000 + i as u64, ..SamplingParams::greedy() },
        Draw::SeededFiltered => SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 2000 + i as u64, ..SamplingParams::greedy() },
    }
}

/// `None` means a per-request mix of none, ngram and MTP in one batch.
fn method_of(method: Option<SpecMethod>, i: usize) -> SpecMethod {
    method.unwrap_or([SpecMethod::None, SpecMethod::Ngram, SpecMethod::Mtp][i % 3])
}

/// The GPU, the default model on it and its files; reused across engines.
struct Rig {
    parts: Option<(CudaBackend, Qwen35<CudaBackend>)>,
    files: ModelFiles,
}

impl Rig {
    fn new() -> Option<Rig> {
        Rig::quantized(None)
    }

    /// The default model, quantized at load where `q` says.
    fn quantized(q: Option<OnlineQuantization>) -> Option<Rig> {
        let gpu = gpu()?;
        let mut files = ModelFiles::open(None).expect("embedded model opens");
        files.config.online_quantization = q;
        let model = Qwen35::load(&gpu, files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
        Some(Rig { parts: Some((gpu, model)), files })
    }

    /// Runs `prompts` arriving two steps apart on an engine with `config`; returns each
    /// request's tokens and the engine's (spec accepted, drafted, draft steps, preemptions).
    fn run(&mut self, prompts: &[Vec<u32>], config: EngineConfig, draw: Draw, method: Option<SpecMethod>) -> (Vec<Vec<u32>>, [u64; 4]) {
        let (gpu, model) = self.parts.take().expect("parts are returned after every run");
        let mut engine = Engine::new(gpu, model, config).expect("engine starts");
        let requests = prompts.iter().enumerate().map(|(i, p)| request(p, max_tokens(i), sampling(draw, i), Some(method_of(method, i)))).collect();
        let arrivals: Vec<usize> = (0..prompts.len()).map(|i| 2 * i).collect();
        let out = run_staggered(&mut engine, requests, &arrivals);
        let s = &engine.stats.spec;
        let counters = [s.accepted, s.drafted, s.draft_steps, engine.preemptions()];
        self.parts = Some(engine.into_parts());
        (out, counters)
    }

    /// Each request alone with `--spec none`.
    fn references(&mut self, prompts: &[Vec<u32>], draw: Draw) -> Vec<Vec<u32>> {
        (0..prompts.len())
            .map(|i| {
                // Request `i` keeps its own sampling seed and max_tokens when run alone, eagerly
                // (no CUDA graphs: the runs it is compared with replay graphs).
                let (gpu, model) = self.parts.take().expect("parts are returned after every run");
                let mut engine = Engine::new(gpu, model, EngineConfig { cuda_graphs: false, ..config(1, 4) }).expect("engine starts");
                let out = run_staggered(&mut engine, vec![request(&prompts[i], max_tokens(i), sampling(draw, i), Some(SpecMethod::None))], &[0]);
                self.parts = Some(engine.into_parts());
                out.into_iter().next().expect("one request")
            })
            .collect()
    }
}

/// 96 tokens per step, so prefill pieces share steps with verify rows.
fn config(max_batch: usize, k: usize) -> EngineConfig {
    EngineConfig { max_num_seqs: max_batch, max_num_batched_tokens: 96, spec: SpecMethod::None, spec_tokens: k, ..EngineConfig::default() }
}

#[test]
fn speculation_on_the_gpu_is_bitwise_equal_to_none_for_every_batch_and_k() {
    let Some(mut rig) = Rig::new() else { return };
    let prompts = code_prompts(&rig.files, 72);
    for draw in [Draw::Greedy, Draw::Seeded, Draw::SeededFiltered] {
        let refs = rig.references(&prompts, draw);
        for method in [Some(SpecMethod::Ngram), Some(SpecMethod::Mtp), None] {
            let mut accepted = 0;
            for k in [1, 3, 8, 64] {
                for max_batch in [1, 3, 8, 16, 64] {
                    // Batches of 1 and 3 run the first 18 prompts (every length once).
                    let n = if max_batch < 8 { 18 } else { prompts.len() };
                    let (got, [acc, drafted, draft_steps, _]) = rig.run(&prompts[..n], config(max_batch, k), draw, method);
                    for (i, (g, r)) in got.iter().zip(&refs).enumerate() {
                        assert_eq!(g, r, "request {i} differs from its run alone: {method:?} k={k} max_batch={max_batch} {draw:?}");
                    }
                    assert!(acc <= drafted);
                    assert!(draft_steps > 0, "{method:?} k={k} max_batch={max_batch} never drafted");
                    accepted += acc;
                }
            }
            eprintln!("{method:?} {draw:?}: {accepted} drafts accepted over the matrix");
            assert!(accepted > 0, "{method:?} {draw:?}: no draft accepted, so rollback went untested");
        }
    }
}

/// The same with the weights in quantized bits on the GPU (int4 and Q4_K: their few-row and
/// many-row kernels in decode, verify and prefill steps of every size).
#[test]
fn speculation_with_quantized_weights_is_bitwise_equal_to_none() {
    for q in [OnlineQuantization::Int4, OnlineQuantization::Q4K] {
        let Some(mut rig) = Rig::quantized(Some(q)) else { return };
        let prompts = code_prompts(&rig.files, 72);
        for draw in [Draw::Greedy, Draw::Seeded] {
            let refs = rig.references(&prompts, draw);
            for method in [Some(SpecMethod::Ngram), Some(SpecMethod::Mtp), None] {
                let mut accepted = 0;
                for (k, max_batch) in [(1, 1), (3, 8), (8, 64), (64, 16)] {
                    let n = if max_batch < 8 { 18 } else { prompts.len() };
                    let (got, [acc, drafted, draft_steps, _]) = rig.run(&prompts[..n], config(max_batch, k), draw, method);
                    for (i, (g, r)) in got.iter().zip(&refs).enumerate() {
                        assert_eq!(g, r, "{q}: request {i} differs from its run alone: {method:?} k={k} max_batch={max_batch} {draw:?}");
                    }
                    assert!(acc <= drafted);
                    assert!(draft_steps > 0, "{q}: {method:?} k={k} max_batch={max_batch} never drafted");
                    accepted += acc;
                }
                eprintln!("{q}: {method:?} {draw:?}: {accepted} drafts accepted");
                assert!(accepted > 0, "{q}: {method:?} {draw:?}: no draft accepted, so rollback went untested");
            }
        }
    }
}

#[test]
fn speculation_on_the_gpu_is_bitwise_equal_under_preemption() {
    let Some(mut rig) = Rig::new() else { return };
    let prompts = code_prompts(&rig.files, 24);
    for draw in [Draw::Greedy, Draw::SeededFiltered] {
        let refs = rig.references(&prompts, draw);
        for method in [Some(SpecMethod::Ngram), Some(SpecMethod::Mtp), None] {
            // 40 blocks of 16 tokens cannot hold many of these requests at once.
            let (got, [acc, _, _, preemptions]) = rig.run(&prompts, EngineConfig { num_blocks: 40, ..config(16, 8) }, draw, method);
            eprintln!("preemption {method:?} {draw:?}: {preemptions} preemptions, {acc} accepted");
            assert!(preemptions > 0, "the pool was meant to force preemption");
            assert!(acc > 0, "no draft accepted: rollback went untested");
            assert_eq!(got, refs, "{method:?} {draw:?} with preemption");
        }
    }
}

#[test]
fn cuda_graphs_change_speed_never_text() {
    let Some(mut rig) = Rig::new() else { return };
    let prompts = code_prompts(&rig.files, 40);
    for draw in [Draw::Greedy, Draw::Seeded] {
        for max_batch in [1, 7, 16] {
            let cfg = |graphs: bool| EngineConfig { cuda_graphs: graphs, ..config(max_batch, 4) };
            let (eager, _) = rig.run(&prompts, cfg(false), draw, Some(SpecMethod::None));
            let (graphed, _) = rig.run(&prompts, cfg(true), draw, Some(SpecMethod::None));
            let captured = rig.parts.as_ref().map_or(0, |(gpu, _)| gpu.captured_graphs());
            assert!(captured > 0, "max_batch {max_batch}: no decode step was captured");
            assert_eq!(graphed, eager, "{draw:?} max_batch {max_batch}: graph replay changed the text");
            eprintln!("{draw:?} max_batch {max_batch}: equal with {captured} captured graphs");
        }
    }
}

/// Decode and verify steps padded up to the capture sizes (captured at start-up) and replayed:
/// 17 requests run as 24 rows, and 19, 29 and 45, and a full batch of 16 (`max_num_seqs` 16,
/// whose verify steps pad into the 17th row), with ngram and MTP at k 1, 3 and 8, every
/// request bitwise equal to itself alone, eager, without speculation. The first engine starts on
/// a fresh GPU backend, so its start-up captures are the backend's first forwards (anything a
/// forward makes on first use must not be made inside a capture); the references run last.
#[test]
fn padded_graph_steps_are_bitwise_equal_to_each_request_alone() {
    let Some(mut rig) = Rig::new() else { return };
    let prompts = code_prompts(&rig.files, 45);
    let mut runs = Vec::new();
    for (n, max_num_seqs) in [(17, 64), (19, 64), (29, 64), (45, 64), (16, 16)] {
        for method in [SpecMethod::Ngram, SpecMethod::Mtp] {
            for k in [1, 3, 8] {
                let (gpu, model) = rig.parts.take().expect("parts are returned after every run");
                let config = EngineConfig { max_num_seqs, max_num_batched_tokens: 1024, spec: method, spec_tokens: k, ..EngineConfig::default() };
                let mut engine = Engine::new(gpu, model, config).expect("engine starts");
                let report = engine.graph_capture.clone().expect("the GPU captures graphs at start-up");
                assert!(report.graphs > 0, "no graph captured at start-up");
                let requests = prompts[..n].iter().enumerate().map(|(i, p)| request(p, max_tokens(i), sampling(Draw::Seeded, i), Some(method))).collect();
                let got = run_staggered(&mut engine, requests, &vec![0; n]);
                let padding = engine.stats.padding;
                let accepted = engine.stats.spec.accepted;
                let captured = engine.backend.captured_graphs();
                rig.parts = Some(engine.into_parts());
                assert!(padding.padded_rows > padding.real_rows, "{n} {method:?} k={k}: no padded row ran: {padding:?}");
                assert!(accepted > 0, "{n} {method:?} k={k}: no draft accepted");
                eprintln!("{n} requests {method:?} k={k}: {} graphs at start-up in {:?}, {captured} in all; {padding:?}", report.graphs, report.time);
                runs.push((n, method, k, got));
            }
        }
    }
    let refs = rig.references(&prompts, Draw::Seeded);
    for (n, method, k, got) in runs {
        for (i, (g, r)) in got.iter().zip(&refs).enumerate() {
            assert_eq!(g, r, "request {i} of {n} differs from its run alone: {method:?} k={k}");
        }
    }
}

/// Logits rows with planted ties, NaN and -inf, to exercise every rule of the draw.
fn awkward_logits(rng: &mut Rng, rows: usize, vocab: usize) -> Vec<f32> {
    let mut v = rng.vec(rows * vocab, 6.0);
    for r in 0..rows {
        let row = &mut v[r * vocab..(r + 1) * vocab];
        match r % 5 {
            // A tie for the maximum: the lower id must win.
            0 => {
                let (a, b) = (rng.below(vocab), rng.below(vocab));
                row[a] = 50.0;
                row[b] = 50.0;
            }
            // NaN and -inf never win.
            1 => {
                for _ in 0..vocab / 3 {
                    let i = rng.below(vocab);
                    row[i] = if i.is_multiple_of(2) { f32::NAN } else { f32::NEG_INFINITY };
                }
            }
            // Everything masked: nothing finite to draw from.
            2 if r % 10 == 2 => row.fill(f32::NEG_INFINITY),
            _ => {}
        }
    }
    v
}

#[test]
fn device_sampling_draws_what_the_host_sampler_draws() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(5);
    for vocab in [17, 1000, 248_320] {
        let rows = 40;
        let logits = awkward_logits(&mut rng, rows, vocab);
        let params = [
            SamplingParams::greedy(),
            SamplingParams { temperature: 0.7, seed: 3, ..SamplingParams::greedy() },
            SamplingParams { temperature: 1.5, seed: 99, ..SamplingParams::greedy() },
            SamplingParams { temperature: 0.9, top_k: 20, top_p: 0.9, seed: 7, ..SamplingParams::greedy() },
            SamplingParams { temperature: 0.8, min_p: 0.05, seed: 11, ..SamplingParams::greedy() },
        ];
        let specs: Vec<RowSampling> = (0..rows).map(|r| RowSampling { params: params[r % params.len()].clone(), position: (r * 37) as u64, allowed: None }).collect();
        let on_gpu = gpu.sample_rows(&gpu.from_host(&logits, rows, vocab), &specs);
        let on_cpu = cpu.sample_rows(&cpu.from_host(&logits, rows, vocab), &specs);
        assert_eq!(on_gpu, on_cpu, "vocab {vocab}: device and host draws differ");
        // The draws are not degenerate: sampling rows do not all pick the argmax.
        let greedy: Vec<RowSampling> = specs.iter().map(|s| RowSampling { params: SamplingParams::greedy(), position: s.position, allowed: None }).collect();
        let argmax = gpu.sample_rows(&gpu.from_host(&logits, rows, vocab), &greedy);
        if vocab > 100 {
            assert!(on_gpu.iter().zip(&argmax).any(|(a, b)| a != b), "vocab {vocab}: sampled rows all equal the argmax");
        }
    }
}

/// Rows with no finite logit, in every shape a broken model gives them, among healthy rows: all
/// NaN, all -inf, all +inf, a mix of the three, and rows whose only finite logit (or only +inf)
/// sits in the last of a split row's blocks, so that blocks must agree on what they saw.
fn rows_without_finite_logits(rng: &mut Rng, vocab: usize) -> Vec<Vec<f32>> {
    let mixed: Vec<f32> = (0..vocab).map(|i| [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][i % 3]).collect();
    let mut last_finite = vec![f32::NAN; vocab];
    last_finite[vocab - 1] = -7.5;
    let mut last_infinite = vec![f32::NEG_INFINITY; vocab];
    last_infinite[vocab - 1] = f32::INFINITY;
    vec![vec![f32::NAN; vocab], rng.vec(vocab, 4.0), vec![f32::NEG_INFINITY; vocab], vec![f32::INFINITY; vocab], mixed, last_finite, last_infinite, rng.vec(vocab, 4.0)]
}

#[test]
fn rows_without_a_finite_logit_draw_the_no_finite_signal_on_the_device() {
    use kestrel::backend::sampling::NO_FINITE_LOGIT;
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(17);
    // One block per row, and a row split across blocks.
    for vocab in [1000, 248_320] {
        let rows = rows_without_finite_logits(&mut rng, vocab);
        let flat: Vec<f32> = rows.concat();
        let params = [
            SamplingParams::greedy(),
            SamplingParams { temperature: 0.8, seed: 5, ..SamplingParams::greedy() },
            // Filtered rows are drawn on the host from the copied row.
            SamplingParams { temperature: 0.8, top_k: 40, min_p: 0.05, seed: 5, ..SamplingParams::greedy() },
        ];
        for p in &params {
            let specs: Vec<RowSampling> = (0..rows.len()).map(|r| RowSampling { params: p.clone(), position: r as u64, allowed: None }).collect();
            let on_gpu = gpu.sample_rows(&gpu.from_host(&flat, rows.len(), vocab), &specs);
            let on_cpu = cpu.sample_rows(&cpu.from_host(&flat, rows.len(), vocab), &specs);
            assert_eq!(on_gpu, on_cpu, "vocab {vocab} {p:?}: device and host disagree");
            let signalled: Vec<bool> = on_gpu.iter().map(|&t| t == NO_FINITE_LOGIT).collect();
            assert_eq!(signalled, [true, false, true, true, true, false, true, false], "vocab {vocab} {p:?}: {on_gpu:?}");
            assert_eq!(on_gpu[5], (vocab - 1) as u32, "vocab {vocab} {p:?}: the one finite logit must be drawn");
        }
    }
}

/// Rows masked by a grammar: for every draw (greedy, temperature, filtered), in a row of one
/// block and in a row split across blocks, with masks of every width (shorter than the
/// vocabulary, allowing nothing), the device draws what the host draws from the masked row.
#[test]
fn device_sampling_applies_grammar_masks_as_the_host_does() {
    use kestrel::backend::sampling::{is_allowed, AllowedTokens, NO_FINITE_LOGIT};
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(23);
    for vocab in [1000, 248_320] {
        let rows = 30;
        let logits = awkward_logits(&mut rng, rows, vocab);
        let words = vocab.div_ceil(32);
        let random_word = |rng: &mut Rng| (rng.below(1 << 16) as u32) << 16 | rng.below(1 << 16) as u32;
        let mask = |r: usize, rng: &mut Rng| -> Option<AllowedTokens> {
            match r % 6 {
                0 => None,
                // Nothing allowed: nothing to draw.
                1 => Some(AllowedTokens::from(vec![0u32; words])),
                // A few tokens, or a mask covering only the first part of the vocabulary.
                2 => Some((0..words).map(|_| if rng.below(8) == 0 { 1u32 << rng.below(32) } else { 0 }).collect()),
                3 => Some((0..words / 2).map(|_| random_word(rng)).collect()),
                _ => Some((0..words).map(|_| random_word(rng)).collect()),
            }
        };
        let params = [
            SamplingParams::greedy(),
            SamplingParams { temperature: 0.7, seed: 3, ..SamplingParams::greedy() },
            SamplingParams { temperature: 0.9, top_k: 20, top_p: 0.9, seed: 7, ..SamplingParams::greedy() },
        ];
        let specs: Vec<RowSampling> = (0..rows).map(|r| RowSampling { params: params[r % params.len()].clone(), position: (r * 13) as u64, allowed: mask(r, &mut rng) }).collect();
        let on_gpu = gpu.sample_rows(&gpu.from_host(&logits, rows, vocab), &specs);
        let on_cpu = cpu.sample_rows(&cpu.from_host(&logits, rows, vocab), &specs);
        assert_eq!(on_gpu, on_cpu, "vocab {vocab}: masked device and host draws differ");
        for (r, (&token, spec)) in on_gpu.iter().zip(&specs).enumerate() {
            if let Some(allowed) = &spec.allowed {
                assert!(token == NO_FINITE_LOGIT || is_allowed(allowed, token as usize), "vocab {vocab} row {r}: drew {token}, which its mask forbids");
            }
            if r % 6 == 1 {
                assert_eq!(token, NO_FINITE_LOGIT, "vocab {vocab} row {r}: a mask allowing nothing draws nothing");
            }
        }
        // The masks matter: unmasked, some rows draw a token their mask forbids.
        let unmasked: Vec<RowSampling> = specs.iter().map(|s| RowSampling { allowed: None, ..s.clone() }).collect();
        assert_ne!(gpu.sample_rows(&gpu.from_host(&logits, rows, vocab), &unmasked), on_gpu, "vocab {vocab}");
    }
}

/// A JSON schema's rows are masked and drawn on the device; asking for log probabilities as well
/// moves them to the host. Both draw the same tokens, with speculation and graphs or without.
#[test]
fn grammar_rows_masked_on_the_device_match_the_host_draw() {
    use kestrel::engine::logits::grammar::{GrammarCompiler, GrammarSpec};
    use kestrel::engine::logits::LogitsOptions;
    let Some(mut rig) = Rig::new() else { return };
    let ends = rig.files.config.eos_token_ids.clone();
    let compiler = GrammarCompiler::new(&rig.files.tokenizer, rig.files.config.vocab_size, &ends).expect("token table");
    let schema = serde_json::json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "args": {"type": "array", "items": {"enum": ["a", "b", "n"]}}, "pure": {"type": "boolean"}}, "required": ["name", "args", "pure"]});
    let grammar = compiler.compile(&GrammarSpec::JsonSchema(schema), &ends).expect("compiles");
    let prompts = code_prompts(&rig.files, 6);
    let run = |rig: &mut Rig, logprobs: Option<usize>, method: Option<SpecMethod>, graphs: bool| {
        let (gpu, model) = rig.parts.take().expect("parts are returned after every run");
        let mut engine = Engine::new(gpu, model, EngineConfig { cuda_graphs: graphs, ..config(6, 4) }).expect("engine starts");
        let requests = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let draw = [Draw::Greedy, Draw::Seeded, Draw::SeededFiltered][i % 3];
                let logits = LogitsOptions { grammar: Some(grammar.clone()), logprobs, ..LogitsOptions::default() };
                kestrel::engine::request::Request { logits, stop_token_ids: ends.clone(), ..request(p, 48, sampling(draw, i), Some(method_of(method, i))) }
            })
            .collect();
        let out = run_staggered(&mut engine, requests, &[0, 0, 1, 2, 3, 5]);
        rig.parts = Some(engine.into_parts());
        out
    };
    let on_host = run(&mut rig, Some(0), Some(SpecMethod::None), false);
    assert!(on_host.iter().all(|t| t.len() > 4), "{on_host:?}");
    let first = rig.files.tokenizer.decode(&on_host[0][..1], true).expect("decodes");
    assert!(first.trim_start().starts_with('{'), "a JSON object starts with a brace: {first:?}");
    assert_eq!(run(&mut rig, None, Some(SpecMethod::None), false), on_host, "device-masked rows drew other tokens");
    assert_eq!(run(&mut rig, None, None, true), on_host, "device-masked rows with speculation and graphs drew other tokens");
}
