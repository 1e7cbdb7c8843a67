// KV cache formats on the device, as kestrel_quant::kv defines them: per attention layer, K and
// V each a data plane [slot][kv head][row bytes] and a plane of 16-bit parameters
// [slot][kv head][params]. A format is a struct of static functions that attention.cu's kernels
// take as a template argument:
//
//   ROW_BYTES(hd)      data bytes of one vector
//   PARAMS             16-bit parameters per vector
//   SCALED             whether a stored vector reads as raw values times one per-vector scale
//                      (scale(params)); raw values are what load_lane / load_elem give
//   ROTATED            whether vectors are stored rotated (TurboQuant): the query is rotated
//                      before the scores and the attention output rotated back
//   Lane, load_lane    a lane's share of a row, as stored (at most MAX_DIMS_PER_LANE elements;
//                      kept packed, so a key pass holds KEYS_PER_PASS of them in few registers)
//   lane_dot           the lane's part of the dot product of a query row (shared memory, hd
//                      floats) with a row's raw values, its elements in a fixed order
//   Elem, load_elem    element d of a row (global or shared memory) as stored
//   value              an element's raw value
//   store_warp         one warp stores the hd floats at `x` (shared memory, overwritten) as a
//                      vector: data at `row` (and at `row2` where given) and its parameters
//
// Quantizing a vector reads that vector alone, and every kernel that stores one runs
// store_warp, so a token's cached key and value have the same bits whichever step wrote them.

#define MAX_DIMS_PER_LANE 8   // head_dim <= 256

// The tables of a rotated format (backend/cuda/attention.rs, kv_tables): the 8 codebook levels
// of a unit vector's rotated coordinates, the 7 boundaries between them, the rotation's scale
// 1/sqrt(hd) and its hd signs.
struct KvTables {
    float levels[8];
    float bounds[7];
    float scale;
    float signs[256];
};

// The cache of one attention layer, passed by value (KvCacheArg in attention.rs).
struct KvCache {
    unsigned char* k;
    unsigned short* kp;
    unsigned char* v;
    unsigned short* vp;
    const KvTables* tables;
};

__device__ __forceinline__ float bf16_bits_to_f32(unsigned short h) { return __uint_as_float(((u32)h) << 16); }

// e4m3 (float8_e4m3fn) byte to f32; NaN codes are never stored.
__device__ __forceinline__ float e4m3_to_f32(u32 b) {
    u32 e = (b >> 3) & 15, m = b & 7;
    float v = e ? __uint_as_float(((e + 120) << 23) | (m << 20)) : (float)m * 0.001953125f;
    return (b & 0x80) ? -v : v;
}

// The e4m3 byte nearest to x (ties to even), saturating at +-448: kestrel_quant::fp8::f32_to_e4m3
// (sm_80 has no conversion instruction).
__device__ __forceinline__ u32 f32_to_e4m3(float x) {
    u32 sign = (__float_as_uint(x) >> 24) & 0x80;
    float a = fabsf(x);
    if (a != a) return 0x7F;
    if (a >= 448.0f) return sign | 0x7E;
    if (a < 0.015625f) return sign | (u32)rintf(a * 512.0f);
    u32 bits = __float_as_uint(a);
    u32 rounded = bits + 0x7FFFF + ((bits >> 20) & 1);
    return sign | min((rounded >> 20) - (120u << 3), 0x7Eu);
}

// The 3-bit code of element d of a row of 3-bit codes (element d in bits 3d .. 3d + 2 of the
// little-endian byte stream); the next byte is read only where the code spans two bytes.
__device__ __forceinline__ u32 code3(const unsigned char* row, int d) {
    int bit = 3 * d, at = bit >> 3, shift = bit & 7;
    u32 b = row[at];
    if (shift > 5) b |= (u32)row[at + 1] << 8;
    return (b >> shift) & 7;
}

// One warp's fast Walsh-Hadamard transform of the hd floats at x (shared memory): stages of
// pair distance 1, 2, 4, ..., pair (a, b) becoming (a + b, a - b), as kestrel_quant's fwht.
__device__ __forceinline__ void fwht_warp(float* x, int hd) {
    int lane = threadIdx.x & 31;
    for (int h = 1; h < hd; h <<= 1) {
        __syncwarp();
        for (int q = lane; q < hd / 2; q += 32) {
            int i = (q / h) * 2 * h + q % h;
            float a = x[i], b = x[i + h];
            x[i] = a + b;
            x[i + h] = a - b;
        }
    }
    __syncwarp();
}

