"""LLVM lowering rules, one per op (or family), registered in codegen.LOWERINGS.

A rule looks up where its operands live, gets or aliases memory for its outputs, and
appends kernel calls. Views (reshape, leading-axis slices) emit no call.
"""
from __future__ import annotations

from ggraph.core import Sym
from ggraph.backends.llvm import kernels as K
from ggraph.backends.llvm.codegen import LoweringError, Ref, eval_size, lowering, rows
from ggraph.passes.plan_memory import leading_slice


def _offset(r: Ref, extra) -> Ref:
    if extra == 0:
        return r
    if r.offset == 0:
        return Ref(r.buf, extra)
    return Ref(r.buf, r.offset + extra)


@lowering("reshape")
def _reshape(lw, e):
    lw.alias(e.outputs[0], lw.ref(e.inputs[0]))            # row-major data: a reshape is a view


@lowering("slice")
def _slice(lw, e):
    x, out = e.inputs[0], e.outputs[0]
    axis = e.params["axis"] % x.aval.ndim
    if not leading_slice(e):
        return _lower_copy(lw, e)
    inner = 1
    for d in x.aval.shape[axis + 1:]:
        inner = d * inner if isinstance(d, Sym) else inner * d
    start = e.params["start"]
    step_bytes = inner * 4 if not isinstance(inner, Sym) else inner * 4
    lw.alias(out, _offset(lw.ref(x), start * step_bytes if start != 0 else 0))


def _lower_copy(lw, e):
    raise LoweringError(f"llvm backend: {e.prim.name} on {e.inputs[0].aval} needs a copy kernel, "
                        f"which is not written yet")


@lowering("take")
def _take(lw, e):
    table, ids = e.inputs
    V, D = table.aval.shape
    out = lw.output(e.outputs[0])
    name = K.get_rows(lw.module, table.aval.dtype, D, V, lw.target)
    lw.call(name, lw.ref(table), lw.ref(ids), out, rows(e.outputs[0].aval), writes=(out,))


@lowering("qmatmul")
def _qmatmul(lw, e):
    """Float weights: one fmatmul. Block weights: quantise x once per format, then qmatmul."""
    x, w = e.inputs
    N, Kdim = w.aval.shape
    R = rows(x.aval)
    out = lw.output(e.outputs[0])
    dt = w.aval.dtype
    if K.float_weight(dt):
        name = K.fmatmul(lw.module, dt, Kdim, N, lw.target)
        lw.call(name, lw.ref(w), lw.ref(x), out, R, writes=(out,))
        return
    fmt = K.act_format(dt)
    xq = lw.memo(("act_quant", x, fmt))
    if xq is None:
        xq = lw.scratch(lambda dims, R=R: K.act_bytes(fmt, eval_size(R, dims), Kdim), f"xq_{fmt}")
        lw.call(K.act_quant(lw.module, fmt, Kdim, lw.target), lw.ref(x), xq, R, writes=(xq,))
        lw.memo(("act_quant", x, fmt), xq)
    lw.call(K.qmatmul(lw.module, dt, Kdim, N, lw.target), lw.ref(w), xq, out, R, writes=(out,))
