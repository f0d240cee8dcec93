"""q4_k, q5_k and q6_k weights interleaved 16 rows at a time ("rows16"), made once when a program
binds them.

In a GGUF file a row is its blocks one after another. A gemv over that layout spends most of its
instructions on one row's block at a time: its scales shuffled into place, its dot products
packed to words to be scaled, its partial sums reduced across lanes. With 16 rows interleaved,
one 64-byte vector holds the same 4-byte word of 16 rows' blocks, so that lanes are rows: one
broadcast activation word serves 16 rows, a sub-block's dot product is one i32 lane per row, its
scale a lane of a vector decoded once for 16 rows, and nothing is shuffled. Group g (rows 16g ..
16g+15), block b, lies at (g * blocks + b) * BYTES, each part of the block as a run of its units
(2 or 4 bytes), unit u of 16 rows side by side, in the order a gemv step reads them:

    q4_k (2304 bytes)           q5_k (2816 bytes)                 q6_k (3392 bytes)
    +0    d, dmin  2 x 32 B     +0    d, dmin  2 x 32 B            +0     scales  4 x 64 B (int8)
    +64   scales   3 x 64 B     +64   scales   3 x 64 B            +256   16 x (ql, ql, qh) 3 x 64 B
    +256  nibbles 32 x 64 B     +256  8 x (nibbles, qh) 2 x 64 B   +3328  d 32 B, 32 B of zeros
                                +1280 nibbles 24 x 64 B

q4_k and q5_k: nibble word 8p + j holds weights 4j..4j+3 of sub-block 2p in its low nibbles and of
sub-block 2p+1 in its high ones; q5_k's qh word j their fifth bits (bit s for sub-block s). q6_k:
step (h, j) (half h, j < 8) holds ql word 16h + j (weights 128h + 4j.. in its low nibbles,
128h + 64 + 4j.. in its high ones), ql word 16h + 8 + j (128h + 32 + 4j.., 128h + 96 + 4j..), and
qh word 8h + j (their top two bits, in that order from bit 0); its 3360 bytes take 32 of padding
so that every block is 64-byte aligned (1% more memory, faster than unaligned). Reading the words
in the order they lie is what lets the hardware prefetcher stream them (docs/kernels.md).

The prefill kernels (qmatmul's rows gemm, and its AMX tiles) decode their panels from this layout
too (the same bits as from the file's), so a program keeps one copy of each weight; a word vector
here is already a line of an AMX weight tile. Which matmuls take it is the plan's
(``plan.layouts``); docs/kernels.md has the measurements against the file's layout.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir

from ggraph.backends.llvm.kernels.blocks import Decoded
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i8, i16, i32, vec
from ggraph.backends.llvm.kernels.isa import Isa
from ggraph.backends.llvm.kernels.plan import ROWS16_TYPES, Layout, layouts
from ggraph.backends.llvm.target import Prefetch, Target

LAYOUT = Layout.ROWS16
ROWS = 16
BLOCK = 256                     # weights per block of either type
_U16, _U32 = np.dtype(np.uint16), np.dtype(np.uint32)


def _splat(value: int) -> ir.Constant:
    return ir.Constant(vec(i32, ROWS), [value] * ROWS)


def _zero() -> ir.Constant:
    return _splat(0)


def _i16_pairs(b: ir.IRBuilder, low: ir.Value, high: ir.Value) -> ir.Value:
    """Lanes of i32 values that fit i16 as one (low, high) i16 pair per lane."""
    return b.or_(b.and_(low, _splat(0xFFFF)), b.shl(high, _splat(16)))


class _Q4K:
    """One q4_k block of a group, decoded as lanes of rows: the integer scales and mins of each
    sub-block of 32 (<16 x i32>), d and dmin (<16 x f32>), the nibble words on demand."""

    SUB = 32
    # (byte in the block, byte in the group, units, unit): d and dmin, the scale words, the nibble words
    PARTS = ((0, 0, 2, _U16), (4, 64, 3, _U32), (16, 256, 32, _U32))
    D_AT, SCALES_AT = 0, 64
    BYTES = 2304             # a block of 16 rows
    # what the rows gemm's dot products need to know of the levels: unsigned nibbles, no offset
    LEVELS = Decoded(chunk=None, signed=False, offset=0, qmax=15, scales=None, mins=None)
    MINS = True
    TERMS = 2                # (scaled dots, d) and (mins times activation sums, -dmin)

    def __init__(self, k: Kernel, isa: Isa, at: ir.Value):
        b = k.b
        self.k, self.isa, self.at = k, isa, at
        w = [k.load(vec(i32, ROWS), at, self.SCALES_AT + 64 * i) for i in range(3)]

        def field(v, shift: int, width: int) -> ir.Value:
            return b.and_(b.lshr(v, _splat(shift)), _splat((1 << width) - 1))
        # the 12 scale bytes: sub-block s < 4 keeps its 6-bit scale in byte s, its min in byte s+4;
        # s >= 4 the low 4 bits of both in byte s+4 and the high 2 in the top bits of bytes s-4 and s
        self.scales = [field(w[0], 8 * s, 6) for s in range(4)] + \
            [b.or_(field(w[2], 8 * s, 4), b.shl(field(w[0], 8 * s + 6, 2), _splat(4))) for s in range(4)]
        self.mins = [field(w[1], 8 * s, 6) for s in range(4)] + \
            [b.or_(field(w[2], 8 * s + 4, 4), b.shl(field(w[1], 8 * s + 6, 2), _splat(4))) for s in range(4)]
        self.d = isa.f16_to_f32(k.load(vec(i16, ROWS), at, self.D_AT))
        self.dmin = isa.f16_to_f32(k.load(vec(i16, ROWS), at, self.D_AT + 32))

    @staticmethod
    def quants_at(w: int) -> int:
        """Where nibble word w lies in the group's block."""
        return 256 + 64 * w

    def words(self):
        """(sub-block, word in it, <64 x i8> of levels 0..15 of 16 rows), in the order of the loads."""
        for p in range(4):
            for j in range(8):
                q = self.k.load(vec(i8, 64), self.at, self.quants_at(8 * p + j))
                yield 2 * p, j, self.isa.byte_bits(q, 0, 4, 0)
                yield 2 * p + 1, j, self.isa.byte_bits(q, 4, 4, 0)

    def min_pairs(self, p: int) -> ir.Value:
        """The mins of sub-blocks 2p and 2p+1 as one i16 pair per row."""
        return _i16_pairs(self.k.b, self.mins[2 * p], self.mins[2 * p + 1])

    def terms(self, lay, xt, blk, isum: ir.Value) -> list:
        """The block's (integer sum, float factor) terms of y, given isum = sum_s scale_s * dot_s: the
        scaled dots times d, and the mins times the activation sums of 32 times -dmin."""
        k, b = self.k, self.k.b
        sums = k.load(vec(i32, 4), xt, lay.sums32(k, 1, k.mul(blk, 8)))       # i16 pairs of sub-block sums
        msum = _zero()
        for p in range(4):
            pair = k.cast_vec(k.splat(b.extract_element(sums, ir.Constant(i32, p)), ROWS), i16)
            msum = self.isa.dot_pairs(msum, k.cast_vec(self.min_pairs(p), i16), pair)
        return [(isum, self.d), (msum, b.fneg(self.dmin))]


