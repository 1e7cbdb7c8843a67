//! [`ModelConfig`] from a GGUF file's metadata, read as llama.cpp reads it
//! (`llama_model_qwen35::load_arch_hparams` and its qwen35moe / qwen3next siblings).
//!
//! The converter (`TextModel`, `Qwen2MoeModel` and `Qwen3NextModel.set_gguf_parameters`) writes:
//! `block_count` (trunk layers plus `nextn_predict_layers` MTP blocks), `context_length`,
//! `embedding_length`, `feed_forward_length` (when the config has `intermediate_size`),
//! `attention.head_count[_kv]`, `attention.key_length` = `value_length` = head_dim,
//! `attention.layer_norm_rms_epsilon`, `rope.freq_base`, `rope.dimension_count` (= head_dim x
//! partial_rotary_factor), `rope.dimension_sections` (MRoPE, ignored: text positions make it
//! plain RoPE), `expert_count`, `expert_used_count`, `expert_[shared_]feed_forward_length`,
//! `full_attention_interval`, and `ssm.{conv_kernel, state_size = key head dim, group_count =
//! key heads, time_step_rank = value heads, inner_size = value heads x value head dim}`.
//! `layer_types`, `mlp_only_layers` and `norm_topk_prob` are not written: llama.cpp derives the
//! layer kinds from `full_attention_interval` (or `attention.recurrent_layers`) and always
//! renormalizes the top-k routing weights; dense MLP layers are told by their tensors here.

use super::GgufModelError;
use crate::backend::shapes::{LinearAttnShape, MoeShape};
use crate::model::config::{LayerKind, ModelConfig, ModelFamily};
use crate::model::weights::gguf::{GgufArray, GgufError, GgufFile, GgufValue, OptionalKey};

/// Metadata of one architecture: `key("block_count")` is `qwen35.block_count`.
struct Meta<'a> {
    file: &'a GgufFile,
    arch: &'a str,
}

impl Meta<'_> {
    fn key(&self, name: &str) -> String {
        format!("{}.{name}", self.arch)
    }
    fn usize(&self, name: &str) -> Result<usize, GgufError> {
        Ok(self.file.get_u32(&self.key(name))? as usize)
    }
    fn opt_usize(&self, name: &str) -> Result<Option<usize>, GgufError> {
        Ok(self.file.get_u32(&self.key(name)).optional()?.map(|v| v as usize))
    }
    fn bad(&self, name: &str, reason: String) -> GgufModelError {
        GgufModelError::Metadata { path: self.file.path().to_path_buf(), key: self.key(name), reason }
    }
    /// The size of dimension `dim` (ne order) of a tensor, for sizes the metadata may omit.
    fn tensor_dim(&self, tensor: &str, dim: usize) -> Option<usize> {
        self.file.tensor_info(tensor).and_then(|t| t.dims().get(dim)).map(|&d| d as usize)
    }
}

pub(super) fn family(arch: &str) -> ModelFamily {
    match arch {
        "qwen35moe" => ModelFamily::Qwen35Moe,
        "qwen3next" => ModelFamily::Qwen3Next,
        _ => ModelFamily::Qwen35,
    }
}

