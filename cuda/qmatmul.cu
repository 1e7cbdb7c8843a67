// Quantized weights in their own bits (tiles: src/backend/cuda/quant_tiles.rs) times f32
// activations on tensor cores, batch-invariant. One module per format: the host prepends
// `#define QFMT n` (TileFormat::kernel_id) and compiles the module the first time a weight of
// that format is uploaded.
//
// The weights are the mma's A operand (16 weight rows per m16 tile, rows g and g+8 in lane g's
// registers), the activations its B operand (8 tokens per n8 tile), rounded to bf16 as in
// cuda/matmul.cu (one mma per product). Every output element (weight row n, token t) is computed by the
// same sequence of operations in every kernel below, whatever the token count or the kernel:
//  - K is cut into units of QU elements, grouped into KSLICES fixed slices of ceil(units/8)
//    units each (from K alone). A slice's sum starts at 0 and walks its units in order; the
//    slice sums are added in slice order: 0 + s0 + s1 + ... + s7.
//  - Within a unit, per scale block (QSB elements) a fresh f32 accumulator P takes, per k16 step
//    in k order, mma(w, bf16(x)), w the block's codes as exact bf16 numbers
//    (integers, IQ4 codebook entries, e4m3 values); then sum = fma(scale, P, sum). The formats
//    with a min (Q4_1, Q5_1, Q4_K, Q5_K) multiply 128 + code (the bf16 the code lands in, one
//    instruction fewer per pair) and then add sum = fma(min - 128 * scale, S, sum), S the sum of
//    the block's bf16 activations (split_block), which is what the 128s added.
// The few-row kernel (qmm_few*) gives each warp one slice and adds the slices through shared
// memory; the many-row kernel (qmm_many) walks them in sequence. The tests compare their bits.
//
// The formats' decoding is in cuda/qformats.cuh, the embedding rows and random tiles in
// cuda/qtiles.cu (one module with this file).

// ---- activations ----

// One 32-element block of an activation row (`xb`, f32) rounded to bf16 at `hb`, in fragment
// order (quad q's eight: elements 4q..4q+3, 16+4q..+3), and its sum: ((s0 + s1) + (s2 + s3)),
// s_q the left-to-right sum of quad q's eight bf16 values in that order. Every kernel takes S
// from here, so the sums are the same bits everywhere. (The launches still size room for lo
// halves `lo_off` elements on, which the former two-mma split wrote; nothing reads it.)
// With a norm weight `nw` (the block's 32 weights), each value is first normalized as
// rms_norm_rows writes it: x * inv * w.
__device__ __forceinline__ void split_block(const float* xb, bf16_t* hb, float* sum, const float* nw = 0, float inv = 0.0f) {
    float sq[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        float4 a = *(const float4*)(xb + 4 * q), b = *(const float4*)(xb + 16 + 4 * q);
        float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        if (nw) {
            float4 wa = *(const float4*)(nw + 4 * q), wb = *(const float4*)(nw + 16 + 4 * q);
            float w[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = v[i] * inv * w[i];
        }
        u32 h[4];
        round8(v, h);
        *(uint4*)(hb + 8 * q) = make_uint4(h[0], h[1], h[2], h[3]);
        // The values as the mma multiplies them.
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float h0 = __uint_as_float(h[i] << 16), h1 = __uint_as_float(h[i] & 0xFFFF0000u);
            s = i == 0 ? h0 : __fadd_rn(s, h0);
            s = __fadd_rn(s, h1);
        }
        sq[q] = s;
    }
    *sum = __fadd_rn(__fadd_rn(sq[0], sq[1]), __fadd_rn(sq[2], sq[3]));
}

// Row stride of the block sums: whole groups of four, so a stage copies them 16 bytes at a time.
__device__ __forceinline__ int sums_stride(int K) { return ((K / 32 + 3) / 4) * 4; }

