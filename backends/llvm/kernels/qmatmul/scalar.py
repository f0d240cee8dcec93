"""The quantised matmul's generic twin (Method.SCALAR): the readable spec of the vector kernels,
one weight at a time, for every T on baseline x86."""
from __future__ import annotations

from llvmlite import ir

from ggraph.backends.llvm.kernels.builder import f32, i8, i32
from ggraph.backends.llvm.kernels.qmatmul.context import Matmul, sum_of


def scalar(m: Matmul, rows, L: int) -> None:
    """y[t, n] = sum over blocks of dx * (scale * sum(q * xq) - min * sum(xq)), rounded as llama.cpp
    does: a super-block sums its sub-blocks' integer dots times their integer scales (its mins
    likewise) and takes one float step, dx*d times that sum; the steps accumulate with FMA, the
    mins' apart, subtracted at the end. Activations in groups of L tokens."""
    k, isa, fmt, lay = m.k, m.isa, m.fmt, m.lay
    b = k.b
    step = _block if fmt.int_scale is None else _super_block
    with k.loop(*rows, name="n") as n:
        with k.loop(0, k.arg["T"], name="t") as t:
            x = (k.addr(k.arg["xq"], k.mul(b.sdiv(t, k.i64(L)), lay.group_bytes(L))), b.srem(t, k.i64(L)))
            acc, mins = k.var(f32, 0.0), k.var(f32, 0.0)
            with k.loop(0, lay.K // fmt.dtype.block_size, name="blk") as blk:
                wblk = m.row(n, blk)
                dx = k.load(f32, x[0], lay.d(k, L, blk, x[1]))
                for total, (factor, value) in zip((acc, mins), step(m, L, x, wblk, blk, dx)):
                    total.set(isa.fused(factor, value, total.get()))
            k.store(b.fsub(acc.get(), mins.get()), k.arg["y"], k.mul(k.add(k.mul(t, m.N), n), 4))


def _block(m: Matmul, L: int, x, wblk, blk, dx) -> list:
    """A one-scale block's (scale*dx, sum(q * xq)) and, with a min, (min*dx, sum(xq)), or with q8_1
    activations (min, s): pairs of floats whose products the caller sums."""
    k, isa, fmt, lay = m.k, m.isa, m.fmt, m.lay
    b = k.b
    scale, mn = fmt.scale(k, isa, wblk, 0)
    out = [(b.fmul(scale, dx), b.sitofp(_dot(m, L, x, wblk, blk, 0), f32))]
    if mn is None:
        return out
    if lay.keeps_s:
        return out + [(mn, lay.load_s(k, isa, x[0], L, blk, lane=x[1]))]
    return out + [(b.fmul(mn, dx), b.sitofp(_xsum(m, L, x, blk, 0), f32))]


def _super_block(m: Matmul, L: int, x, wblk, blk, dx) -> list:
    """A super-block's (d*dx, sum_s scale[s] * sum(q * xq)) and, with mins, (dmin*dx, sum_s min[s] * sum(xq))."""
    k, isa, fmt = m.k, m.isa, m.fmt
    b = k.b
    header = fmt.int_scale(k, isa, wblk, 0)                           # d and dmin (sub-block 0's scales unused)
    isum, msum = k.var(i32, 0), k.var(i32, 0)
    with k.loop(0, fmt.dtype.block_size // fmt.sub, name="s") as s:
        ints = fmt.int_scale(k, isa, wblk, s)
        isum.set(b.add(isum.get(), b.mul(ints.scales, _dot(m, L, x, wblk, blk, s))))
        if ints.mins is not None:
            msum.set(b.add(msum.get(), b.mul(ints.mins, _xsum(m, L, x, blk, s))))
    out = [(b.fmul(header.d, dx), b.sitofp(isum.get(), f32))]
    return out + ([(b.fmul(header.dmin, dx), b.sitofp(msum.get(), f32))] if header.mins is not None else [])


def _dot(m: Matmul, L: int, x, wblk, blk, s) -> ir.Value:
    """sum(q * xq) over sub-block s (an int or i64 value) of block blk, one weight at a time (i32)."""
    k, isa, fmt, lay = m.k, m.isa, m.fmt, m.lay
    b = k.b
    base, lane = x
    isum = k.var(i32, 0)
    with k.loop(0, fmt.sub, name="i") as i:
        e = k.add(k.mul(blk, fmt.dtype.block_size), k.mul(s, fmt.sub), i)           # feature index
        at = k.add(lay.qs(k, L, b.sdiv(e, k.i64(4)), lane), b.srem(e, k.i64(4)))
        q = fmt.level(k, isa, wblk, k.add(k.mul(s, fmt.sub), i))
        isum.set(b.add(isum.get(), b.mul(q, b.sext(k.load(i8, base, at), i32))))
    return isum.get()


def _xsum(m: Matmul, L: int, x, blk, s):
    """Sum of quantised activations of sub-block s (an int or i64 value) for one token."""
    k, fmt, lay = m.k, m.fmt, m.lay
    base, lane = x
    per = fmt.sub // lay.sum_block
    first = k.add(k.mul(blk, fmt.dtype.block_size // lay.sum_block), k.mul(s, per))
    return sum_of(k, [lay.load_sums(k, base, L, k.add(first, p), lane=lane) for p in range(per)])
