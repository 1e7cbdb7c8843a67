#!/usr/bin/env python3
"""References for the fixture models under Kestrel's precision contract: every linear layer takes
its input rounded to bf16 (round to nearest even) and multiplies it by the stored weights with f32
sums, as tensor cores do and as the GPU backend and the CPU backend's default mode compute; the
residual stream, norms, attention and the delta rule stay f32.

transformers computes them itself: the fixtures of scripts/make_fixtures.py are loaded in float32
and `torch.nn.functional.linear` (which nn.Linear, the routers and the stacked experts call) is
wrapped to round its input first. Nothing else changes.

Writes, next to each fixture's reference.safetensors, reference-bf16-activations.safetensors:
  prompt_ids    I64 [T]          the same prompt ids as reference.safetensors
  logits        F32 [T, vocab]   one full forward over the prompt (no cache)
  greedy_ids    I64 [32]         generate(do_sample=False, EOS disabled), HF's cached decode path
  greedy_logits F32 [32, vocab]  the logits generate() chose each greedy token from
metadata: versions, the largest logit change against the f32 reference, the smallest top-2 gap.

Run from the repo root (CPU only): python3 scripts/make_bf16_activation_references.py
"""

import argparse
import contextlib
import importlib.util
import os

os.environ["USE_HUB_KERNELS"] = "0"

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import transformers
from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(HERE, "make_fixtures.py"))
fixtures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fixtures)


@contextlib.contextmanager
def bf16_linear_inputs():
    """F.linear with its input rounded to bf16 (weights are stored in bf16/f16/f32 already)."""
    plain = F.linear

    def rounded(x, w, b=None):
        return plain(x.to(torch.bfloat16).to(x.dtype), w, b)

    F.linear = rounded
    try:
        yield
    finally:
        F.linear = plain


def load_dense(folder):
    """qwen35-dense is stored in the real checkpoints' nested layout: map names back."""
    cfg = Qwen3_5Config.from_pretrained(folder).text_config
    m = Qwen3_5ForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    back = {}
    for k, v in load_file(os.path.join(folder, "model.safetensors")).items():
        if k.startswith("mtp."):
            continue
        k = "model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k
        back[k] = v.float()
    missing, unexpected = m.load_state_dict(back, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_word_embeddings]
    assert not missing and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        m.tie_weights()
    return m


def load_auto(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                experts_implementation="eager")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="tests/fixtures")
    args = ap.parse_args()
    for name, load in (("qwen35-dense", load_dense), ("qwen35-moe", load_auto), ("qwen3-next", load_auto)):
        folder = os.path.join(args.fixtures, name)
        ref = load_file(os.path.join(folder, "reference.safetensors"))
        prompt_ids = ref["prompt_ids"]
        model = load(folder).eval()
        with torch.no_grad():
            plain = model(input_ids=prompt_ids[None], use_cache=False).logits[0].float()
        f32_check = (plain - ref["logits"]).abs().max().item()
        assert f32_check < 1e-3, f"{name}: reloaded f32 forward off its reference by {f32_check}"
        with bf16_linear_inputs():
            full, greedy, glogits, stats = fixtures.references(model, prompt_ids)
        moved = (full - ref["logits"]).abs().max().item()
        rel = moved / ref["logits"].abs().max().item()
        print(f"{name}: bf16 linear inputs move the logits by {moved:.4g} (max abs; {rel:.3g} of the largest), "
              f"min greedy top-2 gap {stats['min_greedy_top2_gap']:.4g}, "
              f"greedy ids equal to f32's for {int((greedy == ref['greedy_ids']).cumprod(0).sum())} tokens")
        meta = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "contract": "F.linear inputs rounded to bf16 (nearest even), f32 sums; all else f32",
            "max_abs_change_vs_f32_reference": f"{moved:.6g}",
            **stats,
        }
        fixtures.save_reference(folder, prompt_ids, full, greedy, glogits, meta, name="reference-bf16-activations.safetensors")


if __name__ == "__main__":
    main()
