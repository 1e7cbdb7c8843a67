#!/usr/bin/env python3
"""Train Kestrel's embedded default model, `kestrel-coder`: a small Qwen3.5-architecture
(hybrid Gated-DeltaNet 3 : 1 gated full attention) Python code model with one MTP module, exported
with int4 weights.

Runs on one H100 in about 25 minutes, including corpus building, export and evaluation. Everything is
seeded; the corpus is whatever Python source the machine has (the standard library and site-packages of
the running interpreter), so a different machine gives a different model.

  python3 scripts/train_default_model.py --out models/kestrel-coder --fla FLA_DIR \
      --tokenizer models/kestrel-coder/tokenizer.json --baseline OLD_MODEL_DIR

Steps
  1. corpus: every *.py under the interpreter's stdlib and site-packages, deduplicated by content
     hash (sha1), files > 1 MB or not UTF-8 dropped; held out BY FILE: sha1 % 100 == 0 (1 %).
  2. tokenizer: byte-level BPE (HF tokenizers, Qwen2-style pre-tokenizer regex), 8192 tokens incl.
     <|endoftext|> (id 0, document separator), <|im_start|> (1), <|im_end|> (2), trained on a seeded
     sample of the train split; or an earlier model's tokenizer.json reused (`--tokenizer`).
  3. model: transformers' Qwen3_5ForCausalLM (tied embeddings) + one MTP module built from
     transformers' own Qwen3_5DecoderLayer / Qwen3_5RMSNorm / rotary embedding, trained jointly:
     loss = CE(main, t+1) + 0.5 * CE(mtp, t+2); h is NOT detached (MTP gradients reach the trunk).
     MTP: x = mtp.fc(cat[RMSNorm1p(embed(tok_{t+1})), RMSNorm1p(h_t)]) with h_t the final-normed
     hidden state, one full-attention decoder layer at the positions of t, logits =
     lm_head(RMSNorm1p(x; mtp.norm)). With `--fla DIR` the delta rule runs on flash-linear-attention's
     Triton kernels while training (checked against transformers' pure-torch rule first).
  4. int4: round-to-nearest and GPTQ over every linear but the delta rule's gate projections
     (asymmetric, groups of 128 inputs), the one with the lower held-out loss exported in GPTQ
     tensors (auto-round's `auto_round` packing) beside BF16 embedding and norms.
  5. evaluation from the EXPORTED file read back and dequantized in float32 (eval.json, README.md,
     loss.png, heldout.txt), and of `--baseline` on the same held-out data.
"""

import argparse
import copy
import hashlib
import json
import math
import os
import random
import shutil
import site
import sys
import sysconfig
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import transformers
import transformers.models.qwen3_5.modeling_qwen3_5 as q35
from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import SPECIALS, build_tokenizer, tokenizer_config  # noqa: E402

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# --------------------------------------------------------------------------------------------
# corpus


def python_roots():
    paths = sysconfig.get_paths()
    roots = {paths["stdlib"], paths["purelib"], paths["platlib"]}
    try:
        roots |= set(site.getsitepackages())
    except AttributeError:
        pass
    return sorted(r for r in roots if os.path.isdir(r))


def read_corpus(roots, max_file_bytes):
    seen_paths, seen_hash = set(), set()
    docs, n_files, n_dup, n_skip = [], 0, 0, 0
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for fn in sorted(filenames):
                if not fn.endswith(".py"):
                    continue
                p = os.path.realpath(os.path.join(dirpath, fn))
                if p in seen_paths:
                    continue
                seen_paths.add(p)
                n_files += 1
                try:
                    size = os.path.getsize(p)
                    if size == 0 or size > max_file_bytes:
                        n_skip += 1
                        continue
                    with open(p, "rb") as f:
                        b = f.read()
                except OSError:
                    n_skip += 1
                    continue
                h = hashlib.sha1(b).hexdigest()
                if h in seen_hash:
                    n_dup += 1
                    continue
                try:
                    t = b.decode("utf-8")
                except UnicodeDecodeError:
                    n_skip += 1
                    continue
                seen_hash.add(h)
                docs.append((h, t.replace("\r\n", "\n")))
    docs.sort()  # by content hash: independent of file-system order
    return docs, dict(files_seen=n_files, duplicates=n_dup, skipped=n_skip)


def is_heldout(h):
    return int(h[:8], 16) % 100 == 0


def tokenize_docs(tok, texts, eot, batch=4096):
    """Concatenate docs, each followed by <|endoftext|>, into one int32 stream."""
    parts = []
    enc = getattr(tok, "encode_batch_fast", tok.encode_batch)
    for i in range(0, len(texts), batch):
        for e in enc(texts[i:i + batch], add_special_tokens=False):
            parts.append(np.asarray(e.ids, dtype=np.int32))
            parts.append(np.array([eot], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


# --------------------------------------------------------------------------------------------
# model


class MTP(nn.Module):
    """Qwen3.5 multi-token-prediction module; state-dict names match real checkpoints' mtp.*."""

    def __init__(self, config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        c = copy.deepcopy(config)
        c.layer_types = ["full_attention"]
        c.num_hidden_layers = 1
        self.pre_fc_norm_embedding = q35.Qwen3_5RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = q35.Qwen3_5RMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([q35.Qwen3_5DecoderLayer(c, 0)])
        self.norm = q35.Qwen3_5RMSNorm(H, eps=eps)

    def forward(self, emb_next, h, position_embeddings):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(h)], dim=-1))
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)


def mtp_hidden(model, mtp, ids, h):
    """Rows t = 0..T-2 of `ids` [B, T]: MTP fed (h_t, ids[t+1]); returns mtp-normed states [B, T-1, H]."""
    B, T = ids.shape
    e = model.model.embed_tokens(ids[:, 1:])
    pos = torch.arange(T - 1, device=ids.device).view(1, 1, -1).expand(3, B, -1)
    cos_sin = model.model.rotary_emb(h, pos)
    return mtp(e, h[:, :-1], cos_sin)


