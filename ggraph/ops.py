"""The ops models are written with: the primitives' functions, ``linear``, and the composites.

    from ggraph import ops
    h = ops.rms_norm(x, w, eps=1e-6)
    y = ops.linear(ops.gelu_tanh(ops.linear(h, w_up)), w_down)

A new elementwise primitive is ``ops.elementwise(name, numpy_rule, emit=...)``; a new
composite is a function decorated with ``@ops.composite(name, numpy_rule)``.
"""
from __future__ import annotations

from ggraph.ir.composites import *  # noqa: F401,F403
from ggraph.ir.composites import __all__ as _composites
from ggraph.ir.dtypes import f32
from ggraph.ir.methods import dot, index  # noqa: F401
from ggraph.ir.prims import *  # noqa: F401,F403
from ggraph.ir.prims import __all__ as _prims
from ggraph.ir.prims import dequant, matmul

__all__ = list(_prims) + list(_composites) + ["dot", "index", "linear"]


def linear(x, w, b=None):
    """``x @ w.T (+ b)`` with w [out, in] as GGUF stores it; a quantised w traces as matmul(x, dequant(w))."""
    if w.dtype is not f32:
        w = dequant(w)
    y = matmul(x, w)
    return y if b is None else y + b
