"""The expert-indexed matmul: each token times its chosen experts, read straight from the [E, N, K] weight.

    qmatmul_experts_<wtype>_k<K>_n<N>_e<E>_j<k>_<target>(w: ptr [E, N, K], x: ptr, ids: ptr i32 [T, k],
                                                          y: ptr f32 [T, k, N], status: ptr i64 [2], T, ith, nth)

For block weights x arrives quantised by act_quant with one row per token (its rows_only layout); for
float weights (f32, f16, bf16) it is f32 [T, K]. Work units are (token t, expert slot j, chunk of rows):
a unit reads ids[t, j] and runs the decode row dot of its weight type (plan.experts_plan: gemv's, or the
scalar twin's; fmatmul's for float weights) over the chunk's rows of that expert, so only the chosen
experts' blocks are read. Threads split the units statically. An id outside [0, E) is never read: that
unit's rows of y are zeroed and {1, id} goes to ``status``, which the run turns into an error.

Prefill (T > 1) runs the same per-token arithmetic; grouping the tokens by expert into the gemm kernels
(gemm, rows gemm, AMX tiles) is the next step.
"""
from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels.act_quant import ActLayout
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i32
from ggraph.backends.llvm.kernels.fmatmul import _Fmatmul, _tile
from ggraph.backends.llvm.kernels.isa import PORTABLE_LANES, Isa
from ggraph.backends.llvm.kernels.plan import Method, experts_plan, fmatmul_plan
from ggraph.backends.llvm.kernels.qmatmul.context import Matmul
from ggraph.backends.llvm.kernels.qmatmul.gemv import gemv, steps_order
from ggraph.backends.llvm.kernels.qmatmul.scalar import scalar
from ggraph.backends.llvm.target import Target


def qmatmul_experts(module: ir.Module, dtype, K: int, N: int, E: int, k_per: int, target: Target) -> str:
    """Emit (once) y[t, j] = x[t] @ w[ids[t, j]].T for experts w (E, N, K) of ``dtype``, k_per experts per
    token; returns its name."""
    dt = dtypes.from_name(dtype)
    plan = experts_plan(dt, N, target)
    name = f"qmatmul_experts_{dt.name}_k{K}_n{N}_e{E}_j{k_per}_{target.name}"
    if Kernel.exists(module, name):
        return name
    x_arg = "x" if plan.matmul is None else "xq"
    k = Kernel(module, name, ("w", x_arg, "ids", "y", "status"))
    b = k.b
    isa = Isa(k, target)
    if plan.matmul is None:
        x_row, w_bytes, rows = 4 * K, N * dt.row_bytes(K), _float_rows(k, isa, dt, K, N, target)
    else:
        m = Matmul(k, isa, plan.matmul, ActLayout(plan.matmul.fmt.act, K), N)
        if K % dt.block_size:
            raise ValueError(f"qmatmul_experts {dt.name}: K={K} is not a multiple of {dt.block_size}")
        x_row, w_bytes, rows = m.lay.group_bytes(1), N * dt.row_bytes(K), _quant_rows(m)
    chunk = plan.chunk_rows
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
                with _bound(k, w=k.addr(k.arg["w"], k.mul(expert, w_bytes)),
                            **{x_arg: k.addr(k.arg[x_arg], k.mul(t, x_row))}, y=y, T=k.i64(1)):
                    rows((r0, r1))
            with bad:
                k.store(ir.Constant(ir.IntType(64), 1), k.arg["status"])
                k.store(expert, k.arg["status"], 8)
                with k.loop(r0, r1, name="zero") as n:
                    k.store(ir.Constant(f32, 0.0), y, k.mul(n, 4))
    return k.finish()


@contextmanager
def _bound(k: Kernel, **values):
    """The row-dot pieces read their operands through ``k.arg``: for the body, one expert's matrix, one
    token's activations, its output row and T = 1 stand there."""
    saved = {name: k.arg[name] for name in values}
    k.arg.update(values)
    try:
        yield
    finally:
        k.arg.update(saved)


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
