// Few rows with the weights streamed through shared memory (sm_90 bulk copies). Compiled in the
// matmul module after cuda/matmul.cu, whose fragments, groups and stores it uses.
//
// matmul_small_body's arithmetic (warp w < KSLICES owns k-slice w, the slices are added through
// shared memory in slice order), but the weights arrive by bulk copy: an extra producer warp
// copies each column block's weight rows into a ring of `stages` shared-memory stages and the
// k-slice warps read them from there. A block keeps whole column blocks in flight without
// spending registers on them, keeps copying while its warps add up the last column block, and
// (plain launches) copies its first stages before its inputs are ready; it splits its
// activation rows into bf16 halves once, where the small-row kernel converts them again for
// every column block. One m tile (up to 16 rows), bf16 weights, K a multiple of 32.

#define STREAM_THREADS (32 * (KSLICES + 1))
#define STREAM_MAX_STAGES 8
// Stages a block fills before its inputs are ready. One: the kernel before is often short
// and bound by its chain of loads, and every block's whole ring copied at once queues those
// loads behind megabytes of weights (H100, 35B-A3B decode: 3.93 ms per step against 3.97
// with all stages early; `KESTREL_CUDA_DEFINES=STREAM_EARLY_STAGES=n` for A/B runs).
#ifndef STREAM_EARLY_STAGES
#define STREAM_EARLY_STAGES 1
#endif
// Stages a block keeps in flight while it goes on filling the ring before its inputs are ready
// (stream_start; 0: it stops after the early stages). `KESTREL_CUDA_DEFINES=STREAM_EARLY_PACED=n`
// for A/B runs.
#ifndef STREAM_EARLY_PACED
#define STREAM_EARLY_PACED 1
#endif

// Whether a stage's weight rows are padded in shared memory (1) or copied whole (0, the
// default). Padded rows keep a warp's fragment loads on distinct banks but take one bulk copy
// per row (1 KB each at K = 512); unpadded, a stage's runs of consecutive rows go in one or two
// copies, and the fragment loads of two rows share banks (two-way conflicts). On the H100,
// unpadded: 9b decode 6.29, 6.28 against 6.45, 6.48 ms per step; 35B-A3B and 0.8b unchanged.
// The host sizes rings for padded rows, so either fits. `KESTREL_CUDA_DEFINES=STREAM_ROW_PAD=1`
// for A/B runs.
#ifndef STREAM_ROW_PAD
#define STREAM_ROW_PAD 0
#endif

// sm_90 instructions; the backend launches the streaming kernels only there (elsewhere these
// trap, so that a launch by mistake cannot pass silently).
#if __CUDA_ARCH__ >= 900
#define SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define SM90_ASM(...) __trap()
#endif

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    SM90_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Whether the barrier's phase of parity `parity` has completed (without waiting).
__device__ __forceinline__ bool mbar_done(u32 bar, u32 parity) {
    u32 done = 1;
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
#endif
    return done != 0;
}
// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    SM90_ASM("{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n @!done bra WAIT;\n}" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
    SM90_ASM("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// `bytes` from global `src` to shared `dst`, counted on barrier `bar`; the weights go first
// out of L2, as ldg_stream's do.
__device__ __forceinline__ void bulk_copy_weights(u32 dst, const void* src, u32 bytes, u32 bar) {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    SM90_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar),
             "l"(policy)
             : "memory");
}

// The ring of one block: stage s holds 8 * NT weight rows of `row_bytes` each (2K bytes of
// data; with STREAM_ROW_PAD padded so that the rows of a warp's 16-byte loads fall on different
// banks, see stage_slot for their order); full[s] completes when its copies have landed,
// empty[s] when the k-slice warps are done with it.
struct StreamRing {
    unsigned char* stage0;
    u32 full, empty;
    int stages, row_bytes, issued;
    // The weights the producer started copying before the inputs were ready (0: none).
    const bf16_t* early_w;
    // Set by thread 0 once the block's inputs are ready (stream_inputs_ready).
    volatile int* inputs_ready;
    // The RMSNorm weight of a normalizing launch, copied into shared memory after the split
    // rows before the inputs are ready (null: none), and its barrier.
    const float* norm_s;
    u32 norm_bar;
};

