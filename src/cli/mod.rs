//! Command-line front end: one file per subcommand; the flag groups they share are in flags.rs,
//! and building an engine from them is here.

pub mod batch;
pub mod bench;
mod bench_multiturn;
mod bench_plot;
pub mod chat;
pub mod flags;
pub mod info;
mod kv_plan;
pub mod perplexity;
pub mod run;
pub mod serve;
pub mod tokenize;

use anyhow::{bail, Context, Result};
use clap::Args;
use flags::{ContextArgs, DeviceArgs, ModelArgs, SelectedBackend, SpecArgs};
use kestrel::backend::{Backend, CacheSpec};
use kestrel::engine::request::SpecMethod;
use kestrel::engine::worker::EngineWorker;
use kestrel::engine::padding::Scratch;
use kestrel::engine::{Engine, EngineConfig};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::{dummy, ModelFiles};
use std::sync::Arc;

/// Tokens per KV block.
const BLOCK_SIZE: usize = 16;

/// Memory of the prefix cache's checkpoints unless `--prefix-cache-memory` says otherwise (on a
/// GPU at most an eighth of what the caches may take).
const DEFAULT_PREFIX_CACHE_MEMORY: usize = 2 << 30;

/// Binds `$engine` to an engine on the backend `--device` selects and evaluates `$body` with
/// it (the body is compiled once per backend type).
macro_rules! with_engine {
    ($args:expr, $files:expr, $max_num_seqs:expr, |$engine:ident| $body:expr) => {
        match $args.device.select_backend()? {
            $crate::cli::flags::SelectedBackend::Cpu(b) => {
                let $engine = $args.build_engine_on(b, $files, $max_num_seqs)?;
                $body
            }
            $crate::cli::flags::SelectedBackend::Cuda(b) => {
                let $engine = $args.build_engine_on(*b, $files, $max_num_seqs)?;
                $body
            }
        }
    };
}
pub(crate) use with_engine;

/// Everything that builds an engine: the model, the device, speculation, and the context and
/// memory of the KV cache.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub context: ContextArgs,
}

/// A progress bar on stderr, hidden when stderr is not a terminal.
pub fn progress_bar(len: u64, message: &str) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}").expect("static template").progress_chars("=> "));
    bar.set_message(message.to_string());
    bar
}

/// Starts an engine, capturing its CUDA graphs with a progress bar and saying what they took.
pub fn start_engine<B: Backend>(backend: B, model: Qwen35<B>, config: EngineConfig) -> Result<Engine<B>> {
    let bar = progress_bar(0, "capturing CUDA graphs");
    let engine = Engine::with_progress(backend, model, config, &bar).context("cannot start the engine")?;
    bar.finish_and_clear();
    if let Some(line) = capture_summary(&engine) {
        eprintln!("kestrel: {line}");
    }
    Ok(engine)
}

/// "captured 54 CUDA graphs (27 of the MTP drafter; capture sizes 1,2,4,8) in 1.9 s, 412 MiB",
/// where there are graphs.
pub fn capture_summary<B: Backend>(engine: &Engine<B>) -> Option<String> {
    let r = engine.graph_capture.as_ref()?;
    let memory = r.bytes.map(|b| format!(", {} MiB", b >> 20)).unwrap_or_default();
    let drafter = if r.drafter_graphs > 0 { format!("{} of the MTP drafter; ", r.drafter_graphs) } else { String::new() };
    Some(format!("captured {} CUDA graphs ({drafter}capture sizes {}) in {:.1} s{memory}", r.graphs, engine.capture_sizes(), r.time.as_secs_f64()))
}

