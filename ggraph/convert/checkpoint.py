"""A Hugging Face checkpoint's tensors, read straight from its ``.safetensors`` files.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON giving each
tensor's dtype, shape and ``data_offsets`` [begin, end) into the bytes that follow, then those
bytes. Reading that header here (rather than through the ``safetensors`` package, which has
no byte offsets to give and no numpy bfloat16) makes every tensor a view of the memory-mapped
file, whatever its dtype: nothing is read until a tensor is asked for, and BF16 is widened
to float32 by hand (a bfloat16 is the top half of a float32).

A model is one ``model.safetensors`` or shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> shard file); every shard the index names must be there, and
the shards must hold exactly the tensors it lists.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors dtype -> the numpy type of its stored elements (BF16 is stored as raw 16-bit words)
STORED = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8")}
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20          # the format's own limit on the JSON header


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are: ``file`` from byte ``start`` on, ``dtype`` a safetensors name."""
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int


class Checkpoint:
    """Every tensor of a checkpoint folder by its Hugging Face name; ``read(name)`` gives float32.

    ``with Checkpoint(folder) as ck: ck.read("model.embed_tokens.weight")``
    """

    def __init__(self, folder):
        self.folder = Path(folder)
        self.tensors: dict[str, TensorRef] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self.dtypes: set[str] = set()           # the dtypes of the stored tensors, e.g. {"BF16"}
        for shard in _shards(self.folder):
            for ref in _header(shard):
                if ref.name in self.tensors:
                    raise ValueError(f"{ref.name} is in both {self.tensors[ref.name].file.name} and {shard.name}")
                self.tensors[ref.name] = ref
                self.dtypes.add(ref.dtype)
        _check_index(self.folder, self.tensors)

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a float32 array (a copy for F16/BF16/F64, a read-only view for F32)."""
        ref = self.tensors[name]
        if ref.file not in self._maps:
            with open(ref.file, "rb") as f:
                self._maps[ref.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        stored = STORED[ref.dtype]
        x = np.frombuffer(self._maps[ref.file], stored, math.prod(ref.shape), ref.start).reshape(ref.shape)
        if ref.dtype == "BF16":
            return (x.astype(np.uint32) << 16).view(np.float32)
        return x if ref.dtype == "F32" else x.astype(np.float32)

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shards(folder: Path) -> list[Path]:
    """The weight files: those the index names (each must exist), else model*.safetensors."""
    index = folder / INDEX
    if index.is_file():
        files = sorted(set(_weight_map(index).values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: shard{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                                    f"missing from {folder}")
        return [folder / f for f in files]
    files = sorted(p for p in folder.glob("model*.safetensors") if p.is_file())
    if not files:
        bins = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
        hint = (f" (found {', '.join(bins)}: PyTorch pickles are not read; save the model with "
                f"safe_serialization=True)") if bins else ""
        raise FileNotFoundError(f"{folder}: no model*.safetensors weights{hint}")
    return files


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{index}: not a JSON object with a weight_map: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: weight_map must map tensor names to shard file names")
    return weight_map


def _check_index(folder: Path, tensors: dict[str, TensorRef]) -> None:
    """The shards hold exactly the tensors the index lists, each in the shard it names."""
    index = folder / INDEX
    if not index.is_file():
        return
    weight_map = _weight_map(index)
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise ValueError(f"{index} lists {len(missing)} tensor(s) that no shard holds: {', '.join(missing[:5])}"
                         f"{', ...' if len(missing) > 5 else ''} (expected in {weight_map[missing[0]]})")
    extra = sorted(set(tensors) - set(weight_map))
    if extra:
        raise ValueError(f"{index} does not list {', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''}, "
                         f"found in {tensors[extra[0]].file.name}")
    for name, file in weight_map.items():
        if tensors[name].file.name != file:
            raise ValueError(f"{index} puts {name} in {file}, but it is in {tensors[name].file.name}")


def _header(path: Path) -> list[TensorRef]:
    """The tensors one safetensors file declares, each checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise ValueError(f"{path}: header length {n} does not fit the file's {size} bytes")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    header.pop("__metadata__", None)
    return [_entry(path, name, info, 8 + n, size) for name, info in header.items()]


def _entry(path: Path, name: str, info, data_start: int, size: int) -> TensorRef:
    """One header entry as a TensorRef: a dtype we read, and offsets that match its shape and the file."""
    try:
        dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: tensor {name}: the header entry needs dtype, shape and data_offsets") from None
    if dtype not in STORED:
        raise ValueError(f"{path}: tensor {name} is {dtype}; supported: {', '.join(STORED)} "
                         f"(quantised checkpoints are not converted)")
    want = math.prod(shape) * STORED[dtype].itemsize
    if end - begin != want or begin < 0 or data_start + end > size:
        raise ValueError(f"{path}: tensor {name} ({dtype}{list(shape)}, {want} bytes) has data_offsets "
                         f"[{begin}, {end}], outside the file's {size - data_start} data bytes or of the wrong size")
    return TensorRef(name, path, dtype, shape, data_start + begin)
