// Quantized weights in their own bits (tiles: src/backend/cuda/quant_tiles.rs) times f32
// activations on tensor cores, batch-invariant. One module per format: the host prepends
// `#define QFMT n` (TileFormat::kernel_id) and compiles the module the first time a weight of
// that format is uploaded.
//
// The weights are the mma's A operand (16 weight rows per m16 tile, rows g and g+8 in lane g's
// registers), the activations its B operand (8 tokens per n8 tile), split into bf16 hi and lo
// halves as in cuda/matmul.cu. Every output element (weight row n, token t) is computed by the
// same sequence of operations in every kernel below, whatever the token count or the kernel:
//  - K is cut into units of QU elements, grouped into KSLICES fixed slices of ceil(units/8)
//    units each (from K alone). A slice's sum starts at 0 and walks its units in order; the
//    slice sums are added in slice order: 0 + s0 + s1 + ... + s7.
//  - Within a unit, per scale block (QSB elements) a fresh f32 accumulator P takes, per k16 step
//    in k order, mma(w, x_hi) then mma(w, x_lo), w the block's codes as exact bf16 numbers
//    (integers, IQ4 codebook entries, e4m3 values); then sum = fma(scale, P, sum). The formats
//    with a min (Q4_1, Q5_1, Q4_K, Q5_K) multiply 128 + code (the bf16 the code lands in, one
//    instruction fewer per pair) and then add sum = fma(min - 128 * scale, S, sum), S the sum of
//    the block's activation halves (split_block), which is what the 128s added.
// The few-row kernel (qmm_few*) gives each warp one slice and adds the slices through shared
// memory; the many-row kernel (qmm_many) walks them in sequence. The tests compare their bits.

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

// ---- activations ----

// One 32-element block of an activation row (`xb`, f32) as bf16 hi halves at `hb` and lo halves
// `lo_off` elements further, in fragment order (quad q's eight: elements 4q..4q+3, 16+4q..+3),
// and its sum: ((s0 + s1) + (s2 + s3)), s_q the left-to-right sum of quad q's eight (hi + lo
// each) in that order. Every kernel takes S from here, so the sums are the same bits everywhere.
// With a norm weight `nw` (the block's 32 weights), each value is first normalized as
// rms_norm_rows writes it: x * inv * w.
__device__ __forceinline__ void split_block(const float* xb, bf16_t* hb, long long lo_off, float* sum, const float* nw = 0, float inv = 0.0f) {
    float sq[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        float4 a = *(const float4*)(xb + 4 * q), b = *(const float4*)(xb + 16 + 4 * q);
        float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        if (nw) {
            float4 wa = *(const float4*)(nw + 4 * q), wb = *(const float4*)(nw + 16 + 4 * q);
            float w[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = v[i] * inv * w[i];
        }
        u32 h[4], l[4];
        split8(v, h, l);
        *(uint4*)(hb + 8 * q) = make_uint4(h[0], h[1], h[2], h[3]);
        *(uint4*)(hb + lo_off + 8 * q) = make_uint4(l[0], l[1], l[2], l[3]);
        // The halves as the mma multiplies them (hi + lo is exact in f32).
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float h0 = __uint_as_float(h[i] << 16), h1 = __uint_as_float(h[i] & 0xFFFF0000u);
            float l0 = __uint_as_float(l[i] << 16), l1 = __uint_as_float(l[i] & 0xFFFF0000u);
            s = i == 0 ? __fadd_rn(h0, l0) : __fadd_rn(s, __fadd_rn(h0, l0));
            s = __fadd_rn(s, __fadd_rn(h1, l1));
        }
        sq[q] = s;
    }
    *sum = __fadd_rn(__fadd_rn(sq[0], sq[1]), __fadd_rn(sq[2], sq[3]));
}

// Row stride of the block sums: whole groups of four, so a stage copies them 16 bytes at a time.
__device__ __forceinline__ int sums_stride(int K) { return ((K / 32 + 3) / 4) * 4; }

// Activations split once for the launches that read them from memory: hi [rows][K], lo
// `lo_off` elements further, block sums [rows][sums_stride]. A thread per (row, block).
extern "C" __global__ void qsplit(bf16_t* hi, long long lo_off, float* sums, const float* x, int rows, int K) {
    wait_for_inputs();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int nkb = K / 32;
    if (i >= (long long)rows * nkb) return;
    long long r = i / nkb;
    int kb = (int)(i % nkb);
    split_block(x + r * K + kb * 32, hi + r * K + kb * 32, lo_off, sums + r * sums_stride(K) + kb);
}

// ---- one unit ----

__device__ __forceinline__ void apply_scale(float c[4], float2 sc, const float P[4]) {
    c[0] = __fmaf_rn(sc.x, P[0], c[0]);
    c[1] = __fmaf_rn(sc.x, P[1], c[1]);
    c[2] = __fmaf_rn(sc.y, P[2], c[2]);
    c[3] = __fmaf_rn(sc.y, P[3], c[3]);
}

