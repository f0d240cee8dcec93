"""causal_conv and ssm_scan: their numpy rules and decompositions against float64 rules written here from
ggml's semantics (``ggml_compute_forward_ssm_conv_f32`` and the Mamba-2 branch of
``ggml_compute_forward_ssm_scan_f32``) and against ggml's own ops (llama-cpp-python's libggml through
ctypes), the fused llvm kernels against the numpy rules bit for bit on every feature set this host runs with
1-3 threads, the unfused pipelines (the decompositions) against them, the state carried across calls (a
prefill of 7 then decode steps gives a prefill of all), and the errors."""
import ctypes
from pathlib import Path

import numpy as np
import pytest

import ggraph
from ggraph import f32, ops
from ggraph.backends.llvm.target import X86_NAMES, runnable_targets
from ggraph.ir import param
from ggraph.ir.primitive import ShapeError
from ggraph.ir.prims import state_write
from ggraph.ir.text import parse
from ggraph.compiler import optimize
from ggraph.passes import RewriteLog
from llvm_targets import compiled_for as llvm, fused_kernels

rng = np.random.default_rng(42)
RUNNABLE = [t.name for t in runnable_targets()]
TS = (1, 7, 33)


def randn(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# -- float64 rules, one element at a time -----------------------------------------------------------------

def conv_ref(x, state, w, bias=None):
    """ggml_ssm_conv: y[t, c] = sum_k w[c, k]·xx[t+k, c] over xx = [state; x] (+ bias); the last K-1 rows carry."""
    T, C = x.shape
    K = w.shape[1]
    xx = np.concatenate([state, x]).astype(np.float64)
    y = np.zeros((T, C))
    for t in range(T):
        for c in range(C):
            y[t, c] = sum(float(w[c, k]) * xx[t + k, c] for k in range(K)) + (float(bias[c]) if bias is not None else 0)
    return y, xx[T:]


def scan_ref(state, x, dt, A, B, C):
    """ggml_ssm_scan, Mamba-2: per token and head, dt' = softplus(dt) (dt itself above 20), the state decays
    by exp(dt'·A[h]) and takes (x·dt') ⊗ B of the head's group; y = state · C of the group."""
    T, H, D = x.shape
    G = B.shape[1]
    s = state.astype(np.float64).copy()
    y = np.zeros((T, H, D))
    for t in range(T):
        for h in range(H):
            g = h // (H // G)
            d = float(dt[t, h])
            sp = d if d > 20 else np.log1p(np.exp(d))
            s[h] = s[h] * np.exp(sp * float(A.reshape(-1)[h])) + np.outer(x[t, h].astype(np.float64) * sp, B[t, g])
            y[t, h] = s[h] @ C[t, g].astype(np.float64)
    return y, s


def close(got, want, rtol, what):
    """Each output within rtol of the largest magnitude of its reference."""
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what}: output {i} has shape {g.shape}, want {w.shape}"
        if not w.size:
            continue
        err = np.abs(g.astype(np.float64) - w).max() / max(np.abs(w).max(), 1e-30)
        assert err <= rtol, f"{what}: output {i} is {err:.3g} off (relative to its largest value)"


def rule_and_decomposition(g, op, args_at, ref, rtol):
    """``op``'s numpy rule and its decomposition (no ``op`` left, one ops.scan) each within ``rtol`` of the float64
    rule ``ref`` on the arguments ``args_at(T)``, for every T of TS."""
    rule, plain = ggraph.compile(g, passes=[]), ggraph.compile(g, passes="none")
    assert plain.graph.count(op) == 0 and plain.graph.count("scan") == 1
    for T in TS:
        args = args_at(T)
        want = ref(*args)
        close(rule(*args), want, rtol, f"rule T={T}")
        close(plain(*args), want, rtol, f"decomposition T={T}")


def same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"{what}: output {i}")


# -- cases ----------------------------------------------------------------------------------------------------

def conv_fn(bias: bool):
    return (lambda x, s, w, b: ops.causal_conv(x, s, w, b)) if bias else (lambda x, s, w: ops.causal_conv(x, s, w))


