"""Fused elementwise row loops and copy kernels against the numpy reference backend, on
every x86 feature set this host runs, with 1, 2 and 3 threads.

Bodies come from tracing: a composite's `eqn.body`, or a whole graph after
inline_composites. The oracle is `ggraph.compile(graph, backend="numpy", passes=[])`,
which runs each composite's own numpy rule (float64 where it says so), not our body.
One module per target holds every kernel and is cached on disk.
"""
import ctypes
import math
import threading
import zlib

import numpy as np
import pytest
from llvm_targets import runnable_target
from llvmlite import ir

import ggraph
from ggraph import dtypes, f32, i32, ops
from ggraph.backends.llvm import jit
from ggraph.backends.llvm.kernels import copies
from ggraph.backends.llvm.kernels import elementwise as ew
from ggraph.backends.llvm.target import host_names, named_target
from ggraph.passes.inline_composites import inline_composites

P = ctypes.c_void_p
ROWS = (1, 7, 64)
NS = (640, 256, 33)
H = 4                                  # heads in the [T, H, D] cases
CAP = 20.0                             # the softcap constant


def _ops_every(x, y, w):
    """Every elementwise op and both reductions, with row, column and scalar operands."""
    a = ops.where(ops.less(x, y), ops.sin(x) * ops.cos(y), ops.exp(x * 0.5) - ops.log(y * y + 1.0))
    b = ops.maximum(ops.sqrt(y * y), ops.rsqrt(x * x + 1.0)) / (ops.neg(w) - 3.0)
    c = ops.cast(ops.cast(x * 100.0, i32), f32) + ops.cast(ops.cast(y, "f16"), f32)
    return a + b, c - ops.reduce_max(a), ops.reduce_sum(b)


#  name: (function, argument avals given N, how to get the body, input generator tags)
CASES = {
    "rms_norm": (lambda x, w: ops.rms_norm(x, w, eps=1e-6), lambda n: (f32["T", n], f32[n]), "composite"),
    "add_rms_norm": (lambda x, r, w: (x + r, ops.rms_norm(x + r, w, eps=1e-6)),
                     lambda n: (f32["T", n], f32["T", n], f32[n]), "inline"),
    "swiglu": (lambda g, u: ops.swiglu(g, u), lambda n: (f32["T", n], f32["T", n]), "composite"),
    "gelu_mul": (lambda g, u: ops.gelu_tanh(g) * u, lambda n: (f32["T", n], f32["T", n]), "inline"),
    "softmax": (lambda x: ops.softmax(x), lambda n: (f32["T", n],), "composite"),
    "softcap": (lambda x: ops.tanh(x * (1.0 / CAP)) * CAP, lambda n: (f32["T", n],), "inline"),
    "qk_norm": (lambda x, w: ops.rms_norm(x, w, eps=1e-6), lambda n: (f32["T", H, n], f32[n]), "composite"),
    "every_op": (_ops_every, lambda n: (f32["T", n], f32["T", n], f32["T", 1]), "inline"),
    "crossed": (lambda x, y: (y * 2.0, ops.exp(x)), lambda n: (f32["T", n], f32["T", n]), "inline"),
    "broadcasts": (lambda x, a, b, c, s: (x * a + b) * c + s + np.arange(x.shape[-1], dtype=np.float32),
                   lambda n: (f32["T", H, n], f32["T", 1, n], f32[H, n], f32["T", H, 1], f32[1]), "inline"),
}


#  function: (input ranges, absolute tolerance)      relative tolerance MATH_RTOL everywhere
MATH = {
    "exp": ([(-87.0, 88.0), (-5.0, 5.0)], 0.0),
    "log": ([(-44.0, 38.0)], 0.0),                       # log10 of the inputs
    "tanh": ([(-20.0, 20.0), (-1.0, 1.0)], 0.0),
    "sin": ([(-1e4, 1e4), (-10.0, 10.0)], 2e-7),          # absolute near the zeros
    "cos": ([(-1e4, 1e4), (-10.0, 10.0)], 2e-7),
    "sqrt": ([(0.0, 1e6)], 0.0),
    "rsqrt": ([(1e-6, 1e6)], 0.0),
}
MATH_N = 1000                          # a tail on every vector width
MATH_RTOL = 1e-6