// One warp rotates the hd floats at x (shared memory) in place: x <- H (s . x) / sqrt(hd)
// (kestrel_quant::kv::hadamard::RandomizedHadamard::rotate).
__device__ __forceinline__ void rotate_warp(float* x, int hd, const KvTables* t) {
    int lane = threadIdx.x & 31;
    __syncwarp();
    for (int d = lane; d < hd; d += 32) x[d] *= t->signs[d];
    fwht_warp(x, hd);
    for (int d = lane; d < hd; d += 32) x[d] *= t->scale;
    __syncwarp();
}

// The inverse: y <- s . (H y) / sqrt(hd), each element (H y) * scale * sign as unrotate does.
__device__ __forceinline__ void unrotate_warp(float* y, int hd, const KvTables* t) {
    int lane = threadIdx.x & 31;
    fwht_warp(y, hd);
    for (int d = lane; d < hd; d += 32) y[d] = y[d] * t->scale * t->signs[d];
    __syncwarp();
}

struct KvF32 {
    static constexpr int PARAMS = 0;
    static constexpr bool SCALED = false, ROTATED = false;
    __device__ static int row_bytes(int hd) { return 4 * hd; }
    struct Lane {
        float x[MAX_DIMS_PER_LANE];
    };
    __device__ static void load_lane(Lane& l, const unsigned char* row, int hd, int lane) {
        const float* r = (const float*)row;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) l.x[i] = lane + 32 * i < hd ? r[lane + 32 * i] : 0.0f;
    }
    __device__ static float lane_dot(const Lane& l, const float* q, int hd, int lane, const float* levels) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i)
            if (lane + 32 * i < hd) dot += q[lane + 32 * i] * l.x[i];
        return dot;
    }
    typedef float Elem;
    __device__ static Elem load_elem(const unsigned char* row, int d) { return ((const float*)row)[d]; }
    __device__ static float value(Elem e, const float* levels) { return e; }
    __device__ static float scale(const unsigned short* params) { return 1.0f; }
    __device__ static void store_warp(unsigned char* row, unsigned char* row2, unsigned short* params, float* x, int hd, const KvTables* t) {
        int lane = threadIdx.x & 31;
        __syncwarp();
        for (int d = lane; d < hd; d += 32) {
            ((float*)row)[d] = x[d];
            if (row2) ((float*)row2)[d] = x[d];
        }
    }
};

struct KvBf16 {
    static constexpr int PARAMS = 0;
    static constexpr bool SCALED = false, ROTATED = false;
    __device__ static int row_bytes(int hd) { return 2 * hd; }
    struct Lane {
        unsigned short h[MAX_DIMS_PER_LANE];
    };
    __device__ static void load_lane(Lane& l, const unsigned char* row, int hd, int lane) {
        const unsigned short* r = (const unsigned short*)row;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) l.h[i] = lane + 32 * i < hd ? r[lane + 32 * i] : 0;
    }
    __device__ static float lane_dot(const Lane& l, const float* q, int hd, int lane, const float* levels) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i)
            if (lane + 32 * i < hd) dot += q[lane + 32 * i] * bf16_bits_to_f32(l.h[i]);
        return dot;
    }
    typedef unsigned short Elem;
    __device__ static Elem load_elem(const unsigned char* row, int d) { return ((const unsigned short*)row)[d]; }
    __device__ static float value(Elem e, const float* levels) { return bf16_bits_to_f32(e); }
    __device__ static float scale(const unsigned short* params) { return 1.0f; }
    __device__ static void store_warp(unsigned char* row, unsigned char* row2, unsigned short* params, float* x, int hd, const KvTables* t) {
        int lane = threadIdx.x & 31;
        __syncwarp();
        for (int d = lane; d < hd; d += 32) {
            unsigned short h = f32_to_bf16(x[d]);
            ((unsigned short*)row)[d] = h;
            if (row2) ((unsigned short*)row2)[d] = h;
        }
    }
};

