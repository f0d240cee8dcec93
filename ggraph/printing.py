"""Graphs as text (jaxpr-like), as networkx graphs, and as DOT.

The text form is the user interface and the thing pass tests compare:

    { lambda ; x:f32[T,256] g:f32[256]. let
        # blk.0
        w:q8_0[512,256] = param "blk.0.ffn_up.weight"
        a:f32[T,256] = rms_norm[eps=1e-06] x g
        ...
      in (e) }

Weights print as ``param`` lines just before their first use, scope changes print as
comments, and composites print collapsed (one line) unless ``expand=True``.
"""
from __future__ import annotations

import itertools
import re

import numpy as np

from ggraph.core import Eqn, Graph, Literal, Var, print_rules


# ---------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------

def _letters():
    """a, b, ..., z, ba, bb, ... (jaxpr's scheme)."""
    for n in itertools.count(1):
        for t in itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=n):
            if n > 1 and t[0] == "a":
                continue
            yield "".join(t)


class Names:
    """Stable printing names: argument hints where unique, else fresh letters."""

    def __init__(self):
        self.names: dict[Var, str] = {}
        self.used: set[str] = set()
        self.fresh = _letters()

    def __getitem__(self, v) -> str:
        if isinstance(v, Literal):
            return literal_str(v)
        if v not in self.names:
            name = v.hint if v.hint and v.hint not in self.used and re.fullmatch(r"[A-Za-z_]\w*", v.hint) else None
            while name is None or name in self.used:
                name = next(self.fresh)
            self.names[v] = name
            self.used.add(name)
        return self.names[v]

    def decl(self, v: Var) -> str:
        return f"{self[v]}:{v.aval}"


def literal_str(lit: Literal) -> str:
    """Scalars print their value (shortest round-trip form of the f32); arrays print their aval."""
    if lit.value.ndim == 0:
        return str(lit.value.item()) if not lit.aval.dtype.is_float else str(np.float32(lit.value))
    return f"const:{lit.aval}"


def format_param(v) -> str:
    if isinstance(v, float):
        return str(np.float32(v)) if float(np.float32(v)) == v else repr(v)   # an f32 value prints short
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(format_param(x) for x in v) + ")"
    return str(v)


def eqn_params(e: Eqn) -> str:
    items = [(k, v) for k, v in e.params.items() if v is not None]
    return "[" + ", ".join(f"{k}={format_param(v)}" for k, v in items) + "]" if items else ""


def op_label(e: Eqn) -> str:
    """The op as it prints: ``rms_norm[eps=1e-06]``, or ``fused{rms_norm,mul}`` for a fused loop."""
    if e.prim.name == "fused":
        return "fused{" + ",".join(e.params.get("ops", ())) + "}"
    return e.prim.name + eqn_params(e)


def eqn_to_str(e: Eqn, names: Names | None = None) -> str:
    names = names or Names()
    if e.prim in print_rules:
        return print_rules[e.prim](e, names)
    outs = " ".join(names.decl(o) for o in e.outputs)
    ins = " ".join(names[a] for a in e.inputs)
    return f"{outs} = {e.prim.name}{eqn_params(e)} {ins}".rstrip()


# ---------------------------------------------------------------------------------------
# text
# ---------------------------------------------------------------------------------------

def in_layer(scope: str, layer: int | None) -> bool:
    if layer is None:
        return True
    head = f"blk.{layer}"
    return scope == head or scope.startswith(head + ".")


def graph_to_str(graph: Graph, expand: bool = False, layer: int | None = None, names: Names | None = None) -> str:
    """The text form; pass ``names`` to reuse its printing names afterwards (e.g. for a memory plan)."""
    names = Names() if names is None else names
    lines: list[str] = []
    _emit_graph(graph, names, lines, indent="", expand=expand, layer=layer)
    return "\n".join(lines)


