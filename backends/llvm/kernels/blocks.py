"""What a weight block decoder gives the matmul drivers, and the byte-level readers
both its twins use.

Every block type is `w = scale[s] * q - min[s]` per sub-block s of `sub` weights, with
an integer level q. The scalar twin reads q one weight at a time (the spec); the vector
twin unpacks 32 weights at a time into a byte vector, either the signed levels, or
`q + offset` as unsigned bytes so that u8 x s8 dot products apply. The drivers take
`offset * sum(x)` back out in integers, using the activation sums.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from llvmlite import ir

from ggraph.backends.llvm.kernels.builder import Kernel, i8, i16, i32, vec
from ggraph.backends.llvm.kernels.isa import Isa
from ggraph.ir.dtypes import DType


@dataclass
class IntScales:
    """A super-block's sub-block scales (and mins) as integers, and the block's float factors:
    scale[s] = d * scales[s], min[s] = dmin * mins[s]. Drivers may sum a block's sub-blocks in
    integers with them, as llama.cpp's k-quant dot products do."""

    scales: ir.Value                   # <subs x i32>, or one sub-block's i32 (BlockFormat.int_scale)
    d: ir.Value                        # float
    mins: ir.Value | None = None       # as scales
    dmin: ir.Value | None = None       # float


@dataclass
class Headers:
    """The integer scales and mins and the float d, dmin of G consecutive super-blocks of a row,
    unpacked together (a gemv row's blocks share the shifts and masks): sub-block s of block g
    is lane ``subs * g + s`` of ``scales`` and ``mins``, block g is lane g of ``d`` and ``dmin``."""

    scales: ir.Value                   # <G*subs x i16>
    mins: ir.Value                     # <G*subs x i16>
    d: ir.Value                        # <G x float>
    dmin: ir.Value                     # <G x float>


@dataclass
class Decoded:
    """One block, unpacked for the vector drivers."""

    chunk: Callable                    # c -> <32 x i8>: weights 32c..32c+31 (c an int or i64 value)
    signed: bool                       # bytes are signed levels q; else q + offset, unsigned
    offset: int                        # for unsigned bytes: what to subtract from each
    qmax: int                          # the largest unsigned byte (bounds i16 pair sums)
    scales: ir.Value                   # <subs x float>: one per sub-block
    mins: ir.Value | None              # <subs x float>, or None
    ints: IntScales | None = None      # the same scales as integers, for super-block types

    @classmethod
    def of_ints(cls, k: Kernel, chunk: Callable, offset: int, qmax: int, ints: IntScales) -> "Decoded":
        """A block of unsigned levels whose float scales and mins are its integer ones times d, dmin."""
        mins = lanes_f32(k, ints.mins, ints.dmin) if ints.mins is not None else None
        return cls(chunk, False, offset, qmax, lanes_f32(k, ints.scales, ints.d), mins, ints)

    def scale(self, k: Kernel, s) -> ir.Value:
        """Scale of sub-block s (an int or an i64 value)."""
        return k.b.extract_element(self.scales, _lane(k, s))

    def min(self, k: Kernel, s) -> ir.Value:
        return k.b.extract_element(self.mins, _lane(k, s))

    def int_scale(self, k: Kernel, s) -> ir.Value:
        """The integer scale of sub-block s (super-block types), as a float."""
        return k.b.sitofp(k.b.extract_element(self.ints.scales, _lane(k, s)), ir.FloatType())

    def int_min(self, k: Kernel, s) -> ir.Value:
        """The integer min of sub-block s (super-block types with mins), as a float."""
        return k.b.sitofp(k.b.extract_element(self.ints.mins, _lane(k, s)), ir.FloatType())


def _lane(k: Kernel, s) -> ir.Value:
    return ir.Constant(i32, s) if isinstance(s, int) else k.b.trunc(s, i32)


@dataclass
class Run:
    """G consecutive 32-weight blocks of a row, for gemv: ``weights(j, m)`` the bytes of blocks j ..
    j+m-1 end to end (each as Decoded.chunk(0) gives it), ``d`` and ``mins`` one lane per block."""

    weights: Callable                  # (j, m) -> <32m x i8>
    d: ir.Value                        # <G x float>
    mins: ir.Value | None              # <G x float>, or None
    signed: bool
    offset: int
    qmax: int

    @classmethod
    def of_blocks(cls, k: Kernel, decs: list) -> "Run":
        """A run from each block's own decoder (a load and an unpack per block)."""
        first = decs[0]
        return cls(lambda j, m: k.concat(*[decs[j + i].chunk(0) for i in range(m)]),
                   k.concat(*[dec.scales for dec in decs]),
                   k.concat(*[dec.mins for dec in decs]) if first.mins is not None else None,
                   first.signed, first.offset, first.qmax)


