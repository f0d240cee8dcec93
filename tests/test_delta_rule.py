"""gated_delta_rule: the numpy rule, the decomposition (ops.scan) and the fused llvm kernel against a float64 rule
written here from llama.cpp's semantics (``ggml_compute_forward_gated_delta_net_one_chunk``, which its CPU
backend runs for qwen3next's prefill and decode alike) and against ggml's own op (llama-cpp-python's libggml
through ctypes), on every feature set this host runs with 1-3 threads; the state carried across calls (a
prefill of 7 then decode steps gives a prefill of all); a state written back in place; the pass; the errors."""
import ctypes
import math

import numpy as np
import pytest

import ggraph
from ggraph import f32, ops
from ggraph.compiler import optimize
from ggraph.backends.llvm.target import X86_NAMES, runnable_targets
from ggraph.ir.primitive import ShapeError
from ggraph.passes import RewriteLog
from llvm_targets import compiled_for as llvm, fused_kernels
from test_recurrent_ops import TS, close, ggml, rule_and_decomposition  # noqa: F401  (ggml: the fixture)

rng = np.random.default_rng(7)
RUNNABLE = [t.name for t in runnable_targets()]
# (Hk, Hv, Dk, Dv): k heads shared by 2 value heads; Qwen3-Next's head size 128; sizes past whole vectors
# of 16 and Dk != Dv; 4 rows of 64 a unit
CASES = [(2, 4, 16, 16), (1, 2, 128, 128), (2, 2, 40, 24), (2, 8, 64, 64)]


