//! The `kestrel` command line.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kestrel", version, about = "Local LLM inference for hybrid Gated-DeltaNet models, with speculative decoding")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate from one prompt.
    Run(cli::run::RunArgs),
    /// Run a JSONL file of requests through the batch engine.
    Batch(cli::batch::BatchArgs),
    /// Latency, throughput and speculation gains of several methods side by side.
    Bench(cli::bench::BenchArgs),
    /// Perplexity of a text file.
    Perplexity(cli::perplexity::PerplexityArgs),
    /// Describe a model.
    Info(cli::info::InfoArgs),
    /// Chat in the terminal, with a live speculation panel.
    Chat(cli::chat::ChatArgs),
    /// Serve an OpenAI-compatible API (completions, chat completions, SSE streaming).
    Serve(cli::serve::ServeArgs),
    /// Text to token ids with a model's tokenizer (a vocab-only GGUF is enough).
    Tokenize(cli::tokenize::TokenizeArgs),
    /// Token ids back to text.
    Detokenize(cli::tokenize::DetokenizeArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse_from(cli::flags::expand_short_aliases(std::env::args_os()));
    match cli.command {
        Command::Run(a) => cli::run::run(a),
        Command::Batch(a) => cli::batch::run(a),
        Command::Bench(a) => cli::bench::run(a),
        Command::Perplexity(a) => cli::perplexity::run(a),
        Command::Info(a) => cli::info::run(a),
        Command::Chat(a) => cli::chat::run(a),
        Command::Serve(a) => cli::serve::run(a),
        Command::Tokenize(a) => cli::tokenize::tokenize(a),
        Command::Detokenize(a) => cli::tokenize::detokenize(a),
    }
}
