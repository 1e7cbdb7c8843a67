// x[rows, K] (f32) @ W[N, K]^T (bf16) on tensor cores, batch-invariant.
//
// Every output element is computed by the same instruction sequence in all the kernels below
// (small-row, tiled, pipelined), whatever the row count, the tile it lands in, or the kernel
// that runs it:
//  - K is cut into 32-wide blocks, grouped into 8 fixed slices (of ceil(blocks/8) blocks each,
//    from K alone). Within a slice, blocks are accumulated in order by m16n8k16 bf16 mma with
//    an f32 accumulator that starts at zero; the 8 slice sums are then added in slice order.
//  - Inside a 32-wide block, a thread's 8 consecutive k values feed two mmas (k permuted
//    consistently for activations and weights, so 16-byte loads feed the fragments directly).
//  - Each f32 activation enters as bf16 (round to nearest even; round8), one mma per product,
//    as bf16 inference does (vLLM, llama.cpp's cuBLAS path); the residual stream stays f32.
//    F32/F16 weights are split as Whi = bf16(w), Wlo = bf16(w - Whi) to keep their precision:
//    per half-block the order is x*Whi, then x*Wlo when the weight has a lo part.
// The small-row kernel gives each warp one slice and adds the slices through shared memory;
// the tiled and pipelined kernels walk the slices in sequence. All add 0 + s0 + s1 + ... + s7
// in order. The batch-invariance tests check this bitwise across the kernels.

// One 32-wide k block for one m16 x n8 tile. a[s] are the fragments of half-block s.
__device__ __forceinline__ void mma_kblock(float c[4], const u32 a[2][4], uint4 whi, uint4 wlo, bool has_lo) {
    mma_bf16(c, a[0], whi.x, whi.y);
    if (has_lo) mma_bf16(c, a[0], wlo.x, wlo.y);
    mma_bf16(c, a[1], whi.z, whi.w);
    if (has_lo) mma_bf16(c, a[1], wlo.z, wlo.w);
}

__device__ __forceinline__ void load8_f32(const float* row, int k, int K, bool vec, float v[8]) {
    if (row && vec && k + 8 <= K) {
        float4 a = *(const float4*)(row + k), b = *(const float4*)(row + k + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = (row && k + i < K) ? row[k + i] : 0.0f;
    }
}

__device__ __forceinline__ uint4 load8_bf16(const bf16_t* row, int k, int K, bool vec) {
    if (row && vec && k + 8 <= K) return *(const uint4*)(row + k);
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 a = (row && k + 2 * i < K) ? row[k + 2 * i] : 0u;
        u32 b = (row && k + 2 * i + 1 < K) ? row[k + 2 * i + 1] : 0u;
        w[i] = a | (b << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}


// Fragments of half-blocks 0 and 1 from rows g (r0) and g+8 (r1), 4 pairs each.
__device__ __forceinline__ void make_frags(const u32 r0[4], const u32 r1[4], u32 f[2][4]) {
    f[0][0] = r0[0]; f[0][1] = r1[0]; f[0][2] = r0[1]; f[0][3] = r1[1];
    f[1][0] = r0[2]; f[1][1] = r1[2]; f[1][2] = r0[3]; f[1][3] = r1[3];
}

struct Group {
    const bf16_t* whi;
    const bf16_t* wlo;
    int rows;
    const int* list;
};

// Grouped launches (mixture of experts): blockIdx.z picks an expert from the `active` list
// ([count, experts...], in expert order), hence its weights and row list; list entries are
// output rows, and activation rows are entry / a_div.
__device__ __forceinline__ Group group_of(const bf16_t* whi, const bf16_t* wlo, int rows, const u64* group_w, const int* counts, const int* lists, int list_stride, const int* active) {
    Group g;
    if (group_w) {
        // Both loads in flight at once (slice blockIdx.z < the launch's group bound, within the
        // active list's length): the expert launch after the router starts its copies one
        // round trip sooner.
        int n = active[0], z = active[1 + blockIdx.z];
        if ((int)blockIdx.z >= n) {
            g.whi = 0; g.wlo = 0; g.rows = 0; g.list = 0;
            return g;
        }
        g.whi = (const bf16_t*)group_w[2 * z];
        g.wlo = (const bf16_t*)group_w[2 * z + 1];
        g.rows = counts[z];
        g.list = lists + (long long)z * list_stride;
    } else {
        g.whi = whi; g.wlo = wlo; g.rows = rows; g.list = 0;
    }
    return g;
}

// One m16n8 accumulator fragment of a thread: rows row (g) and row + 8 of the tile, columns
// col and col + 1, stored by the epilogue.
__device__ __forceinline__ void store_fragment(const Epilogue& e, float* out, const Group& grp, int N, int row, int col, const float v[4]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        int r = row + 8 * half;
        if (r >= grp.rows) continue;
        long long orow = grp.list ? grp.list[r] : r;
        store_pair(e, out, orow, col, N, v[2 * half], v[2 * half + 1]);
    }
}

// Weights are read once per step: bypass L1, and in L2 make them the first lines to go, so
// that activations and the weights prefetch_small pulls ahead stay (on the H100,
// 35B-A3B's decode step took 4.89 ms with both against 5.08 ms with neither).
__device__ __forceinline__ uint4 ldg_stream(const bf16_t* p) {
    uint4 v;
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(policy));
    return v;
}

