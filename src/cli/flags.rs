//! The flag groups the subcommands share. Each subcommand flattens the groups it uses, so its
//! `--help` lists exactly the flags it reads, under a heading per group.

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use kestrel::backend::cpu::{CpuBackend, MatmulMode};
use kestrel::backend::cuda::CudaBackend;
use kestrel::backend::sampling::{top_k_from_signed, SamplingError, SamplingParams};
use kestrel::backend::KvDtype;
use kestrel::engine::padding::CaptureSizes;
use kestrel::engine::request::SpecMethod;
use kestrel::model::generation_config::SamplingDefaults;
use kestrel::model::weights::online::OnlineQuantization;
use kestrel::model::tensor_parallel::SplitPlan;
use kestrel::model::{default_model, dummy, ModelFiles};
use std::path::PathBuf;

/// Seed of the random weights of `--load-format dummy`.
const DUMMY_SEED: u64 = 1234;

/// The most draft tokens per step: verify rows grow with k while acceptance falls, so beyond
/// this a step only costs more.
pub const MAX_SPEC_TOKENS: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Auto,
    Cpu,
    #[value(alias = "gpu")]
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvCacheDtype {
    /// bf16.
    Auto,
    /// Full precision, 4 bytes per element (the reference).
    F32,
    /// 2 bytes per element (the default).
    Bf16,
    /// e4m3 with a scale per token and kv head: a byte per element.
    Fp8,
    /// TurboQuant 3-bit: keys and values rotated, a 3-bit codebook index per element and a norm
    /// per token and kv head (about 3.1 bits per element).
    Tq3,
}

impl KvCacheDtype {
    pub fn dtype(self) -> KvDtype {
        match self {
            KvCacheDtype::Auto | KvCacheDtype::Bf16 => KvDtype::Bf16,
            KvCacheDtype::F32 => KvDtype::F32,
            KvCacheDtype::Fp8 => KvDtype::Fp8,
            KvCacheDtype::Tq3 => KvDtype::Tq3,
        }
    }
}

/// `--quantization`: float linears quantized at load (model/weights/online.rs), or with
/// `--load-format dummy` the format of the random weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Quantization {
    /// The weights as stored.
    None,
    /// E4M3 with a scale per 128 inputs of each row.
    Fp8,
    /// Asymmetric int4 in groups of 128 inputs.
    Int4,
    /// Q4_K, and Q6_K where llama.cpp's Q4_K_M puts it.
    #[value(name = "q4_k")]
    Q4K,
}

impl Quantization {
    pub fn online(self) -> Option<OnlineQuantization> {
        match self {
            Quantization::None => None,
            Quantization::Fp8 => Some(OnlineQuantization::Fp8),
            Quantization::Int4 => Some(OnlineQuantization::Int4),
            Quantization::Q4K => Some(OnlineQuantization::Q4K),
        }
    }
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

/// Which model to open.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// Hugging Face model directory or GGUF file (default: the embedded kestrel-coder model); with
    /// --load-format dummy, a preset name such as qwen3.5-9b.
    #[arg(long, short = 'm', value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// auto: the weights of --model; dummy: random weights of a preset's shapes, made on the GPU
    /// (benchmarks at real sizes without checkpoint files).
    #[arg(long, value_enum, default_value = "auto")]
    pub load_format: LoadFormat,
    /// Quantize float weights while loading (checkpoints already quantized keep their format),
    /// or with --load-format dummy make the random weights in that format.
    #[arg(long, value_enum, default_value = "none")]
    pub quantization: Quantization,
}

impl ModelArgs {
    /// The model's files: an HF directory, a GGUF file, the embedded default model, or with
    /// `--load-format dummy` a preset's shapes (`--model qwen3.5-9b`) with random weights.
    pub fn open(&self) -> Result<ModelFiles> {
        if self.load_format == LoadFormat::Dummy {
            return self.dummy_files();
        }
        let mut files = ModelFiles::open(self.model.as_deref()).with_context(|| match &self.model {
            Some(p) => format!("cannot load model {}", p.display()),
            None => "cannot load the embedded default model".to_string(),
        })?;
        files.config.online_quantization = self.quantization.online();
        Ok(files)
    }

    /// The name clients and the chat show: the directory or file name of `--model`, or the
    /// embedded model's name.
    pub fn display_name(&self) -> String {
        self.model.as_deref().and_then(|p| p.file_name()).map_or_else(|| default_model::NAME.to_string(), |n| n.to_string_lossy().into_owned())
    }

    pub fn is_dummy(&self) -> bool {
        self.load_format == LoadFormat::Dummy
    }

