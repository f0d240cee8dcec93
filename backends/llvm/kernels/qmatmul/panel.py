"""Weight panels: blocks of 16 rows decoded once into a private buffer with rows as lanes (one
64-byte line holds the same 4-byte word of 16 rows), which the rows gemm (``Panel``) and the AMX
tiles (``TilePanel``) then read for many tokens; and the pieces both decode with.

Both layouts end each block with the same float factors, a 64-byte line each (``Factors``): the
rows' d, their negated dmin where the type has mins, and the integer mins as i16 pairs.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ggraph.backends.llvm.kernels import amx
from ggraph.backends.llvm.kernels.act_quant import ActLayout
from ggraph.backends.llvm.kernels.blocks import BlockFormat, pack
from ggraph.backends.llvm.kernels.builder import Kernel, i32, i64, vec

ROWS = 16                # lanes are rows: one 64-byte vector holds the same 4 features of 16 rows


class Factors:
    """Where a block's float factors lie in a panel, after its weights (``d``): d, -dmin, then the
    integer min pairs, a 64-byte line each."""

    @property
    def d(self) -> int:
        raise NotImplementedError

    @property
    def ndmin(self) -> int:
        return self.d + 64

    def imin(self, p: int) -> int:
        return self.d + 128 + 64 * p


@dataclass(frozen=True)
class Panel(Factors):
    """Where one block of a 16-row vector lies in a rows gemm panel: for each sub-block its 4-byte
    words of 16 rows (64 bytes each) and, for super-block types, its integer scales as f32; then the
    factors, one min pair for each pair of sub-blocks (so that one vpdpwssd takes the mins of two).
    ``room`` bytes per block and vector."""

    fmt: BlockFormat
    ints: bool               # sub-blocks with integer scales of their own (super-block types)
    mins: bool

    @property
    def subs(self) -> int:
        return self.fmt.dtype.block_size // self.fmt.sub

    @property
    def sub_bytes(self) -> int:
        return 64 * (self.fmt.sub // 4 + self.ints)

    def word(self, s: int, j: int) -> int:
        return s * self.sub_bytes + 64 * j

    def iscale(self, s: int) -> int:
        return s * self.sub_bytes + 16 * self.fmt.sub

    @property
    def d(self) -> int:
        return self.subs * self.sub_bytes

    @staticmethod
    def room(fmt: BlockFormat) -> int:
        """Bytes per block and vector, enough for every layout of ``fmt``."""
        widest = Panel(fmt, True, True)
        return widest.imin(widest.subs)


@dataclass(frozen=True)
class TilePanel(Factors):
    """Where one block of 16 rows lies in a tile panel: its planes (lo and hi, or the one plane of a
    ONE_PLANE type), ``block_size / 4`` 64-byte lines each; then the factors, one min pair per pair
    of activation sums (of ``unit`` features: 32 for types with sub-blocks of 32, whose mins then take
    half as many pairs, else act_quant's sum blocks)."""

    fmt: BlockFormat
    lay: ActLayout

    @property
    def unit(self) -> int:
        return 32 if self.fmt.sub == 32 and self.lay.has_sums32 else self.lay.sum_block

    @property
    def planes(self) -> int:
        return 1 if self.fmt.dtype in amx.ONE_PLANE else 2

    @property
    def sign(self) -> int:
        """How a one-plane type's plane holds v: v (1) or -v (-1)."""
        return amx.ONE_PLANE.get(self.fmt.dtype, 1)

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
    def room(self) -> int:
        return self.imin(self.pairs)


def store_int_factors(k: Kernel, fmt: BlockFormat, decs, buf, at, panel: Factors, unit: int) -> None:
    """A super-block of 16 rows' float factors into a panel at ``at``, rows as lanes: d, and for types
    with mins the negated dmin and the integer mins as i16 pairs, one pair for each pair of
    ``unit``-feature runs."""
    k.store(k.concat(*[pack(k, [d.ints.d]) for d in decs]), buf, k.add(at, panel.d))
    if decs[0].mins is not None:
        k.store(k.concat(*[pack(k, [k.b.fneg(d.ints.dmin)]) for d in decs]), buf, k.add(at, panel.ndmin))
        for p, col in enumerate(k.transpose([min_pairs(k, fmt, d.ints.mins, unit) for d in decs])):
            k.store(col, buf, k.add(at, panel.imin(p)))


def min_pairs(k: Kernel, fmt: BlockFormat, mins: ir.Value, unit: int) -> ir.Value:
    """A row's integer mins as one i16 pair per pair of ``unit``-feature runs of the block: (the min of
    run 2p's sub-block, the min of run 2p+1's), as <pairs x i32>."""
    b = k.b
    n = fmt.dtype.block_size // unit // 2
    first = k.shuffle(mins, [2 * p * unit // fmt.sub for p in range(n)])
    second = k.shuffle(mins, [(2 * p + 1) * unit // fmt.sub for p in range(n)])
    return b.or_(b.and_(first, ir.Constant(vec(i32, n), [0xFFFF] * n)), b.shl(second, ir.Constant(vec(i32, n), [16] * n)))


def row_mask(k: Kernel, r0, first: int, n0, end):
    """<16 x i1>: which of rows r0+first .. r0+first+15 a tile that owns [n0, end) stores (a last tile
    shifted back over rows before n0 leaves those to their own tile)."""
    rows = k.add(k.splat(r0, ROWS), ir.Constant(vec(i64, ROWS), [first + r for r in range(ROWS)]))
    return k.b.and_(k.b.icmp_signed(">=", rows, k.splat(n0, ROWS)), k.b.icmp_signed("<", rows, k.splat(end, ROWS)))


def tile_rows(k: Kernel, N: int, n0, vecs: int):
    """The first row a tile of 16*vecs rows starting at n0 decodes: n0, or N - 16*vecs for the last
    tile of the matrix, whose rows are then all real (the rows before n0 are decoded again but not
    stored). N >= 16*vecs."""
    return k.b.select(k.b.icmp_signed("<", n0, k.i64(N - vecs * ROWS)), n0, k.i64(N - vecs * ROWS))


def panel_count(k: Kernel, p0, per_panel: int, nblocks: int):
    """Blocks in the K panel that starts at block p0: per_panel, or what is left of the row."""
    b = k.b
    return b.select(b.icmp_signed("<", k.add(p0, per_panel), k.i64(nblocks)), k.i64(per_panel),
                    b.sub(k.i64(nblocks), p0))
