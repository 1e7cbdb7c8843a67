//! Qwen3.5 / Qwen3.6 / Qwen3-Next: hybrid Gated DeltaNet + gated attention, dense or MoE.
//!
//! ```text
//! x = embed(ids)
//! per layer: x += mixer(norm1p(x))   mixer = Gated DeltaNet (3 of 4) | gated attention (1 of 4)
//!            x += mlp(norm1p(x))     mlp = SwiGLU | MoE (softmax top-k + gated shared expert)
//! hidden = norm1p(x); logits = hidden @ lm_head^T
//! ```
//! Zero-centred norms store `w` and scale by `1 + w`; the 1 is folded in when loading.

use super::mtp::Mtp;
use crate::backend::{AttentionDims, Backend, BackendError, BatchLayout, CacheSpec, GdnParams, KvDtype, MoeWeights};
use crate::model::config::{LayerKind, ModelConfig, ModelFamily};
use crate::model::weights::online::OnlineQuantization;
use crate::model::weights::quantized::QuantizationConfig;
use crate::model::weights::{WeightError, WeightStore};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Weight(#[from] WeightError),
    #[error("backend: {0}")]
    Backend(#[from] BackendError),
}

/// Weight access that checks shapes and names the tensor on error.
pub(crate) struct Loader<'a, B: Backend> {
    pub store: &'a WeightStore,
    pub backend: &'a B,
    /// Name prefix: "" for text tensors (resolved under model./model.language_model.), or "mtp.".
    pub mtp: bool,
    /// How quantized linears are stored (config.json's `quantization_config`).
    pub quantization: Option<&'a QuantizationConfig>,
    /// Quantization of float linears at load, and the model's decoder layers (its rules).
    pub online: Option<(OnlineQuantization, usize)>,
}

impl<B: Backend> Loader<'_, B> {
    /// The full stored name of `name`.
    pub(crate) fn full_name(&self, name: &str) -> String {
        if self.mtp {
            format!("mtp.{name}")
        } else {
            self.store.text_name(name)
        }
    }
    fn view(&self, name: &str) -> Result<crate::model::weights::TensorView<'_>, WeightError> {
        self.store.get(&self.full_name(name))
    }
    /// The linear `name` (dense, or repacked from its quantized form) as a `[rows, cols]`
    /// matrix, quantized at load where `--quantization` asks for it.
    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<crate::model::weights::MatrixBytes, WeightError> {
        let full = self.full_name(name);
        let m = self.store.linear(&full, rows, cols, self.quantization)?;
        self.online(&full, m)
    }
    /// `m` (the linear `full_name`) quantized where `--quantization` asks for it: float weights
    /// only; quantized checkpoints stay as stored.
    pub(crate) fn online(&self, full_name: &str, m: crate::model::weights::MatrixBytes) -> Result<crate::model::weights::MatrixBytes, WeightError> {
        let Some((q, layers)) = self.online else { return Ok(m) };
        match q.target(full_name, m.cols, layers).filter(|_| !m.dtype.is_quantized()) {
            Some(dtype) => OnlineQuantization::quantize(&m, dtype).map_err(|source| WeightError::Convert { tensor: full_name.to_string(), source }),
            None => Ok(m),
        }
    }
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<B::Matrix, LoadError> {
        Ok(self.backend.upload_matrix(&self.linear(name, rows, cols)?)?)
    }
    /// A SwiGLU's gate and up projections (`[rows, cols]` each) as one weight.
    pub fn gate_up(&self, gate: &str, up: &str, rows: usize, cols: usize) -> Result<B::Matrix, LoadError> {
        Ok(self.backend.upload_gate_up(&self.linear(gate, rows, cols)?, &self.linear(up, rows, cols)?)?)
    }
    /// The named `[rows, cols]` matrices stacked by rows into one (projections of one input).
    pub fn stacked(&self, parts: &[(&str, usize)], cols: usize) -> Result<B::Matrix, LoadError> {
        let mut bytes = Vec::with_capacity(parts.len());
        for &(name, rows) in parts {
            bytes.push(self.linear(name, rows, cols)?);
        }
        Ok(self.backend.upload_stacked(&bytes)?)
    }
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, LoadError> {
        let view = self.view(name)?;
        if view.numel() != len {
            view.expect_shape(&[len])?;
        }
        Ok(view.to_f32()?)
    }
    /// A zero-centred RMSNorm weight, returned as `1 + w`.
    pub fn norm1p(&self, name: &str, len: usize) -> Result<B::Vector, LoadError> {
        let w: Vec<f32> = self.vector(name, len)?.iter().map(|x| 1.0 + x).collect();
        Ok(self.backend.upload_vector(&w)?)
    }
    pub fn has(&self, name: &str) -> bool {
        if self.mtp {
            self.store.contains(&format!("mtp.{name}"))
        } else {
            self.store.has_text(name)
        }
    }
}

