"""``ggraph bench``: prefill and decode tok/s, pipelines compared, llama.cpp side by side, profiles."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from ggraph.cli.common import add_memory_arg, add_model_arg, model_path, passes_arg, pipeline_names

NAMED_PASSES = {"fused": "default", "unfused": "none"}


def _int_list(text: str, what: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise ValueError(f"{what} must be integers of at least {minimum}, got {text!r}")
    return values


def cmd_bench(args) -> int:
    """Measure prefill (pp) and decode (tg) tok/s, optionally against llama.cpp on the same file."""
    from ggraph import bench
    from ggraph.progress import Progress
    from ggraph.backends.llvm.team import check_threads
    path = model_path(args)
    configs = [(pp, tg, t) for pp in _int_list(args.pp, "--pp") for tg in _int_list(args.tg, "--tg", minimum=0)
               for t in _int_list(args.threads, "--threads")]
    for _, _, t in configs:
        check_threads(t)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if args.profile and args.backend != "llvm":
        raise ValueError("--profile times the native program: use --backend llvm")
    if args.vs_llama_cpp and importlib.util.find_spec("llama_cpp") is None:
        raise ValueError("--vs-llama-cpp needs llama-cpp-python: pip install llama-cpp-python (see the README)")
    pipelines = [NAMED_PASSES.get(p, p) for p in (args.compare.split(",") if args.compare else [args.passes])]
    for pipe in pipelines:
        pipeline_names(args, pipe)                       # every argument checked before the slow part
    jobs = [("ggraph", c, p) for c in configs for p in pipelines]
    if args.vs_llama_cpp:
        jobs += [("llama.cpp", c, None) for c in configs]
    results = []
    with Progress(len(jobs), "benchmarking", stream=sys.stderr) as bar:
        for engine, (pp, tg, threads), pipe in jobs:
            if engine == "ggraph":
                r = bench.bench_ggraph(path, pp, tg, threads, backend=args.backend, passes=passes_arg(pipe),
                                       repeats=args.repeats, disabled=args.no_pass, max_memory=args.max_memory)
            else:
                r = bench.bench_llama_cpp(path, pp, tg, threads, repeats=args.repeats)
            results.append(r.row())
            bar.advance()
    if args.profile:
        for (pp, _, threads), pipe in {((c[0], 0, c[2]), p) for c in configs for p in pipelines}:
            prof = bench.profile_ggraph(path, pp, threads, passes=passes_arg(pipe), disabled=args.no_pass)
            for r in results:
                if r["engine"] == "ggraph" and (r["pp"], r["threads"], r["passes"]) == (pp, threads, pipe):
                    r["profile"], r["roofline"] = prof, prof["roofline"]
    if args.plot:
        from ggraph.bench.plot import plot_results
        print(f"wrote {plot_results(results, args.plot)}", file=sys.stderr)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else {"results": results}, indent=1))
        return 0
    if args.csv:
        keys = list(results[0])
        print(",".join(keys))
        for r in results:
            print(",".join(str(r[k]) for k in keys))
        return 0
    print(bench_table(results))
    for r in results:
        if "profile" in r:
            print(profile_report(r))
    return 0


def profile_report(r: dict) -> str:
    """Per-op and per-layer tables of one profiled configuration, against the roofline."""
    from ggraph.bench import profile_table
    roof = r["roofline"]
    head = (f"\nprofile: {r['passes']} pipeline, {roof['threads']} thread(s), {roof['target']}; roofline: "
            f"{roof['bandwidth_gb_s']:.1f} GB/s measured, {roof['peak_gflop_s']:.0f} GFLOP/s f32 and "
            f"{roof['peak_int8_gop_s']:.0f} Gop/s int8 peak ('of roofline' = the time the limit allows / the time taken)")
    parts = [head]
    for step, label in (("prefill", f"prefill of {r['pp']} tokens"), ("decode", "one decode step")):
        parts.append(profile_table(f"{label}, by op:", r["profile"][step]["op"]))
        parts.append(profile_table(f"{label}, by layer:", r["profile"][step]["layer"]))
    return "\n".join(parts)


def bench_table(results: list[dict]) -> str:
    """A table of tok/s per configuration, with each row's ratio to the first row of its config."""
    lines = [f"{'engine':<10} {'passes':<8} {'threads':>7} {'pp':>5} {'pp tok/s':>10} {'ratio':>6} "
             f"{'tg':>4} {'tg tok/s':>9} {'ratio':>6}"]
    base: dict[tuple, dict] = {}
    for r in results:
        key = (r["pp"], r["tg"], r["threads"])
        ref = base.setdefault(key, r)
        lines.append(f"{r['engine']:<10} {r['passes'] or '-':<8} {r['threads']:>7} {r['pp']:>5} "
                     f"{r['pp_tok_s']:>10.1f} {r['pp_tok_s'] / ref['pp_tok_s']:>5.2f}x "
                     f"{r['tg']:>4} {r['tg_tok_s']:>9.1f} {r['tg_tok_s'] / max(ref['tg_tok_s'], 1e-9):>5.2f}x")
    return "\n".join(lines)


def add_parser(sub, parents) -> None:
    p = sub.add_parser("bench", help="measure prefill and decode speed", description=cmd_bench.__doc__,
                       parents=parents,
                       epilog="examples: ggraph bench --demo --pp 64 --tg 32 -t 2 --json\n"
                              "          ggraph bench --demo -p 64,512 -n 64 -t 1,2 --compare fused,unfused --vs-llama-cpp",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(p)
    p.add_argument("-p", "--pp", default="64", help="prompt tokens per prefill; a comma list sweeps (default 64)")
    p.add_argument("-n", "--tg", default="32", help="decode steps; a comma list sweeps (default 32)")
    p.add_argument("-t", "--threads", default="1", help="threads; a comma list sweeps (default 1)")
    p.add_argument("--backend", choices=["numpy", "llvm"], default="llvm", help="backend (default llvm)")
    p.add_argument("--passes", default="default", help="pipeline: default, none, or pass,pass,...")
    p.add_argument("--no-pass", action="append", default=[], metavar="NAME",
                   help="switch off one pass in every pipeline (repeatable)")
    p.add_argument("--compare", help="comma list of pipelines to compare, e.g. fused,unfused")
    p.add_argument("--vs-llama-cpp", action="store_true", help="also run llama.cpp (llama-cpp-python) on the same file")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs (default 3)")
    p.add_argument("--json", action="store_true", help="print JSON (one object for one configuration)")
    p.add_argument("--csv", action="store_true", help="print CSV rows")
    p.add_argument("--profile", action="store_true",
                   help="time every op inside the native program, per op kind and per layer, against the roofline")
    from ggraph.bench.plot import plot_path
    p.add_argument("--plot", metavar="FILE.png", type=plot_path,
                   help="also draw tok/s bars with ratios (and a roofline with a profile)")
    add_memory_arg(p)
    p.set_defaults(fn=cmd_bench)
