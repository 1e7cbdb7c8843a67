// Attention on tensor cores for the bf16, fp8 and tq3 KV formats (attn_flash; the tiles each
// format loads are in attention_flash_tiles.cuh, which comes before this file): a block takes the
// query heads of one kv head for up to 64 / group consecutive tokens of one sequence (a query
// tile of at most 64 rows, a row being a (token, query head) pair) and walks the key tiles of 64
// keys aligned to absolute positions, reading each tile once for all its rows. QK^T and PV run
// as mma.sync m16n8k16 bf16 with f32 accumulation. Keys and values are bf16 (fp8's e4m3 values
// are bf16 values); q and the softmax weights are f32, so each is split into a bf16 part and a
// bf16 remainder, two MMAs per product (FlashAttention rounds them to bf16 once; that left
// outputs 2e-3 off the f32 reference, where the GPU-against-CPU checks allow 1e-3 on logits).
// fp8 keys and values are turned into bf16 tiles in shared memory
// (e4m3 values are bf16 values) with their per-vector scales applied in f32 to the scores and to
// the weights. tq3 (TurboQuant) tiles are its codebook levels looked up from the 3-bit codes,
// with the corrected norms applied as fp8's scales are. The levels are rounded to fp16 (11
// significant bits: within 2^-11 of the f32 levels, where bf16's 8 bits leave up to 2^-8,
// more than the checks against the f32 reference allow), so tq3's tiles, query parts and
// weight parts are fp16 and its MMAs f16 ones (the old per-(token, head) kernels multiplied
// f32 levels in f32). Attention runs in the rotated space: the queries are rotated once
// (attn_prep, or the decode launch's preparation) and each output is rotated back once, by
// the block that finishes the row or by attn_flash_combine. An MMA output element depends only
// on its own row of A and column of B, and every other step is per row, so a query's bits
// depend on its own context only:
//
// - A query with ctx keys cuts its tiles into at most FLASH_SPLITS ranges of flash_span(ctx)
//   tiles: each range an online softmax over its tiles, the ranges merged in order with
//   merge_scales / merge_sum. Rows of one query tile whose spans differ merge at their own
//   boundaries.
// - Keys after a query's position get weight exactly 0 (its maximum and sum then stay as they
//   were, its accumulators gain exact zeros), so the tiles a query's neighbours add leave its
//   bits unchanged. Key rows past the tile's last context are zero-filled, never read.
// - A step with few tokens gives each range of each token a block of its own (gridDim.z ==
//   FLASH_SPLITS) and attn_flash_combine merges the ranges in the same order with the same
//   arithmetic: decode, verify and prefill rows compute the same bits.
//
// Warps: all 8 compute, shared out over a run's 16-row tiles (8 on the one row tile of a
// decode token's query heads, 2 on each of 4): a tile's warps split its 64 keys for the scores
// (through shared memory, a named barrier per row tile), each then runs the whole softmax of its
// rows (the same bits in every warp) and accumulates its share of the head dim. The cache slots
// of the next tile are fetched while the current one computes.
//
// A step whose every row is one token (plain decode) skips attn_prep (attn_flash_decode): each
// block prepares its token's query heads itself with attn_prep's arithmetic (norm_rope_head),
// and the block whose range holds the token's own position also prepares its kv head's key and
// stores it and the value in the token's cache slot (store_warp), then reads them back from the
// cache like any other key after its barrier. No other block reads that slot (ranges are
// disjoint and every row is a sequence of its own), so the bits are attn_prep's and no block
// waits for another.

#define FLASH_SPLITS 32
#define FLASH_ROW_TILES 4
// Accumulator n-tiles of 8 columns per warp: half of a head dim of 256.
#define FLASH_MAX_NT 16
#define FLASH_MAX_KSTEPS 16
// f32 scores and weights of a key tile per query row, and the weights' 16-bit parts: rows
// padded so that a quad's rows (and ldmatrix's eight) fall in distinct banks.
#define FLASH_SCORE_STRIDE (KEY_TILE + 8)
// Whether a row tile's warps share its weights through shared memory (each computing those of
// its own keys) rather than each computing all 64 keys' (the same bits either way), where the
// launch gives the shared memory (not an A100's 163 KB at a head dim of 256).
#ifndef FLASH_SHARED_WEIGHTS
#define FLASH_SHARED_WEIGHTS 1
#endif

// Tiles per range for a query with ctx keys: the fewest that leave at most FLASH_SPLITS ranges.
__device__ __forceinline__ int flash_span(int ctx) {
    int tiles = (ctx + KEY_TILE - 1) / KEY_TILE;
    return (tiles + FLASH_SPLITS - 1) / FLASH_SPLITS;
}
__device__ __forceinline__ int flash_ranges(int ctx) {
    int tiles = (ctx + KEY_TILE - 1) / KEY_TILE, span = flash_span(ctx);
    return (tiles + span - 1) / span;
}