    pub fn dummy_seed(&self) -> u64 {
        DUMMY_SEED
    }

    /// A dummy model's configuration and placeholder store. Prompts are tokenized with the
    /// default model's tokenizer (its ids are valid in every preset's vocabulary; generated ids
    /// beyond it decode as nothing). The model has no stop tokens, so every request runs to its
    /// `max_tokens`, as benchmarks want.
    fn dummy_files(&self) -> Result<ModelFiles> {
        let name = self.model.as_deref().and_then(|p| p.to_str()).ok_or_else(|| anyhow!("--load-format dummy needs --model PRESET, one of: {}", dummy::PRESETS.join(", ")))?;
        let mut config = dummy::preset_config(name)?;
        config.eos_token_ids.clear();
        config.online_quantization = self.quantization.online();
        let store = dummy::dummy_store(&config, DUMMY_SEED)?;
        let tokenizer = default_model::open().context("cannot open the default model's tokenizer")?.tokenizer.with_model_vocab_size(config.vocab_size);
        Ok(ModelFiles { source: format!("dummy {name}"), config, store, tokenizer, sampling_defaults: SamplingDefaults::default() })
    }
}

/// Where the weights run.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Device")]
pub struct DeviceArgs {
    /// auto: CUDA where its libraries and a GPU are present, else the CPU; cpu; cuda (or gpu).
    #[arg(long, value_enum, default_value = "auto")]
    pub device: Device,
    /// Threads of the CPU backend (default: every core this process may use); the output does
    /// not depend on it.
    #[arg(long, short = 't', value_name = "N")]
    pub threads: Option<usize>,
    /// How the CPU backend multiplies quantized weights: exact (each weight converted to f32,
    /// the reference), int8 (Q4_K, Q6_K, Q8_0, Q4_0 and int4 weights against activations
    /// quantized to 8 bits per row, in integers, as llama.cpp does: several times faster, with
    /// slightly different numerics; still independent of the batch and the thread count) or
    /// auto (the default: int8 for Q4_K, Q6_K and Q4_0 weights, where it is the faster path,
    /// exact for the rest).
    #[arg(long, value_parser = parse_cpu_matmul, value_name = "MODE")]
    pub cpu_matmul: Option<MatmulMode>,
    /// Fraction of GPU memory Kestrel may take (weights, activations, recurrent state and KV
    /// cache), above 0 and at most 1.
    #[arg(long, default_value_t = 0.9, allow_negative_numbers = true, value_name = "FRACTION")]
    pub gpu_memory_utilization: f32,
    /// GPUs to split the model over (tensor parallelism, also -tp): 1, 2, 4 or 8. `kestrel info
    /// --tensor-parallel-size N` shows the split and the memory per GPU.
    #[arg(long, visible_alias = "tp", default_value_t = 1, value_name = "N")]
    pub tensor_parallel_size: usize,
}

impl DeviceArgs {
    pub fn check(&self) -> Result<()> {
        if self.threads == Some(0) {
            bail!("--threads must be at least 1");
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            bail!("--gpu-memory-utilization must be in (0, 1], got {}", self.gpu_memory_utilization);
        }
        Ok(())
    }

    /// The backend `--device` asks for. `auto` takes CUDA where its libraries and a GPU are
    /// present, else the CPU (saying why on stderr). The libraries are probed before any CUDA
    /// call, since a missing one would abort the process.
    pub fn select_backend(&self) -> Result<SelectedBackend> {
        self.check()?;
        let cpu = || CpuBackend::with_threads(self.cpu_threads()).with_matmul_mode(self.cpu_matmul.unwrap_or(MatmulMode::Auto));
        match self.device {
            Device::Cpu => Ok(SelectedBackend::Cpu(cpu())),
            Device::Cuda => {
                if let Some(mode) = self.cpu_matmul {
                    bail!("--cpu-matmul {mode} applies to the CPU backend, not to --device cuda");
                }
                kestrel::backend::cuda::probe().context("--device cuda")?;
                Ok(SelectedBackend::Cuda(Box::new(CudaBackend::new(0).context("--device cuda: cannot start the CUDA backend")?)))
            }
            Device::Auto => match kestrel::backend::cuda::probe().map_err(anyhow::Error::from).and_then(|()| Ok(CudaBackend::new(0)?)) {
                Ok(b) => Ok(SelectedBackend::Cuda(Box::new(b))),
                Err(e) => {
                    eprintln!("kestrel: CUDA unavailable ({e}); running on the CPU");
                    Ok(SelectedBackend::Cpu(cpu()))
                }
            },
        }
    }

