"""The compiled native program: buffers, the thread team, and the call from Python.

    prog = LLVMProgram(graph, weights=gguf_file, threads=2)
    logits, *caches = prog.run_inputs([tokens, P, *k_caches, *v_caches])

Weights are read in place from the GGUF mmap; activations live in one arena that grows
to the largest step seen and is reused. One call runs the whole graph: every team
thread enters the program once.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import time
from pathlib import Path

import numpy as np

from ggraph.core import Literal, Var
from ggraph.backends.llvm import jit
from ggraph.backends.llvm.codegen import Call, ProgramSpec, lower
from ggraph.backends.llvm.target import host_target
from ggraph.backends.llvm.team import PROGRAM_ARGS, Team
from ggraph.backends.numpy_ref import as_value, bind_symbols, weight_value
from ggraph.prims import Blocks
from ggraph.trace import tree_flatten, tree_unflatten

ALIGN = 64


def _load_or_build(graph, target, profile: bool):
    """The lowered program and its loaded code: from the program cache when this exact graph,
    target and kernel source were compiled before (no IR is built then), else built and saved."""
    key = program_key(graph, target, profile)
    path = jit.cache_dir() / f"{key}.program"
    if path.exists():
        try:
            with open(path, "rb") as f:
                state = pickle.load(f)
            return _spec_from_state(state, graph), jit.link(state["object"], state["names"], True)
        except (OSError, pickle.UnpicklingError, EOFError, KeyError, IndexError, AttributeError, ValueError):
            path.unlink(missing_ok=True)                     # a stale or torn entry: rebuild it
    spec = lower(graph, target, profile)
    text = str(spec.module)
    lib = jit.compile(text, target)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(_spec_state(spec, graph, lib.object, lib.names), f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
    return spec, lib


@functools.cache
def _kernel_sources() -> bytes:
    """A digest of the code that decides a program: the llvm backend and the memory planner."""
    from ggraph.passes import plan_memory
    root = Path(__file__).parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")) + [Path(plan_memory.__file__)]:
        h.update(p.read_bytes())
    return h.digest()


def program_key(graph, target, profile: bool) -> str:
    """What decides a compiled program: the graph's text and constants, the target, the code."""
    import llvmlite
    h = hashlib.sha256(graph.pretty(expand=True).encode())
    for e in graph.walk(expand=True):
        for a in e.inputs:
            if isinstance(a, Literal) and a.value.ndim:
                h.update(a.value.tobytes())
    for part in (target.name, target.cpu, target.features, llvmlite.__version__, str(profile)):
        h.update(part.encode())
    h.update(_kernel_sources())
    return h.hexdigest()


def _spec_state(spec, graph, obj: bytes, names) -> dict:
    index = {id(e): i for i, e in enumerate(graph.eqns)}
    return {"buffers": spec.buffers, "outputs": spec.outputs, "name": spec.name, "object": obj, "names": list(names),
            "calls": [(c.kernel, c.args, c.writes, index.get(id(c.eqn))) for c in spec.calls],
            "inputs": [(graph.invars.index(v), b) for v, b in spec.input_index.items()],
            "params": [(v.aval.source, b) for v, b in spec.param_index.items()]}


def _spec_from_state(state: dict, graph) -> ProgramSpec:
    by_source = {v.aval.source: v for v in graph.params}
    calls = [Call(k, args, writes, graph.eqns[i] if i is not None else None) for k, args, writes, i in state["calls"]]
    return ProgramSpec(None, state["buffers"], calls, state["outputs"],
                       {graph.invars[i]: b for i, b in state["inputs"]},
                       {by_source[src]: b for src, b in state["params"]}, state["name"])


