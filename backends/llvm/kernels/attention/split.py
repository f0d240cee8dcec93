"""How threads share kernel B's work, and kernel C, which merges the partial results of a split step.

Threads split the work one of two ways, decided alike in B and C from T and nth. With at
least as many (token, kv head) pairs as threads, B splits the T*H query rows into
contiguous shares with equal numbers of (query, key) pairs, and C does nothing. With fewer
(decode with one or two kv heads: a split by rows would leave threads idle or reading the
same keys), B cuts every row's visible keys into one range per thread (flash-decoding):
each thread stores, per row, the running max, the sum of exponentials and the unnormalised
sum of values over its range, and C rescales and adds them.
"""
from __future__ import annotations

import math

from llvmlite import ir

from ggraph.backends.llvm.kernels import vmath
from ggraph.backends.llvm.kernels.attention.params import ROW_COST, SPLIT_MAX, SPLIT_T, Attention, Rope
from ggraph.backends.llvm.kernels.attention.rows import Rows, chunked, open_kernel, splat, typ, zeros
from ggraph.backends.llvm.kernels.builder import f32, i64
from ggraph.backends.llvm.target import Target


def splitting(rows: Rows) -> ir.Value:
    """Whether this step splits keys across threads: fewer (token, kv head) pairs than threads, so
    a split by rows would leave threads idle or reading the same keys (decode with one or two kv
    heads). Kernels B and C decide alike."""
    k, b = rows.k, rows.b
    if rows.attn.slot_rows:                               # a batch of sequences: rows split, keys whole
        return ir.Constant(ir.IntType(1), 0)
    T = k.arg["T"]
    few = b.icmp_signed("<", b.mul(T, k.i64(rows.attn.Hkv)), b.sext(k.arg["nth"], i64))
    return b.and_(few, b.icmp_signed("<=", T, k.i64(SPLIT_T)))


def n_parts(rows: Rows) -> ir.Value:
    """Key ranges of a split step: one per thread, at most SPLIT_MAX."""
    k, b = rows.k, rows.b
    nth = b.sext(k.arg["nth"], i64)
    return b.select(b.icmp_signed("<", nth, k.i64(SPLIT_MAX)), nth, k.i64(SPLIT_MAX))


def part_range(rows: Rows, lo, hi, part) -> tuple[ir.Value, ir.Value]:
    """Range ``part`` of the n_parts equal cuts of keys [lo, hi)."""
    k, b = rows.k, rows.b
    n, length = n_parts(rows), b.sub(hi, lo)
    return (k.add(lo, b.sdiv(k.mul(length, part), n)), k.add(lo, b.sdiv(k.mul(length, k.add(part, 1)), n)))


def partial_row(rows: Rows, part, r):
    """Where query row r's partial result of key range ``part`` lives: f32 {max, sum, acc[Dv]}."""
    k, attn = rows.k, rows.attn
    slot = k.add(k.mul(part, SPLIT_T * attn.H), r)
    return k.addr(k.arg["partial"], k.mul(slot, 4 * (attn.Dv + 2)))


def _work_before(rows: Rows, r) -> ir.Value:
    """Work in rows 0..r-1 of T*H: visible (query row, key) pairs plus ROW_COST per row.

    Token t sees keys(t) = min(P + t + 1, window) keys; the first m = clamp(window - P - 1, 0, t)
    tokens are below the window, the rest see exactly `window`."""
    k, b, attn = rows.k, rows.b, rows.attn
    t, h = b.udiv(r, k.i64(attn.H)), b.urem(r, k.i64(attn.H))
    P1 = k.add(k.arg["P"], 1)

    def clamp(v, lo, hi):
        return b.select(b.icmp_signed("<", v, lo), lo, b.select(b.icmp_signed(">", v, hi), hi, v))
    if attn.window is None:
        m, keys = t, k.add(P1, t)
    else:
        m = clamp(b.sub(k.i64(attn.window), P1), k.i64(0), t)
        keys = clamp(k.add(P1, t), k.i64(0), k.i64(attn.window))
    tri = b.sdiv(k.mul(m, b.sub(m, k.i64(1))), k.i64(2))
    tokens = k.add(k.mul(m, P1), tri, k.mul(b.sub(t, m), attn.window or 0))
    return k.add(k.mul(tokens, attn.H), k.mul(h, keys), k.mul(r, ROW_COST))


