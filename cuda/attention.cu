// Gated full attention: q/gate split, per-head q/k RMSNorm, partial NeoX RoPE, paged KV
// writes (attn_prep), then causal attention per (token, head) over key tiles of 64 aligned to
// absolute positions, with an online softmax (attn_core). A query's context is cut into
// ATTN_SPLITS contiguous ranges of whole tiles (their length from the context length alone);
// each range gets its own online softmax, and the range results are merged in range order
// (merge_scales, merge_sum). The ranges run in one block one after another, or, for steps with
// few rows, in blocks of their own whose results attn_combine merges; where every row has one
// token (decode), attn_decode does all three launches' work in one: the same arithmetic either
// way. A query's arithmetic depends only on its own context, so it is the same alone, in any
// batch, and in any prefill split.

#define KEY_TILE 64
#define MAX_ELEMS_PER_THREAD 8
#define MAX_DIMS_PER_LANE 8   // head_dim <= 256
#define KEYS_PER_PASS 8
#define VALUES_IN_FLIGHT 32
#define ATTN_SPLITS 32
static_assert(ATTN_SPLITS % 16 == 0, "merged_ranges loads ranges 16 at a time");

// Keys per range for a context of ctx keys: whole tiles, ATTN_SPLITS ranges covering ctx.
__device__ __forceinline__ int range_keys(int ctx) {
    return (ctx + ATTN_SPLITS * KEY_TILE - 1) / (ATTN_SPLITS * KEY_TILE) * KEY_TILE;
}

// Merging one range's (m, l, acc) into the running (M, L, ACC), ranges in order: the new
// maximum and the scales of the old totals and of the range (call only for non-empty ranges:
// l > 0, m finite), then L and each ACC element by merge_sum. Products and sums are rounded one
// by one (no contraction), so every kernel that merges gets the same bits.
__device__ __forceinline__ float merge_scales(float M, float m, float* c_old, float* c_new) {
    float mn = fmaxf(M, m);
    *c_old = expf(M - mn);
    *c_new = expf(m - mn);
    return mn;
}
__device__ __forceinline__ float merge_sum(float total, float part, float c_old, float c_new) {
    return __fadd_rn(__fmul_rn(total, c_old), __fmul_rn(part, c_new));
}

// The cache slot of position `p` of token t's row, from the step's layout (written before the
// step's first launch).
__device__ __forceinline__ long long cache_slot(const int* tok_row, const RowInfo* rows, const int* block_tables, int t, int p, int block_size) {
    RowInfo row = rows[tok_row[t]];
    return (long long)block_tables[row.block_table_offset + p / block_size] * block_size + p % block_size;
}

// What attn_prep reads before it waits for its inputs, each a round trip to memory that sat in
// its chain: the head's norm weight and the rotation's frequencies (weights), copied to shared
// memory after the `hd` floats of normalized rows, and the token's position and (key heads) its
// cache slot, from the step's layout, written before the step's first launch.
struct AttnPrepStart {
    const float* w;
    const float* freq;
    int pos;
    long long slot;
};
__device__ __forceinline__ AttnPrepStart attn_prep_start(const float* q_norm, const float* k_norm, const float* inv_freq, const int* tok_row, const int* positions,
        const RowInfo* rows, const int* block_tables, int nq, int hd, int rot, int block_size) {
    extern __shared__ float prep_smem[];
    int t = blockIdx.x, h = blockIdx.y;
    float* w = prep_smem + hd;
    float* freq = w + hd;
    const float* wsrc = h < nq ? q_norm : k_norm;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) w[d] = wsrc[d];
    for (int j = threadIdx.x; j < rot / 2; j += blockDim.x) freq[j] = inv_freq[j];
    AttnPrepStart st = {w, freq, positions[t], 0};
    if (h >= nq) st.slot = cache_slot(tok_row, rows, block_tables, t, st.pos, block_size);
    return st;
}

