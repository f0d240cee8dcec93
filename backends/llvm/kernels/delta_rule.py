"""The gated delta rule's kernels (``ggraph/ir/delta_rule.py`` states the op): prefill and decode in one pass.

    delta_decay_h<Hv>_<target>(g, decay, i64 T, ith, nth)      decay[t, h] = exp(g[t, h])  (f64 exp, rounded once)
    gated_delta_rule_hk<Hk>_hv<Hv>_dk<Dk>_dv<Dv>_s<scale bits>_<target>(q, k, v, decay, beta, state, y, new_state,
                                                                        i64 T, ith, nth)
        per token t, value head h, row j of M (the state transposed, rows of Dk), hk = h // (Hv/Hk):
        a = M[j]·k, b = M[j]·q (the state before the token), c = k·q
        d = (v[t, h, j] - a·decay)·beta;  y[t, h, j] = fma(d, c, b·decay)·scale;  M[j] = fma(d, k, M[j]·decay)

That is ggml's step (decay, delta against the decayed state, rank-1 update, output from the updated state)
with both dots taken from the state before the token: (decay·M + k ⊗ d)ᵀq = decay·Mᵀq + d·(k·q). The two
dots of a row no longer wait for each other or for the update, and a token's whole chain per row is two
dots, one reduction, one update (the sums differ from ggml's in rounding only). Threads split (value head,
block of R rows) units: a unit's R rows of M (R·Dk values, R chosen so they fit in registers) stay in
registers for all T tokens and share each token's k and q loads, so the state is read and written once per
call however long the prompt. Rows are held in vectors of 16 lanes (the generic twin: one lane); a unit's
2R dots are reduced together, halving lanes across all of them at once, and the lanes past the last whole
vector fused in one by one.
"""
from __future__ import annotations

import struct

from llvmlite import ir

from ggraph.backends.llvm.kernels.builder import Kernel, f32, f64, i32, mangle, vec
from ggraph.backends.llvm.kernels.isa import vector_path
from ggraph.backends.llvm.target import Target

LANES = 16                 # f32 lanes of a vector on the vector path (AVX-512's width; AVX2 takes two registers)
STATE_REGISTERS = 8        # vectors of 16 f32 a unit keeps its rows of M in (k and q take as many again)


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


def delta_decay(module: ir.Module, Hv: int, target: Target) -> str:
    """Emit (once) decay[t, h] = exp(g[t, h]) for T·Hv values split across threads; returns its name."""
    name = f"delta_decay_h{Hv}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("g", "decay"), ("T",))
    start, end = k.thread_share(k.b.mul(k.arg["T"], k.i64(Hv)))
    with k.loop(start, end, name="th") as th:
        k.store(_exp(k, k.load(f32, k.arg["g"], k.mul(th, 4))), k.arg["decay"], k.mul(th, 4))
    return k.finish()


def gated_delta_rule(module: ir.Module, Hk: int, Hv: int, Dk: int, Dv: int, scale: float, target: Target) -> str:
    """Emit (once) the delta-rule kernel for these head counts and sizes; returns its name."""
    bits = struct.unpack("<I", struct.pack("<f", scale))[0]
    name = f"gated_delta_rule_hk{Hk}_hv{Hv}_dk{Dk}_dv{Dv}_s{bits:08x}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("q", "k", "v", "decay", "beta", "state", "y", "new_state"), ("T",))
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
            th = b.add(b.mul(t, k.i64(Hv)), h)                                   # [t, h] of decay, beta
            decay = k.load(f32, k.arg["decay"], k.mul(th, 4))
            beta = k.load(f32, k.arg["beta"], k.mul(th, 4))
            at = k.mul(b.add(b.mul(t, k.i64(Hk)), hk), 4 * Dk)                   # k[t, hk], q[t, hk]
            kv = [k.load(vec(f32, w), k.arg["k"], k.add(at, 4 * i)) for i, w in pieces]
            qv = [k.load(vec(f32, w), k.arg["q"], k.add(at, 4 * i)) for i, w in pieces]
            old = [[s.get() for s in row] for row in M]
            sums = _dots(k, pieces, [(m, kv) for m in old] + [(m, qv) for m in old] + [(kv, qv)], W)
            kq = sums[2 * R]
            vrow = k.mul(b.add(b.mul(th, k.i64(Dv)), j0), 4)                     # v[t, h, j0], y[t, h, j0]
            for r in range(R):
                vj = k.load(f32, k.arg["v"], k.add(vrow, 4 * r))
                d = b.fmul(b.fsub(vj, b.fmul(sums[r], decay)), beta)
                out = b.fmul(_fma(k, d, kq, b.fmul(sums[R + r], decay)), ir.Constant(f32, scale))
                k.store(out, k.arg["y"], k.add(vrow, 4 * r))
                for s, m, kp, (i, w) in zip(M[r], old[r], kv, pieces):
                    s.set(_fma(k, k.splat(d, w), kp, b.fmul(m, k.splat(decay, w))))
        for r in range(R):
            for (i, w), s in zip(pieces, M[r]):
                k.store(s.get(), k.arg["new_state"], k.add(srow[r], 4 * i))
    return k.finish()