// One m16n8k16 MMA with f32 accumulation; F16: fp16 operands (tq3's tiles), else bf16.
template <bool F16>
__device__ __forceinline__ void flash_mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
    if (F16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats as bf16 pairs: their nearest bf16 values and the bf16 of what those leave out
// (a + b in bf16 pairs carries 16 significant bits of each float; K and V tiles are bf16 already,
// so scores and outputs come within f32 rounding of the f32 products).
__device__ __forceinline__ void split_bf16x2(float x0, float x1, u32* hi, u32* lo) {
    u32 h = pack_bf16x2(x0, x1);
    float r0 = __fsub_rn(x0, __uint_as_float(h << 16)), r1 = __fsub_rn(x1, __uint_as_float(h & 0xffff0000u));
    *hi = h;
    *lo = pack_bf16x2(r0, r1);
}
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// The same in fp16 pairs (22 significant bits of each float). fp16 holds magnitudes up to 65504:
// tq3's queries and weights times value norms stay far below it.
__device__ __forceinline__ void split_f16x2(float x0, float x1, u32* hi, u32* lo) {
    u32 h = pack_f16x2(x0, x1);
    float h0, h1;
    asm("{.reg .f16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;}" : "=f"(h0), "=f"(h1) : "r"(h));
    *hi = h;
    *lo = pack_f16x2(__fsub_rn(x0, h0), __fsub_rn(x1, h1));
}
template <bool F16>
__device__ __forceinline__ void flash_split(float x0, float x1, u32* hi, u32* lo) {
    if (F16)
        split_f16x2(x0, x1, hi, lo);
    else
        split_bf16x2(x0, x1, hi, lo);
}
__device__ __forceinline__ void ldsm_x4(u32 r[4], const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) : "memory");
}
__device__ __forceinline__ void ldsm_x2(u32 r[2], const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)) : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(u32 r[4], const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) : "memory");
}

// What attn_flash_decode's blocks prepare from: the q/gate projection, the step's keys and
// values, the q and k norm weights and the rotation's frequencies (attn_prep's inputs).
struct FlashPrep {
    const float *qg, *k, *v, *q_norm, *k_norm, *inv_freq;
    int rot;
    float eps;
};

// attn_flash_decode's preparation of token t (position pos) for kv head kvh: the group's query
// heads (rotated for a rotated format) into the 16-bit parts and remainders of query rows
// 0..group (zero rows after them), as attn_prep writes them and attn_flash's query load splits
// them; with `own`, the token's key
// and value stored in `slot`, as attn_prep stores them. One warp per head row, rows of
// `scratch` (2 * hd floats per warp: the norm's scratch, then the prepared row).
template <class KV>
__device__ __forceinline__ void flash_prepare_decode(const FlashPrep& p, KvCache kv, bf16_t* qs, bf16_t* qr, float* scratch, int t, int pos, long long slot, bool own,
        int nq, int nkv, int kvh, int hd, int stride) {
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nwarps = blockDim.x >> 5;
    int group = nq / nkv, half = hd / 2;
    for (int e = group * half + tid; e < FLASH_ROW_TILES * 16 * half; e += blockDim.x) {
        int r = e / half, d = 2 * (e % half);
        *(u32*)(qs + r * stride + d) = 0;
        *(u32*)(qr + r * stride + d) = 0;
    }
    float* normed = scratch + warp * 2 * hd;
    float* row = normed + hd;
    int jobs = group + (own ? 2 : 0);
    for (int j = warp; j < jobs; j += nwarps) {
        if (j < group) {
            norm_rope_head(row, normed, p.qg + ((long long)t * nq + kvh * group + j) * 2 * hd, p.q_norm, p.inv_freq, hd, p.rot, pos, p.eps);
            if (KV::ROTATED) rotate_warp(row, hd, kv.tables);
            __syncwarp();
            for (int d = 2 * lane; d < hd; d += 64) flash_split<FlashTile<KV>::F16>(row[d], row[d + 1], (u32*)(qs + j * stride + d), (u32*)(qr + j * stride + d));
        } else {
            long long vec = kv_vector(slot, nkv, kvh), src = ((long long)t * nkv + kvh) * hd;
            if (j == group) {
                norm_rope_head(row, normed, p.k + src, p.k_norm, p.inv_freq, hd, p.rot, pos, p.eps);
                KV::store_warp(kv.k + vec * KV::row_bytes(hd), 0, kv.kp + vec * KV::PARAMS, row, hd, kv.tables);
            } else {
                copy_row_warp(row, 0, p.v + src, hd);
                KV::store_warp(kv.v + vec * KV::row_bytes(hd), 0, kv.vp + vec * KV::PARAMS, row, hd, kv.tables);
            }
        }
        __syncwarp();  // the warp's scratch is read before its next head overwrites it
    }
}

