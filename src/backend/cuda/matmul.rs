//! Launches of the batch-invariant matmul kernels (cuda/matmul.cu). Both kernels run the same
//! per-element instruction sequence, so picking one by row count changes speed only.

use super::{Arg, CudaBackend, CudaMatrix, CudaTensor};

/// Up to this many rows (per group) go to the small-row kernel, which streams the weights
/// once per 16 rows; above it the tiled kernel reuses each weight tile across 64 rows.
const SMALL_MAX_ROWS: usize = 64;

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
}

/// `out[rows, n] = x[., k] @ W^T`. Plain launches read rows `0..rows` of `x`; grouped
/// launches read the rows listed per group (at most `rows` per group).
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_matmul(be: &CudaBackend, out: u64, x: u64, whi: u64, wlo: u64, rows: usize, n: usize, k: usize, grouped: Option<&Grouped>) {
    if rows == 0 || n == 0 {
        return;
    }
    let (table, counts, lists, stride, a_div, active, groups) = match grouped {
        Some(g) => (g.table, g.counts, g.lists, g.list_stride, g.a_div, g.active, g.groups),
        None => (0, 0, 0, 0, 1, 0, 1),
    };
    let args = [
        Arg::Ptr(out),
        Arg::Ptr(x),
        Arg::Ptr(whi),
        Arg::Ptr(wlo),
        Arg::I32(rows as i32),
        Arg::I32(n as i32),
        Arg::I32(k as i32),
        Arg::Ptr(table),
        Arg::Ptr(counts),
        Arg::Ptr(lists),
        Arg::I32(stride as i32),
        Arg::I32(a_div as i32),
        Arg::Ptr(active),
    ];
    if rows <= SMALL_MAX_ROWS {
        be.launch(&be.k.matmul_small, (n.div_ceil(16) as u32, rows.div_ceil(16) as u32, groups as u32), 128, 0, &args);
    } else {
        be.launch(&be.k.matmul_tiled, (n.div_ceil(64) as u32, rows.div_ceil(64) as u32, groups as u32), 128, 0, &args);
    }
}

pub(super) fn matmul(be: &CudaBackend, x: &CudaTensor, w: &CudaMatrix) -> CudaTensor {
    assert_eq!(x.cols, w.cols, "matmul: activation has {} columns, weight has {} inputs", x.cols, w.cols);
    let out = be.tensor(x.rows, w.rows);
    let wlo = w.lo.as_ref().map_or(0, |l| be.ptr(l));
    launch_matmul(be, be.ptr(&out.data), be.ptr(&x.data), be.ptr(&w.hi), wlo, x.rows, w.rows, w.cols, None);
    out
}
