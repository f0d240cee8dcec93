"""The primitives, each registered with its shape rule, numpy rule and cost rule side by side.

Conventions (ggml's, so quantised weights never need a transpose):
- ``matmul a b`` contracts the LAST axis of both: a[..., M, K], b[..., N, K] -> [..., M, N].
- reductions (``reduce_sum``, ``reduce_max``) run over the last axis and keep it as size 1.
- binary elementwise ops broadcast numpy-style (trailing dims equal, or 1).
- ``less`` yields an i8 mask of 0/1, which ``where`` consumes.
- ``cache_update cache x pos`` writes x's rows into cache at row ``pos`` and returns the cache.
  Its numpy rule writes in place: the cache operand is donated.
"""
from __future__ import annotations

import numpy as np

from ggraph import dtypes
from ggraph.core import Aval, Sym, ShapeError, dim_product, poly_str, register, simplify
from ggraph.dtypes import f32, i8, i32


class Blocks:
    """A weight's raw bytes as the numpy rules see them: uint8 rows of blocks, with dtype and shape."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, data: np.ndarray, dtype, shape):
        self.data = data            # uint8 [rows, row_bytes]
        self.dtype = dtypes.from_name(dtype)
        self.shape = tuple(shape)

    def dequantize(self) -> np.ndarray:
        from ggraph.quants import dequantize
        return dequantize(self.data, self.dtype, self.shape)


def _elems(aval: Aval, dims) -> int:
    n = 1
    for d in aval.concrete(dims):
        n *= d
    return n


def _io_bytes(eqn, dims) -> int:
    return sum(a.aval.nbytes(dims) for a in eqn.inputs) + sum(o.aval.nbytes(dims) for o in eqn.outputs)


def _cost_per_output(flops_per_elem: int):
    """Cost rule for ops that do a fixed amount of arithmetic per output element."""
    return lambda eqn, dims: (flops_per_elem * sum(_elems(o.aval, dims) for o in eqn.outputs), _io_bytes(eqn, dims))


_move_cost = _cost_per_output(0)


def _require_plain(op: str, *avals: Aval):
    for a in avals:
        if a.dtype.is_quantized or a.dtype is dtypes.bf16:
            raise ShapeError(f"{op}: operand {a} must be dequantised first (got {a.dtype})")


# ---------------------------------------------------------------------------------------
# elementwise
# ---------------------------------------------------------------------------------------

def broadcast_shapes(op: str, *shapes) -> tuple:
    """numpy broadcasting over dims that may be symbolic; mismatches name the op and shapes."""
    nd = max(len(s) for s in shapes)
    out = []
    for i in range(nd):
        ds = {s[i - nd + len(s)] for s in shapes if i - nd + len(s) >= 0}
        ds.discard(1)
        if len(ds) > 1:
            raise ShapeError(f"{op}: shapes {' and '.join('[' + ','.join(map(str, s)) + ']' for s in shapes)} "
                             f"do not broadcast (axis {i - nd})")
        out.append(ds.pop() if ds else 1)
    return tuple(out)


def _unary_shape(op):
    def rule(x):
        _require_plain(op, x)
        if not x.dtype.is_float:
            raise ShapeError(f"{op}: needs a float operand, got {x}")
        return x
    return rule


def _binary_shape(op, out_dtype=None):
    def rule(x, y):
        _require_plain(op, x, y)
        if x.dtype is not y.dtype:
            raise ShapeError(f"{op}: dtypes differ ({x} and {y}); insert a cast")
        return Aval(broadcast_shapes(op, x.shape, y.shape), out_dtype or x.dtype)
    return rule


def _np_unary(fn):
    return lambda x: fn(x).astype(x.dtype, copy=False)


_UNARY = {  # name: (numpy rule, flops per element)
    "neg":   (np.negative, 1),
    "exp":   (np.exp, 8),
    "log":   (np.log, 8),
    "sqrt":  (np.sqrt, 4),
    "rsqrt": (lambda x: np.float32(1) / np.sqrt(x), 5),
    "tanh":  (np.tanh, 10),
    "sin":   (np.sin, 10),
    "cos":   (np.cos, 10),
}
for _name, (_fn, _flops) in _UNARY.items():
    register(_name, shape=_unary_shape(_name), impl=_np_unary(_fn), cost=_cost_per_output(_flops), kind="elementwise")

_BINARY = {  # name: numpy rule
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "max": np.maximum,
}
for _name, _fn in _BINARY.items():
    register(_name, shape=_binary_shape(_name), impl=_fn, cost=_cost_per_output(1), kind="elementwise")

register("less", shape=_binary_shape("less", out_dtype=i8),
         impl=lambda x, y: np.less(x, y).astype(np.int8), cost=_cost_per_output(1), kind="elementwise")


def _where_shape(c, x, y):
    if c.dtype is not i8:
        raise ShapeError(f"where: the condition must be an i8 mask, got {c}")
    if x.dtype is not y.dtype:
        raise ShapeError(f"where: branch dtypes differ ({x} and {y})")
    return Aval(broadcast_shapes("where", c.shape, x.shape, y.shape), x.dtype)


register("where", shape=_where_shape, impl=lambda c, x, y: np.where(c != 0, x, y),
         cost=_cost_per_output(1), kind="elementwise")


_CASTS = {"f32", "f16", "i32", "i8"}


def _cast_shape(x, *, dtype):
    dt = dtypes.from_name(dtype)
    if dt.name not in _CASTS or x.dtype.name not in _CASTS:
        raise ShapeError(f"cast: only between {sorted(_CASTS)}, not {x.dtype} -> {dt}")
    return x.update(dtype=dt)


def _cast_impl(x, *, dtype):
    return x.astype(dtypes.from_name(dtype).np_dtype)


register("cast", shape=_cast_shape, impl=_cast_impl, cost=_cost_per_output(1), kind="elementwise")


# ---------------------------------------------------------------------------------------
# reductions over the last axis (kept as size 1)
# ---------------------------------------------------------------------------------------

def _reduce_shape(op):
    def rule(x):
        _require_plain(op, x)
        if x.ndim == 0:
            raise ShapeError(f"{op}: cannot reduce a scalar")
        return x.update(shape=x.shape[:-1] + (1,))
    return rule


def _reduce_cost(eqn, dims):
    return _elems(eqn.inputs[0].aval, dims), _io_bytes(eqn, dims)


register("reduce_sum", shape=_reduce_shape("reduce_sum"),
         impl=lambda x: np.sum(x, axis=-1, keepdims=True, dtype=x.dtype), cost=_reduce_cost, kind="reduce")
register("reduce_max", shape=_reduce_shape("reduce_max"),
         impl=lambda x: np.max(x, axis=-1, keepdims=True), cost=_reduce_cost, kind="reduce")


# ---------------------------------------------------------------------------------------
# shape ops
# ---------------------------------------------------------------------------------------

def _reshape_shape(x, *, shape):
    new = Aval(shape, x.dtype)
    if x.dtype.is_quantized:
        raise ShapeError(f"reshape: cannot reshape quantised {x}")
    n_old, n_new = dim_product(x.shape), dim_product(new.shape)
    if n_old != n_new:
        raise ShapeError(f"reshape: {x} has {poly_str(n_old)} elements but [{','.join(map(str, new.shape))}] "
                         f"has {poly_str(n_new)}")
    return new


register("reshape", shape=_reshape_shape, impl=lambda x, *, shape: np.reshape(x, shape), cost=_move_cost, kind="shape")


def _transpose_shape(x, *, perm):
    if sorted(perm) != list(range(x.ndim)):
        raise ShapeError(f"transpose: perm {tuple(perm)} is not a permutation of the {x.ndim} axes of {x}")
    _require_plain("transpose", x)
    return x.update(shape=tuple(x.shape[p] for p in perm))


register("transpose", shape=_transpose_shape, impl=lambda x, *, perm: np.transpose(x, perm),
         cost=_move_cost, kind="shape")


def _broadcast_shape(x, *, shape):
    target = Aval(shape, x.dtype)
    got = broadcast_shapes("broadcast", x.shape, target.shape)
    if got != target.shape:
        raise ShapeError(f"broadcast: {x} cannot broadcast to [{','.join(map(str, target.shape))}]")
    return target


register("broadcast", shape=_broadcast_shape, impl=lambda x, *, shape: np.broadcast_to(x, shape),
         cost=_move_cost, kind="shape")


def _slice_shape(x, *, axis, start, stop):
    if not -x.ndim <= axis < x.ndim:
        raise ShapeError(f"slice: axis {axis} out of range for {x}")
    ax = axis % x.ndim
    length = simplify(stop - start) if isinstance(stop, Sym) or isinstance(start, Sym) else stop - start
    if isinstance(length, int) and length < 0:
        raise ShapeError(f"slice: stop {stop} < start {start} on {x}")
    d = x.shape[ax]
    if isinstance(d, int) and isinstance(stop, int) and stop > d:
        raise ShapeError(f"slice: stop {stop} > dim {d} on axis {ax} of {x}")
    if ax == x.ndim - 1 and x.dtype.is_quantized:
        raise ShapeError(f"slice: cannot slice inside the blocks of quantised {x}")
    return x.update(shape=x.shape[:ax] + (length,) + x.shape[ax + 1:])


def _slice_impl(x, *, axis, start, stop):
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(start, stop)
    return x[tuple(idx)]


register("slice", shape=_slice_shape, impl=_slice_impl, cost=_move_cost, kind="shape")


def _concat_shape(*xs, axis):
    if not xs:
        raise ShapeError("concat: needs at least one operand")
    x0 = xs[0]
    ax = axis % x0.ndim
    total = 0
    for x in xs:
        _require_plain("concat", x)
        if x.ndim != x0.ndim or x.dtype is not x0.dtype or \
                any(a != b for i, (a, b) in enumerate(zip(x.shape, x0.shape)) if i != ax):
            raise ShapeError(f"concat on axis {axis}: operands {', '.join(map(str, xs))} disagree off the axis")
        total = x.shape[ax] + total
    return x0.update(shape=x0.shape[:ax] + (simplify(total),) + x0.shape[ax + 1:])


register("concat", shape=_concat_shape, impl=lambda *xs, axis: np.concatenate(xs, axis=axis),
         cost=_move_cost, kind="shape")


# ---------------------------------------------------------------------------------------
# gather, matmul, dequant, iota, cache_update
# ---------------------------------------------------------------------------------------

def _take_shape(table, ids):
    if table.ndim != 2:
        raise ShapeError(f"take: the table must be 2-D [rows, dim], got {table}")
    if ids.dtype is not i32:
        raise ShapeError(f"take: ids must be i32, got {ids}")
    table.check_blocks()
    return Aval(ids.shape + (table.shape[1],), f32)


def _take_impl(table, ids):
    if isinstance(table, Blocks):  # gather the block rows first: only T rows get dequantised
        rows = table.data[ids.reshape(-1)]
        return Blocks(rows, table.dtype, (rows.shape[0], table.shape[1])).dequantize().reshape(ids.shape + (-1,))
    return table[ids].astype(np.float32, copy=False)


def _take_cost(eqn, dims):
    """Only the gathered rows of the table are read, not the whole table."""
    table, ids = (a.aval for a in eqn.inputs)
    n = _elems(ids, dims)
    return 0, n * table.dtype.row_bytes(table.shape[1]) + ids.nbytes(dims) + eqn.outputs[0].aval.nbytes(dims)


register("take", shape=_take_shape, impl=_take_impl, cost=_take_cost, kind="memory")


def _matmul_shape(a, b):
    _require_plain("matmul", a, b)
    if a.ndim < 2 or b.ndim < 2:
        raise ShapeError(f"matmul: operands must be at least 2-D, got {a} and {b}")
    if a.shape[-1] != b.shape[-1]:
        raise ShapeError(f"matmul: contracted dims differ: {a} · {b}ᵀ (K={a.shape[-1]} vs {b.shape[-1]})")
    if a.dtype is not b.dtype:
        raise ShapeError(f"matmul: dtypes differ ({a} and {b})")
    batch = broadcast_shapes("matmul", a.shape[:-2], b.shape[:-2])
    return Aval(batch + (a.shape[-2], b.shape[-2]), a.dtype)


def _matmul_impl(a, b):
    return np.matmul(a, np.swapaxes(b, -1, -2))


def _matmul_cost(eqn, dims):
    a, b = (x.aval for x in eqn.inputs)
    out = _elems(eqn.outputs[0].aval, dims)
    k = a.concrete(dims)[-1]
    return 2 * out * k, _io_bytes(eqn, dims)


register("matmul", shape=_matmul_shape, impl=_matmul_impl, cost=_matmul_cost, kind="matmul")


def _dequant_shape(w):
    if w.dtype is f32:
        raise ShapeError(f"dequant: {w} is already f32")
    if w.dtype not in dtypes.QUANTIZED and w.dtype not in (dtypes.f16, dtypes.bf16):
        raise ShapeError(f"dequant: {w} is not a weight type")
    w.check_blocks()
    return w.update(dtype=f32)


def _dequant_impl(w):
    return w.dequantize() if isinstance(w, Blocks) else w.astype(np.float32)


register("dequant", shape=_dequant_shape, impl=_dequant_impl, cost=_cost_per_output(2), kind="memory")


def _iota_shape(*, n, dtype="i32"):
    return Aval((n,), dtype)


register("iota", shape=_iota_shape,
         impl=lambda *, n, dtype="i32": np.arange(n, dtype=dtypes.from_name(dtype).np_dtype),
         cost=_move_cost, kind="shape")


def _cache_update_shape(cache, x, pos):
    _require_plain("cache_update", cache, x)
    if pos.dtype is not i32 or pos.ndim != 0:
        raise ShapeError(f"cache_update: pos must be a scalar i32, got {pos}")
    if cache.ndim != x.ndim or cache.shape[1:] != x.shape[1:] or cache.dtype is not x.dtype:
        raise ShapeError(f"cache_update: rows {x} do not fit cache {cache}")
    return cache


def _cache_update_impl(cache, x, pos):
    p = int(pos)
    if p < 0 or p + x.shape[0] > cache.shape[0]:
        raise ValueError(f"cache_update: rows {p}..{p + x.shape[0]} do not fit a cache of {cache.shape[0]} rows")
    cache[p:p + x.shape[0]] = x
    return cache


def _cache_update_cost(eqn, dims):
    return 0, 2 * eqn.inputs[1].aval.nbytes(dims)


register("cache_update", shape=_cache_update_shape, impl=_cache_update_impl, cost=_cache_update_cost, kind="memory")
