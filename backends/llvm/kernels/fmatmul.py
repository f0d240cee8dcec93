"""Matmul with float weights (f32, f16, bf16) and f32 activations: no act_quant.

    fmatmul_<wtype>_k<K>_n<N>_<target>(w: ptr [N, K], x: ptr f32 [T, K], y: ptr f32 [T, N], counter: ptr i32,
                                       T, ith, nth)

Threads take chunks of rows in turn, counted in ``counter`` (zero when the call starts), as
qmatmul's do. Lanes run along K: gemm keeps an R x C tile of accumulators (rows x tokens) so each
loaded weight vector serves C tokens and each x vector serves R rows, one accumulator per output
then its lanes summed by halving (llamafile's tinyBLAS, which llama.cpp's f32 matmul takes for two
tokens or more). K tails run scalar.

One token (T == 1) on x86 and the generic twin sums as ggml_vec_dot_f32 does, which llama.cpp takes
for one token (a decode step; a router's logits, where a near tie picks the experts): per output
VEC_DOT_ACCS accumulators over steps of VEC_DOT_ACCS vectors, then acc0 + acc2, acc1 + acc3, their
sum, its lanes (halving on 512 bits; on 256 bits the two halves, then hadd twice), then the tail.

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
VEC_DOT_ACCS = 4               # ggml_vec_dot_f32's accumulators (GGML_F32_ARR: GGML_F32_STEP / GGML_F32_EPR)


def float_weight(dtype) -> bool:
    """True for the weight types fmatmul takes."""
    return dtypes.from_name(dtype) in FLOAT_LOADERS


def variant(dtype, target: Target) -> str:
    """A one-line description of the kernel `fmatmul` emits on ``target``, from its plan."""
    plan = fmatmul_plan(target)
    if not plan.vector:
        return (f"portable {PORTABLE_LANES} f32 lanes (generic twin), FMA rounded once; one token in "
                f"ggml_vec_dot_f32's order ({VEC_DOT_ACCS} accumulators)")
    R, C = plan.tile
    gemv = f"gemv {R} rows at a time" + (", the next rows' weights asked for ahead" if plan.prefetch else "")
    if target.arch == "x86_64":
        gemv += f" in ggml_vec_dot_f32's order ({VEC_DOT_ACCS} accumulators)"
    return f"fma-{target.vector_bits}: gemm {R} rows x {C} tokens, {gemv}; f32 activations"


def fmatmul(module: ir.Module, dtype, K: int, N: int, target: Target, rows_only: bool = False) -> str:
    """Emit (once) y = x @ W.T for float weights W (N, K); returns the kernel name. With ``rows_only``
    (a batch's step) every token is computed as one token alone is, at any T."""
    dt = dtypes.from_name(dtype)
    if dt not in FLOAT_LOADERS:
        raise ValueError(f"fmatmul: weight type {dt.name} is not a float type; "
                         f"supported: {', '.join(d.name for d in FLOAT_LOADERS)}")
    vec_dot = target.arch == "x86_64" or not fmatmul_plan(target).vector     # T == 1 in ggml_vec_dot_f32's order
    rows_only = rows_only and vec_dot                   # elsewhere every T sums alike already
    name = f"fmatmul_{dt.name}_k{K}_n{N}{'_rows' if rows_only else ''}_{target.name}"
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

        def tiles():
            for nlo, nhi, r in ((start, full_n, R), (full_n, end, 1)):
                with k.loop(nlo, nhi, step=r, name=f"n{r}") as n0:
                    for tlo, thi, c in ((0, full_t, C), (full_t, T, 1)):
                        with k.loop(tlo, thi, step=c, name=f"t{r}x{c}") as t0:
                            _tile(f, n0, r, t0, c, ahead and c == 1 and r > 1)
        def one_by_one(tokens):
            for nlo, nhi, r in ((start, full_n, R), (full_n, end, 1)):
                with k.loop(nlo, nhi, step=r, name=f"d{r}") as n0:
                    with k.loop(0, tokens, name=f"dt{r}") as t:
                        _vec_dot_rows(f, n0, r, t, ahead and r > 1)
        if not vec_dot:                                  # ARM: one order for every T
            tiles()
        elif rows_only:
            one_by_one(T)
        else:
            with b.if_else(b.icmp_signed("==", T, k.i64(1))) as (one, many):
                with one:
                    one_by_one(k.i64(1))
                with many:
                    tiles()
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


def _vec_dot_rows(f: _Fmatmul, n0, R: int, t, ahead: bool = False) -> None:
    """y[t, n0:n0+R] for token t alone, in ggml_vec_dot_f32's order: VEC_DOT_ACCS accumulators per row
    over steps of VEC_DOT_ACCS vectors, reduced as GGML_F32_VEC_REDUCE does, then the K tail one FMA at
    a time; with ``ahead``, each step asks for the next R rows' weights at its columns."""
    k, isa, K, lanes = f.k, f.isa, f.K, f.lanes
    step = VEC_DOT_ACCS * lanes
    rows = [k.add(n0, r) for r in range(R)]
    main = K - K % step
    zero = ir.Constant(vec(f32, lanes), [0.0] * lanes)
    acc = [[k.var(vec(f32, lanes), zero) for _ in range(VEC_DOT_ACCS)] for _ in range(R)]
    with k.loop(0, main, step=step, name="k") as kk:
        if ahead:
            for n in rows:
                at = f.w_offset(k.add(n, R), kk)
                for line in range(0, step * FLOAT_LOADERS[f.dt][0], 64):
                    k.prefetch(k.addr(k.arg["w"], k.add(at, line)), level=2)
        for j in range(VEC_DOT_ACCS):
            at = k.add(kk, j * lanes)
            x = f.load_x(t, at, lanes)
            for r, n in enumerate(rows):
                acc[r][j].set(isa.fused(f.load_w(n, at, lanes), x, acc[r][j].get()))
    b = k.b
    for r, n in enumerate(rows):
        a = [v.get() for v in acc[r]]
        total = _lane_sum(k, isa, b.fadd(b.fadd(a[0], a[2]), b.fadd(a[1], a[3])))
        if main < K:
            tail = k.var(f32, total)
            with k.loop(main, K, name="kt") as kk:
                tail.set(isa.fused(f.load_w(n, kk, 1), f.load_x(t, kk, 1), tail.get()))
            total = tail.get()
        k.store(total, k.arg["y"], k.mul(k.add(k.mul(t, f.N), n), 4))


def _lane_sum(k: Kernel, isa: Isa, v: ir.Value) -> ir.Value:
    """GGML_F32_VEC_REDUCE's last step: 8 lanes (AVX) as their two halves added, then hadd twice
    ((l0 + l1) + (l2 + l3) of those); other widths by halving (_mm512_reduce_add_ps' order)."""
    if v.type.count != 8:
        return isa.hsum(v)
    b = k.b
    t = b.fadd(k.shuffle(v, range(4)), k.shuffle(v, range(4, 8)))
    pair = lambda i: b.fadd(b.extract_element(t, ir.Constant(ir.IntType(32), i)),  # noqa: E731
                            b.extract_element(t, ir.Constant(ir.IntType(32), i + 1)))
    return b.fadd(pair(0), pair(2))
