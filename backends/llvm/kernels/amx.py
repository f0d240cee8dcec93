"""The quantised matmul's T >= 32 path on AMX tiles (the `amx` feature set), for super-block types.

A tile multiply (tdpbssd) adds a [16 x 64] s8 tile times a [64 x 16] s8 tile into a
[16 x 16] i32 tile. Here the first is 16 tokens' activations, read in place from
act_quant's one-row-per-token layout; the second is 16 weight rows in VNNI order (each
64-byte line holds the same 4 features of 16 rows), decoded once per tile of rows into a
private panel (from the file's layout, or from rows16, where q4_k, q5_k and q6_k lie in such
lines already, so that decode's gemv streams them 16 rows as lanes) and then used by every
token; result row t holds token t's 16 outputs, so it adds to y[t, rows] as one vector.

A tile sums 64 features at once, but the weights have a scale per sub-block of 16 or 32.
Super-block types have integer sub-block scales, so the panel holds v = (q - offset) * scale
per weight (|v| < 8192) as two s8 planes, lo = v & 127 and hi = v >> 7, each with its own
result tile: lo + 128 * hi is sum_s scale_s * dot_s over the 256-weight block, exact, which
then takes one float step (times d and the activation scale), and the mins one vpdpwssd
chain, as the rows gemm does. Where v fits one s8 plane (q2_k: 0..45; q3_k: -124..128, kept
negated with its d) a unit's two weight tiles are the planes of two tiles of rows instead, so
the same tile multiplies give twice the outputs (q3_k 1.56x, q2_k 1.23x over two planes;
4.0x and 2.7x the AVX-512 VNNI rows gemm on 2048 x 2048 at one thread, T = 512).

Four result tiles (2 token tiles x 2 weight tiles), 2 activation tiles and 2 weight tiles use
all eight tile registers: a unit is one block of 16 (or 32) rows times a pair of token tiles,
16 tile multiplies. Its float steps (32 tokens' vectors of 16 rows) run between the next unit's tile
multiplies, which the tile unit does while the vector units do them. Around the units, the
loops keep each operand in the cache that feeds it: a K panel of activations (8 blocks of 512
tokens, 1.3 MB) in L2 while a chunk of rows goes over it; a block's planes in L1 while 4 pairs
of tokens take them; a pair's activations in L1 while a group of 4 tiles of rows takes them.
On a 2-core Xeon with AMX (one thread, T = 512, `benchmarks/kernels.py --targets
avx512_vnni,amx --tokens 512`), against the AVX-512 VNNI rows gemm in the same run: 2048 x
2048 q4_k 1.89x, 8192 x 2048 q4_k 1.63x, 2048 x 8192 q6_k 2.66x with the activations in 2 MB
pages, as a program's are (1.50x, 1.35x, 2.15x in 4 KB pages, where one tile of rows at a
time over all of K gave 1.21x, 0.64x and 1.98x). Groups of 4 tiles gave 1.1-1.7x of one (a
process per variant; groups of 2 the same as 4), K panels outermost 1.5x on 8192-wide rows (whose
activations are larger than L2); panels of 4 blocks were 5-15% slower than 8, and 2 or 8 pairs a
chunk, or spans of 128 or 512 tokens, within the noise of 4 and 256.

Where a unit's time goes (q4_k 2048 x 2048 in rows16, T = 512, one thread of a Sapphire Rapids Xeon;
cycles a unit of 16 tile multiplies, each variant of this kernel in a process of its own): 312 is
the tile unit's own rate on real operands (`python benchmarks/tiles.py`: 19.6 cycles a tdpbssd of
random bytes, 16.7 of zero tiles, which is why ggraph.bench.peaks multiplies random bytes). This
kernel's tile instructions alone, over a panel's addresses, take ~400-450 (tiles.py; with two sets
of two result tiles used in turn, one token tile a unit, each set stored while the other multiplies,
~340, but that kernel was no faster with its float steps); with the float steps' memory traffic
beside them (a token's two stored result rows and its accumulator loaded, the accumulator stored),
~470 with the accumulators in L1 and ~540 spread over 32 KB as here (tiles.py, 441 without); in the
kernel, with the accumulators' loads and stores, ~600; the panel decode brings it to ~650 and the
float steps (about 12 vector instructions a token and tile of rows) to ~840, 37% of the tile rate.
The tile multiplies hide only so much vector work: about 12 zmm FMAs a tdpbssd (tiles.py: 18.2
cycles a tdpbssd alone or with 12 beside it, 27.3 with 24, near the 18.2 + 12.0 of both in turn),
and the float steps bring 32 x ~12 a unit of 16 multiplies, twice that. (Without the mins' four
vpdpwssd a step, the kernel ran within 5% of its speed: not the instruction count alone, then; and
the float steps as a pass of their own after each block's multiplies, their vector work at full
rate, ran at 0.8x.) A tileloadd of rows that do not start 64-byte lines costs ~54 cycles instead of
~8.4 (tiles.py), hence the aligned activation rows (ActLayout.group_bytes).

The last group of tiles of rows starts at N - 16R and the last pair of token tiles at T - 32,
so every tile row is real; rows an earlier group owns are masked out of the stores to y, and
tokens an earlier pair did are skipped.

Types with a float scale per 32 weights stay on the rows gemm: each 32 features would need
their own result tiles stored and scaled, and storing a tile and reading it back costs more
than the multiply saves (q4_0 and q8_0 ran at 0.55x the rows gemm that way).
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels import rows16
from ggraph.backends.llvm.kernels.act_quant import ActLayout
from ggraph.backends.llvm.kernels.blocks import BlockFormat
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i8, i16, i32, i64, vec
from ggraph.backends.llvm.kernels.isa import Isa
from ggraph.backends.llvm.kernels.qmatmul import (_launder, _panel_count, _row, _row_mask, _store_int_factors,
                                                   _tile_rows)
from ggraph.backends.llvm.target import Target

TILE = 16                  # rows of a tile, and 4-byte columns; weight rows per tile of the matrix
MIN_T = 2 * TILE           # tokens the path needs (a pair of token tiles; fewer go to the rows gemm)
KSTEP = 64                 # features per tile multiply
PANEL_BLOCKS = 8           # blocks of 16 rows decoded at once: a K panel (8 x 8.6 KB of q4_k planes, in L2)
CHUNK_PAIRS = 4            # token pairs that go over a K panel together, block by block (a block's planes in L1)
GROUP_TILES = 4            # tiles of rows that take each pair's activations in turn (from L1)
SPAN = 256                 # tokens whose accumulators a group of tiles of rows keeps while it runs over K (4 x 16 KB)
C_BYTES = TILE * 64        # one i32 result tile
UNIT_BYTES = 4 * C_BYTES   # the four result tiles of a unit (a block of its rows x a pair of token tiles)


def on_tiles(dtype) -> bool:
    """True for the weight types the tiles take: super-block types (integer sub-block scales)."""
    return dtypes.from_name(dtype).block_size > 32


# Types whose v = (q - offset) * scale fits one s8 plane: q2_k's 0..45, and q3_k's -124..128 negated
# (-128..124; its d is negated with it). Their units take two tiles of rows (the plane of each as a
# weight tile) instead of one tile's two planes: the same tile multiplies for twice the outputs.
ONE_PLANE = {dtypes.q2_k: 1, dtypes.q3_k: -1}


def tiles_per_group(N: int, dtype=None) -> int:
    """Tiles of rows that go over the activations together: GROUP_TILES, or what N has room for (an
    even number for one-plane types, whose units take tiles in pairs, where N has room for two)."""
    R = max(1, min(GROUP_TILES, N // TILE))
    return R - R % 2 if dtype is not None and dtypes.from_name(dtype) in ONE_PLANE and R > 1 else R


def takes(fmt: BlockFormat, target: Target) -> bool:
    """True if qmatmul's T >= MIN_T kernel for ``fmt`` uses tiles on ``target`` (given N >= TILE)."""
    return target.has("amx-int8") and on_tiles(fmt.dtype)


