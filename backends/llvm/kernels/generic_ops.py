"""Kernels for the unfused graph's plain primitives: batched f32 matmul, row reductions over a
runtime length, iota, and a byte copy. Plain loops that LLVM vectorises (fast-math on the
reductions); the fused pipeline rarely needs them, the unfused baseline always does.

    matmul_f32_<tag>(a, b, y, i64 batch, i64 M, i64 N, i64 K, i64 a_batch, i64 b_batch, ith, nth)
        y[z, m, n] = sum_k a[z*, m, k] b[z*, n, k]     (ggml's layout: both contract the last axis)
    reduce_<op>_f32(x, y, i64 rows, i64 n, ith, nth)   y[r] = op over x[r, 0:n]
    iota_<dtype>(y, i64 n, ith, nth)                    y[i] = i
    copy_bytes(x, y, i64 nbytes, ith, nth)              y[0:nbytes] = x[0:nbytes]
"""
from __future__ import annotations

import math

from llvmlite import ir

from ggraph.backends.llvm.kernels.builder import Kernel, f32, i8, i32, i64

FAST = ("fast",)


def _share(k: Kernel, n: ir.Value) -> tuple[ir.Value, ir.Value]:
    """This thread's [start, end) of n items: an even static split."""
    b = k.b
    ith, nth = (b.sext(k.arg[a], i64) for a in ("ith", "nth"))
    per = b.sdiv(b.add(n, b.sub(nth, ir.Constant(i64, 1))), nth)
    start = b.mul(per, ith)
    end = b.add(start, per)
    start = b.select(b.icmp_signed("<", start, n), start, n)
    end = b.select(b.icmp_signed("<", end, n), end, n)
    return start, end


def matmul_f32(module: ir.Module, name: str = "matmul_f32") -> str:
    """y = a · bᵀ over the last axes, batched; a_batch/b_batch are 0 for a broadcast operand."""
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("a", "b", "y"), ("batch", "M", "N", "K", "a_batch", "b_batch"), noalias=True)
    b = k.b
    M, N, K = k.arg["M"], k.arg["N"], k.arg["K"]
    start, end = _share(k, b.mul(k.arg["batch"], M))
    with k.loop(start, end, name="zm") as zm:
        z = b.sdiv(zm, M)
        m = b.srem(zm, M)
        arow = b.add(b.mul(b.mul(z, k.arg["a_batch"]), b.mul(M, K)), b.mul(m, K))
        bmat = b.mul(b.mul(z, k.arg["b_batch"]), b.mul(N, K))
        with k.loop(0, N, name="n") as n:
            brow = b.add(bmat, b.mul(n, K))
            acc = k.var(f32, ir.Constant(f32, 0.0))
            with k.loop(0, K, name="k") as kk:
                x = k.load(f32, k.arg["a"], b.mul(b.add(arow, kk), ir.Constant(i64, 4)))
                w = k.load(f32, k.arg["b"], b.mul(b.add(brow, kk), ir.Constant(i64, 4)))
                acc.set(b.fadd(acc.get(), b.fmul(x, w, flags=FAST), flags=FAST))
            k.store(acc.get(), k.arg["y"], b.mul(b.add(b.mul(zm, N), n), ir.Constant(i64, 4)))
    return k.finish()


_REDUCE = {  # op: (identity, combine)
    "reduce_sum": (0.0, lambda b, x, y: b.fadd(x, y, flags=FAST)),
    "reduce_max": (-math.inf, lambda b, x, y: b.select(b.fcmp_ordered(">", y, x), y, x)),
}


def reduce_rows(module: ir.Module, op: str) -> str:
    """y[r] = op(x[r, :n]) for a runtime row length n."""
    name = f"{op}_f32_rows"
    if Kernel.exists(module, name):
        return name
    identity, combine = _REDUCE[op]
    k = Kernel(module, name, ("x", "y"), ("rows", "n"), noalias=True)
    b = k.b
    n = k.arg["n"]
    start, end = _share(k, k.arg["rows"])
    with k.loop(start, end, name="r") as r:
        acc = k.var(f32, ir.Constant(f32, identity))
        base = b.mul(r, n)
        with k.loop(0, n, name="i") as i:
            x = k.load(f32, k.arg["x"], b.mul(b.add(base, i), ir.Constant(i64, 4)))
            acc.set(combine(b, acc.get(), x))
        k.store(acc.get(), k.arg["y"], b.mul(r, ir.Constant(i64, 4)))
    return k.finish()


def iota(module: ir.Module, dtype: str) -> str:
    """y[i] = i for i < n (i32 or f32)."""
    name = f"iota_{dtype}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("y",), ("n",), noalias=True)
    b = k.b
    start, end = _share(k, k.arg["n"])
    with k.loop(start, end, name="i") as i:
        v = b.trunc(i, i32) if dtype == "i32" else b.sitofp(i, f32)
        k.store(v, k.arg["y"], b.mul(i, ir.Constant(i64, 4)))
    return k.finish()


def copy_bytes(module: ir.Module) -> str:
    """y[0:nbytes] = x[0:nbytes], split across threads."""
    name = "copy_bytes"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("x", "y"), ("nbytes",), noalias=True)
    start, end = _share(k, k.arg["nbytes"])
    with k.loop(start, end, name="i") as i:
        k.store(k.load(i8, k.arg["x"], i), k.arg["y"], i)
    return k.finish()


# -- one elementwise op over broadcast operands of any (runtime) shape ------------------------

