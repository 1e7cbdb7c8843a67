//! Launches of the batch-invariant matmul kernels (cuda/matmul.cu). All of them run the same
//! per-element instruction sequence, so picking one by row count or width changes speed only.

use super::tensor::WeightStorage;
use super::{ck, Arg, CudaBackend, CudaMatrix, CudaTensor, CudaVector, Kernels};
use cudarc::driver::CudaFunction;

/// Up to this many rows (per group) go to the small-row kernels, which stream the weights
/// once per launch (per 64 rows); above it the pipelined (or, for F32/F16 weights and K not a multiple of
/// 32, the tiled) kernel reuses each weight tile across 128 (64) rows.
const SMALL_MAX_ROWS: usize = 64;
/// Threads of the small-row kernel: one warp per k-slice (KSLICES = 8 in cuda/matmul.cu).
pub(super) const SMALL_THREADS: u32 = 256;

/// A small-row kernel: `mt` m16 tiles (16 * mt rows) and `nt` n8 tiles per block.
pub(super) struct SmallVariant {
    pub mt: usize,
    pub nt: usize,
    pub kernel: fn(&Kernels) -> &CudaFunction,
}

/// The small-row kernels of cuda/matmul.cu. A launch takes the fewest m tiles that cover its
/// rows (so each block streams the weights once for all of them) and, for that, the n-tile
/// width suited to the output width.
pub(super) const SMALL_VARIANTS: [SmallVariant; 7] = [
    SmallVariant { mt: 1, nt: 1, kernel: |k| &k.matmul_small_nt1 },
    SmallVariant { mt: 1, nt: 2, kernel: |k| &k.matmul_small_nt2 },
    SmallVariant { mt: 1, nt: 4, kernel: |k| &k.matmul_small_nt4 },
    SmallVariant { mt: 2, nt: 1, kernel: |k| &k.matmul_small2_nt1 },
    SmallVariant { mt: 2, nt: 2, kernel: |k| &k.matmul_small2_nt2 },
    SmallVariant { mt: 4, nt: 1, kernel: |k| &k.matmul_small4_nt1 },
    SmallVariant { mt: 4, nt: 2, kernel: |k| &k.matmul_small4_nt2 },
];

/// Inputs up to which one-m-tile launches take four n tiles per block (16 k blocks).
const SHORT_K: usize = 512;

/// Fewest column blocks per group a grouped small-row launch gives each expert.
const GROUP_MIN_COL_BLOCKS: usize = 8;

/// Index into [`SMALL_VARIANTS`] for `rows <= SMALL_MAX_ROWS` rows, `n` output columns and `k`
/// inputs, in a grouped (per-expert) launch or not.
fn small_variant(rows: usize, n: usize, k: usize, grouped: bool) -> usize {
    let mt = rows.div_ceil(16).next_power_of_two().min(4);
    // Enough warps to keep the memory system busy: narrower column blocks for small N. (Four n
    // tiles per block measured no faster than two at any width, 4096 to 248320 columns.) Past
    // one m tile the one-n-tile kernels keep 16 or 8 k blocks in flight in about 250 registers,
    // one block per SM, and two n tiles win from 1024 columns (H100, 32 rows: 2048 x 4096 36.6 ->
    // 28.1 us; 35B-A3B's grouped expert matmuls 65 -> 32 ms per step).
    // In a grouped launch, a K of at most 16 k blocks leaves each warp one or two k blocks per
    // column block and each block many column blocks of its expert: four n tiles per block load
    // four times the bytes per round trip. (Plain launches keep narrow blocks: a small model's
    // K = 256 matmuls lost 15% of the default model's decode speed with four.)
    let nt = match mt {
        1 if grouped && k <= SHORT_K => 4,
        1 if n <= 2048 => 1,
        1 => 2,
        _ if n < 1024 => 1,
        _ => 2,
    };
    // The widest n tile that exists for this m tile count.
    (0..SMALL_VARIANTS.len()).filter(|&i| SMALL_VARIANTS[i].mt == mt && SMALL_VARIANTS[i].nt <= nt).max_by_key(|&i| SMALL_VARIANTS[i].nt).expect("every m tile count has an nt=1 kernel")
}

/// A router matmul that routes in its last block: `matmul_router_stream` (cuda/matmul_stream.cu) where
/// the streaming kernels take the shape (one n tile: the same logits as matmul_small_nt1 and
/// matmul_stream_nt1), else `matmul_router`, which runs matmul_small_nt1's blocks and so stands
/// in only where that is the kernel a plain launch would take.
pub(super) struct RouterLaunch<'a> {
    pub kernel: &'a CudaFunction,
    pub blocks: u32,
    pub threads: u32,
    /// Dynamic shared memory of the matmul (the routing's is added by the caller).
    pub smem: usize,
    pub stages: usize,
}

/// The router launch for `rows` tokens, a router of `n` outputs over `k` inputs (with a lo
/// part: F32/F16 sources), or None where neither kernel applies.
pub(super) fn router_launch(be: &CudaBackend, rows: usize, n: usize, k: usize, has_lo: bool) -> Option<RouterLaunch<'_>> {
    // Room for the input norm's weight either way (the caller decides whether it fuses the
    // norm after the shape).
    if let Some(shape) = be.stream_kernels.as_ref().filter(|_| !has_lo).and_then(|sk| sk.shape_of_variant(rows, k, 0, sk.ring_bytes)?.with_norm_weight(sk, k)) {
        let blocks = n.div_ceil(8).min(shape.blocks_per_sm * be.sm_count) as u32;
        return Some(RouterLaunch { kernel: &be.k.matmul_router_stream, blocks, threads: STREAM_THREADS, smem: shape.smem, stages: shape.stages });
    }
    (rows <= 16 && small_variant(rows, n, k, false) == 0).then(|| RouterLaunch { kernel: &be.k.matmul_router, blocks: n.div_ceil(8).min(be.small_matmul_slots[0]) as u32, threads: SMALL_THREADS, smem: 0, stages: 0 })
}

