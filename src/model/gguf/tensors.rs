//! GGUF tensors under the Hugging Face names [`Qwen35::load`](crate::model::arch::qwen35::Qwen35)
//! reads.
//!
//! Names follow gguf-py's `TensorNameMap` for the three archs (`token_embd`, `output`,
//! `output_norm`, and per block `attn_norm`, `post_attention_norm`, `attn_{q,k,v,output}`,
//! `attn_{q,k}_norm`, `attn_qkv` / `attn_gate` (the linear attention's `in_proj_qkv` / `_z`),
//! `ssm_{alpha,beta,a,conv1d,norm,out}`, `ssm_dt.bias`, Qwen3-Next's `ssm_ba` and legacy
//! `ssm_in` (= `in_proj_qkvz`), `ffn_{gate,up,down}`, `ffn_gate_inp`, `ffn_{gate,up,down}_exps`
//! or fused `ffn_gate_up_exps`, `ffn_{gate,up,down}_shexp`, `ffn_gate_inp_shexp`), and the MTP
//! block after the trunk as `blk.{n}` with `nextn.{eh_proj,enorm,hnorm,shared_head_norm}`
//! (`_Qwen35MtpMixin`). GGUF dims are stored innermost first, so a tensor's row-major shape is
//! the Hugging Face shape.

use super::heads::{permute_units, untile_tail, HeadOrder};
use super::GgufModelError;
use crate::model::config::{LayerKind, ModelConfig, ModelFamily};
use crate::model::weights::gguf::{GgufFile, GgufTensor};
use crate::model::weights::{Dtype, SharedBytes, TensorEntry, WeightStore};
use std::collections::HashMap;
use std::path::PathBuf;

/// Collects store entries: zero-copy ranges of the map (file 0) and owned buffers.
struct StoreBuilder<'a> {
    file: &'a GgufFile,
    path: PathBuf,
    files: Vec<(PathBuf, SharedBytes)>,
    tensors: HashMap<String, TensorEntry>,
}

impl<'a> StoreBuilder<'a> {
    fn missing(&self, tensor: &str, hf_name: &str) -> GgufModelError {
        GgufModelError::MissingTensor { path: self.path.clone(), tensor: tensor.to_string(), hf_name: hf_name.to_string() }
    }

    fn has(&self, tensor: &str) -> bool {
        self.file.tensor_info(tensor).is_some()
    }

    /// A tensor's info, dtype and bytes; `hf_name` names what it was wanted as.
    fn get(&self, tensor: &str, hf_name: &str) -> Result<(&'a GgufTensor, Dtype, &'a [u8]), GgufModelError> {
        let info = self.file.tensor_info(tensor).ok_or_else(|| self.missing(tensor, hf_name))?;
        let dtype = info.dtype().ok_or_else(|| GgufModelError::UnsupportedType { path: self.path.clone(), tensor: tensor.to_string(), ggml_type: info.type_name() })?;
        Ok((info, dtype, self.file.tensor_bytes(info)?))
    }

    fn expect_shape(&self, info: &GgufTensor, want: &[usize]) -> Result<(), GgufModelError> {
        if info.shape() != want {
            return Err(GgufModelError::Shape { path: self.path.clone(), tensor: info.name().to_string(), got: info.shape().to_vec(), want: want.to_vec() });
        }
        Ok(())
    }

    /// `tensor` as `hf_name`, zero-copy.
    fn alias(&mut self, tensor: &str, hf_name: &str) -> Result<(), GgufModelError> {
        let (info, dtype, _) = self.get(tensor, hf_name)?;
        let range = info.byte_range().ok_or_else(|| self.missing(tensor, hf_name))?;
        self.tensors.insert(hf_name.to_string(), TensorEntry { dtype, shape: info.shape().to_vec(), file: 0, start: range.start, end: range.end });
        Ok(())
    }

