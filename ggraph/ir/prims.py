"""The primitives: each registered once with every rule it has, beside the function that binds it.

Conventions (ggml's, so quantised weights never need a transpose):
- ``matmul a b`` contracts the LAST axis of both: a[..., M, K], b[..., N, K] -> [..., M, N].
- reductions (``reduce_sum``, ``reduce_max``) run over the last axis and keep it as size 1.
- binary elementwise ops broadcast numpy-style (trailing dims equal, or 1).
- comparisons (``less``, ``greater``, ``equal``, ...) yield an i8 mask of 0/1, which ``where`` consumes and
  ``cast(mask, f32)`` turns into 0.0/1.0 for arithmetic.
- routing: ``top_k`` and ``argmax`` over the last axis, ``take_along_axis`` (numpy's gather along any axis),
  ``segment_sum`` (rows summed into segments in increasing row order).
- ``cache_update cache x pos`` writes x's rows into cache at row ``pos`` and returns the cache.
  Its numpy rule writes in place: the cache operand is donated. ``state_write state value`` does
  the same for a recurrent state: value overwrites it.

An elementwise primitive's ``emit`` rule is its llvm code, written against the backend's
evaluator ``ev`` (``Evaluator`` in ``backends/llvm/kernels/elementwise.py``: ``ev.b`` is an
llvmlite IRBuilder, ``ev.eqn`` the eqn, and ``const``, ``typ``, ``reg``, ``math``, ``poly``,
``intrinsic`` build typed values). Values are registers of any width, scalar or vector, so
one emitter serves every loop the backend runs an op in. Its ``simplify`` rules are the
algebra ``fold`` applies, one line each with the identity as its comment. A new elementwise
op is one call: ``elementwise(name, numpy_rule, emit=...)``.
"""
from __future__ import annotations

import builtins
import math

import numpy as np

from ggraph.ir import dtypes
from ggraph.ir.dims import Sym, as_dim, dim_product, poly_str, simplify
from ggraph.ir.dtypes import Aval, f32, i8, i32
from ggraph.ir.graph import Literal
from ggraph.ir.primitive import Primitive, ShapeError, register
from ggraph.ir.trace import Op, Tracer, bind, to_atom

__all__ = ["add", "sub", "mul", "div", "maximum", "less", "greater", "less_equal", "greater_equal", "equal",
           "not_equal", "neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sin",
           "cos", "fma", "where", "cast", "reduce_sum", "reduce_mean", "reduce_max", "reshape", "transpose",
           "broadcast_to", "slice", "concat", "take", "matmul", "dequant", "iota", "cache_update", "state_write",
           "elementwise", "top_k", "argmax", "take_along_axis", "segment_sum"]


class Blocks:
    """A weight's raw bytes as the numpy rules see them: uint8 rows of blocks, with dtype and shape."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, data: np.ndarray, dtype, shape):
        self.data = data            # uint8 [rows, row_bytes]
        self.dtype = dtypes.from_name(dtype)
        self.shape = tuple(shape)

    def dequantize(self) -> np.ndarray:
        from ggraph.gguf.quants import dequantize
        return dequantize(self.data, self.dtype, self.shape)


# ---------------------------------------------------------------------------------------
# shared rule pieces
# ---------------------------------------------------------------------------------------

def io_bytes(eqn, dims) -> int:
    """Bytes an eqn reads and writes: each operand and each output once."""
    return sum(a.aval.nbytes(dims) for a in eqn.inputs) + sum(o.aval.nbytes(dims) for o in eqn.outputs)


def cost_per_output(flops_per_elem: int):
    """Cost rule for ops that do a fixed amount of arithmetic per output element."""
    return lambda eqn, dims: (flops_per_elem * sum(o.aval.numel(dims) for o in eqn.outputs), io_bytes(eqn, dims))


_move_cost = cost_per_output(0)


def _require_plain(op: str, *avals: Aval):
    for a in avals:
        if a.dtype.is_quantized or a.dtype is dtypes.bf16:
            raise ShapeError(f"{op}: operand {a} must be dequantised first (got {a.dtype})")


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


def _is(a, value) -> bool:
    """True if atom ``a`` is a constant whose every element equals ``value``."""
    return isinstance(a, Literal) and a.value.size > 0 and bool(np.all(a.value == value))


def _same(e, a):
    """``a`` replaces e's output only if it has the very same aval (no broadcasting hidden)."""
    return a if Aval.__eq__(a.aval, e.outputs[0].aval) else None


# -- emitters shared by several ops -------------------------------------------------------

def _arith(float_op: str, int_op: str | None):
    """The IRBuilder method for float or integer registers (None: floats only)."""
    def emit(ev, *xs):
        if ev.is_float(xs[0]):
            return getattr(ev.b, float_op)(*xs)
        if int_op is None:
            raise ValueError(f"{ev.eqn.prim.name} on {ev.eqn.inputs[0].aval.dtype} operands has no llvm emitter")
        return getattr(ev.b, int_op)(*xs)
    return emit


