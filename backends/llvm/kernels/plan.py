"""The kernel plan: which kernel runs for a quantised or float matmul, given the weight type, the
rows, the shape class (gemv T == 1, gemm T > 1, AMX tiles from MIN_T tokens, rows_only: every
token alike) and the target, and with which parameters. Lowering, the kernels and ``ggraph
target`` read it; no other module decides. A feature set or a weight type is one entry here:
the feature rules in ``_many`` / ``_GEMM_TILES`` / ``_FLOAT_TILES``, the weight decoders in
``FORMATS``, the weight types with a rows16 layout in ``ROWS16_TYPES``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels import amx, kquant_blocks, quant_blocks
from ggraph.backends.llvm.kernels.blocks import BlockFormat
from ggraph.backends.llvm.kernels.isa import vector_path
from ggraph.backends.llvm.target import Prefetch, Target

# weight type -> its block decoder (and the activation format it meets, BlockFormat.act)
FORMATS: dict[dtypes.DType, BlockFormat] = {**quant_blocks.FORMATS, **kquant_blocks.FORMATS}
# weight types that can be interleaved 16 rows at a time at load (rows16.py has their decoders)
ROWS16_TYPES = ("q4_k", "q5_k", "q6_k")
ROWS16_TILE = 32           # rows16 matrices are whole tiles of the rows gemm (2 x 16 rows)


class Method(enum.Enum):
    """The arithmetic that computes a shape class."""

    SCALAR = "scalar"              # the generic twin, one weight at a time
    GEMV = "gemv"                  # T == 1: one row at a time, lanes along K
    ROWS16_GEMV = "rows16 gemv"    # T == 1 on rows16 weights: 16 rows as lanes
    GEMV_ROWS = "gemv per token"   # rows_only: gemv's arithmetic for each token at any T
    GEMM = "gemm"                  # T > 1: R rows x G groups of 16 tokens, tokens as lanes
    ROWS_GEMM = "rows gemm"        # T > 1 (rows_only: any T): panels of 32 rows as lanes, 6 tokens a tile


class Layout(str, enum.Enum):
    """Where a weight matrix's bytes lie: as in the file, or interleaved at load."""

    FILE = "file"
    ROWS16 = "rows16"              # 16 rows' blocks side by side (rows16.py)

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


@dataclass(frozen=True)
class Tiles:
    """AMX tiles for T >= min_t: ``group`` tiles of 16 rows take each pair of token tiles in turn."""

    group: int
    min_t: int = amx.MIN_T


@dataclass(frozen=True)
class QmatmulPlan:
    """The quantised matmul kernel for one weight type, N rows, layout and target."""

    fmt: BlockFormat
    rows_only: bool               # one method for every T: a token's result does not depend on T
    layout: Layout
    one: Method                   # T == 1
    many: Method                  # T > 1, below the tiles (rows_only: the same as ``one``)
    tiles: Tiles | None           # AMX tiles, where the target and the type have them
    act_rows: bool                # activations one row per token at T > 1, not groups of 16
    prefetch: Prefetch | None     # how gemv asks for weights ahead of its reads; None: it does not
    chunks_per_step: int          # 32-weight chunks a gemv step dots together
    wide_steps: bool              # ... as the format's ``wide`` pairs (one 64-byte load), not consecutive
    blocks_per_dot: int           # 32-weight blocks a gemv dot takes (2 on 512-bit targets)
    gathers: bool                 # gemv gathers groups of 32-weight blocks by word shuffles (fmt.run)
    gemm_tile: tuple[int, int]    # (rows R, token groups G) of Method.GEMM's register tile
    gemm_from_memory: bool        # GEMM broadcasts weight words from memory (16 vector registers)
    gemm_mmla: bool = False       # GEMM dots 2 rows x 2 tokens x 8 bytes at once (smmla, AArch64 i8mm)

    @property
    def steps(self) -> list[tuple[int, ...]]:
        """The chunks each gemv step dots together."""
        if self.wide_steps:
            return list(self.fmt.wide)
        return consecutive(self.fmt, self.chunks_per_step)


def consecutive(fmt: BlockFormat, P: int) -> list[tuple[int, ...]]:
    """A block's chunks P at a time, in order."""
    return [tuple(range(c, c + P)) for c in range(0, fmt.chunks, P)]


