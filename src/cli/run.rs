//! `kestrel run`: one prompt, streamed to stdout (or one JSON object with `--json`); statistics
//! go to stderr so that stdout carries exactly the generated text.

use super::{with_engine, EngineArgs, SamplingArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use kestrel::backend::Backend;
use kestrel::engine::request::{FinishReason, Request, RequestEvent, SpecMethod};
use kestrel::engine::Engine;
use kestrel::model::ModelFiles;
use kestrel::tokenizer::ChatMessage;
use std::io::{ErrorKind, IsTerminal, Read, Write};
use std::time::Instant;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The prompt (read from standard input when omitted).
    pub prompt: Option<String>,
    /// Maximum tokens to generate.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 128)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
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

fn read_prompt(argument: Option<String>) -> Result<String> {
    let prompt = match argument {
        Some(p) => p,
        None => {
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
        bail!("empty prompt: pass it as an argument or on standard input");
    }
    Ok(prompt)
}

pub fn run(args: RunArgs) -> Result<()> {
    let prompt = read_prompt(args.prompt)?;
    let params = args.sampling.params();
    params.validate()?;
    let files = args.engine.open_model()?;
    let text = if args.chat {
        let messages = [ChatMessage::user(prompt)];
        files.tokenizer.apply_chat_template(&messages, true, None).context("cannot apply the chat template (--chat)")?
    } else {
        prompt
    };
    let prompt_ids = files.tokenizer.encode(&text, false).context("cannot tokenize the prompt")?;
    // A chat turn ends at the template's end-of-turn token as well as at end-of-sequence.
    let stop_token_ids = if args.chat { files.chat_stop_token_ids() } else { files.config.eos_token_ids.clone() };
    let request = Request::new(prompt_ids, params, args.max_tokens, stop_token_ids);
    with_engine!(args.engine, &files, 1, |engine| generate(engine, request, &files, args.json))
}

/// Runs the request to the end on `engine`, streaming text (or printing one JSON object).
fn generate<B: Backend>(mut engine: Engine<B>, request: Request, files: &ModelFiles, json: bool) -> Result<()> {
    let start = Instant::now();
    let id = engine.add_request(request)?;
    let mut decoder = files.tokenizer.stream_decoder(true);
    let mut out = TextOut { stdout: std::io::stdout().lock(), closed: false, ends_with_newline: false };
    let (mut first_token_at, mut finished) = (None, None);
    while engine.has_unfinished() {
        if out.closed && !json {
            // Nobody reads the rest: stop generating it.
            if let Ok(RequestEvent::Finished { reason, output, .. }) = engine.abort(id) {
                finished = Some((reason, output));
            }
            break;
        }
        for event in engine.step() {
            match event {
                RequestEvent::Tokens { tokens, .. } => {
                    first_token_at.get_or_insert_with(Instant::now);
                    for t in tokens {
                        if let Some(delta) = decoder.push(t)? {
                            if !json {
                                out.write(&delta)?;
                            }
                        }
                    }
                }
                RequestEvent::Finished { reason, output, .. } => finished = Some((reason, output)),
            }
        }
    }
    if let Some(rest) = decoder.flush()? {
        if !json {
            out.write(&rest)?;
        }
    }
    let end = Instant::now();
    let (reason, output) = finished.context("the request did not finish")?;
    let ttft_ms = first_token_at.map(|t| (t - start).as_secs_f64() * 1e3).unwrap_or(0.0);
    let n = output.generated.len();
    let decode_s = first_token_at.map(|t| (end - t).as_secs_f64()).unwrap_or(0.0);
    let decode_tps = if n > 1 && decode_s > 0.0 { (n - 1) as f64 / decode_s } else { 0.0 };
    let k = engine.reported_k(output.method);
    let spec = output.spec.to_json(output.method.name(), k);
    if json {
        let text = files.tokenizer.decode(&output.generated, true)?;
        let obj = serde_json::json!({
            "text": text,
            "token_ids": output.generated,
            "finish_reason": reason.as_str(),
            "usage": {"prompt_tokens": output.prompt_tokens, "completion_tokens": n},
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
        FinishReason::Stop => "",
    };
    let spec_summary = if output.method == SpecMethod::None {
        "no speculation".to_string()
    } else {
        format!(
            "{} k={k}: acceptance {:.1}%, mean acceptance length {:.2}",
            output.method.name(),
            100.0 * output.spec.acceptance_rate(),
            output.spec.mean_acceptance_length()
        )
    };
    eprintln!("[{} prompt + {n} generated tokens{why}; TTFT {ttft_ms:.0} ms; {decode_tps:.1} tokens/s; {spec_summary}]", output.prompt_tokens);
    Ok(())
}
