"""ops.scan conformance: random bodies against plain numpy float64 loops written here, on the numpy backend
and on llvm for every feature set this host runs (1 and 2 threads); a symbolic length run at several T
through one compiled program; passes inside the body (its elementwise chain becomes one fused loop); the
printed form parsed back; nested scans; scans in a composite's decomposition; and bad input's errors."""
import numpy as np
import pytest

import ggraph
from ggraph import f32, ops
from ggraph.ir.dtypes import q8_0
from ggraph.backends.llvm.target import runnable_targets
from ggraph.gguf.quants import dequantize, quantize
from ggraph.ir.graph import Names, VerifyError, graph_to_str
from ggraph.ir.text import parse
from ggraph.ir.trace import tree_flatten
from ggraph.passes import RewriteLog, resolve, run

TARGETS = [t.name for t in runnable_targets()]
RNG = np.random.default_rng(42)
Q = 32                                          # the q8_0 weight's size: one block per row


def randn(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def row(x):                                     # f32[K] -> f32[1, K], for linear
    return ops.reshape(x, (1, x.shape[0]))


# -- cases: (traced function, its avals at length T, inputs at length T, numpy float64 loop) ----------

def elementwise(c0, xs):
    def body(c, x):
        c = ops.tanh(c * 0.9 + x)
        return c, c * x + 1.0
    return ops.scan(body, c0, xs)


def elementwise_ref(c0, xs):
    c, ys = c0.astype(np.float64), []
    for x in xs.astype(np.float64):
        c = np.tanh(c * 0.9 + x)
        ys.append(c * x + 1.0)
    return [c, np.array(ys).reshape(len(xs), -1)]


def reductions(s0, xs):
    def body(s, x):
        return s + ops.reduce_sum(x * x), x - ops.reduce_max(x)
    return ops.scan(body, s0, xs)


def reductions_ref(s0, xs):
    s, ys = s0.astype(np.float64), []
    for x in xs.astype(np.float64):
        s = s + (x * x).sum()
        ys.append(x - x.max())
    return [s, np.array(ys).reshape(xs.shape)]


def matmul_weight(h0, xs, w):
    def body(h, x):                                            # w [8, 16] is closed over
        h = ops.tanh(ops.linear(row(x), w) + h)
        return h, ops.reshape(h, (8,))
    return ops.scan(body, h0, xs)


def matmul_weight_ref(h0, xs, w):
    h, ys = h0.astype(np.float64), []
    for x in xs.astype(np.float64):
        h = np.tanh(x[None] @ w.astype(np.float64).T + h)
        ys.append(h.reshape(8))
    return [h, np.array(ys).reshape(len(xs), 8)]


def q8_weight(h0, xs, w):
    def body(h, x):                                            # a q8_0 weight: qmatmul inside the loop
        h = ops.tanh(ops.linear(row(x) + h, w))
        return h, h * 2.0
    return ops.scan(body, h0, xs)


def q8_weight_ref(h0, xs, w):
    wf = dequantize(w, q8_0, (Q, Q)).astype(np.float64)
    h, ys = h0.astype(np.float64), []
    for x in xs.astype(np.float64):
        h = np.tanh((x[None] + h) @ wf.T)
        ys.append(h * 2.0)
    return [h, np.array(ys).reshape(len(xs), 1, Q)]


def q8_weight_act_ref(h0, xs, w):
    """As llvm computes it, as ggml does: x quantised to q8_0 blocks before the integer dot products."""
    wf = dequantize(w, q8_0, (Q, Q)).astype(np.float64)
    h, ys = h0, []
    for x in xs:
        a = x[None] + h
        a = dequantize(quantize(a, q8_0), q8_0, a.shape).astype(np.float64)
        h = np.tanh(a @ wf.T).astype(np.float32)
        ys.append(h * 2.0)
    return [h, np.array(ys).reshape(len(xs), 1, Q)]


def tuple_carry(a0, b0, xs):
    def body(c, x):                                            # the carries swap: one's new value is the other's old
        a, b = c
        return (b, a + x), a * b
    return ops.scan(body, (a0, b0), xs)


def tuple_carry_ref(a0, b0, xs):
    a, b, ys = a0.astype(np.float64), b0.astype(np.float64), []
    for x in xs.astype(np.float64):
        ys.append(a * b)
        a, b = b, a + x
    return [a, b, np.array(ys).reshape(xs.shape)]


def pytree_ys(c0, u, v):
    def body(c, x):
        s = x["u"] * x["v"] + c
        return s, {"s": s, "m": ops.maximum(x["u"], c)}
    return ops.scan(body, c0, {"u": u, "v": v})


def pytree_ys_ref(c0, u, v):
    c, ss, ms = c0.astype(np.float64), [], []
    for x, y in zip(u.astype(np.float64), v.astype(np.float64)):
        ms.append(np.maximum(x, c))
        c = x * y + c
        ss.append(c)
    return [c, np.array(ss).reshape(u.shape), np.array(ms).reshape(u.shape)]


def empty_ys(c0, xs):
    final, ys = ops.scan(lambda c, x: (c * 0.5 + ops.exp(x * 0.1), None), c0, xs)
    assert ys is None
    return final


def empty_ys_ref(c0, xs):
    c = c0.astype(np.float64)
    for x in xs.astype(np.float64):
        c = c * 0.5 + np.exp(x * 0.1)
    return [c]


def reverse(c0, xs):
    return ops.scan(lambda c, x: (c * 0.8 + x, c), c0, xs, reverse=True)      # y_t: the carry before step t


def reverse_ref(c0, xs):
    c, ys = c0.astype(np.float64), [None] * len(xs)
    for t in range(len(xs) - 1, -1, -1):
        ys[t] = c
        c = c * 0.8 + xs[t].astype(np.float64)
    return [c, np.array(ys).reshape(xs.shape)]


def axis1(c0, xs):
    return ops.scan(lambda c, x: (ops.sin(c) + x, c * x), c0, xs, axis=1)       # xs [3, T, 4], c [3, 4]


def axis1_ref(c0, xs):
    c, ys = c0.astype(np.float64), []
    for t in range(xs.shape[1]):
        x = xs[:, t].astype(np.float64)
        ys.append(c * x)
        c = np.sin(c) + x
    return [c, np.stack(ys, axis=1).reshape(xs.shape)]


def broadcast_carry(c0, xs):
    return ops.scan(lambda c, x: (ops.tanh(c * 0.9 + 0.1), x * c), c0, xs)     # c [1, 8] against x_t [4, 8]


def broadcast_carry_ref(c0, xs):
    c, ys = c0.astype(np.float64), []
    for x in xs.astype(np.float64):
        ys.append(x * c)
        c = np.tanh(c * 0.9 + 0.1)
    return [c, np.array(ys).reshape(xs.shape)]


def nested(c0, xs):
    def inner(d, x):                                           # over the 3 rows of one step's [3, 4]
        d = d * 0.5 + x
        return d, d * c0
    def outer(c, x):
        d, ys = ops.scan(inner, c, x)
        return d + 1.0, ys
    return ops.scan(outer, c0, xs)                              # xs [T, 3, 4]; c0 closed over by the inner body


def nested_ref(c0, xs):
    k, c, out = c0.astype(np.float64), c0.astype(np.float64), []
    for x in xs.astype(np.float64):
        d, ys = c, []
        for r in x:
            d = d * 0.5 + r
            ys.append(d * k)
        c = d + 1.0
        out.append(ys)
    return [c, np.array(out).reshape(xs.shape)]


CASES = {   # name: (fn, avals(T), inputs(T) -> (inputs, weights), reference, llvm's reference if another)
    "elementwise": (elementwise, lambda T: (f32[8], f32[T, 8]), lambda T: ((randn(8), randn(T, 8)), {}),
                    elementwise_ref, None),
    "reductions": (reductions, lambda T: (f32[1], f32[T, 16]), lambda T: ((randn(1), randn(T, 16)), {}),
                   reductions_ref, None),
    "matmul_weight": (matmul_weight, lambda T: (f32[1, 8], f32[T, 16], ggraph.param("w", f32[8, 16])),
                      lambda T: ((randn(1, 8), randn(T, 16)), {"w": randn(8, 16, scale=0.3)}),
                      matmul_weight_ref, None),
    "q8_weight": (q8_weight, lambda T: (f32[1, Q], f32[T, Q], ggraph.param("w", q8_0[Q, Q])),
                  lambda T: ((randn(1, Q), randn(T, Q)), {"w": quantize(randn(Q, Q, scale=0.1), q8_0)}),
                  q8_weight_ref, q8_weight_act_ref),
    "tuple_carry": (tuple_carry, lambda T: (f32[4], f32[4], f32[T, 4]),
                    lambda T: ((randn(4), randn(4), randn(T, 4, scale=0.3)), {}), tuple_carry_ref, None),
    "pytree_ys": (pytree_ys, lambda T: (f32[4], f32[T, 4], f32[T, 4]),
                  lambda T: ((randn(4), randn(T, 4, scale=0.5), randn(T, 4, scale=0.5)), {}), pytree_ys_ref, None),
    "empty_ys": (empty_ys, lambda T: (f32[4], f32[T, 4]), lambda T: ((randn(4), randn(T, 4)), {}), empty_ys_ref, None),
    "reverse": (reverse, lambda T: (f32[4], f32[T, 4]), lambda T: ((randn(4), randn(T, 4)), {}), reverse_ref, None),
    "axis1": (axis1, lambda T: (f32[3, 4], f32[3, T, 4]), lambda T: ((randn(3, 4), randn(3, T, 4)), {}),
              axis1_ref, None),
    "broadcast_carry": (broadcast_carry, lambda T: (f32[1, 8], f32[T, 4, 8]),
                        lambda T: ((randn(1, 8), randn(T, 4, 8)), {}), broadcast_carry_ref, None),
    "nested": (nested, lambda T: (f32[4], f32[T, 3, 4]), lambda T: ((randn(4), randn(T, 3, 4)), {}), nested_ref, None),
}
LENGTHS = (1, 7, 33)


def traced(name):
    fn, avals, *_ = CASES[name]
    return ggraph.trace(fn, *avals("T"), name=name)


def flat(out):
    leaves, _ = tree_flatten(out)
    return [np.asarray(x) for x in leaves]


def check(name, prog, llvm: bool = False):
    """Run ``prog`` at every length in LENGTHS (one compiled program) against the float64 loop."""
    _, _, inputs, ref, llvm_ref = CASES[name]
    ref = llvm_ref if llvm and llvm_ref else ref
    rtol = 1e-5
    for T in LENGTHS:
        args, weights = inputs(T)
        prog.bind_weights(weights)
        got = flat(prog(*args))
        want = ref(*args, *weights.values())
        assert len(got) == len(want), name
        for g, w in zip(got, want):
            assert g.dtype == np.float32 and g.shape == w.shape, (name, T, g.shape, w.shape)
            np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * max(1.0, np.abs(w).max()), err_msg=f"{name} T={T}")