// Activations rounded once for the launches that read them from memory: bf16 [rows][K] (the
// buffer keeps room for lo halves `lo_off` elements further, unused), block sums
// [rows][sums_stride]. A thread per (row, block).
extern "C" __global__ void qsplit(bf16_t* hi, long long lo_off, float* sums, const float* x, int rows, int K) {
    wait_for_inputs();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int nkb = K / 32;
    if (i >= (long long)rows * nkb) return;
    long long r = i / nkb;
    int kb = (int)(i % nkb);
    split_block(x + r * K + kb * 32, hi + r * K + kb * 32, sums + r * sums_stride(K) + kb);
}

// ---- one unit ----

__device__ __forceinline__ void apply_scale(float c[4], float2 sc, const float P[4]) {
    c[0] = __fmaf_rn(sc.x, P[0], c[0]);
    c[1] = __fmaf_rn(sc.x, P[1], c[1]);
    c[2] = __fmaf_rn(sc.y, P[2], c[2]);
    c[3] = __fmaf_rn(sc.y, P[3], c[3]);
}

// Where a warp finds its token tiles' activations: per tile j, the bf16 row of token 8j+g
// (null: no token, zeros); the block-sum rows of tokens 8j+2q and
// 8j+2q+1 (min formats; null: zeros). Rows are whole K-rows in the few-row kernel, a stage's
// in the many-row kernel (q_unit's `kb` counts blocks from their start).
template <int TT>
struct QAct {
    const bf16_t* x[TT];
    const float* s[TT][2];
};

__device__ __forceinline__ void load_b(const bf16_t* row, int k, uint4& bh) {
    bh = row ? *(const uint4*)(row + k) : make_uint4(0, 0, 0, 0);
}

// Adds units un[0..WT) (the same unit of WT weight tiles; tiles past `wtiles` skipped) into the
// slice sums c[w][j] of the token tiles j < tiles (TT at most), the unit's blocks at block
// index `kb` of the activation rows. One load of a block's activations feeds every tile.
template <int TT, int WT>
__device__ __forceinline__ void q_unit(float c[WT][TT][4], const QUnit (&un)[WT], const QAct<TT>& act, int kb, int q, int tiles, int wtiles) {
#pragma unroll
    for (int b0 = 0; b0 < QB; b0 += QBPS) {
        u32 a[WT][QBPS][2][4];
#pragma unroll
        for (int w = 0; w < WT; ++w)
#pragma unroll
            for (int bb = 0; bb < QBPS; ++bb)
                if (WT == 1 || w < wtiles) q_frags(un[w], b0 + bb, a[w][bb]);
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            if (j >= tiles) break;
#if QSB == 16
            uint4 bh;
            load_b(act.x[j], (kb + b0) * 32 + 8 * q, bh);
#pragma unroll
            for (int w = 0; w < WT; ++w) {
                if (WT > 1 && w >= wtiles) break;
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    float P[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mma_bf16(P, a[w][0][s], s ? bh.z : bh.x, s ? bh.w : bh.y);
                    apply_scale(c[w][j], q_scale(un[w], 2 * b0 + s), P);
                }
            }
#else
            // One block's activations at a time (a wide scale block has one weight tile: WT is 1).
            static_assert(QBPS == 1 || WT == 1, "a wide scale block takes one weight tile");
            uint4 bh;
            if (QBPS == 1) load_b(act.x[j], (kb + b0) * 32 + 8 * q, bh);
#if QHAS_MIN
            float s0 = act.s[j][0] ? act.s[j][0][kb + b0] : 0.0f, s1 = act.s[j][1] ? act.s[j][1][kb + b0] : 0.0f;
#endif
#pragma unroll
            for (int w = 0; w < WT; ++w) {
                if (WT > 1 && w >= wtiles) break;
                float P[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int bb = 0; bb < QBPS; ++bb) {
                    if (QBPS > 1) load_b(act.x[j], (kb + b0 + bb) * 32 + 8 * q, bh);
                    mma_bf16(P, a[w][bb][0], bh.x, bh.y);
                    mma_bf16(P, a[w][bb][1], bh.z, bh.w);
                }
                float2 sc = q_scale(un[w], b0 / QBPS);
                apply_scale(c[w][j], sc, P);
#if QHAS_MIN
                float2 mn = q_min(un[w], b0, sc);
                c[w][j][0] = __fmaf_rn(mn.x, s0, c[w][j][0]);
                c[w][j][1] = __fmaf_rn(mn.x, s1, c[w][j][1]);
                c[w][j][2] = __fmaf_rn(mn.y, s0, c[w][j][2]);
                c[w][j][3] = __fmaf_rn(mn.y, s1, c[w][j][3]);
#endif
            }
#endif
        }
    }
}

