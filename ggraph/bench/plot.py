"""Pictures of benchmark results: tok/s bars with ratios, and a roofline when the results carry a profile.

    plot_results(results, "bench.png")     # results: the dicts `ggraph bench --json` prints

A result may carry ``profile`` and ``roofline`` (``ggraph bench --profile`` adds both). The
profile is ``bench.profile_ggraph``'s {"prefill": {"op": rows}, "decode": {"op": rows}} or a
plain list of rows; a row has "op" (or "name"), "seconds", "bytes", "flops", and may have
"phase" and "roofline" (the time the limit allows over the time taken). The roofline is
{"bandwidth_gb_s", "peak_gflop_s"[, "peak_int8_gop_s"]}. With a profile, two more panels show
each op kind's achieved GFLOP/s under the roofs, and how near its roof each op kind runs.
"""
from __future__ import annotations

from pathlib import Path

from ggraph.bench.measure import IDLE, ROOF_NOISE

RESULT_FIELDS = ("engine", "pp", "tg", "threads", "pp_tok_s", "tg_tok_s")
ROW_FIELDS = ("seconds", "bytes", "flops")
PHASES = ("prefill", "decode")
COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d")
PHASE_MARKERS = {"prefill": "o", "decode": "^"}
TOP_OPS = 12                                   # op kinds listed per profile and phase in the "near its roof" table
DPI = 110
PLOT_FORMATS = ("png", "svg", "pdf")


def profile_rows(profile, where: str = "profile") -> list[dict]:
    """The rows of a profile in either form, as {"phase", "op", "seconds", "bytes", "flops"[, "bound_s"]}."""
    if isinstance(profile, dict):
        if not set(PHASES) & set(profile):                     # other keys (its roofline) are not rows
            raise ValueError(f"{where}: expected prefill/decode sections, got keys {sorted(profile)}")
        listed = [(f"{where}.{phase} row {j}", dict(row, phase=phase)) for phase in PHASES if phase in profile
                  for j, row in enumerate(_op_section(profile[phase], f"{where}.{phase}"))]
    elif isinstance(profile, (list, tuple)):
        listed = [(f"{where} row {j}", row) for j, row in enumerate(profile)]
    else:
        raise ValueError(f"{where}: expected a list of rows or prefill/decode sections, got {type(profile).__name__}")
    rows = []
    for at, row in listed:
        op = row.get("op", row.get("name"))
        gone = [f for f in ROW_FIELDS if f not in row] + ([] if op is not None else ["op"])
        if gone:
            raise ValueError(f"{at} has no {', '.join(gone)}")
        out = {"phase": row.get("phase", ""), "op": str(op), **{f: float(row[f]) for f in ROW_FIELDS}}
        if "roofline" in row:
            out["bound_s"] = float(row["roofline"]) * out["seconds"]
        rows.append(out)
    return rows


def _op_section(section, where: str) -> list:
    if not isinstance(section, dict) or "op" not in section:
        raise ValueError(f"{where}: expected {{'op': rows, ...}}")
    return section["op"]


def check(results: list[dict]) -> None:
    """Raise a ValueError naming the result and field that a plot cannot be drawn without."""
    if not results:
        raise ValueError("bench plot: no results to draw")
    for k, r in enumerate(results):
        missing = [f for f in RESULT_FIELDS if f not in r]
        if missing:
            raise ValueError(f"bench plot: result {k} has no {', '.join(missing)}")
        if r.get("profile"):
            profile_rows(r["profile"], f"bench plot: result {k} profile")
        roof = r.get("roofline")
        if roof is not None and not {"bandwidth_gb_s", "peak_gflop_s"} <= set(roof):
            raise ValueError(f"bench plot: result {k} roofline needs bandwidth_gb_s and peak_gflop_s, "
                             f"got {sorted(roof)}")


