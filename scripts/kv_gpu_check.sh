#!/usr/bin/env bash
# The KV cache formats on a GPU, from prebuilt binaries (scripts/pack_kv_gpu_check.sh), run
# from the root of a checkout of the same commit:
#   bash BIN_DIR/kv_gpu_check.sh BIN_DIR OUT_DIR
# 1. Capacity and decode speed of qwen3.5-9b (dummy weights) per KV format at the default
#    --gpu-memory-utilization: kestrel bench at 1 and 32 concurrent sequences; the start-up line
#    gives the tokens that fit.
# 2. The GPU tests, each test of cuda_kv_dtypes in its own process beside the others, and
#    cuda_model; with the planted bug (verify rows skip the cached keys) the seed-40880 test must
#    fail. Logs land in OUT_DIR; the exit status is 0 when every check passed.
set -uo pipefail
bin=${1:?BIN_DIR}
out=${2:?OUT_DIR}
mkdir -p "$out"
export KESTREL_FIXTURES_DIR=${KESTREL_FIXTURES_DIR:-$PWD/tests/fixtures}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
status=0
for dtype in ${KV_BENCH_DTYPES:-bf16 f32 fp8 tq3}; do
  timeout "${KV_BENCH_TIMEOUT:-60}" "$bin/kestrel" bench --load-format dummy --model qwen3.5-9b --dataset random --input-len 128 \
    --num-prompts "${KV_BENCH_PROMPTS:-16}" --max-tokens "${KV_BENCH_TOKENS:-48}" --concurrency 1,32 --kv-cache-dtype "$dtype" --json > "$out/bench_$dtype.json" 2> "$out/bench_$dtype.err" || status=1
  echo "$dtype: $(grep -o 'KV cache .*' "$out/bench_$dtype.err" | head -1)"
  python3 -c 'import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print("  concurrency %d: %.1f output tok/s, tpot median %.2f ms" % (r["concurrency"], r["output_tokens_per_s"], r["tpot_ms"]["median"]))' "$out/bench_$dtype.json" || true
done
# The tests get what is left of KV_DEADLINE seconds (from the start of this script).
left=$(( ${KV_DEADLINE:-380} - SECONDS )); [ "$left" -lt 60 ] && left=60
pids=()
for t in $("$bin/cuda_kv_dtypes" --list 2>/dev/null | grep ': test$' | sed 's/: test$//'); do
  timeout "$left" "$bin/cuda_kv_dtypes" --exact "$t" --test-threads 1 > "$out/cuda_kv_dtypes.$t.log" 2>&1 &
  pids+=($!)
done
timeout "$left" "$bin/cuda_model" --test-threads 1 > "$out/cuda_model.log" 2>&1 &
pids+=($!)
if [ -x "$bin/cuda_kv_dtypes_planted" ]; then
  timeout "$left" "$bin/cuda_kv_dtypes_planted" seed_40880 > "$out/planted_seed_40880.log" 2>&1
  if grep -q 'test result: FAILED' "$out/planted_seed_40880.log"; then echo "planted bug: seed_40880 fails, as it must"; else echo "planted bug: seed_40880 did NOT fail"; status=1; fi
fi
for p in "${pids[@]}"; do wait "$p" || status=1; done
for f in "$out"/cuda_*.log; do echo "$(basename "$f"): $(grep -E '^test result|panicked|timed out' "$f" | head -3 | tr '\n' ' ')"; done
exit $status
