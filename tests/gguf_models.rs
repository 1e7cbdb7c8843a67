//! GGUF checkpoints in llama.cpp's conventions against Hugging Face transformers.
//!
//! tests/fixtures/gguf/{qwen35-dense,qwen35-moe,qwen3-next}.gguf are the HF fixtures converted by
//! scripts/make_gguf_models.py the way llama.cpp's converter does it (value heads tiled,
//! `1 + w` norms, `-exp(A_log)`, split Qwen3-Next projections, MTP as a nextn block), so they
//! must reproduce the HF reference logits and greedy continuation. qwen35-moe-quant.gguf holds
//! Q4_K and Q8_0 tensors; it must give exactly the logits of the same model with those tensors
//! dequantized to F32, and so must a copy whose linear attention is widened (in a temporary
//! directory) to hold `ssm_out` in each 256-value block type.

mod common;

use common::*;
use indicatif::ProgressBar;
use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::{Backend, BatchLayout, RowKind, RowLayout};
use kestrel::engine::request::SpecMethod;
use kestrel::backend::sampling::SamplingParams;
use kestrel::engine::EngineConfig;
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::weights::gguf::{GgufArray, GgufFile, GgufTensor, GgufValue, GgufWriter};
use kestrel::model::weights::Dtype;
use kestrel::model::ModelFiles;
use kestrel::tokenizer::ChatMessage;
use std::path::{Path, PathBuf};

fn gguf_path(name: &str) -> PathBuf {
    fixture_dir("gguf").join(format!("{name}.gguf"))
}