def _emit_max(ev, x, y):
    """numpy's maximum: the larger, and NaN if either is NaN."""
    b = ev.b
    if not ev.is_float(x):
        return b.select(b.icmp_signed(">", x, y), x, y)
    m = b.select(b.fcmp_ordered(">", x, y), x, y)
    return b.select(b.fcmp_unordered("uno", x, x), x, m)


def _emit_less(ev, x, y):
    b = ev.b
    c = b.fcmp_ordered("<", x, y) if ev.is_float(x) else b.icmp_signed("<", x, y)
    return b.zext(c, ev.typ(x, "i8"))


def _compare(pred: str):
    """An i8 mask of ``x pred y`` (0/1): floats compare ordered (False where either is NaN), except ``!=``,
    which is True there, as numpy's; integers compare signed."""
    def emit(ev, x, y):
        b = ev.b
        if not ev.is_float(x):
            c = b.icmp_signed(pred, x, y)
        else:
            c = b.fcmp_unordered(pred, x, y) if pred == "!=" else b.fcmp_ordered(pred, x, y)
        return b.zext(c, ev.typ(x, "i8"))
    return emit


def _emit_where(ev, c, x, y):
    return ev.b.select(ev.b.icmp_signed("!=", c, ev.const(c, 0)), x, y)


def _emit_cast(ev, x):
    """numpy's astype between f32, f16, i32, i8 (float -> int truncates toward zero, saturating).
    f16 values live in f32 registers: the evaluator rounds every f16 result."""
    b = ev.b
    src, dst = (ev.reg(a.aval.dtype) for a in (ev.eqn.inputs[0], ev.eqn.outputs[0]))
    if src == dst:
        return x
    if src == "f32":
        wide = ev.intrinsic("llvm.fptosi.sat", ev.typ(x, "i32"), x)
        return wide if dst == "i32" else b.trunc(wide, ev.typ(x, "i8"))
    if dst == "f32":
        return b.sitofp(x, ev.typ(x, "f32"))
    return b.trunc(x, ev.typ(x, "i8")) if dst == "i8" else b.sext(x, ev.typ(x, "i32"))


def _math(name: str):
    """libm's ``name`` through LLVM's intrinsic (one call per lane of a vector)."""
    return lambda ev, x: ev.math(name, x)


def _math_f64(name: str):
    """libm's double ``name`` of the exact f64 value, rounded to f32 once: the correctly rounded result."""
    return lambda ev, x: ev.b.fptrunc(ev.math(name, ev.b.fpext(x, ev.typ(x, "f64"))), x.type)


def _poly(name: str):
    """The backend's polynomial form of ``name``: whole vectors at a time."""
    return lambda ev, x: ev.poly(name, x)


# ---------------------------------------------------------------------------------------
# elementwise
# ---------------------------------------------------------------------------------------

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


def elementwise(name: str, numpy_rule, *, arity: int = 1, flops: int = 1, shape=None, **rules) -> Primitive:
    """Register an elementwise primitive: ``numpy_rule`` on arrays, ``emit=`` its llvm code, ``flops`` per element.

    Unary ops take a float operand; binary ops broadcast two operands of one dtype. Give
    ``shape=`` for anything else. An op with ``emit`` fuses and compiles natively like the
    shipped ones; without it the llvm backend refuses it by name."""
    if shape is None:
        shape = _unary_shape(name) if arity == 1 else _binary_shape(name)
    impl = (lambda x: numpy_rule(x).astype(x.dtype, copy=False)) if arity == 1 else numpy_rule
    return register(name, cls=Op, shape=shape, impl=impl, cost=cost_per_output(flops), kind="elementwise", **rules)


neg_p = elementwise("neg", np.negative, emit=lambda ev, x: ev.b.fneg(x))
exp_p = elementwise("exp", np.exp, flops=8, emit=_math("exp"), emit_vector=_poly("exp"))
log_p = elementwise("log", np.log, flops=8, emit=_math("log"), emit_vector=_poly("log"))
sqrt_p = elementwise("sqrt", np.sqrt, flops=4, emit=_math("sqrt"))
rsqrt_p = elementwise("rsqrt", lambda x: np.float32(1) / np.sqrt(x), flops=5,
                      emit=lambda ev, x: ev.b.fdiv(ev.const(x, 1.0), ev.math("sqrt", x)))
tanh_p = elementwise("tanh", np.tanh, flops=10, emit=_math("tanh"), emit_vector=_poly("tanh"))
# sin and cos are the correctly rounded values (computed in f64), as glibc's sinf and cosf give ggml's rope
sin_p = elementwise("sin", lambda x: np.sin(x.astype(np.float64)), flops=10, emit=_math_f64("sin"),
                    emit_vector=_poly("sin"))
