"""Copy kernels for the shape ops that move data: transpose, slice, concat, broadcast.

    emit_transpose / emit_slice / emit_concat / emit_broadcast(module, target, ...) -> name
        void name(ptr x0, ..., ptr y, i64 <symbol>..., i32 ith, i32 nth)

Every one is a strided copy of rows, threads splitting the rows; a row is a memcpy where it is
contiguous in both arrays. Any dim may be symbolic; a kernel takes the value of every symbol its
shapes mention as i64 arguments, in sorted name order. The pointers are ``noalias``: outputs must
not overlap inputs.
"""
from __future__ import annotations

from typing import Sequence

from llvmlite import ir

from ggraph.ir.dims import Sym
from ggraph.ir.dtypes import Aval
from ggraph.ir.prims import broadcast_shapes
from ggraph.backends.llvm.kernels.builder import Kernel, i8, i16, i32
from ggraph.backends.llvm.kernels.elementwise import ir_dim, kernel_name
from ggraph.backends.llvm.kernels.isa import Isa
from ggraph.backends.llvm.target import Target

_INT_OF = {1: i8, 2: i16, 4: i32}


def _symbols(*dim_lists) -> tuple[str, ...]:
    return tuple(sorted({n for dims in dim_lists for d in dims if isinstance(d, Sym) for n in d.names}))


def _plain(aval: Aval, op: str) -> int:
    if aval.dtype.is_quantized or aval.dtype.type_size not in _INT_OF:
        raise ValueError(f"{op}: cannot move elements of {aval} ({aval.dtype})")
    return aval.dtype.type_size


def _strides(k: Kernel, dims) -> list:
    """Contiguous element strides of a shape (ints or IR)."""
    out, s = [], 1
    for d in reversed(dims):
        out.append(s)
        s = k.mul(s, d)
    return out[::-1]


def _copy_kernel(module, name: str, srcs: tuple[str, ...], syms: tuple[str, ...]) -> Kernel:
    return Kernel(module, name, srcs + ("y",), syms)


def _strided_copy(k: Kernel, isa: Isa, esize: int, shape: list, src, s_strides: list, s_off,
                  dst, d_strides: list, d_off) -> None:
    """dst[d_off + idx·d_strides] = src[s_off + idx·s_strides] over `shape`; threads split rows.

    The last axis is contiguous in dst; it is a memcpy when contiguous in src too, else a loop.
    """
    b = k.b
    elem = _INT_OF[esize]
    shape = list(shape) or [1]
    s_strides, d_strides = list(s_strides) or [1], list(d_strides) or [1]
    rows = 1
    for d in shape[:-1]:
        rows = k.mul(rows, d)
    n = shape[-1]
    start, end = k.thread_share(rows)
    with k.loop(start, end, name="r") as r:
        s, d, rest = s_off, d_off, r
        for j in range(len(shape) - 2, -1, -1):
            i = b.urem(rest, k.i64(shape[j])) if j else rest
            rest = b.udiv(rest, k.i64(shape[j])) if j else rest
            s, d = k.add(s, k.mul(i, s_strides[j])), k.add(d, k.mul(i, d_strides[j]))
        src_row, dst_row = k.addr(src, k.mul(s, esize)), k.addr(dst, k.mul(d, esize))
        step = s_strides[-1]
        if isinstance(step, int) and step == 1:
            k.intrinsic("llvm.memcpy.p0.p0.i64", ir.VoidType(),
                        [dst_row, src_row, k.i64(k.mul(n, esize)), ir.Constant(ir.IntType(1), 0)])
        elif isinstance(step, int) and step == 0:
            v = k.load(elem, src_row)
            with k.loop(0, n, name="fill") as j:
                k.store(v, dst_row, k.mul(j, esize))
        else:
            with k.loop(0, n, name="gather") as j:
                k.store(k.load(elem, src_row, k.mul(k.mul(j, step), esize)), dst_row, k.mul(j, esize))


def emit_transpose(module: ir.Module, target: Target, aval: Aval, perm, name: str | None = None) -> str:
    """y = x.transpose(perm): void name(ptr x, ptr y, i64 <symbols of aval>..., ith, nth)."""
    name = name or kernel_name("transpose", target, str(aval), tuple(perm))
    if Kernel.exists(module, name):
        return name
    perm = tuple(int(p) for p in perm)
    if sorted(perm) != list(range(aval.ndim)):
        raise ValueError(f"transpose: perm {perm} is not a permutation of the {aval.ndim} axes of {aval}")
    esize = _plain(aval, "transpose")
    k = _copy_kernel(module, name, ("x",), _symbols(aval.shape))
    dims = [ir_dim(k, d) for d in aval.shape]
    strides = _strides(k, dims)
    out = [dims[p] for p in perm]
    _strided_copy(k, Isa(k, target), esize, out, k.arg["x"], [strides[p] for p in perm], 0,
                  k.arg["y"], _strides(k, out), 0)
    return k.finish()


