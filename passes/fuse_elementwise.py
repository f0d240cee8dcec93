"""fuse_elementwise: maximal chains of elementwise ops and last-axis reductions -> single fused loops.

A region is a set of eqns that loop over the same rows: the same leading dims, and a row
width W (values of width 1, such as reductions, broadcast along it). Members are elementwise
primitives, last-axis reductions, and the composites whose bodies hold only those (the op
table says which: ``fusable``); their bodies are inlined into the loop.
Regions grow from producer to consumer in program order and must stay convex: no path may
leave a region and come back into it. A value used outside its region is an output of the
fused eqn. A lone primitive is left as it is.

    b = rms_norm[eps] x w ; c = add r b ; d = rms_norm[eps] c v
  ->
    c d = fused{rms_norm,add,rms_norm} x w r v
"""
from __future__ import annotations

import heapq

from ggraph.ir.fused import fused_p
from ggraph.ir.prims import transpose_p
from ggraph.ir.graph import Atom, Eqn, Graph, Var, op_label
from ggraph.ir.primitive import fusable
from ggraph.passes.manager import graph_pass, note, skip
from ggraph.passes.rewrite import clone_eqns

Domain = tuple[tuple, object]       # (leading dims, row width)


# ---------------------------------------------------------------------------------------
# row domains
# ---------------------------------------------------------------------------------------

def domain(e: Eqn) -> Domain | None:
    """The (leading dims, row width) ``e`` loops over, or None when it cannot be part of a fused loop."""
    if not fusable(e):
        return None
    if e.body is not None:
        return _body_domain(e.body)
    if e.prim.kind == "reduce":
        shape = e.inputs[0].aval.shape                      # it reads whole rows of its input
    else:
        shape = e.outputs[0].aval.shape
    return (shape[:-1], shape[-1]) if shape else None


def _body_domain(body: Graph) -> Domain | None:
    dom = None
    for e in body.eqns:
        d = domain(e)
        dom = d if dom is None or d is None else join(dom, d)
        if dom is None:
            return None
    return dom


def join(a: Domain, b: Domain) -> Domain | None:
    """One loop serves both when the leading dims agree and the widths agree (width 1 joins any)."""
    if a[0] != b[0]:
        return None
    if a[1] == b[1] or b[1] == 1:
        return a
    return b if a[1] == 1 else None


def _fmt(d: Domain) -> str:
    return "[" + ",".join(map(str, d[0] + (d[1],))) + "]"


def _what(e: Eqn) -> str:
    return op_label(e) if e.prim is fused_p else e.prim.name


def _ops(e: Eqn) -> tuple[str, ...]:
    return tuple(e.params["ops"]) if e.prim is fused_p else (e.prim.name,)


# ---------------------------------------------------------------------------------------
# growing regions
# ---------------------------------------------------------------------------------------

class Region:
    """Eqn indices (ascending) that become one fused loop, and the row domain they share."""

    __slots__ = ("members", "domain")

    def __init__(self, members: list[int], dom: Domain):
        self.members, self.domain = members, dom

    def ops(self, eqns) -> str:
        return "{" + ",".join(op for i in self.members for op in _ops(eqns[i])) + "}"


def _escape(members: set[int], consumers: list[list[int]]) -> tuple[int, int] | None:
    """A path leaving the region and coming back, as (member, first eqn outside), or None if convex."""
    last = max(members)
    dead_ends: set[int] = set()
    for m in sorted(members):
        for hop in consumers[m]:
            if hop in members or hop > last or hop in dead_ends:
                continue
            stack = [hop]
            while stack:
                n = stack.pop()
                if n in dead_ends:
                    continue
                dead_ends.add(n)
                for c in consumers[n]:
                    if c in members:
                        return m, hop
                    if c < last:
                        stack.append(c)
    return None


def _log_shape_break(e: Eqn, s: Eqn, producer: dict, eqns) -> None:
    """Say so when a shape op sits between ``e`` and a fusable eqn it could otherwise join."""
    for a in s.inputs:
        j = producer.get(a)
        if j is not None and domain(eqns[j]) is not None:
            if e.prim.kind == "reduce" and s.prim is transpose_p:
                skip(f"{_what(e)} not fused with {_what(eqns[j])}: reduction not over the last axis of its rows "
                     f"(transpose in between)", e.scope)
            else:
                skip(f"{_what(e)} not fused with {_what(eqns[j])}: shape ops break the row domain "
                     f"({s.prim.name} in between)", e.scope)
            return


def grow_regions(graph: Graph) -> list[Region]:
    """Regions in program order: each fusable eqn joins the regions of its fusable producers where it can."""
    eqns = graph.eqns
    producer = {o: i for i, e in enumerate(eqns) for o in e.outputs}
    consumers: list[list[int]] = [[] for _ in eqns]
    for i, e in enumerate(eqns):
        for j in sorted({producer[a] for a in e.inputs if isinstance(a, Var) and a in producer}):
            consumers[j].append(i)
    region_of: dict[int, Region] = {}
    for i, e in enumerate(eqns):
        dom = domain(e)
        if dom is None:
            continue
        mine = region_of[i] = Region([i], dom)
        for a in e.inputs:
            j = producer.get(a) if isinstance(a, Var) else None
            if j is None:
                continue
            if eqns[j].prim.kind == "shape":
                _log_shape_break(e, eqns[j], producer, eqns)
            other = region_of.get(j)
            if other is None or other is mine:
                continue
            joined = join(other.domain, mine.domain)
            if joined is None:
                skip(f"{_what(e)} not fused with {other.ops(eqns)}: row domains differ "
                     f"({_fmt(mine.domain)} vs {_fmt(other.domain)})", e.scope)
                continue
            esc = _escape(set(other.members) | set(mine.members), consumers)
            if esc is not None:
                m, hop = esc
                skip(f"{_what(e)} not fused with {other.ops(eqns)}: {_what(eqns[m])} output has another user "
                     f"outside the region ({_what(eqns[hop])}) that leads back into it", e.scope)
                continue
            other.members = sorted(other.members + mine.members)
            other.domain = joined
            for k in mine.members:
                region_of[k] = other
            mine = other
    seen, regions = set(), []
    for i in sorted(region_of):
        r = region_of[i]
        if id(r) not in seen:
            seen.add(id(r))
            regions.append(r)
    return regions


