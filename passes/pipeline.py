"""Named pipelines: one straight list of pass names each."""
from __future__ import annotations

from typing import Iterable, Sequence

PIPELINES: dict[str, tuple[str, ...]] = {
    # the optimising pipeline
    "default": ("dce", "cse", "fold",
                "fuse_rope_attention",      # rope(q), rope(k), cache write, attention -> rope_attention
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


def pipeline(passes: str | Sequence[str] = "default", disabled: Iterable[str] = ()) -> list[str]:
    """Pass names for a pipeline name or an explicit list, minus ``disabled``."""
    if isinstance(passes, str):
        if passes not in PIPELINES:
            raise KeyError(f"unknown pipeline {passes!r}; named pipelines: {', '.join(PIPELINES)} "
                           f"(or give a list of pass names)")
        names = list(PIPELINES[passes])
    else:
        names = list(passes)
    disabled = set(disabled)
    return [n for n in names if n not in disabled]