    /// Rows `row0..row0 + rows` of `tensor` seen as `[n, cols]` (leading dims flattened), as
    /// `hf_name` of shape `[rows, cols]`, zero-copy.
    fn alias_rows(&mut self, tensor: &str, hf_name: &str, row0: usize, rows: usize) -> Result<(), GgufModelError> {
        let (info, dtype, _) = self.get(tensor, hf_name)?;
        let cols = info.shape().last().copied().unwrap_or(0);
        let row_bytes = self.row_bytes(info, dtype)?;
        let start = info.byte_range().map_or(0, |r| r.start) + row0 * row_bytes;
        self.tensors.insert(hf_name.to_string(), TensorEntry { dtype, shape: vec![rows, cols], file: 0, start, end: start + rows * row_bytes });
        Ok(())
    }

    fn row_bytes(&self, info: &GgufTensor, dtype: Dtype) -> Result<usize, GgufModelError> {
        let cols = info.shape().last().copied().unwrap_or(0);
        dtype.row_bytes(cols).map_err(|e| GgufModelError::Unsupported { path: self.path.clone(), tensor: info.name().to_string(), reason: e.to_string() })
    }

    /// An owned buffer as `hf_name`.
    fn owned(&mut self, hf_name: &str, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>) {
        let end = bytes.len();
        self.files.push((self.path.clone(), SharedBytes::from_vec(bytes)));
        self.tensors.insert(hf_name.to_string(), TensorEntry { dtype, shape, file: self.files.len() - 1, start: 0, end });
    }

    fn owned_f32(&mut self, hf_name: &str, shape: Vec<usize>, values: &[f32]) {
        self.owned(hf_name, Dtype::F32, shape, values.iter().flat_map(|v| v.to_le_bytes()).collect());
    }

    /// A tensor's values as f32, with its shape.
    fn values(&self, tensor: &str, hf_name: &str) -> Result<(Vec<usize>, Vec<f32>), GgufModelError> {
        let (info, dtype, bytes) = self.get(tensor, hf_name)?;
        let values = kestrel_quant::dequantize(dtype, bytes).map_err(|e| GgufModelError::Unsupported { path: self.path.clone(), tensor: tensor.to_string(), reason: e.to_string() })?;
        Ok((info.shape().to_vec(), values))
    }

    /// A zero-centred RMSNorm weight: llama.cpp stores `1 + w` (`Qwen3NextModel.modify_tensors`
    /// adds 1 to every `*norm.weight` but the gated norm's), the forward wants `w`.
    fn norm(&mut self, tensor: &str, hf_name: &str) -> Result<(), GgufModelError> {
        let (shape, values) = self.values(tensor, hf_name)?;
        let w: Vec<f32> = values.iter().map(|v| v - 1.0).collect();
        self.owned_f32(hf_name, shape, &w);
        Ok(())
    }

    /// Rows of `tensor` (whole block runs, any dtype) gathered in `order`, as `hf_name`.
    fn gather_rows(&mut self, tensor: &str, hf_name: &str, order: &[usize]) -> Result<(), GgufModelError> {
        let (info, dtype, bytes) = self.get(tensor, hf_name)?;
        let row_bytes = self.row_bytes(info, dtype)?;
        let cols = info.shape().last().copied().unwrap_or(0);
        self.owned(hf_name, dtype, vec![order.len(), cols], permute_units(bytes, row_bytes, order));
        Ok(())
    }

    fn finish(self) -> WeightStore {
        WeightStore::new(self.files, self.tensors, self.path.display().to_string())
    }
}

