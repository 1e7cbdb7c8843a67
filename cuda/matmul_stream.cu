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
__device__ __forceinline__ void stream_norm_rows(const float* x, const MoeCombine* mc, int rows, int K, const StreamRing& ring, float eps, float* normed, bf16_t* xs, int xstride,
        long long lo_off) {
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
            u32 hi[4], lo[4];
            split8(n, hi, lo);
            *(uint2*)(xs + (long long)t * xstride + 4 * c) = make_uint2(hi[0], hi[1]);
            *(uint2*)(xs + lo_off + (long long)t * xstride + 4 * c) = make_uint2(lo[0], lo[1]);
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
    // The group's activation rows split into bf16 hi and lo halves once, into shared memory
    // after the ring (rows of K values plus the weight rows' pad, the lo rows `lo_off` values
    // after the hi rows; where rows are padded, a warp's fragment loads fall on distinct
    // banks). The k loop then loads ready fragments, as the pre-split kernels do, instead of
    // converting the activations again for every column block.
    int xstride = ring.row_bytes / 2;
    long long lo_off = (long long)rows * xstride;
    bf16_t* xs = (bf16_t*)(ring.stage0 + (long long)S * per * ring.row_bytes);
    // Rows normalized on the way in: in registers, by stream_norm_rows.
    bool norm_in = INPUT == STREAM_INPUT_COMBINE || (INPUT == STREAM_INPUT_NORM && norm_w);
    if (norm_in) stream_norm_rows(x, mc, grp.rows, K, ring, eps, normed, xs, xstride, lo_off);
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
            u32 hi[4], lo[4];
            split8(v[b], hi, lo);
            *(uint4*)(xs + (long long)r * xstride + k) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
            *(uint4*)(xs + lo_off + (long long)r * xstride + k) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
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
            small_kblock_split<NT>(c, h0, h1, lo_off, two, kb * 32 + q * 8, bh, zero);
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

// The shared expert's weights (gate/up, then down), which the launches after the router
// stream, pulled into L2 by the router's blocks while its chain runs: its norm, matmul, count
// and routing are latencies with the memory idle, since the routed experts' weights are not
// known before it ends. Zero bytes: none.
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
// What moe_down_combine does before its inputs are ready: its ring, each slot's weights (the
// routing is complete once this kernel runs: two launches back, the gate/up launch between
// waited for it before it let this one start; or written by moe_route_gate_up just before,
// which lets this one start only after its blocks wrote and fenced it), and the producer warp's copies of the first
// `early` slots (the whole ring while the gate/up launch streams: 32 KB a block) and L2
// prefetches of the slots past them.
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
    StreamRing& ring = st.ring;
    ring.stage0 = stream_smem;
    ring.full = smem_u32(bars);
    ring.empty = ring.full + 8 * STREAM_MAX_STAGES;
    ring.stages = stages;
    ring.row_bytes = 2 * K + (STREAM_ROW_PAD && (2 * K) % 128 == 0 ? 64 : 0);
    st.slot_w = slot_w;
    st.slot_e = slot_e;
    st.early = min(stages, slots);
    st.epi.mode = EPI_STORE;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            mbar_init(ring.full + 8 * s, 1);
            mbar_init(ring.empty + 8 * s, KSLICES);
        }
        mbar_init_fence();
    }
    if ((int)threadIdx.x < slots) {
        int e = (int)threadIdx.x < k ? load_l2(topk_idx + threadIdx.x) : E;
        slot_e[threadIdx.x] = e;
        slot_w[threadIdx.x] = (const bf16_t*)load_l2(table + 2 * e);
    }
    __syncthreads();
    if ((int)(threadIdx.x >> 5) == KSLICES) {
        int lane = threadIdx.x & 31, n0 = blockIdx.x * 8;
        for (int i = 0; i < st.early; ++i) stream_issue<1>(ring, slot_w[i], H, K, n0, i, st.epi);
        for (int i = st.early + lane; i < slots; i += 32) bulk_prefetch_l2(slot_w[i] + (long long)n0 * K, 16u * (u32)K);
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
    long long lo_off = (long long)slots * xstride;
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
    // The slots' rows split into bf16 halves, two chunks of 8 per thread loaded before either
    // is split (nine rows of K = 512 are 2.25 chunks a thread).
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
            u32 hi[4], lo[4];
            split8(v[b], hi, lo);
            *(uint4*)(xs + (long long)r * xstride + kk) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
            *(uint4*)(xs + lo_off + (long long)r * xstride + kk) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
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
            small_kblock_split<1>(c, g == 0 ? xs + (long long)i * xstride : 0, 0, lo_off, false, kb * 32 + q * 8, bh, zero);
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
// decode) the two launches took 30-31 us of each layer, this one 26-28 us; its blocks know
// the routing 8-10 us after their inputs are ready (the slowest of a cluster's 16 blocks sets
// the exchange), and the 20 SMs that do not fit a 16-block cluster stay idle.

// Gate/up column blocks the k-slice warps of moe_route_gate_up take at once: independent mma
// chains, where one column block's chain left the warps waiting on each mma's latency (35B-A3B
// decode on the H100: 3.334-3.371 ms per step against 3.387-3.434 with one).
// `KESTREL_CUDA_DEFINES=RGU_PASS=1` for A/B runs; at most RGU_MAX_PASS.
#ifndef RGU_PASS
#define RGU_PASS 2
#endif
// Most column blocks of one pass (the reduction buffers' size): the router's share of a block
// (up to three column blocks) goes in passes of two and one. With room for three the larger
// static shared memory cost more than the pass gained (3.343, 3.387 against 3.322, 3.335 ms).
#define RGU_MAX_PASS 2
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
__device__ __forceinline__ void one_row_column_blocks(const StreamRing& ring, int i, int pass, const Epilogue& epi, const bf16_t* h0, long long lo_off, int kb0, int kb1,
        float (*red)[KSLICES][RGU_MAX_PASS][32][4], float t[RGU_MAX_PASS][4]) {
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
        // small_kblock_split's fragments (rows 8-15 zero) and mma_kblock's four products for
        // each chain, but step by step across the chains: the products are issued in program
        // order, so chain by chain each mma waited for the one before it.
        u32 hi0[4] = {0, 0, 0, 0}, lo0[4] = {0, 0, 0, 0}, ahi[2][4], alo[2][4];
        const u32 none[4] = {0, 0, 0, 0};
        if (h0) {
            int k = kb * 32 + q * 8;
            uint4 a = *(const uint4*)(h0 + k), b = *(const uint4*)(h0 + lo_off + k);
            hi0[0] = a.x; hi0[1] = a.y; hi0[2] = a.z; hi0[3] = a.w;
            lo0[0] = b.x; lo0[1] = b.y; lo0[2] = b.z; lo0[3] = b.w;
        }
        make_frags(hi0, none, ahi);
        make_frags(lo0, none, alo);
#pragma unroll
        for (int j = 0; j < P; ++j) mma_bf16(c[j], ahi[0], bh[j].x, bh[j].y);
#pragma unroll
        for (int j = 0; j < P; ++j) mma_bf16(c[j], alo[0], bh[j].x, bh[j].y);
#pragma unroll
        for (int j = 0; j < P; ++j) mma_bf16(c[j], ahi[1], bh[j].z, bh[j].w);
#pragma unroll
        for (int j = 0; j < P; ++j) mma_bf16(c[j], alo[1], bh[j].z, bh[j].w);
    }
    // This warp's reads of the stages are done: the producer may refill them.
    __syncwarp();
    if (lane == 0)
        for (int j = 0; j < P; ++j) mbar_arrive(ring.empty + 8 * ((i + j) % S));
    // Buffer pass & 1 was last read by warp 0 in pass - 2, before the barrier of pass - 1.
    float (*rb)[RGU_MAX_PASS][32][4] = red[pass & 1];
#pragma unroll
    for (int j = 0; j < P; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) rb[warp][j][lane][e] = c[j][e];
    k_slices_sync();
    if (warp == 0) {
#pragma unroll
        for (int j = 0; j < P; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) t[j][e] = 0.0f;
            for (int w = 0; w < KSLICES; ++w)
#pragma unroll
                for (int e = 0; e < 4; ++e) t[j][e] += rb[w][j][lane][e];
        }
    }
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
// copied first, while the router runs.
//
// The next launch (moe_down_combine) reads topk_idx before its own wait: the blocks let it
// launch only after their routing is written and fenced, and it checks the experts again after
// its wait. Dynamic shared memory: the ring (stages * 8 rows of 2K bytes), the split row (2
// rows), the norm weight (K floats); stages >= 2.
extern "C" __global__ void __launch_bounds__(STREAM_THREADS) moe_route_gate_up(float* act, const float* resid, const bf16_t* router_w, int router_n, int K,
        Epilogue router_epi, const float* norm_w, float eps, const u64* table, int E, int k, int renormalize, int inter, int* topk_idx, float* topk_w,
        int stages) {
    extern __shared__ __align__(128) unsigned char stream_smem[];
    __shared__ __align__(8) u64 bars[2 * STREAM_MAX_STAGES];
    __shared__ __align__(8) u64 norm_bar;
    __shared__ float red[2][KSLICES][RGU_MAX_PASS][32][4];
    __shared__ __align__(16) float logits_s[ROUTE_GU_MAX_COLS];
    __shared__ const bf16_t* expert_w[ROUTE_GU_MAX_COLS];
    __shared__ int slot_expert[FUSED_DOWN_MAX_SLOTS];
    __shared__ float slot_weight[FUSED_DOWN_MAX_SLOTS];
    __shared__ int slot_row[FUSED_DOWN_MAX_SLOTS + 1];
    // Set by warp 0 once the routing's global writes are fenced.
    __shared__ int routing_published;
    StreamRing ring = {};
    ring.stage0 = stream_smem;
    ring.full = smem_u32(bars);
    ring.empty = ring.full + 8 * STREAM_MAX_STAGES;
    ring.stages = stages;
    ring.row_bytes = 2 * K + (STREAM_ROW_PAD && (2 * K) % 128 == 0 ? 64 : 0);
    ring.norm_bar = smem_u32(&norm_bar);
    ring.norm_s = (const float*)(stream_smem + ((long long)stages * 8 + 2) * ring.row_bytes);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int rank = (int)cluster_rank(), C = (int)cluster_blocks();
    int router_cbs = (router_n + 7) / 8, nr = rank < router_cbs ? (router_cbs - 1 - rank) / C + 1 : 0;
    int gu_n = 2 * inter, gu_cbs = gu_n / 8, gu_total = (k + 1) * gu_cbs;
    int n_gu = (int)blockIdx.x < gu_total ? (gu_total - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    Epilogue gu_epi = {};
    gu_epi.mode = EPI_SWIGLU;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            mbar_init(ring.full + 8 * s, 1);
            mbar_init(ring.empty + 8 * s, KSLICES);
        }
        mbar_init(ring.norm_bar, 1);
        mbar_init_fence();
    }
    if ((int)threadIdx.x <= k) slot_row[threadIdx.x] = threadIdx.x;
    if (threadIdx.x == 0) routing_published = 0;
    __syncthreads();
    // Phase 0: every block of the cluster has started, so its shared memory may be written.
    cluster_arrive_relaxed();
    if (warp == KSLICES) {
        // The producer: the norm weight, the router's column blocks, the shared expert's, then
        // (once warp 0 has routed) the routed experts'.
        if (lane == 0) {
            mbar_arrive_expect_tx(ring.norm_bar, 4u * (u32)K);
            bulk_copy_weights(smem_u32(ring.norm_s), norm_w, 4u * (u32)K, ring.norm_bar);
        }
        int i = 0;
        for (; i < nr; ++i) {
            if (i >= stages) mbar_wait(ring.empty + 8 * (i % stages), (u32)((i / stages - 1) & 1));
            stream_issue<1>(ring, router_w, router_n, K, (rank + C * i) * 8, i % stages, router_epi);
        }
        // Phase 1 (the logits exchange) needs nothing from this warp; arriving before the
        // gate/up copies keeps it from waiting on stages only the exchange frees.
        cluster_wait();
        cluster_arrive_relaxed();
        bool routed = false, launched = false;
        for (int j = 0; j < n_gu; ++j, ++i) {
            int idx = blockIdx.x + j * gridDim.x, p = idx / gu_cbs, n0 = (idx % gu_cbs) * 8;
            if (p > 0 && !routed) {
                asm volatile("bar.sync 2, 64;" ::: "memory");
                routed = true;
            }
            if (i >= stages) mbar_wait(ring.empty + 8 * (i % stages), (u32)((i / stages - 1) & 1));
            const bf16_t* w = p == 0 ? (const bf16_t*)load_l2(table + 2 * E) : expert_w[slot_expert[p - 1]];
            stream_issue<1>(ring, w, gu_n, K, n0, i % stages, gu_epi);
            if (!launched && *(volatile int*)&routing_published) {
                let_dependents_launch();
                launched = true;
            }
        }
        if (!routed) asm volatile("bar.sync 2, 64;" ::: "memory");
        return;
    }
    // The experts' weight pointers (the table was written long before this launch), off the
    // producer's path: its first copies go out as soon as the block is resident. Warp 0 reads
    // them after the barriers below and the producer after warp 0's routing.
    for (int e = threadIdx.x; e < E; e += 32 * KSLICES) expert_w[e] = (const bf16_t*)load_l2(table + 2 * e);
    wait_for_inputs_holding_dependents();
    int xstride = ring.row_bytes / 2;
    long long lo_off = xstride;
    bf16_t* xs = (bf16_t*)(ring.stage0 + (long long)stages * 8 * ring.row_bytes);
    stream_norm_rows(resid, 0, 1, K, ring, eps, 0, xs, xstride, lo_off);
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
        // The router's column blocks land together: two in one pass.
        int n = min(RGU_MAX_PASS, nr - i);
        if (n == 2) one_row_column_blocks<2>(ring, i, pass, router_epi, h0, lo_off, kb0, kb1, red, t);
        else one_row_column_blocks<1>(ring, i, pass, router_epi, h0, lo_off, kb0, kb1, red, t);
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
    if (warp == 0) {
        // The routing into shared memory first: global stores wait behind the copies' traffic.
        int e = route_token(0, slot_expert, slot_weight, logits_s, E, k, renormalize, false);
        __syncwarp();
        // The producer starts on the routed experts' copies; the fence of the routing's global
        // writes (for the next launch, which reads them before its wait) follows off its path.
        asm volatile("bar.arrive 2, 64;" ::: "memory");
        if (lane == 0 && blockIdx.x == 0) TRACE_MARK(TRACE_GROUP_KNOWN);
        if (lane < k) {
            topk_idx[lane] = e;
            topk_w[lane] = slot_weight[lane];
        }
        __threadfence();
        if (lane == 0) *(volatile int*)&routing_published = 1;
    }
    // Every thread lets the next launch start only once the routing is written and fenced:
    // after the first pass's barrier (warp 0 fenced before it), or after one of its own.
    if (n_gu == 0) k_slices_sync();
    if (n_gu == 0) let_dependents_launch();
    for (int j0 = 0; j0 < n_gu; ++pass) {
        int n = min(RGU_PASS, n_gu - j0);
        if (n == 2) one_row_column_blocks<2>(ring, i, pass, gu_epi, h0, lo_off, kb0, kb1, red, t);
        else one_row_column_blocks<1>(ring, i, pass, gu_epi, h0, lo_off, kb0, kb1, red, t);
        if (j0 == 0) let_dependents_launch();
        if (j0 == 0 && threadIdx.x == 0 && blockIdx.x == 0) TRACE_MARK(TRACE_FIRST_DATA);
        if (warp == 0) {
            for (int j = 0; j < n; ++j) {
                int idx = blockIdx.x + (j0 + j) * gridDim.x, p = idx / gu_cbs, n0 = (idx % gu_cbs) * 8;
                Group row = {0, 0, 1, &slot_row[p == 0 ? k : p - 1]};
                store_fragment(gu_epi, act, row, gu_n, g, n0 + 2 * q, t[j]);
            }
        }
        i += n;
        j0 += n;
    }
    if (threadIdx.x == 0) TRACE_MARK(TRACE_BLOCK_END);
}
