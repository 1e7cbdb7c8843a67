// Mixture-of-experts routing and combination. Expert matmuls run through the grouped mode of
// the matmul kernels, with per-expert row lists built here in token order.

// Most experts routing supports: each lane keeps E / 32 probabilities in registers.
#define ROUTE_MAX_PER_LANE 16

// Routing of token t by one warp: softmax over all experts, top-k by repeated argmax (ties to
// the lower index), optional renormalization. Lane j holds experts j, j + 32, ... in registers,
// so an argmax round reads no memory. A warp, not a block: the k argmax rounds need no block
// barriers, and a block of 8 warps routes 8 tokens at once. Every lane ends the butterflies
// with the same (value, index).
__device__ __forceinline__ void route_token(int t, int* topk_idx, float* topk_w, const float* logits, int E, int k, int renormalize) {
    int lane = threadIdx.x & 31;
    const float* l = logits + (long long)t * E;
    // Probabilities of this lane's experts; NEG_INF marks a chosen or missing one.
    float p[ROUTE_MAX_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i) p[i] = lane + 32 * i < E ? l[lane + 32 * i] : NEG_INF;
    float m = NEG_INF;
#pragma unroll
    for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i) m = fmaxf(m, p[i]);
    m = warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i) {
        if (lane + 32 * i < E) {
            p[i] = expf(p[i] - m);
            sum += p[i];
        }
    }
    sum = warp_sum(sum);
    // Lane s % 32 keeps slot s (k <= 64: two registers).
    float mine_w[2] = {0.0f, 0.0f};
    int mine_i[2] = {0, 0};
    float total = 0.0f;
    for (int s = 0; s < k; ++s) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i) {
            int e = lane + 32 * i;
            if (p[i] > bv || (p[i] == bv && e < bi)) { bv = p[i]; bi = e; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        float chosen = bv / sum;
        total += chosen;
        if ((s & 31) == lane) {
            if (s < 32) { mine_w[0] = chosen; mine_i[0] = bi; } else { mine_w[1] = chosen; mine_i[1] = bi; }
        }
#pragma unroll
        for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i)
            if (lane + 32 * i == bi) p[i] = NEG_INF;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int s = lane + 32 * h;
        if (s < k) {
            topk_idx[t * k + s] = mine_i[h];
            topk_w[t * k + s] = renormalize ? mine_w[h] / total : mine_w[h];
        }
    }
}

// A warp per token, 8 tokens per block of 256 threads.
extern "C" __global__ void moe_route(int* topk_idx, float* topk_w, const float* logits, int T, int E, int k, int renormalize) {
    wait_for_inputs();
    int warp = threadIdx.x >> 5, t = blockIdx.x * (blockDim.x >> 5) + warp;
    if (t < T) route_token(t, topk_idx, topk_w, logits, E, k, renormalize);
}

// One block (256 threads) per expert: the (token, slot) entries routed to it, in entry order.
// lists[e * cap + i] = t * slots + s; counts[e] = number of entries. With the shared expert
// folded in (slots = k + 1), block E lists slot k of every token (cap = T tokens).
extern "C" __global__ void moe_group(int* lists, int* counts, const int* topk_idx, int entries, int cap, int k, int slots, int E) {
    wait_for_inputs();
    __shared__ int warp_counts[8];
    int e = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (e == E) {
        for (int t = tid; t < cap; t += blockDim.x) lists[(long long)E * cap + t] = t * slots + k;
        if (tid == 0) counts[E] = cap;
        return;
    }
    int base_out = 0;
    for (int base = 0; base < entries; base += blockDim.x) {
        int i = base + tid;
        bool hit = i < entries && topk_idx[i] == e;
        u32 ballot = __ballot_sync(FULL_MASK, hit);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = base_out;
        for (int w = 0; w < warp; ++w) before += warp_counts[w];
        int total = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += warp_counts[w];
        if (hit) lists[(long long)e * cap + before + __popc(ballot & ((1u << lane) - 1u))] = (i / k) * slots + i % k;
        base_out += total;
        __syncthreads();
    }
    if (tid == 0) counts[e] = base_out;
}

// active = [number of experts with rows, those experts in order]: grouped matmuls launch one
// grid slice per active expert instead of one per expert.
extern "C" __global__ void moe_active(int* active, const int* counts, int E) {
    wait_for_inputs();
    if (threadIdx.x != 0) return;
    int n = 0;
    for (int e = 0; e < E; ++e)
        if (counts[e] > 0) active[1 + n++] = e;
    active[0] = n;
}

