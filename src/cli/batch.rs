//! `kestrel batch`: JSONL requests in, one JSONL result per request out (in input order).

use super::{with_engine, EngineArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use kestrel::backend::Backend;
use kestrel::engine::request::{Request, RequestEvent, SpecMethod};
use kestrel::engine::Engine;
use kestrel::model::ModelFiles;
use kestrel::backend::sampling::SamplingParams;
use kestrel::tokenizer::ChatMessage;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct BatchArgs {
    /// JSONL file of requests.
    #[arg(long)]
    pub input: PathBuf,
    /// Where to write results (default: standard output).
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Maximum concurrent sequences.
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// One input line.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchLine {
    pub id: serde_json::Value,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
    #[serde(default)]
    pub temperature: f32,
    #[serde(default = "one")]
    pub top_p: f32,
    #[serde(default)]
    pub top_k: usize,
    #[serde(default)]
    pub seed: u64,
    pub spec: Option<SpecMethod>,
}

fn default_max_tokens() -> usize {
    128
}
fn one() -> f32 {
    1.0
}

pub fn run(args: BatchArgs) -> Result<()> {
    if args.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    let text = std::fs::read_to_string(&args.input).with_context(|| format!("cannot read {}", args.input.display()))?;
    let files = args.engine.open_model()?;
    let tok = &files.tokenizer;
    let mut lines = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let req: BatchLine = serde_json::from_str(line).with_context(|| format!("{} line {}: invalid request", args.input.display(), n + 1))?;
        let text = match (&req.prompt, &req.messages) {
            (Some(p), None) => p.clone(),
            (None, Some(m)) => tok.apply_chat_template(m, true, None).with_context(|| format!("line {}: chat template", n + 1))?,
            _ => bail!("{} line {}: give exactly one of `prompt` and `messages`", args.input.display(), n + 1),
        };
        let ids = tok.encode(&text, false)?;
        lines.push((n + 1, req, ids));
    }
    let results = with_engine!(args.engine, &files, args.max_batch, |engine| run_lines(engine, &lines, &files, &args.input)?);
    let mut out: Box<dyn Write> = match &args.output {
        Some(p) => Box::new(std::io::BufWriter::new(std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?)),
        None => Box::new(std::io::stdout().lock()),
    };
    for r in results.into_iter().flatten() {
        writeln!(out, "{}", serde_json::to_string(&r)?)?;
    }
    out.flush()?;
    Ok(())
}

/// Runs every line's request to the end; one result per line, in line order.
fn run_lines<B: Backend>(mut engine: Engine<B>, lines: &[(usize, BatchLine, Vec<u32>)], files: &ModelFiles, input: &Path) -> Result<Vec<Option<serde_json::Value>>> {
    let tok = &files.tokenizer;
    let mut by_engine_id = HashMap::new();
    for (idx, (n, req, ids)) in lines.iter().enumerate() {
        let request = Request {
            prompt_ids: ids.clone(),
            params: SamplingParams { temperature: req.temperature, top_k: req.top_k, top_p: req.top_p, seed: req.seed },
            max_tokens: req.max_tokens,
            stop_token_ids: files.config.eos_token_ids.clone(),
            spec: req.spec,
            logits: Default::default(),
        };
        let id = engine.add_request(request).with_context(|| format!("{} line {n}", input.display()))?;
        by_engine_id.insert(id, idx);
    }
    let mut results: Vec<Option<serde_json::Value>> = vec![None; lines.len()];
    while engine.has_unfinished() {
        for event in engine.step() {
            if let RequestEvent::Finished { id, reason, output } = event {
                let idx = by_engine_id[&id];
                let k = engine.reported_k(output.method);
                results[idx] = Some(serde_json::json!({
                    "id": lines[idx].1.id,
                    "text": tok.decode(&output.generated, true)?,
                    "token_ids": output.generated,
                    "finish_reason": reason.as_str(),
                    "usage": {"prompt_tokens": output.prompt_tokens, "completion_tokens": output.generated.len()},
                    "spec": output.spec.to_json(output.method.name(), k),
                }));
            }
        }
    }
    Ok(results)
}
