//! AVX2 forms of the [`scalar`](super::scalar) integer dot products: one weight row against `T`
//! activation rows (up to four tokens), each weight block unpacked once for all of them. The
//! products go through `_mm256_maddubs_epi16` (unsigned weight bytes, or their magnitudes with
//! the signs moved onto the activations, times signed activation bytes) and
//! `_mm256_madd_epi16`; no i16 sum can saturate with activations in [-127, 127], so every
//! lane's integer is the scalar one, and the f32 steps are the scalar ones in the same order.
//!
//! Activation rows are `stride` blocks apart: token `i`'s block `b` is `a[i * stride + b]`.

use super::act::{BlockQ80, BlockQ8K, QK_K};
use super::scalar;
use super::scalar::q4_k_scales_mins;
use crate::backend::cpu::dot::{reduce_lanes, LANES};
use std::arch::x86_64::*;

#[inline(always)]
unsafe fn load32(p: *const u8) -> __m256i {
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// The eight lanes of each accumulator summed in the reference order.
#[inline(always)]
unsafe fn lanes_sums<const T: usize>(acc: &[__m256; T]) -> [f32; T] {
    let mut out = [0.0f32; T];
    for (o, v) in out.iter_mut().zip(acc) {
        let mut l = [0.0f32; LANES];
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), *v) };
        *o = reduce_lanes(&l);
    }
    out
}

/// The f16 at `b[at..at + 2]` as f32 (exact, as `half` converts it), inline with F16C.
#[inline(always)]
unsafe fn f16_at(b: &[u8], at: usize) -> f32 {
    let bits = i32::from(u16::from_le_bytes([b[at], b[at + 1]]));
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits))) }
}

/// Q4_K row `w` against `T` q8_K rows.
///
/// # Safety
/// AVX2 and F16C are available; `a` holds `T` rows of a block per 256 weights of `w`, `stride` apart.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn q4_k<const T: usize>(w: &[u8], a: &[BlockQ8K], stride: usize) -> [f32; T] {
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); T];
        for (b, wb) in w.chunks_exact(144).enumerate() {
            let sm = _mm_loadu_si128(q4_k_scales_mins(&wb[4..16]).as_ptr() as *const __m128i);
            // Scales as i16 in both halves; minimums as i16 pairs (m0, m0, m1, m1, ...).
            let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
            let m = _mm_cvtepu8_epi16(_mm_srli_si128::<8>(sm));
            let mins = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
            let mut sums = [_mm256_setzero_si256(); T];
            for c in 0..4 {
                let q = load32(wb.as_ptr().add(16 + 32 * c));
                let (lo, hi) = (_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4));
                // Scale 2c and 2c + 1 (i16 lanes of `scales`) in every i16 lane.
                let pick = |j: i8| _mm256_set1_epi16(i16::from_le_bytes([2 * j as u8, 2 * j as u8 + 1]));
                let s_lo = _mm256_shuffle_epi8(scales, pick(2 * c as i8));
                let s_hi = _mm256_shuffle_epi8(scales, pick(2 * c as i8 + 1));
                for (i, sum) in sums.iter_mut().enumerate() {
                    let qs = a.get_unchecked(i * stride + b).qs.as_ptr() as *const u8;
                    let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(qs.add(64 * c))), s_lo);
                    let p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(qs.add(64 * c + 32))), s_hi);
                    *sum = _mm256_add_epi32(*sum, _mm256_add_epi32(p_lo, p_hi));
                }
            }
            let (wd, wdmin) = (f16_at(wb, 0), f16_at(wb, 2));
            for (i, (lanes, sum)) in acc.iter_mut().zip(&sums).enumerate() {
                let ab = a.get_unchecked(i * stride + b);
                let bsums = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
                let min_lanes = _mm256_madd_epi16(mins, bsums);
                let (d, dmin) = (_mm256_set1_ps(ab.d * wd), _mm256_set1_ps(ab.d * wdmin));
                *lanes = _mm256_sub_ps(_mm256_add_ps(*lanes, _mm256_mul_ps(d, _mm256_cvtepi32_ps(*sum))), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(min_lanes)));
            }
        }
        lanes_sums(&acc)
    }
}

