"""Passes, text in and text out, and the pass manager's contract."""
import textwrap

import pytest

import ggraph
from ggraph import f32, ops
from ggraph.ir.graph import Var
from ggraph.ir.text import ParseError, parse
from ggraph.cli import main
from ggraph.ir.primitive import ShapeError
from ggraph.passes import PASSES, PassError, PipelineError, RewriteLog, graph_pass, resolve, run


def check(pass_names, before, after, expand=False):
    log = RewriteLog()
    g = run(parse(textwrap.dedent(before)), resolve(pass_names), log=log)
    assert g.pretty(expand=expand) == textwrap.dedent(after).strip("\n")
    return log


def test_dce():
    log = check(["dce"], """
    { lambda ; x:f32[T,4] y:f32[4]. let
        a:f32[T,4] = add x y
        b:f32[T,4] = mul x y
        c:f32[T,4] = exp b
      in (a) }
    """, """
    { lambda ; x:f32[T,4] y:f32[4]. let
        a:f32[T,4] = add x y
      in (a) }
    """)
    assert [str(e) for e in log.rewrites()] == ["+ [dce] removed dead exp", "+ [dce] removed dead mul"]


def test_cse_keeps_cache_writes():
    check(["cse"], """
    { lambda ; x:f32[T,4] c:f32[8,4] P:i32[]. let
        a:f32[T,4] = exp x
        b:f32[T,4] = exp x
        d:f32[T,4] = add a b
        e:f32[8,4] = cache_update c d P
        f:f32[8,4] = cache_update e d P
      in (f) }
    """, """
    { lambda ; x:f32[T,4] c:f32[8,4] P:i32[]. let
        a:f32[T,4] = exp x
        b:f32[T,4] = add a a
        d:f32[8,4] = cache_update c b P
        e:f32[8,4] = cache_update d b P
      in (e) }
    """)


def test_fold_identities_and_constants():
    log = check(["fold", "dce"], """
    { lambda ; x:f32[T,4]. let
        a:f32[T,4] = mul x 1.0
        b:f32[T,4] = add 0.0 a
        c:f32[4,T] = transpose[perm=(1,0)] b
        d:f32[T,4] = transpose[perm=(1,0)] c
        e:f32[T,2,2] = reshape[shape=(T,2,2)] d
        f:f32[T,4,1] = reshape[shape=(T,4,1)] e
        g:f32[] = mul 2.0 3.0
        h:f32[T,4,1] = mul f g
      in (h) }
    """, """
    { lambda ; x:f32[T,4]. let
        a:f32[T,4,1] = reshape[shape=(T,4,1)] x
        b:f32[T,4,1] = mul a 6.0
      in (b) }
    """)
    details = [e.detail for e in log.rewrites("fold")]
    assert "removed identity mul" in details and "merged transpose∘transpose" in details
    assert "merged reshape∘reshape" in details and any(d.startswith("folded constant mul") for d in details)


def test_fold_keeps_broadcasting_identity():
    """x + 0 with a broadcast 0 of a bigger shape is not an identity."""
    check(["fold"], """
    { lambda ; x:f32[4] z:f32[T,4]. let
        a:f32[T,4] = mul z 0.0
        b:f32[T,4] = add x a
      in (b) }
    """, """
    { lambda ; x:f32[4] z:f32[T,4]. let
        a:f32[T,4] = mul z 0.0
        b:f32[T,4] = add x a
      in (b) }
    """)


def test_inline_composites():
    g = ggraph.trace(lambda x: ops.silu(x), f32["T", 4])
    text = g.pretty(expand=True)
    assert text == textwrap.dedent("""\
    { lambda ; x:f32[T,4]. let
        a:f32[T,4] = silu x
          { lambda ; b:f32[T,4]. let
              c:f32[T,4] = neg b
              d:f32[T,4] = exp c
              e:f32[T,4] = add d 1.0
              f:f32[T,4] = div b e
            in (f) }
      in (a) }""")
    check(["inline_composites"], text, """
    { lambda ; x:f32[T,4]. let
        a:f32[T,4] = neg x
        b:f32[T,4] = exp a
        c:f32[T,4] = add b 1.0
        d:f32[T,4] = div x c
      in (d) }
    """)


def test_inline_is_recursive():
    g = ggraph.trace(lambda g_, u: ops.swiglu(g_, u), f32["T", 4], f32["T", 4])
    out = run(g, resolve("inline_composites"))
    assert all(not e.prim.composite for e in out.eqns) and out.count("exp") == 1