// One 32-wide k block of the small-row kernel for its NT n8 tiles.
// `two`: whether rows 8..15 of the tile exist (uniform across the warp); when not, their
// fragments are the zeros the loads would give.
template <int NT>
__device__ __forceinline__ void small_kblock(float c[NT][4], const float* xr0, const float* xr1, bool two, int k, int K, bool vec, const uint4 bh[NT], const uint4 bl[NT], bool has_lo) {
    float v0[8];
    load8_f32(xr0, k, K, vec, v0);
    u32 h0[4], h1[4] = {0, 0, 0, 0}, a[2][4];
    round8(v0, h0);
    if (two) {
        float v1[8];
        load8_f32(xr1, k, K, vec, v1);
        round8(v1, h1);
    }
    make_frags(h0, h1, a);
#pragma unroll
    for (int j = 0; j < NT; ++j) mma_kblock(c[j], a, bh[j], bl[j], has_lo);
}

// One fragment row's 8 bf16 values at k of an activation row rounded ahead of time (`h`).
__device__ __forceinline__ void load_round8(const bf16_t* h, int k, u32 hi[4]) {
    uint4 a = *(const uint4*)(h + k);
    hi[0] = a.x; hi[1] = a.y; hi[2] = a.z; hi[3] = a.w;
}

// small_kblock on activations rounded to bf16 ahead of time (round_activations): rows g and
// g+8 of the tile come as bf16 arrays `h0`/`h1`. The fragments are exactly those round8
// makes, so the results are bitwise the same.
template <int NT>
__device__ __forceinline__ void small_kblock_rounded(float c[NT][4], const bf16_t* h0, const bf16_t* h1, bool two, int k, const uint4 bh[NT], const uint4 zero[NT]) {
    u32 hi0[4] = {0, 0, 0, 0}, hi1[4] = {0, 0, 0, 0}, a[2][4];
    if (h0) load_round8(h0, k, hi0);
    if (two && h1) load_round8(h1, k, hi1);
    make_frags(hi0, hi1, a);
#pragma unroll
    for (int j = 0; j < NT; ++j) mma_kblock(c[j], a, bh[j], zero[j], false);
}