def losses(model, mtp, x):
    """x [B, T+1]. Main predicts x[t+1] at rows 0..T-1; MTP predicts x[t+2] at rows 0..T-2."""
    inp = x[:, :-1]
    h = model.model(input_ids=inp, use_cache=False).last_hidden_state
    logits = model.lm_head(h)
    V = logits.shape[-1]
    loss_main = F.cross_entropy(logits.float().reshape(-1, V), x[:, 1:].reshape(-1))
    m = mtp_hidden(model, mtp, x[:, :-1], h)  # rows 0..T-2 -> targets x[2..T]
    mlogits = model.lm_head(m)
    loss_mtp = F.cross_entropy(mlogits.float().reshape(-1, V), x[:, 2:].reshape(-1))
    acc_mtp = (mlogits.argmax(-1) == x[:, 2:]).float().mean()
    return loss_main, loss_mtp, acc_mtp


def _chunk_gdn_fp32(*args, **kwargs):
    # keep the pure-torch chunked GDN maths in fp32 under bf16 autocast (inference runs it in fp32)
    with torch.autocast("cuda", enabled=False):
        return _ORIG_CHUNK(*args, **kwargs)


_ORIG_CHUNK = q35.torch_chunk_gated_delta_rule


def set_chunk_delta_rule(model, fn):
    """Points `model`'s delta-rule layers at `fn`; returns how many there are. transformers versions
    differ: some call the module-level function, some bind it on each layer at construction."""
    q35.torch_chunk_gated_delta_rule = fn
    n = 0
    for m in model.modules():
        if type(m).__name__.endswith("GatedDeltaNet"):
            n += 1
            if hasattr(m, "chunk_gated_delta_rule"):
                m.chunk_gated_delta_rule = fn
    return n


def use_fla_delta_rule(model, fla_dir, device):
    """Trains with flash-linear-attention's Triton chunked delta rule (forward and backward), after
    checking it against transformers' own pure-torch one on random inputs (values and gradients):
    the pure-torch rule runs Python loops per chunk and took most of the step time."""
    sys.path.insert(0, fla_dir)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    calls = [0]

    def fla_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):
        calls[0] += 1
        return fla_chunk(query, key, value, g=g.float(), beta=beta, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    cfg = model.config
    hk, hv, d = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim
    gen = torch.Generator(device=device).manual_seed(7)
    B, T = 2, 200  # T not a multiple of the chunk

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    q, k, v = rand(B, T, hk, d), rand(B, T, hk, d), rand(B, T, hv, d)
    g = -F.softplus(rand(B, T, hv)) * 0.5
    beta = torch.sigmoid(rand(B, T, hv))
    w = rand(B, T, hv, d)
    errs = {}
    grads = {}
    for name, fn in (("torch", _ORIG_CHUNK), ("fla", fla_rule)):
        ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        rep = hv // hk
        qq, kk = ins[0].repeat_interleave(rep, dim=2), ins[1].repeat_interleave(rep, dim=2)
        o = fn(qq, kk, ins[2], g=ins[3], beta=ins[4], use_qk_l2norm_in_kernel=True)[0]
        (o.float() * w).sum().backward()
        grads[name] = [o.detach().float()] + [t.grad.float() for t in ins]
    for name, a, b in zip(("out", "dq", "dk", "dv", "dg", "dbeta"), grads["torch"], grads["fla"]):
        errs[name] = ((a - b).abs().max() / a.abs().max().clamp(min=1e-12)).item()
    worst = max(errs.values())
    if not worst < 2e-2:
        raise RuntimeError(f"fla's delta rule differs from transformers' (max relative error {errs})")
    calls[0] = 0
    n = set_chunk_delta_rule(model, fla_rule)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=(device == "cuda")):
        model(input_ids=torch.zeros(1, 70, dtype=torch.long, device=device), use_cache=False)
    if calls[0] != n:
        raise RuntimeError(f"the fla delta rule ran in {calls[0]} of {n} layers: this transformers version calls it elsewhere")
    return f"flash-linear-attention's Triton kernels ({n} layers; against the pure-torch rule: " + \
        ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + ")"


# --------------------------------------------------------------------------------------------
# int4 export: asymmetric 4-bit groups along the inputs, GPTQ tensor layout with zero points
# stored as they are (auto-round's `auto_round` packing), scales in f16


def quantized_linears(model, mtp):
    """Export names (`...weight`) of the linears stored in int4 -> module. The delta rule's tiny
    gate projections (in_proj_a / in_proj_b, one output per value head) stay bf16, as published
    int4 checkpoints keep them."""
    out = {}
    for prefix, root in (("", model), ("mtp.", mtp)):
        for n, m in root.named_modules():
            if isinstance(m, nn.Linear) and n != "lm_head" and not n.endswith(("in_proj_a", "in_proj_b")):
                out[f"{prefix}{n}.weight"] = m
    return out


def export_bytes_estimate(model, mtp, group):
    q = {id(m.weight) for m in quantized_linears(model, mtp).values()}
    total = 0
    for p in list(model.parameters()) + list(mtp.parameters()):
        if id(p) in q:
            o, i = p.shape
            total += o * i // 2 + (i // group) * o * 2 + (i // group) * o // 2
        else:
            total += p.numel() * 2
    return total


def int4_group_params(w):
    """Scale (f16-representable) and zero point of each row of `w` [rows, group]: the range is
    stretched to include 0, as GPTQ's asymmetric quantizer does."""
    lo = w.min(1, keepdim=True).values.clamp(max=0)
    hi = w.max(1, keepdim=True).values.clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=6.2e-5).half().float()
    zero = torch.round(-lo / scale).clamp(0, 15)
    return scale, zero


def int4_rtn(W, group):
    """Round to nearest: codes [out, in], scales and zeros [out, in / group]."""
    o, i = W.shape
    Wg = W.float().reshape(o, i // group, group)
    lo = Wg.min(2).values.clamp(max=0)
    hi = Wg.max(2).values.clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=6.2e-5).half().float()
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.clamp(torch.round(Wg / scale[..., None]) + zero[..., None], 0, 15)
    return q.reshape(o, i), scale, zero


