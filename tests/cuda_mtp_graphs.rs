//! The MTP drafter's forwards replayed as CUDA graphs (padded to capture sizes): the drafts are
//! exactly the eager drafter's, and the text is exactly `--spec none`'s. Runs where a GPU is
//! present.

mod common;
mod cuda_support;

use common::conversation::humaneval_tokens;
use common::mtp_rounds::{draft_round, DraftSeq};
use common::{request, run_staggered};
use cuda_support::*;
use kestrel::backend::sampling::SamplingParams;
use kestrel::backend::{Backend, StepLimits};
use kestrel::engine::graphed::{startup_shapes, GraphPadding};
use kestrel::engine::padding::{CaptureSizes, PadLimits, Scratch};
use kestrel::engine::request::SpecMethod;
use kestrel::engine::spec::mtp::capture_mtp_at_startup;
use kestrel::engine::{Engine, EngineConfig};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::ModelFiles;

const BLOCK_SIZE: usize = 16;
/// Blocks per sequence: room for its prompt, the rounds' tokens and k chained drafts.
const BLOCKS_EACH: usize = 12;

/// Drafts of 1, 3 and 17 sequences at k = 1, 3 and 8, whose catch-ups commit 1..k+1 tokens
/// per row (every row count and token mix pads to a capture size), each round against the
/// eager drafter on a cache of its own: equal, token for token. The graphed drafter chains its
/// forwards on the device (each forward's ids the argmax of the one before, one read-back per
/// proposal), the eager one reads every draft back before the next forward. A padded row that
/// wrote a live block (or skipped the cut back to the real rows), or a chained forward that
/// read the wrong ids or hidden rows, would change the drafts.
#[test]
fn graphed_mtp_drafts_equal_the_eager_drafters() {
    let Some(gpu) = gpu() else { return };
    let files = ModelFiles::open(None).expect("embedded model opens");
    let model = Qwen35::load(&gpu, files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
    let text = humaneval_tokens(&files.tokenizer);
    let max_seqs = 17;
    let num_blocks = max_seqs * BLOCKS_EACH;
    let scratch = Scratch::after(num_blocks, max_seqs);
    let spec = model.cache_spec(num_blocks + Scratch::BLOCKS, BLOCK_SIZE, max_seqs + Scratch::STATE_SLOTS, 64);
    let mut eager_cache = gpu.alloc_cache(&spec).expect("cache");
    let mut graphed_cache = gpu.alloc_cache(&spec).expect("cache");
    let limits = StepLimits { max_tokens: 1024, max_rows: 64, max_blocks_per_row: BLOCKS_EACH };
    gpu.reserve_step_inputs(limits).expect("step inputs");
    let mut rng = Rng::new(37);
    let mut drafted = 0;
    for k in [1, 3, 8] {
        let padding = GraphPadding { sizes: CaptureSizes::default_up_to(32), scratch, limits: PadLimits { max_tokens: 1024, max_blocks_per_row: BLOCKS_EACH, block_size: BLOCK_SIZE }, k };
        // The drafter's graphs of every capture shape, as at an engine's start-up.
        let captured = capture_mtp_at_startup(&model, &gpu, &mut graphed_cache, &padding, &startup_shapes(&padding, true), &indicatif::ProgressBar::hidden());
        let graphs = gpu.captured_graphs();
        assert!(captured > 0 && graphs >= captured, "k={k}: {captured} drafter graphs captured, {graphs} in the backend");
        for n in [1, 3, 17] {
            let slots: Vec<usize> = (0..n).collect();
            gpu.reset_states(&mut eager_cache, &slots);
            gpu.reset_states(&mut graphed_cache, &slots);
            let mut seqs: Vec<DraftSeq> = (0..n).map(|i| DraftSeq { text: text[i * 173..i * 173 + 200].to_vec(), len: 0, table: (0..BLOCKS_EACH as u32).map(|b| (i * BLOCKS_EACH) as u32 + b).collect(), slot: i }).collect();
            for round in 0..12 {
                // The prompt first (a long catch-up, eager both ways), then 1..k+1 tokens a row.
                let pieces: Vec<(usize, usize)> = (0..n).map(|s| (s, if round == 0 { 20 + 3 * s } else { 1 + rng.below(k + 1) })).collect();
                let eager = draft_round(&gpu, &model, &mut eager_cache, &seqs, &pieces, k, None);
                let graphed = draft_round(&gpu, &model, &mut graphed_cache, &seqs, &pieces, k, Some(&padding));
                assert_eq!(graphed, eager, "k={k}, {n} sequences, round {round} ({pieces:?}): graphed drafts differ from the eager drafter's");
                assert!(eager.iter().all(|d| d.len() == k), "k={k}, {n} sequences, round {round}: a sequence drafted fewer than k ({eager:?})");
                drafted += eager.iter().map(Vec::len).sum::<usize>();
                for (s, count) in pieces {
                    seqs[s].len += count;
                }
            }
        }
        // Every shape was captured ahead: no forward added a graph.
        assert_eq!(gpu.captured_graphs(), graphs, "k={k}: a drafter forward was captured at a shape outside the start-up ones");
    }
    assert!(drafted > 0, "nothing drafted");
    eprintln!("{drafted} drafts equal, {} drafter graphs", gpu.captured_graphs());
}

/// The engine with MTP at k 1, 3 and 8, batches of 1, 3 and 17 sequences (padded to 1, 4 and
/// 24 rows): graphs on (the drafter's captured at start-up) against graphs off, the same
/// drafts (so the same accepted and drafted counts), and every request's text equal to its
/// run alone, eager, with `--spec none`.
#[test]
fn mtp_with_drafter_graphs_drafts_as_eager_and_writes_what_none_writes() {
    let Some(gpu) = gpu() else { return };
    let files = ModelFiles::open(None).expect("embedded model opens");
    let model = Qwen35::load(&gpu, files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
    let text = humaneval_tokens(&files.tokenizer);
    let prompts: Vec<Vec<u32>> = (0..17).map(|i| text[i * 211..i * 211 + 5 + (i * 13) % 60].to_vec()).collect();
    let max_tokens = |i: usize| 24 + (i * 7) % 40;
    let greedy = SamplingParams::greedy();
    let mut parts = Some((gpu, model));
    let refs: Vec<Vec<u32>> = (0..prompts.len())
        .map(|i| {
            let config = EngineConfig { max_num_seqs: 1, cuda_graphs: false, ..EngineConfig::default() };
            let (gpu, model) = parts.take().expect("parts");
            let mut engine = Engine::new(gpu, model, config).expect("engine starts");
            let out = run_staggered(&mut engine, vec![request(&prompts[i], max_tokens(i), greedy.clone(), Some(SpecMethod::None))], &[0]);
            parts = Some(engine.into_parts());
            out.into_iter().next().expect("one request")
        })
        .collect();
    let mut run = |n: usize, config: EngineConfig, method: SpecMethod| {
        let (gpu, model) = parts.take().expect("parts are returned after every run");
        let mut engine = Engine::new(gpu, model, config).expect("engine starts");
        let drafter_graphs = engine.graph_capture.as_ref().map_or(0, |r| r.drafter_graphs);
        let requests = prompts[..n].iter().enumerate().map(|(i, p)| request(p, max_tokens(i), greedy.clone(), Some(method))).collect();
        let out = run_staggered(&mut engine, requests, &vec![0; n]);
        let s = &engine.stats.spec;
        let counts = [s.accepted, s.drafted, s.draft_steps];
        parts = Some(engine.into_parts());
        (out, counts, drafter_graphs)
    };
    for k in [1, 3, 8] {
        for n in [1, 3, 17] {
            let config = |graphs: bool| EngineConfig { max_num_seqs: 32, max_num_batched_tokens: 1024, spec: SpecMethod::Mtp, spec_tokens: k, cuda_graphs: graphs, ..EngineConfig::default() };
            let (eager, eager_counts, _) = run(n, config(false), SpecMethod::Mtp);
            let (graphed, graphed_counts, drafter_graphs) = run(n, config(true), SpecMethod::Mtp);
            assert!(drafter_graphs > 0, "k={k} n={n}: no drafter graph captured at start-up");
            assert_eq!(graphed_counts, eager_counts, "k={k} n={n}: graphed drafting drafted or accepted differently (accepted, drafted, draft steps)");
            assert!(graphed_counts[0] > 0, "k={k} n={n}: no draft accepted");
            for (i, (g, r)) in graphed.iter().zip(&refs).enumerate() {
                assert_eq!(g, r, "k={k} n={n}: request {i} differs from its run alone without speculation");
            }
            assert_eq!(eager, graphed, "k={k} n={n}");
            eprintln!("k={k} n={n}: {drafter_graphs} drafter graphs, (accepted, drafted, steps) {graphed_counts:?} both ways");
        }
    }
}
