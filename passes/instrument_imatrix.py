"""instrument_imatrix: every matmul against a stored weight also outputs what an importance matrix needs.

    b = qmatmul x w                  b = qmatmul x w
                             ->      t = transpose[perm=(1,0)] x                  # (K, R): x is (R, K)
                                     s = reshape[(K,)] (reduce_sum (mul t t))     # Σ over rows of x², per column
                                     n = reduce_sum (broadcast[(R,)] 1.0)         # (1,): R, once per row count
    in (outs)                        in (outs, {"w's tensor name": (s, n)})

llama.cpp's importance matrix for a weight [N, K] is, per input column k, the mean of x[:, k]²
over the tokens the weight was applied to. The graph gives each step's sums and row counts as
extra outputs, named by the weight's GGUF tensor in the graph's output tree; the runner
(``ggraph.imatrix``) adds them up over the calibration chunks. Weights that read one input (q, k
and v) share one pair of outputs; a weight applied to several inputs gets the sum of their pairs.

Where: it instruments the fused op's f32 operand, so it runs after ``fuse_dequant_matmul``
(pipeline "imatrix") and before ``fuse_elementwise``, which then fuses the squares and sums
into row loops. A qmatmul's first operand is the f32 activation itself: the q8 copy that
integer dot products read is made inside the qmatmul's lowering, never in the graph, so no
quantisation stands between the graph value and what llama.cpp's callback reads (ggml's
src1, also f32). The unfused forms, ``matmul x (dequant w)`` and ``matmul x w`` with an f32
weight, are found too, so the pass gives the same outputs wherever it is placed.
"""
from __future__ import annotations

from ggraph.ir import prims as P
from ggraph.ir.dims import product
from ggraph.ir.dtypes import ParamAval, f32
from ggraph.ir.fused import qmatmul_p
from ggraph.ir.graph import Eqn, Graph, Literal, Var
from ggraph.ir.primitive import infer
from ggraph.ir.trace import tree_flatten, tree_unflatten
from ggraph.passes.manager import graph_pass, note
from ggraph.passes.rewrite import Rewriter


def weight_of(e: Eqn, producers: dict) -> Var | None:
    """The weight param that matmul ``e`` multiplies its first operand by, or None (no weight)."""
    if e.prim is qmatmul_p:
        w = e.inputs[1]
    elif e.prim is P.matmul_p:
        w = e.inputs[1]
        d = producers.get(w)
        if d is not None and d.prim is P.dequant_p:
            w = d.inputs[0]
    else:
        return None
    return w if isinstance(w, Var) and isinstance(w.aval, ParamAval) and w.aval.ndim == 2 else None


class _Emitter:
    """Appends new eqns to a rewrite, each output's aval from its primitive's shape rule."""

    def __init__(self, rw: Rewriter, scope: str):
        self.rw, self.scope = rw, scope

    def __call__(self, prim, *inputs, **params) -> Var:
        (aval,) = infer(prim, [a.aval for a in inputs], params)
        out = Var(aval)
        self.rw.emit(Eqn(prim, inputs, (out,), params, self.scope))
        return out


def _column_squares(emit: _Emitter, x: Var) -> Var:
    """Σ over the rows of x² per column, f32[K], of an activation x f32[..., K]."""
    K = x.aval.shape[-1]
    rows = emit(P.reshape_p, x, shape=(product(x.aval.shape[:-1]), K)) if x.aval.ndim != 2 else x   # (R, K)
    t = emit(P.transpose_p, rows, perm=(1, 0))                                        # (K, R)
    sums = emit(P.reduce_sum_p, emit(P.mul_p, t, t))                                  # (K, 1)
    return emit(P.reshape_p, sums, shape=(K,))                                        # (K,)


def _row_count(emit: _Emitter, R) -> Var:
    """R, the rows of a step's activation (a symbol such as T), as an f32[1] value."""
    ones = emit(P.broadcast_p, Literal(1.0, f32), shape=(R,))                         # (R,)
    return emit(P.reduce_sum_p, ones)                                                 # (1,)


@graph_pass("instrument_imatrix", explain=True)
def instrument_imatrix(graph: Graph) -> Graph:
    """Each weight matmul also outputs Σ_rows x² per input column and its row count (for an imatrix)."""
    producers = graph.producers()
    rw = Rewriter(graph)
    squares: dict[Var, Var] = {}                        # activation -> its Σ x² per column, made once
    counts: dict = {}                                   # rows (an int or a symbol) -> that count as a value
    recorded: dict[str, tuple[Var, Var]] = {}           # weight tensor name -> (sums, rows) outputs
    for e in graph.eqns:
        e = rw.renamed(e)
        rw.emit(e)
        w = weight_of(e, producers)
        if w is None or not isinstance(e.inputs[0], Var):
            continue
        x = e.inputs[0]
        emit = _Emitter(rw, e.scope)
        if x not in squares:
            squares[x] = _column_squares(emit, x)
        R = product(x.aval.shape[:-1])
        if R not in counts:
            counts[R] = _row_count(emit, R)
        name, stats = w.aval.source, (squares[x], counts[R])
        if name in recorded:                            # a weight applied to another input too
            (s0, n0), (s1, n1) = recorded[name], stats
            stats = emit(P.add_p, s0, s1), emit(P.add_p, n0, n1)
        recorded[name] = stats
        note(f"{e.prim.name} · {name}: also Σ x² per column of its input {x.aval}, and the rows", e.scope)
    graph = rw.finish()
    outs = tree_unflatten(graph.out_tree, graph.outvars) if graph.out_tree is not None else tuple(graph.outvars)
    leaves, tree = tree_flatten((outs, recorded))
    return graph.replace(outvars=leaves, out_tree=tree)
