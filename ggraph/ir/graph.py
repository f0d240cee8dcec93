"""The graph: Var, Literal, Eqn and Graph, the checks on them, their cost, and their text form.

A graph is a jaxpr-like straight-line program; its printed text is the user interface:

    { lambda ; x:f32[T,256] w:q8_0[512,256]. let
        a:f32[512,256] = dequant w
        b:f32[T,512] = matmul x a
      in (b) }

Weights print as ``param`` lines just before their first use, scope changes print as
comments, and composites print collapsed (one line) unless ``expand=True``. A graph an eqn
holds in its params (a scan's body) always prints nested under it, as ``body={ lambda ; ...``.
The parser that reads this text back is ``ggraph.ir.text``.
"""
from __future__ import annotations

import hashlib
import itertools
import re
import weakref
from typing import Iterable, Sequence

import numpy as np

from ggraph.ir import dtypes
from ggraph.ir.dtypes import Aval, DType
from ggraph.ir.primitive import Primitive, ShapeError, infer, known

# ---------------------------------------------------------------------------------------
# Var, Literal, Eqn, Graph
# ---------------------------------------------------------------------------------------

_var_ids = itertools.count()


class Var:
    """A value defined once: a graph input, a param, or an eqn output. Identity is the object."""

    __slots__ = ("aval", "id", "hint")

    def __init__(self, aval: Aval, hint: str | None = None):
        self.aval = aval
        self.id = next(_var_ids)
        self.hint = hint      # a preferred printing name (an argument name), or None

    def __repr__(self):
        return f"Var#{self.id}:{self.aval}"


class Literal:
    """A constant operand: a python scalar or a small numpy array, with its aval."""

    __slots__ = ("value", "aval")

    def __init__(self, value, dtype: DType | str | None = None):
        arr = np.asarray(value)
        if dtype is None:
            dtype = dtypes.i32 if arr.dtype.kind in "iub" else dtypes.f32
        dtype = dtypes.from_name(dtype)
        self.value = arr.astype(dtype.np_dtype) if dtype.np_dtype is not None else arr
        self.aval = Aval(arr.shape, dtype)

    def key(self):
        return (self.aval.dtype.name, self.value.shape, self.value.tobytes())

    def __repr__(self):
        return f"Literal({self})"

    def __str__(self):
        """Scalars print their value (an f32 in its shortest round-trip form); arrays print their aval."""
        if self.value.ndim == 0:
            return str(np.float32(self.value)) if self.aval.dtype.is_float else str(self.value.item())
        return f"const:{self.aval}"


Atom = Var | Literal


class Eqn:
    """``outs = prim[params] ins`` at a scope; composite and fused eqns carry a ``body`` graph."""

    __slots__ = ("prim", "inputs", "outputs", "params", "scope", "body")

    def __init__(self, prim: Primitive, inputs: Sequence[Atom], outputs: Sequence[Var],
                 params: dict | None = None, scope: str = "", body: "Graph | None" = None):
        self.prim = prim
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.params = dict(params or {})
        self.scope = scope
        self.body = body

    def replace(self, **kw) -> "Eqn":
        fields = dict(prim=self.prim, inputs=self.inputs, outputs=self.outputs,
                      params=self.params, scope=self.scope, body=self.body)
        fields.update(kw)
        return Eqn(**fields)

    def shape_params(self) -> dict:
        """Params a shape rule sees: composites and fused eqns also get their body."""
        return dict(self.params, body=self.body) if self.body is not None else self.params

    def cost(self, dims: dict[str, int]) -> tuple[float, float]:
        """(flops, bytes moved) with the symbols bound; an eqn with a body and no rule costs its body."""
        if self.prim.cost is not None:
            return self.prim.cost(self, dims)
        if self.body is not None:
            flops = nbytes = 0.0
            for e in self.body.eqns:
                f, b = e.cost(dims)
                flops, nbytes = flops + f, nbytes + b
            return flops, nbytes
        raise KeyError(f"{self.prim.name}: no cost rule registered")

    def __repr__(self):
        return eqn_to_str(self)


