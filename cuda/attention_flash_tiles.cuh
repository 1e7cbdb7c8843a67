// The key and value tiles of attn_flash (cuda/attention_flash.cu): each KV format's FlashTile
// turns a tile of 64 cached keys and values into 16-bit shared-memory rows (bf16 copied, fp8's
// e4m3 bytes converted, tq3's 3-bit codes looked up as fp16 codebook levels) with the
// per-vector scales a scaled format applies in f32. Each row depends only on its own stored
// vector, so the tiles have the same bits whichever step or block reads them.

// The cache slots of a tile's keys (-1 past the block's last context; tile j's in flash_slots[j
// & 1], so that the next tile's are stored while the current one is read) and, for a scaled
// format, the current tile's key and value scales (0 past it).
__shared__ long long flash_slots[2][KEY_TILE];
__shared__ float flash_kscale[KEY_TILE];
__shared__ float flash_vscale[KEY_TILE];

// tq3 stages the next tile's codes while the current tile computes (FLASH_STAGE_TQ3=0 loads
// each tile after the last one's barrier, as bf16 and fp8 do; the tiles' bits are the same).
#ifndef FLASH_STAGE_TQ3
#define FLASH_STAGE_TQ3 1
#endif

// Key tile loads into shared memory as rows of `stride` 16-bit elements: bf16, or fp16 where
// F16. setup runs once per block before its first tile. A format that stages(hd) copies a
// tile's stored bytes to shared memory (`raw`) with issue, while the tile before computes,
// and turns them into the tile with convert; the others load a tile with load.
template <class KV>
struct FlashTile;

// Nothing staged: the formats whose tiles load in one step.
struct FlashUnstaged {
    struct Stage {};
    __device__ static bool stages(int hd) { return false; }
    __device__ static int stage_bytes(int hd) { return 0; }
    __device__ static void issue(unsigned char* raw, Stage& st, const long long* slots, KvCache kv, int nkv, int kvh, int hd) {}
    __device__ static void convert(bf16_t* ks, bf16_t* vs, const unsigned char* raw, const Stage& st, const long long* slots, int hd, int stride) {}
};

template <>
struct FlashTile<KvBf16> : FlashUnstaged {
    static constexpr bool F16 = false;
    __device__ static void setup(KvCache kv) {}
    __device__ static void load(bf16_t* ks, bf16_t* vs, KvCache kv, const long long* flash_slots, int nkv, int kvh, int hd, int stride) {
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
struct FlashTile<KvFp8> : FlashUnstaged {
    static constexpr bool F16 = false;
    __device__ static void setup(KvCache kv) {}
    __device__ static void load(bf16_t* ks, bf16_t* vs, KvCache kv, const long long* flash_slots, int nkv, int kvh, int hd, int stride) {
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
    // Staged where a row is whole 16-byte chunks (hd a multiple of 128): `raw` holds the tile's
    // key rows, then its value rows, of row_bytes(hd) each; the scales wait in registers.
    struct Stage {
        unsigned short kp, vp;
    };
    __device__ static bool stages(int hd) { return FLASH_STAGE_TQ3 && hd % 128 == 0; }
    __device__ static int stage_bytes(int hd) { return 2 * KEY_TILE * KvTq3::row_bytes(hd); }
    __device__ static void issue(unsigned char* raw, Stage& st, const long long* slots, KvCache kv, int nkv, int kvh, int hd) {
        int bytes = KvTq3::row_bytes(hd), chunks = bytes / 16;
        for (int c = threadIdx.x; c < KEY_TILE * chunks; c += blockDim.x) {
            int i = c / chunks, o = 16 * (c % chunks);
            long long slot = slots[i];
            long long off = slot >= 0 ? kv_vector(slot, nkv, kvh) * bytes + o : 0;
            cp_async16(raw + i * bytes + o, kv.k + off, slot >= 0);
            cp_async16(raw + (KEY_TILE + i) * bytes + o, kv.v + off, slot >= 0);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
        if (threadIdx.x < KEY_TILE) {
            long long slot = slots[threadIdx.x];
            long long vec = slot >= 0 ? kv_vector(slot, nkv, kvh) : 0;
            st.kp = slot >= 0 ? kv.kp[vec * KvTq3::PARAMS] : 0;
            st.vp = slot >= 0 ? kv.vp[vec * KvTq3::PARAMS] : 0;
        }
    }
    // After cp.async.wait_all and a barrier: the staged codes as the tile (zero rows past the
    // context, as load leaves them).
    __device__ static void convert(bf16_t* ks, bf16_t* vs, const unsigned char* raw, const Stage& st, const long long* slots, int hd, int stride) {
        if (threadIdx.x < KEY_TILE) {
            // KvTq3::scale of the staged parameters (a slot past the context staged 0: scale 0).
            flash_kscale[threadIdx.x] = bf16_bits_to_f32(st.kp);
            flash_vscale[threadIdx.x] = bf16_bits_to_f32(st.vp);
        }
        int bytes = KvTq3::row_bytes(hd), units = hd / 32;
        for (int c = threadIdx.x; c < 2 * KEY_TILE * units; c += blockDim.x) {
            // Keys' units, then values'.
            int kv2 = c >= KEY_TILE * units, cu = c - kv2 * KEY_TILE * units;
            int i = cu / units, j = 32 * (cu % units);
            const u32* w = (const u32*)(raw + (kv2 * KEY_TILE + i) * bytes + 12 * (cu % units));
            u32 w0 = w[0], w1 = w[1], w2 = w[2], o[16];
            tq3_pairs<10>(o, (unsigned long long)w0 | (unsigned long long)w1 << 32);
            tq3_pairs<6>(o + 10, ((unsigned long long)w1 | (unsigned long long)w2 << 32) >> 28);
            bool live = slots[i] >= 0;
            uint4* dst = (uint4*)((kv2 ? vs : ks) + i * stride + j);
#pragma unroll
            for (int q = 0; q < 4; ++q) dst[q] = live ? make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]) : make_uint4(0, 0, 0, 0);
        }
    }
    __device__ static void load(bf16_t* ks, bf16_t* vs, KvCache kv, const long long* flash_slots, int nkv, int kvh, int hd, int stride) {
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
