"""The gated delta rule (Gated DeltaNet: Qwen3-Next's and Qwen3.5's linear attention) as a composite with a
fused kernel, as llama.cpp's ``ggml_gated_delta_net`` computes it.

    y, new_state = gated_delta_rule(q, k, v, g, beta, state)

q, k f32[T, Hk, Dk], v f32[T, Hv, Dv], g and beta f32[T, Hv], state f32[Hv, Dv, Dk]; value head h reads key
head h // (Hv/Hk) (k and q repeated head by head, as llama.cpp repeats them for qwen3next). The state is ggml's
layout, S transposed: row j of head h, ``M[h, j, :]``, is column j of the (Dk × Dv) matrix S, so every step
reads and writes whole contiguous rows. Per token t and value head h:

    M = M · exp(g[t, h])                               # the gate: a decay per head (g is its log)
    d[j] = (v[t, h, j] - M[j, :] · k[t, h]) · beta[t, h]  # the delta: what the memory misses of v
    M[j, :] = M[j, :] + d[j] · k[t, h]                 # S += k ⊗ d (fused multiply-adds)
    y[t, h, j] = (M[j, :] · q[t, h]) · scale           # scale = 1/sqrt(Dk) unless given

q and k arrive l2-normed and beta as sigmoid(b): both are the caller's, as in llama.cpp's graph. Its
decomposition is ``ops.scan`` over the tokens with M the carry; ``fuse_recurrent`` puts
``fused_gated_delta_rule`` (one kernel: heads split across threads, each head's rows of M kept in registers
over all T tokens) in its place. Prefill and decode are the same call (T = 1 for decode).
"""
from __future__ import annotations

import math

import numpy as np

from ggraph.ir import methods  # noqa: F401  (Tracer operators, used by the decomposition)
from ggraph.ir.composites import composite
from ggraph.ir.dtypes import Aval, f32, from_numpy
from ggraph.ir.prims import _np_fma, broadcast_to, exp, fma, io_bytes, reduce_sum, reshape
from ggraph.ir.primitive import ShapeError, register
from ggraph.ir.recurrent import FUSED, _overwrite_aliases, _overwriting
from ggraph.ir.scan import scan
from ggraph.ir.trace import Tracer

__all__ = ["gated_delta_rule"]


# ---------------------------------------------------------------------------------------
# shape
# ---------------------------------------------------------------------------------------

def delta_rule_shape(op: str, q, k, v, g, beta, state, **_) -> tuple[Aval, Aval]:
    """(y f32[T, Hv, Dv], new_state f32[Hv, Dv, Dk]) for the operand avals, or a ShapeError naming the operand."""
    for name, a, nd, want in (("q", q, 3, "[T, Hk, Dk]"), ("k", k, 3, "[T, Hk, Dk]"), ("v", v, 3, "[T, Hv, Dv]"),
                              ("g", g, 2, "[T, Hv]"), ("beta", beta, 2, "[T, Hv]"),
                              ("state", state, 3, "[Hv, Dv, Dk]")):
        if a.dtype is not f32 or a.ndim != nd:
            raise ShapeError(f"{op}: {name} must be f32{want}, got {a}")
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    if not all(isinstance(d, int) for d in (Hk, Dk, Hv, Dv)):
        raise ShapeError(f"{op}: heads and head sizes must be static, got q {q}, v {v}")
    if tuple(k.shape) != tuple(q.shape):
        raise ShapeError(f"{op}: k must be shaped as q {q}, got {k}")
    if v.shape[0] != T:
        raise ShapeError(f"{op}: v {v} has another token count than q {q}")
    if Hk < 1 or Hv % Hk:
        raise ShapeError(f"{op}: v's {Hv} heads are not a multiple of q and k's {Hk} heads")
    for name, a in (("g", g), ("beta", beta)):
        if tuple(a.shape) != (T, Hv):
            raise ShapeError(f"{op}: {name} must be f32[{T}, {Hv}] (one per token and value head), got {a}")
    if tuple(state.shape) != (Hv, Dv, Dk):
        raise ShapeError(f"{op}: state must be f32[{Hv}, {Dv}, {Dk}] (value heads, value dim, key dim), got {state}")
    return Aval(v.shape, f32), Aval(state.shape, f32)


# ---------------------------------------------------------------------------------------
# the numpy rule: ggml's f32 steps, token by token
# ---------------------------------------------------------------------------------------

