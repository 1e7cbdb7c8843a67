// The key and value tiles of attn_flash (cuda/attention_flash.cu): each KV format's FlashTile
// turns a tile of 64 cached keys and values into 16-bit shared-memory rows (bf16 copied, fp8's
// e4m3 bytes converted, tq3's 3-bit codes looked up as fp16 codebook levels) with the
// per-vector scales a scaled format applies in f32. Each row depends only on its own stored
// vector, so the tiles have the same bits whichever step or block reads them.

// The cache slots of the current tile's keys (-1 past the block's last context) and, for a
// scaled format, their key and value scales (0 past it).
__shared__ long long flash_slots[KEY_TILE];
__shared__ float flash_kscale[KEY_TILE];
__shared__ float flash_vscale[KEY_TILE];

// Key tile loads into shared memory as rows of `stride` 16-bit elements: bf16, or fp16 where
// F16. setup runs once per block before its first tile.
template <class KV>
struct FlashTile;

template <>
struct FlashTile<KvBf16> {
    static constexpr bool F16 = false;
    __device__ static void setup(KvCache kv) {}
    __device__ static void load(bf16_t* ks, bf16_t* vs, KvCache kv, int nkv, int kvh, int hd, int stride) {
        int chunks = hd / 8;  // 16 bytes each
        for (int c = threadIdx.x; c < KEY_TILE * chunks; c += blockDim.x) {
            int i = c / chunks, j = 8 * (c % chunks);
            long long slot = flash_slots[i];
            bool live = slot >= 0;
            long long off = live ? kv_vector(slot, nkv, kvh) * 2 * hd + 2 * j : 0;
            cp_async16(ks + i * stride + j, kv.k + off, live);
            cp_async16(vs + i * stride + j, kv.v + off, live);
        }
        asm volatile("cp.async.commit_group;\ncp.async.wait_all;" ::: "memory");
    }
};

