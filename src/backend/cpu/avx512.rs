//! AVX-512 kernels of the reference dot product of [`super::dot`], in its order.
//!
//! Both keep a register's two halves for two weight rows (lanes 0-7 and 8-15, each half the
//! reference's eight lanes), so one instruction works on two rows.
//!
//! f32 weights (read in place, or converted from a block format): two rows' eight values per
//! register, products and sums as AVX2's tiles make them (the same bits: no fused multiply-add).
//!
//! BF16 weights against bf16 activations, on `vdpbf16ps`: it adds two products into each f32
//! lane, `acc += a[2i+1] * b[2i+1]` and then `acc += a[2i] * b[2i]`, each rounded to nearest
//! even. A product of two bf16 values is exact in f32, so a lane that receives element `8c + l`
//! in its odd slot and `8(c + 1) + l` in its even slot does what the reference's lane `l` does
//! for chunks `c` and `c + 1`: two rounded additions in that order. One instruction covers two
//! rows by sixteen inputs. Weights are read in place from the memory map and their words
//! permuted in registers (one two-source permute per two rows and sixteen inputs);
//! activations are packed the same way once per matmul. An odd last chunk runs as separate
//! f32 multiplies and adds, and the tail past the last chunk and the lanes' sum as the
//! reference has them, so the bits are the reference's. The one difference: the instruction
//! treats subnormal inputs and results as zero. Values below 2^-126 in magnitude do not occur
//! in a model's weights and activations but as zeros; the tests pin that case too
//! ([`Isa::Avx512Bf16`](super::dot::Isa::Avx512Bf16)).

use super::dot::avx2::{Bf16Rows, Lanes};

/// Runs `$tile::<MR, NP[, W]>(args)` for the shape (`mr` tokens, `np` row pairs) that
/// [`tile_pairs`] chose.
macro_rules! for_tile_shape {
    ($mr:expr, $np:expr, $tile:ident $(, $w:ty)?; $($arg:expr),+) => {
        match ($mr, $np) {
            (1, 8) => $tile::<1, 8 $(, $w)?>($($arg),+),
            (2, 4) => $tile::<2, 4 $(, $w)?>($($arg),+),
            (3, 2) => $tile::<3, 2 $(, $w)?>($($arg),+),
            (4, 2) => $tile::<4, 2 $(, $w)?>($($arg),+),
            (1, 1) => $tile::<1, 1 $(, $w)?>($($arg),+),
            (2, 1) => $tile::<2, 1 $(, $w)?>($($arg),+),
            (3, 1) => $tile::<3, 1 $(, $w)?>($($arg),+),
            (4, 1) => $tile::<4, 1 $(, $w)?>($($arg),+),
            (mr, np) => unreachable!("no {mr}x{np} tile"),
        }
    };
}
use super::matmul::Dst;
use std::arch::x86_64::*;

/// AVX-512 F, BW and BF16 (the caller checks AVX2 and F16C, which every such CPU has).
pub fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512bf16"))
}

/// Rows of weights a thread runs every token against before moving on (within L1 at the
/// widest rows the presets have), for steps of more than one tile of tokens.
const ROW_BLOCK_BYTES: usize = 32 * 1024;

/// Activation rows packed for the kernel: per token and sixteen inputs, the bf16 words in the
/// order the weights are permuted to.
pub struct PackedActs {
    words: Vec<u16>,
    /// Words per token: sixteen per whole group of two chunks.
    stride: usize,
}

impl PackedActs {
    /// `x`'s `t` rows of `k` values packed, or `None` where a value is not a bf16 value (a
    /// backend with f32 activations): the kernel would round it.
    pub fn new(x: &[f32], t: usize, k: usize) -> Option<PackedActs> {
        let stride = k / 16 * 16;
        let mut words = vec![0u16; t * stride];
        for (row, packed) in x.chunks_exact(k).zip(words.chunks_exact_mut(stride.max(1))) {
            for (src, dst) in row[..stride].chunks_exact(16).zip(packed.chunks_exact_mut(16)) {
                for l in 0..8 {
                    let (first, second) = (src[l].to_bits(), src[8 + l].to_bits());
                    if (first | second) & 0xffff != 0 {
                        return None;
                    }
                    dst[2 * l + 1] = (first >> 16) as u16;
                    dst[2 * l] = (second >> 16) as u16;
                }
            }
        }
        Some(PackedActs { words, stride })
    }
}