class LLVMProgram:
    """A graph compiled to one native program for the host's (or a forced) feature set."""

    def __init__(self, graph, weights=None, threads: int | None = None, target=None, profile: bool = False):
        self.graph = graph
        self.target = target or host_target()
        self.profile = profile
        self.last_profile: list[tuple] = []           # (call, seconds) of the last run, when profiling
        t0 = time.perf_counter()
        self.spec, self.lib = _load_or_build(graph, self.target, profile)
        self.compile_s = time.perf_counter() - t0
        self.fn = self.lib.function(self.spec.name, None, PROGRAM_ARGS)
        self.threads = int(threads or os.cpu_count() or 1)
        self.team = Team(self.threads)
        self.table = np.zeros(len(self.spec.buffers), dtype=np.uint64)
        self._keep: dict[int, object] = {}            # arrays whose addresses are in the table
        self._arena = np.zeros(0, dtype=np.uint8)
        self._dim_values = {}                          # dim inputs (P) as i32 scalars in memory
        for i, buf in enumerate(self.spec.buffers):
            if buf.kind == "const":
                self._bind(i, buf.data)
            elif buf.kind == "dim":
                self._dim_values[buf.name] = np.zeros(1, dtype=np.int32)
                self._bind(i, self._dim_values[buf.name])
            elif buf.kind == "profile":
                self._cycles = np.zeros(len(self.spec.calls) + 1, dtype=np.int64)
                self._bind(i, self._cycles)
        if weights is not None:
            self.bind_weights(weights)

    # -- memory ----------------------------------------------------------------------
    def _bind(self, i: int, array) -> None:
        data = array.data if isinstance(array, Blocks) else array
        if not data.flags.c_contiguous:
            raise ValueError(f"buffer {self.spec.buffers[i].name}: the llvm backend needs contiguous arrays")
        self._keep[i] = array
        self.table[i] = data.ctypes.data

    def bind_weights(self, weights) -> None:
        """Point each weight at its tensor in a GGUFFile (in place) or at an array of a mapping."""
        for v, i in self.spec.param_index.items():
            self._bind(i, weight_value(v.aval, weights))
        self._weights = weights

    def _layout(self, dims: dict) -> None:
        """Place activation and scratch buffers in the arena for these dims (growing it)."""
        offsets, total = [], 0
        for i, buf in enumerate(self.spec.buffers):
            if buf.kind in ("act", "scratch"):
                offsets.append((i, total))
                total += -(-max(buf.size(dims), 1) // ALIGN) * ALIGN
        if total > self._arena.nbytes:
            self._arena = np.zeros(total + ALIGN, dtype=np.uint8)
        base = self._arena.ctypes.data
        base += -base % ALIGN
        for i, off in offsets:
            self.table[i] = base + off

    # -- calling -----------------------------------------------------------------------
    def run_inputs(self, inputs: list) -> list:
        """Run with the graph's non-weight inputs in order; returns the outputs as arrays."""
        g = self.graph
        if len(inputs) != len(g.invars):
            raise TypeError(f"{g.name or 'graph'} has {len(g.invars)} inputs, got {len(inputs)}")
        return self.run({v: as_value(v.aval, x) for v, x in zip(g.invars, inputs)})

    def __call__(self, *args):
        g = self.graph
        leaves, _ = tree_flatten(list(args))
        if len(leaves) != len(g.args):
            raise TypeError(f"{g.name or 'graph'} takes {len(g.args)} array arguments, got {len(leaves)}")
        values = {}
        for v, x in zip(g.args, leaves):
            if v in g.params:
                if x is not None:
                    self._bind(self.spec.param_index[v], as_value(v.aval, x))
            else:
                values[v] = as_value(v.aval, x)
        outs = self.run(values)
        return tree_unflatten(g.out_tree, outs) if g.out_tree is not None else outs

    def run(self, values: dict[Var, object]) -> list:
        g = self.graph
        for v in g.params:
            if self.table[self.spec.param_index[v]] == 0:
                raise KeyError(f"no value for weight {v.aval.source!r}")
        dims = bind_symbols(g, values)
        for v, i in self.spec.input_index.items():
            self._bind(i, values[v])
        self._layout(dims)
        for name, cell in self._dim_values.items():
            cell[0] = dims[name]
        T, P = int(dims.get("T", 1)), int(dims.get("P", 0))
        table, bar, n = self.table.ctypes.data, self.team.barrier_ptr, self.threads
        t0 = time.perf_counter()
        self.team.run(lambda ith: self.fn(table, T, P, ith, n, bar))
        if self.profile:
            wall = time.perf_counter() - t0
            ticks = np.diff(self._cycles)
            per_tick = wall / max(int(self._cycles[-1] - self._cycles[0]), 1)   # calibrate the counter
            self.last_profile = [(c, float(t) * per_tick) for c, t in zip(self.spec.calls, ticks)]
        return [self._output(o, v, dims) for o, v in zip(self.spec.outputs, g.outvars)]

    def _output(self, ref, var, dims):
        if isinstance(ref, Literal):
            return ref.value
        shape = var.aval.concrete(dims)
        buf = self.spec.buffers[ref.buf]
        if buf.kind == "input" and ref.offset == 0 and isinstance(self._keep[ref.buf], np.ndarray) \
                and self._keep[ref.buf].shape == shape:
            return self._keep[ref.buf]                      # an in-place update of an input
        nbytes = var.aval.nbytes(dims)
        off = int(self.table[ref.buf]) + (ref.offset if isinstance(ref.offset, int) else ref.offset.eval(dims))
        raw = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * nbytes).from_address(off))
        return raw.view(var.aval.dtype.np_dtype).reshape(shape).copy()
