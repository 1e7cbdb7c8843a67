#!/usr/bin/env python3
"""Convert the tiny HF fixtures to GGUF the way llama.cpp's converter does, for tests/gguf_models.rs.

Writes under tests/fixtures/gguf/:

  qwen35-dense.gguf    tests/fixtures/qwen35-dense (BF16 source -> BF16, with its MTP block)
  qwen35-moe.gguf      tests/fixtures/qwen35-moe   (F32 source -> F32, `--outtype f32`)
  qwen3-next.gguf      tests/fixtures/qwen3-next   (F16 source -> F16)
  qwen35-moe-quant.gguf  a random qwen35moe model with hidden size 256 (the HF fixtures' rows of
                       64 cannot hold a 256-element Q4_K block): Q4_K where a row is a whole
                       number of 256 blocks, Q8_0 where it is one of 32-blocks, F32/F16 elsewhere.

The float files use the converter's `--outtype auto` (`ModelBase.__init__` picks BF16 or F16
from the first 2-D tensor and defaults to F16) except qwen35-moe, an F32 checkpoint, which gets
`--outtype f32`: rounding its weights to F16 moves this random model's logits by 3e-3 and flips
an expert choice at prompt token 10 (measured), so the file could not be held to the HF
reference. `ModelBase.prepare_tensors` keeps 1-D tensors, `*_norm.weight`, the routers
(`ffn_gate_inp`, `ffn_gate_inp_shexp`), `ssm_conv1d` and tensors not named `*.weight` (`ssm_a`,
`ssm_dt.bias`) in F32 whatever the file type.

Every rename and transform mirrors a function of llama.cpp's converter (convert_hf_to_gguf.py,
split into conversion/qwen.py in later versions), named in the comments below. Two deviations,
both because the converter would refuse these tiny fixtures:
  - The tokenizer's pre-tokenizer name: `TextModel.get_vocab_base_pre` recognizes a tokenizer by
    the hash of its output on a test text, and this tiny BPE matches no known hash. Its
    tokenizer.json splits with the Qwen2 regex, which llama.cpp calls `qwen2`.
  - qwen3-next's layer 1 is a dense MLP (`mlp_only_layers: [1]`); gguf-py has no dense FFN names
    for arch qwen3next (`MODEL_TENSORS[QWEN3NEXT]` lacks FFN_GATE/UP/DOWN), so the converter stops
    there. This script names them `ffn_gate`/`ffn_up`/`ffn_down`, as every other arch does.

Run (the fixtures are committed; rerun only to change them):
  python3 -m pip install --target /tmp/gpy numpy gguf==0.19.0
  PYTHONPATH=/tmp/gpy python3 scripts/make_gguf_models.py [--out tests/fixtures/gguf]
"""

import argparse
import json
import struct
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

ARCHES = {
    "qwen3_5": gguf.MODEL_ARCH.QWEN35,
    "qwen3_5_text": gguf.MODEL_ARCH.QWEN35,
    "qwen3_5_moe": gguf.MODEL_ARCH.QWEN35MOE,
    "qwen3_5_moe_text": gguf.MODEL_ARCH.QWEN35MOE,
    "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT,
}


# ---------------------------------------------------------------------------------------------
# Reading the HF checkpoint