// Where a warp finds its token tiles' activations: per tile j, the hi row of token 8j+g (null:
// no token, zeros), the lo halves `lo_off` elements on; the block-sum rows of tokens 8j+2q and
// 8j+2q+1 (min formats; null: zeros). Rows are whole K-rows in the few-row kernel, a stage's
// in the many-row kernel (q_unit's `kb` counts blocks from their start).
template <int TT>
struct QAct {
    const bf16_t* x[TT];
    const float* s[TT][2];
    long long lo_off;
};

__device__ __forceinline__ void load_b(const bf16_t* row, long long lo_off, int k, uint4& bh, uint4& bl) {
    if (row) {
        bh = *(const uint4*)(row + k);
        bl = *(const uint4*)(row + lo_off + k);
    } else {
        bh = make_uint4(0, 0, 0, 0);
        bl = bh;
    }
}

// Adds units un[0..WT) (the same unit of WT weight tiles; tiles past `wtiles` skipped) into the
// slice sums c[w][j] of the token tiles j < tiles (TT at most), the unit's blocks at block
// index `kb` of the activation rows. One load of a block's activations feeds every tile.
template <int TT, int WT>
__device__ __forceinline__ void q_unit(float c[WT][TT][4], const QUnit (&un)[WT], const QAct<TT>& act, int kb, int q, int tiles, int wtiles) {
#pragma unroll
    for (int b0 = 0; b0 < QB; b0 += QBPS) {
        u32 a[WT][QBPS][2][4];
#pragma unroll
        for (int w = 0; w < WT; ++w)
#pragma unroll
            for (int bb = 0; bb < QBPS; ++bb)
                if (WT == 1 || w < wtiles) q_frags(un[w], b0 + bb, a[w][bb]);
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            if (j >= tiles) break;
#if QSB == 16
            uint4 bh, bl;
            load_b(act.x[j], act.lo_off, (kb + b0) * 32 + 8 * q, bh, bl);
#pragma unroll
            for (int w = 0; w < WT; ++w) {
                if (WT > 1 && w >= wtiles) break;
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    float P[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mma_bf16(P, a[w][0][s], s ? bh.z : bh.x, s ? bh.w : bh.y);
                    mma_bf16(P, a[w][0][s], s ? bl.z : bl.x, s ? bl.w : bl.y);
                    apply_scale(c[w][j], q_scale(un[w], 2 * b0 + s), P);
                }
            }
#else
            // One block's activations at a time (a wide scale block has one weight tile: WT is 1).
            static_assert(QBPS == 1 || WT == 1, "a wide scale block takes one weight tile");
            uint4 bh, bl;
            if (QBPS == 1) load_b(act.x[j], act.lo_off, (kb + b0) * 32 + 8 * q, bh, bl);
#if QHAS_MIN
            float s0 = act.s[j][0] ? act.s[j][0][kb + b0] : 0.0f, s1 = act.s[j][1] ? act.s[j][1][kb + b0] : 0.0f;
#endif
#pragma unroll
            for (int w = 0; w < WT; ++w) {
                if (WT > 1 && w >= wtiles) break;
                float P[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int bb = 0; bb < QBPS; ++bb) {
                    if (QBPS > 1) load_b(act.x[j], act.lo_off, (kb + b0 + bb) * 32 + 8 * q, bh, bl);
                    mma_bf16(P, a[w][bb][0], bh.x, bh.y);
                    mma_bf16(P, a[w][bb][0], bl.x, bl.y);
                    mma_bf16(P, a[w][bb][1], bh.z, bh.w);
                    mma_bf16(P, a[w][bb][1], bl.z, bl.w);
                }
                float2 sc = q_scale(un[w], b0 / QBPS);
                apply_scale(c[w][j], sc, P);
#if QHAS_MIN
                float2 mn = q_min(un[w], b0, sc);
                c[w][j][0] = __fmaf_rn(mn.x, s0, c[w][j][0]);
                c[w][j][1] = __fmaf_rn(mn.x, s1, c[w][j][1]);
                c[w][j][2] = __fmaf_rn(mn.y, s0, c[w][j][2]);
                c[w][j][3] = __fmaf_rn(mn.y, s1, c[w][j][3]);
#endif
            }
#endif
        }
    }
}

// ---- groups and stores ----

struct QGroup {
    const unsigned char* w;
    int rows;
    const int* list;
};

