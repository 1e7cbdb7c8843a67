//! Mixture of experts on the device: routing, per-expert row lists in token order, grouped
//! expert matmuls (one launch per projection for all experts), and the weighted sum.

use super::matmul::{launch_matmul, Epilogue, Grouped};
use super::tensor::{QuantTiles, WeightStorage};
use super::{ck, Arg, CudaBackend, CudaMatrix, CudaTensor, CudaVector, ExpertTables};
use crate::backend::MoeWeights;
use crate::backend::shapes::MoeShape;
use std::sync::Arc;

/// Up to this many (token, slot) entries, one block builds the expert lists (fewer launches
/// for decode steps); the lists are the same either way.
const FEW_ENTRIES: usize = 256;
/// Up to this many tokens (a warp each), that block also routes them instead of a separate
/// routing launch: one launch fewer for decode steps.
const ROUTE_IN_GROUP_MAX_TOKENS: usize = 8;
/// Tokens the routing kernel routes per block of 256 threads (a warp each).
const ROUTE_WARPS: usize = 8;
/// Most experts per token the routing kernel keeps.
const MAX_TOP_K: usize = 64;
/// Most experts the routing kernel handles (ROUTE_MAX_PER_LANE = 16 per lane of a warp).
const MAX_EXPERTS: usize = 512;

/// Whether the shared expert runs as one more group of the grouped expert launches (group E,
/// slot k of every token): it must have the experts' shapes. Two launches fewer per layer.
fn shared_in_groups(w: &MoeWeights<CudaBackend>, inter: usize) -> bool {
    let alike = |a: &CudaMatrix, b: &CudaMatrix| match (&a.store, &b.store) {
        (WeightStorage::Dense { .. }, WeightStorage::Dense { .. }) => true,
        (WeightStorage::Tiles(x), WeightStorage::Tiles(y)) => (x.fmt, x.order) == (y.fmt, y.order),
        _ => false,
    };
    w.shared.as_ref().is_some_and(|[gu, d]| (gu.rows, d.cols) == (2 * inter, inter) && w.experts.first().is_some_and(|[egu, ed]| alike(gu, egu) && alike(d, ed)))
}

fn tiles_of(m: &CudaMatrix) -> Option<&QuantTiles> {
    match &m.store {
        WeightStorage::Tiles(t) => Some(t),
        _ => None,
    }
}

/// Device tables of expert weight pointers (the shared expert last when it runs with them),
/// built on first use and kept on the router weight (which belongs to exactly this block and
/// lives as long as its experts).
fn expert_tables(be: &CudaBackend, w: &MoeWeights<CudaBackend>, with_shared: bool) -> ExpertTables {
    w.router
        .expert_tables
        .get_or_init(|| {
            let table = |which: usize| {
                let shared = w.shared.iter().filter(|_| with_shared);
                let ptrs: Vec<u64> = w
                    .experts
                    .iter()
                    .chain(shared)
                    .flat_map(|m| match &m[which].store {
                        WeightStorage::Dense { hi, lo } => [be.ptr(hi), lo.as_ref().map_or(0, |l| be.ptr(l))],
                        WeightStorage::Tiles(t) => [be.ptr(&t.data), 0],
                        WeightStorage::Stacked(_) => panic!("moe: an expert stacked from differently stored parts ({})", m[which].storage_name()),
                    })
                    .collect();
                ck(be.stream.clone_htod(&ptrs), "expert table upload")
            };
            Arc::new([table(0), table(1)])
        })
        .clone()
}

pub(super) fn moe_add(be: &CudaBackend, acc: &mut CudaTensor, x: &CudaTensor, w: &MoeWeights<CudaBackend>, cfg: &MoeShape) {
    if let MoeOutput::Pending(pending) = moe_experts(be, acc, MoeInput::Normed(x), w, cfg, L2Ahead::default()) {
        pending.add(be, acc);
    }
}