def block_format(dtype) -> BlockFormat:
    """The decoder table entry of a quantised weight type; ValueError names unknown ones."""
    dt = dtypes.from_name(dtype)
    if dt not in FORMATS:
        raise ValueError(f"qmatmul: no kernel for weight type {dt.name}; "
                         f"supported: {', '.join(d.name for d in FORMATS)}")
    return FORMATS[dt]


# -- the rules, one per decision --------------------------------------------------------------
#  target name:  (rows R, token groups G) of the gemm's register tile
_GEMM_TILES = {"avx512": (4, 2), "avx2": (2, 1)}
_DEFAULT_GEMM_TILE = (2, 1)


def _many(target: Target) -> Method:
    """T > 1: the rows gemm with AVX-512 VNNI (its dot broadcasts a 4-byte activation word from
    memory), the gemm on other vector targets, the scalar twin on baseline x86."""
    if not vector_path(target):
        return Method.SCALAR
    if target.arch == "x86_64" and target.has("avx512vnni") and target.vector_bits >= 512:
        return Method.ROWS_GEMM
    return Method.GEMM


def act_rows(target: Target) -> bool:
    """True if act_quant lays out T > 1 activations one row per token on ``target`` (what the rows
    gemm and the tiles read), not in groups of 16 tokens."""
    return _many(target) is Method.ROWS_GEMM


def layouts(dtype, N: int, target: Target) -> tuple[Layout, ...]:
    """The layouts a matmul of N rows of ``dtype`` can read on ``target``, the preferred first: rows16
    where the type has it, the rows gemm takes rows as lanes (as the tiles do) and N is whole 32-row
    tiles; always the file's."""
    dt = dtypes.from_name(dtype)
    if dt.name in ROWS16_TYPES and act_rows(target) and N > 0 and N % ROWS16_TILE == 0:
        return (Layout.ROWS16, Layout.FILE)
    return (Layout.FILE,)


def _tiles(fmt: BlockFormat, N: int, target: Target) -> Tiles | None:
    """AMX tiles for super-block types (integer sub-block scales) where the target has them and N
    fills a tile of rows."""
    if target.has("amx-int8") and amx.on_tiles(fmt.dtype) and N >= amx.TILE:
        return Tiles(amx.tiles_per_group(N, fmt.dtype))
    return None


def _gemv_chunks(fmt: BlockFormat, target: Target) -> int:
    """32-weight chunks per gemv step: two of a block on 512-bit targets (pairing blocks costs more),
    but one for 16-weight sub-blocks with AVX-512 VNNI where the format has no ``wide`` pairs (no lane
    inserts, half as many lanes to scale per step)."""
    if fmt.sub == 16 and fmt.dtype.block_size == 256 and target.has("avx512vnni") and not fmt.wide:
        return 1
    return 2 if target.vector_bits >= 512 and fmt.chunks > 1 else 1


def _prefetch(fmt: BlockFormat, layout: Layout, target: Target) -> Prefetch | None:
    """gemv's weight prefetch: ROWS (Intel) at every row's start (rows16: with every block); SPREAD
    (AMD) with each group of q4_k / q5_k headers or of 32-weight blocks, nothing for other types and
    for rows16, which the hardware prefetcher streams alone."""
    if target.gemv_prefetch is Prefetch.ROWS:
        return Prefetch.ROWS
    spreads = layout is Layout.FILE and (fmt.dtype.block_size == 32 or fmt.headers is not None)
    return Prefetch.SPREAD if spreads else None


def qmatmul_plan(dtype, N: int, target: Target, rows_only: bool = False, layout: Layout | str | None = None
                 ) -> QmatmulPlan:
    """The plan of the quantised matmul of N rows of ``dtype`` weights on ``target`` (``rows_only``:
    one arithmetic for every token at any T; ``layout``: the weights' layout, default the file's)."""
    fmt = block_format(dtype)
    if layout not in (None, *layouts(fmt.dtype, N, target)):
        raise ValueError(f"qmatmul {fmt.dtype.name}: no {str(layout)!r} weight layout for {N} rows on {target.name}")
    layout = Layout(layout or Layout.FILE)
    many = _many(target)
    if rows_only:                    # the rows gemm's arithmetic per token does not depend on T; gemv's either
        one = many = many if many is not Method.GEMM else Method.GEMV_ROWS
    elif layout is Layout.ROWS16:
        one = Method.ROWS16_GEMV
    else:
        one = Method.GEMV if vector_path(target) else Method.SCALAR
    P = _gemv_chunks(fmt, target)
    return QmatmulPlan(
        fmt=fmt, rows_only=rows_only, layout=layout, one=one, many=many,
        tiles=None if rows_only else _tiles(fmt, N, target),
        act_rows=rows_only or act_rows(target),
        prefetch=_prefetch(fmt, layout, target),
        chunks_per_step=P,
        wide_steps=P > 1 and bool(fmt.wide) and target.has("avx512vnni"),
        blocks_per_dot=2 if fmt.dtype.block_size == 32 and target.vector_bits >= 512 else 1,
        gathers=fmt.run is not None and target.vector_bits >= 512 and target.has("avx512vnni"),
        gemm_tile=_GEMM_TILES.get(target.name, _DEFAULT_GEMM_TILE),
        gemm_from_memory=target.arch == "x86_64" and target.vector_bits < 512,
        gemm_mmla=target.has("i8mm"))


