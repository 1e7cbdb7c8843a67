//! The op set the model forward is written against.
//!
//! Activations are 2-D, token-major `[tokens, features]` f32 tensors. Each op is one kernel (or a
//! short fixed sequence of kernels) on a device backend, and every op computes a row's result
//! independently of the other rows in the batch and of how many there are (DESIGN Invariant 3):
//! fixed reduction orders, no algorithm switch on the row count.
//!
//! The cache ops take a [`BatchLayout`], which says for each request row where its tokens sit,
//! where its attention blocks and recurrent-state slot are, and whether it is a prefill chunk
//! (chunked delta rule, writes the canonical state) or a generate row (one decode token or a
//! verify row of 1 + k tokens: recurrent delta rule, writes one state snapshot per token and
//! leaves the canonical state alone until [`Backend::commit_states`]; a row of one token, which
//! is always committed, writes its delta-rule state in place: [`delta_state_in_place`]).

pub mod cpu;
pub mod cuda;
pub mod graph_step;
pub mod sampling;
pub mod shapes;
pub mod tensor_parallel;
pub mod weight_bytes;

use crate::backend::sampling::{sample_allowed, AllowedTokens, SamplingParams};
use crate::backend::shapes::{LinearAttnShape, MoeShape};
use crate::backend::weight_bytes::MatrixBytes;
pub use kestrel_quant::kv::KvDtype;
pub use graph_step::{CaptureWhen, ChainLink, GraphInputs, GraphKey, GraphedForward, Padded, PaddedShape, Real, RealShape};

/// Tokens per chunk of the chunked delta rule. Chunks are aligned to absolute positions, and the
/// scheduler cuts prompt pieces at multiples of this size, so any split of a prompt computes
/// exactly the same chunks on every backend.
pub const DELTA_RULE_CHUNK: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("device error: {0}")]
    Device(String),
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowKind {
    /// A piece of a prompt (or of recomputed prompt tokens after preemption).
    Prefill,
    /// Tokens after the prompt: a decode (1 token) or a verify row (1 + k tokens).
    Generate,
}

/// One request's rows in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct RowLayout {
    pub kind: RowKind,
    /// First token of this row in the step's token-indexed arrays.
    pub token_start: usize,
    pub num_tokens: usize,
    /// Absolute position of the row's first token in its sequence.
    pub start_position: usize,
    /// Attention KV blocks covering positions `0..start_position + num_tokens`.
    pub block_table: Vec<u32>,
    /// The request's canonical recurrent-state slot.
    pub state_slot: usize,
    /// Generate rows: snapshot slot of the state after token `i` is `snapshot_base + i`.
    pub snapshot_base: usize,
}

/// The rows of one forward step. Token-indexed data (ids, positions) is derived from it.
#[derive(Debug, Clone, Default)]
pub struct BatchLayout {
    pub rows: Vec<RowLayout>,
}

impl BatchLayout {
    pub fn num_tokens(&self) -> usize {
        self.rows.iter().map(|r| r.num_tokens).sum()
    }

    /// Absolute position of every token, token-indexed.
    pub fn positions(&self) -> Vec<u32> {
        let mut out = vec![0u32; self.num_tokens()];
        for r in &self.rows {
            for i in 0..r.num_tokens {
                out[r.token_start + i] = (r.start_position + i) as u32;
            }
        }
        out
    }
}

/// How to draw the token of one logits row: the request's sampling parameters and the output
/// position the row predicts (the key of the position-keyed noise, see backend/sampling/).
#[derive(Debug, Clone)]
pub struct RowSampling {
    pub params: SamplingParams,
    pub position: u64,
    /// Only these tokens may be drawn (a grammar's mask); `None`: any.
    pub allowed: Option<AllowedTokens>,
}

/// The largest step the engine will run, so that a backend can allocate its per-step input
/// buffers once at their maximum sizes (DESIGN Invariant 4).
#[derive(Debug, Clone, Copy)]
pub struct StepLimits {
    pub max_tokens: usize,
    pub max_rows: usize,
    pub max_blocks_per_row: usize,
}

