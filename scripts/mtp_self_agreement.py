#!/usr/bin/env python3
"""MTP self-agreement of default-model directories, measured as train_default_model.py measures it.

Greedy continuations (64 tokens, float32, cached) of held-out prefixes of 96 tokens; at every row t
whose t+1 and t+2 were generated, the MTP's argmax from (h_t, token t+1) against token t+2. Scored on
the first stage's 32 prompts and on one prompt from every held-out file of 256 tokens or more (the
32 are the first of those), so models can be compared on a sample with a smaller standard error.
A directory is read as the loaders read it: int4 tensors dequantized where config.json has a
quantization_config, else float.

  python3 scripts/mtp_self_agreement.py models/kestrel-coder OLD_DIR [--out FILE.json]

The held-out split is the training corpus's (the interpreter's *.py files, sha1 % 100 == 0), so
run it where the model was trained.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_default_model as tdm  # noqa: E402
from transformers import Qwen3_5TextConfig  # noqa: E402


def load(model_dir, device):
    with open(os.path.join(model_dir, "config.json")) as f:
        cj = json.load(f)
    path = os.path.join(model_dir, "model.safetensors")
    if "quantization_config" in cj:
        cfg = Qwen3_5TextConfig.from_dict({k: v for k, v in cj.items() if k != "quantization_config"})
        return tdm.load_int4_reference(path, cfg, cj["quantization_config"]["group_size"], device)
    model, mtp = tdm.load_float_reference(model_dir)
    return model.to(device), mtp.to(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", help="model directories (config.json, model.safetensors, tokenizer.json)")
    ap.add_argument("--seed", type=int, default=1234, help="the first stage's seed, which picks the prompts")
    ap.add_argument("--max-file-bytes", type=int, default=1_000_000)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from tokenizers import Tokenizer
    docs, _ = tdm.read_corpus(tdm.python_roots(), args.max_file_bytes)
    held_docs = [(h, t) for h, t in docs if tdm.is_heldout(h)]
    results = []
    for model_dir in args.models:
        tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        eot = tok.token_to_id("<|endoftext|>")
        wide = tdm.self_agreement_prompts(tok, held_docs, args.seed, count=len(held_docs))
        model, mtp = load(model_dir, device)
        first, first_n, _ = tdm.mtp_self_agreement(model, mtp, wide[:32], 64, eot, device)
        every, every_n, _ = tdm.mtp_self_agreement(model, mtp, wide, 64, eot, device)
        r = {"model": model_dir, "prompts_32": {"value": first, "positions": first_n},
             f"prompts_{len(wide)}": {"value": every, "positions": every_n}}
        print(json.dumps(r), flush=True)
        results.append(r)
        del model, mtp
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