cos_p = elementwise("cos", lambda x: np.cos(x.astype(np.float64)), flops=10, emit=_math_f64("cos"),
                    emit_vector=_poly("cos"))

add_p = elementwise("add", np.add, arity=2, emit=_arith("fadd", "add"), simplify=(
    lambda e, prod, x, y: _same(e, x) if _is(y, 0) else None,                    # x+0 -> x
    lambda e, prod, x, y: _same(e, y) if _is(x, 0) else None))                   # 0+x -> x
sub_p = elementwise("sub", np.subtract, arity=2, emit=_arith("fsub", "sub"), simplify=(
    lambda e, prod, x, y: _same(e, x) if _is(y, 0) else None,))                  # x-0 -> x
mul_p = elementwise("mul", np.multiply, arity=2, emit=_arith("fmul", "mul"), simplify=(
    lambda e, prod, x, y: _same(e, x) if _is(y, 1) else None,                    # x*1 -> x
    lambda e, prod, x, y: _same(e, y) if _is(x, 1) else None))                   # 1*x -> x
def _np_div(x, y):
    """x / y; integers divide flooring, as Python's //, and x // 0 is 0 (numpy's result, without its warning)."""
    if np.asarray(x).dtype.kind in "iu":
        with np.errstate(divide="ignore", over="ignore"):                         # INT_MIN // -1 wraps
            return np.floor_divide(x, y)
    return np.divide(x, y)


def _emit_div(ev, x, y):
    """fdiv for floats; for integers floor division with numpy's answers where sdiv has none (x // 0 is 0,
    INT_MIN // -1 wraps) instead of a trap."""
    b = ev.b
    if ev.is_float(x):
        return b.fdiv(x, y)
    zero, one, minus = ev.const(y, 0), ev.const(y, 1), ev.const(y, -1)
    by_zero, by_minus = b.icmp_signed("==", y, zero), b.icmp_signed("==", y, minus)
    safe = b.select(b.or_(by_zero, by_minus), one, y)
    q, r = b.sdiv(x, safe), b.srem(x, safe)
    down = b.and_(b.icmp_signed("!=", r, zero), b.icmp_signed("<", b.xor(r, safe), zero))
    q = b.sub(q, b.zext(down, q.type))
    return b.select(by_zero, zero, b.select(by_minus, b.sub(zero, x), q))


div_p = elementwise("div", _np_div, arity=2, emit=_emit_div, simplify=(
    lambda e, prod, x, y: _same(e, x) if _is(y, 1) else None,))                  # x/1 -> x
max_p = elementwise("max", np.maximum, arity=2, emit=_emit_max)
less_p = elementwise("less", lambda x, y: np.less(x, y).astype(np.int8), arity=2,
                     shape=_binary_shape("less", out_dtype=i8), emit=_emit_less)


def comparison(name: str, numpy_rule, pred: str) -> Primitive:
    """An elementwise comparison of two operands of one dtype (f32, f16, i32, i8): an i8 mask of 0/1, which
    ``where`` takes and ``cast(mask, f32)`` turns into 0.0/1.0 for arithmetic."""
    return elementwise(name, lambda x, y: numpy_rule(x, y).astype(np.int8), arity=2,
                       shape=_binary_shape(name, out_dtype=i8), emit=_compare(pred))


greater_p = comparison("greater", np.greater, ">")
less_equal_p = comparison("less_equal", np.less_equal, "<=")
greater_equal_p = comparison("greater_equal", np.greater_equal, ">=")
equal_p = comparison("equal", np.equal, "==")
not_equal_p = comparison("not_equal", np.not_equal, "!=")


def _where_shape(c, x, y):
    if c.dtype is not i8:
        raise ShapeError(f"where: the condition must be an i8 mask, got {c}")
    if x.dtype is not y.dtype:
        raise ShapeError(f"where: branch dtypes differ ({x} and {y})")
    return Aval(broadcast_shapes("where", c.shape, x.shape, y.shape), x.dtype)


where_p = elementwise("where", lambda c, x, y: np.where(c != 0, x, y), arity=3, shape=_where_shape,
                      emit=_emit_where)

def _fma_shape(a, b, c):
    _require_plain("fma", a, b, c)
    if not (a.dtype is b.dtype is c.dtype) or not a.dtype.is_float:
        raise ShapeError(f"fma: needs three operands of one float dtype, got {a}, {b} and {c}")
    return Aval(broadcast_shapes("fma", a.shape, b.shape, c.shape), a.dtype)


def _np_fma(a, b, c):
    """a·b + c rounded once: the product of two f32 is exact in f64 (ties of the f64 sum's rounding
    aside, which a second rounding to f32 could break the other way: about one in 2^29)."""
    return (np.asarray(a, np.float64) * b + c).astype(np.result_type(a, b, c))


