"""The GGUF writer: metadata with inferred or explicit (``Typed``) value types, tensors aligned.

    write("model.gguf", {"general.architecture": "llama", ...}, {"token_embd.weight": array, ...})

A tensor may also be ``Deferred(dtype, shape, produce)``: the header needs only its type and
shape, and ``produce()`` is called for its bytes when the writer reaches it, so a whole model
can be converted one tensor at a time. ``typed_metadata(gguf_file)`` gives a file's metadata
with every value's GGUF type kept, ready to write again. ``header(metadata, tensors)`` gives only
the bytes before the tensor data, the metadata exactly as given, for a caller that streams the
tensor bytes itself (``ggraph.split``).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ggraph.ir import dtypes
from ggraph.gguf.format import (ARR, BOOL, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS, MAX_NAME_BYTES, STR, U32, U64,
                                VTYPE_BY_NAME, VTYPES, VType, align)
from ggraph.gguf.reader import StringArray


@dataclass(frozen=True)
class Typed:
    """A metadata value with an explicit GGUF type: ``Typed(7, "i32")``, ``Typed([1, 2], "u16")``.

    For a list, tuple or array value the type names the element type.
    """
    value: object
    type: str


@dataclass(frozen=True)
class Deferred:
    """A tensor whose bytes are made only when the writer reaches it: ``produce()`` returns them
    (a uint8 array or bytes-like of exactly ``dtype.nbytes(shape)`` bytes)."""
    dtype: object
    shape: tuple
    produce: Callable[[], object]


def typed_metadata(f) -> dict:
    """An open GGUFFile's metadata as ``Typed`` values, in file order, each with its GGUF type."""
    out = {}
    for key, value in f.metadata.items():
        t = f.metadata_types[key]
        elem = t[4:-1] if t.startswith("arr[") else t
        out[key] = Typed(list(value) if t.startswith("arr[") else value, elem)
    return out


_NP_VTYPES = {t.np_dtype: t for t in VTYPES if t.np_dtype is not None and t is not BOOL}
_NP_VTYPES[np.dtype(bool)] = BOOL


def write(path: str | os.PathLike, metadata: dict, tensors: dict, alignment: int = DEFAULT_ALIGNMENT) -> None:
    """Write a GGUF v3 file.

    ``metadata``: key -> value. Types are inferred unless wrapped in ``Typed``:
    bool -> bool; int -> u32 if 0 <= v < 2**32, else i64 (u64 above that); float -> f32;
    str -> str; numpy scalars keep their dtype; a list/tuple/1-D array -> an array whose
    element type follows the same rules (ints: u32 if all fit, else i64; any float: f32;
    a numpy array's dtype maps directly). llama.cpp checks hparam types exactly and its
    hparams are u32, which is why ints default to u32.

    ``tensors``: name -> a numpy array (float32, float16, int8 or int32; written as
    that type), ``(raw_uint8_bytes, dtype, shape)`` for block types, with ``dtype`` a
    DType or name and ``shape`` in numpy order, or a ``Deferred``. ``general.alignment`` is written when
    ``alignment`` is not 32.

    The file is written as ``path + ".partial"`` and renamed to ``path`` once complete, so a
    failure (a Deferred that raises, a full disk) leaves no half-written file, and a reader
    that maps the old ``path`` keeps its own, whole copy.
    """
    _check_alignment(alignment)
    metadata = dict(metadata)
    if "general.alignment" in metadata:
        given = metadata["general.alignment"]
        given = given.value if isinstance(given, Typed) else given
        if given != alignment:
            raise ValueError(f"metadata general.alignment={given!r} disagrees with alignment={alignment}")
        del metadata["general.alignment"]
    if alignment != DEFAULT_ALIGNMENT:
        metadata["general.alignment"] = Typed(alignment, "u32")
    entries = [_tensor_entry(name, value) for name, value in tensors.items()]   # (name, shape, dtype, raw)
    partial = os.fspath(path) + ".partial"
    try:
        with open(partial, "wb") as f:
            f.write(header(metadata, [entry[:3] for entry in entries], alignment))
            for name, shape, dtype, raw in entries:
                if raw is None:
                    raw = _produced(name, shape, dtype, tensors[name].produce)
                f.write(raw.data)
                f.write(bytes(align(raw.nbytes, alignment) - raw.nbytes))
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def header(metadata: dict, tensors, alignment: int = DEFAULT_ALIGNMENT) -> bytes:
    """The bytes of a GGUF v3 file that come before its tensor data, padded to ``alignment``.

    ``metadata`` is written exactly as given, in its order (nothing added or dropped, unlike
    ``write``), so a file laid out at an ``alignment`` other than 32 must declare it as
    ``general.alignment``; a mismatch is a ValueError. ``tensors`` is a sequence of
    ``(name, shape, dtype)``, shape in numpy order: each tensor's data is placed right after
    the previous one's, padded to ``alignment``, and the caller writes it that way.
    """
    _check_alignment(alignment)
    declared = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    declared = declared.value if isinstance(declared, Typed) else declared
    if declared != alignment:
        raise ValueError(f"metadata general.alignment={declared!r} disagrees with alignment={alignment}")
    head = [MAGIC, struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    head += [_pack_str(key) + _encode_value(key, value) for key, value in _checked_keys(metadata)]
    offset = 0
    for name, shape, dtype in tensors:
        head.append(_pack_str(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *reversed(shape),
                                                  dtype.ggml_id, offset))
        offset += align(dtype.nbytes(shape), alignment)
    packed = b"".join(head)
    return packed + bytes(align(len(packed), alignment) - len(packed))


def _check_alignment(alignment) -> None:
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment!r} is not a power of two")


