"""emulator.setup under concurrent use, with a stand-in build (no network): two setups at once build
once; a rebuild swaps the tree in whole, so a process reading it meanwhile never sees half of one; a
build that fails leaves the tree that was there. The real build under the same lock and swap is checked
by hand (docs/arm.md)."""
import subprocess
import sys
import time
from pathlib import Path

ARM = Path(__file__).parent

# a stand-in for emulator._build: a tree of FILES files, each holding the build's id, written slowly
FAKE = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {arm!r})
import emulator

def build(root, log):
    root.mkdir(parents=True)
    with open({builds!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    for i in range({files}):
        (root / f"part{{i}}").write_text(str(os.getpid()))
        time.sleep(0.05)
    if os.environ.get("FAIL"):
        raise emulator.Unavailable("stand-in failure")
    (root / "ready").write_text(emulator._versions())

emulator._build = build
try:
    print(emulator.setup(Path({root!r}), log=lambda *a: None, rebuild=bool(os.environ.get("REBUILD"))))
except emulator.Unavailable as e:
    sys.exit(f"unavailable: {{e}}")
"""
FILES = 20

# reads the tree by path over and over, as a running guest finds its files, until it has seen two builds
# (or `seconds` pass): every part and the ready stamp there and whole at every moment
READER = """
import sys, time
from pathlib import Path
root, until, seen = Path({root!r}), time.time() + {seconds}, set()
while time.time() < until and len(seen) < 2:
    for i in range({files}):
        seen.add((root / f"part{{i}}").read_text())
    assert (root / "ready").exists()
print(len(seen), min(map(len, seen)))
"""


def _setup(tmp_path, **env):
    code = FAKE.format(arm=str(ARM), builds=str(tmp_path / "builds"), files=FILES, root=str(tmp_path / "env"))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**_env(), **env})


def _env():
    import os
    return {k: v for k, v in os.environ.items() if k not in ("REBUILD", "FAIL")}


def _done(p) -> str:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return out.strip()


def _builds(tmp_path) -> int:
    return len((tmp_path / "builds").read_text().split())


def test_two_setups_at_once_build_once(tmp_path):
    a, b = _setup(tmp_path), _setup(tmp_path)
    assert _done(a) == _done(b) == str(tmp_path / "env")
    assert _builds(tmp_path) == 1
    assert _done(_setup(tmp_path)) == str(tmp_path / "env") and _builds(tmp_path) == 1    # ready: no build
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builds", "env", "env.lock"]    # no build folder left


def test_a_rebuild_never_shows_a_reader_half_a_tree(tmp_path):
    _done(_setup(tmp_path))
    reader = subprocess.Popen([sys.executable, "-c", READER.format(root=str(tmp_path / "env"), seconds=120,
                                                                    files=FILES)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    _done(_setup(tmp_path, REBUILD="1"))
    seen, shortest = _done(reader).split()
    assert seen == "2" and int(shortest) > 0         # it found the first build's files, then the second's
    assert _builds(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builds", "env", "env.lock"]


def test_a_failed_rebuild_keeps_the_tree(tmp_path):
    first = _done(_setup(tmp_path))
    before = (tmp_path / "env" / "part0").read_text()
    p = _setup(tmp_path, REBUILD="1", FAIL="1")
    p.communicate(timeout=120)
    assert p.returncode != 0
    assert (tmp_path / "env" / "part0").read_text() == before and (tmp_path / "env" / "ready").exists()
    assert _done(_setup(tmp_path)) == first and _builds(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builds", "env", "env.lock"]
