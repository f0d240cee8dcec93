"""The one table of element types (plain numeric types and GGUF block types), and avals.

A dtype knows its ggml type id, how many elements one block holds and how many bytes
that block takes. Plain types have a block of one element. An aval is a shape of dims
and a dtype; subscripting a dtype makes one: ``f32["T", 640]``, ``q4_k[1024, 640]``.
"""
from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np

from ggraph.ir.dims import Sym, as_dim, eval_dim


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

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of ``n`` elements; ``n`` must be a whole number of blocks."""
        if n % self.block_size:
            raise ValueError(f"{self.name}: row length {n} is not a multiple of the block size {self.block_size}")
        return n // self.block_size * self.type_size

    def nbytes(self, shape) -> int:
        """Bytes of a tensor of numpy ``shape`` (innermost dim last)."""
        return math.prod(int(d) for d in shape[:-1]) * self.row_bytes(int(shape[-1])) if shape else self.type_size

    def __getitem__(self, shape) -> "Aval":
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
    ("mxfp4",   39,    32,    17,  None),   # OCP MX: an e8m0 exponent, 16 bytes of e2m1 nibbles (gpt-oss experts)
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
mxfp4: DType

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


# ---------------------------------------------------------------------------------------
# avals
# ---------------------------------------------------------------------------------------

class Aval:
    """An abstract value: a shape of dims and a dtype. ``f32["T", 640]`` builds one."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: Sequence, dtype: DType | str):
        self.shape = tuple(as_dim(d) for d in shape)
        self.dtype = from_name(dtype)

    def check_blocks(self) -> None:
        """Raise unless the innermost dim is a whole number of blocks (ops that read blocks call this)."""
        if self.dtype.is_quantized and self.shape and isinstance(self.shape[-1], int) \
                and self.shape[-1] % self.dtype.block_size:
            raise ValueError(f"{self}: innermost dim {self.shape[-1]} is not a multiple of "
                             f"the {self.dtype} block size {self.dtype.block_size}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def symbols(self) -> set[str]:
        return {n for d in self.shape if isinstance(d, Sym) for n in d.names}

    def concrete(self, env: dict[str, int]) -> tuple[int, ...]:
        return tuple(eval_dim(d, env) for d in self.shape)

    def numel(self, env: dict[str, int] | None = None) -> int:
        """Elements, with the symbols bound by ``env``."""
        return math.prod(self.concrete(env or {}))

    def nbytes(self, env: dict[str, int] | None = None) -> int:
        return self.dtype.nbytes(self.concrete(env or {}))

    def update(self, shape=None, dtype=None) -> "Aval":
        return Aval(self.shape if shape is None else shape, self.dtype if dtype is None else dtype)

    def __eq__(self, other):
        return isinstance(other, Aval) and self.shape == other.shape and self.dtype is other.dtype

    def __hash__(self):
        return hash((self.shape, self.dtype.name))

    def __str__(self):
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"

    __repr__ = __str__


class DimAval(Aval):
    """The aval of a scalar i32 input that binds a symbolic dim by its value."""

    __slots__ = ("symbol",)

    def __init__(self, symbol: str):
        super().__init__((), _BY_NAME["i32"])
        if not re.fullmatch(r"[A-Za-z_]\w*", symbol):
            raise ValueError(f"bad symbol name {symbol!r}")
        self.symbol = symbol

    def __eq__(self, other):
        return isinstance(other, DimAval) and other.symbol == self.symbol

    def __hash__(self):
        return hash(("dim", self.symbol))


class ParamAval(Aval):
    """The aval of a weight: it carries the name of its source tensor (a GGUF tensor name)."""

    __slots__ = ("source",)

    def __init__(self, source: str, aval: Aval):
        super().__init__(aval.shape, aval.dtype)
        self.source = source

    def __eq__(self, other):
        return isinstance(other, ParamAval) and Aval.__eq__(self, other) and other.source == self.source

    def __hash__(self):
        return hash((self.source, self.shape))


def dim(symbol: str) -> DimAval:
    """Declare a scalar i32 input whose value binds ``symbol``, e.g. ``dim("P")`` for the past length."""
    return DimAval(symbol)


def param(source: str, aval: Aval) -> ParamAval:
    """Declare a weight read from tensor ``source``: ``param("blk.0.attn_q.weight", q4_k[1024, 640])``."""
    return ParamAval(source, aval)
