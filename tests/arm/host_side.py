"""The test models and llama.cpp's results for tests run in the emulated guest, made by this host's Python.

The guest has no llama-cpp-python (and no x86 llama-quantize): as a pytest plugin in the guest,

    python tests/arm/emulator.py run --cpu max -- -m pytest -p tests.arm.host_side tests/test_llvm_models.py

it replaces ``zoo.cached_model`` and oracle's llama.cpp calls with calls to one server process of the
host's Python (this file run there: requests and answers pickled over its stdin and stdout). Files are
named by path, the same on both sides. A skip on the host (no llama-cpp-python) skips the guest's test.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import traceback
from pathlib import Path

HOSTED = {"zoo": ("cached_model",),
          "oracle": ("llama_logits", "llama_logits_stepwise", "llama_greedy", "llama_decided", "llama_logits_at",
                     "llama_tensors", "llama_tokenize")}
TESTS = Path(__file__).resolve().parents[1]


class _Host:
    """The host's server process, started on first use."""

    def __init__(self):
        self.proc = None

    def call(self, module: str, name: str, args, kwargs):
        import pytest
        if self.proc is None:
            python = os.environ.get("GGRAPH_COMPILE_PYTHON")
            if not python:
                raise RuntimeError("tests.arm.host_side: GGRAPH_COMPILE_PYTHON (the host's Python) is not set; "
                                   "run pytest through tests/arm/emulator.py")
            self.proc = subprocess.Popen([python, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        pickle.dump((module, name, args, kwargs), self.proc.stdin)
        self.proc.stdin.flush()
        try:
            kind, value = pickle.load(self.proc.stdout)
        except EOFError:
            raise RuntimeError(f"the host's {module}.{name} server exited {self.proc.wait()}") from None
        if kind == "skip":
            pytest.skip(f"on the host: {value}")
        if kind == "error":
            raise RuntimeError(f"the host's {module}.{name} failed:\n{value}")
        return value

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()


_HOST = _Host()


def _hosted(module: str, name: str):
    def call(*args, **kwargs):
        return _HOST.call(module, name, args, kwargs)
    call.__name__ = name
    call.__doc__ = f"{module}.{name}, run by the host's Python (tests/arm/host_side.py)"
    return call


def pytest_configure(config):
    """Guest side: route the hosted functions to the host (tests/ is on sys.path by now)."""
    import importlib
    for module, names in HOSTED.items():
        m = importlib.import_module(module)
        for name in names:
            setattr(m, name, _hosted(module, name))


def pytest_unconfigure(config):
    _HOST.close()


def serve() -> None:
    """Host side: answer requests on stdin until it closes; fd 1 carries answers only (llama.cpp's C
    code writes to stdout, so fd 1 becomes stderr for everything else)."""
    import importlib

    import pytest
    sys.path.insert(0, str(TESTS))
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    while True:
        try:
            module, name, args, kwargs = pickle.load(requests)
        except EOFError:
            return
        try:
            reply = ("ok", getattr(importlib.import_module(module), name)(*args, **kwargs))
        except pytest.skip.Exception as e:
            reply = ("skip", str(e.msg))
        except Exception:
            reply = ("error", traceback.format_exc())
        pickle.dump(reply, answers)
        answers.flush()


if __name__ == "__main__":
    serve()
