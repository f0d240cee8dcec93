"""Benchmarks: prefill and decode speed of ggraph (and of llama.cpp on the same file), side by side.

    result = bench_ggraph("model.gguf", pp=64, tg=32, threads=2)   # {"pp_tok_s": ..., "tg_tok_s": ...}
    results = bench_side_by_side([GGraphRunner(...), LlamaCppRunner(...)], pp=512, tg=32, depth=4096)

As ``llama-bench -d N`` does it: ``depth`` tokens are put in the KV cache untimed; then a
prefill of ``pp`` tokens (one step, run in ubatches of 512) is timed at P=depth, and ``tg``
decode steps of one token each are timed after the same ``depth`` tokens. Every round puts
each engine back at the depth (the cache is truncated, not refilled), and the rounds of the
engines alternate, so that noise on a busy machine falls on all of them alike; each figure is
the best of ``repeats`` rounds.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from ggraph.ir.dtypes import ParamAval
from ggraph.ir.fused import qmatmul_experts_p, qmatmul_p

GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}     # llama.cpp's ids of the cache types
LLAMA_NEEDS_FA = ("q8_0", "q4_0")          # V cache types llama.cpp runs only with flash attention
LLAMA_UBATCH = 512                         # llama.cpp's default n_ubatch, as ggraph's ubatch
LLAMA_BATCH = 2048                         # llama.cpp's default n_batch


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
    depth: int = 0                         # tokens in the cache before the timed prefill and decode
    ctx: int = 0
    cache_k: str = ""
    cache_v: str = ""
    flash_attn: str = ""                   # llama.cpp's -fa: "on" or "off" ("" for ggraph)
    model: str = ""                        # the file's name

    def row(self) -> dict:
        return dataclasses.asdict(self)


def prompt_tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt (ids clear of the special tokens at the start of vocabularies)."""
    return [int(t) for t in np.random.default_rng(seed).integers(min(1000, n_vocab // 2), n_vocab, n)]


def context_needed(depth: int, pp: int, tg: int) -> int:
    """The KV cache rows a measurement at ``depth`` takes, as llama-bench sizes it: depth + pp + tg."""
    return depth + pp + tg


class GGraphRunner:
    """A ggraph Session set up for timing: compiled, warmed up, and moved to a depth between rounds.
    ``fill`` holds a context's first tokens in the cache; ``prefill`` and ``decode`` truncate back to
    them and time a step of ``pp`` tokens, or ``n`` steps of one."""
    engine = "ggraph"

    def __init__(self, path, threads: int = 1, ctx: int = 4096, backend: str = "llvm", passes="default",
                 cache_type_k: str = "f16", cache_type_v: str = "f16", disabled=(), max_memory=None):
        from ggraph.runtime.session import Session
        t0 = time.perf_counter()
        self.session = s = Session(path, backend=backend, threads=threads, passes=passes, ctx=ctx, disabled=disabled,
                                   max_memory=max_memory, cache_type_k=cache_type_k, cache_type_v=cache_type_v)
        s.step([0])                                            # compile and warm up both step kinds
        s.step([0, 0])
        s.reset()
        self.held = 0                                          # leading context tokens the cache holds
        self.load_s = time.perf_counter() - t0
        self.n_vocab = s.config.n_vocab
        self.passes = passes if isinstance(passes, str) else ",".join(passes)
        self.fields = dict(engine="ggraph", threads=threads, passes=self.passes, backend=backend, ctx=ctx,
                           cache_k=cache_type_k, cache_v=cache_type_v, model=Path(path).name)

    def fill(self, ids: list[int], depth: int) -> None:
        """Hold the first ``depth`` of ``ids`` in the cache (prefilling only what it lacks), untimed."""
        self.held = min(self.held, depth)
        self.session.truncate(self.held)
        if depth > self.held:
            self.session.step(ids[self.held:depth])
            self.held = depth

    def prefill(self, ids: list[int], depth: int) -> float:
        self.session.truncate(depth)
        t = time.perf_counter()
        self.session.step(ids)
        return time.perf_counter() - t

    def decode(self, tok: int, n: int, depth: int) -> float:
        s = self.session
        s.truncate(depth)
        t = time.perf_counter()
        for _ in range(n):
            tok = int(np.argmax(s.step([tok])[-1]))
        return time.perf_counter() - t

    def close(self) -> None:
        self.session = None


class LlamaCppRunner:
    """The same through llama-cpp-python (ImportError when it is missing): n_batch 2048, n_ubatch 512,
    the cache types and flash attention as asked."""
    engine = "llama.cpp"

    def __init__(self, path, threads: int = 1, ctx: int = 4096, cache_type_k: str = "f16",
                 cache_type_v: str = "f16", flash_attn: bool = True):
        import llama_cpp
        t0 = time.perf_counter()
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=ctx, n_batch=min(LLAMA_BATCH, ctx),
                                   n_ubatch=min(LLAMA_UBATCH, ctx), n_threads=threads, n_threads_batch=threads,
                                   type_k=GGML_TYPES[cache_type_k], type_v=GGML_TYPES[cache_type_v],
                                   flash_attn=flash_attn, verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.llm.eval([0])
        self.llm.eval([0])
        self.llm.reset()
        self.held = 0
        self.load_s = time.perf_counter() - t0
        self.fields = dict(engine="llama.cpp", threads=threads, backend=f"llama-cpp-python {llama_cpp.__version__}",
                           ctx=ctx, cache_k=cache_type_k, cache_v=cache_type_v,
                           flash_attn="on" if flash_attn else "off", model=Path(path).name)

    def _last_token(self) -> int:
        import llama_cpp
        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.n_vocab,))))

    def fill(self, ids: list[int], depth: int) -> None:
        self.held = min(self.held, depth)
        self.llm.n_tokens = self.held                        # eval drops the cache past n_tokens
        if depth > self.held:
            self.llm.eval(ids[self.held:depth])
            self.held = depth

    def prefill(self, ids: list[int], depth: int) -> float:
        self.llm.n_tokens = depth
        t = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t

    def decode(self, tok: int, n: int, depth: int) -> float:
        self.llm.n_tokens = depth
        t = time.perf_counter()
        for _ in range(n):
            self.llm.eval([tok])
            tok = self._last_token()
        return time.perf_counter() - t

    def close(self) -> None:
        self.llm.close()


