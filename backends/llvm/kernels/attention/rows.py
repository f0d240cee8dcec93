"""What the attention kernels share: the pointer arguments, where a token's rows are, the rope of
head rows, the causal window and softcap, and pieces of vectors.

Rope angles are computed in the kernel once per position and shared by its rows, as ggml
computes them (and the numpy rule, ``ops.rope_angles_table``): theta_0 = pos, theta_(i+1) =
theta_i * base^(-2/dims) rounded to f32 at each pair, / freq_factors[i], * scale; then sin
and cos of that f32 angle, reduced by pi/2 in f64, times mscale, and the rotation
x0*c - x1*s, x0*s + x1*c with the first product fused (an FMA), as ggml's C compiles.
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.backends.llvm.kernels import vmath
from ggraph.backends.llvm.kernels.attention.params import Attention, Rope
from ggraph.backends.llvm.kernels.builder import Kernel, f32, f64, i32, i64, splat_const, vec
from ggraph.backends.llvm.kernels.isa import Isa, vector_path
from ggraph.backends.llvm.kernels.kv_rows import KVRow
from ggraph.backends.llvm.target import Target


def open_kernel(module, name: str, args: tuple[str, ...]) -> Kernel:
    """A kernel of ``args`` whose last two are the thread pair (ith, nth)."""
    return Kernel(module, name, args[:-2], args[-2:])


def buffer(k: Kernel, n: int):
    """A private f32[n] scratch array (an entry-block alloca); returns its address."""
    return k.scratch(f32, n)


def _chunks(n: int, lanes: int) -> list[tuple[int, int]]:
    """(offset, width) pieces covering n: full vectors, then one narrower tail."""
    out = [(o, lanes) for o in range(0, n - n % lanes, lanes)]
    return out + ([(n - n % lanes, n % lanes)] if n % lanes else [])


def chunked(k: Kernel, n: int, lanes: int, unroll: int, body, name: str = "chunk") -> None:
    """body(offset, widths) over [0, n): a loop taking `unroll` full vectors per step, then the
    remaining vectors and the narrow tail once, statically."""
    step = lanes * unroll
    main = n - n % step
    if main:
        with k.loop(0, main, step=step, name=name) as off:
            body(off, [lanes] * unroll)
    rest = [w for _, w in _chunks(n - main, lanes)]
    if rest:
        body(main, rest)


def typ(w: int) -> ir.Type:
    return f32 if w == 1 else vec(f32, w)


def splat(k: Kernel, x: ir.Value, w: int) -> ir.Value:
    return x if w == 1 else k.splat(x, w)


def zeros(w: int) -> ir.Constant:
    return ir.Constant(f32, 0.0) if w == 1 else splat_const(f32, w, 0.0)


def const_lanes(w: int, x: float) -> ir.Constant:
    return ir.Constant(f32, x) if w == 1 else splat_const(f32, w, x)


def width_of(v: ir.Value) -> int:
    return v.type.count if isinstance(v.type, ir.VectorType) else 1


def extract_lane(k: Kernel, v: ir.Value, i: int) -> ir.Value:
    return v if width_of(v) == 1 else k.b.extract_element(v, ir.Constant(i32, i))


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _scaled(k: Kernel, x: ir.Value, mult: float | None) -> ir.Value:
    return x if mult is None else k.b.fmul(x, vmath.const(x, mult))


class Rows:
    """What the kernels share: the pointer args, the rope of head rows, the vector width."""

    def __init__(self, k: Kernel, target: Target, attn: Attention, rope: Rope | None, name: str):
        self.k, self.b, self.attn, self.rope = k, k.b, attn, rope
        self.isa = Isa(k, target)
        self.vector = vector_path(target)
        self.lanes = self.isa.vector_bytes // 4 if self.vector else 1
        self._angles = None                                              # scratch: one position's angles
        self.ff = k.arg.get("freq_factors")
        self.keys = KVRow(k, self.isa, attn.k_type, attn.D)             # rows of the caches
        self.values = KVRow(k, self.isa, attn.v_type, attn.Dv)

    def row(self, base, index, width: int):
        """Address of row `index` of `width` floats."""
        return self.k.addr(base, self.k.mul(index, 4 * width))

    def angles(self, pos: ir.Value) -> ir.Value:
        """The rope angles of position ``pos`` (f32) in a private f32[dims/2]: ggml's chain, theta_0 = pos
        and theta_(i+1) = theta_i · base^(-2/dims) rounded to f32 (``ops.rope_angles_table``)."""
        k = self.k
        if self._angles is None:
            self._angles = k.scratch(f32, self.rope.dims // 2)
        with vmath.rope_angles(k, pos, self.rope.dims, self.rope.base) as (i, theta):
            k.store(theta, self._angles, k.mul(i, 4))
        return self._angles

    def position(self, t) -> ir.Value:
        """positions[t] as f32, as ggml's rope takes it ((float)p): the first angle of token t."""
        return self.b.sitofp(self._position(t), f32)

    def _position(self, t) -> ir.Value:
        return self.k.load(i32, self.k.arg["positions"], self.k.mul(t, 4))

    def token(self, t) -> tuple[ir.Value, ir.Value, ir.Value]:
        """(p, k_cache, v_cache) for token t: its position in its sequence, and where that sequence's
        rows start (P + t and the caches; slotted: positions[t] and the rows of slot seq[t])."""
        k, b = self.k, self.b
        if not self.attn.slot_rows:
            return k.add(k.arg["P"], t), k.arg["k_cache"], k.arg["v_cache"]
        seq = b.sext(k.load(i32, k.arg["seq"], k.mul(t, 4)), i64)
        first = k.mul(seq, self.attn.slot_rows * self.attn.Hkv)
        return (b.sext(self._position(t), i64), self.keys.at(k.arg["k_cache"], first),
                self.values.at(k.arg["v_cache"], first))

    def rope_rows(self, pairs: list, pos: ir.Value, mult: float | None) -> None:
        """dst[0:D] = rope(src[0:D]) * mult for each (src, dst), all at position pos: the angles,
        sin and cos are computed once per chunk of pairs and shared by the rows."""
        k, b, rope, lanes = self.k, self.b, self.rope, self.lanes
        start = 0
        if rope is not None:
            half, m = rope.dims // 2, rope.mscale * (1.0 if mult is None else mult)
            angles = self.angles(pos)

            def rotate(off, widths):
                o = 0
                for w in widths:
                    i0 = k.add(off, o)
                    theta = k.load(typ(w), angles, k.mul(i0, 4))
                    if self.ff is not None:
                        theta = b.fdiv(theta, k.load(typ(w), self.ff, k.mul(i0, 4)))
                    if rope.scale != 1.0:
                        theta = b.fmul(theta, vmath.const(theta, rope.scale))
                    theta = b.fpext(theta, f64 if w == 1 else vec(f64, w))          # exact: sin, cos to f32
                    if self.vector:
                        s, c = vmath.sincos_f64(self.isa, theta)
                    else:
                        s, c = (b.fptrunc(self.k.intrinsic(f"llvm.{f}.f64", f64, [theta]), f32) for f in ("sin", "cos"))
                    if m != 1.0:
                        s, c = b.fmul(s, vmath.const(s, m)), b.fmul(c, vmath.const(c, m))
                    for src, dst in pairs:                       # ggml's x0·c − x1·s, x0·s + x1·c, contracted
                        x0, x1 = self._pair(src, i0, w)
                        self._store_pair(dst, i0, w, self.isa.fused(x0, c, b.fneg(b.fmul(x1, s))),
                                         self.isa.fused(x0, s, b.fmul(x1, c)))
                    o += w
            chunked(k, half, lanes, 1, rotate, "pair")
            start = rope.dims

        def copy(off, widths):
            o = 0
            for w in widths:
                i = k.add(off, start + o)
                for src, dst in pairs:
                    k.store(_scaled(k, k.load(typ(w), src, k.mul(i, 4)), mult), dst, k.mul(i, 4))
                o += w
        if self.attn.D > start:
            chunked(k, self.attn.D - start, lanes, 1, copy, "keep")

    def _pair(self, src, i0, w: int) -> tuple[ir.Value, ir.Value]:
        """The w rotation pairs from pair index i0: neox (i, i + dims/2), interleaved (2i, 2i+1)."""
        k, half = self.k, self.rope.dims // 2
        if self.rope.style == "neox":
            return k.load(typ(w), src, k.mul(i0, 4)), k.load(typ(w), src, k.mul(k.add(i0, half), 4))
        if w == 1:
            return k.load(f32, src, k.mul(i0, 8)), k.load(f32, src, k.add(k.mul(i0, 8), 4))
        x = k.load(vec(f32, 2 * w), src, k.mul(i0, 8))
        return k.shuffle(x, range(0, 2 * w, 2)), k.shuffle(x, range(1, 2 * w, 2))

    def _store_pair(self, dst, i0, w: int, r0: ir.Value, r1: ir.Value) -> None:
        k, half = self.k, self.rope.dims // 2
        if self.rope.style == "neox":
            k.store(r0, dst, k.mul(i0, 4))
            k.store(r1, dst, k.mul(k.add(i0, half), 4))
        elif w == 1:
            k.store(r0, dst, k.mul(i0, 8))
            k.store(r1, dst, k.add(k.mul(i0, 8), 4))
        else:
            k.store(k.shuffle(r0, [j // 2 + (j % 2) * w for j in range(2 * w)], r1), dst, k.mul(i0, 8))


def key_range(rows: Rows, p) -> tuple[ir.Value, ir.Value]:
    """[lo, hi) of the keys visible from position p: causal, and inside the window."""
    k, b, window = rows.k, rows.b, rows.attn.window
    lo = k.i64(0)
    if window is not None:
        lo = k.add(p, 1 - window)
        lo = b.select(b.icmp_signed("<", lo, k.i64(0)), k.i64(0), lo)
    return lo, k.add(p, 1)


def softcap(rows: Rows, s: ir.Value) -> ir.Value:
    """c * tanh(s / c) (s unchanged without a softcap)."""
    c = rows.attn.softcap
    if c is None:
        return s
    b = rows.b
    th = vmath.unary(rows.isa, "tanh", b.fmul(s, vmath.const(s, 1.0 / c)), rows.vector)
    return b.fmul(th, vmath.const(s, c))
