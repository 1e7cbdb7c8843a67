//! The integer path's kernels against each other and against f64 references.

use super::act::{quantize_q8_0, quantize_q8_k, BlockQ80, BlockQ8K, QK8_0, QK_K};
use super::*;
use crate::backend::cpu::dequant::tests::random_matrix;
use crate::backend::cpu::matmul::CpuMatrix;

/// Int4 in every group shape its kernel takes: pieces of two and four 16-value sums, whole
/// octets of them, and groups over several q8_K blocks (random zero bytes, up to 255).
const INT_FORMATS: [Dtype; 9] = [
    Dtype::Q4K,
    Dtype::Q6K,
    Dtype::Q8_0,
    Dtype::Q4_0,
    Dtype::Int4 { group: 32 },
    Dtype::Int4 { group: 64 },
    Dtype::Int4 { group: 128 },
    Dtype::Int4 { group: 256 },
    Dtype::Int4 { group: 512 },
];

fn random(n: usize, seed: &mut u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
        })
        .collect()
}

/// Activation rows that reach every branch of the quantizers: random values, a zero row, a
/// constant row, a row whose largest magnitude is positive and one with a single huge value.
fn activations(t: usize, k: usize, seed: &mut u64) -> Vec<f32> {
    let mut x = random(t * k, seed);
    let shapes = t.min(4);
    for (i, row) in x.chunks_mut(k).take(shapes).enumerate() {
        match i {
            0 => row.fill(0.0),
            1 => row.fill(-0.75),
            2 => row[k / 3] = 1e4,
            _ => row.iter_mut().for_each(|v| *v = v.abs() * 1e-3),
        }
    }
    x
}

fn int8_matmul(pool: &ThreadPool, isa: Isa, x: &[f32], t: usize, w: &CpuMatrix) -> Vec<f32> {
    mode_matmul(pool, isa, MatmulMode::Int8, x, t, w)
}

fn mode_matmul(pool: &ThreadPool, isa: Isa, mode: MatmulMode, x: &[f32], t: usize, w: &CpuMatrix) -> Vec<f32> {
    let mut y = vec![0.0f32; t * w.rows];
    matmul_into(pool, isa, mode, x, t, w, &mut y, Store::Set);
    y
}

fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {i}: {g} against {w}");
    }
}

/// Every integer format: the AVX2 kernels (tiles of one to four tokens) give the scalar
/// definition's bits, on 1 to 3 threads, and a token's row is the same alone as in the batch.
#[test]
fn every_kernel_thread_count_and_batch_gives_the_scalar_bits() {
    let mut seed = 42u64;
    let pools = [ThreadPool::new(1), ThreadPool::new(2), ThreadPool::new(3)];
    for dtype in INT_FORMATS {
        // 45 rows: a split over threads with a remainder; 1024 columns: four K-quant blocks, two
        // int4 groups of 512.
        let (out, k) = (45, 1024);
        let w = CpuMatrix::from(random_matrix(dtype, out, k, &mut seed));
        for t in [1, 2, 3, 4, 5, 7, 11] {
            let x = activations(t, k, &mut seed);
            let want = int8_matmul(&pools[0], Isa::Scalar, &x, t, &w);
            assert!(want.iter().all(|v| v.is_finite()), "{dtype}: non-finite results");
            for pool in &pools {
                for isa in Isa::all_available() {
                    let what = format!("{dtype}, {t} tokens, {} threads, {isa:?}", pool.threads());
                    assert_bits(&int8_matmul(pool, isa, &x, t, &w), &want, &what);
                    for i in [0, t - 1] {
                        let alone = int8_matmul(pool, isa, &x[i * k..(i + 1) * k], 1, &w);
                        assert_bits(&alone, &want[i * out..(i + 1) * out], &format!("{what}, token {i} alone"));
                    }
                }
            }
        }
    }
}

