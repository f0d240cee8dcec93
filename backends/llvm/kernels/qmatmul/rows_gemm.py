"""The quantised matmul for T > 1 with AVX-512 VNNI, and for every T of a rows_only step there
(Method.ROWS_GEMM): lanes are rows. A panel of 16-row vectors is decoded and transposed once into a
private buffer (``Panel``), then each token's 4-byte activation words are broadcast (from memory,
into the dot) against it, for 32 rows x TILE_TOKENS tokens at a time; super-block types sum their
sub-blocks' dots times their scales (exact small integers in f32 lanes), and their mins with
vpdpwssd; results stay in a private stripe of tokens until the last K panel.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ggraph.backends.llvm.kernels import rows16
from ggraph.backends.llvm.kernels.blocks import Decoded
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i8, i16, i32, vec
from ggraph.backends.llvm.kernels.plan import Layout
from ggraph.backends.llvm.kernels.qmatmul.context import Matmul, launder, sum_of
from ggraph.backends.llvm.kernels.qmatmul.panel import (ROWS, Panel, panel_count, row_mask, store_int_factors,
                                                        tile_rows)

PANEL_BYTES = 32768      # decoded weights of one tile kept at once (a K panel, in L1)
STRIPE_TOKENS = 512      # tokens whose results a tile keeps across its panels (64 KB, in L2)
# Tokens per register tile of 32 rows: 12 dot chains, 12 block sums for super-block types, two weight
# vectors and the broadcasts fill the 32 registers; each weight load serves 6 tokens
TILE_TOKENS = 6
TILE_ROWS = 2 * ROWS     # rows of a tile: two 16-row vectors


@dataclass(frozen=True)
class _Panels:
    """One tile's decoded K panel, as its token runs read it: ``vecs`` 16-row vectors of ``room``
    bytes a block in ``buf``, laid out as ``panel``; ``dec``: one row's decoder (offsets and kinds
    are the same for every row)."""

    m: Matmul
    vecs: int
    buf: ir.Value
    room: int
    panel: Panel
    dec: Decoded


def rows_gemm(m: Matmul, rows) -> None:
    """Tiles of 32 rows (the last one masked at the end of the rows): a K panel of the tile is
    decoded into a private buffer with rows as lanes (``Panel``), then every token runs over
    the panel, a few at a time, each activation word broadcast into the dot products of both
    halves of the tile. Tokens go STRIPE_TOKENS at a time: their results stay in a private stripe
    across the panels, and go to y once, after the last one (rows of y are N floats apart, so a
    tile's rows of y for many tokens would share a few cache sets and be fetched again per panel).
    Super-block types sum their sub-blocks times their scales before one float step per block, as
    llama.cpp does. Activations come one row per token."""
    k, fmt, lay, N = m.k, m.fmt, m.lay, m.N
    start, end = rows
    T = k.arg["T"]
    nblocks = lay.K // fmt.dtype.block_size
    room = Panel.room(fmt)
    per_panel = max(1, min(nblocks, PANEL_BYTES // (2 * room)))
    buf = k.scratch(i8, 2 * room * per_panel)
    vecs = 2
    stripe = launder(k, k.scratch(f32, (STRIPE_TOKENS + TILE_TOKENS) * vecs * ROWS))
    with k.loop(start, end, step=vecs * ROWS, name="tile") as n0:
        with k.loop(0, T, step=STRIPE_TOKENS, name="stripe") as c0:
            c_end = k.b.select(k.b.icmp_signed("<", k.add(c0, STRIPE_TOKENS), T), k.add(c0, STRIPE_TOKENS), T)
            with k.loop(0, nblocks, step=per_panel, name="panel") as p0:
                count = panel_count(k, p0, per_panel, nblocks)
                panel, dec = _decode_panel(m, n0, vecs, p0, count, buf, room)
                pb = _Panels(m, vecs, buf, room, panel, dec)
                with k.loop(c0, c_end, step=TILE_TOKENS, name="tt") as t0:
                    _panel_run(pb, p0, count, stripe, c0, c_end, t0)
            _stripe_out(m, n0, vecs, end, c0, c_end, stripe)


def _stripe_out(m: Matmul, n0, vecs: int, end, c0, c_end, stripe) -> None:
    """y[t, rows of the tile] for the stripe's tokens c0..c_end, the rows before ``end`` only."""
    k, N = m.k, m.N
    r0 = tile_rows(k, N, n0, vecs) if N >= vecs * ROWS else n0     # the panel's lane 0 is row r0
    masks = [row_mask(k, r0, ROWS * v, n0, end) for v in range(vecs)]
    with k.loop(c0, c_end, name="out") as t:
        for v in range(vecs):
            value = k.load(vec(f32, ROWS), stripe, k.mul(k.add(k.mul(k.b.sub(t, c0), vecs), v), 64))
            k.masked_store(value, k.arg["y"], k.mul(k.add(k.mul(t, N), r0, ROWS * v), 4), masks[v])


def _decode_panel(m: Matmul, n0, vecs: int, p0, count, buf, room: int):
    """Blocks p0..p0+count of the tile's 16*vecs rows into the buffer (``tile_rows``; in a matrix of
    fewer rows, rows past N repeat row N-1), a 16-row vector of a block at a time (run-time loops over
    vectors and chunk groups keep the code small), from weights in the plan's layout; returns the
    Panel layout and one row's decoder (offsets and kinds are the same for every row)."""
    k, isa, fmt, lay, N = m.k, m.isa, m.fmt, m.lay, m.N
    b = k.b
    nblocks = lay.K // fmt.dtype.block_size
    row_bytes = fmt.dtype.row_bytes(lay.K)                # a row's share of the matrix, in its layout
    laid = m.plan.layout is Layout.ROWS16
    if laid:                                              # rows16: what each of its groups decodes to
        kind = rows16.kind(fmt.dtype)
        panel, dec = Panel(fmt, True, kind.MINS), kind.LEVELS
        row_bytes = nblocks * kind.BYTES // ROWS
    lines = -(-vecs * ROWS * row_bytes // 64 // (nblocks * vecs))   # of the next tile, per vector decoded
    with k.loop(0, k.mul(count, vecs), name="pvec") as iv:
        i, v = b.sdiv(iv, k.i64(vecs)), b.srem(iv, k.i64(vecs))
        # the next tile's rows are one contiguous stretch: ask for a share of it now, so that a small
        # T, which does little more than decode, streams from memory instead of waiting on it
        # (prefetches never fault past the end)
        ahead = k.add(k.mul(k.add(n0, vecs * ROWS), row_bytes), k.mul(k.add(k.mul(p0, vecs), iv), 64 * lines))
        for line in range(lines):
            k.prefetch(k.addr(k.arg["w"], k.add(ahead, 64 * line)))
        if laid:                                          # rows16: the 16 rows' block is one group
            rows16.decode_panel(k, isa, lay, k.add(tile_rows(k, N, n0, vecs), k.mul(v, ROWS)), k.add(p0, i), buf,
                                k.add(k.mul(i, vecs * room), k.mul(v, room)), panel)
        else:
            panel, dec = _decode_panel_vector(m, n0, vecs, p0, i, v, buf, room)
    return panel, dec


def _decode_panel_vector(m: Matmul, n0, vecs: int, p0, i, v, buf, room: int):
    """Block p0+i of the tile's vector v (16 rows) from the file's layout into the panel buffer."""
    k, isa, fmt, lay, N = m.k, m.isa, m.fmt, m.lay, m.N
    b = k.b
    row_bytes = fmt.dtype.row_bytes(lay.K)
    if N >= vecs * ROWS:                              # rows at fixed distances from the tile's first
        first = m.row(k.add(tile_rows(k, N, n0, vecs), k.mul(v, ROWS)), k.add(p0, i))
        decs = [fmt.decode(k, isa, k.addr(first, r * row_bytes)) for r in range(ROWS)]
    else:                                             # a matrix smaller than a tile: rows past N repeat N-1
        rows = [k.add(n0, k.mul(v, ROWS), r) for r in range(ROWS)]
        rows = [b.select(b.icmp_signed("<", r, k.i64(N)), r, k.i64(N - 1)) for r in rows]
        decs = [fmt.decode(k, isa, m.row(r, k.add(p0, i))) for r in rows]
    dec = decs[0]
    panel = Panel(fmt, dec.ints is not None, dec.mins is not None)
    if not panel.ints and panel.subs > 1:
        raise ValueError(f"qmatmul {fmt.dtype.name}: sub-block scales without integer scales")
    vat = k.add(k.mul(i, vecs * room), k.mul(v, room))
    if panel.ints:
        for s, col in enumerate(k.transpose([d.ints.scales for d in decs])):
            k.store(b.sitofp(col, vec(f32, ROWS)), buf, k.add(vat, panel.iscale(s)))
        store_int_factors(k, fmt, decs, buf, vat, panel, unit=fmt.sub)
    else:
        k.store(k.concat(*[d.scales for d in decs]), buf, k.add(vat, panel.d))
        if panel.mins:
            k.store(k.concat(*[b.fneg(d.mins) for d in decs]), buf, k.add(vat, panel.ndmin))
    U = fmt.unroll
    per_chunk = 32 // fmt.sub                            # sub-blocks per 32-weight chunk (1 or 2)

    def chunk(c, chunk_at):
        for j, col in enumerate(k.transpose([k.cast_vec(d.chunk(c), i32) for d in decs])):
            k.store(col, buf, k.add(chunk_at, panel.word(4 * j // fmt.sub, j % (fmt.sub // 4))))
    if fmt.chunks == U:
        for c in range(U):
            chunk(c, k.add(vat, c * per_chunk * panel.sub_bytes))
    else:
        with k.loop(0, fmt.chunks // U, name="pchunk") as cg:
            for u in range(U):
                c = k.add(k.mul(cg, U), u)
                chunk(c, k.add(vat, k.mul(c, per_chunk * panel.sub_bytes)))
    return panel, dec


def _panel_run(pb: _Panels, p0, count, stripe, c0, c_end, t0) -> None:
    """Tokens t0..t0+TILE_TOKENS-1 of the stripe c0..c_end (those past its end repeat its last token)
    over the panel, an f32 accumulator of 16 rows per (token, vector) in the stripe, which starts from
    zero at the first panel. Super-block types work on the stripe in place (a (token, vector) is
    touched once per block; the registers hold its sub-block dot and block sum), the others in
    registers."""
    k, lay, vecs = pb.m.k, pb.m.lay, pb.vecs
    b = k.b
    n = TILE_TOKENS
    tokens = [b.select(b.icmp_signed("<", k.add(t0, t), c_end), k.add(t0, t), b.sub(c_end, k.i64(1))) for t in range(n)]
    xs = [k.addr(k.arg["xq"], k.mul(tok, lay.group_bytes(1))) for tok in tokens]
    slots = [[k.mul(k.add(k.mul(k.add(b.sub(t0, c0), t), vecs), v), 64) for v in range(vecs)] for t in range(n)]
    first = b.icmp_signed("==", p0, k.i64(0))
    accs = _Accumulators(k, stripe, slots, first, in_registers=not pb.panel.ints)
    with k.loop(0, count, name="pblk") as i:
        blk, at = k.add(p0, i), k.mul(i, vecs * pb.room)
        (_super_block if pb.panel.ints else _plain_block)(pb, xs, blk, at, accs)
    accs.close()


class _Accumulators:
    """The f32 accumulators of a register tile, [token][vector], kept in the stripe's ``slots`` (zeroed
    first when ``first``), or in registers between a load from the stripe and ``close``."""

    def __init__(self, k: Kernel, stripe, slots: list, first, in_registers: bool):
        self.k, self.stripe, self.slots = k, stripe, slots
        v16 = vec(f32, ROWS)
        zero = ir.Constant(v16, [0.0] * ROWS)
        if in_registers:
            self.vars = [[k.var(v16, k.b.select(first, zero, k.load(v16, stripe, at))) for at in row] for row in slots]
        else:
            self.vars = None
            with k.if_then(first):
                for row in slots:
                    for at in row:
                        k.store(zero, stripe, at)

    def get(self, t: int, v: int) -> ir.Value:
        if self.vars is None:
            return self.k.load(vec(f32, ROWS), self.stripe, self.slots[t][v])
        return self.vars[t][v].get()

    def set(self, t: int, v: int, value: ir.Value) -> None:
        if self.vars is None:
            self.k.store(value, self.stripe, self.slots[t][v])
        else:
            self.vars[t][v].set(value)

    def close(self) -> None:
        """Registers back to the stripe."""
        if self.vars is not None:
            for row, at_row in zip(self.vars, self.slots):
                for var, at in zip(row, at_row):
                    self.k.store(var.get(), self.stripe, at)


def _sub_dots(pb: _Panels, xs, blk, s, sub_at) -> list:
    """Each (token, vector)'s integer dot over sub-block s (an int or i64 value) of block blk, whose
    words lie at ``sub_at``: [token][vector] <16 x i32>, the offset term included."""
    k, isa, lay, panel, dec, vecs = pb.m.k, pb.m.isa, pb.m.lay, pb.panel, pb.dec, pb.vecs
    b = k.b
    fmt = panel.fmt
    words, per = fmt.sub // 4, fmt.sub // lay.sum_block
    vi = vec(i32, ROWS)

    def xsum(t):                                         # token t's sum of quants in sub-block s
        first_sum = k.mul(k.add(k.mul(blk, panel.subs), s), per)
        return sum_of(k, [lay.load_sums(k, xs[t], 1, k.add(first_sum, p)) for p in range(per)])
    dots = [[k.splat(b.mul(xsum(t), ir.Constant(i32, -dec.offset)), ROWS) if dec.offset else ir.Constant(vi, [0] * ROWS)
             for _ in range(vecs)] for t in range(len(xs))]
    word0 = k.mul(k.add(k.mul(blk, panel.subs), s), words)
    for j in range(words):
        w = [k.load(vec(i8, 64), pb.buf, k.add(sub_at, v * pb.room + 64 * j)) for v in range(vecs)]
        for t, xt in enumerate(xs):
            x = k.cast_vec(k.splat(k.load(i32, xt, lay.qs(k, 1, k.add(word0, j))), ROWS), i8)
            for v in range(vecs):
                dots[t][v] = isa.dot(dots[t][v], w[v], x, False, dec.qmax)
    return dots


def _super_block(pb: _Panels, xs, blk, at, accs: _Accumulators) -> None:
    """One super-block into the accumulators: per sub-block, each (token, vector)'s integer dot times the
    rows' scales (f32 in the panel: small integers, so the products and their sums are the integer
    sums llama.cpp takes, below 2**24) into a block sum; then acc += sum * d*dx, and for types with
    mins acc += (sum_s min_s * xsum_s) * -dmin*dx, two sub-blocks per vpdpwssd."""
    k, isa, lay, panel, vecs, buf, room = pb.m.k, pb.m.isa, pb.m.lay, pb.panel, pb.vecs, pb.buf, pb.room
    b = k.b
    v16, vi = vec(f32, ROWS), vec(i32, ROWS)
    zero_f = ir.Constant(v16, [0.0] * ROWS)
    sums = [[k.var(v16, zero_f) for _ in range(vecs)] for _ in xs]
    with k.loop(0, panel.subs, name="psub") as s:
        sub_at = k.add(at, k.mul(s, panel.sub_bytes))
        dots = _sub_dots(pb, xs, blk, s, sub_at)
        scales = [k.load(v16, buf, k.add(sub_at, v * room + panel.iscale(0))) for v in range(vecs)]
        for sum_t, dot_t in zip(sums, dots):
            for v in range(vecs):
                sum_t[v].set(isa.fma(b.sitofp(dot_t[v], v16), scales[v], sum_t[v].get()))
    pairs = panel.subs // 2
    factors = []                                          # each vector's (d, -dmin, integer min pairs)
    for v in range(vecs):
        vat = k.add(at, v * room)
        factors.append((k.load(v16, buf, k.add(vat, panel.d)),
                        k.load(v16, buf, k.add(vat, panel.ndmin)) if panel.mins else None,
                        [k.cast_vec(k.load(vi, buf, k.add(vat, panel.imin(p))), i16) for p in range(pairs)]
                        if panel.mins else []))
    for t, xt in enumerate(xs):
        dx = k.splat(k.load(f32, xt, lay.d(k, 1, blk)), ROWS)            # activation blocks = weight blocks
        words = _sub_sum_pairs(pb, xt, blk) if panel.mins else []
        for v, (d, ndmin, imins) in enumerate(factors):
            a = isa.fma(sums[t][v].get(), b.fmul(d, dx), accs.get(t, v))
            if panel.mins:                                # sum_s min_s * xsum_s, two sub-blocks per step, two chains
                chains = [ir.Constant(vi, [0] * ROWS)] * 2
                for p, (im, word) in enumerate(zip(imins, words)):
                    chains[p % 2] = isa.dot_pairs(chains[p % 2], im, word)
                a = isa.fma(b.sitofp(sum_of(k, chains), v16), b.fmul(ndmin, dx), a)
            accs.set(t, v, a)


def _sub_sum_pairs(pb: _Panels, xt, blk) -> list:
    """A token's activation sums of block blk per sub-block, as i16 pairs (sub-blocks 2p, 2p+1), each
    broadcast from memory to <32 x i16>: the sums where a sub-block is a sum block, else the sums of
    32 (act_quant's ``sums32``, the sub-blocks of 32-weight types)."""
    k, lay, panel = pb.m.k, pb.m.lay, pb.panel
    subs = panel.subs
    if panel.fmt.sub == lay.sum_block:
        at = lambda p: lay.sums(k, 1, k.add(k.mul(blk, subs), 2 * p))          # noqa: E731
    elif panel.fmt.sub == 32 and lay.has_sums32:
        at = lambda p: lay.sums32(k, 1, k.add(k.mul(blk, subs), 2 * p))        # noqa: E731
    else:
        raise ValueError(f"qmatmul {panel.fmt.dtype.name}: no activation sums per sub-block of {panel.fmt.sub}")
    return [k.cast_vec(k.splat(k.load(i32, xt, at(p)), ROWS), i16) for p in range(subs // 2)]


def _plain_block(pb: _Panels, xs, blk, at, accs: _Accumulators) -> None:
    """One block of a 32-weight type into the accumulators: acc += dot * d*dx (- xsum * dmin*dx, or with
    q8_1 activations - s * dmin)."""
    k, isa, lay, panel, buf = pb.m.k, pb.m.isa, pb.m.lay, pb.panel, pb.buf
    b = k.b
    v16 = vec(f32, ROWS)
    dots = _sub_dots(pb, xs, blk, 0, at)
    per = panel.fmt.sub // lay.sum_block
    for v in range(pb.vecs):                          # the vector's block factors, loaded once for all tokens
        vat = k.add(at, v * pb.room)
        d = k.load(v16, buf, k.add(vat, panel.d))
        ndmin = k.load(v16, buf, k.add(vat, panel.ndmin)) if panel.mins else None
        for t, xt in enumerate(xs):
            dx = k.splat(k.load(f32, xt, lay.d(k, 1, blk)), ROWS)
            a = isa.fma(b.sitofp(dots[t][v], v16), b.fmul(d, dx), accs.get(t, v))
            if panel.mins and lay.keeps_s:                # q8_1's s = dx xsum, as ggml rounds it
                a = isa.fma(k.splat(lay.load_s(k, isa, xt, 1, blk), ROWS), ndmin, a)
            elif panel.mins:
                xsum = sum_of(k, [lay.load_sums(k, xt, 1, k.add(k.mul(blk, per), p)) for p in range(per)])
                a = isa.fma(b.sitofp(k.splat(xsum, ROWS), v16), b.fmul(ndmin, dx), a)
            accs.set(t, v, a)
