#!/usr/bin/env python3
"""Quantized versions of the dense test fixture, in the layouts published checkpoints use.

    python3 -m pip install --target /tmp/qfx numpy ml_dtypes
    PYTHONPATH=/tmp/qfx python3 scripts/make_quantized_fixtures.py

From tests/fixtures/qwen35-dense (BF16) it writes
  tests/fixtures/qwen35-dense-int4/  AutoRound int4 (`auto_round:auto_gptq`: GPTQ packing, v1
                                     zero points, symmetric full-range scales that may be
                                     negative, group 32), in-projections a/b, embeddings,
                                     lm_head and the MTP head left BF16 as AutoRound leaves them;
  tests/fixtures/qwen35-dense-fp8/   block FP8 as Qwen's FP8 releases store it (F8_E4M3 weights,
                                     BF16 `weight_scale_inv` per 128x128 block, partial edge
                                     blocks), in-projections a/b and the rest left BF16;
each with `dequantized.safetensors`: the F32 weights every quantized linear stands for, computed
here from the stored values with the formulas of the formats (scale * (q - zero); e4m3 * scale).
A model whose quantized linears are replaced by these must give bitwise the logits of the
quantized one: that is what the tests check.
"""

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SOURCE = ROOT / "qwen35-dense"
GROUP = 32
FP8_BLOCK = (128, 128)

DTYPES = {"F32": np.float32, "F16": np.float16, "I32": np.int32}