# -- float weights -----------------------------------------------------------------------------
#  x86 vector bits: (rows R, tokens C) of fmatmul's gemm tile (32 registers with AVX-512, 16 with AVX2)
_FLOAT_TILES = {512: (4, 4), 256: (2, 4)}
_DEFAULT_FLOAT_TILE = (2, 2)


@dataclass(frozen=True)
class FmatmulPlan:
    """The float-weight matmul on one target: vector lanes along K (or the generic twin's portable
    lanes), its R x C tile, and whether gemv asks for the next rows' weights ahead."""

    vector: bool
    tile: tuple[int, int]
    prefetch: bool


def fmatmul_plan(target: Target) -> FmatmulPlan:
    vector = vector_path(target)
    tile = _FLOAT_TILES.get(target.vector_bits, _DEFAULT_FLOAT_TILE) if target.arch == "x86_64" \
        else _DEFAULT_FLOAT_TILE
    return FmatmulPlan(vector, tile, vector and target.gemv_prefetch is Prefetch.ROWS)


# -- expert-indexed matmul (qmatmul_experts) ----------------------------------------------------
EXPERT_CHUNK_ROWS = 32     # rows of one expert (and one token, or one group of tokens) a thread takes at a time
# (docs/kernels.md, "Expert-indexed matmul"): tokens per expert, on average (T·k / E), from which a step sorts its
# tokens by expert; and an expert's tokens from which they take the gemm together, not the decode dot one by one
EXPERT_GROUP_FROM = 1
_EXPERT_GEMM_FROM = {Method.GEMM: 4, Method.ROWS_GEMM: 4, Method.SCALAR: 1}


@dataclass(frozen=True)
class ExpertsPlan:
    """The expert-indexed matmul for one weight type, N rows per expert and target. ``matmul`` is the qmatmul
    plan of one expert's [N, K] matrix in the file's layout (None for float experts, which take fmatmul's row
    dot). Below ``group_from`` tokens per expert (decode), each (token, expert) runs its ``one`` method (gemv,
    or the scalar twin) on ``chunk_rows`` rows at a time, threads splitting (token, expert, chunk) statically.
    From there (block experts, not rows_only) the step's (token, expert) pairs are sorted by expert and threads
    take (expert, chunk of rows) units in turn: an expert with ``gemm_from`` tokens or more runs them through
    ``grouped`` (the gemm its prefill would run: Method.GEMM, ROWS_GEMM, or the scalar twin) against its
    blocks, read once a step; an expert with fewer, each token through the decode dot."""

    matmul: QmatmulPlan | None
    chunk_rows: int
    grouped: Method | None        # the arithmetic of an expert's tokens in grouped steps; None: never grouped
    group_from: int               # tokens per expert (T·k >= group_from·E) from which a step is grouped
    gemm_from: int                # an expert's tokens from which they take ``grouped`` together


def experts_plan(dtype, N: int, target: Target, rows_only: bool = False) -> ExpertsPlan:
    """``rows_only`` (a batch of requests: each token computed as if alone) keeps the decode arithmetic at
    every T, as rows_only qmatmuls do."""
    dt = dtypes.from_name(dtype)
    if dt in (dtypes.f32, dtypes.f16, dtypes.bf16):
        return ExpertsPlan(None, EXPERT_CHUNK_ROWS, None, EXPERT_GROUP_FROM, 0)
    plan = qmatmul_plan(dt, N, target)
    grouped = None if rows_only else plan.many
    return ExpertsPlan(plan, EXPERT_CHUNK_ROWS, grouped, EXPERT_GROUP_FROM, _EXPERT_GEMM_FROM.get(grouped, 0))
