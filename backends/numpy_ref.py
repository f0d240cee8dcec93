"""The numpy reference backend: an env-dict interpreter over eqns. Slow on purpose, simple, exact.

Every fast path is checked against it. Quantised weights arrive as their uint8 block bytes
and become ``Blocks``; dequantised weights are cached per parameter across calls.
"""
from __future__ import annotations

import numpy as np

from ggraph import dtypes
from ggraph.core import DimAval, Graph, Literal, Sym, Var, impl_rules
from ggraph.prims import Blocks
from ggraph.trace import tree_flatten, tree_unflatten


def concrete_params(params: dict, env: dict[str, int]) -> dict:
    """Params with symbolic dims evaluated under ``env``."""
    def conc(v):
        if isinstance(v, Sym):
            return v.eval(env)
        if isinstance(v, tuple):
            return tuple(conc(x) for x in v)
        return v
    return {k: conc(v) for k, v in params.items()}


def bind_symbols(graph: Graph, values: dict[Var, object]) -> dict[str, int]:
    """Symbol values from dim inputs and from input shapes; mismatches name the input."""
    env: dict[str, int] = {}
    for v in graph.invars:
        if isinstance(v.aval, DimAval):
            env[v.aval.symbol] = int(values[v])
    for v in graph.invars:
        shape = _logical_shape(values[v])
        for d, n in zip(v.aval.shape, shape):
            if isinstance(d, Sym) and len(d.terms) == 1 and d.terms[0][1] == 1 and d.const == 0:
                env.setdefault(d.terms[0][0], n)
    for v in graph.invars:
        want = v.aval.concrete(env)
        got = _logical_shape(values[v])
        if want != got:
            raise ValueError(f"input {v.hint or v}: expected shape {v.aval} = {want}, got {got}")
    return env


def _logical_shape(x) -> tuple:
    return x.shape if isinstance(x, (np.ndarray, Blocks)) else ()


def as_value(aval, x):
    """Check and convert a user array for an input of ``aval`` (quantised -> Blocks)."""
    dt = aval.dtype
    if dt.np_dtype is None:                         # block types and bf16: raw bytes
        x = np.asarray(x)
        if x.dtype == np.uint16 and dt is dtypes.bf16:
            x = x.view(np.uint8)
        if x.dtype != np.uint8:
            raise TypeError(f"a {dt} input must be its uint8 block bytes, got {x.dtype}")
        rows = x.reshape(-1, x.shape[-1]).shape[0] if x.ndim > 1 else None
        return _blocks(aval, x, rows)
    x = np.asarray(x)
    if x.dtype != dt.np_dtype:
        if dt.is_float and x.dtype.kind == "f" or dt in (dtypes.i32, dtypes.i8) and x.dtype.kind in "iu":
            x = x.astype(dt.np_dtype)
        else:
            raise TypeError(f"expected {dt} data for {aval}, got {x.dtype}")
    return x


def weight_value(aval, weights):
    """A weight's value, checked against its aval: a view of its tensor in a GGUFFile's mmap,
    or the array a ``{name: array}`` mapping holds under its source name."""
    src = aval.source
    if hasattr(weights, "tensors"):
        if src not in weights.tensors:
            raise KeyError(f"weight {src!r} is not in {getattr(weights, 'path', 'the file')}")
        t = weights.tensors[src]
        data = t.data.view(t.dtype.np_dtype).reshape(t.shape) if t.dtype.np_dtype is not None else t.data
    else:
        data = weights[src]
    return as_value(aval, data)


def _blocks(aval, x: np.ndarray, rows) -> Blocks:
    shape = aval.shape
    if any(not isinstance(d, int) for d in shape):
        raise ValueError(f"a quantised input must have a static shape, got {aval}")
    want = aval.dtype.nbytes(shape)
    if x.nbytes != want:
        raise ValueError(f"{aval}: expected {want} bytes of {aval.dtype} blocks, got {x.nbytes}")
    n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return Blocks(x.reshape(n_rows, -1), aval.dtype, shape)


