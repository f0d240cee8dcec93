"""A compile worker: ``python -m ggraph.backends.llvm.compile_worker`` turns IR texts into object code.

The parent (``jit.Compiler``) writes pickles to stdin: the target, then ``(index, ir_text)`` per
job, then closes it; the worker answers on stdout with one pickle per job as it finishes,
``(index, object_bytes)``, or ``(index, error_message)`` as a str if LLVM rejects the text. A separate process per core is
how kernels compile in parallel: llvmlite serialises every call within one process.
"""
from __future__ import annotations

import os
import pickle
import sys


def main() -> int:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C reaches the whole process group: the parent
    #                                                  decides, and closes stdin (EOF) or goes away
    from ggraph.backends.llvm.jit import emit_object
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    target = pickle.load(inp)
    while True:
        try:
            index, text = pickle.load(inp)
        except EOFError:
            return 0
        try:
            result = emit_object(text, target)
        except Exception as e:                          # reported by the parent, naming the kernel
            result = f"{type(e).__name__}: {e}"
        try:
            pickle.dump((index, result), out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
        except BrokenPipeError:                        # the parent is gone: nobody to answer (and no flush at exit)
            os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
