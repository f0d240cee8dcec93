"""Graphs as networkx graphs and as DOT: what ``ggraph dump --format dot|png|svg`` draws.

With ``layer=N`` there is one node per eqn of that layer; a whole model collapses to one box
per layer (its op counts, weight bytes and types, the params that differ between layers,
and the state it carries). Node labels and edge names are the printed text's.
"""
from __future__ import annotations

import re

from ggraph.ir.graph import Eqn, Graph, Names, Var, format_param, graph_to_str, in_layer, op_label
from ggraph.units import fmt_bytes


# ---------------------------------------------------------------------------------------
# networkx and DOT
# ---------------------------------------------------------------------------------------

KIND_COLOURS = {
    "elementwise": "#cfe8ff",
    "reduce": "#d9f2d0",
    "shape": "#eeeeee",
    "matmul": "#ffd6a5",
    "memory": "#fff3b0",
    "composite": "#e5d4ff",
    "fused": "#ffc8dd",
    "other": "#ffffff",
    "scope": "#e5d4ff",         # one box per layer (or embd, output) in the collapsed view
    "input": "#ffffff",         # graph inputs and outputs
    "weight": "#f2f2f2",        # params (GGUF tensors)
    "boundary": "#ffffff",      # values that come from (or go to) eqns outside the view; drawn dashed
}
FUSED_COLOUR = "#c9184a"        # the outline of a fused kernel, or of a layer that contains one
EDGE_NOTE = "edges: value:dtype[shape] and its bytes with T=1"


def _layer_of(scope: str) -> str | None:
    m = re.match(r"(blk\.\d+)", scope)
    return m.group(1) if m else None


def _group_of(scope: str) -> str:
    """The collapsed view's box for a scope: ``blk.N``, else the scope's first part (embd, output)."""
    return _layer_of(scope) or scope.split(".")[0] or "(top)"


def graph_to_networkx(graph: Graph, layer: int | None = None, collapse: bool = True):
    """A DiGraph to draw: one node per eqn of ``layer`` (or of the graph), or one box per layer.

    A graph with ``blk.N`` scopes and no ``layer`` collapses to one box per layer unless
    ``collapse=False``. Nodes carry ``label``, ``kind`` (the fill colour), ``fused`` (outlined)
    and ``scope``; edges carry ``label``: value name (as the text dump prints it), aval, bytes.
    """
    whole_model = collapse and layer is None and any(_layer_of(e.scope) for e in graph.eqns)
    return _collapsed_view(graph) if whole_model else _eqn_view(graph, layer)


def _wrap(label: str, width: int = 40) -> str:
    """Break a long op label after commas so a box stays narrow: ``rope_attention[dims=256, ...]``."""
    lines, line = [], ""
    for part in re.split(r"(?<=, )", label):
        if line and len(line) + len(part) > width:
            lines.append(line.rstrip())
            line = "  "
        line += part
    return "\n".join(lines + [line])


def _value_label(names: Names, v) -> str:
    """``name:dtype[shape] bytes``, bytes with every symbol bound to 1."""
    return f"{names.decl(v)} {fmt_bytes(v.aval.nbytes(_default_dims(v.aval)))}"


def _eqn_view(graph: Graph, layer: int | None):
    """One node per eqn in ``layer``; weights, inputs, and dashed nodes for values crossing the view's edge."""
    import networkx as nx
    names = Names()
    graph_to_str(graph, layer=layer, names=names)         # the names `ggraph dump --layer` prints
    g = nx.DiGraph(title=f"{graph.name or 'graph'}: " + (f"blk.{layer}" if layer is not None else "every eqn"))
    params, invars = set(graph.params), set(graph.invars)
    producer: dict[Var, str] = {}                         # value -> node id of its eqn
    producer_scope: dict[Var, str] = {}
    for i, e in enumerate(graph.eqns):
        for o in e.outputs:
            producer[o], producer_scope[o] = f"n{i}", e.scope
    shown = {f"n{i}" for i, e in enumerate(graph.eqns) if in_layer(e.scope, layer)}
    for i, e in enumerate(graph.eqns):
        nid = f"n{i}"
        if nid not in shown:
            continue
        g.add_node(nid, label=_wrap(op_label(e)), kind=e.prim.kind, scope=e.scope, fused=e.prim.kind == "fused")
        for a in e.inputs:
            if not isinstance(a, Var):
                continue
            if a in params:
                src = f"param:{a.aval.source}"
                g.add_node(src, label=f"{a.aval.source}\n{_value_label(names, a)}", kind="weight", scope=e.scope)
            elif a in invars:
                src = f"in:{names[a]}"
                g.add_node(src, label=f"in {names.decl(a)}", kind="input", scope="")
            elif producer[a] in shown:
                src = producer[a]
            else:
                src = f"from:{names[a]}"
                g.add_node(src, label=f"{names.decl(a)}\nfrom {producer_scope[a] or '(top)'}", kind="boundary",
                           scope="")
            g.add_edge(src, nid, label=_value_label(names, a))
    _add_exits(g, graph, names, shown, producer)
    return g