/// What a matmul does with each product (`struct Epilogue` in cuda/matmul.cu, passed by
/// value): store it, add it into the output, apply SwiGLU to gate/up pairs, or cut the columns
/// into parts. Every mode computes the same products; only the store differs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Epilogue {
    mode: i32,
    parts: i32,
    width: [i32; 4],
    ptr: [u64; 4],
}

// SAFETY: a plain `repr(C)` struct of integers with the layout of the kernels' `struct Epilogue`.
unsafe impl cudarc::driver::DeviceRepr for Epilogue {}

/// Most column parts one launch can write.
pub(super) const MAX_PARTS: usize = 4;

impl Epilogue {
    pub const STORE: Epilogue = Epilogue { mode: 0, parts: 0, width: [0; 4], ptr: [0; 4] };
    pub const ADD: Epilogue = Epilogue { mode: 1, parts: 0, width: [0; 4], ptr: [0; 4] };
    pub const SWIGLU: Epilogue = Epilogue { mode: 2, parts: 0, width: [0; 4], ptr: [0; 4] };

    pub(super) fn parts(parts: &[(u64, usize)]) -> Epilogue {
        assert!((1..=MAX_PARTS).contains(&parts.len()), "matmul: {} output parts (1..={MAX_PARTS})", parts.len());
        let mut e = Epilogue { mode: 3, parts: parts.len() as i32, ..Default::default() };
        for (i, &(ptr, width)) in parts.iter().enumerate() {
            e.ptr[i] = ptr;
            e.width[i] = width as i32;
        }
        e
    }

    pub(super) fn is_swiglu(&self) -> bool {
        self.mode == Epilogue::SWIGLU.mode
    }

    /// The store of output columns `c0..c0 + n` alone, for the rows of a stacked weight stored
    /// apart (a parts store whose parts those columns are, whole); None where that is not so.
    pub(super) fn restrict(&self, c0: usize, n: usize) -> Option<Epilogue> {
        if self.mode != 3 {
            return None;
        }
        let mut start = 0;
        let mut picked = Vec::new();
        for i in 0..self.parts as usize {
            let w = self.width[i] as usize;
            if start >= c0 && start + w <= c0 + n {
                picked.push((self.ptr[i], w));
            } else if start < c0 + n && start + w > c0 {
                return None;
            }
            start += w;
        }
        (picked.iter().map(|p| p.1).sum::<usize>() == n).then(|| Epilogue::parts(&picked))
    }
}

/// The rows a normalizing streaming launch starts from (`struct MoeCombine` in
/// cuda/routing.cuh, passed by value): the residual rows (`resid`), and, where `y` is set, the
/// experts' rows and weights, the shared expert's rows and gate (0: none) to add into them, and
/// where the updated residual rows go. [`plain_rows`] leaves out the MoE.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct MoeCombine {
    pub resid: u64,
    pub y: u64,
    pub topk_w: u64,
    pub shared: u64,
    pub shared_gate: u64,
    pub resid_out: u64,
    pub shared_stride: i64,
    pub k: i32,
    pub slots: i32,
}

/// The streaming kernels and launch shape of a normalizing launch (`matmul_stream_norm_*`,
/// `matmul_stream_combine_*`) of `rows` rows through `w` with `norm`, or None where it does not
/// apply: the streaming kernels do not take the shape, or the norm would not take the row
/// norm's register path, which the launch reproduces.
fn normed_shape<'a>(be: &'a CudaBackend, rows: usize, norm: &CudaVector, w: &CudaMatrix) -> Option<(&'a StreamKernels, StreamShape)> {
    let sk = be.stream_kernels.as_ref().filter(|sk| sk.norm_in_matmul)?;
    if w.bf16().is_none() || rows == 0 || !be.norm_in_registers(norm, w.cols) {
        return None;
    }
    let shape = sk.shape(rows, w.cols, false)?.with_norm_weight(sk, w.cols)?;
    Some((sk, shape))
}

/// Whether [`launch_normed`] takes `rows` rows through `w` with `norm` (otherwise the caller
/// runs the separate ops).
pub(super) fn normed_launch_fits(be: &CudaBackend, rows: usize, norm: &CudaVector, w: &CudaMatrix) -> bool {
    normed_shape(be, rows, norm, w).is_some()
}