enum GdnProjection<B: Backend> {
    /// Qwen3.5 (and Qwen3-Next from GGUF): the q|k|v, z, b and a projections stacked into one
    /// matmul of four parts.
    Stacked { qkvzba: B::Matrix, widths: [usize; 4] },
    /// Qwen3-Next: fused projections grouped per key head; regrouped by column gathers.
    Packed { qkvz: B::Matrix, ba: B::Matrix, mixed_cols: Vec<u32>, z_cols: Vec<u32>, b_cols: Vec<u32>, a_cols: Vec<u32> },
}

struct GdnLayer<B: Backend> {
    proj: GdnProjection<B>,
    params: GdnParams<B>,
    out_proj: B::Matrix,
    linear_index: usize,
}

pub(crate) struct AttnLayer<B: Backend> {
    /// q (with its gate) | k | v stacked: one matmul of three parts.
    qkv_proj: B::Matrix,
    qkv_widths: [usize; 3],
    o_proj: B::Matrix,
    q_norm: B::Vector,
    k_norm: B::Vector,
    pub attention_index: usize,
}

enum Mixer<B: Backend> {
    Linear(GdnLayer<B>),
    Full(AttnLayer<B>),
}

enum Mlp<B: Backend> {
    /// `gate_up`: gate stacked over up, one matmul with the SwiGLU in its store.
    Dense { gate_up: B::Matrix, down: B::Matrix },
    Moe(MoeWeights<B>),
}

pub(crate) struct DecoderLayer<B: Backend> {
    pub(crate) input_norm: B::Vector,
    post_norm: B::Vector,
    mixer: Mixer<B>,
    mlp: Mlp<B>,
}

/// What a layer hands the next: the next layer's input rows (the residual stream normalized by
/// its input norm), or, where the MoE half did the next layer's input projection too
/// ([`Backend::moe_residual_project`]), that projection's parts.
pub(crate) enum LayerInput<T> {
    Normed(T),
    Projected(Vec<T>),
}

impl<T> LayerInput<T> {
    /// The normalized rows; only layers without a stacked input projection take them, and no
    /// layer projects for those.
    pub(crate) fn normed(self) -> T {
        match self {
            LayerInput::Normed(h) => h,
            LayerInput::Projected(_) => unreachable!("a projected input for a layer without a stacked input projection"),
        }
    }

    /// The residual stream `x` normalized by `norm`, or, given the next layer's input projection
    /// `proj`, that projection of it (the norm inside the projection's launch on a device).
    fn from_residual<B: Backend<Tensor = T>>(b: &B, x: &T, norm: &B::Vector, eps: f32, proj: Option<(&B::Matrix, &[usize])>) -> Self {
        match proj {
            Some((w, widths)) => LayerInput::Projected(b.rms_norm_matmul_parts(x, norm, eps, w, widths)),
            None => LayerInput::Normed(b.rms_norm(x, norm, eps)),
        }
    }

    /// The parts of `w` (row-stacked) cut into `widths`.
    fn project<B: Backend<Tensor = T>>(self, b: &B, w: &B::Matrix, widths: &[usize]) -> Vec<T> {
        match self {
            LayerInput::Normed(h) => b.matmul_parts(&h, w, widths),
            LayerInput::Projected(parts) => parts,
        }
    }
}