@pytest.mark.parametrize("passes", ["default", "none"])
@pytest.mark.parametrize("name", CASES)
def test_numpy(name, passes):
    check(name, ggraph.compile(traced(name), backend="numpy", passes=passes))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", CASES)
def test_llvm(name, target, threads):
    from ggraph.backends.llvm.target import named_target
    prog = ggraph.compile(traced(name), backend="llvm", target=named_target(target), threads=threads)
    check(name, prog, llvm=True)


@pytest.mark.parametrize("name", ["elementwise", "tuple_carry", "nested"])
def test_llvm_unfused(name):
    """The unfused baseline (every op its own kernel in the loop) on the host's feature set."""
    check(name, ggraph.compile(traced(name), backend="llvm", passes="none", threads=2), llvm=True)


# -- passes see through the body ------------------------------------------------------------------

def _body_lines(text: str) -> list[str]:
    return text[text.index("body={"):].splitlines()


def test_body_fuses():
    """fuse_elementwise runs on the body: its chain of elementwise ops becomes one fused loop, logged, and
    the llvm program runs it as one kernel call per step (y_t written straight into ys, the new carry over
    the old)."""
    log = RewriteLog()
    g = run(traced("elementwise"), resolve("default"), log=log)
    body = g.eqns[0].params["body"]
    assert [e.prim.name for e in body.eqns] == ["fused"], str(g)
    assert any("fused{mul,add,tanh,mul,add}" in str(e) for e in log.rewrites("fuse_elementwise")), str(log)
    assert "fused{mul,add,tanh,mul,add}" in "\n".join(_body_lines(str(g)))
    prog = ggraph.compile(traced("elementwise"), backend="llvm", threads=1)
    looped = [c.kernel for c in prog.spec.calls if c.loops]       # the new carry written over the old in place
    assert len(looped) == 1 and looped[0].startswith("fused"), looped
    check("elementwise", prog, llvm=True)


