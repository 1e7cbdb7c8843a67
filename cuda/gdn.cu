// Gated DeltaNet: causal conv with its window, gates and l2-normalized q/k, the delta rule
// (chunked over chunks of 64 aligned to absolute positions for prefill rows; recurrent with a
// state snapshot per token for generate rows) and the gated output RMSNorm.
// Recurrent state per value head is S[i][j] (i over dk, j over dv), f32, as on the CPU, stored
// in the order state_index gives (the host reads it back through `recurrent_state_index` in
// backend/cuda/cache.rs).

#define CHUNK 64
#define MAX_DK 128
#define MAX_HIST 8

// Window value `idx` of a row: the K-1 stored inputs, then the row's own inputs.
__device__ __forceinline__ float conv_window(const float* state, const float* mixed, int idx, int hist, int token_start, int c, int conv_dim) {
    return idx < hist ? state[(long long)idx * conv_dim + c] : mixed[(long long)(token_start + idx - hist) * conv_dim + c];
}

// silu(sum_j w[c][j] * window[i + j]) of token t, channel c. For generate rows with
// `snapshot` it also stores the window after the token (snapshot i); the canonical window is
// only read.
__device__ __forceinline__ float conv_channel(float* conv_snap, const float* mixed, const float* conv_state, const float* conv_w, const RowInfo& row, int t, int c,
        int conv_dim, int kw, bool snapshot) {
    int hist = kw - 1, i = t - row.token_start;
    const float* state = conv_state + (long long)row.state_slot * hist * conv_dim;
    float acc = 0.0f;
#pragma unroll 4
    for (int j = 0; j < kw; ++j) acc += conv_w[c * kw + j] * conv_window(state, mixed, i + j, hist, row.token_start, c, conv_dim);
    if (row.kind == 1 && snapshot) {
        float* snap = conv_snap + (long long)(row.snapshot_base + i) * hist * conv_dim;
#pragma unroll 4
        for (int j = 0; j < hist; ++j) snap[(long long)j * conv_dim + c] = conv_window(state, mixed, i + 1 + j, hist, row.token_start, c, conv_dim);
    }
    return siluf_(acc);
}

// The decay and write gates of token t, value head v: g = -exp(A_log) * softplus(a + dt_bias),
// beta = sigmoid(b).
__device__ __forceinline__ void gdn_gate_values(float a, float b, float neg_a, float dt_bias, float* g, float* beta) {
    float x = a + dt_bias;
    float sp = x > 20.0f ? x : log1pf(expf(x));
    *g = neg_a * sp;
    *beta = 1.0f / (1.0f + expf(-b));
}
__device__ __forceinline__ void gdn_gates(const float* a, const float* b, const float* neg_a, const float* dt_bias, int t, int v, int nv, float* g, float* beta) {
    gdn_gate_values(a[(long long)t * nv + v], b[(long long)t * nv + v], neg_a[v], dt_bias[v], g, beta);
}

// The conv, the gates and the l2-normalized q/k of the prefill tokens of a step in one launch
// (generate tokens get theirs inside gdn_recurrent). grid (T, nk + 1 + ceil(value_dim / 128)),
// 128 threads. Blocks y < nk: conv of the q and k channels of key head y, then q (times
// dk^-1/2) and k l2-normalized. Block y == nk: the gates. Blocks y > nk: conv of 128 value
// channels each.
extern "C" __global__ void gdn_conv_gates(float* conv_out, float* conv_snap, float* qn, float* kn, float* g_out, float* beta_out, const float* mixed,
        const float* conv_state, const float* conv_w, const float* a, const float* b, const float* neg_a, const float* dt_bias, const int* tok_row,
        const RowInfo* rows, int nk, int nv, int dk, int conv_dim, int kw) {
    wait_for_inputs();
    __shared__ float scratch[33];
    int t = blockIdx.x, h = blockIdx.y;
    int key_dim = nk * dk;
    RowInfo row = rows[tok_row[t]];
    if (row.kind == 1) return;
    if (h == nk) {
        for (int v = threadIdx.x; v < nv; v += blockDim.x) gdn_gates(a, b, neg_a, dt_bias, t, v, nv, g_out + (long long)t * nv + v, beta_out + (long long)t * nv + v);
        return;
    }
    float* out_row = conv_out + (long long)t * conv_dim;
    if (h > nk) {
        int c = 2 * key_dim + (h - nk - 1) * blockDim.x + threadIdx.x;
        if (c < conv_dim) out_row[c] = conv_channel(conv_snap, mixed, conv_state, conv_w, row, t, c, conv_dim, kw, true);
        return;
    }
    float q_scale = 1.0f / sqrtf((float)dk);
    for (int which = 0; which < 2; ++which) {
        int c0 = which * key_dim + h * dk;
        float* dst = (which == 0 ? qn : kn) + (long long)t * key_dim + h * dk;
        float ss = 0.0f;
        for (int d = threadIdx.x; d < dk; d += blockDim.x) {
            float v = conv_channel(conv_snap, mixed, conv_state, conv_w, row, t, c0 + d, conv_dim, kw, true);
            out_row[c0 + d] = v;
            ss += v * v;
        }
        ss = block_sum(ss, scratch);
        float f = 1.0f / sqrtf(ss + 1e-6f) * (which == 0 ? q_scale : 1.0f);
        // Each thread reads back the channels it wrote.
        for (int d = threadIdx.x; d < dk; d += blockDim.x) dst[d] = out_row[c0 + d] * f;
    }
}

