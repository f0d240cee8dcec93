"""Quantised matmul y[t, n] = sum_k W[n, k] x[t, k], on the GGUF blocks in place.

    qmatmul_<wtype>_k<K>_n<N>_<target>(w: ptr, xq: ptr, y: ptr f32 [T, N], counter: ptr i32, T, ith, nth)

x arrives quantised by act_quant (the layout is described there). Threads take chunks of
rows (multiples of 16, of 32 for the rows gemm, about 8 per thread) in turn, counting them in
``counter``, which must be zero when the call starts: a thread that gets more of the machine
does more rows; a gemv first gives each thread one long run of rows (GEMV_LEAD of them). Per
sub-block the integer dot is exact; it is then scaled by the weight and activation scales in f32.
The mins of q4_1 and q5_1 meet ggml's q8_1 s (d * sum(q) as fp16), not the exact integer sums.
Four drivers share the block decoders:

- gemv (T == 1): one row at a time, 32 weights per step (64 for 256-weight blocks on
  512-bit targets: with VNNI the two chunks one 64-byte load holds, against a copy of the
  activations in that order), f32 lanes along K, weights prefetched (the next rows; on AMD, with
  each group of blocks of q4_k, q5_k and the 32-weight types, further ahead), rows of up to GEMV_INLINE_BLOCKS blocks
  without a block loop. The super-block types sum a block's dots times their integer scales
  in i32 lanes (two steps' dots packed to i16 words per vpdpwssd) and their mins in integers;
  q4_k and q5_k unpack the headers of HEADER_BLOCKS blocks at once. 32-weight blocks go
  SMALL_GROUP at a time (scales, offset terms and mins as vectors, the offsets and mins taken out
  in floats), two to a 512-bit dot, gathered with AVX-512 VNNI by word shuffles of 64-byte loads
  (`quant_blocks.gathered_run`). The
  rows_only kernels (a batch of sequences) run the gemv arithmetic for every token at any T,
  SMALL_T tokens at a time, each block decoded once for all of them: a token's result is the
  same bits whatever shares the step, and the weights are read once per step.
- rows gemm (T > 1 with AVX-512 VNNI): lanes are rows. A panel of 16-row vectors is decoded
  and transposed once into a private buffer, then each token's 4-byte activation words are
  broadcast (from memory, into the dot) against it, for 32 rows x 6 tokens at a time; super-block
  types sum their sub-blocks' dots times their scales (exact small integers in f32 lanes), and
  their mins with vpdpwssd; results stay in a private stripe of tokens until the last K panel.
- gemm (T > 1 elsewhere): a tile of R rows x G groups of 16 tokens. Lanes are tokens: each
  4-byte word of a decoded weight chunk is broadcast and dotted with the same word of 16
  tokens (one 64-byte load of the interleaved activations), so no horizontal sums. Its arithmetic
  is the rows gemm's (super-blocks summed times their integer scales, one float step per block),
  so every x86 vector feature set gives a prefill the same bits.
- scalar: the generic target's readable twin, one weight at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels import kquant_blocks, quant_blocks, rows16
from ggraph.backends.llvm.kernels.act_quant import GROUP, ActLayout, rows_gemm
from ggraph.backends.llvm.kernels.blocks import BlockFormat, Decoded, Run, pack
from ggraph.backends.llvm.kernels.builder import ROW_CHUNK, Kernel, f32, i8, i16, i32, i64, vec
from ggraph.backends.llvm.kernels.isa import Isa, vector_path
from ggraph.backends.llvm.target import Target

FORMATS: dict[dtypes.DType, BlockFormat] = {**quant_blocks.FORMATS, **kquant_blocks.FORMATS}

#  target name:  (rows R, token groups G) of the 4-rows gemm's register tile
_TILES = {"avx512": (4, 2), "avx2": (2, 1)}
_DEFAULT_TILE = (2, 1)


def block_format(dtype) -> BlockFormat:
    """The decoder table entry of a quantised weight type; ValueError names unknown ones."""
    dt = dtypes.from_name(dtype)
    if dt not in FORMATS:
        raise ValueError(f"qmatmul: no kernel for weight type {dt.name}; "
                         f"supported: {', '.join(d.name for d in FORMATS)}")
    return FORMATS[dt]


def act_format(dtype) -> str:
    """The activation format `act_quant` must produce for weights of `dtype`."""
    return block_format(dtype).act


def tile(target: Target) -> tuple[int, int]:
    return _TILES.get(target.name, _DEFAULT_TILE)


def gemv_chunks(fmt: BlockFormat, target: Target) -> int:
    """32-weight chunks per gemv step: two of a block on 512-bit targets (pairing blocks costs more),
    but one for 16-weight sub-blocks with AVX-512 VNNI where the format has no ``wide`` pairs (no lane
    inserts, half as many lanes to scale per step)."""
    if fmt.sub == 16 and fmt.dtype.block_size == 256 and target.has("avx512vnni") and not fmt.wide:
        return 1
    return 2 if target.vector_bits >= 512 and fmt.chunks > 1 else 1


def _consecutive(fmt: BlockFormat, P: int) -> list[tuple[int, ...]]:
    return [tuple(range(c, c + P)) for c in range(0, fmt.chunks, P)]


def gemv_steps(fmt: BlockFormat, target: Target) -> list[tuple[int, ...]]:
    """The chunks each gemv step dots together: consecutive ones, or with AVX-512 VNNI the format's
    ``wide`` pairs (chunks whose bytes one 64-byte load holds, such as q4_k's low nibbles of 64 bytes:
    q4_k 1.3x, q6_k 1.15x, q2_k 1.35x faster in L2 on a Zen 4), when it has them; gemv then reads a
    copy of the token's activations laid out in step order (`_steps_order`)."""
    P = gemv_chunks(fmt, target)
    if P > 1 and fmt.wide and target.has("avx512vnni"):
        return list(fmt.wide)
    return _consecutive(fmt, P)


def variant(dtype, target: Target) -> str:
    """A one-line description of the kernel `qmatmul` emits for (dtype, target)."""
    fmt = block_format(dtype)
    if not vector_path(target):
        return "scalar (generic twin)" + ("; sub-blocks times integer scales, one FMA per block"
                                          if fmt.int_scale is not None else "; FMA per block")
    R, G = tile(target)
    dot = {True: "vpdpbusd", False: "pmaddubsw"}[target.has("avx512vnni")] if target.arch == "x86_64" \
        else ("sdot" if target.has("dotprod") else "smull")
    gemm = (f"gemm {2 * ROWS} rows (rows as lanes) x {TILE_TOKENS} tokens"
            if rows_gemm(target) else f"gemm {R} rows x {G * GROUP} tokens")
    from ggraph.backends.llvm.kernels import amx           # the tiled driver builds on this module's pieces
    if amx.takes(fmt, target):
        planes = ("as one s8 plane, 2 tiles of rows a unit" if fmt.dtype in amx.ONE_PLANE
                  else f"as lo/hi s8 planes, {amx.TILE} rows a unit")
        gemm = (f"AMX tiles for T >= {amx.MIN_T} (tdpbssd x {amx.MIN_T} tokens, groups of {amx.GROUP_TILES} tiles of "
                f"rows, weights times their sub-block scales {planes}), {gemm} below")
    if fmt.dtype.block_size == 32 and target.vector_bits >= 512:
        gathered = ", gathered by word shuffles" if _gathers(fmt, target) else ""
        gemv = f"gemv 64 weights/step ({SMALL_GROUP} blocks a group{gathered})"
    else:
        gemv = f"gemv {32 * gemv_chunks(fmt, target)} weights/step"
    if rows16.takes(fmt.dtype, 2 * ROWS, target):
        gemv = (f"weights interleaved {rows16.ROWS} rows at a time at load (rows16, for matrices of whole "
                f"{2 * ROWS}-row tiles that only matmuls read): gemv {rows16.ROWS} rows as lanes; else {gemv}")
    return f"{dot}-{target.vector_bits}: {gemm}, {gemv}; {fmt.act} activations"


# Chunks per thread of a rows16 gemv (decode): the last chunk a thread takes is what the other waits
# for at the barrier. 1B-shaped file, 2 threads, `ggraph bench --profile`, 4-6 alternating rounds:
# barrier/idle 1.4-2.4% of the step with 16 (mean 1.8%), 1.6-5.5% with 8 (mean 3.8%), 2.1-2.4% with 32;
# end to end (decode at 2 threads against stream_bandwidth, 4 alternating rounds) no change above the noise.
GEMV_CHUNKS = 16

# The share of a gemv's rows (decode) that goes first as one contiguous chunk per thread, before the
# small chunks taken in turn. Each chunk a thread starts is a stream its prefetches must get going
# again (cycle stamps per chunk, 1B-shaped file, 2 threads: a 16-row, 18 KB chunk of attn_k moved
# 27% fewer bytes a cycle than a 64-row chunk of attn_q), and with small chunks only the two threads
# leapfrog through every matrix. Decode at 2 threads, separate processes alternating, 4 rounds each,
# against stream_bandwidth read in the same process: 1B-shaped q4_k_m 38.6 -> 40.0 tok/s (84.0% ->
# 87.1% of the stream), Qwen2.5-0.5B-shaped 51.9 -> 55.4, SmolLM2-shaped q4_1 272 -> 281; one thread
# the same. The last quarter, still taken in turn, keeps a thread that loses its core from holding
# up the barrier (all of it static ran as fast here: 87.0%).
GEMV_LEAD = 0.75


