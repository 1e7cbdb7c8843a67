// Row-wise and element-wise ops on f32 activations. Every output element depends only on its
// own row, with fixed block sizes and reduction orders.

extern "C" __global__ void embed_rows(float* out, const bf16_t* hi, const bf16_t* lo, const int* ids, int rows, int cols) {
    wait_for_inputs();
    int r = blockIdx.x;
    if (r >= rows) return;
    long long src = (long long)ids[r] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = bf16_to_f32(hi[src + c]);
        if (lo) v += bf16_to_f32(lo[src + c]);
        out[(long long)r * cols + c] = v;
    }
}

// y = x * rsqrt(mean(x^2) + eps) * w, one block of 256 threads per row. Rows whose width is a
// multiple of 4 (up to RMS_VECS float4s per thread) are loaded once into registers, all loads
// issued before the first use: a row of a decode step is one block, so the kernel's time is
// its chain of memory latencies, not its bytes.
extern "C" __global__ void rms_norm_rows(float* out, const float* x, const float* w, int rows, int cols, float eps) {
    wait_for_inputs();
    __shared__ float scratch[33];
    int r = blockIdx.x;
    const float* xr = x + (long long)r * cols;
    float* yr = out + (long long)r * cols;
    int nvec = cols >> 2;
    if (rms_row_in_registers(xr, yr, w, cols)) {
        float4 v[RMS_VECS], wv[RMS_VECS];
        row_float4s(v, (const float4*)xr, nvec, blockDim.x);
        row_float4s(wv, (const float4*)w, nvec, blockDim.x);
        rms_norm_row_registers(yr, v, wv, cols, eps, scratch);
        return;
    }
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(ss / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = xr[c] * inv * w[c];
}

extern "C" __global__ void add_assign(float* x, const float* y, long long n) {
    wait_for_inputs();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

extern "C" __global__ void silu_mul(float* out, const float* gate, const float* up, long long n) {
    wait_for_inputs();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = siluf_(gate[i]) * up[i];
}

extern "C" __global__ void gather_cols(float* out, const float* x, const int* cols, int rows, int in_cols, int out_cols) {
    wait_for_inputs();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * out_cols) return;
    int r = (int)(i / out_cols), c = (int)(i % out_cols);
    out[i] = x[(long long)r * in_cols + cols[c]];
}

extern "C" __global__ void gather_rows(float* out, const float* x, const int* rows, int n_rows, int cols) {
    wait_for_inputs();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_rows * cols) return;
    int r = (int)(i / cols), c = (int)(i % cols);
    out[i] = x[(long long)rows[r] * cols + c];
}

extern "C" __global__ void concat_cols(float* out, const float* a, const float* b, int rows, int ca, int cb) {
    wait_for_inputs();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int w = ca + cb;
    if (i >= (long long)rows * w) return;
    int r = (int)(i / w), c = (int)(i % w);
    out[i] = c < ca ? a[(long long)r * ca + c] : b[(long long)r * cb + (c - ca)];
}

// Uniform values in [-scale, scale) from a hash of (seed, index): random weights made on the
// device, for benchmarks at real sizes without a file.
extern "C" __global__ void fill_random_bf16(bf16_t* out, long long n, u64 seed, float scale) {
    wait_for_inputs();
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 z = seed + (u64)i * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        out[i] = f32_to_bf16((2.0f * u - 1.0f) * scale);
    }
}

// out = in, 16 bytes per thread: measures the copy bandwidth the roofline is computed from.
extern "C" __global__ void copy_bandwidth(uint4* out, const uint4* in, long long n) {
    wait_for_inputs();
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = in[i];
}

// Reads `in` (16 bytes per thread, four loads in flight) and folds the words into a value that
// is stored only if it equals `never`, so the loads cannot be dropped: the read bandwidth a
// decode step's weight stream could reach, for the roofline.
extern "C" __global__ void read_bandwidth(u32* out, const uint4* in, long long n, u32 never) {
    wait_for_inputs();
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    u32 acc = 0;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = in[i], b = in[i + stride], c = in[i + 2 * stride], d = in[i + 3 * stride];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        uint4 a = in[i];
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == never) out[0] = acc;
}
