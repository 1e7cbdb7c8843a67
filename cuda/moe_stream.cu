// The MoE's streaming kernels for one-token steps: the experts' down projection with the
// weighted sum into the residual row (moe_down_combine), and the router, its routing and the
// experts' gate/up in one clustered launch (moe_route_gate_up). Compiled in the matmul module
// after cuda/matmul_stream.cu, whose ring, copies and row norm they use, and cuda/routing.cuh.

// Most slots (routed experts, then the shared one) of moe_down_combine's token.
#define FUSED_DOWN_MAX_SLOTS 16

// The experts' down projection of a one-token step, with the MoE's weighted sum into the
// residual row in its store. Block b owns output columns 8b .. 8b+7 of every slot (slot s < k:
// expert topk_idx[s]; slot k, where slots > k: the shared expert, group E of `table`), streams
// their 8 weight rows per slot through its ring in slot order, and adds the slots' products
// into the sum: moe_combined4's expression in its order (the routed slots by their weights,
// then the shared one by its gate, then onto the residual), with the products of
// matmul_stream_nt1 (the same copies, fragments and mma sequence, the slices added in slice
// order), so the residual row is bitwise the grouped down launch's and then the combine
// pass's. The launch after it then reads one row instead of the residual and all the expert
// rows (35B-A3B: each of the next input projection's 264 blocks read 80 KB of them).
//
// Its ring start, row split and k loop are written out here rather than shared with
// matmul_stream_body: with them as shared helpers the plain streaming kernels compiled
// differently, and 9b's decode step went from 6.22 to 6.40 ms on the H100.
//
// Writes `resid` in place: each block reads and writes only its own columns. Arguments: the
// residual row, the k + fold activation rows (the SwiGLU outputs, K each), the down weights'
// pointer table ([groups][hi, lo], bf16 hi only), the routing (topk_idx, topk_w), the shared
// expert's gate logit (null: none, a scale of 1), H (a multiple of 8), K (a multiple of 32), k,
// slots, E and the ring's stage count. Dynamic shared memory: the ring (stages * 8 rows of 2K
// bytes), then the split activation rows (2 * slots rows of 2K bytes).
// The ring of a one-token MoE launch: `stages` stages at the start of dynamic shared memory,
// rows of 2K bytes (padded as stream_start pads them), its barriers in `bars` (initialized by
// thread 0: a stage is full once its copies land, empty once the k-slice warps are done).
__device__ __forceinline__ StreamRing one_token_ring(unsigned char* smem, u64* bars, int stages, int K) {
    StreamRing ring = {};
    ring.stage0 = smem;
    ring.full = smem_u32(bars);
    ring.empty = ring.full + 8 * STREAM_MAX_STAGES;
    ring.stages = stages;
    ring.row_bytes = 2 * K + (STREAM_ROW_PAD && (2 * K) % 128 == 0 ? 64 : 0);
    if (threadIdx.x == 0)
        for (int s = 0; s < stages; ++s) {
            mbar_init(ring.full + 8 * s, 1);
            mbar_init(ring.empty + 8 * s, KSLICES);
        }
    return ring;
}

// What moe_down_combine does before its inputs are ready: its ring, each slot's weights (the
// routing is complete once this kernel runs: two launches back, the gate/up launch between
// waited for it before it let this one start; or written by moe_route_gate_up just before,
// which lets this one start only after its blocks wrote and fenced it), and the producer warp's
// copies of the first `early` slots (the whole ring while the gate/up launch streams: 32 KB a
// block). The slots past them are not pulled into L2 ahead: since this launch's blocks fit
// beside moe_route_gate_up's, those prefetches competed with the experts' gate/up stream
// (35B-A3B decode on the H100: 3.286-3.290 ms per step without them, 3.303-3.332 with).
struct FusedDownStart {
    StreamRing ring;
    const bf16_t* const* slot_w;
    // The routed slots' experts read before the wait, checked after it.
    const int* slot_e;
    int early;
    // The plain store: what stream_issue copies by (its rows in order).
    Epilogue epi;
};

