// Shared device helpers, prepended to every kernel source before NVRTC compiles it.
// No NVIDIA headers: bf16 conversions are written in PTX.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t h) { return __uint_as_float(((u32)h) << 16); }

// Round to nearest even.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Two floats as a bf16 pair: `lo` in the low half (the lower k index of an mma fragment).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

#ifdef KESTREL_TRACE
// Start-time trace (KESTREL_CUDA_TRACE=1, profile.rs): the host points this at a buffer of
// [count, capacity, then per kernel (resident ns, inputs-ready ns)].
__device__ u64* kestrel_trace;

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Marks of the kernel whose inputs were ready last (entry count - 1), after the entries: per
// kernel, TRACE_MARKS times. Past its wait, a kernel is the only one running (the next waits
// for its end), so the last entry is its own once block 0 has counted itself, which it does
// first thing after the wait. Block ends are maxima over the blocks; the others are set once.
#define TRACE_MARKS 4
// Block 0's first weights landed (streaming matmuls).
#define TRACE_FIRST_DATA 0
// The latest block end.
#define TRACE_BLOCK_END 1
// Block 0's activation rows ready for its k loop (streaming matmuls).
#define TRACE_ROWS_READY 2
// Block 0 knows its group (grouped streaming matmuls); the router's last block got its ticket.
#define TRACE_GROUP_KNOWN 3
__device__ __forceinline__ void trace_mark(int which) {
    if (!kestrel_trace) return;
    u64 n = *(volatile u64*)kestrel_trace, cap = kestrel_trace[1];
    if (n == 0 || n > cap) return;
    u64* mark = kestrel_trace + 2 + 2 * cap + TRACE_MARKS * (n - 1) + which;
    if (which == TRACE_BLOCK_END) atomicMax(mark, global_ns());
    else *mark = global_ns();
}
#define TRACE_MARK(which) trace_mark(which)
#else
#define TRACE_MARK(which) \
    do {                  \
    } while (0)
#endif

// wait_for_inputs without letting the next kernel launch: for a kernel whose next launch reads
// something it writes before that launch's own wait (let_dependents_launch once it is written).
__device__ __forceinline__ void wait_for_inputs_holding_dependents() {
#ifdef KESTREL_TRACE
    u64 resident = global_ns();
#endif
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef KESTREL_TRACE
    // The first block of each kernel records when it became resident and when its inputs were
    // ready; kernels pass this point in launch order, so entry i is the i-th launch.
    if (kestrel_trace && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        u64 i = atomicAdd(kestrel_trace, 1ull);
        if (i < kestrel_trace[1]) {
            kestrel_trace[2 + 2 * i] = resident;
            kestrel_trace[3 + 2 * i] = global_ns();
        }
    }
#endif
}

__device__ __forceinline__ void let_dependents_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Programmatic dependent launch (sm_90 and later). Kernels are launched allowed to start before
// the previous kernel in the stream has finished, which hides the launch latency and the
// previous kernel's tail. Every kernel calls this before its first read of anything an earlier
// kernel wrote and before its first global write (the previous kernel may still be reading the
// memory it writes); only reads of weights, and of what launches two or more back wrote, may
// come before it (a kernel starts only once the one before it has passed its own wait, that
// is, once the launch two back has finished). Once this kernel's inputs are ready, the next
// kernel may launch and wait in turn. Without the launch attribute both instructions do
// nothing.
__device__ __forceinline__ void wait_for_inputs() {
    wait_for_inputs_holding_dependents();
    let_dependents_launch();
}

