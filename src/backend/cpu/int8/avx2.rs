//! AVX2 forms of the [`scalar`](super::scalar) integer dot products: one weight row against `T`
//! activation rows (up to four tokens), each weight block unpacked once for all of them. The
//! products go through `_mm256_maddubs_epi16` (unsigned weight bytes, or their magnitudes with
//! the signs moved onto the activations, times signed activation bytes) and
//! `_mm256_madd_epi16`; no i16 sum can saturate with activations in [-127, 127], so every
//! integer is the scalar one, and the f32 steps are the scalar ones in the same order.

use super::act::{BlockQ80, BlockQ8K};
use super::scalar::{f16_at, q4_k_block_value, q4_k_min_sum, q6_k_offset_sum, scale_min_k4};
use crate::backend::cpu::dot::{reduce_lanes, LANES};
use std::arch::x86_64::*;

#[inline(always)]
unsafe fn load32(p: *const u8) -> __m256i {
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// The eight i32 lanes of `v` summed (exact: integer addition).
#[inline(always)]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    unsafe {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }
}

/// Q4_K row `w` against `T` q8_K rows.
///
/// # Safety
/// AVX2 is available; each `a[i]` holds a block per 256 weights of `w`.
#[target_feature(enable = "avx2")]
pub unsafe fn q4_k<const T: usize>(w: &[u8], a: [&[BlockQ8K]; T]) -> [f32; T] {
    let mut acc = [0.0f32; T];
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        for (b, wb) in w.chunks_exact(144).enumerate() {
            let (mut sc, mut mins) = ([0u8; 8], [0u8; 8]);
            for j in 0..8 {
                (sc[j], mins[j]) = scale_min_k4(j, &wb[4..16]);
            }
            let mut sums = [_mm256_setzero_si256(); T];
            for c in 0..4 {
                let q = load32(wb.as_ptr().add(16 + 32 * c));
                let (lo, hi) = (_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4));
                let (s_lo, s_hi) = (_mm256_set1_epi16(i16::from(sc[2 * c])), _mm256_set1_epi16(i16::from(sc[2 * c + 1])));
                for (sum, ai) in sums.iter_mut().zip(&a) {
                    let qs = ai.get_unchecked(b).qs.as_ptr() as *const u8;
                    let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(qs.add(64 * c))), s_lo);
                    let p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(qs.add(64 * c + 32))), s_hi);
                    *sum = _mm256_add_epi32(*sum, _mm256_add_epi32(p_lo, p_hi));
                }
            }
            for ((r, sum), ai) in acc.iter_mut().zip(&sums).zip(&a) {
                let ab = ai.get_unchecked(b);
                *r += q4_k_block_value(wb, ab, hsum_i32(*sum), q4_k_min_sum(&mins, ab));
            }
        }
    }
    acc
}

/// Q6_K row `w` against `T` q8_K rows.
///
/// # Safety
/// AVX2 is available; each `a[i]` holds a block per 256 weights of `w`.
#[target_feature(enable = "avx2")]
pub unsafe fn q6_k<const T: usize>(w: &[u8], a: [&[BlockQ8K]; T]) -> [f32; T] {
    let mut acc = [0.0f32; T];
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        for (b, wb) in w.chunks_exact(210).enumerate() {
            let scales = &wb[192..208];
            let mut sums = [_mm256_setzero_si256(); T];
            for h in 0..2 {
                let ql0 = load32(wb.as_ptr().add(64 * h));
                let ql1 = load32(wb.as_ptr().add(64 * h + 32));
                let qh = load32(wb.as_ptr().add(128 + 32 * h));
                // Six-bit values 0..63 of the half's four runs of 32 (the top two bits moved
                // into place by 16-bit shifts of masked bytes, which never cross a byte).
                let q = [
                    _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16::<4>(_mm256_and_si256(qh, _mm256_set1_epi8(0x03)))),
                    _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16::<2>(_mm256_and_si256(qh, _mm256_set1_epi8(0x0C)))),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4), _mm256_and_si256(qh, _mm256_set1_epi8(0x30))),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4), _mm256_srli_epi16::<2>(_mm256_and_si256(qh, _mm256_set1_epi8(0xC0u8 as i8)))),
                ];
                for (j, qj) in q.iter().enumerate() {
                    let s = 8 * h + 2 * j;
                    let scale = _mm256_set_m128i(_mm_set1_epi16(i16::from(scales[s + 1] as i8)), _mm_set1_epi16(i16::from(scales[s] as i8)));
                    for (sum, ai) in sums.iter_mut().zip(&a) {
                        let qs = ai.get_unchecked(b).qs.as_ptr() as *const u8;
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(*qj, load32(qs.add(128 * h + 32 * j))), scale);
                        *sum = _mm256_add_epi32(*sum, p);
                    }
                }
            }
            let wd = f16_at(wb, 208);
            for ((r, sum), ai) in acc.iter_mut().zip(&sums).zip(&a) {
                let ab = ai.get_unchecked(b);
                let sumi = hsum_i32(*sum) - q6_k_offset_sum(scales, ab);
                *r += (ab.d * wd) * sumi as f32;
            }
        }
    }
    acc
}

/// Rows of 32-value blocks against `T` q8_0 rows; `weights` gives a block's 32 signed weights.
#[inline(always)]
unsafe fn lanes_rows<const B: usize, const T: usize>(w: &[u8], a: [&[BlockQ80]; T], weights: impl Fn(&[u8]) -> __m256i) -> [f32; T] {
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        for (b, wb) in w.chunks_exact(B).enumerate() {
            let wq = weights(wb);
            let mag = _mm256_sign_epi8(wq, wq);
            let wd = f16_at(wb, 0);
            for (lanes, ai) in acc.iter_mut().zip(&a) {
                let ab = ai.get_unchecked(b);
                let signed = _mm256_sign_epi8(load32(ab.qs.as_ptr() as *const u8), wq);
                // Lane k: the products of elements 4k..4k + 3.
                let s = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, signed), ones);
                *lanes = _mm256_add_ps(*lanes, _mm256_mul_ps(_mm256_set1_ps(wd * ab.d), _mm256_cvtepi32_ps(s)));
            }
        }
        acc.map(|v| {
            let mut l = [0.0f32; LANES];
            _mm256_storeu_ps(l.as_mut_ptr(), v);
            reduce_lanes(&l)
        })
    }
}

/// Q8_0 row `w` against `T` q8_0 rows.
///
/// # Safety
/// AVX2 is available; each `a[i]` holds a block per 32 weights of `w`.
#[target_feature(enable = "avx2")]
pub unsafe fn q8_0<const T: usize>(w: &[u8], a: [&[BlockQ80]; T]) -> [f32; T] {
    unsafe { lanes_rows::<34, T>(w, a, |wb| load32(wb.as_ptr().add(2))) }
}

/// Q4_0 row `w` against `T` q8_0 rows.
///
/// # Safety
/// AVX2 is available; each `a[i]` holds a block per 32 weights of `w`.
#[target_feature(enable = "avx2")]
pub unsafe fn q4_0<const T: usize>(w: &[u8], a: [&[BlockQ80]; T]) -> [f32; T] {
    unsafe {
        lanes_rows::<18, T>(w, a, |wb| {
            let q = _mm_loadu_si128(wb.as_ptr().add(2) as *const __m128i);
            let m4 = _mm_set1_epi8(0x0F);
            let nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(q), m4), _mm_and_si128(q, m4));
            _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8))
        })
    }
}
