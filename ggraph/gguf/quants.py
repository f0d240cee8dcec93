"""Numpy reference for the GGUF block formats: dequantise every type, quantise every float one.

The simple quantisers (scale from a block's extremes) are here; the k-quants, IQ4_* and
the imatrix-weighted Q4_0..Q5_1 search for their scales and live in ``quantize_k.py``;
``quantize`` routes to it. The bit layouts both sides share are in ``block_bits.py``.

This file is the spec the LLVM kernels are tested against, so each format is one small
function that reads like the layout in ggml-common.h. Conventions:

- A dequantiser takes ``blocks``, a ``(n, type_size)`` uint8 array (one row per block),
  and returns ``(n, block_size)`` float32. A quantiser does the reverse.
- fp16 scales are widened to f32 first; products are grouped exactly as ggml and gguf-py
  group them (``(d*sc)*q - (dmin*m)``), so results match gguf-py bit for bit.
- "nibbles of a group of G bytes" means: the G low nibbles come first, then the G high
  nibbles. Q4_0 uses G=16, Q4_K G=32, Q6_K G=64. 2-bit fields ("crumbs") are the same
  idea with four shifts (0, 2, 4, 6) over a group of 32 bytes.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ggraph.gguf import quantize_k
from ggraph.gguf.block_bits import (IQ4_VALUES, MXFP4_VALUES, e8m0_half, k_scale_min, pack_bit4_u32, pack_nibbles,
                                    q3_k_scales)
from ggraph.ir import dtypes
from ggraph.ir.dtypes import DType

QK_K = 256  # elements in a K-quant super-block

# byte offsets of each block type's f16 fields (d, and dmin where it has one): what random blocks must
# hold finite, small values in to be sane weights
F16_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "q8_1": (0, 2),
              "iq4_nl": (0,), "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2),
              "q6_k": (208,), "iq4_xs": (0,), "mxfp4": ()}
# byte offsets of each block type's e8m0 exponent (a power-of-two scale): random blocks hold ones near 127
E8M0_FIELDS = {"mxfp4": (0,)}

_CHUNK = 1 << 16  # elements per step: keeps the temporaries of a step in L2, not in RAM


# ---------------------------------------------------------------- unpacking helpers

def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 little-endian halves -> (n, 1) float32."""
    return b.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """(n, k*group) bytes -> (n, 2*k*group) 4-bit values: per group, low nibbles then high."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """(n, k*32) bytes -> (n, 4*k*32) 2-bit values: per 32 bytes, shift 0, 2, 4, then 6."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (q & np.uint8(3)).reshape(n, -1)


def _bit_planes(h: np.ndarray) -> np.ndarray:
    """(n, 32) bytes -> (n, 256) bits: element i is bit i//32 of byte i%32 (Q3_K, Q5_K)."""
    n = h.shape[0]
    q = h.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return (q & np.uint8(1)).reshape(n, 256)


def _high_bits_u32(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian u32 -> (n, 32) bits: element i is bit i (Q5_0, Q5_1)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


# ---------------------------------------------------------------- dequantisers

def _deq_f32(b):
    """(n, 4) -> (n, 1): plain float32."""
    return b.view(np.float32)


def _deq_f16(b):
    """(n, 2) -> (n, 1): IEEE half widened to float32."""
    return b.view(np.float16).astype(np.float32)


def _deq_bf16(b):
    """(n, 2) -> (n, 1): bf16 is the top half of a float32."""
    return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _deq_i8(b):
    """(n, 1) -> (n, 1): int8 values as float32."""
    return b.view(np.int8).astype(np.float32)


def _deq_i32(b):
    """(n, 4) -> (n, 1): int32 values as float32."""
    return b.view(np.int32).astype(np.float32)


def _deq_q4_0(b):
    """(n, 18) -> (n, 32): d f16 @0, qs[16] @2; x = d*(q-8)."""
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18], 16).astype(np.int8) - np.int8(8)
    return d * q


def _deq_q4_1(b):
    """(n, 20) -> (n, 32): d @0, m @2, qs[16] @4; x = d*q + m."""
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return d * _nibbles(b[:, 4:20], 16) + m


