"""Core IR, tracing and printing: symbolic dims, pytrees, scopes, golden text, DOT, cost."""
import numpy as np
import pytest

import ggraph
from ggraph import dim, dtypes, f32, ops, param
from ggraph.ir.dims import Sym
from ggraph.ir.graph import Var, VerifyError


def mlp(x, g, w_up, w_down):
    h = ops.rms_norm(x, g, eps=1e-6)
    return x + ops.linear(ops.gelu_tanh(ops.linear(h, w_up)), w_down)


MLP_TEXT = """\
{ lambda ; x:f32[T,256] g:f32[256] w_up:q8_0[512,256] w_down:f32[256,512]. let
    a:f32[T,256] = rms_norm[eps=1e-06] x g
    b:f32[512,256] = dequant w_up
    c:f32[T,512] = matmul a b
    d:f32[T,512] = gelu_tanh c
    e:f32[T,256] = matmul d w_down
    f:f32[T,256] = add x e
  in (f) }"""


def trace_mlp():
    return ggraph.trace(mlp, f32["T", 256], f32[256], dtypes.q8_0[512, 256], f32[256, 512])


def test_dtype_table():
    assert str(dtypes.q4_k) == "q4_k" and dtypes.q4_k.ggml_id == 12
    assert (dtypes.q4_k.block_size, dtypes.q4_k.type_size) == (256, 144)
    assert dtypes.q8_1.type_size == 36 and dtypes.bf16.ggml_id == 30
    assert str(f32["T", 640]) == "f32[T,640]" and str(dtypes.q4_k[1024, 640]) == "q4_k[1024,640]"
    with pytest.raises(ValueError, match=r"q4_k\[4,100\]: innermost dim 100 is not a multiple of the q4_k block size 256"):
        ggraph.trace(ops.dequant, dtypes.q4_k[4, 100])
    with pytest.raises(ValueError, match="unknown dtype 'q9_9'"):
        dtypes.from_name("q9_9")


def test_symbolic_dims():
    T, P = Sym("T"), Sym("P")
    assert str(P + T) == "P+T" and (P + T) == Sym("P+T") and str(Sym("2*T-1")) == "2*T-1"
    assert (P + T) - P == T and (T - T) == 0 and isinstance(T - T, int)
    assert (P + T).eval({"P": 3, "T": 4}) == 7
    with pytest.raises(ValueError, match="needs a value for 'P'"):
        (P + T).eval({"T": 1})


def test_golden_text():
    assert str(trace_mlp()) == MLP_TEXT


def test_expanded_text_shows_bodies():
    text = trace_mlp().pretty(expand=True)
    assert "      { lambda ; " in text and "rsqrt" in text and "tanh" in text


def test_pytrees_params_scopes_and_dims():
    def block(x, w, P):
        with ggraph.scope("blk.0"), ggraph.scope("attn"):
            h = ops.rms_norm(x, w["norm"], eps=1e-5)
        with ggraph.scope("blk.0"):
            pos = ops.iota(x.shape[0]) + P
            y = ops.linear(h, w["proj"]) + ops.cast(pos, "f32")[:, None] if False else ops.linear(h, w["proj"])
        return {"y": y, "pos": pos}
    weights = {"norm": param("blk.0.attn_norm.weight", f32[64]),
               "proj": param("blk.0.attn_q.weight", dtypes.q4_0[64, 64])}
    g = ggraph.trace(block, f32["T", 64], weights, dim("P"))
    text = str(g)
    assert '    # blk.0.attn\n    a:f32[64] = param "blk.0.attn_norm.weight"' in text
    assert "# blk.0\n" in text and 'param "blk.0.attn_q.weight"' in text
    assert "P:i32[]" in text and [v.aval.source for v in g.params] == ["blk.0.attn_norm.weight", "blk.0.attn_q.weight"]
    assert g.out_tree.keys == ("y", "pos")


def test_verify_names_the_eqn():
    g = trace_mlp()
    bad = g.eqns[2].replace(outputs=(Var(f32["T", 7]),))
    broken = g.replace(eqns=g.eqns[:2] + (bad,) + g.eqns[3:])
    with pytest.raises(VerifyError, match=r"eqn 2 \(.*matmul.*\): declares outputs f32\[T,7\] but its shape rule gives f32\[T,512\]"):
        broken.verify()
    swapped = g.replace(eqns=(g.eqns[1], g.eqns[2], g.eqns[0]) + g.eqns[3:])
    with pytest.raises(VerifyError, match="used before it is defined"):
        swapped.verify()


