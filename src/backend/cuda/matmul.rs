//! Launches of the batch-invariant matmul kernels (cuda/matmul.cu). All of them run the same
//! per-element instruction sequence, so picking one by row count or width changes speed only.

use super::{ck, Arg, CudaBackend, CudaMatrix, CudaTensor};

/// Up to this many rows (per group) go to the small-row kernel, which streams the weights
/// once per 16 rows; above it the pipelined (or, for F32/F16 weights and K not a multiple of
/// 32, the tiled) kernel reuses each weight tile across 128 (64) rows.
const SMALL_MAX_ROWS: usize = 64;
/// Threads of the small-row kernel: one warp per k-slice (KSLICES = 8 in cuda/matmul.cu).
pub(super) const SMALL_THREADS: u32 = 256;

/// Row lists of a grouped (per-expert) launch.
pub(super) struct Grouped {
    /// Device table `[groups][hi, lo]` of weight pointers.
    pub table: u64,
    pub counts: u64,
    pub lists: u64,
    pub list_stride: usize,
    pub a_div: usize,
    /// Device `[count, experts...]`: the groups that have rows.
    pub active: u64,
    /// Upper bound of the active count (grid slices launched).
    pub groups: usize,
    /// Whether the group weights carry a lo part (F32/F16 sources).
    pub has_lo: bool,
}

/// Bytes of dynamic shared memory of the pipelined kernel (3 stages of A hi, A lo and W tiles
/// of 128 rows x 32 bf16).
pub(super) const PIPELINED_SMEM: usize = 3 * 3 * 128 * 64;

/// `out[rows, n] = x[x_rows, k] @ W^T`. Plain launches read rows `0..rows` of `x`; grouped
/// launches read the rows listed per group (at most `rows` per group).
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_matmul(be: &CudaBackend, out: u64, x: u64, x_rows: usize, whi: u64, wlo: u64, rows: usize, n: usize, k: usize, grouped: Option<&Grouped>) {
    if rows == 0 || n == 0 {
        return;
    }
    let (table, counts, lists, stride, a_div, active, groups, has_lo) = match grouped {
        Some(g) => (g.table, g.counts, g.lists, g.list_stride, g.a_div, g.active, g.groups, g.has_lo),
        None => (0, 0, 0, 0, 1, 0, 1, wlo != 0),
    };
    let tail = [Arg::I32(rows as i32), Arg::I32(n as i32), Arg::I32(k as i32), Arg::Ptr(table), Arg::Ptr(counts), Arg::Ptr(lists), Arg::I32(stride as i32), Arg::I32(a_div as i32), Arg::Ptr(active)];
    if rows <= SMALL_MAX_ROWS {
        let mut args = vec![Arg::Ptr(out), Arg::Ptr(x), Arg::Ptr(whi), Arg::Ptr(wlo)];
        args.extend(tail);
        // Enough warps to keep the memory system busy: narrower column blocks for small N.
        // One wave of resident blocks; more column blocks are walked by the grid-stride loop.
        let (variant, f) = match n {
            0..=2048 => (0, &be.k.matmul_small_nt1),
            2049..=8192 => (1, &be.k.matmul_small_nt2),
            _ => (2, &be.k.matmul_small_nt4),
        };
        let col_blocks = n.div_ceil(8 << variant).min(be.small_matmul_slots[variant]);
        be.launch(f, (col_blocks as u32, rows.div_ceil(16) as u32, groups as u32), SMALL_THREADS, 0, &args);
    } else if !has_lo && k.is_multiple_of(32) && PIPELINED_SMEM <= be.max_dynamic_smem {
        // Split the activations once, then stream bf16 tiles with cp.async.
        let elems = x_rows * k;
        // SAFETY: fully written by split_activations before the matmul reads it.
        let split = ck(unsafe { be.stream.alloc::<u16>(2 * elems) }, "alloc");
        let (hi, lo) = (be.ptr(&split), be.ptr(&split) + 2 * elems as u64);
        be.launch(&be.k.split_activations, ((elems / 8).div_ceil(256) as u32, 1, 1), 256, 0, &[Arg::Ptr(hi), Arg::Ptr(lo), Arg::Ptr(x), Arg::I64((elems / 8) as i64)]);
        let mut args = vec![Arg::Ptr(out), Arg::Ptr(hi), Arg::Ptr(lo), Arg::Ptr(whi)];
        args.extend(tail);
        be.launch(&be.k.matmul_pipelined, (n.div_ceil(128) as u32, rows.div_ceil(128) as u32, groups as u32), 256, PIPELINED_SMEM, &args);
    } else {
        let mut args = vec![Arg::Ptr(out), Arg::Ptr(x), Arg::Ptr(whi), Arg::Ptr(wlo)];
        args.extend(tail);
        be.launch(&be.k.matmul_tiled, (n.div_ceil(64) as u32, rows.div_ceil(64) as u32, groups as u32), 128, 0, &args);
    }
}

pub(super) fn matmul(be: &CudaBackend, x: &CudaTensor, w: &CudaMatrix) -> CudaTensor {
    assert_eq!(x.cols, w.cols, "matmul: activation has {} columns, weight has {} inputs", x.cols, w.cols);
    let out = be.tensor(x.rows, w.rows);
    let wlo = w.lo.as_ref().map_or(0, |l| be.ptr(l));
    launch_matmul(be, be.ptr(&out.data), be.ptr(&x.data), x.rows, be.ptr(&w.hi), wlo, x.rows, w.rows, w.cols, None);
    out
}
