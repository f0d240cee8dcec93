"""A ggraph Graph as Model Explorer's graph JSON (the format its adapters return), and per-node data.

    g = to_me_graph(graph, "08 plan_memory", log=log, kernels=kernel_table())
    g.json                       # {"id", "nodes": [...], "groupNodeAttributes": {...}, ...}
    g.eqn_of["n42"]              # the Eqn node n42 shows
    node_data("flops", {g.json["id"]: {"n42": 1.2e6}})   # an overlay, colour-scaled

Scopes become collapsible layers (``blk.5.attn`` -> ``blk.5/attn``); a scan is a layer holding its body
(an input node per body operand, an output node per body result); weights are not nodes but sit in
the attrs of the op that reads them; edges carry the value's name, dtype[shape] and bytes at ``dims``.
The JSON is plain data: this module does not import ``model_explorer`` (``ggraph.view.explore`` does).
"""
from __future__ import annotations

import dataclasses
import re

from ggraph.ir.graph import Eqn, Graph, Names, Var, eqn_to_str, graph_to_str, op_label, subgraphs
from ggraph.units import fmt_bytes
from ggraph.view.dot import FUSED_COLOUR, KIND_COLOURS

DEFAULT_DIMS = {"T": 1, "P": 0}


@dataclasses.dataclass
class MEGraph:
    """One graph of a collection: its JSON, and the eqn behind each op node (for overlays)."""
    json: dict
    eqn_of: dict[str, Eqn]


def namespace(scope: str) -> str:
    """A scope as a layer path: ``blk.5.attn`` -> ``blk.5/attn`` (a block and its number are one layer)."""
    parts = scope.split(".") if scope else []
    out = []
    for p in parts:
        if out and out[-1] == "blk" and p.isdigit():
            out[-1] = f"blk.{p}"
        else:
            out.append(p)
    return "/".join(out)


def kernel_table(target=None) -> dict[str, str]:
    """What `ggraph target` prints for ``target`` (default: this host's): kernel variant by op."""
    from ggraph.backends.llvm import kernels
    from ggraph.backends.llvm.target import host_target
    return kernels.describe(target or host_target())


ROUTING = ("top_k", "argmax", "take_along_axis", "segment_sum")
FLOAT_WEIGHTS = ("f32", "f16", "bf16")


def kernel_of(e: Eqn, table: dict[str, str]) -> str | None:
    """The kernel variant ``table`` (kernel_table) names for ``e``, or None where it lists none. A fused
    form of an op (``fused_ssm_scan``) runs the op's kernel; expert matmuls add their weight type's dot."""
    name = e.prim.name
    base = name[len("fused_"):] if name.startswith("fused_") else name
    dts = [str(a.aval.dtype) for a in e.inputs]
    matmul = f"{'fmatmul' if dts[1] in FLOAT_WEIGHTS else 'qmatmul'} {dts[1]}" if len(dts) > 1 else None
    keys = []
    if name == "qmatmul" and matmul:
        keys.append(matmul)
    if name == "take" and dts:
        keys.append(f"get_rows {dts[0]}")
    if e.prim.kind == "fused" and "ops" in e.params:
        keys.append("fused (elementwise)")
    if name in ROUTING:
        keys.append("routing")
    keys += [name, base]
    keys += [k for k in table if {name, base} & set(k.split(", "))]
    found = next((table[k] for k in keys if k in table), None)
    own = [part for part in (found or "").split("; ") if part.startswith(f"{base}: ")]
    if own:                                        # a row for several ops: this op's part of it
        found = own[0]
    if found and name == "qmatmul_experts" and matmul in table:
        found += f"; the {dts[1]} dot: {table[matmul]}"
    return found


def chosen_experts(e: Eqn, dims: dict) -> str | None:
    """For an expert matmul, which of its weights a step reads: min(E, T*k) experts' (the router picks them
    as the step runs), against all E."""
    if e.prim.name != "qmatmul_experts":
        return None
    w, ids = e.inputs[1].aval, e.inputs[2].aval
    T, k = ids.concrete(dims)
    E, N, K = w.concrete(dims)
    n = min(E, T * k)
    return (f"{n} of {E} experts at {_dims_str(dims)} ({k} a token): {_value_bytes(w.update(shape=(n, N, K)), dims)} "
            f"of {_value_bytes(w, dims)}; which ones the router picks as the step runs")


def _fmt(v) -> str:
    from ggraph.ir.graph import format_param
    return format_param(v)


def _value_bytes(aval, dims) -> str:
    try:
        return fmt_bytes(aval.nbytes(dims))
    except Exception:                              # a dim the bindings do not cover, an opaque dtype
        return "?"


def _shape_str(aval) -> str:
    return "[" + ",".join(str(d) for d in aval.shape) + "]"


