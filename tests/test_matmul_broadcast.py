"""The unfused matmul broadcasts batch dims as numpy does, also where an operand has some batch axes of 1
and others full ([T, 1] against [T, k]: a token's row against each of its experts); the llvm kernel steps
through whole batches, so such an operand is copied out first (it read past the operand before)."""
import numpy as np
import pytest

import ggraph
from ggraph import f32, ops
from ggraph.backends.llvm.target import named_target, runnable_targets

CASES = [((3, 1, 4, 8), (3, 2, 5, 8)), ((1, 2, 4, 8), (3, 1, 5, 8)), ((4, 8), (3, 2, 5, 8)),
         ((3, 2, 4, 8), (5, 8)), (("T", 1, 4, 8), ("T", 2, 5, 8)), ((2, 3, 4, 8), (2, 3, 5, 8))]


@pytest.mark.parametrize("target", [t.name for t in runnable_targets()])
@pytest.mark.parametrize("a_shape,b_shape", CASES)
def test_batched_matmul_broadcasts_as_numpy(a_shape, b_shape, target):
    g = ggraph.trace(lambda a, b: ops.matmul(a, b), f32[a_shape], f32[b_shape])
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(tuple(3 if d == "T" else d for d in s)).astype(np.float32) for s in (a_shape, b_shape))
    want = np.matmul(a, np.swapaxes(b, -1, -2))
    for backend, options in (("numpy", {}), ("llvm", {"target": named_target(target)})):
        got = ggraph.compile(g, backend=backend, passes="none", **options)(a, b)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
