// Gated full attention: q/gate split, per-head q/k RMSNorm, partial NeoX RoPE, paged KV
// writes in the cache's KV format (attn_prep; the formats are in kv_formats.cuh), then causal
// attention per (token, head) over key tiles of 64 aligned to absolute positions, with an
// online softmax (attn_core). Every position, the step's own included, is read back from the
// cache, so a query sees the same stored keys and values whichever step wrote them. A rotated
// format (TurboQuant) rotates each query once and un-rotates each output once, and reads its
// keys and values as codebook levels times one scale per vector. A step whose every row is one token
// does both in one launch (attn_decode). A query's context is cut into ATTN_SPLITS contiguous
// ranges of whole tiles (their length from the context length alone); each range gets its own
// online softmax, and the range results are merged in range order (merge_scales, merge_sum).
// The ranges run in one block one after another, or, for steps with few rows, in blocks of
// their own whose results attn_combine merges: the same arithmetic either way. A query's
// arithmetic depends only on its own context, so it is the same alone, in any batch, and in
// any prefill split.

#define KEY_TILE 64
#define MAX_ELEMS_PER_THREAD 8
#define KEYS_PER_PASS 8
#define VALUES_IN_FLIGHT 32
#define ATTN_SPLITS 32

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

// The cache slot of position `p` of a row whose block table is `table`.
__device__ __forceinline__ long long table_slot(const int* table, int p, int block_size) {
    return (long long)table[p / block_size] * block_size + p % block_size;
}

// The cache slot of position `p` of token t's row, from the step's layout (written before the
// step's first launch).
__device__ __forceinline__ long long cache_slot(const int* tok_row, const RowInfo* rows, const int* block_tables, int t, int p, int block_size) {
    return table_slot(block_tables + rows[tok_row[t]].block_table_offset, p, block_size);
}

// One warp prepares one head row of `hd` elements into `dst`: the RMS norm (lane l sums
// elements l, l + 32, ... in order, then a butterfly), the norm weight `w`, and the NeoX
// rotation of the first `rot` elements at position `pos`; `normed` is hd floats of shared
// scratch. Products and sums are rounded one by one (no contraction), so attn_prep and
// attn_decode give a head the same bits.
__device__ __forceinline__ void norm_rope_head(float* dst, float* normed, const float* src, const float* w, const float* freq, int hd, int rot, int pos, float eps) {
    int lane = threadIdx.x & 31;
    __syncwarp();  // w and freq were stored by other lanes
    float x[MAX_DIMS_PER_LANE];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
        int d = lane + 32 * i;
        x[i] = d < hd ? src[d] : 0.0f;
        ss = __fmaf_rn(x[i], x[i], ss);
    }
    float inv = 1.0f / sqrtf(warp_sum(ss) / (float)hd + eps);
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
        int d = lane + 32 * i;
        if (d < hd) normed[d] = __fmul_rn(__fmul_rn(x[i], inv), w[d]);
    }
    __syncwarp();
    int half = rot / 2;
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
        int d = lane + 32 * i;
        if (d >= hd) break;
        float val = normed[d];
        if (d < rot) {
            float s, c;
            sincosf((float)pos * freq[d < half ? d : d - half], &s, &c);
            val = d < half ? __fsub_rn(__fmul_rn(val, c), __fmul_rn(normed[d + half], s)) : __fadd_rn(__fmul_rn(val, c), __fmul_rn(normed[d - half], s));
        }
        dst[d] = val;
    }
}

// One warp copies a row of `hd` (at most 32 * MAX_DIMS_PER_LANE) floats to `dst` and, where
// given, `dst2`: every load issued before the first store (a copy is its load latency).
__device__ __forceinline__ void copy_row_warp(float* dst, float* dst2, const float* src, int hd) {
    int lane = threadIdx.x & 31;
    float x[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) x[i] = lane + 32 * i < hd ? src[lane + 32 * i] : 0.0f;
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i)
        if (lane + 32 * i < hd) {
            dst[lane + 32 * i] = x[i];
            if (dst2) dst2[lane + 32 * i] = x[i];
        }
}

