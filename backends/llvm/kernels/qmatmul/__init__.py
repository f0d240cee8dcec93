"""Quantised matmul y[t, n] = sum_k W[n, k] x[t, k], on the GGUF blocks in place.

    qmatmul_<wtype>_k<K>_n<N>_<target>(w: ptr, xq: ptr, y: ptr f32 [T, N], counter: ptr i32, T, ith, nth)

x arrives quantised by act_quant (the layout is described there). Threads take chunks of
rows (multiples of 16, of 32 for the rows gemm, about 8 per thread) in turn, counting them in
``counter``, which must be zero when the call starts: a thread that gets more of the machine
does more rows; a gemv first gives each thread one long run of rows (GEMV_LEAD of them). Per
sub-block the integer dot is exact; it is then scaled by the weight and activation scales in f32.
The mins of q4_1 and q5_1 meet ggml's q8_1 s (d * sum(q) as fp16), not the exact integer sums.

Which arithmetic runs for each T is the plan's (plan.qmatmul_plan); one module per method:
gemv.py (T == 1, and rows_only's per-token gemv), gemm.py (tokens as lanes), rows_gemm.py (rows
as lanes, AVX-512 VNNI), tiles.py (AMX), scalar.py (the generic twin), over panel.py's layouts.
rows16.py holds the gemv of weights interleaved 16 rows at a time.
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.backends.llvm.kernels import amx, rows16
from ggraph.backends.llvm.kernels.act_quant import GROUP, ActLayout
from ggraph.backends.llvm.kernels.builder import ROW_CHUNK, Kernel
from ggraph.backends.llvm.kernels.isa import Isa
from ggraph.backends.llvm.kernels.plan import (FORMATS, Layout, Method, QmatmulPlan, block_format, layouts,
                                               qmatmul_plan)
from ggraph.backends.llvm.kernels.qmatmul.context import Matmul
from ggraph.backends.llvm.kernels.qmatmul.gemm import gemm
from ggraph.backends.llvm.kernels.qmatmul.gemv import SMALL_GROUP, gemv, gemv_all_rows, steps_order
from ggraph.backends.llvm.kernels.qmatmul.panel import ROWS
from ggraph.backends.llvm.kernels.qmatmul.rows_gemm import TILE_ROWS, TILE_TOKENS, rows_gemm
from ggraph.backends.llvm.kernels.qmatmul.scalar import scalar
from ggraph.backends.llvm.kernels.qmatmul.tiles import tiles
from ggraph.backends.llvm.target import Target

GEMV_CHUNKS = 16     # chunks per thread of a rows16 gemv: the last one a thread takes is what the other waits for
GEMV_LEAD = 0.75     # the share of a gemv's rows that goes first as one contiguous chunk per thread


def act_format(dtype) -> str:
    """The activation format `act_quant` must produce for weights of `dtype`."""
    return block_format(dtype).act


def qmatmul(module: ir.Module, dtype, K: int, N: int, target: Target, rows_only: bool = False,
            layout: Layout | str | None = None) -> str:
    """Emit (once) the quantised matmul for weights (N, K) of `dtype`; returns its name. With
    ``rows_only`` (act_quant's rows_only layout) every token is computed the same way at any T (the
    rows gemm's arithmetic with AVX-512 VNNI, gemv's elsewhere): a token's result does not depend on
    what else is in the step. ``layout``: the weights' layout, if not the file's (Layout.ROWS16)."""
    fmt = block_format(dtype)
    if K % fmt.dtype.block_size:
        raise ValueError(f"qmatmul {fmt.dtype.name}: K={K} is not a multiple of {fmt.dtype.block_size}")
    plan = qmatmul_plan(fmt.dtype, N, target, rows_only, layout)
    suffix = ("_rows" if rows_only else "") + (f"_{plan.layout}" if plan.layout is not Layout.FILE else "")
    name = f"qmatmul_{fmt.dtype.name}_k{K}_n{N}{suffix}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("w", "xq", "y", "counter"))
    m = Matmul(k, Isa(k, target), plan, ActLayout(fmt.act, K), N)
    if plan.rows_only:                                   # one method at every T
        _every_t(m)
        return k.finish()
    with k.b.if_else(k.b.icmp_signed("==", k.arg["T"], k.i64(1))) as (single, many):
        with single:
            _one(m)
        with many:
            _many(m)
    return k.finish()


def _every_t(m: Matmul) -> None:
    """rows_only: the plan's method for every token at any T."""
    k, method = m.k, m.plan.many
    chunks = {"quantum": TILE_ROWS} if method is Method.ROWS_GEMM else {}
    with k.row_chunks(m.N, k.arg["counter"], **chunks) as rows:
        if method is Method.ROWS_GEMM:
            rows_gemm(m, rows)
        elif method is Method.SCALAR:
            scalar(m, rows, 1)
        else:
            with k.b.if_else(k.b.icmp_signed("==", k.arg["T"], k.i64(1))) as (one, more):
                with one:
                    gemv(m, rows)
                with more:
                    gemv_all_rows(m, rows)


