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

RESULT_FIELDS = ("engine", "pp", "tg", "threads", "pp_tok_s", "tg_tok_s")
ROW_FIELDS = ("seconds", "bytes", "flops")
PHASES = ("prefill", "decode")
COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d")
PHASE_MARKERS = {"prefill": "o", "decode": "^"}
TOP_OPS = 12                                   # op kinds shown in the "near the roof" panel
LABELLED = 4                                   # op kinds named on the roofline, per profile and phase
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
    """engine and pipeline or flash attention: ``ggraph default``, ``ggraph none``, ``llama.cpp -fa 1``."""
    if r.get("passes"):
        return f"{r['engine']} {r['passes']}"
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


def _roofline(ax, profiled) -> None:
    """Achieved GFLOP/s against arithmetic intensity, under the bandwidth slope and the compute roof."""
    import numpy as np
    roofs = [roof for _, roof, _ in profiled if roof]
    points = [(name, row) for name, _, rows in profiled for row in rows
              if row["flops"] > 0 and row["bytes"] > 0 and row["seconds"] > 0]
    ai = [row["flops"] / row["bytes"] for _, row in points] or [1.0]
    xs = np.geomspace(min(ai) / 4, max(ai) * 4, 64)
    for roof in roofs[:1]:
        bw, peak = roof["bandwidth_gb_s"], roof["peak_gflop_s"]
        ax.plot(xs, np.minimum(peak, bw * xs), color="#333333", lw=1.2,
                label=f"roof: {bw:.1f} GB/s, {peak:.0f} GFLOP/s f32")
        if roof.get("peak_int8_gop_s"):
            ax.plot(xs, np.minimum(roof["peak_int8_gop_s"], bw * xs), color="#333333", lw=0.8, ls="--",
                    label=f"int8 roof: {roof['peak_int8_gop_s']:.0f} Gop/s")
    names = list(dict.fromkeys(name for name, _, _ in profiled))
    ranked: dict[tuple, int] = {}
    for name, row in points:                      # rows come slowest first: name the slowest few per phase
        rank = ranked[(name, row["phase"])] = ranked.get((name, row["phase"]), -1) + 1
        colour = COLOURS[names.index(name) % len(COLOURS)]
        x, y = row["flops"] / row["bytes"], row["flops"] / row["seconds"] / 1e9
        ax.scatter(x, y, color=colour, marker=PHASE_MARKERS.get(row["phase"], "s"), s=22 if rank < LABELLED else 8,
                   alpha=1.0 if rank < LABELLED else 0.5, zorder=3)
        if rank < LABELLED:
            ax.annotate(f"{row['phase'] + ' ' if row['phase'] else ''}{row['op']}", (x, y), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
    for k, name in enumerate(names):
        ax.scatter([], [], color=COLOURS[k % len(COLOURS)], label=name)
    for phase in dict.fromkeys(row["phase"] for _, row in points):
        ax.scatter([], [], color="#777777", marker=PHASE_MARKERS.get(phase, "s"), label=phase or "(no phase)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (flop / byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title("roofline per op kind (the slowest named)" + ("" if roofs else " - no roofline measured"),
                 fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", lw=0.3, alpha=0.5)


def _near_roof(ax, profiled) -> None:
    """Per op kind: % of its roofline bound (bars) and share of the time (text), slowest op kinds first."""
    rows = []
    for name, roof, kinds in profiled:
        phase_s: dict[str, float] = {}
        for r in kinds:
            phase_s[r["phase"]] = phase_s.get(r["phase"], 0.0) + r["seconds"]
        for r in kinds:
            rows.append((r["seconds"], f"{name + ': ' if len(profiled) > 1 else ''}{r['phase']} {r['op']}".strip(),
                         roof_fraction(r, roof), r["seconds"] / (phase_s[r["phase"]] or 1),
                         r["bytes"] / r["seconds"] / 1e9 if r["seconds"] else 0.0))
    rows = sorted(rows, reverse=True)[:TOP_OPS][::-1]
    ys = range(len(rows))
    ax.barh(ys, [100 * f if f == f else 0 for _, _, f, _, _ in rows], color="#4c78a8")
    for y, (_, _, frac, share, gbs) in zip(ys, rows):
        near = f"{100 * frac:.0f}% of roof, " if frac == frac else ""
        ax.text(1, y, f"{near}{gbs:.1f} GB/s, {100 * share:.0f}% of its phase's time", va="center", fontsize=6.5)
    ax.set_yticks(list(ys), [label for _, label, _, _, _ in rows], fontsize=7)
    ax.set_xlim(0, max([110.0] + [105 * f for _, _, f, _, _ in rows if f == f]))
    ax.axvline(100, color="#333333", lw=0.8)
    ax.set_xlabel("% of the roofline bound at the op's intensity")
    ax.set_title("how near its roof each op kind runs (slowest first)", fontsize=10)


# ---------------------------------------------------------------------------------------
# the figure
# ---------------------------------------------------------------------------------------

def figure(results: list[dict], title: str | None = None):
    """A matplotlib Figure (object API: no pyplot state) with the speed bars and, given profiles, the roofline."""
    from matplotlib.figure import Figure
    check(results)
    profiled = _profiled(results)
    rows = 2 if profiled else 1
    fig = Figure(figsize=(12, 4.6 * rows), layout="constrained")
    axes = fig.subplots(rows, 2, squeeze=False)
    _speed_bars(axes[0][0], results, "pp_tok_s", "pp", "prefill (pp tokens in one step)")
    _speed_bars(axes[0][1], results, "tg_tok_s", "tg", "decode (one token per step)")
    if profiled:
        _roofline(axes[1][0], profiled)
        _near_roof(axes[1][1], profiled)
    model = Path(str(results[0].get("model", ""))).name
    fig.suptitle(title or f"ggraph bench{' · ' + model if model else ''} · ratios to the first row of each group",
                 fontsize=11)
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
    figure(results, title).savefig(str(path), format=plot_format(path), dpi=110)
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
