"""``ggraph bench``: prefill and decode tok/s (at a depth), pipelines compared, llama.cpp side by side, profiles;
``--memory``: planned and resident memory against context length."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from ggraph.cli.common import (add_force_arg, add_memory_arg, add_model_arg, check_output, model_path,
                               resolved_passes)

NAMED_PASSES = {"fused": "default", "unfused": "none"}
FLASH_ATTN = {"on": [True], "off": [False], "both": [True, False]}       # --flash-attn: llama.cpp's -fa settings


def _int_list(text: str, what: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",")]      # an empty item ("1,,2", "") is a mistake too
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{what} must be integers of at least {minimum}, got {text!r}")
    return values


def _cache_type(text: str, what: str) -> str:
    from ggraph.runtime.session import CACHE_TYPES
    if text.lower() not in CACHE_TYPES:
        raise ValueError(f"{what} must be one of {', '.join(CACHE_TYPES)}, got {text!r}")
    return text.lower()


def _flash_attn(args, cache_vs: list[str]) -> list[bool]:
    """llama.cpp's flash attention settings to run. A quantised V cache needs it on: its -fa off rows are
    left out (said once), and asking for nothing else is an error."""
    from ggraph.bench.measure import LLAMA_NEEDS_FA
    settings = FLASH_ATTN[args.flash_attn]
    quantised = [v for v in cache_vs if v in LLAMA_NEEDS_FA]
    if args.vs_llama_cpp and quantised and False in settings:
        if settings == [False] and len(quantised) == len(cache_vs):
            raise ValueError(f"llama.cpp needs flash attention for a {quantised[0]} V cache: use --flash-attn on")
        from ggraph.progress import warn
        warn(f"llama.cpp needs flash attention for a {quantised[0]} V cache: no -fa off rows for it")
    return settings


def _ctx_arg(args, needed: int) -> int | None:
    """--ctx for a speed run (one length, at least the largest depth + pp + tg), or None when not given."""
    if args.ctx is None:
        return None
    ctx = _int_list(args.ctx, "--ctx")
    if len(ctx) > 1:
        raise ValueError(f"--ctx takes one context length when benchmarking speed, got {args.ctx!r}")
    if ctx[0] < needed:
        raise ValueError(f"--ctx {ctx[0]} is too small: the largest depth + pp + tg is {needed} tokens")
    return ctx[0]


def bench_context(ctx: int | None, path, needed: int) -> int:
    """The context of every bench run: ``ctx``, else depth + pp + tg (within the model's trained length)."""
    if ctx is not None:
        return ctx
    from ggraph.models import load
    trained = load(path).config.n_ctx_train
    if needed > trained:
        raise ValueError(f"depth + pp + tg is {needed} tokens, beyond the model's trained context of {trained}; "
                         f"give --ctx to run past it")
    return max(needed, 64)


def cmd_bench(args) -> int:
    """Measure prefill (pp) and decode (tg) tok/s, optionally at a depth and against llama.cpp on the same
    file; with --memory, planned and resident memory against context length instead."""
    from ggraph.backends.llvm.team import check_threads
    from ggraph.bench.measure import LLAMA_NEEDS_FA
    cluster = _cluster_args(args)
    path = None if cluster else model_path(args)                # on a cluster, each node resolves its own
    if args.plot:
        check_output(args.plot, args.force, "--plot")
    threads = _int_list(args.threads, "--threads")
    for t in threads if not cluster else ():                      # a node's cores are checked on the node
        check_threads(t)
    cache_k = _cache_type(args.cache_type_k, "--cache-type-k")
    cache_v = _cache_type(args.cache_type_v, "--cache-type-v")
    if args.vs_llama_cpp and not cluster and importlib.util.find_spec("llama_cpp") is None:
        raise ValueError("--vs-llama-cpp needs llama-cpp-python: pip install llama-cpp-python (see the README)")
    if args.memory:
        return cmd_memory(args, path, threads, cache_k, cache_v)
    if args.fill is not None or args.cache_types is not None:
        raise ValueError("--fill and --cache-types belong to --memory")
    pps = _int_list("64" if args.pp is None else args.pp, "--pp")
    tgs = _int_list("32" if args.tg is None else args.tg, "--tg", minimum=0)
    depths = _int_list(args.depth, "--depth", minimum=0)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if args.profile and args.backend != "llvm":
        raise ValueError("--profile times the native program: use --backend llvm")
    pipelines = [NAMED_PASSES.get(p, p) for p in (args.compare.split(",") if args.compare else [args.passes])]
    for pipe in pipelines:
        resolved_passes(args, pipe, "--compare" if args.compare else "--passes")   # checked before the slow part
    needed = max(depths) + max(pps) + max(tgs)
    fas = [fa for fa in _flash_attn(args, [cache_v]) if fa or cache_v not in LLAMA_NEEDS_FA]
    if cluster:
        from ggraph.cluster.bench import Sweep
        sweep = Sweep(models=cluster["models"], threads=tuple(threads), depths=tuple(depths), pps=tuple(pps),
                      tgs=tuple(tgs), pipelines=tuple(pipelines), targets=cluster["targets"], repeats=args.repeats,
                      ctx=_ctx_arg(args, needed), cache_k=cache_k, cache_v=cache_v, backend=args.backend,
                      disabled=tuple(args.no_pass), max_memory=args.max_memory, vs_llama_cpp=args.vs_llama_cpp,
                      flash_attn=tuple(fas), roofline=args.roofline)
        return cmd_cluster(args, sweep, cluster["nodes"])
    ctx = bench_context(_ctx_arg(args, needed), path, needed)
    results = bench_speed(args, path, threads, depths, pps, tgs, pipelines, ctx, cache_k, cache_v, fas)
    if args.profile:
        from ggraph import bench
        for pp, t, d, pipe in sorted({(pp, t, d, p) for pp in pps for t in threads for d in depths for p in pipelines}):
            prof = bench.profile_ggraph(path, pp, t, passes=pipe, disabled=args.no_pass, depth=d)
            for r in results:
                if r["engine"] == "ggraph" and (r["pp"], r["threads"], r["passes"], r["depth"]) == (pp, t, pipe, d):
                    r["profile"], r["roofline"] = prof, prof["roofline"]
    if not _print_rows(args, results):
        print(bench_table(results))
        if args.roofline:
            print(roofline_table(results))
        for r in results:
            if "profile" in r:
                print(profile_report(r))
    if args.plot:                                      # after the rows: a failing plot loses no measurements
        from ggraph.bench.plot import plot_results
        print(f"wrote {plot_results(results, args.plot)}", file=sys.stderr)
    return 0


def _cluster_args(args) -> dict | None:
    """--cluster's models, nodes and feature sets (None without --cluster); its flags refused without it,
    and the modes it does not run refused with it."""
    if args.cluster is None:
        given = [f for f, v in (("--nodes", args.nodes), ("--targets", args.targets), ("--models", args.models)) if v]
        if given:
            raise ValueError(f"{', '.join(given)} need{'s' * (len(given) == 1)} --cluster ADDRESS")
        return None
    for flag, given in (("--memory", args.memory), ("--profile", args.profile)):
        if given:
            raise ValueError(f"{flag} does not run on --cluster: run it on the node itself")
    from ggraph.cluster.bench import DEMO, require_ray
    require_ray()                                            # one line saying how to install it, before any work
    models = ([DEMO] if args.demo else [args.model] if args.model else []) + _items(args.models, "--models")
    if not models:
        raise ValueError("give a MODEL path, --models or --demo: each node reads it as its own path")
    targets = _items(args.targets, "--targets")
    if targets:
        from ggraph.backends.llvm.target import NAMES
        unknown = [t for t in targets if t not in NAMES]
        if unknown:
            raise ValueError(f"--targets {unknown[0]}: not a feature set (known: {', '.join(NAMES)})")
    return {"models": tuple(models), "nodes": _items(args.nodes, "--nodes") or None,
            "targets": tuple(targets) or (None,)}


def _items(text: str | None, flag: str) -> list[str]:
    """A comma list; an empty item is a mistake."""
    if text is None:
        return []
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise ValueError(f"{flag} must be a comma-separated list without empty items, got {text!r}")
    return items


def cmd_cluster(args, sweep, nodes: list[str] | None) -> int:
    """The sweep on the cluster: each run's rows on stderr as it finishes, then the table (or --json/--csv) of
    them all and the nodes that failed; 1 when any failed, 130 on Ctrl-C (after the rows so far)."""
    from ggraph.cluster.bench import Failure, bench_sweep
    rows, failures, interrupted = [], [], False
    events = bench_sweep(args.cluster, sweep, nodes)
    try:
        for event in events:
            if isinstance(event, Failure):
                failures.append(event)
                print(f"failed: {event}", file=sys.stderr)
                continue
            for r in event:
                rows.append(r)
                print(f"[{len(rows)}] {cluster_line(r)}", file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        events.close()                                   # cancels what is still queued or running
    if interrupted:
        print("interrupted: the sweep's remaining tasks were cancelled", file=sys.stderr)
    if rows and not _print_rows(args, rows):
        models = list(dict.fromkeys(r["model"] for r in rows))    # a table per file: ratios within one model
        for m in models:
            print((f"{m}:\n" if len(models) > 1 else "") + cluster_table([r for r in rows if r["model"] == m]))
        if args.roofline:
            for node in dict.fromkeys(r["node"] for r in rows):
                print(f"\n{node}:" + roofline_table([r for r in rows if r["node"] == node]))
    for f in failures:
        print(f"ggraph bench: node {f}", file=sys.stderr)
    if args.plot and rows:
        from ggraph.cluster.plot import plot_nodes
        print(f"wrote {plot_nodes(rows, args.plot)}", file=sys.stderr)
    sys.stdout.flush()
    return 130 if interrupted else 1 if failures or not rows else 0


def cluster_line(r: dict) -> str:
    """One row as it arrives: where it ran and what it measured."""
    run = r["passes"] or (f"fa {r['flash_attn']}" if r["flash_attn"] else "")
    speeds = "".join(f", {n} {r[n]}: {r[n + '_tok_s']:.1f} tok/s" for n in ("pp", "tg") if r[n])
    return f"{r['node']} ({r['cpu']}, {r['target']}): {r['engine']} {run} {r['model']} {r['threads']}t " \
           f"depth {r['depth']}{speeds}"


def cluster_table(rows: list[dict]) -> str:
    """``bench_table`` with the node and feature set in front (ratios: to the first row of each configuration,
    across nodes), then which CPU each node is."""
    lines = bench_table(rows).splitlines()
    width = max(len("node"), *(len(r["node"]) for r in rows))
    out = [f"{'node':<{width}} {'target':<12} {lines[0]}"]
    out += [f"{r['node']:<{width}} {r['target']:<12} {line}" for r, line in zip(rows, lines[1:])]
    out.append("")
    for node, r in {r["node"]: r for r in rows}.items():
        out.append(f"{node}: {r['cpu']} (LLVM: {r['llvm_cpu']}), {r['hostname']} {r['node_ip']}")
    return "\n".join(out)


def bench_speed(args, path, threads, depths, pps, tgs, pipelines, ctx, cache_k, cache_v, fas) -> list[dict]:
    """Every (threads, depth, pp, tg) configuration: ggraph per pipeline, then llama.cpp per flash attention
    setting, loaded once per thread count, their rounds alternating."""
    from ggraph.progress import Progress
    results = []
    with Progress(len(threads) * len(depths) * len(pps) * len(tgs), "benchmarking", stream=sys.stderr) as bar:
        for t in threads:
            for rows in thread_rows(path, t, depths, pps, tgs, pipelines, ctx, cache_k, cache_v, fas,
                                    backend=args.backend, disabled=args.no_pass, max_memory=args.max_memory,
                                    vs_llama_cpp=args.vs_llama_cpp, roofline=args.roofline, repeats=args.repeats):
                results += rows
                bar.advance()
    return results


def thread_rows(path, t, depths, pps, tgs, pipelines, ctx, cache_k, cache_v, fas, *, backend, disabled,
                max_memory, vs_llama_cpp, roofline, repeats):
    """The rows of each (depth, pp, tg) configuration at ``t`` threads, one list (an engine each) at a time:
    the engines loaded once, and with ``roofline`` the peaks measured once and the bandwidth every round."""
    from ggraph.bench.measure import (GGraphRunner, LlamaCppRunner, StreamRunner, bench_side_by_side, round_bytes,
                                      roofline_limits)
    runners = []
    try:
        for pipe in pipelines:
            runners.append(GGraphRunner(path, t, ctx, backend, pipe, cache_k, cache_v, disabled, max_memory))
        for fa in fas if vs_llama_cpp else ():
            runners.append(LlamaCppRunner(path, t, ctx, cache_k, cache_v, fa))
        roof = _machine_peaks(runners[0], t) if roofline else None
        stream = StreamRunner(t) if roof else None
        for depth in depths:
            for pp in pps:
                for tg in tgs:
                    nbytes = round_bytes(runners[0].session, pp, tg, depth) if stream else 0
                    rows = [r.row() for r in bench_side_by_side(runners, pp, tg, depth, repeats, stream, nbytes)]
                    if roof:
                        limits = roofline_limits(runners[0].session, pp, tg, depth, stream.best, roof["peaks"])
                        for r in rows:
                            r.update(limits, bandwidth_gb_s=stream.best, peak_int8_gop_s=roof["peaks"]["int8"],
                                     peak_tiles_gop_s=roof["peaks"].get("tiles"),
                                     peak_gflop_s=roof["peaks"]["f32"], limit_target=roof["target"])
                    yield rows
    finally:
        for r in runners:
            r.close()


def cmd_memory(args, path, threads, cache_k, cache_v) -> int:
    """Planned and resident memory per context length and cache type, each point in a fresh process."""
    from ggraph.bench.memory import memory_curve, memory_points, memory_table
    from ggraph.progress import Progress
    unused = [flag for flag, given in (("--pp", args.pp), ("--tg", args.tg), ("--depth", args.depth != "0"),
                                       ("--compare", args.compare), ("--profile", args.profile),
                                       ("--roofline", args.roofline)) if given]
    if unused:
        raise ValueError(f"--memory measures memory, not speed: {', '.join(unused)} do not apply")
    if len(threads) > 1:
        raise ValueError(f"--memory takes one --threads value, got {args.threads!r}")
    ctxs = _int_list("512,4096" if args.ctx is None else args.ctx, "--ctx")
    types = [(_cache_type(t, "--cache-types"),) * 2 for t in args.cache_types.split(",")] if args.cache_types \
        else [(cache_k, cache_v)]
    if args.fill is not None and args.fill < 1:
        raise ValueError(f"--fill must be at least 1 token, got {args.fill}")
    points = memory_points(ctxs, types, args.vs_llama_cpp, _flash_attn(args, [v for _, v in types]))
    with Progress(len(points), "measuring memory", unit=" points", stream=sys.stderr) as bar:
        rows = memory_curve(path, points, args.fill, threads[0], bar, args.max_memory)
    if not _print_rows(args, rows):                     # the measurements first: a plot that fails loses nothing
        print(memory_table(rows))
    sys.stdout.flush()
    if args.plot:
        from ggraph.bench.plot import plot_memory
        print(f"wrote {plot_memory(rows, args.plot, model=path, threads=threads[0])}", file=sys.stderr)
    return 0


def _print_rows(args, rows: list[dict]) -> bool:
    """Print ``rows`` as --json or --csv asked (nested fields flattened with dots); False when neither was."""
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else {"results": rows}, indent=1))
        return True
    if args.csv:
        flat = [_flatten(r) for r in rows]
        keys = list(dict.fromkeys(k for r in flat for k in r))
        print(",".join(keys))
        for r in flat:
            print(",".join(str(r.get(k, "")) for k in keys))
        return True
    return False