/// Q6_K row `w` against `T` q8_K rows.
///
/// # Safety
/// AVX2 and F16C are available; `a` holds `T` rows of a block per 256 weights of `w`, `stride` apart.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn q6_k<const T: usize>(w: &[u8], a: &[BlockQ8K], stride: usize) -> [f32; T] {
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); T];
        for (b, wb) in w.chunks_exact(210).enumerate() {
            let sc8 = _mm_loadu_si128(wb.as_ptr().add(192) as *const __m128i);
            let scales = _mm256_cvtepi8_epi16(sc8);
            // Each half's eight scales as i16 in both 128-bit lanes, for the shuffles below.
            let halves = [_mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc8)), _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128::<8>(sc8)))];
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
                    // Scale 8h + 2j for the run's first 16 values (low lane), 8h + 2j + 1 for
                    // the last 16 (high lane).
                    let pick = |i: usize| _mm_set1_epi16(i16::from_le_bytes([2 * i as u8, 2 * i as u8 + 1]));
                    let scale = _mm256_shuffle_epi8(halves[h], _mm256_set_m128i(pick(2 * j + 1), pick(2 * j)));
                    for (i, sum) in sums.iter_mut().enumerate() {
                        let qs = a.get_unchecked(i * stride + b).qs.as_ptr() as *const u8;
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(*qj, load32(qs.add(128 * h + 32 * j))), scale);
                        *sum = _mm256_add_epi32(*sum, p);
                    }
                }
            }
            let wd = f16_at(wb, 208);
            for (i, (lanes, sum)) in acc.iter_mut().zip(&sums).enumerate() {
                let ab = a.get_unchecked(i * stride + b);
                let offsets = _mm256_madd_epi16(scales, _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i));
                let net = _mm256_sub_epi32(*sum, _mm256_slli_epi32::<5>(offsets));
                *lanes = _mm256_add_ps(*lanes, _mm256_mul_ps(_mm256_set1_ps(ab.d * wd), _mm256_cvtepi32_ps(net)));
            }
        }
        lanes_sums(&acc)
    }
}

/// Rows of 32-value blocks against `T` q8_0 rows; `weights` gives a block's 32 signed weights.
#[inline(always)]
unsafe fn lanes_rows<const B: usize, const T: usize>(w: &[u8], a: &[BlockQ80], stride: usize, weights: impl Fn(&[u8]) -> __m256i) -> [f32; T] {
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        for (b, wb) in w.chunks_exact(B).enumerate() {
            let wq = weights(wb);
            let mag = _mm256_sign_epi8(wq, wq);
            let wd = f16_at(wb, 0);
            for (i, lanes) in acc.iter_mut().enumerate() {
                let ab = a.get_unchecked(i * stride + b);
                let signed = _mm256_sign_epi8(load32(ab.qs.as_ptr() as *const u8), wq);
                // Lane k: the products of elements 4k..4k + 3.
                let s = _mm256_madd_epi16(_mm256_maddubs_epi16(mag, signed), ones);
                *lanes = _mm256_add_ps(*lanes, _mm256_mul_ps(_mm256_set1_ps(wd * ab.d), _mm256_cvtepi32_ps(s)));
            }
        }
        lanes_sums(&acc)
    }
}

/// Q8_0 row `w` against `T` q8_0 rows.
///
/// # Safety
/// AVX2 and F16C are available; `a` holds `T` rows of a block per 32 weights of `w`, `stride` apart.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn q8_0<const T: usize>(w: &[u8], a: &[BlockQ80], stride: usize) -> [f32; T] {
    unsafe { lanes_rows::<34, T>(w, a, stride, |wb| load32(wb.as_ptr().add(2))) }
}

/// Q4_0 row `w` against `T` q8_0 rows.
///
/// # Safety
/// AVX2 and F16C are available; `a` holds `T` rows of a block per 32 weights of `w`, `stride` apart.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn q4_0<const T: usize>(w: &[u8], a: &[BlockQ80], stride: usize) -> [f32; T] {
    unsafe {
        lanes_rows::<18, T>(w, a, stride, |wb| {
            let q = _mm_loadu_si128(wb.as_ptr().add(2) as *const __m128i);
            let m4 = _mm_set1_epi8(0x0F);
            let nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(q), m4), _mm_and_si128(q, m4));
            _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8))
        })
    }
}