/// Sizes of the attention and recurrent caches.
#[derive(Debug, Clone)]
pub struct CacheSpec {
    /// Full-attention layers that keep KV (main model layers plus MTP layers).
    pub attention_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// How keys and values are stored (kestrel_quant::kv).
    pub kv_dtype: KvDtype,
    /// Gated-DeltaNet layers.
    pub linear_layers: usize,
    pub linear: LinearAttnShape,
    /// Canonical recurrent-state slots (one per running request).
    pub state_slots: usize,
    /// Snapshot slots for generate rows (1 + k per verifying request).
    pub snapshot_slots: usize,
    /// Checkpoint slots of the prefix cache: recurrent states kept at cached prompt positions.
    pub checkpoint_slots: usize,
}

impl CacheSpec {
    /// Bytes one token's keys and values take over every attention layer, in the cache's KV
    /// format (parameters such as scales and norms included).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.attention_layers * self.kv_heads * self.kv_dtype.bytes_per_token_head(self.head_dim)
    }

    /// Device bytes of one KV block over every attention layer.
    pub fn bytes_per_block(&self) -> usize {
        self.block_size * self.kv_bytes_per_token()
    }

    /// Bytes of one request's recurrent state (conv windows and delta-rule states of every
    /// linear layer): one slot, one snapshot, or one prefix-cache checkpoint.
    pub fn bytes_per_state(&self) -> usize {
        self.linear_layers * (self.linear.conv_state_len() + self.linear.recurrent_state_len()) * 4
    }

    /// Device bytes of the recurrent state: canonical slots, snapshots and checkpoints.
    pub fn state_bytes(&self) -> usize {
        (self.state_slots + self.snapshot_slots + self.checkpoint_slots) * self.bytes_per_state()
    }
}

/// Shapes of a gated attention layer.
#[derive(Debug, Clone, Copy)]
pub struct AttentionDims {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub eps: f32,
}

/// Weights of one mixture-of-experts block.
pub struct MoeWeights<B: Backend + ?Sized> {
    /// Router `[E, H]`; with `shared_gate`, the shared expert's gate row `[1, H]` stacked under
    /// it (both read the same input: one matmul).
    pub router: B::Matrix,
    /// Per expert: gate stacked over up `[2I, H]` ([`Backend::matmul_swiglu`]), down `[H, I]`.
    pub experts: Vec<[B::Matrix; 2]>,
    /// The shared expert, laid out like the others.
    pub shared: Option<[B::Matrix; 2]>,
    /// Whether the router's last row is the shared expert's sigmoid gate.
    pub shared_gate: bool,
}

impl<B: Backend + ?Sized> MoeWeights<B> {
    /// Column parts of the router's output: the expert logits, then the shared gate if any.
    pub fn router_widths(&self, num_experts: usize) -> Vec<usize> {
        let mut widths = vec![num_experts];
        if self.shared_gate {
            widths.push(1);
        }
        widths
    }
}

pub trait Backend: Send + Sync {
    type Tensor: Send + Sync;
    type Matrix: Send + Sync;
    type Vector: Send + Sync;
    type Cache: Send;

    fn name(&self) -> &'static str;

    fn upload_matrix(&self, m: &MatrixBytes) -> Result<Self::Matrix, BackendError>;
    /// One matrix of `parts` stacked by rows (all with the same column count): a layer's
    /// projections that read the same input become one matmul ([`Backend::matmul_parts`],
    /// [`Backend::matmul_swiglu`]). Nothing is copied on the host.
    fn upload_stacked(&self, parts: &[MatrixBytes]) -> Result<Self::Matrix, BackendError>;
    /// A SwiGLU's gate over its up projection (same shapes), read only by
    /// [`Backend::matmul_swiglu`] and the MoE: a device backend may interleave their rows so that
    /// one thread holds a gate output and its up output (quantized tiles do).
    fn upload_gate_up(&self, gate: &MatrixBytes, up: &MatrixBytes) -> Result<Self::Matrix, BackendError> {
        self.upload_stacked(&[gate.clone(), up.clone()])
    }
    fn upload_vector(&self, v: &[f32]) -> Result<Self::Vector, BackendError>;
    fn alloc_cache(&self, spec: &CacheSpec) -> Result<Self::Cache, BackendError>;

    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Self::Tensor;
    fn to_host(&self, x: &Self::Tensor) -> Vec<f32>;
    fn shape(&self, x: &Self::Tensor) -> (usize, usize);

