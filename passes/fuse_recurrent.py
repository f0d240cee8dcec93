"""fuse_recurrent: the recurrent-layer composites become their one-kernel forms.

    y s2 = causal_conv x s w [b]              ->  y s2 = fused_causal_conv x s w [b]
    y s2 = ssm_scan s x dt A B C              ->  y s2 = fused_ssm_scan s x dt A B C

Same operands and outputs, so every one is taken. Where the only other reader of the state is a
``state_write s s2`` of the new state (a model's step writing its state back), the fused op gets
``overwrite=True``: its kernel writes s2 over s, and the write-back has nothing to copy. With the pass
off, inline_unfusable inlines them: the conv as concat, slices and fmas, the scan as its scan body.
"""
from __future__ import annotations

from ggraph.ir.graph import Eqn, Graph, Var
from ggraph.ir.prims import state_write_p
from ggraph.ir.recurrent import FUSED
from ggraph.passes.manager import graph_pass, note
from ggraph.passes.rewrite import rewrite


@graph_pass("fuse_recurrent", explain=True)
def fuse_recurrent(graph: Graph) -> Graph:
    """causal_conv and ssm_scan -> fused_causal_conv and fused_ssm_scan: one kernel each, state carried in registers."""
    users = graph.users()
    outputs = {o for o in graph.outvars if isinstance(o, Var)}

    def visit(rw, e):
        if e.prim not in FUSED:
            rw.emit(e)
            return
        fused, state_at = FUSED[e.prim]
        overwrite = _written_back(e, e.inputs[state_at], users, outputs)
        rw.emit(e.replace(prim=fused, body=None, params=dict(e.params, overwrite=True) if overwrite else e.params))
        note(f"{e.prim.name} -> {fused.name}{' (new state written over the state)' if overwrite else ''}", e.scope)
    return rewrite(graph, visit)


def _written_back(e: Eqn, state, users: dict, outputs: set) -> bool:
    """True if ``state``'s readers are ``e`` and one ``state_write state new_state`` of e's new state."""
    if not isinstance(state, Var) or state in outputs:
        return False
    readers = users.get(state, [])
    others = [u for u in readers if u.outputs != e.outputs]
    return len(readers) == 2 and len(others) == 1 and others[0].prim is state_write_p and \
        others[0].inputs[0] is state and others[0].inputs[1] is e.outputs[1]
