//! Command-line front end: one file per subcommand; shared engine flags live here.

pub mod batch;
pub mod bench;
mod bench_plot;
pub mod chat;
pub mod info;
pub mod perplexity;
pub mod run;
pub mod serve;
pub mod tokenize;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::cuda::CudaBackend;
use kestrel::backend::Backend;
use kestrel::engine::request::SpecMethod;
use kestrel::backend::sampling::SamplingParams;
use kestrel::engine::{Engine, EngineConfig};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::{default_model, dummy, ModelFiles};
use kestrel::engine::worker::EngineWorker;
use std::path::PathBuf;
use std::sync::Arc;

/// Seed of the random weights of `--load-format dummy`.
const DUMMY_SEED: u64 = 1234;

/// Tokens per KV block.
const BLOCK_SIZE: usize = 16;

/// Binds `$engine` to an engine on the backend `--device` selects and evaluates `$body` with
/// it (the body is compiled once per backend type).
macro_rules! with_engine {
    ($args:expr, $files:expr, $max_num_seqs:expr, |$engine:ident| $body:expr) => {
        match $args.select_backend()? {
            $crate::cli::SelectedBackend::Cpu(b) => {
                let $engine = $args.build_engine_on(b, $files, $max_num_seqs)?;
                $body
            }
            $crate::cli::SelectedBackend::Cuda(b) => {
                let $engine = $args.build_engine_on(*b, $files, $max_num_seqs)?;
                $body
            }
        }
    };
}
pub(crate) use with_engine;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Auto,
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvCacheDtype {
    Bf16,
    Fp8,
    Tq3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Quantization {
    None,
    Fp8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LoadFormat {
    Auto,
    Dummy,
}

/// The backend chosen by `--device`.
pub enum SelectedBackend {
    Cpu(CpuBackend),
    Cuda(Box<CudaBackend>),
}

/// Model, device, speculation and memory flags shared by every subcommand that runs a model.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Hugging Face model directory or GGUF file (default: the embedded kestrel-coder model).
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "auto")]
    pub device: Device,
    /// Speculative decoding method (`bench` takes a comma-separated list to compare).
    #[arg(long, default_value = "none", value_parser = parse_spec, value_delimiter = ',')]
    pub spec: Vec<SpecMethod>,
    /// Draft tokens per step (k).
    #[arg(long, default_value_t = 4)]
    pub spec_tokens: usize,
    #[arg(long, default_value_t = 2)]
    pub ngram_min: usize,
    #[arg(long, default_value_t = 4)]
    pub ngram_max: usize,
    #[arg(long, value_enum, default_value = "bf16")]
    pub kv_cache_dtype: KvCacheDtype,
    #[arg(long, value_enum, default_value = "none")]
    pub quantization: Quantization,
    #[arg(long, value_enum, default_value = "auto")]
    pub load_format: LoadFormat,
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Fraction of GPU memory the CUDA backend may use.
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f32,
    /// Maximum tokens per engine step (prefill chunks + decode/verify rows).
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// Context length (prompt + generated) per request; defaults to min(model limit, 4096).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// KV cache size in blocks of 16 tokens (default: enough for every concurrent request).
    #[arg(long)]
    pub kv_blocks: Option<usize>,
}

fn parse_spec(s: &str) -> Result<SpecMethod, String> {
    s.parse()
}

/// Per-request sampling flags.
#[derive(Debug, Clone, Args)]
pub struct SamplingArgs {
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams { temperature: self.temperature, top_k: self.top_k, top_p: self.top_p, seed: self.seed }
    }
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

impl EngineArgs {
    /// Rejects flag combinations this build cannot honour, with a message saying so.
    fn check_supported(&self) -> Result<()> {
        if self.kv_cache_dtype != KvCacheDtype::Bf16 {
            bail!("--kv-cache-dtype {:?}: only bf16 is supported so far (the cache is kept in f32)", self.kv_cache_dtype);
        }
        if self.quantization != Quantization::None {
            bail!("--quantization fp8 is not supported yet");
        }
        if self.spec_tokens == 0 && self.spec.iter().any(|m| *m != SpecMethod::None) {
            bail!("--spec-tokens must be at least 1 with speculation on");
        }
        if self.spec.is_empty() {
            bail!("--spec needs a method: none, ngram or mtp");
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            bail!("--gpu-memory-utilization must be in (0, 1], got {}", self.gpu_memory_utilization);
        }
        Ok(())
    }