/// Int4 row `w` (groups of `group`, see [`scalar::int4_row`]) against `T` q8_K rows. The
/// weights stay unsigned (0..15) in `_mm256_maddubs_epi16`; a piece's i16 products are summed
/// over its runs before widening (at most eight runs of at most 2 * 15 * 127 each fit in i16).
///
/// # Safety
/// AVX2 and F16C are available; `a` holds `T` rows of a block per 256 weights of `w`, `stride`
/// apart; `group` is one [`super::int4_takes_q8k`] accepts.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn int4<const T: usize>(w: &[u8], group: usize, a: &[BlockQ8K], stride: usize) -> [f32; T] {
    // Groups of 128 (GPTQ's and AutoRound's default) with the loops' bounds known.
    unsafe { if group == 128 { int4_rows::<T>(w, 128, a, stride) } else { int4_rows::<T>(w, group, a, stride) } }
}

#[inline(always)]
unsafe fn int4_rows<const T: usize>(w: &[u8], group: usize, a: &[BlockQ8K], stride: usize) -> [f32; T] {
    unsafe {
        let header = kestrel_quant::int4::HEADER_BYTES;
        let (m4, ones16) = (_mm_set1_epi8(0x0F), _mm256_set1_epi16(1));
        let mut acc = [_mm256_setzero_ps(); T];
        for (g, wg) in w.chunks_exact(header + group / 2).enumerate() {
            let (scale, zero) = (f16_at(wg, 0), _mm256_set1_epi32(i32::from(wg[2])));
            for (p, (block, at, len)) in scalar::int4_pieces(g, group).enumerate() {
                let mut sums = [_mm256_setzero_si256(); T];
                for r in (0..len).step_by(32) {
                    let qb = _mm_loadu_si128(wg.as_ptr().add(header + (p * QK_K + r) / 2) as *const __m128i);
                    let (lo, hi) = (_mm_and_si128(qb, m4), _mm_and_si128(_mm_srli_epi16::<4>(qb), m4));
                    // Elements in order: bytes 0..8 interleaved are elements 0..16, bytes 8..16 the rest.
                    let q = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
                    for (i, sum) in sums.iter_mut().enumerate() {
                        let qs = a.get_unchecked(i * stride + block).qs.as_ptr().add(at + r) as *const u8;
                        *sum = _mm256_add_epi16(*sum, _mm256_maddubs_epi16(q, load32(qs)));
                    }
                }
                for (i, (lanes, sum)) in acc.iter_mut().zip(&sums).enumerate() {
                    let ab = a.get_unchecked(i * stride + block);
                    let zero_lanes = int4_zero_lanes(&ab.bsums, at / 16, len / 16);
                    let net = _mm256_sub_epi32(_mm256_madd_epi16(*sum, ones16), _mm256_mullo_epi32(zero, zero_lanes));
                    *lanes = _mm256_add_ps(*lanes, _mm256_mul_ps(_mm256_set1_ps(scale * ab.d), _mm256_cvtepi32_ps(net)));
                }
            }
        }
        lanes_sums(&acc)
    }
}

/// Lane k: the sum of `bsums[j]` over `j0 <= j < j0 + n` with `j % 8 == k`.
#[inline(always)]
unsafe fn int4_zero_lanes(bsums: &[i16; QK_K / 16], j0: usize, n: usize) -> __m256i {
    unsafe {
        match n {
            // Whole octets (groups of 128 and 256): j0 is a multiple of 8.
            8 => _mm256_cvtepi16_epi32(_mm_loadu_si128(bsums.as_ptr().add(j0) as *const __m128i)),
            16 => _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm_loadu_si128(bsums.as_ptr() as *const __m128i)), _mm256_cvtepi16_epi32(_mm_loadu_si128(bsums.as_ptr().add(8) as *const __m128i))),
            _ => {
                let mut lanes = [0i32; LANES];
                for j in j0..j0 + n {
                    lanes[j % LANES] += i32::from(bsums[j]);
                }
                _mm256_loadu_si256(lanes.as_ptr() as *const __m256i)
            }
        }
    }
}
