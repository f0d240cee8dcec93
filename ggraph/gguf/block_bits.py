"""The bit layouts both sides of a GGUF block format share: the dequantisers (``quants.py``) unpack them,
the quantisers (``quants.py``, ``quantize_k.py``) pack them. IQ4's and MXFP4's levels, MXFP4's e8m0 scale,
the packed 6-bit scales of the k-quants, and nibble and fifth-bit packing.
"""
from __future__ import annotations

import numpy as np

# the 16 non-linear levels of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10,
                       1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)

# the 16 e2m1 values of MXFP4, doubled to integers (ggml's kvalues_mxfp4): bit 3 is the sign
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """uint8 e8m0 exponents -> float32 2^(e-127) / 2, as ggml's GGML_E8M0_TO_FP32_HALF builds the bits:
    a subnormal for e < 2, else the exponent field e - 1 (the half undoes MXFP4_VALUES' doubling)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) packed 6-bit scales of Q4_K/Q5_K -> (sc, m), each (n, 8) uint8.

    Bytes 0-3 hold sc0-3 (low 6 bits) and the top 2 bits of sc4-7; bytes 4-7 hold m0-3
    and the top 2 bits of m4-7; bytes 8-11 hold the low 4 bits of sc4-7 (low nibble)
    and of m4-7 (high nibble).
    """
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]                       # (n, 4) each
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, m


def q3_k_scales(s: np.ndarray) -> np.ndarray:
    """(n, 12) packed 6-bit scales of Q3_K -> (n, 16) int8 in [-32, 31].

    Low 4 bits: bytes 0-7, low nibbles for scales 0-7, high nibbles for 8-15.
    High 2 bits: bytes 8-11, byte 8 + j%4 at shift 2*(j//4).
    """
    n = s.shape[0]
    low = np.concatenate([s[:, :8] & 15, s[:, :8] >> 4], axis=1)      # (n, 16)
    high = s[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)
    high = (high & np.uint8(3)).reshape(n, 16)                        # (n, 16)
    return (low | (high << 4)).astype(np.int8) - np.int8(32)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) values < 16 -> (n, 16) bytes: q[j] in the low nibble, q[j+16] in the high."""
    return (q[:, :16] & np.uint8(15)) | (q[:, 16:] << np.uint8(4))


def pack_bit4_u32(q: np.ndarray) -> np.ndarray:
    """(n, 32) 5-bit values -> (n, 4) bytes of a u32 whose bit j is bit 4 of q[j]."""
    return np.packbits(q >> np.uint8(4), axis=1, bitorder="little")
