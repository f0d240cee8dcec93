"""fold: evaluate constant eqns and remove algebraic identities.

Each rule is one line: ``(op, rule)`` where the rule returns the atom that replaces the
eqn's single output, or None when it does not apply. The rule's algebra is its comment.
"""
from __future__ import annotations

import numpy as np

from ggraph.core import Aval, Eqn, Graph, Literal, Sym, Var, impl_rules
from ggraph.passes.manager import graph_pass, note, skip
from ggraph.passes.rewrite import Rewriter, rewrite

FOLD_LIMIT = 1 << 20        # largest constant (elements) worth materialising
NO_FOLD = {"cache_update", "dequant", "take"}


def _is(a, value) -> bool:
    """True if atom ``a`` is a constant whose every element equals ``value``."""
    return isinstance(a, Literal) and a.value.size > 0 and bool(np.all(a.value == value))


def _same(e: Eqn, a):
    """``a`` replaces e's output only if it has the very same aval (no broadcasting hidden)."""
    return a if Aval.__eq__(a.aval, e.outputs[0].aval) else None


def _ident_perm(perm) -> bool:
    return tuple(perm) == tuple(range(len(perm)))


IDENTITIES = [
    ("mul",       lambda e, x, y: _same(e, x) if _is(y, 1) else None),                 # x*1 -> x
    ("mul",       lambda e, x, y: _same(e, y) if _is(x, 1) else None),                 # 1*x -> x
    ("add",       lambda e, x, y: _same(e, x) if _is(y, 0) else None),                 # x+0 -> x
    ("add",       lambda e, x, y: _same(e, y) if _is(x, 0) else None),                 # 0+x -> x
    ("sub",       lambda e, x, y: _same(e, x) if _is(y, 0) else None),                 # x-0 -> x
    ("div",       lambda e, x, y: _same(e, x) if _is(y, 1) else None),                 # x/1 -> x
    ("reshape",   lambda e, x: _same(e, x)),                                           # reshape(x, x.shape) -> x
    ("transpose", lambda e, x: _same(e, x) if _ident_perm(e.params["perm"]) else None),  # transpose(x, id) -> x
    ("broadcast", lambda e, x: _same(e, x)),                                           # broadcast(x, x.shape) -> x
    ("cast",      lambda e, x: _same(e, x)),                                           # cast(x, x.dtype) -> x
    ("slice",     lambda e, x: _same(e, x)),                                           # x[0:n] on an n-long axis -> x
]


def _compose(rw: Rewriter, producers: dict, e: Eqn) -> Eqn | None:
    """Merge an op into the same op that produced its input; None if it does not apply."""
    x = e.inputs[0]
    inner = producers.get(x)
    if inner is None or inner.prim is not e.prim:
        return None
    if e.prim.name == "reshape":                     # reshape(reshape(x, s1), s2) -> reshape(x, s2)
        return e.replace(inputs=inner.inputs)
    if e.prim.name == "transpose":                   # transpose(transpose(x, p1), p2) -> transpose(x, p1∘p2)
        p1, p2 = inner.params["perm"], e.params["perm"]
        return e.replace(inputs=inner.inputs, params={"perm": tuple(p1[i] for i in p2)})
    return None


def _concrete(aval: Aval) -> bool:
    return all(isinstance(d, int) for d in aval.shape)


def _fold_constant(e: Eqn):
    """An eqn whose operands are all constants becomes a constant (if small and concrete)."""
    if e.prim.name in NO_FOLD or e.prim not in impl_rules or len(e.outputs) != 1:
        return None
    if not all(isinstance(a, Literal) for a in e.inputs):
        return None
    if any(isinstance(v, Sym) for v in e.params.values()):
        return None
    out = e.outputs[0].aval
    if not _concrete(out) or out.dtype.np_dtype is None:
        return None
    if int(np.prod(out.shape)) > FOLD_LIMIT:
        skip(f"{e.prim.name} of constants left unfolded: {out} exceeds {FOLD_LIMIT} elements", e.scope)
        return None
    value = impl_rules[e.prim](*[a.value for a in e.inputs], **e.params)
    return Literal(np.asarray(value).reshape(out.shape), out.dtype)


@graph_pass("fold")
def fold(graph: Graph) -> Graph:
    """Fold constants and remove identities: x*1, x+0, reshape∘reshape, transpose∘transpose."""
    producers: dict[Var, Eqn] = {}

    def visit(rw: Rewriter, e: Eqn):
        merged = _compose(rw, producers, e) if e.prim.name in ("reshape", "transpose") else None
        if merged is not None:
            note(f"merged {e.prim.name}∘{e.prim.name}", e.scope)
            e = merged
        const = _fold_constant(e)
        if const is not None:
            note(f"folded constant {e.prim.name} -> {const.aval}", e.scope)
            rw.alias(e.outputs[0], const)
            return
        for op, rule in IDENTITIES:
            if op == e.prim.name:
                out = rule(e, *e.inputs)
                if out is not None:
                    note(f"removed identity {e.prim.name}", e.scope)
                    rw.alias(e.outputs[0], out)
                    return
        producers.update((o, e) for o in e.outputs)
        rw.emit(e)

    return rewrite(graph, visit)
