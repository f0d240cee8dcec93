"""Session: a model, its tokenizer and KV cache, prefill and decode steps, and generation.

    s = ggraph.Session("model.gguf")
    print(s.generate("The capital of France is", max_tokens=16, temperature=0))

A model with recurrent layers also carries their states (``Model.state_avals``), zeroed for a new
sequence and written in place by every step. A state cannot be cut back to an earlier position the
way KV rows can, so the session keeps a few snapshots (after each prefill step and every
SNAPSHOT_EVERY decoded tokens, at most MAX_SNAPSHOTS, as llama.cpp's server keeps context
checkpoints); ``truncate(n)`` restores the newest one at or before n (or zeros) and runs the tokens
between again, which rewrites their KV rows too.
"""
from __future__ import annotations

import time
from typing import Iterator, Sequence

import numpy as np

from ggraph.runtime.sampling import Sampler
from ggraph.backends.llvm.team import check_threads
from ggraph.runtime.tokenizer import Tokenizer


POOLINGS = ("mean", "last", "cls")
UBATCH = 512                  # tokens per native step of a long prompt, as llama.cpp's default n_ubatch
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
MAX_SNAPSHOTS = 8             # recurrent-state snapshots a sequence keeps (llama.cpp's server: 8 checkpoints)
SNAPSHOT_EVERY = 32           # decoded tokens between two snapshots: truncating re-runs at most this many


class ContextFullError(ValueError):
    """The KV cache has no room for the tokens of this step."""


