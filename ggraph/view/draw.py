"""Pictures of a graph: graphviz ``dot`` when it is installed, else a layered layout drawn with matplotlib.

    draw(graph, "layer3.png", layer=3)      # one layer: one box per eqn
    draw(graph, "model.svg")                # a whole model: one box per layer

Both renderers draw the networkx model the DOT text is made from (``ggraph.view.dot.graph_to_networkx``):
nodes coloured by op kind, fused kernels outlined, edges labelled with value, dtype, shape
and bytes. The matplotlib layout is a small Sugiyama layout: rows by longest path, long edges
routed through invisible points, rows ordered by barycentre to cut crossings, and x pulled
toward each node's neighbours.
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

from ggraph.ir.graph import Graph
from ggraph.view.dot import EDGE_NOTE, FUSED_COLOUR, FUSED_NOTE, KIND_COLOURS, graph_to_dot, graph_to_networkx

FORMATS = ("png", "svg")
DPI = 110

# sizes in inches (the axes are laid out in inches, so text and boxes scale together)
FONT, EDGE_FONT = 6.5, 5.5          # points
CHAR_W, LINE_H = 0.057, 0.11         # a monospace character and a line at FONT
EDGE_CHAR_W, EDGE_LINE_H = 0.048, 0.095   # the same at EDGE_FONT
PAD_X, PAD_Y = 0.14, 0.08            # inside a box
GAP_X, GAP_Y = 0.22, 0.32            # between boxes
ROUTE_W = 0.1                        # the width a long edge takes as it passes a row
MARGIN = 0.25                        # around the drawing
TALL, TALL_MIN, COLUMN_GAP = 1.6, 24.0, 0.4    # a view this many times higher than wide is wrapped into columns
TITLE_CHAR_W, KEY_CHAR_W = 0.058, 0.05          # a character of the title (8 pt), of a legend entry (6 pt)
KEY_W, KEY_GAP, KEY_H = 0.22, 0.25, 0.17        # a legend swatch, the gap after an entry, a legend row
CHIP_FONT, CHIP_CHAR_W, CHIP_H = 5.5, 0.048, 0.16    # a kernel's chip inside a layer box
CHIP_PAD, CHIP_GAP, CHIP_ROW = 0.05, 0.05, 5.2       # inside a chip, between chips, widest row of chips


def draw(graph: Graph, path, layer: int | None = None, fmt: str | None = None) -> str:
    """Write a PNG or SVG of ``graph`` (one layer if given) to ``path``; returns the renderer used."""
    fmt = (fmt or Path(path).suffix.lstrip(".")).lower()
    if fmt not in FORMATS:
        raise ValueError(f"draw: format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    dot = shutil.which("dot")
    if dot:
        done = subprocess.run([dot, f"-T{fmt}", "-o", str(path)], input=graph_to_dot(graph, layer=layer).encode(),
                              capture_output=True)
        if done.returncode:
            raise ValueError(f"graphviz dot failed ({done.returncode}): {done.stderr.decode().strip()}")
        return "graphviz"
    draw_matplotlib(graph, path, layer, fmt)
    return "matplotlib"


# ---------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------

def box_size(label: str) -> tuple[float, float]:
    """(width, height) in inches of a box holding ``label`` in monospace."""
    lines = label.split("\n")
    return PAD_X * 2 + CHAR_W * max(len(s) for s in lines), PAD_Y * 2 + LINE_H * len(lines)


def chip_rows(kernels: list, width: float) -> list[list[tuple]]:
    """The kernels of a layer box as rows of chips no wider than ``width``: (name, kind, fused, x, w)
    with x from the row's left edge, in program order."""
    rows, x = [[]], 0.0
    for name, kind, fused in kernels:
        w = CHIP_PAD * 2 + CHIP_CHAR_W * len(name)
        if rows[-1] and x + w > width:
            rows.append([])
            x = 0.0
        rows[-1].append((name, kind, fused, x, w))
        x += w + CHIP_GAP
    return rows if rows[-1] else []


