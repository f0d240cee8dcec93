"""How the attention kernels read and write one row of a KV cache of each cache type.

    f32    4 bytes per value
    f16    IEEE half, round to nearest even on write
    bf16   the top half of the f32, round to nearest even on write (NaNs stay quiet NaNs)
    q8_0   blocks of 32: f16 d = amax/127, int8 q = round_even(x * 127/amax)
           (ggml's x86 quantize_row_q8_0, which llama.cpp's CPU backend uses for its cache)
    q4_0   blocks of 32: f16 d = max/-8 (max: the first value of largest magnitude),
           q = min(15, trunc(x/d + 8.5)); element j in the low nibble of byte j, j+16 in
           its high nibble (quantize_row_q4_0_ref)

A row is written once (per new token, per kv head) and read at every later step, so
writes are simple scalar loops and reads are vectors: ``load(row, e, w)`` gives the w
values from element e as f32 (w = 1 is a scalar; for block types w divides 32 and e is
a multiple of w, so a vector never crosses a block).
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i8, i16, i32, vec
from ggraph.backends.llvm.kernels.isa import Isa

CACHE_TYPES = (dtypes.f32, dtypes.f16, dtypes.bf16, dtypes.q8_0, dtypes.q4_0)


def check_cache_type(dtype) -> dtypes.DType:
    dt = dtypes.from_name(dtype)
    if dt not in CACHE_TYPES:
        raise ValueError(f"attention: no kernel reads a {dt.name} KV cache; cache types: "
                         f"{', '.join(t.name for t in CACHE_TYPES)}")
    return dt


def _typ(elem: ir.Type, w: int) -> ir.Type:
    return elem if w == 1 else vec(elem, w)


def _c(elem: ir.Type, w: int, value) -> ir.Constant:
    return ir.Constant(elem, value) if w == 1 else ir.Constant(vec(elem, w), [value] * w)


class KVRow:
    """Rows of ``n`` values of cache type ``dtype`` inside kernel ``k``."""

    def __init__(self, k: Kernel, isa: Isa, dtype, n: int):
        self.k, self.b, self.isa = k, k.b, isa
        self.dt, self.n = check_cache_type(dtype), n
        if n % self.dt.block_size:
            raise ValueError(f"attention: a {self.dt.name} KV cache needs rows that are whole blocks of "
                             f"{self.dt.block_size}, not {n} values")
        self.bytes = self.dt.row_bytes(n)

    def at(self, base, index):
        """Address of row ``index``."""
        return self.k.addr(base, self.k.mul(index, self.bytes))

    def prefetch(self, row) -> None:
        """Ask for every cache line of ``row`` (its last byte too: rows need not start on a line)."""
        for off in sorted({*range(0, self.bytes, 64), self.bytes - 1}):
            self.k.prefetch(self.k.addr(row, off))

    # -- reads -----------------------------------------------------------------------
    def load(self, row, e, w: int) -> ir.Value:
        """Values e..e+w-1 of ``row`` as f32 (a scalar when w == 1)."""
        return self.loads(row, e, [w])[0]

    def loads(self, row, e, widths: list[int]) -> list[ir.Value]:
        """Consecutive pieces of ``row`` from value e, of the given widths, as f32 (a scalar where
        a width is 1). In a block type the pieces must lie in one block (e a multiple of their
        total, which divides 32), and share its scale: one load and conversion for all of them."""
        k, b, isa, dt = self.k, self.b, self.isa, self.dt
        e = k.i64(e)
        starts = [sum(widths[:c]) for c in range(len(widths))]
        if dt is dtypes.f32:
            return [k.load(_typ(f32, w), row, k.mul(k.add(e, o), 4)) for w, o in zip(widths, starts)]
        if dt in (dtypes.f16, dtypes.bf16):
            widen = isa.f16_to_f32 if dt is dtypes.f16 else isa.bf16_to_f32
            return [widen(k.load(_typ(i16, w), row, k.mul(k.add(e, o), 2))) for w, o in zip(widths, starts)]
        if 32 % sum(widths):
            raise ValueError(f"kv rows: pieces of {sum(widths)} values cannot share a {dt.name} block's scale")
        block = b.lshr(e, k.i64(5))
        j0 = b.and_(e, k.i64(31))
        head = k.addr(row, k.mul(block, dt.type_size))
        d = isa.f16_to_f32(k.load(i16, head))
        out = []
        for w, o in zip(widths, starts):
            j = k.add(j0, o)
            if dt is dtypes.q8_0:
                q = b.sext(k.load(_typ(i8, w), head, k.add(j, 2)), _typ(i32, w))
            else:                                                # q4_0: nibbles, minus 8
                byte = b.zext(k.load(_typ(i8, w), head, k.add(b.and_(j, k.i64(15)), 2)), _typ(i32, w))
                shift = b.trunc(b.mul(b.lshr(j, k.i64(4)), k.i64(4)), i32)
                shift = shift if w == 1 else k.splat(shift, w)
                q = b.sub(b.and_(b.lshr(byte, shift), _c(i32, w, 15)), _c(i32, w, 8))
            out.append(b.fmul(d if w == 1 else k.splat(d, w), b.sitofp(q, _typ(f32, w))))
        return out

    # -- writes ----------------------------------------------------------------------
    def store(self, src, dst) -> None:
        """dst (a row of this type) = the n f32 values at src, converted or quantised."""
        k, isa, dt = self.k, self.isa, self.dt
        if dt is dtypes.f32:
            k.intrinsic("llvm.memcpy.p0.p0.i64", ir.VoidType(),
                        [dst, src, k.i64(4 * self.n), ir.Constant(ir.IntType(1), 0)])
            return
        if dt in (dtypes.f16, dtypes.bf16):
            convert = isa.f32_to_f16 if dt is dtypes.f16 else self._to_bf16
            with k.loop(0, self.n, name="cvt") as i:
                k.store(convert(k.load(f32, src, k.mul(i, 4))), dst, k.mul(i, 2))
            return
        with k.loop(0, self.n // 32, name="qblk") as blk:
            x = k.addr(src, k.mul(blk, 128))
            head = k.addr(dst, k.mul(blk, dt.type_size))
            (self._q8_0 if dt is dtypes.q8_0 else self._q4_0)(x, head)

    def _to_bf16(self, x: ir.Value) -> ir.Value:
        b = self.b
        u = b.bitcast(x, i32)
        nan = b.icmp_unsigned(">", b.and_(u, ir.Constant(i32, 0x7FFFFFFF)), ir.Constant(i32, 0x7F800000))
        quiet = b.or_(b.and_(u, ir.Constant(i32, 0xFFFF0000)), ir.Constant(i32, 0x00400000))
        odd = b.and_(b.lshr(u, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = b.add(u, b.add(ir.Constant(i32, 0x7FFF), odd))
        return b.trunc(b.lshr(b.select(nan, quiet, rounded), ir.Constant(i32, 16)), i16)

    def _reduce(self, x, init: float, combine) -> ir.Value:
        """combine over the 32 values at x, in order."""
        acc = self.k.var(f32, init)
        with self.k.loop(0, 32, name="scan") as i:
            acc.set(combine(acc.get(), self.k.load(f32, x, self.k.mul(i, 4))))
        return acc.get()

    def _abs(self, v: ir.Value) -> ir.Value:
        return self.k.intrinsic("llvm.fabs.f32", f32, [v])

    def _q8_0(self, x, head) -> None:
        k, b, isa = self.k, self.b, self.isa
        amax = self._reduce(x, 0.0, lambda a, v: isa.maxnum(a, self._abs(v)))
        k.store(isa.f32_to_f16(b.fdiv(amax, ir.Constant(f32, 127.0))), head)
        nonzero = b.fcmp_ordered("!=", amax, ir.Constant(f32, 0.0))
        iscale = b.select(nonzero, b.fdiv(ir.Constant(f32, 127.0), amax), ir.Constant(f32, 0.0))
        with k.loop(0, 32, name="q") as i:
            q = isa.round_even(b.fmul(k.load(f32, x, k.mul(i, 4)), iscale))
            k.store(b.trunc(q, i8), head, k.add(i, 2))

    def _q4_0(self, x, head) -> None:
        k, b, isa = self.k, self.b, self.isa
        amax, mx = k.var(f32, 0.0), k.var(f32, 0.0)
        with k.loop(0, 32, name="scan") as i:                    # the first value of largest magnitude
            v = k.load(f32, x, k.mul(i, 4))
            bigger = b.fcmp_ordered("<", amax.get(), self._abs(v))
            amax.set(b.select(bigger, self._abs(v), amax.get()))
            mx.set(b.select(bigger, v, mx.get()))
        d = b.fdiv(mx.get(), ir.Constant(f32, -8.0))
        k.store(isa.f32_to_f16(d), head)
        nonzero = b.fcmp_ordered("!=", d, ir.Constant(f32, 0.0))
        inv = b.select(nonzero, b.fdiv(ir.Constant(f32, 1.0), d), ir.Constant(f32, 0.0))

        def level(i):
            v = b.fadd(b.fmul(k.load(f32, x, k.mul(i, 4)), inv), ir.Constant(f32, 8.5))
            q = b.fptosi(v, i32)
            return b.select(b.icmp_signed(">", q, ir.Constant(i32, 15)), ir.Constant(i32, 15), q)
        with k.loop(0, 16, name="q") as i:
            byte = b.or_(level(i), b.shl(level(k.add(i, 16)), ir.Constant(i32, 4)))
            k.store(b.trunc(byte, i8), head, k.add(i, 2))


def kv_store(module: ir.Module, dtype, n: int, target) -> str:
    """Emit (once) ``kv_store_<dtype>_n<n>_<target>(x: f32 [T, n], cache: [T, n] of dtype, T)``:
    T contiguous rows converted or quantised; threads split rows. Returns the name."""
    dt = check_cache_type(dtype)
    name = f"kv_store_{dt.name}_n{n}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("x", "cache"))
    row = KVRow(k, Isa(k, target), dt, n)
    start, end = k.thread_share(k.arg["T"])
    with k.loop(start, end, name="r") as r:
        row.store(k.addr(k.arg["x"], k.mul(r, 4 * n)), row.at(k.arg["cache"], r))
    return k.finish()