def _add_exits(g, graph: Graph, names: Names, shown: set, producer: dict) -> None:
    """Dashed nodes for values the view computes and something outside it reads, and graph outputs."""
    readers: dict[Var, list[str]] = {}
    for i, e in enumerate(graph.eqns):
        for a in e.inputs:
            if isinstance(a, Var) and producer.get(a) in shown and f"n{i}" not in shown:
                readers.setdefault(a, []).append(e.scope or "(top)")
    for o in graph.outvars:
        if isinstance(o, Var) and producer.get(o) in shown:
            g.add_node(f"out:{names[o]}", label=f"out {names.decl(o)}", kind="input", scope="")
            g.add_edge(producer[o], f"out:{names[o]}", label=_value_label(names, o))
    for v, scopes in readers.items():
        more = f" (+{len(set(scopes)) - 1} more)" if len(set(scopes)) > 1 else ""
        g.add_node(f"to:{names[v]}", label=f"{names.decl(v)}\nto {scopes[0]}{more}", kind="boundary", scope="")
        g.add_edge(producer[v], f"to:{names[v]}", label=_value_label(names, v))


def _collapsed_view(graph: Graph):
    """One box per layer (and for embd, output): op counts, weight bytes, per-layer params, carried state."""
    import networkx as nx
    names = Names()
    graph_to_str(graph, names=names)
    groups: dict[str, list[Eqn]] = {}
    for e in graph.eqns:
        groups.setdefault(_group_of(e.scope), []).append(e)
    made: dict[Var, str] = {o: grp for grp, eqns in groups.items() for e in eqns for o in e.outputs}
    read_by: dict[Var, list[str]] = {}
    for grp, eqns in groups.items():
        for e in eqns:
            for a in e.inputs:
                if isinstance(a, Var) and a not in graph.params and grp not in read_by.setdefault(a, []) \
                        and made.get(a) != grp:
                    read_by[a].append(grp)
    outs = {o: made[o] for o in graph.outvars if isinstance(o, Var) and o in made}
    state = {v: read_by[v][0] for v in graph.invars if len(read_by.get(v, ())) == 1    # e.g. a layer's KV cache:
             and any(o.aval == v.aval and grp == read_by[v][0] for o, grp in outs.items())}  # read and returned
    state_out = {o for o, grp in outs.items() if any(s.aval == o.aval and owner == grp for s, owner in state.items())}
    varying = _varying_params(groups)
    g = nx.DiGraph(title=f"{graph.name or 'graph'}: one box per layer")
    for grp, eqns in groups.items():
        carried = [s for s, owner in state.items() if owner == grp]
        g.add_node(grp, label=_group_label(grp, eqns, graph, varying.get(grp, []), carried, names),
                   kind="scope", scope=grp,
                   fused=any(e.prim.kind == "fused" for e in eqns))
    for v in graph.invars:
        if v in read_by and v not in state:
            g.add_node(f"in:{names[v]}", label=f"in {names.decl(v)}", kind="input", scope="")
            made[v] = f"in:{names[v]}"
    edges: dict[tuple[str, str], list[str]] = {}
    for v, readers in read_by.items():
        if v in state:
            continue
        note = f" (and {len(readers) - 1} more boxes)" if len(readers) > 2 else ""
        for r in readers[:1] if note else readers:
            edges.setdefault((made[v], r), []).append(_value_label(names, v) + note)
    for o in graph.outvars:
        if isinstance(o, Var) and o in made and o not in state_out:
            g.add_node(f"out:{names[o]}", label=f"out {names.decl(o)}", kind="input", scope="")
            edges.setdefault((made[o], f"out:{names[o]}"), []).append(_value_label(names, o))
    for (a, b), labels in edges.items():
        g.add_edge(a, b, label="\n".join(labels[:3] + ([f"+{len(labels) - 3} more"] if len(labels) > 3 else [])))
    return g