    /// Checks `--tensor-parallel-size` against the model's split plan, and refuses a split run:
    /// this build runs a model on one GPU only, and never falls back to one silently.
    pub fn check_tensor_parallel(&self, files: &ModelFiles) -> Result<()> {
        let n = self.tensor_parallel_size;
        let plan = SplitPlan::for_store(&files.config, n, &files.store).with_context(|| format!("cannot split {} over {n} GPUs", files.source))?;
        if n == 1 {
            return Ok(());
        }
        let online = files.config.online_quantization.map(|q| (q, files.config.num_layers()));
        let per_gpu = plan.weight_bytes_per_rank(&files.store, online).into_iter().max().unwrap_or(0);
        let backend = match self.device {
            Device::Cpu => "the CPU backend, which runs on one device",
            Device::Cuda | Device::Auto => "the CUDA backend yet",
        };
        bail!(
            "--tensor-parallel-size {n}: {} splits over {n} GPUs ({:.2} GiB of weights on the fullest; `kestrel info --tensor-parallel-size {n}` shows the split), but running a split model is not available on {backend}; run with --tensor-parallel-size 1",
            files.source,
            per_gpu as f64 / (1u64 << 30) as f64
        )
    }

    /// Threads the CPU backend (and host work that follows it) runs on.
    pub fn cpu_threads(&self) -> usize {
        self.threads.unwrap_or_else(kestrel::backend::cpu::default_threads)
    }
}

/// The command line with vLLM's `-tp` spelled `--tensor-parallel-size` (clap's short flags are
/// one letter); arguments after `--` are left as they are.
pub fn expand_short_aliases(args: impl IntoIterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut literal = false;
    args.into_iter()
        .map(|arg| {
            if literal {
                return arg;
            }
            match arg.to_str() {
                Some("--") => {
                    literal = true;
                    arg
                }
                Some("-tp") => "--tensor-parallel-size".into(),
                Some(s) if s.starts_with("-tp=") => format!("--tensor-parallel-size={}", &s[4..]).into(),
                _ => arg,
            }
        })
        .collect()
}

fn parse_cpu_matmul(s: &str) -> Result<MatmulMode, String> {
    s.parse()
}

fn parse_spec(s: &str) -> Result<SpecMethod, String> {
    s.parse()
}

fn parse_spec_tokens(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(k) if (1..=MAX_SPEC_TOKENS).contains(&k) => Ok(k),
        _ => Err(format!("draft tokens per step must be a whole number from 1 to {MAX_SPEC_TOKENS}, got `{s}`")),
    }
}

/// Speculative decoding.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Speculative decoding")]
pub struct SpecArgs {
    /// none, ngram (drafts from the request's own text) or mtp (the model's multi-token-prediction
    /// head); `bench` takes a comma-separated list to compare.
    #[arg(long, default_value = "none", value_parser = parse_spec, value_delimiter = ',')]
    pub spec: Vec<SpecMethod>,
    /// Draft tokens per step (k), 1 to 16.
    #[arg(long, default_value_t = 4, value_parser = parse_spec_tokens, value_name = "K")]
    pub spec_tokens: usize,
    /// Shortest suffix the ngram drafter looks for earlier in the text.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub ngram_min: usize,
    /// Longest suffix the ngram drafter looks for earlier in the text.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub ngram_max: usize,
    /// Offer every step --spec-tokens drafts per row. By default a step is offered fewer (down
    /// to none) when the step costs measured so far say verifying them would not pay, as with
    /// many sequences on a GPU; the text is the same either way.
    #[arg(long)]
    pub no_spec_backoff: bool,
}

impl SpecArgs {
    pub fn check(&self) -> Result<()> {
        if self.spec.is_empty() {
            bail!("--spec needs a method: none, ngram or mtp");
        }
        Ok(())
    }

    /// The one speculation method of a subcommand that runs a single configuration.
    pub fn single(&self) -> Result<SpecMethod> {
        match self.spec.as_slice() {
            [m] => Ok(*m),
            _ => bail!("--spec takes one method here (lists are for `kestrel bench`)"),
        }
    }
}

/// Context lengths past the model's training length.
#[derive(Debug, Clone, Args)]
pub struct LongContextArgs {
    /// Allow a context longer than the model's max_position_embeddings: positions past those it
    /// was trained on give unreliable output (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1).
    #[arg(long)]
    pub allow_long_context: bool,
}

