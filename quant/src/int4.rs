//! The int4 row format [`Dtype::Int4`](crate::Dtype::Int4): groups of `group` elements, each a
//! 4-byte header (f16 scale, u8 zero, u8 reserved) and `group / 2` bytes of nibbles, element 2i
//! in the low nibble of byte i and 2i+1 in the high one. Value = scale * (q - zero).
//!
//! Checkpoints (GPTQ, AWQ, AutoRound) keep q, zeros and scales in three tensors laid out along
//! different axes; [`crate::gptq`] repacks them into this format so a row dequantizes alone.

use half::f16;

/// Bytes before a group's nibbles.
pub const HEADER_BYTES: usize = 4;

pub(crate) fn dequantize(group: usize, bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes.chunks_exact(HEADER_BYTES + group / 2).zip(out.chunks_exact_mut(group)) {
        let scale = f16::from_le_bytes([b[0], b[1]]).to_f32();
        let zero = b[2] as i32;
        // All 16 possible values of the group, each one rounding of scale * (q - zero).
        let mut lut = [0f32; 16];
        for (q, v) in lut.iter_mut().enumerate() {
            *v = scale * (q as i32 - zero) as f32;
        }
        for (pair, &q) in o.as_chunks_mut::<2>().0.iter_mut().zip(&b[HEADER_BYTES..]) {
            pair[0] = lut[(q & 0xF) as usize];
            pair[1] = lut[(q >> 4) as usize];
        }
    }
}

/// Appends one group: header, then `q` (values 0..=15, an even count) packed two per byte. The
/// repackers write in place instead; this plain writer is the reference their tests compare to.
#[cfg(test)]
pub(crate) fn push_group(out: &mut Vec<u8>, scale: f16, zero: u8, q: impl Iterator<Item = u8>) {
    out.extend_from_slice(&scale.to_le_bytes());
    out.push(zero);
    out.push(0);
    let mut low = None;
    for v in q {
        match low.take() {
            None => low = Some(v & 0xF),
            Some(l) => out.push(l | (v & 0xF) << 4),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{dequantize as dequantize_bytes, Dtype};

    #[test]
    fn packs_low_nibble_first_and_applies_zero_and_sign() {
        let mut row = Vec::new();
        push_group(&mut row, f16::from_f32(-0.5), 3, [0u8, 1, 15, 3].into_iter());
        push_group(&mut row, f16::from_f32(2.0), 0, [4u8, 5, 6, 7].into_iter());
        assert_eq!(row, [0x00, 0xB8, 3, 0, 0x10, 0x3F, 0x00, 0x40, 0, 0, 0x54, 0x76]);
        let values = dequantize_bytes(Dtype::Int4 { group: 4 }, &row).unwrap();
        assert_eq!(values, [1.5, 1.0, -6.0, 0.0, 8.0, 10.0, 12.0, 14.0]);
    }
}
