"""The weight tools on mixture-of-experts files: quantize, imatrix, perplexity, bench, dump/diff, split/merge.

Each is checked against llama.cpp on the tiny qwen3moe model that llama.cpp's own converter made
(``hf_models``: 2 layers, 8 experts of width 128, top-2); quantize and imatrix also on every other MoE
family of ``hf_models`` (qwen2moe, olmoe, mixtral, gpt-oss), and the quantiser's expert rules on small
hand-written qwen2moe files (8 layers, shared experts beside stacked ones, 4 or 8 experts), where
llama.cpp reads the FFN's layer from each tensor's name rather than counting tensors.

Bit for bit: every file type's per-tensor types, whole quantised files (with and without a per-expert
imatrix, requantised too), split files. To a tolerance: imatrix values (float accumulation on f32 files;
8-bit activation rounding on quantised ones) and perplexity, with the measured numbers beside each bound.
"""
from __future__ import annotations

import io
import re

import numpy as np
import pytest

import hf_models
from ggraph import imatrix
from ggraph import quantize as Q
from ggraph.cli import main
from ggraph.gguf import GGUFFile, Typed, write
from llama_tools import quantizes_as_llama_quantize
from zoo import llama_quantize

from test_imatrix import relative_differences
from test_perplexity import CALIBRATION, CALIBRATION_PATH


# -- small qwen2moe files: the mix rules alone ---------------------------------------------------

def write_qwen2moe(path, *, n_layer=8, n_embd=256, n_head=4, n_head_kv=1, n_expert=8, n_ff_exp=128,
                   n_ff_shexp=256, n_vocab=96, seed=0):
    """An f16 qwen2moe file, random weights: per layer attention with biases, a router, stacked experts
    [E, F, D] / [E, D, F] and a shared expert with its [1, D] gate (which llama-quantize writes as [D]).
    llama_model_quantize reads only its hyper-parameters and tensor names, so no tokenizer is needed."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float16)

    D, kv = n_embd, n_embd // n_head * n_head_kv
    tensors = {"token_embd.weight": w(n_vocab, D)}
    for i in range(n_layer):
        b = f"blk.{i}."
        tensors.update({
            b + "attn_norm.weight": np.ones(D, np.float32),
            b + "attn_q.weight": w(D, D), b + "attn_q.bias": np.zeros(D, np.float32),
            b + "attn_k.weight": w(kv, D), b + "attn_k.bias": np.zeros(kv, np.float32),
            b + "attn_v.weight": w(kv, D), b + "attn_v.bias": np.zeros(kv, np.float32),
            b + "attn_output.weight": w(D, D),
            b + "ffn_norm.weight": np.ones(D, np.float32),
            b + "ffn_gate_inp.weight": w(n_expert, D).astype(np.float32),
            b + "ffn_gate_exps.weight": w(n_expert, n_ff_exp, D), b + "ffn_up_exps.weight": w(n_expert, n_ff_exp, D),
            b + "ffn_down_exps.weight": w(n_expert, D, n_ff_exp),
            b + "ffn_gate_inp_shexp.weight": w(1, D).astype(np.float32),     # [1, D], as llama.cpp converts it
            b + "ffn_gate_shexp.weight": w(n_ff_shexp, D), b + "ffn_up_shexp.weight": w(n_ff_shexp, D),
            b + "ffn_down_shexp.weight": w(D, n_ff_shexp),
        })
    tensors.update({"output_norm.weight": np.ones(D, np.float32), "output.weight": w(n_vocab, D)})
    a = "qwen2moe"
    md = {"general.architecture": a, "general.name": "tiny qwen2moe",
          f"{a}.block_count": Typed(n_layer, "u32"), f"{a}.context_length": Typed(4096, "u32"),
          f"{a}.embedding_length": Typed(D, "u32"), f"{a}.feed_forward_length": Typed(n_ff_shexp, "u32"),
          f"{a}.attention.head_count": Typed(n_head, "u32"), f"{a}.attention.head_count_kv": Typed(n_head_kv, "u32"),
          f"{a}.rope.freq_base": Typed(1e6, "f32"), f"{a}.attention.layer_norm_rms_epsilon": Typed(1e-6, "f32"),
          f"{a}.expert_count": Typed(n_expert, "u32"), f"{a}.expert_used_count": Typed(2, "u32"),
          f"{a}.expert_feed_forward_length": Typed(n_ff_exp, "u32"),
          f"{a}.expert_shared_feed_forward_length": Typed(n_ff_shexp, "u32"),
          "general.file_type": Typed(1, "u32")}
    write(path, md, tensors)
    return path


SMALL = {  # name -> overrides: 8 experts (llama.cpp's 8-expert rules) GQA 4, 4 experts GQA 2, rows of 64
    "qwen2moe-8x": dict(),
    "qwen2moe-4x": dict(n_expert=4, n_head_kv=2),
    "qwen2moe-64": dict(n_expert=4, n_ff_exp=64, n_ff_shexp=64, n_layer=3),
}


@pytest.fixture(scope="module")
def small_moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-small")
    return {name: write_qwen2moe(root / f"{name}.gguf", **ov) for name, ov in SMALL.items()}


@pytest.fixture(scope="module")
def qwen3moe():
    """llama.cpp's conversion of the tiny Hugging Face Qwen3-MoE (f32)."""
    return hf_models.converted("qwen3moe", "f32")


