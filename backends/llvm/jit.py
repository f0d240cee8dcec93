"""Compile LLVM IR for a Target to object code, cache it on disk, and load it (``ld -shared``, else LLJIT).

    lib = jit.compile(module, target)       # one llvmlite.ir.Module or IR text
    fn = lib.function("name", None, [ctypes.c_void_p, ...])

A program is built from kernel *units*: ``unit(emitter, args, target, units)`` stands for
the kernel(s) ``emitter(module, *args)`` emits. Its key hashes the emitter, its arguments
(graphs by their signature and their primitives' rules), the target, the source of the code
that emits kernels and the code of any rule outside it (a researcher's emitter or lowering), so
a unit seen before is read from the cache without building any IR; a new one is built into
a module of its own. A ``Compiler`` turns new units into object code while lowering goes on,
in worker processes (one per core when there are many, else one this process keeps), with a
progress bar once it takes a second, and ``link`` loads the objects of a program together, as
one shared object the system linker makes (cached) or through LLJIT: a process that runs
programs never has LLVM's optimiser or code generator resident. The cache lives in $GGRAPH_CACHE, else
~/.cache/ggraph.
"""
from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import hashlib
import itertools
import os
import pickle
import queue
import re
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import llvmlite
from llvmlite import ir

from ggraph.backends.llvm import cache
from ggraph.backends.llvm.target import AARCH64, X86, Target, host_arch, host_os, init_llvm, target_machine
from ggraph.demo import cache_dir          # one cache root for models and object code
from ggraph.ir.dims import Sym
from ggraph.ir.dtypes import Aval, DType
from ggraph.ir.fingerprint import fingerprint, primitives_of, rules_fingerprint
from ggraph.ir.graph import Graph
from ggraph.ir.primitive import Primitive

_DEFINE = re.compile(r'^define\s+([^@]*)@"?([^"(\s]+)"?\s*\(', re.MULTILINE)
_jit_lock = threading.Lock()
_jit: list = []                    # the one LLJIT instance, created on first use
_names = itertools.count()
PARALLEL_MIN = 4                   # compile in worker processes once this many new units wait


def _os_part(target: Target) -> tuple[str, ...]:
    """The target's triple where it is not one of the Linux triples every key before macOS assumed."""
    return () if target.triple in (X86, AARCH64) else (target.triple,)


