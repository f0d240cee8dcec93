"""Grouped steps of the expert-indexed matmul: the step's (token, expert) pairs sorted by expert, each
expert's tokens packed together in the activation layout its gemm reads, then that gemm per expert.

    qmatmul_experts_pack_<fmt>_k<K>_n<N>_e<E>_j<k>_l<L>_g<from>_<target>(xq: ptr [T rows], ids: ptr i32 [T, k],
        order: ptr i32 [T*k], xg: ptr, y: ptr f32 [T, k, N], status: ptr i64 [2], T, ith, nth)

Every thread counts the pairs per expert itself (T·k ids, read-only), so the sort needs no barrier of its
own: expert e's pairs are positions offsets[e] .. offsets[e+1] of the sort (stable: in token order), and
its packed tokens start at group gstart[e] of ``xg`` (groups of L tokens, each expert's last one padded
with zeros; L = 1 is act_quant's row layout, L = GROUP its gemm's interleaved groups). ``pack`` copies
each pair's quantised row (``xq``, quantised once per token, one row per token) into its place and writes
``order`` (position -> pair); the matmul kernel (experts.py) then runs the rows x tokens of each expert with
enough tokens through the gemm into ``ys`` (in sorted order) and copies each row back to y[t, j]
(``scatter``), and each token of an expert with fewer through the decode row dot, into y[t, j] directly. A
pair whose id is outside [0, E) is left out of the sort; ``pack`` zeroes its row of y and reports it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from llvmlite import ir

from ggraph.backends.llvm.kernels.act_quant import GROUP, ActLayout, _zero_lane
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i16, i32, i64, vec
from ggraph.backends.llvm.kernels.plan import Method
from ggraph.backends.llvm.target import Target


def lanes(method: Method) -> int:
    """Tokens per group of packed activations: the gemm takes tokens as lanes in groups of GROUP; the rows
    gemm and the scalar twin read one row per token."""
    return GROUP if method is Method.GEMM else 1


def grouped_step(k: Kernel, E: int, k_per: int, group_from: int) -> ir.Value:
    """True (i1) if this step sorts its pairs by expert: T·k >= group_from·E."""
    return k.b.icmp_signed(">=", k.b.mul(k.arg["T"], k.i64(k_per)), k.i64(group_from * E))


@dataclass(frozen=True)
class Sort:
    """One thread's private counting sort of the step's pairs: i64 arrays (allocas) ``offsets`` [E+1] (the
    first sorted position of each expert's pairs; offsets[E]: the pairs with a valid id) and ``gstart``
    [E+1] (the first packed group of each expert)."""

    offsets: ir.Value
    gstart: ir.Value

    def at(self, k: Kernel, arr: ir.Value, e) -> ir.Value:
        return k.load(i64, arr, k.mul(e, 8))


def count(k: Kernel, E: int, k_per: int, L: int) -> Sort:
    """Count the pairs of each expert and lay the sort out (ids outside [0, E) are not counted)."""
    b = k.b
    counts, offsets, gstart = (k.scratch(i64, E + 1) for _ in range(3))
    with k.loop(0, E, name="zero") as e:
        k.store(k.i64(0), counts, k.mul(e, 8))
    with k.loop(0, b.mul(k.arg["T"], k.i64(k_per)), name="count") as q:
        e = _expert(k, q)
        with k.if_then(_valid(k, e, E)):
            at = k.mul(e, 8)
            k.store(k.add(k.load(i64, counts, at), 1), counts, at)
    k.store(k.i64(0), offsets)
    k.store(k.i64(0), gstart)
    with k.loop(0, E, name="prefix") as e:
        n = k.load(i64, counts, k.mul(e, 8))
        nxt = k.mul(k.add(e, 1), 8)
        k.store(k.add(k.load(i64, offsets, k.mul(e, 8)), n), offsets, nxt)
        k.store(k.add(k.load(i64, gstart, k.mul(e, 8)), b.sdiv(k.add(n, L - 1), k.i64(L))), gstart, nxt)
    return Sort(offsets, gstart)


def _pair(k: Kernel, p) -> ir.Value:
    """The pair (t·k + j) at sorted position p."""
    return k.b.sext(k.load(i32, k.arg["order"], k.mul(p, 4)), i64)


def _expert(k: Kernel, q) -> ir.Value:
    return k.b.sext(k.load(i32, k.arg["ids"], k.mul(q, 4)), i64)


def _valid(k: Kernel, e, E: int) -> ir.Value:
    b = k.b
    return b.and_(b.icmp_signed(">=", e, k.i64(0)), b.icmp_signed("<", e, k.i64(E)))


def expert_pack(module: ir.Module, fmt: str, K: int, N: int, E: int, k_per: int, L: int, group_from: int,
                target: Target) -> str:
    """Emit (once) the pack kernel of a grouped step (a no-op below ``group_from`` tokens per expert)."""
    name = f"qmatmul_experts_pack_{fmt}_k{K}_n{N}_e{E}_j{k_per}_l{L}_g{group_from}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("xq", "ids", "order", "xg", "y", "status"))
    b = k.b
    lay = ActLayout(fmt, K)
    with k.if_then(grouped_step(k, E, k_per, group_from)):
        sort = count(k, E, k_per, L)
        valid = sort.at(k, sort.offsets, E)
        p0, p1 = k.thread_share(valid)
        cursor = k.scratch(i64, E)
        with k.loop(0, E, name="cur") as e:
            k.store(sort.at(k, sort.offsets, e), cursor, k.mul(e, 8))
        first = b.icmp_signed("==", k.arg["ith"], ir.Constant(i32, 0))
        with k.loop(0, b.mul(k.arg["T"], k.i64(k_per)), name="pair") as q:
            e = _expert(k, q)
            with b.if_else(_valid(k, e, E)) as (good, bad):
                with good:
                    p = k.load(i64, cursor, k.mul(e, 8))
                    k.store(k.add(p, 1), cursor, k.mul(e, 8))
                    mine = b.and_(b.icmp_signed(">=", p, p0), b.icmp_signed("<", p, p1))
                    with k.if_then(mine):
                        k.store(b.trunc(q, i32), k.arg["order"], k.mul(p, 4))
                        local = b.sub(p, sort.at(k, sort.offsets, e))
                        g = k.add(sort.at(k, sort.gstart, e), b.sdiv(local, k.i64(L)))
                        src = k.addr(k.arg["xq"], k.mul(b.sdiv(q, k.i64(k_per)), lay.group_bytes(1)))
                        _copy_row(k, lay, L, src, k.addr(k.arg["xg"], k.mul(g, lay.group_bytes(L))),
                                  b.srem(local, k.i64(L)))
                with bad:
                    with k.if_then(first):
                        k.store(ir.Constant(i64, 1), k.arg["status"])
                        k.store(e, k.arg["status"], 8)
                        with k.loop(0, N, name="zero_y") as n:
                            k.store(ir.Constant(f32, 0.0), k.arg["y"], k.mul(k.add(k.mul(q, N), n), 4))
        if L > 1:                                      # each expert's last group: zero the lanes past its tokens
            e0, e1 = k.thread_share(E)
            with k.loop(e0, e1, name="pad") as e:
                n = b.sub(sort.at(k, sort.offsets, k.add(e, 1)), sort.at(k, sort.offsets, e))
                used = b.srem(n, k.i64(L))
                with k.if_then(b.icmp_signed(">", used, k.i64(0))):
                    g = k.add(sort.at(k, sort.gstart, e), b.sdiv(n, k.i64(L)))
                    base = k.addr(k.arg["xg"], k.mul(g, lay.group_bytes(L)))
                    with k.loop(used, L, name="lane") as lane:
                        _zero_lane(k, lay, L, base, lane)
    return k.finish()


def _copy_row(k: Kernel, lay: ActLayout, L: int, src, dst, lane) -> None:
    """One token's quantised row (act_quant's row layout) into lane ``lane`` of the group at ``dst``."""
    if L == 1:
        v = vec(i32, 16)
        with k.loop(0, lay.group_bytes(1) // 64, name="line") as c:
            k.store(k.load(v, src, k.mul(c, 64)), dst, k.mul(c, 64))
        return
    with k.loop(0, lay.K // 4, name="w") as w:
        k.store(k.load(i32, src, lay.qs(k, 1, w)), dst, lay.qs(k, L, w, lane))
    with k.loop(0, lay.K // lay.block, name="d") as blk:
        k.store(k.load(f32, src, lay.d(k, 1, blk)), dst, lay.d(k, L, blk, lane))
    with k.loop(0, lay.K // lay.sum_block, name="s") as s:
        k.store(k.load(i16, src, lay.sums(k, 1, s)), dst, lay.sums(k, L, s, lane))
    if lay.has_sums32:
        with k.loop(0, lay.K // 32, name="s32") as s:
            k.store(k.load(i16, src, lay.sums32(k, 1, s)), dst, lay.sums32(k, L, s, lane))


def grouped_units(k: Kernel, E: int, k_per: int, N: int, L: int, w_bytes: int, x_row: int, group_bytes: int,
                  chunk: int, gemm_from: int, rows, row_dot) -> None:
    """The grouped step in the matmul kernel: units (expert, chunk of ``chunk`` rows), expert by expert, taken
    in turn (``counter``): thread ith starts at unit ith, then takes the next nobody has. A unit of an expert
    with ``gemm_from`` tokens or more binds the expert's matrix, packed tokens and rows of ``ys`` and runs
    ``rows((r0, r1))`` (the gemm), then copies those rows of each of its tokens to y[t, j]; with fewer, each
    of its tokens runs ``row_dot((r0, r1))`` (the decode dot, on the token's row of ``xq``) into y[t, j]."""
    b = k.b
    sort = count(k, E, k_per, L)
    chunks = (N + chunk - 1) // chunk
    nth = b.sext(k.arg["nth"], i64)
    first = b.sext(k.arg["ith"], i64)
    pre = b.block
    head = k.fn.append_basic_block("unit.head")
    body = k.fn.append_basic_block("unit.body")
    done = k.fn.append_basic_block("unit.done")
    b.branch(head)
    b.position_at_end(head)
    u = b.phi(i64, name="unit")
    u.add_incoming(first, pre)
    b.cbranch(b.icmp_signed("<", u, k.i64(E * chunks)), body, done)
    b.position_at_end(body)
    e, c = b.sdiv(u, k.i64(chunks)), b.srem(u, k.i64(chunks))
    off = sort.at(k, sort.offsets, e)
    n_tok = b.sub(sort.at(k, sort.offsets, k.add(e, 1)), off)
    r0 = k.mul(c, chunk)
    r1 = b.select(b.icmp_signed("<", k.add(r0, chunk), k.i64(N)), k.add(r0, chunk), k.i64(N))
    w = k.addr(k.arg["w"], k.mul(e, w_bytes))
    with b.if_else(b.icmp_signed(">=", n_tok, k.i64(gemm_from))) as (many, few):
        with many:
            ys = k.addr(k.arg["ys"], k.mul(off, 4 * N))
            with bound(k, w=w, T=n_tok, y=ys, xq=k.addr(k.arg["xg"], k.mul(sort.at(k, sort.gstart, e), group_bytes))):
                rows((r0, r1))
            with k.loop(0, n_tok, name="scatter") as i:
                q = _pair(k, k.add(off, i))
                src = k.addr(ys, k.mul(k.add(k.mul(i, N), r0), 4))
                dst = k.addr(k.arg["y"], k.mul(k.add(k.mul(q, N), r0), 4))
                with k.loop(0, b.sub(r1, r0), name="n") as n:
                    k.store(k.load(f32, src, k.mul(n, 4)), dst, k.mul(n, 4))
        with few:
            with k.loop(0, n_tok, name="token") as i:
                q = _pair(k, k.add(off, i))
                x = k.addr(k.arg["xq"], k.mul(b.sdiv(q, k.i64(k_per)), x_row))
                with bound(k, w=w, T=k.i64(1), y=k.addr(k.arg["y"], k.mul(q, 4 * N)), xq=x):
                    row_dot((r0, r1))
    taken = b.atomic_rmw("add", k.arg["counter"], ir.Constant(i32, 1), "monotonic")
    u.add_incoming(b.add(nth, b.sext(taken, i64)), b.block)
    b.branch(head)
    b.position_at_end(done)


@contextmanager
def bound(k: Kernel, **values):
    """The matmul pieces read their operands through ``k.arg``: for the body, one expert's matrix, its
    tokens' activations, their output rows and their count stand there."""
    saved = {name: k.arg[name] for name in values}
    k.arg.update(values)
    try:
        yield
    finally:
        k.arg.update(saved)
