"""ggraph beside llama.cpp's ``llama-bench`` in alternating rounds, medians of the rounds: the part of
moe.py and hybrid.py that times engines.

    res = side_by_side(path, threads=1, pp=512, tg=128, rounds=3, engines={"llama.cpp": "PATH/llama-bench"})
    print(table_head(512, 128)); print(table_rows(res[0], threads=1))

Each round runs every engine in turn at every depth (ggraph in this process: one prefill of ``pp``
tokens and ``tg`` decode steps from it, after ``depth`` tokens held untimed, as ``llama-bench -p PP -n TG
-d DEPTH`` does; each llama-bench a process of one repetition), so that the noise of a shared machine
falls on all alike. ``pp=0`` times decode only. An engine is a binary with, optionally, options of its
own after it in one string ("PATH -rtr 1").
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path


def llama_bench(exe: str, path: Path, pp: int, tg: int, threads: int, depth: int = 0) -> tuple[float, float]:
    """(prefill, decode) tok/s of one llama-bench repetition of ``-p pp -n tg -d depth`` (0.0 for a part
    not asked for)."""
    exe, *extra = exe.split()
    out = subprocess.run([exe, "-m", str(path), "-p", str(pp), "-n", str(tg), "-t", str(threads), "-r", "1",
                          *(["-d", str(depth)] if depth else []), "-o", "json", *extra], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{exe} failed ({out.returncode}) on {path}: {out.stderr.strip()[-800:]}")
    rows = json.loads(out.stdout)
    pp_s = next(r["avg_ts"] for r in rows if r["n_prompt"] == pp and r["n_gen"] == 0) if pp else 0.0
    tg_s = next(r["avg_ts"] for r in rows if r["n_gen"] == tg and r["n_prompt"] == 0) if tg else 0.0
    return pp_s, tg_s


def side_by_side(path: Path, threads: int, pp: int, tg: int, rounds: int, engines: dict[str, str],
                 depths=(0,)) -> dict[int, dict[str, tuple[float, float, list]]]:
    """{depth: {engine: (median prefill tok/s, median decode tok/s, each round's (prefill, decode))}} of ggraph
    and each llama-bench over ``rounds`` alternating rounds. Every round runs every depth: ggraph holds
    each depth's context in a session of its own, so that decode at depth and at 0 see the same load. The
    prefill is timed at the first depth only (0.0 at the others)."""
    from ggraph.bench.measure import GGraphRunner, context_needed, prompt_tokens
    runners = {}
    got: dict[int, dict[str, list]] = {d: {name: [] for name in ["ggraph", *engines]} for d in depths}
    try:
        for d in depths:
            runners[d] = r = GGraphRunner(path, threads, ctx=context_needed(d, max(pp, 1), tg) + 16)
            r.fill(prompt_tokens(d, r.n_vocab, seed=1), d)
        ids = prompt_tokens(max(pp, 1), runners[depths[0]].n_vocab)
        for _ in range(rounds):
            for d, r in runners.items():
                p = pp if d == depths[0] else 0
                prefill = p / r.prefill(ids, d) if p else 0.0
                got[d]["ggraph"].append((prefill, tg / r.decode(ids[0], tg, d) if tg else 0.0))
                for name, exe in engines.items():
                    got[d][name].append(llama_bench(exe, path, p, tg, threads, d))
    finally:
        for r in runners.values():
            r.close()
    return {d: {name: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows), rows)
                for name, rows in res.items()} for d, res in got.items()}


def table_head(pp: int, tg: int, depth: bool = False) -> str:
    """The header of print_table's rows (with a depth column when ``depth``)."""
    d = ("| depth ", "|---") if depth else ("", "")
    return (f"| threads {d[0]}| engine | prefill {pp} tok/s | decode {tg} tok/s | ggraph's ratio (pp / tg) |\n"
            f"|---{d[1]}|---|---|---|---|")


def table_rows(res: dict, threads: int, depth: int | None = None) -> str:
    """One markdown row per engine: medians, ggraph's ratio to it, and every round's prefill/decode."""
    lines = []
    gpp, gtg, _ = res["ggraph"]
    for name, (pps, tgs, rows) in res.items():
        ratio = "" if name == "ggraph" else f"{_ratio(gpp, pps)} / {_ratio(gtg, tgs)}"
        runs = "; ".join(f"{a:.1f}/{b:.1f}" for a, b in rows)
        at = "" if depth is None else f"{depth} | "
        lines.append(f"| {threads} | {at}{name} | {pps:.1f} | {tgs:.1f} | {ratio} |  rounds: {runs}")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def load() -> str:
    """The host's load averages (1, 5, 15 minutes), to print beside figures taken on a shared machine."""
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
