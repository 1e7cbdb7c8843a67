"""HF transformers on the same shapes as examples/cuda_bench.rs (random bf16 weights on the GPU),
for comparison: batch-1 `generate` decode tokens/s after a prompt, and prefill tokens/s.

Usage: python3 scripts/hf_generate_bench.py PRESET [--prompt 512] [--decode 32] [--prefill 512,4096]
Prints one JSON object.
"""
import argparse, json, sys, time

import torch

PRESETS = {
    "qwen3.5-9b": dict(kind="dense", hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                       intermediate_size=12288, linear_num_value_heads=32),
    "qwen3.5-35b-a3b": dict(kind="moe", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            linear_num_value_heads=32),
}


def build(preset):
    p = dict(PRESETS[preset])
    kind = p.pop("kind")
    common = dict(vocab_size=248320, head_dim=256, rms_norm_eps=1e-6, linear_num_key_heads=16, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False, max_position_embeddings=32768,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    common.update(p)
    if kind == "dense":
        from transformers import Qwen3_5ForCausalLM as Model, Qwen3_5TextConfig as Config
    else:
        from transformers import Qwen3_5MoeForCausalLM as Model, Qwen3_5MoeTextConfig as Config
    cfg = Config(**common)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Model(cfg)
    model.eval()
    return model, cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--prefill", default="512,4096")
    a = ap.parse_args()
    import transformers
    t0 = time.time()
    model, cfg = build(a.preset)
    torch.cuda.synchronize()
    out = {"preset": a.preset, "transformers": transformers.__version__, "torch": torch.__version__,
           "device": torch.cuda.get_device_name(), "init_seconds": time.time() - t0, "prefill": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for n in [int(x) for x in a.prefill.split(",")]:
            ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda", generator=g)
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.time()
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
                torch.cuda.synchronize()
                times.append(time.time() - t)
            s = sorted(times)[1]
            out["prefill"][str(n)] = {"seconds": s, "tokens_per_s": n / s}
        ids = torch.randint(0, cfg.vocab_size, (1, a.prompt), device="cuda", generator=g)
        runs = {}
        for new in (1, 1 + a.decode):
            torch.cuda.synchronize()
            t = time.time()
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            torch.cuda.synchronize()
            runs[new] = time.time() - t
        # Decode time alone: generate(1 + N) minus generate(1) (the prefill and first token).
        dt = (runs[1 + a.decode] - runs[1]) / a.decode
        out["decode"] = {"prompt_tokens": a.prompt, "steps": a.decode, "ms_per_token": dt * 1e3, "tokens_per_s": 1 / dt}
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
