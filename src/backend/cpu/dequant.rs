//! Weight rows to f32, bit for bit what [`kestrel_quant::dequantize_into`] gives (the
//! reference), with AVX2 forms of the formats the matmul reads most.

use super::dot::Isa;
use crate::backend::weight_bytes::MatrixBytes;

/// Rows `r0..r1` of `part` as f32 into `out` (`(r1 - r0) * cols` values).
pub fn rows(isa: Isa, part: &MatrixBytes, r0: usize, r1: usize, out: &mut [f32]) {
    let rb = part.row_bytes();
    let bytes = &part.bytes()[r0 * rb..r1 * rb];
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Bf16 && part.dtype == kestrel_quant::Dtype::Q8_0 && out.len() % 32 == 0 {
        // SAFETY: AVX-512 F is available (the backend checked it when choosing `isa`).
        return unsafe { avx512::q8_0_rows(bytes, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2 is available (the backend checked it when choosing `isa`).
        if unsafe { avx2::rows(part.dtype, bytes, out) } {
            return;
        }
    }
    let _ = isa;
    // Cannot fail: the slice holds exactly `out.len()` elements of `dtype` by construction.
    kestrel_quant::dequantize_into(part.dtype, bytes, out).expect("weight rows size");
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! Q8_0, the block format whose conversion a decode step spends most of its time in, sixteen
    //! values at a time: the reference's `d * q` in f32.

    use std::arch::x86_64::*;

    /// Whole Q8_0 blocks (34 bytes: an f16 scale, 32 int8) into `out`.
    #[target_feature(enable = "avx512f,f16c")]
    pub unsafe fn q8_0_rows(bytes: &[u8], out: &mut [f32]) {
        for (b, o) in bytes.as_chunks::<34>().0.iter().zip(out.as_chunks_mut::<32>().0) {
            let d = _mm512_set1_ps(half::f16::from_le_bytes([b[0], b[1]]).to_f32());
            for (h, o16) in o.as_chunks_mut::<16>().0.iter_mut().enumerate() {
                // SAFETY: bytes 2 + 16h .. 18 + 16h lie inside the block; `o16` holds 16 values.
                unsafe {
                    let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(b[2 + 16 * h..].as_ptr() as *const __m128i));
                    _mm512_storeu_ps(o16.as_mut_ptr(), _mm512_mul_ps(d, _mm512_cvtepi32_ps(q)));
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Each block decoder does the reference's f32 operations in the reference's order (the
    //! products and differences of `kestrel_quant::gguf`), eight values at a time.

    use kestrel_quant::Dtype;
    use std::arch::x86_64::*;

    /// Non-linear 4-bit codebook of IQ4_NL / IQ4_XS, as bytes (the values are whole numbers).
    const IQ4_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

    /// Converts `bytes` of `dtype` into `out` where this module has the format; false where it
    /// does not (the caller falls back to the reference conversion).
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn rows(dtype: Dtype, bytes: &[u8], out: &mut [f32]) -> bool {
        unsafe {
            match dtype {
                Dtype::BF16 if out.len() % 8 == 0 => {
                    for (o, b) in out.chunks_exact_mut(8).zip(bytes.chunks_exact(16)) {
                        let h = _mm_loadu_si128(b.as_ptr() as *const __m128i);
                        _mm256_storeu_ps(o.as_mut_ptr(), _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h))));
                    }
                }
                Dtype::F16 if out.len() % 8 == 0 => {
                    for (o, b) in out.chunks_exact_mut(8).zip(bytes.chunks_exact(16)) {
                        _mm256_storeu_ps(o.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr() as *const __m128i)));
                    }
                }
                Dtype::Q8_0 => blocks::<34, 32>(bytes, out, |b, o| q8_0(b, o)),
                Dtype::Q4_0 => blocks::<18, 32>(bytes, out, |b, o| q4_0(b, o)),
                Dtype::Q4_1 => blocks::<20, 32>(bytes, out, |b, o| q4_1(b, o)),
                Dtype::Q5_0 => blocks::<22, 32>(bytes, out, |b, o| q5_0(b, o)),
                Dtype::Q5_1 => blocks::<24, 32>(bytes, out, |b, o| q5_1(b, o)),
                Dtype::IQ4NL => blocks::<18, 32>(bytes, out, |b, o| iq4_nl(b, o)),
                Dtype::Q4K => blocks::<144, 256>(bytes, out, |b, o| q4_k(b, o)),
                Dtype::Q5K => blocks::<176, 256>(bytes, out, |b, o| q5_k(b, o)),
                Dtype::Q6K => blocks::<210, 256>(bytes, out, |b, o| q6_k(b, o)),
                Dtype::IQ4XS => blocks::<136, 256>(bytes, out, |b, o| iq4_xs(b, o)),
                Dtype::Int4 { group } if group % 32 == 0 => int4(group as usize, bytes, out),
                _ => return false,
            }
        }
        true
    }

    #[inline(always)]
    fn blocks<const B: usize, const E: usize>(bytes: &[u8], out: &mut [f32], block: impl Fn(&[u8; B], &mut [f32; E])) {
        for (b, o) in bytes.as_chunks::<B>().0.iter().zip(out.as_chunks_mut::<E>().0) {
            block(b, o);
        }
    }

    #[inline(always)]
    fn f16_at(b: &[u8], at: usize) -> f32 {
        half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
    }

    /// Bytes `8i..8i + 8` of `v` as eight i32 (sign-extended).
    #[inline(always)]
    unsafe fn i8_lanes(v: __m256i, i: usize) -> __m256i {
        unsafe {
            let half = if i < 2 { _mm256_castsi256_si128(v) } else { _mm256_extracti128_si256::<1>(v) };
            _mm256_cvtepi8_epi32(if i % 2 == 0 { half } else { _mm_srli_si128::<8>(half) })
        }
    }

    /// `scale * q` for eight i32 `q`, stored at `o`.
    #[inline(always)]
    unsafe fn put_scaled(o: &mut [f32], q: __m256i, scale: f32) {
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(q))) }
    }

    /// `scale * q - min` for eight i32 `q`, stored at `o`.
    #[inline(always)]
    unsafe fn put_scaled_min(o: &mut [f32], q: __m256i, scale: f32, min: f32) {
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(q)), _mm256_set1_ps(min))) }
    }

    #[inline(always)]
    unsafe fn load32(b: &[u8]) -> __m256i {
        debug_assert!(b.len() >= 32);
        unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) }
    }

    #[inline(always)]
    unsafe fn load16(b: &[u8]) -> __m128i {
        debug_assert!(b.len() >= 16);
        unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) }
    }

    /// Low and high nibbles of 16 bytes, as 32 bytes: [low 16 | high 16].
    #[inline(always)]
    unsafe fn nibbles16(q: __m128i) -> __m256i {
        unsafe {
            let m = _mm_set1_epi8(0x0F);
            _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(q), m), _mm_and_si128(q, m))
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
        unsafe {
            let d = f16_at(b, 0);
            let q = load32(&b[2..]);
            for i in 0..4 {
                put_scaled(&mut y[8 * i..], i8_lanes(q, i), d);
            }
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
        unsafe {
            let d = f16_at(b, 0);
            let q = _mm256_sub_epi8(nibbles16(load16(&b[2..])), _mm256_set1_epi8(8));
            for i in 0..4 {
                put_scaled(&mut y[8 * i..], i8_lanes(q, i), d);
            }
        }
    }

    /// Groups of [`Dtype::Int4`]: `scale * (q - zero)` per element, one rounding, as the
    /// reference's table holds it; elements 2i and 2i + 1 are the low and high nibbles of byte i.
    #[inline(always)]
    unsafe fn int4(group: usize, bytes: &[u8], out: &mut [f32]) {
        unsafe {
            let mask = _mm_set1_epi8(0x0F);
            for (b, o) in bytes.chunks_exact(kestrel_quant::int4::HEADER_BYTES + group / 2).zip(out.chunks_exact_mut(group)) {
                let scale = _mm256_set1_ps(f16_at(b, 0));
                // The zero is a whole byte: subtracted in 32 bits, so any stored value is exact.
                let zero = _mm256_set1_epi32(b[2] as i32);
                for (q, o) in b[kestrel_quant::int4::HEADER_BYTES..].chunks_exact(16).zip(o.chunks_exact_mut(32)) {
                    let q = load16(q);
                    let (lo, hi) = (_mm_and_si128(q, mask), _mm_and_si128(_mm_srli_epi16::<4>(q), mask));
                    // Bytes 0..8 interleaved are elements 0..16, bytes 8..16 elements 16..32.
                    let (first, second) = (_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi));
                    for (i, v) in [first, _mm_srli_si128::<8>(first), second, _mm_srli_si128::<8>(second)].into_iter().enumerate() {
                        let d = _mm256_sub_epi32(_mm256_cvtepu8_epi32(v), zero);
                        _mm256_storeu_ps(o.as_mut_ptr().add(8 * i), _mm256_mul_ps(scale, _mm256_cvtepi32_ps(d)));
                    }
                }
            }
        }
    }

    /// `scale * q + min` for eight i32 `q`, stored at `o`.
    #[inline(always)]
    unsafe fn put_scaled_plus(o: &mut [f32], q: __m256i, scale: f32, min: f32) {
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(q)), _mm256_set1_ps(min))) }
    }

    /// Bit `e` of `qh` as 0x10 in byte `e` (the fifth bit of element `e` of a Q5 block).
    #[inline(always)]
    unsafe fn fifth_bits(qh: u32) -> __m256i {
        unsafe {
            // Byte e takes byte e / 8 of qh, then keeps bit e % 8.
            let spread = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0));
            let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
            _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10))
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
        unsafe {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let q = nibbles16(load16(&b[4..]));
            for i in 0..4 {
                put_scaled_plus(&mut y[8 * i..], i8_lanes(q, i), d, m);
            }
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
        unsafe {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let q = _mm256_sub_epi8(_mm256_or_si256(nibbles16(load16(&b[6..])), fifth_bits(qh)), _mm256_set1_epi8(16));
            for i in 0..4 {
                put_scaled(&mut y[8 * i..], i8_lanes(q, i), d);
            }
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
        unsafe {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let q = _mm256_or_si256(nibbles16(load16(&b[8..])), fifth_bits(qh));
            for i in 0..4 {
                put_scaled_plus(&mut y[8 * i..], i8_lanes(q, i), d, m);
            }
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn iq4_nl(b: &[u8; 18], y: &mut [f32; 32]) {
        unsafe {
            let d = f16_at(b, 0);
            let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_VALUES.as_ptr() as *const __m128i));
            let q = _mm256_shuffle_epi8(table, nibbles16(load16(&b[2..])));
            for i in 0..4 {
                put_scaled(&mut y[8 * i..], i8_lanes(q, i), d);
            }
        }
    }

    /// The 6-bit (scale, min) pair of sub-block `j` (`get_scale_min_k4`).
    #[inline(always)]
    fn scale_min_k4(j: usize, s: &[u8]) -> (f32, f32) {
        let (sc, m) = if j < 4 { (s[j] & 63, s[j + 4] & 63) } else { ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)) };
        (sc as f32, m as f32)
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
        unsafe {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let m4 = _mm256_set1_epi8(0x0F);
            for c in 0..4 {
                let (sc1, m1) = scale_min_k4(2 * c, scales);
                let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
                let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
                let q = load32(&b[16 + 32 * c..]);
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                for i in 0..4 {
                    put_scaled_min(&mut y[64 * c + 8 * i..], i8_lanes(lo, i), d1, m1);
                    put_scaled_min(&mut y[64 * c + 32 + 8 * i..], i8_lanes(hi, i), d2, m2);
                }
            }
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
        unsafe {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let qh = load32(&b[16..]);
            let (m4, one) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(1));
            for c in 0..4 {
                let (sc1, m1) = scale_min_k4(2 * c, scales);
                let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
                let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
                let q = load32(&b[48 + 32 * c..]);
                // Bits 2c and 2c + 1 of each qh byte, moved to bit 4.
                let h = _mm256_srlv_epi64(qh, _mm256_set1_epi64x(2 * c as i64));
                let h1 = _mm256_slli_epi16::<4>(_mm256_and_si256(h, one));
                let h2 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<1>(h), one));
                let lo = _mm256_or_si256(_mm256_and_si256(q, m4), h1);
                let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m4), h2);
                for i in 0..4 {
                    put_scaled_min(&mut y[64 * c + 8 * i..], i8_lanes(lo, i), d1, m1);
                    put_scaled_min(&mut y[64 * c + 32 + 8 * i..], i8_lanes(hi, i), d2, m2);
                }
            }
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
        unsafe {
            let d = f16_at(b, 208);
            let mut ds = [0f32; 16];
            for (i, s) in ds.iter_mut().enumerate() {
                *s = d * (b[192 + i] as i8) as f32;
            }
            let (m4, m3, off) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3), _mm256_set1_epi8(32));
            for h in 0..2 {
                let ql_a = load32(&b[64 * h..]);
                let ql_b = load32(&b[64 * h + 32..]);
                let qh = load32(&b[128 + 32 * h..]);
                let top = |shift: i64| top2(qh, shift, m3);
                let q = [
                    _mm256_or_si256(_mm256_and_si256(ql_a, m4), top(0)),
                    _mm256_or_si256(_mm256_and_si256(ql_b, m4), top(2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql_a), m4), top(4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql_b), m4), top(6)),
                ];
                for (j, qj) in q.iter().enumerate() {
                    let qj = _mm256_sub_epi8(*qj, off);
                    let base = 128 * h + 32 * j;
                    for i in 0..4 {
                        // Elements l = 8i..8i+8 of this quarter use scale 8h + l/16 + 2j.
                        put_scaled(&mut y[base + 8 * i..], i8_lanes(qj, i), ds[8 * h + i / 2 + 2 * j]);
                    }
                }
            }
        }
    }

    /// Bits `shift..shift + 2` of each byte of `qh`, moved to bits 4..6.
    #[inline(always)]
    unsafe fn top2(qh: __m256i, shift: i64, m3: __m256i) -> __m256i {
        unsafe { _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srlv_epi64(qh, _mm256_set1_epi64x(shift)), m3)) }
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn iq4_xs(b: &[u8; 136], y: &mut [f32; 256]) {
        unsafe {
            let d = f16_at(b, 0);
            let scales_h = u16::from_le_bytes([b[2], b[3]]) as u32;
            let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_VALUES.as_ptr() as *const __m128i));
            for ib in 0..8 {
                let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) as u32 & 0xF;
                let ls = lo | ((scales_h >> (2 * ib)) & 3) << 4;
                let dl = d * (ls as i32 - 32) as f32;
                let q = _mm256_shuffle_epi8(table, nibbles16(load16(&b[8 + 16 * ib..])));
                for i in 0..4 {
                    put_scaled(&mut y[32 * ib + 8 * i..], i8_lanes(q, i), dl);
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kestrel_quant::Dtype;

    /// Random bytes of `rows x cols` weights of `dtype`, with every f16 scale field finite.
    pub(crate) fn random_matrix(dtype: Dtype, rows: usize, cols: usize, seed: &mut u64) -> MatrixBytes {
        let n = rows * dtype.row_bytes(cols).expect("whole blocks");
        let mut bytes: Vec<u8> = (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (*seed >> 56) as u8
            })
            .collect();
        // Scales: small finite halves (exponent bits kept below the top), so values stay finite.
        let fix_half = |b: &mut [u8], at: usize| b[at + 1] &= 0x3B;
        let bb = dtype.block_bytes();
        for blk in bytes.chunks_exact_mut(bb) {
            match dtype {
                Dtype::F16 | Dtype::BF16 => fix_half(blk, 0),
                Dtype::F32 => blk[3] &= 0x3F,
                Dtype::Q4_0 | Dtype::Q5_0 | Dtype::Q8_0 | Dtype::IQ4NL | Dtype::IQ4XS => fix_half(blk, 0),
                Dtype::Q4_1 | Dtype::Q5_1 | Dtype::Q4K | Dtype::Q5K => {
                    fix_half(blk, 0);
                    fix_half(blk, 2)
                }
                Dtype::Q6K => fix_half(blk, 208),
                Dtype::Int4 { .. } => fix_half(blk, 0),
                _ => {}
            }
        }
        MatrixBytes { data: crate::backend::weight_bytes::SharedBytes::from_vec(bytes), start: 0, dtype, rows, cols }
    }

    /// Int4 in groups of 32 and 128 (the SIMD path) and of 16 (the reference's fallback).
    pub(crate) const FORMATS: [Dtype; 16] = [
        Dtype::F32,
        Dtype::F16,
        Dtype::BF16,
        Dtype::Q4_0,
        Dtype::Q4_1,
        Dtype::Q5_0,
        Dtype::Q5_1,
        Dtype::Q8_0,
        Dtype::Q4K,
        Dtype::Q5K,
        Dtype::Q6K,
        Dtype::IQ4NL,
        Dtype::IQ4XS,
        Dtype::Int4 { group: 32 },
        Dtype::Int4 { group: 128 },
        Dtype::Int4 { group: 16 },
    ];

    /// Every format's SIMD conversion gives the reference's bits.
    #[test]
    fn simd_conversion_has_the_reference_bits() {
        let mut seed = 7u64;
        for dtype in FORMATS {
            let (rows, cols) = (5, 512);
            let m = random_matrix(dtype, rows, cols, &mut seed);
            let mut want = vec![0.0f32; rows * cols];
            kestrel_quant::dequantize_into(dtype, m.bytes(), &mut want).unwrap();
            for isa in Isa::all_available() {
                let mut got = vec![0.0f32; rows * cols];
                rows_of(isa, &m, &mut got);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "{dtype} {isa:?} element {i}: {g} against {w}");
                }
            }
        }
    }

    fn rows_of(isa: Isa, m: &MatrixBytes, out: &mut [f32]) {
        // In two blocks, as the matmul converts them.
        let split = m.rows / 2;
        let (a, b) = out.split_at_mut(split * m.cols);
        rows(isa, m, 0, split, a);
        rows(isa, m, split, m.rows, b);
    }
}
