//! Prefix caching changes speed, never text (DESIGN Invariant 5), on the CPU engine.
//!
//! Every workload runs twice on the embedded default model, with the prefix cache and without,
//! and must give bitwise the same tokens: multi-turn conversations, conversations side by side
//! with their rows mixed in one step, a prefix shared by several running requests, preemption
//! while a cached prefix is shared, checkpoints evicted under a small budget, and a cached
//! prefix whose blocks were freed and reused. Speculation none, ngram and MTP; greedy and
//! seeded sampling. Cache hits are asserted where the workload must have them.

mod common;

use common::conversation::{humaneval_messages, run_batch, run_conversations, with_prefix, Conversation, Turn};
use kestrel::engine::request::Request;
use common::{default_model, engine, request};
use kestrel::backend::sampling::SamplingParams;
use kestrel::engine::cache::checkpoint_position;
use kestrel::engine::request::SpecMethod;
use kestrel::engine::{Engine, EngineConfig, EngineError};

const METHODS: [SpecMethod; 3] = [SpecMethod::None, SpecMethod::Ngram, SpecMethod::Mtp];

fn draws() -> [SamplingParams; 2] {
    [SamplingParams::greedy(), SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 77, ..SamplingParams::greedy() }]
}

fn config(max_batch: usize, token_budget: usize, checkpoints: usize) -> EngineConfig {
    EngineConfig { max_num_seqs: max_batch, max_num_batched_tokens: token_budget, spec_tokens: 4, prefix_cache_checkpoints: checkpoints, ..EngineConfig::default() }
}

fn cpu_engine(config: EngineConfig) -> Engine<kestrel::backend::cpu::CpuBackend> {
    engine(default_model().1, config)
}

fn outputs(turns: &[Vec<Turn>]) -> Vec<Vec<Vec<u32>>> {
    turns.iter().map(|c| c.iter().map(|t| t.output.clone()).collect()).collect()
}

#[test]
fn a_conversation_gives_the_same_turns_with_and_without_the_cache() {
    let (files, _) = default_model();
    let messages = humaneval_messages(&files.tokenizer, 0, 5, 120);
    for spec in METHODS {
        for params in draws() {
            let conversation = [Conversation { messages: messages.clone(), max_tokens: 20, spec, params: params.clone() }];
            let mut plain = cpu_engine(config(1, 512, 0));
            let want = run_conversations(&mut plain, &conversation, 0);
            let mut cached = cpu_engine(config(1, 512, 16));
            let got = run_conversations(&mut cached, &conversation, 0);
            let what = format!("{spec:?} temperature {}", params.temperature);
            assert_eq!(outputs(&got), outputs(&want), "{what}: the cache changed the text");
            // Each turn resumes where the turn before stopped caching: its last multiple of 64.
            let turns = &got[0];
            assert_eq!(turns[0].cached_tokens, 0);
            for t in 1..turns.len() {
                assert_eq!(turns[t].cached_tokens, checkpoint_position(turns[t - 1].prompt_len), "{what}: turn {t}");
                assert!(turns[t].cached_tokens > 0, "{what}: turn {t} missed the cache");
            }
            // The same drafts, too: the cached MTP layer's KV is what the catch-up computes.
            assert_eq!(cached.stats.spec, plain.stats.spec, "{what}: speculation counters differ");
            assert!(plain.prefix_cache_stats().is_none());
            let stats = cached.prefix_cache_stats().expect("the cache is on");
            assert_eq!(stats.hits, turns.len() as u64 - 1);
        }
    }
}

#[test]
fn conversations_side_by_side_share_the_cache() {
    let (files, _) = default_model();
    let a = humaneval_messages(&files.tokenizer, 10, 3, 100);
    let b = humaneval_messages(&files.tokenizer, 20, 3, 100);
    // A branch of `a`: the same first message, then its own.
    let mut branch = a[..1].to_vec();
    branch.extend(humaneval_messages(&files.tokenizer, 30, 2, 100));
    for params in draws() {
        let conversations: Vec<Conversation> = [a.clone(), b.clone(), branch.clone()]
            .into_iter()
            .zip(METHODS.iter().rev())
            .map(|(messages, &spec)| Conversation { messages, max_tokens: 16, spec, params: params.clone() })
            .collect();
        // 96 tokens a step: prompt pieces share steps with verify rows of the others.
        let want = run_conversations(&mut cpu_engine(config(3, 96, 0)), &conversations, 2);
        let mut cached = cpu_engine(config(3, 96, 32));
        let got = run_conversations(&mut cached, &conversations, 2);
        assert_eq!(outputs(&got), outputs(&want), "temperature {}", params.temperature);
        for (c, turns) in got.iter().enumerate() {
            assert!(turns[1..].iter().all(|t| t.cached_tokens > 0), "conversation {c}: a later turn missed the cache: {turns:?}");
        }
        assert!(got[2][0].cached_tokens > 0, "the branch's first turn did not reuse the shared first message");
    }
}

