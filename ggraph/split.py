"""Split a GGUF model into several files, and merge them back: llama.cpp's ``llama-gguf-split``, byte for byte.

    with GGUFFile("model.gguf") as m:
        parts = plan_split(m, "out/model", max_size=parse_size("200M"))
        write_parts(parts, inputs=m.paths)       # out/model-00001-of-00003.gguf, ...

The format, as ``tools/gguf-split`` writes it:

- the files are ``PREFIX-00001-of-00003.gguf``: numbered from 1, five digits;
- every file carries ``split.no`` (u16, from 0), ``split.count`` (u16) and ``split.tensors.count`` (i32,
  the tensors of all the files). The first file also carries all of the input's metadata, in the input's
  order, before those three; the others carry only the three. gguf-split sets a key by removing it and
  appending it, and sets ``split.count`` once more at the end, when the count is known, so the three come
  last in the order ``split.no``, ``split.tensors.count``, ``split.count``;
- the tensors keep the input's order. By count, a file holds ``max_tensors`` tensors. By size, a new file
  starts when the current one's tensor bytes, each tensor padded to 32 bytes, would pass ``max_size``.
  Headers are not counted, so a file can be larger than the limit by its header, and a tensor larger
  than the limit gets a file of its own;
- each file is laid out as ggml's gguf writer does: the header padded to the alignment (32, unless
  ``general.alignment`` says otherwise: see below), then each tensor padded to it; a tensor info lists
  the dims only up to the last one that is not 1 (``ggml_n_dims``), so a [1, 4096] tensor is stored
  as [4096].

Merging writes the first file's metadata with ``split.count`` set to 0 (and so moved to the end) and
every file's tensors, in order. The result is not the unsplit original: like ``llama-gguf-split --merge``,
it keeps ``split.no = 0``, ``split.tensors.count`` and ``split.count = 0``.

Where ggraph differs from llama-gguf-split, on purpose:

- a first tensor larger than ``max_size`` gets a file of its own, like any other tensor; gguf-split stops
  there with "one of splits have 0 tensors";
- a model whose ``general.alignment`` is not 32: gguf-split lays its files out at 32 anyway, which makes the
  first file, which declares the other alignment, unreadable. ggraph lays each file out at the alignment
  it declares: the input's for the first file (and for a merged file), 32 for the others;
- an input that is itself split is read whole (``GGUFFile`` joins its files) and split again; gguf-split
  reads only the file it is given;
- existing outputs are refused unless ``force``; gguf-split overwrites split files (its merge refuses);
- sizes may be in K as well as M and G, and may have decimals (``1.5G``); gguf-split reads ``1.5G`` as 1G.

Each file is written to ``NAME.partial``, its tensor bytes streamed from the input's mapping, and every
file is renamed into place only once all of them are complete; a failure removes the partial files.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ggraph.gguf.format import DEFAULT_ALIGNMENT, align, ggml_dims
from ggraph.gguf.reader import GGUFFile, TensorInfo
from ggraph.gguf.writer import Typed, header, typed_metadata
from ggraph.progress import Progress, warn
from ggraph.units import fmt_bytes

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
MAX_FILES = 0xFFFF                 # split.count is a u16
DEFAULT_MAX_TENSORS = 128          # gguf-split's default: by count, 128 tensors a file
SIZE_PAD = DEFAULT_ALIGNMENT       # gguf-split counts each tensor padded to 32, whatever the alignment
UNITS = {"K": 10**3, "M": 10**6, "G": 10**9}   # decimal, as gguf-split reads 200M
CHUNK = 1 << 24                    # bytes written between progress updates
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([KMG])", re.IGNORECASE)


@dataclass(frozen=True)
class Part:
    """One output file: its path, its header bytes, its tensors (data read from the input) and alignment."""
    path: str
    header: bytes
    tensors: tuple[TensorInfo, ...]
    alignment: int

    @property
    def nbytes(self) -> int:
        """The file's size: the header and every tensor, each padded to the alignment."""
        return len(self.header) + sum(align(t.nbytes, self.alignment) for t in self.tensors)


def parse_size(text: str) -> int:
    """``"200M"`` -> 200000000 bytes: a positive number and a decimal unit K, M or G."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r}: expected a positive number and a unit K, M or G "
                         f"(decimal, as llama-gguf-split reads them: 1M = 1000000 bytes), e.g. 200M or 4G")
    n = round(float(m[1]) * UNITS[m[2].upper()])
    if n <= 0:
        raise ValueError(f"{text!r} is 0 bytes: give a positive size, e.g. 200M")
    return n


def split_path(prefix: str, no: int, count: int) -> str:
    """The name of file ``no`` (from 0) of ``count``: ``PREFIX-00001-of-00003.gguf``, as llama.cpp names them."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def plan_split(model: GGUFFile, prefix: str, *, max_size: int | None = None, max_tensors: int | None = None,
               no_tensor_first_split: bool = False) -> list[Part]:
    """The files ``model`` splits into, by tensor bytes (``max_size``) or by count (``max_tensors``, default 128).

    ``no_tensor_first_split`` puts only the metadata in the first file, as gguf-split's option of that name.
    """
    if max_size is not None and max_tensors is not None:
        raise ValueError("split by size or by tensor count, not both")
    if max_size is not None and max_size <= 0:
        raise ValueError(f"max_size (--max-size) must be a positive number of bytes, got {max_size}")
    max_tensors = DEFAULT_MAX_TENSORS if max_size is None and max_tensors is None else max_tensors
    if max_tensors is not None and max_tensors <= 0:
        raise ValueError(f"max_tensors (--max-tensors) must be at least 1, got {max_tensors}")
    if prefix.endswith(".gguf"):
        raise ValueError(f"output prefix {prefix!r} ends in .gguf: the files would be named "
                         f"{split_path(prefix, 0, 2)}, ...; give the prefix without .gguf")
    tensors = list(model.tensors.values())
    groups = _group(tensors, max_size, max_tensors, no_tensor_first_split)
    if len(groups) > MAX_FILES:
        raise ValueError(f"{model.path} would split into {len(groups)} files, more than split.count (a u16) "
                         f"can say ({MAX_FILES}): allow more per file")
    if max_size is not None:
        _warn_oversized(tensors, max_size)
    first = typed_metadata(model)
    return [_part(split_path(prefix, no, len(groups)),
                  _with_split_keys(first if no == 0 else {}, no, len(groups), len(tensors)), group)
            for no, group in enumerate(groups)]


