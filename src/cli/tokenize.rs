//! `kestrel tokenize` and `kestrel detokenize`: text to token ids and back with a model's
//! tokenizer (llama-tokenize's job). Only the tokenizer is read, so a vocab-only GGUF will do.

use anyhow::{bail, Context, Result};
use clap::Args;
use kestrel::model::open_tokenizer;
use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// The text (read from standard input when omitted, exactly as given).
    pub text: Option<String>,
    /// Hugging Face model directory or GGUF file (default: the embedded kestrel-coder model).
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// Print `{"ids": [...]}` instead of ids separated by spaces.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DetokenizeArgs {
    /// Token ids (read from standard input, separated by spaces or commas, when omitted).
    pub ids: Vec<String>,
    /// Hugging Face model directory or GGUF file (default: the embedded kestrel-coder model).
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
}

fn read_stdin(what: &str) -> Result<String> {
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        eprintln!("reading {what} from standard input; end it with Ctrl-D");
    }
    let mut text = String::new();
    stdin.lock().read_to_string(&mut text).with_context(|| format!("cannot read {what} from standard input"))?;
    Ok(text)
}

fn load(model: &Option<PathBuf>) -> Result<kestrel::tokenizer::Tokenizer> {
    open_tokenizer(model.as_deref()).with_context(|| match model {
        Some(p) => format!("cannot load the tokenizer of {}", p.display()),
        None => "cannot load the embedded model's tokenizer".to_string(),
    })
}

pub fn tokenize(args: TokenizeArgs) -> Result<()> {
    let tokenizer = load(&args.model)?;
    let text = match args.text {
        Some(text) => text,
        None => read_stdin("the text")?,
    };
    let ids = tokenizer.encode(&text, false).context("cannot tokenize the text")?;
    let line = if args.json { serde_json::json!({ "ids": ids }).to_string() } else { ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ") };
    writeln!(std::io::stdout(), "{line}").context("cannot write to standard output")
}

pub fn detokenize(args: DetokenizeArgs) -> Result<()> {
    let tokenizer = load(&args.model)?;
    let words = if args.ids.is_empty() { vec![read_stdin("the token ids")?] } else { args.ids };
    let mut ids = Vec::new();
    for word in words.iter().flat_map(|w| w.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']')).filter(|w| !w.is_empty()) {
        match word.parse::<u32>() {
            Ok(id) => ids.push(id),
            Err(_) => bail!("`{word}` is not a token id (ids are non-negative integers)"),
        }
    }
    let text = tokenizer.decode(&ids, false).context("cannot detokenize")?;
    let mut stdout = std::io::stdout();
    stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()).context("cannot write to standard output")
}
