"""The compiled native program: buffers, the thread team, and the call from Python.

    prog = LLVMProgram(graph, weights=gguf_file, threads=2)
    logits, *caches = prog.run_inputs([tokens, P, *k_caches, *v_caches])

Weights are read in place from the GGUF mmap, except those the program lays out its own way
(``Buffer.layout``: q4_k, q5_k and q6_k matrices interleaved 16 rows at a time on AVX-512 VNNI,
with or without AMX, see kernels/rows16.py), copied once per process into memory of their own as they
are bound, the file's pages let go. Activations live in one arena that grows to the largest step seen and is
reused. One call runs the whole graph: every team thread enters the program once.

Building is cached at two levels: each kernel unit's object code (``jit.unit``), and the
whole lowered program (its buffers, calls and the program function's object code) by the
graph's signature, target and code. A warm start builds no IR; a program already loaded
in this process is reused as it is.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pickle
import sys
import time
import weakref
from pathlib import Path

import numpy as np

from ggraph.backends import debug_nans
from ggraph.backends.llvm import cache, jit
from ggraph.backends.llvm.codegen import Call, ProgramSpec, barriers_needed, lower
from ggraph.backends.llvm.lowering import LOWERINGS, Ref
from ggraph.backends.llvm.target import host_target
from ggraph.backends.llvm.team import RUN, SERVE, Team, check_threads
from ggraph.backends.inputs import bind_symbols
from ggraph.backends.program import Program
from ggraph import memory
from ggraph.ir.dims import eval_dim
from ggraph.ir.graph import Literal, Var
from ggraph.ir.prims import Blocks
from ggraph.progress import Progress

ALIGN = 64
_LOADED: dict[str, tuple[dict, list, jit.Library]] = {}     # program key -> (state, units, code) loaded here


def _load_or_build(graph, target, profile: bool, rows_only: bool = False, debug_nans: bool = False):
    """The lowered program for ``graph`` and its loaded code: already loaded in this process, from the
    program cache (no IR is built then), or lowered, compiled (new kernels only) and saved."""
    if not target.executable:
        raise ValueError(f"llvm backend: target '{target.name}' cannot run in this process (another "
                         f"architecture, or AMX tiles without Linux's permission)")
    key = program_key(graph, target, profile, rows_only, debug_nans)
    if key not in _LOADED:
        path = jit.cache_dir() / f"{key}.program"
        loaded = _load(path)
        if loaded is not None:
            try:
                state, units = loaded
                lib = jit.link([u.object for u in units] + [state["object"]], _exports(state), True)
            except Exception as e:                         # verified, yet it does not link: rebuild it all
                cache.discard(path, f"it does not link: {e}")
                for u in loaded[1]:
                    cache.discard(u.path, "its program did not link")
                loaded = None
        if loaded is None:
            state, units = _build(graph, target, profile, rows_only, debug_nans)
            cache.write(path, cache.PROGRAM, cache.dump_state(state))
            lib = jit.link([u.object for u in units] + [state["object"]], _exports(state), False)
        _LOADED[key] = state, units, lib
    state, units, lib = _LOADED[key]
    return _spec_from_state(state, graph, units), lib


def _exports(state: dict) -> list[str]:
    return [state["name"], SERVE, RUN]


def _build(graph, target, profile: bool, rows_only: bool = False, debug_nans: bool = False) -> tuple[dict, list]:
    """Lower ``graph``, compile its new kernels (in workers, while lowering goes on) and its program."""
    t0 = time.perf_counter()
    with jit.Compiler(target) as compiler:
        with Progress(len(graph.eqns), "lowering", unit=" ops", stream=sys.stderr, delay=1.0) as bar:
            spec = lower(graph, target, profile, compiler, bar, rows_only, debug_nans)
        compiler.finish(start=t0)
    fn = spec.module.globals[spec.name]
    fn.attributes.add("noinline")                  # a list of calls: nothing to optimise, and unoptimised
    fn.attributes.add("optnone")                   # code generation takes a blink
    obj = jit.emit_object_elsewhere(str(spec.module), target)
    _release_freed_heap()
    return _spec_state(spec, graph, obj), spec.units


def _release_freed_heap() -> None:
    """Hand the heap that lowering freed back to the system (glibc keeps it otherwise), so that it
    is not resident for the life of the process."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):              # not glibc
        pass


