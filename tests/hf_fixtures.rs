//! The CPU forward against Hugging Face transformers on tiny random-weight models of each family.

mod common;

use common::*;
use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::{Backend, BatchLayout, RowKind, RowLayout};
use kestrel::engine::sampler::SamplingParams;
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::ModelFiles;

/// Prefill of `ids` in pieces of `piece` tokens; returns the logits of every token.
fn prefill_logits(model: &Qwen35<CpuBackend>, ids: &[u32], piece: usize) -> Vec<f32> {
    let b = CpuBackend::new();
    let spec = model.cache_spec(64, 16, 1, 0);
    let mut cache = b.alloc_cache(&spec).unwrap();
    b.reset_states(&mut cache, &[0]);
    let table: Vec<u32> = (0..64).collect();
    let mut all = Vec::new();
    for (n, chunk) in ids.chunks(piece).enumerate() {
        let layout = BatchLayout {
            rows: vec![RowLayout { kind: RowKind::Prefill, token_start: 0, num_tokens: chunk.len(), start_position: n * piece, block_table: table.clone(), state_slot: 0, snapshot_base: 0 }],
        };
        let rows: Vec<u32> = (0..chunk.len() as u32).collect();
        let out = model.forward(&b, chunk, &layout, &rows, &mut cache);
        all.extend(b.to_host(&out.logits));
    }
    all
}

fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let max_ref = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_err = got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    max_err / max_ref
}

#[test]
fn logits_match_transformers() {
    for name in FIXTURES {
        let r = reference(name);
        let (_, model) = load_model(&fixture_dir(name));
        let logits = prefill_logits(&model, &r.prompt_ids, r.prompt_ids.len());
        let err = relative_error(&logits, &r.logits);
        assert!(err < 1e-3, "{name}: relative logit error {err}");
    }
}

#[test]
fn greedy_continuation_matches_transformers() {
    for name in FIXTURES {
        let r = reference(name);
        let got = generate_alone(Some(&fixture_dir(name)), &r.prompt_ids, r.greedy_ids.len(), SamplingParams::greedy());
        assert_eq!(got, r.greedy_ids, "{name}: greedy continuation differs");
    }
}

#[test]
fn chunked_prefill_keeps_state_across_pieces() {
    for name in FIXTURES {
        let r = reference(name);
        let (_, model) = load_model(&fixture_dir(name));
        let vocab = model.config.vocab_size;
        let whole = prefill_logits(&model, &r.prompt_ids, r.prompt_ids.len());
        let last = &whole[whole.len() - vocab..];
        for piece in [1, 7, 64] {
            let chunked = prefill_logits(&model, &r.prompt_ids, piece);
            let err = relative_error(&chunked[chunked.len() - vocab..], last);
            assert!(err < 1e-4, "{name}: pieces of {piece} give next-token logits off by {err}");
        }
    }
}

/// Copies a fixture into a temp dir so a test can damage it.
fn scratch_copy(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture_dir(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

fn load_error(dir: &std::path::Path) -> String {
    let files = match ModelFiles::open_dir(dir) {
        Err(e) => return e.to_string(),
        Ok(f) => f,
    };
    match Qwen35::load(&CpuBackend::new(), files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("damaged model {} loaded without error", dir.display()),
    }
}

#[test]
fn truncated_weights_are_reported() {
    let dir = scratch_copy("qwen35-dense");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let msg = load_error(dir.path());
    assert!(msg.contains("model.safetensors") && msg.contains("truncated"), "{msg}");
}

/// Rewrites the dense fixture's weights through `edit`, which may drop or change tensors.
fn rewrite_weights(dir: &std::path::Path, edit: impl Fn(&str, safetensors::Dtype, Vec<usize>, Vec<u8>) -> Option<(safetensors::Dtype, Vec<usize>, Vec<u8>)>) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, (safetensors::Dtype, Vec<usize>, Vec<u8>))> =
        st.tensors().into_iter().filter_map(|(n, t)| edit(&n, t.dtype(), t.shape().to_vec(), t.data().to_vec()).map(|v| (n, v))).collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        kept.iter().map(|(n, (d, s, b))| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let dir = scratch_copy("qwen35-dense");
    let victim = "model.language_model.layers.2.linear_attn.out_proj.weight";
    rewrite_weights(dir.path(), |n, d, s, b| (n != victim).then_some((d, s, b)));
    let msg = load_error(dir.path());
    assert!(msg.contains(victim) && msg.contains("missing"), "{msg}");
}

#[test]
fn wrong_shape_is_named() {
    let dir = scratch_copy("qwen35-dense");
    let victim = "model.language_model.layers.0.mlp.up_proj.weight";
    rewrite_weights(dir.path(), |n, d, s, b| {
        if n == victim {
            let half = b.len() / 2;
            Some((d, vec![s[0] / 2, s[1]], b[..half].to_vec()))
        } else {
            Some((d, s, b))
        }
    });
    let msg = load_error(dir.path());
    assert!(msg.contains(victim) && msg.contains("shape"), "{msg}");
}

#[test]
fn wrong_dtype_is_named() {
    let dir = scratch_copy("qwen35-dense");
    let victim = "model.language_model.norm.weight";
    rewrite_weights(dir.path(), |n, d, s, b| if n == victim { Some((safetensors::Dtype::U8, vec![b.len()], b)) } else { Some((d, s, b)) });
    let msg = load_error(dir.path());
    assert!(msg.contains(victim) && msg.contains("dtype"), "{msg}");
}

#[test]
fn unknown_model_type_is_named() {
    let dir = scratch_copy("qwen35-dense");
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&path).unwrap().replacen("\"qwen3_5\"", "\"mamba9\"", 1);
    std::fs::write(&path, text).unwrap();
    let msg = load_error(dir.path());
    assert!(msg.contains("unknown model_type `mamba9`"), "{msg}");
}

#[test]
fn missing_directory_and_config() {
    let msg = load_error(std::path::Path::new("/nonexistent/model"));
    assert!(msg.contains("does not exist"), "{msg}");
    let empty = tempfile::tempdir().unwrap();
    let msg = load_error(empty.path());
    assert!(msg.contains("not a model directory"), "{msg}");
}