class NumpyProgram:
    """A compiled graph for the numpy backend: call it like the traced function."""

    def __init__(self, graph: Graph, weights=None):
        self.graph = graph
        self._dequant_cache: dict[Var, tuple[object, np.ndarray]] = {}
        self.weights: dict[str, object] = {}
        if weights is not None:
            self.bind_weights(weights)

    def bind_weights(self, weights) -> None:
        """Bind params by source name from a GGUFFile or a {name: array} mapping."""
        for v in self.graph.params:
            self.weights[v.aval.source] = weight_value(v.aval, weights)

    def __call__(self, *args):
        g = self.graph
        leaves, _ = tree_flatten(list(args))
        arg_vars = g.args
        if len(leaves) != len(arg_vars):
            raise TypeError(f"{g.name or 'graph'} takes {len(arg_vars)} array arguments, got {len(leaves)}")
        values = {}
        for v, x in zip(arg_vars, leaves):
            if x is None and v in g.params and v.aval.source in self.weights:
                values[v] = self.weights[v.aval.source]
            else:
                values[v] = as_value(v.aval, x)
        outs = self.run(values)
        return tree_unflatten(g.out_tree, outs) if g.out_tree is not None else outs

    def run_inputs(self, inputs: list) -> list:
        """Run with the graph's non-weight inputs in order; weights come from ``bind_weights``."""
        g = self.graph
        if len(inputs) != len(g.invars):
            raise TypeError(f"{g.name or 'graph'} has {len(g.invars)} inputs, got {len(inputs)}")
        return self.run({v: as_value(v.aval, x) for v, x in zip(g.invars, inputs)})

    def run(self, values: dict[Var, object]) -> list:
        """Evaluate with inputs given per var; params missing from ``values`` come from bound weights."""
        g = self.graph
        env = dict(values)
        for v in g.params:
            if v not in env:
                if v.aval.source not in self.weights:
                    raise KeyError(f"no value for weight {v.aval.source!r}")
                env[v] = self.weights[v.aval.source]
        dims = bind_symbols(g, env)
        for e in g.eqns:
            if e.prim.name == "dequant" and isinstance(e.inputs[0], Var) and e.inputs[0] in g.params:
                out = self._cached_dequant(e.inputs[0], env[e.inputs[0]])
            else:
                out = eval_eqn(e, [_read(env, a) for a in e.inputs], dims)
            outs = out if isinstance(out, tuple) else (out,)
            for o, val in zip(e.outputs, outs):
                env[o] = val
        return [_read(env, o) for o in g.outvars]

    def _cached_dequant(self, v: Var, blocks):
        hit = self._dequant_cache.get(v)
        if hit is not None and hit[0] is blocks:
            return hit[1]
        out = impl_rules[_prim("dequant")](blocks)
        self._dequant_cache[v] = (blocks, out)
        return out


def _prim(name):
    from ggraph.core import get_primitive
    return get_primitive(name)


def _read(env, a):
    return a.value if isinstance(a, Literal) else env[a]


def eval_eqn(e, vals: list, dims: dict[str, int]):
    """Apply the numpy rule of ``e``; check the result against the eqn's declared shapes."""
    rule = impl_rules.get(e.prim)
    if rule is None:
        raise NotImplementedError(f"numpy backend: op {e.prim.name!r} has no numpy rule")
    params = concrete_params(e.params, dims)
    if e.body is not None and not e.prim.composite:       # a fused loop: its rule evaluates the body
        params["body"] = e.body
    out = rule(*vals, **params)
    outs = out if isinstance(out, tuple) else (out,)
    for o, val in zip(e.outputs, outs):
        want = o.aval.concrete(dims)
        got = getattr(val, "shape", ())
        if tuple(got) != want:
            raise AssertionError(f"numpy rule of {e.prim.name} at {e.scope or 'top'} gave shape {got}, "
                                 f"its aval says {o.aval} = {want}")
    return out
