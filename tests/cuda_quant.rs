//! Quantized weights on the GPU in their own bits (cuda/qmatmul.cu): every format's kernels
//! against the CPU dequantization times the activations in f64, every row count from one token
//! to many, and a row's bits the same whatever the other rows and whichever kernel ran it.
//! Runs where a GPU is present.

mod cuda_support;

use cuda_support::*;
use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::cuda::quant_tiles::{random_rows, ALL_FORMATS};
use kestrel::backend::weight_bytes::{MatrixBytes, SharedBytes};
use kestrel::backend::Backend;
use kestrel::model::weights::Dtype;

fn seed() -> u64 {
    let s = std::env::var("KESTREL_TEST_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1));
    eprintln!("seed {s}");
    s
}

/// One stored dtype per tile format (Int4 and FP8 at each unit width).
fn dtypes() -> Vec<Dtype> {
    use kestrel::backend::cuda::quant_tiles::TileFormat as F;
    ALL_FORMATS
        .iter()
        .map(|f| match *f {
            F::Q4_0 => Dtype::Q4_0,
            F::Q4_1 => Dtype::Q4_1,
            F::Q5_0 => Dtype::Q5_0,
            F::Q5_1 => Dtype::Q5_1,
            F::Q8_0 => Dtype::Q8_0,
            F::Q4K => Dtype::Q4K,
            F::Q5K => Dtype::Q5K,
            F::Q6K => Dtype::Q6K,
            F::IQ4NL => Dtype::IQ4NL,
            F::IQ4XS => Dtype::IQ4XS,
            F::Int4 { unit } => Dtype::Int4 { group: unit },
            F::Fp8 { unit } => Dtype::F8E4M3Scaled { block: unit },
        })
        .collect()
}

fn quantized(dtype: Dtype, rows: usize, cols: usize, seed: u64) -> MatrixBytes {
    let bytes = random_rows(dtype, rows, cols, seed);
    MatrixBytes { data: SharedBytes::from_vec(bytes), start: 0, dtype, rows, cols }
}

/// `x @ W^T` in f64 from the CPU's dequantized weights, the activations rounded to bf16 as the
/// GPU's mmas (and the CPU backend) take them.
fn reference(x: &[f32], rows: usize, w: &MatrixBytes) -> Vec<f32> {
    let values = kestrel_quant::dequantize(w.dtype, w.bytes()).expect("valid rows");
    let (n, k) = (w.rows, w.cols);
    let mut out = vec![0f32; rows * n];
    for r in 0..rows {
        for c in 0..n {
            let s: f64 = (0..k).map(|i| kestrel_quant::round_to_bf16(x[r * k + i]) as f64 * values[c * k + i] as f64).sum();
            out[r * n + c] = s as f32;
        }
    }
    out
}

/// Widths (K) per format: a few units, an odd count, and a model's width.
fn widths(dtype: Dtype) -> Vec<usize> {
    // A tile unit, or a stored block where that is wider (the K-quants' 256).
    let unit = kestrel::backend::cuda::quant_tiles::TileFormat::of(dtype).expect("tiles").unit().max(dtype.block_elems());
    let mut w = vec![3 * unit, 7 * unit];
    if unit >= 128 {
        w.push(4096);
    } else {
        w.push(unit * 64);
    }
    w
}

#[test]
fn quantized_matmuls_match_the_dequantized_weights_and_rows_are_independent() {
    let Some(gpu) = gpu() else { return };
    let s = seed();
    let mut rng = Rng::new(s);
    // 1..16 rows: the few-row kernels (one or two token tiles, rows split in the kernel); more:
    // the many-row kernel, in blocks per k-slice and a sum where the weight has few tiles (all
    // of these widths but 4500 columns past 64 rows).
    let row_counts = [1, 2, 7, 8, 9, 16, 17, 33, 63, 64, 65, 130, 200];
    for dtype in dtypes() {
        for k in widths(dtype) {
            let ns: &[usize] = if k == widths(dtype)[0] { &[37, 300, 4500] } else { &[37, 300] };
            for &n in ns {
                let w = quantized(dtype, n, k, s ^ (k * 131 + n) as u64);
                let gw = gpu.upload_matrix(&w).unwrap();
                let max_rows = *row_counts.last().unwrap();
                let x = rng.vec(max_rows * k, 1.0);
                let want_all = reference(&x, max_rows, &w);
                let full = gpu.to_host(&gpu.matmul(&gpu.from_host(&x, max_rows, k), &gw));
                let err = relative_error(&full, &want_all);
                assert!(err < 1e-4, "{dtype} {max_rows}x{k} @ {n}: relative error {err}");
                for rows in row_counts {
                    let got = gpu.to_host(&gpu.matmul(&gpu.from_host(&x[..rows * k], rows, k), &gw));
                    assert!(bitwise_equal(&got, &full[..rows * n]), "{dtype} {k} -> {n}: rows differ between {rows} and {max_rows} rows");
                }
                // The accumulating store adds the same products.
                let rows = 5;
                let acc0 = rng.vec(rows * n, 1.0);
                let mut acc = gpu.from_host(&acc0, rows, n);
                gpu.matmul_add(&mut acc, &gpu.from_host(&x[..rows * k], rows, k), &gw);
                let want: Vec<f32> = acc0.iter().zip(&full[..rows * n]).map(|(a, b)| a + b).collect();
                assert!(bitwise_equal(&gpu.to_host(&acc), &want), "{dtype}: matmul_add");
            }
        }
    }
}

#[test]
fn quantized_embeddings_are_the_cpu_rows() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let s = seed();
    for dtype in dtypes() {
        let k = widths(dtype)[1];
        let table = quantized(dtype, 45, k, s ^ 77);
        let ids: Vec<u32> = (0..20).map(|i| ((i * 7 + 3) % 45) as u32).collect();
        let got = gpu.to_host(&gpu.embed(&gpu.upload_matrix(&table).unwrap(), &ids));
        let want = cpu.to_host(&cpu.embed(&cpu.upload_matrix(&table).unwrap(), &ids));
        assert!(bitwise_equal(&got, &want), "{dtype}: embedding rows differ from the CPU's");
    }
}

