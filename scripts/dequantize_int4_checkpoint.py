"""Writes a BF16 copy of an int4 GPTQ-layout checkpoint (AutoRound `auto_round` / `auto_gptq`
packing, as the embedded default model is stored), for tools that read float checkpoints only:
llama.cpp's convert_hf_to_gguf.py does not take `quant_method: auto-round`.

Each int4 linear `M.qweight` (int32 [k/8, n], element 8i+j of a column in nibble j), `M.qzeros`
(int32 [k/group, n/8]) and `M.scales` ([k/group, n]) becomes `M.weight` [n, k] =
scale * (q - zero) in f32, rounded to bf16 (nearest even); `zero` is stored as is for the
`auto_round` packing and `gptq_v2`, plus 1 for `auto_gptq` (GPTQ v1). Every other tensor is copied
unchanged, and the config loses its `quantization_config`.

Usage: dequantize_int4_checkpoint.py MODEL_DIR OUT_DIR   (needs numpy)
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np


def unpack_nibbles(words: np.ndarray) -> np.ndarray:
    """int32 words [a, b] -> uint8 nibbles [a, 8, b] (nibble j of each word at [:, j, :])."""
    w = words.view(np.uint32)
    return np.stack([(w >> (4 * j)) & 0xF for j in range(8)], axis=1).astype(np.uint8)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round f32 to bf16 (nearest even), returned as the raw uint16 bits."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = 0x7FC0
    return out


def dequantize(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group: int, zero_offset: int) -> np.ndarray:
    k8, n = qweight.shape
    k = 8 * k8
    q = unpack_nibbles(qweight).reshape(k, n).astype(np.float32)  # [k, n]: row 8i+j from word i, nibble j
    groups = scales.shape[0]
    z = unpack_nibbles(qzeros).transpose(0, 2, 1).reshape(groups, n).astype(np.float32) + zero_offset
    g = np.arange(k) // group
    w = scales.astype(np.float32)[g] * (q - z[g])
    return np.ascontiguousarray(w.T)  # [n, k]


def read_safetensors(path: Path) -> dict:
    """name -> (dtype string, shape, raw bytes), read by hand: numpy has no bf16."""
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    header.pop("__metadata__", None)
    data = raw[8 + header_len :]
    return {name: (h["dtype"], h["shape"], data[h["data_offsets"][0] : h["data_offsets"][1]]) for name, h in header.items()}


def write_safetensors(path: Path, tensors: dict) -> None:
    header, chunks, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for c in chunks:
            f.write(c)


SCALE_DTYPES = {"F16": np.float16, "F32": np.float32}


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    config = json.loads((src / "config.json").read_text())
    quant = config.pop("quantization_config", None)
    if not quant or quant.get("bits") != 4:
        sys.exit(f"{src}: not an int4 checkpoint (quantization_config {quant!r})")
    packing = quant.get("packing_format") or quant.get("checkpoint_format") or "auto_gptq"
    # As Kestrel's loader reads them (src/model/weights/quantized.rs): GPTQ v1 stores zero - 1.
    zero_offset = {"auto_round": 0, "auto_round:gptqmodel": 0, "gptq_v2": 0, "auto_round:auto_gptq": 1, "auto_round:gptq": 1, "auto_gptq": 1, "gptq": 1}.get(packing)
    if zero_offset is None:
        sys.exit(f"{src}: packing {packing!r} is not a GPTQ layout")
    group = int(quant["group_size"])
    dst.mkdir(parents=True, exist_ok=True)
    out, converted = {}, 0
    for f in sorted(src.glob("*.safetensors")):
        tensors = read_safetensors(f)
        modules = {name[: -len(".qweight")] for name in tensors if name.endswith(".qweight")}
        for name, (dtype, shape, data) in tensors.items():
            module = name.rsplit(".", 1)[0]
            if module not in modules:
                out[name] = (dtype, shape, data)
                continue
            if not name.endswith(".qweight"):
                continue  # qzeros, scales and g_idx are folded into the weight
            qdtype, qshape, qdata = tensors[f"{module}.qzeros"]
            sdtype, sshape, sdata = tensors[f"{module}.scales"]
            if dtype != "I32" or qdtype != "I32" or sdtype not in SCALE_DTYPES:
                sys.exit(f"{module}: expected I32 qweight and qzeros and F16/F32 scales, got {dtype}, {qdtype}, {sdtype}")
            if f"{module}.g_idx" in tensors:
                g_idx = np.frombuffer(tensors[f"{module}.g_idx"][2], dtype=np.int32)
                if not np.array_equal(g_idx, np.arange(len(g_idx)) // group):
                    sys.exit(f"{module}: g_idx reorders the groups (activation order), not supported")
            qweight = np.frombuffer(data, dtype=np.int32).reshape(shape)
            qzeros = np.frombuffer(qdata, dtype=np.int32).reshape(qshape)
            scales = np.frombuffer(sdata, dtype=SCALE_DTYPES[sdtype]).reshape(sshape)
            w = dequantize(qweight, qzeros, scales, group, zero_offset)
            out[f"{module}.weight"] = ("BF16", w.shape, f32_to_bf16_bits(w).tobytes())
            converted += 1
    write_safetensors(dst / "model.safetensors", out)
    config["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"]:
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    print(f"{converted} int4 linears as BF16, {len(out) - converted} tensors copied, in {dst}")


if __name__ == "__main__":
    main()