/// The activation blocks of a row as f64 values.
fn dequantized_acts(dtype: Dtype, x: &[f32]) -> Vec<f64> {
    if act_format(MatmulMode::Int8, dtype, x.len()) == Some(ActFormat::Q8K) {
        let mut b = vec![BlockQ8K::default(); x.len() / QK_K];
        quantize_q8_k(x, &mut b);
        b.iter().flat_map(|b| b.qs.map(|q| f64::from(b.d) * f64::from(q))).collect()
    } else {
        let mut b = vec![BlockQ80::default(); x.len() / QK8_0];
        quantize_q8_0(x, &mut b);
        b.iter().flat_map(|b| b.qs.map(|q| f64::from(b.d) * f64::from(q))).collect()
    }
}

/// Each result is the dot product of the weights (as the exact path converts them) with the
/// quantized activations, up to f32 rounding of the block sums: against an f64 reference of
/// the same values, within a few f32 ulps of the sum of magnitudes. And it is the exact path's
/// result up to the activations' quantization error, whose bound is half a step per value.
#[test]
fn integer_dots_are_the_dots_of_the_quantized_activations() {
    let mut seed = 3u64;
    let pool = ThreadPool::new(2);
    for dtype in INT_FORMATS {
        let (out, k) = (19, 1024);
        let m = random_matrix(dtype, out, k, &mut seed);
        let mut wf = vec![0.0f32; out * k];
        kestrel_quant::dequantize_into(dtype, m.bytes(), &mut wf).unwrap();
        let w = CpuMatrix::from(m);
        let t = 6;
        let x = activations(t, k, &mut seed);
        let y = int8_matmul(&pool, Isa::detect(), &x, t, &w);
        let exact = crate::backend::cpu::matmul::matmul(&pool, Isa::detect(), &x, t, &w);
        for i in 0..t {
            let xi = &x[i * k..(i + 1) * k];
            let xq = dequantized_acts(dtype, xi);
            let block = if act_format(MatmulMode::Int8, dtype, k) == Some(ActFormat::Q8K) { QK_K } else { QK8_0 };
            for r in 0..out {
                let wr = &wf[r * k..(r + 1) * k];
                let reference: f64 = wr.iter().zip(&xq).map(|(&a, &b)| f64::from(a) * b).sum();
                let magnitude: f64 = wr.iter().zip(&xq).map(|(&a, &b)| (f64::from(a) * b).abs()).sum();
                let got = f64::from(y[i * out + r]);
                assert!((got - reference).abs() <= 1e-5 * magnitude + 1e-30, "{dtype} token {i} row {r}: {got} against {reference} (magnitude {magnitude})");
                // Quantization error: at most half a step (amax / 127) per activation.
                let step: f64 = xi.chunks(block).zip(wr.chunks(block)).map(|(xb, wb)| {
                    let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    f64::from(amax) / 127.0 * 0.5 * wb.iter().map(|v| f64::from(v.abs())).sum::<f64>()
                }).sum();
                let e = f64::from(exact[i * out + r]);
                assert!((got - e).abs() <= step * 1.01 + 1e-5 * magnitude + 1e-6, "{dtype} token {i} row {r}: int8 {got}, exact {e}, bound {step}");
            }
        }
    }
}

/// A stack of an integer-kernel part between float and other block parts: each part's columns
/// are what that part gives alone, the others' the exact path's bits.
#[test]
fn stacked_parts_mix_integer_and_exact_kernels() {
    let mut seed = 11u64;
    let pool = ThreadPool::new(2);
    let k = 512;
    let parts = [random_matrix(Dtype::BF16, 9, k, &mut seed), random_matrix(Dtype::Q4K, 13, k, &mut seed), random_matrix(Dtype::Q5K, 5, k, &mut seed), random_matrix(Dtype::Q8_0, 8, k, &mut seed)];
    let stacked = CpuMatrix::stacked(&parts).unwrap();
    let t = 3;
    let x = random(t * k, &mut seed);
    let y = int8_matmul(&pool, Isa::detect(), &x, t, &stacked);
    let mut col = 0;
    for part in &parts {
        let alone = CpuMatrix::from(part.clone());
        let want = if takes_integer_path(MatmulMode::Int8, part.dtype, k) { int8_matmul(&pool, Isa::Scalar, &x, t, &alone) } else { matmul::matmul(&pool, Isa::Scalar, &x, t, &alone) };
        for i in 0..t {
            assert_bits(&y[i * stacked.rows + col..][..part.rows], &want[i * part.rows..][..part.rows], &format!("{} part, token {i}", part.dtype));
        }
        col += part.rows;
    }
    // Adding into the output adds the same values.
    let mut acc = vec![1.5f32; t * stacked.rows];
    matmul_into(&pool, Isa::detect(), MatmulMode::Int8, &x, t, &stacked, &mut acc, Store::Add);
    let added: Vec<f32> = y.iter().map(|v| 1.5 + v).collect();
    assert_bits(&acc, &added, "added");
}