def int4_gptq(W, H, group, percdamp=0.01):
    """GPTQ (Frantar et al. 2022): columns quantized in order, each one's rounding error spread over
    the columns not yet quantized through the inverse Hessian of the layer's inputs (H = sum x x^T
    over calibration tokens). Groups are the blocks, so each group's scale is fitted to its updated
    weights."""
    W = W.float().clone()
    o, n = W.shape
    H = H.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(n, device=H.device, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    Q = torch.zeros_like(W)
    scales, zeros = [], []
    for i1 in range(0, n, group):
        i2 = i1 + group
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        Hi = Hinv[i1:i2, i1:i2]
        scale, zero = int4_group_params(W1)
        scales.append(scale[:, 0])
        zeros.append(zero[:, 0])
        for c in range(group):
            w = W1[:, c]
            q = torch.clamp(torch.round(w / scale[:, 0]) + zero[:, 0], 0, 15)
            Q[:, i1 + c] = q
            err = (w - (q - zero[:, 0]) * scale[:, 0]) / Hi[c, c]
            W1[:, c:] -= err[:, None] * Hi[c, c:][None, :]
            E1[:, c] = err
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    return Q, torch.stack(scales, 1), torch.stack(zeros, 1)


def int4_dequant(q, scale, zero, group):
    o, i = q.shape
    return ((q.reshape(o, i // group, group) - zero[..., None]) * scale[..., None]).reshape(o, i)


def pack_gptq(q, scale, zero):
    """GPTQ tensors of one linear: qweight int32 [in/8, out] (input 8r+j in bits 4j), qzeros int32
    [groups, out/8] (output 8c+j in bits 4j), scales f16 [groups, out]."""
    qt = q.to(torch.int64).t().contiguous()
    words = torch.zeros(qt.shape[0] // 8, qt.shape[1], dtype=torch.int64, device=q.device)
    for j in range(8):
        words |= qt[j::8] << (4 * j)
    zt = zero.to(torch.int64).t().contiguous()
    zwords = torch.zeros(zt.shape[0], zt.shape[1] // 8, dtype=torch.int64, device=q.device)
    for j in range(8):
        zwords |= zt[:, j::8] << (4 * j)
    as_i32 = lambda x: ((x + 2**31) % 2**32 - 2**31).to(torch.int32).cpu().contiguous()  # noqa: E731
    return {"qweight": as_i32(words), "qzeros": as_i32(zwords), "scales": scale.t().contiguous().half().cpu()}


def unpack_gptq(qweight, qzeros, scales, group):
    """The float weight [out, in] a loader reads from GPTQ tensors (zeros as stored)."""
    w = qweight.to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(w >> (4 * j)) & 15 for j in range(8)], dim=1).reshape(-1, w.shape[1])  # [in, out]
    z = qzeros.to(torch.int64) & 0xFFFFFFFF
    z = torch.stack([(z >> (4 * j)) & 15 for j in range(8)], dim=2).reshape(z.shape[0], -1)  # [groups, out]
    g = torch.arange(q.shape[0]) // group
    return ((q - z[g]).float() * scales.float()[g]).t().contiguous()


@torch.no_grad()
def input_hessians(model, mtp, linears, batches, device, forward=None):
    """H = sum over calibration tokens of x x^T for each linear's input x (float32), from running
    `forward(model, mtp, batch)` (the training losses by default) over the batches."""
    forward = forward or losses
    hs, hooks = {}, []
    for name, m in linears.items():
        def hook(mod, inp, out, name=name):
            x = inp[0].reshape(-1, inp[0].shape[-1]).float()
            hs[name] = hs.get(name, 0) + x.t() @ x
        hooks.append(m.register_forward_hook(hook))
    for x in batches:
        forward(model, mtp, x.to(device))
    for h in hooks:
        h.remove()
    return hs


def load_int4_reference(path, cfg, group, device):
    """The exported file read back as a loader reads it, in float32: transformers' model and our MTP
    module with every int4 linear dequantized from its packed tensors."""
    sd = load_file(path)
    dense = {}
    for k, v in sd.items():
        if k.endswith(".qweight"):
            m = k[: -len(".qweight")]
            dense[m + ".weight"] = unpack_gptq(v, sd[m + ".qzeros"], sd[m + ".scales"], group)
        elif not k.endswith((".qzeros", ".scales")):
            dense[k] = v.float()
    ref = Qwen3_5ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    missing, unexpected = ref.load_state_dict({k: v for k, v in dense.items() if not k.startswith("mtp.")}, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    ref.lm_head.weight = ref.model.embed_tokens.weight
    ref_mtp = MTP(ref.config)
    ref_mtp.load_state_dict({k[4:]: v for k, v in dense.items() if k.startswith("mtp.")})
    ref, ref_mtp = ref.to(device).eval(), ref_mtp.to(device).eval()
    set_chunk_delta_rule(ref, _ORIG_CHUNK)
    return ref, ref_mtp


def load_float_reference(model_dir):
    """A float checkpoint directory (the earlier default model) on the CPU in float32: transformers'
    model and our MTP module."""
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    set_chunk_delta_rule(model, _ORIG_CHUNK)
    mtp = MTP(model.config)
    mtp.load_state_dict({k[4:]: v.float() for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()
                         if k.startswith("mtp.")})
    return model, mtp.eval()


def count_params(model, mtp):
    n_main = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    n_mtp = sum(p.numel() for p in mtp.parameters())
    return n_main, n_mtp


# --------------------------------------------------------------------------------------------
# evaluation (float32, from the exported weights)


@torch.no_grad()
def window_nll(model, ids_1d, win, device, batch=64):
    """Mean NLL over non-overlapping windows of `win` tokens, each from empty state."""
    n = len(ids_1d)
    wins = [ids_1d[i:i + win] for i in range(0, n, win)]
    wins = [w for w in wins if len(w) >= 2]
    tot, cnt = 0.0, 0
    full = [w for w in wins if len(w) == win]
    rest = [w for w in wins if len(w) != win]
    for group in ([full[i:i + batch] for i in range(0, len(full), batch)] + [[w] for w in rest]):
        x = torch.tensor(np.stack(group), dtype=torch.long, device=device)
        logits = model(input_ids=x, use_cache=False).logits.float()
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        tot += nll.item()
        cnt += x[:, 1:].numel()
    return tot / cnt, cnt, len(wins)


@torch.no_grad()
def heldout_eval_f32(model, mtp, stream, win, device, batch=32):
    """Main NLL and MTP (t+2) top-1 / NLL over the whole held-out stream, non-overlapping windows."""
    n = (len(stream) - 1) // win
    tot, cnt, mtot, mhit, mcnt = 0.0, 0, 0.0, 0, 0
    for i in range(0, n, batch):
        rows = [stream[j * win:(j + 1) * win + 1] for j in range(i, min(n, i + batch))]
        x = torch.tensor(np.stack(rows), dtype=torch.long, device=device)
        h = model.model(input_ids=x[:, :-1], use_cache=False).last_hidden_state
        logits = model.lm_head(h).float()
        V = logits.shape[-1]
        tot += F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1), reduction="sum").item()
        cnt += x[:, 1:].numel()
        ml = model.lm_head(mtp_hidden(model, mtp, x[:, :-1], h)).float()
        mtot += F.cross_entropy(ml.reshape(-1, V), x[:, 2:].reshape(-1), reduction="sum").item()
        mhit += (ml.argmax(-1) == x[:, 2:]).sum().item()
        mcnt += x[:, 2:].numel()
    return tot / cnt, cnt, mtot / mcnt, mhit / mcnt


def self_agreement_prompts(tok, held_docs, seed, count=32):
    """`count` held-out prefixes of 96 tokens from random points of held-out files (seeded by the
    training run's seed + 2, so the distillation stage scores the same prompts)."""
    prng = random.Random(seed + 2)
    cands = [t for _, t in held_docs]
    prng.shuffle(cands)
    prompts = []
    for t in cands:
        ids = tok.encode(t, add_special_tokens=False).ids
        if len(ids) >= 256:
            cut = prng.randint(96, len(ids) - 1)
            prompts.append(np.asarray(ids[cut - 96:cut], dtype=np.int64))
        if len(prompts) == count:
            break
    return prompts


@torch.no_grad()
def greedy_continuations(model, prompts, n_new, eot):
    """prompts [B, P] -> [B, P + n_new]: HF generate, greedy, cached, no end token."""
    gc = GenerationConfig(do_sample=False, max_new_tokens=n_new, eos_token_id=None, pad_token_id=eot, use_cache=True)
    model.generation_config.eos_token_id = None
    seq = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=gc)
    assert seq.shape[1] == prompts.shape[1] + n_new, seq.shape
    return seq


@torch.no_grad()
def mtp_self_agreement(model, mtp, prompts, n_new, eot, device):
    ids = torch.tensor(np.stack(prompts), dtype=torch.long, device=device)
    P = ids.shape[1]
    seq = greedy_continuations(model, ids, n_new, eot)
    h = model.model(input_ids=seq, use_cache=False).last_hidden_state
    pred = model.lm_head(mtp_hidden(model, mtp, seq, h)).argmax(-1)  # row t predicts seq[t+2]
    rows = torch.arange(P - 1, P + n_new - 2, device=device)  # t+1 and t+2 both generated
    hit = (pred[:, rows] == seq[:, rows + 2]).float()
    return hit.mean().item(), hit.numel(), hit.mean(0).tolist()


# --------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="models/kestrel-coder")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tok-sample-mb", type=float, default=24.0)
    ap.add_argument("--max-file-bytes", type=int, default=1_000_000)
    ap.add_argument("--tokenizer", default="", help="reuse this tokenizer.json instead of training one "
                    "(keeps per-token figures comparable with an earlier model)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=1280)
    ap.add_argument("--heads", type=int, default=8, help="full-attention query heads (head_dim 64)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--gdn-key-heads", type=int, default=4, help="delta-rule key heads (dk 64)")
    ap.add_argument("--gdn-value-heads", type=int, default=8, help="delta-rule value heads (dv 64)")
    ap.add_argument("--group-size", type=int, default=128, help="int4 group size of the exported linears")
    ap.add_argument("--max-file-mb", type=float, default=30.0, help="limit on the exported model.safetensors")
    ap.add_argument("--fla", default="", help="folder holding the flash-linear-attention package `fla`: its "
                    "Triton delta-rule kernels replace transformers' pure-torch one while training")
    ap.add_argument("--baseline", default="", help="an earlier model folder, scored on the same held-out data")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--max-train-seconds", type=float, default=1020.0,
                    help="time budget of the train loop: the learning-rate schedule follows whichever of steps and "
                         "time is further along, so a slower machine still ends on a decayed rate")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--compile", action="store_true", help="torch.compile the loss (compiling took > 4 min on an H100: off)")
    ap.add_argument("--max-docs", type=int, default=0, help="debug: cap the number of documents")
    args = ap.parse_args()

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, python {sys.version.split()[0]}, "
        f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    os.makedirs(args.out, exist_ok=True)

    # ---- corpus
    roots = python_roots()
    log("corpus roots:", roots)
    docs, cstats = read_corpus(roots, args.max_file_bytes)
    if args.max_docs:
        docs = docs[: args.max_docs]
    train_docs = [t for h, t in docs if not is_heldout(h)]
    held_docs = [(h, t) for h, t in docs if is_heldout(h)]
    n_bytes = sum(len(t.encode()) for _, t in docs)
    log(f"corpus: {len(docs)} unique files ({cstats}), {n_bytes / 1e6:.1f} MB; "
        f"train {len(train_docs)} files, held-out {len(held_docs)} files")

    # ---- tokenizer
    if args.tokenizer:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(args.tokenizer)
        V = tok.get_vocab_size()
        eot = tok.token_to_id("<|endoftext|>")
        log(f"tokenizer: vocab {V}, reused from {args.tokenizer}; specials", {t: tok.token_to_id(t) for t in SPECIALS})
    else:
        rng = random.Random(args.seed)
        order = list(range(len(train_docs)))
        rng.shuffle(order)
        sample, sb = [], 0
        for i in order:
            if sb >= args.tok_sample_mb * 1e6:
                break
            sample.append(train_docs[i])
            sb += len(train_docs[i])
        tok = build_tokenizer(sample, args.vocab)
        V = tok.get_vocab_size()
        eot = tok.token_to_id("<|endoftext|>")
        log(f"tokenizer: vocab {V}, trained on {len(sample)} files / {sb / 1e6:.1f} MB; specials",
            {t: tok.token_to_id(t) for t in SPECIALS})
    tok_path = os.path.join(args.out, "tokenizer.json")
    if args.tokenizer and os.path.realpath(args.tokenizer) != os.path.realpath(tok_path):
        shutil.copyfile(args.tokenizer, tok_path)
    elif not args.tokenizer:
        tok.save(tok_path)
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config("<|endoftext|>"), f, indent=2)

    # ---- token streams
    train_order = list(range(len(train_docs)))
    random.Random(args.seed + 1).shuffle(train_order)
    train_stream = tokenize_docs(tok, [train_docs[i] for i in train_order], eot)
    held_stream = tokenize_docs(tok, [t for _, t in held_docs], eot)
    held_bytes = sum(len(t.encode()) for _, t in held_docs)
    n_tokens = len(train_stream) + len(held_stream)
    log(f"tokens: train {len(train_stream):,}, held-out {len(held_stream):,}, total {n_tokens:,} "
        f"({n_bytes / n_tokens:.2f} bytes/token)")

    # heldout.txt: whole held-out files, 40-60 KB, "\n"-separated
    picked, hb = [], 0
    for h, t in held_docs:
        if 1000 <= len(t.encode()) <= 12000:
            picked.append(t)
            hb += len(t.encode()) + 1
            if hb >= 48000:
                break
    heldout_txt = "\n".join(picked)
    with open(os.path.join(args.out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write(heldout_txt)
    log(f"heldout.txt: {len(picked)} files, {len(heldout_txt.encode())} bytes")

    # ---- model
    T, B = args.seq, args.batch
    cfg = Qwen3_5TextConfig(
        vocab_size=V, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=64,
        linear_num_key_heads=args.gdn_key_heads, linear_num_value_heads=args.gdn_value_heads,
        linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096,
        layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(args.layers)],
        tie_word_embeddings=True, eos_token_id=eot, pad_token_id=eot, bos_token_id=None,
        # head_dim 64 * 0.25 = 16 rotary dims = 8 frequencies = mrope_section 3 + 3 + 2
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    )
    model = Qwen3_5ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).to(device)
    mtp = MTP(model.config).to(device)
    with torch.no_grad():
        for mod in mtp.modules():
            if isinstance(mod, nn.Linear):
                mod.weight.normal_(0.0, cfg.initializer_range)
    n_main, n_mtp = count_params(model, mtp)
    est = export_bytes_estimate(model, mtp, args.group_size)
    log(f"params: main {n_main:,} (embedding {V * args.hidden:,}, tied), mtp {n_mtp:,}, total {n_main + n_mtp:,} "
        f"-> int4 export about {est / 1e6:.2f} MB")
    assert est < args.max_file_mb * 1e6, f"the int4 export would be about {est / 1e6:.1f} MB, over {args.max_file_mb} MB"
    gdn_impl = use_fla_delta_rule(model, args.fla, device) if args.fla else "transformers' pure-torch chunked delta rule (fp32)"
    if not args.fla:
        set_chunk_delta_rule(model, _chunk_gdn_fp32)
    log(f"delta rule while training: {gdn_impl}")

    decay, no_decay = [], []
    for n, p in list(model.named_parameters()) + [("mtp." + n, p) for n, p in mtp.named_parameters()]:
        (decay if p.dim() == 2 and "embed_tokens" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=(device == "cuda"))
    loss_fn = torch.compile(losses) if args.compile else losses

    train_gpu = torch.from_numpy(train_stream.astype(np.int64)).to(device)
    held_gpu = torch.from_numpy(held_stream.astype(np.int64)).to(device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    n_held_win = min(48, (len(held_stream) - 1) // (T + 1))
    held_batches = torch.stack([held_gpu[i * (T + 1):(i + 1) * (T + 1)] for i in range(n_held_win)])
    ar = torch.arange(T + 1, device=device)

    def batch():
        starts = torch.randint(0, len(train_gpu) - T - 1, (B,), device=device, generator=gen)
        return train_gpu[starts[:, None] + ar]

    def progress(step):
        """How far along the schedule is: steps or the time budget, whichever is further."""
        return max(step / args.steps, (time.time() - t_train) / args.max_train_seconds)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        p0 = args.warmup / args.steps
        p = (progress(step) - p0) / max(1e-9, 1 - p0)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, p)))))

    @torch.no_grad()
    def held_loss():
        model.eval()
        mtp.eval()
        tot = [0.0, 0.0, 0.0]
        for i in range(0, n_held_win, 16):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=(device == "cuda")):
                a, b, c = losses(model, mtp, held_batches[i:i + 16])
            k = held_batches[i:i + 16].shape[0]
            tot = [tot[0] + a.item() * k, tot[1] + b.item() * k, tot[2] + c.item() * k]
        model.train()
        mtp.train()
        return [v / n_held_win for v in tot]

    history = {"step": [], "tokens": [], "train": [], "train_mtp": [], "eval_step": [], "heldout": [],
               "heldout_mtp": [], "heldout_mtp_top1": []}
    log(f"training: {args.steps} steps x {B} x {T} tokens = {args.steps * B * T / 1e6:.0f}M tokens "
        f"(~{args.steps * B * T / len(train_stream):.2f} epochs), lr {args.lr}, compile={args.compile}")
    model.train()
    mtp.train()
    t_train = time.time()
    acc = [0.0, 0.0, 0]
    step = 0
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x = batch()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=(device == "cuda")):
            lm, lt, _ = loss_fn(model, mtp, x)
            loss = lm + args.mtp_weight * lt
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(mtp.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        acc = [acc[0] + lm.item(), acc[1] + lt.item(), acc[2] + 1]
        if (step + 1) % args.log_every == 0 or step == 0:
            el = time.time() - t_train
            history["step"].append(step + 1)
            history["tokens"].append((step + 1) * B * T)
            history["train"].append(acc[0] / acc[2])
            history["train_mtp"].append(acc[1] / acc[2])
            log(f"step {step + 1:5d} loss {acc[0] / acc[2]:.4f} mtp {acc[1] / acc[2]:.4f} lr {lr_at(step):.2e} "
                f"{(step + 1) * B * T / el / 1e3:.0f}k tok/s, {el:.0f}s")
            acc = [0.0, 0.0, 0]
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            hl, hm, ha = held_loss()
            history["eval_step"].append(step + 1)
            history["heldout"].append(hl)
            history["heldout_mtp"].append(hm)
            history["heldout_mtp_top1"].append(ha)
            log(f"  held-out (48 windows) loss {hl:.4f} mtp {hm:.4f} mtp-top1 {ha:.3f}")
        if time.time() - t_train > args.max_train_seconds:
            log(f"time budget reached after {step + 1} steps ({time.time() - t_train:.0f}s)")
            if history["eval_step"][-1:] != [step + 1]:
                hl, hm, ha = held_loss()
                history["eval_step"].append(step + 1)
                history["heldout"].append(hl)
                history["heldout_mtp"].append(hm)
                history["heldout_mtp_top1"].append(ha)
            break
    steps_done = step + 1
    train_seconds = time.time() - t_train
    log(f"trained {steps_done} steps in {train_seconds:.0f}s, {steps_done * B * T / 1e6:.1f}M tokens; "
        f"peak mem {torch.cuda.max_memory_allocated() / 2**30 if device == 'cuda' else 0:.1f} GiB")
    # ---- int4: round-to-nearest and GPTQ, the one with the lower held-out loss is exported
    model.eval()
    mtp.eval()
    G = args.group_size
    linears = quantized_linears(model, mtp)
    calib_gen = torch.Generator(device=device).manual_seed(args.seed + 3)
    calib = [train_gpu[torch.randint(0, len(train_gpu) - T - 1, (16,), device=device, generator=calib_gen)[:, None] + ar]
             for _ in range(8)]
    hessians = input_hessians(model, mtp, linears, calib, device)
    originals = {n: m.weight.detach().clone() for n, m in linears.items()}
    quant_results, codes = {}, {}
    float_loss = held_loss()
    for method in ("rtn", "gptq"):
        codes[method] = {}
        for n, m in linears.items():
            W = originals[n]
            q, sc, z = int4_rtn(W, G) if method == "rtn" else int4_gptq(W, hessians[n], G)
            codes[method][n] = (q, sc, z)
            with torch.no_grad():
                m.weight.copy_(int4_dequant(q, sc, z, G))
        quant_results[method] = held_loss()
        log(f"int4 {method} (group {G}): held-out (48 windows) loss {quant_results[method][0]:.4f} "
            f"(float {float_loss[0]:.4f}), mtp {quant_results[method][1]:.4f}")
    with torch.no_grad():
        for n, m in linears.items():
            m.weight.copy_(originals[n])
    quant_method = min(quant_results, key=lambda k: quant_results[k][0])
    log(f"exporting int4 {quant_method}")

    # ---- export: int4 linears (GPTQ tensors), everything else bf16
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sd.update({"mtp." + k: v for k, v in mtp.state_dict().items()})
    export = {}
    for k, v in sd.items():
        if k in linears:
            m = k[: -len(".weight")]
            for part, t in pack_gptq(*codes[quant_method][k]).items():
                export[f"{m}.{part}"] = t
        else:
            export[k] = v.detach().to(torch.bfloat16).cpu().contiguous()
    st_path = os.path.join(args.out, "model.safetensors")
    save_file(export, st_path, metadata={"format": "pt"})
    quantization_config = {"quant_method": "auto-round", "packing_format": "auto_round", "bits": 4,
                           "group_size": G, "sym": False, "data_type": "int"}
    cj = model.config.to_dict()
    noise = {"id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions",
             "output_hidden_states", "problem_type", "return_dict", "_name_or_path"}
    cj = {k: v for k, v in cj.items() if k not in noise}
    cj.update({"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "dtype": "bfloat16",
               "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "full_attention_interval": 4,
               "attn_output_gate": True, "mamba_ssm_dtype": "float32", "eos_token_id": eot,
               "quantization_config": quantization_config, "transformers_version": transformers.__version__})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
    st_size = os.path.getsize(st_path)
    n_int4 = sum(linears[k].weight.numel() for k in linears)
    log(f"exported {len(export)} tensors ({len(linears)} int4 linears, {n_int4:,} weights), model.safetensors "
        f"{st_size / 1e6:.2f} MB")
    assert st_size <= args.max_file_mb * 1e6

    # ---- evaluation from the exported file, read back as a loader reads it, float32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    del opt, train_gpu, calib, hessians
    if device == "cuda":
        torch.cuda.empty_cache()
    # transformers may look for fla when it builds a model: the references use its pure-torch rule
    if args.fla:
        sys.path.remove(args.fla)
        for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
            del sys.modules[name]
    ref, ref_mtp = load_int4_reference(st_path, model.config, G, device)
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()

    h_loss, h_tokens, h_mtp_loss, mtp_top1 = heldout_eval_f32(ref, ref_mtp, held_stream, T, device)
    log(f"held-out (whole split, f32, exported weights): loss {h_loss:.4f} (ppl {math.exp(h_loss):.2f}) over "
        f"{h_tokens:,} tokens; mtp loss {h_mtp_loss:.4f}, mtp top-1 (t+2) {mtp_top1:.4f}")

    prompts = self_agreement_prompts(tok, held_docs, args.seed)
    agree, agree_n, agree_by_pos = mtp_self_agreement(ref, ref_mtp, prompts, 64, eot, device)
    log(f"mtp self-agreement (32 prompts x 63 positions): {agree:.4f}")

    # heldout.txt sample loss: CPU, float32, windows of 256 from empty state
    cpu = ref.to("cpu")
    torch.set_num_threads(min(16, os.cpu_count() or 1))
    sample_ids = tok.encode(heldout_txt, add_special_tokens=False).ids
    s_loss, s_tokens, s_windows = window_nll(cpu, sample_ids, 256, "cpu")
    log(f"heldout.txt: {len(sample_ids)} tokens, {s_windows} windows, sample loss {s_loss:.4f} "
        f"(ppl {math.exp(s_loss):.2f}) over {s_tokens} predicted tokens")

    baseline = None
    if args.baseline:
        base, base_mtp = load_float_reference(args.baseline)
        base_sample, _, _ = window_nll(base, sample_ids, 256, "cpu")
        base, base_mtp = base.to(device), base_mtp.to(device)
        b_loss, _, b_mtp_loss, b_top1 = heldout_eval_f32(base, base_mtp, held_stream, T, device)
        b_agree, _, _ = mtp_self_agreement(base, base_mtp, prompts, 64, eot, device)
        baseline = {"model": args.baseline, "params": sum(p.numel() for p in base.parameters()) + sum(p.numel() for p in base_mtp.parameters()),
                    "heldout_loss": b_loss, "heldout_perplexity": math.exp(b_loss), "heldout_mtp_loss": b_mtp_loss,
                    "mtp_top1_t2": b_top1, "mtp_self_agreement": b_agree, "heldout_sample_loss": base_sample}
        log(f"baseline {args.baseline}: held-out loss {b_loss:.4f} (ppl {math.exp(b_loss):.2f}), sample loss "
            f"{base_sample:.4f}, mtp self-agreement {b_agree:.4f}; new: {h_loss:.4f} (ppl {math.exp(h_loss):.2f}), "
            f"{s_loss:.4f}, {agree:.4f}")
        del base, base_mtp

    # greedy sample, CPU float32
    fib = tok.encode("def fib(n):", add_special_tokens=False).ids
    x = torch.tensor([fib])
    cpu.generation_config.eos_token_id = None
    out = cpu.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=GenerationConfig(
        do_sample=False, max_new_tokens=64, eos_token_id=None, pad_token_id=eot, use_cache=True))
    fib_ids = out[0, len(fib):].tolist()
    fib_text = tok.decode(fib_ids, skip_special_tokens=False)
    log("greedy sample:\n" + "def fib(n):" + fib_text)

    evals = {
        "heldout_sample_loss": s_loss,
        "heldout_sample_tokens": s_tokens,
        "heldout_sample_windows": s_windows,
        "heldout_sample_scheme": "tokenize heldout.txt (no special tokens), consecutive non-overlapping windows "
                                 "of 256 tokens (last kept if >= 2), each from empty state, mean NLL over tokens "
                                 "1..len-1 of every window; float32 on CPU from the exported weights (int4 dequantized)",
        "heldout_loss": h_loss,
        "heldout_perplexity": math.exp(h_loss),
        "heldout_tokens": h_tokens,
        "heldout_scheme": f"whole held-out split (documents joined with <|endoftext|>), non-overlapping "
                          f"{T}-token windows, float32 on GPU (TF32 off) from the exported weights (int4 dequantized)",
        "heldout_mtp_loss": h_mtp_loss,
        "mtp_top1_t2": mtp_top1,
        "mtp_self_agreement": agree,
        "mtp_self_agreement_positions": agree_n,
        "mtp_self_agreement_scheme": "32 held-out prefixes of 96 tokens, 64 greedy tokens (HF generate, cached, "
                                     "f32); at every t with t+1 and t+2 generated, MTP argmax from (h_t post final "
                                     "norm, greedy token t+1) == greedy token t+2",
        "fib_prompt": "def fib(n):",
        "fib_prompt_ids": fib,
        "fib_greedy_ids": fib_ids,
        "quantization": {"config": quantization_config, "method": quant_method,
                         "heldout48_loss": {"float": float_loss[0], **{k: v[0] for k, v in quant_results.items()}},
                         "heldout48_mtp_loss": {"float": float_loss[1], **{k: v[1] for k, v in quant_results.items()}}},
        "baseline": baseline,
        "delta_rule_while_training": gdn_impl,
        "params_main": n_main,
        "params_mtp": n_mtp,
        "train_steps": steps_done,
        "train_tokens": steps_done * B * T,
        "train_seconds": round(train_seconds, 1),
        "final_train_loss": history["train"][-1],
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    with open(os.path.join(args.out, "eval.json"), "w") as f:
        json.dump(evals, f, indent=2)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(history, f)

    # ---- loss curve
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    tk = [t / 1e6 for t in history["tokens"]]
    ek = [s * B * T / 1e6 for s in history["eval_step"]]
    ax.plot(tk, history["train"], label="train (main, t+1)")
    ax.plot(tk, history["train_mtp"], label="train (MTP, t+2)")
    ax.plot(ek, history["heldout"], "o-", label="held-out (main)")
    ax.plot(ek, history["heldout_mtp"], "s-", label="held-out (MTP)")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0, max(6.0, min(10.0, history["train"][0])))
    ax.set_title("kestrel-coder")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "loss.png"), dpi=100)

    # ---- README
    cmd = "python3 scripts/train_default_model.py --out models/kestrel-coder"
    extra = [a for a in sys.argv[1:] if not a.startswith("--out") and a != args.out]
    if extra:
        cmd += " " + " ".join(extra)
    def baseline_rows():
        if not baseline:
            return ""
        return f"""
Against the previous default model (`{baseline['model']}`, {baseline['params']:,} parameters, BF16), scored by
this script on the same held-out data:

| metric | previous | this model (int4) |
|---|---|---|
| held-out perplexity (whole split) | {baseline['heldout_perplexity']:.2f} | {math.exp(h_loss):.2f} ({100 * (math.exp(h_loss) / baseline['heldout_perplexity'] - 1):+.1f} %) |
| heldout.txt sample loss | {baseline['heldout_sample_loss']:.4f} | {s_loss:.4f} |
| MTP held-out loss (t+2) | {baseline['heldout_mtp_loss']:.4f} | {h_mtp_loss:.4f} |
| MTP self-agreement | {baseline['mtp_self_agreement']:.4f} | {agree:.4f} |
"""

    kinds = ", ".join("F" if t == "full_attention" else "L" for t in cfg.layer_types)
    readme = f"""# kestrel-coder

Kestrel's embedded default model: a small Qwen3.5-architecture Python code model (hybrid Gated-DeltaNet,
3 linear : 1 gated full-attention layer) with one MTP (multi-token prediction) module for speculative
decoding, stored with 4-bit weights. Trained from scratch by `scripts/train_default_model.py` on the
Python source files installed on the GPU machine. It completes Python code; it was not trained on chat data.

## Rebuild

On one {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'} (torch {torch.__version__}, transformers {transformers.__version__}, tokenizers), from the repo root:

    {cmd}

Seeded, but the corpus is whatever `*.py` the interpreter's stdlib and site-packages hold, so another
machine gives another model, and the learning-rate schedule follows the time budget where the machine is
slower than the step count assumes. Training took {train_seconds:.0f} s; the whole script about {time.time() - T0:.0f} s.

## Files

| file | what |
|---|---|
| config.json | flat `qwen3_5_text` config, `Qwen3_5ForCausalLM`, tied embeddings, `mtp_num_hidden_layers: 1`, eos = `<|endoftext|>` (id {eot}), `quantization_config` (auto-round int4, `auto_round` packing) |
| model.safetensors | `model.*` (no `lm_head.weight`: tied) + `mtp.*` (real Qwen3.5 MTP names); {len(linears)} linears as int4 (`qweight`/`qzeros`/`scales`, groups of {G} inputs, asymmetric, zero points stored as is), embedding, norms, convolutions and the delta rule's gate projections in BF16; {st_size / 1e6:.2f} MB |
| tokenizer.json / tokenizer_config.json | byte-level BPE, {V} tokens; `<|endoftext|>`={eot} (document separator, eos), `<|im_start|>`={tok.token_to_id('<|im_start|>')}, `<|im_end|>`={tok.token_to_id('<|im_end|>')}; ChatML template |
| heldout.txt | {len(picked)} whole held-out files, {len(heldout_txt.encode())} bytes, for `kestrel perplexity` |
| eval.json | the numbers below, with the exact scheme of each |
| loss.png / train_log.json | loss curves |

## Architecture

hidden {args.hidden}, {args.layers} layers ({kinds}),
full attention {args.heads} query / {args.kv_heads} KV heads x head_dim 64 (gated, q/k norm, partial RoPE 16 dims, theta 1e4),
GDN {args.gdn_key_heads} key heads / {args.gdn_value_heads} value heads, dk = dv = 64, conv 4, SwiGLU intermediate
{args.intermediate}, vocab {V}, trained at context {T}. MTP: fc [{args.hidden}, {2 * args.hidden}] over
cat[norm(embed(t+1)), norm(h_t)] (embedding first, h_t = final-normed hidden), one full-attention decoder layer at
the positions of t, mtp.norm, shared tied lm_head.

Parameters: {n_main:,} main (incl. {V * args.hidden:,} tied embedding) + {n_mtp:,} MTP = {n_main + n_mtp:,}.

## Corpus

{len(docs):,} unique `.py` files ({n_bytes / 1e6:.1f} MB; {cstats['duplicates']:,} duplicate and {cstats['skipped']:,}
skipped files dropped), {n_tokens:,} tokens ({n_bytes / n_tokens:.2f} bytes/token). Held out by file
(sha1 % 100 == 0): {len(held_docs):,} files, {held_bytes / 1e6:.2f} MB, {len(held_stream):,} tokens.

## Training

AdamW (0.9, 0.95), peak lr {args.lr}, {args.warmup} warmup steps then cosine to 5 %, weight decay 0.1 on
matrices, grad clip 1.0, batch {B} x {T} tokens, {steps_done} steps = {steps_done * B * T / 1e6:.0f}M tokens
({steps_done * B * T / len(train_stream):.2f} epochs), bf16 autocast, loss = main + {args.mtp_weight} x MTP,
h not detached. Delta rule while training: {gdn_impl}.

![loss](loss.png)

Curves: train = mean over the last {args.log_every} steps; held-out = the first {n_held_win} windows of
{T} tokens of the held-out stream under bf16 autocast (a harder subset than the whole split scored below).

## Quantization

Every linear but the delta rule's gate projections is stored as asymmetric int4 in groups of {G} inputs.
Round-to-nearest and GPTQ (inverse-Hessian error feedback from 8 x 16 x {T} training tokens, 1 % damping)
were both scored on the 48 held-out windows; the lower was exported:

| weights | held-out loss (48 windows) | MTP loss |
|---|---|---|
| float (trained) | {float_loss[0]:.4f} | {float_loss[1]:.4f} |
| int4, round to nearest | {quant_results['rtn'][0]:.4f} | {quant_results['rtn'][1]:.4f} |
| int4, GPTQ | {quant_results['gptq'][0]:.4f} | {quant_results['gptq'][1]:.4f} |

Exported: {quant_method}.

## Results (float32, from the exported file, int4 dequantized as a loader reads it)

| metric | value |
|---|---|
| held-out loss (whole split, {T}-token windows) | {h_loss:.4f} nats/token, perplexity {math.exp(h_loss):.2f} |
| heldout.txt sample loss (256-token windows, CPU) | {s_loss:.4f} over {s_tokens} tokens (perplexity {math.exp(s_loss):.2f}) |
| MTP held-out loss (t+2) | {h_mtp_loss:.4f} |
| MTP top-1 accuracy for t+2 (true h_t, true t+1) | {mtp_top1:.4f} |
| MTP self-agreement on greedy text (draft position-0 acceptance) | {agree:.4f} |
{baseline_rows()}
Greedy sample (64 tokens, CPU float32):

```python
def fib(n):{fib_text}
```
"""
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(readme)
    log("done")


if __name__ == "__main__":
    main()