@dataclass(frozen=True)
class TilePanel:
    """Where one block of 16 rows lies in a tile panel: its planes (lo and hi, or the one plane of a
    ONE_PLANE type), ``block_size / 4`` 64-byte lines each; then the rows' d (16 f32), their
    negated dmin, and the integer mins as i16 pairs, one line per pair of activation sums (of
    ``unit`` features: 32 for types with sub-blocks of 32, whose mins then take half as many
    pairs, else act_quant's sum blocks)."""

    fmt: BlockFormat
    lay: ActLayout

    @property
    def unit(self) -> int:
        return 32 if self.fmt.sub == 32 and self.lay.has_sums32 else self.lay.sum_block

    @property
    def planes(self) -> int:
        return 1 if self.fmt.dtype in ONE_PLANE else 2

    @property
    def sign(self) -> int:
        """How a one-plane type's plane holds v: v (1) or -v (-1)."""
        return ONE_PLANE.get(self.fmt.dtype, 1)

    @property
    def pairs(self) -> int:
        return self.fmt.dtype.block_size // self.unit // 2

    def sums(self, k: Kernel, blk, p: int):
        """Offset in a token's activations of the i16 pair of sums that imin(p) of block blk meets."""
        first = k.add(k.mul(blk, 2 * self.pairs), 2 * p)
        return self.lay.sums32(k, 1, first) if self.unit == 32 else self.lay.sums(k, 1, first)

    @property
    def lines(self) -> int:
        return self.fmt.dtype.block_size // 4

    def plane(self, p: int) -> int:
        return 64 * self.lines * p

    @property
    def d(self) -> int:
        return self.plane(self.planes)

    @property
    def ndmin(self) -> int:
        return self.d + 64

    def imin(self, p: int) -> int:
        return self.d + 128 + 64 * p

    @property
    def room(self) -> int:
        return self.imin(self.pairs)


