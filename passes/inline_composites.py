"""inline_composites and inline_unfusable: replace composites by their decompositions.

``inline_composites`` inlines every composite (the unfused baseline). ``inline_unfusable``
inlines only the composites no fusion can take whole: those whose bodies hold more than
elementwise ops and last-axis reductions (a matmul, a reshape, a gather), or whose parts
do not loop over one row domain. Their parts then
fuse like any other chain; elementwise and row-reduction composites (rms_norm, a user's
layer_norm or squared-relu) stay whole for fuse_elementwise, which makes one loop of each.
Nested composites are treated the same way, level by level.
"""
from __future__ import annotations

from ggraph.ir.graph import Eqn, Graph
from ggraph.ir.primitive import not_fusable
from ggraph.passes.fuse_elementwise import domain
from ggraph.passes.manager import graph_pass, note, skip
from ggraph.passes.rewrite import clone_eqns, rewrite


def inline(graph: Graph, keep=lambda e: False, why=lambda e: "") -> Graph:
    """Inline every composite eqn (recursively) except those ``keep(eqn)`` holds; log each decision."""
    def visit(rw, e: Eqn):
        if not e.prim.composite:
            rw.emit(e)
            return
        if keep(e):
            skip(f"{e.prim.name} kept whole: an elementwise and row-reduction chain, for fuse_elementwise", e.scope)
            rw.emit(e)
            return
        subst = dict(zip(e.body.invars, e.inputs))
        inner = e.body.replace(eqns=clone_eqns(e.body.eqns, subst), outvars=[subst.get(o, o) for o in e.body.outvars])
        inner = inline(inner, keep, why)
        for b in inner.eqns:
            rw.emit(b)
        for old, new in zip(e.outputs, inner.outvars):
            rw.alias(old, new)
        note(f"inlined {e.prim.name} ({len(inner.eqns)} eqns){why(e)}", e.scope)
    return rewrite(graph, visit)


@graph_pass("inline_composites", explain=True)
def inline_composites(graph: Graph) -> Graph:
    """Inline each composite's body in place of its eqn, recursively: plain primitives only (the unfused baseline)."""
    return inline(graph)


@graph_pass("inline_unfusable", explain=True)
def inline_unfusable(graph: Graph) -> Graph:
    """Inline the composites no kernel takes whole (bodies with more than elementwise ops and row reductions)."""
    return inline(graph, keep=lambda e: domain(e) is not None, why=_why)


def _why(e: Eqn) -> str:
    ops = not_fusable(e)
    if ops:
        return f": no kernel takes it whole (its body has {', '.join(ops)})"
    return ": its elementwise body has no single row domain for one fused loop"