// One head row through its RMSNorm and the partial NeoX rotation, by 128 threads: thread i
// (0 .. 127, of warps i / 32 of the team) takes d = i, i + 128, ..., and the sum of squares goes
// through block_sum's tree at 128 threads (warp butterflies, then the first warp adds the 4 warp
// totals); `sync` is the team's barrier. attn_prep's blocks are one such team and attn_decode's
// have two (q heads, and the new key beside them), so both write the same bits. `w` and `freq`
// are in shared memory; `normed` (hd floats) and `scratch` (33) are the team's own. The result
// goes to dst[0 .. hd).
template <typename Barrier>
__device__ __forceinline__ void norm_rotate_head(float* dst, const float* src, const float* w, const float* freq, int pos, int hd, int rot, float eps, float* normed,
        float* scratch, int i, Barrier sync) {
    int lane = i & 31, warp = i >> 5;
    float ss = 0.0f;
    for (int d = i; d < hd; d += 128) ss += src[d] * src[d];
    ss = warp_sum(ss);
    sync();
    if (lane == 0) scratch[warp] = ss;
    sync();
    if (warp == 0) {
        float t = warp_sum(lane < 4 ? scratch[lane] : 0.0f);
        if (lane == 0) scratch[32] = t;
    }
    sync();
    float inv = 1.0f / sqrtf(scratch[32] / (float)hd + eps);
    for (int d = i; d < hd; d += 128) normed[d] = src[d] * inv * w[d];
    sync();
    int half = rot / 2;
    for (int d = i; d < hd; d += 128) {
        float val = normed[d];
        if (d < rot) {
            int j = d < half ? d : d - half;
            float s, c;
            sincosf((float)pos * freq[j], &s, &c);
            val = d < half ? normed[d] * c - normed[d + half] * s : normed[d] * c + normed[d - half] * s;
        }
        dst[d] = val;
    }
}

// grid (T, nq + nkv), 128 threads; dynamic shared memory: 2 * hd + rot / 2 floats.
extern "C" __global__ void attn_prep(float* q_out, float* gate_out, float* k_cache, float* v_cache, const float* qg, const float* k, const float* v,
        const float* q_norm, const float* k_norm, const float* inv_freq, const int* tok_row, const int* positions, const RowInfo* rows,
        const int* block_tables, int nq, int nkv, int hd, int rot, int block_size, float eps) {
    AttnPrepStart st = attn_prep_start(q_norm, k_norm, inv_freq, tok_row, positions, rows, block_tables, nq, hd, rot, block_size);
    wait_for_inputs();
    extern __shared__ float normed[];
    __shared__ float scratch[33];
    int t = blockIdx.x, h = blockIdx.y;
    bool is_q = h < nq;
    const float* src = is_q ? qg + (long long)t * nq * 2 * hd + (long long)h * 2 * hd : k + (long long)t * nkv * hd + (long long)(h - nq) * hd;
    float* dst;
    if (is_q) {
        dst = q_out + (long long)t * nq * hd + (long long)h * hd;
        const float* gsrc = src + hd;
        float* gdst = gate_out + (long long)t * nq * hd + (long long)h * hd;
        for (int d = threadIdx.x; d < hd; d += blockDim.x) gdst[d] = gsrc[d];
    } else {
        dst = k_cache + st.slot * nkv * hd + (long long)(h - nq) * hd;
        float* vdst = v_cache + st.slot * nkv * hd + (long long)(h - nq) * hd;
        const float* vsrc = v + (long long)t * nkv * hd + (long long)(h - nq) * hd;
        for (int d = threadIdx.x; d < hd; d += blockDim.x) vdst[d] = vsrc[d];
    }
    norm_rotate_head(dst, src, st.w, st.freq, st.pos, hd, rot, eps, normed, scratch, threadIdx.x, [] { __syncthreads(); });
    if (threadIdx.x == 0) TRACE_MARK(TRACE_BLOCK_END);
}

// Whether attn_core's split blocks pull their key and value rows into L2 before waiting
// (`KESTREL_CUDA_DEFINES=ATTN_PREFETCH=0` for A/B runs).
#ifndef ATTN_PREFETCH
#define ATTN_PREFETCH 1
#endif