/// `rms_norm(x, norm) @ w^T` stored by `epi` at `out`, the norm made inside the streaming launch
/// (`matmul_stream_norm_*`, cuda/matmul_stream.cu): `combine.resid` holds the rows of x, or,
/// with `combine.y` set, the residual rows before the MoE, whose sum the launch adds first
/// (`matmul_stream_combine_*`, writing the updated rows to `combine.resid_out`). Bitwise
/// rms_norm (after moe_combine_norm's sum) then the matmul. Only where
/// [`normed_launch_fits`].
#[allow(clippy::too_many_arguments)]
fn launch_normed(be: &CudaBackend, out: u64, combine: MoeCombine, rows: usize, norm: &CudaVector, eps: f32, w: &CudaMatrix, epi: Epilogue) {
    let (sk, shape) = normed_shape(be, rows, norm, w).expect("launch_normed: the caller checked normed_launch_fits");
    let kernel = if combine.y != 0 {
        [&be.k.matmul_stream_combine_nt1, &be.k.matmul_stream_combine_nt2, &be.k.matmul_stream_combine_nt4][shape.variant]
    } else {
        [&be.k.matmul_stream_norm_nt1, &be.k.matmul_stream_norm_nt2, &be.k.matmul_stream_norm_nt4][shape.variant]
    };
    let args = [
        Arg::Ptr(out),
        Arg::Ptr(be.ptr(w.bf16().expect("normed_launch_fits checked a bf16 weight"))),
        Arg::I32(rows as i32),
        Arg::I32(w.rows as i32),
        Arg::I32(w.cols as i32),
        Arg::Epilogue(epi),
        Arg::I32(shape.stages as i32),
        Arg::MoeCombine(combine),
        Arg::Ptr(be.ptr(&norm.data)),
        Arg::F32(eps),
    ];
    let blocks_per_sm = shape.blocks_per_sm.min(sk.norm_blocks_per_sm[shape.variant]);
    let col_blocks = w.rows.div_ceil(8 * shape.nt).min(blocks_per_sm * be.sm_count);
    be.launch(kernel, (col_blocks as u32, 1, 1), STREAM_THREADS, shape.smem, &args);
}

/// The rows of `x` as a normalizing launch's input (no MoE sum).
fn plain_rows(be: &CudaBackend, x: &CudaTensor) -> MoeCombine {
    MoeCombine { resid: be.ptr(&x.data), y: 0, topk_w: 0, shared: 0, shared_gate: 0, resid_out: 0, shared_stride: 0, k: 0, slots: 0 }
}

/// Output tensors of `widths` for `rows` rows and the parts epilogue that writes them.
fn part_outputs(be: &CudaBackend, rows: usize, w: &CudaMatrix, widths: &[usize]) -> (Vec<CudaTensor>, Epilogue) {
    assert_eq!(widths.iter().sum::<usize>(), w.rows, "matmul_parts: widths {widths:?} do not add up to {} rows", w.rows);
    let outs: Vec<CudaTensor> = widths.iter().map(|&n| be.tensor(rows, n)).collect();
    let parts: Vec<(u64, usize)> = outs.iter().zip(widths).map(|(t, &n)| (be.ptr(&t.data), n)).collect();
    (outs, Epilogue::parts(&parts))
}

/// [`launch_normed`] into parts of `widths` (the MoE's sum first, per `combine`). Only where
/// [`normed_launch_fits`].
pub(super) fn matmul_parts_normed(be: &CudaBackend, combine: MoeCombine, rows: usize, norm: &CudaVector, eps: f32, w: &CudaMatrix, widths: &[usize]) -> Vec<CudaTensor> {
    let (outs, epi) = part_outputs(be, rows, w, widths);
    launch_normed(be, be.ptr(&outs[0].data), combine, rows, norm, eps, w, epi);
    outs
}

/// `rms_norm(x, norm) @ w^T` cut into parts, the norm in the matmul's launch where it can be.
pub(super) fn rms_norm_matmul_parts(be: &CudaBackend, x: &CudaTensor, norm: &CudaVector, eps: f32, w: &CudaMatrix, widths: &[usize]) -> Vec<CudaTensor> {
    assert_eq!(x.cols, w.cols, "rms_norm_matmul_parts: activation has {} columns, weight has {} inputs", x.cols, w.cols);
    if normed_launch_fits(be, x.rows, norm, w) {
        return matmul_parts_normed(be, plain_rows(be, x), x.rows, norm, eps, w, widths);
    }
    if w.dense().is_none() && norm_in_launches(be, x.rows, norm, w) {
        let (outs, epi) = part_outputs(be, x.rows, w, widths);
        launch_weights(be, be.ptr(&outs[0].data), x, w, epi, Some((norm, eps)));
        return outs;
    }
    matmul_parts(be, &crate::backend::Backend::rms_norm(be, x, norm, eps), w, widths)
}

/// `silu(h @ gate^T) * (h @ up^T)` for `h = rms_norm(x, norm)`, the norm in the matmul's launch
/// where it can be.
pub(super) fn rms_norm_matmul_swiglu(be: &CudaBackend, x: &CudaTensor, norm: &CudaVector, eps: f32, w: &CudaMatrix) -> CudaTensor {
    assert_eq!(x.cols, w.cols, "rms_norm_matmul_swiglu: activation has {} columns, weight has {} inputs", x.cols, w.cols);
    if matches!(w.store, WeightStorage::Tiles(_)) && swiglu_in_store(w) && norm_in_launches(be, x.rows, norm, w) {
        let out = be.tensor(x.rows, w.rows / 2);
        launch_weights(be, be.ptr(&out.data), x, w, Epilogue::SWIGLU, Some((norm, eps)));
        return out;
    }
    if !normed_launch_fits(be, x.rows, norm, w) {
        return matmul_swiglu(be, &crate::backend::Backend::rms_norm(be, x, norm, eps), w);
    }
    assert!(w.rows.is_multiple_of(2), "rms_norm_matmul_swiglu: {} rows is not gate over up", w.rows);
    let out = be.tensor(x.rows, w.rows / 2);
    launch_normed(be, be.ptr(&out.data), plain_rows(be, x), x.rows, norm, eps, w, Epilogue::SWIGLU);
    out
}

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
    /// Whether the routing was written two or more launches before this one, so that the
    /// small-row kernel may read it before waiting for its inputs and pull its experts' weights
    /// into L2 early (`prefetch_small` in cuda/matmul.cu).
    pub lists_ready: bool,
}

