"""The serving engine: a request queue, a Batch of ``parallel`` sequence slots (slotted KV caches and
two compiled batched steps: one for steps slots share, one for a slot alone, as a Session's), and one
scheduler thread: continuous batching.

    engine = Engine(path, parallel=4, ctx=4096, threads=2)
    job = engine.submit(ids, dict(max_tokens=64, temperature=0), emit)   # emit(kind, value), any thread
    job.cancel()                                                           # e.g. the client went away
    engine.close()                  # every job still running or waiting ends with an error, now

Between steps the scheduler admits waiting jobs into free slots and drops finished or cancelled
ones. Each step then runs, in one native call, every active slot's new tokens: a chunk of a
prompt still being prefilled, or the one token a decoding slot sampled last. A slot whose
prompt is done samples from its row of the step's logits. Embedding jobs run between steps on
a Session of their own.

A model without a batched step (an architecture with a forward of its own, e.g. with recurrent
layers) is served by a sequential Batch: the step runs each active slot's tokens one slot after
the other, each slot with its own KV caches and recurrent states, so each request gets the text
it gets alone; slots then share the scheduler, not the weight reads.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Callable

import numpy as np

from ggraph.progress import held_warnings
from ggraph.runtime.batch import Batch
from ggraph.runtime.generation import Generation

FINISH = {"eog": "stop", "stop": "stop", "length": "length", "context": "length"}   # why it ended -> OpenAI


class SoloBatch(Batch):
    """A Batch whose steps of one sequence alone run without ``rows_only``, as a Session's steps do (a
    decode token through the gemv, a prompt chunk through the gemm), so a request served alone gets
    ``ggraph run``'s text to the bit. A step that several sequences share keeps ``rows_only``: there a
    token's result does not depend on which others share it (the gemv and the rows gemm round apart)."""
    _alone, _solo = False, None

    def step(self, work: dict) -> dict[int, np.ndarray]:
        self._alone = len(work) == 1
        return super().step(work)

    def program(self):
        if not self._alone or self.sequential:              # a sequential batch steps each slot alone already
            return super().program()
        if self._solo is None:
            from ggraph.compiler import compile_graph
            options = {"threads": self.threads, "max_memory": self.max_memory} if self.backend != "numpy" else {}
            self._solo = compile_graph(self.model.batch_graph(self.slots, self.ctx, self.cache_types),
                                       backend=self.backend, passes=self.passes,
                                       weights=self.model.file, **options)
        return self._solo

    def compile(self) -> None:
        """Both programs, before serving."""
        for self._alone in (True, False):
            self.program()


class Overloaded(RuntimeError):
    """Every slot is busy and the waiting queue is full."""


@dataclasses.dataclass
class Job:
    """One request: prompt ids, Session.generate keywords, and where its pieces go."""
    id: int
    ids: list
    options: dict
    emit: Callable[[str, object], None]       # ("piece", text) ... then ("done", info) or ("error", message)
    kind: str = "generate"                    # or "embed": ids is then a list of texts' ids, options {pooling}
    _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclasses.dataclass
class _Running:
    """A generate job in its slot: what of its prompt is still to prefill, its sampling state."""
    job: Job
    gen: Generation
    pending: list                              # prompt ids not yet run
    started: float
    first: float | None = None                 # when its first token was sampled
    next_token: int | None = None


@dataclasses.dataclass
class Metrics:
    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_seconds: float = 0.0
    generate_seconds: float = 0.0
    steps: int = 0
    step_tokens: int = 0