// Where logical column c (0 .. 8NT-1) of a column block sits in its stage: in order, or (whole
// unpadded copies of SwiGLU's gate and up runs) the gate rows first, then the up rows.
template <int NT>
__device__ __forceinline__ int stage_slot(const Epilogue& e, int c) {
    return STREAM_ROW_PAD == 0 && e.mode == EPI_SWIGLU ? (c >> 1) + (c & 1) * 4 * NT : c;
}

// The producer warp's copies of column block n0 (logical columns n0 .. n0 + 8NT - 1; past N
// they repeat row N-1, whose results are never written) into stage s.
template <int NT>
__device__ __forceinline__ void stream_issue(const StreamRing& r, const bf16_t* w, int N, int K, int n0, int s, const Epilogue& e) {
    int lane = threadIdx.x & 31;
    u32 bar = r.full + 8 * s;
    if (lane == 0) mbar_arrive_expect_tx(bar, 8u * NT * 2u * (u32)K);
    __syncwarp();
    unsigned char* stage = r.stage0 + (long long)(s * 8 * NT) * r.row_bytes;
    if (STREAM_ROW_PAD == 0 && n0 + 8 * NT <= N) {
        // Whole runs of consecutive weight rows: SwiGLU's gate rows n0/2 .. and up rows
        // N/2 + n0/2 .., else rows n0 ...
        if (e.mode == EPI_SWIGLU) {
            if (lane < 2) bulk_copy_weights(smem_u32(stage + (long long)lane * 4 * NT * r.row_bytes), w + ((long long)(n0 >> 1) + lane * (N >> 1)) * K, 4u * NT * 2u * (u32)K, bar);
        } else if (lane == 0) {
            bulk_copy_weights(smem_u32(stage), w + (long long)n0 * K, 8u * NT * 2u * (u32)K, bar);
        }
        return;
    }
    if (lane < 8 * NT) {
        const bf16_t* src = w + weight_row(e, min(n0 + lane, N - 1), N) * K;
        bulk_copy_weights(smem_u32(stage + (long long)stage_slot<NT>(e, lane) * r.row_bytes), src, 2u * (u32)K, bar);
    }
}