def _deq_q5_0(b):
    """(n, 22) -> (n, 32): d @0, qh u32 @2, qs[16] @6; x = d*((nib | bit<<4) - 16)."""
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 6:22], 16) | (_high_bits_u32(b[:, 2:6]) << 4)
    return d * (q.astype(np.int8) - np.int8(16))


def _deq_q5_1(b):
    """(n, 24) -> (n, 32): d @0, m @2, qh u32 @4, qs[16] @8; x = d*q + m."""
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:24], 16) | (_high_bits_u32(b[:, 4:8]) << 4)
    return d * q + m


def _deq_q8_0(b):
    """(n, 34) -> (n, 32): d @0, int8 qs[32] @2; x = d*q."""
    return _f16(b[:, 0:2]) * b[:, 2:34].view(np.int8)


def _deq_q8_1(b):
    """(n, 36) -> (n, 32): d @0, s=d*sum(q) @2, int8 qs[32] @4; x = d*q (s is for dot products)."""
    return _f16(b[:, 0:2]) * b[:, 4:36].view(np.int8)


def _deq_q2_k(b):
    """(n, 84) -> (n, 256): scales[16] @0 (sc | m<<4), qs[64] @16, d @80, dmin @82."""
    n = b.shape[0]
    s = b[:, 0:16]                                                    # (n, 16)
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (s & 15))[:, :, None]                                   # (n, 16, 1)
    ml = (dmin * (s >> 4))[:, :, None]                                # (n, 16, 1)
    q = _crumbs(b[:, 16:80]).reshape(n, 16, 16)                       # (n, 16, 16)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q3_k(b):
    """(n, 110) -> (n, 256): hmask[32] @0, qs[64] @32, scales[12] @96, d @108."""
    n = b.shape[0]
    d = _f16(b[:, 108:110])
    dl = (d * q3_k_scales(b[:, 96:108]))[:, :, None]                  # (n, 16, 1)
    low = _crumbs(b[:, 32:96]).astype(np.int8)                        # (n, 256)
    h = _bit_planes(b[:, 0:32]).astype(np.int8)                       # (n, 256)
    q = (low - ((1 - h) << 2)).reshape(n, 16, 16)                     # subtract 4 where the bit is 0
    return (dl * q).reshape(n, QK_K)


def _deq_q4_k(b):
    """(n, 144) -> (n, 256): d @0, dmin @2, scales[12] @4, qs[128] @16."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = k_scale_min(b[:, 4:16])
    q = _nibbles(b[:, 16:144], 32).reshape(n, 8, 32)                  # (n, 8, 32)
    return ((d * sc)[:, :, None] * q - (dmin * m)[:, :, None]).reshape(n, QK_K)


def _deq_q5_k(b):
    """(n, 176) -> (n, 256): d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = k_scale_min(b[:, 4:16])
    q = _nibbles(b[:, 48:176], 32) | (_bit_planes(b[:, 16:48]) << 4)
    q = q.reshape(n, 8, 32)                                           # (n, 8, 32)
    return ((d * sc)[:, :, None] * q - (dmin * m)[:, :, None]).reshape(n, QK_K)


def _deq_q6_k(b):
    """(n, 210) -> (n, 256): ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208."""
    n = b.shape[0]
    d = _f16(b[:, 208:210])
    dl = (d * b[:, 192:208].view(np.int8))[:, :, None]                # (n, 16, 1)
    q = _nibbles(b[:, 0:128], 64) | (_crumbs(b[:, 128:192]) << 4)      # (n, 256) in 0..63
    q = (q.astype(np.int8) - np.int8(32)).reshape(n, 16, 16)
    return (dl * q).reshape(n, QK_K)


def _deq_q8_k(b):
    """(n, 292) -> (n, 256): f32 d @0, int8 qs[256] @4, int16 bsums[16] @260; x = d*q."""
    return b[:, 0:4].view(np.float32) * b[:, 4:260].view(np.int8)


