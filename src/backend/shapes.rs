//! Shapes of the layers whose ops take more than a matrix: the backend's own parameter types,
//! filled by the model from its configuration.

#[derive(Debug, Clone, PartialEq)]
/// Shape of a Gated DeltaNet layer: what the delta-rule ops need to know of it.
pub struct LinearAttnShape {
    pub num_key_heads: usize,
    pub num_value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
    /// Whether the output's value heads go in llama.cpp's tiled order (value head `v` of key
    /// head `k` at `v * num_key_heads + k`) rather than grouped by key head: the column order
    /// of a Qwen3.5 GGUF file's output projection, whose quantized blocks span several heads
    /// and cannot be reordered.
    pub out_heads_tiled: bool,
}

impl LinearAttnShape {
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }
    /// Channels that pass through the causal convolution: q | k | v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Value heads served by each key head (repeat-interleave factor).
    pub fn heads_per_key_head(&self) -> usize {
        self.num_value_heads / self.num_key_heads
    }
    /// Where value head `h`'s output goes among the output's heads (see `out_heads_tiled`).
    pub fn out_head(&self, h: usize) -> usize {
        let r = self.heads_per_key_head();
        if self.out_heads_tiled {
            (h % r) * self.num_key_heads + h / r
        } else {
            h
        }
    }
    /// f32 elements of one recurrent state (all value heads).
    pub fn recurrent_state_len(&self) -> usize {
        self.num_value_heads * self.key_head_dim * self.value_head_dim
    }
    /// Elements of one conv window (the last K-1 pre-conv inputs).
    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim()
    }
}

#[derive(Debug, Clone, PartialEq)]
/// Shape of a mixture-of-experts MLP and its routing rule.
pub struct MoeShape {
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    pub shared_intermediate: usize,
    /// Renormalize the top-k routing weights to sum to one.
    pub norm_topk_prob: bool,
}
