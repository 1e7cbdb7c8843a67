//! Multi-turn conversations driven through an engine, for the prefix-cache tests on the CPU
//! and the GPU: each turn's prompt is the previous prompt, the model's reply to it and the
//! next user message, so every turn begins with everything the turn before saw.

use kestrel::backend::sampling::SamplingParams;
use kestrel::backend::Backend;
use kestrel::engine::request::{Request, RequestEvent, RequestId, SpecMethod};
use kestrel::engine::Engine;
use std::collections::HashMap;

/// One turn's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub prompt_len: usize,
    pub output: Vec<u32>,
    pub cached_tokens: usize,
}

/// A conversation: its user messages and how each turn is generated.
#[derive(Debug, Clone)]
pub struct Conversation {
    pub messages: Vec<Vec<u32>>,
    pub max_tokens: usize,
    pub spec: SpecMethod,
    /// Sampling of turn `t` (its seed differs per turn, as the chat's does).
    pub params: SamplingParams,
}

impl Conversation {
    fn request(&self, prompt: Vec<u32>, turn: usize) -> Request {
        let params = SamplingParams { seed: self.params.seed.wrapping_add(turn as u64), ..self.params.clone() };
        Request { spec: Some(self.spec), ..Request::new(prompt, params, self.max_tokens, Vec::new()) }
    }
}

/// Runs `conversations` side by side: each starts `i * stagger` steps in, and each turn is
/// submitted as soon as the previous one finished. Returns every conversation's turns.
pub fn run_conversations<B: Backend>(engine: &mut Engine<B>, conversations: &[Conversation], stagger: usize) -> Vec<Vec<Turn>> {
    let n = conversations.len();
    let mut turns: Vec<Vec<Turn>> = vec![Vec::new(); n];
    let mut history: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut in_flight: HashMap<RequestId, usize> = HashMap::new();
    let mut busy = vec![false; n];
    let mut step = 0usize;
    loop {
        for c in 0..n {
            let turn = turns[c].len();
            if busy[c] || turn == conversations[c].messages.len() || step < c * stagger {
                continue;
            }
            history[c].extend_from_slice(&conversations[c].messages[turn]);
            let id = engine.add_request(conversations[c].request(history[c].clone(), turn)).expect("turn accepted");
            in_flight.insert(id, c);
            busy[c] = true;
        }
        if in_flight.is_empty() && turns.iter().zip(conversations).all(|(t, c)| t.len() == c.messages.len()) {
            return turns;
        }
        for event in engine.step() {
            if let RequestEvent::Finished { id, output, .. } = event {
                let c = in_flight.remove(&id).expect("a turn of a conversation");
                history[c].extend_from_slice(&output.generated);
                turns[c].push(Turn { prompt_len: output.prompt_tokens, output: output.generated, cached_tokens: output.cached_tokens });
                busy[c] = false;
            }
        }
        step += 1;
        assert!(step < 200_000, "the conversations did not finish");
    }
}

/// What [`run_batch`] saw.
pub struct BatchRun {
    /// Each request's output and cached prompt tokens, in input order.
    pub outputs: Vec<(Vec<u32>, usize)>,
    /// The most KV blocks held by requests after any step.
    pub peak_blocks: usize,
    /// The most KV blocks held by more than one request after any step.
    pub peak_shared_blocks: usize,
}

/// Runs requests that all arrive at step 0, as many at a time as `engine`'s batch takes.
pub fn run_batch<B: Backend>(engine: &mut Engine<B>, requests: Vec<Request>) -> BatchRun {
    let mut index = HashMap::new();
    for (i, r) in requests.into_iter().enumerate() {
        index.insert(engine.add_request(r).expect("request accepted"), i);
    }
    let mut out = vec![None; index.len()];
    let (mut peak_blocks, mut peak_shared_blocks) = (0, 0);
    while engine.has_unfinished() {
        for event in engine.step() {
            if let RequestEvent::Finished { id, output, .. } = event {
                out[index[&id]] = Some((output.generated, output.cached_tokens));
            }
        }
        peak_blocks = peak_blocks.max(engine.cache_usage().0 .0);
        peak_shared_blocks = peak_shared_blocks.max(engine.prefix_cache_stats().map_or(0, |s| s.shared_blocks));
    }
    BatchRun { outputs: out.into_iter().map(|o| o.expect("every request finished")).collect(), peak_blocks, peak_shared_blocks }
}

/// Token ids of HumanEval prompts (code the default model knows), one message per prompt,
/// starting at prompt `first`, each cut to at most `max_len` tokens.
pub fn humaneval_messages(tokenizer: &kestrel::tokenizer::Tokenizer, first: usize, count: usize, max_len: usize) -> Vec<Vec<u32>> {
    static HUMANEVAL: &str = include_str!("../../data/humaneval/prompts.jsonl");
    HUMANEVAL
        .lines()
        .skip(first)
        .take(count)
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("prompts.jsonl line");
            let mut ids = tokenizer.encode(v["prompt"].as_str().expect("prompt"), false).expect("tokenizes");
            ids.truncate(max_len);
            ids
        })
        .collect()
}

/// Every HumanEval prompt's tokens, one prompt after another.
pub fn humaneval_tokens(tokenizer: &kestrel::tokenizer::Tokenizer) -> Vec<u32> {
    humaneval_messages(tokenizer, 0, usize::MAX, usize::MAX).concat()
}

/// Prompts that begin with `prefix` (a system prompt, say) and end with each of `tails`.
pub fn with_prefix(prefix: &[u32], tails: Vec<Vec<u32>>) -> Vec<Vec<u32>> {
    tails.into_iter().map(|tail| [prefix, &tail[..]].concat()).collect()
}