def cache_key(ir_text: str, target: Target) -> str:
    """A hash of everything that decides the object code."""
    h = hashlib.sha256()
    for part in (ir_text, target.name, target.cpu, target.features, llvmlite.__version__, *_os_part(target)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def optimize(module, target: Target, speed_level: int = 3):
    """Parse, verify and run the O``speed_level`` pipeline (loop and SLP vectorisers on) for `target`:
    an llvmlite ModuleRef."""
    import llvmlite.binding as llvm
    tm = target_machine(target, speed_level)
    mod = llvm.parse_assembly(str(module))
    mod.triple = tm.triple
    mod.data_layout = str(tm.target_data)
    mod.verify()
    pto = llvm.create_pipeline_tuning_options(speed_level=speed_level)
    pto.loop_vectorization = speed_level > 1
    pto.slp_vectorization = speed_level > 1
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    return mod


def emit_assembly(module, target: Target) -> str:
    """Optimised assembly text for `target`; works for any target, runnable or not."""
    return target_machine(target).emit_assembly(optimize(module, target))


def emit_object(text: str, target: Target, speed_level: int = 3) -> bytes:
    """Object code of IR text for `target` at O``speed_level`` (the work a compile worker does)."""
    return target_machine(target, speed_level).emit_object(optimize(text, target, speed_level))


def object_code(module, target: Target) -> tuple[bytes, bool]:
    """Object code for `module` on `target` and whether it came from the disk cache."""
    text = str(module)
    path = cache_dir() / f"{cache_key(text, target)}.o"
    obj = cache.read(path, cache.OBJECT)
    if obj is not None:
        return obj, True
    obj = emit_object_elsewhere(text, target) if compile_python() else emit_object(text, target)
    cache.write(path, cache.OBJECT, obj)
    return obj, False


def defined_functions(ir_text: str) -> list[str]:
    """Names of the externally visible functions the IR text defines."""
    return [name for linkage, name in _DEFINE.findall(ir_text)
            if "internal" not in linkage and "private" not in linkage]


# ---------------------------------------------------------------------------------------
# kernel units
# ---------------------------------------------------------------------------------------

@functools.cache
def covered_roots() -> tuple[str, ...]:
    """The source directories ``code_digest`` hashes whole: the op table (ggraph/ir) and the llvm backend."""
    from ggraph import ir as ggraph_ir
    return tuple(str(p) + os.sep for p in (Path(__file__).parent, Path(ggraph_ir.__file__).parent))


@functools.cache
def code_digest() -> bytes:
    """A digest of the code that decides kernels: the op table (ggraph/ir) and the llvm backend."""
    h = hashlib.sha256(llvmlite.__version__.encode())
    for root in covered_roots():
        for p in sorted(Path(root).rglob("*.py")):
            h.update(p.read_bytes())
    return h.digest()


def user_code(obj) -> str:
    """A digest of the code in ``obj`` that ``code_digest`` does not cover: a researcher's emitter, numpy
    rule or lowering, the constants and closures they capture (``ggraph.ir.fingerprint``)."""
    return fingerprint(obj, covered_roots()).hex()


def graph_code(graph: Graph, lowering_of=None) -> str:
    """A digest of every rule of the primitives ``graph`` uses, and of ``lowering_of(prim)`` beside each
    (a program's key passes the llvm lowering rules; a fused body's kernel is emitted from the op table)."""
    return rules_fingerprint(primitives_of(graph), covered_roots(), lowering_of).hex()


def _key_part(a):
    if isinstance(a, Graph):
        return ("graph", a.signature(), graph_code(a))
    if isinstance(a, Target):
        return ("target", a.name, a.cpu, a.features, *_os_part(a))
    if isinstance(a, (tuple, list)):
        return tuple(_key_part(x) for x in a)
    if isinstance(a, (Aval, DType, Sym)):
        return str(a)
    if callable(a) or isinstance(a, Primitive):
        return ("code", getattr(a, "__qualname__", repr(a)), user_code(a))
    return repr(a)


@dataclasses.dataclass
class Unit:
    """The kernel(s) one emitter call makes: their names, and object code or the IR still to compile."""
    key: str
    names: tuple[str, ...]
    object: bytes | None = None
    text: str | None = None

    @property
    def path(self) -> Path:
        return cache_dir() / "kernels" / f"{self.key}.kernel"


def unit(emitter, args: tuple, target: Target, units: dict, compiler: "Compiler | None" = None) -> Unit:
    """The unit of ``emitter(module, *args)`` for ``target``: from ``units``, the disk cache, or built now
    (and handed to ``compiler``, which compiles it while lowering goes on)."""
    h = hashlib.sha256(code_digest())
    h.update(repr((emitter.__module__, emitter.__qualname__, user_code(emitter), _key_part(args),
                   _key_part(target))).encode())
    key = h.hexdigest()
    if key in units:
        return units[key]
    found = cached_unit(key)
    if found is None:
        module = ir.Module(name=emitter.__name__)
        out = emitter(module, *args)
        names = (out,) if isinstance(out, str) else tuple(out)
        found = Unit(key, names, text=str(module))
        if compiler is not None:
            compiler.submit(found)
    units[key] = found
    return found


def cached_unit(key: str) -> Unit | None:
    """The unit ``key`` from the disk cache, verified; None when it is not there (or was damaged)."""
    u = Unit(key, ())
    payload = cache.read(u.path, cache.KERNEL)
    if payload is None:
        return None
    try:
        u.names, u.object = cache.kernel_from_payload(payload)
    except (ValueError, UnicodeDecodeError, struct.error):
        cache.discard(u.path, "its header does not parse")
        return None
    return u


class Compiler:
    """Turns new kernel units into object code (and caches them): in the compile worker this process
    keeps when there are a few, in one worker process per core once ``PARALLEL_MIN`` are waiting, so
    that LLVM compiles while Python goes on lowering. ``finish`` waits for all of them, with a progress bar once it
    has taken a second.

        with Compiler(target) as c:
            ...  jit.unit(..., compiler=c) ...
            c.finish()
    """

    def __init__(self, target: Target, label: str = "compiling kernels"):
        self.target, self.label = target, label
        self.units: list[Unit] = []             # every unit submitted, in order
        self.pending: list[int] = []            # indices of units not yet handed to a worker
        self.workers: list[_Worker] | None = None
        self.results: queue.Queue = queue.Queue()

    def submit(self, u: Unit) -> None:
        self.units.append(u)
        self.pending.append(len(self.units) - 1)
        cores = os.cpu_count() or 1
        if self.workers is None and cores > 1 and len(self.pending) >= PARALLEL_MIN:
            self.workers = [_Worker(self.target, i, self.results) for i in range(cores)]
        if self.workers is not None:
            for i in self.pending:
                min(self.workers, key=lambda w: w.load).send(i, self.units[i])
            self.pending = []

    def finish(self, start: float | None = None) -> int:
        """Wait for every submitted unit's object code; returns how many were compiled. The progress
        bar shows once a second has passed since ``start`` (default: now)."""
        from ggraph.progress import Progress
        if not self.units:
            return 0
        with Progress(len(self.units), self.label, unit=" kernels", stream=sys.stderr, delay=1.0, start=start) as bar:
            if self.workers is None:
                for i in self.pending:
                    _finish(self.units[i], emit_object_elsewhere(self.units[i].text, self.target))
                    bar.advance()
            else:
                for _ in range(sum(w.sent for w in self.workers)):
                    i, result = self.results.get()
                    if i is None or isinstance(result, str):
                        what = "a compile worker died" if i is None else f"kernel {self.units[i].names[0]}"
                        raise RuntimeError(f"llvm backend: {what}: {result}")
                    _finish(self.units[i], result)
                    bar.advance()
        self.pending = []
        return len(self.units)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for w in self.workers or ():
            w.close()


def compile_python() -> str | None:
    """$GGRAPH_COMPILE_PYTHON: a command that runs compile workers in another Python (with the same
    ggraph and llvmlite), such as the host's own when this process is emulated (tests/arm/), so that LLVM
    runs natively; None: this Python runs them."""
    return os.environ.get("GGRAPH_COMPILE_PYTHON") or None


class _Worker:
    """One compile worker process (``compile_worker.py``), fed by a thread of its own so that sending
    a big module never blocks the caller, and read by another that posts results."""

    def __init__(self, target: Target, n: int, results: queue.Queue):
        python = compile_python()
        env = dict(os.environ) if python else \
            dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))   # the same ggraph as ours
        self.proc = subprocess.Popen([python or sys.executable, "-m", "ggraph.backends.llvm.compile_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.jobs: queue.Queue = queue.Queue()
        self.load = self.sent = 0
        self.jobs.put(target)
        threading.Thread(target=self._write, daemon=True, name=f"ggraph-compile-send-{n}").start()
        threading.Thread(target=self._read, args=(results,), daemon=True, name=f"ggraph-compile-recv-{n}").start()

    def send(self, index: int, u: Unit) -> None:
        self.load += len(u.text)
        self.sent += 1
        self.jobs.put((index, u.text))

    def _write(self) -> None:
        try:
            while (job := self.jobs.get()) is not None:
                pickle.dump(job, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                self.proc.stdin.flush()
            self.proc.stdin.close()
        except OSError:
            pass                                 # the reader reports the dead worker

    def _read(self, results: queue.Queue) -> None:
        try:
            while True:
                results.put(pickle.load(self.proc.stdout))
        except EOFError:
            pass
        except (OSError, pickle.UnpicklingError) as e:
            results.put((None, f"exit code {self.proc.poll()} ({type(e).__name__})"))
            return
        if self.proc.wait() != 0:
            results.put((None, f"exit code {self.proc.returncode}"))

    def close(self) -> None:
        self.jobs.put(None)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_kept: dict[tuple, tuple["_Worker", queue.Queue]] = {}      # target -> the compile worker kept for it
_kept_lock = threading.Lock()
_kept_timer: list[threading.Timer] = []
KEPT_IDLE_S = 5.0                  # a kept compile worker exits once it has been idle this long


def emit_object_elsewhere(text: str, target: Target) -> bytes:
    """``emit_object(text, target)`` in a compile worker that this process keeps (one per target, until
    it has been idle for ``KEPT_IDLE_S``), so that LLVM's optimiser and code generator never become
    resident here: a process that runs programs maps only the JIT linker's part of LLVM. A function
    marked ``optnone`` is compiled as at O0."""
    key = (target.name, target.cpu, target.features)
    with _kept_lock:
        for timer in _kept_timer:
            timer.cancel()
        _kept_timer.clear()
        if key not in _kept or _kept[key][0].proc.poll() is not None:
            if not _kept:
                atexit.register(_close_kept)
            results: queue.Queue = queue.Queue()
            _kept[key] = (_Worker(target, len(_kept), results), results)
        worker, results = _kept[key]
        worker.send(0, Unit("", (), text=text))
        index, result = results.get()
        timer = threading.Timer(KEPT_IDLE_S, _close_kept)
        timer.daemon = True
        timer.start()
        _kept_timer.append(timer)
    if index is None or isinstance(result, str):
        raise RuntimeError(f"llvm backend: {'the compile worker died' if index is None else 'compiling'}: {result}")
    return result


def _close_kept() -> None:
    with _kept_lock:
        for worker, _ in _kept.values():
            worker.close()
        _kept.clear()


def _finish(u: Unit, obj: bytes) -> None:
    u.object, u.text = obj, None
    cache.write(u.path, cache.KERNEL, cache.kernel_payload(u.names, obj))


# ---------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------

def _lljit():
    import llvmlite.binding as llvm
    init_llvm()
    with _jit_lock:
        if not _jit:
            # JITLink, not RuntimeDyld (llvmlite's default): RuntimeDyld maps code and constants
            # apart and, in llvmlite's LLVM (built with assertions), aborts the process when a
            # crowded address space puts them more than 2 GB apart; JITLink lays out a link in one
            # allocation and reports what it cannot resolve as an error.
            _jit.append(llvm.create_lljit_compiler(use_jit_link=True))
        return _jit[0]


class Library:
    """Loaded native code. Keep it alive while any of its addresses may be called."""

    def __init__(self, tracker, names: list[str], from_cache: bool, objects: tuple[bytes, ...]):
        self._tracker = tracker
        self.objects = objects             # the object code, for callers that cache more alongside it
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
        why = "uses AMX tiles and Linux refused this process the tile data" if target.arch == host_arch() \
            else f"is {target.arch} code"
        raise ValueError(f"target '{target.name}' {why}, so this process cannot execute it; "
                         f"use jit.emit_assembly() to inspect it")
    text = str(module)
    names = defined_functions(text)
    if not names:
        raise ValueError("module defines no external functions to load")
    obj, hit = object_code(text, target)
    return link([obj], names, hit)


def link(objects, names, from_cache: bool = True) -> Library:
    """Load object code (one or several objects that call each other) and export ``names``: as one
    shared object made by the system linker when there is one (cached, so that a process running
    programs it has run before needs none of LLVM's JIT), else with LLJIT."""
    lib = _shared_library(objects)
    if lib is None:
        import llvmlite.binding as llvm
        builder = llvm.JITLibraryBuilder()
        for obj in objects:
            builder.add_object_img(obj)
        builder.add_current_process()
        for name in names:
            builder.export_symbol(name)
        lib = builder.link(_lljit(), f"ggraph{next(_names)}")
    return Library(lib, list(names), from_cache, tuple(objects))


class _Dylib:
    """A shared object loaded with dlopen, its symbols looked up by name as LLJIT's tracker does. It is
    loaded from a file of its own name (dlopen takes a name it has loaded before for the same
    library), deleted once mapped."""

    def __init__(self, data: bytes):
        import tempfile
        fd, path = tempfile.mkstemp(prefix="ggraph-", suffix=".so")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            self._lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
        finally:
            os.unlink(path)

    def __getitem__(self, name: str) -> int:
        return ctypes.cast(getattr(self._lib, name), ctypes.c_void_p).value


_ELF_MACHINES = {62: "x86_64", 183: "aarch64"}              # ELF e_machine -> architecture


def _native_binary(path: str) -> bool:
    """False if ``path`` is an ELF executable for another architecture (an x86 ``ld`` that an emulated
    AArch64 process finds on PATH links x86 code only); True otherwise."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return True
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return True                                           # a script: it says nothing
    machine = struct.unpack_from("<H" if head[5] == 1 else ">H", head, 18)[0]
    return _ELF_MACHINES.get(machine, host_arch()) == host_arch()


def system_linker() -> str | None:
    """The path of the system linker that makes each program one shared object on Linux: ``ld``, or when
    that is another architecture's program (emulation) the cross linker named for this one
    (``aarch64-linux-gnu-ld``, as Debian names it); or None (macOS, Windows, no binutils, a foreign
    ``ld`` and no cross linker): LLJIT links programs in the process then."""
    if host_os() != "linux":
        return None
    ld = shutil.which("ld")
    return ld if ld is None or _native_binary(ld) else shutil.which(f"{host_arch()}-linux-gnu-ld")


def _shared_library(objects) -> _Dylib | None:
    """``objects`` linked by the system linker (``ld -shared``) into one shared object, loaded; the
    linked bytes are cached by the objects' digest. None without a linker, or when linking or
    loading fails (said once; LLJIT loads them then)."""
    ld = system_linker()
    if ld is None:
        return None
    h = hashlib.sha256(b"ld -shared")
    for obj in objects:
        h.update(hashlib.sha256(obj).digest())
    path = cache_dir() / "libs" / f"{h.hexdigest()}.so"
    data = cache.read(path, cache.OBJECT)
    if data is None:
        data = _ld_shared(ld, objects)
        if data is None:
            return None
        cache.write(path, cache.OBJECT, data)
    try:
        return _Dylib(data)
    except OSError as e:                                  # e.g. a temp dir mounted noexec
        from ggraph.progress import warn
        warn(f"cannot load a linked program ({e}); loading with LLVM's JIT instead")
        return None


def _ld_shared(ld: str, objects) -> bytes | None:
    import tempfile
    with tempfile.TemporaryDirectory(prefix="ggraph-ld-") as d:
        paths = [os.path.join(d, f"{i}.o") for i in range(len(objects))]
        for path, obj in zip(paths, objects):
            with open(path, "wb") as f:
                f.write(obj)
        out = os.path.join(d, "program.so")
        done = subprocess.run([ld, "-shared", "-o", out, *paths], capture_output=True, text=True)
        if done.returncode != 0:
            from ggraph.progress import warn
            lines = (done.stderr or "").strip().splitlines()
            warn(f"the system linker failed ({lines[-1] if lines else f'exit {done.returncode}'}); "
                 "loading with LLVM's JIT instead")
            return None
        with open(out, "rb") as f:
            return f.read()
