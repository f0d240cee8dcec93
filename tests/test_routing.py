"""The routing primitives (top_k, argmax, comparisons as masks, take_along_axis, segment_sum): their numpy
rules against plain numpy (and top_k's ties against ggml's own std::sort), the llvm kernels against the
numpy rules on every feature set this host runs (bit for bit), errors, text, and a mixture-of-experts
layer written with them on both backends, with and without the default passes."""
import shutil
import subprocess

import numpy as np
import pytest

import ggraph
from ggraph import dtypes, f32, i32, ops
from ggraph.backends.llvm import jit
from ggraph.backends.llvm.kernels import routing
from ggraph.backends.llvm.target import X86_NAMES, named_target, runnable_targets
from ggraph.ir import param
from ggraph.ir.primitive import ShapeError
from ggraph.ir.text import parse

rng = np.random.default_rng(41)
RUNNABLE = [t.name for t in runnable_targets()]


def numpy_run(fn, avals, *arrays):
    return ggraph.compile(ggraph.trace(fn, *avals), backend="numpy", passes=[])(*arrays)


def llvm_run(fn, avals, *arrays, target="generic", threads=2, passes="default"):
    if target not in RUNNABLE:
        pytest.skip(f"host cannot run {target}")
    program = ggraph.compile(ggraph.trace(fn, *avals), backend="llvm", passes=passes,
                             target=named_target(target), threads=threads)
    return program(*arrays)


def ranked(row) -> list[int]:
    """The spec of top_k's order, one comparison at a time: NaN first, then larger values, ties by index."""
    return sorted(range(len(row)), key=lambda j: (not np.isnan(row[j]), -row[j] if not np.isnan(row[j]) else 0, j))


