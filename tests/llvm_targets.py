"""The kernel tests' shared fixture logic: skip feature sets the host cannot run, build once; a graph compiled
for a named feature set, and the fused-kernel loop of the recurrent ops' tests."""
import pytest

import ggraph
from ggraph.backends.llvm.target import named_target, runnable_targets


def runnable_target(name: str, libs: dict, build) -> str:
    """``name`` if this host can run it, with ``build(name)`` cached in ``libs``; else skip the test."""
    if name not in [t.name for t in runnable_targets()]:
        pytest.skip(f"host cannot run {name}")
    if name not in libs:
        libs[name] = build(name)
    return name


def compiled_for(graph, target: str, threads: int, **passes):
    """``graph`` compiled by the llvm backend for the feature set ``target`` with ``threads`` threads (``passes``
    as ggraph.compile takes them); skip the test where this host cannot run ``target``."""
    if target not in [t.name for t in runnable_targets()]:
        pytest.skip(f"host cannot run {target}")
    return ggraph.compile(graph, backend="llvm", target=named_target(target), threads=threads, **passes)


def fused_kernels(cases, graph_of, fused: str, target: str, threads: int):
    """Per case of ``cases``: (the case, ``graph_of(*case)`` compiled for ``target`` with ``threads`` threads,
    checked to run one ``fused`` op, and the same graph's numpy-rule program), for a kernel test that holds the
    fused kernel to the rule on every feature set."""
    for case in cases:
        g = graph_of(*case)
        prog = compiled_for(g, target, threads)
        assert prog.graph.count(fused) == 1, f"{fused} on {target}: {prog.graph.count(fused)} ops for {case}"
        yield case, prog, ggraph.compile(g, passes=[])
