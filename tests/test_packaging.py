"""Every Python package of the source tree is in pyproject.toml's list, so a wheel (not only an editable
install, which finds subpackages on disk) carries it: the kernels' qmatmul/ and attention/ packages were
missing from it when they were split out."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIRS = {"ggraph.passes": "passes", "ggraph.backends": "backends", "ggraph.models": "models", "ggraph": "ggraph"}


def test_every_package_is_listed():
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(ggraph[\w.]*)"', text.split("packages = [", 1)[1].split("]", 1)[0]))
    found = set()
    for name, folder in DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name,) + parts))
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
