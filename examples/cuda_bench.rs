//! GPU benchmark on dummy (random, device-generated) weights at real model sizes:
//! batch-1 decode tokens/s and its fraction of the HBM roofline (weight bytes read per token
//! over the bandwidth measured in the same run, both by a copy kernel and by a read-only kernel),
//! and prefill tokens/s.
//!
//! `cargo run --release --example cuda_bench -- [--presets a,b] [--prompt N] [--decode N] [--prefill N,M] [--kv-cache-dtype bf16|fp8|tq3|f32] [--no-matmul-kernels] [--decode-rows R [--all-rows-at-prompt]]`
//! Prints one JSON object per preset, then a table.

use kestrel::backend::cuda::CudaBackend;
use kestrel::model::dummy;
use kestrel::backend::{Backend, BatchLayout, CacheSpec, KvDtype, RowKind, RowLayout};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::config::ModelConfig;
use std::time::Instant;

struct Options {
    /// `--matmul-only N,K`: only run a 1-row matmul on an N x K weight a few times (for a profiler).
    matmul_only: Option<(usize, usize)>,
    presets: Vec<String>,
    prompt: usize,
    decode: usize,
    /// Generate rows per decode step (row 0 follows the prompt; the others start empty).
    decode_rows: usize,
    /// `--all-rows-at-prompt`: the rows after the first decode at the prompt's position too,
    /// over their own blocks as the cache holds them (zeros: attention reads the same bytes as
    /// over a real prompt, for the price of one prompt's prefill).
    all_rows_at_prompt: bool,
    prefill: Vec<usize>,
    /// `--profile-step N`: bracket decode step N with cuProfilerStart/Stop, so that
    /// `ncu --profile-from-start off` or `nsys -c cudaProfilerApi` records that step only.
    profile_step: Option<usize>,
    /// `--no-matmul-kernels`: skip the per-shape matmul timings after each preset.
    matmul_kernels: bool,
    /// How the KV cache stores keys and values.
    kv_dtype: KvDtype,
}

fn parse_args() -> Result<Options, String> {
    let mut o = Options { matmul_only: None, presets: vec!["qwen3.5-9b".into(), "qwen3.5-35b-a3b".into()], prompt: 512, decode: 64, decode_rows: 1, all_rows_at_prompt: false, prefill: vec![512, 4096], profile_step: None, matmul_kernels: true, kv_dtype: KvDtype::default() };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--matmul-only" => {
                let v: Vec<usize> = value()?.split(',').map(|x| x.parse().map_err(|e| format!("--matmul-only: {e}"))).collect::<Result<_, _>>()?;
                match v.as_slice() {
                    [n, k] => o.matmul_only = Some((*n, *k)),
                    _ => return Err("--matmul-only takes N,K".into()),
                }
            }
            "--presets" => o.presets = value()?.split(',').map(str::to_string).collect(),
            "--prompt" => o.prompt = value()?.parse().map_err(|e| format!("--prompt: {e}"))?,
            "--decode" => o.decode = value()?.parse().map_err(|e| format!("--decode: {e}"))?,
            "--decode-rows" => o.decode_rows = value()?.parse::<usize>().map_err(|e| format!("--decode-rows: {e}"))?.max(1),
            "--prefill" => o.prefill = value()?.split(',').map(|s| s.parse().map_err(|e| format!("--prefill: {e}"))).collect::<Result<_, _>>()?,
            "--no-matmul-kernels" => o.matmul_kernels = false,
            "--all-rows-at-prompt" => o.all_rows_at_prompt = true,
            "--kv-cache-dtype" => {
                let name = value()?;
                o.kv_dtype = KvDtype::ALL.into_iter().find(|d| d.name() == name).ok_or(format!("--kv-cache-dtype: unknown format {name}"))?;
            }
            "--profile-step" => o.profile_step = Some(value()?.parse().map_err(|e| format!("--profile-step: {e}"))?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(o)
}

/// Weight bytes one decode step reads: every matrix once, except the embedding table (one row)
/// and the experts a token is not routed to.
fn bytes_per_token(c: &ModelConfig, uploaded: usize) -> f64 {
    let embed = c.vocab_size * c.hidden_size * 2;
    let mut bytes = uploaded as f64;
    if !c.tie_word_embeddings {
        bytes -= embed as f64;
    }
    if let Some(m) = &c.moe {
        let expert = 3 * m.expert_intermediate * c.hidden_size * 2;
        let layers = c.moe_layers.iter().filter(|x| **x).count();
        bytes -= (layers * (m.num_experts - m.top_k) * expert) as f64;
    }
    bytes
}

