"""Kernel B's vector walk: the query heads that share a kv head (GQA) go together, so each K and V
row is read once for all of them, and walk the visible keys once in blocks of BLOCK with an online
softmax: per block the scores, their max m, p = exp(s - m), one rescale of the accumulators by
exp(m_old - m), then p·V. Threads' shares of rows are whole groups.
"""
from __future__ import annotations

import math

from llvmlite import ir

from ggraph.backends.llvm.kernels import vmath
from ggraph.backends.llvm.kernels.attention.params import BLOCK, PREFETCH_KEYS
from ggraph.backends.llvm.kernels.attention.rows import (At, Rows, buffer, chunked, const_lanes, extract_lane,
                                                         first_lanes, i32_of, key_range, modded, pow2, seen, splat,
                                                         typ, width_of, zeros)
from ggraph.backends.llvm.kernels.attention.split import part_range, partial_row
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i32, vec
from ggraph.backends.llvm.kernels.kv_rows import KVRow


def attention_grouped(rows: Rows, share, part) -> None:
    """The G query rows (t, h) that share a kv head walk the keys together, so K and V rows are
    read once for all of them; ``share`` is whole groups. With ``part``, only that range of
    each row's keys is walked and the partial result is stored for kernel C."""
    k, attn = rows.k, rows.attn
    G = attn.H // attn.Hkv
    NP = pow2(G)
    bufs = {"q": buffer(k, G * attn.D), "s": buffer(k, BLOCK * NP), "acc": buffer(k, G * attn.Dv)}
    start, end = share
    with k.loop(start, end, step=G, name="group") as r:
        _run(rows, bufs, r, G, part)