class Graph:
    """invars and params in, eqns in order, outvars out. Immutable by convention: passes build new ones."""

    __slots__ = ("invars", "params", "eqns", "outvars", "in_tree", "out_tree", "name", "args", "meta", "__weakref__")

    def __init__(self, invars: Sequence[Var], params: Sequence[Var], eqns: Sequence[Eqn],
                 outvars: Sequence[Atom], in_tree=None, out_tree=None, name: str = "",
                 args: Sequence[Var] | None = None, meta: dict | None = None):
        self.invars = tuple(invars)
        self.params = tuple(params)
        self.eqns = tuple(eqns)
        self.outvars = tuple(outvars)
        self.in_tree = in_tree      # pytree structure of the traced function's arguments
        self.out_tree = out_tree    # and of its result
        self.name = name
        self.args = tuple(args) if args is not None else self.invars + self.params  # leaf order of in_tree
        self.meta = dict(meta or {})  # annotations passes attach, e.g. "memory_plan"

    def replace(self, **kw) -> "Graph":
        fields = {k: getattr(self, k) for k in self.__slots__ if k != "__weakref__"}
        fields.update(kw)
        return Graph(**fields)

    # -- views -----------------------------------------------------------------------
    @property
    def symbols(self) -> set[str]:
        return {s for v in self.invars for s in v.aval.symbols}

    def users(self) -> dict[Var, list[Eqn]]:
        """Map each var to the eqns that read it (graph outputs are not counted)."""
        out: dict[Var, list[Eqn]] = {}
        for e in self.eqns:
            for a in e.inputs:
                if isinstance(a, Var):
                    out.setdefault(a, []).append(e)
        return out

    def producers(self) -> dict[Var, Eqn]:
        return {o: e for e in self.eqns for o in e.outputs}

    def last_reads(self) -> tuple[dict[Var, Var], dict[Var, int]]:
        """(the storage root of each output that aliases an operand (a view, a cache update), the index of
        the last eqn reading each storage root); graph outputs are read at len(eqns)."""
        from ggraph.ir.primitive import aliases
        root: dict[Var, Var] = {}
        last: dict[Var, int] = {}
        for i, e in enumerate(self.eqns):
            for a in e.inputs:
                if isinstance(a, Var):
                    last[root.get(a, a)] = i
            for k, src in aliases(e).items():
                if isinstance(e.inputs[src], Var):
                    root[e.outputs[k]] = root.get(e.inputs[src], e.inputs[src])
        for o in self.outvars:
            if isinstance(o, Var):
                last[root.get(o, o)] = len(self.eqns)
        return root, last

    def walk(self, expand: bool = False) -> Iterable[Eqn]:
        """Every eqn; with expand, the eqns inside composite bodies too (not the composite itself)."""
        for e in self.eqns:
            if expand and e.body is not None:
                yield from e.body.walk(expand=True)
            else:
                yield e

    def count(self, prim_name: str, expand: bool = False) -> int:
        return sum(e.prim.name == prim_name for e in self.walk(expand))

    # -- checks and measures -------------------------------------------------------------
    def verify(self) -> None:
        """Check SSA order and re-run every shape rule; raise VerifyError naming the eqn."""
        verify(self)

    def cost(self, **dims: int) -> dict[str, dict[str, float]]:
        """Flops and bytes moved per op kind, with symbolic dims bound (defaults T=1, P=0)."""
        env = {s: 1 for s in self.symbols} | {"P": 0} | dict(dims)
        table: dict[str, dict[str, float]] = {}
        for e in self.eqns:
            f, b = e.cost(env)
            row = table.setdefault(e.prim.name, {"count": 0, "flops": 0.0, "bytes": 0.0})
            row["count"] += 1
            row["flops"] += f
            row["bytes"] += b
        table["total"] = {k: sum(r[k] for r in table.values()) for k in ("count", "flops", "bytes")}
        return table

    def signature(self) -> str:
        """A digest of what the graph computes: its text without scopes or names, and its constants' bytes.

        Two graphs with one signature run the same code (kernels are keyed by it)."""
        h = hashlib.sha256(graph_to_str(self, expand=True, names=Names(hints=False), scopes=False).encode())
        for e in self.walk(expand=True):
            for a in e.inputs:
                if isinstance(a, Literal) and a.value.ndim:
                    h.update(a.value.tobytes())
            for _, g in subgraphs(e):                        # a scan's body (its text is in the text above)
                h.update(g.signature().encode())
        return h.hexdigest()

    # -- printing --------------------------------------------------------------------
    def __str__(self):
        return graph_to_str(self)

    def pretty(self, expand: bool = False, layer: int | None = None) -> str:
        return graph_to_str(self, expand=expand, layer=layer)

    def __repr__(self):
        return f"<Graph {self.name or ''} {len(self.invars)} in, {len(self.params)} params, {len(self.eqns)} eqns>"


