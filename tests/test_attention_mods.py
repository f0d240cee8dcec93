"""Programmable attention: score_mod, mask_mod and sinks, traced from plain Python and inlined.

Checked three ways, each against the numpy rule (composites._np_attention in float64, which applies
the mods on broadcast index arrays): the unfused decomposition (the mods inlined on tensors), the
fused kernels on every x86 feature set this host runs (prefill tiles, decode, the flash-decoding
split, quantised caches), and whole compiled programs on both backends. The forms the kernels know
(softcap, a window, a chunk) must compile to the very kernels the structured options give.
"""
import ctypes

import numpy as np
import pytest
from llvm_targets import runnable_target
from llvmlite import ir

import ggraph
from ggraph import f32, ops
from ggraph.backends.llvm import jit
from ggraph.backends.llvm.kernels.attention import (Attention, Rope, attention_kernels, kernel_arg_names,
                                                     kernel_names, partial_bytes)
from ggraph.backends.llvm.target import X86_NAMES, named_target
from ggraph.ir import composites
from ggraph.ir.attention_mods import Mod, chunk_of, parse_mod, softcap_of, trace_mod, window_of
from ggraph.ir.text import parse


def alibi(score, b, h, q_idx, kv_idx):
    """ALiBi with 8 heads: slope 2^(-(h+1)) times the (negative) distance."""
    return score + ops.exp(ops.cast(h + 1, "f32") * -0.6931471805599453) * ops.cast(kv_idx - q_idx, "f32")