    /// Rows of `table` for each id.
    fn embed(&self, table: &Self::Matrix, ids: &[u32]) -> Self::Tensor;
    /// Row-wise RMSNorm with a plain multiplicative weight (zero-centred weights have the 1 folded in at load).
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Vector, eps: f32) -> Self::Tensor;
    /// `x @ w^T` for `w` stored `[out, in]`.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Matrix) -> Self::Tensor;
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor);
    /// `acc += x @ w^T`, bitwise what `add_assign(acc, &matmul(x, w))` gives (a device backend
    /// adds in the matmul's store and saves a launch and a tensor).
    fn matmul_add(&self, acc: &mut Self::Tensor, x: &Self::Tensor, w: &Self::Matrix) {
        let y = self.matmul(x, w);
        self.add_assign(acc, &y);
    }
    /// `x @ w^T` for a row-stacked weight ([`Backend::upload_stacked`]), its output columns cut
    /// into consecutive parts of `widths`; bitwise the columns of `matmul(x, w)`.
    fn matmul_parts(&self, x: &Self::Tensor, w: &Self::Matrix, widths: &[usize]) -> Vec<Self::Tensor> {
        let y = self.matmul(x, w);
        let mut start = 0u32;
        widths
            .iter()
            .map(|&n| {
                let cols: Vec<u32> = (start..start + n as u32).collect();
                start += n as u32;
                self.gather_cols(&y, &cols)
            })
            .collect()
    }
    /// `silu(x @ gate^T) * (x @ up^T)` for `w` = gate stacked over up (`[2I, in]`); bitwise
    /// `silu_mul` of the two products.
    fn matmul_swiglu(&self, x: &Self::Tensor, w: &Self::Matrix) -> Self::Tensor {
        let mut parts = self.matmul_parts(x, w, &[self.matrix_rows(w) / 2; 2]).into_iter();
        let (gate, up) = (parts.next().expect("two parts"), parts.next().expect("two parts"));
        self.silu_mul(&gate, &up)
    }
    /// `matmul_parts(rms_norm(x, norm), w, widths)`, bitwise. A device backend normalizes the
    /// rows inside the matmul's launch (one launch fewer per layer norm).
    fn rms_norm_matmul_parts(&self, x: &Self::Tensor, norm: &Self::Vector, eps: f32, w: &Self::Matrix, widths: &[usize]) -> Vec<Self::Tensor> {
        self.matmul_parts(&self.rms_norm(x, norm, eps), w, widths)
    }
    /// `matmul_swiglu(rms_norm(x, norm), w)`, bitwise; the norm as in
    /// [`Backend::rms_norm_matmul_parts`].
    fn rms_norm_matmul_swiglu(&self, x: &Self::Tensor, norm: &Self::Vector, eps: f32, w: &Self::Matrix) -> Self::Tensor {
        self.matmul_swiglu(&self.rms_norm(x, norm, eps), w)
    }
    /// Output rows of a matrix (`out` of `[out, in]`).
    fn matrix_rows(&self, w: &Self::Matrix) -> usize;
    /// `silu(gate) * up`.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Self::Tensor;
    /// Columns of `x` in the order given (`out[:, j] = x[:, cols[j]]`).
    fn gather_cols(&self, x: &Self::Tensor, cols: &[u32]) -> Self::Tensor;
    /// Rows of `x` in the order given.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[u32]) -> Self::Tensor;
    /// `[a | b]` along columns.
    fn concat_cols(&self, a: &Self::Tensor, b: &Self::Tensor) -> Self::Tensor;

    /// Full gated attention core for one layer: splits the per-head `[q | gate]` projection,
    /// applies the per-head q/k RMSNorm and partial NeoX RoPE, writes K and V into the paged
    /// cache, attends causally over each row's context, and multiplies by `sigmoid(gate)`.
    /// Returns `[T, num_heads * head_dim]`, ready for the output projection.
    #[allow(clippy::too_many_arguments)]
    fn gated_attention(
        &self,
        q_gate: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        q_norm: &Self::Vector,
        k_norm: &Self::Vector,
        dims: &AttentionDims,
        layout: &BatchLayout,
        cache: &mut Self::Cache,
        attention_layer: usize,
    ) -> Self::Tensor;

    /// Gated DeltaNet core for one layer: causal depthwise conv (+SiLU) over `mixed` = q|k|v with
    /// the conv window, decay `g = -exp(a_log) * softplus(a + dt_bias)` and `beta = sigmoid(b)`,
    /// l2-normalized q/k, the delta rule (chunked for prefill rows, recurrent with per-token
    /// snapshots for generate rows), and the gated RMSNorm `norm(o) * w * silu(z)`.
    /// Returns `[T, value_dim]`, ready for the output projection.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_net(
        &self,
        mixed: &Self::Tensor,
        z: &Self::Tensor,
        b: &Self::Tensor,
        a: &Self::Tensor,
        params: &GdnParams<Self>,
        cfg: &LinearAttnShape,
        eps: f32,
        layout: &BatchLayout,
        cache: &mut Self::Cache,
        linear_layer: usize,
    ) -> Self::Tensor;

    /// `acc += moe(x)`: mixture of experts with softmax top-k routing and an optional
    /// sigmoid-gated shared expert, added into the residual stream (bitwise what `add_assign`
    /// of the MoE output would give).
    fn moe_add(&self, acc: &mut Self::Tensor, x: &Self::Tensor, w: &MoeWeights<Self>, cfg: &MoeShape);

    /// The MoE half of a layer on the residual stream `acc`: `acc += moe(rms_norm(acc,
    /// pre_norm))`, then the RMSNorm of the updated stream by `next_norm` (the next layer's
    /// input norm), bitwise what those separate ops give. A device backend normalizes the
    /// input inside the router launch and the output in the MoE's last pass over the rows.
    #[allow(clippy::too_many_arguments)]
    fn moe_residual(&self, acc: &mut Self::Tensor, pre_norm: &Self::Vector, w: &MoeWeights<Self>, cfg: &MoeShape, next_norm: &Self::Vector, eps: f32) -> Self::Tensor {
        let x = self.rms_norm(acc, pre_norm, eps);
        self.moe_add(acc, &x, w, cfg);
        self.rms_norm(acc, next_norm, eps)
    }

    /// [`Backend::moe_residual`], then the next layer's input projection on its result:
    /// `proj` (row-stacked) cut into `widths`, bitwise `matmul_parts` of the normalized rows. A
    /// device backend adds up the experts' rows and normalizes them inside the projection's
    /// launch, so the normalized rows are not returned.
    #[allow(clippy::too_many_arguments)]
    fn moe_residual_project(
        &self,
        acc: &mut Self::Tensor,
        pre_norm: &Self::Vector,
        w: &MoeWeights<Self>,
        cfg: &MoeShape,
        next_norm: &Self::Vector,
        eps: f32,
        proj: &Self::Matrix,
        widths: &[usize],
    ) -> Vec<Self::Tensor> {
        let h = self.moe_residual(acc, pre_norm, w, cfg, next_norm, eps);
        self.matmul_parts(&h, proj, widths)
    }

    /// One token per row of `logits` (`[N, vocab]`), drawn by position-keyed sampling
    /// ([`crate::backend::sampling::sample_at_position`]) with `rows[i]` for row `i`, tokens
    /// outside the row's `allowed` masked ([`sample_allowed`]); a row without a finite (allowed)
    /// logit gives [`crate::backend::sampling::NO_FINITE_LOGIT`]. A device backend masks and draws
    /// on the device so that only the tokens come back; this default copies the logits to the host.
    fn sample_rows(&self, logits: &Self::Tensor, rows: &[RowSampling]) -> Vec<u32> {
        let (n, vocab) = self.shape(logits);
        assert_eq!(n, rows.len(), "sample_rows: {n} logits rows, {} sampling specs", rows.len());
        let host = self.to_host(logits);
        rows.iter().enumerate().map(|(i, r)| sample_allowed(&host[i * vocab..(i + 1) * vocab], r.allowed.as_deref(), &r.params, r.position)).collect()
    }

    /// Rows `rows` of `logits` (`[N, vocab]`) on the host, one after another, for rows the
    /// engine adjusts or reads before drawing (penalties, grammar masks, log probabilities).
    fn logits_rows_to_host(&self, logits: &Self::Tensor, rows: &[usize]) -> Vec<f32> {
        let (_, vocab) = self.shape(logits);
        let host = self.to_host(logits);
        rows.iter().flat_map(|&r| host[r * vocab..(r + 1) * vocab].iter().copied()).collect()
    }

    /// While `Some(seed)`, `upload_matrix` ignores the bytes it is given and fills the matrix
    /// with random bf16 values made by the backend (`--load-format dummy`: real-size models
    /// without files). The CPU and CUDA backends make the same values from the same seed; a
    /// backend that cannot make them says so.
    fn set_random_weights(&self, seed: Option<u64>) -> Result<(), BackendError> {
        match seed {
            None => Ok(()),
            Some(_) => Err(BackendError::Invalid(format!("the {} backend cannot make random weights", self.name()))),
        }
    }

    /// Runs `forward` (a whole model forward over the padded step `inputs`, whose launches
    /// depend only on `inputs.key()`, returning outputs of one row per padded token, or per
    /// padded row for a drafter forward: [`GraphInputs::padded_output_rows`]) and returns its
    /// outputs cut to the real rows, the first ones. A device backend
    /// may capture it as a graph and replay the graph afterwards, with the inputs written to
    /// the persistent buffers the graph reads (DESIGN Invariant 4). This default runs it.
    fn run_graphed(&self, inputs: &GraphInputs<'_>, forward: &mut dyn FnMut() -> Vec<Self::Tensor>) -> Vec<Self::Tensor> {
        let outputs = forward();
        if inputs.padded_output_rows().0 == inputs.real_output_rows().0 {
            return outputs;
        }
        outputs.iter().map(|t| self.first_rows(t, inputs.real_output_rows())).collect()
    }

    /// [`Backend::run_graphed`] of a forward that also reads a hidden-state input of a row per
    /// padded token: rows `rows` of `x` for the real tokens, then rows for the padded ones
    /// (finite values that only padded rows read). A device backend gathers them into a buffer
    /// at a fixed address, which its graph reads. This default gathers them (the padded tokens'
    /// from `x`'s first row) and runs `forward`.
    fn run_graphed_on_rows(&self, inputs: &GraphInputs<'_>, x: &Self::Tensor, rows: &[u32], forward: &mut dyn FnMut(&Self::Tensor) -> Vec<Self::Tensor>) -> Vec<Self::Tensor> {
        assert_eq!(rows.len(), inputs.real.tokens.0, "a hidden-state row per real token");
        let mut all = rows.to_vec();
        all.resize(inputs.padded.tokens.0, 0);
        let hidden = self.gather_rows(x, &all);
        self.run_graphed(inputs, &mut || forward(&hidden))
    }

    /// Drafts by a chain of drafter forwards: the argmax of `logits` (the forward before the
    /// chain, `[N, vocab]`) gives the first drafts; then each link runs as
    /// [`Backend::run_graphed_on_rows`] runs a forward, on rows `link.prev_rows` of the previous
    /// forward's hidden output (`hidden` for the first link), its real rows' ids being the
    /// argmax of the previous forward's logits at those rows, 0 where there was no finite
    /// logit (such a row's later drafts are the caller's to drop). `forward` returns a link's
    /// [hidden states, logits]. Returns the argmax of each forward's logits rows (`logits`'
    /// rows, then each link's real rows), [`sampling::NO_FINITE_LOGIT`] where none is finite.
    /// A device backend keeps the ids on the device and reads every draft back once, at the
    /// end; this default reads each forward's back before the next.
    fn run_graphed_chain(&self, logits: &Self::Tensor, hidden: &Self::Tensor, links: &[ChainLink<'_>], forward: &mut dyn FnMut(&GraphInputs<'_>, &Self::Tensor) -> Vec<Self::Tensor>) -> Vec<Vec<u32>> {
        let greedy = |t: &Self::Tensor| {
            let spec = RowSampling { params: SamplingParams::greedy(), position: 0, allowed: None };
            self.sample_rows(t, &vec![spec; self.shape(t).0])
        };
        let mut drafts = vec![greedy(logits)];
        let mut last_hidden: Option<Self::Tensor> = None;
        for link in links {
            let previous = drafts.last().expect("the first forward's drafts");
            let mut ids = link.inputs.ids.to_vec();
            for (id, &row) in ids.iter_mut().zip(&link.prev_rows) {
                let draft = previous[row as usize];
                *id = if draft == sampling::NO_FINITE_LOGIT { 0 } else { draft };
            }
            let inputs = GraphInputs { ids: &ids, ..link.inputs };
            let x = last_hidden.as_ref().unwrap_or(hidden);
            let mut outputs = self.run_graphed_on_rows(&inputs, x, &link.prev_rows, &mut |h| forward(&inputs, h));
            let step_logits = outputs.pop().expect("a drafter forward returns hidden states and logits");
            last_hidden = Some(outputs.pop().expect("a drafter forward returns hidden states and logits"));
            drafts.push(greedy(&step_logits));
        }
        drafts
    }

    /// [`Backend::prepare_graph`] of a forward with a hidden-state input `cols` wide (see
    /// [`Backend::run_graphed_on_rows`]).
    fn prepare_graph_on_rows(&self, _inputs: &GraphInputs<'_>, _cols: usize, _forward: &mut dyn FnMut(&Self::Tensor) -> Vec<Self::Tensor>) -> Result<bool, BackendError> {
        Ok(false)
    }

    /// Captures the graph of `inputs`' key ahead of the steps that replay it (start-up), and
    /// runs it once; `Ok(false)` where the backend does not replay graphs. `inputs` must be a
    /// step whose rows are all padding: it writes only scratch cache memory.
    fn prepare_graph(&self, _inputs: &GraphInputs<'_>, _forward: &mut dyn FnMut() -> Vec<Self::Tensor>) -> Result<bool, BackendError> {
        Ok(false)
    }

    /// Whether this backend replays steps as graphs (so padding steps to capture sizes pays).
    fn replays_graphs(&self) -> bool {
        false
    }

    /// Device memory in use now, in bytes; `None` where there is no separate device memory.
    fn device_memory_used(&self) -> Option<usize> {
        None
    }

    /// The first `rows` rows of `x` (a padded step's real rows).
    fn first_rows(&self, x: &Self::Tensor, rows: Real) -> Self::Tensor {
        let indices: Vec<u32> = (0..rows.0 as u32).collect();
        self.gather_rows(x, &indices)
    }

    /// Allocates per-step input buffers for steps up to `limits` (a no-op where inputs are host
    /// memory). Steps beyond the limits still run; the buffers grow.
    fn reserve_step_inputs(&self, _limits: StepLimits) -> Result<(), BackendError> {
        Ok(())
    }

    /// Bytes of device memory the caches may take, given that the process may hold
    /// `utilization` of the device and that `workspace` bytes must stay free for activations.
    /// `None` on a backend without a separate device memory (the CPU).
    fn cache_memory_budget(&self, _utilization: f32, _workspace: usize) -> Option<Result<usize, BackendError>> {
        None
    }

    /// For each commit, makes snapshot `snapshot` the canonical recurrent state (conv window and
    /// delta-rule state; the conv window only with `conv_only`) of `slot`, in every linear
    /// layer. The slots are distinct.
    fn commit_states(&self, cache: &mut Self::Cache, commits: &[StateCommit]);
    /// Zeroes the recurrent state of each slot (new sequences).
    fn reset_states(&self, cache: &mut Self::Cache, slots: &[usize]);
    /// Copies the canonical recurrent state of each `slot` (every linear layer) to prefix-cache
    /// checkpoint `checkpoint`. The checkpoints are distinct.
    fn save_checkpoints(&self, cache: &mut Self::Cache, copies: &[StateCheckpoint]);
    /// Copies checkpoint `checkpoint` to the canonical recurrent state of each `slot` (a request
    /// resuming from a cached prefix). The slots are distinct.
    fn restore_checkpoints(&self, cache: &mut Self::Cache, copies: &[StateCheckpoint]);
}

