"""LLVM lowering rules, one per op (or family), registered in codegen.LOWERINGS.

A rule looks up where its operands live, gets or aliases memory for its outputs, and
appends kernel calls. Views (reshape, leading-axis slices) emit no call.
"""
from __future__ import annotations

import numpy as np

from ggraph.core import DimAval, Literal, Sym, Var
from ggraph.backends.llvm import kernels as K
from ggraph.backends.llvm.kernels import attention as A
from ggraph.backends.llvm.kernels import elementwise as E
from ggraph.backends.llvm.kernels import generic_ops as G
from ggraph.backends.llvm.codegen import Bytes, LoweringError, Ref, lowering, rows
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
        xq = lw.scratch(Bytes("act", (fmt, R, Kdim)), f"xq_{fmt}")
        lw.call(K.act_quant(lw.module, fmt, Kdim, lw.target), lw.ref(x), xq, R, writes=(xq,))
        lw.memo(("act_quant", x, fmt), xq)
    lw.call(K.qmatmul(lw.module, dt, Kdim, N, lw.target), lw.ref(w), xq, out, R, writes=(out,))


# -- fused loops and single elementwise ops ----------------------------------------------------

def _body_of(e):
    """A fused eqn carries its body; a lone elementwise op or reduction becomes a one-eqn body."""
    if e.body is not None:
        return e.body
    from ggraph.core import Eqn, Graph, Var
    ins = [Var(a.aval) for a in e.inputs if not isinstance(a, Literal)]
    it = iter(ins)
    operands = [a if isinstance(a, Literal) else next(it) for a in e.inputs]
    outs = [Var(o.aval) for o in e.outputs]
    return Graph(ins, (), [Eqn(e.prim, operands, outs, e.params, e.scope)], outs, name=e.prim.name)


@lowering("fused", "add", "sub", "mul", "div", "max", "neg", "exp", "log", "sqrt", "rsqrt", "tanh",
          "sin", "cos", "cast", "less", "where")
def _fused(lw, e):
    if e.body is None and _needs_nd(e.outputs[0].aval):
        return _elementwise_nd(lw, e)
    body = _body_of(e)
    operands = [a for a in e.inputs if not isinstance(a, Literal)] if e.body is None else list(e.inputs)
    in_avals = [a.aval for a in operands]
    out_avals = [o.aval for o in e.outputs]
    name = E.fused_name(body, in_avals, out_avals, lw.target)
    E.emit_fused(lw.module, lw.target, body, in_avals, out_avals, name)
    outs = [lw.output(o) for o in e.outputs]
    lw.call(name, *[lw.ref(a) for a in operands], *outs, E.fused_rows(body), writes=outs)


def _needs_nd(aval) -> bool:
    """More than one runtime dim, or a runtime row length: beyond the fused loops' iteration space."""
    symbolic = [d for d in aval.shape if isinstance(d, Sym)]
    return len(symbolic) > 1 or (bool(aval.shape) and isinstance(aval.shape[-1], Sym))


_KINDS = {"f32": "f32", "i32": "i32", "i8": "i8"}


def _elementwise_nd(lw, e):
    """One elementwise op over operands broadcast to a shape with several runtime dims."""
    out_aval = e.outputs[0].aval
    if out_aval.ndim > G.RANK:
        raise LoweringError(f"llvm backend: {e.prim.name} on rank {out_aval.ndim} > {G.RANK}")
    kinds = tuple(_KINDS[a.aval.dtype.name] for a in e.inputs)
    name = G.elementwise_nd(lw.module, e.prim.name, kinds, _KINDS[out_aval.dtype.name])
    out = lw.output(e.outputs[0])
    pad = lambda shape: (1,) * (G.RANK - len(shape)) + tuple(shape)                 # noqa: E731
    dims = [d for a in e.inputs for d in pad(a.aval.shape)]
    lw.call(name, *[lw.ref(a) for a in e.inputs], out, *pad(out_aval.shape), *dims, writes=(out,))


@lowering("reduce_sum", "reduce_max")
def _reduce(lw, e):
    x = e.inputs[0]
    n = x.aval.shape[-1]
    if isinstance(n, int):
        return _fused(lw, e)
    out = lw.output(e.outputs[0])                              # a runtime row length: plain loop
    lw.call(G.reduce_rows(lw.module, e.prim.name), lw.ref(x), out, rows(x.aval), n, writes=(out,))


# -- data movement ----------------------------------------------------------------------------

def _symbols(*avals) -> list:
    """The i64 size arguments of a copy kernel: each symbol in the shapes, sorted by name."""
    names = sorted({s for a in avals for s in a.symbols})
    return [Sym(n) for n in names]


def _copy_name(kind: str, e, *parts) -> str:
    import hashlib
    key = "|".join([kind, str(e.inputs[0].aval)] + [str(p) for p in parts])
    return f"{kind}_{hashlib.sha256(key.encode()).hexdigest()[:12]}_{len(parts)}"


