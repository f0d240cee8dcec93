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

Stacked experts [E, N, K] (``qmatmul_experts x w ids``, or unfused ``matmul xs (take w ids)``) get
one importance vector per expert, from the rows routed to it only, as llama.cpp's collector does
for ``ggml_mul_mat_id``: f32[E, K] sums and f32[E] counts, summed by ``segment_sum`` over the
(slot, row) pairs in llama.cpp's order (slot by slot, rows in order within a slot):

    y = qmatmul_experts x w ids                 # x (R, K), ids (R, k), w (E, N, K)
    s = segment_sum (reshape[(k·R, K)] (broadcast[(k, R, K)] (x·x)))  (reshape[(k·R,)] (transpose ids))
    n = segment_sum (broadcast[(k·R, 1)] 1.0) (the same ids)                      # (E, 1): rows per expert

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
from ggraph.ir.fused import qmatmul_experts_p, qmatmul_p
from ggraph.ir.graph import Eqn, Graph, Literal, Var
from ggraph.ir.primitive import infer
from ggraph.ir.trace import tree_flatten, tree_unflatten
from ggraph.ops import expert_linear
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


def experts_of(e: Eqn, producers: dict) -> tuple[Var, Var, Var] | None:
    """(rows, stored experts w [E, N, K], ids) for an expert matmul ``e``, or None. Fused (or the
    ``expert_linear`` composite not yet inlined), rows is x f32[R, K] shared by its k experts and ids
    i32[R, k]; unfused (``matmul xs (take w ids)``), rows is xs [..., 1, K] with one row per entry of ids
    (broadcast where it is shared)."""
    if e.prim is qmatmul_experts_p or e.prim is expert_linear.prim:
        x, w, ids = e.inputs
    elif e.prim is P.matmul_p and (tk := producers.get(e.inputs[1])) is not None and tk.prim is P.take_p:
        (x, _), (w, ids) = e.inputs, tk.inputs
        d = producers.get(w)
        if d is not None and d.prim is P.dequant_p:
            w = d.inputs[0]
    else:
        return None
    ok = isinstance(w, Var) and isinstance(w.aval, ParamAval) and w.aval.ndim == 3 and isinstance(ids, Var)
    ok = ok and isinstance(x, Var) and (x.aval.ndim == 2 or x.aval.shape[-2] == 1)
    return (x, w, ids) if ok else None


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


def _slot_major(emit: _Emitter, v: Var, R, k: int) -> Var:
    """v [R, k, ...] -> [k·R, ...], slot by slot (llama.cpp's order: all rows of slot 0, then slot 1, ...)."""
    rest = tuple(v.aval.shape[2:])
    if k > 1:
        v = emit(P.transpose_p, v, perm=(1, 0) + tuple(range(2, v.aval.ndim)))          # (k, R, ...)
    return emit(P.reshape_p, v, shape=(product((k, R)),) + rest)


def _expert_squares(emit: _Emitter, x: Var, w: Var, ids: Var) -> tuple[Var, Var]:
    """(Σ x² f32[E, K] over the rows routed to each expert, those rows' counts f32[E]) of an expert matmul."""
    E, K = w.aval.shape[0], w.aval.shape[-1]
    per_id = tuple(ids.aval.shape) + (1, K)                 # unfused xs: one row per id
    lead = tuple(ids.aval.shape) if ids.aval.ndim > 1 else tuple(ids.aval.shape) + (1,)    # one expert a row
    R, k = product(lead[:-1]), lead[-1]
    if ids.aval.ndim != 2:
        ids = emit(P.reshape_p, ids, shape=(R, k))                                    # (R, k)
    slots = _slot_major(emit, ids, R, k)                                              # (k·R,)
    if x.aval.ndim == 2:                                    # fused: x (R, K) shared by the row's k experts
        sq = emit(P.mul_p, x, x)                                                      # (R, K)
        if k > 1:
            sq = emit(P.broadcast_p, emit(P.reshape_p, sq, shape=(1, R, K)), shape=(k, R, K))
        sq = emit(P.reshape_p, sq, shape=(product((k, R)), K))                       # (k·R, K)
    else:                                                   # unfused: xs [..., 1, K], a row per (row, slot)
        if tuple(x.aval.shape) != per_id:
            x = emit(P.broadcast_p, x, shape=per_id)
        rows = _slot_major(emit, emit(P.reshape_p, x, shape=(R, k, K)), R, k)         # (k·R, K)
        sq = emit(P.mul_p, rows, rows)
    sums = emit(P.segment_sum_p, sq, slots, num_segments=E)                           # (E, K)
    ones = emit(P.broadcast_p, Literal(1.0, f32), shape=(product((k, R)), 1))         # (k·R, 1)
    counts = emit(P.reshape_p, emit(P.segment_sum_p, ones, slots, num_segments=E), shape=(E,))
    return sums, counts


@graph_pass("instrument_imatrix", explain=True, bodies=False)
def instrument_imatrix(graph: Graph) -> Graph:
    """Each weight matmul also outputs Σ_rows x² per input column and its rows (per expert for experts): imatrix."""
    producers = graph.producers()
    rw = Rewriter(graph)
    squares: dict[Var, Var] = {}                        # activation -> its Σ x² per column, made once
    counts: dict = {}                                   # rows (an int or a symbol) -> that count as a value
    recorded: dict[str, tuple[Var, Var]] = {}           # weight tensor name -> (sums, rows) outputs
    for e in graph.eqns:
        e = rw.renamed(e)
        rw.emit(e)
        emit = _Emitter(rw, e.scope)
        experts = experts_of(e, producers)
        if experts is not None:
            x, w, ids = experts
            stats = _expert_squares(emit, x, w, ids)
            what = f"Σ x² per column of the rows routed to each of its {w.aval.shape[0]} experts, and their rows"
        else:
            w = weight_of(e, producers)
            if w is None or not isinstance(e.inputs[0], Var):
                continue
            x = e.inputs[0]
            if x not in squares:
                squares[x] = _column_squares(emit, x)
            R = product(x.aval.shape[:-1])
            if R not in counts:
                counts[R] = _row_count(emit, R)
            stats = squares[x], counts[R]
            what = f"Σ x² per column of its input {x.aval}, and the rows"
        name = w.aval.source
        if name in recorded:                            # a weight applied to another input too
            (s0, n0), (s1, n1) = recorded[name], stats
            if s0.aval.shape != s1.aval.shape:
                raise ValueError(f"instrument_imatrix: weight {name} is used both as stacked experts and as one "
                                 f"matrix; an imatrix entry holds one or the other")
            stats = emit(P.add_p, s0, s1), emit(P.add_p, n0, n1)
        recorded[name] = stats
        note(f"{e.prim.name} · {name}: also {what}", e.scope)
    graph = rw.finish()
    outs = tree_unflatten(graph.out_tree, graph.outvars) if graph.out_tree is not None else tuple(graph.outvars)
    leaves, tree = tree_flatten((outs, recorded))
    return graph.replace(outvars=leaves, out_tree=tree)
