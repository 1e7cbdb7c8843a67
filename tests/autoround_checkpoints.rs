//! Int4 checkpoints made by the real `auto-round` package (scripts/make_autoround_fixtures.py:
//! AutoRound 0.16.1 over the dense fixture, symmetric and asymmetric, each quantization saved in
//! the `auto_gptq` format and, the symmetric one, in the `auto_round` format too) run on the CPU
//! as transformers runs them: the reference logits and greedy ids are transformers' own, from
//! auto-round's `fake` export of the same quantization (the weights the packed codes stand for,
//! as auto-round computes them).

mod common;

use common::*;
use kestrel::backend::sampling::SamplingParams;
use std::path::PathBuf;

/// (recipe, export folder, what `kestrel info` says of it)
const EXPORTS: [(&str, &str, &str); 3] = [
    ("sym-g32", "auto-gptq", "int4 in groups of 32 (GPTQ packing, v1 zero points)"),
    ("sym-g32", "auto-round-auto-gptq", "int4 in groups of 32 (GPTQ packing, v1 zero points)"),
    ("asym-g64", "auto-gptq", "int4 in groups of 64 (GPTQ packing, v1 zero points)"),
];

fn export_dir(recipe: &str, export: &str) -> PathBuf {
    fixture_dir("autoround").join(recipe).join(export)
}

fn recipe_reference(recipe: &str) -> Reference {
    reference(&format!("autoround/{recipe}"))
}

#[test]
fn autoround_exports_give_transformers_logits() {
    for (recipe, export, _) in EXPORTS {
        let r = recipe_reference(recipe);
        let (files, model) = load_model(&export_dir(recipe, export));
        assert!(files.config.quantization.is_some(), "{recipe}/{export}: no quantization config read");
        let logits = prefill_logits(&model, &r.prompt_ids, r.prompt_ids.len());
        let err = relative_error(&logits, &r.logits);
        assert!(err < 1e-3, "{recipe}/{export}: relative logit error {err} against transformers");
    }
}

#[test]
fn autoround_exports_continue_as_transformers_does() {
    for (recipe, export, _) in EXPORTS {
        let r = recipe_reference(recipe);
        let got = generate_alone(Some(&export_dir(recipe, export)), &r.prompt_ids, r.greedy_ids.len(), SamplingParams::greedy());
        assert_eq!(got, r.greedy_ids, "{recipe}/{export}: greedy continuation differs from transformers'");
    }
}

#[test]
fn autoround_exports_are_described_by_info() {
    for (recipe, export, says) in EXPORTS {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel")).args(["info", "--json", "--model"]).arg(export_dir(recipe, export)).output().unwrap();
        assert!(out.status.success(), "{recipe}/{export}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["quantization"], says, "{recipe}/{export}: {v}");
    }
}