fma_p = elementwise("fma", _np_fma, arity=3, flops=2, shape=_fma_shape,
                    emit=lambda ev, a, b, c: ev.math("fma", a, b, c))

CASTS = {"f32", "f16", "i32", "i8"}


def _cast_shape(x, *, dtype):
    dt = dtypes.from_name(dtype)
    if dt.name not in CASTS or x.dtype.name not in CASTS:
        raise ShapeError(f"cast: only between {sorted(CASTS)}, not {x.dtype} -> {dt}")
    return x.update(dtype=dt)


cast_p = register("cast", shape=_cast_shape, impl=lambda x, *, dtype: x.astype(dtypes.from_name(dtype).np_dtype),
                  cost=cost_per_output(1), kind="elementwise", emit=_emit_cast, simplify=(
                      lambda e, prod, x: _same(e, x),))                          # cast(x, x.dtype) -> x


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
    return eqn.inputs[0].aval.numel(dims), io_bytes(eqn, dims)


reduce_sum_p = register("reduce_sum", shape=_reduce_shape("reduce_sum"), cost=_reduce_cost, kind="reduce",
                        impl=lambda x: np.sum(x, axis=-1, keepdims=True, dtype=x.dtype), reduce=(0.0, add_p))
reduce_mean_p = register("reduce_mean", shape=_reduce_shape("reduce_mean"), cost=_reduce_cost, kind="reduce",
                         impl=lambda x: (np.sum(x, axis=-1, keepdims=True, dtype=np.float64) / x.shape[-1])
                         .astype(x.dtype), reduce=(0.0, add_p, True, True))   # f64 sum and division, as ggml
reduce_max_p = register("reduce_max", shape=_reduce_shape("reduce_max"), cost=_reduce_cost, kind="reduce",
                        impl=lambda x: np.max(x, axis=-1, keepdims=True), reduce=(-math.inf, max_p))


# ---------------------------------------------------------------------------------------
# shape ops
# ---------------------------------------------------------------------------------------

def _reshape_shape(x, *, shape):
    new = Aval(shape, x.dtype)
    if x.dtype.is_quantized and (not new.shape or new.shape[-1] != x.shape[-1]):
        raise ShapeError(f"reshape: quantised {x} reshapes only on its leading axes (rows of blocks): the last "
                         f"dim must stay {x.shape[-1]}, got [{','.join(map(str, new.shape))}]")
    n_old, n_new = dim_product(x.shape), dim_product(new.shape)
    if n_old != n_new:
        raise ShapeError(f"reshape: {x} has {poly_str(n_old)} elements but [{','.join(map(str, new.shape))}] "
                         f"has {poly_str(n_new)}")
    return new


def _compose_reshape(e, prod, x):
    inner = prod(x)                                # reshape(reshape(x, s1), s2) -> reshape(x, s2)
    return e.replace(inputs=inner.inputs) if inner is not None and inner.prim is e.prim else None


def _reshape_impl(x, *, shape):
    if isinstance(x, Blocks):                              # the same rows of blocks, counted another way
        return Blocks(x.data, x.dtype, shape)
    return np.reshape(x, shape)


reshape_p = register("reshape", shape=_reshape_shape, impl=_reshape_impl,
                     cost=_move_cost, kind="shape", aliases={0: 0}, simplify=(
                         _compose_reshape,
                         lambda e, prod, x: _same(e, x)))                        # reshape(x, x.shape) -> x


def _transpose_shape(x, *, perm):
    if sorted(perm) != list(range(x.ndim)):
        raise ShapeError(f"transpose: perm {tuple(perm)} is not a permutation of the {x.ndim} axes of {x}")
    _require_plain("transpose", x)
    return x.update(shape=tuple(x.shape[p] for p in perm))


def _compose_transpose(e, prod, x):
    inner = prod(x)                                # transpose(transpose(x, p1), p2) -> transpose(x, p1∘p2)
    if inner is None or inner.prim is not e.prim:
        return None
    p1, p2 = inner.params["perm"], e.params["perm"]
    return e.replace(inputs=inner.inputs, params={"perm": tuple(p1[i] for i in p2)})


transpose_p = register("transpose", shape=_transpose_shape, impl=lambda x, *, perm: np.transpose(x, perm),
                       cost=_move_cost, kind="shape", simplify=(
                           _compose_transpose,
                           lambda e, prod, x: _same(e, x) if tuple(e.params["perm"]) == tuple(range(x.aval.ndim))
                           else None))                                           # transpose(x, id) -> x


def _broadcast_shape(x, *, shape):
    target = Aval(shape, x.dtype)
    got = broadcast_shapes("broadcast", x.shape, target.shape)
    if got != target.shape:
        raise ShapeError(f"broadcast: {x} cannot broadcast to [{','.join(map(str, target.shape))}]")
    return target


