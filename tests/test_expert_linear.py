"""ops.expert_linear (each token times its chosen experts of an [E, N, K] weight): the numpy rule against a
float64 reference, the fused llvm kernel (qmatmul_experts) against the numpy rule on every feature set this
host runs and against the decode qmatmul of each chosen expert, its grouped steps (tokens sorted by expert
into the prefill gemm) against the numpy rule and the prefill qmatmul, the unfused baseline, the fusion of
the pattern a researcher writes by hand, out-of-range ids, the cost rule, and an MoE layer on both backends."""
import numpy as np
import pytest

import ggraph
from ggraph import f32, i32, ops
from ggraph.backends.llvm.kernels.plan import experts_plan
from ggraph.backends.llvm.target import runnable_targets
from ggraph.compiler import optimize
from ggraph.gguf.quants import dequantize, quantize
from ggraph.ir import dtypes, param

rng = np.random.default_rng(412)
TARGETS = runnable_targets()
TYPES = ["q8_0", "q4_0", "q4_k", "q6_k", "f32"]
E, N, K = 8, 32, 256
# normalised error ||llvm - numpy|| / ||numpy|| allowed: the kernels meet q8 activations (q8_k: 256 a
# scale), numpy f32 ones
TOLERANCE = {"q8_0": 2e-2, "q4_0": 2e-2, "q4_k": 2e-2, "q6_k": 2e-2, "f32": 1e-5}


def experts(wtype: str, e=E, n=N, k=K):
    """Random experts stored as ``wtype`` ([E, N, row bytes] of blocks, or f32) and their f32 values."""
    w = (rng.standard_normal((e * n, k)) * 0.5).astype(np.float32)
    if wtype == "f32":
        return w.reshape(e, n, k), w.reshape(e, n, k)
    blocks = quantize(w, wtype).reshape(e, n, -1)
    return blocks, dequantize(blocks.reshape(-1), wtype, (e, n, k))


def expert_graph(wtype: str, k_per: int):
    return ggraph.trace(lambda x, ids, w: ops.expert_linear(x, w, ids), f32["T", K], i32["T", k_per],
                        param("blk.0.ffn_up_exps.weight", dtypes.from_name(wtype)[E, N, K]))


def inputs(T: int, k_per: int):
    x = rng.standard_normal((T, K)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k_per] for _ in range(T)]).astype(np.int32)
    return x, ids


