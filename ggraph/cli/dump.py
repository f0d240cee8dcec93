"""``ggraph dump``: a model's graph after the passes, what the passes did, and the memory plan.

    ggraph dump model.gguf --layer 3                     # text of one layer after the default pipeline
    ggraph dump model.gguf --after fuse_dequant_matmul   # the graph at that point of the pipeline
    ggraph dump model.gguf --explain                     # every fusion made, every candidate left alone
    ggraph dump model.gguf --show-buffers                # the memory plan, peak vs one buffer per value
    ggraph dump model.gguf --layer 0 --format png -o l0.png
"""
from __future__ import annotations

import errno
import os
import stat
import sys

from ggraph.cli.common import (DEFAULT_CTX, add_cache_type_args, add_ctx_arg, add_force_arg, add_model_arg,
                               add_pass_args, check_output, model_path, resolved_passes)
from ggraph.units import fmt_bytes


# ---------------------------------------------------------------------------------------
# dump
# ---------------------------------------------------------------------------------------

def cmd_dump(args) -> int:
    """Print a model's graph after the passes, as text, DOT, PNG or SVG; or explain the fusions and buffers."""
    from ggraph.models import load
    passes = resolved_passes(args)
    if args.format in ("png", "svg") and not args.output:
        raise ValueError(f"--format {args.format} writes a picture: give -o FILE")
    if args.ctx is not None and args.ctx < 1:
        raise ValueError(f"--ctx must be at least 1, got {args.ctx}")
    if args.output:
        check_output(args.output, args.force, "-o")
    held = _fifo_reader(args.output) if args.output else None
    try:
        return _dump(args, passes, load(model_path(args)))
    finally:
        if held is not None:
            os.close(held)


def _fifo_reader(path: str) -> int | None:
    """For an output that is a FIFO: a write end held open while dump works (so that its reader does not see
    the end of input before the output is written), or an error when no process reads it (the write would
    block forever). None for anything else."""
    try:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            return None
    except OSError:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise ValueError(f"-o {path}: a FIFO that no process reads (writing to it would block)") from None
        raise


def _dump(args, passes, model) -> int:
    from ggraph.passes import RewriteLog, run
    n = model.config.n_layer
    if args.layer is not None and not 0 <= args.layer < n:
        raise ValueError(f"--layer {args.layer}: the model has layers 0..{n - 1}")
    log = RewriteLog()
    from ggraph.runtime.session import cache_dtype
    cache_types = (cache_dtype(args.cache_type_k, "--cache-type-k"), cache_dtype(args.cache_type_v, "--cache-type-v"))
    ctx = args.ctx if args.ctx is not None else min(DEFAULT_CTX, model.config.n_ctx_train)
    graph = run(model.graph(ctx=ctx, cache_types=cache_types), passes, log=log)
    reports = []
    if args.explain:
        reports.append(explain(log, args.layer))
    if args.show_buffers:
        reports.append(show_buffers(graph, args.layer))
    if args.format in ("png", "svg"):
        from ggraph.view.draw import draw
        how = draw(graph, args.output, layer=args.layer, fmt=args.format)
        print(f"wrote {args.output} ({args.format} by {how})", file=sys.stderr)
    elif args.output or not reports:
        from ggraph.view.dot import graph_to_dot
        text = graph_to_dot(graph, layer=args.layer) if args.format == "dot" else graph.pretty(args.expand, args.layer)
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
    """Every rewrite and every skip of the passes that explain themselves (fusions, inlining), with
    reasons; the other passes as counts."""
    from ggraph.ir.graph import in_layer
    from ggraph.passes import PASSES
    keep = lambda e: layer is None or not e.where or in_layer(e.where, layer)       # noqa: E731
    lines = [f"passes run: {', '.join(log.ran) or 'none'}"]
    for name in log.ran:
        made, left = log.rewrites(name), log.skips(name)
        if not PASSES[name].explain:
            lines.append(f"{name}: {len(made)} rewrites, {len(left)} skipped")
            continue
        verbs = ("fused", "left alone") if name.startswith("fuse_") else ("rewrites", "skipped")
        lines.append(f"{name}: {len(made)} {verbs[0]}, {len(left)} {verbs[1]}" if made or left else f"{name}:")
        lines += [f"  {e}" for e in made + left if keep(e)]
    return "\n".join(lines)


def show_buffers(graph, layer: int | None = None) -> str:
    """The memory plan: each buffer's size, the buffer of every value, peak vs naive bytes at T=1 and T=64."""
    from ggraph.ir.dims import poly_str
    from ggraph.passes import plan_memory as pm
    from ggraph.ir.graph import Names, graph_to_str, in_layer
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
        lines.append(f"  {b:<8}{pm.size_str(size):<22}{fmt_bytes(pm.size_bytes(size, dims[0])):>12}"
                     f"{fmt_bytes(pm.size_bytes(size, dims[1])):>12}")
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
        lines.append(f"peak activation bytes at T={d['T']}: {fmt_bytes(peak)} "
                     f"(one buffer per value: {fmt_bytes(naive)}, {100 * (1 - peak / naive):.0f}% less)")
    return "\n".join(lines)


def add_parser(sub, parents) -> None:
    p = sub.add_parser("dump", help="print a model's graph after the passes, or explain them",
                       description=cmd_dump.__doc__, parents=parents,
                       epilog="example: ggraph dump --demo --layer 0 --explain")
    add_model_arg(p)
    p.add_argument("--after", metavar="PASS", help="stop the pipeline after this pass and show that graph")
    p.add_argument("--layer", type=int, metavar="N", help="show only layer N (blk.N)")
    p.add_argument("--format", choices=("text", "dot", "png", "svg"), default="text", help="output format")
    add_pass_args(p)
    p.add_argument("--expand", action="store_true", help="print composite and fused bodies too")
    report = p.add_mutually_exclusive_group()
    report.add_argument("--show-buffers", action="store_true", help="print the memory plan instead of the graph")
    report.add_argument("--explain", action="store_true",
                        help="print every fusion made and every candidate left alone, with reasons, instead of the "
                             "graph")
    add_ctx_arg(p)
    add_cache_type_args(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write the graph here (needed for png and svg)")
    add_force_arg(p)
    p.set_defaults(fn=cmd_dump)
