#!/usr/bin/env python3
"""Write the GGUF fixtures under tests/fixtures/gguf/ with gguf-py, llama.cpp's own Python package.

They let the Rust reader (src/model/weights/gguf/) be checked against an independent writer:

  tiny.gguf     little-endian v3, alignment 64, metadata of every value type (string array,
                nested arrays, u8 array from bytes, ...) and small F32 / F16 / BF16 / Q8_0 / Q4_K /
                IQ4_XS / MXFP4 tensors (the block types hold random bytes: only their layout matters).
  tiny.json     what tiny.gguf holds: every key with its type and value, every tensor with its
                ggml type, dims (ne[0] first), offsets and bytes (hex) as gguf-py's GGUFReader
                reads them back, and gguf-py's (block elements, block bytes) table.
  tiny-be.gguf  the same writer in big-endian mode (metadata only), which the reader must refuse.

Run (the fixtures are committed; rerun only to change them):
  python3 -m pip install --target /tmp/gpy numpy gguf==0.19.0
  PYTHONPATH=/tmp/gpy python3 scripts/make_gguf_fixture.py [--out tests/fixtures/gguf]
"""

import argparse
import json
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q, GGUFValueType as V

ARCH = "qwen35"
ALIGNMENT = 64

# (key, gguf-py adder, value, type name as the JSON records it). Floats are exactly representable
# in their storage type so the JSON comparison can be exact.
SCALARS = [
    ("general.name", "add_string", "tiny gguf fixture", "string"),
    ("general.quantization_version", "add_uint32", 2, "u32"),
    ("qwen35.block_count", "add_uint32", 2, "u32"),
    ("qwen35.context_length", "add_uint64", 4096, "u64"),
    ("qwen35.attention.layer_norm_rms_epsilon", "add_float32", 2.0 ** -20, "f32"),
    ("qwen35.rope.freq_base", "add_float32", 10000000.0, "f32"),
    ("tokenizer.ggml.add_bos_token", "add_bool", False, "bool"),
    ("tokenizer.ggml.bos_token_id", "add_uint32", 1, "u32"),
    ("kestrel.test.u8", "add_uint8", 200, "u8"),
    ("kestrel.test.i8", "add_int8", -100, "i8"),
    ("kestrel.test.u16", "add_uint16", 60000, "u16"),
    ("kestrel.test.i16", "add_int16", -30000, "i16"),
    ("kestrel.test.i32", "add_int32", -7, "i32"),
    ("kestrel.test.u64", "add_uint64", 2 ** 63 + 5, "u64"),
    ("kestrel.test.i64", "add_int64", -(2 ** 40), "i64"),
    ("kestrel.test.f64", "add_float64", 0.1, "f64"),
    ("kestrel.test.empty_string", "add_string", "", "string"),
    ("kestrel.test.unicode", "add_string", "héllo, 世界 🦅", "string"),
]

TOKENS = ["<unk>", "<s>", "</s>", "Ġhello", "日本", "🦅", " ", "a\nb", "\u0000", "Ċ"]

# (key, value as given to add_array, JSON description). gguf-py picks the element type from the
# Python values: int -> i32, float -> f32, str -> string, bool -> bool, list -> array, bytes -> u8.
ARRAYS = [
    ("tokenizer.ggml.tokens", TOKENS, {"type": "array", "elem_type": "string", "value": TOKENS}),
    ("tokenizer.ggml.token_type", [2, 3, 3, 1, 1, 1, 1, 1, 6, 1], {"type": "array", "elem_type": "i32", "value": [2, 3, 3, 1, 1, 1, 1, 1, 6, 1]}),
    ("tokenizer.ggml.scores", [0.0, -1.5, 0.25], {"type": "array", "elem_type": "f32", "value": [0.0, -1.5, 0.25]}),
    ("qwen35.rope.dimension_sections", [11, 11, 10, 0], {"type": "array", "elem_type": "i32", "value": [11, 11, 10, 0]}),
    ("kestrel.test.bools", [True, False, True], {"type": "array", "elem_type": "bool", "value": [True, False, True]}),
    ("kestrel.test.bytes", b"\x00\x01\xfe\xff", {"type": "array", "elem_type": "u8", "value": [0, 1, 254, 255]}),
    ("kestrel.test.nested", [[1, 2, 3], [-4, 5]], {"type": "array", "elem_type": "array", "value": [
        {"type": "array", "elem_type": "i32", "value": [1, 2, 3]},
        {"type": "array", "elem_type": "i32", "value": [-4, 5]},
    ]}),
    # Arrays of arrays do not share an element type: each inner array names its own.
    ("kestrel.test.nested_mixed", [["x", "yz"], [1.5], [[7], [8, 9]]], {"type": "array", "elem_type": "array", "value": [
        {"type": "array", "elem_type": "string", "value": ["x", "yz"]},
        {"type": "array", "elem_type": "f32", "value": [1.5]},
        {"type": "array", "elem_type": "array", "value": [
            {"type": "array", "elem_type": "i32", "value": [7]},
            {"type": "array", "elem_type": "i32", "value": [8, 9]},
        ]},
    ]}),
]


