"""The quantised matmul's T >= 32 path on AMX tiles (the `amx` feature set), for super-block types.

A tile multiply (tdpbssd) adds a [16 x 64] s8 tile times a [64 x 16] s8 tile into a
[16 x 16] i32 tile. Here the first is 16 tokens' activations, read in place from
act_quant's one-row-per-token layout; the second is 16 weight rows in VNNI order (each
64-byte line holds the same 4 features of 16 rows), decoded once per tile of rows into a
private panel and then used by every token; result row t holds token t's 16 outputs, so it
adds to y[t, rows] as one vector.

A tile sums 64 features at once, but the weights have a scale per sub-block of 16 or 32.
Super-block types have integer sub-block scales, so the panel holds v = (q - offset) * scale
per weight (|v| < 8192) as two s8 planes, lo = v & 127 and hi = v >> 7, each with its own
result tile: lo + 128 * hi is sum_s scale_s * dot_s over the 256-weight block, exact, which
then takes one float step (times d and the activation scale), and the mins one vpdpwssd
chain, as the rows gemm does.

Four result tiles (2 token tiles x lo, hi), 2 activation tiles and 2 weight tiles use all
eight tile registers. The last tile of rows starts at N - 16 and the last pair of token
tiles at T - 32, so every tile row is real; rows an earlier tile owns are masked out of the
stores to y, and tokens an earlier pass did are skipped.

Types with a float scale per 32 weights stay on the rows gemm: each 32 features would need
their own result tiles stored and scaled, and storing a tile and reading it back costs more
than the multiply saves (q4_0 and q8_0 ran at 0.55x the rows gemm that way).
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels.act_quant import ActLayout
from ggraph.backends.llvm.kernels.blocks import BlockFormat
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i8, i16, i32, vec
from ggraph.backends.llvm.kernels.isa import Isa
from ggraph.backends.llvm.kernels.qmatmul import (_launder, _panel_count, _row, _row_mask, _store_int_factors,
                                                   _sum_of, _tile_rows)
from ggraph.backends.llvm.target import Target

TILE = 16                  # rows of a tile, and 4-byte columns; weight rows per tile of the matrix
MIN_T = 2 * TILE           # tokens the path needs (two token tiles; fewer go to the rows gemm)
KSTEP = 64                 # features per tile multiply
PANEL_BYTES = 131072       # decoded weights of one tile of rows kept at once (a K panel, in L2)
C_BYTES = TILE * 64        # one i32 result tile


def on_tiles(dtype) -> bool:
    """True for the weight types the tiles take: super-block types (integer sub-block scales)."""
    return dtypes.from_name(dtype).block_size > 32


def takes(fmt: BlockFormat, target: Target) -> bool:
    """True if qmatmul's T >= MIN_T kernel for ``fmt`` uses tiles on ``target`` (given N >= TILE)."""
    return target.has("amx-int8") and on_tiles(fmt.dtype)


@dataclass(frozen=True)
class TilePanel:
    """Where one block of 16 rows lies in a tile panel: the lo and hi planes, ``block_size / 4``
    64-byte lines each; then the rows' d (16 f32), their negated dmin, and the integer mins as
    i16 pairs, one line per pair of activation sums."""

    fmt: BlockFormat
    pairs: int                 # pairs of activation sums per block

    @property
    def lines(self) -> int:
        return self.fmt.dtype.block_size // 4

    def plane(self, p: int) -> int:
        return 64 * self.lines * p

    @property
    def d(self) -> int:
        return self.plane(2)

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


