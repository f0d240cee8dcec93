"""The ``ggraph`` command line: one small function per subcommand, listed in COMMANDS."""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

FILE_TYPES = {  # llama.cpp's general.file_type values
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 25: "IQ4_NL", 30: "IQ4_XS", 32: "BF16",
}
ARRAY_PREVIEW = 8


def _model_path(args) -> str:
    if getattr(args, "demo", False):
        from ggraph.demo import demo_model_path
        return str(demo_model_path())
    if not args.model:
        raise SystemExit("ggraph: error: give a MODEL path or --demo")
    return args.model


# ---------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------

def _summary(value, full: bool = False):
    """A JSON-able value; arrays longer than ARRAY_PREVIEW are summarised unless ``full``."""
    if isinstance(value, (str, int, float, bool)):
        return value
    seq = list(value) if full or len(value) <= ARRAY_PREVIEW else [value[i] for i in range(ARRAY_PREVIEW)]
    seq = [x.item() if hasattr(x, "item") else x for x in seq]
    if full or len(value) <= ARRAY_PREVIEW:
        return seq
    return {"array_length": len(value), "head": seq}


def _fmt_value(value) -> str:
    if isinstance(value, str):
        return repr(value) if len(value) < 80 else repr(value[:77] + "...")
    if isinstance(value, (int, float, bool)):
        return str(value)
    n = len(value)
    head = ", ".join(_fmt_value(value[i].item() if hasattr(value[i], "item") else value[i])
                     for i in range(min(n, 4)))
    return f"[{n} items] {head}{', ...' if n > 4 else ''}"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def cmd_inspect(args) -> int:
    """Show a GGUF file's metadata, tensor table and per-type totals."""
    from ggraph.gguf import GGUFFile
    path = _model_path(args)
    with GGUFFile(path) as f:
        tensors = list(f.tensors.values())
        if args.json:
            out = {"path": path, "version": f.version, "alignment": f.alignment,
                   "metadata": {k: _summary(v, args.full) for k, v in f.metadata.items()},
                   "tensors": [{"name": t.name, "shape": list(t.shape), "type": str(t.dtype),
                                "offset": t.offset, "nbytes": t.nbytes} for t in tensors]}
            json.dump(out, sys.stdout, indent=1)
            print()
            return 0
        md = f.metadata
        n_params = sum(_numel(t.shape) for t in tensors)
        total = sum(t.nbytes for t in tensors)
        ftype = FILE_TYPES.get(md.get("general.file_type"), md.get("general.file_type", "?"))
        print(f"{path}: GGUF v{f.version}, {len(md)} keys, {len(tensors)} tensors, {_fmt_bytes(total)} of weights")
        print(f"architecture {f.architecture or '?'} · {md.get('general.name', '?')} · "
              f"{n_params / 1e6:.1f}M params · {8 * total / max(n_params, 1):.2f} bits/weight · file type {ftype}")
        print("\nmetadata:")
        for k, v in md.items():
            print(f"  {k} = {_fmt_value(v)}")
        print("\ntensors:")
        width = max((len(t.name) for t in tensors), default=4)
        print(f"  {'name':<{width}}  {'shape':<16} {'type':<7} {'bytes':>10}")
        for t in tensors:
            shape = "x".join(map(str, t.shape))
            print(f"  {t.name:<{width}}  {shape:<16} {str(t.dtype):<7} {t.nbytes:>10}")
        print("\ntotals by type:")
        by_type = Counter()
        counts = Counter()
        elems = Counter()
        for t in tensors:
            by_type[str(t.dtype)] += t.nbytes
            counts[str(t.dtype)] += 1
            elems[str(t.dtype)] += _numel(t.shape)
        for name, nbytes in by_type.most_common():
            print(f"  {name:<7} {counts[name]:>4} tensors {elems[name] / 1e6:>9.2f}M weights "
                  f"{_fmt_bytes(nbytes):>10} {8 * nbytes / elems[name]:>6.2f} bits/weight")
    return 0


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------

def passes_arg(text: str):
    """'default', 'none', or a comma-separated list of pass names."""
    return text if text in ("default", "none") else [p.strip() for p in text.split(",") if p.strip()]


