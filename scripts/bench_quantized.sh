#!/usr/bin/env bash
# Kestrel's decode and prefill speed per weight format on dummy (random) weights at real sizes,
# with the lengths of the llama.cpp side-by-side run (../shared/peer/side_by_side.sh): prefill of
# 4096 tokens, and 256 tokens generated after 32-token prompts at 1 / 8 / 32 / 64 sequences.
#   bash scripts/bench_quantized.sh KESTREL_BIN OUT_DIR [PRESET] [FORMATS]
# PRESET defaults to qwen3.5-9b, FORMATS to "none q4_k int4 fp8" (--quantization values).
# Writes OUT_DIR/bench-FORMAT.txt (kestrel's JSON lines and stderr) and prints a table.
set -uo pipefail
kes=${1:?KESTREL_BIN}
out=${2:?OUT_DIR}
preset=${3:-qwen3.5-9b}
formats=${4:-none q4_k int4 fp8}
mkdir -p "$out"
echo "| weights | GPU weight GiB | load s | prefill 4096 tok/s | decode tok/s at 1 / 8 / 32 / 64 sequences |"
echo "|---|---|---|---|---|"
for q in $formats; do
  f="$out/bench-$q.txt"
  : > "$f"
  K="$kes bench --load-format dummy --model $preset --quantization $q --device cuda --spec none --dataset random --json"
  timeout 300 $K --input-len 4096 --max-tokens 2 --num-prompts 3 --concurrency 1 --max-model-len 8192 --max-num-batched-tokens 8192 >> "$f" 2>&1
  timeout 300 $K --input-len 32 --max-tokens 256 --num-prompts 4 --concurrency 1 >> "$f" 2>&1
  timeout 400 $K --input-len 32 --max-tokens 256 --num-prompts 64 --concurrency 8,32,64 >> "$f" 2>&1
  python3 - "$f" "$q" <<'PY'
import json, re, sys
text = open(sys.argv[1]).read()
rows = [json.loads(l) for l in text.splitlines() if l.startswith('{')]
loads = re.findall(r'weights loaded in ([0-9.]+) s, ([0-9.]+) GiB', text)
pre = round(4096 / rows[0]['ttft_ms']['median'] * 1000) if rows else '-'
dec = ' / '.join(str(round(r['output_tokens_per_s'])) for r in rows[1:])
print(f"| {sys.argv[2]} | {loads[0][1] if loads else '-'} | {loads[-1][0] if loads else '-'} | {pre} | {dec} |")
PY
done
