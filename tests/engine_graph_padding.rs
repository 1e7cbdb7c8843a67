//! Steps padded up to CUDA graph capture sizes, run eagerly on the CPU backend (DESIGN
//! Invariant 2): padded rows write only scratch memory and are cut off before the engine sees
//! the step's results, so every request's tokens are bitwise those it produces alone, without
//! padding and without speculation. The GPU runs the same padded steps as graphs
//! (tests/cuda_engine.rs).

mod common;

use common::*;
use kestrel::backend::sampling::SamplingParams;
use kestrel::engine::padding::CaptureSizes;
use kestrel::engine::request::SpecMethod;
use kestrel::engine::{Engine, EngineConfig};

fn code_prompts(n: usize) -> Vec<Vec<u32>> {
    let (files, _) = default_model();
    let text = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/humaneval/prompts.jsonl")).unwrap();
    let mut all: Vec<u32> = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        all.extend(files.tokenizer.encode(v["prompt"].as_str().unwrap(), false).unwrap());
        if all.len() > 8000 {
            break;
        }
    }
    let lengths = [1usize, 2, 3, 5, 9, 17, 40, 64, 65, 100];
    (0..n).map(|i| all[i * 97..i * 97 + lengths[i % lengths.len()]].to_vec()).collect()
}

fn max_tokens(i: usize) -> usize {
    6 + (i * 5) % 13
}

fn sampling(i: usize) -> SamplingParams {
    if i.is_multiple_of(2) {
        SamplingParams::greedy()
    } else {
        SamplingParams { temperature: 0.8, seed: 500 + i as u64, ..SamplingParams::greedy() }
    }
}

/// Each request alone, unpadded (no graphs), without speculation.
fn references(prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let (_, mut model) = default_model();
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut e = Engine::new(kestrel::backend::cpu::CpuBackend::new().with_f32_activations(), model, EngineConfig { max_num_seqs: 1, cuda_graphs: false, ..EngineConfig::default() }).expect("engine starts");
        out.push(run_staggered(&mut e, vec![request(p, max_tokens(i), sampling(i), Some(SpecMethod::None))], &[0]).remove(0));
        model = e.into_parts().1;
    }
    out
}

/// All requests at once on an engine that pads to the default capture sizes.
fn run_padded(prompts: &[Vec<u32>], method: SpecMethod, k: usize) -> (Vec<Vec<u32>>, Engine<kestrel::backend::cpu::CpuBackend>) {
    let (_, model) = default_model();
    let config = EngineConfig {
        max_num_seqs: 64,
        max_num_batched_tokens: 1024,
        spec: method,
        spec_tokens: k,
        cuda_graph_sizes: Some(CaptureSizes::default_up_to(64)),
        ..EngineConfig::default()
    };
    let mut e = engine(model, config);
    let requests = prompts.iter().enumerate().map(|(i, p)| request(p, max_tokens(i), sampling(i), None)).collect();
    let out = run_staggered(&mut e, requests, &vec![0; prompts.len()]);
    (out, e)
}

#[test]
fn padded_steps_are_bitwise_equal_to_each_request_alone() {
    let prompts = code_prompts(19);
    let refs = references(&prompts);
    for (n, method, k) in [(17, SpecMethod::None, 1), (17, SpecMethod::Ngram, 3), (19, SpecMethod::Mtp, 3), (19, SpecMethod::Ngram, 1), (17, SpecMethod::Mtp, 8)] {
        let (got, engine) = run_padded(&prompts[..n], method, k);
        for (i, (g, r)) in got.iter().zip(&refs).enumerate() {
            assert_eq!(g, r, "request {i} of {n} differs from its run alone: {method:?} k={k}");
        }
        let padding = engine.stats.padding;
        assert!(padding.steps > 0, "{method:?} k={k}: no step was padded");
        assert!(padding.padded_rows > padding.real_rows, "{method:?} k={k}: {n} requests never ran padded rows: {padding:?}");
        if method != SpecMethod::None {
            assert!(engine.stats.spec.accepted > 0, "{method:?} k={k}: no draft accepted, so padded verify rows went untested");
        }
        eprintln!("{n} requests {method:?} k={k}: equal; padding {padding:?}");
    }
}

