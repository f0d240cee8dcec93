"""Decoders for the 32-weight block types: q4_0 q4_1 q5_0 q5_1 q8_0 iq4_nl.

Each type has a scalar twin (`_level_*`, `_scale_*`: one weight, the spec) and a vector
one (`_decode_*`: the whole block as one <32 x i8>). Offsets are from the GGUF layout:
d (fp16) first, then m / qh where present, then the quants.
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels.blocks import (BlockFormat, Decoded, bits, bytes_at, half, lookup,
                                                 nibble32, nibbles32, pack, sbyte, table)
from ggraph.backends.llvm.kernels.builder import Kernel, i1, i8, i32, vec
from ggraph.backends.llvm.kernels.isa import Isa

IQ4_VALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def _d(k: Kernel, isa: Isa, blk, s):
    """Scale d at offset 0, no min."""
    return half(k, isa, blk, 0), None


def _d_m(k: Kernel, isa: Isa, blk, s):
    """Scale d at 0 and m at 2: w = d*q + m, so min = -m."""
    return half(k, isa, blk, 0), k.b.fneg(half(k, isa, blk, 2))


def _high_bit(k: Kernel, blk, qh: int, i) -> ir.Value:
    """Bit i of the little-endian u32 at qh, as i32 (0 or 16)."""
    word = k.load(i32, blk, qh)
    return k.b.shl(bits(k, word, i, 1), ir.Constant(i32, 4))


def _high_bits(k: Kernel, blk, qh: int) -> ir.Value:
    """The 32 fifth bits at qh as a <32 x i8> of 0 or 16."""
    mask = k.b.bitcast(k.load(i32, blk, qh), vec(i1, 32))
    return k.b.select(mask, ir.Constant(vec(i8, 32), [16] * 32), ir.Constant(vec(i8, 32), [0] * 32))


# -- q4_0: d, qs[16]; q = nib - 8 ------------------------------------------------------------
def _level_q4_0(k, isa, blk, i):
    return k.b.sub(nibble32(k, blk, 2, i), ir.Constant(i32, 8))


def _decode_q4_0(k, isa, blk):
    return Decoded(lambda c: nibbles32(k, blk, 2), False, 8, 15, pack(k, [half(k, isa, blk, 0)]), None)


# -- q4_1: d, m, qs[16]; w = d*nib + m -------------------------------------------------------
def _level_q4_1(k, isa, blk, i):
    return nibble32(k, blk, 4, i)


def _decode_q4_1(k, isa, blk):
    scale, mn = _d_m(k, isa, blk, 0)
    return Decoded(lambda c: nibbles32(k, blk, 4), False, 0, 15, pack(k, [scale]), pack(k, [mn]))


# -- q5_0: d, qh u32, qs[16]; q = (nib | bit<<4) - 16 ----------------------------------------
def _level_q5_0(k, isa, blk, i):
    q = k.b.or_(nibble32(k, blk, 6, i), _high_bit(k, blk, 2, i))
    return k.b.sub(q, ir.Constant(i32, 16))


def _decode_q5_0(k, isa, blk):
    chunk = lambda c: k.b.or_(nibbles32(k, blk, 6), _high_bits(k, blk, 2))  # noqa: E731
    return Decoded(chunk, False, 16, 31, pack(k, [half(k, isa, blk, 0)]), None)


# -- q5_1: d, m, qh u32, qs[16]; w = d*(nib | bit<<4) + m ------------------------------------
def _level_q5_1(k, isa, blk, i):
    return k.b.or_(nibble32(k, blk, 8, i), _high_bit(k, blk, 4, i))


def _decode_q5_1(k, isa, blk):
    scale, mn = _d_m(k, isa, blk, 0)
    chunk = lambda c: k.b.or_(nibbles32(k, blk, 8), _high_bits(k, blk, 4))  # noqa: E731
    return Decoded(chunk, False, 0, 31, pack(k, [scale]), pack(k, [mn]))


# -- q8_0: d, int8 qs[32] --------------------------------------------------------------------
def _level_q8_0(k, isa, blk, i):
    return sbyte(k, blk, k.add(i, 2))


def _decode_q8_0(k, isa, blk):
    scales = pack(k, [half(k, isa, blk, 0)])
    if isa.full_u8_dot:                         # q + 128 as u8: one xor, no sign juggling
        flip = ir.Constant(vec(i8, 32), [0x80] * 32)
        return Decoded(lambda c: k.b.xor(bytes_at(k, blk, 2, 32), flip), False, 128, 255, scales, None)
    return Decoded(lambda c: bytes_at(k, blk, 2, 32), True, 0, 0, scales, None)


# -- iq4_nl: d, qs[16]; q = IQ4_VALUES[nib] --------------------------------------------------
def _level_iq4_nl(k, isa, blk, i):
    return lookup(k, table(k, "ggraph_iq4_values", IQ4_VALUES), nibble32(k, blk, 2, i))


def iq4_chunk(k: Kernel, isa: Isa, blk, offset: int) -> tuple:
    """(chunk emitter, signed, offset, qmax) for 32 iq4 nibbles at `offset`."""
    if isa.full_u8_dot:
        shifted = [v + 128 for v in IQ4_VALUES]
        return (lambda: isa.lookup16(shifted, nibbles32(k, blk, offset))), False, 128, max(shifted)
    return (lambda: isa.lookup16(IQ4_VALUES, nibbles32(k, blk, offset))), True, 0, 0


def _decode_iq4_nl(k, isa, blk):
    emit, signed, offset, qmax = iq4_chunk(k, isa, blk, 2)
    return Decoded(lambda c: emit(), signed, offset, qmax, pack(k, [half(k, isa, blk, 0)]), None)


#   dtype          level          scale  decode
_TABLE = [
    (dtypes.q4_0,   _level_q4_0,   _d,    _decode_q4_0),
    (dtypes.q4_1,   _level_q4_1,   _d_m,  _decode_q4_1),
    (dtypes.q5_0,   _level_q5_0,   _d,    _decode_q5_0),
    (dtypes.q5_1,   _level_q5_1,   _d_m,  _decode_q5_1),
    (dtypes.q8_0,   _level_q8_0,   _d,    _decode_q8_0),
    (dtypes.iq4_nl, _level_iq4_nl, _d,    _decode_iq4_nl),
]
FORMATS = {dt: BlockFormat(dt, "q8_0", 32, level, scale, decode) for dt, level, scale, decode in _TABLE}