// The ring's barriers, and (weights known before the inputs: a plain launch, or a grouped one
// whose routing is two or more launches back, see prefetch_small) the producer's first
// STREAM_EARLY_STAGES column blocks, all before the block waits for its inputs: weight rows
// land in shared memory while the previous kernel finishes.
template <int NT>
__device__ __forceinline__ StreamRing stream_start(const bf16_t* whi, int N, int K, const u64* group_w, const int* active, int lists_ready, int stages, const Epilogue& e,
        const float* norm_w, int rows) {
    extern __shared__ __align__(128) unsigned char stream_smem[];
    __shared__ __align__(8) u64 bars[2 * STREAM_MAX_STAGES];
    __shared__ __align__(8) u64 norm_bar;
    StreamRing r;
    r.stage0 = stream_smem;
    r.full = smem_u32(bars);
    r.empty = r.full + 8 * STREAM_MAX_STAGES;
    r.stages = stages;
    // 2K bytes, plus 64 with STREAM_ROW_PAD when 2K is a multiple of 128: rows then start 64
    // bytes apart in the banks, and the two rows of a quarter-warp's 16-byte loads cover all 32
    // banks.
    r.row_bytes = 2 * K + (STREAM_ROW_PAD && (2 * K) % 128 == 0 ? 64 : 0);
    r.issued = 0;
    r.norm_bar = smem_u32(&norm_bar);
    r.norm_s = norm_w ? (const float*)(stream_smem + ((long long)stages * 8 * NT + 2LL * rows) * r.row_bytes) : 0;
    __shared__ const bf16_t* early_w;
    __shared__ int inputs_ready;
    r.inputs_ready = &inputs_ready;
    if (threadIdx.x == 0) {
        inputs_ready = 0;
        for (int s = 0; s < stages; ++s) {
            mbar_init(r.full + 8 * s, 1);
            mbar_init(r.empty + 8 * s, KSLICES);
        }
        mbar_init(r.norm_bar, 1);
        mbar_init_fence();
        early_w = 0;
        if (!group_w) early_w = whi;
        else if (lists_ready && (int)blockIdx.z < load_l2(active)) early_w = (const bf16_t*)load_l2(group_w + 2 * load_l2(active + 1 + blockIdx.z));
    }
    __syncthreads();
    r.early_w = early_w;
    if ((int)(threadIdx.x >> 5) != KSLICES) return r;
    // The norm weight first: the rows wait for it after their sums, the stages only later.
    if (r.norm_s && (threadIdx.x & 31) == 0) {
        mbar_arrive_expect_tx(r.norm_bar, 4u * (u32)K);
        bulk_copy_weights(smem_u32(r.norm_s), norm_w, 4u * (u32)K, r.norm_bar);
    }
    if (!r.early_w) return r;
    int n0 = blockIdx.x * 8 * NT, stride = gridDim.x * 8 * NT;
    for (; n0 < N && r.issued < min(stages, STREAM_EARLY_STAGES); n0 += stride) stream_issue<NT>(r, r.early_w, N, K, n0, r.issued++, e);
    // While the inputs are not ready, the rest of the ring, paced: a stage is issued once the
    // one STREAM_EARLY_PACED before it has landed, so that each block has that many stages in
    // flight and the kernel before, which may be bound by its chain of loads, does not wait
    // behind a burst of weight copies (every block's whole ring at once made 35B-A3B's decode
    // step slower, see STREAM_EARLY_STAGES). Lane 0 decides for the warp.
    while (STREAM_EARLY_PACED && r.issued > 0 && n0 < N && r.issued < stages) {
        int go = 0;
        if ((threadIdx.x & 31) == 0) {
            for (;;) {
                if (*r.inputs_ready) break;
                if (r.issued < STREAM_EARLY_PACED || mbar_done(r.full + 8 * (r.issued - STREAM_EARLY_PACED), 0)) {
                    go = 1;
                    break;
                }
                asm volatile("nanosleep.u32 100;");
            }
        }
        if (!__shfl_sync(FULL_MASK, go, 0)) break;
        stream_issue<NT>(r, r.early_w, N, K, n0, r.issued++, e);
        n0 += stride;
    }
    return r;
}

// Tells the producer warp, which may still be copying stages ahead, that the block's inputs
// are ready: from then on the ring is refilled as the k-slice warps empty it. Called by every
// thread after wait_for_inputs.
__device__ __forceinline__ void stream_inputs_ready(const StreamRing& r) {
    if (threadIdx.x == 0) *r.inputs_ready = 1;
}

// Barrier of the k-slice warps only (named barrier 1; the producer warp is not part of it).
__device__ __forceinline__ void k_slices_sync() { asm volatile("bar.sync 1, %0;" ::"n"(32 * KSLICES) : "memory"); }

// Sum over the 256 threads of the k-slice warps (the producer warp is busy elsewhere):
// block_sum's arithmetic at 256 threads.
__device__ __forceinline__ float k_slices_sum(float v, float* scratch) {
    return warps_sum(v, scratch, KSLICES, [] { k_slices_sync(); });
}

