"""The thread team's barrier and futex under stress, natively and (tests/test_arm.py) in the emulated
AArch64 guest: every thread writes its slots of a buffer with plain stores, waits at the barrier, and
checks every other thread's slots; steps alternate between two buffers. A barrier whose release/acquire
ordering were wrong (or that LLVM could move plain loads across) would let a thread read a slot before
its new value. Then the workers fall asleep on the futex (this architecture's system call number) and
the next step must wake them."""
import ctypes
import sys
import time

import numpy as np
import pytest
from llvmlite import ir

from ggraph.backends.llvm import jit
from ggraph.backends.llvm.target import host_target
from ggraph.backends.llvm.team import SLEEPERS, Team, emit_barrier, emit_team

SLOTS = 16                                       # i32 slots per thread, a cache line
_i32, _i64 = ir.IntType(32), ir.IntType(64)


def build(x86: bool):
    """``stress(bufs, steps, errors, _, ith, nth, barrier)`` in a team: for s in 0..steps-1, thread ith
    writes s*nth*SLOTS + j to its slots j of buffer s%2, waits at the barrier, then adds to errors[ith]
    the slots of that buffer (every thread's) that do not hold step s's values."""
    m = ir.Module()
    barrier = emit_barrier(m, x86)
    ptr = ir.PointerType()
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [ptr, _i64, _i64, _i64, _i32, _i32, ptr]), name="stress")
    fn.linkage = "internal"
    bufs, steps, errors_at, _, ith, nth, state = fn.args
    names = ("entry", "step", "write", "wait", "check", "next", "done")
    entry, step, write, wait, check, next_step, done = (fn.append_basic_block(n) for n in names)
    b = ir.IRBuilder(entry)
    errors = b.gep(b.inttoptr(errors_at, ptr), [b.sext(ith, _i64)], source_etype=_i32)
    total = b.mul(b.sext(nth, _i64), ir.Constant(_i64, SLOTS))
    first = b.mul(b.sext(ith, _i64), ir.Constant(_i64, SLOTS))
    b.cbranch(b.icmp_signed(">", steps, ir.Constant(_i64, 0)), step, done)

    b.position_at_end(step)
    s = b.phi(_i64)
    s.add_incoming(ir.Constant(_i64, 0), entry)
    buf = b.gep(bufs, [b.mul(b.and_(s, ir.Constant(_i64, 1)), total)], source_etype=_i32)
    base = b.mul(s, total)
    b.branch(write)

    b.position_at_end(write)                     # this thread's slots, plain stores
    j = b.phi(_i64)
    j.add_incoming(first, step)
    b.store(b.trunc(b.add(base, j), _i32), b.gep(buf, [j], source_etype=_i32))
    j1 = b.add(j, ir.Constant(_i64, 1))
    j.add_incoming(j1, write)
    b.cbranch(b.icmp_signed("==", j1, b.add(first, ir.Constant(_i64, SLOTS))), wait, write)

    b.position_at_end(wait)
    b.call(barrier, [state, nth])
    b.branch(check)

    b.position_at_end(check)                     # every thread's slots, plain loads
    k = b.phi(_i64)
    k.add_incoming(ir.Constant(_i64, 0), wait)
    got = b.load(b.gep(buf, [k], source_etype=_i32), typ=_i32)
    bad = b.zext(b.icmp_signed("!=", got, b.trunc(b.add(base, k), _i32)), _i32)
    b.store(b.add(b.load(errors, typ=_i32), bad), errors)
    k1 = b.add(k, ir.Constant(_i64, 1))
    k.add_incoming(k1, check)
    b.cbranch(b.icmp_signed("==", k1, total), next_step, check)

    b.position_at_end(next_step)
    s1 = b.add(s, ir.Constant(_i64, 1))
    s.add_incoming(s1, next_step)
    b.cbranch(b.icmp_signed("==", s1, steps), done, step)

    b.position_at_end(done)
    b.ret_void()
    t = host_target()
    emit_team(m, fn, t.triple)
    return jit.compile(m, t)


@pytest.fixture(scope="module")
def lib():
    return build(host_target().arch == "x86_64")


@pytest.mark.parametrize("nth", [2, 3, 4])
def test_every_thread_sees_every_other_threads_writes_after_the_barrier(lib, nth):
    steps = 300
    team = Team(lib, nth)
    try:
        for _ in range(3):
            bufs = np.full(2 * nth * SLOTS, -1, np.int32)
            errors = np.zeros(nth, np.int32)
            team.run(bufs.ctypes.data, steps, errors.ctypes.data)
            assert errors.tolist() == [0] * nth
            last = (steps - 1) * nth * SLOTS + np.arange(nth * SLOTS)
            assert np.array_equal(bufs[((steps - 1) % 2) * nth * SLOTS:][:nth * SLOTS], last)
    finally:
        team.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="idle workers sleep on a Linux futex")
def test_idle_workers_sleep_on_the_futex_and_a_step_wakes_them(lib):
    """With a wrong futex system call number a worker would not stay asleep (the call fails at once)."""
    nth = 3
    team = Team(lib, nth)
    try:
        errors = np.zeros(nth, np.int32)
        bufs = np.zeros(2 * nth * SLOTS, np.int32)
        team.run(bufs.ctypes.data, 10, errors.ctypes.data)
        words = team.ctl.view(np.int32)
        deadline = time.monotonic() + 60
        while words[SLEEPERS // 4] != nth - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert words[SLEEPERS // 4] == nth - 1
        time.sleep(0.2)
        assert words[SLEEPERS // 4] == nth - 1            # still asleep: the futex call is waiting
        team.run(bufs.ctypes.data, 100, errors.ctypes.data)
        assert errors.tolist() == [0] * nth
    finally:
        team.close()