// A warp's share of a run's row tiles: all 8 warps compute, 8 / 4 / 2 on each of the run's
// 1 / 2 / 3-4 row tiles (warps of a fourth tile that a run of 3 leaves unused only load). Each
// takes 8 / wpr of the tile's 8 key n-tiles for the scores and as much of the head dim's n-tiles
// for the accumulators; every score and accumulator element runs the same chain of MMAs
// whichever warp computes it, so a row's bits do not depend on how many rows share its block.
struct FlashWarp {
    int rt, u, wpr;  // row tile, index among its warps, warps per row tile
    int k0, nk;      // key n-tiles k0 .. k0 + nk of the scores
    int n0, nt;      // head-dim n-tiles n0 .. n0 + nt of the accumulators
    bool computes;
};
__device__ __forceinline__ FlashWarp flash_warp(int warp, int used_rows, int hd) {
    FlashWarp w;
    int tiles = (used_rows + 15) / 16, nts = hd / 8;
    w.wpr = tiles <= 1 ? 8 : tiles == 2 ? 4 : 2;
    w.rt = warp / w.wpr;
    w.u = warp % w.wpr;
    w.computes = w.rt < tiles;
    w.nk = 8 / w.wpr;
    w.k0 = w.u * w.nk;
    w.n0 = w.u * nts / w.wpr;
    w.nt = (w.u + 1) * nts / w.wpr - w.n0;
    return w;
}
// The warps of one row tile wait for each other (named barrier 1 + rt; 0 is __syncthreads').
__device__ __forceinline__ void flash_row_tile_sync(const FlashWarp& w) {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + w.rt), "r"(w.wpr * 32) : "memory");
}

// One row's softmax state: the running range (m, l and the accumulators in the caller's
// registers) and the merged total of the ranges before it.
struct FlashRow {
    int ctx, span;
    float m, l, mt, lt;
};

// Merges row i's running range into its total (merge_scales / merge_sum: attn_flash_combine's
// arithmetic) and starts an empty range.
__device__ __forceinline__ void flash_merge_row(FlashRow& r, int i, float acc[FLASH_MAX_NT][4], float tot[FLASH_MAX_NT][4], int nt) {
    float c_old, c_new;
    float mn = merge_scales(r.mt, r.m, &c_old, &c_new);
#pragma unroll
    for (int n = 0; n < FLASH_MAX_NT; ++n)
        if (n < nt) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                tot[n][2 * i + c] = merge_sum(tot[n][2 * i + c], acc[n][2 * i + c], c_old, c_new);
                acc[n][2 * i + c] = 0.0f;
            }
        }
    r.lt = merge_sum(r.lt, r.l, c_old, c_new);
    r.mt = mn;
    r.m = NEG_INF;
    r.l = 0.0f;
}

// Scores of the warp's row tile against its key n-tiles of the current tile, in order of head
// dims (per element: q's part, then its remainder, one key step after another), scaled and
// masked, into `scores` (f32 rows of FLASH_SCORE_STRIDE, a row per query row of the block).
template <class KV, bool F16>
__device__ __forceinline__ void flash_tile_scores(float* scores, const bf16_t* qs, const bf16_t* qr, const bf16_t* ks, const FlashWarp& w, const FlashRow row[2], int lane,
        int stride, int ksteps, int j, float scale, int first) {
    int g4 = lane >> 2, tig = lane & 3;
    float s[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[n][c] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < FLASH_MAX_KSTEPS; ++kk) {
        if (kk >= ksteps) break;
        u32 a[4], ar[4];
        int qoff = (w.rt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * stride + kk * 16 + ((lane >> 4) & 1) * 8;
        ldsm_x4(a, qs + qoff);
        ldsm_x4(ar, qr + qoff);
#pragma unroll
        for (int p = 0; p < 4; p += 2) {
            if (p >= w.nk) break;
            int key0 = (w.k0 + p) * 8;
            if (p + 1 < w.nk) {
                u32 b[4];
                ldsm_x4(b, ks + (key0 + (lane & 7) + ((lane >> 4) & 1) * 8) * stride + kk * 16 + ((lane >> 3) & 1) * 8);
                flash_mma<F16>(s[p], a, b[0], b[1]);
                flash_mma<F16>(s[p], ar, b[0], b[1]);
                flash_mma<F16>(s[p + 1], a, b[2], b[3]);
                flash_mma<F16>(s[p + 1], ar, b[2], b[3]);
            } else {
                u32 b[2];
                ldsm_x2(b, ks + (key0 + (lane & 7)) * stride + kk * 16 + ((lane >> 3) & 1) * 8);
                flash_mma<F16>(s[p], a, b[0], b[1]);
                flash_mma<F16>(s[p], ar, b[0], b[1]);
            }
        }
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        if (p >= w.nk) break;
        int n = w.k0 + p;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float x[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                int key = j * KEY_TILE + n * 8 + 2 * tig + c;
                x[c] = s[p][2 * i + c];
                if (KV::SCALED) x[c] = __fmul_rn(x[c], flash_kscale[key - j * KEY_TILE]);
                x[c] = __fmul_rn(x[c], scale);
                if (PLANT_VERIFY_SKIPS_CACHE && key < first) x[c] = -1e30f;
                if (key >= row[i].ctx) x[c] = NEG_INF;
            }
            *(float2*)(scores + (w.rt * 16 + g4 + 8 * i) * FLASH_SCORE_STRIDE + n * 8 + 2 * tig) = make_float2(x[0], x[1]);
        }
    }
}