// Few rows: grid (column blocks, ceil(rows/(16*MT)), groups), 32 * KSLICES threads; warp w
// owns k-slice w. A block computes MT m16 tiles (up to 16*MT rows) from each weight load, so
// the weights are streamed once per 16*MT rows.
// Bf16 weights with K a multiple of 32 take the streaming path (SMALL_UNROLL k blocks of
// loads in flight per warp, no bounds checks); other shapes the checked path. Both issue the same
// mma sequence per output element.
// NT (n8 tiles per block) trades per-column overhead against parallelism for small N, and
// SMALL_UNROLL (k blocks of weight loads in flight per warp) keeps the bytes in flight per SM
// up when there are few columns; the per-element arithmetic depends on none of MT, NT, SMALL_UNROLL.
// PRESPLIT kernels (more than one m tile) read activations rounded to bf16 once by
// round_activations (`x` is then a bf16 array) instead of rounding them in every column
// block; they take bf16 weights with K a multiple of 32 only.
template <int MT, int NT, int SMALL_UNROLL, bool PRESPLIT>
__device__ __forceinline__ void matmul_small_body(float* out, const float* x, const bf16_t* whi_, const bf16_t* wlo_, int rows, int N, int K,
        const u64* group_w, const int* counts, const int* lists, int list_stride, int a_div, const int* active, const Epilogue& epi) {
    __shared__ float red[KSLICES][MT][NT][32][4];
    Group grp = group_of(whi_, wlo_, rows, group_w, counts, lists, list_stride, active);
    int m0 = blockIdx.y * 16 * MT;
    if (m0 >= grp.rows) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    bool vec = (K % 8) == 0;
    bool has_lo = grp.wlo != 0;
    // Per m16 tile: its activation rows g and g+8, whether the tile has rows at all and
    // whether it has rows 8..15 (both uniform across the warp).
    const float* xr0[MT];
    const float* xr1[MT];
    const bf16_t* xh0[MT];
    const bf16_t* xh1[MT];
    bool live[MT], two[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        int r = m0 + mt * 16 + g;
        long long a0 = r < grp.rows ? (long long)(grp.list ? grp.list[r] / a_div : r) * K : -1;
        long long a1 = r + 8 < grp.rows ? (long long)(grp.list ? grp.list[r + 8] / a_div : r + 8) * K : -1;
        xr0[mt] = a0 >= 0 ? x + a0 : 0;
        xr1[mt] = a1 >= 0 ? x + a1 : 0;
        xh0[mt] = a0 >= 0 ? (const bf16_t*)x + a0 : 0;
        xh1[mt] = a1 >= 0 ? (const bf16_t*)x + a1 : 0;
        live[mt] = m0 + mt * 16 < grp.rows;
        two[mt] = m0 + mt * 16 + 8 < grp.rows;
    }
    int nkb = (K + 31) / 32, kps = (nkb + KSLICES - 1) / KSLICES;
    int kb0 = warp * kps, kb1 = min(kb0 + kps, nkb);
    // Column blocks in a grid-stride loop: a grid sized to the GPU streams without a tail wave.
    for (int n0 = blockIdx.x * 8 * NT; n0 < N; n0 += gridDim.x * 8 * NT) {
        float c[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NT; ++j) c[mt][j][0] = c[mt][j][1] = c[mt][j][2] = c[mt][j][3] = 0.0f;
        if (!has_lo && (K % 32) == 0) {
            // Rows past N read row N-1 (always valid); their results are never written.
            const bf16_t* wh[NT];
#pragma unroll
            for (int j = 0; j < NT; ++j) wh[j] = grp.whi + weight_row(epi, min(n0 + j * 8 + g, N - 1), N) * K + q * 8;
            const uint4 zero[NT] = {};
            // `count` (at most SMALL_UNROLL) k blocks from kb: their loads issued together, then
            // their mmas in k order. Full rounds pass SMALL_UNROLL, so their predicates fold away.
            auto stream_kblocks = [&](int kb, int count) {
                uint4 bh[SMALL_UNROLL][NT];
#pragma unroll
                for (int u = 0; u < SMALL_UNROLL; ++u)
#pragma unroll
                    for (int j = 0; j < NT; ++j) bh[u][j] = u < count ? ldg_stream(wh[j] + (kb + u) * 32) : zero[j];
#pragma unroll
                for (int u = 0; u < SMALL_UNROLL; ++u) {
                    if (u >= count) break;
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        if (!live[mt]) continue;
                        if constexpr (PRESPLIT) small_kblock_rounded<NT>(c[mt], xh0[mt], xh1[mt], two[mt], (kb + u) * 32 + q * 8, bh[u], zero);
                        else small_kblock<NT>(c[mt], xr0[mt], xr1[mt], two[mt], (kb + u) * 32 + q * 8, K, true, bh[u], zero, false);
                    }
                }
            };
            int kb = kb0;
            for (; kb + SMALL_UNROLL <= kb1; kb += SMALL_UNROLL) stream_kblocks(kb, SMALL_UNROLL);
            // The last (fewer than SMALL_UNROLL) k blocks of the slice; a short slice (the
            // experts' K = 512 down projections) is only this.
            if (kb < kb1) stream_kblocks(kb, kb1 - kb);
        } else {
            const bf16_t* wh[NT];
            const bf16_t* wl[NT];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                int n = n0 + j * 8 + g;
                wh[j] = n < N ? grp.whi + weight_row(epi, n, N) * K : 0;
                wl[j] = (has_lo && n < N) ? grp.wlo + weight_row(epi, n, N) * K : 0;
            }
            for (int kb = kb0; kb < kb1; ++kb) {
                int k = kb * 32 + q * 8;
                uint4 bh[NT], bl[NT];
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    bh[j] = load8_bf16(wh[j], k, K, vec);
                    bl[j] = has_lo ? load8_bf16(wl[j], k, K, vec) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    if (live[mt]) small_kblock<NT>(c[mt], xr0[mt], xr1[mt], two[mt], k, K, vec, bh, bl, has_lo);
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) red[warp][mt][j][lane][i] = c[mt][j][i];
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (!live[mt]) continue;
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    for (int w = 0; w < KSLICES; ++w)
#pragma unroll
                        for (int i = 0; i < 4; ++i) t[i] += red[w][mt][j][lane][i];
                    store_fragment(epi, out, grp, N, m0 + mt * 16 + g, n0 + j * 8 + 2 * q, t);
                }
            }
        }
        __syncthreads();
    }
}

