//! Quantization of f32 weights into the row formats: the online modes (`--quantization fp8`,
//! `int4`, `q4_k`), random-weight presets at real sizes, and the tests' quantized models.
//!
//! These are plain round-to-nearest quantizers (min-max scales, no search for the scale that
//! minimizes the error as llama.cpp's `make_qkx` or AutoRound do): every value they write is a
//! valid block of its format, which [`crate::dequantize`] reads back.

use half::f16;

use crate::{shape_product, Dtype, QuantError};

/// The largest finite e4m3 value.
const E4M3_MAX: f32 = 448.0;

/// The e4m3 byte nearest to `x` (ties to even), saturating at ±448; NaN maps to the NaN code.
pub fn e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    // Subnormals are multiples of 2^-9 below 2^-6; 2^-6 itself is code 8 either way.
    if a < 2f32.powi(-6) {
        let m = round_half_even(a * 512.0) as u8;
        return sign | m;
    }
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127;
    // Keep 3 of the 23 mantissa bits, rounding the other 20 to nearest even.
    let mant = bits & 0x7F_FFFF;
    let (mut m, rest) = (mant >> 20, mant & 0xF_FFFF);
    if rest > 0x8_0000 || (rest == 0x8_0000 && m & 1 == 1) {
        m += 1;
    }
    let (exp, m) = if m == 8 { (exp + 1, 0) } else { (exp, m) };
    let code = (((exp + 7) as u32) << 3 | m).min(0x7E) as u8;
    sign | code
}

fn round_half_even(v: f32) -> f32 {
    let r = v.round();
    if (v - v.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - v.signum()
    } else {
        r
    }
}

/// Quantizes `rows x cols` row-major values into `rows` rows of `dtype`: `Int4 { group }`,
/// `F8E4M3Scaled { block }`, Q8_0, Q5_0, Q4_K or Q6_K.
pub fn quantize(dtype: Dtype, values: &[f32], rows: usize, cols: usize) -> Result<Vec<u8>, QuantError> {
    let n = shape_product(rows, cols)?;
    if values.len() != n {
        return Err(QuantError::OutputSize { have: values.len(), want: n });
    }
    let row_bytes = dtype.row_bytes(cols)?;
    let mut out = vec![0u8; shape_product(rows, row_bytes)?];
    if cols == 0 {
        return Ok(out);
    }
    let block = dtype.block_elems();
    let bytes = dtype.block_bytes();
    let encode: fn(&[f32], &mut [u8]) = match dtype {
        Dtype::Int4 { .. } => int4_group,
        Dtype::F8E4M3Scaled { .. } => fp8_block,
        Dtype::Q8_0 => q8_0,
        Dtype::Q5_0 => q5_0,
        Dtype::Q4K => q4_k,
        Dtype::Q6K => q6_k,
        other => return Err(QuantError::NoQuantizer { dtype: other }),
    };
    for (x, y) in values.chunks_exact(block).zip(out.chunks_exact_mut(bytes)) {
        encode(x, y);
    }
    Ok(out)
}

/// f16 scale, u8 zero, u8 reserved, nibbles: asymmetric min-max over the group.
fn int4_group(x: &[f32], y: &mut [u8]) {
    let (lo, hi) = min_max(x);
    let (lo, hi) = (lo.min(0.0), hi.max(0.0));
    let scale = f16::from_f32((hi - lo) / 15.0);
    let s = scale.to_f32();
    let zero = if s > 0.0 { (-lo / s).round().clamp(0.0, 15.0) } else { 0.0 };
    y[..2].copy_from_slice(&scale.to_le_bytes());
    y[2] = zero as u8;
    y[3] = 0;
    let q = |v: f32| if s > 0.0 { (v / s + zero).round().clamp(0.0, 15.0) as u8 } else { zero as u8 };
    for (b, pair) in y[4..].iter_mut().zip(x.chunks_exact(2)) {
        *b = q(pair[0]) | q(pair[1]) << 4;
    }
}

/// f32 scale (amax / 448), then e4m3 bytes.
fn fp8_block(x: &[f32], y: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
    y[..4].copy_from_slice(&scale.to_le_bytes());
    for (b, v) in y[4..].iter_mut().zip(x) {
        *b = e4m3_from_f32(v / scale);
    }
}