def tied(rows, n) -> np.ndarray:
    """Rows of few distinct values (ties everywhere), some with NaN, -0.0 and 0.0."""
    x = rng.integers(-2, 3, (rows, n)).astype(np.float32)
    x[::3, n // 2] = np.nan
    x[1::4, 0], x[1::4, -1] = -0.0, 0.0
    return x


# -- numpy rules against plain numpy ---------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(8, 1), (8, 2), (8, 8), (33, 5), (128, 8)])
def test_top_k_numpy_rule_orders_ties_by_index_and_nan_first(n, k):
    x = np.concatenate([tied(6, n), rng.standard_normal((3, n)).astype(np.float32)])
    values, indices = numpy_run(lambda x: ops.top_k(x, k), [f32["T", n]], x)
    want = np.array([ranked(row)[:k] for row in x], np.int32)
    np.testing.assert_array_equal(indices, want)
    np.testing.assert_array_equal(values, np.take_along_axis(x, want, -1))
    assert indices.dtype == np.int32 and values.dtype == np.float32


def test_top_k_of_one_is_argmax_and_argmax_is_numpys():
    x = np.concatenate([tied(9, 16), rng.standard_normal((4, 16)).astype(np.float32)])
    (_, top1), best = numpy_run(lambda x: (ops.top_k(x, 1), ops.argmax(x)), [f32["T", 16]], x)
    np.testing.assert_array_equal(best, np.argmax(x, axis=-1))
    np.testing.assert_array_equal(top1[:, 0], best)
    assert best.dtype == np.int32 and best.shape == (13,)


def test_top_k_ties_are_ggmls_argsort_order():
    """ggml's MoE routers take the first k of a descending std::sort of indices (ggml_argsort_top_k, ggml-cpu
    ops.cpp's cmp_argsort); built by g++ here as llama.cpp is, on rows of up to 16 experts it agrees with
    top_k on ties (libstdc++ sorts such rows by insertion)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++")
    src = r"""
    #include <algorithm>
    #include <cstdio>
    #include <cstdint>
    int main() {
        int rows, n; std::scanf("%d %d", &rows, &n);
        for (int r = 0; r < rows; r++) {
            float x[64]; int32_t idx[64];
            for (int j = 0; j < n; j++) { std::scanf("%f", &x[j]); idx[j] = j; }
            std::sort(idx, idx + n, [&](int32_t a, int32_t b) { return x[a] > x[b]; });
            for (int j = 0; j < n; j++) std::printf("%d ", idx[j]);
            std::printf("\n");
        }
    }"""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([gxx, "-O2", "-x", "c++", "-", "-o", f"{d}/argsort"], input=src, text=True, check=True)
        for n in (4, 8, 16):
            x = rng.integers(-2, 2, (40, n)).astype(np.float32)
            text = f"{len(x)} {n}\n" + "\n".join(" ".join(map(str, row)) for row in x)
            out = subprocess.run([f"{d}/argsort"], input=text, capture_output=True, text=True, check=True).stdout
            ggml = np.array([list(map(int, line.split())) for line in out.splitlines()], np.int32)
            _, ours = numpy_run(lambda x: ops.top_k(x, n), [f32["T", n]], x)
            np.testing.assert_array_equal(ours, ggml)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_take_along_axis_numpy_rule(axis):
    x = rng.standard_normal((3, 5, 4)).astype(np.float32)
    shape = list(x.shape)
    shape[axis] = 6
    idx = rng.integers(0, x.shape[axis], shape).astype(np.int32)
    out = numpy_run(lambda x, i: ops.take_along_axis(x, i, axis), [f32[3, 5, 4], i32[tuple(shape)]], x, idx)
    np.testing.assert_array_equal(out, np.take_along_axis(x, idx, axis))
    xi = (x * 100).astype(np.int32)
    out = numpy_run(lambda x, i: ops.take_along_axis(x, i, axis), [i32[3, 5, 4], i32[tuple(shape)]], xi, idx)
    np.testing.assert_array_equal(out, np.take_along_axis(xi, idx, axis))


def test_segment_sum_numpy_rule_sums_rows_in_order():
    values = (rng.standard_normal((40, 3, 7)) * 10.0 ** rng.integers(-4, 5, (40, 1, 1))).astype(np.float32)
    ids = rng.integers(0, 6, 40).astype(np.int32)
    out = numpy_run(lambda v, s: ops.segment_sum(v, s, 7), [f32["T", 3, 7], i32["T"]], values, ids)
    want = np.zeros((7, 3, 7), np.float32)
    for m in range(40):                                      # f32 adds, row after row
        want[ids[m]] = want[ids[m]] + values[m]
    np.testing.assert_array_equal(out, want)
    assert not out[6].any()                                  # a segment no row names is zero


@pytest.mark.parametrize("name,np_rule", [("less", np.less), ("greater", np.greater), ("less_equal", np.less_equal),
                                          ("greater_equal", np.greater_equal), ("equal", np.equal),
                                          ("not_equal", np.not_equal)])
def test_comparisons_give_masks_for_where_and_arithmetic(name, np_rule):
    op = getattr(ops, name)
    x = tied(5, 8)
    y = tied(5, 8)
    a = rng.integers(-3, 3, (5, 8)).astype(np.int32)

    def f(x, y, a, b):
        m = op(x, y)
        return m, ops.cast(m, f32) * x, ops.where(op(a, b), a, b), ops.cast(op(a, 1), f32)
    avals = [f32["T", 8], f32["T", 8], i32["T", 8], i32[8]]
    b = a[0]
    m, masked, picked, one = numpy_run(f, avals, x, y, a, b)
    assert m.dtype == np.int8
    np.testing.assert_array_equal(m, np_rule(x, y))
    np.testing.assert_array_equal(masked, np_rule(x, y).astype(np.float32) * x)
    np.testing.assert_array_equal(picked, np.where(np_rule(a, b), a, b))
    np.testing.assert_array_equal(one, np_rule(a, 1).astype(np.float32))
    for target in RUNNABLE:
        got = llvm_run(f, avals, x, y, a, b, target=target)
        for w, g in zip((m, masked, picked, one), got):
            np.testing.assert_array_equal(g, w, err_msg=f"{name} on {target}")


def test_tracer_comparison_operators():
    g = ggraph.trace(lambda x, y: (x > y, x >= y, x <= y, x < y), f32[4], f32[4])
    assert [e.prim.name for e in g.eqns] == ["greater", "greater_equal", "less_equal", "less"]


# -- llvm against numpy on every feature set ---------------------------------------------------------

def routed(x, idx, values, seg):
    top_vals, top_idx = ops.top_k(x, 3)
    return (top_vals, top_idx, ops.top_k(x, 1)[1], ops.top_k(x, x.shape[-1])[1], ops.argmax(x),
            ops.take_along_axis(x, idx, -1), ops.take_along_axis(x, ops.reshape(top_idx, [x.shape[0], 3]), 1),
            ops.segment_sum(values, seg, x.shape[0]))


@pytest.mark.parametrize("target", X86_NAMES)
@pytest.mark.parametrize("T", [1, 5, 33])
def test_llvm_matches_numpy_bit_for_bit(target, T):
    n = 12
    x = np.concatenate([tied(T, n)[: (T + 1) // 2], rng.standard_normal((T // 2, n)).astype(np.float32)])
    idx = rng.integers(0, n, (T, 4)).astype(np.int32)
    M = 2 * T + 1
    values = rng.standard_normal((M, 3, 5)).astype(np.float32)
    seg = rng.integers(0, T, M).astype(np.int32)
    avals = [f32["T", n], i32["T", 4], f32["R", 3, 5], i32["R"]]
    want = numpy_run(routed, avals, x, idx, values, seg)
    for threads in (1, 3):
        got = llvm_run(routed, avals, x, idx, values, seg, target=target, threads=threads)
        for i, (w, g) in enumerate(zip(want, got)):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w, err_msg=f"output {i} on {target}, {threads} threads")


@pytest.mark.parametrize("target", X86_NAMES)
def test_take_along_every_axis_of_a_3d_tensor_on_llvm(target):
    x = rng.standard_normal((4, 6, 5)).astype(np.float32)
    for axis in (0, 1, 2):
        shape = [4, 6, 5]
        shape[axis] = 3
        idx = rng.integers(0, x.shape[axis], shape).astype(np.int32)
        avals = [f32[4, 6, 5], i32[tuple(shape)]]
        got = llvm_run(lambda x, i: ops.take_along_axis(x, i, axis), avals, x, idx, target=target)
        np.testing.assert_array_equal(got, np.take_along_axis(x, idx, axis))
        xi = (x * 1000).astype(np.int32)
        got = llvm_run(lambda x, i: ops.take_along_axis(x, i, axis), [i32[4, 6, 5], avals[1]], xi, idx,
                       target=target)
        np.testing.assert_array_equal(got, np.take_along_axis(xi, idx, axis))


@pytest.mark.parametrize("name", ["neon", "neon_dotprod"])
def test_routing_kernels_assemble_for_aarch64(name):
    from llvmlite import ir
    from ggraph.backends.llvm.kernels.elementwise import emit_fused
    t = named_target(name)
    m = ir.Module()
    for emit in (lambda: routing.top_k(m, 4, t), lambda: routing.argmax(m, t),
                 lambda: routing.take_along_axis(m, t), lambda: routing.segment_sum(m, t)):
        emit()
    body = ggraph.trace(lambda i, experts: ops.cast(ops.equal(i, experts), f32), i32["T", 1], i32[8])
    emit_fused(m, t, body, [v.aval for v in body.invars], [v.aval for v in body.outvars])
    asm = jit.emit_assembly(m, t)
    for kernel in ("top_k_k4", "argmax", "take_along_axis", "segment_sum", "fused"):
        assert f"{kernel}" in asm, kernel


# -- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn,avals,message", [
    (lambda x: ops.top_k(x, 9), [f32["T", 8]], r"top_k: k=9 must be an int in 1\.\.8 \(the last dim of f32\[T,8\]\)"),
    (lambda x: ops.top_k(x, 0), [f32[8]], r"top_k: k=0"),
    (lambda x: ops.top_k(x, 2), [f32[8, "T"]], r"top_k: the last dim of f32\[8,T\] must be static"),
    (lambda x: ops.top_k(x, 2), [i32[8]], r"top_k: needs an f32 operand .* got i32\[8\]"),
    (lambda x: ops.argmax(x), [f32[()]], r"argmax: needs an f32 operand of at least 1 dim, got f32\[\]"),
    (lambda x, i: ops.take_along_axis(x, i, 1), [f32[4, 6], i32[3, 2]], r"take_along_axis: x f32\[4,6\] and idx "
     r"i32\[3,2\] differ off axis 1"),
    (lambda x, i: ops.take_along_axis(x, i, 0), [f32[4, 6], i32[4]], r"take_along_axis: .* one rank"),
    (lambda x, i: ops.take_along_axis(x, i, 2), [f32[4, 6], i32[4, 6]], r"take_along_axis: .* axis 2"),
    (lambda x, i: ops.take_along_axis(x, i, 0), [f32[4, 6], f32[4, 6]], r"take_along_axis: x must be f32 or i32 "
     r"and idx i32, got f32\[4,6\] and f32\[4,6\]"),
    (lambda v, s: ops.segment_sum(v, s, 4), [f32[5, 3], i32[4]], r"segment_sum: segment ids must be i32\[5\], one "
     r"per row of f32\[5,3\], got i32\[4\]"),
    (lambda v, s: ops.segment_sum(v, s, 4), [i32[5, 3], i32[5]], r"segment_sum: values must be f32"),
    (lambda x, y: ops.equal(x, y), [i32[4], f32[4]], r"equal: dtypes differ \(i32\[4\] and f32\[4\]\)"),
    (lambda x, y: ops.greater(x, y), [f32[4], f32[3]], r"greater: shapes \[4\] and \[3\] do not broadcast"),
])
def test_bad_shapes_and_dtypes_name_the_op_and_shapes(fn, avals, message):
    with pytest.raises(ShapeError, match=message):
        ggraph.trace(fn, *avals)


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_out_of_range_indices_are_one_line_errors_naming_the_op(backend):
    gather = ggraph.trace(lambda x, i: ops.take_along_axis(x, i, -1), f32["T", 8], i32["T", 2])
    combine = ggraph.trace(lambda v, s: ops.segment_sum(v, s, "T"), f32["T", 4], i32["T"])
    x, v = np.ones((3, 8), np.float32), np.ones((3, 4), np.float32)
    for graph, args, message in [
            (gather, (x, np.array([[0, 1], [8, 0], [0, 0]], np.int32)), r"take_along_axis.*8 is out of range"),
            (gather, (x, np.array([[0, 1], [-1, 0], [0, 0]], np.int32)), r"take_along_axis.*-1 is out of range"),
            (combine, (v, np.array([0, 3, 1], np.int32)), r"segment_sum.*segment id 3 is out of range"),
            (combine, (v, np.array([0, -2, 1], np.int32)), r"segment_sum.*segment id -2 is out of range")]:
        program = ggraph.compile(graph, backend=backend)
        with pytest.raises(IndexError, match=message) as err:
            program(*args)
        assert "\n" not in str(err.value)


# -- text and cost ------------------------------------------------------------------------------------

def test_printed_graph_reads_back_and_costs_count_the_ops():
    g = ggraph.trace(routed, f32["T", 12], i32["T", 4], f32["R", 3, 5], i32["R"])
    text = str(g)
    for line in ("f32[T,3] b:i32[T,3] = top_k[k=3] x", "i32[T] = argmax x", "= take_along_axis[axis=-1] x idx",
                 "f32[T,3,5] = segment_sum[num_segments=T] values seg"):
        assert line in text, text
    assert str(parse(text)) == text
    cost = g.cost(T=4, R=9)
    assert cost["top_k"]["flops"] == 3 * 4 * 12 and cost["argmax"]["flops"] == 4 * 12
    assert cost["segment_sum"]["flops"] == 9 * 15
    assert cost["take_along_axis"]["bytes"] == (4 * 4 + 2 * 4 * 4) * 4 + (4 * 3 + 2 * 4 * 3) * 4


# -- a mixture-of-experts layer -----------------------------------------------------------------------

E, K, N, TOP = 8, 64, 32, 2


def moe(x, router, experts, *, one_hot=False):
    """softmax -> top_k -> the chosen probabilities, renormalised -> each token times its experts (ops.take of
    the q8_0 [E, N, K] tensor, ops.linear) -> combined by segment_sum over tokens, or by a one-hot of the
    chosen experts over every expert's output."""
    T = x.shape[0]
    probs = ops.softmax(ops.linear(x, router))                               # [T, E]
    _, chosen = ops.top_k(probs, TOP)                                       # i32[T, TOP]
    gate = ops.take_along_axis(probs, chosen, -1)                           # [T, TOP]
    gate = gate / ops.reduce_sum(gate)
    if one_hot:
        hot = ops.cast(ops.equal(chosen.reshape(T, TOP, 1), ops.iota(E)), f32)     # [T, TOP, E]
        dense = ops.reduce_sum(ops.transpose(hot * gate.reshape(T, TOP, 1), (0, 2, 1))).reshape(T, E)
        every = ops.linear(x, ops.dequant(experts).reshape(E * N, K)).reshape(T, E, N)
        return ops.reduce_sum(ops.transpose(every * dense.reshape(T, E, 1), (0, 2, 1))).reshape(T, N)
    w = ops.take(experts, chosen.reshape(T * TOP))                           # [T*TOP, N, K]
    y = ops.linear(ops.broadcast_to(x.reshape(T, 1, K), (T, TOP, K)).reshape(T * TOP, 1, K), w)   # [T*TOP, 1, N]
    y = (y.reshape(T, TOP, N) * gate.reshape(T, TOP, 1)).reshape(T * TOP, N)
    token = ops.broadcast_to(ops.iota(T).reshape(T, 1), (T, TOP)).reshape(T * TOP)
    return ops.segment_sum(y, token, T)                                      # [T, N]


def moe_reference(x, router, experts):
    logits = x.astype(np.float64) @ router.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros((len(x), N))
    for t in range(len(x)):
        chosen = ranked(p[t])[:TOP]
        g = p[t, chosen] / p[t, chosen].sum()
        for e, w in zip(chosen, g):
            out[t] += w * (experts[e] @ x[t])
    return out


@pytest.mark.parametrize("one_hot", [False, True])
def test_moe_layer_on_both_backends_with_and_without_passes(one_hot):
    from ggraph.gguf.quants import dequantize, quantize
    x = rng.standard_normal((5, K)).astype(np.float32)
    router = rng.standard_normal((E, K)).astype(np.float32) * 0.3
    experts = rng.standard_normal((E, N, K)).astype(np.float32)
    blocks = quantize(experts.reshape(E * N, K), "q8_0")
    want = moe_reference(x, router, dequantize(blocks.reshape(-1), "q8_0", (E, N, K)))
    g = ggraph.trace(lambda x, r, w: moe(x, r, w, one_hot=one_hot), f32["T", K], f32[E, K],
                     param("blk.0.ffn_experts", dtypes.q8_0[E, N, K]))
    for backend in ("numpy", "llvm"):
        for passes in ("default", "none"):
            program = ggraph.compile(g, backend=backend, passes=passes, threads=2) if backend == "llvm" else \
                ggraph.compile(g, backend=backend, passes=passes)
            for T in (1, 5):
                got = program(x[:T], router, blocks)
                np.testing.assert_allclose(got, want[:T], rtol=1e-4, atol=1e-4 * np.abs(want).max(),
                                           err_msg=f"{backend}, passes {passes}, T={T}")
