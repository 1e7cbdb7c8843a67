#!/usr/bin/env bash
# Builds the release binary and the KV-format GPU test binaries (and cuda_kv_dtypes with the
# planted verify-row bug), and packs them with scripts/kv_gpu_check.sh for a GPU machine that
# has no Rust toolchain:
#   bash scripts/pack_kv_gpu_check.sh [ARCHIVE]   (default target/kv-gpu-check.tar.xz)
# There, from a checkout of the same commit:
#   mkdir -p /tmp/k && tar -C /tmp/k -xJf ARCHIVE && bash /tmp/k/kv_gpu_check.sh /tmp/k OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
archive=${1:-target/kv-gpu-check.tar.xz}
stage=$(mktemp -d)
cargo build --release --bin kestrel
cargo test --release --no-run --test cuda_kv_dtypes --test cuda_model 2>&1 | tee /tmp/kestrel-kv-gpu-build.log
for t in cuda_kv_dtypes cuda_model; do
  cp "$(grep -o "target/release/deps/$t-[0-9a-f]*" /tmp/kestrel-kv-gpu-build.log | tail -1)" "$stage/$t"
done
cargo test --release --no-run --features plant-verify-skips-cache --test cuda_kv_dtypes 2>&1 | tee /tmp/kestrel-kv-gpu-build.log
cp "$(grep -o "target/release/deps/cuda_kv_dtypes-[0-9a-f]*" /tmp/kestrel-kv-gpu-build.log | tail -1)" "$stage/cuda_kv_dtypes_planted"
cp target/release/kestrel scripts/kv_gpu_check.sh "$stage"/
strip "$stage"/kestrel "$stage"/cuda_* 2>/dev/null || true
# One stream with a dictionary larger than a binary: the binaries share the embedded model, so
# the archive holds it about once (it must fit the 64 MiB a GPU call carries beside a checkout).
tar -C "$stage" -cf - . | xz -9e --lzma2=preset=9e,dict=192MiB -T1 > "$archive"
rm -rf "$stage"
ls -la "$archive"
