"""The state of lowering one graph: buffers, where each value lives, the kernel calls, the kernels.

A lowering rule (``rules.py``, one per primitive, in ``LOWERINGS``) looks up where its
operands live (``ref``), gets or aliases memory for its outputs (``output``, ``alias``),
asks for the kernels it needs (``kernel``) and appends calls (``call``). A call's pointer
arguments are (buffer, byte offset) references; its dims are ints or symbolic
expressions over the program's runtime dims T and P.

Kernels are keyed by signature: ``kernel(emitter, *args)`` names the kernel(s)
``emitter(module, *args)`` builds, and each distinct (emitter, args) is one unit, built
once per program however many eqns call it, and its object code cached on disk.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import numpy as np

from ggraph.ir.dims import Sym, eval_dim, product
from ggraph.ir.dtypes import Aval, DimAval
from ggraph.ir.graph import Eqn, Graph, Literal, Var
from ggraph.ir.primitive import Primitive
from ggraph.backends.llvm import jit
from ggraph.backends.llvm.kernels import act_bytes
from ggraph.passes.plan_memory import size_bytes
from ggraph.backends.llvm.target import Target

SYMBOLS = ("T", "P", "R")          # the runtime dims a program takes: tokens, past length, rows picked


class Bytes:
    """A buffer's size in bytes at given dims, as data (a program's state is pickled, and a lambda is
    not): ``size(dims)``, and the runtime dims it depends on. One subclass per way of knowing it."""

    def __call__(self, dims: dict) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not say its size")

    def symbols(self) -> frozenset:
        return frozenset()


@dataclasses.dataclass(frozen=True)
class FixedBytes(Bytes):
    """So many bytes, whatever the dims."""
    n: int

    def __call__(self, dims: dict) -> int:
        return self.n


@dataclasses.dataclass(frozen=True)
class AvalBytes(Bytes):
    """The bytes of a value of ``aval``."""
    aval: Aval

    def __call__(self, dims: dict) -> int:
        return self.aval.nbytes(dims)

    def symbols(self) -> frozenset:
        return frozenset(n for d in self.aval.shape if isinstance(d, Sym) for n in d.names)


@dataclasses.dataclass(frozen=True)
class PlanBytes(Bytes):
    """A memory-plan buffer: the largest of its values' size polynomials."""
    polys: tuple

    def __call__(self, dims: dict) -> int:
        return size_bytes(self.polys, dims)

    def symbols(self) -> frozenset:
        return frozenset(s for poly in self.polys for mono in poly for s in mono)


@dataclasses.dataclass(frozen=True)
class ActBytes(Bytes):
    """Quantised activations: ``rows`` rows of ``K`` values in format ``fmt``."""
    fmt: str
    rows: object
    K: int
    rows_only: bool = False

    def __call__(self, dims: dict) -> int:
        return act_bytes(self.fmt, eval_dim(self.rows, dims), self.K, self.rows_only)

    def symbols(self) -> frozenset:
        return frozenset(self.rows.names) if isinstance(self.rows, Sym) else frozenset()


@dataclasses.dataclass
class Buffer:
    """A memory region: a graph input, a weight, an activation, scratch, or a constant."""
    kind: str                              # "input" | "param" | "act" | "scratch" | "const" | "dim" | "counters" | ...
    name: str
    size: Bytes                            # bytes, given the dims
    data: np.ndarray | None = None         # constants: their bytes
    layout: str | None = None              # weights: how the program lays them out, if not as the file does


@dataclasses.dataclass(frozen=True)
class Ref:
    """A pointer argument: buffer ``buf`` plus a byte offset (a dim expression)."""
    buf: int
    offset: object = 0

    def plus(self, extra) -> "Ref":
        return self if extra == 0 else Ref(self.buf, extra if self.offset == 0 else self.offset + extra)


@dataclasses.dataclass(eq=False)
class Loop:
    """A counted loop around the calls lowered inside it (a scan's steps). Its step index is the runtime
    symbol ``index``, which the calls' Refs and dims may use (x_t = xs + index·stride): it runs over
    0..count-1, or from count-1 down to 0 when ``reverse``. Every thread runs every step; a barrier opens
    each step and follows the loop. ``counters``: the work counters of its calls, zeroed after each step."""
    index: str
    count: object                          # a dim (int | Sym over T, P, R)
    reverse: bool = False
    counters: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Call:
    kernel: str
    args: tuple                            # Refs and dims (int | Sym), then ith/nth are appended
    writes: frozenset                      # buffers this call writes; every other Ref is read
    eqn: Eqn | None = None                 # the eqn it implements (for profiles)
    loops: tuple = ()                      # the Loops it sits in, outermost first

    @property
    def reads(self) -> frozenset:
        return frozenset(a.buf for a in self.args if isinstance(a, Ref)) - self.writes


COUNTER_BYTES = 64                 # one work counter per cache line: threads bump them at once


class LoweringError(NotImplementedError):
    """The llvm backend cannot lower an op; the message names it."""


