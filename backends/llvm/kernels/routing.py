"""Kernels for a mixture-of-experts router's ops: top_k, argmax, take_along_axis, segment_sum.

    top_k_k<k>_<target>(x, values, indices, i64 rows, i64 N, ith, nth)
        per row of N f32: the k largest, from the largest down, and their indices
    argmax_<target>(x, indices, i64 rows, i64 N, ith, nth)
        per row of N f32: the index of the first maximum
    take_along_axis_<target>(x, idx, out, status, i64 outer, i64 L, i64 J, i64 inner, ith, nth)
        out[o, j, i] = x[o, idx[o, j, i], i]   (x [outer, L, inner], idx and out [outer, J, inner])
    segment_sum_<target>(values, ids, out, status, i64 M, i64 S, i64 D, ith, nth)
        out[s] = sum of values[m] (rows of D f32) over m with ids[m] = s, in increasing m

Each is a plain scalar loop, and one loop serves every feature set: it is the generic twin and
the fast path at once. Routers are tiny (a row of 8 to 256 expert scores, a few chosen); the
gathers and the segment sum have inner loops over contiguous elements that LLVM vectorises
for the target it builds for (segment_sum's adds stay in row order per lane, so its sums are
numpy's to the bit).

Order: NaN ranks above every number and equal values keep increasing index order
(``ggraph.ops.top_k``), so top_k with k=1 and argmax agree. An index outside its axis (a
segment id outside 0..S-1) stores {1, index} in ``status``, which the run turns into an error
naming the op; that output element is zero and memory is never touched out of bounds.
Threads split rows: of x for top_k and argmax, of (o, j) for take_along_axis, and of the
output segments for segment_sum (each thread reads every id, and sums only its segments).
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.backends.llvm.kernels.builder import Kernel, f32, i32, i64
from ggraph.backends.llvm.target import Target


def _beats(b: ir.IRBuilder, a: ir.Value, c: ir.Value) -> ir.Value:
    """True if ``a`` ranks strictly above ``c``: a > c, or a is NaN and c is not."""
    nan_over = b.and_(b.fcmp_unordered("uno", a, a), b.fcmp_ordered("ord", c, c))
    return b.or_(b.fcmp_ordered(">", a, c), nan_over)


def top_k(module: ir.Module, k_: int, target: Target) -> str:
    """Emit (once) top_k for a static k; returns the kernel name. Each row is one pass over x with an
    insertion into the sorted output row: an element that does not beat the k-th so far costs one
    comparison; one that does moves down past the ones it beats (a tie stays below)."""
    name = f"top_k_k{k_}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("x", "values", "indices"), ("rows", "N"))
    b = k.b
    N = k.arg["N"]
    start, end = k.thread_share(k.arg["rows"])
    with k.loop(start, end, name="row") as r:
        x = k.addr(k.arg["x"], k.mul(k.mul(r, N), 4))
        vals = k.addr(k.arg["values"], k.mul(r, 4 * k_))
        idx = k.addr(k.arg["indices"], k.mul(r, 4 * k_))
        with k.loop(0, N, name="j") as j:
            v = k.load(f32, x, k.mul(j, 4))
            filled = b.icmp_signed("<", j, k.i64(k_))            # j < k: the output row is not full yet
            last = k.load(f32, vals, 4 * (k_ - 1))               # read only when the row is full
            enter = b.or_(filled, _beats(b, v, last))
            with b.if_then(enter):
                at = b.select(filled, j, k.i64(k_ - 1))
                _insert(k, vals, idx, at, v, b.trunc(j, i32))
    return k.finish()


def _insert(k: Kernel, vals, idx, at: ir.Value, v: ir.Value, j: ir.Value) -> None:
    """Move the entries above slot ``at`` that ``v`` beats down one slot, then put (v, j) in the gap."""
    b = k.b
    pre = b.block
    head = k.fn.append_basic_block("ins.head")
    move = k.fn.append_basic_block("ins.move")
    done = k.fn.append_basic_block("ins.done")
    b.branch(head)
    b.position_at_end(head)
    p = b.phi(i64, name="p")
    p.add_incoming(at, pre)
    above = b.sub(p, k.i64(1))
    positive = b.icmp_signed(">", p, k.i64(0))
    check = k.fn.append_basic_block("ins.check")
    b.cbranch(positive, check, done)
    b.position_at_end(check)
    prev = k.load(f32, vals, k.mul(above, 4))
    b.cbranch(_beats(b, v, prev), move, done)
    b.position_at_end(move)
    k.store(prev, vals, k.mul(p, 4))
    k.store(k.load(i32, idx, k.mul(above, 4)), idx, k.mul(p, 4))
    p.add_incoming(above, move)
    b.branch(head)
    b.position_at_end(done)
    k.store(v, vals, k.mul(p, 4))
    k.store(j, idx, k.mul(p, 4))


def argmax(module: ir.Module, target: Target) -> str:
    """Emit (once) argmax: a running best per row that only a strictly higher rank replaces."""
    name = f"argmax_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("x", "indices"), ("rows", "N"))
    b = k.b
    N = k.arg["N"]
    start, end = k.thread_share(k.arg["rows"])
    with k.loop(start, end, name="row") as r:
        x = k.addr(k.arg["x"], k.mul(k.mul(r, N), 4))
        best = k.var(f32, k.load(f32, x))
        at = k.var(i64, 0)
        with k.loop(1, N, name="j") as j:
            v = k.load(f32, x, k.mul(j, 4))
            better = _beats(b, v, best.get())
            best.set(b.select(better, v, best.get()))
            at.set(b.select(better, j, at.get()))
        k.store(b.trunc(at.get(), i32), k.arg["indices"], k.mul(r, 4))
    return k.finish()


def _report(k: Kernel, bad: ir.Value, index: ir.Value) -> None:
    """If ``bad``, store {1, index} in the status slot."""
    with k.b.if_then(bad):
        k.store(ir.Constant(i64, 1), k.arg["status"])
        k.store(index, k.arg["status"], 8)


def take_along_axis(module: ir.Module, target: Target) -> str:
    """Emit (once) the gather along an axis of 4-byte elements (f32 or i32: the bits move as they are)."""
    name = f"take_along_axis_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("x", "idx", "out", "status"), ("outer", "L", "J", "inner"))
    b = k.b
    L, J, inner = k.arg["L"], k.arg["J"], k.arg["inner"]
    start, end = k.thread_share(b.mul(k.arg["outer"], J))
    with k.loop(start, end, name="oj") as oj:
        o = b.sdiv(oj, J)
        src = k.addr(k.arg["x"], k.mul(k.mul(k.mul(o, L), inner), 4))
        row = k.mul(oj, inner)
        with k.loop(0, inner, name="i") as i:
            at = k.mul(k.add(row, i), 4)
            id_ = b.sext(k.load(i32, k.arg["idx"], at), i64)
            ok = b.and_(b.icmp_signed(">=", id_, k.i64(0)), b.icmp_signed("<", id_, L))
            _report(k, b.not_(ok), id_)
            safe = b.select(ok, id_, k.i64(0))
            v = k.load(i32, src, k.mul(k.add(k.mul(safe, inner), i), 4))
            k.store(b.select(ok, v, ir.Constant(i32, 0)), k.arg["out"], at)
    return k.finish()


def segment_sum(module: ir.Module, target: Target) -> str:
    """Emit (once) the segment sum: this thread's segments zeroed, then every row whose id is one of them
    added in, in row order (lanes along D are independent, so vectors keep each sum's order)."""
    name = f"segment_sum_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("values", "ids", "out", "status"), ("M", "S", "D"))
    b = k.b
    S, D = k.arg["S"], k.arg["D"]
    s0, s1 = k.thread_share(S)
    with k.loop(k.mul(s0, D), k.mul(s1, D), name="z") as z:
        k.store(ir.Constant(f32, 0.0), k.arg["out"], k.mul(z, 4))
    first = b.icmp_signed("==", k.arg["ith"], ir.Constant(i32, 0))
    with k.loop(0, k.arg["M"], name="m") as m:
        s = b.sext(k.load(i32, k.arg["ids"], k.mul(m, 4)), i64)
        _report(k, b.and_(first, b.or_(b.icmp_signed("<", s, k.i64(0)), b.icmp_signed(">=", s, S))), s)
        mine = b.and_(b.icmp_signed(">=", s, s0), b.icmp_signed("<", s, s1))
        with b.if_then(mine):
            dst = k.addr(k.arg["out"], k.mul(k.mul(s, D), 4))
            src = k.addr(k.arg["values"], k.mul(k.mul(m, D), 4))
            with k.loop(0, D, name="d") as d:
                at = k.mul(d, 4)
                k.store(b.fadd(k.load(f32, dst, at), k.load(f32, src, at)), dst, at)
    return k.finish()
