//! Tensor parallelism's split plan: for a model and N GPUs, the part of every weight tensor
//! each GPU holds, the per-GPU shapes of the KV cache and the recurrent state, and the memory
//! per GPU.
//!
//! The layout is vLLM's for Qwen3.5 / Qwen3-Next (reference/serving-features.md §5):
//! - attention: q (with its interleaved output gate) by heads, k and v by KV heads (replicated
//!   when N exceeds the KV heads: GPU r holds KV head r / (N / kv_heads)), o_proj by its input
//!   columns (row-parallel, then reduced);
//! - Gated DeltaNet: everything by key head and the value heads that go with it (value head v
//!   belongs to key head v / (nv / nk)): the q, k and v blocks of the projection and of the conv
//!   channels, z, b, a, A_log and dt_bias; out_proj row-parallel;
//! - MLP: gate and up by the intermediate dimension, down row-parallel; MoE: every expert cut on
//!   its intermediate dimension, the shared expert likewise, routers replicated;
//! - embedding and lm_head by vocabulary (padded to 64 per GPU); norms replicated.
//!
//! Row-parallel layers are where one GPU and N GPUs could differ: the matmul kernels reduce K
//! in [`K_SLICES`] fixed slices and add them in slice order, so each GPU must hold whole slices
//! (N divides 8, and K is 8 equal slices of 32-wide blocks) for the slice partials to be added
//! in the one-GPU order afterwards (backend/tensor_parallel.rs).

pub use crate::backend::tensor_parallel::K_SLICES;
use crate::backend::cuda::quant_tiles::TileFormat;
use crate::backend::CacheSpec;
use crate::model::config::{LayerKind, ModelConfig, ModelFamily};
use crate::model::weights::online::OnlineQuantization;
use crate::model::weights::WeightStore;
use std::collections::HashMap;
use std::ops::Range;

/// The GPU counts a model can be split over.
pub const SUPPORTED_SIZES: [usize; 4] = [1, 2, 4, 8];
/// Width of the K units the slices of bf16 weights are made of (quantized formats: their own).
const K_BLOCK: usize = 32;
/// Vocabulary rows per GPU are a multiple of this (vLLM's `DEFAULT_VOCAB_PADDING_SIZE`).
const VOCAB_PADDING: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    #[error("--tensor-parallel-size {size} is not supported: use 1, 2, 4 or 8 (each GPU must hold whole slices of the 8 the matmul kernels cut K into)")]
    UnsupportedSize { size: usize },
    #[error("--tensor-parallel-size {size} does not divide the model's {what} ({count}); use a size that divides it")]
    Indivisible { size: usize, what: &'static str, count: usize },
    #[error("--tensor-parallel-size {size} and the model's {kv_heads} KV heads: one must divide the other (KV heads are split, or replicated when there are fewer than GPUs)")]
    KvHeads { size: usize, kv_heads: usize },
    #[error("{tensor}: its input width {k} is not {K_SLICES} equal slices of {unit}-wide units, so {size} GPUs cannot reproduce the one-GPU reduction")]
    SliceMisaligned { tensor: String, k: usize, unit: usize, size: usize },
    #[error("this checkpoint stores the Gated DeltaNet output heads in llama.cpp's tiled order, whose columns cannot be split by key head; tensor parallelism needs a Hugging Face checkpoint of this model")]
    TiledOutputHeads,
}

/// How a tensor is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Every GPU holds all of it.
    Replicated,
    /// Split on its output rows (or per-head vectors and conv channels with their heads): each
    /// GPU computes its own outputs, no communication.
    Column,
    /// Split on its input columns: each GPU computes partial sums over whole K slices, added
    /// afterwards in the one-GPU slice order.
    Row,
    /// Split by vocabulary rows: embedding lookups and logits are gathered, never summed.
    Vocab,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::Replicated => "replicated",
            Layout::Column => "column",
            Layout::Row => "row",
            Layout::Vocab => "vocab",
        }
    }
}