// ---- groups and stores ----

struct QGroup {
    const unsigned char* w;
    int rows;
    const int* list;
};

// As cuda/matmul.cu's group_of: grouped launches (experts) take their weights and rows from
// the active list ([count, experts...]); the table holds [groups][tiles, 0].
__device__ __forceinline__ QGroup qgroup_of(const unsigned char* w, int rows, const u64* group_w, const int* counts, const int* lists, int list_stride, const int* active) {
    QGroup g;
    if (group_w) {
        int n = active[0], z = active[1 + blockIdx.z];
        if ((int)blockIdx.z >= n) {
            g.w = 0;
            g.rows = 0;
            g.list = 0;
            return g;
        }
        g.w = (const unsigned char*)group_w[2 * z];
        g.rows = counts[z];
        g.list = lists + (long long)z * list_stride;
    } else {
        g.w = w;
        g.rows = rows;
        g.list = 0;
    }
    return g;
}

// Stores a lane's sums of weight tile `tile` for tokens tok0 + 2q and tok0 + 2q + 1: v[0], v[1]
// of row g, v[2], v[3] of row g+8. N weight rows; with SwiGLU (gate/up tiles: rows g are gate
// rows, g+8 the matching up rows) out[t, i] = silu(gate) * up, i < N / 2.
__device__ __forceinline__ void q_store(const Epilogue& e, float* out, const QGroup& grp, int N, int tile, int tok0, int g, int q, const float v[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int tok = tok0 + 2 * q + h;
        if (tok >= grp.rows) continue;
        long long orow = grp.list ? grp.list[tok] : tok;
        if (e.mode == EPI_SWIGLU) {
            int i = tile * 8 + g;
            if (i < (N >> 1)) out[orow * (N >> 1) + i] = siluf_(v[h]) * v[2 + h];
        } else {
            store_one(e, out, orow, tile * 16 + g, N, v[h]);
            store_one(e, out, orow, tile * 16 + g + 8, N, v[2 + h]);
        }
    }
}

__device__ __forceinline__ int weight_tiles(const Epilogue& e, int N) { return e.mode == EPI_SWIGLU ? ((N >> 1) + 7) / 8 : (N + 15) / 16; }

// ---- few rows ----

// Weight tiles a few-row block takes at once. One: a block per tile keeps the most blocks busy
// on narrow weights (4096 outputs are 256 tiles for some 264 resident blocks), where two tiles
// per block (one activation load feeding both) left half of them idle.
#define QFEW_WT 1

// A warp's loads of one step: QSTEP units of each of the QFEW_WT tiles of a tile group.
struct QStep {
    QUnit un[QSTEP][QFEW_WT];
};

// Loads the step of units u..u+QSTEP (below u1) of tile group `grp_i` (tiles QFEW_WT * grp_i + w
// below `tiles`).
__device__ __forceinline__ void q_load_step(QStep& st, const unsigned char* w, long long tile_bytes, int grp_i, int tiles, int u, int u1, int lane, u64 pol) {
#pragma unroll
    for (int i = 0; i < QSTEP; ++i)
#pragma unroll
        for (int t = 0; t < QFEW_WT; ++t) {
            int tile = QFEW_WT * grp_i + t;
            if (u + i < u1 && tile < tiles) q_load<true>(st.un[i][t], w + tile * tile_bytes + (long long)(u + i) * QUNIT_BYTES, lane, pol);
        }
}