def _entries_for(e: Eqn, entries, weights: list[str]) -> list:
    """The rewrite-log entries about ``e``: at its scope, naming its fused ops, a weight it reads, or it as a
    rewrite's result."""
    label = op_label(e)
    ops = label[label.index("{"):] if "{" in label else None
    out = []
    for en in entries:
        if en.where != e.scope:
            continue
        d = en.detail
        over = re.search(r"over (\[[^\]]*\])", d)            # a fused loop's domain tells two like loops apart
        if over and e.outputs and over.group(1) != _shape_str(e.outputs[0].aval):
            continue
        if (ops and ops in d) or any(f"({w})" in d for w in weights) or f"-> {e.prim.name}" in d:
            out.append(en)
    return out


class _Builder:
    def __init__(self, graph_id: str, log_entries, kernels, dims, names: Names):
        self.id = graph_id
        self.entries = list(log_entries or ())
        self.kernels = kernels
        self.dims = dims
        self.names = names
        self.nodes: list[dict] = []
        self.eqn_of: dict[str, Eqn] = {}
        self.groups: dict[str, dict[str, str]] = {}
        self.counter = 0
        self.scans = 0

    def new_id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def meta(self, v: Var, i: int) -> dict:
        return {"id": str(i), "attrs": [
            {"key": "tensor_name", "value": self.names[v]},
            {"key": "tensor_shape", "value": str(v.aval)},
            {"key": "bytes", "value": f"{_value_bytes(v.aval, self.dims)} at {_dims_str(self.dims)}"}]}

    def io_node(self, label: str, ns: str, v: Var, src: tuple[str, int] | None) -> str:
        nid = self.new_id("io")
        node = {"id": nid, "label": label, "namespace": ns, "attrs": [
            {"key": "value", "value": self.names.decl(v)}], "incomingEdges": [], "outputsMetadata": [self.meta(v, 0)]}
        if src is not None:
            node["incomingEdges"].append({"sourceNodeId": src[0], "sourceNodeOutputId": str(src[1]),
                                          "targetNodeInputId": "0"})
        self.nodes.append(node)
        return nid

    def graph(self, g: Graph, where: dict, base_ns: str | None) -> list[tuple[str, int] | None]:
        """Add ``g``'s eqns as nodes; ``where`` maps a var to (node id, output index). Returns where each of
        g's outvars is. ``base_ns`` is None at the top level (scopes make the layers), else the layer of the
        scan that runs ``g``."""
        params = set(g.params)
        for e in g.eqns:
            ns = namespace(e.scope) if base_ns is None else base_ns
            subs = subgraphs(e)
            if subs:
                self.scan(e, subs, ns, where)
                continue
            nid = self.new_id("n")
            self.eqn_of[nid] = e
            weights = [a for a in e.inputs if isinstance(a, Var) and a in params]
            edges = []
            for j, a in enumerate(e.inputs):
                if isinstance(a, Var) and a in where and where[a] is not None:
                    src, k = where[a]
                    edges.append({"sourceNodeId": src, "sourceNodeOutputId": str(k), "targetNodeInputId": str(j)})
            attrs = self.attrs(e, weights)
            fused = e.prim.kind == "fused"
            style = {"backgroundColor": KIND_COLOURS.get(e.prim.kind, "#ffffff")}
            if fused:
                style["borderColor"] = FUSED_COLOUR
            self.nodes.append({"id": nid, "label": op_label(e) if "ops" in e.params else e.prim.name, "namespace": ns,
                               "attrs": attrs, "incomingEdges": edges, "style": style,
                               "outputsMetadata": [self.meta(o, i) for i, o in enumerate(e.outputs)]})
            for i, o in enumerate(e.outputs):
                where[o] = (nid, i)
        return [where.get(o) if isinstance(o, Var) else None for o in g.outvars]

    def attrs(self, e: Eqn, weights: list[Var]) -> list[dict]:
        kv = [("eqn", eqn_to_str(e, self.names)), ("op", e.prim.name), ("kind", e.prim.kind),
              ("scope", e.scope or "(top)")]
        kv += [(f"param {k}", _fmt(v)) for k, v in e.params.items() if v is not None and not isinstance(v, Graph)]
        for w in weights:
            kv.append(("weight", f'{self.names[w]} = "{w.aval.source}": {w.aval}, {_value_bytes(w.aval, self.dims)}'))
        if self.kernels is not None:
            k = kernel_of(e, self.kernels)
            kv.append(("kernel", k if k else "ggraph target lists no variant for this op"))
        experts = chosen_experts(e, self.dims)
        if experts:
            kv.append(("weights read", experts))
        try:
            flops, nbytes = e.cost(self.dims)
            kv.append((f"cost at {_dims_str(self.dims)}", f"{flops:.4g} flops, {fmt_bytes(nbytes)} moved"))
        except (KeyError, ValueError):
            pass
        for en in _entries_for(e, self.entries, [w.aval.source for w in weights if w.aval.source]):
            kv.append((f"{'fused' if en.action == 'rewrote' else 'not fused'} [{en.pass_name}]", en.detail))
        if e.body is not None:
            kv.append(("body", graph_to_str(e.body, names=self.names)))
        return [{"key": k, "value": v} for k, v in kv]

    def scan(self, e: Eqn, subs, ns: str, where: dict) -> None:
        """A scan (an eqn that runs graphs) as a layer: its body's operands, eqns and results inside."""
        self.scans += 1
        layer = f"{ns}/{e.prim.name}_{self.scans}" if ns else f"{e.prim.name}_{self.scans}"
        info = {"eqn": eqn_to_str(e, self.names), "scope": e.scope or "(top)"}
        info.update({f"param {k}": _fmt(v) for k, v in e.params.items() if v is not None and not isinstance(v, Graph)})
        if self.kernels is not None:
            info["kernel"] = kernel_of(e, self.kernels) or "ggraph target lists no variant for this op"
        self.groups[layer] = info
        for k, body in subs:
            sub_ns = layer if len(subs) == 1 else f"{layer}/{k}"
            inner: dict = {}
            n_consts, n_carry = e.params.get("consts", 0), e.params.get("carry", 0)
            for j, (v, a) in enumerate(zip(body.invars, e.inputs)):
                role = "const" if j < n_consts else "carry" if j < n_consts + n_carry else "x_t"
                src = where.get(a) if isinstance(a, Var) else None
                inner[v] = (self.io_node(f"{role} in", sub_ns, v, src), 0)
            outs = self.graph(body, inner, sub_ns)
            for i, (o, loc) in enumerate(zip(body.outvars, outs)):
                role = "carry out" if i < n_carry else "y_t"
                nid = self.io_node(role, sub_ns, o, loc) if isinstance(o, Var) else None
                if i < len(e.outputs) and nid is not None:
                    where[e.outputs[i]] = (nid, 0)


