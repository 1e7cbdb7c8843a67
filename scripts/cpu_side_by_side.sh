#!/usr/bin/env bash
# Kestrel's CPU backend against llama.cpp's CPU build on the same GGUF files, same threads,
# interleaved repeats (the machine is shared: take medians). Prints one line per run; the
# summary at the end is the median of each figure.
# Usage: scripts/cpu_side_by_side.sh LLAMA_BIN_DIR KESTREL TEXT THREADS REPEATS FILE.gguf...
# KESTREL_ARGS adds arguments to both kestrel commands (e.g. "--cpu-matmul int8").
set -uo pipefail
L=$1; K=$2; text=$3; t=$4; reps=$5; shift 5
read -r -a extra <<< "${KESTREL_ARGS:-}"
out=$(mktemp -d)
for r in $(seq "$reps"); do
  for f in "$@"; do
    n=$(basename "$f" .gguf)
    load=$(cut -d' ' -f1 /proc/loadavg)
    lb=$("$L/llama-bench" -m "$f" -t "$t" -p 128 -n 128 -r 1 -o json 2>/dev/null | python3 -c "import json,sys; d=json.load(sys.stdin); print(' '.join(str(round(x['avg_ts'])) for x in d))")
    kb=$("$K" bench --model "$f" --device cpu -t "$t" --dataset random --input-len 128 --max-tokens 128 --num-prompts 4 --concurrency 1 "${extra[@]}" --json 2>/dev/null \
      | python3 -c "import json,sys; d=json.loads([l for l in sys.stdin if l.startswith('{')][-1]); print(round(128000/d['ttft_ms']['median']), round(1000/d['itl_ms']['median']))")
    s0=$(date +%s.%N); "$L/llama-perplexity" -m "$f" -f "$text" -c 256 -b 256 -t "$t" > "$out/lp.txt" 2>&1; s1=$(date +%s.%N)
    "$K" perplexity --model "$f" --file "$text" --context 256 --device cpu -t "$t" "${extra[@]}" --json > "$out/kp.txt" 2>&1; s2=$(date +%s.%N)
    lppl=$(grep -o "Final estimate: PPL = [0-9.]*" "$out/lp.txt" | awk '{print $5}')
    kppl=$(python3 -c "import json; print(round(json.loads(open('$out/kp.txt').read().strip().splitlines()[-1])['perplexity'], 4))")
    echo "$n rep $r load $load | llama pp128 tg128: $lb | kestrel pp128 decode: $kb | ppl s llama $(echo "$s1 - $s0" | bc) kestrel $(echo "$s2 - $s1" | bc) | ppl llama $lppl kestrel $kppl"
  done
done | tee "$out/runs.txt"
python3 - "$out/runs.txt" <<'PY'
import re, statistics, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"(\S+) rep \d+ load (\S+) \| llama pp128 tg128: (\d+) (\d+) \| kestrel pp128 decode: (\d+) (\d+) \| ppl s llama (\S+) kestrel (\S+)", line)
    if m:
        rows[m[1]].append([float(x) for x in m.groups()[1:]])
print("| file | load | llama.cpp pp128 | Kestrel pp128 | llama.cpp tg128 | Kestrel decode | llama-perplexity s | kestrel perplexity s |")
print("|---|---|---|---|---|---|---|---|")
for n, v in rows.items():
    med = [statistics.median(c) for c in zip(*v)]
    print(f"| {n} | {med[0]:.1f} | {med[1]:.0f} | {med[3]:.0f} | {med[2]:.0f} | {med[4]:.0f} | {med[5]:.2f} | {med[6]:.2f} |")
PY
