"""Decoders for the 32-weight block types: q4_0 q4_1 q5_0 q5_1 q8_0 iq4_nl mxfp4.

Each type has a scalar twin (`_level_*`, `_scale_*`: one weight, the spec) and a vector
one (`_decode_*`: the whole block as one <32 x i8>). Offsets are from the GGUF layout:
d (fp16) first, then m / qh where present, then the quants; mxfp4 has an e8m0 byte for d.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels.blocks import (BlockFormat, Decoded, Run, bits, byte, bytes_at, half, lookup,
                                                 nibble32, nibbles32, pack, sbyte, table)
from ggraph.backends.llvm.kernels.builder import Kernel, i1, i8, i16, i32, i64, vec
from ggraph.backends.llvm.kernels.isa import Isa

IQ4_VALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
MXFP4_VALUES = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]     # e2m1, doubled (ggml's kvalues_mxfp4)


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


# -- mxfp4: e (e8m0) @0, qs[16] @1; q = MXFP4_VALUES[nib], w = 2^(e-127)/2 * q -----------------
def _e8m0_half(k: Kernel, isa: Isa, blk, s):
    """Scale 2^(e-127)/2 from the exponent byte at 0, as ggml's GGML_E8M0_TO_FP32_HALF builds its bits
    (a subnormal for e < 2), no min."""
    b = k.b
    e = byte(k, blk, 0)
    sub = b.shl(ir.Constant(i32, 0x00200000), e)
    normal = b.shl(b.sub(e, ir.Constant(i32, 1)), ir.Constant(i32, 23))
    word = b.select(b.icmp_unsigned("<", e, ir.Constant(i32, 2)), sub, normal)
    return b.bitcast(word, ir.FloatType()), None


def _level_mxfp4(k, isa, blk, i):
    return lookup(k, table(k, "ggraph_mxfp4_values", MXFP4_VALUES), nibble32(k, blk, 1, i))


_MXFP4_U8 = [v + 12 for v in MXFP4_VALUES]      # q + 12 in 0..24: unsigned bytes on every feature set


def _decode_mxfp4(k, isa, blk):
    scales = pack(k, [_e8m0_half(k, isa, blk, 0)[0]])
    return Decoded(lambda c: isa.lookup16(_MXFP4_U8, nibbles32(k, blk, 1)), False, 12, max(_MXFP4_U8), scales, None)


# -- runs of blocks gathered with word shuffles (AVX-512 VNNI gemv) ---------------------------
# A gemv row's 32-weight blocks are 18-34 bytes apart, so a block's quants and scale straddle 64-byte
# vectors. Every field of these formats starts at an even offset, so one two-source word shuffle
# (vpermt2w) of two 64-byte loads gathers two blocks' quants, or up to 8 blocks' scales, where
# per-block loads take a lane insert each.
WINDOW = 128                     # the bytes one two-source word shuffle picks from


@dataclass(frozen=True)
class Fields:
    """Where a 32-weight block type of nibbles keeps what gemv gathers (byte offsets in the block)."""

    qs: int                      # the 16 bytes of nibbles: weights 0-15 low halves, 16-31 high
    offset: int                  # what to subtract from the unsigned bytes gemv dots (as Decoded.offset)
    qmax: int                    # the largest of those bytes
    m: int | None = None         # fp16 m, where w = d*q + m
    qh: int | None = None        # the 32 fifth bits, a little-endian u32
    values: tuple | None = None  # the 16 levels the nibbles index (iq4_nl), plus offset


def _words(k: Kernel, at: ir.Value, start: int, picks: list) -> ir.Value:
    """The i16 words at byte offsets ``picks`` (even, within WINDOW bytes of ``start``) from ``at``."""
    if any(p % 2 or not start <= p < start + WINDOW - 1 for p in picks):
        raise ValueError(f"gathered run: words {picks} are not all in the {WINDOW} bytes at {start}")
    lo, hi = (k.load(vec(i16, 32), at, start + part) for part in (0, 64))
    return k.shuffle(lo, [(p - start) // 2 for p in picks], hi)


def _gathered_halves(k: Kernel, isa: Isa, at: ir.Value, ts: int, G: int, offset: int, starts: list) -> ir.Value:
    """The fp16 field at ``offset`` of each of G blocks ``ts`` bytes apart, as <G x float>: one word
    shuffle per window of ``starts`` that is needed (the one holding most of the rest first), blended."""
    inside = lambda start, b: start <= b * ts + offset <= start + WINDOW - 2      # noqa: E731
    left, out = set(range(G)), None
    while left:
        start = max(starts, key=lambda s: sum(inside(s, b) for b in left))
        got = {b for b in left if inside(start, b)}
        if not got:
            raise ValueError(f"gathered run: no window holds the field at {offset} of blocks {sorted(left)}")
        words = _words(k, at, start, [b * ts + offset if b in got else start for b in range(G)])
        out = words if out is None else k.shuffle(out, [G + b if b in got else b for b in range(G)], words)
        left -= got
    return isa.f16_to_f32(out)


def gathered_run(dt, fields: Fields):
    """``BlockFormat.run`` for a 32-weight type of nibbles laid out as ``fields``: G blocks (G even, at
    least WINDOW bytes) from 64-byte loads, two blocks' quants per word shuffle; the unsigned levels
    (q + offset) that a VNNI target dots (isa.full_u8_dot)."""
    ts = dt.type_size

    def run(k: Kernel, isa: Isa, at: ir.Value, G: int) -> Run:
        span = G * ts
        if G % 2 or span < WINDOW:
            raise ValueError(f"gathered run of {dt.name}: {G} blocks ({span} bytes); it takes an even count "
                             f"of at least {WINDOW} bytes")
        b = k.b
        starts = [min(j * ts, span - WINDOW) for j in range(0, G, 2)]     # pair j's window, inside the run

        def weights(j: int, m: int) -> ir.Value:
            if m != 2 or j % 2:
                raise ValueError(f"gathered run of {dt.name}: blocks go in pairs from even ones, not {m} from {j}")
            # each block's 16 bytes twice (low halves, then high), as 32 weights in order
            picks = [blk * ts + fields.qs + 2 * i for blk in (j, j + 1) for _ in range(2) for i in range(8)]
            v = isa.nibbles(k.cast_vec(_words(k, at, starts[j // 2], picks), i8), [False, False, True, True] * 2)
            if fields.qh is not None:                                        # fifth bits: 16 where set
                lo, hi = (b.zext(k.load(i32, at, blk * ts + fields.qh), i64) for blk in (j, j + 1))
                mask = b.bitcast(b.or_(lo, b.shl(hi, ir.Constant(i64, 32))), vec(i1, 64))
                v = b.or_(v, b.select(mask, ir.Constant(v.type, [16] * 64), ir.Constant(v.type, [0] * 64)))
            if fields.values is not None:
                v = isa.lookup16(list(fields.values), v)
            return v

        d = _gathered_halves(k, isa, at, ts, G, 0, starts)
        mins = b.fneg(_gathered_halves(k, isa, at, ts, G, fields.m, starts)) if fields.m is not None else None
        return Run(weights, d, mins, False, fields.offset, fields.qmax)
    return run


_IQ4_U8 = tuple(v + 128 for v in IQ4_VALUES)
# q8_0 keeps its per-block loads: gathered the same way, its 34-byte blocks streamed slower (docs/kernels.md)
_FIELDS = {
    dtypes.q4_0: Fields(qs=2, offset=8, qmax=15),
    dtypes.q4_1: Fields(qs=4, offset=0, qmax=15, m=2),
    dtypes.q5_0: Fields(qs=6, offset=16, qmax=31, qh=2),
    dtypes.q5_1: Fields(qs=8, offset=0, qmax=31, m=2, qh=4),
    dtypes.iq4_nl: Fields(qs=2, offset=128, qmax=max(_IQ4_U8), values=_IQ4_U8),
}

#   dtype          level          scale        decode
_TABLE = [
    (dtypes.q4_0,   _level_q4_0,   _d,          _decode_q4_0),
    (dtypes.q4_1,   _level_q4_1,   _d_m,        _decode_q4_1),
    (dtypes.q5_0,   _level_q5_0,   _d,          _decode_q5_0),
    (dtypes.q5_1,   _level_q5_1,   _d_m,        _decode_q5_1),
    (dtypes.q8_0,   _level_q8_0,   _d,          _decode_q8_0),
    (dtypes.iq4_nl, _level_iq4_nl, _d,          _decode_iq4_nl),
    (dtypes.mxfp4,  _level_mxfp4,  _e8m0_half,  _decode_mxfp4),   # qs at an odd offset: no gathered run
]
# ggml's vec_dot_type: q8_1 (whose s the mins meet) for the types with a min, q8_0 for the others
FORMATS = {dt: BlockFormat(dt, "q8_1" if scale is _d_m else "q8_0", 32, level, scale, decode,
                          run=gathered_run(dt, _FIELDS[dt]) if dt in _FIELDS else None)
           for dt, level, scale, decode in _TABLE}
