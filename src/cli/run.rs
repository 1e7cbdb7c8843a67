//! `kestrel run`: one prompt, streamed to stdout (or one JSON object with `--json`).

use super::{EngineArgs, SamplingArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use kestrel::engine::request::{FinishReason, Request, RequestEvent};
use kestrel::tokenizer::ChatMessage;
use std::io::{Read, Write};
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

pub fn run(args: RunArgs) -> Result<()> {
    let prompt = match args.prompt {
        Some(p) => p,
        None => {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s).context("cannot read the prompt from standard input")?;
            s
        }
    };
    if prompt.is_empty() {
        bail!("empty prompt: pass it as an argument or on standard input");
    }
    let files = args.engine.open_model()?;
    let text = if args.chat {
        let messages = [ChatMessage { role: "user".into(), content: prompt.clone(), tool_calls: None, name: None }];
        files.tokenizer.apply_chat_template(&messages, true, None).context("cannot apply the chat template")?
    } else {
        prompt
    };
    let prompt_ids = files.tokenizer.encode(&text, false).context("cannot tokenize the prompt")?;
    let mut engine = args.engine.build_engine(&files, 1)?;
    let request = Request { prompt_ids, params: args.sampling.params(), max_tokens: args.max_tokens, stop_token_ids: files.config.eos_token_ids.clone(), spec: None };

    let start = Instant::now();
    engine.add_request(request)?;
    let mut decoder = files.tokenizer.stream_decoder(true);
    let mut stdout = std::io::stdout().lock();
    let (mut first_token_at, mut finished) = (None, None);
    while engine.has_unfinished() {
        for event in engine.step() {
            match event {
                RequestEvent::Tokens { tokens, .. } => {
                    first_token_at.get_or_insert_with(Instant::now);
                    for t in tokens {
                        if let Some(delta) = decoder.push(t)? {
                            if !args.json {
                                stdout.write_all(delta.as_bytes())?;
                                stdout.flush()?;
                            }
                        }
                    }
                }
                RequestEvent::Finished { reason, output, .. } => finished = Some((reason, output)),
            }
        }
    }
    let end = Instant::now();
    let (reason, output) = finished.context("the request did not finish")?;
    let ttft_ms = first_token_at.map(|t| (t - start).as_secs_f64() * 1e3).unwrap_or(0.0);
    let n = output.generated.len();
    let decode_s = first_token_at.map(|t| (end - t).as_secs_f64()).unwrap_or(0.0);
    let decode_tps = if n > 1 && decode_s > 0.0 { (n - 1) as f64 / decode_s } else { 0.0 };
    let spec = output.spec.to_json(output.method.name(), if output.method == kestrel::engine::request::SpecMethod::None { 0 } else { engine.config.spec_tokens });
    if args.json {
        let text = files.tokenizer.decode(&output.generated, true)?;
        let obj = serde_json::json!({
            "text": text,
            "token_ids": output.generated,
            "finish_reason": reason.as_str(),
            "usage": {"prompt_tokens": output.prompt_tokens, "completion_tokens": n},
            "timing": {"ttft_ms": ttft_ms, "decode_tokens_per_s": decode_tps},
            "spec": spec,
        });
        writeln!(stdout, "{}", serde_json::to_string_pretty(&obj)?)?;
    } else {
        writeln!(stdout)?;
        let why = if reason == FinishReason::Length { " (max tokens)" } else { "" };
        eprintln!(
            "[{} prompt + {n} generated tokens{why}; ttft {ttft_ms:.0} ms; {decode_tps:.1} tok/s; spec {} acceptance {:.2}, mean length {:.2}]",
            output.prompt_tokens,
            output.method.name(),
            output.spec.acceptance_rate(),
            output.spec.mean_acceptance_length()
        );
    }
    Ok(())
}
