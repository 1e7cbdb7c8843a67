//! `kestrel bench`: latency, throughput and speculation gains, several methods side by side.
//!
//! Serving-style closed loop: `concurrency` requests are kept in flight; each finished request
//! is replaced by the next prompt until `--num-prompts` have run. Metrics follow vLLM's
//! `bench serve`: TTFT, TPOT = (e2e - TTFT) / (output tokens - 1), ITL per streamed chunk.
//! The multiturn dataset runs conversations instead (see bench_multiturn.rs), each method
//! without and then with the prefix cache, and reports the time to first token per turn.

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
use kestrel::engine::{Engine, EngineConfig};
use kestrel::model::ModelFiles;
use std::collections::HashMap;
use std::path::PathBuf;

static HUMANEVAL: &str = include_str!("../../data/humaneval/prompts.jsonl");

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dataset {
    Humaneval,
    Random,
    /// Conversations growing turn by turn: each turn resends the history, the model's replies
    /// included, plus --turn-len new tokens; --num-prompts conversations of --turns turns.
    Multiturn,
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
    /// Turns per conversation of the multiturn dataset.
    #[arg(long, default_value_t = 8)]
    pub turns: usize,
    /// New user tokens per turn of the multiturn dataset (HumanEval text).
    #[arg(long, default_value_t = 256, value_name = "TOKENS")]
    pub turn_len: usize,
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
    /// Whether the prefix cache was on.
    pub prefix_cache: bool,
    /// Prompt tokens served from the prefix cache over all prompt tokens.
    pub cached_prompt_fraction: f64,
    /// Multiturn dataset, per turn: time to first token (ms), and the mean prompt tokens and
    /// mean of those served from the cache.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ttft_ms_by_turn: Vec<Summary>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prompt_tokens_by_turn: Vec<f64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cached_tokens_by_turn: Vec<f64>,
    /// CUDA graph capture sizes in rows (empty: no padding).
    pub capture_sizes: Vec<usize>,
    /// Rows run per real row over the steps at a capture size (1.0: no padding), and tokens
    /// per real token; `None` when no step was graphed.
    pub padded_rows_per_real: Option<f64>,
    pub padded_tokens_per_real: Option<f64>,
    /// Steps whose rows the back-off offered fewer than --spec-tokens drafts, per step (`None`
    /// without speculation).
    pub backed_off_fraction: Option<f64>,
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
        Dataset::Multiturn => unreachable!("the multiturn dataset is made of conversations (bench_multiturn::messages)"),
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
pub struct RequestShape {
    params: SamplingParams,
    logits: LogitsOptions,
    stop_token_ids: Vec<u32>,
    max_tokens: usize,
}

impl RequestShape {
    pub fn request(&self, prompt_ids: Vec<u32>) -> Request {
        Request { logits: self.logits.clone(), ..Request::new(prompt_ids, self.params.clone(), self.max_tokens, self.stop_token_ids.clone()) }
    }
}

/// What a run feeds the engine: single prompts, or conversations of several turns.
#[derive(Clone, Copy)]
enum Workload<'a> {
    Prompts(&'a [Vec<u32>]),
    Conversations(&'a [Vec<Vec<u32>>]),
}

impl Workload<'_> {
    fn requests(&self) -> usize {
        match self {
            Workload::Prompts(p) => p.len(),
            Workload::Conversations(c) => c.iter().map(Vec::len).sum(),
        }
    }
}

/// Every (concurrency, method, prefix cache) triple on one backend; the weights are uploaded
/// once. Conversations run without the prefix cache and then with it (unless
/// `--no-prefix-cache`); prompts run as the flags say. A run that fails (a concurrency whose
/// cache does not fit, say) ends the sweep: the results so far come back with the error.
fn run_all<B: Backend>(args: &BenchArgs, backend: B, files: &ModelFiles, workload: Workload<'_>, shape: &RequestShape) -> Result<(Vec<MethodResult>, Option<anyhow::Error>)> {
    let methods = &args.engine.spec.spec;
    let caches: &[bool] = match (workload, args.engine.context.no_prefix_cache) {
        (_, true) => &[false],
        (Workload::Conversations(_), false) => &[false, true],
        (Workload::Prompts(_), false) => &[true],
    };
    let most = args.concurrency.iter().copied().max().unwrap_or(1);
    let model = args.engine.load_model(&backend, files, most)?;
    let bar = progress_bar((methods.len() * args.concurrency.len() * caches.len() * workload.requests()) as u64, "bench");
    let mut parts = (backend, model);
    let mut results = Vec::new();
    for &c in &args.concurrency {
        for &m in methods {
            for &cache in caches {
                bar.set_message(format!("bench {} x{c}{}", m.name(), if cache { "" } else { " no cache" }));
                let (backend, model) = parts;
                let run = args
                    .engine
                    .engine_config(&backend, &model, files, c, m)
                    .map(|config| EngineConfig { prefix_cache_checkpoints: if cache { config.prefix_cache_checkpoints } else { 0 }, ..config })
                    .and_then(|config| Engine::new(backend, model, config).context("cannot start the engine"))
                    .inspect(|engine| {
                        if let Some(line) = super::capture_summary(engine) {
                            // (println on a hidden bar prints nothing: stderr is not a terminal)
                            bar.suspend(|| eprintln!("kestrel: {} x{c}: {line}", m.name()));
                        }
                    })
                    .and_then(|mut engine| Ok((run_one(&mut engine, workload, shape, m, c, &bar)?, engine)))
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
    }
    bar.finish_and_clear();
    Ok((results, None))
}

/// Each request's timeline and what the run produced.
struct Measured {
    timelines: Vec<RequestTimeline>,
    output_tokens: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    spec: SpecStats,
    duration: f64,
}

fn run_prompts<B: Backend>(engine: &mut Engine<B>, prompts: &[Vec<u32>], shape: &RequestShape, concurrency: usize, bar: &indicatif::ProgressBar) -> Result<Measured> {
    let clock = SecondsClock::start();
    let mut next = 0usize;
    let mut timelines: HashMap<u64, RequestTimeline> = HashMap::new();
    let mut m = Measured { timelines: Vec::new(), output_tokens: 0, prompt_tokens: 0, cached_tokens: 0, spec: SpecStats::default(), duration: 0.0 };
    while m.timelines.len() < prompts.len() {
        while next < prompts.len() && engine.num_running() + engine.num_waiting() < concurrency {
            let req = shape.request(prompts[next].clone());
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
                    m.output_tokens += output.generated.len();
                    m.prompt_tokens += output.prompt_tokens;
                    m.cached_tokens += output.cached_tokens;
                    m.spec.merge(&output.spec);
                    m.timelines.push(t);
                    bar.inc(1);
                }
                RequestEvent::Failed { error, .. } => bail!("generation failed: {error}"),
            }
        }
    }
    m.duration = clock.now();
    Ok(m)
}

fn run_one<B: Backend>(
    engine: &mut Engine<B>,
    workload: Workload<'_>,
    shape: &RequestShape,
    method: SpecMethod,
    concurrency: usize,
    bar: &indicatif::ProgressBar,
) -> Result<MethodResult> {
    let mean = |v: &[usize]| if v.is_empty() { 0.0 } else { v.iter().sum::<usize>() as f64 / v.len() as f64 };
    let (m, ttft_ms_by_turn, prompt_tokens_by_turn, cached_tokens_by_turn) = match workload {
        Workload::Prompts(prompts) => (run_prompts(engine, prompts, shape, concurrency, bar)?, Vec::new(), Vec::new(), Vec::new()),
        Workload::Conversations(messages) => {
            let r = super::bench_multiturn::run(engine, messages, shape, concurrency, bar)?;
            let measured = Measured {
                timelines: r.timelines,
                output_tokens: r.output_tokens,
                prompt_tokens: r.prompt_tokens_by_turn.iter().flatten().sum(),
                cached_tokens: r.cached_tokens_by_turn.iter().flatten().sum(),
                spec: r.spec,
                duration: r.duration,
            };
            let ttft = r.ttft_by_turn.iter().map(|t| ms(summarize(t))).collect();
            (measured, ttft, r.prompt_tokens_by_turn.iter().map(|p| mean(p)).collect(), r.cached_tokens_by_turn.iter().map(|c| mean(c)).collect())
        }
    };
    let done = &m.timelines;
    let ttft: Vec<f64> = done.iter().filter_map(|t| t.ttft()).collect();
    let tpot: Vec<f64> = done.iter().filter_map(|t| t.tpot()).collect();
    let itl: Vec<f64> = done.iter().flat_map(|t| t.itls()).collect();
    let k = engine.reported_k(method);
    Ok(MethodResult {
        method: method.name().to_string(),
        concurrency,
        num_requests: done.len(),
        duration_s: m.duration,
        output_tokens: m.output_tokens,
        ttft_ms: ms(summarize(&ttft)),
        tpot_ms: ms(summarize(&tpot)),
        itl_ms: ms(summarize(&itl)),
        output_tokens_per_s: m.output_tokens as f64 / m.duration,
        requests_per_s: done.len() as f64 / m.duration,
        speedup_vs_none: None,
        spec: m.spec.to_json(method.name(), k),
        prefix_cache: engine.prefix_cache_stats().is_some(),
        cached_prompt_fraction: if m.prompt_tokens == 0 { 0.0 } else { m.cached_tokens as f64 / m.prompt_tokens as f64 },
        ttft_ms_by_turn,
        prompt_tokens_by_turn,
        cached_tokens_by_turn,
        capture_sizes: engine.capture_sizes().sizes().to_vec(),
        padded_rows_per_real: engine.stats.padding.row_overhead(),
        padded_tokens_per_real: engine.stats.padding.token_overhead(),
        backed_off_fraction: (method != SpecMethod::None && engine.stats.steps > 0).then(|| engine.stats.backed_off_steps as f64 / engine.stats.steps as f64),
    })
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.num_prompts == 0 || args.max_tokens == 0 || args.concurrency.contains(&0) {
        bail!("--num-prompts, --max-tokens and every --concurrency must be at least 1");
    }
    let files = args.engine.open_model()?;
    // A benchmark samples as its flags say: the model's recommendation would change the workload.
    let params = args.sampling.params(&SamplingDefaults::default())?;
    let (prompts, conversations);
    let workload = if args.dataset == Dataset::Multiturn {
        conversations = super::bench_multiturn::messages(HUMANEVAL, &files.tokenizer, args.num_prompts, args.turns, args.turn_len)?;
        Workload::Conversations(&conversations)
    } else {
        prompts = dataset_prompts(&args, &files.tokenizer, files.config.vocab_size)?;
        Workload::Prompts(&prompts)
    };
    let shape = match &args.json_schema {
        None => RequestShape { params, logits: LogitsOptions::default(), stop_token_ids: Vec::new(), max_tokens: args.max_tokens },
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("--json-schema: cannot read {}", path.display()))?;
            let schema = serde_json::from_str(&text).with_context(|| format!("--json-schema: {} is not JSON", path.display()))?;
            // Dummy weights have no stop tokens (their requests run to max_tokens); their grammar
            // ends at those of the tokenizer they borrow, where the schema's value is complete.
            let ends = if files.config.eos_token_ids.is_empty() { files.tokenizer.eos_token_ids() } else { files.config.eos_token_ids.clone() };
            let compiler = GrammarCompiler::new(&files.tokenizer, files.config.vocab_size, &ends).context("--json-schema needs the model's vocabulary")?;
            let grammar = compiler.compile(&GrammarSpec::JsonSchema(schema), &ends).context("--json-schema: cannot compile")?;
            RequestShape { params, logits: LogitsOptions { grammar: Some(grammar), ..LogitsOptions::default() }, stop_token_ids: ends, max_tokens: args.max_tokens }
        }
    };
    let (mut results, failure) = match args.engine.device.select_backend()? {
        SelectedBackend::Cpu(b) => run_all(&args, b, &files, workload, &shape)?,
        SelectedBackend::Cuda(b) => run_all(&args, *b, &files, workload, &shape)?,
    };
    if results.is_empty() {
        if let Some(e) = failure {
            return Err(e);
        }
    }
    for i in 0..results.len() {
        let r = &results[i];
        let base = results.iter().find(|b| b.method == "none" && b.concurrency == r.concurrency && b.prefix_cache == r.prefix_cache).map(|b| b.output_tokens_per_s);
        results[i].speedup_vs_none = base.map(|b| results[i].output_tokens_per_s / b);
    }
    print_results(&args, &results)?;
    // Results are printed first: a sweep that stopped early or plots that cannot be drawn still
    // leave every measured figure on stdout. The plots show the runs with the prefix cache as
    // the flags set it.
    if let Some(dir) = &args.plot_dir {
        let cache = !args.engine.context.no_prefix_cache;
        let plotted: Vec<MethodResult> = results.iter().filter(|r| r.prefix_cache == cache).cloned().collect();
        super::bench_plot::write_plots(dir, &plotted)?;
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
        "{:<6} {:>5} {:>4} {:>9} {:>9} {:>9} {:>10} {:>8} {:>7} {:>7} {:>7} {:>8} {:>6} {:>6} {:>8}",
        "method", "cache", "conc", "ttft ms", "tpot ms", "itl ms", "out tok/s", "req/s", "accept", "mal", "tok/fwd", "speedup", "pad r", "pad t", "backoff"
    );
    let overhead = |x: Option<f64>| x.map(|x| format!("{x:.2}x")).unwrap_or_else(|| "-".into());
    for r in results {
        let s = &r.spec;
        println!(
            "{:<6} {:>5} {:>4} {:>9.1} {:>9.2} {:>9.2} {:>10.1} {:>8.2} {:>7.3} {:>7.2} {:>7.2} {:>8} {:>6} {:>6} {:>8}",
            r.method,
            if r.prefix_cache { "on" } else { "off" },
            r.concurrency,
            r.ttft_ms.median,
            r.tpot_ms.median,
            r.itl_ms.median,
            r.output_tokens_per_s,
            r.requests_per_s,
            s["acceptance_rate"].as_f64().unwrap_or(0.0),
            s["mean_acceptance_length"].as_f64().unwrap_or(0.0),
            s["tokens_per_forward"].as_f64().unwrap_or(0.0),
            r.speedup_vs_none.map(|x| format!("{x:.2}x")).unwrap_or_else(|| "-".into()),
            overhead(r.padded_rows_per_real),
            overhead(r.padded_tokens_per_real),
            r.backed_off_fraction.map(|x| format!("{:.0}%", 100.0 * x)).unwrap_or_else(|| "-".into())
        );
    }
    // Padding: rows (tokens) run per real row (token) of the graphed steps.
    let mut sizes: Vec<&Vec<usize>> = results.iter().map(|r| &r.capture_sizes).filter(|s| !s.is_empty()).collect();
    sizes.dedup();
    for s in sizes {
        let list: Vec<String> = s.iter().map(|x| x.to_string()).collect();
        println!("CUDA graph capture sizes: {} (pad r / pad t: rows / tokens run per real one in graphed steps)", list.join(","));
    }
    print_turns(results);
    Ok(())
}

/// Multiturn runs: the median time to first token of each turn, without and with the prefix
/// cache side by side.
fn print_turns(results: &[MethodResult]) {
    for r in results.iter().filter(|r| r.prefix_cache && !r.ttft_ms_by_turn.is_empty()) {
        let off = results.iter().find(|o| !o.prefix_cache && o.method == r.method && o.concurrency == r.concurrency);
        println!("\n{} x{}: time to first token per turn (median ms)", r.method, r.concurrency);
        println!("{:>4} {:>8} {:>8} {:>10} {:>10} {:>8}", "turn", "prompt", "cached", "no cache", "cache", "gain");
        for (t, on) in r.ttft_ms_by_turn.iter().enumerate() {
            let without = off.and_then(|o| o.ttft_ms_by_turn.get(t)).map(|s| s.median);
            println!(
                "{:>4} {:>8.0} {:>8.0} {:>10} {:>10.1} {:>8}",
                t + 1,
                r.prompt_tokens_by_turn[t],
                r.cached_tokens_by_turn[t],
                without.map_or("-".to_string(), |w| format!("{w:.1}")),
                on.median,
                without.map_or("-".to_string(), |w| format!("{:.2}x", w / on.median))
            );
        }
    }
}