/// The MTP drafter's forwards are padded too (a catch-up's rows of 1..k+1 tokens to rows x m
/// tokens, a chained draft's rows to a row size): the same drafts as the unpadded drafter, so
/// the same accepted and drafted counts and the same text. A padded drafter row writing a live
/// sequence's KV block would change that sequence's later drafts.
#[test]
fn padded_mtp_drafter_forwards_draft_what_the_unpadded_drafter_drafts() {
    let prompts = code_prompts(17);
    for k in [1, 3] {
        let (padded, padded_engine) = run_padded(&prompts, SpecMethod::Mtp, k);
        let s = &padded_engine.stats.spec;
        let padded_counts = (s.accepted, s.drafted, s.draft_steps);
        let (_, model) = default_model();
        let config = EngineConfig { max_num_seqs: 64, max_num_batched_tokens: 1024, spec: SpecMethod::Mtp, spec_tokens: k, ..EngineConfig::default() };
        let mut e = engine(model, config);
        assert!(e.capture_sizes().is_empty(), "the CPU pads nothing unless told to");
        let requests = prompts.iter().enumerate().map(|(i, p)| request(p, max_tokens(i), sampling(i), None)).collect();
        let unpadded = run_staggered(&mut e, requests, &vec![0; prompts.len()]);
        let counts = (e.stats.spec.accepted, e.stats.spec.drafted, e.stats.spec.draft_steps);
        assert!(counts.0 > 0, "k={k}: no draft accepted");
        assert_eq!(padded_counts, counts, "k={k}: padded drafter forwards drafted differently (accepted, drafted, draft steps)");
        assert_eq!(padded, unpadded, "k={k}");
    }
}

/// A full batch (every sequence slot in use) verifying drafts: its padded tokens ride on one
/// padded row past the batch (capture size max_num_seqs + 1), so every generate step after the
/// one prefill step runs at a capture size, and the text is each request's alone.
#[test]
fn a_full_batch_of_verify_rows_runs_at_a_capture_size() {
    let prompts = code_prompts(8);
    let refs = references(&prompts);
    for method in [SpecMethod::Ngram, SpecMethod::Mtp] {
        let (_, model) = default_model();
        let config = EngineConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 1024,
            spec: method,
            spec_tokens: 3,
            cuda_graph_sizes: Some(CaptureSizes::default_up_to(8)),
            spec_backoff: false,
            ..EngineConfig::default()
        };
        let mut e = engine(model, config);
        assert_eq!(e.capture_sizes().sizes(), &[1, 2, 4, 8, 9]);
        let requests = prompts.iter().enumerate().map(|(i, p)| request(p, max_tokens(i), sampling(i), None)).collect();
        let got = run_staggered(&mut e, requests, &[0; 8]);
        assert_eq!(got, refs, "{method:?}");
        // Verify rows ran: drafts were offered (whether the model then accepts them on these
        // short replies depends on the model, not on the padding).
        assert!(e.stats.spec.drafted > 0, "{method:?}: nothing drafted");
        // The first step prefills every prompt; each later one is padded to a capture size.
        assert_eq!(e.stats.padding.steps, e.stats.steps - 1, "{method:?}: {:?}", e.stats.padding);
    }
}

#[test]
fn seventeen_decodes_run_as_twenty_four_rows() {
    let prompts = code_prompts(17);
    let (_, engine) = run_padded(&prompts, SpecMethod::None, 1);
    let padding = engine.stats.padding;
    // The first decode step has all 17 requests: 24 rows, 7 of them padding.
    assert!(padding.padded_rows >= 24 && padding.padded_rows - padding.real_rows >= 7, "{padding:?}");
    assert_eq!(engine.capture_sizes().sizes(), &[1, 2, 4, 8, 16, 24, 32, 48, 64]);
}

#[test]
fn capture_sizes_are_capped_by_the_largest_batch_and_off_without_graphs() {
    let (_, model) = default_model();
    let e = engine(model, EngineConfig { max_num_seqs: 20, cuda_graph_sizes: Some(CaptureSizes::default_up_to(64)), max_cuda_graph_size: Some(16), ..EngineConfig::default() });
    assert_eq!(e.capture_sizes().sizes(), &[1, 2, 4, 8, 16]);
    let (_, model) = e.into_parts();
    // The CPU backend does not replay graphs: no padding unless sizes are given.
    let e = engine(model, EngineConfig { max_num_seqs: 20, ..EngineConfig::default() });
    assert!(e.capture_sizes().is_empty());
    assert!(e.graph_capture.is_none());
    let (_, model) = e.into_parts();
    let e = engine(model, EngineConfig { cuda_graphs: false, cuda_graph_sizes: Some(CaptureSizes::default_up_to(8)), ..EngineConfig::default() });
    assert!(e.capture_sizes().is_empty());
    let (backend, model) = e.into_parts();
    let err = Engine::new(backend, model, EngineConfig { max_cuda_graph_size: Some(0), ..EngineConfig::default() }).err().expect("a zero size is refused");
    assert!(err.to_string().contains("max_cuda_graph_size"), "{err}");
}
