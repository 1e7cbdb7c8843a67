// How fast bursts of sm_90 bulk copies (cp.async.bulk into shared memory, what the streaming
// matmuls copy their weights with) land when many SMs start them at once: one block per SM
// issues `copies` copies of `bytes` each, all at once, and records when each one has landed.
// Slices distinct per block (cold, from DRAM), or shared by every 16th block (as the clusters
// of moe_route_gate_up each read the whole router). L2 is flushed before each run. Numbers in
// BENCHMARKS.md.
//
//   nvcc -O2 -arch=sm_90 -o bulk_copy_probe scripts/bulk_copy_probe.cu && ./bulk_copy_probe

#include <cstdio>
#include <cuda_runtime.h>

typedef unsigned long long u64;
typedef unsigned u32;

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// landed[block * 8 + i]: ns from the block's first issue to copy i's landing.
__global__ void copy_burst(const char* src, u64* landed, int copies, int shared_slices, int bytes) {
    extern __shared__ __align__(128) unsigned char stage[];
    __shared__ __align__(8) u64 bars[8];
    if (threadIdx.x == 0) {
        for (int i = 0; i < copies; ++i) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bars[i])));
        asm volatile("fence.mbarrier_init.release.cluster;");
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    int slice = shared_slices ? blockIdx.x % 16 : blockIdx.x;
    const char* base = src + (size_t)slice * copies * bytes;
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    u64 t0 = global_ns();
    for (int i = 0; i < copies; ++i) {
        u32 bar = smem_u32(&bars[i]);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes));
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(smem_u32(stage + (size_t)i * bytes)),
                     "l"(base + (size_t)i * bytes), "r"(bytes), "r"(bar), "l"(policy)
                     : "memory");
    }
    for (int i = 0; i < copies; ++i) {
        u32 bar = smem_u32(&bars[i]);
        asm volatile("{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n @!done bra WAIT;\n}" ::"r"(bar) : "memory");
        landed[blockIdx.x * 8 + i] = global_ns() - t0;
    }
}

int main() {
    char *src, *flush;
    u64* landed;
    cudaMalloc(&src, 1 << 30);
    cudaMemset(src, 1, 1 << 30);
    cudaMalloc(&flush, 256 << 20);
    cudaMalloc(&landed, 8 * 1024 * sizeof(u64));
    cudaFuncSetAttribute(copy_burst, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10);
    // blocks, copies per block, slices shared by every 16th block, bytes per copy
    int runs[][4] = {{112, 1, 0, 32768}, {112, 3, 0, 32768}, {112, 4, 0, 32768}, {112, 6, 0, 32768}, {132, 4, 0, 32768}, {112, 4, 1, 32768}, {16, 3, 0, 32768}, {112, 4, 0, 16384}};
    for (auto& r : runs) {
        for (int rep = 0; rep < 3; ++rep) {
            cudaMemset(flush, rep, 256 << 20);
            copy_burst<<<r[0], 32, r[1] * r[3]>>>(src + (size_t)((rep * 7919) % 64) * (4 << 20), landed, r[1], r[2], r[3]);
            cudaDeviceSynchronize();
            u64 h[8 * 1024];
            cudaMemcpy(h, landed, sizeof(h), cudaMemcpyDeviceToHost);
            double first = 0, last = 0, latest = 0;
            for (int b = 0; b < r[0]; ++b) {
                first += h[b * 8];
                last += h[b * 8 + r[1] - 1];
                if (h[b * 8 + r[1] - 1] > latest) latest = h[b * 8 + r[1] - 1];
            }
            double moved = (double)r[0] * r[1] * r[3];
            printf("%3d blocks x %d copies of %5d B, %s: first landed %.2f us, last %.2f us (mean), all %.2f us: %.0f GB/s\n", r[0], r[1], r[3],
                   r[2] ? "slices shared by 7 blocks" : "distinct slices", first / r[0] / 1e3, last / r[0] / 1e3, latest / 1e3, moved / latest);
        }
    }
    printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}