def _checked_keys(metadata: dict):
    for key, value in metadata.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"metadata key {key!r} must be a non-empty str")
        yield key, value


def _pack_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return U64.pack(len(raw)) + raw


def _encode_value(key: str, value) -> bytes:
    """The value type code and payload bytes of one metadata value."""
    if isinstance(value, Typed):
        vt = VTYPE_BY_NAME.get(value.type)
        if vt is None or vt is ARR:
            raise ValueError(f"metadata '{key}': unknown GGUF type {value.type!r}; known: "
                             f"{', '.join(n for n in VTYPE_BY_NAME if n != 'arr')}")
        value, is_array = value.value, _is_sequence(value.value)
    else:
        is_array = _is_sequence(value)
        vt = _infer_array(key, value) if is_array else _infer_scalar(key, value)
    if not is_array:
        return U32.pack(vt.code) + _pack_scalar(key, vt, value)
    if vt is STR:
        body = b"".join(_pack_scalar(f"{key}[{i}]", vt, v) for i, v in enumerate(value))
    else:
        body = _pack_numbers(key, vt, value)
    return struct.pack("<IIQ", ARR.code, vt.code, len(value)) + body


def _pack_numbers(key: str, vt: VType, value) -> bytes:
    """Little-endian bytes of a numeric or bool array, checking kinds and ranges at once."""
    try:
        arr = np.asarray(value)   # (n,)
    except OverflowError:
        raise ValueError(f"metadata '{key}': an element does not fit in {vt.name}") from None
    if arr.ndim != 1:
        raise ValueError(f"metadata '{key}': arrays must be 1-D and not nested, got shape {arr.shape}")
    if len(arr):
        allowed = "b" if vt is BOOL else "iu" if vt.np_dtype.kind in "iu" else "iuf"
        if arr.dtype.kind not in allowed:
            raise TypeError(f"metadata '{key}': {arr.dtype} values cannot be stored as {vt.name}")
        finite = arr[np.isfinite(arr)] if arr.dtype.kind == "f" else arr   # inf and nan are fine as floats
        lo, hi = _limits(vt)
        if len(finite) and (finite.min() < lo or finite.max() > hi):
            raise ValueError(f"metadata '{key}': values {finite.min()}..{finite.max()} do not fit in {vt.name}")
    return arr.astype(np.uint8 if vt is BOOL else vt.np_dtype).tobytes()


def _limits(vt: VType):
    """Smallest and largest (finite) values of a value type; bools are 0..1."""
    if vt is BOOL:
        return 0, 1
    info = np.iinfo(vt.np_dtype) if vt.np_dtype.kind in "iu" else np.finfo(vt.np_dtype)
    return info.min, info.max


def _is_sequence(value) -> bool:
    return isinstance(value, (list, tuple, np.ndarray, StringArray))


def _infer_scalar(key: str, v) -> VType:
    if isinstance(v, str):
        return STR
    if isinstance(v, (bool, np.bool_)):
        return BOOL
    if isinstance(v, np.generic):
        return _np_vtype(key, v.dtype)
    if isinstance(v, int):
        return VTYPE_BY_NAME["u32" if 0 <= v < 2**32 else "i64" if -2**63 <= v < 2**63 else "u64"]
    if isinstance(v, float):
        return VTYPE_BY_NAME["f32"]
    raise TypeError(f"metadata '{key}': cannot store a {type(v).__name__} in GGUF")


def _np_vtype(key: str, dtype: np.dtype) -> VType:
    vt = _NP_VTYPES.get(dtype.newbyteorder("<"))
    if vt is None:
        raise TypeError(f"metadata '{key}': numpy {dtype} has no GGUF value type")
    return vt


