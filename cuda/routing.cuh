// MoE routing and the MoE's weighted sum, shared by cuda/moe.cu and cuda/matmul.cu (whose
// router matmul routes in its last block, and whose streaming matmuls can start from the
// MoE's sum): both modules are compiled with this text in front of them.

// Most experts routing supports: each lane keeps E / 32 probabilities in registers.
#define ROUTE_MAX_PER_LANE 16

// Whether route_token takes route_top_k_sorted where it applies (1) or its argmax rounds (0, for
// A/B runs through `KESTREL_CUDA_DEFINES=ROUTE_SORTED=0`): the same choices either way.
#ifndef ROUTE_SORTED
#define ROUTE_SORTED 1
#endif

// A probability as an unsigned key for integer reductions: a probability is >= 0 or NEG_INF, so
// its bits plus one (0 for NEG_INF) order as unsigned integers as the floats do, and equal keys
// are equal probabilities. route_key_value gives the probability back.
__device__ __forceinline__ u32 route_key(float p) {
    return p >= 0.0f ? __float_as_uint(p) + 1u : 0u;
}
__device__ __forceinline__ float route_key_value(u32 key) {
    return key == 0u ? NEG_INF : __uint_as_float(key - 1u);
}

// Round s's choice of expert e with probability bv: its weight into the running total, and into
// the registers of lane s % 32 (k <= 64: two registers).
__device__ __forceinline__ void route_keep(int s, int lane, float bv, int e, float sum, float mine_w[2], int mine_i[2], float& total) {
    float chosen = bv / sum;
    total += chosen;
    if ((s & 31) == lane) {
        if (s < 32) { mine_w[0] = chosen; mine_i[0] = e; } else { mine_w[1] = chosen; mine_i[1] = e; }
    }
}

// Round s's expert e to a waiting warp of the block, where route_token is given somewhere to
// put it: the expert into chosen_expert[s], then an arrival on the shared-memory barrier
// chosen_bars + 8s (count 1), whose wait orders the expert before the waiter's reads. A barrier
// rather than a flag: the waiting warp may share the routing warp's SM sub-partition, where a
// spin would take the routing's issue slots. The arrival is written out here because
// mbar_arrive (cuda/matmul_stream.cu) is not in the moe module, which includes this file too.
__device__ __forceinline__ void route_publish(int s, int lane, int e, int* chosen_expert, unsigned chosen_bars) {
    if (chosen_expert && lane == 0) {
        chosen_expert[s] = e;
#if __CUDA_ARCH__ >= 800
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(chosen_bars + 8u * (unsigned)s) : "memory");
#endif
    }
}

#if __CUDA_ARCH__ >= 800
// Descending compare-exchange of two composite keys.
__device__ __forceinline__ void route_cas(u64& a, u64& b) {
    u64 hi = a > b ? a : b, lo = a > b ? b : a;
    a = hi;
    b = lo;
}

// route_token's k argmax rounds where each lane holds at most 8 experts (E <= 256): the same
// choices (the largest probability, ties to the lower expert) and sums, in fewer instructions.
// Each lane sorts its (probability, expert) pairs once, as composite keys (route_key over the
// complement of the expert), by the 19-exchange network for 8; a round then takes the warp's
// largest head by two integer reductions, and the lane that held it drops its head. The
// rounds' argmax over 16 registers is a chain of dependent compares in every round.
__device__ __forceinline__ void route_top_k_sorted(const float p[ROUTE_MAX_PER_LANE], int lane, int k, float sum, float mine_w[2], int mine_i[2], float& total,
        int* chosen_expert, unsigned chosen_bars) {
    u64 s8[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        // A missing expert's probability is NEG_INF, whose key is 0: it is never chosen.
        s8[i] = ((u64)route_key(p[i]) << 32) | (u32)~(lane + 32 * i);
    }
    route_cas(s8[0], s8[2]); route_cas(s8[1], s8[3]); route_cas(s8[4], s8[6]); route_cas(s8[5], s8[7]);
    route_cas(s8[0], s8[4]); route_cas(s8[1], s8[5]); route_cas(s8[2], s8[6]); route_cas(s8[3], s8[7]);
    route_cas(s8[0], s8[1]); route_cas(s8[2], s8[3]); route_cas(s8[4], s8[5]); route_cas(s8[6], s8[7]);
    route_cas(s8[2], s8[4]); route_cas(s8[3], s8[5]);
    route_cas(s8[1], s8[4]); route_cas(s8[3], s8[6]);
    route_cas(s8[1], s8[2]); route_cas(s8[3], s8[4]); route_cas(s8[5], s8[6]);
    for (int s = 0; s < k; ++s) {
        u32 hi = (u32)(s8[0] >> 32), lo = (u32)s8[0], top, best;
        asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(top) : "r"(hi));
        u32 candidate = hi == top ? lo : 0u;
        asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(best) : "r"(candidate));
        bool won = hi == top && lo == best;
        route_keep(s, lane, route_key_value(top), (int)~best, sum, mine_w, mine_i, total);
        route_publish(s, lane, (int)~best, chosen_expert, chosen_bars);