// As cuda/matmul.cu's group_of: grouped launches (experts) take their weights and rows from
// the active list ([count, experts...]); the table holds [groups][tiles, 0].
__device__ __forceinline__ QGroup qgroup_of(const unsigned char* w, int rows, const u64* group_w, const int* counts, const int* lists, int list_stride, const int* active) {
    QGroup g;
    if (group_w) {
        int n = active[0], z = active[1 + blockIdx.z];
        if ((int)blockIdx.z >= n) {
            g.w = 0;
            g.rows = 0;
            g.list = 0;
            return g;
        }
        g.w = (const unsigned char*)group_w[2 * z];
        g.rows = counts[z];
        g.list = lists + (long long)z * list_stride;
    } else {
        g.w = w;
        g.rows = rows;
        g.list = 0;
    }
    return g;
}

// Stores a lane's sums of weight tile `tile` for tokens tok0 + 2q and tok0 + 2q + 1: v[0], v[1]
// of row g, v[2], v[3] of row g+8. N weight rows; with SwiGLU (gate/up tiles: rows g are gate
// rows, g+8 the matching up rows) out[t, i] = silu(gate) * up, i < N / 2.
__device__ __forceinline__ void q_store(const Epilogue& e, float* out, const QGroup& grp, int N, int tile, int tok0, int g, int q, const float v[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int tok = tok0 + 2 * q + h;
        if (tok >= grp.rows) continue;
        long long orow = grp.list ? grp.list[tok] : tok;
        if (e.mode == EPI_SWIGLU) {
            int i = tile * 8 + g;
            if (i < (N >> 1)) out[orow * (N >> 1) + i] = siluf_(v[h]) * v[2 + h];
        } else {
            store_one(e, out, orow, tile * 16 + g, N, v[h]);
            store_one(e, out, orow, tile * 16 + g + 8, N, v[2 + h]);
        }
    }
}

__device__ __forceinline__ int weight_tiles(const Epilogue& e, int N) { return e.mode == EPI_SWIGLU ? ((N >> 1) + 7) / 8 : (N + 15) / 16; }

// ---- few rows ----

// Weight tiles a few-row block takes at once. One: a block per tile keeps the most blocks busy
// on narrow weights (4096 outputs are 256 tiles for some 264 resident blocks), where two tiles
// per block (one activation load feeding both) left half of them idle.
#define QFEW_WT 1

// A warp's loads of one step: QSTEP units of each of the QFEW_WT tiles of a tile group.
struct QStep {
    QUnit un[QSTEP][QFEW_WT];
};

// Loads the step of units u..u+QSTEP (below u1) of tile group `grp_i` (tiles QFEW_WT * grp_i + w
// below `tiles`).
__device__ __forceinline__ void q_load_step(QStep& st, const unsigned char* w, long long tile_bytes, int grp_i, int tiles, int u, int u1, int lane, u64 pol) {
#pragma unroll
    for (int i = 0; i < QSTEP; ++i)
#pragma unroll
        for (int t = 0; t < QFEW_WT; ++t) {
            int tile = QFEW_WT * grp_i + t;
            if (u + i < u1 && tile < tiles) q_load<true>(st.un[i][t], w + tile * tile_bytes + (long long)(u + i) * QUNIT_BYTES, lane, pol);
        }
}

// What a few-row block does before its inputs are ready: a plain launch's warps issue their
// first step of weight loads (weights never depend on the kernels before).
struct QFewStart {
    QStep st;
    bool loaded;
};

__device__ __forceinline__ QFewStart qmm_few_start(const unsigned char* w, int N, int K, const u64* group_w, const Epilogue& epi) {
    QFewStart s;
    s.loaded = false;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int nu = K / QU, ups = (nu + KSLICES - 1) / KSLICES, u0 = warp * ups, u1 = min(u0 + ups, nu);
    int tiles = weight_tiles(epi, N);
    if (group_w || blockIdx.y != 0 || (int)blockIdx.x * QFEW_WT >= tiles) return s;
    q_load_step(s.st, w, (long long)nu * QUNIT_BYTES, blockIdx.x, tiles, u0, u1, lane, evict_first_policy());
    s.loaded = true;
    return s;
}

