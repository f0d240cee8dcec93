"""inline_composites: replace every composite by its decomposition (the unfused baseline)."""
from __future__ import annotations

from ggraph.core import Graph
from ggraph.passes.manager import graph_pass, note
from ggraph.passes.rewrite import clone_eqns, rewrite


def _inline(rw, e):
    if not e.prim.composite:
        rw.emit(e)
        return
    subst = dict(zip(e.body.invars, e.inputs))
    inner = e.body.replace(eqns=clone_eqns(e.body.eqns, subst),
                           outvars=[subst.get(o, o) for o in e.body.outvars])
    inner = _inline_all(inner)                              # nested composites too
    for b in inner.eqns:
        rw.emit(b)
    for old, new in zip(e.outputs, inner.outvars):
        rw.alias(old, new)
    note(f"inlined {e.prim.name} ({len(inner.eqns)} eqns)", e.scope)


def _inline_all(graph: Graph) -> Graph:
    return rewrite(graph, _inline)


@graph_pass("inline_composites")
def inline_composites(graph: Graph) -> Graph:
    """Inline each composite's body in place of its eqn, recursively: plain primitives only."""
    return _inline_all(graph)

