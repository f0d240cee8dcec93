"""Perplexity of a model on a text, chunk by chunk, as llama.cpp's ``llama-perplexity`` computes it.

    est = perplexity("model.gguf", open("wiki.txt").read(), n_ctx=512)
    est.ppl, est.error                  # "Final estimate: PPL = 12.3456 +/- 0.12345"

The text is tokenised once with the model's BOS (and no parsing of special tokens), cut into
``len // n_ctx`` chunks of ``n_ctx`` tokens (at most ``n_chunks``) with the remainder dropped,
and each chunk runs from an empty KV cache with its first token replaced by BOS. Only the
second half of a chunk is scored, so every scored token has at least ``n_ctx / 2`` tokens of
context: the logits at positions ``n_ctx/2 .. n_ctx-2`` predict the tokens after them. The
negative log-likelihood of each is taken from a log-softmax whose sum of exponentials is
accumulated in double precision. The error estimate is the standard error of the mean
negative log-likelihood, carried through the exponential: ``ppl * sqrt(var(nll) / (n - 1))``.

``ggraph imatrix`` runs the same chunks and prints the same running estimates.
"""
from __future__ import annotations

import math
import sys
from typing import Callable, Sequence

import numpy as np

from ggraph.progress import Progress

ROWS_PER_SOFTMAX = 64          # logit rows exponentiated at once: bounds the f32 temporaries (rows × vocab)


def text_tokens(tokenizer, text: str) -> list[int]:
    """The text's token ids as llama.cpp's tools take them: BOS if the model adds one, specials not parsed."""
    if tokenizer.add_eos:
        raise ValueError("the model's tokenizer appends EOS (tokenizer.ggml.add_eos_token), which llama.cpp's "
                         "perplexity and imatrix refuse: the text would end in an EOS token")
    return tokenizer.encode(text, add_special=True, parse_special=False)


def chunks(tokens: Sequence[int], n_ctx: int, n_chunks: int | None, bos: int | None) -> np.ndarray:
    """(n, n_ctx) i32: the first ``n_chunks`` (or all) whole chunks of ``tokens``, each starting with ``bos``
    (when not None). Needs at least two chunks' worth of tokens, as llama.cpp does."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 4:
        raise ValueError(f"the chunk size (--ctx) must be a whole number of at least 4 tokens, got {n_ctx!r}")
    if n_chunks is not None and (isinstance(n_chunks, bool) or not isinstance(n_chunks, int) or n_chunks < 1):
        raise ValueError(f"--chunks must be a positive whole number, got {n_chunks!r}")
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"the text is {len(tokens)} tokens; chunks of {n_ctx} need at least {2 * n_ctx} "
                         f"(2 × --ctx): give a longer text or a smaller --ctx")
    n = len(tokens) // n_ctx if n_chunks is None else min(n_chunks, len(tokens) // n_ctx)
    out = np.array(tokens[:n * n_ctx], dtype=np.int32).reshape(n, n_ctx)
    if bos is not None:
        out[:, 0] = bos
    return out


def bos_of(tokenizer) -> int | None:
    """The id llama.cpp puts at every chunk's start: the BOS token, if the model's tokenizer adds one."""
    return tokenizer.bos_id if tokenizer.add_bos and tokenizer.bos_id is not None else None


def chunk_nll(logits: np.ndarray, chunk: np.ndarray) -> np.ndarray:
    """f64 negative log-likelihoods of the chunk's second half: position i's logits (n_ctx, V) against
    token i+1, for i in n_ctx/2 .. n_ctx-2. Max and differences in f32, the sum of exps in f64."""
    n_ctx = chunk.shape[0]
    first = n_ctx // 2
    rows = np.arange(first, n_ctx - 1)
    out = np.empty(rows.size, dtype=np.float64)
    for at in range(0, rows.size, ROWS_PER_SOFTMAX):
        r = rows[at:at + ROWS_PER_SOFTMAX]
        z = logits[r].astype(np.float32, copy=False)                          # (rows, V)
        top = z.max(axis=1, keepdims=True)
        sum_exp = np.exp(z - top).sum(axis=1, dtype=np.float64)
        picked = z[np.arange(r.size), chunk[r + 1]] - top[:, 0]              # f32, as llama.cpp's logit - max
        out[at:at + r.size] = np.log(sum_exp) - picked.astype(np.float64)
    return out


class Estimate:
    """The running perplexity: sums of the scored tokens' nll and nll², and how many there were."""

    def __init__(self):
        self.nll = self.nll2 = 0.0
        self.count = 0

    def add(self, nlls: np.ndarray) -> None:
        self.nll += float(nlls.sum())
        self.nll2 += float(np.square(nlls).sum())
        self.count += int(nlls.size)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def error(self) -> float | None:
        """The standard error of the perplexity, or None while the spread is not positive (one token)."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        return math.sqrt(var / (self.count - 1)) * self.ppl if var > 0 and self.count > 1 else None

    def final_line(self) -> str:
        if self.error is None:
            return f"Final estimate: PPL = {self.ppl:.4f} (no error estimate: the log-probabilities do not vary)"
        return f"Final estimate: PPL = {self.ppl:.4f} +/- {self.error:.5f}"


def evaluate(chunk_rows: np.ndarray, logits_of: Callable[[np.ndarray], np.ndarray | None], label: str,
             out=None) -> Estimate | None:
    """Run every chunk through ``logits_of`` (chunk -> its logits at every position, or None not to score),
    printing llama.cpp's running estimates ``[1]x,[2]y,...`` to ``out`` and the final line; a progress bar
    shows on stderr. While the bar draws on the same terminal as ``out``, the running estimate shows in
    the bar and the estimates line prints once at the end."""
    out = out or sys.stdout
    est = Estimate()
    line = []
    with Progress(len(chunk_rows), label, unit=" chunks") as bar:
        progressive = not (bar.live and getattr(out, "isatty", lambda: False)())
        for i, chunk in enumerate(chunk_rows, 1):
            logits = logits_of(chunk)
            if logits is not None:
                est.add(chunk_nll(logits, chunk))
                line.append(f"[{i}]{est.ppl:.4f},")
                bar.label = f"{label} [{i}]{est.ppl:.4f}"
                if progressive:
                    print(line[-1], end="", file=out, flush=True)
            bar.advance()
    if not est.count:
        return None
    print("" if progressive else "".join(line), file=out)
    print(est.final_line(), file=out, flush=True)
    return est


def perplexity(path, text: str, n_ctx: int = 512, n_chunks: int | None = None, threads: int | None = None,
               batch: int = 512, cache_type_k: str = "f16", cache_type_v: str = "f16", max_memory=None,
               backend: str = "llvm", out=None) -> Estimate:
    """The model's perplexity on ``text`` in chunks of ``n_ctx`` tokens (see the module docstring),
    running ``batch`` tokens per native step; prints the running estimates and the final line."""
    from ggraph.runtime.session import Session
    session = Session(path, backend=backend, threads=threads, ctx=n_ctx, ubatch=batch, max_memory=max_memory,
                      cache_type_k=cache_type_k, cache_type_v=cache_type_v)
    rows = chunks(text_tokens(session.tokenizer, text), n_ctx, n_chunks, bos_of(session.tokenizer))
    session.program(last_only=False)                       # compiled (with its own bar) before the chunks' bar
    return evaluate(rows, session.logits, "perplexity", out)
