"""The rope + KV-store and attention kernels against composites._np_rope and composites._np_attention
(the composites' own numpy rules, in float64), on every x86 feature set this host runs.

Each configuration covers a different corner (GQA ratio, head dims with vector tails,
window, softcap, rope style, partial rotary dims, freq_factors, mscale, no rope); each is
run at T in {1, 7, 33} x P in {0, 5}, each with 1, 2 and 3 threads. One module per
target holds all kernels and is cached on disk.
"""
import ctypes
import threading

import numpy as np
import pytest
from llvm_targets import runnable_target
from llvmlite import ir

import ggraph
from ggraph import f32, ops
from ggraph.ir import composites
from ggraph.backends.llvm import jit
from ggraph.backends.llvm.kernels.attention import (Attention, Rope, attention_kernels, from_rope_attention,
                                                     kernel_arg_names, kernel_names, partial_bytes)
from ggraph.backends.llvm.target import host_names, named_target
from ggraph.passes.fuse_rope_attention import fuse_rope_attention

#  name: (attention, rope)
CONFIGS = {
    "gemma_global": (Attention(4, 1, 256, 256, 256 ** -0.5), Rope(256, 1e6)),
    "gemma_local": (Attention(4, 1, 256, 256, 256 ** -0.5, window=3), Rope(256, 1e4)),
    "llama_softcap": (Attention(4, 2, 64, 64, 0.125, softcap=20.0), Rope(64, 5e5, style="interleaved")),
    "phi3_partial": (Attention(2, 2, 64, 64, 0.125), Rope(32, 1e4, freq_factors=True, mscale=1.19, scale=0.25)),
    "dv_differs": (Attention(4, 2, 64, 48, 0.2, window=3, softcap=20.0),
                   Rope(48, 1e4, style="interleaved", freq_factors=True)),
    "odd_tails": (Attention(6, 2, 36, 20, 0.3), Rope(36, 1e4, mscale=0.8)),      # G = 3, dims not /8
    "no_rope": (Attention(3, 1, 64, 64, 0.125, window=5), None),
    "qwen_gqa7": (Attention(14, 2, 64, 64, 0.125), Rope(64, 1e6)),                 # G = 7, padded to 8
    "mha_odd_dims": (Attention(3, 3, 20, 12, 0.25, softcap=10.0), Rope(20, 1e4)),  # G = 1, D < lanes
}
LONG = (Attention(4, 2, 64, 64, 0.125, window=100, softcap=20.0), Rope(64, 1e4, style="interleaved"))
CACHE = 40
FROM_EQN = (Attention(4, 2, 64, 48, 0.2, window=4, softcap=30.0),
            Rope(32, 1e4, scale=0.5, style="interleaved", mscale=1.1, freq_factors=True))
SHAPES = [(T, P) for T in (1, 7, 33) for P in (0, 5)]
#  K and V cache types: every type as K and as V, with GQA, a window, softcap, interleaved rope
TYPED = {(kt, vt): (Attention(4, 2, 64, 96, 0.125, window=9, softcap=30.0, k_type=kt, v_type=vt),
                    Rope(64, 1e4, style="interleaved"))
         for kt, vt in (("f16", "f16"), ("bf16", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "bf16"), ("f32", "q8_0"))}
SPLIT = (Attention(4, 1, 64, 64, 0.125, window=150, softcap=20.0, k_type="f16"), Rope(64, 1e4))
P_ = ctypes.c_void_p


def _build(target_name: str) -> jit.Library:
    t = named_target(target_name)
    m = ir.Module()
    for attn, rope in list(CONFIGS.values()) + [LONG, FROM_EQN, SPLIT] + list(TYPED.values()):
        attention_kernels(m, t, attn, rope)
    return jit.compile(m, t)


_LIBS: dict = {}


@pytest.fixture(params=host_names())
def target(request):
    return runnable_target(request.param, _LIBS, _build)


def reference(a: dict, P, attn: Attention, rope: Rope | None):
    """ops' numpy rules: rope q and k at `positions`, then attention over the updated cache
    (which, like rope_attention's rule, masks by P + t)."""
    q, k = a["q"], a["k"]
    if rope is not None:
        kw = dict(dims=rope.dims, base=rope.base, scale=rope.scale, style=rope.style, mscale=rope.mscale)
        q, k = (composites._np_rope(x, a["positions"], a.get("freq_factors"), **kw) for x in (q, k))
    return composites._np_attention(q, k, a["v"], a["k_cache"].copy(), a["v_cache"].copy(), P, scale=attn.scale,
                             window=attn.window, softcap=attn.softcap)


