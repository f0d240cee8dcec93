"""A researcher's own ops compile natively with every pipeline: a layer_norm composite, an elementwise
primitive with its own llvm emitter, a gate composite built on it, and an MLP composite with matmuls
inside, in a decoder written here, on llvm with the default pipeline, none and random pass subsets,
against the numpy backend."""
import random
import re

import numpy as np
import pytest

import ggraph
from ggraph import dim, f32, i32, ops
from ggraph.backends.llvm.lowering import LoweringError
from ggraph.gguf.quants import quantize
from ggraph.ir import dtypes, param
from ggraph.passes import PIPELINES, RewriteLog
from ggraph.compiler import optimize

D, F, H, HD, V, C, LAYERS = 64, 128, 4, 16, 96, 32, 2


def _np_layer_norm(x, w, b, *, eps):
    x64 = x.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    var = ((x64 - mu) ** 2).mean(-1, keepdims=True)
    return ((x64 - mu) / np.sqrt(var + eps) * w + b).astype(np.float32)


@ops.composite("layer_norm", _np_layer_norm)
def layer_norm(x, w, b, *, eps):
    """(x - mean) / sqrt(var + eps) · w + b over the last axis."""
    n = 1.0 / x.shape[-1]
    xc = x - ops.reduce_sum(x) * n
    return xc * ops.rsqrt(ops.reduce_sum(xc * xc) * n + eps) * w + b


def _emit_squared_relu(ev, x):
    r = ev.b.select(ev.b.fcmp_ordered(">", x, ev.const(x, 0.0)), x, ev.const(x, 0.0))
    return ev.b.fmul(r, r)


squared_relu_p = ops.elementwise("squared_relu", lambda x: np.square(np.maximum(x, 0)), flops=2,
                                 emit=_emit_squared_relu)


def squared_relu(x):
    return ggraph.ir.bind(squared_relu_p, x)


@ops.composite("relu2_gate", lambda g, u: (np.square(np.maximum(g, 0)) * u).astype(np.float32))
def relu2_gate(g, u):
    """squared_relu(g) · u: a gate of the user's own op."""
    return squared_relu(g) * u


@ops.composite("mlp", None)
def mlp(x, wg, wu, wd):
    """down(relu2_gate(gate(x), up(x))): a composite with matmuls inside."""
    return ops.linear(relu2_gate(ops.linear(x, wg), ops.linear(x, wu)), wd)


def decoder(tokens, P, kc, vc, w):
    T = tokens.shape[0]
    x = ops.take(w["embd"], tokens)                                              # (T, D)
    pos = ops.iota(T) + P
    k_out, v_out = [], []
    for i in range(LAYERS):
        with ggraph.scope(f"blk.{i}"):
            h = layer_norm(x, w[f"ln{i}.w"], w[f"ln{i}.b"], eps=1e-5)
            q = ops.linear(h, w[f"q{i}"]).reshape(T, H, HD)
            k = ops.linear(h, w[f"k{i}"]).reshape(T, H, HD)
            v = ops.linear(h, w[f"v{i}"]).reshape(T, H, HD)
            q, k = ops.rope(q, pos, base=1e4), ops.rope(k, pos, base=1e4)
            o, kci, vci = ops.attention(q, k, v, kc[i], vc[i], P, scale=HD ** -0.5)
            x = x + ops.linear(o.reshape(T, D), w[f"o{i}"])
            x = x + mlp(layer_norm(x, w[f"ln{i}.w"], w[f"ln{i}.b"], eps=1e-5), w[f"g{i}"], w[f"u{i}"], w[f"d{i}"])
            k_out.append(kci)
            v_out.append(vci)
    return ops.linear(x, w["embd"]), k_out, v_out


def _weights(rng):
    shapes = {"embd": (V, D)}
    for i in range(LAYERS):
        shapes |= {f"ln{i}.w": (D,), f"ln{i}.b": (D,), f"q{i}": (D, D), f"k{i}": (D, D), f"v{i}": (D, D),
                   f"o{i}": (D, D), f"g{i}": (F, D), f"u{i}": (F, D), f"d{i}": (D, F)}
    arrays, avals = {}, {}
    for name, shape in shapes.items():
        a = (rng.standard_normal(shape) * (0.3 if len(shape) == 2 else 0.1)).astype(np.float32)
        if len(shape) == 2:
            arrays[name] = quantize(a, "q8_0")
            avals[name] = param(name, dtypes.q8_0[shape])
        else:
            arrays[name] = a + (1.0 if name.endswith(".w") else 0.0)
            avals[name] = param(name, f32[shape])
    return arrays, avals