#pragma unroll
        for (int i = 0; i < 7; ++i) s8[i] = won ? s8[i + 1] : s8[i];
        s8[7] = won ? 0ull : s8[7];
    }
}
#endif

// Routing of token t by one warp: softmax over all experts, top-k by repeated argmax (ties to
// the lower index), optional renormalization. Lane j holds experts j, j + 32, ... in registers,
// so an argmax round reads no memory. A warp, not a block: the k argmax rounds need no block
// barriers, and a block of 8 warps routes 8 tokens at once. Every lane ends the butterflies
// with the same (value, index). Returns the expert of slot `lane` (lanes below k, k <= 32).
// `logits_in_l2`: whether the logits are in global memory, where other blocks of the same
// launch may have written them (matmul_router), so they are read from L2; otherwise they are
// in this block's shared memory (moe_route_gate_up). `chosen_expert` (shared memory, or null)
// and `chosen_bars`: where each round's expert goes as the rounds run (route_publish).
__device__ __forceinline__ int route_token(int t, int* topk_idx, float* topk_w, const float* logits, int E, int k, int renormalize, bool logits_in_l2 = true,
        int* chosen_expert = nullptr, unsigned chosen_bars = 0) {
    int lane = threadIdx.x & 31;
    const float* l = logits + (long long)t * E;
    // Probabilities of this lane's experts; NEG_INF marks a chosen or missing one.
    float p[ROUTE_MAX_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i) {
        int e = lane + 32 * i;
        p[i] = e >= E ? NEG_INF : logits_in_l2 ? load_l2(l + e) : l[e];
    }
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
    // Lane s % 32 keeps slot s (route_keep).
    float mine_w[2] = {0.0f, 0.0f};
    int mine_i[2] = {0, 0};
    float total = 0.0f;
#if __CUDA_ARCH__ >= 800
    if (ROUTE_SORTED && E <= 8 * 32) {
        route_top_k_sorted(p, lane, k, sum, mine_w, mine_i, total, chosen_expert, chosen_bars);
    } else
#endif
    for (int s = 0; s < k; ++s) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < ROUTE_MAX_PER_LANE; ++i) {
            int e = lane + 32 * i;
            if (p[i] > bv || (p[i] == bv && e < bi)) { bv = p[i]; bi = e; }
        }
#if __CUDA_ARCH__ >= 800
        // The warp's largest probability, then the lowest expert holding it, by two integer
        // reductions on route_key instead of five rounds of paired shuffles. The same (value,
        // index) as the butterfly below.
        u32 key = route_key(bv), top, low;
        asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(top) : "r"(key));
        u32 mine_low = key == top ? (u32)bi : 0xffffffffu;
        asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(low) : "r"(mine_low));
        bv = route_key_value(top);
        bi = (int)low;
#else
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
#endif
        route_keep(s, lane, bv, bi, sum, mine_w, mine_i, total);
        route_publish(s, lane, bi, chosen_expert, chosen_bars);
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
    return mine_i[0];
}

