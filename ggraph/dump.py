"""``ggraph dump`` and ``ggraph diff``: what the passes did to a model's graph, and what it changed.

    ggraph dump model.gguf --layer 3                     # text of one layer after the default pipeline
    ggraph dump model.gguf --after fuse_dequant_matmul   # the graph at that point of the pipeline
    ggraph dump model.gguf --explain                     # every fusion made, every candidate left alone
    ggraph dump model.gguf --show-buffers                # the memory plan, peak vs one buffer per value
    ggraph dump model.gguf --layer 0 --format png -o l0.png
    ggraph diff model.gguf --passes default --vs none --prompt "Hello"
"""
from __future__ import annotations

import sys

import numpy as np

FUSION_PASSES = ("fuse_dequant_matmul", "fuse_rope_attention", "fuse_elementwise", "plan_memory")
DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog"


# ---------------------------------------------------------------------------------------
# shared: the model graph after a pipeline
# ---------------------------------------------------------------------------------------

def _passes(text: str):
    from ggraph.cli import passes_arg
    return passes_arg(text)


def _pipeline(args, passes_text: str) -> list[str]:
    """The pass names a --passes / --no-pass / --after combination runs, checked."""
    from ggraph.passes import PASSES, pipeline
    names = pipeline(_passes(passes_text), args.no_pass)
    unknown = sorted(set(args.no_pass) - set(PASSES))
    if unknown:
        raise KeyError(f"--no-pass: unknown pass(es) {', '.join(unknown)}; available: {', '.join(PASSES)}")
    after = getattr(args, "after", None)
    if after:
        if after not in names:
            raise ValueError(f"--after {after}: that pass is not in the pipeline ({', '.join(names) or 'empty'})")
        names = names[:names.index(after) + 1]
    return names


def _load(args):
    from ggraph.cli import _model_path
    from ggraph.models import load
    return load(_model_path(args))


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# ---------------------------------------------------------------------------------------
# dump
# ---------------------------------------------------------------------------------------

def cmd_dump(args) -> int:
    """Print a model's graph after the passes, as text, DOT, PNG or SVG; or explain the fusions and buffers."""
    from ggraph.passes import RewriteLog, run
    model = _load(args)
    names = _pipeline(args, args.passes)
    log = RewriteLog()
    graph = run(model.graph(ctx=args.ctx), names, log=log)
    reports = []
    if args.explain:
        reports.append(explain(log, args.layer))
    if args.show_buffers:
        reports.append(show_buffers(graph, args.layer))
    if args.format in ("png", "svg"):
        if not args.output:
            raise ValueError(f"--format {args.format} writes a picture: give -o FILE")
        from ggraph.draw import draw
        how = draw(graph, args.output, layer=args.layer, fmt=args.format)
        print(f"wrote {args.output} ({args.format} by {how})", file=sys.stderr)
    elif args.output or not reports:
        text = graph.to_dot(layer=args.layer) if args.format == "dot" else graph.pretty(args.expand, args.layer)
        _write(text, args.output)
    if reports:
        print("\n\n".join(reports))
    return 0


