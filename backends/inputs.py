"""What callers hand a compiled program, checked the same way for every backend.

Inputs are numpy arrays (quantised ones as their uint8 block bytes, which become
``Blocks``), weights come from a GGUFFile (views of its mmap) or a ``{name: array}``
mapping. Every check names the input or weight: its dtype, its shape, its byte size.
"""
from __future__ import annotations

import math
import weakref

import numpy as np

from ggraph.ir import dtypes
from ggraph.ir.dims import Sym
from ggraph.ir.dtypes import DimAval
from ggraph.ir.graph import Graph, Var
from ggraph.ir.prims import Blocks


def bind_symbols(graph: Graph, values: dict[Var, object]) -> dict[str, int]:
    """Symbol values from dim inputs and from input shapes; mismatches name the input. ``values`` are
    checked (``as_value``), which has held every input of a static shape to it already: only the
    dim inputs and the inputs with symbolic dims are looked at here."""
    dims, shaped = _symbolic_inputs(graph)
    env: dict[str, int] = {}
    for v in dims:
        x = values[v]
        if getattr(x, "shape", ()) != () or np.asarray(x).dtype.kind not in "iu":
            raise TypeError(f"input {v.aval.symbol} is a dim: give one integer, got {x!r}")
        env[v.aval.symbol] = int(x)
        if env[v.aval.symbol] < 0:
            raise ValueError(f"input {v.aval.symbol} = {env[v.aval.symbol]}: a dim cannot be negative")
    for v in shaped:
        shape = _logical_shape(values[v])
        for d, n in zip(v.aval.shape, shape):
            if isinstance(d, Sym) and len(d.terms) == 1 and d.terms[0][1] == 1 and d.const == 0:
                if n == 0 and d.terms[0][0] not in env:     # the llvm program would read row -1 of nothing
                    raise ValueError(f"input {v.hint or graph.invars.index(v)}: {d.terms[0][0]} = 0; a step takes "
                                     f"at least one row ({v.aval})")
                env.setdefault(d.terms[0][0], n)
    for v in shaped:
        want, got = v.aval.concrete(env), _logical_shape(values[v])
        if want != got:
            raise ValueError(f"input {v.hint or v}: expected shape {v.aval} = {want}, got {got}")
    return env


_SYMBOLIC: "weakref.WeakKeyDictionary[Graph, tuple]" = weakref.WeakKeyDictionary()


def _symbolic_inputs(graph: Graph) -> tuple[tuple, tuple]:
    """(the dim inputs, the inputs whose shapes have symbolic dims) of ``graph``, found once."""
    found = _SYMBOLIC.get(graph)
    if found is None:
        dims = tuple(v for v in graph.invars if isinstance(v.aval, DimAval))
        shaped = tuple(v for v in graph.invars if not isinstance(v.aval, DimAval)
                       and not all(type(d) is int for d in v.aval.shape))
        found = _SYMBOLIC[graph] = (dims, shaped)
    return found


def _logical_shape(x) -> tuple:
    return x.shape if isinstance(x, (np.ndarray, Blocks)) else ()


def as_value(aval, x, what: str = "input"):
    """Check and convert a caller's array for a value of ``aval`` (quantised and bf16 -> Blocks)."""
    dt = aval.dtype
    x = np.asarray(x)
    if dt.np_dtype is None:                         # block types and bf16: raw bytes
        if x.dtype == np.uint16 and dt is dtypes.bf16:
            x = x.view(np.uint8)
        if x.dtype != np.uint8:
            raise TypeError(f"{what}: a {dt} value ({aval}) must be its uint8 block bytes, got {x.dtype}")
        return _blocks(aval, x, what)
    if x.dtype != dt.np_dtype:
        if dt in (dtypes.i32, dtypes.i8) and x.dtype.kind in "iu" and x.dtype != np.bool_:
            info = np.iinfo(dt.np_dtype)
            if x.size and (x.min() < info.min or x.max() > info.max):
                raise ValueError(f"{what}: {x.min() if x.min() < info.min else x.max()} does not fit {dt}")
            x = x.astype(dt.np_dtype)
        elif dt.is_float and x.dtype.kind == "f":
            x = x.astype(dt.np_dtype)
        else:
            raise TypeError(f"{what}: expected {dt} data for {aval}, got {x.dtype}")
    static = all(isinstance(d, int) for d in aval.shape)
    if static and x.shape != aval.shape:
        raise ValueError(f"{what}: expected shape {aval} = {aval.shape}, got {x.shape}")
    return x