/// d (f16, amax / 127), int8 values.
fn q8_0(x: &[f32], y: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = f16::from_f32(amax / 127.0);
    let inv = if d.to_f32() > 0.0 { 1.0 / d.to_f32() } else { 0.0 };
    y[..2].copy_from_slice(&d.to_le_bytes());
    for (b, v) in y[2..].iter_mut().zip(x) {
        *b = (v * inv).round().clamp(-127.0, 127.0) as i8 as u8;
    }
}

/// d (f16, amax / 15), fifth bits, nibbles (low: elements 0..16, high: 16..32); value d*(q-16).
fn q5_0(x: &[f32], y: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = f16::from_f32(amax / 15.0);
    let inv = if d.to_f32() > 0.0 { 1.0 / d.to_f32() } else { 0.0 };
    let q: Vec<u32> = x.iter().map(|v| ((v * inv).round().clamp(-16.0, 15.0) + 16.0) as u32).collect();
    y[..2].copy_from_slice(&d.to_le_bytes());
    let qh: u32 = q.iter().enumerate().map(|(j, &v)| ((v >> 4) & 1) << j).sum();
    y[2..6].copy_from_slice(&qh.to_le_bytes());
    for j in 0..16 {
        y[6 + j] = (q[j] & 0xF) as u8 | ((q[j + 16] & 0xF) as u8) << 4;
    }
}

/// Q4_K: per 32-element sub-block a min-max scale and min, quantized to 6 bits against the
/// super-block's f16 d and dmin.
fn q4_k(x: &[f32], y: &mut [u8]) {
    let mut scale = [0f32; 8];
    let mut min = [0f32; 8];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let (lo, hi) = min_max(sub);
        let lo = lo.min(0.0);
        scale[j] = (hi - lo) / 15.0;
        min[j] = -lo;
    }
    let d = f16::from_f32(scale.iter().fold(0.0f32, |m, &v| m.max(v)) / 63.0);
    let dmin = f16::from_f32(min.iter().fold(0.0f32, |m, &v| m.max(v)) / 63.0);
    let six = |v: f32, unit: f32| if unit > 0.0 { (v / unit).round().clamp(0.0, 63.0) as u8 } else { 0 };
    let sc: Vec<u8> = scale.iter().map(|&s| six(s, d.to_f32())).collect();
    let m: Vec<u8> = min.iter().map(|&v| six(v, dmin.to_f32())).collect();
    y[..2].copy_from_slice(&d.to_le_bytes());
    y[2..4].copy_from_slice(&dmin.to_le_bytes());
    // The inverse of get_scale_min_k4 (quant-formats.md 4.3).
    for j in 0..4 {
        y[4 + j] = sc[j] | (sc[j + 4] >> 4) << 6;
        y[8 + j] = m[j] | (m[j + 4] >> 4) << 6;
        y[12 + j] = (sc[j + 4] & 0xF) | (m[j + 4] & 0xF) << 4;
    }
    let mut q = [0u8; 256];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let (ds, dm) = (d.to_f32() * sc[j] as f32, dmin.to_f32() * m[j] as f32);
        for (i, &v) in sub.iter().enumerate() {
            q[32 * j + i] = if ds > 0.0 { ((v + dm) / ds).round().clamp(0.0, 15.0) as u8 } else { 0 };
        }
    }
    for c in 0..4 {
        for l in 0..32 {
            y[16 + 32 * c + l] = q[64 * c + l] | q[64 * c + 32 + l] << 4;
        }
    }
}

