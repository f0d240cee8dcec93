"""Matmul with float weights (f32, f16, bf16) and f32 activations: no act_quant.

    fmatmul_<wtype>_k<K>_n<N>_<target>(w: ptr [N, K], x: ptr f32 [T, K], y: ptr f32 [T, N], counter: ptr i32,
                                       T, ith, nth)

Threads take chunks of rows in turn, counted in ``counter`` (zero when the call starts), as
qmatmul's do. Lanes run along K: gemv keeps one accumulator
per row; gemm keeps an R x C tile of accumulators (rows x tokens) so each loaded weight
vector serves C tokens and each x vector serves R rows. K tails run scalar.

The generic twin sums in PORTABLE_LANES lanes with FMA rounded once: the order and rounding of
the AVX-512 kernel and of llama.cpp's f32 matmul there, so that f32 models agree across targets
to their accumulation, not to a sequential sum's larger error.
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i16, vec
from ggraph.backends.llvm.kernels.isa import PORTABLE_LANES, Isa
from ggraph.backends.llvm.kernels.plan import fmatmul_plan
from ggraph.backends.llvm.target import Target

#  dtype: (bytes, bits -> f32) for one element or a vector of them
FLOAT_LOADERS = {
    dtypes.f32: (4, None),
    dtypes.f16: (2, Isa.f16_to_f32),
    dtypes.bf16: (2, Isa.bf16_to_f32),
}
def float_weight(dtype) -> bool:
    """True for the weight types fmatmul takes."""
    return dtypes.from_name(dtype) in FLOAT_LOADERS


def variant(dtype, target: Target) -> str:
    """A one-line description of the kernel `fmatmul` emits on ``target``, from its plan."""
    plan = fmatmul_plan(target)
    if not plan.vector:
        return f"portable {PORTABLE_LANES} f32 lanes (generic twin), FMA rounded once"
    R, C = plan.tile
    gemv = f"gemv {R} rows at a time" + (", the next rows' weights asked for ahead" if plan.prefetch else "")
    return f"fma-{target.vector_bits}: gemm {R} rows x {C} tokens, {gemv}; f32 activations"


def fmatmul(module: ir.Module, dtype, K: int, N: int, target: Target) -> str:
    """Emit (once) y = x @ W.T for float weights W (N, K); returns the kernel name."""
    dt = dtypes.from_name(dtype)
    if dt not in FLOAT_LOADERS:
        raise ValueError(f"fmatmul: weight type {dt.name} is not a float type; "
                         f"supported: {', '.join(d.name for d in FLOAT_LOADERS)}")
    name = f"fmatmul_{dt.name}_k{K}_n{N}_{target.name}"
    if Kernel.exists(module, name):
        return name
    k = Kernel(module, name, ("w", "x", "y", "counter"))
    isa = Isa(k, target)
    plan = fmatmul_plan(target)
    lanes = target.vector_bits // 32 if plan.vector else PORTABLE_LANES
    R, C = plan.tile
    T = k.arg["T"]
    b = k.b
    full_t = b.mul(b.sdiv(T, k.i64(C)), k.i64(C))
    ahead = plan.prefetch
    f = _Fmatmul(k, isa, dt, K, N, lanes)
    with k.row_chunks(N, k.arg["counter"]) as (start, end):
        full_n = k.add(start, b.mul(b.sdiv(b.sub(end, start), k.i64(R)), k.i64(R)))
        for nlo, nhi, r in ((start, full_n, R), (full_n, end, 1)):
            with k.loop(nlo, nhi, step=r, name=f"n{r}") as n0:
                for tlo, thi, c in ((0, full_t, C), (full_t, T, 1)):
                    with k.loop(tlo, thi, step=c, name=f"t{r}x{c}") as t0:
                        _tile(f, n0, r, t0, c, ahead and c == 1 and r > 1)
    return k.finish()


@dataclass(frozen=True)
class _Fmatmul:
    """One fmatmul kernel being emitted: builder, instructions, weight type, shape and vector lanes."""

    k: Kernel
    isa: Isa
    dt: dtypes.DType
    K: int
    N: int
    lanes: int

    def w_offset(self, n, kk) -> ir.Value:
        """Byte offset of weight (n, kk)."""
        k = self.k
        return k.mul(k.add(k.mul(n, self.K), kk), FLOAT_LOADERS[self.dt][0])

    def load_w(self, n, kk, lanes: int) -> ir.Value:
        """`lanes` weights of row n from feature kk, as f32 (a scalar when lanes == 1)."""
        convert = FLOAT_LOADERS[self.dt][1]
        elem = f32 if self.dt is dtypes.f32 else i16
        typ = elem if lanes == 1 else vec(elem, lanes)
        raw = self.k.load(typ, self.k.arg["w"], self.w_offset(n, kk))
        return raw if convert is None else convert(self.isa, raw)

    def load_x(self, t, kk, lanes: int) -> ir.Value:
        k = self.k
        typ = f32 if lanes == 1 else vec(f32, lanes)
        return k.load(typ, k.arg["x"], k.mul(k.add(k.mul(t, self.K), kk), 4))


# A gemv step asks for the same columns of the next R rows, into L2: the R rows it reads side by side
# are R streams, more than the hardware prefetcher keeps up with. Intel only (Prefetch.ROWS; the plan's
# FmatmulPlan.prefetch); docs/kernels.md has the measurements.


def _tile(f: _Fmatmul, n0, R: int, t0, C: int, ahead: bool = False) -> None:
    """y[t0:t0+C, n0:n0+R]: vector steps over K, then a scalar tail, then lane sums; with ``ahead``,
    each step asks for the next R rows' weights at its columns (prefetches never fault past the end)."""
    k, isa, K, lanes = f.k, f.isa, f.K, f.lanes
    rows = [k.add(n0, r) for r in range(R)]
    toks = [k.add(t0, c) for c in range(C)]
    main = K - K % lanes
    acc = [[k.var(vec(f32, lanes), ir.Constant(vec(f32, lanes), [0.0] * lanes)) for _ in range(C)]
           for _ in range(R)]
    with k.loop(0, main, step=lanes, name="k") as kk:
        if ahead:
            for n in rows:
                k.prefetch(k.addr(k.arg["w"], f.w_offset(k.add(n, R), kk)), level=2)
        ws = [f.load_w(n, kk, lanes) for n in rows]
        xs = [f.load_x(t, kk, lanes) for t in toks]
        for r in range(R):
            for c in range(C):
                acc[r][c].set(isa.fused(ws[r], xs[c], acc[r][c].get()))
    sums = [[isa.hsum(acc[r][c].get()) for c in range(C)] for r in range(R)]
    if main < K:
        tail = [[k.var(f32, sums[r][c]) for c in range(C)] for r in range(R)]
        with k.loop(main, K, name="kt") as kk:
            ws = [f.load_w(n, kk, 1) for n in rows]
            xs = [f.load_x(t, kk, 1) for t in toks]
            for r in range(R):
                for c in range(C):
                    tail[r][c].set(isa.fused(ws[r], xs[c], tail[r][c].get()))
        sums = [[tail[r][c].get() for c in range(C)] for r in range(R)]
    for r in range(R):
        for c in range(C):
            k.store(sums[r][c], k.arg["y"], k.mul(k.add(k.mul(toks[c], f.N), rows[r]), 4))
