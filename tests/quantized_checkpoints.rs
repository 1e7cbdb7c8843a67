//! Quantized Hugging Face checkpoints (AutoRound int4, block FP8) on the CPU: each runs exactly
//! as the model whose quantized linears hold the weights they stand for, as computed by
//! scripts/make_quantized_fixtures.py from the stored values (`dequantized.safetensors`), and
//! what cannot be loaded is refused with a message that says why.

mod common;

use common::*;
use std::path::Path;

const INT4: &str = "qwen35-dense-int4";
const FP8: &str = "qwen35-dense-fp8";

/// Adds tensors to a copied fixture's model.safetensors.
fn add_tensors(dir: &Path, extra: Vec<(String, safetensors::tensor::TensorView)>) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut all = st.tensors();
    all.extend(extra);
    safetensors::serialize_to_file(all, None, &path).unwrap();
}

/// `dir` turned into a plain checkpoint: every quantized linear replaced by its dequantized F32
/// weight, the quantization tensors dropped and `quantization_config` removed.
fn dequantized_twin(dir: &Path) {
    let reference = std::fs::read(dir.join("dequantized.safetensors")).unwrap();
    let reference = safetensors::SafeTensors::deserialize(&reference).unwrap();
    let replaced: Vec<String> = reference.names().into_iter().map(str::to_string).collect();
    rewrite_weights(dir, |name, d, s, b| {
        let quantization_part = [".qweight", ".qzeros", ".scales", ".weight_scale_inv"].iter().any(|suffix| name.ends_with(suffix));
        (!quantization_part && !replaced.iter().any(|r| r == name)).then_some((d, s, b))
    });
    add_tensors(dir, reference.tensors());
    edit_quantization_config(dir, |q| *q = serde_json::Value::Null);
}

fn prompt() -> Vec<u32> {
    reference("qwen35-dense").prompt_ids
}

/// Logits of the quantized fixture and of its dequantized twin are bitwise equal; and each
/// quantized linear, as the loader repacks it, stays within the format's error of the BF16
/// model's weight (the logits of a tiny random-weight model amplify any weight error too much
/// to say more).
fn check_runs_as_its_dequantized_weights(name: &str, max_weight_error: f32) {
    let ids = prompt();
    let (files, model) = load_model(&fixture_dir(name));
    let quantization = files.config.quantization.clone();
    assert!(quantization.is_some(), "{name}: no quantization config read");
    let quantized = prefill_logits(&model, &ids, ids.len());

    let twin = scratch_copy(name);
    dequantized_twin(twin.path());
    let (twin_files, model) = load_model(twin.path());
    assert!(twin_files.config.quantization.is_none());
    let dequantized = prefill_logits(&model, &ids, ids.len());
    assert_eq!(quantized.len(), dequantized.len());
    let differing = quantized.iter().zip(&dequantized).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    assert_eq!(differing, 0, "{name}: {differing} logits differ from the dequantized twin's");

    let original = kestrel::model::ModelFiles::open_dir(&fixture_dir("qwen35-dense")).unwrap();
    let reference = std::fs::read(fixture_dir(name).join("dequantized.safetensors")).unwrap();
    let reference = safetensors::SafeTensors::deserialize(&reference).unwrap();
    assert!(reference.len() >= 30, "{name}: only {} quantized linears", reference.len());
    for linear in reference.names() {
        let want = original.store.get(linear).unwrap();
        let (rows, cols) = (want.shape[0], want.shape[1]);
        let got = files.store.linear(linear, rows, cols, quantization.as_ref()).unwrap();
        assert!(got.dtype.is_quantized(), "{linear}: loaded as {}", got.dtype);
        let got = kestrel_quant::dequantize(got.dtype, got.bytes()).unwrap();
        let want = want.to_f32().unwrap();
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        let diff: Vec<f32> = got.iter().zip(&want).map(|(a, b)| a - b).collect();
        let err = norm(&diff) / norm(&want);
        assert!(err > 0.0 && err < max_weight_error, "{name}: {linear} is {err} (relative) from the BF16 weight");
    }
}

#[test]
fn int4_autoround_checkpoint_runs_as_its_dequantized_weights() {
    check_runs_as_its_dequantized_weights(INT4, 0.12);
}

#[test]
fn fp8_block_checkpoint_runs_as_its_dequantized_weights() {
    check_runs_as_its_dequantized_weights(FP8, 0.04);
}