/// A long shared beginning (a system prompt, say) and short different endings.
fn shared_prefix_prompts(n: usize) -> (Vec<u32>, Vec<Vec<u32>>) {
    let (files, _) = default_model();
    let prefix: Vec<u32> = humaneval_messages(&files.tokenizer, 40, 3, 100).concat();
    let prompts = with_prefix(&prefix, humaneval_messages(&files.tokenizer, 50, n, 12));
    (prefix, prompts)
}

/// Request `i` of a batch: speculation none, ngram and MTP in turn, so that one batch mixes them.
fn mixed(i: usize, p: &[u32], max_tokens: usize, params: &SamplingParams) -> Request {
    request(p, max_tokens, params.clone(), Some(METHODS[i % METHODS.len()]))
}

#[test]
fn a_prefix_shared_by_several_running_requests() {
    let (prefix, prompts) = shared_prefix_prompts(6);
    for params in draws() {
        let run = |checkpoints: usize| {
            // 128 tokens a step: the first request checkpoints every 128 tokens of the prefix.
            // The first request drafts with MTP, so its blocks hold the MTP layer's KV too and
            // serve every method (an MTP request takes only such blocks: see
            // cache::prefix's `mtp_requests_take_only_blocks_holding_draft_kv`).
            let method_of = |i: usize| mixed(i + 2, &prompts[i], 24, &params);
            let mut e = cpu_engine(config(8, 128, checkpoints));
            let first = run_batch(&mut e, vec![method_of(0)]);
            let rest = run_batch(&mut e, (1..prompts.len()).map(method_of).collect());
            (first.outputs.into_iter().chain(rest.outputs).collect::<Vec<_>>(), rest.peak_shared_blocks)
        };
        let (want, _) = run(0);
        let (got, peak_shared) = run(16);
        let what = format!("temperature {}", params.temperature);
        let tokens = |v: &[(Vec<u32>, usize)]| v.iter().map(|(t, _)| t.clone()).collect::<Vec<_>>();
        assert_eq!(tokens(&got), tokens(&want), "{what}");
        // The first request checkpointed at multiples of 128 and at its checkpoint position;
        // the others resume at the last of those inside the shared prefix (or later, where
        // their endings happen to begin alike).
        let last = checkpoint_position(prompts[0].len());
        let shared = (1..).map(|k| 128 * k).take_while(|&p| p < last).chain([last]).filter(|&p| p < prefix.len()).max().expect("a long prefix");
        for (i, (_, cached)) in got.iter().enumerate().skip(1) {
            assert!(*cached >= shared, "{what}: request {i} resumed at {cached}, before the end of the shared prefix ({shared})");
        }
        // They ran together on one copy of the prefix's blocks.
        assert!(peak_shared >= shared / 16, "{what}: at most {peak_shared} blocks were held by several requests at once");
    }
}

#[test]
fn preemption_while_a_cached_prefix_is_shared() {
    let (_, prompts) = shared_prefix_prompts(6);
    for params in draws() {
        let run = |checkpoints: usize| {
            // 26 blocks of 16 tokens: one of these requests takes 21, and even sharing their
            // prefix, six of them cannot run at once.
            let mut e = cpu_engine(EngineConfig { num_blocks: 26, ..config(6, 96, checkpoints) });
            let requests = prompts.iter().enumerate().map(|(i, p)| mixed(i, p, 20, &params)).collect();
            let arrivals: Vec<usize> = (0..prompts.len()).map(|i| 3 * i).collect();
            let out = common::run_staggered(&mut e, requests, &arrivals);
            (out, e.preemptions(), e.prefix_cache_stats())
        };
        let (want, _, _) = run(0);
        let (got, preemptions, stats) = run(8);
        let what = format!("temperature {}", params.temperature);
        assert_eq!(got, want, "{what}");
        let stats = stats.expect("the cache is on");
        assert!(preemptions > 0, "{what}: the pool was meant to force preemption");
        assert!(stats.hits > 0, "{what}: no request resumed from the shared prefix");
    }
}