// Up to 8*TT tokens per block: grid (tile groups, token blocks, groups), KSLICES warps, warp w
// owning k-slice w. Each block walks groups of QFEW_WT weight tiles in a grid-stride loop, its warps
// streaming their slice's units straight into registers (QSTEP units per tile of loads in
// flight, then their mmas), and adds the slices through shared memory.
// XSMEM: the block splits its tokens' rows into dynamic shared memory first (hi rows of K + 32
// elements, lo rows, block sums [rows][sums_stride], then a zero row), normalizing them by
// `norm_w` where given exactly as rms_norm_rows does; else the rows come split from qsplit
// (`xs`, lo halves `lo_off` further, `sums`). The arithmetic is the same either way.
template <int TT, bool XSMEM>
__device__ __forceinline__ void qmm_few_body(QFewStart& start, float* out, const float* x, const unsigned char* w_, int rows, int N, int K, const u64* group_w,
        const int* counts, const int* lists, int list_stride, int a_div, const int* active, const bf16_t* xs, long long lo_off, const float* sums, const Epilogue& epi,
        const float* norm_w, float eps) {
    extern __shared__ __align__(16) unsigned char qsm[];
    // Slice sums of up to QRED (tile, token tile) pairs at once.
    constexpr int QRED = QFEW_WT * TT < 8 ? QFEW_WT * TT : 8;
    __shared__ float red[KSLICES][QRED][32][4];
    __shared__ float scratch[33];
    __shared__ float row_inv[8 * TT];
    QGroup grp = qgroup_of(w_, rows, group_w, counts, lists, list_stride, active);
    int t0 = blockIdx.y * 8 * TT;
    if (t0 >= grp.rows) return;
    int nt = min(8 * TT, grp.rows - t0);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int nu = K / QU, ups = (nu + KSLICES - 1) / KSLICES, sstride = sums_stride(K);
    int u0 = warp * ups, u1 = min(u0 + ups, nu);
    QAct<TT> act;
    if (XSMEM) {
        int xstride = K + 32, nkb = K / 32;
        bf16_t* xh = (bf16_t*)qsm;
        act.lo_off = (long long)nt * xstride;
        float* ss = (float*)(qsm + 4LL * nt * xstride);
        if (norm_w) {
            // rms_norm_rows' register path at 256 threads: the same sums, the same inverse.
            for (int r = 0; r < nt; ++r) {
                int tok = t0 + r;
                long long arow = grp.list ? grp.list[tok] / a_div : tok;
                float4 v[RMS_VECS];
                row_float4s(v, (const float4*)(x + arow * K), K >> 2, blockDim.x);
                float ssum = block_sum(rms_partial(v), scratch);
                if (threadIdx.x == 0) row_inv[r] = 1.0f / sqrtf(ssum / (float)K + eps);
            }
            __syncthreads();
        }
        for (int i = threadIdx.x; i < nt * nkb; i += blockDim.x) {
            int r = i / nkb, kb = i % nkb, tok = t0 + r;
            long long arow = grp.list ? grp.list[tok] / a_div : tok;
            split_block(x + arow * K + kb * 32, xh + (long long)r * xstride + kb * 32, act.lo_off, ss + r * sstride + kb, norm_w ? norm_w + kb * 32 : 0, norm_w ? row_inv[r] : 0.0f);
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            int r = 8 * j + g, r0 = 8 * j + 2 * q;
            act.x[j] = r < nt ? xh + (long long)r * xstride : 0;
            act.s[j][0] = r0 < nt ? ss + r0 * sstride : 0;
            act.s[j][1] = r0 + 1 < nt ? ss + (r0 + 1) * sstride : 0;
        }
    } else {
        act.lo_off = lo_off;
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            int r = 8 * j + g, r0 = 8 * j + 2 * q;
            auto arow = [&](int rr) -> long long { return grp.list ? grp.list[t0 + rr] / a_div : t0 + rr; };
            act.x[j] = r < nt ? xs + arow(r) * K : 0;
            act.s[j][0] = r0 < nt ? sums + arow(r0) * sstride : 0;
            act.s[j][1] = r0 + 1 < nt ? sums + arow(r0 + 1) * sstride : 0;
        }
    }
    int tiles = weight_tiles(epi, N), groups = (tiles + QFEW_WT - 1) / QFEW_WT, ttiles = (nt + 7) / 8;
    long long tile_bytes = (long long)nu * QUNIT_BYTES;
    u64 pol = evict_first_policy();
    for (int gi = blockIdx.x; gi < groups; gi += gridDim.x) {
        int wtiles = min(QFEW_WT, tiles - QFEW_WT * gi);
        float c[QFEW_WT][TT][4];
#pragma unroll
        for (int t = 0; t < QFEW_WT; ++t)
#pragma unroll
            for (int j = 0; j < TT; ++j) c[t][j][0] = c[t][j][1] = c[t][j][2] = c[t][j][3] = 0.0f;
        for (int u = u0; u < u1; u += QSTEP) {
            // The first step may have been loaded before the inputs were ready.
            if (!(start.loaded && gi == (int)blockIdx.x && u == u0)) q_load_step(start.st, grp.w, tile_bytes, gi, tiles, u, u1, lane, pol);
#pragma unroll
            for (int i = 0; i < QSTEP; ++i)
                if (u + i < u1) q_unit<TT, QFEW_WT>(c, start.st.un[i], act, (u + i) * QB, q, ttiles, wtiles);
        }
        // Pairs (tile t, token tile j) as items t * TT + j, QRED at a time: every warp writes its
        // slice sums, then warp i adds up item base + i: 0 + s0 + ... + s7.
#pragma unroll
        for (int base = 0; base < QFEW_WT * TT; base += QRED) {
#pragma unroll
            for (int i = 0; i < QRED; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) red[warp][i][lane][e] = c[(base + i) / TT][(base + i) % TT][e];
            __syncthreads();
            if (warp < QRED) {
                int item = base + warp, t = item / TT, j = item % TT;
                if (t < wtiles && j < ttiles) {
                    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    for (int s = 0; s < KSLICES; ++s)
#pragma unroll
                        for (int e = 0; e < 4; ++e) sum[e] += red[s][warp][lane][e];
                    q_store(epi, out, grp, N, QFEW_WT * gi + t, t0 + 8 * j, g, q, sum);
                }
            }
            __syncthreads();
        }
    }
}