def _write(text: str, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
        print(f"wrote {path}", file=sys.stderr)
    else:
        print(text)


def explain(log, layer: int | None = None) -> str:
    """Every rewrite and every skip of the fusion passes, with reasons; other passes as counts."""
    from ggraph.printing import in_layer
    keep = lambda e: layer is None or not e.where or in_layer(e.where, layer)       # noqa: E731
    lines = [f"passes run: {', '.join(log.ran) or 'none'}"]
    for name in log.ran:
        made, left = log.rewrites(name), log.skips(name)
        if name not in FUSION_PASSES:
            lines.append(f"{name}: {len(made)} rewrites, {len(left)} skipped")
            continue
        lines.append(f"{name}: {len(made)} fused, {len(left)} left alone" if name.startswith("fuse_") else f"{name}:")
        lines += [f"  {e}" for e in made + left if keep(e)]
    return "\n".join(lines)


def show_buffers(graph, layer: int | None = None) -> str:
    """The memory plan: each buffer's size, the buffer of every value, peak vs naive bytes at T=1 and T=64."""
    from ggraph.core import poly_str
    from ggraph.passes import plan_memory as pm
    from ggraph.printing import Names, graph_to_str, in_layer
    plan = graph.meta.get("memory_plan")
    lines = []
    if plan is None:
        plan = pm.plan(graph)
        lines.append("(the pipeline did not run plan_memory; this plan was made now, for display)")
    plan.check(graph)
    names = Names()
    graph_to_str(graph, layer=layer, names=names)          # the names `dump --layer` prints
    owners = set(plan.owners)
    dims = [{"T": 1, "P": 0}, {"T": 64, "P": 0}]
    lines.append(f"memory plan: {len(plan.buffer_of)} values in {len(plan.sizes)} buffers, "
                 f"{len(plan.in_place)} written in place (checked: no two live values share a buffer)")
    lines.append(f"  {'buffer':<8}{'bytes':<22}{'T=1':>12}{'T=64':>12}")
    for b, size in enumerate(plan.sizes):
        lines.append(f"  {b:<8}{pm.size_str(size):<22}{_fmt_bytes(pm.size_bytes(size, dims[0])):>12}"
                     f"{_fmt_bytes(pm.size_bytes(size, dims[1])):>12}")
    lines.append(f"  {'value':<28}{'buffer':>7}  bytes")
    for e in graph.eqns:
        if layer is not None and not in_layer(e.scope, layer):
            continue
        for o in e.outputs:
            if o not in plan.buffer_of:
                continue
            how = f"in place of {names[plan.in_place[o]]}" if o in plan.in_place else \
                "" if o in owners else "view/alias"
            lines.append(f"  {names.decl(o):<28}{plan.buffer_of[o]:>7}  {poly_str(pm.size_of(o.aval)):<14}{how}")
    for d in dims:
        peak, naive = plan.peak_bytes(d), plan.naive_bytes(d)
        lines.append(f"peak activation bytes at T={d['T']}: {_fmt_bytes(peak)} "
                     f"(one buffer per value: {_fmt_bytes(naive)}, {100 * (1 - peak / naive):.0f}% less)")
    return "\n".join(lines)


def add_dump_parser(subparsers) -> None:
    """Register ``ggraph dump``."""
    from ggraph.cli import _add_model_arg
    p = subparsers.add_parser("dump", help="print a model's graph after the passes, or explain them",
                              description=cmd_dump.__doc__,
                              epilog="example: ggraph dump --demo --layer 0 --explain")
    _add_model_arg(p)
    p.add_argument("--after", metavar="PASS", help="stop the pipeline after this pass and show that graph")
    p.add_argument("--layer", type=int, metavar="N", help="show only layer N (blk.N)")
    p.add_argument("--format", choices=("text", "dot", "png", "svg"), default="text", help="output format")
    p.add_argument("--passes", default="default", help="pipeline: default, none (unfused), or pass,pass,...")
    p.add_argument("--no-pass", action="append", default=[], metavar="NAME", help="switch off one pass (repeatable)")
    p.add_argument("--expand", action="store_true", help="print composite and fused bodies too")
    p.add_argument("--show-buffers", action="store_true", help="print the memory plan instead of the graph")
    p.add_argument("--explain", action="store_true",
                   help="print every fusion made and every candidate left alone, with reasons, instead of the graph")
    p.add_argument("--ctx", type=int, default=4096, help="context length: KV cache rows (default 4096)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the graph here (needed for png and svg)")
    p.set_defaults(fn=cmd_dump)


# ---------------------------------------------------------------------------------------
# diff
# ---------------------------------------------------------------------------------------

def layer_outputs(graph, n_layer: int) -> list:
    """The residual stream after each block: the first output of the last eqn in scope blk.i."""
    from ggraph.printing import in_layer
    outs = []
    for i in range(n_layer):
        last = [e for e in graph.eqns if in_layer(e.scope, i)]
        if not last:
            raise ValueError(f"diff: the graph has no eqns in scope blk.{i}")
        outs.append(last[-1].outputs[0])
    return outs


def run_marked(model, graph, ctx: int, passes, disabled, tokens) -> list[np.ndarray]:
    """Compile ``graph`` with ``passes`` on the numpy backend and run it on ``tokens`` from an empty cache."""
    from ggraph.compiler import compile_graph
    prog = compile_graph(graph, passes=passes, disabled=disabled, weights=model.file)
    kshape, vshape = model.kv_shapes(ctx)
    n = model.config.n_layer
    caches = [np.zeros(kshape, np.float32) for _ in range(n)] + [np.zeros(vshape, np.float32) for _ in range(n)]
    return prog.run_inputs([np.asarray(tokens, np.int32), np.int32(0), *caches])


def compare(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max |a-b| / max |b|, cosine of a and b), in float64."""
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    rel = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
    cos = float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))
    return rel, cos


def _tokens(args, model) -> list[int]:
    if args.tokens:
        try:
            ids = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
    else:
        from ggraph.tokenizer import Tokenizer
        ids = Tokenizer.from_metadata(model.file.metadata).encode(args.prompt or DEFAULT_PROMPT)
    bad = [t for t in ids if not 0 <= t < model.config.n_vocab]
    if not ids or bad:
        raise ValueError(f"diff: need token ids in [0, {model.config.n_vocab}); got {ids if not ids else bad}")
    return ids


def cmd_diff(args) -> int:
    """Run two pipelines on the numpy backend and print the max relative error per layer and for the logits."""
    model = _load(args)
    tokens = _tokens(args, model)
    graph = model.graph(ctx=len(tokens))
    n = model.config.n_layer
    marked = graph.replace(outvars=graph.outvars + tuple(layer_outputs(graph, n)), out_tree=None)
    runs = []
    for text in (args.passes, args.vs):
        _pipeline(args, text)                                   # validate names before the slow part
        outs = run_marked(model, marked, len(tokens), _passes(text), args.no_pass, tokens)
        runs.append((outs[0], outs[len(outs) - n:]))
    (logits_a, layers_a), (logits_b, layers_b) = runs
    print(f"ggraph diff: --passes {args.passes} vs --vs {args.vs}, {len(tokens)} tokens, numpy backend")
    print(f"  {'where':<8}{'max rel err':>14}{'cosine':>14}")
    for i, (a, b) in enumerate(zip(layers_a, layers_b)):
        rel, cos = compare(a, b)
        print(f"  {'blk.' + str(i):<8}{rel:>14.3e}{cos:>14.8f}")
    rel, cos = compare(logits_a, logits_b)
    print(f"  {'logits':<8}{rel:>14.3e}{cos:>14.8f}")
    same = (logits_a.argmax(-1) == logits_b.argmax(-1)).mean()
    print(f"  top-1 token agrees at {100 * same:.0f}% of {len(tokens)} positions")
    return 0


def add_diff_parser(subparsers) -> None:
    """Register ``ggraph diff``."""
    from ggraph.cli import _add_model_arg
    p = subparsers.add_parser("diff", help="compare two pipelines numerically, layer by layer",
                              description=cmd_diff.__doc__,
                              epilog="example: ggraph diff --demo --passes default --vs none --prompt 'Hello'")
    _add_model_arg(p)
    p.add_argument("--passes", default="default", help="the pipeline to check (default: default)")
    p.add_argument("--vs", default="none", help="the reference pipeline (default: none, the unfused graph)")
    p.add_argument("--no-pass", action="append", default=[], metavar="NAME", help="switch off one pass in both")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prompt", help=f"text to run (default {DEFAULT_PROMPT!r})")
    what.add_argument("--tokens", help="token ids to run, e.g. 2,818,5279")
    p.set_defaults(fn=cmd_diff)
