"""The thread team: native threads that all walk one program, with a spin barrier between nodes.

The barrier is emitted into the program module as ``ggraph_barrier(ptr state, i32 nth)``:
every thread adds one to a counter; the last to arrive resets it and bumps a generation
word, and the others spin (with ``pause``) until the generation moves. This is ggml's
scheme. A waiter that has spun for a while yields its core (``sched_yield``) between
checks, so a machine with more runnable threads than cores degrades gently instead of
stalling at every barrier.

The hand-off of a step is native too (``emit_team``). Each worker thread makes one ctypes call,
``ggraph_serve(ctl, ith)``, that returns only when the team closes: it waits for the control
block's sequence word to move, runs its share of the program, counts itself done, and waits
again. Thread 0 calls ``ggraph_run(ctl)`` once per step: it bumps the sequence word, runs its
own share and spins until the others are done. No Python and no system call is on that path;
a worker that has waited a few milliseconds (the user is typing) sleeps on a futex instead of
spinning, and ``ggraph_run`` wakes it only when one sleeps. ctypes releases the GIL for the
duration of each call.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
import weakref

import numpy as np
from llvmlite import ir

from ggraph.progress import warn

BARRIER, SERVE, RUN = "ggraph_barrier", "ggraph_serve", "ggraph_run"
SPINS_BEFORE_YIELD = 1 << 12        # ~10-50 µs of pause loops before a waiter gives up its core
SPINS_BEFORE_SLEEP = 1 << 16        # ~0.3-3 ms before an idle worker sleeps on the futex
_i32, _i64 = ir.IntType(32), ir.IntType(64)

# The control block: one cache line for the words thread 0 writes to post a step, one for the
# count of threads done, one for the step's arguments, one for the barrier between calls.
SEQ, SLEEPERS, DONE = 0, 4, 64                              # i32 each
TABLE, T_ARG, P_ARG, R_ARG, NTH, QUIT = 128, 136, 144, 152, 160, 164    # ptr, i64, i64, i64, i32, i32
BARRIER_STATE = 192                                         # {i32 count, i32 generation}
CTL_BYTES = 256
FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 128, 129
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}                  # Linux system call numbers


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
        b.call(_pause(module), [])
    now = b.load_atomic(gen_ptr, "acquire", 4, typ=_i32)
    more = b.add(spins, ir.Constant(_i32, 1))
    b.cbranch(b.icmp_signed("!=", now, gen), blocks["done"], blocks["wait"])

    b.position_at_end(blocks["wait"])                         # every so often, give the core away
    due = b.icmp_signed("==", b.and_(more, ir.Constant(_i32, SPINS_BEFORE_YIELD - 1)), ir.Constant(_i32, 0))
    b.cbranch(due, blocks["yield"], blocks["spin"])
    spins.add_incoming(more, blocks["wait"])

    b.position_at_end(blocks["yield"])
    b.call(_sched_yield(module), [])
    b.branch(blocks["spin"])
    spins.add_incoming(more, blocks["yield"])

    b.position_at_end(blocks["done"])
    b.ret_void()
    return fn


def _declared(module: ir.Module, name: str, fnty: ir.FunctionType) -> ir.Function:
    return module.globals.get(name) or ir.Function(module, fnty, name=name)


def _pause(module: ir.Module) -> ir.Function:
    return _declared(module, "llvm.x86.sse2.pause", ir.FunctionType(ir.VoidType(), []))


def _sched_yield(module: ir.Module) -> ir.Function:
    return _declared(module, "sched_yield", ir.FunctionType(_i32, []))


def emit_team(module: ir.Module, program: ir.Function, triple: str) -> None:
    """``void ggraph_serve(ptr ctl, i32 ith)``, a worker's whole life, and ``void ggraph_run(ptr ctl)``,
    one step on thread 0, around ``program(table, T, P, R, ith, nth, barrier)``; ``ctl`` is the
    control block laid out above, zeroed at the start."""
    arch = triple.split("-")[0]
    futex = SYS_FUTEX.get(arch) if "linux" in triple else None
    syscall = _declared(module, "syscall", ir.FunctionType(_i64, [_i64], var_arg=True)) if futex else None
    void = ir.VoidType()

    def word(b, ctl, offset):
        return b.gep(ctl, [ir.Constant(_i64, offset)], source_etype=ir.IntType(8))

    def relax(b):                             # one turn of a spin loop
        if arch == "x86_64":
            b.call(_pause(module), [])

    def spin_turn(b, spins, rest, wait):
        """One turn of a spin loop: pause, count it, and every SPINS_BEFORE_YIELD turns go to ``rest``."""
        relax(b)
        n = b.add(b.load(spins), ir.Constant(_i32, 1))
        b.store(n, spins)
        due = b.icmp_signed("==", b.and_(n, ir.Constant(_i32, SPINS_BEFORE_YIELD - 1)), ir.Constant(_i32, 0))
        b.cbranch(due, rest, wait)

    def call_program(b, ctl, ith):
        args = [b.load(word(b, ctl, TABLE), typ=ir.PointerType()), b.load(word(b, ctl, T_ARG), typ=_i64),
                b.load(word(b, ctl, P_ARG), typ=_i64), b.load(word(b, ctl, R_ARG), typ=_i64), ith,
                b.load(word(b, ctl, NTH), typ=_i32), word(b, ctl, BARRIER_STATE)]
        b.call(program, args)

    # ggraph_serve: wait for the sequence word to move, run, count done, wait again
    serve = ir.Function(module, ir.FunctionType(void, [ir.PointerType(), _i32]), name=SERVE)
    ctl, ith = serve.args
    entry, wait, turn, rest, sleep, woken, go, work = (serve.append_basic_block(n) for n in
                                                        ("entry", "wait", "turn", "rest", "sleep", "woken", "go", "work"))
    b = ir.IRBuilder(entry)
    last, spins = b.alloca(_i32), b.alloca(_i32)
    b.store(ir.Constant(_i32, 0), last)
    b.store(ir.Constant(_i32, 0), spins)
    seq = word(b, ctl, SEQ)
    b.branch(wait)

    b.position_at_end(wait)
    now = b.load_atomic(seq, "acquire", 4, typ=_i32)
    b.cbranch(b.icmp_signed("!=", now, b.load(last)), go, turn)

    b.position_at_end(turn)
    spin_turn(b, spins, rest, wait)

    b.position_at_end(rest)                   # now and then: give the core away, or sleep when idle long
    b.call(_sched_yield(module), [])
    long_idle = b.icmp_signed(">=", b.load(spins), ir.Constant(_i32, SPINS_BEFORE_SLEEP))
    b.cbranch(long_idle, sleep, wait) if futex else b.branch(wait)

    b.position_at_end(sleep)                  # say so, check once more, then sleep while seq == last
    sleepers = word(b, ctl, SLEEPERS)
    b.atomic_rmw("add", sleepers, ir.Constant(_i32, 1), "seq_cst")
    again = b.load_atomic(seq, "seq_cst", 4, typ=_i32)
    with b.if_then(b.icmp_signed("==", again, b.load(last))):
        b.call(syscall, [ir.Constant(_i64, futex), b.ptrtoint(seq, _i64), ir.Constant(_i64, FUTEX_WAIT_PRIVATE),
                         b.sext(b.load(last), _i64), ir.Constant(_i64, 0)])
    b.branch(woken)
    b.position_at_end(woken)
    b.atomic_rmw("sub", sleepers, ir.Constant(_i32, 1), "seq_cst")
    b.store(ir.Constant(_i32, 0), spins)
    b.branch(wait)

    b.position_at_end(go)
    b.store(now, last)
    b.store(ir.Constant(_i32, 0), spins)
    quit_ = b.load(word(b, ctl, QUIT), typ=_i32)
    done_block = serve.append_basic_block("exit")
    b.cbranch(b.icmp_signed("!=", quit_, ir.Constant(_i32, 0)), done_block, work)
    b.position_at_end(work)
    call_program(b, ctl, ith)
    b.atomic_rmw("add", word(b, ctl, DONE), ir.Constant(_i32, 1), "release")
    b.branch(wait)
    b.position_at_end(done_block)
    b.ret_void()

    # ggraph_run: post the step, wake sleepers if any, run thread 0's share, wait for the others
    run = ir.Function(module, ir.FunctionType(void, [ir.PointerType()]), name=RUN)
    ctl, = run.args
    entry, share, wait, turn, rest, done_block = (run.append_basic_block(n) for n in
                                                  ("entry", "share", "wait", "turn", "rest", "done"))
    b = ir.IRBuilder(entry)
    spins = b.alloca(_i32)
    b.store(ir.Constant(_i32, 0), spins)
    done = word(b, ctl, DONE)
    b.atomic_rmw("xchg", done, ir.Constant(_i32, 0), "seq_cst")
    seq = word(b, ctl, SEQ)
    b.atomic_rmw("add", seq, ir.Constant(_i32, 1), "seq_cst")
    if futex:
        asleep = b.load_atomic(word(b, ctl, SLEEPERS), "seq_cst", 4, typ=_i32)
        with b.if_then(b.icmp_signed(">", asleep, ir.Constant(_i32, 0))):
            b.call(syscall, [ir.Constant(_i64, futex), b.ptrtoint(seq, _i64), ir.Constant(_i64, FUTEX_WAKE_PRIVATE),
                             ir.Constant(_i64, 1 << 30)])
    quit_ = b.load(word(b, ctl, QUIT), typ=_i32)
    b.cbranch(b.icmp_signed("!=", quit_, ir.Constant(_i32, 0)), done_block, share)
    b.position_at_end(share)
    call_program(b, ctl, ir.Constant(_i32, 0))
    others = b.sub(b.load(word(b, ctl, NTH), typ=_i32), ir.Constant(_i32, 1))
    b.branch(wait)
    b.position_at_end(wait)
    finished = b.load_atomic(done, "acquire", 4, typ=_i32)
    b.cbranch(b.icmp_signed("==", finished, others), done_block, turn)
    b.position_at_end(turn)
    spin_turn(b, spins, rest, wait)
    b.position_at_end(rest)
    b.call(_sched_yield(module), [])
    b.branch(wait)
    b.position_at_end(done_block)
    b.ret_void()


MAX_THREADS_PER_CORE = 4


def check_threads(threads, oversubscribed: str = "the spinning barriers will slow every step down") -> int | None:
    """A thread count in 1..4 × the cores (None: all cores); more threads than cores gets a warning
    that says what it costs (``oversubscribed``)."""
    if threads is None:
        return None
    cores = os.cpu_count() or 1
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or \
            not 1 <= threads <= MAX_THREADS_PER_CORE * cores:
        raise ValueError(f"threads must be a whole number in 1..{MAX_THREADS_PER_CORE * cores} "
                         f"({MAX_THREADS_PER_CORE} × the {cores} cores), got {threads!r}")
    if threads > cores:
        warn(f"{threads} threads on {cores} cores: {oversubscribed}")
    return int(threads)


class Team:
    """``n`` threads that run one compiled program's steps: the caller is thread 0, and each of the
    others spends its life in one native call (``ggraph_serve``); ``lib`` holds the program and
    the functions ``emit_team`` added to it."""

    def __init__(self, lib, n: int):
        if n < 1:
            raise ValueError(f"a team needs at least one thread, got {n}")
        self.n = n
        self._raw = np.zeros(CTL_BYTES + 64, dtype=np.uint8)
        start = -self._raw.ctypes.data % 64
        self.ctl = self._raw[start:start + CTL_BYTES]           # cache-line aligned control block
        self._words, self._longs = self.ctl.view(np.int32), self.ctl.view(np.int64)
        self._words[NTH // 4] = n
        self._run = lib.function(RUN, None, (ctypes.c_void_p,))
        serve = lib.function(SERVE, None, (ctypes.c_void_p, ctypes.c_int32))
        at = self.ctl.ctypes.data
        self._threads = [threading.Thread(target=serve, args=(at, i), daemon=True, name=f"ggraph-{i}")
                         for i in range(1, n)]
        for t in self._threads:
            t.start()
        _TEAMS.add(self)

    def run(self, table: int, T: int, P: int, R: int = 0) -> None:
        """One step of the program on every thread; returns when all of them have finished it."""
        if self._words[QUIT // 4]:
            raise RuntimeError("this thread team is closed")
        longs = self._longs
        longs[TABLE // 8], longs[T_ARG // 8], longs[P_ARG // 8], longs[R_ARG // 8] = table, T, P, R
        self._run(self.ctl.ctypes.data)

    def close(self) -> None:
        """Let the workers return (they must, before the program's code or this block goes away)."""
        if self._words[QUIT // 4]:
            return
        self._words[QUIT // 4] = 1
        self._run(self.ctl.ctypes.data)
        for t in self._threads:
            t.join()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_TEAMS: "weakref.WeakSet[Team]" = weakref.WeakSet()
atexit.register(lambda: [team.close() for team in list(_TEAMS)])   # before the interpreter frees memory


class CallTeam:
    """``n`` threads (the caller is thread 0) that each make one Python call per job: for benchmarks
    that time single kernels through ctypes, many reps per job."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"a team needs at least one thread, got {n}")
        self.n = n
        self._job = None
        self._go = [threading.Semaphore(0) for _ in range(n)]
        self._done = threading.Semaphore(0)
        self._errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._worker, args=(i,), daemon=True, name=f"ggraph-call-{i}")
                         for i in range(1, n)]
        for t in self._threads:
            t.start()

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

