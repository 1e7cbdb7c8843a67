//! TurboQuant 3-bit vectors (TurboQuant_mse with norm correction).
//!
//! Storing `x`: `y = Π·x` (the randomized Hadamard rotation), `n = ‖y‖`; each coordinate of the
//! unit vector `y / n` becomes the code of its nearest Lloyd-Max level `c`; the stored norm is
//! `n / ‖c‖` in bf16, where `c` is the vector of the chosen levels. Reading gives
//! `ŷ = (n / ‖c‖)·c`, which has exactly the length of `x` (the "norm correction" of vLLM's `_nc`
//! formats, done once at write time instead of at every read), in the rotated space:
//! `⟨q, x̂⟩ = ⟨Π·q, ŷ⟩` and `Σ wᵢ·x̂ᵢ = Πᵀ·Σ wᵢ·ŷᵢ`, so attention rotates its query and its
//! output once and reads each cached vector with a table look-up and one multiply.
//!
//! The CUDA kernels (cuda/attention.cu, `KvTq3`) run the same steps on the same f32 values: the
//! same transform stages, comparisons against the same boundaries, the same bf16 rounding; only
//! the order of the two sums of squares differs.

use super::codebook::Codebook;
use super::hadamard::RandomizedHadamard;
use super::{pack3, unpack3};
use half::bf16;

/// Stores `x` as codes in `data` (`3·d / 8` bytes); returns the bf16 bits of the corrected norm.
pub fn encode(x: &[f32], rotation: &RandomizedHadamard, codebook: &Codebook, data: &mut [u8]) -> u16 {
    let mut y = x.to_vec();
    rotation.rotate(&mut y);
    let n = y.iter().fold(0.0f32, |s, v| s + v * v).sqrt();
    let inv = if n > 0.0 { 1.0 / n } else { 0.0 };
    let codes: Vec<u8> = y.iter().map(|&v| codebook.code(v * inv)).collect();
    pack3(&codes, data);
    if n == 0.0 {
        return 0;
    }
    let c_len = codes.iter().fold(0.0f32, |s, &k| {
        let c = codebook.centroids[k as usize];
        s + c * c
    });
    bf16::from_f32(n / c_len.sqrt()).to_bits()
}

/// The rotated vector `norm · c[code]` of stored codes.
pub fn decode(codebook: &Codebook, data: &[u8], norm: u16, out: &mut [f32]) {
    let norm = bf16::from_bits(norm).to_f32();
    let mut codes = [0u8; 8];
    for (bytes, o) in data.chunks_exact(3).zip(out.chunks_exact_mut(8)) {
        unpack3(bytes, &mut codes);
        for (v, &k) in o.iter_mut().zip(&codes) {
            *v = codebook.centroids[k as usize] * norm;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::kv::{KvCodec, VectorFormat};

    /// Gaussian vectors (Box-Muller over splitmix64), uniform in direction.
    fn gaussian(seed: &mut u64, n: usize) -> Vec<f32> {
        let mut next = || {
            *seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = *seed;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        (0..n).map(|_| ((-2.0 * (1.0 - next()).ln()).sqrt() * (2.0 * std::f64::consts::PI * next()).cos()) as f32).collect()
    }

    fn squared_error(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum()
    }

    /// TurboQuant's Theorem 1: for unit vectors, the mean squared error of the 3-bit MSE
    /// quantizer is at most √3·π/2·4⁻³ ≈ 0.0425, and about 0.03 in practice (0.0345 for the
    /// Gaussian Lloyd-Max codebook). Norm correction keeps the error at that level.
    #[test]
    fn unit_vector_error_is_within_the_paper_bound() {
        let mut seed = 11;
        for dim in [64usize, 128, 256] {
            let codec = KvCodec::new(VectorFormat::Codebook3, dim).unwrap();
            let (mut data, mut params, mut back) = (vec![0u8; 3 * dim / 8], [0u16], vec![0.0f32; dim]);
            let trials = 2000;
            let mut total = 0.0;
            for _ in 0..trials {
                let mut x = gaussian(&mut seed, dim);
                let n = x.iter().map(|v| v * v).sum::<f32>().sqrt();
                x.iter_mut().for_each(|v| *v /= n);
                codec.encode(&x, &mut data, &mut params);
                codec.decode_unrotated(&data, &params, &mut back);
                total += squared_error(&x, &back);
            }
            let mse = total / trials as f64;
            eprintln!("d {dim}: 3-bit TurboQuant unit-vector MSE {mse:.5}");
            assert!(mse < 3f64.sqrt() * std::f64::consts::PI / 2.0 / 64.0, "d {dim}: MSE {mse} above Theorem 1's bound");
            assert!((0.03..0.037).contains(&mse), "d {dim}: MSE {mse}, expected about 0.0345");
        }
    }

    /// Structured vectors (one large outlier channel, a constant vector) are spread over every
    /// coordinate by the rotation and quantize as well as random ones; the stored norm keeps
    /// the length exactly (to bf16).
    #[test]
    fn outliers_are_spread_and_lengths_kept() {
        let dim = 128;
        let codec = KvCodec::new(VectorFormat::Codebook3, dim).unwrap();
        let mut outlier = vec![0.01f32; dim];
        outlier[17] = 40.0;
        let constant = vec![3.0f32; dim];
        for x in [outlier, constant] {
            let (mut data, mut params, mut back) = (vec![0u8; 48], [0u16], vec![0.0f32; dim]);
            codec.encode(&x, &mut data, &mut params);
            codec.decode_unrotated(&data, &params, &mut back);
            let len = |v: &[f32]| v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
            let rel = squared_error(&x, &back) / len(&x).powi(2);
            assert!(rel < 0.06, "relative error {rel}");
            assert!((len(&back) / len(&x) - 1.0).abs() < 0.005, "length {} vs {}", len(&back), len(&x));
        }
    }

    /// A zero vector stores a zero norm and reads back as zeros.
    #[test]
    fn zero_vector_reads_back_as_zero() {
        let codec = KvCodec::new(VectorFormat::Codebook3, 64).unwrap();
        let (mut data, mut params, mut back) = (vec![0u8; 24], [7u16], vec![1.0f32; 64]);
        codec.encode(&[0.0; 64], &mut data, &mut params);
        codec.decode(&data, &params, &mut back);
        assert_eq!(params[0], 0);
        assert!(back.iter().all(|&v| v == 0.0));
    }

    /// Scores in the rotated space equal scores against the un-rotated read-back.
    #[test]
    fn rotated_scores_equal_original_space_scores() {
        let dim = 256;
        let codec = KvCodec::new(VectorFormat::Codebook3, dim).unwrap();
        let mut seed = 5;
        let (k, q) = (gaussian(&mut seed, dim), gaussian(&mut seed, dim));
        let (mut data, mut params) = (vec![0u8; 96], [0u16]);
        codec.encode(&k, &mut data, &mut params);
        let (mut rotated, mut original) = (vec![0.0f32; dim], vec![0.0f32; dim]);
        codec.decode(&data, &params, &mut rotated);
        codec.decode_unrotated(&data, &params, &mut original);
        let mut q_rot = q.clone();
        codec.rotation().unwrap().rotate(&mut q_rot);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum::<f64>();
        assert!((dot(&q_rot, &rotated) - dot(&q, &original)).abs() < 1e-3, "{} vs {}", dot(&q_rot, &rotated), dot(&q, &original));
    }
}