def _load(path: Path):
    """(state, units) from a verified cache entry whose kernels are all cached and verified; else None."""
    payload = cache.read(path, cache.PROGRAM)
    if payload is None:
        return None
    try:
        state = cache.load_state(payload)
        units = [jit.cached_unit(k) for k in state["units"]]
    except (pickle.UnpicklingError, EOFError, KeyError, AttributeError, ValueError, TypeError, ImportError) as e:
        cache.discard(path, f"it does not load: {e}")
        return None
    return None if any(u is None for u in units) else (state, units)


@functools.cache
def _planner_source() -> bytes:
    from ggraph.passes import plan_memory
    return Path(plan_memory.__file__).read_bytes()


def program_key(graph, target, profile: bool, rows_only: bool = False, debug_nans: bool = False) -> str:
    """What decides a compiled program: the graph's signature, the target, the code (ggraph's and the rules
    of the graph's primitives, a researcher's included), profiling, and the
    names of the weights it binds (the signature leaves names out: two files whose graphs differ only
    in a tensor's name, or in one the program does not read, must not share a cached program)."""
    h = hashlib.sha256(graph.signature().encode())
    h.update("\0".join(v.aval.source for v in graph.params).encode("utf-8", "surrogatepass"))
    for part in (target.name, target.cpu, target.features, str(target.gemv_prefetch), str(profile), str(rows_only),
                 str(debug_nans)):
        h.update(part.encode())
    h.update(jit.code_digest())
    h.update(jit.graph_code(graph, LOWERINGS.get).encode())
    h.update(_planner_source())
    return h.hexdigest()


def _spec_state(spec, graph, program_object: bytes) -> dict:
    index = {id(e): i for i, e in enumerate(graph.eqns)}
    return {"buffers": spec.buffers, "outputs": spec.outputs, "name": spec.name, "object": program_object,
            "units": [u.key for u in spec.units], "checks": spec.checks, "bounds": spec.bounds, "ranges": spec.ranges,
            "calls": [(c.kernel, c.args, c.writes, index.get(id(c.eqn)), c.loops) for c in spec.calls],
            "inputs": [(graph.invars.index(v), b) for v, b in spec.input_index.items()],
            "params": [(v.aval.source, b) for v, b in spec.param_index.items()]}


def _spec_from_state(state: dict, graph, units) -> ProgramSpec:
    by_source = {v.aval.source: v for v in graph.params}
    calls = [Call(k, args, writes, graph.eqns[i] if i is not None else None, loops)
             for k, args, writes, i, loops in state["calls"]]
    return ProgramSpec(None, state["buffers"], calls, state["outputs"],
                       {graph.invars[i]: b for i, b in state["inputs"]},
                       {by_source[src]: b for src, b in state["params"]}, units, state["checks"], state["bounds"],
                       state["name"], ranges=state["ranges"])


def lifetimes(spec: ProgramSpec) -> dict[int, tuple[int, int]]:
    """The (first, last) barrier epoch of each activation and scratch buffer: calls between two
    barriers form one epoch and may run at once on different threads, so two buffers may share
    bytes only when their epochs do not meet. An output lives on after the last call; a buffer a
    loop's call uses lives over the whole (outermost) loop, every step of it."""
    spans: dict[int, tuple[int, int]] = {}
    loop_epochs: dict[int, tuple[int, int]] = {}              # id of an outermost loop -> its epochs
    in_loop: list[tuple[int, int]] = []                       # (buffer, outermost loop id)
    epoch, loops = 0, ()
    for call, wait in zip(spec.calls, barriers_needed(spec.calls)):
        epoch += wait or call.loops != loops                  # entering or leaving a loop passes a barrier
        loops = call.loops
        for a in call.args:
            if isinstance(a, Ref):
                spans[a.buf] = (spans.get(a.buf, (epoch,))[0], epoch)
                if loops:
                    in_loop.append((a.buf, id(loops[0])))
        if loops:
            loop_epochs[id(loops[0])] = (loop_epochs.get(id(loops[0]), (epoch,))[0], epoch)
    for buf, lp in in_loop:
        (lo, hi), (a, b) = spans[buf], loop_epochs[lp]
        spans[buf] = (min(lo, a), max(hi, b))
    end = epoch + 1
    for o in spec.outputs:
        if isinstance(o, Ref):
            spans[o.buf] = (spans.get(o.buf, (0,))[0], end)
    return {i: spans.get(i, (0, end)) for i, b in enumerate(spec.buffers) if b.kind in ("act", "scratch")}


