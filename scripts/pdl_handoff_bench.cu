// Hand-over cost between dependent launches on one stream: programmatic dependent launch
// (griddepcontrol.wait, what every Kestrel kernel uses) against a counter the blocks of each
// launch bump at their end and the next launch polls. Each launch waits for the previous one,
// reads what it wrote, spins for a fixed time and writes; the time per launch beyond the spin
// is the hand-over. Numbers in BENCHMARKS.md.
//
//   nvcc -O2 -arch=sm_90 -o pdl_handoff_bench scripts/pdl_handoff_bench.cu && ./pdl_handoff_bench

#include <cstdio>
#include <cuda_runtime.h>

enum Handover { PDL_WAIT = 0, COUNTER = 1, COUNTER_NANOSLEEP = 2 };

__device__ unsigned finished_blocks;

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

template <int MODE>
__global__ void dependent_step(float* buf, int step, unsigned blocks_before, int spin_ns, int n) {
    if (MODE == PDL_WAIT) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
    } else {
        if (threadIdx.x == 0) {
            for (;;) {
                unsigned done;
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(done) : "l"(&finished_blocks) : "memory");
                if (done >= blocks_before) break;
                if (MODE == COUNTER_NANOSLEEP) __nanosleep(32);
            }
        }
        __syncthreads();
    }
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = buf[((step + 1) & 1) * n + i % n];
    unsigned long long t0 = global_ns();
    while (global_ns() - t0 < (unsigned long long)spin_ns) {
    }
    buf[(step & 1) * n + i] = v + 1.0f;
    if (MODE != PDL_WAIT) {
        __syncthreads();
        if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(&finished_blocks) : "memory");
    }
}

// Microseconds per launch over `steps` dependent launches (the second of two passes).
template <int MODE>
float us_per_launch(float* buf, int blocks, int spin_ns, int steps) {
    unsigned zero = 0;
    cudaMemcpyToSymbol(finished_blocks, &zero, sizeof zero);
    cudaDeviceSynchronize();
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(256);
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cudaEvent_t start, end;
    cudaEventCreate(&start);
    cudaEventCreate(&end);
    int n = blocks * 256;
    unsigned blocks_before = 0;
    for (int pass = 0; pass < 2; ++pass) {
        cudaEventRecord(start);
        for (int step = 0; step < steps; ++step) {
            cudaLaunchKernelEx(&cfg, dependent_step<MODE>, buf, step, blocks_before, spin_ns, n);
            blocks_before += blocks;
        }
        cudaEventRecord(end);
        cudaEventSynchronize(end);
    }
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, end);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) printf("error: %s\n", cudaGetErrorString(err));
    return ms * 1000.0f / steps;
}

int main() {
    float* buf;
    if (cudaMalloc(&buf, 2ull * 396 * 256 * sizeof(float)) != cudaSuccess) {
        printf("error: no device memory\n");
        return 1;
    }
    for (int spin_ns : {3000, 6000})
        for (int blocks : {33, 132, 264, 396}) {
            float pdl = us_per_launch<PDL_WAIT>(buf, blocks, spin_ns, 2000);
            float counter = us_per_launch<COUNTER>(buf, blocks, spin_ns, 2000);
            float sleepy = us_per_launch<COUNTER_NANOSLEEP>(buf, blocks, spin_ns, 2000);
            float spin = spin_ns / 1000.0f;
            printf("blocks %3d, spin %.0f us: hand-over %.3f us (griddepcontrol.wait), %.3f us (counter), %.3f us (counter, nanosleep)\n", blocks, spin, pdl - spin,
                   counter - spin, sleepy - spin);
        }
    return 0;
}
