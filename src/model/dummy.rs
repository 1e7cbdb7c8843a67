//! `--load-format dummy`: real-size models with random weights, for benchmarks without files.
//!
//! A preset names a real model's dimensions (reference/architecture.md §6). The weight store
//! built here has every tensor the loader asks for: small vectors (norms, conv kernels, gate
//! constants) hold random host values, while matrices are shape-only entries over one
//! untouched anonymous mapping; the backend, switched to random weights, fills each matrix on
//! the device and never reads those bytes.

use crate::backend::{Backend, BackendError};
use crate::model::arch::qwen35::{LoadError, Qwen35};
use crate::model::config::{ConfigError, LayerKind, ModelConfig, ModelFamily};
use crate::model::weights::{Dtype, SharedBytes, TensorEntry, WeightStore};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const PRESETS: [&str; 5] = ["qwen3.5-0.8b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"];

#[derive(Debug, thiserror::Error)]
pub enum DummyError {
    #[error("unknown model preset `{0}` (known: qwen3.5-0.8b, qwen3.5-9b, qwen3.5-27b, qwen3.5-35b-a3b, qwen3-next-80b-a3b)")]
    UnknownPreset(String),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot map placeholder memory for the dummy weights: {0}")]
    Map(std::io::Error),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("--load-format dummy: {0}")]
    Backend(#[from] BackendError),
}

