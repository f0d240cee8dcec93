"""scan: ``jax.lax.scan`` for ggraph, a loop over the leading axis whose step is a traced sub-graph.

    final, ys = ops.scan(body, init, xs)          # body(carry, x_t) -> (carry, y_t)

``body`` is traced once, over the carry's avals and one step's slice of each ``xs`` leaf. The eqn holds
it as its ``body`` param; the values it closes over (weights, other values of the outer graph) become
the eqn's first operands, as JAX's closure conversion makes them:

    c:f32[4] d:f32[T,4] = scan[length=T, reverse=False, consts=1, carry=1] w c0 xs
      body={ lambda ; e:f32[4,4] f:f32[4] g:f32[4]. let
          h:f32[4] = ...
        in (h, h) }

Operands are consts, then the initial carries, then xs (scanned along axis 0); outputs are the final
carries, then ys (each step's y stacked along axis 0). ``ops.scan``'s ``axis`` moves the scanned axis
to the front of xs and back in ys with transposes around the eqn.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ggraph.ir.dims import Dim, eval_dim
from ggraph.ir.dtypes import Aval
from ggraph.ir.graph import Eqn, Graph, Var, evaluate
from ggraph.ir.primitive import ShapeError, infer, register
from ggraph.ir.trace import Tracer, _Frame, _frame, _frames, current_scope, to_atom, tree_flatten, tree_unflatten


# ---------------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------------

def _shape(*avals, body, length, consts, carry, reverse=False):
    """Final carries (the init's avals) and ys ([length, *y_t]); the body must fit the operands."""
    if not isinstance(body, Graph):
        raise ShapeError(f"scan: param body must be a Graph, got {type(body).__name__}")
    if len(body.invars) != len(avals) or consts + carry > len(avals):
        raise ShapeError(f"scan: {len(avals)} operands ({consts} consts, {carry} carries) but the body takes "
                         f"{len(body.invars)} inputs")
    for i, (a, v) in enumerate(zip(avals, body.invars)):
        what = "const" if i < consts else "carry" if i < consts + carry else "xs"
        if what == "xs":
            if not a.shape or a.shape[0] != length:
                raise ShapeError(f"scan: xs operand {i - consts - carry} is {a}, not of length {length}")
            a = a.update(shape=a.shape[1:])
        if not Aval.__eq__(Aval(a.shape, a.dtype), Aval(v.aval.shape, v.aval.dtype)):
            raise ShapeError(f"scan: body input {i} ({what}) is {v.aval}, the operand gives {a}")
    if len(body.outvars) < carry:
        raise ShapeError(f"scan: the body returns {len(body.outvars)} values, fewer than its {carry} carries")
    for k in range(carry):
        got, want = body.outvars[k].aval, avals[consts + k]
        if got.shape != want.shape or got.dtype is not want.dtype:
            raise ShapeError(f"scan: carry {k} goes into the body as {want} and comes out as {got}")
    carries = tuple(Aval(a.shape, a.dtype) for a in avals[consts:consts + carry])
    return carries + tuple(Aval((length,) + o.aval.shape, o.aval.dtype) for o in body.outvars[carry:])


def run_plain(graph: Graph, vals) -> list:
    """Evaluate ``graph`` with each eqn's numpy rule (a composite without one runs its body): the graph's own
    interpreter, for a scan run outside a backend (the numpy backend passes its own, which checks more)."""
    def apply(e: Eqn, v):
        if e.prim.impl is not None:
            params = dict(e.params, body=e.body) if e.body is not None and not e.prim.composite else dict(e.params)
            if any(isinstance(p, Graph) for p in e.params.values()):
                params["run"] = run_plain
            return e.prim.impl(*v, **params)
        outs = evaluate(e.body, v, apply)
        return tuple(outs) if len(outs) > 1 or e.prim.multiple_results else outs[0]
    return evaluate(graph, list(vals), apply)


def _impl(*vals, body: Graph, length: int, consts: int, carry: int, reverse: bool = False,
          run: Callable | None = None):
    """The loop: ``run(body, values)`` (an interpreter, ``run_plain`` by default) once per step."""
    run = run or run_plain
    fixed, c, xs = list(vals[:consts]), list(vals[consts:consts + carry]), vals[consts + carry:]
    ys: list[list] = [[] for _ in body.outvars[carry:]]
    for t in (range(length - 1, -1, -1) if reverse else range(length)):
        outs = run(body, fixed + c + [x[t] for x in xs])
        c = [np.asarray(o) for o in outs[:carry]]
        for acc, y in zip(ys, outs[carry:]):
            acc.append(np.asarray(y))
    if reverse:
        ys = [acc[::-1] for acc in ys]
    stacked = []
    for acc, o in zip(ys, body.outvars[carry:]):
        dt = o.aval.dtype.np_dtype
        stacked.append(np.stack(acc).astype(dt, copy=False) if acc else np.zeros((0,) + o.aval.concrete({}), dt))
    return tuple(c) + tuple(stacked)


def _cost(e: Eqn, dims: dict) -> tuple[float, float]:
    """length × the body's cost."""
    n = eval_dim(e.params["length"], dims)
    flops = nbytes = 0.0
    for b in e.params["body"].eqns:
        f, m = b.cost(dims)
        flops, nbytes = flops + f, nbytes + m
    return n * flops, n * nbytes


scan_p = register("scan", shape=_shape, impl=_impl, cost=_cost, kind="other", multiple_results=True, fold=False,
                  doc="a loop over the leading axis of xs: body(consts, carry, x_t) -> (carry, y_t), as lax.scan")


# ---------------------------------------------------------------------------------------
# tracing
# ---------------------------------------------------------------------------------------

def _leaves(tree, what: str):
    """Leaves of a pytree as atoms (Tracers' vars, constants as Literals) and their paths."""
    paths: list[str] = []
    leaves, treedef = tree_flatten(tree, paths, what)
    atoms = []
    for leaf, path in zip(leaves, paths):
        try:
            atoms.append(to_atom(leaf))
        except TypeError:
            raise TypeError(f"scan: {path} must be a traced value or an array, got {type(leaf).__name__}") from None
    return atoms, treedef, paths


def _move_axis(t: Tracer, src: int, dst: int) -> Tracer:
    from ggraph.ir.prims import transpose
    perm = list(range(t.ndim))
    perm.insert(dst, perm.pop(src))
    return t if src == dst else transpose(t, tuple(perm))


def scan(body: Callable, init, xs, *, axis: int = 0, reverse: bool = False, length: Dim | None = None):
    """``jax.lax.scan``: ``body(carry, x_t) -> (carry, y_t)`` over the slices of ``xs`` along ``axis``
    (from the last when ``reverse``); returns ``(final carry, ys)``, ys stacked along ``axis``.

    ``init`` and ``xs`` are traced values or pytrees (tuples, lists, dicts) of them; every xs leaf has the
    same length along ``axis``, which may be symbolic (T). ``xs`` may be None (or an empty tuple) when
    ``length`` is given. The body is traced once; the carry must keep its structure, shapes and dtypes."""
    if not callable(body):
        raise TypeError(f"scan: body must be a function (carry, x) -> (carry, y), got {type(body).__name__}")
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"scan: axis must be an int, got {axis!r}")
    init_atoms, init_tree, init_paths = _leaves(init, "init")
    x_atoms, x_tree, x_paths = _leaves(() if xs is None else xs, "xs")
    moved = []
    for a, path in zip(x_atoms, x_paths):
        if a.aval.ndim == 0:
            raise ValueError(f"scan: {path} is a scalar ({a.aval}); xs leaves need an axis to scan")
        if not -a.aval.ndim <= axis < a.aval.ndim:
            raise ValueError(f"scan: axis {axis} is out of range for {path} ({a.aval})")
        moved.append(_move_axis(Tracer(a), axis % a.aval.ndim, 0).var)
    lengths = {path: a.aval.shape[0] for a, path in zip(moved, x_paths)}
    found = list(dict.fromkeys(lengths.values()))
    if len(found) > 1:
        raise ValueError(f"scan: xs leaves differ in length along axis {axis}: "
                         + ", ".join(f"{p} has {n}" for p, n in lengths.items()))
    if length is None and not found:
        raise ValueError("scan: with no xs, give length=")
    if length is not None and found and found[0] != length:
        raise ValueError(f"scan: length={length} but xs have length {found[0]} along axis {axis}")
    n = found[0] if found else length
    carry_in = [Var(Aval(a.aval.shape, a.aval.dtype)) for a in init_atoms]
    x_in = [Var(Aval(a.aval.shape[1:], a.aval.dtype)) for a in moved]
    frame = _Frame()
    _frames.append(frame)
    try:
        out = body(tree_unflatten(init_tree, [Tracer(v) for v in carry_in]),
                   tree_unflatten(x_tree, [Tracer(v) for v in x_in]))
    finally:
        _frames.pop()
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"scan: body must return a pair (carry, y), got {type(out).__name__}")
    carry_out, c_tree, c_paths = _leaves(out[0], "carry")
    if c_tree != init_tree:
        raise TypeError(f"scan: body returns a carry of another structure than init ({len(carry_out)} leaves "
                        f"{c_paths} vs {len(init_atoms)} leaves {init_paths})")
    for a, b, path in zip(init_atoms, carry_out, init_paths):
        if a.aval.shape != b.aval.shape or a.aval.dtype is not b.aval.dtype:
            raise TypeError(f"scan: carry {path.replace('init', 'carry', 1)} goes into the body as {a.aval} and "
                            f"comes out as {b.aval}; a carry keeps its shape and dtype")
    y_atoms, y_tree, _ = _leaves(out[1], "y") if out[1] is not None else ([], None, [])
    g, outer = _closure_converted(frame.eqns, carry_in + x_in, carry_out + y_atoms)
    params = {"length": n, "reverse": bool(reverse), "consts": len(outer), "carry": len(init_atoms), "body": g}
    operands = outer + init_atoms + moved
    outs = [Var(a) for a in infer(scan_p, [a.aval for a in operands], params)]
    _frame().eqns.append(Eqn(scan_p, operands, outs, params, current_scope()))
    outs = [Tracer(v) for v in outs]
    finals, ys = outs[:len(init_atoms)], outs[len(init_atoms):]
    ys = [_move_axis(y, 0, axis % y.ndim) if -y.ndim <= axis < y.ndim else _bad_y_axis(axis, y) for y in ys]
    return tree_unflatten(init_tree, finals), (None if y_tree is None else tree_unflatten(y_tree, ys))


def _bad_y_axis(axis: int, y: Tracer):
    raise ValueError(f"scan: axis {axis} is out of range for a stacked y of {y.aval}")


def _closure_converted(eqns: list[Eqn], invars: list[Var], outvars: list) -> tuple[Graph, list[Var]]:
    """The body's graph, in which the values it reads from outside (closed over) become its first inputs,
    and those outer values."""
    defined = set(invars) | {o for e in eqns for o in e.outputs}
    free: dict[Var, Var] = {}
    for a in [a for e in eqns for a in e.inputs] + list(outvars):
        if isinstance(a, Var) and a not in defined and a not in free:
            free[a] = Var(a.aval, a.hint)
    sub = lambda a: free.get(a, a) if isinstance(a, Var) else a                    # noqa: E731
    body = [e.replace(inputs=tuple(sub(a) for a in e.inputs)) if any(a in free for a in e.inputs
                                                                       if isinstance(a, Var)) else e for e in eqns]
    return Graph(list(free.values()) + invars, (), body, [sub(o) for o in outvars], name="scan body"), list(free)
