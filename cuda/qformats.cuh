// The tile formats of cuda/qmatmul.cu: per format (`QFMT`, TileFormat::kernel_id) its
// geometry, a lane's loads of a unit tile, and the decoding of its codes into bf16 mma
// fragments and of its scales (layout: src/backend/cuda/quant_tiles/mod.rs).
#ifndef QFMT
#error "QFMT (the tile format) must be defined"
#endif

// Per format: elements per unit (QU) and per scale block (QSB), code bits, bytes of a unit
// tile's scales, whether blocks have a min term, the code's offset (w = code - offset), scale
// words a lane loads per unit, units a few-row warp loads at once.
#if QFMT == 0  // Q4_0: d * (q - 8)
#define QU 32
#define QSB 32
#define QBITS 4
#define QSCALE_BYTES 32
#define QHAS_MIN 0
#define QOFFSET 8
#define QSWORDS 1
#define QSTEP 6
#elif QFMT == 1  // Q4_1: d * q + m
#define QU 32
#define QSB 32
#define QBITS 4
#define QSCALE_BYTES 64
#define QHAS_MIN 1
#define QOFFSET 0
#define QSWORDS 2
#define QSTEP 6
#elif QFMT == 2  // Q5_0: d * (q - 16)
#define QU 32
#define QSB 32
#define QBITS 5
#define QSCALE_BYTES 32
#define QHAS_MIN 0
#define QOFFSET 16
#define QSWORDS 1
#define QSTEP 6
#elif QFMT == 3  // Q5_1: d * q + m
#define QU 32
#define QSB 32
#define QBITS 5
#define QSCALE_BYTES 64
#define QHAS_MIN 1
#define QOFFSET 0
#define QSWORDS 2
#define QSTEP 6
#elif QFMT == 4  // Q8_0: d * q (codes stored as q + 128)
#define QU 32
#define QSB 32
#define QBITS 8
#define QSCALE_BYTES 32
#define QHAS_MIN 0
#define QOFFSET 128
#define QSWORDS 1
#define QSTEP 4
#elif QFMT == 5  // Q4_K: (d * sc) * q - dmin * m
#define QU 128
#define QSB 32
#define QBITS 4
#define QSCALE_BYTES 192
#define QHAS_MIN 1
#define QOFFSET 0
#define QSWORDS 6
#define QSTEP 2
#elif QFMT == 6  // Q5_K
#define QU 128
#define QSB 32
#define QBITS 5
#define QSCALE_BYTES 192
#define QHAS_MIN 1
#define QOFFSET 0
#define QSWORDS 6
#define QSTEP 1
#elif QFMT == 7  // Q6_K: (d * sc) * (q - 32), sc per 16 elements
#define QU 128
#define QSB 16
#define QBITS 6
#define QSCALE_BYTES 192
#define QHAS_MIN 0
#define QOFFSET 32
#define QSWORDS 6
#define QSTEP 1
#elif QFMT == 8  // IQ4_NL: d * K[q]
#define QU 32
#define QSB 32
#define QBITS 4
#define QSCALE_BYTES 32
#define QHAS_MIN 0
#define QOFFSET 0
#define QSWORDS 1
#define QSTEP 6
#define QCODEBOOK 1
#elif QFMT == 9  // IQ4_XS: (d * (ls - 32)) * K[q]
#define QU 128
#define QSB 32
#define QBITS 4
#define QSCALE_BYTES 128
#define QHAS_MIN 0
#define QOFFSET 0
#define QSWORDS 4
#define QSTEP 2
#define QCODEBOOK 1
#elif QFMT >= 10 && QFMT <= 12  // Int4 (units of 32, 64, 128): scale * (q - zero)
#define QU (32 << (QFMT - 10))
#define QSB QU
#define QBITS 4
#define QSCALE_BYTES 64
#define QHAS_MIN 0
#define QOFFSET 0
#define QSWORDS 2
#define QSTEP (QU == 128 ? 2 : 4)
#define QINT4 1
#elif QFMT >= 13 && QFMT <= 15  // FP8 e4m3 (units of 32, 64, 128): e4m3 * scale
#define QU (32 << (QFMT - 13))
#define QSB QU
#define QBITS 8
#define QSCALE_BYTES 64
#define QHAS_MIN 0
#define QOFFSET 0
#define QSWORDS 2
#define QSTEP (QU == 128 ? 1 : 2)
#define QFP8 1
#else
#error "unknown QFMT"
#endif
#ifndef QCODEBOOK
#define QCODEBOOK 0
#endif
#ifndef QINT4
#define QINT4 0
#endif
#ifndef QFP8
#define QFP8 0
#endif

