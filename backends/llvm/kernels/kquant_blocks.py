"""Decoders for the 256-weight super-block types: q2_k q3_k q4_k q5_k q6_k iq4_xs.

Byte offsets and bit positions follow GGUF_AND_QUANTS.md. Each type has a scalar twin
(`_level_*`, `_ints_*`: one weight or sub-block's integer scales, the spec) and a vector one
(`_decode_*`: scales up front, 32-weight chunks on demand).
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels.blocks import (BlockFormat, Decoded, Headers, IntScales, bits, byte, bytes_at, half,
                                                 idiv, imod, lanes_f32, lookup, pack, sbyte,
                                                 table, vbits, vshift)
from ggraph.backends.llvm.kernels.builder import Kernel, i8, i16, i32, vec, vec_const
from ggraph.backends.llvm.kernels.isa import Isa
from ggraph.backends.llvm.kernels.quant_blocks import IQ4_VALUES, iq4_chunk


def _c32(value: int) -> ir.Constant:
    return ir.Constant(i32, value)


def _q2(k: Kernel, blk, qs: int, i) -> ir.Value:
    """The 2-bit field of weight i (q2_k / q3_k order): qs[32*(i/128) + i%32] >> 2*((i%128)/32)."""
    byte_at = k.add(qs, k.mul(idiv(k, i, 128), 32), imod(k, i, 32))
    return bits(k, byte(k, blk, byte_at), k.mul(idiv(k, imod(k, i, 128), 32), 2), 2)


def _q2_chunk(k: Kernel, blk, qs: int, c) -> ir.Value:
    """The 32 2-bit fields of chunk c as <32 x i8>: 32 bytes per four chunks, shifts 0, 2, 4, 6."""
    return vbits(k, bytes_at(k, blk, k.add(qs, k.mul(idiv(k, c, 4), 32)), 32), k.mul(imod(k, c, 4), 2), 2)


def _nib_chunk(k: Kernel, blk, qs: int, c) -> ir.Value:
    """Chunk c of q4_k-style nibbles: 32 bytes per pair of chunks, low halves then high."""
    return vbits(k, bytes_at(k, blk, k.add(qs, k.mul(idiv(k, c, 2), 32)), 32), k.mul(imod(k, c, 2), 4), 4)


def _k4_nibble(k: Kernel, blk, qs: int, i) -> ir.Value:
    """Weight i's nibble in q4_k / q5_k: low half of qs[32c+w] (w<32) else high of qs[32c+w-32]."""
    w = imod(k, i, 64)
    at = k.add(qs, k.mul(idiv(k, i, 64), 32), imod(k, w, 32))
    return bits(k, byte(k, blk, at), k.mul(idiv(k, w, 32), 4), 4)


# -- q2_k: scales[16] @0, qs[64] @16, d @80, dmin @82 ------------------------------------------
def _level_q2_k(k, isa, blk, i):
    return _q2(k, blk, 16, i)


def _ints_q2_k(k, isa, blk, s):
    sc = byte(k, blk, s)
    return IntScales(bits(k, sc, 0, 4), half(k, isa, blk, 80), bits(k, sc, 4, 4), half(k, isa, blk, 82))


def _decode_q2_k(k, isa, blk):
    sc = bytes_at(k, blk, 0, 16)
    ints = IntScales(k.b.zext(vbits(k, sc, 0, 4), vec(i32, 16)), half(k, isa, blk, 80),
                     k.b.zext(vbits(k, sc, 4, 4), vec(i32, 16)), half(k, isa, blk, 82))
    return Decoded.of_ints(k, lambda c: _q2_chunk(k, blk, 16, c), 0, 3, ints)


# -- q3_k: hmask[32] @0, qs[64] @32, scales[12] @96, d @108 ------------------------------------
def _level_q3_k(k, isa, blk, i):
    h = bits(k, byte(k, blk, imod(k, i, 32)), idiv(k, i, 32), 1)
    return k.b.sub(k.b.or_(_q2(k, blk, 32, i), k.b.shl(h, _c32(2))), _c32(4))


def _q3_scale6(k: Kernel, blk, j) -> ir.Value:
    """Signed 6-bit scale j of q3_k: low 4 bits from scales[j%8] (>>4 if j>=8), high 2 from scales[8+j%4]."""
    low = bits(k, byte(k, blk, k.add(96, imod(k, j, 8))), k.mul(idiv(k, j, 8), 4), 4)
    high = bits(k, byte(k, blk, k.add(104, imod(k, j, 4))), k.mul(idiv(k, j, 4), 2), 2)
    return k.b.sub(k.b.or_(low, k.b.shl(high, _c32(4))), _c32(32))


