"""The quantised matmul for one token (Method.GEMV), and gemv's arithmetic for every token of a
rows_only step (Method.GEMV_ROWS): one output row at a time, f32 lanes along K.

A step dots ``plan.chunks_per_step`` 32-weight chunks of a block (with AVX-512 VNNI, the format's
``wide`` pairs that one 64-byte load holds, against a copy of the activations in that order).
Super-block types sum a block's dots times their integer scales in i32 lanes (two steps' dots
packed to i16 words per vpdpwssd) and their mins in integers, as llama.cpp does, and take one
float step per block; q4_k and q5_k unpack the headers of HEADER_BLOCKS blocks at once. 32-weight
blocks go SMALL_GROUP at a time (scales and mins as vectors), two to a 512-bit dot, gathered with
AVX-512 VNNI by word shuffles of 64-byte loads; their f32 sum is ggml's x86 vec_dot's at every
vector width (one 8-lane accumulator, or two: TWO_ACCUMULATORS; one FMA per block, in order).
Rows of up to GEMV_INLINE_BLOCKS blocks are emitted without a block loop. Weights are prefetched
as ``plan.prefetch`` says.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ggraph.backends.llvm.kernels.blocks import Run
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i8, i16, i32, vec
from ggraph.backends.llvm.kernels.isa import Isa
from ggraph.backends.llvm.kernels.plan import consecutive
from ggraph.backends.llvm.kernels.qmatmul.context import Matmul
from ggraph.backends.llvm.target import Prefetch

PREFETCH_AHEAD = (2048, 4096)   # Prefetch.ROWS: bytes on from a row's start that it asks for, into L2
SPREAD_AHEAD = 8192             # Prefetch.SPREAD: bytes ahead of each group of blocks, into L2
SMALL_T = 8                     # tokens whose accumulators a rows_only step keeps in registers at once
SMALL_GROUP = 8                 # 32-weight blocks a gemv row takes together (one float step for all)
HEADER_BLOCKS = 4               # q4_k / q5_k super-blocks whose headers a gemv row unpacks together
GEMV_INLINE_BLOCKS = 8          # rows of at most this many blocks have no block loop (longer ones outgrow the op cache)
# 32-weight types whose ggml x86 vec_dot keeps even and odd blocks in two 8-lane accumulators (added
# before the final hsum); the others keep one
TWO_ACCUMULATORS = ("iq4_nl", "mxfp4")
CHAIN_ROWS = 4                  # rows of 32-weight blocks a gemv takes side by side (their FMA chains overlap)


def gemv(m: Matmul, rows, xorder=None) -> None:
    """One output row at a time, for the one token there is (its quants in step order at ``xorder``,
    if given); 32-weight blocks CHAIN_ROWS rows at a time (ggml's one f32 chain per row is FMA latency:
    the rows' chains overlap, and their offset terms are computed once)."""
    k = m.k
    if m.fmt.dtype.block_size != 32:
        with k.loop(*rows, name="n") as row:
            gemv_row(m, row, 1, 0, xorder)
        return
    start, end = rows
    b = k.b
    whole = k.add(start, b.mul(b.sdiv(b.sub(end, start), k.i64(CHAIN_ROWS)), k.i64(CHAIN_ROWS)))
    with k.loop(start, whole, step=CHAIN_ROWS, name="nr") as row:
        gemv_row(m, row, 1, 0, xorder, count=CHAIN_ROWS)
    with k.loop(whole, end, name="n") as row:
        gemv_row(m, row, 1, 0, xorder)


def steps_order(m: Matmul) -> ir.Value | None:
    """A private copy of the token's quants with each block's chunks in the order of the plan's
    steps, so that a step's activations are one load; None where the steps take the chunks in order."""
    k, lay = m.k, m.lay
    order = [c for step in m.plan.steps for c in step]
    if order == sorted(order):
        return None
    xs = k.scratch(i8, lay.K)
    bs = m.fmt.dtype.block_size
    with k.loop(0, lay.K // bs, name="xblk") as blk:
        for at, c in enumerate(order):
            k.store(k.load(vec(i8, 32), k.arg["xq"], k.add(k.mul(blk, bs), 32 * c)), xs, k.add(k.mul(blk, bs), 32 * at))
    return xs


def _dot(m: Matmul, dec, w, blk, step: int, chunks: tuple, init, xbase):
    """(dot(w, x) - offset*sum(x) per i32 lane, each lane's sub-block) for gemv step ``step``, which
    takes ``chunks``; x is in step order at ``xbase``."""
    k, fmt = m.k, m.fmt
    P = len(chunks)
    lanes = 8 * P
    lane_sub = [(32 * chunks[j // 8] + 4 * (j % 8)) // fmt.sub for j in range(lanes)]   # each i32 lane's sub-block
    if init is None:
        start = ir.Constant(vec(i32, lanes), [0] * lanes)
    else:                                                   # -offset*sum(x) in each sub-block's first lane
        subs = init.type.count
        first = [s if j == 0 or s != lane_sub[j - 1] else subs for j, s in enumerate(lane_sub)]
        start = k.shuffle(init, first, ir.Constant(vec(i32, subs), [0] * subs))
    xv = k.load(vec(i8, 4 * lanes), xbase, k.add(k.mul(blk, fmt.dtype.block_size), 32 * P * step))
    return m.isa.dot(start, w, xv, dec.signed, dec.qmax), lane_sub                # (lanes,) i32


def gemv_all_rows(m: Matmul, rows) -> None:
    """Any T with one activation row per token (``rows_only``): per output row, the tokens in
    groups of SMALL_T and then the rest, each token computed as gemv computes one token alone,
    whatever else shares the step; the row's weights stay in cache across its groups."""
    k = m.k
    b = k.b
    T = k.arg["T"]
    groups = b.sdiv(T, k.i64(SMALL_T))
    with k.loop(*rows, name="n") as row:
        with k.loop(0, groups, name="tg") as g:
            gemv_row(m, row, SMALL_T, k.mul(g, SMALL_T))
        rest = b.sub(T, k.mul(groups, SMALL_T))
        _by_count(k, rest, range(1, SMALL_T), lambda n: gemv_row(m, row, n, b.sub(T, k.i64(n))))


def _by_count(k: Kernel, count, counts, body) -> None:
    """``body(n)`` for the n in ``counts`` that ``count`` (an i64) equals; nothing for other values."""
    b = k.b
    blocks = {n: k.fn.append_basic_block(f"count{n}") for n in counts}
    done = k.fn.append_basic_block("count.done")
    switch = b.switch(count, done)
    for n, block in blocks.items():
        switch.add_case(k.i64(n), block)
        b.position_at_end(block)
        body(n)
        b.branch(done)
    b.position_at_end(done)


def gemv_row(m: Matmul, row, n: int, t0, xorder=None, count: int = 1) -> None:
    """Output row ``row`` (and the ``count`` - 1 after it, each on its own, their blocks interleaved)
    for exactly n tokens from token t0 (rows of xq ``group_bytes(1)`` apart):
    integer dots per step, scaled into f32 lanes (super-block types first sum their sub-blocks in i32
    lanes times their integer scales and take one f32 step per block), the K-quant mins in a separate
    accumulator, the same arithmetic for each token whatever n is. ``xorder``: the one token's quants
    in the order of the plan's steps (n == 1), where that is not the natural order."""
    k, fmt, lay, plan = m.k, m.fmt, m.lay, m.plan
    b = k.b
    P = plan.chunks_per_step
    subs = m.subs
    small = fmt.dtype.block_size == 32                  # 32-weight blocks: SMALL_GROUP at a time
    S = plan.blocks_per_dot                             # ... and S of them per dot
    # 32-weight blocks: ggml's 8-lane f32 accumulator(s), [even blocks | odd blocks] where it keeps two
    lanes = (16 if fmt.dtype.name in TWO_ACCUMULATORS else 8) if small else 8 * P
    mlanes = subs // 2 * (HEADER_BLOCKS if fmt.headers else 1) if fmt.int_mins else (SMALL_GROUP if small else subs)
    first = k.addr(k.arg["xq"], k.mul(t0, lay.group_bytes(1)))
    xts = [k.addr(first, t * lay.group_bytes(1)) for t in range(n)]
    rs = []
    for i in range(count):
        _prefetch_row(m, k.add(row, i))
        rs.append(_GemvRow(m, k.add(row, i), plan.steps if xorder is not None else consecutive(fmt, P), xts,
                           [xorder] if xorder is not None else xts,
                           [k.var(vec(f32, lanes), ir.Constant(vec(f32, lanes), [0.0] * lanes)) for _ in range(n)],
                           [k.var(vec(f32, mlanes), ir.Constant(vec(f32, mlanes), [0.0] * mlanes)) for _ in range(n)],
                           lanes, mlanes, S))
    nblocks = lay.K // fmt.dtype.block_size
    if small:
        _in_groups(k, nblocks, SMALL_GROUP, SMALL_GROUP, lambda blk0, G: [_small_group(r, blk0, G) for r in rs])
    elif fmt.headers is not None:
        if not (fmt.int_mins and fmt.sub == 32 and lay.has_sums32):
            raise ValueError(f"qmatmul {fmt.dtype.name}: header groups take 32-weight sub-blocks with integer "
                             f"mins and q8_k's sums of 32, which this format lacks")
        _in_groups(k, nblocks, HEADER_BLOCKS, GEMV_INLINE_BLOCKS,
                   lambda blk0, G: [_header_group(r, blk0, G) for r in rs])
    else:
        _in_groups(k, nblocks, 1, GEMV_INLINE_BLOCKS, lambda blk, _: [_block(r, blk) for r in rs])
    for r in rs:
        for t, (acc, macc) in enumerate(zip(r.accs, r.maccs)):
            at = k.mul(k.add(k.mul(k.add(t0, t), m.N), r.row), 4)
            k.store(b.fsub(m.isa.hsum(acc.get()), m.isa.hsum(macc.get())), k.arg["y"], at)


@dataclass
class _GemvRow:
    """What the block drivers of one gemv row share."""

    m: Matmul
    row: ir.Value
    steps: list                # the chunks each step dots together
    xts: list                  # each token's activation row
    quants: list               # where each token's step activations are (its row, or the xorder copy)
    accs: list                 # each token's accumulator (``lanes`` f32)
    maccs: list                # ... of its mins and offset terms (``mlanes`` f32), subtracted at the end
    lanes: int
    mlanes: int
    S: int                     # 32-weight blocks per dot

    def block(self, blk) -> ir.Value:
        """Address of block ``blk`` of the row."""
        return self.m.row(self.row, blk)


def _block(r: _GemvRow, blk) -> None:
    """One block of the row, for each token."""
    m = r.m
    k, isa, fmt, lay, b, subs = m.k, m.isa, m.fmt, m.lay, m.k.b, m.subs
    dec = fmt.decode(k, isa, r.block(blk))
    terms = []                         # each token's dx, offset init, f32 scales and activation sums
    for xt, macc in zip(r.xts, r.maccs):
        dx = k.load(f32, xt, lay.d(k, 1, blk))
        xs = _xsums_row(m, blk, xt)                                           # (subs,) i32
        if fmt.int_mins:                               # sum_s min_s x xsum_s in integers, one float step
            mm = _word_pairs(k, isa, dec.ints.mins, xs)
            macc.set(isa.fma(b.sitofp(mm, vec(f32, subs // 2)), k.splat(b.fmul(dec.ints.dmin, dx), subs // 2), macc.get()))
        elif dec.mins is not None:
            macc.set(isa.fma(b.fmul(dec.mins, k.splat(dx, subs)), b.sitofp(xs, vec(f32, subs)), macc.get()))
        init = b.mul(xs, ir.Constant(vec(i32, subs), [-dec.offset] * subs)) if dec.offset else None
        terms.append((dx, init, None if dec.ints is not None else b.fmul(dec.scales, k.splat(dx, subs)), xs))
    if dec.ints is not None:
        dds = [k.splat(b.fmul(dec.ints.d, dx), r.lanes) for dx, _, _, _ in terms]
        _int_block(r, dec, blk, [t[1] for t in terms], dec.ints.scales, [t[3] for t in terms], dds)
    else:
        for step, chunks in enumerate(r.steps):         # each chunk decoded once, for every token
            w = k.concat(*[dec.chunk(c) for c in chunks])
            for xq, acc, (_, init, scales, _) in zip(r.quants, r.accs, terms):
                # acc += float(dot(w, x) - offset*sum(x)) * scale*dx, per lane
                dot, lane_sub = _dot(m, dec, w, blk, step, chunks, init, xq)
                acc.set(isa.fma(b.sitofp(dot, vec(f32, 8 * len(chunks))), k.shuffle(scales, lane_sub), acc.get()))


def _header_group(r: _GemvRow, blk0, G: int) -> None:
    """Blocks blk0 .. blk0+G-1 of the row, their headers unpacked together; the mins of all G in one step."""
    m = r.m
    k, isa, fmt, lay, b, subs = m.k, m.isa, m.fmt, m.lay, m.k.b, m.subs
    hd = fmt.headers(k, isa, [r.block(k.add(blk0, g)) for g in range(G)])
    _spread_prefetch(m, r.block(blk0), G)
    ddx = []
    for xt, macc in zip(r.xts, r.maccs):
        dx = k.load(vec(f32, G), xt, lay.d(k, 1, blk0))
        xs = k.load(vec(i16, subs * G), xt, lay.sums32(k, 1, k.mul(blk0, subs)))
        mm = isa.dot_pairs(ir.Constant(vec(i32, subs // 2 * G), [0] * (subs // 2 * G)), hd.mins, xs)
        dmx = k.shuffle(b.fmul(hd.dmin, dx), [g for g in range(G) for _ in range(subs // 2)])
        term = b.fmul(b.sitofp(mm, vec(f32, subs // 2 * G)), dmx)
        macc.set(b.fadd(macc.get(), _widen_lanes(k, term, r.mlanes)))    # a row's last blocks: upper lanes 0
        ddx.append(b.fmul(hd.d, dx))
    for g in range(G):
        blk = k.add(blk0, g)
        scales = b.zext(k.shuffle(hd.scales, range(subs * g, subs * (g + 1))), vec(i32, subs))
        _int_block(r, fmt.decode(k, isa, r.block(blk)), blk, [None] * len(r.xts), scales, [None] * len(r.xts),
                   [k.shuffle(dd, [g] * r.lanes) for dd in ddx])


def _small_group(r: _GemvRow, blk0, G: int) -> None:
    """G consecutive 32-weight blocks of the row: their scales, activation scales and sums and mins
    as G-lane vectors, the dots S blocks at a time (lanes 8j.. are block j's), each started from its
    offset term so that its lanes are ggml's exact sums of (level - offset) x q."""
    m = r.m
    k, isa, lay, b, S = m.k, m.isa, m.lay, m.k.b, r.S
    _spread_prefetch(m, r.block(blk0), G)
    if G == SMALL_GROUP and m.plan.gathers:
        run = m.fmt.run(k, isa, r.block(blk0), G)                       # gathered from 64-byte loads
    else:
        run = Run.of_blocks(k, [m.fmt.decode(k, isa, r.block(k.add(blk0, g))) for g in range(G)])
    for xt, acc, macc in zip(r.xts, r.accs, r.maccs):
        dx = k.load(vec(f32, G), xt, lay.d(k, 1, blk0))
        ddx = b.fmul(run.d, dx)
        factor = xs = None                             # what the dots leave out, one lane a block: the mins
        if lay.keeps_s:                                # q8_1: min x s, ggml's fp16 s = dx xsum (subtracted)
            factor, xs = run.mins, lay.load_s(k, isa, xt, 1, blk0, G)
        elif run.mins is not None:                     # min x dx xsum (subtracted)
            factor, xs = b.fmul(run.mins, dx), b.sitofp(lay.load_sums(k, xt, 1, blk0, G), vec(f32, G))
        if factor is not None:
            macc.set(isa.fma(factor, xs, macc.get()) if r.mlanes == G else
                     b.fadd(macc.get(), _widen_lanes(k, b.fmul(factor, xs), r.mlanes)))
        # acc = fma(block's 8 lane dots, d dx, acc) block after block, as ggml's vec_dot sums them at any
        # width: a dot of S blocks is split into its blocks' 8-lane halves, so that the f32 rounding
        # (and a router's near tie after it) is ggml's on 512-bit targets too. Groups start at even blocks.
        two = r.lanes == 16
        halves = [k.shuffle(acc.get(), range(8 * h, 8 * h + 8)) for h in range(r.lanes // 8)]
        for s0 in range(0, G, S):
            n = min(S, G - s0)
            w = run.weights(s0, n)
            xv = k.load(vec(i8, 32 * n), xt, k.mul(k.add(blk0, s0), 32))
            if n < S:                                  # a row's odd last block: zero lanes after it
                w, xv = (k.concat(v, ir.Constant(v.type, [0] * v.type.count)) for v in (w, xv))
            dot = b.sitofp(isa.dot(_offset_lanes(k, isa, run.offset, xv), w, xv, run.signed, run.qmax),
                           vec(f32, 8 * S))
            for j in range(n):
                h = (s0 + j) % 2 if two else 0
                halves[h] = isa.fused(k.shuffle(dot, range(8 * j, 8 * j + 8)), k.shuffle(ddx, [s0 + j] * 8),
                                      halves[h])
        acc.set(k.concat(*halves) if two else halves[0])


def _offset_lanes(k: Kernel, isa: Isa, offset: int, xv: ir.Value) -> ir.Value:
    """-offset x (the sum of each 4 activations of ``xv``), one i32 lane per 4: a dot started from it
    gives each lane the exact sum of (level - offset) x q that ggml's signed lanes hold."""
    lanes = xv.type.count // 4
    zero = ir.Constant(vec(i32, lanes), [0] * lanes)
    if not offset:
        return zero
    as_u8 = ir.Constant(vec(i8, 4 * lanes), [offset - 256 if offset > 127 else offset] * (4 * lanes))
    return k.b.sub(zero, isa.dot(zero, as_u8, xv, False, offset))


def _spread_prefetch(m: Matmul, at: ir.Value, G: int) -> None:
    """With Prefetch.SPREAD, ask for the lines of the G blocks at ``at`` SPREAD_AHEAD bytes on."""
    if m.plan.prefetch is Prefetch.SPREAD:
        for line in range(0, G * m.fmt.dtype.type_size, 64):
            m.k.prefetch(m.k.addr(at, SPREAD_AHEAD + line), level=2)


def _widen_lanes(k: Kernel, v: ir.Value, n: int) -> ir.Value:
    """v with zero lanes after its own, to n lanes."""
    have = v.type.count
    return v if have == n else k.shuffle(v, [min(j, have) for j in range(n)], ir.Constant(v.type, [0] * have))


def _int_block(r: _GemvRow, dec, blk, inits, scales, xss, dds) -> None:
    """A super-block of each token (sub-blocks summed in i32 lanes times their integer ``scales``, then
    acc += float(sum) * dd): ``inits`` (offset terms), ``xss`` (activation sums) and ``dds`` (d x dx
    splat over the lanes) per token."""
    m = r.m
    k, isa, fmt = m.k, m.isa, m.fmt
    b = k.b
    lanes = dds[0].type.count
    subs = m.subs
    # where a lane of the dot fits i16, vpdpwssd applies the scales (see _scaled_sum). q6_k's
    # offset term (32 x the sub-block's activation sum) does not fit, so its dots leave it out
    # and the block adds sum_s scale_s x term_s once, in the same i32 lanes (no vpmulld per step)
    fits = isa.full_u8_dot and lanes in (8, 16)
    offset_apart = fits and dec.offset and _lane_bound(fmt, dec) >= 1 << 15 \
        and _lane_bound(fmt, dec, with_offset=False) < 1 << 15 and dec.offset * 128 < 1 << 15 \
        and subs in (lanes, 2 * lanes, 4 * lanes)
    pairs = fits and (offset_apart or _lane_bound(fmt, dec) < 1 << 15)
    dots = [[] for _ in r.quants]
    for step, chunks in enumerate(r.steps):
        w = k.concat(*[dec.chunk(c) for c in chunks])
        for t, (xq, init) in enumerate(zip(r.quants, inits)):
            dots[t].append(_dot(m, dec, w, blk, step, chunks, None if offset_apart else init, xq))
    for t, (acc, dd) in enumerate(zip(r.accs, dds)):
        isum = _scaled_sum(k, isa, scales, dots[t], pairs)
        if offset_apart:                                   # + sum_s (-offset x scale_s) x xsum_s, i16 pairs
            offset = b.mul(scales, ir.Constant(vec(i32, subs), [-dec.offset] * subs))
            extra = _word_pairs(k, isa, offset, xss[t])                               # (subs / 2,) i32
            while extra.type.count > lanes:
                half = extra.type.count // 2
                extra = b.add(k.shuffle(extra, range(half)), k.shuffle(extra, range(half, 2 * half)))
            if extra.type.count < lanes:                   # subs == lanes: the upper lanes add nothing
                extra = k.shuffle(extra, range(lanes), ir.Constant(extra.type, [0] * extra.type.count))
            isum = b.add(isum, extra)
        acc.set(isa.fma(b.sitofp(isum, vec(f32, lanes)), dd, acc.get()))


def _scaled_sum(k: Kernel, isa: Isa, scales: ir.Value, dots: list, pairs: bool) -> ir.Value:
    """sum over a block's steps of dot x its lanes' sub-block scales, in i32 lanes; ``dots``: (dot,
    lane_sub) per step. With ``pairs`` (every lane below 2**15) vpdpwssd applies the scales: two 16-lane
    steps' dots packed to i16 words (vpackssdw, exact) against their scales shuffled into place (one
    vpdpwssd per two steps), else each lane as (dot, sign) x (scale, 0), instead of vpmulld and an add."""
    b = k.b
    lanes = dots[0][0].type.count
    if pairs and lanes == 16 and len(dots) % 2 == 0:
        words = b.trunc(scales, vec(i16, scales.type.count))
        total = ir.Constant(vec(i32, lanes), [0] * lanes)
        for (da, sa), (db, sb) in zip(dots[::2], dots[1::2]):
            # vpackssdw: per 128-bit lane q, words 0-3 are da's lanes 4q..4q+3, words 4-7 db's
            subs = [(sa if r < 4 else sb)[4 * (w // 8) + r % 4] for w in range(32) for r in [w % 8]]
            total = isa.dot_pairs(total, isa.pack_i32(da, db), k.shuffle(words, subs))
        return total
    total = None
    words = b.and_(scales, ir.Constant(scales.type, [0xFFFF] * scales.type.count))
    for dot, lane_sub in dots:
        if pairs:
            total = isa.dot_pairs(total if total is not None else ir.Constant(vec(i32, lanes), [0] * lanes),
                                  k.cast_vec(dot, i16), k.cast_vec(k.shuffle(words, lane_sub), i16))
        else:
            scaled = b.mul(dot, k.shuffle(scales, lane_sub))
            total = scaled if total is None else b.add(total, scaled)
    return total


def _word_pairs(k: Kernel, isa: Isa, a: ir.Value, b: ir.Value) -> ir.Value:
    """a[2j]*b[2j] + a[2j+1]*b[2j+1] for two <n x i32> whose values fit i16: <n/2 x i32> (pmaddwd)."""
    n = a.type.count
    return isa.dot_pairs(ir.Constant(vec(i32, n // 2), [0] * (n // 2)), k.b.trunc(a, vec(i16, n)), k.b.trunc(b, vec(i16, n)))


def _in_groups(k: Kernel, nblocks: int, size: int, inline: int, body) -> None:
    """``body(first, count)`` over a row's blocks in groups of ``size`` (1: block by block): inline
    with constant indices for rows of at most ``inline`` blocks, else a loop over the whole groups
    and then the partial last one."""
    if nblocks <= inline:
        for g0 in range(0, nblocks, size):
            body(k.i64(g0), min(size, nblocks - g0))
        return
    whole = nblocks // size
    with k.loop(0, whole, name="blk") as gi:
        body(gi if size == 1 else k.mul(gi, size), size)
    if nblocks % size:
        body(k.i64(whole * size), nblocks % size)


def _lane_bound(fmt, dec, with_offset: bool = True) -> int:
    """The largest |value| of one i32 lane of a gemv dot: four |level| x 128 products, and (with the
    offset) in a sub-block's first lane the offset times the sub-block's activation sum."""
    level = 128 if dec.signed else (max(dec.qmax, dec.offset) if with_offset else dec.qmax)
    return 4 * level * 128 + (dec.offset * fmt.sub * 128 if with_offset else 0)


def _xsums_row(m: Matmul, blk, xbase) -> ir.Value:
    """Sums of the quantised activations per sub-block of block blk, one-token layout at ``xbase``: (subs,) i32."""
    k, fmt, lay = m.k, m.fmt, m.lay
    subs = m.subs
    per = fmt.sub // lay.sum_block
    if per == 2 and lay.has_sums32:                      # the layout's sums of 32 quants
        return k.b.sext(k.load(vec(i16, subs), xbase, lay.sums32(k, 1, k.mul(blk, subs))), vec(i32, subs))
    sums = lay.load_sums(k, xbase, 1, k.mul(blk, subs * per), subs * per)
    if per == 1:
        return sums
    return k.b.add(k.shuffle(sums, range(0, 2 * subs, 2)), k.shuffle(sums, range(1, 2 * subs, 2)))


def _prefetch_row(m: Matmul, n) -> None:
    """With Prefetch.ROWS, ask for the bytes PREFETCH_AHEAD on from the row's start, into L2
    (prefetches never fault past the end)."""
    if m.plan.prefetch is not Prefetch.ROWS:
        return
    k = m.k
    row_bytes = m.fmt.dtype.row_bytes(m.lay.K)
    for ahead in PREFETCH_AHEAD:
        base = k.add(k.mul(n, row_bytes), ahead)
        for off in range(0, row_bytes, 64):
            k.prefetch(k.addr(k.arg["w"], k.add(base, off)), level=2)
