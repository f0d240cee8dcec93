"""Memory against context length: ggraph's plan beside the resident memory it really takes, and llama.cpp's.

    points = memory_points(ctxs=[512, 4096], cache_types=[("f16", "f16"), ("q8_0", "q8_0")], llama_cpp=True)
    print(memory_table(memory_curve("model.gguf", points, threads=2)))

Each point runs in a fresh Python process, so that its resident memory (RSS) is its own: the
process loads the model (and compiles or loads its program), notes its RSS, prefills ``fill``
tokens in ubatches, decodes a few steps after them, and reports its peak RSS (VmHWM). The
plan is ``Session.memory()``: the weights (the file's tensors, mapped), the KV cache (the
arrays allocated for the whole context), recurrent states with their snapshots (models with
recurrent layers) and the activation arena of one ubatch at a full context. ggraph's cache
pages become resident as rows are written, so a partial fill shows only the rows filled;
llama.cpp zeroes its KV buffer when it makes the context, so all of its cache is resident from
the start.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

DECODE_STEPS = 4                     # decode steps after the fill (the fill leaves room for them)
MIB = 1 << 20


def resident() -> dict[str, int]:
    """This process's resident bytes now (rss, and its anonymous and file-backed parts) and at its peak (hwm)."""
    fields = {"VmRSS": "rss", "VmHWM": "hwm", "RssAnon": "anon", "RssFile": "file"}
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in fields:
                    out[fields[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    if "hwm" not in out:                                  # not Linux: the peak from getrusage (KiB here)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["hwm"] = peak if sys.platform == "darwin" else peak * 1024
        out.setdefault("rss", out["hwm"])
    return out


def fill_for(ctx: int, fill: int | None) -> tuple[int, int]:
    """(prompt tokens, decode steps) of a point at ``ctx``: the whole context minus the decode steps, or
    ``fill`` tokens when that leaves room for them."""
    decode = min(DECODE_STEPS, ctx - 1)
    prompt = ctx - decode if fill is None else min(fill, ctx - decode)
    return max(prompt, 1), decode


def _ggraph_point(spec: dict) -> dict:
    from ggraph.bench.measure import prompt_tokens
    from ggraph.runtime.session import Session
    s = Session(spec["path"], threads=spec["threads"], ctx=spec["ctx"], cache_type_k=spec["cache_k"],
                cache_type_v=spec["cache_v"], max_memory=spec.get("max_memory"))
    s.program(last_only=True)
    planned = s.memory()
    loaded = resident()
    ids = prompt_tokens(spec["fill"], s.config.n_vocab)
    tok = int(s.step(ids)[-1].argmax())
    for _ in range(spec["decode"]):
        tok = int(s.step([tok])[-1].argmax())
    return {"planned": planned, "load": loaded, "end": resident()}


def _llama_point(spec: dict) -> dict:
    import numpy as np
    import llama_cpp
    from ggraph.bench.measure import GGML_TYPES, LLAMA_BATCH, LLAMA_UBATCH, prompt_tokens
    ctx = spec["ctx"]
    llm = llama_cpp.Llama(model_path=spec["path"], n_ctx=ctx, n_batch=min(LLAMA_BATCH, ctx),
                          n_ubatch=min(LLAMA_UBATCH, ctx), n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], type_k=GGML_TYPES[spec["cache_k"]],
                          type_v=GGML_TYPES[spec["cache_v"]], flash_attn=spec["flash_attn"], verbose=False)
    loaded = resident()
    n_vocab = llm.n_vocab()
    llm.eval(prompt_tokens(spec["fill"], n_vocab))
    for _ in range(spec["decode"]):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        llm.eval([int(logits.argmax())])
    end = resident()
    llm.close()
    return {"load": loaded, "end": end}


def measure_point(engine: str, path, ctx: int, cache_k: str = "f16", cache_v: str = "f16", fill: int | None = None,
                  threads: int = 1, flash_attn: bool = True, max_memory=None) -> dict:
    """One point, measured in a fresh process: {"engine", "ctx", "cache_k", "cache_v", "fill", "decode",
    "flash_attn", "planned" (ggraph only: weights, kv_cache, states, activations, total), "load", "end"}; "load"
    and "end" are ``resident()`` after loading and after the run (its "hwm" is the peak)."""
    prompt, decode = fill_for(ctx, fill)
    spec = {"engine": engine, "path": str(path), "ctx": ctx, "cache_k": cache_k, "cache_v": cache_v, "fill": prompt,
            "decode": decode, "threads": threads, "flash_attn": bool(flash_attn), "max_memory": max_memory}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))   # the ggraph this process runs
    from ggraph import plugins
    files = [k for k in plugins._loaded if os.path.isfile(k)]          # --plugin files: the same architectures
    if files:
        env[plugins.ENV] = os.pathsep.join([*files, *filter(None, [os.environ.get(plugins.ENV)])])
    proc = subprocess.run([sys.executable, "-m", "ggraph.bench.memory", json.dumps(spec)], capture_output=True,
                          text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1]) if proc.returncode in (0, 1) and lines else {}
    if proc.returncode != 0 or "error" in out:
        what = f"memory point {engine} ctx={ctx} {cache_k}/{cache_v}"
        if "error" in out:
            raise (ValueError if out["input"] else RuntimeError)(f"{what}: {out['error']}")
        tail = [line for line in proc.stderr.splitlines() if line.strip()]
        raise RuntimeError(f"{what}: the measuring process died (exit {proc.returncode}): "
                           f"{tail[-1] if tail else 'no message'}")
    return {k: v for k, v in spec.items() if k not in ("path", "max_memory")} | out