pub(super) fn build_store(file: &GgufFile, c: &ModelConfig) -> Result<WeightStore, GgufModelError> {
    let path = file.path().to_path_buf();
    let mut b = StoreBuilder { file, files: vec![(path.clone(), file.shared_bytes().clone())], path, tensors: HashMap::new() };
    b.alias("token_embd.weight", "model.embed_tokens.weight")?;
    b.norm("output_norm.weight", "model.norm.weight")?;
    if b.has("output.weight") {
        b.alias("output.weight", "lm_head.weight")?;
    }
    for (i, kind) in c.layer_kinds.iter().enumerate() {
        map_block(&mut b, c, i, &format!("model.layers.{i}."), *kind, c.moe_layers[i])?;
    }
    if c.mtp_layers > 0 {
        let n = c.num_layers();
        let blk = format!("blk.{n}.");
        b.alias(&format!("{blk}nextn.eh_proj.weight"), "mtp.fc.weight")?;
        b.norm(&format!("{blk}nextn.enorm.weight"), "mtp.pre_fc_norm_embedding.weight")?;
        b.norm(&format!("{blk}nextn.hnorm.weight"), "mtp.pre_fc_norm_hidden.weight")?;
        b.norm(&format!("{blk}nextn.shared_head_norm.weight"), "mtp.norm.weight")?;
        map_block(&mut b, c, n, "mtp.layers.0.", LayerKind::FullAttention, c.moe.is_some())?;
    }
    Ok(b.finish())
}

/// Block `i` of the file as the layer `p` (`model.layers.{i}.` or the MTP layer).
fn map_block(b: &mut StoreBuilder, c: &ModelConfig, i: usize, p: &str, kind: LayerKind, moe: bool) -> Result<(), GgufModelError> {
    let blk = format!("blk.{i}.");
    b.norm(&format!("{blk}attn_norm.weight"), &format!("{p}input_layernorm.weight"))?;
    b.norm(&format!("{blk}post_attention_norm.weight"), &format!("{p}post_attention_layernorm.weight"))?;
    match kind {
        LayerKind::FullAttention => map_attention(b, c, &blk, &format!("{p}self_attn."))?,
        LayerKind::LinearAttention => map_linear_attention(b, c, &blk, &format!("{p}linear_attn."))?,
    }
    let mlp = format!("{p}mlp.");
    if !moe {
        for (g, h) in [("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")] {
            b.alias(&format!("{blk}{g}.weight"), &format!("{mlp}{h}.weight"))?;
        }
        return Ok(());
    }
    let m = c.moe.as_ref().expect("an MoE layer has an MoE config");
    b.alias(&format!("{blk}ffn_gate_inp.weight"), &format!("{mlp}gate.weight"))?;
    let fused = format!("{blk}ffn_gate_up_exps.weight");
    if b.has(&fused) {
        // `--fuse-gate-up-exps`: gate and up concatenated per expert, the HF `gate_up_proj`.
        b.alias(&fused, &format!("{mlp}experts.gate_up_proj"))?;
        b.alias(&format!("{blk}ffn_down_exps.weight"), &format!("{mlp}experts.down_proj"))?;
    } else {
        // Stacked [E, rows, cols]: each expert's rows are one contiguous range.
        for (g, h, rows) in [("ffn_gate_exps", "gate_proj", m.expert_intermediate), ("ffn_up_exps", "up_proj", m.expert_intermediate), ("ffn_down_exps", "down_proj", c.hidden_size)] {
            let tensor = format!("{blk}{g}.weight");
            let (info, _, _) = b.get(&tensor, &format!("{mlp}experts.{h}"))?;
            let cols = if h == "down_proj" { m.expert_intermediate } else { c.hidden_size };
            b.expect_shape(info, &[m.num_experts, rows, cols])?;
            for x in 0..m.num_experts {
                b.alias_rows(&tensor, &format!("{mlp}experts.{x}.{h}.weight"), x * rows, rows)?;
            }
        }
    }
    if m.shared_intermediate > 0 {
        b.alias(&format!("{blk}ffn_gate_inp_shexp.weight"), &format!("{mlp}shared_expert_gate.weight"))?;
        for (g, h) in [("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"), ("ffn_down_shexp", "down_proj")] {
            b.alias(&format!("{blk}{g}.weight"), &format!("{mlp}shared_expert.{h}.weight"))?;
        }
    }
    Ok(())
}