def emit_slice(module: ir.Module, target: Target, aval: Aval, axis: int, start, stop, name: str | None = None) -> str:
    """y = x[..., start:stop, ...] along `axis` (start/stop may be symbolic):
    void name(ptr x, ptr y, i64 <symbols>..., ith, nth)."""
    name = name or kernel_name("slice", target, str(aval), axis, str(start), str(stop))
    if Kernel.exists(module, name):
        return name
    if not -aval.ndim <= axis < aval.ndim:
        raise ValueError(f"slice: axis {axis} out of range for {aval}")
    axis %= aval.ndim
    esize = _plain(aval, "slice")
    k = _copy_kernel(module, name, ("x",), _symbols(aval.shape, (start, stop)))
    dims = [ir_dim(k, d) for d in aval.shape]
    strides = _strides(k, dims)
    lo, hi = ir_dim(k, start), ir_dim(k, stop)
    out = dims[:axis] + [hi - lo if isinstance(hi, int) and isinstance(lo, int) else k.b.sub(k.i64(hi), k.i64(lo))] \
        + dims[axis + 1:]
    _strided_copy(k, Isa(k, target), esize, out, k.arg["x"], strides, k.mul(lo, strides[axis]),
                  k.arg["y"], _strides(k, out), 0)
    return k.finish()


def emit_concat(module: ir.Module, target: Target, avals: Sequence[Aval], axis: int, name: str | None = None) -> str:
    """y = concatenate(xs, axis): void name(ptr x0, ..., ptr y, i64 <symbols>..., ith, nth)."""
    name = name or kernel_name("concat", target, tuple(map(str, avals)), axis)
    if Kernel.exists(module, name):
        return name
    if not avals:
        raise ValueError("concat: needs at least one operand")
    nd = avals[0].ndim
    if not -nd <= axis < nd:
        raise ValueError(f"concat: axis {axis} out of range for {avals[0]}")
    axis %= nd
    for a in avals:
        if a.ndim != nd or a.dtype is not avals[0].dtype or \
                any(x != y for j, (x, y) in enumerate(zip(a.shape, avals[0].shape)) if j != axis):
            raise ValueError(f"concat on axis {axis}: operands {', '.join(map(str, avals))} disagree off the axis")
    esize = _plain(avals[0], "concat")
    k = _copy_kernel(module, name, tuple(f"x{i}" for i in range(len(avals))), _symbols(*[a.shape for a in avals]))
    isa = Isa(k, target)
    shapes = [[ir_dim(k, d) for d in a.shape] for a in avals]
    total = 0
    for s in shapes:
        total = k.add(total, s[axis]) if not (isinstance(total, int) and isinstance(s[axis], int)) \
            else total + s[axis]
    out = shapes[0][:axis] + [total] + shapes[0][axis + 1:]
    out_strides = _strides(k, out)
    offset = 0
    for i, s in enumerate(shapes):
        _strided_copy(k, isa, esize, s, k.arg[f"x{i}"], _strides(k, s), 0,
                      k.arg["y"], out_strides, k.mul(offset, out_strides[axis]))
        offset = offset + s[axis] if isinstance(offset, int) and isinstance(s[axis], int) \
            else k.add(offset, s[axis])
    return k.finish()


def emit_broadcast(module: ir.Module, target: Target, aval: Aval, shape, name: str | None = None) -> str:
    """y = broadcast_to(x, shape), numpy rules: void name(ptr x, ptr y, i64 <symbols>..., ith, nth)."""
    name = name or kernel_name("broadcast", target, str(aval), tuple(map(str, shape)))
    if Kernel.exists(module, name):
        return name
    shape = tuple(Aval(shape, aval.dtype).shape)
    if broadcast_shapes("broadcast", aval.shape, shape) != shape:
        raise ValueError(f"broadcast: {aval} cannot broadcast to [{','.join(map(str, shape))}]")
    esize = _plain(aval, "broadcast")
    k = _copy_kernel(module, name, ("x",), _symbols(aval.shape, shape))
    own = (1,) * (len(shape) - aval.ndim) + aval.shape
    dims = [ir_dim(k, d) for d in own]
    strides = [0 if o == 1 and t != 1 else s for o, t, s in zip(own, shape, _strides(k, dims))]
    out = [ir_dim(k, d) for d in shape]
    _strided_copy(k, Isa(k, target), esize, out, k.arg["x"], strides, 0, k.arg["y"], _strides(k, out), 0)
    return k.finish()