def config(k: Kernel) -> ir.Value:
    """The module's tile configuration (palette 1): tiles 0-3 results [16 x 16 i32], 4-5 activations
    [16 tokens x 64 bytes], 6-7 weights [16 lines x 64 bytes]."""
    name = "ggraph_amx_config"
    g = k.module.globals.get(name)
    if g is None:
        cfg = [0] * 64
        cfg[0] = 1                                  # palette
        for t in range(8):
            cfg[16 + 2 * t] = 64                    # bytes per row (little-endian u16)
            cfg[48 + t] = TILE                      # rows
        typ = ir.ArrayType(i8, 64)
        g = ir.GlobalVariable(k.module, typ, name=name)
        g.initializer = ir.Constant(typ, cfg)
        g.global_constant = True
        g.linkage = "internal"
        g.align = 64
    return k.b.bitcast(g, ir.PointerType())


def tile_op(k: Kernel, op: str, *args) -> None:
    """One AMX instruction on fixed tile registers (ints) and addresses."""
    k.intrinsic(f"llvm.x86.{op}", ir.VoidType(), [ir.Constant(i8, a) if isinstance(a, int) else a for a in args])


def amx_gemm(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, rows, R: int,
             layout: str | None = None) -> None:
    """The kernel body for T >= MIN_T and N >= R * TILE: configure the tiles, run every group of R
    16-row tiles of the chunks ``rows`` yields ([start, end), multiples of R * 16), release the tiles.
    A chunk goes over K one panel (PANEL_BLOCKS blocks) at a time, all its groups over a panel before
    the next, so the activations of a panel (1.3 MB for 512 tokens) stay in L2 while the chunk's
    groups use them. Per group, the panel is decoded once; then the tokens, SPAN at a time with
    their accumulators private (y holds them between panels), go over it CHUNK_PAIRS pairs at a time,
    block by block, and for each pair every tile of the group in turn: a block's planes stay in L1
    while the chunk's pairs take them, and a pair's activations while the group's tiles do. The
    weights are in the file's layout, or in ``layout`` (rows16, whose groups are tiles of rows)."""
    b = k.b
    T = k.arg["T"]
    tp = TilePanel(fmt, lay)
    nblocks = lay.K // fmt.dtype.block_size
    per_panel = min(nblocks, PANEL_BLOCKS)
    buf = k.scratch(i8, R * tp.room * per_panel)
    cbuf = k.scratch(i8, 2 * UNIT_BYTES)
    acc = k.scratch(f32, R * SPAN * TILE)
    decode = _decode_rows16 if layout == rows16.LAYOUT else _decode
    tile_op(k, "ldtilecfg", config(k))
    with rows as (start, end), k.loop(0, nblocks, step=per_panel, name="apanel") as p0:
        count = _panel_count(k, p0, per_panel, nblocks)
        with k.loop(start, end, step=R * TILE, name="agroup") as n0:
            r0 = _tile_rows(k, N, n0, R)
            for r in range(R):
                mins = decode(k, isa, fmt, lay, tp, k.add(r0, r * TILE), p0, count,
                              k.addr(buf, r * tp.room * per_panel))
            with k.loop(0, T, step=SPAN, name="aspan") as s0:
                run = _Run(k, isa, lay, tp, N, R, r0, [_row_mask(k, r0, r * TILE, n0, end) for r in range(R)],
                           s0, buf, tp.room * per_panel, cbuf, acc, mins)
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
    tile_op(k, "tilerelease")


