"""Benchmarks: prefill and decode speed of ggraph (and of llama.cpp on the same file), side by side.

    result = bench_ggraph("model.gguf", pp=64, tg=32, threads=2)   # {"pp_tok_s": ..., "tg_tok_s": ...}

Prefill runs ``pp`` prompt tokens as one step; decode then runs ``tg`` greedy steps of one
token each. Each figure is the best of ``repeats`` runs.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np


@dataclasses.dataclass
class Result:
    engine: str
    pp: int
    tg: int
    threads: int
    pp_tok_s: float
    tg_tok_s: float
    passes: str = ""
    backend: str = ""
    load_s: float = 0.0

    def row(self) -> dict:
        return dataclasses.asdict(self)


def prompt_tokens(n: int, n_vocab: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt (ids clear of the special tokens at the start of vocabularies)."""
    return [int(t) for t in np.random.default_rng(seed).integers(min(1000, n_vocab // 2), n_vocab, n)]


def bench_ggraph(path, pp: int = 64, tg: int = 32, threads: int = 1, backend: str = "llvm",
                 passes="default", repeats: int = 3, ctx: int | None = None) -> Result:
    """Best-of-``repeats`` prefill and decode speed of a ggraph Session."""
    from ggraph.runtime import Session
    t0 = time.perf_counter()
    s = Session(path, backend=backend, threads=threads, passes=passes, ctx=ctx or max(pp + tg + 1, 64))
    ids = prompt_tokens(pp, s.config.n_vocab)
    s.step(ids[:1])                                            # compile and warm up both step kinds
    s.step(ids[:2])
    load = time.perf_counter() - t0
    best_pp = best_tg = float("inf")
    for _ in range(repeats):
        s.reset()
        t = time.perf_counter()
        logits = s.step(ids)
        best_pp = min(best_pp, time.perf_counter() - t)
        tok = int(np.argmax(logits[-1]))
        t = time.perf_counter()
        for _ in range(tg):
            tok = int(np.argmax(s.step([tok])[-1]))
        best_tg = min(best_tg, time.perf_counter() - t)
    return Result("ggraph", pp, tg, threads, pp / best_pp, tg / best_tg if tg else 0.0,
                  passes=passes if isinstance(passes, str) else ",".join(passes), backend=backend, load_s=load)


def bench_llama_cpp(path, pp: int = 64, tg: int = 32, threads: int = 1, repeats: int = 3) -> Result:
    """The same measurement through llama-cpp-python (raises ImportError when it is missing)."""
    import llama_cpp
    t0 = time.perf_counter()
    n_ctx = max(pp + tg + 1, 64)               # n_batch = n_ctx: llama-cpp-python indexes its scores by position
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=max(pp, 1),
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    ids = prompt_tokens(pp, llm.n_vocab())
    load = time.perf_counter() - t0
    best_pp = best_tg = float("inf")
    for _ in range(repeats):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        best_pp = min(best_pp, time.perf_counter() - t)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(tg):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        best_tg = min(best_tg, time.perf_counter() - t)
    llm.close()
    return Result("llama.cpp", pp, tg, threads, pp / best_pp, tg / best_tg if tg else 0.0,
                  backend=f"llama-cpp-python {llama_cpp.__version__}", load_s=load)