// The rows a plain launch starts from, normalized in registers by the norm weight (its copy at
// `ring.norm_s`, which stream_start asked for before the inputs were ready: loaded after the
// sums, it was a round trip to memory in every layer's chain) and split into the bf16 halves
// at `xs`: the rows of x, or (`mc` given) the residual rows plus the MoE's sum
// (moe_combined4). Each k-slice thread keeps float4s threadIdx.x + i * 256 (K a multiple of 4,
// at most RMS_VECS float4s per thread), so the sums, the reduction tree and the expression are
// rms_norm_row_registers' at its 256 threads: the same bits as the row norm (after
// moe_combine_norm's sum), then the split. The first block stores the normalized rows to
// `normed` and the updated residual rows to `mc->resid_out` (where given).
__device__ __forceinline__ void stream_norm_rows(const float* x, const MoeCombine* mc, int rows, int K, const StreamRing& ring, float eps, float* normed, bf16_t* xs, int xstride) {
    __shared__ float scratch[33];
    int nvec = K >> 2;
    for (int t = 0; t < rows; ++t) {
        float scale = mc && mc->shared ? shared_scale(mc->shared_gate, t) : 1.0f;
        const float4* row = (const float4*)((mc ? mc->resid : x) + (long long)t * K);
        float4 v[RMS_VECS];
#pragma unroll
        for (int i = 0; i < RMS_VECS; ++i) {
            int c = threadIdx.x + i * 32 * KSLICES;
            float4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
            v[i] = c >= nvec ? zero : mc ? moe_combined4(row[c], mc->y, mc->topk_w, mc->shared, scale, t, c, K, mc->k, mc->slots, mc->shared_stride) : row[c];
        }
        float ss = k_slices_sum(rms_partial(v), scratch);
        float inv = 1.0f / sqrtf(ss / (float)K + eps);
        if (t == 0) mbar_wait(ring.norm_bar, 0);
#pragma unroll
        for (int i = 0; i < RMS_VECS; ++i) {
            int c = threadIdx.x + i * 32 * KSLICES;
            if (c >= nvec) continue;
            float4 wv = ((const float4*)ring.norm_s)[c];
            float4 n4 = {v[i].x * inv * wv.x, v[i].y * inv * wv.y, v[i].z * inv * wv.z, v[i].w * inv * wv.w};
            if (blockIdx.x == 0 && mc && mc->resid_out) ((float4*)(mc->resid_out + (long long)t * K))[c] = v[i];
            if (blockIdx.x == 0 && normed) ((float4*)(normed + (long long)t * K))[c] = n4;
            float n[8] = {n4.x, n4.y, n4.z, n4.w, 0.0f, 0.0f, 0.0f, 0.0f};
            u32 hi[4];
            round8(n, hi);
            *(uint2*)(xs + (long long)t * xstride + 4 * c) = make_uint2(hi[0], hi[1]);
        }
    }
}

// What a streaming launch does to its activation rows before splitting them.
#define STREAM_INPUT_PLAIN 0
// RMS-normalized by `norm_w` (when given) by stream_norm_rows, which also stores the normalized
// rows to `normed` (where given; ungrouped launches only).
#define STREAM_INPUT_NORM 1
// The MoE's sum into the residual rows (`mc`), normalized by stream_norm_rows (ungrouped
// launches only).
#define STREAM_INPUT_COMBINE 2