def run_name(r: dict) -> str:
    """engine and pipeline or flash attention: ``ggraph fused``, ``ggraph unfused`` (the pipelines
    ``--compare fused,unfused`` names), ``ggraph rms_norm,dce``, ``llama.cpp -fa 1``."""
    if r.get("passes"):
        from ggraph.cli.bench import NAMED_PASSES
        called = {passes: name for name, passes in NAMED_PASSES.items()}
        return f"{r['engine']} {called.get(r['passes'], r['passes'])}"
    fa = {"on": " -fa 1", "off": " -fa 0"}.get(r.get("flash_attn", ""), "")
    return r["engine"] + fa


def configuration(r: dict) -> tuple:
    """What a ratio compares within: (pp, tg, threads, depth, K and V cache types)."""
    return r["pp"], r["tg"], r["threads"], r.get("depth", 0), r.get("cache_k", ""), r.get("cache_v", "")


def ratios(results: list[dict], field: str) -> list[float]:
    """Each result's ``field`` over the first result of the same configuration, as ``ggraph bench`` prints."""
    first: dict[tuple, float] = {}
    out = []
    for r in results:
        base = first.setdefault(configuration(r), r[field])
        out.append(r[field] / base if base else float("nan"))
    return out


def op_kinds(rows: list[dict]) -> list[dict]:
    """Profile rows summed per (phase, op): seconds, bytes, flops (and bound time); slowest first."""
    kinds: dict[tuple, dict] = {}
    for e in rows:
        key = (e["phase"], e["op"])
        row = kinds.setdefault(key, {"phase": key[0], "op": key[1], "seconds": 0.0, "bytes": 0.0, "flops": 0.0})
        for f in ("seconds", "bytes", "flops", "bound_s"):
            if f in e:
                row[f] = row.get(f, 0.0) + e[f]
    return sorted(kinds.values(), key=lambda r: -r["seconds"])


def roof_fraction(row: dict, roof: dict) -> float:
    """The time the roofline allows over the time taken (1 = at the limit); the profile's own bound if it has one."""
    if row["seconds"] <= 0:
        return float("nan")
    if "bound_s" in row:
        return row["bound_s"] / row["seconds"]
    if not roof:
        return float("nan")
    bound = max(row["bytes"] / (roof["bandwidth_gb_s"] * 1e9), row["flops"] / (roof["peak_gflop_s"] * 1e9))
    return bound / row["seconds"]


# ---------------------------------------------------------------------------------------
# panels
# ---------------------------------------------------------------------------------------

def _speed_bars(ax, results: list[dict], field: str, size_field: str, title: str) -> None:
    """Grouped bars: one group per (threads, size), one bar per engine/pipeline, labelled with the ratio."""
    names = list(dict.fromkeys(run_name(r) for r in results))
    groups = list(dict.fromkeys((r["threads"], r[size_field], r.get("depth", 0)) for r in results))
    width = 0.8 / len(names)
    for r, ratio in zip(results, ratios(results, field)):
        k, g = names.index(run_name(r)), groups.index((r["threads"], r[size_field], r.get("depth", 0)))
        x = g + (k - (len(names) - 1) / 2) * width
        ax.bar(x, r[field], width * 0.92, color=COLOURS[k % len(COLOURS)], label=run_name(r) if g == 0 else None)
        ax.text(x, r[field], f"{r[field]:.1f}\n{ratio:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), [f"{t} thread{'s' * (t != 1)}\n{size_field}={n}" + (f" @ depth {d}" if d else "")
                                       for t, n, d in groups])
    ax.set_ylabel("tokens / s")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.25)
    ax.legend(fontsize=7, loc="upper left")


def _profiled(results: list[dict]) -> list[tuple[str, dict, list[dict]]]:
    """(name, roofline or {}, op kinds) of each result that carries a profile."""
    return [(f"{run_name(r)} {r['threads']}t pp={r['pp']}", r.get("roofline") or {},
             op_kinds(profile_rows(r["profile"]))) for r in results if r.get("profile")]


