//! CPU time of one matmul at qwen3.5-0.8b's FFN shape (3584 x 1024) in the CPU backend's two
//! modes, exact and int8, for Q4_K, Q6_K, Q8_0 and int4 (groups of 128) weights, at 1 and 128
//! tokens. CPU time of the calling thread (from /proc), not wall time, so a machine shared with
//! other work still gives comparable figures. Usage: `cargo run --release --example cpu_matmul_modes [THREADS]`
//! (one thread, the default, keeps all the work on the measured thread).

use kestrel::backend::cpu::int8;
use kestrel::backend::cpu::matmul::{self, CpuMatrix, Store};
use kestrel::backend::cpu::pool::ThreadPool;
use kestrel::backend::cpu::{Isa, MatmulMode};
use kestrel::backend::weight_bytes::{MatrixBytes, SharedBytes};
use kestrel_quant::Dtype;

/// CPU time of this thread (seconds), from /proc.
fn cpu() -> f64 {
    let s = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).map_or(Ok(1), |s| s.parse()).expect("THREADS: a whole number");
    let pool = ThreadPool::new(threads);
    let (out, k) = (3584, 1024);
    let mut seed = 1u64;
    let vals: Vec<f32> = (0..out * k).map(|_| { seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1); ((seed >> 40) as f32 / 16777216.0 - 0.5) * 0.04 }).collect();
    for dtype in [Dtype::Q4K, Dtype::Q6K, Dtype::Q8_0, Dtype::Int4 { group: 128 }] {
        let bytes = kestrel_quant::quantize::quantize(dtype, &vals, out, k).unwrap();
        let w = CpuMatrix::from(MatrixBytes { data: SharedBytes::from_vec(bytes), start: 0, dtype, rows: out, cols: k });
        for t in [1usize, 128] {
            let x: Vec<f32> = (0..t * k).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 0.002).collect();
            let mut y = vec![0.0f32; t * out];
            for rep in 0..2 {
                let reps = if t == 1 { 2000 } else { 40 };
                let t0 = cpu();
                for _ in 0..reps { matmul::matmul_into(&pool, Isa::detect(), &x, t, &w, &mut y, Store::Set); }
                let e = (cpu() - t0) / reps as f64;
                let t1 = cpu();
                for _ in 0..reps { int8::matmul_into(&pool, Isa::detect(), MatmulMode::Int8, &x, t, &w, &mut y, Store::Set); }
                let i = (cpu() - t1) / reps as f64;
                let gmac = (t * out * k) as f64 / 1e9;
                println!("{dtype} t={t} rep {rep}: exact {:.2} ms ({:.1} GMAC/s)  int8 {:.2} ms ({:.1} GMAC/s)", e * 1e3, gmac / e, i * 1e3, gmac / i);
            }
        }
    }
}