def subgraphs(e: Eqn) -> list[tuple[str, Graph]]:
    """The graphs an eqn holds in its params, by param name (a scan's ``body``): standalone graphs that the
    op runs, unlike a composite's ``e.body``, which stands for the eqn itself."""
    return [(k, v) for k, v in e.params.items() if isinstance(v, Graph)]


def inlined(graph: Graph, subst: dict) -> list:
    """The graph's eqns with nested composites' bodies inlined; ``subst`` gains, for each composite output,
    the inner atom that stands for it."""
    out = []
    for e in graph.eqns:
        ins = tuple(subst.get(a, a) if isinstance(a, Var) else a for a in e.inputs)
        if e.body is not None:
            inner = dict(zip(e.body.invars, ins))
            out += inlined(e.body, inner)
            for o, v in zip(e.outputs, e.body.outvars):
                subst[o] = inner.get(v, v) if isinstance(v, Var) else v
        else:
            out.append(e.replace(inputs=ins))
    return out


def evaluate(graph: Graph, args: Sequence, apply) -> list:
    """Run ``graph`` on values for its invars (then params): the one eqn loop every interpreter shares.

    ``apply(eqn, operand_values)`` returns the eqn's output value (a tuple for several)."""
    env = dict(zip(graph.invars + graph.params, args))
    read = lambda a: a.value if isinstance(a, Literal) else env[a]                   # noqa: E731
    for e in graph.eqns:
        out = apply(e, [read(a) for a in e.inputs])
        env.update(zip(e.outputs, out if isinstance(out, tuple) else (out,)))
    return [read(o) for o in graph.outvars]


# ---------------------------------------------------------------------------------------
# verification
# ---------------------------------------------------------------------------------------

class VerifyError(ValueError):
    """The graph is malformed; the message names the eqn."""


_verified_bodies: "weakref.WeakSet[Graph]" = weakref.WeakSet()   # bodies are immutable: one check each


def verify(graph: Graph) -> None:
    defined: set[Var] = set()
    for v in graph.invars + graph.params:
        if v in defined:
            raise VerifyError(f"input {v} appears twice")
        defined.add(v)
    for i, e in enumerate(graph.eqns):
        where = f"eqn {i} ({eqn_to_str(e)})" + (f" in {e.scope}" if e.scope else "")
        if not known(e.prim):
            raise VerifyError(f"{where}: unknown op {e.prim.name!r}")
        for a in e.inputs:
            if isinstance(a, Var) and a not in defined:
                raise VerifyError(f"{where}: operand {a} is used before it is defined")
        try:
            expected = infer(e.prim, [a.aval for a in e.inputs], e.shape_params())
        except ShapeError as err:
            raise VerifyError(f"{where}: {err}") from None
        got = tuple(o.aval for o in e.outputs)
        if len(expected) != len(got) or not all(Aval.__eq__(x, y) for x, y in zip(expected, got)):
            raise VerifyError(f"{where}: declares outputs {', '.join(map(str, got))} but its shape rule "
                              f"gives {', '.join(map(str, expected))}")
        if e.prim.composite and e.body is None:
            raise VerifyError(f"{where}: composite without a body")
        if e.body is not None and e.body not in _verified_bodies:
            try:
                verify(e.body)
            except VerifyError as err:
                raise VerifyError(f"{where}: body: {err}") from None
            _verified_bodies.add(e.body)
        for k, g in subgraphs(e):
            if g not in _verified_bodies:
                try:
                    verify(g)
                except VerifyError as err:
                    raise VerifyError(f"{where}: param {k}: {err}") from None
                _verified_bodies.add(g)
        for o in e.outputs:
            if o in defined:
                raise VerifyError(f"{where}: output {o} is defined twice")
            defined.add(o)
    for o in graph.outvars:
        if isinstance(o, Var) and o not in defined:
            raise VerifyError(f"graph output {o} is never defined")


