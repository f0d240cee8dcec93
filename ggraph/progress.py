"""What long work tells the user on stderr: a progress bar (silent when stderr is not a terminal),
and one-line warnings."""
from __future__ import annotations

import contextlib
import sys
import time

from ggraph.units import fmt_bytes


class Progress:
    """``with Progress(total, "label") as bar: bar.advance(n)``

    ``unit="B"`` shows byte counts; any other unit follows the counts ("3/40 kernels").
    With ``delay`` the bar appears only once the work has taken that many seconds (counted
    from ``start``, a ``time.perf_counter()`` value, when the work began earlier), so quick
    work prints nothing."""

    def __init__(self, total: float, label: str, unit: str = "", stream=None, width: int = 30, delay: float = 0.0,
                 start: float | None = None):
        self.total, self.label, self.unit, self.width = max(total, 1), label, unit, width
        self.stream = stream or sys.stderr
        self.done = 0.0
        self.start = time.perf_counter() if start is None else start      # the delay counts from here
        self.last = 0.0
        self.delay = delay
        self.shown = False
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()

    def advance(self, n: float = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.live and now - self.start >= self.delay and (now - self.last > 0.1 or self.done >= self.total):
            self.last = now
            self._draw()

    def _count(self) -> str:
        if self.unit == "B":
            return f"{fmt_bytes(self.done)}/{fmt_bytes(self.total)}"
        return f"{self.done:.0f}/{self.total:.0f}{self.unit}"

    def _draw(self):
        self.shown = True
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * self.width)
        self.stream.write(f"\r{self.label} [{bar:<{self.width}}] {frac:4.0%} {self._count()}")
        self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.live and (self.shown or time.perf_counter() - self.start >= self.delay):
            self._draw()
            self.stream.write(f"  {time.perf_counter() - self.start:.1f}s\n")
            self.stream.flush()


_warned: set[str] = set()
_held: list[list[str]] = []            # warnings held back by `held_warnings`, innermost last


def warn(message: str, once: bool = True) -> None:
    """One line on stderr, ``ggraph: warning: ...``; a message already shown is not repeated."""
    if once and message in _warned:
        return
    _warned.add(message)
    if _held:
        _held[-1].append(message)
        return
    print(f"ggraph: warning: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def held_warnings():
    """Warnings given inside are shown when the block succeeds and dropped when it raises, so that an
    error stands alone (a KV cache that fits, then a second one that does not)."""
    _held.append([])
    try:
        yield
    except BaseException:
        _held.pop()
        raise
    for message in _held.pop():
        _warned.discard(message)
        warn(message)
