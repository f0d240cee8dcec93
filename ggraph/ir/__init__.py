"""The IR: dims, dtypes and avals, the primitive table, graphs and their text, tracing.

    dims.py        symbolic dims (T, P+T) and their polynomials
    dtypes.py      element and GGUF block types; avals (``f32["T", 640]``)
    primitive.py   ``Primitive``: one table entry per op with every rule about it
    graph.py       Var, Literal, Eqn, Graph: checks, cost and the printed text
    text.py        parsing the printed text back into a Graph
    trace.py       tracing Python functions into graphs
    prims.py       the primitives; ``elementwise(...)`` registers a new one
    methods.py     Tracer operators and methods (``x + y``, ``x[:, :64]``, ``x.T``)
    composites.py  composites (rms_norm, softmax, rope, attention, ...) and ``@composite``
    recurrent.py   causal_conv and ssm_scan (recurrent layers) and their fused forms
    fused.py       the ops fusion passes produce: qmatmul, rope_attention, fused loops
"""
from ggraph.ir import composites, fused, methods, prims, recurrent  # noqa: F401  (register the op table)
from ggraph.ir.dims import Sym
from ggraph.ir.dtypes import Aval, DimAval, ParamAval, dim, param
from ggraph.ir.graph import Eqn, Graph, Literal, Var, VerifyError
from ggraph.ir.primitive import Primitive, ShapeError, get_primitive, primitives, register
from ggraph.ir.trace import bind, scope, trace

__all__ = ["Aval", "DimAval", "Eqn", "Graph", "Literal", "ParamAval", "Primitive", "ShapeError", "Sym", "Var",
           "VerifyError", "bind", "dim", "get_primitive", "param", "primitives", "register", "scope", "trace"]