def test_unknown_pass_and_pipeline():
    g = parse("{ lambda ; x:f32[4]. let\n  in (x) }")
    with pytest.raises(PipelineError, match=r"passes: unknown pass\(es\) fuse_everything \(pipelines: default, .*"
                                            r"passes: .*dce"):
        resolve(["dce", "fuse_everything"])
    with pytest.raises(PipelineError, match="passes: unknown pipeline or pass 'fast'"):
        ggraph.compile(g, passes="fast")
    with pytest.raises(PipelineError, match=r"disabled: unknown pass\(es\) nope"):
        resolve("default", disabled=["nope"])
    with pytest.raises(PipelineError, match=r"passes: unknown pass\(es\) fuse_everything"):
        run(g, ["fuse_everything"])


def test_resolve_spells_a_pipeline_three_ways():
    dce, cse = PASSES["dce"], PASSES["cse"]
    assert resolve("dce,cse") == resolve(["dce", "cse"]) == resolve((dce, cse)) == (dce, cse)
    assert resolve("dce") == resolve(" dce ") == (dce,) and resolve("") == resolve([]) == ()
    assert resolve(" none") == resolve("none")
    assert [p.name for p in resolve("default", disabled=["dce", "plan_memory"])][:2] == ["cse", "fold"]
    assert resolve("none", disabled=["inline_composites"]) == (dce, cse, PASSES["fold"])


def test_bad_passes_flags_are_one_line_naming_the_flag(capsys):
    """Found before the model is read (none is given): one line naming the flag and the unknown pass."""
    for argv, words in ((["run", "-p", "hi", "--passes", "dce,fuze"], ("--passes: unknown pass(es) fuze", "fold")),
                        (["dump", "--passes", "fast"], ("--passes: unknown pipeline or pass 'fast'", "imatrix")),
                        (["run", "-p", "hi", "--no-pass", "fuse_everything"],
                         ("--no-pass: unknown pass(es) fuse_everything", "plan_memory")),
                        (["diff", "--vs", "dce,nope"], ("--vs: unknown pass(es) nope",))):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"ggraph {argv[0]}: error: "), err
        for w in words:
            assert w in err, (w, err)


def test_disabled_pass_is_skipped():
    g = parse("{ lambda ; x:f32[4]. let\n a:f32[4] = exp x\n  in (x) }")
    log = RewriteLog()
    assert len(run(g, resolve("dce", disabled=["dce"]), log=log).eqns) == 1 and log.ran == []


def test_verify_failure_names_pass_eqn_and_history():
    @graph_pass("test_break_shapes")
    def break_shapes(graph):
        """Corrupt the first eqn's output aval (a deliberately broken pass for this test)."""
        e = graph.eqns[0]
        return graph.replace(eqns=(e.replace(outputs=(Var(f32[3]),)),) + graph.eqns[1:])
    try:
        g = parse("{ lambda ; x:f32[4]. let\n a:f32[4] = exp x\n b:f32[4] = neg a\n  in (b) }")
        with pytest.raises(PassError, match=r"pass 'test_break_shapes' left an invalid graph: eqn 0 \(.*exp x\): "
                                            r"declares outputs f32\[3\].*passes run before: dce, cse"):
            run(g, resolve("dce,cse,test_break_shapes"))
    finally:
        del PASSES["test_break_shapes"]


def test_any_error_in_a_pass_names_it_and_the_passes_before():
    @graph_pass("test_raise_shape_error")
    def raise_shape_error(graph):
        """Raise a ShapeError (a deliberately broken pass for this test)."""
        raise ShapeError("add: shapes (4,) and (3,) do not broadcast")
    try:
        g = parse("{ lambda ; x:f32[4]. let\n a:f32[4] = exp x\n  in (a) }")
        with pytest.raises(PassError, match=r"pass 'test_raise_shape_error' failed: ShapeError: add: shapes .* "
                                            r"\(passes run before: dce, cse\)") as info:
            run(g, resolve("dce,cse,test_raise_shape_error"))
        assert isinstance(info.value.__cause__, ShapeError)
    finally:
        del PASSES["test_raise_shape_error"]


def test_every_pass_has_a_one_line_doc():
    for p in PASSES.values():
        assert p.doc and len(p.doc) < 120, p.name


def test_parse_errors_name_the_line():
    with pytest.raises(ParseError, match="unknown op 'frobnicate'"):
        parse("{ lambda ; x:f32[4]. let\n a:f32[4] = frobnicate x\n  in (a) }")
    with pytest.raises(ParseError, match="needs its body"):
        parse("{ lambda ; x:f32[4]. let\n a:f32[4] = silu x\n  in (a) }")


def test_dump_after():
    g = ggraph.trace(lambda x: ops.silu(x) * 1.0, f32["T", 4])
    seen = []
    run(g, resolve("inline_composites,fold"), dump_after=lambda name, gr: seen.append((name, gr.count("mul"))))
    assert seen == [("inline_composites", 1), ("fold", 0)]