// What a few-row block does before its inputs are ready: a plain launch's warps issue their
// first step of weight loads (weights never depend on the kernels before).
struct QFewStart {
    QStep st;
    bool loaded;
};

__device__ __forceinline__ QFewStart qmm_few_start(const unsigned char* w, int N, int K, const u64* group_w, const Epilogue& epi) {
    QFewStart s;
    s.loaded = false;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int nu = K / QU, ups = (nu + KSLICES - 1) / KSLICES, u0 = warp * ups, u1 = min(u0 + ups, nu);
    int tiles = weight_tiles(epi, N);
    if (group_w || blockIdx.y != 0 || (int)blockIdx.x * QFEW_WT >= tiles) return s;
    q_load_step(s.st, w, (long long)nu * QUNIT_BYTES, blockIdx.x, tiles, u0, u1, lane, evict_first_policy());
    s.loaded = true;
    return s;
}

// Up to 8*TT tokens per block: grid (tile groups, token blocks, groups), KSLICES warps, warp w
// owning k-slice w. Each block walks groups of QFEW_WT weight tiles in a grid-stride loop, its warps
// streaming their slice's units straight into registers (QSTEP units per tile of loads in
// flight, then their mmas), and adds the slices through shared memory.
// XSMEM: the block splits its tokens' rows into dynamic shared memory first (hi rows of K + 32
// elements, lo rows, block sums [rows][sums_stride], then a zero row), normalizing them by
// `norm_w` where given exactly as rms_norm_rows does; else the rows come split from qsplit
// (`xs`, lo halves `lo_off` further, `sums`). The arithmetic is the same either way.
template <int TT, bool XSMEM>
__device__ __forceinline__ void qmm_few_body(QFewStart& start, float* out, const float* x, const unsigned char* w_, int rows, int N, int K, const u64* group_w,
        const int* counts, const int* lists, int list_stride, int a_div, const int* active, const bf16_t* xs, long long lo_off, const float* sums, const Epilogue& epi,
        const float* norm_w, float eps) {
    extern __shared__ __align__(16) unsigned char qsm[];
    // Slice sums of up to QRED (tile, token tile) pairs at once.
    constexpr int QRED = QFEW_WT * TT < 8 ? QFEW_WT * TT : 8;
    __shared__ float red[KSLICES][QRED][32][4];
    __shared__ float scratch[33];
    __shared__ float row_inv[8 * TT];
    QGroup grp = qgroup_of(w_, rows, group_w, counts, lists, list_stride, active);
    int t0 = blockIdx.y * 8 * TT;
    if (t0 >= grp.rows) return;
    int nt = min(8 * TT, grp.rows - t0);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int nu = K / QU, ups = (nu + KSLICES - 1) / KSLICES, sstride = sums_stride(K);
    int u0 = warp * ups, u1 = min(u0 + ups, nu);
    QAct<TT> act;
    if (XSMEM) {
        int xstride = K + 32, nkb = K / 32;
        bf16_t* xh = (bf16_t*)qsm;
        float* ss = (float*)(qsm + 4LL * nt * xstride);
        if (norm_w) {
            // rms_norm_rows' register path at 256 threads: the same sums, the same inverse.
            for (int r = 0; r < nt; ++r) {
                int tok = t0 + r;
                long long arow = grp.list ? grp.list[tok] / a_div : tok;
                float4 v[RMS_VECS];
                row_float4s(v, (const float4*)(x + arow * K), K >> 2, blockDim.x);
                float ssum = block_sum(rms_partial(v), scratch);
                if (threadIdx.x == 0) row_inv[r] = 1.0f / sqrtf(ssum / (float)K + eps);
            }
            __syncthreads();
        }
        for (int i = threadIdx.x; i < nt * nkb; i += blockDim.x) {
            int r = i / nkb, kb = i % nkb, tok = t0 + r;
            long long arow = grp.list ? grp.list[tok] / a_div : tok;
            split_block(x + arow * K + kb * 32, xh + (long long)r * xstride + kb * 32, ss + r * sstride + kb, norm_w ? norm_w + kb * 32 : 0, norm_w ? row_inv[r] : 0.0f);
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            int r = 8 * j + g, r0 = 8 * j + 2 * q;
            act.x[j] = r < nt ? xh + (long long)r * xstride : 0;
            act.s[j][0] = r0 < nt ? ss + r0 * sstride : 0;
            act.s[j][1] = r0 + 1 < nt ? ss + (r0 + 1) * sstride : 0;
        }
    } else {
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            int r = 8 * j + g, r0 = 8 * j + 2 * q;
            auto arow = [&](int rr) -> long long { return grp.list ? grp.list[t0 + rr] / a_div : t0 + rr; };
            act.x[j] = r < nt ? xs + arow(r) * K : 0;
            act.s[j][0] = r0 < nt ? sums + arow(r0) * sstride : 0;
            act.s[j][1] = r0 + 1 < nt ? sums + arow(r0 + 1) * sstride : 0;
        }
    }
    int tiles = weight_tiles(epi, N), groups = (tiles + QFEW_WT - 1) / QFEW_WT, ttiles = (nt + 7) / 8;
    long long tile_bytes = (long long)nu * QUNIT_BYTES;
    u64 pol = evict_first_policy();
    for (int gi = blockIdx.x; gi < groups; gi += gridDim.x) {
        int wtiles = min(QFEW_WT, tiles - QFEW_WT * gi);
        float c[QFEW_WT][TT][4];
#pragma unroll
        for (int t = 0; t < QFEW_WT; ++t)
#pragma unroll
            for (int j = 0; j < TT; ++j) c[t][j][0] = c[t][j][1] = c[t][j][2] = c[t][j][3] = 0.0f;
        for (int u = u0; u < u1; u += QSTEP) {
            // The first step may have been loaded before the inputs were ready.
            if (!(start.loaded && gi == (int)blockIdx.x && u == u0)) q_load_step(start.st, grp.w, tile_bytes, gi, tiles, u, u1, lane, pol);
#pragma unroll
            for (int i = 0; i < QSTEP; ++i)
                if (u + i < u1) q_unit<TT, QFEW_WT>(c, start.st.un[i], act, (u + i) * QB, q, ttiles, wtiles);
        }
        // Pairs (tile t, token tile j) as items t * TT + j, QRED at a time: every warp writes its
        // slice sums, then warp i adds up item base + i: 0 + s0 + ... + s7.
#pragma unroll
        for (int base = 0; base < QFEW_WT * TT; base += QRED) {
#pragma unroll
            for (int i = 0; i < QRED; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) red[warp][i][lane][e] = c[(base + i) / TT][(base + i) % TT][e];
            __syncthreads();
            if (warp < QRED) {
                int item = base + warp, t = item / TT, j = item % TT;
                if (t < wtiles && j < ttiles) {
                    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    for (int s = 0; s < KSLICES; ++s)
#pragma unroll
                        for (int e = 0; e < 4; ++e) sum[e] += red[s][warp][lane][e];
                    q_store(epi, out, grp, N, QFEW_WT * gi + t, t0 + 8 * j, g, q, sum);
                }
            }
            __syncthreads();
        }
    }
}

