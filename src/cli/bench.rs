//! `kestrel bench`: latency, throughput and speculation gains, several methods side by side.
//!
//! Serving-style closed loop: `concurrency` requests are kept in flight; each finished request
//! is replaced by the next prompt until `--num-prompts` have run. Metrics follow vLLM's
//! `bench serve`: TTFT, TPOT = (e2e - TTFT) / (output tokens - 1), ITL per streamed chunk.

use super::flags::{SamplingArgs, SelectedBackend};
use super::{progress_bar, EngineArgs};
use kestrel::backend::sampling::SamplingParams;
use kestrel::model::generation_config::SamplingDefaults;
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kestrel::engine::metrics::{summarize, RequestTimeline, SecondsClock, SpecStats, Summary};
use kestrel::backend::Backend;
use kestrel::engine::logits::grammar::{GrammarCompiler, GrammarSpec};
use kestrel::engine::logits::LogitsOptions;
use kestrel::engine::request::{Request, RequestEvent, SpecMethod};
use kestrel::engine::Engine;
use kestrel::model::ModelFiles;
use std::collections::HashMap;
use std::path::PathBuf;

static HUMANEVAL: &str = include_str!("../../data/humaneval/prompts.jsonl");

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dataset {
    Humaneval,
    Random,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Prompts: HumanEval's (code the default model knows) or random token ids.
    #[arg(long, value_enum, default_value = "humaneval")]
    pub dataset: Dataset,
    /// Requests per method and concurrency.
    #[arg(long, default_value_t = 32)]
    pub num_prompts: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Prompt length of the random dataset.
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Requests kept in flight; a list sweeps them.
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub concurrency: Vec<usize>,
    /// Print one JSON object per method and concurrency.
    #[arg(long)]
    pub json: bool,
    /// Write PNG plots (per-position acceptance, throughput against concurrency) here.
    #[arg(long)]
    pub plot_dir: Option<PathBuf>,
    /// Hold every output to the JSON schema in FILE (to measure what the grammar costs; requests
    /// end at the model's end-of-sequence token once the value is complete).
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<PathBuf>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// Results of one method at one concurrency.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MethodResult {
    pub method: String,
    pub concurrency: usize,
    pub num_requests: usize,
    pub duration_s: f64,
    pub output_tokens: usize,
    pub ttft_ms: Summary,
    pub tpot_ms: Summary,
    pub itl_ms: Summary,
    pub output_tokens_per_s: f64,
    pub requests_per_s: f64,
    pub speedup_vs_none: Option<f64>,
    pub spec: serde_json::Value,
}

fn dataset_prompts(args: &BenchArgs, tok: &kestrel::tokenizer::Tokenizer, vocab: usize) -> Result<Vec<Vec<u32>>> {
    match args.dataset {
        Dataset::Humaneval => {
            let mut out = Vec::new();
            for line in HUMANEVAL.lines().take(args.num_prompts) {
                let v: serde_json::Value = serde_json::from_str(line).context("embedded HumanEval data")?;
                let prompt = v["prompt"].as_str().context("HumanEval line without prompt")?;
                out.push(tok.encode(prompt, false)?);
            }
            if out.len() < args.num_prompts {
                bail!("HumanEval has {} prompts; asked for {}", out.len(), args.num_prompts);
            }
            Ok(out)
        }
        Dataset::Random => {
            let mut state = 0x2545f4914f6cdd1du64;
            Ok((0..args.num_prompts)
                .map(|_| {
                    (0..args.input_len)
                        .map(|_| {
                            state ^= state << 13;
                            state ^= state >> 7;
                            state ^= state << 17;
                            (state % vocab as u64) as u32
                        })
                        .collect()
                })
                .collect())
        }
    }
}

fn ms(s: Summary) -> Summary {
    Summary { mean: s.mean * 1e3, median: s.median * 1e3, p99: s.p99 * 1e3 }
}

/// What every request of a run asks for besides its prompt.
struct RequestShape {
    params: SamplingParams,
    logits: LogitsOptions,
    stop_token_ids: Vec<u32>,
}