// Before a split block of attn_core waits for its inputs: the first query head block of each
// kv group pulls its range's key and value rows into L2 (a decode block's time is its chain of
// loads, and the rows of earlier steps are in memory, not L2; on the H100, 35B-A3B decode
// 3.608-3.621 against 3.648-3.723 ms per step). Only the step's layout (written before the
// step's first launch) is read; a prefetch moves lines into L2 and reads nothing into the
// kernel, so the row attn_prep (the launch before) is writing is no hazard.
__device__ __forceinline__ void attn_prefetch_range(const float* k_cache, const float* v_cache, const int* tok_row, const int* positions, const RowInfo* rows,
        const int* block_tables, int nq, int nkv, int hd, int block_size, int heads_per_block) {
    if (!ATTN_PREFETCH || gridDim.z == 1) return;
    int t = blockIdx.x, h0 = blockIdx.y * heads_per_block, group = nq / nkv;
    if (h0 % group != 0) return;
    int ctx = positions[t] + 1, span = range_keys(ctx), p = (int)blockIdx.z * span + (int)threadIdx.x;
    if ((int)threadIdx.x >= span || p >= ctx) return;
    long long off = cache_slot(tok_row, rows, block_tables, t, p, block_size) * nkv * hd + (long long)(h0 / group) * hd;
#if __CUDA_ARCH__ >= 900
    if ((hd & 3) == 0) {
        bulk_prefetch_l2(k_cache + off, 4 * hd);
        bulk_prefetch_l2(v_cache + off, 4 * hd);
    }
#else
    for (int d = 0; d < hd; d += 32) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(k_cache + off + d) : "memory");
        asm volatile("prefetch.global.L2 [%0];" ::"l"(v_cache + off + d) : "memory");
    }
#endif
}

// What attn_decode (attn_core_body<true>) takes beyond attn_core's arguments: the raw
// projections (q and gate interleaved per head, the new key and value rows), the norm weights
// and the rotation's frequencies (copied to shared memory before the wait), 2 hd floats of
// scratch for the two norms, and the per-(token, head block) counts of finished ranges.
struct AttnFused {
    const float* qg;
    const float* k;
    const float* v;
    float* k_cache;
    float* v_cache;
    const float* wq;
    const float* wk;
    const float* freq;
    float* normed;
    int rot;
    float eps;
    unsigned* done;
};

// The ranges of (token t, head h) that attn_core wrote to `partial`, merged in range order
// (attn_core's own merge of walked ranges, bit for bit), for element d: the gated output.
// Partials are read from L2: in attn_decode other blocks of the same launch wrote them.
__device__ __forceinline__ float merged_ranges(const float* partial, int t, int h, int nq, int hd, int d, int ctx, float gate) {
    int span = range_keys(ctx);
    float M = NEG_INF, L = 0.0f, ACC = 0.0f;
    // The partials of MERGE_CHUNK ranges loaded before the first of them is merged (the merge's
    // time is its loads; a short context's live ranges fit in one chunk).
    const int MERGE_CHUNK = 16;
    for (int r0 = 0; r0 < ATTN_SPLITS && r0 * span < ctx; r0 += MERGE_CHUNK) {
        float pm0[MERGE_CHUNK], pm1[MERGE_CHUNK], pa[MERGE_CHUNK];
#pragma unroll
        for (int i = 0; i < MERGE_CHUNK; ++i) {
            const float* pm = partial + (((long long)t * nq + h) * ATTN_SPLITS + r0 + i) * (hd + 2);
            bool live = (r0 + i) * span < ctx;
            pm0[i] = live ? load_l2(pm) : 0.0f;
            pm1[i] = live ? load_l2(pm + 1) : 0.0f;
            pa[i] = live ? load_l2(pm + 2 + d) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < MERGE_CHUNK; ++i) {
            if ((r0 + i) * span >= ctx) break;
            float c_old, c_new;
            M = merge_scales(M, pm0[i], &c_old, &c_new);
            L = merge_sum(L, pm1[i], c_old, c_new);
            ACC = merge_sum(ACC, pa[i], c_old, c_new);
        }
    }
    return ACC / L * sigmoidf_(gate);
}