// Arguments: as qmm_many's, plus the activations before any split (`x`), qsplit's outputs where
// the rows are not split in the kernel, and the RMSNorm weight the XSMEM kernels may apply to
// the rows first (null: none) with its epsilon.
#define QMM_FEW(NAME, TT, XSMEM, MIN_BLOCKS)                                                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * KSLICES, MIN_BLOCKS) NAME(float* out, const float* x, const unsigned char* w, int rows, int N, int K, const u64* group_w, \
            const int* counts, const int* lists, int list_stride, int a_div, const int* active, const bf16_t* xs, long long lo_off, const float* sums, Epilogue epi, \
            const float* norm_w, float eps) {                                                                                                              \
        QFewStart st = qmm_few_start(w, N, K, group_w, epi);                                                                                               \
        wait_for_inputs();                                                                                                                                 \
        qmm_few_body<TT, XSMEM>(st, out, x, w, rows, N, K, group_w, counts, lists, list_stride, a_div, active, xs, lo_off, sums, epi, norm_w, eps);          \
    }
// One token tile (decode up to 8 sequences): registers for three resident blocks per SM, whose
// weight loads keep the memory busier than two blocks' (FP8's wide blocks would spill: two).
#define QFEW1_BLOCKS (QFP8 && QU == 128 ? 2 : 3)
QMM_FEW(qmm_few1s, 1, true, QFEW1_BLOCKS)
QMM_FEW(qmm_few2s, 2, true, 1)
QMM_FEW(qmm_few1, 1, false, QFEW1_BLOCKS)
QMM_FEW(qmm_few2, 2, false, 1)
QMM_FEW(qmm_few4, 4, false, 1)
QMM_FEW(qmm_few8, 8, false, 1)

