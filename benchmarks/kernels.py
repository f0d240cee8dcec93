"""Speed of the qmatmul kernels on the Gemma 3 270M shapes: GB/s for GEMV, GFLOP/s for GEMM.

    python benchmarks/kernels.py [--targets avx512_vnni,avx2] [--threads 1,2] [--types q8_0,q4_k]
    python benchmarks/kernels.py --shapes q4_1:576:1536,q4_1:1536:576     # any TYPE:K:N instead
    python benchmarks/kernels.py --shapes q4_k:2048:8192 --layouts file,rows16   # the file's layout and rows16

GEMV (T=1) streams weights that are not in cache (copies are rotated so that each call
reads a fresh one; the 178 MB output matrix is read as one), the decode situation.
GEMM (T=64) reuses one copy, the prefill situation, where compute is the limit.
Threads are Python threads calling the ctypes function (which releases the GIL), each
taking chunks of rows of every call in turn (as in a program); a kernel never waits.
"""
from __future__ import annotations

import argparse
import ctypes

import numpy as np
from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm import jit, kernels
from ggraph.backends.llvm.kernels import rows16
from ggraph.gguf.quants import F16_FIELDS
from ggraph.backends.llvm.program import own_pages
from ggraph.backends.llvm.target import runnable_targets
from ggraph.backends.llvm.team import CallTeam

#  wtype   K      N       what it is in gemma 3 270m
SHAPES = [
    ("q5_0", 640, 256, "attn_k / attn_v"),
    ("q8_0", 640, 256, "attn_v (some layers)"),
    ("q5_0", 640, 1024, "attn_q"),
    ("q5_0", 640, 2048, "ffn_gate / ffn_up"),
    ("q4_k", 1024, 640, "attn_output"),
    ("q4_k", 2048, 640, "ffn_down (half the layers)"),
    ("q6_k", 2048, 640, "ffn_down (other half)"),
    ("q8_0", 640, 262144, "token_embd = tied output"),
]
COLD_BYTES = 256 << 20           # rotate weight copies over this much memory for GEMV
P = ctypes.c_void_p
ABI = [P, P, P, P, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]      # w, xq, y, counter, T, ith, nth
ACT_ABI = [P, P, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]       # act_quant: x, xq, T, ith, nth


