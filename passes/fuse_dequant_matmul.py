"""fuse_dequant_matmul: let matmul and take read stored weights directly, never as f32 copies.

    b = matmul x (dequant w)   ->   b = qmatmul x w        (also matmul x w for an f32 weight param;
                                                             a [1, N, K] w is viewed as [N, K])
    c = take (dequant w) ids   ->   c = take w ids
    y = matmul xs (take (dequant w) ids)   ->   y = qmatmul_experts x w ids    (w [E, N, K]; xs each token's
                                                row shared by its experts, [..., 1, 1, K] or broadcast)

A dequant is removed only when every one of its users can read the blocks; if any other
user needs the f32 value, the dequant and all its users are left alone, with the reason.
"""
from __future__ import annotations

from ggraph.ir import prims as P
from ggraph.ir.dims import product
from ggraph.ir.dtypes import ParamAval, f32
from ggraph.ir.fused import qmatmul_experts_p, qmatmul_p
from ggraph.ir.graph import Eqn, Graph, Var
from ggraph.passes.manager import graph_pass, note, skip
from ggraph.passes.rewrite import Rewriter


def _reads_blocks(e: Eqn, d: Var) -> bool:
    """True if eqn ``e`` can read weight value ``d`` as stored: as a matmul's right operand holding one
    matrix ([N, K], or [1, N, K] as a slice of experts leaves it), or a take table."""
    return not _why_f32(e, d)


def _why_f32(e: Eqn, d: Var) -> str:
    """Why eqn ``e`` needs the f32 value of ``d`` ('' if it can read the stored blocks)."""
    where = f" in {e.scope}" if e.scope else ""
    if e.prim is P.matmul_p and e.inputs[1] is d and e.inputs[0] is not d:
        if all(n == 1 for n in d.aval.shape[:-2]):
            return ""
        return (f"{e.prim.name}{where} reads it as a batch of matrices {d.aval} (qmatmul takes one matrix; slice or "
                f"take the one it needs first)")
    if e.prim is P.take_p and e.inputs[0] is d and e.inputs[1] is not d:
        return ""
    if e.prim is P.matmul_p:
        return f"{e.prim.name}{where} reads it as its left operand (qmatmul reads a stored weight on the right)"
    return f"the dequant has another user: {e.prim.name}{where}"


def _source(w) -> str:
    return w.aval.source if isinstance(w.aval, ParamAval) else f"a {w.aval} value"


def _droppable_dequants(graph: Graph) -> dict[Var, Var]:
    """dequant output -> its stored weight, for dequants whose every user can read the weight directly."""
    users = graph.users()
    outputs = {o for o in graph.outvars if isinstance(o, Var)}
    out = {}
    for e in graph.eqns:
        if e.prim is not P.dequant_p:
            continue
        d, w = e.outputs[0], e.inputs[0]
        needs_f32 = [why for u in users.get(d, []) if (why := _why_f32(u, d))]
        if d in outputs:
            skip(f"dequant of {_source(w)} kept: its f32 value is a graph output", e.scope)
        elif needs_f32:
            skip(f"dequant of {_source(w)} kept: {needs_f32[0]}", e.scope)
        elif isinstance(w, Var):
            out[d] = w
    return out


def _view(rw: Rewriter, w: Var, shape: tuple, scope) -> Var:
    """``w`` reshaped to ``shape`` (a view: no data moves)."""
    v = Var(w.aval.update(shape=tuple(shape)))
    rw.emit(Eqn(P.reshape_p, (w,), (v,), {"shape": tuple(shape)}, scope))
    return v


def _f32_weights(graph: Graph) -> set[Var]:
    """Weight params stored as f32 matrices: a matmul against one is a qmatmul too. In a scan's body a weight
    it closes over is an input that keeps the param's aval."""
    weights = graph.params + tuple(v for v in graph.invars if isinstance(v.aval, ParamAval))
    return {v for v in weights if v.aval.dtype is f32 and v.aval.ndim == 2}


