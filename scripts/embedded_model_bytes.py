#!/usr/bin/env python3
"""Takes the embedded default model's bytes out of prebuilt binaries, and puts them back.

Every kestrel binary and test binary embeds models/kestrel-coder/model.safetensors (29 MB, int4,
nearly incompressible). A GPU machine receives a checkout that already holds that file, and what
travels there is limited, so scripts/pack_gpu_check.sh zeroes the embedded copy in each binary
(`strip`) and the machine writes the checkout's file back in place (`restore`) before running them.

  embedded_model_bytes.py strip MODEL BINARY...     zero each copy in place; prints `offset length`
  embedded_model_bytes.py restore MODEL BINARY...   write MODEL back where `strip` zeroed it
Offsets are kept beside each binary in BINARY.model-offsets.
"""

import sys


def copies(data, model):
    """Offsets of every copy of `model` in `data`."""
    found, start = [], 0
    while (i := data.find(model[:4096], start)) >= 0:
        if data[i:i + len(model)] == model:
            found.append(i)
        start = i + 1
    return found


def main():
    verb, model_path, binaries = sys.argv[1], sys.argv[2], sys.argv[3:]
    model = open(model_path, "rb").read()
    for path in binaries:
        if path.endswith(".model-offsets"):
            continue
        if verb == "strip":
            data = bytearray(open(path, "rb").read())
            offsets = copies(data, model)
            for i in offsets:
                data[i:i + len(model)] = bytes(len(model))
            open(path, "wb").write(data)
            open(path + ".model-offsets", "w").write("\n".join(map(str, offsets)) + "\n")
            print(path, offsets, len(model))
        elif verb == "restore":
            offsets = [int(x) for x in open(path + ".model-offsets").read().split()]
            with open(path, "r+b") as f:
                for i in offsets:
                    f.seek(i)
                    if f.read(4096) != bytes(4096):
                        sys.exit(f"{path}: offset {i} is not a zeroed model copy")
                    f.seek(i)
                    f.write(model)
        else:
            sys.exit(f"unknown verb {verb}")


if __name__ == "__main__":
    main()
