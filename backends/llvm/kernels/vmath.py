"""Float math for kernels: exp, log, tanh, sin, cos as plain LLVM IR, for f32 scalars or
vectors of any width.

LLVM lowers `llvm.exp.v16f32` and friends to one libm call per lane, so vector kernels use
the polynomial forms here: range reduction, a Cephes single-precision polynomial, and
selects for the special values (exp(-inf) = 0, tanh saturates to ±1, log(0) = -inf,
NaN in gives NaN out). Against float64 numpy the relative error stays under 1.5e-7
(about 2 ulp) over the ranges models hit. sin and cos (`sincos_f64`, and `sincos` for f32
angles, which gives NaN past 2**22) reduce and evaluate their polynomials in f64, so their
f32 results are the correctly rounded ones but in rare near-ties, for angles into the
hundreds of thousands.
The scalar generic twins call libm through LLVM's intrinsics instead (`libm`).

    y = vmath.unary(isa, "tanh", x, poly=vector_path(target))
"""
from __future__ import annotations

import math
from contextlib import contextmanager

from llvmlite import ir

from ggraph.backends.llvm.kernels.builder import Kernel, f32, i32, mangle, splat_const, vec
from ggraph.backends.llvm.kernels.isa import Isa
from ggraph.ir.composites import rope_theta_scale

_MAGIC = 12582912.0              # 1.5 * 2**23: adding it rounds |v| < 2**22 to an integer


def const(x: ir.Value, value, elem: ir.Type = f32) -> ir.Constant:
    """A constant shaped like x (scalar or vector), with lanes of type `elem`."""
    if isinstance(x.type, ir.VectorType):
        return splat_const(elem, x.type.count, value)
    return ir.Constant(elem, value)


def like(x: ir.Value, elem: ir.Type) -> ir.Type:
    """x's shape (scalar or vector) with lanes of type `elem`."""
    return vec(elem, x.type.count) if isinstance(x.type, ir.VectorType) else elem


def _call(isa: Isa, name: str, *args: ir.Value) -> ir.Value:
    return isa.k.intrinsic(f"llvm.{name}.{mangle(args[0].type)}", args[0].type, list(args))


def horner(isa: Isa, x: ir.Value, coefs, elem: ir.Type = f32) -> ir.Value:
    """c0*x^n + c1*x^(n-1) + ... + cn, by fused multiply-adds."""
    acc = const(x, coefs[0], elem)
    for c in coefs[1:]:
        acc = isa.fma(acc, x, const(x, c, elem))
    return acc


def _round(isa: Isa, v: ir.Value) -> tuple[ir.Value, ir.Value]:
    """v rounded to the nearest integer, as (float, i32), for |v| < 2**22."""
    b = isa.k.b
    t = b.fadd(v, const(v, _MAGIC))
    n = b.sub(b.bitcast(t, like(v, i32)), b.bitcast(const(v, _MAGIC), like(v, i32)))
    return b.fsub(t, const(v, _MAGIC)), n


def _pow2(isa: Isa, n: ir.Value, x: ir.Value) -> ir.Value:
    """2**n as f32 for integer n in [-126, 127] (lanes of n are i32)."""
    b = isa.k.b
    return b.bitcast(b.shl(b.add(n, const(x, 127, i32)), const(x, 23, i32)), like(x, f32))


# -- exp --------------------------------------------------------------------------------------
_EXP_HI, _EXP_LO = 88.72283935546875, -103.97208404541016    # beyond: inf, and 0 (below subnormals)
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4               # ln 2 = HI + LO; HI has 9 bits
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
             1.6666665459e-1, 5.0000001201e-1)


def exp(isa: Isa, x: ir.Value) -> ir.Value:
    """e**x: x = n ln2 + r with |r| <= ln2/2, e**r by polynomial, 2**n in two halves."""
    b = isa.k.b
    xc = _call(isa, "minnum", _call(isa, "maxnum", x, const(x, _EXP_LO)), const(x, _EXP_HI))
    nf, n = _round(isa, b.fmul(xc, const(x, 1.0 / math.log(2.0))))
    r = isa.fma(nf, const(x, -_LN2_HI), xc)
    r = isa.fma(nf, const(x, -_LN2_LO), r)
    p = b.fadd(isa.fma(horner(isa, r, _EXP_POLY), b.fmul(r, r), r), const(x, 1.0))
    n1 = b.ashr(n, const(x, 1, i32))                          # 2**n = 2**n1 * 2**(n - n1): no overflow
    y = b.fmul(b.fmul(p, _pow2(isa, n1, x)), _pow2(isa, b.sub(n, n1), x))
    y = b.select(b.fcmp_ordered(">", x, const(x, _EXP_HI)), const(x, math.inf), y)
    y = b.select(b.fcmp_ordered("<", x, const(x, _EXP_LO)), const(x, 0.0), y)
    return b.select(b.fcmp_unordered("uno", x, x), x, y)


