//! Speculation changes speed, never text (DESIGN Invariant 3), on the CPU batch engine.
//!
//! The equivalence matrix runs the embedded default model (trained on Python, so ngram and MTP
//! drafts are often right and every rollback depth occurs); the drafter-controlled tests use the
//! tiny dense fixture, where the drafts are planted.

mod common;

use common::*;
use kestrel::engine::request::SpecMethod;
use kestrel::backend::sampling::SamplingParams;
use kestrel::engine::{Engine, EngineConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const MODEL: &str = "qwen35-dense";

/// HumanEval prompts cut to many lengths: 1, k, k+1, k+2 for each tested k, up to 300 tokens.
fn code_prompts() -> Vec<Vec<u32>> {
    let (files, _) = default_model();
    let text: Vec<String> = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/humaneval/prompts.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["prompt"].as_str().unwrap().to_string())
        .collect();
    let lengths = [1usize, 2, 3, 4, 5, 8, 9, 10, 17, 40, 64, 65, 66, 129, 200, 300];
    let mut all: Vec<u32> = Vec::new();
    for t in &text {
        all.extend(files.tokenizer.encode(t, false).unwrap());
        if all.len() > 4000 {
            break;
        }
    }
    lengths.iter().enumerate().map(|(i, &n)| all[i * 173..i * 173 + n].to_vec()).collect()
}

/// Deterministic prompts of many lengths for the fixture model.
fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    let lengths = [1usize, 3, 4, 5, 8, 9, 10, 17, 40, 63, 64, 65, 100, 129, 200, 300];
    let mut state = 0x9e3779b97f4a7c15u64;
    lengths
        .iter()
        .map(|&n| {
            let motif: Vec<u32> = (0..7)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((state >> 33) as u32) % vocab
                })
                .collect();
            (0..n).map(|i| if i % 11 < 7 { motif[i % 7] } else { ((i * 31 + n) as u32) % vocab }).collect()
        })
        .collect()
}

fn max_tokens(i: usize) -> usize {
    8 + (i * 5) % 17
}

fn sampling(kind: usize, i: usize) -> SamplingParams {
    match kind {
        0 => SamplingParams::greedy(),
        _ => SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 1000 + i as u64, ..SamplingParams::greedy() },
    }
}

fn config(max_batch: usize, k: usize, method: SpecMethod) -> EngineConfig {
    EngineConfig { max_num_seqs: max_batch, max_num_batched_tokens: 96, spec: method, spec_tokens: k, ..EngineConfig::default() }
}

fn references(ps: &[Vec<u32>], kind: usize) -> Vec<Vec<u32>> {
    ps.iter().enumerate().map(|(i, p)| generate_alone(None, p, max_tokens(i), sampling(kind, i))).collect()
}

fn run_mixed(ps: &[Vec<u32>], cfg: EngineConfig, kind: usize) -> (Vec<Vec<u32>>, Engine<kestrel::backend::cpu::CpuBackend>) {
    let (_, model) = default_model();
    let mut e = engine(model, cfg);
    let reqs = ps.iter().enumerate().map(|(i, p)| request(p, max_tokens(i), sampling(kind, i), None)).collect();
    let arrivals: Vec<usize> = (0..ps.len()).map(|i| i * 2).collect();
    (run_staggered(&mut e, reqs, &arrivals), e)
}

#[test]
fn speculation_is_bitwise_equal_to_none_for_every_batch_and_k() {
    let ps = code_prompts();
    for kind in [0, 1] {
        let refs = references(&ps, kind);
        for method in [SpecMethod::Ngram, SpecMethod::Mtp] {
            let mut accepted = 0;
            for k in [1, 3, 8, 64] {
                for max_batch in [1, 3, 8, 16] {
                    let (got, e) = run_mixed(&ps, config(max_batch, k, method), kind);
                    for (i, (g, r)) in got.iter().zip(&refs).enumerate() {
                        assert_eq!(g, r, "request {i} differs: {method:?} k={k} batch={max_batch} sampling={kind}");
                    }
                    assert!(e.stats.spec.accepted <= e.stats.spec.drafted);
                    assert!(e.stats.spec.draft_steps > 0, "{method:?} k={k} batch={max_batch} never drafted");
                    accepted += e.stats.spec.accepted;
                }
            }
            eprintln!("{method:?} sampling={kind}: {accepted} drafts accepted over the matrix");
            assert!(accepted > 0, "{method:?} sampling={kind}: no draft was ever accepted, so verification paths went untested");
        }
    }
}

