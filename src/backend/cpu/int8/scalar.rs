//! The integer dot products written out plainly: the definition of every result of the
//! integer path. Within a weight block the products are summed exactly in i32; the block's
//! sums become f32 through the expressions below, in this order, and the blocks of a row are
//! added in f32 one after the other (K-quants), or into eight lanes of four consecutive values
//! each, summed at the end in the reference order of [`reduce_lanes`] (Q8_0, Q4_0). The AVX2
//! kernels compute the same integers and the same f32 operations, so they give the same bits.

use super::act::{BlockQ80, BlockQ8K, QK8_0, QK_K};
use crate::backend::cpu::dot::{reduce_lanes, LANES};

#[inline(always)]
pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Scale and minimum of sub-block `j` of a Q4_K / Q5_K block's 12 packed scale bytes.
#[inline(always)]
pub(super) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Sum over the block of `m_j * (activations of sub-block j)`, from the q8_K sums of 16.
#[inline(always)]
pub(super) fn q4_k_min_sum(mins: &[u8; 8], a: &BlockQ8K) -> i32 {
    (0..8).map(|j| i32::from(mins[j]) * (i32::from(a.bsums[2 * j]) + i32::from(a.bsums[2 * j + 1]))).sum()
}

/// A Q4_K block's value against its activation block, from the exact integer sums.
#[inline(always)]
pub(super) fn q4_k_block_value(w: &[u8], a: &BlockQ8K, sumi: i32, summ: i32) -> f32 {
    let (d, dmin) = (a.d * f16_at(w, 0), a.d * f16_at(w, 2));
    d * sumi as f32 - dmin * summ as f32
}

/// Q4_K (d, dmin, 12 scale bytes, 128 nibble bytes) against q8_K: each sub-block j of 32 has
/// value `d * sc_j * q - dmin * m_j`.
pub fn q4_k_row(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (wb, ab) in w.chunks_exact(144).zip(a) {
        let (mut sumi, mut mins) = (0i32, [0u8; 8]);
        for (j, m) in mins.iter_mut().enumerate() {
            let (sc, min) = scale_min_k4(j, &wb[4..16]);
            *m = min;
            let (c, shift) = (j / 2, 4 * (j % 2));
            let s: i32 = (0..32).map(|l| i32::from((wb[16 + 32 * c + l] >> shift) & 0xF) * i32::from(ab.qs[32 * j + l])).sum();
            sumi += i32::from(sc) * s;
        }
        acc += q4_k_block_value(wb, ab, sumi, q4_k_min_sum(&mins, ab));
    }
    acc
}

/// Sum over the block of `scale_s * 32 * (activations of sub-block s)`: the offset of Q6_K's
/// unsigned six-bit values.
#[inline(always)]
pub(super) fn q6_k_offset_sum(scales: &[u8], a: &BlockQ8K) -> i32 {
    (0..16).map(|s| i32::from(scales[s] as i8) * i32::from(a.bsums[s])).sum::<i32>() * 32
}

/// Q6_K (128 low-bit bytes, 64 high-bit bytes, 16 i8 scales, d) against q8_K: element e has
/// value `d * scale_{e/16} * (q - 32)`.
pub fn q6_k_row(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (wb, ab) in w.chunks_exact(210).zip(a) {
        let mut sumi = 0i32;
        for e in 0..QK_K {
            let (h, j, l) = (e / 128, (e % 128) / 32, e % 32);
            let ql = wb[64 * h + l + 32 * (j % 2)];
            let lo = if j >= 2 { ql >> 4 } else { ql & 0xF };
            let hi = (wb[128 + 32 * h + l] >> (2 * j)) & 3;
            let q = i32::from(lo | hi << 4);
            sumi += i32::from(wb[192 + e / 16] as i8) * q * i32::from(ab.qs[e]);
        }
        sumi -= q6_k_offset_sum(&wb[192..208], ab);
        acc += (ab.d * f16_at(wb, 208)) * sumi as f32;
    }
    acc
}

/// Rows of 32-value blocks (Q8_0, Q4_0): `value(wb, e)` is the integer weight of element `e`.
#[inline(always)]
fn lanes_row<const B: usize>(w: &[u8], a: &[BlockQ80], value: impl Fn(&[u8], usize) -> i32) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (wb, ab) in w.chunks_exact(B).zip(a) {
        let dd = f16_at(wb, 0) * ab.d;
        for (k, lane) in acc.iter_mut().enumerate() {
            let s: i32 = (4 * k..4 * k + 4).map(|e| value(wb, e) * i32::from(ab.qs[e])).sum();
            *lane += dd * s as f32;
        }
    }
    reduce_lanes(&acc)
}

/// Q8_0 (d, 32 i8) against q8_0.
pub fn q8_0_row(w: &[u8], a: &[BlockQ80]) -> f32 {
    lanes_row::<34>(w, a, |wb, e| i32::from(wb[2 + e] as i8))
}

/// Q4_0 (d, 16 bytes: element j in the low nibble of byte j, element j + 16 in the high one)
/// against q8_0: value `d * (q - 8)`.
pub fn q4_0_row(w: &[u8], a: &[BlockQ80]) -> f32 {
    lanes_row::<18>(w, a, |wb, e| i32::from((wb[2 + e % 16] >> (4 * (e / 16))) & 0xF) - 8)
}

const _: () = assert!(QK8_0 == 4 * LANES);