/// Rows `r0..r1` of a BF16 matrix (row `r` at `base + r * row_bytes`, `k` values) against the
/// `t` tokens of `x` (`acts` packed from it), into `dst`.
///
/// # Safety
/// AVX2, F16C and this module's features are available; the rows lie inside the matrix.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512bf16")]
pub unsafe fn rows(x: &[f32], acts: &PackedActs, t: usize, base: *const u8, row_bytes: usize, k: usize, r0: usize, r1: usize, dst: &Dst) {
    let block = if t <= 4 { r1 - r0 } else { (ROW_BLOCK_BYTES / row_bytes.max(1)).max(16) };
    let mut b0 = r0;
    while b0 < r1 {
        let b1 = (b0 + block).min(r1);
        let mut i0 = 0;
        while i0 < t {
            let mr = (t - i0).min(4);
            let mut r = b0;
            while r < b1 {
                let np = tile_pairs(mr, b1 - r);
                let ptrs = tile_rows(r, np, b1, |row| base.wrapping_add(row * row_bytes));
                let mut out = [[0.0f32; 16]; 4];
                let xp = acts.words.as_ptr().wrapping_add(i0 * acts.stride);
                let xf = x.as_ptr().wrapping_add(i0 * k);
                // SAFETY: tokens i0..i0 + mr and the rows named lie inside their buffers.
                unsafe { for_tile_shape!(mr, np, tile; xp, acts.stride, xf, k, &ptrs, &mut out) }
                // SAFETY: this share owns rows r0..r1's columns.
                r += unsafe { store_tile(&out, mr, np, i0, r, b1, dst) };
            }
            i0 += mr;
        }
        b0 = b1;
    }
}

/// Row pairs of the next tile for `mr` tokens with `left` rows to go: the widest tile's (eight
/// accumulators) while they fill it, else one.
#[inline(always)]
fn tile_pairs(mr: usize, left: usize) -> usize {
    let widest = match mr {
        1 => 8,
        2 => 4,
        _ => 2,
    };
    if left >= 2 * widest {
        widest
    } else {
        1
    }
}

/// Where the `2 * np` rows of a tile from row `r` start, the last row before `end` paired with
/// itself where one is left over (its twin's result is dropped).
#[inline(always)]
fn tile_rows(r: usize, np: usize, end: usize, row: impl Fn(usize) -> *const u8) -> [*const u8; 16] {
    let mut ptrs = [row(r); 16];
    for (j, p) in ptrs.iter_mut().enumerate().take(2 * np) {
        *p = row((r + j).min(end - 1));
    }
    ptrs
}

/// Stores a tile's results (tokens `i0..i0 + mr`, rows from `r`, none at or past `end`) into
/// `dst`; returns the rows stored.
///
/// # Safety
/// The calling share owns the columns of those rows.
#[inline(always)]
unsafe fn store_tile(out: &[[f32; 16]; 4], mr: usize, np: usize, i0: usize, r: usize, end: usize, dst: &Dst) -> usize {
    let n = (2 * np).min(end - r);
    for (i, row) in out.iter().enumerate().take(mr) {
        for (j, &v) in row.iter().enumerate().take(n) {
            unsafe { dst.put(i0 + i, r + j, v) };
        }
    }
    n
}

/// The word permutation of a two-row register: in each half, word `2l + 1` takes input `l`
/// of the sixteen and word `2l` input `8 + l`.
#[inline(always)]
unsafe fn pair_index() -> __m512i {
    let idx: [u16; 32] = std::array::from_fn(|j| {
        let (half, w) = (j / 16, j % 16);
        (16 * half + if w % 2 == 1 { w / 2 } else { 8 + w / 2 }) as u16
    });
    // SAFETY: 64 bytes read from a 64-byte array.
    unsafe { _mm512_loadu_si512(idx.as_ptr() as *const __m512i) }
}

/// `out[i][j]` = the reference dot product of token `i` (of `MR`) with row `j` (of `2 * NP`).
#[inline(always)]
unsafe fn tile<const MR: usize, const NP: usize>(xp: *const u16, xstride: usize, xf: *const f32, k: usize, rows: &[*const u8; 16], out: &mut [[f32; 16]; 4]) {
    unsafe {
        let idx = pair_index();
        let groups = k / 16;
        let mut acc = [[_mm512_setzero_ps(); NP]; MR];
        for g in 0..groups {
            let mut w = [_mm512_setzero_si512(); NP];
            for (p, wp) in w.iter_mut().enumerate() {
                let a = _mm256_loadu_si256(rows[2 * p].add(32 * g) as *const __m256i);
                let b = _mm256_loadu_si256(rows[2 * p + 1].add(32 * g) as *const __m256i);
                *wp = _mm512_permutexvar_epi16(idx, _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b));
            }
            for (i, acc_i) in acc.iter_mut().enumerate() {
                let xv = _mm512_broadcast_i64x4(_mm256_loadu_si256(xp.add(i * xstride + 16 * g) as *const __m256i));
                for (a, wp) in acc_i.iter_mut().zip(&w) {
                    *a = _mm512_dpbf16_ps(*a, std::mem::transmute::<__m512i, __m512bh>(xv), std::mem::transmute::<__m512i, __m512bh>(*wp));
                }
            }
        }
        let chunks = k / 8;
        if chunks % 2 == 1 {
            // The last chunk alone: f32 products and sums, as the reference's next step.
            f32_chunk::<MR, NP, Bf16Rows>(&mut acc, xf, k, rows, chunks - 1);
        }
        finish::<MR, NP, Bf16Rows>(&acc, xf, k, rows, out);
    }
}