def qmatmul(module: ir.Module, dtype, K: int, N: int, target: Target, rows_only: bool = False,
            layout: str | None = None) -> str:
    """Emit (once) the quantised matmul for weights (N, K) of `dtype`; returns its name. With
    ``rows_only`` (act_quant's rows_only layout) every token is computed the same way at any T (the
    rows gemm's arithmetic with AVX-512 VNNI, gemv's elsewhere): a token's result does not depend on
    what else is in the step. ``layout``: the weights' layout, if not the file's (rows16.LAYOUT)."""
    fmt = block_format(dtype)
    if K % fmt.dtype.block_size:
        raise ValueError(f"qmatmul {fmt.dtype.name}: K={K} is not a multiple of {fmt.dtype.block_size}")
    if layout not in (None, rows16.LAYOUT) or (layout and not rows16.takes(fmt.dtype, N, target)):
        raise ValueError(f"qmatmul {fmt.dtype.name}: no {layout!r} weight layout for {N} rows on {target.name}")
    suffix = ("_rows" if rows_only else "") + (f"_{layout}" if layout else "")
    name = f"qmatmul_{fmt.dtype.name}_k{K}_n{N}{suffix}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("w", "xq", "y", "counter"))
    isa = Isa(k, target)
    lay = ActLayout(fmt.act, K)
    T = k.arg["T"]
    if layout and not rows_only:      # rows16: gemv 16 rows at a time, the gemms' panels from groups
        with k.b.if_else(k.b.icmp_signed("==", T, k.i64(1))) as (single, many):
            with single:
                with k.row_chunks(N, k.arg["counter"], per_thread=GEMV_CHUNKS, quantum=rows16.ROWS, lead=GEMV_LEAD) as rows:
                    rows16.gemv(k, isa, fmt.dtype, lay, rows)
            with many:
                _many(k, isa, fmt, lay, N, target, layout)
        return k.finish()
    if rows_only and rows_gemm(target):                  # its arithmetic per token does not depend on T
        with k.row_chunks(N, k.arg["counter"], quantum=2 * ROWS) as rows:
            _rows_gemm(k, isa, fmt, lay, N, rows, layout)
        return k.finish()
    if rows_only:
        with k.row_chunks(N, k.arg["counter"]) as rows:
            if not vector_path(target):
                _scalar(k, isa, fmt, lay, N, rows, 1)
            else:
                with k.b.if_else(k.b.icmp_signed("==", T, k.i64(1))) as (one, more):
                    with one:
                        _gemv(k, isa, fmt, lay, N, rows)
                    with more:
                        _gemv_all_rows(k, isa, fmt, lay, N, rows)
        return k.finish()
    with k.b.if_else(k.b.icmp_signed("==", T, k.i64(1))) as (single, many):
        with single:
            xorder = _steps_order(k, fmt, lay, gemv_steps(fmt, target)) if vector_path(target) else None
            with k.row_chunks(N, k.arg["counter"], lead=GEMV_LEAD) as rows:
                if vector_path(target):
                    _gemv(k, isa, fmt, lay, N, rows, xorder)
                else:
                    _scalar(k, isa, fmt, lay, N, rows, 1)
        with many:
            _many(k, isa, fmt, lay, N, target)
    return k.finish()


def _many(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, target: Target,
          layout: str | None = None) -> None:
    """T > 1: AMX tiles from MIN_T tokens where the target has them, else (and below) the rows gemm
    with AVX-512 VNNI, the 4-rows gemm on other vector targets; weights in the file's layout or in
    ``layout`` (which the tiles and the rows gemm read)."""
    from ggraph.backends.llvm.kernels import amx           # the tiled driver builds on this module's pieces
    if amx.takes(fmt, target) and N >= amx.TILE:
        R = amx.tiles_per_group(N, fmt.dtype)
        with k.b.if_else(k.b.icmp_signed(">=", k.arg["T"], k.i64(amx.MIN_T))) as (tiles, fewer):
            with tiles:
                amx.amx_gemm(k, isa, fmt, lay, N, k.row_chunks(N, k.arg["counter"], quantum=R * amx.TILE), R,
                             layout)
            with fewer:
                _below_tiles(k, isa, fmt, lay, N, target, layout)
    else:
        _below_tiles(k, isa, fmt, lay, N, target, layout)


def _below_tiles(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, target: Target,
                 layout: str | None = None) -> None:
    """T > 1 without tiles: the rows gemm with AVX-512 VNNI, the 4-rows gemm on other vector targets."""
    with k.row_chunks(N, k.arg["counter"], quantum=2 * ROWS if rows_gemm(target) else ROW_CHUNK) as rows:
        if rows_gemm(target):
            _rows_gemm(k, isa, fmt, lay, N, rows, layout)
        elif vector_path(target):
            _gemm(k, isa, fmt, lay, N, rows, *tile(target))
        else:
            _scalar(k, isa, fmt, lay, N, rows, GROUP)


# -- shared pieces ------------------------------------------------------------------------
def _row(k: Kernel, fmt: BlockFormat, lay: ActLayout, n, blk):
    """Address of block `blk` of weight row n."""
    row_bytes = fmt.dtype.row_bytes(lay.K)
    return k.addr(k.arg["w"], k.add(k.mul(n, row_bytes), k.mul(blk, fmt.dtype.type_size)))


def _subs(k: Kernel, fmt: BlockFormat, c) -> list:
    """Sub-blocks (scale indices) inside 32-weight chunk c (an int or i64 value)."""
    return [c] if fmt.sub == 32 else [k.mul(c, 2), k.add(k.mul(c, 2), 1)]


