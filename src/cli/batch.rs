//! `kestrel batch`: JSONL requests in, one JSONL line per request out, written as each request
//! finishes. A line that cannot run (malformed JSON, an unknown role, a prompt past the context)
//! gets a line with its `id` and an `error` object; the others run.

use super::flags::{ConcurrencyArgs, GenerationConfigArgs};
use super::{progress_bar, with_engine, EngineArgs};
use anyhow::{Context, Result};
use clap::Args;
use kestrel::backend::sampling::{seed_from_signed, top_k_from_signed, SamplingParams};
use kestrel::backend::Backend;
use kestrel::engine::request::{Request, RequestEvent, SpecMethod};
use kestrel::engine::Engine;
use kestrel::model::generation_config::SamplingDefaults;
use kestrel::model::ModelFiles;
use kestrel::tokenizer::ChatMessage;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

/// The input format, shown by `kestrel batch --help`.
pub const INPUT_FORMAT: &str = "\
Input: one JSON object per line (blank lines are skipped):
  {\"id\": \"a\", \"prompt\": \"def fib(n):\", \"max_tokens\": 64}
  {\"id\": 2, \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": 0.7, \"seed\": 1}
Fields: id (any JSON value, required), prompt (text) or messages (role system, user,
assistant or tool; through the chat template), max_tokens (default 128), temperature, top_p,
top_k, min_p (default: the model's generation_config.json, else greedy), seed (-1: random),
spec (none, ngram or mtp).
Output: one line per input line, in the order requests finish:
  {\"id\", \"text\", \"token_ids\", \"finish_reason\", \"usage\", \"spec\"}, or for a line that
  could not run {\"id\", \"line\", \"error\": {\"message\", \"type\"}}.";

#[derive(Debug, Args)]
#[command(after_long_help = INPUT_FORMAT)]
pub struct BatchArgs {
    /// JSONL file of requests (`--help` shows the format).
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Where to write results (default: standard output).
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub concurrency: ConcurrencyArgs,
    #[command(flatten)]
    pub generation: GenerationConfigArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// One input line.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchLine {
    pub id: Value,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub spec: Option<SpecMethod>,
}

fn default_max_tokens() -> usize {
    128
}

/// A line ready for the engine.
struct Prepared {
    line: usize,
    id: Value,
    request: Request,
}

/// Why a line cannot run, and its id when the line got as far as naming one.
struct LineError {
    line: usize,
    id: Value,
    kind: &'static str,
    message: String,
}

impl LineError {
    fn to_json(&self) -> Value {
        json!({"id": self.id, "line": self.line, "error": {"message": format!("line {}: {}", self.line, self.message), "type": self.kind}})
    }
}

/// The request of input line `line` (1-based), or why it cannot run.
fn prepare(line: usize, text: &str, files: &ModelFiles, defaults: &SamplingDefaults) -> Result<Prepared, LineError> {
    let invalid = |id: &Value, message: String| LineError { line, id: id.clone(), kind: "invalid_request", message };
    let value: Value = serde_json::from_str(text).map_err(|err| {
        // serde_json counts lines within the one line it was given: its column is what helps.
        let message = err.to_string();
        let what = message.rsplit_once(" at line ").map_or(message.as_str(), |(what, _)| what);
        invalid(&Value::Null, format!("malformed JSON at column {}: {what}", err.column()))
    })?;
    let id = value.get("id").cloned().unwrap_or(Value::Null);
    let req: BatchLine = serde_path_to_error::deserialize(&value).map_err(|err| {
        let path = err.path().to_string();
        let message = err.into_inner().to_string();
        invalid(&id, if path == "." { message } else { format!("`{path}`: {message}") })
    })?;
    let prompt = match (&req.prompt, &req.messages) {
        (Some(p), None) => p.clone(),
        (None, Some(messages)) => {
            if let Some((i, m)) = messages.iter().enumerate().find(|(_, m)| !["system", "user", "assistant", "tool"].contains(&m.role.as_str())) {
                return Err(invalid(&id, format!("messages[{i}]: unknown role `{}` (expected system, user, assistant or tool)", m.role)));
            }
            files.tokenizer.apply_chat_template(messages, true, None).map_err(|err| invalid(&id, format!("cannot apply the chat template: {err}")))?
        }
        _ => return Err(invalid(&id, "give exactly one of `prompt` and `messages`".into())),
    };
    let prompt_ids = files.tokenizer.encode(&prompt, false).map_err(|err| invalid(&id, format!("cannot tokenize the prompt: {err}")))?;
    let refused = |err: kestrel::backend::sampling::SamplingError| invalid(&id, format!("`{}`: {err}", err.field()));
    let params = SamplingParams {
        temperature: req.temperature.or(defaults.temperature).unwrap_or(0.0),
        top_p: req.top_p.or(defaults.top_p).unwrap_or(1.0),
        top_k: match req.top_k {
            Some(k) => top_k_from_signed(k).map_err(refused)?,
            None => defaults.top_k.unwrap_or(0),
        },
        min_p: req.min_p.or(defaults.min_p).unwrap_or(0.0),
        seed: match req.seed {
            Some(seed) => seed_from_signed(seed).unwrap_or_else(rand::random),
            None => 0,
        },
    };
    params.validate().map_err(refused)?;
    // A chat conversation's reply ends at the template's end-of-turn token too.
    let stop_token_ids = if req.messages.is_some() { files.chat_stop_token_ids() } else { files.config.eos_token_ids.clone() };
    let request = Request { spec: req.spec, ..Request::new(prompt_ids, params, req.max_tokens, stop_token_ids) };
    Ok(Prepared { line, id: req.id, request })
}

/// Where result lines go, each written and flushed as its request finishes.
struct ResultWriter {
    out: Box<dyn Write>,
    bar: indicatif::ProgressBar,
    failed: usize,
}

impl ResultWriter {
    fn write(&mut self, value: &Value) -> Result<()> {
        let line = serde_json::to_string(value)?;
        // Above the progress bar, so the two never interleave on a terminal.
        self.bar.suspend(|| writeln!(self.out, "{line}").and_then(|()| self.out.flush())).context("cannot write the results")?;
        self.bar.inc(1);
        Ok(())
    }

    fn error(&mut self, error: &LineError) -> Result<()> {
        self.failed += 1;
        self.write(&error.to_json())
    }
}

pub fn run(args: BatchArgs) -> Result<()> {
    let max_num_seqs = args.concurrency.check()?;
    let bytes = std::fs::read(&args.input).with_context(|| format!("cannot read {}", args.input.display()))?;
    let text = String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", args.input.display()))?;
    // Editors on Windows start UTF-8 files with a byte-order mark; it is not part of line 1.
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let files = args.engine.open_model()?;
    let defaults = args.generation.defaults(&files);
    let lines: Vec<(usize, &str)> = text.lines().enumerate().map(|(n, l)| (n + 1, l)).filter(|(_, l)| !l.trim().is_empty()).collect();
    let out: Box<dyn Write> = match &args.output {
        Some(p) => Box::new(std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?),
        None => Box::new(std::io::stdout()),
    };
    let mut writer = ResultWriter { out, bar: progress_bar(lines.len() as u64, "batch"), failed: 0 };
    let mut prepared = Vec::new();
    for (line, text) in lines {
        match prepare(line, text, &files, &defaults) {
            Ok(p) => prepared.push(p),
            Err(e) => writer.error(&e)?,
        }
    }
    if !prepared.is_empty() {
        with_engine!(args.engine, &files, max_num_seqs, |engine| run_lines(engine, prepared, &files, &mut writer)?);
    }
    writer.bar.finish_and_clear();
    if writer.failed > 0 {
        eprintln!("kestrel batch: {} of the requests failed; their lines hold an `error` object", writer.failed);
    }
    Ok(())
}

/// Runs every prepared line to the end, writing each result as its request finishes.
fn run_lines<B: Backend>(mut engine: Engine<B>, lines: Vec<Prepared>, files: &ModelFiles, writer: &mut ResultWriter) -> Result<()> {
    let tok = &files.tokenizer;
    let mut by_engine_id = HashMap::new();
    for Prepared { line, id, request } in lines {
        match engine.add_request(request) {
            Ok(engine_id) => {
                by_engine_id.insert(engine_id, (line, id));
            }
            Err(err) => writer.error(&LineError { line, id, kind: "invalid_request", message: err.to_string() })?,
        }
    }
    while engine.has_unfinished() {
        for event in engine.step() {
            match event {
                RequestEvent::Tokens { .. } => {}
                RequestEvent::Finished { id, reason, output } => {
                    let Some((_, line_id)) = by_engine_id.remove(&id) else { continue };
                    let k = engine.reported_k(output.method);
                    writer.write(&json!({
                        "id": line_id,
                        "text": tok.decode(&output.generated, true)?,
                        "token_ids": output.generated,
                        "finish_reason": reason.as_str(),
                        "usage": {"prompt_tokens": output.prompt_tokens, "completion_tokens": output.generated.len(), "prompt_tokens_details": {"cached_tokens": output.cached_tokens}},
                        "spec": output.spec.to_json(output.method.name(), k),
                    }))?;
                }
                RequestEvent::Failed { id, error, .. } => {
                    let Some((line, line_id)) = by_engine_id.remove(&id) else { continue };
                    writer.error(&LineError { line, id: line_id, kind: "generation_failed", message: error.to_string() })?;
                }
            }
        }
    }
    Ok(())
}
