// Many-row matmuls (bf16 weights, K a multiple of 32) over shared-memory tiles filled by
// cp.async: the per-element arithmetic of cuda/matmul.cu (one m16n8k16 mma per half-block of
// each 32-wide k block, in k order, eight k-slice sums from zero added in slice order), so a
// row gives the same bits here as in the small-row kernels.
//
// A 32-wide k block lies in shared memory as [rows][32] bf16 (64 bytes a row): the thread at
// (g, q) of a warp reads its fragments for row (or weight row) g as one 16-byte load at chunk q
// (k = 8q..8q+7), the k permutation the other kernels form from global memory. A quarter warp
// then reads two whole rows, 128 contiguous bytes, so the loads meet no bank conflicts without
// a swizzle.

// Activations rounded to bf16 once for the kernels that read them from memory (the multi-tile
// small-row kernels and the kernels below): exactly round8's values. Thread per 8 values
// (n8 = T*K/8).
extern "C" __global__ void round_activations(bf16_t* xh, const float* x, long long n8) {
    wait_for_inputs();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n8) return;
    float4 a = *(const float4*)(x + 8 * i), b = *(const float4*)(x + 8 * i + 4);
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    u32 h[4];
    round8(v, h);
    *(uint4*)(xh + 8 * i) = make_uint4(h[0], h[1], h[2], h[3]);
}

#define PBM 128
#define PBN 128
#define PSTAGES 3

// Up to a few hundred rows: grid (ceil(N/128), ceil(rows/128), groups), 256 threads as 2x4
// warps of 64x32, a 3-stage cp.async pipeline over 32-wide k blocks. The slice sums stay in
// registers beside the accumulators.
extern "C" __global__ void __launch_bounds__(256, 1) matmul_pipelined(float* out, const bf16_t* xh, const bf16_t* whi_, int rows, int N, int K,
        const u64* group_w, const int* counts, const int* lists, int list_stride, int a_div, const int* active, Epilogue epi) {
    wait_for_inputs();
    extern __shared__ __align__(16) unsigned char psm[];
    bf16_t (*s_a)[PBM][32] = (bf16_t (*)[PBM][32])psm;
    bf16_t (*s_w)[PBN][32] = (bf16_t (*)[PBN][32])(psm + PSTAGES * PBM * 64);
    Group grp = group_of(whi_, 0, rows, group_w, counts, lists, list_stride, active);
    int m0 = blockIdx.y * PBM;
    if (m0 >= grp.rows) return;
    int n0 = blockIdx.x * PBN;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    int wm = warp >> 2, wn = warp & 3;
    // Loader: each thread copies 2 16-byte chunks of each of A and W per stage.
    long long a_off[2];
    const bf16_t* w_src[2];
    bool a_ok[2], w_ok[2];
    int ld_row[2], ld_chunk[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        int c = tid + i * 256;  // 0..511: row c/4, chunk c%4
        ld_row[i] = c >> 2;
        ld_chunk[i] = c & 3;
        int r = m0 + ld_row[i];
        a_ok[i] = r < grp.rows;
        long long arow = a_ok[i] ? (grp.list ? grp.list[r] / a_div : r) : 0;
        a_off[i] = arow * K + ld_chunk[i] * 8;
        int n = n0 + ld_row[i];
        w_ok[i] = n < N;
        w_src[i] = grp.whi + (w_ok[i] ? weight_row(epi, n, N) : 0) * K + ld_chunk[i] * 8;
    }
    int nkb = K / 32, kps = (nkb + KSLICES - 1) / KSLICES;
    auto load_stage = [&](int stage, int kb) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            cp_async16(&s_a[stage][ld_row[i]][ld_chunk[i] * 8], xh + a_off[i] + kb * 32, a_ok[i]);
            cp_async16(&s_w[stage][ld_row[i]][ld_chunk[i] * 8], w_src[i] + kb * 32, w_ok[i]);
        }
    };
    float acc[4][4][4], tot[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = tot[i][j][e] = 0.0f;
#pragma unroll
    for (int s = 0; s < PSTAGES - 1; ++s) {
        if (s < nkb) load_stage(s, s);
        asm volatile("cp.async.commit_group;");
    }
    int slice = 0, slice_end = min(kps, nkb);
    for (int kb = 0; kb < nkb; ++kb) {
        asm volatile("cp.async.wait_group %0;" ::"n"(PSTAGES - 2));
        __syncthreads();
        if (kb + PSTAGES - 1 < nkb) load_stage((kb + PSTAGES - 1) % PSTAGES, kb + PSTAGES - 1);
        asm volatile("cp.async.commit_group;");
        int st = kb % PSTAGES;
        uint4 bw[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) bw[j] = *(const uint4*)&s_w[st][wn * 32 + j * 8 + g][q * 8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int r = wm * 64 + i * 16 + g;
            uint4 h0 = *(const uint4*)&s_a[st][r][q * 8], h1 = *(const uint4*)&s_a[st][r + 8][q * 8];
            u32 a0[4] = {h0.x, h0.y, h0.z, h0.w}, a1[4] = {h1.x, h1.y, h1.z, h1.w};
            u32 a[2][4];
            make_frags(a0, a1, a);
#pragma unroll
            for (int j = 0; j < 4; ++j) mma_kblock(acc[i][j], a, bw[j], make_uint4(0, 0, 0, 0), false);
        }
        if (kb + 1 == slice_end) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        tot[i][j][e] += acc[i][j][e];
                        acc[i][j][e] = 0.0f;
                    }
            ++slice;
            slice_end = min((slice + 1) * kps, nkb);
        }
    }
    asm volatile("cp.async.wait_group 0;");
    finish_warp_tiles<4>(out, tot, slice, grp, N, m0 + wm * 64, n0 + wn * 32, g, q, epi);
}