/// Output of one forward step.
pub struct ForwardOutput<B: Backend> {
    /// Final-normed hidden state of every token `[T, H]` (what the MTP head consumes).
    pub hidden: B::Tensor,
    /// Logits of the requested token rows `[N, vocab]`.
    pub logits: B::Tensor,
}

pub struct Qwen35<B: Backend> {
    pub config: ModelConfig,
    pub(crate) embed: B::Matrix,
    lm_head: Option<B::Matrix>,
    final_norm: B::Vector,
    layers: Vec<DecoderLayer<B>>,
    pub mtp: Option<Mtp<B>>,
}

impl<B: Backend> Qwen35<B> {
    pub fn load(backend: &B, config: ModelConfig, store: &WeightStore, progress: &indicatif::ProgressBar) -> Result<Self, LoadError> {
        let c = &config;
        let ld = Loader { store, backend, mtp: false, quantization: c.quantization.as_ref(), online: c.online_quantization.map(|q| (q, c.num_layers())) };
        let h = c.hidden_size;
        progress.set_length(c.num_layers() as u64 + 2);
        let embed = ld.matrix("embed_tokens.weight", c.vocab_size, h)?;
        progress.inc(1);
        let mut layers = Vec::with_capacity(c.num_layers());
        let (mut attn_idx, mut lin_idx) = (0, 0);
        for (i, kind) in c.layer_kinds.iter().enumerate() {
            let p = format!("layers.{i}.");
            let mixer = match kind {
                LayerKind::LinearAttention => {
                    lin_idx += 1;
                    Mixer::Linear(load_gdn(&ld, c, &p, lin_idx - 1)?)
                }
                LayerKind::FullAttention => {
                    attn_idx += 1;
                    Mixer::Full(load_attention(&ld, c, &p, attn_idx - 1)?)
                }
            };
            layers.push(DecoderLayer {
                input_norm: ld.norm1p(&format!("{p}input_layernorm.weight"), h)?,
                post_norm: ld.norm1p(&format!("{p}post_attention_layernorm.weight"), h)?,
                mixer,
                mlp: load_mlp(&ld, c, &p, c.moe_layers[i])?,
            });
            progress.inc(1);
        }
        let final_norm = ld.norm1p("norm.weight", h)?;
        let lm_head = if c.tie_word_embeddings && !store.contains_linear("lm_head.weight") {
            None
        } else {
            let m = store.linear("lm_head.weight", c.vocab_size, h, c.quantization.as_ref())?;
            Some(backend.upload_matrix(&ld.online("lm_head.weight", m)?)?)
        };
        let mtp = if c.mtp_layers > 0 && store.contains_linear("mtp.fc.weight") {
            Some(Mtp::load(backend, c, store, c.full_attention_layers())?)
        } else {
            None
        };
        progress.inc(1);
        Ok(Qwen35 { config, embed, lm_head, final_norm, layers, mtp })
    }

    pub(crate) fn lm_head(&self) -> &B::Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Cache geometry for this model, keys and values in the default KV format (bf16); MTP
    /// layers get attention-layer indices after the main ones. No prefix-cache checkpoints: the
    /// engine sets `checkpoint_slots` when it wants some.
    pub fn cache_spec(&self, num_blocks: usize, block_size: usize, state_slots: usize, snapshot_slots: usize) -> CacheSpec {
        cache_spec(&self.config, self.mtp.is_some(), num_blocks, block_size, state_slots, snapshot_slots)
    }

    pub(crate) fn attention_dims(&self) -> AttentionDims {
        let c = &self.config;
        AttentionDims { num_heads: c.num_heads, num_kv_heads: c.num_kv_heads, head_dim: c.head_dim, rotary_dim: c.rotary_dim, rope_theta: c.rope_theta, eps: c.rms_norm_eps }
    }

