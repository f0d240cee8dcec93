"""cse: compute each distinct expression once."""
from __future__ import annotations

from ggraph.ir.graph import Graph, Literal
from ggraph.passes.manager import graph_pass, note
from ggraph.passes.rewrite import rewrite

def _key(e):
    ins = tuple(("lit",) + a.key() if isinstance(a, Literal) else ("var", a.id) for a in e.inputs)
    body = str(e.body) if e.body is not None and not e.prim.composite else None
    params = sorted((k, v.signature() if isinstance(v, Graph) else v) for k, v in e.params.items())  # a scan's body
    return (e.prim.name, ins, repr(params), body)


@graph_pass("cse")
def cse(graph: Graph) -> Graph:
    """Common-subexpression elimination: an eqn equal to an earlier one reuses its outputs."""
    seen = {}

    def visit(rw, e):
        if e.prim.effects:                  # writes a donated buffer: two of them are two writes
            rw.emit(e)
            return
        k = _key(e)
        if k in seen:
            for old, new in zip(e.outputs, seen[k].outputs):
                rw.alias(old, new)
            note(f"reused an earlier {e.prim.name}", e.scope)
        else:
            seen[k] = e
            rw.emit(e)
    return rewrite(graph, visit)
