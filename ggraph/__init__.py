"""ggraph: a composable graph compiler for LLM inference on CPUs.

    import ggraph
    from ggraph import ops, f32
    graph = ggraph.trace(fn, f32["T", 256], ...)
    print(graph)
    fn = ggraph.compile(graph, backend="numpy")
"""
from ggraph import dtypes, prims, ops, fused  # noqa: F401  (registers the primitives, composites, fused ops)
from ggraph.core import Aval, Graph, Sym, dim, param
from ggraph.dtypes import bf16, f16, f32, i8, i32
from ggraph.trace import scope, trace

__version__ = "0.1.0"

__all__ = ["Aval", "Graph", "Sym", "dim", "param", "trace", "scope", "compile", "ops", "dtypes",
           "f32", "f16", "bf16", "i32", "i8"]


def compile(graph: Graph, backend: str = "numpy", passes="default", **options):
    """Run the pass pipeline on ``graph`` and build a callable for ``backend``."""
    from ggraph.compiler import compile_graph
    return compile_graph(graph, backend=backend, passes=passes, **options)