// Asks L2 to fetch `bytes` (a multiple of 16) at the 16-byte aligned `p` without waiting for
// them (the sm_90 bulk prefetch; a hint, so nothing before sm_90, where callers fall back or
// skip).
__device__ __forceinline__ void bulk_prefetch_l2(const void* p, u32 bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Loads that skip L1, for data written during the same launch by other blocks, or by a kernel
// this one has not waited for: L1 is not coherent across SMs, L2 is.
__device__ __forceinline__ float load_l2(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ int load_l2(const int* p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u64 load_l2(const u64* p) {
    u64 v;
    asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes global -> shared without passing through registers (sm_80 and later; complete them
// with cp.async.wait), zero-filled when !valid.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.0f + expf(-x)); }

// Butterfly sum over a warp: the same fixed pairing on every call.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the block's first `nwarps` warps with a fixed order: warp butterflies, then warp 0
// sums the warp totals; `sync` is the barrier among those warps. `scratch` holds at least 33
// floats. Every thread gets the result.
template <typename Barrier>
__device__ __forceinline__ float warps_sum(float v, float* scratch, int nwarps, Barrier sync) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    sync();
    if (lane == 0) scratch[warp] = v;
    sync();
    if (warp == 0) {
        float t = lane < nwarps ? scratch[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) scratch[32] = t;
    }
    sync();
    return scratch[32];
}

// warps_sum over the whole block.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    return warps_sum(v, scratch, (blockDim.x + 31) >> 5, [] { __syncthreads(); });
}

// block_sum of two values with one set of barriers (the same sums, bit for bit); `scratch`
// holds 66 floats.
__device__ __forceinline__ float2 block_sum2(float a, float b, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    a = warp_sum(a);
    b = warp_sum(b);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = a;
        scratch[33 + warp] = b;
    }
    __syncthreads();
    if (warp == 0) {
        float t = warp_sum(lane < nwarps ? scratch[lane] : 0.0f);
        float u = warp_sum(lane < nwarps ? scratch[33 + lane] : 0.0f);
        if (lane == 0) {
            scratch[32] = t;
            scratch[65] = u;
        }
    }
    __syncthreads();
    return make_float2(scratch[32], scratch[65]);
}

// Float4s per thread the row norm keeps in registers: rows of up to 8192 floats at 256 threads.
#define RMS_VECS 8

// Whether a row norm takes the register path: width a multiple of 4, at most RMS_VECS float4s
// per thread, 16-byte aligned row, output and weight.
__device__ __forceinline__ bool rms_row_in_registers(const float* xr, const float* yr, const float* w, int cols) {
    return (cols & 3) == 0 && (cols >> 2) <= RMS_VECS * (int)blockDim.x && (((u64)xr | (u64)yr | (u64)w) & 15) == 0;
}

// The register path of the row norm (rms_norm_rows, and kernels that end by normalizing the
// rows they wrote): v[i] / wv[i] hold float4 threadIdx.x + i * blockDim.x of the row and the
// weight (zeros past the row's end); writes yr = v * rsqrt(mean(v^2) + eps) * wv. Every
// caller gets the same bits for the same row.
// Float4s threadIdx.x + i * stride (i < RMS_VECS) of a row of `nvec` float4s, zero past its
// end: a thread's part of the row on the register path.
__device__ __forceinline__ void row_float4s(float4 v[RMS_VECS], const float4* x4, int nvec, int stride) {
#pragma unroll
    for (int i = 0; i < RMS_VECS; ++i) {
        int c = threadIdx.x + i * stride;
        float4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
        v[i] = c < nvec ? x4[c] : zero;
    }
}

// A thread's share of a row's sum of squares on the register path (float4s v[i], zero past
// the row's end). Kernels that normalize rows themselves use it to get rms_norm_rows' bits.
__device__ __forceinline__ float rms_partial(const float4 v[RMS_VECS]) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < RMS_VECS; ++i) ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
    return ss;
}

__device__ __forceinline__ void rms_norm_row_registers(float* yr, const float4 v[RMS_VECS], const float4 wv[RMS_VECS], int cols, float eps, float* scratch) {
    int nvec = cols >> 2;
    float ss = block_sum(rms_partial(v), scratch);
    float inv = 1.0f / sqrtf(ss / (float)cols + eps);
#pragma unroll
    for (int i = 0; i < RMS_VECS; ++i) {
        int c = threadIdx.x + i * blockDim.x;
        if (c < nvec) {
            float4 y = {v[i].x * inv * wv[i].x, v[i].y * inv * wv[i].y, v[i].z * inv * wv[i].z, v[i].w * inv * wv[i].w};
            ((float4*)yr)[c] = y;
        }
    }
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nwarps ? scratch[lane] : NEG_INF;
        t = warp_max(t);
        if (lane == 0) scratch[32] = t;
    }
    __syncthreads();
    return scratch[32];
}

// Per-row description of a step, packed by the host (see layout.rs).
struct RowInfo {
    int kind;            // 0 = prefill, 1 = generate
    int token_start;
    int num_tokens;
    int start_position;
    int state_slot;
    int snapshot_base;
    int block_table_offset;
    int block_table_len;
};