impl LongContextArgs {
    /// Refuses `length` tokens past the model's trained length unless asked for.
    pub fn check(&self, flag: &str, length: usize, files: &ModelFiles) -> Result<()> {
        let trained = files.config.max_position_embeddings;
        if length > trained {
            if !self.allow_long_context {
                bail!("{flag} {length} is longer than {}'s max_position_embeddings ({trained}); pass --allow-long-context to run past the trained length anyway", files.source);
            }
            eprintln!("kestrel: {flag} {length} is past the trained length of {trained} tokens; output may degrade there");
        }
        Ok(())
    }
}

/// How the attention cache stores keys and values.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Context and memory")]
pub struct KvCacheArgs {
    /// KV cache element type: bf16 (auto), f32, fp8 or tq3 (TurboQuant 3-bit).
    #[arg(long, value_enum, default_value = "auto")]
    pub kv_cache_dtype: KvCacheDtype,
}

impl KvCacheArgs {
    pub fn dtype(&self) -> KvDtype {
        self.kv_cache_dtype.dtype()
    }

    /// Refuses a format the model's attention heads cannot be stored in.
    pub fn check(&self, files: &ModelFiles) -> Result<()> {
        let dtype = self.dtype();
        dtype.check_head_dim(files.config.head_dim).with_context(|| format!("--kv-cache-dtype {dtype} cannot hold {}'s attention heads", files.source))
    }
}

/// Context length, KV cache and step size of the engine.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Context and memory")]
pub struct ContextArgs {
    /// Context length (prompt and generated tokens) of a request; default: the model's
    /// max_position_embeddings, at most 4096.
    #[arg(long, short = 'c', visible_alias = "ctx-size", value_name = "TOKENS")]
    pub max_model_len: Option<usize>,
    #[command(flatten)]
    pub long_context: LongContextArgs,
    #[command(flatten)]
    pub kv_cache: KvCacheArgs,
    /// KV cache size in blocks of 16 tokens (default: room for every concurrent request at full
    /// context, as far as GPU memory allows).
    #[arg(long, value_name = "BLOCKS")]
    pub kv_blocks: Option<usize>,
    /// Most tokens one engine step runs (prefill chunks and decode or verify rows), at least 64.
    #[arg(long, default_value_t = 512, value_name = "TOKENS")]
    pub max_num_batched_tokens: usize,
    /// Run decode steps one kernel at a time instead of replaying them as CUDA graphs.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Batch sizes (rows) whose CUDA graphs are captured at start-up, comma-separated; decode
    /// and verify steps are padded up to the smallest that holds them (default: 1,2,4,8,16,24,
    /// 32, then every 16 up to --max-cuda-graph-size).
    #[arg(long, value_name = "SIZES", value_parser = parse_capture_sizes, conflicts_with = "no_cuda_graphs")]
    pub cuda_graph_sizes: Option<CaptureSizes>,
    /// The largest CUDA graph capture size; larger steps run at their own shape (default: the
    /// most concurrent requests).
    #[arg(long, value_name = "ROWS", conflicts_with = "no_cuda_graphs")]
    pub max_cuda_graph_size: Option<usize>,
    /// Memory for the prefix cache's recurrent-state checkpoints, e.g. 2GiB or 512MiB (default:
    /// 2GiB; on a GPU at most an eighth of the memory left after the weights). Cached prompts'
    /// KV blocks stay in the KV cache's free blocks.
    #[arg(long, value_name = "SIZE", value_parser = parse_memory_size)]
    pub prefix_cache_memory: Option<usize>,
    /// Compute every prompt from its first token: no prefix caching.
    #[arg(long, conflicts_with = "prefix_cache_memory")]
    pub no_prefix_cache: bool,
}

fn parse_capture_sizes(s: &str) -> Result<CaptureSizes, String> {
    CaptureSizes::parse(s).map_err(|e| e.to_string())
}

/// A size in bytes: a number with an optional unit (B, KiB, MiB, GiB; KB, MB, GB are powers of 10).
fn parse_memory_size(s: &str) -> Result<usize, String> {
    let size: bytesize::ByteSize = s.trim().parse().map_err(|_| format!("a memory size is a number with an optional unit such as MiB or GiB, got `{s}`"))?;
    usize::try_from(size.as_u64()).map_err(|_| format!("{s} is more memory than this machine can address"))
}

impl ContextArgs {
    pub fn check(&self) -> Result<()> {
        if self.max_cuda_graph_size == Some(0) {
            bail!("--max-cuda-graph-size must be at least 1");
        }
        if self.max_model_len == Some(0) {
            bail!("--max-model-len must be at least 1");
        }
        Ok(())
    }

    /// The context length of a request, checked against the model's trained length.
    pub fn max_model_len(&self, files: &ModelFiles) -> Result<usize> {
        match self.max_model_len {
            None => Ok(files.config.max_position_embeddings.min(4096)),
            Some(n) => {
                self.long_context.check("--max-model-len", n, files)?;
                Ok(n)
            }
        }
    }
}

