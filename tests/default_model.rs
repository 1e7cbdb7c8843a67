//! The embedded default model's MTP head is wired as it was trained: the engine's greedy
//! position-0 acceptance matches the training script's MTP self-agreement; and its drafter's
//! catch-up writes the same cache whether or not it drafts.

mod common;

use common::conversation::humaneval_tokens;
use common::mtp_rounds::{draft_round, DraftSeq};
use common::*;
use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::sampling::SamplingParams;
use kestrel::backend::Backend;
use kestrel::engine::request::SpecMethod;
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

/// A catch-up whose rows draft nothing (prompt pieces, rows without room for drafts) writes
/// only the MTP layer's cache and makes no logits: the drafts after it are those after a
/// catch-up that drafted, on a cache of its own, token for token. A catch-up that skipped or
/// misplaced its cache rows would change the later drafts.
#[test]
fn a_catch_up_without_drafts_writes_the_cache_a_drafting_one_writes() {
    let (files, model) = default_model();
    let b = CpuBackend::new().with_f32_activations();
    let text = humaneval_tokens(&files.tokenizer);
    let (n, k, blocks_each, block_size) = (3, 3, 8, 16);
    let spec = model.cache_spec(n * blocks_each, block_size, n, 0);
    let mut drafting = b.alloc_cache(&spec).expect("cache");
    let mut skipping = b.alloc_cache(&spec).expect("cache");
    let mut seqs: Vec<DraftSeq> = (0..n).map(|i| DraftSeq { text: text[i * 173..i * 173 + 120].to_vec(), len: 0, table: (0..blocks_each as u32).map(|x| (i * blocks_each) as u32 + x).collect(), slot: i }).collect();
    let mut compared = 0;
    for round in 0..10 {
        let pieces: Vec<(usize, usize)> = (0..n).map(|s| (s, if round == 0 { 20 + 3 * s } else { 1 + (round * 7 + s * 3) % (k + 1) })).collect();
        let want = draft_round(&b, &model, &mut drafting, &seqs, &pieces, k, None);
        // Every other round the second cache's catch-up drafts nothing.
        let got = draft_round(&b, &model, &mut skipping, &seqs, &pieces, if round % 2 == 0 { k } else { 0 }, None);
        if round % 2 == 0 {
            assert_eq!(got, want, "round {round} ({pieces:?}): drafts after catch-ups without drafts differ");
            assert!(want.iter().all(|d| d.len() == k), "round {round}: a sequence drafted fewer than {k}: {want:?}");
            compared += 1;
        } else {
            assert!(got.iter().all(Vec::is_empty), "round {round}: a catch-up without drafts drafted {got:?}");
        }
        for (s, count) in pieces {
            seqs[s].len += count;
        }
    }
    assert_eq!(compared, 5);
}