def np_gated_delta_rule(q, k, v, g, beta, state, *, scale):
    """ggml_gated_delta_net's loop in f32: the decay a product, each dot summed in f32, the rank-1 update
    fused (C compiled with FMA), the output dot times scale."""
    T, Hk, Dk = q.shape
    Hv = v.shape[1]
    heads = np.arange(Hv) // (Hv // Hk)
    qh, kh = q[:, heads].astype(np.float32), k[:, heads].astype(np.float32)            # (T, Hv, Dk)
    decay = np.exp(g.astype(np.float64)).astype(np.float32)                            # (T, Hv)
    M = np.array(state, np.float32)                                                     # (Hv, Dv, Dk)
    y = np.empty(v.shape, np.float32)
    for t in range(T):
        M = M * decay[t][:, None, None]
        sk = np.einsum("hji,hi->hj", M, kh[t])                                         # (Hv, Dv) f32 sums
        d = ((v[t] - sk) * beta[t][:, None]).astype(np.float32)
        M = _np_fma(d[:, :, None], kh[t][:, None, :], M)
        y[t] = np.einsum("hji,hi->hj", M, qh[t]) * np.float32(scale)
    return y, M


def _cost(eqn, dims):
    """Per token and state element: the decay, two dots and the update (7 flops); bytes moved once."""
    T = eqn.inputs[0].aval.concrete(dims)[0]
    Hv, Dv, Dk = eqn.inputs[5].aval.shape
    return 7 * T * Hv * Dv * Dk, io_bytes(eqn, dims)


# ---------------------------------------------------------------------------------------
# the composite: a scan over the tokens
# ---------------------------------------------------------------------------------------

@composite("gated_delta_rule", np_gated_delta_rule, cost=_cost)
def _gated_delta_rule(q, k, v, g, beta, state, *, scale):
    """ops.scan over the tokens, M [Hv, Dv, Dk] the carry: decay, the delta against M·k, the rank-1 update, M·q."""
    Hv, Dv, Dk = state.shape
    Hk = q.shape[1]

    def per_value_head(x):                                                        # (Hk, Dk) -> (Hv, 1, Dk)
        x = broadcast_to(reshape(x, (Hk, 1, Dk)), (Hk, Hv // Hk, Dk))
        return reshape(x, (Hv, 1, Dk))

    def step(M, token):
        q_t, k_t, v_t, g_t, b_t = token                                           # (Hk, Dk) x2, (Hv, Dv), (Hv,) x2
        qh, kh = per_value_head(q_t), per_value_head(k_t)                        # (Hv, 1, Dk)
        M = M * reshape(exp(g_t), (Hv, 1, 1))
        d = (v_t - reshape(reduce_sum(M * kh), (Hv, Dv))) * reshape(b_t, (Hv, 1))   # (Hv, Dv)
        M = fma(reshape(d, (Hv, Dv, 1)), kh, M)                                  # M[j, :] += d[j]·k
        return M, reshape(reduce_sum(M * qh), (Hv, Dv)) * scale                  # (Hv, Dv, Dk), (Hv, Dv)
    final, y = scan(step, state, (q, k, v, g, beta))
    return y, final


def gated_delta_rule(q, k, v, g, beta, state, *, scale: float | None = None):
    """The gated delta rule over T tokens, as llama.cpp's ``ggml_gated_delta_net`` computes it (module docstring).

    q, k f32[T, Hk, Dk] (l2-normed by the caller), v f32[T, Hv, Dv], g f32[T, Hv] (the log of each token's
    decay), beta f32[T, Hv] (the write strength, sigmoid(b)), state f32[Hv, Dv, Dk] (S transposed: zeros at
    the start); Hv a multiple of Hk, value head h reading key head h // (Hv/Hk). ``scale`` multiplies the
    output (default 1/sqrt(Dk)). Returns ``(y f32[T, Hv, Dv], new_state f32[Hv, Dv, Dk])``."""
    operands = (q, k, v, g, beta, state)
    delta_rule_shape("gated_delta_rule", *[_aval(a) for a in operands])
    scale = 1.0 / math.sqrt(_aval(q).shape[2]) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"gated_delta_rule: scale must be a finite number, got {scale}")
    return _gated_delta_rule(*operands, scale=scale)


def _aval(a):
    return a.aval if isinstance(a, Tracer) else Aval(np.shape(a), from_numpy(np.asarray(a).dtype))


def _fused_shape(q, k, v, g, beta, state, *, scale, overwrite=False):
    return delta_rule_shape("fused_gated_delta_rule", q, k, v, g, beta, state)


def _fused_impl(*arrays, scale, overwrite=False):
    return _overwriting(lambda *a: np_gated_delta_rule(*a, scale=scale), 5)(*arrays, overwrite=overwrite)


fused_gated_delta_rule_p = register(
    "fused_gated_delta_rule", kind="fused", multiple_results=True, in_place=False, effects=True,
    impl=_fused_impl, aliases=_overwrite_aliases(5), cost=_cost, shape=_fused_shape,
    doc="gated_delta_rule as one kernel: each value head's state rows in registers across the T tokens, "
        "heads split across threads; with overwrite, new_state is written over the state operand")
gated_delta_rule_p = _gated_delta_rule.prim
FUSED[gated_delta_rule_p] = (fused_gated_delta_rule_p, 5)            # fuse_recurrent's pairing, the state