// Thread per (prefill row, channel): the row's new window. Reads finish before writes, and
// each thread owns its channel of its row. (Generate rows' snapshots come from gdn_recurrent.)
extern "C" __global__ void gdn_conv_state(float* conv_state, const float* mixed, const RowInfo* rows, const int* row_ids, int num_rows, int conv_dim, int kw) {
    wait_for_inputs();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)num_rows * conv_dim) return;
    int r = (int)(idx / conv_dim), c = (int)(idx % conv_dim);
    RowInfo row = rows[row_ids[r]];
    int hist = kw - 1, n = row.num_tokens;
    float* state = conv_state + (long long)row.state_slot * hist * conv_dim;
    float win[MAX_HIST];
    for (int j = 0; j < hist; ++j) win[j] = conv_window(state, mixed, n + j, hist, row.token_start, c, conv_dim);
    for (int j = 0; j < hist; ++j) state[(long long)j * conv_dim + c] = win[j];
}

#define REC_GROUPS 4   // threads per value column of the recurrent kernel

// Whether the recurrent state is stored in gdn_recurrent's thread order (1) or row by row (0;
// `KESTREL_CUDA_DEFINES=GDN_STATE_TILED=0` for A/B runs, timing only: the host's read-back
// assumes 1).
#ifndef GDN_STATE_TILED
#define GDN_STATE_TILED 1
#endif

// Whether a head's state is in gdn_recurrent's thread order (state_index): dk a multiple of
// 4 * REC_GROUPS, so that every thread holds whole quads of rows.
__device__ __forceinline__ bool state_tiled(int dk) { return GDN_STATE_TILED && dk % (4 * REC_GROUPS) == 0; }

// Where element (i, j) of a head's dk x dv state sits among its dk * dv floats. Tiled: thread
// (column j, group r) of gdn_recurrent holds rows r * src + m, m < src = dk / REC_GROUPS, in
// registers, and its rows 4a .. 4a + 3 are one float4; float4 a of every thread of the block
// is one run, thread after thread, so that a warp stores 512 contiguous bytes at once. A
// decode step writes the whole state of every linear layer back: row by row, a warp's store
// of one element touched four rows (four 32-byte pieces of four lines) and each thread made
// 32 stores, and their issue held the delta rule's chain up. 35B-A3B decode on the H100,
// alternated with row by row: a float per store in this order 3.231-3.245 ms per step against
// 3.247-3.272 on three machines; float4s 3.226-3.242 against 3.240-3.255, and 3.252-3.254
// against 3.246-3.263 on a fourth. Otherwise row by row.
__device__ __forceinline__ long long state_index(int i, int j, int dk, int dv) {
    if (!state_tiled(dk)) return (long long)i * dv + j;
    int src = dk / REC_GROUPS, m = i % src;
    return (((long long)(m >> 2) * dv + j) * REC_GROUPS + i / src) * 4 + (m & 3);
}
// state_index of rows 4a .. 4a + 3 of group r (rows r * src + 4a on) in column j, tiled: the
// float4 they make, counted in float4s.
__device__ __forceinline__ long long state_quad_index(int r, int a, int j, int dv) { return ((long long)a * dv + j) * REC_GROUPS + r; }

