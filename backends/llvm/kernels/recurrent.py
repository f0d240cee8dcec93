"""Kernels of the recurrent layers: the causal depthwise convolution with carried state, and Mamba-2's
selective scan (``ggraph/ir/recurrent.py`` states both ops).

    causal_conv_c<C>_k<K>[_bias][_overwrite]_<target>(x, state, w, [bias,] y, new_state, i64 T, ith, nth)
        y[t, c] = sum_k w[c, k]·xx[t+k, c] (+ bias[c]), new_state = xx[T:], xx = concat(state, x)
    ssm_decay_h<H>_<target>(dt, A, decay, i64 T, ith, nth)
        decay[t, h] = (softplus(dt[t, h]), exp(softplus(dt[t, h])·A[h]))   ggml's f32 steps, exp and log rounded once
    ssm_scan_h<H>_d<D>_n<N>_g<G>[_overwrite]_<target>(state, x, decay, B, C, y, new_state, i64 T, ith, nth)
        per token: state[h, r] = fma(state[h, r], dA, B[t, g]·x[t, h, r]·dt'), y[t, h, r] = state[h, r]·C[t, g]

One pass serves prefill (T > 1) and decode (T = 1). The conv splits channels across threads in blocks of
16 (a vector; the generic twin takes them one at a time): each block loads its K weight columns and its
K-1 state rows into registers once, walks the T tokens with a sliding window of the last K-1 inputs, and
stores the window as new_state at the end. The scan splits (head, rows) units across threads: a unit's
R rows of state (R·N values, R chosen so they fit in registers) stay in registers for all T tokens and
share each token's B and C loads; a token's softplus and decay per head come from ``ssm_decay``, run
before it. Its dot with C sums as ggml's AVX-512 loop does (``ggraph.ir.recurrent.np_ssm_scan``): each
64 states into 4 × 16 lane accumulators, combined pairwise then halved lane-wise, then the states past
the last whole 64 fused in one at a time; the generic twin keeps that order one lane at a time. Every
product that ggml's C fuses is an ``llvm.fma`` (one rounding on every target), so the kernels give the
numpy rules' bits.
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.backends.llvm.kernels.builder import Kernel, f32, f64, i32, mangle, vec
from ggraph.backends.llvm.kernels.isa import vector_path
from ggraph.backends.llvm.target import Target
from ggraph.ir.recurrent import SCAN_CHUNK, SCAN_LANES, SOFTPLUS_LINEAR

STATE_REGISTERS = 16      # vectors of 16 f32 a scan unit keeps its rows' state in (of AVX-512's 32)


def variant(target: Target) -> str:
    """How the recurrent kernels run on ``target`` (for ``ggraph target``)."""
    how = "16 channels a vector" if vector_path(target) else "one channel at a time (generic twin)"
    return (f"causal_conv: {how}, weights and window in registers; ssm_scan: state rows in registers across "
            f"tokens, ggml's 4 x 16 lane dot order")


def _lanes(target: Target) -> int:
    return SCAN_LANES if vector_path(target) else 1


def _fma(k: Kernel, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a·b + c rounded once on every target (llvm.fma), as ggml's C compiled with FMA computes it."""
    return k.intrinsic(f"llvm.fma.{mangle(a.type)}", a.type, [a, b, c])


# ---------------------------------------------------------------------------------------
# causal_conv
# ---------------------------------------------------------------------------------------

def causal_conv(module: ir.Module, C: int, K: int, bias: bool, target: Target, overwrite: bool = False) -> str:
    """Emit (once) the causal conv over C channels with K taps; returns its name. With ``overwrite``
    new_state may be state itself (a block stores its rows of it after it has read them)."""
    name = f"causal_conv_c{C}_k{K}{'_bias' if bias else ''}{'_overwrite' if overwrite else ''}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("x", "state", "w") + (("bias",) if bias else ()) + ("y", "new_state"), ("T",),
               noalias=not overwrite)
    W = _lanes(target)
    blocks = C // W                                   # whole vector blocks; the channels past them one at a time
    units = blocks + (C - blocks * W)
    start, end = k.thread_share(units)
    b = k.b
    lo = b.select(b.icmp_signed("<", end, k.i64(blocks)), end, k.i64(blocks))
    with k.loop(start, lo, name="blk") as blk:
        _conv_block(k, C, K, bias, b.mul(blk, k.i64(W)), W)
    if units > blocks:
        first = b.select(b.icmp_signed(">", start, k.i64(blocks)), start, k.i64(blocks))
        with k.loop(first, end, name="ch") as u:
            _conv_block(k, C, K, bias, b.add(b.sub(u, k.i64(blocks)), k.i64(blocks * W)), 1)
    return k.finish()


