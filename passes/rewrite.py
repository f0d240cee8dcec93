"""Shared machinery for passes: rebuild a graph eqn by eqn while substituting vars."""
from __future__ import annotations

from typing import Callable, Iterable

from ggraph.ir.graph import Atom, Eqn, Graph, Var


class Rewriter:
    """Walks a graph's eqns; each may be kept, replaced by other eqns, or replaced by an atom.

    ``subst`` maps old vars to the atoms that now stand for them; it is applied to every
    later eqn's inputs and to the graph outputs.
    """

    def __init__(self, graph: Graph):
        self.graph = graph
        self.subst: dict[Var, Atom] = {}
        self.eqns: list[Eqn] = []

    def atom(self, a: Atom) -> Atom:
        while isinstance(a, Var) and a in self.subst:
            a = self.subst[a]
        return a

    def renamed(self, e: Eqn) -> Eqn:
        ins = tuple(self.atom(a) for a in e.inputs)
        return e if ins == e.inputs else e.replace(inputs=ins)

    def emit(self, e: Eqn) -> None:
        self.eqns.append(e)

    def alias(self, old: Var, new: Atom) -> None:
        self.subst[old] = new

    def finish(self) -> Graph:
        return self.graph.replace(eqns=self.eqns, outvars=[self.atom(o) for o in self.graph.outvars])


def clone_eqns(eqns: Iterable[Eqn], subst: dict[Var, Atom]) -> list[Eqn]:
    """Copy eqns with fresh output vars; ``subst`` maps body inputs in and collects outputs."""
    out = []
    for e in eqns:
        ins = tuple(subst.get(a, a) if isinstance(a, Var) else a for a in e.inputs)
        outs = tuple(Var(o.aval, o.hint) for o in e.outputs)
        subst.update(zip(e.outputs, outs))
        out.append(e.replace(inputs=ins, outputs=outs))
    return out


def rewrite(graph: Graph, fn: Callable[[Rewriter, Eqn], None]) -> Graph:
    """Apply ``fn(rw, eqn)`` to each eqn (already renamed); fn emits or aliases."""
    rw = Rewriter(graph)
    for e in graph.eqns:
        fn(rw, rw.renamed(e))
    return rw.finish()
