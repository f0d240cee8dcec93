"""Kernel B for steps of several tokens (prefill), where the heads fit (`tiles_fit`): a tile is the G
heads of one kv head for lanes // G consecutive tokens, a lane per query row. Each block's K and
V rows are converted to f32 once for the tile; the scores take one FMA per head dim (the key's
value broadcast against the column of the tile's queries), summed in the grouped walk's order,
the softmax runs across lanes, and p·V adds p (a vector of rows) times each broadcast value
(faster than the grouped walk for prefill: docs/kernels.md has the measurement). Key blocks start
at multiples of BLOCK in both walks and lanes mask the keys they do not see, so a row's result is
the same bits whatever tile, thread count or step it falls in.
"""
from __future__ import annotations

import math

from llvmlite import ir

from ggraph.backends.llvm.kernels.attention.grouped import softmax_step, unroll
from ggraph.backends.llvm.kernels.attention.params import BLOCK, Attention
from ggraph.backends.llvm.kernels.attention.rows import (At, Rows, buffer, chunked, const_lanes, first_lanes, i32_of,
                                                         key_range, modded, seen, zeros)
from ggraph.backends.llvm.kernels.blocks import pack
from ggraph.backends.llvm.kernels.builder import f32, i32, i64, vec
from ggraph.backends.llvm.kernels.kv_rows import KVRow


def tiles_fit(attn: Attention, lanes: int) -> bool:
    """Whether kernel B's query tiles serve ``attn``: one vector of lanes holds whole groups of the G
    query heads of a kv head, the head dims are whole vectors, and the caches are not slotted."""
    G = attn.H // attn.Hkv
    return lanes > 1 and G <= lanes and attn.D % lanes == 0 and attn.Dv % lanes == 0 and not attn.slot_rows


def attention_tiles(rows: Rows) -> None:
    """Steps of several tokens (prefill), lanes as query rows: a tile is the G heads of one kv head
    for TQ = lanes // G consecutive tokens. Per block of BLOCK keys the K and V rows are converted
    once for all the tile's rows; the scores are one FMA per (key, dim) with the key's value
    broadcast against the column of the tile's (roped, transposed) queries, the online softmax runs
    lane by lane, and p.V adds p[key] (a vector of rows) times each broadcast value. Key blocks
    start at multiples of BLOCK and each lane masks the keys it does not see, so a row's result
    does not depend on which tokens or threads share its tile. Threads take tiles in turn."""
    k, b, attn, L = rows.k, rows.b, rows.attn, rows.lanes
    G = attn.H // attn.Hkv
    TQ = L // G
    T = k.arg["T"]
    units = b.mul(b.sdiv(k.add(T, TQ - 1), k.i64(TQ)), k.i64(attn.Hkv))
    ith, nth = b.sext(k.arg["ith"], i64), b.sext(k.arg["nth"], i64)
    bufs = {"q": buffer(k, L * attn.D), "qt": buffer(k, attn.D * L), "k": buffer(k, BLOCK * attn.D),
            "v": buffer(k, BLOCK * attn.Dv), "p": buffer(k, BLOCK * L), "acc": buffer(k, attn.Dv * L),
            "part": buffer(k, BLOCK * L * L)}
    turns = b.sdiv(k.add(units, b.sub(nth, k.i64(1))), nth)
    with k.loop(0, turns, name="turn") as turn:
        unit = k.add(k.mul(turn, nth), ith)
        with k.if_then(b.icmp_signed("<", unit, units)):
            _tile(rows, bufs, b.sdiv(unit, k.i64(attn.Hkv)), b.srem(unit, k.i64(attn.Hkv)), TQ)


