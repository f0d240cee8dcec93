"""Kernels for the unfused graph's plain primitives: batched f32 matmul, iota, and a byte copy.
Plain loops that LLVM vectorises (fast-math on the dot products); the fused pipeline rarely
needs them, the unfused baseline always does.

    matmul_f32(a, b, y, i64 batch, i64 M, i64 N, i64 K, i64 a_batch, i64 b_batch, ith, nth)
        y[z, m, n] = sum_k a[z*, m, k] b[z*, n, k]     (ggml's layout: both contract the last axis)
    iota_<dtype>(y, i64 n, ith, nth)                    y[i] = i
    copy_bytes(x, y, i64 nbytes, ith, nth)              y[0:nbytes] = x[0:nbytes]
    check_finite_f32(x, status, i64 n, ith, nth)        status = {1, i} at the first non-finite x[i]
    rope_angles_*(positions, [freq_factors,] y, i64 T, ith, nth)   y[t, i]: ggml's f32 angle chain
"""
from __future__ import annotations

import hashlib

from llvmlite import ir

from ggraph.backends.llvm.kernels import vmath
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


def check_finite(module: ir.Module) -> str:
    """status = {1, i} for the first i < n where x[i] is NaN or infinite (GGRAPH_DEBUG_NANS); thread 0
    scans it all, so the index is the first."""
    name = "check_finite_f32"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("x", "status"), ("n",), noalias=True)
    b = k.b
    first = k.var(i64, -1)
    with k.if_then(b.icmp_signed("==", k.arg["ith"], ir.Constant(i32, 0))):
        with k.loop(0, k.arg["n"], name="i") as i:
            x = k.load(f32, k.arg["x"], b.mul(i, ir.Constant(i64, 4)))
            finite = b.fcmp_ordered("<", k.intrinsic("llvm.fabs.f32", f32, [x]), ir.Constant(f32, float("inf")))
            missing = b.icmp_signed("<", first.get(), ir.Constant(i64, 0))
            first.set(b.select(b.and_(b.not_(finite), missing), i, first.get()))
        with k.if_then(b.icmp_signed(">=", first.get(), ir.Constant(i64, 0))):
            k.store(ir.Constant(i64, 1), k.arg["status"])
            k.store(first.get(), k.arg["status"], 8)
    return k.finish()


def rope_angles(module: ir.Module, dims: int, base: float, scale: float, freq_factors: bool) -> str:
    """y[t, i] for i < dims/2: theta = positions[t], times base^(-2/dims) once per pair, every product
    rounded to f32 (ggml's chain, ``ops.rope_angles_table``); / freq_factors[i], then * scale."""
    tag = hashlib.sha256(repr((dims, base, scale, freq_factors)).encode()).hexdigest()[:10]
    name = f"rope_angles_{dims}_{tag}"
    if Kernel.exists(module, name):
        return name
    ff = ("freq_factors",) if freq_factors else ()
    k = Kernel(module, name, ("positions",) + ff + ("y",), ("T",), noalias=True)
    b, half = k.b, dims // 2
    start, end = _share(k, k.arg["T"])
    with k.loop(start, end, name="t") as t:
        pos = b.sitofp(k.load(i32, k.arg["positions"], b.mul(t, ir.Constant(i64, 4))), f32)
        with vmath.rope_angles(k, pos, dims, base) as (i, v):
            if freq_factors:
                v = b.fdiv(v, k.load(f32, k.arg["freq_factors"], b.mul(i, ir.Constant(i64, 4))))
            if scale != 1.0:
                v = b.fmul(v, ir.Constant(f32, scale))
            k.store(v, k.arg["y"], b.mul(b.add(b.mul(t, ir.Constant(i64, half)), i), ir.Constant(i64, 4)))
    return k.finish()
