"""Composites: the numpy rule against formulas written here, and the decomposition against the rule."""
import math

import numpy as np
import pytest

import ggraph
from ggraph import dim, f32, i32, ops

rng = np.random.default_rng(1)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def both(fn, avals, args):
    """Run fn as composites (numpy rules) and inlined (decomposition); return both outputs."""
    g = ggraph.trace(fn, *avals)
    fused = ggraph.compile(g, passes=[])
    plain = ggraph.compile(g, passes="none")
    assert plain.graph.count(g.eqns[-1].prim.name) == 0 or not g.eqns[-1].prim.composite
    copy = lambda a: a.copy() if isinstance(a, np.ndarray) else a
    return fused(*[copy(a) for a in args]), plain(*[copy(a) for a in args])


def test_rms_norm():
    x, w = randn(5, 64), randn(64)
    a, b = both(lambda x, w: ops.rms_norm(x, w, eps=1e-5), [f32["T", 64], f32[64]], [x, w])
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, want, rtol=1e-5, atol=1e-5)


def test_softmax_silu_gelu_swiglu():
    x, u = randn(4, 40) * 3, randn(4, 40)
    for op, want in [
        (ops.softmax, np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)),
        (ops.silu, x / (1 + np.exp(-x))),
        (ops.gelu_tanh, 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))),
    ]:
        a, b = both(op, [f32["T", 40]], [x])
        np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b, want, rtol=1e-5, atol=1e-5)
    a, b = both(ops.swiglu, [f32["T", 40], f32["T", 40]], [x, u])
    np.testing.assert_allclose(a, x / (1 + np.exp(-x)) * u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def rope_ref(x, pos, dims, base, style, factors=None, scale=1.0):
    """Rotary embedding written per pair, the slow obvious way."""
    out = x.astype(np.float64).copy()
    T, H, D = x.shape
    for t in range(T):
        for i in range(dims // 2):
            f = base ** (-2 * i / dims) / (factors[i] if factors is not None else 1.0)
            th = pos[t] * scale * f
            j, k = (2 * i, 2 * i + 1) if style == "interleaved" else (i, i + dims // 2)
            a, b = x[t, :, j].astype(np.float64), x[t, :, k].astype(np.float64)
            out[t, :, j] = a * math.cos(th) - b * math.sin(th)
            out[t, :, k] = a * math.sin(th) + b * math.cos(th)
    return out


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("dims", [16, 8])
@pytest.mark.parametrize("factors", [False, True])
def test_rope(style, dims, factors):
    x = randn(5, 3, 16)
    pos = np.array([0, 1, 7, 100, 3], np.int32)
    ff = (1.0 + rng.random(dims // 2)).astype(np.float32) if factors else None
    if factors:
        fn = lambda x, p, ff: ops.rope(x, p, base=10000.0, dims=dims, style=style, freq_factors=ff, scale=0.5)
        avals, args = [f32["T", 3, 16], i32["T"], f32[dims // 2]], [x, pos, ff]
    else:
        fn = lambda x, p: ops.rope(x, p, base=10000.0, dims=dims, style=style, scale=0.5)
        avals, args = [f32["T", 3, 16], i32["T"]], [x, pos]
    a, b = both(fn, avals, args)
    want = rope_ref(x, pos, dims, 10000.0, style, ff, scale=0.5)
    np.testing.assert_allclose(a, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(b, want, rtol=1e-4, atol=1e-4)


def test_rope_rejects_bad_args():
    with pytest.raises(ValueError, match="style must be one of"):
        ggraph.trace(lambda x, p: ops.rope(x, p, base=1e4, style="llama"), f32["T", 2, 8], i32["T"])
    with pytest.raises(ValueError, match="rotary dims 10 must be even and at most the head dim 8"):
        ggraph.trace(lambda x, p: ops.rope(x, p, base=1e4, dims=10), f32["T", 2, 8], i32["T"])


def attention_ref(q, k, v, scale, window=None, softcap=None, past=0):
    """Per-head loops; keys are positions 0..past+T-1, queries past..past+T-1."""
    T, H, D = q.shape
    S, Hkv = k.shape[:2]
    out = np.zeros((T, H, v.shape[2]))
    for h in range(H):
        kh = h // (H // Hkv)
        for t in range(T):
            qp = past + t
            s = np.array([q[t, h] @ k[j, kh] for j in range(S)], np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            ok = np.array([j <= qp and (not window or qp - j < window) for j in range(S)])
            s = np.where(ok, s, -np.inf)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[:, kh]
    return out


@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 5.0), (2, 30.0)])
def test_attention_with_cache_gqa(window, softcap):
    T, P, H, Hkv, D, Dv, C = 5, 4, 4, 2, 8, 6, 16
    q, k, v = randn(T, H, D), randn(T, Hkv, D), randn(T, Hkv, Dv)
    kc, vc = np.zeros((C, Hkv, D), np.float32), np.zeros((C, Hkv, Dv), np.float32)
    kc[:P], vc[:P] = randn(P, Hkv, D), randn(P, Hkv, Dv)

    def fn(q, k, v, kc, vc, P):
        return ops.attention(q, k, v, kc, vc, P, scale=0.3, window=window, softcap=softcap)
    avals = [f32["T", H, D], f32["T", Hkv, D], f32["T", Hkv, Dv], f32[C, Hkv, D], f32[C, Hkv, Dv], dim("P")]
    (a, ka, va), (b, kb, vb) = both(fn, avals, [q, k, v, kc, vc, np.int32(P)])
    kfull = np.concatenate([kc[:P], k])
    vfull = np.concatenate([vc[:P], v])
    want = attention_ref(q, kfull, vfull, 0.3, window, softcap, past=P)
    np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ka[:P + T], kfull)
    np.testing.assert_array_equal(vb[:P + T], vfull)


def test_attention_without_cache():
    q, k, v = randn(6, 2, 8), randn(6, 1, 8), randn(6, 1, 8)
    a, b = both(lambda q, k, v: ops.attention(q, k, v, scale=0.5),
                [f32["T", 2, 8], f32["T", 1, 8], f32["T", 1, 8]], [q, k, v])
    want = attention_ref(q, k, v, 0.5)
    np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b, want, rtol=1e-5, atol=1e-5)


def test_attention_errors():
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 kv heads"):
        ggraph.trace(lambda q, k: ops.attention(q, k, k, scale=1.0), f32["T", 3, 8], f32["T", 2, 8])
    with pytest.raises(ValueError, match="needs pos"):
        ggraph.trace(lambda q, c: ops.attention(q, q, q, c, c, scale=1.0), f32["T", 2, 8], f32[8, 2, 8])