/// Bytes of dynamic shared memory of the pipelined kernel (3 stages of A and W tiles of 128
/// rows x 32 bf16).
pub(super) const PIPELINED_SMEM: usize = 3 * 2 * 128 * 64;
/// Bytes of dynamic shared memory of the large-tile kernel (cuda/matmul_tiles.cu): 4 stages of
/// 128 activation and 256 weight rows of 32 bf16, then the 128 x 256 f32 slice sums.
pub(crate) const LARGE_SMEM: usize = 4 * (128 + 256) * 64 + 128 * 256 * 4;
/// Bytes of dynamic shared memory of the k-sliced kernel: 4 stages of 64 activation and 128
/// weight rows of 32 bf16, then the slice sums of its 8 rows ([8][8][136] f32).
pub(crate) const SLICED_SMEM: usize = 4 * (64 + 128) * 64 + 8 * 8 * 136 * 4;
/// Most rows a k-sliced launch takes (two 64-row tiles).
const SLICED_MAX_ROWS: usize = 128;

/// Rows past which a bf16 launch takes the large-tile kernel: a 128 x 256 tile over fewer rows
/// leaves too few blocks for the GPU (the 128 x 128 pipelined kernel runs them).
pub(super) const LARGE_MIN_ROWS: usize = 128;

/// `out[rows, n] = x[x_rows, k] @ W^T`. Plain launches read rows `0..rows` of `x`; grouped
/// launches read the rows listed per group (at most `rows` per group).
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_matmul(be: &CudaBackend, out: u64, x: u64, x_rows: usize, whi: u64, wlo: u64, rows: usize, n: usize, k: usize, grouped: Option<&Grouped>, epi: Epilogue) {
    if rows == 0 || n == 0 {
        return;
    }
    let (table, counts, lists, stride, a_div, active, groups, has_lo, lists_ready) = match grouped {
        Some(g) => (g.table, g.counts, g.lists, g.list_stride, g.a_div, g.active, g.groups, g.has_lo, g.lists_ready),
        None => (0, 0, 0, 0, 1, 0, 1, wlo != 0, false),
    };
    let tail = [Arg::I32(rows as i32), Arg::I32(n as i32), Arg::I32(k as i32), Arg::Ptr(table), Arg::Ptr(counts), Arg::Ptr(lists), Arg::I32(stride as i32), Arg::I32(a_div as i32), Arg::Ptr(active)];
    // Past one m tile, a wide output gives the pipelined kernel enough 128-column blocks to
    // fill the GPU, and it splits the activations once instead of in every column block: on
    // the H100 it takes 1x12288 -> 64 rows from 0.28 to 0.14 ms and the 248320-wide lm_head
    // from 5.4 to 2.0 ms, while at 4096 columns (32 blocks) the small-row kernel stays faster
    // (examples/cuda_bench.rs times both).
    let wide = n.div_ceil(128) * 2 >= be.sm_count;
    let bf16_blocks = pipelined_fits(be, has_lo, k);
    // Multi-tile small-row kernels read pre-split activations, so they take what the pipelined
    // kernel takes (bf16 weights, whole 32-wide k blocks); other weights past 16 rows go tiled.
    let small = rows <= 16 || (rows <= SMALL_MAX_ROWS && bf16_blocks && !wide);
    if rows <= 16 && !has_lo {
        if let Some((kernel, shape)) = stream_plan(be, rows, k, grouped.is_some()) {
            let mut args = vec![Arg::Ptr(out), Arg::Ptr(x), Arg::Ptr(whi), Arg::Ptr(wlo)];
            args.extend(tail);
            args.push(Arg::I64((x_rows * k) as i64));
            args.push(Arg::Epilogue(epi));
            args.push(Arg::I32(i32::from(lists_ready)));
            args.push(Arg::I32(shape.stages as i32));
            let slots = shape.blocks_per_sm * be.sm_count;
            let wave = if grouped.is_some() { (slots / groups).max(GROUP_MIN_COL_BLOCKS) } else { slots };
            let col_blocks = n.div_ceil(8 * shape.nt).min(wave);
            be.launch(kernel, (col_blocks as u32, 1, groups as u32), STREAM_THREADS, shape.smem, &args);
            return;
        }
    }
    // 17 to 128 rows of a plain bf16 launch on Hopper: one k-slice per block, the slices of a
    // tile summed across a cluster of 8 (cuda/matmul_tiles.cu). Each weight column block is
    // read once and the activations once per 128 columns, where the small-row kernels re-read
    // the activations for every 16 columns.
    if be.sliced_matmul && grouped.is_none() && !has_lo && k.is_multiple_of(32) && rows > 16 && rows <= SLICED_MAX_ROWS {
        let rounded = round_activations(be, x, x_rows * k);
        let args = [Arg::Ptr(out), Arg::Ptr(be.ptr(&rounded)), Arg::Ptr(whi), Arg::I32(rows as i32), Arg::I32(n as i32), Arg::I32(k as i32), Arg::Epilogue(epi)];
        be.launch_in_clusters(&be.k.matmul_sliced, ((n.div_ceil(128) * 8) as u32, rows.div_ceil(64) as u32, 1), 256, SLICED_SMEM, 8, &args);
        return;
    }
    if small {
        let index = small_variant(rows, n, k, grouped.is_some());
        let v = &SMALL_VARIANTS[index];
        // Activations rounded to bf16 once for all column blocks (multi-tile kernels).
        let rounded = (v.mt > 1).then(|| round_activations(be, x, x_rows * k));
        let xs = rounded.as_ref().map_or(x, |s| be.ptr(s));
        let mut args = vec![Arg::Ptr(out), Arg::Ptr(xs), Arg::Ptr(whi), Arg::Ptr(wlo)];
        args.extend(tail);
        args.push(Arg::I64((x_rows * k) as i64));
        args.push(Arg::Epilogue(epi));
        args.push(Arg::I32(i32::from(lists_ready)));
        // One wave of resident blocks; more column blocks are walked by the grid-stride loop.
        // A grouped launch shares the wave among its groups (at least GROUP_MIN_COL_BLOCKS
        // each): a block walking several column blocks of its expert starts up (looks its group
        // up, finds its rows) once. On the H100, 35B-A3B's expert matmuls at one token took
        // 2.19 -> 1.75 ms per step, and at 32 tokens 31.7 -> 28.8 ms.
        let slots = be.small_matmul_slots[index];
        let wave = if grouped.is_some() { (slots / groups).max(GROUP_MIN_COL_BLOCKS) } else { slots };
        let col_blocks = n.div_ceil(8 * v.nt).min(wave);
        be.launch((v.kernel)(&be.k), (col_blocks as u32, rows.div_ceil(16 * v.mt) as u32, groups as u32), SMALL_THREADS, 0, &args);
    } else if bf16_blocks {
        // Past one m tile of a plain launch on sm_90: the wgmma kernel (the same bits).
        if grouped.is_none() && rows > LARGE_MIN_ROWS && super::wgmma::try_launch(be, out, x, rows, whi, n, k, epi) {
            return;
        }
        // Round the activations to bf16 once, then stream bf16 tiles with cp.async.
        let rounded = round_activations(be, x, x_rows * k);
        let mut args = vec![Arg::Ptr(out), Arg::Ptr(be.ptr(&rounded)), Arg::Ptr(whi)];
        args.extend(tail);
        args.push(Arg::Epilogue(epi));
        if be.large_matmul && rows > LARGE_MIN_ROWS {
            be.launch(&be.k.matmul_large, (n.div_ceil(256) as u32, rows.div_ceil(128) as u32, groups as u32), 256, LARGE_SMEM, &args);
        } else {
            be.launch(&be.k.matmul_pipelined, (n.div_ceil(128) as u32, rows.div_ceil(128) as u32, groups as u32), 256, PIPELINED_SMEM, &args);
        }
    } else {
        let mut args = vec![Arg::Ptr(out), Arg::Ptr(x), Arg::Ptr(whi), Arg::Ptr(wlo)];
        args.extend(tail);
        args.push(Arg::Epilogue(epi));
        be.launch(&be.k.matmul_tiled, (n.div_ceil(64) as u32, rows.div_ceil(64) as u32, groups as u32), 128, 0, &args);
    }
}