def chunked(b, h, q_idx, kv_idx):
    return ops.equal(q_idx // 4, kv_idx // 4)


def documents(b, h, q_idx, kv_idx):
    """Documents of 6 positions: a query sees keys of its own document only (not a window form)."""
    return ops.equal(q_idx // 6, kv_idx // 6) * ops.greater(h, -1)       # times an always-true mask: no chunk form


def odd_heads_blind(b, h, q_idx, kv_idx):
    """Odd heads see only keys at even positions more than 2 back: some rows see nothing."""
    return ops.not_equal(h - (h // 2) * 2, 1) + ops.less(q_idx - kv_idx, -1)


ALIBI, CHUNKED, DOCS, BLIND = (trace_mod("score_mod", alibi), trace_mod("mask_mod", chunked),
                               trace_mod("mask_mod", documents), trace_mod("mask_mod", odd_heads_blind))
CONFIGS = {
    "alibi": (Attention(8, 2, 64, 64, 0.125, score_mod=ALIBI), Rope(64, 1e4)),
    "chunked": (Attention(4, 2, 64, 64, 0.125, chunk=4), Rope(64, 1e4)),
    "documents": (Attention(4, 1, 64, 48, 0.2, mask_mod=DOCS, softcap=20.0), Rope(32, 1e4, style="interleaved")),
    "sinks": (Attention(4, 2, 64, 64, 0.125, sinks=True), Rope(64, 1e4)),
    "sinks_window": (Attention(8, 2, 64, 64, 0.125, window=3, sinks=True, k_type="q8_0", v_type="f16"),
                     Rope(64, 1e4)),
    "blind_rows": (Attention(4, 4, 32, 32, 0.2, mask_mod=BLIND, score_mod=ALIBI, sinks=True), None),
    "mods_odd_heads": (Attention(6, 2, 36, 20, 0.3, score_mod=ALIBI, mask_mod=DOCS), Rope(36, 1e4)),
}
SPLIT = (Attention(4, 1, 64, 64, 0.125, sinks=True, score_mod=ALIBI, mask_mod=DOCS, k_type="f16"), Rope(64, 1e4))
SHAPES = [(T, P) for T in (1, 7, 33) for P in (0, 5)]
P_ = ctypes.c_void_p


def _build(target_name: str) -> jit.Library:
    m = ir.Module()
    for attn, rope in list(CONFIGS.values()) + [SPLIT]:
        attention_kernels(m, named_target(target_name), attn, rope)
    return jit.compile(m, named_target(target_name))


_LIBS: dict = {}


@pytest.fixture(params=X86_NAMES)
def target(request):
    return runnable_target(request.param, _LIBS, _build)


def _quantised(dtype: str, rows: np.ndarray):
    """A cache of ``dtype`` holding ``rows`` (f32 [C, Hkv, D]) as the kernels and the numpy rule read it."""
    from ggraph.gguf.quants import quantize
    from ggraph.ir import dtypes
    from ggraph.ir.prims import Blocks
    dt = dtypes.from_name(dtype)
    if dt.np_dtype is not None:
        return rows.astype(dt.np_dtype)
    data = quantize(rows.reshape(-1, rows.shape[-1]), dt)
    return Blocks(np.ascontiguousarray(data), dt, rows.shape)


def make(attn: Attention, rope, T: int, P: int, rng) -> dict:
    C = P + T + 2
    a = {"q": rng.standard_normal((T, attn.H, attn.D)), "k": rng.standard_normal((T, attn.Hkv, attn.D)),
         "v": rng.standard_normal((T, attn.Hkv, attn.Dv)), "k_cache": rng.standard_normal((C, attn.Hkv, attn.D)),
         "v_cache": rng.standard_normal((C, attn.Hkv, attn.Dv))}
    a = {n: x.astype(np.float32) for n, x in a.items()}
    a["k_cache"], a["v_cache"] = _quantised(attn.k_type, a["k_cache"]), _quantised(attn.v_type, a["v_cache"])
    a["positions"] = np.arange(P, P + T, dtype=np.int32)
    a["sinks"] = rng.uniform(-1.0, 3.0, attn.H).astype(np.float32)
    a["out"] = np.full((T, attn.H, attn.Dv), np.nan, np.float32)
    return a


def reference(a: dict, P: int, attn: Attention, rope) -> np.ndarray:
    q, k = a["q"], a["k"]
    if rope is not None:
        kw = dict(dims=rope.dims, base=rope.base, scale=rope.scale, style=rope.style, mscale=rope.mscale)
        q, k = (composites._np_rope(x, a["positions"], **kw) for x in (q, k))
    copy = lambda c: c.copy() if isinstance(c, np.ndarray) else type(c)(c.data.copy(), c.dtype, c.shape)  # noqa: E731
    sinks = (a["sinks"],) if attn.sinks else ()
    return composites._np_attention(q, k, a["v"], copy(a["k_cache"]), copy(a["v_cache"]), P, *sinks, scale=attn.scale,
                                    window=attn.window, softcap=attn.softcap, chunk=attn.chunk,
                                    score_mod=attn.score_mod, mask_mod=attn.mask_mod, sinks=attn.sinks)[0]


def run(target: str, attn: Attention, rope, a: dict, T: int, P: int, nth: int) -> None:
    """Kernels A, B and C in turn, each for every ith (one thread after another)."""
    a.setdefault("partial", np.zeros(partial_bytes(attn) // 4, np.float32))
    for name, args in zip(kernel_names(attn, rope, named_target(target)), kernel_arg_names(rope, attn)):
        f = _LIBS[target].function(name, None, [P_] * (len(args) - 2) + [ctypes.c_int64] * 2 + [ctypes.c_int32] * 2)
        ptrs = [(a[n].data if hasattr(a[n], "dtype") and not isinstance(a[n], np.ndarray) else a[n]).ctypes.data
                for n in args[:-2]]
        for ith in range(nth):
            f(*ptrs, T, P, ith, nth)


def close(got: np.ndarray, want: np.ndarray, what: str, tol: float = 1e-5) -> None:
    assert not np.isnan(got).any(), f"{what}: NaN or rows left unwritten"
    scale = np.maximum(np.linalg.norm(want, axis=-1), 1e-3)
    err = np.linalg.norm(got - want, axis=-1) / scale
    assert err.max() < tol, f"{what}: output relative error {err.max():.2e}"


@pytest.mark.parametrize("config", CONFIGS)
def test_kernels_apply_the_mods_as_numpy_does(target, config):
    attn, rope = CONFIGS[config]
    rng = np.random.default_rng(len(config))
    tol = 1e-5 if attn.k_type == "f32" else 2e-3          # a q8_0 cache: its rows quantised by the kernel's store
    for T, P in SHAPES:
        fresh = make(attn, rope, T, P, rng)
        want = reference(fresh, P, attn, rope)
        for nth in (1, 2, 3):
            a = {n: (x.copy() if isinstance(x, np.ndarray) else type(x)(x.data.copy(), x.dtype, x.shape))
                 for n, x in fresh.items()}
            run(target, attn, rope, a, T, P, nth)
            close(a["out"], want, f"{config} T={T} P={P} nth={nth}", tol)


def test_rows_that_see_no_key_give_zeros(target):
    """odd_heads_blind hides every key of odd heads at positions 0 and 1; sinks and ALiBi ride along."""
    attn, rope = CONFIGS["blind_rows"]
    a = make(attn, rope, 5, 0, np.random.default_rng(5))
    want = reference(a, 0, attn, rope)
    assert not want[:2, 1::2].any() and want[:2, 0::2].any()
    run(target, attn, rope, a, 5, 0, 2)
    close(a["out"], want, "blind rows")


@pytest.mark.parametrize("T,nth", [(1, 2), (1, 3), (2, 3)])
def test_split_decode_adds_each_sink_once(target, T, nth):
    """Decode with one kv head splits keys across threads; kernel C adds the sink, once per row."""
    attn, rope = SPLIT
    a = make(attn, rope, T, 300, np.random.default_rng(9))
    want = reference(a, 300, attn, rope)
    run(target, attn, rope, a, T, 300, nth)
    assert a["partial"].any(), "the step did not split"
    close(a["out"], want, f"split T={T} nth={nth}")


# -- tracing, printing, the known forms ------------------------------------------------------------

@pytest.mark.parametrize("fn,W", [(lambda b, h, q, kv: q - kv < 7, 7), (lambda b, h, q, kv: kv > q - 7, 7),
                                  (lambda b, h, q, kv: q - kv <= 6, 7), (lambda b, h, q, kv: kv - q >= -6, 7),
                                  (lambda b, h, q, kv: (q + 3) - (kv + 3) < 2 * 4, 8)])
def test_windows_in_any_linear_spelling_are_windows(fn, W):
    assert window_of(trace_mod("mask_mod", fn)) == W


@pytest.mark.parametrize("fn", [lambda b, h, q, kv: q - kv > 7, lambda b, h, q, kv: h - kv < 7,
                                lambda b, h, q, kv: q - 2 * kv < 7, lambda b, h, q, kv: ops.equal(q, kv)])
def test_other_masks_are_not(fn):
    mod = trace_mod("mask_mod", fn)
    assert window_of(mod) is None and chunk_of(mod) is None


def test_forms_and_round_trips():
    assert chunk_of(CHUNKED) == 4 and chunk_of(DOCS) is None
    assert softcap_of(trace_mod("score_mod", lambda s, b, h, q, kv: ops.tanh(s * (1 / 30.0)) * 30.0)) == 30.0
    assert softcap_of(trace_mod("score_mod", lambda s, b, h, q, kv: ops.tanh(s / 30.0) * 30.0)) is None   # not ggml's order
    for mod in (ALIBI, CHUNKED, DOCS, BLIND):
        again = parse_mod(str(mod))
        assert again == mod and isinstance(again, Mod)
    assert str(ALIBI).startswith("{s b h q kv -> (add s (mul (exp")


@pytest.mark.parametrize("kind,fn,err", [
    ("score_mod", lambda s, b, h: s, "must take 5 arguments"),
    ("mask_mod", lambda b, h, q, kv: ops.cast(q, "f32"), "must return a mask"),
    ("score_mod", lambda s, b, h, q, kv: q < kv, "must return a score"),
    ("score_mod", lambda s, b, h, q, kv: ops.reduce_sum(ops.reshape(s, (1,))), "not an elementwise op"),
    ("mask_mod", lambda b, h, q, kv: q / kv < 1, r"mask_mod <lambda>: / of i32\[\]: use //"),
    ("score_mod", 3, "must be a function"),
])
def test_bad_mods_are_refused_by_name(kind, fn, err):
    with pytest.raises((TypeError, ValueError), match=err):
        trace_mod(kind, fn)


def test_floor_division_of_integers():
    g = ggraph.trace(lambda x, y: x // y, ggraph.i32[6], ggraph.i32[6])
    x = np.array([7, -7, 7, -7, 5, -2147483648], np.int32)
    y = np.array([2, 2, -2, -2, 0, -1], np.int32)
    want = np.array([3, -4, -4, 3, 0, -2147483648], np.int32)
    for backend in ("numpy", "llvm"):
        np.testing.assert_array_equal(ggraph.compile(g, backend=backend)(x, y), want, err_msg=backend)
    with pytest.raises(TypeError, match="integer division"):
        ggraph.trace(lambda x: x // 2.0, f32[3])


# -- whole programs ----------------------------------------------------------------------------------

H, HKV, D, C = 8, 2, 32, 24


def _program(**attend):
    def step(q, k, v, kc, vc, P, sinks):
        pos = ops.iota(q.shape[0]) + P
        q, k = ops.rope(q, pos, base=1e4), ops.rope(k, pos, base=1e4)
        extra = dict(attend)
        if extra.pop("with_sinks", False):
            extra["sinks"] = sinks
        return ops.attention(q, k, v, kc, vc, P, scale=D ** -0.5, **extra)
    return ggraph.trace(step, f32["T", H, D], f32["T", HKV, D], f32["T", HKV, D], f32[C, HKV, D], f32[C, HKV, D],
                        ggraph.dim("P"), f32[H])


def _inputs(T, P, rng):
    return [rng.standard_normal(s).astype(np.float32) for s in ((T, H, D), (T, HKV, D), (T, HKV, D), (C, HKV, D),
                                                                 (C, HKV, D))] + [P, rng.uniform(0, 2, H).astype(np.float32)]


@pytest.mark.parametrize("attend", [dict(score_mod=alibi), dict(mask_mod=documents, with_sinks=True),
                                    dict(mask_mod=chunked, score_mod=alibi, with_sinks=True)],
                         ids=["alibi", "documents_sinks", "chunked_alibi_sinks"])
def test_programs_fused_and_unfused_agree_with_numpy(attend):
    g = _program(**attend)
    rng = np.random.default_rng(1)
    for T, P in ((9, 0), (1, 9)):
        args = _inputs(T, P, rng)
        want = ggraph.compile(g, backend="numpy", passes="none")(*[a.copy() if hasattr(a, "copy") else a
                                                                    for a in args])[0]
        for backend, passes in (("numpy", "default"), ("llvm", "default"), ("llvm", "none")):
            got = ggraph.compile(g, backend=backend, passes=passes)(*[a.copy() if hasattr(a, "copy") else a
                                                                        for a in args])[0]
            close(got, want, f"{backend} passes={passes} T={T} P={P}", 1e-4)
    fused = ggraph.compile(g, backend="llvm").graph
    assert "rope_attention" in str(fused), "the mods kept attention out of the fused kernel"


def test_known_forms_compile_to_the_structured_kernels():
    """A window, softcap or chunk written as a mod prints and compiles exactly as the option does."""
    pairs = [(dict(window=5), dict(mask_mod=lambda b, h, q, kv: kv > q - 5)),
             (dict(softcap=30.0), dict(score_mod=lambda s, b, h, q, kv: ops.tanh(s * (1 / 30.0)) * 30.0))]
    for option, mod in pairs:
        a, b = _program(**option), _program(**mod)
        assert str(a) == str(b)
        ka, kb = ({n for u in ggraph.compile(g, backend="llvm").spec.units for n in u.names if "attention" in n}
                  for g in (a, b))
        assert ka == kb and ka
    assert "chunk=4" in str(_program(mask_mod=chunked))


def test_graph_text_round_trips_the_mods():
    g = _program(score_mod=alibi, mask_mod=documents, with_sinks=True)
    text = g.pretty(expand=True)
    assert "score_mod={s b h q kv ->" in text and "sinks=True" in text
    assert parse(text).pretty(expand=True) == text


def test_bad_options_are_refused_by_name():
    with pytest.raises(ValueError, match="window given twice"):
        _program(window=4, mask_mod=lambda b, h, q, kv: q - kv < 4)
    with pytest.raises(ValueError, match="hides every key"):
        _program(mask_mod=lambda b, h, q, kv: q - kv < 0)
    with pytest.raises(Exception, match=r"sinks must be f32\[8\]"):
        ggraph.trace(lambda q, k, v, s: ops.attention(q, k, v, scale=1.0, sinks=s), f32[4, H, D], f32[4, HKV, D],
                     f32[4, HKV, D], f32[4])
