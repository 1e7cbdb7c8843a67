#!/usr/bin/env bash
# Puts llama.cpp's Qwen tokenizer test vectors into DEST_DIR: the vocab-only GGUF files
# models/ggml-vocab-qwen{2,35}.gguf (6 MB each, too large to commit) with their .inp/.out files
# (inputs and the ids Hugging Face's tokenizer gives for them), as vendored in the PyPI sdist of
# llama-cpp-python 0.3.36. The version is pinned because tests compare against these files.
#
# Usage: scripts/fetch_llamacpp_vocab.sh DEST_DIR
#   then: KESTREL_LLAMACPP_VOCAB_DIR=DEST_DIR cargo test (bash .ci/run does both)
set -euo pipefail

dest=${1:?usage: $0 DEST_DIR}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# pip prepares an sdist's metadata before it downloads it, which needs its build backend.
python3 -m pip install -q --disable-pip-version-check --only-binary :all: --target "$work/tools" cmake scikit-build-core
PATH="$work/tools/bin:$PATH" PYTHONPATH="$work/tools" python3 -m pip download -q --disable-pip-version-check \
  --no-deps --no-build-isolation --no-binary :all: -d "$work" "llama-cpp-python==$version"
root="llama_cpp_python-$version/vendor/llama.cpp/models"
members=()
for name in qwen2 qwen35; do
  for suffix in "" .inp .out; do members+=("$root/ggml-vocab-$name.gguf$suffix"); done
done
tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work" "${members[@]}"
mkdir -p "$dest"
cp "$work/$root"/ggml-vocab-qwen* "$dest/"
echo "llama.cpp vocab test vectors from llama-cpp-python $version are in $dest"
