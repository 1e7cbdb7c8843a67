#!/usr/bin/env bash
# Makes the llama.cpp fixtures of tests/peer_fixtures.rs with llama.cpp's own tools: a small BF16
# Qwen3.5 model (MODEL, default the 7.7M-parameter model that was the embedded default before the
# int4 one, taken from git at commit 2fdb0a7: 15 MB, so that its quantized files stay small enough
# to commit) converted by convert_hf_to_gguf.py to BF16 and quantized by
# llama-quantize to Q8_0, Q4_K_M, Q6_K and IQ4_XS; then llama.cpp's greedy 64-token continuation
# of `def fib(n):` (llama-completion, --temp 0) and its perplexity on models/kestrel-coder/heldout.txt
# (llama-perplexity -c 512) for each, written to tests/fixtures/peer/llamacpp.json.
#
# llama.cpp is the tree vendored in the PyPI sdist of llama-cpp-python (pinned: the JSON records
# what this version gives); only llama-quantize, llama-completion and llama-perplexity are built.
# The converter needs torch: its PyPI wheel with its CUDA libraries (about 5 GB unpacked, no GPU
# used). Everything goes under WORK (default target/test-assets/peer), reused when present.
#
# Usage: [MODEL=DIR] scripts/make_peer_fixtures.sh [WORK]
#   KEEP_ALL=1 also copies all five GGUFs to WORK/gguf (the test reads them from
#   KESTREL_PEER_GGUF_DIR=WORK/gguf; only Q4_K_M and IQ4_XS, 10 MB together, are committed).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$(mkdir -p "${1:-target/test-assets/peer}" && cd "${1:-target/test-assets/peer}" && pwd)
model=${MODEL:-}
if [ -z "$model" ]; then
  model=$work/kestrel-coder-7m
  mkdir -p "$model"
  for f in config.json model.safetensors tokenizer.json tokenizer_config.json; do
    git -C "$repo" show "2fdb0a7:models/kestrel-coder/$f" > "$model/$f"
  done
fi
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
src=$work/llama.cpp
jobs=${JOBS:-2}
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }

# 1. llama.cpp's source from the sdist (pip prepares an sdist's metadata before it downloads
#    it, which needs its build backend; cmake comes from its PyPI wheel).
python3 -m pip install -q --disable-pip-version-check --only-binary :all: --target "$work/tools" cmake scikit-build-core
export PATH="$work/tools/bin:$PATH"
if [ ! -f "$src/convert_hf_to_gguf.py" ]; then
  dl=$(mktemp -d)
  PYTHONPATH="$work/tools" python3 -m pip download -q --disable-pip-version-check \
    --no-deps --no-build-isolation --no-binary :all: -d "$dl" "llama-cpp-python==$version"
  tar -xzf "$dl/llama_cpp_python-$version.tar.gz" -C "$dl"
  rm -rf "$src"; mv "$dl/llama_cpp_python-$version/vendor/llama.cpp" "$src"; rm -rf "$dl"
  # Only the three tools are configured (the others need libraries this script does not build).
  cat > "$src/tools/CMakeLists.txt" <<'CM'
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(perplexity)
add_subdirectory(quantize)
add_subdirectory(completion)
CM
fi
stamp "llama.cpp $version source in $src"

# 2. Build (CPU, Release, as shared/peer/build_llamacpp.sh builds it).
bin=$src/build/bin
if [ ! -x "$bin/llama-quantize" ] || [ ! -x "$bin/llama-completion" ] || [ ! -x "$bin/llama-perplexity" ]; then
  cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DCMAKE_BUILD_RPATH="$bin" >"$work/cmake.log"
  cmake --build "$src/build" -j "$jobs" --target llama-quantize llama-completion llama-perplexity >"$work/build.log"
fi
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
stamp "llama.cpp built"

# 3. What convert_hf_to_gguf.py imports (its requirements file names torch, numpy, transformers,
#    sentencepiece, protobuf).
py=$work/py
if ! PYTHONPATH="$py" python3 -c "import torch, numpy, transformers, sentencepiece" >/dev/null 2>&1; then
  python3 -m pip install -q --disable-pip-version-check --target "$py" \
    "torch==2.11.0" "numpy~=2.2.6" "transformers==4.57.6" "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21.0,<5.0.0"
fi
stamp "converter's Python packages in $py"

# 4. Convert and quantize. The embedded model's tokenizer is not in the converter's list of known
#    pre-tokenizer hashes; it splits text with the Qwen2 regex, so it is converted as `qwen2`.
out=$work/out; rm -rf "$out"; mkdir -p "$out"
convert=(python3 "$repo/scripts/convert_hf_to_gguf_as_qwen2.py" "$src" "$model" --outtype bf16 --outfile "$out/kc-BF16.gguf")
PYTHONPATH="$py" "${convert[@]}" >"$out/convert.log" 2>&1
for t in Q8_0 Q4_K_M Q6_K IQ4_XS; do
  "$bin/llama-quantize" "$out/kc-BF16.gguf" "$out/kc-$t.gguf" "$t" "$jobs" >"$out/quantize-$t.log" 2>&1
done
stamp "converted and quantized"

# 5. llama.cpp's results. llama-completion prints text, not ids: its prompt cache (a session file:
#    magic, version, token count, then the int32 ids of the prompt and the generated tokens)
#    holds the ids. It stores the tokens it evaluated, so it is asked for 65 to record 64.
heldout=$repo/models/kestrel-coder/heldout.txt
for t in BF16 Q8_0 Q4_K_M Q6_K IQ4_XS; do
  rm -f "$out/session-$t.bin"
  "$bin/llama-completion" -m "$out/kc-$t.gguf" -p "def fib(n):" -n 65 --temp 0 --seed 0 -no-cnv -t "$jobs" --verbose-prompt \
    --prompt-cache "$out/session-$t.bin" --prompt-cache-all >"$out/completion-$t.txt" 2>"$out/completion-$t.log"
  "$bin/llama-perplexity" -m "$out/kc-$t.gguf" -f "$heldout" -c 512 -t "$jobs" >"$out/perplexity-$t.txt" 2>"$out/perplexity-$t.log"
done
stamp "llama.cpp's continuations and perplexities"

python3 "$repo/scripts/peer_reference_json.py" "$out" "$version" "$("$bin/llama-completion" --version 2>&1 | grep -m1 "^version" || true)" \
  >"$repo/tests/fixtures/peer/llamacpp.json"
for t in Q4_K_M IQ4_XS; do cp "$out/kc-$t.gguf" "$repo/tests/fixtures/peer/"; done
if [ "${KEEP_ALL:-0}" = 1 ]; then mkdir -p "$work/gguf"; cp "$out"/kc-*.gguf "$work/gguf/"; fi
stamp "wrote tests/fixtures/peer/llamacpp.json"