broadcast_p = register("broadcast", shape=_broadcast_shape, impl=lambda x, *, shape: np.broadcast_to(x, shape),
                       cost=_move_cost, kind="shape", simplify=(
                           lambda e, prod, x: _same(e, x),))                     # broadcast(x, x.shape) -> x


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
    if isinstance(x, Blocks):                              # whole rows of blocks: a view of the bytes
        rows = x.data.reshape(x.shape[:-1] + (x.data.shape[1],))
        idx = [builtins.slice(None)] * (len(x.shape) - 1)
        idx[axis % len(x.shape)] = builtins.slice(start, stop)
        part = rows[tuple(idx)]
        return Blocks(part.reshape(-1, x.data.shape[1]), x.dtype, part.shape[:-1] + x.shape[-1:])
    idx = [builtins.slice(None)] * x.ndim
    idx[axis] = builtins.slice(start, stop)
    return x[tuple(idx)]


def leading_slice(e) -> bool:
    """A slice whose dims before the axis are all 1 is a contiguous view of its operand."""
    x = e.inputs[0].aval
    return all(d == 1 for d in x.shape[:e.params["axis"] % x.ndim])


slice_p = register("slice", shape=_slice_shape, impl=_slice_impl, cost=_move_cost, kind="shape",
                   aliases=lambda e: {0: 0} if leading_slice(e) else {}, simplify=(
                       lambda e, prod, x: _same(e, x),))                         # x[0:n] on an n-long axis -> x


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


concat_p = register("concat", shape=_concat_shape, impl=lambda *xs, axis: np.concatenate(xs, axis=axis),
                    cost=_move_cost, kind="shape")


# ---------------------------------------------------------------------------------------
# gather, matmul, dequant, iota, cache_update
# ---------------------------------------------------------------------------------------

def _take_shape(table, ids):
    if table.ndim < 2:
        raise ShapeError(f"take: the table must be at least 2-D [rows, ...], got {table}")
    if ids.dtype is not i32:
        raise ShapeError(f"take: ids must be i32, got {ids}")
    if table.dtype.is_quantized and not all(isinstance(d, int) for d in table.shape[1:]):
        raise ShapeError(f"take: a quantised table's entries must have a static shape, got {table}")
    table.check_blocks()
    return Aval(ids.shape + table.shape[1:], f32)


def _take_impl(table, ids):
    n = table.shape[0]
    bad = (ids < 0) | (ids >= n)
    if bad.any():
        raise IndexError(f"take: id {int(ids[bad].reshape(-1)[0])} is out of range for a table of {n} rows")
    if isinstance(table, Blocks):  # gather the entries' blocks first: only those get dequantised
        entry = table.shape[1:]
        per_entry = table.data.reshape(n, -1)                             # one entry's rows of blocks a row
        picked = per_entry[ids.reshape(-1)].reshape(-1, table.data.shape[1])
        return Blocks(picked, table.dtype, (ids.size,) + entry).dequantize().reshape(ids.shape + entry)
    return table[ids].astype(np.float32, copy=False)


def _take_cost(eqn, dims):
    """Only the gathered entries of the table are read, not the whole table."""
    table, ids = (a.aval for a in eqn.inputs)
    entry = table.update(shape=table.shape[1:])
    return 0, ids.numel(dims) * entry.nbytes(dims) + ids.nbytes(dims) + eqn.outputs[0].aval.nbytes(dims)


take_p = register("take", shape=_take_shape, impl=_take_impl, cost=_take_cost, kind="memory", fold=False)


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


def matmul_cost(eqn, dims):
    """2·K flops per output element: a · bᵀ over the last axes."""
    return 2 * eqn.outputs[0].aval.numel(dims) * eqn.inputs[0].aval.concrete(dims)[-1], io_bytes(eqn, dims)


matmul_p = register("matmul", shape=_matmul_shape, impl=lambda a, b: np.matmul(a, np.swapaxes(b, -1, -2)),
                    cost=matmul_cost, kind="matmul")


def _dequant_shape(w):
    if w.dtype is f32:
        raise ShapeError(f"dequant: {w} is already f32")
    if w.dtype not in dtypes.QUANTIZED and w.dtype not in (dtypes.f16, dtypes.bf16):
        raise ShapeError(f"dequant: {w} is not a weight type")
    w.check_blocks()
    return w.update(dtype=f32)


dequant_p = register("dequant", shape=_dequant_shape, cost=cost_per_output(2), kind="memory", fold=False,
                     impl=lambda w: w.dequantize() if isinstance(w, Blocks) else w.astype(np.float32))


def _iota_shape(*, n, dtype="i32"):
    return Aval((n,), dtype)


iota_p = register("iota", shape=_iota_shape, cost=_move_cost, kind="shape",
                  impl=lambda *, n, dtype="i32": np.arange(n, dtype=dtypes.from_name(dtype).np_dtype))


KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")   # what a cache may hold; its rows are written from f32


def _cache_update_shape(cache, x, pos):
    _require_plain("cache_update", x)
    if pos.dtype is not i32 or pos.ndim != 0:
        raise ShapeError(f"cache_update: pos must be a scalar i32, got {pos}")
    if cache.ndim != x.ndim or cache.shape[1:] != x.shape[1:]:
        raise ShapeError(f"cache_update: rows {x} do not fit cache {cache}")
    if cache.dtype is not x.dtype and not (x.dtype is f32 and cache.dtype.name in KV_CACHE_TYPES):
        raise ShapeError(f"cache_update: rows {x} do not fit cache {cache} (a cache of {', '.join(KV_CACHE_TYPES)} "
                         f"takes f32 rows)")
    cache.check_blocks()
    return cache


def cache_write(cache, x: np.ndarray, p: int):
    """cache[p:p+T] = x, converted or quantised as llama.cpp's CPU backend writes its cache."""
    if p < 0 or p + x.shape[0] > cache.shape[0]:
        raise ValueError(f"cache_update: rows {p}..{p + x.shape[0]} do not fit a cache of {cache.shape[0]} rows")
    if not isinstance(cache, Blocks):
        cache[p:p + x.shape[0]] = x
        return cache
    from ggraph.gguf.quants import quantize, quantize_activations
    to_bytes = quantize_activations if cache.dtype is dtypes.q8_0 else quantize
    per = math.prod(cache.shape[1:-1])                          # block rows per cache row
    cache.data[p * per:(p + x.shape[0]) * per] = to_bytes(x, cache.dtype).reshape(-1, cache.data.shape[1])
    return cache


def cache_rows(cache, stop: int) -> np.ndarray:
    """The first ``stop`` rows of a cache as f32."""
    if not isinstance(cache, Blocks):
        return cache[:stop].astype(np.float32, copy=False)
    per = math.prod(cache.shape[1:-1])
    return Blocks(cache.data[:stop * per], cache.dtype, (stop,) + cache.shape[1:]).dequantize()


def _cache_update_impl(cache, x, pos):
    return cache_write(cache, x, int(pos))


cache_update_p = register("cache_update", shape=_cache_update_shape, impl=_cache_update_impl, kind="memory",
                          cost=lambda eqn, dims: (0, 2 * eqn.inputs[1].aval.nbytes(dims)),
                          effects=True, aliases={0: 0})


def _state_write_shape(state, value):
    _require_plain("state_write", state, value)
    if not all(isinstance(d, int) for d in state.shape):
        raise ShapeError(f"state_write: a recurrent state has a static shape, got {state}")
    if value.shape != state.shape or value.dtype is not state.dtype:
        raise ShapeError(f"state_write: the new value {value} must have the state's shape and type {state}")
    return state


def _state_write_impl(state, value):
    state[...] = value
    return state


# a recurrent layer's state carried from step to step: the new value overwrites the state operand
state_write_p = register("state_write", shape=_state_write_shape, impl=_state_write_impl, kind="memory",
                         cost=lambda eqn, dims: (0, 2 * eqn.inputs[0].aval.nbytes(dims)),
                         effects=True, aliases={0: 0})


# ---------------------------------------------------------------------------------------
# routing: top_k, argmax, take_along_axis, segment_sum (a mixture-of-experts router's ops)
# ---------------------------------------------------------------------------------------

def _rank_order(x: np.ndarray) -> np.ndarray:
    """Indices along the last axis from the largest value down: NaN above every number, equal values
    (NaNs among them, and -0.0 with 0.0) in increasing index order."""
    nan = np.isnan(x)                              # lexsort is stable; its last key is the first
    return np.lexsort((np.where(nan, 0, -x), ~nan), axis=-1).astype(np.int32)


def _top_k_shape(x, *, k):
    _require_plain("top_k", x)
    if x.dtype is not f32 or x.ndim == 0:
        raise ShapeError(f"top_k: needs an f32 operand of at least 1 dim, got {x}")
    n = x.shape[-1]
    if not isinstance(n, int):
        raise ShapeError(f"top_k: the last dim of {x} must be static")
    if not isinstance(k, int) or not 1 <= k <= n:
        raise ShapeError(f"top_k: k={k} must be an int in 1..{n} (the last dim of {x})")
    return x.update(shape=x.shape[:-1] + (k,)), Aval(x.shape[:-1] + (k,), i32)


def _top_k_impl(x, *, k):
    idx = _rank_order(x)[..., :k]
    return np.take_along_axis(x, idx, -1), idx


def _scan_cost(eqn, dims):
    """One comparison per element of the operand (a row is read once; top_k's inserts are rare)."""
    return eqn.inputs[0].aval.numel(dims), io_bytes(eqn, dims)