/// Every (concurrency, method) pair on one backend; the weights are uploaded once. A run that
/// fails (a concurrency whose cache does not fit, say) ends the sweep: the results so far come
/// back with the error.
fn run_all<B: Backend>(args: &BenchArgs, backend: B, files: &ModelFiles, prompts: &[Vec<u32>], shape: &RequestShape) -> Result<(Vec<MethodResult>, Option<anyhow::Error>)> {
    let methods = &args.engine.spec.spec;
    let most = args.concurrency.iter().copied().max().unwrap_or(1);
    let model = args.engine.load_model(&backend, files, most)?;
    let bar = progress_bar((methods.len() * args.concurrency.len() * prompts.len()) as u64, "bench");
    let mut parts = (backend, model);
    let mut results = Vec::new();
    for &c in &args.concurrency {
        for &m in methods {
            bar.set_message(format!("bench {} x{c}", m.name()));
            let (backend, model) = parts;
            let run = args
                .engine
                .engine_config(&backend, &model, files, c, m)
                .and_then(|config| Engine::new(backend, model, config).context("cannot start the engine"))
                .and_then(|mut engine| Ok((run_one(args, &mut engine, prompts, shape, m, c, &bar)?, engine)))
                .with_context(|| format!("{} at concurrency {c}", m.name()));
            match run {
                Ok((result, engine)) => {
                    results.push(result);
                    parts = engine.into_parts();
                }
                Err(e) => {
                    bar.finish_and_clear();
                    return Ok((results, Some(e)));
                }
            }
        }
    }
    bar.finish_and_clear();
    Ok((results, None))
}