def _xsum(k: Kernel, fmt: BlockFormat, lay: ActLayout, L: int, base, blk, s: int):
    """Sum of the quantised activations of sub-block s of block blk: <L x i32>, one lane per token."""
    per = fmt.sub // lay.sum_block                   # activation sum blocks per sub-block
    first = k.add(k.mul(blk, fmt.dtype.block_size // lay.sum_block), k.mul(s, per))
    return _sum_of(k, [lay.load_sums(k, base, L, k.add(first, p), L) for p in range(per)])


# -- gemv: T == 1 ---------------------------------------------------------------------------
# How gemv asks for weight lines ahead of its reads (Target.gemv_prefetch), always into L2, not L1:
# - "rows" (Intel): at a row's start, the lines PREFETCH_AHEAD bytes on. On a 1B-shaped Q4_K_M file
#   larger than L3 (Xeon with AMX, 2 cores), decode 1.07-1.12x at one thread and 1.11-1.13x at two
#   over one distance of 2048 into L1 (/tmp A/B, alternating processes); 4096 alone was 0.8x.
# - "spread" (AMD): q4_k and q5_k rows ask, with each header group, for the group's lines
#   SPREAD_AHEAD bytes on, as do the 32-weight types with each group; nothing else. On a Zen 4, one
#   thread, q4_k from memory: 2048-wide rows 1.13-1.16x, 8192-wide 1.06-1.08x, 4096 bytes ahead 0.8x
#   (A/B in one process); 1B-shaped decode at two threads 1.1-1.3x (alternating processes); the
#   32-weight types' 2048x4096 matrices 1.12-1.38x (q4_0 1.38x, q4_1 1.27x, q5_0 1.16x, iq4_nl 1.16x,
#   q5_1 1.14x, q8_0 1.12x; 16 KB ahead about the same), SmolLM2's 576-wide ones 1.0-1.05x. The "rows"
#   prefetches cost a Zen 4 q6_k 1.4-1.9x, and a whole row asked for 8 KB ahead at its start 0.5-0.65x
#   on 8192-wide rows.
PREFETCH_AHEAD = (2048, 4096)
SPREAD_AHEAD = 8192


def _gemv(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, rows, xorder=None) -> None:
    """One output row at a time, for the one token there is (its quants in step order at ``xorder``,
    if given)."""
    with k.loop(*rows, name="n") as row:
        _gemv_n_row(k, isa, fmt, lay, N, row, 1, 0, xorder)


def _steps_order(k: Kernel, fmt: BlockFormat, lay: ActLayout, steps: list) -> ir.Value | None:
    """A private copy of the token's quants with each block's chunks in the order of ``steps``, so
    that a step's activations are one load; None where the steps take the chunks in order."""
    order = [c for step in steps for c in step]
    if order == sorted(order):
        return None
    xs = k.scratch(i8, lay.K)
    bs = fmt.dtype.block_size
    with k.loop(0, lay.K // bs, name="xblk") as blk:
        for at, c in enumerate(order):
            k.store(k.load(vec(i8, 32), k.arg["xq"], k.add(k.mul(blk, bs), 32 * c)), xs, k.add(k.mul(blk, bs), 32 * at))
    return xs


def _gemv_step(k: Kernel, isa: Isa, fmt: BlockFormat, dec, w, blk, step: int, chunks: tuple, init, scales, acc,
               xbase) -> None:
    """Gemv step ``step`` (``chunks`` of block ``dec``, decoded in ``w``): acc += float(dot(w, x) -
    offset*sum(x)) * scale*dx, per lane, x the token's quants in step order at ``xbase``."""
    dot, lane_sub = _gemv_dot(k, isa, fmt, dec, w, blk, step, chunks, init, xbase)
    acc.set(isa.fma(k.b.sitofp(dot, vec(f32, 8 * len(chunks))), k.shuffle(scales, lane_sub), acc.get()))


def _gemv_dot(k: Kernel, isa: Isa, fmt: BlockFormat, dec, w, blk, step: int, chunks: tuple, init, xbase):
    """(dot(w, x) - offset*sum(x) per i32 lane, each lane's sub-block) for gemv step ``step``, which
    takes ``chunks``; x is in step order at ``xbase``."""
    P = len(chunks)
    lanes = 8 * P
    lane_sub = [(32 * chunks[j // 8] + 4 * (j % 8)) // fmt.sub for j in range(lanes)]   # each i32 lane's sub-block
    if init is None:
        start = ir.Constant(vec(i32, lanes), [0] * lanes)
    else:                                                   # -offset*sum(x) in each sub-block's first lane
        subs = init.type.count
        first = [s if j == 0 or s != lane_sub[j - 1] else subs for j, s in enumerate(lane_sub)]
        start = k.shuffle(init, first, ir.Constant(vec(i32, subs), [0] * subs))
    xv = k.load(vec(i8, 4 * lanes), xbase, k.add(k.mul(blk, fmt.dtype.block_size), 32 * P * step))
    return isa.dot(start, w, xv, dec.signed, dec.qmax), lane_sub                # (lanes,) i32


SMALL_T = 8                        # tokens whose accumulators a rows_only step keeps in registers at once


def _gemv_all_rows(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, rows) -> None:
    """Any T with one activation row per token (``rows_only``): per output row, the tokens in
    groups of SMALL_T and then the rest, each token computed as gemv computes one token alone,
    whatever else shares the step; the row's weights stay in cache across its groups."""
    b = k.b
    T = k.arg["T"]
    groups = b.sdiv(T, k.i64(SMALL_T))
    with k.loop(*rows, name="n") as row:
        with k.loop(0, groups, name="tg") as g:
            _gemv_n_row(k, isa, fmt, lay, N, row, SMALL_T, k.mul(g, SMALL_T))
        rest = b.sub(T, k.mul(groups, SMALL_T))
        _by_count(k, rest, range(1, SMALL_T), lambda n: _gemv_n_row(k, isa, fmt, lay, N, row, n, b.sub(T, k.i64(n))))


def _by_count(k: Kernel, count, counts, body) -> None:
    """``body(n)`` for the n in ``counts`` that ``count`` (an i64) equals; nothing for other values."""
    b = k.b
    blocks = {n: k.fn.append_basic_block(f"count{n}") for n in counts}
    done = k.fn.append_basic_block("count.done")
    switch = b.switch(count, done)
    for n, block in blocks.items():
        switch.add_case(k.i64(n), block)
        b.position_at_end(block)
        body(n)
        b.branch(done)
    b.position_at_end(done)


def _gemv_n_row(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, row, n: int, t0, xorder=None) -> None:
    """Output row ``row`` for exactly n tokens from token t0 (rows of xq ``group_bytes(1)`` apart):
    integer dots per step of P chunks, scaled into f32 lanes (super-block types first sum their
    sub-blocks in i32 lanes times their integer scales, as llama.cpp does, and take one f32 step per
    block: shorter dependency chains, 1.04-1.22x), the K-quant mins in a separate accumulator, the
    same arithmetic for each token whatever n is. Formats with ``headers`` (q4_k, q5_k) unpack the
    scales, mins and d of HEADER_BLOCKS blocks at a time and sum their mins in one step; 32-weight
    blocks go SMALL_GROUP at a time, S to a dot. ``xorder``:
    the one token's quants in the order of `gemv_steps` (n == 1), where that is not the natural order."""
    b = k.b
    P = gemv_chunks(fmt, isa.t)
    subs = fmt.dtype.block_size // fmt.sub
    small = fmt.dtype.block_size == 32                  # 32-weight blocks: SMALL_GROUP at a time
    S = 2 if small and isa.t.vector_bits >= 512 else 1  # ... and S of them per dot
    lanes = 8 * (S if small else P)
    mlanes = subs // 2 * (HEADER_BLOCKS if fmt.headers else 1) if fmt.int_mins else (SMALL_GROUP if small else subs)
    first = k.addr(k.arg["xq"], k.mul(t0, lay.group_bytes(1)))
    xts = [k.addr(first, t * lay.group_bytes(1)) for t in range(n)]
    _prefetch_row(k, isa, fmt, lay, row)
    r = _GemvRow(k, isa, fmt, lay, row, gemv_steps(fmt, isa.t) if xorder is not None else _consecutive(fmt, P), xts,
                 [xorder] if xorder is not None else xts,
                 [k.var(vec(f32, lanes), ir.Constant(vec(f32, lanes), [0.0] * lanes)) for _ in range(n)],
                 [k.var(vec(f32, mlanes), ir.Constant(vec(f32, mlanes), [0.0] * mlanes)) for _ in range(n)],
                 lanes, mlanes, S)
    nblocks = lay.K // fmt.dtype.block_size
    if small:
        _in_groups(k, nblocks, SMALL_GROUP, SMALL_GROUP, lambda blk0, G: _gemv_small_group(r, blk0, G))
    elif fmt.headers is not None:
        if not (fmt.int_mins and fmt.sub == 32 and lay.has_sums32):
            raise ValueError(f"qmatmul {fmt.dtype.name}: header groups take 32-weight sub-blocks with integer "
                             f"mins and q8_k's sums of 32, which this format lacks")
        _in_groups(k, nblocks, HEADER_BLOCKS, GEMV_INLINE_BLOCKS, lambda blk0, G: _gemv_header_group(r, blk0, G))
    else:
        _in_groups(k, nblocks, 1, GEMV_INLINE_BLOCKS, lambda blk, _: _gemv_block(r, blk))
    for t, (acc, macc) in enumerate(zip(r.accs, r.maccs)):
        at = k.mul(k.add(k.mul(k.add(t0, t), N), row), 4)
        k.store(b.fsub(isa.hsum(acc.get()), isa.hsum(macc.get())), k.arg["y"], at)


@dataclass
class _GemvRow:
    """What the block drivers of one gemv row share."""

    k: Kernel
    isa: Isa
    fmt: BlockFormat
    lay: ActLayout
    row: ir.Value
    steps: list                # the chunks each step dots together
    xts: list                  # each token's activation row
    quants: list               # where each token's step activations are (its row, or the xorder copy)
    accs: list                 # each token's accumulator (``lanes`` f32)
    maccs: list                # ... of its mins and offset terms (``mlanes`` f32), subtracted at the end
    lanes: int
    mlanes: int
    S: int                     # 32-weight blocks per dot

    @property
    def subs(self) -> int:
        return self.fmt.dtype.block_size // self.fmt.sub

    def block(self, blk) -> ir.Value:
        """Address of block ``blk`` of the row."""
        return _row(self.k, self.fmt, self.lay, self.row, blk)


def _gemv_block(r: _GemvRow, blk) -> None:
    """One block of the row, for each token."""
    k, isa, fmt, lay, b, subs = r.k, r.isa, r.fmt, r.lay, r.k.b, r.subs
    dec = fmt.decode(k, isa, r.block(blk))
    terms = []                         # each token's dx, offset init, f32 scales and activation sums
    for xt, macc in zip(r.xts, r.maccs):
        dx = k.load(f32, xt, lay.d(k, 1, blk))
        xs = _xsums_row(k, fmt, lay, blk, xt)                                 # (subs,) i32
        if fmt.int_mins:                               # sum_s min_s x xsum_s in integers, one float step
            m = _word_pairs(k, isa, dec.ints.mins, xs)
            macc.set(isa.fma(b.sitofp(m, vec(f32, subs // 2)), k.splat(b.fmul(dec.ints.dmin, dx), subs // 2), macc.get()))
        elif dec.mins is not None:
            macc.set(isa.fma(b.fmul(dec.mins, k.splat(dx, subs)), b.sitofp(xs, vec(f32, subs)), macc.get()))
        init = b.mul(xs, ir.Constant(vec(i32, subs), [-dec.offset] * subs)) if dec.offset else None
        terms.append((dx, init, None if dec.ints is not None else b.fmul(dec.scales, k.splat(dx, subs)), xs))
    if dec.ints is not None:
        dds = [k.splat(b.fmul(dec.ints.d, dx), r.lanes) for dx, _, _, _ in terms]
        _int_block(k, isa, fmt, dec, blk, r.steps, r.quants, [t[1] for t in terms], dec.ints.scales,
                   [t[3] for t in terms], dds, r.accs)
    else:
        for step, chunks in enumerate(r.steps):         # each chunk decoded once, for every token
            w = k.concat(*[dec.chunk(c) for c in chunks])
            for xq, acc, (_, init, scales, _) in zip(r.quants, r.accs, terms):
                _gemv_step(k, isa, fmt, dec, w, blk, step, chunks, init, scales, acc, xq)


def _gemv_header_group(r: _GemvRow, blk0, G: int) -> None:
    """Blocks blk0 .. blk0+G-1 of the row, their headers unpacked together; the mins of all G in one step."""
    k, isa, fmt, lay, b, subs = r.k, r.isa, r.fmt, r.lay, r.k.b, r.subs
    hd = fmt.headers(k, isa, [r.block(k.add(blk0, g)) for g in range(G)])
    _spread_prefetch(k, isa, fmt, r.block(blk0), G)
    ddx = []
    for xt, macc in zip(r.xts, r.maccs):
        dx = k.load(vec(f32, G), xt, lay.d(k, 1, blk0))
        xs = k.load(vec(i16, subs * G), xt, lay.sums32(k, 1, k.mul(blk0, subs)))
        m = isa.dot_pairs(ir.Constant(vec(i32, subs // 2 * G), [0] * (subs // 2 * G)), hd.mins, xs)
        dmx = k.shuffle(b.fmul(hd.dmin, dx), [g for g in range(G) for _ in range(subs // 2)])
        term = b.fmul(b.sitofp(m, vec(f32, subs // 2 * G)), dmx)
        macc.set(b.fadd(macc.get(), _widen_lanes(k, term, r.mlanes)))    # a row's last blocks: upper lanes 0
        ddx.append(b.fmul(hd.d, dx))
    for g in range(G):
        blk = k.add(blk0, g)
        scales = b.zext(k.shuffle(hd.scales, range(subs * g, subs * (g + 1))), vec(i32, subs))
        _int_block(k, isa, fmt, fmt.decode(k, isa, r.block(blk)), blk, r.steps, r.quants, [None] * len(r.xts),
                   scales, [None] * len(r.xts), [k.shuffle(dd, [g] * r.lanes) for dd in ddx], r.accs)


def _gemv_small_group(r: _GemvRow, blk0, G: int) -> None:
    """G consecutive 32-weight blocks of the row: their scales, activation scales and sums, offset
    terms and mins as G-lane vectors, the dots S blocks at a time (lanes 8j.. are block j's)."""
    k, isa, fmt, lay, b, S, lanes = r.k, r.isa, r.fmt, r.lay, r.k.b, r.S, r.lanes
    _spread_prefetch(k, isa, fmt, r.block(blk0), G)
    if G == SMALL_GROUP and _gathers(fmt, isa.t):
        run = fmt.run(k, isa, r.block(blk0), G)                         # gathered from 64-byte loads
    else:
        run = Run.of_blocks(k, [fmt.decode(k, isa, r.block(k.add(blk0, g))) for g in range(G)])
    for xt, acc, macc in zip(r.xts, r.accs, r.maccs):
        dx = k.load(vec(f32, G), xt, lay.d(k, 1, blk0))
        ddx = b.fmul(run.d, dx)
        if lay.keeps_s:                                # q8_1: min x s, ggml's fp16 s = dx xsum (subtracted)
            factor, xs = run.mins, lay.load_s(k, isa, xt, 1, blk0, G)
        else:
            xs = b.sitofp(lay.load_sums(k, xt, 1, blk0, G), vec(f32, G))          # (G,) activation sums
            # what the dots leave out, one lane a block: offset x d dx xsum, and min x dx xsum (subtracted)
            off = b.fmul(ddx, ir.Constant(vec(f32, G), [float(run.offset)] * G)) if run.offset else None
            own = b.fmul(run.mins, dx) if run.mins is not None else None
            factor = own if off is None else off if own is None else b.fadd(off, own)
        if factor is not None:
            macc.set(isa.fma(factor, xs, macc.get()) if r.mlanes == G else
                     b.fadd(macc.get(), _widen_lanes(k, b.fmul(factor, xs), r.mlanes)))
        sd = k.concat(ddx, ir.Constant(vec(f32, G), [0.0] * G))                   # lanes G..: 0
        total = None                                   # the group's sum, then one add to the row's
        for s0 in range(0, G, S):
            m = min(S, G - s0)
            w = run.weights(s0, m)
            xv = k.load(vec(i8, 32 * m), xt, k.mul(k.add(blk0, s0), 32))
            if m < S:                                  # a row's odd last block: zero lanes after it
                w, xv = (k.concat(v, ir.Constant(v.type, [0] * v.type.count)) for v in (w, xv))
            which = [s0 + j // 8 if j // 8 < m else G for j in range(lanes)]       # each lane's block
            dot = b.sitofp(isa.dot(ir.Constant(vec(i32, lanes), [0] * lanes), w, xv, run.signed, run.qmax),
                           vec(f32, lanes))
            scale = k.shuffle(sd, which)
            total = b.fmul(dot, scale) if total is None else isa.fma(dot, scale, total)
        acc.set(b.fadd(acc.get(), total))


# 32-weight blocks a gemv row takes together: their scales, activation scales and sums, offset terms
# and mins in G-lane vectors (one float step for all of them), their dots two blocks to a 512-bit
# vector, summed per group and added to the row's accumulator once. On a Zen 4, one thread, from
# memory: the groups over block by block, q8_0 1.31-1.37x, q4_1 1.13-1.23x, q4_0 1.09-1.15x, q5_0
# 1.01-1.05x; with AVX-512 VNNI the quants and scales then gathered by word shuffles (whole groups;
# GFNI splitting the nibbles), q4_1 1.40x, q4_0 1.30x, q5_0 1.28x, iq4_nl 1.26x, q5_1 1.23x, q8_0
# 1.00x (benchmarks/kernels.py, 2048x8192, old and new tree alternating, 4 rounds each, medians).
SMALL_GROUP = 8


def _gathers(fmt: BlockFormat, target: Target) -> bool:
    """True if gemv gathers whole groups of ``fmt``'s blocks by word shuffles (BlockFormat.run): 512-bit
    dots of two blocks, whose unsigned levels VNNI takes whole."""
    return fmt.run is not None and target.vector_bits >= 512 and target.has("avx512vnni")


def _spread_prefetch(k: Kernel, isa: Isa, fmt: BlockFormat, at: ir.Value, G: int) -> None:
    """With "spread" prefetching (AMD), ask for the lines of the G blocks at ``at`` SPREAD_AHEAD bytes on."""
    if isa.t.gemv_prefetch == "spread":
        for line in range(0, G * fmt.dtype.type_size, 64):
            k.prefetch(k.addr(at, SPREAD_AHEAD + line), level=2)


def _widen_lanes(k: Kernel, v: ir.Value, n: int) -> ir.Value:
    """v with zero lanes after its own, to n lanes."""
    have = v.type.count
    return v if have == n else k.shuffle(v, [min(j, have) for j in range(n)], ir.Constant(v.type, [0] * have))


# Super-blocks whose headers (scales, mins, d, dmin) a gemv row unpacks together, for formats with
# BlockFormat.headers (q4_k, q5_k): four blocks' scales take one set of shifts and masks, their mins
# one multiply-add and one float step. On a Zen 4, one thread, q4_k rows of 2048 and 8192: 1.06-1.19x
# from L3, 1.03-1.07x from memory (old and new kernels in one process, 15 alternating rounds)
HEADER_BLOCKS = 4


def _int_block(k: Kernel, isa: Isa, fmt: BlockFormat, dec, blk, steps, quants, inits, scales, xss, dds, accs) -> None:
    """A super-block of each token (sub-blocks summed in i32 lanes times their integer ``scales``, then
    acc += float(sum) * dd): ``quants``, ``inits`` (offset terms), ``xss`` (activation sums) and
    ``dds`` (d x dx splat over the lanes) per token."""
    b = k.b
    lanes = dds[0].type.count
    subs = fmt.dtype.block_size // fmt.sub
    # where a lane of the dot fits i16, vpdpwssd applies the scales (see _scaled_sum). q6_k's
    # offset term (32 x the sub-block's activation sum) does not fit, so its dots leave it out
    # and the block adds sum_s scale_s x term_s once, in the same i32 lanes (no vpmulld per step)
    fits = isa.full_u8_dot and lanes in (8, 16)
    offset_apart = fits and dec.offset and _lane_bound(fmt, dec) >= 1 << 15 \
        and _lane_bound(fmt, dec, with_offset=False) < 1 << 15 and dec.offset * 128 < 1 << 15 \
        and subs in (lanes, 2 * lanes, 4 * lanes)
    pairs = fits and (offset_apart or _lane_bound(fmt, dec) < 1 << 15)
    dots = [[] for _ in quants]
    for step, chunks in enumerate(steps):
        w = k.concat(*[dec.chunk(c) for c in chunks])
        for t, (xq, init) in enumerate(zip(quants, inits)):
            dots[t].append(_gemv_dot(k, isa, fmt, dec, w, blk, step, chunks, None if offset_apart else init, xq))
    for t, (acc, dd) in enumerate(zip(accs, dds)):
        isum = _scaled_sum(k, isa, scales, dots[t], pairs)
        if offset_apart:                                   # + sum_s (-offset x scale_s) x xsum_s, i16 pairs
            offset = b.mul(scales, ir.Constant(vec(i32, subs), [-dec.offset] * subs))
            extra = _word_pairs(k, isa, offset, xss[t])                               # (subs / 2,) i32
            while extra.type.count > lanes:
                half = extra.type.count // 2
                extra = b.add(k.shuffle(extra, range(half)), k.shuffle(extra, range(half, 2 * half)))
            if extra.type.count < lanes:                   # subs == lanes: the upper lanes add nothing
                extra = k.shuffle(extra, range(lanes), ir.Constant(extra.type, [0] * extra.type.count))
            isum = b.add(isum, extra)
        acc.set(isa.fma(b.sitofp(isum, vec(f32, lanes)), dd, acc.get()))


def _scaled_sum(k: Kernel, isa: Isa, scales: ir.Value, dots: list, pairs: bool) -> ir.Value:
    """sum over a block's steps of dot x its lanes' sub-block scales, in i32 lanes; ``dots``: (dot,
    lane_sub) per step. With ``pairs`` (every lane below 2**15) vpdpwssd applies the scales: two 16-lane
    steps' dots packed to i16 words (vpackssdw, exact) against their scales shuffled into place (one
    vpdpwssd per two steps: q4_k 24 -> 20 cycles a block in L2 on a Zen 4), else each lane as (dot,
    sign) x (scale, 0), instead of vpmulld and an add."""
    b = k.b
    lanes = dots[0][0].type.count
    if pairs and lanes == 16 and len(dots) % 2 == 0:
        words = b.trunc(scales, vec(i16, scales.type.count))
        total = ir.Constant(vec(i32, lanes), [0] * lanes)
        for (da, sa), (db, sb) in zip(dots[::2], dots[1::2]):
            # vpackssdw: per 128-bit lane q, words 0-3 are da's lanes 4q..4q+3, words 4-7 db's
            subs = [(sa if r < 4 else sb)[4 * (w // 8) + r % 4] for w in range(32) for r in [w % 8]]
            total = isa.dot_pairs(total, isa.pack_i32(da, db), k.shuffle(words, subs))
        return total
    total = None
    words = b.and_(scales, ir.Constant(scales.type, [0xFFFF] * scales.type.count))
    for dot, lane_sub in dots:
        if pairs:
            total = isa.dot_pairs(total if total is not None else ir.Constant(vec(i32, lanes), [0] * lanes),
                                  k.cast_vec(dot, i16), k.cast_vec(k.shuffle(words, lane_sub), i16))
        else:
            scaled = b.mul(dot, k.shuffle(scales, lane_sub))
            total = scaled if total is None else b.add(total, scaled)
    return total


def _word_pairs(k: Kernel, isa: Isa, a: ir.Value, b: ir.Value) -> ir.Value:
    """a[2j]*b[2j] + a[2j+1]*b[2j+1] for two <n x i32> whose values fit i16: <n/2 x i32> (pmaddwd)."""
    n = a.type.count
    return isa.dot_pairs(ir.Constant(vec(i32, n // 2), [0] * (n // 2)), k.b.trunc(a, vec(i16, n)), k.b.trunc(b, vec(i16, n)))


# A gemv row of at most this many blocks is emitted without a block loop: on a Zen 4, 2048-wide
# q4_k and q6_k rows then stream from memory 1.2-1.3x faster (75 MB matrices, C harness), and
# 1B-shaped decode runs 1.1-1.3x faster; longer rows lose so (32 q4_k blocks: 0.7x), as their
# code outgrows the op cache, and keep the loop
GEMV_INLINE_BLOCKS = 8


def _in_groups(k: Kernel, nblocks: int, size: int, inline: int, body) -> None:
    """``body(first, count)`` over a row's blocks in groups of ``size`` (1: block by block): inline
    with constant indices for rows of at most ``inline`` blocks, else a loop over the whole groups
    and then the partial last one."""
    if nblocks <= inline:
        for g0 in range(0, nblocks, size):
            body(k.i64(g0), min(size, nblocks - g0))
        return
    whole = nblocks // size
    with k.loop(0, whole, name="blk") as gi:
        body(gi if size == 1 else k.mul(gi, size), size)
    if nblocks % size:
        body(k.i64(whole * size), nblocks % size)


def _lane_bound(fmt: BlockFormat, dec, with_offset: bool = True) -> int:
    """The largest |value| of one i32 lane of a gemv dot: four |level| x 128 products, and (with the
    offset) in a sub-block's first lane the offset times the sub-block's activation sum."""
    level = 128 if dec.signed else (max(dec.qmax, dec.offset) if with_offset else dec.qmax)
    return 4 * level * 128 + (dec.offset * fmt.sub * 128 if with_offset else 0)


def _xsums_row(k: Kernel, fmt: BlockFormat, lay: ActLayout, blk, xbase) -> ir.Value:
    """Sums of the quantised activations per sub-block of block blk, one-token layout at ``xbase``: (subs,) i32."""
    subs = fmt.dtype.block_size // fmt.sub
    per = fmt.sub // lay.sum_block
    if per == 2 and lay.has_sums32:                      # the layout's sums of 32 quants
        return k.b.sext(k.load(vec(i16, subs), xbase, lay.sums32(k, 1, k.mul(blk, subs))), vec(i32, subs))
    sums = lay.load_sums(k, xbase, 1, k.mul(blk, subs * per), subs * per)
    if per == 1:
        return sums
    return k.b.add(k.shuffle(sums, range(0, 2 * subs, 2)), k.shuffle(sums, range(1, 2 * subs, 2)))


def _prefetch_row(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, n) -> None:
    """Ask for the bytes PREFETCH_AHEAD on from the row's start, into L2 (prefetches never fault
    past the end)."""
    if isa.t.gemv_prefetch != "rows":
        return
    row_bytes = fmt.dtype.row_bytes(lay.K)
    for ahead in PREFETCH_AHEAD:
        base = k.add(k.mul(n, row_bytes), ahead)
        for off in range(0, row_bytes, 64):
            k.prefetch(k.addr(k.arg["w"], k.add(base, off)), level=2)


# -- gemm: T > 1 ----------------------------------------------------------------------------
def _gemm(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, rows, R: int, G: int) -> None:
    """Tiles of R rows x G token groups, then the row and group tails."""
    b = k.b
    T = k.arg["T"]
    groups = b.sdiv(k.add(T, GROUP - 1), k.i64(GROUP))
    start, end = rows
    full = k.add(start, b.mul(b.sdiv(b.sub(end, start), k.i64(R)), k.i64(R)))
    gfull = b.mul(b.sdiv(groups, k.i64(G)), k.i64(G))
    #         rows          tile rows   token-group spans and their tile widths
    plan = [((start, full), R, [((0, gfull), G), ((gfull, groups), 1)]),
            ((full, end), 1, [((0, groups), 1)])]          # row tails are rare: 1 x 1 tiles
    for (lo, hi), r, spans in plan:
        with k.loop(lo, hi, step=r, name=f"n{r}") as n:
            for (glo, ghi), g in spans:
                with k.loop(glo, ghi, step=g, name=f"g{r}x{g}") as g0:
                    _gemm_tile(k, isa, fmt, lay, N, n, r, g0, g)


def _gemm_tile(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, n0, R: int, g0, G: int):
    """Rows n0..n0+R x tokens 16*g0..16*(g0+G): R*G accumulators of 16 token lanes.
    Chunks are visited `fmt.unroll` at a time in a run-time loop, which keeps the IR small."""
    L = GROUP
    v16 = vec(f32, L)
    xg = [k.addr(k.arg["xq"], k.mul(k.add(g0, g), lay.group_bytes(L))) for g in range(G)]
    zero = ir.Constant(v16, [0.0] * L)
    acc = [[k.var(v16, zero) for _ in range(G)] for _ in range(R)]
    U = fmt.unroll
    with k.loop(0, lay.K // fmt.dtype.block_size, name="blk") as blk:
        decs = [fmt.decode(k, isa, _row(k, fmt, lay, k.add(n0, r), blk)) for r in range(R)]
        dx = [k.load(v16, xg[g], lay.d(k, L, blk)) for g in range(G)]                 # (16,) f32
        # super-block types sum their sub-blocks' dots times the integer scales first (exact small
        # integers in f32 lanes) and take one float step per block, as llama.cpp does
        sums = [[k.var(v16, zero) for _ in range(G)] for _ in range(R)] if decs[0].ints is not None else None
        if fmt.chunks == U:
            for c in range(U):
                _gemm_chunk(k, isa, fmt, lay, decs, blk, c, xg, dx, acc, sums)
        else:
            with k.loop(0, fmt.chunks // U, name="cg") as cg:
                for i in range(U):
                    _gemm_chunk(k, isa, fmt, lay, decs, blk, k.add(k.mul(cg, U), i), xg, dx, acc, sums)
        if sums is not None:
            _gemm_block_end(k, isa, fmt, lay, decs, blk, xg, dx, acc, sums)
    _store_tile(k, N, n0, R, g0, G, acc)


def _gemm_block_end(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, decs, blk, xg, dx, acc, sums) -> None:
    """A super-block's float step: acc += d*dx * sum_s(scale_s * dot_s) - dmin*dx * sum_s(min_s * xsum_s),
    both sums exact integers in f32 lanes (below 2**24)."""
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
        xs = [b.sitofp(_xsum(k, fmt, lay, L, xg[g], blk, s), v16) for g in range(G)]
        for r in range(R):
            m = k.splat(decs[r].int_min(k, s), L)
            for g in range(G):
                msum[r][g] = b.fmul(xs[g], m) if msum[r][g] is None else isa.fma(xs[g], m, msum[r][g])
    for r, dec in enumerate(decs):
        for g in range(G):
            dmin = b.fmul(k.splat(b.fneg(dec.ints.dmin), L), dx[g])
            acc[r][g].set(isa.fma(msum[r][g], dmin, acc[r][g].get()))


def _gemm_chunk(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, decs, blk, c, xg, dx, acc, sums) -> None:
    """Chunk c (an int or i64 value) of every tile row's block against every token group: into
    ``acc`` scaled by the sub-block's float scale, or for super-block types into the block's
    ``sums`` times its integer scale (mins wait for `_gemm_block_end`)."""
    b = k.b
    L = GROUP
    v16 = vec(f32, L)
    R, G = len(decs), len(xg)
    dec0 = decs[0]
    chunks = [k.cast_vec(d.chunk(c), i32) for d in decs]                          # (8,) i32 each
    xrows = [xg] * R
    from_memory = isa.is_x86 and isa.t.vector_bits < 512          # 16 vector registers: AVX2
    if from_memory:
        # Weight words are broadcast from memory (vpbroadcastd m32), not permuted in registers (each
        # permute holds an index vector), and every tile row loads the activations itself: LLVM
        # would otherwise load them once and spill them for the next row (q5_0 gemm 1.33x, k-quants
        # 1.12-1.15x on a znver3, T=512). Both take pointers it cannot see through (`_launder`),
        # or it would forward the stores and merge the loads.
        wbuf = k.scratch(i32, 8 * R)
        for r, ch in enumerate(chunks):
            k.store(ch, wbuf, 32 * r)
        words_at = _launder(k, wbuf)
        xrows = [xg] + [[_launder(k, x) for x in xg] for _ in range(R - 1)]
    subs = _subs(k, fmt, c)
    words = k.add(k.mul(blk, fmt.dtype.block_size // 4), k.mul(c, 8))
    for si, s in enumerate(subs):
        xs = [None if lay.keeps_s else _xsum(k, fmt, lay, L, xg[g], blk, s) for g in range(G)]
        init = [b.mul(x, ir.Constant(vec(i32, L), [-dec0.offset] * L)) if dec0.offset
                else ir.Constant(vec(i32, L), [0] * L) for x in xs]
        dots = [[init[g] for g in range(G)] for _ in range(R)]
        per = 8 // len(subs)
        run = isa.i16_run(dec0.signed, dec0.qmax, 4 * L)
        for r in range(R):
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


def _launder(k: Kernel, p: ir.Value) -> ir.Value:
    """p, through an empty inline asm: the same address, but LLVM can no longer tell, so loads
    through it are neither merged with loads through p nor fed from stores through p."""
    asm = ir.InlineAsm(ir.FunctionType(ir.PointerType(), [ir.PointerType()]), "", "=r,0")
    return k.b.call(asm, [k.b.bitcast(p, ir.PointerType())])


def _store_tile(k: Kernel, N: int, n0, R: int, g0, G: int, acc) -> None:
    """y[t, n0:n0+R] for every real token t of the tile's groups."""
    b = k.b
    T = k.arg["T"]
    for g in range(G):
        vals = [acc[r][g].get() for r in range(R)]
        for lane in range(GROUP):
            t = k.add(k.mul(k.add(g0, g), GROUP), lane)
            with k.if_then(b.icmp_signed("<", t, T)):
                row = [b.extract_element(v, ir.Constant(i32, lane)) for v in vals]
                out = row[0] if R == 1 else pack(k, row)
                k.store(out, k.arg["y"], k.mul(k.add(k.mul(t, N), n0), 4))


# -- rows gemm: T > 1 with VNNI ---------------------------------------------------------------
ROWS = 16                # lanes are rows: one 64-byte vector holds the same 4 features of 16 rows
PANEL_BYTES = 32768      # decoded weights of one tile kept at once (a K panel, in L1)
STRIPE_TOKENS = 512      # tokens whose results a tile keeps across its panels (64 KB, in L2)


# Tokens per register tile of 32 rows: 12 dot chains (vpdpbusd: 5 cycles of latency, 2 a cycle), 12
# block sums for super-block types, two weight vectors and the broadcasts fill the 32 registers; each
# weight load serves 6 tokens (a C loop of this shape on a Xeon: 4.5 G vpdpbusd/s of 5.7 peak; 4 tokens
# with integer scale multiplies, the layout before: 3.8).
TILE_TOKENS = 6


@dataclass(frozen=True)
class Panel:
    """Where one block of a 16-row vector lies in a tile's panel buffer: for each sub-block its
    4-byte words of 16 rows (64 bytes each) and, for super-block types, its integer scales as f32;
    then the block's scale (d), its negated min (dmin) where the type has mins, and the integer mins
    as i16 pairs, one pair for each pair of sub-blocks (so that one vpdpwssd takes the mins of two).
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

    @property
    def ndmin(self) -> int:
        return self.d + 64

    def imin(self, p: int) -> int:
        return self.d + 128 + 64 * p

    @staticmethod
    def room(fmt: BlockFormat) -> int:
        """Bytes per block and vector, enough for every layout of ``fmt``."""
        widest = Panel(fmt, True, True)
        return widest.imin(widest.subs)


def _rows_gemm(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, rows, layout: str | None = None) -> None:
    """Tiles of 32 rows (the last one masked at the end of the rows): a K panel of the tile is
    decoded into a private buffer with rows as lanes (``Panel``), then every token runs over
    the panel, a few at a time, each activation word broadcast into the dot products of both
    halves of the tile. Tokens go STRIPE_TOKENS at a time: their results stay in a private stripe
    across the panels, and go to y once, after the last one (rows of y are N floats apart, so a
    tile's rows of y for many tokens would share a few cache sets and be fetched again per panel).
    Super-block types sum their sub-blocks times their scales before one float step per block, as
    llama.cpp does. Activations come one row per token."""
    start, end = rows
    T = k.arg["T"]
    nblocks = lay.K // fmt.dtype.block_size
    room = Panel.room(fmt)
    per_panel = max(1, min(nblocks, PANEL_BYTES // (2 * room)))
    buf = k.scratch(i8, 2 * room * per_panel)
    vecs = 2
    stripe = _launder(k, k.scratch(f32, (STRIPE_TOKENS + TILE_TOKENS) * vecs * ROWS))
    with k.loop(start, end, step=vecs * ROWS, name="tile") as n0:
        with k.loop(0, T, step=STRIPE_TOKENS, name="stripe") as c0:
            c_end = k.b.select(k.b.icmp_signed("<", k.add(c0, STRIPE_TOKENS), T), k.add(c0, STRIPE_TOKENS), T)
            with k.loop(0, nblocks, step=per_panel, name="panel") as p0:
                count = _panel_count(k, p0, per_panel, nblocks)
                panel, dec = _decode_panel(k, isa, fmt, lay, N, n0, vecs, p0, count, buf, room, layout)
                with k.loop(c0, c_end, step=TILE_TOKENS, name="tt") as t0:
                    _panel_run(k, isa, lay, vecs, p0, count, buf, room, panel, dec, stripe, c0, c_end, t0)
            _stripe_out(k, N, n0, vecs, end, c0, c_end, stripe)


def _stripe_out(k: Kernel, N: int, n0, vecs: int, end, c0, c_end, stripe) -> None:
    """y[t, rows of the tile] for the stripe's tokens c0..c_end, the rows before ``end`` only."""
    r0 = _tile_rows(k, N, n0, vecs) if N >= vecs * ROWS else n0     # the panel's lane 0 is row r0
    masks = [_row_mask(k, r0, ROWS * v, n0, end) for v in range(vecs)]
    with k.loop(c0, c_end, name="out") as t:
        for v in range(vecs):
            value = k.load(vec(f32, ROWS), stripe, k.mul(k.add(k.mul(k.b.sub(t, c0), vecs), v), 64))
            k.masked_store(value, k.arg["y"], k.mul(k.add(k.mul(t, N), r0, ROWS * v), 4), masks[v])


def _decode_panel(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, n0, vecs: int, p0, count, buf,
                  room: int, layout: str | None = None):
    """Blocks p0..p0+count of the tile's 16*vecs rows into the buffer (``_tile_rows``; in a matrix of
    fewer rows, rows past N repeat row N-1), a 16-row vector of a block at a time (run-time loops over
    vectors and chunk groups keep the code small), from weights in the file's layout or in ``layout``;
    returns the Panel layout and one row's decoder (offsets and kinds are the same for every row)."""
    b = k.b
    nblocks = lay.K // fmt.dtype.block_size
    row_bytes = fmt.dtype.row_bytes(lay.K)                # a row's share of the matrix, in its layout
    if layout:                                            # rows16: what each of its groups decodes to
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
        if layout:                                        # rows16: the 16 rows' block is one group
            rows16.decode_panel(k, isa, lay, k.add(_tile_rows(k, N, n0, vecs), k.mul(v, ROWS)), k.add(p0, i), buf,
                                k.add(k.mul(i, vecs * room), k.mul(v, room)), panel)
        else:
            panel, dec = _decode_panel_vector(k, isa, fmt, lay, N, n0, vecs, p0, i, v, buf, room)
    return panel, dec


def _decode_panel_vector(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, n0, vecs: int, p0, i, v,
                         buf, room: int):
    """Block p0+i of the tile's vector v (16 rows) from the file's layout into the panel buffer."""
    b = k.b
    row_bytes = fmt.dtype.row_bytes(lay.K)
    if N >= vecs * ROWS:                              # rows at fixed distances from the tile's first
        first = _row(k, fmt, lay, k.add(_tile_rows(k, N, n0, vecs), k.mul(v, ROWS)), k.add(p0, i))
        decs = [fmt.decode(k, isa, k.addr(first, r * row_bytes)) for r in range(ROWS)]
    else:                                             # a matrix smaller than a tile: rows past N repeat N-1
        rows = [k.add(n0, k.mul(v, ROWS), r) for r in range(ROWS)]
        rows = [b.select(b.icmp_signed("<", r, k.i64(N)), r, k.i64(N - 1)) for r in rows]
        decs = [fmt.decode(k, isa, _row(k, fmt, lay, r, k.add(p0, i))) for r in rows]
    dec = decs[0]
    panel = Panel(fmt, dec.ints is not None, dec.mins is not None)
    if not panel.ints and panel.subs > 1:
        raise ValueError(f"qmatmul {fmt.dtype.name}: sub-block scales without integer scales")
    vat = k.add(k.mul(i, vecs * room), k.mul(v, room))
    if panel.ints:
        for s, col in enumerate(k.transpose([d.ints.scales for d in decs])):
            k.store(b.sitofp(col, vec(f32, ROWS)), buf, k.add(vat, panel.iscale(s)))
        _store_int_factors(k, fmt, lay, decs, buf, vat, panel, unit=fmt.sub)
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


def _panel_count(k: Kernel, p0, per_panel: int, nblocks: int):
    """Blocks in the K panel that starts at block p0: per_panel, or what is left of the row."""
    b = k.b
    return b.select(b.icmp_signed("<", k.add(p0, per_panel), k.i64(nblocks)), k.i64(per_panel),
                    b.sub(k.i64(nblocks), p0))


def _store_int_factors(k: Kernel, fmt: BlockFormat, lay: ActLayout, decs, buf, at, layout, unit: int | None = None) -> None:
    """A super-block of 16 rows' float factors into a panel at ``at``, rows as lanes, where ``layout``
    (a Panel or a tile panel) puts them: d, and for types with mins the negated dmin and the integer
    mins as i16 pairs, one pair for each pair of ``unit``-feature runs (the activation sum blocks by
    default)."""
    k.store(k.concat(*[pack(k, [d.ints.d]) for d in decs]), buf, k.add(at, layout.d))
    if decs[0].mins is not None:
        k.store(k.concat(*[pack(k, [k.b.fneg(d.ints.dmin)]) for d in decs]), buf, k.add(at, layout.ndmin))
        for p, col in enumerate(k.transpose([_min_pairs(k, fmt, d.ints.mins, unit or lay.sum_block) for d in decs])):
            k.store(col, buf, k.add(at, layout.imin(p)))


def _row_mask(k: Kernel, r0, first: int, n0, end):
    """<16 x i1>: which of rows r0+first .. r0+first+15 a tile that owns [n0, end) stores (a last tile
    shifted back over rows before n0 leaves those to their own tile)."""
    rows = k.add(k.splat(r0, ROWS), ir.Constant(vec(i64, ROWS), [first + r for r in range(ROWS)]))
    return k.b.and_(k.b.icmp_signed(">=", rows, k.splat(n0, ROWS)), k.b.icmp_signed("<", rows, k.splat(end, ROWS)))


def _min_pairs(k: Kernel, fmt: BlockFormat, mins: ir.Value, unit: int) -> ir.Value:
    """A row's integer mins as one i16 pair per pair of ``unit``-feature runs of the block: (the min of
    run 2p's sub-block, the min of run 2p+1's), as <pairs x i32>."""
    b = k.b
    n = fmt.dtype.block_size // unit // 2
    first = k.shuffle(mins, [2 * p * unit // fmt.sub for p in range(n)])
    second = k.shuffle(mins, [(2 * p + 1) * unit // fmt.sub for p in range(n)])
    return b.or_(b.and_(first, ir.Constant(vec(i32, n), [0xFFFF] * n)), b.shl(second, ir.Constant(vec(i32, n), [16] * n)))


def _tile_rows(k: Kernel, N: int, n0, vecs: int):
    """The first row a tile starting at n0 decodes: n0, or N - 32 for the last tile of the matrix, whose
    32 rows are then all real (the rows before n0 are decoded again but not stored). N >= 32."""
    return k.b.select(k.b.icmp_signed("<", n0, k.i64(N - vecs * ROWS)), n0, k.i64(N - vecs * ROWS))


def _panel_run(k: Kernel, isa: Isa, lay: ActLayout, vecs: int, p0, count, buf, room: int, panel: Panel,
               dec: Decoded, stripe, c0, c_end, t0) -> None:
    """Tokens t0..t0+TILE_TOKENS-1 of the stripe c0..c_end (those past its end repeat its last token)
    over the panel, an f32 accumulator of 16 rows per (token, vector) in the stripe, which starts from
    zero at the first panel. Super-block types work on the stripe in place (a (token, vector) is
    touched once per block; the registers hold its sub-block dot and block sum), the others in
    registers."""
    b = k.b
    n = TILE_TOKENS
    tokens = [b.select(b.icmp_signed("<", k.add(t0, t), c_end), k.add(t0, t), b.sub(c_end, k.i64(1))) for t in range(n)]
    xs = [k.addr(k.arg["xq"], k.mul(tok, lay.group_bytes(1))) for tok in tokens]
    slots = [[k.mul(k.add(k.mul(k.add(b.sub(t0, c0), t), vecs), v), 64) for v in range(vecs)] for t in range(n)]
    first = b.icmp_signed("==", p0, k.i64(0))
    accs = _Accumulators(k, stripe, slots, first, in_registers=not panel.ints)
    with k.loop(0, count, name="pblk") as i:
        blk, at = k.add(p0, i), k.mul(i, vecs * room)
        (_super_block if panel.ints else _plain_block)(k, isa, lay, vecs, buf, room, panel, dec, xs, blk, at, accs)
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


def _sub_dots(k: Kernel, isa: Isa, lay: ActLayout, vecs: int, buf, room: int, panel: Panel, dec: Decoded, xs, blk,
              s, sub_at) -> list:
    """Each (token, vector)'s integer dot over sub-block s (an int or i64 value) of block blk, whose
    words lie at ``sub_at``: [token][vector] <16 x i32>, the offset term included."""
    b = k.b
    fmt = panel.fmt
    words, per = fmt.sub // 4, fmt.sub // lay.sum_block
    vi = vec(i32, ROWS)

    def xsum(t):                                         # token t's sum of quants in sub-block s
        first_sum = k.mul(k.add(k.mul(blk, panel.subs), s), per)
        return _sum_of(k, [lay.load_sums(k, xs[t], 1, k.add(first_sum, p)) for p in range(per)])
    dots = [[k.splat(b.mul(xsum(t), ir.Constant(i32, -dec.offset)), ROWS) if dec.offset else ir.Constant(vi, [0] * ROWS)
             for _ in range(vecs)] for t in range(len(xs))]
    word0 = k.mul(k.add(k.mul(blk, panel.subs), s), words)
    for j in range(words):
        w = [k.load(vec(i8, 64), buf, k.add(sub_at, v * room + 64 * j)) for v in range(vecs)]
        for t, xt in enumerate(xs):
            x = k.cast_vec(k.splat(k.load(i32, xt, lay.qs(k, 1, k.add(word0, j))), ROWS), i8)
            for v in range(vecs):
                dots[t][v] = isa.dot(dots[t][v], w[v], x, False, dec.qmax)
    return dots


def _super_block(k: Kernel, isa: Isa, lay: ActLayout, vecs: int, buf, room: int, panel: Panel, dec: Decoded, xs, blk,
                 at, accs: _Accumulators) -> None:
    """One super-block into the accumulators: per sub-block, each (token, vector)'s integer dot times the
    rows' scales (f32 in the panel: small integers, so the products and their sums are the integer
    sums llama.cpp takes, below 2**24) into a block sum; then acc += sum * d*dx, and for types with
    mins acc += (sum_s min_s * xsum_s) * -dmin*dx, two sub-blocks per vpdpwssd."""
    b = k.b
    v16, vi = vec(f32, ROWS), vec(i32, ROWS)
    zero_f = ir.Constant(v16, [0.0] * ROWS)
    sums = [[k.var(v16, zero_f) for _ in range(vecs)] for _ in xs]
    with k.loop(0, panel.subs, name="psub") as s:
        sub_at = k.add(at, k.mul(s, panel.sub_bytes))
        dots = _sub_dots(k, isa, lay, vecs, buf, room, panel, dec, xs, blk, s, sub_at)
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
        words = _sub_sum_pairs(k, lay, panel, xt, blk) if panel.mins else []
        for v, (d, ndmin, imins) in enumerate(factors):
            a = isa.fma(sums[t][v].get(), b.fmul(d, dx), accs.get(t, v))
            if panel.mins:                                # sum_s min_s * xsum_s, two sub-blocks per step, two chains
                chains = [ir.Constant(vi, [0] * ROWS)] * 2
                for p, (im, word) in enumerate(zip(imins, words)):
                    chains[p % 2] = isa.dot_pairs(chains[p % 2], im, word)
                a = isa.fma(b.sitofp(_sum_of(k, chains), v16), b.fmul(ndmin, dx), a)
            accs.set(t, v, a)


def _sub_sum_pairs(k: Kernel, lay: ActLayout, panel: Panel, xt, blk) -> list:
    """A token's activation sums of block blk per sub-block, as i16 pairs (sub-blocks 2p, 2p+1), each
    broadcast from memory to <32 x i16>: the sums where a sub-block is a sum block, else the sums of
    32 (act_quant's ``sums32``, the sub-blocks of 32-weight types)."""
    subs = panel.subs
    if panel.fmt.sub == lay.sum_block:
        at = lambda p: lay.sums(k, 1, k.add(k.mul(blk, subs), 2 * p))          # noqa: E731
    elif panel.fmt.sub == 32 and lay.has_sums32:
        at = lambda p: lay.sums32(k, 1, k.add(k.mul(blk, subs), 2 * p))        # noqa: E731
    else:
        raise ValueError(f"qmatmul {panel.fmt.dtype.name}: no activation sums per sub-block of {panel.fmt.sub}")
    return [k.cast_vec(k.splat(k.load(i32, xt, at(p)), ROWS), i16) for p in range(subs // 2)]


def _plain_block(k: Kernel, isa: Isa, lay: ActLayout, vecs: int, buf, room: int, panel: Panel, dec: Decoded, xs, blk,
                 at, accs: _Accumulators) -> None:
    """One block of a 32-weight type into the accumulators: acc += dot * d*dx (- xsum * dmin*dx, or with
    q8_1 activations - s * dmin)."""
    b = k.b
    v16 = vec(f32, ROWS)
    dots = _sub_dots(k, isa, lay, vecs, buf, room, panel, dec, xs, blk, 0, at)
    per = panel.fmt.sub // lay.sum_block
    for v in range(vecs):                             # the vector's block factors, loaded once for all tokens
        vat = k.add(at, v * room)
        d = k.load(v16, buf, k.add(vat, panel.d))
        ndmin = k.load(v16, buf, k.add(vat, panel.ndmin)) if panel.mins else None
        for t, xt in enumerate(xs):
            dx = k.splat(k.load(f32, xt, lay.d(k, 1, blk)), ROWS)
            a = isa.fma(b.sitofp(dots[t][v], v16), b.fmul(d, dx), accs.get(t, v))
            if panel.mins and lay.keeps_s:                # q8_1's s = dx xsum, as ggml rounds it
                a = isa.fma(k.splat(lay.load_s(k, isa, xt, 1, blk), ROWS), ndmin, a)
            elif panel.mins:
                xsum = _sum_of(k, [lay.load_sums(k, xt, 1, k.add(k.mul(blk, per), p)) for p in range(per)])
                a = isa.fma(b.sitofp(k.splat(xsum, ROWS), v16), b.fmul(ndmin, dx), a)
            accs.set(t, v, a)


def _sum_of(k: Kernel, values: list) -> ir.Value:
    total = values[0]
    for v in values[1:]:
        total = k.b.add(total, v)
    return total


# -- scalar twin ----------------------------------------------------------------------------
def _scalar(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, N: int, rows, L: int) -> None:
    """y[t, n] = sum over blocks of dx * (scale * sum(q * xq) - min * sum(xq)), rounded as llama.cpp
    does: a super-block sums its sub-blocks' integer dots times their integer scales (its mins
    likewise) and takes one float step, dx*d times that sum; the steps accumulate with FMA, the
    mins' apart, subtracted at the end."""
    b = k.b
    step = _block_scalar if fmt.int_scale is None else _super_block_scalar
    with k.loop(*rows, name="n") as n:
        with k.loop(0, k.arg["T"], name="t") as t:
            x = (k.addr(k.arg["xq"], k.mul(b.sdiv(t, k.i64(L)), lay.group_bytes(L))), b.srem(t, k.i64(L)))
            acc, mins = k.var(f32, 0.0), k.var(f32, 0.0)
            with k.loop(0, lay.K // fmt.dtype.block_size, name="blk") as blk:
                wblk = _row(k, fmt, lay, n, blk)
                dx = k.load(f32, x[0], lay.d(k, L, blk, x[1]))
                for total, (factor, value) in zip((acc, mins), step(k, isa, fmt, lay, L, x, wblk, blk, dx)):
                    total.set(isa.fused(factor, value, total.get()))
            k.store(b.fsub(acc.get(), mins.get()), k.arg["y"], k.mul(k.add(k.mul(t, N), n), 4))


def _block_scalar(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, L: int, x, wblk, blk, dx) -> list:
    """A one-scale block's (scale*dx, sum(q * xq)) and, with a min, (min*dx, sum(xq)), or with q8_1
    activations (min, s): pairs of floats whose products the caller sums."""
    b = k.b
    scale, mn = fmt.scale(k, isa, wblk, 0)
    out = [(b.fmul(scale, dx), b.sitofp(_dot_scalar(k, isa, fmt, lay, L, x, wblk, blk, 0), f32))]
    if mn is None:
        return out
    if lay.keeps_s:
        return out + [(mn, lay.load_s(k, isa, x[0], L, blk, lane=x[1]))]
    return out + [(b.fmul(mn, dx), b.sitofp(_xsum_scalar(k, fmt, lay, L, x, blk, 0), f32))]


def _super_block_scalar(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, L: int, x, wblk, blk, dx) -> list:
    """A super-block's (d*dx, sum_s scale[s] * sum(q * xq)) and, with mins, (dmin*dx, sum_s min[s] * sum(xq))."""
    b = k.b
    header = fmt.int_scale(k, isa, wblk, 0)                           # d and dmin (sub-block 0's scales unused)
    isum, msum = k.var(i32, 0), k.var(i32, 0)
    with k.loop(0, fmt.dtype.block_size // fmt.sub, name="s") as s:
        ints = fmt.int_scale(k, isa, wblk, s)
        isum.set(b.add(isum.get(), b.mul(ints.scales, _dot_scalar(k, isa, fmt, lay, L, x, wblk, blk, s))))
        if ints.mins is not None:
            msum.set(b.add(msum.get(), b.mul(ints.mins, _xsum_scalar(k, fmt, lay, L, x, blk, s))))
    out = [(b.fmul(header.d, dx), b.sitofp(isum.get(), f32))]
    return out + ([(b.fmul(header.dmin, dx), b.sitofp(msum.get(), f32))] if header.mins is not None else [])


def _dot_scalar(k: Kernel, isa: Isa, fmt: BlockFormat, lay: ActLayout, L: int, x, wblk, blk, s) -> ir.Value:
    """sum(q * xq) over sub-block s (an int or i64 value) of block blk, one weight at a time (i32)."""
    b = k.b
    base, lane = x
    isum = k.var(i32, 0)
    with k.loop(0, fmt.sub, name="i") as i:
        e = k.add(k.mul(blk, fmt.dtype.block_size), k.mul(s, fmt.sub), i)           # feature index
        at = k.add(lay.qs(k, L, b.sdiv(e, k.i64(4)), lane), b.srem(e, k.i64(4)))
        q = fmt.level(k, isa, wblk, k.add(k.mul(s, fmt.sub), i))
        isum.set(b.add(isum.get(), b.mul(q, b.sext(k.load(i8, base, at), i32))))
    return isum.get()


def _xsum_scalar(k: Kernel, fmt: BlockFormat, lay: ActLayout, L: int, x, blk, s):
    """Sum of quantised activations of sub-block s (an int or i64 value) for one token."""
    base, lane = x
    per = fmt.sub // lay.sum_block
    first = k.add(k.mul(blk, fmt.dtype.block_size // lay.sum_block), k.mul(s, per))
    return _sum_of(k, [lay.load_sums(k, base, L, k.add(first, p), lane=lane) for p in range(per)])
