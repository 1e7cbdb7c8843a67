#!/usr/bin/env python3
"""Write the weight-format test vectors under tests/fixtures/quant/ from independent oracles.

Run from the repository root:

    python3 -m pip install --target /tmp/qpy numpy gguf==0.19.0 ml_dtypes
    PYTHONPATH=/tmp/qpy python3 scripts/make_quant_vectors.py

Oracles: gguf-py's `gguf.quants.dequantize` for the GGUF block types, ml_dtypes' float8_e4m3fn
for FP8, and numpy straight from the published formulas for GPTQ / AWQ / block-FP8 (packing the
int32 tensors here too, so nothing depends on the Rust code). quant/tests/vectors.rs reads the
files and hard-codes the same shapes as CASES below.

Every expected output is little-endian f32 (`*.f32`), compared bit for bit. Inputs are the raw
bytes the Rust functions take. The seed is fixed, so the files are reproducible.
"""

import os
import sys

import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = os.path.join("tests", "fixtures", "quant")
rng = np.random.default_rng(20260611)

# GGUF type: (file stem, elements per block, bytes per block, offsets of its f16 fields).
GGUF = {
    T.Q4_0: ("q4_0", 32, 18, [0]),
    T.Q4_1: ("q4_1", 32, 20, [0, 2]),
    T.Q5_0: ("q5_0", 32, 22, [0]),
    T.Q5_1: ("q5_1", 32, 24, [0, 2]),
    T.Q8_0: ("q8_0", 32, 34, [0]),
    T.Q4_K: ("q4_k", 256, 144, [0, 2]),
    T.Q5_K: ("q5_k", 256, 176, [0, 2]),
    T.Q6_K: ("q6_k", 256, 210, [208]),
    T.IQ4_NL: ("iq4_nl", 32, 18, [0]),
    T.IQ4_XS: ("iq4_xs", 256, 136, [0]),
}
GGUF_ELEMS = 1024  # per type: 32 small blocks or 4 k-quant blocks


def write(name, data):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(np.ascontiguousarray(data).tobytes())


def write_f32(name, values):
    write(name, np.asarray(values, dtype="<f4"))


def finite_halves(count):
    """Random f16 bit patterns over the whole finite range (subnormals included), no inf/NaN."""
    bits = rng.integers(0, 1 << 16, size=count, dtype=np.uint16)
    bad = (bits & 0x7C00) == 0x7C00
    while bad.any():
        bits[bad] = rng.integers(0, 1 << 16, size=int(bad.sum()), dtype=np.uint16)
        bad = (bits & 0x7C00) == 0x7C00
    return bits


def gguf_vectors():
    for qtype, (stem, elems, size, half_fields) in GGUF.items():
        n_blocks = GGUF_ELEMS // elems
        blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
        for at in half_fields:
            blocks[:, at : at + 2] = finite_halves(n_blocks).astype("<u2").view(np.uint8).reshape(n_blocks, 2)
        values = dequantize(blocks.reshape(-1), qtype).astype(np.float32).reshape(-1)
        assert values.size == GGUF_ELEMS and np.isfinite(values).all(), stem
        write(f"{stem}.bin", blocks)
        write_f32(f"{stem}.f32", values)


def e4m3_vectors():
    codes = np.arange(256, dtype=np.uint8)
    write_f32("e4m3_all.f32", codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))