/// Uploads the weights to `backend` (random ones with `--load-format dummy`). On a GPU, a model
/// that cannot fit under `--gpu-memory-utilization` with `activation_bytes` of activations is
/// refused before anything is uploaded.
pub fn load_model<B: Backend>(model: &ModelArgs, device: &DeviceArgs, backend: &B, files: &ModelFiles, activation_bytes: usize) -> Result<Qwen35<B>> {
    // The bytes the GPU keeps: quantized weights in their own bits (after --quantization).
    let weights = files.store.device_bytes(files.config.online_quantization.map(|q| (q, files.config.num_layers())));
    if let Some(budget) = backend.cache_memory_budget(device.gpu_memory_utilization, weights + activation_bytes) {
        budget.with_context(|| format!("{} ({:.2} GiB of weights) does not fit on the GPU", files.source, weights as f64 / (1u64 << 30) as f64))?;
    }
    let bar = progress_bar(0, "loading");
    let started = std::time::Instant::now();
    let loaded = if model.is_dummy() {
        dummy::load_from_dummy_store(backend, files.config.clone(), &files.store, model.dummy_seed(), &bar)?
    } else {
        Qwen35::load(backend, files.config.clone(), &files.store, &bar).with_context(|| format!("cannot load weights of {}", files.source))?
    };
    bar.finish_and_clear();
    let on_gpu = if backend.cache_memory_budget(1.0, 0).is_some() { format!(", {:.2} GiB on the GPU", weights as f64 / (1u64 << 30) as f64) } else { String::new() };
    eprintln!("kestrel: weights loaded in {:.1} s{on_gpu}", started.elapsed().as_secs_f64());
    Ok(loaded)
}

impl EngineArgs {
    /// Refuses flag values this build cannot honour, before anything is loaded.
    pub fn check(&self) -> Result<()> {
        self.device.check()?;
        self.spec.check()?;
        self.context.check()
    }

    /// Checks the flags, opens the model's files and checks the context length against it.
    pub fn open_model(&self) -> Result<ModelFiles> {
        self.check()?;
        let files = self.model.open()?;
        self.device.check_tensor_parallel(&files)?;
        self.context.max_model_len(&files)?;
        self.context.kv_cache.check(&files)?;
        Ok(files)
    }

    /// Device memory one step's activations may take at most.
    fn activation_workspace(&self, files: &ModelFiles, max_num_seqs: usize) -> usize {
        let tokens = self.context.max_num_batched_tokens;
        let logit_rows = (max_num_seqs * (self.spec.spec_tokens + 1)).min(tokens);
        files.config.activation_bytes(tokens, logit_rows)
    }

    /// Uploads the weights for an engine of up to `max_num_seqs` requests.
    pub fn load_model<B: Backend>(&self, backend: &B, files: &ModelFiles, max_num_seqs: usize) -> Result<Qwen35<B>> {
        load_model(&self.model, &self.device, backend, files, self.activation_workspace(files, max_num_seqs))
    }

