#!/usr/bin/env bash
# Builds the release binary, cuda_bench and the CUDA test binaries, and packs them with
# scripts/gpu_check.sh into one archive for a GPU machine that has no Rust toolchain:
#   bash scripts/pack_gpu_check.sh [ARCHIVE]   (default target/gpu-check.tar.xz)
# There, from a checkout of the same commit (the tests read tests/fixtures, and the binaries get
# their embedded default model back from models/kestrel-coder):
#   mkdir -p /tmp/k && tar -C /tmp/k -xJf ARCHIVE && bash /tmp/k/gpu_check.sh /tmp/k OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
archive=${1:-target/gpu-check.tar.xz}
cargo build --release --bin kestrel --example cuda_bench --example quant_bench
# Every GPU test target (tests/cuda_*.rs; each skips without a GPU elsewhere).
mapfile -t tests < <(ls tests/cuda_*.rs | xargs -n1 basename | sed 's/\.rs$//')
cargo test --release --no-run "${tests[@]/#/--test=}" 2>&1 | tee /tmp/kestrel-gpu-check-build.log
stage=$(mktemp -d)
cp target/release/kestrel target/release/examples/cuda_bench target/release/examples/quant_bench scripts/gpu_check.sh "$stage"/
for t in "${tests[@]}"; do
  # The executable cargo just built for this test target.
  exe=$(grep -o "target/release/deps/$t-[0-9a-f]*" /tmp/kestrel-gpu-check-build.log | tail -1)
  cp "$exe" "$stage/$t"
done
# The embedded default model travels in the checkout: each binary's copy is zeroed here and
# written back there (scripts/embedded_model_bytes.py restore, which gpu_check.sh runs).
cp scripts/embedded_model_bytes.py "$stage"/
python3 scripts/embedded_model_bytes.py strip models/kestrel-coder/model.safetensors "$stage"/kestrel "$stage"/cuda_* "$stage"/quant_bench
tar -C "$stage" -cf - . | xz -6 --lzma2=dict=128MiB > "$archive"
rm -rf "$stage"
ls -la "$archive"