// e4m3 byte pairs as bf16 pairs (exact: every e4m3 value is a bf16 value).
__device__ __forceinline__ u32 e4m3x2_to_bf16x2(u32 lo, u32 hi) {
    return (__float_as_uint(e4m3_to_f32(lo)) >> 16) | (__float_as_uint(e4m3_to_f32(hi)) & 0xffff0000u);
}
__device__ __forceinline__ void e4m3x16_to_bf16(bf16_t* dst, uint4 b) {
    u32 w[4] = {b.x, b.y, b.z, b.w}, o[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[2 * i] = e4m3x2_to_bf16x2(w[i] & 0xff, (w[i] >> 8) & 0xff);
        o[2 * i + 1] = e4m3x2_to_bf16x2((w[i] >> 16) & 0xff, w[i] >> 24);
    }
    ((uint4*)dst)[0] = make_uint4(o[0], o[1], o[2], o[3]);
    ((uint4*)dst)[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

template <>
struct FlashTile<KvFp8> {
    static constexpr bool F16 = false;
    __device__ static void setup(KvCache kv) {}
    __device__ static void load(bf16_t* ks, bf16_t* vs, KvCache kv, int nkv, int kvh, int hd, int stride) {
        if (threadIdx.x < KEY_TILE) {
            long long slot = flash_slots[threadIdx.x];
            long long vec = slot >= 0 ? kv_vector(slot, nkv, kvh) : 0;
            flash_kscale[threadIdx.x] = slot >= 0 ? KvFp8::scale(kv.kp + vec) : 0.0f;
            flash_vscale[threadIdx.x] = slot >= 0 ? KvFp8::scale(kv.vp + vec) : 0.0f;
        }
        int chunks = hd / 16;  // 16 bytes each
        // Four chunks of keys and four of values in flight per thread before any conversion.
        for (int c0 = threadIdx.x; c0 < KEY_TILE * chunks; c0 += 4 * blockDim.x) {
            uint4 kb[4], vb[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                int c = c0 + u * blockDim.x;
                kb[u] = vb[u] = make_uint4(0, 0, 0, 0);
                if (c < KEY_TILE * chunks) {
                    long long slot = flash_slots[c / chunks];
                    if (slot >= 0) {
                        long long off = kv_vector(slot, nkv, kvh) * hd + 16 * (c % chunks);
                        kb[u] = *(const uint4*)(kv.k + off);
                        vb[u] = *(const uint4*)(kv.v + off);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                int c = c0 + u * blockDim.x;
                if (c >= KEY_TILE * chunks) break;
                int i = c / chunks, j = 16 * (c % chunks);
                e4m3x16_to_bf16(ks + i * stride + j, kb[u]);
                e4m3x16_to_bf16(vs + i * stride + j, vb[u]);
            }
        }
    }
};

// tq3's codebook levels as fp16 pairs: entry c0 + 8 c1 holds level c0 (low half) and level c1
// (high half), the two elements of one 6-bit field of a row's codes.
__shared__ u32 flash_level_pairs[64];

__device__ __forceinline__ u32 f32_to_f16_bits(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// Codes to fp16 levels: the first PAIRS 6-bit fields of `bits` as as many pairs of levels.
template <int PAIRS>
__device__ __forceinline__ void tq3_pairs(u32* o, unsigned long long bits) {
#pragma unroll
    for (int j = 0; j < PAIRS; ++j) o[j] = flash_level_pairs[(bits >> (6 * j)) & 63];
}

template <>
struct FlashTile<KvTq3> {
    static constexpr bool F16 = true;
    __device__ static void setup(KvCache kv) {
        if (threadIdx.x < 64) flash_level_pairs[threadIdx.x] = f32_to_f16_bits(kv.tables->levels[threadIdx.x & 7]) | f32_to_f16_bits(kv.tables->levels[threadIdx.x >> 3]) << 16;
    }
    __device__ static void load(bf16_t* ks, bf16_t* vs, KvCache kv, int nkv, int kvh, int hd, int stride) {
        if (threadIdx.x < KEY_TILE) {
            long long slot = flash_slots[threadIdx.x];
            long long vec = slot >= 0 ? kv_vector(slot, nkv, kvh) : 0;
            flash_kscale[threadIdx.x] = slot >= 0 ? KvTq3::scale(kv.kp + vec) : 0.0f;
            flash_vscale[threadIdx.x] = slot >= 0 ? KvTq3::scale(kv.vp + vec) : 0.0f;
        }
        int bytes = KvTq3::row_bytes(hd);
        if (hd % 32 == 0) {
            // Units of 32 elements: 12 bytes of codes (4-byte aligned: rows are 12 hd / 32
            // bytes), 64 bytes of tile. Two units of keys and two of values in flight per
            // thread before any lookup.
            int units = hd / 32;
            for (int c0 = threadIdx.x; c0 < KEY_TILE * units; c0 += 2 * blockDim.x) {
                uint3 kb[2], vb[2];
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    int c = c0 + u * blockDim.x;
                    kb[u] = vb[u] = make_uint3(0, 0, 0);
                    if (c < KEY_TILE * units) {
                        long long slot = flash_slots[c / units];
                        if (slot >= 0) {
                            long long off = kv_vector(slot, nkv, kvh) * bytes + 12 * (c % units);
                            const u32* kw = (const u32*)(kv.k + off);
                            const u32* vw = (const u32*)(kv.v + off);
                            kb[u] = make_uint3(kw[0], kw[1], kw[2]);
                            vb[u] = make_uint3(vw[0], vw[1], vw[2]);
                        }
                    }
                }
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    int c = c0 + u * blockDim.x;
                    if (c >= KEY_TILE * units) break;
                    int i = c / units, j = 32 * (c % units);
                    bool live = flash_slots[i] >= 0;
#pragma unroll
                    for (int kv2 = 0; kv2 < 2; ++kv2) {
                        uint3 w = kv2 ? vb[u] : kb[u];
                        // Fields 0..9 from bits 0..63, fields 10..15 from bits 32..95.
                        u32 o[16];
                        tq3_pairs<10>(o, (unsigned long long)w.x | (unsigned long long)w.y << 32);
                        tq3_pairs<6>(o + 10, ((unsigned long long)w.y | (unsigned long long)w.z << 32) >> 28);
                        uint4* dst = (uint4*)((kv2 ? vs : ks) + i * stride + j);
#pragma unroll
                        for (int q = 0; q < 4; ++q) dst[q] = live ? make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]) : make_uint4(0, 0, 0, 0);
                    }
                }
            }
            return;
        }
        // Units of 8 elements (head dims 16, 48, ...): 3 bytes of codes, 16 bytes of tile.
        int units = hd / 8;
        for (int c = threadIdx.x; c < KEY_TILE * units; c += blockDim.x) {
            int i = c / units, j = 8 * (c % units);
            long long slot = flash_slots[i];
#pragma unroll
            for (int kv2 = 0; kv2 < 2; ++kv2) {
                uint4 out = make_uint4(0, 0, 0, 0);
                if (slot >= 0) {
                    const unsigned char* b = (kv2 ? kv.v : kv.k) + kv_vector(slot, nkv, kvh) * bytes + 3 * (c % units);
                    u32 o[4];
                    tq3_pairs<4>(o, (u32)b[0] | (u32)b[1] << 8 | (u32)b[2] << 16);
                    out = make_uint4(o[0], o[1], o[2], o[3]);
                }
                *(uint4*)((kv2 ? vs : ks) + i * stride + j) = out;
            }
        }
    }
};
