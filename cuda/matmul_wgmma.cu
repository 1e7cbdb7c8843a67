// Many-row bf16 matmul on Hopper's warpgroup tensor instructions (wgmma, sm_90a), with the
// per-element arithmetic of every other matmul kernel (cuda/matmul.cu, matmul_tiles.cu): per
// 32-wide k block two k16 products in k order, each on the same 16 (k position, value) pairs
// the m16n8k16 mma.sync of the small-row kernels sees, eight k-slice sums from zero added in
// slice order. Compiled as its own module for sm_90a.
//
// The weights are wgmma's A operand (64 weight rows per warpgroup), fed from registers in
// exactly the fragment layout mma.sync takes (the same 16-byte loads and pairing). The
// activations are the B operand, read by the tensor cores from shared memory, so their k
// order there is what the instruction sees: round_activations_wgmma writes them with each
// 32-wide k block's bf16 pairs transposed as 4 x 4 (pair 4c + q to 4q + c), which puts the
// 8 values of k position 0..7 of the first product in 16-byte chunk 0, positions 8..15 in
// chunk 1, and the second product's in chunks 2 and 3.

// Activation rows per block (wgmma's N; a multiple of 32 up to 256) and k blocks per barrier.
#ifndef WG_BM
#define WG_BM 192
#endif
#ifndef WG_KPI
#define WG_KPI 2
#endif
// Stages of the cp.async ring: (WG_BM + WG_BN) rows of 64 bytes each.
#ifndef WG_STAGES
#define WG_STAGES 10
#endif
#define WG_BN 128  // weight rows (output columns) per block: 2 warpgroups of 64
#define WG_ACC (WG_BM / 2)  // accumulators a thread (m64 x WG_BM over 128 threads)
// M tiles per band of the tile order (as the large-tile kernel walks them).
#ifndef WG_GROUP_M
#define WG_GROUP_M 8
#endif

// The activations rounded to bf16 (round8's values) with each 32-wide k block's pairs in
// wgmma order (above). Thread per 32 values (n32 = T*K/32).
extern "C" __global__ void round_activations_wgmma(bf16_t* xh, const float* x, long long n32) {
    wait_for_inputs();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n32) return;
    const float4* src = (const float4*)(x + 32 * i);
    u32 pair[16];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float4 v = src[j];
        pair[2 * j] = pack_bf16x2(v.x, v.y);
        pair[2 * j + 1] = pack_bf16x2(v.z, v.w);
    }
    uint4* dst = (uint4*)(xh + 32 * i);
#pragma unroll
    for (int c = 0; c < 4; ++c) dst[c] = make_uint4(pair[c], pair[4 + c], pair[8 + c], pair[12 + c]);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// Shared-memory matrix descriptor, no swizzle: core matrices of 8 rows x 16 bytes, `lbo`
// bytes apart along k and `sbo` bytes apart along the rows.
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr >> 4) & 0x3fff) | ((u64)((lbo >> 4) & 0x3fff) << 16) | ((u64)((sbo >> 4) & 0x3fff) << 32);
}

#define WG_D8(i) "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_D32(i) WG_D8(i), WG_D8(i + 8), WG_D8(i + 16), WG_D8(i + 24)
// d (m64 x n192, f32) += A (m64 x k16 bf16, mma.sync A-fragment registers) * B (k16 x n192,
// k-major in shared memory at `desc`).
__device__ __forceinline__ void wgmma_n192_rs(float d[96], const u32 a[4], u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
        "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95},"
        " {%96,%97,%98,%99}, %100, p, 1, 1, 0;\n}\n"
        : WG_D32(0), WG_D32(32), WG_D32(64)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// Pins registers an in-flight wgmma reads or writes until its wait: the compiler may neither
// reuse nor move them before this point.
__device__ __forceinline__ void wg_keep(float d[WG_ACC], u32 a[WG_KPI][2][4]) {
#pragma unroll
    for (int i = 0; i < WG_ACC; ++i) asm volatile("" : "+f"(d[i])::"memory");
#pragma unroll
    for (int j = 0; j < WG_KPI; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[j][0][i]), "+r"(a[j][1][i])::"memory");
}