def table_rows(profiled) -> list[dict]:
    """The rows of the "near its roof" panel, in its order: one block per profile and phase, each block's
    op kinds by their share of that phase's time, most first (at most TOP_OPS; the rest summed in one
    row). Each row has its number ("n", as the roofline's points are numbered; None for a row with no
    flops, which the log axes cannot show), "block", "label",
    "fraction" of its roof, "share" of its phase's time, "gb_s", and the row it came from."""
    rows, n = [], 0
    for name, roof, kinds in profiled:
        for phase in dict.fromkeys(r["phase"] for r in kinds):
            mine = sorted((r for r in kinds if r["phase"] == phase), key=lambda r: -r["seconds"])
            total = sum(r["seconds"] for r in mine) or 1.0
            block = f"{name + ': ' if len(profiled) > 1 else ''}{phase or '(no phase)'}"
            for r in mine[:TOP_OPS]:
                drawn = r["flops"] > 0 and r["bytes"] > 0 and r["seconds"] > 0      # a point on the roofline
                n += drawn
                rows.append({"n": n if drawn else None, "block": block, "label": r["op"], "fraction": roof_fraction(r, roof),
                             "share": r["seconds"] / total, "gb_s": r["bytes"] / r["seconds"] / 1e9 if r["seconds"] else 0.0,
                             "row": r, "profile": name})
            rest = mine[TOP_OPS:]
            if rest:
                rows.append({"n": None, "block": block, "label": f"{len(rest)} more op kinds", "fraction": float("nan"),
                             "share": sum(r["seconds"] for r in rest) / total, "gb_s": 0.0, "row": None, "profile": name})
    return rows


def _roofline(ax, profiled, table: list[dict]) -> list[tuple[float, float, str]]:
    """Achieved GFLOP/s against arithmetic intensity, under the memory slopes and the compute roofs.
    Returns the points drawn as (x, y, number): ``place_labels`` numbers them once the layout is final."""
    import numpy as np
    roofs = [roof for _, roof, _ in profiled if roof]
    points = [(t["profile"], t["row"], t["n"]) for t in table if t["n"] is not None]
    ai = [row["flops"] / row["bytes"] for _, row, _ in points] or [1.0]
    lo, hi = min(ai) / 4, max(ai) * 4
    widen = max(1.0, 1e3 / (hi / lo)) ** 0.5                  # three decades at least: major ticks labelled only
    xs = np.geomspace(lo / widen, hi * widen, 64)
    for roof in roofs[:1]:
        bw, peak = roof["bandwidth_gb_s"], roof["peak_gflop_s"]
        ax.plot(xs, np.minimum(peak, bw * xs), color="#333333", lw=1.2,
                label=f"roof: {bw:.1f} GB/s (DRAM), {peak:.0f} GFLOP/s f32")
        if roof.get("peak_int8_gop_s"):
            ax.plot(xs, np.minimum(roof["peak_int8_gop_s"], bw * xs), color="#333333", lw=0.8, ls="--",
                    label=f"int8 roof: {roof['peak_int8_gop_s']:.0f} Gop/s")
        top = max(peak, roof.get("peak_int8_gop_s") or 0.0)
        for level in roof.get("reads", [])[:-1]:
            ax.plot(xs, np.minimum(top, level["gb_s"] * xs), color="#999999", lw=0.6, ls=":")
        if roof.get("reads"):
            ax.plot([], [], color="#999999", lw=0.6, ls=":", label="cache slopes: " + ", ".join(
                f"{lv['level']} {lv['gb_s']:.0f}" for lv in roof["reads"][:-1]) + " GB/s")
    names = list(dict.fromkeys(name for name, _, _ in profiled))
    drawn = []
    for name, row, n in points:
        colour = COLOURS[names.index(name) % len(COLOURS)]
        x, y = row["flops"] / row["bytes"], row["flops"] / row["seconds"] / 1e9
        ax.scatter(x, y, color=colour, marker=PHASE_MARKERS.get(row["phase"], "s"), s=22, zorder=3)
        drawn.append((x, y, str(n)))
    for k, name in enumerate(names):
        ax.scatter([], [], color=COLOURS[k % len(COLOURS)], label=name)
    for phase in dict.fromkeys(row["phase"] for _, row, _ in points):
        ax.scatter([], [], color="#777777", marker=PHASE_MARKERS.get(phase, "s"), label=phase or "(no phase)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (flop / byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title("roofline per op kind (numbers: the table on the right)" + ("" if roofs else " - no roofline measured"),
                 fontsize=10)
    ax.legend(fontsize=6.5, loc="lower right")
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    return drawn


