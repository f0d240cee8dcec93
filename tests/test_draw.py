"""The static pictures of a graph (``ggraph dump --format png|svg``): a whole model outlines only its fused
kernels, layers alike in a row share a box, the legend says what the outline means, and tall views fit."""
import pytest
from matplotlib.colors import to_rgba

from ggraph import f32, ops, trace
from ggraph.ir.graph import op_label
from ggraph.ir.trace import scope
from ggraph.passes import resolve, run
from ggraph.view.dot import FUSED_COLOUR, FUSED_NOTE, graph_to_dot, graph_to_networkx
from ggraph.view.draw import figure, layout


def layered(n=4, odd=None):
    """A residual stack of ``n`` scoped layers, fused by the default pipeline; layer ``odd`` has one op more."""
    def fn(x, w):
        for i in range(n):
            with scope(f"blk.{i}"):
                h = ops.linear(ops.silu(x), w)
                if i == odd:
                    h = ops.mul(h, h)
                x = ops.add(x, h)
        with scope("output"):
            return ops.rms_norm(x, eps=1e-6)
    return run(trace(fn, f32["T", 64], f32[64, 64]), resolve("default"))


def test_layers_alike_in_a_row_share_a_box():
    g = graph_to_networkx(layered(4))                           # blk.0 reads x alone: its first loop differs
    assert [n for n, d in g.nodes(data=True) if d["kind"] == "scope"] == ["blk.0", "blk.1-3", "output"]
    assert g.nodes["blk.1-3"]["label"].startswith("blk.1-3 (3 layers alike): ")
    g = graph_to_networkx(layered(7, odd=3))                    # blk.3's mul fuses into blk.4's first loop
    boxes = [n for n, d in g.nodes(data=True) if d["kind"] == "scope"]
    assert boxes == ["blk.0", "blk.1-3", "blk.4", "blk.5-6", "output"]
    assert all(g.has_edge(a, b) for a, b in zip(boxes, boxes[1:])) and not any(g.has_edge(b, b) for b in boxes)


def test_a_layer_box_lists_its_kernels_and_only_fused_kernels_are_outlined():
    graph = layered(7, odd=3)
    reps = {"blk.0": "blk.0", "blk.1-3": "blk.1", "blk.4": "blk.4", "blk.5-6": "blk.5", "output": "output"}
    fused = {rep: [op_label(e) for e in graph.eqns if e.scope.startswith(rep) and e.prim.kind == "fused"]
             for rep in reps.values()}
    assert all(fused.values())
    g = graph_to_networkx(graph)
    assert not any(d.get("fused") for _, d in g.nodes(data=True))           # no layer box is outlined
    for box, rep in reps.items():
        assert [k[0] for k in g.nodes[box]["kernels"] if k[2]] == fused[rep]
    fig = figure(graph)
    red = to_rgba(FUSED_COLOUR)
    outlined = [p for p in fig.axes[0].patches if to_rgba(p.get_edgecolor()) == red]
    lay = layout(g)
    chips = [c for cs in lay.chips.values() for c in cs if c[2]]
    legend_key = 1                                               # the legend's own red swatch
    assert len(outlined) == len(chips) + legend_key == sum(len(v) for v in fused.values()) + legend_key
    spots = {(round(c[3], 6), round(c[4], 6)) for c in chips}
    assert len([p for p in outlined if (round(p.get_x(), 6), round(p.get_y(), 6)) in spots]) == len(chips)


def test_the_legend_says_what_the_outline_means_and_fits_the_picture():
    fig = figure(layered(4))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert FUSED_NOTE in texts and any("one box per layer" in t for t in texts)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    renderer = FigureCanvasAgg(fig).get_renderer()
    width = fig.get_figwidth() * fig.dpi
    assert all(t.get_window_extent(renderer).x1 <= width for t in fig.axes[0].texts)


def test_dot_lists_the_kernels_with_the_fused_ones_outlined():
    graph = layered(7, odd=3)
    dot = graph_to_dot(graph)
    fused = sum(e.prim.kind == "fused" for e in graph.eqns if e.scope.startswith(("blk.0", "blk.1", "blk.4",
                                                                                    "blk.5", "output")))
    assert dot.count(f'COLOR="{FUSED_COLOUR}" BORDER="2"') == fused
    assert "penwidth" not in dot and FUSED_NOTE in dot


def chain(n=80):
    """A long chain of elementwise ops, unfused: one box per row, many rows."""
    def fn(x):
        for i in range(n):
            x = ops.exp(x) if i % 2 else ops.neg(x)
        return x
    return run(trace(fn, f32["T", 64]), resolve("none"))


def test_a_tall_view_is_wrapped_into_columns_joined_by_named_stubs():
    from ggraph.view.draw import TALL, columns
    g = graph_to_networkx(chain())
    bands = columns(g)
    assert len(bands) >= 3
    stubs = [n for b in bands for n in b if n.startswith(("to:", "from:"))]
    real = [n for b in bands for n in b if n not in stubs]
    assert sorted(real) == sorted(g) and len(real) == len(set(real))       # every node once
    tos = sorted(n[3:] for n in stubs if n.startswith("to:"))
    assert tos and tos == sorted(n[5:] for n in stubs if n.startswith("from:"))   # each cut edge leaves and arrives
    assert all("column" in b.nodes[n]["label"] for b in bands for n in b if n in stubs)
    lay = layout(g)
    assert lay.height < TALL * lay.width                                    # no longer a strip
    rects = list(lay.boxes.values()) + [lab[1:] for lab in lay.labels]
    for i, (x0, y0, w0, h0) in enumerate(rects):
        for x1, y1, w1, h1 in rects[i + 1:]:
            assert x0 + w0 <= x1 + 1e-9 or x1 + w1 <= x0 + 1e-9 or y0 + h0 <= y1 + 1e-9 or y1 + h1 <= y0 + 1e-9
    assert all(x0 >= 0 and y0 >= 0 and x0 + w <= lay.width + 1e-9 and y0 + h <= lay.height + 1e-9
               for x0, y0, w, h in rects)
    assert len(columns(graph_to_networkx(chain(6)))) == 1                   # a short view stays one column
