#!/usr/bin/env python3
"""Second stage of the default model's recipe: distil its MTP module from the main model it drafts for.

`train_default_model.py` trains the MTP module on the data's tokens (t+2). A draft is accepted when it
equals the main model's own choice, not the data's, so this stage trains the MTP module alone (the
main model frozen, as exported: int4 dequantized) on the main model's next-token distribution: at row
t, fed (h_t, token t+1), the MTP's distribution is pulled towards the main model's at row t+1 (cross
entropy against soft targets, as EAGLE and Medusa's self-distillation do). The text is the training
split and, every other step, the main model's own greedy continuations of training-split prompts
(drafts are offered on the model's own text), so nothing held out is seen. Then the MTP linears are quantized again
(round-to-nearest or GPTQ, whichever agrees more with the main model on held-out text) and written
into the same file; the main model's tensors are copied byte for byte, so every figure of the main
model stays as the first stage measured it.

  python3 scripts/distill_default_mtp.py --model models/kestrel-coder

It rewrites model.safetensors, and the MTP figures of eval.json and README.md, in place.
"""

import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_default_model as tdm  # noqa: E402
from transformers import Qwen3_5TextConfig  # noqa: E402

T0 = time.time()
PROMPT = 96  # tokens of training text before each greedy continuation, as the self-agreement prompts


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def mtp_agreement_loss(model, mtp, x, first_row=0, hard_weight=0.0):
    """x [B, T+1]: the MTP's soft-target cross entropy against the main model's next-token
    distribution one row later (plus `hard_weight` times the cross entropy against that
    distribution's argmax, the token a draft must equal), and the share of rows whose argmaxes
    agree, over MTP rows first_row..T-2 (row t is fed h_t and token t+1, and drafts token t+2)."""
    inp = x[:, :-1]
    with torch.no_grad():
        h = model.model(input_ids=inp, use_cache=False).last_hidden_state
        teacher = F.softmax(model.lm_head(h[:, 1 + first_row:]).float(), dim=-1)  # main at row t+1 predicts t+2
    m = tdm.mtp_hidden(model, mtp, inp, h.detach())[:, first_row:]  # rows first_row..T-2
    logits = model.lm_head(m).float()
    logp = F.log_softmax(logits, dim=-1)
    loss = -(teacher * logp).sum(-1).mean()
    if hard_weight:
        loss = loss + hard_weight * F.nll_loss(logp.flatten(0, 1), teacher.argmax(-1).flatten())
    agree = (logits.argmax(-1) == teacher.argmax(-1)).float().mean()
    return loss, agree


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/kestrel-coder")
    ap.add_argument("--fla", default="", help="flash-linear-attention folder, as for train_default_model.py")
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--max-train-seconds", type=float, default=150.0)
    ap.add_argument("--max-file-bytes", type=int, default=1_000_000)
    ap.add_argument("--max-docs", type=int, default=0, help="debug: cap the number of documents")
    ap.add_argument("--held-windows", type=int, default=48)
    ap.add_argument("--greedy-prompts", type=int, default=2048,
                    help="training-split prompts of 96 tokens continued greedily by the main model for 64 tokens; "
                         "--greedy-share of the steps train on those continuations")
    ap.add_argument("--greedy-share", type=float, default=0.5,
                    help="share of the steps on the greedy continuations (the rest on training text)")
    ap.add_argument("--greedy-generated-only", action="store_true",
                    help="on the greedy continuations, train only the rows whose t+1 and t+2 were generated "
                         "(the rows self-agreement counts), not the prompt's")
    ap.add_argument("--hard-label-weight", type=float, default=0.0,
                    help="weight of a cross entropy against the main model's argmax next to the soft-target loss")
    ap.add_argument("--greedy-batch", type=int, default=512, help="prompts per generate call of the greedy continuations")
    args = ap.parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    docs, _ = tdm.read_corpus(tdm.python_roots(), args.max_file_bytes)
    if args.max_docs:
        docs = docs[: args.max_docs]
    train_docs = [t for h, t in docs if not tdm.is_heldout(h)]
    held_docs = [(h, t) for h, t in docs if tdm.is_heldout(h)]
    order = list(range(len(train_docs)))
    random.Random(args.seed).shuffle(order)
    train_stream = tdm.tokenize_docs(tok, [train_docs[i] for i in order], eot)
    held_stream = tdm.tokenize_docs(tok, [t for _, t in held_docs], eot)
    log(f"tokens: train {len(train_stream):,}, held-out {len(held_stream):,}")

    path = os.path.join(args.model, "model.safetensors")
    with open(os.path.join(args.model, "config.json")) as f:
        cj = json.load(f)
    group = cj["quantization_config"]["group_size"]
    cfg = Qwen3_5TextConfig.from_dict({k: v for k, v in cj.items() if k != "quantization_config"})
    model, mtp = tdm.load_int4_reference(path, cfg, group, device)
    for p in model.parameters():
        p.requires_grad_(False)
    gdn = tdm.use_fla_delta_rule(model, args.fla, device) if args.fla else "transformers' pure-torch rule"
    log(f"delta rule: {gdn}")

    T, B = args.seq, args.batch
    train_gpu = torch.from_numpy(train_stream.astype(np.int64)).to(device)
    held_gpu = torch.from_numpy(held_stream.astype(np.int64)).to(device)
    ar = torch.arange(T + 1, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    held = torch.stack([held_gpu[i * (T + 1):(i + 1) * (T + 1)] for i in range(args.held_windows)])

    @torch.no_grad()
    def held_agreement():
        mtp.eval()
        tot = [0.0, 0.0]
        for i in range(0, len(held), 16):
            k = len(held[i:i + 16]) / len(held)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                a, b = mtp_agreement_loss(model, mtp, held[i:i + 16])
            tot = [tot[0] + a.item() * k, tot[1] + b.item() * k]
        mtp.train()
        return tot

    # the main model's own greedy continuations of training-split prompts: drafts are offered on the
    # model's own text, so half the steps train there (EAGLE-style self-distillation)
    greedy = None
    if args.greedy_prompts:
        pgen = torch.Generator(device=device).manual_seed(args.seed + 2)
        starts = torch.randint(0, len(train_gpu) - PROMPT - 1, (args.greedy_prompts,), device=device, generator=pgen)
        prompts = train_gpu[starts[:, None] + torch.arange(PROMPT, device=device)]
        outs = []
        with torch.no_grad():
            for i in range(0, len(prompts), args.greedy_batch):
                outs.append(tdm.greedy_continuations(model, prompts[i:i + args.greedy_batch], 64, eot))
        greedy = torch.cat(outs)
        log(f"greedy continuations: {tuple(greedy.shape)}")

    mtp.train()
    decay = [p for n, p in mtp.named_parameters() if p.dim() == 2]
    rest = [p for n, p in mtp.named_parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=cuda)
    before = held_agreement()
    log(f"before: held-out soft loss {before[0]:.4f}, argmax agreement {before[1]:.4f}")
    history = {"step": [], "loss": [], "agree": []}
    t_train = time.time()
    acc = [0.0, 0.0, 0]
    step = 0
    for step in range(args.steps):
        p = max(step / args.steps, (time.time() - t_train) / args.max_train_seconds)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))
        for g in opt.param_groups:
            g["lr"] = lr
        first_row = 0
        # at share 0.5 this is every odd step, as the first distillation run had it
        if greedy is not None and int((step + 1) * args.greedy_share) > int(step * args.greedy_share):
            x = greedy[torch.randint(0, len(greedy), (B * T // greedy.shape[1],), device=device, generator=gen)]
            first_row = PROMPT - 1 if args.greedy_generated_only else 0
        else:
            x = train_gpu[torch.randint(0, len(train_gpu) - T - 1, (B,), device=device, generator=gen)[:, None] + ar]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss, agree = mtp_agreement_loss(model, mtp, x, first_row, args.hard_label_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        acc = [acc[0] + loss.item(), acc[1] + agree.item(), acc[2] + 1]
        if (step + 1) % 100 == 0:
            history["step"].append(step + 1)
            history["loss"].append(acc[0] / acc[2])
            history["agree"].append(acc[1] / acc[2])
            log(f"step {step + 1} soft loss {acc[0] / acc[2]:.4f} agreement {acc[1] / acc[2]:.4f} lr {lr:.2e}")
            acc = [0.0, 0.0, 0]
        if time.time() - t_train > args.max_train_seconds:
            break
    steps_done = step + 1
    train_seconds = time.time() - t_train
    mtp.eval()
    after = held_agreement()
    log(f"distilled {steps_done} steps ({steps_done * B * T / 1e6:.0f}M tokens) in {train_seconds:.0f}s: held-out soft loss "
        f"{after[0]:.4f}, argmax agreement {after[1]:.4f}")

    # quantize the MTP linears again: round to nearest and GPTQ, the one that agrees more
    linears = {n: m for n, m in tdm.quantized_linears(model, mtp).items() if n.startswith("mtp.")}
    calib_gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    calib = [train_gpu[torch.randint(0, len(train_gpu) - T - 1, (16,), device=device, generator=calib_gen)[:, None] + ar]
             for _ in range(8)]
    hs = tdm.input_hessians(model, mtp, linears, calib, device, forward=mtp_agreement_loss)
    originals = {n: m.weight.detach().clone() for n, m in linears.items()}
    results, codes = {}, {}
    for method in ("rtn", "gptq"):
        codes[method] = {}
        for n, m in linears.items():
            q, sc, z = tdm.int4_rtn(originals[n], group) if method == "rtn" else tdm.int4_gptq(originals[n], hs[n], group)
            codes[method][n] = (q, sc, z)
            with torch.no_grad():
                m.weight.copy_(tdm.int4_dequant(q, sc, z, group))
        results[method] = held_agreement()
        log(f"int4 {method}: held-out soft loss {results[method][0]:.4f}, argmax agreement {results[method][1]:.4f}")
    method = max(results, key=lambda k: results[k][1])

    old = load_file(path)
    new = {k: v for k, v in old.items() if not k.startswith("mtp.")}
    for k, v in mtp.state_dict().items():
        name = "mtp." + k
        if name in linears:
            for part, t in tdm.pack_gptq(*codes[method][name]).items():
                new[f"{name[:-len('.weight')]}.{part}"] = t
        else:
            new[name] = v.detach().to(torch.bfloat16).cpu().contiguous()
    assert set(new) == set(old), set(new) ^ set(old)
    save_file(new, path, metadata={"format": "pt"})
    log(f"rewrote {path} ({os.path.getsize(path) / 1e6:.2f} MB), MTP int4 {method}")

    # figures, from the rewritten file read back
    if args.fla:
        sys.path.remove(args.fla)
        for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
            del sys.modules[name]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    del train_gpu, calib
    if cuda:
        torch.cuda.empty_cache()
    ref, ref_mtp = tdm.load_int4_reference(path, cfg, group, device)
    h_loss, _, h_mtp_loss, mtp_top1 = tdm.heldout_eval_f32(ref, ref_mtp, held_stream, T, device)
    prompts = tdm.self_agreement_prompts(tok, held_docs, 1234)  # the first stage's default seed
    agree, agree_n, _ = tdm.mtp_self_agreement(ref, ref_mtp, prompts, 64, eot, device)
    # the same measure on every held-out file long enough (32 prompts leave a standard error of ~0.007)
    wide_prompts = tdm.self_agreement_prompts(tok, held_docs, 1234, count=len(held_docs))
    wide, wide_n, _ = tdm.mtp_self_agreement(ref, ref_mtp, wide_prompts, 64, eot, device)
    log(f"from the file: held-out loss {h_loss:.4f} (main, unchanged), mtp loss {h_mtp_loss:.4f}, mtp top-1 (t+2) "
        f"{mtp_top1:.4f}, mtp self-agreement {agree:.4f} ({len(wide_prompts)} prompts: {wide:.4f})")

    with open(os.path.join(args.model, "eval.json")) as f:
        evals = json.load(f)
    first = {k: evals[k] for k in ("heldout_mtp_loss", "mtp_top1_t2", "mtp_self_agreement")}
    assert abs(evals["heldout_loss"] - h_loss) < 1e-4, (evals["heldout_loss"], h_loss)
    # a run on an already distilled file continues it: the runs are kept in order
    runs = evals.pop("mtp_distillation_runs", None) or ([evals.pop("mtp_distillation")] if "mtp_distillation" in evals else [])
    evals.update({"heldout_mtp_loss": h_mtp_loss, "mtp_top1_t2": mtp_top1, "mtp_self_agreement": agree,
                  "mtp_self_agreement_positions": agree_n,
                  "mtp_self_agreement_all_heldout_files": {"prompts": len(wide_prompts), "positions": wide_n, "value": wide},
                  "mtp_distillation_runs": runs + [{"command_args": sys.argv[1:], "steps": steps_done,
                                       "tokens": steps_done * B * T, "seconds": round(train_seconds, 1),
                                       "lr": args.lr, "greedy_prompts": args.greedy_prompts,
                                       "greedy_share": args.greedy_share,
                                       "greedy_generated_only": args.greedy_generated_only,
                                       "hard_label_weight": args.hard_label_weight,
                                       "int4": method, "before": first,
                                       "heldout48_soft_loss": {"before": before[0], "after_float": after[0],
                                                               **{k: v[0] for k, v in results.items()}},
                                       "heldout48_argmax_agreement": {"before": before[1], "after_float": after[1],
                                                                      **{k: v[1] for k, v in results.items()}},
                                       "history": history}]})
    with open(os.path.join(args.model, "eval.json"), "w") as f:
        json.dump(evals, f, indent=2)

    readme_path = os.path.join(args.model, "README.md")
    with open(readme_path) as f:
        readme = f.read()
    cmd = "python3 scripts/distill_default_mtp.py --model models/kestrel-coder"
    extra = [a for a in sys.argv[1:] if a not in ("--model", args.model)]
    if extra:
        cmd += " " + " ".join(extra)
    title = "## MTP distillation (second stage)" if not runs else f"## MTP distillation, run {len(runs) + 1} (continues the file above)"
    rows = "the rows whose t+1 and t+2 were generated" if args.greedy_generated_only else "every row"
    hard = f", plus {args.hard_label_weight} x the cross entropy against its argmax" if args.hard_label_weight else ""
    section = f"""
{title}

`{cmd}`: the MTP module alone,
{steps_done} steps of {B} x {T} tokens ({train_seconds:.0f} s), {args.greedy_share:.0%} of them on the main model's
greedy continuations of {args.greedy_prompts} training prompts ({rows}), the rest on training text, trained on the
main model's next-token distribution (soft-target cross entropy{hard}; main model frozen as exported), then its linears
quantized again (int4 {method}). The main model's tensors are unchanged.

| MTP figure | before this run | after it |
|---|---|---|
| held-out loss against the data (t+2) | {first['heldout_mtp_loss']:.4f} | {h_mtp_loss:.4f} |
| top-1 accuracy for t+2 (true h_t, true t+1) | {first['mtp_top1_t2']:.4f} | {mtp_top1:.4f} |
| argmax agreement with the main model, 48 held-out windows | {before[1]:.4f} | {results[method][1]:.4f} |
| self-agreement on greedy text (draft position-0 acceptance) | {first['mtp_self_agreement']:.4f} | {agree:.4f} |

The same self-agreement over {len(wide_prompts)} held-out prompts (every held-out file of 256 tokens or more) instead of
32: {wide:.4f} over {wide_n} positions. The sections above this one show earlier MTP figures; eval.json holds the final ones.
"""
    marker = "\nGreedy sample (64 tokens, CPU float32):"
    readme = readme.replace(marker, section + marker, 1)
    with open(readme_path, "w") as f:
        f.write(readme)
    log("done")


if __name__ == "__main__":
    main()