// 32-element blocks per unit, blocks per scale block (at least one), bytes of a unit's codes.
#define QB (QU / 32)
#define QBPS (QSB >= 32 ? QSB / 32 : 1)
// Weight tiles a many-row warp takes at once: two where a scale block is at most 32 elements
// (one load of activations feeds both tiles' mmas), one for the wide-block formats, whose
// fragments of a whole scale block already take the registers.
#define QWT (QSB <= 32 ? 2 : 1)
#define QCODE_BYTES (QB * 512 * QBITS / 8)
#define QUNIT_BYTES (QCODE_BYTES + QSCALE_BYTES)

// ---- loads ----

__device__ __forceinline__ u64 evict_first_policy() {
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// Weight loads: streamed (STREAM: read once per launch, past L1 and first out of L2, as
// cuda/matmul.cu's ldg_stream) or plain (shared memory, through a generic pointer).
template <bool STREAM>
__device__ __forceinline__ u32 qld2(const unsigned char* p, u64 pol) {
    if (!STREAM) return *(const unsigned short*)p;
    unsigned short v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(v) : "l"(p), "l"(pol));
    return v;
}
template <bool STREAM>
__device__ __forceinline__ u32 qld4(const unsigned char* p, u64 pol) {
    if (!STREAM) return *(const u32*)p;
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(v) : "l"(p), "l"(pol));
    return v;
}
template <bool STREAM>
__device__ __forceinline__ uint2 qld8(const unsigned char* p, u64 pol) {
    if (!STREAM) return *(const uint2*)p;
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v2.u32 {%0,%1}, [%2], %3;" : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(pol));
    return v;
}
template <bool STREAM>
__device__ __forceinline__ uint4 qld16(const unsigned char* p, u64 pol) {
    if (!STREAM) return *(const uint4*)p;
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
    return v;
}

// A lane's share of one unit tile: the codes of rows g and g+8 (fragment positions 8q..8q+7 of
// every block) and the scale words of quad g.
struct QUnit {
#if QBITS == 8
    uint4 c[QB];  // per block: 8 bytes of row g, then 8 of row g+8
#else
    uint2 w[QB];  // per block: nibble word of row g, of row g+8
#endif
#if QBITS == 5
    u32 h[QB];  // per block: fifth bits of row g (byte 0) and row g+8 (byte 1)
#elif QBITS == 6
    u32 h[QB];  // per block: top bit pairs of row g (low half) and row g+8 (high half)
#endif
    u32 s[QSWORDS];
};

template <bool STREAM>
__device__ __forceinline__ void q_load(QUnit& u, const unsigned char* p, int lane, u64 pol) {
    int g = lane >> 2;
#pragma unroll
    for (int b = 0; b < QB; ++b) {
#if QBITS == 8
        u.c[b] = qld16<STREAM>(p + b * 512 + lane * 16, pol);
#else
        u.w[b] = qld8<STREAM>(p + b * 256 + lane * 8, pol);
#endif
#if QBITS == 5
        u.h[b] = qld2<STREAM>(p + QB * 256 + b * 64 + lane * 2, pol);
#elif QBITS == 6
        u.h[b] = qld4<STREAM>(p + QB * 256 + b * 128 + lane * 4, pol);
#endif
    }
    const unsigned char* sp = p + QCODE_BYTES;
#if QSWORDS == 1
    u.s[0] = qld4<STREAM>(sp + 4 * g, pol);
#elif QSWORDS == 2
    uint2 v = qld8<STREAM>(sp + 8 * g, pol);
    u.s[0] = v.x;
    u.s[1] = v.y;
#elif QSWORDS == 4
    uint4 v = qld16<STREAM>(sp + 16 * g, pol);
    u.s[0] = v.x;
    u.s[1] = v.y;
    u.s[2] = v.z;
    u.s[3] = v.w;
#elif QSWORDS == 6
#pragma unroll
    for (int i = 0; i < 3; ++i) {
        uint2 v = qld8<STREAM>(sp + 24 * g + 8 * i, pol);
        u.s[2 * i] = v.x;
        u.s[2 * i + 1] = v.y;
    }
#endif
}

// ---- codes to bf16 ----

__device__ __forceinline__ float h2f(u32 bits) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(bits & 0xFFFF)));
    return f;
}

__device__ __forceinline__ u32 bf16x2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

#define BF16X2_ONE 0x3F803F80u

// Bit p (p < 8) of h to bit 4p: the fifth bits beside their nibbles.
__device__ __forceinline__ u32 spread_bits(u32 h) {
    u32 x = (h & 0x0Fu) | ((h & 0xF0u) << 12);
    x = (x | (x << 6)) & 0x03030303u;
    return (x | (x << 3)) & 0x11111111u;
}

// Bit pair p (p < 8) of z to bits 4p..4p+1: the top two bits beside their nibbles.
__device__ __forceinline__ u32 spread_pairs(u32 z) {
    u32 x = (z & 0xFFu) | ((z & 0xFF00u) << 8);
    x = (x | (x << 4)) & 0x0F0F0F0Fu;
    return (x | (x << 2)) & 0x33333333u;
}

