"""The quantised matmul's T >= MIN_T path on AMX tiles (``plan.tiles``), for super-block types.

A tile multiply adds 16 tokens' activations (read in place from act_quant's one-row-per-token
layout) times 16 weight rows in VNNI order, decoded once per tile of rows into a private panel
(``TilePanel``; from the file's layout, or from rows16, whose word vectors are tile lines already)
and then used by every token; result row t holds token t's 16 outputs, so it adds to y[t, rows] as
one vector.

A tile sums 64 features at once, but the weights have a scale per sub-block of 16 or 32.
Super-block types have integer sub-block scales, so the panel holds v = (q - offset) * scale
per weight (|v| < 8192) as two s8 planes, lo = v & 127 and hi = v >> 7, each with its own
result tile: lo + 128 * hi is sum_s scale_s * dot_s over the 256-weight block, exact, which
then takes one float step (times d and the activation scale), and the mins one vpdpwssd
chain, as the rows gemm does. Where v fits one s8 plane (amx.ONE_PLANE) a unit's two weight
tiles are the planes of two tiles of rows instead, so the same tile multiplies give twice the
outputs.

Four result tiles (2 token tiles x 2 weight tiles), 2 activation tiles and 2 weight tiles use
all eight tile registers: a unit is one block of 16 (or 32) rows times a pair of token tiles,
16 tile multiplies. Its float steps (32 tokens' vectors of 16 rows) run between the next unit's
tile multiplies, which the tile unit does while the vector units do them. Around the units, the
loops keep each operand in the cache that feeds it: a K panel of activations (8 blocks of 512
tokens, 1.3 MB) in L2 while a chunk of rows goes over it; a block's planes in L1 while 4 pairs
of tokens take them; a pair's activations in L1 while a group of 4 tiles of rows takes them.
A tileloadd of rows that do not start 64-byte lines costs several times an aligned one, hence
the aligned activation rows (ActLayout.group_bytes). docs/kernels.md has the measurements.

The last group of tiles of rows starts at N - 16R and the last pair of token tiles at T - 32,
so every tile row is real; rows an earlier group owns are masked out of the stores to y, and
tokens an earlier pair did are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ggraph.backends.llvm.kernels import rows16
from ggraph.backends.llvm.kernels.amx import KSTEP, MIN_T, TILE, config
from ggraph.backends.llvm.kernels.builder import f32, i8, i16, i32, i64, vec
from ggraph.backends.llvm.kernels.plan import Layout
from ggraph.backends.llvm.kernels.qmatmul.context import Matmul, launder
from ggraph.backends.llvm.kernels.qmatmul.panel import (TilePanel, panel_count, row_mask, store_int_factors,
                                                        tile_rows)

PANEL_BLOCKS = 8           # blocks of 16 rows decoded at once: a K panel (8 x 8.6 KB of q4_k planes, in L2)
CHUNK_PAIRS = 4            # token pairs that go over a K panel together, block by block (a block's planes in L1)
SPAN = 256                 # tokens whose accumulators a group of tiles of rows keeps while it runs over K (4 x 16 KB)
C_BYTES = TILE * 64        # one i32 result tile
UNIT_BYTES = 4 * C_BYTES   # the four result tiles of a unit (a block of its rows x a pair of token tiles)


def tiles(m: Matmul, rows, R: int) -> None:
    """The kernel body for T >= MIN_T and N >= R * TILE: configure the tiles, run every group of R
    16-row tiles of the chunks ``rows`` yields ([start, end), multiples of R * 16), release the tiles.
    A chunk goes over K one panel (PANEL_BLOCKS blocks) at a time, all its groups over a panel before
    the next, so the activations of a panel (1.3 MB for 512 tokens) stay in L2 while the chunk's
    groups use them. Per group, the panel is decoded once; then the tokens, SPAN at a time with
    their accumulators private (y holds them between panels), go over it CHUNK_PAIRS pairs at a time,
    block by block, and for each pair every tile of the group in turn: a block's planes stay in L1
    while the chunk's pairs take them, and a pair's activations while the group's tiles do. The
    weights are in the plan's layout (rows16's groups are tiles of rows)."""
    k, isa, fmt, lay, N = m.k, m.isa, m.fmt, m.lay, m.N
    b = k.b
    T = k.arg["T"]
    tp = TilePanel(fmt, lay)
    nblocks = lay.K // fmt.dtype.block_size
    per_panel = min(nblocks, PANEL_BLOCKS)
    buf = k.scratch(i8, R * tp.room * per_panel)
    cbuf = k.scratch(i8, 2 * UNIT_BYTES)
    acc = k.scratch(f32, R * SPAN * TILE)
    decode = _decode_rows16 if m.plan.layout is Layout.ROWS16 else _decode
    isa.tile("ldtilecfg", config(k))
    with rows as (start, end), k.loop(0, nblocks, step=per_panel, name="apanel") as p0:
        count = panel_count(k, p0, per_panel, nblocks)
        with k.loop(start, end, step=R * TILE, name="agroup") as n0:
            r0 = tile_rows(k, N, n0, R)
            for r in range(R):
                mins = decode(m, tp, k.add(r0, r * TILE), p0, count, k.addr(buf, r * tp.room * per_panel))
            with k.loop(0, T, step=SPAN, name="aspan") as s0:
                run = _Run(_Group(m, tp, R, r0, [row_mask(k, r0, r * TILE, n0, end) for r in range(R)], buf,
                                  tp.room * per_panel, cbuf, acc, mins), s0)
                with b.if_else(b.icmp_signed("==", p0, k.i64(0))) as (first, later):
                    with first:
                        run.zero()
                    with later:
                        run.load()
                with k.loop(0, run.pairs, step=CHUNK_PAIRS, name="achunk") as j0:
                    left = b.sub(run.pairs, j0)
                    run.units(p0, count, j0, b.select(b.icmp_signed("<", left, k.i64(CHUNK_PAIRS)), left,
                                                      k.i64(CHUNK_PAIRS)))
                run.store()
    isa.tile("tilerelease")


def _decode(m: Matmul, tp: TilePanel, r0, p0, count, buf) -> bool:
    """Blocks p0..p0+count of rows r0..r0+15 into the panel; returns whether the type has mins."""
    k, isa, fmt, lay = m.k, m.isa, m.fmt, m.lay
    row_bytes = fmt.dtype.row_bytes(lay.K)
    with k.loop(0, count, name="ablk") as i:
        at = k.mul(i, tp.room)
        first = m.row(r0, k.add(p0, i))
        decs = [fmt.decode(k, isa, k.addr(first, r * row_bytes)) for r in range(TILE)]
        dec = decs[0]
        if dec.ints is None:
            raise ValueError(f"qmatmul {fmt.dtype.name}: AMX tiles need integer sub-block scales")
        store_int_factors(k, fmt, decs, buf, at, tp, tp.unit)

        def chunk(c):
            planes = [_planes(k, fmt, d, c, tp.planes, tp.sign) for d in decs]   # per row: (lo, hi) or (v,)
            for p in range(tp.planes):
                for j, col in enumerate(k.transpose([k.cast_vec(row[p], i32) for row in planes])):
                    k.store(col, buf, k.add(at, tp.plane(p), k.mul(k.add(k.mul(c, 8), j), 64)))
        U = fmt.unroll
        with k.loop(0, fmt.chunks // U, name="achunk") as cg:
            for u in range(U):
                chunk(k.add(k.mul(cg, U), u))
    return dec.mins is not None


def _decode_rows16(m: Matmul, tp: TilePanel, r0, p0, count, buf) -> bool:
    """Blocks p0..p0+count of rows r0..r0+15 from rows16 weights into the panel; returns whether the
    type has mins. A rows16 word vector is already a tile line (a 4-byte word of 16 rows): it only
    takes its sub-block's scales, a row's in each of its words, and splits into the two planes."""
    k, isa, fmt, lay = m.k, m.isa, m.fmt, m.lay
    b = k.b
    kind = rows16.kind(fmt.dtype)
    if tp.planes != 2 or (kind.MINS and tp.unit != kind.SUB):
        raise ValueError(f"qmatmul {fmt.dtype.name}: no rows16 tile panel for {tp.planes} planes, "
                         f"mins per {tp.unit} features")
    words = vec(i16, 4 * TILE)
    each_row = [lane // 4 for lane in range(4 * TILE)]             # a row's scale for each byte of its word
    with k.loop(0, count, name="ablk") as i:
        at = k.mul(i, tp.room)
        g = kind(k, isa, rows16.group_at(k, fmt.dtype, lay, r0, k.add(p0, i)))
        k.store(g.d, buf, k.add(at, tp.d))
        if kind.MINS:
            k.store(b.fneg(g.dmin), buf, k.add(at, tp.ndmin))
            for p in range(tp.pairs):
                k.store(g.min_pairs(p), buf, k.add(at, tp.imin(p)))
        scales = [k.shuffle(b.trunc(s, vec(i16, TILE)), each_row) for s in g.scales]
        for s, j, w in g.words():
            v = b.zext(w, words)
            if kind.LEVELS.offset:
                v = b.sub(v, ir.Constant(words, [kind.LEVELS.offset] * 4 * TILE))
            v = b.mul(v, scales[s])
            line = k.add(at, 64 * (s * kind.SUB // 4 + j))
            k.store(b.trunc(b.and_(v, ir.Constant(words, [127] * 4 * TILE)), vec(i8, 4 * TILE)), buf,
                    k.add(line, tp.plane(0)))
            k.store(b.trunc(b.ashr(v, ir.Constant(words, [7] * 4 * TILE)), vec(i8, 4 * TILE)), buf,
                    k.add(line, tp.plane(1)))
    return kind.MINS


def _planes(k, fmt, dec, c, planes: int = 2, sign: int = 1) -> tuple:
    """Chunk c (an i64 value) of a decoded row as the s8 planes (lo, hi) of v = (q - offset) * scale,
    or for one-plane types (v * sign,)."""
    b = k.b
    v16 = vec(i16, 32)
    raw = dec.chunk(c)                                                   # <32 x i8>
    w = b.sext(raw, v16) if dec.signed else b.zext(raw, v16)
    if dec.offset:
        w = b.sub(w, ir.Constant(v16, [dec.offset] * 32))
    per = 32 // fmt.sub                                                  # sub-blocks in the chunk
    scales = [b.trunc(b.extract_element(dec.ints.scales, b.trunc(k.add(k.mul(c, per), s), i32)), i16)
              for s in range(per)]
    v = b.mul(w, k.concat(*[k.splat(s, fmt.sub) for s in scales]))
    if planes == 1:
        return (b.trunc(b.neg(v) if sign < 0 else v, vec(i8, 32)),)
    lo = b.trunc(b.and_(v, ir.Constant(v16, [127] * 32)), vec(i8, 32))
    hi = b.trunc(b.ashr(v, ir.Constant(v16, [7] * 32)), vec(i8, 32))
    return lo, hi


@dataclass(frozen=True)
class _Group:
    """A group of R tiles of rows (rows r0 .. r0+16R-1) and the buffers it runs with: its decoded
    panel (``panel_bytes`` a tile of rows), the two halves of result tiles, the accumulators."""

    m: Matmul
    tp: TilePanel
    R: int
    r0: ir.Value
    masks: list              # each tile's rows that this group stores
    buf: ir.Value
    panel_bytes: int
    cbuf: ir.Value
    acc: ir.Value
    mins: bool


class _Run:
    """The tokens s0 .. s0+SPAN-1 (or to T) over a group of R tiles of rows (rows r0 .. r0+16R-1), in
    pairs of token tiles: pair j starts at token s0 + 32j, or at T - 32 if that is later (the last pair
    of the matrix is shifted back over an earlier one's tokens, whose results it computes again but
    does not store). The accumulator of tile r and pair j, y of its 32 tokens x 16 rows, lives in
    ``acc`` at (r * SPAN/32 + j) * 2 KB from the first K panel to the last."""

    def __init__(self, g: _Group, s0):
        k, lay, tp, R = g.m.k, g.m.lay, g.tp, g.R
        b = k.b
        self.k, self.isa, self.lay, self.tp, self.N, self.R, self.r0, self.masks = k, g.m.isa, lay, tp, g.m.N, R, g.r0, g.masks
        self.s0, self.buf, self.panel_bytes, self.cbuf, self.acc, self.mins = s0, g.buf, g.panel_bytes, g.cbuf, g.acc, g.mins
        self.stride = lay.group_bytes(1)
        # the two weight tiles of a unit, as (tile of the group after the unit's first, plane): one
        # tile's lo and hi planes, or the one plane of two tiles (of one, in a group of one)
        if tp.planes == 1 and R > 1 and R % 2:
            raise ValueError(f"qmatmul {tp.fmt.dtype.name}: one-plane units take tiles of rows in pairs, "
                             f"not a group of {R} (tiles_per_group gives an even number)")
        self.per_unit = 2 if tp.planes == 1 and R > 1 else 1
        self.cols = [(0, 0), (0, 1)] if tp.planes == 2 else [(u, 0) for u in range(self.per_unit)]
        left = b.sdiv(k.add(b.sub(k.arg["T"], s0), MIN_T - 1), k.i64(MIN_T))
        self.pairs = b.select(b.icmp_signed("<", left, k.i64(SPAN // MIN_T)), left, k.i64(SPAN // MIN_T))

    def first(self, j):
        """(the first token of pair j, how many of its tokens an earlier pair owns)."""
        b, T = self.k.b, self.k.arg["T"]
        want = self.k.add(self.s0, self.k.mul(j, MIN_T))
        last = b.sub(T, self.k.i64(MIN_T))
        ts = b.select(b.icmp_signed("<", want, last), want, last)
        return ts, b.sub(want, ts)

    def _slot(self, r, j, t=0):
        """Offset in ``acc`` of token t of pair j in tile r's accumulator."""
        return self.k.mul(self.k.add(self.k.mul(self.k.add(self.k.mul(r, SPAN // MIN_T), j), MIN_T), t), 64)

    def _y(self, ts, t, r: int):
        return self.k.mul(self.k.add(self.k.mul(self.k.add(ts, t), self.N), self.r0, r * TILE), 4)

    def zero(self) -> None:
        """Every accumulator to zero, before the first K panel."""
        k = self.k
        for r in range(self.R):
            with k.loop(0, k.mul(self.pairs, MIN_T), name="azero") as t:
                k.store(ir.Constant(vec(f32, TILE), [0.0] * TILE), self.acc, k.add(self._slot(r, 0), k.mul(t, 64)))

    def load(self) -> None:
        """Each accumulator from y, where the earlier K panels left it (a pair shifted back over an
        earlier one's tokens reads theirs too: y holds their sums so far, the same ones)."""
        k = self.k
        with k.loop(0, self.pairs, name="apair") as j:
            ts, _ = self.first(j)
            with k.loop(0, MIN_T, name="aload") as t:
                for r in range(self.R):
                    k.store(k.masked_load(vec(f32, TILE), k.arg["y"], self._y(ts, t, r), self.masks[r]),
                            self.acc, self._slot(r, j, t))

    def store(self) -> None:
        """Each accumulator to y, a token's R lines together, but for the tokens an earlier pair owns."""
        k = self.k
        with k.loop(0, self.pairs, name="apair") as j:
            ts, skip = self.first(j)
            with k.loop(skip, MIN_T, name="astore") as t:
                for r in range(self.R):
                    k.masked_store(k.load(vec(f32, TILE), self.acc, self._slot(r, j, t)), k.arg["y"],
                                   self._y(ts, t, r), self.masks[r])

    def units(self, p0, count, j0, pairs) -> None:
        """Every (block, pair, tile) unit of the K panel at block p0 (``count`` blocks), pairs j0 ..
        j0+pairs-1 and the group's R tiles (one or two a unit), in that order: a unit's tile
        multiplies go into four result tiles, stored to one half of ``cbuf``; the float steps that
        scale them into the accumulators run during the next unit's tile multiplies (software
        pipelining: the tile unit and the vector units work at once), and the last unit's after the
        loop."""
        k, b = self.k, self.k.b
        self.p0, self.j0, self.pairs_now = p0, j0, pairs
        total = k.mul(k.mul(count, pairs), self.R // self.per_unit)
        at = [k.var(i64, 0) for _ in range(3)]            # this unit's (block in panel, pair, tile)
        prev = [k.var(i64, 0) for _ in range(4)]          # the last unit's, and its half of cbuf
        self._unit(0, 0, 0, 0, None)
        for v in prev:
            v.set(k.i64(0))
        self._advance(at)
        with k.loop(1, total, name="aunit") as u:
            half = b.and_(u, k.i64(1))
            now = [v.get() for v in at]
            self._unit(*now, half, [v.get() for v in prev])
            for v, value in zip(prev, now + [half]):
                v.set(value)
            self._advance(at)
        for step in self._steps(*[v.get() for v in prev]):
            step()

    def _advance(self, at) -> None:
        """The next unit: the next tile of the group, else the first tile and the next pair, else the
        first pair of the next block."""
        k, b = self.k, self.k.b
        i, j, r = (v.get() for v in at)
        r1 = k.add(r, self.per_unit)
        wrap_r = b.icmp_signed("==", r1, k.i64(self.R))
        j1 = b.select(wrap_r, k.add(j, 1), j)
        wrap_j = b.icmp_signed("==", j1, self.pairs_now)
        at[0].set(b.select(wrap_j, k.add(i, 1), i))
        at[1].set(b.select(wrap_j, k.i64(0), j1))
        at[2].set(b.select(wrap_r, k.i64(0), r1))

    def _unit(self, i, j, r, half, prev) -> None:
        """The tile multiplies of block i of the panel, pair j and the unit's tiles from r into cbuf half
        ``half`` (result tile 2g + c: token tile g, weight tile c of ``cols``); between them, the float
        steps of the unit ``prev`` (block, pair, tile, half), if given."""
        k = self.k
        tp, stride = self.tp, self.stride
        bs = tp.fmt.dtype.block_size
        steps = self._steps(*prev) if prev is not None else []
        tdps = bs // KSTEP * 2 * len(self.cols)
        per = -(-len(steps) // tdps) if steps else 0
        ts, _ = self.first(k.add(self.j0, j))
        blk = k.add(self.p0, i)
        at = k.add(k.mul(i, tp.room), k.mul(r, self.panel_bytes))
        xa = k.addr(k.arg["xq"], k.mul(ts, stride))
        for g in range(2):
            for c in range(len(self.cols)):
                self.isa.tile("tilezero", 2 * g + c)
        n = 0
        for s in range(bs // KSTEP):
            feat = k.add(k.mul(blk, bs), s * KSTEP)
            self.isa.tile("tileloadd64", 4, k.addr(xa, feat), k.i64(stride))
            for c, (u, p) in enumerate(self.cols):
                self.isa.tile("tileloadd64", 6 + c,
                        k.addr(self.buf, k.add(at, u * self.panel_bytes + tp.plane(p) + s * KSTEP * 16)), k.i64(64))
            self.isa.tile("tileloadd64", 5, k.addr(xa, k.add(feat, TILE * stride)), k.i64(stride))
            for g in range(2):
                for c in range(len(self.cols)):
                    self.isa.tile("tdpbssd", 2 * g + c, 4 + g, 6 + c)
                    for step in steps[n:n + per]:
                        step()
                    n += per
        for step in steps[n:]:
            step()
        out = k.addr(self.cbuf, k.mul(half, UNIT_BYTES))
        for g in range(2):
            for c in range(len(self.cols)):
                self.isa.tile("tilestored64", 2 * g + c, k.addr(out, (2 * g + c) * C_BYTES), k.i64(64))

    def _steps(self, i, j, r, half) -> list:
        """The float steps of unit (block i of the panel, pair j, tiles from r, cbuf half), one callable
        per token and tile: acc += v * d*dx, and for types with mins + (sum_s min_s * xsum_s) * (-dmin)*dx,
        v = lo + 128 hi of the tile's two planes, or its one plane (times the type's sign, as d)."""
        k, b, tp, lay, isa = self.k, self.k.b, self.tp, self.lay, self.isa
        v16, vi = vec(f32, TILE), vec(i32, TILE)
        blk = k.add(self.p0, i)
        j = k.add(self.j0, j)
        ts, _ = self.first(j)
        xa = k.addr(k.arg["xq"], k.mul(ts, self.stride))
        cb = k.addr(self.cbuf, k.mul(half, UNIT_BYTES))
        loaded: dict = {}

        def factors(u: int):
            if u not in loaded:
                at = k.add(k.mul(i, tp.room), k.mul(k.add(r, u), self.panel_bytes))
                d = k.load(v16, self.buf, k.add(at, tp.d))
                f = {"d": b.fneg(d) if tp.sign < 0 else d, "slot": k.addr(self.acc, self._slot(k.add(r, u), j))}
                if self.mins:
                    f["ndmin"] = k.load(v16, self.buf, k.add(at, tp.ndmin))
                    f["imins"] = [k.cast_vec(k.load(vi, self.buf, k.add(at, tp.imin(p))), i16) for p in range(tp.pairs)]
                loaded[u] = f
            return loaded[u]

        tokens: dict = {}

        def token(t: int):
            """Token t's row of activations, its scale, and the row for the sums (shared by the unit's tiles)."""
            if t not in tokens:
                xt = k.addr(xa, t * self.stride)
                tokens[t] = (k.splat(k.load(f32, xt, lay.d(k, 1, blk)), TILE), launder(k, xt) if self.mins else None)
            return tokens[t]

        def step(t: int, u: int):
            f = factors(u)
            row = lambda c: (2 * (t >> 4) + c) * C_BYTES + (t & (TILE - 1)) * 64          # noqa: E731
            dx, xw = token(t)
            if tp.planes == 2:
                v = b.add(k.load(vi, cb, row(0)), b.shl(k.load(vi, cb, row(1)), ir.Constant(vi, [7] * TILE)))
            else:
                v = k.load(vi, cb, row(u))
            a = isa.fma(b.sitofp(v, v16), b.fmul(f["d"], dx), k.load(v16, f["slot"], t * 64))
            if self.mins:                                  # sum_s min_s * xsum_s, two sums per step
                m = ir.Constant(vi, [0] * TILE)
                for p, im in enumerate(f["imins"]):
                    word = k.load(i32, xw, tp.sums(k, blk, p))
                    m = isa.dot_pairs(m, im, k.cast_vec(k.splat(word, TILE), i16))
                a = isa.fma(b.sitofp(m, v16), b.fmul(f["ndmin"], dx), a)
            k.store(a, f["slot"], t * 64)

        return [lambda t=t, u=u: step(t, u) for t in range(MIN_T) for u in range(self.per_unit)]
