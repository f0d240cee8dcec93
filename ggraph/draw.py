"""Pictures of a graph: graphviz ``dot`` when it is installed, else networkx + matplotlib.

    draw(graph, "layer3.png", layer=3)

Both start from the same networkx model as the DOT text (``printing.graph_to_networkx``):
nodes coloured by op kind, fused and composite nodes outlined, edges labelled by shape.
"""
from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

from ggraph.core import Graph

FORMATS = ("png", "svg")


def draw(graph: Graph, path, layer: int | None = None, fmt: str | None = None) -> str:
    """Write a PNG or SVG of ``graph`` (one layer if given) to ``path``; returns the renderer used."""
    fmt = (fmt or Path(path).suffix.lstrip(".")).lower()
    if fmt not in FORMATS:
        raise ValueError(f"draw: format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    dot = shutil.which("dot")
    if dot:
        done = subprocess.run([dot, f"-T{fmt}", "-o", str(path)], input=graph.to_dot(layer=layer).encode(),
                              capture_output=True)
        if done.returncode:
            raise ValueError(f"graphviz dot failed ({done.returncode}): {done.stderr.decode().strip()}")
        return "graphviz"
    draw_matplotlib(graph, path, layer, fmt)
    return "matplotlib"


def layered_positions(g) -> dict:
    """x, y per node: rows by longest path from the inputs, each input just above its first reader."""
    import networkx as nx
    depth: dict = {}
    for n in nx.topological_sort(g):
        preds = [depth[p] for p in g.predecessors(n)]
        depth[n] = 1 + max(preds) if preds else 0
    for n in g:
        if g.in_degree(n) == 0 and g.out_degree(n):
            depth[n] = min(depth[c] for c in g.successors(n)) - 1
    order = {n: k for k, n in enumerate(g.nodes)}
    rows: dict[int, list] = {}
    for n in sorted(g, key=order.get):
        rows.setdefault(depth[n], []).append(n)
    return {n: (k - (len(row) - 1) / 2, -d) for d, row in rows.items() for k, n in enumerate(row)}


def draw_matplotlib(graph: Graph, path, layer: int | None, fmt: str) -> None:
    """Draw the layered graph with matplotlib's object API (no pyplot, no global backend change)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch
    from ggraph.printing import KIND_COLOURS
    g = graph.to_networkx(layer=layer)
    g.remove_nodes_from([n for n in list(g) if g.degree(n) == 0])      # inputs this view never reads
    pos = layered_positions(g)
    width = max((sum(1 for p in pos.values() if p[1] == y) for y in {p[1] for p in pos.values()}), default=1)
    depth = 1 - min((p[1] for p in pos.values()), default=0)          # rows
    xscale, yscale = 2.6, 1.0                            # inches per column and per row
    fig = Figure(figsize=(max(4.0, width * xscale), max(3.0, depth * yscale)))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-width / 2 - 0.2, width / 2 + 0.2)
    ax.set_ylim(-depth + 0.4, 0.6)
    ax.axis("off")
    small = g.number_of_nodes() <= 120
    for a, b, d in g.edges(data=True):
        (x0, y0), (x1, y1) = pos[a], pos[b]
        ax.annotate("", xy=(x1, y1 + 0.22), xytext=(x0, y0 - 0.22),
                    arrowprops=dict(arrowstyle="->", color="#777777", lw=0.7, shrinkA=0, shrinkB=0), zorder=1)
        if small and d.get("label"):
            ax.text((x0 + x1) / 2, (y0 + y1) / 2, d["label"], fontsize=5, color="#555555", ha="center", va="center",
                    zorder=2)
    for n, d in g.nodes(data=True):
        x, y = pos[n]
        outlined = d.get("fused")
        ax.add_patch(FancyBboxPatch((x - 0.45, y - 0.2), 0.9, 0.4, boxstyle="round,pad=0.02",
                                    facecolor=KIND_COLOURS.get(d.get("kind"), "#ffffff"),
                                    edgecolor="#c9184a" if outlined else "#444444", lw=2.0 if outlined else 0.6,
                                    zorder=3))
        label = "\n".join(textwrap.wrap(d.get("label", str(n)), 34)[:3])
        ax.text(x, y, label, fontsize=6, ha="center", va="center", family="monospace", zorder=4)
    fig.savefig(str(path), format=fmt, dpi=110)