/// Threads of the streaming kernels: the k-slice warps and the producer warp.
pub(super) const STREAM_THREADS: u32 = 288;
/// Most stages of a streaming kernel's ring (STREAM_MAX_STAGES in cuda/matmul_stream.cu).
pub(super) const STREAM_MAX_STAGES: usize = 8;
/// Shared memory a plain streaming launch's ring aims for ([`StreamKernels::ring_bytes`]).
pub(super) const RING_BYTES: usize = 96 * 1024;
/// The same for grouped launches ([`StreamKernels::grouped_ring_bytes`]).
pub(super) const GROUPED_RING_BYTES: usize = 32 * 1024;

/// The streaming kernels (`matmul_stream_nt*`, cuda/matmul_stream.cu) as the backend found them:
/// how much shared memory each may take and how many blocks fit per SM without it.
pub(super) struct StreamKernels {
    /// Shared memory of the ring a launch aims for (bytes): two blocks of 96 KB share an
    /// SM's 228 KB. `KESTREL_CUDA_STREAM_RING` overrides it for experiments.
    pub ring_bytes: usize,
    /// The same for grouped launches: [`GROUPED_RING_BYTES`] (`KESTREL_CUDA_GROUPED_RING`
    /// overrides it). The experts' down projection then keeps three stages of 8.5 KB, and a
    /// block of it fits on an SM beside two blocks of the gate/up launch before it, so that all
    /// its blocks are resident and copying while the gate/up streams; with the plain ring it had
    /// eight stages and waited for the gate/up's blocks to leave. The gate/up launch keeps its
    /// two stages either way. On the H100, 35B-A3B decode: 3.73, 3.73, 3.72 ms per step against
    /// 3.79, 3.78, 3.78 (40 KB 3.74-3.76, 48 KB 3.74-3.76, 24 KB 3.77-3.78).
    pub grouped_ring_bytes: usize,
    /// Per variant (n tiles 1, 2, 4): static shared memory, resident blocks per SM without
    /// dynamic shared memory, most dynamic shared memory.
    pub static_smem: [usize; 3],
    pub blocks_per_sm: [usize; 3],
    /// Resident blocks per SM of the normalizing twins (`matmul_stream_norm_*`,
    /// `matmul_stream_combine_*`) without dynamic shared memory.
    pub norm_blocks_per_sm: [usize; 3],
    /// Whether input norms (and MoE combine passes) run inside the next matmul's launch
    /// ([`launch_normed`]; `KESTREL_CUDA_STREAM_NORM=0` turns it off for A/B runs).
    pub norm_in_matmul: bool,
    pub max_dynamic: [usize; 3],
    pub smem_per_sm: usize,
    /// Most dynamic shared memory of the one-token fused down projection (`moe_down_combine`;
    /// 0: off, the grouped launch and the combine pass, `KESTREL_CUDA_FUSED_DOWN=0` for A/B runs).
    pub fused_down_max_dynamic: usize,
    /// Blocks per cluster of `moe_route_gate_up` (0: off, the router launch and the grouped
    /// gate/up launch; `KESTREL_CUDA_ROUTE_GATE_UP=0`, `8` or `16` for A/B runs) and its most
    /// dynamic shared memory.
    pub route_gate_up_cluster: usize,
    pub route_gate_up_max_dynamic: usize,
    /// Narrowest variant a launch takes (0: by K alone; `KESTREL_CUDA_STREAM_NT=2` or `4` for
    /// experiments with wider column blocks).
    pub min_variant: usize,
}

