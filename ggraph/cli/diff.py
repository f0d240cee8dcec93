"""``ggraph diff``: two pipelines run on the numpy backend and compared layer by layer.

    ggraph diff model.gguf --passes default --vs none --prompt "Hello"
"""
from __future__ import annotations

import numpy as np

from ggraph.cli.common import add_model_arg, model_path, nonempty, resolved_passes

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog"



def layer_outputs(graph, n_layer: int) -> list:
    """The residual stream after each block: the first output of the last eqn in scope blk.i (a recurrent
    state's write-back at the end of the step is not one)."""
    from ggraph.ir.graph import in_layer
    from ggraph.ir.prims import state_write_p
    outs = []
    for i in range(n_layer):
        last = [e for e in graph.eqns if in_layer(e.scope, i) and e.prim is not state_write_p]
        if not last:
            raise ValueError(f"diff: the graph has no eqns in scope blk.{i}")
        outs.append(last[-1].outputs[0])
    return outs


def run_marked(model, graph, ctx: int, passes, tokens) -> list[np.ndarray]:
    """Compile ``graph`` with ``passes`` on the numpy backend and run it on ``tokens`` from an empty cache
    (and zeroed recurrent states)."""
    from ggraph.compiler import compile_graph
    from ggraph.ir.dtypes import f32
    from ggraph.runtime.session import empty_caches, state_arrays
    prog = compile_graph(graph, passes=passes, weights=model.file)
    k, v = empty_caches(model, ctx, (f32, f32))
    return prog.run_inputs([np.asarray(tokens, np.int32), np.int32(0), *k, *v, *state_arrays(model)])


def compare(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(max |a-b| / max |b|, cosine of a and b), in float64."""
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    rel = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
    cos = float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))
    return rel, cos


def _tokens(args, model) -> list[int]:
    if args.tokens is not None:
        try:
            ids = [int(t) for t in args.tokens.split(",")]      # an empty item ("1,,2", "") is a mistake too
        except ValueError:
            raise ValueError(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
    else:
        from ggraph.runtime.tokenizer import Tokenizer
        text = DEFAULT_PROMPT if args.prompt is None else args.prompt       # an empty --prompt is refused by argparse
        ids = Tokenizer.from_metadata(model.file.metadata).encode(text)
    bad = [t for t in ids if not 0 <= t < model.config.n_vocab]
    if not ids or bad:
        raise ValueError(f"diff: need token ids in [0, {model.config.n_vocab}); got {ids if not ids else bad}")
    return ids


def blas_threads(n: int) -> None:
    """Run numpy's BLAS (OpenBLAS), the only part of the numpy backend that runs on several cores, on ``n``
    threads; an error naming -t where this numpy's BLAS cannot be told."""
    import ctypes
    if n < 1:
        raise ValueError(f"--threads must be at least 1, got {n}")
    try:
        with open("/proc/self/maps") as maps:
            libs = sorted({line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line})
    except OSError:
        libs = []
    for lib in libs:
        for name in ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                     "scipy_openblas_set_num_threads"):
            setter = getattr(ctypes.CDLL(lib), name, None)
            if setter is not None:
                setter(ctypes.c_int(n))
                return
    raise ValueError("--threads: cannot set the threads of this numpy's BLAS (only OpenBLAS, on Linux, is known)")


def _check_memory(model, T: int) -> None:
    """What two numpy runs of ``T`` tokens hold at their peak, roughly, against the memory there is: both
    pipelines' logits (and their float64 comparison), a layer's attention scores, the KV caches."""
    from ggraph import memory
    c = model.config
    need = T * c.n_vocab * (4 * 2 + 8 * 3) + T * T * c.n_head * 4 * 4 + \
        2 * c.n_layer * T * c.n_head_kv * (c.head_dim + c.head_dim_v) * 4
    memory.check(need, f"diff of {T} tokens on the numpy backend (logits of {c.n_vocab} per token in both pipelines, "
                       f"{c.n_head} heads of {T}×{T} attention scores)")


def cmd_diff(args) -> int:
    """Run two pipelines on the numpy backend and print the max relative error per layer and for the logits."""
    from ggraph.models import load
    pipelines = [resolved_passes(args, args.passes), resolved_passes(args, args.vs, "--vs")]   # before the slow part
    if args.threads is not None:
        blas_threads(args.threads)
    model = load(model_path(args))
    tokens = _tokens(args, model)
    _check_memory(model, len(tokens))
    graph = model.graph(ctx=len(tokens))
    n = model.config.n_layer
    marked = graph.replace(outvars=graph.outvars + tuple(layer_outputs(graph, n)), out_tree=None)
    runs = []
    for passes in pipelines:
        outs = run_marked(model, marked, len(tokens), passes, tokens)
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


def add_parser(sub, parents) -> None:
    p = sub.add_parser("diff", help="compare two pipelines numerically, layer by layer",
                       description=cmd_diff.__doc__, parents=parents,
                       epilog="example: ggraph diff --demo --passes default --vs none --prompt 'Hello'")
    add_model_arg(p)
    p.add_argument("--passes", default="default", help="the pipeline to check (default: default)")
    p.add_argument("--vs", default="none", help="the reference pipeline (default: none, the unfused graph)")
    p.add_argument("--no-pass", action="append", default=[], metavar="NAME", help="switch off one pass in both")
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="threads of numpy's BLAS, where the numpy backend spends its time (default: its own)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prompt", type=nonempty, help=f"text to run (default {DEFAULT_PROMPT!r})")
    what.add_argument("--tokens", help="token ids to run, e.g. 2,818,5279")
    p.set_defaults(fn=cmd_diff)
