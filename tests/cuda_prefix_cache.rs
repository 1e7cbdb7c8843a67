//! Prefix caching on the GPU changes speed, never text (DESIGN Invariant 5).
//!
//! The CPU tests (engine_prefix_cache.rs) again on the CUDA backend, with decode steps replayed
//! as CUDA graphs: multi-turn conversations, conversations side by side, a prefix shared by
//! several running requests, preemption while a cached prefix is shared, checkpoints evicted
//! under a small budget and a cached prefix whose blocks were freed and reused, each with and
//! without the cache, speculation none, ngram and MTP, greedy and seeded sampling (drawn on the
//! device, and filtered rows on the host). Plus the checkpoint copy ops against the CPU's.
//! Runs where a GPU is present.

mod common;
mod cuda_support;

use common::conversation::{humaneval_messages, run_batch, run_conversations, with_prefix, BatchRun, Conversation, Turn};
use common::request;
use cuda_support::*;
use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::cuda::CudaBackend;
use kestrel::backend::sampling::SamplingParams;
use kestrel::backend::{Backend, BatchLayout, RowKind, RowLayout, StateCheckpoint};
use kestrel::engine::cache::{checkpoint_position, PrefixCacheStats};
use kestrel::engine::request::{Request, SpecMethod};
use kestrel::engine::{Engine, EngineConfig};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::ModelFiles;

const METHODS: [SpecMethod; 3] = [SpecMethod::None, SpecMethod::Ngram, SpecMethod::Mtp];

fn draws() -> [SamplingParams; 3] {
    [
        SamplingParams::greedy(),
        // Temperature only: drawn by the device kernel.
        SamplingParams { temperature: 0.8, seed: 77, ..SamplingParams::greedy() },
        // Top-k and top-p: drawn by the host sampler from the copied row.
        SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 78, ..SamplingParams::greedy() },
    ]
}

fn config(max_batch: usize, token_budget: usize, checkpoints: usize) -> EngineConfig {
    EngineConfig { max_num_seqs: max_batch, max_num_batched_tokens: token_budget, spec_tokens: 4, prefix_cache_checkpoints: checkpoints, ..EngineConfig::default() }
}

fn outputs(turns: &[Vec<Turn>]) -> Vec<Vec<Vec<u32>>> {
    turns.iter().map(|c| c.iter().map(|t| t.output.clone()).collect()).collect()
}

/// The GPU, the default model on it and its files; reused across engines.
struct Rig {
    parts: Option<(CudaBackend, Qwen35<CudaBackend>)>,
    files: ModelFiles,
}