/// `acc += moe(rms_norm(acc, pre_norm))`, then the RMSNorm of the updated residual stream by
/// `next_norm`: the input norm inside the streaming router launch and the output norm in the
/// combine pass, where the row norm's register path applies (two launches fewer per layer).
pub(super) fn moe_residual(be: &CudaBackend, acc: &mut CudaTensor, pre_norm: &CudaVector, w: &MoeWeights<CudaBackend>, cfg: &MoeShape, next_norm: &CudaVector, eps: f32) -> CudaTensor {
    match moe_experts(be, acc, MoeInput::Residual(pre_norm, eps), w, cfg, L2Ahead::default()) {
        MoeOutput::Added => crate::backend::Backend::rms_norm(be, acc, next_norm, eps),
        MoeOutput::Pending(pending) => pending.add_norm(be, acc, next_norm, eps),
    }
}

/// [`moe_residual`], then the normalized rows through `proj` cut into `widths`: where the
/// streaming matmul takes the shape, the projection's launch does the combine pass and the norm
/// itself (one launch fewer per layer) and the normalized rows are never stored.
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_residual_project(
    be: &CudaBackend,
    acc: &mut CudaTensor,
    pre_norm: &CudaVector,
    w: &MoeWeights<CudaBackend>,
    cfg: &MoeShape,
    next_norm: &CudaVector,
    eps: f32,
    proj: &CudaMatrix,
    widths: &[usize],
) -> Vec<CudaTensor> {
    let pending = match moe_experts(be, acc, MoeInput::Residual(pre_norm, eps), w, cfg, L2Ahead::projection_tail(be, proj)) {
        MoeOutput::Added => return super::matmul::rms_norm_matmul_parts(be, acc, next_norm, eps, proj, widths),
        MoeOutput::Pending(pending) => pending,
    };
    if super::matmul::normed_launch_fits(be, acc.rows, next_norm, proj) {
        // The updated residual rows go to a new tensor: every block of the launch reads the
        // rows before the MoE, so none of them may be overwritten.
        let resid_out = be.tensor(acc.rows, acc.cols);
        let combine = pending.device_args(be, acc, &resid_out);
        let parts = super::matmul::matmul_parts_normed(be, combine, acc.rows, next_norm, eps, proj, widths);
        *acc = resid_out;
        return parts;
    }
    let normed = pending.add_norm(be, acc, next_norm, eps);
    super::matmul::matmul_parts(be, &normed, proj, widths)
}

/// The shared expert's weights, which the streaming router pulls into L2 while its chain runs
/// (`struct L2Ahead` in cuda/matmul_stream.cu, passed by value; zero bytes: none).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct L2Ahead {
    ptr: [u64; 2],
    bytes: [i64; 2],
}

// SAFETY: a plain `repr(C)` struct of integers with the layout of the kernel's `struct L2Ahead`.
unsafe impl cudarc::driver::DeviceRepr for L2Ahead {}

impl L2Ahead {
    /// The shared expert's gate/up and down weights (bf16 halves), where the block has one and
    /// the prefetch is on (`KESTREL_CUDA_L2_AHEAD=0` turns it off for A/B runs).
    fn shared_expert(be: &CudaBackend, w: &MoeWeights<CudaBackend>) -> Self {
        match w.shared.as_ref().filter(|_| be.l2_ahead) {
            Some([gu, d]) => match (gu.bf16(), d.bf16()) {
                (Some(gu), Some(d)) => L2Ahead { ptr: [be.ptr(gu), be.ptr(d)], bytes: [gu.len() as i64, d.len() as i64] },
                _ => L2Ahead::default(),
            },
            None => L2Ahead::default(),
        }
    }

    /// The last `be.l2_tail_bytes` of the next layer's input projection (bf16 half), which
    /// `moe_route_gate_up` pulls into L2 at the start of its routing window. The projection's
    /// launch copies its first column blocks into shared memory while the MoE's down
    /// projection runs and streams the rest after its wait: that rest is its last rows.
    fn projection_tail(be: &CudaBackend, proj: &CudaMatrix) -> Self {
        let Some(hi) = proj.bf16() else { return L2Ahead::default() };
        match tail_range(hi.len(), be.l2_tail_bytes) {
            Some((offset, bytes)) => L2Ahead { ptr: [be.ptr(hi) + offset as u64, 0], bytes: [bytes as i64, 0] },
            None => L2Ahead::default(),
        }
    }
}

