"""``ggraph bench --cluster --plot``: one row of panels per node (prefill, decode), the bars as ``ggraph bench
--plot`` draws them on one machine, each panel titled with the node's CPU and feature set."""
from __future__ import annotations


def figure(rows: list[dict]):
    """A matplotlib Figure (object API) with a prefill and a decode panel for each node, in the rows' order."""
    from matplotlib.figure import Figure

    from ggraph.bench.plot import _speed_bars, check
    check(rows)
    nodes = list(dict.fromkeys(r["node"] for r in rows))
    fig = Figure(figsize=(12, 4.2 * len(nodes)), layout="constrained")
    axes = fig.subplots(len(nodes), 2, squeeze=False)
    for ax, node in zip(axes, nodes):
        mine = [r for r in rows if r["node"] == node]
        where = f"{node}: {mine[0]['cpu']}, {', '.join(dict.fromkeys(r['target'] for r in mine))}"
        _speed_bars(ax[0], mine, "pp_tok_s", "pp", f"{where}\nprefill (pp tokens in one step)")
        _speed_bars(ax[1], mine, "tg_tok_s", "tg", f"{where}\ndecode (one token per step)")
    fig.suptitle(f"ggraph bench on {len(nodes)} node{'s' * (len(nodes) != 1)} · ratios to the first row of each "
                 f"group within a node", fontsize=11)
    return fig


def plot_nodes(rows: list[dict], path) -> str:
    """Write the per-node figure to ``path`` (png, svg or pdf by its suffix); returns the path."""
    from ggraph.bench.plot import plot_format
    figure(rows).savefig(str(path), format=plot_format(path), dpi=110)
    return str(path)
