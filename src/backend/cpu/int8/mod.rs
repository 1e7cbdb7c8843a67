//! The integer matmul path for quantized weights, llama.cpp's way: each activation row is
//! quantized to 8 bits ([`act`]), and each weight row is read in place from the memory map and
//! multiplied in integers, block by block, with the block results added in f32 in a fixed
//! order ([`scalar`] defines every bit; the AVX2 kernels give the same ones).
//!
//! It changes the numerics (the activation loses bits), so it is a mode beside the f32
//! reference ([`MatmulMode::Exact`], the library's default). It keeps the reference's
//! structure: a row's activation blocks depend on that row alone and every output element is
//! one fixed computation, so the results never depend on the batch, the thread count or the
//! kernels. Weights in formats without an integer kernel (floats and the other block formats)
//! take the exact path in every mode. [`MatmulMode::Auto`] (the command line's default) takes
//! the integer path only for the GGUF formats llama.cpp's CPU build runs on 8-bit activations
//! and where it is the faster path here: Q4_K, Q6_K and Q4_0.

pub mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod scalar;

use super::dot::Isa;
use super::matmul::{self, CpuMatrix, Dst, Store};
use super::pool::{SharedOut, ThreadPool};
use crate::backend::weight_bytes::MatrixBytes;
use act::{BlockQ80, BlockQ8K, QK8_0, QK_K};
use kestrel_quant::Dtype;

/// How the CPU multiplies quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatmulMode {
    /// Every weight converted to f32 exactly and multiplied in f32: the reference.
    #[default]
    Exact,
    /// Q4_K, Q6_K, Q8_0, Q4_0 and Int4 weights against 8-bit activations in integers; the
    /// other formats as `Exact` (and Int4 rows the q8_K blocks do not tile, see
    /// [`int4_takes_q8k`]).
    Int8,
    /// Q4_K, Q6_K and Q4_0 weights as `Int8` (llama.cpp multiplies them so, and the integer
    /// kernels run them several times faster than converting each weight), everything else
    /// as `Exact`: Q8_0's integer kernel is slower than its exact path at prefill sizes and
    /// gains nothing at decode (its bytes bound both), and Int4 checkpoints (GPTQ/AutoRound)
    /// keep the f32 maths their own tools define.
    Auto,
}

impl MatmulMode {
    pub const NAMES: [&'static str; 3] = ["exact", "int8", "auto"];
}

impl std::fmt::Display for MatmulMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MatmulMode::Exact => "exact",
            MatmulMode::Int8 => "int8",
            MatmulMode::Auto => "auto",
        })
    }
}

impl std::str::FromStr for MatmulMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "exact" => Ok(MatmulMode::Exact),
            "int8" => Ok(MatmulMode::Int8),
            "auto" => Ok(MatmulMode::Auto),
            _ => Err(format!("unknown CPU matmul mode `{s}`; expected one of: {}", MatmulMode::NAMES.join(", "))),
        }
    }
}

/// Bytes of weight rows a thread runs every token against before moving on (within L1).
const ROW_BLOCK_BYTES: usize = 12 * 1024;

/// The activation blocks a weight format's integer kernel reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ActFormat {
    Q8K,
    Q80,
}

/// The activation blocks `mode` multiplies weights of `dtype` (rows of `cols` values) against,
/// or `None` where it takes the exact path.
fn act_format(mode: MatmulMode, dtype: Dtype, cols: usize) -> Option<ActFormat> {
    match (mode, dtype) {
        (MatmulMode::Exact, _) => None,
        (_, Dtype::Q4K | Dtype::Q6K) => Some(ActFormat::Q8K),
        (_, Dtype::Q4_0) => Some(ActFormat::Q80),
        (MatmulMode::Int8, Dtype::Q8_0) => Some(ActFormat::Q80),
        (MatmulMode::Int8, Dtype::Int4 { group }) if int4_takes_q8k(group as usize, cols) => Some(ActFormat::Q8K),
        _ => None,
    }
}

