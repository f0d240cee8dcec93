"""This machine's limits, measured now: the core clock, the f32 and int8 peaks of a feature set and the
read bandwidth of each cache level and of DRAM, from native loops that do nothing else.

- clock: a chain of dependent integer adds and xors (one cycle each on every x86 and Arm core),
  so cycles per second while turbo and throttling are what they are in this run.
- f32: independent FMA chains of the target's vector width (2 flops a lane each).
- int8: independent u8 x s8 dot chains, the instruction the quantised matmuls use on the
  target (vpdpbusd, pmaddubsw + pmaddwd, sdot): 2 ops per byte lane.
- read: sums of a buffer read over and over, one per cache level and one far larger than the
  caches (DRAM), each thread its own buffer, so the roofline bounds an op whose data sits in a
  cache by that cache's bandwidth, not DRAM's (``read_levels``).
- tiles (AMX sets only): four independent tdpbssd tile multiplies, 16 x 16 x 64 multiply-adds
  each, as the tiled quantised GEMM issues them, of operand tiles holding random bytes: the tile
  unit is quicker on zeros, so a peak measured on zeros reads too high (docs/kernels.md).

Enough independent chains cover every latency, so each figure is the throughput of the
instruction on all the threads at once.
"""
from __future__ import annotations

import ctypes
import time

from llvmlite import ir

CHAINS = 16                      # independent accumulators: more than latency x issue width anywhere
UNROLL = 64                      # dependent add/xor pairs per loop pass of the clock loop
_ABI = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]


