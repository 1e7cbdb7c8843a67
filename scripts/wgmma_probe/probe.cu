// Probe: is wgmma.mma_async m64nNk16 (bf16 in, f32 accumulate) bitwise equal to a chain of
// m16n8k16 mma.sync over the same k16 chunks in the same order? One warpgroup, a 64 x 64 block
// over K (a multiple of 32), three ways: the mma.sync chain of the matmul kernels (`ref`,
// [x row][w row]); wgmma with the weights as A from registers and the activations as B from
// shared memory (`swp`, the operands swapped relative to the mma.sync kernels); wgmma with the
// activations as A from registers and the weights as B (`nsw`). `xp`/`wp` are x/w with each
// 32-wide k block's bf16 pairs in wgmma order (round_activations_wgmma's permutation).
// Compiled with common.cuh and matmul_common.cuh in front, for sm_90a.

#define P_D8(i) "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
__device__ __forceinline__ void wgmma_n64_rs(float d[32], const u32 a[4], u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31},"
        " {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
        : P_D8(0), P_D8(8), P_D8(16), P_D8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
__device__ __forceinline__ u64 p_desc(u32 addr) {
    return (u64)((addr >> 4) & 0x3fff) | ((u64)(128 >> 4) << 16) | ((u64)(512 >> 4) << 32);
}

extern "C" __global__ void __launch_bounds__(128) probe_mma(float* ref, float* swp, float* nsw, const bf16_t* x, const bf16_t* w, const bf16_t* xp, const bf16_t* wp, int K) {
    __shared__ __align__(128) unsigned char s_b[64 * 64];
    int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, q = lane & 3, wv = tid >> 5;
    float c[8][4], ds[32], dn[32];
    for (int j = 0; j < 8; ++j) for (int e = 0; e < 4; ++e) c[j][e] = 0.0f;
    for (int i = 0; i < 32; ++i) ds[i] = dn[i] = 0.0f;
    int r0 = 16 * wv + g;
    for (int kb = 0; kb < K / 32; ++kb) {
        int k = kb * 32 + 8 * q;
        uint4 x0 = *(const uint4*)(x + (long long)r0 * K + k), x1 = *(const uint4*)(x + (long long)(r0 + 8) * K + k);
        uint4 w0 = *(const uint4*)(w + (long long)r0 * K + k), w1 = *(const uint4*)(w + (long long)(r0 + 8) * K + k);
        u32 xa0[4] = {x0.x, x1.x, x0.y, x1.y}, xa1[4] = {x0.z, x1.z, x0.w, x1.w};
        u32 wa0[4] = {w0.x, w1.x, w0.y, w1.y}, wa1[4] = {w0.z, w1.z, w0.w, w1.w};
        // mma.sync chain: x rows 16wv.. as A, the 64 weight rows as eight n8 tiles.
        for (int j = 0; j < 8; ++j) {
            uint4 bw = *(const uint4*)(w + (long long)(8 * j + g) * K + k);
            mma_bf16(c[j], xa0, bw.x, bw.y);
            mma_bf16(c[j], xa1, bw.z, bw.w);
        }
        // Swapped: B = the permuted activations in core-matrix layout.
        for (int i = tid; i < 256; i += 128) {
            int r = i >> 2, ch = i & 3;
            *(uint4*)(s_b + (r >> 3) * 512 + ch * 128 + (r & 7) * 16) = *(const uint4*)(xp + (long long)r * K + kb * 32 + ch * 8);
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        u32 base = smem_u32(s_b);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        wgmma_n64_rs(ds, wa0, p_desc(base));
        wgmma_n64_rs(ds, wa1, p_desc(base + 256));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        __syncthreads();
        // Not swapped: B = the permuted weights.
        for (int i = tid; i < 256; i += 128) {
            int r = i >> 2, ch = i & 3;
            *(uint4*)(s_b + (r >> 3) * 512 + ch * 128 + (r & 7) * 16) = *(const uint4*)(wp + (long long)r * K + kb * 32 + ch * 8);
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        wgmma_n64_rs(dn, xa0, p_desc(base));
        wgmma_n64_rs(dn, xa1, p_desc(base + 256));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        __syncthreads();
    }
    for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 4; ++e) {
            int xr = r0 + 8 * (e >> 1), wc = 8 * j + 2 * q + (e & 1);
            ref[xr * 64 + wc] = c[j][e];
            nsw[xr * 64 + wc] = dn[4 * j + e];
            // swapped: M = weight row r0 + 8(e>>1), N = x row 8j + 2q + (e&1)
            swp[(8 * j + 2 * q + (e & 1)) * 64 + r0 + 8 * (e >> 1)] = ds[4 * j + e];
        }
}