// grid (ceil(T / tokens_per_block), nkv, 1 or FLASH_SPLITS), 256 threads (flash_warps: all 8
// on a run's row tiles, so a decode block of one token computes with all 8); rows =
// tokens_per_block * group, at most 64; with FLASH_SPLITS, tokens_per_block is 1 and
// block z computes range z of its token's query heads into `partial` ([T][nq][FLASH_SPLITS]
// [hd + 2]: m, l, then the hd accumulators). Dynamic shared memory: (2 * 64 + 2 * KEY_TILE) *
// (hd + 8) bf16 (queries, keys, values; rows padded by 16 bytes so that
// ldmatrix's eight rows fall in distinct banks), then 64 rows of FLASH_SCORE_STRIDE f32 scores,
// then where it fits as many of f32 weights, and of the weights' 16-bit parts and of their
// remainders, and after those for a staging format (tq3) a tile's stored key and value rows
// (2 * KEY_TILE * row_bytes): the kernel uses what the launch's dynamic shared memory holds.
// The gate of (token t, head h) is
// gate[(t * nq + h) * gate_stride + d]. PREP (attn_flash_decode, tokens_per_block 1): the
// queries, keys and values come from `prep` (flash_prepare_decode) instead of `q` and the cache.
template <class KV, bool PREP>
__device__ __forceinline__ void attn_flash_body(float* out, const float* q, const float* gate, int gate_stride, KvCache kv, const int* tok_row, const int* positions,
        const RowInfo* rows, const int* block_tables, int num_tokens, int nq, int nkv, int hd, int block_size, int tokens_per_block, float scale, float* partial,
        const FlashPrep& prep) {
    extern __shared__ __align__(16) unsigned char flash_smem[];
    constexpr bool F16 = FlashTile<KV>::F16;
    const int stride = hd + 8, nrt = FLASH_ROW_TILES;
    bf16_t* qs = (bf16_t*)flash_smem;              // q's bf16 parts
    bf16_t* qr = qs + nrt * 16 * stride;           // and its remainders
    bf16_t* ks = qr + nrt * 16 * stride;
    bf16_t* vs = ks + KEY_TILE * stride;
    float* scores = (float*)(vs + KEY_TILE * stride);
    // Where the launch gave the shared memory for them (attention.rs, after the scores): the
    // weights' buffers, then a staging format's codes.
    float* weights = scores + nrt * 16 * FLASH_SCORE_STRIDE;
    bf16_t* weight_parts = (bf16_t*)(weights + nrt * 16 * FLASH_SCORE_STRIDE);
    bf16_t* weight_rems = weight_parts + nrt * 16 * FLASH_SCORE_STRIDE;
    unsigned char* raw = (unsigned char*)(weight_rems + nrt * 16 * FLASH_SCORE_STRIDE);
    unsigned smem_given;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_given));
    const bool share = FLASH_SHARED_WEIGHTS && smem_given >= (unsigned)(raw - flash_smem);
    const bool staged = FlashTile<KV>::stages(hd) && smem_given >= (unsigned)(raw - flash_smem) + FlashTile<KV>::stage_bytes(hd);
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g4 = lane >> 2, tig = lane & 3;
    int group = nq / nkv, kvh = blockIdx.y, nrows = tokens_per_block * group;
    int ksteps = hd / 16;
    bool split = gridDim.z > 1;
    int tb = blockIdx.x * tokens_per_block, te = min(num_tokens, tb + tokens_per_block);
    FlashTile<KV>::setup(kv);  // read after the first tile's barriers
    // The block's tokens as runs of one sequence each (a step's rows are contiguous).
    for (int t0 = tb; t0 < te;) {
        int seq = tok_row[t0], t1 = t0 + 1;
        while (t1 < te && tok_row[t1] == seq) ++t1;
        const RowInfo* ri = rows + seq;
        const int* table = block_tables + ri->block_table_offset;
        int first = PLANT_VERIFY_SKIPS_CACHE && ri->kind == 1 && ri->num_tokens > 1 ? ri->start_position : 0;
        int kmax = 0;
        for (int t = t0; t < t1; ++t) kmax = max(kmax, positions[t] + 1);
        int j0 = 0, j1 = (kmax + KEY_TILE - 1) / KEY_TILE;
        if (split) {
            int span = flash_span(kmax);
            j0 = (int)blockIdx.z * span;
            j1 = min(j1, j0 + span);
        }
        FlashWarp w = flash_warp(warp, (t1 - t0) * group, hd);
        if (PREP) {
            // One token: the block whose tiles hold its own position stores its key and value
            // (the key and value tiles' memory is the preparation's scratch until the first load).
            int pos = kmax - 1;
            bool own = j0 <= pos / KEY_TILE && pos / KEY_TILE < j1;
            if (j0 < j1) flash_prepare_decode<KV>(prep, kv, qs, qr, (float*)ks, t0, pos, table_slot(table, pos, block_size), own, nq, nkv, kvh, hd, stride);
        } else {
            // The run's query rows as 16-bit pairs (zero rows for the tile's unused rows).
            int half = hd / 2;
            for (int e = tid; e < nrt * 16 * half; e += blockDim.x) {
                int r = e / half, d = 2 * (e % half), t = t0 + r / group;
                u32 hi = 0, lo = 0;
                if (r < nrows && t < t1) {
                    const float* src = q + ((long long)t * nq + kvh * group + r % group) * hd + d;
                    flash_split<F16>(src[0], src[1], &hi, &lo);
                }
                *(u32*)(qs + r * stride + d) = hi;
                *(u32*)(qr + r * stride + d) = lo;
            }
        }
        // This thread's two rows: g4 and g4 + 8 of the warp's row tile.
        FlashRow row[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            int r = w.rt * 16 + g4 + 8 * i, t = t0 + r / group;
            row[i].ctx = w.computes && r < nrows && t < t1 ? positions[t] + 1 : 0;
            row[i].span = flash_span(max(row[i].ctx, 1));
            row[i].m = row[i].mt = NEG_INF;
            row[i].l = row[i].lt = 0.0f;
        }
        float acc[FLASH_MAX_NT][4], tot[FLASH_MAX_NT][4];
#pragma unroll
        for (int n = 0; n < FLASH_MAX_NT; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[n][c] = tot[n][c] = 0.0f;
        // Tile j's cache slots are in flash_slots[j & 1]; the next tile's are fetched into a
        // register while a tile computes, and a staging format's next codes copied likewise.
        typename FlashTile<KV>::Stage stage;
        long long next_slot = -1;
        if (tid < KEY_TILE && j0 < j1) {
            int p = j0 * KEY_TILE + tid;
            flash_slots[j0 & 1][tid] = p < kmax ? table_slot(table, p, block_size) : -1;
            p += KEY_TILE;
            next_slot = j0 + 1 < j1 && p < kmax ? table_slot(table, p, block_size) : -1;
        }
        __syncthreads();  // the first slots are stored (and a decode token's key and value)
        if (staged && j0 < j1) FlashTile<KV>::issue(raw, stage, flash_slots[j0 & 1], kv, nkv, kvh, hd);
        for (int j = j0; j < j1; ++j) {
            // A row whose next range starts here (and holds keys) merges the range it ends.
            if (!split && j > 0) {
#pragma unroll
                for (int i = 0; i < 2; ++i)
                    if (j % row[i].span == 0 && j * KEY_TILE < row[i].ctx) flash_merge_row(row[i], i, acc, tot, w.nt);
            }
            asm volatile("cp.async.wait_all;" ::: "memory");
            __syncthreads();  // the last tile's reads are done (and this tile's codes staged)
            if (staged)
                FlashTile<KV>::convert(ks, vs, raw, stage, flash_slots[j & 1], hd, stride);
            else
                FlashTile<KV>::load(ks, vs, kv, flash_slots[j & 1], nkv, kvh, hd, stride);
            if (tid < KEY_TILE) {
                flash_slots[(j + 1) & 1][tid] = next_slot;
                int p = (j + 2) * KEY_TILE + tid;
                next_slot = j + 2 < j1 && p < kmax ? table_slot(table, p, block_size) : -1;
            }
            __syncthreads();  // the tile is stored, and the next tile's slots
            if (staged && j + 1 < j1) FlashTile<KV>::issue(raw, stage, flash_slots[(j + 1) & 1], kv, nkv, kvh, hd);
            // Warps of unused row tiles only help with the loads.
            if (!w.computes) continue;
            flash_tile_scores<KV, F16>(scores, qs, qr, ks, w, row, lane, stride, ksteps, j, scale, first);
            flash_row_tile_sync(w);  // the row tile's scores are stored
            // The row tile's 64 scores, this thread's keys of rows g4 and g4 + 8 as in an MMA
            // accumulator: key n * 8 + 2 tig + (c & 1) of row g4 + 8 (c >> 1).
            float s[8][4];
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int n = 0; n < 8; ++n)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    float2 x = *(const float2*)(scores + (w.rt * 16 + g4 + 8 * i) * FLASH_SCORE_STRIDE + n * 8 + 2 * tig);
                    s[n][2 * i] = x.x;
                    s[n][2 * i + 1] = x.y;
                }
#pragma unroll
            for (int n = 0; n < 8; ++n)
#pragma unroll
                for (int c = 0; c < 4; ++c) mx[c >> 1] = fmaxf(mx[c >> 1], s[n][c]);
            // Online softmax per row: the row's 64 scores sit in the four lanes of a quad,
            // reduced lane by lane in key order, then across the quad by butterflies.
            float corr[2], base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 1));
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(FULL_MASK, mx[i], 2));
                float mn = fmaxf(row[i].m, mx[i]);
                // A row without keys yet (an unused row) keeps zeros instead of NaNs.
                base[i] = mn == NEG_INF ? 0.0f : mn;
                corr[i] = expf(__fsub_rn(row[i].m, base[i]));
                row[i].m = mn;
            }
            u32 pa[4][4], pr[4][4];
            if (share) {
            // Each warp turns its own key n-tiles' scores into weights, p (for the row sums) and
            // p times the value scale as 16-bit parts and remainders, through shared memory to
            // the row tile's other warps: the sums then run over the 64 keys in key order and
            // the parts load as the A fragments the registers would hold.
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                if (q >= w.nk) break;
                int n = w.k0 + q, col = n * 8 + 2 * tig;
                // (The scores again from shared memory: s[n] at a warp-dependent n would not stay in registers.)
                float2 x0 = *(const float2*)(scores + (w.rt * 16 + g4) * FLASH_SCORE_STRIDE + col);
                float2 x1 = *(const float2*)(scores + (w.rt * 16 + g4 + 8) * FLASH_SCORE_STRIDE + col);
                float x[4] = {x0.x, x0.y, x1.x, x1.y}, p[4], pv[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    p[c] = expf(__fsub_rn(x[c], base[c >> 1]));
                    pv[c] = KV::SCALED ? __fmul_rn(p[c], flash_vscale[col + (c & 1)]) : p[c];
                }
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    int r = w.rt * 16 + g4 + 8 * i;
                    u32 hi, lo;
                    flash_split<F16>(pv[2 * i], pv[2 * i + 1], &hi, &lo);
                    *(float2*)(weights + r * FLASH_SCORE_STRIDE + col) = make_float2(p[2 * i], p[2 * i + 1]);
                    *(u32*)(weight_parts + r * FLASH_SCORE_STRIDE + col) = hi;
                    *(u32*)(weight_rems + r * FLASH_SCORE_STRIDE + col) = lo;
                }
            }
            flash_row_tile_sync(w);  // the row tile's weights are stored