def _q5_k_nibbles_at(w: int) -> int:
    """Where q5_k's nibble word w lies in its group's block: the first 8 each beside a qh word."""
    return 256 + 128 * w if w < 8 else 1280 + 64 * (w - 8)


def _q5_k_qh_at(j: int) -> int:
    """Where q5_k's qh word j lies: after nibble word j."""
    return 320 + 128 * j


class _Q5K(_Q4K):
    """One q5_k block of a group: q4_k's scales, mins, d and dmin, and levels 0..31 whose fifth bits
    come from the qh words (bit s of byte l: weight l of sub-block s). The qh words lie between the
    first 8 nibble words, which the first steps read with them (the hardware prefetcher streams what
    is read in order: qh and the nibbles as two runs of their own ran at half the speed from memory);
    later steps find them in L1."""

    quants_at = staticmethod(_q5_k_nibbles_at)
    PARTS = ((0, 0, 2, _U16), (4, 64, 3, _U32), *[(48 + 4 * w, _q5_k_nibbles_at(w), 1, _U32) for w in range(8)],
             *[(16 + 4 * j, _q5_k_qh_at(j), 1, _U32) for j in range(8)], (80, _q5_k_nibbles_at(8), 24, _U32))
    BYTES = 2816             # a block of 16 rows
    LEVELS = Decoded(chunk=None, signed=False, offset=0, qmax=31, scales=None, mins=None)

    def words(self):
        """(sub-block, word in it, <64 x i8> of levels 0..31 of 16 rows): q4_k's nibbles and a bit of qh."""
        for s, j, low in super().words():
            qh = self.k.load(vec(i8, 64), self.at, _q5_k_qh_at(j))
            yield s, j, self.k.b.or_(low, self.isa.byte_bits(qh, s, 1, 4))


