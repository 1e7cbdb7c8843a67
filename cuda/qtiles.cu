// Quantized tiles outside the matmuls (same module as cuda/qmatmul.cu): embedding rows
// dequantized as the CPU does, and random tiles for `--load-format dummy`.

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
