//! FP8 E4M3 (float8_e4m3fn) weights: the plain element type, the block-scaled row format
//! [`Dtype::F8E4M3Scaled`](crate::Dtype::F8E4M3Scaled), and repacking of checkpoints that keep
//! their scales in a separate tensor (Qwen / DeepSeek block FP8, compressed-tensors FP8).

use crate::{shape_product, Dtype, QuantError};

/// Every e4m3 byte's f32 value: one table lookup per element beats decoding the bits.
static E4M3: [f32; 256] = e4m3_table();

/// The f32 value of an e4m3 byte: 1 sign, 4 exponent (bias 7) and 3 mantissa bits; no
/// infinities, S.1111.111 is NaN, exponent 0 holds subnormals m/8 * 2^-6.
pub fn e4m3_to_f32(byte: u8) -> f32 {
    E4M3[byte as usize]
}

const fn e4m3_table() -> [f32; 256] {
    let mut table = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        let sign = ((i as u32) >> 7) << 31;
        let exp = ((i as u32) >> 3) & 0xF;
        let mant = (i as u32) & 7;
        let magnitude = if exp == 0xF && mant == 7 {
            0x7FC0_0000
        } else if exp != 0 {
            // Rebias 7 -> 127 and move the 3 mantissa bits to the top of f32's 23.
            (exp + 120) << 23 | mant << 20
        } else if mant == 0 {
            0
        } else {
            // Subnormal m * 2^-9: normalise on m's leading bit p, so 2^(p-9) * (m / 2^p).
            let p = 31 - mant.leading_zeros();
            (p + 118) << 23 | (mant - (1 << p)) << (23 - p)
        };
        table[i] = f32::from_bits(sign | magnitude);
        i += 1;
    }
    table
}

/// The e4m3 byte nearest to `x` (ties to even), saturating at ±448 (no infinities: what
/// `cvt.rn.satfinite.e4m3x2.f32` gives); NaN becomes 0x7F.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7E;
    }
    if a < 1.0 / 64.0 {
        // Subnormals m/8 * 2^-6: m is a * 2^9 rounded (8 is the smallest normal, code 0x08).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Round f32's 23 mantissa bits to 3, ties to even (a carry moves into the exponent), then
    // rebias the exponent from 127 to 7.
    let bits = a.to_bits();
    let rounded = bits + 0x7_FFFF + ((bits >> 20) & 1);
    sign | ((rounded >> 20) - (120 << 3)).min(0x7E) as u8
}

/// Stores `x` as e4m3 bytes in `data` with one scale, `amax / 448` rounded to bf16; returns the
/// scale's bf16 bits. Each element is `x / scale` rounded to e4m3 (saturating, so an element
/// that the rounded scale puts past 448 stays finite). A zero vector stores zeros.
pub fn encode_e4m3_scaled(x: &[f32], data: &mut [u8]) -> u16 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = half::bf16::from_f32(amax / 448.0);
    let s = scale.to_f32();
    if s == 0.0 {
        data.fill(0);
        return 0;
    }
    for (d, v) in data.iter_mut().zip(x) {
        *d = f32_to_e4m3(v / s);
    }
    scale.to_bits()
}

pub(crate) fn dequantize_e4m3(bytes: &[u8], out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(bytes) {
        *o = E4M3[b as usize];
    }
}

/// Rows of [`Dtype::F8E4M3Scaled`] blocks: f32 scale, then `block` e4m3 bytes.
pub(crate) fn dequantize_scaled(block: usize, bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(4 + block).zip(out.chunks_exact_mut(block)) {
        let scale = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for (o, &q) in o.iter_mut().zip(&b[4..]) {
            *o = E4M3[q as usize] * scale;
        }
    }
}

/// The scaled-row dtype for `block`-element blocks, with `k` checked to split into them.
fn scaled_dtype(k: usize, block: usize) -> Result<Dtype, QuantError> {
    let dtype = match u32::try_from(block) {
        Ok(b) if b > 0 => Dtype::F8E4M3Scaled { block: b },
        _ => return Err(QuantError::InvalidBlock { block }),
    };
    if !k.is_multiple_of(block) {
        return Err(QuantError::NotMultiple { what: "k", value: k, of: block });
    }
    Ok(dtype)
}

fn check_weight(weight: &[u8], n: usize, k: usize) -> Result<(), QuantError> {
    let want = shape_product(n, k)?;
    if weight.len() != want {
        return Err(QuantError::InputLength { tensor: "weight", have: weight.len(), want });
    }
    Ok(())
}

