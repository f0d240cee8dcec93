"""Copies of GGUF files with metadata and tensors changed: the lying and renamed files tests need."""
from __future__ import annotations

from ggraph.gguf import GGUFFile, Typed, typed_metadata, write


def read(src) -> tuple[dict, dict, int]:
    """A file's metadata as ``Typed`` values (types kept), its tensors in the writer's form, its alignment."""
    with GGUFFile(str(src)) as f:
        meta = typed_metadata(f)
        tensors = {n: (bytes(t.data), t.dtype, t.shape) if t.dtype.np_dtype is None else
                   t.data.view(t.dtype.np_dtype).reshape(t.shape).copy() for n, t in f.tensors.items()}
        return meta, tensors, f.alignment


def edited(src, dst, keys: dict | None = None, drop=(), tensors: dict | None = None, rename_arch: str | None = None):
    """Write ``dst``: ``src`` with metadata ``keys`` set (plain values keep the key's old type when it had
    one; give ``Typed`` to change it), keys in ``drop`` removed, ``tensors`` replaced (None drops one),
    and with ``rename_arch`` the architecture (and its key prefix) renamed."""
    meta, ts, alignment = read(src)
    if rename_arch:
        old = meta["general.architecture"].value
        meta = {(rename_arch + k[len(old):] if k.startswith(old + ".") else k): v for k, v in meta.items()}
        meta["general.architecture"] = Typed(rename_arch, "str")
    for k, v in (keys or {}).items():
        meta[k] = v if isinstance(v, Typed) or k not in meta else Typed(v, meta[k].type)
    for k in drop:
        meta.pop(k, None)
    for n, t in (tensors or {}).items():
        if t is None:
            ts.pop(n, None)
        else:
            ts[n] = t
    write(dst, meta, ts, alignment=alignment)
    return dst
