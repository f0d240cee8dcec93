"""The expert-indexed matmul: each token times its chosen experts, read straight from the [E, N, K] weight.

    qmatmul_experts_<wtype>_k<K>_n<N>_e<E>_j<k>[_g<g>m<m>]_<target>(w: ptr [E, N, K], x: ptr,
        ids: ptr i32 [T, k], y: ptr f32 [T, k, N], status: ptr i64 [2], [order: ptr, xg: ptr, ys: ptr,
        counter: ptr,] T, ith, nth)

For block weights x arrives quantised by act_quant with one row per token (its rows_only layout); for
float weights (f32, f16, bf16) it is f32 [T, K]. Which arithmetic runs is the plan's (plan.experts_plan):

- Below ``group_from`` tokens per expert (decode), work units are (token t, expert slot j, chunk of rows):
  a unit reads ids[t, j] and runs the decode row dot of its weight type (gemv's, or the scalar twin's;
  fmatmul's for float weights) over the chunk's rows of that expert, so only the chosen experts' blocks are
  read. Threads split the units statically. An id outside [0, E) is never read: that unit's rows of y are
  zeroed and {1, id} goes to ``status``, which the run turns into an error.
- From there (block weights; prefill), the pack kernel before it (by_expert.py) has sorted the pairs by
  expert and packed each expert's tokens into ``xg`` (``order``: sorted position -> pair); units are
  (expert, chunk of rows), taken in turn through ``counter`` since experts get unequal numbers of tokens.
  A unit of an expert with ``gemm_from`` tokens or more runs the prefill gemm (gemm, rows gemm or the scalar
  twin) on its rows x tokens into ``ys`` and copies the rows to y[t, j]; with fewer, each token the decode
  row dot. Each chosen expert's blocks are read once a step (from cache after its first token).

Float experts and rows_only programs (a batch, every token computed as if alone) keep the per-token units at
every T (``order``, ``xg``, ``ys`` and ``counter`` unused).
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels.act_quant import ActLayout
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i32
from ggraph.backends.llvm.kernels.fmatmul import _Fmatmul, _tile
from ggraph.backends.llvm.kernels.isa import PORTABLE_LANES, Isa
from ggraph.backends.llvm.kernels.plan import Method, experts_plan, fmatmul_plan
from ggraph.backends.llvm.kernels.qmatmul.by_expert import bound, grouped_step, grouped_units, lanes
from ggraph.backends.llvm.kernels.qmatmul.context import Matmul
from ggraph.backends.llvm.kernels.qmatmul.gemm import gemm
from ggraph.backends.llvm.kernels.qmatmul.rows_gemm import rows_gemm
from ggraph.backends.llvm.kernels.qmatmul.gemv import gemv, steps_order
from ggraph.backends.llvm.kernels.qmatmul.scalar import scalar
from ggraph.backends.llvm.target import Target


def qmatmul_experts(module: ir.Module, dtype, K: int, N: int, E: int, k_per: int, target: Target,
                    rows_only: bool = False) -> str:
    """Emit (once) y[t, j] = x[t] @ w[ids[t, j]].T for experts w (E, N, K) of ``dtype``, k_per experts per
    token; returns its name."""
    dt = dtypes.from_name(dtype)
    plan = experts_plan(dt, N, target, rows_only)
    grouped = plan.grouped is not None
    tag = f"_g{plan.group_from}m{plan.gemm_from}" if grouped else ""
    name = f"qmatmul_experts_{dt.name}_k{K}_n{N}_e{E}_j{k_per}{tag}_{target.name}"
    if Kernel.exists(module, name):
        return name
    x_arg = "x" if plan.matmul is None else "xq"
    k = Kernel(module, name, ("w", x_arg, "ids", "y", "status") + (("order", "xg", "ys", "counter") if grouped else ()))
    isa = Isa(k, target)
    if plan.matmul is None:
        x_row, w_bytes, rows = 4 * K, N * dt.row_bytes(K), _float_rows(k, isa, dt, K, N, target)
    else:
        m = Matmul(k, isa, plan.matmul, ActLayout(plan.matmul.fmt.act, K), N)
        if K % dt.block_size:
            raise ValueError(f"qmatmul_experts {dt.name}: K={K} is not a multiple of {dt.block_size}")
        x_row, w_bytes, rows = m.lay.group_bytes(1), N * dt.row_bytes(K), _quant_rows(m)
    if not grouped:
        _per_token(k, E, k_per, N, plan.chunk_rows, x_arg, x_row, w_bytes, rows)
        return k.finish()
    L = lanes(plan.grouped)
    with k.b.if_else(grouped_step(k, E, k_per, plan.group_from)) as (by_expert, per_token):
        with by_expert:
            grouped_units(k, E, k_per, N, L, w_bytes, x_row, m.lay.group_bytes(L), plan.chunk_rows, plan.gemm_from,
                          _group_rows(m, L), rows)
        with per_token:
            _per_token(k, E, k_per, N, plan.chunk_rows, x_arg, x_row, w_bytes, rows)
    return k.finish()


def _per_token(k: Kernel, E: int, k_per: int, N: int, chunk: int, x_arg: str, x_row: int, w_bytes: int, rows):
    """Units (token, expert slot, chunk of rows), split statically, each the decode row dot on one expert."""
    b = k.b
    chunks = (N + chunk - 1) // chunk
    start, end = k.thread_share(b.mul(k.arg["T"], k.i64(k_per * chunks)))
    with k.loop(start, end, name="unit") as u:
        tj, c = b.sdiv(u, k.i64(chunks)), b.srem(u, k.i64(chunks))
        t = b.sdiv(tj, k.i64(k_per))
        expert = b.sext(k.load(i32, k.arg["ids"], k.mul(tj, 4)), ir.IntType(64))
        r0 = k.mul(c, chunk)
        r1 = b.select(b.icmp_signed("<", k.add(r0, chunk), k.i64(N)), k.add(r0, chunk), k.i64(N))
        y = k.addr(k.arg["y"], k.mul(tj, 4 * N))
        ok = b.and_(b.icmp_signed(">=", expert, k.i64(0)), b.icmp_signed("<", expert, k.i64(E)))
        with b.if_else(ok) as (good, bad):
            with good:
                with bound(k, w=k.addr(k.arg["w"], k.mul(expert, w_bytes)),
                           **{x_arg: k.addr(k.arg[x_arg], k.mul(t, x_row))}, y=y, T=k.i64(1)):
                    rows((r0, r1))
            with bad:
                k.store(ir.Constant(ir.IntType(64), 1), k.arg["status"])
                k.store(expert, k.arg["status"], 8)
                with k.loop(r0, r1, name="zero") as n:
                    k.store(ir.Constant(f32, 0.0), y, k.mul(n, 4))


def _group_rows(m: Matmul, L: int):
    """Rows [r0, r1) of the bound expert for its bound tokens (packed in groups of L): the plan's gemm."""
    def rows(span):
        if m.plan.many is Method.GEMM:
            gemm(m, span)
        elif m.plan.many is Method.ROWS_GEMM:
            rows_gemm(m, span)
        elif m.plan.many is Method.SCALAR:
            scalar(m, span, L)
        else:
            raise ValueError(f"qmatmul_experts {m.fmt.dtype.name}: no grouped arithmetic {m.plan.many.value}")
    return rows


def _quant_rows(m: Matmul):
    """Rows [r0, r1) of the bound expert for the bound token: the plan's decode method."""
    def rows(span):
        if m.plan.one is Method.GEMV:
            gemv(m, span, steps_order(m))
        elif m.plan.one is Method.SCALAR:
            scalar(m, span, 1)
        else:
            raise ValueError(f"qmatmul_experts {m.fmt.dtype.name}: no row dot for method {m.plan.one.value}")
    return rows


def _float_rows(k: Kernel, isa: Isa, dt, K: int, N: int, target: Target):
    """Rows [r0, r1) of the bound float expert for the bound token: fmatmul's row dot, one row at a time."""
    plan = fmatmul_plan(target)
    f = _Fmatmul(k, isa, dt, K, N, target.vector_bits // 32 if plan.vector else PORTABLE_LANES)

    def rows(span):
        with k.loop(*span, name="n") as n:
            _tile(f, n, 1, k.i64(0), 1)
    return rows