def run_kernels(target: str, attn: Attention, rope: Rope | None, arrays: dict, T: int, P: int, nth: int,
                threads: bool = False) -> None:
    """Kernel A for every ith, then (the barrier) kernel B for every ith, then kernel C."""
    arrays.setdefault("partial", np.zeros(partial_bytes(attn) // 4, np.float32))
    for fn_name, args in zip(kernel_names(attn, rope, named_target(target)), kernel_arg_names(rope)):
        abi = [P_] * (len(args) - 2) + [ctypes.c_int64] * 2 + [ctypes.c_int32] * 2
        f = _LIBS[target].function(fn_name, None, abi)
        ptrs = [arrays[a].ctypes.data for a in args[:-2]]
        if threads:
            team = [threading.Thread(target=f, args=(*ptrs, T, P, ith, nth)) for ith in range(nth)]
            for th in team:
                th.start()
            for th in team:
                th.join()
        else:
            for ith in range(nth):
                f(*ptrs, T, P, ith, nth)


def make_arrays(attn: Attention, rope, T: int, P: int, rng) -> dict:
    C = P + T + 2                                      # two spare rows that must stay untouched
    a = {"q": rng.standard_normal((T, attn.H, attn.D)),
         "k": rng.standard_normal((T, attn.Hkv, attn.D)),
         "v": rng.standard_normal((T, attn.Hkv, attn.Dv)),
         "k_cache": rng.standard_normal((C, attn.Hkv, attn.D)),
         "v_cache": rng.standard_normal((C, attn.Hkv, attn.Dv))}
    a = {n: x.astype(np.float32) for n, x in a.items()}
    a["positions"] = np.arange(P, P + T, dtype=np.int32)
    if rope is not None and rope.freq_factors:
        a["freq_factors"] = rng.uniform(1.0, 8.0, rope.dims // 2).astype(np.float32)
    a["out"] = np.full((T, attn.H, attn.Dv), np.nan, np.float32)
    return a


def check(arrays: dict, want, what: str) -> None:
    """Output rows within 1e-5 of the reference relative to each row's norm; caches likewise."""
    out, kc, vc = want
    got = arrays["out"]
    assert not np.isnan(got).any(), f"{what}: output rows left unwritten"
    err = np.linalg.norm(got - out, axis=-1) / np.linalg.norm(out, axis=-1)
    assert err.max() < 1e-5, f"{what}: output relative error {err.max():.2e}"
    kerr = np.linalg.norm(arrays["k_cache"] - kc, axis=-1) / np.linalg.norm(kc, axis=-1)
    assert kerr.max() < 1e-5, f"{what}: k_cache relative error {kerr.max():.2e}"
    np.testing.assert_array_equal(arrays["v_cache"], vc, err_msg=f"{what}: v_cache")


@pytest.mark.parametrize("config", CONFIGS)
def test_attention_matches_numpy(target, config):
    attn, rope = CONFIGS[config]
    rng = np.random.default_rng(len(config))
    for T, P in SHAPES:
        fresh = make_arrays(attn, rope, T, P, rng)
        want = reference(fresh, P, attn, rope)
        for nth in (1, 2, 3):
            arrays = {n: a.copy() for n, a in fresh.items()}
            run_kernels(target, attn, rope, arrays, T, P, nth)
            check(arrays, want, f"{config} T={T} P={P} nth={nth}")


@pytest.mark.parametrize("config", list(CONFIGS) + ["long", "typed"])
def test_a_step_of_many_tokens_gives_the_bits_of_one_token_steps(target, config):
    """Several tokens at once go by query tiles (every lane a query row), one token by the grouped
    walk; both sum in the same order, so each output row is the same bits either way, at any thread
    count (here a window that cuts through key blocks, and caches of every kind)."""
    attn, rope = {"long": LONG, "typed": TYPED[("q8_0", "q4_0")]}.get(config) or CONFIGS[config]
    rng = np.random.default_rng(3)
    T, P = 37, 70
    fresh = make_arrays(attn, rope, T, P, rng)
    if config == "typed":
        fresh["k_cache"], _ = _typed_cache(attn.k_type, fresh["k_cache"])
        fresh["v_cache"], _ = _typed_cache(attn.v_type, fresh["v_cache"])
    one = {n: a.copy() for n, a in fresh.items()}
    for t in range(T):
        step = {n: (a[t:t + 1] if n in ("q", "k", "v", "positions", "out") else a) for n, a in one.items()}
        run_kernels(target, attn, rope, step, 1, P + t, 1)
    assert not np.isnan(one["out"]).any()
    for nth in (1, 3):
        many = {n: a.copy() for n, a in fresh.items()}
        run_kernels(target, attn, rope, many, T, P, nth)
        np.testing.assert_array_equal(many["out"], one["out"], err_msg=f"{config} nth={nth}")


def test_attention_threads_at_once(target):
    attn, rope = CONFIGS["gemma_local"]
    rng = np.random.default_rng(11)
    for T, P in ((1, 40), (16, 3)):
        arrays = make_arrays(attn, rope, T, P, rng)
        want = reference(arrays, P, attn, rope)
        run_kernels(target, attn, rope, arrays, T, P, 2, threads=True)
        check(arrays, want, f"threads T={T} P={P}")


def test_long_decode(target):
    """Many keys (several blocks and a partial one), large positions, window and softcap."""
    attn, rope = LONG
    rng = np.random.default_rng(12)
    T, P = 1, 300
    arrays = make_arrays(attn, rope, T, P, rng)
    want = reference(arrays, P, attn, rope)
    run_kernels(target, attn, rope, arrays, T, P, 3)
    check(arrays, want, "long decode")


def test_positions_drive_rope_only(target):
    """Rope angles come from `positions`; cache rows and the causal mask from P + t."""
    attn, rope = CONFIGS["llama_softcap"]
    rng = np.random.default_rng(13)
    T, P = 7, 5
    arrays = make_arrays(attn, rope, T, P, rng)
    arrays["positions"] = rng.integers(0, 200_000, T).astype(np.int32)
    want = reference(arrays, P, attn, rope)
    run_kernels(target, attn, rope, arrays, T, P, 2)
    check(arrays, want, "arbitrary positions")


def _fused_graph():
    """A traced rope + cached attention, and the same after fuse_rope_attention."""
    def f(q, k, v, kc, vc, P, ff):
        pos = ops.iota(q.shape[0]) + P
        kw = dict(base=1e4, dims=32, style="interleaved", freq_factors=ff, mscale=1.1, scale=0.5)
        return ops.attention(ops.rope(q, pos, **kw), ops.rope(k, pos, **kw), v, kc, vc, P,
                             scale=0.2, window=4, softcap=30.0)
    graph = ggraph.trace(f, f32["T", 4, 64], f32["T", 2, 64], f32["T", 2, 48], f32[CACHE, 2, 64],
                         f32[CACHE, 2, 48], ggraph.dim("P"), f32[16])
    return graph, fuse_rope_attention(graph)


def test_from_rope_attention_eqn(target):
    """The eqn's params map onto the kernels, and they match the unfused graph's numpy program."""
    graph, fused = _fused_graph()
    eqn = next(e for e in fused.eqns if e.prim.name == "rope_attention")
    attn, rope = from_rope_attention(eqn)
    assert (attn, rope) == FROM_EQN
    rng = np.random.default_rng(14)
    T, P = 9, 6
    a = make_arrays(attn, rope, T, P, rng)
    a["k_cache"] = rng.standard_normal((CACHE, 2, 64)).astype(np.float32)
    a["v_cache"] = rng.standard_normal((CACHE, 2, 48)).astype(np.float32)
    want = ggraph.compile(graph, backend="numpy", passes=[])(
        a["q"], a["k"], a["v"], a["k_cache"].copy(), a["v_cache"].copy(), P, a["freq_factors"])
    run_kernels(target, attn, rope, a, T, P, 3)
    check(a, want, "from eqn")


def test_kernel_arguments_and_errors():
    t = named_target("generic")
    m = ir.Module()
    attn, rope = CONFIGS["phi3_partial"]
    (fa, args_a), (fb, args_b), (fc, args_c) = attention_kernels(m, t, attn, rope)
    assert args_a == ("k", "v", "k_cache", "v_cache", "positions", "freq_factors", "T", "P")
    assert args_b == ("q", "k_cache", "v_cache", "positions", "freq_factors", "partial", "out", "T", "P")
    assert args_c == ("partial", "out", "T", "P")
    for f, args in ((fa, args_a), (fb, args_b), (fc, args_c)):
        assert [a.name for a in f.args] == list(args) + ["ith", "nth"]
    assert attention_kernels(m, t, attn, rope)[1][0] is fb                # emitted once
    with pytest.raises(ValueError, match="no kernel reads a q4_k KV cache"):
        Attention(4, 4, 64, 64, 0.1, k_type="q4_k")
    with pytest.raises(ValueError, match="a q8_0 cache needs a head dim that is a multiple of 32, not 48"):
        Attention(4, 4, 64, 48, 0.1, v_type="q8_0")
    with pytest.raises(ValueError, match="style must be one of"):
        Rope(64, 1e4, style="gptj")
    with pytest.raises(ValueError, match="rotary dims 31"):
        Rope(31, 1e4)
    with pytest.raises(ValueError, match="rotary dims 128 exceed the head dim 64"):
        attention_kernels(ir.Module(), t, Attention(2, 1, 64, 64, 0.1), Rope(128, 1e4))
    with pytest.raises(ValueError, match="6 query heads must be a positive multiple of 4"):
        Attention(6, 4, 64, 64, 0.1)
    with pytest.raises(ValueError, match="window 0"):
        Attention(4, 4, 64, 64, 0.1, window=0)


def _typed_cache(dtype: str, rows: np.ndarray):
    """f32 rows (C, Hkv, n) as a cache of ``dtype``: its storage array and the numpy rules' view of it."""
    from ggraph.ir import dtypes
    from ggraph.ir.prims import Blocks, cache_write
    dt = dtypes.from_name(dtype)
    if dt.np_dtype is not None:
        store = rows.astype(dt.np_dtype)
        return store, store
    C, Hkv, n = rows.shape
    store = np.zeros((C, Hkv, dt.row_bytes(n)), np.uint8)
    view = Blocks(store.reshape(C * Hkv, -1), dt, rows.shape)
    cache_write(view, rows, 0)
    return store, view


@pytest.mark.parametrize("types", TYPED, ids="-".join)
def test_attention_reads_and_writes_cache_types(target, types):
    """Keys are quantised on write as the numpy rule quantises them (compared dequantised: the
    kernel's rope may differ from numpy's by an ulp), values byte for byte; attention reads the blocks."""
    from ggraph.ir.prims import cache_rows
    attn, rope = TYPED[types]
    rng = np.random.default_rng(21)
    for T, P in ((1, 0), (1, 40), (7, 5), (33, 0)):
        a = make_arrays(attn, rope, T, P, rng)
        (kc, kview), (vc, vview) = _typed_cache(attn.k_type, a["k_cache"]), _typed_cache(attn.v_type, a["v_cache"])
        kw = dict(dims=rope.dims, base=rope.base, scale=rope.scale, style=rope.style, mscale=rope.mscale)
        q, k = (composites._np_rope(x, a["positions"], **kw) for x in (a["q"], a["k"]))
        want, kwant, vwant = composites._np_attention(q, k, a["v"], kview, vview, P, scale=attn.scale,
                                                      window=attn.window, softcap=attn.softcap)
        for nth in (1, 2, 3):
            arrays = dict(a, k_cache=kc.copy(), v_cache=vc.copy(), out=np.full_like(a["out"], np.nan))
            run_kernels(target, attn, rope, arrays, T, P, nth)
            what = f"{types} T={T} P={P} nth={nth}"
            got_k = cache_rows(_typed_cache_view(attn.k_type, arrays["k_cache"], kwant.shape), kwant.shape[0])
            k_err = np.abs(got_k - cache_rows(kwant, kwant.shape[0])).max()
            assert k_err < 1e-6, f"{what}: k_cache off by {k_err}"
            raw = lambda x: x.data if hasattr(x, "data") and not isinstance(x, np.ndarray) else x  # noqa: E731
            np.testing.assert_array_equal(arrays["v_cache"].reshape(-1), raw(vwant).reshape(-1).view(
                arrays["v_cache"].dtype), err_msg=f"{what}: v_cache")
            err = np.linalg.norm(arrays["out"] - want, axis=-1) / np.linalg.norm(want, axis=-1)
            assert err.max() < 1e-5, f"{what}: output relative error {err.max():.2e}"


def _typed_cache_view(dtype: str, store: np.ndarray, shape):
    from ggraph.ir import dtypes
    from ggraph.ir.prims import Blocks
    dt = dtypes.from_name(dtype)
    return store if dt.np_dtype is not None else Blocks(store.reshape(shape[0] * shape[1], -1), dt, shape)


@pytest.mark.parametrize("T,nth,split", [(1, 2, True), (1, 3, True), (2, 3, True), (3, 3, False), (1, 1, False)])
def test_decode_splits_keys_across_threads(target, T, nth, split):
    """With fewer (token, kv head) pairs than threads, every thread takes a range of each row's keys
    (the partials are written) and kernel C merges them; otherwise threads take rows. Both agree
    with the reference, at a long context with a window that ends inside a range."""
    attn, rope = SPLIT
    rng = np.random.default_rng(22)
    P = 300
    a = make_arrays(attn, rope, T, P, rng)
    kc, _ = _typed_cache("f16", a["k_cache"])
    kw = dict(dims=rope.dims, base=rope.base, scale=rope.scale, style=rope.style, mscale=rope.mscale)
    q, k = (composites._np_rope(x, a["positions"], **kw) for x in (a["q"], a["k"]))
    want, _, _ = composites._np_attention(q, k, a["v"], kc.copy(), a["v_cache"].copy(), P, scale=attn.scale,
                                          window=attn.window, softcap=attn.softcap)
    a["k_cache"], a["partial"] = kc, np.zeros(partial_bytes(attn) // 4, np.float32)
    run_kernels(target, attn, rope, a, T, P, nth, threads=True)
    assert bool(a["partial"].any()) == split
    err = np.linalg.norm(a["out"] - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert err.max() < 1e-5, f"T={T} nth={nth}: output relative error {err.max():.2e}"
