"""neon_i8mm's prefill gemm (smmla: 2 rows x 2 tokens x 8 bytes a step) on every weight type: within
1e-5 of the float64 product of the same quantised activations (test_llvm_kernels' check), and the
same bits as neon_dotprod's sdot gemm (the same integer sums, the same float steps). Needs an AArch64
host with i8mm (tests/test_arm.py runs it in the emulated guest); skipped elsewhere."""
import numpy as np
import pytest
from llvmlite import ir

import test_llvm_kernels as K
from ggraph.backends.llvm import jit, kernels
from ggraph.backends.llvm.target import named_target, runnable_targets

TWINS = ("neon_i8mm", "neon_dotprod")
T = 40                                           # two 16-token groups and a tail group
_LIBS: dict = {}


def lib(name: str, dt) -> jit.Library:
    """The act_quant and qmatmul kernels of ``dt`` (K.N rows: 2-row smmla tiles and a 1-row sdot tail)."""
    if (name, dt) not in _LIBS:
        t = named_target(name)
        m = ir.Module()
        kernels.act_quant(m, kernels.act_format(dt), K.k_of(dt), t)
        kernels.qmatmul(m, dt, K.k_of(dt), K.N, t)
        _LIBS[name, dt] = jit.compile(m, t)
    return _LIBS[name, dt]


@pytest.mark.parametrize("dt", kernels.QUANT_TYPES, ids=lambda d: d.name)
def test_smmla_gemm_matches_float64_and_the_sdot_gemm_bit_for_bit(dt):
    if not set(TWINS) <= {t.name for t in runnable_targets()}:
        pytest.skip("host cannot run neon_i8mm")
    assert "smmla" in kernels.describe(named_target("neon_i8mm"))[f"qmatmul {dt.name}"]
    rng = np.random.default_rng(3)
    k = K.k_of(dt)
    w = K.random_blocks(dt, K.N, k, rng)
    K.check_qmatmul("neon_i8mm", dt, k, K.N, w, tokens=(3, 17, T), lib=lib("neon_i8mm", dt))
    x = rng.standard_normal((T, k)).astype(np.float32)
    ys = []
    for name in TWINS:
        f = K.fn(name, f"qmatmul_{dt.name}_k{k}_n{K.N}", abi=K.MATMUL_ABI, lib=lib(name, dt))
        buf = K.quantize_acts(name, x, kernels.act_format(dt), lib(name, dt))
        y = np.full((T, K.N), np.nan, np.float32)
        K.run(f, (w.ctypes.data, buf.ctypes.data, y.ctypes.data, np.zeros(16, np.int32).ctypes.data), T, 2)
        ys.append(y)
    np.testing.assert_array_equal(ys[0], ys[1])