/// A seed flag: a number, or -1 for a random one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seed {
    Fixed(u64),
    Random,
}

fn parse_seed(s: &str) -> Result<Seed, String> {
    match (s.parse::<i64>(), s.parse::<u64>()) {
        (Ok(-1), _) => Ok(Seed::Random),
        (Ok(n), _) => Ok(Seed::Fixed(n as u64)),
        (_, Ok(n)) => Ok(Seed::Fixed(n)),
        _ => Err(format!("a seed is a whole number (-1 for a random one), got `{s}`")),
    }
}

/// Per-request sampling.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Sampling")]
pub struct SamplingArgs {
    /// Temperature, 0 to 2; 0 is greedy. Default: the model's generation_config.json, else 0.8
    /// for run and chat (llama.cpp's defaults: top-k 40, top-p 0.95, min-p 0.05), 0 for batch and
    /// bench.
    #[arg(long, visible_alias = "temp", allow_negative_numbers = true, value_name = "T")]
    pub temperature: Option<f32>,
    /// Keep the most probable tokens up to this total probability, above 0 and at most 1.
    #[arg(long, allow_negative_numbers = true, value_name = "P")]
    pub top_p: Option<f32>,
    /// Keep the K most probable tokens; 0 or -1: no limit.
    #[arg(long, allow_negative_numbers = true, value_name = "K")]
    pub top_k: Option<i64>,
    /// Keep tokens at least P times as probable as the most probable one, 0 to 1 (0: off).
    #[arg(long, allow_negative_numbers = true, value_name = "P")]
    pub min_p: Option<f32>,
    /// Seed of the sampling noise; -1 picks a random one.
    #[arg(long, default_value = "0", value_parser = parse_seed, allow_negative_numbers = true, value_name = "S")]
    pub seed: Seed,
}

impl SamplingArgs {
    /// The sampling parameters: each flag given, else the model's recommendation in `defaults`,
    /// else greedy with no filter. Values out of range are refused naming their flag.
    pub fn params(&self, defaults: &SamplingDefaults) -> Result<SamplingParams> {
        let top_k = match self.top_k {
            Some(k) => top_k_from_signed(k).map_err(flag_error)?,
            None => defaults.top_k.unwrap_or(0),
        };
        let params = SamplingParams {
            temperature: self.temperature.or(defaults.temperature).unwrap_or(0.0),
            top_p: self.top_p.or(defaults.top_p).unwrap_or(1.0),
            top_k,
            min_p: self.min_p.or(defaults.min_p).unwrap_or(0.0),
            seed: match self.seed {
                Seed::Fixed(seed) => seed,
                Seed::Random => rand::random(),
            },
        };
        params.validate().map_err(flag_error)?;
        Ok(params)
    }
}

/// A sampling error in the command line's terms.
fn flag_error(err: SamplingError) -> anyhow::Error {
    anyhow!("invalid value for --{}: {err}", err.field().replace('_', "-"))
}

/// Whether the model's recommended sampling applies.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Sampling")]
pub struct GenerationConfigArgs {
    /// Ignore the sampling defaults of the model's generation_config.json (temperature, top_p,
    /// top_k, min_p); its stop tokens still apply.
    #[arg(long)]
    pub ignore_generation_config: bool,
}

impl GenerationConfigArgs {
    /// The sampling defaults requests get: the model's, unless told to ignore them.
    pub fn defaults(&self, files: &ModelFiles) -> SamplingDefaults {
        if self.ignore_generation_config {
            SamplingDefaults::default()
        } else {
            files.sampling_defaults.clone()
        }
    }

    /// The defaults of the interactive commands (`run`, `chat`): the model's, and llama.cpp's
    /// where the model says nothing, so a first run samples as a llama.cpp user expects
    /// (greedy decoding of a small model loops).
    pub fn interactive_defaults(&self, files: &ModelFiles) -> SamplingDefaults {
        self.defaults(files).or(&SamplingDefaults::llama_cpp())
    }
}

/// The cap on requests in flight.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Batching")]
pub struct ConcurrencyArgs {
    /// Most requests decoded together in one batch; more wait in the queue.
    #[arg(long, visible_alias = "max-batch", default_value_t = 16, value_name = "N")]
    pub max_num_seqs: usize,
}

impl ConcurrencyArgs {
    pub fn check(&self) -> Result<usize> {
        if self.max_num_seqs == 0 {
            bail!("--max-num-seqs must be at least 1");
        }
        Ok(self.max_num_seqs)
    }
}