#[test]
fn checkpoints_are_evicted_under_a_small_budget_and_the_text_stays() {
    let (files, _) = default_model();
    for params in draws() {
        let conversation = |first: usize, spec: SpecMethod| Conversation { messages: humaneval_messages(&files.tokenizer, first, 2, 150), max_tokens: 16, spec, params: params.clone() };
        let (a, b) = (conversation(80, SpecMethod::Mtp), conversation(85, SpecMethod::Ngram));
        // Two checkpoints, and prompt pieces of at most 96 tokens: each prompt checkpoints more
        // often than that, so the older ones are evicted as it goes.
        let run = |checkpoints: usize| {
            let mut e = cpu_engine(config(1, 96, checkpoints));
            let a_turns = run_conversations(&mut e, std::slice::from_ref(&a), 0);
            let b_turns = run_conversations(&mut e, std::slice::from_ref(&b), 0);
            // a goes on after b: its blocks are still cached, its checkpoints are not.
            let mut history: Vec<u32> = Vec::new();
            for (message, turn) in a.messages.iter().zip(&a_turns[0]) {
                history.extend_from_slice(message);
                history.extend_from_slice(&turn.output);
            }
            history.extend_from_slice(&humaneval_messages(&files.tokenizer, 90, 1, 60)[0]);
            let last = run_batch(&mut e, vec![request(&history, 16, params.clone(), Some(SpecMethod::Mtp))]).outputs.remove(0);
            (a_turns, b_turns, last, e.prefix_cache_stats())
        };
        let (a_want, b_want, last_want, _) = run(0);
        let (a_got, b_got, last_got, stats) = run(2);
        let what = format!("temperature {}", params.temperature);
        assert_eq!((outputs(&a_got), outputs(&b_got), &last_got.0), (outputs(&a_want), outputs(&b_want), &last_want.0), "{what}");
        let stats = stats.expect("the cache is on");
        assert!(stats.evicted_checkpoints > 0 && stats.checkpoints == 2, "{what}: {stats:?}");
        // The newest checkpoint of a turn outlives the older ones of the same prompt.
        for turns in [&a_got[0], &b_got[0]] {
            assert_eq!(turns[1].cached_tokens, checkpoint_position(turns[0].prompt_len), "{what}: {turns:?}");
        }
        assert_eq!(last_got.1, 0, "{what}: a's checkpoints were evicted by b's");
    }
}

#[test]
fn a_cached_prefix_whose_blocks_were_freed_and_reused_is_not_hit() {
    let (files, _) = default_model();
    let text = humaneval_messages(&files.tokenizer, 70, 12, 1000).concat();
    let a = text[..300].to_vec();
    let b = text[300..900].to_vec();
    // 40 blocks: b needs 39 of them, so a's cached blocks must go.
    let mut e = cpu_engine(EngineConfig { num_blocks: 40, ..config(1, 512, 8) });
    let run = |e: &mut Engine<_>, p: &[u32]| run_batch(e, vec![request(p, 8, SamplingParams::greedy(), Some(SpecMethod::None))]).outputs.remove(0);
    let (first, cached) = run(&mut e, &a);
    assert_eq!(cached, 0);
    // Freed but kept: a is found again.
    let (again, cached) = run(&mut e, &a);
    assert_eq!((&again, cached), (&first, checkpoint_position(a.len())));
    // Reused by b: a is computed from its first token, and still gives the same text.
    run(&mut e, &b);
    let (after, cached) = run(&mut e, &a);
    assert_eq!(cached, 0, "a's blocks were reused: nothing of them may be hit");
    assert_eq!(after, first);
    let stats = e.prefix_cache_stats().expect("the cache is on");
    assert_eq!(stats.hits, 1);
}

#[test]
fn the_cache_needs_blocks_that_divide_the_delta_rule_chunk() {
    let err = Engine::new(kestrel::backend::cpu::CpuBackend::new().with_f32_activations(), default_model().1, EngineConfig { block_size: 48, ..config(1, 512, 4) }).err().expect("refused");
    assert!(matches!(&err, EngineError::Config(m) if m.contains("block size that divides 64")), "{err}");
    // Without the cache any block size goes.
    assert!(Engine::new(kestrel::backend::cpu::CpuBackend::new().with_f32_activations(), default_model().1, EngineConfig { block_size: 48, ..config(1, 512, 0) }).is_ok());
}