@pytest.mark.parametrize("name", ["q8_weight", "matmul_weight"])
def test_body_dequant_matmul_fuses(name):
    """fuse_dequant_matmul runs on the body: a closed-over weight (q8_0 or f32) is read as stored (qmatmul)
    each step."""
    g = run(traced(name), resolve("default"))
    body = g.eqns[0].params["body"]
    assert body.count("qmatmul") == 1 and body.count("dequant") == 0 and body.count("matmul") == 0, str(g)


@ops.composite("scan_cumsum_test", None)
def cumsum(xs):
    """A composite whose decomposition is a scan (as an SSM scan's is), with no numpy rule of its own."""
    _, ys = ops.scan(lambda c, x: (c + x, c + x), np.zeros(xs.shape[1], np.float32), xs)   # a constant init
    return ys


def test_composite_with_scan():
    """A composite's decomposition may hold a scan: the numpy backend runs it, inline_composites inlines it
    (the scan then sits in the graph, its body processed too), and llvm runs the result."""
    g = ggraph.trace(lambda x: cumsum(ops.exp(x)) * 2.0, f32["T", 4])
    assert g.count("scan_cumsum_test") == 1
    x = randn(9, 4)
    want = np.cumsum(np.exp(x.astype(np.float64)), axis=0) * 2.0
    np.testing.assert_allclose(ggraph.compile(g, backend="numpy", passes=[])(x), want, rtol=1e-5)
    inl = run(g, resolve("inline_composites"))
    assert inl.count("scan_cumsum_test") == 0 and inl.count("scan") == 1, str(inl)
    for passes in ("none", "default"):
        np.testing.assert_allclose(ggraph.compile(g, backend="numpy", passes=passes)(x), want, rtol=1e-5)
        np.testing.assert_allclose(ggraph.compile(g, backend="llvm", passes=passes, threads=2)(x), want, rtol=1e-5)