def node_size(d: dict) -> tuple[float, float]:
    """A node's box: its label, and under it the rows of its kernels' chips if it lists any."""
    w, h = box_size(d["label"])
    if not d.get("kernels"):
        return w, h
    inner = max(w - 2 * PAD_X, min(CHIP_ROW, sum(CHIP_PAD * 2 + CHIP_CHAR_W * len(k[0]) + CHIP_GAP
                                                for k in d["kernels"])))
    rows = chip_rows(d["kernels"], inner)
    wide = max(r[-1][3] + r[-1][4] for r in rows)
    return max(w, wide + 2 * PAD_X), h + len(rows) * (CHIP_H + CHIP_GAP)


def ranks(g, sweeps: int = 4) -> dict:
    """Row of each node: longest path from the sources, then each node moved to the median row its
    neighbours want (within the rows its edges allow), so weights and dequants sit by their readers."""
    import networkx as nx
    order = list(nx.topological_sort(g))
    rank: dict = {}
    for n in order:
        rank[n] = max((rank[p] + 1 for p in g.predecessors(n)), default=0)
    for s in range(sweeps):
        for n in order[::-1] if s % 2 == 0 else order:
            lo = max((rank[p] + 1 for p in g.predecessors(n)), default=-10**9)
            hi = min((rank[c] - 1 for c in g.successors(n)), default=10**9)
            want = sorted([rank[p] + 1 for p in g.predecessors(n)] + [rank[c] - 1 for c in g.successors(n)])
            if want:
                rank[n] = min(max(want[len(want) // 2], lo), hi)
    low = min(rank.values(), default=0)
    return {n: r - low for n, r in rank.items()}


def route_long_edges(g, rank: dict) -> tuple[list[list], dict, dict, dict]:
    """Rows of nodes plus one routing point ``("route", a, b, row)`` per row an edge a->b passes.

    Returns (rows, routes: edge -> its chain of nodes and points, ups, downs: neighbours in the row above/below).
    """
    rows: list[list] = [[] for _ in range(max(rank.values(), default=-1) + 1)]
    for n in g:                                              # networkx keeps insertion (graph) order
        rows[rank[n]].append(n)
    routes, ups, downs = {}, {n: [] for n in g}, {n: [] for n in g}
    for a, b in g.edges:
        chain = [a] + [("route", a, b, r) for r in range(rank[a] + 1, rank[b])] + [b]
        for r, p in zip(range(rank[a] + 1, rank[b]), chain[1:-1]):
            rows[r].append(p)
            ups[p], downs[p] = [], []
        for p, q in zip(chain, chain[1:]):
            downs[p].append(q)
            ups[q].append(p)
        routes[(a, b)] = chain
    return rows, routes, ups, downs


def order_rows(rows: list[list], ups: dict, downs: dict, sweeps: int = 4) -> None:
    """Reorder each row by the mean position of its neighbours in the row before (or after)."""
    def sweep(row, neighbours, index):
        here = {n: k for k, n in enumerate(row)}
        key = {n: sum(index[m] for m in neighbours[n]) / len(neighbours[n]) if neighbours[n] else here[n]
               for n in row}
        row.sort(key=key.get)
    for s in range(sweeps):
        down = s % 2 == 0
        for r in range(1, len(rows)) if down else range(len(rows) - 2, -1, -1):
            near = rows[r - 1] if down else rows[r + 1]
            sweep(rows[r], ups if down else downs, {n: k for k, n in enumerate(near)})


def place_x(rows: list[list], widths: dict, ups: dict, downs: dict, iters: int = 8) -> dict:
    """x of each node's centre: packed rows, then pulled toward neighbours while keeping the gaps."""
    x = {}
    for row in rows:
        at = 0.0
        for n in row:
            x[n] = at + widths[n] / 2
            at += widths[n] + GAP_X
    for it in range(iters):
        down = it % 2 == 0
        for row in rows if down else rows[::-1]:
            want = [_pulled(n, x, ups, downs, down) for n in row]
            sep = [(widths[a] + widths[b]) / 2 + GAP_X for a, b in zip(row, row[1:])]
            left = want[:]
            for k in range(1, len(row)):
                left[k] = max(left[k], left[k - 1] + sep[k - 1])
            right = want[:]
            for k in range(len(row) - 2, -1, -1):
                right[k] = min(right[k], right[k + 1] - sep[k])
            for n, a, b in zip(row, left, right):
                x[n] = (a + b) / 2
    low = min((x[n] - widths[n] / 2 for n in x), default=0.0)
    return {n: v - low + MARGIN for n, v in x.items()}


def _pulled(n, x: dict, ups: dict, downs: dict, down: bool) -> float:
    """Where ``n``'s neighbours want it: their mean x, the rows already placed in this sweep counted twice."""
    near = (ups[n] if down else downs[n]) * 2 + (downs[n] if down else ups[n])
    return sum(x[m] for m in near) / len(near) if near else x[n]


# ---------------------------------------------------------------------------------------
# geometry
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Layout:
    """Where everything goes, in inches from the top left (y grows downwards)."""
    boxes: dict             # node -> (x0, y0, w, h)
    chips: dict             # node -> [(name, kind, fused, x0, y0, w, h)]: the kernels a layer box lists
    labels: list            # (text, x0, y0, w, h): each value's label, once, under its producer
    paths: dict             # edge (a, b) -> the points its curve passes through, top to bottom
    width: float
    height: float
    legend: list            # rows of (label, fill, outline colour, dashed): what the colours and outlines mean
    nodes: dict             # node -> its attributes (label, kind, fused, kernels), the columns' stubs too


def layout(g) -> Layout:
    """Boxes sized to their labels, rows by rank, long edges routed, value labels in the gaps; a view
    much taller than wide wrapped into columns side by side (``columns``); the title and legend on top."""
    g = g.copy()
    g.remove_nodes_from([n for n in list(g) if g.degree(n) == 0])
    parts, at = [], 0.0
    for band in columns(g):
        part = _place(band)
        parts.append(_shift(part, at, 0.0))
        at += part.width - MARGIN + COLUMN_GAP
    title = f"{g.graph.get('title', '')}  ({EDGE_NOTE})"
    width = max(max((p.width for p in parts), default=1.0), 6.0, len(title) * TITLE_CHAR_W + 2 * MARGIN)
    legend = _legend_rows(_legend([d for p in parts for d in p.nodes.values()]), width - 2 * MARGIN)
    header = 0.38 + KEY_H * len(legend) + 0.12
    lay = Layout({}, {}, [], {}, width, max([p.height for p in parts] + [2.0 - header]) + header, legend, {})
    for p in parts:
        p = _shift(p, 0.0, header)
        lay.boxes.update(p.boxes)
        lay.chips.update(p.chips)
        lay.labels.extend(p.labels)
        lay.paths.update(p.paths)
        lay.nodes.update(p.nodes)
    return lay


def _shift(lay: Layout, dx: float, dy: float) -> Layout:
    """``lay`` moved right by dx and down by dy (its size grows by as much)."""
    return Layout({n: (x0 + dx, y0 + dy, w, h) for n, (x0, y0, w, h) in lay.boxes.items()},
                  {n: [(a, b, c, x0 + dx, y0 + dy, w, h) for a, b, c, x0, y0, w, h in cs] for n, cs in lay.chips.items()},
                  [(t, x0 + dx, y0 + dy, w, h) for t, x0, y0, w, h in lay.labels],
                  {e: [(x + dx, y + dy) for x, y in pts] for e, pts in lay.paths.items()},
                  lay.width + dx, lay.height + dy, lay.legend, lay.nodes)


def _place(g) -> Layout:
    """One column's layout from y=0 (no title or legend)."""
    rank = ranks(g)
    rows, routes, ups, downs = route_long_edges(g, rank)
    order_rows(rows, ups, downs)
    size = {n: node_size(d) for n, d in g.nodes(data=True)}
    widths = {n: max(size[n][0], _labels_width(g, n)) if n in size else ROUTE_W for row in rows for n in row}
    x = place_x(rows, widths, ups, downs)
    width = max((x[n] + widths[n] / 2 for n in x), default=1.0) + MARGIN
    top, bottom = _rows_y(g, rows, size, 0.0)
    box_y = {n: (top[rank[n]] + bottom[rank[n]] - size[n][1]) / 2 for n in g}      # centred in its row
    boxes = {n: (x[n] - size[n][0] / 2, box_y[n], *size[n]) for n in g}
    chips = {}
    for n, d in g.nodes(data=True):
        if d.get("kernels"):
            x0, y0, w, _ = boxes[n]
            first = y0 + PAD_Y + LINE_H * len(d["label"].split("\n")) + CHIP_GAP     # the first row of chips
            chips[n] = [(name, kind, fused, x0 + PAD_X + cx, first + k * (CHIP_H + CHIP_GAP), cw, CHIP_H)
                        for k, row in enumerate(chip_rows(d["kernels"], w - 2 * PAD_X))
                        for name, kind, fused, cx, cw in row]
    port = _ports(g, x, routes, widths)
    paths = {}
    for (a, b), chain in routes.items():
        pts = [(port[((a, b), "out")], box_y[a] + size[a][1])]
        for p in chain[1:-1]:
            pts += [(x[p], top[p[3]]), (x[p], bottom[p[3]])]
        paths[(a, b)] = pts + [(port[((a, b), "in")], box_y[b])]
    labels = []
    for n in g:
        y = box_y[n] + size[n][1] + 0.03
        for text, _ in _edge_labels(g, n):
            w, h = _label_size(text)
            labels.append((text, x[n] - w / 2, y, w, h))
            y += h
    return Layout(boxes, chips, labels, paths, width, (bottom[-1] if bottom else 0.0) + MARGIN, [],
                  dict(g.nodes(data=True)))


def columns(g) -> list:
    """``g`` as one graph, or, when its rows stack TALL times higher than its widest row (and over
    TALL_MIN inches), as about sqrt(height / width) columns of consecutive rows: each cut where the
    fewest edges cross, near an even split of the height, and each crossing edge drawn as a dashed
    "to column j" node under its source and a "from column i" node above its target."""
    import math

    import networkx as nx
    if g.number_of_nodes() == 0:
        return [g]
    rank = ranks(g)
    size = {n: node_size(d) for n, d in g.nodes(data=True)}
    n_rows = max(rank.values()) + 1
    row_h, row_w = [LINE_H] * n_rows, [0.0] * n_rows
    for n, r in rank.items():
        below = sum(_label_size(t)[1] for t, _ in _edge_labels(g, n))
        row_h[r] = max(row_h[r], size[n][1] + GAP_Y + below)
        row_w[r] += max(size[n][0], _labels_width(g, n)) + GAP_X
    height, width = sum(row_h), max(row_w)
    k = max(2, round(math.sqrt(height / width))) if height > TALL_MIN and height > TALL * width else 1
    if k == 1:
        return [g]
    below = [sum(row_h[:r]) for r in range(n_rows + 1)]            # height above row r
    crossing = [sum(rank[a] < r <= rank[b] for a, b in g.edges) for r in range(n_rows + 1)]
    cuts = []
    for j in range(1, k):
        want = j * height / k
        near = [r for r in range(1, n_rows) if abs(below[r] - want) <= 0.15 * height / k and r not in cuts] or \
            [min(range(1, n_rows), key=lambda r: abs(below[r] - want))]
        cuts.append(min(near, key=lambda r: (crossing[r], abs(below[r] - want))))
    cuts = sorted(set(cuts))
    band_of = {n: sum(r >= c for c in cuts) for n, r in rank.items()}
    bands = [nx.DiGraph(**g.graph) for _ in range(len(cuts) + 1)]
    for n, d in g.nodes(data=True):
        bands[band_of[n]].add_node(n, **d)
    for a, b, d in g.edges(data=True):
        i, j = band_of[a], band_of[b]
        if i == j:
            bands[i].add_edge(a, b, **d)
            continue
        value = d.get("label", "").split(" ")[0] or str(a)
        out, into = f"to:{a}:{j}", f"from:{a}:{j}"
        bands[i].add_node(out, label=f"{value}\nto column {j + 1}", kind="boundary", scope="")
        bands[i].add_edge(a, out, **d)
        bands[j].add_node(into, label=f"{value}\nfrom column {i + 1}", kind="boundary", scope="")
        bands[j].add_edge(into, b, label="")
    return bands


def _legend(nodes: list[dict]) -> list[tuple]:
    """(label, fill, outline, dashed) for each kind of box these nodes draw, and the fused outline."""
    kinds = list(dict.fromkeys([d["kind"] for d in nodes] + [k[1] for d in nodes for k in d.get("kernels", ())]))
    out = [("outside this view" if k == "boundary" else k, KIND_COLOURS.get(k, "#ffffff"), "#444444", k == "boundary")
           for k in kinds]
    if any(d.get("fused") or any(k[2] for k in d.get("kernels", ())) for d in nodes):
        out.append((FUSED_NOTE, "#ffffff", FUSED_COLOUR, False))
    return out


def _legend_rows(entries: list[tuple], width: float) -> list[list[tuple]]:
    """The legend's entries packed into rows no wider than ``width`` inches."""
    rows, at = [[]], 0.0
    for e in entries:
        w = KEY_W + 0.05 + len(e[0]) * KEY_CHAR_W + KEY_GAP
        if rows[-1] and at + w > width:
            rows.append([])
            at = 0.0
        rows[-1].append(e)
        at += w
    return rows


def _rows_y(g, rows: list[list], size: dict, header: float) -> tuple[list[float], list[float]]:
    """Top and bottom y of each row, from ``header`` down; the gap under a row fits the value labels
    stacked beneath it."""
    top, bottom, y = [], [], header
    for row in rows:
        h = max((size[n][1] for n in row if n in size), default=LINE_H)
        below = max((sum(_label_size(s)[1] for s, _ in _edge_labels(g, n)) for n in row if n in size), default=0.0)
        top.append(y)
        bottom.append(y + h)
        y += h + GAP_Y + below
    return top, bottom


def _edge_labels(g, n) -> list[tuple[str, tuple]]:
    """The distinct labels of the values leaving ``n``, each with its first edge (weights label their box)."""
    if g.nodes[n]["kind"] == "weight":
        return []
    seen: dict[str, tuple] = {}
    for a, b, d in g.out_edges(n, data=True):
        if d.get("label"):
            seen.setdefault(d["label"], (a, b))
    return list(seen.items())


def _label_size(text: str) -> tuple[float, float]:
    lines = text.split("\n")
    return max(len(s) for s in lines) * EDGE_CHAR_W + 0.06, len(lines) * EDGE_LINE_H


def _labels_width(g, n) -> float:
    return max((_label_size(s)[0] + 0.04 for s, _ in _edge_labels(g, n)), default=0.0)


def _ports(g, x: dict, routes: dict, widths: dict) -> dict:
    """Where each edge leaves its source and enters its target: spread along the box edges, by x order."""
    port = {}
    for n in g:
        for side, edges in (("out", list(g.out_edges(n))), ("in", list(g.in_edges(n)))):
            edges.sort(key=lambda e: x[routes[e][1] if side == "out" else routes[e][-2]])
            step = min(0.7 * widths[n] / max(len(edges) - 1, 1), 0.3)
            for k, e in enumerate(edges):
                port[(e, side)] = x[n] + (k - (len(edges) - 1) / 2) * step
    return port


# ---------------------------------------------------------------------------------------
# drawing
# ---------------------------------------------------------------------------------------

def draw_matplotlib(graph: Graph, path, layer: int | None, fmt: str) -> None:
    """Lay out and draw the graph with matplotlib's object API (no pyplot, no global backend change)."""
    figure(graph, layer).savefig(str(path), format=fmt, dpi=DPI)


def figure(graph: Graph, layer: int | None = None):
    """The matplotlib Figure of ``graph`` (one layer if given), laid out in inches."""
    from matplotlib.figure import Figure
    g = graph_to_networkx(graph, layer=layer)
    lay = layout(g)
    fig = Figure(figsize=(lay.width, lay.height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, lay.width)
    ax.set_ylim(lay.height, 0)                                # inches, y downwards
    ax.axis("off")
    _draw_header(ax, g, lay)
    _draw_edges(ax, lay)
    _draw_nodes(ax, g, lay)
    return fig


def _curve(points: list[tuple[float, float]]):
    """A path through ``points`` (top to bottom) of cubic pieces that leave and arrive vertically."""
    from matplotlib.path import Path as MPath
    verts, codes = [points[0]], [MPath.MOVETO]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        mid = (y0 + y1) / 2
        verts += [(x0, mid), (x1, mid), (x1, y1)]
        codes += [MPath.CURVE4] * 3
    return MPath(verts, codes)


def _draw_header(ax, g, lay: Layout) -> None:
    """The title, what the edges say, and a legend of the colours and outlines this picture uses."""
    from matplotlib.patches import Rectangle
    ax.text(MARGIN, 0.1, f"{g.graph.get('title', '')}  ({EDGE_NOTE})", fontsize=8, va="top", ha="left")
    for k, row in enumerate(lay.legend):
        x, y = MARGIN, 0.38 + k * KEY_H
        for label, fill, outline, dashed in row:
            ax.add_patch(Rectangle((x, y - 0.05), KEY_W, 0.1, facecolor=fill, edgecolor=outline,
                                   lw=1.6 if outline == FUSED_COLOUR else 0.6, linestyle="--" if dashed else "-"))
            ax.text(x + KEY_W + 0.05, y, label, fontsize=6, va="center", ha="left")
            x += KEY_W + 0.05 + len(label) * KEY_CHAR_W + KEY_GAP


def _draw_edges(ax, lay: Layout) -> None:
    """Each edge as a curve through its routing points; each value's label once, under its producer."""
    from matplotlib.patches import FancyArrowPatch
    for pts in lay.paths.values():
        ax.add_patch(FancyArrowPatch(path=_curve(pts), arrowstyle="-|>", mutation_scale=7, color="#777777",
                                     lw=0.7, zorder=1))
    for text, x0, y0, w, _ in lay.labels:
        ax.text(x0 + w / 2, y0, text, fontsize=EDGE_FONT, color="#333333", ha="center", va="top",
                family="monospace", zorder=2,
                bbox=dict(boxstyle="square,pad=0.05", facecolor="white", edgecolor="none", alpha=0.85))


def _draw_nodes(ax, g, lay: Layout) -> None:
    """Boxes filled by op kind; fused kernels outlined (a layer box's own chips too), values from outside
    the view dashed."""
    from matplotlib.patches import FancyBboxPatch
    for n, (x0, y0, w, h) in lay.boxes.items():
        d = lay.nodes[n]
        fused = d.get("fused")
        ax.add_patch(FancyBboxPatch((x0, y0), w, h, boxstyle="round,pad=0,rounding_size=0.05",
                                    facecolor=KIND_COLOURS.get(d["kind"], "#ffffff"),
                                    edgecolor=FUSED_COLOUR if fused else "#444444", lw=1.8 if fused else 0.6,
                                    linestyle="--" if d["kind"] == "boundary" else "-", zorder=3))
        if n in lay.chips:
            ax.text(x0 + PAD_X, y0 + PAD_Y, d["label"], fontsize=FONT, ha="left", va="top",
                    family="monospace", linespacing=1.25, zorder=4)
        else:
            ax.text(x0 + PAD_X, y0 + h / 2, d["label"], fontsize=FONT, ha="left", va="center",
                    family="monospace", linespacing=1.25, zorder=4)
        for name, kind, chip_fused, cx, cy, cw, ch in lay.chips.get(n, ()):
            ax.add_patch(FancyBboxPatch((cx, cy), cw, ch, boxstyle="round,pad=0,rounding_size=0.03",
                                        facecolor=KIND_COLOURS.get(kind, "#ffffff"),
                                        edgecolor=FUSED_COLOUR if chip_fused else "#999999",
                                        lw=1.4 if chip_fused else 0.4, zorder=5))
            ax.text(cx + cw / 2, cy + ch / 2, name, fontsize=CHIP_FONT, ha="center", va="center",
                    family="monospace", zorder=6)