// Code pair k (nibbles k and k+4: fragment positions 2k, 2k+1) of nibble word `w` as a bf16
// pair 128 + code, the high bits `hs` (spread) added, then minus `negoff` (-(128 + offset)).
template <int K_>
__device__ __forceinline__ u32 code_pair(u32 w, u32 hs, u32 negoff) {
    u32 t = ((w >> (4 * K_)) & 0x000F000Fu) | 0x43004300u;
#if QBITS == 5
    t |= (K_ == 0 ? (hs << 4) : (hs >> (4 * K_ - 4))) & 0x00100010u;
#elif QBITS == 6
    t |= (K_ == 0 ? (hs << 4) : (hs >> (4 * K_ - 4))) & 0x00300030u;
#endif
#if QHAS_MIN
    // 128 + code: the min term takes the 128s back out.
    (void)negoff;
    return t;
#else
    return bf16x2_fma(t, BF16X2_ONE, negoff);
#endif
}

// Bytes i and i+1 of `word`, each a signed value plus 128 (Q8_0's stored codes), as a bf16 pair.
__device__ __forceinline__ u32 int8_pair(u32 word, int i) {
    // 2^23 + byte as f32 bits, minus 2^23 + 128: the signed value, exact.
    float a = __uint_as_float(prmt(word, 0x4Bu, 0x4550u | (u32)i)) - 8388736.0f;
    float b = __uint_as_float(prmt(word, 0x4Bu, 0x4550u | (u32)(i + 1))) - 8388736.0f;
    return pack_bf16x2(a, b);
}

// Bytes i and i+1 of `word` as e4m3 values in a bf16 pair: sign and the 7 other bits shifted
// into a bf16 whose exponent is the e4m3 exponent (value * 2^-120, e4m3 subnormals landing on
// bf16 subnormals), then times 2^120.
__device__ __forceinline__ u32 e4m3_pair(u32 word, int i) {
    u32 t = prmt(word, 0u, 0x0404u | ((u32)i << 4) | ((u32)(i + 1) << 12));
    u32 r = (t & 0x80008000u) | ((t >> 4) & 0x07F007F0u);
    return bf16x2_fma(r, 0x7B807B80u, 0x80008000u);
}

#if QCODEBOOK
// kvalues_iq4nl as bytes: K[0..3], K[4..7], K[8..11], K[12..15].
#define IQ4_T0 0xBFAD9881u
#define IQ4_T1 0xF6EADDCFu
#define IQ4_T2 0x26190D01u
#define IQ4_T3 0x71594535u

// The codebook values (int8) of the 4 nibbles in bits 0..15 of `idx`, as 4 bytes in nibble order.
__device__ __forceinline__ u32 iq4_lookup4(u32 idx) {
    u32 lo = prmt(IQ4_T0, IQ4_T1, idx & 0x7777u);
    u32 hi = prmt(IQ4_T2, IQ4_T3, idx & 0x7777u);
    return prmt(lo, hi, 0x3210u | ((idx & 0x8888u) >> 1));
}

// The codebook values of nibble word `w` as bf16 pairs: out[k] = positions (2k, 2k+1).
__device__ __forceinline__ void iq4_pairs(u32 w, u32 out[4]) {
    // Nibbles 0..3 hold positions 0, 2, 4, 6; nibbles 4..7 positions 1, 3, 5, 7.
    u32 even = iq4_lookup4(w) ^ 0x80808080u, odd = iq4_lookup4(w >> 16) ^ 0x80808080u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float a = __uint_as_float(prmt(even, 0x4Bu, 0x4550u | (u32)k)) - 8388736.0f;
        float b = __uint_as_float(prmt(odd, 0x4Bu, 0x4550u | (u32)k)) - 8388736.0f;
        out[k] = pack_bf16x2(a, b);
    }
}
#endif

// -(128 + offset) as a bf16 pair, for the code offset of row g (low) or row g+8 (high scale word).
__device__ __forceinline__ u32 neg_offset(const QUnit& u, bool upper) {
#if QINT4
    u32 z = (u.s[upper ? 1 : 0] >> 16) & 0xFFu;
    return (0xC300u + z) * 0x00010001u;
#else
    (void)u;
    (void)upper;
    return (0xC300u + QOFFSET) * 0x00010001u;
#endif
}