#define LBM 128
#define LBN 256
#ifndef LSTAGES
#define LSTAGES 4
#endif
// M tiles per band of the large kernel's tile order.
#ifndef LGROUP_M
#define LGROUP_M 8
#endif

// The (m, n) tile of block (x, y) of a grid of n tiles by m tiles, walked in bands of
// LGROUP_M m tiles, column by column within a band: the blocks resident at once then share a
// few weight column tiles and a few activation row tiles in L2, where row-major order has each
// wave read every weight tile from memory again.
__device__ __forceinline__ void band_tile(int& mt, int& nt) {
    int n_tiles = gridDim.x, m_tiles = gridDim.y;
    int pid = blockIdx.y * n_tiles + blockIdx.x;
    int band = pid / (LGROUP_M * n_tiles), first = band * LGROUP_M;
    int height = min(m_tiles - first, LGROUP_M);
    int in_band = pid - band * LGROUP_M * n_tiles;
    mt = first + in_band % height;
    nt = in_band / height;
}

// Many rows (a prefill): grid (ceil(N/256), ceil(rows/128), groups) in band order
// (band_tile), 256 threads as 2x4 warps of 64x64, an LSTAGES-deep cp.async pipeline over 32-wide k blocks. A warp's 64x64 tile takes
// 16 fragment loads per 64 mmas (a 64x32 tile: 12 per 32), which keeps shared memory from
// limiting the tensor cores; the 128 accumulators leave no registers for the slice sums, so
// those live in shared memory (each thread its own 128 floats, added to 8 times per tile).
// Dynamic shared memory: LSTAGES * (128 + 256) rows of 64 bytes, then 128 KB of sums.
extern "C" __global__ void __launch_bounds__(256, 1) matmul_large(float* out, const bf16_t* xh, const bf16_t* whi_, int rows, int N, int K,
        const u64* group_w, const int* counts, const int* lists, int list_stride, int a_div, const int* active, Epilogue epi) {
    wait_for_inputs();
    extern __shared__ __align__(16) unsigned char lsm[];
    bf16_t (*s_a)[LBM][32] = (bf16_t (*)[LBM][32])lsm;
    bf16_t (*s_w)[LBN][32] = (bf16_t (*)[LBN][32])(lsm + LSTAGES * LBM * 64);
    float4* s_tot = (float4*)(lsm + LSTAGES * (LBM + LBN) * 64);
    Group grp = group_of(whi_, 0, rows, group_w, counts, lists, list_stride, active);
    int mt, nt;
    band_tile(mt, nt);
    int m0 = mt * LBM;
    if (m0 >= grp.rows) return;
    int n0 = nt * LBN;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    int wm = warp >> 2, wn = warp & 3;
    // Loader: per stage each thread copies 2 16-byte chunks of A (128 rows x 4) and 4 of W
    // (256 rows x 4); chunk c is row c/4, k chunk c%4.
    const bf16_t* a_src[2];
    const bf16_t* w_src[4];
    bool a_ok[2], w_ok[4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        int c = tid + i * 256, r = m0 + (c >> 2);
        a_ok[i] = r < grp.rows;
        long long arow = a_ok[i] ? (grp.list ? grp.list[r] / a_div : r) : 0;
        a_src[i] = xh + arow * K + (c & 3) * 8;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int c = tid + i * 256, n = n0 + (c >> 2);
        w_ok[i] = n < N;
        w_src[i] = grp.whi + (w_ok[i] ? weight_row(epi, n, N) : 0) * K + (c & 3) * 8;
    }
    int nkb = K / 32, kps = (nkb + KSLICES - 1) / KSLICES;
    auto load_stage = [&](int stage, int kb) {
        bf16_t* sa = &s_a[stage][0][0];
        bf16_t* sw = &s_w[stage][0][0];
#pragma unroll
        for (int i = 0; i < 2; ++i) cp_async16(sa + (tid + i * 256) * 8, a_src[i] + kb * 32, a_ok[i]);
#pragma unroll
        for (int i = 0; i < 4; ++i) cp_async16(sw + (tid + i * 256) * 8, w_src[i] + kb * 32, w_ok[i]);
    };
#pragma unroll
    for (int s = 0; s < LSTAGES - 1; ++s) {
        if (s < nkb) load_stage(s, s);
        asm volatile("cp.async.commit_group;");
    }
    float acc[4][8][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    const float4 zero4 = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int f = 0; f < 32; ++f) s_tot[f * 256 + tid] = zero4;
    int slice = 0, slice_end = min(kps, nkb);
    for (int kb = 0; kb < nkb; ++kb) {
        asm volatile("cp.async.wait_group %0;" ::"n"(LSTAGES - 2));
        __syncthreads();
        if (kb + LSTAGES - 1 < nkb) load_stage((kb + LSTAGES - 1) % LSTAGES, kb + LSTAGES - 1);
        asm volatile("cp.async.commit_group;");
        int st = kb % LSTAGES;
        u32 a[4][2][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int r = wm * 64 + i * 16 + g;
            uint4 h0 = *(const uint4*)&s_a[st][r][q * 8], h1 = *(const uint4*)&s_a[st][r + 8][q * 8];
            u32 a0[4] = {h0.x, h0.y, h0.z, h0.w}, a1[4] = {h1.x, h1.y, h1.z, h1.w};
            make_frags(a0, a1, a[i]);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            uint4 bw = *(const uint4*)&s_w[st][wn * 64 + j * 8 + g][q * 8];
#pragma unroll
            for (int i = 0; i < 4; ++i) mma_kblock(acc[i][j], a[i], bw, make_uint4(0, 0, 0, 0), false);
        }
        if (kb + 1 == slice_end) {
            // This slice's sums into the running totals (tot + s, as the other kernels add).
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    float4& t = s_tot[(i * 8 + j) * 256 + tid];
                    float4 v = t;
                    v.x += acc[i][j][0]; v.y += acc[i][j][1]; v.z += acc[i][j][2]; v.w += acc[i][j][3];
                    t = v;
                    acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
                }
            ++slice;
            slice_end = min((slice + 1) * kps, nkb);
        }
    }
    asm volatile("cp.async.wait_group 0;");
    int row0 = m0 + wm * 64, col0 = n0 + wn * 64;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float4 v = s_tot[(i * 8 + j) * 256 + tid];
            float t[4] = {v.x, v.y, v.z, v.w};
            // The empty slices' zero sums, as finish_warp_tiles adds them.
            for (int s = slice; s < KSLICES; ++s)
