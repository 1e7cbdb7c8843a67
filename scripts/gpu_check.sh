#!/usr/bin/env bash
# Runs the CUDA tests and the batch-1 decode benchmarks from prebuilt binaries (see
# scripts/pack_gpu_check.sh), from the root of a checkout of the same commit:
#   bash BIN_DIR/gpu_check.sh BIN_DIR OUT_DIR [PRESETS]
# Logs and JSON land in OUT_DIR. PRESETS defaults to qwen3.5-0.8b,qwen3.5-9b,qwen3.5-35b-a3b.
set -uo pipefail
bin=${1:?BIN_DIR}
out=${2:?OUT_DIR}
presets=${3:-qwen3.5-0.8b,qwen3.5-9b,qwen3.5-35b-a3b}
mkdir -p "$out"
python3 "$bin/embedded_model_bytes.py" restore models/kestrel-coder/model.safetensors "$bin"/kestrel "$bin"/cuda_* "$bin"/quant_bench || exit 1
export KESTREL_FIXTURES_DIR=$PWD/tests/fixtures
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader | tee "$out/gpu.txt"
status=0
for exe in "$bin"/cuda_*; do
  t=$(basename "$exe")
  case "$t" in cuda_bench | *.model-offsets) continue ;; esac
  "$bin/$t" --test-threads 1 > "$out/$t.log" 2>&1 || status=1
  tail -3 "$out/$t.log"
done
"$bin/cuda_bench" --presets "$presets" --prefill 512,4096 --decode 64 > "$out/cuda_bench.json" 2> "$out/cuda_bench.err" || status=1
tail -6 "$out/cuda_bench.json"
exit $status
