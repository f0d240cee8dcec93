"""AMX tiles: their geometry, which weight types they take, the tile configuration, and the raw
tile instruction. The quantised matmul's tile driver is qmatmul/tiles.py; kernels emit tile
instructions through ``Isa.tile``, which checks the target has them.

A tile multiply (tdpbssd) adds a [16 x 64] s8 tile times a [64 x 16] s8 tile into a [16 x 16]
i32 tile: 16 tokens' activations times 16 weight rows in VNNI order (each 64-byte line holds the
same 4 features of 16 rows).
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels.builder import Kernel, i8

TILE = 16                  # rows of a tile, and 4-byte columns; weight rows per tile of the matrix
MIN_T = 2 * TILE           # tokens the path needs (a pair of token tiles; fewer go to the rows gemm)
KSTEP = 64                 # features per tile multiply
GROUP_TILES = 4            # tiles of rows that take each pair's activations in turn (from L1)


def on_tiles(dtype) -> bool:
    """True for the weight types the tiles can take: super-block types (integer sub-block scales).
    Types with a float scale per 32 weights would need each 32 features' result tiles stored and
    scaled, which costs more than the multiply saves."""
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
    """One AMX instruction on fixed tile registers (ints) and addresses, unchecked: measurement code
    calls it where it has checked the target; kernels go through ``Isa.tile``."""
    k.intrinsic(f"llvm.x86.{op}", ir.VoidType(), [ir.Constant(i8, a) if isinstance(a, int) else a for a in args])
