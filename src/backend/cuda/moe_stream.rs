//! Launch shapes of the MoE's one-token streaming kernels (cuda/moe_stream.cu): the router,
//! routing and gate/up in one clustered launch (`moe_route_gate_up`), and the down projection
//! with the weighted sum (`moe_down_combine`). Their rings are the streaming matmuls' rings
//! ([`super::matmul::StreamKernels`]), sized so that a block of each fits on one SM.

use super::matmul::{STREAM_MAX_STAGES, STREAM_THREADS};
use super::CudaBackend;

/// Threads of `moe_route_gate_up`: the streaming kernels' and the warm-up warp
/// (ROUTE_GATE_UP_THREADS in cuda/moe_stream.cu).
pub(super) const ROUTE_GATE_UP_THREADS: u32 = STREAM_THREADS + 32;

/// Shared memory `moe_down_combine`'s ring and split rows aim for: a block then fits on an SM
/// beside two blocks of the gate/up launch before it (as the grouped down launch's ring does,
/// [`super::matmul::GROUPED_RING_BYTES`]), or beside one of `moe_route_gate_up`. At 35B-A3B's
/// sizes (nine slots of K = 512), four stages of 8 rows beside the 19 KB of split rows (five,
/// which also fit there, were slower on the H100: 3.312-3.329 against 3.266-3.284 ms per step).
const FUSED_DOWN_BYTES: usize = 54 * 1024;
/// Most slots (routed experts and the shared one) of `moe_down_combine` (FUSED_DOWN_MAX_SLOTS in
/// cuda/moe_stream.cu).
const FUSED_DOWN_MAX_SLOTS: usize = 16;

/// One launch of `moe_down_combine` (cuda/moe_stream.cu): blocks, stages, dynamic shared memory.
pub(super) struct FusedDown {
    pub blocks: u32,
    pub stages: usize,
    pub smem: usize,
}

/// The fused down projection for a token of `slots` expert rows of `k` inputs into `h` outputs,
/// or None where it does not apply (no streaming kernels or turned off, or a shape
/// [`fused_down_shape_of`] does not take).
pub(super) fn fused_down(be: &CudaBackend, slots: usize, h: usize, k: usize) -> Option<FusedDown> {
    let sk = be.stream_kernels.as_ref()?;
    let (stages, smem) = fused_down_shape_of(sk.fused_down_max_dynamic, slots, h, k)?;
    Some(FusedDown { blocks: (h / 8) as u32, stages, smem })
}

/// Most router columns of `moe_route_gate_up` (ROUTE_GU_MAX_COLS in cuda/moe_stream.cu).
const ROUTE_GU_MAX_COLS: usize = 32 * 16 + 8;

/// One launch of `moe_route_gate_up` (cuda/moe_stream.cu): blocks per cluster, blocks,
/// stages, dynamic shared memory.
pub(super) struct RouteGateUp {
    pub cluster: u32,
    pub blocks: u32,
    pub stages: usize,
    pub smem: usize,
}

/// The router, the routing and the experts' gate/up of one token in one launch, for a router of
/// `router_n` columns (E + 1: the shared expert's gate last) over `h` inputs, k routed experts
/// of `inter` outputs and the shared expert with the same shapes; None where the backend has no
/// cluster size for it (no streaming kernels, or `KESTREL_CUDA_ROUTE_GATE_UP=0`) or
/// [`route_gate_up_shape_of`] does not take the shape. The grid is as many clusters as fit on
/// the GPU at once.
pub(super) fn route_gate_up(be: &CudaBackend, router_n: usize, h: usize, inter: usize, k: usize) -> Option<RouteGateUp> {
    let sk = be.stream_kernels.as_ref()?;
    let cluster = sk.route_gate_up_cluster;
    let (stages, smem) = route_gate_up_shape_of(sk.route_gate_up_max_dynamic, cluster, router_n, h, inter, k)?;
    let clusters = be.active_clusters(&be.k.moe_route_gate_up, ROUTE_GATE_UP_THREADS, smem, cluster)?;
    Some(RouteGateUp { cluster: cluster as u32, blocks: (cluster * clusters) as u32, stages, smem })
}