fn preset_json(name: &str) -> Option<String> {
    let linear = |nk: usize, nv: usize| format!(r#""linear_num_key_heads":{nk},"linear_num_value_heads":{nv},"linear_key_head_dim":128,"linear_value_head_dim":128,"linear_conv_kernel_dim":4"#);
    let common = r#""head_dim":256,"rms_norm_eps":1e-6,"full_attention_interval":4,"partial_rotary_factor":0.25,"max_position_embeddings":262144"#;
    let dense = |h: usize, l: usize, nq: usize, nkv: usize, i: usize, nv: usize, tie: bool| {
        format!(r#"{{"model_type":"qwen3_5_text","vocab_size":248320,"hidden_size":{h},"num_hidden_layers":{l},"num_attention_heads":{nq},"num_key_value_heads":{nkv},"intermediate_size":{i},"tie_word_embeddings":{tie},"rope_theta":10000000,{common},{}}}"#, linear(16, nv))
    };
    Some(match name {
        "qwen3.5-0.8b" => dense(1024, 24, 8, 2, 3584, 16, true),
        "qwen3.5-9b" => dense(4096, 32, 16, 4, 12288, 32, false),
        "qwen3.5-27b" => dense(5120, 64, 24, 4, 17408, 48, false),
        "qwen3.5-35b-a3b" => format!(
            r#"{{"model_type":"qwen3_5_moe_text","vocab_size":248320,"hidden_size":2048,"num_hidden_layers":40,"num_attention_heads":16,"num_key_value_heads":2,"num_experts":256,"num_experts_per_tok":8,"moe_intermediate_size":512,"shared_expert_intermediate_size":512,"tie_word_embeddings":false,"rope_theta":10000000,{common},{}}}"#,
            linear(16, 32)
        ),
        "qwen3-next-80b-a3b" => format!(
            r#"{{"model_type":"qwen3_next","vocab_size":151936,"hidden_size":2048,"num_hidden_layers":48,"num_attention_heads":16,"num_key_value_heads":2,"num_experts":512,"num_experts_per_tok":10,"moe_intermediate_size":512,"shared_expert_intermediate_size":512,"norm_topk_prob":true,"tie_word_embeddings":false,"rope_theta":10000000,{common},{}}}"#,
            linear(16, 32)
        ),
        _ => return None,
    })
}

/// The configuration of a preset.
pub fn preset_config(name: &str) -> Result<ModelConfig, DummyError> {
    let json = preset_json(name).ok_or_else(|| DummyError::UnknownPreset(name.to_string()))?;
    Ok(ModelConfig::from_json_str(&json, Path::new(&format!("preset {name}")))?)
}

/// Tensors the loader reads, split into matrices (random on the device) and vectors (random
/// on the host, with the value range each parameter has in a trained model).
struct Plan {
    matrices: Vec<(String, Vec<usize>)>,
    vectors: Vec<(String, Vec<usize>, VectorKind)>,
}

#[derive(Clone, Copy)]
enum VectorKind {
    /// Zero-centred norm weight (the model uses 1 + w).
    NormOffset,
    /// Plain norm weight around 1.
    Norm,
    ConvKernel,
    ALog,
    DtBias,
}

fn plan(c: &ModelConfig) -> Plan {
    let mut p = Plan { matrices: Vec::new(), vectors: Vec::new() };
    let h = c.hidden_size;
    let l = &c.linear;
    let mut m = |name: String, shape: &[usize]| p.matrices.push((name, shape.to_vec()));
    m("model.embed_tokens.weight".into(), &[c.vocab_size, h]);
    if !c.tie_word_embeddings {
        m("lm_head.weight".into(), &[c.vocab_size, h]);
    }
    let mut vectors = vec![("model.norm.weight".to_string(), vec![h], VectorKind::NormOffset)];
    for (i, kind) in c.layer_kinds.iter().enumerate() {
        let pre = format!("model.layers.{i}.");
        vectors.push((format!("{pre}input_layernorm.weight"), vec![h], VectorKind::NormOffset));
        vectors.push((format!("{pre}post_attention_layernorm.weight"), vec![h], VectorKind::NormOffset));
        match kind {
            LayerKind::LinearAttention => {
                let a = format!("{pre}linear_attn.");
                if c.family == ModelFamily::Qwen3Next {
                    let r = l.heads_per_key_head();
                    m(format!("{a}in_proj_qkvz.weight"), &[l.num_key_heads * (2 * l.key_head_dim + 2 * r * l.value_head_dim), h]);
                    m(format!("{a}in_proj_ba.weight"), &[2 * l.num_value_heads, h]);
                } else {
                    m(format!("{a}in_proj_qkv.weight"), &[l.conv_dim(), h]);
                    m(format!("{a}in_proj_z.weight"), &[l.value_dim(), h]);
                    m(format!("{a}in_proj_b.weight"), &[l.num_value_heads, h]);
                    m(format!("{a}in_proj_a.weight"), &[l.num_value_heads, h]);
                }
                m(format!("{a}out_proj.weight"), &[h, l.value_dim()]);
                vectors.push((format!("{a}conv1d.weight"), vec![l.conv_dim(), 1, l.conv_kernel], VectorKind::ConvKernel));
                vectors.push((format!("{a}A_log"), vec![l.num_value_heads], VectorKind::ALog));
                vectors.push((format!("{a}dt_bias"), vec![l.num_value_heads], VectorKind::DtBias));
                vectors.push((format!("{a}norm.weight"), vec![l.value_head_dim], VectorKind::Norm));
            }
            LayerKind::FullAttention => {
                let a = format!("{pre}self_attn.");
                let d = c.head_dim;
                m(format!("{a}q_proj.weight"), &[c.num_heads * d * 2, h]);
                m(format!("{a}k_proj.weight"), &[c.num_kv_heads * d, h]);
                m(format!("{a}v_proj.weight"), &[c.num_kv_heads * d, h]);
                m(format!("{a}o_proj.weight"), &[h, c.num_heads * d]);
                vectors.push((format!("{a}q_norm.weight"), vec![d], VectorKind::NormOffset));
                vectors.push((format!("{a}k_norm.weight"), vec![d], VectorKind::NormOffset));
            }
        }
        let mlp = format!("{pre}mlp.");
        match (&c.moe, c.moe_layers[i]) {
            (Some(moe), true) => {
                let (e, im) = (moe.num_experts, moe.expert_intermediate);
                m(format!("{mlp}gate.weight"), &[e, h]);
                m(format!("{mlp}experts.gate_up_proj"), &[e, 2 * im, h]);
                m(format!("{mlp}experts.down_proj"), &[e, h, im]);
                if moe.shared_intermediate > 0 {
                    let s = moe.shared_intermediate;
                    m(format!("{mlp}shared_expert.gate_proj.weight"), &[s, h]);
                    m(format!("{mlp}shared_expert.up_proj.weight"), &[s, h]);
                    m(format!("{mlp}shared_expert.down_proj.weight"), &[h, s]);
                    m(format!("{mlp}shared_expert_gate.weight"), &[1, h]);
                }
            }
            _ => {
                let im = c.intermediate_size;
                m(format!("{mlp}gate_proj.weight"), &[im, h]);
                m(format!("{mlp}up_proj.weight"), &[im, h]);
                m(format!("{mlp}down_proj.weight"), &[h, im]);
            }
        }
    }
    p.vectors = vectors;
    p
}

/// Uniform in [0, 1) from a splitmix64 stream.
fn uniform(state: &mut u64) -> f32 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 24) as f32
}

