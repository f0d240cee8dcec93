"""The only place kernels get instructions from: each method emits generic IR that LLVM
lowers for any target, or names a target intrinsic only after checking the feature.

Asking for something the target cannot do raises ValueError naming the feature before
any IR is emitted, so a kernel can never carry an instruction its CPU lacks (LLVM
aborts the whole process on such an intrinsic).
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.backends.llvm.kernels import amx
from ggraph.backends.llvm.kernels.builder import Kernel, f16, f32, i1, i8, i16, i32, mangle, splat_const, vec
from ggraph.backends.llvm.target import Target


def _const_like(v: ir.Value, elem: ir.Type, value) -> ir.Constant:
    """A constant of v's shape (scalar or vector) with element type `elem`."""
    if isinstance(v.type, ir.VectorType):
        return splat_const(elem, v.type.count, value)
    return ir.Constant(elem, value)


def _like(v: ir.Value, elem: ir.Type) -> ir.Type:
    return vec(elem, v.type.count) if isinstance(v.type, ir.VectorType) else elem


# u8 x s8 -> i32 dot products: (feature, bytes per instruction) -> intrinsic
_VPDPBUSD = {64: "llvm.x86.avx512.vpdpbusd.512", 32: "llvm.x86.avx512.vpdpbusd.256",
             16: "llvm.x86.avx512.vpdpbusd.128"}
_PMADDUBSW = {("avx512bw", 64): ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512"),
              ("avx2", 32): ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"),
              ("ssse3", 16): ("llvm.x86.ssse3.pmadd.ub.sw.128", "llvm.x86.sse2.pmadd.wd")}
_PSHUFB = {("avx512bw", 64): "llvm.x86.avx512.pshuf.b.512", ("avx2", 32): "llvm.x86.avx2.pshuf.b",
           ("ssse3", 16): "llvm.x86.ssse3.pshuf.b.128"}


def _bit_matrix(shift: int, width: int, to: int) -> list[int]:
    """vgf2p8affineqb's 8 matrix bytes that move a byte's bits shift.. to to.. (width of them): output
    bit i is the parity of (input & matrix byte 7-i)."""
    rows = [0] * 8
    for i in range(width):
        rows[7 - (to + i)] = 1 << (shift + i)
    return rows


# lanes of f32 partial sums in the generic twins' dot products (portable IR vectors that LLVM splits
# into baseline registers): the order of llama.cpp's f32 matmul on AVX-512 and of ggraph's kernels there
PORTABLE_LANES = 16


def vector_path(target: Target) -> bool:
    """True if kernels use their vector emitters; baseline x86 gets the scalar twins."""
    return target.arch != "x86_64" or target.has("avx2")