fn load(path: &Path) -> (ModelFiles, Qwen35<CpuBackend>) {
    let files = ModelFiles::open(Some(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let model = Qwen35::load(&CpuBackend::new().with_f32_activations(), files.config.clone(), &files.store, &ProgressBar::hidden()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (files, model)
}

fn gguf_load_error(path: &Path) -> String {
    let files = match ModelFiles::open(Some(path)) {
        Err(e) => return e.to_string(),
        Ok(f) => f,
    };
    match Qwen35::load(&CpuBackend::new().with_f32_activations(), files.config.clone(), &files.store, &ProgressBar::hidden()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("{} loaded without error", path.display()),
    }
}

type TensorEdit = (String, Vec<u64>, u32, Vec<u8>);

/// Writes `src` to `dst` with metadata and tensors passed through the edits (`None` drops).
fn rewrite(src: &Path, dst: &Path, meta: impl Fn(&str, &GgufValue) -> Option<GgufValue>, tensor: impl Fn(&GgufTensor, &[u8]) -> Option<TensorEdit>) {
    let file = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        if let Some(v) = meta(k, v) {
            w = w.metadata(k, v);
        }
    }
    for t in file.tensors() {
        if let Some((name, dims, ty, data)) = tensor(t, file.tensor_bytes(t).unwrap()) {
            w = w.tensor(&name, &dims, ty, data);
        }
    }
    std::fs::write(dst, w.to_bytes()).unwrap();
}

fn keep(t: &GgufTensor, data: &[u8]) -> Option<TensorEdit> {
    Some((t.name().to_string(), t.dims().to_vec(), t.ggml_type(), data.to_vec()))
}

fn greedy(model: Qwen35<CpuBackend>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut e = engine(model, EngineConfig { max_num_seqs: 1, ..EngineConfig::default() });
    run_staggered(&mut e, vec![request(prompt, n, SamplingParams::greedy(), Some(SpecMethod::None))], &[0]).remove(0)
}

/// The tolerance of tests/hf_fixtures.rs, except for qwen3-next: its checkpoint is F16, and the
/// converter computes `1 + w` for the norms and `-exp(A_log)` in the tensor's own dtype (torch
/// keeps f16 arithmetic in f16), rounding them to f16 before storing them as F32. That moves the
/// logits by 2.5e-3 (measured); `f16_rounding_is_all_that_separates_qwen3_next` shows it is
/// the only difference. BF16 checkpoints, Qwen's releases among them, are widened to f32 first
/// and convert exactly, as qwen35-dense does here.
fn logit_tolerance(name: &str) -> f32 {
    if name == "qwen3-next" {
        3e-3
    } else {
        1e-3
    }
}

#[test]
fn logits_match_transformers() {
    for name in FIXTURES {
        let r = reference(name);
        let (_, model) = load(&gguf_path(name));
        let logits = prefill_logits(&model, &r.prompt_ids, r.prompt_ids.len());
        let err = relative_error(&logits, &r.logits);
        assert!(err < logit_tolerance(name), "{name}.gguf: relative logit error {err}");
    }
}

/// qwen3-next.gguf with its norms and `ssm_a` recomputed in f32 from the HF checkpoint matches
/// the HF logits as closely as the HF directory does.
#[test]
fn f16_rounding_is_all_that_separates_qwen3_next() {
    let hf = ModelFiles::open_dir(&fixture_dir("qwen3-next")).unwrap().store;
    let hf_source = |gguf_name: &str| -> Option<(String, bool)> {
        let (blk, rest) = match gguf_name.strip_prefix("blk.") {
            Some(tail) => tail.split_once('.')?,
            None => return (gguf_name == "output_norm.weight").then(|| ("model.norm.weight".to_string(), true)),
        };
        let p = format!("model.layers.{blk}.");
        Some(match rest {
            "attn_norm.weight" => (format!("{p}input_layernorm.weight"), true),
            "post_attention_norm.weight" => (format!("{p}post_attention_layernorm.weight"), true),
            "attn_q_norm.weight" => (format!("{p}self_attn.q_norm.weight"), true),
            "attn_k_norm.weight" => (format!("{p}self_attn.k_norm.weight"), true),
            "ssm_a" => (format!("{p}linear_attn.A_log"), false),
            _ => return None,
        })
    };
    let (_dir, path) = edited("qwen3-next", |_, v| Some(v.clone()), |t, d| {
        let Some((hf_name, is_norm)) = hf_source(t.name()) else { return keep(t, d) };
        let w = hf.get(&hf_name).unwrap().to_f32().unwrap();
        let v: Vec<f32> = w.iter().map(|x| if is_norm { 1.0 + x } else { -x.exp() }).collect();
        Some((t.name().to_string(), t.dims().to_vec(), 0, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
    });
    let r = reference("qwen3-next");
    let (_, model) = load(&path);
    let err = relative_error(&prefill_logits(&model, &r.prompt_ids, r.prompt_ids.len()), &r.logits);
    assert!(err < 1e-4, "relative logit error {err}");
}

#[test]
fn greedy_continuation_matches_transformers() {
    for name in FIXTURES {
        let r = reference(name);
        let (_, model) = load(&gguf_path(name));
        assert_eq!(greedy(model, &r.prompt_ids, r.greedy_ids.len()), r.greedy_ids, "{name}.gguf: greedy continuation differs");
    }
}

#[test]
fn configs_match_the_hf_checkpoints() {
    for name in FIXTURES {
        let hf = ModelFiles::open_dir(&fixture_dir(name)).unwrap().config;
        let mut gguf = ModelFiles::open(Some(&gguf_path(name))).unwrap().config;
        // GGUF stop tokens also hold <|endoftext|>, which llama.cpp ends generation at.
        assert!(gguf.eos_token_ids.iter().all(|id| [0, 2].contains(id)) && gguf.eos_token_ids.contains(&2), "{name}: {:?}", gguf.eos_token_ids);
        gguf.eos_token_ids = hf.eos_token_ids.clone();
        gguf.model_type = hf.model_type.clone();
        // Qwen3.5 files keep the output projection's columns in the converter's tiled head
        // order, which the delta rule's output follows (Qwen3-Next's keep the grouped order).
        let l = &gguf.linear;
        let tiled = name != "qwen3-next" && l.num_key_heads > 1 && l.heads_per_key_head() > 1;
        assert_eq!(l.out_heads_tiled, tiled, "{name}: out_heads_tiled");
        assert!(!hf.linear.out_heads_tiled, "{name}");
        gguf.linear.out_heads_tiled = false;
        assert_eq!(gguf, hf, "{name}");
    }
}

/// Every tensor both stores hold under one name has one shape and the same values, up to the
/// conversion's rounding (F32 to F16 for the MoE fixture, `1 + w` and `-exp(A_log)` in f16 for
/// qwen3-next).
#[test]
fn shared_tensors_match_the_hf_checkpoints() {
    for name in FIXTURES {
        let hf = ModelFiles::open_dir(&fixture_dir(name)).unwrap().store;
        let gguf_files = ModelFiles::open(Some(&gguf_path(name))).unwrap();
        let (gguf, gguf_config) = (gguf_files.store, gguf_files.config);
        let mut compared = 0;
        for hf_name in hf.names() {
            let n = &hf_name.replace("model.language_model.", "model.");
            if !gguf.contains(n) {
                // The stacked experts and Qwen3-Next's packed projections are split in GGUF.
                assert!(n.contains("experts.") || n.ends_with("in_proj_qkvz.weight") || n.ends_with("in_proj_ba.weight"), "{name}: {n} is missing from the GGUF store");
                continue;
            }
            let (a, b) = (hf.get(hf_name).unwrap(), gguf.get(n).unwrap());
            assert_eq!(a.shape, b.shape, "{name}: {n}");
            let (a, mut b) = (a.to_f32().unwrap(), b.to_f32().unwrap());
            let l = &gguf_config.linear;
            if l.out_heads_tiled && n.ends_with("linear_attn.out_proj.weight") {
                // Its columns are in the tiled head order: value head h's at out_head(h).
                let (cols, dv) = (l.value_dim(), l.value_head_dim);
                b = b.chunks_exact(cols).flat_map(|row| (0..l.num_value_heads).flat_map(move |h| row[l.out_head(h) * dv..(l.out_head(h) + 1) * dv].to_vec())).collect();
            }
            let scale = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
            let err = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
            assert!(err < 2e-3, "{name}: {n} differs by {err} of its largest value");
            compared += 1;
        }
        assert!(compared > 40, "{name}: only {compared} tensors compared");
    }
    assert!(ModelFiles::open(Some(&gguf_path("qwen35-dense"))).unwrap().store.contains("mtp.fc.weight"), "the nextn block is the MTP head");
}

#[test]
fn tokenizer_matches_the_hf_tokenizer() {
    let prompt = "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n";
    let chat = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "hi <|im_end|> there")];
    for name in FIXTURES {
        let hf = ModelFiles::open_dir(&fixture_dir(name)).unwrap().tokenizer;
        let gguf = ModelFiles::open(Some(&gguf_path(name))).unwrap().tokenizer;
        let ids = hf.encode(prompt, false).unwrap();
        assert_eq!(gguf.encode(prompt, false).unwrap(), ids, "{name}");
        assert_eq!(gguf.encode(prompt, true).unwrap(), hf.encode(prompt, true).unwrap(), "{name}");
        let r = reference(name);
        assert_eq!(gguf.decode(&r.greedy_ids, false).unwrap(), hf.decode(&r.greedy_ids, false).unwrap(), "{name}");
        assert_eq!(gguf.decode(&r.greedy_ids, true).unwrap(), hf.decode(&r.greedy_ids, true).unwrap(), "{name}");
        assert_eq!(gguf.apply_chat_template(&chat, true, None).unwrap(), hf.apply_chat_template(&chat, true, None).unwrap(), "{name}");
        assert_eq!(gguf.token_to_id("<|im_end|>"), Some(2), "{name}");
    }
}

/// Logits of the MTP head over a prefilled prompt (each position fed the next prompt token).
fn mtp_logits(model: &Qwen35<CpuBackend>, ids: &[u32]) -> Vec<f32> {
    let b = CpuBackend::new().with_f32_activations();
    let mut cache = b.alloc_cache(&model.cache_spec(64, 16, 1, 0)).unwrap();
    b.reset_states(&mut cache, &[0]);
    let layout = BatchLayout { rows: vec![RowLayout { kind: RowKind::Prefill, token_start: 0, num_tokens: ids.len(), start_position: 0, block_table: (0..64).collect(), state_slot: 0, snapshot_base: 0 }] };
    let rows: Vec<u32> = (0..ids.len() as u32).collect();
    let out = model.forward(&b, ids, &layout, &rows, &mut cache);
    let next: Vec<u32> = ids[1..].iter().copied().chain([0]).collect();
    let mtp = model.mtp.as_ref().expect("an MTP head");
    b.to_host(&mtp.forward(model, &b, &next, &out.hidden, &layout, &rows, &mut cache).logits)
}

/// The MTP head comes from the nextn block: it predicts what the HF checkpoint's head does, and
/// drafting with it leaves the greedy continuation as it is.
#[test]
fn mtp_head_matches_the_hf_checkpoint() {
    let r = reference("qwen35-dense");
    let (_, gguf) = load(&gguf_path("qwen35-dense"));
    let (_, hf) = load_model(&fixture_dir("qwen35-dense"));
    let err = relative_error(&mtp_logits(&gguf, &r.prompt_ids), &mtp_logits(&hf, &r.prompt_ids));
    assert!(err < 1e-4, "MTP logits: relative error {err}");
    let mut e = engine(gguf, EngineConfig { max_num_seqs: 1, spec: SpecMethod::Mtp, spec_tokens: 3, ..EngineConfig::default() });
    let out = run_staggered(&mut e, vec![request(&r.prompt_ids, r.greedy_ids.len(), SamplingParams::greedy(), None)], &[0]).remove(0);
    assert_eq!(out, r.greedy_ids);
    assert!(e.stats.spec.drafted > 0, "never drafted");
}

/// The quantized fixture against itself with every block-type tensor dequantized to F32: the
/// CPU matmul reads a weight row by dequantizing it, so the two must agree to rounding. The
/// F32 copy reorders the tiled value heads of `ssm_out` per element, the quantized one per block.
#[test]
fn quantized_file_equals_its_dequantized_model() {
    let quant = gguf_path("qwen35-moe-quant");
    let dir = tempfile::tempdir().unwrap();
    let f32_copy = dir.path().join("f32.gguf");
    rewrite(&quant, &f32_copy, |_, v| Some(v.clone()), |t, data| {
        let dtype = t.dtype().unwrap();
        if dtype.block_elems() == 1 {
            return keep(t, data);
        }
        let values = kestrel_quant::dequantize(dtype, data).unwrap();
        Some((t.name().to_string(), t.dims().to_vec(), 0, values.iter().flat_map(|v| v.to_le_bytes()).collect()))
    });

    let (files, model) = load(&quant);
    let types: Vec<Dtype> = GgufFile::open(&quant).unwrap().tensors().map(|t| t.dtype().unwrap()).collect();
    assert!(types.contains(&Dtype::Q4K) && types.contains(&Dtype::Q8_0), "{types:?}");
    let store = &files.store;
    assert_eq!(store.get("model.layers.0.linear_attn.out_proj.weight").unwrap().dtype, Dtype::Q8_0);
    assert_eq!(store.get("model.layers.0.mlp.experts.gate_up_proj").unwrap().dtype, Dtype::Q4K);
    assert_eq!(store.get("model.embed_tokens.weight").unwrap().dtype, Dtype::Q4K);
    let (_, reference) = load(&f32_copy);

    let ids: Vec<u32> = (0..48u32).map(|i| (i * 37 + 11) % 512).collect();
    let got = prefill_logits(&model, &ids, ids.len());
    let want = prefill_logits(&reference, &ids, ids.len());
    let err = relative_error(&got, &want);
    assert!(err < 1e-5, "quantized vs dequantized: relative logit error {err}");
    let spread = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(spread > 1.0 && want.iter().all(|v| v.is_finite()), "degenerate logits (max |logit| {spread})");
    assert_eq!(greedy(model, &ids, 16), greedy(reference, &ids, 16));
}

/// Values of a fixed xorshift64* sequence, for weights a test makes up.
fn pseudo_random(seed: u64) -> impl Iterator<Item = u64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    std::iter::repeat_with(move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    })
}