def _one(m: Matmul) -> None:
    """T == 1: gemv (a long first chunk per thread), rows16's gemv, or the scalar twin."""
    k, method = m.k, m.plan.one
    if method is Method.ROWS16_GEMV:
        with k.row_chunks(m.N, k.arg["counter"], per_thread=GEMV_CHUNKS, quantum=rows16.ROWS, lead=GEMV_LEAD) as rows:
            rows16.gemv(k, m.isa, m.fmt.dtype, m.lay, rows, m.plan.prefetch)
        return
    xorder = steps_order(m) if method is Method.GEMV else None
    with k.row_chunks(m.N, k.arg["counter"], lead=GEMV_LEAD) as rows:
        if method is Method.GEMV:
            gemv(m, rows, xorder)
        else:
            scalar(m, rows, 1)


def _many(m: Matmul) -> None:
    """T > 1: AMX tiles from their min_t tokens where the plan has them, else (and below) its method."""
    k, t = m.k, m.plan.tiles
    if t is None:
        return _below_tiles(m)
    with k.b.if_else(k.b.icmp_signed(">=", k.arg["T"], k.i64(t.min_t))) as (on_tiles, fewer):
        with on_tiles:
            tiles(m, k.row_chunks(m.N, k.arg["counter"], quantum=t.group * amx.TILE), t.group)
        with fewer:
            _below_tiles(m)


def _below_tiles(m: Matmul) -> None:
    """T > 1 without tiles: the rows gemm, the gemm, or the scalar twin on groups of GROUP tokens."""
    k, method = m.k, m.plan.many
    with k.row_chunks(m.N, k.arg["counter"], quantum=TILE_ROWS if method is Method.ROWS_GEMM else ROW_CHUNK) as rows:
        if method is Method.ROWS_GEMM:
            rows_gemm(m, rows)
        elif method is Method.GEMM:
            gemm(m, rows)
        else:
            scalar(m, rows, GROUP)


def variant(dtype, target: Target) -> str:
    """A one-line description of the kernel `qmatmul` emits for (dtype, target), from its plan (for a
    matrix of whole 32-row tiles, the rows16 layout's and the file's)."""
    plan = qmatmul_plan(dtype, TILE_ROWS, target)
    fmt = plan.fmt
    if plan.one is Method.SCALAR:
        return "scalar (generic twin)" + ("; sub-blocks times integer scales, one FMA per block"
                                          if fmt.int_scale is not None else "; FMA per block")
    R, G = plan.gemm_tile
    dot = {True: "vpdpbusd", False: "pmaddubsw"}[target.has("avx512vnni")] if target.arch == "x86_64" \
        else ("sdot" if target.has("dotprod") else "smull")
    gemm_ = (f"gemm {TILE_ROWS} rows (rows as lanes) x {TILE_TOKENS} tokens"
             if plan.many is Method.ROWS_GEMM else f"gemm {R} rows x {G * GROUP} tokens")
    if plan.gemm_mmla and plan.many is Method.GEMM:
        gemm_ += " by smmla (2x8 by 8x2 int8 tiles; row tails by sdot)"
    if plan.tiles is not None:
        planes = ("as one s8 plane, 2 tiles of rows a unit" if fmt.dtype in amx.ONE_PLANE
                  else f"as lo/hi s8 planes, {amx.TILE} rows a unit")
        gemm_ = (f"AMX tiles for T >= {plan.tiles.min_t} (tdpbssd x {amx.MIN_T} tokens, groups of {amx.GROUP_TILES} "
                 f"tiles of rows, weights times their sub-block scales {planes}), {gemm_} below")
    if plan.blocks_per_dot == 2:
        gathered = ", gathered by word shuffles" if plan.gathers else ""
        gemv_ = f"gemv 64 weights/step ({SMALL_GROUP} blocks a group{gathered})"
    else:
        gemv_ = f"gemv {32 * plan.chunks_per_step} weights/step"
    if Layout.ROWS16 in layouts(fmt.dtype, TILE_ROWS, target):
        gemv_ = (f"weights interleaved {rows16.ROWS} rows at a time at load (rows16, for matrices of whole "
                 f"{TILE_ROWS}-row tiles that only matmuls read): gemv {rows16.ROWS} rows as lanes; else {gemv_}")
    return f"{dot}-{target.vector_bits}: {gemm_}, {gemv_}; {fmt.act} activations"


__all__ = ["FORMATS", "GEMV_CHUNKS", "GEMV_LEAD", "Layout", "Method", "QmatmulPlan", "ROWS", "act_format",
           "block_format", "qmatmul", "qmatmul_plan", "variant"]