def body_of(name: str, n: int):
    """(graph for the oracle, fused body)."""
    fn, avals, how = CASES[name]
    graph = ggraph.trace(fn, *avals(n))
    body = graph.eqns[0].body if how == "composite" else inline_composites(graph)
    return graph, body


def kernel_name(name: str, n: int) -> str:
    return f"{name}_{n}"


def sizes(body, **dims) -> list[int]:
    """A fused kernel's i64 size arguments: the value of each symbol its shapes mention, in order."""
    return [dims[s] for s in ew.fused_symbols(body)]


#  fused loops over runtime dims: a runtime row length (with reductions), several runtime lead dims
RUNTIME = {
    "softmax_rows_P": (lambda x: ops.softmax(x), (f32["T", "P"],)),
    "add_two_runtime_leads": (lambda x, y: ops.exp(x) + y, (f32["T", "P", 8], f32["P", 8])),
    "sums_over_P": (lambda x, m: (ops.reduce_sum(x * m), ops.reduce_max(x)), (f32[H, "T", "P"], f32["P"])),
}


def _build(target_name: str) -> jit.Library:
    t = named_target(target_name)
    m = ir.Module()
    for name in CASES:
        for n in NS:
            _, body = body_of(name, n)
            ew.emit_fused(m, t, body, [v.aval for v in body.invars], [v.aval for v in body.outvars],
                          f"{kernel_name(name, n)}_{target_name}")
    for i, e in enumerate(_block_fused()[1].eqns):
        ew.emit_fused(m, t, e.body, [a.aval for a in e.inputs], [o.aval for o in e.outputs], f"block{i}_{target_name}")
    for fn in MATH:
        g = ggraph.trace(lambda x, fn=fn: getattr(ops, fn)(x), f32["T", MATH_N])
        ew.emit_fused(m, t, g, [g.invars[0].aval], [g.outvars[0].aval], f"math_{fn}_{target_name}")
    for name, (fn, avals) in RUNTIME.items():
        g = inline_composites(ggraph.trace(fn, *avals))
        ew.emit_fused(m, t, g, [v.aval for v in g.invars], [v.aval for v in g.outvars], f"{name}_{target_name}")
    for aval, dtype, name in ((i32["T"], f32, "cast_i32_f32"), (f32["T", 40], "f16", "cast_f32_f16")):
        g = ggraph.trace(lambda x, dtype=dtype: ops.cast(x, dtype), aval)          # a cast as one fused loop
        ew.emit_fused(m, t, g, [aval], [g.outvars[0].aval], f"{name}_{target_name}")
    x = f32["T", 3, 5]
    copies.emit_transpose(m, t, x, (1, 0, 2), f"transpose102_{target_name}")
    copies.emit_transpose(m, t, f32[2, "T", 3, 5], (3, 1, 0, 2), f"transpose3102_{target_name}")
    copies.emit_slice(m, t, f32[9, 2, 6], 0, 0, ggraph.Sym("P+T"), f"slice_rows_{target_name}")
    copies.emit_slice(m, t, x, 2, 1, 4, f"slice_last_{target_name}")
    copies.emit_concat(m, t, [f32["T", 3, 2], f32["T", 3, 5]], -1, f"concat_last_{target_name}")
    copies.emit_concat(m, t, [f32["T", 3, 5], f32[2, 3, 5]], 0, f"concat_rows_{target_name}")
    copies.emit_broadcast(m, t, f32["T", 1], ("T", 7), f"broadcast_col_{target_name}")
    copies.emit_broadcast(m, t, f32[5], ("T", 3, 5), f"broadcast_row_{target_name}")
    return jit.compile(m, t)


_LIBS: dict = {}


@pytest.fixture(params=host_names())
def target(request):
    """A target name this host can run, with its compiled kernel library."""
    return runnable_target(request.param, _LIBS, _build)