def bench_side_by_side(runners: list, pp: int, tg: int, depth: int = 0, repeats: int = 3,
                       stream: "StreamRunner | None" = None, stream_bytes: int = 0) -> list[Result]:
    """Best-of-``repeats`` prefill and decode speed of each runner at ``depth``, their rounds alternating.
    With a ``stream``, every round also reads ``stream_bytes`` through it (see StreamRunner): its
    ``best`` is then the best of these rounds."""
    if stream is not None:
        stream.best = 0.0
    n_vocab = min(r.n_vocab for r in runners)
    context, ids = prompt_tokens(depth, n_vocab, seed=1), prompt_tokens(pp, n_vocab)
    for r in runners:
        r.fill(context, depth)
    best = [[float("inf"), float("inf")] for _ in runners]
    for _ in range(repeats):
        for r, b in zip(runners, best):
            b[0] = min(b[0], r.prefill(ids, depth))
            b[1] = min(b[1], r.decode(ids[0], tg, depth))
        if stream is not None:
            stream.read(stream_bytes)
    return [Result(pp=pp, tg=tg, pp_tok_s=pp / b[0], tg_tok_s=tg / b[1] if tg else 0.0, load_s=r.load_s, depth=depth,
                   **r.fields) for r, b in zip(runners, best)]


def bench_ggraph(path, pp: int = 64, tg: int = 32, threads: int = 1, backend: str = "llvm",
                 passes="default", repeats: int = 3, ctx: int | None = None, disabled=(), max_memory=None,
                 depth: int = 0, cache_type_k: str = "f16", cache_type_v: str = "f16") -> Result:
    """Best-of-``repeats`` prefill and decode speed of a ggraph Session at ``depth``."""
    ctx = ctx or context_needed(depth, pp, tg)
    runner = GGraphRunner(path, threads, ctx, backend, passes, cache_type_k, cache_type_v, disabled, max_memory)
    try:
        return bench_side_by_side([runner], pp, tg, depth, repeats)[0]
    finally:
        runner.close()