    /// The model's files: an HF directory, a GGUF file, the embedded default model, or with
    /// `--load-format dummy` a preset's shapes (`--model qwen3.5-9b`) with random weights.
    pub fn open_model(&self) -> Result<ModelFiles> {
        self.check_supported()?;
        if self.load_format == LoadFormat::Dummy {
            return self.dummy_model_files();
        }
        ModelFiles::open(self.model.as_deref()).with_context(|| match &self.model {
            Some(p) => format!("cannot load model {}", p.display()),
            None => "cannot load the embedded default model".to_string(),
        })
    }

    /// A dummy model's configuration and placeholder store. Prompts are tokenized with the
    /// default model's tokenizer (its ids are valid in every preset's vocabulary; generated ids
    /// beyond it decode as nothing). The model has no stop tokens, so every request runs to its
    /// `max_tokens`, as benchmarks want.
    fn dummy_model_files(&self) -> Result<ModelFiles> {
        let name = self.model.as_deref().and_then(|p| p.to_str()).ok_or_else(|| anyhow!("--load-format dummy needs --model PRESET, one of: {}", dummy::PRESETS.join(", ")))?;
        let mut config = dummy::preset_config(name)?;
        config.eos_token_ids.clear();
        let store = dummy::dummy_store(&config, DUMMY_SEED)?;
        let tokenizer = default_model::open().context("cannot open the default model's tokenizer")?.tokenizer.skipping_unknown_ids();
        Ok(ModelFiles { source: format!("dummy {name}"), config, store, tokenizer })
    }

    /// The one speculation method of a subcommand that runs a single configuration.
    pub fn single_spec(&self) -> Result<SpecMethod> {
        match self.spec.as_slice() {
            [m] => Ok(*m),
            _ => bail!("--spec takes one method here (lists are for `kestrel bench`)"),
        }
    }

    /// The backend `--device` asks for. `auto` takes CUDA where its libraries and a GPU are
    /// present, else the CPU (saying why on stderr). The libraries are probed before any CUDA
    /// call, since a missing one would abort the process.
    pub fn select_backend(&self) -> Result<SelectedBackend> {
        match self.device {
            Device::Cpu => Ok(SelectedBackend::Cpu(CpuBackend::new())),
            Device::Cuda => {
                kestrel::backend::cuda::probe().context("--device cuda")?;
                Ok(SelectedBackend::Cuda(Box::new(CudaBackend::new(0).context("--device cuda: cannot start the CUDA backend")?)))
            }
            Device::Auto => match kestrel::backend::cuda::probe().map_err(anyhow::Error::from).and_then(|()| Ok(CudaBackend::new(0)?)) {
                Ok(b) => Ok(SelectedBackend::Cuda(Box::new(b))),
                Err(e) => {
                    eprintln!("kestrel: CUDA unavailable ({e}); running on the CPU");
                    Ok(SelectedBackend::Cpu(CpuBackend::new()))
                }
            },
        }
    }

    fn max_model_len(&self, files: &ModelFiles) -> usize {
        self.max_model_len.unwrap_or(files.config.max_position_embeddings.min(4096))
    }

    /// Device memory one step's activations may take at most.
    fn activation_workspace(&self, files: &ModelFiles, max_num_seqs: usize) -> usize {
        let logit_rows = (max_num_seqs * (self.spec_tokens + 1)).min(self.max_num_batched_tokens);
        files.config.activation_bytes(self.max_num_batched_tokens, logit_rows)
    }

    /// Uploads the weights to `backend` (random ones with `--load-format dummy`). On a GPU, a
    /// model that cannot fit under `--gpu-memory-utilization` is refused before anything is
    /// uploaded.
    pub fn load_model<B: Backend>(&self, backend: &B, files: &ModelFiles, max_num_seqs: usize) -> Result<Qwen35<B>> {
        let weights = files.store.device_bytes();
        if let Some(budget) = backend.cache_memory_budget(self.gpu_memory_utilization, weights + self.activation_workspace(files, max_num_seqs)) {
            budget.with_context(|| format!("{} ({:.2} GiB of weights) does not fit on the GPU", files.source, weights as f64 / (1u64 << 30) as f64))?;
        }
        let bar = progress_bar(0, "loading");
        let model = if self.load_format == LoadFormat::Dummy {
            dummy::load_from_dummy_store(backend, files.config.clone(), &files.store, DUMMY_SEED, &bar)?
        } else {
            Qwen35::load(backend, files.config.clone(), &files.store, &bar).with_context(|| format!("cannot load weights of {}", files.source))?
        };
        bar.finish_and_clear();
        Ok(model)
    }