def tensors(rng: np.random.Generator) -> list[tuple[str, np.ndarray, Q | None]]:
    """(name, array in row-major HF order or raw block bytes, raw ggml type or None)."""
    def raw_blocks(qtype: Q, rows: int, cols: int) -> np.ndarray:
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, size=(rows, cols // block_elems * block_bytes), dtype=np.uint8)

    q8_src = rng.standard_normal((4, 64)).astype(np.float32)
    bf16_src = rng.standard_normal((2, 8)).astype(np.float32)
    return [
        ("token_embd.weight", rng.standard_normal((10, 8)).astype(np.float32), None),
        ("output_norm.weight", rng.standard_normal(8).astype(np.float32), None),
        ("blk.0.attn_norm.weight", rng.standard_normal(8).astype(np.float32), None),
        ("blk.0.ffn_up.weight", rng.standard_normal((3, 16)).astype(np.float16), None),
        ("blk.0.ssm_conv1d.weight", rng.standard_normal((2, 3, 4)).astype(np.float32), None),
        ("blk.0.attn_gate.weight", gguf.quants.quantize(bf16_src, Q.BF16), Q.BF16),
        ("blk.0.attn_q.weight", gguf.quants.quantize(q8_src, Q.Q8_0), Q.Q8_0),
        ("blk.0.ffn_down.weight", raw_blocks(Q.Q4_K, 2, 256), Q.Q4_K),
        ("blk.1.ffn_gate.weight", raw_blocks(Q.IQ4_XS, 1, 256), Q.IQ4_XS),
        ("blk.1.ssm_out.weight", raw_blocks(Q.MXFP4, 2, 64), Q.MXFP4),
    ]


def write_tiny(path: Path, rng: np.random.Generator) -> None:
    w = gguf.GGUFWriter(path, ARCH)
    w.add_custom_alignment(ALIGNMENT)
    for key, adder, value, _ in SCALARS:
        if value == "":
            # add_string silently drops empty strings; an empty value is still a valid GGUF string.
            w.add_key_value(key, value, V.STRING)
        else:
            getattr(w, adder)(key, value)
    for key, value, _ in ARRAYS:
        w.add_array(key, value)
    for name, data, raw_dtype in tensors(rng):
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def describe(path: Path) -> dict:
    """What tiny.gguf holds, with tensor positions as gguf-py's reader finds them."""
    metadata = [
        {"key": "general.architecture", "type": "string", "value": ARCH},
        {"key": "general.alignment", "type": "u32", "value": ALIGNMENT},
    ]
    metadata += [{"key": k, "type": t, "value": v} for k, _, v, t in SCALARS]
    metadata += [{"key": k, **d} for k, _, d in ARRAYS]

    reader = gguf.GGUFReader(path)
    # Cross-check the reader against what was written before trusting its tensor offsets.
    assert set(reader.fields) == {m["key"] for m in metadata} | {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    assert reader.alignment == ALIGNMENT
    raw = reader.data
    listed = []
    for t in reader.tensors:
        start = int(t.data_offset)
        n_bytes = int(t.n_bytes)
        listed.append({
            "name": t.name,
            "ggml_type": int(t.tensor_type),
            "type_name": t.tensor_type.name,
            "ne": [int(x) for x in t.shape],
            "n_elements": int(t.n_elements),
            "offset": start - int(reader.data_offset),
            "data_offset": start,
            "n_bytes": n_bytes,
            "hex": bytes(raw[start:start + n_bytes]).hex(),
        })
    return {
        "generator": "gguf-py 0.19.0 (scripts/make_gguf_fixture.py)",
        "version": 3,
        "alignment": ALIGNMENT,
        "data_offset": int(reader.data_offset),
        "file_size": path.stat().st_size,
        "metadata": metadata,
        "tensors": listed,
        "ggml_quant_sizes": {str(int(q)): list(gguf.GGML_QUANT_SIZES[q]) for q in Q},
    }


def write_big_endian(path: Path) -> None:
    w = gguf.GGUFWriter(path, ARCH, endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("qwen35.block_count", 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/fixtures/gguf")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    tiny = args.out / "tiny.gguf"
    write_tiny(tiny, np.random.default_rng(20260615))
    assert tiny.stat().st_size < 20_000, tiny.stat().st_size
    (args.out / "tiny.json").write_text(json.dumps(describe(tiny), indent=1, ensure_ascii=False) + "\n")
    write_big_endian(args.out / "tiny-be.gguf")
    for p in sorted(args.out.iterdir()):
        print(f"{p}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