def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    data = raw[8 + header_len:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        chunk = data[start:end]
        if info["dtype"] == "BF16":
            # `ModelBase.prepare_tensors`: "convert any unsupported data types to float32".
            bits = np.frombuffer(chunk, dtype=np.uint16).astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif info["dtype"] == "F16":
            arr = np.frombuffer(chunk, dtype=np.float16)
        elif info["dtype"] == "F32":
            arr = np.frombuffer(chunk, dtype=np.float32)
        else:
            raise ValueError(f"{path}: {name} has dtype {info['dtype']}")
        out[name] = arr.reshape(info["shape"]).copy()
    return out


def load_hf(model_dir: Path) -> tuple[dict, dict[str, np.ndarray], str]:
    """The config, the tensors, and the file type `--outtype auto` would pick."""
    config = json.loads((model_dir / "config.json").read_text())
    index = model_dir / "model.safetensors.index.json"
    parts = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors: dict[str, np.ndarray] = {}
    source_dtypes = set()
    for part in parts:
        raw = (model_dir / part).read_bytes()
        (header_len,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + header_len])
        source_dtypes |= {v["dtype"] for k, v in header.items() if k != "__metadata__" and len(v["shape"]) >= 2}
        tensors.update(read_safetensors(model_dir / part))
    # `ModelBase.__init__` (ftype GUESSED): BF16 if the first 2-D tensor is bf16, F16 if it is f16,
    # else F16. The fixtures hold one dtype each.
    auto = "bf16" if source_dtypes == {"BF16"} else "f16"
    return config, tensors, auto


def merged_hparams(config: dict) -> dict:
    # `TextModel.__init__`: "move the text_config to the root level".
    return {**config, **config.get("text_config", {})}


# ---------------------------------------------------------------------------------------------
# Tensor transforms

def reorder_v_heads(t: np.ndarray, dim: int, num_k_heads: int, num_v_per_k: int, head_dim: int) -> np.ndarray:
    """`_LinearAttentionVReorderBase._reorder_v_heads`: value heads from grouped by key head
    [k0v0, k0v1, .., k1v0, ..] to tiled [k0v0, k1v0, .., k0v1, k1v1, ..] along `dim`."""
    shape = list(t.shape)
    dim %= len(shape)
    split = shape[:dim] + [num_k_heads, num_v_per_k, head_dim] + shape[dim + 1:]
    perm = list(range(len(split)))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return np.ascontiguousarray(t.reshape(split).transpose(perm)).reshape(shape)


