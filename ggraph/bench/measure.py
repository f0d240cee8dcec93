"""Benchmarks: prefill and decode speed of ggraph (and of llama.cpp on the same file), side by side.

    result = bench_ggraph("model.gguf", pp=64, tg=32, threads=2)   # {"pp_tok_s": ..., "tg_tok_s": ...}

Prefill runs ``pp`` prompt tokens as one step; decode then runs ``tg`` greedy steps of one
token each. Each figure is the best of ``repeats`` runs.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from ggraph.ir.fused import qmatmul_p


@dataclasses.dataclass
class Result:
    engine: str
    pp: int
    tg: int
    threads: int
    pp_tok_s: float
    tg_tok_s: float
    passes: str = ""
    backend: str = ""
    load_s: float = 0.0

    def row(self) -> dict:
        return dataclasses.asdict(self)


def prompt_tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt (ids clear of the special tokens at the start of vocabularies)."""
    return [int(t) for t in np.random.default_rng(seed).integers(min(1000, n_vocab // 2), n_vocab, n)]


def bench_ggraph(path, pp: int = 64, tg: int = 32, threads: int = 1, backend: str = "llvm",
                 passes="default", repeats: int = 3, ctx: int | None = None, disabled=(), max_memory=None) -> Result:
    """Best-of-``repeats`` prefill and decode speed of a ggraph Session."""
    from ggraph.runtime.session import Session
    t0 = time.perf_counter()
    s = Session(path, backend=backend, threads=threads, passes=passes, ctx=ctx or max(pp + tg + 1, 64),
                disabled=disabled, max_memory=max_memory)
    ids = prompt_tokens(pp, s.config.n_vocab)
    s.step(ids[:1])                                            # compile and warm up both step kinds
    s.step(ids[:2])
    load = time.perf_counter() - t0
    best_pp = best_tg = float("inf")
    for _ in range(repeats):
        s.reset()
        t = time.perf_counter()
        logits = s.step(ids)
        best_pp = min(best_pp, time.perf_counter() - t)
        tok = int(np.argmax(logits[-1]))
        t = time.perf_counter()
        for _ in range(tg):
            tok = int(np.argmax(s.step([tok])[-1]))
        best_tg = min(best_tg, time.perf_counter() - t)
    return Result("ggraph", pp, tg, threads, pp / best_pp, tg / best_tg if tg else 0.0,
                  passes=passes if isinstance(passes, str) else ",".join(passes), backend=backend, load_s=load)


def bench_llama_cpp(path, pp: int = 64, tg: int = 32, threads: int = 1, repeats: int = 3) -> Result:
    """The same measurement through llama-cpp-python (raises ImportError when it is missing)."""
    import llama_cpp
    t0 = time.perf_counter()
    n_ctx = max(pp + tg + 1, 64)               # n_batch = n_ctx: llama-cpp-python indexes its scores by position
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=max(pp, 1),
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    ids = prompt_tokens(pp, llm.n_vocab())
    load = time.perf_counter() - t0
    best_pp = best_tg = float("inf")
    for _ in range(repeats):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        best_pp = min(best_pp, time.perf_counter() - t)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(tg):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        best_tg = min(best_tg, time.perf_counter() - t)
    llm.close()
    return Result("llama.cpp", pp, tg, threads, pp / best_pp, tg / best_tg if tg else 0.0,
                  backend=f"llama-cpp-python {llama_cpp.__version__}", load_s=load)


# ---------------------------------------------------------------------------------------
# profiles and the roofline
# ---------------------------------------------------------------------------------------

def stream_bandwidth(threads: int, mbytes: int = 1024, repeats: int = 3) -> float:
    """Memory read bandwidth in GB/s, measured now: native threads summing an array larger than the caches."""
    from ggraph import f32 as F32
    from ggraph import ops, trace
    from ggraph.compiler import compile_graph
    n = mbytes * (1 << 20) // 4 // 4096
    prog = compile_graph(trace(ops.reduce_sum, F32["T", 4096]), backend="llvm", passes=[], threads=threads)
    x = np.ones((n, 4096), dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        prog(x)
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best / 1e9


def cpu_ghz() -> float:
    """The nominal clock from /proc/cpuinfo (a rough figure: turbo and throttling move it)."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.lower().startswith("cpu mhz")]
        return max(mhz) / 1000 if mhz else 3.0
    except OSError:
        return 3.0


def peak_gflops(target, threads: int) -> dict[str, float]:
    """Peak compute from the feature set: f32 FMA (2 ports) and int8 dot products per second."""
    lanes = target.vector_bits // 32
    f32_peak = threads * cpu_ghz() * 2 * lanes * 2                 # 2 FMA ports, 2 flops each
    int8 = 4 if target.has("avx512vnni") or target.has("avxvnni") else 2
    return {"f32": f32_peak, "int8": f32_peak * int8 / 2}


def op_kind(eqn) -> str:
    """How a profile groups eqns: qmatmul by weight type, fused loops together, others by name."""
    if eqn is None:
        return "?"
    if eqn.prim is qmatmul_p:
        return f"qmatmul {eqn.inputs[1].aval.dtype}"
    return eqn.prim.name


def profile_rows(program, dims: dict, bandwidth: float, peaks: dict) -> dict[str, list[dict]]:
    """Time, bytes and flops of the program's last run, per op kind and per layer."""
    per_eqn: dict[int, list] = {}
    for call, seconds in program.last_profile:
        key = id(call.eqn)
        if key not in per_eqn:
            per_eqn[key] = [call.eqn, 0.0]
        per_eqn[key][1] += seconds
    groups = {"op": {}, "layer": {}}
    for eqn, seconds in per_eqn.values():
        flops, nbytes = eqn.cost(dims) if eqn is not None else (0, 0)
        layer = ".".join(eqn.scope.split(".")[:2]) if eqn is not None and eqn.scope.startswith("blk.") \
            else (eqn.scope.split(".")[0] if eqn is not None and eqn.scope else "top")
        for by, key in (("op", op_kind(eqn)), ("layer", layer)):
            row = groups[by].setdefault(key, {"name": key, "calls": 0, "seconds": 0.0, "bytes": 0.0, "flops": 0.0})
            row["calls"] += 1
            row["seconds"] += seconds
            row["bytes"] += nbytes
            row["flops"] += flops
    total = sum(s for _, s in per_eqn.values()) or 1.0
    out = {}
    for by, rows in groups.items():
        listed = sorted(rows.values(), key=lambda r: -r["seconds"])
        for r in listed:
            r["share"] = r["seconds"] / total
            r["gb_s"] = r["bytes"] / r["seconds"] / 1e9 if r["seconds"] else 0.0
            r["gflop_s"] = r["flops"] / r["seconds"] / 1e9 if r["seconds"] else 0.0
            peak = peaks["int8"] if r["name"].startswith("qmatmul") and "f32" not in r["name"] else peaks["f32"]
            bound = max(r["bytes"] / (bandwidth * 1e9), r["flops"] / (peak * 1e9))
            r["roofline"] = bound / r["seconds"] if r["seconds"] else 0.0     # 1.0 = at the limit
        out[by] = listed
    return out


def profile_ggraph(path, pp: int = 64, threads: int = 1, passes="default", ctx: int | None = None,
                   disabled=()) -> dict:
    """Per-op and per-layer time for one prefill of ``pp`` tokens and one decode step."""
    from ggraph.runtime.session import Session
    s = Session(path, backend="llvm", threads=threads, passes=passes, ctx=ctx or max(pp + 8, 64), profile=True,
                disabled=disabled)
    prog = s.program(last_only=True)
    bandwidth = stream_bandwidth(threads)
    peaks = peak_gflops(prog.target, threads)
    ids = prompt_tokens(pp, s.config.n_vocab)
    s.step(ids)                                              # warm: page in the weights
    s.reset()
    s.step(ids)
    prefill = profile_rows(prog, {"T": pp, "P": 0}, bandwidth, peaks)
    s.step([ids[0]])
    decode = profile_rows(prog, {"T": 1, "P": pp}, bandwidth, peaks)
    return {"roofline": {"bandwidth_gb_s": bandwidth, "peak_gflop_s": peaks["f32"], "peak_int8_gop_s": peaks["int8"],
                         "target": prog.target.name, "threads": threads},
            "prefill": prefill, "decode": decode}


def profile_table(title: str, rows: list[dict]) -> str:
    lines = [title, f"  {'':<18} {'calls':>5} {'ms':>8} {'share':>6} {'GB/s':>7} {'GFLOP/s':>8} {'of roofline':>11}"]
    for r in rows:
        lines.append(f"  {r['name']:<18} {r['calls']:>5} {r['seconds'] * 1e3:>8.3f} {r['share']:>6.1%} "
                     f"{r['gb_s']:>7.1f} {r['gflop_s']:>8.1f} {r['roofline']:>10.0%}")
    return "\n".join(lines)
