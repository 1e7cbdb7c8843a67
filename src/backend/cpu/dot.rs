//! The one dot product every CPU matmul computes, and its SIMD forms.
//!
//! Reduction order (the CPU reference's definition, whatever the SIMD width): eight lanes, lane
//! `l` summing `a[k] * b[k]` for `k = l, l + 8, l + 16, ...` in order, each product rounded and
//! then added (no fused multiply-add, so machines with and without FMA agree); the elements
//! past the last multiple of eight summed in order into a separate tail; then
//! `((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) + tail`. The scalar form below is the
//! definition; the AVX2 tiles compute exactly these operations for several rows and tokens at
//! once (one 8-wide register per output element), so the result of an element never depends
//! on the tile it was computed in, the thread that ran it, or the machine's vector width.

/// Lanes of the fixed reduction order.
pub const LANES: usize = 8;

/// The instruction set the CPU kernels run on. Every choice gives the same bits (but for the
/// one exception [`Isa::Avx512Bf16`] names); the scalar one exists for machines without AVX2
/// and for the tests that prove the others equal to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2's kernels, and BF16 weights against bf16 activations on AVX-512's bf16 dot
    /// products ([`super::avx512`]) in the reference's order. Those round as the
    /// reference does, except that the instruction reads subnormal inputs and writes subnormal
    /// sums as zero (values below 2^-126 in magnitude, which a model's activations and weights
    /// do not reach but as zeros); everything else gives AVX2's bits.
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16,
}

impl Isa {
    /// The widest kernels this CPU runs.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            if super::avx512::available() {
                return Isa::Avx512Bf16;
            }
            return Isa::Avx2;
        }
        Isa::Scalar
    }

    /// Every kernel set this CPU runs, the scalar one first (for tests that compare them).
    pub fn all_available() -> Vec<Isa> {
        let mut all = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if avx2::available() {
                all.push(Isa::Avx2);
            }
            if Isa::detect() == Isa::Avx512Bf16 {
                all.push(Isa::Avx512Bf16);
            }
        }
        all
    }

    /// Whether this set includes AVX2's kernels.
    pub fn has_avx2(self) -> bool {
        self != Isa::Scalar
    }
}

/// The reference dot product (see the module comment). Where the CPU has AVX, the same code is
/// compiled for it; the two builds round alike.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU supports AVX2 (checked at run time).
        return unsafe { avx2::dot(a, b) };
    }
    dot_scalar(a, b)
}

/// The reference order written out lane by lane.
#[inline(always)]
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        let (x, y) = (&a[c * LANES..c * LANES + LANES], &b[c * LANES..c * LANES + LANES]);
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0f32;
    for i in chunks * LANES..a.len() {
        tail += a[i] * b[i];
    }
    reduce_lanes(&acc) + tail
}

