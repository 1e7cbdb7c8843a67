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
use kestrel::model::perplexity::{window_nll, PerplexityError, Scoring};
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
    args.device.check_tensor_parallel(&files)?;
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
    let score = |model_nll: &dyn Fn(&indicatif::ProgressBar) -> Result<(f64, usize), PerplexityError>| {
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