# -- log --------------------------------------------------------------------------------------
_LOG_POLY = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
             -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)


def log(isa: Isa, x: ir.Value) -> ir.Value:
    """ln x: x = m 2**e with m in [sqrt(.5), sqrt(2)), ln(m) by polynomial in m - 1."""
    b = isa.k.b
    ity = like(x, i32)
    tiny = b.fcmp_ordered("<", x, const(x, 1.17549435e-38))    # subnormals: scale up by 2**23 first
    xs = b.select(tiny, b.fmul(x, const(x, 8388608.0)), x)
    bits = b.bitcast(xs, ity)
    e = b.sub(b.lshr(bits, const(x, 23, i32)), b.select(tiny, const(x, 126 + 23, i32), const(x, 126, i32)))
    m = b.bitcast(b.or_(b.and_(bits, const(x, 0x007FFFFF, i32)), const(x, 0x3F000000, i32)), x.type)
    low = b.fcmp_ordered("<", m, const(x, 0.70710678118654752))
    e = b.sub(e, b.zext(low, ity))                            # m in [.5, 1): move the low half up
    m = b.fsub(b.select(low, b.fadd(m, m), m), const(x, 1.0))
    ef = b.sitofp(e, x.type)
    z = b.fmul(m, m)
    y = b.fmul(b.fmul(horner(isa, m, _LOG_POLY), m), z)
    y = isa.fma(ef, const(x, _LN2_LO), y)
    y = isa.fma(z, const(x, -0.5), y)
    y = isa.fma(ef, const(x, _LN2_HI), b.fadd(m, y))
    y = b.select(b.fcmp_ordered("==", x, const(x, math.inf)), x, y)
    y = b.select(b.fcmp_ordered("==", x, const(x, 0.0)), const(x, -math.inf), y)
    y = b.select(b.fcmp_ordered("<", x, const(x, 0.0)), const(x, math.nan), y)
    return b.select(b.fcmp_unordered("uno", x, x), x, y)


# -- tanh -------------------------------------------------------------------------------------
_TANH_POLY = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
              -3.33332819422e-1)


def tanh(isa: Isa, x: ir.Value) -> ir.Value:
    """tanh x: an odd polynomial for |x| < 0.625, else sign(x)(1 - 2/(e**2|x| + 1)), which saturates."""
    b = isa.k.b
    a = _call(isa, "fabs", x)
    z = b.fmul(x, x)
    small = isa.fma(b.fmul(horner(isa, z, _TANH_POLY), z), x, x)
    big = b.fsub(const(x, 1.0), b.fdiv(const(x, 2.0), b.fadd(exp(isa, b.fadd(a, a)), const(x, 1.0))))
    big = _call(isa, "copysign", big, x)
    return b.select(b.fcmp_ordered("<", a, const(x, 0.625)), small, big)


# -- sin, cos ---------------------------------------------------------------------------------
_SINCOS_MAX = 4194304.0          # 2**22: f32 angles beyond it answer NaN (the vector forms' domain)
_F64, _I64 = ir.DoubleType(), ir.IntType(64)
_MAGIC64 = 6755399441055744.0    # 1.5 * 2**52: adding it rounds |v| < 2**51 to an integer
_PIO2_HI64, _PIO2_LO64 = 1.5707963267341256e+00, 6.077100506506192e-11   # pi/2; HI has 33 bits
_SIN_TAYLOR = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(6, 0, -1))   # r^13 .. r^3, over r^3
_COS_TAYLOR = tuple((-1) ** k / math.factorial(2 * k) for k in range(7, 0, -1))       # r^14 .. r^2, over r^2


