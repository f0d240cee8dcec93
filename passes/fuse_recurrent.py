"""fuse_recurrent: the recurrent-layer composites become their one-kernel forms.

    y s2 = causal_conv x s w [b]              ->  y s2 = fused_causal_conv x s w [b]
    y s2 = ssm_scan s x dt A B C              ->  y s2 = fused_ssm_scan s x dt A B C

Same operands and outputs, so every one is taken. With the pass off, inline_unfusable inlines them:
the conv as concat, slices and fmas, the scan as its scan body.
"""
from __future__ import annotations

from ggraph.ir.graph import Graph
from ggraph.ir.recurrent import FUSED
from ggraph.passes.manager import graph_pass, note
from ggraph.passes.rewrite import rewrite


@graph_pass("fuse_recurrent", explain=True)
def fuse_recurrent(graph: Graph) -> Graph:
    """causal_conv and ssm_scan -> fused_causal_conv and fused_ssm_scan: one kernel each, state carried in registers."""
    def visit(rw, e):
        fused = FUSED.get(e.prim)
        if fused is None:
            rw.emit(e)
            return
        rw.emit(e.replace(prim=fused, body=None))
        note(f"{e.prim.name} -> {fused.name}", e.scope)
    return rewrite(graph, visit)