#[allow(clippy::too_many_arguments)]
fn run_one<B: Backend>(
    args: &BenchArgs,
    engine: &mut Engine<B>,
    prompts: &[Vec<u32>],
    shape: &RequestShape,
    method: SpecMethod,
    concurrency: usize,
    bar: &indicatif::ProgressBar,
) -> Result<MethodResult> {
    let clock = SecondsClock::start();
    let mut next = 0usize;
    let mut timelines: HashMap<u64, RequestTimeline> = HashMap::new();
    let mut done: Vec<RequestTimeline> = Vec::new();
    let mut spec = SpecStats::default();
    let mut output_tokens = 0usize;
    while done.len() < prompts.len() {
        while next < prompts.len() && engine.num_running() + engine.num_waiting() < concurrency {
            let req = Request { logits: shape.logits.clone(), ..Request::new(prompts[next].clone(), shape.params.clone(), args.max_tokens, shape.stop_token_ids.clone()) };
            let id = engine.add_request(req).with_context(|| format!("prompt {next}"))?;
            timelines.insert(id, RequestTimeline::new(clock.now())?);
            next += 1;
        }
        for event in engine.step() {
            let now = clock.now();
            match event {
                RequestEvent::Tokens { id, tokens, .. } => {
                    if let Some(t) = timelines.get_mut(&id) {
                        t.record_chunk(now, tokens.len())?;
                    }
                }
                RequestEvent::Finished { id, output, .. } => {
                    let mut t = timelines.remove(&id).context("finished request without a timeline")?;
                    t.finish(now)?;
                    output_tokens += output.generated.len();
                    spec.merge(&output.spec);
                    done.push(t);
                    bar.inc(1);
                }
                RequestEvent::Failed { error, .. } => bail!("generation failed: {error}"),
            }
        }
    }
    let duration = clock.now();
    let ttft: Vec<f64> = done.iter().filter_map(|t| t.ttft()).collect();
    let tpot: Vec<f64> = done.iter().filter_map(|t| t.tpot()).collect();
    let itl: Vec<f64> = done.iter().flat_map(|t| t.itls()).collect();
    let k = engine.reported_k(method);
    Ok(MethodResult {
        method: method.name().to_string(),
        concurrency,
        num_requests: done.len(),
        duration_s: duration,
        output_tokens,
        ttft_ms: ms(summarize(&ttft)),
        tpot_ms: ms(summarize(&tpot)),
        itl_ms: ms(summarize(&itl)),
        output_tokens_per_s: output_tokens as f64 / duration,
        requests_per_s: done.len() as f64 / duration,
        speedup_vs_none: None,
        spec: spec.to_json(method.name(), k),
    })
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.num_prompts == 0 || args.max_tokens == 0 || args.concurrency.contains(&0) {
        bail!("--num-prompts, --max-tokens and every --concurrency must be at least 1");
    }
    let files = args.engine.open_model()?;
    // A benchmark samples as its flags say: the model's recommendation would change the workload.
    let params = args.sampling.params(&SamplingDefaults::default())?;
    let prompts = dataset_prompts(&args, &files.tokenizer, files.config.vocab_size)?;
    let shape = match &args.json_schema {
        None => RequestShape { params, logits: LogitsOptions::default(), stop_token_ids: Vec::new() },
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("--json-schema: cannot read {}", path.display()))?;
            let schema = serde_json::from_str(&text).with_context(|| format!("--json-schema: {} is not JSON", path.display()))?;
            let ends = files.config.eos_token_ids.clone();
            let compiler = GrammarCompiler::new(&files.tokenizer, files.config.vocab_size, &ends).context("cannot build the token table for grammars")?;
            let grammar = compiler.compile(&GrammarSpec::JsonSchema(schema), &ends).context("--json-schema: cannot compile")?;
            RequestShape { params, logits: LogitsOptions { grammar: Some(grammar), ..LogitsOptions::default() }, stop_token_ids: ends }
        }
    };
    let (mut results, failure) = match args.engine.device.select_backend()? {
        SelectedBackend::Cpu(b) => run_all(&args, b, &files, &prompts, &shape)?,
        SelectedBackend::Cuda(b) => run_all(&args, *b, &files, &prompts, &shape)?,
    };
    if results.is_empty() {
        if let Some(e) = failure {
            return Err(e);
        }
    }
    for i in 0..results.len() {
        let base = results.iter().find(|r| r.method == "none" && r.concurrency == results[i].concurrency).map(|r| r.output_tokens_per_s);
        results[i].speedup_vs_none = base.map(|b| results[i].output_tokens_per_s / b);
    }
    print_results(&args, &results)?;
    // Results are printed first: a sweep that stopped early or plots that cannot be drawn still
    // leave every measured figure on stdout.
    if let Some(dir) = &args.plot_dir {
        super::bench_plot::write_plots(dir, &results)?;
    }
    match failure {
        Some(e) => Err(e.context("the sweep stopped early; the results above are complete runs")),
        None => Ok(()),
    }
}

fn print_results(args: &BenchArgs, results: &[MethodResult]) -> Result<()> {
    if args.json {
        for r in results {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    println!(
        "{:<6} {:>4} {:>9} {:>9} {:>9} {:>10} {:>8} {:>7} {:>7} {:>7} {:>8}",
        "method", "conc", "ttft ms", "tpot ms", "itl ms", "out tok/s", "req/s", "accept", "mal", "tok/fwd", "speedup"
    );
    for r in results {
        let s = &r.spec;
        println!(
            "{:<6} {:>4} {:>9.1} {:>9.2} {:>9.2} {:>10.1} {:>8.2} {:>7.3} {:>7.2} {:>7.2} {:>8}",
            r.method,
            r.concurrency,
            r.ttft_ms.median,
            r.tpot_ms.median,
            r.itl_ms.median,
            r.output_tokens_per_s,
            r.requests_per_s,
            s["acceptance_rate"].as_f64().unwrap_or(0.0),
            s["mean_acceptance_length"].as_f64().unwrap_or(0.0),
            s["tokens_per_forward"].as_f64().unwrap_or(0.0),
            r.speedup_vs_none.map(|x| format!("{x:.2}x")).unwrap_or_else(|| "-".into())
        );
    }
    Ok(())
}