fn read_only_map(bytes: &[u8], len: usize) -> Result<SharedBytes, DummyError> {
    let mut map = memmap2::MmapOptions::new().len(len.max(1)).map_anon().map_err(DummyError::Map)?;
    map[..bytes.len()].copy_from_slice(bytes);
    Ok(SharedBytes::from_mmap(map.make_read_only().map_err(DummyError::Map)?))
}

/// A weight store with every tensor of `config`; see the module comment.
pub fn dummy_store(config: &ModelConfig, seed: u64) -> Result<WeightStore, DummyError> {
    let p = plan(config);
    let mut state = seed;
    let mut vector_bytes = Vec::new();
    let mut tensors = HashMap::new();
    for (name, shape, kind) in &p.vectors {
        let start = vector_bytes.len();
        for _ in 0..shape.iter().product::<usize>() {
            let u = uniform(&mut state);
            let v = match kind {
                VectorKind::NormOffset => (u - 0.5) * 0.1,
                VectorKind::Norm => 1.0 + (u - 0.5) * 0.1,
                VectorKind::ConvKernel => (u - 0.5) * 1.0,
                VectorKind::ALog => u * 2.0 - 1.0,
                VectorKind::DtBias => (u - 0.5) * 2.0,
            };
            vector_bytes.extend_from_slice(&v.to_le_bytes());
        }
        tensors.insert(name.clone(), TensorEntry { dtype: Dtype::F32, shape: shape.clone(), file: 0, start, end: vector_bytes.len() });
    }
    let mut largest = 0;
    for (name, shape) in &p.matrices {
        // In the format `--quantization` asks for (the backend fills them in it), else bf16.
        let cols = shape.last().copied().unwrap_or(0);
        let dtype = config.online_quantization.and_then(|q| q.target(name, cols, config.num_layers())).unwrap_or(Dtype::BF16);
        let elems = shape.iter().product::<usize>();
        let bytes = dtype.row_bytes(cols).map_or(elems * 2, |r| r * (elems / cols.max(1)));
        largest = largest.max(bytes);
        tensors.insert(name.clone(), TensorEntry { dtype, shape: shape.clone(), file: 1, start: 0, end: bytes });
    }
    let files = vec![
        (PathBuf::from("dummy/vectors"), read_only_map(&vector_bytes, vector_bytes.len())?),
        (PathBuf::from("dummy/matrices"), read_only_map(&[], largest)?),
    ];
    Ok(WeightStore::new(files, tensors, "dummy weights".to_string()))
}

/// Loads preset `name` with random weights made on the device.
pub fn load_dummy<B: Backend>(backend: &B, name: &str, seed: u64, progress: &indicatif::ProgressBar) -> Result<Qwen35<B>, DummyError> {
    load_random(backend, preset_config(name)?, seed, progress)
}

/// Loads a model of any configuration with random weights made on the device.
pub fn load_random<B: Backend>(backend: &B, config: ModelConfig, seed: u64, progress: &indicatif::ProgressBar) -> Result<Qwen35<B>, DummyError> {
    let store = dummy_store(&config, seed)?;
    load_from_dummy_store(backend, config, &store, seed, progress)
}

/// Loads `config` from a store made by [`dummy_store`] with the same seed.
pub fn load_from_dummy_store<B: Backend>(backend: &B, config: ModelConfig, store: &WeightStore, seed: u64, progress: &indicatif::ProgressBar) -> Result<Qwen35<B>, DummyError> {
    backend.set_random_weights(Some(seed))?;
    let model = Qwen35::load(backend, config, store, progress);
    backend.set_random_weights(None)?;
    Ok(model?)
}