def _exp(k: Kernel, x: ir.Value) -> ir.Value:
    """libm's double exp of an f32, rounded to f32 once (glibc's expf, which ggml calls, is within an ulp)."""
    return k.b.fptrunc(k.intrinsic("llvm.exp.f64", f64, [k.b.fpext(x, f64)]), f32)


def _dots(k: Kernel, pieces, pairs: list, W: int) -> list[ir.Value]:
    """The dots a · c of each (a, c) pair of rows (held as ``pieces``): whole vectors by fma into two
    accumulators each, the accumulators of all pairs reduced together (``_reduce``), then the lanes of a
    narrower last vector fused in one by one."""
    b = k.b
    accs = []
    for a, c in pairs:
        acc = [None, None]
        for n, ((i, w), x, y) in enumerate(zip(pieces, a, c)):
            if w == W:
                acc[n % 2] = b.fmul(x, y) if acc[n % 2] is None else _fma(k, x, y, acc[n % 2])
        accs.append(acc[0] if acc[1] is None else b.fadd(acc[0], acc[1]))
    totals = _reduce(k, accs) if accs[0] is not None else [None] * len(pairs)
    out = []
    for total, (a, c) in zip(totals, pairs):
        for (i, w), x, y in zip(pieces, a, c):
            if w == W:
                continue
            for lane in range(w):
                at = ir.Constant(i32, lane)
                xe, ye = b.extract_element(x, at), b.extract_element(y, at)
                total = b.fmul(xe, ye) if total is None else _fma(k, xe, ye, total)
        out.append(total)
    return out


def _reduce(k: Kernel, vs: list[ir.Value]) -> list[ir.Value]:
    """The lane sums of n vectors of W lanes, halving all of them at once: vectors are paired, each pair
    becoming one vector of both halves' sums (one add per pair), until one vector holds every vector's
    partial sums in segments, whose halves are then added within it down to a lane each."""
    b = k.b
    W = vs[0].type.count
    n = len(vs)
    if W == 1:
        return [b.extract_element(v, ir.Constant(i32, 0)) for v in vs]
    if n & (n - 1):                                              # a power of two first, then the rest
        top = 1 << (n.bit_length() - 1)
        return _reduce(k, vs[:top]) + _reduce(k, vs[top:])
    seg = W                                                      # lanes per segment; each vector: segments in order
    items = [(v, [i]) for i, v in enumerate(vs)]                 # (vector, the vectors its segments sum)
    while len(items) > 1 and seg > 1:
        count = W // seg                                         # segments per vector
        halves = [[g * seg + j for g in range(count) for j in range(lo, lo + seg // 2)] for lo in (0, seg // 2)]
        pick = [hv + [W + i for i in hv] for hv in halves]       # both vectors' first halves, then second halves
        items = [(b.fadd(k.shuffle(v, pick[0], u), k.shuffle(v, pick[1], u)), ids + ids2)
                 for (v, ids), (u, ids2) in zip(items[0::2], items[1::2])]
        seg //= 2
    out: dict[int, ir.Value] = {}
    for v, ids in items:
        width = v.type.count
        while width > len(ids):                                  # segments of more than one lane left
            s = width // len(ids)
            halves = [[g * s + j for g in range(len(ids)) for j in range(lo, lo + s // 2)] for lo in (0, s // 2)]
            v = b.fadd(k.shuffle(v, halves[0]), k.shuffle(v, halves[1]))
            width //= 2
        for lane, i in enumerate(ids):
            out[i] = b.extract_element(v, ir.Constant(i32, lane))
    return [out[i] for i in range(n)]
