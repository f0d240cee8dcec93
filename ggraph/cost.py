"""Flops and bytes moved per op kind: the numbers rooflines and benchmarks are built on."""
from __future__ import annotations

from ggraph.core import Graph, cost_rules


def eqn_cost(eqn, dims: dict[str, int]) -> tuple[float, float]:
    """(flops, bytes) of one eqn; composites and fused eqns cost what their bodies cost."""
    rule = cost_rules.get(eqn.prim)
    if rule is not None:
        return rule(eqn, dims)
    if eqn.body is not None:
        flops = nbytes = 0.0
        for e in eqn.body.eqns:
            f, b = eqn_cost(e, dims)
            flops, nbytes = flops + f, nbytes + b
        return flops, nbytes
    raise KeyError(f"{eqn.prim.name}: no cost rule registered")


def graph_cost(graph: Graph, dims: dict[str, int]) -> dict[str, dict[str, float]]:
    """{op name: {"count", "flops", "bytes"}} plus a "total" row, with symbols bound by ``dims``."""
    env = {s: 1 for s in graph.symbols} | {"P": 0} | dict(dims)
    table: dict[str, dict[str, float]] = {}
    for e in graph.eqns:
        f, b = eqn_cost(e, env)
        row = table.setdefault(e.prim.name, {"count": 0, "flops": 0.0, "bytes": 0.0})
        row["count"] += 1
        row["flops"] += f
        row["bytes"] += b
    table["total"] = {k: sum(r[k] for r in table.values()) for k in ("count", "flops", "bytes")}
    return table
