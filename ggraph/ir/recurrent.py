"""Recurrent-layer ops: the causal depthwise convolution with carried state (LFM2's short conv, Mamba's
conv1d) and Mamba-2's selective state-space scan, each a composite with a fused kernel.

- ``causal_conv x state w [bias] -> (y, new_state)``: x f32[T, C], state f32[K-1, C] (the K-1 inputs
  before this step, oldest first), w f32[C, K] as GGUF stores a conv weight; with xx = concat(state, x),
  ``y[t, c] = sum_k w[c, k]·xx[t+k, c] (+ bias[c])`` and ``new_state = xx[T:]`` (ggml's ``ssm_conv``,
  its sum in k order, each term fused into the running sum as ggml's C compiles it, the bias added after).
  Its decomposition is concat, slices over the symbolic T and fma.
- ``ssm_scan state x dt A B C -> (y, new_state)``: state f32[H, D, N], x f32[T, H, D], dt f32[T, H],
  A f32[H], B and C f32[T, G, N]. Per token t and head h (group g = h // (H/G)):
  ``dt' = softplus(dt[t, h])``, ``state[h] = state[h]·exp(dt'·A[h]) + (x[t, h]·dt') ⊗ B[t, g]``,
  ``y[t, h] = state[h] · C[t, g]`` (ggml's ``ssm_scan`` for Mamba-2: one decay per head). Its
  decomposition is ``ops.scan`` over T.

The fused forms (``fused_causal_conv``, ``fused_ssm_scan``) have the same operands and numpy rules;
``fuse_recurrent`` puts them in place of the composites, and the llvm backend has one kernel for each.
Their ``overwrite`` param (set where the graph writes new_state back over a state input with
``state_write``) makes new_state the state operand's storage, so the write-back copies nothing.
"""
from __future__ import annotations

import numpy as np

from ggraph.ir import methods  # noqa: F401  (Tracer operators, used by the decompositions)
from ggraph.ir.composites import composite
from ggraph.ir.dtypes import Aval, f32
from ggraph.ir.primitive import ShapeError, register
from ggraph.ir.prims import (_np_fma, broadcast_to, concat, dequant, exp, fma, greater, io_bytes, log, reduce_sum,
                             reshape, slice, where)
from ggraph.ir.scan import scan
from ggraph.ir.trace import Tracer

__all__ = ["causal_conv", "ssm_scan"]

SOFTPLUS_LINEAR = 20.0        # softplus(x) = x above this, as ggml's ggml_compute_softplus_f32 has it
SCAN_CHUNK, SCAN_LANES = 64, 16   # ggml's AVX-512 dot in ssm_scan: 4 accumulators of 16 lanes per 64 states


# ---------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------

def _plain_f32(op: str, name: str, a, ndim: int, want: str) -> None:
    if a.dtype is not f32 or a.ndim != ndim:
        raise ShapeError(f"{op}: {name} must be f32{want}, got {a}")


def causal_conv_shape(op: str, x, state, w, bias=None) -> tuple[Aval, Aval]:
    """(y f32[T, C], new_state f32[K-1, C]) for causal_conv's operand avals, or a ShapeError naming the operand."""
    _plain_f32(op, "x", x, 2, "[T, C]")
    _plain_f32(op, "w", w, 2, "[C, K] (the conv weight, K taps per channel)")
    C, K = w.shape
    if not isinstance(C, int) or not isinstance(K, int) or K < 1:
        raise ShapeError(f"{op}: w must be a static f32[C, K] with K >= 1, got {w}")
    if x.shape[1] != C:
        raise ShapeError(f"{op}: x {x} has {x.shape[1]} channels but w {w} has {C}")
    _plain_f32(op, "state", state, 2, f"[{K - 1}, {C}] (the {K - 1} inputs before this step)")
    if tuple(state.shape) != (K - 1, C):
        raise ShapeError(f"{op}: state must be f32[{K - 1}, {C}] (the {K - 1} inputs before this step), got {state}")
    if bias is not None and (bias.dtype is not f32 or tuple(bias.shape) != (C,)):
        raise ShapeError(f"{op}: bias must be f32[{C}], got {bias}")
    return Aval(x.shape, f32), Aval((K - 1, C), f32)


