//! `kestrel run`: one prompt, streamed to stdout (or one JSON object with `--json`); statistics
//! go to stderr so that stdout carries exactly the generated text.

use super::flags::{GenerationConfigArgs, SamplingArgs};
use super::{with_engine, EngineArgs};
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
    if args.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        bail!("--logprobs takes at most {MAX_TOP_LOGPROBS} alternatives");
    }
    let penalties = Penalties { presence: args.presence_penalty, frequency: args.frequency_penalty, repetition: args.repeat_penalty };
    penalties.validate().map_err(anyhow::Error::msg)?;
    let grammar = grammar_spec(&args)?;
    let prompt = read_prompt(args.prompt.clone(), args.file.as_ref())?;
    let files = args.engine.open_model()?;
    let params = args.sampling.params(&args.generation.interactive_defaults(&files))?;
    let text = if args.chat {
        let messages = [ChatMessage::user(prompt)];
        files.tokenizer.apply_chat_template(&messages, true, None).context("cannot apply the chat template (--chat)")?
    } else {
        prompt
    };
    let format = ChatFormat::of(&files.tokenizer, false);
    let opened = args.chat && format.thinking && prompt_opens_reasoning(&text);
    let prompt_ids = files.tokenizer.encode(&text, false).context("cannot tokenize the prompt")?;
    let max_tokens = match usize::try_from(args.max_tokens) {
        Ok(n) => n,
        // -1: whatever the context leaves (the engine refuses a prompt that leaves nothing).
        Err(_) => args.engine.context.max_model_len(&files)?.saturating_sub(prompt_ids.len()).max(1),
    };
    // A chat turn ends at the template's end-of-turn token as well as at end-of-sequence.
    let stop_token_ids = if args.chat { files.chat_stop_token_ids() } else { files.config.eos_token_ids.clone() };
    let grammar = match grammar {
        None => None,
        Some((spec, flag)) => {
            let compiler = GrammarCompiler::new(&files.tokenizer, files.config.vocab_size, &files.chat_stop_token_ids()).with_context(|| format!("{flag} needs the model's vocabulary"))?;
            let grammar = compiler.compile(&spec, &stop_token_ids).with_context(|| format!("{flag}: cannot compile"))?;
            // A thinking model reasons freely; its answer follows the grammar.
            Some(match compiler.single_token(THINK_CLOSE).filter(|_| opened) {
                Some(end_of_reasoning) => grammar.starting_after(end_of_reasoning),
                None => grammar,
            })
        }
    };
    let logits = LogitsOptions { penalties, logit_bias: Vec::new(), logprobs: args.logprobs, grammar };
    let request = Request { logits, ..Request::new(prompt_ids, params, max_tokens, stop_token_ids) };
    let output = Output { json: args.json, stops: args.stop, reasoning: (args.chat && format.thinking).then_some(opened), show_reasoning: args.show_reasoning };
    with_engine!(args.engine, &files, 1, |engine| generate(engine, request, &files, output))
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

/// How the result is written.
struct Output {
    json: bool,
    stops: Vec<String>,
    /// A thinking model's chat reply: split off the reasoning (`Some(opened_in_prompt)`).
    reasoning: Option<bool>,
    show_reasoning: bool,
}

/// A chat reply's text, split: the reasoning and the answer.
struct SplitText {
    splitter: Option<ReasoningSplitter>,
    reasoning: String,
    answer: String,
    /// Reasoning was printed: a blank line goes before the answer.
    reasoning_printed: bool,
}

impl SplitText {
    /// Adds text; returns what to print (the answer, and the reasoning when shown).
    fn push(&mut self, text: &str, show_reasoning: bool, finish: bool) -> String {
        let Some(splitter) = self.splitter.as_mut() else {
            self.answer.push_str(text);
            return text.to_string();
        };
        let mut parts = splitter.push(text);
        if finish {
            parts.extend(splitter.finish());
        }
        let terminal = std::io::stdout().is_terminal();
        let mut printed = String::new();
        for part in parts {
            match part {
                ReasoningPart::Reasoning(t) => {
                    self.reasoning.push_str(&t);
                    if show_reasoning {
                        self.reasoning_printed = true;
                        printed.push_str(&if terminal { format!("\x1b[2m{t}\x1b[0m") } else { t });
                    }
                }
                ReasoningPart::Content(t) => {
                    if std::mem::take(&mut self.reasoning_printed) {
                        printed.push_str("\n\n");
                    }
                    self.answer.push_str(&t);
                    printed.push_str(&t);
                }
            }
        }
        printed
    }
}

/// Runs the request to the end on `engine`, streaming text (or printing one JSON object).
fn generate<B: Backend>(mut engine: Engine<B>, request: Request, files: &ModelFiles, output: Output) -> Result<()> {
    let json = output.json;
    let start = Instant::now();
    let request_logprobs = request.logits.logprobs.is_some();
    let params = request.params.clone();
    let mut split = SplitText { splitter: output.reasoning.map(ReasoningSplitter::new), reasoning: String::new(), answer: String::new(), reasoning_printed: false };
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
                            let printed = split.push(&scan.text, output.show_reasoning, false);
                            if !json {
                                out.write(&printed)?;
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
    let mut tail = String::new();
    if !stopped_by_string {
        let rest = decoder.flush()?.unwrap_or_default();
        let scan = stops.push(&rest);
        tail = if scan.stopped { scan.text } else { scan.text + &stops.finish() };
        stopped_by_string = scan.stopped;
        text.push_str(&tail);
    }
    let printed = split.push(&tail, output.show_reasoning, true);
    if !json {
        out.write(&printed)?;
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
        let mut obj = serde_json::json!({
            "text": text,
            "token_ids": generated,
            "finish_reason": reason.as_str(),
            "usage": {"prompt_tokens": summary.prompt_tokens, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": summary.cached_tokens}},
            "timing": {"ttft_ms": ttft_ms, "decode_tokens_per_s": decode_tps},
            "spec": spec,
            "sampling": {"temperature": shortest(params.temperature), "top_k": params.top_k, "top_p": shortest(params.top_p), "min_p": shortest(params.min_p), "seed": params.seed},
        });
        if output.reasoning.is_some() {
            obj["reasoning"] = serde_json::Value::String(split.reasoning);
            obj["content"] = serde_json::Value::String(split.answer);
        }
        if request_logprobs {
            let entries: Vec<serde_json::Value> = summary
                .logprobs
                .iter()
                .take(n)
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

/// An f32 flag value as the f64 its shortest decimal form names (0.8, not 0.800000011920929).
fn shortest(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}
