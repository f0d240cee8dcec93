"""The thread team: native threads that all walk one program, with a spin barrier between nodes.

The barrier is emitted into the program module as ``ggraph_barrier(ptr state, i32 nth)``:
every thread adds one to a counter; the last to arrive resets it and bumps a generation
word, and the others spin (with ``pause``) until the generation moves. This is ggml's
scheme. A waiter that has spun for a while yields its core (``sched_yield``) between
checks, so a machine with more runnable threads than cores degrades gently instead of
stalling at every barrier. Python only starts the team: each thread makes one ctypes call into the program,
and ctypes releases the GIL for its duration, so no Python runs per op.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np
from llvmlite import ir

from ggraph.progress import warn

BARRIER = "ggraph_barrier"
SPINS_BEFORE_YIELD = 1 << 12        # ~10-50 µs of pause loops before a waiter gives up its core
_i32 = ir.IntType(32)


def emit_barrier(module: ir.Module, x86: bool) -> ir.Function:
    """``void ggraph_barrier(ptr state, i32 nth)``; state is {i32 count, i32 generation}, zeroed."""
    if BARRIER in module.globals:
        return module.globals[BARRIER]
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ir.PointerType(), _i32]), name=BARRIER)
    fn.linkage = "internal"
    state, nth = fn.args
    blocks = {n: fn.append_basic_block(n) for n in ("entry", "arrive", "last", "spin", "wait", "yield", "done")}
    b = ir.IRBuilder(blocks["entry"])
    b.cbranch(b.icmp_signed("<=", nth, ir.Constant(_i32, 1)), blocks["done"], blocks["arrive"])

    b.position_at_end(blocks["arrive"])                       # count in; remember the generation
    count = state
    gen_ptr = b.gep(state, [ir.Constant(_i32, 1)], source_etype=_i32)
    gen = b.load_atomic(gen_ptr, "acquire", 4, typ=_i32)
    old = b.atomic_rmw("add", count, ir.Constant(_i32, 1), "acq_rel")
    b.cbranch(b.icmp_signed("==", old, b.sub(nth, ir.Constant(_i32, 1))), blocks["last"], blocks["spin"])

    b.position_at_end(blocks["last"])                         # the last one in releases everyone
    b.atomic_rmw("xchg", count, ir.Constant(_i32, 0), "release")    # (llvmlite's store_atomic needs typed pointers)
    b.atomic_rmw("add", gen_ptr, ir.Constant(_i32, 1), "release")
    b.branch(blocks["done"])

    b.position_at_end(blocks["spin"])                         # the others spin until the generation moves
    spins = b.phi(_i32)
    spins.add_incoming(ir.Constant(_i32, 0), blocks["arrive"])
    if x86:                                   # pause is SSE2: every x86-64 target has it
        pause = module.globals.get("llvm.x86.sse2.pause") or \
            ir.Function(module, ir.FunctionType(ir.VoidType(), []), name="llvm.x86.sse2.pause")
        b.call(pause, [])
    now = b.load_atomic(gen_ptr, "acquire", 4, typ=_i32)
    more = b.add(spins, ir.Constant(_i32, 1))
    b.cbranch(b.icmp_signed("!=", now, gen), blocks["done"], blocks["wait"])

    b.position_at_end(blocks["wait"])                         # every so often, give the core away
    due = b.icmp_signed("==", b.and_(more, ir.Constant(_i32, SPINS_BEFORE_YIELD - 1)), ir.Constant(_i32, 0))
    b.cbranch(due, blocks["yield"], blocks["spin"])
    spins.add_incoming(more, blocks["wait"])

    b.position_at_end(blocks["yield"])
    sched_yield = module.globals.get("sched_yield") or ir.Function(module, ir.FunctionType(_i32, []), name="sched_yield")
    b.call(sched_yield, [])
    b.branch(blocks["spin"])
    spins.add_incoming(more, blocks["yield"])

    b.position_at_end(blocks["done"])
    b.ret_void()
    return fn


MAX_THREADS_PER_CORE = 4


def check_threads(threads) -> int | None:
    """A thread count in 1..4 × the cores (None: all cores); more threads than cores gets a warning."""
    if threads is None:
        return None
    cores = os.cpu_count() or 1
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or \
            not 1 <= threads <= MAX_THREADS_PER_CORE * cores:
        raise ValueError(f"threads must be a whole number in 1..{MAX_THREADS_PER_CORE * cores} "
                         f"({MAX_THREADS_PER_CORE} × the {cores} cores), got {threads!r}")
    if threads > cores:
        warn(f"{threads} threads on {cores} cores: the spinning barriers will slow every step down")
    return int(threads)


class Team:
    """``n`` native threads (the caller is thread 0) that run one ctypes call each per job."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"a team needs at least one thread, got {n}")
        self.n = n
        self.barrier_state = np.zeros(16, dtype=np.int32)        # {count, generation}, own cache line
        self._job = None
        self._go = [threading.Semaphore(0) for _ in range(n)]
        self._done = threading.Semaphore(0)
        self._errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True, name=f"ggraph-{i}")
                         for i in range(1, n)]
        for t in self._threads:
            t.start()

    @property
    def barrier_ptr(self) -> int:
        return self.barrier_state.ctypes.data

    def _worker(self, ith: int) -> None:
        while True:
            self._go[ith].acquire()
            job = self._job
            if job is None:
                return
            try:
                job(ith)
            except BaseException as e:          # reported by run(); a native fault cannot be caught
                self._errors.append(e)
            self._done.release()

    def run(self, job) -> None:
        """Call ``job(ith)`` on every thread at once and wait for all of them."""
        self._job = job
        self.barrier_state[:] = 0
        for i in range(1, self.n):
            self._go[i].release()
        try:
            job(0)
        finally:
            for _ in range(1, self.n):
                self._done.acquire()
        if self._errors:
            err, self._errors = self._errors[0], []
            raise err

    def best_time(self, job, tries: int = 5) -> float:
        """Seconds of the fastest of ``tries`` runs of ``job`` (for benchmarks)."""
        best = float("inf")
        for _ in range(tries):
            t0 = time.perf_counter()
            self.run(job)
            best = min(best, time.perf_counter() - t0)
        return best

    def close(self) -> None:
        self._job = None
        for i in range(1, self.n):
            self._go[i].release()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


PROGRAM_ARGS = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p)