def ssm_scan_shape(op: str, state, x, dt, A, B, C) -> tuple[Aval, Aval]:
    """(y f32[T, H, D], new_state f32[H, D, N]) for ssm_scan's operand avals, or a ShapeError naming the operand."""
    _plain_f32(op, "state", state, 3, "[H, D, N] (heads, head dim, state size)")
    H, D, N = state.shape
    if not all(isinstance(d, int) for d in state.shape):
        raise ShapeError(f"{op}: state must have a static shape [H, D, N], got {state}")
    _plain_f32(op, "x", x, 3, f"[T, {H}, {D}]")
    if tuple(x.shape[1:]) != (H, D):
        raise ShapeError(f"{op}: x must be f32[T, {H}, {D}] to match state {state}, got {x}")
    T = x.shape[0]
    _plain_f32(op, "dt", dt, 2, f"[T, {H}]")
    if tuple(dt.shape) != (T, H):
        raise ShapeError(f"{op}: dt must be f32[{T}, {H}], one step per token and head, got {dt}")
    if A.dtype is not f32 or tuple(A.shape) != (H,):
        raise ShapeError(f"{op}: A must be f32[{H}], one decay per head (Mamba-2), got {A}")
    for name, a in (("B", B), ("C", C)):
        _plain_f32(op, name, a, 3, f"[{T}, G, {N}]")
        if a.shape[0] != T or a.shape[2] != N or not isinstance(a.shape[1], int):
            raise ShapeError(f"{op}: {name} must be f32[{T}, G, {N}] (groups, state size {N}), got {a}")
    G = B.shape[1]
    if C.shape[1] != G:
        raise ShapeError(f"{op}: B {B} and C {C} have different group counts")
    if G < 1 or H % G:
        raise ShapeError(f"{op}: {H} heads are not a multiple of the {G} groups of B and C")
    return Aval(x.shape, f32), Aval(state.shape, f32)


# ---------------------------------------------------------------------------------------
# numpy rules: ggml's arithmetic, step by step
# ---------------------------------------------------------------------------------------

def np_causal_conv(x, state, w, bias=None):
    """ggml_ssm_conv: each output the running sum over taps k = 0..K-1 with each product fused into it
    (C compiled with FMA contracts ``sum += s·c``), then + bias."""
    T = x.shape[0]
    K = w.shape[1]
    xx = np.concatenate([state, x], axis=0).astype(np.float32)                   # (T+K-1, C)
    y = xx[0:T] * w[:, 0]
    for k in range(1, K):
        y = _np_fma(xx[k:k + T], w[:, k], y)
    if bias is not None:
        y = y + bias
    return y.astype(np.float32), np.ascontiguousarray(xx[T:])


def np_softplus(x):
    """ggml_compute_softplus_f32: logf(1 + expf(x)) in f32 steps, and x itself above 20 (each exp and log
    rounded once from f64; glibc's expf and logf, which ggml calls, are within an ulp of that)."""
    with np.errstate(over="ignore"):
        e = np.exp(x.astype(np.float64)).astype(np.float32)
    sp = np.log((np.float32(1) + e).astype(np.float64)).astype(np.float32)
    return np.where(x > SOFTPLUS_LINEAR, x, sp).astype(np.float32)