/// One tensor's split: GPU r holds the indices `ranks[r]` (concatenated in order) along `dim`,
/// and everything of the other dimensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSplit {
    /// The tensor's name relative to the text model (`layers.3.self_attn.q_proj.weight`);
    /// `lm_head.weight` is the top-level one.
    pub name: String,
    pub shape: Vec<usize>,
    pub layout: Layout,
    pub dim: usize,
    /// How many GPUs hold each index along `dim` (N when replicated, N / kv_heads for
    /// replicated KV heads, else 1).
    pub copies: usize,
    pub ranks: Vec<Vec<Range<usize>>>,
}

impl TensorSplit {
    /// The shape of the part GPU `rank` holds.
    pub fn shard_shape(&self, rank: usize) -> Vec<usize> {
        let mut shape = self.shape.clone();
        shape[self.dim] = self.ranks[rank].iter().map(|r| r.len()).sum();
        shape
    }

    /// Elements GPU `rank` holds.
    pub fn shard_elements(&self, rank: usize) -> usize {
        self.shard_shape(rank).iter().product()
    }

    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A model's split over `size` GPUs.
#[derive(Debug, Clone)]
pub struct SplitPlan {
    pub size: usize,
    pub tensors: Vec<TensorSplit>,
    /// Per GPU: attention heads, KV heads, and the delta rule's key and value heads.
    pub heads: RankHeads,
}

/// The heads each GPU holds (the same count on every GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankHeads {
    pub attention: usize,
    pub kv: usize,
    pub linear_key: usize,
    pub linear_value: usize,
}

/// Contiguous equal parts of `0..len` for `n` GPUs (`len` divisible by `n`).
fn even(len: usize, n: usize, offset: usize) -> Vec<Range<usize>> {
    let part = len / n;
    (0..n).map(|r| offset + r * part..offset + (r + 1) * part).collect()
}

/// Blocks of the given lengths laid end to end, each split evenly: GPU r holds part r of each.
fn merged(blocks: &[usize], n: usize) -> Vec<Vec<Range<usize>>> {
    let mut ranks = vec![Vec::new(); n];
    let mut offset = 0;
    for &len in blocks {
        for (r, range) in even(len, n, offset).into_iter().enumerate() {
            ranks[r].push(range);
        }
        offset += len;
    }
    ranks
}

struct Builder<'a> {
    n: usize,
    config: &'a ModelConfig,
    /// The K unit of a tensor's format on the GPU, by plan name.
    k_unit: &'a dyn Fn(&str) -> usize,
    tensors: Vec<TensorSplit>,
}

