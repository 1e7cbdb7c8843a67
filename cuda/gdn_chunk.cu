// The chunked delta rule of prefill rows on tensor cores, in the form of flash-linear-attention
// (chunks of CHUNK = 64 tokens aligned to absolute positions, so that a row's result does not
// depend on how its prompt was split into 64-aligned pieces nor on the other rows of the step).
//
// 1. gdn_chunk_prep, one block per (chunk, value head), all chunks of all rows at once: the
//    cumulative log-decay gam of the chunk, A[l][m] = beta_l (k_l . k_m) exp(gam_l - gam_m)
//    (m < l) and P[l][m] = (q_l . k_m) exp(gam_l - gam_m) (m <= l) as matmuls, the inverse
//    T = (I + A)^-1 by forward substitution, then W = T diag(beta exp(gam)) K and
//    U = T diag(beta) V as matmuls. W, U, P and gam go to scratch.
// 2. gdn_chunk_state, one block per (row, value head, block of value columns), walks its row's
//    chunks in order with its columns of the state S (dk x columns, f32) in shared memory:
//    V' = U - W S, O = diag(exp(gam)) Q S + P V', S = exp(gam_last) S + (diag(exp(gam_last -
//    gam)) K)^T V', all as matmuls.
// The same equations as the CPU's chunked_delta_rule (backend/cpu/gdn.rs). Every product runs on
// the tensor cores as three tf32 products (hi*hi + hi*lo + lo*hi of each operand split into a
// tf32 head and a tf32 tail): one tf32 product alone loses about 3 decimal digits, which the
// state carries from chunk to chunk; the split keeps close to f32's accuracy.

#define GC_THREADS 256   // 8 warps in both kernels
#define GC_WARPS (GC_THREADS / 32)
#define GC_LDC (CHUNK + 4)   // row stride of 64-wide shared arrays (A, T, P)

__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// x = hi + lo (up to lo's own rounding), both tf32.
__device__ __forceinline__ void split_tf32(float x, unsigned* hi, unsigned* lo) {
    *hi = to_tf32(x);
    *lo = to_tf32(x - __uint_as_float(*hi));
}

__device__ __forceinline__ void mma_tf32(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One warp: acc (a 16 x 8 tile in the mma's accumulator layout: lane (g = lane / 4, t = lane % 4)
// holds (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)) += A (16 x kk) B (kk x 8), kk a
// multiple of 8, with A(i, k) = a[i * ars + k * acs] and B(k, n) = b[k * brs + n * bcs] in shared
// memory (strides let either operand be read transposed).
__device__ __forceinline__ void tile_mma(float acc[4], const float* a, int ars, int acs, const float* b, int brs, int bcs, int kk) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int k = 0; k < kk; k += 8) {
        float af[4] = {a[g * ars + (k + t) * acs], a[(g + 8) * ars + (k + t) * acs], a[g * ars + (k + t + 4) * acs], a[(g + 8) * ars + (k + t + 4) * acs]};
        float bf[2] = {b[(k + t) * brs + g * bcs], b[(k + t + 4) * brs + g * bcs]};
        unsigned ah[4], al[4], bh[2], bl[2];
#pragma unroll
        for (int x = 0; x < 4; ++x) split_tf32(af[x], &ah[x], &al[x]);
#pragma unroll
        for (int x = 0; x < 2; ++x) split_tf32(bf[x], &bh[x], &bl[x]);
        // The small terms first.
        mma_tf32(acc, al, bh);
        mma_tf32(acc, ah, bl);
        mma_tf32(acc, ah, bh);
    }
}

// Row and column of accumulator element x (0..3) of lane `lane` within its 16 x 8 tile.
__device__ __forceinline__ int acc_row(int lane, int x) { return (lane >> 2) + (x >> 1) * 8; }
__device__ __forceinline__ int acc_col(int lane, int x) { return (lane & 3) * 2 + (x & 1); }

// Chunks of a row: its first chunk runs from its start to the next multiple of CHUNK.
__device__ __forceinline__ int row_chunks(const RowInfo& row) {
    return row.num_tokens > 0 ? (row.start_position % CHUNK + row.num_tokens + CHUNK - 1) / CHUNK : 0;
}

