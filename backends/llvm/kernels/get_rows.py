"""Embedding gather with dequantisation: out[t] = table[ids[t]] * scale; and plain dequantisation
of contiguous rows (dequant_rows).

    get_rows_<dtype>_k<K>_v<V>_<target>(table: ptr u8 [V, row_bytes], ids: ptr i32 [T],
                                        out: ptr f32 [T, K], status: ptr i64 [2], T, ith, nth)

V (the row count) is baked in (or, for V=None, passed before T, e.g. a gather from this step's
activations) so that an id outside [0, V) is caught: the table is never
read out of bounds, that row of `out` is zeroed, and the kernel stores {1, id} in
`status`, which the caller checks after the run and turns into an error naming the op.
`scale` (e.g. gemma's sqrt(dim)) is an optional constant multiplied into every value;
without it, values equal gguf-py's dequantisation bit for bit. Threads split tokens.
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i32, vec
from ggraph.backends.llvm.kernels.fmatmul import FLOAT_LOADERS
from ggraph.backends.llvm.kernels.isa import Isa, vector_path
from ggraph.backends.llvm.kernels.plan import FORMATS
from ggraph.backends.llvm.target import Target


def get_rows(module: ir.Module, dtype, K: int, V: int | None, target: Target, scale: float | None = None) -> str:
    """Emit (once) the gather of rows of a (V, K) table of `dtype` (V=None: a runtime argument V
    before T); returns the kernel name."""
    dt = dtypes.from_name(dtype)
    if dt not in FORMATS and dt not in FLOAT_LOADERS:
        raise ValueError(f"get_rows: no kernel for table type {dt.name}")
    row_bytes = dt.row_bytes(K)
    tag = "" if scale is None else "_s" + f"{scale:.9g}".replace(".", "p").replace("-", "m")
    name = f"get_rows_{dt.name}_k{K}_v{'n' if V is None else V}{tag}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("table", "ids", "out", "status"), ("T",) if V is not None else ("V", "T"))
    isa = Isa(k, target)
    b = k.b
    start, end = k.thread_share(k.arg["T"])
    with k.loop(start, end, name="t") as t:
        row_id = b.sext(k.load(i32, k.arg["ids"], k.mul(t, 4)), ir.IntType(64))
        out = k.addr(k.arg["out"], k.mul(t, 4 * K))
        rows = k.i64(V) if V is not None else k.arg["V"]
        ok = b.and_(b.icmp_signed(">=", row_id, k.i64(0)), b.icmp_signed("<", row_id, rows))
        with b.if_else(ok) as (good, bad):
            with good:
                row = k.addr(k.arg["table"], k.mul(row_id, row_bytes))
                emit = _quant_row if dt in FORMATS else _float_row
                emit(k, isa, dt, K, row, out, scale, vector_path(target))
            with bad:
                k.store(ir.Constant(ir.IntType(64), 1), k.arg["status"])
                k.store(row_id, k.arg["status"], 8)
                with k.loop(0, K, name="zero") as i:
                    k.store(ir.Constant(f32, 0.0), out, k.mul(i, 4))
    return k.finish()


def dequant_rows(module: ir.Module, dtype, K: int, target: Target) -> str:
    """Emit (once) out[r] = dequant(src[r]) for T contiguous rows of K values; returns the kernel name."""
    dt = dtypes.from_name(dtype)
    if dt not in FORMATS and dt not in FLOAT_LOADERS:
        raise ValueError(f"dequant: no kernel for type {dt.name}")
    name = f"dequant_rows_{dt.name}_k{K}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("src", "out"))
    isa = Isa(k, target)
    start, end = k.thread_share(k.arg["T"])
    with k.loop(start, end, name="r") as r:
        emit = _quant_row if dt in FORMATS else _float_row
        emit(k, isa, dt, K, k.addr(k.arg["src"], k.mul(r, dt.row_bytes(K))), k.addr(k.arg["out"], k.mul(r, 4 * K)),
             None, vector_path(target))
    return k.finish()


def _scaled(k: Kernel, v: ir.Value, scale: float | None) -> ir.Value:
    if scale is None:
        return v
    c = ir.Constant(f32, scale)
    return k.b.fmul(v, k.splat(c, v.type.count) if isinstance(v.type, ir.VectorType) else c)


def _float_row(k: Kernel, isa: Isa, dt, K: int, row, out, scale, vector: bool) -> None:
    """Convert K float elements; vector steps, then a scalar tail."""
    size, convert = FLOAT_LOADERS[dt]
    lanes = isa.vector_bytes // 4 if vector else 1
    main = K - K % lanes

    def step(kk, n):
        elem = f32 if dt is dtypes.f32 else ir.IntType(16)
        raw = k.load(elem if n == 1 else vec(elem, n), row, k.mul(kk, size))
        v = raw if convert is None else convert(isa, raw)
        k.store(_scaled(k, v, scale), out, k.mul(kk, 4))
    with k.loop(0, main, step=lanes, name="k") as kk:
        step(kk, lanes)
    if main < K:
        with k.loop(main, K, name="kt") as kk:
            step(kk, 1)


def _quant_row(k: Kernel, isa: Isa, dt, K: int, row, out, scale, vector: bool) -> None:
    """Dequantise K weights block by block: w = scale[s] * q - min[s]."""
    fmt = FORMATS[dt]
    with k.loop(0, K // dt.block_size, name="blk") as blk:
        blk_ptr = k.addr(row, k.mul(blk, dt.type_size))
        emit = _quant_block_vector if vector else _quant_block_scalar
        emit(k, isa, fmt, blk_ptr, out, k.mul(blk, dt.block_size), scale)


def _quant_block_scalar(k: Kernel, isa: Isa, fmt, blk_ptr, out, first, scale) -> None:
    """One block, one weight at a time: the spec."""
    b = k.b
    with k.loop(0, fmt.dtype.block_size, name="i") as i:
        sc, mn = fmt.scale(k, isa, blk_ptr, b.udiv(i, k.i64(fmt.sub)))
        w = b.fmul(sc, b.sitofp(fmt.level(k, isa, blk_ptr, i), f32))
        w = w if mn is None else b.fsub(w, mn)
        k.store(_scaled(k, w, scale), out, k.mul(k.add(first, i), 4))


def _quant_block_vector(k: Kernel, isa: Isa, fmt, blk_ptr, out, first, scale) -> None:
    """One block, 32 weights per step."""
    b = k.b
    dec = fmt.decode(k, isa, blk_ptr)
    v32 = vec(f32, 32)
    for c in range(fmt.chunks):
        bytes_ = dec.chunk(c)
        wide = b.sext(bytes_, vec(i32, 32)) if dec.signed else b.zext(bytes_, vec(i32, 32))
        if dec.offset:
            wide = b.sub(wide, ir.Constant(vec(i32, 32), [dec.offset] * 32))
        lanes = [(32 * c + j) // fmt.sub for j in range(32)]             # each weight's sub-block
        w = b.fmul(k.shuffle(dec.scales, lanes), b.sitofp(wide, v32))
        if dec.mins is not None:
            w = b.fsub(w, k.shuffle(dec.mins, lanes))
        k.store(_scaled(k, w, scale), out, k.mul(k.add(first, 32 * c), 4))