# ---------------------------------------------------------------------------------------
# text
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

    def __init__(self, hints: bool = True):
        self.hints = hints
        self.names: dict[Var, str] = {}
        self.used: set[str] = set()
        self.fresh = _letters()

    def __getitem__(self, v) -> str:
        if isinstance(v, Literal):
            return str(v)
        if v not in self.names:
            name = v.hint if self.hints and v.hint and v.hint not in self.used and re.fullmatch(r"[A-Za-z_]\w*", v.hint) else None
            while name is None or name in self.used:
                name = next(self.fresh)
            self.names[v] = name
            self.used.add(name)
        return self.names[v]

    def decl(self, v: Var) -> str:
        return f"{self[v]}:{v.aval}"


def format_param(v) -> str:
    if isinstance(v, float):
        return str(np.float32(v)) if float(np.float32(v)) == v else repr(v)   # an f32 value prints short
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(format_param(x) for x in v) + ")"
    return str(v)


def eqn_params(e: Eqn) -> str:
    items = [(k, v) for k, v in e.params.items() if v is not None and not isinstance(v, Graph)]
    return "[" + ", ".join(f"{k}={format_param(v)}" for k, v in items) + "]" if items else ""


def op_label(e: Eqn) -> str:
    """The op as it prints: ``rms_norm[eps=1e-06]``, or ``fused{rms_norm,mul}`` for a fused loop."""
    if "ops" in e.params and e.prim.kind == "fused":
        return e.prim.name + "{" + ",".join(e.params["ops"]) + "}"
    return e.prim.name + eqn_params(e)


def eqn_to_str(e: Eqn, names: Names | None = None) -> str:
    names = names or Names()
    if e.prim.print is not None:
        return e.prim.print(e, names)
    outs = " ".join(names.decl(o) for o in e.outputs)
    ins = " ".join(names[a] for a in e.inputs)
    return f"{outs} = {op_label(e)} {ins}".rstrip()


def in_layer(scope: str, layer: int | None) -> bool:
    if layer is None:
        return True
    head = f"blk.{layer}"
    return scope == head or scope.startswith(head + ".")


def graph_to_str(graph: Graph, expand: bool = False, layer: int | None = None, names: Names | None = None,
                 scopes: bool = True) -> str:
    """The text form; pass ``names`` to reuse its printing names afterwards (e.g. for a memory plan)."""
    names = Names() if names is None else names
    lines: list[str] = []
    _emit_graph(graph, names, lines, "", expand, layer, scopes)
    return "\n".join(lines)


def _emit_graph(graph: Graph, names: Names, lines: list[str], indent: str, expand: bool, layer: int | None,
                scopes: bool):
    ins = " ".join(names.decl(v) for v in graph.invars)
    lines.append(f"{indent}{{ lambda ; {ins}. let")
    params = set(graph.params)
    printed: set[Var] = set()
    scope = ""
    for e in graph.eqns:
        if not in_layer(e.scope, layer):
            continue
        if scopes and e.scope != scope:
            scope = e.scope
            lines.append(f"{indent}    # {scope or '(top)'}")
        for a in e.inputs:
            if a in params and a not in printed:
                printed.add(a)
                lines.append(f'{indent}    {names.decl(a)} = param "{a.aval.source}"')
        lines.append(f"{indent}    {eqn_to_str(e, names)}")
        for k, g in subgraphs(e):                            # always printed: the op runs it (a scan's body)
            nested: list[str] = []
            _emit_graph(g, names, nested, indent + "      ", expand, None, scopes)
            lines.append(f"{indent}      {k}={nested[0].lstrip()}")
            lines.extend(nested[1:])
        if expand and e.body is not None:
            _emit_graph(e.body, names, lines, indent + "      ", expand, None, scopes)
    outs = " ".join(names[o] for o in graph.outvars)
    lines.append(f"{indent}  in ({outs}) }}")
