#!/usr/bin/env python3
"""Train Kestrel's embedded default model, `kestrel-coder`: a small Qwen3.5-architecture
(hybrid Gated-DeltaNet 3 : 1 gated full attention) Python code model with one MTP module.

Runs on one H100 in under 9 minutes, including corpus building, tokenizer training, export and
evaluation. Everything is seeded; the corpus is whatever Python source the machine has (the
standard library and site-packages of the running interpreter), so a different machine gives a
different model.

  python3 scripts/train_default_model.py --out models/kestrel-coder

Steps
  1. corpus: every *.py under the interpreter's stdlib and site-packages, deduplicated by content
     hash (sha1), files > 1 MB or not UTF-8 dropped; held out BY FILE: sha1 % 100 == 0 (1 %).
  2. tokenizer: byte-level BPE (HF tokenizers, Qwen2-style pre-tokenizer regex), 8192 tokens incl.
     <|endoftext|> (id 0, document separator), <|im_start|> (1), <|im_end|> (2), trained on a seeded
     sample of the train split.
  3. model: transformers' Qwen3_5ForCausalLM (tied embeddings) + one MTP module built from
     transformers' own Qwen3_5DecoderLayer / Qwen3_5RMSNorm / rotary embedding, trained jointly:
     loss = CE(main, t+1) + 0.5 * CE(mtp, t+2); h is NOT detached (MTP gradients reach the trunk).
     MTP: x = mtp.fc(cat[RMSNorm1p(embed(tok_{t+1})), RMSNorm1p(h_t)]) with h_t the final-normed
     hidden state, one full-attention decoder layer at the positions of t, logits =
     lm_head(RMSNorm1p(x; mtp.norm)).
  4. export (HF layout, BF16, `model.*` + `mtp.*`), then evaluation from the EXPORTED weights
     reloaded in float32 (eval.json, README.md, loss.png, heldout.txt).
"""

import argparse
import copy
import hashlib
import json
import math
import os
import random
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