// e4m3 bytes and one bf16 scale, amax / 448 (kestrel_quant::fp8::encode_e4m3_scaled).
struct KvFp8 {
    static constexpr int PARAMS = 1;
    static constexpr bool SCALED = true, ROTATED = false;
    __device__ static int row_bytes(int hd) { return hd; }
    struct Lane {
        unsigned char b[MAX_DIMS_PER_LANE];
    };
    __device__ static void load_lane(Lane& l, const unsigned char* row, int hd, int lane) {
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) l.b[i] = lane + 32 * i < hd ? row[lane + 32 * i] : 0;
    }
    __device__ static float lane_dot(const Lane& l, const float* q, int hd, int lane, const float* levels) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_LANE; ++i)
            if (lane + 32 * i < hd) dot += q[lane + 32 * i] * e4m3_to_f32(l.b[i]);
        return dot;
    }
    typedef unsigned char Elem;
    __device__ static Elem load_elem(const unsigned char* row, int d) { return row[d]; }
    __device__ static float value(Elem e, const float* levels) { return e4m3_to_f32(e); }
    __device__ static float scale(const unsigned short* params) { return bf16_bits_to_f32(params[0]); }
    __device__ static void store_warp(unsigned char* row, unsigned char* row2, unsigned short* params, float* x, int hd, const KvTables* t) {
        int lane = threadIdx.x & 31;
        __syncwarp();
        float amax = 0.0f;
        for (int d = lane; d < hd; d += 32) amax = fmaxf(amax, fabsf(x[d]));
        amax = warp_max(amax);
        unsigned short sbits = f32_to_bf16(amax / 448.0f);
        float s = bf16_bits_to_f32(sbits);
        for (int d = lane; d < hd; d += 32) {
            unsigned char c = s == 0.0f ? 0 : (unsigned char)f32_to_e4m3(x[d] / s);
            row[d] = c;
            if (row2) row2[d] = c;
        }
        if (lane == 0) params[0] = s == 0.0f ? 0 : sbits;
    }
};

// TurboQuant 3-bit (kestrel_quant::kv::turbo): rotated vectors, a 3-bit Lloyd-Max code per
// element and the bf16 norm with the codebook vector's length divided out. A lane reads the 8
// consecutive elements of one 3-byte group.
struct KvTq3 {
    static constexpr int PARAMS = 1;
    static constexpr bool SCALED = true, ROTATED = true;
    __device__ static int row_bytes(int hd) { return 3 * hd / 8; }
    // The 8 codes of elements 8 * lane .. 8 * lane + 7: 24 bits.
    struct Lane {
        u32 bits;
    };
    __device__ static void load_lane(Lane& l, const unsigned char* row, int hd, int lane) {
        l.bits = 8 * lane < hd ? (u32)row[3 * lane] | (u32)row[3 * lane + 1] << 8 | (u32)row[3 * lane + 2] << 16 : 0;
    }
    __device__ static float lane_dot(const Lane& l, const float* q, int hd, int lane, const float* levels) {
        float dot = 0.0f;
        if (8 * lane < hd) {
#pragma unroll
            for (int i = 0; i < 8; ++i) dot += q[8 * lane + i] * levels[(l.bits >> (3 * i)) & 7];
        }
        return dot;
    }
    typedef unsigned char Elem;
    __device__ static Elem load_elem(const unsigned char* row, int d) { return (Elem)code3(row, d); }
    __device__ static float value(Elem e, const float* levels) { return levels[e]; }
    __device__ static float scale(const unsigned short* params) { return bf16_bits_to_f32(params[0]); }
    // Rotates x, then codes each element of the unit vector by the boundaries below it.
    __device__ static void store_warp(unsigned char* row, unsigned char* row2, unsigned short* params, float* x, int hd, const KvTables* t) {
        int lane = threadIdx.x & 31;
        rotate_warp(x, hd, t);
        float ss = 0.0f;
        for (int d = lane; d < hd; d += 32) ss = __fmaf_rn(x[d], x[d], ss);
        float n = sqrtf(warp_sum(ss));
        float inv = n > 0.0f ? 1.0f / n : 0.0f;
        float cc = 0.0f;
        for (int g = lane; g < hd / 8; g += 32) {
            u32 bits = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float u = x[8 * g + i] * inv;
                u32 code = 0;
#pragma unroll
                for (int b = 0; b < 7; ++b) code += u > t->bounds[b] ? 1u : 0u;
                bits |= code << (3 * i);
                float c = t->levels[code];
                cc = __fmaf_rn(c, c, cc);
            }
            unsigned char b0 = bits & 255, b1 = (bits >> 8) & 255, b2 = bits >> 16;
            row[3 * g] = b0;
            row[3 * g + 1] = b1;
            row[3 * g + 2] = b2;
            if (row2) {
                row2[3 * g] = b0;
                row2[3 * g + 1] = b1;
                row2[3 * g + 2] = b2;
            }
        }
        cc = warp_sum(cc);
        if (lane == 0) params[0] = n > 0.0f ? f32_to_bf16(n / sqrtf(cc)) : 0;
    }
};
