"""What every piece of one quantised matmul kernel shares, and the small helpers they all use."""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ggraph.backends.llvm.kernels.act_quant import ActLayout
from ggraph.backends.llvm.kernels.blocks import BlockFormat
from ggraph.backends.llvm.kernels.builder import Kernel
from ggraph.backends.llvm.kernels.isa import Isa
from ggraph.backends.llvm.kernels.plan import QmatmulPlan


@dataclass(frozen=True)
class Matmul:
    """One qmatmul kernel being emitted: its builder, instructions, plan, activation layout and rows."""

    k: Kernel
    isa: Isa
    plan: QmatmulPlan
    lay: ActLayout
    N: int

    @property
    def fmt(self) -> BlockFormat:
        return self.plan.fmt

    @property
    def subs(self) -> int:
        """Sub-blocks (scales) per block."""
        return self.fmt.dtype.block_size // self.fmt.sub

    def row(self, n, blk) -> ir.Value:
        """Address of block `blk` of weight row n (file layout)."""
        k = self.k
        row_bytes = self.fmt.dtype.row_bytes(self.lay.K)
        return k.addr(k.arg["w"], k.add(k.mul(n, row_bytes), k.mul(blk, self.fmt.dtype.type_size)))

    def chunk_subs(self, c) -> list:
        """Sub-blocks (scale indices) inside 32-weight chunk c (an int or i64 value)."""
        k = self.k
        return [c] if self.fmt.sub == 32 else [k.mul(c, 2), k.add(k.mul(c, 2), 1)]

    def xsum(self, L: int, base, blk, s):
        """Sum of the quantised activations of sub-block s of block blk: <L x i32>, one lane per token."""
        k, fmt, lay = self.k, self.fmt, self.lay
        per = fmt.sub // lay.sum_block                   # activation sum blocks per sub-block
        first = k.add(k.mul(blk, fmt.dtype.block_size // lay.sum_block), k.mul(s, per))
        return sum_of(k, [lay.load_sums(k, base, L, k.add(first, p), L) for p in range(per)])


def sum_of(k: Kernel, values: list) -> ir.Value:
    total = values[0]
    for v in values[1:]:
        total = k.b.add(total, v)
    return total


def launder(k: Kernel, p: ir.Value) -> ir.Value:
    """p, through an empty inline asm: the same address, but LLVM can no longer tell, so loads
    through it are neither merged with loads through p nor fed from stores through p."""
    asm = ir.InlineAsm(ir.FunctionType(ir.PointerType(), [ir.PointerType()]), "", "=r,0")
    return k.b.call(asm, [k.b.bitcast(p, ir.PointerType())])