fn map_attention(b: &mut StoreBuilder, c: &ModelConfig, blk: &str, p: &str) -> Result<(), GgufModelError> {
    let qkv = format!("{blk}attn_qkv.weight");
    if b.has(&qkv) {
        // One fused projection: q (with its gate) | k | v by rows.
        let (q, kv) = (2 * c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let (info, _, _) = b.get(&qkv, &format!("{p}q_proj.weight"))?;
        b.expect_shape(info, &[q + 2 * kv, c.hidden_size])?;
        b.alias_rows(&qkv, &format!("{p}q_proj.weight"), 0, q)?;
        b.alias_rows(&qkv, &format!("{p}k_proj.weight"), q, kv)?;
        b.alias_rows(&qkv, &format!("{p}v_proj.weight"), q + kv, kv)?;
    } else {
        for (g, h) in [("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")] {
            b.alias(&format!("{blk}{g}.weight"), &format!("{p}{h}.weight"))?;
        }
    }
    b.alias(&format!("{blk}attn_output.weight"), &format!("{p}o_proj.weight"))?;
    b.norm(&format!("{blk}attn_q_norm.weight"), &format!("{p}q_norm.weight"))?;
    b.norm(&format!("{blk}attn_k_norm.weight"), &format!("{p}k_norm.weight"))?;
    Ok(())
}

fn map_linear_attention(b: &mut StoreBuilder, c: &ModelConfig, blk: &str, p: &str) -> Result<(), GgufModelError> {
    let l = &c.linear;
    let (h, nv, dv) = (c.hidden_size, l.num_value_heads, l.value_head_dim);
    let name = |g: &str| format!("{blk}{g}");
    let hf = |n: &str| format!("{p}{n}");
    let tiled = HeadOrder { num_key_heads: l.num_key_heads, per_key: l.heads_per_key_head() };
    // Only Qwen3.5's converter tiles the value heads; with one key head (or one value head per
    // key head) the two orders coincide.
    let untile = c.family != ModelFamily::Qwen3Next && !tiled.is_identity();
    let order = tiled.tiled_source();

    if c.family == ModelFamily::Qwen3Next && b.has(&name("ssm_in.weight")) {
        // Files from before the converter split `in_proj_qkvz` hold it as Hugging Face does.
        b.alias(&name("ssm_in.weight"), &hf("in_proj_qkvz.weight"))?;
        b.alias(&name("ssm_ba.weight"), &hf("in_proj_ba.weight"))?;
    } else {
        if untile {
            b.untile_rows(&name("attn_qkv.weight"), &hf("in_proj_qkv.weight"), &[l.conv_dim(), h], 2 * l.key_dim(), dv, &order)?;
            b.untile_rows(&name("attn_gate.weight"), &hf("in_proj_z.weight"), &[l.value_dim(), h], 0, dv, &order)?;
            b.untile_rows(&name("ssm_beta.weight"), &hf("in_proj_b.weight"), &[nv, h], 0, 1, &order)?;
            b.untile_rows(&name("ssm_alpha.weight"), &hf("in_proj_a.weight"), &[nv, h], 0, 1, &order)?;
        } else {
            b.alias(&name("attn_qkv.weight"), &hf("in_proj_qkv.weight"))?;
            b.alias(&name("attn_gate.weight"), &hf("in_proj_z.weight"))?;
            if c.family == ModelFamily::Qwen3Next {
                // `in_proj_ba` is packed per key head: [b (r rows), a (r rows)] for each.
                let (nk, r) = (l.num_key_heads, l.heads_per_key_head());
                let (info, _, _) = b.get(&name("ssm_ba.weight"), &hf("in_proj_ba.weight"))?;
                b.expect_shape(info, &[2 * nv, h])?;
                let rows = |off: usize| -> Vec<usize> { (0..nk).flat_map(|g| (0..r).map(move |j| g * 2 * r + off + j)).collect() };
                b.gather_rows(&name("ssm_ba.weight"), &hf("in_proj_b.weight"), &rows(0))?;
                b.gather_rows(&name("ssm_ba.weight"), &hf("in_proj_a.weight"), &rows(r))?;
            } else {
                b.alias(&name("ssm_beta.weight"), &hf("in_proj_b.weight"))?;
                b.alias(&name("ssm_alpha.weight"), &hf("in_proj_a.weight"))?;
            }
        }
    }

    // conv1d: [conv_dim, kernel] (HF [conv_dim, 1, kernel], squeezed by the converter).
    let (shape, conv) = b.values(&name("ssm_conv1d.weight"), &hf("conv1d.weight"))?;
    let k = l.conv_kernel;
    if shape.iter().product::<usize>() != l.conv_dim() * k {
        return Err(GgufModelError::Shape { path: b.path.clone(), tensor: name("ssm_conv1d.weight"), got: shape, want: vec![l.conv_dim(), k] });
    }
    let conv = if untile { untile_tail(&conv, 2 * l.key_dim() * k, dv * k, &order) } else { conv };
    b.owned_f32(&hf("conv1d.weight"), vec![l.conv_dim(), 1, k], &conv);

    let per_head = |b: &StoreBuilder, tensor: &str, hf_name: &str| -> Result<Vec<f32>, GgufModelError> {
        let (shape, v) = b.values(tensor, hf_name)?;
        if v.len() != nv {
            return Err(GgufModelError::Shape { path: b.path.clone(), tensor: tensor.to_string(), got: shape, want: vec![nv] });
        }
        Ok(if untile { permute_units(&v, 1, &order) } else { v })
    };
    let dt_bias = per_head(b, &name("ssm_dt.bias"), &hf("dt_bias"))?;
    b.owned_f32(&hf("dt_bias"), vec![nv], &dt_bias);
    // ssm_a = -exp(A_log) (`Qwen3NextModel.modify_tensors`), so A_log = ln(-ssm_a).
    let ssm_a = per_head(b, &name("ssm_a"), &hf("A_log"))?;
    if let Some(bad) = ssm_a.iter().find(|a| a.is_nan() || **a >= 0.0) {
        return Err(GgufModelError::BadValues { path: b.path.clone(), tensor: name("ssm_a"), reason: format!("holds {bad}; llama.cpp stores -exp(A_log), which is negative") });
    }
    let a_log: Vec<f32> = ssm_a.iter().map(|a| (-a).ln()).collect();
    b.owned_f32(&hf("A_log"), vec![nv], &a_log);

    b.alias(&name("ssm_norm.weight"), &hf("norm.weight"))?;
    // The output projection's columns stay in the file's order, whatever the type: the delta
    // rule writes its output heads in that order (LinearAttnShape::out_heads_tiled, which the
    // configuration sets exactly where `untile` holds).
    let (info, _, _) = b.get(&name("ssm_out.weight"), &hf("out_proj.weight"))?;
    b.expect_shape(info, &[h, l.value_dim()])?;
    b.alias(&name("ssm_out.weight"), &hf("out_proj.weight"))
}

impl StoreBuilder<'_> {
    /// `tensor` of shape `shape`, its rows after the first `keep` in heads of `head_rows`, back
    /// in grouped order.
    fn untile_rows(&mut self, tensor: &str, hf_name: &str, shape: &[usize], keep: usize, head_rows: usize, order: &[usize]) -> Result<(), GgufModelError> {
        let (info, dtype, bytes) = self.get(tensor, hf_name)?;
        self.expect_shape(info, shape)?;
        let row_bytes = self.row_bytes(info, dtype)?;
        let data = untile_tail(bytes, keep * row_bytes, head_rows * row_bytes, order);
        self.owned(hf_name, dtype, shape.to_vec(), data);
        Ok(())
    }
}