// The routing of a step with few (token, slot) entries by one block of up to 32 warps: with
// `route`, the block's warps first route the T <= 8 tokens themselves; then the per-group
// lists (entries in entry order), counts and the active list (groups with entries, in group
// order). Entries and the shared expert as in moe_group (`fold`: the shared expert is group
// E). `ex`: shared memory of T * k + E + fold ints.
__device__ __forceinline__ void route_and_group_few(int* ex, int* topk_idx, float* topk_w, const float* logits, int T, int E, int k, int renormalize, int* lists, int* counts,
        int* active, int route, int slots, int fold) {
    __shared__ int warp_counts[32];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    if (route && T == 1 && k <= 32 && k <= E) {
        // One token (a batch-1 decode step): its k experts are distinct and each has one
        // entry, so warp 0 writes the same lists, counts (of the groups with entries, the
        // only ones read) and active list from registers, without the block barriers and the
        // read-back of topk_idx below. An expert's rank among the chosen is its place in the
        // active list (group order).
        if (warp != 0) return;
        int e = route_token(0, topk_idx, topk_w, logits, E, k, renormalize);
        int mine = lane < k ? e : 0x7fffffff;
        int rank = 0;
        for (int j = 0; j < k; ++j) rank += __shfl_sync(FULL_MASK, mine, j) < mine;
        if (lane < k) {
            active[1 + rank] = mine;
            counts[mine] = 1;
            lists[mine] = lane;
        }
        if (lane == 0) {
            if (fold) {
                active[1 + k] = E;
                counts[E] = 1;
                lists[E] = k;
            }
            active[0] = k + fold;
        }
        return;
    }
    if (route)
        for (int t = warp; t < T; t += nwarps) route_token(t, topk_idx, topk_w, logits, E, k, renormalize);
    // The block's global writes of topk_idx are visible to it after the barrier.
    __syncthreads();
    int entries = T * k, cap = T, groups = E + fold;
    int* entry_expert = ex;
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

// The routing of a router launch, in its last block to finish: route_and_group_few with
// `route`, which moe_group_few would run as its own launch. The blocks count themselves in
// `done`, which is zero between launches (the last block resets it). Dynamic shared memory:
// T * k + E + fold ints (the matmul is done with its own by then).
__device__ __forceinline__ void route_in_last_block(unsigned* done, int* topk_idx, float* topk_w, const float* logits, int T, int E, int k, int renormalize, int* lists,
        int* counts, int* active, int slots, int fold) {
    __shared__ unsigned ticket;
    // The block's logits, ordered before thread 0's count by the barrier, are released with it
    // (acq_rel: no fence by every thread before the count); the last block's count acquires
    // every block's, and its threads read after it (the barrier). On the H100 the router's
    // count came 0.7 us sooner in each 35B-A3B layer than with a __threadfence on both sides.
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned t;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(t) : "l"(done) : "memory");
        ticket = t;
    }
    __syncthreads();
    if (ticket != gridDim.x * gridDim.y * gridDim.z - 1) return;
    if (threadIdx.x == 0) *done = 0u;
    if (threadIdx.x == 0) TRACE_MARK(TRACE_GROUP_KNOWN);
    extern __shared__ int route_smem[];
    route_and_group_few(route_smem, topk_idx, topk_w, logits, T, E, k, renormalize, lists, counts, active, 1, slots, fold);
    if (threadIdx.x == 0) TRACE_MARK(TRACE_BLOCK_END);
}

__device__ __forceinline__ float shared_scale(const float* shared_gate, int t) {
    return shared_gate ? 1.0f / (1.0f + expf(-shared_gate[t])) : 1.0f;
}

// The updated residual float4 c of token t: r (the residual's float4 before the MoE) plus
// sum_s w[t,s] * y[t*slots+s] (s < k, in order) plus scale * shared[t * shared_stride]. Every
// kernel that adds the MoE output into whole rows uses it, so they give the same bits.
__device__ __forceinline__ float4 moe_combined4(float4 r, const float* y, const float* topk_w, const float* shared, float scale, int t, int c, int H, int k, int slots,
        long long shared_stride) {
    float4 acc = {0.0f, 0.0f, 0.0f, 0.0f};
    // Unrolled so that the k loads are in flight together; the sum stays in slot order.
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
    r.x = r.x + acc.x;
    r.y = r.y + acc.y;
    r.z = r.z + acc.z;
    r.w = r.w + acc.w;
    return r;
}

// The rows a normalizing streaming matmul starts from (matmul_stream_norm_*: `resid` only;
// matmul_stream_combine_*: the residual rows before the MoE, the expert rows, their weights,
// the shared expert's rows and gate (null: none), and where the updated residual rows go).
// Passed by value; the host's `MoeCombine` in backend/cuda/matmul.rs has the same layout.
struct MoeCombine {
    const float* resid;
    const float* y;
    const float* topk_w;
    const float* shared;
    const float* shared_gate;
    float* resid_out;
    long long shared_stride;
    int k;
    int slots;
};
