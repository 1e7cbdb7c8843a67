// Position-keyed sampling on the device (the draw is defined in src/backend/sampling/mod.rs):
// one block per logits row, so only the chosen token ids leave the GPU.
//
// inv_temps[r] == 0 selects greedy: the argmax, NaN as -inf, ties to the lowest id.
// A row with a grammar mask (mask_rows[r] >= 0: its words start at masks + mask_rows[r] *
// mask_words) draws as if every token the mask does not allow (bit t % 32 of word t / 32 clear,
// or past the words) had a logit of -inf.
// Otherwise Gumbel-max over every token: score = (double)logit * inv_temp - ln(-ln(u)) with
// u from the SplitMix64 hash of (position key, token); -inf and NaN logits never win. Rows with
// top-k / top-p / min-p filtering are drawn on the host (the filtered set needs a sort).
// A row without a single finite logit draws -1 (the host's NO_FINITE_LOGIT): its request ends
// with an error.

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

#define SAMPLE_THREADS 256
#define NEG_INF_F64 __longlong_as_double(0xfff0000000000000LL)
// done[r] counts the row's finished blocks in its low 16 bits and, from this bit up, those of
// them that saw a finite logit (a row has fewer than 65536 blocks).
#define FINITE_BLOCK 0x10000u

// Neither NaN nor an infinity: the exponent bits are not all ones.
__device__ __forceinline__ bool is_finite_f32(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

// Keeps (s, t) as the thread's best if it beats it.
__device__ __forceinline__ void keep_best(double s, int t, double& best_s, int& best_t) {
    if (beats(s, t, best_s, best_t)) {
        best_s = s;
        best_t = t;
    }
}

// The block's best of the threads' (score, token) into slot 0 of the shared arrays (a tree in
// fixed order; the winner is the same in any order, since `beats` is a strict total order on
// tokens).
__device__ __forceinline__ void best_of_block(double best_s, int best_t, double* scores, int* tokens) {
    scores[threadIdx.x] = best_s;
    tokens[threadIdx.x] = best_t;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            int o = threadIdx.x + stride;
            if (beats(scores[o], tokens[o], scores[threadIdx.x], tokens[threadIdx.x])) {
                scores[threadIdx.x] = scores[o];
                tokens[threadIdx.x] = tokens[o];
            }
        }
        __syncthreads();
    }
}

// out[r] = token drawn from logits[rows[r]] (-1 when no logit of the row is finite), with
// keys[r] = position key (splitmix64_step(splitmix64_step(seed) ^ position)) and inv_temps[r] =
// 1 / temperature (0 for greedy).
// Grid (splits, rows): a row's vocabulary is cut into gridDim.x ranges, a block each (one block
// walking a 248K vocabulary took about 0.2 ms, most of a small model's decode step). Each
// block leaves its range's best in part_s/part_t; the last block of the row to finish (counted
// in done[r], zero before the launch) picks the best of them and sets done[r] back to zero.
extern "C" __global__ void sample_rows(int* out, const float* logits, const int* rows, const u64* keys, const double* inv_temps, int vocab, double* part_s, int* part_t,
        unsigned* done, const unsigned* masks, const int* mask_rows, int mask_words) {
    wait_for_inputs();
    __shared__ double best_scores[SAMPLE_THREADS];
    __shared__ int best_tokens[SAMPLE_THREADS];
    __shared__ bool last, row_finite;
    int r = blockIdx.y, splits = gridDim.x;
    const float* row = logits + (long long)rows[r] * vocab;
    double inv_t = inv_temps[r];
    u64 key = keys[r];
    int mask_row = mask_rows ? mask_rows[r] : -1;
    const unsigned* mask = mask_row >= 0 ? masks + (long long)mask_row * mask_words : nullptr;
    bool greedy = inv_t == 0.0;
    double best_s = NEG_INF_F64;
    int best_t = 0x7fffffff;
    bool finite = false;
    int chunk = (vocab + splits - 1) / splits, t0 = blockIdx.x * chunk, t1 = min(t0 + chunk, vocab);
    // Four loads in flight per thread before the scores.
    for (int base = t0 + threadIdx.x; base < t1; base += 4 * blockDim.x) {
        float l[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int t = base + j * blockDim.x;
            l[j] = t < t1 ? row[t] : NEG_INF;
            if (mask && t < t1 && ((t >> 5) >= mask_words || !((mask[t >> 5] >> (t & 31)) & 1u))) l[j] = NEG_INF;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int t = base + j * blockDim.x;
            bool masked = l[j] != l[j] || l[j] == NEG_INF;  // NaN or -inf
            if (t >= t1 || (masked && !greedy)) continue;
            finite |= is_finite_f32(l[j]);
            double s;
            if (greedy) {
                s = masked ? NEG_INF_F64 : (double)l[j];
            } else {
                u64 h = splitmix64_step(key ^ (u64)(u32)t);
                double u = ((double)(h >> 12) + 0.5) * (1.0 / 4503599627370496.0);
                s = (double)l[j] * inv_t + (-log(-log(u)));
            }
            keep_best(s, t, best_s, best_t);
        }
    }
    bool block_finite = __syncthreads_or(finite) != 0;
    best_of_block(best_s, best_t, best_scores, best_tokens);
    // A finite logit is never masked, so a row with one always has a winner.
    if (splits == 1) {
        if (threadIdx.x == 0) out[r] = block_finite ? best_tokens[0] : -1;
        return;
    }
    if (threadIdx.x == 0) {
        part_s[r * splits + blockIdx.x] = best_scores[0];
        part_t[r * splits + blockIdx.x] = best_tokens[0];
        // The partial is visible to every block before this block is counted.
        __threadfence();
        unsigned mine = 1u + (block_finite ? FINITE_BLOCK : 0u);
        // The last block's count includes every other block's.
        unsigned counted = atomicAdd(&done[r], mine) + mine;
        last = (counted & (FINITE_BLOCK - 1u)) == (unsigned)splits;
        row_finite = counted >= FINITE_BLOCK;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    volatile double* ps = part_s;
    volatile int* pt = part_t;
    best_s = NEG_INF_F64;
    best_t = 0x7fffffff;
    for (int i = threadIdx.x; i < splits; i += blockDim.x) keep_best(ps[r * splits + i], pt[r * splits + i], best_s, best_t);
    best_of_block(best_s, best_t, best_scores, best_tokens);
    if (threadIdx.x == 0) {
        out[r] = row_finite ? best_tokens[0] : -1;
        done[r] = 0u;
    }
}

// ids[r] = drafts[rows[r]], or 0 where that draft is -1 (no finite logit): the next chained
// drafter forward's token ids, written on the device from the argmax of the forward before it,
// so that a chain of drafter forwards needs no read-back between them. A row clamped to 0
// drafts nothing further (the host cuts its drafts at the -1); the id only keeps the
// embedding's read inside the table.
extern "C" __global__ void draft_ids(int* ids, const int* drafts, const int* rows, int n) {
    wait_for_inputs();
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < n) {
        int id = drafts[rows[r]];
        ids[r] = id < 0 ? 0 : id;
    }
}