def memory_points(ctxs, cache_types, llama_cpp: bool = False, flash_attn=(True,)) -> list[tuple]:
    """(engine, ctx, K type, V type, flash attention) of every point: ggraph's, then llama.cpp's per flash
    attention setting (only on for a quantised V cache, which llama.cpp cannot run without it)."""
    from ggraph.bench.measure import LLAMA_NEEDS_FA
    points = []
    for k, v in cache_types:
        for ctx in ctxs:
            points.append(("ggraph", ctx, k, v, True))
            points += [("llama.cpp", ctx, k, v, fa) for fa in (flash_attn if llama_cpp else ())
                       if fa or v not in LLAMA_NEEDS_FA]
    return points


def memory_curve(path, points, fill: int | None = None, threads: int = 1, progress=None,
                 max_memory=None) -> list[dict]:
    """The measurement of every point of ``memory_points``, each in a fresh process."""
    rows = []
    for engine, ctx, k, v, fa in points:
        rows.append(measure_point(engine, path, ctx, k, v, fill, threads, fa, max_memory))
        if progress is not None:
            progress.advance()
    return rows


def _peak(rows: list[dict], ctx: int, k: str, v: str, engine: str, fa: bool | None = None) -> int | None:
    for r in rows:
        if (r["engine"], r["ctx"], r["cache_k"], r["cache_v"]) == (engine, ctx, k, v) \
                and (fa is None or r["flash_attn"] == fa):
            return r["end"]["hwm"]
    return None


def memory_table(rows: list[dict]) -> str:
    """Planned and measured MiB per (cache types, ctx): ggraph's plan and RSS, and llama.cpp's peak RSS."""
    fas = sorted({r["flash_attn"] for r in rows if r["engine"] == "llama.cpp"}, reverse=True)
    head = (f"{'K/V':<10} {'ctx':>6} {'fill':>6} | {'weights':>8} {'KV':>8} {'states':>7} {'acts':>7} {'planned':>8} | "
            f"{'load':>7} {'peak':>7} {'unplanned':>9}")
    head += "".join(f" | {'llama.cpp fa ' + ('on' if fa else 'off'):>16} {'ratio':>6}" for fa in fas)
    lines = ["MiB; planned = Session.memory(); load, peak = ggraph's RSS after loading and at its peak; "
             "unplanned = peak - planned", head]
    for r in rows:
        if r["engine"] != "ggraph":
            continue
        p, peak = r["planned"], r["end"]["hwm"]
        line = (f"{r['cache_k'] + '/' + r['cache_v']:<10} {r['ctx']:>6} {r['fill']:>6} | {p['weights'] / MIB:>8.1f} "
                f"{p['kv_cache'] / MIB:>8.1f} {p.get('states', 0) / MIB:>7.1f} {p['activations'] / MIB:>7.1f} "
                f"{p['total'] / MIB:>8.1f} | "
                f"{r['load']['rss'] / MIB:>7.1f} {peak / MIB:>7.1f} {(peak - p['total']) / MIB:>+9.1f}")
        for fa in fas:
            theirs = _peak(rows, r["ctx"], r["cache_k"], r["cache_v"], "llama.cpp", fa)
            line += f" | {theirs / MIB:>16.1f} {peak / theirs:>5.2f}x" if theirs else f" | {'-':>16} {'':>6}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """The measuring process: one point's spec (JSON) in argv, its report (JSON) on stdout's last line."""
    spec = json.loads(argv[0])
    try:
        out, code = _ggraph_point(spec) if spec["engine"] == "ggraph" else _llama_point(spec), 0
    except (ValueError, KeyError, OSError, MemoryError) as e:         # bad input: the parent says which
        out, code = {"error": str(e), "input": isinstance(e, (ValueError, KeyError, OSError))}, 1
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(code)                   # the report is out: skip interpreter teardown (llama.cpp's __del__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