def _decode(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, tp: TilePanel, r0, p0, count, buf) -> bool:
    """Blocks p0..p0+count of rows r0..r0+15 into the panel; returns whether the type has mins."""
    row_bytes = fmt.dtype.row_bytes(lay.K)
    with k.loop(0, count, name="ablk") as i:
        at = k.mul(i, tp.room)
        first = _row(k, fmt, lay, r0, k.add(p0, i))
        decs = [fmt.decode(k, isa, k.addr(first, r * row_bytes)) for r in range(TILE)]
        dec = decs[0]
        if dec.ints is None:
            raise ValueError(f"qmatmul {fmt.dtype.name}: AMX tiles need integer sub-block scales")
        _store_int_factors(k, fmt, lay, decs, buf, at, tp, tp.unit)

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


def _decode_rows16(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, tp: TilePanel, r0, p0, count,
                   buf) -> bool:
    """Blocks p0..p0+count of rows r0..r0+15 from rows16 weights into the panel; returns whether the
    type has mins. A rows16 word vector is already a tile line (a 4-byte word of 16 rows): it only
    takes its sub-block's scales, a row's in each of its words, and splits into the two planes."""
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


def _planes(k: Kernel, fmt: BlockFormat, dec, c, planes: int = 2, sign: int = 1) -> tuple:
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


class _Run:
    """The tokens s0 .. s0+SPAN-1 (or to T) over a group of R tiles of rows (rows r0 .. r0+16R-1), in
    pairs of token tiles: pair j starts at token s0 + 32j, or at T - 32 if that is later (the last pair
    of the matrix is shifted back over an earlier one's tokens, whose results it computes again but
    does not store). The accumulator of tile r and pair j, y of its 32 tokens x 16 rows, lives in
    ``acc`` at (r * SPAN/32 + j) * 2 KB from the first K panel to the last."""

    def __init__(self, k: Kernel, isa: Isa, lay: ActLayout, tp: "TilePanel", N: int, R: int, r0, masks, s0, buf,
                 panel_bytes: int, cbuf, acc, mins: bool):
        b = k.b
        self.k, self.isa, self.lay, self.tp, self.N, self.R, self.r0, self.masks = k, isa, lay, tp, N, R, r0, masks
        self.s0, self.buf, self.panel_bytes, self.cbuf, self.acc, self.mins = s0, buf, panel_bytes, cbuf, acc, mins
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
                tile_op(k, "tilezero", 2 * g + c)
        n = 0
        for s in range(bs // KSTEP):
            feat = k.add(k.mul(blk, bs), s * KSTEP)
            tile_op(k, "tileloadd64", 4, k.addr(xa, feat), k.i64(stride))
            for c, (u, p) in enumerate(self.cols):
                tile_op(k, "tileloadd64", 6 + c,
                        k.addr(self.buf, k.add(at, u * self.panel_bytes + tp.plane(p) + s * KSTEP * 16)), k.i64(64))
            tile_op(k, "tileloadd64", 5, k.addr(xa, k.add(feat, TILE * stride)), k.i64(stride))
            for g in range(2):
                for c in range(len(self.cols)):
                    tile_op(k, "tdpbssd", 2 * g + c, 4 + g, 6 + c)
                    for step in steps[n:n + per]:
                        step()
                    n += per
        for step in steps[n:]:
            step()
        out = k.addr(self.cbuf, k.mul(half, UNIT_BYTES))
        for g in range(2):
            for c in range(len(self.cols)):
                tile_op(k, "tilestored64", 2 * g + c, k.addr(out, (2 * g + c) * C_BYTES), k.i64(64))

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
                tokens[t] = (k.splat(k.load(f32, xt, lay.d(k, 1, blk)), TILE), _launder(k, xt) if self.mins else None)
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