// The vector of kv head `kvh` at cache slot `slot`, as an index into a layer's planes.
__device__ __forceinline__ long long kv_vector(long long slot, int nkv, int kvh) {
    return slot * nkv + kvh;
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

// grid (T, nq + nkv), 64 threads per (token, head); dynamic shared memory: 4 * hd + rot / 2
// floats (normalized rows, weights, frequencies, then one row per warp). Warp 0 prepares the
// head row (a query head into `q_out`, rotated for a rotated format; a key head into the
// token's cache slot) while warp 1 copies the query's gate or stores the key's value.
template <class KV>
__device__ __forceinline__ void attn_prep_body(const AttnPrepStart& st, float* q_out, float* gate_out, KvCache kv, const float* qg, const float* k, const float* v,
        int nq, int nkv, int hd, int rot, float eps) {
    extern __shared__ float normed[];
    __syncthreads();  // the weights both warps copied
    int t = blockIdx.x, h = blockIdx.y, warp = threadIdx.x >> 5;
    float* row = normed + 2 * hd + rot / 2 + warp * hd;
    if (h < nq) {
        const float* src = qg + ((long long)t * nq + h) * 2 * hd;
        if (warp == 0) {
            norm_rope_head(row, normed, src, st.w, st.freq, hd, rot, st.pos, eps);
            if (KV::ROTATED) rotate_warp(row, hd, kv.tables);
            __syncwarp();
            copy_row_warp(q_out + ((long long)t * nq + h) * hd, 0, row, hd);
        } else {
            copy_row_warp(gate_out + ((long long)t * nq + h) * hd, 0, src + hd, hd);
        }
    } else {
        long long vec = kv_vector(st.slot, nkv, h - nq), src = ((long long)t * nkv + h - nq) * hd;
        if (warp == 0) {
            norm_rope_head(row, normed, k + src, st.w, st.freq, hd, rot, st.pos, eps);
            KV::store_warp(kv.k + vec * KV::row_bytes(hd), 0, kv.kp + vec * KV::PARAMS, row, hd, kv.tables);
        } else {
            copy_row_warp(row, 0, v + src, hd);
            KV::store_warp(kv.v + vec * KV::row_bytes(hd), 0, kv.vp + vec * KV::PARAMS, row, hd, kv.tables);
        }
    }
    if (threadIdx.x == 0) TRACE_MARK(TRACE_BLOCK_END);
}

// Whether the split blocks of attn_core and attn_decode pull their key and value rows into L2
// before waiting (`KESTREL_CUDA_DEFINES=ATTN_PREFETCH=0` for A/B runs).
#ifndef ATTN_PREFETCH
#define ATTN_PREFETCH 1
#endif

// Before a split block waits for its inputs: the first query head block of each kv group pulls
// its range's key and value rows into L2 (a decode block's time is its chain of loads, and the
// rows of earlier steps are in memory, not L2; on the H100, 35B-A3B decode 3.608-3.621 against
// 3.648-3.723 ms per step). Only the step's layout (written before the step's first launch) is
// read; a prefetch moves lines into L2 and reads nothing into the kernel, so the rows the
// launch before may be writing are no hazard.
template <class KV>
__device__ __forceinline__ void attn_prefetch_range(KvCache kv, const int* tok_row, const int* positions, const RowInfo* rows, const int* block_tables, int nq, int nkv,
        int hd, int block_size, int heads_per_block) {
    if (!ATTN_PREFETCH || gridDim.z == 1) return;
    int t = blockIdx.x, h0 = blockIdx.y * heads_per_block, group = nq / nkv;
    if (h0 % group != 0) return;
    int ctx = positions[t] + 1, span = range_keys(ctx), p = (int)blockIdx.z * span + (int)threadIdx.x;
    if ((int)threadIdx.x >= span || p >= ctx) return;
    int bytes = KV::row_bytes(hd);
    long long off = kv_vector(cache_slot(tok_row, rows, block_tables, t, p, block_size), nkv, h0 / group) * bytes;
#if __CUDA_ARCH__ >= 900
    if ((bytes & 15) == 0) {
        bulk_prefetch_l2(kv.k + off, bytes);
        bulk_prefetch_l2(kv.v + off, bytes);
        return;
    }
#endif
    for (int b = 0; b < bytes; b += 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(kv.k + off + b) : "memory");
        asm volatile("prefetch.global.L2 [%0];" ::"l"(kv.v + off + b) : "memory");
    }
}

