#!/usr/bin/env python3
"""Int4 checkpoints of the dense test fixture made by the real `auto-round` package, with
transformers' own logits of each as the reference.

    python3 -m pip install --target /tmp/ar auto-round==0.16.1 transformers==5.24.0   (pulls torch)
    PYTHONPATH=/tmp/ar python3 scripts/make_autoround_fixtures.py

For each recipe below it runs AutoRound (signed-gradient rounding, a few iterations, on the CPU)
over tests/fixtures/qwen35-dense with calibration text from the default model's held-out file,
saves the result in the recipe's export format, then loads that directory back with
transformers (which unpacks it through auto-round's own CPU kernels) and records its logits
on the fixture's prompt and its greedy continuation. A loader that unpacks the checkpoint as
auto-round means it must reproduce those logits up to f32 rounding: that is what
tests/autoround_checkpoints.rs checks. Outputs (a few hundred KB each):
  tests/fixtures/autoround/<recipe>/{config.json, model.safetensors, quantization_config.json?,
                                    tokenizer files, reference.safetensors}
"""

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as q35
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "fixtures" / "qwen35-dense"
OUT = ROOT / "tests" / "fixtures" / "autoround"
CALIBRATION = ROOT / "models" / "kestrel-coder" / "heldout.txt"

# (name, bits, group size, symmetric, export formats): each recipe is quantized once and saved
# in every format listed, `fake` (the dequantized weights, as auto-round computes them) last.
RECIPES = [
    ("sym-g32", 4, 32, True, "auto_gptq,auto_round,fake"),
    ("asym-g64", 4, 64, False, "auto_gptq,fake"),  # auto_round asym exports AWQ packing, which 0.16.1 fails to save
]

_eager = q35.eager_attention_forward


def eager_with_causal_mask(module, query, key, value, attention_mask, *args, **kwargs):
    # auto-round 0.16.1 hands full-attention layers the cached 2-D padding mask, which eager
    # attention cannot broadcast: build the causal 4-D mask it stands for.
    if attention_mask is not None and attention_mask.dim() == 2:
        n = query.shape[-2]
        causal = torch.full((n, n), float("-inf"), dtype=query.dtype, device=query.device).triu(1)
        pad = (1.0 - attention_mask[:, None, None, :].to(query.dtype)) * torch.finfo(query.dtype).min
        attention_mask = causal[None, None] + pad
    return _eager(module, query, key, value, attention_mask, *args, **kwargs)


def text_only(tmp):
    """The fixture as a text-only Qwen3_5ForCausalLM checkpoint: with the vision config of the
    original, auto-round takes it for a multimodal model and asks for an image processor."""
    model = AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.float32)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(SOURCE).save_pretrained(tmp)
    return tmp


def quantize(source, name, bits, group, sym, fmt):
    from auto_round import AutoRound

    torch.manual_seed(0)
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="eager")
    text = CALIBRATION.read_text()
    calib = [text[i : i + 1500] for i in range(0, 24000, 1500)]
    q35.eager_attention_forward = eager_with_causal_mask
    ar = AutoRound(model, tok, bits=bits, group_size=group, sym=sym, dataset=calib, iters=20, nsamples=len(calib), seqlen=128,
                   device_map="cpu", enable_torch_compile=False)
    ar.quantize_and_save(str(out), format=fmt)
    q35.eager_attention_forward = _eager
    return flatten(out)


def flatten(out):
    """auto-round saves into a subfolder named after the model and recipe (`<model>-w4g32`),
    one folder per export format inside: move those up."""
    inner = [p for p in out.iterdir() if p.is_dir() and "-w4g" in p.name]
    for d in inner:
        for f in d.iterdir():
            f.rename(out / f.name)
        d.rmdir()
    return out


def record_reference(out):
    """Transformers' logits and greedy ids of the `fake` export (then removed: the packed
    exports are what is kept)."""
    reference = load_file(str(SOURCE / "reference.safetensors"))
    prompt = reference["prompt_ids"]
    fake = out / "fake"
    model = AutoModelForCausalLM.from_pretrained(fake, dtype=torch.float32, device_map="cpu")
    model.eval()
    with torch.no_grad():
        logits = model(prompt[None]).logits[0].float()
        ids = prompt.clone()
        greedy = []
        for _ in range(16):
            nxt = model(ids[None]).logits[0, -1].argmax()
            greedy.append(int(nxt))
            ids = torch.cat([ids, nxt[None]])
    save_file({"prompt_ids": prompt, "logits": logits.contiguous(), "greedy_ids": torch.tensor(greedy, dtype=torch.int64)}, str(out / "reference.safetensors"))
    shutil.rmtree(fake)
    for export in sorted(p for p in out.iterdir() if p.is_dir()):
        q = json.loads((export / "config.json").read_text()).get("quantization_config", {})
        print(f"{out.name}/{export.name}: {q.get('quant_method')} {q.get('packing_format')} bits {q.get('bits')} group {q.get('group_size')} sym {q.get('sym')}")
    print(f"  greedy {greedy}")


def main():
    import tempfile

    names = sys.argv[1:]
    if names[:1] == ["--reference-only"]:
        for name in names[1:]:
            record_reference(OUT / name)
        return
    with tempfile.TemporaryDirectory() as tmp:
        source = text_only(Path(tmp))
        for recipe in RECIPES:
            if names and recipe[0] not in names:
                continue
            out = quantize(source, *recipe)
            record_reference(out)


if __name__ == "__main__":
    main()
