//! `kestrel run`: one prompt, streamed to stdout (or one JSON object with `--json`); statistics
//! go to stderr so that stdout carries exactly the generated text.

use super::{with_engine, EngineArgs, SamplingArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use kestrel::backend::Backend;
use kestrel::chat_format::reasoning::THINK_CLOSE;
use kestrel::chat_format::{prompt_opens_reasoning, ChatFormat, ReasoningPart, ReasoningSplitter};
use kestrel::engine::logits::grammar::{GrammarCompiler, GrammarSpec};
use kestrel::engine::logits::logprobs::MAX_TOP_LOGPROBS;
use kestrel::engine::logits::penalties::Penalties;
use kestrel::engine::logits::LogitsOptions;
use kestrel::engine::request::{FinishReason, Request, RequestEvent, SpecMethod};
use kestrel::engine::Engine;
use kestrel::model::ModelFiles;
use kestrel::tokenizer::ChatMessage;
use std::io::{ErrorKind, IsTerminal, Read, Write};
use std::path::PathBuf;
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
    /// With --chat and a thinking model, print its reasoning (dimmed on a terminal) before the
    /// answer; without this flag only the answer is printed.
    #[arg(long)]
    pub show_reasoning: bool,
    /// The output must be JSON valid for the JSON schema in FILE.
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    pub json_schema: Option<PathBuf>,
    /// The output must follow the grammar in FILE (llguidance's Lark syntax).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<PathBuf>,
    /// Report each generated token's log probability with N alternatives (in --json output).
    #[arg(long, value_name = "N", requires = "json")]
    pub logprobs: Option<usize>,
    /// Penalise tokens by whether they were generated already (OpenAI's presence_penalty, -2..2).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Penalise tokens by how often they were generated already (-2..2).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Divide the positive logits of tokens of the prompt or output by this (1 is off).
    #[arg(long, alias = "repetition-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
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

/// How the output is shown.
struct Output {
    json: bool,
    /// A thinking model's chat reply: split off the reasoning (`Some(opened_in_prompt)`).
    reasoning: Option<bool>,
    show_reasoning: bool,
}

pub fn run(args: RunArgs) -> Result<()> {
    let prompt = read_prompt(args.prompt.clone())?;
    let params = args.sampling.params();
    params.validate()?;
    if args.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        bail!("--logprobs takes at most {MAX_TOP_LOGPROBS} alternatives");
    }
    let penalties = Penalties { presence: args.presence_penalty, frequency: args.frequency_penalty, repetition: args.repeat_penalty };
    penalties.validate().map_err(anyhow::Error::msg)?;
    let grammar = grammar_spec(&args)?;
    let files = args.engine.open_model()?;
    let text = if args.chat {
        let messages = [ChatMessage::user(prompt)];
        files.tokenizer.apply_chat_template(&messages, true, None).context("cannot apply the chat template (--chat)")?
    } else {
        prompt
    };
    let format = ChatFormat::of(&files.tokenizer, false);
    let opened = args.chat && format.thinking && prompt_opens_reasoning(&text);
    let prompt_ids = files.tokenizer.encode(&text, false).context("cannot tokenize the prompt")?;
    // A chat turn ends at the template's end-of-turn token as well as at end-of-sequence.
    let stop_token_ids = if args.chat { files.chat_stop_token_ids() } else { files.config.eos_token_ids.clone() };
    let grammar = match grammar {
        None => None,
        Some((spec, flag)) => {
            let compiler = GrammarCompiler::new(&files.tokenizer, files.config.vocab_size, &files.chat_stop_token_ids()).context("cannot build the token table for grammars")?;
            let grammar = compiler.compile(&spec, &stop_token_ids).with_context(|| format!("{flag}: cannot compile"))?;
            // A thinking model reasons freely; its answer follows the grammar.
            Some(match compiler.single_token(THINK_CLOSE).filter(|_| opened) {
                Some(end_of_reasoning) => grammar.starting_after(end_of_reasoning),
                None => grammar,
            })
        }
    };
    let logits = LogitsOptions { penalties, logit_bias: Vec::new(), logprobs: args.logprobs, grammar };
    let request = Request { logits, ..Request::new(prompt_ids, params, args.max_tokens, stop_token_ids) };
    let output = Output { json: args.json, reasoning: (args.chat && format.thinking).then_some(opened), show_reasoning: args.show_reasoning };
    with_engine!(args.engine, &files, 1, |engine| generate(engine, request, &files, &output))
}

