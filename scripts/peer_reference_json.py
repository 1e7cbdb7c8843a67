"""Collects llama.cpp's results made by scripts/make_peer_fixtures.sh into one JSON object (stdout):
for each GGUF its SHA-256, the greedy continuation's ids (read from llama-completion's session
file) and llama-perplexity's final estimate with the number of tokens it scored.

Usage: peer_reference_json.py OUT_DIR LLAMA_CPP_PYTHON_VERSION LLAMA_CPP_VERSION_LINE
"""
import hashlib
import json
import re
import struct
import sys
from pathlib import Path

PROMPT = "def fib(n):"
GENERATED = 64
CONTEXT = 512
TYPES = ["BF16", "Q8_0", "Q4_K_M", "Q6_K", "IQ4_XS"]


def session_ids(path: Path) -> list[int]:
    """The token ids at the head of a llama.cpp session file: u32 magic 'ggsn', u32 version, u32 count, i32 ids."""
    data = path.read_bytes()
    magic, _version, count = struct.unpack_from("<III", data)
    if magic != 0x6767736E:
        sys.exit(f"{path} is not a llama.cpp session file")
    return list(struct.unpack_from(f"<{count}i", data, 12))


def prompt_ids(log: str) -> list[int]:
    """The prompt's ids as llama-completion logs them: one `   ID -> 'piece'` line each."""
    return [int(m) for m in re.findall(r"^\S+ I +(\d+) -> '", log, re.M)]


def perplexity(log: str) -> tuple[float, int]:
    ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", log).group(1))
    chunks, n_ctx = map(int, re.search(r"perplexity over (\d+) chunks, n_ctx=(\d+)", log).groups())
    return ppl, chunks * (n_ctx - n_ctx // 2 - 1)


def main() -> None:
    out, sdist_version, llama_version = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    files = {}
    for t in TYPES:
        gguf = out / f"kc-{t}.gguf"
        prompt = prompt_ids((out / f"completion-{t}.log").read_text())
        ids = session_ids(out / f"session-{t}.bin")
        if ids[: len(prompt)] != prompt or len(ids) < len(prompt) + GENERATED:
            sys.exit(f"{t}: the session file does not hold the prompt and {GENERATED} generated tokens")
        ppl, scored = perplexity((out / f"perplexity-{t}.log").read_text())
        files[t] = {
            "file": gguf.name,
            "sha256": hashlib.sha256(gguf.read_bytes()).hexdigest(),
            "bytes": gguf.stat().st_size,
            "greedy_ids": ids[len(prompt) : len(prompt) + GENERATED],
            "perplexity": ppl,
            "perplexity_tokens": scored,
        }
    print(json.dumps({
        "llama_cpp": {
            "source": f"the llama.cpp tree vendored in the PyPI sdist llama-cpp-python {sdist_version}",
            "version": llama_version,
            "build": "CPU, Release, GGML_NATIVE=ON; llama-quantize, llama-completion, llama-perplexity",
        },
        "commands": {
            "convert": "scripts/convert_hf_to_gguf_as_qwen2.py LLAMA_CPP models/kestrel-coder --outtype bf16 --outfile kc-BF16.gguf",
            "quantize": "llama-quantize kc-BF16.gguf kc-TYPE.gguf TYPE 2",
            "greedy": f"llama-completion -m kc-TYPE.gguf -p '{PROMPT}' -n {GENERATED + 1} --temp 0 --seed 0 -no-cnv -t 2 --verbose-prompt --prompt-cache SESSION --prompt-cache-all (ids from SESSION: the prompt's, then {GENERATED} generated)",
            "perplexity": f"llama-perplexity -m kc-TYPE.gguf -f models/kestrel-coder/heldout.txt -c {CONTEXT} -t 2",
            "kestrel_greedy": f"kestrel run '{PROMPT}' --model kc-TYPE.gguf --temperature 0 --device cpu -n {GENERATED} --json",
            "kestrel_perplexity": f"kestrel perplexity --model kc-TYPE.gguf --file models/kestrel-coder/heldout.txt --context {CONTEXT} --score-second-half --device cpu --json",
        },
        "prompt": PROMPT,
        "prompt_ids": prompt_ids((out / f"completion-{TYPES[0]}.log").read_text()),
        "context": CONTEXT,
        "files": files,
    }, indent=1))


if __name__ == "__main__":
    main()
