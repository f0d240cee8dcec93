"""compile: run a pipeline of passes over a graph, then hand it to a backend."""
from __future__ import annotations

from ggraph.ir.graph import Graph


def _numpy_backend(graph, **options):
    from ggraph.backends.numpy_ref import NumpyProgram
    return NumpyProgram(graph, **options)


def _llvm_backend(graph, **options):
    from ggraph.backends.llvm.program import LLVMProgram
    return LLVMProgram(graph, **options)


BACKENDS = {
    "numpy": _numpy_backend,
    "llvm": _llvm_backend,
}


def optimize(graph: Graph, passes="default", disabled=(), log=None, dump_after=None) -> Graph:
    """Run a pipeline over ``graph``: a name, pass names, or passes resolved already (``ggraph.passes.resolve``)."""
    from ggraph import passes as P
    return P.run(graph, P.resolve(passes, disabled), log=log, dump_after=dump_after)


def compile_graph(graph: Graph, backend: str = "numpy", passes="default", disabled=(), log=None, **options):
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    return BACKENDS[backend](optimize(graph, passes, disabled, log), **options)