// Arguments: as qmm_many's, plus the activations before any split (`x`), qsplit's outputs where
// the rows are not split in the kernel, and the RMSNorm weight the XSMEM kernels may apply to
// the rows first (null: none) with its epsilon.
#define QMM_FEW(NAME, TT, XSMEM, MIN_BLOCKS)                                                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * KSLICES, MIN_BLOCKS) NAME(float* out, const float* x, const unsigned char* w, int rows, int N, int K, const u64* group_w, \
            const int* counts, const int* lists, int list_stride, int a_div, const int* active, const bf16_t* xs, long long lo_off, const float* sums, Epilogue epi, \
            const float* norm_w, float eps) {                                                                                                              \
        QFewStart st = qmm_few_start(w, N, K, group_w, epi);                                                                                               \
        wait_for_inputs();                                                                                                                                 \
        qmm_few_body<TT, XSMEM>(st, out, x, w, rows, N, K, group_w, counts, lists, list_stride, a_div, active, xs, lo_off, sums, epi, norm_w, eps);          \
    }
// One token tile (decode up to 8 sequences): registers for three resident blocks per SM, whose
// weight loads keep the memory busier than two blocks' (FP8's wide blocks would spill: two).
#define QFEW1_BLOCKS (QFP8 && QU == 128 ? 2 : 3)
QMM_FEW(qmm_few1s, 1, true, QFEW1_BLOCKS)
QMM_FEW(qmm_few2s, 2, true, 1)
QMM_FEW(qmm_few1, 1, false, QFEW1_BLOCKS)
QMM_FEW(qmm_few2, 2, false, 1)
QMM_FEW(qmm_few4, 4, false, 1)
QMM_FEW(qmm_few8, 8, false, 1)

// ---- many rows ----

#define QM_TOKENS 64
#define QM_TILES 8
#define QM_STAGES 3
// Elements of K per stage, units per stage.
#define QM_SK 128
#define QM_UPS (QM_SK / QU)
#define QM_WBYTES (QM_TILES * QM_UPS * QUNIT_BYTES)
// bf16 elements per activation row of a stage (64 bytes of padding: rows g and g+1 of a
// quarter-warp's 16-byte loads fall on different banks).
#define QM_XSTRIDE (QM_SK + 32)
#define QM_XBYTES (QM_TOKENS * QM_XSTRIDE * 2)
#define QM_SBYTES (QM_TOKENS * 16)
#define QM_STAGE_BYTES (QM_WBYTES + 2 * QM_XBYTES + QM_SBYTES)