def _expert_matmuls(graph: Graph, weight_of: dict[Var, Var]) -> dict[Eqn, tuple]:
    """matmul eqn -> (x rows, stored experts, ids, the eqns it absorbs) for each matmul(xs, take(w, ids)) of
    stored experts w [E, N, K] where xs holds one row per token shared by its experts ([*ids[:-1], 1, 1, K],
    or a broadcast of that). Rows repeated per chosen expert (ids flattened) stay the f32 gather for now."""
    users, made_by = graph.users(), graph.producers()
    f32_experts = {v for v in graph.params if v.aval.dtype is f32 and v.aval.ndim == 3}
    outputs = {o for o in graph.outvars if isinstance(o, Var)}
    found = {}
    for e in graph.eqns:
        if e.prim is not P.matmul_p or made_by.get(e.inputs[1]) is None:
            continue
        a, g = e.inputs
        tk = made_by[g]
        if tk.prim is not P.take_p or not (tk.inputs[0] in weight_of or tk.inputs[0] in f32_experts):
            continue
        w, ids = weight_of.get(tk.inputs[0], tk.inputs[0]), tk.inputs[1]
        if w.aval.ndim != 3 or not isinstance(ids, Var) or ids.aval.ndim < 1 or a.aval.shape[-2] != 1:
            continue
        if g in outputs or [u for u in users.get(g, []) if u is not e]:
            skip(f"matmul · take of experts {_source(w)} kept as f32: the gathered experts have another user", e.scope)
            continue
        lead, K = ids.aval.shape, a.aval.shape[-1]
        absorbed = [tk]
        shared = made_by.get(a)
        if shared is not None and shared.prim is P.broadcast_p and len(users.get(a, [])) == 1 and a not in outputs and \
                tuple(shared.inputs[0].aval.shape) == lead[:-1] + (1, 1, K):
            absorbed.append(shared)                             # x[t] broadcast over its experts: read it once
            a = shared.inputs[0]
        if tuple(a.aval.shape) == lead[:-1] + (1, 1, K):        # one row per token, k experts each
            found[e] = (a, (product(lead[:-1]), K), w, ids, (product(lead[:-1]), lead[-1]), absorbed)
    return found


def _expert_matmul(rw: Rewriter, e: Eqn, a: Var, x_shape, w: Var, ids: Var, ids_shape) -> None:
    """y = matmul(xs, take(w, ids)) as qmatmul_experts on views of xs and ids, viewed back as y."""
    x = a if tuple(a.aval.shape) == x_shape else _view(rw, a, x_shape, e.scope)
    ids = ids if tuple(ids.aval.shape) == ids_shape else _view(rw, ids, ids_shape, e.scope)
    out = e.outputs[0]
    y = Var(out.aval.update(shape=ids_shape + (w.aval.shape[1],)))
    rw.emit(Eqn(qmatmul_experts_p, (x, w, ids), (y,), {}, e.scope))
    rw.emit(Eqn(P.reshape_p, (y,), (out,), {"shape": out.aval.shape}, e.scope))


@graph_pass("fuse_dequant_matmul", explain=True)
def fuse_dequant_matmul(graph: Graph) -> Graph:
    """matmul(x, dequant(w)) -> qmatmul(x, w), matmul(xs, take(dequant(w), ids)) -> qmatmul_experts(x, w, ids)
    and take(dequant(w), ids) -> take(w, ids): weights stay in blocks."""
    weight_of = _droppable_dequants(graph)
    f32_weights = _f32_weights(graph)
    experts = _expert_matmuls(graph, weight_of)
    absorbed = {id(d) for *_, eqns in experts.values() for d in eqns}
    rw = Rewriter(graph)
    for e in graph.eqns:
        if id(e) in absorbed:
            continue                                            # qmatmul_experts reads the chosen experts itself
        matched = experts.get(e)
        e = rw.renamed(e)
        prim, ins = e.prim, e.inputs
        if prim is P.dequant_p and e.outputs[0] in weight_of:
            continue                                            # every user now reads the weight itself
        if matched is not None:
            a, x_shape, w, ids, ids_shape, _ = matched
            _expert_matmul(rw, e, rw.atom(a), x_shape, w, rw.atom(ids), ids_shape)
            note(f"matmul · take({_source(w)}, ids) -> qmatmul_experts on {w.aval.dtype}", e.scope)
            continue
        if prim is P.matmul_p and (ins[1] in weight_of or ins[1] in f32_weights):
            w = weight_of.get(ins[1], ins[1])
            what = f"dequant({_source(w)})" if ins[1] in weight_of else _source(w)
            if w.aval.ndim > 2:                                 # [1, N, K]: one matrix, viewed as [N, K]
                w = _view(rw, w, w.aval.shape[-2:], e.scope)
            out = e.outputs[0]
            y = Var(out.aval.update(shape=ins[0].aval.shape[:-1] + (w.aval.shape[0],)))
            rw.emit(Eqn(qmatmul_p, (ins[0], w), (y,) if y.aval != out.aval else e.outputs, {}, e.scope))
            if y.aval != out.aval:                              # [M, N] -> [1, M, N], as the matmul gave
                rw.emit(Eqn(P.reshape_p, (y,), (out,), {"shape": out.aval.shape}, e.scope))
            note(f"matmul · {what} -> qmatmul on {w.aval.dtype}", e.scope)
        elif prim is P.take_p and ins[0] in weight_of:
            w = weight_of[ins[0]]
            rw.emit(e.replace(inputs=(w, ins[1])))
            note(f"take · dequant({_source(w)}) -> take on {w.aval.dtype} rows", e.scope)
        else:
            rw.emit(e)
    return rw.finish()