def amx_gemm(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, rows) -> None:
    """The kernel body for T >= MIN_T and N >= TILE: configure the tiles, run every 16-row tile of the
    chunks ``rows`` yields ([start, end), multiples of 16), release the tiles."""
    tp = TilePanel(fmt, fmt.dtype.block_size // lay.sum_block // 2)
    nblocks = lay.K // fmt.dtype.block_size
    per_panel = max(1, min(nblocks, PANEL_BYTES // tp.room))
    buf = k.scratch(i8, tp.room * per_panel)
    cbuf = k.scratch(i8, 4 * C_BYTES)
    tile_op(k, "ldtilecfg", config(k))
    with rows as (start, end), k.loop(start, end, step=TILE, name="atile") as n0:
        r0 = _tile_rows(k, N, n0, 1)
        with k.loop(0, nblocks, step=per_panel, name="apanel") as p0:
            count = _panel_count(k, p0, per_panel, nblocks)
            mins = _decode(k, isa, fmt, lay, tp, r0, p0, count, buf)
            _tokens(k, isa, lay, tp, N, n0, r0, end, p0, count, buf, cbuf, mins)
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
        _store_int_factors(k, fmt, lay, decs, buf, at, tp)

        def chunk(c):
            planes = [_planes(k, fmt, d, c) for d in decs]                     # per row: (lo, hi)
            for p in range(2):
                for j, col in enumerate(k.transpose([k.cast_vec(row[p], i32) for row in planes])):
                    k.store(col, buf, k.add(at, tp.plane(p), k.mul(k.add(k.mul(c, 8), j), 64)))
        U = fmt.unroll
        with k.loop(0, fmt.chunks // U, name="achunk") as cg:
            for u in range(U):
                chunk(k.add(k.mul(cg, U), u))
    return dec.mins is not None


def _planes(k: Kernel, fmt: BlockFormat, dec, c) -> tuple:
    """Chunk c (an i64 value) of a decoded row as the s8 planes (lo, hi) of (q - offset) * scale."""
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
    lo = b.trunc(b.and_(v, ir.Constant(v16, [127] * 32)), vec(i8, 32))
    hi = b.trunc(b.ashr(v, ir.Constant(v16, [7] * 32)), vec(i8, 32))
    return lo, hi


def _tokens(k: Kernel, isa: Isa, lay: ActLayout, tp: TilePanel, N: int, n0, r0, end, p0, count, buf, cbuf,
            mins: bool) -> None:
    """Every token over the panel, 32 at a time: y[t, rows] of the pass is read once into a private
    accumulator; per block, the tile multiplies go into four result tiles, which are stored and then
    scaled into the accumulator token by token; at the end of the pass it goes back to y."""
    b = k.b
    T = k.arg["T"]
    stride = lay.group_bytes(1)
    bs = tp.fmt.dtype.block_size
    v16, vi = vec(f32, TILE), vec(i32, TILE)
    mask = _row_mask(k, r0, 0, n0, end)
    acc = k.scratch(f32, MIN_T * TILE)                 # y[ts:ts+32, rows] while the pass runs over the panel
    with k.loop(0, T, step=MIN_T, name="atok") as t0:
        ts = b.select(b.icmp_signed("<", t0, b.sub(T, k.i64(MIN_T))), t0, b.sub(T, k.i64(MIN_T)))
        xa = k.addr(k.arg["xq"], k.mul(ts, stride))
        skip = b.sub(t0, ts)                             # tokens before t0 were an earlier pass's
        with k.loop(skip, MIN_T, name="aload") as t:
            ys = k.mul(k.add(k.mul(k.add(ts, t), N), r0), 4)
            start = b.select(b.icmp_signed("==", p0, k.i64(0)), ir.Constant(v16, [0.0] * TILE),
                             k.masked_load(v16, k.arg["y"], ys, mask))
            k.store(start, acc, k.mul(t, 64))
        with k.loop(0, count, name="atblk") as i:
            blk, at = k.add(p0, i), k.mul(i, tp.room)
            for c in range(4):
                tile_op(k, "tilezero", c)
            for j in range(bs // KSTEP):
                feat = k.add(k.mul(blk, bs), j * KSTEP)
                tile_op(k, "tileloadd64", 4, k.addr(xa, feat), k.i64(stride))
                tile_op(k, "tileloadd64", 5, k.addr(xa, k.add(feat, TILE * stride)), k.i64(stride))
                for p in range(2):
                    tile_op(k, "tileloadd64", 6 + p, k.addr(buf, k.add(at, tp.plane(p) + j * KSTEP * 16)), k.i64(64))
                for g in range(2):
                    for p in range(2):
                        tile_op(k, "tdpbssd", 2 * g + p, 4 + g, 6 + p)
            for c in range(4):
                tile_op(k, "tilestored64", c, k.addr(cbuf, c * C_BYTES), k.i64(64))
            d = k.load(v16, buf, k.add(at, tp.d))
            ndmin = k.load(v16, buf, k.add(at, tp.ndmin)) if mins else None
            imins = [k.cast_vec(k.load(vi, buf, k.add(at, tp.imin(p))), i16) for p in range(tp.pairs)] if mins else []
            with k.loop(skip, MIN_T, name="at") as t:
                xt = k.addr(xa, k.mul(t, stride))
                row_at = k.add(k.mul(b.lshr(t, k.i64(4)), 2 * C_BYTES), k.mul(b.and_(t, k.i64(TILE - 1)), 64))
                dx = k.splat(k.load(f32, xt, lay.d(k, 1, blk)), TILE)
                lo = k.load(vi, cbuf, row_at)
                hi = k.load(vi, cbuf, k.add(row_at, C_BYTES))
                a = isa.fma(b.sitofp(b.add(lo, b.shl(hi, ir.Constant(vi, [7] * TILE))), v16), b.fmul(d, dx),
                            k.load(v16, acc, k.mul(t, 64)))
                if mins:                                # sum_s min_s * xsum_s, two sums per step, four chains
                    chains = [ir.Constant(vi, [0] * TILE)] * 4
                    xw = _launder(k, xt)
                    for p, im in enumerate(imins):
                        word = k.load(i32, xw, lay.sums(k, 1, k.add(k.mul(blk, 2 * tp.pairs), 2 * p)))
                        chains[p % 4] = isa.dot_pairs(chains[p % 4], im, k.cast_vec(k.splat(word, TILE), i16))
                    a = isa.fma(b.sitofp(_sum_of(k, chains), v16), b.fmul(ndmin, dx), a)
                k.store(a, acc, k.mul(t, 64))
        with k.loop(skip, MIN_T, name="astore") as t:
            k.masked_store(k.load(v16, acc, k.mul(t, 64)), k.arg["y"], k.mul(k.add(k.mul(k.add(ts, t), N), r0), 4), mask)
