"""Compile LLVM IR for a Target to object code, cache it on disk, and load it with LLJIT.

    lib = jit.compile(module, target)       # an llvmlite.ir.Module or IR text
    fn = lib.function("name", None, [ctypes.c_void_p, ...])
    addr = lib.address("name")

The cache key hashes the IR text, the target's name, cpu and features, and the
llvmlite version. The cache lives in $GGRAPH_CACHE, else ~/.cache/ggraph.
"""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import re
import tempfile
import threading

import llvmlite
import llvmlite.binding as llvm

from ggraph.backends.llvm.target import Target, init_llvm, target_machine
from ggraph.demo import cache_dir          # one cache root for models and object code

_DEFINE = re.compile(r'^define\s+([^@]*)@"?([^"(\s]+)"?\s*\(', re.MULTILINE)
_jit_lock = threading.Lock()
_jit: list = []                    # the one LLJIT instance, created on first use
_names = itertools.count()


def cache_key(ir_text: str, target: Target) -> str:
    """A hash of everything that decides the object code."""
    h = hashlib.sha256()
    for part in (ir_text, target.name, target.cpu, target.features, llvmlite.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def optimize(module, target: Target) -> llvm.ModuleRef:
    """Parse, verify and run the O3 pipeline (loop and SLP vectorisers on) for `target`."""
    tm = target_machine(target)
    mod = llvm.parse_assembly(str(module))
    mod.triple = tm.triple
    mod.data_layout = str(tm.target_data)
    mod.verify()
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    return mod


def emit_assembly(module, target: Target) -> str:
    """Optimised assembly text for `target`; works for any target, runnable or not."""
    return target_machine(target).emit_assembly(optimize(module, target))


def object_code(module, target: Target) -> tuple[bytes, bool]:
    """Object code for `module` on `target` and whether it came from the disk cache."""
    text = str(module)
    path = cache_dir() / f"{cache_key(text, target)}.o"
    if path.exists():
        return path.read_bytes(), True
    obj = target_machine(target).emit_object(optimize(text, target))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(obj)
    os.replace(tmp, path)
    return obj, False


def defined_functions(ir_text: str) -> list[str]:
    """Names of the externally visible functions the IR text defines."""
    return [name for linkage, name in _DEFINE.findall(ir_text)
            if "internal" not in linkage and "private" not in linkage]


def _lljit() -> llvm.LLJIT:
    init_llvm()
    with _jit_lock:
        if not _jit:
            _jit.append(llvm.create_lljit_compiler())
        return _jit[0]


class Library:
    """Loaded native code. Keep it alive while any of its addresses may be called."""

    def __init__(self, tracker, names: list[str], from_cache: bool, obj: bytes):
        self._tracker = tracker
        self.object = obj                  # the object code, for callers that cache more alongside it
        self.names = tuple(names)
        self.from_cache = from_cache

    def address(self, name: str) -> int:
        """The address of exported function `name`."""
        if name not in self.names:
            raise KeyError(f"function {name!r} is not in this library; it has: {', '.join(self.names)}")
        return self._tracker[name]

    def function(self, name: str, restype, argtypes):
        """A ctypes callable for `name`; it keeps this library alive."""
        fn = ctypes.CFUNCTYPE(restype, *argtypes)(self.address(name))
        fn._ggraph_library = self
        return fn


def compile(module, target: Target) -> Library:
    """Compile (or fetch from the cache) and load `module` for `target` in this process."""
    if not target.executable:
        raise ValueError(f"target '{target.name}' is {target.arch} code and this host cannot "
                         f"execute it; use jit.emit_assembly() to inspect it")
    text = str(module)
    names = defined_functions(text)
    if not names:
        raise ValueError("module defines no external functions to load")
    obj, hit = object_code(text, target)
    return link(obj, names, hit)


def link(obj: bytes, names, from_cache: bool = True) -> Library:
    """Load object code into this process and export ``names`` from it."""
    builder = llvm.JITLibraryBuilder().add_object_img(obj).add_current_process()
    for name in names:
        builder.export_symbol(name)
    tracker = builder.link(_lljit(), f"ggraph{next(_names)}")
    return Library(tracker, list(names), from_cache, obj)