# offsets (points) tried around a point for its number: nearest ring first, then farther ones with a leader line
RINGS = (7, 12, 18, 26, 36, 50)
ANGLES = (45, 135, 315, 225, 0, 180, 90, 270, 22, 158, 338, 202, 68, 112, 292, 248)


def place_labels(fig, ax, points: list[tuple[float, float, str]], fontsize: float = 6.5) -> list:
    """Number each point of ``ax`` where its text overlaps no other number, marker or the legend, and
    stays inside the axes: the first free spot on rings of growing radius around it (a thin leader
    line from the second ring on). Run once the figure's layout is final. Returns the annotations."""
    import math

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text
    if not hasattr(fig.canvas, "get_renderer"):
        FigureCanvasAgg(fig)
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    px = fig.dpi / 72
    marks = [ax.transData.transform((x, y)) for x, y, _ in points]
    taken = [(mx - 4 * px, my - 4 * px, mx + 4 * px, my + 4 * px) for mx, my in marks]
    if ax.get_legend() is not None:
        b = ax.get_legend().get_window_extent(renderer)
        taken.append((b.x0, b.y0, b.x1, b.y1))

    def free(b) -> bool:
        inside = frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1
        return inside and not any(b.x0 < x1 and x0 < b.x1 and b.y0 < y1 and y0 < b.y1 for x0, y0, x1, y1 in taken)

    def label(x, y, text, dx, dy, leader):
        t = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                        ha="center", va="center", zorder=4, annotation_clip=False,
                        arrowprops=dict(arrowstyle="-", lw=0.4, color="#666666", shrinkA=0, shrinkB=2)
                        if leader else None)
        t.update_positions(renderer)
        return t

    placed = []
    for (x, y, text) in points:
        spot = None
        for ring in RINGS:
            for angle in ANGLES:
                dx, dy = ring * math.cos(math.radians(angle)), ring * math.sin(math.radians(angle))
                t = label(x, y, text, dx, dy, False)
                if free(Text.get_window_extent(t, renderer)):         # the text alone, not its leader line
                    spot = (dx, dy, ring > RINGS[0])
                t.remove()
                if spot:
                    break
            if spot:
                break
        t = label(x, y, text, *spot) if spot else label(x, y, text, RINGS[0], 0, False)   # nowhere free: overlapping
        t.set_in_layout(False)
        b = Text.get_window_extent(t, renderer)
        taken.append((b.x0, b.y0, b.x1, b.y1))
        placed.append(t)
    return placed


def _near_roof(ax, table: list[dict]) -> None:
    """The table beside the roofline: per profile and phase, op kinds by share of the phase's time (most
    first), each numbered as its point, its bar the % of its roofline limit."""
    ys, labels, y, block = [], [], 0, None
    for t in table:
        if t["block"] != block:
            block = t["block"]
            ax.text(-0.01, y, block, transform=ax.get_yaxis_transform(), ha="right", va="center", fontsize=7.5,
                    fontweight="bold")
            y += 1
        frac, row = t["fraction"], t["row"]
        ax.barh(y, 100 * frac if frac == frac else 0, color="#4c78a8", height=0.8)
        if row is None:
            text = f"{100 * t['share']:.0f}% of the phase's time"
        elif row["op"] == IDLE:
            text = f"no roof: threads waiting for each other, {100 * t['share']:.0f}% of the {row['phase']}'s time"
        else:
            text = (f"{100 * frac:.0f}% of roof, {t['gb_s']:.1f} GB/s, " if frac == frac else "") + \
                f"{100 * t['share']:.0f}% of the {row['phase']}'s time" + ("" if t["n"] else ", no flops: no point")
        ax.text(1, y, text, va="center", fontsize=6.5)
        ys.append(y)
        labels.append(f"{t['label']}  [{t['n']}]" if t["n"] else t["label"])
        y += 1
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_ylim(y - 0.4, -0.6)                                     # the first block on top
    ax.set_xlim(0, max([110.0] + [105 * t["fraction"] for t in table if t["fraction"] == t["fraction"]]))
    ax.axvline(100, color="#333333", lw=0.8)
    ax.set_xlabel(f"% of the op's roofline limit (over 100%: timing noise, up to {ROOF_NOISE:.0%})")
    ax.set_title("each phase's op kinds, most time first", fontsize=10)