// ---- many rows ----

#define QM_TOKENS 64
#define QM_TILES 8
#define QM_STAGES 3
// Elements of K per stage, units per stage.
#define QM_SK 128
#define QM_UPS (QM_SK / QU)
#define QM_WBYTES (QM_TILES * QM_UPS * QUNIT_BYTES)
// bf16 elements per activation row of a stage (64 bytes of padding: rows g and g+1 of a
// quarter-warp's 16-byte loads fall on different banks).
#define QM_XSTRIDE (QM_SK + 32)
#define QM_XBYTES (QM_TOKENS * QM_XSTRIDE * 2)
#define QM_SBYTES (QM_TOKENS * 16)
#define QM_STAGE_BYTES (QM_WBYTES + 2 * QM_XBYTES + QM_SBYTES)

// Many tokens: grid (ceil(tiles / 8), ceil(rows / 64), groups), 256 threads as 4 (weight) x 2
// (token) warps of 2 weight tiles x 4 token tiles, a 3-stage cp.async pipeline over 128
// elements of K: the stage's unit tiles of 8 weight tiles, the tokens' split rows and block
// sums (from qsplit). Same per-element sequence and slice sums as qmm_few. Dynamic shared
// memory: QM_STAGES * QM_STAGE_BYTES.
// SPLIT (plain launches, few tiles): block x computes k-slice x % KSLICES of tile group
// x / KSLICES only, and stores its slice sums to `part` ([KSLICES][rows][tiles * 16]) for
// qreduce, which adds them as the other kernels do: more blocks where a weight has few tiles.
template <bool SPLIT>
__device__ __forceinline__ void qmm_many_body(float* out, const bf16_t* xs, long long lo_off, const float* sums, const unsigned char* w_, int rows, int N, int K,
        const u64* group_w, const int* counts, const int* lists, int list_stride, int a_div, const int* active, const Epilogue& epi, float* part) {
    extern __shared__ __align__(16) unsigned char qsm[];
    QGroup grp = qgroup_of(w_, rows, group_w, counts, lists, list_stride, active);
    int t0 = blockIdx.y * QM_TOKENS;
    if (t0 >= grp.rows) return;
    int my_slice = SPLIT ? blockIdx.x % KSLICES : 0;
    int tile0 = (SPLIT ? blockIdx.x / KSLICES : blockIdx.x) * QM_TILES;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int wm = warp >> 1, wn = warp & 1;
    int tiles = weight_tiles(epi, N);
    int nu = K / QU, ups = (nu + KSLICES - 1) / KSLICES, nstages = (K + QM_SK - 1) / QM_SK, sstride = sums_stride(K);
    // The stages this block walks: all, or those holding its slice's units [su0, su1).
    int su0 = SPLIT ? min(my_slice * ups, nu) : 0, su1 = SPLIT ? min(su0 + ups, nu) : nu;
    int first_stage = su0 / QM_UPS, last_stage = SPLIT ? (su1 + QM_UPS - 1) / QM_UPS : nstages;
    long long tile_bytes = (long long)nu * QUNIT_BYTES;
    // This thread's activation rows in every stage's copies: rows tid/16 + 16i.
    long long arow[4];
    bool aok[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int tok = t0 + (threadIdx.x >> 4) + 16 * i;
        aok[i] = tok < grp.rows;
        arow[i] = aok[i] ? (grp.list ? grp.list[tok] / a_div : tok) : 0;
    }
    auto load_stage = [&](int buf, int stage) {
        unsigned char* base = qsm + (long long)buf * QM_STAGE_BYTES;
        int ku0 = stage * QM_UPS, wbytes = min(QM_UPS, nu - ku0) * QUNIT_BYTES;
        const int wchunks = QM_UPS * QUNIT_BYTES / 16;
        for (int c = threadIdx.x; c < QM_TILES * wchunks; c += 256) {
            int t = c / wchunks, o = (c % wchunks) * 16;
            bool ok = tile0 + t < tiles && o < wbytes;
            const unsigned char* src = ok ? grp.w + (tile0 + t) * tile_bytes + (long long)ku0 * QUNIT_BYTES + o : grp.w;
            cp_async16(base + t * (QM_UPS * QUNIT_BYTES) + o, src, ok);
        }
        bf16_t* xh = (bf16_t*)(base + QM_WBYTES);
        float* sb = (float*)(base + QM_WBYTES + 2 * QM_XBYTES);
        int k0 = stage * QM_SK, kn = min(QM_SK, K - k0), o = (threadIdx.x & 15) * 8;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int r = (threadIdx.x >> 4) + 16 * i;
            bool ok = aok[i] && o < kn;
            const bf16_t* src = xs + arow[i] * K + k0 + (ok ? o : 0);
            cp_async16(xh + r * QM_XSTRIDE + o, src, ok);
            if ((threadIdx.x & 15) == 0) cp_async16(sb + r * 4, sums + arow[i] * sstride + stage * 4, aok[i]);
        }
    };
    float c[2][4][4], tot[2][4][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[m][j][e] = tot[m][j][e] = 0.0f;
#pragma unroll
    for (int s = 0; s < QM_STAGES - 1; ++s) {
        if (first_stage + s < last_stage) load_stage(s, first_stage + s);
        asm volatile("cp.async.commit_group;");
    }
    int slice = 0, slice_end = min(ups, nu);
    for (int stage = first_stage; stage < last_stage; ++stage) {
        int rel = stage - first_stage;
        asm volatile("cp.async.wait_group %0;" ::"n"(QM_STAGES - 2));
        __syncthreads();
        if (stage + QM_STAGES - 1 < last_stage) load_stage((rel + QM_STAGES - 1) % QM_STAGES, stage + QM_STAGES - 1);
        asm volatile("cp.async.commit_group;");
        const unsigned char* base = qsm + (long long)(rel % QM_STAGES) * QM_STAGE_BYTES;
        const bf16_t* xh = (const bf16_t*)(base + QM_WBYTES);
        const float* sb = (const float*)(base + QM_WBYTES + 2 * QM_XBYTES);
        QAct<4> act;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int r = wn * 32 + 8 * j;
            act.x[j] = xh + (r + g) * QM_XSTRIDE;
            act.s[j][0] = sb + (r + 2 * q) * 4;
            act.s[j][1] = sb + (r + 2 * q + 1) * 4;
        }
#pragma unroll
        for (int i = 0; i < QM_UPS; ++i) {
            int u = stage * QM_UPS + i;
            if (u >= su1) break;
            if (u < su0) continue;
            // The warp's two tiles, QWT at a time (one load of activations for both where QWT is 2).
#pragma unroll
            for (int m = 0; m < 2; m += QWT) {
                QUnit un[QWT];
#pragma unroll
                for (int t = 0; t < QWT; ++t) q_load<false>(un[t], base + (2 * wm + m + t) * (QM_UPS * QUNIT_BYTES) + i * QUNIT_BYTES, lane, 0);
                q_unit<4, QWT>((float(*)[4][4])c[m], un, act, i * QB, q, 4, QWT);
            }
            if (!SPLIT && u + 1 == slice_end) {
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            tot[m][j][e] += c[m][j][e];
                            c[m][j][e] = 0.0f;
                        }
                ++slice;
                slice_end = min((slice + 1) * ups, nu);
            }
        }
    }
    asm volatile("cp.async.wait_group 0;");
    if (SPLIT) {
        // This slice's sums (zeros for an empty slice) for qreduce.
        int np = tiles * 16;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            int tile = tile0 + 2 * wm + m;
            if (tile >= tiles) continue;
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    int tok = t0 + wn * 32 + 8 * j + 2 * q + h;
                    if (tok >= grp.rows) continue;
                    float* p = part + ((long long)my_slice * grp.rows + tok) * np + tile * 16 + g;
                    p[0] = c[m][j][h];
                    p[8] = c[m][j][2 + h];
                }
        }
        return;
    }
    // The empty slices after the last add their zero sums, as qmm_few's reduction does.
    for (; slice < KSLICES; ++slice)
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) tot[m][j][e] += 0.0f;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        int tile = tile0 + 2 * wm + m;
        if (tile >= tiles) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) q_store(epi, out, grp, N, tile, t0 + wn * 32 + 8 * j, g, q, tot[m][j]);
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) qmm_many(float* out, const bf16_t* xs, long long lo_off, const float* sums, const unsigned char* w, int rows, int N, int K,
        const u64* group_w, const int* counts, const int* lists, int list_stride, int a_div, const int* active, Epilogue epi) {
    wait_for_inputs();
    qmm_many_body<false>(out, xs, lo_off, sums, w, rows, N, K, group_w, counts, lists, list_stride, a_div, active, epi, 0);
}

