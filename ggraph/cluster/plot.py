"""``ggraph bench --cluster --plot``: one row of panels per node (prefill, decode), the bars as ``ggraph bench
--plot`` draws them on one machine, each panel titled with the node's CPU, feature set and model."""
from __future__ import annotations


def figure(rows: list[dict]):
    """A matplotlib Figure (object API) with a prefill and a decode panel for each node, in the rows' order
    (for each feature set and model of a node, when the sweep had several: their bars would coincide)."""
    from matplotlib.figure import Figure

    from ggraph.bench.plot import _speed_bars, check
    check(rows)
    panels = list(dict.fromkeys((r["node"], r["target"], r["model"]) for r in rows))
    fig = Figure(figsize=(12, 4.2 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 2, squeeze=False)
    for ax, (node, target, model) in zip(axes, panels):
        mine = [r for r in rows if (r["node"], r["target"], r["model"]) == (node, target, model)]
        where = f"{node}: {mine[0]['cpu']}, {target}, {model}"
        _speed_bars(ax[0], mine, "pp_tok_s", "pp", f"{where}\nprefill (pp tokens in one step)")
        _speed_bars(ax[1], mine, "tg_tok_s", "tg", f"{where}\ndecode (one token per step)")
    nodes = len({p[0] for p in panels})
    fig.suptitle(f"ggraph bench on {nodes} node{'s' * (nodes != 1)} · ratios to the first row of each group "
                 f"within a panel", fontsize=11)
    return fig


def plot_nodes(rows: list[dict], path) -> str:
    """Write the per-node figure to ``path`` (png, svg or pdf by its suffix); returns the path."""
    from ggraph.bench.plot import plot_format
    figure(rows).savefig(str(path), format=plot_format(path), dpi=110)
    return str(path)
