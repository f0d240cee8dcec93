"""A compile worker: ``python -m ggraph.backends.llvm.compile_worker`` turns IR texts into object code.

The parent (``jit.compile_units``) writes one pickle to stdin, ``(target, [(index, ir_text), ...])``;
the worker answers on stdout with one pickle per text as it finishes, ``(index, object_bytes)``,
or ``(index, error_message)`` as a str if LLVM rejects the text. A separate process per core is
how kernels compile in parallel: llvmlite serialises every call within one process.
"""
from __future__ import annotations

import pickle
import sys


def main() -> int:
    from ggraph.backends.llvm.jit import emit_object
    target, jobs = pickle.load(sys.stdin.buffer)
    out = sys.stdout.buffer
    for index, text in jobs:
        try:
            result = emit_object(text, target)
        except Exception as e:                          # reported by the parent, naming the kernel
            result = f"{type(e).__name__}: {e}"
        pickle.dump((index, result), out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
