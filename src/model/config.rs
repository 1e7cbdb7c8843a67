//! One normalized model configuration, read from a Hugging Face `config.json`.
//!
//! Qwen3.5 checkpoints nest the text settings under `text_config` (model_type `qwen3_5` /
//! `qwen3_5_moe`); the text-only classes (`qwen3_5_text`, `qwen3_5_moe_text`) and Qwen3-Next
//! (`qwen3_next`) are flat. Every family is mapped onto [`ModelConfig`].

use crate::backend::shapes::{LinearAttnShape, MoeShape};
use crate::model::weights::online::OnlineQuantization;
use crate::model::weights::quantized::QuantizationConfig;
use serde_json::Value;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} is not valid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path} has no `model_type`; cannot tell which architecture this is")]
    MissingModelType { path: PathBuf },
    #[error("{path}: unknown model_type `{model_type}` (supported: qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, qwen3_next)")]
    UnknownArchitecture { path: PathBuf, model_type: String },
    #[error("{path}: missing or invalid field `{field}`")]
    Field { path: PathBuf, field: String },
    #[error("{path}: `{field}` {reason}")]
    Invalid { path: PathBuf, field: String, reason: String },
    #[error("{path}: inconsistent configuration: {reason}")]
    Inconsistent { path: PathBuf, reason: String },
    #[error("{path}: quantization_config: {reason}")]
    Quantization { path: PathBuf, reason: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFamily {
    /// Qwen3.5 / Qwen3.6 dense.
    Qwen35,
    /// Qwen3.5 / Qwen3.6 mixture of experts.
    Qwen35Moe,
    /// Qwen3-Next (packed `in_proj_qkvz` / `in_proj_ba`).
    Qwen3Next,
}

impl ModelFamily {
    pub fn name(self) -> &'static str {
        match self {
            ModelFamily::Qwen35 => "qwen3.5",
            ModelFamily::Qwen35Moe => "qwen3.5-moe",
            ModelFamily::Qwen3Next => "qwen3-next",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (recurrent) layer.
    LinearAttention,
    /// Gated full attention layer with a KV cache.
    FullAttention,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub family: ModelFamily,
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Dense MLP width (0 when every layer is MoE).
    pub intermediate_size: usize,
    pub layer_kinds: Vec<LayerKind>,
    /// Per layer: true when its MLP is a mixture of experts.
    pub moe_layers: Vec<bool>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f32,
    pub linear: LinearAttnShape,
    pub moe: Option<MoeShape>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// Number of MTP modules shipped with the checkpoint (0 or 1 in practice).
    pub mtp_layers: usize,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// How the checkpoint's quantized linears are stored (`quantization_config`), if any are.
    pub quantization: Option<QuantizationConfig>,
    /// Quantization of float linears at load (`--quantization`), if asked for.
    pub online_quantization: Option<OnlineQuantization>,
}

impl ModelConfig {
    pub fn num_layers(&self) -> usize {
        self.layer_kinds.len()
    }

    pub fn full_attention_layers(&self) -> usize {
        self.layer_kinds.iter().filter(|k| **k == LayerKind::FullAttention).count()
    }

    /// An upper bound on the f32 activation memory of one forward over `tokens` tokens that
    /// computes `logit_rows` logits rows: the widest tensors a layer keeps alive at once
    /// (projections, conv output, the delta rule's chunk scratch, MLP or routed-expert
    /// intermediates), twice over for the allocator's fragmentation, plus the logits.
    pub fn activation_bytes(&self, tokens: usize, logit_rows: usize) -> usize {
        let attention = 2 * self.num_heads * self.head_dim + 2 * self.num_kv_heads * self.head_dim + self.num_heads * self.head_dim;
        // The chunked delta rule's scratch per token and value head: its rows of W and U, of
        // the chunk's P and its cumulative decay (backend/cuda/gdn.rs).
        let l = &self.linear;
        let chunk_scratch = l.num_value_heads * (l.key_head_dim + l.value_head_dim + crate::backend::DELTA_RULE_CHUNK + 1);
        let linear = 3 * l.conv_dim() + 3 * l.value_dim() + 2 * l.num_value_heads + chunk_scratch;
        let mlp = match &self.moe {
            Some(m) => self.intermediate_size.max(m.top_k * m.expert_intermediate + m.shared_intermediate) * 3 + m.num_experts,
            None => 3 * self.intermediate_size,
        };
        let per_token = 6 * self.hidden_size + attention.max(linear) + mlp;
        2 * 4 * (tokens * per_token + logit_rows * (self.vocab_size + self.hidden_size))
    }

    pub fn linear_attention_layers(&self) -> usize {
        self.layer_kinds.iter().filter(|k| **k == LayerKind::LinearAttention).count()
    }

    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        Self::from_json_str(&text, path)
    }

    /// Parses a config.json body; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let root: Value = serde_json::from_str(text).map_err(|source| ConfigError::Json { path: path.into(), source })?;
        let top_type = root.get("model_type").and_then(Value::as_str).ok_or_else(|| ConfigError::MissingModelType { path: path.into() })?;
        let (family, text_cfg) = match top_type {
            "qwen3_5" | "qwen3_5_moe" => {
                let family = if top_type == "qwen3_5" { ModelFamily::Qwen35 } else { ModelFamily::Qwen35Moe };
                let text = root.get("text_config").ok_or_else(|| field(path, "text_config"))?;
                (family, text)
            }
            "qwen3_5_text" => (ModelFamily::Qwen35, &root),
            "qwen3_5_moe_text" => (ModelFamily::Qwen35Moe, &root),
            "qwen3_next" => (ModelFamily::Qwen3Next, &root),
            other => return Err(ConfigError::UnknownArchitecture { path: path.into(), model_type: other.to_string() }),
        };
        parse_text_config(family, top_type, text_cfg, &root, path)
    }
}

