// Position-keyed sampling on the device (the draw is defined in src/engine/sampler.rs): one
// block per logits row, so only the chosen token ids leave the GPU.
//
// inv_temps[r] == 0 selects greedy: the argmax, NaN as -inf, ties to the lowest id.
// Otherwise Gumbel-max over every token: score = (double)logit * inv_temp - ln(-ln(u)) with
// u from the SplitMix64 hash of (position key, token); -inf and NaN logits never win. Rows with
// top-k / top-p filtering are drawn on the host (the filtered set needs a sort).

__device__ __forceinline__ u64 splitmix64_mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 splitmix64_step(u64 x) { return splitmix64_mix(x + 0x9e3779b97f4a7c15ULL); }

// Better of two candidates: higher score, then lower token.
__device__ __forceinline__ bool beats(double s, int t, double best_s, int best_t) {
    return s > best_s || (s == best_s && t < best_t);
}

#define SAMPLE_THREADS 512
#define NEG_INF_F64 __longlong_as_double(0xfff0000000000000LL)

// out[r] = token drawn from logits[rows[r]], with keys[r] = position key (splitmix64_step(
// splitmix64_step(seed) ^ position)) and inv_temps[r] = 1 / temperature (0 for greedy).
extern "C" __global__ void sample_rows(int* out, const float* logits, const int* rows, const u64* keys, const double* inv_temps, int vocab) {
    wait_for_inputs();
    __shared__ double best_scores[SAMPLE_THREADS];
    __shared__ int best_tokens[SAMPLE_THREADS];
    int r = blockIdx.x;
    const float* row = logits + (long long)rows[r] * vocab;
    double inv_t = inv_temps[r];
    u64 key = keys[r];
    bool greedy = inv_t == 0.0;
    double best_s = NEG_INF_F64;
    int best_t = 0x7fffffff;
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
        float l = row[t];
        bool masked = l != l || l == NEG_INF;  // NaN or -inf
        double s;
        if (greedy) {
            s = masked ? NEG_INF_F64 : (double)l;
        } else {
            if (masked) continue;
            u64 h = splitmix64_step(key ^ (u64)(u32)t);
            double u = ((double)(h >> 12) + 0.5) * (1.0 / 4503599627370496.0);
            s = (double)l * inv_t + (-log(-log(u)));
        }
        if (beats(s, t, best_s, best_t)) {
            best_s = s;
            best_t = t;
        }
    }
    best_scores[threadIdx.x] = best_s;
    best_tokens[threadIdx.x] = best_t;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            int o = threadIdx.x + stride;
            if (beats(best_scores[o], best_tokens[o], best_scores[threadIdx.x], best_tokens[threadIdx.x])) {
                best_scores[threadIdx.x] = best_scores[o];
                best_tokens[threadIdx.x] = best_tokens[o];
            }
        }
        __syncthreads();
    }
    // Every token masked: token 0, as the host sampler answers.
    if (threadIdx.x == 0) out[r] = best_tokens[0] == 0x7fffffff ? 0 : best_tokens[0];
}