// The (m, n) tile of block (x, y) in bands of WG_GROUP_M m tiles (band_tile of the large-tile
// kernel): resident blocks share a few weight and activation tiles in L2.
__device__ __forceinline__ void wg_band_tile(int& mt, int& nt) {
    int n_tiles = gridDim.x, m_tiles = gridDim.y;
    int pid = blockIdx.y * n_tiles + blockIdx.x;
    int band = pid / (WG_GROUP_M * n_tiles), first = band * WG_GROUP_M;
    int height = min(m_tiles - first, WG_GROUP_M);
    int in_band = pid - band * WG_GROUP_M * n_tiles;
    mt = first + in_band % height;
    nt = in_band / height;
}

// Many rows (a prefill): grid (ceil(N/128), ceil(rows/WG_BM)) in band order, 256 threads = 2
// warpgroups, each 64 output columns x WG_BM rows, the k-slice sums in registers beside the
// accumulators, and a WG_STAGES-deep cp.async ring over 32-wide k blocks that all threads
// fill (the whole of shared memory goes to the ring, so that enough bytes are in flight).
// `xp` is round_activations_wgmma's output. Thread (warp w of warpgroup v, lane 4g + q) holds
// output columns c0 = n0 + 64v + 16w + 2g and c0 + 1 (fragment rows g and g + 8), so the
// swiglu and part epilogues find both columns of a pair in one thread.
// Activation stage layout: [WG_BM / 8 row groups][4 k chunks][8 rows][16 bytes] (the
// descriptor's core matrices: 128 bytes apart along k, 512 along the rows); weight stage:
// [128 rows][64 bytes]. Dynamic shared memory: WG_STAGES * (WG_BM + 128) * 64 bytes.
extern "C" __global__ void __launch_bounds__(256, 1) matmul_wgmma(float* out, const bf16_t* xp, const bf16_t* w, int rows, int N, int K, Epilogue epi) {
    wait_for_inputs();
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "matmul_wgmma needs the sm_90a target"
#endif
    extern __shared__ __align__(128) unsigned char wsm[];
    unsigned char* s_x = wsm;
    unsigned char* s_w = wsm + WG_STAGES * WG_BM * 64;
    int mt, nt;
    wg_band_tile(mt, nt);
    int m0 = mt * WG_BM, n0 = nt * WG_BN;
    if (m0 >= rows) return;
    int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, q = lane & 3;
    int v = tid >> 7, wv = (tid >> 5) & 3;
    // Loader. Activations: WG_BM * 4 chunks a stage; chunk i = row (i / 32) * 8 + i % 8, k
    // chunk (i / 8) % 4, so 8 consecutive threads fill one 128-byte core matrix.
    constexpr int XL = WG_BM * 4 / 256;
    const bf16_t* x_src[XL];
    bool x_ok[XL];
    u32 x_dst[XL];
#pragma unroll
    for (int i = 0; i < XL; ++i) {
        int c = tid + 256 * i, r = (c >> 5) * 8 + (c & 7), kc = (c >> 3) & 3;
        x_ok[i] = m0 + r < rows;
        x_src[i] = xp + (long long)(x_ok[i] ? m0 + r : 0) * K + kc * 8;
        x_dst[i] = (u32)((r >> 3) * 512 + kc * 128 + (r & 7) * 16);
    }
    // Weights: 512 chunks a stage, 2 a thread; chunk c = row c / 4, k chunk c % 4.
    const bf16_t* w_src[2];
    bool w_ok[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        int c = tid + 256 * i, n = n0 + (c >> 2);
        w_ok[i] = n < N;
        w_src[i] = w + (w_ok[i] ? weight_row(epi, n, N) : 0) * K + (c & 3) * 8;
    }
    int nkb = K / 32, kps = (nkb + KSLICES - 1) / KSLICES;
    // One commit group per k block, empty past the last.
    auto load_stage = [&](int kb) {
        if (kb < nkb) {
            int stage = kb % WG_STAGES;
            unsigned char* sx = s_x + stage * WG_BM * 64;
#pragma unroll
            for (int i = 0; i < XL; ++i) cp_async16(sx + x_dst[i], x_src[i] + kb * 32, x_ok[i]);
            unsigned char* sw = s_w + stage * WG_BN * 64;
#pragma unroll
            for (int i = 0; i < 2; ++i) cp_async16(sw + (tid + 256 * i) * 16, w_src[i] + kb * 32, w_ok[i]);
        }
        asm volatile("cp.async.commit_group;");
    };
    // Loads run `ahead` k blocks in front: each iteration's products complete within it, so
    // past the barrier of blocks kb.. the stages of the previous iteration are free.
    constexpr int ahead = WG_STAGES - WG_KPI;
#pragma unroll
    for (int s = 0; s < ahead; ++s) load_stage(s);
    float d[WG_ACC], tot[WG_ACC];
#pragma unroll
    for (int i = 0; i < WG_ACC; ++i) d[i] = tot[i] = 0.0f;
    // This thread's weight rows in a stage: output columns c0 and c0 + 1 (fragment rows g, g + 8).
    int wrow = v * 64 + wv * 16 + 2 * g;
    int slice = 0, slice_end = min(kps, nkb);
    for (int kb = 0; kb < nkb; kb += WG_KPI) {
        asm volatile("cp.async.wait_group %0;" ::"n"(ahead - WG_KPI));
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
#pragma unroll
        for (int j = 0; j < WG_KPI; ++j) load_stage(kb + ahead + j);
        // Every fragment of the iteration first: the registers an issued product reads stay
        // untouched until the wait.
        u32 a[WG_KPI][2][4];
#pragma unroll
        for (int j = 0; j < WG_KPI; ++j) {
            const unsigned char* sw = s_w + ((kb + j) % WG_STAGES) * WG_BN * 64;
            uint4 h0 = *(const uint4*)(sw + wrow * 64 + q * 16), h1 = *(const uint4*)(sw + (wrow + 1) * 64 + q * 16);
            a[j][0][0] = h0.x; a[j][0][1] = h1.x; a[j][0][2] = h0.y; a[j][0][3] = h1.y;
            a[j][1][0] = h0.z; a[j][1][1] = h1.z; a[j][1][2] = h0.w; a[j][1][3] = h1.w;
        }
        wg_fence();
#pragma unroll
        for (int j = 0; j < WG_KPI; ++j) {
            if (kb + j < nkb) {
                u32 xbase = smem_u32(s_x + ((kb + j) % WG_STAGES) * WG_BM * 64);
                wgmma_n192_rs(d, a[j][0], wg_desc(xbase, 128, 512));
                wgmma_n192_rs(d, a[j][1], wg_desc(xbase + 256, 128, 512));
                if (kb + j + 1 == slice_end) {
                    // This slice's sums into the running totals (tot + s, as the other kernels add).
                    wg_commit();
                    wg_wait0();
                    wg_keep(d, a);
#pragma unroll
                    for (int i = 0; i < WG_ACC; ++i) {
                        tot[i] += d[i];
                        d[i] = 0.0f;
                    }
                    ++slice;
                    slice_end = min((slice + 1) * kps, nkb);
                    wg_fence();
                }
            }
        }
        wg_commit();
        wg_wait0();
        wg_keep(d, a);
    }
    asm volatile("cp.async.wait_group 0;");
    int c0 = n0 + wrow;
#pragma unroll
    for (int j = 0; j < WG_ACC / 4; ++j) {
        float t[4] = {tot[4 * j], tot[4 * j + 1], tot[4 * j + 2], tot[4 * j + 3]};
        // The empty slices' zero sums, as finish_warp_tiles adds them.
        for (int s = slice; s < KSLICES; ++s)
#pragma unroll
            for (int e = 0; e < 4; ++e) t[e] += 0.0f;
        // t[0], t[1]: column c0 of rows r, r + 1; t[2], t[3]: column c0 + 1.
        int r = m0 + 8 * j + 2 * q;
        if (r < rows) store_pair(epi, out, r, c0, N, t[0], t[2]);
        if (r + 1 < rows) store_pair(epi, out, r + 1, c0, N, t[1], t[3]);
    }
}