// Many tokens: grid (ceil(tiles / 8), ceil(rows / 64), groups), 256 threads as 4 (weight) x 2
// (token) warps of 2 weight tiles x 4 token tiles, a 3-stage cp.async pipeline over 128
// elements of K: the stage's unit tiles of 8 weight tiles, the tokens' split rows and block
// sums (from qsplit). Same per-element sequence and slice sums as qmm_few. Dynamic shared
// memory: QM_STAGES * QM_STAGE_BYTES.
// SPLIT (plain launches, few tiles): block x computes k-slice x % KSLICES of tile group
// x / KSLICES only, and stores its slice sums to `part` ([KSLICES][rows][tiles * 16]) for
// qreduce, which adds them as the other kernels do: more blocks where a weight has few tiles.
template <bool SPLIT>
__device__ __forceinline__ void qmm_many_body(float* out, const bf16_t* xs, long long lo_off, const float* sums, const unsigned char* w_, int rows, int N, int K,
        const u64* group_w, const int* counts, const int* lists, int list_stride, int a_div, const int* active, const Epilogue& epi, float* part) {
    extern __shared__ __align__(16) unsigned char qsm[];
    QGroup grp = qgroup_of(w_, rows, group_w, counts, lists, list_stride, active);
    int t0 = blockIdx.y * QM_TOKENS;
    if (t0 >= grp.rows) return;
    int my_slice = SPLIT ? blockIdx.x % KSLICES : 0;
    int tile0 = (SPLIT ? blockIdx.x / KSLICES : blockIdx.x) * QM_TILES;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int wm = warp >> 1, wn = warp & 1;
    int tiles = weight_tiles(epi, N);
    int nu = K / QU, ups = (nu + KSLICES - 1) / KSLICES, nstages = (K + QM_SK - 1) / QM_SK, sstride = sums_stride(K);
    // The stages this block walks: all, or those holding its slice's units [su0, su1).
    int su0 = SPLIT ? min(my_slice * ups, nu) : 0, su1 = SPLIT ? min(su0 + ups, nu) : nu;
    int first_stage = su0 / QM_UPS, last_stage = SPLIT ? (su1 + QM_UPS - 1) / QM_UPS : nstages;
    long long tile_bytes = (long long)nu * QUNIT_BYTES;
    // This thread's activation rows in every stage's copies: rows tid/16 + 16i.
    long long arow[4];
    bool aok[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int tok = t0 + (threadIdx.x >> 4) + 16 * i;
        aok[i] = tok < grp.rows;
        arow[i] = aok[i] ? (grp.list ? grp.list[tok] / a_div : tok) : 0;
    }
    auto load_stage = [&](int buf, int stage) {
        unsigned char* base = qsm + (long long)buf * QM_STAGE_BYTES;
        int ku0 = stage * QM_UPS, wbytes = min(QM_UPS, nu - ku0) * QUNIT_BYTES;
        const int wchunks = QM_UPS * QUNIT_BYTES / 16;
        for (int c = threadIdx.x; c < QM_TILES * wchunks; c += 256) {
            int t = c / wchunks, o = (c % wchunks) * 16;
            bool ok = tile0 + t < tiles && o < wbytes;
            const unsigned char* src = ok ? grp.w + (tile0 + t) * tile_bytes + (long long)ku0 * QUNIT_BYTES + o : grp.w;
            cp_async16(base + t * (QM_UPS * QUNIT_BYTES) + o, src, ok);
        }
        bf16_t* xh = (bf16_t*)(base + QM_WBYTES);
        bf16_t* xl = (bf16_t*)(base + QM_WBYTES + QM_XBYTES);
        float* sb = (float*)(base + QM_WBYTES + 2 * QM_XBYTES);
        int k0 = stage * QM_SK, kn = min(QM_SK, K - k0), o = (threadIdx.x & 15) * 8;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int r = (threadIdx.x >> 4) + 16 * i;
            bool ok = aok[i] && o < kn;
            const bf16_t* src = xs + arow[i] * K + k0 + (ok ? o : 0);
            cp_async16(xh + r * QM_XSTRIDE + o, src, ok);
            cp_async16(xl + r * QM_XSTRIDE + o, src + lo_off, ok);
            if ((threadIdx.x & 15) == 0) cp_async16(sb + r * 4, sums + arow[i] * sstride + stage * 4, aok[i]);
        }
    };
    float c[2][4][4], tot[2][4][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) c[m][j][e] = tot[m][j][e] = 0.0f;
#pragma unroll
    for (int s = 0; s < QM_STAGES - 1; ++s) {
        if (first_stage + s < last_stage) load_stage(s, first_stage + s);
        asm volatile("cp.async.commit_group;");
    }
    int slice = 0, slice_end = min(ups, nu);
    for (int stage = first_stage; stage < last_stage; ++stage) {
        int rel = stage - first_stage;
        asm volatile("cp.async.wait_group %0;" ::"n"(QM_STAGES - 2));
        __syncthreads();
        if (stage + QM_STAGES - 1 < last_stage) load_stage((rel + QM_STAGES - 1) % QM_STAGES, stage + QM_STAGES - 1);
        asm volatile("cp.async.commit_group;");
        const unsigned char* base = qsm + (long long)(rel % QM_STAGES) * QM_STAGE_BYTES;
        const bf16_t* xh = (const bf16_t*)(base + QM_WBYTES);
        const float* sb = (const float*)(base + QM_WBYTES + 2 * QM_XBYTES);
        QAct<4> act;
        act.lo_off = QM_XBYTES / 2;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int r = wn * 32 + 8 * j;
            act.x[j] = xh + (r + g) * QM_XSTRIDE;
            act.s[j][0] = sb + (r + 2 * q) * 4;
            act.s[j][1] = sb + (r + 2 * q + 1) * 4;
        }