def _group(tensors: list[TensorInfo], max_size: int | None, max_tensors: int | None,
           no_tensor_first_split: bool) -> list[list[TensorInfo]]:
    """gguf-split's rule: the tensors, in order, cut into files by count or by padded size."""
    groups = [[], []] if no_tensor_first_split else [[]]
    size = 0                                           # padded tensor bytes in the last file so far
    for i, t in enumerate(tensors):
        padded = align(t.nbytes, SIZE_PAD)
        if max_tensors is not None:
            new_file = i > 0 and i % max_tensors == 0
        else:
            new_file = bool(groups[-1]) and size + padded > max_size
        if new_file:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += padded
    return groups


def _warn_oversized(tensors: list[TensorInfo], max_size: int) -> None:
    big = [t for t in tensors if align(t.nbytes, SIZE_PAD) > max_size]
    if big:
        names = ", ".join(f"{t.name} ({fmt_bytes(t.nbytes)})" for t in big[:3]) + (", ..." if len(big) > 3 else "")
        warn(f"{len(big)} tensor(s) are larger than the maximum size of {max_size} bytes: {names}; "
             f"each gets a file of its own, larger than the maximum")


def _with_split_keys(metadata: dict, no: int, count: int, n_tensors: int) -> dict:
    """``metadata`` with the split keys set as gguf-split sets them: removed, then appended in its order."""
    out = {k: v for k, v in metadata.items() if k not in SPLIT_KEYS}
    out["split.no"] = Typed(no, "u16")
    out["split.tensors.count"] = Typed(n_tensors, "i32")
    out["split.count"] = Typed(count, "u16")
    return out


def plan_merge(model: GGUFFile, out: str) -> list[Part]:
    """The one file a split ``model`` (opened from its first file, which joins the rest) merges into."""
    count = model.metadata.get("split.count")
    if count is None:
        raise ValueError(f"{model.path} is not a split model: it has no split.count key")
    if count == 0:
        raise ValueError(f"{model.path} is already merged (its split.count is 0)")
    metadata = {k: v for k, v in typed_metadata(model).items() if k != "split.count"}
    metadata["split.count"] = Typed(0, "u16")          # a merged file: llama.cpp loads it as one file
    return [_part(out, metadata, list(model.tensors.values()))]


def _part(path: str, metadata: dict, tensors: list[TensorInfo]) -> Part:
    alignment = metadata["general.alignment"].value if "general.alignment" in metadata else DEFAULT_ALIGNMENT
    infos = [(t.name, ggml_dims(t.shape), t.dtype) for t in tensors]
    return Part(path, header(metadata, infos, alignment), tuple(tensors), alignment)


def write_parts(parts: list[Part], *, inputs=(), force: bool = False, label: str = "writing") -> None:
    """Write every part to ``PATH.partial`` with a progress bar, then rename them all into place.

    Refuses a part that would replace one of ``inputs``, and an existing file unless ``force``. No
    output is renamed before every file is complete, and on a failure the partial files are removed.
    """
    _check_outputs(parts, inputs, force)
    partials = []
    try:
        with Progress(sum(p.nbytes for p in parts), label, unit="B") as bar:
            for part in parts:
                partials.append(part.path + ".partial")
                _write_part(part, partials[-1], bar)
        for part, partial in zip(parts, partials):
            os.replace(partial, part.path)
    except BaseException:
        for partial in partials:
            if os.path.exists(partial):
                os.unlink(partial)
        raise


def _check_outputs(parts: list[Part], inputs, force: bool) -> None:
    for part in parts:
        folder = os.path.dirname(part.path) or "."
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{part.path}: the folder {folder} does not exist")
        if not os.path.exists(part.path):
            continue
        if not os.path.isfile(part.path):
            raise FileExistsError(f"{part.path} exists and is not a file")
        if any(os.path.samefile(part.path, i) for i in inputs if os.path.exists(i)):
            raise FileExistsError(f"{part.path} is one of the input files: write the output elsewhere")
        if not force:
            raise FileExistsError(f"{part.path} already exists: remove it or give --force to overwrite it")


def _write_part(part: Part, path: str, bar: Progress) -> None:
    """The header, then each tensor's bytes straight from the input mapping, padded; synced to disk."""
    with open(path, "wb") as f:
        f.write(part.header)
        bar.advance(len(part.header))
        for t in part.tensors:
            for start in range(0, t.nbytes, CHUNK):
                piece = t.data[start:start + CHUNK]
                f.write(piece)
                bar.advance(len(piece))
            pad = align(t.nbytes, part.alignment) - t.nbytes
            f.write(bytes(pad))
            bar.advance(pad)
        f.flush()
        os.fsync(f.fileno())                          # on disk before a name points at it