/// Whether Int4 rows of `cols` values in groups of `group` run against q8_K activations: the
/// rows are whole q8_K blocks, and each group lies within one block or spans whole ones, so
/// that one activation scale covers each piece of a group.
pub fn int4_takes_q8k(group: usize, cols: usize) -> bool {
    cols % QK_K == 0 && group % 32 == 0 && (QK_K % group == 0 || group % QK_K == 0)
}

/// Whether weights of `dtype`, rows of `cols` values, take the integer path in `mode`.
pub fn takes_integer_path(mode: MatmulMode, dtype: Dtype, cols: usize) -> bool {
    act_format(mode, dtype, cols).is_some()
}

/// The activation rows of one matmul, quantized in the forms its weights need.
struct QuantActs {
    q8k: Vec<BlockQ8K>,
    q80: Vec<BlockQ80>,
    /// Blocks per row of each form.
    k_blocks: usize,
    blocks_0: usize,
}

impl QuantActs {
    /// Quantizes the `t` rows of `x` (`k` values each), rows split over the pool.
    fn new(pool: &ThreadPool, x: &[f32], t: usize, k: usize, q8k: bool, q80: bool) -> Self {
        let (k_blocks, blocks_0) = (if q8k { k / QK_K } else { 0 }, if q80 { k / QK8_0 } else { 0 });
        let mut acts = QuantActs { q8k: vec![BlockQ8K::default(); t * k_blocks], q80: vec![BlockQ80::default(); t * blocks_0], k_blocks, blocks_0 };
        let (out_k, out_0) = (SharedOut::new(&mut acts.q8k), SharedOut::new(&mut acts.q80));
        let job = |rows: std::ops::Range<usize>| {
            for i in rows {
                let xi = &x[i * k..(i + 1) * k];
                // SAFETY: each row's blocks belong to the one share that holds the row.
                unsafe {
                    if q8k {
                        act::quantize_q8_k(xi, out_k.slice(i * k_blocks, k_blocks));
                    }
                    if q80 {
                        act::quantize_q8_0(xi, out_0.slice(i * blocks_0, blocks_0));
                    }
                }
            }
        };
        if t * k <= 64 * 1024 {
            job(0..t);
        } else {
            pool.split(t, 1, &job);
        }
        acts
    }

    fn q8k_row(&self, i: usize) -> &[BlockQ8K] {
        &self.q8k[i * self.k_blocks..(i + 1) * self.k_blocks]
    }

    fn q80_row(&self, i: usize) -> &[BlockQ80] {
        &self.q80[i * self.blocks_0..(i + 1) * self.blocks_0]
    }
}

/// `y (store) x [t, in] @ w^T` into `y [t, out]`, the parts `mode` multiplies in integers
/// through their kernels, the others exactly.
pub fn matmul_into(pool: &ThreadPool, isa: Isa, mode: MatmulMode, x: &[f32], t: usize, w: &CpuMatrix, y: &mut [f32], store: Store) {
    let (out, k) = (w.rows, w.cols);
    let formats: Vec<ActFormat> = w.parts().iter().filter_map(|p| act_format(mode, p.dtype, p.cols)).collect();
    if formats.is_empty() {
        return matmul::matmul_into(pool, isa, x, t, w, y, store);
    }
    assert_eq!(x.len(), t * k, "matmul: activation has {} values, expected {t}x{k}", x.len());
    assert_eq!(y.len(), t * out, "matmul: output has {} values, expected {t}x{out}", y.len());
    if t == 0 || out == 0 {
        return;
    }
    let acts = QuantActs::new(pool, x, t, k, formats.contains(&ActFormat::Q8K), formats.contains(&ActFormat::Q80));
    let exact_acts = matmul::MatmulActs::new(isa, x, t, w);
    let y_out = SharedOut::new(y);
    let job = |rows: std::ops::Range<usize>| {
        let mut first = 0;
        for part in w.parts() {
            let (a, b) = (rows.start.max(first), rows.end.min(first + part.rows));
            if a < b {
                let dst = Dst { y: y_out, ldy: out, col0: first, store };
                match act_format(mode, part.dtype, part.cols) {
                    Some(_) => int8_rows(isa, &acts, t, part, a - first, b - first, &dst),
                    None => matmul::part_rows(isa, &exact_acts, t, part, a - first, b - first, &dst),
                }
            }
            first += part.rows;
        }
    };
    if t * out * k <= matmul::SERIAL_WORK {
        job(0..out);
    } else {
        pool.split(out, 8, &job);
    }
}

