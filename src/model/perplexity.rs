//! Perplexity of a token stream: the mean negative log-likelihood of each predicted token over
//! consecutive windows, each run from an empty state (what `kestrel perplexity` reports, and
//! what the KV-format quality checks compare).

use crate::backend::{Backend, BackendError, BatchLayout, CacheSpec, KvDtype, RowKind, RowLayout};
use crate::model::arch::qwen35::Qwen35;

/// Why a stream could not be scored.
#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    #[error("cannot hold a window's keys and values as {kv_dtype}")]
    Cache {
        kv_dtype: KvDtype,
        #[source]
        source: BackendError,
    },
    #[error("the file holds {tokens} tokens: fewer than one whole window of --context {context} tokens to score")]
    NoWholeWindow { tokens: usize, context: usize },
    #[error(
        "the model's prediction of token {token} (window {window}, position {position}) is not a finite number ({nll}): its logits hold NaN or infinite values, so its weights or configuration are broken"
    )]
    NotFinite { token: usize, window: usize, position: usize, nll: f64 },
    #[error("no window holds 2 tokens to score")]
    NothingToScore,
}

/// The NLL of `target` under one logits row: log-sum-exp in f64 minus the target's logit.
fn token_nll(l: &[f32], target: u32) -> f64 {
    let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = m + l.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    lse - l[target as usize] as f64
}

/// Which tokens of the stream are scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// Every window, the last one possibly short; tokens 1..len of each.
    EveryToken,
    /// llama-perplexity's choice: whole windows only, the first token of each replaced by `bos`
    /// where the tokenizer adds one, and tokens context/2+1 .. context-1 of each.
    SecondHalf { bos: Option<u32> },
}

/// Mean NLL (nats) of each predicted token over the windows, with keys and values cached as
/// `kv_dtype`, and their count. Fails at the first token whose NLL is not a finite number. The
/// rows of a window are scored on `threads` threads; the sum runs in token order whatever
/// their number.
pub fn window_nll<B: Backend>(model: &Qwen35<B>, backend: &B, kv_dtype: KvDtype, ids: &[u32], context: usize, scoring: Scoring, threads: usize, progress: &indicatif::ProgressBar) -> Result<(f64, usize), PerplexityError> {
    let block_size = 16;
    let spec = CacheSpec { kv_dtype, ..model.cache_spec(context.div_ceil(block_size), block_size, 1, 0) };
    let mut cache = backend.alloc_cache(&spec).map_err(|source| PerplexityError::Cache { kv_dtype, source })?;
    let vocab = model.config.vocab_size;
    let (mut total, mut count) = (0.0f64, 0usize);
    let (windows, first): (Vec<&[u32]>, usize) = match scoring {
        Scoring::EveryToken => (ids.chunks(context).filter(|w| w.len() >= 2).collect(), 0),
        Scoring::SecondHalf { .. } => (ids.chunks_exact(context).collect(), context / 2),
    };
    if windows.is_empty() {
        return Err(PerplexityError::NoWholeWindow { tokens: ids.len(), context });
    }
    progress.set_length(windows.len() as u64);
    for (window, w) in windows.into_iter().enumerate() {
        let mut w = w.to_vec();
        if let Scoring::SecondHalf { bos: Some(bos) } = scoring {
            w[0] = bos;
        }
        backend.reset_states(&mut cache, &[0]);
        let layout = BatchLayout {
            rows: vec![RowLayout { kind: RowKind::Prefill, token_start: 0, num_tokens: w.len(), start_position: 0, block_table: (0..spec.num_blocks as u32).collect(), state_slot: 0, snapshot_base: 0 }],
        };
        let rows: Vec<u32> = (first as u32..w.len() as u32 - 1).collect();
        let out = model.forward(backend, &w, &layout, &rows, &mut cache);
        let logits = backend.to_host(&out.logits);
        let targets = &w[first + 1..];
        let per_thread = targets.len().div_ceil(threads.max(1));
        let nlls: Vec<f64> = std::thread::scope(|s| {
            let parts: Vec<_> = targets
                .chunks(per_thread)
                .enumerate()
                .map(|(p, part)| {
                    let logits = &logits;
                    s.spawn(move || part.iter().enumerate().map(|(j, &t)| token_nll(&logits[(p * per_thread + j) * vocab..][..vocab], t)).collect::<Vec<f64>>())
                })
                .collect();
            parts.into_iter().flat_map(|h| h.join().expect("a scoring thread")).collect()
        });
        for (i, nll) in nlls.into_iter().enumerate() {
            if !nll.is_finite() {
                return Err(PerplexityError::NotFinite { token: window * context + first + i + 1, window: window + 1, position: first + i + 1, nll });
            }
            total += nll;
            count += 1;
        }
        progress.inc(1);
    }
    if count == 0 {
        return Err(PerplexityError::NothingToScore);
    }
    Ok((total / count as f64, count))
}