pub(super) fn read(file: &GgufFile, arch: &str) -> Result<ModelConfig, GgufModelError> {
    let m = Meta { file, arch };
    let family = family(arch);
    let block_count = m.usize("block_count")?;
    if block_count == 0 {
        return Err(m.bad("block_count", "must be at least 1, got 0".into()));
    }
    let nextn = m.opt_usize("nextn_predict_layers")?.unwrap_or(0);
    if nextn >= block_count {
        return Err(m.bad("nextn_predict_layers", format!("{nextn} MTP blocks leave none of the {block_count} blocks for the model")));
    }
    let num_layers = block_count - nextn;
    let hidden_size = m.usize("embedding_length")?;
    if hidden_size == 0 {
        return Err(m.bad("embedding_length", "must be at least 1, got 0".into()));
    }
    let num_heads = m.usize("attention.head_count")?;
    if num_heads == 0 {
        return Err(m.bad("attention.head_count", "must be at least 1".into()));
    }
    let num_kv_heads = m.opt_usize("attention.head_count_kv")?.unwrap_or(num_heads);
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(m.bad("attention.head_count_kv", format!("{num_kv_heads} does not divide the {num_heads} attention heads")));
    }
    let head_dim = m.opt_usize("attention.key_length")?.unwrap_or(hidden_size / num_heads);
    if let Some(v) = m.opt_usize("attention.value_length")? {
        if v != head_dim {
            return Err(m.bad("attention.value_length", format!("{v} differs from the key length {head_dim}")));
        }
    }
    // llama.cpp rotates the whole head when rope.dimension_count is absent.
    let rotary_dim = m.opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
    if rotary_dim % 2 != 0 || rotary_dim > head_dim {
        return Err(m.bad("rope.dimension_count", format!("{rotary_dim} must be even and at most the head size {head_dim}")));
    }
    let rope_theta = f64::from(file.get_f32(&m.key("rope.freq_base")).optional()?.unwrap_or(10_000.0));
    // 0, negative or NaN would make every logit NaN or infinite.
    if !(rope_theta > 0.0 && rope_theta.is_finite()) {
        return Err(m.bad("rope.freq_base", format!("must be a positive number, got {rope_theta}")));
    }
    let rms_norm_eps = file.get_f32(&m.key("attention.layer_norm_rms_epsilon"))?;
    if !(rms_norm_eps > 0.0 && rms_norm_eps.is_finite()) {
        return Err(m.bad("attention.layer_norm_rms_epsilon", format!("must be a positive number, got {rms_norm_eps}")));
    }

    let mut linear = linear_config(&m)?;
    // Qwen3.5's converter tiles the value heads (heads.rs); the output projection's columns stay
    // tiled, and the delta rule writes its output in that order.
    linear.out_heads_tiled = family != ModelFamily::Qwen3Next && !super::heads::HeadOrder { num_key_heads: linear.num_key_heads, per_key: linear.heads_per_key_head() }.is_identity();
    let layer_kinds = layer_kinds(&m, num_layers, block_count)?;

    let vocab_size = m.tensor_dim("token_embd.weight", 1).ok_or_else(|| GgufModelError::MissingTensor {
        path: file.path().to_path_buf(),
        tensor: "token_embd.weight".into(),
        hf_name: "model.embed_tokens.weight".into(),
    })?;
    let (moe, moe_layers) = match family {
        ModelFamily::Qwen35 => (None, vec![false; num_layers]),
        ModelFamily::Qwen35Moe | ModelFamily::Qwen3Next => {
            let layers: Vec<bool> = (0..num_layers).map(|i| file.tensor_info(&format!("blk.{i}.ffn_gate_inp.weight")).is_some() || file.tensor_info(&format!("blk.{i}.ffn_gate.weight")).is_none()).collect();
            (Some(moe_config(&m, layers.iter().position(|&x| x).unwrap_or(0))?), layers)
        }
    };
    let intermediate_size = m.opt_usize("feed_forward_length")?.unwrap_or(0);
    if intermediate_size == 0 && moe_layers.iter().any(|moe| !moe) {
        return Err(GgufError::MissingKey { path: file.path().to_path_buf(), key: m.key("feed_forward_length") }.into());
    }
    // An MTP block with its own embedding or output head is not the shared-head block the
    // forward implements; the model still loads, without MTP.
    let dedicated_mtp = ["nextn.embed_tokens.weight", "nextn.shared_head_head.weight"].iter().any(|t| file.tensor_info(&format!("blk.{num_layers}.{t}")).is_some());

    Ok(ModelConfig {
        family,
        model_type: arch.to_string(),
        vocab_size,
        hidden_size,
        intermediate_size,
        layer_kinds,
        moe_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rotary_dim,
        rope_theta,
        rms_norm_eps,
        linear,
        moe,
        tie_word_embeddings: file.tensor_info("output.weight").is_none(),
        max_position_embeddings: m.usize("context_length")?,
        mtp_layers: if dedicated_mtp { 0 } else { nextn },
        eos_token_ids: Vec::new(),
        bos_token_id: None,
        quantization: None,
        online_quantization: None,
    })
}