/// Q6_K: per 16-element sub-block a signed 8-bit scale against the super-block's f16 d; codes
/// q + 32 in 6 bits.
fn q6_k(x: &[f32], y: &mut [u8]) {
    let scale: Vec<f32> = x.chunks_exact(16).map(|s| s.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 31.0).collect();
    let d = f16::from_f32(scale.iter().fold(0.0f32, |m, &v| m.max(v)) / 127.0);
    let sc: Vec<i8> = scale.iter().map(|&s| if d.to_f32() > 0.0 { (s / d.to_f32()).round().clamp(-128.0, 127.0) as i8 } else { 0 }).collect();
    let mut q = [0u8; 256];
    for (e, &v) in x.iter().enumerate() {
        let ds = d.to_f32() * sc[e / 16] as f32;
        let v = if ds != 0.0 { (v / ds).round().clamp(-32.0, 31.0) } else { 0.0 };
        q[e] = (v + 32.0) as u8;
    }
    for h in 0..2 {
        for l in 0..32 {
            let e = 128 * h + l;
            let (q1, q2, q3, q4) = (q[e], q[e + 32], q[e + 64], q[e + 96]);
            y[64 * h + l] = (q1 & 0xF) | (q3 & 0xF) << 4;
            y[64 * h + l + 32] = (q2 & 0xF) | (q4 & 0xF) << 4;
            y[128 + 32 * h + l] = (q1 >> 4) | (q2 >> 4) << 2 | (q3 >> 4) << 4 | (q4 >> 4) << 6;
        }
    }
    for (i, &s) in sc.iter().enumerate() {
        y[192 + i] = s as u8;
    }
    y[208..210].copy_from_slice(&d.to_le_bytes());
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{dequantize, e4m3_to_f32};

    #[test]
    fn e4m3_encoding_inverts_decoding_and_rounds_to_even() {
        for code in 0u8..=255 {
            let v = e4m3_to_f32(code);
            if v.is_nan() {
                continue;
            }
            // -0.0 keeps its sign.
            assert_eq!(e4m3_from_f32(v), code, "code {code:#04x} ({v})");
        }
        // Halfway between 1.0 (0x38) and 1.125 (0x39): to the even code.
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        // Halfway between 1.125 and 1.25 (0x3A): even again.
        assert_eq!(e4m3_from_f32(1.1875), 0x3A);
        assert_eq!(e4m3_from_f32(1.0e6), 0x7E, "saturates at 448");
        assert_eq!(e4m3_from_f32(-1.0e6), 0xFE);
        assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0x00, "half the smallest subnormal rounds to even (zero)");
        assert_eq!(e4m3_from_f32(3.0 * 2f32.powi(-10)), 0x02, "1.5 subnormal units round to 2");
        assert_eq!(e4m3_from_f32(f32::NAN), 0x7F);
    }

    /// Each quantizer's output dequantizes to within its format's step of the input.
    #[test]
    fn quantizers_round_trip_within_their_step() {
        let cols = 512;
        let rows = 3;
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0 + if i % 97 == 0 { 3.0 } else { 0.0 }).collect();
        for (dtype, tol) in [
            (Dtype::Int4 { group: 128 }, 0.27),
            (Dtype::Int4 { group: 32 }, 0.27),
            (Dtype::F8E4M3Scaled { block: 128 }, 0.13),
            (Dtype::Q8_0, 0.02),
            (Dtype::Q5_0, 0.14),
            (Dtype::Q4K, 0.3),
            (Dtype::Q6K, 0.07),
        ] {
            let bytes = quantize(dtype, &values, rows, cols).unwrap();
            assert_eq!(bytes.len(), rows * dtype.row_bytes(cols).unwrap(), "{dtype}");
            let back = dequantize(dtype, &bytes).unwrap();
            let worst = values.iter().zip(&back).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst < tol, "{dtype}: worst error {worst}");
            assert!(back.iter().any(|&v| v != 0.0), "{dtype}: all zeros");
        }
    }

    #[test]
    fn zero_blocks_stay_zero_and_bad_requests_are_refused() {
        for dtype in [Dtype::Int4 { group: 32 }, Dtype::F8E4M3Scaled { block: 32 }, Dtype::Q8_0, Dtype::Q5_0, Dtype::Q4K, Dtype::Q6K] {
            let cols = dtype.block_elems();
            let bytes = quantize(dtype, &vec![0.0; cols], 1, cols).unwrap();
            assert!(dequantize(dtype, &bytes).unwrap().iter().all(|&v| v == 0.0), "{dtype}");
        }
        assert!(matches!(quantize(Dtype::Q4K, &[0.0; 300], 1, 300), Err(QuantError::PartialBlock { .. })));
        assert!(matches!(quantize(Dtype::Q8_0, &[0.0; 31], 1, 32), Err(QuantError::OutputSize { .. })));
        assert!(matches!(quantize(Dtype::IQ4XS, &[0.0; 256], 1, 256), Err(QuantError::NoQuantizer { dtype: Dtype::IQ4XS })));
    }
}
