//! `kestrel run`: one prompt, streamed to stdout (or one JSON object with `--json`); statistics
//! go to stderr so that stdout carries exactly the generated text.

use super::flags::{GenerationConfigArgs, SamplingArgs};
use super::{with_engine, EngineArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use kestrel::backend::Backend;
use kestrel::engine::request::{FinishReason, Request, RequestEvent, SpecMethod};
use kestrel::engine::Engine;
use kestrel::model::ModelFiles;
use kestrel::tokenizer::stop_strings::StopStringMatcher;
use kestrel::tokenizer::ChatMessage;
use std::io::{ErrorKind, IsTerminal, Read, Write};
use std::path::PathBuf;
use std::time::Instant;

/// At most this many `--stop` strings, as in the OpenAI API.
const MAX_STOP_STRINGS: usize = 4;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The prompt (default: --file, else standard input).
    #[arg(conflicts_with = "file")]
    pub prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(short = 'f', long, value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Most tokens to generate; -1: until the context is full.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 128, allow_negative_numbers = true, value_name = "N")]
    pub max_tokens: i64,
    /// Stop before this text (it is not printed); up to 4 of them.
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub generation: GenerationConfigArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// Where the generated text goes: stdout, until a reader such as `head` closes it.
struct TextOut {
    stdout: std::io::StdoutLock<'static>,
    closed: bool,
    ends_with_newline: bool,
}

impl TextOut {
    fn write(&mut self, text: &str) -> Result<()> {
        if self.closed || text.is_empty() {
            return Ok(());
        }
        match self.stdout.write_all(text.as_bytes()).and_then(|()| self.stdout.flush()) {
            Ok(()) => {
                self.ends_with_newline = text.ends_with('\n');
                Ok(())
            }
            // The reader has all it wanted (`| head`): stop quietly, as other command-line tools do.
            Err(err) if err.kind() == ErrorKind::BrokenPipe => {
                self.closed = true;
                Ok(())
            }
            Err(err) => Err(err).context("cannot write to standard output"),
        }
    }
}

fn read_prompt(argument: Option<String>, file: Option<&PathBuf>) -> Result<String> {
    let prompt = match (argument, file) {
        (Some(p), _) => p,
        (None, Some(path)) => std::fs::read_to_string(path).with_context(|| format!("cannot read the prompt from {}", path.display()))?,
        (None, None) => {
            let stdin = std::io::stdin();
            if stdin.is_terminal() {
                eprintln!("reading the prompt from standard input; end it with Ctrl-D");
            }
            let mut s = String::new();
            stdin.lock().read_to_string(&mut s).context("cannot read the prompt from standard input")?;
            s
        }
    };
    if prompt.trim().is_empty() {
        bail!("empty prompt: pass it as an argument, with --file, or on standard input");
    }
    Ok(prompt)
}

pub fn run(args: RunArgs) -> Result<()> {
    if args.max_tokens == 0 || args.max_tokens < -1 {
        bail!("max_tokens must be at least 1 (or -1 for as many as the context holds), got {}", args.max_tokens);
    }
    if args.stop.len() > MAX_STOP_STRINGS {
        bail!("at most {MAX_STOP_STRINGS} --stop strings are allowed, got {}", args.stop.len());
    }
    let prompt = read_prompt(args.prompt, args.file.as_ref())?;
    let files = args.engine.open_model()?;
    let params = args.sampling.params(&args.generation.defaults(&files))?;
    let text = if args.chat {
        let messages = [ChatMessage::user(prompt)];
        files.tokenizer.apply_chat_template(&messages, true, None).context("cannot apply the chat template (--chat)")?
    } else {
        prompt
    };
    let prompt_ids = files.tokenizer.encode(&text, false).context("cannot tokenize the prompt")?;
    let max_tokens = match usize::try_from(args.max_tokens) {
        Ok(n) => n,
        // -1: whatever the context leaves (the engine refuses a prompt that leaves nothing).
        Err(_) => args.engine.context.max_model_len(&files)?.saturating_sub(prompt_ids.len()).max(1),
    };
    // A chat turn ends at the template's end-of-turn token as well as at end-of-sequence.
    let stop_token_ids = if args.chat { files.chat_stop_token_ids() } else { files.config.eos_token_ids.clone() };
    let request = Request { prompt_ids, params, max_tokens, stop_token_ids, spec: None };
    let output = Output { json: args.json, stops: args.stop };
    with_engine!(args.engine, &files, 1, |engine| generate(engine, request, &files, output))
}

/// How the result is written.
struct Output {
    json: bool,
    stops: Vec<String>,
}