/// Runs `avx2::kernel::<T>` for the tile of `out.len()` tokens (one to four).
#[cfg(target_arch = "x86_64")]
macro_rules! tiles {
    ($out:expr, $kernel:ident, $row:expr, $($arg:expr),+) => {
        unsafe {
            match $out.len() {
                1 => $out.copy_from_slice(&avx2::$kernel::<1>($row, $($arg),+)),
                2 => $out.copy_from_slice(&avx2::$kernel::<2>($row, $($arg),+)),
                3 => $out.copy_from_slice(&avx2::$kernel::<3>($row, $($arg),+)),
                _ => $out.copy_from_slice(&avx2::$kernel::<4>($row, $($arg),+)),
            }
        }
    };
}

/// Rows `r0..r1` of an integer-kernel part against every token.
fn int8_rows(isa: Isa, acts: &QuantActs, t: usize, part: &MatrixBytes, r0: usize, r1: usize, dst: &Dst) {
    let (rb, bytes) = (part.row_bytes(), part.bytes());
    // Blocks of weight rows that stay in L1 while every tile of up to four tokens (whose
    // activation blocks stay in L1 across the block's rows) passes over them.
    let block = (ROW_BLOCK_BYTES / rb.max(1)).max(1);
    let rows = |kernel: &dyn Fn(&[u8], usize, &mut [f32])| {
        let mut res = [0.0f32; 4];
        for b0 in (r0..r1).step_by(block) {
            let b1 = (b0 + block).min(r1);
            let mut i0 = 0;
            while i0 < t {
                let n = (t - i0).min(4);
                for r in b0..b1 {
                    kernel(&bytes[r * rb..(r + 1) * rb], i0, &mut res[..n]);
                    for (i, &v) in res[..n].iter().enumerate() {
                        // SAFETY: this share owns rows r0..r1's columns.
                        unsafe { dst.put(i0 + i, r, v) };
                    }
                }
                i0 += n;
            }
        }
    };
    let (k_stride, stride_0) = (acts.k_blocks, acts.blocks_0);
    match isa {
        Isa::Scalar => {
            let dots = |row: &[u8], i0: usize, out: &mut [f32]| {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = match part.dtype {
                        Dtype::Q4K => scalar::q4_k_row(row, acts.q8k_row(i0 + i)),
                        Dtype::Q6K => scalar::q6_k_row(row, acts.q8k_row(i0 + i)),
                        Dtype::Q8_0 => scalar::q8_0_row(row, acts.q80_row(i0 + i)),
                        Dtype::Q4_0 => scalar::q4_0_row(row, acts.q80_row(i0 + i)),
                        Dtype::Int4 { group } => scalar::int4_row(row, group as usize, acts.q8k_row(i0 + i)),
                        other => unreachable!("no integer kernel for {other}"),
                    };
                }
            };
            rows(&dots)
        }
        // SAFETY (each kernel): AVX2 and F16C are available (the backend checked them when choosing
        // `isa`); tokens i0..i0 + n hold a block per block of the weight row.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512Bf16 => match part.dtype {
            Dtype::Q4K => rows(&|row, i0, out| tiles!(out, q4_k, row, &acts.q8k[i0 * k_stride..], k_stride)),
            Dtype::Q6K => rows(&|row, i0, out| tiles!(out, q6_k, row, &acts.q8k[i0 * k_stride..], k_stride)),
            Dtype::Q8_0 => rows(&|row, i0, out| tiles!(out, q8_0, row, &acts.q80[i0 * stride_0..], stride_0)),
            Dtype::Q4_0 => rows(&|row, i0, out| tiles!(out, q4_0, row, &acts.q80[i0 * stride_0..], stride_0)),
            Dtype::Int4 { group } => rows(&|row, i0, out| tiles!(out, int4, row, group as usize, &acts.q8k[i0 * k_stride..], k_stride)),
            other => unreachable!("no integer kernel for {other}"),
        },
    }
}


#[cfg(test)]
mod tests;