class Engine:
    """Slots of one Batch, a bounded queue, and the scheduler thread that steps them together."""

    def __init__(self, path, parallel: int = 1, ctx: int = 4096, queue: int | None = None, **options):
        from ggraph.runtime.session import Session
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel must be a whole number of slots >= 1, got {parallel!r}")
        with held_warnings():                                      # an error (the slots' caches) stands alone
            self.session = Session(path, ctx=ctx, **options)      # templates, tokenizer, embeddings
            self.batch = SoloBatch(path, slots=parallel, ctx=ctx, model=self.session.model, **options)
        self.batch.tokenizer = self.session.tokenizer             # one tokenizer: grammars compile once
        self.batch.compile()                                       # before serving
        self.parallel, self.ctx = parallel, ctx
        self.queue_limit = 4 * parallel if queue is None else queue    # requests that may wait for a busy slot
        self.metrics = Metrics()
        self._ids = itertools.count(1)
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: dict[int, _Running] = {}
        self._embedding: list[Job] = []                        # embed jobs the scheduler is running now
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ggraph-scheduler", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def alive(self) -> bool:
        """Open, and its scheduler thread running: what a Ray Serve replica's health check asks."""
        return not self._closed and self._thread.is_alive()

    @property
    def tokenizer(self):
        return self.session.tokenizer

    # -- requests ------------------------------------------------------------------------
    def submit(self, ids: list, options: dict, emit, kind: str = "generate") -> Job:
        """Queue a job; Overloaded when the queue is full. Every prompt (an embed job has a list of them)
        must fit a slot's context."""
        if kind not in ("generate", "embed"):
            raise ValueError(f"unknown job kind {kind!r}")
        for one in ids if kind == "embed" else [ids]:
            if not one:
                raise ValueError("the prompt encodes to no tokens")
            if len(one) > self.ctx:
                raise ValueError(f"the prompt is {len(one)} tokens, more than the context of {self.ctx} tokens a slot has")
        with self._wake:
            if self._closed:
                raise Overloaded("the server is shutting down")
            free = self.parallel - len(self._active)
            if len(self._waiting) >= self.queue_limit + free:
                raise Overloaded(f"all {self.parallel} slots are busy and {len(self._waiting)} requests wait; "
                                 "try again shortly")
            job = Job(next(self._ids), list(ids), dict(options), emit, kind)
            self._waiting.append(job)
            self.metrics.requests += 1
            self._wake.notify()
        return job

    def status(self) -> dict:
        """Queue depth, busy slots and KV rows in use, for /metrics and /health."""
        with self._wake:
            active = list(self._active)
            return {"waiting": len(self._waiting), "active": len(active), "slots": self.parallel,
                    "kv_used": sum(self.batch.n_past[i] for i in active), "kv_capacity": self.parallel * self.ctx}

    def close(self, wait: float = 1.0) -> None:
        """Refuse new jobs and end every running and waiting one now with an error; then wait up to
        ``wait`` seconds for the scheduler to finish the step it is in (it emits nothing more)."""
        with self._wake:
            if not self._closed:
                self._closed = True
                for job in [run.job for run in self._active.values()] + self._embedding + list(self._waiting):
                    job.cancel()
                    job.emit("error", "the server is shutting down")
                self._waiting.clear()
                self._wake.notify()
        self._thread.join(timeout=wait)

    def _send(self, job: Job, kind: str, value) -> None:
        """Pass a job's piece, end or error on, unless close() has already ended it."""
        with self._wake:
            if not self._closed:
                job.emit(kind, value)

    # -- the scheduler ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._active:
                    self._wake.wait()
                if self._closed:
                    return                              # close() has ended every job
                embeds = self._embedding = self._admit()
            for job in embeds:
                self._embed(job)
            with self._wake:
                self._embedding = []
            self._drop_cancelled()
            if self._active:
                self._step()

    def _admit(self) -> list[Job]:
        """Waiting generate jobs into free slots (embed jobs are returned, to run now)."""
        embeds, free = [], [i for i in range(self.parallel) if i not in self._active]
        while self._waiting and (free or self._waiting[0].kind == "embed"):
            job = self._waiting.popleft()
            if job.cancelled:
                self.metrics.cancelled += 1
            elif job.kind == "embed":
                embeds.append(job)
            else:
                try:
                    gen = self._generation(job)
                except Exception as e:                 # a grammar that fails to start, say
                    self.metrics.failed += 1
                    self._send(job, "error", f"{type(e).__name__}: {e}")
                    continue
                slot = free.pop(0)
                self.batch.reset(slot)
                self._active[slot] = _Running(job, gen, list(job.ids), time.perf_counter())
        return embeds

    def _generation(self, job: Job) -> Generation:
        from ggraph.runtime.sampling import Sampler
        o = job.options
        sampler = Sampler(**{f: o[f] for f in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty") if f in o})
        grammar = o.get("grammar")
        return Generation(self.tokenizer, job.ids, o.get("max_tokens", -1), sampler, o.get("seed"), o.get("stop", ()),
                          grammar.matcher() if grammar is not None else None)

    def _drop_cancelled(self) -> None:
        with self._wake:
            for slot in [s for s, run in self._active.items() if run.job.cancelled]:
                del self._active[slot]
                self.metrics.cancelled += 1

    def _step(self) -> None:
        """One batched step: each decoding slot's token, then prompt chunks in the room that is left."""
        budget = self.batch.ubatch
        work = {}
        for slot, run in self._active.items():
            if not run.pending:
                work[slot] = [run.next_token]
                budget -= 1
        for slot, run in self._active.items():
            if run.pending and budget > 0:
                work[slot] = run.pending[:budget]
                budget -= len(work[slot])
        try:
            out = self.batch.step(work)
        except Exception as e:                          # our bug, or memory: fail the jobs in this step
            for slot in work:
                self._fail(slot, e)
            return
        m = self.metrics
        m.steps += 1
        m.step_tokens += sum(map(len, work.values()))
        for slot, ids in work.items():
            if self._closed:
                return                                  # close() has ended every job
            run = self._active[slot]
            if run.pending:
                run.pending = run.pending[len(ids):]
                if run.pending:
                    continue                            # more of the prompt to prefill
            try:
                piece, tok = run.gen.feed(out[slot], room=self.batch.n_past[slot] < self.ctx)
            except Exception as e:
                self._fail(slot, e)
                continue
            now = time.perf_counter()
            if run.first is None:
                run.first = now
                m.prompt_seconds += now - run.started
                m.prompt_tokens += len(run.job.ids)
            if piece:
                self._send(run.job, "piece", piece)
            if tok is None:
                self._finish(slot, run, now)
            else:
                run.next_token = tok

    def _finish(self, slot: int, run: _Running, now: float) -> None:
        with self._wake:
            self._active.pop(slot, None)
        m = self.metrics
        m.finished += 1
        m.generated_tokens += run.gen.generated
        m.generate_seconds += now - run.first
        self._send(run.job, "done", {"finish_reason": FINISH[run.gen.stop], "prompt_tokens": len(run.job.ids),
                                     "completion_tokens": run.gen.generated})

    def _fail(self, slot: int, e: Exception) -> None:
        with self._wake:
            run = self._active.pop(slot, None)
        self.metrics.failed += 1
        if run is not None:
            self._send(run.job, "error", f"{type(e).__name__}: {e}")

    def _embed(self, job: Job) -> None:
        try:
            vectors = [self.session.embed([ids], **job.options)[0] for ids in job.ids if not job.cancelled]
        except Exception as e:
            self.metrics.failed += 1
            self._send(job, "error", f"{type(e).__name__}: {e}")
            return
        if job.cancelled:
            self.metrics.cancelled += 1
            return
        n = sum(map(len, job.ids))
        self.metrics.finished += 1
        self.metrics.prompt_tokens += n
        self._send(job, "done", {"embeddings": vectors, "prompt_tokens": n})