impl Builder<'_> {
    fn push(&mut self, name: String, shape: &[usize], layout: Layout, dim: usize, copies: usize, ranks: Vec<Vec<Range<usize>>>) {
        self.tensors.push(TensorSplit { name, shape: shape.to_vec(), layout, dim, copies, ranks });
    }
    fn replicated(&mut self, name: String, shape: &[usize]) {
        let ranks = vec![vec![0..shape[0]]; self.n];
        self.push(name, shape, Layout::Replicated, 0, self.n, ranks);
    }
    /// Rows (dim `dim`) split as the end-to-end `blocks`, each evenly.
    fn column(&mut self, name: String, shape: &[usize], dim: usize, blocks: &[usize]) {
        let ranks = merged(blocks, self.n);
        self.push(name, shape, Layout::Column, dim, 1, ranks);
    }
    /// Input columns (the last dimension) split evenly, in whole K slices.
    fn row(&mut self, name: String, shape: &[usize]) -> Result<(), SplitError> {
        let dim = shape.len() - 1;
        let k = shape[dim];
        let unit = (self.k_unit)(&name);
        if self.n > 1 && !k.is_multiple_of(K_SLICES * unit) {
            return Err(SplitError::SliceMisaligned { tensor: name, k, unit, size: self.n });
        }
        let ranks = merged(&[k], self.n);
        self.push(name, shape, Layout::Row, dim, 1, ranks);
        Ok(())
    }
    fn vocab(&mut self, name: String, shape: &[usize]) {
        let v = shape[0];
        let per = v.div_ceil(self.n).next_multiple_of(VOCAB_PADDING);
        let ranks = (0..self.n).map(|r| vec![(r * per).min(v)..((r + 1) * per).min(v)]).collect();
        self.push(name, shape, Layout::Vocab, 0, 1, ranks);
    }
    /// k_proj / v_proj: split by KV head, or with fewer KV heads than GPUs, GPU r holds KV head
    /// r / (N / kv_heads).
    fn kv(&mut self, name: String, shape: &[usize]) {
        let (n, kv, d) = (self.n, self.config.num_kv_heads, self.config.head_dim);
        if n <= kv {
            self.column(name, shape, 0, &[kv * d]);
        } else {
            let copies = n / kv;
            let ranks = (0..n).map(|r| vec![(r / copies) * d..(r / copies + 1) * d]).collect();
            self.push(name, shape, Layout::Column, 0, copies, ranks);
        }
    }
}

fn check_divides(n: usize, what: &'static str, count: usize) -> Result<(), SplitError> {
    if count.is_multiple_of(n) {
        Ok(())
    } else {
        Err(SplitError::Indivisible { size: n, what, count })
    }
}

impl SplitPlan {
    /// The split of `config` over `size` GPUs with bf16 weights (or formats of 32-wide units),
    /// or why it cannot be split so.
    pub fn new(config: &ModelConfig, size: usize) -> Result<Self, SplitError> {
        Self::with_k_units(config, size, &|_| K_BLOCK)
    }

    /// The split of the model in `store` over `size` GPUs: each row-parallel weight's slices in
    /// whole units of the format the GPU keeps it in (after `--quantization`; 128 for the
    /// k-quants, IQ4_XS and 128-wide int4 and FP8 blocks). Packed int4 modules count as 128.
    pub fn for_store(config: &ModelConfig, size: usize, store: &WeightStore) -> Result<Self, SplitError> {
        let online = config.online_quantization;
        let unit = |name: &str| {
            let full = stored_name(store, name);
            let Ok(view) = store.get(&full) else { return 128 };
            let cols = view.shape.last().copied().unwrap_or(1);
            let dtype = online.filter(|_| !view.dtype.is_quantized()).and_then(|q| q.target(&full, cols, config.num_layers())).unwrap_or(view.dtype);
            TileFormat::of(dtype).map_or(K_BLOCK, |f| f.unit()).max(K_BLOCK)
        };
        Self::with_k_units(config, size, &unit)
    }