def sincos(isa: Isa, x: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(sin x, cos x) of f32 x, correctly rounded (``sincos_f64`` of the exact f64 value), as glibc's
    sinf and cosf give them (and so ggml's rope); NaN for |x| >= 2**22 and for inf and NaN."""
    b = isa.k.b
    lost = b.fcmp_unordered("uge", _call(isa, "fabs", x), const(x, _SINCOS_MAX))
    return tuple(b.select(lost, const(x, math.nan), v) for v in sincos_f64(isa, b.fpext(x, like(x, _F64))))


def sincos_f64(isa: Isa, x: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(sin x, cos x) rounded to f32, for f64 angles x (rope's): the reduction by pi/2 and the
    polynomials (Taylor to r^13 and r^14: under 3e-14 on |r| <= pi/4) run in f64, so the f32 results
    are the correctly rounded ones, as glibc's sinf and cosf give ggml, but in rare near-ties; |x| <
    2**31 pi/2."""
    b = isa.k.b
    a = _call(isa, "fabs", x)
    t = b.fadd(b.fmul(a, const(x, 2.0 / math.pi, _F64)), const(x, _MAGIC64, _F64))
    qf = b.fsub(t, const(x, _MAGIC64, _F64))
    q = b.trunc(b.bitcast(t, like(x, _I64)), like(x, i32))                   # the integer sits in the low bits
    r = b.fsub(b.fsub(a, b.fmul(qf, const(x, _PIO2_HI64, _F64))), b.fmul(qf, const(x, _PIO2_LO64, _F64)))
    z = b.fmul(r, r)
    ps = isa.fma(b.fmul(horner(isa, z, _SIN_TAYLOR, _F64), z), r, r)          # r + r^3 (-1/6 + ...)
    pc = isa.fma(horner(isa, z, _COS_TAYLOR, _F64), z, const(x, 1.0, _F64))   # 1 + z (-1/2 + ...)
    narrow = lambda v: b.fptrunc(v, like(x, f32))  # noqa: E731
    return _signed(isa, narrow(ps), narrow(pc), q, narrow(x))


def _signed(isa: Isa, ps: ir.Value, pc: ir.Value, q: ir.Value, x: ir.Value) -> tuple[ir.Value, ir.Value]:
    """sin x and cos x from sin r and cos r (f32), where |x| = q pi/2 + r: chosen and signed by q and
    x's sign."""
    b = isa.k.b
    ity = like(ps, i32)
    odd = b.icmp_unsigned("!=", b.and_(q, const(ps, 1, i32)), const(ps, 0, i32))
    sin_a, cos_a = b.select(odd, pc, ps), b.select(odd, ps, pc)
    sign = lambda bits: b.shl(b.and_(bits, const(ps, 2, i32)), const(ps, 30, i32))  # noqa: E731
    sin_sign = b.xor(sign(q), b.and_(b.bitcast(x, ity), const(ps, 0x80000000, i32)))
    cos_sign = sign(b.add(q, const(ps, 1, i32)))
    flip = lambda v, s: b.bitcast(b.xor(b.bitcast(v, ity), s), ps.type)  # noqa: E731
    return flip(sin_a, sin_sign), flip(cos_a, cos_sign)


def sin(isa: Isa, x: ir.Value) -> ir.Value:
    return sincos(isa, x)[0]


def cos(isa: Isa, x: ir.Value) -> ir.Value:
    return sincos(isa, x)[1]


# -- dispatch ---------------------------------------------------------------------------------
POLY = {"exp": exp, "log": log, "tanh": tanh, "sin": sin, "cos": cos}


def libm(isa: Isa, name: str, x: ir.Value) -> ir.Value:
    """The libm version through LLVM's intrinsic (one call per lane): the scalar twins' choice."""
    if name not in POLY:
        raise ValueError(f"vmath: no function {name!r}; known: {', '.join(POLY)}")
    return _call(isa, name, x)


def unary(isa: Isa, name: str, x: ir.Value, poly: bool) -> ir.Value:
    """f(x) for f in POLY: the polynomial form when `poly`, else libm."""
    if name not in POLY:
        raise ValueError(f"vmath: no function {name!r}; known: {', '.join(POLY)}")
    return POLY[name](isa, x) if poly else libm(isa, name, x)


@contextmanager
def rope_angles(k: Kernel, first: ir.Value, dims: int, base: float):
    """A loop over a rope's dims/2 pairs that yields (i, theta_i): ggml's f32 angle chain, theta_0 =
    ``first`` (the position as f32) and theta_(i+1) = theta_i * base^(-2/dims), each product rounded
    to f32 (``ops.rope_angles_table``)."""
    step = ir.Constant(f32, float(rope_theta_scale(dims, base)))
    theta = k.var(f32, first)
    with k.loop(0, dims // 2, name="angle") as i:
        yield i, theta.get()
        theta.set(k.b.fmul(theta.get(), step))
