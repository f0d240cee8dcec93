"""The native thread team: steps handed to workers without Python, idle workers asleep on a
futex and woken by the next step, and a clean close."""
import ctypes
import sys
import time

import numpy as np
import pytest
from llvmlite import ir

import zoo
from ggraph.backends.llvm import jit
from ggraph.backends.llvm.kernels.builder import Kernel, i32
from ggraph.backends.llvm.target import host_target
from ggraph.backends.llvm.team import QUIT, SLEEPERS
from ggraph.runtime.session import Session

IDS = [1, 7, 42, 3, 99, 5]


def decode(threads: int, **kw) -> np.ndarray:
    s = Session(zoo.cached_model("llama", "f32"), backend="llvm", threads=threads, ctx=32, **kw)
    out = [s.step(IDS[:3])]
    out += [s.step([t]) for t in IDS[3:]]
    return np.concatenate(out)


def test_every_thread_count_computes_the_same_logits():
    """Rows go to threads in turn (equal bits); decode attention splits its keys among the threads
    and merges their partial softmaxes (equal up to f32 rounding)."""
    one = decode(1)
    for n in (2, 3):                                          # 3: more threads than this VM has cores
        np.testing.assert_allclose(decode(n), one, rtol=0, atol=1e-5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="idle workers sleep on a Linux futex")
def test_idle_workers_sleep_and_the_next_step_wakes_them():
    s = Session(zoo.cached_model("llama", "f32"), backend="llvm", threads=2, ctx=32)
    first = s.step(IDS[:3])
    team = s.program(True).team
    words = team.ctl.view(np.int32)
    deadline = time.monotonic() + 10
    while words[SLEEPERS // 4] != 1 and time.monotonic() < deadline:   # spins for ~0.3-3 ms, then sleeps
        time.sleep(0.01)
    assert words[SLEEPERS // 4] == 1
    s.truncate(0)
    assert np.array_equal(s.step(IDS[:3]), first)                     # the step woke it: same answer
    assert words[SLEEPERS // 4] in (0, 1)


def test_a_closed_team_lets_its_workers_go_and_refuses_steps():
    s = Session(zoo.cached_model("llama", "f32"), backend="llvm", threads=2, ctx=32)
    s.step(IDS[:2])
    team = s.program(True).team
    team.close()
    assert team.ctl.view(np.int32)[QUIT // 4] == 1
    assert not any(t.is_alive() for t in team._threads)
    with pytest.raises(RuntimeError, match="closed"):
        s.step([5])
    team.close()                                                        # twice is fine


@pytest.mark.parametrize("lead", [0.0, 0.75])
def test_row_chunks_give_every_row_to_one_chunk(lead):
    """Each thread's first chunk (one long run with ``lead``), then the counter's: every row of every
    matrix size once, for any thread count (threads run one after another here; the counter is what
    keeps two from taking a chunk, whatever the timing)."""
    P = ctypes.c_void_p
    for n in (16, 48, 100, 512, 2064, 8192):
        m = ir.Module()
        k = Kernel(m, f"visit_{n}", ("y", "counter"))
        with k.row_chunks(n, k.arg["counter"], per_thread=16, quantum=16, lead=lead) as (start, end):
            with k.loop(start, end) as r:
                k.store(k.b.add(k.load(i32, k.arg["y"], k.mul(r, 4)), ir.Constant(i32, 1)), k.arg["y"], k.mul(r, 4))
        name = k.finish()
        lib = jit.compile(m, host_target())
        visit = lib.function(name, None, [P, P, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32])
        for nth in (1, 2, 3, 5):
            y, counter = np.zeros(n, np.int32), np.zeros(16, np.int32)
            for ith in range(nth):
                visit(y.ctypes.data, counter.ctypes.data, 1, ith, nth)
            assert (y == 1).all(), (n, nth, lead, np.flatnonzero(y != 1)[:8], y[y != 1][:8])