template <int NT, int INPUT>
__device__ __forceinline__ void matmul_stream_body(const StreamRing& ring, float* out, const float* x, const bf16_t* whi_, int rows, int N, int K, const u64* group_w,
        const int* counts, const int* lists, int list_stride, int a_div, const int* active, const Epilogue& epi, const float* norm_w, float eps, float* normed,
        const MoeCombine* mc) {
    // Two reduction buffers, alternating by column block: one barrier per column block, and
    // warp 0 adds up and stores one column block while the others start on the next.
    __shared__ float red[2][KSLICES][NT][32][4];
    Group grp = group_of(whi_, 0, rows, group_w, counts, lists, list_stride, active);
    // The early copies must be of this group's weights: the routing two launches back was
    // complete when this kernel started. Should that ever not hold, stop loudly rather than
    // multiply by another expert's weights.
    if (ring.early_w && ring.early_w != grp.whi) __trap();
    // Inactive slices of a grouped launch (nothing was issued for them).
    if (grp.rows <= 0) return;
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.z == 0) TRACE_MARK(TRACE_GROUP_KNOWN);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int per = 8 * NT, stride = gridDim.x * per, S = ring.stages;
    if (warp == KSLICES) {
        int i = 0;
        for (int n0 = blockIdx.x * per; n0 < N; n0 += stride, ++i) {
            if (i < ring.issued) continue;
            int s = i % S;
            if (i >= S) mbar_wait(ring.empty + 8 * s, (u32)((i / S - 1) & 1));
            stream_issue<NT>(ring, grp.whi, N, K, n0, s, epi);
        }
        return;
    }
    // The group's activation rows rounded to bf16 once, into shared memory after the ring
    // (rows of K values plus the weight rows' pad; where rows are padded, a warp's fragment
    // loads fall on distinct banks). The k loop then loads ready fragments, as the pre-rounded
    // kernels do, instead of converting the activations again for every column block. (The
    // area the launch sizes still holds twice these rows, the room the lo halves of the
    // former two-mma split took.)
    int xstride = ring.row_bytes / 2;
    bf16_t* xs = (bf16_t*)(ring.stage0 + (long long)S * per * ring.row_bytes);
    // Rows normalized on the way in: in registers, by stream_norm_rows.
    bool norm_in = INPUT == STREAM_INPUT_COMBINE || (INPUT == STREAM_INPUT_NORM && norm_w);
    if (norm_in) stream_norm_rows(x, mc, grp.rows, K, ring, eps, normed, xs, xstride);
    // ROW_BATCH chunks of 8 per thread loaded before any is split and stored: the stores to
    // shared memory would otherwise keep the next chunk's loads from being issued early, and a
    // wide row (K = 12288: six chunks per thread) would take six round trips.
    const int ROW_BATCH = 4;
    for (int c0 = threadIdx.x; !norm_in && c0 < grp.rows * (K / 8); c0 += ROW_BATCH * 32 * KSLICES) {
        float v[ROW_BATCH][8];
#pragma unroll
        for (int b = 0; b < ROW_BATCH; ++b) {
            int c = c0 + b * 32 * KSLICES;
            if (c >= grp.rows * (K / 8)) break;
            int r = c / (K / 8), k = (c % (K / 8)) * 8;
            load8_f32(x + (long long)(grp.list ? grp.list[r] / a_div : r) * K, k, K, true, v[b]);
        }
#pragma unroll
        for (int b = 0; b < ROW_BATCH; ++b) {
            int c = c0 + b * 32 * KSLICES;
            if (c >= grp.rows * (K / 8)) break;
            int r = c / (K / 8), k = (c % (K / 8)) * 8;
            u32 hi[4];
            round8(v[b], hi);
            *(uint4*)(xs + (long long)r * xstride + k) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        }
    }
    k_slices_sync();
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.z == 0) TRACE_MARK(TRACE_ROWS_READY);
    const bf16_t* h0 = g < grp.rows ? xs + (long long)g * xstride : 0;
    const bf16_t* h1 = g + 8 < grp.rows ? xs + (long long)(g + 8) * xstride : 0;
    bool two = 8 < grp.rows;
    int nkb = K / 32, kps = (nkb + KSLICES - 1) / KSLICES;
    int kb0 = warp * kps, kb1 = min(kb0 + kps, nkb);
    const uint4 zero[NT] = {};
    int i = 0;
    for (int n0 = blockIdx.x * per; n0 < N; n0 += stride, ++i) {
        int s = i % S;
        float c[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
        mbar_wait(ring.full + 8 * s, (u32)((i / S) & 1));
        if (i == 0 && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.z == 0) TRACE_MARK(TRACE_FIRST_DATA);
        const unsigned char* st = ring.stage0 + (long long)s * per * ring.row_bytes + q * 16;
        for (int kb = kb0; kb < kb1; ++kb) {
            uint4 bh[NT];
#pragma unroll
            for (int j = 0; j < NT; ++j) bh[j] = *(const uint4*)(st + (long long)stage_slot<NT>(epi, j * 8 + g) * ring.row_bytes + kb * 64);
            small_kblock_rounded<NT>(c, h0, h1, two, kb * 32 + q * 8, bh, zero);
        }
        // This warp's reads of the stage are done: the producer may refill it.
        __syncwarp();
        if (lane == 0) mbar_arrive(ring.empty + 8 * s);
        // Buffer i & 1 was last read by warp 0 for column block i - 2, before it reached the
        // barrier of column block i - 1, which this warp has passed.
        float (*rb)[NT][32][4] = red[i & 1];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) rb[warp][j][lane][e] = c[j][e];
        k_slices_sync();
        if (warp == 0) {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int w = 0; w < KSLICES; ++w)
#pragma unroll
                    for (int e = 0; e < 4; ++e) t[e] += rb[w][j][lane][e];
                store_fragment(epi, out, grp, N, g, n0 + j * 8 + 2 * q, t);
            }
        }
    }
    if (threadIdx.x == 0) TRACE_MARK(TRACE_BLOCK_END);
}

