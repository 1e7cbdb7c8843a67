// How many thread block clusters of a 288-thread kernel fit on the GPU at once, by cluster size
// and dynamic shared memory per block (cudaOccupancyMaxActiveClusters), and what a cluster
// barrier after one store into the first block's shared memory costs: the shapes
// moe_route_gate_up (cuda/moe_stream.cu) chooses between. Numbers in BENCHMARKS.md.
//
//   nvcc -O2 -arch=sm_90 -o cluster_occupancy_probe scripts/cluster_occupancy_probe.cu && ./cluster_occupancy_probe

#include <cstdio>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

namespace cg = cooperative_groups;

// out[cluster]: ns the first block of each cluster spent from its start to past the barrier.
__global__ void store_and_sync(float* out) {
    extern __shared__ float words[];
    cg::cluster_group cluster = cg::this_cluster();
    unsigned long long t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    float* first = cluster.map_shared_rank(words, 0);
    if (threadIdx.x < 32) first[cluster.block_rank() * 32 + threadIdx.x] = threadIdx.x;
    cluster.sync();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (threadIdx.x == 0 && cluster.block_rank() == 0) out[blockIdx.x / cluster.num_blocks()] = (float)(t1 - t0) + 0.0f * words[33];
}

int main() {
    cudaFuncSetAttribute(store_and_sync, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    float* out;
    cudaMalloc(&out, 4096 * sizeof(float));
    for (int kb : {64, 100, 145, 170, 200}) {
        cudaFuncSetAttribute(store_and_sync, cudaFuncAttributeMaxDynamicSharedMemorySize, kb << 10);
        for (int size : {4, 8, 12, 16}) {
            cudaLaunchAttribute attr[1];
            attr[0].id = cudaLaunchAttributeClusterDimension;
            attr[0].val.clusterDim.x = size;
            attr[0].val.clusterDim.y = 1;
            attr[0].val.clusterDim.z = 1;
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(size, 1, 1);
            cfg.blockDim = dim3(288, 1, 1);
            cfg.dynamicSmemBytes = kb << 10;
            cfg.attrs = attr;
            cfg.numAttrs = 1;
            int clusters = 0;
            cudaOccupancyMaxActiveClusters(&clusters, store_and_sync, &cfg);
            cfg.gridDim = dim3(size * (clusters > 0 ? clusters : 1), 1, 1);
            cudaLaunchKernelEx(&cfg, store_and_sync, out);
            cudaDeviceSynchronize();
            float first;
            cudaMemcpy(&first, out, sizeof(float), cudaMemcpyDeviceToHost);
            printf("%3d KB per block, clusters of %2d: %2d resident at once (%3d blocks); store and barrier %.0f ns\n", kb, size, clusters, size * clusters, first);
        }
    }
    printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}