__device__ __forceinline__ FusedDownStart fused_down_start(const u64* table, const int* topk_idx, int H, int K, int k, int slots, int E, int stages) {
    extern __shared__ __align__(128) unsigned char stream_smem[];
    __shared__ __align__(8) u64 bars[2 * STREAM_MAX_STAGES];
    __shared__ const bf16_t* slot_w[FUSED_DOWN_MAX_SLOTS];
    __shared__ int slot_e[FUSED_DOWN_MAX_SLOTS];
    FusedDownStart st = {};
    st.ring = one_token_ring(stream_smem, bars, stages, K);
    StreamRing& ring = st.ring;
    st.slot_w = slot_w;
    st.slot_e = slot_e;
    st.early = min(stages, slots);
    st.epi.mode = EPI_STORE;
    if (threadIdx.x == 0) mbar_init_fence();
    if ((int)threadIdx.x < slots) {
        int e = (int)threadIdx.x < k ? load_l2(topk_idx + threadIdx.x) : E;
        slot_e[threadIdx.x] = e;
        slot_w[threadIdx.x] = (const bf16_t*)load_l2(table + 2 * e);
    }
    __syncthreads();
    if ((int)(threadIdx.x >> 5) == KSLICES) {
        int lane = threadIdx.x & 31, n0 = blockIdx.x * 8;
        for (int i = 0; i < st.early; ++i) stream_issue<1>(ring, slot_w[i], H, K, n0, i, st.epi);
    }
    return st;
}

