"""The seeds' pipeline end to end, on a tiny transformers model of each family:
``convert`` -> ``imatrix`` -> ``quantize`` -> ``split`` -> ``run``, with llama.cpp loading every file made
on the way and agreeing with ggraph (and, for the f16 file, with transformers)."""
from __future__ import annotations

import numpy as np
import pytest

from ggraph.cli import main
from ggraph.runtime.session import Session
from oracle import decided, llama_logits
from test_convert import IDS, build_hf_model, hf_logits

pytestmark = pytest.mark.slow

WIDE = dict(hidden_size=256, intermediate_size=512)      # rows of whole 256-blocks: the k-quants proper


def _cos(a, b) -> float:
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma2", "gemma3"])
def test_convert_imatrix_quantize_split_run(family, tmp_path, capsys):
    heads = dict(num_attention_heads=16, num_key_value_heads=4) if family == "phi3" else {}   # head 16: 6 rope factors
    folder, model, _ = build_hf_model(tmp_path, family, **WIDE, **heads)
    f16, imx, q4 = tmp_path / "f16.gguf", tmp_path / "imatrix.gguf", tmp_path / "q4_k_m.gguf"
    text = tmp_path / "calibration.txt"
    text.write_text("The graph compiler reads the weights straight from the file. " * 40)
    assert main(["convert", str(folder), str(f16), "--outtype", "f16"]) == 0
    assert main(["imatrix", str(f16), "-f", str(text), "-o", str(imx), "-c", "64", "--chunks", "2", "-t", "2"]) == 0
    assert main(["quantize", str(f16), str(q4), "Q4_K_M", "--imatrix", str(imx)]) == 0
    assert main(["split", str(q4), str(tmp_path / "parts"), "--max-tensors", "8"]) == 0
    parts = sorted(tmp_path.glob("parts-*-of-*.gguf"))
    assert len(parts) > 1

    want = hf_logits(model, IDS)
    ref16 = llama_logits(f16, IDS)
    assert _cos(ref16, want) > 0.9999                         # llama.cpp runs the converted file
    ref4 = llama_logits(q4, IDS)                              # and the quantised one (4 bits of random weights
    assert np.isfinite(ref4).all()                            # are far from the original: ggraph must agree)
    assert np.array_equal(llama_logits(parts[0], IDS), ref4)  # and the split one, exactly as the whole
    ours = Session(str(parts[0]), threads=2, ctx=64).logits(IDS)
    sure = decided(ref4)                                      # random 4-bit weights: near ties are chaos
    assert sure.sum() >= len(IDS) // 2, f"llama.cpp decides too few positions to compare: {sure}"
    assert _cos(ours, ref4) > 0.995 and (ours.argmax(1) == ref4.argmax(1))[sure].mean() >= 0.9

    capsys.readouterr()
    assert main(["run", str(parts[0]), "-p", "The graph", "-n", "6", "--temp", "0", "--ctx", "64"]) == 0
    assert capsys.readouterr().out.startswith("The graph")