// Whether a generate row's first token takes its conv weights, windows and gate parameters
// from recurrent_start's registers (1) or loads them after the wait (0, for A/B runs through
// `KESTREL_CUDA_DEFINES=GDN_FIRST_PRELOAD=0`).
#ifndef GDN_FIRST_PRELOAD
#define GDN_FIRST_PRELOAD 1
#endif

// Sum over 4 consecutive lanes (the recurrent kernel's row groups of a value column, the
// chunked kernels' parts of a sum): a fixed butterfly, every lane of the 4 gets the same bits.
__device__ __forceinline__ float row_group_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    v += __shfl_xor_sync(FULL_MASK, v, 2);
    return v;
}

// Whether row i of group r (rows r0 = r * src onward) is one of the head's dk rows.
__device__ __forceinline__ bool group_has_row(int i, int src, int r0, int dk) { return i < src && r0 + i < dk; }

// Where k or q row d sits in its padded shared array (each group's src rows then 4 floats).
__device__ __forceinline__ int padded_row(int d, int src) { return d + d / src * 4; }

// Where value head h's output goes among the output's heads: in order, or (`tiled`) in
// llama.cpp's tiled order, value head v of key head k at v * nk + k (LinearAttnShape::
// out_heads_tiled).
__device__ __forceinline__ int out_head(int h, int nk, int nv, int tiled) {
    int per_key = nv / nk;
    return tiled ? (h % per_key) * nk + h / per_key : h;
}

// The conv channel of value column j of value head h, and of q/k index c (< 2 dk: q then k) of
// key head kh, in the projection's mixed row (q, k, then v channels).
__device__ __forceinline__ int value_channel(int key_dim, int h, int dv, int j) { return 2 * key_dim + h * dv + j; }
__device__ __forceinline__ int qk_channel(int key_dim, int kh, int dk, int c) {
    int which = c >= dk;
    return which * key_dim + kh * dk + (c - which * dk);
}

// What a block of gdn_recurrent loads before its inputs are ready: its row and the state rows
// it keeps in registers. With `state_early` it does so before waiting: the canonical state was
// written by commit_states, reset_states, a prefill launch or (one-token rows) this kernel, and
// the host passes 0 when that launch is the one just before (a kernel starts only once the
// launch two back has finished, so anything older is complete). The step's row table is older
// still.
struct RecurrentStart {
    RowInfo row;
    float s[MAX_DK / REC_GROUPS];
    // With the conv width compiled in (KW == 4), also the head's gate parameters, the column's
    // norm weight, and the conv weights and canonical window (the K-1 stored inputs) of the
    // thread's value channel and q/k channel: the row's first token then waits after its
    // inputs only for the fresh projections, which sit in L2, where these would each be a
    // round trip to memory (the weights and windows of 30 layers do not stay in L2).
    float neg_a, dt_bias, norm_w;
    float wv[4], hv[3], wqk[4], hqk[3];
};

