"""The compile cache on disk: every entry is verified before anything in it is used.

An entry is ``magic (8 bytes) | sha256 of its name and payload (32) | payload``, written atomically
(readers see the old file or the whole new one). Reading checks the magic and the digest
first: a torn, truncated or bit-flipped entry is deleted with a one-line warning and the
caller rebuilds it, so a damaged cache never reaches the linker (where a bad relocation
aborts the process) and heals on the next run by itself. The name is in the digest because
it is the entry's key: another entry's intact bytes under this name (a copied or swapped
file) would load another program. Entries of the previous format are replaced quietly. Program states are pickles, read
with an unpickler that builds only the classes a program state holds. A cache directory
that cannot be written is a warning: the work is compiled in memory and still runs.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import shutil
import stat
import struct
import tempfile
from pathlib import Path

from ggraph.demo import cache_dir
from ggraph.progress import warn

KERNEL, PROGRAM, OBJECT = b"GGRAPHK2", b"GGRAPHP2", b"GGRAPHO2"
_OLD = {b"GGRAPHK1", b"GGRAPHP1", b"GGRAPHO1"}        # digest of the payload alone: replaced without a warning
_HEAD = 8 + 32
_unwritable: list = []                 # paths that could not be written (the first one is warned about)


def write(path: Path, magic: bytes, payload: bytes) -> None:
    """Store ``payload`` under ``path``; a cache that cannot be written is a warning, not a failure."""
    try:
        _own_folder(path.parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(magic + _digest(path, payload) + payload)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:                                   # said once: every later write fails the same way
        if not _unwritable:
            warn(f"cannot write the compile cache in {cache_dir()} ({e.strerror or e}); compiling in memory")
        _unwritable.append(path)


def _unusable(e: OSError) -> None:
    """The cache folder itself cannot be read (a path too long, no access): one warning for reads and
    writes alike."""
    if not _unwritable:
        warn(f"cannot write the compile cache in {cache_dir()} ({e.strerror or e}); compiling in memory")
    _unwritable.append(None)


def read(path: Path, magic: bytes) -> bytes | None:
    """The verified payload of ``path``, or None (missing; or damaged, which is deleted and said)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:                         # the entry is a symlink loop
            discard(path, f"it cannot be read: {e.strerror or e}")
        else:                                              # the folder itself (a name too long, no access): once
            _unusable(e)
        return None
    if not stat.S_ISREG(st.st_mode):                       # a FIFO would block the read, a folder fail it forever
        discard(path, "it is not a regular file")
        return None
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        warn(f"cannot read the compile cache entry {path} ({e.strerror or e}); rebuilding it")
        return None
    if len(data) >= _HEAD and data[:8] == magic and _digest(path, data[_HEAD:]) == data[8:_HEAD]:
        return data[_HEAD:]
    if data[:8] in _OLD:
        try:
            path.unlink()
        except OSError:
            pass
        return None
    discard(path, "its digest does not match" if data[:8] == magic else "it is not a ggraph cache entry")
    return None


def _digest(path: Path, payload: bytes) -> bytes:
    """The digest of an entry's name (its key) and payload."""
    return hashlib.sha256(path.name.encode("utf-8", "surrogateescape") + b"\0" + payload).digest()


def _own_folder(folder: Path) -> None:
    """A file (or anything not a folder) where one of the cache's own subfolders (kernels/, libs/) belongs
    is removed, so the cache heals instead of failing every write from now on."""
    root = cache_dir()
    broken = (folder.is_symlink() and not folder.exists()) or (folder.exists() and not folder.is_dir())
    if folder != root and folder.parent == root and broken:
        warn(f"the compile cache folder {folder} is not a folder; replacing it")
        folder.unlink()


def discard(path: Path, why: str) -> None:
    """Delete a bad entry (so the next run rebuilds it), with a one-line warning."""
    warn(f"compile cache entry {path.name} is damaged ({why}); deleted, rebuilding it")
    try:
        if path.is_dir() and not path.is_symlink():        # the entry's own name: nothing else lives there
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


# -- kernels: names and object code ---------------------------------------------------------

def kernel_payload(names, obj: bytes) -> bytes:
    head = json.dumps(list(names)).encode()
    return struct.pack("<I", len(head)) + head + obj


def kernel_from_payload(payload: bytes) -> tuple[tuple[str, ...], bytes]:
    (n,) = struct.unpack_from("<I", payload)
    names = json.loads(payload[4:4 + n].decode())
    if not isinstance(names, list) or not names or not all(isinstance(x, str) for x in names):
        raise ValueError("bad kernel names")
    return tuple(names), payload[4 + n:]


# -- program states: a pickle of known classes only ------------------------------------------

_ALLOWED = {
    ("ggraph.backends.llvm.lowering", "Buffer"), ("ggraph.backends.llvm.lowering", "FixedBytes"),
    ("ggraph.backends.llvm.lowering", "AvalBytes"), ("ggraph.backends.llvm.lowering", "PlanBytes"),
    ("ggraph.backends.llvm.lowering", "ActBytes"), ("ggraph.backends.llvm.kernels.plan", "Layout"),
    ("ggraph.backends.llvm.lowering", "Ref"), ("ggraph.backends.llvm.lowering", "Loop"), ("ggraph.ir.dtypes", "Aval"), ("ggraph.ir.dtypes", "DimAval"),
    ("ggraph.ir.dtypes", "ParamAval"), ("ggraph.ir.dtypes", "from_name"), ("ggraph.ir.dims", "Sym"),
    ("ggraph.ir.graph", "Literal"), ("builtins", "frozenset"), ("builtins", "set"), ("builtins", "slice"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"), ("copyreg", "_reconstructor"), ("builtins", "object"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),   # contiguous arrays
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"a program state holds {module}.{name}, which it never should")
        return super().find_class(module, name)


def load_state(payload: bytes) -> dict:
    state = _Unpickler(io.BytesIO(payload)).load()
    if not isinstance(state, dict):
        raise pickle.UnpicklingError("a program state is a dict")
    return state


def dump_state(state: dict) -> bytes:
    return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
