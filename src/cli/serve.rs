//! `kestrel serve`: the local OpenAI-compatible server.

use super::EngineArgs;
use anyhow::{Context, Result};
use clap::Args;
use kestrel::server::error::BodyLimit;
use kestrel::server::{self, ServerState, DEFAULT_BODY_LIMIT};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on. Only loopback is reachable by default; anything else exposes the
    /// model to the network (set --api-key then).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0 picks a free one; the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* and /metrics (also read from KESTREL_API_KEY).
    #[arg(long, env = "KESTREL_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model id clients name in requests (default: the model directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Most requests decoded together in one batch; more wait in the queue.
    #[arg(long, default_value_t = 16)]
    pub max_num_seqs: usize,
    /// Largest accepted request body, in bytes.
    #[arg(long, default_value_t = DEFAULT_BODY_LIMIT)]
    pub max_request_bytes: usize,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let files = Arc::new(args.engine.open_model()?);
    let model_name = args.served_model_name.clone().unwrap_or_else(|| default_model_name(&args.engine));
    let worker = args.engine.spawn_worker(files.clone(), args.max_num_seqs.max(1))?;

    let mut state = ServerState::new(worker.handle(), files, &model_name, args.api_key.as_deref());
    state.body_limit = BodyLimit(args.max_request_bytes);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("kestrel-http").build().context("cannot start the async runtime")?;
    runtime.block_on(async {
        let address = SocketAddr::new(args.host, args.port);
        let listener = tokio::net::TcpListener::bind(address).await.with_context(|| format!("cannot listen on {address}"))?;
        let bound = listener.local_addr().context("cannot read the bound address")?;
        if !args.host.is_loopback() && args.api_key.is_none() {
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

/// The model id: the directory name of `--model`, or the embedded model's name.
fn default_model_name(engine: &EngineArgs) -> String {
    engine.model.as_deref().and_then(|path| path.file_name()).map(|name| name.to_string_lossy().into_owned()).unwrap_or_else(|| kestrel::model::default_model::NAME.to_string())
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