// Online softmax of a tile's scores `sc` ([hpb][KEY_TILE], np live), one warp per head: lane j
// takes keys j and j + 32, the tile's maximum and sum by butterflies (a fixed order, like every
// reduction here); the scores become their exponentials, and the head's running maximum and
// sum and the old sum's correction are updated.
__device__ __forceinline__ void tile_softmax(float* sc, float* mrun, float* lrun, float* corr, int hpb, int np) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int g = warp; g < hpb; g += nwarps) {
        float* s = sc + g * KEY_TILE;
        float s0 = lane < np ? s[lane] : NEG_INF, s1 = lane + 32 < np ? s[lane + 32] : NEG_INF;
        float mt = warp_max(fmaxf(mrun[g], fmaxf(s0, s1)));
        float e0 = lane < np ? expf(s0 - mt) : 0.0f, e1 = lane + 32 < np ? expf(s1 - mt) : 0.0f;
        if (lane < np) s[lane] = e0;
        if (lane + 32 < np) s[lane + 32] = e1;
        float sum = warp_sum(e0 + e1);
        if (lane == 0) {
            float c = expf(mrun[g] - mt);
            lrun[g] = lrun[g] * c + sum;
            mrun[g] = mt;
            corr[g] = c;
        }
    }
}

// attn_decode's end of a range, after its partial is stored: the block that finishes the last
// of its (token, head block)'s ranges merges them all (attn_combine's launch and hand-over
// saved). The count's atomic is acq_rel, ordered after the block's stores by the barrier
// (route_in_last_block does the same), and the count starts again from zero for the next
// launch.
__device__ __forceinline__ void merge_if_last(float* out, const float* partial, const AttnFused& f, int t, int h0, int hpb, int nq, int hd, int ctx, int span) {
    __shared__ int merges;
    int tid = threadIdx.x;
    __syncthreads();
    if (tid == 0) {
        unsigned* count = f.done + (long long)t * gridDim.y + blockIdx.y;
        unsigned before, live = (unsigned)((ctx + span - 1) / span);
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(count) : "memory");
        merges = before == live - 1;
        if (merges) *count = 0;
    }
    __syncthreads();
    if (!merges) return;
    for (int e = tid; e < hpb * hd; e += blockDim.x) {
        int g = e / hd, d = e % hd;
        float gate = f.qg[(long long)t * nq * 2 * hd + (long long)(h0 + g) * 2 * hd + hd + d];
        out[(long long)t * nq * hd + (long long)h0 * hd + e] = merged_ranges(partial, t, h0 + g, nq, hd, d, ctx, gate);
    }
}

