"""Cycles per instruction of the 512-bit loads and operations the gemv kernels are made of, on this
core: which of them share an issue slot. The figures docs/performance.md quotes.

    python benchmarks/pipes.py [--iterations 50000000]

Each test is a loop of inline assembly (independent instructions, eight accumulators where they
accumulate); the clock is that of a chain of dependent scalar adds, one cycle each. Two kinds
side by side take the sum of their cycles where they share a slot, the larger where they do not.
x86-64 with AVX-512 VNNI and GFNI only.
"""
from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
import llvmlite.binding as llvm
from llvmlite import ir

from ggraph.backends.llvm import jit
from ggraph.backends.llvm.kernels.builder import Kernel
from ggraph.backends.llvm.target import host_features, named_target

REGS = range(3, 11)                                      # zmm3..zmm10 (and zmm11..zmm18): destinations


def each(template: str, second: bool = False) -> str:
    """The template once per destination register ``{d}`` (the second kind's set with ``second``),
    sources zmm1 and zmm2."""
    return "\n".join(template.format(d=d + 8 * second) for d in REGS)


CHAIN = "\n".join(["add $$1, %rax"] * 8)                 # 8 dependent scalar adds: 8 cycles
TESTS = {                                                # name: (body, instructions per iteration)
    "vpdpbusd": each("vpdpbusd %zmm1, %zmm2, %zmm{d}"),
    "vpmaddwd": each("vpmaddwd %zmm1, %zmm2, %zmm{d}"),
    "vgf2p8affineqb": each("vgf2p8affineqb $$0, %zmm1, %zmm2, %zmm{d}"),
    "vpermw": each("vpermw %zmm1, %zmm2, %zmm{d}"),
    "vpackssdw": each("vpackssdw %zmm1, %zmm2, %zmm{d}"),
    "vpsrlw": each("vpsrlw $$4, %zmm1, %zmm{d}"),
    "vpandq": each("vpandq %zmm1, %zmm2, %zmm{d}"),
    "load, aligned": each("vmovdqu64 {d}*64($0), %zmm{d}"),
    "load, across lines": each("vmovdqu64 {d}*64+8($0), %zmm{d}"),
    "vpdpbusd + vpmaddwd": each("vpdpbusd %zmm1, %zmm2, %zmm{d}") + "\n" + each("vpmaddwd %zmm1, %zmm2, %zmm{d}", True),
    "vpdpbusd + vgf2p8affineqb": each("vpdpbusd %zmm1, %zmm2, %zmm{d}") + "\n"
                                 + each("vgf2p8affineqb $$0, %zmm1, %zmm2, %zmm{d}", True),
    "vpdpbusd + vpermw": each("vpdpbusd %zmm1, %zmm2, %zmm{d}") + "\n" + each("vpermw %zmm1, %zmm2, %zmm{d}", True),
    "vpdpbusd + vpsrlw": each("vpdpbusd %zmm1, %zmm2, %zmm{d}") + "\n" + each("vpsrlw $$4, %zmm1, %zmm{d}", True),
    "vpdpbusd + vpandq": each("vpdpbusd %zmm1, %zmm2, %zmm{d}") + "\n" + each("vpandq %zmm1, %zmm2, %zmm{d}", True),
    "vpdpbusd + load": each("vpdpbusd %zmm1, %zmm2, %zmm{d}") + "\n" + each("vmovdqu64 {d}*64($0), %zmm{d}", True),
}


def build(names: list[str]):
    """One kernel per test and one for the clock, each looping over its body ``n`` times."""
    m = ir.Module()
    clobbers = "r,~{rax},~{memory}," + ",".join(f"~{{zmm{r}}}" for r in range(3, 19))
    for name, body in [("clock", CHAIN)] + [(f"t{j}", TESTS[n]) for j, n in enumerate(names)]:
        k = Kernel(m, name, ("buf",), sizes=("n",))
        with k.loop(0, k.arg["n"]):
            k.b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), [k.arg["buf"].type]), body, clobbers,
                                  side_effect=True), [k.arg["buf"]])
        k.finish()
    llvm.initialize_native_asmparser()                   # inline assembly needs the x86 parser
    lib = jit.compile(m, named_target("avx512_vnni", ("gfni",)))
    abi = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]          # buf, n, ith, nth
    return {name: lib.function(name, None, abi)
            for name in ["clock"] + [f"t{j}" for j in range(len(names))]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=20_000_000)
    args = ap.parse_args()
    if args.iterations < 1000:
        ap.error(f"--iterations must be at least 1000, got {args.iterations}")
    missing = {"avx512bw", "avx512vnni", "gfni"} - host_features()
    if missing:
        ap.error(f"this host lacks {', '.join(sorted(missing))}")
    names = list(TESTS)
    fns = build(names)
    buf = np.zeros(2048 + 64, np.uint8)
    at = buf.ctypes.data + (-buf.ctypes.data % 64)          # 64-byte aligned

    def seconds(f) -> float:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            f(at, args.iterations, 0, 1)
            best = min(best, time.perf_counter() - t)
        return best
    hz = 8 * args.iterations / seconds(fns["clock"])
    print(f"clock: {hz / 1e9:.2f} GHz (dependent scalar adds)")
    print(f"{'instructions':<28} cycles per iteration (8 of each kind)")
    for j, name in enumerate(names):
        print(f"{name:<28} {seconds(fns[f't{j}']) * hz / args.iterations:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
