"""The serving engine: a request queue, ``parallel`` slots (a Session each: its own KV cache, one
copy of the weights in the shared mmap and one compiled program), and one scheduler thread.

    engine = Engine(lambda: Session(path, ctx=4096), parallel=4)
    job = engine.submit(ids, dict(max_tokens=64, temperature=0), emit)   # emit(kind, value), any thread
    job.cancel()                                                           # e.g. the client went away

The scheduler admits waiting jobs into free slots between steps and then gives every active
slot one turn: the first turn prefills the prompt and samples a token, each later one decodes a
token (an embedding job embeds one of its texts a turn). A job leaves its slot when it
finishes, fails or is cancelled, and the next waiting job takes the slot at once. Every slot's step is its own native program call: the slots take turns,
they are not yet batched into one step.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Callable

FINISH = {"eog": "stop", "stop": "stop", "length": "length", "context": "length"}   # Session stop -> OpenAI


class Overloaded(RuntimeError):
    """Every slot is busy and the waiting queue is full."""


@dataclasses.dataclass
class Job:
    """One request: prompt ids, Session.generate keywords, and where its pieces go."""
    id: int
    ids: list[int]
    options: dict
    emit: Callable[[str, object], None]       # ("piece", text) ... then ("done", info) or ("error", message)
    kind: str = "generate"                    # or "embed": ids is then a list of texts' ids, options {pooling}
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


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


class Engine:
    """Slots, a bounded queue, and the scheduler thread that steps them."""

    def __init__(self, make_session: Callable[[], object], parallel: int = 1, queue: int | None = None):
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel must be a whole number of slots >= 1, got {parallel!r}")
        self.slots = [make_session() for _ in range(parallel)]
        for s in self.slots[1:]:
            s.tokenizer = self.slots[0].tokenizer         # one file, one tokenizer: grammars compile once for all
        for s in self.slots:
            s.program(last_only=True)                  # compiled (once: the slots share it) before serving
        self.ctx = self.slots[0].ctx
        self.queue_limit = 4 * parallel if queue is None else queue    # requests that may wait for a busy slot
        self.metrics = Metrics()
        self._ids = itertools.count(1)
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: dict[int, tuple] = {}           # slot index -> (job, its generator, embeddings so far)
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ggraph-scheduler", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.slots[0].tokenizer

    # -- requests ------------------------------------------------------------------------
    def submit(self, ids: list, options: dict, emit, kind: str = "generate") -> Job:
        """Queue a job; Overloaded when the queue is full. Every prompt (an embed job has a list of them)
        must fit a slot's context."""
        for one in ids if kind == "embed" else [ids]:
            if not one:
                raise ValueError("the prompt encodes to no tokens")
            if len(one) > self.ctx:
                raise ValueError(f"the prompt is {len(one)} tokens, more than the context of {self.ctx} tokens a slot has")
        with self._wake:
            if self._closed:
                raise Overloaded("the server is shutting down")
            if kind not in ("generate", "embed"):
                raise ValueError(f"unknown job kind {kind!r}")
            free = len(self.slots) - len(self._active)
            if len(self._waiting) >= self.queue_limit + free:
                raise Overloaded(f"all {len(self.slots)} slots are busy and {len(self._waiting)} requests wait; "
                                 "try again shortly")
            job = Job(next(self._ids), list(ids), dict(options), emit, kind)
            self._waiting.append(job)
            self.metrics.requests += 1
            self._wake.notify()
        return job

    def status(self) -> dict:
        """Queue depth, busy slots and KV rows in use, for /metrics and /health."""
        with self._wake:
            active = dict(self._active)
            return {"waiting": len(self._waiting), "active": len(active), "slots": len(self.slots),
                    "kv_used": sum(self.slots[i].n_past for i in active), "kv_capacity": len(self.slots) * self.ctx}

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # -- the scheduler ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._active:
                    self._wake.wait()
                if self._closed:
                    for job, gen, _ in self._active.values():
                        gen.close()
                        job.emit("error", "the server is shutting down")
                    for job in self._waiting:
                        job.emit("error", "the server is shutting down")
                    return
                self._admit()
                turns = list(self._active.items())
            for slot, (job, gen, done) in turns:
                self._turn(slot, job, gen, done)

    def _admit(self) -> None:
        free = [i for i in range(len(self.slots)) if i not in self._active]
        while free and self._waiting:
            job = self._waiting.popleft()
            if job.cancelled:
                self.metrics.cancelled += 1
                continue
            slot = free.pop(0)
            session = self.slots[slot]
            if job.kind == "embed":                        # one text a turn
                gen = (session.embed([ids], **job.options)[0] for ids in job.ids)
            else:
                gen = session.generate(job.ids, stream=True, **job.options)
            self._active[slot] = (job, gen, [])

    def _turn(self, slot: int, job: Job, gen, done: list) -> None:
        """One token (the first turn: the prompt and one token) of the job in ``slot``; for an embed
        job, one text's vector (kept in ``done`` until the last)."""
        session = self.slots[slot]
        if job.cancelled:
            gen.close()
            self._leave(slot)
            self.metrics.cancelled += 1
            return
        try:
            piece = next(gen)
        except StopIteration:
            if job.kind == "embed":
                self._leave(slot)
                self.metrics.finished += 1
                self.metrics.prompt_tokens += sum(map(len, job.ids))
                job.emit("done", {"embeddings": done, "prompt_tokens": sum(map(len, job.ids))})
                return
            st = session.stats
            self._leave(slot)
            m = self.metrics
            m.finished += 1
            m.prompt_tokens += st["prompt_tokens"]
            m.generated_tokens += st["generated_tokens"]
            m.prompt_seconds += st["prompt_s"]
            m.generate_seconds += st["generate_s"]
            job.emit("done", {"finish_reason": FINISH[st["stop"]], "prompt_tokens": len(job.ids),
                              "completion_tokens": st["generated_tokens"]})
        except Exception as e:                         # a bad request that passed the checks, or our bug
            self._leave(slot)
            self.metrics.failed += 1
            job.emit("error", f"{type(e).__name__}: {e}")
        else:
            if job.kind == "embed":
                done.append(piece)
            else:
                job.emit("piece", piece)

    def _leave(self, slot: int) -> None:
        with self._wake:
            self._active.pop(slot, None)