#pragma unroll
        for (int i = 0; i < QM_UPS; ++i) {
            int u = stage * QM_UPS + i;
            if (u >= su1) break;
            if (u < su0) continue;
            // The warp's two tiles, QWT at a time (one load of activations for both where QWT is 2).
#pragma unroll
            for (int m = 0; m < 2; m += QWT) {
                QUnit un[QWT];
#pragma unroll
                for (int t = 0; t < QWT; ++t) q_load<false>(un[t], base + (2 * wm + m + t) * (QM_UPS * QUNIT_BYTES) + i * QUNIT_BYTES, lane, 0);
                q_unit<4, QWT>((float(*)[4][4])c[m], un, act, i * QB, q, 4, QWT);
            }
            if (!SPLIT && u + 1 == slice_end) {
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            tot[m][j][e] += c[m][j][e];
                            c[m][j][e] = 0.0f;
                        }
                ++slice;
                slice_end = min((slice + 1) * ups, nu);
            }
        }
    }
    asm volatile("cp.async.wait_group 0;");
    if (SPLIT) {
        // This slice's sums (zeros for an empty slice) for qreduce.
        int np = tiles * 16;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            int tile = tile0 + 2 * wm + m;
            if (tile >= tiles) continue;
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    int tok = t0 + wn * 32 + 8 * j + 2 * q + h;
                    if (tok >= grp.rows) continue;
                    float* p = part + ((long long)my_slice * grp.rows + tok) * np + tile * 16 + g;
                    p[0] = c[m][j][h];
                    p[8] = c[m][j][2 + h];
                }
        }
        return;
    }
    // The empty slices after the last add their zero sums, as qmm_few's reduction does.
    for (; slice < KSLICES; ++slice)
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) tot[m][j][e] += 0.0f;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        int tile = tile0 + 2 * wm + m;
        if (tile >= tiles) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) q_store(epi, out, grp, N, tile, t0 + wn * 32 + 8 * j, g, q, tot[m][j]);
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) qmm_many(float* out, const bf16_t* xs, long long lo_off, const float* sums, const unsigned char* w, int rows, int N, int K,
        const u64* group_w, const int* counts, const int* lists, int list_stride, int a_div, const int* active, Epilogue epi) {
    wait_for_inputs();
    qmm_many_body<false>(out, xs, lo_off, sums, w, rows, N, K, group_w, counts, lists, list_stride, a_div, active, epi, 0);
}

// qmm_many's slices in blocks of their own (grid (tile groups * KSLICES, token blocks)), into
// `part`; qreduce adds and stores them.
extern "C" __global__ void __launch_bounds__(256, 1) qmm_many_split(float* part, const bf16_t* xs, long long lo_off, const float* sums, const unsigned char* w, int rows, int N,
        int K, Epilogue epi) {
    wait_for_inputs();
    qmm_many_body<true>(0, xs, lo_off, sums, w, rows, N, K, 0, 0, 0, 0, 1, 0, epi, part);
}

// The slice sums of qmm_many_split added in slice order from 0 (as every kernel adds them) and
// stored by `epi`: a thread per (token, tile, row pair g / g+8).
extern "C" __global__ void qreduce(float* out, const float* part, int rows, int N, Epilogue epi) {
    wait_for_inputs();
    int tiles = weight_tiles(epi, N), np = tiles * 16;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * tiles * 8) return;
    int tok = (int)(i / (tiles * 8)), rest = (int)(i % (tiles * 8)), tile = rest / 8, g = rest % 8;
    float v0 = 0.0f, v1 = 0.0f;
    for (int s = 0; s < KSLICES; ++s) {
        const float* p = part + ((long long)s * rows + tok) * np + tile * 16 + g;
        v0 += p[0];
        v1 += p[8];
    }
    if (epi.mode == EPI_SWIGLU) {
        int r = tile * 8 + g;
        if (r < (N >> 1)) out[(long long)tok * (N >> 1) + r] = siluf_(v0) * v1;
    } else {
        store_one(epi, out, tok, tile * 16 + g, N, v0);
        store_one(epi, out, tok, tile * 16 + g + 8, N, v1);
    }
}

// ---- embedding rows ----

// Rows `ids` of a weight in plain row order, dequantized as the CPU does: scale * w (+ min),
// each operation rounded on its own. One block per token; a thread per (unit, quad).
extern "C" __global__ void qembed(float* out, const unsigned char* w, const int* ids, int n, int K) {
    wait_for_inputs();
    int t = blockIdx.x;
    if (t >= n) return;
    int r = ids[t], tile = r / 16, g = r % 8;
    bool upper = (r % 16) >= 8;
    int nu = K / QU;
    for (int i = threadIdx.x; i < nu * 4; i += blockDim.x) {
        int u = i >> 2, q = i & 3;
        QUnit un;
        q_load<false>(un, w + ((long long)tile * nu + u) * QUNIT_BYTES, 4 * g + q, 0);
#pragma unroll
        for (int b = 0; b < QB; ++b) {
            u32 a[2][4];
            q_frags(un, b, a);
#pragma unroll
            for (int p = 0; p < 8; ++p) {
                // Position p: step p / 4, register (row g: 0 or 2, row g+8: 1 or 3), half p % 2.
                int s = p >> 2, reg = ((p >> 1) & 1) * 2 + (upper ? 1 : 0);
                float wv = bf16_to_f32((bf16_t)(a[s][reg] >> (16 * (p & 1))));
                int sb = QSB == 16 ? 2 * b + s : (b * 32) / QSB;
                float2 sc = q_scale(un, sb);
#if QHAS_MIN
                // The fragments hold 128 + code (see code_pair).
                wv -= 128.0f;
#endif
                float v = __fmul_rn(upper ? sc.y : sc.x, wv);
#if QHAS_MIN
                float2 mn = q_stored_min(un, b);
                v = __fadd_rn(v, upper ? mn.y : mn.x);
#endif
                int e = p < 4 ? 4 * q + p : 16 + 4 * q + p - 4;
                out[(long long)t * K + u * QU + b * 32 + e] = v;
            }
        }
    }
}