/// (stages, dynamic shared memory) of `moe_route_gate_up` in clusters of `cluster` blocks, for
/// a kernel that may take `max_dynamic` bytes; None where K is not in whole 32-wide blocks, the
/// gate/up rows not in whole 8-column blocks, the router has more columns or the token more
/// slots than the kernel keeps, or the ring does not fit. The ring holds a block's share of the
/// router's column blocks and one more (the shared expert's first, copied while the router
/// runs), at least four stages.
fn route_gate_up_shape_of(max_dynamic: usize, cluster: usize, router_n: usize, h: usize, inter: usize, k: usize) -> Option<(usize, usize)> {
    if cluster == 0 || !h.is_multiple_of(32) || !inter.is_multiple_of(4) || router_n > ROUTE_GU_MAX_COLS || k + 1 > FUSED_DOWN_MAX_SLOTS {
        return None;
    }
    let row_bytes = 2 * h + if (2 * h).is_multiple_of(128) { 64 } else { 0 };
    let router_items = router_n.div_ceil(8).div_ceil(cluster);
    let stages = (router_items + 1).clamp(4, STREAM_MAX_STAGES);
    let smem = stages * 8 * row_bytes + 2 * row_bytes + 4 * h;
    (smem <= max_dynamic).then_some((stages, smem))
}

/// (stages, dynamic shared memory) of `moe_down_combine`, for a kernel that may take
/// `max_dynamic` bytes (0: off); None where K is not in whole 32-wide blocks, H not in whole
/// 8-column blocks, there are more slots than the kernel keeps, or two stages do not fit.
fn fused_down_shape_of(max_dynamic: usize, slots: usize, h: usize, k: usize) -> Option<(usize, usize)> {
    if !k.is_multiple_of(32) || !h.is_multiple_of(8) || slots == 0 || slots > FUSED_DOWN_MAX_SLOTS {
        return None;
    }
    // Rows padded as [`StreamKernels::shape_of_variant`] sizes them (the kernel's default rows
    // take less): stages of 8 weight rows, then the split activation rows.
    let row_bytes = 2 * k + if (2 * k).is_multiple_of(128) { 64 } else { 0 };
    let stage = 8 * row_bytes;
    let x_bytes = 2 * slots * row_bytes;
    let stages = (FUSED_DOWN_BYTES.saturating_sub(x_bytes) / stage).clamp(2, STREAM_MAX_STAGES);
    let smem = stages * stage + x_bytes;
    (smem <= max_dynamic).then_some((stages, smem))
}

#[cfg(test)]
mod tests {
    use super::*;
    use super::super::matmul::{StreamKernels, GROUPED_RING_BYTES, RING_BYTES};

    #[test]
    fn fused_down_ring_fits_beside_the_gate_up_launch_or_falls_back() {
        // An H100 (as above); the fused kernel's static shared memory is 4.5 KB.
        let (smem_per_sm, max_dynamic, gate_up_static) = (228 * 1024, 227 * 1024 - 4608, 8448);
        let sk = StreamKernels { ring_bytes: RING_BYTES, grouped_ring_bytes: GROUPED_RING_BYTES, static_smem: [gate_up_static, 16768, 33024], blocks_per_sm: [3, 3, 1], norm_blocks_per_sm: [2, 2, 1], norm_in_matmul: true, max_dynamic: [227 * 1024 - 8448; 3], smem_per_sm, fused_down_max_dynamic: max_dynamic, route_gate_up_cluster: 0, route_gate_up_max_dynamic: 0, min_variant: 0 };
        let gate_up = sk.shape(1, 2048, true).expect("gate/up streams");
        // 35B-A3B: nine slots (eight routed experts and the shared one) of K = 512 into 2048:
        // four stages of 8 rows beside the split rows, and a block fits on an SM beside two of
        // the gate/up launch's.
        let (stages, smem) = fused_down_shape_of(max_dynamic, 9, 2048, 512).expect("35B-A3B's down projection fuses");
        assert_eq!((stages, smem), (4, 4 * 8 * 1088 + 2 * 9 * 1088));
        assert!(2 * (gate_up.smem + gate_up_static + 1024) + smem + 4608 + 1024 <= smem_per_sm);
        // Rows of 2K bytes not a multiple of 128 are not padded; a short K fills more stages.
        assert_eq!(fused_down_shape_of(max_dynamic, 3, 64, 32), Some((STREAM_MAX_STAGES, STREAM_MAX_STAGES * 8 * 64 + 2 * 3 * 64)));
        // Shapes it does not take go to the grouped launch and the combine pass.
        assert_eq!(fused_down_shape_of(max_dynamic, 9, 2048, 500), None, "K not in whole 32-wide blocks");
        assert_eq!(fused_down_shape_of(max_dynamic, 9, 2044, 512), None, "H not in whole 8-column blocks");
        assert_eq!(fused_down_shape_of(max_dynamic, FUSED_DOWN_MAX_SLOTS + 1, 2048, 512), None, "more slots than the kernel keeps");
        assert_eq!(fused_down_shape_of(max_dynamic, 9, 2048, 8192), None, "two stages past shared memory");
        assert_eq!(fused_down_shape_of(0, 9, 2048, 512), None, "turned off");
    }