# ---------------------------------------------------------------------------------------
# the figure
# ---------------------------------------------------------------------------------------

def figure(results: list[dict], title: str | None = None):
    """A matplotlib Figure (object API: no pyplot state) with the speed bars and, given profiles, the roofline."""
    from matplotlib.figure import Figure
    check(results)
    profiled = _profiled(results)
    table = table_rows(profiled)
    blocks = len({t["block"] for t in table})
    low = max(4.6, 0.19 * (len(table) + blocks) + 1.2)           # the table's rows stay readable
    fig = Figure(figsize=(12, 4.6 + (low if profiled else 0)), layout="constrained", dpi=DPI)
    axes = fig.subplots(2 if profiled else 1, 2, squeeze=False, height_ratios=[4.6, low] if profiled else None)
    _speed_bars(axes[0][0], results, "pp_tok_s", "pp", "prefill (pp tokens in one step)")
    _speed_bars(axes[0][1], results, "tg_tok_s", "tg", "decode (one token per step)")
    points = []
    if profiled:
        points = _roofline(axes[1][0], profiled, table)
        _near_roof(axes[1][1], table)
    model = Path(str(results[0].get("model", ""))).name
    fig.suptitle(title or f"ggraph bench{' · ' + model if model else ''} · ratios to the first row of each group",
                 fontsize=11)
    if points:
        place_labels(fig, axes[1][0], points)
    return fig


def plot_format(path) -> str:
    """The picture format of ``path`` from its suffix; a ValueError for any other suffix."""
    fmt = Path(path).suffix.lstrip(".").lower()
    if fmt not in PLOT_FORMATS:
        raise ValueError(f"bench plot: write a {', '.join('.' + f for f in PLOT_FORMATS)} file, got {str(path)!r}")
    return fmt


def plot_path(text: str) -> str:
    """argparse type for ``--plot``: checks the suffix and the directory before the benchmark runs, not after."""
    import argparse
    from pathlib import Path
    try:
        plot_format(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    parent = Path(text).expanduser().parent
    if parent.exists() and not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {str(parent)!r} is not a directory")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: directory {str(parent)!r} does not exist")
    return text


def plot_results(results: list[dict], path, title: str | None = None) -> str:
    """Write the figure to ``path`` (png, svg or pdf by its suffix); returns the path."""
    figure(results, title).savefig(str(path), format=plot_format(path), dpi=DPI)
    return str(path)


# ---------------------------------------------------------------------------------------
# memory against context length
# ---------------------------------------------------------------------------------------

PLANNED_PARTS = (("weights", "planned weights", "#9ecae9"), ("kv_cache", "planned KV cache", "#4c78a8"),
                 ("activations", "planned activations", "#f2cf5b"))
LLAMA_MARKERS = {True: ("^", "llama.cpp peak RSS, -fa 1"), False: ("s", "llama.cpp peak RSS, -fa 0")}


