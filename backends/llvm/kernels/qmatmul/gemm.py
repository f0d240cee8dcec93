"""The quantised matmul for T > 1 without AVX-512 VNNI (Method.GEMM): tiles of R rows x G groups
of 16 tokens (``plan.gemm_tile``). Lanes are tokens: each 4-byte word of a decoded weight chunk is
broadcast and dotted with the same word of 16 tokens (one 64-byte load of act_quant's interleaved
activations), so no horizontal sums. With AArch64's i8mm, pairs of rows dot pairs of tokens 8 bytes at
a time instead (smmla, ``_mmla_dots``): the same integer sums. Its arithmetic is the rows gemm's
(super-blocks summed times their integer scales, one float step per block), so every x86 vector
feature set gives a prefill the same bits, and every AArch64 one too.
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.backends.llvm.kernels.act_quant import GROUP
from ggraph.backends.llvm.kernels.blocks import pack
from ggraph.backends.llvm.kernels.builder import f32, i8, i32, vec
from ggraph.backends.llvm.kernels.qmatmul.context import Matmul, launder


def gemm(m: Matmul, rows) -> None:
    """Tiles of R rows x G token groups, then the row and group tails."""
    k = m.k
    b = k.b
    R, G = m.plan.gemm_tile
    T = k.arg["T"]
    groups = b.sdiv(k.add(T, GROUP - 1), k.i64(GROUP))
    start, end = rows
    full = k.add(start, b.mul(b.sdiv(b.sub(end, start), k.i64(R)), k.i64(R)))
    gfull = b.mul(b.sdiv(groups, k.i64(G)), k.i64(G))
    #         rows          tile rows   token-group spans and their tile widths
    spans = [((start, full), R, [((0, gfull), G), ((gfull, groups), 1)]),
             ((full, end), 1, [((0, groups), 1)])]          # row tails are rare: 1 x 1 tiles
    for (lo, hi), r, widths in spans:
        with k.loop(lo, hi, step=r, name=f"n{r}") as n:
            for (glo, ghi), g in widths:
                with k.loop(glo, ghi, step=g, name=f"g{r}x{g}") as g0:
                    _tile(m, n, r, g0, g)


def _tile(m: Matmul, n0, R: int, g0, G: int):
    """Rows n0..n0+R x tokens 16*g0..16*(g0+G): R*G accumulators of 16 token lanes.
    Chunks are visited `fmt.unroll` at a time in a run-time loop, which keeps the IR small."""
    k, isa, fmt, lay = m.k, m.isa, m.fmt, m.lay
    L = GROUP
    v16 = vec(f32, L)
    xg = [k.addr(k.arg["xq"], k.mul(k.add(g0, g), lay.group_bytes(L))) for g in range(G)]
    zero = ir.Constant(v16, [0.0] * L)
    acc = [[k.var(v16, zero) for _ in range(G)] for _ in range(R)]
    U = fmt.unroll
    with k.loop(0, lay.K // fmt.dtype.block_size, name="blk") as blk:
        decs = [fmt.decode(k, isa, m.row(k.add(n0, r), blk)) for r in range(R)]
        dx = [k.load(v16, xg[g], lay.d(k, L, blk)) for g in range(G)]                 # (16,) f32
        # super-block types sum their sub-blocks' dots times the integer scales first (exact small
        # integers in f32 lanes) and take one float step per block, as llama.cpp does
        sums = [[k.var(v16, zero) for _ in range(G)] for _ in range(R)] if decs[0].ints is not None else None
        if fmt.chunks == U:
            for c in range(U):
                _chunk(m, decs, blk, c, xg, dx, acc, sums)
        else:
            with k.loop(0, fmt.chunks // U, name="cg") as cg:
                for i in range(U):
                    _chunk(m, decs, blk, k.add(k.mul(cg, U), i), xg, dx, acc, sums)
        if sums is not None:
            _block_end(m, decs, blk, xg, dx, acc, sums)
    _store_tile(m, n0, R, g0, G, acc)


def _block_end(m: Matmul, decs, blk, xg, dx, acc, sums) -> None:
    """A super-block's float step: acc += d*dx * sum_s(scale_s * dot_s) - dmin*dx * sum_s(min_s * xsum_s),
    both sums exact integers in f32 lanes (below 2**24)."""
    k, isa, fmt = m.k, m.isa, m.fmt
    b = k.b
    L = GROUP
    v16 = vec(f32, L)
    R, G = len(decs), len(xg)
    for r, dec in enumerate(decs):
        for g in range(G):
            acc[r][g].set(isa.fma(sums[r][g].get(), b.fmul(k.splat(dec.ints.d, L), dx[g]), acc[r][g].get()))
    if decs[0].ints.mins is None:
        return
    msum = [[None] * G for _ in range(R)]
    for s in range(fmt.dtype.block_size // fmt.sub):
        xs = [b.sitofp(m.xsum(L, xg[g], blk, s), v16) for g in range(G)]
        for r in range(R):
            mn = k.splat(decs[r].int_min(k, s), L)
            for g in range(G):
                msum[r][g] = b.fmul(xs[g], mn) if msum[r][g] is None else isa.fma(xs[g], mn, msum[r][g])
    for r, dec in enumerate(decs):
        for g in range(G):
            dmin = b.fmul(k.splat(b.fneg(dec.ints.dmin), L), dx[g])
            acc[r][g].set(isa.fma(msum[r][g], dmin, acc[r][g].get()))


def _chunk(m: Matmul, decs, blk, c, xg, dx, acc, sums) -> None:
    """Chunk c (an int or i64 value) of every tile row's block against every token group: into
    ``acc`` scaled by the sub-block's float scale, or for super-block types into the block's
    ``sums`` times its integer scale (mins wait for `_block_end`)."""
    k, isa, fmt, lay = m.k, m.isa, m.fmt, m.lay
    b = k.b
    L = GROUP
    v16 = vec(f32, L)
    R, G = len(decs), len(xg)
    dec0 = decs[0]
    chunks = [k.cast_vec(d.chunk(c), i32) for d in decs]                          # (8,) i32 each
    xrows = [xg] * R
    from_memory = m.plan.gemm_from_memory
    if from_memory:
        # Weight words are broadcast from memory (vpbroadcastd m32), not permuted in registers (each
        # permute holds an index vector), and every tile row loads the activations itself: LLVM
        # would otherwise load them once and spill them for the next row. Both take pointers it
        # cannot see through (`launder`), or it would forward the stores and merge the loads.
        wbuf = k.scratch(i32, 8 * R)
        for r, ch in enumerate(chunks):
            k.store(ch, wbuf, 32 * r)
        words_at = launder(k, wbuf)
        xrows = [xg] + [[launder(k, x) for x in xg] for _ in range(R - 1)]
    subs = m.chunk_subs(c)
    words = k.add(k.mul(blk, fmt.dtype.block_size // 4), k.mul(c, 8))
    mmla = m.plan.gemm_mmla and R % 2 == 0 and (dec0.signed or dec0.qmax <= 127)     # s8 x s8, as sdot
    for si, s in enumerate(subs):
        xs = [None if lay.keeps_s else m.xsum(L, xg[g], blk, s) for g in range(G)]
        init = [b.mul(x, ir.Constant(vec(i32, L), [-dec0.offset] * L)) if dec0.offset
                else ir.Constant(vec(i32, L), [0] * L) for x in xs]
        dots = [[init[g] for g in range(G)] for _ in range(R)]
        per = 8 // len(subs)
        run = isa.i16_run(dec0.signed, dec0.qmax, 4 * L)
        if mmla:
            dots = _mmla_dots(m, chunks, xg, words, range(si * per, (si + 1) * per), init)
        for r in range(0 if mmla else R):
            part = [None] * G                                                        # i16 pair sums
            for n_j, j in enumerate(range(si * per, (si + 1) * per)):
                xv = [k.load(vec(i8, 4 * L), xrows[r][g], lay.qs(k, L, k.add(words, j))) for g in range(G)]
                wb = k.splat(k.load(i32, words_at, 32 * r + 4 * j), L) if from_memory else \
                    k.shuffle(chunks[r], [j] * L)
                wb = k.cast_vec(wb, i8)                                                # (64,) i8
                for g in range(G):
                    if run == 1:
                        dots[r][g] = isa.dot(dots[r][g], wb, xv[g], dec0.signed, dec0.qmax)
                    else:
                        part[g] = isa.pair_sums(wb, xv[g], part[g])
                        if (n_j + 1) % run == 0 or n_j + 1 == per:
                            dots[r][g], part[g] = isa.widen(dots[r][g], part[g]), None
        if sums is not None:
            for r in range(R):
                iscale = k.splat(decs[r].int_scale(k, s), L)
                for g in range(G):
                    sums[r][g].set(isa.fma(b.sitofp(dots[r][g], v16), iscale, sums[r][g].get()))
            continue
        for g in range(G):
            xf = None if dec0.mins is None else lay.load_s(k, isa, xg[g], L, blk, L) if lay.keeps_s else \
                b.fmul(b.sitofp(xs[g], v16), dx[g])                                # dx xsum, or q8_1's s
            for r in range(R):
                scale = b.fmul(k.splat(decs[r].scale(k, s), L), dx[g])
                a = isa.fma(b.sitofp(dots[r][g], v16), scale, acc[r][g].get())
                if xf is not None:
                    a = isa.fma(k.splat(b.fneg(decs[r].min(k, s)), L), xf, a)
                acc[r][g].set(a)


def _mmla_dots(m: Matmul, chunks, xg, words, js: range, init) -> list:
    """``dots[r][g]``: ``init[g]`` plus the dot of words ``js`` of chunk row r with every token of group g,
    by smmla on (2 rows x 8 bytes) by (2 tokens x 8 bytes) tiles: words j, j+1 of a row pair (one
    register), of each token pair (zipped from the two 64-byte word loads); each 2x2 result's rows go
    back to the token lanes at the end."""
    k, isa, lay = m.k, m.isa, m.lay
    L, R, G = GROUP, len(chunks), len(xg)
    zero = ir.Constant(vec(i32, 4), [0] * 4)
    dots = [[None] * G for _ in range(R)]
    for g in range(G):
        acc = [[zero] * (L // 2) for _ in range(R // 2)]              # [row pair][token pair]
        for j in js[::2]:
            xj, xj1 = (k.cast_vec(k.load(vec(i8, 4 * L), xg[g], lay.qs(k, L, k.add(words, w))), i32)
                       for w in (j, j + 1))                            # (16,) i32: every token's word
            zipped = k.shuffle(xj, [i for t in range(L) for i in (t, L + t)], xj1)       # t: word j, j+1
            tokens = [k.cast_vec(x, i8) for x in k.split(zipped, L // 2)]               # (16,) i8 pairs
            for rp in range(R // 2):
                rows = k.cast_vec(k.shuffle(chunks[2 * rp], [j, j + 1, 8 + j, 9 + j], chunks[2 * rp + 1]), i8)
                for p, x in enumerate(tokens):
                    acc[rp][p] = isa.mmla(acc[rp][p], rows, x)        # [r·t, r·t+1, r+1·t, r+1·t+1]
        for rp in range(R // 2):
            joined = k.concat(*acc[rp])                                 # (32,) i32
            for half in (0, 1):                                         # row 2rp, then 2rp + 1
                lanes = k.shuffle(joined, [4 * p + 2 * half + i for p in range(L // 2) for i in (0, 1)])
                dots[2 * rp + half][g] = k.b.add(init[g], lanes)
    return dots


def _store_tile(m: Matmul, n0, R: int, g0, G: int, acc) -> None:
    """y[t, n0:n0+R] for every real token t of the tile's groups."""
    k = m.k
    b = k.b
    T = k.arg["T"]
    for g in range(G):
        vals = [acc[r][g].get() for r in range(R)]
        for lane in range(GROUP):
            t = k.add(k.mul(k.add(g0, g), GROUP), lane)
            with k.if_then(b.icmp_signed("<", t, T)):
                row = [b.extract_element(v, ir.Constant(i32, lane)) for v in vals]
                out = row[0] if R == 1 else pack(k, row)
                k.store(out, k.arg["y"], k.mul(k.add(k.mul(t, m.N), n0), 4))
