"""How much memory a request may take, checked before it is allocated.

The budget is the memory this machine has available now (``MemAvailable`` in /proc/meminfo,
else its physical memory), or a user's limit (``--max-memory 8G``, ``Session(max_memory=...)``),
whichever is smaller. A KV cache or an activation arena that does not fit is a
``MemoryBudgetError`` that says how much it needs and what it is for, before any of it is
allocated: a lying block count or an enormous ``--ctx`` never reaches the OOM killer.
"""
from __future__ import annotations

import os
import re

from ggraph.units import fmt_bytes

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


class MemoryBudgetError(MemoryError, ValueError):
    """A request needs more memory than the budget allows; the message says how much and for what."""


def parse_size(text) -> int:
    """``"8G"``, ``"512 MiB"``, ``"1e9"`` or an int -> bytes; anything else is a ValueError naming it."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or not 0 < float(m.group(1)) * _UNITS[m.group(2).lower()] < 2 ** 63:
        raise ValueError(f"memory size {text!r}: give a positive number of bytes below 8 EiB, optionally with K, M, "
                         f"G or T")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"memory size {text!r}: that is less than one byte")
    return n


def available() -> int:
    """Bytes this process could allocate now: MemAvailable (else physical memory), and no more than its
    cgroup's memory.max leaves or its address-space limit (RLIMIT_AS) leaves: a container or a
    ``ulimit -v`` is the machine this process has."""
    return min(_system_available(), _cgroup_left(), _rlimit_left())


def _system_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62                                     # unknown: no limit but the user's


def _cgroup_left() -> int:
    """cgroup v2 memory.max - memory.current of this process's cgroup (unlimited: a huge number)."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is None:
            return 1 << 62
        folder = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(folder, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return 1 << 62
        with open(os.path.join(folder, "memory.current")) as f:
            return max(int(limit) - int(f.read().strip()), 0)
    except (OSError, ValueError, IndexError):
        return 1 << 62


def _rlimit_left() -> int:
    """RLIMIT_AS less the address space this process maps now (unlimited: a huge number)."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft == resource.RLIM_INFINITY:
            return 1 << 62
        with open("/proc/self/status") as f:
            vm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))
        return max(soft - vm, 0)
    except (OSError, ValueError, StopIteration, ImportError):
        return 1 << 62


def check(nbytes: int, what: str, limit: int | None = None) -> None:
    """Raise MemoryBudgetError unless ``nbytes`` (for ``what``) fits the budget."""
    free = available()
    if limit and limit < free:
        if nbytes > limit:
            raise MemoryBudgetError(f"{what} needs {fmt_bytes(nbytes)}, more than the --max-memory limit of "
                                    f"{fmt_bytes(limit)}")
    elif nbytes > free:
        raise MemoryBudgetError(f"{what} needs {fmt_bytes(nbytes)}, more than the {fmt_bytes(free)} this machine "
                                f"has available")
