//! Row-independent matrix products over weights stored in any dtype, read in place.
//!
//! Every output element is one [`dot`](super::dot) of an activation row with a weight row, in
//! the reference order, so a row's result never depends on how many rows share the call, how
//! the threads split the work or which kernels ran it (batch invariance). Threads take
//! contiguous ranges of weight rows; inside a range the AVX2 path computes tiles of up to four
//! tokens by up to eight weight rows. Plain float weights (F32, BF16, F16) are read straight
//! from the memory map for steps of a few tokens; longer steps and the block formats convert a
//! block of weight rows to f32 once ([`super::dequant`]) and run every token against it.

use super::dequant;
use super::dot::{dot_scalar, Isa};
use super::pool::{SharedOut, ThreadPool};
use crate::backend::weight_bytes::MatrixBytes;
use kestrel_quant::Dtype;
use std::cell::RefCell;

/// Tokens up to which float weights are read in place (one tile of tokens).
const DIRECT_TOKENS: usize = 4;
/// f32 values of converted weight rows a thread keeps at once: for a step of a few tokens, 16
/// KiB (the rows are written and read back within L1); for longer steps, which read each block
/// once per four tokens, 64 KiB (within L2).
const SCRATCH_VALUES_FEW: usize = 4 * 1024;
const SCRATCH_VALUES_MANY: usize = 16 * 1024;
/// Multiply-adds below which a matmul runs on the calling thread alone.
pub(super) const SERIAL_WORK: usize = 16 * 1024;

/// A weight as the CPU reads it: one or more parts stacked by rows, each read straight from
/// the memory map (stacking never copies the weights).
#[derive(Clone)]
pub struct CpuMatrix {
    parts: Vec<MatrixBytes>,
    pub rows: usize,
    pub cols: usize,
}

impl CpuMatrix {
    /// `parts` stacked by rows; they must share the column count.
    pub fn stacked(parts: &[MatrixBytes]) -> Result<Self, String> {
        let (rows, cols) = MatrixBytes::stacked_shape(parts)?;
        Ok(CpuMatrix { parts: parts.to_vec(), rows, cols })
    }

    /// The parts, stacked by rows.
    pub fn parts(&self) -> &[MatrixBytes] {
        &self.parts
    }
}

impl From<MatrixBytes> for CpuMatrix {
    fn from(m: MatrixBytes) -> Self {
        CpuMatrix { rows: m.rows, cols: m.cols, parts: vec![m] }
    }
}

/// Writes row `r` of `w` as f32 into `out`.
#[inline]
pub fn weight_row(w: &CpuMatrix, mut r: usize, out: &mut [f32]) {
    for part in &w.parts {
        if r < part.rows {
            let rb = part.row_bytes();
            let bytes = &part.bytes()[r * rb..(r + 1) * rb];
            // Cannot fail: the slice holds exactly `cols` elements of `dtype` by construction.
            kestrel_quant::dequantize_into(part.dtype, bytes, out).expect("weight row size");
            return;
        }
        r -= part.rows;
    }
    panic!("weight row past the matrix's {} rows", w.rows);
}

/// What the matmul does with each result: store it, or add it to what the output holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    Set,
    Add,
}

/// `x [t, in] @ w^T` with `w [out, in]`, giving `[t, out]`.
pub fn matmul(pool: &ThreadPool, isa: Isa, x: &[f32], t: usize, w: &CpuMatrix) -> Vec<f32> {
    let mut y = vec![0.0f32; t * w.rows];
    matmul_into(pool, isa, x, t, w, &mut y, Store::Set);
    y
}

/// `y (store) x [t, in] @ w^T` into `y [t, out]`.
pub fn matmul_into(pool: &ThreadPool, isa: Isa, x: &[f32], t: usize, w: &CpuMatrix, y: &mut [f32], store: Store) {
    let (out, k) = (w.rows, w.cols);
    assert_eq!(x.len(), t * k, "matmul: activation has {} values, expected {t}x{k}", x.len());
    assert_eq!(y.len(), t * out, "matmul: output has {} values, expected {t}x{out}", y.len());
    if t == 0 || out == 0 {
        return;
    }
    let acts = MatmulActs::new(isa, x, t, w);
    let y_out = SharedOut::new(y);
    let job = |rows: std::ops::Range<usize>| {
        // Each part of a stacked weight in turn, over the rows of the range it holds.
        let mut first = 0;
        for part in &w.parts {
            let (a, b) = (rows.start.max(first), rows.end.min(first + part.rows));
            if a < b {
                let dst = Dst { y: y_out, ldy: out, col0: first, store };
                part_rows(isa, &acts, t, part, a - first, b - first, &dst);
            }
            first += part.rows;
        }
    };
    if t * out * k <= SERIAL_WORK {
        job(0..out);
    } else {
        pool.split(out, 8, &job);
    }
}