def plans_agree(src, tmp_path, skip=("Q2_K_S",)):
    """Every file type's per-tensor types, in order, as ggraph plans them and llama.cpp makes them."""
    with GGUFFile(src) as f:
        for name, ft in Q.FILE_TYPES.items():
            if name in skip:
                continue
            llama_quantize(src, tmp_path / "ref.gguf", ft.id)
            with GGUFFile(tmp_path / "ref.gguf") as ref:
                want = [(n, t.dtype) for n, t in ref.tensors.items()]
            got = list(Q.plan(f, ft).types.items())
            assert got == want, f"{src.name} {name}: " + ", ".join(
                f"{n}: ggraph {g} llama.cpp {w}" for (n, g), (_, w) in zip(got, want) if g != w)


@pytest.mark.slow
@pytest.mark.parametrize("model", SMALL)
def test_mix_rules_match_llama_cpp_on_small_moe(small_moe, model, tmp_path):
    pytest.importorskip("llama_cpp")
    plans_agree(small_moe[model], tmp_path)


# hf_models' families whose FFN is a mixture of experts (shared experts in qwen2moe, expert biases and MXFP4-ready
# experts in gpt-oss): each tool is checked on every one of them
MOE_FAMILIES = [f for f in ("qwen3moe", "qwen2moe", "olmoe", "mixtral", "gpt-oss") if f in hf_models.FAMILIES]


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_mix_rules_match_llama_cpp_on_every_moe_family(family, tmp_path):
    plans_agree(hf_models.converted(family, "f32"), tmp_path)


def test_expert_rules_read_the_layer_from_the_name(small_moe):
    """Q4_K_M's use_more_bits over 8 layers: layers 0, 3, 6, 7 get q6_k for both the stacked and the shared
    expert's ffn_down (a counter over the 16 ffn_down tensors would give other layers)."""
    with GGUFFile(small_moe["qwen2moe-4x"]) as f:
        types = Q.plan(f, "Q4_K_M").types
    for kind in ("exps", "shexp"):
        six = [i for i in range(8) if types[f"blk.{i}.ffn_down_{kind}.weight"].name in ("q6_k", "q8_0")]
        assert six == [0, 3, 6, 7], (kind, six)
    assert types["blk.0.ffn_gate_inp.weight"].name == "f32"                  # the router is never quantised
    assert types["blk.0.ffn_gate_exps.weight"].name == "q4_k"


def test_eight_experts_bump_attention(small_moe):
    with GGUFFile(small_moe["qwen2moe-8x"]) as f:
        types = Q.plan(f, "Q4_K_M").types
    assert {types[f"blk.{i}.attn_{m}.weight"].name for i in range(8) for m in "kv"} == {"q8_0"}
    assert {types[f"blk.{i}.attn_output.weight"].name for i in range(8)} == {"q5_k"}
    with GGUFFile(small_moe["qwen2moe-4x"]) as f:
        types = Q.plan(f, "Q4_K_M").types
    assert types["blk.1.attn_k.weight"].name == "q4_k" and types["blk.1.attn_output.weight"].name == "q4_k"