def _lower_copy(lw, e):
    """Ops that move data into a new layout: one copy kernel each."""
    x = e.inputs[0]
    out = lw.output(e.outputs[0])
    p = e.params
    if e.prim.name == "transpose":
        name = _copy_name("transpose", e, p["perm"], lw.target.name)
        E.emit_transpose(lw.module, lw.target, x.aval, p["perm"], name)
        avals = (x.aval,)
    elif e.prim.name == "slice":
        name = _copy_name("slice", e, p["axis"], p["start"], p["stop"], lw.target.name)
        E.emit_slice(lw.module, lw.target, x.aval, p["axis"], p["start"], p["stop"], name)
        avals = (x.aval, e.outputs[0].aval)
    elif e.prim.name == "broadcast":
        name = _copy_name("broadcast", e, p["shape"], lw.target.name)
        E.emit_broadcast(lw.module, lw.target, x.aval, p["shape"], name)
        avals = (x.aval, e.outputs[0].aval)
    else:
        raise LoweringError(f"llvm backend: no copy kernel for {e.prim.name}")
    lw.call(name, lw.ref(x), out, *_symbols(*avals), writes=(out,))


lowering("transpose", "broadcast")(_lower_copy)


@lowering("concat")
def _concat(lw, e):
    out = lw.output(e.outputs[0])
    avals = [a.aval for a in e.inputs]
    name = _copy_name("concat", e, *avals, e.params["axis"], lw.target.name)
    E.emit_concat(lw.module, lw.target, avals, e.params["axis"], name)
    lw.call(name, *[lw.ref(a) for a in e.inputs], out, *_symbols(*avals, e.outputs[0].aval), writes=(out,))


@lowering("cache_update")
def _cache_update(lw, e):
    """Write the new rows into the cache at row P, in place: the output is the cache."""
    cache, x, pos = e.inputs
    row_bytes = 4
    for d in cache.aval.shape[1:]:
        row_bytes *= d
    if not isinstance(pos, Var) or not isinstance(pos.aval, DimAval):
        raise LoweringError("llvm backend: cache_update needs the position to be a dim input such as P")
    dst = lw.ref(cache)
    at = Ref(dst.buf, Sym(pos.aval.symbol) * row_bytes if dst.offset == 0 else dst.offset + Sym(pos.aval.symbol) * row_bytes)
    lw.call(G.copy_bytes(lw.module), lw.ref(x), at, x.aval.shape[0] * row_bytes, writes=(at,))
    lw.alias(e.outputs[0], dst)


@lowering("iota")
def _iota(lw, e):
    out = lw.output(e.outputs[0])
    lw.call(G.iota(lw.module, e.params.get("dtype", "i32")), out, e.params["n"], writes=(out,))


@lowering("dequant")
def _dequant(lw, e):
    """The unfused baseline's explicit dequant: the whole weight through the gather kernel."""
    w = e.inputs[0]
    if w.aval.ndim != 2:
        raise LoweringError(f"llvm backend: dequant of {w.aval} (only 2-D weights)")
    N, D = w.aval.shape
    ids = lw.ref(Literal(np.arange(N, dtype=np.int32)))
    out = lw.output(e.outputs[0])
    lw.call(K.get_rows(lw.module, w.aval.dtype, D, N, lw.target), lw.ref(w), ids, out, N, writes=(out,))


@lowering("matmul")
def _matmul(lw, e):
    """The unfused baseline's f32 matmul, batched, contracting the last axes."""
    a, b = e.inputs
    M, Kd = a.aval.shape[-2], a.aval.shape[-1]
    N = b.aval.shape[-2]
    y = e.outputs[0].aval
    batch = _dims_product(y.shape[:-2])
    a_batch = 0 if _dims_product(a.aval.shape[:-2]) == 1 else 1
    b_batch = 0 if _dims_product(b.aval.shape[:-2]) == 1 else 1
    out = lw.output(e.outputs[0])
    lw.call(G.matmul_f32(lw.module), lw.ref(a), lw.ref(b), out, batch, M, N, Kd, a_batch, b_batch, writes=(out,))


def _dims_product(dims):
    out = 1
    for d in dims:
        out = d * out if isinstance(d, Sym) else out * d
    return out


# -- attention ----------------------------------------------------------------------------------

@lowering("rope_attention")
def _rope_attention(lw, e):
    """Two kernels: rope k and store k, v at rows P.. of the caches; then attend (rope q inside)."""
    attn, rope = A.from_rope_attention(e)
    q, k, v, kc, vc, pos, positions = e.inputs[:7]
    if not isinstance(pos, Var) or not isinstance(pos.aval, DimAval) or pos.aval.symbol != "P":
        raise LoweringError("llvm backend: rope_attention needs the past length as the dim input P")
    refs = {"q": lw.ref(q), "k": lw.ref(k), "v": lw.ref(v), "k_cache": lw.ref(kc), "v_cache": lw.ref(vc),
            "positions": lw.ref(positions), "T": q.aval.shape[0], "P": Sym("P")}
    if len(e.inputs) > 7:
        refs["freq_factors"] = lw.ref(e.inputs[7])
    out = lw.output(e.outputs[0])
    refs["out"] = out
    (store, store_args), (attend, attend_args) = A.attention_kernels(lw.module, lw.target, attn, rope)
    lw.call(store.name, *[refs[a] for a in store_args], writes=(refs["k_cache"], refs["v_cache"]))
    lw.call(attend.name, *[refs[a] for a in attend_args], writes=(out,))
    lw.alias(e.outputs[1], refs["k_cache"])
    lw.alias(e.outputs[2], refs["v_cache"])
