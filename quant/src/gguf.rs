//! GGUF block formats, dequantized as llama.cpp's reference `dequantize_row_*` (ggml-quants.c)
//! does, operation for operation, so results match it bit for bit.
//!
//! Each function decodes one block: `[u8; B]` on-disk bytes into `[f32; E]` values. f16 fields
//! are little-endian IEEE half.

use crate::f16_at;

/// Non-linear 4-bit codebook of IQ4_NL / IQ4_XS (`kvalues_iq4nl`).
const IQ4_VALUES: [f32; 16] = [-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0];

/// Decodes every whole block of `bytes` into `out` with `block`; the caller has checked that
/// both hold the same number of whole blocks.
#[inline(always)]
pub(crate) fn blocks<const B: usize, const E: usize>(bytes: &[u8], out: &mut [f32], block: fn(&[u8; B], &mut [f32; E])) {
    for (b, o) in bytes.as_chunks::<B>().0.iter().zip(out.as_chunks_mut::<E>().0) {
        block(b, o);
    }
}

/// Q4_0: d:f16, qs[16]. Low nibbles are elements 0..16, high nibbles 16..32; value d*(q-8).
#[inline(always)]
pub(crate) fn q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = d * ((q & 0xF) as i32 - 8) as f32;
        y[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
    }
}

/// Q4_1: d:f16, m:f16, qs[16]; value d*q + m.
#[inline(always)]
pub(crate) fn q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = d * (q & 0xF) as f32 + m;
        y[j + 16] = d * (q >> 4) as f32 + m;
    }
}

/// Q5_0: d:f16, qh:u32, qs[16]; bit j of qh is the fifth bit of element j; value d*(q-16).
#[inline(always)]
pub(crate) fn q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let q = b[6 + j] as u32;
        let lo = (q & 0xF) | ((qh >> j) & 1) << 4;
        let hi = (q >> 4) | ((qh >> (j + 16)) & 1) << 4;
        y[j] = d * (lo as i32 - 16) as f32;
        y[j + 16] = d * (hi as i32 - 16) as f32;
    }
}

/// Q5_1: d:f16, m:f16, qh:u32, qs[16]; value d*q + m.
#[inline(always)]
pub(crate) fn q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let q = b[8 + j] as u32;
        let lo = (q & 0xF) | ((qh >> j) & 1) << 4;
        let hi = (q >> 4) | ((qh >> (j + 16)) & 1) << 4;
        y[j] = d * lo as f32 + m;
        y[j + 16] = d * hi as f32 + m;
    }
}

/// Q8_0: d:f16, qs:i8[32]; value d*q.
#[inline(always)]
pub(crate) fn q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = d * (b[2 + j] as i8) as f32;
    }
}

/// The 6-bit (scale, min) pair of sub-block `j` from a k-quant's 12 packed scale bytes
/// (`get_scale_min_k4`).
#[inline(always)]
fn scale_min_k4(j: usize, s: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 { (s[j] & 63, s[j + 4] & 63) } else { ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)) };
    (sc as f32, m as f32)
}

/// Q4_K: d:f16, dmin:f16, scales[12], qs[128]. Each 64-element chunk c uses 32 qs bytes: low
/// nibbles for its first 32 elements (sub-block 2c), high nibbles for the next 32 (2c+1).
/// Value (d*sc)*q - dmin*m.
#[inline(always)]
pub(crate) fn q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        for l in 0..32 {
            let q = b[16 + 32 * c + l];
            y[64 * c + l] = d1 * (q & 0xF) as f32 - m1;
            y[64 * c + 32 + l] = d2 * (q >> 4) as f32 - m2;
        }
    }
}

/// Q5_K: d:f16, dmin:f16, scales[12], qh[32], qs[128]; as Q4_K, with bit `i` of qh[l] the fifth
/// bit of element 32i + l.
#[inline(always)]
pub(crate) fn q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        for l in 0..32 {
            let q = b[48 + 32 * c + l];
            let h = qh[l] >> (2 * c);
            y[64 * c + l] = d1 * ((q & 0xF) | (h & 1) << 4) as f32 - m1;
            y[64 * c + 32 + l] = d2 * ((q >> 4) | ((h >> 1) & 1) << 4) as f32 - m2;
        }
    }
}

/// Q6_K: ql[128], qh[64], scales:i8[16], d:f16. Per 128-element half h: element 32j + l (j < 4,
/// l < 32) takes its low 4 bits from ql[64h + l + 32(j%2)] (high nibble when j >= 2) and its top
/// 2 bits from qh[32h + l] >> 2j. Element e uses scales[e/16]; value (d*sc)*(q-32).
#[inline(always)]
pub(crate) fn q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let d = f16_at(b, 208);
    let mut ds = [0f32; 16];
    for (i, s) in ds.iter_mut().enumerate() {
        *s = d * (b[192 + i] as i8) as f32;
    }
    for h in 0..2 {
        let (ql, qh) = (&b[64 * h..64 * h + 64], &b[128 + 32 * h..128 + 32 * h + 32]);
        let (y, ds) = (&mut y[128 * h..128 * h + 128], &ds[8 * h..8 * h + 8]);
        for l in 0..32 {
            let q1 = ((ql[l] & 0xF) | (qh[l] & 3) << 4) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) as i32 - 32;
            let q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) as i32 - 32;
            let is = l / 16;
            y[l] = ds[is] * q1 as f32;
            y[l + 32] = ds[is + 2] * q2 as f32;
            y[l + 64] = ds[is + 4] * q3 as f32;
            y[l + 96] = ds[is + 6] * q4 as f32;
        }
    }
}

/// IQ4_NL: d:f16, qs[16]; as Q4_0's nibble order, value d*IQ4_VALUES[q].
#[inline(always)]
pub(crate) fn iq4_nl(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = d * IQ4_VALUES[(q & 0xF) as usize];
        y[j + 16] = d * IQ4_VALUES[(q >> 4) as usize];
    }
}

/// IQ4_XS: d:f16, scales_h:u16, scales_l[4], qs[128]. Sub-block ib (32 elements, 16 qs bytes)
/// has a 6-bit scale: low 4 bits from scales_l (nibble ib%2 of byte ib/2), top 2 from bits
/// 2ib..2ib+1 of scales_h; value (d*(ls-32))*IQ4_VALUES[q].
#[inline(always)]
pub(crate) fn iq4_xs(b: &[u8; 136], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]) as u32;
    for ib in 0..8 {
        let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) as u32 & 0xF;
        let ls = lo | ((scales_h >> (2 * ib)) & 3) << 4;
        let dl = d * (ls as i32 - 32) as f32;
        let (qs, y) = (&b[8 + 16 * ib..8 + 16 * ib + 16], &mut y[32 * ib..32 * ib + 32]);
        for j in 0..16 {
            y[j] = dl * IQ4_VALUES[(qs[j] & 0xF) as usize];
            y[j + 16] = dl * IQ4_VALUES[(qs[j] >> 4) as usize];
        }
    }
}