#pragma unroll
            for (int n = 0; n < 8; ++n)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    float2 p = *(const float2*)(weights + (w.rt * 16 + g4 + 8 * i) * FLASH_SCORE_STRIDE + n * 8 + 2 * tig);
                    sum[i] = __fadd_rn(sum[i], p.x);
                    sum[i] = __fadd_rn(sum[i], p.y);
                }
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                int off = (w.rt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * FLASH_SCORE_STRIDE + kk * 16 + ((lane >> 4) & 1) * 8;
                ldsm_x4(pa[kk], weight_parts + off);
                ldsm_x4(pr[kk], weight_rems + off);
            }
            } else {
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                float pv[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    float p = expf(__fsub_rn(s[n][c], base[c >> 1]));
                    sum[c >> 1] = __fadd_rn(sum[c >> 1], p);
                    pv[c] = KV::SCALED ? __fmul_rn(p, flash_vscale[n * 8 + 2 * tig + (c & 1)]) : p;
                }
                // The weights as the A fragment of key step n / 2 (keys 16 (n / 2) ...).
                flash_split<F16>(pv[0], pv[1], &pa[n >> 1][(n & 1) * 2], &pr[n >> 1][(n & 1) * 2]);
                flash_split<F16>(pv[2], pv[3], &pa[n >> 1][(n & 1) * 2 + 1], &pr[n >> 1][(n & 1) * 2 + 1]);
            }
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                sum[i] = __fadd_rn(sum[i], __shfl_xor_sync(FULL_MASK, sum[i], 1));
                sum[i] = __fadd_rn(sum[i], __shfl_xor_sync(FULL_MASK, sum[i], 2));
                row[i].l = __fadd_rn(__fmul_rn(row[i].l, corr[i]), sum[i]);
            }