/// Appends the scaled blocks of one `k`-element weight row; `scale(j)` is block j's scale.
fn push_row(out: &mut Vec<u8>, row: &[u8], block: usize, scale: impl Fn(usize) -> f32) {
    for (j, q) in row.chunks_exact(block).enumerate() {
        out.extend_from_slice(&scale(j).to_le_bytes());
        out.extend_from_slice(q);
    }
}

/// Repacks a block-FP8 weight (Qwen3 / DeepSeek-V3 `weight` + `weight_scale_inv`) into `n` rows
/// of `F8E4M3Scaled { block: block_k }`.
///
/// `weight` is e4m3 `[n, k]` row-major; `scale_inv` is `[ceil(n/block_n), ceil(k/block_k)]`
/// (converted to f32 by the caller) and, despite its name, multiplies:
/// `W[r, c] = e4m3(weight[r, c]) * scale_inv[r / block_n][c / block_k]`. A partial last block of
/// rows shares its block's scale; columns must split into whole blocks.
pub fn fp8_block_rows(weight: &[u8], scale_inv: &[f32], n: usize, k: usize, block_n: usize, block_k: usize) -> Result<Vec<u8>, QuantError> {
    if block_n == 0 {
        return Err(QuantError::InvalidBlock { block: block_n });
    }
    let dtype = scaled_dtype(k, block_k)?;
    check_weight(weight, n, k)?;
    let blocks_per_row = k / block_k;
    let want = shape_product(n.div_ceil(block_n), blocks_per_row)?;
    if scale_inv.len() != want {
        return Err(QuantError::ValueCount { tensor: "weight_scale_inv", have: scale_inv.len(), want: want.to_string() });
    }
    let mut out = Vec::with_capacity(shape_product(n, dtype.row_bytes(k)?)?);
    // With k == 0 there is nothing to repack, and chunks_exact below would reject a zero length.
    if k == 0 {
        return Ok(out);
    }
    for (r, row) in weight.chunks_exact(k).enumerate() {
        let scales = &scale_inv[r / block_n * blocks_per_row..][..blocks_per_row];
        push_row(&mut out, row, block_k, |j| scales[j]);
    }
    Ok(out)
}