def _intrinsic(module, name: str, n_args: int = 1):
    if name in module.globals:
        return module.globals[name]
    return ir.Function(module, ir.FunctionType(f32, [f32] * n_args), name=name)


def _f(name):
    return lambda k, m, xs: k.b.call(_intrinsic(m, f"llvm.{name}.f32"), [xs[0]])


SCALAR_OPS = {  # op: (emit(k, module, operands), dtype kind)
    "add":   lambda k, m, xs: k.b.fadd(xs[0], xs[1]),
    "sub":   lambda k, m, xs: k.b.fsub(xs[0], xs[1]),
    "mul":   lambda k, m, xs: k.b.fmul(xs[0], xs[1]),
    "div":   lambda k, m, xs: k.b.fdiv(xs[0], xs[1]),
    "max":   lambda k, m, xs: k.b.call(_intrinsic(m, "llvm.maximum.f32", 2), xs),
    "neg":   lambda k, m, xs: k.b.fneg(xs[0]),
    "exp":   _f("exp"),
    "log":   _f("log"),
    "sqrt":  _f("sqrt"),
    "rsqrt": lambda k, m, xs: k.b.fdiv(ir.Constant(f32, 1.0), k.b.call(_intrinsic(m, "llvm.sqrt.f32"), [xs[0]])),
    "tanh":  lambda k, m, xs: k.b.call(_intrinsic(m, "tanhf"), [xs[0]]),
    "sin":   _f("sin"),
    "cos":   _f("cos"),
}
INT_OPS = {
    "add": lambda k, m, xs: k.b.add(xs[0], xs[1]),
    "sub": lambda k, m, xs: k.b.sub(xs[0], xs[1]),
    "mul": lambda k, m, xs: k.b.mul(xs[0], xs[1]),
}
RANK = 4


def elementwise_nd(module: ir.Module, op: str, kinds: tuple[str, ...], out_kind: str) -> str:
    """y = op(x...) over a [d0, d1, d2, d3] output; each operand has its own dims (1 = broadcast).

    ``name(x0.., y, d0..d3, e00..e03, e10..e13, .., ith, nth)``; kinds are "f32" | "i32" | "i8".
    For shapes the fused loops do not cover (several runtime dims), as in the unfused baseline.
    """
    name = f"ew_{op}_{'_'.join(kinds)}_{out_kind}"
    if Kernel.exists(module, name):
        return name
    n = len(kinds)
    sizes = tuple(f"d{i}" for i in range(RANK)) + tuple(f"e{j}{i}" for j in range(n) for i in range(RANK))
    k = Kernel(module, name, tuple(f"x{j}" for j in range(n)) + ("y",), sizes, noalias=False)
    b = k.b
    d = [k.arg[f"d{i}"] for i in range(RANK)]
    typ = {"f32": f32, "i32": i32, "i8": i8}
    start, end = _share(k, b.mul(b.mul(d[0], d[1]), d[2]))
    with k.loop(start, end, name="r") as r:
        i2 = b.srem(r, d[2])
        i1 = b.srem(b.sdiv(r, d[2]), d[1])
        i0 = b.sdiv(b.sdiv(r, d[2]), d[1])
        bases, inner = [], []
        for j in range(n):
            s = _strides(k, [k.arg[f"e{j}{i}"] for i in range(RANK)])
            bases.append(b.add(b.add(b.mul(i0, s[0]), b.mul(i1, s[1])), b.mul(i2, s[2])))
            inner.append(s[3])
        with k.loop(0, d[3], name="c") as c:
            xs = []
            for j, kind in enumerate(kinds):
                idx = b.add(bases[j], b.mul(c, inner[j]))
                width = 1 if kind == "i8" else 4
                xs.append(k.load(typ[kind], k.arg[f"x{j}"], b.mul(idx, ir.Constant(i64, width))))
            y = _apply(k, module, op, xs, kinds, out_kind)
            width = 1 if out_kind == "i8" else 4
            yidx = b.add(b.mul(r, d[3]), c)
            k.store(y, k.arg["y"], b.mul(yidx, ir.Constant(i64, width)))
    return k.finish()


def _strides(k: Kernel, dims) -> list:
    """Row-major element strides of an operand, 0 along its broadcast (size-1) dims."""
    b = k.b
    one, zero = ir.Constant(i64, 1), ir.Constant(i64, 0)
    out, step = [None] * RANK, one
    for i in reversed(range(RANK)):
        out[i] = b.select(b.icmp_signed("==", dims[i], one), zero, step)
        step = b.mul(step, dims[i])
    return out


def _apply(k: Kernel, module, op: str, xs, kinds, out_kind):
    b = k.b
    if op == "less":
        cmp = b.fcmp_ordered("<", xs[0], xs[1]) if kinds[0] == "f32" else b.icmp_signed("<", xs[0], xs[1])
        return b.zext(cmp, i8)
    if op == "where":
        return b.select(b.icmp_signed("!=", xs[0], ir.Constant(i8, 0)), xs[1], xs[2])
    if op == "cast":
        src, dst = kinds[0], out_kind
        if src == dst:
            return xs[0]
        if src == "f32":
            return b.fptosi(xs[0], {"i32": i32, "i8": i8}[dst])
        if dst == "f32":
            return b.sitofp(xs[0], f32)
        return b.trunc(xs[0], i8) if dst == "i8" else b.sext(xs[0], i32)
    table = SCALAR_OPS if kinds[0] == "f32" else INT_OPS
    if op not in table:
        raise ValueError(f"elementwise_nd: no {kinds[0]} rule for {op}")
    return table[op](k, module, xs)