/// One streaming launch's shape.
#[derive(Debug, PartialEq)]
pub(super) struct StreamShape {
    /// Index of the variant (n tiles 1, 2, 4).
    variant: usize,
    nt: usize,
    stages: usize,
    /// Dynamic shared memory (bytes).
    pub smem: usize,
    blocks_per_sm: usize,
}

impl StreamShape {
    /// The shape with room for a normalizing launch's norm weight (`k` f32 after the split
    /// rows, which stream_start copies before the inputs are ready), or None where that no
    /// longer fits.
    fn with_norm_weight(mut self, sk: &StreamKernels, k: usize) -> Option<Self> {
        self.smem += 4 * k;
        self.blocks_per_sm = self.blocks_per_sm.min(sk.smem_per_sm / (self.smem + sk.static_smem[self.variant] + 1024)).max(1);
        (self.smem <= sk.max_dynamic[self.variant]).then_some(self)
    }
}

impl StreamKernels {
    /// The streaming launch for `rows` (at most 16) rows and `k` inputs (bf16 weights), or None
    /// where it does not apply: K not in whole 32-wide blocks, or two stages of weight rows and
    /// the split activations do not fit in shared memory.
    pub(super) fn shape(&self, rows: usize, k: usize, grouped: bool) -> Option<StreamShape> {
        // A stage of about 8K weight columns' worth of bytes (32 KB at K = 2048): four n tiles
        // at K <= 512, two at K <= 1024. Grouped launches take one n tile whatever K is: a
        // group's few blocks (a wave shared by all groups) walk its column blocks, and the
        // narrowest column blocks share them out most evenly (35B-A3B's expert down projection,
        // 64 column blocks of 32 over 29 blocks, took 3 rounds for an average of 2.2; with
        // 256 of 8, 9 rounds for 8.8: 3.86-3.89 -> 3.81 ms per step on the H100).
        let by_k = if grouped { 0 } else if k <= 512 { 2 } else if k <= 1024 { 1 } else { 0 };
        let variant = by_k.max(self.min_variant);
        let ring = if grouped { self.grouped_ring_bytes } else { self.ring_bytes };
        self.shape_of_variant(rows, k, variant, ring)
    }

    /// [`Self::shape`] with `variant`'s n tiles whatever K is, its ring aiming for `ring_bytes`.
    fn shape_of_variant(&self, rows: usize, k: usize, variant: usize, ring_bytes: usize) -> Option<StreamShape> {
        if !k.is_multiple_of(32) || rows == 0 || rows > 16 {
            return None;
        }
        let nt = 1 << variant;
        // Rows padded by 64 bytes where 2K is a multiple of 128, as stream_start pads them with
        // STREAM_ROW_PAD=1 (unpadded rows, the default, take less).
        let row_bytes = 2 * k + if (2 * k).is_multiple_of(128) { 64 } else { 0 };
        let stage = 8 * nt * row_bytes;
        // The activation rows as bf16, padded like the weight rows. The kernels write only the
        // first `rows` rows; the area still holds two per activation row, the room of the
        // former hi/lo split (halving it changes every stage count this shape plans).
        let x_bytes = 2 * rows * row_bytes;
        let stages = (ring_bytes.saturating_sub(x_bytes) / stage).clamp(2, STREAM_MAX_STAGES);
        let smem = stages * stage + x_bytes;
        if smem > self.max_dynamic[variant] {
            return None;
        }
        // The driver reserves 1 KB of shared memory per block.
        let by_smem = self.smem_per_sm / (smem + self.static_smem[variant] + 1024);
        Some(StreamShape { variant, nt, stages, smem, blocks_per_sm: self.blocks_per_sm[variant].min(by_smem).max(1) })
    }
}

/// The streaming kernel and its launch shape for `rows` rows over `k` inputs, where the backend
/// has the streaming kernels (sm_90 and later, not turned off) and the shape fits.
fn stream_plan(be: &CudaBackend, rows: usize, k: usize, grouped: bool) -> Option<(&CudaFunction, StreamShape)> {
    let shape = be.stream_kernels.as_ref()?.shape(rows, k, grouped)?;
    Some(([&be.k.matmul_stream_nt1, &be.k.matmul_stream_nt2, &be.k.matmul_stream_nt4][shape.variant], shape))
}