/// The grammar of `--json-schema` or `--grammar`, with the flag it came from.
fn grammar_spec(args: &RunArgs) -> Result<Option<(GrammarSpec, &'static str)>> {
    if let Some(path) = &args.json_schema {
        let text = std::fs::read_to_string(path).with_context(|| format!("--json-schema: cannot read {}", path.display()))?;
        let schema = serde_json::from_str(&text).with_context(|| format!("--json-schema: {} is not JSON", path.display()))?;
        return Ok(Some((GrammarSpec::JsonSchema(schema), "--json-schema")));
    }
    if let Some(path) = &args.grammar {
        let text = std::fs::read_to_string(path).with_context(|| format!("--grammar: cannot read {}", path.display()))?;
        return Ok(Some((GrammarSpec::Lark(text), "--grammar")));
    }
    Ok(None)
}

/// Prints a chat reply's pieces: the answer, and the reasoning only when asked (dimmed on a
/// terminal, a blank line before the answer).
fn print_parts(out: &mut TextOut, parts: Vec<ReasoningPart>, show_reasoning: bool, reasoning_shown: &mut bool) -> Result<()> {
    let terminal = std::io::stdout().is_terminal();
    for part in parts {
        match part {
            ReasoningPart::Reasoning(text) if show_reasoning => {
                *reasoning_shown = true;
                out.write(&if terminal { format!("\x1b[2m{text}\x1b[0m") } else { text })?;
            }
            ReasoningPart::Reasoning(_) => {}
            ReasoningPart::Content(text) => {
                if std::mem::take(reasoning_shown) {
                    out.write("\n\n")?;
                }
                out.write(&text)?;
            }
        }
    }
    Ok(())
}

/// Runs the request to the end on `engine`, streaming text (or printing one JSON object).
fn generate<B: Backend>(mut engine: Engine<B>, request: Request, files: &ModelFiles, output_kind: &Output) -> Result<()> {
    let json = output_kind.json;
    let mut splitter = output_kind.reasoning.map(ReasoningSplitter::new);
    let mut reasoning_shown = false;
    let start = Instant::now();
    let request_logprobs = request.logits.logprobs.is_some();
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
                            if json {
                                continue;
                            }
                            match splitter.as_mut() {
                                Some(splitter) => print_parts(&mut out, splitter.push(&delta), output_kind.show_reasoning, &mut reasoning_shown)?,
                                None => out.write(&delta)?,
                            }
                        }
                    }
                }
                RequestEvent::Finished { reason, output, .. } => finished = Some((reason, output)),
            }
        }
    }
    if !json {
        let rest = decoder.flush()?.unwrap_or_default();
        match splitter.as_mut() {
            Some(splitter) => {
                let mut parts = splitter.push(&rest);
                parts.extend(splitter.finish());
                print_parts(&mut out, parts, output_kind.show_reasoning, &mut reasoning_shown)?;
            }
            None => out.write(&rest)?,
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
        let mut obj = serde_json::json!({
            "text": text,
            "token_ids": output.generated,
            "finish_reason": reason.as_str(),
            "usage": {"prompt_tokens": output.prompt_tokens, "completion_tokens": n},
            "timing": {"ttft_ms": ttft_ms, "decode_tokens_per_s": decode_tps},
            "spec": spec,
        });
        if let Some(opened) = output_kind.reasoning {
            let mut splitter = ReasoningSplitter::new(opened);
            let mut parts = splitter.push(&text);
            parts.extend(splitter.finish());
            let side = |reasoning: bool| -> String {
                parts.iter().filter_map(|p| match (p, reasoning) {
                    (ReasoningPart::Reasoning(t), true) | (ReasoningPart::Content(t), false) => Some(t.as_str()),
                    _ => None,
                }).collect()
            };
            obj["reasoning"] = serde_json::Value::String(side(true));
            obj["content"] = serde_json::Value::String(side(false));
        }
        if request_logprobs {
            let entries: Vec<serde_json::Value> = output
                .logprobs
                .iter()
                .map(|entry| {
                    let top: Vec<serde_json::Value> = entry.top.iter().map(|&(token, logprob)| serde_json::json!({"token_id": token, "logprob": logprob})).collect();
                    serde_json::json!({"token_id": entry.token, "logprob": entry.logprob, "top_logprobs": top})
                })
                .collect();
            obj["logprobs"] = serde_json::Value::Array(entries);
        }
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