/// `x` rounded to bf16 (round to nearest even), as the GPU's matmuls take their activations
/// (the backend rounds before [`matmul_into`] unless built with f32 activations).
pub fn bf16_activations(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| kestrel_quant::round_to_bf16(v)).collect()
}

/// A matmul's activation rows as its kernels read them: the f32 values and, where BF16 parts
/// run on AVX-512's bf16 dot products, their packing for that kernel, made once per matmul and
/// shared by every thread and part.
pub(super) struct MatmulActs<'a> {
    x: &'a [f32],
    #[cfg(target_arch = "x86_64")]
    bf16: Option<super::avx512::PackedActs>,
}

impl<'a> MatmulActs<'a> {
    /// The `t` rows of `x` for a matmul with `w` on `isa`'s kernels.
    pub(super) fn new(isa: Isa, x: &'a [f32], t: usize, w: &CpuMatrix) -> Self {
        #[cfg(target_arch = "x86_64")]
        let bf16 = if isa == Isa::Avx512Bf16 && w.parts.iter().any(|p| p.dtype == Dtype::BF16) { super::avx512::PackedActs::new(x, t, w.cols) } else { None };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (isa, t, w);
        MatmulActs {
            x,
            #[cfg(target_arch = "x86_64")]
            bf16,
        }
    }
}

/// Where results go: column `col0 + r` of the `[t, ldy]` output for local weight row `r`.
pub(super) struct Dst {
    pub(super) y: SharedOut,
    pub(super) ldy: usize,
    pub(super) col0: usize,
    pub(super) store: Store,
}

impl Dst {
    /// Stores `v` as token `i`'s value of local weight row `r`.
    ///
    /// # Safety
    /// The calling share owns weight row `r`'s column of the output.
    #[inline(always)]
    pub(super) unsafe fn put(&self, i: usize, r: usize, v: f32) {
        let at = i * self.ldy + self.col0 + r;
        unsafe {
            match self.store {
                Store::Set => self.y.write(at, v),
                Store::Add => {
                    let cell = self.y.slice(at, 1);
                    cell[0] += v;
                }
            }
        }
    }
}