// Bytes of weights a plain small-row launch may pull into L2 before it waits for its
// activations. At 0 each block pulls its first column block only (the measured setting); a
// larger budget (an experiment: KESTREL_CUDA_DEFINES="PREFETCH_BUDGET=16777216") lets blocks
// pull further column blocks of their grid-stride loop while the kernels before them finish.
#ifndef PREFETCH_BUDGET
#define PREFETCH_BUDGET 0
#endif

// Before a small-row kernel waits for its activations, its blocks start pulling their weight
// rows into L2, so the stream of weights starts while the previous kernel finishes. Thread i of
// a block prefetches the block's i-th column block of weight `w`, for `rounds` column blocks.
__device__ __forceinline__ void prefetch_weight_columns(const bf16_t* w, int N, int K, int cols, int rounds, const Epilogue& e) {
#if __CUDA_ARCH__ >= 900
    if ((int)threadIdx.x >= rounds) return;
    int n0 = (blockIdx.x + threadIdx.x * gridDim.x) * cols;
    if (n0 >= N) return;
    int n1 = min(n0 + cols, N);
    // Weight rows [r0, r1) as bytes; SwiGLU columns map to gate rows and the same up rows.
    int r0 = e.mode == EPI_SWIGLU ? n0 >> 1 : n0, r1 = e.mode == EPI_SWIGLU ? (n1 + 1) >> 1 : n1;
    unsigned bytes = (unsigned)(r1 - r0) * (unsigned)K * 2u;
    bulk_prefetch_l2(w + (long long)r0 * K, bytes);
    if (e.mode == EPI_SWIGLU) bulk_prefetch_l2(w + (long long)(r0 + (N >> 1)) * K, bytes);
#endif
}

// The prefetch of a small-row launch (block row 0 only, K in whole 32-wide blocks). A plain
// launch pulls its first column block per block, or more up to PREFETCH_BUDGET bytes per launch.
// A grouped launch learns its weights from the routing; with `lists_ready` (the routing was
// written two or more launches back, so it is complete once this kernel is running: the launch
// in between waited for it before letting this one start) each block looks its expert up and
// pulls all its column blocks: an expert's down projection is a few MB, pulled while the
// gate/up launch ends.
__device__ __forceinline__ void prefetch_small(const bf16_t* whi, const bf16_t* wlo, int N, int K, int cols, const u64* group_w, const int* active, int lists_ready,
        const Epilogue& e) {
    if (blockIdx.y != 0 || (K % 32) != 0) return;
    if (!group_w) {
        if (wlo) return;
        long long launch_round = (long long)gridDim.x * cols * K * 2;
        prefetch_weight_columns(whi, N, K, cols, (int)max(1LL, (long long)PREFETCH_BUDGET / launch_round), e);
    } else if (lists_ready) {
        if ((int)blockIdx.z >= load_l2(active)) return;
        const bf16_t* w = (const bf16_t*)load_l2(group_w + 2 * load_l2(active + 1 + blockIdx.z));
        prefetch_weight_columns(w, N, K, cols, (N / cols + gridDim.x) / gridDim.x, e);
    }
}

