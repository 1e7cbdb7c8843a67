//! `kestrel chat`: the terminal chat with a live speculation panel.

use super::flags::{GenerationConfigArgs, SamplingArgs};
use super::EngineArgs;
use anyhow::{bail, Result};
use clap::Args;
use kestrel::tui::{self, App, ChatOptions};
use std::io::IsTerminal;
use std::sync::Arc;

#[derive(Debug, Args)]
pub struct ChatArgs {
    /// Most tokens per reply.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 512, value_name = "N")]
    pub max_tokens: usize,
    /// A system message put before the conversation.
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub generation: GenerationConfigArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn run(args: ChatArgs) -> Result<()> {
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        bail!("kestrel chat needs a terminal; for one prompt from a pipe use `kestrel run --chat`");
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let spec = args.engine.spec.single()?;
    let files = Arc::new(args.engine.open_model()?);
    if !files.tokenizer.has_chat_template() {
        bail!("{} has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja); use `kestrel run` for plain completion", files.source);
    }
    let params = args.sampling.params(&args.generation.interactive_defaults(&files))?;
    let model_name = args.engine.model.display_name();
    eprintln!("loading {} ...", files.source);
    let worker = args.engine.spawn_worker(files.clone(), 1)?;
    let options = ChatOptions { model_name, max_tokens: args.max_tokens, sampling: params, spec, system_prompt: args.system };
    let result = tui::run(App::new(worker.handle(), files, options));
    worker.shutdown();
    Ok(result?)
}
