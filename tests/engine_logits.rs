//! Penalties, logit bias, grammar masks and log probabilities on the CPU batch engine: with
//! speculation (planted drafts of every rollback depth, ngram, MTP) and batching, every request's
//! tokens and log probabilities are bitwise those it gets alone without speculation (DESIGN
//! Invariant 3), and a grammar's output follows the grammar.

mod common;

use common::*;
use kestrel::backend::sampling::SamplingParams;
use kestrel::engine::logits::grammar::{GrammarCompiler, GrammarSpec};
use kestrel::engine::logits::logprobs::TokenLogprob;
use kestrel::engine::logits::penalties::Penalties;
use kestrel::engine::logits::LogitsOptions;
use kestrel::engine::request::{Request, RequestEvent, SpecMethod};
use kestrel::engine::EngineConfig;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

const SCHEMA: &str = r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer", "minimum": 0, "maximum": 999}, "kind": {"enum": ["def", "class", "module"]}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}, "required": ["name", "size", "kind", "tags"], "additionalProperties": false}"#;

/// Requests that ask for everything the host path does, and one that asks for nothing.
fn requests() -> Vec<Request> {
    let (files, _) = default_model();
    let compiler = GrammarCompiler::new(&files.tokenizer, files.config.vocab_size, &files.config.eos_token_ids).expect("token table");
    let ends = files.config.eos_token_ids.clone();
    let encode = |text: &str| files.tokenizer.encode(text, false).expect("encodes");
    let json = compiler.compile(&GrammarSpec::JsonSchema(serde_json::from_str(SCHEMA).expect("schema")), &ends).expect("compiles");
    let lark = compiler.compile(&GrammarSpec::Lark("start: \"def \" NAME \"(\" NAME? \"):\"\nNAME: /[a-z_]{1,8}/".into()), &ends).expect("compiles");
    let sampled = |seed| SamplingParams { temperature: 0.8, top_k: 0, top_p: 0.95, min_p: 0.02, seed };
    let with = |prompt: &str, params, max_tokens, logits| Request { logits, ..Request::new(encode(prompt), params, max_tokens, ends.clone()) };
    vec![
        with("# describe it as JSON\n", sampled(3), 120, LogitsOptions { grammar: Some(json.clone()), logprobs: Some(3), ..LogitsOptions::default() }),
        with("import os\nimport sys\n", sampled(4), 48, LogitsOptions {
            penalties: Penalties { presence: 1.0, frequency: 0.5, repetition: 1.2 },
            logit_bias: vec![(encode(" os")[0], 2.0), (encode("import")[0], -3.0)],
            logprobs: Some(2),
            grammar: None,
        }),
        with("class Stack:\n", SamplingParams::greedy(), 40, LogitsOptions { grammar: Some(lark), ..LogitsOptions::default() }),
        with("def fib(n):\n", SamplingParams::greedy(), 40, LogitsOptions { penalties: Penalties { presence: 0.0, frequency: 1.5, repetition: 1.0 }, logprobs: Some(0), ..LogitsOptions::default() }),
        with("def add(a, b):\n", sampled(9), 160, LogitsOptions { grammar: Some(json), ..LogitsOptions::default() }),
        with("for i in range(10):\n", SamplingParams::greedy(), 40, LogitsOptions::default()),
    ]
}

type Output = (Vec<u32>, Vec<TokenLogprob>);

fn run(requests: &[Request], method: SpecMethod, max_batch: usize, drafter: Option<kestrel::engine::engine::CustomDrafter>) -> (Vec<Output>, u64) {
    let (_, model) = default_model();
    let mut engine = engine(model, EngineConfig { max_num_seqs: max_batch, max_num_batched_tokens: 96, spec: method, spec_tokens: 4, ..EngineConfig::default() });
    engine.set_custom_drafter(drafter);
    let mut index = HashMap::new();
    for (i, r) in requests.iter().enumerate() {
        index.insert(engine.add_request(r.clone()).expect("accepted"), i);
    }
    let mut outputs: Vec<Option<Output>> = vec![None; requests.len()];
    for event in engine.run_to_completion() {
        if let RequestEvent::Finished { id, output, .. } = event {
            outputs[index[&id]] = Some((output.generated, output.logprobs));
        }
    }
    (outputs.into_iter().map(|o| o.expect("finished")).collect(), engine.stats.spec.accepted)
}

