"""Composites: named regions that carry their decomposition into primitives, as StableHLO's do.

A composite (rms_norm, softmax, silu, gelu_tanh, swiglu, rope, attention, or one a user
registers with ``@composite``) is recorded as one eqn whose ``body`` is its traced
decomposition. Passes inline the body (the unfused baseline, and any composite no kernel
claims), fuse it whole (an elementwise or row-reduction composite becomes one fused
loop), or replace it with a dedicated kernel (rope + attention). Each composite also has
a direct numpy rule, so the decomposition itself is checked against it.

    @composite("layer_norm", lambda x, w, b, *, eps: ...)        # the numpy rule
    def layer_norm(x, w, b, *, eps):                              # the decomposition
        mu = reduce_sum(x) * (1.0 / x.shape[-1])
        ...
"""
from __future__ import annotations

import math

import numpy as np

from ggraph.ir import methods  # noqa: F401  (Tracer operators, used by the decompositions)
from ggraph.ir.dims import Sym, simplify
from ggraph.ir.dtypes import Aval, DimAval, f32
from ggraph.ir.primitive import ShapeError, register
from ggraph.ir.prims import (broadcast_to, cache_rows, cache_update, cache_write, cast, concat, cos, dequant, div,
                             equal, exp, fma, io_bytes, iota, less, matmul, neg, not_equal, reduce_max, reduce_mean,
                             reduce_sum, reshape, rsqrt, sin, slice, tanh, transpose, where)
from ggraph.ir.trace import Op, Tracer, bind, bind_composite, to_atom

__all__ = ["composite", "rms_norm", "softmax", "silu", "gelu_tanh", "swiglu", "rope", "attention",
           "rope_theta_scale", "rope_angles_table", "to_tracer", "ROPE_STYLES"]


# ---------------------------------------------------------------------------------------
# composites
# ---------------------------------------------------------------------------------------

def _composite_shape(*in_avals, body, **params):
    expected = [v.aval for v in body.invars]
    if len(in_avals) != len(expected) or not all(Aval.__eq__(a, b) for a, b in zip(in_avals, expected)):
        raise ShapeError(f"operands {', '.join(map(str, in_avals))} do not match the body's inputs "
                         f"{', '.join(map(str, expected))}")
    return tuple(o.aval for o in body.outvars)


def composite(name: str, numpy_rule, **rules):
    """Register a composite primitive whose decomposition is the decorated function.

    ``numpy_rule(*arrays, **params)`` states the same computation directly (the numpy backend
    runs it, and tests check the decomposition against it); ``rules`` are further Primitive
    rules (a cost rule, say). The decorated function returns the op to call."""
    def wrap(decomposition):
        prim = register(name, cls=Op, shape=_composite_shape, impl=numpy_rule, kind="composite",
                        decomposition=decomposition, doc=(decomposition.__doc__ or "").strip(), **rules)

        def op(*operands, **params):
            return bind_composite(prim, decomposition, operands, params)
        op.__name__, op.__doc__ = decomposition.__name__, decomposition.__doc__
        op.prim, op.decomposition = prim, decomposition
        return op
    return wrap


# -- numpy rules (the independent statement of each composite) --------------------------

def _np_rms_norm(x, w=None, *, eps):
    mean = (np.sum(x * x, axis=-1, keepdims=True, dtype=np.float64) / x.shape[-1]).astype(np.float32)
    y = x * (np.float32(1) / np.sqrt(mean + np.float32(eps)))
    return y if w is None else y * w


def _np_softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


def _np_silu(x):
    return (x / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def _np_gelu_tanh(x, *, f16_table=False):
    x64 = (x.astype(np.float16) if f16_table else x).astype(np.float64)
    y = (0.5 * x64 * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64 ** 3)))).astype(np.float32)
    if f16_table:
        y = np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, y.astype(np.float16).astype(np.float32)))
    return y.astype(np.float32)


def _np_swiglu(g, u):
    return (_np_silu(g) * u).astype(np.float32)


def rope_theta_scale(dims: int, base: float) -> np.float32:
    """base^(-2/dims) in f32, as ggml's powf gives it (glibc's powf works in f64 and rounds once, as
    here; numpy's f32 power is an ulp off for base 10000 and 64 dims, which llama's chained angles then
    carry to every pair): from one rotation pair's angle to the next's."""
    return np.float32(float(np.float32(base)) ** (float(np.float32(-2.0) / np.float32(dims))))


