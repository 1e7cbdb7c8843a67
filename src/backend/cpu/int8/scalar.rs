//! The integer dot products written out plainly: the definition of every result of the
//! integer path. Each weight row is summed in eight lanes, as the AVX2 registers hold it: per
//! block, lane `k`'s integer sum is exact (i32), becomes f32, is scaled by the block's f32
//! factor and added to the lane's f32 total, block after block; at the end the lanes are summed
//! in the reference order of [`reduce_lanes`]. Which products fall in which lane is that of
//! `_mm256_maddubs_epi16` followed by `_mm256_madd_epi16`: lane `k` of a run of 32 values
//! holds values `4k..4k + 3`. The AVX2 kernels compute the same integers and the same f32
//! operations (no fused multiply-add), so they give the same bits.

use super::act::{BlockQ80, BlockQ8K, QK_K};
use crate::backend::cpu::dot::{reduce_lanes, LANES};

#[inline(always)]
pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Scales (first eight bytes) and minimums (last eight) of a Q4_K block's 12 packed scale
/// bytes, six bits each (llama.cpp's unpacking).
#[inline(always)]
pub(super) fn q4_k_scales_mins(s: &[u8]) -> [u8; 16] {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    let u = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (u0, u1, u2) = (u(0), u(1), u(2));
    let words = [u0 & K1, (u2 & K2) | (((u0 >> 6) & K3) << 4), u1 & K1, ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4)];
    let mut out = [0u8; 16];
    for (o, w) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// Lane `k` of the q8_K sums of 16 weighted per pair: `f(2k) * bsums[2k] + f(2k + 1) *
/// bsums[2k + 1]`.
#[inline(always)]
fn bsum_lanes(a: &BlockQ8K, f: impl Fn(usize) -> i32) -> [i32; LANES] {
    std::array::from_fn(|k| f(2 * k) * i32::from(a.bsums[2 * k]) + f(2 * k + 1) * i32::from(a.bsums[2 * k + 1]))
}

/// Lane `k` of a run of 32: `sum over b in 4k..4k + 3 of q(b) * a[b]`.
#[inline(always)]
fn run_lanes(a: &[i8], q: impl Fn(usize) -> i32) -> [i32; LANES] {
    std::array::from_fn(|k| (4 * k..4 * k + 4).map(|b| q(b) * i32::from(a[b])).sum())
}

/// Q4_K (d, dmin, 12 scale bytes, 128 nibble bytes) against q8_K: sub-block j (32 values)
/// has value `d * sc_j * q - dmin * m_j`. Per block: `lane = (lane + (a.d * d) * sums) -
/// (a.d * dmin) * mins`, with `mins` lane k = `m_k * (bsums[2k] + bsums[2k + 1])`.
pub fn q4_k_row(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (wb, ab) in w.chunks_exact(144).zip(a) {
        let sm = q4_k_scales_mins(&wb[4..16]);
        let mut sums = [0i32; LANES];
        for j in 0..8 {
            let (c, shift) = (j / 2, 4 * (j % 2));
            let run = run_lanes(&ab.qs[32 * j..32 * j + 32], |b| i32::from((wb[16 + 32 * c + b] >> shift) & 0xF));
            for (s, r) in sums.iter_mut().zip(run) {
                *s += i32::from(sm[j]) * r;
            }
        }
        let mins = bsum_lanes(ab, |s| i32::from(sm[8 + s / 2]));
        let (d, dmin) = (ab.d * f16_at(wb, 0), ab.d * f16_at(wb, 2));
        for k in 0..LANES {
            acc[k] = (acc[k] + d * sums[k] as f32) - dmin * mins[k] as f32;
        }
    }
    reduce_lanes(&acc)
}

/// The six-bit value (0..63) of element `32j + b` of 128-value half `h` of a Q6_K block.
#[inline(always)]
fn q6_value(wb: &[u8], h: usize, j: usize, b: usize) -> i32 {
    let ql = wb[64 * h + b + 32 * (j % 2)];
    let lo = if j >= 2 { ql >> 4 } else { ql & 0xF };
    i32::from(lo | ((wb[128 + 32 * h + b] >> (2 * j)) & 3) << 4)
}

