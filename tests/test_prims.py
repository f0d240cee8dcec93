"""Every primitive traced alone and run on the numpy backend, against plain numpy."""
import numpy as np
import pytest

import ggraph
from ggraph import ops, f32, i32, dtypes
from ggraph.ir.primitive import ShapeError

rng = np.random.default_rng(0)


def run1(fn, *arrays, avals=None):
    """Trace fn on avals matching the arrays (first dim symbolic T) and run it."""
    avals = avals or [getattr(dtypes, "f32" if a.dtype == np.float32 else "i32")[("T",) + a.shape[1:]]
                      if a.ndim else ggraph.Aval((), dtypes.from_numpy(a.dtype)) for a in arrays]
    g = ggraph.trace(fn, *avals)
    return ggraph.compile(g, passes=[])(*arrays), g


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


UNARY = {
    "neg": (ops.neg, np.negative), "exp": (ops.exp, np.exp), "tanh": (ops.tanh, np.tanh),
    "sin": (ops.sin, np.sin), "cos": (ops.cos, np.cos),
    "log": (lambda x: ops.log(ops.exp(x)), lambda x: x),
    "sqrt": (lambda x: ops.sqrt(x * x), np.abs),
    "rsqrt": (lambda x: ops.rsqrt(x * x + 1.0), lambda x: 1 / np.sqrt(x * x + 1)),
}


@pytest.mark.parametrize("name", UNARY)
def test_unary(name):
    op, ref = UNARY[name]
    x = randn(7, 33)
    y, g = run1(op, x)
    np.testing.assert_allclose(y, ref(x), rtol=2e-6, atol=2e-6)
    assert y.dtype == np.float32


BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "maximum": np.maximum}


@pytest.mark.parametrize("name", BINARY)
@pytest.mark.parametrize("yshape", [(5, 3), (3,), (1, 3), (5, 1)])
def test_binary_broadcasting(name, yshape):
    x, y = randn(5, 3), randn(*yshape) + 3.0
    out, _ = run1(getattr(ops, name), x, y,
                  avals=[f32[5, 3], f32[yshape]])
    np.testing.assert_allclose(out, BINARY[name](x, y), rtol=1e-6)


def test_binary_shape_error_names_op_and_shapes():
    with pytest.raises(ShapeError, match=r"add.*\[T,3\].*\[4\].*do not broadcast"):
        ggraph.trace(lambda x, y: x + y, f32["T", 3], f32[4])


def test_binary_dtype_mismatch():
    with pytest.raises(ShapeError, match="dtypes differ"):
        ggraph.trace(lambda x, y: x + y, f32[3], i32[3])


def test_less_where_cast():
    x, y = randn(6, 4), randn(6, 4)
    out, g = run1(lambda x, y: ops.where(ops.less(x, y), x, y), x, y)
    np.testing.assert_array_equal(out, np.minimum(x, y))
    ids = np.arange(6, dtype=np.int32)
    out, _ = run1(lambda i: ops.cast(i, "f32") * 0.5, ids)
    np.testing.assert_array_equal(out, ids * 0.5)
    with pytest.raises(ShapeError, match="i8 mask"):
        ggraph.trace(lambda x: ops.where(x, x, x), f32[3])


def test_fma_broadcasts_and_names_bad_operands():
    """fma broadcasts its three operands as the binary ops do; mixed or integer dtypes and shapes that
    do not broadcast are refused by name."""
    x, y = randn(6, 4), randn(4)
    out, g = run1(lambda x, y: ops.fma(x, y, x), x, y, avals=[f32["T", 4], f32[4]])
    assert str(g.outvars[0].aval) == "f32[T,4]"
    np.testing.assert_array_equal(out, (x.astype(np.float64) * y + x).astype(np.float32))
    with pytest.raises(ShapeError, match=r"fma: needs three operands of one float dtype"):
        ggraph.trace(lambda x, i: ops.fma(x, x, i), f32[3], i32[3])
    with pytest.raises(ShapeError, match=r"fma.*do not broadcast"):
        ggraph.trace(lambda x, y: ops.fma(x, y, x), f32["T", 3], f32[4])