    #[test]
    fn route_gate_up_ring_holds_the_router_share_or_falls_back() {
        // An H100 (227 KB per block, 228 KB per SM, 1 KB of each block's reserved) beside the
        // kernel's 8.25 KB of static shared memory.
        let (smem_per_sm, static_smem) = (228 * 1024, 8448);
        let max_dynamic = 227 * 1024 - static_smem;
        let row = 2 * 2048 + 64;
        // 35B-A3B: 257 router columns (256 experts and the shared gate) in 33 column blocks,
        // at most three per block of a 16-block cluster, and the shared expert's first one.
        let (stages, smem) = route_gate_up_shape_of(max_dynamic, 16, 257, 2048, 512, 8).expect("35B-A3B's router and gate/up fuse");
        assert_eq!((stages, smem), (4, 4 * 8 * row + 2 * row + 4 * 2048));
        // A block of the down projection after it (4.4 KB static, four stages) fits on the same
        // SM, so that it copies its first slots while the gate/up products stream.
        let down_static = 4480;
        let down = fused_down_shape_of(227 * 1024 - down_static, 9, 2048, 512).expect("35B-A3B's down projection fuses");
        assert!(down.0 == 4 && smem + static_smem + 1024 + down.1 + down_static + 1024 <= smem_per_sm);
        // Clusters of 8: five router column blocks a block, six stages; of 4: nine, too many.
        assert_eq!(route_gate_up_shape_of(max_dynamic, 8, 257, 2048, 512, 8), Some((6, 6 * 8 * row + 2 * row + 4 * 2048)));
        assert_eq!(route_gate_up_shape_of(max_dynamic, 4, 257, 2048, 512, 8), None, "the router's share past shared memory");
        // A small router still takes four stages; one of 16 blocks per cluster takes none.
        assert_eq!(route_gate_up_shape_of(max_dynamic, 16, 9, 128, 64, 2).map(|(stages, _)| stages), Some(4));
        // Shapes it does not take go to the router launch and the grouped gate/up launch.
        assert_eq!(route_gate_up_shape_of(max_dynamic, 0, 257, 2048, 512, 8), None, "turned off");
        assert_eq!(route_gate_up_shape_of(max_dynamic, 16, 257, 2040, 512, 8), None, "K not in whole 32-wide blocks");
        assert_eq!(route_gate_up_shape_of(max_dynamic, 16, 257, 2048, 510, 8), None, "gate/up rows not in whole 8-column blocks");
        assert_eq!(route_gate_up_shape_of(max_dynamic, 16, ROUTE_GU_MAX_COLS + 1, 2048, 512, 8), None, "more router columns than the kernel keeps");
        assert_eq!(route_gate_up_shape_of(max_dynamic, 16, 257, 2048, 512, FUSED_DOWN_MAX_SLOTS), None, "more slots than the down projection keeps");
    }
}