def random_weights(dt, N: int, K: int, rng) -> np.ndarray:
    """Random block bytes with small fp16 scales (the values do not change the speed, once the scales
    are normal numbers)."""
    raw = rng.integers(0, 256, (N * K // dt.block_size, dt.type_size), dtype=np.uint8)
    for at in F16_FIELDS.get(dt.name, ()):    # random f16 bytes would be NaNs and subnormals, which are slow
        raw[:, at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw


def timed(fn, args_for, reps: int, nth: int, runs: int = 5) -> float:
    """Seconds per call: nth threads each run their share `reps` times; best of ``runs``. Every call
    gets a work counter of its own (zeroed before each run), as a program gives each of its calls;
    args_for(r, counter) gives call r's arguments."""
    counters = np.zeros((reps, 16), np.int32)
    base = counters.ctypes.data

    def worker(ith):
        for r in range(reps):
            fn(*args_for(r, base + 64 * r), ith, nth)
    team = CallTeam(nth)
    try:
        best = float("inf")
        for _ in range(runs):
            counters[:] = 0
            best = min(best, team.best_time(worker, tries=1))
        return best / reps
    finally:
        team.close()


class Shape:
    """One qmatmul compiled for (target, type, K, N) and weights in the file's ``layout`` or one a
    program lays them out in (rows16: in pages of their own, as a program allocates them): ``gemv(nth)``
    GB/s of weights at T=1 (cold: a fresh copy per call, unless ``hot``), ``gemm(nth)`` GFLOP/s."""

    def __init__(self, target, wtype: str, K: int, N: int, rng, hot: bool = False, tokens: int = 64,
                 layout: str = "file"):
        dt = dtypes.from_name(wtype)
        fmt = kernels.act_format(dt)
        m = ir.Module()
        qname = kernels.qmatmul(m, dt, K, N, target, layout=None if layout == "file" else layout)
        aname = kernels.act_quant(m, fmt, K, target)
        self.lib = jit.compile(m, target)
        self.qm = self.lib.function(qname, None, ABI)
        aq = self.lib.function(aname, None, ACT_ABI)
        raw = random_weights(dt, N, K, rng)
        self.bytes = raw.nbytes
        self.copies = 1 if hot else max(1, COLD_BYTES // raw.nbytes)
        if layout == "file":
            self.pool = np.empty((self.copies, raw.nbytes), np.uint8)
            self.pool[:] = raw.reshape(1, -1)
        else:                      # (GB/s count the file's bytes; rows16 pads q6_k by 1%)
            laid = rows16.repack(raw, dt, N, K)
            self.pool = own_pages(self.copies * laid.nbytes).reshape(self.copies, laid.nbytes)
            self.pool[:] = laid.reshape(1, -1)
        self.acts = {}
        for T in (1, tokens):            # page aligned
            x = rng.standard_normal((T, K)).astype(np.float32)
            xq = own_pages(kernels.act_bytes(fmt, T, K))
            aq(x.ctypes.data, xq.ctypes.data, T, 0, 1)
            y = own_pages(4 * T * N).view(np.float32).reshape(T, N)
            self.acts[T] = (xq, y, 2 * T * N * K)
        self.tokens = tokens

    def _rate(self, T: int, nth: int, runs: int) -> float:
        xq, y, flops = self.acts[T]
        copies = self.copies if T == 1 else 1
        work = self.bytes if T == 1 else flops
        reps = max(3, min(200, int(2e8 // work * (1 if T == 1 else 50))))
        base, stride = self.pool.ctypes.data, self.pool.shape[1]
        args = lambda r, c: (base + (r % copies) * stride, xq.ctypes.data, y.ctypes.data, c, T)  # noqa: E731
        return work / timed(self.qm, args, reps, nth, runs) / 1e9

    def gemv(self, nth: int, runs: int = 1) -> float:
        return self._rate(1, nth, runs)

    def gemm(self, nth: int) -> float:
        return self._rate(self.tokens, nth, 5)


ROUNDS = 7                       # alternating GEMV rounds of the layouts of one shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="", help="comma list; default: every target this host runs")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--types", default="", help="only these weight types")
    ap.add_argument("--hot", action="store_true", help="GEMV on one cached copy: the compute ceiling")
    ap.add_argument("--shapes", default="", help="comma list of TYPE:K:N to run instead of Gemma 3's shapes")
    ap.add_argument("--tokens", type=int, default=64, help="T of the GEMM columns (a prefill's length)")
    ap.add_argument("--layouts", default="file", help="comma list of weight layouts, a row each: file (as "
                    "in the GGUF file), rows16 (q4_k, q5_k and q6_k interleaved 16 rows at a time, as a "
                    "program lays them out on AVX-512 VNNI)")
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    if any(lay not in ("file", rows16.LAYOUT) for lay in layouts):
        ap.error(f"--layouts takes file and rows16, got {args.layouts!r}")
    shapes = SHAPES
    if args.shapes:
        try:
            shapes = [(w, int(k), int(n), "--shapes") for w, k, n in (x.split(":") for x in args.shapes.split(","))]
        except ValueError:
            ap.error(f"--shapes takes TYPE:K:N,... (e.g. q4_1:576:1536), got {args.shapes!r}")
    runnable = {t.name: t for t in runnable_targets()}        # each with this host's extras (prefetch kind)
    wanted = args.targets.split(",") if args.targets else [n for n in runnable if n != "generic"]
    unknown = [n for n in wanted if n not in runnable]
    if unknown:
        ap.error(f"--targets: this host does not run {', '.join(unknown)}; it runs {', '.join(runnable)}")
    targets = [runnable[n] for n in wanted]
    if args.tokens < 2:
        ap.error(f"--tokens is the GEMM's T and must be at least 2 (T=1 is the GEMV column), got {args.tokens}")
    threads = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)
    cols = " ".join(f"{'gemv ' + str(n) + 't':>10}" for n in threads) + " " + \
        " ".join(f"{'gemm ' + str(n) + 't':>10}" for n in threads)
    print(f"{'type':6} {'K':>5} {'N':>7} {'target':12} {cols}   (GEMV: GB/s of weights, T=1; "
          f"GEMM: GFLOP/s, T={args.tokens})")
    for wtype, K, N, what in shapes:
        if args.types and wtype not in args.types.split(","):
            continue
        for target in targets:
            shapes_of, missing = {}, []
            for layout in layouts:
                if layout != "file" and not rows16.takes(dtypes.from_name(wtype), N, target):
                    missing.append(f"{wtype:6} {K:5} {N:7} {target.name:12} (no {layout} layout for {wtype}, "
                                   f"{N} rows, {target.name})")
                    continue
                shapes_of[layout] = Shape(target, wtype, K, N, rng, args.hot, args.tokens, layout)
            # GEMV: the layouts' rounds alternate, so that each meets the same neighbours; the median
            # of the rounds, and of each round's ratio to the first layout's
            rates = {(lay, n): [] for lay in shapes_of for n in threads}
            for _ in range(ROUNDS if len(shapes_of) > 1 else 1):
                for lay, sh in shapes_of.items():
                    for n in threads:
                        rates[(lay, n)].append(sh.gemv(n, runs=1 if len(shapes_of) > 1 else 5))
            first = next(iter(shapes_of), None)
            for lay, sh in shapes_of.items():
                gemv = " ".join(f"{np.median(rates[(lay, n)]):10.2f}" for n in threads)
                gemm = " ".join(f"{sh.gemm(n):10.1f}" for n in threads)
                ratio = "" if lay == first else " (" + lay + ": gemv " + ", ".join(
                    f"{np.median(np.divide(rates[(lay, n)], rates[(first, n)])):.2f}x" for n in threads) + ")"
                print(f"{wtype:6} {K:5} {N:7} {target.name:12} {gemv} {gemm}   {what}{ratio}", flush=True)
            for line in missing:
                print(line, flush=True)


if __name__ == "__main__":
    main()