#[test]
fn speculation_is_bitwise_equal_under_preemption() {
    let ps = code_prompts();
    for kind in [0, 1] {
        let refs = references(&ps, kind);
        for method in [SpecMethod::Ngram, SpecMethod::Mtp] {
            // 30 blocks of 16 tokens cannot hold many of these requests at once.
            let (got, e) = run_mixed(&ps, EngineConfig { num_blocks: 30, ..config(8, 8, method) }, kind);
            assert!(e.preemptions() > 0, "the pool was meant to force preemption");
            eprintln!("preemption {method:?} sampling={kind}: {} preemptions, {} accepted", e.preemptions(), e.stats.spec.accepted);
            assert!(e.stats.spec.accepted > 0, "no draft accepted: rollback went untested");
            assert_eq!(got, refs, "{method:?} sampling={kind} with preemption");
        }
    }
}

#[test]
fn the_backoff_changes_drafts_never_text() {
    // With the back-off on, the drafts offered per row follow measured step times (so they
    // differ from run to run); every request's tokens must not.
    let ps = code_prompts();
    for kind in [0, 1] {
        let refs = references(&ps, kind);
        for method in [SpecMethod::Ngram, SpecMethod::Mtp] {
            let (got, e) = run_mixed(&ps, EngineConfig { spec_backoff: true, ..config(8, 8, method) }, kind);
            assert_eq!(got, refs, "{method:?} sampling={kind} with the back-off");
            // Every smaller k is tried once after the first measured step, whatever the timings.
            assert!(e.stats.backed_off_steps > 0, "{method:?}: the back-off never offered fewer drafts");
            assert!(e.stats.spec.draft_steps > 0, "{method:?}: never drafted");
        }
    }
}

/// A drafter built from the reference continuations of each request.
type Plan = Box<dyn FnMut(usize, &[u32], usize) -> usize + Send>;

struct Controlled {
    outputs: Vec<Vec<u32>>,
    accepted_planted: u64,
    accepted: u64,
}

/// Runs `prompts` with a custom drafter: `plan(call, reference_next_tokens, max)` returns how
/// many of the true next tokens to use followed by wrong ones.
fn run_controlled(ps: &[Vec<u32>], refs: &[Vec<u32>], k: usize, max_batch: usize, mut plan: Plan) -> Controlled {
    let (files, model) = load_model(&fixture_dir(MODEL));
    let vocab = files.config.vocab_size as u32;
    let mut e = engine(model, EngineConfig { max_num_seqs: max_batch, spec: SpecMethod::Ngram, spec_tokens: k, ..EngineConfig::default() });
    let prompt_of: Arc<Mutex<HashMap<u64, usize>>> = Arc::new(Mutex::new(HashMap::new()));
    let planted = Arc::new(Mutex::new((0u64, 0u64)));
    let refs_c = refs.to_vec();
    let lens: Vec<usize> = ps.iter().map(|p| p.len()).collect();
    let (pm, pl) = (prompt_of.clone(), planted.clone());
    let mut call = 0usize;
    e.set_custom_drafter(Some(Box::new(move |id, tokens, max| {
        let i = pm.lock().unwrap()[&id];
        let g = tokens.len() - lens[i];
        let truth: Vec<u32> = refs_c[i][g.min(refs_c[i].len())..].to_vec();
        let cap = max.min(k);
        let good = plan(call, &truth, cap).min(cap).min(truth.len());
        call += 1;
        let mut d: Vec<u32> = truth[..good].to_vec();
        // Wrong drafts: differ from the true token at that position.
        while d.len() < cap {
            let pos = d.len();
            d.push(truth.get(pos).map(|t| (t + 1) % vocab).unwrap_or(0));
        }
        let mut p = pl.lock().unwrap();
        p.0 += good as u64;
        p.1 += d.len() as u64;
        d
    })));
    let mut ids = HashMap::new();
    for (i, p) in ps.iter().enumerate() {
        let id = e.add_request(request(p, refs[i].len(), SamplingParams::greedy(), None)).unwrap();
        prompt_of.lock().unwrap().insert(id, i);
        ids.insert(id, i);
    }
    let mut outputs = vec![Vec::new(); ps.len()];
    for ev in e.run_to_completion() {
        if let kestrel::engine::request::RequestEvent::Finished { id, output, .. } = ev {
            outputs[ids[&id]] = output.generated;
        }
    }
    assert_eq!(e.stats.spec.drafted, planted.lock().unwrap().1, "every proposed draft was verified");
    let p = *planted.lock().unwrap();
    Controlled { outputs, accepted_planted: p.0, accepted: e.stats.spec.accepted }
}

