//! Requests, their per-sequence state, stop conditions and the events the engine emits.

use super::cache::blocks::NodeId;
use super::logits::logprobs::TokenLogprob;
use super::logits::{LogitsOptions, LogitsState};
use super::metrics::SpecStats;
use crate::backend::sampling::SamplingParams;

pub type RequestId = u64;

/// How a request drafts tokens for speculative decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpecMethod {
    None,
    Ngram,
    Mtp,
}

impl SpecMethod {
    pub fn name(self) -> &'static str {
        match self {
            SpecMethod::None => "none",
            SpecMethod::Ngram => "ngram",
            SpecMethod::Mtp => "mtp",
        }
    }
}

impl std::str::FromStr for SpecMethod {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(SpecMethod::None),
            "ngram" => Ok(SpecMethod::Ngram),
            "mtp" => Ok(SpecMethod::Mtp),
            other => Err(format!("unknown speculation method `{other}` (expected none, ngram or mtp)")),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Request {
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    /// Generation stops after any of these (the stop token itself is not part of the output).
    pub stop_token_ids: Vec<u32>,
    /// Overrides the engine's speculation method for this request.
    pub spec: Option<SpecMethod>,
    /// Penalties, logit bias, grammar, log probabilities (none by default).
    pub logits: LogitsOptions,
}

impl Request {
    /// A request with no speculation override and nothing asked of its logits.
    pub fn new(prompt_ids: Vec<u32>, params: SamplingParams, max_tokens: usize, stop_token_ids: Vec<u32>) -> Self {
        Request { prompt_ids, params, max_tokens, stop_token_ids, spec: None, logits: LogitsOptions::default() }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop token was produced.
    Stop,
    /// `max_tokens` was reached.
    Length,
    /// The request was cancelled.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Why a request stopped before its generation could finish. The other requests go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestFailure {
    #[error("the model produced no finite logit for generated token {position} (only NaN or infinite values): its weights or configuration are broken")]
    NonFiniteLogits { position: usize },
}

/// What a step produced for one request.
#[derive(Debug, Clone)]
pub enum RequestEvent {
    /// Newly generated tokens, in order, with their log probabilities when the request asked,
    /// and the prompt tokens the request took from the prefix cache.
    Tokens { id: RequestId, tokens: Vec<u32>, logprobs: Vec<TokenLogprob>, cached_tokens: usize },
    Finished { id: RequestId, reason: FinishReason, output: SequenceSummary },
    /// The request ended with an error; `output` holds what it generated before.
    Failed { id: RequestId, error: RequestFailure, output: SequenceSummary },
}

/// Final accounting of a finished request.
#[derive(Debug, Clone)]
pub struct SequenceSummary {
    pub prompt_tokens: usize,
    pub generated: Vec<u32>,
    /// Log probabilities of the generated tokens, when the request asked.
    pub logprobs: Vec<TokenLogprob>,
    pub spec: SpecStats,
    pub method: SpecMethod,
    /// Prompt tokens served from the prefix cache (at the request's first admission).
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    Running,
}

/// How a newly admitted sequence's recurrent state starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreshState {
    /// Zeroed: the prompt is computed from its first token.
    Zero,
    /// Copied from this prefix-cache checkpoint.
    Checkpoint(usize),
}

/// A request in flight.
#[derive(Debug)]
pub struct Sequence {
    pub id: RequestId,
    pub prompt_len: usize,
    /// Prompt followed by every committed generated token.
    pub tokens: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub method: SpecMethod,
    pub status: SeqStatus,
    /// Tokens whose keys/values and recurrent state are in the cache (always < tokens.len()
    /// once generation started: the newest token is the next input).
    pub num_computed: usize,
    pub block_table: Vec<u32>,
    pub state_slot: Option<usize>,
    /// Drafts proposed for the next step.
    pub drafts: Vec<u32>,
    pub spec: SpecStats,
    /// Order of admission, for choosing whom to preempt (the newest first).
    pub admitted_at: u64,
    /// Penalties, bias, grammar and log probabilities of this request.
    pub logits: LogitsState,
    /// Log probabilities of the generated tokens so far, when asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// Set at admission, taken when the step's state resets and restores are laid out.
    pub fresh_state: Option<FreshState>,
    /// Prefix-cache node of each leading block of `block_table` found in or registered with
    /// the cache, in order.
    pub cache_nodes: Vec<NodeId>,
    /// Prompt tokens the first admission took from the prefix cache (`None` before it).
    pub cached_tokens: Option<usize>,
}

impl Sequence {
    pub fn new(id: RequestId, req: Request, method: SpecMethod) -> Self {
        let logits = LogitsState::new(req.logits, &req.prompt_ids);
        Sequence {
            id,
            prompt_len: req.prompt_ids.len(),
            tokens: req.prompt_ids,
            params: req.params,
            max_tokens: req.max_tokens,
            stop_token_ids: req.stop_token_ids,
            method,
            status: SeqStatus::Waiting,
            num_computed: 0,
            block_table: Vec::new(),
            state_slot: None,
            drafts: Vec::new(),
            spec: SpecStats::default(),
            admitted_at: 0,
            logits,
            logprobs: Vec::new(),
            fresh_state: None,
            cache_nodes: Vec::new(),
            cached_tokens: None,
        }
    }

    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Still feeding prompt tokens (nothing sampled yet from this admission's prefill).
    pub fn in_prefill(&self) -> bool {
        self.num_computed < self.prompt_len
    }

    /// Most drafts worth proposing: each step emits accepted + 1 tokens, so more drafts than
    /// tokens left (by max_tokens or by the context length) would be wasted work.
    pub fn max_useful_drafts(&self, max_model_len: usize) -> usize {
        (self.max_tokens - self.num_generated()).saturating_sub(1).min(max_model_len.saturating_sub(self.tokens.len()))
    }

    /// Forget all cached work (preemption): the sequence will recompute from scratch.
    pub fn reset_for_recompute(&mut self) {
        self.num_computed = 0;
        self.block_table.clear();
        self.state_slot = None;
        self.drafts.clear();
        self.status = SeqStatus::Waiting;
        self.fresh_state = None;
        self.cache_nodes.clear();
    }
}