extern "C" __global__ void __launch_bounds__(STREAM_THREADS) moe_down_combine(float* resid, const float* act, const u64* table, const int* topk_idx,
        const float* topk_w, const float* shared_gate, int H, int K, int k, int slots, int E, int stages) {
    FusedDownStart st = fused_down_start(table, topk_idx, H, K, k, slots, E, stages);
    wait_for_inputs();
    // The experts read before the wait must be the routing's: should that ever not hold (the
    // routing written by the launch just before, moe_route_gate_up), stop loudly rather than
    // add another expert's products.
    int routed_expert = (int)threadIdx.x < k ? load_l2(topk_idx + threadIdx.x) : 0;
    __shared__ float slot_scale[FUSED_DOWN_MAX_SLOTS];
    __shared__ float slice_sums[FUSED_DOWN_MAX_SLOTS][KSLICES][8];
    const StreamRing& ring = st.ring;
    const Epilogue& epi = st.epi;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, n0 = blockIdx.x * 8;
    if (warp == KSLICES) {
        for (int i = st.early; i < slots; ++i) {
            int s = i % stages;
            mbar_wait(ring.empty + 8 * s, (u32)((i / stages - 1) & 1));
            stream_issue<1>(ring, st.slot_w[i], H, K, n0, s, epi);
        }
        return;
    }
    int xstride = ring.row_bytes / 2;
    bf16_t* xs = (bf16_t*)(ring.stage0 + (long long)stages * 8 * ring.row_bytes);
    // Lanes 0-3 of warp 0 hold columns n0 + 2q and n0 + 2q + 1 of the fragments (row 0).
    bool holder = warp == 0 && g == 0;
    float r0 = 0.0f, r1 = 0.0f;
    if (holder) {
        r0 = resid[n0 + 2 * q];
        r1 = resid[n0 + 2 * q + 1];
    }
    // Each slot's factor in the sum, in shared memory before the k loop's chain needs them.
    if ((int)threadIdx.x < slots) slot_scale[threadIdx.x] = (int)threadIdx.x < k ? topk_w[threadIdx.x] : shared_scale(shared_gate, 0);
    // The slots' rows rounded to bf16, two chunks of 8 per thread loaded before either is
    // rounded (nine rows of K = 512 are 2.25 chunks a thread).
    for (int c0 = threadIdx.x; c0 < slots * (K / 8); c0 += 2 * 32 * KSLICES) {
        float v[2][8];
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            int c = c0 + b * 32 * KSLICES;
            if (c < slots * (K / 8)) load8_f32(act + (long long)(c / (K / 8)) * K, (c % (K / 8)) * 8, K, true, v[b]);
        }
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            int c = c0 + b * 32 * KSLICES, r = c / (K / 8), kk = (c % (K / 8)) * 8;
            if (c >= slots * (K / 8)) break;
            u32 hi[4];
            round8(v[b], hi);
            *(uint4*)(xs + (long long)r * xstride + kk) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        }
    }
    k_slices_sync();
    if (threadIdx.x == 0 && blockIdx.x == 0) TRACE_MARK(TRACE_ROWS_READY);
    int nkb = K / 32, kps = (nkb + KSLICES - 1) / KSLICES;
    int kb0 = warp * kps, kb1 = min(kb0 + kps, nkb);
    const uint4 zero[1] = {};
    // Each warp takes the slots in turn without waiting for the others (a block barrier per
    // slot held every warp to the slowest one's copy and arithmetic), keeping its slice's sums
    // of the 8 columns (lanes 0-3 of fragment row 0) in shared memory; after one barrier, warp
    // 0 adds them up in slice order as matmul_stream_body does, slot by slot.
    for (int i = 0; i < slots; ++i) {
        int s = i % stages;
        float c[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
        mbar_wait(ring.full + 8 * s, (u32)((i / stages) & 1));
        if (i == 0 && threadIdx.x == 0 && blockIdx.x == 0) TRACE_MARK(TRACE_FIRST_DATA);
        const unsigned char* st = ring.stage0 + (long long)s * 8 * ring.row_bytes + g * ring.row_bytes + q * 16;
        for (int kb = kb0; kb < kb1; ++kb) {
            uint4 bh[1] = {*(const uint4*)(st + kb * 64)};
            small_kblock_rounded<1>(c, g == 0 ? xs + (long long)i * xstride : 0, 0, false, kb * 32 + q * 8, bh, zero);
        }
        // This warp's reads of the stage are done: the producer may refill it.
        __syncwarp();
        if (lane == 0) mbar_arrive(ring.empty + 8 * s);
        if (g == 0) {
            slice_sums[i][warp][2 * q] = c[0][0];
            slice_sums[i][warp][2 * q + 1] = c[0][1];
        }
    }
    k_slices_sync();
    if ((int)threadIdx.x < k && routed_expert != st.slot_e[threadIdx.x]) __trap();
    if (holder) {
        float a0 = 0.0f, a1 = 0.0f;
        for (int i = 0; i < slots; ++i) {
            float t0 = 0.0f, t1 = 0.0f;
            for (int w = 0; w < KSLICES; ++w) {
                t0 += slice_sums[i][w][2 * q];
                t1 += slice_sums[i][w][2 * q + 1];
            }
            float ws = slot_scale[i];
            a0 += ws * t0;
            a1 += ws * t1;
        }
        resid[n0 + 2 * q] = r0 + a0;
        resid[n0 + 2 * q + 1] = r1 + a1;
    }
    if (threadIdx.x == 0) TRACE_MARK(TRACE_BLOCK_END);
}

// ---- The router, the routing and the experts' gate/up in one launch (one-token steps) ----
//
// Launched in clusters of C blocks (thread block clusters, sm_90). Every cluster computes all
// router columns, each block its share (column blocks rank, rank + C, ...), and each block
// sends its columns to every block of its cluster through distributed shared memory; after one
// cluster barrier every block routes the token itself and goes straight on to its share of the
// gate/up column blocks. The separate router launch met at a global count in its last block,
// which routed from logits read back from L2, and the gate/up launch then waited for that
// grid to end and looked its experts up in global memory. On the H100 (35B-A3B, one-token
// decode) the two launches took 30-31 us of each layer, this one 23-26 us. After its inputs,
// a block's normalized row is ready at 1.3-2 us, the cluster's exchange is done at about 5 us
// (its slowest block sets it), the routing's rounds end 2.5-5 us later, and the first routed
// weights land at 9-11 us; the 20 SMs that do not fit a 16-block cluster stay idle.

