//! Command-line front end: one file per subcommand; shared engine flags live here.

pub mod batch;
pub mod bench;
mod bench_plot;
pub mod chat;
pub mod info;
pub mod perplexity;
pub mod run;
pub mod serve;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::cuda::CudaBackend;
use kestrel::backend::Backend;
use kestrel::engine::request::SpecMethod;
use kestrel::engine::sampler::SamplingParams;
use kestrel::engine::{Engine, EngineConfig};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::ModelFiles;
use std::path::PathBuf;

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
    /// Hugging Face model directory (default: the embedded kestrel-coder model).
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
            bail!("--kv-cache-dtype {:?}: only bf16 (full precision on the CPU) is supported by the CPU backend", self.kv_cache_dtype);
        }
        if self.quantization != Quantization::None {
            bail!("--quantization fp8 needs the CUDA backend");
        }
        if self.load_format == LoadFormat::Dummy {
            bail!("--load-format dummy: random weights at real sizes are benchmarked by `cargo run --release --example cuda_bench -- --presets NAME`");
        }
        if self.spec_tokens == 0 && self.spec.iter().any(|m| *m != SpecMethod::None) {
            bail!("--spec-tokens must be at least 1 with speculation on");
        }
        if self.spec.is_empty() {
            bail!("--spec needs a method: none, ngram or mtp");
        }
        Ok(())
    }

    pub fn open_model(&self) -> Result<ModelFiles> {
        self.check_supported()?;
        ModelFiles::open(self.model.as_deref()).with_context(|| match &self.model {
            Some(p) => format!("cannot load model {}", p.display()),
            None => "cannot load the embedded default model".to_string(),
        })
    }

    /// Uploads the weights and builds an engine for up to `max_num_seqs` concurrent requests.
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

    /// A CPU engine, for subcommands that do not run on CUDA yet (`--device cuda` is refused).
    pub fn build_engine(&self, files: &ModelFiles, max_num_seqs: usize) -> Result<Engine<CpuBackend>> {
        if self.device == Device::Cuda {
            bail!("--device cuda: this subcommand runs on the CPU so far (`kestrel run` supports CUDA)");
        }
        self.build_engine_on(CpuBackend::new(), files, max_num_seqs)
    }

    /// Uploads the weights to `backend` and builds an engine for up to `max_num_seqs` requests.
    pub fn build_engine_on<B: Backend>(&self, backend: B, files: &ModelFiles, max_num_seqs: usize) -> Result<Engine<B>> {
        let spec = self.single_spec()?;
        let bar = progress_bar(0, "loading");
        let model = Qwen35::load(&backend, files.config.clone(), &files.store, &bar).with_context(|| format!("cannot load weights of {}", files.source))?;
        bar.finish_and_clear();
        let max_model_len = self.max_model_len.unwrap_or(files.config.max_position_embeddings.min(4096));
        let block_size = 16;
        let num_blocks = self.kv_blocks.unwrap_or(max_num_seqs * (max_model_len + self.spec_tokens).div_ceil(block_size));
        let config = EngineConfig {
            max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            block_size,
            num_blocks,
            max_model_len,
            spec,
            spec_tokens: self.spec_tokens.max(1),
            ngram_min: self.ngram_min,
            ngram_max: self.ngram_max,
        };
        Engine::new(backend, model, config).context("cannot start the engine")
    }
}
