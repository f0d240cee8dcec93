"""A small progress bar for long work, written to stderr and silent when it is not a terminal."""
from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "label") as bar: bar.advance(n)``"""

    def __init__(self, total: float, label: str, unit: str = "", stream=None, width: int = 30):
        self.total, self.label, self.unit, self.width = max(total, 1), label, unit, width
        self.stream = stream or sys.stderr
        self.done = 0.0
        self.start = time.perf_counter()
        self.last = 0.0
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()

    def advance(self, n: float = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.live and (now - self.last > 0.1 or self.done >= self.total):
            self.last = now
            self._draw()

    def _fmt(self, x: float) -> str:
        if self.unit == "B":
            return f"{x / 1e6:.0f} MB"
        return f"{x:.0f}{self.unit}"

    def _draw(self):
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * self.width)
        self.stream.write(f"\r{self.label} [{bar:<{self.width}}] {frac:4.0%} "
                          f"{self._fmt(self.done)}/{self._fmt(self.total)}")
        self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.live:
            self._draw()
            self.stream.write(f"  {time.perf_counter() - self.start:.1f}s\n")
            self.stream.flush()