    /// The engine configuration for `max_num_seqs` concurrent requests with speculation
    /// `spec`. On a GPU the KV cache takes what `--gpu-memory-utilization` leaves after the
    /// weights, the recurrent state and the activations (capped at what the requests can use).
    pub fn engine_config<B: Backend>(&self, backend: &B, model: &Qwen35<B>, files: &ModelFiles, max_num_seqs: usize, spec: SpecMethod) -> Result<EngineConfig> {
        let max_model_len = self.max_model_len(files);
        let mut config = EngineConfig {
            max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            block_size: BLOCK_SIZE,
            num_blocks: 0,
            max_model_len,
            spec,
            spec_tokens: self.spec_tokens.max(1),
            ngram_min: self.ngram_min,
            ngram_max: self.ngram_max,
            cuda_graphs: !self.no_cuda_graphs,
        };
        let per_request = (max_model_len + config.spec_tokens).div_ceil(BLOCK_SIZE);
        let wanted = self.kv_blocks.unwrap_or(max_num_seqs * per_request);
        config.num_blocks = match backend.cache_memory_budget(self.gpu_memory_utilization, self.activation_workspace(files, max_num_seqs)) {
            None => wanted,
            Some(budget) => {
                let budget = budget.context("no GPU memory is left for the KV cache")?;
                let cache = model.cache_spec(0, BLOCK_SIZE, max_num_seqs, config.snapshot_slots());
                let fit = budget.saturating_sub(cache.state_bytes()) / cache.bytes_per_block().max(1);
                let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
                if let Some(n) = self.kv_blocks.filter(|&n| n > fit) {
                    bail!("--kv-blocks {n} needs {:.2} GiB, but {:.2} GiB are left under --gpu-memory-utilization {}", gib(n * cache.bytes_per_block()), gib(budget), self.gpu_memory_utilization);
                }
                if fit < per_request {
                    bail!(
                        "the KV cache fits {fit} blocks of {BLOCK_SIZE} tokens but one request of --max-model-len {max_model_len} needs {per_request}; lower --max-model-len or --max-batch/--max-num-seqs, or raise --gpu-memory-utilization"
                    );
                }
                let blocks = wanted.min(fit);
                eprintln!(
                    "kestrel: KV cache {blocks} blocks ({} tokens, {:.2} GiB), recurrent state {:.2} GiB",
                    blocks * BLOCK_SIZE,
                    gib(blocks * cache.bytes_per_block()),
                    gib(cache.state_bytes())
                );
                blocks
            }
        };
        Ok(config)
    }

    /// Uploads the weights to `backend` and builds an engine for up to `max_num_seqs` requests.
    pub fn build_engine_on<B: Backend>(&self, backend: B, files: &ModelFiles, max_num_seqs: usize) -> Result<Engine<B>> {
        let spec = self.single_spec()?;
        let model = self.load_model(&backend, files, max_num_seqs)?;
        let config = self.engine_config(&backend, &model, files, max_num_seqs, spec)?;
        Engine::new(backend, model, config).context("cannot start the engine")
    }

    /// Starts the engine on a worker thread (for the server and the chat).
    pub fn spawn_worker(&self, files: Arc<ModelFiles>, max_num_seqs: usize) -> Result<EngineWorker> {
        let args = self.clone();
        let worker = match self.select_backend()? {
            SelectedBackend::Cpu(b) => EngineWorker::spawn(move || args.build_engine_on(b, &files, max_num_seqs).map_err(|err| format!("{err:#}"))),
            SelectedBackend::Cuda(b) => EngineWorker::spawn(move || args.build_engine_on(*b, &files, max_num_seqs).map_err(|err| format!("{err:#}"))),
        };
        Ok(worker?)
    }
}