# ---------------------------------------------------------------------------------------
# building fused eqns
# ---------------------------------------------------------------------------------------

def _inline_into(e: Eqn, subst: dict, out: list[Eqn]) -> None:
    """Append ``e`` to ``out`` with composite and fused bodies flattened; ``subst`` maps old vars to new."""
    if e.body is None:
        out.extend(clone_eqns([e], subst))
        return
    inner = {bv: (subst.get(a, a) if isinstance(a, Var) else a) for bv, a in zip(e.body.invars, e.inputs)}
    for b in e.body.eqns:
        _inline_into(b, inner, out)
    for o, bo in zip(e.outputs, e.body.outvars):
        subst[o] = inner.get(bo, bo) if isinstance(bo, Var) else bo


def fused_eqn(members: list[Eqn], used_outside: set[Var]) -> Eqn:
    """One fused eqn computing ``members``; its outputs are the members' values used outside."""
    defined = {o for e in members for o in e.outputs}
    inputs: list[Var] = []
    for e in members:
        for a in e.inputs:
            if isinstance(a, Var) and a not in defined and a not in inputs:
                inputs.append(a)
    subst: dict[Var, Atom] = {a: Var(a.aval, a.hint) for a in inputs}
    body_invars = [subst[a] for a in inputs]
    body: list[Eqn] = []
    for e in members:
        _inline_into(e, subst, body)
    outs = [o for e in members for o in e.outputs if o in used_outside]
    ops = tuple(op for e in members for op in _ops(e))
    return Eqn(fused_p, inputs, outs, {"ops": ops}, members[-1].scope,
               Graph(body_invars, (), body, [subst[o] for o in outs]))


def _schedule(nodes: list[tuple[int, Eqn]]) -> list[Eqn]:
    """Order eqns after their operands' producers, otherwise by key: a fused eqn sits at its last member."""
    producer = {o: n for n, (_, e) in enumerate(nodes) for o in e.outputs}
    waiting = [0] * len(nodes)
    dependents: list[list[int]] = [[] for _ in nodes]
    for n, (_, e) in enumerate(nodes):
        for p in {producer[a] for a in e.inputs if isinstance(a, Var) and a in producer}:
            waiting[n] += 1
            dependents[p].append(n)
    ready = [(key, n) for n, (key, _) in enumerate(nodes) if not waiting[n]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(nodes[n][1])
        for d in dependents[n]:
            waiting[d] -= 1
            if not waiting[d]:
                heapq.heappush(ready, (nodes[d][0], d))
    if len(order) != len(nodes):
        raise RuntimeError("fuse_elementwise: regions form a cycle (a region is not convex)")
    return order


@graph_pass("fuse_elementwise", explain=True)
def fuse_elementwise(graph: Graph) -> Graph:
    """Chains of elementwise ops, last-axis reductions and elementwise composites -> one fused loop each."""
    eqns = graph.eqns
    regions = grow_regions(graph)
    in_region = {i: r for r in regions for i in r.members}
    readers: dict[Var, list[int]] = {}
    for i, e in enumerate(eqns):
        for a in e.inputs:
            if isinstance(a, Var):
                readers.setdefault(a, []).append(i)
    graph_outs = {o for o in graph.outvars if isinstance(o, Var)}
    nodes: list[tuple[int, Eqn]] = []                   # (position key, eqn) before scheduling
    fused_away: set[int] = set()
    for r in regions:
        members = [eqns[k] for k in r.members]
        if len(members) == 1 and not members[0].prim.composite:
            if members[0].prim is not fused_p:
                skip(f"{_what(members[0])} left alone: nothing to fuse it with", members[0].scope)
            continue
        mine = {o for m in members for o in m.outputs}
        if not any(isinstance(a, Var) and a not in mine for m in members for a in m.inputs):
            skip(f"{r.ops(eqns)} left alone: all its operands are constants (fold's job)", members[-1].scope)
            continue
        used = {o for o in mine if o in graph_outs or any(in_region.get(c) is not r for c in readers.get(o, ()))}
        fe = fused_eqn(members, used)
        nodes.append((r.members[-1], fe))
        fused_away.update(r.members)
        plural = lambda n, word: f"{n} {word}{'s' if n > 1 else ''}"                  # noqa: E731
        note(f"{_what(fe)}: {plural(len(members), 'op')}, {len(fe.body.eqns)} primitives -> one loop over "
             f"{_fmt(r.domain)}, {plural(len(fe.outputs), 'output')}", fe.scope)
    nodes += [(i, e) for i, e in enumerate(eqns) if i not in fused_away]
    return graph.replace(eqns=_schedule(nodes))