// Thread (column j = tid / 4, group r = tid % 4) of a recurrent block keeps the state rows
// r * src + i, i < src = ceil(dk / 4), of its column: contiguous, so that with the head dims
// known at compile time every state, snapshot and k/q address is a base plus a constant.
template <int DK, int DV, int KW>
__device__ __forceinline__ RecurrentStart recurrent_start(int state_early, const float* rec, const RowInfo* rows, const int* row_ids, int nk, int nv, int dk_, int dv_,
        const float* conv_state, const float* conv_w, const float* neg_a, const float* dt_bias, const float* norm_w, int conv_dim) {
    const int dk = DK ? DK : dk_, dv = DV ? DV : dv_, src = (dk + REC_GROUPS - 1) / REC_GROUPS;
#if __CUDA_ARCH__ >= 900
    if (!state_early) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    RecurrentStart st;
    st.row = rows[row_ids[blockIdx.x]];
    int j = threadIdx.x / REC_GROUPS, rg = threadIdx.x % REC_GROUPS;
    bool col_ok = j < dv;
    const float* sp = rec + st.row.state_slot * ((long long)nv * dk * dv) + (long long)blockIdx.y * dk * dv;
    if (state_tiled(dk)) {
#pragma unroll
        for (int a = 0; a < MAX_DK / REC_GROUPS / 4; ++a) {
            float4 v = {0.0f, 0.0f, 0.0f, 0.0f};
            if (4 * a < src && col_ok) v = ((const float4*)sp)[state_quad_index(rg, a, j, dv)];
            st.s[4 * a] = v.x;
            st.s[4 * a + 1] = v.y;
            st.s[4 * a + 2] = v.z;
            st.s[4 * a + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < MAX_DK / REC_GROUPS; ++i) st.s[i] = (group_has_row(i, src, rg * src, dk) && col_ok) ? sp[state_index(rg * src + i, j, dk, dv)] : 0.0f;
    }
    if (GDN_FIRST_PRELOAD && KW == 4) {
        int h = blockIdx.y, kh = h / (nv / nk), key_dim = nk * dk;
        const float* window = conv_state + (long long)st.row.state_slot * (KW - 1) * conv_dim;
        st.neg_a = neg_a[h];
        st.dt_bias = dt_bias[h];
        st.norm_w = col_ok && rg == 0 ? norm_w[j] : 0.0f;
        int cv = value_channel(key_dim, h, dv, j), cqk = qk_channel(key_dim, kh, dk, threadIdx.x);
        bool has_v = col_ok && rg == 0, has_qk = (int)threadIdx.x < 2 * dk;
#pragma unroll
        for (int x = 0; x < KW; ++x) {
            st.wv[x] = has_v ? conv_w[cv * KW + x] : 0.0f;
            st.wqk[x] = has_qk ? conv_w[cqk * KW + x] : 0.0f;
        }
#pragma unroll
        for (int x = 0; x < KW - 1; ++x) {
            st.hv[x] = has_v ? window[(long long)x * conv_dim + cv] : 0.0f;
            st.hqk[x] = has_qk ? window[(long long)x * conv_dim + cqk] : 0.0f;
        }
    }
    return st;
}

// conv_channel of a row's first token from the channel's weights and canonical window in
// registers (recurrent_start, KW == 4) and its input `m`: the same products and sums in the
// same order, so the same bits. With `snapshot`, stores the window after the token as
// conv_channel does.
__device__ __forceinline__ float conv_channel_first(const float w[4], const float hist[3], float m, float* conv_snap, const RowInfo& row, int c, int conv_dim, bool snapshot) {
    float acc = 0.0f;
    acc += w[0] * hist[0];
    acc += w[1] * hist[1];
    acc += w[2] * hist[2];
    acc += w[3] * m;
    if (row.kind == 1 && snapshot) {
        float* snap = conv_snap + (long long)row.snapshot_base * 3 * conv_dim;
        snap[c] = hist[1];
        snap[(long long)conv_dim + c] = hist[2];
        snap[2LL * conv_dim + c] = m;
    }
    return siluf_(acc);
}

// Rows 4m .. 4m+3 of a group's padded k or q: one float4 when the head dims are compiled in
// (each group's rows then start 16-byte aligned), else four loads.
template <int DK>
__device__ __forceinline__ void group_rows4(const float* g, int m, float* out) {
    if (DK) {
        float4 v = ((const float4*)g)[m];
        out[0] = v.x;
        out[1] = v.y;
        out[2] = v.z;
        out[3] = v.w;
    } else {
#pragma unroll
        for (int x = 0; x < 4; ++x) out[x] = g[4 * m + x];
    }
}

// Generate rows: grid (rows listed in row_ids, nv), REC_GROUPS * dv threads. Thread (column j,
// group r) keeps its state rows (recurrent_start) in registers; the 4 groups of a column
// combine their sums over the rows with a fixed butterfly (every lane gets the same bits).
// Writes the state after every token to its snapshot slot (a row of one token: to its canonical
// slot, delta_state_in_place in backend/mod.rs). Four threads per column rather than
// one: a decode step has only nv blocks, and each needs enough warps in flight.
//
// A generate token's conv (with its window snapshot), gates and normalized q/k are computed
// here rather than by gdn_conv_gates (one launch fewer per layer of a decode step): each block
// convolves its head's value channels and its key head's q and k channels (the blocks of a
// key head's value heads all compute them; the first writes their snapshots). Its output is
// normalized here too (gated RMSNorm, as gdn_out_norm does for prefill tokens). A token's
// output always comes from the same kernel, whatever else is in the step.
//
// A decode step has one row, so this kernel's time is its chain of latencies and of
// instructions, not its bytes: the state is loaded before the inputs are ready, and the
// instantiation for the models' head dims (gdn_recurrent_128) addresses everything with
// constant offsets (`DK`, `DV`, `KW` 0: taken from the arguments).
template <int DK, int DV, int KW>
__device__ __forceinline__ void gdn_recurrent_body(RecurrentStart& st, float* out, const float* z, const float* norm_w, float eps, const float* mixed,
        const float* conv_state, const float* conv_w, float* conv_snap, const float* a, const float* b, const float* neg_a, const float* dt_bias, float* rec,
        float* rec_snap, int nk, int nv, int dk_, int dv_, int conv_dim, int kw_, int out_tiled) {
    const int dk = DK ? DK : dk_, dv = DV ? DV : dv_, kw = KW ? KW : kw_, src = (dk + REC_GROUPS - 1) / REC_GROUPS;
    __shared__ float scratch[66];
    // The normalized k and q, each group's rows padded by 4 floats: the 4 groups of a warp
    // read different banks, and (DK given) whole float4s.
    __shared__ __align__(16) float ks[MAX_DK + 4 * REC_GROUPS], qs[MAX_DK + 4 * REC_GROUPS];
    const RowInfo& row = st.row;
    int h = blockIdx.y, per_key = nv / nk, kh = h / per_key;
    int j = threadIdx.x / REC_GROUPS, rg = threadIdx.x % REC_GROUPS, r0 = rg * src;
    const float* kg = ks + rg * (src + 4);
    const float* qg = qs + rg * (src + 4);
    bool col_ok = j < dv;
    int key_dim = nk * dk, head_len = dk * dv;
    bool qk_snapshots = h % per_key == 0;
    float q_scale = 1.0f / sqrtf((float)dk);
    long long state_len = (long long)nv * head_len;
    // Whether recurrent_start loaded the weights and windows of the first token.
    const bool preloaded = GDN_FIRST_PRELOAD && KW == 4;
    float nw = preloaded ? st.norm_w : col_ok && rg == 0 ? norm_w[j] : 0.0f;
    // This thread's value channel and q/k channel.
    int cv = value_channel(key_dim, h, dv, j), c_qk = qk_channel(key_dim, kh, dk, threadIdx.x);
    for (int n = 0; n < row.num_tokens; ++n) {
        int t = row.token_start + n;
        // The first token with what recurrent_start loaded: every load below is then of this
        // step's projections.
        bool first = preloaded && n == 0;
        float gt, bt;
        if (first) gdn_gate_values(a[(long long)t * nv + h], b[(long long)t * nv + h], st.neg_a, st.dt_bias, &gt, &bt);
        else gdn_gates(a, b, neg_a, dt_bias, t, h, nv, &gt, &bt);
        long long e = (long long)t * nv * dv + h * dv + j;
        float zt = col_ok && rg == 0 ? z[e] : 0.0f;
        // The column's value: convolved by the first thread of its group, shared with the rest.
        float vj = 0.0f;
        if (col_ok && rg == 0)
            vj = first ? conv_channel_first(st.wv, st.hv, mixed[(long long)t * conv_dim + cv], conv_snap, row, cv, conv_dim, true)
                       : conv_channel(conv_snap, mixed, conv_state, conv_w, row, t, cv, conv_dim, kw, true);
        // This thread's q/k channel of the first token, before the barrier (its load in
        // flight with the others).
        float qk_first = first && (int)threadIdx.x < 2 * dk
                             ? conv_channel_first(st.wqk, st.hqk, mixed[(long long)t * conv_dim + c_qk], conv_snap, row, c_qk, conv_dim, qk_snapshots)
                             : 0.0f;
        vj = __shfl_sync(FULL_MASK, vj, (threadIdx.x & 31) & ~(REC_GROUPS - 1));
        // The previous token's reads of ks and qs are done.
        __syncthreads();
        float qss = 0.0f, kss = 0.0f;
        for (int c = threadIdx.x; c < 2 * dk; c += blockDim.x) {
            int which = c >= dk, d = c - which * dk;
            float v = first && c == (int)threadIdx.x ? qk_first : conv_channel(conv_snap, mixed, conv_state, conv_w, row, t, qk_channel(key_dim, kh, dk, c), conv_dim, kw, qk_snapshots);
            int padded = padded_row(d, src);
            if (which) {
                ks[padded] = v;
                kss += v * v;
            } else {
                qs[padded] = v;
                qss += v * v;
            }
        }
        // q times dk^-1/2 and k l2-normalized, as gdn_conv_gates does; each thread scales the
        // channels it wrote (block_sum2 ends with a barrier, so the sums are everyone's).
        float2 sums = block_sum2(qss, kss, scratch);
        float qf = 1.0f / sqrtf(sums.x + 1e-6f) * q_scale;
        float kf = 1.0f / sqrtf(sums.y + 1e-6f);
        for (int c = threadIdx.x; c < 2 * dk; c += blockDim.x) {
            int which = c >= dk, d = c - which * dk, padded = padded_row(d, src);
            if (which) ks[padded] = ks[padded] * kf;
            else qs[padded] = qs[padded] * qf;
        }
        __syncthreads();
        float decay = expf(gt);
        float kv = 0.0f;
#pragma unroll
        for (int m = 0; m < MAX_DK / REC_GROUPS / 4; ++m) {
            float k4[4];
            group_rows4<DK>(kg, m, k4);
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                int i = 4 * m + x;
                if (group_has_row(i, src, r0, dk)) {
                    st.s[i] *= decay;
                    kv += st.s[i] * k4[x];
                }
            }
        }
        kv = row_group_sum(kv);
        float u = bt * (vj - kv);
        float o = 0.0f;
#pragma unroll
        for (int m = 0; m < MAX_DK / REC_GROUPS / 4; ++m) {
            float k4[4], q4[4];
            group_rows4<DK>(kg, m, k4);
            group_rows4<DK>(qg, m, q4);
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                int i = 4 * m + x;
                if (group_has_row(i, src, r0, dk)) {
                    st.s[i] += k4[x] * u;
                    o += st.s[i] * q4[x];
                }
            }
        }
        o = row_group_sum(o);
        if (col_ok) {
            // A row of one token writes the canonical state itself (delta_state_in_place in
            // backend/mod.rs); this block's thread read those rows before and nothing else does.
            float* dst = row.num_tokens == 1 ? rec + row.state_slot * state_len : rec_snap + (long long)(row.snapshot_base + n) * state_len;
            float* snap = dst + (long long)h * head_len;
            if (state_tiled(dk)) {
#pragma unroll
                for (int a = 0; a < MAX_DK / REC_GROUPS / 4; ++a)
                    if (4 * a < src) ((float4*)snap)[state_quad_index(rg, a, j, dv)] = make_float4(st.s[4 * a], st.s[4 * a + 1], st.s[4 * a + 2], st.s[4 * a + 3]);
            } else {
#pragma unroll
                for (int i = 0; i < MAX_DK / REC_GROUPS; ++i) {
                    if (group_has_row(i, src, r0, dk)) snap[state_index(r0 + i, j, dk, dv)] = st.s[i];
                }
            }
        }
        float ss = block_sum(col_ok && rg == 0 ? o * o : 0.0f, scratch);
        if (col_ok && rg == 0) out[(long long)t * nv * dv + out_head(h, nk, nv, out_tiled) * dv + j] = o * (1.0f / sqrtf(ss / (float)dv + eps)) * nw * siluf_(zt);
    }
}