/// Repacks an FP8 weight with a per-tensor (`scale.len() == 1`) or per-output-row
/// (`scale.len() == n`) scale (compressed-tensors `weight_scale`, `strategy: tensor | channel`)
/// into `n` rows of `F8E4M3Scaled { block }`, repeating the row's scale in each of its blocks.
pub fn fp8_scaled_rows(weight: &[u8], scale: &[f32], n: usize, k: usize, block: usize) -> Result<Vec<u8>, QuantError> {
    let dtype = scaled_dtype(k, block)?;
    check_weight(weight, n, k)?;
    if scale.len() != 1 && scale.len() != n {
        return Err(QuantError::ValueCount { tensor: "weight_scale", have: scale.len(), want: format!("1 (per tensor) or {n} (per row)") });
    }
    let mut out = Vec::with_capacity(shape_product(n, dtype.row_bytes(k)?)?);
    if k == 0 {
        return Ok(out);
    }
    for (r, row) in weight.chunks_exact(k).enumerate() {
        let s = if scale.len() == 1 { scale[0] } else { scale[r] };
        push_row(&mut out, row, block, |_| s);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dequantize;

    #[test]
    fn decodes_landmark_values() {
        assert_eq!(e4m3_to_f32(0x00).to_bits(), 0);
        assert_eq!(e4m3_to_f32(0x80).to_bits(), 0x8000_0000, "negative zero");
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
    }

    /// Every finite code encodes back to itself, and any f32 goes to the nearest code (ties to
    /// the even code), saturating at ±448.
    #[test]
    fn encoding_rounds_to_the_nearest_code() {
        for b in 0..=255u8 {
            if b & 0x7F != 0x7F {
                assert_eq!(f32_to_e4m3(e4m3_to_f32(b)) & 0x7F, b & 0x7F, "code {b:#04x}");
            }
        }
        let finite: Vec<(u8, f32)> = (0..0x7Fu8).map(|b| (b, e4m3_to_f32(b))).collect();
        let mut x = 1e-4f32;
        while x < 500.0 {
            for v in [x, -x] {
                let got = f32_to_e4m3(v);
                let want = finite.iter().map(|&(b, f)| (b, (f - v.abs()).abs())).fold((0u8, f32::INFINITY), |best, c| if c.1 < best.1 || (c.1 == best.1 && c.0 % 2 == 0) { c } else { best });
                assert_eq!(got & 0x7F, want.0, "{v}: code {got:#04x}, nearest {:#04x}", want.0);
                assert_eq!(got & 0x80 != 0, v < 0.0, "{v}: sign");
            }
            x *= 1.0137;
        }
        assert_eq!(f32_to_e4m3(1e9), 0x7E);
        assert_eq!(f32_to_e4m3(-1e9), 0xFE);
        // Halfway between 1.0 and 1.125: to the even mantissa (1.0).
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
    }

    #[test]
    fn scaled_vectors_keep_a_few_percent() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 - 31.5) * 0.37).collect();
        let mut data = vec![0u8; 64];
        let scale = half::bf16::from_bits(encode_e4m3_scaled(&x, &mut data)).to_f32();
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!((scale * 448.0 / amax - 1.0).abs() < 0.004, "scale {scale}");
        for (b, v) in data.iter().zip(&x) {
            let back = e4m3_to_f32(*b) * scale;
            assert!((back - v).abs() <= v.abs() / 16.0 + scale * 2f32.powi(-10), "{v} -> {back}");
        }
        let mut zeros = vec![9u8; 8];
        assert_eq!(encode_e4m3_scaled(&[0.0; 8], &mut zeros), 0);
        assert_eq!(zeros, [0; 8]);
    }

    #[test]
    fn block_rows_use_the_scale_of_their_block() {
        // 3 rows x 4 cols, blocks 2x2: rows 0-1 use scale row 0, row 2 (partial block) row 1.
        let weight = [0x38u8; 12]; // all 1.0
        let scales = [1.0, 2.0, 3.0, 4.0];
        let rows = fp8_block_rows(&weight, &scales, 3, 4, 2, 2).unwrap();
        let dtype = Dtype::F8E4M3Scaled { block: 2 };
        assert_eq!(rows.len(), 3 * dtype.row_bytes(4).unwrap());
        assert_eq!(dequantize(dtype, &rows).unwrap(), [1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]);
    }

    #[test]
    fn scaled_rows_take_tensor_or_row_scales() {
        let weight = [0x38u8, 0x40, 0x38, 0x40]; // 1.0, 2.0 per row
        let dtype = Dtype::F8E4M3Scaled { block: 1 };
        let per_tensor = fp8_scaled_rows(&weight, &[0.5], 2, 2, 1).unwrap();
        assert_eq!(dequantize(dtype, &per_tensor).unwrap(), [0.5, 1.0, 0.5, 1.0]);
        let per_row = fp8_scaled_rows(&weight, &[-1.0, 3.0], 2, 2, 1).unwrap();
        assert_eq!(dequantize(dtype, &per_row).unwrap(), [-1.0, -2.0, 3.0, 6.0]);
        assert!(matches!(fp8_scaled_rows(&weight, &[1.0; 3], 2, 2, 1), Err(QuantError::ValueCount { have: 3, .. })));
    }

    #[test]
    fn rejects_bad_shapes() {
        let w = [0u8; 12];
        assert!(matches!(fp8_block_rows(&w, &[1.0; 4], 3, 4, 2, 3), Err(QuantError::NotMultiple { what: "k", value: 4, of: 3 })));
        assert!(matches!(fp8_block_rows(&w, &[1.0; 4], 3, 4, 0, 2), Err(QuantError::InvalidBlock { block: 0 })));
        assert!(matches!(fp8_block_rows(&w, &[1.0; 4], 3, 4, 2, 0), Err(QuantError::InvalidBlock { block: 0 })));
        assert!(matches!(fp8_block_rows(&w[..11], &[1.0; 4], 3, 4, 2, 2), Err(QuantError::InputLength { tensor: "weight", have: 11, want: 12 })));
        assert!(matches!(fp8_block_rows(&w, &[1.0; 2], 3, 4, 2, 2), Err(QuantError::ValueCount { have: 2, .. })));
        assert!(matches!(fp8_block_rows(&w, &[1.0; 4], usize::MAX, 4, 2, 2), Err(QuantError::ShapeOverflow { .. })));
        assert!(matches!(fp8_scaled_rows(&w, &[1.0], 3, 4, usize::MAX), Err(QuantError::InvalidBlock { .. })));
        assert_eq!(fp8_block_rows(&[], &[], 3, 0, 2, 2).unwrap(), Vec::<u8>::new());
    }
}