def cmd_run(args) -> int:
    """Generate text from a GGUF model, streaming it as it comes."""
    from ggraph.runtime import Session
    path = _model_path(args)
    session = Session(path, backend=args.backend, threads=args.threads, passes=passes_arg(args.passes),
                      ctx=args.ctx, disabled=args.no_pass)
    options = dict(max_tokens=args.n_predict, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                   min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop,
                   stream=True)
    if args.chat:
        pieces = session.chat([{"role": "user", "content": args.prompt}], **options)
    else:
        if not args.no_echo:
            print(args.prompt, end="", flush=True)
        pieces = session.generate(args.prompt, **options)
    for piece in pieces:
        print(piece, end="", flush=True)
    print(flush=True)
    st = session.stats
    pp = st["prompt_tokens"] / st["prompt_s"] if st.get("prompt_s") else 0.0
    tg = st["generated_tokens"] / st["generate_s"] if st.get("generate_s") else 0.0
    print(f"[{args.backend}] prompt: {st['prompt_tokens']} tokens, {pp:.1f} tok/s | "
          f"generated: {st['generated_tokens']} tokens, {tg:.1f} tok/s", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------

NAMED_PASSES = {"fused": "default", "unfused": "none"}


def _int_list(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def cmd_bench(args) -> int:
    """Measure prefill (pp) and decode (tg) tok/s, optionally against llama.cpp on the same file."""
    from ggraph import bench
    from ggraph.progress import Progress
    path = _model_path(args)
    configs = [(pp, tg, t) for pp in _int_list(args.pp) for tg in _int_list(args.tg) for t in _int_list(args.threads)]
    pipelines = [NAMED_PASSES.get(p, p) for p in (args.compare.split(",") if args.compare else [args.passes])]
    jobs = [("ggraph", c, p) for c in configs for p in pipelines]
    if args.vs_llama_cpp:
        jobs += [("llama.cpp", c, None) for c in configs]
    results = []
    with Progress(len(jobs), "benchmarking", stream=sys.stderr) as bar:
        for engine, (pp, tg, threads), pipe in jobs:
            if engine == "ggraph":
                r = bench.bench_ggraph(path, pp, tg, threads, backend=args.backend, passes=passes_arg(pipe),
                                       repeats=args.repeats)
            else:
                r = bench.bench_llama_cpp(path, pp, tg, threads, repeats=args.repeats)
            results.append(r.row())
            bar.advance()
    if args.profile:
        if args.backend != "llvm":
            raise ValueError("--profile times the native program: use --backend llvm")
        for (pp, _, threads), pipe in {((c[0], 0, c[2]), p) for c in configs for p in pipelines}:
            prof = bench.profile_ggraph(path, pp, threads, passes=passes_arg(pipe))
            for r in results:
                if r["engine"] == "ggraph" and (r["pp"], r["threads"], r["passes"]) == (pp, threads, pipe):
                    r["profile"], r["roofline"] = prof, prof["roofline"]
    if args.plot:
        from ggraph.bench_plot import plot_results
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


# ---------------------------------------------------------------------------------------
# target
# ---------------------------------------------------------------------------------------

FEATURES_THAT_MATTER = ("sse4.1", "sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                        "avx512dq", "avx512vnni", "avxvnni", "amx-tile", "amx-int8", "neon", "dotprod")


def target_report() -> dict:
    """The host CPU as llvmlite sees it, the feature sets it runs, and the kernels of the chosen one."""
    import os
    import llvmlite
    import llvmlite.binding as llvm
    from ggraph.backends.llvm import target as T
    feats = T.host_features()
    chosen = T.host_target()
    return {
        "cpu": llvm.get_host_cpu_name(),
        "llvmlite": llvmlite.__version__,
        "llvm": ".".join(map(str, llvm.llvm_version_info)),
        "features": {f: f in feats for f in FEATURES_THAT_MATTER},
        "runnable": [t.name for t in T.runnable_targets()],
        "chosen": chosen.name,
        "forced": bool(os.environ.get("GGRAPH_TARGET")),
        "kernels": T.describe(chosen),
    }


def cmd_target(args) -> int:
    """Show the host CPU, the features that matter, and which kernel variant each op gets."""
    info = target_report()
    if args.json:
        json.dump(info, sys.stdout, indent=1)
        print()
        return 0
    print(f"host cpu: {info['cpu']} (as LLVM names it; ggraph trusts the feature map below)")
    print(f"llvmlite {info['llvmlite']}, LLVM {info['llvm']}")
    print("features: " + "  ".join(f"{k}{'+' if v else '-'}" for k, v in info["features"].items()))
    print("note: AMX is never used (it crashes on these machines)" if info["features"]["amx-tile"] else "", end="")
    print(f"\nfeature sets this host runs: {', '.join(info['runnable'])}")
    print(f"chosen: {info['chosen']}" + (" (forced by GGRAPH_TARGET)" if info["forced"] else
                                         " (best available; GGRAPH_TARGET=<set> forces one)"))
    print("kernels:")
    for op, variant in info["kernels"].items():
        print(f"  {op:<20} {variant}")
    return 0


# ---------------------------------------------------------------------------------------
# the parser
# ---------------------------------------------------------------------------------------

def _add_model_arg(p):
    p.add_argument("model", nargs="?", help="path to a .gguf file (the first file of a split model)")
    p.add_argument("--demo", action="store_true", help="use the demo model, Gemma 3 270M Q4_K_M (needs ggraph[demo])")


def _add_compile_args(p):
    p.add_argument("--backend", choices=["numpy", "llvm"], default="llvm",
                   help="llvm: native code for this CPU (default); numpy: the slow reference interpreter")
    p.add_argument("--threads", "-t", type=int, default=None, help="threads for the llvm backend (default: all cores)")
    p.add_argument("--passes", default="default", help="pipeline: default, none (unfused), or pass,pass,...")
    p.add_argument("--no-pass", action="append", default=[], metavar="NAME", help="switch off one pass (repeatable)")
    p.add_argument("--ctx", type=int, default=4096, help="context length: KV cache rows (default 4096)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ggraph",
        description="ggraph: trace, fuse and run LLMs from GGUF files on CPUs.",
        epilog="Run 'ggraph COMMAND --help' for each command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("inspect", help="show a GGUF file's metadata and tensors",
                       description=cmd_inspect.__doc__)
    _add_model_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with metadata and tensors")
    p.add_argument("--full", action="store_true", help="with --json, include long arrays in full")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("run", help="generate text from a model", description=cmd_run.__doc__,
                       epilog="example: ggraph run --demo -p 'The capital of France is' -n 32 --temp 0")
    _add_model_arg(p)
    p.add_argument("-p", "--prompt", required=True, help="the prompt text")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens (default 40; 0 = all)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min-p × the top probability (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalty for recent tokens (default 1.0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop at this text (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--no-echo", action="store_true", help="do not print the prompt before the generated text")
    _add_compile_args(p)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("bench", help="measure prefill and decode speed", description=cmd_bench.__doc__,
                       epilog="examples: ggraph bench --demo --pp 64 --tg 32 -t 2 --json\n"
                              "          ggraph bench --demo -p 64,512 -n 64 -t 1,2 --compare fused,unfused --vs-llama-cpp",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_arg(p)
    p.add_argument("-p", "--pp", default="64", help="prompt tokens per prefill; a comma list sweeps (default 64)")
    p.add_argument("-n", "--tg", default="32", help="decode steps; a comma list sweeps (default 32)")
    p.add_argument("-t", "--threads", default="1", help="threads; a comma list sweeps (default 1)")
    p.add_argument("--backend", choices=["numpy", "llvm"], default="llvm", help="backend (default llvm)")
    p.add_argument("--passes", default="default", help="pipeline: default, none, or pass,pass,...")
    p.add_argument("--compare", help="comma list of pipelines to compare, e.g. fused,unfused")
    p.add_argument("--vs-llama-cpp", action="store_true", help="also run llama.cpp (llama-cpp-python) on the same file")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs (default 3)")
    p.add_argument("--json", action="store_true", help="print JSON (one object for one configuration)")
    p.add_argument("--csv", action="store_true", help="print CSV rows")
    p.add_argument("--profile", action="store_true",
                   help="time every op inside the native program, per op kind and per layer, against the roofline")
    from ggraph.bench_plot import plot_path
    p.add_argument("--plot", metavar="FILE.png", type=plot_path,
                   help="also draw tok/s bars with ratios (and a roofline with a profile)")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("target", help="show the host CPU features and the chosen kernel set",
                       description=cmd_target.__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_target)

    from ggraph.dump import add_diff_parser, add_dump_parser
    add_dump_parser(sub)
    add_diff_parser(sub)
    return parser


def main(argv=None) -> int:
    from ggraph.passes import PassError
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    try:
        return args.fn(args)
    except BrokenPipeError:                     # `ggraph inspect x | head` is fine
        sys.stdout = open(__import__("os").devnull, "w")
        return 0
    except (OSError, ValueError, KeyError, NotImplementedError, PassError) as e:   # the user's input, not our bug
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"ggraph {args.command}: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
