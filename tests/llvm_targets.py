"""The kernel tests' shared fixture logic: skip feature sets the host cannot run, build once."""
import pytest

from ggraph.backends.llvm.target import runnable_targets


def runnable_target(name: str, libs: dict, build) -> str:
    """``name`` if this host can run it, with ``build(name)`` cached in ``libs``; else skip the test."""
    if name not in [t.name for t in runnable_targets()]:
        pytest.skip(f"host cannot run {name}")
    if name not in libs:
        libs[name] = build(name)
    return name
