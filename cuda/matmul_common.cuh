// Definitions shared by the matmul module (cuda/matmul.cu) and the quantized matmul modules
// (cuda/qmatmul.cu): the k-slice count, the stores, the bf16 mma and the activations' rounding to bf16.

#define KSLICES 8

// What a matmul does with each output element; the products are the same in every mode, only
// the store differs, so a fused projection gives bitwise the values of the separate ops.
#define EPI_STORE 0   // out[r, c] = v
#define EPI_ADD 1     // out[r, c] += v: out is the residual stream (bitwise add_assign)
#define EPI_SWIGLU 2  // W = gate stacked over up ([2I, K]); logical column 2i is gate row i and
                      // 2i+1 up row i, so one thread holds both: out[r, i] = silu(gate) * up
#define EPI_PARTS 3   // consecutive column parts of `width`, each its own [rows, width] tensor
struct Epilogue {
    int mode;
    int parts;
    int width[4];
    u64 ptr[4];
};

// The weight row behind logical output column n (N logical columns, N weight rows).
__device__ __forceinline__ long long weight_row(const Epilogue& e, int n, int N) {
    return e.mode == EPI_SWIGLU ? (n >> 1) + (n & 1) * (N >> 1) : n;
}

__device__ __forceinline__ void store_one(const Epilogue& e, float* out, long long orow, int col, int N, float v) {
    if (col >= N) return;
    if (e.mode == EPI_PARTS) {
        int p = 0, start = 0;
        while (p + 1 < e.parts && col >= start + e.width[p]) start += e.width[p++];
        ((float*)e.ptr[p])[orow * e.width[p] + (col - start)] = v;
    } else if (e.mode == EPI_ADD) {
        float* o = out + orow * N + col;
        *o = *o + v;
    } else {
        out[orow * N + col] = v;
    }
}

// Columns col (even) and col + 1 of output row orow.
__device__ __forceinline__ void store_pair(const Epilogue& e, float* out, long long orow, int col, int N, float v0, float v1) {
    if (e.mode == EPI_SWIGLU) {
        // The silu_mul kernel's expression (N is even, so both columns exist or neither).
        if (col < N) out[orow * (N >> 1) + (col >> 1)] = siluf_(v0) * v1;
        return;
    }
    store_one(e, out, orow, col, N, v0);
    store_one(e, out, orow, col + 1, N, v1);
}

__device__ __forceinline__ void mma_bf16(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Activations enter the tensor cores as bf16 (round to nearest even), one mma per product
// with an f32 accumulator, as bf16 inference does everywhere (the residual stream stays f32).
// Pairs of 8 consecutive values: out[i] = {v[2i], v[2i+1]}.
__device__ __forceinline__ void round8(const float v[8], u32 hi[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) hi[i] = pack_bf16x2(v[2 * i], v[2 * i + 1]);
}
