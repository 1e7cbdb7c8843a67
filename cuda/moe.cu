// Mixture-of-experts routing and combination. Expert matmuls run through the grouped mode of
// the matmul kernels, with per-expert row lists built here in token order (the routing itself
// is in cuda/routing.cuh, which the router matmul uses too).

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
// entries: the same lists, counts and active list from one launch (route_and_group_few; with
// `route` it also routes the T <= 8 tokens, otherwise moe_route has). Dynamic shared memory:
// entries + groups ints.
extern "C" __global__ void moe_group_few(int* topk_idx, float* topk_w, const float* logits, int T, int E, int k, int renormalize, int* lists, int* counts, int* active, int route,
        int slots, int fold) {
    wait_for_inputs();
    extern __shared__ int ex[];
    route_and_group_few(ex, topk_idx, topk_w, logits, T, E, k, renormalize, lists, counts, active, route, slots, fold);
}

// The MoE output for (token t, column d): sum_s w[t,s] * y[t*slots+s, d] (s < k, in order),
// then + scale * shared[t * shared_stride + d] with scale = sigmoid(shared_gate[t]) (1 without
// a gate): moe_combined4's sum for one column, so that both give the same bits.
__device__ __forceinline__ float moe_output(const float* y, const float* topk_w, const float* shared, float scale, int t, int d, int H, int k, int slots, long long shared_stride) {
    float acc = 0.0f;
    // Unrolled so that the k loads are in flight together; the sum stays in slot order.
#pragma unroll 8
    for (int s = 0; s < k; ++s) acc += topk_w[t * k + s] * y[((long long)t * slots + s) * H + d];
    if (shared) acc += scale * shared[t * shared_stride + d];
    return acc;
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
// threads per token, one launch fewer per layer. Four columns per thread (moe_combined4, with
// the float4 loads all issued before the sums); each column's sum is moe_output's expression
// (the GPU tests check the bits against moe_combine). The host takes this path only where the
// row norm takes its register path (rms_row_in_registers).
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
            v[i] = moe_combined4(row[c], y, topk_w, shared, scale, t, c, H, k, slots, shared_stride);
            row[c] = v[i];
            wv[i] = ((const float4*)w)[c];
        }
    }
    rms_norm_row_registers(normed + (long long)t * H, v, wv, H, eps, scratch);
}
