//! The engine worker thread that the server and the TUI share: batched requests give the same
//! tokens as one at a time, cancelling or dropping a request frees its cache, a refused request
//! leaves the worker serving, and a failed start is reported.

mod common;

use common::*;
use kestrel::engine::request::{FinishReason, Request, SpecMethod};
use kestrel::backend::sampling::SamplingParams;
use kestrel::engine::{EngineConfig, EngineError};
use kestrel::engine::worker::{EngineHandle, EngineWorker, Generation, GenerationEvent, WorkerError};
use std::time::{Duration, Instant};

const MODEL: &str = "qwen35-dense";

fn start_worker(max_num_seqs: usize, spec: SpecMethod) -> EngineWorker {
    EngineWorker::spawn(move || {
        let (_, model) = load_model(&fixture_dir(MODEL));
        Ok::<_, String>(engine(model, EngineConfig { max_num_seqs, spec, spec_tokens: 3, ..EngineConfig::default() }))
    })
    .expect("the worker starts")
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (seed * 97 + i * 31 + i * i) % 500 + 3).collect()
}

/// Waits for the next event, at most 60 s.
fn next_event(generation: &mut Generation) -> GenerationEvent {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match generation.try_next() {
            Ok(Some(event)) => return event,
            Ok(None) => {
                assert!(Instant::now() < deadline, "no event within 60 s");
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(err) => panic!("the worker stopped: {err}"),
        }
    }
}

/// Runs a generation to its end; returns the tokens streamed and the finish reason.
fn collect(generation: &mut Generation) -> (Vec<u32>, FinishReason) {
    let mut tokens = Vec::new();
    loop {
        match next_event(generation) {
            GenerationEvent::Accepted => {}
            GenerationEvent::Rejected(err) => panic!("refused: {err}"),
            GenerationEvent::Failed { error, .. } => panic!("failed: {error}"),
            GenerationEvent::Tokens { tokens: new, .. } => tokens.extend(new),
            GenerationEvent::Finished { reason, summary } => {
                assert_eq!(summary.generated, tokens, "the summary holds exactly the streamed tokens");
                return (tokens, reason);
            }
        }
    }
}

fn wait_idle(handle: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = handle.snapshot();
        if s.running == 0 && s.waiting == 0 && s.kv_blocks_used == 0 && s.state_slots_used == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "the engine did not go idle: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn concurrent_requests_share_the_batch_and_match_requests_run_alone() {
    let worker = start_worker(8, SpecMethod::Ngram);
    let handle = worker.handle();
    let params = |i: usize| if i.is_multiple_of(2) { SamplingParams::greedy() } else { SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 7 + i as u64, ..SamplingParams::greedy() } };
    let requests: Vec<Request> = (0..6).map(|i| request(&prompt(i as u32, 5 + 13 * i), 24 + i, params(i), None)).collect();
    let alone: Vec<Vec<u32>> = requests.iter().map(|r| generate_alone(Some(&fixture_dir(MODEL)), &r.prompt_ids, r.max_tokens, r.params.clone())).collect();

    let generations: Vec<Generation> = requests.into_iter().map(|r| handle.submit(r).expect("submitted")).collect();
    // Watch the batch from another thread while the requests run.
    let watcher = {
        let handle = handle.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            let deadline = Instant::now() + Duration::from_secs(60);
            while handle.snapshot().requests_finished < 6 && Instant::now() < deadline {
                peak = peak.max(handle.snapshot().running);
                std::thread::sleep(Duration::from_millis(1));
            }
            peak
        })
    };
    let outputs: Vec<(Vec<u32>, FinishReason)> = generations.into_iter().map(|mut g| collect(&mut g)).collect();
    let peak_running = watcher.join().expect("the watcher ends");
    for (i, ((tokens, reason), expected)) in outputs.iter().zip(&alone).enumerate() {
        assert_eq!(tokens, expected, "request {i} differs when batched");
        assert_eq!(*reason, FinishReason::Length);
    }
    assert!(peak_running >= 2, "the requests never shared a batch");
    wait_idle(&handle);
    let snapshot = handle.snapshot();
    assert_eq!(snapshot.requests_accepted, 6);
    assert_eq!(snapshot.requests_finished, 6);
    assert_eq!(snapshot.generated_tokens, alone.iter().map(|t| t.len() as u64).sum::<u64>());
    assert!(snapshot.spec.forwards > 0 && snapshot.alive);
}

#[test]
fn cancel_and_drop_free_the_cache_and_the_worker_keeps_serving() {
    let worker = start_worker(4, SpecMethod::None);
    let handle = worker.handle();

    let mut cancelled = handle.submit(request(&prompt(1, 40), 2000, SamplingParams::greedy(), None)).expect("submitted");
    assert!(matches!(next_event(&mut cancelled), GenerationEvent::Accepted));
    assert!(matches!(next_event(&mut cancelled), GenerationEvent::Tokens { .. }));
    cancelled.cancel();
    let reason = loop {
        if let GenerationEvent::Finished { reason, .. } = next_event(&mut cancelled) {
            break reason;
        }
    };
    assert_eq!(reason, FinishReason::Abort);
    wait_idle(&handle);

    let mut dropped = handle.submit(request(&prompt(2, 40), 2000, SamplingParams::greedy(), None)).expect("submitted");
    assert!(matches!(next_event(&mut dropped), GenerationEvent::Accepted));
    drop(dropped);
    wait_idle(&handle);
    assert_eq!(handle.snapshot().requests_cancelled, 2);
    assert!(handle.snapshot().generated_tokens < 4000, "the cancelled requests ran to the end");

    let mut refused = handle.submit(Request::new(Vec::new(), SamplingParams::greedy(), 4, Vec::new())).expect("submitted");
    assert!(matches!(next_event(&mut refused), GenerationEvent::Rejected(EngineError::EmptyPrompt)));
    let mut too_long = handle.submit(request(&prompt(3, 10), 1_000_000, SamplingParams::greedy(), None)).expect("submitted");
    assert!(matches!(next_event(&mut too_long), GenerationEvent::Rejected(EngineError::ContextExceeded { .. })));
    assert_eq!(handle.snapshot().requests_rejected, 2);

    let mut after = handle.submit(request(&prompt(4, 8), 5, SamplingParams::greedy(), None)).expect("submitted");
    let (tokens, reason) = collect(&mut after);
    assert_eq!((tokens.len(), reason), (5, FinishReason::Length));

    worker.shutdown();
    assert!(!handle.snapshot().alive, "the snapshot says the worker is gone");
    assert!(matches!(handle.submit(request(&prompt(5, 4), 2, SamplingParams::greedy(), None)), Err(WorkerError::Stopped)));
}

#[test]
fn a_failed_start_is_reported() {
    let result = EngineWorker::spawn(|| {
        let (_, model) = load_model(&fixture_dir(MODEL));
        kestrel::engine::Engine::new(kestrel::backend::cpu::CpuBackend::new().with_f32_activations(), model, EngineConfig { max_num_seqs: 0, ..EngineConfig::default() })
    });
    match result {
        Err(WorkerError::Startup(message)) => assert!(message.contains("max_num_seqs"), "{message}"),
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("an engine without sequences started"),
    }
}