def _keys_per_step(rows: Rows, n: int) -> int:
    """Keys whose scores one step of the score loop computes: enough that (keys x padded queries)
    accumulators fill a vector of sums, which `_lane_sums` then reduces together."""
    return max(1, min(BLOCK, rows.lanes // pow2(n)))


def _run(rows: Rows, bufs: dict, r, n: int, part) -> None:
    """Query rows r..r+n-1 (one token, one kv head): rope, then the keys in blocks of BLOCK that
    start at multiples of BLOCK, keys before the window masked, as query tiles take them (with
    ``part``: that range of them, from its start, the unnormalised result stored as a partial).

    A block's scores are kept key-major, s[jj][i] for key jj and query i (queries padded to NP,
    a power of two), so the online softmax runs down the block with NP-lane vectors, one lane
    per query: no horizontal max or sum, and p[jj][i] is where p·V reads it."""
    k, b, attn = rows.k, rows.b, rows.attn
    NP = pow2(n)
    t, g = b.udiv(r, k.i64(attn.H)), b.udiv(b.urem(r, k.i64(attn.H)), k.i64(attn.H // attn.Hkv))
    p, bufs["kc"], bufs["vc"] = rows.token(t)
    qrow = lambda i: k.addr(bufs["q"], 4 * i * attn.D)                  # noqa: E731
    arow = lambda i: k.addr(bufs["acc"], 4 * i * attn.Dv)               # noqa: E731
    rows.rope_rows([(rows.row(k.arg["q"], k.add(r, i), attn.D), qrow(i)) for i in range(n)],
                   rows.position(t), attn.scale)
    lo, hi = key_range(rows, p)
    if part is not None:
        lo, hi = part_range(rows, lo, hi, part)
        first = lo
    else:                                       # blocks at multiples of BLOCK, as query tiles take them
        first = b.mul(b.sdiv(lo, k.i64(BLOCK)), k.i64(BLOCK))

    def zero(off, widths):
        o = 0
        for w in widths:
            for i in range(n):
                k.store(zeros(w), arow(i), k.mul(k.add(off, o), 4))
            o += w
    chunked(k, attn.Dv, rows.lanes, 1, zero, "zero")
    vnp = typ(NP)
    m = k.var(vnp, const_lanes(NP, -math.inf))
    total = k.var(vnp, zeros(NP))
    h0 = k.mul(g, attn.H // attn.Hkv) if attn.sinks or rows.mods else None   # the group's first query head
    if attn.sinks and part is None:                                     # a split step's sinks wait for kernel C
        m.set(first_lanes(k, [rows.sink(k.add(h0, i)) for i in range(n)], NP, -math.inf))
        total.set(first_lanes(k, [ir.Constant(f32, 1.0)] * n, NP, 0.0))
    if rows.mods:
        heads = i32_of(k, h0) if NP == 1 else b.add(k.splat(i32_of(k, h0), NP),
                                                      ir.Constant(vec(i32, NP), list(range(NP))))
        where = At(rows.batch(t), heads, i32_of(k, p), None)
    KB = _keys_per_step(rows, n)
    with k.loop(first, hi, step=BLOCK, name="blk") as j0:
        nk = b.sub(hi, j0)
        nk = b.select(b.icmp_signed("<", nk, k.i64(BLOCK)), nk, k.i64(BLOCK))
        with k.loop(0, nk, step=KB, name="key") as jj:
            _scores(rows, bufs, qrow, n, j0, jj, hi, g, KB)
        live = [b.and_(b.icmp_signed("<", k.i64(jj), nk), b.icmp_signed(">=", k.add(j0, jj), lo)) for jj in range(BLOCK)]
        srows = []
        for jj in range(BLOCK):                                         # the live keys' scores
            at = At(where.b, where.h, where.q, i32_of(k, k.add(j0, jj))) if rows.mods else None
            sj = modded(rows, k.load(vnp, bufs["s"], 4 * jj * NP), at)
            mask = seen(rows, at, NP) if rows.mods else None
            cond = live[jj] if mask is None else b.and_(splat(k, live[jj], NP), mask)
            srows.append(b.select(cond, sj, const_lanes(NP, -math.inf)))
        corr = softmax_step(rows, srows, m, total, bufs["s"])                # p over s, in place
        _values(rows, bufs, arow, n, j0, nk, g, [extract_lane(k, corr, i) for i in range(n)])

    ms, totals = [extract_lane(k, m.get(), i) for i in range(n)], [extract_lane(k, total.get(), i) for i in range(n)]
    if part is not None:
        for i in range(n):
            dst = partial_row(rows, part, k.add(r, i))
            k.store(ms[i], dst)
            k.store(totals[i], dst, 4)
            k.intrinsic("llvm.memcpy.p0.p0.i64", ir.VoidType(),
                        [k.addr(dst, 8), arow(i), k.i64(4 * attn.Dv), ir.Constant(ir.IntType(1), 0)])
        return
    invs = [rows.inverse(totals[i]) for i in range(n)]

    def finish(off, widths):
        o = 0
        for w in widths:
            for i in range(n):
                at = k.mul(k.add(off, o), 4)
                out = rows.row(k.arg["out"], k.add(r, i), attn.Dv)
                k.store(b.fmul(k.load(typ(w), arow(i), at), splat(k, invs[i], w)), out, at)
            o += w
    chunked(k, attn.Dv, rows.lanes, 1, finish, "out")


def softmax_step(rows: Rows, srows: list, m, total, pbuf) -> ir.Value:
    """One block of the online softmax over its masked scores (one value or vector per key, a lane
    per query row): the running max ``m`` and sum ``total`` move on, p = exp(s - max) goes to
    pbuf key by key, and the factor the accumulators must be rescaled by is returned. A lane that
    has seen no key yet (max -inf) takes p = 0 and a factor of 0 rather than exp(-inf + inf)."""
    b, isa = rows.b, rows.isa
    w = width_of(srows[0])
    top = srows[0]
    for sj in srows[1:]:
        top = isa.maxnum(top, sj)
    m_old = m.get()
    m_new = isa.maxnum(m_old, top)
    m_use = b.select(b.fcmp_ordered("==", m_new, const_lanes(w, -math.inf)), zeros(w), m_new)
    corr = vmath.exp(isa, b.fsub(m_old, m_use))
    block_sum = None
    for jj, sj in enumerate(srows):
        pj = vmath.exp(isa, b.fsub(sj, m_use))
        block_sum = pj if block_sum is None else b.fadd(block_sum, pj)
        rows.k.store(pj, pbuf, 4 * jj * w)
    total.set(isa.fma(total.get(), corr, block_sum))
    m.set(m_new)
    return corr


def _scores(rows: Rows, bufs: dict, qrow, n: int, j0, jj, hi, g, KB: int) -> None:
    """s[jj + kk][i] = q_i · k_(j0+jj+kk) for KB keys and the n queries, each chunk of a K row
    loaded once for all queries. Keys past ``hi`` (a partial last step) read row hi-1 and their
    scores are masked by the caller."""
    k, b, isa, attn, lanes = rows.k, rows.b, rows.isa, rows.attn, rows.lanes
    NP = pow2(n)
    last = b.sub(hi, k.i64(1))
    krows = []
    for kk in range(KB):
        j = k.add(j0, jj, kk)
        ahead = k.add(k.mul(k.add(j, PREFETCH_KEYS), attn.Hkv), g)       # the next block's rows, on their way
        rows.keys.prefetch(rows.keys.at(bufs["kc"], ahead))
        rows.values.prefetch(rows.values.at(bufs["vc"], ahead))
        j = b.select(b.icmp_signed(">", j, last), last, j) if kk else j
        krows.append(rows.keys.at(bufs["kc"], k.add(k.mul(j, attn.Hkv), g)))
    acc = [[k.var(vec(f32, lanes), zeros(lanes)) for _ in range(n)] for _ in range(KB)]

    def dot(off, widths):
        pieces = [rows.keys.loads(krow, off, widths) for krow in krows]        # a block's pieces share its scale
        o = 0
        for c, w in enumerate(widths):
            at = k.mul(k.add(off, o), 4)
            kvs = [kp[c] for kp in pieces]
            for i in range(n):
                qv = k.load(typ(w), qrow(i), at)
                for kk in range(KB):
                    a = acc[kk][i]
                    if w == lanes:
                        a.set(isa.fma(kvs[kk], qv, a.get()))
                    else:                                               # a narrow tail, zero-padded
                        prod = b.fmul(kvs[kk], qv)
                        wide = k.shuffle(prod, list(range(w)) + [w] * (lanes - w), zeros(w)) if w > 1 else \
                            b.insert_element(zeros(lanes), prod, ir.Constant(i32, 0))
                        a.set(b.fadd(a.get(), wide))
            o += w
    chunked(k, attn.D, lanes, unroll(rows.keys, lanes, 1 if KB * n >= 4 else 2), dot, "d")
    sums = [a.get() if i < n else zeros(lanes) for kk in range(KB) for i, a in
            enumerate(acc[kk] + [None] * (NP - n))]
    per = min(len(sums), lanes)                                         # vectors reduced together
    for c in range(0, len(sums), per):
        k.store(_lane_sums(k, sums[c:c + per]), bufs["s"], k.mul(k.add(k.mul(jj, NP), c), 4))


def unroll(row: KVRow, lanes: int, want: int, most: bool = False) -> int:
    """Vectors per step of a loop over a row's values: ``want``, adjusted for a block type so that
    each step's pieces lie in one block (they share its scale): a whole block per step, or with
    ``most`` (a register budget) at most ``want`` vectors that divide one."""
    if row.dt.block_size == 1 or lanes >= 32:
        return want
    per_block = 32 // lanes
    if not most:
        return per_block * max(1, want // per_block)
    return max(u for u in range(1, per_block + 1) if per_block % u == 0 and u <= max(want, 1))


def _lane_sums(k: Kernel, vs: list) -> ir.Value:
    """A vector whose lane i is the sum of the lanes of vs[i] (len(vs) a power of two, at most
    the lane count): pairs of vectors fold half of every group of lanes onto the other half and
    merge, so each add serves all the sums at once, then the single vector folds down to len(vs)
    lanes. Where len(vs) == 1 this is the plain halving sum."""
    b = k.b
    W = width_of(vs[0])
    if W == 1:
        return vs[0]
    group = W                                                          # lanes per source in each vector
    while len(vs) > 1:
        half, nxt = group // 2, []
        for x, y in zip(vs[0::2], vs[1::2]):
            firsts = [gi * group + l for gi in range(W // group) for l in range(half)]
            lo = firsts + [W + i for i in firsts]
            hi = [i + half for i in firsts] + [W + i + half for i in firsts]
            nxt.append(b.fadd(k.shuffle(x, lo, y), k.shuffle(x, hi, y)))
        vs, group = nxt, half
    v = vs[0]
    while group > 1:
        half = group // 2
        firsts = [gi * group + l for gi in range(width_of(v) // group) for l in range(half)]
        v = b.fadd(k.shuffle(v, firsts), k.shuffle(v, [i + half for i in firsts]))
        group = half
    return v if width_of(v) > 1 else b.extract_element(v, ir.Constant(i32, 0))


def _values(rows: Rows, bufs: dict, arow, n: int, j0, nk, g, corr: list) -> None:
    """acc_i = acc_i * corr_i + sum_jj p[jj][i] v_(j0+jj), a group of Dv chunks in registers at a time."""
    k, isa, attn, lanes = rows.k, rows.isa, rows.attn, rows.lanes
    NP = pow2(n)
    per = unroll(rows.values, lanes, max(1, (16 if lanes >= 16 else 8) // n), most=True)   # accumulators in registers

    def group(off, widths):
        ats = [k.mul(k.add(off, sum(widths[:c])), 4) for c in range(len(widths))]
        accs = [[k.var(typ(w), k.b.fmul(k.load(typ(w), arow(i), at), splat(k, corr[i], w)))
                 for w, at in zip(widths, ats)] for i in range(n)]
        with k.loop(0, nk, name="val") as jj:
            vrow = rows.values.at(bufs["vc"], k.add(k.mul(k.add(j0, jj), attn.Hkv), g))
            vs = rows.values.loads(vrow, off, widths)
            for i in range(n):
                pij = k.load(f32, bufs["s"], k.mul(k.add(k.mul(jj, NP), i), 4))
                for a, v, w in zip(accs[i], vs, widths):
                    a.set(isa.fma(splat(k, pij, w), v, a.get()))
        for i in range(n):
            for a, at in zip(accs[i], ats):
                k.store(a.get(), arow(i), at)
    chunked(k, attn.Dv, lanes, per, group, "vg")