thread_local! {
    /// Converted weight rows of the current block, per thread.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Rows `r0..r1` of one part against every token.
pub(super) fn part_rows(isa: Isa, acts: &MatmulActs, t: usize, part: &MatrixBytes, r0: usize, r1: usize, dst: &Dst) {
    let (x, k) = (acts.x, part.cols);
    #[cfg(target_arch = "x86_64")]
    if let Some(packed) = acts.bf16.as_ref().filter(|_| part.dtype == Dtype::BF16) {
        // SAFETY: the packing exists only on `Isa::Avx512Bf16`, whose features the backend
        // checked when choosing `isa`; rows r0..r1 lie inside this part's bytes.
        return unsafe { super::avx512::rows(x, packed, t, part.bytes().as_ptr(), part.row_bytes(), k, r0, r1, dst) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && t <= DIRECT_TOKENS {
        use super::dot::avx2::{Bf16Rows, F16Rows, F32Rows};
        let (base, row_bytes) = (part.bytes().as_ptr(), part.row_bytes());
        // SAFETY: AVX2 is available (the backend checked it when choosing `isa`); the loaders
        // read rows r0..r1 of this part, which lie inside its bytes.
        match part.dtype {
            Dtype::F32 => return unsafe { lane_rows(isa, x, t, &F32Rows { base, row_bytes }, k, r0, r1, dst) },
            Dtype::BF16 => return unsafe { lane_rows(isa, x, t, &Bf16Rows { base, row_bytes }, k, r0, r1, dst) },
            Dtype::F16 => return unsafe { lane_rows(isa, x, t, &F16Rows { base, row_bytes }, k, r0, r1, dst) },
            _ => {}
        }
    }
    let values = if t <= DIRECT_TOKENS { SCRATCH_VALUES_FEW } else { SCRATCH_VALUES_MANY };
    // Whole tiles of rows (eight, the widest), however long the rows are.
    let block = (values / k.max(1)).max(1).next_multiple_of(8);
    SCRATCH.with_borrow_mut(|scratch| {
        let mut b0 = r0;
        while b0 < r1 {
            let b1 = (b0 + block).min(r1);
            scratch.resize((b1 - b0) * k, 0.0);
            dequant::rows(isa, part, b0, b1, scratch);
            let sub = Dst { y: dst.y, ldy: dst.ldy, col0: dst.col0 + b0, store: dst.store };
            match isa {
                Isa::Scalar => scalar_rows(x, t, scratch, k, b1 - b0, &sub),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2 is available; the loader reads the block just converted.
                Isa::Avx2 | Isa::Avx512Bf16 => unsafe {
                    let rows = super::dot::avx2::F32Rows { base: scratch.as_ptr() as *const u8, row_bytes: 4 * k };
                    lane_rows(isa, x, t, &rows, k, 0, b1 - b0, &sub)
                },
            }
            b0 = b1;
        }
    });
}

/// Every token against converted rows `0..n` of `w` (`[n, k]` f32).
fn scalar_rows(x: &[f32], t: usize, w: &[f32], k: usize, n: usize, dst: &Dst) {
    for r in 0..n {
        let wr = &w[r * k..(r + 1) * k];
        for i in 0..t {
            // SAFETY: this share owns the block's columns.
            unsafe { dst.put(i, r, dot_scalar(&x[i * k..(i + 1) * k], wr)) };
        }
    }
}

/// Every token against rows `r0..r1` of a loader on `isa`'s widest f32 tiles.
///
/// # Safety
/// `isa` is one the CPU runs, with AVX2; rows `r0..r1` lie inside the loader's matrix.
#[cfg(target_arch = "x86_64")]
unsafe fn lane_rows<W: super::dot::avx2::Lanes>(isa: Isa, x: &[f32], t: usize, w: &W, k: usize, r0: usize, r1: usize, dst: &Dst) {
    unsafe {
        if isa == Isa::Avx512Bf16 {
            super::avx512::f32_rows(x, t, w, k, r0, r1, dst)
        } else {
            avx2_rows(x, t, w, k, r0, r1, dst)
        }
    }
}

/// Every token against rows `r0..r1` of a loader, in tiles (`dst` numbers rows as the loader
/// does).
///
/// # Safety
/// AVX2 and F16C are available; rows `r0..r1` lie inside the loader's matrix.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn avx2_rows<W: super::dot::avx2::Lanes>(x: &[f32], t: usize, w: &W, k: usize, r0: usize, r1: usize, dst: &Dst) {
    let mut i0 = 0;
    while i0 < t {
        let mr = (t - i0).min(4);
        let nr = match mr {
            1 => 8,
            2 | 3 => 4,
            _ => 2,
        };
        let xi = x[i0 * k..].as_ptr();
        let mut r = r0;
        while r < r1 {
            let n = if r1 - r >= nr { nr } else { 1 };
            let mut res = [0.0f32; 16];
            // SAFETY: rows r..r + n and tokens i0..i0 + mr exist; `res` holds mr * n values.
            unsafe { tile_dyn(mr, n, xi, k, w, r, res.as_mut_ptr()) };
            for i in 0..mr {
                for j in 0..n {
                    // SAFETY: this share owns rows r0..r1's columns.
                    unsafe { dst.put(i0 + i, r + j, res[i * n + j]) };
                }
            }
            r += n;
        }
        i0 += mr;
    }
}

/// [`avx2::tile`](super::dot::avx2::tile) for a tile shape chosen at run time; `out` gets
/// `mr * nr` values, token-major.
///
/// # Safety
/// As for `tile`; (mr, nr) is one of the shapes [`avx2_rows`] uses.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_dyn<W: super::dot::avx2::Lanes>(mr: usize, nr: usize, x: *const f32, k: usize, w: &W, r: usize, out: *mut f32) {
    use super::dot::avx2::tile;
    unsafe {
        match (mr, nr) {
            (1, 8) => tile::<1, 8, W>(x, k, w, r, k, out, 8),
            (2, 4) => tile::<2, 4, W>(x, k, w, r, k, out, 4),
            (3, 4) => tile::<3, 4, W>(x, k, w, r, k, out, 4),
            (4, 2) => tile::<4, 2, W>(x, k, w, r, k, out, 2),
            (1, 1) => tile::<1, 1, W>(x, k, w, r, k, out, 1),
            (2, 1) => tile::<2, 1, W>(x, k, w, r, k, out, 1),
            (3, 1) => tile::<3, 1, W>(x, k, w, r, k, out, 1),
            (4, 1) => tile::<4, 1, W>(x, k, w, r, k, out, 1),
            _ => unreachable!("no {mr}x{nr} tile"),
        }
    }
}
#[cfg(test)]
mod tests {
    use super::super::dequant::tests::{random_matrix, FORMATS};
    use super::super::dot::dot;
    use super::*;

    fn random(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
            })
            .collect()
    }

    /// The reference: each element the scalar dot product of the rows.
    fn reference(x: &[f32], t: usize, w: &CpuMatrix) -> Vec<f32> {
        let mut y = vec![0.0; t * w.rows];
        let mut row = vec![0.0; w.cols];
        for o in 0..w.rows {
            weight_row(w, o, &mut row);
            for i in 0..t {
                y[i * w.rows + o] = dot_scalar(&x[i * w.cols..(i + 1) * w.cols], &row);
            }
        }
        y
    }

    fn assert_bits(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {i}: {g} against {w}");
        }
    }

    /// Every format, every token count, scalar and SIMD kernels, 1 to 3 threads: the bits of
    /// the scalar reference, and a token's row the same alone as among the others.
    #[test]
    fn every_path_gives_the_reference_bits() {
        let mut seed = 99u64;
        let pools = [ThreadPool::new(1), ThreadPool::new(2), ThreadPool::new(3)];
        for dtype in FORMATS {
            // 77 rows: tiles of 8, 4 and 2 with remainders; 512 columns: two k-quant blocks.
            let (out, k) = (77, 512);
            let w = CpuMatrix::from(random_matrix(dtype, out, k, &mut seed));
            for t in [1, 2, 3, 4, 5, 9, 17] {
                let x = random(t * k, &mut seed);
                let want = reference(&x, t, &w);
                for pool in &pools {
                    for isa in Isa::all_available() {
                        let what = format!("{dtype}, {t} tokens, {} threads, {isa:?}", pool.threads());
                        let y = matmul(pool, isa, &x, t, &w);
                        assert_bits(&y, &want, &what);
                        let alone = matmul(pool, isa, &x[(t - 1) * k..], 1, &w);
                        assert_bits(&alone, &want[(t - 1) * out..], &format!("{what}, last token alone"));
                    }
                }
            }
        }
    }

    /// `[rows, cols]` BF16 weights of normal magnitude (no subnormals: see the next test).
    fn bf16_matrix(rows: usize, cols: usize, seed: &mut u64) -> MatrixBytes {
        let bytes: Vec<u8> = random(rows * cols, seed).iter().flat_map(|v| ((kestrel_quant::round_to_bf16(v * 0.05).to_bits() >> 16) as u16).to_le_bytes()).collect();
        MatrixBytes { data: crate::backend::weight_bytes::SharedBytes::from_vec(bytes), start: 0, dtype: Dtype::BF16, rows, cols }
    }

    /// BF16 weights against bf16 activations (the backend's default) run on AVX-512's bf16 dot
    /// products where the CPU has them: the reference's bits for whole groups of sixteen
    /// inputs, an odd last chunk of eight and a tail, any token and row count, alone and among
    /// other tokens, on every kernel set and thread count.
    #[test]
    fn bf16_activations_on_bf16_weights_give_the_reference_bits() {
        let mut seed = 71u64;
        let pools = [ThreadPool::new(1), ThreadPool::new(3)];
        for k in [8, 16, 24, 40, 100, 512, 1000, 1029] {
            let out = 37;
            let w = CpuMatrix::from(bf16_matrix(out, k, &mut seed));
            for t in [1, 2, 3, 4, 5, 9] {
                let x = bf16_activations(&random(t * k, &mut seed));
                let want = reference(&x, t, &w);
                for pool in &pools {
                    for isa in Isa::all_available() {
                        let what = format!("bf16 k {k}, {t} tokens, {} threads, {isa:?}", pool.threads());
                        assert_bits(&matmul(pool, isa, &x, t, &w), &want, &what);
                        let alone = matmul(pool, isa, &x[(t - 1) * k..], 1, &w);
                        assert_bits(&alone, &want[(t - 1) * out..], &format!("{what}, last token alone"));
                    }
                }
            }
        }
    }

    /// Where the AVX-512 bf16 kernel runs, its one difference from the reference: a subnormal
    /// input counts as zero (the instruction's rule), so a subnormal activation times a large
    /// weight gives 0 there and the product elsewhere; a normal one gives the same bits.
    #[test]
    fn the_avx512_bf16_kernel_reads_subnormal_inputs_as_zero() {
        let k = 32;
        let big = kestrel_quant::round_to_bf16(1e30);
        let bytes: Vec<u8> = (0..k).flat_map(|_| ((big.to_bits() >> 16) as u16).to_le_bytes()).collect();
        let w = CpuMatrix::from(MatrixBytes { data: crate::backend::weight_bytes::SharedBytes::from_vec(bytes), start: 0, dtype: Dtype::BF16, rows: 1, cols: k });
        let pool = ThreadPool::new(1);
        let subnormal = f32::from_bits(0x0001_0000);
        assert!(subnormal > 0.0 && !subnormal.is_normal());
        for (x0, flushed) in [(subnormal, true), (1e-30, false)] {
            let mut x = vec![0.0f32; k];
            x[0] = x0;
            let want = reference(&x, 1, &w)[0];
            assert!(want > 0.0);
            for isa in Isa::all_available() {
                let got = matmul(&pool, isa, &x, 1, &w)[0];
                #[cfg(target_arch = "x86_64")]
                if isa == Isa::Avx512Bf16 && flushed {
                    assert_eq!(got, 0.0, "{isa:?}: the subnormal input was not flushed");
                    continue;
                }
                assert_eq!(got.to_bits(), want.to_bits(), "{isa:?}, input {x0:e}");
            }
        }
    }

    /// Round to nearest even: 1 + 2^-8 is a tie that rounds to 1, 1 + 3 * 2^-9 rounds up to
    /// 1 + 2^-7; NaN stays NaN.
    #[test]
    fn bf16_activations_round_to_nearest_even() {
        let r = bf16_activations(&[1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-9), -0.0, f32::NAN]);
        assert_eq!(&r[..3], &[1.0, 1.0 + 2f32.powi(-7), -0.0]);
        assert!(r[3].is_nan());
    }

    /// Columns that are not a multiple of the lane count take the tail path on every kernel.
    #[test]
    fn ragged_columns_and_accumulation() {
        let mut seed = 5u64;
        let pool = ThreadPool::new(2);
        for k in [1, 7, 19, 37] {
            let (t, out) = (6, 29);
            let x = random(t * k, &mut seed);
            let w = CpuMatrix::from(MatrixBytes::from_f32(random(out * k, &mut seed), out, k));
            let want = reference(&x, t, &w);
            for isa in Isa::all_available() {
                assert_bits(&matmul(&pool, isa, &x, t, &w), &want, &format!("k {k} {isa:?}"));
                let base = random(t * out, &mut seed);
                let mut acc = base.clone();
                matmul_into(&pool, isa, &x, t, &w, &mut acc, Store::Add);
                let added: Vec<f32> = base.iter().zip(&want).map(|(a, b)| a + b).collect();
                assert_bits(&acc, &added, &format!("k {k} {isa:?} added"));
            }
        }
        assert_eq!(dot(&[2.0], &[3.0]), 6.0);
    }

    #[test]
    fn stacked_parts_read_as_one_matrix() {
        let pool = ThreadPool::new(2);
        let (t, inn) = (3, 24);
        let x: Vec<f32> = (0..t * inn).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
        let part = |rows: usize, salt: usize| MatrixBytes::from_f32((0..rows * inn).map(|i| (((i + salt) * 5 % 11) as f32 - 5.0) * 0.05).collect(), rows, inn);
        let (a, b, c) = (part(5, 0), part(1, 3), part(7, 8));
        let stacked = CpuMatrix::stacked(&[a.clone(), b.clone(), c.clone()]).unwrap();
        assert_eq!((stacked.rows, stacked.cols), (13, inn));
        let y = matmul(&pool, Isa::detect(), &x, t, &stacked);
        let parts: Vec<Vec<f32>> = [a, b, c].into_iter().map(|m| matmul(&pool, Isa::detect(), &x, t, &CpuMatrix::from(m))).collect();
        for ti in 0..t {
            let want: Vec<f32> = parts.iter().flat_map(|p| p[ti * p.len() / t..(ti + 1) * p.len() / t].to_vec()).collect();
            assert_eq!(&y[ti * 13..(ti + 1) * 13], &want[..]);
        }
        let Err(err) = CpuMatrix::stacked(&[part(2, 0), MatrixBytes::from_f32(vec![0.0; 10], 1, 10)]) else { panic!("stacked 24 and 10 columns") };
        assert!(err.contains("1x10 matrix under 24 columns"), "{err}");
    }
}
