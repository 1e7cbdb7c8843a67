//! vLLM's value quantizer for `turboquant_3bit_nc`, kept to compare against: the value vector is
//! not rotated; its minimum and `(max - min) / 7` define 8 evenly spaced levels, each element
//! stored as the 3-bit index of its nearest level, with the scale and the minimum in f16
//! (vLLM's `triton_turboquant_store`: `q = clamp(int((v - min) / scale + 0.5), 0, 7)`).

use super::{pack3, unpack3};
use half::f16;

/// Smallest scale, so that a constant vector divides safely.
const MIN_SCALE: f32 = 1e-8;

/// Stores `x` in `data` (`3·d / 8` bytes) and `params` (f16 scale, f16 minimum).
pub fn encode(x: &[f32], data: &mut [u8], params: &mut [u16]) {
    let min = x.iter().fold(f32::INFINITY, |m, &v| m.min(v));
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let scale = ((max - min) / 7.0).max(MIN_SCALE);
    let codes: Vec<u8> = x.iter().map(|&v| ((v - min) / scale + 0.5).floor().clamp(0.0, 7.0) as u8).collect();
    pack3(&codes, data);
    params[0] = f16::from_f32(scale).to_bits();
    params[1] = f16::from_f32(min).to_bits();
}

/// `code · scale + min` with the stored f16 scale and minimum.
pub fn decode(data: &[u8], params: &[u16], out: &mut [f32]) {
    let (scale, min) = (f16::from_bits(params[0]).to_f32(), f16::from_bits(params[1]).to_f32());
    let mut codes = [0u8; 8];
    for (bytes, o) in data.chunks_exact(3).zip(out.chunks_exact_mut(8)) {
        unpack3(bytes, &mut codes);
        for (v, &k) in o.iter_mut().zip(&codes) {
            *v = f32::from(k) * scale + min;
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::kv::{KvCodec, VectorFormat};

    #[test]
    fn levels_span_the_vector_and_round_to_the_nearest() {
        let x: Vec<f32> = (0..16).map(|i| -1.0 + i as f32 * (2.0 / 15.0)).collect();
        let codec = KvCodec::new(VectorFormat::Uniform3, 16).unwrap();
        let (mut data, mut params, mut back) = (vec![0u8; 6], [0u16; 2], vec![0.0f32; 16]);
        codec.encode(&x, &mut data, &mut params);
        codec.decode(&data, &params, &mut back);
        assert_eq!(back[0], -1.0);
        assert!((back[15] - 1.0).abs() < 2e-3, "{}", back[15]);
        for (a, b) in back.iter().zip(&x) {
            // Half a step of 2/7, plus f16 rounding of the scale.
            assert!((a - b).abs() <= 1.0 / 7.0 + 2e-3, "{a} vs {b}");
        }
    }

    #[test]
    fn a_constant_vector_reads_back_exactly() {
        let codec = KvCodec::new(VectorFormat::Uniform3, 8).unwrap();
        let (mut data, mut params, mut back) = (vec![0u8; 3], [0u16; 2], vec![0.0f32; 8]);
        codec.encode(&[0.5; 8], &mut data, &mut params);
        codec.decode(&data, &params, &mut back);
        assert!(back.iter().all(|&v| v == 0.5), "{back:?}");
    }
}