    fn with_k_units(config: &ModelConfig, size: usize, k_unit: &dyn Fn(&str) -> usize) -> Result<Self, SplitError> {
        if !SUPPORTED_SIZES.contains(&size) {
            return Err(SplitError::UnsupportedSize { size });
        }
        let n = size;
        let l = &config.linear;
        if l.out_heads_tiled && n > 1 {
            return Err(SplitError::TiledOutputHeads);
        }
        let has_attention = config.layer_kinds.contains(&LayerKind::FullAttention);
        let has_linear = config.layer_kinds.contains(&LayerKind::LinearAttention);
        if has_attention {
            check_divides(n, "attention heads", config.num_heads)?;
            let kv = config.num_kv_heads;
            if !(kv.is_multiple_of(n) || n.is_multiple_of(kv)) {
                return Err(SplitError::KvHeads { size: n, kv_heads: kv });
            }
        }
        if has_linear {
            check_divides(n, "Gated DeltaNet key heads", l.num_key_heads)?;
            check_divides(n, "Gated DeltaNet value heads", l.num_value_heads)?;
        }
        if config.moe_layers.iter().any(|m| !m) {
            check_divides(n, "MLP intermediate size", config.intermediate_size)?;
        }
        if let Some(moe) = config.moe.as_ref().filter(|_| config.moe_layers.contains(&true)) {
            check_divides(n, "expert intermediate size", moe.expert_intermediate)?;
            if moe.shared_intermediate > 0 {
                check_divides(n, "shared expert intermediate size", moe.shared_intermediate)?;
            }
        }
        let mut b = Builder { n, config, k_unit, tensors: Vec::new() };
        let h = config.hidden_size;
        b.vocab("embed_tokens.weight".into(), &[config.vocab_size, h]);
        if !config.tie_word_embeddings {
            b.vocab("lm_head.weight".into(), &[config.vocab_size, h]);
        }
        b.replicated("norm.weight".into(), &[h]);
        for (i, kind) in config.layer_kinds.iter().enumerate() {
            let pre = format!("layers.{i}.");
            b.replicated(format!("{pre}input_layernorm.weight"), &[h]);
            b.replicated(format!("{pre}post_attention_layernorm.weight"), &[h]);
            match kind {
                LayerKind::LinearAttention => linear_attention(&mut b, &format!("{pre}linear_attn."))?,
                LayerKind::FullAttention => {
                    let a = format!("{pre}self_attn.");
                    let (d, nq, nkv) = (config.head_dim, config.num_heads, config.num_kv_heads);
                    // Per head [q_h | gate_h]: whole heads stay together.
                    b.column(format!("{a}q_proj.weight"), &[nq * 2 * d, h], 0, &[nq * 2 * d]);
                    b.kv(format!("{a}k_proj.weight"), &[nkv * d, h]);
                    b.kv(format!("{a}v_proj.weight"), &[nkv * d, h]);
                    b.row(format!("{a}o_proj.weight"), &[h, nq * d])?;
                    b.replicated(format!("{a}q_norm.weight"), &[d]);
                    b.replicated(format!("{a}k_norm.weight"), &[d]);
                }
            }
            let mlp = format!("{pre}mlp.");
            match (&config.moe, config.moe_layers[i]) {
                (Some(moe), true) => {
                    let (e, im) = (moe.num_experts, moe.expert_intermediate);
                    b.replicated(format!("{mlp}gate.weight"), &[e, h]);
                    b.column(format!("{mlp}experts.gate_up_proj"), &[e, 2 * im, h], 1, &[im, im]);
                    b.row(format!("{mlp}experts.down_proj"), &[e, h, im])?;
                    if moe.shared_intermediate > 0 {
                        let s = moe.shared_intermediate;
                        b.column(format!("{mlp}shared_expert.gate_proj.weight"), &[s, h], 0, &[s]);
                        b.column(format!("{mlp}shared_expert.up_proj.weight"), &[s, h], 0, &[s]);
                        b.row(format!("{mlp}shared_expert.down_proj.weight"), &[h, s])?;
                        b.replicated(format!("{mlp}shared_expert_gate.weight"), &[1, h]);
                    }
                }
                _ => {
                    let im = config.intermediate_size;
                    b.column(format!("{mlp}gate_proj.weight"), &[im, h], 0, &[im]);
                    b.column(format!("{mlp}up_proj.weight"), &[im, h], 0, &[im]);
                    b.row(format!("{mlp}down_proj.weight"), &[h, im])?;
                }
            }
        }
        let heads = RankHeads {
            attention: config.num_heads / n,
            kv: (config.num_kv_heads / n).max(1),
            linear_key: l.num_key_heads / n,
            linear_value: l.num_value_heads / n,
        };
        Ok(SplitPlan { size, tensors: b.tensors, heads })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorSplit> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The cache one GPU keeps for `cache` (the one-GPU geometry): its KV heads, and the
    /// recurrent state and conv window of its delta-rule heads.
    pub fn rank_cache(&self, cache: &CacheSpec) -> CacheSpec {
        let mut rank = cache.clone();
        rank.kv_heads = self.heads.kv;
        rank.linear.num_key_heads = self.heads.linear_key;
        rank.linear.num_value_heads = self.heads.linear_value;
        rank
    }

    /// Device weight bytes per GPU for the model in `store` (after `online` quantization):
    /// each planned tensor (with its quantization scales) in proportion to the part each GPU
    /// holds; tensors outside the plan (the MTP head, which runs beside the scheduler) on the
    /// first GPU.
    pub fn weight_bytes_per_rank(&self, store: &WeightStore, online: Option<(OnlineQuantization, usize)>) -> Vec<usize> {
        let planned: HashMap<String, &TensorSplit> = self.tensors.iter().map(|t| (stored_name(store, &t.name), t)).collect();
        let mut ranks = vec![0usize; self.size];
        for (name, bytes) in store.device_bytes_per_tensor(online) {
            // A GPTQ module's scales and zero points go with its matrix.
            let module = [".scales", ".qzeros", ".g_idx"].iter().find_map(|s| name.strip_suffix(s)).map(|m| format!("{m}.weight"));
            match planned.get(module.as_deref().unwrap_or(&name)) {
                Some(t) => {
                    for (r, total) in ranks.iter_mut().enumerate() {
                        *total += (bytes as u128 * t.shard_elements(r) as u128 / t.elements().max(1) as u128) as usize;
                    }
                }
                None => ranks[0] += bytes,
            }
        }
        ranks
    }
}

/// The stored name of plan tensor `name` (text tensors sit under the checkpoint's prefix).
fn stored_name(store: &WeightStore, name: &str) -> String {
    if name == "lm_head.weight" {
        name.to_string()
    } else {
        store.text_name(name)
    }
}

/// A Gated DeltaNet layer's tensors, split by key head and its value heads.
fn linear_attention(b: &mut Builder, a: &str) -> Result<(), SplitError> {
    let (config, h) = (b.config, b.config.hidden_size);
    let l = &config.linear;
    let (key_dim, value_dim, nv) = (l.key_dim(), l.value_dim(), l.num_value_heads);
    if config.family == ModelFamily::Qwen3Next {
        // Rows grouped per key head ([q_g, k_g, v_g, z_g] and [b_g, a_g]): contiguous whole groups.
        let r = l.heads_per_key_head();
        let qkvz = l.num_key_heads * (2 * l.key_head_dim + 2 * r * l.value_head_dim);
        b.column(format!("{a}in_proj_qkvz.weight"), &[qkvz, h], 0, &[qkvz]);
        b.column(format!("{a}in_proj_ba.weight"), &[2 * nv, h], 0, &[2 * nv]);
    } else {
        b.column(format!("{a}in_proj_qkv.weight"), &[l.conv_dim(), h], 0, &[key_dim, key_dim, value_dim]);
        b.column(format!("{a}in_proj_z.weight"), &[value_dim, h], 0, &[value_dim]);
        b.column(format!("{a}in_proj_b.weight"), &[nv, h], 0, &[nv]);
        b.column(format!("{a}in_proj_a.weight"), &[nv, h], 0, &[nv]);
    }
    b.row(format!("{a}out_proj.weight"), &[h, value_dim])?;
    // The depthwise conv runs over q | k | v channels: each block split with its heads.
    b.column(format!("{a}conv1d.weight"), &[l.conv_dim(), 1, l.conv_kernel], 0, &[key_dim, key_dim, value_dim]);
    b.column(format!("{a}A_log"), &[nv], 0, &[nv]);
    b.column(format!("{a}dt_bias"), &[nv], 0, &[nv]);
    // Normalizes each value head on its own: no statistics across GPUs.
    b.replicated(format!("{a}norm.weight"), &[l.value_head_dim]);
    Ok(())
}