def call(target: str, name: str, arrays: list, sizes: list, nth: int, threads: bool = False) -> None:
    """Run kernel `name` for every ith of nth, in turn or from real threads."""
    abi = [P] * len(arrays) + [ctypes.c_int64] * len(sizes) + [ctypes.c_int32] * 2
    f = _LIBS[target].function(f"{name}_{target}", None, abi)
    args = [a.ctypes.data for a in arrays] + list(sizes)
    if not threads:
        for ith in range(nth):
            f(*args, ith, nth)
        return
    team = [threading.Thread(target=f, args=(*args, ith, nth)) for ith in range(nth)]
    for th in team:
        th.start()
    for th in team:
        th.join()


def inputs(name: str, graph, T: int, rng) -> list:
    """Random inputs for the graph's avals at T; softmax rows get -inf masks, softcap big values."""
    out = []
    for v in graph.invars:
        shape = v.aval.concrete({"T": T})
        x = rng.standard_normal(shape).astype(np.float32)
        if name == "softmax":
            x *= 4
            x[..., shape[-1] // 2:] = np.where(rng.random((*shape[:-1], shape[-1] - shape[-1] // 2)) < 0.5,
                                               -np.inf, x[..., shape[-1] // 2:])
        if name == "softcap":
            x *= rng.choice([1.0, 30.0, 3000.0], shape).astype(np.float32)
        out.append(x)
    return out


def assert_close(got: np.ndarray, want: np.ndarray, what: str, rtol=1e-5) -> None:
    """Elementwise: |got - want| <= rtol (|want| + rms of the row); NaN and inf must match."""
    want = np.asarray(want, np.float64)
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaNs differ")
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite], want[~finite], err_msg=f"{what}: infinities differ")
    w = np.where(finite, want, 0.0)
    rms = np.sqrt(np.mean(w * w, axis=-1, keepdims=True)) if w.ndim else np.abs(w)
    err = np.abs(np.where(finite, got - w, 0.0)) / (np.abs(w) + rms + 1e-30)
    assert err.max() <= rtol, f"{what}: relative error {err.max():.2e} at {np.unravel_index(err.argmax(), err.shape)}"


# -- fused loops ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_fused_matches_numpy(target, name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))          # str hash() changes per process
    for n in NS:
        graph, body = body_of(name, n)
        ref = ggraph.compile(graph, backend="numpy", passes=[])
        for T in ROWS:
            xs = inputs(name, graph, T, rng)
            want = ref(*xs)
            want = list(want) if isinstance(want, (tuple, list)) else [want]
            for nth in (1, 2, 3):
                outs = [np.full(v.aval.concrete({"T": T}), np.nan, np.float32) for v in body.outvars]
                call(target, kernel_name(name, n), xs + outs, sizes(body, T=T), nth)
                for i, (got, w) in enumerate(zip(outs, want)):
                    assert_close(got, w, f"{name} N={n} T={T} nth={nth} output {i}")


def test_fused_threads_at_once(target):
    rng = np.random.default_rng(7)
    graph, body = body_of("add_rms_norm", 640)
    xs = inputs("add_rms_norm", graph, 64, rng)
    want = ggraph.compile(graph, backend="numpy", passes=[])(*xs)
    outs = [np.full((64, 640), np.nan, np.float32) for _ in range(2)]
    call(target, kernel_name("add_rms_norm", 640), xs + outs, [64], 2, threads=True)
    for got, w in zip(outs, want):
        assert_close(got, w, "threads")


@pytest.mark.parametrize("name", ["add_rms_norm", "every_op", "softmax", "crossed"])
def test_fused_in_place(target, name):
    """Outputs written over inputs of the same shape (plan_memory's in-place outputs); in
    "crossed" output 0 lands on x, which output 1 still has to read."""
    rng = np.random.default_rng(8)
    graph, body = body_of(name, 33)
    for T, nth in ((1, 1), (7, 3)):
        xs = inputs(name, graph, T, rng)
        want = ggraph.compile(graph, backend="numpy", passes=[])(*xs)
        want = list(want) if isinstance(want, (tuple, list)) else [want]
        free = list(xs)
        outs = []
        for v in body.outvars:                      # each output over the first input of its shape
            shape = v.aval.concrete({"T": T})
            match = next((x for x in free if x.shape == shape), None)
            outs.append(match if match is not None else np.full(shape, np.nan, np.float32))
            if match is not None:
                free = [x for x in free if x is not match]
        assert len(free) < len(xs), "the case must write over at least one input"
        call(target, kernel_name(name, 33), xs + outs, sizes(body, T=T), nth)
        for i, (got, w) in enumerate(zip(outs, want)):
            assert_close(got, w, f"{name} in place T={T} output {i}")