@pytest.fixture(scope="module")
def model():
    rng = np.random.default_rng(5)
    arrays, avals = _weights(rng)
    graph = ggraph.trace(decoder, i32["T"], dim("P"), [f32[C, H, HD]] * LAYERS, [f32[C, H, HD]] * LAYERS, avals)
    tokens = rng.integers(0, V, 12).astype(np.int32)
    return graph, arrays, tokens


def _run(graph, arrays, tokens, backend, passes="default", disabled=()):
    fn = ggraph.compile(graph, backend=backend, passes=passes, disabled=disabled, weights=arrays)
    caches = [np.zeros((C, H, HD), np.float32) for _ in range(2 * LAYERS)]
    logits, *_ = fn.run_inputs([tokens, np.int32(0), *caches])
    return fn, logits


def test_user_ops_compile_with_every_pipeline(model):
    graph, arrays, tokens = model
    _, want = _run(graph, arrays, tokens, "numpy", "none")
    rng = random.Random(7)
    default = PIPELINES["default"]
    runs = [("default", ()), ("none", ())] + \
        [("default", tuple(rng.sample(default, rng.randint(1, len(default) - 1)))) for _ in range(4)]
    for passes, off in runs:
        fn, got = _run(graph, arrays, tokens, "llvm", passes, off)
        q8 = passes == "default" and "fuse_dequant_matmul" not in off      # matmuls on q8 activations
        np.testing.assert_allclose(got, want, rtol=0, atol=(0.05 if q8 else 2e-4) * np.abs(want).max(),
                                   err_msg=f"passes={passes} off={off}")


def test_default_pipeline_fuses_user_ops(model):
    graph, _, _ = model
    log = RewriteLog()
    g = optimize(graph, "default", log=log)
    labels = [e.params.get("ops", ()) for e in g.eqns if e.prim.name == "fused"]
    assert any("layer_norm" in ops_ for ops_ in labels), labels                 # a row-reduction composite
    assert any("relu2_gate" in ops_ for ops_ in labels), labels                 # a user elementwise op inside one
    assert not any(e.prim.composite for e in g.eqns)
    assert g.count("qmatmul") == 7 * LAYERS + 1 and g.count("dequant") == 0     # the MLP's matmuls too
    said = "\n".join(map(str, log.entries))
    assert "inlined mlp (7 eqns): no kernel takes it whole (its body has dequant, matmul)" in said
    assert "layer_norm kept whole" in said and re.search(r"fused\{[a-z_,]*layer_norm", said)
    assert "relu2_gate kept whole" in said


def test_explain_lists_user_composites(model, capsys):
    from ggraph.cli.dump import explain
    graph, _, _ = model
    log = RewriteLog()
    optimize(graph, "default", log=log)
    text = explain(log, layer=1)
    assert "inline_unfusable:" in text and "[inline_unfusable] blk.1: inlined mlp" in text
    assert "[inline_unfusable] blk.1: layer_norm kept whole" in text
    assert re.search(r"\[fuse_elementwise\] blk\.1: fused\{[a-z_,]*layer_norm[a-z_,]*\}: ", text)


def test_an_op_without_an_emitter_is_refused_by_name():
    plain_p = ops.elementwise("softsign_no_emit", lambda x: x / (1 + np.abs(x)))
    g = ggraph.trace(lambda x: ggraph.ir.bind(plain_p, x) * 2.0, f32["T", 8])
    x = np.linspace(-2, 2, 16, dtype=np.float32).reshape(2, 8)
    np.testing.assert_allclose(ggraph.compile(g)(x), x / (1 + np.abs(x)) * 2, rtol=1e-6)
    with pytest.raises(LoweringError, match="op 'softsign_no_emit' has no llvm emitter"):
        ggraph.compile(g, backend="llvm")


def test_a_composite_without_a_numpy_rule_runs_its_body():
    @ops.composite("double_exp", None)
    def double_exp(x):
        return ops.exp(x) * 2.0
    g = ggraph.trace(lambda x: double_exp(x), f32["T", 8])
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    for backend, passes in (("numpy", []), ("numpy", "default"), ("llvm", "default"), ("llvm", [])):
        np.testing.assert_allclose(ggraph.compile(g, backend=backend, passes=passes)(x), np.exp(x) * 2, rtol=1e-6)
