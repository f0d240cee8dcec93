"""Speed of the attention kernels on Gemma 3 270M shapes (H=4, Hkv=1, D=Dv=256).

    python benchmarks/attention.py [--targets avx512_vnni,avx2] [--threads 1,2] [--past 512] [--prefill 64]
                                   [--cache-type f16]

decode: T=1 at past length P; the attention kernel streams the K and V cache rows 0..P,
reported as GB/s of cache read. Each call uses the next of 18 cache copies (one per
layer of the model), so the cache comes from memory or L3 as in a real decode step.
prefill: T tokens at P=0, reported as GFLOP/s (2·D + 2·Dv flops per visible query-key pair).
The attention time includes the combine kernel that merges the threads' partial softmaxes
when they split the keys (timed separately and added: in a program a barrier sits between
them). rope_kv_store (kernel A) is timed on its own. Threads are Python threads calling the
ctypes function (which releases the GIL), each doing its (ith, nth) share of every call.
"""
from __future__ import annotations

import argparse
import ctypes

import numpy as np
from llvmlite import ir

from ggraph.backends.llvm import jit
from ggraph.backends.llvm.kernels.attention import Attention, Rope, attention_kernels, partial_bytes
from ggraph.gguf.quants import quantize
from ggraph.ir import dtypes
from ggraph.backends.llvm.target import named_target, runnable_targets
from ggraph.backends.llvm.team import CallTeam

GEMMA_ROPE = Rope(dims=256, base=1e6)
LAYERS = 18                      # cache copies rotated over in decode


def cache_rows(x: np.ndarray, cache_type: str) -> np.ndarray:
    """f32 rows as a cache of ``cache_type``: a numpy array, or block bytes."""
    dt = dtypes.from_name(cache_type)
    return x.astype(dt.np_dtype) if dt.np_dtype is not None else quantize(x, dt)


def timed(call, reps: int, nth: int) -> float:
    """Seconds per call: nth threads each run their share `reps` times; best of 5."""
    def worker(ith):
        for r in range(reps):
            call(r, ith, nth)
    team = CallTeam(nth)
    try:
        return team.best_time(worker) / reps
    finally:
        team.close()


def bench(target, T: int, P: int, threads: list[int], rng, cache_type: str = "f16") -> dict:
    """{(kernel, nth): (seconds, rate)} for one (T, P)."""
    a = Attention(H=4, Hkv=1, D=256, Dv=256, scale=256 ** -0.5, k_type=cache_type, v_type=cache_type)
    m = ir.Module()
    kernels = attention_kernels(m, target, a, GEMMA_ROPE)
    lib = jit.compile(m, target)
    copies = LAYERS if T == 1 else 1
    C = P + T
    kc = [cache_rows(rng.standard_normal((C, a.Hkv, a.D)).astype(np.float32), cache_type) for _ in range(copies)]
    vc = [cache_rows(rng.standard_normal((C, a.Hkv, a.Dv)).astype(np.float32), cache_type) for _ in range(copies)]
    arrays = {"q": rng.standard_normal((T, a.H, a.D)), "k": rng.standard_normal((T, a.Hkv, a.D)),
              "v": rng.standard_normal((T, a.Hkv, a.Dv)), "out": np.zeros((T, a.H, a.Dv))}
    arrays = {n: x.astype(np.float32) for n, x in arrays.items()}
    arrays["positions"] = np.arange(P, P + T, dtype=np.int32)
    arrays["partial"] = np.zeros(partial_bytes(a), np.uint8)
    fixed = {n: x.ctypes.data for n, x in arrays.items()}                # numpy's .ctypes costs µs: once
    per_copy = {"k_cache": [x.ctypes.data for x in kc], "v_cache": [x.ctypes.data for x in vc]}
    calls = {}
    for fn, args in kernels:
        f = lib.function(fn.name, None, [ctypes.c_void_p] * (len(args) - 2) + [ctypes.c_int64] * 2
                         + [ctypes.c_int32] * 2)
        ptrs = [[per_copy[n][c] if n in per_copy else fixed[n] for n in args[:-2]] for c in range(copies)]
        calls[fn.name.split("_h")[0]] = lambda r, ith, nth, f=f, ptrs=ptrs: f(*ptrs[r % copies], T, P, ith, nth)
    pairs = sum(P + t + 1 for t in range(T)) * a.H                  # visible (query head, key) pairs
    flops = pairs * 2 * (a.D + a.Dv)
    cache_bytes = kc[0].nbytes + vc[0].nbytes
    reps = max(20, int(1e9 // flops))
    res = {}
    for nth in threads:
        sb = timed(calls["attention"], reps, nth) + timed(calls["attention_combine"], reps, nth)
        sa = timed(calls["rope_kv_store"], reps, nth)
        res[("attention", nth)] = (sb, cache_bytes / sb / 1e9 if T == 1 else flops / sb / 1e9)
        res[("rope_kv_store", nth)] = (sa, None)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="", help="comma list; default: every target this host runs")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--past", type=int, default=512, help="P for decode")
    ap.add_argument("--prefill", type=int, default=64, help="T for prefill")
    ap.add_argument("--cache-type", default="f16", help="K and V cache type: f32, f16, bf16, q8_0 or q4_0")
    args = ap.parse_args()
    targets = [named_target(t) for t in args.targets.split(",")] if args.targets else runnable_targets()
    threads = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)
    print(f"gemma 3 270m attention: H=4 Hkv=1 D=Dv=256, {args.cache_type} caches")
    print(f"{'target':12} {'case':22} {'threads':>7} {'attention µs':>13} {'rate':>17} {'rope_kv_store µs':>17}")
    for target in targets:
        cases = ((f"decode T=1 P={args.past}", 1, args.past), (f"prefill T={args.prefill} P=0", args.prefill, 0))
        for label, T, P in cases:
            r = bench(target, T, P, threads, rng, args.cache_type)
            unit = "GB/s cache" if T == 1 else "GFLOP/s"
            for nth in threads:
                sb, rate = r[("attention", nth)]
                sa, _ = r[("rope_kv_store", nth)]
                print(f"{target.name:12} {label:22} {nth:7d} {sb * 1e6:13.1f} {rate:9.2f} {unit:6} {sa * 1e6:17.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