#define SMALL_KERNEL(NAME, MT, NT, UNROLL, PRESPLIT)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * KSLICES) NAME(float* out, const float* x, const bf16_t* whi, const bf16_t* wlo, int rows, \
            int N, int K, const u64* group_w, const int* counts, const int* lists, int list_stride, int a_div, const int* active,        \
            long long x_elems, Epilogue epi, int lists_ready) {                                                                           \
        prefetch_small(whi, wlo, N, K, 8 * NT, group_w, active, lists_ready, epi);                                                      \
        wait_for_inputs();                                                                                                              \
        matmul_small_body<MT, NT, UNROLL, PRESPLIT>(out, x, whi, wlo, rows, N, K, group_w, counts, lists, list_stride, a_div, active, epi); \
    }
// Up to 16 rows, f32 activations rounded in the k loop. Four k blocks of loads in flight per warp
// leave registers for two or three resident blocks per SM, which streams faster than deeper
// unrolling at fewer blocks (on the H100, 1 row: 4096x4096 22.5 -> 17.7 us, 24576x4096
// 82.7 -> 76.6 us, 4096x12288 50.9 -> 43.2 us against nt4/u4 and nt2/u8).
SMALL_KERNEL(matmul_small_nt1, 1, 1, 4, false)
SMALL_KERNEL(matmul_small_nt2, 1, 2, 4, false)
// A K of at most 16 k blocks (two per warp): four n tiles, so that a block's one round of
// loads per column block is four times as large.
SMALL_KERNEL(matmul_small_nt4, 1, 4, 2, false)
// Up to 32 rows, activations rounded ahead. With two n tiles, two k blocks in flight leave
// registers for two resident blocks per SM (32 rows on the H100: 4096x4096 35.3 -> 24.7 us,
// 4096x12288 85.0 -> 67.9 us against eight k blocks at one block per SM).
SMALL_KERNEL(matmul_small2_nt1, 2, 1, 16, true)
SMALL_KERNEL(matmul_small2_nt2, 2, 2, 2, true)
// Up to 64 rows, activations rounded ahead.
SMALL_KERNEL(matmul_small4_nt1, 4, 1, 8, true)
SMALL_KERNEL(matmul_small4_nt2, 4, 2, 4, true)

// The router matmul of a step of at most 8 tokens (matmul_small_nt1's arithmetic, so the same
// logits), then the routing (route_in_last_block). Arguments: matmul_small_nt1's for a plain
// launch, an unused stage count (matmul_router_stream's), then moe_group_few's.
extern "C" __global__ void __launch_bounds__(32 * KSLICES) matmul_router(float* out, const float* x, const bf16_t* whi, const bf16_t* wlo, int rows, int N, int K,
        Epilogue epi, int stages, unsigned* done, int* topk_idx, float* topk_w, const float* logits, int T, int E, int k, int renormalize, int* lists, int* counts,
        int* active, int slots, int fold) {
    prefetch_small(whi, wlo, N, K, 8, 0, 0, 0, epi);
    wait_for_inputs();
    matmul_small_body<1, 1, 4, false>(out, x, whi, wlo, rows, N, K, 0, 0, 0, 0, 1, 0, epi);
    route_in_last_block(done, topk_idx, topk_w, logits, T, E, k, renormalize, lists, counts, active, slots, fold);
}
// The end of a warp's MI x 4 block of m16n8 tiles in the tiled and pipelined kernels: the
// slices after `slice` add their zero sums (as the small-row kernel does, so -0.0 turns into
// 0.0 the same way everywhere), then the tiles are written from row `row0`, column `col0`.
template <int MI>
__device__ __forceinline__ void finish_warp_tiles(float* out, float tot[MI][4][4], int slice, const Group& grp, int N, int row0, int col0, int g, int q, const Epilogue& epi) {
    for (; slice < KSLICES; ++slice)
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) tot[i][j][e] += 0.0f;
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) store_fragment(epi, out, grp, N, row0 + i * 16 + g, col0 + j * 8 + 2 * q, tot[i][j]);
}

#define TBM 64
#define TBN 64

