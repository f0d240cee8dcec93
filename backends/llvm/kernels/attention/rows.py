"""What the attention kernels share: the pointer arguments, where a token's rows are, the rope of
head rows, the causal window and chunk, softcap and the traced score and mask mods, and pieces of vectors.

Rope angles are computed in the kernel once per position and shared by its rows, as ggml
computes them (and the numpy rule, ``ops.rope_angles_table``): theta_0 = pos, theta_(i+1) =
theta_i * base^(-2/dims) rounded to f32 at each pair, / freq_factors[i], * scale; then sin
and cos of that f32 angle, reduced by pi/2 in f64, times mscale, and the rotation
x0*c - x1*s, x0*s + x1*c with the first product fused (an FMA), as ggml's C compiles.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ggraph.backends.llvm.kernels import vmath
from ggraph.backends.llvm.kernels.attention.params import Attention, Rope
from ggraph.backends.llvm.kernels.builder import Kernel, f32, f64, i32, i64, splat_const, vec
from ggraph.backends.llvm.kernels.elementwise import Evaluator
from ggraph.backends.llvm.kernels.isa import Isa, vector_path
from ggraph.backends.llvm.kernels.kv_rows import KVRow
from ggraph.backends.llvm.target import Target
from ggraph.ir.graph import Var


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


def first_lanes(k: Kernel, values: list, w: int, pad: float) -> ir.Value:
    """f32 scalars in the first lanes of a w-lane register, ``pad`` in the rest (a scalar when w is 1)."""
    if w == 1:
        return values[0]
    v = const_lanes(w, pad)
    for i, x in enumerate(values):
        v = k.b.insert_element(v, x, ir.Constant(i32, i))
    return v


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

    @property
    def mods(self) -> bool:
        """Whether scores need their indices (a score_mod or mask_mod is emitted inline)."""
        return self.attn.score_mod is not None or self.attn.mask_mod is not None

    def batch(self, t) -> ir.Value:
        """Token t's sequence slot as a mod's b (i32; 0 without slots)."""
        if not self.attn.slot_rows:
            return ir.Constant(i32, 0)
        return self.k.load(i32, self.k.arg["seq"], self.k.mul(t, 4))

    def sink(self, h) -> ir.Value:
        """Head h's sink logit (f32)."""
        return self.k.load(f32, self.k.arg["sinks"], self.k.mul(h, 4))

    def inverse(self, total: ir.Value) -> ir.Value:
        """1 / total, as the output's scale; 0 where a mask_mod left a row no key (total 0): zeros out."""
        b = self.b
        inv = b.fdiv(vmath.const(total, 1.0), total)
        if self.attn.mask_mod is None:
            return inv
        return b.select(b.fcmp_ordered(">", total, vmath.const(total, 0.0)), inv, vmath.const(total, 0.0))

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
    """[lo, hi) of the keys visible from position p: causal, inside the window, in p's chunk."""
    k, b, attn = rows.k, rows.b, rows.attn
    lo = k.i64(0)
    if attn.window is not None:
        lo = k.add(p, 1 - attn.window)
        lo = b.select(b.icmp_signed("<", lo, k.i64(0)), k.i64(0), lo)
    if attn.chunk is not None:                                     # p - p % C: positions are never negative
        start = b.sub(p, b.srem(p, k.i64(attn.chunk)))
        lo = b.select(b.icmp_signed(">", start, lo), start, lo)
    return lo, k.add(p, 1)


@dataclass
class At:
    """What a block of scores stands for, as i32 scalars (alike in every lane) or vectors of lanes:
    the sequence slot b, the query head h, the query's position q and the key's kv."""

    b: ir.Value
    h: ir.Value
    q: ir.Value
    kv: ir.Value


def i32_of(k: Kernel, v) -> ir.Value:
    """An i64 index (scalar or vector) as the i32 a mod's graph takes."""
    t = v.type.element if isinstance(v.type, ir.VectorType) else v.type
    if t.width == 32:
        return v
    return k.b.trunc(v, vec(i32, v.type.count) if isinstance(v.type, ir.VectorType) else i32)


def modded(rows: Rows, s: ir.Value, at: At | None) -> ir.Value:
    """The scores after softcap c * tanh(s / c) and the score_mod (unchanged without them)."""
    c = rows.attn.softcap
    if c is not None:
        b = rows.b
        th = vmath.unary(rows.isa, "tanh", b.fmul(s, vmath.const(s, 1.0 / c)), rows.vector)
        s = b.fmul(th, vmath.const(s, c))
    if rows.attn.score_mod is not None:
        s = _emit_mod(rows, rows.attn.score_mod, (s, at.b, at.h, at.q, at.kv), width_of(s))
    return s


def seen(rows: Rows, at: At, w: int) -> ir.Value | None:
    """Where the mask_mod lets the queries see the key (i1 in w lanes), or None without one."""
    if rows.attn.mask_mod is None:
        return None
    m = _emit_mod(rows, rows.attn.mask_mod, (at.b, at.h, at.q, at.kv), w)
    return rows.b.icmp_signed("!=", m, ir.Constant(m.type, [0] * w if w > 1 else 0))


def _emit_mod(rows: Rows, mod, args, w: int) -> ir.Value:
    """A mod's graph on registers of w lanes, each op by its emit rule (as fused loops apply them)."""
    k = rows.k
    ev = Evaluator(k, rows.isa, rows.vector)

    def lanes(v):
        return k.splat(v, w) if w > 1 and not isinstance(v.type, ir.VectorType) else v

    def literal(a):
        reg = f32 if a.aval.dtype.is_float else ir.IntType(a.aval.dtype.type_size * 8)
        v = float(a.value) if reg is f32 else int(a.value)
        return ir.Constant(reg, v) if w == 1 else ir.Constant(vec(reg, w), [v] * w)
    env = {v: lanes(a) for v, a in zip(mod.graph.invars, args)}
    for e in mod.graph.eqns:
        if e.prim.emit is None:
            raise ValueError(f"llvm backend: op {e.prim.name} of {mod.kind} {mod} has no llvm emitter")
        env[e.outputs[0]] = ev.apply(e, [env[a] if isinstance(a, Var) else literal(a) for a in e.inputs])
    out = mod.graph.outvars[0]
    return env[out] if isinstance(out, Var) else literal(out)
