"""The GGUF format's constants and value types, shared by the reader and the writer.

See ``../shared/reference/GGUF_AND_QUANTS.md``: a 24-byte header, metadata key/value
pairs with a u32 value type each, tensor infos of ``24 + len(name) + 8·n_dims`` bytes,
and tensor data aligned to ``general.alignment`` (32 by default).
"""
from __future__ import annotations

import re
import struct
from typing import NamedTuple

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_NAME_BYTES = 63    # ggml's GGML_MAX_NAME is 64, including the NUL
EAGER_MAX = 1024       # arrays up to this many elements become lists; longer ones stay in the mapping
HEADER_BYTES = 24      # magic, version, tensor_count, kv_count
MIN_KV_BYTES = 8 + 1 + 4 + 1             # key length, a non-empty key, value type, a 1-byte value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")


class VType(NamedTuple):
    """A GGUF metadata value type."""
    code: int
    name: str
    fmt: str | None        # struct format of one element; None for str and arr
    np_dtype: np.dtype | None

    @property
    def size(self) -> int:
        return struct.calcsize(self.fmt)


#                 code  name    struct  numpy
VTYPES = [VType(0,  "u8",   "<B", np.dtype("<u1")),
           VType(1,  "i8",   "<b", np.dtype("<i1")),
           VType(2,  "u16",  "<H", np.dtype("<u2")),
           VType(3,  "i16",  "<h", np.dtype("<i2")),
           VType(4,  "u32",  "<I", np.dtype("<u4")),
           VType(5,  "i32",  "<i", np.dtype("<i4")),
           VType(6,  "f32",  "<f", np.dtype("<f4")),
           VType(7,  "bool", "<B", np.dtype("<u1")),   # one byte, 0 or 1
           VType(8,  "str",  None, None),              # u64 length + UTF-8 bytes
           VType(9,  "arr",  None, None),              # u32 element type, u64 count, elements
           VType(10, "u64",  "<Q", np.dtype("<u8")),
           VType(11, "i64",  "<q", np.dtype("<i8")),
           VType(12, "f64",  "<d", np.dtype("<f8"))]
VTYPE_BY_CODE = {t.code: t for t in VTYPES}
STRUCTS = {t.code: struct.Struct(t.fmt) for t in VTYPES if t.fmt}
VTYPE_BY_NAME = {t.name: t for t in VTYPES}
STR, ARR, BOOL = VTYPE_BY_NAME["str"], VTYPE_BY_NAME["arr"], VTYPE_BY_NAME["bool"]

# keys whose value type llama.cpp checks exactly (gguf.cpp for the alignment,
# llama-model-loader's GKV::get_kv for the rest); a wrong type here is a broken file
KEY_TYPES = {"general.alignment": "u32", "general.architecture": "str",
             "split.no": "u16", "split.count": "u16", "split.tensors.count": "i32"}


class GGUFError(ValueError):
    """A malformed or unsupported GGUF file; the message names the field and its byte offset."""

    def __init__(self, path: str, field: str, offset: int | None, problem: str):
        where = field if offset is None else f"{field} at byte {offset}"
        super().__init__(f"{path}: {where}: {problem}")
        self.path, self.field, self.offset, self.problem = path, field, offset, problem

    def __reduce__(self):
        return (GGUFError, (self.path, self.field, self.offset, self.problem))


def align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def ggml_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` (numpy order) without its leading 1s, keeping one dim: the dims ggml's ``ggml_n_dims``
    counts, and the ones its writer stores in a tensor info."""
    keep = next((i for i, d in enumerate(shape) if d != 1), len(shape) - 1)
    return tuple(shape[keep:])