def test_reductions_keep_last_axis():
    x = randn(5, 17)
    s, g = run1(ops.reduce_sum, x)
    m, _ = run1(ops.reduce_max, x)
    assert str(g.outvars[0].aval) == "f32[T,1]"
    np.testing.assert_allclose(s, x.sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(m, x.max(-1, keepdims=True))


def test_shape_ops():
    x = randn(4, 6, 8)
    out, _ = run1(lambda x: ops.reshape(x, ("T", 48)), x)
    np.testing.assert_array_equal(out, x.reshape(4, 48))
    out, _ = run1(lambda x: ops.transpose(x, (2, 0, 1)), x)
    np.testing.assert_array_equal(out, x.transpose(2, 0, 1))
    out, _ = run1(lambda x: x[:, 1:4, -3:], x)
    np.testing.assert_array_equal(out, x[:, 1:4, -3:])
    out, _ = run1(lambda x: x[..., 2], x)
    np.testing.assert_array_equal(out, x[..., 2])
    out, _ = run1(lambda x: ops.concat([x, x[:, :2]], axis=1), x)
    np.testing.assert_array_equal(out, np.concatenate([x, x[:, :2]], axis=1))
    b = randn(6, 1)
    out, _ = run1(lambda b: ops.broadcast_to(b, (6, 5)), b, avals=[f32[6, 1]])
    np.testing.assert_array_equal(out, np.broadcast_to(b, (6, 5)))


def test_shape_op_errors():
    with pytest.raises(ShapeError, match=r"reshape: f32\[T,6\] has 6\*T elements"):
        ggraph.trace(lambda x: ops.reshape(x, ("T", 5)), f32["T", 6])
    with pytest.raises(ShapeError, match="not a permutation"):
        ggraph.trace(lambda x: ops.transpose(x, (0, 0)), f32[2, 2])
    with pytest.raises(ShapeError, match="stop 9 > dim 8"):
        ggraph.trace(lambda x: ops.slice(x, 1, 0, 9), f32[2, 8])
    with pytest.raises(ShapeError, match="disagree off the axis"):
        ggraph.trace(lambda x, y: ops.concat([x, y], axis=0), f32[2, 8], f32[2, 7])


def test_matmul_contracts_last_axes_with_batch():
    a, b = randn(3, 5, 16), randn(3, 7, 16)
    out, g = run1(ops.matmul, a, b, avals=[f32[3, "T", 16], f32[3, 7, 16]])
    np.testing.assert_allclose(out, a @ b.transpose(0, 2, 1), rtol=1e-5, atol=1e-5)
    out, _ = run1(lambda a, b: a @ b, a[0], randn(16, 4), avals=[f32["T", 16], f32[16, 4]])
    with pytest.raises(ShapeError, match=r"contracted dims differ"):
        ggraph.trace(ops.matmul, f32["T", 16], f32[8, 15])


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "f16"])
def test_dequant_and_linear(dtype):
    from ggraph.gguf.quants import dequantize, quantize
    w = randn(64, 96)
    wq = quantize(w, dtype) if dtype != "f16" else w.astype(np.float16)
    wd = dequantize(wq.view(np.uint8).reshape(-1), dtype, w.shape) if dtype != "f16" else w.astype(np.float16).astype(np.float32)
    x = randn(3, 96)
    g = ggraph.trace(ops.linear, f32["T", 96], getattr(dtypes, dtype)[64, 96])
    assert [e.prim.name for e in g.eqns] == ["dequant", "matmul"]
    out = ggraph.compile(g)(x, wq)
    np.testing.assert_allclose(out, x @ wd.T, rtol=1e-5, atol=1e-5)


def test_take_quantised_and_plain():
    from ggraph.gguf.quants import dequantize, quantize
    table = randn(50, 64)
    ids = np.array([3, 0, 49, 3], dtype=np.int32)
    out, _ = run1(ops.take, table, ids, avals=[f32[50, 64], i32["T"]])
    np.testing.assert_array_equal(out, table[ids])
    tq = quantize(table, "q8_0")
    g = ggraph.trace(ops.take, dtypes.q8_0[50, 64], i32["T"])
    out = ggraph.compile(g)(tq, ids)
    np.testing.assert_array_equal(out, dequantize(tq.reshape(-1), "q8_0", (50, 64))[ids])


def test_iota_and_cache_update():
    def f(x, cache, P):
        pos = ops.iota(x.shape[0]) + P
        return ops.cache_update(cache, x, P), pos
    g = ggraph.trace(f, f32["T", 4], f32[10, 4], ggraph.dim("P"))
    cache = np.zeros((10, 4), np.float32)
    x = randn(3, 4)
    c, pos = ggraph.compile(g)(x, cache, np.int32(5))
    np.testing.assert_array_equal(c[5:8], x)
    np.testing.assert_array_equal(pos, [5, 6, 7])
    with pytest.raises(ValueError, match="do not fit a cache of 10 rows"):
        ggraph.compile(g)(x, cache, np.int32(8))