def np_ssm_scan(state, x, dt, A, B, C):
    """ggml_ssm_scan's Mamba-2 branch token by token: state = fma(state, dA, B·x_dt) (the first product
    fused, as ggml's C compiles ``s·dA + B·x_dt``), and y summed as ggml's AVX-512 loop sums it: each
    64 states into 4 × 16 lane accumulators by fma, those added pairwise and halved lane-wise to one,
    then the states past the last whole 64 fused in one by one."""
    T, H, D = x.shape
    N = state.shape[-1]
    G = B.shape[1]
    g = np.arange(H) // (H // G)
    sp = np_softplus(dt)                                                          # (T, H)
    dA = np.exp((sp * A.reshape(H)).astype(np.float64)).astype(np.float32)       # (T, H)
    x_dt = (x * sp[:, :, None]).astype(np.float32)                               # (T, H, D)
    s = np.array(state, np.float32)                                               # (H, D, N)
    y = np.empty((T, H, D), np.float32)
    whole = N - N % SCAN_CHUNK
    for t in range(T):
        Bt, Ct = B[t, g][:, None, :], C[t, g][:, None, :]                         # (H, 1, N)
        s = _np_fma(s, dA[t][:, None, None], (Bt * x_dt[t][:, :, None]).astype(np.float32))
        acc = np.zeros((H, D, SCAN_CHUNK // SCAN_LANES, SCAN_LANES), np.float32)
        for i in range(0, whole, SCAN_CHUNK):
            shape = (H, D, SCAN_CHUNK // SCAN_LANES, SCAN_LANES)
            acc = _np_fma(s[..., i:i + SCAN_CHUNK].reshape(shape),
                          np.broadcast_to(Ct[..., i:i + SCAN_CHUNK], (H, D, SCAN_CHUNK)).reshape(shape), acc)
        v = (acc[:, :, 0] + acc[:, :, 2]) + (acc[:, :, 1] + acc[:, :, 3])       # (H, D, 16)
        while v.shape[-1] > 1:
            half = v.shape[-1] // 2
            v = v[..., :half] + v[..., half:]
        total = v[..., 0]
        for i in range(whole, N):
            total = _np_fma(s[..., i], Ct[..., i], total)
        y[t] = total
    return y, s


# ---------------------------------------------------------------------------------------
# causal_conv
# ---------------------------------------------------------------------------------------

def _conv_cost(eqn, dims):
    T, C = eqn.inputs[0].aval.concrete(dims)
    K = eqn.inputs[2].aval.shape[1]
    return 2 * T * C * K, io_bytes(eqn, dims)


@composite("causal_conv", np_causal_conv, cost=_conv_cost)
def _causal_conv(x, state, w, bias=None):
    """concat(state, x), then y = sum over taps of slices of it times w's columns (fused in tap order), + bias."""
    T = x.shape[0]
    Cn, K = w.shape
    xx = concat([state, x], axis=0) if K > 1 else x                              # (T+K-1, C)
    y = None
    for k in range(K):
        xk = slice(xx, 0, k, k + T)                                              # (T, C): rows k..k+T-1
        wk = reshape(slice(w, 1, k, k + 1), (Cn,))                               # (C,): tap k of each channel
        y = xk * wk if y is None else fma(xk, wk, y)
    if bias is not None:
        y = y + bias
    return y, slice(xx, 0, T, T + K - 1)                                          # (K-1, C): the last K-1 rows


def causal_conv(x, state, w, bias=None):
    """Causal depthwise convolution of x f32[T, C] with K taps per channel, carrying the last K-1 inputs.

    ``state`` f32[K-1, C] holds the K-1 inputs before this step, oldest first (zeros at the start);
    ``w`` is the conv weight as GGUF stores it, [C, K] (a Mamba file's [C, 1, K] is taken too, and a
    float weight of another type is dequantised); ``bias`` f32[C] is optional. Returns
    ``(y f32[T, C], new_state f32[K-1, C])`` with ``y[t, c] = sum_k w[c, k]·xx[t+k, c] (+ bias[c])``
    over xx = concat(state, x), and new_state = its last K-1 rows: what the next step takes as state.
    Prefill and decode are the same call (T = 1 for decode)."""
    if isinstance(w, Tracer) and w.ndim == 3 and w.shape[1] == 1:
        w = reshape(w, (w.shape[0], w.shape[2]))                                  # Mamba's [C, 1, K]
    if isinstance(w, Tracer) and w.dtype is not f32 and not w.dtype.is_quantized:
        w = dequant(w)
    operands = (x, state, w) + (() if bias is None else (bias,))
    causal_conv_shape("causal_conv", *[_aval(a) for a in operands])
    return _causal_conv(*operands)


def _aval(a):
    return a.aval if isinstance(a, Tracer) else Aval(np.shape(a), f32)


def _overwriting(rule, state_at: int):
    """The numpy rule of a fused op whose ``overwrite`` param says new_state goes into the state operand's
    storage (a state the graph writes back with state_write anyway), as its kernel then does."""
    def impl(*arrays, overwrite=False):
        y, new = rule(*arrays)
        if not overwrite:
            return y, new
        state = arrays[state_at]
        state[...] = new
        return y, state
    return impl


def _overwrite_aliases(state_at: int):
    return lambda e: {1: state_at} if e.params.get("overwrite") else {}


fused_causal_conv_p = register(
    "fused_causal_conv", kind="fused", multiple_results=True, in_place=False, effects=True,
    impl=_overwriting(np_causal_conv, 1), aliases=_overwrite_aliases(1), cost=_conv_cost,
    shape=lambda x, state, w, bias=None, overwrite=False: causal_conv_shape("fused_causal_conv", x, state, w, bias),
    doc="causal_conv as one kernel: (y, new_state) in one pass over x, channels split across threads; with "
        "overwrite, new_state is written over the state operand")
causal_conv_p = _causal_conv.prim


# ---------------------------------------------------------------------------------------
# ssm_scan
# ---------------------------------------------------------------------------------------

def _scan_cost(eqn, dims):
    """Per token and state element: the decay, the input and the dot with C (5 flops); bytes moved once."""
    T = eqn.inputs[1].aval.concrete(dims)[0]
    H, D, N = eqn.inputs[0].aval.shape
    return 5 * T * H * D * N, io_bytes(eqn, dims)


def softplus(x):
    """log(1 + exp(x)), and x itself above 20 (ggml's softplus)."""
    return where(greater(x, SOFTPLUS_LINEAR), x, log(exp(x) + 1.0))


@composite("ssm_scan", np_ssm_scan, cost=_scan_cost)
def _ssm_scan(state, x, dt, A, B, C):
    """ops.scan over the tokens, the state [H, D, N] the carry: decay it, add the token's input, dot with C."""
    H, D, N = state.shape
    G = B.shape[1]

    def per_head(v):                                                              # (G, N) -> (H, 1, N)
        return reshape(broadcast_to(reshape(v, (G, 1, N)), (G, H // G, N)), (H, 1, N))

    def step(s, token):
        x_t, dt_t, B_t, C_t = token                                               # (H, D), (H,), (G, N), (G, N)
        sp = softplus(dt_t)                                                       # (H,)
        dA = exp(sp * A)                                                          # (H,)
        x_dt = x_t * reshape(sp, (H, 1))                                          # (H, D)
        s = fma(s, reshape(dA, (H, 1, 1)), per_head(B_t) * reshape(x_dt, (H, D, 1)))
        return s, reshape(reduce_sum(s * per_head(C_t)), (H, D))                 # (H, D, N), (H, D)
    final, y = scan(step, state, (x, dt, B, C))
    return y, final


def ssm_scan(state, x, dt, A, B, C):
    """Mamba-2's selective state-space scan over T tokens, as llama.cpp's ``ggml_ssm_scan`` computes it.

    state f32[H, D, N] (heads, head dim, state size), x f32[T, H, D], dt f32[T, H] (before softplus),
    A f32[H] (one decay per head; GGUF's [H, 1] is taken too), B and C f32[T, G, N] (G groups, head h
    reads group h // (H/G)). Per token: dt' = softplus(dt), state = state·exp(dt'·A) + (x·dt') ⊗ B,
    y = state · C. Returns ``(y f32[T, H, D], new_state f32[H, D, N])``; prefill and decode are the same
    call, the state carried from one to the next. Mamba-2's D skip and gate are the caller's."""
    if isinstance(A, Tracer) and A.ndim == 2 and A.shape[1] == 1:
        A = reshape(A, (A.shape[0],))                                             # GGUF's [H, 1]
    operands = (state, x, dt, A, B, C)
    ssm_scan_shape("ssm_scan", *[_aval(a) for a in operands])
    return _ssm_scan(*operands)


def _ssm_scan_fused_shape(state, x, dt, A, B, C, overwrite=False):
    return ssm_scan_shape("fused_ssm_scan", state, x, dt, A, B, C)


fused_ssm_scan_p = register(
    "fused_ssm_scan", kind="fused", multiple_results=True, in_place=False, effects=True,
    impl=_overwriting(np_ssm_scan, 0), aliases=_overwrite_aliases(0), cost=_scan_cost, shape=_ssm_scan_fused_shape,
    doc="ssm_scan as one kernel: the state rows in registers across the T tokens, (head, rows) split across "
        "threads; with overwrite, new_state is written over the state operand")
ssm_scan_p = _ssm_scan.prim

# composite -> (its kernel's op, which operand is the state)
FUSED = {causal_conv_p: (fused_causal_conv_p, 1), ssm_scan_p: (fused_ssm_scan_p, 0)}
