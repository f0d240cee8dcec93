"""Batch: several sequences stepped together, each in a slot of its own in slotted KV caches.

    b = Batch("model.gguf", slots=8, ctx=2048)
    out = b.step({0: prompt_ids, 3: [next_token]})       # one native step for both sequences
    out[0], out[3]                                       # each one's last-token logits (V,)

A step takes any mix of prompt chunks and single decode tokens, one entry per slot, with each
slot's tokens placed after what that slot already holds. Every weight is read once per step for
all of them, which is where batching wins: decode is bound by reading the weights. On the llvm
backend every kernel computes a token as it would alone in the step (``rows_only`` matmuls), so
a sequence's logits do not depend on which others share its steps.

A model without a batched step (an architecture with a forward of its own, such as one with
recurrent layers) runs its slots one at a time instead: each slot is a ``Sequence`` of its own (KV
caches, recurrent states and their snapshots) stepped by the single-sequence program a Session
runs, so each sequence gets exactly the logits it would get alone.
"""
from __future__ import annotations

import numpy as np

from ggraph.backends.llvm.team import check_threads
from ggraph.runtime.session import (UBATCH, Sequence, cache_dtype, check_memory, empty_caches, kv_caches,
                                    state_arrays, token_ids)


class Batch:
    """Slotted KV caches and the compiled batched step over them (or, for a model without a batched step,
    a Sequence per slot)."""

    def __init__(self, path, slots: int, ctx: int = 4096, backend: str = "llvm", threads: int | None = None,
                 passes="default", disabled=(), max_memory=None, cache_type_k: str = "f16",
                 cache_type_v: str = "f16", ubatch: int = UBATCH, model=None):
        from ggraph import memory
        from ggraph.models import load
        from ggraph.passes import resolve
        from ggraph.runtime.tokenizer import Tokenizer
        for name, v in (("slots", slots), ("ctx", ctx), ("ubatch", ubatch)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive whole number, got {v!r}")
        self.threads = check_threads(threads)
        self.passes = resolve(passes, disabled)             # a tuple of Pass, checked once
        self.max_memory = memory.parse_size(max_memory) if max_memory is not None else None
        self.model = model or load(path)
        self.config = self.model.config
        self.tokenizer = Tokenizer.from_metadata(self.model.file.metadata)
        self.slots, self.ctx, self.ubatch = int(slots), int(ctx), int(ubatch)
        self.backend = backend
        self.cache_types = (cache_dtype(cache_type_k, "cache_type_k"), cache_dtype(cache_type_v, "cache_type_v"))
        self.sequential = not self.model.batched              # one slot at a time, each a Sequence
        what = f"{self.slots} slots × ctx {self.ctx}"
        if self.sequential:
            check_memory(self.model, self.ctx, self.cache_types, self.max_memory, what, sequences=self.slots)
            self.sequences = [Sequence(*empty_caches(self.model, self.ctx, self.cache_types), state_arrays(self.model),
                                       self.ubatch) for _ in range(self.slots)]
        else:
            self.k_cache, self.v_cache = kv_caches(self.model, self.slots * self.ctx, self.cache_types,
                                                   self.max_memory, what)
        self._n_past = [0] * self.slots
        self._program = None

    @property
    def n_past(self) -> tuple[int, ...]:
        """Tokens each slot holds (read-only: ``reset(slot)`` and ``truncate(slot, n)`` change them)."""
        if self.sequential:
            return tuple(q.n_past for q in self.sequences)
        return tuple(self._n_past)

    def program(self):
        """The compiled batched step (or the single-sequence step of a sequential batch), built once."""
        if self._program is None:
            from ggraph.compiler import compile_graph
            options = {"threads": self.threads, "max_memory": self.max_memory, "rows_only": not self.sequential} \
                if self.backend != "numpy" else {}
            graph = self.model.graph(self.ctx, last_only=True, cache_types=self.cache_types) if self.sequential \
                else self.model.batch_graph(self.slots, self.ctx, self.cache_types)
            self._program = compile_graph(graph, backend=self.backend, passes=self.passes,
                                          weights=self.model.file, **options)
        return self._program

    def reset(self, slot: int) -> None:
        """Forget slot ``slot``'s sequence (its rows are overwritten later)."""
        self._check_slot(slot)
        self._n_past[slot] = 0
        if self.sequential:
            self.sequences[slot].reset()

    def truncate(self, slot: int, n: int) -> None:
        """Keep the first ``n`` tokens of slot ``slot``'s sequence (recurrent states rebuilt at ``n``)."""
        self._check_slot(slot)
        if self.sequential:
            self.sequences[slot].truncate(n, self.program)
            return
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self._n_past[slot]:
            raise ValueError(f"truncate: n must be in 0..{self._n_past[slot]} (slot {slot}'s tokens), got {n!r}")
        self._n_past[slot] = int(n)

    def step(self, work: dict) -> dict[int, np.ndarray]:
        """Run ``work`` ({slot: token ids}) in one step; returns {slot: logits (V,) of its last token}.
        At most ``ubatch`` tokens in all, and each slot's tokens must fit its context."""
        if not work:
            raise ValueError("step needs at least one slot with tokens")
        parts, total = [], 0
        for slot, ids in sorted(work.items()):
            self._check_slot(slot)
            ids = token_ids(ids, self.config.n_vocab)
            if ids.size == 0:
                raise ValueError(f"slot {slot}: no tokens")
            if self.n_past[slot] + ids.size > self.ctx:
                raise ValueError(f"slot {slot}: {self.n_past[slot]} tokens + {ids.size} new > ctx={self.ctx}")
            parts.append((slot, ids))
            total += ids.size
        if total > self.ubatch:
            raise ValueError(f"a step takes at most ubatch={self.ubatch} tokens, got {total}")
        if self.sequential:
            prog = self.program()
            return {s: np.asarray(self.sequences[s].run(prog, ids)[-1][-1], dtype=np.float32) for s, ids in parts}
        tokens = np.concatenate([ids for _, ids in parts]).astype(np.int32)
        seq = np.concatenate([np.full(ids.size, s, np.int32) for s, ids in parts])
        positions = np.concatenate([self._n_past[s] + np.arange(ids.size, dtype=np.int32) for s, ids in parts])
        pick = (np.cumsum([ids.size for _, ids in parts]) - 1).astype(np.int32)    # each slot's last token
        logits, = self.program().run_inputs([tokens, seq, positions, pick, *self.k_cache, *self.v_cache], first=1)
        for s, ids in parts:
            self._n_past[s] += ids.size
        return {s: np.asarray(row, dtype=np.float32) for (s, _), row in zip(parts, logits)}

    def _check_slot(self, slot) -> None:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in 0..{self.slots - 1}, got {slot!r}")
