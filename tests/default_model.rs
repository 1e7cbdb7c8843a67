//! The embedded default model's MTP head is wired as it was trained: the engine's greedy
//! position-0 acceptance matches the training script's MTP self-agreement.

mod common;

use common::*;
use kestrel::engine::request::SpecMethod;
use kestrel::backend::sampling::SamplingParams;
use kestrel::engine::EngineConfig;

#[test]
fn mtp_first_draft_acceptance_matches_training() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let eval: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root.join("models/kestrel-coder/eval.json")).unwrap()).unwrap();
    let want = eval["mtp_self_agreement"].as_f64().unwrap();
    let (files, model) = default_model();
    let ids = files.tokenizer.encode(&std::fs::read_to_string(root.join("models/kestrel-coder/heldout.txt")).unwrap(), false).unwrap();
    // 32 held-out prefixes of 96 tokens, 64 greedy tokens each, one MTP draft per step.
    let stride = (ids.len() - 96) / 32;
    let prompts: Vec<Vec<u32>> = (0..32).map(|i| ids[i * stride..i * stride + 96].to_vec()).collect();
    let mut e = engine(model, EngineConfig { max_num_seqs: 16, spec: SpecMethod::Mtp, spec_tokens: 1, ..EngineConfig::default() });
    let reqs = prompts.iter().map(|p| request(p, 64, SamplingParams::greedy(), None)).collect();
    run_staggered(&mut e, reqs, &[0; 32]);
    let got = e.stats.spec.per_position()[0];
    eprintln!("MTP position-0 acceptance {got:.4} vs training self-agreement {want:.4} over {} draft steps", e.stats.spec.draft_steps);
    assert!(e.stats.spec.draft_steps > 500);
    assert!((got - want).abs() < 0.05, "MTP acceptance {got:.3} is far from the trained {want:.3}: check the hidden state, norms or token shift");
}
