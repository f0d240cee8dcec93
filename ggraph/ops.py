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
from ggraph.ir.attention_mods import alibi, chunked, sliding_window, softcap
from ggraph.ir.composites import composite
from ggraph.ir.dtypes import f32
from ggraph.ir.methods import dot, index  # noqa: F401
from ggraph.ir.prims import *  # noqa: F401,F403
from ggraph.ir.prims import __all__ as _prims
from ggraph.ir.fused import expert_linear_cost, expert_linear_impl, expert_linear_shape
from ggraph.ir.prims import broadcast_to, dequant, matmul, reshape, take
from ggraph.ir.recurrent import causal_conv, ssm_scan
from ggraph.ir.scan import scan
from ggraph.ir.delta_rule import gated_delta_rule

__all__ = list(_prims) + list(_composites) + ["dot", "index", "linear", "expert_linear", "alibi", "chunked",
                                              "sliding_window", "softcap", "scan", "causal_conv", "ssm_scan",
                                              "gated_delta_rule"]


def linear(x, w, b=None):
    """``x @ w.T (+ b)`` with w [out, in] as GGUF stores it; a quantised w traces as matmul(x, dequant(w))."""
    if w.dtype is not f32:
        w = dequant(w)
    y = matmul(x, w)
    return y if b is None else y + b


@composite("expert_linear", expert_linear_impl, cost=expert_linear_cost)
def expert_linear(x, w_experts, ids):
    """Each token times its chosen experts: x f32[T, K], w_experts [E, N, K] (quantised or float, as GGUF
    stores MoE experts), ids i32[T, k] -> f32[T, k, N] with ``out[t, j] = x[t] @ w_experts[ids[t, j]].T``.

    Its body is the unfused baseline (take the chosen experts as f32, then a batched matmul);
    fuse_dequant_matmul makes it one qmatmul_experts kernel that reads only the chosen experts' blocks."""
    T, K = x.shape
    k, N = ids.shape[1], w_experts.shape[1]
    expert_linear_shape("expert_linear", x.aval, w_experts.aval, ids.aval)
    xs = broadcast_to(reshape(x, (T, 1, 1, K)), (T, k, 1, K))                # (T, k, 1, K): x[t] for each expert
    return reshape(matmul(xs, take(w_experts, ids)), (T, k, N))              # (T, k, N, K) experts -> (T, k, N)