fn prefill_row(n: usize, start: usize, blocks: usize) -> BatchLayout {
    BatchLayout { rows: vec![RowLayout { kind: RowKind::Prefill, token_start: 0, num_tokens: n, start_position: start, block_table: (0..blocks as u32).collect(), state_slot: 0, snapshot_base: 0 }] }
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32
}

fn profile_json(report: &[(&'static str, f64, usize)], divide: usize) -> serde_json::Value {
    let d = divide.max(1) as f64;
    serde_json::Value::Object(report.iter().map(|(name, ms, n)| (name.to_string(), serde_json::json!({"ms": ms / d, "calls": *n as f64 / d}))).collect())
}

/// Microseconds from `from` to `to` (device ns), or NaN where a kernel left either mark unset.
fn mark_us(from: u64, to: u64) -> f64 {
    if from == 0 || to == 0 {
        f64::NAN
    } else {
        to.saturating_sub(from) as f64 / 1e3
    }
}

/// One kernel grid's totals over a traced step: share of the step, time resident before its
/// inputs were ready, and (kernels that mark them) inputs-ready to block 0's first weights and
/// to its last block's end, and that end to the next kernel's inputs-ready.
#[derive(Default)]
struct TraceTotals {
    share: f64,
    early: f64,
    first_data: f64,
    run: f64,
    handoff: f64,
    calls: usize,
}

/// The last decode step's kernel start trace (`KESTREL_CUDA_TRACE=1`): per kernel and grid,
/// the time from its inputs being ready to the next kernel's (its share of the step when
/// kernels overlap), how long before that it was resident, and where marked, how that share
/// splits into running and handing over to the next kernel; largest share first.
fn trace_summary(kernels: &[kestrel::backend::cuda::TracedKernel]) -> serde_json::Value {
    if kernels.len() < 2 {
        return serde_json::Value::Null;
    }
    let mut by_kernel: Vec<(String, TraceTotals)> = Vec::new();
    for w in kernels.windows(2) {
        let (k, next) = (&w[0], &w[1]);
        let key = format!("{} {:?}", k.name, k.grid);
        let i = match by_kernel.iter().position(|e| e.0 == key) {
            Some(i) => i,
            None => {
                by_kernel.push((key, TraceTotals::default()));
                by_kernel.len() - 1
            }
        };
        let e = &mut by_kernel[i].1;
        e.share += next.ready_ns.saturating_sub(k.ready_ns) as f64 / 1e3;
        e.early += k.ready_ns.saturating_sub(k.resident_ns) as f64 / 1e3;
        e.first_data += mark_us(k.ready_ns, k.first_data_ns);
        e.run += mark_us(k.ready_ns, k.end_ns);
        e.handoff += mark_us(k.end_ns, next.ready_ns);
        e.calls += 1;
    }
    by_kernel.sort_by(|a, b| b.1.share.total_cmp(&a.1.share));
    let span = (kernels[kernels.len() - 1].ready_ns - kernels[0].ready_ns) as f64 / 1e3;
    // The launches of the step's middle stretch in order (a layer or two), to see one layer's chain.
    let mid = kernels.len() / 2;
    let sequence: Vec<String> = kernels
        .windows(2)
        .skip(mid)
        .take(24)
        .map(|w| {
            let (k, next) = (&w[0], &w[1]);
            format!(
                "{:>7.1} us (resident {:>5.1} us early; group {:>5.1}, rows {:>5.1}, first weights {:>5.1}, end {:>5.1}, handoff {:>5.1}) {} {:?}",
                next.ready_ns.saturating_sub(k.ready_ns) as f64 / 1e3,
                k.ready_ns.saturating_sub(k.resident_ns) as f64 / 1e3,
                mark_us(k.ready_ns, k.group_known_ns),
                mark_us(k.ready_ns, k.rows_ready_ns),
                mark_us(k.ready_ns, k.first_data_ns),
                mark_us(k.ready_ns, k.end_ns),
                mark_us(k.end_ns, next.ready_ns),
                k.name,
                k.grid
            )
        })
        .collect();
    serde_json::json!({
        "sequence": sequence,
        "kernels": kernels.len(),
        "first_to_last_start_us": span,
        "by_kernel": by_kernel
            .iter()
            .map(|(k, e)| {
                let n = e.calls as f64;
                // NaN (unmarked kernels) becomes null in the JSON.
                serde_json::json!({"kernel": k, "us": e.share, "calls": e.calls, "resident_early_us": e.early / n, "first_data_us": e.first_data / n, "run_us": e.run / n, "handoff_us": e.handoff / n})
            })
            .collect::<Vec<_>>(),
    })
}

/// Median seconds of `f` over `reps` runs after one warm-up.
fn time_median(gpu: &CudaBackend, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    gpu.synchronize();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            gpu.synchronize();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.total_cmp(b));
    t[t.len() / 2]
}

/// The matmul kernels alone on this model's shapes: weight bandwidth at 1 row (GB/s of
/// weight bytes) and tensor throughput at 4096 rows (TFLOP/s, 2*rows*N*K).
fn matmul_microbench(gpu: &CudaBackend, c: &ModelConfig) -> serde_json::Value {
    let h = c.hidden_size;
    let inter = if c.intermediate_size > 0 { c.intermediate_size } else { 4 * h };
    let mut out = serde_json::Map::new();
    // gate_up: the fused gate and up projection a layer runs (2 * inter outputs).
    for (name, n, k) in [("up", inter, h), ("gate_up", 2 * inter, h), ("down", h, inter), ("lm_head", c.vocab_size, h)] {
        let weight = match random_weight(gpu, n, k) {
            Ok(w) => w,
            Err(e) => {
                out.insert(name.into(), serde_json::json!({"error": e}));
                continue;
            }
        };
        let mut entry = serde_json::Map::new();
        for rows in [1usize, 8, 16, 17, 32, 33, 64, 65, 4096] {
            if rows * n > 1 << 30 {
                continue;
            }
            let x = gpu.from_host(&vec![0.5f32; rows * k], rows, k);
            let s = time_median(gpu, 5, || {
                let _ = gpu.matmul(&x, &weight);
            });
            let key = format!("rows_{rows}");
            entry.insert(key, serde_json::json!({"ms": s * 1e3, "weight_GB_per_s": (n * k * 2) as f64 / s / 1e9, "TFLOP_per_s": 2.0 * (rows * n * k) as f64 / s / 1e12}));
        }
        out.insert(format!("{name} {n}x{k}"), serde_json::Value::Object(entry));
    }
    serde_json::Value::Object(out)
}

fn random_weight(gpu: &CudaBackend, n: usize, k: usize) -> Result<kestrel::backend::cuda::CudaMatrix, String> {
    // Shape-only bytes: in random mode the backend fills the matrix on the device.
    let placeholder = memmap2::MmapOptions::new().len(n * k * 2).map_anon().map_err(|e| e.to_string())?.make_read_only().map_err(|e| e.to_string())?;
    let m = kestrel::model::weights::MatrixBytes { data: kestrel::model::weights::SharedBytes::from_mmap(placeholder), start: 0, dtype: kestrel::model::weights::Dtype::BF16, rows: n, cols: k };
    gpu.set_random_weights(Some(77)).map_err(|e| e.to_string())?;
    let w = gpu.upload_matrix(&m).map_err(|e| e.to_string());
    gpu.set_random_weights(None).map_err(|e| e.to_string())?;
    w
}

/// Device memory bandwidth measured in the run (bytes per second).
struct Bandwidth {
    /// (read + written) / time of a copy kernel.
    copy: f64,
    /// read / time of a read-only kernel.
    read: f64,
}

fn run_preset(gpu: &CudaBackend, preset: &str, o: &Options, bandwidth: &Bandwidth) -> Result<serde_json::Value, String> {
    let before = gpu.uploaded_bytes();
    let t0 = Instant::now();
    let model: Qwen35<CudaBackend> = dummy::load_dummy(gpu, preset, 1234, &indicatif::ProgressBar::hidden()).map_err(|e| e.to_string())?;
    gpu.synchronize();
    let load_s = t0.elapsed().as_secs_f64();
    let c = model.config.clone();
    let uploaded = gpu.uploaded_bytes() - before;
    let per_token = bytes_per_token(&c, uploaded);
    let max_len = o.prefill.iter().copied().max().unwrap_or(0).max(o.prompt + o.decode + 1);
    let blocks = max_len.div_ceil(16) + 1;
    let nrows = o.decode_rows;
    let mut cache = gpu.alloc_cache(&CacheSpec { kv_dtype: o.kv_dtype, ..model.cache_spec(blocks * nrows, 16, nrows, nrows) }).map_err(|e| e.to_string())?;
    let vocab = c.vocab_size as u32;
    let ids = |n: usize, salt: u32| -> Vec<u32> { (0..n as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(salt)) % vocab).collect() };

    // Prefill: warm-up once at each size, then the median of three timed runs.
    let mut prefill = serde_json::Map::new();
    let mut profiles = serde_json::Map::new();
    for &n in &o.prefill {
        let mut times = Vec::new();
        for rep in 0..4 {
            gpu.reset_states(&mut cache, &[0]);
            let prompt = ids(n, rep);
            gpu.synchronize();
            let t = Instant::now();
            let out = model.forward(gpu, &prompt, &prefill_row(n, 0, blocks), &[n as u32 - 1], &mut cache);
            let _ = gpu.to_host(&out.logits);
            if rep > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        // Split of one more prefill's device time between ops (KESTREL_CUDA_PROFILE=1 only).
        gpu.profile_report();
        gpu.reset_states(&mut cache, &[0]);
        let _ = gpu.to_host(&model.forward(gpu, &ids(n, 7), &prefill_row(n, 0, blocks), &[n as u32 - 1], &mut cache).logits);
        profiles.insert(format!("prefill_{n}"), profile_json(&gpu.profile_report(), 1));
        times.sort_by(|a, b| a.total_cmp(b));
        let s = times[times.len() / 2];
        prefill.insert(n.to_string(), serde_json::json!({"seconds": s, "tokens_per_s": n as f64 / s}));
    }

    // Decode at batch 1 after a prompt: one generate row per step, its state committed.
    gpu.reset_states(&mut cache, &[0]);
    let prompt = ids(o.prompt, 99);
    let out = model.forward(gpu, &prompt, &prefill_row(o.prompt, 0, blocks), &[o.prompt as u32 - 1], &mut cache);
    let mut next = argmax(&gpu.to_host(&out.logits));
    let mut step_times = Vec::with_capacity(o.decode);
    // Host time to enqueue a step (before waiting for its logits): near the step time means
    // the host's launches, not the GPU, set the pace.
    let mut enqueue_times = Vec::with_capacity(o.decode);
    gpu.profile_report();
    let mut launches_per_step = 0;
    // Host time in launches and allocations over the steady steps (KESTREL_CUDA_HOST_PROFILE=1).
    let mut host = kestrel::backend::cuda::HostTiming::default();
    let mut trace = serde_json::Value::Null;
    let greedy_rows: Vec<kestrel::backend::RowSampling> = (0..nrows).map(|r| kestrel::backend::RowSampling { params: kestrel::backend::sampling::SamplingParams::greedy(), position: r as u64, allowed: None }).collect();
    for i in 0..o.decode {
        let rows = (0..nrows)
            .map(|r| RowLayout {
                kind: RowKind::Generate,
                token_start: r,
                num_tokens: 1,
                start_position: if r == 0 || o.all_rows_at_prompt { o.prompt + i } else { i },
                block_table: (r * blocks..(r + 1) * blocks).map(|b| b as u32).collect(),
                state_slot: r,
                snapshot_base: r,
            })
            .collect();
        let layout = BatchLayout { rows };
        let step_ids: Vec<u32> = std::iter::once(next).chain(ids(nrows - 1, i as u32)).collect();
        let logit_rows: Vec<u32> = (0..nrows as u32).collect();
        // Decode rows of one token: their delta-rule state is written in place, the conv window
        // comes from the snapshot (as the engine commits them).
        let commits: Vec<kestrel::backend::StateCommit> = layout.rows.iter().map(|row| kestrel::backend::StateCommit { slot: row.state_slot, snapshot: row.snapshot_base, conv_only: kestrel::backend::delta_state_in_place(row.kind, row.num_tokens) }).collect();
        let profiled = o.profile_step == Some(i);
        if profiled {
            gpu.synchronize();
            cudarc::driver::profiler_start().map_err(|e| format!("cuProfilerStart: {e:?}"))?;
        }
        let traced = i + 1 == o.decode;
        if traced {
            gpu.take_trace();
        }
        gpu.take_host_timing();
        let (t, launched) = (Instant::now(), gpu.launch_count());
        let out = model.forward(gpu, &step_ids, &layout, &logit_rows, &mut cache);
        gpu.commit_states(&mut cache, &commits);
        enqueue_times.push(t.elapsed().as_secs_f64());
        if i >= 4 {
            let step = gpu.take_host_timing();
            host.launch_s += step.launch_s;
            host.alloc_s += step.alloc_s;
            host.allocs += step.allocs;
        }
        launches_per_step = gpu.launch_count() - launched;
        // Sampled on the device, as the engine does: only the token comes back.
        next = gpu.sample_rows(&out.logits, &greedy_rows)[0];
        if profiled {
            cudarc::driver::profiler_stop().map_err(|e| format!("cuProfilerStop: {e:?}"))?;
        }
        step_times.push(t.elapsed().as_secs_f64());
        if traced {
            trace = trace_summary(&gpu.take_trace());
        }
    }
    profiles.insert("decode_per_token".into(), profile_json(&gpu.profile_report(), o.decode));
    // The first steps include one-time costs (memory pool growth); report the steady state.
    let steady = &step_times[step_times.len().min(4)..];
    let mean = steady.iter().sum::<f64>() / steady.len().max(1) as f64;
    let roofline_s = per_token / bandwidth.copy;
    let read_roofline_s = per_token / bandwidth.read;
    Ok(serde_json::json!({
        "preset": preset,
        "load_seconds": load_s,
        "weight_bytes_on_device": uploaded,
        "weight_bytes_per_token": per_token,
        "copy_bandwidth_bytes_per_s": bandwidth.copy,
        "read_bandwidth_bytes_per_s": bandwidth.read,
        "decode": {
            "prompt_tokens": o.prompt,
            "kv_cache_dtype": o.kv_dtype.name(),
            "rows": nrows,
            "steps": steady.len(),
            "ms_per_token": mean * 1e3,
            "tokens_per_s": nrows as f64 / mean,
            "roofline_ms_per_token": roofline_s * 1e3,
            "fraction_of_roofline": roofline_s / mean,
            "read_roofline_ms_per_token": read_roofline_s * 1e3,
            "fraction_of_read_roofline": read_roofline_s / mean,
            "kernel_launches_per_step": launches_per_step,
            "host_enqueue_ms_per_token": enqueue_times[enqueue_times.len().min(4)..].iter().sum::<f64>() / steady.len().max(1) as f64 * 1e3,
            "host_launch_ms_per_token": host.launch_s / steady.len().max(1) as f64 * 1e3,
            "host_alloc_ms_per_token": host.alloc_s / steady.len().max(1) as f64 * 1e3,
            "allocations_per_step": host.allocs as f64 / steady.len().max(1) as f64,
        },
        "prefill": prefill,
        "device_ms_by_op": profiles,
        "last_step_trace": trace,
        "matmul_kernels": if o.matmul_kernels { matmul_microbench(gpu, &c) } else { serde_json::Value::Null },
    }))
}

fn main() {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("cuda_bench: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = kestrel::backend::cuda::probe() {
        eprintln!("cuda_bench: {e}");
        std::process::exit(1);
    }
    let gpu = match CudaBackend::new(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("cuda_bench: {e}");
            std::process::exit(1);
        }
    };
    if let Some((n, k)) = o.matmul_only {
        let w = match random_weight(&gpu, n, k) {
            Ok(w) => w,
            Err(e) => {
                eprintln!("cuda_bench: {e}");
                std::process::exit(1);
            }
        };
        let x = gpu.from_host(&vec![0.5f32; k], 1, k);
        let s = time_median(&gpu, 5, || {
            let _ = gpu.matmul(&x, &w);
        });
        println!("matmul 1x{k} @ {n}x{k}: {:.1} us, {:.0} GB/s", s * 1e6, (n * k * 2) as f64 / s / 1e9);
        return;
    }
    let bandwidth = match (gpu.copy_bandwidth(2 << 30, 10), gpu.read_bandwidth(2 << 30, 10)) {
        (Ok(copy), Ok(read)) => Bandwidth { copy, read },
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("cuda_bench: bandwidth measurement failed: {e:?}");
            std::process::exit(1);
        }
    };
    eprintln!("{}: copy bandwidth {:.0} GB/s (read + write), read bandwidth {:.0} GB/s", gpu.device_description(), bandwidth.copy / 1e9, bandwidth.read / 1e9);
    let mut rows = Vec::new();
    for p in &o.presets {
        match run_preset(&gpu, p, &o, &bandwidth) {
            Ok(v) => {
                println!("{v}");
                rows.push(v);
            }
            Err(e) => eprintln!("{p}: {e}"),
        }
    }
    println!("\n{:<22} {:>10} {:>10} {:>9} {:>9} {:>14} {:>14}", "preset", "decode t/s", "ms/token", "roofline", "read roof", "prefill512 t/s", "prefill4096 t/s");
    for v in &rows {
        let pf = |n: &str| v["prefill"][n]["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:<22} {:>10.1} {:>10.2} {:>9.3} {:>9.3} {:>14.0} {:>14.0}",
            v["preset"].as_str().unwrap_or("?"),
            v["decode"]["tokens_per_s"].as_f64().unwrap_or(f64::NAN),
            v["decode"]["ms_per_token"].as_f64().unwrap_or(f64::NAN),
            v["decode"]["fraction_of_roofline"].as_f64().unwrap_or(f64::NAN),
            v["decode"]["fraction_of_read_roofline"].as_f64().unwrap_or(f64::NAN),
            pf("512"),
            pf("4096")
        );
    }
}