class Isa:
    """Instruction choices for one target, emitting into one kernel."""

    def __init__(self, k: Kernel, target: Target):
        self.k, self.t = k, target
        self.is_x86 = target.arch == "x86_64"

    # -- capabilities ---------------------------------------------------------------
    @property
    def vector_bytes(self) -> int:
        return self.t.vector_bits // 8

    @property
    def full_u8_dot(self) -> bool:
        """True if u8 x s8 dots take the whole u8 range (VNNI has no i16 saturation)."""
        return self.t.has("avx512vnni")

    def tile(self, op: str, *args) -> None:
        """One AMX instruction (``amx.tile_op``: tile registers as ints, addresses), on a target with
        AMX tiles (tdpbssd: with their int8 multiplies)."""
        self.t.require("amx-int8" if op.startswith("tdp") else "amx-tile", f"AMX {op}")
        amx.tile_op(self.k, op, *args)

    # -- float helpers ---------------------------------------------------------------
    def fma(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        """a*b + c, fused where the target has FMA (llvm.fmuladd)."""
        return self.k.intrinsic(f"llvm.fmuladd.{mangle(a.type)}", a.type, [a, b, c])

    def fused(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        """a*b + c rounded once on every target (llvm.fma: the instruction, or libm's fma where the
        target lacks it), for arithmetic that must give the bits of C compiled with FMA."""
        return self.k.intrinsic(f"llvm.fma.{mangle(a.type)}", a.type, [a, b, c])

    def maxnum(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.k.intrinsic(f"llvm.maxnum.{mangle(a.type)}", a.type, [a, b])

    def maximum(self, a: ir.Value, b: ir.Value) -> ir.Value:
        """The larger of a and b, NaN if either is (maxnum would take the other)."""
        return self.k.intrinsic(f"llvm.maximum.{mangle(a.type)}", a.type, [a, b])

    def _tree(self, v: ir.Value, op) -> ir.Value:
        k = self.k
        while v.type.count > 1:
            n = v.type.count // 2
            v = op(k.shuffle(v, range(n)), k.shuffle(v, range(n, 2 * n)))
        return k.b.extract_element(v, ir.Constant(i32, 0))

    def hsum(self, v: ir.Value) -> ir.Value:
        """Sum of a vector's lanes, by halving (a fixed order)."""
        add = self.k.b.fadd if isinstance(v.type.element, ir.FloatType) else self.k.b.add
        return self._tree(v, add)

    def hmax(self, v: ir.Value, nan: bool = False) -> ir.Value:
        """Largest lane of a float vector; with ``nan``, NaN if any lane is."""
        return self._tree(v, self.maximum if nan else self.maxnum)

    def round_even(self, v: ir.Value) -> ir.Value:
        """Nearest integer (ties to even) of |v| < 2**22 as i32: ggml's nearest_int."""
        b = self.k.b
        magic = b.fadd(v, _const_like(v, f32, 12582912.0))
        as_int = b.bitcast(magic, _like(v, i32))
        return b.sub(b.and_(as_int, _const_like(v, i32, 0x7FFFFF)), _const_like(v, i32, 0x400000))

    def f16_to_f32(self, h: ir.Value) -> ir.Value:
        """IEEE half bits (i16 or <n x i16>) to float: vcvtph2ps with F16C, integer ops without."""
        b = self.k.b
        if self.t.has("f16c") or not self.is_x86:
            return b.fpext(b.bitcast(h, _like(h, f16)), _like(h, f32))
        w = b.zext(h, _like(h, i32))
        em = b.and_(w, _const_like(w, i32, 0x7FFF))
        shifted = b.shl(em, _const_like(w, i32, 13))
        finite = b.fmul(b.bitcast(shifted, _like(h, f32)), _const_like(w, f32, 2.0 ** 112))
        special = b.bitcast(b.or_(shifted, _const_like(w, i32, 0x7F800000)), _like(h, f32))
        is_special = b.icmp_unsigned(">=", em, _const_like(w, i32, 0x7C00))
        mag = b.bitcast(b.select(is_special, special, finite), _like(h, i32))
        sign = b.shl(b.and_(w, _const_like(w, i32, 0x8000)), _const_like(w, i32, 16))
        return b.bitcast(b.or_(mag, sign), _like(h, f32))

    def f32_to_f16(self, x: ir.Value) -> ir.Value:
        """float to IEEE half bits, round to nearest even (vcvtps2ph with F16C)."""
        b = self.k.b
        if self.t.has("f16c") or not self.is_x86:
            return b.bitcast(b.fptrunc(x, _like(x, f16)), _like(x, i16))
        c = lambda value: _const_like(x, i32, value)  # noqa: E731
        u = b.bitcast(x, _like(x, i32))
        sign = b.and_(u, c(0x80000000))
        a = b.xor(u, sign)
        # overflow to inf, NaN to a quiet NaN
        big = b.select(b.icmp_unsigned(">", a, c(255 << 23)), c(0x7E00), c(0x7C00))
        # results below the smallest normal half: let the FPU round in a shifted range
        magic = c(((127 - 15) + (23 - 10) + 1) << 23)
        small = b.sub(b.bitcast(b.fadd(b.bitcast(a, _like(x, f32)), b.bitcast(magic, _like(x, f32))),
                                _like(x, i32)), magic)
        # normal halves: rebias the exponent and round the dropped 13 bits to even
        odd = b.and_(b.lshr(a, c(13)), c(1))
        normal = b.lshr(b.add(b.add(a, c(((15 - 127) << 23) + 0xFFF)), odd), c(13))
        out = b.select(b.icmp_unsigned("<", a, c(113 << 23)), small, normal)
        out = b.select(b.icmp_unsigned(">=", a, c((127 + 16) << 23)), big, out)
        out = b.or_(out, b.lshr(sign, c(16)))
        return b.trunc(out, _like(x, i16))

    def round_f16(self, x: ir.Value) -> ir.Value:
        """x rounded to the nearest half-precision value, as float."""
        return self.f16_to_f32(self.f32_to_f16(x))

    def bf16_to_f32(self, h: ir.Value) -> ir.Value:
        """bfloat16 bits to float: the bits are the top half of an f32."""
        b = self.k.b
        w = b.shl(b.zext(h, _like(h, i32)), _const_like(h, i32, 16))
        return b.bitcast(w, _like(h, f32))

    # -- integer dot products -------------------------------------------------------------
    def dot(self, acc: ir.Value, a: ir.Value, b: ir.Value, signed: bool, amax: int = 255) -> ir.Value:
        """acc[j] + sum(a[4j+i] * b[4j+i] for i < 4): a is u8 (<= amax) or s8; b is s8 in [-127, 127]."""
        n = a.type.count
        if self.full_u8_dot:                                   # vpdpbusd: u8 x s8, no saturation
            if signed:
                a, b = self._sign_trick(a, b)
            return self._pieces(acc, a, b, min(n, self.vector_bytes), self._vpdpbusd)
        width = self._maddubs_width(n)
        if width:                                              # pmaddubsw saturates pairs at i16
            if signed:
                a, b = self._sign_trick(a, b)
            elif amax > 127:
                self.t.require("avx512vnni", f"a u8 x s8 dot with u8 values up to {amax}")
            return self._pieces(acc, a, b, width, self._maddubs)
        if self.t.has("dotprod") and (signed or amax <= 127) and n % 16 == 0:
            return self._pieces(acc, a, b, 16, self._sdot)      # sdot: s8 x s8
        return self._dot_generic(acc, a, b, signed)

    def dot_pairs(self, acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
        """acc[j] + a[2j]*b[2j] + a[2j+1]*b[2j+1] for i32 lanes of acc and i16 pairs of a and b
        (vpdpwssd with AVX-512 VNNI, no saturation; the portable form elsewhere)."""
        k = self.k
        n = acc.type.count
        if self.full_u8_dot and n in (8, 16):
            return k.intrinsic(f"llvm.x86.avx512.vpdpwssd.{32 * n}", acc.type, [acc, a, b])
        wide = vec(i32, 2 * n)
        prod = k.b.mul(k.b.sext(a, wide), k.b.sext(b, wide))
        return k.b.add(acc, k.b.add(k.shuffle(prod, range(0, 2 * n, 2)), k.shuffle(prod, range(1, 2 * n, 2))))

    def pack_i32(self, a: ir.Value, b: ir.Value) -> ir.Value:
        """Two <16 x i32> whose lanes fit i16 as one <32 x i16>, in vpackssdw's order: per 128-bit lane
        q, a's lanes 4q..4q+3 then b's."""
        self.t.require("avx512bw", "packing i32 lanes to i16 words (vpackssdw)")
        return self.k.intrinsic("llvm.x86.avx512.packssdw.512", vec(i16, 32), [a, b])

    def i16_run(self, signed: bool, amax: int, nbytes: int) -> int:
        """How many u8 x s8 dots of ``nbytes`` may add their i16 pair sums (``pair_sums``) before
        ``widen`` must take them to i32, where pmaddubsw does the work and a's bytes are small
        unsigned levels: a pair of a q5 level (<= 31) times activations (>= -128) is at least
        -2 * 31 * 128 = -7936, so four fit in i16. 1 otherwise, and then ``dot`` is the way."""
        if signed or self.full_u8_dot or not self._maddubs_width(nbytes):
            return 1
        return max(1, 32768 // (2 * 128 * max(amax, 1)))

    def pair_sums(self, a: ir.Value, b: ir.Value, total: list | None = None) -> list:
        """``total`` (pieces of i16 pair sums, or None) plus pmaddubsw(a, b), piece by piece."""
        k = self.k
        width = self._maddubs_width(a.type.count)
        maddubs = self._pmaddubsw(width)[0]
        pieces = [k.intrinsic(maddubs, vec(i16, width // 2), [x, y])
                  for x, y in zip(k.split(a, a.type.count // width), k.split(b, a.type.count // width))]
        return pieces if total is None else [k.b.add(t, p) for t, p in zip(total, pieces)]

    def widen(self, acc: ir.Value, total: list) -> ir.Value:
        """acc (i32 lanes) plus the i16 pair sums of ``total`` added in pairs (pmaddwd by ones)."""
        k = self.k
        width = 2 * total[0].type.count
        maddwd = self._pmaddubsw(width)[1]
        quads = [k.intrinsic(maddwd, vec(i32, width // 4), [t, splat_const(i16, width // 2, 1)]) for t in total]
        return k.b.add(acc, k.concat(*quads))

    def _pmaddubsw(self, width: int) -> tuple[str, str]:
        """The (pmaddubsw, pmaddwd) intrinsics for ``width``-byte vectors; the target must have them."""
        feature = {64: "avx512bw", 32: "avx2", 16: "ssse3"}[width]
        self.t.require(feature, f"a {width}-byte pmaddubsw")
        return _PMADDUBSW[(feature, width)]

    def _pieces(self, acc, a, b, width: int, emit) -> ir.Value:
        k = self.k
        parts = a.type.count // width
        return k.concat(*[emit(c, x, y) for c, x, y in
                          zip(k.split(acc, parts), k.split(a, parts), k.split(b, parts))])

    def _sign_trick(self, a: ir.Value, b: ir.Value) -> tuple[ir.Value, ir.Value]:
        """|a| as u8 and b with a's sign: the same products, now u8 x s8."""
        k = self.k
        absa = k.intrinsic(f"llvm.abs.{mangle(a.type)}", a.type, [a, ir.Constant(i1, 0)])
        neg = k.b.icmp_signed("<", a, _const_like(a, i8, 0))
        return absa, k.b.select(neg, k.b.sub(_const_like(b, i8, 0), b), b)

    def _maddubs_width(self, n: int) -> int | None:
        """The widest pmaddubsw this target has that divides n bytes."""
        for (feature, width) in _PMADDUBSW:
            if self.is_x86 and self.t.has(feature) and n % width == 0:
                return width
        return None

    def _vpdpbusd(self, acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
        self.t.require("avx512vnni", "vpdpbusd")
        if a.type.count < 64:
            self.t.require("avx512vl", f"a {a.type.count}-byte vpdpbusd")
        return self.k.intrinsic(_VPDPBUSD[a.type.count], acc.type, [acc, a, b])

    def _maddubs(self, acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.widen(acc, self.pair_sums(a, b))

    def _sdot(self, acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
        self.t.require("dotprod", "sdot")
        return self.k.intrinsic("llvm.aarch64.neon.sdot.v4i32.v16i8", acc.type, [acc, a, b])

    def mmla(self, acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
        """acc (<4 x i32>, a 2x2 matrix by rows) + a·bᵀ, where a and b are <16 x i8> 2x8 matrices by rows
        (s8 x s8): smmla, ARMv8.6's int8 matrix multiply."""
        self.t.require("i8mm", "smmla")
        return self.k.intrinsic("llvm.aarch64.neon.smmla.v4i32.v16i8", acc.type, [acc, a, b])

    def _dot_generic(self, acc: ir.Value, a: ir.Value, b: ir.Value, signed: bool) -> ir.Value:
        """The portable form: widen, multiply, add groups of four."""
        k = self.k
        n = a.type.count
        wide = vec(i32, n)
        prod = k.b.mul(k.b.sext(a, wide) if signed else k.b.zext(a, wide), k.b.sext(b, wide))
        quad = [k.shuffle(prod, range(i, n, 4)) for i in range(4)]
        return k.b.add(acc, k.b.add(k.b.add(quad[0], quad[1]), k.b.add(quad[2], quad[3])))

    # -- nibbles and table lookup ------------------------------------------------------------
    def nibbles(self, v: ir.Value, high: list[bool]) -> ir.Value:
        """Each byte's high nibble where ``high[q]`` holds for its 8-byte qword q, else its low one, as
        bytes 0..15: one vgf2p8affineqb with GFNI (a bit matrix per qword), else a word shift and a mask."""
        k, b = self.k, self.k.b
        n = v.type.count
        if len(high) * 8 != n:
            raise ValueError(f"nibbles: {len(high)} qword choices for {n} bytes")
        if self._affine(n):
            rows = {h: _bit_matrix(4 * h, 4, 0) for h in (False, True)}
            return self._affine_bytes(v, [r for h in high for r in rows[h]])
        words = k.cast_vec(v, i16)
        shifted = b.lshr(words, ir.Constant(words.type, [4 if high[w // 4] else 0 for w in range(n // 2)]))
        return b.and_(k.cast_vec(shifted, i8), ir.Constant(v.type, [0x0F] * n))

    def byte_bits(self, v: ir.Value, shift: int, width: int, to: int) -> ir.Value:
        """Each byte's bits shift..shift+width-1 moved to bits to..to+width-1, the others zero: a mask
        where they stay in place, else one vgf2p8affineqb with GFNI, a word shift and a mask without."""
        k, b = self.k, self.k.b
        n = v.type.count
        mask = ir.Constant(v.type, [((1 << width) - 1) << to] * n)
        if shift == to:
            return b.and_(v, mask)
        if self._affine(n):
            return self._affine_bytes(v, _bit_matrix(shift, width, to) * (n // 8))
        words = k.cast_vec(v, i16)
        by = ir.Constant(words.type, [abs(shift - to)] * (n // 2))
        return b.and_(k.cast_vec(b.lshr(words, by) if shift > to else b.shl(words, by), i8), mask)

    def _affine(self, n: int) -> bool:
        """True if vgf2p8affineqb takes n bytes on this target."""
        return self.is_x86 and self.t.has("gfni") and n in (16, 32, 64) and (n < 64 or self.t.has("avx512bw"))

    def _affine_bytes(self, v: ir.Value, matrix: list[int]) -> ir.Value:
        n = v.type.count
        return self.k.intrinsic(f"llvm.x86.vgf2p8affineqb.{8 * n}", vec(i8, n),
                                [v, ir.Constant(vec(i8, n), matrix), ir.Constant(i8, 0)])

    def lookup16(self, table: list[int], idx: ir.Value) -> ir.Value:
        """table[idx[i]] for a 16-entry byte table and indices in 0..15 (pshufb)."""
        k = self.k
        n = idx.type.count
        for (feature, width), name in _PSHUFB.items():
            if self.is_x86 and self.t.has(feature) and n % width == 0:
                tbl = ir.Constant(vec(i8, width), [v & 0xFF for v in table] * (width // 16))
                return k.concat(*[k.intrinsic(name, vec(i8, width), [tbl, part])
                                  for part in k.split(idx, n // width)])
        if self.t.has("neon") and n % 16 == 0:
            tbl = ir.Constant(vec(i8, 16), [v & 0xFF for v in table])
            return k.concat(*[k.intrinsic("llvm.aarch64.neon.tbl1.v16i8", vec(i8, 16), [tbl, part])
                              for part in k.split(idx, n // 16)])
        self.t.require("ssse3", "a 16-entry byte table lookup (pshufb)")
        raise ValueError(f"no {n}-byte table lookup on target '{self.t.name}'")
