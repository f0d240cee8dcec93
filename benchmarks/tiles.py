"""What this machine's AMX tile unit does with the instruction patterns of the tiled gemm
(backends/llvm/kernels/qmatmul/tiles.py), in cycles of the core clock measured in the same run:

- a tdpbssd of zero tiles and of random bytes (the tile unit is quicker on zeros);
- 24 zmm FMAs alone, and a tdpbssd with 12 or 24 of them issued beside it (how much vector work,
  such as a tile gemm's float steps, the tile multiplies hide);
- a tileloadd of 16 rows that start 64-byte lines, and of rows that do not;
- 16 tile multiplies as the tiled gemm issues them (2 token tiles x 2 weight planes a unit, its four
  result tiles zeroed and stored each unit); the same with the memory traffic of the float steps
  beside them (each token's two stored result rows loaded, its accumulator loaded and stored),
  the accumulators in L1 or spread over 32 KB as the tiled gemm's are; against two sets of two result
  tiles used in turn (1 token tile a unit; a set is stored, and zeroed, after the next unit's
  first k-step, so the tile unit never waits for it); all over a 1B-shaped panel's addresses
  with random bytes.

    python benchmarks/tiles.py [--rounds 5]

Needs the amx feature set (a CPU with AMX and Linux's grant of tile data). On a shared host the
tile unit may be shared with another tenant's thread; compare lines of one run, not runs.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from llvmlite import ir

from ggraph.backends.llvm import jit
from ggraph.backends.llvm.kernels import amx
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i32, vec
from ggraph.backends.llvm.kernels.isa import Isa
from ggraph.backends.llvm.target import host_target
from ggraph.bench import peaks

STRIDE, ROOM = 2496, 8576      # a token's q8_k row at K = 2048; a q4_k panel block (qmatmul.panel.TilePanel.room)
B_AT, C_AT = 2 << 20, 3 << 20  # where the weight panel and the stored result tiles lie in the buffer
FMA_AT = 3 << 20 | 1 << 19     # the FMAs' operands (small floats)
ACC_AT = FMA_AT + 4096          # the float steps' accumulators (32 KB of small floats)
PAIRS, BLOCKS, TILES = 4, 8, 4  # a chunk of pairs of token tiles, a K panel, a group of tiles of rows


def _load(k, tile, at, stride):
    amx.tile_op(k, "tileloadd64", tile, k.addr(k.arg["buf"], at), k.i64(stride))


def _kernel(m, name, body):
    """``name(buf, n)``: n passes of ``body(k)`` between one tile configuration and its release."""
    k = Kernel(m, name, ("buf",), sizes=("n",))
    amx.tile_op(k, "ldtilecfg", amx.config(k))
    for t in range(8):
        amx.tile_op(k, "tilezero", t)
    with k.loop(0, k.arg["n"], name="rep"):
        body(k)
    amx.tile_op(k, "tilerelease")
    k.finish()


def _with_fmas(per_tdp: int, tiles: bool = True, operands: int = 0):
    """Four chains of tile multiplies, 64 each a pass, of operand tiles loaded once from ``operands``
    in buf (or, without ``tiles``, none), with ``per_tdp`` zmm FMAs (12 independent chains) issued
    beside each tdpbssd: how much vector work the tile multiplies hide."""
    def build(m, name):
        k = Kernel(m, name, ("buf",), sizes=("n",))
        isa, typ = Isa(k, host_target()), vec(f32, 16)
        amx.tile_op(k, "ldtilecfg", amx.config(k))
        for t in range(4):
            amx.tile_op(k, "tilezero", t)
        for t in range(4, 8):
            _load(k, t, operands, 64)
        a, b = k.load(typ, k.arg["buf"], FMA_AT), k.load(typ, k.arg["buf"], FMA_AT + 64)
        accs = [k.var(typ, k.load(typ, k.arg["buf"], FMA_AT + 64 * (2 + c))) for c in range(12)]
        with k.loop(0, k.arg["n"], name="rep"), k.loop(0, 64, name="it"):
            for c, (x, y) in enumerate(((4, 6), (4, 7), (5, 6), (5, 7))):
                if tiles:
                    amx.tile_op(k, "tdpbssd", c, x, y)
                for f in range(per_tdp):
                    acc = accs[(c * per_tdp + f) % 12]
                    acc.set(isa.fma(acc.get(), a, b))
        total = accs[0].get()
        for acc in accs[1:]:
            total = k.b.fadd(total, acc.get())
        k.store(total, k.arg["buf"], FMA_AT + 64 * 14)
        amx.tile_op(k, "tilerelease")
        k.finish()
    return build


def _loads(offset):
    return lambda k: [_load(k, t, offset + 1024 * (t - 4), 64) for t in (4, 5, 6, 7)]


def _unit_now(k, i, j, r, acc_span=None):
    """The tiled gemm's unit: block i, pair j, tile of rows r; four result tiles zeroed, then stored. With
    ``acc_span``, the memory traffic of its float steps beside its tile multiplies, two tokens a
    tdpbssd: each token's lo and hi rows of the last unit's stored tiles loaded, and its
    accumulator loaded and stored (pair j of tile r at (r * PAIRS + j) * acc_span: 2048 spreads
    them over 32 KB, as the tiled gemm's are; 0 keeps one 2 KB set in L1)."""
    a = k.add(k.mul(i, 256), k.mul(j, 32 * STRIDE))
    w = k.add(k.mul(i, ROOM), k.mul(r, BLOCKS * ROOM))
    half = k.mul(k.b.and_(r, k.i64(1)), 4096)
    steps = [] if acc_span is None else _memory_steps(k, k.b.sub(k.i64(C_AT + 4096), half),
                                                      k.add(ACC_AT, k.mul(k.add(k.mul(r, PAIRS), j), acc_span)))
    for t in range(4):
        amx.tile_op(k, "tilezero", t)
    for s in range(4):
        _load(k, 4, k.add(a, s * 64), STRIDE)
        _load(k, 6, k.add(w, B_AT + s * 1024), 64)
        _load(k, 7, k.add(w, B_AT + 4096 + s * 1024), 64)
        _load(k, 5, k.add(a, 16 * STRIDE + s * 64), STRIDE)
        for c, (x, y) in enumerate(((4, 6), (4, 7), (5, 6), (5, 7))):
            amx.tile_op(k, "tdpbssd", c, x, y)
            for step in steps[8 * s + 2 * c:8 * s + 2 * c + 2]:
                step()
    for t in range(4):
        amx.tile_op(k, "tilestored64", t, k.addr(k.arg["buf"], k.add(half, C_AT + t * 1024)), k.i64(64))


def _memory_steps(k, last, acc):
    """A callable a token of a unit: acc[t] += float(lo[t] + hi[t]) from the result tiles at ``last``."""
    v16, vi = vec(f32, 16), vec(i32, 16)

    def step(t):
        lo, hi = (k.load(vi, k.arg["buf"], k.add(last, (2 * (t >> 4) + c) * 1024 + (t & 15) * 64)) for c in (0, 1))
        k.store(k.b.fadd(k.load(v16, k.arg["buf"], k.add(acc, t * 64)), k.b.sitofp(k.b.add(lo, hi), v16)),
                k.arg["buf"], k.add(acc, t * 64))
    return [lambda t=t: step(t) for t in range(32)]


def _unit_in_turn(k, i, j, r, g, now, last):
    """Token tile g of pair j into result set ``now``; the set ``last`` stored and zeroed after the
    first k-step."""
    a = k.add(k.mul(i, 256), k.mul(k.add(k.mul(j, 2), g), 16 * STRIDE))
    w = k.add(k.mul(i, ROOM), k.mul(r, BLOCKS * ROOM))
    for s in range(4):
        _load(k, 4, k.add(a, s * 64), STRIDE)
        _load(k, 6, k.add(w, B_AT + s * 1024), 64)
        _load(k, 7, k.add(w, B_AT + 4096 + s * 1024), 64)
        amx.tile_op(k, "tdpbssd", now[0], 4, 6)
        amx.tile_op(k, "tdpbssd", now[1], 4, 7)
        if s == 0:
            for t in last:
                amx.tile_op(k, "tilestored64", t, k.addr(k.arg["buf"], C_AT + 8192 + t * 1024), k.i64(64))
            for t in last:
                amx.tile_op(k, "tilezero", t)


def _panel(unit):
    """A chunk of pairs over a K panel, block by block, each pair over the group's tiles of rows."""
    def body(k):
        with k.loop(0, BLOCKS, name="i") as i, k.loop(0, PAIRS, name="j") as j, k.loop(0, TILES, name="r") as r:
            unit(k, i, j, r)
    return body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of every case; the best is shown (default 5)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, not {args.rounds}")
    target = host_target()
    if not target.has("amx-int8"):
        raise SystemExit(f"benchmarks/tiles.py needs the amx feature set; this host runs {target.name}")
    m = ir.Module()
    per_pass = 16 * BLOCKS * PAIRS * TILES
    cases = {   # name: (builder, passes a call, what one result is: (label, how many a pass))
        "tdpbssd, zero tiles": (_with_fmas(0, operands=4096), 2000, ("a tdpbssd", 256)),
        "tdpbssd, random bytes": (_with_fmas(0), 2000, ("a tdpbssd", 256)),
        "24 zmm FMAs alone": (_with_fmas(24, tiles=False), 2000, ("24 FMAs", 256)),
        "tdpbssd beside 12 FMAs each": (_with_fmas(12), 2000, ("a tdpbssd", 256)),
        "tdpbssd beside 24 FMAs each": (_with_fmas(24), 2000, ("a tdpbssd", 256)),
        "tileloadd, rows on lines": (lambda m, n: _kernel(m, n, _loads(64 * 1024)), 50000, ("a tileloadd", 4)),
        "tileloadd, rows off lines": (lambda m, n: _kernel(m, n, _loads(64 * 1024 + 8)), 50000, ("a tileloadd", 4)),
        "units as the tiled gemm issues them": (lambda m, n: _kernel(m, n, _panel(_unit_now)), 20,
                                        ("16 tdpbssd", per_pass // 16)),
        "units, steps' memory, acc L1": (lambda m, n: _kernel(m, n, _panel(
            lambda k, i, j, r: _unit_now(k, i, j, r, 0))), 20, ("16 tdpbssd", per_pass // 16)),
        "units, steps' memory, 32 KB": (lambda m, n: _kernel(m, n, _panel(
            lambda k, i, j, r: _unit_now(k, i, j, r, 2048))), 20, ("16 tdpbssd", per_pass // 16)),
        "two result sets in turn": (lambda m, n: _kernel(m, n, _panel(
            lambda k, i, j, r: (_unit_in_turn(k, i, j, r, 0, (0, 1), (2, 3)),
                                _unit_in_turn(k, i, j, r, 1, (2, 3), (0, 1))))), 20, ("16 tdpbssd", per_pass // 16)),
    }
    for at, (build, _, _) in enumerate(cases.values()):
        build(m, f"case_{at}")
    lib = jit.compile(m, target)
    size = 4 << 20
    raw = np.random.default_rng(0).integers(0, 256, size + 4096, dtype=np.uint8)
    buf = raw[-raw.ctypes.data % 4096:][:size]                  # page aligned: every tile row starts a line
    buf[4096:8192] = 0                                          # the zero operand tiles
    buf[FMA_AT:ACC_AT + 32768].view(np.float32)[:] = 1e-3               # no NaNs or subnormals
    ghz = peaks.measure(target)["ghz"]
    print(f"core clock {ghz:.2f} GHz; cycles, the best of {args.rounds} rounds (each case once a round, "
          "the best of 3 calls)")
    fns = [lib.function(f"case_{at}", None, peaks._ABI) for at in range(len(cases))]
    best = [float("inf")] * len(cases)
    for _ in range(args.rounds):        # cases in turn, so that a slow spell of the host hits them all
        for at, (fn, (_, n, (_, count))) in enumerate(zip(fns, cases.values())):
            best[at] = min(best[at], min(_timed(fn, buf, n) for _ in range(3)) * ghz * 1e9 / (n * count))
    for (name, (_, _, (what, _))), cycles in zip(cases.items(), best):
        print(f"  {name:30s}{cycles:8.1f}   cycles for {what}")


def _timed(fn, buf, n) -> float:
    start = time.perf_counter()
    fn(buf.ctypes.data, n, 0, 1)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