/// Q6_K (128 low-bit bytes, 64 high-bit bytes, 16 i8 scales, d) against q8_K: element e has
/// value `d * scale_{e/16} * (q - 32)`. Per block: `lane = lane + (a.d * d) * (sums -
/// offsets)`, with `offsets` lane k = `32 * (sc_2k * bsums[2k] + sc_2k+1 * bsums[2k + 1])`.
pub fn q6_k_row(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (wb, ab) in w.chunks_exact(210).zip(a) {
        let scale = |s: usize| i32::from(wb[192 + s] as i8);
        let mut sums = [0i32; LANES];
        for h in 0..2 {
            for j in 0..4 {
                let e0 = 128 * h + 32 * j;
                let run = run_lanes(&ab.qs[e0..e0 + 32], |b| q6_value(wb, h, j, b));
                for (k, (s, r)) in sums.iter_mut().zip(run).enumerate() {
                    *s += scale(e0 / 16 + k / 4) * r;
                }
            }
        }
        let offsets = bsum_lanes(ab, scale);
        let d = ab.d * f16_at(wb, 208);
        for k in 0..LANES {
            acc[k] += d * (sums[k] - 32 * offsets[k]) as f32;
        }
    }
    reduce_lanes(&acc)
}

/// Rows of 32-value blocks (Q8_0, Q4_0): `value(wb, e)` is the integer weight of element `e`;
/// per block `lane = lane + (d * a.d) * sums`.
#[inline(always)]
fn lanes_row<const B: usize>(w: &[u8], a: &[BlockQ80], value: impl Fn(&[u8], usize) -> i32) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (wb, ab) in w.chunks_exact(B).zip(a) {
        let dd = f16_at(wb, 0) * ab.d;
        let sums = run_lanes(&ab.qs, |e| value(wb, e));
        for (lane, s) in acc.iter_mut().zip(sums) {
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

/// The pieces of Int4 group `g` (of `group` elements) that integer sums run over: one per q8_K
/// block the group touches, as (block, first element within it, elements). A group lies within
/// one block or spans whole ones (its size divides 256 or is a multiple of it; see
/// [`super::int4_takes_q8k`]).
#[inline(always)]
pub(super) fn int4_pieces(g: usize, group: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let e0 = g * group;
    (0..group.div_ceil(QK_K)).map(move |p| {
        let e = e0 + p * QK_K;
        (e / QK_K, e % QK_K, group.min(QK_K))
    })
}

/// Int4 groups (a 4-byte header: f16 scale, u8 zero, a reserved byte; then `group / 2` bytes,
/// element 2i in the low nibble of byte i and 2i + 1 in the high one) against q8_K: value
/// `scale * (q - zero)`. Per piece of a group within one q8_K block: lane k sums `q * a` over
/// elements `4k..4k + 3` of each run of 32 (exact in i32), less `zero` times the sum of the
/// piece's 16-value activation sums `bsums[j]` with `j % 8 == k`; then `lane = lane + (scale *
/// a.d) * net`.
pub fn int4_row(w: &[u8], group: usize, a: &[BlockQ8K]) -> f32 {
    let header = kestrel_quant::int4::HEADER_BYTES;
    let mut acc = [0.0f32; LANES];
    for (g, wg) in w.chunks_exact(header + group / 2).enumerate() {
        let (scale, zero) = (f16_at(wg, 0), i32::from(wg[2]));
        for (p, (block, at, len)) in int4_pieces(g, group).enumerate() {
            let ab = &a[block];
            let mut sums = [0i32; LANES];
            for r in (0..len).step_by(32) {
                let bytes = &wg[header + (p * QK_K + r) / 2..];
                let run = run_lanes(&ab.qs[at + r..at + r + 32], |b| i32::from((bytes[b / 2] >> (4 * (b % 2))) & 0xF));
                for (s, v) in sums.iter_mut().zip(run) {
                    *s += v;
                }
            }
            let mut zero_lanes = [0i32; LANES];
            for j in at / 16..(at + len) / 16 {
                zero_lanes[j % LANES] += i32::from(ab.bsums[j]);
            }
            let dd = scale * ab.d;
            for k in 0..LANES {
                acc[k] += dd * (sums[k] - zero * zero_lanes[k]) as f32;
            }
        }
    }
    reduce_lanes(&acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The packed scales unpack as the format's definition (`kestrel_quant`'s per-index form).
    #[test]
    fn q4_k_scales_unpack_as_defined() {
        let mut seed = 1u32;
        for _ in 0..200 {
            let s: Vec<u8> = (0..12)
                .map(|_| {
                    seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    (seed >> 16) as u8
                })
                .collect();
            let sm = q4_k_scales_mins(&s);
            for j in 0..8 {
                let want = if j < 4 { (s[j] & 63, s[j + 4] & 63) } else { ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)) };
                assert_eq!((sm[j], sm[8 + j]), want, "sub-block {j} of {s:?}");
            }
        }
    }
}