def _ints_q3_k(k, isa, blk, s):
    return IntScales(_q3_scale6(k, blk, s), half(k, isa, blk, 108))


def _decode_q3_k(k, isa, blk):
    raw = k.b.zext(bytes_at(k, blk, 96, 12), vec(i32, 12))                   # (12,) i32
    low_src = k.shuffle(raw, [j % 8 for j in range(16)])
    low = k.b.and_(k.b.lshr(low_src, vec_const(i32, [4 * (j // 8) for j in range(16)])),
                   vec_const(i32, [15] * 16))
    high_src = k.shuffle(raw, [8 + j % 4 for j in range(16)])
    high = k.b.and_(k.b.lshr(high_src, vec_const(i32, [2 * (j // 4) for j in range(16)])),
                    vec_const(i32, [3] * 16))
    six = k.b.sub(k.b.or_(low, k.b.shl(high, vec_const(i32, [4] * 16))), vec_const(i32, [32] * 16))

    def chunk(c):
        h = vshift(k, vbits(k, bytes_at(k, blk, 0, 32), c, 1), 2)
        return k.b.or_(_q2_chunk(k, blk, 32, c), h)
    return Decoded.of_ints(k, chunk, 4, 7, IntScales(six, half(k, isa, blk, 108)))


# -- q4_k / q5_k: d @0, dmin @2, 6-bit scales and mins packed in 12 bytes @4 ------------------
def _k4_scale_min(k: Kernel, blk, j) -> tuple:
    """The 6-bit (scale, min) pair j (0..7) of q4_k / q5_k, as i32."""
    a = byte(k, blk, k.add(4, j))
    e = byte(k, blk, k.add(8, j))
    f = byte(k, blk, k.add(4, k.b.and_(k.add(j, 4), k.i64(7))))          # s[j-4] when j >= 4
    lo = k.b.icmp_unsigned("<", k.i64(j), k.i64(4))
    sc = k.b.select(lo, bits(k, a, 0, 6), k.b.or_(bits(k, e, 0, 4), k.b.shl(bits(k, f, 6, 2), _c32(4))))
    mn = k.b.select(lo, bits(k, e, 0, 6), k.b.or_(bits(k, e, 4, 4), k.b.shl(bits(k, a, 6, 2), _c32(4))))
    return sc, mn


def _ints_k4(k, isa, blk, s):
    sc, mn = _k4_scale_min(k, blk, s)
    return IntScales(sc, half(k, isa, blk, 0), mn, half(k, isa, blk, 2))


def _k4_scales_vector(k: Kernel, isa: Isa, blk) -> IntScales:
    """All 8 scales and mins of a q4_k / q5_k block, unpacked four bytes at a time in the lanes of one
    vector (words u0, u1, u2 of the 12 scale bytes): scales 0..3 = u0 & 0x3f.., 4..7 = (u2 & 0x0f..) |
    ((u0 >> 6) & 3..) << 4, mins 0..3 = u1 & 0x3f.., 4..7 = ((u2 >> 4) & 0x0f..) | ((u1 >> 6) & 3..) << 4."""
    b = k.b
    v4 = vec(i32, 4)
    u = k.load(v4, blk, 4)                                                       # u0 u1 u2 (d of qs: unused)
    low = b.lshr(k.shuffle(u, [0, 2, 1, 2]), vec_const(i32, [0, 0, 0, 4]))
    low = b.and_(low, vec_const(i32, [0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F]))
    high = b.and_(b.lshr(k.shuffle(u, [0, 0, 1, 1]), vec_const(i32, [6] * 4)), vec_const(i32, [0, 0x03030303, 0, 0x03030303]))
    words = b.or_(low, b.shl(high, vec_const(i32, [4] * 4)))                 # sc 0..3, sc 4..7, mn 0..3, mn 4..7
    six = b.zext(k.cast_vec(words, i8), vec(i16, 16))       # (16,) i16, so that i16 consumers truncate for free
    return IntScales(b.zext(k.shuffle(six, range(8)), vec(i32, 8)), half(k, isa, blk, 0),
                     b.zext(k.shuffle(six, range(8, 16)), vec(i32, 8)), half(k, isa, blk, 2))


def _k4_headers(k: Kernel, isa: Isa, blks: list) -> Headers:
    """The scales, mins, d and dmin of consecutive q4_k / q5_k blocks, unpacked as _k4_scales_vector
    unpacks one block's, each block's words u0 u1 u2 in four lanes of one vector."""
    b = k.b
    G = len(blks)

    def each(lanes):
        return [x for _ in range(G) for x in lanes]
    u = k.concat(*[k.load(vec(i32, 4), blk, 4) for blk in blks])                 # (4G,) i32
    low = b.lshr(k.shuffle(u, [4 * g + j for g in range(G) for j in (0, 2, 1, 2)]), vec_const(i32, each([0, 0, 0, 4])))
    low = b.and_(low, vec_const(i32, each([0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F])))
    high = b.lshr(k.shuffle(u, [4 * g + j for g in range(G) for j in (0, 0, 1, 1)]), vec_const(i32, [6] * 4 * G))
    high = b.and_(high, vec_const(i32, each([0, 0x03030303, 0, 0x03030303])))
    six = k.cast_vec(b.or_(low, b.shl(high, vec_const(i32, [4] * 4 * G))), i8)  # per block: 8 scales, 8 mins
    scales = b.zext(k.shuffle(six, [16 * g + j for g in range(G) for j in range(8)]), vec(i16, 8 * G))
    mins = b.zext(k.shuffle(six, [16 * g + 8 + j for g in range(G) for j in range(8)]), vec(i16, 8 * G))
    dm = isa.f16_to_f32(k.concat(*[k.load(vec(i16, 2), blk, 0) for blk in blks]))            # d, dmin per block
    return Headers(scales, mins, k.shuffle(dm, range(0, 2 * G, 2)), k.shuffle(dm, range(1, 2 * G, 2)))


# -- q4_k: qs[128] @16 -------------------------------------------------------------------------
def _level_q4_k(k, isa, blk, i):
    return _k4_nibble(k, blk, 16, i)


def _decode_q4_k(k, isa, blk):
    return Decoded.of_ints(k, lambda c: _nib_chunk(k, blk, 16, c), 0, 15, _k4_scales_vector(k, isa, blk))


# -- q5_k: qh[32] @16, qs[128] @48; fifth bit = bit (i/32) of qh[i%32] ----------------------------
def _level_q5_k(k, isa, blk, i):
    h = bits(k, byte(k, blk, k.add(16, imod(k, i, 32))), idiv(k, i, 32), 1)
    return k.b.or_(_k4_nibble(k, blk, 48, i), k.b.shl(h, _c32(4)))


def _decode_q5_k(k, isa, blk):
    def chunk(c):
        h = vshift(k, vbits(k, bytes_at(k, blk, 16, 32), c, 1), 4)
        return k.b.or_(_nib_chunk(k, blk, 48, c), h)
    return Decoded.of_ints(k, chunk, 0, 31, _k4_scales_vector(k, isa, blk))


# -- q6_k: ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208 ---------------------------------
def _level_q6_k(k, isa, blk, i):
    h, kk, l = idiv(k, i, 128), idiv(k, imod(k, i, 128), 32), imod(k, i, 32)
    lo_at = k.add(k.mul(h, 64), k.mul(imod(k, kk, 2), 32), l)
    lo = bits(k, byte(k, blk, lo_at), k.mul(idiv(k, kk, 2), 4), 4)
    hi = bits(k, byte(k, blk, k.add(128, k.mul(h, 32), l)), k.mul(kk, 2), 2)
    return k.b.sub(k.b.or_(lo, k.b.shl(hi, _c32(4))), _c32(32))


def _ints_q6_k(k, isa, blk, s):
    return IntScales(sbyte(k, blk, k.add(192, s)), half(k, isa, blk, 208))


def _decode_q6_k(k, isa, blk):
    ints = IntScales(k.b.sext(bytes_at(k, blk, 192, 16), vec(i32, 16)), half(k, isa, blk, 208))

    def chunk(c):
        h, kk = idiv(k, c, 4), imod(k, c, 4)
        lo_at = k.add(k.mul(h, 64), k.mul(imod(k, kk, 2), 32))
        lo = vbits(k, bytes_at(k, blk, lo_at, 32), k.mul(idiv(k, kk, 2), 4), 4)
        hi = vshift(k, vbits(k, bytes_at(k, blk, k.add(128, k.mul(h, 32)), 32), k.mul(kk, 2), 2), 4)
        return k.b.or_(lo, hi)
    return Decoded.of_ints(k, chunk, 32, 63, ints)


# -- iq4_xs: d @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8 -----------------------------------
def _level_iq4_xs(k, isa, blk, i):
    ib, j = idiv(k, i, 32), imod(k, i, 32)
    nib = bits(k, byte(k, blk, k.add(8, k.mul(ib, 16), imod(k, j, 16))), k.mul(idiv(k, j, 16), 4), 4)
    return lookup(k, table(k, "ggraph_iq4_values", IQ4_VALUES), nib)


def _iq4_xs_ls(k: Kernel, blk, ib) -> ir.Value:
    """The 6-bit scale of sub-block ib, as i32 in -32..31."""
    low = bits(k, byte(k, blk, k.add(4, idiv(k, ib, 2))), k.mul(imod(k, ib, 2), 4), 4)
    high = bits(k, k.b.zext(k.load(ir.IntType(16), blk, 2), i32), k.mul(ib, 2), 2)
    return k.b.sub(k.b.or_(low, k.b.shl(high, _c32(4))), _c32(32))


def _ints_iq4_xs(k, isa, blk, s):
    return IntScales(_iq4_xs_ls(k, blk, s), half(k, isa, blk, 0))


def _float_scale(ints):
    """BlockFormat.scale from an integer-scale reader: (d * scale[s], dmin * min[s]), as llama.cpp's
    dequantisers round them."""
    def scale(k, isa, blk, s):
        got = ints(k, isa, blk, s)
        times = lambda d, n: k.b.fmul(d, k.b.sitofp(n, ir.FloatType()))      # noqa: E731
        return times(got.d, got.scales), times(got.dmin, got.mins) if got.mins is not None else None
    return scale


def _decode_iq4_xs(k, isa, blk):
    ints = IntScales(pack(k, [_iq4_xs_ls(k, blk, s) for s in range(8)]), half(k, isa, blk, 0))
    _, signed, offset, qmax = iq4_chunk(k, isa, blk, 8)
    return Decoded(lambda c: iq4_chunk(k, isa, blk, k.add(8, k.mul(c, 16)))[0](), signed, offset, qmax,
                   lanes_f32(k, ints.scales, ints.d), None, ints)


# sub: weights per scale; unroll: chunks whose bit positions differ (gemm loops over such groups);
# mins: integer mins beside the integer scales
#   dtype          sub  unroll  mins   level          scales         decode
_TABLE = [
    (dtypes.q2_k,   16,  4,     True,  _level_q2_k,   _ints_q2_k,    _decode_q2_k),
    (dtypes.q3_k,   16,  4,     False, _level_q3_k,   _ints_q3_k,    _decode_q3_k),
    (dtypes.q4_k,   32,  2,     True,  _level_q4_k,   _ints_k4,      _decode_q4_k),
    (dtypes.q5_k,   32,  2,     True,  _level_q5_k,   _ints_k4,      _decode_q5_k),
    (dtypes.q6_k,   16,  4,     False, _level_q6_k,   _ints_q6_k,    _decode_q6_k),
    (dtypes.iq4_xs, 32,  2,     False, _level_iq4_xs, _ints_iq4_xs,  _decode_iq4_xs),
]
# q4_k / q5_k: 64 bytes of nibbles hold chunks (0, 2) in their low halves and (1, 3) in their high ones;
# q2_k / q3_k (qs) and q6_k (qh): 64 bytes of 2-bit fields hold chunks (c, c + 4) at the same shift
_NIBBLE_PAIRS = ((0, 2), (1, 3), (4, 6), (5, 7))
_HALF_PAIRS = ((0, 4), (1, 5), (2, 6), (3, 7))
_WIDE = {dtypes.q4_k: _NIBBLE_PAIRS, dtypes.q5_k: _NIBBLE_PAIRS,
         dtypes.q2_k: _HALF_PAIRS, dtypes.q3_k: _HALF_PAIRS, dtypes.q6_k: _HALF_PAIRS}
_HEADERS = {dtypes.q4_k: _k4_headers, dtypes.q5_k: _k4_headers}
FORMATS = {dt: BlockFormat(dt, "q8_k", sub, level, _float_scale(ints), decode, unroll, _WIDE.get(dt, ()), mins,
                          _HEADERS.get(dt), int_scale=ints)
           for dt, sub, unroll, mins, level, ints, decode in _TABLE}
