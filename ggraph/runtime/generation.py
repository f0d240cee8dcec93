"""One sequence's generation state, apart from how its steps run: each step's logits in, the
next token and the text it completes out. Session.generate and the server's batch share it.

    g = Generation(tokenizer, prompt_ids, max_tokens=64, sampler=Sampler(0.0), stop=["\\n\\n"])
    piece, tok = g.feed(logits, room=True)      # tok None: finished (g.stop says why)
"""
from __future__ import annotations

import numpy as np

from ggraph.runtime.tokenizer import Detokenizer


class NonFiniteLogits(ValueError):
    """A step gave NaN or infinite logits: there is no token to sample (GGRAPH_DEBUG_NANS=1 finds the op)."""


class Generation:
    """Sampling, the grammar mask, stop strings held back until they cannot match, and why it ended."""

    def __init__(self, tokenizer, prompt_ids, max_tokens: int, sampler, seed=None, stop=(), matcher=None):
        self.tokenizer, self.sampler, self.matcher = tokenizer, sampler, matcher
        self.max_tokens, self.stops = int(max_tokens), tuple(stop)
        self.rng = np.random.default_rng(seed)
        self.history = list(prompt_ids)
        self.detok = Detokenizer(tokenizer, skip_special=True)
        self.text, self.emitted, self.generated = "", 0, 0
        self.stop: str | None = None           # "eog", "stop", "length" or "context" once finished

    def feed(self, logits, room: bool) -> tuple[str, int | None]:
        """The text this step's token completes, and the token to run next (None: finished).
        ``room``: whether the context has a row for that token."""
        if self.stop is not None:
            raise RuntimeError("this generation has finished")
        if 0 <= self.max_tokens <= self.generated:
            return self._finish("length")
        if not np.isfinite(logits).all():              # before the grammar mask, which writes -inf
            raise NonFiniteLogits(f"the model's logits are not finite (NaN or infinite) at generated token "
                                  f"{self.generated}; run again with GGRAPH_DEBUG_NANS=1 to name the op that made "
                                  f"them (and the weight, if one holds them)")
        if self.matcher is not None:
            logits = self.matcher.mask(logits)
        tok = self.sampler(logits, self.history, self.rng)
        if self.matcher is not None:
            self.matcher.accept(tok)
        if self.tokenizer.is_eog(tok):
            return self._finish("eog")
        self.history.append(tok)
        self.generated += 1
        self.text += self.detok.push(tok)
        cut = first_stop(self.text, self.stops)
        safe = cut if cut is not None else len(self.text) - partial_stop(self.text, self.stops)
        piece = ""
        if safe > self.emitted:
            piece, self.emitted = self.text[self.emitted:safe], safe
        if cut is not None:
            return piece + self._finish("stop")[0], None
        if self.generated == self.max_tokens:
            return piece + self._finish("length")[0], None
        if not room:
            return piece + self._finish("context")[0], None
        return piece, tok

    def _finish(self, why: str) -> tuple[str, None]:
        """End with ``why``; the held-back tail, up to any stop string."""
        self.stop = why
        tail = self.text + self.detok.flush()
        cut = first_stop(tail, self.stops)
        end = cut if cut is not None else len(tail)
        piece = tail[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece, None


def first_stop(text: str, stop) -> int | None:
    """Where the first stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else None


def partial_stop(text: str, stop) -> int:
    """Characters at the end of ``text`` that may be the start of a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                best = max(best, n)
                break
    return best
