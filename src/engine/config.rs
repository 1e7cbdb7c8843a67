//! What an engine is built with (its configuration and errors) and the counters it keeps.

use super::metrics::SpecStats;
use super::padding::{CaptureSizes, PaddingStats};
use super::request::{RequestId, SpecMethod};
use crate::backend::KvDtype;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("prompt of {prompt} tokens plus max_tokens {max_tokens} exceeds the context length of {context} tokens")]
    ContextExceeded { prompt: usize, max_tokens: usize, context: usize },
    #[error("the request needs {need} KV blocks but the cache holds {total}; raise the cache size or shorten the request")]
    CacheTooSmall { need: usize, total: usize },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
    #[error("speculation method `mtp` needs a model with an MTP head (mtp.* tensors)")]
    NoMtpHead,
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error("unknown request id {0}")]
    UnknownRequest(RequestId),
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_model_len: usize,
    pub spec: SpecMethod,
    /// Drafts per step (k).
    pub spec_tokens: usize,
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// Replay decode steps as CUDA graphs where the backend can.
    pub cuda_graphs: bool,
    /// How the attention cache stores keys and values.
    pub kv_dtype: KvDtype,
    /// Capture sizes in rows that generate-only steps are padded up to. `None`: the default
    /// ([`CaptureSizes::default_up_to`]) on a backend that replays graphs, no padding on one
    /// that does not; empty: every step keeps its exact shape.
    pub cuda_graph_sizes: Option<CaptureSizes>,
    /// The largest capture size (default and at most: `max_num_seqs`).
    pub max_cuda_graph_size: Option<usize>,
    /// Recurrent-state checkpoints the prefix cache may keep; 0 turns prefix caching off.
    pub prefix_cache_checkpoints: usize,
    /// Verify fewer drafts per row (down to none) when measured step costs say they would not
    /// pay ([`SpecBackoff`](super::spec::backoff::SpecBackoff)); off: every step offers `spec_tokens`.
    pub spec_backoff: bool,
}

impl EngineConfig {
    /// Whether steps may carry one padded row past the sequences: with speculation and
    /// capture sizes (the default on a backend that `replays_graphs`), a verify step of a full
    /// batch pads its tokens up to a capture shape of rows x m tokens, and padded tokens ride
    /// on padded rows; without that row such a step would run at its exact shape, eagerly.
    pub fn verify_padding_row(&self, replays_graphs: bool) -> bool {
        let sizes = match &self.cuda_graph_sizes {
            Some(sizes) => !sizes.is_empty(),
            None => replays_graphs,
        };
        self.spec != SpecMethod::None && self.cuda_graphs && sizes
    }

    /// Rows a step may have: a row per sequence, and the padded verify row where there is one.
    pub fn max_step_rows(&self, replays_graphs: bool) -> usize {
        self.max_num_seqs + usize::from(self.verify_padding_row(replays_graphs))
    }

    /// Recurrent-state snapshot slots: every generate-row token takes one. With speculation on
    /// there is room for a full verify row per step row (padded ones included). With `none` (a
    /// real model's snapshot takes tens of MiB) there is one per sequence plus one verify row's
    /// drafts, which requests that ask for speculation themselves share. Recomputed replays
    /// that need more are fed over several steps.
    pub fn snapshot_slots(&self, replays_graphs: bool) -> usize {
        let slots = match self.spec {
            SpecMethod::None => self.max_num_seqs + self.spec_tokens,
            _ => self.max_step_rows(replays_graphs) * (self.spec_tokens + 1),
        };
        slots.min(self.max_num_batched_tokens)
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_seqs: 16,
            max_num_batched_tokens: 512,
            block_size: 16,
            num_blocks: 1024,
            max_model_len: 4096,
            spec: SpecMethod::None,
            spec_tokens: 4,
            ngram_min: 2,
            ngram_max: 4,
            cuda_graphs: true,
            kv_dtype: KvDtype::default(),
            cuda_graph_sizes: None,
            max_cuda_graph_size: None,
            prefix_cache_checkpoints: 64,
            spec_backoff: false,
        }
    }
}

/// Engine-wide counters.
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    pub steps: u64,
    pub forward_tokens: u64,
    pub spec: SpecStats,
    /// Real and padded rows of the steps run at a capture size or replayed at their own shape.
    pub padding: PaddingStats,
    /// Steps whose rows were offered fewer drafts than `spec_tokens` by the back-off.
    pub backed_off_steps: u64,
}

