"""Activation quantisers: f32 rows to q8 blocks, exactly as ggml's x86 quantisers round.

    act_quant_<fmt>_k<K>_<target>(x: ptr f32 [T, K], xq: ptr u8 [act_bytes], T, ith, nth)

The layout of xq is private to the qmatmul kernels and made for them. Tokens come in
groups of L (L = 1 when T == 1, for rows_only kernels and where the plan says act_rows: targets
whose gemm takes rows as lanes; else 16; the last group is zero-padded). Per group:

    qs   int8 [K/4, L, 4]   the quants, one 4-byte word per token in turn, so a 64-byte
                            load gives the same 4 features of 16 tokens (L = 1: plain row)
    d    f32  [K/bs, L]     the block scale: bs = 32 (q8_0, q8_1) or 256 (q8_k)
    sums i16  [K/ss, L]     sums of quants: ss = 32 (q8_0) or 16 (q8_k, ggml's bsums); at
                            most 32 * 128 in size, so two sub-blocks' sums share a word.
                            q8_1 keeps ggml's s there instead: fp16 bits of d * sum(q)
    sums32 i16 [K/32, L]    q8_k only: sums of 32 quants (the sub-blocks of q4_k and q5_k), so
                            that one 4-byte word holds the sums of two of them
    (padding)               to the next 64-byte line

q8_0: d = amax/127 rounded to fp16 (as ggml stores it), q = round_even(x * 127/amax).
q8_1 (for q4_1 and q5_1): q8_0's d and q, and s = (amax/127) * sum(q) rounded to fp16, as
ggml's x86 quantize_row_q8_1 keeps it (d unrounded in the product). Its vec_dot adds m * s,
which differs from the exact m * d * sum(q) by s's fp16 rounding: large where a block holds an
outlier activation.
q8_k: ggml's quantize_row_q8_K with the sign of d made positive (iscale = 127/amax,
d = 1/iscale); ggml's (d, q) differ from ours by one common sign, so every product d*q
is bit-identical.

A NaN anywhere in a block makes its amax and d NaN (ggml's quantisers skip it, and its quant
rounds to 0), so damaged activations reach the logits as NaN, which the runtime reports,
rather than as quietly zeroed features.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ggraph.backends.llvm.kernels.builder import Kernel, f32, i8, i16, i32, vec
from ggraph.backends.llvm.kernels.isa import Isa, vector_path
from ggraph.backends.llvm.kernels.plan import act_rows
from ggraph.backends.llvm.target import Target

GROUP = 16                      # tokens per group when T > 1 (not rows_only)

#           fmt:  (block, sum block)
_FORMATS = {"q8_0": (32, 32), "q8_1": (32, 32), "q8_k": (256, 16)}


def tokens_per_group(T: int, rows_only: bool = False, target: Target | None = None) -> int:
    """Tokens per group of the activations of T tokens: one row per token, or GROUP (plan.act_rows)."""
    return 1 if rows_only or T == 1 or (target is not None and act_rows(target)) else GROUP


@dataclass(frozen=True)
class ActLayout:
    """Byte offsets inside one token group of quantised activations."""

    fmt: str
    K: int

    def __post_init__(self):
        if self.fmt not in _FORMATS:
            raise ValueError(f"unknown activation format {self.fmt!r}; known: {', '.join(_FORMATS)}")
        if self.K % self.block:
            raise ValueError(f"act_quant {self.fmt}: K={self.K} is not a multiple of {self.block}")

    @property
    def block(self) -> int:
        return _FORMATS[self.fmt][0]

    @property
    def sum_block(self) -> int:
        return _FORMATS[self.fmt][1]

    @property
    def has_sums32(self) -> bool:
        return self.sum_block < 32

    @property
    def keeps_s(self) -> bool:
        """True if the sums' words hold ggml's fp16 s = d * sum(q) (q8_1), not integer sums."""
        return self.fmt == "q8_1"

    def used_bytes(self, L: int) -> int:
        """Bytes of a group that hold quants, scales and sums."""
        return L * (self.K + 4 * (self.K // self.block) + 2 * (self.K // self.sum_block)
                    + (2 * (self.K // 32) if self.has_sums32 else 0))

    def group_bytes(self, L: int) -> int:
        """Bytes from one group to the next: used_bytes rounded up to a 64-byte line, so that every
        row of one token (L = 1) starts a line (an AMX tile load reads 64 bytes of each; q8_k at
        K = 2048 takes 2464 bytes, which would leave every other row split across two lines)."""
        return -(-self.used_bytes(L) // 64) * 64

    def qs(self, k: Kernel, L, word, lane=0):
        """Offset of 4-byte word `word` (features 4w..4w+3) of token `lane` in its group."""
        return k.mul(k.add(k.mul(word, L), lane), 4)

    def d(self, k: Kernel, L, block, lane=0):
        return k.add(k.mul(L, self.K), k.mul(k.add(k.mul(block, L), lane), 4))

    def sums(self, k: Kernel, L, sblock, lane=0):
        """Offset of the i16 sum of sum block `sblock` of token `lane`."""
        return k.add(k.mul(L, self.K + 4 * (self.K // self.block)), k.mul(k.add(k.mul(sblock, L), lane), 2))

    def sums32(self, k: Kernel, L, i, lane=0):
        """Offset of the i16 sum of quants 32i..32i+31 of token `lane` (formats with a smaller sum block)."""
        start = self.K + 4 * (self.K // self.block) + 2 * (self.K // self.sum_block)
        return k.add(k.mul(L, start), k.mul(k.add(k.mul(i, L), lane), 2))

    def load_sums(self, k: Kernel, base, L, sblock, n: int | None = None, lane=0) -> ir.Value:
        """The sum at ``sums(sblock, lane)`` as i32, or the n consecutive ones there as <n x i32>."""
        if self.keeps_s:
            raise ValueError(f"act_quant {self.fmt}: keeps s = d*sum(q) as fp16, not integer sums (load_s)")
        typ = i16 if n is None else vec(i16, n)
        return k.b.sext(k.load(typ, base, self.sums(k, L, sblock, lane)), i32 if n is None else vec(i32, n))

    def load_s(self, k: Kernel, isa: Isa, base, L, block, n: int | None = None, lane=0) -> ir.Value:
        """q8_1's s of ``block`` (token ``lane``) as float, or the n consecutive ones there as <n x float>."""
        if not self.keeps_s:
            raise ValueError(f"act_quant {self.fmt}: keeps integer sums, not q8_1's s (load_sums)")
        return isa.f16_to_f32(k.load(i16 if n is None else vec(i16, n), base, self.sums(k, L, block, lane)))