def read_safetensors(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = data[a:b]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            out[name] = ("BF16", info["shape"], bits.view(np.float32).reshape(info["shape"]))
        else:
            out[name] = (info["dtype"], info["shape"], np.frombuffer(buf, dtype=DTYPES[info["dtype"]]).reshape(info["shape"]))
    return out


def to_bf16_bytes(values):
    """Round-to-nearest-even f32 -> bf16 (the values here are already bf16 or bf16-rounded)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def bf16_round(values):
    return np.frombuffer(to_bf16_bytes(values), dtype="<u2").astype(np.uint32).__lshift__(16).view(np.float32).reshape(np.shape(values))


def write_safetensors(path, tensors):
    """tensors: name -> (dtype tag, shape, raw little-endian bytes), written in name order."""
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))


LITTLE_ENDIAN = {"F32": "<f4", "F16": "<f2", "I32": "<i4"}


def stored(dtype, shape, values):
    if dtype == "BF16":
        return (dtype, shape, to_bf16_bytes(values))
    return (dtype, shape, np.asarray(values).astype(LITTLE_ENDIAN[dtype]).tobytes())


def quantizable(name, shape):
    """AutoRound's rule for int W4A16: text-decoder linears whose both dims are multiples of 32
    (and, as in published Qwen checkpoints, not the GDN a/b in-projections)."""
    return (
        name.startswith("model.language_model.layers.")
        and name.endswith(".weight")
        and len(shape) == 2
        and shape[0] % 32 == 0
        and shape[1] % 32 == 0
        and "in_proj_a" not in name
        and "in_proj_b" not in name
    )


def int4_sym_full_range(w):
    """AutoRound's symmetric full-range int4 of one [n, k] weight in groups of GROUP along k:
    scale = +-max|w| / 8 with the sign that maps the larger-magnitude extreme to -8, rounded
    to f16; q = clip(round(w / scale) + 8, 0, 15)."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    hi, lo = g.max(axis=2), g.min(axis=2)
    scale = np.where(-lo >= hi, lo / -8.0, hi / -8.0)
    scale = np.where(scale == 0, 1.0, scale).astype(np.float16)
    q = np.clip(np.round(g / scale.astype(np.float32)[..., None]) + 8, 0, 15).astype(np.int64)
    return q.reshape(n, k), scale  # scale: [n, groups]


def gptq_pack(q, scale):
    """GPTQ layout: qweight I32 [k/8, n] packed along k (row 8r+i in bits 4i..4i+3); qzeros I32
    [groups, n/8] packed along n holding zero - 1 = 7 (v1); scales F16 [groups, n]."""
    n, k = q.shape
    qt = q.T.reshape(k // 8, 8, n)
    qweight = np.zeros((k // 8, n), dtype=np.uint32)
    for i in range(8):
        qweight |= (qt[:, i, :].astype(np.uint32) << (4 * i))
    groups = k // GROUP
    zeros = np.full((groups, n), 8 - 1, dtype=np.uint32).reshape(groups, n // 8, 8)
    qzeros = np.zeros((groups, n // 8), dtype=np.uint32)
    for j in range(8):
        qzeros |= zeros[:, :, j] << (4 * j)
    return qweight.view(np.int32), qzeros.view(np.int32), scale.T.copy()


def dequant_int4(q, scale):
    n, k = q.shape
    s = np.repeat(scale.astype(np.float32), GROUP, axis=1)
    return (s * (q - 8).astype(np.float32)).astype(np.float32)


def fp8_blocks(w):
    """Block FP8: per [128, 128] block (edge blocks partial) scale = bf16(amax / 448); weight =
    e4m3(w / scale). Returns the e4m3 bytes, the bf16 scales and the dequantized f32 weight."""
    n, k = w.shape
    bn, bk = FP8_BLOCK
    sn, sk = -(-n // bn), -(-k // bk)
    scale = np.zeros((sn, sk), dtype=np.float32)
    for i in range(sn):
        for j in range(sk):
            amax = np.abs(w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]).max()
            scale[i, j] = amax / 448.0 if amax > 0 else 1.0
    scale = bf16_round(scale)
    full = np.repeat(np.repeat(scale, bn, axis=0)[:n], bk, axis=1)[:, :k]
    q = (w / full).astype(ml_dtypes.float8_e4m3fn)
    deq = q.astype(np.float32) * full
    return q.view(np.uint8), scale, deq.astype(np.float32)


def copy_side_files(dest, quantization_config):
    dest.mkdir(parents=True, exist_ok=True)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(SOURCE / f, dest / f)
    config = json.loads((SOURCE / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def int4_tensors(name, values):
    """The AutoRound tensors of one linear and its dequantized weight."""
    module = name[: -len(".weight")]
    q, scale = int4_sym_full_range(values)
    qweight, qzeros, scales = gptq_pack(q, scale)
    stored_tensors = {
        module + ".qweight": ("I32", qweight.shape, qweight.astype("<i4").tobytes()),
        module + ".qzeros": ("I32", qzeros.shape, qzeros.astype("<i4").tobytes()),
        module + ".scales": ("F16", scales.shape, scales.astype("<f2").tobytes()),
    }
    return stored_tensors, dequant_int4(q, scale)


def fp8_tensors(name, values):
    """The block-FP8 tensors of one linear and its dequantized weight."""
    q, scale, deq = fp8_blocks(values)
    module = name[: -len(".weight")]
    return {name: ("F8_E4M3", values.shape, q.tobytes()), module + ".weight_scale_inv": ("BF16", scale.shape, to_bf16_bytes(scale))}, deq


def write_quantized(dest, tensors, quantize, quantization_config):
    """A copy of the source fixture in `dest` with every quantizable linear through `quantize`,
    and the dequantized weights beside it."""
    copy_side_files(dest, quantization_config)
    out, deq = {}, {}
    for name, (dtype, shape, values) in tensors.items():
        if not quantizable(name, shape):
            out[name] = stored(dtype, shape, values)
            continue
        stored_tensors, dequantized = quantize(name, values)
        out.update(stored_tensors)
        deq[name] = ("F32", shape, dequantized.astype("<f4").tobytes())
    write_safetensors(dest / "model.safetensors", out)
    write_safetensors(dest / "dequantized.safetensors", deq)
    print(dest, sum(f.stat().st_size for f in dest.iterdir()), "bytes")


def main():
    tensors = read_safetensors(SOURCE / "model.safetensors")
    autoround = {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": GROUP, "sym": True, "data_type": "int", "act_bits": 16, "block_name_to_quantize": "model.language_model.layers"}
    write_quantized(ROOT / "qwen35-dense-int4", tensors, int4_tensors, autoround)
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK), "modules_to_not_convert": ["lm_head", "in_proj_a", "in_proj_b", "mtp"]}
    write_quantized(ROOT / "qwen35-dense-fp8", tensors, fp8_tensors, fp8)


if __name__ == "__main__":
    main()