/// Default of [`CudaBackend::l2_tail_bytes`]. 35B-A3B decode on the H100 (per step, three runs
/// each, alternated): 0 MiB 3.306-3.330 ms, 20 MiB 3.239-3.272, 28 MiB 3.261-3.265, 36 MiB
/// 3.334-3.369 (past about 20 MiB the prefetches still run when the routed experts' copies
/// start, and hold them back).
pub(super) const PROJECTION_TAIL_BYTES: usize = 20 << 20;

/// (offset, bytes) of the last `want` bytes of a `len`-byte matrix in whole 16-byte pieces
/// (the bulk prefetch's unit; the matrix starts 16-byte aligned), None where that is nothing.
fn tail_range(len: usize, want: usize) -> Option<(usize, usize)> {
    let bytes = want.min(len) & !15;
    (bytes > 0).then(|| ((len - bytes) & !15, bytes))
}

/// The MoE's input rows: already normalized, or the residual stream (the accumulator itself)
/// still to be normalized by this weight.
#[derive(Clone, Copy)]
enum MoeInput<'a> {
    Normed(&'a CudaTensor),
    Residual(&'a CudaVector, f32),
}

/// What the experts' launches leave: the MoE's sum already added into the residual rows (a
/// one-token step's down projection does it in its store, `moe_down_combine`), or the rows
/// waiting for the combine pass.
enum MoeOutput {
    Added,
    Pending(PendingCombine),
}

/// The MoE's rows, routed and through the experts, waiting for their weighted sum into the
/// residual stream: the tensors the combine pass reads (kept alive until it is enqueued) and
/// its scalars.
struct PendingCombine {
    y: CudaTensor,
    /// Routing words; the top-k weights sit at `topk_w`.
    _routing: cudarc::driver::CudaSlice<i32>,
    topk_w: u64,
    /// The shared expert's rows where it ran on its own, and its gate.
    _separate: Option<CudaTensor>,
    _shared_gate: Option<CudaTensor>,
    shared: u64,
    gate: u64,
    shared_stride: usize,
    k: usize,
    slots: usize,
}

impl PendingCombine {
    /// moe_combine's and moe_combine_norm's arguments, from the output row pointer on.
    fn args(&self, acc: &CudaTensor, be: &CudaBackend) -> Vec<Arg> {
        vec![
            Arg::Ptr(be.ptr(&acc.data)),
            Arg::Ptr(be.ptr(&self.y.data)),
            Arg::Ptr(self.topk_w),
            Arg::Ptr(self.shared),
            Arg::Ptr(self.gate),
            Arg::I32(acc.rows as i32),
            Arg::I32(acc.cols as i32),
            Arg::I32(self.k as i32),
            Arg::I32(self.slots as i32),
            Arg::I64(self.shared_stride as i64),
        ]
    }

    /// `acc += the MoE output`.
    fn add(self, be: &CudaBackend, acc: &mut CudaTensor) {
        be.launch(&be.k.moe_combine, ((acc.rows * acc.cols).div_ceil(256) as u32, 1, 1), 256, 0, &self.args(acc, be));
    }

    /// `acc += the MoE output`, then the updated rows normalized by `norm`: in the combine pass
    /// where the row norm's register path applies (16-byte aligned rows and weight), else by
    /// the row norm after it.
    fn add_norm(self, be: &CudaBackend, acc: &mut CudaTensor, norm: &CudaVector, eps: f32) -> CudaTensor {
        if !be.norm_in_registers(norm, acc.cols) {
            self.add(be, acc);
            return crate::backend::Backend::rms_norm(be, acc, norm, eps);
        }
        let normed = be.tensor(acc.rows, acc.cols);
        let mut args = self.args(acc, be);
        args.extend([Arg::Ptr(be.ptr(&normed.data)), Arg::Ptr(be.ptr(&norm.data)), Arg::F32(eps)]);
        be.launch(&be.k.moe_combine_norm, (acc.rows as u32, 1, 1), 256, 0, &args);
        normed
    }

    /// The combine pass's inputs for a streaming launch that starts from them: the rows of
    /// `acc` plus the MoE output, written to `resid_out`.
    fn device_args(&self, be: &CudaBackend, acc: &CudaTensor, resid_out: &CudaTensor) -> super::matmul::MoeCombine {
        super::matmul::MoeCombine {
            resid: be.ptr(&acc.data),
            y: be.ptr(&self.y.data),
            topk_w: self.topk_w,
            shared: self.shared,
            shared_gate: self.gate,
            resid_out: be.ptr(&resid_out.data),
            shared_stride: self.shared_stride as i64,
            k: self.k as i32,
            slots: self.slots as i32,
        }
    }
}

/// Routing and the experts' rows for the MoE on `acc`'s rows; the combine pass is left to the
/// caller ([`PendingCombine`]) unless the down projection added the sum into `acc` itself.
/// `ahead`: weights of later launches that the one-token launch (`moe_route_gate_up`) pulls
/// into L2 in its routing window; the other paths have no such window and ignore it.
fn moe_experts(be: &CudaBackend, acc: &mut CudaTensor, input: MoeInput, w: &MoeWeights<CudaBackend>, cfg: &MoeShape, ahead: L2Ahead) -> MoeOutput {
    let (t, h) = (acc.rows, acc.cols);
    let (e, k, inter) = (cfg.num_experts, cfg.top_k, cfg.expert_intermediate);
    assert_eq!(w.experts.len(), e, "moe: {} experts loaded, config says {e}", w.experts.len());
    assert!(k >= 1 && k <= e && k <= MAX_TOP_K, "moe: top-k {k} unsupported");
    for (i, [gu, d]) in w.experts.iter().enumerate() {
        assert!((gu.rows, gu.cols, d.rows, d.cols) == (2 * inter, h, h, inter), "moe: expert {i} has unexpected shapes");
    }
    if let MoeInput::Normed(x) = input {
        assert_eq!((x.rows, x.cols), (t, h), "moe: input shape differs from the accumulator's");
    }
    let fold = shared_in_groups(w, inter);
    // Rows per token in the expert activations: its k routed experts, then the shared one.
    let slots = k + usize::from(fold);
    let groups_max = e + usize::from(fold);
    // Each token picks an expert at most once, so an expert's list holds at most t entries.
    // The routing's outputs share one allocation of 4-byte words (each allocation and free is a
    // driver call on the host, which a decode step of a large MoE model is short of time for):
    // topk_idx [t*k], lists [groups_max][t], counts [groups_max], active [1 + groups_max], and
    // the f32 topk_w [t*k].
    let lists_at = t * k;
    let counts_at = lists_at + groups_max * t;
    let active_at = counts_at + groups_max;
    let weights_at = active_at + groups_max + 1;
    let routing = be.alloc_i32(weights_at + t * k);
    let word = |offset: usize| be.ptr(&routing) + 4 * offset as u64;
    let (topk_idx, lists, counts, active, topk_w) = (word(0), word(lists_at), word(counts_at), word(active_at), word(weights_at));
    assert!(e <= MAX_EXPERTS, "moe: {e} experts (routing supports at most {MAX_EXPERTS})");
    // Router logits and the shared expert's gate from one matmul.
    let widths = w.router_widths(e);
    let few = t * k <= FEW_ENTRIES;
    let route_here = few && t <= ROUTE_IN_GROUP_MAX_TOKENS;
    let router_launch = super::matmul::router_launch(be, t, w.router.rows, h, w.router.bf16().is_none()).filter(|_| route_here && w.router.dense().is_some());
    let tables = expert_tables(be, w, fold);
    let grouped_weights = |which: usize| w.experts.iter().chain(w.shared.iter().filter(|_| fold)).map(move |m| &m[which]);
    let has_lo = |which: usize| grouped_weights(which).any(|m| matches!(m.dense(), Some((_, Some(_)))));
    // The streaming paths read bf16 weights only.
    let all_bf16 = |which: usize| grouped_weights(which).all(|m| m.bf16().is_some());
    // Tiled experts: the quantized kernels of their format, which must be every group's.
    let expert_tiles = |which: usize| -> Option<&QuantTiles> {
        let first = tiles_of(&w.experts[0][which])?;
        assert!(grouped_weights(which).all(|m| tiles_of(m).is_some_and(|t| (t.fmt, t.order) == (first.fmt, first.order))), "moe: experts stored in different formats");
        Some(first)
    };
    // One token whose input norm the streaming router would take, with the shared expert in the
    // groups: the router, the routing and the gate/up in one launch (moe_route_gate_up), then
    // the fused down projection: one launch where the router's and the gate/up's were two, and
    // no hand-over between them.
    let route_gate_up = match input {
        MoeInput::Residual(n, eps) if t == 1 && fold && all_bf16(0) && all_bf16(1) && router_launch.as_ref().is_some_and(|l| l.stages > 0) && be.norm_in_registers(n, h) => {
            super::moe_stream::route_gate_up(be, w.router.rows, h, inter, k).zip(super::moe_stream::fused_down(be, slots, h, inter)).map(|plans| (n, eps, plans))
        }
        _ => None,
    };
    if let Some((norm, eps, (plan, down))) = route_gate_up {
        // Router logits and the shared expert's gate (written by the launch's first cluster).
        let parts: Vec<CudaTensor> = widths.iter().map(|&n| be.tensor(t, n)).collect();
        let act = be.tensor(slots, inter);
        let outs: Vec<(u64, usize)> = parts.iter().map(|p| (be.ptr(&p.data), p.cols)).collect();
        let args = [
            Arg::Ptr(be.ptr(&act.data)),
            Arg::Ptr(be.ptr(&acc.data)),
            Arg::Ptr(be.ptr(w.router.bf16().expect("the streaming router takes bf16 weights"))),
            Arg::I32(w.router.rows as i32),
            Arg::I32(h as i32),
            Arg::Epilogue(super::matmul::Epilogue::parts(&outs)),
            Arg::Ptr(be.ptr(&norm.data)),
            Arg::F32(eps),
            Arg::Ptr(be.ptr(&tables[0])),
            Arg::I32(e as i32),
            Arg::I32(k as i32),
            Arg::I32(i32::from(cfg.norm_topk_prob)),
            Arg::I32(inter as i32),
            Arg::Ptr(topk_idx),
            Arg::Ptr(topk_w),
            Arg::I32(plan.stages as i32),
            Arg::L2Ahead(ahead),
        ];
        be.launch_in_clusters(&be.k.moe_route_gate_up, (plan.blocks, 1, 1), super::moe_stream::ROUTE_GATE_UP_THREADS, plan.smem, plan.cluster, &args);
        let gate = parts.get(1).map_or(0, |s| be.ptr(&s.data));
        launch_fused_down(be, acc, &act, &tables[1], (topk_idx, topk_w, gate), (h, inter, k, slots, e), &down);
        return MoeOutput::Added;
    }
    // The input rows: normalized inside the streaming router (which stores them for the
    // experts) where it can, else by the row norm first.
    let normed_input: CudaTensor;
    let (x, router_norm) = match input {
        MoeInput::Normed(x) => (x, None),
        MoeInput::Residual(n, eps) if router_launch.as_ref().is_some_and(|l| l.stages > 0) && be.norm_in_registers(n, h) => {
            normed_input = be.tensor(t, h);
            (&normed_input, Some((n, eps)))
        }
        MoeInput::Residual(n, eps) => {
            normed_input = crate::backend::Backend::rms_norm(be, acc, n, eps);
            (&normed_input, None)
        }
    };
    let mut parts = match router_launch {
        Some(_) => widths.iter().map(|&n| be.tensor(t, n)).collect(),
        None => super::matmul::matmul_parts(be, x, &w.router, &widths),
    }
    .into_iter();
    let logits = parts.next().expect("router logits");
    let shared_gate = parts.next();
    // moe_route's arguments, which moe_group_few and matmul_router's routing also start with.
    let route_args = [
        Arg::Ptr(topk_idx),
        Arg::Ptr(topk_w),
        Arg::Ptr(be.ptr(&logits.data)),
        Arg::I32(t as i32),
        Arg::I32(e as i32),
        Arg::I32(k as i32),
        Arg::I32(i32::from(cfg.norm_topk_prob)),
    ];
    let route = || be.launch(&be.k.moe_route, (t.div_ceil(ROUTE_WARPS) as u32, 1, 1), 256, 0, &route_args);
    // Dynamic shared memory of moe_group_few and matmul_router.
    let group_smem = (t * k + groups_max) * 4;
    if let Some(launch) = router_launch {
        // The router matmul with the routing in its last block: one launch fewer per layer.
        let outs: Vec<(u64, usize)> = std::iter::once(&logits).chain(shared_gate.as_ref()).map(|p| (be.ptr(&p.data), p.cols)).collect();
        let (router_hi, router_lo) = w.router.dense().expect("router_launch takes dense routers only");
        let wlo = router_lo.map_or(0, |l| be.ptr(l));
        // With the norm fused, the router reads the residual stream and writes `x`.
        let router_x = if router_norm.is_some() { be.ptr(&acc.data) } else { be.ptr(&x.data) };
        let mut args = vec![
            Arg::Ptr(outs[0].0),
            Arg::Ptr(router_x),
            Arg::Ptr(be.ptr(router_hi)),
            Arg::Ptr(wlo),
            Arg::I32(t as i32),
            Arg::I32(w.router.rows as i32),
            Arg::I32(h as i32),
            Arg::Epilogue(super::matmul::Epilogue::parts(&outs)),
            Arg::I32(launch.stages as i32),
            Arg::Ptr(be.ptr(&be.router_done)),
        ];
        args.extend(route_args);
        args.extend([Arg::Ptr(lists), Arg::Ptr(counts), Arg::Ptr(active), Arg::I32(slots as i32), Arg::I32(i32::from(fold))]);
        if launch.stages > 0 {
            // matmul_router_stream's input norm (none: a null weight).
            let (nw, eps) = router_norm.map_or((0, 0.0), |(n, eps)| (be.ptr(&n.data), eps));
            args.extend([Arg::Ptr(nw), Arg::F32(eps), Arg::Ptr(be.ptr(&x.data))]);
            args.push(Arg::L2Ahead(L2Ahead::shared_expert(be, w)));
        }
        be.launch(launch.kernel, (launch.blocks, 1, 1), launch.threads, launch.smem.max(group_smem), &args);
    } else if few {
        if !route_here {
            route();
        }
        let mut args = route_args.to_vec();
        args.extend([
            Arg::Ptr(lists),
            Arg::Ptr(counts),
            Arg::Ptr(active),
            Arg::I32(i32::from(route_here)),
            Arg::I32(slots as i32),
            Arg::I32(i32::from(fold)),
        ]);
        be.launch(&be.k.moe_group_few, (1, 1, 1), 256, group_smem, &args);
    } else {
        route();
        be.launch(
            &be.k.moe_group,
            (groups_max as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(lists),
                Arg::Ptr(counts),
                Arg::Ptr(topk_idx),
                Arg::I32((t * k) as i32),
                Arg::I32(t as i32),
                Arg::I32(k as i32),
                Arg::I32(slots as i32),
                Arg::I32(e as i32),
            ],
        );
        be.launch(&be.k.moe_active, (1, 1, 1), 32, 0, &[Arg::Ptr(active), Arg::Ptr(counts), Arg::I32(groups_max as i32)]);
    }
    // At most t * k experts have rows (and the shared one): one grid slice each.
    let groups = e.min(t * k) + usize::from(fold);
    let grouped = |which: usize, a_div: usize, lists_ready: bool| Grouped {
        table: be.ptr(&tables[which]),
        counts,
        lists,
        list_stride: t,
        a_div,
        active,
        groups,
        has_lo: has_lo(which),
        lists_ready,
    };
    // Gate and up in one grouped launch, SwiGLU applied in its store.
    let act = be.tensor(t * slots, inter);
    let launch_grouped = |which: usize, out: u64, xp: u64, x_rows: usize, n: usize, k: usize, g: &Grouped, epi: Epilogue| match expert_tiles(which) {
        Some(tiles) => super::qmatmul::launch_tiles(be, out, xp, x_rows, tiles, t, n, k, Some(g), epi, None),
        None => launch_matmul(be, out, xp, x_rows, 0, 0, t, n, k, Some(g), epi),
    };
    launch_grouped(0, be.ptr(&act.data), be.ptr(&x.data), t, 2 * inter, h, &grouped(0, slots, false), Epilogue::SWIGLU);
    // The gate/up launch waited for the routing before it let this one start, so the down
    // launch may look its experts up early.
    let down = grouped(1, 1, true);
    // One token: the down projection adds the weighted sum into the residual row itself (the
    // same bits as the grouped launch and the combine pass), so that the next launch reads one
    // row instead of every expert's.
    let fused_down = (t == 1 && (fold || w.shared.is_none()) && all_bf16(1)).then(|| super::moe_stream::fused_down(be, slots, h, inter)).flatten();
    if let Some(launch) = fused_down {
        let gate = shared_gate.as_ref().filter(|_| fold).map_or(0, |s| be.ptr(&s.data));
        launch_fused_down(be, acc, &act, &tables[1], (topk_idx, topk_w, gate), (h, inter, k, slots, e), &launch);
        return MoeOutput::Added;
    }
    let y = be.tensor(t * slots, h);
    launch_grouped(1, be.ptr(&y.data), be.ptr(&act.data), t * slots, h, inter, &down, Epilogue::STORE);

    // The shared expert's rows: slot k of y, or its own matmuls when its shapes differ.
    let separate = w.shared.as_ref().filter(|_| !fold).map(|[gu, d]| super::matmul::matmul(be, &super::matmul::matmul_swiglu(be, x, gu), d));
    let (shared, shared_stride) = match (&separate, w.shared.is_some()) {
        (Some(s), _) => (be.ptr(&s.data), h),
        (None, true) => (be.ptr(&y.data) + 4 * (k * h) as u64, slots * h),
        (None, false) => (0, 0),
    };
    let gate = shared_gate.as_ref().filter(|_| shared != 0).map_or(0, |s| be.ptr(&s.data));
    MoeOutput::Pending(PendingCombine { y, _routing: routing, topk_w, _separate: separate, _shared_gate: shared_gate, shared, gate, shared_stride, k, slots })
}

/// `moe_down_combine`: the experts' rows of one token (`act`, SwiGLU outputs) through their down
/// projections (`table`), weighted by the routing (topk_idx, topk_w; the shared expert's gate
/// logit, 0: none) and added into the residual row `acc`. Shapes: (h, inter, k, slots, E).
fn launch_fused_down(be: &CudaBackend, acc: &CudaTensor, act: &CudaTensor, table: &cudarc::driver::CudaSlice<u64>, routing: (u64, u64, u64), shape: (usize, usize, usize, usize, usize), launch: &super::moe_stream::FusedDown) {
    let (topk_idx, topk_w, gate) = routing;
    let (h, inter, k, slots, e) = shape;
    let args = [
        Arg::Ptr(be.ptr(&acc.data)),
        Arg::Ptr(be.ptr(&act.data)),
        Arg::Ptr(be.ptr(table)),
        Arg::Ptr(topk_idx),
        Arg::Ptr(topk_w),
        Arg::Ptr(gate),
        Arg::I32(h as i32),
        Arg::I32(inter as i32),
        Arg::I32(k as i32),
        Arg::I32(slots as i32),
        Arg::I32(e as i32),
        Arg::I32(launch.stages as i32),
    ];
    be.launch(&be.k.moe_down_combine, (launch.blocks, 1, 1), super::matmul::STREAM_THREADS, launch.smem, &args);
}

#[cfg(test)]
mod tests {
    use super::tail_range;

    #[test]
    fn tail_range_takes_the_last_whole_pieces_inside_the_matrix() {
        // 35B-A3B's input projection (12352 rows of 2048 bf16): its last 20 MiB.
        let len = 12352 * 2048 * 2;
        assert_eq!(tail_range(len, 20 << 20), Some((len - (20 << 20), 20 << 20)));
        // A matrix smaller than the tail: all of it.
        assert_eq!(tail_range(4096, 20 << 20), Some((0, 4096)));
        // Pieces of 16 bytes that start 16-byte aligned and end inside the matrix.
        let (offset, bytes) = tail_range(1000, 100).expect("a tail");
        assert!(offset.is_multiple_of(16) && bytes.is_multiple_of(16) && offset + bytes <= 1000 && bytes == 96);
        // Off, or nothing whole.
        assert_eq!(tail_range(len, 0), None);
        assert_eq!(tail_range(8, 100), None);
    }
}