/// `x` (`elems` f32, a multiple of 8) rounded to bf16 (the values every matmul kernel feeds
/// its mmas).
fn round_activations(be: &CudaBackend, x: u64, elems: usize) -> cudarc::driver::CudaSlice<u16> {
    // SAFETY: fully written by round_activations before any matmul reads it.
    let rounded = ck(be.host_timer.time(true, || unsafe { be.stream.alloc::<u16>(elems) }), "alloc");
    be.launch(&be.k.round_activations, ((elems / 8).div_ceil(256) as u32, 1, 1), 256, 0, &[Arg::Ptr(be.ptr(&rounded)), Arg::Ptr(x), Arg::I64((elems / 8) as i64)]);
    rounded
}

/// Whether the pipelined kernel takes this weight: bf16 only, K in whole 32-wide blocks.
fn pipelined_fits(be: &CudaBackend, has_lo: bool, k: usize) -> bool {
    !has_lo && k.is_multiple_of(32) && PIPELINED_SMEM <= be.max_dynamic_smem
}

/// `x @ w^T` with the products stored by `epi` at `out`.
fn launch_plain(be: &CudaBackend, out: u64, x: &CudaTensor, w: &CudaMatrix, epi: Epilogue) {
    launch_weights(be, out, x, w, epi, None);
}

/// `x @ w^T`, or with `norm` `rms_norm(x, norm) @ w^T` with the norm inside each launch (only
/// where [`norm_in_launches`]), stored by `epi` at `out`; a stacked weight takes a launch per
/// part.
fn launch_weights(be: &CudaBackend, out: u64, x: &CudaTensor, w: &CudaMatrix, epi: Epilogue, norm: Option<(&CudaVector, f32)>) {
    assert_eq!(x.cols, w.cols, "matmul: activation has {} columns, weight has {} inputs", x.cols, w.cols);
    match (&w.store, norm) {
        (WeightStorage::Dense { .. }, Some((n, eps))) => launch_normed(be, out, plain_rows(be, x), x.rows, n, eps, w, epi),
        (WeightStorage::Dense { hi, lo }, None) => {
            let wlo = lo.as_ref().map_or(0, |l| be.ptr(l));
            launch_matmul(be, out, be.ptr(&x.data), x.rows, be.ptr(hi), wlo, x.rows, w.rows, w.cols, None, epi)
        }
        (WeightStorage::Tiles(t), _) => super::qmatmul::launch_tiles(be, out, be.ptr(&x.data), x.rows, t, x.rows, w.rows, w.cols, None, epi, norm.map(|(n, eps)| (be.ptr(&n.data), eps))),
        (WeightStorage::Stacked(parts), _) => {
            for p in parts {
                let part_epi = epi.restrict(p.row0, p.matrix.rows).unwrap_or_else(|| panic!("matmul: a weight stacked from differently stored parts ({}) is only cut along its parts", w.storage_name()));
                launch_weights(be, out, x, &p.matrix, part_epi, norm);
            }
        }
    }
}

/// Whether every launch of `rows` rows through `w` can apply the norm itself: bf16 parts in the
/// streaming normalizing kernels, tiles in the few-row kernel that splits its rows.
fn norm_in_launches(be: &CudaBackend, rows: usize, norm: &CudaVector, w: &CudaMatrix) -> bool {
    match &w.store {
        WeightStorage::Dense { .. } => normed_launch_fits(be, rows, norm, w),
        WeightStorage::Tiles(_) => be.norm_in_registers(norm, w.cols) && super::qmatmul::norm_fits(rows, w.cols),
        WeightStorage::Stacked(parts) => parts.iter().all(|p| norm_in_launches(be, rows, norm, &p.matrix)),
    }
}

/// Whether the SwiGLU store can take `w` in one launch: bf16 gate over up, or gate/up tiles.
fn swiglu_in_store(w: &CudaMatrix) -> bool {
    match &w.store {
        WeightStorage::Dense { .. } => true,
        WeightStorage::Tiles(t) => matches!(t.order, super::quant_tiles::RowOrder::GateUp { .. }),
        WeightStorage::Stacked(_) => false,
    }
}

pub(super) fn matmul(be: &CudaBackend, x: &CudaTensor, w: &CudaMatrix) -> CudaTensor {
    let out = be.tensor(x.rows, w.rows);
    launch_plain(be, be.ptr(&out.data), x, w, Epilogue::STORE);
    out
}

/// `acc += x @ w^T` in the matmul's store.
pub(super) fn matmul_add(be: &CudaBackend, acc: &mut CudaTensor, x: &CudaTensor, w: &CudaMatrix) {
    assert_eq!((acc.rows, acc.cols), (x.rows, w.rows), "matmul_add: accumulator shape");
    launch_plain(be, be.ptr(&acc.data), x, w, Epilogue::ADD);
}

/// `x @ w^T` cut into column parts of `widths`, each written to its own tensor by the store.
pub(super) fn matmul_parts(be: &CudaBackend, x: &CudaTensor, w: &CudaMatrix, widths: &[usize]) -> Vec<CudaTensor> {
    let (outs, epi) = part_outputs(be, x.rows, w, widths);
    launch_plain(be, be.ptr(&outs[0].data), x, w, epi);
    outs
}

