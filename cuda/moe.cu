// Mixture-of-experts routing and combination. Expert matmuls run through the grouped mode of
// the matmul kernels, with per-expert row lists built here in token order.

// Routing of token t by one block of 256 threads: softmax over all experts, top-k by repeated
// argmax (ties to the lower index), optional renormalization. `ex`: E floats of shared memory.
__device__ __forceinline__ void route_token(int t, int* topk_idx, float* topk_w, const float* logits, int E, int k, int renormalize, float* ex) {
    __shared__ float scratch[33];
    __shared__ float best_v[8];
    __shared__ int best_i[8];
    __shared__ float chosen[64];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* l = logits + (long long)t * E;
    float m = NEG_INF;
    for (int e = tid; e < E; e += blockDim.x) m = fmaxf(m, l[e]);
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int e = tid; e < E; e += blockDim.x) {
        ex[e] = expf(l[e] - m);
        sum += ex[e];
    }
    sum = block_sum(sum, scratch);
    for (int s = 0; s < k; ++s) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int e = tid; e < E; e += blockDim.x) {
            float v = ex[e];
            if (v > bv || (v == bv && e < bi)) { bv = v; bi = e; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { best_v[warp] = bv; best_i[warp] = bi; }
        __syncthreads();
        if (tid == 0) {
            float v = best_v[0];
            int i = best_i[0];
            for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
                if (best_v[w] > v || (best_v[w] == v && best_i[w] < i)) { v = best_v[w]; i = best_i[w]; }
            topk_idx[t * k + s] = i;
            chosen[s] = v / sum;
            ex[i] = NEG_INF;
        }
        __syncthreads();
    }
    if (tid == 0) {
        float total = 0.0f;
        for (int s = 0; s < k; ++s) total += chosen[s];
        for (int s = 0; s < k; ++s) topk_w[t * k + s] = renormalize ? chosen[s] / total : chosen[s];
    }
    __syncthreads();
}

// One block (256 threads) per token. Dynamic shared memory: E floats.
extern "C" __global__ void moe_route(int* topk_idx, float* topk_w, const float* logits, int E, int k, int renormalize) {
    extern __shared__ float ex[];
    route_token(blockIdx.x, topk_idx, topk_w, logits, E, k, renormalize, ex);
}

// One block (256 threads) per expert: the (token, slot) entries routed to it, in entry order.
// lists[e * cap + i] = t * slots + s; counts[e] = number of entries. With the shared expert
// folded in (slots = k + 1), block E lists slot k of every token (cap = T tokens).
extern "C" __global__ void moe_group(int* lists, int* counts, const int* topk_idx, int entries, int cap, int k, int slots, int E) {
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
    if (threadIdx.x != 0) return;
    int n = 0;
    for (int e = 0; e < E; ++e)
        if (counts[e] > 0) active[1 + n++] = e;
    active[0] = n;
}

// moe_group and moe_active in one block, for steps with few (token, slot) entries: the same
// lists, counts and active list from one launch. With `route`, the block first routes the T
// tokens itself (one launch for a decode step); otherwise moe_route has. Entries and the shared
// expert as in moe_group (`fold`: the shared expert is group E). Dynamic shared memory:
// E + 1 floats (routing), then reused as ints (counts).
extern "C" __global__ void moe_group_few(int* topk_idx, float* topk_w, const float* logits, int E, int k, int renormalize, int* lists, int* counts, int* active, int T, int route,
        int slots, int fold) {
    extern __shared__ float ex[];
    if (route)
        for (int t = 0; t < T; ++t) route_token(t, topk_idx, topk_w, logits, E, k, renormalize, ex);
    // route_token ends on a barrier: the block's writes of topk_idx are visible to it here.
    int* cnt = (int*)ex;
    int entries = T * k, cap = T, groups = E + fold;
    for (int e = threadIdx.x; e < groups; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 0; i < entries; ++i) {
            int e = topk_idx[i];
            lists[(long long)e * cap + cnt[e]++] = (i / k) * slots + i % k;
        }
        if (fold)
            for (int t = 0; t < T; ++t) lists[(long long)E * cap + cnt[E]++] = t * slots + k;
        int n = 0;
        for (int e = 0; e < groups; ++e)
            if (cnt[e] > 0) active[1 + n++] = e;
        active[0] = n;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < groups; e += blockDim.x) counts[e] = cnt[e];
}

// acc[t] += (sum_s w[t,s] * y[t*slots+s] (s < k, in order), then + sigmoid(shared_gate[t]) *
// shared[t * shared_stride]): the MoE output added into the residual stream, as add_assign
// would. The shared expert's row is y's slot k when it ran with the experts.
extern "C" __global__ void moe_combine(float* out, const float* y, const float* topk_w, const float* shared, const float* shared_gate, int T, int H, int k, int slots,
        long long shared_stride) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)T * H) return;
    int t = (int)(idx / H), d = (int)(idx % H);
    float acc = 0.0f;
    for (int s = 0; s < k; ++s) acc += topk_w[t * k + s] * y[((long long)t * slots + s) * H + d];
    if (shared) {
        float scale = shared_gate ? 1.0f / (1.0f + expf(-shared_gate[t])) : 1.0f;
        acc += scale * shared[t * shared_stride + d];
    }
    out[idx] = out[idx] + acc;
}
