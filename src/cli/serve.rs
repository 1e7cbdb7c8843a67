//! `kestrel serve`: the local OpenAI-compatible server.
//!
//! Everything that can be refused without the model (the flags, the listening address) is
//! checked before the model loads, so a busy port or an empty API key fails in a second rather
//! than after minutes of loading weights.

use super::flags::{ConcurrencyArgs, GenerationConfigArgs};
use super::EngineArgs;
use anyhow::{bail, Context, Result};
use clap::Args;
use kestrel::server::error::BodyLimit;
use kestrel::server::{self, ServerState, DEFAULT_BODY_LIMIT};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The model to serve (the same as --model).
    #[arg(value_name = "MODEL", conflicts_with = "model")]
    pub model_path: Option<PathBuf>,
    /// Host name or address to listen on. Only loopback is reachable by default; anything else
    /// exposes the model to the network (set --api-key then).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* and /metrics (also read from KESTREL_API_KEY).
    #[arg(long, env = "KESTREL_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model id clients name in requests (default: the model directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Largest accepted request body, in bytes.
    #[arg(long, default_value_t = DEFAULT_BODY_LIMIT)]
    pub max_request_bytes: usize,
    /// Origins browsers may call the API from (CORS), comma-separated, or `*` for any; none by
    /// default.
    #[arg(long, value_delimiter = ',', value_name = "ORIGINS")]
    pub allowed_origins: Vec<String>,
    #[command(flatten)]
    pub concurrency: ConcurrencyArgs,
    #[command(flatten)]
    pub generation: GenerationConfigArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

impl ServeArgs {
    /// Refuses flag values that cannot work, before anything is loaded.
    fn check(&self) -> Result<()> {
        if self.api_key.as_deref().is_some_and(|key| key.trim().is_empty()) {
            bail!("--api-key is empty: give a key, or leave the flag out to serve without one");
        }
        if self.max_request_bytes == 0 {
            bail!("--max-request-bytes must be at least 1");
        }
        server::cors::layer(&self.allowed_origins).context("--allowed-origins")?;
        self.concurrency.check()?;
        self.engine.check()
    }
}

pub fn run(mut args: ServeArgs) -> Result<()> {
    if let Some(path) = args.model_path.take() {
        args.engine.model.model = Some(path);
    }
    args.check()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("kestrel-http").build().context("cannot start the async runtime")?;
    let listener = runtime.block_on(bind(&args.host, args.port))?;
    let bound = listener.local_addr().context("cannot read the bound address")?;

    let files = Arc::new(args.engine.open_model()?);
    let model_name = args.served_model_name.clone().unwrap_or_else(|| args.engine.model.display_name());
    let sampling_defaults = args.generation.defaults(&files);
    let worker = args.engine.spawn_worker(files.clone(), args.concurrency.max_num_seqs)?;

    let mut state = ServerState::new(worker.handle(), files, &model_name, args.api_key.as_deref());
    state.body_limit = BodyLimit(args.max_request_bytes);
    state.sampling_defaults = sampling_defaults;
    state.allowed_origins = args.allowed_origins.clone();
    runtime.block_on(async {
        if !bound.ip().is_loopback() && args.api_key.is_none() {
            eprintln!("warning: listening on {bound} without --api-key: anyone who can reach this address can use the model");
        }
        // Tests and scripts read this line to learn the port.
        eprintln!("kestrel serve: model `{model_name}` listening on http://{bound} (OpenAI base URL http://{bound}/v1)");
        let shutdown = async {
            shutdown_signal().await;
            eprintln!("kestrel serve: finishing the requests in flight (Ctrl-C again stops at once)");
            tokio::spawn(async {
                shutdown_signal().await;
                eprintln!("kestrel serve: stopped");
                std::process::exit(130);
            });
        };
        server::serve(listener, state, shutdown).await.context("the server stopped with an error")
    })?;
    eprintln!("kestrel serve: shutting down");
    worker.shutdown();
    Ok(())
}

/// Listens on the first address `host` resolves to that accepts the port (`localhost` is
/// loopback, as anywhere else).
async fn bind(host: &str, port: u16) -> Result<tokio::net::TcpListener> {
    let addresses: Vec<_> = tokio::net::lookup_host((host, port)).await.with_context(|| format!("--host {host}: cannot resolve the name to an address"))?.collect();
    let mut last_error = None;
    for address in &addresses {
        match tokio::net::TcpListener::bind(address).await {
            Ok(listener) => return Ok(listener),
            Err(err) => last_error = Some((address, err)),
        }
    }
    match last_error {
        Some((address, err)) if err.kind() == std::io::ErrorKind::AddrInUse => {
            bail!("cannot listen on {address}: the port is in use (another server?); pick another with --port, or 0 for any free one")
        }
        Some((address, err)) => Err(err).with_context(|| format!("cannot listen on {address}")),
        None => bail!("--host {host} resolves to no address"),
    }
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}