@dataclass(frozen=True)
class BlockFormat:
    """A weight block type: its activation format, and its scalar and vector decoders."""

    dtype: DType
    act: str                                      # "q8_0", "q8_1" (q4_1, q5_1: ggml's fp16 s) or "q8_k"
    sub: int                                      # weights per scale: 16 or 32
    level: Callable[[Kernel, Isa, ir.Value, ir.Value], ir.Value]    # (blk, i) -> i32 q
    scale: Callable[[Kernel, Isa, ir.Value, ir.Value], tuple]       # (blk, s) -> (scale, min)
    decode: Callable[[Kernel, Isa, ir.Value], Decoded]              # blk -> Decoded
    unroll: int = 1          # chunks whose bit positions differ; gemm loops over groups of them
    wide: tuple = ()         # groups of chunks whose bytes one 64-byte load holds (gemv steps), if not consecutive
    int_mins: bool = False   # Decoded.ints has mins (super-blocks with w = d*sc*q - dmin*m)
    headers: Callable | None = None   # (k, isa, [blk]) -> Headers of consecutive blocks, where the format has it
    run: Callable | None = None       # (k, isa, first blk, G) -> Run gathered from 64-byte loads, where it has one
    int_scale: Callable | None = None  # (k, isa, blk, s) -> IntScales of sub-block s (super-block types)

    @property
    def chunks(self) -> int:
        return self.dtype.block_size // 32


# -- scalar readers (index arguments are i64 values or ints) ---------------------------
def byte(k: Kernel, blk: ir.Value, offset) -> ir.Value:
    """An unsigned byte of the block, as i32."""
    return k.b.zext(k.load(i8, blk, offset), i32)


def sbyte(k: Kernel, blk: ir.Value, offset) -> ir.Value:
    """A signed byte of the block, as i32."""
    return k.b.sext(k.load(i8, blk, offset), i32)


def half(k: Kernel, isa: Isa, blk: ir.Value, offset: int) -> ir.Value:
    """An fp16 field of the block, as float."""
    return isa.f16_to_f32(k.load(i16, blk, offset))


def bits(k: Kernel, value: ir.Value, shift, width: int) -> ir.Value:
    """(value >> shift) & (2**width - 1) on i32; shift may be an i64 value."""
    amount = ir.Constant(i32, shift) if isinstance(shift, int) else k.b.trunc(shift, i32)
    return k.b.and_(k.b.lshr(value, amount), ir.Constant(i32, (1 << width) - 1))


def idiv(k: Kernel, i, d: int):
    """i // d for a non-negative int or i64 value."""
    return i // d if isinstance(i, int) else k.b.udiv(i, k.i64(d))


def imod(k: Kernel, i, d: int):
    """i % d for a non-negative int or i64 value."""
    return i % d if isinstance(i, int) else k.b.urem(i, k.i64(d))


def nibble32(k: Kernel, blk: ir.Value, qs: int, i) -> ir.Value:
    """Weight i of a 32-weight block of nibbles at `qs`: low halves first, then high halves."""
    return bits(k, byte(k, blk, k.add(qs, imod(k, i, 16))), k.mul(idiv(k, i, 16), 4), 4)


def table(k: Kernel, name: str, values: list[int]) -> ir.GlobalVariable:
    """A module-level constant i8 table, made once."""
    g = k.module.globals.get(name)
    if g is None:
        typ = ir.ArrayType(i8, len(values))
        g = ir.GlobalVariable(k.module, typ, name=name)
        g.initializer = ir.Constant(typ, [v & 0xFF for v in values])
        g.global_constant = True
        g.linkage = "internal"
    return g


def lookup(k: Kernel, tbl: ir.GlobalVariable, index: ir.Value) -> ir.Value:
    """Signed entry `index` (i32) of a constant i8 table, as i32."""
    p = k.b.gep(tbl, [ir.Constant(i32, 0), index], source_etype=tbl.value_type)
    return k.b.sext(k.b.load(p, typ=i8), i32)


# -- vector readers ---------------------------------------------------------------------
def bytes_at(k: Kernel, blk: ir.Value, offset: int, n: int) -> ir.Value:
    """n bytes of the block as <n x i8> (an unaligned load)."""
    return k.load(vec(i8, n), blk, offset)


def vbits(k: Kernel, v: ir.Value, shift, width: int) -> ir.Value:
    """(v >> shift) & mask, lane-wise on a byte vector; shift is an int or an i64 value."""
    n = v.type.count
    if not isinstance(shift, int):
        v = k.b.lshr(v, k.splat(k.b.trunc(shift, i8), n))
    elif shift:
        v = k.b.lshr(v, ir.Constant(v.type, [shift] * n))
    return k.b.and_(v, ir.Constant(v.type, [(1 << width) - 1] * n))


def vshift(k: Kernel, v: ir.Value, left: int) -> ir.Value:
    """v << left (or >> -left) lane-wise."""
    n = v.type.count
    if left > 0:
        return k.b.shl(v, ir.Constant(v.type, [left] * n))
    if left < 0:
        return k.b.lshr(v, ir.Constant(v.type, [-left] * n))
    return v


def nibbles32(k: Kernel, blk: ir.Value, offset: int) -> ir.Value:
    """32 nibbles from 16 bytes: the low halves, then the high halves, as <32 x i8>."""
    qs = bytes_at(k, blk, offset, 16)
    return k.concat(vbits(k, qs, 0, 4), vbits(k, qs, 4, 4))


def lanes_f32(k: Kernel, v: ir.Value, scale: ir.Value) -> ir.Value:
    """An integer vector times the float `scale`, lane by lane."""
    return k.b.fmul(k.b.sitofp(v, vec(ir.FloatType(), v.type.count)), k.splat(scale, v.type.count))


def pack(k: Kernel, values: list) -> ir.Value:
    """Scalars as one vector."""
    v = ir.Constant(vec(values[0].type, len(values)), None)
    for j, x in enumerate(values):
        v = k.b.insert_element(v, x, ir.Constant(i32, j))
    return v