// grid (T, nq / heads_per_block, 1 or ATTN_SPLITS), 256 threads. A block serves
// heads_per_block query heads of one kv group (sharing the key/value reads); the per-(query,
// head) arithmetic is identical for any heads_per_block. With gridDim.z == 1 a block walks all
// ranges and merges them; with gridDim.z == ATTN_SPLITS block z computes range z only and
// writes its (m, l, acc) to `partial` ([T][nq][ATTN_SPLITS][hd + 2]), which attn_combine
// merges, or (FUSED, attn_decode) the block that finishes a (token, head block)'s last range.
// Dynamic shared memory: heads_per_block * (hd + KEY_TILE + 5) floats (FUSED: then AttnFused's).
template <bool FUSED>
__device__ __forceinline__ void attn_core_body(float* out, const float* q, const float* gate, const float* k_cache, const float* v_cache, const int* tok_row,
        const int* positions, const RowInfo* rows, const int* block_tables, int nq, int nkv, int hd, int block_size, int heads_per_block, float scale, float* partial,
        const AttnFused& f) {
    extern __shared__ float sm[];
    __shared__ long long slots[KEY_TILE];
    int hpb = heads_per_block;
    float* qs = sm;                      // [hpb][hd]
    float* sc = qs + hpb * hd;           // [hpb][KEY_TILE]
    float* mrun = sc + hpb * KEY_TILE;   // [hpb]
    float* lrun = mrun + hpb;            // [hpb]
    float* corr = lrun + hpb;            // [hpb]
    float* mtot = corr + hpb;            // [hpb]
    float* ltot = mtot + hpb;            // [hpb]
    int t = blockIdx.x, h0 = blockIdx.y * hpb;
    int group = nq / nkv, kvh = h0 / group;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nwarps = blockDim.x >> 5;
    int ctx = positions[t] + 1;
    int span = range_keys(ctx);
    bool split = gridDim.z > 1;
    if (split && (int)blockIdx.z * span >= ctx) return;  // an empty range: the merge skips it
    if (FUSED) {
        // attn_prep's work for this block: its query heads normalized and rotated into shared
        // memory, and, in the block whose range holds the token's own position, the new key and
        // value into the cache before the keys are read. With one head per block, the blocks of
        // a kv group's heads write the same bits to the same row (attn_decode runs only where
        // every row of the step has one token, so no other token reads it).
        int pos = ctx - 1;
        __shared__ float scratch[2][33];
        // The weights attn_decode_start copied (by other threads) are in place.
        __syncthreads();
        if (warp < 4) {
            // Warps 0-3: the query heads.
            for (int g = 0; g < hpb; ++g)
                norm_rotate_head(qs + g * hd, f.qg + (long long)t * nq * 2 * hd + (long long)(h0 + g) * 2 * hd, f.wq, f.freq, pos, hd, f.rot, f.eps, f.normed, scratch[0],
                        tid, [] { asm volatile("bar.sync 1, 128;" ::: "memory"); });
        } else if ((int)blockIdx.z == pos / span) {
            // Warps 4-7, beside them: the new key and value row.
            long long at = cache_slot(tok_row, rows, block_tables, t, pos, block_size) * nkv * hd + (long long)kvh * hd;
            const float* vsrc = f.v + (long long)t * nkv * hd + (long long)kvh * hd;
            for (int d = tid - 128; d < hd; d += 128) f.v_cache[at + d] = vsrc[d];
            norm_rotate_head(f.k_cache + at, f.k + (long long)t * nkv * hd + (long long)kvh * hd, f.wk, f.freq, pos, hd, f.rot, f.eps, f.normed + hd, scratch[1],
                    tid - 128, [] { asm volatile("bar.sync 2, 128;" ::: "memory"); });
        }
    } else {
        for (int e = tid; e < hpb * hd; e += blockDim.x) qs[e] = q[(long long)t * nq * hd + (long long)h0 * hd + e];
    }
    if (tid < hpb) { mtot[tid] = NEG_INF; ltot[tid] = 0.0f; }
    RowInfo row = rows[tok_row[t]];
    const int* table = block_tables + row.block_table_offset;
    int kv_stride = nkv * hd;
    float tot[MAX_ELEMS_PER_THREAD];
#pragma unroll
    for (int i = 0; i < MAX_ELEMS_PER_THREAD; ++i) tot[i] = 0.0f;
    for (int r = split ? blockIdx.z : 0; r < (split ? (int)blockIdx.z + 1 : ATTN_SPLITS); ++r) {
    int k0 = r * span, k1 = min(ctx, k0 + span);
    if (k0 >= k1) break;  // this range and the later ones are empty (uniform across the block)
    float acc[MAX_ELEMS_PER_THREAD];
#pragma unroll
    for (int i = 0; i < MAX_ELEMS_PER_THREAD; ++i) acc[i] = 0.0f;
    if (tid < hpb) { mrun[tid] = NEG_INF; lrun[tid] = 0.0f; }
    __syncthreads();
    for (int p0 = k0; p0 < k1; p0 += KEY_TILE) {
        int np = min(KEY_TILE, k1 - p0);
        if (tid < np) {
            int p = p0 + tid;
            slots[tid] = (long long)table[p / block_size] * block_size + p % block_size;
        }
        __syncthreads();
        // Scores: one warp per (head, key), lanes over dims in a fixed stride, butterfly sum.
        // A warp loads its next KEYS_PER_PASS keys before summing any (loads in flight).
        for (int base = warp; base < hpb * KEY_TILE; base += nwarps * KEYS_PER_PASS) {
            float kv[KEYS_PER_PASS][MAX_DIMS_PER_LANE];
#pragma unroll
            for (int u = 0; u < KEYS_PER_PASS; ++u) {
                int pi = base + u * nwarps, p = pi % KEY_TILE;
                bool live = pi < hpb * KEY_TILE && p < np;
                const float* kr = k_cache + (live ? slots[p] : 0) * kv_stride + (long long)kvh * hd;
#pragma unroll
                for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) kv[u][i] = (live && lane + 32 * i < hd) ? kr[lane + 32 * i] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < KEYS_PER_PASS; ++u) {
                int pi = base + u * nwarps, g = pi / KEY_TILE, p = pi % KEY_TILE;
                if (pi >= hpb * KEY_TILE || p >= np) continue;
                const float* qr = qs + g * hd;
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < MAX_DIMS_PER_LANE; ++i)
                    if (lane + 32 * i < hd) dot += qr[lane + 32 * i] * kv[u][i];
                dot = warp_sum(dot);
                if (lane == 0) sc[g * KEY_TILE + p] = dot * scale;
            }
        }
        __syncthreads();
        tile_softmax(sc, mrun, lrun, corr, hpb, np);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < MAX_ELEMS_PER_THREAD; ++i) {
            int e = tid + i * blockDim.x;
            if (e >= hpb * hd) break;
            int g = e / hd, d = e % hd;
            const float* s = sc + g * KEY_TILE;
            float a = acc[i] * corr[g];
            const float* vcol = v_cache + (long long)kvh * hd + d;
            // Values loaded VALUES_IN_FLIGHT keys at a time before use (a decode block's time is
            // its chain of load latencies); the sum stays in key order.
            for (int p0v = 0; p0v < np; p0v += VALUES_IN_FLIGHT) {
                float vv[VALUES_IN_FLIGHT];
#pragma unroll
                for (int u = 0; u < VALUES_IN_FLIGHT; ++u) vv[u] = p0v + u < np ? vcol[slots[p0v + u] * kv_stride] : 0.0f;
#pragma unroll
                for (int u = 0; u < VALUES_IN_FLIGHT; ++u)
                    if (p0v + u < np) a += s[p0v + u] * vv[u];
            }
            acc[i] = a;
        }
        __syncthreads();
    }
    if (split) {
        // This range's result for attn_combine.
        for (int i = 0; i < MAX_ELEMS_PER_THREAD; ++i) {
            int e = tid + i * blockDim.x;
            if (e >= hpb * hd) break;
            int g = e / hd, d = e % hd;
            partial[(((long long)t * nq + h0 + g) * ATTN_SPLITS + r) * (hd + 2) + 2 + d] = acc[i];
        }
        if (tid < hpb) {
            float* pm = partial + (((long long)t * nq + h0 + tid) * ATTN_SPLITS + r) * (hd + 2);
            pm[0] = mrun[tid];
            pm[1] = lrun[tid];
        }
        if (FUSED) merge_if_last(out, partial, f, t, h0, hpb, nq, hd, ctx, span);
        if (tid == 0) TRACE_MARK(TRACE_BLOCK_END);
        return;
    }
    // Merge this range into the running totals: every thread reads the old totals, then one
    // thread per head updates them.
