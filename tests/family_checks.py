"""The runs the model-family tests (test_hf_families, test_recurrent_families, test_qwen3next) hold to llama.cpp
alike: a file through one feature set's kernels, a cached prefix cut back and run on, and a second chat turn
that reuses the cached prefix; and the module-wide session each family test reuses."""
from functools import lru_cache

import numpy as np
import pytest

import oracle
from ggraph.runtime.session import Session
from test_models import EXACT

@lru_cache(maxsize=None)
def _session(path, backend, ctx):
    return Session(path, backend=backend, threads=2, ctx=ctx, **EXACT)


def shared_session(path, backend, ctx):
    """One session per file, backend and context for the whole run (compiled once), reset for each use."""
    s = _session(path, backend, ctx)
    s.reset()
    return s


def on_feature_set(path, target, monkeypatch, ids, agrees, ctx):
    """The llvm backend's session of ``path`` compiled for the feature set ``target`` (GGRAPH_TARGET; the test is
    skipped where this host cannot run it), after ``agrees(got, want, what)`` held its prefill of ``ids`` and its
    token-by-token run of ``ids[:8]`` to llama.cpp's logits of the same runs."""
    from ggraph.backends.llvm.target import missing_features
    if missing_features(target):
        pytest.skip(f"this host cannot run {target}")
    monkeypatch.setenv("GGRAPH_TARGET", target)
    s = Session(path, backend="llvm", threads=2, ctx=ctx, **EXACT)
    assert s.program(False).target.name == target
    agrees(s.logits(ids), oracle.llama_logits(path, ids, n_ctx=ctx), "prefill")
    s.reset()
    got = np.concatenate([s.step([t], last_only=False) for t in ids[:8]])
    agrees(got, oracle.llama_logits_stepwise(path, ids[:8], n_ctx=ctx), "decode")
    return s


def cut_back_then_new_tokens(s, path, ids, ctx):
    """What a chat turn that reuses the cached prefix does: ``ids[:16]`` run on session ``s`` (a prefill of 12,
    then decode steps), the cache cut back to 10 (the states restored from the prefill's snapshot, tokens after it
    run again), then 10 new tokens (``ids[10:12] + ids[14:22]``): (their logits, llama.cpp's over one prefill of
    the whole sequence, ``path`` being the file ``s`` runs)."""
    seq = ids[:12] + ids[14:22]
    s.step(ids[:12])
    for t in ids[12:16]:
        s.step([t])
    s.truncate(10)
    assert s.n_past == 10 and s.cached_tokens == tuple(ids[:10])
    return s.step(seq[10:], last_only=False), oracle.llama_logits(path, seq, n_ctx=ctx)[10:]


def second_turn_reusing_the_prefix(s, path, ids, ctx):
    """Session.generate(reuse_cache=True) on the llvm session ``s`` of ``path``: a first turn of ``ids[:12]``, then a
    second prompt sharing its first 10 tokens, so the states go back to a snapshot and the rest runs again; its
    greedy reply (6 tokens) must be a fresh session's. Returns (the reply, the second prompt)."""
    s.generate(ids[:12], max_tokens=6, temperature=0)
    second = ids[:10] + ids[14:22]
    reply = s.generate(second, max_tokens=6, temperature=0, reuse_cache=True)
    assert s.stats["cached_tokens"] == 10 and s.stats["recomputed_tokens"] > 0, s.stats
    fresh = Session(path, backend="llvm", threads=2, ctx=ctx, **EXACT)
    assert reply == fresh.generate(second, max_tokens=6, temperature=0)
    return reply, second