#pragma unroll
                for (int e = 0; e < 4; ++e) t[e] += 0.0f;
            store_fragment(epi, out, grp, N, row0 + i * 16 + g, col0 + j * 8 + 2 * q, t);
        }
}

#define SBM 64
#define SBN 128
#define SSTAGES 4
// Row stride of the slice sums (floats): rows 32 bytes apart in the banks.
#define SRED_STRIDE 136

// A few dozen rows (a decode step of many sequences; Hopper thread block clusters): grid
// (8 * ceil(N/128), ceil(rows/64)) in clusters of 8 blocks along x, 256 threads as 2x4 warps
// of 32x32. The 8 blocks of a cluster share one 64x128 output tile and each computes one
// k-slice of it (its cluster rank), so a weight column block is read once per 64 rows by 8
// SMs at once and the activations once per column block, where the small-row kernels read
// the activations again in every 16-column block. Each block pushes its slice sums into the
// shared memory of the block that finishes those rows (rank = row / 8) through distributed
// shared memory; after one cluster barrier that block adds the 8 slices from zero in slice
// order, as the small-row kernel does, and stores them. Dynamic shared memory: SSTAGES stages
// of 64 + 128 rows of 64 bytes, then [8 slices][8 rows][SRED_STRIDE] floats.
extern "C" __global__ void __launch_bounds__(256) matmul_sliced(float* out, const bf16_t* xh, const bf16_t* whi, int rows, int N, int K, Epilogue epi) {
    wait_for_inputs();
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(16) unsigned char ssm[];
    bf16_t (*s_a)[SBM][32] = (bf16_t (*)[SBM][32])ssm;
    bf16_t (*s_w)[SBN][32] = (bf16_t (*)[SBN][32])(ssm + SSTAGES * SBM * 64);
    float* s_red = (float*)(ssm + SSTAGES * (SBM + SBN) * 64);
    int slice = (int)cluster_rank();
    int m0 = blockIdx.y * SBM, n0 = (blockIdx.x / KSLICES) * SBN;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    int wm = warp >> 2, wn = warp & 3;
    // Loader: per stage one 16-byte chunk of A (64 rows x 4) and two of W (128 rows x 4) per
    // thread; chunk c is row c/4, k chunk c%4.
    int ar = m0 + (tid >> 2);
    bool a_ok = ar < rows;
    const bf16_t* a_src = xh + (long long)(a_ok ? ar : 0) * K + (tid & 3) * 8;
    const bf16_t* w_src[2];
    bool w_ok[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        int n = n0 + ((tid + i * 256) >> 2);
        w_ok[i] = n < N;
        w_src[i] = whi + (w_ok[i] ? weight_row(epi, n, N) : 0) * K + (tid & 3) * 8;
    }
    int nkb = K / 32, kps = (nkb + KSLICES - 1) / KSLICES;
    int kb0 = min(slice * kps, nkb), kb1 = min(kb0 + kps, nkb), count = kb1 - kb0;
    auto load_stage = [&](int stage, int kb) {
        cp_async16(&s_a[stage][0][0] + tid * 8, a_src + kb * 32, a_ok);
#pragma unroll
        for (int i = 0; i < 2; ++i) cp_async16(&s_w[stage][0][0] + (tid + i * 256) * 8, w_src[i] + kb * 32, w_ok[i]);
    };
#pragma unroll
    for (int s = 0; s < SSTAGES - 1; ++s) {
        if (s < count) load_stage(s, kb0 + s);
        asm volatile("cp.async.commit_group;");
    }
    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    for (int u = 0; u < count; ++u) {
        asm volatile("cp.async.wait_group %0;" ::"n"(SSTAGES - 2));
        __syncthreads();
        if (u + SSTAGES - 1 < count) load_stage((u + SSTAGES - 1) % SSTAGES, kb0 + u + SSTAGES - 1);
        asm volatile("cp.async.commit_group;");
        int st = u % SSTAGES;
        u32 a[2][2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            int r = wm * 32 + i * 16 + g;
            uint4 h0 = *(const uint4*)&s_a[st][r][q * 8], h1 = *(const uint4*)&s_a[st][r + 8][q * 8];
            u32 a0[4] = {h0.x, h0.y, h0.z, h0.w}, a1[4] = {h1.x, h1.y, h1.z, h1.w};
            make_frags(a0, a1, a[i]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint4 bw = *(const uint4*)&s_w[st][wn * 32 + j * 8 + g][q * 8];
#pragma unroll
            for (int i = 0; i < 2; ++i) mma_kblock(acc[i][j], a[i], bw, make_uint4(0, 0, 0, 0), false);
        }
    }
    asm volatile("cp.async.wait_group 0;");
    // This slice's sums of rows r go to block r / 8, at [slice][r % 8][column].
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int r = wm * 32 + i * 16 + g + 8 * half;
            float* local = s_red + (slice * 8 + (r & 7)) * SRED_STRIDE;
            u32 remote;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(local)), "r"((u32)(r >> 3)));
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                int col = wn * 32 + j * 8 + 2 * q;
                asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" ::"r"(remote + 4u * col), "f"(acc[i][j][2 * half]), "f"(acc[i][j][2 * half + 1]) : "memory");
            }
        }
    cluster_arrive_release();
    cluster_wait();
    // This block's 8 rows: 0 + s0 + ... + s7 per element, then the epilogue's store.
#pragma unroll
    for (int p = tid; p < 8 * SBN / 2; p += 256) {
        int rr = p / (SBN / 2), col = 2 * (p % (SBN / 2));
        float t0 = 0.0f, t1 = 0.0f;
#pragma unroll
        for (int s = 0; s < KSLICES; ++s) {
            float2 v = *(const float2*)(s_red + (s * 8 + rr) * SRED_STRIDE + col);
            t0 += v.x;
            t1 += v.y;
        }
        int r = m0 + slice * 8 + rr;
        if (r < rows) store_pair(epi, out, r, n0 + col, N, t0, t1);
    }
#endif
}
