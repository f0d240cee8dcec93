"""fold: evaluate constant eqns and apply each op's algebraic identities.

The identities are the ``simplify`` rules of the op table (``x*1 -> x`` beside ``mul``,
``reshape∘reshape -> reshape`` beside ``reshape``); a rule returns the atom that replaces
the eqn's output, an eqn that replaces the eqn, or None when it does not apply.
"""
from __future__ import annotations

import numpy as np

from ggraph.ir.dims import Sym
from ggraph.ir.graph import Eqn, Graph, Literal, Var
from ggraph.passes.manager import graph_pass, note, skip
from ggraph.passes.rewrite import Rewriter, rewrite

FOLD_LIMIT = 1 << 20        # largest constant (elements) worth materialising


def _fold_constant(e: Eqn):
    """An eqn whose operands are all constants becomes a constant (if small and concrete)."""
    if not e.prim.fold or e.prim.impl is None or e.body is not None or len(e.outputs) != 1:
        return None
    if not all(isinstance(a, Literal) for a in e.inputs):
        return None
    if any(isinstance(v, Sym) for v in e.params.values()):
        return None
    out = e.outputs[0].aval
    if not all(isinstance(d, int) for d in out.shape) or out.dtype.np_dtype is None:
        return None
    if out.numel() > FOLD_LIMIT:
        skip(f"{e.prim.name} of constants left unfolded: {out} exceeds {FOLD_LIMIT} elements", e.scope)
        return None
    value = e.prim.impl(*[a.value for a in e.inputs], **e.params)
    return Literal(np.asarray(value).reshape(out.shape), out.dtype)


@graph_pass("fold")
def fold(graph: Graph) -> Graph:
    """Fold constants and apply the op table's identities: x*1, x+0, reshape∘reshape, transpose∘transpose."""
    producers: dict[Var, Eqn] = {}

    def visit(rw: Rewriter, e: Eqn):
        for rule in e.prim.simplify:
            out = rule(e, producers.get, *e.inputs)
            if isinstance(out, Eqn):
                note(f"merged {e.prim.name}∘{e.prim.name}", e.scope)
                e = out
            elif out is not None:
                note(f"removed identity {e.prim.name}", e.scope)
                rw.alias(e.outputs[0], out)
                return
        const = _fold_constant(e)
        if const is not None:
            note(f"folded constant {e.prim.name} -> {const.aval}", e.scope)
            rw.alias(e.outputs[0], const)
            return
        producers.update((o, e) for o in e.outputs)
        rw.emit(e)

    return rewrite(graph, visit)
