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
FUSED_COLOUR = "#c9184a"        # the outline of a fused kernel (a layer box outlines the fused kernels it lists)
FUSED_NOTE = "outlined: a fused kernel (one loop or kernel the fusion passes made of several ops)"
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
    """One box per layer (and for embd, output), consecutive layers alike merged into one box: op counts,
    weight bytes, per-layer params, carried state, and its kernels in program order (``kernels``)."""
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
    carried = {grp: [s for s, owner in state.items() if owner == grp] for grp in groups}
    box = _merge_alike(groups, varying, carried)              # each group's box: itself or a run of layers alike
    g = nx.DiGraph(title=f"{graph.name or 'graph'}: one box per layer (layers alike in a row merged), "
                         f"its kernels in program order")
    for key, members in _runs(box).items():
        eqns = groups[members[0]]
        g.add_node(key, label=_group_label(key, members, groups, graph, varying.get(members[0], []),
                                           carried[members[0]], names),
                   kind="scope", scope=key, fused=False, kernels=_kernels(eqns))
    for v in graph.invars:
        if v in read_by and v not in state:
            g.add_node(f"in:{names[v]}", label=f"in {names.decl(v)}", kind="input", scope="")
            box[f"in:{names[v]}"] = made[v] = f"in:{names[v]}"
    edges: dict[tuple[str, str], list[str]] = {}
    for v, readers in read_by.items():
        if v in state:
            continue
        readers = [r for r in dict.fromkeys(box[r] for r in readers) if r != box[made[v]]]
        note = f" (and {len(readers) - 1} more boxes)" if len(readers) > 2 else ""
        for r in readers[:1] if note else readers:
            edges.setdefault((box[made[v]], r), []).append(_value_label(names, v) + note)
    for o in graph.outvars:
        if isinstance(o, Var) and o in made and o not in state_out:
            g.add_node(f"out:{names[o]}", label=f"out {names.decl(o)}", kind="input", scope="")
            edges.setdefault((box[made[o]], f"out:{names[o]}"), []).append(_value_label(names, o))
    for (a, b), labels in edges.items():
        g.add_edge(a, b, label="\n".join(labels[:3] + ([f"+{len(labels) - 3} more"] if len(labels) > 3 else [])))
    return g


def _kernels(eqns: list[Eqn]) -> list[tuple[str, str, bool]]:
    """A box's kernels in program order as (name, kind, fused); shape ops are views, not kernels, and
    are left out. A matmul names its weight: ``qmatmul attn_q``."""
    out = []
    for e in eqns:
        if e.prim.kind == "shape":
            continue
        name = op_label(e) if e.prim.kind == "fused" and "ops" in e.params else e.prim.name
        weights = [a.aval.source for a in e.inputs if isinstance(a, Var) and hasattr(a.aval, "source")]
        if weights and e.prim.kind == "matmul":
            name += " " + re.sub(r"^blk\.\d+\.|\.weight$", "", weights[0])
        out.append((name, e.prim.kind, e.prim.kind == "fused"))
    return out


def _merge_alike(groups: dict[str, list[Eqn]], varying: dict, carried: dict) -> dict[str, str]:
    """Each group's box: consecutive layers with the same kernels, params of their own and carried state
    share one box, ``blk.0-4``; weight types may differ (a mixed quantisation)."""
    def alike(grp):
        return (_kernels(groups[grp]), tuple(varying.get(grp, [])), tuple(str(v.aval) for v in carried[grp])) \
            if _layer_of(grp) else None
    box, run = {}, []
    for grp in list(groups) + [None]:
        if run and (grp is None or alike(grp) is None or alike(grp) != alike(run[0])):
            first, last = run[0], run[-1]
            key = first if len(run) == 1 else f"{first}-{last.split('.')[1]}"
            box.update({r: key for r in run})
            run = []
        if grp is not None:
            if alike(grp) is None:
                box[grp] = grp
            else:
                run.append(grp)
    return box


def _runs(box: dict[str, str]) -> dict[str, list[str]]:
    """box key -> its groups, in graph order."""
    runs: dict[str, list[str]] = {}
    for grp, key in box.items():
        runs.setdefault(key, []).append(grp)
    return runs


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