def _conv_block(k: Kernel, C: int, K: int, bias: bool, c0: ir.Value, W: int) -> None:
    """Channels c0..c0+W-1 for every token: weights and the window of the last K-1 inputs in registers."""
    b = k.b
    vt = vec(f32, W)
    row = lambda r: k.mul(k.add(k.mul(r, C), c0), 4)                            # noqa: E731  byte offset of [r, c0]
    wk = k.load(vec(f32, W * K), k.arg["w"], k.mul(c0, 4 * K))                 # W rows of K taps
    taps = [k.shuffle(wk, [j * K + i for j in range(W)]) for i in range(K)]   # tap i of each channel
    bias_v = k.load(vt, k.arg["bias"], k.mul(c0, 4)) if bias else None
    window = [k.var(vt, k.load(vt, k.arg["state"], row(r))) for r in range(K - 1)]   # oldest first
    with k.loop(0, k.arg["T"], name="t") as t:
        xin = k.load(vt, k.arg["x"], row(t))
        seen = [w.get() for w in window] + [xin]
        acc = b.fmul(seen[0], taps[0])
        for i in range(1, K):
            acc = _fma(k, seen[i], taps[i], acc)
        if bias:
            acc = b.fadd(acc, bias_v)
        k.store(acc, k.arg["y"], row(t))
        for w, v in zip(window, seen[1:]):
            w.set(v)
    for r, w in enumerate(window):
        k.store(w.get(), k.arg["new_state"], row(r))


# ---------------------------------------------------------------------------------------
# ssm_scan
# ---------------------------------------------------------------------------------------

def ssm_decay(module: ir.Module, H: int, target: Target) -> str:
    """Emit (once) the per-(token, head) softplus and decay: decay[t, h] = (dt', expf(dt'·A[h]))."""
    name = f"ssm_decay_h{H}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("dt", "A", "decay"), ("T",))
    b = k.b
    start, end = k.thread_share(b.mul(k.arg["T"], k.i64(H)))
    with k.loop(start, end, name="th") as th:
        d = k.load(f32, k.arg["dt"], k.mul(th, 4))
        e = _rounded(k, "exp", d)
        sp = _rounded(k, "log", b.fadd(ir.Constant(f32, 1.0), e))
        sp = b.select(b.fcmp_ordered(">", d, ir.Constant(f32, SOFTPLUS_LINEAR)), d, sp)
        h = b.srem(th, k.i64(H))
        dA = _rounded(k, "exp", b.fmul(sp, k.load(f32, k.arg["A"], k.mul(h, 4))))
        k.store(sp, k.arg["decay"], k.mul(th, 8))
        k.store(dA, k.arg["decay"], k.add(k.mul(th, 8), 4))
    return k.finish()


def _rounded(k: Kernel, fn: str, x: ir.Value) -> ir.Value:
    """libm's double ``fn`` of an f32, rounded to f32 once: the correctly rounded result (ggml's expf and
    logf are glibc's, within an ulp of it)."""
    return k.b.fptrunc(k.intrinsic(f"llvm.{fn}.f64", f64, [k.b.fpext(x, f64)]), f32)