// Arguments: the small-row kernels', then the ring's stage count. Dynamic shared memory: the
// ring (stages * 8 * NT rows of 2K bytes, padded as in stream_start), then the split
// activations (2 * rows rows of K bf16, padded alike).
#define STREAM_KERNEL(NAME, NT)                                                                                                                      \
    extern "C" __global__ void __launch_bounds__(STREAM_THREADS) NAME(float* out, const float* x, const bf16_t* whi, const bf16_t* wlo, int rows, int N, int K, \
            const u64* group_w, const int* counts, const int* lists, int list_stride, int a_div, const int* active, long long lo_off, Epilogue epi,     \
            int lists_ready, int stages) {                                                                                                            \
        StreamRing ring = stream_start<NT>(whi, N, K, group_w, active, lists_ready, stages, epi, 0, rows);                                           \
        wait_for_inputs();                                                                                                                           \
        stream_inputs_ready(ring);                                                                                                                   \
        matmul_stream_body<NT, STREAM_INPUT_PLAIN>(ring, out, x, whi, rows, N, K, group_w, counts, lists, list_stride, a_div, active, epi, 0, 0.0f, 0, 0); \
    }
STREAM_KERNEL(matmul_stream_nt1, 1)
STREAM_KERNEL(matmul_stream_nt2, 2)
STREAM_KERNEL(matmul_stream_nt4, 4)

// A plain streaming launch that normalizes its rows itself (stream_norm_rows): the rows of the
// residual stream `mc.resid` (matmul_stream_norm_*), or those plus the MoE's sum, written to
// `mc.resid_out` (matmul_stream_combine_*), RMS-normalized by `norm_w`. The layer's norm (and
// the MoE's last pass) cost no launch of their own, and the weights stream in while the rows
// are made. Two families rather than a run-time switch: the sum's registers and branches cost
// the plain norm 1 µs per launch on the H100. Arguments: the plain streaming kernel's, less the
// activations and the grouping, then the rows, the norm's weight and epsilon. Dynamic shared
// memory as the plain kernel's, then the norm weight (K floats); two blocks per SM, as the
// plain kernel has (the row sums' registers would otherwise take one).
#define STREAM_NORM_KERNEL(NAME, NT, INPUT)                                                                                                          \
    extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 2) NAME(float* out, const bf16_t* whi, int rows, int N, int K, Epilogue epi, int stages, \
            MoeCombine mc, const float* norm_w, float eps) {                                                                                          \
        StreamRing ring = stream_start<NT>(whi, N, K, 0, 0, 0, stages, epi, norm_w, rows);                                                          \
        wait_for_inputs();                                                                                                                           \
        stream_inputs_ready(ring);                                                                                                                   \
        matmul_stream_body<NT, INPUT>(ring, out, mc.resid, whi, rows, N, K, 0, 0, 0, 0, 1, 0, epi, norm_w, eps, 0, INPUT == STREAM_INPUT_COMBINE ? &mc : 0); \
    }