#define GDN_RECURRENT_KERNEL(NAME, DK, DV, KW)                                                                                                              \
    extern "C" __global__ void __launch_bounds__(512) NAME(float* out, const float* z, const float* norm_w, float eps, float* conv_snap,                     \
            const float* mixed, const float* conv_state, const float* conv_w, const float* a, const float* b, const float* neg_a, const float* dt_bias,        \
            float* rec, float* rec_snap, const RowInfo* rows, const int* row_ids, int nk, int nv, int dk, int dv, int conv_dim, int kw, int state_early,      \
            int out_tiled) {                                                                                                                                \
        RecurrentStart st = recurrent_start<DK, DV, KW>(state_early, rec, rows, row_ids, nk, nv, dk, dv, conv_state, conv_w, neg_a, dt_bias, norm_w,     \
                                                        conv_dim);                                                                                  \
        wait_for_inputs();                                                                                                                                  \
        gdn_recurrent_body<DK, DV, KW>(st, out, z, norm_w, eps, mixed, conv_state, conv_w, conv_snap, a, b, neg_a, dt_bias, rec, rec_snap, nk, nv, dk, dv, \
                                       conv_dim, kw, out_tiled);                                                                                            \
        if (threadIdx.x == 0) TRACE_MARK(TRACE_BLOCK_END);                                                                                                  \
    }