def scan_rows(D: int, N: int) -> int:
    """Rows of one head a scan unit carries at once: as many (up to 4, dividing D) as fit STATE_REGISTERS."""
    per_row = -(-N // SCAN_LANES)
    return next(r for r in (4, 2, 1) if D % r == 0 and (r * per_row <= STATE_REGISTERS or r == 1))


def _pieces(N: int, W: int) -> list[tuple[int, int]]:
    """(first state, width) of the vectors a row of N states is held in: W wide, a narrower one at the end."""
    return [(i, min(W, N - i)) for i in range(0, N, W)]


def ssm_scan(module: ir.Module, H: int, D: int, N: int, G: int, target: Target, overwrite: bool = False) -> str:
    """Emit (once) the scan over T tokens for state [H, D, N] and B, C of G groups; returns its name. With
    ``overwrite`` new_state may be state itself (a unit stores its rows of it after it has read them)."""
    name = f"ssm_scan_h{H}_d{D}_n{N}_g{G}{'_overwrite' if overwrite else ''}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("state", "x", "decay", "B", "C", "y", "new_state"), ("T",), noalias=not overwrite)
    b = k.b
    W = _lanes(target)
    R = scan_rows(D, N)
    pieces = _pieces(N, W)
    whole = N - N % SCAN_CHUNK
    start, end = k.thread_share(H * (D // R))
    with k.loop(start, end, name="unit") as unit:
        h = b.sdiv(unit, k.i64(D // R))
        r0 = b.mul(b.srem(unit, k.i64(D // R)), k.i64(R))
        g = b.sdiv(h, k.i64(H // G))
        first = b.add(b.mul(h, k.i64(D)), r0)                                    # row h·D + r0 of [H·D]
        srow = [k.mul(b.add(first, k.i64(r)), 4 * N) for r in range(R)]          # byte offsets of state rows
        state = [[k.var(vec(f32, w), k.load(vec(f32, w), k.arg["state"], k.add(srow[r], 4 * i))) for i, w in pieces]
                 for r in range(R)]
        with k.loop(0, k.arg["T"], name="t") as t:
            th = b.add(b.mul(t, k.i64(H)), h)
            sp = k.load(f32, k.arg["decay"], k.mul(th, 8))
            dA = k.load(f32, k.arg["decay"], k.add(k.mul(th, 8), 4))
            bc = k.mul(b.add(b.mul(t, k.i64(G)), g), 4 * N)                      # B[t, g], C[t, g]
            Bv = [k.load(vec(f32, w), k.arg["B"], k.add(bc, 4 * i)) for i, w in pieces]
            Cv = [k.load(vec(f32, w), k.arg["C"], k.add(bc, 4 * i)) for i, w in pieces]
            xrow = k.mul(b.add(b.mul(th, k.i64(D)), r0), 4)                      # x[t, h, r0]
            for r in range(R):
                x_dt = b.fmul(k.load(f32, k.arg["x"], k.add(xrow, 4 * r)), sp)
                new = []
                for (i, w), s, Bi in zip(pieces, state[r], Bv):
                    v = _fma(k, s.get(), k.splat(dA, w), b.fmul(Bi, k.splat(x_dt, w)))
                    s.set(v)
                    new.append(v)
                k.store(_dot(k, pieces, new, Cv, whole, W), k.arg["y"], k.add(xrow, 4 * r))
        for r in range(R):
            for (i, w), s in zip(pieces, state[r]):
                k.store(s.get(), k.arg["new_state"], k.add(srow[r], 4 * i))
    return k.finish()


def _dot(k: Kernel, pieces, state: list, Cv: list, whole: int, W: int) -> ir.Value:
    """state · C in ggml's order: the first ``whole`` states into 4 × 16 lane accumulators, reduced, then
    the rest fused in one by one."""
    b = k.b
    per_acc = SCAN_LANES // W                          # vectors of one 16-lane accumulator
    zero = ir.Constant(vec(f32, W), [0.0] * W)
    acc = [zero] * (SCAN_CHUNK // W)                   # acc[j·per_acc + m]: lanes m·W.. of accumulator j
    for (i, w), s, c in zip(pieces, state, Cv):
        if i >= whole:
            break
        slot = (i % SCAN_CHUNK) // W
        acc[slot] = _fma(k, s, c, acc[slot])
    parts = [b.fadd(b.fadd(acc[m], acc[2 * per_acc + m]), b.fadd(acc[per_acc + m], acc[3 * per_acc + m]))
             for m in range(per_acc)]                  # (acc0 + acc2) + (acc1 + acc3), lane by lane
    while len(parts) > 1 or parts[0].type.count > 1:   # lane l + lane l + half, halving to one lane
        if len(parts) > 1:
            half = len(parts) // 2
            parts = [b.fadd(parts[m], parts[m + half]) for m in range(half)]
        else:
            lo, hi = k.split(parts[0], 2)
            parts = [b.fadd(lo, hi)]
    total = b.extract_element(parts[0], ir.Constant(i32, 0))
    for (i, w), s, c in zip(pieces, state, Cv):
        if i < whole:
            continue
        for lane in range(w):
            at = ir.Constant(i32, lane)
            total = _fma(k, b.extract_element(s, at), b.extract_element(c, at), total)
    return total