@pytest.mark.parametrize("name", RUNTIME)
def test_fused_runtime_dims(target, name):
    """Rows of a runtime length (vector chunks, then a scalar tail) and more than one runtime lead dim."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))          # str hash() changes per process
    fn, avals = RUNTIME[name]
    graph = ggraph.trace(fn, *avals)
    body = inline_composites(graph)
    ref = ggraph.compile(graph, backend="numpy", passes=[])
    for T, Pv in ((1, 1), (3, 17), (5, 40), (2, 64)):
        dims = {"T": T, "P": Pv}
        xs = [rng.standard_normal(v.aval.concrete(dims)).astype(np.float32) for v in graph.invars]
        want = ref(*xs)
        want = list(want) if isinstance(want, (tuple, list)) else [want]
        for nth in (1, 3):
            outs = [np.full(v.aval.concrete(dims), np.nan, np.float32) for v in body.outvars]
            call(target, name, xs + outs, sizes(body, **dims), nth)
            for i, (got, w) in enumerate(zip(outs, want)):
                assert_close(got, w, f"{name} T={T} P={Pv} nth={nth} output {i}")


def test_fused_special_values(target):
    """exp(-inf) = 0 in a masked softmax row, tanh saturates, NaN stays NaN."""
    x = np.array([[0.0, -np.inf, 1.0, -np.inf] + [-np.inf] * 29], np.float32)
    y = np.full_like(x, np.nan)
    call(target, kernel_name("softmax", 33), [x, y], [1], 1)
    e = math.exp(1.0)
    np.testing.assert_allclose(y[0, :3], [1 / (1 + e), 0.0, e / (1 + e)], rtol=1e-6)
    assert (y[0, 3:] == 0).all()
    x = np.array([[1e30, -1e30, 1e4, -60.0, np.nan, 0.0, -0.0] + [0.5] * 26], np.float32)
    y = np.zeros_like(x)
    call(target, kernel_name("softcap", 33), [x, y], [1], 1)
    np.testing.assert_allclose(y[0, :4], [CAP, -CAP, CAP, CAP * math.tanh(-3.0)], rtol=1e-6)
    assert np.isnan(y[0, 4]) and y[0, 5] == 0.0


@pytest.mark.parametrize("fn", MATH)
def test_math_accuracy(target, fn):
    """Each function against float64 numpy: max relative error 1e-6 (plus a small absolute
    floor for sin and cos), and the special values: exp(-inf) = 0, tanh(±inf) = ±1, log(0) = -inf."""
    ranges, atol = MATH[fn]
    rng = np.random.default_rng(5)
    x = np.stack([rng.uniform(lo, hi, MATH_N) for lo, hi in ranges]).astype(np.float32)
    if fn == "log":
        x = (10.0 ** x.astype(np.float64)).astype(np.float32)
    special = {"exp": [-np.inf, np.inf, np.nan, -200.0, 89.0, 0.0], "log": [0.0, -1.0, np.inf, np.nan, 1.0, 1e-45],
               "tanh": [-np.inf, np.inf, np.nan, 0.0, -0.0, 9.5], "sin": [0.0, np.nan, np.inf, -np.pi, 1e5, -1e5],
               "cos": [0.0, np.nan, np.inf, np.pi, 1e5, -1e5], "sqrt": [0.0, np.inf, -1.0, np.nan, 1e-40, 4.0],
               "rsqrt": [0.0, np.inf, -1.0, np.nan, 1e-40, 4.0]}[fn]
    x[0, :len(special)] = special
    y = np.full_like(x, 7.0)
    call(target, f"math_{fn}", [x, y], [len(x)], 2)
    with np.errstate(all="ignore"):
        ref = (lambda v: 1.0 / np.sqrt(v)) if fn == "rsqrt" else getattr(np, fn)
        want = ref(x.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want), err_msg=f"{fn}: NaNs differ")
    inf = np.isinf(want)
    np.testing.assert_array_equal(y[inf], want[inf], err_msg=f"{fn}: infinities differ")
    ok = np.isfinite(want)
    err = np.abs(y[ok].astype(np.float64) - want[ok]) - atol
    rel = err / np.maximum(np.abs(want[ok].astype(np.float64)), 1e-38)
    worst = np.argmax(rel)
    assert rel[worst] <= MATH_RTOL, f"{fn}({x[ok][worst]!r}) = {y[ok][worst]!r}, want {want[ok][worst]!r}: " \
                                    f"relative error {rel[worst]:.2e}"
    if fn == "exp":
        assert y[0, 0] == 0.0 and y[0, 3] == 0.0, "exp(-inf) and exp(-200) must be exactly 0"
    if fn == "tanh":
        assert y[0, 0] == -1.0 and y[0, 1] == 1.0 and y[0, 5] == 1.0, "tanh must saturate to ±1"


def _block(x, r, w, g, u, q, qw):
    """A decoder block's elementwise work: residual, norms, activation, a softcap."""
    h = x + r
    y = ops.rms_norm(h, w, eps=1e-6)
    return h, y, ops.gelu_tanh(g) * u, ops.rms_norm(q, qw, eps=1e-6), ops.tanh(y * (1.0 / CAP)) * CAP