def act_bytes(fmt: str, T: int, K: int, rows_only: bool = False) -> int:
    """Bytes of scratch the quantised activations of T tokens take, on any target: the larger of one
    row per token and groups of 16."""
    lay = ActLayout(fmt, K)
    rows = T * lay.group_bytes(1)
    if rows_only or T == 1:
        return rows
    return max(rows, (T + GROUP - 1) // GROUP * lay.group_bytes(GROUP))


def act_quant(module: ir.Module, fmt: str, K: int, target: Target, rows_only: bool = False) -> str:
    """Emit (once) the quantiser of f32 rows of length K into `fmt` (``rows_only``: one row per
    token at any T, for qmatmul's rows_only kernels); returns its name."""
    lay = ActLayout(fmt, K)
    name = f"act_quant_{fmt}_k{K}{'_rows' if rows_only else ''}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("x", "xq"))
    isa = Isa(k, target)
    row = _quant_row_vector if vector_path(target) else _quant_row_scalar
    if rows_only or act_rows(target):
        _groups(k, isa, lay, 1, row)
        return k.finish()
    T = k.arg["T"]
    with k.b.if_else(k.b.icmp_signed("==", T, k.i64(1))) as (single, many):
        with single:
            _groups(k, isa, lay, 1, row)
        with many:
            _groups(k, isa, lay, GROUP, row)
    return k.finish()


def _groups(k: Kernel, isa: Isa, lay: ActLayout, L: int, row) -> None:
    """Quantise this thread's share of token groups; pad the last group with zeros."""
    T = k.arg["T"]
    n_groups = k.b.sdiv(k.add(T, L - 1), k.i64(L))
    start, end = k.thread_share(n_groups)
    with k.loop(start, end, name="g") as g:
        base = k.addr(k.arg["xq"], k.mul(g, lay.group_bytes(L)))
        with k.loop(0, L, name="lane") as lane:
            t = k.add(k.mul(g, L), lane)
            with k.b.if_else(k.b.icmp_signed("<", t, T)) as (real, pad):
                with real:
                    row(k, isa, lay, L, k.addr(k.arg["x"], k.mul(t, 4 * lay.K)), base, lane)
                with pad:
                    _zero_lane(k, lay, L, base, lane)


def _scales(k: Kernel, lay: ActLayout, amax: ir.Value, isa: Isa) -> tuple[ir.Value, ir.Value]:
    """(d as stored, multiplier) for a block whose largest |x| is amax."""
    b = k.b
    zero = ir.Constant(f32, 0.0)
    nonzero = b.fcmp_unordered("!=", amax, zero)                          # NaN too: d stays NaN
    inv = b.fdiv(ir.Constant(f32, 127.0), amax)
    if lay.fmt in ("q8_0", "q8_1"):
        d = isa.round_f16(b.fdiv(amax, ir.Constant(f32, 127.0)))
    else:
        d = b.select(nonzero, b.fdiv(ir.Constant(f32, 1.0), inv), zero)
    return d, b.select(nonzero, inv, zero)


def _sum_word(k: Kernel, isa: Isa, lay: ActLayout, amax: ir.Value, total: ir.Value) -> ir.Value:
    """The i16 word a sum block stores: its sum of quants, or q8_1's s = (amax/127) * sum as fp16 bits."""
    if not lay.keeps_s:
        return k.b.trunc(total, i16)
    return isa.f32_to_f16(k.b.fmul(k.b.fdiv(amax, ir.Constant(f32, 127.0)), k.b.sitofp(total, f32)))


def _fabs(k: Kernel, v: ir.Value) -> ir.Value:
    suffix = f"v{v.type.count}f32" if isinstance(v.type, ir.VectorType) else "f32"
    return k.intrinsic(f"llvm.fabs.{suffix}", v.type, [v])


def _quant_row_vector(k: Kernel, isa: Isa, lay: ActLayout, L: int, x, base, lane) -> None:
    """One token row, a whole block per step as one wide vector."""
    bs, ss = lay.block, lay.sum_block
    with k.loop(0, lay.K // bs, name="blk") as blk:
        v = k.load(vec(f32, bs), x, k.mul(blk, 4 * bs))                        # (bs,) f32
        amax = isa.hmax(_fabs(k, v), nan=True)
        d, mult = _scales(k, lay, amax, isa)
        q = isa.round_even(k.b.fmul(v, k.splat(mult, bs)))                       # (bs,) i32
        qb = k.b.trunc(q, vec(i8, bs))
        if L == 1:
            k.store(qb, base, k.mul(blk, bs))
        else:
            words = k.cast_vec(qb, i32)                                         # (bs/4,) i32
            for w in range(bs // 4):
                word = k.b.extract_element(words, ir.Constant(i32, w))
                k.store(word, base, lay.qs(k, L, k.add(k.mul(blk, bs // 4), w), lane))
        k.store(d, base, lay.d(k, L, blk, lane))
        totals = [isa.hsum(k.shuffle(q, range(s * ss, (s + 1) * ss))) for s in range(bs // ss)]
        for s, total in enumerate(totals):
            k.store(_sum_word(k, isa, lay, amax, total), base, lay.sums(k, L, k.add(k.mul(blk, bs // ss), s), lane))
        if lay.has_sums32:
            _store_sums32(k, lay, L, base, lane, blk, totals)


def _quant_row_scalar(k: Kernel, isa: Isa, lay: ActLayout, L: int, x, base, lane) -> None:
    """One token row, element by element: the readable spec of the vector version."""
    b = k.b
    bs, ss = lay.block, lay.sum_block
    with k.loop(0, lay.K // bs, name="blk") as blk:
        amax = k.var(f32, 0.0)
        with k.loop(0, bs, name="i") as i:
            xi = k.load(f32, x, k.mul(k.add(k.mul(blk, bs), i), 4))
            amax.set(isa.maximum(amax.get(), _fabs(k, xi)))
        d, mult = _scales(k, lay, amax.get(), isa)
        with k.loop(0, bs // ss, name="s") as s:
            total = k.var(i32, 0)
            with k.loop(0, ss, name="j") as j:
                e = k.add(k.mul(blk, bs), k.mul(s, ss), j)                       # feature index
                q = isa.round_even(b.fmul(k.load(f32, x, k.mul(e, 4)), mult))
                word = b.sdiv(e, k.i64(4))
                offset = k.add(lay.qs(k, L, word, lane), b.srem(e, k.i64(4)))
                k.store(b.trunc(q, i8), base, offset)
                total.set(b.add(total.get(), q))
            k.store(_sum_word(k, isa, lay, amax.get(), total.get()), base,
                    lay.sums(k, L, k.add(k.mul(blk, bs // ss), s), lane))
        k.store(d, base, lay.d(k, L, blk, lane))
        if lay.has_sums32:
            totals = [b.sext(k.load(i16, base, lay.sums(k, L, k.add(k.mul(blk, bs // ss), s), lane)), i32)
                      for s in range(bs // ss)]
            _store_sums32(k, lay, L, base, lane, blk, totals)


def _store_sums32(k: Kernel, lay: ActLayout, L: int, base, lane, blk, totals: list) -> None:
    """The sums of 32 quants of block blk from its sum-block totals (i32 values, in order)."""
    per = 32 // lay.sum_block
    for i in range(lay.block // 32):
        total = totals[i * per]
        for extra in totals[i * per + 1:(i + 1) * per]:
            total = k.b.add(total, extra)
        k.store(k.b.trunc(total, i16), base, lay.sums32(k, L, k.add(k.mul(blk, lay.block // 32), i), lane))


def _zero_lane(k: Kernel, lay: ActLayout, L: int, base, lane) -> None:
    """A padding token: zero quants, scales and sums, so it adds nothing anywhere."""
    zero = ir.Constant(i32, 0)
    with k.loop(0, lay.K // 4, name="w") as w:
        k.store(zero, base, lay.qs(k, L, w, lane))
    with k.loop(0, lay.K // lay.block, name="zb") as blk:
        k.store(ir.Constant(f32, 0.0), base, lay.d(k, L, blk, lane))
    with k.loop(0, lay.K // lay.sum_block, name="zs") as s:
        k.store(ir.Constant(i16, 0), base, lay.sums(k, L, s, lane))
    if lay.has_sums32:
        with k.loop(0, lay.K // 32, name="z32") as s:
            k.store(ir.Constant(i16, 0), base, lay.sums32(k, L, s, lane))