def test_mxfp4_moe_gives_stacked_experts_mxfp4(small_moe):
    with GGUFFile(small_moe["qwen2moe-8x"]) as f:
        types = Q.plan(f, "MXFP4_MOE").types
    assert {n: t.name for n, t in types.items() if t.name == "mxfp4"} == {
        f"blk.{i}.ffn_{m}_exps.weight": "mxfp4" for i in range(8) for m in ("gate", "up", "down")}
    assert types["blk.0.ffn_down_shexp.weight"].name == "q8_0" and types["output.weight"].name == "q8_0"


def moe_imatrix_file(path, src, seed: int = 0) -> None:
    """A random importance matrix in llama.cpp's GGUF format for every matrix of ``src``: per expert for
    stacked experts, one expert of each seeing no rows (llama-quantize then uses ones for it)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    with GGUFFile(src) as f:
        for name, t in f.tensors.items():
            if len(t.shape) in (2, 3) and name != "token_embd.weight" and name.startswith("blk."):
                n_mat, K = (t.shape[0] if len(t.shape) == 3 else 1), t.shape[-1]
                sums = rng.gamma(0.5, 2.0, (n_mat, K)).astype(np.float32) * 512
                sums[:, : K // 16] = 0                                   # some columns never active
                counts = rng.integers(100, 600, (n_mat, 1)).astype(np.float32)
                if n_mat > 1:
                    counts[1] = 0
                    sums[1] = 0
                tensors[f"{name}.in_sum2"], tensors[f"{name}.counts"] = sums, counts
    write(path, {"general.type": "imatrix", "imatrix.datasets": Typed(["calibration.txt"], "str"),
                 "imatrix.chunk_count": Typed(1, "u32"), "imatrix.chunk_size": Typed(512, "u32")}, tensors)


SMALL_FILE_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "Q2_K", "Q4_0", "MXFP4_MOE")


@pytest.mark.slow
@pytest.mark.parametrize("with_imatrix", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("ftype", SMALL_FILE_TYPES)
def test_small_moe_files_equal_llama_quantize(small_moe, ftype, with_imatrix, tmp_path, monkeypatch):
    """Whole files, byte for byte, with per-expert importance (one expert of each stack without rows)."""
    monkeypatch.chdir(tmp_path)
    src = small_moe["qwen2moe-8x"]
    args = []
    if with_imatrix:
        moe_imatrix_file(tmp_path / "imatrix.gguf", src)
        args = ["--imatrix", "imatrix.gguf"]
    quantizes_as_llama_quantize(src, ftype, *args)


@pytest.mark.slow
@pytest.mark.parametrize("ftype, with_imatrix", [("Q8_0", False), ("Q4_K_M", False), ("Q4_K_M", True),
                                                 ("IQ4_XS", True), ("MXFP4_MOE", False)])
def test_qwen3moe_files_equal_llama_quantize(qwen3moe, ftype, with_imatrix, tmp_path, monkeypatch):
    """The converted tiny Qwen3-MoE: its expert rows of 128 take the fallbacks (q4_k -> q5_0, q6_k -> q8_0)."""
    monkeypatch.chdir(tmp_path)
    args = []
    if with_imatrix:
        moe_imatrix_file(tmp_path / "imatrix.gguf", qwen3moe, seed=1)
        args = ["--imatrix", "imatrix.gguf"]
    quantizes_as_llama_quantize(qwen3moe, ftype, *args)


@pytest.mark.slow
def test_requantized_experts_equal_llama_quantize(tmp_path, monkeypatch):
    """llama.cpp's Q4_K_M qwen3moe (stacked q4_k and q5_0 experts) dequantised and quantised again to Q5_K_M."""
    monkeypatch.chdir(tmp_path)
    quantizes_as_llama_quantize(hf_models.converted("qwen3moe", "q4_k_m"), "Q5_K_M", "--allow-requantize")