BLOCK_AVALS = (f32["T", 640], f32["T", 640], f32[640], f32["T", 2048], f32["T", 2048], f32["T", H, 256], f32[256])


def _block_fused():
    from ggraph.passes.fuse_elementwise import fuse_elementwise
    graph = ggraph.trace(_block, *BLOCK_AVALS)
    return graph, fuse_elementwise(graph)


def test_fuse_elementwise_bodies(target):
    """The fused eqns the fuse_elementwise pass makes, run as kernels, give the unfused graph's outputs."""
    graph, fused = _block_fused()
    assert [e.prim.name for e in fused.eqns] == ["fused"] * 3
    rng = np.random.default_rng(9)
    for T, nth in ((1, 2), (13, 3)):
        xs = [rng.standard_normal(v.aval.concrete({"T": T})).astype(np.float32) for v in graph.invars]
        env = dict(zip(fused.invars, xs))
        for i, e in enumerate(fused.eqns):
            outs = [np.full(o.aval.concrete({"T": T}), np.nan, np.float32) for o in e.outputs]
            call(target, f"block{i}", [env[a] for a in e.inputs] + outs, sizes(e.body, T=T),
                 nth)
            env.update(zip(e.outputs, outs))
        want = ggraph.compile(graph, backend="numpy", passes=[])(*xs)
        for j, (o, w) in enumerate(zip(fused.outvars, want)):
            assert_close(env[o], w, f"block output {j} T={T}")


# -- cast and copies -----------------------------------------------------------------------
def test_cast(target):
    x = np.array([-7, 0, 3, 2**24 + 1, -(2**31)], np.int32)
    y = np.zeros(5, np.float32)
    call(target, "cast_i32_f32", [x, y], [5], 2)                 # a symbolic last dim: rows = 5
    np.testing.assert_array_equal(y, x.astype(np.float32))
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 40)) * 1e3).astype(np.float32)
    x[0, :4] = [70000.0, 1e-6, np.inf, np.nan]
    h = np.zeros((3, 40), np.float16)
    call(target, "cast_f32_f16", [x, h], [3], 3)
    with np.errstate(over="ignore"):                                       # 70000 -> inf is the point
        want = x.astype(np.float16)
    np.testing.assert_array_equal(h.view(np.uint16)[~np.isnan(x)], want.view(np.uint16)[~np.isnan(x)])
    assert np.isnan(h[0, 3])