def conv_graph(C, K, bias):
    avals = [f32["T", C], f32[K - 1, C], f32[C, K]] + ([f32[C]] if bias else [])
    return ggraph.trace(conv_fn(bias), *avals)


def conv_args(T, C, K, bias):
    return [randn(T, C), randn(K - 1, C), randn(C, K, scale=0.5)] + ([randn(C)] if bias else [])


CONV_CASES = [(40, 4, True), (35, 3, False), (16, 2, True), (19, 1, True)]   # (C, K, bias): LFM2 K=3, Mamba K=4


def scan_graph(H, D, N, G):
    return ggraph.trace(ops.ssm_scan, f32[H, D, N], f32["T", H, D], f32["T", H], f32[H], f32["T", G, N],
                        f32["T", G, N])


def scan_args(T, H, D, N, G):
    dt = randn(T, H, scale=3.0)
    dt[0, 0] = 25.0                      # past 20: softplus passes it through
    return [randn(H, D, N), randn(T, H, D), dt, -np.exp(randn(H)), randn(T, G, N), randn(T, G, N)]


# (H, D, N, G): N=128 as Mamba-2 files have it (two whole 64s), 80 (a whole 64 and 16 one by one), 16 (all one
# by one), 64 with one group
SCAN_CASES = [(4, 8, 16, 2), (2, 4, 128, 1), (3, 6, 80, 3), (2, 2, 64, 1)]


# -- numpy: rules and decompositions against the float64 rules ------------------------------------------------

@pytest.mark.parametrize("C,K,bias", CONV_CASES)
def test_causal_conv_numpy_rule_and_decomposition(C, K, bias):
    g = conv_graph(C, K, bias)
    rule, plain = ggraph.compile(g, passes=[]), ggraph.compile(g, passes="none")
    assert plain.graph.count("causal_conv") == 0 and (K == 1 or plain.graph.count("concat") == 1)
    for T in TS:
        args = conv_args(T, C, K, bias)
        want = conv_ref(*args)
        close(rule(*args), want, 1e-6, f"rule T={T}")
        same(plain(*args), rule(*args), f"decomposition T={T}")   # the same fmas in the same order


@pytest.mark.parametrize("H,D,N,G", SCAN_CASES)
def test_ssm_scan_numpy_rule_and_decomposition(H, D, N, G):
    rule_and_decomposition(scan_graph(H, D, N, G), "ssm_scan", lambda T: scan_args(T, H, D, N, G), scan_ref, 2e-6)


def test_ssm_scan_softplus_edges():
    """dt far below zero (no decay, no input), around 20 (ggml switches to dt itself above it) and far above."""
    H, D, N, G = 6, 2, 16, 1
    g = scan_graph(H, D, N, G)
    args = scan_args(3, H, D, N, G)
    args[2][:] = np.array([-90.0, -20.0, 19.99, 20.0, 20.01, 95.0], np.float32)
    args[3][:] = -0.01
    got = ggraph.compile(g, passes=[])(*args)
    close(got, scan_ref(*args), 2e-6, "edges")
    assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all()


# -- llvm: the fused kernels bit for bit, every feature set, 1-3 threads ---------------------------------------

