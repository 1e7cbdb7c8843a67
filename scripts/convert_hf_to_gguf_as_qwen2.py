"""Runs llama.cpp's convert_hf_to_gguf.py unchanged, except that a tokenizer whose pre-tokenizer
hash is not in the converter's list is taken as "qwen2" (the embedded model's tokenizer splits
text with the Qwen2 regex; the converter refuses unknown hashes).

Usage: convert_hf_to_gguf_as_qwen2.py LLAMA_CPP_SRC MODEL_DIR [converter arguments...]
"""
import runpy
import sys
from pathlib import Path

src = Path(sys.argv.pop(1))
sys.path.insert(0, str(src))
sys.path.insert(1, str(src / "gguf-py"))
import conversion.base as base  # noqa: E402  (importable only once the tree is on the path)

known_pre = base.TextModel.get_vocab_base_pre


def known_pre_or_qwen2(self, tokenizer):
    try:
        return known_pre(self, tokenizer)
    except NotImplementedError:
        return "qwen2"


base.TextModel.get_vocab_base_pre = known_pre_or_qwen2
sys.argv[0] = str(src / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