def normalised_error(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("wtype", TYPES)
def test_numpy_rule_is_each_token_times_its_experts(wtype):
    w, wf = experts(wtype)
    x, ids = inputs(5, 2)
    got = ggraph.compile(expert_graph(wtype, 2), backend="numpy", passes=[])(x, ids, w)
    want = np.einsum("tk,tjnk->tjn", x.astype(np.float64), wf[ids].astype(np.float64))
    assert got.shape == (5, 2, N) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    unfused = ggraph.compile(expert_graph(wtype, 2), backend="numpy", passes="none")(x, ids, w)
    np.testing.assert_allclose(unfused, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("wtype", TYPES)
@pytest.mark.parametrize("k_per", [1, 2])
def test_llvm_matches_numpy_on_every_feature_set(target, wtype, k_per):
    w, _ = experts(wtype)
    g = expert_graph(wtype, k_per)
    fused = ggraph.compile(g, backend="llvm", target=target, threads=2)
    assert "qmatmul_experts" in str(fused.graph) and "take" not in str(fused.graph)
    unfused = ggraph.compile(g, backend="llvm", target=target, threads=2, passes="none")
    reference = ggraph.compile(g, backend="numpy", passes=[])
    x, ids = inputs(5, k_per)
    for T in (1, 5):                                          # one program: T is symbolic
        want = reference(x[:T], ids[:T], w)
        got = fused(x[:T], ids[:T], w)
        assert got.shape == want.shape == (T, k_per, N)
        assert normalised_error(got, want) < TOLERANCE[wtype], (target.name, wtype, T)
        np.testing.assert_allclose(unfused(x[:T], ids[:T], w), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("wtype", TYPES[:4])
def test_each_token_gets_the_decode_kernels_numbers(target, wtype):
    """One token's row against expert e equals the decode qmatmul of expert e's [N, K] matrix, bit for bit:
    the same gemv row dot on the same blocks."""
    w, _ = experts(wtype)
    dt = dtypes.from_name(wtype)
    every = ggraph.trace(lambda x, w: ops.concat([ops.linear(x, ops.slice(w, 0, e, e + 1).reshape(N, K))
                                                 for e in range(E)], -1),
                         f32[1, K], param("blk.0.ffn_up_exps.weight", dt[E, N, K]))
    x, ids = inputs(1, 2)
    dense = ggraph.compile(every, backend="llvm", target=target, threads=2)(x, w).reshape(E, N)
    got = ggraph.compile(expert_graph(wtype, 2), backend="llvm", target=target, threads=2)(x, ids, w)
    np.testing.assert_array_equal(got[0], dense[ids[0]])


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_out_of_range_ids_are_one_line_errors_naming_the_op(backend):
    w, _ = experts("q8_0")
    program = ggraph.compile(expert_graph("q8_0", 2), backend=backend)
    x, _ = inputs(3, 2)
    for bad in (E, -1):
        ids = np.array([[0, 1], [2, bad], [3, 4]], np.int32)
        with pytest.raises(IndexError, match=rf"expert_linear.*expert id {bad} is out of range for {E} experts") \
                as err:
            program(x, ids, w)
        assert "\n" not in str(err.value)


def test_cost_counts_only_the_chosen_experts():
    g = expert_graph("q8_0", 2)
    row = dtypes.q8_0.row_bytes(K)
    for T, chosen in ((1, 2), (3, 6), (64, E)):             # at most min(E, T*k) distinct experts a step
        for graph in (g, optimize(g)):
            cost = graph.cost(T=T)
            op = "expert_linear" if graph is g else "qmatmul_experts"
            assert cost[op]["flops"] == 2 * T * 2 * N * K
            assert cost[op]["bytes"] == chosen * N * row + T * K * 4 + T * 2 * 4 + T * 2 * N * 4


def test_graph_text_fused_and_unfused():
    g = expert_graph("q4_k", 2)
    assert "f32[T,2,32] = expert_linear x ids blk_0_ffn_up_exps_weight" in str(g).replace("w ", "w ") or \
        "expert_linear" in str(g)
    fused = str(optimize(g))
    assert "qmatmul_experts" in fused and "dequant" not in fused and "take" not in fused, fused
    baseline = str(optimize(g, "none"))
    for op in ("dequant", "take", "matmul"):
        assert op in baseline, baseline
    assert "qmatmul_experts" not in baseline


def test_the_pattern_written_by_hand_fuses():
    """matmul of each token's row against take(dequant(w), ids), the row shared by the token's experts
    (matmul broadcasting it, or broadcast by hand), becomes qmatmul_experts and gives the numpy rule's
    results on llvm."""
    def shared(x, ids, w):
        T = x.shape[0]
        return ops.matmul(x.reshape(T, 1, 1, K), ops.take(w, ids)).reshape(T, 2, N)

    def broadcast(x, ids, w):
        T = x.shape[0]
        rows = ops.broadcast_to(x.reshape(T, 1, 1, K), (T, 2, 1, K))
        return ops.linear(rows, ops.take(w, ids)).reshape(T, 2, N)

    w, _ = experts("q8_0")
    x, ids = inputs(5, 2)
    want = ggraph.compile(expert_graph("q8_0", 2), backend="numpy", passes=[])(x, ids, w)
    for fn in (shared, broadcast):
        g = ggraph.trace(fn, f32["T", K], i32["T", 2], param("blk.0.ffn_up_exps.weight", dtypes.q8_0[E, N, K]))
        text = str(optimize(g))
        assert "qmatmul_experts" in text and "take" not in text and "dequant" not in text, text
        got = ggraph.compile(g, backend="llvm", threads=2)(x, ids, w)
        assert normalised_error(got, want) < TOLERANCE["q8_0"], fn.__name__


# -- grouped steps: tokens sorted by expert, then the prefill gemm ---------------------------------------

GE, GN = 64, 48                   # Qwen3-MoE's 64 experts; 48 rows: a unit of 32 and a tail of 16
GROUP_FROM = experts_plan("q8_0", GN, TARGETS[0]).group_from     # tokens per expert from which a step is grouped


def grouped_threshold(k_per: int) -> int:
    """The least T whose step is grouped: T·k >= group_from·E."""
    return -(-GROUP_FROM * GE // k_per)


def routings(T: int, k_per: int) -> dict[str, np.ndarray]:
    """ids i32[T, k] routed in the ways that stress the sort: at random (k distinct experts a token; at small
    T most experts get no token), every token on the same experts (k = 1: all on one expert), every slot of
    every token on one expert, and skewed onto a few experts (some twice for one token)."""
    return {"random": np.stack([rng.permutation(GE)[:k_per] for _ in range(T)]).astype(np.int32),
            "same experts": np.tile(rng.permutation(GE)[:k_per], (T, 1)).astype(np.int32),
            "one expert": np.full((T, k_per), 37, np.int32),
            "skewed": rng.integers(0, 5, (T, k_per)).astype(np.int32) * 13}


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("wtype", TYPES)
@pytest.mark.parametrize("k_per", [1, 8])
def test_grouped_steps_match_numpy(target, wtype, k_per):
    """From one token to past the grouping threshold, with experts that get no token, all tokens on one
    expert, and k = 1 and 8 of 64 experts: the llvm kernel (per token below the threshold, grouped by expert
    from it) against the numpy rule. Float experts run per token at every T."""
    w, _ = experts(wtype, GE, GN, K)
    g = ggraph.trace(lambda x, ids, w: ops.expert_linear(x, w, ids), f32["T", K], i32["T", k_per],
                     param("blk.0.ffn_up_exps.weight", dtypes.from_name(wtype)[GE, GN, K]))
    fused = ggraph.compile(g, backend="llvm", target=target, threads=2)
    reference = ggraph.compile(g, backend="numpy", passes=[])
    at = grouped_threshold(k_per)
    for T in sorted({1, 2, at - 1, at, at + 1, 2 * at + 7}):
        x = rng.standard_normal((T, K)).astype(np.float32)
        for how, ids in routings(T, k_per).items():
            want = reference(x, ids, w)
            got = fused(x, ids, w)
            assert got.shape == (T, k_per, GN)
            assert normalised_error(got, want) < TOLERANCE[wtype], (target.name, wtype, T, how)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("wtype", TYPES[:4])
def test_grouped_step_gives_the_prefill_and_decode_kernels_numbers(target, wtype):
    """In a grouped step, the tokens of an expert with the plan's gemm_from tokens or more get the prefill
    qmatmul's (T > 1) numbers for that expert's [N, K] matrix, bit for bit (the same gemm on the same blocks,
    whichever tokens share its groups), and those of an expert with fewer, the decode qmatmul's (T = 1)."""
    w, _ = experts(wtype, GE, GN, K)
    dt = dtypes.from_name(wtype)
    every = ggraph.compile(ggraph.trace(lambda x, w: ops.concat([ops.linear(x, ops.slice(w, 0, e, e + 1).reshape(GN, K))
                                                                 for e in range(GE)], -1),
                                        f32["T", K], param("blk.0.ffn_up_exps.weight", dt[GE, GN, K])),
                           backend="llvm", target=target, threads=2)
    k_per, gemm_from = 8, experts_plan(wtype, GN, target).gemm_from
    T = max(grouped_threshold(k_per), gemm_from) + 3
    x = rng.standard_normal((T, K)).astype(np.float32)
    ids = np.stack([np.r_[3, 4 + rng.permutation(GE - 4)[:k_per - 1]] for _ in range(T)]).astype(np.int32)
    ids[: T // 2, 1] = 2                                          # expert 3 has every token, expert 2 half of them
    prefill = every(x, w).reshape(T, GE, GN)
    decode = np.stack([every(x[t:t + 1], w).reshape(GE, GN) for t in range(T)])
    g = ggraph.trace(lambda x, ids, w: ops.expert_linear(x, w, ids), f32["T", K], i32["T", k_per],
                     param("blk.0.ffn_up_exps.weight", dt[GE, GN, K]))
    got = ggraph.compile(g, backend="llvm", target=target, threads=2)(x, ids, w)
    tokens = np.bincount(ids.reshape(-1), minlength=GE)
    want = np.where((tokens[ids] >= gemm_from)[..., None], prefill[np.arange(T)[:, None], ids],
                    decode[np.arange(T)[:, None], ids])
    assert (tokens[ids] >= gemm_from).any() and (tokens[ids] < gemm_from).any() or gemm_from <= 1
    np.testing.assert_array_equal(got, want)


def test_grouped_step_reports_out_of_range_ids():
    w, _ = experts("q4_k", GE, GN, K)
    g = ggraph.trace(lambda x, ids, w: ops.expert_linear(x, w, ids), f32["T", K], i32["T", 8],
                     param("blk.0.ffn_up_exps.weight", dtypes.q4_k[GE, GN, K]))
    program = ggraph.compile(g, backend="llvm", threads=2)
    T = grouped_threshold(8) + 1
    x = rng.standard_normal((T, K)).astype(np.float32)
    for bad in (GE, -3):
        ids = routings(T, 8)["random"]
        ids[T // 2, 5] = bad
        with pytest.raises(IndexError, match=rf"expert_linear.*expert id {bad} is out of range for {GE} experts"):
            program(x, ids, w)


def test_rows_only_and_float_experts_are_never_grouped():
    """A batch's program (rows_only) computes every token as if alone, so its experts keep the decode
    arithmetic at every T; float experts have no grouped arithmetic."""
    for target in TARGETS:
        assert experts_plan("q4_k", GN, target, rows_only=True).grouped is None
        assert experts_plan("f32", GN, target).grouped is None
        assert experts_plan("q4_k", GN, target).grouped is not None


# -- a mixture-of-experts FFN -------------------------------------------------------------------------

D, F, TOP = 256, 512, 2


def moe_ffn(x, router, gate_exps, up_exps, down_exps):
    """softmax router -> top_k -> renormalised weights -> swiglu(gate, up) experts -> down experts -> the
    weighted sum of each token's experts."""
    T = x.shape[0]
    probs = ops.softmax(ops.linear(x, router))                               # [T, E]
    weight, chosen = ops.top_k(probs, TOP)                                   # [T, TOP], i32[T, TOP]
    weight = weight / ops.reduce_sum(weight)
    h = ops.swiglu(ops.expert_linear(x, gate_exps, chosen), ops.expert_linear(x, up_exps, chosen))  # [T, TOP, F]
    y = ops.expert_linear(h.reshape(T * TOP, F), down_exps, chosen.reshape(T * TOP, 1))         # [T*TOP, 1, D]
    y = y.reshape(T, TOP, D) * weight.reshape(T, TOP, 1)
    return ops.reduce_sum(ops.transpose(y, (0, 2, 1))).reshape(T, D)         # [T, D]


def moe_reference(x, router, gate, up, down):
    logits = x.astype(np.float64) @ router.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros((len(x), D))
    for t in range(len(x)):
        chosen = np.argsort(-p[t], kind="stable")[:TOP]
        for e, g in zip(chosen, p[t, chosen] / p[t, chosen].sum()):
            a, b = gate[e] @ x[t], up[e] @ x[t]
            out[t] += g * (down[e] @ (a / (1 + np.exp(-a)) * b))
    return out


def test_moe_ffn_on_both_backends_with_and_without_passes():
    x = rng.standard_normal((24, D)).astype(np.float32)
    router = (rng.standard_normal((E, D)) * 0.3).astype(np.float32)
    (gate, gf), (up, uf), (down, df) = experts("q8_0", E, F, D), experts("q8_0", E, F, D), experts("q8_0", E, D, F)
    want = moe_reference(x, router, gf, uf, df)
    g = ggraph.trace(moe_ffn, f32["T", D], f32[E, D], param("blk.0.ffn_gate_exps.weight", dtypes.q8_0[E, F, D]),
                     param("blk.0.ffn_up_exps.weight", dtypes.q8_0[E, F, D]),
                     param("blk.0.ffn_down_exps.weight", dtypes.q8_0[E, D, F]))
    assert str(optimize(g)).count("qmatmul_experts") == 3
    for backend in ("numpy", "llvm"):
        for passes in ("default", "none"):
            options = {"threads": 2} if backend == "llvm" else {}
            program = ggraph.compile(g, backend=backend, passes=passes, **options)
            for T in (1, 5, 24):                        # 24 tokens x 2 of 8 experts: a grouped step
                got = program(x[:T], router, gate, up, down)
                err = normalised_error(got, want[:T])
                assert err < (2e-2 if backend == "llvm" and passes == "default" else 1e-5), (backend, passes, T, err)