def _varying_params(groups: dict[str, list[Eqn]]) -> dict[str, list[str]]:
    """Per layer, ``op: param=value ...`` lines for the params not every layer shares (e.g. a sliding window)."""
    items = {grp: {(e.prim.name, f"{k}={format_param(v)}") for e in eqns for k, v in e.params.items()
                   if v is not None and k not in ("body", "ops")}
             for grp, eqns in groups.items() if _layer_of(grp)}
    common = set.intersection(*items.values()) if items else set()
    out = {}
    for grp, s in items.items():
        by_op: dict[str, list[str]] = {}
        for op, kv in sorted(s - common):
            by_op.setdefault(op, []).append(kv)
        out[grp] = [f"{op}: {' '.join(kvs)}" for op, kvs in by_op.items()]
    return out


def _group_label(grp: str, eqns: list[Eqn], graph: Graph, varying: list[str], carried: list, names: Names) -> str:
    """A collapsed box's text: op count and weights, op mix, params of its own, the state it carries."""
    counts: dict[str, int] = {}
    for e in eqns:
        counts[e.prim.name] = counts.get(e.prim.name, 0) + 1
    params = set(graph.params)
    weights = {a: None for e in eqns for a in e.inputs if a in params}
    wbytes = sum(w.aval.nbytes() for w in weights)
    wtypes = sorted({str(w.aval.dtype) for w in weights})
    lines = [f"{grp}: {len(eqns)} ops" + (f", weights {fmt_bytes(wbytes)} ({' '.join(wtypes)})" if weights else ""),
             ", ".join(f"{n} {op}" for op, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))]
    lines += varying
    if carried:
        lines.append(f"state in/out: {' '.join(names[v] for v in carried)} "
                     f"{' '.join(sorted({str(v.aval) for v in carried}))}")
    return "\n".join(lines)


def _default_dims(aval) -> dict[str, int]:
    return {s: 1 for s in aval.symbols}


def _dot_quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_node(nid: str, d: dict) -> str:
    """One DOT node line: filled by kind, outlined when fused, dashed when it stands for another view."""
    style = "dashed,rounded" if d["kind"] == "boundary" else "rounded,filled"
    extra = f", penwidth=2.5, color=\"{FUSED_COLOUR}\"" if d.get("fused") else ""
    return (f"{_dot_quote(nid)} [label={_dot_quote(d['label'])}, style=\"{style}\", "
            f"fillcolor=\"{KIND_COLOURS.get(d['kind'], '#ffffff')}\"{extra}];")


def graph_to_dot(graph: Graph, layer: int | None = None, collapse: bool = True) -> str:
    """DOT text of ``graph_to_networkx``: kinds as colours, fused kernels outlined, scopes as clusters."""
    g = graph_to_networkx(graph, layer=layer, collapse=collapse)
    out = [f"digraph {_dot_quote(graph.name or 'ggraph')} {{",
           f"  label={_dot_quote(g.graph['title'] + ' - ' + EDGE_NOTE)}; labelloc=t; fontname=\"Helvetica\";",
           "  rankdir=TB; node [shape=box, fontname=\"Helvetica\", fontsize=10];",
           "  edge [fontname=\"Helvetica\", fontsize=8, color=\"#777777\"];"]
    clusters: dict[str, list[str]] = {}
    for nid, d in g.nodes(data=True):
        clusters.setdefault(d["scope"] if d["kind"] not in ("scope", "input", "boundary") else "", []).append(
            _dot_node(nid, d))
    for k, (scope, lines) in enumerate(clusters.items()):
        if not scope or len(clusters) < 3:
            out += ["  " + s for s in lines]
            continue
        out.append(f"  subgraph cluster_{k} {{ label={_dot_quote(scope)}; style=\"rounded,dashed\"; color=\"#999999\";")
        out += ["    " + s for s in lines]
        out.append("  }")
    for a, b, d in g.edges(data=True):
        out.append(f"  {_dot_quote(a)} -> {_dot_quote(b)} [label={_dot_quote(d.get('label', ''))}];")
    out.append("}")
    return "\n".join(out)