#pragma unroll
    for (int i = 0; i < MAX_ELEMS_PER_THREAD; ++i) {
        int e = tid + i * blockDim.x;
        if (e >= hpb * hd) break;
        int g = e / hd;
        float c_old, c_new;
        merge_scales(mtot[g], mrun[g], &c_old, &c_new);
        tot[i] = merge_sum(tot[i], acc[i], c_old, c_new);
    }
    __syncthreads();
    if (tid < hpb) {
        float c_old, c_new;
        mtot[tid] = merge_scales(mtot[tid], mrun[tid], &c_old, &c_new);
        ltot[tid] = merge_sum(ltot[tid], lrun[tid], c_old, c_new);
    }
    __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < MAX_ELEMS_PER_THREAD; ++i) {
        int e = tid + i * blockDim.x;
        if (e >= hpb * hd) break;
        int g = e / hd;
        long long o = (long long)t * nq * hd + (long long)h0 * hd + e;
        out[o] = tot[i] / ltot[g] * sigmoidf_(gate[o]);
    }
    if (tid == 0) TRACE_MARK(TRACE_BLOCK_END);
}

extern "C" __global__ void __launch_bounds__(256) attn_core(float* out, const float* q, const float* gate, const float* k_cache, const float* v_cache,
        const int* tok_row, const int* positions, const RowInfo* rows, const int* block_tables, int nq, int nkv, int hd, int block_size,
        int heads_per_block, float scale, float* partial) {
    attn_prefetch_range(k_cache, v_cache, tok_row, positions, rows, block_tables, nq, nkv, hd, block_size, heads_per_block);
    wait_for_inputs();
    attn_core_body<false>(out, q, gate, k_cache, v_cache, tok_row, positions, rows, block_tables, nq, nkv, hd, block_size, heads_per_block, scale, partial, AttnFused{});
}