def balanced_share(rows: Rows) -> tuple[ir.Value, ir.Value]:
    """This thread's [start, end) of the T*H query rows, cut so that every thread gets about
    the same number of visible (query, key) pairs (a contiguous split would give the thread
    holding the last tokens most of the causal triangle). Cuts fall between groups of the G
    heads that share a kv head, so every row is computed the same way whatever the thread
    count. Boundaries come from a binary search on `_work_before`, the same function for
    every thread, so shares tie up exactly."""
    k, b = rows.k, rows.b
    G = rows.attn.H // rows.attn.Hkv
    n = b.mul(k.arg["T"], k.i64(rows.attn.Hkv))                       # groups
    if rows.attn.slot_rows:                                           # positions vary by sequence: equal shares
        start, end = k.thread_share(n)
        return k.mul(start, G), k.mul(end, G)
    total = _work_before(rows, k.mul(n, G))
    ith, nth = b.sext(k.arg["ith"], i64), b.sext(k.arg["nth"], i64)

    def boundary(i):
        goal = b.sdiv(k.mul(total, i), nth)                           # first group whose prefix reaches it
        lo, hi = k.var(i64, k.i64(0)), k.var(i64, n)
        head, body, done = (k.fn.append_basic_block(f"split.{x}") for x in ("head", "body", "done"))
        b.branch(head)
        b.position_at_end(head)
        b.cbranch(b.icmp_signed("<", lo.get(), hi.get()), body, done)
        b.position_at_end(body)
        mid = b.sdiv(k.add(lo.get(), hi.get()), k.i64(2))
        reached = b.icmp_signed(">=", _work_before(rows, k.mul(mid, G)), goal)
        hi.set(b.select(reached, mid, hi.get()))
        lo.set(b.select(reached, lo.get(), k.add(mid, 1)))
        b.branch(head)
        b.position_at_end(done)
        return lo.get()
    start = boundary(ith)
    end = b.select(b.icmp_signed("==", k.add(ith, 1), nth), n, boundary(k.add(ith, 1)))
    return k.mul(start, G), k.mul(end, G)


def emit_combine(module, target: Target, attn: Attention, rope: Rope | None, name: str, args) -> None:
    """out[r] = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i over the key ranges i of row r
    (M the largest m_i); nothing when the step did not split. Threads split rows."""
    k = open_kernel(module, name, args)
    rows = Rows(k, target, attn, None, name)
    b, isa, lanes = k.b, rows.isa, rows.lanes
    with k.if_then(splitting(rows)):
        n = n_parts(rows)
        start, end = k.thread_share(b.mul(k.arg["T"], k.i64(attn.H)))
        with k.loop(start, end, name="row") as r:
            sink = rows.sink(b.urem(r, k.i64(attn.H))) if attn.sinks else None     # the head's sink logit
            top = k.var(f32, -math.inf if sink is None else sink)
            with k.loop(0, n, name="max") as i:
                top.set(isa.maxnum(top.get(), k.load(f32, partial_row(rows, i, r))))
            if rows.mods:                                              # every key hidden: zeros, not NaN
                ninf = b.fcmp_ordered("==", top.get(), ir.Constant(f32, -math.inf))
                top.set(b.select(ninf, ir.Constant(f32, 0.0), top.get()))
            total = k.var(f32, 0.0 if sink is None else vmath.libm(isa, "exp", b.fsub(sink, top.get())))
            with k.loop(0, n, name="sum") as i:
                src = partial_row(rows, i, r)
                w = vmath.libm(isa, "exp", b.fsub(k.load(f32, src), top.get()))
                total.set(isa.fma(w, k.load(f32, src, 4), total.get()))
            out = rows.row(k.arg["out"], r, attn.Dv)
            inv = rows.inverse(total.get())

            def mix(off, widths):
                o = 0
                for wd in widths:
                    at = k.mul(k.add(off, o), 4)
                    acc = k.var(typ(wd), zeros(wd))
                    with k.loop(0, n, name="part") as i:
                        src = partial_row(rows, i, r)
                        w = vmath.libm(isa, "exp", b.fsub(k.load(f32, src), top.get()))
                        acc.set(isa.fma(splat(k, b.fmul(w, inv), wd), k.load(typ(wd), k.addr(src, 8), at), acc.get()))
                    k.store(acc.get(), out, at)
                    o += wd
            chunked(k, attn.Dv, lanes, 1, mix, "dv")
    k.finish()
