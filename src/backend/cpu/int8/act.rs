//! Activation rows quantized to 8 bits, in the two forms llama.cpp's integer dot products read:
//! q8_K (256 values, an f32 scale, sums of each 16) for the K-quants and q8_0 (32 values, an
//! f16 scale) for Q8_0 and Q4_0. The rounding is that of `quantize_row_q8_K_ref` and
//! `quantize_row_q8_0_ref`, so a row quantizes here as it does there. A row's blocks depend on
//! that row alone, which keeps the integer path batch-invariant.

/// Values of a q8_K block (and of every K-quant weight block).
pub const QK_K: usize = 256;
/// Values of a q8_0 block (and of Q8_0 and Q4_0 weight blocks).
pub const QK8_0: usize = 32;

/// 256 activations as `d * qs[i]`, with `bsums[j]` the sum of `qs[16j..16j + 16]` (the K-quant
/// kernels take their minimums and offsets from these sums).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

/// 32 activations as `d * qs[i]`; `d` is an f16 widened to f32 (the block stores it as f16).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ80 {
    pub d: f32,
    pub qs: [i8; QK8_0],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; QK_K / 16] }
    }
}

impl Default for BlockQ80 {
    fn default() -> Self {
        BlockQ80 { d: 0.0, qs: [0; QK8_0] }
    }
}

/// `v` rounded half to even, for |v| < 2^22: llama.cpp's `nearest_int`, which adds 1.5 * 2^23
/// so that the float addition does the rounding (no library call on baseline x86-64).
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    ((v + 12_582_912.0).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// `x` (a multiple of 256 values) into `out` (one block per 256): the scale makes the value of
/// largest magnitude -127 (its sign folded into `d`), the others round half to even.
pub fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    debug_assert_eq!(x.len(), out.len() * QK_K);
    for (xb, y) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (mut max, mut amax) = (0.0f32, 0.0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *y = BlockQ8K::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in y.qs.iter_mut().zip(xb) {
            // |iscale * v| <= 127 up to rounding; the clamp keeps a rounding step in range.
            *q = nearest_int(iscale * v).clamp(-127, 127) as i8;
        }
        for (s, qs) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
            *s = qs.iter().map(|&q| i16::from(q)).sum();
        }
        y.d = 1.0 / iscale;
    }
}

/// `x` (a multiple of 32 values) into `out` (one block per 32): `d = amax / 127` stored as f16,
/// each value `x / d` (with the unrounded `d`) rounded half away from zero.
pub fn quantize_q8_0(x: &[f32], out: &mut [BlockQ80]) {
    debug_assert_eq!(x.len(), out.len() * QK8_0);
    for (xb, y) in x.chunks_exact(QK8_0).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        y.d = half::f16::from_f32(d).to_f32();
        for (q, &v) in y.qs.iter_mut().zip(xb) {
            *q = (v * id).round().clamp(-127.0, 127.0) as i8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_k_takes_the_largest_magnitude_to_minus_127_and_sums_each_16() {
        let mut x: Vec<f32> = (0..QK_K).map(|i| (i as f32 - 100.0) * 0.01).collect();
        x[7] = -3.0;
        let mut b = [BlockQ8K::default()];
        quantize_q8_k(&x, &mut b);
        assert_eq!(b[0].qs[7], -127);
        assert_eq!(b[0].d, 1.0 / (-127.0 / -3.0));
        for (v, &q) in x.iter().zip(&b[0].qs) {
            assert!((v - b[0].d * f32::from(q)).abs() <= b[0].d.abs() * 0.5 + 1e-6, "{v} as {q}");
        }
        for j in 0..16 {
            assert_eq!(i32::from(b[0].bsums[j]), b[0].qs[16 * j..16 * j + 16].iter().map(|&q| i32::from(q)).sum::<i32>());
        }
        quantize_q8_k(&[0.0; QK_K], &mut b);
        assert_eq!((b[0].d, b[0].qs, b[0].bsums), (0.0, [0; QK_K], [0; 16]));
    }

    #[test]
    fn nearest_int_rounds_half_to_even() {
        for v in [-127.0f32, -2.5, -1.5, -0.5, -0.49, 0.0, 0.5, 0.51, 1.5, 2.5, 126.5, 127.0] {
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
        }
    }

    #[test]
    fn q8_0_scales_by_the_largest_magnitude_over_127_in_f16() {
        let mut x: Vec<f32> = (0..QK8_0).map(|i| (i as f32 - 16.0) * 0.1).collect();
        x[3] = 2.54;
        let mut b = [BlockQ80::default()];
        quantize_q8_0(&x, &mut b);
        assert_eq!(b[0].d, half::f16::from_f32(2.54 / 127.0).to_f32());
        assert_eq!(b[0].qs[3], 127);
        assert_eq!(b[0].qs[16], 0);
        for (v, &q) in x.iter().zip(&b[0].qs) {
            assert!((v - b[0].d * f32::from(q)).abs() <= b[0].d * 0.51, "{v} as {q}");
        }
        quantize_q8_0(&[0.0; QK8_0], &mut b);
        assert_eq!((b[0].d, b[0].qs), (0.0, [0; QK8_0]));
    }
}