def pack_along_rows(q):
    """GPTQ qweight: int32 [k/8, n], row 8r+i of q [k, n] in bits 4i..4i+3."""
    k, n = q.shape
    words = np.zeros((k // 8, n), dtype=np.uint32)
    for i in range(8):
        words |= q[i::8, :].astype(np.uint32) << np.uint32(4 * i)
    return words.astype("<u4")


def pack_along_cols(z, order=range(8)):
    """int32 [rows, n/8]: nibble p of word j holds column 8j + order[p] (GPTQ: order = p)."""
    rows, n = z.shape
    words = np.zeros((rows, n // 8), dtype=np.uint32)
    for p, col in enumerate(order):
        words |= z[:, col::8].astype(np.uint32) << np.uint32(4 * p)
    return words.astype("<u4")


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble p holds column AWQ_ORDER[p] of its 8


def int4_case(stem, layout, k, n, group, zero_offset, zeros, scales_dtype):
    """q [k, n] random; true zeros given as [k/group, n]; scales of both signs."""
    groups = k // group
    q = rng.integers(0, 16, size=(k, n), dtype=np.uint8)
    raw = rng.normal(0.0, 0.02, size=(groups, n)).astype(np.float32)
    if scales_dtype == "f16":
        scales = raw.astype(np.float16)
        scale_bytes = scales.astype("<f2")
    else:
        scales = raw.astype(ml_dtypes.bfloat16)
        scale_bytes = scales.view(np.uint16).astype("<u2")
    scales_f32 = scales.astype(np.float32)
    assert (scales_f32 < 0).any() and (scales_f32 > 0).any()
    stored = zeros - zero_offset
    assert stored.min() >= 0 and stored.max() <= 15
    # W[r, c] = scale[c // group, r] * (q[c, r] - zero[c // group, r]); float32 throughout.
    g_of_c = np.arange(k) // group
    diff = (q.astype(np.int32) - zeros[g_of_c, :].astype(np.int32)).astype(np.float32)
    w = (scales_f32[g_of_c, :] * diff).T  # [n, k]
    if layout == "gptq":
        qweight = pack_along_rows(q)
        qzeros = pack_along_cols(stored)
    else:
        qweight = pack_along_cols(q, AWQ_ORDER)
        qzeros = pack_along_cols(stored, AWQ_ORDER)
    write(f"{stem}.qweight", qweight)
    write(f"{stem}.qzeros", qzeros)
    write(f"{stem}.scales", scale_bytes)
    write_f32(f"{stem}.f32", w)


def int4_vectors():
    k, n = 256, 16
    sym = np.full((k // 128, n), 8, dtype=np.uint8)  # AutoRound sym: qzeros all 0x77777777
    # (stem, layout, group, zero offset, true zeros, scales dtype)
    cases = [
        ("gptq_v1_g32", "gptq", 32, 1, rng.integers(1, 16, size=(k // 32, n), dtype=np.uint8), "f16"),
        ("gptq_v1_g128_sym", "gptq", 128, 1, sym, "f16"),
        ("gptq_v2_g32_bf16", "gptq", 32, 0, rng.integers(0, 16, size=(k // 32, n), dtype=np.uint8), "bf16"),
        ("gptq_v2_g128", "gptq", 128, 0, rng.integers(0, 16, size=(k // 128, n), dtype=np.uint8), "f16"),
        ("awq_g32", "awq", 32, 0, rng.integers(0, 16, size=(k // 32, n), dtype=np.uint8), "f16"),
        ("awq_g128", "awq", 128, 0, rng.integers(0, 16, size=(k // 128, n), dtype=np.uint8), "f16"),
    ]
    for stem, layout, group, offset, zeros, scales_dtype in cases:
        int4_case(stem, layout, k, n, group, offset, zeros, scales_dtype)


def random_e4m3(shape):
    """e4m3 bytes without the two NaN codes, so expected values compare bit for bit."""
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3F
    return codes


def fp8_vectors():
    # Block FP8: n = 40 rows in blocks of 16 (the last block holds 8), k = 64 in blocks of 32.
    n, k, block_n, block_k = 40, 64, 16, 32
    weight = random_e4m3((n, k))
    scale_shape = (-(-n // block_n), k // block_k)
    scale = (rng.lognormal(-6.0, 1.0, size=scale_shape) * rng.choice([-1, 1], size=scale_shape)).astype(np.float32)
    values = weight.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    expanded = np.repeat(np.repeat(scale, block_n, axis=0)[:n], block_k, axis=1)
    write("fp8_block.weight", weight)
    write_f32("fp8_block.scale.f32", scale)
    write_f32("fp8_block.f32", values * expanded)
    # Per-channel FP8 (compressed-tensors strategy "channel"): n = 8, k = 64, one scale per row.
    n, k = 8, 64
    weight = random_e4m3((n, k))
    scale = rng.lognormal(-5.0, 1.0, size=n).astype(np.float32)
    write("fp8_channel.weight", weight)
    write_f32("fp8_channel.scale.f32", scale)
    write_f32("fp8_channel.f32", weight.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale[:, None])


def main():
    os.makedirs(OUT, exist_ok=True)
    gguf_vectors()
    e4m3_vectors()
    int4_vectors()
    fp8_vectors()
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"wrote {len(os.listdir(OUT))} files, {total} bytes, to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