def _lanes(target) -> int:
    from ggraph.backends.llvm.kernels.isa import vector_path
    return max(1, (target.vector_bits // 8 if vector_path(target) else 4) // 4)


def module(target) -> ir.Module:
    """The loops for ``target``: ``peak_f32``, ``peak_int8``, ``peak_clock(buf, n)``, and ``peak_tiles``
    on sets with AMX (its buf: 1 KB of operand bytes, then 1 KB for the result)."""
    from ggraph.backends.llvm.kernels.builder import Kernel, f32, i8, i32, vec
    from ggraph.backends.llvm.kernels.isa import Isa

    m = ir.Module()
    lanes = _lanes(target)

    def chains(name: str, typ, step):
        """n iterations of CHAINS independent ``acc = step(acc, a, b)``; the sums are stored so the
        loop stays, and the operands come from memory, so nothing folds."""
        k = Kernel(m, name, ("buf",), sizes=("n",))
        isa = Isa(k, target)
        a, b = (k.load(typ["in"], k.arg["buf"], off) for off in (0, 64))
        accs = [k.var(typ["acc"], k.load(typ["acc"], k.arg["buf"], 128)) for _ in range(CHAINS)]
        with k.loop(0, k.arg["n"], name="it"):
            for acc in accs:
                acc.set(step(isa, acc.get(), a, b))
        total = accs[0].get()
        for acc in accs[1:]:
            total = (k.b.fadd if typ["acc"].element == f32 else k.b.add)(total, acc.get())
        k.store(total, k.arg["buf"], 192)
        k.finish()

    chains("peak_f32", {"in": vec(f32, lanes), "acc": vec(f32, lanes)}, lambda isa, acc, a, b: isa.fma(a, b, acc))
    # the accumulator's own bytes are the u8 operand: without that, LLVM would hoist the multiplies of a
    # two-instruction dot (pmaddubsw, pmaddwd) out of the loop and leave only the adds
    chains("peak_int8", {"in": vec(i8, 4 * lanes), "acc": vec(i32, lanes)},
           lambda isa, acc, a, b: isa.dot(acc, isa.k.cast_vec(acc, i8), b, False, 127))

    if target.has("amx-int8"):
        from ggraph.backends.llvm.kernels import amx
        k = Kernel(m, "peak_tiles", ("buf",), sizes=("n",))
        amx.tile_op(k, "ldtilecfg", amx.config(k))
        for t in range(4):
            amx.tile_op(k, "tilezero", t)
        for t in range(4, 8):                                             # the operands: buf's random bytes
            amx.tile_op(k, "tileloadd64", t, k.arg["buf"], k.i64(64))
        with k.loop(0, k.arg["n"], name="it"):
            for c, (a, b) in enumerate(((4, 6), (4, 7), (5, 6), (5, 7))):
                amx.tile_op(k, "tdpbssd", c, a, b)
        amx.tile_op(k, "tilestored64", 0, k.addr(k.arg["buf"], 1024), k.i64(64))   # the loop's result stays
        amx.tile_op(k, "tilerelease")
        k.finish()

    # n passes over `blocks` KiB: CHAINS vector accumulators, one 64-byte load each per 1 KiB block
    k = Kernel(m, "peak_read", ("buf",), sizes=("n", "blocks"))
    accs = [k.var(vec(f32, 16), k.load(vec(f32, 16), k.arg["buf"], 0)) for _ in range(CHAINS)]
    with k.loop(0, k.arg["n"], name="it"):
        with k.loop(0, k.arg["blocks"], name="blk") as blk:
            at = k.mul(blk, 64 * CHAINS)
            for c, acc in enumerate(accs):
                acc.set(k.b.fadd(acc.get(), k.load(vec(f32, 16), k.addr(k.arg["buf"], k.add(at, 64 * c)))))
    total = accs[0].get()
    for acc in accs[1:]:
        total = k.b.fadd(total, acc.get())
    k.store(total, k.arg["buf"], 0)
    k.finish()

    k = Kernel(m, "peak_clock", ("buf",), sizes=("n",))
    c, d = k.load(i32, k.arg["buf"], 0), k.load(i32, k.arg["buf"], 4)
    x = k.var(i32, k.load(i32, k.arg["buf"], 8))
    with k.loop(0, k.arg["n"], name="it"):
        v = x.get()
        for _ in range(UNROLL):
            v = k.b.xor(k.b.add(v, c), d)
        x.set(v)
    k.store(x.get(), k.arg["buf"], 12)
    k.finish()
    return m


REPEATS = 50                     # timed passes of each loop; the fastest counts


def fastest(run, seconds: float, repeats: int = REPEATS, n: int = 1, grow: bool = True) -> tuple[int, float]:
    """(n, the least seconds of ``repeats`` calls of ``run(n)``), n first grown until one call takes
    ``seconds``: on a shared machine a neighbour preempts many short passes, and the fastest one is
    the machine's own speed (a peak measured slower than that would let ops pass 100% of it)."""
    def timed():
        start = time.perf_counter()
        run(n)
        return time.perf_counter() - start
    while grow and (t := timed()) < seconds:
        n *= max(2, int(seconds / max(t, 1e-6)))
    return n, min(timed() for _ in range(repeats))


def measure(target, threads: int = 1, seconds: float = 0.001) -> dict:
    """{"ghz": the core clock, "f32": GFLOP/s, "int8": Gop/s, and "tiles": Gop/s on AMX sets} of
    ``threads`` cores running ``target``'s loops at once (the clock from one core); a multiply-add
    counts 2."""
    import numpy as np
    from ggraph.backends.llvm.team import CallTeam

    from ggraph.backends.llvm import jit
    lib = jit.compile(module(target), target)
    tiles = target.has("amx-int8")
    names = ("peak_f32", "peak_int8", "peak_clock") + (("peak_tiles",) if tiles else ())
    fns = {name: lib.function(name, None, _ABI) for name in names}
    lanes = _lanes(target)
    ops = {"peak_f32": CHAINS * lanes * 2, "peak_int8": CHAINS * 4 * lanes * 2, "peak_clock": 2 * UNROLL,
           "peak_tiles": 4 * 16 * 16 * 64 * 2}
    bufs = [np.zeros(1024, np.uint8) for _ in range(threads)]
    for b in bufs:
        b[:8] = 1
    rng = np.random.default_rng(0)
    tile_bufs = [rng.integers(0, 256, 2048, dtype=np.uint8) for _ in range(threads)]   # operands, then result
    out = {}
    team = CallTeam(threads)
    try:
        for name, fn in fns.items():
            nth = 1 if name == "peak_clock" else threads
            args = tile_bufs if name == "peak_tiles" else bufs
            if nth == 1:                                   # called directly: no hand-off to time
                n, best = fastest(lambda n: fn(args[0].ctypes.data, n, 0, 1), seconds, n=1000)
            else:
                n, best = fastest(lambda n: team.run(lambda ith: fn(args[ith].ctypes.data, n, ith, nth)
                                                     if ith < nth else None), seconds, n=1000)
            out[name] = n * ops[name] * nth / best / 1e9
    finally:
        team.close()
        del lib
    peaks = {"ghz": out["peak_clock"], "f32": out["peak_f32"], "int8": out["peak_int8"]}
    if tiles:
        peaks["tiles"] = out["peak_tiles"]
    return peaks


FALLBACK_CACHES = {"L1": (32 << 10, True), "L2": (1 << 20, True), "L3": (32 << 20, False)}
DRAM_READ = 512 << 20            # bytes read per pass for DRAM, across the threads: far beyond any L3
DRAM_PIECE, DRAM_SWEEPS = 8 << 20, 4  # one thread's DRAM read: pieces timed one by one, sweeps over them


def cache_sizes() -> dict[str, tuple[int, bool]]:
    """{"L1": (bytes, private to a core), "L2": ..., "L3": ...}: the data caches Linux lists for cpu0,
    else typical sizes."""
    from pathlib import Path
    found = {}
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            size = (d / "size").read_text().strip()
            nbytes = int(size[:-1]) << {"K": 10, "M": 20, "G": 30}[size[-1]] if size[-1] in "KMG" else int(size)
            sharing = (d / "shared_cpu_list").read_text().strip()
            cpus = sum(int(b) - int(a) + 1 for a, _, b in (r.partition("-") if "-" in r else (r, "", r)
                                                            for r in sharing.split(",")))
            threads_per_core = len((Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
                                     .read_text().strip()).split(","))
            found[f"L{(d / 'level').read_text().strip()}"] = (nbytes, cpus <= threads_per_core)
        except (OSError, ValueError, KeyError):
            continue
    return found or dict(FALLBACK_CACHES)


def read_levels(target, threads: int = 1, seconds: float = 0.001) -> list[tuple[str, float, float]]:
    """[(level, bytes an op's data may take and still sit there, GB/s read), ...] from L1 to DRAM
    (whose bytes are inf), on ``threads`` cores at once: each thread reads a buffer of half its share
    of the level (the caches a core has alone count once per thread), as many times as fill ``seconds``.
    On one thread DRAM's is the fastest of many 8 MiB pieces of a sweep through four L3s' worth, so
    a neighbour that preempts some pieces does not slow the figure. Every buffer is written first: pages
    never written all map to one page of zeros, which any cache holds."""
    import numpy as np
    from ggraph.backends.llvm import jit
    from ggraph.backends.llvm.team import CallTeam
    lib = jit.compile(module(target), target)
    fn = lib.function("peak_read", None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32,
                                          ctypes.c_int32])
    sizes = cache_sizes()
    levels = [(name, size * threads if private else size, size // 2 if private else size // 2 // threads)
              for name, (size, private) in sorted(sizes.items())]
    out = []
    team = CallTeam(threads)
    try:
        for name, holds, per_thread in levels:
            blocks = max(1, per_thread // (64 * CHAINS))
            bufs = [np.full(blocks * 64 * CHAINS, 0x3f, np.uint8) for _ in range(threads)]
            if threads == 1:
                n, best = fastest(lambda n: fn(bufs[0].ctypes.data, n, blocks, 0, 1), seconds)
            else:
                n, best = fastest(lambda n: team.run(lambda ith: fn(bufs[ith].ctypes.data, n, blocks, ith, threads)),
                                  seconds)
            out.append((name, holds, n * blocks * 64 * CHAINS * threads / best / 1e9))
            del bufs
        if threads == 1:
            piece = DRAM_PIECE // (64 * CHAINS)
            big = np.full(4 * max(size for size, _ in sizes.values()), 0x3f, np.uint8)
            starts = range(0, big.nbytes - DRAM_PIECE + 1, DRAM_PIECE)
            best = float("inf")
            for _ in range(DRAM_SWEEPS):
                for at in starts:
                    t = time.perf_counter()
                    fn(big.ctypes.data + at, 1, piece, 0, 1)
                    best = min(best, time.perf_counter() - t)
            gb_s = DRAM_PIECE / best / 1e9
            del big
        else:
            blocks = DRAM_READ // threads // (64 * CHAINS)
            bufs = [np.full(blocks * 64 * CHAINS, 0x3f, np.uint8) for _ in range(threads)]
            _, best = fastest(lambda n: team.run(lambda ith: fn(bufs[ith].ctypes.data, 1, blocks, ith, threads)),
                              seconds, repeats=5, grow=False)
            gb_s = blocks * 64 * CHAINS * threads / best / 1e9
            del bufs
        out.append(("DRAM", float("inf"), gb_s))
    finally:
        team.close()
        del lib
    return out