// What attn_decode does before its inputs are ready: attn_core's L2 prefetch of its range's
// keys and values, and its norm weights and frequencies into shared memory. Dynamic shared
// memory (floats): attn_core's arrays (heads_per_block * (hd + KEY_TILE + 5)), then q_norm and
// k_norm (hd each), rot / 2 frequencies and 2 hd of norm scratch.
__device__ __forceinline__ AttnFused attn_decode_start(const float* qg, const float* k, const float* v, float* k_cache, float* v_cache, const float* q_norm,
        const float* k_norm, const float* inv_freq, const int* tok_row, const int* positions, const RowInfo* rows, const int* block_tables, int nq, int nkv, int hd,
        int rot, int block_size, int heads_per_block, float eps, unsigned* done) {
    attn_prefetch_range(k_cache, v_cache, tok_row, positions, rows, block_tables, nq, nkv, hd, block_size, heads_per_block);
    extern __shared__ float sm[];
    float* wq = sm + heads_per_block * (hd + KEY_TILE + 5);
    float* wk = wq + hd;
    float* freq = wk + hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        wq[d] = q_norm[d];
        wk[d] = k_norm[d];
    }
    for (int j = threadIdx.x; j < rot / 2; j += blockDim.x) freq[j] = inv_freq[j];
    return AttnFused{qg, k, v, k_cache, v_cache, wq, wk, freq, freq + rot / 2, rot, eps, done};
}

// attn_prep, attn_core's split blocks and attn_combine in one launch, for steps whose rows each
// have one token (decode): each block normalizes and rotates its own query heads, the block
// holding the token's position writes the new key and value row, and the block finishing a
// (token, head block)'s last range merges the ranges. The same arithmetic as the three
// launches, so the same bits. grid (T, nq / heads_per_block, ATTN_SPLITS), 256 threads; the
// arguments are the raw projections (attn_prep's), the cache, the weights, the layout, the
// shape, then the partials ([T][nq][ATTN_SPLITS][hd + 2]) and T * gridDim.y zeroed counts.
// Dynamic shared memory: see attn_decode_start.
extern "C" __global__ void __launch_bounds__(256) attn_decode(float* out, const float* qg, const float* k, const float* v, float* k_cache, float* v_cache,
        const float* q_norm, const float* k_norm, const float* inv_freq, const int* tok_row, const int* positions, const RowInfo* rows, const int* block_tables,
        int nq, int nkv, int hd, int rot, int block_size, int heads_per_block, float scale, float eps, float* partial, unsigned* done) {
    AttnFused f = attn_decode_start(qg, k, v, k_cache, v_cache, q_norm, k_norm, inv_freq, tok_row, positions, rows, block_tables, nq, nkv, hd, rot, block_size,
            heads_per_block, eps, done);
    wait_for_inputs();
    attn_core_body<true>(out, 0, 0, k_cache, v_cache, tok_row, positions, rows, block_tables, nq, nkv, hd, block_size, heads_per_block, scale, partial, f);
}

// grid (T, nq), hd threads (rounded up to a warp): merges the ranges attn_core wrote to
// `partial`, in range order, exactly as attn_core merges them in one block (merged_ranges).
// The context length comes from the step's layout (written before the step's first launch),
// read before the wait: it decides which partials are loaded.
extern "C" __global__ void attn_combine(float* out, const float* gate, const float* partial, const int* positions, int nq, int hd) {
    int ctx = positions[blockIdx.x] + 1;
    wait_for_inputs();
    int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (d < hd) {
        long long o = ((long long)t * nq + h) * hd + d;
        out[o] = merged_ranges(partial, t, h, nq, hd, d, ctx, gate[o]);
    }
    if (d == 0) TRACE_MARK(TRACE_BLOCK_END);
}