def _deq_iq4_nl(b):
    """(n, 18) -> (n, 32): d @0, qs[16] @2; x = d*IQ4_VALUES[q]."""
    return _f16(b[:, 0:2]) * IQ4_VALUES[_nibbles(b[:, 2:18], 16)]


def _deq_iq4_xs(b):
    """(n, 136) -> (n, 256): d @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8."""
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    lo = _nibbles(b[:, 4:8], 1)                                       # (n, 8): nibble ib%2 of byte ib//2
    hi = (b[:, 2:4].view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3   # (n, 8)
    ls = (lo | (hi.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    dl = (d * ls)[:, :, None]                                         # (n, 8, 1)
    q = IQ4_VALUES[_nibbles(b[:, 8:136], 16)].reshape(n, 8, 32)       # (n, 8, 32)
    return (dl * q).reshape(n, QK_K)


def _deq_mxfp4(b):
    """(n, 17) -> (n, 32): e (e8m0) @0, qs[16] @1; x = MXFP4_VALUES[q] * 2^(e-127)/2 (inf past FLT_MAX, as ggml)."""
    with np.errstate(over="ignore"):
        return e8m0_half(b[:, 0:1]) * MXFP4_VALUES[_nibbles(b[:, 1:17], 16)]


_DEQUANT = {
    dtypes.f32: _deq_f32, dtypes.f16: _deq_f16, dtypes.bf16: _deq_bf16,
    dtypes.i8: _deq_i8, dtypes.i32: _deq_i32,
    dtypes.q4_0: _deq_q4_0, dtypes.q4_1: _deq_q4_1,
    dtypes.q5_0: _deq_q5_0, dtypes.q5_1: _deq_q5_1,
    dtypes.q8_0: _deq_q8_0, dtypes.q8_1: _deq_q8_1,
    dtypes.q2_k: _deq_q2_k, dtypes.q3_k: _deq_q3_k, dtypes.q4_k: _deq_q4_k,
    dtypes.q5_k: _deq_q5_k, dtypes.q6_k: _deq_q6_k, dtypes.q8_k: _deq_q8_k,
    dtypes.iq4_nl: _deq_iq4_nl, dtypes.iq4_xs: _deq_iq4_xs, dtypes.mxfp4: _deq_mxfp4,
}


# ---------------------------------------------------------------- quantisation helpers

def _to_f16_bytes(v: np.ndarray) -> np.ndarray:
    """(n, 1) float32 -> (n, 2) uint8 of IEEE halves (round to nearest even)."""
    return v.astype(np.float16).view(np.uint8)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1/d in float32, and 0 where d == 0 (ggml's ``id = d ? 1.0f/d : 0.0f``)."""
    out = np.zeros_like(d)
    np.divide(np.float32(1), d, out=out, where=d != 0)
    return out


def _round_away(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: nearest integer, halves away from zero (np.rint would go to even)."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= np.float32(0.5), np.sign(v), np.float32(0))


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """(n, k) -> (n, 1): the first value of largest magnitude, with its sign; +0 if all are zero."""
    mx = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    return np.where(mx != 0, mx, np.float32(0))                       # ggml starts from max = 0: never -0


def _first_min_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, k) -> lo, hi (n, 1): C's running ``if (v < min) min = v`` (and max) keep the first
    of equal values, so a block of 0 and -0 gets the sign ggml gives it; np.min may not."""
    lo = np.take_along_axis(x, x.argmin(axis=1)[:, None], axis=1)
    hi = np.take_along_axis(x, x.argmax(axis=1)[:, None], axis=1)
    return lo, hi


# ---------------------------------------------------------------- quantisers (ggml's *_ref)

def _q_f32(x):
    """(n, 1) -> (n, 4)."""
    return x.view(np.uint8)


def _q_f16(x):
    """(n, 1) -> (n, 2): round to nearest even."""
    return x.astype(np.float16).view(np.uint8)


def _q_bf16(x):
    """(n, 1) -> (n, 2): top half of the float32, rounded to nearest even, NaNs kept quiet."""
    u = x.view(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    u = np.where(nan, (u & np.uint32(0xFFFF0000)) | np.uint32(0x00400000), u).astype(np.uint64)
    u = (u + (np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1)))) >> np.uint64(16)
    return u.astype(np.uint16).view(np.uint8)


def _q_q4_0(x):
    """(n, 32) -> (n, 18): d = max/-8 (max signed), q = min(15, trunc(x/d + 8.5))."""
    d = _signed_absmax(x) / np.float32(-8)                            # (n, 1)
    q = np.minimum(np.trunc(x * _inverse(d) + np.float32(8.5)), 15).astype(np.uint8)
    return np.concatenate([_to_f16_bytes(d), pack_nibbles(q)], axis=1)


def _q_q4_1(x):
    """(n, 32) -> (n, 20): d = (max-min)/15, m = min, q = min(15, trunc((x-m)/d + 0.5))."""
    lo, hi = _first_min_max(x)
    d = (hi - lo) / np.float32(15)
    q = np.minimum(np.trunc((x - lo) * _inverse(d) + np.float32(0.5)), 15).astype(np.uint8)
    return np.concatenate([_to_f16_bytes(d), _to_f16_bytes(lo), pack_nibbles(q)], axis=1)


def _q_q5_0(x):
    """(n, 32) -> (n, 22): d = max/-16, q = min(31, trunc(x/d + 16.5))."""
    d = _signed_absmax(x) / np.float32(-16)
    q = np.minimum(np.trunc(x * _inverse(d) + np.float32(16.5)), 31).astype(np.uint8)
    return np.concatenate([_to_f16_bytes(d), pack_bit4_u32(q), pack_nibbles(q)], axis=1)


def _q_q5_1(x):
    """(n, 32) -> (n, 24): d = (max-min)/31, m = min, q = min(31, trunc((x-m)/d + 0.5))."""
    lo, hi = _first_min_max(x)
    d = (hi - lo) / np.float32(31)
    q = np.minimum(np.trunc((x - lo) * _inverse(d) + np.float32(0.5)), 31).astype(np.uint8)
    return np.concatenate([_to_f16_bytes(d), _to_f16_bytes(lo), pack_bit4_u32(q),
                           pack_nibbles(q)], axis=1)


def _q8_ref(x):
    """(n, 32) -> d (n, 1), q (n, 32) int8: ggml's *_ref: d = amax/127, q = roundf(x * (1/d))."""
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    return d, _round_away(x * _inverse(d)).astype(np.int8)


def _q8_x86(x):
    """(n, 32) -> d (n, 1), q (n, 32) int8: ggml's AVX path: q = rint(x * (127/amax)), halves to even."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    iscale = np.zeros_like(amax)
    np.divide(np.float32(127), amax, out=iscale, where=amax != 0)
    return amax / np.float32(127), np.rint(x * iscale).astype(np.int8)


def _pack_q8_0(d, q):
    """d (n, 1), q (n, 32) -> (n, 34): d f16, qs."""
    return np.concatenate([_to_f16_bytes(d), q.view(np.uint8)], axis=1)


def _pack_q8_1(d, q):
    """d (n, 1), q (n, 32) -> (n, 36): d f16, s = d*sum(q) f16, qs."""
    s = q.sum(axis=1, keepdims=True, dtype=np.int32).astype(np.float32) * d
    return np.concatenate([_to_f16_bytes(d), _to_f16_bytes(s), q.view(np.uint8)], axis=1)


def _q_q8_0(x):
    """(n, 32) -> (n, 34): reference q8_0 (as gguf-py and quantize_row_q8_0_ref)."""
    return _pack_q8_0(*_q8_ref(x))


def _q_q8_1(x):
    """(n, 32) -> (n, 36): reference q8_1 (quantize_row_q8_1_ref)."""
    return _pack_q8_1(*_q8_ref(x))


def _qa_q8_0(x):
    """(n, 32) -> (n, 34): q8_0 as llama.cpp's x86 CPU backend quantises activations."""
    return _pack_q8_0(*_q8_x86(x))


def _qa_q8_1(x):
    """(n, 32) -> (n, 36): q8_1 as llama.cpp's x86 CPU backend quantises activations."""
    return _pack_q8_1(*_q8_x86(x))


def _q_q8_k(x):
    """(n, 256) -> (n, 292): iscale = -127/max (max signed), q = min(127, rint(iscale*x)), d = 1/iscale."""
    n = x.shape[0]
    iscale = np.zeros((n, 1), np.float32)
    mx = _signed_absmax(x)
    np.divide(np.float32(-127), mx, out=iscale, where=mx != 0)
    q = np.minimum(np.rint(iscale * x), 127).astype(np.int8)          # rint: ggml's nearest_int
    bsums = q.reshape(n, 16, 16).sum(axis=2, dtype=np.int16)           # (n, 16)
    d = _inverse(iscale)
    return np.concatenate([d.view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)], axis=1)


def _q_mxfp4(x):
    """(n, 32) -> (n, 17): e = floor(log2(amax)) - 2 + 127 (0 for an all-zero block), q = the first of
    the nearest MXFP4_VALUES * d (ggml's best_index_mxfp4), d = 2^(e-127)/2; as quantize_row_mxfp4_ref."""
    amax = np.abs(x).max(axis=1, keepdims=True)                       # (n, 1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - np.float32(2) + np.float32(127), 0).astype(np.uint8)
    d = e8m0_half(e)                                                  # (n, 1)
    err = np.abs(d[:, :, None] * MXFP4_VALUES - x[:, :, None])       # (n, 32, 16)
    q = err.argmin(axis=2).astype(np.uint8)                           # argmin keeps the first of ties, as C's <
    return np.concatenate([e, pack_nibbles(q)], axis=1)


_QUANT = {
    dtypes.f32: _q_f32, dtypes.f16: _q_f16, dtypes.bf16: _q_bf16,
    dtypes.q4_0: _q_q4_0, dtypes.q4_1: _q_q4_1,
    dtypes.q5_0: _q_q5_0, dtypes.q5_1: _q_q5_1,
    dtypes.q8_0: _q_q8_0, dtypes.q8_1: _q_q8_1, dtypes.q8_k: _q_q8_k, dtypes.mxfp4: _q_mxfp4,
}

# the activation (vec_dot_type) quantisers of llama.cpp's x86 backend; its q8_k is the reference
_QUANT_ACT = {dtypes.q8_0: _qa_q8_0, dtypes.q8_1: _qa_q8_1, dtypes.q8_k: _q_q8_k}


# ---------------------------------------------------------------- public API

_SEARCHED = tuple(quantize_k.SEARCHED)          # the types whose scales quantize_k.py searches for

DEQUANTIZABLE: tuple[DType, ...] = tuple(_DEQUANT)
QUANTIZABLE: tuple[DType, ...] = tuple(_QUANT) + _SEARCHED


def _supported(dtype, supported, what: str) -> DType:
    """The dtype called ``dtype``; ValueError naming it unless it is in ``supported``."""
    dt = dtypes.from_name(dtype)
    if dt not in supported:
        raise ValueError(f"{what}: unsupported dtype {dt.name}; supported: "
                         + ", ".join(d.name for d in supported))
    return dt


def _lookup(table: dict, dtype, what: str) -> tuple[DType, Callable]:
    """The dtype and its function in ``table``; ValueError naming the dtype if it has none."""
    dt = _supported(dtype, table, what)
    return dt, table[dt]


def _check_row(dt: DType, shape: tuple[int, ...], what: str) -> None:
    """Raise ValueError unless the innermost dim is a whole number of blocks."""
    if not shape:
        raise ValueError(f"{what}: {dt.name} needs at least one dimension, got shape ()")
    if shape[-1] % dt.block_size:
        raise ValueError(f"{what}: {dt.name} innermost dim {shape[-1]} is not a multiple "
                         f"of its block size {dt.block_size}")


def _map_blocks(fn: Callable, src: np.ndarray, out: np.ndarray, block_size: int) -> np.ndarray:
    """out[i] = fn(src[i]) for every block, a chunk of about _CHUNK elements at a time."""
    step = max(1, _CHUNK // block_size)
    for i in range(0, src.shape[0], step):
        out[i:i + step] = fn(src[i:i + step])
    return out


def dequantize(data: np.ndarray, dtype, shape) -> np.ndarray:
    """Raw block bytes of a tensor of numpy ``shape`` -> float32 array of that shape."""
    dt, fn = _lookup(_DEQUANT, dtype, "dequantize")
    shape = tuple(int(s) for s in shape)
    _check_row(dt, shape, "dequantize")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        got = data.dtype if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"dequantize: {dt.name} data must be a uint8 array of block bytes, got {got}")
    want = dt.nbytes(shape)
    if data.nbytes != want:
        raise ValueError(f"dequantize: {dt.name}{list(shape)} needs {want} bytes, got {data.nbytes}")
    blocks = np.ascontiguousarray(data).reshape(-1, dt.type_size)    # (n, type_size), a view
    out = np.empty((blocks.shape[0], dt.block_size), np.float32)      # (n, block_size)
    return _map_blocks(fn, blocks, out, dt.block_size).reshape(shape)


def _quantize_with(table: dict, array, dtype, what: str) -> np.ndarray:
    """Quantise ``array`` row by row with the function ``table`` holds for ``dtype``."""
    dt, fn = _lookup(table, dtype, what)
    x = np.asarray(array).astype(np.float32, copy=False)
    _check_row(dt, x.shape, what)
    blocks = np.ascontiguousarray(x).reshape(-1, dt.block_size)       # (n, block_size)
    out = np.empty((blocks.shape[0], dt.type_size), np.uint8)         # (n, type_size)
    return _map_blocks(fn, blocks, out, dt.block_size).reshape(*x.shape[:-1], dt.row_bytes(x.shape[-1]))


def _check_imatrix(dt: DType, imatrix, n_per_row: int) -> np.ndarray | None:
    """None, or ``imatrix`` as a float32 vector of n_per_row finite non-negative weights."""
    if imatrix is None:
        return None
    try:
        w = np.asarray(imatrix, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"quantize: {dt.name} imatrix is not an array of numbers ({e})") from None
    if w.shape != (n_per_row,):
        raise ValueError(f"quantize: {dt.name} imatrix has shape {list(w.shape)}, "
                         f"expected [{n_per_row}] (one weight per element of a row)")
    bad = np.flatnonzero(~(np.isfinite(w) & (w >= 0)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"quantize: {dt.name} imatrix[{i}] is {w[i]}; "
                         f"weights must be finite and non-negative")
    return w


def quantize(array, dtype, imatrix=None) -> np.ndarray:
    """float array -> uint8 block bytes, shape (*array.shape[:-1], row_bytes), as llama-quantize makes them.

    The bytes are those of ggml's ``ggml_quantize_chunk`` over the rows of ``array`` (of
    ``quantize_row_*_ref`` for q8_1 and q8_k, which it does not offer).
    ``imatrix`` is None or one non-negative weight per element of a row (length
    array.shape[-1], shared by every row, as llama-imatrix computes it). With it the
    k-quants, IQ4_* and Q4_0..Q5_1 minimise the weighted error; f32, f16, bf16, the
    Q8 types and mxfp4 ignore it, as llama.cpp does.
    """
    dt = _supported(dtype, QUANTIZABLE, "quantize")
    x = np.asarray(array).astype(np.float32, copy=False)
    _check_row(dt, x.shape, "quantize")
    qw = _check_imatrix(dt, imatrix, x.shape[-1])
    if dt in _SEARCHED or (qw is not None and dt in quantize_k.WEIGHTED_LEGACY):
        rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])        # (rows, n_per_row)
        return quantize_k.quantize_rows(rows, dt, qw).reshape(*x.shape[:-1], dt.row_bytes(x.shape[-1]))
    return _quantize_with(_QUANT, x, dt, "quantize")


def quantize_activations(array, dtype) -> np.ndarray:
    """float array -> q8_0/q8_1/q8_k bytes exactly as llama.cpp's x86 backend quantises activations."""
    return _quantize_with(_QUANT_ACT, array, dtype, "quantize_activations")
