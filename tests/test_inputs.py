"""Both backends check every input the same way: shapes, dtypes and byte sizes of weights of every type
(f32, f16 and bf16 included), and gather ids; a compiled callable keeps the weights it was given."""
import numpy as np
import pytest

import ggraph
from ggraph import f32, i32, ops
from ggraph.gguf.quants import quantize
from ggraph.ir import dtypes, param

BACKENDS = ["numpy", "llvm"]
W = {"emb": (16, 8), "wf": (12, 8), "wh": (12, 8), "wb": (12, 8), "wq": (12, 32)}


def lm(tokens, w):
    x = ops.take(w["emb"], tokens)                                 # (T, 8)
    y = ops.linear(x, w["wf"]) + ops.linear(x, w["wh"]) + ops.linear(x, w["wb"])
    return ops.linear(ops.concat([y, y, y[:, :8]], axis=-1), w["wq"])


AVALS = {"emb": param("emb", f32[16, 8]), "wf": param("wf", f32[12, 8]), "wh": param("wh", dtypes.f16[12, 8]),
         "wb": param("wb", dtypes.bf16[12, 8]), "wq": param("wq", dtypes.q8_0[12, 32])}


def weights(rng):
    a = {k: rng.standard_normal(s).astype(np.float32) for k, s in W.items()}
    return {"emb": a["emb"], "wf": a["wf"], "wh": a["wh"].astype(np.float16),
            "wb": (a["wb"].view(np.uint32) >> 16).astype(np.uint16), "wq": quantize(a["wq"], "q8_0")}


@pytest.fixture(scope="module")
def graph():
    return ggraph.trace(lm, i32["T"], AVALS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_given_at_compile_time_stay_bound(graph, backend):
    w = weights(np.random.default_rng(0))
    fn = ggraph.compile(graph, backend=backend, weights=w)
    tokens = np.array([1, 5, 15], np.int32)
    y = fn(tokens)                                                  # only the non-weight argument
    ref = ggraph.compile(graph)(tokens, w)                          # every argument, as traced
    np.testing.assert_allclose(y, ref, rtol=0.05, atol=0.05 * np.abs(ref).max())
    with pytest.raises(TypeError, match="takes 6 array arguments \\(or 1 without the weights bound"):
        fn(tokens, w["emb"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,bad,message", [
    ("wf", np.zeros((12, 9), np.float32), r"weight 'wf': expected shape f32\[12,8\] = \(12, 8\), got \(12, 9\)"),
    ("wh", np.zeros((13, 8), np.float16), r"weight 'wh': expected shape f16\[12,8\]"),
    ("wb", np.zeros((12, 7), np.uint16), r"weight 'wb': expected 192 bytes of bf16 blocks for bf16\[12,8\], got 168"),
    ("wq", np.zeros((12, 33), np.uint8), r"weight 'wq': expected 408 bytes of q8_0 blocks"),
    ("wb", np.zeros((12, 8), np.float32), r"weight 'wb': a bf16 value \(bf16\[12,8\]\) must be its uint8 block bytes"),
    ("emb", np.zeros((16, 8), np.complex64), r"weight 'emb': expected f32 data for f32\[16,8\], got complex64"),
])
def test_bad_weights_are_refused_by_name(graph, backend, name, bad, message):
    w = weights(np.random.default_rng(1))
    w[name] = bad
    with pytest.raises((ValueError, TypeError), match=message):
        ggraph.compile(graph, backend=backend, weights=w)
    missing = dict(w)
    del missing[name]
    with pytest.raises(KeyError, match=f"weight '{name}' is not in the weights given"):
        ggraph.compile(graph, backend=backend, weights=missing)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_ids_are_an_error(graph, backend):
    fn = ggraph.compile(graph, backend=backend, weights=weights(np.random.default_rng(2)))
    for bad in (16, -1, 1 << 20):
        with pytest.raises(IndexError, match=f"take.*id {bad} is out of range for a table of 16 rows"):
            fn(np.array([3, bad, 4], np.int32))
    assert np.isfinite(fn(np.array([3, 15, 0], np.int32))).all()    # and the program still runs after


@pytest.mark.parametrize("backend", BACKENDS)
def test_computed_ids_are_checked_too(backend):
    """ids made inside the graph (not a caller's array) are checked by the kernel itself."""
    g = ggraph.trace(lambda t, table: ops.take(table, t + 14), i32["T"], f32[16, 4])
    fn = ggraph.compile(g, backend=backend)
    table = np.arange(64, dtype=np.float32).reshape(16, 4)
    np.testing.assert_array_equal(fn(np.array([0, 1], np.int32), table), table[[14, 15]])
    with pytest.raises(IndexError, match="id 16 is out of range"):
        fn(np.array([0, 2], np.int32), table)


def test_gguf_weights_are_checked_against_the_graph(tmp_path):
    from ggraph.gguf import GGUFFile, write
    write(tmp_path / "w.gguf", {"general.architecture": "test"},
          {"emb": np.zeros((16, 8), np.float16), "wf": np.zeros((12, 4), np.float32)})
    g = ggraph.trace(lambda t, w: ops.take(w["emb"], t), i32["T"], {"emb": param("emb", f32[16, 8])})
    with GGUFFile(str(tmp_path / "w.gguf")) as f:
        for backend in BACKENDS:
            with pytest.raises(TypeError, match="weight 'emb': the graph reads it as f32\\[16,8\\] but the file "
                                                "stores f16"):
                ggraph.compile(g, backend=backend, weights=f)
        g2 = ggraph.trace(lambda t, w: ops.take(w["wf"], t), i32["T"], {"wf": param("wf", f32[12, 8])})
        with pytest.raises(ValueError, match="the file's tensor is \\[12,4\\]"):
            ggraph.compile(g2, backend="llvm", weights=f)


def test_a_graph_of_static_shapes_runs_natively():
    """A graph with no symbolic dim (no T) lays out its buffers on its first call like any other: it
    once skipped the layout (its T, None, looked like the last one laid out) and wrote through null."""
    def f(x, pos):
        h = ops.rms_norm(x, x[0, 0], eps=1e-6)
        return ops.rope(h, pos, base=10000.0) * 2.0
    graph = ggraph.trace(f, f32[8, 2, 64], i32[8])
    rng = np.random.default_rng(0)
    x, pos = rng.standard_normal((8, 2, 64)).astype(np.float32), np.arange(8, dtype=np.int32)
    fn = ggraph.compile(graph, backend="llvm")
    want = ggraph.compile(graph, backend="numpy")(x, pos)
    for _ in range(2):
        np.testing.assert_allclose(fn(x, pos), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_inputs_can_return_only_the_first_outputs(backend):
    """A decode step wants its logits, not the caches it updated in place: ``first`` leaves the rest out."""
    g = ggraph.trace(lambda tokens, w: (lm(tokens, w), ops.take(w["emb"], tokens)), i32["T"], AVALS)
    fn = ggraph.compile(g, backend=backend, weights=weights(np.random.default_rng(0)))
    tokens = np.array([1, 5, 15], np.int32)
    every = fn.run_inputs([tokens])
    some = fn.run_inputs([tokens], first=1)
    assert len(every) == 2 and len(some) == 1
    np.testing.assert_array_equal(some[0], every[0])