/// Gate/up tiles store silu(gate) * up; stacks of differently stored parts cut into parts;
/// both equal the separate matmuls bit for bit.
#[test]
fn swiglu_tiles_and_mixed_stacks_equal_the_separate_ops() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let s = seed();
    let mut rng = Rng::new(s);
    let k = 512;
    for dtype in [Dtype::Q4K, Dtype::Int4 { group: 128 }, Dtype::F8E4M3Scaled { block: 128 }, Dtype::Q8_0] {
        let (gate, up) = (quantized(dtype, 75, k, s ^ 1), quantized(dtype, 75, k, s ^ 2));
        let gu = gpu.upload_gate_up(&gate, &up).unwrap();
        let (g1, u1) = (gpu.upload_matrix(&gate).unwrap(), gpu.upload_matrix(&up).unwrap());
        let cgu = cpu.upload_gate_up(&gate, &up).unwrap();
        for rows in [1, 9, 40, 100] {
            let x = rng.vec(rows * k, 1.0);
            let gx = gpu.from_host(&x, rows, k);
            let fused = gpu.to_host(&gpu.matmul_swiglu(&gx, &gu));
            let separate = gpu.to_host(&gpu.silu_mul(&gpu.matmul(&gx, &g1), &gpu.matmul(&gx, &u1)));
            assert!(bitwise_equal(&fused, &separate), "{dtype}: swiglu of gate/up tiles, {rows} rows");
            let want = cpu.to_host(&cpu.matmul_swiglu(&cpu.from_host(&x, rows, k), &cgu));
            let err = relative_error(&fused, &want);
            assert!(err < 1e-4, "{dtype}: swiglu against the CPU, {rows} rows: relative error {err}");
        }
    }
    // The norm inside the launch (the few-row kernel normalizes the rows it splits): bitwise the
    // separate norm, for gate/up tiles and plain tiles, at row counts in and past that kernel.
    for dtype in [Dtype::Q4K, Dtype::Q6K, Dtype::Int4 { group: 128 }] {
        let (gate, up) = (quantized(dtype, 40, k, s ^ 5), quantized(dtype, 40, k, s ^ 6));
        let gu = gpu.upload_gate_up(&gate, &up).unwrap();
        let plain = gpu.upload_stacked(&[gate.clone(), up.clone()]).unwrap();
        let norm = gpu.upload_vector(&rng.vec(k, 1.0)).unwrap();
        for rows in [1, 3, 16, 17, 70] {
            let gx = gpu.from_host(&rng.vec(rows * k, 2.0), rows, k);
            let h = gpu.rms_norm(&gx, &norm, 1e-6);
            let fused = gpu.to_host(&gpu.rms_norm_matmul_swiglu(&gx, &norm, 1e-6, &gu));
            assert!(bitwise_equal(&fused, &gpu.to_host(&gpu.matmul_swiglu(&h, &gu))), "{dtype}: rms_norm_matmul_swiglu, {rows} rows");
            let got = gpu.rms_norm_matmul_parts(&gx, &norm, 1e-6, &plain, &[40, 40]);
            let want = gpu.matmul_parts(&h, &plain, &[40, 40]);
            for (g, w) in got.iter().zip(&want) {
                assert!(bitwise_equal(&gpu.to_host(g), &gpu.to_host(w)), "{dtype}: rms_norm_matmul_parts, {rows} rows");
            }
        }
    }
    // q | k | v | a as Q6_K, Q4_K, BF16 and F32 parts: four runs, each its own launch.
    let parts = [quantized(Dtype::Q6K, 64, k, s ^ 3), quantized(Dtype::Q4K, 32, k, s ^ 4), random_matrix(&mut rng, 16, k, Dtype::BF16), random_matrix(&mut rng, 8, k, Dtype::F32)];
    let widths: Vec<usize> = parts.iter().map(|p| p.rows).collect();
    let stacked = gpu.upload_stacked(&parts).unwrap();
    assert_eq!(stacked.storage_name(), "q6_k+q4_k+bf16+bf16 pair");
    let separate: Vec<_> = parts.iter().map(|p| gpu.upload_matrix(p).unwrap()).collect();
    let cstacked = cpu.upload_stacked(&parts).unwrap();
    for rows in [1, 20, 70] {
        let x = rng.vec(rows * k, 1.0);
        let gx = gpu.from_host(&x, rows, k);
        let got = gpu.matmul_parts(&gx, &stacked, &widths);
        let want = cpu.matmul_parts(&cpu.from_host(&x, rows, k), &cstacked, &widths);
        for (p, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(bitwise_equal(&gpu.to_host(g), &gpu.to_host(&gpu.matmul(&gx, &separate[p]))), "mixed stack part {p}, {rows} rows");
            let err = relative_error(&gpu.to_host(g), &cpu.to_host(w));
            assert!(err < 1e-4, "mixed stack part {p} against the CPU, {rows} rows: relative error {err}");
        }
        // Normalized in the launches of the parts that can (the F32 part cannot: one norm first).
        let norm = gpu.upload_vector(&rng.vec(k, 1.0)).unwrap();
        let h = gpu.rms_norm(&gx, &norm, 1e-6);
        for (g, w) in gpu.rms_norm_matmul_parts(&gx, &norm, 1e-6, &stacked, &widths).iter().zip(gpu.matmul_parts(&h, &stacked, &widths)) {
            assert!(bitwise_equal(&gpu.to_host(g), &gpu.to_host(&w)), "mixed stack with its norm, {rows} rows");
        }
    }
}