def randn(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def delta_ref(q, k, v, g, beta, state, scale=None):
    """llama.cpp's gated delta net in float64, one value head at a time: S (Dk x Dv) is state[h].T; per token
    S = S·exp(g); d = (v - Sᵀk)·beta; S = S + k ⊗ d; y = (Sᵀq)·scale, scale = 1/sqrt(Dk); value head h reads
    q/k head h // (Hv/Hk) (llama.cpp repeats each k head Hv/Hk times, adjacent)."""
    T, Hk, Dk = q.shape
    Hv = v.shape[1]
    scale = 1 / math.sqrt(Dk) if scale is None else scale
    S = state.astype(np.float64).transpose(0, 2, 1).copy()                      # (Hv, Dk, Dv)
    y = np.zeros(v.shape)
    for t in range(T):
        for h in range(Hv):
            hk = h // (Hv // Hk)
            kt, qt = k[t, hk].astype(np.float64), q[t, hk].astype(np.float64)
            S[h] *= np.exp(float(g[t, h]))
            d = (v[t, h] - S[h].T @ kt) * float(beta[t, h])
            S[h] += np.outer(kt, d)
            y[t, h] = (S[h].T @ qt) * scale
    return y, S.transpose(0, 2, 1)


def args_for(T, Hk, Hv, Dk, Dv):
    """l2-normed q and k, log-decays g <= 0, beta in (0, 1), as qwen3next feeds them; a state from earlier tokens."""
    q, k = randn(T, Hk, Dk), randn(T, Hk, Dk)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -np.exp(randn(T, Hv))                                                    # decays exp(g) in (0, 1)
    beta = 1 / (1 + np.exp(-randn(T, Hv)))
    return [q, k, randn(T, Hv, Dv), g.astype(np.float32), beta.astype(np.float32), randn(Hv, Dv, Dk, scale=0.5)]


def graph(Hk, Hv, Dk, Dv):
    return ggraph.trace(ops.gated_delta_rule, f32["T", Hk, Dk], f32["T", Hk, Dk], f32["T", Hv, Dv], f32["T", Hv],
                        f32["T", Hv], f32[Hv, Dv, Dk])


# -- numpy: the rule and the decomposition -------------------------------------------------------------------

@pytest.mark.parametrize("Hk,Hv,Dk,Dv", CASES)
def test_numpy_rule_and_decomposition(Hk, Hv, Dk, Dv):
    rule_and_decomposition(graph(Hk, Hv, Dk, Dv), "gated_delta_rule", lambda T: args_for(T, Hk, Hv, Dk, Dv),
                           delta_ref, 2e-6)


def test_scale_and_strong_decay():
    """An explicit scale; g far below zero (the state forgotten: y is beta·(v·(k·q))·scale) and 0 (kept)."""
    Hk, Hv, Dk, Dv = 1, 2, 16, 8
    g = ggraph.trace(lambda *a: ops.gated_delta_rule(*a, scale=0.5), f32["T", Hk, Dk], f32["T", Hk, Dk],
                     f32["T", Hv, Dv], f32["T", Hv], f32["T", Hv], f32[Hv, Dv, Dk])
    args = args_for(3, Hk, Hv, Dk, Dv)
    args[3][:] = np.array([-200.0, 0.0], np.float32)
    for prog in (ggraph.compile(g), llvm(g, RUNNABLE[0], 2)):
        got = prog(*args)
        close(got, delta_ref(*args, scale=0.5), 2e-6, "scale 0.5")
        kq = (args[1][:, 0] * args[0][:, 0]).sum(-1)
        np.testing.assert_allclose(got[0][0, 0], args[4][0, 0] * args[2][0, 0] * kq[0] * 0.5, rtol=1e-5)


# -- llvm: the fused kernel, every feature set, 1-3 threads --------------------------------------------------

@pytest.mark.parametrize("target", X86_NAMES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_llvm_kernel(target, threads):
    for (Hk, Hv, Dk, Dv), prog, rule in fused_kernels(CASES, graph, "fused_gated_delta_rule", target, threads):
        for T in TS:
            args = args_for(T, Hk, Hv, Dk, Dv)
            got = prog(*args)
            what = f"Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv} T={T} on {target}, {threads} threads"
            close(got, delta_ref(*args), 2e-6, what)
            close(got, [w.astype(np.float64) for w in rule(*args)], 1e-6, what + " (vs the numpy rule)")


@pytest.mark.parametrize("off", [{"passes": "none"}, {"disabled": ["fuse_recurrent"]}])
def test_unfused_llvm_runs_the_decomposition(off):
    target = RUNNABLE[0]
    for Hk, Hv, Dk, Dv in CASES:
        g = graph(Hk, Hv, Dk, Dv)
        prog = llvm(g, target, 2, **off)
        assert prog.graph.count("fused_gated_delta_rule") == 0 and prog.graph.count("scan") == 1
        for T in (1, 7):
            args = args_for(T, Hk, Hv, Dk, Dv)
            close(prog(*args), delta_ref(*args), 2e-6, f"Hk={Hk} Hv={Hv} Dk={Dk} T={T}")


# -- the state carried across calls --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "llvm", "llvm-unfused"])
def test_prefill_then_decode_equals_prefill_of_all(backend):
    T, (Hk, Hv, Dk, Dv) = 12, CASES[0]
    kw = {"passes": "none"} if backend == "llvm-unfused" else {}
    g = graph(Hk, Hv, Dk, Dv)
    prog = ggraph.compile(g, **kw) if backend == "numpy" else llvm(g, RUNNABLE[0], 2, **kw)
    q, k, v, gg, beta, s0 = args_for(T, Hk, Hv, Dk, Dv)
    whole = prog(q, k, v, gg, beta, s0)
    ys, state = [], s0
    for lo, hi in [(0, 7)] + [(t, t + 1) for t in range(7, T)]:
        y, state = prog(q[lo:hi], k[lo:hi], v[lo:hi], gg[lo:hi], beta[lo:hi], state)
        ys.append(y)
    close([np.concatenate(ys), state], [w.astype(np.float64) for w in whole], 1e-6, f"steps on {backend}")
    close(whole, delta_ref(q, k, v, gg, beta, s0), 2e-6, f"whole on {backend}")


# -- ggml's own gated_delta_net ------------------------------------------------------------------------------

def ggml_delta(ggml, q, k, v, g, beta, state):
    """ggml_gated_delta_net for one sequence (K 1 snapshot): q and k repeated to the value heads first, each
    key head's copies adjacent, as llama.cpp's qwen3next graph repeats them; y {Dv, Hv, T}, then the state."""
    run, base = ggml
    P = ctypes.c_void_p
    base.ggml_gated_delta_net.restype, base.ggml_gated_delta_net.argtypes = P, [P] * 7 + [ctypes.c_int64]
    T, Hv, Dv = v.shape
    r = Hv // q.shape[1]
    qr, kr = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)
    out = run(lambda ctx, t: base.ggml_gated_delta_net(ctx, t(ctx, qr[None]), t(ctx, kr[None]), t(ctx, v[None]),
                                                       t(ctx, g[None, :, :, None]), t(ctx, beta[None, :, :, None]),
                                                       t(ctx, state[None]), 1))
    return out[:T * Hv * Dv].reshape(v.shape), out[T * Hv * Dv:].reshape(state.shape)


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_against_ggmls_gated_delta_net(ggml, backend):
    """The numpy rule and the kernel against ggml's op (its dots sum in another order: within 1e-6 of the
    largest value) on the cases with Dk = Dv, as ggml requires."""
    for Hk, Hv, Dk, Dv in [c for c in CASES if c[2] == c[3]]:
        g = graph(Hk, Hv, Dk, Dv)
        prog = llvm(g, RUNNABLE[0], 2) if backend == "llvm" else ggraph.compile(g)
        for T in TS:
            args = args_for(T, Hk, Hv, Dk, Dv)
            want = [w.astype(np.float64) for w in ggml_delta(ggml, *args)]
            close(want, delta_ref(*args), 2e-6, f"ggml itself, Hk={Hk} Hv={Hv} D={Dk} T={T}")
            close(prog(*args), want, 1e-6, f"Hk={Hk} Hv={Hv} D={Dk} T={T}")


# -- a state written back: the kernel writes it in place ------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_a_state_written_back_is_overwritten_in_place(backend):
    """A model's step writes the new state back over its state input (state_write): fuse_recurrent lets the
    kernel write it there directly (overwrite), and the results are those of a state kept apart."""
    Hk, Hv, Dk, Dv = CASES[0]

    def step(q, k, v, gg, beta, state):
        y, new = ops.gated_delta_rule(q, k, v, gg, beta, state)
        return y, ops.state_write(state, new)
    g = ggraph.trace(step, f32["T", Hk, Dk], f32["T", Hk, Dk], f32["T", Hv, Dv], f32["T", Hv], f32["T", Hv],
                     f32[Hv, Dv, Dk])
    prog = llvm(g, RUNNABLE[0], 2) if backend == "llvm" else ggraph.compile(g)
    assert "overwrite=True" in str(prog.graph)
    args = args_for(7, Hk, Hv, Dk, Dv)
    want = delta_ref(*args)
    state = args[5]
    y, _ = prog(*args)
    close([y, state], want, 2e-6, f"{backend}: y, and the state input after the call")


# -- the pass: its input and output text -----------------------------------------------------------------------

def test_fuse_recurrent_text_and_log():
    g = graph(1, 2, 4, 4)
    log = RewriteLog()
    fused = optimize(g, ["fuse_recurrent"], log=log)
    assert str(fused) == (
        "{ lambda ; q:f32[T,1,4] k:f32[T,1,4] v:f32[T,2,4] g:f32[T,2] beta:f32[T,2] state:f32[2,4,4]. let\n"
        "    a:f32[T,2,4] b:f32[2,4,4] = fused_gated_delta_rule[scale=0.5] q k v g beta state\n"
        "  in (a b) }")
    assert [e.detail for e in log.rewrites("fuse_recurrent")] == ["gated_delta_rule -> fused_gated_delta_rule"]


# -- errors: one line naming the op and the operand -------------------------------------------------------------

@pytest.mark.parametrize("which,aval,match", [
    (0, f32["T", 2, 9], r"gated_delta_rule: k must be shaped as q"),
    (1, f32["T", 2], r"gated_delta_rule: k must be f32\[T, Hk, Dk\]"),
    (2, f32["T", 3, 16], r"gated_delta_rule: v's 3 heads are not a multiple of q and k's 2 heads"),
    (3, f32["T", 2], r"gated_delta_rule: g must be f32\[T, 4\] \(one per token and value head\)"),
    (4, f32["T", 4, 1], r"gated_delta_rule: beta must be f32\[T, Hv\]"),
    (5, f32[4, 8, 16], r"gated_delta_rule: state must be f32\[4, 16, 8\] \(value heads, value dim, key dim\)"),
    (2, f32[5, 4, 16], r"gated_delta_rule: v .* has another token count than q"),
])
def test_errors(which, aval, match):
    avals = [f32["T", 2, 8], f32["T", 2, 8], f32["T", 4, 16], f32["T", 4], f32["T", 4], f32[4, 16, 8]]
    avals[which] = aval
    with pytest.raises(ShapeError, match=match) as err:
        ggraph.trace(ops.gated_delta_rule, *avals)
    assert "\n" not in str(err.value)
