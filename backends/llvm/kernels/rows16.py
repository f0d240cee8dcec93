"""q4_k weights interleaved 16 rows at a time ("rows16"), made once when a program binds them.

In a GGUF file a q4_k row is its 144-byte blocks one after another. A gemv over that layout
spends most of its instructions on one row's block at a time: its 6-bit scales shuffled into
place, its dot products packed to words to be scaled, its partial sums reduced across lanes.
With 16 rows interleaved, one 64-byte vector holds the same 4-byte word of 16 rows' blocks, so
that lanes are rows: one broadcast activation word serves 16 rows, a sub-block's dot product is
one i32 lane per row, its scale a lane of a vector decoded once for 16 rows, and nothing is
shuffled. Group g (rows 16g .. 16g+15), block b, at (g * blocks + b) * 2304 bytes:

    +0     d     16 x f16        the rows' block scales
    +32    dmin  16 x f16
    +64    3 x 64 bytes          word w (w < 3) of the 12 packed scale bytes, of each row
    +256   32 x 64 bytes         word w (w < 32) of the 128 nibble bytes, of each row

the same bytes as the 16 rows' blocks, so the weights take no more memory than in the file
(where they are read once, to repack them). Word 8p + j of the nibbles holds weights 4j..4j+3
of sub-block 2p in its low nibbles and of sub-block 2p+1 in its high ones.

The prefill kernel (qmatmul's rows gemm) decodes its panels from this layout too (the same bits
as from the file's), so a program keeps one copy of each weight. On a Zen 4, one thread, the
gemv ran 2048 x 8192 at 40-55 GB/s from L3 where the file's layout ran 20-25, and from memory
1.0-1.3x as fast for rows of 2048 (8192-wide rows 1.0-1.1x; once, for a few minutes, 0.5-0.8x);
two threads share the memory bandwidth, and there both layouts run at about what it gives
(``python benchmarks/kernels.py --shapes q4_k:2048:8192,q4_k:8192:2048 --layouts file,rows16``,
alternating rounds).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir

from ggraph.backends.llvm.kernels.blocks import Decoded
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i8, i16, i32, vec
from ggraph.backends.llvm.kernels.isa import Isa
from ggraph.backends.llvm.target import Target

LAYOUT = "rows16"
ROWS = 16
BLOCK = 256                     # weights per q4_k block
BLOCK_BYTES = 144
GROUP_BYTES = ROWS * BLOCK_BYTES
SCALES_AT, QUANTS_AT = 64, 256
# what the rows gemm's dot products need to know of every rows16 level: unsigned nibbles, no offset
LEVELS = Decoded(chunk=None, signed=False, offset=0, qmax=15, scales=None, mins=None)


def takes(dtype, N: int, target: Target) -> bool:
    """True if a q4_k matmul of N rows runs on rows16 weights on ``target``: AVX-512 VNNI (whose rows
    gemm takes rows as lanes too), no AMX tiles (whose kernels read the file's layout), and whole
    32-row tiles."""
    from ggraph.backends.llvm.kernels.act_quant import rows_gemm
    return (dtype.name == "q4_k" and rows_gemm(target) and not target.has("amx-int8")
            and N > 0 and N % (2 * ROWS) == 0)


# (byte in the block, byte in the group, units, unit): d and dmin, the scale words, the nibble words
_PARTS = ((0, 0, 2, np.dtype(np.uint16)), (4, SCALES_AT, 3, np.dtype(np.uint32)),
          (16, QUANTS_AT, 32, np.dtype(np.uint32)))


def repack(data: np.ndarray, N: int, K: int, out: np.ndarray | None = None) -> np.ndarray:
    """The rows16 bytes of a q4_k matrix of N rows of K weights (``data``: its bytes, as in the file),
    in ``out`` if given (uint8, as many bytes)."""
    nb = K // BLOCK
    if K % BLOCK or N % ROWS or data.nbytes != N * nb * BLOCK_BYTES:
        raise ValueError(f"rows16: a q4_k matrix of {N} x {K} has {N * (K // BLOCK) * BLOCK_BYTES} bytes in whole "
                         f"16-row groups; got {data.nbytes} bytes")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(N // ROWS, ROWS, nb, BLOCK_BYTES)
    flat = np.empty(data.nbytes, np.uint8) if out is None else out
    if flat.nbytes != data.nbytes or flat.dtype != np.uint8:
        raise ValueError(f"rows16: the output must be {data.nbytes} bytes (uint8), not {flat.nbytes} ({flat.dtype})")
    out = flat.reshape(N // ROWS, nb, GROUP_BYTES)
    for first, at, count, unit in _PARTS:                   # each part moved in units of 2 or 4 bytes
        part = blocks[..., first:first + count * unit.itemsize].view(unit).reshape(N // ROWS, ROWS, nb, count)
        out[..., at:at + count * ROWS * unit.itemsize].view(unit).reshape(N // ROWS, nb, count, ROWS)[:] = \
            part.transpose(0, 2, 3, 1)
    return flat


def unpack(data: np.ndarray, N: int, K: int) -> np.ndarray:
    """The file's bytes of a rows16 matrix (repack's inverse)."""
    nb = K // BLOCK
    groups = np.ascontiguousarray(data).view(np.uint8).reshape(N // ROWS, nb, GROUP_BYTES)
    out = np.empty((N // ROWS, ROWS, nb, BLOCK_BYTES), np.uint8)
    for first, at, count, unit in _PARTS:
        part = groups[..., at:at + count * ROWS * unit.itemsize].view(unit).reshape(N // ROWS, nb, count, ROWS)
        out[..., first:first + count * unit.itemsize].view(unit).reshape(N // ROWS, ROWS, nb, count)[:] = \
            part.transpose(0, 3, 1, 2)
    return out.reshape(-1)


class Group:
    """One block of a 16-row group, decoded as lanes of rows: the integer scales and mins of each
    sub-block (<16 x i32>), d and dmin (<16 x f32>), and the nibble words on demand."""

    def __init__(self, k: Kernel, isa: Isa, at: ir.Value):
        b = k.b
        self.k, self.isa, self.at = k, isa, at
        w = [k.load(vec(i32, ROWS), at, SCALES_AT + 64 * i) for i in range(3)]

        def field(v, shift: int, width: int) -> ir.Value:
            return b.and_(b.lshr(v, _splat(shift)), _splat((1 << width) - 1))
        # q4_k's 12 scale bytes: sub-block s < 4 keeps its 6-bit scale in byte s, its min in byte s+4;
        # s >= 4 the low 4 bits of both in byte s+4 and the high 2 in the top bits of bytes s-4 and s
        self.scales = [field(w[0], 8 * s, 6) for s in range(4)] + \
            [b.or_(field(w[2], 8 * s, 4), b.shl(field(w[0], 8 * s + 6, 2), _splat(4))) for s in range(4)]
        self.mins = [field(w[1], 8 * s, 6) for s in range(4)] + \
            [b.or_(field(w[2], 8 * s + 4, 4), b.shl(field(w[1], 8 * s + 6, 2), _splat(4))) for s in range(4)]
        self.d = isa.f16_to_f32(k.load(vec(i16, ROWS), at, 0))
        self.dmin = isa.f16_to_f32(k.load(vec(i16, ROWS), at, 32))

    def nibbles(self, p: int, j: int) -> tuple[ir.Value, ir.Value]:
        """Word j of sub-blocks 2p (low nibbles) and 2p+1 (high), 16 rows: two <64 x i8> of levels 0..15."""
        q = self.k.load(vec(i8, 64), self.at, QUANTS_AT + 64 * (8 * p + j))
        low = self.k.b.and_(q, ir.Constant(q.type, [0x0F] * 64))
        return low, self.isa.nibbles(q, [True] * 8)

    def min_pairs(self, p: int) -> ir.Value:
        """The mins of sub-blocks 2p and 2p+1 as one i16 pair per row."""
        return self.k.b.or_(self.mins[2 * p], self.k.b.shl(self.mins[2 * p + 1], _splat(16)))


def _splat(value: int) -> ir.Constant:
    return ir.Constant(vec(i32, ROWS), [value] * ROWS)


def group_at(k: Kernel, lay, row, blk) -> ir.Value:
    """Address of block ``blk`` of the 16-row group that starts at ``row`` (a multiple of 16)."""
    nb = lay.K // BLOCK
    return k.addr(k.arg["w"], k.mul(k.add(k.mul(k.b.sdiv(row, k.i64(ROWS)), nb), blk), GROUP_BYTES))


def gemv(k: Kernel, isa: Isa, lay, rows) -> None:
    """y[rows] for the one token: 16 rows at a time, every activation word broadcast to the 16 rows'
    dot products, each sub-block's dot times its scales in i32 lanes, one float step per block.
    ``rows``: [start, end), multiples of 16.

    The weights stream in order, and the hardware prefetcher alone fetches them ahead (asking for
    them 8-64 KB ahead cost 5-25% on a Zen 4). A group's pass over its row streams 2304 bytes a
    block through L1, which evicts the activations before the next group reads them again once
    the row is longer than about 8 blocks, so each block asks for the next block's activations: on
    a Zen 4, one thread, from memory, 8192 x 2048 0.83-0.91x of the file's layout without, 1.0-1.1x
    with."""
    b = k.b
    nb = lay.K // BLOCK
    xt = k.arg["xq"]
    with k.loop(*rows, step=ROWS, name="n") as row:
        acc = k.var(vec(f32, ROWS), ir.Constant(vec(f32, ROWS), [0.0] * ROWS))
        macc = k.var(vec(f32, ROWS), ir.Constant(vec(f32, ROWS), [0.0] * ROWS))
        with k.loop(0, nb, name="blk") as blk:
            at = group_at(k, lay, row, blk)
            x = k.mul(blk, BLOCK)
            for line in range(0, BLOCK, 64):             # the next block's activations, into L1
                k.prefetch(k.addr(xt, k.add(x, BLOCK + line)), level=1)
            g = Group(k, isa, at)
            isum = None
            for p in range(4):
                zero = ir.Constant(vec(i32, ROWS), [0] * ROWS)
                dots = [zero, zero]
                for j in range(8):
                    for h, w in enumerate(g.nibbles(p, j)):
                        word = k.load(i32, xt, k.add(x, 64 * p + 32 * h + 4 * j))
                        dots[h] = isa.dot(dots[h], w, k.cast_vec(k.splat(word, ROWS), i8), False, 15)
                scaled = b.add(b.mul(dots[0], g.scales[2 * p]), b.mul(dots[1], g.scales[2 * p + 1]))
                isum = scaled if isum is None else b.add(isum, scaled)
            sums = k.load(vec(i32, 4), xt, lay.sums32(k, 1, k.mul(blk, 8)))    # i16 pairs of sub-block sums
            msum = ir.Constant(vec(i32, ROWS), [0] * ROWS)
            for p in range(4):
                pair = k.cast_vec(k.splat(b.extract_element(sums, ir.Constant(i32, p)), ROWS), i16)
                msum = isa.dot_pairs(msum, k.cast_vec(g.min_pairs(p), i16), pair)
            dx = k.splat(k.load(f32, xt, lay.d(k, 1, blk)), ROWS)
            acc.set(isa.fma(b.sitofp(isum, vec(f32, ROWS)), b.fmul(g.d, dx), acc.get()))
            macc.set(isa.fma(b.sitofp(msum, vec(f32, ROWS)), b.fmul(g.dmin, dx), macc.get()))
        k.store(b.fsub(acc.get(), macc.get()), k.arg["y"], k.mul(row, 4))


def decode_panel(k: Kernel, isa: Isa, lay, row, blk, buf, vat, panel) -> None:
    """Block ``blk`` of the 16 rows from ``row`` into a rows gemm panel at ``vat`` (qmatmul.Panel's
    places: nibble words as u8 levels, f32 integer scales, d, -dmin and the min pairs)."""
    b = k.b
    g = Group(k, isa, group_at(k, lay, row, blk))
    for s in range(8):
        k.store(b.sitofp(g.scales[s], vec(f32, ROWS)), buf, k.add(vat, panel.iscale(s)))
    k.store(g.d, buf, k.add(vat, panel.d))
    k.store(b.fneg(g.dmin), buf, k.add(vat, panel.ndmin))
    for p in range(4):
        k.store(g.min_pairs(p), buf, k.add(vat, panel.imin(p)))
        for j in range(8):
            low, high = g.nibbles(p, j)
            k.store(low, buf, k.add(vat, panel.word(2 * p, j)))
            k.store(high, buf, k.add(vat, panel.word(2 * p + 1, j)))