// qmm_many's slices in blocks of their own (grid (tile groups * KSLICES, token blocks)), into
// `part`; qreduce adds and stores them.
extern "C" __global__ void __launch_bounds__(256, 1) qmm_many_split(float* part, const bf16_t* xs, long long lo_off, const float* sums, const unsigned char* w, int rows, int N,
        int K, Epilogue epi) {
    wait_for_inputs();
    qmm_many_body<true>(0, xs, lo_off, sums, w, rows, N, K, 0, 0, 0, 0, 1, 0, epi, part);
}

// The slice sums of qmm_many_split added in slice order from 0 (as every kernel adds them) and
// stored by `epi`: a thread per (token, tile, row pair g / g+8).
extern "C" __global__ void qreduce(float* out, const float* part, int rows, int N, Epilogue epi) {
    wait_for_inputs();
    int tiles = weight_tiles(epi, N), np = tiles * 16;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * tiles * 8) return;
    int tok = (int)(i / (tiles * 8)), rest = (int)(i % (tiles * 8)), tile = rest / 8, g = rest % 8;
    float v0 = 0.0f, v1 = 0.0f;
    for (int s = 0; s < KSLICES; ++s) {
        const float* p = part + ((long long)s * rows + tok) * np + tile * 16 + g;
        v0 += p[0];
        v1 += p[8];
    }
    if (epi.mode == EPI_SWIGLU) {
        int r = tile * 8 + g;
        if (r < (N >> 1)) out[(long long)tok * (N >> 1) + r] = siluf_(v0) * v1;
    } else {
        store_one(epi, out, tok, tile * 16 + g, N, v0);
        store_one(epi, out, tok, tile * 16 + g + 8, N, v1);
    }
}