// Many rows: grid (ceil(N/64), ceil(rows/64), groups), 128 threads as 2x2 warps of 32x32.
// Shared tiles hold one 32-wide k block as bf16 (activations rounded on the way in).
extern "C" __global__ void __launch_bounds__(128) matmul_tiled(float* out, const float* x, const bf16_t* whi_, const bf16_t* wlo_, int rows, int N, int K,
        const u64* group_w, const int* counts, const int* lists, int list_stride, int a_div, const int* active, Epilogue epi) {
    wait_for_inputs();
    __shared__ __align__(16) bf16_t s_a[2][TBM][32];
    __shared__ __align__(16) bf16_t s_whi[2][TBN][32];
    __shared__ __align__(16) bf16_t s_wlo[2][TBN][32];
    Group grp = group_of(whi_, wlo_, rows, group_w, counts, lists, list_stride, active);
    int m0 = blockIdx.y * TBM;
    if (m0 >= grp.rows) return;
    int n0 = blockIdx.x * TBN;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    int wm = warp >> 1, wn = warp & 1;
    bool vec = (K % 8) == 0;
    bool has_lo = grp.wlo != 0;
    // Loader role: row tid/2 of each tile, k offset (tid%2)*16.
    int lr = tid >> 1, lk = (tid & 1) * 16;
    const float* xrow = 0;
    if (m0 + lr < grp.rows) xrow = x + (long long)(grp.list ? grp.list[m0 + lr] / a_div : m0 + lr) * K;
    const bf16_t* whrow = n0 + lr < N ? grp.whi + weight_row(epi, n0 + lr, N) * K : 0;
    const bf16_t* wlrow = (has_lo && n0 + lr < N) ? grp.wlo + weight_row(epi, n0 + lr, N) * K : 0;

    float acc[2][4][4], tot[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = tot[i][j][e] = 0.0f;

    int nkb = (K + 31) / 32, kps = (nkb + KSLICES - 1) / KSLICES;
    float xv[2][8];
    uint4 wv[2][2];
    auto load = [&](int kb) {
        int k = kb * 32 + lk;
        load8_f32(xrow, k, K, vec, xv[0]);
        load8_f32(xrow, k + 8, K, vec, xv[1]);
        wv[0][0] = load8_bf16(whrow, k, K, vec);
        wv[0][1] = load8_bf16(whrow, k + 8, K, vec);
        wv[1][0] = has_lo ? load8_bf16(wlrow, k, K, vec) : make_uint4(0, 0, 0, 0);
        wv[1][1] = has_lo ? load8_bf16(wlrow, k + 8, K, vec) : make_uint4(0, 0, 0, 0);
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            u32 hi[4];
            round8(xv[h], hi);
            *(uint4*)&s_a[buf][lr][lk + 8 * h] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
            *(uint4*)&s_whi[buf][lr][lk + 8 * h] = wv[0][h];
            *(uint4*)&s_wlo[buf][lr][lk + 8 * h] = wv[1][h];
        }
    };
    if (nkb > 0) {
        load(0);
        store(0);
    }
    __syncthreads();
    int slice = 0, slice_end = min(kps, nkb);
    for (int kb = 0; kb < nkb; ++kb) {
        int buf = kb & 1;
        if (kb + 1 < nkb) load(kb + 1);
        u32 a[2][2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            int r = wm * 32 + i * 16 + g;
            uint4 h0 = *(const uint4*)&s_a[buf][r][q * 8], h1 = *(const uint4*)&s_a[buf][r + 8][q * 8];
            u32 a0[4] = {h0.x, h0.y, h0.z, h0.w}, a1[4] = {h1.x, h1.y, h1.z, h1.w};
            make_frags(a0, a1, a[i]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int n = wn * 32 + j * 8 + g;
            uint4 bh = *(const uint4*)&s_whi[buf][n][q * 8];
            uint4 bl = *(const uint4*)&s_wlo[buf][n][q * 8];
#pragma unroll
            for (int i = 0; i < 2; ++i) mma_kblock(acc[i][j], a[i], bh, bl, has_lo);
        }
        if (kb + 1 == slice_end) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        tot[i][j][e] += acc[i][j][e];
                        acc[i][j][e] = 0.0f;
                    }
            ++slice;
            slice_end = min((slice + 1) * kps, nkb);
        }
        if (kb + 1 < nkb) store(buf ^ 1);
        __syncthreads();
    }
    finish_warp_tiles<2>(out, tot, slice, grp, N, m0 + wm * 32, n0 + wn * 32, g, q, epi);
}

