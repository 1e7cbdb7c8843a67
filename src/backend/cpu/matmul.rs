//! Row-independent matrix products over weights stored in any dense dtype.
//!
//! Every output element is one fixed-order dot product of an activation row with a weight row,
//! so a row's result never depends on how many rows share the call (batch invariance).

use crate::backend::weight_bytes::MatrixBytes;
use rayon::prelude::*;

/// Weight rows converted per rayon task; small enough to balance, large enough to amortize.
const ROWS_PER_TASK: usize = 16;

/// Dot product with eight interleaved accumulators, summed pairwise: a fixed order that the
/// compiler vectorizes. Where the CPU has AVX, the same code is compiled for it (one 8-wide
/// register holds the eight accumulators); without fused multiply-adds the two builds round
/// alike, so results do not depend on the machine's vector width.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx_available() {
        // SAFETY: the CPU supports AVX (checked at run time).
        return unsafe { dot_avx(a, b) };
    }
    dot_portable(a, b)
}

#[cfg(target_arch = "x86_64")]
fn avx_available() -> bool {
    static AVX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX.get_or_init(|| std::arch::is_x86_feature_detected!("avx"))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn dot_avx(a: &[f32], b: &[f32]) -> f32 {
    dot_portable(a, b)
}

#[inline(always)]
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0f32;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// A weight as the CPU reads it: one or more parts stacked by rows, each read straight from
/// the memory map (stacking never copies the weights).
#[derive(Clone)]
pub struct CpuMatrix {
    parts: Vec<MatrixBytes>,
    pub rows: usize,
    pub cols: usize,
}

impl CpuMatrix {
    /// `parts` stacked by rows; they must share the column count.
    pub fn stacked(parts: &[MatrixBytes]) -> Result<Self, String> {
        let (rows, cols) = MatrixBytes::stacked_shape(parts)?;
        Ok(CpuMatrix { parts: parts.to_vec(), rows, cols })
    }
}

impl From<MatrixBytes> for CpuMatrix {
    fn from(m: MatrixBytes) -> Self {
        CpuMatrix { rows: m.rows, cols: m.cols, parts: vec![m] }
    }
}

/// Writes row `r` of `w` as f32 into `out`.
#[inline]
pub fn weight_row(w: &CpuMatrix, mut r: usize, out: &mut [f32]) {
    for part in &w.parts {
        if r < part.rows {
            let rb = part.row_bytes();
            let bytes = &part.bytes()[r * rb..(r + 1) * rb];
            // Cannot fail: the slice holds exactly `cols` elements of `dtype` by construction.
            kestrel_quant::dequantize_into(part.dtype, bytes, out).expect("weight row size");
            return;
        }
        r -= part.rows;
    }
    panic!("weight row past the matrix's {} rows", w.rows);
}

/// `x [t, in] @ w^T` with `w [out, in]`, giving `[t, out]`.
pub fn matmul(x: &[f32], t: usize, w: &CpuMatrix) -> Vec<f32> {
    let (out, inn) = (w.rows, w.cols);
    assert_eq!(x.len(), t * inn, "matmul: activation has {} values, expected {t}x{inn}", x.len());
    let tasks = out.div_ceil(ROWS_PER_TASK);
    let parts: Vec<Vec<f32>> = (0..tasks)
        .into_par_iter()
        .map(|task| {
            let (o0, o1) = (task * ROWS_PER_TASK, ((task + 1) * ROWS_PER_TASK).min(out));
            let mut row = vec![0.0f32; inn];
            let mut res = vec![0.0f32; (o1 - o0) * t];
            for o in o0..o1 {
                weight_row(w, o, &mut row);
                for ti in 0..t {
                    res[(o - o0) * t + ti] = dot(&x[ti * inn..(ti + 1) * inn], &row);
                }
            }
            res
        })
        .collect();
    let mut y = vec![0.0f32; t * out];
    for (task, part) in parts.iter().enumerate() {
        let o0 = task * ROWS_PER_TASK;
        let n = part.len() / t.max(1);
        for j in 0..n {
            for ti in 0..t {
                y[ti * out + o0 + j] = part[j * t + ti];
            }
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], t: usize, w: &[f32], out: usize, inn: usize) -> Vec<f32> {
        let mut y = vec![0.0; t * out];
        for i in 0..t {
            for o in 0..out {
                y[i * out + o] = (0..inn).map(|k| x[i * inn + k] as f64 * w[o * inn + k] as f64).sum::<f64>() as f32;
            }
        }
        y
    }

    /// The AVX build of the dot product rounds exactly as the portable one.
    #[test]
    fn dot_is_the_same_with_and_without_avx() {
        let mut seed = 12345u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
        };
        for len in [1, 7, 8, 9, 64, 255, 1000] {
            let a: Vec<f32> = (0..len).map(|_| next()).collect();
            let b: Vec<f32> = (0..len).map(|_| next()).collect();
            assert_eq!(dot(&a, &b).to_bits(), dot_portable(&a, &b).to_bits(), "length {len}");
        }
    }

    #[test]
    fn matches_naive_and_is_row_independent() {
        let (t, out, inn) = (5, 37, 19);
        let x: Vec<f32> = (0..t * inn).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
        let wv: Vec<f32> = (0..out * inn).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.05).collect();
        let w = CpuMatrix::from(MatrixBytes::from_f32(wv.clone(), out, inn));
        let y = matmul(&x, t, &w);
        for (a, b) in y.iter().zip(naive(&x, t, &wv, out, inn)) {
            assert!((a - b).abs() < 1e-5);
        }
        // Row 2 alone gives bitwise the same values as inside the batch.
        let alone = matmul(&x[2 * inn..3 * inn], 1, &w);
        assert_eq!(&y[2 * out..3 * out], &alone[..]);
    }

    #[test]
    fn stacked_parts_read_as_one_matrix() {
        let (t, inn) = (3, 24);
        let x: Vec<f32> = (0..t * inn).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
        let part = |rows: usize, salt: usize| MatrixBytes::from_f32((0..rows * inn).map(|i| (((i + salt) * 5 % 11) as f32 - 5.0) * 0.05).collect(), rows, inn);
        let (a, b, c) = (part(5, 0), part(1, 3), part(7, 8));
        let stacked = CpuMatrix::stacked(&[a.clone(), b.clone(), c.clone()]).unwrap();
        assert_eq!((stacked.rows, stacked.cols), (13, inn));
        let y = matmul(&x, t, &stacked);
        let parts: Vec<Vec<f32>> = [a, b, c].into_iter().map(|m| matmul(&x, t, &CpuMatrix::from(m))).collect();
        for ti in 0..t {
            let want: Vec<f32> = parts.iter().flat_map(|p| p[ti * p.len() / t..(ti + 1) * p.len() / t].to_vec()).collect();
            assert_eq!(&y[ti * 13..(ti + 1) * 13], &want[..]);
        }
        let Err(err) = CpuMatrix::stacked(&[part(2, 0), MatrixBytes::from_f32(vec![0.0; 10], 1, 10)]) else { panic!("stacked 24 and 10 columns") };
        assert!(err.contains("1x10 matrix under 24 columns"), "{err}");
    }
}