/// Runs the request to the end on `engine`, streaming text (or printing one JSON object).
fn generate<B: Backend>(mut engine: Engine<B>, request: Request, files: &ModelFiles, output: Output) -> Result<()> {
    let json = output.json;
    let start = Instant::now();
    let id = engine.add_request(request)?;
    let mut decoder = files.tokenizer.stream_decoder(true);
    let mut stops = StopStringMatcher::new(output.stops);
    let mut out = TextOut { stdout: std::io::stdout().lock(), closed: false, ends_with_newline: false };
    let mut text = String::new();
    // Tokens that made the output: those after a stop string do not.
    let mut used = 0usize;
    let mut stopped_by_string = false;
    let (mut first_token_at, mut finished) = (None, None);
    while engine.has_unfinished() {
        if (out.closed && !json) || stopped_by_string {
            // Nobody reads the rest, or it would be cut: stop generating it.
            if let Ok(RequestEvent::Finished { reason, output, .. }) = engine.abort(id) {
                let reason = if stopped_by_string { FinishReason::Stop } else { reason };
                finished = Some((reason, output));
            }
            break;
        }
        for event in engine.step() {
            match event {
                RequestEvent::Tokens { tokens, .. } => {
                    first_token_at.get_or_insert_with(Instant::now);
                    for t in tokens {
                        if stopped_by_string {
                            break;
                        }
                        used += 1;
                        if let Some(delta) = decoder.push(t)? {
                            let scan = stops.push(&delta);
                            stopped_by_string = scan.stopped;
                            text.push_str(&scan.text);
                            if !json {
                                out.write(&scan.text)?;
                            }
                        }
                    }
                }
                RequestEvent::Finished { reason, output, .. } => finished = Some((reason, output)),
                RequestEvent::Failed { error, .. } => {
                    if !json && !out.ends_with_newline && !text.is_empty() {
                        out.write("\n")?;
                    }
                    bail!("generation failed: {error}");
                }
            }
        }
    }
    if !stopped_by_string {
        let rest = decoder.flush()?.unwrap_or_default();
        let scan = stops.push(&rest);
        let tail = if scan.stopped { scan.text } else { scan.text + &stops.finish() };
        stopped_by_string = scan.stopped;
        text.push_str(&tail);
        if !json {
            out.write(&tail)?;
        }
    }
    let end = Instant::now();
    let (reason, summary) = finished.context("the request did not finish")?;
    let reason = if stopped_by_string { FinishReason::Stop } else { reason };
    let generated = &summary.generated[..used.min(summary.generated.len())];
    let ttft_ms = first_token_at.map(|t| (t - start).as_secs_f64() * 1e3).unwrap_or(0.0);
    let n = generated.len();
    let decode_s = first_token_at.map(|t| (end - t).as_secs_f64()).unwrap_or(0.0);
    let decode_tps = if n > 1 && decode_s > 0.0 { (n - 1) as f64 / decode_s } else { 0.0 };
    let k = engine.reported_k(summary.method);
    let spec = summary.spec.to_json(summary.method.name(), k);
    if json {
        let obj = serde_json::json!({
            "text": text,
            "token_ids": generated,
            "finish_reason": reason.as_str(),
            "usage": {"prompt_tokens": summary.prompt_tokens, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": summary.cached_tokens}},
            "timing": {"ttft_ms": ttft_ms, "decode_tokens_per_s": decode_tps},
            "spec": spec,
        });
        out.write(&format!("{}\n", serde_json::to_string_pretty(&obj)?))?;
        return Ok(());
    }
    // On a terminal, end the line so the shell prompt starts on its own; a pipe gets the exact text.
    if std::io::stdout().is_terminal() && !out.ends_with_newline {
        out.write("\n")?;
    }
    let why = match reason {
        FinishReason::Length => " (max tokens)",
        FinishReason::Abort => " (output closed)",
        FinishReason::Stop if stopped_by_string => " (stop string)",
        FinishReason::Stop => "",
    };
    let spec_summary = if summary.method == SpecMethod::None {
        "no speculation".to_string()
    } else {
        format!(
            "{} k={k}: acceptance {:.1}%, mean acceptance length {:.2}",
            summary.method.name(),
            100.0 * summary.spec.acceptance_rate(),
            summary.spec.mean_acceptance_length()
        )
    };
    eprintln!("[{} prompt + {n} generated tokens{why}; TTFT {ttft_ms:.0} ms; {decode_tps:.1} tokens/s; {spec_summary}]", summary.prompt_tokens);
    Ok(())
}