/// `silu(x @ gate^T) * (x @ up^T)` for gate stacked over up, in the matmul's store (or, for a
/// weight whose gate and up are stored apart, the two parts and silu_mul).
pub(super) fn matmul_swiglu(be: &CudaBackend, x: &CudaTensor, w: &CudaMatrix) -> CudaTensor {
    assert!(w.rows.is_multiple_of(2), "matmul_swiglu: {} rows is not gate over up", w.rows);
    if !swiglu_in_store(w) {
        let mut parts = matmul_parts(be, x, w, &[w.rows / 2, w.rows / 2]).into_iter();
        let (gate, up) = (parts.next().expect("two parts"), parts.next().expect("two parts"));
        return super::ops::silu_mul(be, &gate, &up);
    }
    let out = be.tensor(x.rows, w.rows / 2);
    launch_plain(be, be.ptr(&out.data), x, w, Epilogue::SWIGLU);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_shapes_fit_shared_memory_or_fall_back() {
        // An H100: 227 KB per block at most, 228 KB per SM.
        let sk = StreamKernels { ring_bytes: RING_BYTES, grouped_ring_bytes: GROUPED_RING_BYTES, static_smem: [4096, 8192, 16384], blocks_per_sm: [3, 3, 1], norm_blocks_per_sm: [2, 2, 1], norm_in_matmul: true, max_dynamic: [227 * 1024 - 4096, 227 * 1024 - 8192, 227 * 1024 - 16384], smem_per_sm: 228 * 1024, fused_down_max_dynamic: 227 * 1024 - 4608, route_gate_up_cluster: 0, route_gate_up_max_dynamic: 0, min_variant: 0 };
        // A decode step's expert gate/up (K = 2048): one n tile, rows of 4096 + 64 bytes, two
        // stages beside the split activation row; two blocks per SM.
        let s = sk.shape(1, 2048, true).expect("K = 2048 streams");
        assert_eq!((s.variant, s.nt, s.stages), (0, 1, 2));
        assert_eq!(s.smem, 2 * 8 * 4160 + 2 * 4160);
        assert_eq!(s.blocks_per_sm, 2);
        // Plain launches at K = 512: four n tiles; K = 1024: two.
        assert_eq!(sk.shape(1, 512, false).map(|s| (s.nt, s.stages)), Some((4, 2)));
        assert_eq!(sk.shape(4, 1024, false).map(|s| s.nt), Some(2));
        // Grouped launches (the experts' down projections, K = 512) take one n tile at any K,
        // with the grouped ring's stages: three of 8 rows of 1024 + 64 bytes, so that a block
        // fits on an SM beside two of the gate/up launch's.
        let down = sk.shape(1, 512, true).expect("K = 512 streams");
        assert_eq!((down.nt, down.stages), (1, 3));
        assert!(2 * (s.smem + sk.static_smem[0] + 1024) + down.smem + sk.static_smem[0] + 1024 <= sk.smem_per_sm);
        // A normalizing launch keeps its norm weight after the split rows: 8 KB more at
        // K = 2048, still two blocks per SM; where that no longer fits, no normalizing launch.
        let normed = sk.shape(1, 2048, false).and_then(|p| p.with_norm_weight(&sk, 2048)).expect("fits");
        assert_eq!((normed.smem, normed.blocks_per_sm), (sk.shape(1, 2048, false).map_or(0, |p| p.smem) + 8192, 2));
        let wide = sk.shape(1, 4096, false).expect("K = 4096 streams");
        assert_eq!(StreamShape { smem: sk.max_dynamic[wide.variant] - 4 * 4096 + 16, ..wide }.with_norm_weight(&sk, 4096), None);
        // With the plain ring the same shape fills all the stages the kernel has barriers for.
        assert_eq!(sk.shape_of_variant(1, 512, 0, sk.ring_bytes).map(|s| s.stages), Some(STREAM_MAX_STAGES));
        // A short K fills the ring with more stages, up to the most the kernel has barriers for.
        assert_eq!(sk.shape(1, 32, false).map(|s| s.stages), Some(STREAM_MAX_STAGES));
        // 2K not a multiple of 128: no padding.
        assert_eq!(sk.shape(1, 96, false).map(|s| s.smem % (2 * 96)), Some(0));
        // Shapes that do not fit or do not apply fall back to the small-row kernels.
        assert_eq!(sk.shape(1, 12288, false), None, "two stages of 8 rows of K = 12288 exceed shared memory");
        assert_eq!(sk.shape(16, 4096, false), None, "16 split activation rows of K = 4096 beside the ring");
        assert_eq!(sk.shape(1, 100, false), None, "K not in whole 32-wide blocks");
        assert_eq!(sk.shape(17, 512, false), None, "one m tile only");
    }

    #[test]
    fn small_variants_cover_their_rows_with_one_pass_over_the_weights() {
        for rows in 1..=SMALL_MAX_ROWS {
            for n in [1, 8, 257, 1023, 1024, 2048, 2049, 8192, 8193, 248_320] {
                for (k, grouped) in [(32, false), (32, true), (512, true), (544, true), (4096, false)] {
                    let v = &SMALL_VARIANTS[small_variant(rows, n, k, grouped)];
                    assert_eq!(rows.div_ceil(16 * v.mt), 1, "rows {rows}: one block row streams the weights once");
                    assert!(16 * v.mt < 2 * rows.max(16), "rows {rows}: at most twice the m tiles needed");
                    // Narrow outputs keep one n tile (enough column blocks to fill the GPU); a
                    // short K at one m tile takes four.
                    let widest = if v.mt == 1 && grouped && k <= SHORT_K {
                        4
                    } else if n < 1024 || (v.mt == 1 && n <= 2048) {
                        1
                    } else {
                        2
                    };
                    assert_eq!(v.nt, widest, "rows {rows}, {n} columns, {k} inputs, grouped {grouped}");
                }
            }
        }
    }
}