def _tile(rows: Rows, bufs: dict, tb, g, TQ: int) -> None:
    """Tokens TQ*tb.. (those past T repeat the last, unstored) x the query heads of kv head g."""
    k, b, isa, attn, L = rows.k, rows.b, rows.isa, rows.attn, rows.lanes
    G, D, Dv = attn.H // attn.Hkv, attn.D, attn.Dv
    n = TQ * G
    vL = vec(f32, L)
    T = k.arg["T"]
    last = b.sub(T, k.i64(1))
    t0 = k.mul(tb, TQ)
    real = [b.icmp_signed("<", k.add(t0, tq), T) for tq in range(TQ)]
    toks = [b.select(r, k.add(t0, tq), last) for tq, r in enumerate(real)]
    qrow = lambda i: k.addr(bufs["q"], 4 * i * D)                                    # noqa: E731
    _, kc, vc = rows.token(toks[0])
    for tq, tok in enumerate(toks):
        heads = [(rows.row(k.arg["q"], k.add(k.mul(tok, attn.H), k.mul(g, G), gi), D), qrow(tq * G + gi))
                 for gi in range(G)]
        rows.rope_rows(heads, rows.position(tok), attn.scale)
    for i in range(n, L):                                                            # rows no query fills
        for c in range(D // L):
            k.store(zeros(L), qrow(i), 4 * c * L)
    for c in range(D // L):                                                          # qt[d][lane] = q[lane][d]
        cols = k.transpose([k.load(vL, qrow(i), 4 * c * L) for i in range(L)])
        for j, col in enumerate(cols):
            k.store(col, bufs["qt"], 4 * (c * L + j) * L)
    ranges = [key_range(rows, k.add(k.arg["P"], tok)) for tok in toks]
    lanes_of = lambda vals, pad: [b.trunc(vals[i // G], i32) if i < n else ir.Constant(i32, pad)  # noqa: E731
                                  for i in range(L)]
    lo_v = pack(k, lanes_of([lo for lo, _ in ranges], 0))
    hi_v = pack(k, lanes_of([hi for _, hi in ranges], 0))
    jhi = ranges[-1][1]
    jlo = b.mul(b.sdiv(ranges[0][0], k.i64(BLOCK)), k.i64(BLOCK))
    with k.loop(0, Dv, name="azero") as d:
        k.store(zeros(L), bufs["acc"], k.mul(d, 4 * L))
    m = k.var(vL, const_lanes(L, -math.inf))
    total = k.var(vL, zeros(L))
    h0 = k.mul(g, G) if attn.sinks or rows.mods else None                         # the group's first query head
    if attn.sinks:                                                                   # lane i: head h0 + i % G
        m.set(first_lanes(k, [rows.sink(k.add(h0, i % G)) for i in range(n)], L, -math.inf))
        total.set(first_lanes(k, [ir.Constant(f32, 1.0)] * n, L, 0.0))
    if rows.mods:
        heads = b.add(k.splat(i32_of(k, h0), L), ir.Constant(vec(i32, L), [i % G if i < n else 0 for i in range(L)]))
        where = At(ir.Constant(i32, 0), heads, pack(k, lanes_of([k.add(k.arg["P"], tok) for tok in toks], 0)), None)
    with k.loop(jlo, jhi, step=BLOCK, name="kblk") as j0:
        krows, vrows = [], []
        for jj in range(BLOCK):
            j = b.select(b.icmp_signed("<", k.add(j0, jj), jhi), k.add(j0, jj), b.sub(jhi, k.i64(1)))
            krows.append(rows.keys.at(kc, k.add(k.mul(j, attn.Hkv), g)))
            vrows.append(rows.values.at(vc, k.add(k.mul(j, attn.Hkv), g)))
        _rows_to(rows, rows.keys, krows, bufs["k"], D)
        _rows_to(rows, rows.values, vrows, bufs["v"], Dv)
        srows = []
        for jj, score in enumerate(_tile_scores(rows, bufs)):
            j = b.trunc(k.add(j0, jj), i32)
            live = b.and_(b.icmp_signed(">=", k.splat(j, L), lo_v), b.icmp_signed("<", k.splat(j, L), hi_v))
            at = At(where.b, where.h, where.q, j) if rows.mods else None
            mask = seen(rows, at, L) if rows.mods else None
            live = live if mask is None else b.and_(live, mask)
            srows.append(b.select(live, modded(rows, score, at), const_lanes(L, -math.inf)))
        corr = softmax_step(rows, srows, m, total, bufs["p"])
        ps = [k.load(vL, bufs["p"], 4 * jj * L) for jj in range(BLOCK)]
        step = 8 if Dv % 8 == 0 else 1
        with k.loop(0, Dv, step=step, name="pv") as d0:
            accs = [b.fmul(k.load(vL, bufs["acc"], k.mul(k.add(d0, dd), 4 * L)), corr) for dd in range(step)]
            for jj, pj in enumerate(ps):
                for dd in range(step):
                    vv = k.splat(k.load(f32, bufs["v"], k.mul(k.add(d0, jj * Dv + dd), 4)), L)
                    accs[dd] = isa.fma(pj, vv, accs[dd])
            for dd, a in enumerate(accs):
                k.store(a, bufs["acc"], k.mul(k.add(d0, dd), 4 * L))
    inv = rows.inverse(total.get())
    for c in range(Dv // L):                                                         # out[row][d] = acc[d][lane] / total
        outs = k.transpose([k.load(vL, bufs["acc"], 4 * (c * L + j) * L) for j in range(L)])
        for i in range(n):
            tq, gi = divmod(i, G)
            with k.if_then(real[tq]):
                r = k.add(k.mul(toks[tq], attn.H), k.mul(g, G), gi)
                value = b.fmul(outs[i], k.splat(b.extract_element(inv, ir.Constant(i32, i)), L))
                k.store(value, rows.row(k.arg["out"], r, Dv), 4 * c * L)


def _tile_scores(rows: Rows, bufs: dict) -> list:
    """The block's BLOCK keys against every lane's query, summed in the order of grouped.py's
    `_scores`: lane l of a D chunk accumulates dims l, l + lanes, ... in turn, and its `_lane_sums`
    folds the lanes in halves (l + lanes/2 onto l, then l + lanes/4, ...), so a row gets the bits
    the one-token path gives it. The partial sums of one l go for all keys at once (each query column loaded once for
    BLOCK keys) into a buffer, and are folded key by key."""
    k, b, isa, attn, L = rows.k, rows.b, rows.isa, rows.attn, rows.lanes
    vL = vec(f32, L)
    with k.loop(0, L, name="sl") as lane:
        parts = [k.var(vL, zeros(L)) for _ in range(BLOCK)]
        with k.loop(0, attn.D, step=L, name="sd") as d0:
            d = k.add(d0, lane)
            qv = k.load(vL, bufs["qt"], k.mul(d, 4 * L))
            for jj, part in enumerate(parts):
                kv = k.splat(k.load(f32, bufs["k"], k.mul(k.add(d, jj * attn.D), 4)), L)
                part.set(isa.fma(kv, qv, part.get()))
        for jj, part in enumerate(parts):
            k.store(part.get(), bufs["part"], k.add(k.mul(lane, 4 * L), 4 * L * L * jj))
    scores = []
    for jj in range(BLOCK):
        sums = [k.load(vL, bufs["part"], 4 * L * (L * jj + lane)) for lane in range(L)]
        while len(sums) > 1:
            half = len(sums) // 2
            sums = [b.fadd(sums[i], sums[i + half]) for i in range(half)]
        scores.append(sums[0])
    return scores


def _rows_to(rows: Rows, kv: KVRow, addrs: list, dst, n: int) -> None:
    """The f32 values of cache rows ``addrs`` into dst[row][0:n]."""
    k = rows.k

    def copy(off, widths):
        for r, row in enumerate(addrs):
            o = 0
            for piece, w in zip(kv.loads(row, off, widths), widths):
                k.store(piece, dst, k.mul(k.add(off, o + r * n), 4))
                o += w
    chunked(k, n, rows.lanes, unroll(kv, rows.lanes, 1), copy, "conv")