fn linear_config(m: &Meta) -> Result<LinearAttnShape, GgufModelError> {
    let num_key_heads = m.usize("ssm.group_count")?;
    let num_value_heads = m.usize("ssm.time_step_rank")?;
    let inner_size = m.usize("ssm.inner_size")?;
    if num_key_heads == 0 || num_value_heads % num_key_heads != 0 {
        return Err(m.bad("ssm.time_step_rank", format!("{num_value_heads} value heads are not a multiple of the {num_key_heads} key heads (ssm.group_count)")));
    }
    if num_value_heads == 0 || inner_size % num_value_heads != 0 {
        return Err(m.bad("ssm.inner_size", format!("{inner_size} is not a multiple of the {num_value_heads} value heads")));
    }
    let conv_kernel = m.usize("ssm.conv_kernel")?;
    if conv_kernel == 0 {
        return Err(m.bad("ssm.conv_kernel", "must be at least 1".into()));
    }
    Ok(LinearAttnShape { num_key_heads, num_value_heads, key_head_dim: m.usize("ssm.state_size")?, value_head_dim: inner_size / num_value_heads, conv_kernel, out_heads_tiled: false })
}

/// Linear (recurrent) or full attention per trunk layer: `attention.recurrent_layers` when
/// present, else every `full_attention_interval`-th layer (default 4) is full attention.
fn layer_kinds(m: &Meta, num_layers: usize, block_count: usize) -> Result<Vec<LayerKind>, GgufModelError> {
    let kind = |recurrent: bool| if recurrent { LayerKind::LinearAttention } else { LayerKind::FullAttention };
    let key = "attention.recurrent_layers";
    if let Some(value) = m.file.get(&m.key(key)) {
        let flags: Vec<bool> = match value {
            GgufValue::Bool(b) => vec![*b; block_count],
            GgufValue::Array(GgufArray::Bool(v)) => v.clone(),
            GgufValue::Array(a) => a.to_integers().map(|v| v.into_iter().map(|x| x != 0).collect()).ok_or_else(|| m.bad(key, format!("expected bools, found {}", value.describe())))?,
            other => return Err(m.bad(key, format!("expected bools, found {}", other.describe()))),
        };
        if flags.len() < num_layers {
            return Err(m.bad(key, format!("{} entries for {num_layers} layers", flags.len())));
        }
        return Ok(flags[..num_layers].iter().map(|&r| kind(r)).collect());
    }
    let interval = m.opt_usize("full_attention_interval")?.unwrap_or(4);
    if interval == 0 {
        return Err(m.bad("full_attention_interval", "must be at least 1".into()));
    }
    Ok((0..num_layers).map(|i| kind((i + 1) % interval != 0)).collect())
}

/// The experts of an MoE model; sizes the metadata leaves out are read from layer `layer`'s
/// expert tensors.
fn moe_config(m: &Meta, layer: usize) -> Result<MoeShape, GgufModelError> {
    let num_experts = m.usize("expert_count")?;
    let top_k = m.usize("expert_used_count")?;
    if top_k == 0 || top_k > num_experts {
        return Err(m.bad("expert_used_count", format!("{top_k} must be between 1 and the {num_experts} experts")));
    }
    let expert_intermediate = match m.opt_usize("expert_feed_forward_length")? {
        Some(n) => n,
        None => m
            .tensor_dim(&format!("blk.{layer}.ffn_gate_exps.weight"), 1)
            .or_else(|| m.tensor_dim(&format!("blk.{layer}.ffn_gate_up_exps.weight"), 1).map(|n| n / 2))
            .ok_or_else(|| GgufError::MissingKey { path: m.file.path().to_path_buf(), key: m.key("expert_feed_forward_length") })?,
    };
    let shared_intermediate = match m.opt_usize("expert_shared_feed_forward_length")? {
        Some(n) => n,
        None => m.tensor_dim(&format!("blk.{layer}.ffn_gate_shexp.weight"), 1).unwrap_or(0),
    };
    Ok(MoeShape { num_experts, top_k, expert_intermediate, shared_intermediate, norm_topk_prob: true })
}