def _ctx_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _memory_panel(ax, rows: list[dict], k: str, v: str, scale: float, unit: str) -> None:
    """One cache type: the plan stacked by part, its total, and the measured peaks as markers."""
    import numpy as np
    mine = sorted((r for r in rows if r["engine"] == "ggraph" and (r["cache_k"], r["cache_v"]) == (k, v)),
                  key=lambda r: r["ctx"])
    xs = np.array([r["ctx"] for r in mine], dtype=float)
    parts = [np.array([r["planned"][key] for r in mine], dtype=float) / scale for key, _, _ in PLANNED_PARTS]
    bottom = np.zeros(len(mine))
    for values, (_, label, colour) in zip(parts, PLANNED_PARTS):
        if len(mine) > 1:
            ax.fill_between(xs, bottom, bottom + values, color=colour, alpha=0.85, lw=0, label=label)
        else:
            ax.bar(xs, values, bottom=bottom, width=xs * 0.5, color=colour, alpha=0.85, label=label)
        bottom = bottom + values
    ax.plot(xs, bottom, color="#333333", lw=1.2, ls="--", label="planned total (peak above it: Python, libraries,\ntokenizer)")
    ax.plot(xs, [r["end"]["hwm"] / scale for r in mine], "o-", color="#e45756", ms=7, lw=1.2,
            label="ggraph peak RSS")
    ax.plot(xs, [r["load"]["rss"] / scale for r in mine], "o", color="#e45756", ms=5, mfc="white",
            label="ggraph RSS after loading")
    for fa, (marker, label) in LLAMA_MARKERS.items():
        theirs = sorted((r for r in rows if r["engine"] == "llama.cpp" and r["flash_attn"] == fa
                         and (r["cache_k"], r["cache_v"]) == (k, v)), key=lambda r: r["ctx"])
        if theirs:
            ax.plot([r["ctx"] for r in theirs], [r["end"]["hwm"] / scale for r in theirs], marker, ls=":",
                    color="#54a24b" if fa else "#72b7b2", ms=7, lw=1, label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted({r["ctx"] for r in rows})
    ax.set_xticks(ticks, [_ctx_label(t) for t in ticks])
    ax.minorticks_off()
    if len(ticks) == 1:
        ax.set_xlim(ticks[0] / 2, ticks[0] * 2)
    ax.set_xlabel("context length (tokens, log scale)")
    ax.set_ylabel(f"resident memory ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_title(f"KV cache K={k}, V={v}", fontsize=10)
    ax.grid(True, axis="y", lw=0.3, alpha=0.6)


def memory_figure(rows: list[dict], model: str = "", threads: int | None = None):
    """A matplotlib Figure of memory against context length, one panel per cache type."""
    from matplotlib.figure import Figure
    mine = [r for r in rows if r["engine"] == "ggraph"]
    if not mine:
        raise ValueError("memory plot: no ggraph points to draw")
    types = list(dict.fromkeys((r["cache_k"], r["cache_v"]) for r in mine))
    top = max([r["end"]["hwm"] for r in rows] + [r["planned"]["total"] for r in mine])
    scale, unit = (1 << 30, "GiB") if top >= 1.5 * (1 << 30) else (1 << 20, "MiB")
    fig = Figure(figsize=(4.2 * len(types) + 2.6, 4.4), layout="constrained")
    axes = fig.subplots(1, len(types), squeeze=False, sharey=True)[0]
    for ax, (k, v) in zip(axes, types):
        _memory_panel(ax, rows, k, v, scale, unit)
    for ax in axes[1:]:
        ax.set_ylabel("")                                   # the panels share the first one's axis
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="outside right center", fontsize=8, frameon=False)
    left = {r["ctx"] - r["fill"] for r in mine}
    filled = f"each context filled to ctx - {left.pop()}, then decoded" if len(left) == 1 else \
        f"prompts of {', '.join(sorted({str(r['fill']) for r in mine}, key=int))} tokens, then decoded"
    who = f" · {threads} thread{'s' * (threads != 1)}" if threads else ""
    fig.suptitle(f"memory against context · {Path(str(model)).name}{who} · {filled}", fontsize=11)
    return fig


def plot_memory(rows: list[dict], path, model: str = "", threads: int | None = None) -> str:
    """Write the memory figure to ``path`` (png, svg or pdf by its suffix); returns the path."""
    memory_figure(rows, model, threads).savefig(str(path), format=plot_format(path), dpi=110)
    return str(path)
