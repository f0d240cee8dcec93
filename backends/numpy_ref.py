"""The numpy reference backend: an env-dict interpreter over eqns. Slow on purpose, simple, exact.

Every fast path is checked against it. Each eqn runs its op's numpy rule; a composite
without one runs its body. Dequantised weights are cached per parameter across calls.
"""
from __future__ import annotations

import numpy as np

from ggraph.backends import debug_nans
from ggraph.backends.inputs import bind_symbols
from ggraph.backends.program import Program
from ggraph.ir.dims import Sym
from ggraph.ir.graph import Graph, Var, evaluate, subgraphs
from ggraph.ir.prims import dequant_p


def concrete_params(params: dict, env: dict[str, int]) -> dict:
    """Params with symbolic dims evaluated under ``env``."""
    def conc(v):
        if isinstance(v, Sym):
            return v.eval(env)
        if isinstance(v, tuple):
            return tuple(conc(x) for x in v)
        return v
    return {k: conc(v) for k, v in params.items()}


class NumpyProgram(Program):
    """A compiled graph for the numpy backend: call it like the traced function."""

    def __init__(self, graph: Graph, weights=None):
        self.graph = graph
        self.debug_nans = debug_nans.enabled()
        self._dequant_cache: dict[Var, tuple[object, np.ndarray]] = {}
        self.weights: dict[str, object] = {}        # by source name
        if weights is not None:
            self.bind_weights(weights)

    @property
    def bound(self) -> set:
        return {v for v in self.graph.params if v.aval.source in self.weights}

    def bind(self, v: Var, value) -> None:
        self.weights[v.aval.source] = value

    def run(self, values: dict[Var, object], first: int | None = None) -> list:
        """Evaluate with inputs given per var; the params come from the bound weights. Returns the
        outputs, or the ``first`` few."""
        g = self.graph
        missing = [v.aval.source for v in g.params if v.aval.source not in self.weights]
        if missing:
            raise KeyError(f"no value for weight {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if missing[1:] else ""))
        dims = bind_symbols(g, values)
        params = set(g.params)

        def apply(e, vals):
            if e.prim is dequant_p and e.inputs[0] in params:
                out = self._cached_dequant(e.inputs[0], vals[0])
            else:
                out = eval_eqn(e, vals, dims, apply)
            if self.debug_nans:
                check_finite(e, vals, out)
            return out
        return evaluate(g, [values[v] for v in g.invars] + [self.weights[v.aval.source] for v in g.params], apply)[:first]

    def _cached_dequant(self, v: Var, blocks):
        hit = self._dequant_cache.get(v)
        if hit is not None and hit[0] is blocks:
            return hit[1]
        out = dequant_p.impl(blocks)
        self._dequant_cache[v] = (blocks, out)
        return out


def check_finite(e, vals: list, out) -> None:
    """Raise ``NonFiniteError`` naming ``e`` if one of its f32 outputs holds NaN or an infinity."""
    for i, (o, val) in enumerate(zip(e.outputs, out if isinstance(out, tuple) else (out,))):
        if debug_nans.checked(o.aval) and (where := debug_nans.first_non_finite(val)) is not None:
            raise debug_nans.error(e, i, where, list(zip(e.inputs, vals)))


def _run_subgraph(e, g, vals, apply) -> list:
    """Evaluate graph ``g`` that eqn ``e`` runs; a non-finite value found in it names its eqn, inside ``e``."""
    try:
        return evaluate(g, vals, apply)
    except debug_nans.NonFiniteError as err:
        raise debug_nans.NonFiniteError(f"{err} (inside {e.prim.name} at {e.scope or 'top level'})") from None


def eval_eqn(e, vals: list, dims: dict[str, int], apply=None):
    """Apply the numpy rule of ``e`` (a composite without one runs its body); check the result's shapes.
    ``apply(eqn, values)`` evaluates the eqns of bodies (this function by default)."""
    apply = apply or (lambda b, bvals: eval_eqn(b, bvals, dims))
    params = concrete_params(e.params, dims)
    if e.prim.impl is not None:
        if e.body is not None and not e.prim.composite:       # a fused loop: its rule evaluates the body
            params["body"] = e.body
        if subgraphs(e):                                      # a scan: its rule runs its body with this interpreter
            params["run"] = lambda g, gvals: _run_subgraph(e, g, gvals, apply)
        out = e.prim.impl(*vals, **params)
    elif e.body is not None:
        outs = evaluate(e.body, vals, apply)
        out = tuple(outs) if len(outs) > 1 or e.prim.multiple_results else outs[0]
    else:
        raise NotImplementedError(f"numpy backend: op {e.prim.name!r} has no numpy rule")
    outs = out if isinstance(out, tuple) else (out,)
    for o, val in zip(e.outputs, outs):
        want = o.aval.concrete(dims)
        got = getattr(val, "shape", ())
        if tuple(got) != want:
            raise AssertionError(f"numpy rule of {e.prim.name} at {e.scope or 'top'} gave shape {got}, "
                                 f"its aval says {o.aval} = {want}")
    return out