@pytest.mark.slow
@pytest.mark.parametrize("ftype, with_imatrix", [("Q4_K_M", True), ("MXFP4_MOE", False)])
@pytest.mark.parametrize("family", [f for f in MOE_FAMILIES if f != "qwen3moe"])
def test_moe_family_files_equal_llama_quantize(family, ftype, with_imatrix, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = hf_models.converted(family, "f32")
    args = []
    if with_imatrix:
        moe_imatrix_file(tmp_path / "imatrix.gguf", src, seed=2)
        args = ["--imatrix", "imatrix.gguf"]
    quantizes_as_llama_quantize(src, ftype, *args)


def test_expert_imatrix_of_the_wrong_size_is_refused(small_moe, tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    write(bad, {"general.type": "imatrix", "imatrix.datasets": Typed(["x"], "str"),
                "imatrix.chunk_count": Typed(1, "u32"), "imatrix.chunk_size": Typed(512, "u32")},
          {"blk.0.ffn_up_exps.weight.in_sum2": np.ones((1, 256), np.float32),
           "blk.0.ffn_up_exps.weight.counts": np.ones((1, 1), np.float32)})
    out = tmp_path / "out.gguf"
    assert main(["quantize", "--imatrix", str(bad), str(small_moe["qwen2moe-8x"]), str(out), "Q4_K_M"]) == 1
    err = capsys.readouterr().err
    assert "imatrix entry 'blk.0.ffn_up_exps.weight' has 256 values, the tensor's rows have 256 in each of its " \
           "8 experts (so 2048 values)" in err, err
    assert not out.exists()


# -- imatrix: the instrument_imatrix pass on expert matmuls ------------------------------------------

ROUTER, UP, DOWN = "blk.0.ffn_gate_inp.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"
E, TOP_K, K, N = 4, 2, 64, 32


def tiny_moe_graph():
    """x -> router (f32) -> top 2 of 4 experts -> up experts (q8_0) -> h² -> down experts (q8_0); also the ids
    and h."""
    from ggraph import ops
    from ggraph.ir.dtypes import Aval, f32, param, q8_0
    from ggraph.ir.trace import trace

    def f(x, w):
        T = x.shape[0]
        _, ids = ops.top_k(ops.softmax(ops.linear(x, w[ROUTER])), TOP_K)                  # (T, k)
        h = ops.expert_linear(x, w[UP], ids)                                              # (T, k, N)
        y = ops.expert_linear((h * h).reshape(T * TOP_K, N), w[DOWN], ids.reshape(T * TOP_K, 1))   # (T·k, 1, K)
        return y, ids, h
    weights = {ROUTER: param(ROUTER, Aval((E, K), f32)), UP: param(UP, Aval((E, N, K), q8_0)),
               DOWN: param(DOWN, Aval((E, K, N), q8_0))}
    return trace(f, f32["T", K], weights)


def tiny_moe_weights(rng):
    from ggraph.gguf.quants import quantize
    from ggraph.ir.dtypes import q8_0
    return {ROUTER: rng.standard_normal((E, K)).astype(np.float32),
            UP: quantize(rng.standard_normal((E, N, K)).astype(np.float32), q8_0),
            DOWN: quantize(rng.standard_normal((E, K, N)).astype(np.float32), q8_0)}


def per_expert(rows: np.ndarray, ids: np.ndarray):
    """Σ x² per expert over the rows routed to it, and the row counts: rows (R, K), ids (R, k)."""
    sums, counts = np.zeros((E, rows.shape[1])), np.zeros(E)
    for r, chosen in enumerate(ids):
        for e in chosen:
            sums[e] += rows[r].astype(np.float64) ** 2
            counts[e] += 1
    return sums, counts


@pytest.mark.parametrize("passes", ["imatrix", "unfused"])
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_pass_records_each_expert_over_its_rows(backend, passes):
    """qmatmul_experts (and the unfused matmul of taken experts) output f32[E, K] sums over the rows routed
    to each expert and f32[E] counts; the router, a plain weight, its [K] and [1]; results unchanged."""
    from ggraph.compiler import compile_graph
    rng = np.random.default_rng(0)
    w = tiny_moe_weights(rng)
    x = rng.standard_normal((37, K)).astype(np.float32)
    pipeline = "imatrix" if passes == "imatrix" else ["inline_composites", "instrument_imatrix"]
    (y, ids, h), recorded = compile_graph(tiny_moe_graph(), backend=backend, passes=pipeline, weights=w)(x)
    plain = compile_graph(tiny_moe_graph(), backend=backend, passes="default" if passes == "imatrix" else "none",
                          weights=w)(x)
    assert all(np.array_equal(a, b) for a, b in zip((y, ids, h), plain))
    assert sorted(recorded) == sorted([ROUTER, UP, DOWN])
    for name, rows, chosen in ((UP, x, ids), (DOWN, (h * h).reshape(-1, N), ids.reshape(-1, 1))):
        sums, counts = recorded[name]
        want_sums, want_counts = per_expert(rows, chosen)
        assert sums.shape == (E, rows.shape[1]) and counts.tolist() == want_counts.tolist(), name
        np.testing.assert_allclose(sums, want_sums, rtol=1e-5)
    sq, n = recorded[ROUTER]
    np.testing.assert_allclose(sq, (x.astype(np.float64) ** 2).sum(0), rtol=1e-5)
    assert n.tolist() == [37.0]


def test_pass_text_for_experts():
    """After fusion, each qmatmul_experts' extra eqns: its rows' squares slot by slot, and ones, summed by
    expert id (two segment_sums each); before inlining, the expert_linear composite is found the same."""
    from ggraph.passes import run
    for pipeline in (["inline_unfusable", "fuse_dequant_matmul", "instrument_imatrix"], ["instrument_imatrix"]):
        text = str(run(tiny_moe_graph(), pipeline))
        assert text.count("segment_sum[num_segments=4]") == 4, text
        assert "i32[2,T] = transpose[perm=(1,0)]" in text, text


def test_small_steps_still_count_for_experts():
    """llama.cpp records every ggml_mul_mat_id, and only matmuls of at least 16 rows: a step of 3 tokens adds
    to the experts and not to the dense weights."""
    sums = imatrix.Sums()
    step = {"blk.0.attn_q.weight": (np.ones(4, np.float32), np.array([3.0], np.float32)),
            UP: (np.ones((E, 4), np.float32), np.array([3, 0, 2, 1], np.float32))}
    sums.add(step, small=True)
    sums.add(step, small=False)
    imx = sums.imatrix(["t.txt"], 4)
    assert imx.counts["blk.0.attn_q.weight"].tolist() == [3.0]
    assert imx.counts[UP].tolist() == [6.0, 0.0, 4.0, 2.0] and imx.sums[UP].shape == (E, 4)
    assert imx.chunk_count == 1
    v = imx.vectors()[UP].reshape(E, 4)
    assert v[1].tolist() == [1.0] * 4 and v[0].tolist() == [np.float32(2) / np.float32(6)] * 4   # no rows: ones


# -- imatrix, perplexity: against llama.cpp on the tiny Qwen3-MoE ----------------------------------

IMX_CTX, IMX_CHUNKS = 64, 4


@pytest.fixture(scope="module")
def llama_imatrices(qwen3moe, tmp_path_factory):
    """llama-imatrix's GGUF and .dat files over the tiny Qwen3-MoE: 4 chunks of 64, output.weight too."""
    from test_imatrix import llama_imatrix
    folder = tmp_path_factory.mktemp("moe-llama-imatrix")
    for fmt in ("gguf", "dat"):
        llama_imatrix(qwen3moe, folder / f"l.{fmt}", IMX_CTX, IMX_CHUNKS, "--process-output", "--output-format", fmt)
    return folder / "l.gguf", folder / "l.dat"


@pytest.fixture(scope="module")
def ggraph_imatrix(qwen3moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-ggraph-imatrix") / "g.gguf"
    assert main(["imatrix", str(qwen3moe), "-f", str(CALIBRATION_PATH), "-c", str(IMX_CTX), "--chunks",
                 str(IMX_CHUNKS), "-t", "2", "--process-output", "-o", str(out)]) == 0
    return out


@pytest.mark.slow
def test_qwen3moe_imatrix_matches_llama_imatrix(ggraph_imatrix, llama_imatrices):
    """On the f32 file: the same entries, every expert's count (the same tokens routed to it) and values
    to float accumulation, as the dense f32 zoo model in test_imatrix."""
    mine, theirs = imatrix.read(ggraph_imatrix), imatrix.read(llama_imatrices[0])
    assert (mine.chunk_count, mine.chunk_size, mine.datasets) == (theirs.chunk_count, theirs.chunk_size,
                                                                  theirs.datasets)
    assert sorted(mine.sums) == sorted(theirs.sums)
    assert mine.sums["blk.0.ffn_down_exps.weight"].shape == (8, 128)
    assert mine.sums["blk.1.ffn_gate_exps.weight"].shape == (8, 256)
    assert {n: c.tolist() for n, c in mine.counts.items()} == {n: c.tolist() for n, c in theirs.counts.items()}
    diffs = relative_differences(mine.vectors(), theirs.vectors())
    assert max(diffs.values()) < 1e-5, {n: f"{d:.1e}" for n, d in diffs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in MOE_FAMILIES if f != "qwen3moe"])
def test_moe_family_imatrix_matches_llama_imatrix(family, tmp_path):
    """Every MoE family's f32 file: the same entries (shared experts and their gates too) and counts; values
    to float accumulation (measured worst: qwen2moe 1.6e-5, mixtral 9.5e-6, olmoe 4.2e-6, gpt-oss 3.8e-6,
    each a blk.1.ffn_down_exps: llama.cpp sums every chunk's squares in f32)."""
    from test_imatrix import both_imatrices
    mine, theirs = both_imatrices(hf_models.converted(family, "f32"), tmp_path, IMX_CTX, IMX_CHUNKS)
    assert {n: c.tolist() for n, c in mine.counts.items()} == {n: c.tolist() for n, c in theirs.counts.items()}
    diffs = relative_differences(mine.vectors(), theirs.vectors())
    assert max(diffs.values()) < 5e-5, {n: f"{d:.1e}" for n, d in diffs.items()}


# quantised files: (tokens routed elsewhere than llama.cpp routes them, worst and median relative difference).
# Both tools round the activations to 8 bits, in other orders; measured: Q4_K_M routes every token alike,
# worst 2.5e-3 (blk.1.ffn_down_exps), median 1.5e-4; q8_0 sends one token of blk.1 to expert 1 where
# llama.cpp picks expert 4 (a near tie of their router probabilities), which moves those experts' vectors:
# worst 1.5e-2, median 1.5e-4. The dense demo model's bounds (test_imatrix) are 1e-2 and 2e-3.
QUANTISED_IMATRIX = {"q4_k_m": (0, 1e-2, 2e-3), "q8_0": (1, 2e-2, 2e-3)}


@pytest.mark.slow
@pytest.mark.parametrize("mix", QUANTISED_IMATRIX)
def test_quantised_qwen3moe_imatrix_close_to_llama_imatrix(mix, tmp_path):
    from test_imatrix import both_imatrices
    mine, theirs = both_imatrices(hf_models.converted("qwen3moe", mix), tmp_path, IMX_CTX, IMX_CHUNKS)
    moved, worst, median = QUANTISED_IMATRIX[mix]
    for name, c in mine.counts.items():
        assert c.sum() == theirs.counts[name].sum() and np.abs(c - theirs.counts[name]).sum() <= 2 * moved, name
    diffs = relative_differences(mine.vectors(), theirs.vectors())
    assert max(diffs.values()) < worst and float(np.median(list(diffs.values()))) < median, \
        {n: f"{d:.1e}" for n, d in diffs.items()}


@pytest.mark.slow
def test_llama_imatrix_dat_and_gguf_give_the_same_expert_vectors(llama_imatrices):
    from_gguf, from_dat = imatrix.load(llama_imatrices[0]), imatrix.load(llama_imatrices[1])
    assert sorted(from_gguf) == sorted(from_dat)
    for name, v in from_gguf.items():
        np.testing.assert_allclose(from_dat[name], v, rtol=1e-6, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["Q4_K_M", "IQ4_XS"])
def test_quantize_with_ggraphs_moe_imatrix_equals_llama_quantize(qwen3moe, ggraph_imatrix, ftype, tmp_path,
                                                                  monkeypatch):
    """llama-quantize takes ggraph's imatrix (every entry), and both quantisers make the same file from it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "imatrix.gguf").write_bytes(ggraph_imatrix.read_bytes())
    run = quantizes_as_llama_quantize(qwen3moe, ftype, "--imatrix", "imatrix.gguf")
    n = len(imatrix.read(ggraph_imatrix).sums)
    assert f"loaded {n} importance matrix entries" in run.stdout
    assert "did not find weights for blk." not in run.stdout + run.stderr      # (token_embd is no matmul)


# measured (-c 128, 4 chunks, f16 caches): qwen3moe f32 1.4e-6 apart, q8_0 7.7e-4, Q4_K_M 2.0e-3; the other
# families' f32 files qwen2moe 5.0e-6, gpt-oss 5.0e-6, mixtral 2.5e-6, olmoe 3.6e-7. The quantised files'
# activations are rounded to 8 bits in both tools, in other orders, which moves the random model's
# near-uniform predictions (PPL ~1.6e5) a little; the bound there is the dense demo test's 0.5%
PPL_BOUND = {"f32": 1e-5, "q8_0": 5e-3, "q4_k_m": 5e-3}
PPL_CASES = [("qwen3moe", mix) for mix in PPL_BOUND] + [(f, "f32") for f in MOE_FAMILIES if f != "qwen3moe"]


@pytest.mark.slow
@pytest.mark.parametrize("family, mix", PPL_CASES)
def test_moe_perplexity_matches_llama_perplexity(family, mix):
    from ggraph.perplexity import perplexity
    from llama_tools import llama_perplexity
    path = hf_models.converted(family, mix)
    theirs = llama_perplexity(path, CALIBRATION_PATH, n_ctx=128, chunks=4)
    mine = perplexity(path, CALIBRATION, n_ctx=128, n_chunks=4, threads=2, out=io.StringIO())
    assert abs(mine.ppl / theirs - 1) < PPL_BOUND[mix], f"ggraph {mine.ppl:.4f} vs llama.cpp {theirs:.4f}"


# -- bench, dump, diff, split -------------------------------------------------------------------

@pytest.mark.slow
def test_bench_rows_for_a_moe_file_at_depth_and_beside_llama_cpp(capsys):
    import json
    pytest.importorskip("llama_cpp")
    path = hf_models.converted("qwen3moe", "q4_k_m")
    assert main(["bench", str(path), "-p", "16", "-n", "4", "-d", "0,32", "--repeats", "1", "--vs-llama-cpp",
                 "--json", "-t", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    engines = {(r["engine"], r["depth"]) for r in rows}
    assert {("ggraph", 0), ("ggraph", 32), ("llama.cpp", 0), ("llama.cpp", 32)} <= engines, rows
    assert all(r["pp_tok_s"] > 0 and r["tg_tok_s"] > 0 for r in rows), rows


@pytest.mark.slow
def test_dump_explain_and_diff_on_a_moe_file(capsys):
    path = str(hf_models.converted("qwen3moe", "q8_0"))
    assert main(["dump", path, "--layer", "1", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "qmatmul_experts" in out and "blk.1.ffn_down_exps.weight" in out
    assert main(["diff", path, "--tokens", "1,2,3,4,5,6"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\s+(blk\.\d|logits)\s+(\S+)", out, re.M))
    assert sorted(rows) == ["blk.0", "blk.1", "logits"] and all(float(v) < 1e-3 for v in rows.values()), out


@pytest.mark.slow
def test_split_and_merge_round_trip_expert_tensors(tmp_path):
    """A Q4_K_M file split by size and by count, merged back: every tensor (the stacked experts too) byte for
    byte, and the split files are llama-gguf-split's."""
    from llama_tools import run_tool
    path = hf_models.converted("qwen3moe", "q4_k_m")
    with GGUFFile(path) as f:
        want = {n: bytes(t.data) for n, t in f.tensors.items()}
    assert any(n.endswith("_exps.weight") for n in want)
    for how, ours, theirs in ((["--max-tensors", "10"], "ours-n", ["--split-max-tensors", "10"]),
                              (["--max-size", "11M"], "ours-s", ["--split-max-size", "11M"])):
        assert main(["split", str(path), str(tmp_path / ours), *how]) == 0
        run_tool("llama-gguf-split", "--split", *theirs, path, tmp_path / f"llama-{ours}")
        mine = sorted(tmp_path.glob(f"{ours}-*.gguf"))
        llamas = sorted(tmp_path.glob(f"llama-{ours}-*.gguf"))
        assert len(mine) == len(llamas) > 1
        for a, b in zip(mine, llamas):
            assert a.read_bytes() == b.read_bytes(), f"{a.name} differs from llama-gguf-split's {b.name}"
        assert main(["merge", str(mine[0]), str(tmp_path / f"{ours}.gguf")]) == 0
        with GGUFFile(tmp_path / f"{ours}.gguf") as f:
            assert {n: bytes(t.data) for n, t in f.tensors.items()} == want
