"""The one table of element types: plain numeric types and GGUF block types.

A dtype knows its ggml type id, how many elements one block holds and how many bytes
that block takes. Plain types have a block of one element. Subscripting a dtype makes
an abstract value for tracing: ``f32["T", 640]``, ``q4_k[1024, 640]``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ggraph.core import Aval


class DType:
    """An element type. Instances are unique: compare with ``is`` or ``==``."""

    __slots__ = ("name", "ggml_id", "block_size", "type_size", "np_dtype")

    def __init__(self, name: str, ggml_id: int | None, block_size: int, type_size: int,
                 np_dtype: type | None):
        self.name = name
        self.ggml_id = ggml_id          # None for types GGUF files never carry (i8, i32 have ids 24/26)
        self.block_size = block_size    # elements per block
        self.type_size = type_size      # bytes per block
        self.np_dtype = np.dtype(np_dtype) if np_dtype is not None else None

    @property
    def is_quantized(self) -> bool:
        """True for GGUF block types (more than one element per block)."""
        return self.block_size > 1

    @property
    def is_float(self) -> bool:
        return self.name in ("f32", "f16", "bf16")

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of ``n`` elements; ``n`` must be a whole number of blocks."""
        if n % self.block_size:
            raise ValueError(f"{self.name}: row length {n} is not a multiple of the block size {self.block_size}")
        return n // self.block_size * self.type_size

    def nbytes(self, shape) -> int:
        """Bytes of a tensor of numpy ``shape`` (innermost dim last)."""
        rows = 1
        for d in shape[:-1]:
            rows *= int(d)
        return rows * self.row_bytes(int(shape[-1])) if shape else self.type_size

    def __getitem__(self, shape) -> "Aval":
        from ggraph.core import Aval
        if not isinstance(shape, tuple):
            shape = (shape,)
        return Aval(shape, self)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"ggraph.dtypes.{self.name}"

    def __reduce__(self):
        return (from_name, (self.name,))


#      name     ggml id  block  bytes  numpy
_TABLE = [
    ("f32",      0,     1,     4,  np.float32),
    ("f16",      1,     1,     2,  np.float16),
    ("q4_0",     2,    32,    18,  None),
    ("q4_1",     3,    32,    20,  None),
    ("q5_0",     6,    32,    22,  None),
    ("q5_1",     7,    32,    24,  None),
    ("q8_0",     8,    32,    34,  None),
    ("q8_1",     9,    32,    36,  None),  # activations only; gguf-py's 40 is stale
    ("q2_k",    10,   256,    84,  None),
    ("q3_k",    11,   256,   110,  None),
    ("q4_k",    12,   256,   144,  None),
    ("q5_k",    13,   256,   176,  None),
    ("q6_k",    14,   256,   210,  None),
    ("q8_k",    15,   256,   292,  None),  # activations only
    ("iq4_nl",  20,    32,    18,  None),
    ("iq4_xs",  23,   256,   136,  None),
    ("i8",      24,     1,     1,  np.int8),
    ("i32",     26,     1,     4,  np.int32),
    ("bf16",    30,     1,     2,  None),   # numpy has no bfloat16: held as raw uint16 bits
]

_BY_NAME: dict[str, DType] = {}
_BY_ID: dict[int, DType] = {}
for _name, _id, _bs, _ts, _np in _TABLE:
    _dt = DType(_name, _id, _bs, _ts, _np)
    _BY_NAME[_name] = _dt
    _BY_ID[_id] = _dt
    globals()[_name] = _dt
del _name, _id, _bs, _ts, _np, _dt

f32: DType
f16: DType
bf16: DType
i32: DType
i8: DType
q4_0: DType
q4_1: DType
q5_0: DType
q5_1: DType
q8_0: DType
q8_1: DType
q2_k: DType
q3_k: DType
q4_k: DType
q5_k: DType
q6_k: DType
q8_k: DType
iq4_nl: DType
iq4_xs: DType

ALL: tuple[DType, ...] = tuple(_BY_NAME.values())
QUANTIZED: tuple[DType, ...] = tuple(d for d in ALL if d.block_size > 1)


def from_name(name: str | DType) -> DType:
    """The dtype called ``name`` (case-insensitive); a DType passes through."""
    if isinstance(name, DType):
        return name
    try:
        return _BY_NAME[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(_BY_NAME)}") from None


def from_ggml_id(type_id: int) -> DType:
    """The dtype with ggml type id ``type_id``; raises ValueError naming the id."""
    try:
        return _BY_ID[int(type_id)]
    except KeyError:
        raise ValueError(f"unsupported ggml type id {type_id}; supported: "
                         + ", ".join(f"{d.name}={d.ggml_id}" for d in ALL)) from None


def from_numpy(dtype) -> DType:
    """The dtype of a numpy array's element type."""
    dtype = np.dtype(dtype)
    for d in ALL:
        if d.np_dtype is not None and d.np_dtype == dtype:   # np.dtype(None) is float64
            return d
    raise ValueError(f"numpy dtype {dtype} has no ggraph dtype")