class Session:
    """A loaded model ready to run: ``.logits(tokens)``, ``.generate(prompt)``, ``.chat(messages)``.

    The default backend is the native one ("llvm"); "numpy" is the slow, exact reference.
    """

    def __init__(self, path, backend: str = "llvm", threads: int | None = None, passes="default",
                 ctx: int = 4096, disabled=(), profile: bool = False, max_memory: int | str | None = None,
                 cache_type_k: str = "f16", cache_type_v: str = "f16", ubatch: int = UBATCH):
        from ggraph import memory
        from ggraph.compiler import BACKENDS
        from ggraph.models import load
        from ggraph.passes import resolve
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
        if isinstance(ctx, bool) or not isinstance(ctx, (int, np.integer)) or ctx < 1:
            raise ValueError(f"ctx must be a positive whole number of tokens, got {ctx!r}")
        if isinstance(ubatch, bool) or not isinstance(ubatch, (int, np.integer)) or ubatch < 1:
            raise ValueError(f"ubatch must be a positive whole number of tokens, got {ubatch!r}")
        if profile and backend != "llvm":
            raise ValueError("profile=True needs backend='llvm' (it times the native program's kernels)")
        self.threads = check_threads(threads)             # before any slow work
        self.passes = resolve(passes, disabled)             # a tuple of Pass, checked once
        self.max_memory = memory.parse_size(max_memory) if max_memory is not None else None
        self.cache_types = (cache_dtype(cache_type_k, "cache_type_k"), cache_dtype(cache_type_v, "cache_type_v"))
        self.model = load(path)
        self.config = self.model.config
        self.tokenizer = Tokenizer.from_metadata(self.model.file.metadata)
        if self.tokenizer.n_vocab != self.config.n_vocab:
            raise ValueError(f"the tokenizer has {self.tokenizer.n_vocab} tokens but the model's vocabulary has "
                             f"{self.config.n_vocab}")
        self.ctx, self.ubatch = int(ctx), int(ubatch)
        self.backend = backend
        self.profile = profile
        self._programs: dict[bool, object] = {}
        self.seq = Sequence(*kv_caches(self.model, self.ctx, self.cache_types, self.max_memory, f"ctx {self.ctx}"),
                            state_arrays(self.model), self.ubatch)
        if self.ctx > self.config.n_ctx_train:             # once the caches fit: an error stands alone
            from ggraph.progress import warn
            warn(f"ctx {self.ctx} is beyond the {self.config.n_ctx_train} tokens this model was trained on "
                 f"({self.config.arch}.context_length): positions past it may give poor text")
        self.stats: dict[str, float] = {}

    def memory(self, tokens: int | None = None) -> dict[str, int]:
        """Planned bytes: weights (the file's tensors, mapped), KV cache, recurrent states (with room for
        their snapshots), activations of a step of ``tokens`` (default: one ubatch) at a full context,
        and their total."""
        weights = sum(t.nbytes for t in self.model.file.tensors.values())
        kv = sum(c.nbytes for c in self.k_cache + self.v_cache)
        states = (1 + MAX_SNAPSHOTS) * sum(a.nbytes for a in self.states)
        T = min(self.ubatch if tokens is None else int(tokens), self.ctx)
        acts = 0
        if self.backend == "llvm":
            acts = self.program(last_only=True).arena_bytes({"T": T, "P": self.ctx - T})
        return {"weights": weights, "kv_cache": kv, "states": states, "activations": acts,
                "total": weights + kv + states + acts}

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        """The token ids the KV cache holds, in order."""
        return tuple(self.seq.cached)

    @property
    def n_past(self) -> int:
        """Tokens in the KV cache (read-only: ``reset()`` and ``truncate(n)`` change it)."""
        return self.seq.n_past

    @property
    def k_cache(self) -> list:
        return self.seq.k_cache

    @property
    def v_cache(self) -> list:
        return self.seq.v_cache

    @property
    def states(self) -> list:
        """The recurrent states, flat in the order the step graph takes them (empty without recurrent layers)."""
        return self.seq.states

    # -- steps ---------------------------------------------------------------------------
    def program(self, last_only: bool, output: str = "logits"):
        """The compiled step (all-position logits, the last position's only, or with ``output="hidden"``
        every position's final hidden state), built once."""
        key = "hidden" if output == "hidden" else last_only
        if key not in self._programs:
            from ggraph.compiler import compile_graph
            options = {"threads": self.threads, "profile": self.profile, "max_memory": self.max_memory} \
                if self.backend != "numpy" else {}
            graph = self.model.graph(self.ctx, last_only=last_only, cache_types=self.cache_types, output=output)
            self._programs[key] = compile_graph(graph, backend=self.backend, passes=self.passes,
                                                weights=self.model.file, **options)
        return self._programs[key]

    def reset(self) -> None:
        """Forget the context (the cache rows are simply overwritten later; recurrent states are zeroed)."""
        self.seq.reset()

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` tokens of the context (0 <= n <= n_past). With recurrent states, the
        state at ``n`` is rebuilt: from the newest snapshot at or before ``n`` (else from zeros), by running
        the tokens between again."""
        self.seq.truncate(n, lambda: self.program(last_only=True))

    def step(self, tokens: Sequence[int], last_only: bool = True) -> np.ndarray:
        """Run tokens after the current context; returns logits (T or 1, n_vocab)."""
        tokens = token_ids(tokens, self.config.n_vocab)
        if tokens.size == 0:
            raise ValueError("step needs at least one token")
        if self.seq.n_past + tokens.size > self.ctx:
            raise ContextFullError(f"context full: {self.seq.n_past} tokens in the cache + {tokens.size} new "
                                   f"> ctx={self.ctx}; start a new Session with a larger ctx")
        out = self.seq.run(self.program(last_only), tokens)
        return out[-1] if last_only else out[0] if len(out) == 1 else np.concatenate(out)

    def embed(self, texts, pooling: str = "mean", normalize: bool = True) -> np.ndarray:
        """Embeddings (n, n_embd) of ``texts`` (strings or lists of token ids): the final hidden state
        after the output norm, pooled over each text's tokens ("mean"; "last" token; "cls", the first),
        L2-normalised unless ``normalize=False``. Each text runs in a fresh context (the cache is reset)."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        if isinstance(texts, str) or (isinstance(texts, (list, tuple)) and texts and isinstance(texts[0], (int, np.integer))):
            texts = [texts]
        if not isinstance(texts, (list, tuple)):
            raise TypeError(f"texts must be a string, a list of token ids, or a list of those, got {type(texts).__name__}")
        prog = self.program(last_only=False, output="hidden")
        out = np.zeros((len(texts), self.config.n_embd), dtype=np.float32)
        for i, text in enumerate(texts):
            ids = self.tokenizer.encode(text) if isinstance(text, str) else token_ids(text, self.config.n_vocab).tolist()
            if not ids:
                raise ValueError(f"text {i} encodes to no tokens")
            if len(ids) > self.ctx:
                raise ContextFullError(f"text {i} is {len(ids)} tokens > ctx={self.ctx}")
            self.reset()
            h = np.concatenate(self.seq.run(prog, np.asarray(ids, dtype=np.int32)))
            v = h.mean(axis=0) if pooling == "mean" else h[-1] if pooling == "last" else h[0]
            if normalize:
                v = v / max(float(np.linalg.norm(v)), 1e-12)
            out[i] = v
        self.reset()
        return out

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits at every position of ``tokens``, from a fresh context, as one prefill."""
        self.reset()
        return np.asarray(self.step(tokens, last_only=False), dtype=np.float32)

    # -- generation ----------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 seed: int | None = None, stop: Sequence[str] = (), stream: bool = False,
                 reuse_cache: bool = False, grammar=None):
        """Generate text after ``prompt`` (text, or token ids); greedy when temperature is 0.

        ``grammar`` (a ``ggraph.runtime.grammar.Grammar``: a JSON schema, any JSON object or a GBNF
        grammar) masks every step's logits to the tokens that keep the output inside it; generation
        then ends when the grammar is complete ("eog").

        ``max_tokens=-1`` generates until the end of text or a full context. Generation also ends at a
        full context; ``stats["stop"]`` says why it ended: "eog", "stop", "length" or "context".
        With ``reuse_cache`` the tokens the prompt shares with the cached context are kept and only
        the rest is prefilled (``stats["cached_tokens"]``), as a conversation's next turn is.
        """
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < -1:
            raise ValueError(f"max_tokens must be a whole number >= -1 (-1: until the end of text), got {max_tokens!r}")
        sampler = Sampler(temperature, top_k, top_p, min_p, repeat_penalty)
        stop = stop_strings(stop)
        if grammar is not None and not hasattr(grammar, "matcher"):
            raise TypeError(f"grammar must be a ggraph.runtime.grammar.Grammar, got {type(grammar).__name__}")
        if isinstance(prompt, str):
            try:
                self.tokenizer.check_fits(prompt, self.ctx)
            except ValueError as e:
                raise ContextFullError(f"{e}; start a new Session with a larger ctx") from None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else token_ids(prompt, self.config.n_vocab).tolist()
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        if len(ids) > self.ctx:
            raise ContextFullError(f"context full: the prompt is {len(ids)} tokens > ctx={self.ctx}; "
                                   "start a new Session with a larger ctx")
        if grammar is not None and grammar.tokenizer is not self.tokenizer:
            raise ValueError("the grammar was compiled for another tokenizer than this session's")
        matcher = grammar.matcher() if grammar is not None else None
        pieces = self._generate(ids, int(max_tokens), sampler, seed, tuple(stop), reuse_cache, matcher)
        return pieces if stream else "".join(pieces)

    def _keep_prefix(self, ids: list) -> int:
        """Truncate the cache to its longest common prefix with ``ids``, leaving at least one id to run."""
        n = 0
        for a, b in zip(self.seq.cached, ids[:-1]):
            if a != b:
                break
            n += 1
        self.truncate(n)
        return n

    def _generate(self, ids, max_tokens, sampler, seed, stop, reuse_cache, matcher=None) -> Iterator[str]:
        from ggraph.runtime.generation import Generation
        gen = Generation(self.tokenizer, ids, max_tokens, sampler, seed, stop, matcher)
        self.seq.recomputed = 0
        kept = self._keep_prefix(ids) if reuse_cache else 0
        if not reuse_cache:
            self.reset()
        self.program(last_only=True)                       # compile (or load) before the clock starts
        t0 = time.perf_counter()
        logits = self.step(ids[kept:])[-1]
        self.stats = {"prompt_tokens": len(ids) - kept, "cached_tokens": kept, "prompt_s": time.perf_counter() - t0,
                      "generated_tokens": 0, "generate_s": 0.0, "stop": "length",
                      "recomputed_tokens": self.seq.recomputed}   # run again to rebuild recurrent states
        while True:
            piece, tok = gen.feed(logits, room=self.seq.n_past < self.ctx)
            self.stats["generated_tokens"], self.stats["stop"] = gen.generated, gen.stop or "length"
            if piece:
                yield piece
            if tok is None:
                return
            t = time.perf_counter()
            logits = self.step([tok])[-1]
            self.stats["generate_s"] += time.perf_counter() - t

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, **template_vars) -> list[int]:
        """The token ids of ``messages`` rendered by the model's chat template (one BOS, as the model wants)."""
        check_messages(messages)
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    **template_vars)
        return self.tokenizer.encode(prompt, add_special=not _starts_with_bos(prompt, self.tokenizer))

    def chat(self, messages: list[dict], **kwargs):
        """Render ``messages`` with the model's chat template and generate the reply."""
        return self.generate(self.chat_ids(messages), **kwargs)


class Sequence:
    """One sequence's context: its KV caches, recurrent states and their snapshots, and the token ids
    they hold. ``run`` steps a compiled single-sequence program over them; Session holds one, and a
    Batch of a model without a batched step one per slot."""

    def __init__(self, k_cache: list, v_cache: list, states: list, ubatch: int = UBATCH):
        self.k_cache, self.v_cache, self.states, self.ubatch = k_cache, v_cache, states, ubatch
        self.n_past = 0
        self.cached: list[int] = []                       # the ids whose keys and values the cache holds
        self.snapshots: list[tuple[int, list[np.ndarray]]] = []      # (n_past, states), oldest first
        self.recomputed = 0                               # tokens the last truncate ran again

    def run(self, prog, tokens: np.ndarray) -> list:
        """Run ``tokens`` after the context in ubatches (bounded activations for a long prompt): each
        ubatch's first output (logits, or hidden states)."""
        out = []
        for at in range(0, tokens.size, self.ubatch):
            part = tokens[at:at + self.ubatch]
            first, = prog.run_inputs([part, np.int32(self.n_past), *self.k_cache, *self.v_cache, *self.states],
                                     first=1)
            self.n_past += part.size
            self.cached += part.tolist()
            out.append(first)
        self._snapshot(tokens.size)
        return out

    def reset(self) -> None:
        self.n_past = 0
        self.cached = []
        for a in self.states:
            a.fill(0)
        self.snapshots = []

    def truncate(self, n: int, program) -> None:
        """Keep the first ``n`` tokens; ``program()`` gives the step that re-runs tokens to rebuild states."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self.n_past:
            raise ValueError(f"truncate: n must be a whole number in 0..{self.n_past} (the tokens in the cache), "
                             f"got {n!r}")
        self.recomputed = 0
        if self.states and n < self.n_past:
            self._rewind(int(n), program)
            return
        self.n_past = int(n)
        del self.cached[self.n_past:]

    def _rewind(self, n: int, program) -> None:
        """The states (and KV rows) at ``n`` tokens: restore the newest snapshot at or before ``n`` (else
        zeros) and run the cached tokens from there to ``n`` again."""
        self.snapshots = [snap for snap in self.snapshots if snap[0] <= n]
        at, saved = self.snapshots[-1] if self.snapshots else (0, None)
        for i, a in enumerate(self.states):
            if saved is None:
                a.fill(0)
            else:
                np.copyto(a, saved[i])
        redo = np.asarray(self.cached[at:n], dtype=np.int32)
        self.n_past = at
        del self.cached[at:]
        if redo.size:
            self.run(program(), redo)
        self.recomputed = int(redo.size)

    def _snapshot(self, tokens: int) -> None:
        """After a step of ``tokens``: keep the states at this position if the step was a prefill, or
        SNAPSHOT_EVERY tokens have passed since the last snapshot (the oldest goes beyond MAX_SNAPSHOTS)."""
        last = self.snapshots[-1][0] if self.snapshots else 0
        if not self.states or self.n_past == last or (tokens == 1 and self.n_past - last < SNAPSHOT_EVERY):
            return
        if len(self.snapshots) < MAX_SNAPSHOTS:
            saved = [a.copy() for a in self.states]
        else:                                             # reuse the oldest snapshot's arrays
            saved = self.snapshots.pop(0)[1]
            for dst, a in zip(saved, self.states):
                np.copyto(dst, a)
        self.snapshots.append((self.n_past, saved))


def cache_dtype(name, what: str = "cache type"):
    """A KV cache element type by name: one of CACHE_TYPES."""
    from ggraph.ir import dtypes
    if not isinstance(name, str) or name.lower() not in CACHE_TYPES:
        raise ValueError(f"{what} must be one of {', '.join(CACHE_TYPES)}, got {name!r}")
    return dtypes.from_name(name.lower())


def kv_caches(model, rows: int, cache_types, max_memory, what: str) -> tuple[list, list]:
    """Zeroed K and V caches of ``rows`` rows for every layer with attention (``model.kv_layers``), checked
    against the memory there is first with one sequence's recurrent states; ``what`` says how the rows
    come about (e.g. "ctx 4096")."""
    check_memory(model, rows, cache_types, max_memory, what)
    return empty_caches(model, rows, cache_types)


def check_memory(model, rows: int, cache_types, max_memory, what: str, sequences: int = 1) -> None:
    """MemoryBudgetError unless ``sequences`` sequences' KV caches of ``rows`` rows and recurrent states
    (with room for their snapshots) fit the budget."""
    from ggraph import memory
    n = len(model.kv_layers)
    one = state_bytes(model)
    states = sequences * (1 + MAX_SNAPSHOTS) * one
    held = f"recurrent states ({sequences} × {one} bytes, with up to {MAX_SNAPSHOTS} snapshots each)"
    if not n:
        memory.check(states, f"the {held}", max_memory)
        return
    k_aval, v_aval = model.kv_avals(rows, cache_types)
    memory.check(sequences * n * (k_aval.nbytes({}) + v_aval.nbytes({})) + states,
                 f"the KV cache ({what} × {n} layers × {k_aval.shape[1]} kv heads × "
                 f"({k_aval.shape[2]} {k_aval.dtype} + {v_aval.shape[2]} {v_aval.dtype}))"
                 + (f" and {held}" if one else ""), max_memory)


def empty_caches(model, rows: int, cache_types) -> tuple[list, list]:
    """Zeroed K and V caches of ``rows`` rows for the layers with attention, unchecked."""
    if not model.kv_layers:
        return [], []
    k_aval, v_aval = model.kv_avals(rows, cache_types)
    n = len(model.kv_layers)
    return [cache_array(k_aval) for _ in range(n)], [cache_array(v_aval) for _ in range(n)]


def state_bytes(model) -> int:
    """Bytes of one sequence's recurrent states."""
    return sum(a.nbytes({}) for layer in model.state_avals() for a in layer.values())


def state_arrays(model) -> list[np.ndarray]:
    """One sequence's recurrent states, zeroed, flat in the order the step graph takes them."""
    return [np.zeros(a.shape, a.dtype.np_dtype) for layer in model.state_avals() for a in layer.values()]


def cache_array(aval) -> np.ndarray:
    """Zeroed storage for a cache of ``aval``: its numpy dtype, or uint8 block bytes (rows, row bytes)."""
    if aval.dtype.np_dtype is not None:
        return np.zeros(aval.shape, aval.dtype.np_dtype)
    return np.zeros((aval.shape[0], aval.shape[1], aval.dtype.row_bytes(aval.shape[2])), np.uint8)


def token_ids(tokens, n_vocab: int) -> np.ndarray:
    """Token ids as i32, checked: integers (no floats, strings or bools), each in [0, n_vocab), no wrap-around."""
    if isinstance(tokens, np.ndarray):
        flat = tokens.reshape(-1)
        if flat.size and (flat.dtype.kind not in "iu" or flat.dtype == np.bool_):
            raise TypeError(f"token ids must be integers, got an array of {flat.dtype}")
        bad = np.flatnonzero((flat < 0) | (flat >= n_vocab))
        if bad.size:
            raise ValueError(f"token id {flat[bad[0]]} is outside the vocabulary (n_vocab={n_vocab})")
        return flat.astype(np.int32)
    if not isinstance(tokens, (int, np.integer)) and not hasattr(tokens, "__iter__"):
        raise TypeError(f"token ids must be an integer or a sequence of integers, got {type(tokens).__name__}")
    items = [tokens] if isinstance(tokens, (int, np.integer)) else list(tokens)
    for t in items:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"token ids must be integers, got {type(t).__name__} {t!r}")
        if not 0 <= int(t) < n_vocab:
            raise ValueError(f"token id {int(t)} is outside the vocabulary (n_vocab={n_vocab})")
    return np.array(items, np.int32).reshape(-1)


def check_messages(messages) -> None:
    """A chat is a list of messages, each a dict with a string ``role`` (its content is the template's to read)."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TypeError(f"message {i} must be a dict with a string 'role', got {m!r}"[:200])


def stop_strings(stop) -> tuple[str, ...]:
    """``stop`` as a tuple of strings: None is none, and one string is one stop string (not its characters)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not hasattr(stop, "__iter__") or not all(isinstance(x, str) for x in stop):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}"[:200])
    return tuple(stop)


def _starts_with_bos(text: str, tok) -> bool:
    bos = tok.bos_id
    return bos is not None and bos >= 0 and text.startswith(tok.token_text(bos))