fn field(path: &Path, name: &str) -> ConfigError {
    ConfigError::Field { path: path.into(), field: name.to_string() }
}

fn invalid(path: &Path, name: &str, reason: String) -> ConfigError {
    ConfigError::Invalid { path: path.into(), field: name.to_string(), reason }
}

/// Refuses a size of 0 (a model without layers, heads or vocabulary cannot run).
fn at_least_one(path: &Path, name: &str, value: usize) -> Result<usize, ConfigError> {
    if value == 0 {
        return Err(invalid(path, name, "must be at least 1, got 0".into()));
    }
    Ok(value)
}

/// Refuses a value that cannot be right for a positive constant (a norm epsilon, a rotary base):
/// 0, negative or NaN would make every logit NaN or infinite.
fn positive(path: &Path, name: &str, value: f64) -> Result<f64, ConfigError> {
    if !(value > 0.0 && value.is_finite()) {
        return Err(invalid(path, name, format!("must be a positive number, got {value}")));
    }
    Ok(value)
}

struct Fields<'a> {
    text: &'a Value,
    root: &'a Value,
    path: &'a Path,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.text.get(key).filter(|v| !v.is_null())
    }
    fn usize_req(&self, key: &str) -> Result<usize, ConfigError> {
        self.get(key).and_then(Value::as_u64).map(|v| v as usize).ok_or_else(|| field(self.path, key))
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_u64().map(|v| v as usize).ok_or_else(|| field(self.path, key)),
        }
    }
    fn f64_or(&self, key: &str, default: f64) -> Result<f64, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| field(self.path, key)),
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| field(self.path, key)),
        }
    }
    /// Token ids may be a number or a list, in the text config or at the top level.
    fn token_ids(&self, key: &str) -> Vec<u32> {
        let v = self.get(key).or_else(|| self.root.get(key));
        match v {
            Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
            _ => Vec::new(),
        }
    }
}