def bench_llama_cpp(path, pp: int = 64, tg: int = 32, threads: int = 1, repeats: int = 3, ctx: int | None = None,
                    depth: int = 0, cache_type_k: str = "f16", cache_type_v: str = "f16",
                    flash_attn: bool = True) -> Result:
    """The same measurement through llama-cpp-python (raises ImportError when it is missing)."""
    ctx = ctx or context_needed(depth, pp, tg)
    runner = LlamaCppRunner(path, threads, ctx, cache_type_k, cache_type_v, flash_attn)
    try:
        return bench_side_by_side([runner], pp, tg, depth, repeats)[0]
    finally:
        runner.close()


# ---------------------------------------------------------------------------------------
# profiles and the roofline
# ---------------------------------------------------------------------------------------

class StreamRunner:
    """Memory read bandwidth, measured as the engines run: native threads summing an array larger than
    the caches. Beside them in bench_side_by_side's rounds it reads, each round, as many bytes as an
    engine's round reads (``round_bytes``), so that it meets the same neighbours for as long as they
    do (on a shared machine the bandwidth swings 3x within seconds, and a short read catches the quiet
    moments a long decode round cannot). ``best`` is its best round's GB/s, as the engines keep their best."""

    def __init__(self, threads: int, mbytes: int = 1024):
        from ggraph import f32 as F32
        from ggraph import ops, trace
        from ggraph.compiler import compile_graph
        self.program = compile_graph(trace(ops.reduce_sum, F32["T", 4096]), backend="llvm", passes=[],
                                     threads=threads)
        self.array = np.ones((mbytes * (1 << 20) // 4 // 4096, 4096), dtype=np.float32)
        self.best = 0.0

    def read(self, nbytes: int = 0) -> float:
        """Read the array as many times as ``nbytes`` takes (once at least); the GB/s of the reads."""
        times = max(1, round(nbytes / self.array.nbytes))
        t = time.perf_counter()
        for _ in range(times):
            self.program(self.array)
        gb_s = times * self.array.nbytes / (time.perf_counter() - t) / 1e9
        self.best = max(self.best, gb_s)
        return gb_s


def stream_bandwidth(threads: int, mbytes: int = 1024, repeats: int = 3) -> float:
    """Memory read bandwidth in GB/s, measured now: the best of ``repeats`` reads of ``mbytes``."""
    stream = StreamRunner(threads, mbytes)
    for _ in range(repeats):
        stream.read()
    return stream.best


def machine_peaks(target, threads: int) -> dict:
    """The core clock (GHz), the f32 (GFLOP/s) and int8 (Gop/s) peaks of ``target``'s instructions on
    ``threads`` cores, and under "reads" [(level, bytes it holds, GB/s)] from L1 to DRAM, measured now
    (``ggraph.bench.peaks``). A roof must bound every op from above, and on a shared machine a
    neighbour seldom leaves every core free at once: so each peak and each read bandwidth is one
    core's fastest times ``threads`` (or all the cores' together, if that is faster)."""
    from ggraph.bench import peaks
    one = peaks.measure(target, 1)
    out = {k: v if k == "ghz" else v * threads for k, v in one.items()}
    reads = peaks.read_levels(target, 1)
    if threads > 1:                 # a shared level (L3, DRAM) may not scale with the cores: the bound is loose there
        sizes = peaks.cache_sizes()
        together = {name: gb_s for name, _, gb_s in peaks.read_levels(target, threads)}
        reads = [(name, holds * threads if sizes.get(name, (0, False))[1] else holds,
                  max(gb_s * threads, together[name])) for name, holds, gb_s in reads]
    # data a smaller level holds is never slower to read than from a larger one
    out["reads"] = [(name, holds, max(g for _, _, g in reads[k:])) for k, (name, holds, _) in enumerate(reads)]
    return out


def op_kind(eqn) -> str:
    """How a profile groups eqns: qmatmul by weight type, fused loops together, others by name."""
    if eqn is None:
        return "?"
    if eqn.prim is qmatmul_p:
        return f"qmatmul {eqn.inputs[1].aval.dtype}"
    if eqn.prim is qmatmul_experts_p:
        return f"{EXPERTS} {eqn.inputs[1].aval.dtype}"
    return eqn.prim.name


def _eqn_seconds(profile) -> dict[int, list]:
    """{id(eqn): [eqn, seconds]} of one run's (call, seconds) profile."""
    per_eqn: dict[int, list] = {}
    for call, seconds in profile:
        per_eqn.setdefault(id(call.eqn), [call.eqn, 0.0])[1] += seconds
    return per_eqn


IDLE = "barrier/idle"                # the profile row of the time threads spent waiting for each other
EXPERTS = "experts"                  # the profile rows of the expert-indexed matmuls (qmatmul_experts), by weight type
# what a profile says of their bytes, under its tables
EXPERT_BYTES = ("experts: bytes count the chosen experts' weights only, as min(E, T*k) distinct experts a step "
                "(the routing is not known before the step runs), plus activations, ids and outputs")


def profile_rows(runs, dims: dict, bandwidth: float, peaks: dict, core_hz: float = 0.0) -> dict[str, list[dict]]:
    """Time, bytes and flops per op kind and per layer, from one or more runs of the same step,
    each a ((call, seconds) profile, seconds idle at barriers) pair: each equation counts its
    fastest run, so one preempted call on a shared machine does not pass for a slow kernel, and
    the waiting has a row of its own in both tables (its fastest run too). ``core_hz`` (the
    team's cores times their clock) turns rates into operations per core cycle."""
    per_eqn: dict[int, list] = {}
    for profile, _ in runs:
        for key, (eqn, seconds) in _eqn_seconds(profile).items():
            per_eqn[key] = [eqn, min(seconds, per_eqn[key][1])] if key in per_eqn else [eqn, seconds]
    groups = {"op": {}, "layer": {}}
    for eqn, seconds in per_eqn.values():
        flops, nbytes = eqn.cost(dims) if eqn is not None else (0, 0)
        bound = eqn_bound(eqn, dims, bandwidth, peaks) if eqn is not None else 0.0   # each op at its own limit
        layer = ".".join(eqn.scope.split(".")[:2]) if eqn is not None and eqn.scope.startswith("blk.") \
            else (eqn.scope.split(".")[0] if eqn is not None and eqn.scope else "top")
        for by, key in (("op", op_kind(eqn)), ("layer", layer)):
            row = groups[by].setdefault(key, {"name": key, "calls": 0, "seconds": 0.0, "bytes": 0.0, "flops": 0.0,
                                              "bound": 0.0})
            row["calls"] += 1
            row["seconds"] += seconds
            row["bytes"] += nbytes
            row["flops"] += flops
            row["bound"] += bound
    idle = min(i for _, i in runs)
    for rows in groups.values():
        rows[IDLE] = {"name": IDLE, "calls": len(runs[0][0]), "seconds": idle, "bytes": 0.0, "flops": 0.0, "bound": 0.0}
    total = sum(s for _, s in per_eqn.values()) + idle or 1.0
    out = {}
    for by, rows in groups.items():
        listed = sorted(rows.values(), key=lambda r: -r["seconds"])
        for r in listed:
            r["share"] = r["seconds"] / total
            r["gb_s"] = r["bytes"] / r["seconds"] / 1e9 if r["seconds"] else 0.0
            r["gflop_s"] = r["flops"] / r["seconds"] / 1e9 if r["seconds"] else 0.0
            r["ops_cycle"] = r["flops"] / r["seconds"] / core_hz if r["seconds"] and core_hz else 0.0
            r["roofline"] = r.pop("bound") / r["seconds"] if r["seconds"] else 0.0     # 1.0 = at the limit
        out[by] = listed
    return out


def _bound(kind: str, flops: float, nbytes: float, bandwidth: float, peaks: dict, tokens: int,
           cached: float = 0.0, cache_gb_s: float = 0.0) -> float:
    """The least time an op of this kind can take: its bytes at the measured bandwidth (``cached`` of
    them at ``cache_gb_s``), or its flops at the peak (int8 for quantised matmuls, the AMX tiles' where
    they take the matmul), whichever is longer."""
    memory = (nbytes - cached) / (bandwidth * 1e9) + (cached / (cache_gb_s * 1e9) if cached else 0.0)
    return max(memory, flops / (_peak(kind, peaks, tokens) * 1e9))


def activation_bytes(eqn, dims: dict, outputs: bool = True) -> float:
    """The bytes of ``eqn``'s inputs (and outputs) that are not weights: activations, caches, ids."""
    total = 0.0
    for v in list(eqn.inputs) + (list(eqn.outputs) if outputs else []):
        aval = getattr(v, "aval", None)
        if aval is None or isinstance(aval, ParamAval):
            continue
        total += aval.nbytes({**{s: 1 for s in aval.symbols}, **dims})
    return total


def eqn_bound(eqn, dims: dict, bandwidth: float, peaks: dict) -> float:
    """The least time ``eqn`` can take at ``dims``. Weights stream at ``bandwidth`` (DRAM: a step's
    weights do not fit the caches). The rest (activations, caches), when the smallest cache level that
    holds all of it is not DRAM (``peaks["reads"]``), may still sit there from the op that wrote it:
    then its reads go at that level's read bandwidth and its writes overlap them (a core loads and
    stores in the same cycle), so only the reads count."""
    flops, nbytes = eqn.cost(dims)
    kind, tokens = op_kind(eqn), dims.get("T", 1)
    acts = min(nbytes, activation_bytes(eqn, dims)) if peaks.get("reads") else 0.0
    level = next((gb_s for _, holds, gb_s in peaks.get("reads", ()) if acts <= holds), None)
    if not acts or level is None or acts > peaks["reads"][-2][1]:
        return _bound(kind, flops, nbytes, bandwidth, peaks, tokens)
    reads = min(acts, activation_bytes(eqn, dims, outputs=False))
    return _bound(kind, flops, nbytes - acts + reads, bandwidth, peaks, tokens, reads, max(level, bandwidth))


def _peak(kind: str, peaks: dict, tokens: int) -> float:
    if kind.startswith(EXPERTS):                 # the decode dot or the gemm, never the AMX tiles
        return peaks["f32"] if kind.split()[-1] in ("f32", "f16", "bf16") else peaks["int8"]
    if not kind.startswith("qmatmul") or "f32" in kind:
        return peaks["f32"]
    from ggraph.backends.llvm.kernels import amx
    if "tiles" in peaks and tokens >= amx.MIN_T and amx.on_tiles(kind.split()[-1]):
        return peaks["tiles"]
    return peaks["int8"]


def step_bound(program, dims: dict, bandwidth: float, peaks: dict) -> float:
    """Seconds a step of ``program`` at ``dims`` (T, P) takes at the roofline: every op at its limit."""
    total = 0.0
    for eqn in program.graph.eqns:
        total += eqn_bound(eqn, dims, bandwidth, peaks)
    return total


def roofline_limits(session, pp: int, tg: int, depth: int, bandwidth: float, peaks: dict) -> dict:
    """The fastest prefill and decode (tok/s) this machine allows for a bench configuration: the
    prefill's ubatch steps and the decode steps from ``depth`` (as timed), each op at its roofline.
    The same work bounds any engine on the same file, llama.cpp included."""
    from ggraph.runtime.session import UBATCH
    ubatch = getattr(session, "ubatch", UBATCH)
    prog = session.program(last_only=True)
    pre = sum(step_bound(prog, {"T": min(ubatch, pp - at), "P": depth + at}, bandwidth, peaks)
              for at in range(0, pp, ubatch))
    dec = sum(step_bound(prog, {"T": 1, "P": depth + i}, bandwidth, peaks) for i in range(tg))
    return {"pp_limit_tok_s": pp / pre if pre else 0.0, "tg_limit_tok_s": tg / dec if dec else 0.0}


def round_bytes(session, pp: int, tg: int, depth: int) -> int:
    """The bytes one engine's bench round reads, by the ops' own counts: the prefill's ubatch steps
    and the ``tg`` decode steps from ``depth`` (weights once a step, and the caches)."""
    from ggraph.runtime.session import UBATCH
    ubatch = getattr(session, "ubatch", UBATCH)
    prog = session.program(last_only=True)
    steps = [{"T": min(ubatch, pp - at), "P": depth + at} for at in range(0, pp, ubatch)]
    steps += [{"T": 1, "P": depth + i} for i in range(tg)]
    return int(sum(eqn.cost(dims)[1] for dims in steps for eqn in prog.graph.eqns))


DECODE_PROFILE_STEPS = 5           # decode steps profiled; each op counts its fastest


def profile_ggraph(path, pp: int = 64, threads: int = 1, passes="default", ctx: int | None = None,
                   disabled=(), ubatch: int | None = None, depth: int = 0) -> dict:
    """Per-op and per-layer time for one prefill of ``pp`` tokens after ``depth`` tokens already in
    the cache (its last ubatch, when it takes several: "prefill_step" says which) and the fastest
    of a few decode steps after it, op by op."""
    from ggraph.backends.llvm.codegen import barriers_needed
    from ggraph.runtime.session import UBATCH, Session
    s = Session(path, backend="llvm", threads=threads, passes=passes, ctx=ctx or max(depth + pp + 8, 64),
                profile=True, disabled=disabled, ubatch=ubatch or UBATCH)
    prog = s.program(last_only=True)
    peaks = machine_peaks(prog.target, threads)
    bandwidth = peaks["reads"][-1][2]                      # DRAM's, read by the same loop as the caches'
    core_hz = threads * peaks["ghz"] * 1e9
    ids = prompt_tokens(depth + pp, s.config.n_vocab)
    s.step(ids[depth:])                                      # warm: page in the weights
    s.reset()
    if depth:
        s.step(ids[:depth])
    s.step(ids[depth:])
    last = (pp - 1) // s.ubatch * s.ubatch                   # a long prompt runs in ubatches: the last one is timed
    step = {"T": pp - last, "P": depth + last}
    prefill = profile_rows([(prog.last_profile, prog.last_idle)], step, bandwidth, peaks, core_hz)
    steps = []
    for _ in range(DECODE_PROFILE_STEPS):
        s.step([ids[0]])
        steps.append((prog.last_profile, prog.last_idle))
    decode = profile_rows(steps, {"T": 1, "P": depth + pp}, bandwidth, peaks, core_hz)
    return {"roofline": {"bandwidth_gb_s": bandwidth, "peak_gflop_s": peaks["f32"], "peak_int8_gop_s": peaks["int8"],
                         "reads": [{"level": name, "holds_bytes": None if name == "DRAM" else int(holds), "gb_s": gb_s}
                                   for name, holds, gb_s in peaks["reads"]],
                         "target": prog.target.name, "threads": threads, "ghz": core_hz / threads / 1e9,
                         "peak_int8_ops_cycle": peaks["int8"] * 1e9 / core_hz, "peak_f32_ops_cycle": peaks["f32"] * 1e9 / core_hz,
                         **({"peak_tiles_gop_s": peaks["tiles"], "peak_tiles_ops_cycle": peaks["tiles"] * 1e9 / core_hz}
                            if "tiles" in peaks else {})},
            "prefill": prefill, "decode": decode, "prefill_step": step,
            "calls": len(prog.spec.calls), "barriers": sum(barriers_needed(prog.spec.calls))}


ROOF_NOISE = 0.1                   # how far over 100% of its roof an op may read from timing noise alone


def roofline_note(roof: dict) -> str:
    """One line on the memory roofs of a profile: DRAM for weights, each cache level for the rest."""
    from ggraph.units import fmt_bytes
    levels = ", ".join(f"{r['level']} ({fmt_bytes(r['holds_bytes'])}) {r['gb_s']:.0f}" for r in roof["reads"][:-1])
    return (f"memory roofs: weights at {roof['bandwidth_gb_s']:.1f} GB/s (DRAM); activations and caches at the read "
            f"bandwidth of the smallest cache that holds an op's data: {levels} GB/s (writes overlap the reads), "
            f"else DRAM's; timing noise can put an op up to {ROOF_NOISE:.0%} over its roof")


def profile_table(title: str, rows: list[dict]) -> str:
    lines = [title, f"  {'':<18} {'calls':>5} {'ms':>8} {'share':>6} {'GB/s':>7} {'GFLOP/s':>8} {'op/cyc':>6} "
                    f"{'of roofline':>11}"]
    for r in rows:
        rates = (f"{'-':>7} {'-':>8} {'-':>6} {'-':>11}" if r["name"] == IDLE else
                 f"{r['gb_s']:>7.1f} {r['gflop_s']:>8.1f} {r.get('ops_cycle', 0.0):>6.1f} {r['roofline']:>10.0%}")
        lines.append(f"  {r['name']:<18} {r['calls']:>5} {r['seconds'] * 1e3:>8.3f} {r['share']:>6.1%} {rates}")
    if any(r["name"].startswith(EXPERTS) for r in rows):
        lines.append(f"  ({EXPERT_BYTES})")
    return "\n".join(lines)
