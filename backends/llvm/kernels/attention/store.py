"""Kernel A: rope the new keys into the cache (converted or quantised to its type), copy the new values."""
from __future__ import annotations

from ggraph.backends.llvm.kernels.attention.params import Attention, Rope
from ggraph.backends.llvm.kernels.attention.rows import Rows, buffer, open_kernel
from ggraph.backends.llvm.target import Target


def emit_store(module, target: Target, attn: Attention, rope: Rope | None, name: str, args) -> None:
    k = open_kernel(module, name, args)
    rows = Rows(k, target, attn, rope, name)
    b = k.b
    scratch = buffer(k, attn.D)
    start, end = k.thread_share(b.mul(k.arg["T"], k.i64(attn.Hkv)))
    with k.loop(start, end, name="row") as r:
        t = b.udiv(r, k.i64(attn.Hkv))
        p, kc, vc = rows.token(t)
        slot = k.add(k.mul(p, attn.Hkv), b.urem(r, k.i64(attn.Hkv)))                      # p*Hkv + g
        key = rows.keys.at(kc, slot)
        roped = key if attn.k_type == "f32" else scratch                  # other types: rope, then convert
        rows.rope_rows([(rows.row(k.arg["k"], r, attn.D), roped)], rows.position(t), None)
        if roped is not key:
            rows.keys.store(roped, key)
        rows.values.store(rows.row(k.arg["v"], r, attn.Dv), rows.values.at(vc, slot))
    k.finish()