def test_custom_block_two_lengths_one_program():
    """A researcher's block: traced once, printed, run for two different T."""
    def parallel_block(x, wn, wq, wo, wu, wd):
        h = ops.rms_norm(x, wn, eps=1e-6)
        q = ops.linear(h, wq).reshape(x.shape[0], 2, 16)
        a = ops.attention(q, q, q, scale=0.25).reshape(x.shape[0], 32)
        return x + ops.linear(a, wo) + ops.linear(ops.gelu_tanh(ops.linear(h, wu)), wd)
    g = ggraph.trace(parallel_block, f32["T", 32], f32[32], f32[32, 32], dtypes.q8_0[32, 32],
                     f32[64, 32], f32[32, 64])
    assert "attention[scale=0.25]" in str(g)
    fn = ggraph.compile(g)
    rng = np.random.default_rng(0)
    from ggraph.gguf.quants import quantize
    ws = [rng.standard_normal(s).astype(np.float32) * 0.2 for s in [(32,), (32, 32), (32, 32), (64, 32), (32, 64)]]
    ws[2] = quantize(ws[2], "q8_0")
    x = rng.standard_normal((7, 32)).astype(np.float32)
    y7, y3 = fn(x, *ws), fn(x[:3], *ws)
    assert y7.shape == (7, 32) and y3.shape == (3, 32)
    np.testing.assert_allclose(y7[:3], y3, rtol=1e-5, atol=1e-5)   # causal: a prefix sees only itself


def test_compile_checks_inputs():
    fn = ggraph.compile(trace_mlp())
    x = np.zeros((2, 256), np.float32)
    with pytest.raises(ValueError, match=r"input g: expected shape f32\[256\]"):
        fn(x, np.zeros(255, np.float32), np.zeros((512, 272), np.uint8), np.zeros((256, 512), np.float32))
    with pytest.raises(ValueError, match="expected 139264 bytes of q8_0 blocks"):
        fn(x, np.zeros(256, np.float32), np.zeros((512, 271), np.uint8), np.zeros((256, 512), np.float32))
    with pytest.raises(TypeError, match="takes 4 array arguments, got 1"):
        fn(x)


def test_dot_and_networkx():
    from ggraph.view.dot import graph_to_dot, graph_to_networkx
    g = trace_mlp()
    nx_graph = graph_to_networkx(g)
    kinds = {d["kind"] for _, d in nx_graph.nodes(data=True)}
    assert {"composite", "matmul", "memory", "elementwise", "input"} <= kinds
    dot = graph_to_dot(g)
    assert dot.startswith('digraph "mlp"') and "matmul" in dot and "f32[T,512]" in dot


def test_cost_counts_matmul_flops():
    cost = trace_mlp().cost(T=4)
    assert cost["matmul"]["flops"] == 2 * 4 * 256 * 512 * 2
    assert cost["dequant"]["bytes"] == 512 * 272 + 512 * 256 * 4
    assert cost["total"]["count"] == 6


def test_the_public_api_after_a_bare_import():
    import subprocess
    import sys
    code = ("import sys, ggraph; "
            "assert 'matplotlib' not in sys.modules and 'llvmlite' not in sys.modules, 'import ggraph stays light'; "
            "ggraph.Session; ggraph.quants.quantize; ggraph.passes.PIPELINES; ggraph.draw.draw; "
            "ggraph.gguf.GGUFFile; ggraph.models.register_architecture")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_passes_and_backends_ask_the_op_table_not_op_names():
    """No pass, lowering rule or interpreter names an op by a string: they ask the op table."""
    import ast
    import pathlib
    from ggraph.ir import primitives
    root = pathlib.Path(__file__).parent.parent
    files = sorted((root / "passes").glob("*.py")) + [root / "backends" / f for f in (
        "numpy_ref.py", "inputs.py", "program.py", "llvm/lowering.py", "llvm/rules.py", "llvm/codegen.py",
        "llvm/program.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in primitives, f"{path.name}:{node.lineno} names op {node.value!r}"


def test_every_elementwise_primitive_has_its_llvm_emitter_in_its_entry():
    from ggraph.ir import Primitive, prims
    shipped = [p for p in vars(prims).values() if isinstance(p, Primitive)]
    assert len(shipped) >= 28
    for p in shipped:
        if p.kind == "elementwise":
            assert p.emit is not None, p.name
        if p.kind == "reduce":
            assert p.reduce is not None and p.reduce[1].emit is not None, p.name