// Whether attn_decode copies its first tile's values into shared memory before its wait
// (`KESTREL_CUDA_DEFINES=ATTN_VALUES_EARLY=0` for A/B runs).
#ifndef ATTN_VALUES_EARLY
#define ATTN_VALUES_EARLY 1
#endif

// attn_decode's shared memory after attn_body's own (one head per block), from a 16-byte
// boundary: the first tile's stored value rows (KEY_TILE * hd floats hold them in any format),
// the q and k norm weights, two heads' norm scratch, the new key and value rows, the
// rotation's frequencies.
struct DecodeSmem {
    float *values, *wq, *wk, *scratch, *key, *value, *freq;
};
__device__ __forceinline__ DecodeSmem decode_smem(int hd) {
    extern __shared__ float decode_sm[];
    float* b = decode_sm + ((hd + KEY_TILE + 5 + 3) & ~3);
    float* w = b + KEY_TILE * hd;
    DecodeSmem s = {b, w, w + hd, w + 2 * hd, w + 4 * hd, w + 5 * hd, w + 6 * hd};
    return s;
}

// The cache slots of the keys of a block's current tile, their values' scales (a scaled
// format), and a rotated format's codebook levels (KvTables, constant).
__shared__ long long attn_slots[KEY_TILE];
__shared__ float attn_value_scales[KEY_TILE];
__shared__ float attn_levels[8];

// Whether a row's queries see the key at position p: every cached position. The define plants
// vLLM's bug 40880 (verify rows of 1 + k tokens see only their own new tokens) to check that
// the tests catch it (cargo feature plant-verify-skips-cache).
#ifndef PLANT_VERIFY_SKIPS_CACHE
#define PLANT_VERIFY_SKIPS_CACHE 0
#endif

