"""Tracing: run a Python function on Tracers and record a Graph, the way jax.make_jaxpr does.

    graph = trace(fn, f32["T", 256], {"w": param("blk.0.w", q8_0[512, 256])})

Arguments are pytrees (nested dict/list/tuple) of avals. An ``Aval`` becomes a graph
input, a ``param(...)`` becomes a weight read from a named tensor, and ``dim("P")``
becomes a scalar input whose value binds the symbol P. ``scope("blk.3")`` names the
eqns traced inside it, so printed graphs read like the model.
"""
from __future__ import annotations

import contextlib
import inspect
import re
from typing import Callable, Sequence

import numpy as np

from ggraph.ir.dtypes import Aval, DimAval, ParamAval
from ggraph.ir.graph import Eqn, Graph, Literal, Var
from ggraph.ir.primitive import Primitive, infer


# ---------------------------------------------------------------------------------------
# pytrees: nested dict / list / tuple with leaves
# ---------------------------------------------------------------------------------------

class TreeDef:
    """The structure of a pytree: a node kind, its keys, and child TreeDefs; None marks a leaf."""

    __slots__ = ("kind", "keys", "children")

    def __init__(self, kind, keys=(), children=()):
        self.kind, self.keys, self.children = kind, tuple(keys), tuple(children)

    def __eq__(self, other):
        return isinstance(other, TreeDef) and (self.kind, self.keys, self.children) == \
            (other.kind, other.keys, other.children)

    def __repr__(self):
        return f"TreeDef({self.kind}, {self.keys}, {self.children})"


_LEAF = TreeDef("leaf")


def tree_flatten(tree, paths: list | None = None, prefix: str = "") -> tuple[list, TreeDef]:
    """Leaves in order and the structure; ``paths`` (if given) receives each leaf's path string."""
    if isinstance(tree, dict):
        kids = [tree_flatten(tree[k], paths, f"{prefix}.{k}" if prefix else str(k)) for k in tree]
        return [l for ls, _ in kids for l in ls], TreeDef("dict", tree.keys(), [t for _, t in kids])
    if isinstance(tree, (list, tuple)):
        kids = [tree_flatten(x, paths, f"{prefix}[{i}]") for i, x in enumerate(tree)]
        return [l for ls, _ in kids for l in ls], TreeDef(type(tree).__name__, (), [t for _, t in kids])
    if paths is not None:
        paths.append(prefix)
    return [tree], _LEAF


def tree_unflatten(treedef: TreeDef, leaves: Sequence):
    it = iter(leaves)

    def build(td: TreeDef):
        if td.kind == "leaf":
            return next(it)
        kids = [build(c) for c in td.children]
        if td.kind == "dict":
            return dict(zip(td.keys, kids))
        return tuple(kids) if td.kind == "tuple" else list(kids)
    return build(treedef)


# ---------------------------------------------------------------------------------------
# trace state
# ---------------------------------------------------------------------------------------

class _Frame:
    """One graph being recorded: its eqns so far."""

    def __init__(self):
        self.eqns: list[Eqn] = []


_frames: list[_Frame] = []
_scopes: list[str] = []


@contextlib.contextmanager
def scope(name: str):
    """Name the eqns traced inside: ``with scope("blk.3"), scope("attn"):`` gives ``blk.3.attn``."""
    _scopes.append(str(name))
    try:
        yield
    finally:
        _scopes.pop()


def current_scope() -> str:
    return ".".join(_scopes)


def _frame() -> _Frame:
    if not _frames:
        raise RuntimeError("ggraph ops can only be called while tracing: use ggraph.trace(fn, *avals)")
    return _frames[-1]


# ---------------------------------------------------------------------------------------
# Tracer
# ---------------------------------------------------------------------------------------

class Tracer:
    """A traced value. Arithmetic and indexing on it record eqns (see ggraph.ir.methods)."""

    __slots__ = ("var",)
    __array_priority__ = 1000   # so `np_array * tracer` defers to us

    def __init__(self, var: Var | Literal):
        self.var = var

    @property
    def aval(self) -> Aval:
        return self.var.aval

    @property
    def shape(self):
        return self.aval.shape

    @property
    def dtype(self):
        return self.aval.dtype

    @property
    def ndim(self) -> int:
        return self.aval.ndim

    def __repr__(self):
        return f"Tracer<{self.aval}>"

    def __bool__(self):
        raise TypeError(f"a traced value ({self.aval}) has no truth value at trace time; use ops.where")

    def __len__(self):
        return self.shape[0]

    # arithmetic operators, indexing and the numpy-style methods are attached by ggraph.ir.methods