#[test]
fn modes_parse_by_name_and_refuse_others() {
    assert_eq!("int8".parse::<MatmulMode>(), Ok(MatmulMode::Int8));
    assert_eq!("exact".parse::<MatmulMode>(), Ok(MatmulMode::Exact));
    assert_eq!("auto".parse::<MatmulMode>(), Ok(MatmulMode::Auto));
    assert_eq!(MatmulMode::default(), MatmulMode::Exact);
    for name in MatmulMode::NAMES {
        assert_eq!(name.parse::<MatmulMode>().unwrap().to_string(), name);
    }
    // Int4 runs on q8_K blocks only where they tile its rows and groups; the rest is exact.
    let int8 = |dtype, cols| takes_integer_path(MatmulMode::Int8, dtype, cols);
    assert!(int8(Dtype::Int4 { group: 128 }, 1280) && int8(Dtype::Int4 { group: 512 }, 1024));
    assert!(!int8(Dtype::Int4 { group: 16 }, 512) && !int8(Dtype::Int4 { group: 96 }, 768));
    assert!(!int8(Dtype::Int4 { group: 128 }, 384) && !int8(Dtype::Int4 { group: 384 }, 768));
    let err = "fast".parse::<MatmulMode>().unwrap_err();
    assert_eq!(err, "unknown CPU matmul mode `fast`; expected one of: exact, int8, auto");
}

/// Auto multiplies Q4_K, Q6_K and Q4_0 as int8 mode does and every other format (Q8_0, Int4,
/// floats, formats without an integer kernel) as exact mode does, bit for bit, stacked parts
/// included; exact mode never takes the integer path.
#[test]
fn auto_takes_the_integer_path_for_the_k_quants_and_q4_0_only() {
    let mut seed = 23u64;
    let pool = ThreadPool::new(2);
    let k = 512;
    let formats = [Dtype::Q4K, Dtype::Q6K, Dtype::Q4_0, Dtype::Q8_0, Dtype::Int4 { group: 128 }, Dtype::Q5K, Dtype::BF16, Dtype::F32];
    let parts: Vec<MatrixBytes> = formats.iter().map(|&d| random_matrix(d, 7, k, &mut seed)).collect();
    let stacked = CpuMatrix::stacked(&parts).unwrap();
    let t = 5;
    let x = activations(t, k, &mut seed);
    let y = mode_matmul(&pool, Isa::detect(), MatmulMode::Auto, &x, t, &stacked);
    let mut col = 0;
    for part in &parts {
        let integer = matches!(part.dtype, Dtype::Q4K | Dtype::Q6K | Dtype::Q4_0);
        assert_eq!(takes_integer_path(MatmulMode::Auto, part.dtype, k), integer, "{}", part.dtype);
        assert!(!takes_integer_path(MatmulMode::Exact, part.dtype, k));
        let alone = CpuMatrix::from(part.clone());
        let want = if integer { int8_matmul(&pool, Isa::Scalar, &x, t, &alone) } else { matmul::matmul(&pool, Isa::Scalar, &x, t, &alone) };
        for i in 0..t {
            assert_bits(&y[i * stacked.rows + col..][..part.rows], &want[i * part.rows..][..part.rows], &format!("auto, {} part, token {i}", part.dtype));
        }
        col += part.rows;
    }
    // The k-quant parts differ from exact mode's (the activations lost bits), so the test
    // above tells the two paths apart.
    let q4k = CpuMatrix::from(parts[0].clone());
    assert_ne!(mode_matmul(&pool, Isa::Scalar, MatmulMode::Auto, &x[k..], t - 1, &q4k), matmul::matmul(&pool, Isa::Scalar, &x[k..], t - 1, &q4k));
}