def _q6_k_parts(scales: int, triples: int, d: int) -> tuple:
    """q6_k's parts: the scale words at ``scales``; from ``triples``, for each half h and j < 8 the
    three words a gemv step reads (ql 16h + j, ql 16h + 8 + j, qh 8h + j), so that the weights stream
    in the order they are read; d at ``d``."""
    steps = [(h, j) for h in range(2) for j in range(8)]
    words = [(4 * (16 * h + j), 4 * (16 * h + 8 + j), 128 + 4 * (8 * h + j)) for h, j in steps]
    runs = [(at, triples + 64 * (3 * step + n), 1, _U32) for step, ats in enumerate(words) for n, at in enumerate(ats)]
    return ((192, scales, 4, _U32), *runs, (208, d, 1, _U16))


class _Q6K:
    """One q6_k block of a group, decoded as lanes of rows: the integer scales of its sub-blocks of
    16 (<16 x i32>, -128..127), d (<16 x f32>), the 6-bit levels (q + 32, 0..63) on demand."""

    SUB = 16
    SCALES_AT, TRIPLES_AT, D_AT = 0, 256, 3328
    BYTES = 3392             # a block of 16 rows, 3360 bytes, and 32 of padding: every block 64-byte aligned
    PARTS = _q6_k_parts(SCALES_AT, TRIPLES_AT, D_AT)
    LEVELS = Decoded(chunk=None, signed=False, offset=32, qmax=63, scales=None, mins=None)
    MINS = False
    TERMS = 1

    def __init__(self, k: Kernel, isa: Isa, at: ir.Value):
        b = k.b
        self.k, self.isa, self.at = k, isa, at
        w = [k.load(vec(i32, ROWS), at, self.SCALES_AT + 64 * i) for i in range(4)]
        self.scales = [b.ashr(b.shl(w[s // 4], _splat(24 - 8 * (s % 4))), _splat(24)) for s in range(16)]
        self.d = isa.f16_to_f32(k.load(vec(i16, ROWS), at, self.D_AT))

    def words(self):
        """(sub-block, word in it, <64 x i8> of levels 0..63 of 16 rows), in the order of the loads."""
        k, b, isa = self.k, self.k.b, self.isa
        for h in range(2):
            for j in range(8):
                *ql, qh = [k.load(vec(i8, 64), self.at, self.TRIPLES_AT + 64 * (3 * (8 * h + j) + n))
                           for n in range(3)]
                for i in range(4):       # weights 128h + 32i + 4j..: nibble i // 2 of ql[i % 2], bits 2i.. of qh
                    low = isa.byte_bits(ql[i % 2], 4 * (i // 2), 4, 0)
                    yield 8 * h + 2 * i + j // 4, j % 4, b.or_(low, isa.byte_bits(qh, 2 * i, 2, 4))

    def terms(self, lay, xt, blk, isum: ir.Value) -> list:
        """The block's one term: (isum - 32 * sum_s scale_s * xsum_s) times d; the activation sums of
        16 two at a time, one vpdpwssd a pair of sub-blocks."""
        k, b = self.k, self.k.b
        msum = _zero()
        for p in range(8):
            pair = k.cast_vec(k.splat(k.load(i32, xt, lay.sums(k, 1, k.add(k.mul(blk, 16), 2 * p))), ROWS), i16)
            scales = _i16_pairs(b, self.scales[2 * p], self.scales[2 * p + 1])
            msum = self.isa.dot_pairs(msum, k.cast_vec(scales, i16), pair)
        return [(b.sub(isum, b.shl(msum, _splat(5))), self.d)]


_KINDS = {"q4_k": _Q4K, "q5_k": _Q5K, "q6_k": _Q6K}      # one per plan.ROWS16_TYPES
TYPES = ROWS16_TYPES


def takes(dtype, N: int, target: Target) -> bool:
    """True if the plan lays a matmul of N rows of ``dtype`` out in rows16 on ``target``."""
    return LAYOUT in layouts(dtype, N, target)


def kind(dtype):
    """The rows16 decoder class of ``dtype`` (its PARTS, LEVELS, MINS)."""
    if dtype.name not in _KINDS:
        raise ValueError(f"rows16: no layout for {dtype.name}; it has {', '.join(_KINDS)}")
    return _KINDS[dtype.name]


def nbytes(dtype, N: int, K: int) -> int:
    """Bytes of an N x K ``dtype`` matrix in rows16 (q6_k: 32 more per block of 16 rows than in the file)."""
    return N // ROWS * (K // BLOCK) * kind(dtype).BYTES


def _checked(dtype, data: np.ndarray, N: int, K: int, size: int):
    """``dtype``'s kind, once ``data`` is checked to be ``size`` bytes per block of whole 16-row groups
    of N x K."""
    kind_ = kind(dtype)
    nb = K // BLOCK
    if K % BLOCK or N % ROWS or data.nbytes != N // ROWS * nb * size:
        raise ValueError(f"rows16: a {dtype.name} matrix of {N} x {K} has {N // ROWS * nb * size} bytes in "
                         f"whole 16-row groups; got {data.nbytes} bytes")
    return kind_


def _moves(kind_, blocks: np.ndarray, groups: np.ndarray):
    """Each part's (units in the blocks (groups, 16, blocks, count), units in the groups (groups, blocks,
    count, 16)) views, for ``blocks`` (groups, 16, blocks, block bytes) and ``groups`` (groups, blocks,
    BYTES)."""
    G, nb = blocks.shape[0], blocks.shape[2]
    for first, at, count, unit in kind_.PARTS:
        yield (blocks[..., first:first + count * unit.itemsize].view(unit).reshape(G, ROWS, nb, count),
               groups[..., at:at + count * ROWS * unit.itemsize].view(unit).reshape(G, nb, count, ROWS))


def repack(data: np.ndarray, dtype, N: int, K: int, out: np.ndarray | None = None) -> np.ndarray:
    """The rows16 bytes of a ``dtype`` matrix of N rows of K weights (``data``: its bytes, as in the
    file), in ``out`` if given (uint8, ``nbytes`` of them)."""
    kind_, nb = _checked(dtype, data, N, K, ROWS * dtype.type_size), K // BLOCK
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(N // ROWS, ROWS, nb, dtype.type_size)
    size = nbytes(dtype, N, K)
    flat = np.empty(size, np.uint8) if out is None else out
    if flat.nbytes != size or flat.dtype != np.uint8:
        raise ValueError(f"rows16: the output must be {size} bytes (uint8), not {flat.nbytes} ({flat.dtype})")
    groups = flat.reshape(N // ROWS, nb, kind_.BYTES)
    groups[..., ROWS * dtype.type_size:] = 0                          # padding
    step = max(1, (1 << 20) // (nb * kind_.BYTES))      # ~1 MB of groups a step: its many parts read it from cache
    for g in range(0, N // ROWS, step):
        for src, dst in _moves(kind_, blocks[g:g + step], groups[g:g + step]):
            dst[:] = src.transpose(0, 2, 3, 1)
    return flat


def unpack(data: np.ndarray, dtype, N: int, K: int) -> np.ndarray:
    """The file's bytes of a rows16 matrix (repack's inverse)."""
    kind_, nb = _checked(dtype, data, N, K, kind(dtype).BYTES), K // BLOCK
    groups = np.ascontiguousarray(data).view(np.uint8).reshape(N // ROWS, nb, kind_.BYTES)
    out = np.empty((N // ROWS, ROWS, nb, dtype.type_size), np.uint8)
    for dst, src in _moves(kind_, out, groups):
        dst[:] = src.transpose(0, 3, 1, 2)
    return out.reshape(-1)


def group_at(k: Kernel, dtype, lay, row, blk) -> ir.Value:
    """Address of block ``blk`` of the 16-row group that starts at ``row`` (a multiple of 16)."""
    nb = lay.K // BLOCK
    return k.addr(k.arg["w"], k.mul(k.add(k.mul(k.b.sdiv(row, k.i64(ROWS)), nb), blk), kind(dtype).BYTES))


# How far ahead an Intel gemv asks for its weights (Prefetch.ROWS): the L2 streamer stops at 4 KB pages
GEMV_AHEAD = 12288


def gemv(k: Kernel, isa: Isa, dtype, lay, rows, prefetch: Prefetch | None) -> None:
    """y[rows] for the one token: 16 rows at a time, every activation word broadcast to the 16 rows'
    dot products, each sub-block's dot times its scales in i32 lanes, one float step per block and
    term. ``rows``: [start, end), multiples of 16.

    The weights stream in order. Without ``prefetch`` (the plan's, None on AMD) the hardware
    prefetcher alone fetches them ahead; with Prefetch.ROWS (Intel) each block asks for the lines
    GEMV_AHEAD bytes on, into L2. A group's pass over its row streams a block of 16 rows through L1
    at a time, which evicts the activations before the next group reads them again once the row is
    longer than a few blocks, so each block asks for the next block's activations."""
    b = k.b
    kind_ = kind(dtype)
    nb, words = lay.K // BLOCK, kind_.SUB // 4
    xt = k.arg["xq"]
    v16 = vec(f32, ROWS)
    with k.loop(*rows, step=ROWS, name="n") as row:
        accs = [k.var(v16, ir.Constant(v16, [0.0] * ROWS)) for _ in range(kind_.TERMS)]
        with k.loop(0, nb, name="blk") as blk:
            x = k.mul(blk, BLOCK)
            for line in range(0, BLOCK, 64):             # the next block's activations, into L1
                k.prefetch(k.addr(xt, k.add(x, BLOCK + line)), level=1)
            at = group_at(k, dtype, lay, row, blk)
            if prefetch is Prefetch.ROWS:
                for line in range(0, kind_.BYTES, 64):
                    k.prefetch(k.addr(at, GEMV_AHEAD + line), level=2)
            g = kind_(k, isa, at)
            dots = [_zero()] * (BLOCK // kind_.SUB)
            for s, j, w in g.words():
                word = k.load(i32, xt, k.add(x, 4 * (words * s + j)))
                dots[s] = isa.dot(dots[s], w, k.cast_vec(k.splat(word, ROWS), i8), False, kind_.LEVELS.qmax)
            isum = None
            for s, dot in enumerate(dots):
                scaled = b.mul(dot, g.scales[s])
                isum = scaled if isum is None else b.add(isum, scaled)
            dx = k.splat(k.load(f32, xt, lay.d(k, 1, blk)), ROWS)
            for acc, (total, factor) in zip(accs, g.terms(lay, xt, blk, isum), strict=True):
                acc.set(isa.fma(b.sitofp(total, v16), b.fmul(factor, dx), acc.get()))
        y = accs[0].get()
        for acc in accs[1:]:
            y = b.fadd(y, acc.get())
        k.store(y, k.arg["y"], k.mul(row, 4))


def decode_panel(k: Kernel, isa: Isa, lay, row, blk, buf, vat, panel) -> None:
    """Block ``blk`` of the 16 rows from ``row`` into a rows gemm panel at ``vat`` (qmatmul.Panel's
    places: levels as u8 words, f32 integer scales, d, and for q4_k and q5_k -dmin and the min pairs)."""
    b = k.b
    dtype = panel.fmt.dtype
    g = kind(dtype)(k, isa, group_at(k, dtype, lay, row, blk))
    for s, scale in enumerate(g.scales):
        k.store(b.sitofp(scale, vec(f32, ROWS)), buf, k.add(vat, panel.iscale(s)))
    k.store(g.d, buf, k.add(vat, panel.d))
    if g.MINS:
        k.store(b.fneg(g.dmin), buf, k.add(vat, panel.ndmin))
        for p in range(len(g.mins) // 2):
            k.store(g.min_pairs(p), buf, k.add(vat, panel.imin(p)))
    for s, j, w in g.words():
        k.store(w, buf, k.add(vat, panel.word(s, j)))