GDN_RECURRENT_KERNEL(gdn_recurrent, 0, 0, 0)
GDN_RECURRENT_KERNEL(gdn_recurrent_128, 128, 128, 4)

// The chunked delta rule of prefill rows: cuda/gdn_chunk.cu.

// grid (T, nv), 128 threads: y = x * rsqrt(mean(x^2) + eps) * w * silu(z), per value head,
// for tokens of prefill rows (gdn_recurrent normalizes generate tokens).
extern "C" __global__ void gdn_out_norm(float* out, const float* core, const float* z, const float* w, const int* tok_row, const RowInfo* rows, int nv, int dv,
        float eps, int nk, int out_tiled) {
    wait_for_inputs();
    __shared__ float scratch[33];
    if (rows[tok_row[blockIdx.x]].kind != 0) return;
    long long base = ((long long)blockIdx.x * nv + blockIdx.y) * dv;
    long long obase = ((long long)blockIdx.x * nv + out_head(blockIdx.y, nk, nv, out_tiled)) * dv;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) ss += core[base + d] * core[base + d];
    ss = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(ss / (float)dv + eps);
    for (int d = threadIdx.x; d < dv; d += blockDim.x) out[obase + d] = core[base + d] * inv * w[d] * siluf_(z[base + d]);
}