def rope_angles_table(positions: np.ndarray, *, dims: int, base: float, scale: float = 1.0,
                      freq_factors: np.ndarray | None = None) -> np.ndarray:
    """The rotation angles f32[T, dims/2] of each position, computed as ggml computes them: theta_0 = p,
    theta_(i+1) = theta_i · base^(-2/dims) rounded to f32 at every step, then / freq_factors[i] and
    · scale in f32. Pair i's angle drifts from p·base^(-2i/dims) by up to ~i ulps (~1e-3 rad at
    position 30000), but these are the angles llama.cpp rotates by: the rest of the model, and the
    next matmul's 8-bit rounding of its input above all, then sees the same numbers."""
    ts = rope_theta_scale(dims, base)
    theta = np.asarray(positions).astype(np.float32)
    out = np.empty((theta.size, dims // 2), np.float32)
    for i in range(dims // 2):
        out[:, i] = theta
        theta = theta * ts
    if freq_factors is not None:
        out = out / np.asarray(freq_factors, np.float32)
    return out if scale == 1.0 else out * np.float32(scale)


def _np_rope(x, positions, freq_factors=None, *, dims, base, scale, style, mscale=1.0):
    # x: (T, H, D); rotate the first `dims` dims of each head, as ggml's C compiled with FMA does:
    # x0·c − x1·s and x0·s + x1·c with the second product rounded to f32 and the first fused
    theta = rope_angles_table(positions, dims=dims, base=base, scale=scale, freq_factors=freq_factors)
    c = (np.cos(theta.astype(np.float64)).astype(np.float32) * np.float32(mscale))[:, None, :]   # (T, 1, dims/2)
    s = (np.sin(theta.astype(np.float64)).astype(np.float32) * np.float32(mscale))[:, None, :]
    xr = x[..., :dims]
    a, b = (xr[..., :dims // 2], xr[..., dims // 2:]) if style == "neox" else (xr[..., 0::2], xr[..., 1::2])
    fused = lambda p, q, rounded: (p.astype(np.float64) * q - rounded).astype(np.float32)  # noqa: E731
    r0, r1 = fused(a, c, b * s), fused(a, s, -(b * c))
    rot = np.concatenate([r0, r1], axis=-1) if style == "neox" else np.stack([r0, r1], axis=-1).reshape(xr.shape)
    return np.concatenate([rot, x[..., dims:]], axis=-1)


def _cache_and_sink(rest: tuple, sinks) -> tuple:
    """attention's optional trailing operands: (k_cache, v_cache, pos) or Nones, then the sinks or None."""
    k_cache, v_cache, pos = (rest[:-1] if sinks else rest) or (None, None, None)
    return k_cache, v_cache, pos, rest[-1] if sinks else None


def _np_attention(q, k, v, *rest, scale, window=None, softcap=None, chunk=None, score_mod=None, mask_mod=None,
                  sinks=None, batch=0):
    # q: (T, H, D)  k: (T, Hkv, D)  v: (T, Hkv, Dv)  caches: (C, Hkv, D|Dv)  [sinks: (H,)]
    k_cache, v_cache, pos, sink = _cache_and_sink(rest, sinks)
    T, H, _ = q.shape
    p = 0
    if k_cache is not None:
        p = int(pos)
        if p < 0 or p + T > k_cache.shape[0]:
            raise ValueError(f"attention: rows {p}..{p + T} do not fit a KV cache of {k_cache.shape[0]} rows")
        cache_write(k_cache, k, p)
        cache_write(v_cache, v, p)
        k, v = cache_rows(k_cache, p + T), cache_rows(v_cache, p + T)
    S, Hkv = k.shape[0], k.shape[1]
    kh = np.repeat(k.transpose(1, 0, 2), H // Hkv, axis=0).astype(np.float64)   # (H, S, D)
    vh = np.repeat(v.transpose(1, 0, 2), H // Hkv, axis=0).astype(np.float64)   # (H, S, Dv)
    s = np.einsum("thd,hsd->hts", q.astype(np.float64), kh) * scale              # (H, T, S)
    if softcap:
        s = np.tanh(s / softcap) * softcap
    qpos = (p + np.arange(T, dtype=np.int32))[:, None]
    kpos = np.arange(S, dtype=np.int32)[None, :]
    h = np.arange(H, dtype=np.int32)[:, None, None]
    if score_mod is not None:
        s = np.broadcast_to(score_mod.numpy(s, np.int32(batch), h, qpos, kpos), s.shape)
    masked = kpos > qpos
    if window:
        masked |= qpos - kpos >= window
    if chunk:
        masked |= qpos // chunk != kpos // chunk
    masked = np.broadcast_to(masked, s.shape)
    if mask_mod is not None:
        masked = masked | (mask_mod.numpy(np.int32(batch), h, qpos, kpos) == 0)
    s = np.where(masked, -np.inf, s)
    top = s.max(axis=-1, keepdims=True)
    if sink is not None:
        top = np.maximum(top, sink.astype(np.float64)[:, None, None])
    top = np.where(np.isneginf(top), 0.0, top)                                     # a row that sees nothing
    w = np.exp(s - top)
    total = w.sum(axis=-1, keepdims=True)
    if sink is not None:
        total += np.exp(sink.astype(np.float64)[:, None, None] - top)
    w = np.divide(w, total, out=np.zeros_like(w), where=total > 0)                 # ... gives zeros
    out = np.einsum("hts,hsd->thd", w, vh).astype(np.float32)                    # (T, H, Dv)
    return (out, k_cache, v_cache) if k_cache is not None else out


# -- decompositions ----------------------------------------------------------------------

@composite("rms_norm", _np_rms_norm)
def _rms_norm(x, w=None, *, eps):
    """x / sqrt(mean(x²) + eps) · w over the last axis; the mean of the f32 squares summed in f64, as
    ggml's rms_norm sums it (so that both give the same bits, which the next matmul's 8-bit rounding of
    its input would otherwise magnify)."""
    y = x * rsqrt(reduce_mean(x * x) + eps)
    return y if w is None else y * w


def rms_norm(x, w=None, *, eps: float):
    """RMS normalisation over the last axis, times the weight ``w`` if given."""
    return _rms_norm(x, eps=float(eps)) if w is None else _rms_norm(x, w, eps=float(eps))


@composite("softmax", _np_softmax)
def softmax(x):
    """exp(x - max x) / sum over the last axis."""
    e = exp(x - reduce_max(x))
    return e / reduce_sum(e)


@composite("silu", _np_silu)
def silu(x):
    """x · sigmoid(x)."""
    return x / (exp(neg(x)) + 1.0)


@composite("gelu_tanh", _np_gelu_tanh)
def _gelu_tanh(x, *, f16_table=False):
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))); with f16_table, as ggml's CPU table computes it."""
    xg = cast(cast(x, "f16"), "f32") if f16_table else x
    inner = (xg + xg * xg * xg * 0.044715) * math.sqrt(2.0 / math.pi)
    y = xg * (tanh(inner) + 1.0) * 0.5
    if not f16_table:
        return y
    y = cast(cast(y, "f16"), "f32")
    y = where(less(x, 10.0), y, x)                        # x >= 10: x
    return where(less(-10.0, x), y, 0.0)                  # x <= -10: 0


def gelu_tanh(x, *, f16_table: bool = False):
    """The tanh approximation of GELU.

    ``f16_table=True`` computes it as llama.cpp's CPU backend does: GELU of x rounded to
    f16, the result rounded to f16, and exact 0 / x beyond ±10 (ggml reads a 65536-entry
    f16 table). Models set it so their logits match llama.cpp's on the same file.
    """
    return _gelu_tanh(x, f16_table=True) if f16_table else _gelu_tanh(x)


@composite("swiglu", _np_swiglu)
def swiglu(g, u):
    """silu(g) · u, the gated FFN activation."""
    return silu(g) * u


def _rope_angles_shape(positions, freq_factors=None, *, dims, base, scale):
    if positions.ndim != 1 or positions.dtype.name != "i32":
        raise ShapeError(f"rope_angles: positions must be i32[T], got {positions}")
    if dims <= 0 or dims % 2:
        raise ShapeError(f"rope_angles: rotary dims {dims} must be even and positive")
    if freq_factors is not None and (freq_factors.dtype is not f32 or freq_factors.shape != (dims // 2,)):
        raise ShapeError(f"rope_angles: freq_factors must be f32[{dims // 2}], got {freq_factors}")
    return Aval((positions.shape[0], dims // 2), f32)


rope_angles_p = register(
    "rope_angles", shape=_rope_angles_shape, kind="other",
    cost=lambda eqn, dims: (2 * eqn.outputs[0].aval.numel(dims), io_bytes(eqn, dims)),
    impl=lambda positions, freq_factors=None, **p: rope_angles_table(positions, freq_factors=freq_factors, **p),
    doc="f32[T, dims/2]: each position's rope angles, chained in f32 as ggml computes them")


def rope_angles(positions, *freq_factors, dims: int, base: float, scale: float = 1.0):
    """The angles ``rope_angles_table`` gives, as a graph op: (T, dims/2)."""
    return bind(rope_angles_p, positions, *freq_factors, dims=int(dims), base=float(base), scale=float(scale))


@composite("rope", _np_rope)
def _rope(x, positions, freq_factors=None, *, dims, base, scale, style, mscale=1.0):
    """Rotate pairs of the first ``dims`` dims of each head by position·base^(-2i/dims), times mscale."""
    T, H, D = x.shape
    half = dims // 2
    ff = () if freq_factors is None else (freq_factors,)
    theta = rope_angles(positions, *ff, dims=dims, base=base, scale=scale)         # (T, dims/2)
    c = reshape(cos(theta) * mscale, (T, 1, half))
    s = reshape(sin(theta) * mscale, (T, 1, half))
    # ggml's x0·c − x1·s and x0·s + x1·c, as its C compiles with FMA: the first product fused
    if style == "neox":
        a, b = x[:, :, :half], x[:, :, half:dims]
        parts = [fma(a, c, -(b * s)), fma(a, s, b * c)]
    else:
        pairs = reshape(x[:, :, :dims], (T, H, half, 2))
        a = reshape(pairs[:, :, :, 0:1], (T, H, half))
        b = reshape(pairs[:, :, :, 1:2], (T, H, half))
        ra = reshape(fma(a, c, -(b * s)), (T, H, half, 1))
        rb = reshape(fma(a, s, b * c), (T, H, half, 1))
        parts = [reshape(concat([ra, rb], axis=-1), (T, H, dims))]
    if dims < D:
        parts.append(x[:, :, dims:])
    return concat(parts, axis=-1) if len(parts) > 1 else parts[0]


ROPE_STYLES = ("neox", "interleaved")


def rope(x, positions, *, base: float, dims: int | None = None, scale: float = 1.0,
         style: str = "neox", freq_factors=None, mscale: float = 1.0):
    """Rotary position embedding of x (T, H, D) at ``positions`` i32[T].

    style "interleaved" rotates pairs (x[2i], x[2i+1]) (llama); "neox" rotates
    (x[i], x[i+dims/2]) (qwen2, phi3, gemma). Only the first ``dims`` dims rotate.
    ``freq_factors`` (phi3's rope_factors) divides each pair's frequency; ``scale``
    multiplies positions (linear rope scaling); ``mscale`` multiplies cos and sin
    (llama.cpp's rope attn_factor).
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"rope: style must be one of {ROPE_STYLES}, got {style!r}")
    D = x.shape[-1]
    dims = D if dims is None else int(dims)
    if dims % 2 or not 0 < dims <= D:
        raise ValueError(f"rope: rotary dims {dims} must be even and at most the head dim {D}")
    params = dict(dims=dims, base=float(base), scale=float(scale), style=style)
    if mscale != 1.0:
        params["mscale"] = float(mscale)
    if freq_factors is None:
        return _rope(x, positions, **params)
    return _rope(x, positions, freq_factors, **params)


@composite("attention", _np_attention)
def _attention(q, k, v, *rest, scale, window=None, softcap=None, chunk=None, score_mod=None, mask_mod=None,
               sinks=None):
    """softmax(mask(mods(q·kᵀ·scale)))·v over the cache, with GQA by head groups (and sink logits)."""
    k_cache, v_cache, pos, sink = _cache_and_sink(rest, sinks)
    T, H, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    G = H // Hkv
    if k_cache is not None:
        k_cache = cache_update(k_cache, k, pos)
        v_cache = cache_update(v_cache, v, pos)
        P = Sym(pos.aval.symbol)
        S = simplify(P + T)
        k, v = slice(k_cache, 0, 0, S), slice(v_cache, 0, 0, S)                  # (S, Hkv, D)
        k, v = (x if x.aval.dtype is f32 else dequant(x) for x in (k, v))          # f16, bf16, q8_0, q4_0 caches
        qpos = iota(T) + pos                                                        # (T,)
    else:
        S = T
        qpos = iota(T)
    qg = reshape(transpose(reshape(q, (T, Hkv, G, D)), (1, 2, 0, 3)), (Hkv, G * T, D))
    kt = transpose(k, (1, 0, 2))                                                    # (Hkv, S, D)
    vt = transpose(v, (1, 2, 0))                                                    # (Hkv, Dv, S)
    s = matmul(qg, kt) * scale                                                      # (Hkv, G*T, S)
    if softcap:
        s = tanh(s * (1.0 / softcap)) * softcap
    kpos = iota(S)
    qcol = reshape(qpos, (T, 1))
    heads = reshape(iota(H), (Hkv, G, 1, 1))
    s = reshape(s, (Hkv, G, T, S))
    if score_mod is not None:
        s = broadcast_to(score_mod.inline(s, 0, heads, qcol, kpos), (Hkv, G, T, S))
    s = where(less(qcol, kpos), -np.inf, s)                                         # key after query
    if window:
        s = where(less(kpos, qcol - (window - 1)), -np.inf, s)                   # key too far back
    if chunk:
        s = where(not_equal(div(qcol, chunk), div(kpos, chunk)), -np.inf, s)      # key in another chunk
    if mask_mod is not None:
        s = where(mask_mod.inline(0, heads, qcol, kpos), s, -np.inf)
    if sink is not None:                                                            # one more logit per row
        s = concat([s, broadcast_to(reshape(sink, (Hkv, G, 1, 1)), (Hkv, G, T, 1))], axis=-1)
    w = reshape(s, (Hkv, G * T, S + 1 if sink is not None else S))
    if mask_mod is not None:                                                        # a row that sees nothing: 0
        top = reduce_max(w)
        e = exp(w - where(equal(top, -np.inf), 0.0, top))
        total = reduce_sum(e)
        w = e / where(equal(total, 0.0), 1.0, total)
    else:
        w = softmax(w)
    if sink is not None:
        w = slice(w, 2, 0, S)
    o = matmul(w, vt)                                                               # (Hkv, G*T, Dv)
    out = reshape(transpose(reshape(o, (Hkv, G, T, Dv)), (2, 0, 1, 3)), (T, H, Dv))
    return (out, k_cache, v_cache) if k_cache is not None else out


rope_p, attention_p = _rope.prim, _attention.prim


def attention(q, k, v, k_cache=None, v_cache=None, pos=None, *, scale: float, window: int | None = None,
              softcap: float | None = None, score_mod=None, mask_mod=None, sinks=None):
    """Causal attention of q (T, H, D) over keys/values (T, Hkv, D), GQA when Hkv < H.

    With a KV cache (C, Hkv, D) and ``pos`` (a ``dim("P")`` input), the new keys and
    values are written at row P and attention runs over rows 0..P+T; returns
    ``(out, k_cache, v_cache)``. ``window`` keeps only keys less than ``window``
    positions back (sliding window); ``softcap`` applies c·tanh(s/c) to the scores.

    ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` are plain
    functions over scalars, traced once and inlined into the kernels (FlexAttention's
    meaning; ``ggraph.ir.attention_mods``): score_mod rewrites each scaled score, mask_mod
    returns a mask (a comparison) of the keys a query sees besides the causal ones. ``sinks``
    f32[H] adds one logit per head to every softmax's denominator (gpt-oss). A query that
    sees no key gives zeros.
    """
    from ggraph.ir.attention_mods import canonical
    H, Hkv = q.shape[1], k.shape[1]
    if H % Hkv:
        raise ShapeError(f"attention: {H} query heads are not a multiple of {Hkv} kv heads")
    params = dict(scale=float(scale), **canonical(score_mod, mask_mod, window=window, softcap=softcap))
    extra = ()
    if sinks is not None:
        sinks = sinks if isinstance(sinks, Tracer) else to_tracer(sinks)
        if sinks.dtype is not f32 or sinks.shape != (H,):
            raise ShapeError(f"attention: sinks must be f32[{H}], one logit per query head, got {sinks.aval}")
        params["sinks"], extra = True, (sinks,)
    params = {k_: v_ for k_, v_ in params.items() if v_ is not None}
    if k_cache is None:
        return _attention(q, k, v, *extra, **params)
    if pos is None or not isinstance(pos.aval, DimAval):
        raise ShapeError("attention: a KV cache needs pos, a dim('P') input giving the past length")
    return _attention(q, k, v, k_cache, v_cache, pos, *extra, **params)


def to_tracer(x) -> Tracer:
    """A numpy constant as an operand."""
    return Tracer(to_atom(np.asarray(x, dtype=np.float32)))