# -- text, keys, cost ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_print_parse_round_trip(name):
    """print -> parse -> print gives the same text, traced and after the default pipeline (fused bodies
    print expanded), and the parsed graph computes the same."""
    g = traced(name)
    text = str(g)
    assert "body={ lambda ;" in text
    plain = lambda g, expand=False: graph_to_str(g, expand=expand, names=Names(hints=False))     # noqa: E731
    assert plain(parse(text)) == plain(g)                     # (a parsed param has no argument name)
    if not g.params:
        assert str(parse(text)) == text
    opt = run(g, resolve("default"))
    full = opt.pretty(expand=True)
    assert plain(parse(full), True) == plain(opt, True)
    again = ggraph.compile(parse(text), backend="numpy", passes=[])
    _, _, inputs, _, _ = CASES[name]
    args, weights = inputs(5)
    again.bind_weights(weights)
    prog = ggraph.compile(g, backend="numpy", passes=[], weights=weights)
    for a, b in zip(flat(again(*args)), flat(prog(*args))):
        np.testing.assert_array_equal(a, b)


def test_printed_form():
    """The body prints nested under its eqn, as a jaxpr prints scan's jaxpr param."""
    g = ggraph.trace(lambda c, xs: ops.scan(lambda c, x: (c + x, c * 2.0), c, xs), f32[4], f32["T", 4])
    assert str(g) == """{ lambda ; c:f32[4] xs:f32[T,4]. let
    a:f32[4] b:f32[T,4] = scan[length=T, reverse=False, consts=0, carry=1] c xs
      body={ lambda ; d:f32[4] e:f32[4]. let
          f:f32[4] = add d e
          g:f32[4] = mul d 2.0
        in (f g) }
  in (a b) }"""


def _two_bodies(op):
    return ggraph.trace(lambda c, xs: ops.scan(lambda c, x: (op(c, x), c), c, xs), f32[4], f32["T", 4])


def test_bodies_in_keys():
    """Scans that differ only in their bodies differ in signature, program key, and are not merged by cse."""
    from ggraph.backends.llvm.program import program_key
    from ggraph.backends.llvm.target import host_target
    a, b = _two_bodies(lambda c, x: c + x), _two_bodies(lambda c, x: c * x)
    assert a.signature() != b.signature()
    assert program_key(a, host_target(), False) != program_key(b, host_target(), False)
    both = ggraph.trace(lambda c, xs: (ops.scan(lambda c, x: (c + x, c), c, xs),
                                       ops.scan(lambda c, x: (c * x, c), c, xs)), f32[4], f32["T", 4])
    assert run(both, resolve("cse")).count("scan") == 2
    same = ggraph.trace(lambda c, xs: (ops.scan(lambda c, x: (c + x, c), c, xs),
                                       ops.scan(lambda c, x: (c + x, c), c, xs)), f32[4], f32["T", 4])
    assert run(same, resolve("cse")).count("scan") == 1