def test_copy_kernels(target):
    rng = np.random.default_rng(4)
    T = 4
    x = rng.standard_normal((T, 3, 5)).astype(np.float32)
    cases = [
        ("transpose102", [x], np.transpose(x, (1, 0, 2)), [T]),
        ("slice_last", [x], x[:, :, 1:4], [T]),
        ("broadcast_row", [x[0, 0]], np.broadcast_to(x[0, 0], (T, 3, 5)), [T]),
        ("broadcast_col", [x[:, 0, :1].copy()], np.broadcast_to(x[:, 0, :1], (T, 7)), [T]),
    ]
    y4 = rng.standard_normal((2, T, 3, 5)).astype(np.float32)
    cases.append(("transpose3102", [y4], np.transpose(y4, (3, 1, 0, 2)), [T]))
    cache = rng.standard_normal((9, 2, 6)).astype(np.float32)
    cases.append(("slice_rows", [cache], cache[:2 + T], [2, T]))         # symbols in order: P, T
    a = rng.standard_normal((T, 3, 2)).astype(np.float32)
    cases.append(("concat_last", [a, x], np.concatenate([a, x], -1), [T]))
    b = rng.standard_normal((2, 3, 5)).astype(np.float32)
    cases.append(("concat_rows", [x, b], np.concatenate([x, b], 0), [T]))
    for name, srcs, want, sizes in cases:
        for nth in (1, 3):
            y = np.full(want.shape, np.nan, np.float32)
            call(target, name, srcs + [y], sizes, nth)
            np.testing.assert_array_equal(y, want, err_msg=f"{name} nth={nth}")


def test_copy_kernel_arguments():
    t = named_target("generic")
    m = ir.Module()
    name = copies.emit_slice(m, t, f32[9, 2, 6], 0, ggraph.Sym("P"), ggraph.Sym("P+T"), "s")
    assert ew.kernel_args(m.globals[name]) == ("x", "y", "P", "T")
    graph, body = body_of("add_rms_norm", 64)
    name = ew.emit_fused(m, t, body, [v.aval for v in body.invars], [v.aval for v in body.outvars], "f")
    assert ew.kernel_args(m.globals[name]) == ("in0", "in1", "in2", "out0", "out1", "T")
    assert ew.emit_fused(m, t, body, [v.aval for v in body.invars], [v.aval for v in body.outvars], "f") == name
    assert ew.fused_symbols(body) == ("T",)
    assert ew.fused_symbols(body_of("qk_norm", 64)[1]) == ("T",)
    fn, avals = RUNTIME["sums_over_P"]
    assert ew.fused_symbols(inline_composites(ggraph.trace(fn, *avals))) == ("P", "T")
    name = ew.fused_name(body, [v.aval for v in body.invars], [v.aval for v in body.outvars], t)
    assert name.startswith("fused_") and name.endswith("_generic")
    _, other = body_of("add_rms_norm", 32)
    assert ew.fused_name(other, [v.aval for v in other.invars], [v.aval for v in other.outvars], t) != name


# -- errors name the problem -----------------------------------------------------------------
def _emit(body, target="avx2"):
    return ew.emit_fused(ir.Module(), named_target(target), body, [v.aval for v in body.invars],
                         [v.aval for v in body.outvars], "k")


def test_errors():
    g = ggraph.trace(lambda x, w: ops.matmul(x, w), f32["T", 8], f32[4, 8])
    with pytest.raises(ValueError, match="op 'matmul' is not elementwise or a last-axis reduction"):
        _emit(g)
    g = ggraph.trace(lambda x, w: (x + 1.0, w * 2.0), f32["T", 8], f32[8])
    with pytest.raises(ValueError, match="output 1 f32\\[8\\] does not cover"):
        _emit(g)
    g = ggraph.trace(lambda x: ops.exp(x), f32["T", 8])
    with pytest.raises(ValueError, match="input 0 is f32\\[T,9\\]"):
        ew.emit_fused(ir.Module(), named_target("generic"), g, [f32["T", 9]], [f32["T", 8]], "k")
    with pytest.raises(ValueError, match="transpose: perm"):
        copies.emit_transpose(ir.Module(), named_target("generic"), f32[2, 3], (0, 0), "t")
    with pytest.raises(ValueError, match="cannot move elements of q4_k"):
        copies.emit_transpose(ir.Module(), named_target("generic"), dtypes.q4_k[2, 256], (1, 0), "t")