def _infer_array(key: str, value) -> VType:
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"metadata '{key}': arrays must be 1-D, not shape {value.shape}")
        return STR if value.dtype.kind == "U" else _np_vtype(key, value.dtype)
    if not len(value):
        raise ValueError(f"metadata '{key}': cannot infer the element type of an empty array; use Typed([], 'u32')")
    kinds = {_kind(key, v) for v in value}
    if kinds == {"str"} or kinds == {"bool"}:
        return VTYPE_BY_NAME[kinds.pop()]
    if kinds == {"int"}:
        return VTYPE_BY_NAME["u32" if all(0 <= v < 2**32 for v in value) else "i64"]
    if kinds <= {"int", "float"}:
        return VTYPE_BY_NAME["f32"]
    raise TypeError(f"metadata '{key}': array mixes element kinds {sorted(kinds)}")


def _kind(key: str, v) -> str:
    if isinstance(v, (str, np.str_)):
        return "str"
    if isinstance(v, (bool, np.bool_)):
        return "bool"
    if isinstance(v, (int, np.integer)):
        return "int"
    if isinstance(v, (float, np.floating)):
        return "float"
    if _is_sequence(v):
        raise TypeError(f"metadata '{key}': nested arrays are not allowed in GGUF")
    raise TypeError(f"metadata '{key}': cannot store a {type(v).__name__} in a GGUF array")


def _pack_scalar(key: str, vt: VType, v) -> bytes:
    if vt is not STR:
        return _pack_numbers(key, vt, [v])
    if not isinstance(v, str):
        raise TypeError(f"metadata '{key}': {v!r} is not a str")
    return _pack_str(v)


def _produced(name: str, shape: tuple, dtype, produce) -> np.ndarray:
    """The bytes a Deferred tensor's ``produce()`` made, checked against its type and shape."""
    raw = produce()
    raw = np.frombuffer(raw, np.uint8) if not isinstance(raw, np.ndarray) else raw
    if raw.dtype != np.uint8 or raw.nbytes != dtype.nbytes(shape):
        raise ValueError(f"tensor '{name}': produced {raw.nbytes} bytes of {raw.dtype}, but "
                         f"{dtype.name}{list(shape)} takes {dtype.nbytes(shape)} bytes")
    return np.ascontiguousarray(raw).reshape(-1)


def _tensor_entry(name: str, value):
    """(name, shape, dtype, raw uint8 array, or None for a Deferred) of one tensor to write, validated."""
    if not isinstance(name, str) or not name or len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise ValueError(f"tensor name {name!r} must be a non-empty str of at most {MAX_NAME_BYTES} UTF-8 bytes")
    if isinstance(value, Deferred):
        try:
            dtype = dtypes.from_name(value.dtype)
        except ValueError as e:
            raise ValueError(f"tensor '{name}': {e}") from None
        shape, raw = tuple(int(d) for d in value.shape), None
    elif isinstance(value, tuple):
        if len(value) != 3:
            raise ValueError(f"tensor '{name}': expected an array or (raw_uint8_bytes, dtype, shape), "
                             f"got a {len(value)}-tuple")
        raw, dtype, shape = value
        try:
            dtype = dtypes.from_name(dtype)
        except ValueError as e:
            raise ValueError(f"tensor '{name}': {e}") from None
        shape = tuple(int(d) for d in shape)
        if not isinstance(raw, np.ndarray):
            try:
                raw = np.frombuffer(raw, np.uint8)
            except TypeError:
                raise TypeError(f"tensor '{name}': raw data must be bytes-like or a uint8 array, "
                                f"not {type(raw).__name__}") from None
        if raw.dtype != np.uint8:
            raise ValueError(f"tensor '{name}': raw bytes must be uint8, not {raw.dtype}")
        raw = np.ascontiguousarray(raw).reshape(-1)
    elif isinstance(value, np.ndarray):
        arr = value.astype(value.dtype.newbyteorder("<"), copy=False) if value.dtype.byteorder == ">" else value
        try:
            dtype = dtypes.from_numpy(arr.dtype)
        except ValueError as e:
            raise ValueError(f"tensor '{name}': {e}; cast it or pass (raw, dtype, shape)") from None
        if dtype.ggml_id is None:
            raise ValueError(f"tensor '{name}': {dtype.name} has no ggml type id")
        shape, raw = arr.shape, np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    else:
        raise TypeError(f"tensor '{name}': expected a numpy array or (raw_uint8_bytes, dtype, shape), "
                        f"got {type(value).__name__}")
    if not 1 <= len(shape) <= MAX_DIMS or min(shape) < 0:
        raise ValueError(f"tensor '{name}': shape {shape} must have 1..{MAX_DIMS} non-negative dims")
    if shape[-1] % dtype.block_size:
        raise ValueError(f"tensor '{name}': row length {shape[-1]} is not a multiple of "
                         f"{dtype.name}'s block size {dtype.block_size}")
    if raw is not None and raw.nbytes != dtype.nbytes(shape):
        raise ValueError(f"tensor '{name}': {dtype.name}{list(shape)} takes {dtype.nbytes(shape)} bytes, "
                         f"got {raw.nbytes}")
    return name, shape, dtype, raw