def v_reorder(name: str, data: np.ndarray, hp: dict) -> np.ndarray:
    """`_LinearAttentionVReorderBase.modify_tensors` (Qwen3_5TextModel, Qwen3_5MoeTextModel)."""
    nk, nv = hp.get("linear_num_key_heads", 0), hp.get("linear_num_value_heads", 0)
    if not (nk > 0 and nv > 0 and nk != nv and "linear_attn." in name):
        return data
    dk, dv, r = hp["linear_key_head_dim"], hp["linear_value_head_dim"], nv // nk
    if ".in_proj_qkv." in name:
        qk = 2 * dk * nk
        return np.concatenate([data[:qk], reorder_v_heads(data[qk:], 0, nk, r, dv)], axis=0)
    if ".in_proj_z." in name:
        return reorder_v_heads(data, 0, nk, r, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return reorder_v_heads(data, 0, nk, r, 1)
    if ".A_log" in name or ".dt_bias" in name or ".dt_proj" in name:
        return reorder_v_heads(data[:, None], 0, nk, r, 1)[:, 0] if data.ndim == 1 else reorder_v_heads(data, -1, nk, r, 1)
    if ".conv1d" in name:
        data = data.squeeze()
        qk = 2 * dk * nk
        return np.concatenate([data[:qk], reorder_v_heads(data[qk:], 0, nk, r, dv)], axis=0)
    if ".out_proj." in name:
        return reorder_v_heads(data, 1, nk, r, dv)
    return data


def qwen3next_transform(name: str, data: np.ndarray, hp: dict) -> list[tuple[str, np.ndarray]]:
    """`Qwen3NextModel.modify_tensors` (also the tail of the Qwen3.5 classes). Arithmetic stays in
    the tensor's dtype, as torch's does: an f16 checkpoint gets `1 + w` and `-exp(A_log)` in f16."""
    if name.endswith(".A_log"):
        data = -np.exp(data)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        data = data.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        data = data + data.dtype.type(1)
    if "in_proj_qkvz.weight" in name:
        # "original order: [q, k, v, z] * head_count; corrected order: [q * head_count, k * head_count, ...]"
        dk, dv = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
        nk, nv = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
        sizes = [dk, dk, nv // nk * dv, nv // nk * dv]
        grouped = data.T.reshape(-1, nk, sum(sizes))
        q, k, v, z = np.split(grouped, np.cumsum(sizes)[:-1], axis=-1)
        flat = [np.ascontiguousarray(p).reshape(hp["hidden_size"], -1) for p in (q, k, v, z)]
        qkv = np.concatenate(flat[:3], axis=-1).T
        bid = name.split(".")[2]
        return [(f"model.layers.{bid}.linear_attn.in_proj_qkv.weight", np.ascontiguousarray(qkv)), (f"model.layers.{bid}.linear_attn.in_proj_z.weight", np.ascontiguousarray(flat[3].T))]
    return [(name, data)]


def mtp_rename(name: str, n_layer: int) -> str:
    """`_Qwen35MtpMixin.modify_tensors`: the MTP block becomes layer `n_layer` (block_count grows
    by `mtp_num_hidden_layers`), its own tensors take the nextn names."""
    if name.startswith("mtp.layers."):
        bid = int(name.split(".")[2])
        return name.replace(f"mtp.layers.{bid}", f"model.layers.{bid + n_layer}", 1)
    stem, _, suffix = name.rpartition(".")
    remap = {"mtp.fc": "eh_proj", "mtp.pre_fc_norm_embedding": "enorm", "mtp.pre_fc_norm_hidden": "hnorm", "mtp.norm": "shared_head.norm"}
    return f"model.layers.{n_layer}.{remap[stem]}.{suffix}"


NEXTN = {
    "eh_proj": gguf.MODEL_TENSOR.NEXTN_EH_PROJ,
    "enorm": gguf.MODEL_TENSOR.NEXTN_ENORM,
    "hnorm": gguf.MODEL_TENSOR.NEXTN_HNORM,
    "shared_head.norm": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM,
}
DENSE_FFN = {"gate_proj": gguf.MODEL_TENSOR.FFN_GATE, "up_proj": gguf.MODEL_TENSOR.FFN_UP, "down_proj": gguf.MODEL_TENSOR.FFN_DOWN}


def gguf_name(name: str, name_map: gguf.TensorNameMap) -> str:
    """`ModelBase.map_tensor_name`, with the two names gguf-py 0.19.0 cannot map for these archs
    (the nextn tensors, and qwen3-next's dense MLP; see the module docstring)."""
    mapped = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
    if mapped is not None:
        return mapped
    parts = name.split(".")
    bid = int(parts[2])
    inner = ".".join(parts[3:-1])
    if inner in NEXTN:
        return gguf.TENSOR_NAMES[NEXTN[inner]].format(bid=bid) + ".weight"
    if parts[3] == "mlp" and parts[4] in DENSE_FFN:
        return gguf.TENSOR_NAMES[DENSE_FFN[parts[4]]].format(bid=bid) + ".weight"
    raise ValueError(f"cannot map tensor {name}")


def hf_to_gguf_tensors(arch: gguf.MODEL_ARCH, hp: dict, tensors: dict[str, np.ndarray], fuse_gate_up: bool) -> list[tuple[str, np.ndarray]]:
    n_layer = hp["num_hidden_layers"]
    with_mtp = arch != gguf.MODEL_ARCH.QWEN3NEXT and hp.get("mtp_num_hidden_layers", 0) > 0
    block_count = n_layer + (hp["mtp_num_hidden_layers"] if with_mtp else 0)
    name_map = gguf.get_tensor_name_map(arch, block_count)
    out: list[tuple[str, np.ndarray]] = []
    experts: dict[int, dict[str, np.ndarray]] = {}
    for name, data in tensors.items():
        name = name.replace("model.language_model.", "model.", 1)
        if name.startswith("mtp."):
            if not with_mtp:
                continue  # `Qwen3NextModel`: "ignore MTP layers for now"
            name = mtp_rename(name, n_layer)
        if arch != gguf.MODEL_ARCH.QWEN3NEXT:
            data = v_reorder(name, data, hp)
        for name, data in qwen3next_transform(name, data, hp):
            # `Qwen2MoeModel.modify_tensors`: split the stacked gate_up_proj [E, 2I, H] into gate
            # and up [E, I, H]; stack per-expert tensors into one [E, .., ..] tensor per kind.
            if name.endswith("mlp.experts.gate_up_proj"):
                n_ff = data.shape[-2] // 2
                base = name.removesuffix(".gate_up_proj")
                out.append((f"{base}.gate_proj.weight", np.ascontiguousarray(data[..., :n_ff, :])))
                out.append((f"{base}.up_proj.weight", np.ascontiguousarray(data[..., n_ff:, :])))
            elif name.endswith("mlp.experts.down_proj"):
                out.append((f"{name}.weight", data))
            elif ".mlp.experts." in name:
                bid = int(name.split(".")[2])
                experts.setdefault(bid, {})[name] = data
                if len(experts[bid]) == hp["num_experts"] * 3:
                    for kind in ("down_proj", "gate_proj", "up_proj"):
                        stack = np.stack([experts[bid].pop(f"model.layers.{bid}.mlp.experts.{x}.{kind}.weight") for x in range(hp["num_experts"])])
                        out.append((f"model.layers.{bid}.mlp.experts.{kind}.weight", stack))
            else:
                out.append((name, data))
    assert not any(experts.values()), "unprocessed experts"
    mapped = [(gguf_name(n, name_map), d) for n, d in out]
    if fuse_gate_up:
        # `ModelBase.modify_tensors` with --fuse-gate-up-exps: gate and up concatenated on dim 1.
        by_name = dict(mapped)
        fused = []
        for n, d in mapped:
            if n.endswith("ffn_gate_exps.weight"):
                fused.append((n.replace("ffn_gate_exps", "ffn_gate_up_exps"), np.concatenate([d, by_name[n.replace("gate", "up")]], axis=1)))
            elif not n.endswith("ffn_up_exps.weight"):
                fused.append((n, d))
        mapped = fused
    return mapped


# ---------------------------------------------------------------------------------------------
# Storage types

ALWAYS_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def storage_type(name: str, data: np.ndarray, outtype: str) -> Q:
    """`ModelBase.prepare_tensors`: which tensors stay F32, and the file type for the rest."""
    if data.ndim <= 1 or name.endswith("_norm.weight") or name.endswith(ALWAYS_F32) or not name.endswith(".weight"):
        return Q.F32
    return {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16}[outtype]


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K blocks (gguf-py 0.19.0 has no Q4_K quantizer, only the dequantizer this is checked
    with): per 256 values, f16 d and dmin, eight 6-bit scales and mins packed in 12 bytes, and
    256 4-bit values; value = d * scale_j * q - dmin * min_j for sub-block j of 32."""
    blocks = rows.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(blocks.min(axis=-1), 0.0)
    hi = blocks.max(axis=-1)
    sub_scale = (hi - lo) / 15.0
    sub_min = -lo
    d = (sub_scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (sub_min.max(axis=-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(sub_scale, df, out=np.zeros_like(sub_scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(sub_min, dminf, out=np.zeros_like(sub_min), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    offset = (dminf * mn)[..., None]
    q = np.clip(np.round(np.divide(blocks + offset, step, out=np.zeros_like(blocks), where=step > 0)), 0, 15).astype(np.uint8)
    scales = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
    ], axis=-1)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)
    packed = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), scales, qs], axis=-1)
    return packed.reshape(*rows.shape[:-1], rows.shape[-1] // 256 * 144)


def quantized_type(name: str, data: np.ndarray) -> Q:
    """For the quantized fixture: Q4_K where a row is whole 256-blocks, else Q8_0 where it is
    whole 32-blocks, else what the float conversion keeps."""
    float_type = storage_type(name, data, "f16")
    if float_type == Q.F32:
        return Q.F32
    if data.shape[-1] % 256 == 0:
        return Q.Q4_K
    if data.shape[-1] % 32 == 0:
        return Q.Q8_0
    return Q.F16


def encode(data: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.Q4_K:
        packed = quantize_q4_k(data)
        back = gguf.quants.dequantize(packed, Q.Q4_K)
        span = float(data.max() - data.min())
        assert np.abs(back - data).max() <= span / 15, "Q4_K round trip is off"
        return packed
    return gguf.quants.quantize(data.astype(np.float32) if qtype != Q.F16 else data, qtype)


# ---------------------------------------------------------------------------------------------
# Metadata

def set_parameters(w: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, hp: dict, block_count: int, ftype: int) -> None:
    """`TextModel.set_gguf_parameters`, `Qwen2MoeModel.set_gguf_parameters` and
    `Qwen3NextModel.set_gguf_parameters` (the Qwen3.5 classes inherit the last)."""
    w.add_block_count(block_count)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    if "intermediate_size" in hp:
        w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope = hp.get("rope_parameters") or {}
    if "mrope_section" in rope:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0, 0, 0, 0])[:4])
    w.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta")))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if "num_experts" in hp:
        w.add_expert_count(hp["num_experts"])
        w.add_expert_used_count(hp["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        if "shared_expert_intermediate_size" in hp:
            w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_file_type(ftype)
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hp["linear_key_head_dim"])
    w.add_ssm_group_count(hp["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    w.add_full_attention_interval(hp.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(hp["head_dim"] * hp.get("partial_rotary_factor", 0.25)))
    if block_count > hp["num_hidden_layers"]:
        # `_Qwen35MtpMixin.set_gguf_parameters`.
        w.add_uint32(gguf.Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=gguf.MODEL_ARCH_NAMES[arch]), block_count - hp["num_hidden_layers"])


def set_vocab(w: gguf.GGUFWriter, tokenizer_dir: Path, vocab_size: int) -> None:
    """`TextModel._set_vocab_gpt2` / `get_vocab_base`: every id below vocab_size, added tokens
    CONTROL when special or spelled `<|...|>` and USER_DEFINED otherwise, ids without a token as
    UNUSED `[PAD{i}]`; merges, special ids and the chat template via gguf-py's SpecialVocab."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    added = {t["id"]: t for t in tok["added_tokens"]}
    reverse = {i: s for s, i in tok["model"]["vocab"].items()}
    reverse.update({i: t["content"] for i, t in added.items()})
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            t = added[i]
            special = t["special"] or (t["content"].startswith("<|") and t["content"].endswith("|>"))
            tokens.append(t["content"])
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(tokenizer_dir, load_merges=True).add_to_gguf(w, quiet=True)


def write(path: Path, arch: gguf.MODEL_ARCH, hp: dict, tensors: list[tuple[str, np.ndarray]], types: dict[str, Q], tokenizer_dir: Path, name: str, ftype: int) -> None:
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(name)
    block_count = max(int(n.split(".")[1]) for n, _ in tensors if n.startswith("blk.")) + 1
    set_parameters(w, arch, hp, block_count, ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    set_vocab(w, tokenizer_dir, hp["vocab_size"])
    for n, d in tensors:
        qtype = types[n]
        w.add_tensor(n, encode(d, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{path}: {path.stat().st_size} bytes, {len(tensors)} tensors")


def convert_fixture(fixture: str, out: Path, outtype: str | None) -> None:
    model_dir = FIXTURES / fixture
    config, tensors, auto = load_hf(model_dir)
    outtype = outtype or auto
    hp = merged_hparams(config)
    arch = ARCHES[config["model_type"]]
    converted = hf_to_gguf_tensors(arch, hp, tensors, fuse_gate_up=False)
    types = {n: storage_type(n, d, outtype) for n, d in converted}
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype]
    write(out / f"{fixture}.gguf", arch, hp, converted, types, model_dir, fixture, ftype)


# ---------------------------------------------------------------------------------------------
# The quantized fixture: a random qwen35moe checkpoint in HF naming, converted like the others.

QUANT_CONFIG = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 2,
    "full_attention_interval": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4, "num_experts": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "partial_rotary_factor": 0.25, "rope_parameters": {"rope_theta": 10000000.0, "mrope_section": [2, 1, 1]},
    "tie_word_embeddings": True,
}


def random_checkpoint(hp: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, e, i, s = hp["hidden_size"], hp["num_experts"], hp["moe_intermediate_size"], hp["shared_expert_intermediate_size"]
    nk, nv, dk, dv = hp["linear_num_key_heads"], hp["linear_num_value_heads"], hp["linear_key_head_dim"], hp["linear_value_head_dim"]
    hd, nh, nkv = hp["head_dim"], hp["num_attention_heads"], hp["num_key_value_heads"]
    conv_dim = 2 * nk * dk + nv * dv

    def mat(rows: int, cols: int, *lead: int) -> np.ndarray:
        return (rng.standard_normal((*lead, rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": rng.standard_normal((hp["vocab_size"], h)).astype(np.float32), "model.norm.weight": norm(h)}
    for layer in range(hp["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        if (layer + 1) % hp["full_attention_interval"] != 0:
            la = p + "linear_attn."
            t[la + "in_proj_qkv.weight"] = mat(conv_dim, h)
            t[la + "in_proj_z.weight"] = mat(nv * dv, h)
            t[la + "in_proj_b.weight"] = mat(nv, h)
            t[la + "in_proj_a.weight"] = mat(nv, h)
            t[la + "conv1d.weight"] = (0.3 * rng.standard_normal((conv_dim, 1, hp["linear_conv_kernel_dim"]))).astype(np.float32)
            t[la + "dt_bias"] = rng.standard_normal(nv).astype(np.float32)
            t[la + "A_log"] = np.log(rng.uniform(1, 16, nv)).astype(np.float32)
            t[la + "norm.weight"] = (1 + norm(dv)).astype(np.float32)
            t[la + "out_proj.weight"] = mat(h, nv * dv)
        else:
            sa = p + "self_attn."
            t[sa + "q_proj.weight"] = mat(2 * nh * hd, h)
            t[sa + "k_proj.weight"] = mat(nkv * hd, h)
            t[sa + "v_proj.weight"] = mat(nkv * hd, h)
            t[sa + "o_proj.weight"] = mat(h, nh * hd)
            t[sa + "q_norm.weight"] = norm(hd)
            t[sa + "k_norm.weight"] = norm(hd)
        t[p + "mlp.gate.weight"] = mat(e, h)
        t[p + "mlp.experts.gate_up_proj"] = mat(2 * i, h, e)
        t[p + "mlp.experts.down_proj"] = mat(h, i, e)
        t[p + "mlp.shared_expert.gate_proj.weight"] = mat(s, h)
        t[p + "mlp.shared_expert.up_proj.weight"] = mat(s, h)
        t[p + "mlp.shared_expert.down_proj.weight"] = mat(h, s)
        t[p + "mlp.shared_expert_gate.weight"] = mat(1, h)
    return t


def quantized_fixture(out: Path) -> None:
    hp = merged_hparams(QUANT_CONFIG)
    arch = gguf.MODEL_ARCH.QWEN35MOE
    # The fused expert layout (`--fuse-gate-up-exps`) here; the float fixtures keep them apart.
    converted = hf_to_gguf_tensors(arch, hp, random_checkpoint(hp, seed=35), fuse_gate_up=True)
    types = {n: quantized_type(n, d) for n, d in converted}
    write(out / "qwen35-moe-quant.gguf", arch, hp, converted, types, FIXTURES / "qwen35-dense", "qwen35-moe-quant", gguf.LlamaFileType.MOSTLY_Q4_K_M)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=FIXTURES / "gguf")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for fixture, outtype in (("qwen35-dense", None), ("qwen35-moe", "f32"), ("qwen3-next", None)):
        convert_fixture(fixture, args.out, outtype)
    quantized_fixture(args.out)


if __name__ == "__main__":
    main()