#pragma unroll
            for (int n = 0; n < FLASH_MAX_NT; ++n)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[n][c] = __fmul_rn(acc[n][c], corr[c >> 1]);
            // Weights times values, in key order, for this warp's columns of the head dims
            // (n-tiles w.n0 .. w.n0 + w.nt; a pair's second may lie in the rows' padding, unused).
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
                for (int np = 0; np < FLASH_MAX_NT / 2; ++np) {
                    if (2 * np >= w.nt) break;
                    u32 b[4];
                    ldsm_x4_trans(b, vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * stride + (w.n0 + 2 * np) * 8 + ((lane >> 4) & 1) * 8);
                    flash_mma<F16>(acc[2 * np], pa[kk], b[0], b[1]);
                    flash_mma<F16>(acc[2 * np], pr[kk], b[0], b[1]);
                    if (2 * np + 1 < w.nt) {
                        flash_mma<F16>(acc[2 * np + 1], pa[kk], b[2], b[3]);
                        flash_mma<F16>(acc[2 * np + 1], pr[kk], b[2], b[3]);
                    }
                }
            }
        }
        // Results: this thread's elements of rows g4 and g4 + 8, columns 2 tig, 2 tig + 1 of
        // each of its n-tiles. A rotated format's finished rows go through shared memory
        // (the key and value tiles' place, f32 rows of hd) to be rotated back one warp a row.
        float* rotated = (float*)ks;
        if (KV::ROTATED && !split) __syncthreads();  // the last tile's reads are done
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            int r = w.rt * 16 + g4 + 8 * i;
            if (row[i].ctx == 0) continue;
            int t = t0 + r / group, h = kvh * group + r % group;
            if (split) {
                if (j0 >= j1) continue;
                float* pm = partial + (((long long)t * nq + h) * FLASH_SPLITS + blockIdx.z) * (hd + 2);
                if (w.u == 0 && tig == 0) {
                    pm[0] = row[i].m;
                    pm[1] = row[i].l;
                }
#pragma unroll
                for (int n = 0; n < FLASH_MAX_NT; ++n)
                    if (n < w.nt) {
                        int d = (w.n0 + n) * 8 + 2 * tig;
                        pm[2 + d] = acc[n][2 * i];
                        pm[3 + d] = acc[n][2 * i + 1];
                    }
                continue;
            }
            flash_merge_row(row[i], i, acc, tot, w.nt);
            if (KV::ROTATED) {
                // To shared memory, rotated back below.
#pragma unroll
                for (int n = 0; n < FLASH_MAX_NT; ++n)
                    if (n < w.nt) {
#pragma unroll
                        for (int c = 0; c < 2; ++c) rotated[r * hd + (w.n0 + n) * 8 + 2 * tig + c] = tot[n][2 * i + c] / row[i].lt;
                    }
                continue;
            }
            long long o = ((long long)t * nq + h) * hd, og = ((long long)t * nq + h) * gate_stride;