// ---- random weights ----

__device__ __forceinline__ u32 qhash(u64 seed, u64 i) {
    u64 z = seed + i * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (u32)((z ^ (z >> 31)) >> 16);
}

__device__ __forceinline__ u32 f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Random unit tiles (`--load-format dummy`): random codes, and per row scales (and mins) of the
// format's kind such that the weights have standard deviation about `sigma`. A thread per
// 16 bytes of codes, then one per (unit, quad) for the scales.
extern "C" __global__ void qfill(unsigned char* w, long long units, u64 seed, float sigma) {
    wait_for_inputs();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long code_chunks = QCODE_BYTES / 16;
    if (i < units * code_chunks) {
        long long unit = i / code_chunks, off = (i % code_chunks) * 16;
        u32 v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[k] = qhash(seed, 4 * i + k) * 65537u ^ qhash(seed ^ 0x5555, 4 * i + k);
#if QFP8
            // Exponents 5..8: magnitudes 0.25 to 3.75, no NaN.
            v[k] = (v[k] & 0x87878787u) | ((((v[k] >> 3) & 0x03030303u) + 0x05050505u) << 3);
#endif
        }
        *(uint4*)(w + unit * QUNIT_BYTES + off) = make_uint4(v[0], v[1], v[2], v[3]);
    }
    long long j = i - units * code_chunks;
    if (j < 0 || j >= units * 8) return;
    long long unit = j / 8;
    int g = (int)(j % 8);
    unsigned char* sp = w + unit * QUNIT_BYTES + QCODE_BYTES;
    float jitter = 0.75f + 0.5f * (float)(qhash(seed, 1000003ull * (j + 1)) & 0xFFFF) / 65536.0f;
    float s = sigma * jitter;
    u32 rnd = qhash(seed ^ 0xABCDEF, j);
#if QFMT == 0 || QFMT == 2 || QFMT == 4 || QFMT == 8
    // Code spreads: q - 8, q - 16, int8, the codebook.
    float spread = QFMT == 0 ? 4.6f : QFMT == 2 ? 9.2f : QFMT == 4 ? 74.0f : 64.0f;
    u32 d = f2h(s / spread);
    *(u32*)(sp + 4 * g) = d | (d << 16);
#elif QFMT == 1 || QFMT == 3
    float spread = QFMT == 1 ? 4.6f : 9.2f, mean = QFMT == 1 ? 7.5f : 15.5f;
    u32 d = f2h(s / spread), m = f2h(-(s / spread) * mean);
    *(uint2*)(sp + 8 * g) = make_uint2(d | (m << 16), d | (m << 16));
#elif QINT4
    u32 word = f2h(s / 4.6f) | (8u << 16);
    *(uint2*)(sp + 8 * g) = make_uint2(word, word);
#elif QFP8
    float scale = s / 1.6f;
    *(uint2*)(sp + 8 * g) = make_uint2(__float_as_uint(scale), __float_as_uint(scale));
#elif QFMT == 5 || QFMT == 6
    // Sub-block scales 32..63 with mins equal to them: the codes' mean (7.5, 15.5) cancelled.
    float spread = QFMT == 5 ? 4.6f : 9.2f, mean = QFMT == 5 ? 7.5f : 15.5f;
    float d = s / (spread * 48.0f);
    u32 dw = f2h(d) | (f2h(d * mean) << 16);
    u32 sc = (rnd & 0x1F1F1F1Fu) | 0x20202020u;
    *(uint2*)(sp + 24 * g) = make_uint2(dw, sc);
    *(uint2*)(sp + 24 * g + 8) = make_uint2(sc, dw);
    *(uint2*)(sp + 24 * g + 16) = make_uint2(sc, sc);
#elif QFMT == 7
    // int8 scales 64..127.
    u32 sc = (rnd & 0x3F3F3F3Fu) | 0x40404040u;
    u32 d = f2h(s / (18.5f * 96.0f));
    *(uint2*)(sp + 24 * g) = make_uint2(sc, sc);
    *(uint2*)(sp + 24 * g + 8) = make_uint2(sc, sc);
    *(uint2*)(sp + 24 * g + 16) = make_uint2(d | (d << 16), 0);
#elif QFMT == 9
    // ls - 32 of 8..23.
    u32 ls = (rnd & 0x0F0F0F0Fu) + 0x08080808u;
    u32 d = f2h(s / (64.0f * 16.0f));
    *(uint4*)(sp + 16 * g) = make_uint4(ls, ls, d | (d << 16), 0);
#endif
}