// Gate/up column blocks the k-slice warps of moe_route_gate_up take at once: independent mma
// chains, where one column block's chain left the warps waiting on each mma's latency (35B-A3B
// decode on the H100: 3.334-3.371 ms per step against 3.387-3.434 with one).
// `KESTREL_CUDA_DEFINES=RGU_PASS=1` for A/B runs; at most RGU_MAX_PASS.
#ifndef RGU_PASS
#define RGU_PASS 2
#endif
// Most column blocks of one pass (the reduction buffers' size): a block's share of the router
// (up to three column blocks) goes in one pass. In passes of two and one, the block with three
// held its whole cluster's exchange back by a pass (35B-A3B decode on the H100, with the routing
// published round by round: 3.301-3.320 ms per step against 3.386-3.396).
#define RGU_MAX_PASS 3
// Most router columns (experts, then the shared expert's gate) moe_route_gate_up keeps.
#define ROUTE_GU_MAX_COLS (32 * ROUTE_MAX_PER_LANE + 8)

__device__ __forceinline__ u32 cluster_rank() {
    u32 r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ u32 cluster_blocks() {
    u32 n = 1;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}
// Cluster barrier halves: every thread of every block of the cluster arrives once per phase.
__device__ __forceinline__ void cluster_arrive_release() { SM90_ASM("barrier.cluster.arrive.release;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive_relaxed() { SM90_ASM("barrier.cluster.arrive.relaxed;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { SM90_ASM("barrier.cluster.wait.acquire;" ::: "memory"); }
// v into the shared memory of the cluster's block `rank`, at the place of `local` (16-byte
// aligned) in this one.
__device__ __forceinline__ void store4_in_cluster_block(const float* local, u32 rank, float4 v) {
    u32 remote = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(local)), "r"(rank));
#endif
    SM90_ASM("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(remote), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}

// Ring items i .. i + P - 1 of a one-row launch through the k-slice warps at once:
// matmul_stream_body's products of P column blocks for their row 0 (for each column block the
// same copies, fragments, mma sequence and slice order, so the same bits; P chains side by
// side, as matmul_stream_body's n tiles are), left in warp 0's `t[j]` (lanes 0-3: columns 2q
// and 2q + 1). `pass` alternates the reduction buffers. Written out rather than shared with
// matmul_stream_body for the reason moe_down_combine gives.
template <int P>
__device__ __forceinline__ void one_row_column_blocks(const StreamRing& ring, int i, int pass, const Epilogue& epi, const bf16_t* h0, int kb0, int kb1,
        float (*red)[KSLICES][RGU_MAX_PASS][4][2], float t[RGU_MAX_PASS][4]) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, S = ring.stages;
    float c[P][4];
    const unsigned char* st[P];
#pragma unroll
    for (int j = 0; j < P; ++j) {
        int s = (i + j) % S;
        c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
        mbar_wait(ring.full + 8 * s, (u32)(((i + j) / S) & 1));
        st[j] = ring.stage0 + (long long)s * 8 * ring.row_bytes + (long long)stage_slot<1>(epi, g) * ring.row_bytes + q * 16;
    }
    for (int kb = kb0; kb < kb1; ++kb) {
        uint4 bh[P];
#pragma unroll
        for (int j = 0; j < P; ++j) bh[j] = *(const uint4*)(st[j] + kb * 64);
        // small_kblock_rounded's fragments (rows 8-15 zero) and mma_kblock's two products for
        // each chain, but step by step across the chains: the products are issued in program
        // order, so chain by chain each mma waited for the one before it.
        u32 hi0[4] = {0, 0, 0, 0}, a[2][4];
        const u32 none[4] = {0, 0, 0, 0};
        if (h0) load_round8(h0, kb * 32 + q * 8, hi0);
        make_frags(hi0, none, a);
#pragma unroll
        for (int j = 0; j < P; ++j) mma_bf16(c[j], a[0], bh[j].x, bh[j].y);
#pragma unroll
        for (int j = 0; j < P; ++j) mma_bf16(c[j], a[1], bh[j].z, bh[j].w);
    }
    // This warp's reads of the stages are done: the producer may refill them.
    __syncwarp();
    if (lane == 0)
        for (int j = 0; j < P; ++j) mbar_arrive(ring.empty + 8 * ((i + j) % S));
    // Only fragment row 0 (lanes 0-3, their first two values) is the token's; the buffers hold
    // just that, so that moe_down_combine's blocks fit on the SMs beside this launch's and
    // copy their first slots while the gate/up products stream. Buffer pass & 1 was last read
    // by warp 0 in pass - 2, before the barrier of pass - 1.
    float (*rb)[RGU_MAX_PASS][4][2] = red[pass & 1];
    if (g == 0)
#pragma unroll
        for (int j = 0; j < P; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) rb[warp][j][q][e] = c[j][e];
    k_slices_sync();
    if (warp == 0) {
#pragma unroll
        for (int j = 0; j < P; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) t[j][e] = 0.0f;
            if (g == 0)
                for (int w = 0; w < KSLICES; ++w)
#pragma unroll
                    for (int e = 0; e < 2; ++e) t[j][e] += rb[w][j][q][e];
        }
    }
}

// The routing warp's code, called rather than inlined so that one copy of it exists: the
// warm-up warp runs that copy before the routing warp needs it (see ROUTE_WARM_WARP).
__device__ __noinline__ void route_gate_up_routing(const float* logits, bool logits_in_l2, int* topk_idx, float* topk_w, int E, int k, int renormalize,
        int* chosen_expert, u32 chosen_bars) {
    route_token(0, topk_idx, topk_w, logits, E, k, renormalize, logits_in_l2, chosen_expert, chosen_bars);
}

// moe_route_gate_up's threads: the k-slice warps, the producer warp, and a warm-up warp that
// runs the routing's code once on scratch data before the launch's inputs are ready. The
// routing is one warp's chain of a few thousand instructions, run once a layer; by then its code
// has left the caches (a layer streams some 125 MB of weights), and the routing warp fetched it
// from memory line by line. 35B-A3B decode on the H100, device clocks around the routing: 11.8
// thousand cycles cold, 4.0 thousand right after a warm-up run by the same warp. The warm-up
// run in a k-slice warp or in the producer delayed their own work in the window (the row's
// norm; the L2 prefetches and the shared expert's copies) and the step took longer. Its own
// warp (warp KSLICES + 1, on the sub-partition of warp 1), with the routing in warp 1: the
// routing 3.5 us after the logits' exchange instead of 6.5, and 3.190-3.221 ms per step against
// 3.242-3.259 with the warp idle (`KESTREL_CUDA_DEFINES=ROUTE_WARM=0`, for A/B runs), and
// 3.199-3.217 with the routing in warp 0 (ROUTE_WARP=0).
#define ROUTE_WARM_WARP (KSLICES + 1)
#define ROUTE_GATE_UP_THREADS (32 * (KSLICES + 2))
#ifndef ROUTE_WARM
#define ROUTE_WARM 1
#endif
// The k-slice warp that routes: the one sharing the warm-up warp's sub-partition (warps w and
// w + 4 issue from the same one), whose instruction cache that warp filled.
#ifndef ROUTE_WARP
#define ROUTE_WARP 1
#endif

// What moe_route_gate_up does before its inputs are ready (weights and the weight table only):
// its ring, the cluster's first barrier phase (every block has started, so its shared memory
// may be written), the producer's copies of the norm weight and of the block's share of the
// router, the experts' weight pointers (loaded by the k-slice warps, off the producer's path)
// and the warm-up warp's run of the routing code. Its shared arrays are static here and reached
// through the pointers.
struct RouteGateUpStart {
    StreamRing ring;
    int rank, C, nr, n_gu, gu_cbs;
    Epilogue gu_epi;
    float (*red)[KSLICES][RGU_MAX_PASS][4][2];
    float* logits;
    const bf16_t** expert_w;
    int* slot_row;
    // Set by the routing warp once the routing's global writes are fenced.
    volatile int* routing_published;
    // The routing's slots as route_token's rounds choose them: their experts, and a barrier per
    // slot that the round completes. The producer copies a slot's weights as soon as it is chosen.
    int* chosen_expert;
    u32 chosen_bars;
};

__device__ __forceinline__ RouteGateUpStart route_gate_up_start(const bf16_t* router_w, int router_n, int K, const Epilogue& router_epi, const float* norm_w, const u64* table,
        int E, int k, int renormalize, int inter, int stages) {
    extern __shared__ __align__(128) unsigned char stream_smem[];
    __shared__ __align__(8) u64 bars[2 * STREAM_MAX_STAGES];
    __shared__ __align__(8) u64 norm_bar;
    __shared__ float red[2][KSLICES][RGU_MAX_PASS][4][2];
    __shared__ __align__(16) float logits_s[ROUTE_GU_MAX_COLS];
    __shared__ const bf16_t* expert_w[ROUTE_GU_MAX_COLS];
    __shared__ int slot_row[FUSED_DOWN_MAX_SLOTS + 1];
    __shared__ int routing_published;
    __shared__ int chosen_expert[FUSED_DOWN_MAX_SLOTS];
    __shared__ __align__(8) u64 chosen_bars[FUSED_DOWN_MAX_SLOTS];
    RouteGateUpStart st = {};
    st.ring = one_token_ring(stream_smem, bars, stages, K);
    StreamRing& ring = st.ring;
    ring.norm_bar = smem_u32(&norm_bar);
    ring.norm_s = (const float*)(stream_smem + ((long long)stages * 8 + 2) * ring.row_bytes);
    st.rank = (int)cluster_rank();
    st.C = (int)cluster_blocks();
    int router_cbs = (router_n + 7) / 8;
    st.nr = st.rank < router_cbs ? (router_cbs - 1 - st.rank) / st.C + 1 : 0;
    st.gu_cbs = 2 * inter / 8;
    int gu_total = (k + 1) * st.gu_cbs;
    st.n_gu = (int)blockIdx.x < gu_total ? (gu_total - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    st.gu_epi.mode = EPI_SWIGLU;
    st.red = red;
    st.logits = logits_s;
    st.expert_w = expert_w;
    st.slot_row = slot_row;
    st.routing_published = &routing_published;
    st.chosen_expert = chosen_expert;
    st.chosen_bars = smem_u32(chosen_bars);
    if (threadIdx.x == 0) {
        mbar_init(ring.norm_bar, 1);
        for (int s = 0; s < k; ++s) mbar_init(st.chosen_bars + 8 * s, 1);
        mbar_init_fence();
        routing_published = 0;
    }
    if ((int)threadIdx.x <= k) slot_row[threadIdx.x] = threadIdx.x;
    __syncthreads();
    cluster_arrive_relaxed();
    if ((int)(threadIdx.x >> 5) == KSLICES) {
        if ((threadIdx.x & 31) == 0) {
            mbar_arrive_expect_tx(ring.norm_bar, 4u * (u32)K);
            bulk_copy_weights(smem_u32(ring.norm_s), norm_w, 4u * (u32)K, ring.norm_bar);
        }
        for (int i = 0; i < st.nr; ++i) {
            if (i >= stages) mbar_wait(ring.empty + 8 * (i % stages), (u32)((i / stages - 1) & 1));
            stream_issue<1>(ring, router_w, router_n, K, (st.rank + st.C * i) * 8, i % stages, router_epi);
        }
    } else if ((int)(threadIdx.x >> 5) < KSLICES) {
        for (int e = threadIdx.x; e < E; e += 32 * KSLICES) expert_w[e] = (const bf16_t*)load_l2(table + 2 * e);
    } else {
        // The warm-up warp: the cluster barrier's phases as the producer takes them (it never
        // waits on phase 1), then the routing's code with the norm weight for logits (a
        // weight, readable before the wait) and its choices into scratch, nowhere else.
        cluster_wait();
        cluster_arrive_relaxed();
        if (ROUTE_WARM) {
            __shared__ int warm_idx[FUSED_DOWN_MAX_SLOTS];
            __shared__ float warm_w[FUSED_DOWN_MAX_SLOTS];
            route_gate_up_routing(norm_w, true, warm_idx, warm_w, min(E, K), k, renormalize, nullptr, 0u);
        }
    }
    return st;
}

// One token through the MoE's router (`router_w`, router_n = E + 1 rows: the experts, then the
// shared expert's gate; input norm `norm_w` applied to the residual row `resid` exactly as
// matmul_router_stream does), its routing (route_token: topk_idx and topk_w, written by every
// block, the same values) and the gate/up products with SwiGLU of its k routed experts and the
// shared expert (weight table [E + 1][hi, lo], the shared expert last) into `act`'s rows 0..k
// (slot s < k: routed expert s; slot k: the shared expert), bitwise those of the grouped
// gate/up launch. The router's outputs go to `router_epi`'s parts (written by the first
// cluster). Gate/up item j of block b is column block idx = b + j * gridDim.x of the slots in
// the order shared, 0 .. k-1, so the shared expert's weights, known before the routing, are
// copied first, while the router runs. `ahead`: weights of later launches to pull into L2
// (L2Ahead).
//
// The next launch (moe_down_combine) reads topk_idx before its own wait: the blocks let it
// launch only after their routing is written and fenced, and it checks the experts again after
// its wait. Dynamic shared memory: the ring (stages * 8 rows of 2K bytes), the split row (2
// rows), the norm weight (K floats); stages >= 2.
extern "C" __global__ void __launch_bounds__(ROUTE_GATE_UP_THREADS) moe_route_gate_up(float* act, const float* resid, const bf16_t* router_w, int router_n, int K,
        Epilogue router_epi, const float* norm_w, float eps, const u64* table, int E, int k, int renormalize, int inter, int* topk_idx, float* topk_w,
        int stages, L2Ahead ahead) {
    RouteGateUpStart st = route_gate_up_start(router_w, router_n, K, router_epi, norm_w, table, E, k, renormalize, inter, stages);
    wait_for_inputs_holding_dependents();
    const StreamRing& ring = st.ring;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    if (warp == ROUTE_WARM_WARP) return;
    int rank = st.rank, C = st.C, nr = st.nr, n_gu = st.n_gu, gu_cbs = st.gu_cbs, gu_n = 2 * inter;
    const Epilogue& gu_epi = st.gu_epi;
    float* logits_s = st.logits;
    if (warp == KSLICES) {
        // The producer, its router copies issued: the shared expert's column blocks, then each
        // routed slot's as soon as the routing warp's round has chosen its expert (the first
        // copies go out before the rounds are done). Phase 1 of the cluster barrier (the logits
        // exchange) needs nothing from this warp; arriving before the gate/up copies keeps it
        // from waiting on stages only the exchange frees.
        cluster_wait();
        cluster_arrive_relaxed();
        // The next input projection's last weight rows into L2 (`ahead`), at the start of the
        // routing window, when only the router's and the shared expert's copies are in flight:
        // that launch then reads them from L2 after its wait (35B-A3B decode on the H100:
        // 3.239-3.272 ms per step with 20 MiB, 3.306-3.330 without; issued later, once the
        // routing had chosen, they held back the routed experts' copies instead).
        if (lane == 0) l2_prefetch_ahead(ahead);
        bool launched = false;
        for (int j = 0, i = nr; j < n_gu; ++j, ++i) {
            int idx = blockIdx.x + j * gridDim.x, p = idx / gu_cbs, n0 = (idx % gu_cbs) * 8;
            if (i >= stages) mbar_wait(ring.empty + 8 * (i % stages), (u32)((i / stages - 1) & 1));
            const bf16_t* w;
            if (p == 0) {
                w = (const bf16_t*)load_l2(table + 2 * E);
            } else {
                mbar_wait(st.chosen_bars + 8 * (p - 1), 0u);
                w = st.expert_w[st.chosen_expert[p - 1]];
            }
            stream_issue<1>(ring, w, gu_n, K, n0, i % stages, gu_epi);
            if (!launched && *st.routing_published) {
                let_dependents_launch();
                launched = true;
            }
        }
        return;
    }
    int xstride = ring.row_bytes / 2;
    bf16_t* xs = (bf16_t*)(ring.stage0 + (long long)stages * 8 * ring.row_bytes);
    stream_norm_rows(resid, 0, 1, K, ring, eps, 0, xs, xstride);
    k_slices_sync();
    if (threadIdx.x == 0 && blockIdx.x == 0) TRACE_MARK(TRACE_ROWS_READY);
    const bf16_t* h0 = g == 0 ? xs : 0;
    int nkb = K / 32, kps = (nkb + KSLICES - 1) / KSLICES;
    int kb0 = warp * kps, kb1 = min(kb0 + kps, nkb);
    cluster_wait();
    Group one_row = {0, 0, 1, 0};
    int i = 0, pass = 0;
    float t[RGU_MAX_PASS][4];
    for (; i < nr; ++pass) {
        // The router's column blocks land together: all of a block's share in one pass.
        int n = min(RGU_MAX_PASS, nr - i);
        if (n == 3) one_row_column_blocks<3>(ring, i, pass, router_epi, h0, kb0, kb1, st.red, t);
        else if (n == 2) one_row_column_blocks<2>(ring, i, pass, router_epi, h0, kb0, kb1, st.red, t);
        else one_row_column_blocks<1>(ring, i, pass, router_epi, h0, kb0, kb1, st.red, t);
        // The column blocks' logits into this block's copy, then (lane r) into block r's.
        if (warp == 0) {
            for (int j = 0; j < n; ++j) {
                int cb = rank + C * (i + j);
                if (g == 0) {
                    logits_s[cb * 8 + 2 * q] = t[j][0];
                    logits_s[cb * 8 + 2 * q + 1] = t[j][1];
                    if ((int)blockIdx.x < C) store_fragment(router_epi, 0, one_row, router_n, g, cb * 8 + 2 * q, t[j]);
                }
                __syncwarp();
                if (lane < C && lane != rank) {
                    const float4* v = (const float4*)&logits_s[cb * 8];
                    store4_in_cluster_block(&logits_s[cb * 8], lane, v[0]);
                    store4_in_cluster_block(&logits_s[cb * 8 + 4], lane, v[1]);
                }
            }
        }
        i += n;
    }
    // Phase 1: every block's logits are here.
    cluster_arrive_release();
    cluster_wait();
    if (warp == ROUTE_WARP) {
        // Each round's expert goes to the producer as it is chosen (chosen_expert and its
        // barrier); the routing's global writes come after the last round, and their fence (for
        // the next launch, which reads them before its wait) is off the producer's path.
        route_gate_up_routing(logits_s, false, topk_idx, topk_w, E, k, renormalize, st.chosen_expert, st.chosen_bars);
        if (lane == 0 && blockIdx.x == 0) TRACE_MARK(TRACE_GROUP_KNOWN);
        __threadfence();
        if (lane == 0) *st.routing_published = 1;
    }
    // Every thread lets the next launch start only once the routing is written and fenced:
    // after the first pass's barrier (the routing warp fenced before it), or after one of its own.
    if (n_gu == 0) k_slices_sync();
    if (n_gu == 0) let_dependents_launch();
    for (int j0 = 0; j0 < n_gu; ++pass) {
        int n = min(RGU_PASS, n_gu - j0);
        if (n == 2) one_row_column_blocks<2>(ring, i, pass, gu_epi, h0, kb0, kb1, st.red, t);
        else one_row_column_blocks<1>(ring, i, pass, gu_epi, h0, kb0, kb1, st.red, t);
        if (j0 == 0) let_dependents_launch();
        if (j0 == 0 && threadIdx.x == 0 && blockIdx.x == 0) TRACE_MARK(TRACE_FIRST_DATA);
        if (warp == 0) {
            for (int j = 0; j < n; ++j) {
                int idx = blockIdx.x + (j0 + j) * gridDim.x, p = idx / gu_cbs, n0 = (idx % gu_cbs) * 8;
                Group row = {0, 0, 1, &st.slot_row[p == 0 ? k : p - 1]};
                store_fragment(gu_epi, act, row, gu_n, g, n0 + 2 * q, t[j]);
            }
        }
        i += n;
        j0 += n;
    }
    if (threadIdx.x == 0) TRACE_MARK(TRACE_BLOCK_END);
}
