"""fuse_rope_attention: rope(q), rope(k) and the cached attention become one rope_attention.

    q2 = rope[p] q positions [ff]
    k2 = rope[p] k positions [ff]
    o kc2 vc2 = attention[a] q2 k2 v kc vc P [sinks]
  ->
    o kc2 vc2 = rope_attention[p, a] q k v kc vc P positions [ff] [sinks]

An attention over caches whose q and k no rope produced (NoPE layers) becomes a rope_attention of
rotary dims 0, at positions P + iota(T), so that it runs on the same kernels:

    o kc2 vc2 = attention[a] q k v kc vc P [sinks]
  ->
    i = iota[n=T]; positions = add i P
    o kc2 vc2 = rope_attention[dims=0, a] q k v kc vc P positions [sinks]

Each attention is a candidate; one left alone is logged with the reason.
"""
from __future__ import annotations

from ggraph.ir.composites import attention_p, rope_p
from ggraph.ir.dtypes import Aval, i32
from ggraph.ir.fused import rope_attention_p
from ggraph.ir.graph import Eqn, Graph, Var
from ggraph.ir.prims import add_p, iota_p
from ggraph.passes.manager import graph_pass, note, skip
from ggraph.passes.rewrite import Rewriter


def _ropes(e: Eqn, producers: dict, users: dict, outputs: set) -> tuple[Eqn, Eqn] | str:
    """The rope eqns of q and k that attention ``e`` can absorb, or why it cannot."""
    if len(e.inputs) < 6:
        return "attention has no KV cache"
    rq, rk = producers.get(e.inputs[0]), producers.get(e.inputs[1])
    if not any(r is not None and r.prim is rope_p for r in (rq, rk)):
        return None, None                                        # no rope at all: NoPE
    for name, r in (("q", rq), ("k", rk)):
        if r is None or r.prim is not rope_p:
            return f"{name} is not the output of rope"
    for p in sorted(rq.params.keys() | rk.params.keys()):
        if rq.params.get(p) != rk.params.get(p):
            return f"q and k ropes differ: {p} {rq.params.get(p)} vs {rk.params.get(p)}"
    if rq.inputs[1] is not rk.inputs[1]:
        return "q and k ropes differ: they use different positions"
    if rq.inputs[2:] != rk.inputs[2:]:
        return "q and k ropes differ: frequency factors"
    for name, r in (("q", rq), ("k", rk)):
        out = r.outputs[0]
        if len(users.get(out, ())) > 1 or out in outputs:
            return f"{name} rope output has another user"
    return rq, rk


@graph_pass("fuse_rope_attention", explain=True)
def fuse_rope_attention(graph: Graph) -> Graph:
    """rope(q), rope(k), the KV-cache write and masked softmax attention -> one rope_attention."""
    producers = graph.producers()
    users = graph.users()
    outputs = {o for o in graph.outvars if isinstance(o, Var)}
    fusing: dict[int, tuple[Eqn, Eqn]] = {}            # index of attention eqn -> its q and k ropes
    for i, e in enumerate(graph.eqns):
        if e.prim is attention_p:
            got = _ropes(e, producers, users, outputs)
            if isinstance(got, str):
                skip(got, e.scope)
            else:
                fusing[i] = got
    absorbed = {id(r) for pair in fusing.values() for r in pair if r is not None}
    rw = Rewriter(graph)
    for i, e in enumerate(graph.eqns):
        if id(e) in absorbed:
            continue
        e = rw.renamed(e)
        if i not in fusing:
            rw.emit(e)
            continue
        rq, rk = fusing[i]
        if rq is None:
            _unrotated(rw, e)
            continue
        q, k = rw.atom(rq.inputs[0]), rw.atom(rk.inputs[0])
        rest = tuple(rw.atom(a) for a in rq.inputs[1:])                 # positions [, freq_factors]
        params = {("rope_scale" if k_ == "scale" else k_): v for k_, v in rq.params.items()}   # every rope param
        clash = params.keys() & e.params.keys()
        if clash:
            raise ValueError(f"fuse_rope_attention: rope and attention both have params {sorted(clash)}")
        params.update(e.params)
        rw.emit(Eqn(rope_attention_p, (q, k) + e.inputs[2:6] + rest + e.inputs[6:], e.outputs, params, e.scope))
        extras = [f"{k_}={e.params[k_]}" for k_ in ("window", "chunk", "softcap", "score_mod", "mask_mod", "sinks")
                  if e.params.get(k_)]
        note(f"rope(q), rope(k), attention -> rope_attention{' (' + ', '.join(extras) + ')' if extras else ''}",
             e.scope)
    return rw.finish()


def _unrotated(rw: Rewriter, e: Eqn) -> None:
    """Emit a NoPE attention over caches as a rope_attention of rotary dims 0 at positions P + iota(T)."""
    T, pos = e.inputs[0].aval.shape[0], e.inputs[5]
    steps, positions = Var(Aval((T,), i32)), Var(Aval((T,), i32))
    rw.emit(Eqn(iota_p, (), (steps,), {"n": T, "dtype": "i32"}, e.scope))
    rw.emit(Eqn(add_p, (steps, pos), (positions,), {}, e.scope))
    params = dict(dims=0, base=0.0, rope_scale=1.0, style="neox", **e.params)
    rw.emit(Eqn(rope_attention_p, e.inputs[:6] + (positions,) + e.inputs[6:], e.outputs, params, e.scope))
    note("attention without rope -> rope_attention (dims=0: no rotation)", e.scope)