#[test]
fn quantized_checkpoints_generate_from_the_command_line() {
    for name in [INT4, FP8] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .args(["run", "--device", "cpu", "--model"])
            .arg(fixture_dir(name))
            .args(["hello", "-n", "8", "--json"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["token_ids"].as_array().map(Vec::len), Some(8), "{name}: {v}");
    }
    for (name, says) in [(INT4, "int4 in groups of 32 (GPTQ packing, v1 zero points)"), (FP8, "FP8 E4M3 with 128x128 block scales")] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel")).args(["info", "--json", "--model"]).arg(fixture_dir(name)).output().unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["quantization"], says, "{name}: {v}");
    }
}

/// Edits config.json's `quantization_config` of a copied fixture.
fn edit_quantization_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config["quantization_config"]);
    std::fs::write(&path, config.to_string()).unwrap();
}

const QWEIGHT: &str = "model.language_model.layers.0.mlp.down_proj.qweight";

#[test]
fn int4_weights_without_a_quantization_config_are_refused() {
    let dir = scratch_copy(INT4);
    edit_quantization_config(dir.path(), |q| *q = serde_json::Value::Null);
    let msg = load_error(dir.path());
    assert!(msg.contains("qweight") && msg.contains("quantization_config"), "{msg}");
}

#[test]
fn unsupported_quantization_settings_are_named() {
    for (key, value, says) in [("bits", serde_json::json!(8), "8-bit"), ("packing_format", serde_json::json!("auto_round:llm_compressor"), "llm_compressor"), ("quant_method", serde_json::json!("hqq"), "hqq")] {
        let dir = scratch_copy(INT4);
        edit_quantization_config(dir.path(), |q| q[key] = value);
        let msg = load_error(dir.path());
        assert!(msg.contains("quantization_config") && msg.contains(says), "{key}: {msg}");
    }
}

#[test]
fn a_group_size_that_does_not_match_the_tensors_is_refused() {
    let dir = scratch_copy(INT4);
    edit_quantization_config(dir.path(), |q| q["group_size"] = serde_json::json!(64));
    let msg = load_error(dir.path());
    assert!(msg.contains("qzeros") || msg.contains("scales"), "{msg}");
}

#[test]
fn activation_order_int4_is_refused() {
    let dir = scratch_copy(INT4);
    // The 96 inputs of the down projection listed in reverse: an activation-order checkpoint.
    let permuted: Vec<u8> = (0..96i32).rev().flat_map(|i| (i / 32).to_le_bytes()).collect();
    let g_idx = safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![96], &permuted).unwrap();
    add_tensors(dir.path(), vec![(QWEIGHT.replace(".qweight", ".g_idx"), g_idx)]);
    let msg = load_error(dir.path());
    assert!(msg.contains("g_idx") && msg.contains("activation order"), "{msg}");
}

#[test]
fn damaged_int4_tensors_are_named() {
    let dir = scratch_copy(INT4);
    let qzeros = QWEIGHT.replace(".qweight", ".qzeros");
    rewrite_weights(dir.path(), |n, d, s, b| (n != qzeros).then_some((d, s, b)));
    let msg = load_error(dir.path());
    assert!(msg.contains(&qzeros) && msg.contains("missing"), "{msg}");

    let dir = scratch_copy(INT4);
    rewrite_weights(dir.path(), |n, d, s, b| if n == QWEIGHT { Some((d, vec![s[0] / 2, s[1]], b[..b.len() / 2].to_vec())) } else { Some((d, s, b)) });
    let msg = load_error(dir.path());
    assert!(msg.contains(QWEIGHT) && msg.contains("shape"), "{msg}");
}

#[test]
fn fp8_weights_without_their_scales_are_refused() {
    let dir = scratch_copy(FP8);
    let scale = "model.language_model.layers.3.self_attn.q_proj.weight_scale_inv";
    rewrite_weights(dir.path(), |n, d, s, b| (n != scale).then_some((d, s, b)));
    let msg = load_error(dir.path());
    assert!(msg.contains(scale) && msg.contains("missing"), "{msg}");

    let dir = scratch_copy(FP8);
    edit_quantization_config(dir.path(), |q| *q = serde_json::Value::Null);
    let msg = load_error(dir.path());
    assert!(msg.contains("F8_E4M3") && msg.contains("quantization_config"), "{msg}");
}
