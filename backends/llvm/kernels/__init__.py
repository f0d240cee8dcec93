"""Kernel emitters, one family per file. Each adds one function with the kernel ABI
(`void f(ptr..., i64 T, i32 ith, i32 nth)`) to a caller's llvmlite module and returns
its name; asking twice for the same kernel returns the existing one.

    act_quant(module, fmt, K, target)            f32 [T, K] -> private q8 layout
    qmatmul(module, wtype, K, N, target)          GGUF blocks x quantised activations (rows taken in
    fmatmul(module, wtype, K, N, target)          f32 / f16 / bf16 weights x f32   turns: a work counter)
    get_rows(module, dtype, K, V, target, scale)  embedding gather + dequantisation
    dequant_rows(module, dtype, K, target)        contiguous rows of any weight type -> f32
    kv_store(module, dtype, n, target)            f32 rows -> f16 / bf16 / q8_0 / q4_0 cache rows

Which kernel runs for a matmul on a target (method, layout, tiles, prefetch) is plan.py's: lowering,
the kernels and `describe` (what `ggraph target` prints) read it.

Sizing: `act_bytes(act_format(wtype), T, K)` bytes of scratch for the activations.
"""
from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels import attention, delta_rule, elementwise, recurrent
from ggraph.backends.llvm.kernels import fmatmul as _fmatmul
from ggraph.backends.llvm.kernels import qmatmul as _qmatmul
from ggraph.backends.llvm.kernels.act_quant import GROUP, ActLayout, act_bytes, act_quant
from ggraph.backends.llvm.kernels.fmatmul import fmatmul, float_weight
from ggraph.backends.llvm.kernels.get_rows import dequant_rows, get_rows
from ggraph.backends.llvm.kernels.kv_rows import kv_store
from ggraph.backends.llvm.kernels.isa import vector_path
from ggraph.backends.llvm.kernels.plan import (EXPERT_CHUNK_ROWS, FORMATS, Layout, act_rows, experts_plan, layouts,
                                               qmatmul_plan)
from ggraph.backends.llvm.kernels.qmatmul import act_format, qmatmul
from ggraph.backends.llvm.target import Target

QUANT_TYPES = tuple(FORMATS)
FLOAT_TYPES = (dtypes.f32, dtypes.f16, dtypes.bf16)


def describe(target: Target) -> dict[str, str]:
    """Which kernel variant each op gets on `target`, e.g. {"qmatmul q4_k": "vpdpbusd-512: ..."}: the
    plan's (plan.py) in words."""
    how = "vector" if vector_path(target) else "scalar (generic twin)"
    layout = "one row per token" if act_rows(target) else f"tokens in groups of {GROUP}"
    out = {f"act_quant {fmt}": f"{how}; {layout}" for fmt in ("q8_0", "q8_1", "q8_k")}
    out.update({f"qmatmul {dt.name}": _qmatmul.variant(dt, target) for dt in QUANT_TYPES})
    out.update({f"fmatmul {dt.name}": _fmatmul.variant(dt, target) for dt in FLOAT_TYPES})
    out.update({f"get_rows {dt.name}": how for dt in QUANT_TYPES + FLOAT_TYPES})
    out["fused (elementwise)"] = elementwise.variant(target)
    out["rope_attention"] = attention.variant(target)
    out["causal_conv, ssm_scan"] = recurrent.variant(target)
    out["gated_delta_rule"] = delta_rule.variant(target)
    grouped = experts_plan(dtypes.q4_k, EXPERT_CHUNK_ROWS, target)
    out["qmatmul_experts"] = (f"decode: each token's chosen experts, {EXPERT_CHUNK_ROWS} rows a unit, with the decode "
                              f"dot of the weight type (qmatmul above); from {grouped.group_from} token per expert, "
                              f"tokens sorted by expert: an expert's {grouped.gemm_from}+ tokens by the "
                              f"{grouped.grouped.value}, fewer by the decode dot, (expert, rows) units taken in turn; "
                              f"float experts and batches per token")
    out["routing"] = "top_k, argmax, take_along_axis, segment_sum: scalar loops, vectorised by LLVM where contiguous"
    return out


__all__ = ["ActLayout", "FLOAT_TYPES", "GROUP", "Layout", "QUANT_TYPES", "act_bytes", "act_format", "act_quant",
           "dequant_rows", "describe", "float_weight", "fmatmul", "get_rows", "kv_store", "layouts", "qmatmul",
           "qmatmul_plan"]
