"""Kernel B's generic twin: one query row at a time, one key at a time, libm exp, scores summed in
PORTABLE_LANES lanes and everything accumulated with FMA rounded once, as llama.cpp's x86 kernels
round."""
from __future__ import annotations

import math

from llvmlite import ir

from ggraph.backends.llvm.kernels import vmath
from ggraph.backends.llvm.kernels.attention.rows import At, Rows, buffer, i32_of, key_range, modded, seen, zeros
from ggraph.backends.llvm.kernels.attention.split import part_range, partial_row
from ggraph.backends.llvm.kernels.builder import f32, vec
from ggraph.backends.llvm.kernels.isa import PORTABLE_LANES


def attention_rows(rows: Rows, share, part) -> None:
    """The scalar twin: one query row (t, h) at a time (with ``part``, that range of its keys)."""
    k, b, attn = rows.k, rows.b, rows.attn
    q = buffer(k, attn.D)                                            # this row's roped, scaled query
    start, end = share
    with k.loop(start, end, name="row") as r:
        t, h = b.udiv(r, k.i64(attn.H)), b.urem(r, k.i64(attn.H))
        p, kc, vc = rows.token(t)
        rows.rope_rows([(rows.row(k.arg["q"], r, attn.D), q)], rows.position(t), attn.scale)
        lo, hi = key_range(rows, p)
        if part is not None:
            lo, hi = part_range(rows, lo, hi, part)
        out = rows.row(k.arg["out"], r, attn.Dv) if part is None else partial_row(rows, part, r)
        at = At(rows.batch(t), i32_of(k, h), i32_of(k, p), None) if rows.mods else None
        _keys_scalar(rows, (kc, vc), q, (h, b.udiv(h, k.i64(attn.H // attn.Hkv))), lo, hi, out, part is not None, at)


def _dot_scalar(rows: Rows, q, krow) -> ir.Value:
    """q · k in PORTABLE_LANES partial sums (FMA rounded once), then the tail one at a time: the
    order of llama.cpp's f32 K·Q matmul on AVX-512."""
    k, isa, D, L = rows.k, rows.isa, rows.attn.D, PORTABLE_LANES
    main = D - D % L
    lanes = k.var(vec(f32, L), zeros(L))
    if main:
        with k.loop(0, main, step=L, name="d") as d:
            lanes.set(isa.fused(k.load(vec(f32, L), q, k.mul(d, 4)), rows.keys.load(krow, d, L), lanes.get()))
    dot = k.var(f32, isa.hsum(lanes.get()))
    if main < D:
        with k.loop(main, D, name="dt") as d:
            dot.set(isa.fused(k.load(f32, q, k.mul(d, 4)), rows.keys.load(krow, d, 1), dot.get()))
    return dot.get()


def _keys_scalar(rows: Rows, caches, q, heads, lo, hi, out, partial: bool, at: At | None) -> None:
    """One key at a time: score, running max and sum, rescale the accumulator (the spec). A
    partial result is stored unnormalised after its max and sum (its sink, if any, is kernel C's)."""
    k, b, isa, attn = rows.k, rows.b, rows.isa, rows.attn
    h, g = heads
    acc = buffer(k, attn.Dv)
    with k.loop(0, attn.Dv, name="zero") as d:
        k.store(ir.Constant(f32, 0.0), acc, k.mul(d, 4))
    sink = attn.sinks and not partial                                # the sink logit: a key with no value
    m = k.var(f32, rows.sink(h) if sink else -math.inf)
    total = k.var(f32, 1.0 if sink else 0.0)
    with k.loop(lo, hi, name="key") as j:
        krow = rows.keys.at(caches[0], k.add(k.mul(j, attn.Hkv), g))
        here = At(at.b, at.h, at.q, i32_of(k, j)) if at is not None else None
        s = modded(rows, _dot_scalar(rows, q, krow), here)
        mask = seen(rows, here, 1) if here is not None else None
        if mask is None:
            _add_key(rows, caches[1], acc, m, total, s, j, g)
        else:
            with k.if_then(mask):                                     # a hidden key adds nothing
                _add_key(rows, caches[1], acc, m, total, s, j, g)
    if partial:
        k.store(m.get(), out)
        k.store(total.get(), out, 4)
        with k.loop(0, attn.Dv, name="out") as d:
            k.store(k.load(f32, acc, k.mul(d, 4)), out, k.add(k.mul(d, 4), 8))
        return
    inv = rows.inverse(total.get())                                  # times 1/sum, as ggml scales
    with k.loop(0, attn.Dv, name="out") as d:
        k.store(b.fmul(k.load(f32, acc, k.mul(d, 4)), inv), out, k.mul(d, 4))


def _add_key(rows: Rows, v_cache, acc, m, total, s, j, g) -> None:
    """The online softmax takes key j's score s: max and sum move on, acc = acc * corr + p * v_j."""
    k, b, isa, attn = rows.k, rows.b, rows.isa, rows.attn
    m_new = isa.maxnum(m.get(), s)
    m_use = m_new
    if attn.score_mod is not None:                                   # a score_mod may give -inf: no NaN from it
        m_use = b.select(b.fcmp_ordered("==", m_new, ir.Constant(f32, -math.inf)), ir.Constant(f32, 0.0), m_new)
    corr = vmath.libm(isa, "exp", b.fsub(m.get(), m_use))
    p = vmath.libm(isa, "exp", b.fsub(s, m_use))
    total.set(isa.fused(total.get(), corr, p))
    m.set(m_new)
    vrow = rows.values.at(v_cache, k.add(k.mul(j, attn.Hkv), g))
    with k.loop(0, attn.Dv, name="dv") as d:
        a = k.load(f32, acc, k.mul(d, 4))
        k.store(isa.fused(p, rows.values.load(vrow, d, 1), b.fmul(a, corr)), acc, k.mul(d, 4))
