//! Matmul kernel timings per weight format on the GPU: random weights of each format at model
//! shapes, times for a few token counts (median of repeated launches, each synchronized), as
//! weight bytes per second (decode: the weights are the traffic) and TFLOP/s (2 * rows * N * K).
//! Launches run back to back, as in a forward, and are synchronized once per round.
//!
//! `cargo run --release --example quant_bench -- [--formats bf16,q4_k,...] [--shapes NxK,...] [--rows 1,8,...]`

use kestrel::backend::cuda::CudaBackend;
use kestrel::backend::weight_bytes::{MatrixBytes, SharedBytes};
use kestrel::backend::Backend;
use kestrel::model::weights::Dtype;
use std::time::Instant;

fn dtype(name: &str) -> Result<Dtype, String> {
    Ok(match name {
        "bf16" => Dtype::BF16,
        "q4_0" => Dtype::Q4_0,
        "q4_1" => Dtype::Q4_1,
        "q5_0" => Dtype::Q5_0,
        "q5_1" => Dtype::Q5_1,
        "q8_0" => Dtype::Q8_0,
        "q4_k" => Dtype::Q4K,
        "q5_k" => Dtype::Q5K,
        "q6_k" => Dtype::Q6K,
        "iq4_nl" => Dtype::IQ4NL,
        "iq4_xs" => Dtype::IQ4XS,
        "int4" => Dtype::Int4 { group: 128 },
        "fp8" => Dtype::F8E4M3Scaled { block: 128 },
        other => return Err(format!("unknown format {other}")),
    })
}

fn list<T>(v: &str, f: impl Fn(&str) -> Result<T, String>) -> Result<Vec<T>, String> {
    v.split(',').map(f).collect()
}

fn main() -> Result<(), String> {
    let mut formats = list("bf16,q4_k,q6_k,q8_0,int4,fp8", dtype)?;
    let mut shapes = vec![(4096, 4096), (12288, 4096), (4096, 12288), (24576, 4096), (248320, 4096)];
    let mut rows = vec![1, 8, 32, 64, 512, 4096];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().ok_or(format!("{a} needs a value"))?;
        match a.as_str() {
            "--formats" => formats = list(&v, dtype)?,
            "--shapes" => {
                shapes = list(&v, |s| {
                    let (n, k) = s.split_once('x').ok_or(format!("shape {s} is not NxK"))?;
                    Ok((n.parse().map_err(|e| format!("{s}: {e}"))?, k.parse().map_err(|e| format!("{s}: {e}"))?))
                })?
            }
            "--rows" => rows = list(&v, |s| s.parse().map_err(|e| format!("--rows: {e}")))?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let gpu = CudaBackend::new(0).map_err(|e| e.to_string())?;
    eprintln!("{}", gpu.device_description());
    println!("format  shape         rows   us/call   weight GB/s   TFLOP/s");
    for &(n, k) in &shapes {
        for &dt in &formats {
            gpu.set_random_weights(Some(11)).map_err(|e| e.to_string())?;
            let shape_only = MatrixBytes { data: SharedBytes::from_vec(Vec::new()), start: 0, dtype: dt, rows: n, cols: k };
            let w = gpu.upload_matrix(&shape_only).map_err(|e| e.to_string())?;
            gpu.set_random_weights(None).map_err(|e| e.to_string())?;
            let bytes = w.device_bytes() as f64;
            for &r in &rows {
                let x = gpu.from_host(&vec![0.5f32; r * k], r, k);
                // Warm-up (compiles and caches the kernels), then the median of timed calls.
                for _ in 0..3 {
                    drop(gpu.matmul(&x, &w));
                }
                gpu.synchronize();
                // Back-to-back launches (as a forward runs them), synchronized once per round.
                let per_round = if r >= 512 { 3 } else { 20 };
                let mut times = Vec::with_capacity(7);
                for _ in 0..7 {
                    let t0 = Instant::now();
                    for _ in 0..per_round {
                        drop(gpu.matmul(&x, &w));
                    }
                    gpu.synchronize();
                    times.push(t0.elapsed().as_secs_f64() / per_round as f64);
                }
                times.sort_by(|a, b| a.total_cmp(b));
                let t = times[times.len() / 2];
                println!("{:<7} {:>6}x{:<6} {:>5} {:>9.1} {:>13.0} {:>9.1}", dt.name(), n, k, r, t * 1e6, bytes / t / 1e9, 2.0 * (r * n * k) as f64 / t / 1e12);
            }
        }
    }
    Ok(())
}