#pragma unroll
            for (int n = 0; n < FLASH_MAX_NT; ++n)
                if (n < w.nt) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        int d = (w.n0 + n) * 8 + 2 * tig + c;
                        float v = tot[n][2 * i + c] / row[i].lt;
                        out[o + d] = v * sigmoidf_(gate[og + d]);
                    }
                }
        }
        if (KV::ROTATED && !split) {
            __syncthreads();
            int used = (t1 - t0) * group;
            for (int r = warp; r < used; r += blockDim.x >> 5) unrotate_warp(rotated + r * hd, hd, kv.tables);
            __syncthreads();
            for (int e = tid; e < used * hd; e += blockDim.x) {
                int r = e / hd, d = e % hd, t = t0 + r / group, h = kvh * group + r % group;
                out[((long long)t * nq + h) * hd + d] = rotated[e] * sigmoidf_(gate[((long long)t * nq + h) * gate_stride + d]);
            }
        }
        t0 = t1;
        __syncthreads();  // the run's queries are read before the next run's are stored
    }
    if (tid == 0) TRACE_MARK(TRACE_BLOCK_END);
}

// grid (T, nq), hd threads (rounded up to a warp): merges the ranges attn_flash's split blocks
// wrote, in range order, exactly as a block walking them merges them; ROTATED rotates the
// merged row back through hd floats of dynamic shared memory, one warp, as attn_flash does.
template <bool ROTATED>
__device__ __forceinline__ void attn_flash_combine_body(int ctx, float* out, const float* gate, int gate_stride, const float* partial, int nq, int hd, const KvTables* tables) {
    int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x, nr = flash_ranges(ctx);
    float M = NEG_INF, L = 0.0f, ACC = 0.0f;
    float pm0[FLASH_SPLITS], pm1[FLASH_SPLITS], pa[FLASH_SPLITS];
#pragma unroll
    for (int r = 0; r < FLASH_SPLITS; ++r) {
        const float* pm = partial + (((long long)t * nq + h) * FLASH_SPLITS + r) * (hd + 2);
        bool live = r < nr;
        pm0[r] = live ? pm[0] : 0.0f;
        pm1[r] = live ? pm[1] : 0.0f;
        pa[r] = live && d < hd ? pm[2 + d] : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < FLASH_SPLITS; ++r) {
        if (r >= nr) break;
        float c_old, c_new;
        M = merge_scales(M, pm0[r], &c_old, &c_new);
        L = merge_sum(L, pm1[r], c_old, c_new);
        ACC = merge_sum(ACC, pa[r], c_old, c_new);
    }
    float v = ACC / L;
    if (ROTATED) {
        extern __shared__ float merged_row[];
        if (d < hd) merged_row[d] = v;
        __syncthreads();
        if (threadIdx.x < 32) unrotate_warp(merged_row, hd, tables);
        __syncthreads();
        if (d < hd) v = merged_row[d];
    }
    if (d < hd) out[((long long)t * nq + h) * hd + d] = v * sigmoidf_(gate[((long long)t * nq + h) * gate_stride + d]);
    if (d == 0) TRACE_MARK(TRACE_BLOCK_END);
}