    /// The engine configuration for `max_num_seqs` concurrent requests with speculation
    /// `spec`. On a GPU the KV cache takes what `--gpu-memory-utilization` leaves after the
    /// weights, the recurrent state, the prefix cache's checkpoints and the activations (capped
    /// at what the requests can use).
    pub fn engine_config<B: Backend>(&self, backend: &B, model: &Qwen35<B>, files: &ModelFiles, max_num_seqs: usize, spec: SpecMethod) -> Result<EngineConfig> {
        let max_model_len = self.context.max_model_len(files)?;
        let mut config = EngineConfig {
            max_num_seqs,
            max_num_batched_tokens: self.context.max_num_batched_tokens,
            block_size: BLOCK_SIZE,
            num_blocks: 0,
            max_model_len,
            spec,
            spec_tokens: self.spec.spec_tokens,
            ngram_min: self.spec.ngram_min,
            ngram_max: self.spec.ngram_max,
            cuda_graphs: !self.context.no_cuda_graphs,
            kv_dtype: self.context.kv_cache.dtype(),
            cuda_graph_sizes: self.context.cuda_graph_sizes.clone(),
            max_cuda_graph_size: self.context.max_cuda_graph_size,
            prefix_cache_checkpoints: 0,
            spec_backoff: !self.spec.no_spec_backoff,
        };
        let per_request = (max_model_len + config.spec_tokens).div_ceil(BLOCK_SIZE);
        let wanted = self.context.kv_blocks.unwrap_or(max_num_seqs * per_request);
        let utilization = self.device.gpu_memory_utilization;
        // The engine keeps one state slot and one KV block more, for padded rows.
        let state = model.cache_spec(0, BLOCK_SIZE, max_num_seqs + Scratch::STATE_SLOTS, config.snapshot_slots(backend.replays_graphs()));
        let budget = backend.cache_memory_budget(utilization, self.activation_workspace(files, max_num_seqs)).transpose().context("no GPU memory is left for the KV cache")?;
        let checkpoints = self.prefix_cache_checkpoints(state.bytes_per_state(), budget)?;
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        config.num_blocks = match budget {
            None => wanted,
            Some(budget) => {
                // The checkpoints' memory comes off the budget with the recurrent state's.
                let cache = CacheSpec { kv_dtype: config.kv_dtype, checkpoint_slots: checkpoints, ..state.clone() };
                let plan = kv_plan::plan_kv_blocks(budget, &cache, wanted, self.context.kv_blocks, per_request, utilization)?;
                eprintln!("kestrel: {}", kv_plan::describe(&plan, &cache));
                plan.blocks
            }
        };
        // Checkpoints sit 64 tokens apart at least, and one is of use only while the KV blocks
        // before it are cached: more than the KV cache's 64-token spans is memory never used.
        config.prefix_cache_checkpoints = checkpoints.min(config.num_blocks * BLOCK_SIZE / 64);
        if config.prefix_cache_checkpoints > 0 {
            let per = state.bytes_per_state();
            eprintln!(
                "kestrel: prefix cache up to {} checkpoint{} of {:.2} MiB ({:.2} GiB)",
                config.prefix_cache_checkpoints,
                if config.prefix_cache_checkpoints == 1 { "" } else { "s" },
                per as f64 / (1u64 << 20) as f64,
                gib(config.prefix_cache_checkpoints * per)
            );
        }
        Ok(config)
    }

    /// Checkpoints the prefix cache may keep: `--prefix-cache-memory` (or its default) over
    /// `per_checkpoint` bytes each; 0 with `--no-prefix-cache`. `budget` is the device memory
    /// the caches may take, if the backend has one.
    fn prefix_cache_checkpoints(&self, per_checkpoint: usize, budget: Option<usize>) -> Result<usize> {
        if self.context.no_prefix_cache {
            return Ok(0);
        }
        let per_checkpoint = per_checkpoint.max(1);
        let memory = match (self.context.prefix_cache_memory, budget) {
            (Some(memory), _) => {
                if memory < per_checkpoint {
                    bail!(
                        "--prefix-cache-memory {memory} bytes holds no checkpoint: one takes {:.2} MiB for this model; give more, or --no-prefix-cache",
                        per_checkpoint as f64 / (1u64 << 20) as f64
                    );
                }
                memory
            }
            (None, Some(budget)) => DEFAULT_PREFIX_CACHE_MEMORY.min(budget / 8),
            (None, None) => DEFAULT_PREFIX_CACHE_MEMORY,
        };
        Ok(memory / per_checkpoint)
    }

    /// Uploads the weights to `backend` and builds an engine for up to `max_num_seqs` requests.
    pub fn build_engine_on<B: Backend>(&self, backend: B, files: &ModelFiles, max_num_seqs: usize) -> Result<Engine<B>> {
        let spec = self.spec.single()?;
        let model = self.load_model(&backend, files, max_num_seqs)?;
        let config = self.engine_config(&backend, &model, files, max_num_seqs, spec)?;
        start_engine(backend, model, config)
    }

    /// Starts the engine on a worker thread (for the server and the chat).
    pub fn spawn_worker(&self, files: Arc<ModelFiles>, max_num_seqs: usize) -> Result<EngineWorker> {
        let args = self.clone();
        let worker = match self.device.select_backend()? {
            SelectedBackend::Cpu(b) => EngineWorker::spawn(move || args.build_engine_on(b, &files, max_num_seqs).map_err(|err| format!("{err:#}"))),
            SelectedBackend::Cuda(b) => EngineWorker::spawn(move || args.build_engine_on(*b, &files, max_num_seqs).map_err(|err| format!("{err:#}"))),
        };
        Ok(worker?)
    }
}
