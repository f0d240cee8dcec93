"""Primitives: one table entry per op kind, holding every rule about it.

A ``Primitive`` is registered once, where the op is defined (``ggraph/ir/prims.py`` for
primitives, ``composites.py`` for composites, ``fused.py`` for the fused ops), and carries:

- ``shape(*in_avals, **params) -> Aval | tuple[Aval, ...]``    output avals; raise ShapeError
- ``impl(*arrays, **params) -> ndarray | tuple``               the numpy reference
- ``cost(eqn, dims) -> (flops, bytes)``                        for rooflines and ``Graph.cost``
- ``print(eqn, names) -> str``                                 optional; the default form otherwise
- ``kind``: elementwise | reduce | shape | matmul | memory | composite | fused | other
- ``effects``: the op writes a donated operand (cse never merges two, fold never runs one)
- ``aliases``: ``{output index: operand index}`` (or ``fn(eqn) -> dict``): outputs that are
  an operand's storage, as a KV-cache update or a reshape view is
- ``fold``: False keeps it out of constant folding (e.g. gathers from large tables)
- ``in_place``: its kernel reads row r of every operand before writing row r of an output,
  so an output may take a dying operand's buffer (the memory planner asks)
- ``simplify``: algebraic rules ``rule(eqn, producer) -> Atom | Eqn | None`` that fold applies
- ``emit(ev, *values)``: the llvm scalar emitter of an elementwise op or reduction's combine
  (``ev`` is the backend's evaluator, values are LLVM registers of any width);
  ``emit_vector`` is a faster emitter for vector widths, where one exists
- ``reduce = (identity, combining primitive[, f64[, mean]])`` for reductions over the last axis
  (a ``Reduction``): with ``f64`` the partial results are f64 and the result is rounded to f32
  once; with ``mean`` it is divided by the row length first (ggml's norms sum this way)
- ``decomposition``: a composite's body, as the function it is traced from

Passes and backends ask these entries; none keeps a list of op names.
"""
from __future__ import annotations

import sys
import weakref
from typing import Callable, NamedTuple, Sequence

KINDS = ("elementwise", "reduce", "shape", "matmul", "memory", "composite", "fused", "other")


class Reduction(NamedTuple):
    """How a last-axis reduction combines a row: from ``identity`` by the binary primitive ``combine``;
    ``f64``: in f64 partials, rounded to f32 once at the end; ``mean``: divided by the row length (in
    the partials' precision) before that rounding."""
    identity: float
    combine: "Primitive"
    f64: bool = False
    mean: bool = False


class ShapeError(ValueError):
    """A shape or dtype rule failed; the message names the op and the shapes involved."""


class Primitive:
    """An op kind and its rules (see the module docstring)."""

    __slots__ = ("name", "kind", "multiple_results", "shape", "impl", "cost", "print", "effects", "aliases",
                 "fold", "in_place", "simplify", "emit", "emit_vector", "reduce", "decomposition", "doc", "__weakref__")

    def __init__(self, name: str, *, shape: Callable, impl: Callable | None = None, cost: Callable | None = None,
                 kind: str = "other", multiple_results: bool = False, print: Callable | None = None,
                 effects: bool = False, aliases: dict | Callable = None, fold: bool = True,
                 in_place: bool | None = None, simplify: Sequence[Callable] = (), emit: Callable | None = None,
                 emit_vector: Callable | None = None, reduce: tuple | None = None,
                 decomposition: Callable | None = None, doc: str = ""):
        if kind not in KINDS:
            raise ValueError(f"primitive {name!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        self.name, self.kind, self.multiple_results = name, kind, multiple_results
        self.shape, self.impl, self.cost, self.print = shape, impl, cost, print
        self.effects = effects
        self.aliases = aliases or {}
        self.fold = fold and not effects
        self.in_place = kind in ("elementwise", "fused") if in_place is None else in_place
        self.simplify = tuple(simplify)
        self.emit, self.emit_vector = emit, emit_vector
        self.reduce = Reduction(*reduce) if reduce is not None else None
        self.decomposition = decomposition
        self.doc = doc

    @property
    def composite(self) -> bool:
        return self.kind == "composite"

    def __repr__(self):
        return self.name


primitives: dict[str, Primitive] = {}
_origins: dict[str, str] = {}          # primitive name -> the module or file that defined it
superseded: "weakref.WeakSet[Primitive]" = weakref.WeakSet()    # definitions replaced by a later one


def register(name: str, cls: type = Primitive, **rules) -> Primitive:
    """Make a primitive (of ``cls``: ``trace.Op`` for one models call) with its rules (the keyword
    arguments of ``Primitive``) and file it by name.

    Defining a name again from where it was defined before (a notebook cell run twice, a script, the
    same plugin file) replaces the old entry; from anywhere else it is an error naming both places."""
    origin = definition_site()
    if name in primitives and _origins[name] != origin:
        raise ValueError(f"primitive {name!r} is already registered by {_origins[name]}; {origin} registers "
                         f"it again: rename one of them")
    p = cls(name, **rules)
    if name in primitives:
        superseded.add(primitives[name])
    primitives[name] = p
    _origins[name] = origin
    return p


def known(p: Primitive) -> bool:
    """True if ``p`` is the registered op of its name, or an earlier definition that one replaced (a graph
    traced before the op was defined again keeps the op it was traced with, as a jaxpr does)."""
    return primitives.get(p.name) is p or p in superseded


def definition_site() -> str:
    """The module (its file, or ``__main__`` for a notebook, a REPL or a script) that is defining
    something: the first frame up the stack outside ggraph's functions (ggraph's own modules define
    their ops in their module bodies)."""
    frame = sys._getframe(1)
    while frame.f_back is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module == "ggraph" or module.startswith("ggraph.")) or frame.f_code.co_name == "<module>":
            break
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "?")
    if module == "__main__" or module.startswith("ggraph."):
        return module
    return frame.f_globals.get("__file__") or module


def get_primitive(name: str) -> Primitive:
    try:
        return primitives[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(sorted(primitives))}") from None


def infer(prim: Primitive, in_avals: Sequence, params: dict) -> tuple:
    """Run ``prim``'s shape rule; wrap failures so they name the op and its operand avals."""
    try:
        out = prim.shape(*in_avals, **params)
    except ShapeError:
        raise
    except (ValueError, TypeError, IndexError) as e:
        ops = ", ".join(str(a) for a in in_avals)
        raise ShapeError(f"{prim.name}({ops}): {e}") from None
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# -- questions passes and backends ask about an eqn -------------------------------------

def fusable(e) -> bool:
    """True if eqn ``e`` can run inside a fused row loop: an elementwise op, a last-axis reduction,
    or a composite or fused eqn whose body holds only those."""
    if e.body is not None:
        return all(fusable(b) for b in e.body.eqns)
    return e.prim.kind == "elementwise" or (e.prim.kind == "reduce" and e.prim.reduce is not None)


def not_fusable(e) -> list[str]:
    """The ops in ``e`` (or its body) that keep it out of a fused row loop, each once, in order."""
    if e.body is None:
        return [] if fusable(e) else [e.prim.name]
    out: list[str] = []
    for b in e.body.eqns:
        out += [n for n in not_fusable(b) if n not in out]
    return out


def aliases(e) -> dict[int, int]:
    """{output index: operand index} of ``e``'s outputs that are views of (or updates to) an operand."""
    rule = e.prim.aliases
    return dict(rule(e)) if callable(rule) else dict(rule)