// attn_flash_NAME, attn_flash_decode_NAME and attn_flash_combine_NAME for a format with a
// FlashTile loader (attn_flash_combine: dynamic shared memory hd floats for a rotated format).
// attn_flash_decode: grid (T, nkv, 1 or FLASH_SPLITS), a step whose every row
// is one token, straight from the projections (its arguments after the first two are
// attn_prep's, then the scale); its gates are the q/gate projection's second halves.
#define FLASH_KERNELS(NAME, KV)                                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) attn_flash_##NAME(float* out, const float* q, const float* gate, KvCache kv, const int* tok_row,  \
            const int* positions, const RowInfo* rows, const int* block_tables, int num_tokens, int nq, int nkv, int hd, int block_size,               \
            int tokens_per_block, float scale, float* partial) {                                                                                       \
        wait_for_inputs();                                                                                                                             \
        FlashPrep none = {};                                                                                                                           \
        attn_flash_body<KV, false>(out, q, gate, hd, kv, tok_row, positions, rows, block_tables, num_tokens, nq, nkv, hd, block_size, tokens_per_block, \
                scale, partial, none);                                                                                                                 \
    }                                                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) attn_flash_decode_##NAME(float* out, float* partial, KvCache kv, const float* qg, const float* k, \
            const float* v, const float* q_norm, const float* k_norm, const float* inv_freq, const int* tok_row, const int* positions, const RowInfo* rows, \
            const int* block_tables, int nq, int nkv, int hd, int rot, int block_size, float eps, float scale) {                                         \
        wait_for_inputs();                                                                                                                             \
        FlashPrep prep = {qg, k, v, q_norm, k_norm, inv_freq, rot, eps};                                                                               \
        attn_flash_body<KV, true>(out, 0, qg + hd, 2 * hd, kv, tok_row, positions, rows, block_tables, gridDim.x, nq, nkv, hd, block_size, 1, scale,   \
                partial, prep);                                                                                                                        \
    }                                                                                                                                                  \
    extern "C" __global__ void attn_flash_combine_##NAME(float* out, const float* gate, const float* partial, const int* positions, int nq, int hd,    \
            int gate_stride, const KvTables* tables) {                                                                                                 \
        int ctx = positions[blockIdx.x] + 1;                                                                                                           \
        wait_for_inputs();                                                                                                                             \
        attn_flash_combine_body<KV::ROTATED>(ctx, out, gate, gate_stride, partial, nq, hd, tables);                                                    \
    }
