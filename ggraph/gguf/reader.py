"""The GGUF reader: strict and zero-copy, over mmap.

Opening a file parses only its header (metadata and tensor infos). Tensor bytes stay in
the read-only mapping, and each ``TensorInfo.data`` is a view into it. Every malformed
byte raises ``GGUFError`` naming the field and its byte offset; no other exception
escapes for any input bytes. The format is ggml's ``docs/gguf.md``; the checks are those
of ggml's ``src/gguf.cpp`` plus a few more (UTF-8, bool bytes, exact key types).

Metadata values read back as Python values:

- scalars: ``int`` (u8 … i64), ``float`` (f32, f64), ``bool``, ``str``;
- arrays of at most ``EAGER_MAX`` elements: a ``list`` of those;
- longer numeric arrays: a read-only 1-D ``np.ndarray`` viewing the mapping (dtype
  ``<f4``, ``<i4``, …; bool arrays become a copied ``np.bool_`` array);
- longer string arrays: a ``StringArray``, a sequence of ``str`` decoded on first use.

So ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges`` are sequences of ``str``,
``tokenizer.ggml.scores`` is a float32 array (or list of float) and
``tokenizer.ggml.token_type`` an int32 array (or list of int).
"""
from __future__ import annotations

import difflib
import itertools
import math
import mmap
import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ggraph.ir import dtypes
from ggraph.gguf.format import (ARR, BOOL, DEFAULT_ALIGNMENT, EAGER_MAX, HEADER_BYTES, KEY_TYPES, MAGIC, MAX_DIMS,
                                MAX_NAME_BYTES, MIN_KV_BYTES, MIN_TENSOR_INFO_BYTES, SPLIT_NAME, STR, STRUCTS, U32,
                                U64, VERSIONS, VTYPE_BY_CODE, GGUFError, VType, align)


@dataclass(frozen=True, slots=True, eq=False)
class TensorInfo:
    """One tensor of a GGUF file: where its bytes are and how to read them."""
    name: str
    shape: tuple[int, ...]   # numpy order: GGUF dims reversed, so (out, in) for a weight
    dtype: dtypes.DType
    offset: int              # absolute byte offset in its file
    nbytes: int
    data: np.ndarray         # (nbytes,) uint8, a read-only view into the file's mapping
    path: str                # the file holding it (differs between the files of a split model)

    def __repr__(self) -> str:
        return (f"TensorInfo({self.name!r}, {self.dtype.name}{list(self.shape)}, "
                f"offset={self.offset}, nbytes={self.nbytes})")


