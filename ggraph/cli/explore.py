"""``ggraph explore``: the compiled graph in Model Explorer, pass by pass, with cost and profile overlays.

    ggraph explore --demo                        # serve it on 127.0.0.1:8080 and open a browser tab
    ggraph explore --demo --compare none         # the unfused pipeline's graphs beside the fused ones
    ggraph explore --demo --profile -t 2         # time, share, bytes and roofline fraction of every node
    ggraph explore model.gguf --layer 3 --port 9000 --no-browser     # a remote or headless machine
    ggraph explore --demo --export out/          # graphs.json and node data files, to open later
"""
from __future__ import annotations

import os
import sys
import time

from ggraph.cli.common import (DEFAULT_CTX, add_cache_type_args, add_ctx_arg, add_force_arg, add_model_arg,
                               add_pass_args, model_path, resolved_passes)


def cmd_explore(args) -> int:
    """Open a model's graph in Model Explorer: as traced and after every pass, each scope a collapsible layer,
    with each node's eqn, params, weights, kernel and fusion log, and cost (and --profile) overlays."""
    from ggraph.models import load
    from ggraph.passes import resolve
    from ggraph.runtime.session import cache_dtype
    from ggraph.view import explore as X
    from ggraph.view.adapter import kernel_table, to_me_graph
    passes = resolved_passes(args)
    compare = resolve(args.compare, args.no_pass, flags=("--compare", "--no-pass")) if args.compare else None
    dims = parse_at(args.at)
    if args.profile and args.pp < 1:
        raise ValueError(f"--pp must be at least 1, got {args.pp}")
    if args.ctx is not None and args.ctx < 1:
        raise ValueError(f"--ctx must be at least 1, got {args.ctx}")
    if args.export is None:
        _check_installed()
    elif os.path.exists(os.path.join(args.export, "graphs.json")) and not args.force:
        raise ValueError(f"--export {args.export}: graphs.json already exists there: remove it or give --force")
    elif os.path.exists(args.export) and not os.path.isdir(args.export):
        raise ValueError(f"--export {args.export}: not a directory")
    path = model_path(args)
    model = load(path)
    n = model.config.n_layer
    if args.layer is not None and not 0 <= args.layer < n:
        raise ValueError(f"--layer {args.layer}: the model has layers 0..{n - 1}")
    cache_types = (cache_dtype(args.cache_type_k, "--cache-type-k"), cache_dtype(args.cache_type_v, "--cache-type-v"))
    ctx = args.ctx if args.ctx is not None else min(DEFAULT_CTX, model.config.n_ctx_train)
    started = time.monotonic()
    graph = model.graph(ctx=ctx, last_only=True, cache_types=cache_types)
    table = kernel_table()
    ex = X.Exploration()
    graphs, _, log = X.pass_by_pass(graph, passes, kernels=table, dims=dims, layer=args.layer)
    ex.add_collection(X.pipeline_label(args.passes, passes), graphs)
    if compare is not None:
        other, _, _ = X.pass_by_pass(graph, compare, prefix=f"{args.compare} ", kernels=table, dims=dims,
                                     layer=args.layer)
        ex.add_collection(X.pipeline_label(args.compare, compare), other)
    X.add_cost_overlays(ex, dims)
    if args.profile:
        from ggraph.runtime.session import Session
        session = Session(path, backend="llvm", threads=args.threads, passes=passes, ctx=max(ctx, args.pp + 8),
                          profile=True, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v)
        prog = session.program(last_only=True)
        shown = to_me_graph(prog.graph, f"{len(graphs):02d} program (profiled)", log=log, kernels=table, dims=dims,
                            layer=args.layer)
        graphs.append(shown)
        s = X.add_profile_overlays(ex, session, shown, args.pp)
        print(f"profiled at {prog.threads} thread(s): " + "; ".join(
            f"{k} {v['seconds'] * 1e3:.2f} ms" for k, v in s.items() if isinstance(v, dict) and "seconds" in v)
            + f"; roofline {s['bandwidth_gb_s']:.1f} GB/s, {s['peaks']['f32']:.0f} GFLOP/s f32, "
              f"{s['peaks']['int8']:.0f} Gop/s int8", file=sys.stderr)
    total = sum(len(g.json["nodes"]) for g in ex.graphs())
    print(f"{len(ex.graphs())} graphs ({total} nodes), {len(ex.overlays)} overlays in "
          f"{time.monotonic() - started:.1f} s", file=sys.stderr)
    if args.export is not None:
        for p in ex.export(args.export):
            print(f"wrote {p}", file=sys.stderr)
        return 0
    url = ex.serve(host=args.host, port=args.port, open_browser=not args.no_browser,
                   expand=[f"blk.{args.layer}"] if args.layer is not None else ())
    print(f"Model Explorer: {url}\n(Ctrl+C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


def _check_installed() -> None:
    """Refuse before any work when Model Explorer is missing (serving needs it; --export does not)."""
    import importlib.util
    from ggraph.view.explore import INSTALL_HINT
    if importlib.util.find_spec("model_explorer") is None:
        raise ValueError(f"{INSTALL_HINT}; --export DIR works without it")


def parse_at(text: str) -> dict:
    """--at T=1,P=512 -> {"T": 1, "P": 512}: the symbol bindings costs and bytes are shown at."""
    dims = {}
    for part in text.split(","):
        name, eq, value = part.partition("=")
        if not eq or name.strip() not in ("T", "P") or not value.strip().isdigit():
            raise ValueError(f"--at {text}: expected T=N,P=N (whole numbers), e.g. T=1,P=512")
        dims[name.strip()] = int(value)
    return {"T": 1, "P": 0} | dims


def add_parser(sub, parents) -> None:
    p = sub.add_parser("explore", help="the compiled graph in Model Explorer, pass by pass, with overlays",
                       description=cmd_explore.__doc__, parents=parents,
                       epilog="example: ggraph explore --demo --compare none   (needs pip install -e \".[explore]\")")
    add_model_arg(p)
    add_pass_args(p)
    p.add_argument("--compare", metavar="PIPELINE",
                   help="a second pipeline shown beside the first, e.g. none (the unfused graph)")
    p.add_argument("--layer", type=int, metavar="N", help="show only layer N (blk.N)")
    p.add_argument("--at", default="T=1,P=0", metavar="T=N,P=N",
                   help="bind the symbols for bytes and the cost overlays (default T=1,P=0)")
    p.add_argument("--profile", action="store_true",
                   help="run the program (llvm) and overlay each node's time, share, bytes and roofline fraction")
    p.add_argument("--pp", type=int, default=64, metavar="N", help="prompt tokens of the profiled prefill (default 64)")
    p.add_argument("--threads", "-t", type=int, default=None, help="threads for --profile (default: all cores)")
    add_ctx_arg(p)
    add_cache_type_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port to serve on (default: the first free from 8080)")
    p.add_argument("--no-browser", action="store_true", help="serve without opening a browser (remote, headless)")
    p.add_argument("--export", metavar="DIR",
                   help="write graphs.json and the overlays' node data files into DIR instead of serving")
    add_force_arg(p)
    p.set_defaults(fn=cmd_explore)
