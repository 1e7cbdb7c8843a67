//! The multi-turn dataset of `kestrel bench`: conversations that grow turn by turn, as a chat
//! or a coding agent resends its whole history. Turn `t`'s prompt is turn `t - 1`'s prompt, the
//! model's reply to it and a new user message of `--turn-len` tokens of HumanEval text, so the
//! prefix cache's gain shows in the time to first token of the later turns.
//!
//! `concurrency` conversations are in flight at once; each submits its next turn as soon as
//! the previous one finished, and a finished conversation makes room for the next one.

use anyhow::{bail, Context, Result};
use kestrel::backend::Backend;
use kestrel::engine::metrics::{RequestTimeline, SecondsClock, SpecStats};
use kestrel::engine::request::{RequestEvent, RequestId};
use kestrel::engine::Engine;
use std::collections::HashMap;

/// The user messages of `conversations` conversations of `turns` turns, each `turn_len` tokens
/// of the HumanEval prompts' text (taken in order, wrapping around).
pub fn messages(humaneval: &str, tokenizer: &kestrel::tokenizer::Tokenizer, conversations: usize, turns: usize, turn_len: usize) -> Result<Vec<Vec<Vec<u32>>>> {
    if turns == 0 || turn_len == 0 {
        bail!("--turns and --turn-len must be at least 1");
    }
    let mut text = Vec::new();
    for line in humaneval.lines() {
        let v: serde_json::Value = serde_json::from_str(line).context("embedded HumanEval data")?;
        text.extend(tokenizer.encode(v["prompt"].as_str().context("HumanEval line without prompt")?, false)?);
    }
    if text.is_empty() {
        bail!("the HumanEval prompts tokenize to nothing");
    }
    let mut at = 0;
    let mut next_message = || -> Vec<u32> {
        (0..turn_len)
            .map(|_| {
                let t = text[at % text.len()];
                at += 1;
                t
            })
            .collect()
    };
    Ok((0..conversations).map(|_| (0..turns).map(|_| next_message()).collect()).collect())
}

/// What one run of the dataset measured.
pub struct MultiturnRun {
    /// Every turn's timeline, in the order they finished.
    pub timelines: Vec<RequestTimeline>,
    /// Per turn index: each conversation's time to first token (seconds).
    pub ttft_by_turn: Vec<Vec<f64>>,
    /// Per turn index: each conversation's prompt tokens, and those served from the cache.
    pub prompt_tokens_by_turn: Vec<Vec<usize>>,
    pub cached_tokens_by_turn: Vec<Vec<usize>>,
    pub output_tokens: usize,
    pub spec: SpecStats,
    pub duration: f64,
}

struct Live {
    conversation: usize,
    turn: usize,
    timeline: RequestTimeline,
}

/// Runs every conversation of `messages` to its last turn, `concurrency` at a time.
pub fn run<B: Backend>(engine: &mut Engine<B>, messages: &[Vec<Vec<u32>>], shape: &super::bench::RequestShape, concurrency: usize, bar: &indicatif::ProgressBar) -> Result<MultiturnRun> {
    let turns = messages.first().map_or(0, Vec::len);
    let clock = SecondsClock::start();
    let mut history: Vec<Vec<u32>> = vec![Vec::new(); messages.len()];
    let mut live: HashMap<RequestId, Live> = HashMap::new();
    let mut next_conversation = 0;
    let mut run = MultiturnRun {
        timelines: Vec::new(),
        ttft_by_turn: vec![Vec::new(); turns],
        prompt_tokens_by_turn: vec![Vec::new(); turns],
        cached_tokens_by_turn: vec![Vec::new(); turns],
        output_tokens: 0,
        spec: SpecStats::default(),
        duration: 0.0,
    };
    // Turns whose conversation is ready for them: (conversation, turn).
    let mut ready: Vec<(usize, usize)> = Vec::new();
    loop {
        while live.len() + ready.len() < concurrency && next_conversation < messages.len() {
            ready.push((next_conversation, 0));
            next_conversation += 1;
        }
        for (c, t) in ready.drain(..) {
            history[c].extend_from_slice(&messages[c][t]);
            let request = shape.request(history[c].clone());
            let id = engine.add_request(request).with_context(|| format!("conversation {c} turn {}", t + 1))?;
            live.insert(id, Live { conversation: c, turn: t, timeline: RequestTimeline::new(clock.now())? });
        }
        if live.is_empty() {
            break;
        }
        for event in engine.step() {
            let now = clock.now();
            match event {
                RequestEvent::Tokens { id, tokens, .. } => {
                    if let Some(l) = live.get_mut(&id) {
                        l.timeline.record_chunk(now, tokens.len())?;
                    }
                }
                RequestEvent::Finished { id, output, .. } => {
                    let Live { conversation, turn, mut timeline } = live.remove(&id).context("finished turn without a timeline")?;
                    timeline.finish(now)?;
                    if let Some(ttft) = timeline.ttft() {
                        run.ttft_by_turn[turn].push(ttft);
                    }
                    run.prompt_tokens_by_turn[turn].push(output.prompt_tokens);
                    run.cached_tokens_by_turn[turn].push(output.cached_tokens);
                    run.output_tokens += output.generated.len();
                    run.spec.merge(&output.spec);
                    run.timelines.push(timeline);
                    history[conversation].extend_from_slice(&output.generated);
                    bar.inc(1);
                    if turn + 1 < turns {
                        ready.push((conversation, turn + 1));
                    }
                }
                RequestEvent::Failed { error, .. } => bail!("generation failed: {error}"),
            }
        }
    }
    run.duration = clock.now();
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_cut_the_text_in_order_and_wrap_around() {
        let files = kestrel::model::default_model::open().expect("embedded model");
        let data = "{\"prompt\": \"def f(x):\\n    return x\\n\"}\n";
        let all = files.tokenizer.encode("def f(x):\n    return x\n", false).expect("tokenizes");
        let m = messages(data, &files.tokenizer, 2, 3, 4).expect("messages");
        assert_eq!((m.len(), m[0].len(), m[0][0].len()), (2, 3, 4));
        let flat: Vec<u32> = m.concat().concat();
        let want: Vec<u32> = (0..24).map(|i| all[i % all.len()]).collect();
        assert_eq!(flat, want);
        assert!(messages(data, &files.tokenizer, 1, 0, 4).is_err());
        assert!(messages(data, &files.tokenizer, 1, 2, 0).is_err());
    }
}