// The A fragments of block b for its two k16 steps: a[s] = {row g (positions 4s, 4s+1), row g+8
// (same), row g (4s+2, 4s+3), row g+8 (same)}.
__device__ __forceinline__ void q_frags(const QUnit& u, int b, u32 a[2][4]) {
#if QBITS == 8
    u32 lo[4] = {u.c[b].x, u.c[b].y, u.c[b].z, u.c[b].w};
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            u32 word_g = lo[s], word_g8 = lo[2 + s];
#if QFP8
            a[s][2 * h] = e4m3_pair(word_g, 2 * h);
            a[s][2 * h + 1] = e4m3_pair(word_g8, 2 * h);
#else
            a[s][2 * h] = int8_pair(word_g, 2 * h);
            a[s][2 * h + 1] = int8_pair(word_g8, 2 * h);
#endif
        }
#elif QCODEBOOK
    u32 pg[4], pg8[4];
    iq4_pairs(u.w[b].x, pg);
    iq4_pairs(u.w[b].y, pg8);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        a[s][0] = pg[2 * s];
        a[s][1] = pg8[2 * s];
        a[s][2] = pg[2 * s + 1];
        a[s][3] = pg8[2 * s + 1];
    }
#else
    u32 ng = neg_offset(u, false), ng8 = neg_offset(u, true);
#if QBITS == 5
    u32 hg = spread_bits(u.h[b] & 0xFFu), hg8 = spread_bits((u.h[b] >> 8) & 0xFFu);
#elif QBITS == 6
    u32 hg = spread_pairs(u.h[b] & 0xFFFFu), hg8 = spread_pairs(u.h[b] >> 16);
#else
    u32 hg = 0, hg8 = 0;
#endif
    u32 wg = u.w[b].x, wg8 = u.w[b].y;
    a[0][0] = code_pair<0>(wg, hg, ng);
    a[0][1] = code_pair<0>(wg8, hg8, ng8);
    a[0][2] = code_pair<1>(wg, hg, ng);
    a[0][3] = code_pair<1>(wg8, hg8, ng8);
    a[1][0] = code_pair<2>(wg, hg, ng);
    a[1][1] = code_pair<2>(wg8, hg8, ng8);
    a[1][2] = code_pair<3>(wg, hg, ng);
    a[1][3] = code_pair<3>(wg8, hg8, ng8);
#endif
}

// The scale of scale block sb of the unit for rows g (x) and g+8 (y).
__device__ __forceinline__ float2 q_scale(const QUnit& u, int sb) {
#if QFMT == 0 || QFMT == 2 || QFMT == 4 || QFMT == 8
    (void)sb;
    return make_float2(h2f(u.s[0]), h2f(u.s[0] >> 16));
#elif QFMT == 1 || QFMT == 3 || QINT4
    (void)sb;
    return make_float2(h2f(u.s[0]), h2f(u.s[1]));
#elif QFP8
    (void)sb;
    return make_float2(__uint_as_float(u.s[0]), __uint_as_float(u.s[1]));
#elif QFMT == 5 || QFMT == 6
    return make_float2(h2f(u.s[0]) * (float)((u.s[1] >> (8 * sb)) & 0xFFu), h2f(u.s[3]) * (float)((u.s[4] >> (8 * sb)) & 0xFFu));
#elif QFMT == 7
    u32 wg = sb < 4 ? u.s[0] : u.s[1], wg8 = sb < 4 ? u.s[2] : u.s[3];
    int sh = 8 * (sb & 3);
    return make_float2(h2f(u.s[4]) * (float)(signed char)((wg >> sh) & 0xFFu), h2f(u.s[4] >> 16) * (float)(signed char)((wg8 >> sh) & 0xFFu));
#elif QFMT == 9
    int sh = 8 * sb;
    return make_float2(h2f(u.s[2]) * (float)(signed char)((u.s[0] >> sh) & 0xFFu), h2f(u.s[2] >> 16) * (float)(signed char)((u.s[1] >> sh) & 0xFFu));
#endif
}

#if QHAS_MIN
// The min of block b for rows g (x) and g+8 (y), as the stored values have it: m (Q4_1, Q5_1)
// or -(dmin * m) (the K-quants).
__device__ __forceinline__ float2 q_stored_min(const QUnit& u, int b) {
#if QFMT == 1 || QFMT == 3
    (void)b;
    return make_float2(h2f(u.s[0] >> 16), h2f(u.s[1] >> 16));
#else
    return make_float2(-(h2f(u.s[0] >> 16) * (float)((u.s[2] >> (8 * b)) & 0xFFu)), -(h2f(u.s[3] >> 16) * (float)((u.s[5] >> (8 * b)) & 0xFFu)));
#endif
}

// The coefficient of block b's activation sum: the min, less the 128 * scale that the codes'
// bf16 form (128 + code) added.
__device__ __forceinline__ float2 q_min(const QUnit& u, int b, float2 sc) {
    float2 m = q_stored_min(u, b);
    return make_float2(__fmaf_rn(-128.0f, sc.x, m.x), __fmaf_rn(-128.0f, sc.y, m.y));
}
#endif