/// Random tiles (`--load-format dummy`) hold finite weights of about the bf16 random weights'
/// scale: a matmul of unit activations gives outputs of order one.
#[test]
fn random_tiles_have_the_random_weights_scale() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(seed());
    let k = 2048;
    for dtype in dtypes() {
        gpu.set_random_weights(Some(7)).unwrap();
        let shape_only = MatrixBytes { data: SharedBytes::from_vec(Vec::new()), start: 0, dtype, rows: 256, cols: k };
        let w = gpu.upload_matrix(&shape_only).unwrap();
        gpu.set_random_weights(None).unwrap();
        let x = rng.vec(4 * k, 3f32.sqrt());
        let y = gpu.to_host(&gpu.matmul(&gpu.from_host(&x, 4, k), &w));
        let rms = (y.iter().map(|v| v * v).sum::<f32>() / y.len() as f32).sqrt();
        assert!(y.iter().all(|v| v.is_finite()), "{dtype}: non-finite outputs");
        assert!(rms > 0.2 && rms < 5.0, "{dtype}: output rms {rms} is not of order one");
    }
}

/// The device bytes of tiled weights stay near the stored bytes (within 6% for every format
/// at model widths).
#[test]
fn tiles_take_about_the_stored_bytes() {
    let Some(gpu) = gpu() else { return };
    for dtype in dtypes() {
        let k = 4096;
        let w = quantized(dtype, 512, k, 5);
        let before = gpu.uploaded_bytes();
        let m = gpu.upload_matrix(&w).unwrap();
        let device = gpu.uploaded_bytes() - before;
        assert_eq!(device, m.device_bytes());
        let stored = w.bytes().len();
        assert!(device as f64 <= stored as f64 * 1.12, "{dtype}: {device} device bytes for {stored} stored");
    }
}
