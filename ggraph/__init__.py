"""ggraph: a composable graph compiler for LLM inference on CPUs.

    import ggraph
    from ggraph import ops, f32
    graph = ggraph.trace(fn, f32["T", 256], ...)
    print(graph)
    fn = ggraph.compile(graph, backend="llvm")
    s = ggraph.Session("model.gguf")

``ggraph.passes``, ``ggraph.quants``, ``ggraph.gguf``, ``ggraph.draw``, ``ggraph.models`` and
``ggraph.Session`` load on first use, so ``import ggraph`` stays light.
"""
from __future__ import annotations

import importlib

from ggraph import ops  # noqa: F401
from ggraph.ir import dtypes  # noqa: F401
from ggraph.ir.dims import Sym
from ggraph.ir.dtypes import Aval, bf16, dim, f16, f32, i8, i32, param
from ggraph.ir.graph import Graph
from ggraph.ir.trace import scope, trace

__version__ = "0.1.0"

__all__ = ["Aval", "Graph", "Session", "Sym", "compile", "dim", "draw", "dtypes", "f16", "f32", "bf16", "gguf",
           "i32", "i8", "models", "ops", "param", "passes", "quants", "scope", "trace"]

_LAZY = {  # attribute: (module, attribute or None for the module itself)
    "Session": ("ggraph.runtime.session", "Session"),
    "passes": ("ggraph.passes", None),
    "quants": ("ggraph.gguf.quants", None),
    "gguf": ("ggraph.gguf", None),
    "draw": ("ggraph.view.draw", None),
    "models": ("ggraph.models", None),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ggraph' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    return getattr(value, attr) if attr else value


def compile(graph: Graph, backend: str = "numpy", passes="default", **options):
    """Run the pass pipeline on ``graph`` and build a callable for ``backend`` ("numpy" or "llvm")."""
    from ggraph.compiler import compile_graph
    return compile_graph(graph, backend=backend, passes=passes, **options)