def _group_label(key: str, members: list[str], groups: dict, graph: Graph, varying: list[str], carried: list,
                 names: Names) -> str:
    """A collapsed box's text: op count and weights, op mix, params of its own, the state it carries."""
    eqns = groups[members[0]]
    counts: dict[str, int] = {}
    for e in eqns:
        counts[e.prim.name] = counts.get(e.prim.name, 0) + 1
    params = set(graph.params)
    per = [{a: None for e in groups[m] for a in e.inputs if a in params} for m in members]
    wbytes = sorted({sum(w.aval.nbytes() for w in ws) for ws in per})
    wtypes = sorted({str(w.aval.dtype) for ws in per for w in ws})
    many = len(members) > 1
    sizes = fmt_bytes(wbytes[0]) if len(wbytes) == 1 else f"{fmt_bytes(wbytes[0])}-{fmt_bytes(wbytes[-1])}"
    head = f"{key}" + (f" ({len(members)} layers alike)" if many else "") + f": {len(eqns)} ops" + (" each" if many else "")
    lines = [head + (f", weights {sizes}{' each' if many else ''} ({' '.join(wtypes)})" if any(per) else ""),
             ", ".join(f"{n} {op}" for op, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))]
    lines += varying
    if carried:
        lines.append(f"state in/out{' each' if many else ''}: "
                     + (f"{' '.join(names[v] for v in carried)} " if not many else f"{len(carried)} x ")
                     + " ".join(sorted({str(v.aval) for v in carried})))
    return "\n".join(lines)


def _default_dims(aval) -> dict[str, int]:
    return {s: 1 for s in aval.symbols}


def _dot_quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _html(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _dot_kernels_label(d: dict, per_row: int = 5) -> str:
    """A layer box's HTML label: its text, then a table of its kernels, the fused ones outlined."""
    lines = "<BR ALIGN=\"LEFT\"/>".join(_html(s) for s in d["label"].split("\n")) + "<BR ALIGN=\"LEFT\"/>"
    cells = [f'<TD BGCOLOR="{KIND_COLOURS.get(kind, "#ffffff")}" '
             + (f'COLOR="{FUSED_COLOUR}" BORDER="2"' if fused else 'COLOR="#999999" BORDER="1"')
             + f'><FONT POINT-SIZE="8">{_html(name)}</FONT></TD>' for name, kind, fused in d["kernels"]]
    rows = "".join("<TR>" + "".join(cells[k:k + per_row]) + "</TR>" for k in range(0, len(cells), per_row))
    return (f'<<TABLE BORDER="0" CELLSPACING="3"><TR><TD ALIGN="LEFT" COLSPAN="{per_row}">{lines}</TD></TR>'
            f'<TR><TD COLSPAN="{per_row}"><TABLE BORDER="0" CELLSPACING="3">{rows}</TABLE></TD></TR></TABLE>>')


def _dot_node(nid: str, d: dict) -> str:
    """One DOT node line: filled by kind, outlined when fused, dashed when it stands for another view; a
    layer box lists its kernels, the fused ones outlined."""
    if d.get("kernels"):
        return (f"{_dot_quote(nid)} [label={_dot_kernels_label(d)}, style=\"rounded,filled\", "
                f"fillcolor=\"{KIND_COLOURS.get(d['kind'], '#ffffff')}\"];")
    style = "dashed,rounded" if d["kind"] == "boundary" else "rounded,filled"
    extra = f", penwidth=2.5, color=\"{FUSED_COLOUR}\"" if d.get("fused") else ""
    return (f"{_dot_quote(nid)} [label={_dot_quote(d['label'])}, style=\"{style}\", "
            f"fillcolor=\"{KIND_COLOURS.get(d['kind'], '#ffffff')}\"{extra}];")


def graph_to_dot(graph: Graph, layer: int | None = None, collapse: bool = True) -> str:
    """DOT text of ``graph_to_networkx``: kinds as colours, fused kernels outlined, scopes as clusters."""
    g = graph_to_networkx(graph, layer=layer, collapse=collapse)
    note = " - " + FUSED_NOTE if any(d.get("fused") or any(k[2] for k in d.get("kernels", ()))
                                     for _, d in g.nodes(data=True)) else ""
    out = [f"digraph {_dot_quote(graph.name or 'ggraph')} {{",
           f"  label={_dot_quote(g.graph['title'] + ' - ' + EDGE_NOTE + note)}; labelloc=t; fontname=\"Helvetica\";",
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