def _dims_str(dims: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in dims.items())


def to_me_graph(graph: Graph, graph_id: str, *, log=None, upto: int | None = None, kernels: dict | None = None,
                dims: dict | None = None, layer: int | None = None) -> MEGraph:
    """``graph`` as Model Explorer graph JSON. ``log`` (a RewriteLog; its first ``upto`` entries) says what
    fused into each node or why not; ``kernels`` (kernel_table()) names each op's kernel variant; ``dims``
    bind T and P for bytes and costs; ``layer`` keeps blk.N only (and what feeds it, as inputs)."""
    from ggraph.ir.graph import in_layer
    dims = dict(DEFAULT_DIMS if dims is None else dims)
    entries = [] if log is None else log.entries[:upto]
    names = Names()
    graph_to_str(graph, layer=layer, names=names)                  # the names `ggraph dump` prints
    b = _Builder(graph_id, entries, kernels, dims, names)
    where: dict = {}
    shown = graph if layer is None else graph.replace(eqns=[e for e in graph.eqns if in_layer(e.scope, layer)])
    params = set(graph.params)
    produced = {o for e in shown.eqns for o in e.outputs}
    for e in shown.eqns:                                           # graph inputs, and (with layer) what enters it
        for a in e.inputs:
            if isinstance(a, Var) and a not in params and a not in produced and a not in where:
                where[a] = (b.io_node("input", namespace(e.scope), a, None), 0)
    outs = b.graph(shown, where, None)
    if layer is None:
        for o, loc in zip(graph.outvars, outs):
            if isinstance(o, Var) and loc is not None:
                src = next((n for n in b.nodes if n["id"] == loc[0]), None)
                b.io_node("output", src["namespace"] if src else "", o, loc)
    for scope in sorted({e.scope for e in shown.eqns if e.scope}):
        here = [str(en) for en in entries if en.where == scope]
        if here:
            b.groups.setdefault(namespace(scope), {})["rewrite log"] = "\n".join(here)
    doc = {"id": graph_id, "nodes": b.nodes, "groupNodeAttributes": b.groups,
           "layoutConfigs": {"keepLayersWithASingleChild": False}}
    return MEGraph(doc, b.eqn_of)


def collection(label: str, graphs: list[MEGraph]) -> dict:
    """A graph collection as Model Explorer's JSON loader reads it (graphs listed in the order given)."""
    return {"label": label, "graphs": [g.json for g in graphs], "graphSorting": "name_asc"}


GRADIENT = [{"stop": 0, "bgColor": "#ffffcc"}, {"stop": 0.5, "bgColor": "#fd8d3c"}, {"stop": 1, "bgColor": "#bd0026"}]


def node_data(name: str, values: dict[str, dict[str, float]]) -> dict:
    """An overlay as Model Explorer's node data JSON (graph id -> its nodes' values), colour-scaled from the
    smallest value (pale yellow) to the largest (red)."""
    return {gid: {"name": name, "results": {nid: {"value": float(v)} for nid, v in vals.items()},
                  "gradient": GRADIENT}
            for gid, vals in values.items()}


def safe_id(text: str) -> str:
    """A graph id or file name from a label: letters, digits, '.', '_' and '-' only."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")
