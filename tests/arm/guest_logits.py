"""Run in the emulated guest: a model's logits on the llvm backend, saved for the host to compare.

    python guest_logits.py MODEL.gguf IDS OUT.npy [THREADS]      (IDS: comma-separated token ids)

Prints the feature set the program was built for. K and V caches are f32, as the oracle's llama.cpp
context keeps them.
"""
import sys

import numpy as np

from ggraph.runtime.session import Session


def main(path: str, ids: str, out: str, threads: str = "2") -> None:
    s = Session(path, backend="llvm", threads=int(threads), ctx=64, cache_type_k="f32", cache_type_v="f32")
    logits = s.logits([int(t) for t in ids.split(",")])
    np.save(out, logits)
    print(s.program(False).target.name)


if __name__ == "__main__":
    main(*sys.argv[1:])
