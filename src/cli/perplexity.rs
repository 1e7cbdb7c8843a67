//! `kestrel perplexity`: mean negative log-likelihood of a text file.
//!
//! The token stream is cut into consecutive windows of `--context` tokens; each window runs
//! from an empty state and predicts its tokens 1..len (a last window shorter than 2 is dropped).
//! With `--score-second-half` it scores the tokens that `llama-perplexity -c CONTEXT` scores, so
//! the two figures compare on the same file: only whole windows (the tail is dropped), each
//! starting with the BOS token where the tokenizer adds one, and in each only the predictions
//! made with at least half a window of context (tokens CONTEXT/2+1 .. CONTEXT-1).
//! A prediction that is not a finite number (NaN or infinite logits) ends the run with an error
//! naming the token, rather than a perplexity of NaN.

use super::flags::{DeviceArgs, KvCacheArgs, LongContextArgs, ModelArgs, SelectedBackend};
use super::{load_model, progress_bar};
use anyhow::{bail, Context, Result};
use clap::Args;
use kestrel::backend::{Backend, BatchLayout, CacheSpec, KvDtype, RowKind, RowLayout};
use kestrel::model::arch::qwen35::Qwen35;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct PerplexityArgs {
    /// Text file to score.
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens per window (at most the model's max_position_embeddings, unless
    /// --allow-long-context).
    #[arg(long, default_value_t = 256, value_name = "TOKENS")]
    pub context: usize,
    #[command(flatten)]
    pub long_context: LongContextArgs,
    /// Score as llama-perplexity does: whole windows only, each from BOS (where the tokenizer
    /// adds one), and only the tokens predicted from its second half.
    #[arg(long)]
    pub score_second_half: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub kv_cache: KvCacheArgs,
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
pub fn window_nll<B: Backend>(model: &Qwen35<B>, backend: &B, kv_dtype: KvDtype, ids: &[u32], context: usize, scoring: Scoring, threads: usize, progress: &indicatif::ProgressBar) -> Result<(f64, usize)> {
    let block_size = 16;
    let spec = CacheSpec { kv_dtype, ..model.cache_spec(context.div_ceil(block_size), block_size, 1, 0) };
    let mut cache = backend.alloc_cache(&spec).with_context(|| format!("cannot hold a window's keys and values as {kv_dtype}"))?;
    let vocab = model.config.vocab_size;
    let (mut total, mut count) = (0.0f64, 0usize);
    let (windows, first): (Vec<&[u32]>, usize) = match scoring {
        Scoring::EveryToken => (ids.chunks(context).filter(|w| w.len() >= 2).collect(), 0),
        Scoring::SecondHalf { .. } => (ids.chunks_exact(context).collect(), context / 2),
    };
    if windows.is_empty() {
        bail!("the file holds {} tokens: fewer than one whole window of --context {context} tokens to score", ids.len());
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
                bail!(
                    "the model's prediction of token {} (window {}, position {}) is not a finite number ({nll}): its logits hold NaN or infinite values, so its weights or configuration are broken",
                    window * context + first + i + 1,
                    window + 1,
                    first + i + 1
                );
            }
            total += nll;
            count += 1;
        }
        progress.inc(1);
    }
    if count == 0 {
        bail!("no window holds 2 tokens to score");
    }
    Ok((total / count as f64, count))
}

pub fn run(args: PerplexityArgs) -> Result<()> {
    if args.context < 2 {
        bail!("--context must be at least 2");
    }
    if args.score_second_half && args.context < 3 {
        bail!("--score-second-half needs --context of at least 3 (it scores tokens CONTEXT/2+1 .. CONTEXT-1 of each window)");
    }
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("cannot read {}", args.file.display()))?;
    args.device.check()?;
    let files = args.model.open()?;
    args.long_context.check("--context", args.context, &files)?;
    args.kv_cache.check(&files)?;
    let kv_dtype = args.kv_cache.dtype();
    let ids = files.tokenizer.encode(&text, false)?;
    let scoring = if args.score_second_half {
        // The tokenizer adds BOS where encoding with special tokens puts one token before the rest.
        let with_special = files.tokenizer.encode(&text, true)?;
        let bos = (with_special.len() == ids.len() + 1 && with_special[1..] == ids[..]).then(|| with_special[0]);
        Scoring::SecondHalf { bos }
    } else {
        Scoring::EveryToken
    };
    if ids.len() < 2 {
        bail!("{} holds fewer than 2 tokens", args.file.display());
    }
    let score = |model_nll: &dyn Fn(&indicatif::ProgressBar) -> Result<(f64, usize)>| {
        let bar = progress_bar(0, "scoring");
        let r = model_nll(&bar);
        bar.finish_and_clear();
        r
    };
    // One window's forward at a time: its tokens are the activations.
    let activations = files.config.activation_bytes(args.context, args.context);
    let (mean_nll, tokens) = match args.device.select_backend()? {
        SelectedBackend::Cpu(b) => {
            let model = load_model(&args.model, &args.device, &b, &files, activations)?;
            score(&|bar| window_nll(&model, &b, kv_dtype, &ids, args.context, scoring, b.threads(), bar))?
        }
        SelectedBackend::Cuda(b) => {
            let model = load_model(&args.model, &args.device, &*b, &files, activations)?;
            score(&|bar| window_nll(&model, &*b, kv_dtype, &ids, args.context, scoring, args.device.cpu_threads(), bar))?
        }
    };
    let ppl = mean_nll.exp();
    if args.json {
        println!("{}", serde_json::json!({"perplexity": ppl, "tokens": tokens, "mean_nll": mean_nll}));
    } else {
        println!("perplexity {ppl:.4}  mean NLL {mean_nll:.5} nats over {tokens} predicted tokens");
    }
    Ok(())
}