/// The fixed sum of the eight lanes.
#[inline(always)]
pub fn reduce_lanes(acc: &[f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    //! AVX2 tiles of the reference dot product: `MR` activation rows against `NR` weight rows
    //! whose values a [`Lanes`] loader produces eight at a time.

    use super::LANES;
    use std::arch::x86_64::*;

    /// AVX2 and F16C (the half-precision loads); every x86-64 CPU with AVX2 has F16C.
    pub fn available() -> bool {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"))
    }

    /// Eight consecutive weights of a row as f32, exactly as the scalar conversion gives them.
    pub trait Lanes: Sync {
        /// Where row `r` starts.
        fn row(&self, r: usize) -> *const u8;
        /// Elements `8c..8c + 8` of the row starting at `row`.
        ///
        /// # Safety
        /// AVX2 and F16C are available; the elements lie inside the row.
        unsafe fn load(row: *const u8, c: usize) -> __m256;
        /// Element `k` of the row starting at `row` (for the tail past the last whole chunk).
        ///
        /// # Safety
        /// The element lies inside the row.
        unsafe fn scalar(row: *const u8, k: usize) -> f32;
    }

    /// Rows of f32 values (4 bytes each, any alignment).
    pub struct F32Rows {
        pub base: *const u8,
        pub row_bytes: usize,
    }
    /// Rows of bf16 values.
    pub struct Bf16Rows {
        pub base: *const u8,
        pub row_bytes: usize,
    }
    /// Rows of IEEE half values.
    pub struct F16Rows {
        pub base: *const u8,
        pub row_bytes: usize,
    }
    // SAFETY: read-only views of weights that outlive the matmul using them.
    unsafe impl Sync for F32Rows {}
    unsafe impl Sync for Bf16Rows {}
    unsafe impl Sync for F16Rows {}

    impl Lanes for F32Rows {
        #[inline(always)]
        fn row(&self, r: usize) -> *const u8 {
            self.base.wrapping_add(r * self.row_bytes)
        }
        #[inline(always)]
        unsafe fn load(row: *const u8, c: usize) -> __m256 {
            unsafe { _mm256_loadu_ps(row.add(c * 32) as *const f32) }
        }
        unsafe fn scalar(row: *const u8, k: usize) -> f32 {
            unsafe { (row.add(k * 4) as *const f32).read_unaligned() }
        }
    }
    impl Lanes for Bf16Rows {
        #[inline(always)]
        fn row(&self, r: usize) -> *const u8 {
            self.base.wrapping_add(r * self.row_bytes)
        }
        #[inline(always)]
        unsafe fn load(row: *const u8, c: usize) -> __m256 {
            unsafe {
                let h = _mm_loadu_si128(row.add(c * 16) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
        }
        unsafe fn scalar(row: *const u8, k: usize) -> f32 {
            f32::from_bits(u32::from(unsafe { (row.add(k * 2) as *const u16).read_unaligned() }) << 16)
        }
    }
    impl Lanes for F16Rows {
        #[inline(always)]
        fn row(&self, r: usize) -> *const u8 {
            self.base.wrapping_add(r * self.row_bytes)
        }
        #[inline(always)]
        unsafe fn load(row: *const u8, c: usize) -> __m256 {
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(row.add(c * 16) as *const __m128i)) }
        }
        unsafe fn scalar(row: *const u8, k: usize) -> f32 {
            half::f16::from_bits(unsafe { (row.add(k * 2) as *const u16).read_unaligned() }).to_f32()
        }
    }

    /// The eight lanes of `v` summed in the reference order.
    #[inline(always)]
    pub(in crate::backend::cpu) unsafe fn reduce(v: __m256) -> f32 {
        unsafe {
            // s = (l0+l4, l1+l5, l2+l6, l3+l7)
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            // (s0+s1) and (s2+s3), then their sum.
            let pairs = _mm_add_ps(s, _mm_shuffle_ps::<0b10_11_00_01>(s, s));
            _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehl_ps(pairs, pairs)))
        }
    }

    /// `out[i * ldo + j] = dot(x row i, weight row r0 + j)` for `i < MR`, `j < NR`, over `k`
    /// elements (`x` rows `ldx` apart).
    #[inline(always)]
    pub unsafe fn tile<const MR: usize, const NR: usize, W: Lanes>(x: *const f32, ldx: usize, w: &W, r0: usize, k: usize, out: *mut f32, ldo: usize) {
        unsafe {
            let chunks = k / LANES;
            let rows: [*const u8; NR] = std::array::from_fn(|j| w.row(r0 + j));
            let mut acc = [[_mm256_setzero_ps(); NR]; MR];
            for c in 0..chunks {
                let mut wv = [_mm256_setzero_ps(); NR];
                for (v, &row) in wv.iter_mut().zip(&rows) {
                    *v = W::load(row, c);
                }
                for (i, row) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(i * ldx + c * LANES));
                    for (a, wj) in row.iter_mut().zip(&wv) {
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(xv, *wj));
                    }
                }
            }
            for (i, row) in acc.iter().enumerate() {
                for (j, a) in row.iter().enumerate() {
                    let mut tail = 0.0f32;
                    for kk in chunks * LANES..k {
                        tail += *x.add(i * ldx + kk) * W::scalar(rows[j], kk);
                    }
                    *out.add(i * ldo + j) = reduce(*a) + tail;
                }
            }
        }
    }

    /// The reference dot product of two f32 slices.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        debug_assert_eq!(a.len(), b.len());
        let w = F32Rows { base: b.as_ptr() as *const u8, row_bytes: 0 };
        let mut out = 0.0f32;
        unsafe { tile::<1, 1, _>(a.as_ptr(), 0, &w, 0, a.len(), &mut out, 0) };
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn random(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
            })
            .collect()
    }

    /// The SIMD dot product gives the scalar definition's bits.
    #[test]
    fn simd_dot_has_the_scalar_bits() {
        let mut seed = 12345u64;
        for len in [0, 1, 7, 8, 9, 64, 255, 256, 1000, 3584] {
            for _ in 0..20 {
                let (a, b) = (random(len, &mut seed), random(len, &mut seed));
                assert_eq!(dot(&a, &b).to_bits(), dot_scalar(&a, &b).to_bits(), "length {len}");
            }
        }
    }
}
