"""Fingerprints of code: what a cached kernel or program depends on besides ggraph's own source.

    fingerprint(fn, covered=(dir, ...)) -> bytes     # changes whenever fn would behave differently

A function is digested by what it runs: its bytecode and constants, its defaults, the values in its
closure cells and the values of the globals it names, recursively through the functions it reaches.
So a researcher's emitter that multiplies by a global ``k`` gets a new fingerprint when ``k`` or the
emitter's body changes, whatever its name. Functions defined in ``covered`` directories (source that
the caller hashes whole) contribute only their closures and defaults, where a user's function may be
held (``ops.elementwise`` wraps the user's numpy rule in a lambda of its own).
"""
from __future__ import annotations

import functools
import hashlib
import re
import sys
import types

import numpy as np

from ggraph.ir.graph import subgraphs
from ggraph.ir.primitive import Primitive

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
_MAX_DEPTH = 8                     # plain objects are followed this deep through their attributes


def fingerprint(obj, covered: tuple[str, ...] = ()) -> bytes:
    """A digest of ``obj`` as code that uses it sees it (see the module docstring)."""
    h = hashlib.sha256()
    _Feeder(h, tuple(covered)).feed(obj, 0)
    return h.digest()


def rules_fingerprint(prims, covered: tuple[str, ...] = (), extra=None) -> bytes:
    """A digest of every rule of each primitive in ``prims`` (by name), and of ``extra(prim)`` beside it
    (a backend's lowering rule)."""
    items = [(p.name, p, extra(p) if extra else None) for p in sorted(set(prims), key=lambda p: p.name)]
    return fingerprint(items, covered)


def primitives_of(graph) -> set[Primitive]:
    """Every primitive ``graph`` uses, composites and the ops inside their bodies alike, and the ops of the
    graphs its eqns run (a scan's body)."""
    out: set[Primitive] = set()
    stack = [graph]
    while stack:
        g = stack.pop()
        for e in g.eqns:
            out.add(e.prim)
            if e.body is not None:
                stack.append(e.body)
            stack.extend(sub for _, sub in subgraphs(e))
    return out


class _Feeder:
    def __init__(self, h, covered: tuple[str, ...]):
        self.h, self.covered = h, covered
        self.seen: dict[int, object] = {}          # id -> object, kept alive so that ids stay unique

    def tag(self, *parts) -> None:
        for p in parts:
            self.h.update(str(p).encode("utf-8", "surrogatepass"))
            self.h.update(b"\0")

    def feed(self, obj, depth: int) -> None:
        t = type(obj)
        if obj is None or t in (bool, int, float, complex, str, bytes):
            return self.tag(t.__name__, repr(obj))
        if id(obj) in self.seen:
            return self.tag("again", type(obj).__qualname__)
        self.seen[id(obj)] = obj
        if isinstance(obj, types.FunctionType):
            return self.function(obj, depth)
        if isinstance(obj, types.MethodType):
            self.tag("method")
            self.feed(obj.__func__, depth)
            return self.feed(obj.__self__, depth + 1)
        if isinstance(obj, functools.partial):
            self.tag("partial")
            return self.feed((obj.func, obj.args, obj.keywords), depth)
        if isinstance(obj, types.CodeType):
            return self.code(obj, depth)
        if isinstance(obj, Primitive):
            self.tag("primitive", obj.name, obj.kind)
            return self.feed([getattr(obj, s) for s in Primitive.__slots__ if s != "__weakref__"], depth)
        if isinstance(obj, (tuple, list)):
            self.tag(t.__name__, len(obj))
            for x in obj:
                self.feed(x, depth)
            return
        if isinstance(obj, dict):
            self.tag("dict", len(obj))
            for k, v in obj.items():
                self.feed(k, depth)
                self.feed(v, depth)
            return
        if isinstance(obj, (set, frozenset)):
            self.tag("set", *sorted(fingerprint(x, self.covered).hex() for x in obj))
            return
        if isinstance(obj, np.ndarray):
            self.tag("ndarray", obj.dtype.str, obj.shape)
            return self.h.update(np.ascontiguousarray(obj).tobytes())
        if isinstance(obj, (np.generic, np.dtype)):
            return self.tag(type(obj).__name__, repr(obj))
        if isinstance(obj, types.ModuleType):
            return self.tag("module", obj.__name__)
        if isinstance(obj, type):
            self.tag("class", obj.__module__, obj.__qualname__)
            if not self._is_covered(getattr(sys.modules.get(obj.__module__), "__file__", None)):
                self.feed({k: v for k, v in vars(obj).items() if isinstance(v, (types.FunctionType, classmethod,
                                                                                staticmethod, property))}, depth)
            return
        if isinstance(obj, (classmethod, staticmethod)):
            return self.feed(obj.__func__, depth)
        if isinstance(obj, property):
            return self.feed((obj.fget, obj.fset), depth)
        if callable(obj) and not hasattr(obj, "__dict__"):           # builtins, ufuncs
            return self.tag("builtin", _ADDRESS.sub("", repr(obj)))
        self.tag("object", t.__module__, t.__qualname__)
        if depth < _MAX_DEPTH:
            state = getattr(obj, "__dict__", None)
            if state is None and hasattr(t, "__slots__"):
                state = {s: getattr(obj, s, None) for s in t.__slots__}
            if state is not None:
                self.feed(type(obj), depth + 1)
                return self.feed(state, depth + 1)
        self.tag(_ADDRESS.sub("", repr(obj)))

    def _is_covered(self, filename) -> bool:
        return bool(filename) and bool(self.covered) and str(filename).startswith(self.covered)

    def function(self, fn: types.FunctionType, depth: int) -> None:
        code = fn.__code__
        own = self._is_covered(code.co_filename)
        self.tag("function", fn.__module__, fn.__qualname__)
        if not own:
            self.code(code, depth)
        self.feed((fn.__defaults__, fn.__kwdefaults__), depth)
        for cell in fn.__closure__ or ():
            try:
                self.feed(cell.cell_contents, depth)
            except ValueError:                                 # a cell not yet filled
                self.tag("empty cell")
        if not own:
            for name in sorted(_global_names(code)):
                if name in fn.__globals__:
                    self.tag("global", name)
                    self.feed(fn.__globals__[name], depth)

    def code(self, code: types.CodeType, depth: int) -> None:
        self.tag("code", code.co_argcount, code.co_kwonlyargcount, code.co_flags)
        self.h.update(code.co_code)
        self.tag(*code.co_names)
        for c in code.co_consts:
            self.feed(c, depth)


def _global_names(code: types.CodeType) -> set[str]:
    """The names a code object (and the code objects nested in it) may look up as globals."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names