def _emit_graph(graph: Graph, names: Names, lines: list[str], indent: str, expand: bool, layer: int | None):
    ins = " ".join(names.decl(v) for v in graph.invars)
    lines.append(f"{indent}{{ lambda ; {ins}. let")
    params = set(graph.params)
    printed: set[Var] = set()
    scope = ""
    for e in graph.eqns:
        if not in_layer(e.scope, layer):
            continue
        if e.scope != scope:
            scope = e.scope
            lines.append(f"{indent}    # {scope or '(top)'}")
        for a in e.inputs:
            if a in params and a not in printed:
                printed.add(a)
                lines.append(f'{indent}    {names.decl(a)} = param "{a.aval.source}"')
        lines.append(f"{indent}    {eqn_to_str(e, names)}")
        if expand and e.body is not None:
            _emit_graph(e.body, names, lines, indent + "      ", expand, None)
    outs = " ".join(names[o] for o in graph.outvars)
    lines.append(f"{indent}  in ({outs}) }}")


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
    "input": "#ffffff",
}


def _layer_of(scope: str) -> str | None:
    m = re.match(r"(blk\.\d+)", scope)
    return m.group(1) if m else None


def graph_to_networkx(graph: Graph, layer: int | None = None, collapse: bool = True):
    """A DiGraph of eqn nodes (and input nodes) with edges labelled by shape, dtype and bytes.

    ``collapse=True`` without a layer draws one box per layer (blk.N) for a whole model.
    """
    import networkx as nx
    g = nx.DiGraph()
    names = Names()
    producer: dict[Var, str] = {}
    whole_model = collapse and layer is None and any(_layer_of(e.scope) for e in graph.eqns)

    def node_for(e: Eqn, i: int) -> str:
        if whole_model and _layer_of(e.scope):
            return _layer_of(e.scope)
        return f"n{i}"

    for v in graph.invars:
        nid = f"in:{names[v]}"
        g.add_node(nid, label=names.decl(v), kind="input", scope="")
        producer[v] = nid
    for i, e in enumerate(graph.eqns):
        if not in_layer(e.scope, layer):
            continue
        nid = node_for(e, i)
        if nid not in g:
            label = nid if whole_model and nid.startswith("blk.") else op_label(e)
            kind = "composite" if nid.startswith("blk.") else e.prim.kind
            g.add_node(nid, label=label, kind=kind, scope=e.scope, ops=0,
                       fused=e.body is not None or e.prim.kind == "fused")
        g.nodes[nid]["ops"] = g.nodes[nid].get("ops", 0) + 1
        for a in e.inputs:
            src = producer.get(a) if isinstance(a, Var) else None
            if a in graph.params:
                src = f"param:{a.aval.source}"
                if whole_model:
                    continue
                g.add_node(src, label=f"{a.aval}\n{a.aval.source}", kind="input", scope=e.scope)
            if src is None or src == nid:
                continue
            aval = a.aval
            g.add_edge(src, nid, label=f"{aval} {_fmt_bytes(aval.nbytes(_default_dims(aval)))}")
        for o in e.outputs:
            producer[o] = nid
    for o in graph.outvars:
        if isinstance(o, Var) and o in producer and producer[o] in g:
            g.add_node(f"out:{names[o]}", label=f"out {names.decl(o)}", kind="input", scope="")
            g.add_edge(producer[o], f"out:{names[o]}", label=str(o.aval))
    return g


def _default_dims(aval) -> dict[str, int]:
    return {s: 1 for s in aval.symbols}


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}B"


def _dot_quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def graph_to_dot(graph: Graph, layer: int | None = None, collapse: bool = True) -> str:
    """DOT text: nodes coloured by op kind, fused/composite nodes outlined, labelled edges."""
    g = graph_to_networkx(graph, layer=layer, collapse=collapse)
    out = [f"digraph {_dot_quote(graph.name or 'ggraph')} {{",
           "  rankdir=TB; node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10];",
           "  edge [fontname=\"Helvetica\", fontsize=8];"]
    for nid, d in g.nodes(data=True):
        extra = ", penwidth=2.5, color=\"#c9184a\"" if d.get("fused") else ""
        out.append(f"  {_dot_quote(nid)} [label={_dot_quote(d['label'])}, "
                   f"fillcolor=\"{KIND_COLOURS.get(d['kind'], '#ffffff')}\"{extra}];")
    for a, b, d in g.edges(data=True):
        out.append(f"  {_dot_quote(a)} -> {_dot_quote(b)} [label={_dot_quote(d.get('label', ''))}];")
    out.append("}")
    return "\n".join(out)