impl Rig {
    fn new() -> Option<Rig> {
        let gpu = gpu()?;
        let files = ModelFiles::open(None).expect("embedded model opens");
        let model = Qwen35::load(&gpu, files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
        Some(Rig { parts: Some((gpu, model)), files })
    }

    /// Runs `work` on a fresh engine with `config`; returns its result and the engine's
    /// prefix-cache counters and preemptions.
    fn with_engine<T>(&mut self, config: EngineConfig, work: impl FnOnce(&mut Engine<CudaBackend>) -> T) -> (T, Option<PrefixCacheStats>, u64) {
        let (gpu, model) = self.parts.take().expect("parts are returned after every run");
        let mut engine = Engine::new(gpu, model, config).expect("engine starts");
        let out = work(&mut engine);
        let (stats, preemptions) = (engine.prefix_cache_stats(), engine.preemptions());
        self.parts = Some(engine.into_parts());
        (out, stats, preemptions)
    }

    fn messages(&self, first: usize, count: usize, max_len: usize) -> Vec<Vec<u32>> {
        humaneval_messages(&self.files.tokenizer, first, count, max_len)
    }
}

#[test]
fn conversations_on_the_gpu_give_the_same_turns_with_and_without_the_cache() {
    let Some(mut rig) = Rig::new() else { return };
    let messages = rig.messages(0, 6, 200);
    for spec in METHODS {
        for params in draws() {
            let conversation = [Conversation { messages: messages.clone(), max_tokens: 32, spec, params: params.clone() }];
            let (want, _, _) = rig.with_engine(config(1, 512, 0), |e| run_conversations(e, &conversation, 0));
            let (got, stats, _) = rig.with_engine(config(1, 512, 16), |e| run_conversations(e, &conversation, 0));
            let what = format!("{spec:?} {params:?}");
            assert_eq!(outputs(&got), outputs(&want), "{what}: the cache changed the text");
            let turns = &got[0];
            for t in 1..turns.len() {
                assert_eq!(turns[t].cached_tokens, checkpoint_position(turns[t - 1].prompt_len), "{what}: turn {t}");
                assert!(turns[t].cached_tokens > 0, "{what}: turn {t} missed the cache");
            }
            assert_eq!(stats.expect("the cache is on").hits, turns.len() as u64 - 1, "{what}");
        }
    }
    // Side by side, rows of several conversations in one step, one of them a branch of another.
    let a = rig.messages(10, 4, 150);
    let b = rig.messages(20, 4, 150);
    let mut branch = a[..1].to_vec();
    branch.extend(rig.messages(30, 3, 150));
    for params in draws() {
        let conversations: Vec<Conversation> = [a.clone(), b.clone(), branch.clone()]
            .into_iter()
            .zip(METHODS.iter().rev())
            .map(|(messages, &spec)| Conversation { messages, max_tokens: 24, spec, params: params.clone() })
            .collect();
        let (want, _, _) = rig.with_engine(config(3, 96, 0), |e| run_conversations(e, &conversations, 2));
        let (got, _, _) = rig.with_engine(config(3, 96, 32), |e| run_conversations(e, &conversations, 2));
        assert_eq!(outputs(&got), outputs(&want), "side by side, {params:?}");
        assert!(got.iter().all(|turns| turns[1..].iter().all(|t| t.cached_tokens > 0)), "a later turn missed the cache: {got:?}");
        assert!(got[2][0].cached_tokens > 0, "the branch's first turn did not reuse the shared first message");
    }
}

#[test]
fn a_prefix_shared_by_several_running_requests_on_the_gpu() {
    let Some(mut rig) = Rig::new() else { return };
    let prefix: Vec<u32> = rig.messages(40, 4, 200).concat();
    let prompts = with_prefix(&prefix, rig.messages(50, 8, 16));
    for spec in METHODS {
        for params in draws() {
            let requests = |ps: &[Vec<u32>]| ps.iter().map(|p| request(p, 40, params.clone(), Some(spec))).collect::<Vec<Request>>();
            let run = |e: &mut Engine<CudaBackend>| {
                let first: BatchRun = run_batch(e, requests(&prompts[..1]));
                let rest = run_batch(e, requests(&prompts[1..]));
                (first.outputs.into_iter().chain(rest.outputs).collect::<Vec<_>>(), rest.peak_shared_blocks)
            };
            let ((want, _), _, _) = rig.with_engine(config(8, 128, 0), run);
            let ((got, peak_shared), _, _) = rig.with_engine(config(8, 128, 16), run);
            let what = format!("{spec:?} {params:?}");
            let tokens = |v: &[(Vec<u32>, usize)]| v.iter().map(|(t, _)| t.clone()).collect::<Vec<_>>();
            assert_eq!(tokens(&got), tokens(&want), "{what}");
            let last = checkpoint_position(prompts[0].len());
            let shared = (1..).map(|k| 128 * k).take_while(|&p| p < last).chain([last]).filter(|&p| p < prefix.len()).max().expect("a long prefix");
            assert!(got[1..].iter().all(|(_, cached)| *cached >= shared), "{what}: a request resumed before {shared}: {:?}", got.iter().map(|g| g.1).collect::<Vec<_>>());
            assert!(peak_shared >= shared / 16, "{what}: at most {peak_shared} blocks were held by several requests at once");
        }
    }
}

#[test]
fn preemption_on_the_gpu_while_a_cached_prefix_is_shared() {
    let Some(mut rig) = Rig::new() else { return };
    let prefix: Vec<u32> = rig.messages(60, 2, 120).concat();
    let prompts = with_prefix(&prefix, rig.messages(70, 12, 16));
    for spec in METHODS {
        for params in draws() {
            let run = |e: &mut Engine<CudaBackend>| {
                let requests = prompts.iter().map(|p| request(p, 32, params.clone(), Some(spec))).collect();
                let arrivals: Vec<usize> = (0..prompts.len()).map(|i| 2 * i).collect();
                common::run_staggered(e, requests, &arrivals)
            };
            // 32 blocks of 16 tokens: one request takes about 19, and even sharing the prefix's
            // 15, a few of them fill the pool (48 was not enough once the prefix was shared).
            let (want, _, _) = rig.with_engine(EngineConfig { num_blocks: 32, ..config(12, 96, 0) }, run);
            let (got, stats, preemptions) = rig.with_engine(EngineConfig { num_blocks: 32, ..config(12, 96, 8) }, run);
            let what = format!("{spec:?} {params:?}");
            assert_eq!(got, want, "{what}");
            assert!(preemptions > 0, "{what}: the pool was meant to force preemption");
            assert!(stats.expect("the cache is on").hits > 0, "{what}: no request resumed from the shared prefix");
        }
    }
}

#[test]
fn checkpoints_on_the_gpu_are_evicted_under_a_small_budget_and_the_text_stays() {
    let Some(mut rig) = Rig::new() else { return };
    let tail = rig.messages(90, 1, 60).remove(0);
    for params in draws() {
        let conversation = |first: usize, spec: SpecMethod| Conversation { messages: rig.messages(first, 2, 200), max_tokens: 24, spec, params: params.clone() };
        let (a, b) = (conversation(80, SpecMethod::Mtp), conversation(85, SpecMethod::Ngram));
        let run = |e: &mut Engine<CudaBackend>| {
            let a_turns = run_conversations(e, std::slice::from_ref(&a), 0);
            let b_turns = run_conversations(e, std::slice::from_ref(&b), 0);
            let mut history: Vec<u32> = Vec::new();
            for (message, turn) in a.messages.iter().zip(&a_turns[0]) {
                history.extend_from_slice(message);
                history.extend_from_slice(&turn.output);
            }
            history.extend_from_slice(&tail);
            let last = run_batch(e, vec![request(&history, 24, params.clone(), Some(SpecMethod::Mtp))]).outputs.remove(0);
            (a_turns, b_turns, last)
        };
        let ((a_want, b_want, last_want), _, _) = rig.with_engine(config(1, 96, 0), run);
        let ((a_got, b_got, last_got), stats, _) = rig.with_engine(config(1, 96, 2), run);
        let what = format!("{params:?}");
        assert_eq!((outputs(&a_got), outputs(&b_got), &last_got.0), (outputs(&a_want), outputs(&b_want), &last_want.0), "{what}");
        let stats = stats.expect("the cache is on");
        assert!(stats.evicted_checkpoints > 0 && stats.checkpoints == 2, "{what}: {stats:?}");
        for turns in [&a_got[0], &b_got[0]] {
            assert_eq!(turns[1].cached_tokens, checkpoint_position(turns[0].prompt_len), "{what}: {turns:?}");
        }
        assert_eq!(last_got.1, 0, "{what}: a's checkpoints were evicted by b's");
    }
}

#[test]
fn a_cached_prefix_on_the_gpu_whose_blocks_were_freed_and_reused_is_not_hit() {
    let Some(mut rig) = Rig::new() else { return };
    let text = rig.messages(100, 12, 1000).concat();
    let (a, b) = (text[..300].to_vec(), text[300..900].to_vec());
    let one = |e: &mut Engine<CudaBackend>, p: &[u32]| run_batch(e, vec![request(p, 8, SamplingParams::greedy(), Some(SpecMethod::None))]).outputs.remove(0);
    let (runs, stats, _) = rig.with_engine(EngineConfig { num_blocks: 40, ..config(1, 512, 8) }, |e| {
        let first = one(e, &a);
        let again = one(e, &a);
        one(e, &b);
        let after = one(e, &a);
        (first, again, after)
    });
    let (first, again, after) = runs;
    assert_eq!(first.1, 0);
    assert_eq!((&again.0, again.1), (&first.0, checkpoint_position(a.len())), "freed but kept: found again");
    assert_eq!(after.1, 0, "a's blocks were reused by b: nothing of them may be hit");
    assert_eq!(after.0, first.0);
    assert_eq!(stats.expect("the cache is on").hits, 1);
}

/// The checkpoint ops move whole states: a state saved from one slot and restored into another
/// is that state, on the device as on the CPU, and the checkpoint holds it in the CPU's layout
/// once copied back.
#[test]
fn checkpoint_copies_on_the_gpu_match_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let files = ModelFiles::open(None).expect("embedded model opens");
    let cpu = CpuBackend::new();
    let on_gpu = Qwen35::load(&gpu, files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
    let on_cpu = Qwen35::load(&cpu, files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
    let ids: Vec<u32> = humaneval_messages(&files.tokenizer, 3, 1, 128).remove(0);
    let mut spec = on_gpu.cache_spec(16, 16, 3, 0);
    spec.checkpoint_slots = 2;
    let mut gpu_cache = gpu.alloc_cache(&spec).expect("cache");
    let mut cpu_cache = cpu.alloc_cache(&spec).expect("cache");
    let layout = BatchLayout { rows: vec![RowLayout { kind: RowKind::Prefill, token_start: 0, num_tokens: ids.len(), start_position: 0, block_table: (0..16).collect(), state_slot: 0, snapshot_base: 0 }] };
    gpu.reset_states(&mut gpu_cache, &[0, 1, 2]);
    cpu.reset_states(&mut cpu_cache, &[0, 1, 2]);
    let last = [ids.len() as u32 - 1];
    on_gpu.forward(&gpu, &ids, &layout, &last, &mut gpu_cache);
    on_cpu.forward(&cpu, &ids, &layout, &last, &mut cpu_cache);
    gpu.save_checkpoints(&mut gpu_cache, &[StateCheckpoint { slot: 0, checkpoint: 1 }]);
    gpu.restore_checkpoints(&mut gpu_cache, &[StateCheckpoint { slot: 2, checkpoint: 1 }]);
    cpu.save_checkpoints(&mut cpu_cache, &[StateCheckpoint { slot: 0, checkpoint: 1 }]);
    cpu.restore_checkpoints(&mut cpu_cache, &[StateCheckpoint { slot: 2, checkpoint: 1 }]);
    let host = gpu.cache_to_host(&gpu_cache);
    let (conv, rec) = (spec.linear.conv_state_len(), spec.linear.recurrent_state_len());
    for layer in 0..spec.linear_layers {
        assert_eq!(host.conv[layer][2 * conv..3 * conv], host.conv[layer][..conv], "layer {layer}: conv window restored");
        assert_eq!(host.rec[layer][2 * rec..3 * rec], host.rec[layer][..rec], "layer {layer}: delta-rule state restored");
        assert!(host.rec[layer][..rec].iter().any(|&x| x != 0.0), "layer {layer}: the prefill left a state");
        assert_eq!(cpu_cache.conv[layer][2 * conv..3 * conv], cpu_cache.conv[layer][..conv]);
        assert_eq!(cpu_cache.rec[layer][2 * rec..3 * rec], cpu_cache.rec[layer][..rec]);
    }
    assert_eq!(host.checkpoints[1], cpu_cache_checkpoint_of(&host, 0), "the device checkpoint holds slot 0's state");
    assert_eq!(cpu_cache.checkpoints[1], cpu_cache_checkpoint_of(&cpu_cache, 0));
}

/// Slot `slot`'s state in the layout a checkpoint keeps: every layer's conv window, then its
/// delta-rule state.
fn cpu_cache_checkpoint_of(cache: &kestrel::backend::cpu::CpuCache, slot: usize) -> Vec<f32> {
    let (conv, rec) = (cache.spec.linear.conv_state_len(), cache.spec.linear.recurrent_state_len());
    let mut out = Vec::new();
    for layer in 0..cache.spec.linear_layers {
        out.extend_from_slice(&cache.conv[layer][slot * conv..][..conv]);
        out.extend_from_slice(&cache.rec[layer][slot * rec..][..rec]);
    }
    out
}