STREAM_NORM_KERNEL(matmul_stream_norm_nt1, 1, STREAM_INPUT_NORM)
STREAM_NORM_KERNEL(matmul_stream_norm_nt2, 2, STREAM_INPUT_NORM)
STREAM_NORM_KERNEL(matmul_stream_norm_nt4, 4, STREAM_INPUT_NORM)
STREAM_NORM_KERNEL(matmul_stream_combine_nt1, 1, STREAM_INPUT_COMBINE)
STREAM_NORM_KERNEL(matmul_stream_combine_nt2, 2, STREAM_INPUT_COMBINE)
STREAM_NORM_KERNEL(matmul_stream_combine_nt4, 4, STREAM_INPUT_COMBINE)

// Weights the launches after a router stream, pulled into L2 by the router's blocks while its
// chain runs: its norm, matmul, count and routing are latencies with the memory idle, since
// the routed experts' weights are not known before it ends. The streaming router takes the
// shared expert's (gate/up, then down); moe_route_gate_up the next input projection's last
// rows. Zero bytes: none.
struct L2Ahead {
    const unsigned char* ptr[2];
    long long bytes[2];
};

// This block's share of each range, in 16-byte aligned pieces of up to 64 KB.
__device__ __forceinline__ void l2_prefetch_ahead(const L2Ahead& a) {
    const long long piece = 64 * 1024;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        long long share = ((a.bytes[i] + gridDim.x - 1) / gridDim.x + 15) & ~15LL;
        long long lo = share * blockIdx.x, hi = min(a.bytes[i], lo + share);
        for (long long o = lo; o < hi; o += piece) {
            u32 n = (u32)min(piece, hi - o) & ~15u;
            if (n > 0) bulk_prefetch_l2(a.ptr[i] + o, n);
        }
    }
}

// matmul_router with the weights streamed (matmul_stream_nt1's arithmetic, the same logits):
// the router's rows land in shared memory while the kernel before it runs. Arguments:
// matmul_router's, then (norm_w non-null) the RMSNorm the router's input still needs: x is
// then the residual stream, normalized here exactly as rms_norm_rows would (the first block
// stores the rows to `normed` for the experts), then the weights to pull into L2. One launch
// fewer per layer, and the router is resident, copying its weights, while the output
// projection runs. Dynamic shared memory the larger of the ring's (with the norm weight after
// the split rows) and the routing's.
extern "C" __global__ void __launch_bounds__(STREAM_THREADS) matmul_router_stream(float* out, const float* x, const bf16_t* whi, const bf16_t* wlo, int rows, int N,
        int K, Epilogue epi, int stages, unsigned* done, int* topk_idx, float* topk_w, const float* logits, int T, int E, int k, int renormalize, int* lists,
        int* counts, int* active, int slots, int fold, const float* norm_w, float eps, float* normed, L2Ahead ahead) {
    StreamRing ring = stream_start<1>(whi, N, K, 0, 0, 0, stages, epi, norm_w, rows);
    wait_for_inputs();
    stream_inputs_ready(ring);
    // The producer warp (its one stage was issued before the wait) issues the prefetches, after
    // the wait: issued before it, they ran beside the output projection's tail and made the step
    // slower in two of three runs.
    if (threadIdx.x == 32 * KSLICES) l2_prefetch_ahead(ahead);
    matmul_stream_body<1, STREAM_INPUT_NORM>(ring, out, x, whi, rows, N, K, 0, 0, 0, 0, 1, 0, epi, norm_w, eps, normed, 0);
    // The producer warp left the body early; every warp takes part in the count.
    route_in_last_block(done, topk_idx, topk_w, logits, T, E, k, renormalize, lists, counts, active, slots, fold);
}