// Chunk c of a row: its first token within the row and its length.
__device__ __forceinline__ void chunk_span(const RowInfo& row, int c, int* i0, int* len) {
    int off = row.start_position % CHUNK;
    *i0 = c == 0 ? 0 : c * CHUNK - off;
    *len = min(CHUNK - (row.start_position + *i0) % CHUNK, row.num_tokens - *i0);
}

// Whether load_rows copies with cp.async (1: all of a thread's 16-byte copies in flight at once,
// where a loop of plain loads and shared stores waited for each load in turn) or with plain
// loads (0, for A/B runs through `KESTREL_CUDA_DEFINES=GDN_CHUNK_ASYNC=0`).
#ifndef GDN_CHUNK_ASYNC
#define GDN_CHUNK_ASYNC 1
#endif

__device__ __forceinline__ void copy16_async(float* dst, const float* src) {
#if GDN_CHUNK_ASYNC
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
#else
    *(float4*)dst = *(const float4*)src;
#endif
}

// Waits for this thread's copies of load_rows; a __syncthreads must follow before others read.
__device__ __forceinline__ void load_rows_wait() {
#if GDN_CHUNK_ASYNC
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// dst[l * ld + c] = src[l * stride + c] for l < rows and c < n, 0 elsewhere in l < CHUNK,
// c < np (np a multiple of 8, ld a multiple of 4, dst 16-byte aligned). Rows of whole float4s
// are copied asynchronously: load_rows_wait, then __syncthreads, before they are read.
__device__ __forceinline__ void load_rows(float* dst, int ld, const float* src, long long stride, int n, int np, int rows) {
    if ((n & 3) == 0 && (stride & 3) == 0 && ((unsigned long long)src & 15) == 0) {
        int quads = np / 4;
        for (int e = threadIdx.x; e < CHUNK * quads; e += blockDim.x) {
            int l = e / quads, c = (e % quads) * 4;
            if (l < rows && c < n) copy16_async(dst + l * ld + c, src + l * stride + c);
            else *(float4*)(dst + l * ld + c) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    } else {
        for (int e = threadIdx.x; e < CHUNK * np; e += blockDim.x) {
            int l = e / np, c = e % np;
            dst[l * ld + c] = l < rows && c < n ? src[l * stride + c] : 0.0f;
        }
    }
}

__device__ __forceinline__ int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Which row of the step (an index into row_ids) chunk slot `slot` belongs to, and which of its
// chunks it is; -1 past the last chunk. Slots are numbered row after row in row_ids' order.
__device__ __forceinline__ int chunk_owner(const RowInfo* rows, const int* row_ids, int num_rows, int slot, int* chunk) {
    for (int r = 0; r < num_rows; ++r) {
        int n = row_chunks(rows[row_ids[r]]);
        if (slot < n) {
            *chunk = slot;
            return r;
        }
        slot -= n;
    }
    return -1;
}

// Scratch of chunk slot s, value head h: W [CHUNK][dk], U [CHUNK][dv], P [CHUNK][CHUNK] and
// gam [CHUNK] at (s * nv + h) times their sizes.

// Grid (chunk slots, nv), GC_THREADS threads. Dynamic shared memory, floats:
// CHUNK * (dkp + 4) (k) + CHUNK * (max(dkp, dvp) + 4) (q, then exp(gam) k, then v)
// + 2 * CHUNK * GC_LDC (A, T) + 2 * CHUNK (gam, beta); dkp = dk rounded up to 16, dvp = dv
// rounded up to 8.
extern "C" __global__ void __launch_bounds__(GC_THREADS) gdn_chunk_prep(float* w_out, float* u_out, float* p_out, float* gam_out, const float* qn, const float* kn,
        const float* conv_out, const float* g, const float* beta, const RowInfo* rows, const int* row_ids, int num_rows, int nk, int nv, int dk, int dv,
        int conv_dim) {
    wait_for_inputs();
    extern __shared__ float sm[];
    int chunk;
    int r = chunk_owner(rows, row_ids, num_rows, blockIdx.x, &chunk);
    if (r < 0) return;
    RowInfo row = rows[row_ids[r]];
    int i0, len;
    chunk_span(row, chunk, &i0, &len);
    const int h = blockIdx.y, kh = h / (nv / nk), key_dim = nk * dk;
    const int dkp = round_up(dk, 16), dvp = round_up(dv, 8), ldk = dkp + 4, ldx = max(dkp, dvp) + 4;
    float* ks = sm;                 // [CHUNK][ldk]
    float* xs = ks + CHUNK * ldk;   // [CHUNK][ldx]
    float* as = xs + CHUNK * ldx;   // [CHUNK][GC_LDC]
    float* ts = as + CHUNK * GC_LDC; // [CHUNK][GC_LDC]
    float* gam = ts + CHUNK * GC_LDC; // [CHUNK]
    float* bet = gam + CHUNK;       // [CHUNK]
    const long long scratch = (long long)blockIdx.x * nv + h;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const long long t0 = row.token_start + i0;

    load_rows(ks, ldk, kn + t0 * key_dim + kh * dk, key_dim, dk, dkp, len);
    load_rows(xs, ldx, qn + t0 * key_dim + kh * dk, key_dim, dk, dkp, len);
    if (tid < CHUNK) {
        // Tokens past the chunk's end: no decay, no write (their k, q and v are zero).
        gam[tid] = tid < len ? g[(t0 + tid) * nv + h] : 0.0f;
        bet[tid] = tid < len ? beta[(t0 + tid) * nv + h] : 0.0f;
    }
    load_rows_wait();
    __syncthreads();
    if (tid == 0) {
        // In token order, as the CPU sums.
        float acc = 0.0f;
        for (int l = 0; l < CHUNK; ++l) {
            acc += gam[l];
            gam[l] = acc;
        }
    }
    __syncthreads();
    if (tid < CHUNK) gam_out[scratch * CHUNK + tid] = gam[tid];

    // A and P, 16 x 8 tiles; tiles wholly above the diagonal are zero.
    float* p_dst = p_out + scratch * CHUNK * CHUNK;
    for (int tile = warp; tile < (CHUNK / 16) * (CHUNK / 8); tile += GC_WARPS) {
        int mi = tile / (CHUNK / 8), ni = tile % (CHUNK / 8);
        float acc_a[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc_p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        bool live = ni * 8 <= mi * 16 + 15;
        if (live) {
            tile_mma(acc_a, ks + mi * 16 * ldk, ldk, 1, ks + ni * 8 * ldk, 1, ldk, dkp);
            tile_mma(acc_p, xs + mi * 16 * ldx, ldx, 1, ks + ni * 8 * ldk, 1, ldk, dkp);
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            int l = mi * 16 + acc_row(lane, x), m = ni * 8 + acc_col(lane, x);
            float decay = m <= l ? expf(gam[l] - gam[m]) : 0.0f;
            as[l * GC_LDC + m] = m < l ? bet[l] * acc_a[x] * decay : 0.0f;
            p_dst[l * CHUNK + m] = m <= l ? acc_p[x] * decay : 0.0f;
        }
    }
    __syncthreads();
    // q is no longer needed: the right-hand side of W, exp(gam) k.
    for (int e = tid; e < CHUNK * dkp; e += blockDim.x) {
        int l = e / dkp, a = e % dkp;
        xs[l * ldx + a] = expf(gam[l]) * ks[l * ldk + a];
    }
    // T = (I + A)^-1, row by row: T[l][j] = [l == j] - sum_{j <= m < l} A[l][m] T[m][j]. Thread
    // (column j, part p) sums the m = p mod 4; the 4 parts are adjacent lanes.
    {
        int j = tid >> 2, part = tid & 3;
        for (int l = 0; l < CHUNK; ++l) {
            float s = 0.0f;
            for (int m = j + part; m < l; m += 4) s += as[l * GC_LDC + m] * ts[m * GC_LDC + j];
            s = row_group_sum(s);
            if (part == 0) ts[l * GC_LDC + j] = j == l ? 1.0f : (j < l ? -s : 0.0f);
            __syncthreads();
        }
    }
    // T diag(beta), the factor both W and U start with.
    for (int e = tid; e < CHUNK * CHUNK; e += blockDim.x) {
        int l = e / CHUNK, m = e % CHUNK;
        ts[l * GC_LDC + m] *= bet[m];
    }
    __syncthreads();
    // W = T diag(beta) X, U = T diag(beta) V: T is lower triangular, so tile row mi needs
    // k < 16 (mi + 1).
    for (int pass = 0; pass < 2; ++pass) {
        int n = pass == 0 ? dk : dv, np = pass == 0 ? dkp : dvp;
        float* dst = (pass == 0 ? w_out : u_out) + scratch * CHUNK * n;
        if (pass == 1) {
            __syncthreads();
            load_rows(xs, ldx, conv_out + t0 * conv_dim + value_channel(key_dim, h, dv, 0), conv_dim, dv, dvp, len);
            load_rows_wait();
            __syncthreads();
        }
        for (int tile = warp; tile < (CHUNK / 16) * (np / 8); tile += GC_WARPS) {
            int mi = tile / (np / 8), ni = tile % (np / 8);
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tile_mma(acc, ts + mi * 16 * GC_LDC, GC_LDC, 1, xs + ni * 8, ldx, 1, 16 * (mi + 1));
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                int l = mi * 16 + acc_row(lane, x), c = ni * 8 + acc_col(lane, x);
                if (c < n) dst[l * n + c] = acc[x];
            }
        }
    }
}

// Grid (rows listed in row_ids, nv, ceil(dv / COLS)), GC_THREADS threads. Dynamic shared
// memory, floats: 2 * CHUNK * (dkp + 4) (W, q) + CHUNK * (dkp + 8) (k) + CHUNK * GC_LDC (P)
// + 2 * CHUNK * (COLS + 8) (U then V', and V' scaled) + dkp * (COLS + 8) (S) + 2 * CHUNK (the
// row factors of q and V').
template <int COLS>
__device__ __forceinline__ void chunk_state_body(float* core, float* rec, const float* w_in, const float* u_in, const float* p_in, const float* gam_in,
        const float* qn, const float* kn, const RowInfo* rows, const int* row_ids, int nk, int nv, int dk, int dv) {
    extern __shared__ float state_smem[];
    const int dkp = round_up(dk, 16), ldw = dkp + 4, ldk = dkp + 8, ldv = COLS + 8;
    float* ws = state_smem;           // [CHUNK][ldw]
    float* qs = ws + CHUNK * ldw;     // [CHUNK][ldw]
    float* ks = qs + CHUNK * ldw;     // [CHUNK][ldk]
    float* ps = ks + CHUNK * ldk;     // [CHUNK][GC_LDC]
    float* vs = ps + CHUNK * GC_LDC;  // [CHUNK][ldv]
    float* ss = vs + CHUNK * ldv;     // [dkp][ldv]
    float* vk = ss + dkp * ldv;       // [CHUNK][ldv]  diag(exp(gam_last - gam)) V'
    float* fq = vk + CHUNK * ldv;     // [CHUNK]
    float* fk = fq + CHUNK;           // [CHUNK]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int h = blockIdx.y, kh = h / (nv / nk), key_dim = nk * dk, j0 = blockIdx.z * COLS;
    const int cols = min(COLS, dv - j0);
    int slot = 0;
    for (int r = 0; r < (int)blockIdx.x; ++r) slot += row_chunks(rows[row_ids[r]]);
    RowInfo row = rows[row_ids[blockIdx.x]];
    const long long head_len = (long long)dk * dv;
    float* sp = rec + row.state_slot * ((long long)nv * head_len) + h * head_len;
    for (int e = tid; e < dkp * COLS; e += blockDim.x) {
        int i = e / COLS, c = e % COLS;
        ss[i * ldv + c] = i < dk && c < cols ? sp[state_index(i, j0 + c, dk, dv)] : 0.0f;
    }
    // Per warp, at most 4 tiles of S (dkp / 16 x COLS / 8 tiles, dk <= 128, COLS <= 32).
    const int s_tiles = (dkp / 16) * (COLS / 8);
    const int nch = row_chunks(row);
    for (int c = 0; c < nch; ++c, ++slot) {
        int i0, len;
        chunk_span(row, c, &i0, &len);
        const long long t0 = row.token_start + i0, scratch = (long long)slot * nv + h;
        // What the last chunk read is free: its last reads came before its last __syncthreads.
        load_rows(ws, ldw, w_in + scratch * CHUNK * dk, dk, dk, dkp, CHUNK);
        load_rows(qs, ldw, qn + t0 * key_dim + kh * dk, key_dim, dk, dkp, len);
        load_rows(ks, ldk, kn + t0 * key_dim + kh * dk, key_dim, dk, dkp, len);
        load_rows(ps, GC_LDC, p_in + scratch * CHUNK * CHUNK, CHUNK, CHUNK, CHUNK, CHUNK);
        load_rows(vs, ldv, u_in + scratch * CHUNK * dv + j0, dv, cols, COLS, CHUNK);
        const float glast = gam_in[scratch * CHUNK + len - 1];
        if (tid < CHUNK) {
            float gl = gam_in[scratch * CHUNK + tid];
            fq[tid] = tid < len ? expf(gl) : 0.0f;
            fk[tid] = tid < len ? expf(glast - gl) : 0.0f;
        }
        load_rows_wait();
        __syncthreads();
        // V' = U - W S, and diag(exp(gam_last - gam)) V' for the state's increment.
        for (int tile = warp; tile < (CHUNK / 16) * (COLS / 8); tile += GC_WARPS) {
            int mi = tile / (COLS / 8), ni = tile % (COLS / 8);
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tile_mma(acc, ws + mi * 16 * ldw, ldw, 1, ss + ni * 8, ldv, 1, dkp);
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                int l = mi * 16 + acc_row(lane, x), at = l * ldv + ni * 8 + acc_col(lane, x);
                float v = vs[at] - acc[x];
                vs[at] = v;
                vk[at] = v * fk[l];
            }
        }
        __syncthreads();
        // O = diag(exp(gam)) Q S + P V' (P lower triangular: tile row mi needs m < 16 (mi + 1)).
        for (int tile = warp; tile < (CHUNK / 16) * (COLS / 8); tile += GC_WARPS) {
            int mi = tile / (COLS / 8), ni = tile % (COLS / 8);
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tile_mma(acc, qs + mi * 16 * ldw, ldw, 1, ss + ni * 8, ldv, 1, dkp);
#pragma unroll
            for (int x = 0; x < 4; ++x) acc[x] *= fq[mi * 16 + acc_row(lane, x)];
            tile_mma(acc, ps + mi * 16 * GC_LDC, GC_LDC, 1, vs + ni * 8, ldv, 1, 16 * (mi + 1));
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                int l = mi * 16 + acc_row(lane, x), cc = ni * 8 + acc_col(lane, x);
                if (l < len && cc < cols) core[(t0 + l) * nv * dv + h * dv + j0 + cc] = acc[x];
            }
        }
        // S increment K^T diag(exp(gam_last - gam)) V': A(i, l) = ks[l][i].
        float sacc[4][4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            int tile = warp + q * GC_WARPS;
#pragma unroll
            for (int x = 0; x < 4; ++x) sacc[q][x] = 0.0f;
            if (tile < s_tiles) {
                int mi = tile / (COLS / 8), ni = tile % (COLS / 8);
                tile_mma(sacc[q], ks + mi * 16, 1, ldk, vk + ni * 8, ldv, 1, CHUNK);
            }
        }
        __syncthreads();
        const float el = expf(glast);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            int tile = warp + q * GC_WARPS;
            if (tile < s_tiles) {
                int mi = tile / (COLS / 8), ni = tile % (COLS / 8);
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    float* s = ss + (mi * 16 + acc_row(lane, x)) * ldv + ni * 8 + acc_col(lane, x);
                    *s = *s * el + sacc[q][x];
                }
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < dkp * COLS; e += blockDim.x) {
        int i = e / COLS, c = e % COLS;
        if (i < dk && c < cols) sp[state_index(i, j0 + c, dk, dv)] = ss[i * ldv + c];
    }
}

#define GDN_CHUNK_STATE_KERNEL(NAME, COLS)                                                                                                           \
    extern "C" __global__ void __launch_bounds__(GC_THREADS) NAME(float* core, float* rec, const float* w_in, const float* u_in, const float* p_in,   \
            const float* gam_in, const float* qn, const float* kn, const RowInfo* rows, const int* row_ids, int nk, int nv, int dk, int dv) {          \
        wait_for_inputs();                                                                                                                           \
        chunk_state_body<COLS>(core, rec, w_in, u_in, p_in, gam_in, qn, kn, rows, row_ids, nk, nv, dk, dv);                                          \
    }
GDN_CHUNK_STATE_KERNEL(gdn_chunk_state_32, 32)
GDN_CHUNK_STATE_KERNEL(gdn_chunk_state_16, 16)
