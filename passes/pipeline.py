"""Named pipelines: one straight list of pass names each (``ggraph.passes.resolve`` turns one into passes)."""
from __future__ import annotations

PIPELINES: dict[str, tuple[str, ...]] = {
    # the optimising pipeline
    "default": ("dce", "cse", "fold",
                "fuse_rope_attention",      # rope(q), rope(k), cache write, attention -> rope_attention
                "fuse_recurrent",           # causal_conv, ssm_scan -> one kernel each
                "inline_unfusable",         # other composites no kernel takes whole -> their primitives
                "fuse_dequant_matmul",      # matmul(x, dequant(w)) -> qmatmul(x, w): weights stay in blocks
                "fuse_elementwise",         # elementwise chains, row reductions, their composites -> fused loops
                "plan_memory"),             # activation buffers by liveness, in place where safe
    # the unfused baseline: plain primitives with explicit dequant
    "none": ("inline_composites", "dce", "cse", "fold"),
}
# the optimising pipeline that also outputs each weight matmul's input squares (ggraph imatrix):
# instrument_imatrix right after fuse_dequant_matmul, so that fuse_elementwise fuses what it adds
_fused = PIPELINES["default"].index("fuse_dequant_matmul") + 1
PIPELINES["imatrix"] = PIPELINES["default"][:_fused] + ("instrument_imatrix",) + PIPELINES["default"][_fused:]