fn greedy_refs(ps: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    ps.iter().map(|p| generate_alone(Some(&fixture_dir(MODEL)), p, n, SamplingParams::greedy())).collect()
}

#[test]
fn drafter_controlled_acceptance_is_exact() {
    let (files, _) = load_model(&fixture_dir(MODEL));
    let ps: Vec<Vec<u32>> = prompts(files.config.vocab_size as u32).into_iter().step_by(4).collect();
    let refs = greedy_refs(&ps, 24);
    let k = 5;
    // Oracle: every draft accepted.
    let r = run_controlled(&ps, &refs, k, 4, Box::new(|_, _, cap| cap));
    assert_eq!(r.outputs, refs, "oracle drafter");
    assert_eq!(r.accepted, r.accepted_planted, "oracle: all accepted");
    assert!(r.accepted_planted > 0);
    // Always wrong: nothing accepted.
    let r = run_controlled(&ps, &refs, k, 4, Box::new(|_, _, _| 0));
    assert_eq!(r.outputs, refs, "always-wrong drafter");
    assert_eq!(r.accepted, 0, "always-wrong: none accepted");
    // Random prefix: every rollback depth 0..=k, accepted exactly as planted.
    let mut rng = 7u64;
    let r = run_controlled(
        &ps,
        &refs,
        k,
        4,
        Box::new(move |_, _, cap| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((rng >> 33) as usize) % (cap + 1)
        }),
    );
    assert_eq!(r.outputs, refs, "random-prefix drafter");
    assert_eq!(r.accepted, r.accepted_planted, "accepted count equals the planted prefixes");
}

#[test]
fn zero_draft_steps_mix_with_full_accepts() {
    let (files, _) = load_model(&fixture_dir(MODEL));
    let ps: Vec<Vec<u32>> = prompts(files.config.vocab_size as u32).into_iter().skip(2).step_by(3).collect();
    let refs = greedy_refs(&ps, 30);
    // Per call: full accept, then zero drafts, then a partial accept, then zero again.
    let r = run_controlled(&ps, &refs, 4, 1, Box::new(|call, _, cap| [cap, 0, 2, 0][call % 4]));
    assert_eq!(r.outputs, refs, "alternating full/zero drafts, one at a time");
    // Several requests per step: some rows draft, others do not, and sometimes none do.
    let r = run_controlled(&ps, &refs, 4, 8, Box::new(|call, _, cap| if call % 3 == 0 { 0 } else if call % 2 == 0 { cap } else { 1 }));
    assert_eq!(r.outputs, refs, "mixed zero and non-zero draft rows in one step");
}

#[test]
fn an_aborted_request_keeps_its_drafts_in_the_engine_totals() {
    let (_, model) = load_model(&fixture_dir(MODEL));
    let mut engine = engine(model, EngineConfig { max_num_seqs: 2, spec: SpecMethod::Ngram, spec_tokens: 3, ..EngineConfig::default() });
    // Drafts from a custom drafter, so that every step drafts.
    engine.set_custom_drafter(Some(Box::new(|_, tokens: &[u32], left| tokens.iter().rev().take(left.min(3)).copied().collect())));
    let id = engine.add_request(request(&[5, 6, 7, 5, 6, 7], 200, SamplingParams::greedy(), None)).expect("accepted");
    let mut steps = 0;
    while engine.request_spec_stats(id).is_none_or(|s| s.drafted < 9) {
        engine.step();
        steps += 1;
        assert!(steps < 100, "no drafts after 100 steps");
    }
    let drafted = engine.request_spec_stats(id).expect("in flight").drafted;
    engine.abort(id).expect("aborted");
    assert_eq!(engine.stats.spec.drafted, drafted, "the aborted request's drafts left the totals");
}