def _flatten(row: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif k not in ("profile", "roofline"):
            out[prefix + k] = v
    return out


def _machine_peaks(runner, threads: int) -> dict:
    """The compute peaks of the feature set the ggraph program was built for, at ``threads`` threads,
    measured now (the memory bandwidth is measured in each configuration's rounds, beside the engines)."""
    from ggraph.backends.llvm.target import host_target
    from ggraph.bench.measure import machine_peaks
    target = getattr(runner.session.program(last_only=True), "target", None) or host_target()
    return {"peaks": machine_peaks(target, threads), "target": target.name}


def _tiles(roof: dict) -> str:
    """', 7141 Gop/s on AMX tiles' where the run measured a tile peak (prefill of super-block types)."""
    return f", {roof['peak_tiles_gop_s']:.0f} Gop/s on AMX tiles" if roof.get("peak_tiles_gop_s") else ""


def roofline_table(results: list[dict]) -> str:
    """Each result as a fraction of the fastest its machine allows (``--roofline``)."""
    lines = []
    for t in dict.fromkeys(r["threads"] for r in results):
        first = next(r for r in results if r["threads"] == t)
        lines.append(f"\nroofline at {t} thread{'s' * (t != 1)}: {first['peak_int8_gop_s']:.0f} Gop/s int8{_tiles(first)} "
                     f"and {first['peak_gflop_s']:.0f} GFLOP/s f32 ({first['limit_target']}), and memory bandwidth "
                     f"(GB/s: the best of the rounds that read as many bytes as an engine's round, alternating with "
                     f"them), all measured in this run; limit = every op of the step at its bound")
        lines.append(f"{'engine':<10} {'passes':<8} {'fa':>3} {'depth':>6} {'GB/s':>5} {'pp':>5} {'limit tok/s':>11} "
                     f"{'of limit':>8} {'tg':>4} {'limit tok/s':>11} {'of limit':>8}")
        for r in (r for r in results if r["threads"] == t):
            pp = (f"{r['pp_limit_tok_s']:>11.1f} {r['pp_tok_s'] / r['pp_limit_tok_s']:>8.0%}" if r["pp"]
                  else f"{'-':>11} {'-':>8}")
            tg = (f"{r['tg_limit_tok_s']:>11.1f} {r['tg_tok_s'] / r['tg_limit_tok_s']:>8.0%}" if r["tg"]
                  else f"{'-':>11} {'-':>8}")
            lines.append(f"{r['engine']:<10} {r.get('passes') or '-':<8} {r.get('flash_attn') or '-':>3} "
                         f"{r['depth']:>6} {r['bandwidth_gb_s']:>5.1f} {r['pp']:>5} {pp} {r['tg']:>4} {tg}")
    return "\n".join(lines)


def profile_report(r: dict) -> str:
    """Per-op and per-layer tables of one profiled configuration, against the roofline."""
    from ggraph.bench import profile_table
    from ggraph.bench.measure import DECODE_PROFILE_STEPS, IDLE
    roof = r["roofline"]
    head = (f"\nprofile: {r['passes']} pipeline, {roof['threads']} thread(s), {roof['target']}; roofline: "
            f"{roof['bandwidth_gb_s']:.1f} GB/s, {roof['peak_gflop_s']:.0f} GFLOP/s f32 and "
            f"{roof['peak_int8_gop_s']:.0f} Gop/s int8{_tiles(roof)} peak, measured in this run ('of roofline' = the time the "
            f"limit allows / the time taken)")
    if "reads" in roof:
        from ggraph.bench.measure import roofline_note
        head += "\n" + roofline_note(roof)
    if "ghz" in roof:
        head += (f"\n'op/cyc': operations (a multiply-add is 2) per core per cycle at {roof['ghz']:.2f} GHz (measured); "
                 f"the peaks are {roof['peak_f32_ops_cycle']:.0f} f32 and {roof['peak_int8_ops_cycle']:.0f} int8"
                 + (f" ({roof['peak_tiles_ops_cycle']:.0f} on AMX tiles)" if "peak_tiles_ops_cycle" in roof else ""))
    if "calls" in r["profile"]:
        head += (f"\n{r['profile']['calls']} kernel calls and {r['profile']['barriers']} barriers a step (profiling puts "
                 f"a barrier after every call; '{IDLE}' is the threads' mean time waiting at them)")
    parts = [head]
    depth = r.get("depth", 0)
    first = r["profile"].get("prefill_step", {"T": r["pp"], "P": depth})
    whole = f"prefill of {r['pp']} tokens" + (f" at depth {depth}" if depth else "") + \
        ("" if first["T"] == r["pp"] else f", its last ubatch ({first['T']} tokens at P={first['P']})")
    fastest = f"decode at P={depth + r['pp']}, each op's fastest of {DECODE_PROFILE_STEPS} steps"
    for step, label in (("prefill", whole), ("decode", fastest)):
        parts.append(profile_table(f"{label}, by op:", r["profile"][step]["op"]))
        parts.append(profile_table(f"{label}, by layer:", r["profile"][step]["layer"]))
    return "\n".join(parts)


def _rate(n: int, tok_s: float, ref: float, width: int) -> str:
    """tok/s and its ratio to the reference row's; dashes where nothing of the kind was timed (-p 0, -n 0)."""
    if not n or not ref:
        return f"{'-':>{width}} {'-':>6}"
    return f"{tok_s:>{width}.1f} {tok_s / ref:>5.2f}x"


def bench_table(results: list[dict]) -> str:
    """A table of tok/s per configuration, with each row's ratio to the first row of its configuration."""
    lines = [f"{'engine':<10} {'passes':<8} {'threads':>7} {'fa':>3} {'K/V':<10} {'depth':>6} {'pp':>5} "
             f"{'pp tok/s':>10} {'ratio':>6} {'tg':>4} {'tg tok/s':>9} {'ratio':>6}"]
    from ggraph.bench.plot import configuration
    base: dict[tuple, dict] = {}
    for r in results:
        ref = base.setdefault(configuration(r), r)
        lines.append(f"{r['engine']:<10} {r['passes'] or '-':<8} {r['threads']:>7} {r['flash_attn'] or '-':>3} "
                     f"{r['cache_k'] + '/' + r['cache_v']:<10} {r['depth']:>6} {r['pp']:>5} "
                     f"{_rate(r['pp'], r['pp_tok_s'], ref['pp_tok_s'], 10)} "
                     f"{r['tg']:>4} {_rate(r['tg'], r['tg_tok_s'], ref['tg_tok_s'], 9)}")
    return "\n".join(lines)


EPILOG = """\
examples: ggraph bench --demo --pp 64 --tg 32 -t 2 --json
          ggraph bench --demo -p 64,512 -n 64 -t 1,2 --compare fused,unfused --vs-llama-cpp
          ggraph bench --demo -p 512 -n 32 -d 0,4096,16384 -ctk q8_0 -ctv q8_0 --vs-llama-cpp
          ggraph bench --demo -p 512 -n 32 -t 2 --vs-llama-cpp --roofline
          ggraph bench --demo -p 64 -n 8 -d 4096 -t 2 --profile
          ggraph bench --memory --demo --ctx 512,4096,32768 --cache-types f16,q8_0 --vs-llama-cpp --plot mem.png
          ggraph bench '~/models/llama-1b.gguf' --cluster ray://head:10001 -t 1,2 --targets avx2,avx512_vnni

At a depth (-d N), N tokens are prefilled untimed, then a prefill of pp tokens is timed at P=N
and tg decode steps are timed after the same N tokens, as llama-bench -d does.

--memory runs every point in a fresh process: planned bytes (weights, KV cache, the activations
of one 512-token ubatch at a full context) beside the RSS after loading and the peak RSS after
filling the context. ggraph's cache pages become resident as rows are written, so a partial
--fill shows only the rows filled; llama.cpp zeroes its KV buffer when it makes the context, so
all of its cache is resident from the start.

--cluster runs each (node, model, feature set, thread count) as a Ray task holding all of its node's
CPUs, so no two benchmarks share a node; each run's rows come back (on stderr) as it finishes, then
the table has them all, with the node, its CPU and the feature set it compiled for. A node that lacks
the file or cannot run a set is named on stderr and the exit status is 1; Ctrl-C cancels what is
left and prints the rows so far (exit status 130)."""


def add_parser(sub, parents) -> None:
    p = sub.add_parser("bench", help="measure prefill and decode speed, or memory against context length",
                       description=cmd_bench.__doc__, parents=parents, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(p)
    p.add_argument("-p", "--pp", default=None, help="prompt tokens per prefill; a comma list sweeps (default 64)")
    p.add_argument("-n", "--tg", default=None, help="decode steps; a comma list sweeps (default 32)")
    p.add_argument("-d", "--depth", default="0",
                   help="tokens already in the KV cache before the timed prefill and decode; a comma list sweeps "
                        "(default 0)")
    p.add_argument("-t", "--threads", default="1", help="threads; a comma list sweeps (default 1)")
    p.add_argument("--ctx", "-c", default=None,
                   help="context length (default: depth + pp + tg); with --memory, the comma list of context "
                        "lengths to measure (default 512,4096)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", metavar="TYPE",
                   help="K cache type: f32, f16, bf16, q8_0 or q4_0 (default f16), for ggraph and llama.cpp")
    p.add_argument("-ctv", "--cache-type-v", default="f16", metavar="TYPE", help="V cache type (default f16)")
    p.add_argument("--backend", choices=["numpy", "llvm"], default="llvm", help="backend (default llvm)")
    pipelines = p.add_mutually_exclusive_group()
    pipelines.add_argument("--passes", default="default", help="pipeline: default, none, or pass,pass,...")
    pipelines.add_argument("--compare", help="comma list of pipelines to compare, e.g. fused,unfused")
    p.add_argument("--no-pass", action="append", default=[], metavar="NAME",
                   help="switch off one pass in every pipeline (repeatable)")
    p.add_argument("--vs-llama-cpp", action="store_true",
                   help="also run llama.cpp (llama-cpp-python) on the same file, depth and cache types")
    p.add_argument("--flash-attn", choices=["on", "off", "both"], default="both",
                   help="llama.cpp's flash attention: -fa 1, -fa 0 or a row of each (default both; a quantised V "
                        "cache needs it on)")
    p.add_argument("--repeats", type=int, default=3, help="best of this many rounds (default 3)")
    p.add_argument("--memory", action="store_true",
                   help="measure memory instead of speed: planned and resident (RSS) per --ctx and cache type")
    p.add_argument("--cache-types", metavar="LIST", default=None,
                   help="with --memory: comma list of cache types, each for K and V (default: -ctk/-ctv)")
    p.add_argument("--fill", type=int, default=None, metavar="N",
                   help="with --memory: prompt tokens to prefill (default: the whole context minus 4 decode steps)")
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--json", action="store_true", help="print JSON (one object for one configuration)")
    rows.add_argument("--csv", action="store_true", help="print CSV rows")
    p.add_argument("--roofline", action="store_true",
                   help="measure this run's compute peaks, and its memory bandwidth in every round beside the "
                        "engines, and show every result (ggraph and llama.cpp) as a fraction of the fastest the "
                        "machine allows for that work")
    p.add_argument("--profile", action="store_true",
                   help="time every op inside the native program, per op kind and per layer, against the roofline")
    from ggraph.bench.plot import plot_path
    p.add_argument("--plot", metavar="FILE.png", type=plot_path,
                   help="also draw tok/s bars with ratios (and a roofline with a profile); with --memory, bytes "
                        "against context length")
    fleet = p.add_argument_group("on a Ray cluster (pip install 'ggraph[cluster]'; see the README's \"Beyond one "
                                 "machine\")")
    fleet.add_argument("--cluster", metavar="ADDRESS",
                       help="run the sweep as Ray tasks on the cluster at ADDRESS (auto, HOST:PORT or "
                            "ray://HOST:PORT), one whole node per benchmark, each node compiling for its own CPU; "
                            "MODEL is read on each node (~ and $VARS expanded there)")
    fleet.add_argument("--nodes", metavar="LIST",
                       help="with --cluster: comma list of the nodes to use, each a custom resource name "
                            "(node_a), a label KEY=VALUE, an IP address, a hostname or a node id prefix "
                            "(default: every alive node)")
    fleet.add_argument("--targets", metavar="LIST",
                       help="with --cluster: comma list of feature sets (GGRAPH_TARGET) to sweep on each node, "
                            "e.g. avx2,avx512_vnni (default: each node's best)")
    fleet.add_argument("--models", metavar="LIST", help="with --cluster: more model paths to sweep (comma list)")
    add_force_arg(p)
    add_memory_arg(p)
    p.set_defaults(fn=cmd_bench)