    /// Runs the step's tokens through the model; logits only for `logit_rows` (token indices).
    pub fn forward(&self, b: &B, ids: &[u32], layout: &BatchLayout, logit_rows: &[u32], cache: &mut B::Cache) -> ForwardOutput<B> {
        assert_eq!(ids.len(), layout.num_tokens(), "ids and layout disagree on the token count");
        let eps = self.config.rms_norm_eps;
        let mut x = b.embed(&self.embed, ids);
        // Each layer hands the next its normalized input (the last one the final norm's).
        let first = self.layers.first();
        let mut input = LayerInput::from_residual(b, &x, first.map_or(&self.final_norm, |l| &l.input_norm), eps, first.and_then(DecoderLayer::input_projection));
        for (i, layer) in self.layers.iter().enumerate() {
            let next = self.layers.get(i + 1);
            let next_norm = next.map_or(&self.final_norm, |l| &l.input_norm);
            input = layer.forward(self, b, &mut x, input, next_norm, next.and_then(DecoderLayer::input_projection), layout, cache);
        }
        // The last layer has no next projection: its output is the final-normed rows.
        let h = input.normed();
        let logits = logits_of_rows(b, &h, layout.num_tokens(), logit_rows, self.lm_head());
        ForwardOutput { hidden: h, logits }
    }
}

impl<B: Backend> DecoderLayer<B> {
    /// A decoder layer whose mixer is full attention (the MTP layer).
    pub(crate) fn load_full_attention(ld: &Loader<B>, c: &ModelConfig, p: &str, attention_index: usize) -> Result<Self, LoadError> {
        let h = c.hidden_size;
        Ok(DecoderLayer {
            input_norm: ld.norm1p(&format!("{p}input_layernorm.weight"), h)?,
            post_norm: ld.norm1p(&format!("{p}post_attention_layernorm.weight"), h)?,
            mixer: Mixer::Full(load_attention(ld, c, p, attention_index)?),
            mlp: load_mlp(ld, c, p, c.moe_layers[0])?,
        })
    }

    /// The layer's first matmul where it is one row-stacked weight cut into parts (what the
    /// layer before may compute for it: [`LayerInput::Projected`]).
    pub(crate) fn input_projection(&self) -> Option<(&B::Matrix, &[usize])> {
        match &self.mixer {
            Mixer::Linear(GdnLayer { proj: GdnProjection::Stacked { qkvzba, widths }, .. }) => Some((qkvzba, widths)),
            Mixer::Linear(_) => None,
            Mixer::Full(att) => Some((&att.qkv_proj, &att.qkv_widths)),
        }
    }

    /// The layer on the residual stream `x`, whose normalization by this layer's input norm
    /// (or its input projection) is `input`; returns the updated stream normalized by
    /// `next_norm`, or, given the next layer's input projection `next_proj`, where the MoE half
    /// can do it, that projection's parts.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        m: &Qwen35<B>,
        b: &B,
        x: &mut B::Tensor,
        input: LayerInput<B::Tensor>,
        next_norm: &B::Vector,
        next_proj: Option<(&B::Matrix, &[usize])>,
        layout: &BatchLayout,
        cache: &mut B::Cache,
    ) -> LayerInput<B::Tensor> {
        let c = &m.config;
        // The output projections add into the residual stream in their store.
        match &self.mixer {
            Mixer::Linear(g) => {
                let (mixed, z, bb, a) = match &g.proj {
                    GdnProjection::Stacked { qkvzba, widths } => {
                        let mut p = input.project(b, qkvzba, widths).into_iter();
                        let mut next = || p.next().expect("four projection parts");
                        (next(), next(), next(), next())
                    }
                    GdnProjection::Packed { qkvz, ba, mixed_cols, z_cols, b_cols, a_cols } => {
                        let h = input.normed();
                        let p = b.matmul(&h, qkvz);
                        let q = b.matmul(&h, ba);
                        (b.gather_cols(&p, mixed_cols), b.gather_cols(&p, z_cols), b.gather_cols(&q, b_cols), b.gather_cols(&q, a_cols))
                    }
                };
                let o = b.gated_delta_net(&mixed, &z, &bb, &a, &g.params, &c.linear, c.rms_norm_eps, layout, cache, g.linear_index);
                b.matmul_add(x, &o, &g.out_proj);
            }
            Mixer::Full(att) => {
                let o = att.attend(m, b, input, layout, cache);
                b.matmul_add(x, &o, &att.o_proj);
            }
        }
        match &self.mlp {
            Mlp::Dense { gate_up, down } => {
                let act = b.rms_norm_matmul_swiglu(x, &self.post_norm, c.rms_norm_eps, gate_up);
                b.matmul_add(x, &act, down);
                LayerInput::from_residual(b, x, next_norm, c.rms_norm_eps, next_proj)
            }
            Mlp::Moe(w) => {
                let cfg = c.moe.as_ref().expect("MoE layer without MoE config");
                match next_proj {
                    Some((proj, widths)) => LayerInput::Projected(b.moe_residual_project(x, &self.post_norm, w, cfg, next_norm, c.rms_norm_eps, proj, widths)),
                    None => LayerInput::Normed(b.moe_residual(x, &self.post_norm, w, cfg, next_norm, c.rms_norm_eps)),
                }
            }
        }
    }
}

