//! The multi-token-prediction head of Qwen3.5 / Qwen3-Next checkpoints (`mtp.*`).
//!
//! ```text
//! x  = fc([norm1p(embed(token_{t+1})) | norm1p(hidden_t)])   # embedding first; hidden is post final norm
//! x  = one full-attention decoder layer (own KV cache, same positions as t)
//! hm = norm1p(x); logits = hm @ lm_head^T                     # embedding and lm_head shared with the model
//! ```
//! Chained drafting feeds `hm` back as the hidden state of the next step.

use super::qwen35::{logits_of_rows, DecoderLayer, LayerInput, LoadError, Loader, Qwen35};
use crate::backend::{Backend, BatchLayout};
use crate::model::config::{LayerKind, ModelConfig};
use crate::model::weights::WeightStore;

pub struct Mtp<B: Backend> {
    fc: B::Matrix,
    norm_embedding: B::Vector,
    norm_hidden: B::Vector,
    final_norm: B::Vector,
    layer: DecoderLayer<B>,
}

/// Output of one MTP step.
pub struct MtpOutput<B: Backend> {
    /// `[N, vocab]` for the requested rows.
    pub logits: B::Tensor,
    /// `[N, H]` post `mtp.norm`, for the same rows: the hidden state the next chained step
    /// consumes.
    pub hidden: B::Tensor,
}

impl<B: Backend> Mtp<B> {
    pub(crate) fn load(backend: &B, c: &ModelConfig, store: &WeightStore, attention_index: usize) -> Result<Self, LoadError> {
        let ld = Loader { store, backend, mtp: true, quantization: c.quantization.as_ref(), online: c.online_quantization.map(|q| (q, c.num_layers())) };
        let h = c.hidden_size;
        // The MTP layer is a full-attention decoder layer with the main model's MLP kind.
        let mut layer_cfg = c.clone();
        layer_cfg.layer_kinds = vec![LayerKind::FullAttention];
        layer_cfg.moe_layers = vec![c.moe.is_some()];
        Ok(Mtp {
            fc: ld.matrix("fc.weight", h, 2 * h)?,
            norm_embedding: ld.norm1p("pre_fc_norm_embedding.weight", h)?,
            norm_hidden: ld.norm1p("pre_fc_norm_hidden.weight", h)?,
            final_norm: ld.norm1p("norm.weight", h)?,
            layer: DecoderLayer::load_full_attention(&ld, &layer_cfg, "layers.0.", attention_index)?,
        })
    }

    /// One MTP step over `tokens` (the token after each hidden row) and `hidden` `[T, H]`.
    pub fn forward(&self, model: &Qwen35<B>, b: &B, tokens: &[u32], hidden: &B::Tensor, layout: &BatchLayout, logit_rows: &[u32], cache: &mut B::Cache) -> MtpOutput<B> {
        let hidden = self.layer_output(model, b, tokens, hidden, layout, cache);
        // Only the rows that get logits go on; every token's row where they are all of them.
        let all_in_order = logit_rows.len() == tokens.len() && logit_rows.iter().enumerate().all(|(i, &r)| r as usize == i);
        let hidden = if all_in_order { hidden } else { b.gather_rows(&hidden, logit_rows) };
        let in_order: Vec<u32> = (0..logit_rows.len() as u32).collect();
        let logits = logits_of_rows(b, &hidden, logit_rows.len(), &in_order, model.lm_head());
        MtpOutput { logits, hidden }
    }

    /// The step's keys and values written into the layer's cache, as [`Mtp::forward`] writes
    /// them, without the logits: a catch-up whose rows draft nothing needs only these.
    pub fn write_cache(&self, model: &Qwen35<B>, b: &B, tokens: &[u32], hidden: &B::Tensor, layout: &BatchLayout, cache: &mut B::Cache) {
        self.layer_output(model, b, tokens, hidden, layout, cache);
    }

    /// The layer's `mtp.norm`-ed output of every token; writes the layer's cache.
    fn layer_output(&self, model: &Qwen35<B>, b: &B, tokens: &[u32], hidden: &B::Tensor, layout: &BatchLayout, cache: &mut B::Cache) -> B::Tensor {
        let eps = model.config.rms_norm_eps;
        let e = b.rms_norm(&b.embed(&model.embed, tokens), &self.norm_embedding, eps);
        let hn = b.rms_norm(hidden, &self.norm_hidden, eps);
        let mut x = b.matmul(&b.concat_cols(&e, &hn), &self.fc);
        let h = b.rms_norm(&x, &self.layer.input_norm, eps);
        self.layer.forward(model, b, &mut x, LayerInput::Normed(h), &self.final_norm, None, layout, cache).normed()
    }
}