@torch.no_grad()
def mtp_self_agreement(model, mtp, prompts, n_new, eot, device):
    ids = torch.tensor(np.stack(prompts), dtype=torch.long, device=device)
    P = ids.shape[1]
    gc = GenerationConfig(do_sample=False, max_new_tokens=n_new, eos_token_id=None, pad_token_id=eot,
                          use_cache=True)
    model.generation_config.eos_token_id = None
    seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    assert seq.shape[1] == P + n_new, seq.shape
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
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=448)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--lr", type=float, default=2.5e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--max-train-seconds", type=float, default=400.0, help="safety stop for the train loop")
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
    tok.save(os.path.join(args.out, "tokenizer.json"))
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
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
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
    log(f"params: main {n_main:,} (embedding {V * args.hidden:,}, tied), mtp {n_mtp:,}, total {n_main + n_mtp:,} "
        f"-> bf16 {(n_main + n_mtp) * 2 / 2**20:.2f} MiB")
    assert (n_main + n_mtp) * 2 < 15 * 2**20 - 65536, "over the 15 MiB export limit"
    q35.torch_chunk_gated_delta_rule = _chunk_gdn_fp32

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

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        p = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

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
            log(f"SAFETY STOP after {step + 1} steps ({time.time() - t_train:.0f}s)")
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
    q35.torch_chunk_gated_delta_rule = _ORIG_CHUNK

    # ---- export
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sd.update({"mtp." + k: v for k, v in mtp.state_dict().items()})
    sd = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in sd.items()}
    st_path = os.path.join(args.out, "model.safetensors")
    save_file(sd, st_path, metadata={"format": "pt"})
    cj = model.config.to_dict()
    noise = {"id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions",
             "output_hidden_states", "problem_type", "return_dict", "_name_or_path"}
    cj = {k: v for k, v in cj.items() if k not in noise}
    cj.update({"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "dtype": "bfloat16",
               "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "full_attention_interval": 4,
               "attn_output_gate": True, "mamba_ssm_dtype": "float32", "eos_token_id": eot,
               "transformers_version": transformers.__version__})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
    st_size = os.path.getsize(st_path)
    log(f"exported {len(sd)} tensors, model.safetensors {st_size / 2**20:.2f} MiB")
    assert st_size <= 15 * 2**20

    # ---- evaluation from the exported weights, float32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    del opt, train_gpu
    if device == "cuda":
        torch.cuda.empty_cache()
    ref = Qwen3_5ForCausalLM.from_pretrained(args.out, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
    ref_mtp = MTP(ref.config)
    ref_mtp.load_state_dict({k[4:]: v.float() for k, v in load_file(st_path).items() if k.startswith("mtp.")})
    ref_mtp = ref_mtp.to(device).eval()
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()

    h_loss, h_tokens, h_mtp_loss, mtp_top1 = heldout_eval_f32(ref, ref_mtp, held_stream, T, device)
    log(f"held-out (whole split, f32, exported weights): loss {h_loss:.4f} (ppl {math.exp(h_loss):.2f}) over "
        f"{h_tokens:,} tokens; mtp loss {h_mtp_loss:.4f}, mtp top-1 (t+2) {mtp_top1:.4f}")

    # self agreement: 32 held-out prefixes of 96 tokens from random points of held-out files
    prng = random.Random(args.seed + 2)
    cands = [t for _, t in held_docs]
    prng.shuffle(cands)
    prompts = []
    for t in cands:
        ids = tok.encode(t, add_special_tokens=False).ids
        if len(ids) >= 256:
            cut = prng.randint(96, len(ids) - 1)
            prompts.append(np.asarray(ids[cut - 96:cut], dtype=np.int64))
        if len(prompts) == 32:
            break
    agree, agree_n, agree_by_pos = mtp_self_agreement(ref, ref_mtp, prompts, 64, eot, device)
    log(f"mtp self-agreement (32 prompts x 63 positions): {agree:.4f}")

    # heldout.txt sample loss: CPU, float32, windows of 256 from empty state
    cpu = ref.to("cpu")
    torch.set_num_threads(min(16, os.cpu_count() or 1))
    sample_ids = tok.encode(heldout_txt, add_special_tokens=False).ids
    s_loss, s_tokens, s_windows = window_nll(cpu, sample_ids, 256, "cpu")
    log(f"heldout.txt: {len(sample_ids)} tokens, {s_windows} windows, sample loss {s_loss:.4f} "
        f"(ppl {math.exp(s_loss):.2f}) over {s_tokens} predicted tokens")

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
                                 "1..len-1 of every window; float32 on CPU from the exported BF16 weights",
        "heldout_loss": h_loss,
        "heldout_perplexity": math.exp(h_loss),
        "heldout_tokens": h_tokens,
        "heldout_scheme": f"whole held-out split (documents joined with <|endoftext|>), non-overlapping "
                          f"{T}-token windows, float32 on GPU (TF32 off) from the exported BF16 weights",
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
    readme = f"""# kestrel-coder

Kestrel's embedded default model: a small Qwen3.5-architecture Python code model (hybrid Gated-DeltaNet,
3 linear : 1 gated full-attention layer) with one MTP (multi-token prediction) module for speculative
decoding. Trained from scratch by `scripts/train_default_model.py` on the Python source files installed on
the GPU machine. It completes Python code; it was not trained on chat data.

## Rebuild

On one H100 (torch {torch.__version__}, transformers {transformers.__version__}, tokenizers), from the repo root:

    {cmd}

Seeded, but the corpus is whatever `*.py` the interpreter's stdlib and site-packages hold, so another
machine gives another model. Training took {train_seconds:.0f} s; the whole script about {time.time() - T0:.0f} s.

## Files

| file | what |
|---|---|
| config.json | flat `qwen3_5_text` config, `Qwen3_5ForCausalLM`, tied embeddings, `mtp_num_hidden_layers: 1`, eos = `<|endoftext|>` (id {eot}) |
| model.safetensors | BF16, `model.*` (no `lm_head.weight`: tied) + `mtp.*` (real Qwen3.5 MTP names), {st_size / 2**20:.2f} MiB |
| tokenizer.json / tokenizer_config.json | byte-level BPE, {V} tokens; `<|endoftext|>`={eot} (document separator, eos), `<|im_start|>`={tok.token_to_id('<|im_start|>')}, `<|im_end|>`={tok.token_to_id('<|im_end|>')}; ChatML template |
| heldout.txt | {len(picked)} whole held-out files, {len(heldout_txt.encode())} bytes, for `kestrel perplexity` |
| eval.json | the numbers below, with the exact scheme of each |
| loss.png / train_log.json | loss curves |

## Architecture

hidden {args.hidden}, {args.layers} layers ({', '.join('F' if t == 'full_attention' else 'L' for t in cfg.layer_types)}),
full attention 4 query / 2 KV heads x head_dim 64 (gated, q/k norm, partial RoPE 16 dims, theta 1e4),
GDN 2 key heads / 4 value heads, dk = dv = 64, conv 4, SwiGLU intermediate {args.intermediate}, vocab {V},
trained at context {T}. MTP: fc [{args.hidden}, {2 * args.hidden}] over cat[norm(embed(t+1)), norm(h_t)]
(embedding first, h_t = final-normed hidden), one full-attention decoder layer at the positions of t, mtp.norm,
shared tied lm_head.

Parameters: {n_main:,} main (incl. {V * args.hidden:,} tied embedding) + {n_mtp:,} MTP = {n_main + n_mtp:,}.

## Corpus

{len(docs):,} unique `.py` files ({n_bytes / 1e6:.1f} MB; {cstats['duplicates']:,} duplicate and {cstats['skipped']:,}
skipped files dropped), {n_tokens:,} tokens ({n_bytes / n_tokens:.2f} bytes/token). Held out by file
(sha1 % 100 == 0): {len(held_docs):,} files, {held_bytes / 1e6:.2f} MB, {len(held_stream):,} tokens.

## Training

AdamW (0.9, 0.95), peak lr {args.lr}, {args.warmup} warmup steps then cosine to 5 %, weight decay 0.1 on
matrices, grad clip 1.0, batch {B} x {T} tokens, {steps_done} steps = {steps_done * B * T / 1e6:.0f}M tokens,
bf16 autocast (the pure-torch chunked GDN kept in fp32), loss = main + {args.mtp_weight} x MTP, h not
detached.

![loss](loss.png)

Curves: train = mean over the last {args.log_every} steps; held-out = the first {n_held_win} windows of
{T} tokens of the held-out stream under bf16 autocast (a harder subset than the whole split scored below).

## Results (float32, from the exported BF16 weights)

| metric | value |
|---|---|
| held-out loss (whole split, {T}-token windows) | {h_loss:.4f} nats/token, perplexity {math.exp(h_loss):.2f} |
| heldout.txt sample loss (256-token windows, CPU) | {s_loss:.4f} over {s_tokens} tokens (perplexity {math.exp(s_loss):.2f}) |
| MTP held-out loss (t+2) | {h_mtp_loss:.4f} |
| MTP top-1 accuracy for t+2 (true h_t, true t+1) | {mtp_top1:.4f} |
| MTP self-agreement on greedy text (draft position-0 acceptance) | {agree:.4f} |

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