class Lowering:
    """State while lowering one graph: buffers, where each value lives, the calls and kernel units."""

    def __init__(self, graph: Graph, target: Target, compiler: jit.Compiler | None = None, rows_only: bool = False):
        self.graph, self.target, self.compiler = graph, target, compiler
        self.rows_only = rows_only          # quantised matmuls compute every token as if alone (a batch)
        self.buffers: list[Buffer] = []
        self.where: dict[Var, Ref] = {}
        self.calls: list[Call] = []
        self.units: dict[str, jit.Unit] = {}
        self.input_index: dict[Var, int] = {}
        self.param_index: dict[Var, int] = {}
        self._memo: dict = {}
        self.current: Eqn | None = None
        self.loops: list[Loop] = []                           # the loops being lowered into, outermost first
        self._loop_ids = 0
        self.placed: dict[Var, Ref] = {}                      # where output() puts a value (a scan's y_t)
        for v in graph.invars:
            if isinstance(v.aval, DimAval):
                if v.aval.symbol not in SYMBOLS:
                    raise LoweringError(f"llvm backend: dim input {v.aval.symbol} (only {SYMBOLS} are runtime dims)")
                self.where[v] = Ref(self._add(Buffer("dim", v.aval.symbol, FixedBytes(4))))  # its value, as i32
                continue
            self.input_index[v] = self._add(Buffer("input", v.hint or f"in{len(self.buffers)}", aval_size(v.aval)))
            self.where[v] = Ref(self.input_index[v])
        for v in graph.params:
            self.param_index[v] = self._add(Buffer("param", v.aval.source, aval_size(v.aval)))
            self.where[v] = Ref(self.param_index[v])
        self.plan = graph.meta.get("memory_plan")            # plan_memory's buffers, when it ran
        self._plan_buffers: dict[int, int] = {}
        self.checks: list[str] = []                           # what each status slot reports
        self._status: int | None = None
        self._counters: int | None = None                     # the "counters" buffer, once a kernel asks
        self.bounds: list[tuple] = []                         # (rows, capacity, what): rows <= capacity per run
        self.ranges: list[tuple] = []                         # (invar index, lo, hi, what): lo <= x < hi per run
        self._layouts: dict[int, tuple[str, list]] = {}       # weight buffer -> (layout, [(call, file kernel)])
        self._laid_kernels: set[str] = set()                  # kernels asked for weights in a layout of their own

    def _add(self, buf: Buffer) -> int:
        self.buffers.append(buf)
        return len(self.buffers) - 1

    # -- what lowering rules use -----------------------------------------------------
    def ref(self, a) -> Ref:
        """Where operand ``a`` lives (constants become const buffers)."""
        if isinstance(a, Literal):
            data = np.ascontiguousarray(a.value)
            return Ref(self._add(Buffer("const", f"const{len(self.buffers)}", FixedBytes(data.nbytes),
                                        data.view(np.uint8).reshape(-1))))
        return self.where[a]

    def output(self, v: Var) -> Ref:
        """Memory for ``v``: its buffer in the memory plan, or a buffer of its own for a value the plan
        does not cover (there is no plan, or ``v`` lives inside a composite lowered by its body)."""
        if v in self.placed:
            r = self.placed.pop(v)
        elif self.plan is None or v not in self.plan.buffer_of:
            r = Ref(self._add(Buffer("act", f"v{v.id}", aval_size(v.aval))))
        else:
            b = self.plan.buffer_of[v]
            if b not in self._plan_buffers:
                self._plan_buffers[b] = self._add(Buffer("act", f"buf{b}", PlanBytes(self.plan.sizes[b])))
            r = Ref(self._plan_buffers[b])
        self.where[v] = r
        return r

    def alias(self, v: Var, r: Ref) -> None:
        """``v`` is a view of existing memory (reshape, a leading-axis slice, an in-place op)."""
        self.where[v] = r

    def scratch(self, size: Bytes, name: str) -> Ref:
        return Ref(self._add(Buffer("scratch", name, size)))

    def status(self, message) -> Ref:
        """A status slot (i64 {flag, value}) a kernel sets on bad input; the run raises ``message``
        (with ``{id}`` filled in from the value) when it is set, or, for an (eqn index, output) pair,
        GGRAPH_DEBUG_NANS's error naming that eqn."""
        if self._status is None:
            self._status = self._add(Buffer("status", "status", FixedBytes(0)))
        self.checks.append(message)
        self.buffers[self._status].size = FixedBytes(16 * len(self.checks))
        return Ref(self._status, 16 * (len(self.checks) - 1))

    def counter(self) -> Ref:
        """A work counter of the call's own: an i32 on a cache line of its own, zero at the start of
        every run, for a kernel whose threads take chunks of work in turn (``Kernel.row_chunks``).
        No call writes it as far as barriers go: only the call it was made for touches it."""
        if self._counters is None:
            self._counters = self._add(Buffer("counters", "counters", FixedBytes(0)))
        buf = self.buffers[self._counters]
        n = buf.size({}) // COUNTER_BYTES
        buf.size = FixedBytes(COUNTER_BYTES * (n + 1))
        r = Ref(self._counters, COUNTER_BYTES * n)
        if self.loops:                                        # zero again for the next step
            self.loops[-1].counters.append(r)
        return r

    @contextlib.contextmanager
    def loop(self, count, reverse: bool = False):
        """Lower calls into a counted loop (``Loop``); yields its step index as a dim (a Sym)."""
        lp = Loop(f"step{self._loop_ids}", count, reverse)
        self._loop_ids += 1
        self.loops.append(lp)
        try:
            yield Sym(lp.index)
        finally:
            self.loops.pop()

    def bound(self, rows, capacity: int, what: str) -> None:
        """Require ``rows`` (a dim expression, e.g. P+T) <= ``capacity`` on every run, before the call:
        the kernels write and read those rows without checking. Of the bounds on one expression (every
        KV cache's P+T) only the tightest is kept: it fails first, and each run evaluates one."""
        for i, (seen, cap, _) in enumerate(self.bounds):
            if seen == rows:
                if int(capacity) < cap:
                    self.bounds[i] = (rows, int(capacity), what)
                return
        self.bounds.append((rows, int(capacity), what))

    def value_range(self, v, lo: int, hi: int, what: str) -> None:
        """Require every element of input ``v`` (integer data, e.g. cache rows) in ``lo <= x < hi`` on every
        run, before the call: the kernels index with it without checking. A value computed inside the
        graph is the graph's to keep in range."""
        if isinstance(v, Var) and v in self.input_index:
            self.ranges.append((self.graph.invars.index(v), int(lo), int(hi), what))

    def kernel(self, emitter: Callable, *args):
        """The name of the kernel ``emitter(module, *args)`` builds (a tuple if it builds several)."""
        unit = jit.unit(emitter, args, self.target, self.units, self.compiler)
        return unit.names[0] if len(unit.names) == 1 else unit.names

    def call(self, kernel: str, *args, writes=()) -> None:
        """Append a kernel call; ``writes`` are the Refs it writes (the rest it only reads)."""
        self.calls.append(Call(kernel, tuple(args), frozenset(r.buf for r in writes), self.current, tuple(self.loops)))

    def weight_layout(self, w: Ref, aval: Aval, layout: str, kernel: Callable[[], str],
                      file_kernel: Callable[[], str]) -> str:
        """The kernel of the call about to be appended, which reads weight ``w`` as ``aval``: ``kernel()``, for
        weights in ``layout``, if ``w`` is a whole weight buffer of that shape (not a slice or a reshape of
        one); else ``file_kernel()``, for the file's layout. The buffer keeps the layout if every call that
        reads it asks for the same (``settle_layouts``)."""
        buf = self.buffers[w.buf]
        whole = buf.kind == "param" and w.offset == 0 and any(
            b == w.buf and v.aval.shape == aval.shape for v, b in self.param_index.items())
        if not whole or self._layouts.get(w.buf, (layout,))[0] != layout:
            return file_kernel()
        self._layouts.setdefault(w.buf, (layout, []))[1].append((len(self.calls), file_kernel))
        name = kernel()
        self._laid_kernels.add(name)
        return name

    def settle_layouts(self) -> None:
        """Give each weight buffer its layout if only the calls that asked for it read it; else point
        those calls at their kernels for the file's layout."""
        readers: dict[int, set] = {}
        for i, c in enumerate(self.calls):
            for r in c.reads:
                readers.setdefault(r, set()).add(i)
        for buf, (layout, calls) in self._layouts.items():
            if readers.get(buf, set()) == {i for i, _ in calls}:
                self.buffers[buf].layout = layout
            else:
                for i, file_kernel in calls:
                    self.calls[i] = dataclasses.replace(self.calls[i], kernel=file_kernel())
        called = {c.kernel for c in self.calls}                # a kernel no call is left with is not built
        self.units = {key: u for key, u in self.units.items()
                      if called & set(u.names) or not self._laid_kernels & set(u.names)}

    def memo(self, key, value=None):
        """Remember a lowering product (e.g. quantised activations) for reuse by later eqns."""
        if value is not None:
            self._memo[key] = value
        return self._memo.get(key)


LOWERINGS: dict[Primitive, Callable[[Lowering, Eqn], None]] = {}


def lowering(*prims: Primitive):
    """Register a lowering rule for the primitives ``prims``."""
    def wrap(fn):
        for p in prims:
            LOWERINGS[p] = fn
        return fn
    return wrap


def aval_size(aval: Aval) -> AvalBytes:
    return AvalBytes(aval)


def rows(aval: Aval):
    """The product of all but the last dim (a dim expression)."""
    return product(aval.shape[:-1])


def symbol_args(*avals) -> list[Sym]:
    """The i64 size arguments of a kernel over ``avals``: each symbol in the shapes, sorted by name."""
    return [Sym(n) for n in sorted({s for a in avals for s in a.symbols})]