def to_atom(x, like: Aval | None = None) -> Var | Literal:
    """A Tracer's var, or a Literal for a python/numpy constant (dtype taken from ``like``)."""
    if isinstance(x, Tracer):
        return x.var
    if isinstance(x, (Var, Literal)):
        return x
    if isinstance(x, (int, float, np.number, np.ndarray, list)) and not isinstance(x, bool):
        dtype = like.dtype if like is not None and not like.dtype.is_quantized else None
        return Literal(x, dtype)
    raise TypeError(f"cannot use {type(x).__name__} {x!r} as a traced operand")


class Op(Primitive):
    """A primitive that models call like a function: ``square_p(x)`` records ``square`` on ``x`` (a
    composite with its traced body); ``ops.elementwise`` and ``ops.composite`` make these."""
    __slots__ = ()

    def __call__(self, *operands, **params):
        if self.composite and self.decomposition is not None:
            return bind_composite(self, self.decomposition, operands, params)
        return bind(self, *operands, **params)


def bind(prim: Primitive, *args, body: Graph | None = None, **params):
    """Record ``prim`` applied to args; return its Tracer output (a tuple for several)."""
    like = next((a.aval for a in args if isinstance(a, Tracer)), None)
    atoms = [to_atom(a, like) for a in args]
    shape_params = dict(params, body=body) if body is not None else params
    out_avals = infer(prim, [a.aval for a in atoms], shape_params)
    outs = [Var(a) for a in out_avals]
    _frame().eqns.append(Eqn(prim, atoms, outs, params, current_scope(), body))
    tracers = tuple(Tracer(v) for v in outs)
    return tracers if (prim.multiple_results or len(tracers) > 1) else tracers[0]


def trace_body(fn: Callable, operands: Sequence, params: dict) -> Graph:
    """Trace ``fn(*fresh_tracers, **params)`` into a standalone sub-graph (a composite body)."""
    invars = [Var(to_atom(o).aval) for o in operands]
    frame = _Frame()
    _frames.append(frame)
    try:
        out = fn(*[Tracer(v) for v in invars], **params)
    finally:
        _frames.pop()
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return Graph(invars, (), frame.eqns, [to_atom(o) for o in outs])


def bind_composite(prim: Primitive, decomposition: Callable, operands: Sequence, params: dict):
    """Record a composite: one eqn named ``prim`` that carries its traced decomposition."""
    like = next((a.aval for a in operands if isinstance(a, Tracer)), None)
    atoms = [to_atom(a, like) for a in operands]
    body = trace_body(decomposition, atoms, params)
    return bind(prim, *atoms, body=body, **params)


# ---------------------------------------------------------------------------------------
# trace
# ---------------------------------------------------------------------------------------

def trace(fn: Callable, *avals, name: str | None = None) -> Graph:
    """Trace ``fn`` on abstract arguments (pytrees of avals) into a Graph."""
    paths: list[str] = []
    leaves, in_tree = tree_flatten(list(avals), paths)
    arg_names = _arg_names(fn, len(avals))
    invars: list[Var] = []
    params: list[Var] = []
    tracers = []
    arg_vars = []
    for leaf, path in zip(leaves, paths):
        if not isinstance(leaf, Aval):
            raise TypeError(f"trace: argument {path} must be an aval such as f32['T', 64], "
                            f"got {type(leaf).__name__}")
        hint = _hint(path, arg_names, leaf)
        v = Var(leaf, hint)
        (params if isinstance(leaf, ParamAval) else invars).append(v)
        arg_vars.append(v)
        tracers.append(Tracer(v))
    args = tree_unflatten(in_tree, tracers)
    frame = _Frame()
    _frames.append(frame)
    try:
        out = fn(*args)
    finally:
        _frames.pop()
    out_leaves, out_tree = tree_flatten(out)
    outvars = [to_atom(o) for o in out_leaves]
    graph = Graph(invars, params, frame.eqns, outvars, in_tree=in_tree, out_tree=out_tree,
                  name=name or getattr(fn, "__name__", ""), args=arg_vars)
    graph.verify()
    return graph


def _arg_names(fn, n) -> list[str]:
    try:
        names = [p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    return (names + [f"arg{i}" for i in range(len(names), n)])[:n]


def _hint(path: str, arg_names: list[str], aval: Aval) -> str | None:
    """A readable name for an input: the argument name for plain leaves, the symbol for dims."""
    if isinstance(aval, DimAval):
        return aval.symbol
    m = re.fullmatch(r"\[(\d+)\](?:\[(\d+)\])?", path)
    if m:                                     # a positional argument, or an item of a list argument
        return arg_names[int(m.group(1))] + (m.group(2) or "")
    return None