/// `n` values uniform in (-scale, scale).
fn uniform(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    pseudo_random(seed).take(n).map(|x| ((x >> 40) as f32 / (1u32 << 23) as f32 - 1.0) * scale).collect()
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The 256-value block types, with the byte offsets of the f16 scales in a block (`d`, and
/// `dmin` where there is one).
const WIDE_BLOCK_TYPES: [(Dtype, &[usize]); 4] = [(Dtype::Q4K, &[0, 2]), (Dtype::Q5K, &[0, 2]), (Dtype::Q6K, &[208]), (Dtype::IQ4XS, &[0])];

/// `blocks` blocks of `dtype` with random quants and sub-block scales, their f16 scales set to
/// 2^-14 so that the values stay below 1.
fn random_blocks(dtype: Dtype, scale_offsets: &[usize], blocks: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = pseudo_random(dtype.block_bytes() as u64).take(blocks * dtype.block_bytes()).map(|x| (x >> 56) as u8).collect();
    for block in bytes.chunks_exact_mut(dtype.block_bytes()) {
        for &at in scale_offsets {
            block[at..at + 2].copy_from_slice(&0x0400u16.to_le_bytes());
        }
    }
    bytes
}

/// qwen35-moe-quant with its linear-attention layer widened from 4 to 8 value heads of 32
/// columns (4 per key head rather than 2), so that a row of `ssm_out` is one 256-value block
/// holding 8 heads, as in a K-quant Qwen3.5 file. The layer gets made-up F32 weights, and
/// `ssm_out` (dims [256, 256]) the given ggml type and bytes.
fn wide_value_heads(dst: &Path, ssm_out_type: u32, ssm_out: &[u8]) {
    let (h, conv_dim, nv) = (256u64, 2 * 2 * 16 + 256u64, 8u64);
    let meta = |k: &str, v: &GgufValue| {
        Some(match k {
            "qwen35moe.ssm.time_step_rank" => GgufValue::from(nv as u32),
            "qwen35moe.ssm.inner_size" => GgufValue::from(256u32),
            _ => v.clone(),
        })
    };
    let tensor = |t: &GgufTensor, data: &[u8]| {
        let f32_tensor = |dims: Vec<u64>, values: Vec<f32>| Some((t.name().to_string(), dims, 0, f32_bytes(&values)));
        let matrix = |seed: u64, dims: [u64; 2]| f32_tensor(dims.to_vec(), uniform(seed, (dims[0] * dims[1]) as usize, (3.0 / dims[0] as f32).sqrt()));
        match t.name() {
            "blk.0.attn_qkv.weight" => matrix(1, [h, conv_dim]),
            "blk.0.attn_gate.weight" => matrix(2, [h, 256]),
            "blk.0.ssm_beta.weight" => matrix(3, [h, nv]),
            "blk.0.ssm_alpha.weight" => matrix(4, [h, nv]),
            "blk.0.ssm_conv1d.weight" => f32_tensor(vec![4, conv_dim], uniform(5, 4 * conv_dim as usize, 0.5)),
            "blk.0.ssm_dt.bias" => f32_tensor(vec![nv], uniform(6, nv as usize, 1.0)),
            // -exp(A_log) for A_log in (0, ln 16).
            "blk.0.ssm_a" => f32_tensor(vec![nv], uniform(7, nv as usize, 7.5).iter().map(|u| -8.5 - u).collect()),
            "blk.0.ssm_out.weight" => Some((t.name().to_string(), vec![256, h], ssm_out_type, ssm_out.to_vec())),
            _ => keep(t, data),
        }
    };
    rewrite(&gguf_path("qwen35-moe-quant"), dst, meta, tensor);
}

/// K-quant Qwen3.5 files store `ssm_out` in 256-value blocks, wider than a value head, so its
/// tiled value heads (columns) cannot be put back in grouped order by moving blocks. The loader
/// keeps the tensor as stored, in the file's order, and the delta rule writes its output heads
/// in that order: the model must compute what the same file with that tensor stored as F32
/// gives (`logits_match_transformers` checks that order against transformers).
#[test]
fn tiled_heads_inside_quantized_blocks_stay_quantized() {
    let out_proj = "model.layers.0.linear_attn.out_proj.weight";
    let ids: Vec<u32> = (0..32u32).map(|i| (i * 37 + 11) % 512).collect();
    for (dtype, scale_offsets) in WIDE_BLOCK_TYPES {
        let dir = tempfile::tempdir().unwrap();
        let (quant, f32_copy) = (dir.path().join("quant.gguf"), dir.path().join("f32.gguf"));
        let blocks = random_blocks(dtype, scale_offsets, 256);
        let file_order = kestrel_quant::dequantize(dtype, &blocks).unwrap();
        let largest = file_order.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(file_order.iter().all(|v| v.is_finite()) && largest > 0.01 && largest < 1.0, "{dtype}: largest value {largest}");
        wide_value_heads(&quant, dtype.ggml_type().unwrap(), &blocks);
        wide_value_heads(&f32_copy, 0, &f32_bytes(&file_order));

        let (files, model) = load(&quant);
        let (_, reference) = load(&f32_copy);
        assert!(files.config.linear.out_heads_tiled, "{dtype}: tiled output heads");
        let got = files.store.get(out_proj).unwrap();
        assert_eq!((got.dtype, got.shape), (dtype, &[256, 256][..]), "{dtype}: stored as the file holds it");
        assert!(got.to_f32().unwrap() == file_order, "{dtype}: out_proj is not the file's");

        let want = prefill_logits(&reference, &ids, ids.len());
        let err = relative_error(&prefill_logits(&model, &ids, ids.len()), &want);
        assert!(err < 1e-6, "{dtype}: relative logit error {err}");
        assert!(want.iter().all(|v| v.is_finite()) && want.iter().any(|v| v.abs() > 1.0), "{dtype}: degenerate logits");
    }
}

/// Qwen3-Next files from before the converter split `in_proj_qkvz` hold it whole (`ssm_in`,
/// grouped per key head as in HF) with `ssm_ba`; llama.cpp still reads them.
#[test]
fn legacy_qwen3_next_layout_gives_the_same_logits() {
    let src = gguf_path("qwen3-next");
    let dir = tempfile::tempdir().unwrap();
    let legacy = dir.path().join("legacy.gguf");
    let file = GgufFile::open(&src).unwrap();
    let (nk, dk, nv, dv) = (2usize, 16usize, 4usize, 24usize);
    let r = nv / nk;
    rewrite(&src, &legacy, |_, v| Some(v.clone()), |t, data| {
        let name = t.name();
        if name.ends_with("attn_gate.weight") {
            return None;
        }
        if !name.ends_with("attn_qkv.weight") || !name.starts_with("blk.") || file.tensor_info(&name.replace("attn_qkv", "ssm_out")).is_none() {
            return keep(t, data);
        }
        let (_, gate) = file.tensor(&name.replace("attn_qkv", "attn_gate")).unwrap();
        let row = t.dims()[0] as usize * 2;
        let rows = |src: &[u8], from: usize, n: usize| src[from * row..(from + n) * row].to_vec();
        let mut out = Vec::new();
        for g in 0..nk {
            out.extend(rows(data, g * dk, dk));
            out.extend(rows(data, nk * dk + g * dk, dk));
            out.extend(rows(data, 2 * nk * dk + g * r * dv, r * dv));
            out.extend(rows(gate, g * r * dv, r * dv));
        }
        let total = (out.len() / row) as u64;
        Some((name.replace("attn_qkv", "ssm_in"), vec![t.dims()[0], total], t.ggml_type(), out))
    });
    let (files, model) = load(&legacy);
    assert!(files.store.contains("model.layers.0.linear_attn.in_proj_qkvz.weight"));
    let (_, split) = load(&src);
    let ids = reference("qwen3-next").prompt_ids;
    let err = relative_error(&prefill_logits(&model, &ids, ids.len()), &prefill_logits(&split, &ids, ids.len()));
    assert!(err < 1e-5, "legacy layout: relative logit error {err}");
}

// ---------------------------------------------------------------------------------------------
// Errors name what is wrong

/// A copy of fixture `name` whose tensor `tensor` is stored as ggml type `ggml_type` (zero
/// blocks of `block_elems` values in `block_bytes` bytes).
fn with_tensor_type(name: &str, tensor: &str, ggml_type: u32, block_elems: usize, block_bytes: usize) -> (tempfile::TempDir, PathBuf) {
    edited(name, |_, v| Some(v.clone()), |t, d| {
        if t.name() != tensor {
            return keep(t, d);
        }
        let blocks = t.n_elements() as usize / block_elems;
        Some((t.name().to_string(), t.dims().to_vec(), ggml_type, vec![0u8; blocks * block_bytes]))
    })
}

fn edited(name: &str, meta: impl Fn(&str, &GgufValue) -> Option<GgufValue>, tensor: impl Fn(&GgufTensor, &[u8]) -> Option<TensorEdit>) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{name}.gguf"));
    rewrite(&gguf_path(name), &path, meta, tensor);
    (dir, path)
}

#[test]
fn unsupported_architecture_is_named() {
    let (_dir, path) = edited("qwen35-dense", |k, v| Some(if k == "general.architecture" { GgufValue::from("llama") } else { v.clone() }), keep);
    let msg = gguf_load_error(&path);
    assert!(msg.contains("architecture `llama` is not supported") && msg.contains("qwen35, qwen35moe, qwen3next"), "{msg}");
}

#[test]
fn missing_tensor_is_named() {
    let (_dir, path) = edited("qwen35-dense", |_, v| Some(v.clone()), |t, d| (t.name() != "blk.2.ssm_out.weight").then(|| keep(t, d)).flatten());
    let msg = gguf_load_error(&path);
    assert!(msg.contains("missing tensor `blk.2.ssm_out.weight`") && msg.contains("model.layers.2.linear_attn.out_proj.weight"), "{msg}");
}

#[test]
fn missing_metadata_key_is_named() {
    let (_dir, path) = edited("qwen35-moe", |k, v| (k != "qwen35moe.ssm.group_count").then(|| v.clone()), keep);
    let msg = gguf_load_error(&path);
    assert!(msg.contains("missing metadata key `qwen35moe.ssm.group_count`"), "{msg}");
}

#[test]
fn unsupported_tensor_type_is_named() {
    // Q2_K (type 10) holds 256 values in 84 bytes; this tensor's rows are 256 wide.
    let (_dir, path) = with_tensor_type("qwen35-moe-quant", "blk.0.attn_gate.weight", 10, 256, 84);
    let msg = gguf_load_error(&path);
    assert!(msg.contains("blk.0.attn_gate.weight") && msg.contains("Q2_K") && msg.contains("not supported"), "{msg}");
}

#[test]
fn metadata_that_cannot_be_right_is_refused_naming_the_key() {
    for (key, value) in [
        ("qwen35.attention.layer_norm_rms_epsilon", GgufValue::F32(-1.0)),
        ("qwen35.attention.layer_norm_rms_epsilon", GgufValue::F32(f32::NAN)),
        ("qwen35.rope.freq_base", GgufValue::F32(0.0)),
        ("qwen35.block_count", GgufValue::U32(0)),
        ("qwen35.attention.head_count_kv", GgufValue::U32(3)),
        ("tokenizer.ggml.eos_token_id", GgufValue::U32(99_999)),
    ] {
        let (_dir, path) = edited("qwen35-dense", |k, v| Some(if k == key { value.clone() } else { v.clone() }), keep);
        let msg = gguf_load_error(&path);
        assert!(msg.contains(&format!("`{key}`")), "{key} = {value:?}: {msg}");
    }
}

/// Rows `rows..rows + extra` appended to a `[rows, width]` BF16 matrix: row `copy_of` times
/// `scale` at `at`, zeros elsewhere.
fn bf16_rows_appended(data: &[u8], width: usize, extra: usize, at: usize, copy_of: usize, scale: f32) -> Vec<u8> {
    let rows = data.len() / (2 * width);
    let mut out = data.to_vec();
    out.resize((rows + extra) * width * 2, 0);
    for c in 0..width {
        let i = 2 * (copy_of * width + c);
        let value = half::bf16::from_le_bytes([data[i], data[i + 1]]).to_f32() * scale;
        let j = 2 * (at * width + c);
        out[j..j + 2].copy_from_slice(&half::bf16::from_f32(value).to_le_bytes());
    }
    out
}

#[test]
fn a_padded_vocabulary_decodes_the_padding_the_model_generates() {
    // llama.cpp's converter pads the token list to the embedding's rows with `[PAD{id}]` tokens of
    // type UNUSED (5). Here 8 padded rows are added, and the output row of padded id 517 is made
    // to win the first draw: twice the logit of the reference's first greedy token (or half of a
    // negative one), so it is the greedy choice.
    let name = "qwen35-dense";
    let r = reference(name);
    let vocab = r.logits.len() / r.prompt_ids.len();
    let greedy = r.greedy_ids[0] as usize;
    let logit = r.logits[(r.prompt_ids.len() - 1) * vocab + greedy];
    let scale = if logit > 0.0 { 2.0 } else { 0.5 };
    let (extra, padded) = (8usize, vocab + 5);
    let (_dir, path) = edited(
        name,
        |k, v| match (k, v) {
            ("tokenizer.ggml.tokens", GgufValue::Array(GgufArray::String(tokens))) => {
                assert_eq!(tokens.len(), vocab, "the fixture's token list fills its embedding");
                Some(GgufValue::Array(GgufArray::String(tokens.iter().cloned().chain((vocab..vocab + extra).map(|i| format!("[PAD{i}]"))).collect())))
            }
            ("tokenizer.ggml.token_type", GgufValue::Array(GgufArray::I32(types))) => Some(GgufValue::Array(GgufArray::I32(types.iter().copied().chain(std::iter::repeat_n(5, extra)).collect()))),
            _ => Some(v.clone()),
        },
        |t, d| {
            if t.name() != "token_embd.weight" && t.name() != "output.weight" {
                return keep(t, d);
            }
            assert_eq!(t.ggml_type(), 30, "{} is BF16 in the fixture", t.name());
            let width = t.dims()[0] as usize;
            let scale = if t.name() == "output.weight" { scale } else { 1.0 };
            Some((t.name().to_string(), vec![width as u64, (vocab + extra) as u64], 30, bf16_rows_appended(d, width, extra, padded, greedy, scale)))
        },
    );
    let prompt = std::fs::read(fixture_dir(name).join("reference.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&prompt).unwrap();
    let text = meta.metadata().as_ref().unwrap()["prompt"].clone();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["run", "--model", path.to_str().unwrap(), &text, "-n", "6", "--json", "--device", "cpu"])
        .output()
        .unwrap();
    assert!(out.status.success(), "a generated padding id failed the run: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<u64> = v["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert_eq!(ids[0], padded as u64, "the padded id was not generated: {v}");
    // The padding decodes as nothing: the text is that of the other tokens.
    let files = ModelFiles::open(Some(&path)).unwrap();
    let rest: Vec<u32> = ids[1..].iter().map(|&i| i as u32).collect();
    assert_eq!(v["text"], files.tokenizer.decode(&rest, true).unwrap());
    assert!(files.tokenizer.decode(&[(vocab + extra) as u32], true).is_err(), "an id past the embedding must still fail");
}

#[test]
fn split_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model-00001-of-00003.gguf");
    let bytes = GgufWriter::new().metadata("general.architecture", "qwen35").metadata("split.count", 3u16).metadata("split.no", 0u16).to_bytes();
    std::fs::write(&path, bytes).unwrap();
    let msg = gguf_load_error(&path);
    assert!(msg.contains("part 1 of 3") && msg.contains("split"), "{msg}");
}

// ---------------------------------------------------------------------------------------------
// The command line

#[test]
fn kestrel_run_takes_a_gguf_file() {
    let r = reference("qwen35-dense");
    let prompt = std::fs::read(fixture_dir("qwen35-dense").join("reference.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&prompt).unwrap();
    let text = meta.metadata().as_ref().unwrap()["prompt"].clone();
    let path = gguf_path("qwen35-dense");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kestrel"))
        .args(["run", "--model", path.to_str().unwrap(), &text, "-n", "32", "--temperature", "0", "--json", "--device", "cpu"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], r.prompt_ids.len());
    let got: Vec<u32> = v["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    // The run stops before the first stop token (<|im_end|>, id 2, the 9th greedy token).
    assert_eq!(got[..], r.greedy_ids[..got.len()]);
    assert_eq!(v["finish_reason"], "stop");
    assert_eq!(r.greedy_ids[got.len()], 2);
}