top_k_p = register("top_k", shape=_top_k_shape, impl=_top_k_impl, cost=_scan_cost, multiple_results=True,
                   doc="the k largest values along the last axis and their indices, from the largest down")


def _argmax_shape(x):
    _require_plain("argmax", x)
    if x.dtype is not f32 or x.ndim == 0:
        raise ShapeError(f"argmax: needs an f32 operand of at least 1 dim, got {x}")
    return Aval(x.shape[:-1], i32)


argmax_p = register("argmax", shape=_argmax_shape, cost=_scan_cost,
                    impl=lambda x: np.argmax(x, axis=-1).astype(np.int32),
                    doc="the index of the first maximum along the last axis (of the first NaN, if any)")


def _take_along_axis_shape(x, idx, *, axis):
    _require_plain("take_along_axis", x)
    if x.dtype not in (f32, i32) or idx.dtype is not i32:
        raise ShapeError(f"take_along_axis: x must be f32 or i32 and idx i32, got {x} and {idx}")
    if x.ndim == 0 or x.ndim != idx.ndim or not -x.ndim <= axis < x.ndim:
        raise ShapeError(f"take_along_axis: x {x} and idx {idx} must have one rank (at least 1) and axis {axis} "
                         f"be one of its axes")
    ax = axis % x.ndim
    if any(a != b for i, (a, b) in enumerate(zip(x.shape, idx.shape)) if i != ax):
        raise ShapeError(f"take_along_axis: x {x} and idx {idx} differ off axis {axis}")
    return x.update(shape=idx.shape)


def _take_along_axis_impl(x, idx, *, axis):
    n = x.shape[axis]
    bad = (idx < 0) | (idx >= n)
    if bad.any():
        raise IndexError(f"take_along_axis: index {int(idx[bad].reshape(-1)[0])} is out of range for axis {axis} "
                         f"of length {n}")
    return np.take_along_axis(x, idx, axis)


def _take_along_axis_cost(eqn, dims):
    """The indices, one element of x per output element, and the output."""
    idx, out = eqn.inputs[1].aval, eqn.outputs[0].aval
    return 0, idx.nbytes(dims) + 2 * out.nbytes(dims)


take_along_axis_p = register("take_along_axis", shape=_take_along_axis_shape, impl=_take_along_axis_impl,
                             cost=_take_along_axis_cost, kind="memory",
                             doc="numpy's take_along_axis: out[..., j, ...] = x[..., idx[..., j, ...], ...]")


def _segment_sum_shape(values, ids, *, num_segments):
    _require_plain("segment_sum", values)
    if values.dtype is not f32 or values.ndim == 0:
        raise ShapeError(f"segment_sum: values must be f32 [M, ...], got {values}")
    if ids.dtype is not i32 or ids.shape != values.shape[:1]:
        raise ShapeError(f"segment_sum: segment ids must be i32[{values.shape[0]}], one per row of {values}, "
                         f"got {ids}")
    if isinstance(num_segments, int) and num_segments < 1:
        raise ShapeError(f"segment_sum: num_segments must be at least 1, got {num_segments}")
    return values.update(shape=(num_segments,) + values.shape[1:])


def _segment_sum_impl(values, ids, *, num_segments):
    bad = (ids < 0) | (ids >= num_segments)
    if bad.any():
        raise IndexError(f"segment_sum: segment id {int(ids[bad][0])} is out of range for {num_segments} "
                         f"segments")
    out = np.zeros((num_segments,) + values.shape[1:], values.dtype)
    np.add.at(out, ids, values)                  # unbuffered, in increasing row order: f32 sums as llvm's
    return out


segment_sum_p = register("segment_sum", shape=_segment_sum_shape, impl=_segment_sum_impl, cost=_scan_cost,
                         doc="out[s] = the sum of values[m] over the rows m with ids[m] = s, in increasing m")


# ---------------------------------------------------------------------------------------
# the functions models call
# ---------------------------------------------------------------------------------------

def add(x, y): return bind(add_p, x, y)
def sub(x, y): return bind(sub_p, x, y)
def mul(x, y): return bind(mul_p, x, y)
def div(x, y): return bind(div_p, x, y)
def maximum(x, y): return bind(max_p, x, y)
def less(x, y): return bind(less_p, x, y)
def greater(x, y): return bind(greater_p, x, y)
def less_equal(x, y): return bind(less_equal_p, x, y)
def greater_equal(x, y): return bind(greater_equal_p, x, y)
def equal(x, y): return bind(equal_p, x, y)
def not_equal(x, y): return bind(not_equal_p, x, y)
def neg(x): return bind(neg_p, x)
def exp(x): return bind(exp_p, x)
def log(x): return bind(log_p, x)
def sqrt(x): return bind(sqrt_p, x)
def rsqrt(x): return bind(rsqrt_p, x)
def tanh(x): return bind(tanh_p, x)
def sin(x): return bind(sin_p, x)
def cos(x): return bind(cos_p, x)
def fma(a, b, c): return bind(fma_p, a, b, c)                    # a·b + c, rounded once
def reduce_sum(x): return bind(reduce_sum_p, x)
def reduce_mean(x): return bind(reduce_mean_p, x)
def reduce_max(x): return bind(reduce_max_p, x)
def dequant(w): return bind(dequant_p, w)
def cache_update(cache, x, pos): return bind(cache_update_p, cache, x, pos)
def state_write(state, value): return bind(state_write_p, state, value)