@pytest.mark.parametrize("target", X86_NAMES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_causal_conv_llvm_kernel(target, threads):
    for (C, K, bias), prog, rule in fused_kernels(CONV_CASES, conv_graph, "fused_causal_conv", target, threads):
        for T in TS:
            args = conv_args(T, C, K, bias)
            same(prog(*args), rule(*args), f"C={C} K={K} T={T} on {target}, {threads} threads")


@pytest.mark.parametrize("target", X86_NAMES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_ssm_scan_llvm_kernel(target, threads):
    for (H, D, N, G), prog, rule in fused_kernels(SCAN_CASES, scan_graph, "fused_ssm_scan", target, threads):
        for T in TS:
            args = scan_args(T, H, D, N, G)
            same(prog(*args), rule(*args), f"H={H} D={D} N={N} G={G} T={T} on {target}, {threads} threads")


@pytest.mark.parametrize("off", [{"passes": "none"}, {"disabled": ["fuse_recurrent"]}])
def test_unfused_llvm_runs_the_decompositions(off):
    """Without fuse_recurrent the llvm program runs concat, slices and fmas (the conv: the same bits) and
    ops.scan's native loop (the scan: its own sum order, within 2e-6)."""
    target = RUNNABLE[0]
    for C, K, bias in CONV_CASES:
        g = conv_graph(C, K, bias)
        prog = llvm(g, target, 2, **off)
        assert prog.graph.count("fused_causal_conv") == 0
        args = conv_args(7, C, K, bias)
        same(prog(*args), ggraph.compile(g, passes=[])(*args), f"conv C={C} K={K}")
    for H, D, N, G in SCAN_CASES:
        g = scan_graph(H, D, N, G)
        prog = llvm(g, target, 2, **off)
        assert prog.graph.count("fused_ssm_scan") == 0 and prog.graph.count("scan") == 1
        for T in TS:
            args = scan_args(T, H, D, N, G)
            close(prog(*args), scan_ref(*args), 2e-6, f"scan H={H} N={N} T={T}")


# -- state carried across calls ---------------------------------------------------------------------------------

def _steps(prog, args_at, n_state_arg, split, T):
    """Outputs of a prefill of ``split`` tokens then one call per token, the state handed on each time."""
    ys, state = [], None
    for lo, hi in [(0, split)] + [(t, t + 1) for t in range(split, T)]:
        args = args_at(lo, hi)
        if state is not None:
            args[n_state_arg] = state
        y, state = prog(*args)
        ys.append(y)
    return np.concatenate(ys), state


@pytest.mark.parametrize("backend", ["numpy", "llvm", "llvm-unfused"])
def test_prefill_then_decode_equals_prefill_of_all(backend):
    T = 12
    kw = {"passes": "none"} if backend == "llvm-unfused" else {}
    make = (lambda g: ggraph.compile(g, **kw)) if backend == "numpy" else \
        (lambda g: llvm(g, RUNNABLE[0], 2, **kw))

    C, K = 24, 4
    x, s0, w, b = conv_args(T, C, K, True)
    prog = make(conv_graph(C, K, True))
    whole = prog(x, s0, w, b)
    got = _steps(prog, lambda lo, hi: [x[lo:hi], s0, w, b], 1, 7, T)
    same(got, whole, f"conv on {backend}")

    H, D, N, G = 4, 4, 64, 2
    state, xs, dt, A, B, Cm = scan_args(T, H, D, N, G)
    prog = make(scan_graph(H, D, N, G))
    whole = prog(state, xs, dt, A, B, Cm)
    got = _steps(prog, lambda lo, hi: [state, xs[lo:hi], dt[lo:hi], A, B[lo:hi], Cm[lo:hi]], 0, 7, T)
    same(got, whole, f"scan on {backend}")
    close(whole, scan_ref(state, xs, dt, A, B, Cm), 2e-6, f"scan on {backend}")


# -- ggml's own ssm_conv and ssm_scan ----------------------------------------------------------------------

class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@pytest.fixture(scope="module")
def ggml():
    """llama-cpp-python's libggml: ``ggml(build)`` runs the op ``build(ctx, tensor)`` returns on one thread
    (``tensor(ctx, array)`` makes an input; numpy's shape is ggml's ne reversed) and gives its data."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="ggml's ops need llama-cpp-python")
    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    P = ctypes.c_void_p
    base.ggml_init.restype, base.ggml_init.argtypes = P, [_InitParams]
    base.ggml_free.argtypes = [P]
    for n in (1, 2, 3, 4):
        f = getattr(base, f"ggml_new_tensor_{n}d")
        f.restype, f.argtypes = P, [P, ctypes.c_int] + [ctypes.c_int64] * n
    base.ggml_get_data.restype, base.ggml_get_data.argtypes = P, [P]
    base.ggml_nelements.restype, base.ggml_nelements.argtypes = ctypes.c_int64, [P]
    base.ggml_ssm_conv.restype, base.ggml_ssm_conv.argtypes = P, [P, P, P]
    base.ggml_ssm_scan.restype, base.ggml_ssm_scan.argtypes = P, [P] * 8 + [ctypes.c_int64]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = P, [P]
    base.ggml_build_forward_expand.argtypes = [P, P]
    compute = cpu.ggml_graph_compute_with_ctx
    compute.restype, compute.argtypes = ctypes.c_int, [P, P, ctypes.c_int]

    def tensor(ctx, arr, dtype=0):                         # GGML_TYPE_F32 = 0, GGML_TYPE_I32 = 26
        arr = np.ascontiguousarray(arr)
        t = getattr(base, f"ggml_new_tensor_{arr.ndim}d")(ctx, dtype, *arr.shape[::-1])
        ctypes.memmove(base.ggml_get_data(t), arr.ctypes.data, arr.nbytes)
        return t

    def run(build):
        ctx = base.ggml_init(_InitParams(64 << 20, None, False))
        try:
            out = build(ctx, tensor)
            gf = base.ggml_new_graph(ctx)
            base.ggml_build_forward_expand(gf, out)
            assert compute(ctx, gf, 1) == 0
            n = base.ggml_nelements(out)
            data = ctypes.cast(base.ggml_get_data(out), ctypes.POINTER(ctypes.c_float))
            return np.ctypeslib.as_array(data, (n,)).copy()
        finally:
            base.ggml_free(ctx)
    return run, base


def ggml_conv(ggml, x, state, w):
    """ggml_ssm_conv of sx {K-1+T, C, 1} (concat(state, x) transposed, as llama.cpp builds it) and c {K, C}."""
    run, base = ggml
    xx = np.concatenate([state, x]).T[None]                                   # (1, C, K-1+T)
    return run(lambda ctx, t: base.ggml_ssm_conv(ctx, t(ctx, xx), t(ctx, w))).reshape(x.shape)


def ggml_scan(ggml, state, x, dt, A, B, C):
    """ggml_ssm_scan for one sequence (ids [0], K 1): y {D, H, T} then the final state {N, D, H}."""
    run, base = ggml
    T, H, D = x.shape
    out = run(lambda ctx, t: base.ggml_ssm_scan(ctx, t(ctx, state[None]), t(ctx, x[None]), t(ctx, dt[None]),
                                                t(ctx, A.reshape(H, 1)), t(ctx, B[None]), t(ctx, C[None]),
                                                t(ctx, np.zeros(1, np.int32), 26), 1))
    return out[:T * H * D].reshape(T, H, D), out[T * H * D:].reshape(state.shape)


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_causal_conv_gives_ggmls_bits(ggml, backend):
    for C, K, bias in CONV_CASES:
        if K == 1:
            continue                                                           # llama.cpp's models have K > 1
        g = conv_graph(C, K, False)
        prog = llvm(g, RUNNABLE[0], 2) if backend == "llvm" else ggraph.compile(g)
        for T in TS:
            args = conv_args(T, C, K, False)
            np.testing.assert_array_equal(prog(*args)[0], ggml_conv(ggml, *args), err_msg=f"C={C} K={K} T={T}")


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_ssm_scan_gives_ggmls_bits(ggml, backend):
    """ggml's bits where no glibc logf is involved (dt > 20: softplus passes dt through), and within 1e-7
    of them otherwise: glibc's expf and logf are an ulp off the correctly rounded ones ggraph computes in
    about 2% of inputs (measured: y 4e-8 apart, relative to its largest value)."""
    for H, D, N, G in SCAN_CASES:
        g = scan_graph(H, D, N, G)
        prog = llvm(g, RUNNABLE[0], 2) if backend == "llvm" else ggraph.compile(g)
        for T in TS:
            args = scan_args(T, H, D, N, G)
            close(prog(*args), [a.astype(np.float64) for a in ggml_scan(ggml, *args)], 1e-7, f"T={T} N={N}")
            args[2] = 20.5 + np.abs(args[2])
            args[3] = args[3] * 0.01
            same(prog(*args), ggml_scan(ggml, *args), f"dt > 20, T={T} N={N}")


# -- a state written back: the kernel writes it in place ------------------------------------------------------

def _mixer(x, s, w, st, xh, dt, A, B, Cm):
    y, s2 = ops.causal_conv(x, s, w)
    yh, st2 = ops.ssm_scan(st, xh, dt, A, B, Cm)
    return y, yh, state_write(s, s2), state_write(st, st2)


MIXER = (f32["T", 40], f32[3, 40], f32[40, 4], f32[4, 8, 64], f32["T", 4, 8], f32["T", 4], f32[4], f32["T", 2, 64],
         f32["T", 2, 64])


def mixer_args(T, seed):
    r = np.random.default_rng(seed)
    return [r.standard_normal(a.concrete({"T": T})).astype(np.float32) for a in MIXER]


@pytest.mark.parametrize("target", X86_NAMES)
def test_state_written_back_is_written_in_place(target):
    """A step that writes its new states back over its state inputs (as a model's step does): the kernels
    write them there (overwrite), no copy kernel runs, and the states are the numpy rules' bit for bit."""
    g = ggraph.trace(_mixer, *MIXER)
    prog = llvm(g, target, 2)
    assert [e.params.get("overwrite") for e in prog.graph.eqns if e.prim.name.startswith("fused_")] == [True, True]
    assert not any("copy" in c.kernel for c in prog.spec.calls), [c.kernel for c in prog.spec.calls]
    for T in TS:
        args = mixer_args(T, T)
        args[6] = -np.exp(args[6])
        want = ggraph.compile(g, passes=[])(*[a.copy() for a in args])
        got = prog(*args)
        same(got, want, f"T={T}")
        same([args[1], args[3]], want[2:], f"the state inputs, T={T}")         # donated, as a KV cache is


def test_state_read_elsewhere_is_not_overwritten():
    def fn(x, s, w):
        y, s2 = ops.causal_conv(x, s, w)
        return y + ops.reduce_sum(ops.reshape(s, (1, 16))), state_write(s, s2)   # s is read after the conv too
    g = ggraph.trace(fn, f32["T", 8], f32[2, 8], f32[8, 3])
    fused = optimize(g, ["fuse_recurrent"])
    assert fused.eqns[0].params == {}
    x, s, w = conv_args(5, 8, 3, False)
    got = llvm(g, RUNNABLE[0], 2)(x, s.copy(), w)
    same(got, ggraph.compile(g, passes=[])(x, s.copy(), w), "conv")


# -- the weights as GGUF stores them --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_gguf_shaped_weights_as_params(backend):
    """Mamba's conv weight [C, 1, K] and Mamba-2's A [H, 1] (as llama.cpp's converter writes them), as weights."""
    C, K, H, D, N, G = 20, 4, 4, 2, 16, 2

    def fn(x, s, w, b, state, xh, dt, A, B, Cm):
        y, s2 = ops.causal_conv(x, s, w, b)
        yh, state2 = ops.ssm_scan(state, xh, dt, A, B, Cm)
        return y, s2, yh, state2
    g = ggraph.trace(fn, f32["T", C], f32[K - 1, C], param("blk.0.ssm_conv1d.weight", f32[C, 1, K]),
                     param("blk.0.ssm_conv1d.bias", f32[C]), f32[H, D, N], f32["T", H, D], f32["T", H],
                     param("blk.0.ssm_a", f32[H, 1]), f32["T", G, N], f32["T", G, N])
    T = 5
    x, s, w, b = conv_args(T, C, K, True)
    state, xh, dt, A, B, Cm = scan_args(T, H, D, N, G)
    weights = {"blk.0.ssm_conv1d.weight": w.reshape(C, 1, K), "blk.0.ssm_conv1d.bias": b,
               "blk.0.ssm_a": A.reshape(H, 1)}
    prog = llvm(g, RUNNABLE[0], 2) if backend == "llvm" else ggraph.compile(g)
    prog.bind_weights(weights)
    got = prog(x, s, state, xh, dt, B, Cm)
    close(got[:2], conv_ref(x, s, w, b), 1e-6, "conv")
    close(got[2:], scan_ref(state, xh, dt, A, B, Cm), 2e-6, "scan")


# -- the pass: its input and output text ----------------------------------------------------------------------

def test_fuse_recurrent_text_and_log():
    g = ggraph.trace(lambda x, s, w: ops.causal_conv(x, s, w), f32["T", 8], f32[2, 8], f32[8, 3])
    log = RewriteLog()
    fused = optimize(g, ["fuse_recurrent"], log=log)
    assert str(fused) == ("{ lambda ; x:f32[T,8] s:f32[2,8] w:f32[8,3]. let\n"
                          "    a:f32[T,8] b:f32[2,8] = fused_causal_conv x s w\n"
                          "  in (a b) }")
    assert [e.detail for e in log.rewrites("fuse_recurrent")] == ["causal_conv -> fused_causal_conv"]
    off = optimize(g, "default", disabled=["fuse_recurrent"])
    assert off.count("fused_causal_conv") == 0 and off.count("concat") == 1
    s = ggraph.trace(ops.ssm_scan, f32[4, 8, 16], f32["T", 4, 8], f32["T", 4], f32[4], f32["T", 2, 16],
                     f32["T", 2, 16])
    for graph in (g, fused, s, optimize(s, ["fuse_recurrent"]), optimize(s, "none")):   # the text parses back
        text = graph.pretty(expand=True)
        assert parse(text).pretty(expand=True) == text


# -- errors: one line naming the op and the operand -----------------------------------------------------------

@pytest.mark.parametrize("avals,match", [
    ((f32["T", 8], f32[3, 8], f32[8, 3]), r"causal_conv: state must be f32\[2, 8\]"),
    ((f32["T", 8], f32[2, 8], f32[6, 3]), r"causal_conv: x .* has 8 channels but w .* has 6"),
    ((f32["T", 8, 1], f32[2, 8], f32[8, 3]), r"causal_conv: x must be f32\[T, C\]"),
    ((f32["T", 8], f32[2, 8], f32[8, 3], f32[7]), r"causal_conv: bias must be f32\[8\]"),
])
def test_causal_conv_errors(avals, match):
    with pytest.raises(ShapeError, match=match) as err:
        ggraph.trace(lambda *a: ops.causal_conv(*a), *avals)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("which,aval,match", [
    (1, f32["T", 4, 3], r"ssm_scan: x must be f32\[T, 4, 8\]"),
    (2, f32["T", 5], r"ssm_scan: dt must be f32\[T, 4\]"),
    (3, f32[4, 2], r"ssm_scan: A must be f32\[4\], one decay per head"),
    (4, f32["T", 2, 15], r"ssm_scan: B must be f32\[T, G, 16\]"),
    (5, f32["T", 3, 16], r"ssm_scan: B .* and C .* have different group counts"),
    (0, f32[4, 8, "T"], r"ssm_scan: state must have a static shape"),
])
def test_ssm_scan_errors(which, aval, match):
    avals = [f32[4, 8, 16], f32["T", 4, 8], f32["T", 4], f32[4], f32["T", 2, 16], f32["T", 2, 16]]
    avals[which] = aval
    with pytest.raises(ShapeError, match=match) as err:
        ggraph.trace(ops.ssm_scan, *avals)
    assert "\n" not in str(err.value)


def test_ssm_scan_groups_must_divide_heads():
    with pytest.raises(ShapeError, match=r"ssm_scan: 4 heads are not a multiple of the 3 groups"):
        ggraph.trace(ops.ssm_scan, f32[4, 8, 16], f32["T", 4, 8], f32["T", 4], f32[4], f32["T", 3, 16],
                     f32["T", 3, 16])