/// `a` in the low half and `b` in the high half of one register.
#[inline(always)]
unsafe fn two_halves(a: __m256, b: __m256) -> __m512 {
    unsafe { _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b))) }
}

/// Rows `r0..r1` of a loader's f32 values against the `t` tokens of `x`, into `dst` (which
/// numbers rows as the loader does): AVX2's tiles with two rows per register.
///
/// # Safety
/// AVX2, F16C and AVX-512 F are available; rows `r0..r1` lie inside the loader's matrix.
#[target_feature(enable = "avx2,f16c,avx512f")]
pub unsafe fn f32_rows<W: Lanes>(x: &[f32], t: usize, w: &W, k: usize, r0: usize, r1: usize, dst: &Dst) {
    let mut i0 = 0;
    while i0 < t {
        let mr = (t - i0).min(4);
        let xi = x.as_ptr().wrapping_add(i0 * k);
        let mut r = r0;
        while r < r1 {
            let np = tile_pairs(mr, r1 - r);
            let ptrs = tile_rows(r, np, r1, |row| w.row(row));
            let mut out = [[0.0f32; 16]; 4];
            // SAFETY: tokens i0..i0 + mr and the rows named exist.
            unsafe { for_tile_shape!(mr, np, f32_tile, W; xi, k, &ptrs, &mut out) }
            // SAFETY: this share owns rows r0..r1's columns.
            r += unsafe { store_tile(&out, mr, np, i0, r, r1, dst) };
        }
        i0 += mr;
    }
}

/// `out[i][j]` = the reference dot product of token `i` (of `MR`, rows `k` apart from `x`) with
/// the loader's row at `rows[j]` (of `2 * NP`).
#[inline(always)]
unsafe fn f32_tile<const MR: usize, const NP: usize, W: Lanes>(x: *const f32, k: usize, rows: &[*const u8; 16], out: &mut [[f32; 16]; 4]) {
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NP]; MR];
        for c in 0..k / 8 {
            f32_chunk::<MR, NP, W>(&mut acc, x, k, rows, c);
        }
        finish::<MR, NP, W>(&acc, x, k, rows, out);
    }
}

/// Chunk `c` (eight inputs) of every token against every row pair, added into `acc`: the
/// reference's rounded products and sums.
#[inline(always)]
unsafe fn f32_chunk<const MR: usize, const NP: usize, W: Lanes>(acc: &mut [[__m512; NP]; MR], x: *const f32, k: usize, rows: &[*const u8; 16], c: usize) {
    unsafe {
        let mut w = [_mm512_setzero_ps(); NP];
        for (p, wp) in w.iter_mut().enumerate() {
            *wp = two_halves(W::load(rows[2 * p], c), W::load(rows[2 * p + 1], c));
        }
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let x8 = _mm256_loadu_ps(x.add(i * k + 8 * c));
            let xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(x8)));
            for (a, wp) in acc_i.iter_mut().zip(&w) {
                *a = _mm512_add_ps(*a, _mm512_mul_ps(xv, *wp));
            }
        }
    }
}

/// Each half's lanes summed in the reference order, plus the inputs past the last whole chunk
/// summed in order, into `out`.
#[inline(always)]
unsafe fn finish<const MR: usize, const NP: usize, W: Lanes>(acc: &[[__m512; NP]; MR], x: *const f32, k: usize, rows: &[*const u8; 16], out: &mut [[f32; 16]; 4]) {
    unsafe {
        for (i, acc_i) in acc.iter().enumerate() {
            for (p, a) in acc_i.iter().enumerate() {
                let lo = _mm512_castps512_ps256(*a);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*a)));
                for (j, half) in [(2 * p, lo), (2 * p + 1, hi)] {
                    let mut tail = 0.0f32;
                    for kk in k / 8 * 8..k {
                        tail += *x.add(i * k + kk) * W::scalar(rows[j], kk);
                    }
                    out[i][j] = super::dot::avx2::reduce(half) + tail;
                }
            }
        }
    }
}