// What a block of attn_core or attn_decode knows before its inputs are ready: the query's
// context from the step's layout (written before the step's first launch), whether its range
// holds any key, its row's block table, and (attn_decode) the cache slot of the token's own
// position; attn_decode also copies its norm weights and the rotation's frequencies to shared
// memory, and starts the copies of its first tile's cached values (written by earlier steps).
struct AttnStart {
    int ctx, span;
    bool live;
    const int* table;
    long long slot;
    // attn_decode: the first key of the block's first tile, and whether that tile's slots are
    // in attn_slots and its values (but the token's own) on their way into shared memory.
    int k0;
    bool values_early;
    // The first position the queries see (0 but for the planted bug).
    int first;
};
template <class KV, bool DECODE>
__device__ __forceinline__ AttnStart attn_start(KvCache kv, const float* q_norm, const float* k_norm, const float* inv_freq, const int* tok_row, const int* positions,
        const RowInfo* rows, const int* block_tables, int nq, int nkv, int hd, int rot, int block_size, int heads_per_block) {
    attn_prefetch_range<KV>(kv, tok_row, positions, rows, block_tables, nq, nkv, hd, block_size, heads_per_block);
    AttnStart st;
    st.ctx = positions[blockIdx.x] + 1;
    st.span = range_keys(st.ctx);
    st.live = gridDim.z == 1 || (int)blockIdx.z * st.span < st.ctx;
    const RowInfo* row = rows + tok_row[blockIdx.x];
    st.table = block_tables + row->block_table_offset;
    st.first = PLANT_VERIFY_SKIPS_CACHE && row->kind == 1 && row->num_tokens > 1 ? row->start_position : 0;
    st.slot = 0;
    st.k0 = gridDim.z > 1 ? (int)blockIdx.z * st.span : 0;
    st.values_early = false;
    if (KV::ROTATED && threadIdx.x < 8) attn_levels[threadIdx.x] = kv.tables->levels[threadIdx.x];
    if (DECODE) {
        int p = st.ctx - 1;
        st.slot = table_slot(st.table, p, block_size);
        DecodeSmem s = decode_smem(hd);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            s.wq[d] = q_norm[d];
            s.wk[d] = k_norm[d];
        }
        for (int j = threadIdx.x; j < rot / 2; j += blockDim.x) s.freq[j] = inv_freq[j];
        // The first tile's values are cached rows of earlier steps (the token's own comes after
        // the wait): their copies run beside the launch before instead of in the block's chain.
        int bytes = KV::row_bytes(hd);
        st.values_early = ATTN_VALUES_EARLY && st.live && (bytes & 15) == 0;
        if (st.values_early) {
            int np = min(KEY_TILE, min(st.ctx, st.k0 + st.span) - st.k0);
            for (int i = threadIdx.x; i < np; i += blockDim.x) {
                int q = st.k0 + i;
                attn_slots[i] = table_slot(st.table, q, block_size);
            }
            __syncthreads();
            int kvh = blockIdx.y / (nq / nkv);
            unsigned char* tile = (unsigned char*)s.values;
            for (int c = threadIdx.x; c < np * (bytes / 16); c += blockDim.x) {
                int i = c / (bytes / 16), j = 16 * (c % (bytes / 16));
                if (st.k0 + i != p) cp_async16(tile + i * bytes + j, kv.v + kv_vector(attn_slots[i], nkv, kvh) * bytes + j, true);
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
    }
    return st;
}

// The attention of a block's query heads, after its wait. A block serves heads_per_block query
// heads of one kv group (sharing the key/value reads); the per-(query, head) arithmetic is
// identical for any heads_per_block. With gridDim.z == 1 a block walks all ranges and merges
// them; with gridDim.z == ATTN_SPLITS block z computes range z only and writes its (m, l, acc)
// to `partial` ([T][nq][ATTN_SPLITS][hd + 2]) for attn_combine (whose rotated version un-rotates
// the merged output).
//
// DECODE (attn_decode, every row one token, one head per block): the block prepares its query
// head from `q` (the q/gate projection) exactly as attn_prep does. Each block whose range holds
// the token's own position also prepares its kv head's new key from `k_new` and stores it and
// the value from `v_new` in the token's cache slot, then reads them back like any other key
// after its barrier. The group's query heads store the same bits in the same slot, so what a
// block reads back does not depend on which store lands last, and no block waits for another:
// one launch does what attn_prep and attn_core do in two.
template <class KV, bool DECODE>
__device__ __forceinline__ void attn_body(const AttnStart& st, float* out, const float* q, const float* gate, const float* k_new, const float* v_new, KvCache kv,
        int nq, int nkv, int hd, int rot, int block_size, int heads_per_block, float eps, float scale, float* partial) {
    if (!st.live) return;  // an empty range: attn_combine skips it
    extern __shared__ float sm[];
    long long* slots = attn_slots;
    float* vscale = attn_value_scales;
    const float* levels = attn_levels;
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
    int ctx = st.ctx, span = st.span, pos = ctx - 1;
    bool split = gridDim.z > 1;
    int bytes = KV::row_bytes(hd);
    if (DECODE) {
        DecodeSmem ds = decode_smem(hd);
        bool holds_own = !split || pos / span == (int)blockIdx.z;
        long long own = kv_vector(st.slot, nkv, kvh);
        __syncthreads();  // the weights every thread copied before the wait
        if (warp == 0) {
            norm_rope_head(qs, ds.scratch, q + ((long long)t * nq + h0) * 2 * hd, ds.wq, ds.freq, hd, rot, pos, eps);
            if (KV::ROTATED) rotate_warp(qs, hd, kv.tables);
        } else if (warp == 1 && holds_own) {
            norm_rope_head(ds.key, ds.scratch + hd, k_new + ((long long)t * nkv + kvh) * hd, ds.wk, ds.freq, hd, rot, pos, eps);
            KV::store_warp(kv.k + own * bytes, 0, kv.kp + own * KV::PARAMS, ds.key, hd, kv.tables);
        } else if (warp == 2 && holds_own) {
            copy_row_warp(ds.value, 0, v_new + ((long long)t * nkv + kvh) * hd, hd);
            unsigned char* early = st.values_early && pos - st.k0 < KEY_TILE ? (unsigned char*)ds.values + (pos - st.k0) * bytes : 0;
            KV::store_warp(kv.v + own * bytes, early, kv.vp + own * KV::PARAMS, ds.value, hd, kv.tables);
        }
    } else {
        for (int e = tid; e < hpb * hd; e += blockDim.x) qs[e] = q[(long long)t * nq * hd + (long long)h0 * hd + e];
    }
    if (tid < hpb) { mtot[tid] = NEG_INF; ltot[tid] = 0.0f; }
    const int* table = st.table;
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
        // attn_decode's first tile: slots and values copied before the wait.
        bool early = DECODE && st.values_early && p0 == st.k0;
        if (tid < np && !early) {
            int p = p0 + tid;
            slots[tid] = table_slot(table, p, block_size);
        }
        __syncthreads();
        if (KV::SCALED && tid < np) vscale[tid] = KV::scale(kv.vp + kv_vector(slots[tid], nkv, kvh) * KV::PARAMS);
        // Scores: one warp per (head, key), lanes over dims in a fixed stride, butterfly sum.
        // A warp loads its next KEYS_PER_PASS keys before summing any (loads in flight).
        for (int base = warp; base < hpb * KEY_TILE; base += nwarps * KEYS_PER_PASS) {
            typename KV::Lane kx[KEYS_PER_PASS];
            float ks[KEYS_PER_PASS];
#pragma unroll
            for (int u = 0; u < KEYS_PER_PASS; ++u) {
                int pi = base + u * nwarps, p = pi % KEY_TILE;
                bool live = pi < hpb * KEY_TILE && p < np;
                long long vec = kv_vector(live ? slots[p] : 0, nkv, kvh);
                KV::load_lane(kx[u], kv.k + vec * bytes, live ? hd : 0, lane);
                ks[u] = KV::SCALED && live ? KV::scale(kv.kp + vec * KV::PARAMS) : 1.0f;
            }
#pragma unroll
            for (int u = 0; u < KEYS_PER_PASS; ++u) {
                int pi = base + u * nwarps, g = pi / KEY_TILE, p = pi % KEY_TILE;
                if (pi >= hpb * KEY_TILE || p >= np) continue;
                float dot = KV::lane_dot(kx[u], qs + g * hd, hd, lane, levels);
                dot = warp_sum(dot);
                if (KV::SCALED) dot *= ks[u];
                if (PLANT_VERIFY_SKIPS_CACHE && p0 + p < st.first) dot = -1e30f;
                if (lane == 0) sc[g * KEY_TILE + p] = dot * scale;
            }
        }
        __syncthreads();
        // Online softmax, one warp per head: lane j takes keys j and j + 32 of the tile, the
        // tile's maximum and sum by butterflies (a fixed order, like every reduction here).
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
        if (early) asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
#pragma unroll
        for (int i = 0; i < MAX_ELEMS_PER_THREAD; ++i) {
            int e = tid + i * blockDim.x;
            if (e >= hpb * hd) break;
            int g = e / hd, d = e % hd;
            const float* s = sc + g * KEY_TILE;
            float a = acc[i] * corr[g];
            // A key's weight, times its value's scale for a scaled format.
#define VALUE_WEIGHT(p) (KV::SCALED ? s[p] * vscale[p] : s[p])
            if (early) {
                // The same products and sums, in key order, from shared memory.
                const unsigned char* tile = (const unsigned char*)decode_smem(hd).values;
#pragma unroll 8
                for (int p = 0; p < np; ++p) a += VALUE_WEIGHT(p) * KV::value(KV::load_elem(tile + p * bytes, d), levels);
                acc[i] = a;
                continue;
            }
            // Values loaded VALUES_IN_FLIGHT keys at a time before use (a decode block's time is
            // its chain of load latencies); the sum stays in key order.
            const unsigned char* vcol = kv.v + (long long)kvh * bytes;
            for (int p0v = 0; p0v < np; p0v += VALUES_IN_FLIGHT) {
                typename KV::Elem vv[VALUES_IN_FLIGHT];
#pragma unroll
                for (int u = 0; u < VALUES_IN_FLIGHT; ++u) vv[u] = p0v + u < np ? KV::load_elem(vcol + slots[p0v + u] * nkv * bytes, d) : 0;
#pragma unroll
                for (int u = 0; u < VALUES_IN_FLIGHT; ++u)
                    if (p0v + u < np) a += VALUE_WEIGHT(p0v + u) * KV::value(vv[u], levels);
            }
#undef VALUE_WEIGHT
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
    // A rotated format's outputs are rotated back, one warp per head, in the queries' place.
    if (KV::ROTATED) {
#pragma unroll
        for (int i = 0; i < MAX_ELEMS_PER_THREAD; ++i) {
            int e = tid + i * blockDim.x;
            if (e >= hpb * hd) break;
            qs[e] = tot[i] / ltot[e / hd];
        }
        __syncthreads();
        for (int g = warp; g < hpb; g += nwarps) unrotate_warp(qs + g * hd, hd, kv.tables);
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < MAX_ELEMS_PER_THREAD; ++i) {
        int e = tid + i * blockDim.x;
        if (e >= hpb * hd) break;
        int g = e / hd, d = e % hd;
        // The gate: the q/gate projection's second half (attn_decode), or attn_prep's copy.
        float gt = DECODE ? q[((long long)t * nq + h0 + g) * 2 * hd + hd + d] : gate[((long long)t * nq + h0 + g) * hd + d];
        float o = KV::ROTATED ? qs[e] : tot[i] / ltot[g];
        out[((long long)t * nq + h0 + g) * hd + d] = o * sigmoidf_(gt);
    }
    if (tid == 0) TRACE_MARK(TRACE_BLOCK_END);
}

// grid (T, nq), hd threads (rounded up to a warp): merges the ranges the split blocks wrote to
// `partial`, in range order, exactly as a block walking them merges them; ROTATED rotates the
// merged output back (`tables`, a rotated format's KvTables) through `hd` floats of dynamic
// shared memory, one warp, as attn_body does. The gate of head h is
// `gate[(t * nq + h) * gate_stride + d]` (attn_prep's copy, or the q/gate projection's second
// half). The context length comes from the step's layout (written before the step's first
// launch), read before the wait: it decides which partials are loaded.
template <bool ROTATED>
__device__ __forceinline__ void attn_combine_body(int ctx, float* out, const float* gate, const float* partial, int nq, int hd, int gate_stride, const KvTables* tables) {
    int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    int span = range_keys(ctx);
    float M = NEG_INF, L = 0.0f, ACC = 0.0f;
    // Every range's partial loaded before the first merge (the kernel's time is its loads).
    float pm0[ATTN_SPLITS], pm1[ATTN_SPLITS], pa[ATTN_SPLITS];
#pragma unroll
    for (int r = 0; r < ATTN_SPLITS; ++r) {
        const float* pm = partial + (((long long)t * nq + h) * ATTN_SPLITS + r) * (hd + 2);
        bool live = r * span < ctx;
        pm0[r] = live ? pm[0] : 0.0f;
        pm1[r] = live ? pm[1] : 0.0f;
        pa[r] = live && d < hd ? pm[2 + d] : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < ATTN_SPLITS; ++r) {
        if (r * span >= ctx) break;
        float c_old, c_new;
        M = merge_scales(M, pm0[r], &c_old, &c_new);
        L = merge_sum(L, pm1[r], c_old, c_new);
        if (d < hd) ACC = merge_sum(ACC, pa[r], c_old, c_new);
    }
    float o = ACC / L;
    if (ROTATED) {
        extern __shared__ float merged[];
        if (d < hd) merged[d] = o;
        __syncthreads();
        if (threadIdx.x < 32) unrotate_warp(merged, hd, tables);
        __syncthreads();
        if (d < hd) o = merged[d];
    }
    if (d < hd) out[((long long)t * nq + h) * hd + d] = o * sigmoidf_(gate[((long long)t * nq + h) * gate_stride + d]);
    if (d == 0) TRACE_MARK(TRACE_BLOCK_END);
}
// The kernels of one KV format KV, named attn_prep_NAME, attn_core_NAME, attn_decode_NAME and
// attn_combine_NAME; each format's module instantiates them once (backend/cuda/kernels.rs), so
// a format's kernels compile on their own.
//
// attn_prep: see attn_prep_body.
//
// attn_core: grid (T, nq / heads_per_block, 1 or ATTN_SPLITS), 256 threads: attention of rows
// attn_prep prepared (`q`, `gate`, and the keys and values in the cache). Dynamic shared
// memory: heads_per_block * (hd + KEY_TILE + 5) floats.
//
// attn_decode: grid (T, nq, 1 or ATTN_SPLITS), 256 threads: a step whose every row is one
// token, straight from the q/gate, key and value projections (attn_prep's work done in the
// same launch; its arguments after the first two are attn_prep's, then the scale). Two blocks
// per SM (128 registers; without the bound ptxas spilled 92 bytes). Dynamic shared memory:
// attn_body's hd + KEY_TILE + 5 floats rounded up to 4, then DecodeSmem's (KEY_TILE + 6) * hd +
// rot / 2 (gated_attention, backend/cuda/attention.rs).
//
// attn_combine: see attn_combine_body; dynamic shared memory hd floats for a rotated format.
#define ATTN_KERNELS(NAME, KV)                                                                                                                            \
    extern "C" __global__ void attn_prep_##NAME(float* q_out, float* gate_out, KvCache kv, const float* qg, const float* k, const float* v,                 \
            const float* q_norm, const float* k_norm, const float* inv_freq, const int* tok_row, const int* positions, const RowInfo* rows,                 \
            const int* block_tables, int nq, int nkv, int hd, int rot, int block_size, float eps) {                                                        \
        AttnPrepStart st = attn_prep_start(q_norm, k_norm, inv_freq, tok_row, positions, rows, block_tables, nq, hd, rot, block_size);                   \
        wait_for_inputs();                                                                                                                                \
        attn_prep_body<KV>(st, q_out, gate_out, kv, qg, k, v, nq, nkv, hd, rot, eps);                                                                     \
    }                                                                                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) attn_core_##NAME(float* out, const float* q, const float* gate, KvCache kv, const int* tok_row,      \
            const int* positions, const RowInfo* rows, const int* block_tables, int nq, int nkv, int hd, int block_size, int heads_per_block, float scale,  \
            float* partial) {                                                                                                                             \
        AttnStart st = attn_start<KV, false>(kv, 0, 0, 0, tok_row, positions, rows, block_tables, nq, nkv, hd, 0, block_size, heads_per_block);          \
        wait_for_inputs();                                                                                                                                \
        attn_body<KV, false>(st, out, q, gate, 0, 0, kv, nq, nkv, hd, 0, block_size, heads_per_block, 0.0f, scale, partial);                              \
    }                                                                                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 2) attn_decode_##NAME(float* out, float* partial, KvCache kv, const float* qg, const float* k,       \
            const float* v, const float* q_norm, const float* k_norm, const float* inv_freq, const int* tok_row, const int* positions, const RowInfo* rows, \
            const int* block_tables, int nq, int nkv, int hd, int rot, int block_size, float eps, float scale) {                                           \
        AttnStart st = attn_start<KV, true>(kv, q_norm, k_norm, inv_freq, tok_row, positions, rows, block_tables, nq, nkv, hd, rot, block_size, 1);       \
        wait_for_inputs();                                                                                                                                \
        attn_body<KV, true>(st, out, qg, 0, k, v, kv, nq, nkv, hd, rot, block_size, 1, eps, scale, partial);                                              \
    }                                                                                                                                                     \
    extern "C" __global__ void attn_combine_##NAME(float* out, const float* gate, const float* partial, const int* positions, int nq, int hd,              \
            int gate_stride, const KvTables* tables) {                                                                                                    \
        int ctx = positions[blockIdx.x] + 1;                                                                                                              \
        wait_for_inputs();                                                                                                                                \
        attn_combine_body<KV::ROTATED>(ctx, out, gate, partial, nq, hd, gate_stride, tables);                                                             \
    }