// moe_group and moe_active in one block of 256 threads, for steps with few (token, slot)
// entries: the same lists, counts and active list from one launch. With `route`, the block's
// warps first route the T <= 8 tokens themselves (one launch for a decode step); otherwise
// moe_route has. Entries and the shared expert as in moe_group (`fold`: the shared expert is
// group E). Dynamic shared memory: entries + groups ints.
extern "C" __global__ void moe_group_few(int* topk_idx, float* topk_w, const float* logits, int T, int E, int k, int renormalize, int* lists, int* counts, int* active, int route,
        int slots, int fold) {
    wait_for_inputs();
    extern __shared__ float ex[];
    __shared__ int warp_counts[8];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    if (route)
        for (int t = warp; t < T; t += nwarps) route_token(t, topk_idx, topk_w, logits, E, k, renormalize);
    // The block's global writes of topk_idx are visible to it after the barrier.
    __syncthreads();
    int entries = T * k, cap = T, groups = E + fold;
    int* entry_expert = (int*)ex;
    int* cnt = entry_expert + entries;
    for (int i = tid; i < entries; i += blockDim.x) entry_expert[i] = topk_idx[i];
    __syncthreads();
    // A thread per group lists its entries in entry order.
    for (int e = tid; e < groups; e += blockDim.x) {
        int c = 0;
        if (e < E) {
            for (int i = 0; i < entries; ++i)
                if (entry_expert[i] == e) lists[(long long)e * cap + c++] = (i / k) * slots + i % k;
        } else {
            for (int t = 0; t < T; ++t) lists[(long long)E * cap + c++] = t * slots + k;
        }
        cnt[e] = c;
        counts[e] = c;
    }
    __syncthreads();
    // The groups with entries, in group order (ballot compaction).
    int base_out = 0;
    for (int base = 0; base < groups; base += blockDim.x) {
        int e = base + tid;
        bool hit = e < groups && cnt[e] > 0;
        u32 ballot = __ballot_sync(FULL_MASK, hit);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = base_out, total = 0;
        for (int w = 0; w < nwarps; ++w) {
            if (w < warp) before += warp_counts[w];
            total += warp_counts[w];
        }
        if (hit) active[1 + before + __popc(ballot & ((1u << lane) - 1u))] = e;
        base_out += total;
        __syncthreads();
    }
    if (tid == 0) active[0] = base_out;
}

// The MoE output for (token t, column d): sum_s w[t,s] * y[t*slots+s, d] (s < k, in order),
// then + scale * shared[t * shared_stride + d] with scale = sigmoid(shared_gate[t]) (1 without
// a gate). Both combine kernels use it, so they give the same bits.
__device__ __forceinline__ float moe_output(const float* y, const float* topk_w, const float* shared, float scale, int t, int d, int H, int k, int slots, long long shared_stride) {
    float acc = 0.0f;
    // Unrolled so that the k loads are in flight together; the sum stays in slot order.
#pragma unroll 8
    for (int s = 0; s < k; ++s) acc += topk_w[t * k + s] * y[((long long)t * slots + s) * H + d];
    if (shared) acc += scale * shared[t * shared_stride + d];
    return acc;
}

__device__ __forceinline__ float shared_scale(const float* shared_gate, int t) {
    return shared_gate ? 1.0f / (1.0f + expf(-shared_gate[t])) : 1.0f;
}

// acc[t] += the MoE output (moe_output): added into the residual stream, as add_assign would.
// The shared expert's row is y's slot k when it ran with the experts.
extern "C" __global__ void moe_combine(float* out, const float* y, const float* topk_w, const float* shared, const float* shared_gate, int T, int H, int k, int slots,
        long long shared_stride) {
    wait_for_inputs();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * H) return;
    int t = (int)(idx / H), d = (int)(idx % H);
    float scale = shared ? shared_scale(shared_gate, t) : 1.0f;
    out[idx] = out[idx] + moe_output(y, topk_w, shared, scale, t, d, H, k, slots, shared_stride);
}

// moe_combine for whole rows, then the RMSNorm of each updated row by `w` into `normed` (the
// next layer's input, bitwise what rms_norm_rows gives on the updated row): one block of 256
// threads per token, one launch fewer per layer. Four columns per thread, with float4 loads
// all issued before the sums; each column's sum is moe_output's expression (the GPU tests
// check the bits against moe_combine). The host takes this path only where the row norm takes
// its register path (rms_row_in_registers).
// Arguments: moe_combine's, then the norm's output, weight and epsilon.
extern "C" __global__ void moe_combine_norm(float* out, const float* y, const float* topk_w, const float* shared, const float* shared_gate, int T, int H, int k, int slots,
        long long shared_stride, float* normed, const float* w, float eps) {
    wait_for_inputs();
    __shared__ float scratch[33];
    int t = blockIdx.x, nvec = H >> 2;
    if (t >= T) return;
    float scale = shared ? shared_scale(shared_gate, t) : 1.0f;
    float4* row = (float4*)(out + (long long)t * H);
    float4 v[RMS_VECS], wv[RMS_VECS];
#pragma unroll
    for (int i = 0; i < RMS_VECS; ++i) {
        int c = threadIdx.x + i * blockDim.x;
        float4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
        v[i] = zero;
        wv[i] = zero;
        if (c < nvec) {
            float4 acc = zero;
#pragma unroll 8
            for (int s = 0; s < k; ++s) {
                float ws = topk_w[t * k + s];
                float4 yv = ((const float4*)(y + ((long long)t * slots + s) * H))[c];
                acc.x += ws * yv.x;
                acc.y += ws * yv.y;
                acc.z += ws * yv.z;
                acc.w += ws * yv.w;
            }
            if (shared) {
                float4 sv = ((const float4*)(shared + t * shared_stride))[c];
                acc.x += scale * sv.x;
                acc.y += scale * sv.y;
                acc.z += scale * sv.z;
                acc.w += scale * sv.w;
            }
            float4 r = row[c];
            r.x = r.x + acc.x;
            r.y = r.y + acc.y;
            r.z = r.z + acc.z;
            r.w = r.w + acc.w;
            row[c] = r;
            v[i] = r;
            wv[i] = ((const float4*)w)[c];
        }
    }
    rms_norm_row_registers(normed + (long long)t * H, v, wv, H, eps, scratch);
}