def test_cost():
    """A scan costs length × its body."""
    g = traced("matmul_weight")
    body = g.eqns[0].params["body"]
    per_step = sum(e.cost({"T": 1})[0] for e in body.eqns)
    assert per_step > 0
    assert g.cost(T=13)["scan"]["flops"] == 13 * per_step


def test_closure_conversion():
    """Closed-over values are operands of the scan eqn (the body's first inputs), not constants."""
    g = traced("matmul_weight")
    e = g.eqns[0]
    assert e.params["consts"] == 1 and e.inputs[0] is g.params[0]
    assert e.params["body"].invars[0].aval.shape == (8, 16)


# -- errors --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn, error, message", [
    (lambda c, xs: ops.scan(lambda c, x: (ops.reshape(c, (1, 4)), x), c, xs), TypeError,
     r"scan: carry carry goes into the body as f32\[4\] and comes out as f32\[1,4\]"),
    (lambda c, xs: ops.scan(lambda c, x: (c, x), c, (xs, xs[:3])), ValueError,
     r"scan: xs leaves differ in length along axis 0: xs\[0\] has T, xs\[1\] has 3"),
    (lambda c, xs: ops.scan("body", c, xs), TypeError, r"scan: body must be a function"),
    (lambda c, xs: ops.scan(lambda c, x: c + x, c, xs), TypeError, r"scan: body must return a pair \(carry, y\)"),
    (lambda c, xs: ops.scan(lambda c, x: ((c, c), x), c, xs), TypeError, r"another structure than init"),
    (lambda c, xs: ops.scan(lambda c, x: (ops.cast(c, "i32"), x), c, xs), TypeError, r"comes out as i32\[4\]"),
    (lambda c, xs: ops.scan(lambda c, x: (c, x), c, xs, axis=2), ValueError, r"axis 2 is out of range for xs"),
    (lambda c, xs: ops.scan(lambda c, x: (c, x), c, None), ValueError, r"with no xs, give length="),
])
def test_errors(fn, error, message):
    with pytest.raises(error, match=message):
        ggraph.trace(fn, f32[4], f32["T", 4])


def test_shape_rule_checks_bodies():
    """A parsed scan whose body does not fit its operands fails verification, naming scan."""
    text = str(traced("elementwise")).replace("c:f32[8] d:f32[8]. let", "c:f32[8] d:f32[9]. let")
    with pytest.raises(ValueError, match=r"scan: body input 1 \(xs\) is f32\[9\], the operand gives f32\[8\]"):
        parse(text)


# -- llvm specifics: profile, debug nans, memory -----------------------------------------------------

def test_profile():
    """A profiled program runs scans right, and its calls inside the loop sum their steps' time."""
    from ggraph.backends.llvm.program import LLVMProgram
    g = run(traced("tuple_carry"), resolve("default"))
    prog = LLVMProgram(g, threads=2, profile=True)
    check("tuple_carry", prog, llvm=True)
    assert len(prog.last_profile) == len(prog.spec.calls) and all(t >= 0 for _, t in prog.last_profile)
    assert sum(t for c, t in prog.last_profile if c.loops) > 0


def test_debug_nans(monkeypatch):
    """GGRAPH_DEBUG_NANS names the scan (on numpy, also the body eqn that made the value)."""
    from ggraph.backends.debug_nans import NonFiniteError
    monkeypatch.setenv("GGRAPH_DEBUG_NANS", "1")
    g = ggraph.trace(lambda c, xs: ops.scan(lambda c, x: (c + ops.log(x), c), c, xs), f32[4], f32["T", 4])
    xs = np.abs(randn(6, 4)) + 1.0
    xs[3, 2] = -1.0
    with pytest.raises(NonFiniteError, match=r"output 0 of log at top level is not finite .*inside scan"):
        ggraph.compile(g, backend="numpy", passes=[])(randn(4), xs)
    with pytest.raises(NonFiniteError, match=r"of scan at top level is not finite.*its body runs inside it: the "
                                             r"numpy backend names the op there"):
        ggraph.compile(g, backend="llvm", threads=2)(randn(4), xs)