def pack(sizes: dict[int, int], spans: dict[int, tuple[int, int]]) -> tuple[dict[int, int], int]:
    """Offsets for buffers of ``sizes`` whose lifetimes are ``spans``, and the arena's total: largest
    first, each at the lowest offset clear of every placed buffer whose lifetime meets its own."""
    placed: list[tuple[int, int, int, int]] = []             # (start, end, first epoch, last epoch)
    offsets = {}
    for i in sorted(sizes, key=lambda i: (-sizes[i], i)):
        lo, hi = spans[i]
        off = 0
        for start, end in sorted((s, e) for s, e, a, b in placed if a <= hi and lo <= b):
            if off + sizes[i] <= start:
                break
            off = max(off, end)
        placed.append((off, off + sizes[i], lo, hi))
        offsets[i] = off
    return offsets, max((end for _, end, _, _ in placed), default=0)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _slot(old: int, n: int) -> int:
    """The bytes a buffer's slot holds once it must take ``n``: ``n`` the first time, then a quarter more."""
    return old if n <= old else n if not old else _aligned(max(n, old * 5 // 4))


_NOT_LAID_OUT = object()          # no layout yet; a graph with no T has T = None


class LLVMProgram(Program):
    """A graph compiled to one native program for the host's (or a forced) feature set."""

    def __init__(self, graph, weights=None, threads: int | None = None, target=None, profile: bool = False,
                 max_memory: int | None = None, rows_only: bool = False):
        """``rows_only``: quantised matmuls compute each token as if it were alone in the step, so that
        a batch of sequences gets the same results whoever shares its steps (prefill is slower)."""
        self.graph = graph
        self.max_memory = max_memory
        self.target = target or host_target()
        self.profile = profile
        self.last_profile: list[tuple] = []           # (call, seconds) of the last run, when profiling
        self.last_idle = 0.0                          # seconds the threads of that run spent at barriers
        t0 = time.perf_counter()
        self.debug_nans = debug_nans.enabled()
        self.spec, self.lib = _load_or_build(graph, self.target, profile, rows_only, self.debug_nans)
        self.compile_s = time.perf_counter() - t0
        self.threads = check_threads(threads) or os.cpu_count() or 1
        self.team = Team(self.lib, self.threads)
        self.table = np.zeros(len(self.spec.buffers), dtype=np.uint64)
        self._keep: dict[int, object] = {}            # arrays whose addresses are in the table
        self._weights: dict[Var, object] = {}          # each weight as given (before any layout of ours)
        self._arena = np.zeros(0, dtype=np.uint8)
        self._spans = lifetimes(self.spec)             # arena buffer -> (first, last) epoch it is used in
        self._slots: dict[int, int] = {}               # arena buffer -> bytes its place in the arena holds
        # a decode step differs from the last in P only: sizes that depend on T alone are kept per T
        self._grows = [i for i in self._spans if self.spec.buffers[i].size.symbols() - {"T"}]
        self._per_T: dict[int, dict[int, int]] = {}
        self._weights_bound = False                    # every weight checked bound (bind() may rebind)
        self._fits_T = _NOT_LAID_OUT                   # a T whose T-only sizes fit the slots as laid out
                                                       # (None for a graph without T: not the same thing)
        self._outputs = [_output_plan(o, v, self.spec) for o, v in zip(self.spec.outputs, graph.outvars)]
        self._dim_values = {}                          # dim inputs (P) as i32 scalars in memory
        self._status = np.zeros(2 * len(self.spec.checks), dtype=np.int64)
        self._counters = np.zeros(0, dtype=np.int32)  # the work counters of kernels that take chunks in turn
        for i, buf in enumerate(self.spec.buffers):
            if buf.kind == "const":
                self._bind(i, buf.data)
            elif buf.kind == "dim":
                self._dim_values[buf.name] = np.zeros(1, dtype=np.int32)
                self._bind(i, self._dim_values[buf.name])
            elif buf.kind == "profile":
                self._cycles = np.zeros((self.threads + 1, len(self.spec.calls) + 1), dtype=np.int64)
                self._bind(i, self._cycles)
            elif buf.kind == "status":
                self._bind(i, self._status)
            elif buf.kind == "counters":
                self._counters = np.zeros(buf.size({}) // 4, dtype=np.int32)
                self._bind(i, self._counters)
        if weights is not None:
            self.bind_weights(weights)

    # -- memory ----------------------------------------------------------------------
    def _bind(self, i: int, array) -> None:
        if self._keep.get(i) is array:              # the same array as the last step's (a KV cache)
            return
        data = array.data if isinstance(array, (Blocks, _Laid)) else array
        if not data.flags.c_contiguous:
            raise ValueError(f"buffer {self.spec.buffers[i].name}: the llvm backend needs contiguous arrays")
        self._keep[i] = array
        self.table[i] = data.ctypes.data

    @property
    def bound(self) -> set:
        return {v for v, i in self.spec.param_index.items() if self.table[i] != 0}

    def bind(self, v: Var, value) -> None:
        """Point weight ``v`` at a checked value (a view of the GGUF mmap, or an array); a weight the
        program lays out its own way (``Buffer.layout``) at a copy in that layout, made once per
        process for each value."""
        i = self.spec.param_index[v]
        self._weights[v] = value
        layout = self.spec.buffers[i].layout
        self._bind(i, value if layout is None else laid_out(value, v.aval, layout))

    def arena_bytes(self, dims: dict) -> int:
        """The activation arena a step at ``dims`` (T, P) needs, packed by lifetime."""
        return pack(self._sizes(dims), self._spans)[1]

    def _sizes(self, dims: dict) -> dict[int, int]:
        return {**self._sizes_of_T(dims), **{i: self._size(i, dims) for i in self._grows}}

    def _sizes_of_T(self, dims: dict) -> dict[int, int]:
        """The sizes of the buffers that depend on T alone (or on nothing), kept per T."""
        T = dims.get("T")
        if T not in self._per_T:
            if len(self._per_T) > 64:
                self._per_T.clear()
            grows = set(self._grows)
            self._per_T[T] = {i: self._size(i, dims) for i in self._spans if i not in grows}
        return self._per_T[T]

    def _size(self, i: int, dims: dict) -> int:
        return _aligned(max(self.spec.buffers[i].size(dims), 1))

    def _layout(self, dims: dict) -> None:
        """Place activation and scratch buffers in the arena for these dims. The layout is kept while
        every buffer fits its slot; a buffer that outgrows it is re-packed with a quarter to spare,
        so that a size growing step by step re-packs only now and then."""
        T, grows = dims.get("T"), {i: self._size(i, dims) for i in self._grows}
        fits = lambda sizes: all(n <= self._slots.get(i, 0) for i, n in sizes.items())  # noqa: E731
        if fits(grows) and (self._fits_T == T or fits(self._sizes_of_T(dims))):
            self._fits_T = T
            return
        sizes = {**self._sizes_of_T(dims), **grows}
        slots = {i: _slot(self._slots.get(i, 0), n) for i, n in sizes.items()}
        offsets, total = pack(slots, self._spans)
        if total + ALIGN > self._arena.nbytes:
            memory.check(total, f"the activations of a step of T={dims.get('T')}", self.max_memory)
            self._arena = np.zeros(total + ALIGN, dtype=np.uint8)
        base = self._arena.ctypes.data
        base += -base % ALIGN
        for i, off in offsets.items():
            self.table[i] = base + off
        self._slots, self._fits_T = slots, T

    # -- calling -----------------------------------------------------------------------
    def run(self, values: dict[Var, object], first: int | None = None) -> list:
        g = self.graph
        if not self._weights_bound:
            for v in g.params:
                if self.table[self.spec.param_index[v]] == 0:
                    raise KeyError(f"no value for weight {v.aval.source!r}")
            self._weights_bound = True
        dims = bind_symbols(g, values)
        for rows, capacity, what in self.spec.bounds:
            n = eval_dim(rows, dims)
            if n > capacity:
                raise ValueError(f"{what}, but this step needs rows up to {n} "
                                 f"({', '.join(f'{k}={v}' for k, v in sorted(dims.items()))})")
        for index, lo, hi, what in self.spec.ranges:
            x = values[g.invars[index]]
            data = x.data if isinstance(x, Blocks) else x
            if data.size and (data.min() < lo or data.max() >= hi):
                bad = data.min() if data.min() < lo else data.max()
                raise ValueError(f"{what}, got {int(bad)}")
        for v, i in self.spec.input_index.items():
            self._bind(i, values[v])
        self._layout(dims)
        for name, cell in self._dim_values.items():
            cell[0] = dims[name]
        self._status[:] = 0
        self._counters[:] = 0
        T, P, R = int(dims.get("T", 1)), int(dims.get("P", 0)), int(dims.get("R", 0))
        if self.profile:
            self._cycles[:] = 0                               # the program adds each call's cycles
        t0 = time.perf_counter()
        self.team.run(self.table.ctypes.data, T, P, R)
        if self.profile:
            self._read_profile(time.perf_counter() - t0)
        for slot, message in enumerate(self.spec.checks):
            if self._status[2 * slot]:
                found = int(self._status[2 * slot + 1])
                if isinstance(message, tuple):                      # GGRAPH_DEBUG_NANS: (eqn index, output)
                    raise self._non_finite(*message, found, values)
                raise IndexError(message.format(id=found))
        return [self._output(plan, dims) for plan in self._outputs[:first]]

    def _non_finite(self, eqn_index: int, output: int, element: int, values: dict):
        """The error naming the first eqn whose output a check kernel found not finite; its operands that are
        graph inputs or weights are looked at for the cause (any other was checked finite when made)."""
        e = self.graph.eqns[eqn_index]
        given = {**values, **self._weights}
        return debug_nans.error(e, output, (element, None), [(a, given.get(a)) for a in e.inputs if a in given])

    def _read_profile(self, wall: float) -> None:
        """Each call's time is its threads' mean time from their start of it to their finish (summed over a
        loop's steps); the rest of its span, up to the barrier after it opening, is waiting (imbalance
        and the barrier)."""
        per_tick = wall / max(int(self._cycles[0, 0]), 1)                         # calibrate the counter
        busy = self._cycles[1:, 1:].mean(axis=0)
        spans = self._cycles[0, 1:]
        self.last_profile = [(c, float(t) * per_tick) for c, t in zip(self.spec.calls, busy)]
        self.last_idle = float(np.maximum(spans - busy, 0).sum()) * per_tick

    def _output(self, plan, dims):
        ref, var, static, in_place = plan
        if isinstance(ref, Literal):
            return ref.value
        shape = static or var.aval.concrete(dims)
        if in_place:                                        # an in-place update of an input (a KV cache)
            kept = self._keep[ref.buf]
            if isinstance(kept, (np.ndarray, Blocks)) and kept.shape == shape:
                return kept
        nbytes = var.aval.dtype.nbytes(shape)
        off = int(self.table[ref.buf]) + (ref.offset if isinstance(ref.offset, int) else ref.offset.eval(dims))
        raw = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * nbytes).from_address(off))
        return raw.view(var.aval.dtype.np_dtype).reshape(shape).copy()


class _Laid:
    """A weight's bytes in a program's own layout, and the value they were made from (kept alive, so
    that its address, the cache key, is not reused while the copy exists)."""

    def __init__(self, source, data: np.ndarray):
        self.source, self.data = source, data


_LAID: "weakref.WeakValueDictionary[tuple, _Laid]" = weakref.WeakValueDictionary()


def laid_out(value, aval, layout: str) -> _Laid:
    """``value`` (a weight's Blocks) in ``layout``: the copy already made in this process for the
    same bytes, or a new one (rows16.repack) in pages of its own."""
    from ggraph.backends.llvm.kernels import rows16
    data = value.data if isinstance(value, Blocks) else value
    key = (data.ctypes.data, data.nbytes, layout)
    laid = _LAID.get(key)
    if laid is None:
        if layout != rows16.LAYOUT or aval.dtype.name not in rows16.TYPES:
            raise ValueError(f"weight {aval.source!r}: no layout {layout!r} for {aval}")
        N, K = aval.shape
        laid = _LAID[key] = _Laid(value, rows16.repack(data, aval.dtype, N, K,
                                                    out=own_pages(rows16.nbytes(aval.dtype, N, K))))
        _drop_file_pages(data)
    return laid


def own_pages(nbytes: int) -> np.ndarray:
    """``nbytes`` of memory of its own (uint8), page aligned, given back to the system when the last
    view of it goes. In 4 KB pages: 2 MB pages ran no faster and kept more resident (docs/kernels.md)."""
    import mmap
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8)[:nbytes]


def _drop_file_pages(a: np.ndarray) -> None:
    """Unmap from this process the whole pages of a read-only file mapping that ``a`` views (a weight
    the program reads from its own copy; the page cache keeps them, a later read maps them again);
    nothing for an array of its own."""
    import mmap
    owner = a.base
    while isinstance(owner, (np.ndarray, memoryview)):
        owner = owner.obj if isinstance(owner, memoryview) else owner.base
    if not isinstance(owner, mmap.mmap):
        return
    start = a.ctypes.data - np.frombuffer(owner, np.uint8).ctypes.data
    lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo and hasattr(owner, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            owner.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except OSError:                               # they stay mapped: only memory is lost
            pass


def _output_plan(ref, var, spec) -> tuple:
    """(ref, var, its shape when static, whether it is an input updated in place) for one output."""
    if isinstance(ref, Literal):
        return ref, var, None, False
    static = None if var.aval.symbols else var.aval.concrete({})
    return ref, var, static, spec.buffers[ref.buf].kind == "input" and ref.offset == 0
