"""dce: drop eqns whose outputs nobody reads."""
from __future__ import annotations

from ggraph.ir.graph import Graph, Var
from ggraph.passes.manager import graph_pass, note


@graph_pass("dce")
def dce(graph: Graph) -> Graph:
    """Dead-code elimination: remove eqns none of whose outputs reach a graph output."""
    live = {o for o in graph.outvars if isinstance(o, Var)}
    kept = []
    for e in reversed(graph.eqns):
        if any(o in live for o in e.outputs):
            kept.append(e)
            live.update(a for a in e.inputs if isinstance(a, Var))
        else:
            note(f"removed dead {e.prim.name}", e.scope)
    return graph.replace(eqns=reversed(kept))
