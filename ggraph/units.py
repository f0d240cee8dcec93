"""Sizes as people read them: the one byte formatter every report and picture uses."""
from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """``512 B``, ``223.71 KiB``, ``235.20 MiB``, ``1.20 GiB`` (binary units, as llama.cpp prints them)."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")