class StringArray(Sequence):
    """A long GGUF string array left in the mapping; decoded to a list of str on first use.

    Open validated every length against the file size. UTF-8 is checked when the
    strings are decoded, and a bad one raises GGUFError naming the key and the index.
    """
    __slots__ = ("_buf", "_start", "_end", "_count", "_key", "_path", "_items")

    def __init__(self, buf, start: int, end: int, count: int, key: str, path: str):
        self._buf, self._start, self._end, self._count = buf, start, end, count
        self._key, self._path, self._items = key, path, None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        return self._decoded()[i]

    def __iter__(self):
        return iter(self._decoded())

    def __eq__(self, other):
        if isinstance(other, (StringArray, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"StringArray({self._count} strings of {self._key!r})"

    def _decoded(self) -> list[str]:
        """Decode every string once: one bytes copy of the span, then a tight loop."""
        if self._items is None:
            span, unpack, pos, out = self._buf[self._start:self._end], U64.unpack_from, 0, []
            for i in range(self._count):
                n = unpack(span, pos)[0]
                try:
                    out.append(span[pos + 8:pos + 8 + n].decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise GGUFError(self._path, f"'{self._key}'[{i}]", self._start + pos,
                                    f"string is not valid UTF-8 ({e.reason} at byte {e.start} of it)") from None
                pos += 8 + n
            self._items = out
        return self._items


class _Tensors(dict):
    """name -> TensorInfo in file order; a missing name raises KeyError listing close names."""

    def __missing__(self, name):
        close = difflib.get_close_matches(str(name), list(self), n=5, cutoff=0.5)
        hint = (f"; close names: {', '.join(close)}" if close else
                f"; {len(self)} tensors, e.g. {', '.join(list(self)[:3])}")
        raise KeyError(f"no tensor named {name!r}{hint}")


# ---------------------------------------------------------------------------- reading

class _Header(NamedTuple):
    """What one file's header says."""
    path: str
    version: int
    alignment: int
    data_offset: int
    metadata: dict
    kv_offsets: dict        # key -> byte offset of its KV pair
    kv_types: dict          # key -> value type name ("arr[f32]" for arrays)
    tensors: list           # TensorInfo, in file order


class _Parser:
    """A cursor over one mapped file that checks every read against the end of the file."""

    def __init__(self, mm: mmap.mmap, path: str):
        self.buf, self.size, self.path, self.pos = mm, len(mm), path, 0

    def fail(self, field: str, offset: int | None, problem: str) -> GGUFError:
        return GGUFError(self.path, field, offset, problem)

    def need(self, n: int, field: str) -> None:
        if self.pos + n > self.size:
            raise self.fail(field, self.pos, f"needs {n} bytes but the file ends at byte {self.size}")

    def unpack(self, st: struct.Struct, field: str):
        self.need(st.size, field)
        value = st.unpack_from(self.buf, self.pos)[0]
        self.pos += st.size
        return value

    def string(self, field: str) -> str:
        at = self.pos
        n = self.unpack(U64, f"{field} length")
        if n > self.size - self.pos:
            raise self.fail(field, at, f"string length {n} runs past the end of the file "
                                       f"({self.size - self.pos} bytes remain)")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(field, at, f"string is not valid UTF-8 ({e.reason} at byte {e.start} of it)") from None

    def value(self, key: str, vt: VType):
        """One metadata value of type ``vt``; returns (value, type name)."""
        if vt is STR:
            return self.string(f"value of '{key}'"), "str"
        if vt is ARR:
            return self.array(key)
        at = self.pos
        v = self.unpack(STRUCTS[vt.code], f"value of '{key}'")
        if vt is BOOL:
            if v > 1:
                raise self.fail(f"value of '{key}'", at, f"bool byte {v} is neither 0 nor 1")
            v = bool(v)
        return v, vt.name

    def array(self, key: str):
        at = self.pos
        code = self.unpack(U32, f"array element type of '{key}'")
        if code == ARR.code:
            raise self.fail(f"array element type of '{key}'", at, "nested arrays are not allowed (ggml refuses them)")
        vt = VTYPE_BY_CODE.get(code)
        if vt is None:
            raise self.fail(f"array element type of '{key}'", at, f"{code} is not a GGUF value type (0..12)")
        at = self.pos
        n = self.unpack(U64, f"array count of '{key}'")
        least = n * (8 if vt is STR else vt.size)   # every string has at least its u64 length
        if least > self.size - self.pos:
            raise self.fail(f"array count of '{key}'", at, f"{n} {vt.name} elements need at least {least} bytes "
                                                          f"but only {self.size - self.pos} remain")
        kind = f"arr[{vt.name}]"
        if vt is STR:
            return self.strings(key, n), kind
        arr = np.frombuffer(self.buf, vt.np_dtype, n, self.pos)   # (n,) read-only view
        if vt is BOOL:
            bad = np.flatnonzero(arr > 1)
            if len(bad):
                i = int(bad[0])
                raise self.fail(f"'{key}'[{i}]", self.pos + i, f"bool byte {arr[i]} is neither 0 nor 1")
            arr = arr != 0
        self.pos += least
        return (arr.tolist() if n <= EAGER_MAX else arr), kind

    def strings(self, key: str, n: int):
        """A string array: a list if short, else a StringArray after a fast validating length walk."""
        if n <= EAGER_MAX:
            return [self.string(f"'{key}'[{i}]") for i in range(n)]
        start = self.pos
        end = _walk_strings(self.buf, start, n)
        if end is None or end > self.size:
            self.checked_walk(key, n)   # raises, naming the element that runs past the end
            raise AssertionError("the fast and checked string walks disagree")
        self.pos = end
        return StringArray(self.buf, start, end, n, key, self.path)

    def checked_walk(self, key: str, n: int) -> None:
        """Walk ``n`` string lengths one by one, raising at the first that runs past the end."""
        for i in range(n):
            at = self.pos
            length = self.unpack(U64, f"'{key}'[{i}] length")
            if length > self.size - self.pos:
                raise self.fail(f"'{key}'[{i}]", at, f"string length {length} runs past the end of the file "
                                                     f"({self.size - self.pos} bytes remain)")
            self.pos += length


def _walk_strings(buf, pos: int, n: int) -> int | None:
    """End offset of ``n`` length-prefixed strings from ``pos``; None if a length field lies past the buffer.

    A tight loop is the fastest pure-Python walk (about 60 ns a string). The caller
    checks that the end lies within the file: offsets only grow, so that bounds them all.
    """
    unpack = U64.unpack_from
    try:
        for _ in itertools.repeat(None, n):
            pos += unpack(buf, pos)[0] + 8
    except (struct.error, OverflowError):   # the caller's checked walk reports which string and where
        return None
    return pos


def _parse_header(mm: mmap.mmap, path: str) -> _Header:
    """Parse and validate one file's header: magic, counts, metadata, tensor infos and layout."""
    p = _Parser(mm, path)
    if p.size < 4 or mm[:4] != MAGIC:
        raise p.fail("magic", 0, f"not a GGUF file: starts with {bytes(mm[:4])!r}, expected b'GGUF'")
    p.pos = 4
    version = p.unpack(U32, "version")
    _check_version(p, version)
    n_tensors = p.unpack(U64, "tensor_count")
    if HEADER_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > p.size:
        raise p.fail("tensor_count", 8, f"{n_tensors} tensor infos cannot fit in a {p.size}-byte file")
    n_kv = p.unpack(U64, "kv_count")
    if HEADER_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES + n_kv * MIN_KV_BYTES > p.size:
        raise p.fail("kv_count", 16, f"{n_kv} key-value pairs (and {n_tensors} tensor infos) cannot fit "
                                     f"in a {p.size}-byte file")
    metadata, kv_offsets, kv_types = _parse_metadata(p, n_kv)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment == 0 or alignment & (alignment - 1):
        raise p.fail("general.alignment", kv_offsets["general.alignment"], f"{alignment} is not a power of two")
    infos = [_parse_tensor_info(p, i) for i in range(n_tensors)]
    data_offset = align(p.pos, alignment)
    tensors = _place_tensors(p, infos, data_offset, alignment)
    return _Header(path, version, alignment, data_offset, metadata, kv_offsets, kv_types, tensors)


def _check_version(p: _Parser, version: int) -> None:
    if version in VERSIONS:
        return
    if version & 0xFFFF == 0 and version:   # ggml's test: a byte-swapped small number
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        raise p.fail("version", 4, f"{version:#010x} looks like a big-endian GGUF file (version {swapped}); "
                                   "big-endian GGUF is not supported")
    raise p.fail("version", 4, f"GGUF version {version} is not supported (only 2 and 3)")


def _parse_metadata(p: _Parser, n_kv: int):
    metadata, offsets, types = {}, {}, {}
    for i in range(n_kv):
        at = p.pos
        key = p.string(f"key #{i}")
        if not key:
            raise p.fail(f"key #{i}", at, "key is empty")
        if key in metadata:
            raise p.fail(f"key '{key}'", at, f"duplicate key (first at byte {offsets[key]})")
        t_at = p.pos
        code = p.unpack(U32, f"value type of '{key}'")
        vt = VTYPE_BY_CODE.get(code)
        if vt is None:
            raise p.fail(f"value type of '{key}'", t_at, f"{code} is not a GGUF value type (0..12)")
        metadata[key], types[key] = p.value(key, vt)
        offsets[key] = at
        want = KEY_TYPES.get(key)
        if want is not None and types[key] != want:
            raise p.fail(key, at, f"must be of type {want}, not {types[key]}")
    return metadata, offsets, types


def _parse_tensor_info(p: _Parser, i: int):
    """One tensor info: (name, shape, dtype, relative offset, info's byte, offset field's byte)."""
    at = p.pos
    name = p.string(f"tensor #{i} name")
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise p.fail(f"tensor #{i} name", at, f"{name[:80]!r} is longer than ggml's {MAX_NAME_BYTES} bytes")
    field = f"tensor '{name}'"
    nd_at = p.pos
    n_dims = p.unpack(U32, f"{field} n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise p.fail(f"{field} n_dims", nd_at, f"{n_dims} is not in 1..{MAX_DIMS}")
    dims = [p.unpack(U64, f"{field} dim {k}") for k in range(n_dims)]   # dims[0] is the row length
    for k, d in enumerate(dims):
        if d >= 2**63:   # ggml reads int64 and refuses negatives; zero is allowed, as there
            raise p.fail(f"{field} dim {k}", nd_at + 4 + 8 * k, f"{d} is negative as an int64")
    if math.prod(dims) >= 2**63:
        raise p.fail(f"{field} dims", nd_at + 4, f"{dims} hold {math.prod(dims)} elements, which overflows int64")
    t_at = p.pos
    type_id = p.unpack(U32, f"{field} type")
    try:
        dtype = dtypes.from_ggml_id(type_id)
    except ValueError as e:
        raise p.fail(f"{field} type", t_at, f"unknown ggml type id {type_id} ({e})") from None
    if dims[0] % dtype.block_size:
        raise p.fail(f"{field} dim 0", nd_at + 4, f"row length {dims[0]} is not a multiple of "
                                                  f"{dtype.name}'s block size {dtype.block_size}")
    o_at = p.pos
    offset = p.unpack(U64, f"{field} offset")
    return name, tuple(reversed(dims)), dtype, offset, at, o_at


def _place_tensors(p: _Parser, infos, data_offset: int, alignment: int) -> list[TensorInfo]:
    """Check each tensor's offset and size against the alignment, its neighbours and the file."""
    whole = np.frombuffer(p.buf, np.uint8)   # (file bytes,) read-only
    tensors, seen, expected, prev = [], {}, 0, None
    for name, shape, dtype, offset, at, o_at in infos:
        if name in seen:
            raise p.fail(f"tensor '{name}'", at, f"duplicate tensor name (first at byte {seen[name]})")
        seen[name] = at
        nbytes = dtype.nbytes(shape)
        if offset % alignment:
            raise p.fail(f"tensor '{name}' offset", o_at, f"{offset} is not a multiple of the alignment {alignment}")
        start = data_offset + offset
        if start + nbytes > p.size:
            raise p.fail(f"tensor '{name}'", at, f"offset {data_offset}+{offset} + {nbytes} bytes runs past "
                                                 f"the end of the file ({p.size} bytes)")
        # ggml's gguf_init_from_reader requires tensor i to start exactly where tensor i-1
        # ends, rounded up to the alignment ("tensor '%s' has offset %" PRIu64 ", expected %zu")
        if offset != expected:
            how = (f"overlaps tensor '{prev}', which ends at {expected}" if offset < expected else
                   f"leaves a gap after {'tensor ' + repr(prev) if prev else 'the data start'}")
            raise p.fail(f"tensor '{name}' offset", o_at, f"{offset} {how}: ggml requires offset {expected}")
        tensors.append(TensorInfo(name, shape, dtype, start, nbytes, whole[start:start + nbytes], p.path))
        expected, prev = offset + align(nbytes, alignment), name
    return tensors


def _map(path: str) -> mmap.mmap:
    """Map a file read-only; an empty file, or one that is not a regular file (a FIFO, a directory, a
    device, which open() or read() could block on forever), is a GGUFError rather than a hang."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise GGUFError(path, "path", None, "not a regular file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise GGUFError(path, "magic", 0, "not a GGUF file: the file is empty")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _open_header(path: str) -> tuple[mmap.mmap, _Header]:
    mm = _map(path)
    return mm, _parse_header(mm, path)


class GGUFFile:
    """A GGUF file (or split model) mapped read-only, with its header parsed and validated.

    ``GGUFFile("m.gguf")`` or ``GGUFFile("m-00001-of-00003.gguf")``; use as a context manager.
    Attributes: ``path``, ``paths`` (every file of a split model), ``version``,
    ``alignment``, ``data_offset``, ``metadata`` (see the module docstring for value
    types), ``metadata_types`` (key -> "u32", "str", "arr[f32]", …), ``tensors`` (name ->
    TensorInfo in file order) and ``buffer`` (the first file as a read-only uint8 array).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        mm, head = _open_header(self.path)
        self._maps = [mm]
        self.version, self.alignment, self.data_offset = head.version, head.alignment, head.data_offset
        self.metadata: dict = head.metadata
        self.metadata_types: dict = head.kv_types
        self.buffer = np.frombuffer(mm, np.uint8)   # (file bytes,) the first file, read-only
        tensors, self.paths = head.tensors, [self.path]
        if self.metadata.get("split.count", 1) > 1:
            tensors, self.paths = self._join_splits(head)
        self.tensors = _Tensors((t.name, t) for t in tensors)
        self.closed = False

    def _join_splits(self, head: _Header) -> tuple[list[TensorInfo], list[str]]:
        """Open the sibling files of a split model, check their split keys and merge their tensors."""
        md, off = head.metadata, head.kv_offsets
        count = md["split.count"]
        if md.get("split.no", 0) != 0:
            raise GGUFError(self.path, "split.no", off["split.no"],
                            f"this is split {md['split.no'] + 1} of {count}; open the first split instead")
        if "split.tensors.count" not in md:
            raise GGUFError(self.path, "split.count", off["split.count"], "split model lacks split.tensors.count")
        m = SPLIT_NAME.match(self.path)
        if m is None or int(m["no"]) != 1 or int(m["count"]) != count:
            raise GGUFError(self.path, "split.count", off["split.count"],
                            f"{count} splits, but the file name does not end in -00001-of-{count:05d}.gguf")
        tensors, paths = list(head.tensors), [self.path]
        for k in range(1, count):
            sib = f"{m['prefix']}-{k + 1:05d}-of-{count:05d}.gguf"
            if not os.path.exists(sib):
                raise GGUFError(self.path, "split.count", off["split.count"],
                                f"split file {sib} is missing (split {k + 1} of {count})")
            mm, h = _open_header(sib)
            self._maps.append(mm)
            for key, want in (("split.no", k), ("split.count", count)):
                if h.metadata.get(key) != want:
                    raise GGUFError(sib, key, h.kv_offsets.get(key), f"is {h.metadata.get(key)}, expected {want}")
            tensors += h.tensors
            paths.append(sib)
        names = {}
        for t in tensors:
            if t.name in names:
                raise GGUFError(t.path, f"tensor '{t.name}'", None, f"duplicate tensor name, also in {names[t.name]}")
            names[t.name] = t.path
        want = md["split.tensors.count"]
        if len(tensors) != want:
            raise GGUFError(self.path, "split.tensors.count", off["split.tensors.count"],
                            f"says {want} tensors but the {count} splits hold {len(tensors)}")
        return tensors, paths

    # -- conveniences

    @property
    def architecture(self) -> str | None:
        """``general.architecture``, or None if the file has none."""
        return self.metadata.get("general.architecture")

    @property
    def nbytes(self) -> int:
        """Total bytes of all tensors."""
        return sum(t.nbytes for t in self.tensors.values())

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32 of its numpy shape, via ggraph.quants."""
        t = self.tensors[name]
        from ggraph.gguf import quants   # lazy: reading a header needs no dequantisers
        return quants.dequantize(t.data, t.dtype, t.shape)

    def close(self) -> None:
        """Drop this object's references to the mappings; views a caller still holds keep theirs alive."""
        self.metadata, self.metadata_types, self.tensors, self.buffer, self._maps = {}, {}, _Tensors(), None, []
        self.closed = True

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return f"GGUFFile({self.path!r}, closed)"
        return (f"GGUFFile({self.path!r}, v{self.version}, arch={self.architecture}, "
                f"{len(self.tensors)} tensors, {self.nbytes / 1e6:.1f} MB, {len(self.metadata)} keys)")