impl<B: Backend> AttnLayer<B> {
    /// The attention output before the output projection.
    fn attend(&self, m: &Qwen35<B>, b: &B, input: LayerInput<B::Tensor>, layout: &BatchLayout, cache: &mut B::Cache) -> B::Tensor {
        let mut p = input.project(b, &self.qkv_proj, &self.qkv_widths).into_iter();
        let mut next = || p.next().expect("three projection parts");
        let (qg, k, v) = (next(), next(), next());
        b.gated_attention(&qg, &k, &v, &self.q_norm, &self.k_norm, &m.attention_dims(), layout, cache, self.attention_index)
    }
}

/// The logits of rows `logit_rows` of `h` (`num_rows` rows). Where those are all of h's rows
/// in order (a decode step of one-token rows), the rows are h itself: gathering them would be a
/// copy, and on the GPU a launch of its own in every step.
pub(crate) fn logits_of_rows<B: Backend>(b: &B, h: &B::Tensor, num_rows: usize, logit_rows: &[u32], lm_head: &B::Matrix) -> B::Tensor {
    let all_in_order = logit_rows.len() == num_rows && logit_rows.iter().enumerate().all(|(i, &r)| r as usize == i);
    if all_in_order {
        b.matmul(h, lm_head)
    } else {
        b.matmul(&b.gather_rows(h, logit_rows), lm_head)
    }
}

pub(crate) fn load_attention<B: Backend>(ld: &Loader<B>, c: &ModelConfig, p: &str, attention_index: usize) -> Result<AttnLayer<B>, LoadError> {
    let (h, d) = (c.hidden_size, c.head_dim);
    let qkv_widths = [c.num_heads * d * 2, c.num_kv_heads * d, c.num_kv_heads * d];
    let names = ["q_proj", "k_proj", "v_proj"].map(|n| format!("{p}self_attn.{n}.weight"));
    Ok(AttnLayer {
        qkv_proj: ld.stacked(&[(&names[0], qkv_widths[0]), (&names[1], qkv_widths[1]), (&names[2], qkv_widths[2])], h)?,
        qkv_widths,
        o_proj: ld.matrix(&format!("{p}self_attn.o_proj.weight"), h, c.num_heads * d)?,
        q_norm: ld.norm1p(&format!("{p}self_attn.q_norm.weight"), d)?,
        k_norm: ld.norm1p(&format!("{p}self_attn.k_norm.weight"), d)?,
        attention_index,
    })
}

