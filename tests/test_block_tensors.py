"""Block-typed tensors of any rank: slices, reshapes and gathers over the leading axes of a quantised
weight ([E, N, K] experts as GGUF stores them) read the right blocks on the llvm backend, fuse into
qmatmul like a 2-D weight, and agree with the numpy backend for every block type, rank and position."""
import numpy as np
import pytest

import ggraph
from ggraph import f32, i32, ops
from ggraph.backends.llvm.kernels import QUANT_TYPES
from ggraph.backends.llvm.target import named_target, runnable_targets
from ggraph.compiler import optimize
from ggraph.ir import dtypes, param
from ggraph.passes import RewriteLog
from test_llvm_kernels import random_blocks

E, N, K, M = 3, 32, 256, 5
TYPES = [t.name for t in QUANT_TYPES]
TARGETS = [t.name for t in runnable_targets()]


def experts(w2, w3, w4, ids):
    """Each way of reaching one [N, K] matrix (or [1, N, K]) inside a bigger quantised tensor."""
    ways = [ops.slice(w2, 0, r, r + N) for r in (0, 7, 2 * N)]                # rows of a 2-D tensor
    ways += [ops.slice(w3, 0, e, e + 1) for e in range(E)]                    # [1, N, K], at every position
    ways += [ops.slice(w3, 0, e, e + 1).reshape(N, K) for e in (1, E - 1)]     # as [N, K]
    inner = ops.slice(w3, 1, 8, 8 + N // 2)                                    # not leading: a copy, [E, N/2, K]
    ways += [ops.slice(inner, 0, e, e + 1).reshape(N // 2, K) for e in range(E)]
    ways += [ops.slice(ops.slice(w4, 0, 1, 2), 1, e, e + 1).reshape(N, K) for e in range(E)]   # [2, E, N, K]
    ways += [w3.reshape(E * N, K)]
    return ways, ops.take(w3, ids)                                              # chosen experts, f32 [2, N, K]


def model(x, ids, w2, w3, w4):
    ways, chosen = experts(w2, w3, w4, ids)
    ys = [ops.linear(x, w).reshape(M, w.shape[-2]) for w in ways]
    return ops.concat(ys, -1), ops.matmul(x, chosen)                           # [M, ...], [2, M, N]


def graph_and_inputs(wtype: str, seed: int = 0):
    dt = dtypes.from_name(wtype)
    rng = np.random.default_rng(seed)
    g = ggraph.trace(model, f32[M, K], i32[2], param("w2", dt[E * N, K]), param("w3", dt[E, N, K]),
                     param("w4", dt[2, E, N, K]))
    row = dt.row_bytes(K)
    weights = {"w2": random_blocks(dt, E * N, K, rng),
               "w3": random_blocks(dt, E * N, K, rng).reshape(E, N, row),
               "w4": random_blocks(dt, 2 * E * N, K, rng).reshape(2, E, N, row)}
    x = rng.standard_normal((M, K)).astype(np.float32)
    return g, weights, (x, np.array([E - 1, 0], np.int32))


def rel_error(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("wtype", TYPES)
def test_slices_reshapes_and_gathers_of_quantised_tensors(wtype, target):
    g, weights, args = graph_and_inputs(wtype)
    want = ggraph.compile(g, backend="numpy", passes="none", weights=weights)(*args)
    fused = ggraph.compile(g, backend="llvm", weights=weights, target=named_target(target))(*args)
    for got, ref in zip(fused, want):                 # qmatmul quantises the activations as ggml does
        assert rel_error(got, ref) < 1.5e-2
    if target == TARGETS[-1]:                         # the unfused graph reads the same blocks, in f32
        plain = ggraph.compile(g, backend="llvm", passes="none", weights=weights, target=named_target(target))(*args)
        for got, ref in zip(plain, want):
            assert rel_error(got, ref) < 1e-5


def test_every_matrix_of_an_expert_tensor_fuses_into_qmatmul():
    g, _, _ = graph_and_inputs("q8_0")
    log = RewriteLog()
    fused = optimize(g, log=log)
    assert fused.count("qmatmul") == 15 and fused.count("dequant") == 0
    assert "matmul · dequant(a q8_0[1,32,256] value) -> qmatmul on q8_0" in str(log)


def test_explain_says_why_a_batch_of_quantised_matrices_is_not_fused():
    g = ggraph.trace(lambda x, w3: ops.linear(x, w3), f32[M, K], param("w3", dtypes.q8_0[E, N, K]))
    log = RewriteLog()
    optimize(g, log=log)
    assert ("dequant of w3 kept: matmul reads it as a batch of matrices f32[3,32,256] (qmatmul takes one "
            "matrix; slice or take the one it needs first)") in str(log)


def test_quantised_reshapes_keep_the_rows_of_blocks():
    w = param("w", dtypes.q4_k[E, N, K])
    with pytest.raises(ggraph.ir.primitive.ShapeError, match=r"reshapes only on its leading axes .* the last dim "
                                                               r"must stay 256, got \[3,8192\]"):
        ggraph.trace(lambda w: ops.dequant(w.reshape(E, N * K)), w)


LONE_VIEWS = {"first expert": lambda w: ops.slice(w, 0, 0, 1).reshape(N, K),
              "first rows": lambda w: ops.slice(w.reshape(E * N, K), 0, 0, 16),
              "all rows": lambda w: w.reshape(E * N, K)}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("view", LONE_VIEWS)
@pytest.mark.parametrize("wtype", ["q4_k", "q5_k", "q6_k"])
def test_a_lone_view_of_a_weight_reads_it_in_the_files_layout(wtype, view, target):
    """A view starting at a weight's first byte is not the whole weight: it must not be laid out anew."""
    dt = dtypes.from_name(wtype)
    rng = np.random.default_rng(1)
    weights = {"w": random_blocks(dt, E * N, K, rng).reshape(E, N, -1)}
    x = rng.standard_normal((M, K)).astype(np.float32)
    g = ggraph.trace(lambda x, w: ops.linear(x, LONE_VIEWS[view](w)), f32[M, K], param("w", dt[E, N, K]))
    want = ggraph.compile(g, backend="numpy", weights=weights)(x)
    program = ggraph.compile(g, backend="llvm", weights=weights, target=named_target(target))
    assert rel_error(program(x), want) < 1.5e-2
    assert [b.layout for b in program.spec.buffers if b.kind == "param"] == [None]