def test_loop_buffers_live_over_the_loop():
    """The arena keeps every buffer a loop uses for the whole loop: the buffers only the loop uses (the
    body's values) share one lifetime, and every other buffer it uses lives over at least that."""
    from ggraph.backends.llvm.program import lifetimes
    prog = ggraph.compile(traced("nested"), backend="llvm", threads=2)
    spans = lifetimes(prog.spec)
    bufs = lambda calls: {a.buf for c in calls for a in c.args if hasattr(a, "buf")} & set(spans)    # noqa: E731
    looped = bufs(c for c in prog.spec.calls if c.loops)
    outputs = {o.buf for o in prog.spec.outputs}                          # these live on past the last call
    only = looped - bufs(c for c in prog.spec.calls if not c.loops) - outputs
    assert only and looped - only
    lo, hi = min(spans[b][0] for b in only), max(spans[b][1] for b in only)
    assert lo < hi
    for b in only:
        assert spans[b] == (lo, hi), (b, spans[b], lo, hi)
    for b in looped:
        assert spans[b][0] <= lo and spans[b][1] >= hi, (b, spans[b], lo, hi)


def test_verify_checks_the_body():
    """The verifier goes into the body: an operand used before it is defined there is named."""
    g = traced("elementwise")
    body = g.eqns[0].params["body"]
    broken = body.replace(eqns=body.eqns[1:])                  # e (the first eqn's output) is never defined
    bad = g.replace(eqns=[g.eqns[0].replace(params={**g.eqns[0].params, "body": broken})])
    with pytest.raises(VerifyError, match=r"eqn 0 \(.*scan.*\): param body: eqn 0 .* operand .* is used before"):
        bad.verify()


def test_dump_after_shows_the_body(capsys):
    """Dumping the graph after a pass shows the body as that pass left it."""
    run(traced("elementwise"), resolve("default"), dump_after={"fuse_elementwise"})
    out = capsys.readouterr().out
    assert "# after fuse_elementwise" in out and "body={ lambda ;" in out and "fused{mul,add,tanh,mul,add}" in out


def test_symbolic_step_slice():
    """A step slice of symbolic size runs on numpy; llvm refuses it, naming scan and the slice."""
    g = ggraph.trace(lambda c, xs: ops.scan(lambda c, x: (c + ops.reduce_sum(x), c), c, xs, axis=1),
                     f32[1], f32["T", 5])
    xs = randn(6, 5)
    final, ys = ggraph.compile(g, backend="numpy", passes=[])(np.zeros(1, np.float32), xs)
    np.testing.assert_allclose(final, xs.astype(np.float64).sum(keepdims=True).reshape(1), rtol=1e-5)
    with pytest.raises(NotImplementedError, match=r"scan at top: xs f32\[5,T\] has a symbolic step slice"):
        ggraph.compile(g, backend="llvm")


def test_carries_in_place_only_when_safe():
    """A new carry is written over the old one only when nothing reads the old one afterwards: here the
    add reads c after the mul made the new carry (unfused, two kernels), so the new carry is copied at the
    step's end; the results are the float64 loop's either way."""
    from ggraph.backends.llvm.rules import _carries_in_place

    def late_read(c, xs):
        def body(c, x):
            n = c * 2.0 + x
            return n, c + n
        return ops.scan(body, c, xs)

    def early_read(c, xs):
        return ops.scan(lambda c, x: (ops.tanh(c) * x, x + 1.0), c, xs)

    x, c0 = randn(9, 4, scale=0.3), randn(4)
    c, ys = c0.astype(np.float64), []
    for t in range(9):
        n = c * 2.0 + x[t]
        ys.append(c + n)
        c = n
    for fn, in_place, want in ((late_read, {}, [c, np.array(ys)]), (early_read, {0: 0}, None)):
        g = run(ggraph.trace(fn, f32[4], f32["T", 4]), resolve("none"))
        body = g.eqns[0].params["body"]
        assert {body.outvars.index(v): k for v, k in _carries_in_place(body, 0, 1).items()} == in_place
        if want is not None:
            prog = ggraph.compile(g, backend="llvm", passes=[], threads=2)
            assert [c.kernel for c in prog.spec.calls if c.loops][-1] == "copy_bytes"
            for got, w in zip(prog(c0, x), want):
                np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


def test_plan_keeps_operands_apart_from_outputs():
    """plan_memory gives a scan's outputs buffers of their own: an operand that dies at the scan (here the
    transposed xs of axis=1) is still read by every step."""
    g = run(traced("axis1"), resolve("default"))
    plan = g.meta["memory_plan"]
    e = next(e for e in g.eqns if e.prim.name == "scan")
    ins = {plan.buffer_of[a] for a in e.inputs if a in plan.buffer_of}
    assert ins and not ins & {plan.buffer_of[o] for o in e.outputs}