fn load_gdn<B: Backend>(ld: &Loader<B>, c: &ModelConfig, p: &str, linear_index: usize) -> Result<GdnLayer<B>, LoadError> {
    let l = &c.linear;
    let h = c.hidden_size;
    let p = format!("{p}linear_attn.");
    // Qwen3-Next checkpoints pack q|k|v|z and b|a per key head; GGUF files from llama.cpp's
    // current converter hold them split like Qwen3.5's and take the stacked path.
    let proj = if c.family == ModelFamily::Qwen3Next && !ld.has(&format!("{p}in_proj_qkv.weight")) {
        let r = l.heads_per_key_head();
        let (dk, dv, nk) = (l.key_head_dim, l.value_head_dim, l.num_key_heads);
        let group = 2 * dk + 2 * r * dv;
        let cols = |off: usize, len: usize| -> Vec<u32> { (0..nk).flat_map(|g| (0..len).map(move |j| (g * group + off + j) as u32)).collect() };
        let mut mixed_cols = cols(0, dk);
        mixed_cols.extend(cols(dk, dk));
        mixed_cols.extend(cols(2 * dk, r * dv));
        let ba_cols = |off: usize| -> Vec<u32> { (0..nk).flat_map(|g| (0..r).map(move |j| (g * 2 * r + off + j) as u32)).collect() };
        GdnProjection::Packed {
            qkvz: ld.matrix(&format!("{p}in_proj_qkvz.weight"), nk * group, h)?,
            ba: ld.matrix(&format!("{p}in_proj_ba.weight"), 2 * l.num_value_heads, h)?,
            mixed_cols,
            z_cols: cols(2 * dk + r * dv, r * dv),
            b_cols: ba_cols(0),
            a_cols: ba_cols(r),
        }
    } else {
        let widths = [l.conv_dim(), l.value_dim(), l.num_value_heads, l.num_value_heads];
        let names = ["qkv", "z", "b", "a"].map(|n| format!("{p}in_proj_{n}.weight"));
        GdnProjection::Stacked { qkvzba: ld.stacked(&[(&names[0], widths[0]), (&names[1], widths[1]), (&names[2], widths[2]), (&names[3], widths[3])], h)?, widths }
    };
    let conv = ld.vector(&format!("{p}conv1d.weight"), l.conv_dim() * l.conv_kernel)?;
    let neg_a: Vec<f32> = ld.vector(&format!("{p}A_log"), l.num_value_heads)?.iter().map(|a| -a.exp()).collect();
    let b = ld.backend;
    Ok(GdnLayer {
        proj,
        params: GdnParams {
            conv_weight: b.upload_vector(&conv)?,
            neg_a: b.upload_vector(&neg_a)?,
            dt_bias: b.upload_vector(&ld.vector(&format!("{p}dt_bias"), l.num_value_heads)?)?,
            norm_weight: b.upload_vector(&ld.vector(&format!("{p}norm.weight"), l.value_head_dim)?)?,
        },
        out_proj: ld.matrix(&format!("{p}out_proj.weight"), h, l.value_dim())?,
        linear_index,
    })
}

fn load_mlp<B: Backend>(ld: &Loader<B>, c: &ModelConfig, p: &str, moe: bool) -> Result<Mlp<B>, LoadError> {
    let h = c.hidden_size;
    if !moe {
        let i = c.intermediate_size;
        let (gate, up) = (format!("{p}mlp.gate_proj.weight"), format!("{p}mlp.up_proj.weight"));
        return Ok(Mlp::Dense { gate_up: ld.gate_up(&gate, &up, i, h)?, down: ld.matrix(&format!("{p}mlp.down_proj.weight"), h, i)? });
    }
    let m = c.moe.as_ref().expect("MoE layer without MoE config");
    let (e, i) = (m.num_experts, m.expert_intermediate);
    let mut experts = Vec::with_capacity(e);
    if ld.has(&format!("{p}mlp.experts.gate_up_proj")) {
        // Stacked layout: gate_up [E, 2I, H] (gate rows first), down [E, H, I].
        let (gu_name, dn_name) = (format!("{p}mlp.experts.gate_up_proj"), format!("{p}mlp.experts.down_proj"));
        let gu = ld.view_matrix(&gu_name, &[e, 2 * i, h])?;
        let dn = ld.view_matrix(&dn_name, &[e, h, i])?;
        let (gu_full, dn_full) = (ld.full_name(&gu_name), ld.full_name(&dn_name));
        for x in 0..e {
            let b = ld.backend;
            let gate = ld.online(&gu_full, gu.rows(x * 2 * i, x * 2 * i + i))?;
            let up = ld.online(&gu_full, gu.rows(x * 2 * i + i, (x + 1) * 2 * i))?;
            let down = ld.online(&dn_full, dn.rows(x * h, (x + 1) * h))?;
            experts.push([b.upload_gate_up(&gate, &up)?, b.upload_matrix(&down)?]);
        }
    } else {
        for x in 0..e {
            let q = format!("{p}mlp.experts.{x}.");
            let (gate, up) = (format!("{q}gate_proj.weight"), format!("{q}up_proj.weight"));
            experts.push([ld.gate_up(&gate, &up, i, h)?, ld.matrix(&format!("{q}down_proj.weight"), h, i)?]);
        }
    }
    let shared = if m.shared_intermediate > 0 {
        let s = m.shared_intermediate;
        let (gate, up) = (format!("{p}mlp.shared_expert.gate_proj.weight"), format!("{p}mlp.shared_expert.up_proj.weight"));
        Some([ld.gate_up(&gate, &up, s, h)?, ld.matrix(&format!("{p}mlp.shared_expert.down_proj.weight"), h, s)?])
    } else {
        None
    };
    let router = format!("{p}mlp.gate.weight");
    let shared_gate = shared.is_some();
    let router = if shared_gate { ld.stacked(&[(&router, e), (&format!("{p}mlp.shared_expert_gate.weight"), 1)], h)? } else { ld.matrix(&router, e, h)? };
    Ok(Mlp::Moe(MoeWeights { router, experts, shared, shared_gate }))
}