/// A recurrent state copied between a request's canonical slot and a prefix-cache checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateCheckpoint {
    pub slot: usize,
    pub checkpoint: usize,
}

/// One request's accepted state: snapshot slot `snapshot` becomes the canonical state of `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateCommit {
    pub slot: usize,
    pub snapshot: usize,
    /// The row wrote its delta-rule state in place ([`delta_state_in_place`]): only its conv
    /// window comes from the snapshot.
    pub conv_only: bool,
}

/// Whether a row writes its delta-rule state straight to its canonical slot: a generate row of
/// one token (a decode step with no drafts to verify), whose token is always accepted. Copying
/// that state from a snapshot would move the layer's largest state twice per step; every other
/// generate row writes a snapshot per token and waits for [`Backend::commit_states`]. Its conv
/// window still goes to the snapshot: on a device, blocks of other value heads of the same key
/// head read the window while the row runs.
pub fn delta_state_in_place(kind: RowKind, num_tokens: usize) -> bool {
    kind == RowKind::Generate && num_tokens == 1
}

/// Per-layer constants of a Gated DeltaNet block.
pub struct GdnParams<B: Backend + ?Sized> {
    /// `[conv_dim, K]` depthwise kernel.
    pub conv_weight: B::Vector,
    /// `-exp(A_log)` per value head.
    pub neg_a: B::Vector,
    pub dt_bias: B::Vector,
    /// Output norm weight `[dv]` (plain, shared across heads).
    pub norm_weight: B::Vector,
}