fn parse_text_config(family: ModelFamily, model_type: &str, text: &Value, root: &Value, path: &Path) -> Result<ModelConfig, ConfigError> {
    let f = Fields { text, root, path };
    let vocab_size = at_least_one(path, "vocab_size", f.usize_req("vocab_size")?)?;
    let hidden_size = at_least_one(path, "hidden_size", f.usize_req("hidden_size")?)?;
    let num_layers = at_least_one(path, "num_hidden_layers", f.usize_req("num_hidden_layers")?)?;
    let num_heads = at_least_one(path, "num_attention_heads", f.usize_req("num_attention_heads")?)?;
    let num_kv_heads = f.usize_or("num_key_value_heads", num_heads)?;
    let head_dim = at_least_one(path, "head_dim", f.usize_or("head_dim", hidden_size / num_heads)?)?;

    // rope: `rope_parameters` (transformers v5) or flat `rope_theta` / `partial_rotary_factor`.
    let rope = f.get("rope_parameters").or_else(|| f.get("rope_scaling"));
    let rope_theta = rope.and_then(|r| r.get("rope_theta")).and_then(Value::as_f64).map(Ok).unwrap_or_else(|| f.f64_or("rope_theta", 10_000_000.0))?;
    let rope_theta = positive(path, "rope_theta", rope_theta)?;
    let partial = rope
        .and_then(|r| r.get("partial_rotary_factor"))
        .and_then(Value::as_f64)
        .map(Ok)
        .unwrap_or_else(|| f.f64_or("partial_rotary_factor", 0.25))?;
    let rotary_dim = (head_dim as f64 * partial) as usize;
    if !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
        return Err(ConfigError::Inconsistent { path: path.into(), reason: format!("rotary dim {rotary_dim} must be even and <= head_dim {head_dim}") });
    }

    let layer_kinds: Vec<LayerKind> = match f.get("layer_types") {
        Some(Value::Array(list)) => list
            .iter()
            .map(|v| match v.as_str() {
                Some("linear_attention") => Ok(LayerKind::LinearAttention),
                Some("full_attention") => Ok(LayerKind::FullAttention),
                _ => Err(field(path, "layer_types")),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(field(path, "layer_types")),
        None => {
            let interval = f.usize_or("full_attention_interval", 4)?.max(1);
            (0..num_layers).map(|i| if (i + 1) % interval == 0 { LayerKind::FullAttention } else { LayerKind::LinearAttention }).collect()
        }
    };
    if layer_kinds.len() != num_layers {
        return Err(ConfigError::Inconsistent { path: path.into(), reason: format!("layer_types has {} entries but num_hidden_layers is {num_layers}", layer_kinds.len()) });
    }

    let size = |name: &str| -> Result<usize, ConfigError> { at_least_one(path, name, f.usize_req(name)?) };
    let linear = LinearAttnShape {
        num_key_heads: size("linear_num_key_heads")?,
        num_value_heads: size("linear_num_value_heads")?,
        key_head_dim: size("linear_key_head_dim")?,
        value_head_dim: size("linear_value_head_dim")?,
        conv_kernel: at_least_one(path, "linear_conv_kernel_dim", f.usize_or("linear_conv_kernel_dim", 4)?)?,
        out_heads_tiled: false,
    };
    if !linear.num_value_heads.is_multiple_of(linear.num_key_heads) {
        return Err(invalid(
            path,
            "linear_num_value_heads",
            format!("({}) must be a multiple of linear_num_key_heads ({})", linear.num_value_heads, linear.num_key_heads),
        ));
    }
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(invalid(path, "num_key_value_heads", format!("({num_kv_heads}) must divide num_attention_heads ({num_heads})")));
    }

    let intermediate_size = f.usize_or("intermediate_size", 0)?;
    let (moe, moe_layers) = match family {
        ModelFamily::Qwen35 => (None, vec![false; num_layers]),
        ModelFamily::Qwen35Moe | ModelFamily::Qwen3Next => {
            let num_experts = f.usize_req("num_experts")?;
            let moe = MoeShape {
                num_experts,
                top_k: f.usize_req("num_experts_per_tok")?,
                expert_intermediate: f.usize_req("moe_intermediate_size")?,
                shared_intermediate: f.usize_or("shared_expert_intermediate_size", 0)?,
                // Qwen3.5-MoE always renormalizes; Qwen3-Next follows its flag.
                norm_topk_prob: family == ModelFamily::Qwen35Moe || f.bool_or("norm_topk_prob", true)?,
            };
            if moe.top_k == 0 || moe.top_k > num_experts {
                return Err(field(path, "num_experts_per_tok"));
            }
            let mlp_only: Vec<usize> = match f.get("mlp_only_layers") {
                Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as usize).collect(),
                _ => Vec::new(),
            };
            let step = f.usize_or("decoder_sparse_step", 1)?.max(1);
            let layers: Vec<bool> = (0..num_layers).map(|i| !mlp_only.contains(&i) && num_experts > 0 && (i + 1) % step == 0).collect();
            if layers.iter().any(|m| !m) && intermediate_size == 0 {
                return Err(ConfigError::Inconsistent { path: path.into(), reason: "a dense MLP layer needs intermediate_size".into() });
            }
            (Some(moe), layers)
        }
    };
    if family == ModelFamily::Qwen35 && intermediate_size == 0 {
        return Err(field(path, "intermediate_size"));
    }

    let tie = text.get("tie_word_embeddings").or_else(|| root.get("tie_word_embeddings")).and_then(Value::as_bool).unwrap_or(false);
    let mtp_layers = f.usize_or("mtp_num_hidden_layers", f.usize_or("num_nextn_predict_layers", 0)?)?;

    let eos_token_ids = f.token_ids("eos_token_id");
    if let Some(&id) = eos_token_ids.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(invalid(path, "eos_token_id", format!("{id} is outside the vocabulary of {vocab_size} tokens")));
    }

    Ok(ModelConfig {
        family,
        model_type: model_type.to_string(),
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
        rms_norm_eps: positive(path, "rms_norm_eps", f.f64_or("rms_norm_eps", 1e-6)?)? as f32,
        linear,
        moe,
        tie_word_embeddings: tie,
        max_position_embeddings: at_least_one(path, "max_position_embeddings", f.usize_or("max_position_embeddings", 32768)?)?,
        mtp_layers,
        eos_token_ids,
        bos_token_id: f.token_ids("bos_token_id").first().copied(),
        quantization: QuantizationConfig::from_json(root.get("quantization_config")).map_err(|reason| ConfigError::Quantization { path: path.into(), reason })?,
        online_quantization: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const DENSE: &str = r#"{"model_type":"qwen3_5","tie_word_embeddings":false,"text_config":{
        "model_type":"qwen3_5_text","vocab_size":512,"hidden_size":64,"intermediate_size":96,
        "num_hidden_layers":6,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
        "linear_num_key_heads":2,"linear_num_value_heads":6,"linear_key_head_dim":16,"linear_value_head_dim":32,
        "rope_parameters":{"rope_theta":10000000,"partial_rotary_factor":0.25,"rope_type":"default"},
        "eos_token_id":2,"mtp_num_hidden_layers":1}}"#;

    #[test]
    fn parses_nested_qwen35() {
        let c = ModelConfig::from_json_str(DENSE, Path::new("config.json")).unwrap();
        assert_eq!(c.family, ModelFamily::Qwen35);
        assert_eq!(c.rotary_dim, 8);
        assert_eq!(c.layer_kinds[3], LayerKind::FullAttention);
        assert_eq!(c.layer_kinds[4], LayerKind::LinearAttention);
        assert_eq!(c.linear.conv_dim(), 2 * 32 + 192);
        assert_eq!(c.eos_token_ids, vec![2]);
        assert_eq!(c.mtp_layers, 1);
        assert!(!c.tie_word_embeddings);
    }

    #[test]
    fn unknown_model_type_is_named() {
        let err = ModelConfig::from_json_str(r#"{"model_type":"llama4"}"#, Path::new("x/config.json")).unwrap_err();
        assert!(err.to_string().contains("unknown model_type `llama4`"), "{err}");
    }

    #[test]
    fn missing_field_is_named() {
        let text = DENSE.replace("\"hidden_size\":64,", "");
        let err = ModelConfig::from_json_str(&text, Path::new("config.json")).unwrap_err();
        assert!(err.to_string().contains("`hidden_size`"), "{err}");
    }

    #[test]
    fn values_that_cannot_be_right_are_refused_naming_the_field() {
        for (from, to, field) in [
            ("\"linear_num_value_heads\":6", "\"linear_num_value_heads\":5", "linear_num_value_heads"),
            ("\"num_hidden_layers\":6", "\"num_hidden_layers\":0", "num_hidden_layers"),
            ("\"eos_token_id\":2", "\"eos_token_id\":[2, 512]", "eos_token_id"),
            ("\"eos_token_id\":2", "\"eos_token_id\":2,\"rms_norm_eps\":-1", "rms_norm_eps"),
            ("\"eos_token_id\":2", "\"eos_token_id\":2,\"rms_norm_eps\":0", "rms_norm_eps"),
            ("\"rope_theta\":10000000", "\"rope_theta\":0", "rope_theta"),
            ("\"rope_theta\":10000000", "\"rope_theta\":-5", "rope_theta"),
            ("\"num_key_value_heads\":2", "\"num_key_value_heads\":3", "num_key_value_heads"),
            ("\"num_attention_heads\":4", "\"num_attention_heads\":0", "num_attention_heads"),
            ("\"vocab_size\":512", "\"vocab_size\":0", "vocab_size"),
            ("\"linear_key_head_dim\":16", "\"linear_key_head_dim\":0", "linear_key_head_dim"),
        ] {
            assert!(DENSE.contains(from), "{from}");
            let err = ModelConfig::from_json_str(&DENSE.replace(from, to), Path::new("m/config.json")).expect_err(to);
            let message = err.to_string();
            assert!(message.contains(&format!("`{field}`")) && message.contains("m/config.json"), "{to}: {message}");
        }
    }

    #[test]
    fn qwen3_next_mlp_only_layers_are_dense() {
        let text = r#"{"model_type":"qwen3_next","vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":4,
          "num_attention_heads":2,"num_key_value_heads":1,"head_dim":4,"linear_num_key_heads":1,"linear_num_value_heads":2,
          "linear_key_head_dim":4,"linear_value_head_dim":4,"num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":4,
          "shared_expert_intermediate_size":4,"norm_topk_prob":false,"mlp_only_layers":[1],"partial_rotary_factor":0.5,"rope_theta":5000000}"#;
        let c = ModelConfig::from_json_str(text, Path::new("c")).unwrap();
        assert_eq!(c.moe_layers, vec![true, false, true, true]);
        assert!(!c.moe.as_ref().unwrap().norm_topk_prob);
        assert_eq!(c.rope_theta, 5e6);
        assert_eq!(c.rotary_dim, 2);
    }

    #[test]
    fn malformed_json_names_file() {
        let err = ModelConfig::from_json_str("{", Path::new("m/config.json")).unwrap_err();
        assert!(err.to_string().contains("m/config.json"));
    }
}