// Recurrent-state bookkeeping of a whole step in one launch each. The cache keeps one buffer
// per linear layer; `*_layers` are tables of their base addresses. Grid (requests, layers,
// STATE_CHUNKS): chunk z copies its share of the delta-rule state and of the conv window.
#define STATE_CHUNKS 16

__device__ __forceinline__ void copy_floats(float* dst, const float* src, long long n) {
    // 16-byte moves where both ends allow (state lengths are multiples of 4 in practice).
    if ((n & 3) == 0 && (((u64)dst | (u64)src) & 15) == 0) {
        for (long long i = threadIdx.x; i < n / 4; i += blockDim.x) ((float4*)dst)[i] = ((const float4*)src)[i];
    } else {
        for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
    }
}

__device__ __forceinline__ void zero_floats(float* dst, long long n) {
    for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = 0.0f;
}

// Chunk blockIdx.z's share [lo, hi) of a state of `len` floats (whole float4s but the last).
__device__ __forceinline__ void state_chunk(long long len, long long* lo, long long* hi) {
    // Rounded up to whole float4s: rounded down first, a length whose sixteenth is a multiple
    // of 4 plus a fraction (a conv window of 3 * 88 floats) lost its last floats.
    long long per = ((len + STATE_CHUNKS - 1) / STATE_CHUNKS + 3) & ~3LL;
    *lo = min((long long)blockIdx.z * per, len);
    *hi = min(*lo + per, len);
}

// commits[3i] = canonical slot, commits[3i + 1] = snapshot slot, commits[3i + 2] = whether the
// conv window only (the row wrote its delta-rule state in place).
extern "C" __global__ void commit_states(const u64* conv_layers, const u64* rec_layers, const u64* conv_snap_layers, const u64* rec_snap_layers,
        const int* commits, long long conv_len, long long rec_len) {
    wait_for_inputs();
    int p = blockIdx.x, layer = blockIdx.y;
    long long slot = commits[3 * p], snap = commits[3 * p + 1], lo, hi;
    state_chunk(rec_len, &lo, &hi);
    if (!commits[3 * p + 2]) copy_floats((float*)rec_layers[layer] + slot * rec_len + lo, (const float*)rec_snap_layers[layer] + snap * rec_len + lo, hi - lo);
    state_chunk(conv_len, &lo, &hi);
    copy_floats((float*)conv_layers[layer] + slot * conv_len + lo, (const float*)conv_snap_layers[layer] + snap * conv_len + lo, hi - lo);
}

extern "C" __global__ void reset_states(const u64* conv_layers, const u64* rec_layers, const int* slots, long long conv_len, long long rec_len) {
    wait_for_inputs();
    int p = blockIdx.x, layer = blockIdx.y;
    long long slot = slots[p], lo, hi;
    state_chunk(rec_len, &lo, &hi);
    zero_floats((float*)rec_layers[layer] + slot * rec_len + lo, hi - lo);
    state_chunk(conv_len, &lo, &hi);
    zero_floats((float*)conv_layers[layer] + slot * conv_len + lo, hi - lo);
}