#[test]
fn speculation_and_batching_leave_tokens_and_logprobs_unchanged() {
    let requests = requests();
    let alone: Vec<Output> = requests.iter().map(|r| run(std::slice::from_ref(r), SpecMethod::None, 1, None).0.remove(0)).collect();
    for (i, (tokens, logprobs)) in alone.iter().enumerate() {
        let asked = requests[i].logits.logprobs.is_some();
        assert_eq!(logprobs.len(), if asked { tokens.len() } else { 0 }, "request {i}");
        assert!(logprobs.iter().zip(tokens).all(|(l, &t)| l.token == t && l.logprob <= 0.0), "request {i}");
    }
    // Planted drafts: the right tokens for a random number of positions, then wrong ones, so
    // that rows are verified and rolled back at every depth, masks and penalties included.
    let truth: Vec<Vec<u32>> = alone.iter().map(|(t, _)| t.clone()).collect();
    let prompts: Vec<usize> = requests.iter().map(|r| r.prompt_ids.len()).collect();
    let order: Arc<Mutex<HashMap<u64, usize>>> = Arc::new(Mutex::new(HashMap::new()));
    let (truth_c, order_c) = (truth.clone(), order.clone());
    let mut state = 17u64;
    let drafter: kestrel::engine::engine::CustomDrafter = Box::new(move |id: u64, tokens: &[u32], max: usize| {
        let Some(&i): Option<&usize> = order_c.lock().expect("lock").get(&id) else { return Vec::new() };
        let done: usize = tokens.len() - prompts[i];
        let right = &truth_c[i][done.min(truth_c[i].len())..];
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let good = ((state >> 33) as usize % (max.min(4) + 1)).min(right.len());
        let mut drafts = right[..good].to_vec();
        while drafts.len() < max.min(4) {
            drafts.push(right.get(drafts.len()).map_or(7, |t| t + 1));
        }
        drafts
    });
    // Ids are given in submission order from 0.
    order.lock().expect("lock").extend((0..requests.len() as u64).map(|id| (id, id as usize)));
    let (planted, accepted) = run(&requests, SpecMethod::Ngram, 4, Some(drafter));
    assert!(accepted > 0, "the planted drafts were never accepted");
    assert_eq!(planted, alone, "planted drafts changed an output");
    for method in [SpecMethod::Ngram, SpecMethod::Mtp] {
        let (together, _) = run(&requests, method, 3, None);
        assert_eq!(together, alone, "{method:?} with a batch of 3 changed an output");
    }
}

#[test]
fn grammars_hold_the_output() {
    let requests = requests();
    let (files, _) = default_model();
    let (outputs, _) = run(&requests, SpecMethod::Mtp, 6, None);
    let schema: serde_json::Value = serde_json::from_str(SCHEMA).expect("schema");
    for i in [0usize, 4] {
        let text = files.tokenizer.decode(&outputs[i].0, true).expect("decodes");
        let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("request {i}: not JSON ({e}): {text:?}"));
        for key in schema["required"].as_array().expect("required") {
            assert!(value.get(key.as_str().expect("a key")).is_some(), "request {i}: {key} missing from {text}");
        }
        assert!(["def", "class", "module"].contains(&value["kind"].as_str().expect("kind")), "{text}");
    }
    let text = files.tokenizer.decode(&outputs[2].0, true).expect("decodes");
    assert!(text.starts_with("def ") && text.ends_with("):"), "{text:?}");
}

/// A grammar alone leaves its rows to the backend, which masks and draws them where the logits
/// are; with log probabilities asked for as well, they are masked and drawn on the host. Both
/// draw the same tokens, for every kind of draw, alone and batched with speculation.
#[test]
fn grammar_rows_drawn_by_the_backend_match_the_host_draw() {
    let (files, _) = default_model();
    let compiler = GrammarCompiler::new(&files.tokenizer, files.config.vocab_size, &files.config.eos_token_ids).expect("token table");
    let ends = files.config.eos_token_ids.clone();
    let json = compiler.compile(&GrammarSpec::JsonSchema(serde_json::from_str(SCHEMA).expect("schema")), &ends).expect("compiles");
    let draws = [
        SamplingParams::greedy(),
        SamplingParams { temperature: 0.9, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 5 },
        SamplingParams { temperature: 0.8, top_k: 20, top_p: 0.95, min_p: 0.0, seed: 6 },
    ];
    let prompts = ["# a function as JSON\n", "def parse(text):\n", "class Node:\n"];
    let requests = |logprobs: Option<usize>| -> Vec<Request> {
        draws
            .iter()
            .zip(prompts)
            .map(|(params, prompt)| {
                let logits = LogitsOptions { grammar: Some(json.clone()), logprobs, ..LogitsOptions::default() };
                Request { logits, ..Request::new(files.tokenizer.encode(prompt, false).expect("encodes"), params.clone(), 120, ends.clone()) }
            })
            .collect()
    };
    assert!(!requests(None)[0].logits.needs_host() && requests(Some(0))[0].logits.needs_host());
    let tokens = |outputs: Vec<Output>| -> Vec<Vec<u32>> { outputs.into_iter().map(|(t, _)| t).collect() };
    let on_host: Vec<Vec<u32>> = requests(Some(0)).iter().map(|r| run(std::slice::from_ref(r), SpecMethod::None, 1, None).0.remove(0).0).collect();
    for (i, text) in on_host.iter().map(|t| files.tokenizer.decode(t, true).expect("decodes")).enumerate() {
        serde_json::from_str::<serde_json::Value>(&text).unwrap_or_else(|e| panic!("request {i}: not JSON ({e}): {text:?}"));
    }
    let alone: Vec<Vec<u32>> = requests(None).iter().map(|r| run(std::slice::from_ref(r), SpecMethod::None, 1, None).0.remove(0).0).collect();
    assert_eq!(alone, on_host, "a row masked by the backend drew another token than the host");
    for method in [SpecMethod::None, SpecMethod::Ngram, SpecMethod::Mtp] {
        assert_eq!(tokens(run(&requests(None), method, 3, None).0), on_host, "{method:?} with a batch of 3");
    }
}
