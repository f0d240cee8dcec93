"""The gated delta rule's kernel (``ggraph/ir/delta_rule.py`` states the op): prefill and decode in one pass.

    gated_delta_rule_hk<Hk>_hv<Hv>_dk<Dk>_dv<Dv>_s<scale bits>_<target>(q, k, v, g, beta, state, y, new_state,
                                                                        i64 T, ith, nth)
        per token t, value head h, state row j (M = state transposed, rows of Dk):
        M[j] = M[j]·exp(g[t, h]);  d = (v[t, h, j] - M[j]·k[t, hk])·beta[t, h];  M[j] = fma(d, k[t, hk], M[j])
        y[t, h, j] = (M[j]·q[t, hk])·scale                                       hk = h // (Hv/Hk)

Threads split (value head, block of R rows) units: a unit's R rows of M (R·Dk values, R chosen so they fit
in registers) stay in registers for all T tokens and share each token's k and q loads, so the state is read
and written once per call however long the prompt. Rows are held in vectors of 16 lanes (the generic twin:
one lane); each dot sums its whole vectors lane-wise by fma, halves the lanes to one, then fuses the lanes
past the last whole vector in one at a time. The decay is libm's exp of the f32 g rounded once.
"""
from __future__ import annotations

import struct

from llvmlite import ir

from ggraph.backends.llvm.kernels.builder import Kernel, f32, f64, i32, mangle, vec
from ggraph.backends.llvm.kernels.isa import vector_path
from ggraph.backends.llvm.target import Target

LANES = 16                 # f32 lanes of a vector on the vector path (AVX-512's width; AVX2 takes two registers)
STATE_REGISTERS = 16       # vectors of 16 f32 a unit keeps its rows of M in (of AVX-512's 32)


def variant(target: Target) -> str:
    """How the delta-rule kernel runs on ``target`` (for ``ggraph target``)."""
    how = "16 lanes a vector" if vector_path(target) else "one lane at a time (generic twin)"
    return f"(value head, rows) units across threads, the rows of the state in registers across tokens, {how}"


def state_rows(Dv: int, Dk: int, vector: bool) -> int:
    """Rows of M a unit carries at once: as many (up to 4, dividing Dv) as fit STATE_REGISTERS vectors (the
    generic twin: one)."""
    per_row = -(-Dk // LANES)
    if not vector:
        return 1
    return next(r for r in (4, 2, 1) if Dv % r == 0 and (r * per_row <= STATE_REGISTERS or r == 1))


def _fma(k: Kernel, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    return k.intrinsic(f"llvm.fma.{mangle(a.type)}", a.type, [a, b, c])


def _pieces(n: int, W: int) -> list[tuple[int, int]]:
    """(first element, width) of the vectors a row of n values is held in: W wide, a narrower one at the end."""
    return [(i, min(W, n - i)) for i in range(0, n, W)]


def gated_delta_rule(module: ir.Module, Hk: int, Hv: int, Dk: int, Dv: int, scale: float, target: Target) -> str:
    """Emit (once) the delta-rule kernel for these head counts and sizes; returns its name."""
    bits = struct.unpack("<I", struct.pack("<f", scale))[0]
    name = f"gated_delta_rule_hk{Hk}_hv{Hv}_dk{Dk}_dv{Dv}_s{bits:08x}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("q", "k", "v", "g", "beta", "state", "y", "new_state"), ("T",))
    b = k.b
    W = LANES if vector_path(target) else 1
    R = state_rows(Dv, Dk, W > 1)
    pieces = _pieces(Dk, W)
    blocks = Dv // R
    start, end = k.thread_share(Hv * blocks)
    with k.loop(start, end, name="unit") as unit:
        h = b.sdiv(unit, k.i64(blocks))
        j0 = b.mul(b.srem(unit, k.i64(blocks)), k.i64(R))
        hk = b.sdiv(h, k.i64(Hv // Hk))
        first = b.add(b.mul(h, k.i64(Dv)), j0)                                   # row h·Dv + j0 of M [Hv·Dv, Dk]
        srow = [k.mul(b.add(first, k.i64(r)), 4 * Dk) for r in range(R)]
        M = [[k.var(vec(f32, w), k.load(vec(f32, w), k.arg["state"], k.add(srow[r], 4 * i))) for i, w in pieces]
             for r in range(R)]
        with k.loop(0, k.arg["T"], name="t") as t:
            th = b.add(b.mul(t, k.i64(Hv)), h)                                   # [t, h] of g, beta
            decay = _exp(k, k.load(f32, k.arg["g"], k.mul(th, 4)))
            beta = k.load(f32, k.arg["beta"], k.mul(th, 4))
            at = k.mul(b.add(b.mul(t, k.i64(Hk)), hk), 4 * Dk)                   # k[t, hk], q[t, hk]
            kv = [k.load(vec(f32, w), k.arg["k"], k.add(at, 4 * i)) for i, w in pieces]
            qv = [k.load(vec(f32, w), k.arg["q"], k.add(at, 4 * i)) for i, w in pieces]
            vrow = k.mul(b.add(b.mul(th, k.i64(Dv)), j0), 4)                     # v[t, h, j0], y[t, h, j0]
            for r in range(R):
                m = [b.fmul(s.get(), k.splat(decay, w)) for s, (i, w) in zip(M[r], pieces)]
                vj = k.load(f32, k.arg["v"], k.add(vrow, 4 * r))
                d = b.fmul(b.fsub(vj, _dot(k, pieces, m, kv, W)), beta)
                m = [_fma(k, k.splat(d, w), kp, mp) for mp, kp, (i, w) in zip(m, kv, pieces)]
                for s, v in zip(M[r], m):
                    s.set(v)
                out = b.fmul(_dot(k, pieces, m, qv, W), ir.Constant(f32, scale))
                k.store(out, k.arg["y"], k.add(vrow, 4 * r))
        for r in range(R):
            for (i, w), s in zip(pieces, M[r]):
                k.store(s.get(), k.arg["new_state"], k.add(srow[r], 4 * i))
    return k.finish()


def _exp(k: Kernel, x: ir.Value) -> ir.Value:
    """libm's double exp of an f32, rounded to f32 once (glibc's expf, which ggml calls, is within an ulp)."""
    return k.b.fptrunc(k.intrinsic("llvm.exp.f64", f64, [k.b.fpext(x, f64)]), f32)


def _dot(k: Kernel, pieces, a: list, c: list, W: int) -> ir.Value:
    """a · c over a row: whole W-lane vectors into one accumulator by fma, its lanes halved to one, then the
    lanes of a narrower last vector fused in one by one."""
    b = k.b
    acc = None
    for (i, w), x, y in zip(pieces, a, c):
        if w == W:
            acc = b.fmul(x, y) if acc is None else _fma(k, x, y, acc)
    total = None
    if acc is not None:
        while acc.type.count > 1:
            lo, hi = k.split(acc, 2)
            acc = b.fadd(lo, hi)
        total = b.extract_element(acc, ir.Constant(i32, 0))
    for (i, w), x, y in zip(pieces, a, c):
        if w == W:
            continue
        for lane in range(w):
            at = ir.Constant(i32, lane)
            xe, ye = b.extract_element(x, at), b.extract_element(y, at)
            total = b.fmul(xe, ye) if total is None else _fma(k, xe, ye, total)
    return total