impl<B: Backend> Loader<'_, B> {
    /// A stacked tensor of the given shape, as a matrix of its flattened leading dims.
    fn view_matrix(&self, name: &str, shape: &[usize]) -> Result<crate::model::weights::MatrixBytes, LoadError> {
        let view = self.view(name)?;
        view.expect_shape(shape)?;
        let cols = *shape.last().unwrap_or(&0);
        Ok(view.matrix(view.numel() / cols.max(1), cols)?)
    }
}

/// Cache geometry of a model of `config` (with its MTP head's attention layer if `mtp`), keys
/// and values in the default KV format (bf16); what [`Qwen35::cache_spec`] gives once loaded.
pub fn cache_spec(config: &ModelConfig, mtp: bool, num_blocks: usize, block_size: usize, state_slots: usize, snapshot_slots: usize) -> CacheSpec {
    CacheSpec {
        attention_layers: config.full_attention_layers() + usize::from(mtp),
        num_blocks,
        block_size,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        kv_dtype: KvDtype::default(),
        linear_layers: config.linear_attention_layers(),
        linear: config.linear.clone(),
        state_slots,
        snapshot_slots,
        checkpoint_slots: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::logits_of_rows;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::Backend;
    use crate::model::weights::MatrixBytes;

    /// All rows in order take the rows as they are; any other choice gathers them; both give
    /// the logits of exactly the rows asked for.
    #[test]
    fn logits_of_rows_takes_the_rows_asked_for() {
        let b = CpuBackend::new();
        let (rows, h, vocab) = (3, 4, 5);
        let x: Vec<f32> = (0..rows * h).map(|i| i as f32 * 0.25 - 1.0).collect();
        let w: Vec<f32> = (0..vocab * h).map(|i| (i % 7) as f32 - 3.0).collect();
        let lm_head = b.upload_matrix(&MatrixBytes::from_f32(w.clone(), vocab, h)).expect("matrix");
        let hx = b.from_host(&x, rows, h);
        let row_logits = |r: usize| -> Vec<f32> { (0..vocab).map(|v| (0..h).map(|k| x[r * h + k] * w[v * h + k]).sum()).collect() };
        for pick in [vec![0u32, 1, 2], vec![2], vec![1, 0, 2], vec![0, 1]] {
            let got = b.to_host(&logits_of_rows(&b, &hx, rows, &pick, &lm_head));
            let want: Vec<f32> = pick.iter().flat_map(|&r| row_logits(r as usize)).collect();
            assert_eq!(got.len(), want.len(), "rows {pick:?}");
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-4, "rows {pick:?}: {got:?} against {want:?}");
            }
        }
    }
}