def where(cond, x, y):
    """x where cond (an i8 mask) is nonzero, else y; a constant takes the other branch's dtype, and two
    constants their own (a Python float is f32, an int i32), never the mask's."""
    like = x if isinstance(x, Tracer) else y
    if isinstance(like, Tracer):
        like = like.aval
    elif any(isinstance(a, float) for a in (x, y)):
        like = Aval((), f32)                                 # where(m, 0, 1.5): both f32
    else:
        like = None
    x, y = (Tracer(to_atom(a, like)) for a in (x, y))
    return bind(where_p, cond, x, y)


def cast(x, dtype):
    return bind(cast_p, x, dtype=dtypes.from_name(dtype).name)


def reshape(x, shape):
    return bind(reshape_p, x, shape=tuple(as_dim(d) for d in shape))


def transpose(x, perm):
    return bind(transpose_p, x, perm=tuple(int(p) for p in perm))


def broadcast_to(x, shape):
    return bind(broadcast_p, x, shape=tuple(as_dim(d) for d in shape))


def slice(x, axis: int, start, stop):
    """Rows ``start:stop`` along ``axis``; start/stop may be symbolic (e.g. ``P+T``)."""
    return bind(slice_p, x, axis=axis, start=as_dim(start), stop=as_dim(stop))


def concat(xs, axis: int = -1):
    return bind(concat_p, *xs, axis=axis)


def iota(n, dtype=i32):
    return bind(iota_p, n=as_dim(n), dtype=dtypes.from_name(dtype).name)


def take(table, ids):
    """Entries of ``table`` [V, ...] at ``ids`` i32[...] -> f32[..., ...]: the rows of an embedding, or the
    matrices of chosen experts from [E, N, K]. A quantised table is dequantised first (and fusion then
    reads only the chosen entries' blocks)."""
    if isinstance(table, Tracer) and table.dtype is not f32:
        table = dequant(table)
    return bind(take_p, table, ids)


def matmul(a, b):
    """``a · bᵀ`` over the last axes: a[..., M, K], b[..., N, K] -> [..., M, N] (ggml's mul_mat)."""
    return bind(matmul_p, a, b)


def top_k(x, k: int):
    """The ``k`` largest values of f32 ``x`` along the last axis and their indices, from the largest down:
    ``(values f32[..., k], indices i32[..., k])``.

    Ties: equal values come in increasing index order. That is llama.cpp's order for its routers
    (``ggml_argsort_top_k``: a descending ``std::sort`` of the indices, which libstdc++ does by insertion,
    a stable sort, for rows of up to 16; on longer rows std::sort leaves the order of exact ties
    unspecified, and ggraph keeps the stable one). NaN counts as larger than every number (as numpy's
    argmax has it), so ``top_k(x, 1)`` picks ``argmax(x)``."""
    return bind(top_k_p, x, k=int(k))


def argmax(x):
    """The index (i32) of the largest value of f32 ``x`` along the last axis, which is dropped: the first
    of equal maxima, and the first NaN if there is one, as numpy's ``argmax`` and llama.cpp's greedy
    sampler pick. (ggml's own ``ggml_argmax`` keeps the last of equal maxima.)"""
    return bind(argmax_p, x)


def take_along_axis(x, idx, axis: int):
    """numpy's ``take_along_axis``: x (f32 or i32) and idx (i32) of one rank, equal off ``axis``; out has
    idx's shape and ``out[..., j, ...] = x[..., idx[..., j, ...], ...]``. An index outside
    ``0..x.shape[axis]-1`` is an error (negative indices do not wrap). E.g. the router's probabilities of
    the chosen experts: ``take_along_axis(probs, top_k(logits, k)[1], -1)``."""
    return bind(take_along_axis_p, x, idx, axis=int(axis))


def segment_sum(values, segment_ids, num_segments):
    """Rows of ``values`` [M, ...] summed by segment: ``out[s] = sum(values[m] for m with segment_ids[m] == s)``,
    out [num_segments, ...], zero for a segment no row names. Sums run in increasing row order, so every
    backend rounds alike; num_segments may be symbolic (``"T"``, for expert outputs combined per token)."""
    return bind(segment_sum_p, values, segment_ids, num_segments=as_dim(num_segments))