def written_inputs(graph: Graph) -> set:
    """The inputs the graph updates in place (a KV cache): operands an op with effects writes, through
    any views of them and through composite bodies."""
    from ggraph.ir.primitive import aliases

    def walk(g: Graph) -> set:
        root: dict = {}                                    # a view -> the value it views
        written = set()
        find = lambda a: root.get(a, a)                    # noqa: E731
        for e in g.eqns:
            al = aliases(e)
            if e.prim.effects:
                written.update(find(e.inputs[i]) for i in al.values() if isinstance(e.inputs[i], Var))
            if e.body is not None:
                body_args = e.body.invars + e.body.params
                for k in walk(e.body):
                    j = body_args.index(k)
                    if j < len(e.inputs) and isinstance(e.inputs[j], Var):
                        written.add(find(e.inputs[j]))
            for o, i in al.items():
                if isinstance(e.inputs[i], Var) and o < len(e.outputs):
                    root[e.outputs[o]] = find(e.inputs[i])
        return {v for v in g.invars + g.params if v in written}
    return walk(graph)


def as_written(aval, x, what: str):
    """``as_value`` for an input the program updates in place: the caller's own array, never a converted
    copy (the update would land in the copy), and one that may be written."""
    dt = aval.dtype
    want = dt.np_dtype if dt.np_dtype is not None else np.dtype(np.uint8)
    if isinstance(x, np.ndarray) and dt.np_dtype is not None and all(isinstance(d, int) for d in aval.shape) \
            and x.shape != aval.shape:
        raise ValueError(f"{what}: expected shape {aval} = {aval.shape}, got {x.shape}")
    if not isinstance(x, np.ndarray) or x.dtype != want:
        got = x.dtype if isinstance(x, np.ndarray) else type(x).__name__
        raise TypeError(f"{what} is updated in place: give an array of {want} ({aval}), got {got}; a converted "
                        f"copy would not see the update")
    if not x.flags.writeable:
        raise ValueError(f"{what} is updated in place, but the array given is read-only")
    if dt.np_dtype is None and not x.flags.c_contiguous:
        raise ValueError(f"{what} is updated in place: its block bytes must be one contiguous array")
    return as_value(aval, x, what)


def weight_value(aval, weights):
    """A weight's value, checked against its aval: a view of its tensor in a GGUFFile's mmap,
    or the array a ``{name: array}`` mapping holds under its source name."""
    src = aval.source
    what = f"weight {src!r}"
    if hasattr(weights, "tensors"):
        if src not in weights.tensors:
            raise KeyError(f"{what} is not in {getattr(weights, 'path', 'the file')}")
        t = weights.tensors[src]
        if t.dtype is not aval.dtype:
            raise TypeError(f"{what}: the graph reads it as {aval} but the file stores {t.dtype}")
        if tuple(t.shape) != aval.shape:
            raise ValueError(f"{what}: the graph reads it as {aval} but the file's tensor is "
                             f"[{','.join(map(str, t.shape))}]")
        data = t.data.view(t.dtype.np_dtype).reshape(t.shape) if t.dtype.np_dtype is not None else t.data
    else:
        if src not in weights:
            raise KeyError(f"{what} is not in the weights given ({len(weights)} arrays)")
        data = weights[src]
    return as_value(aval, data, what)


def _blocks(aval, x: np.ndarray, what: str) -> Blocks:
    shape = aval.shape
    if any(not isinstance(d, int) for d in shape):
        raise ValueError(f"{what}: a quantised value must have a static shape, not {aval}")
    want = aval.dtype.nbytes(shape)
    if x.nbytes != want:
        raise ValueError(f"{what}: expected {want} bytes of {aval.dtype} blocks for {aval}, got {x.nbytes}")
    n_rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    return Blocks(x.reshape(n_rows, -1), aval.dtype, shape)
