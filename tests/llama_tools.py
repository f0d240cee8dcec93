"""llama.cpp's command-line tools as oracles: llama-quantize, llama-imatrix, llama-perplexity, llama-gguf-split
(and llama-bench, which benchmarks/ runs beside ggraph).

    exe = llama_tool("llama-quantize")        # a pathlib.Path; skips the calling test if it can't be had

The tools come from the same llama.cpp as the installed llama-cpp-python: its source distribution
(``pip download --no-binary :all: llama-cpp-python==<installed version>``) carries llama.cpp under
``vendor/llama.cpp``, which is built once with cmake for this CPU's features (the flags of
``llama_cpp_cmake_args.py``) into ``$GGRAPH_CACHE/llama-tools/<version>-<flags hash>/``
(``~/.cache/ggraph`` by default). ``$GGRAPH_LLAMA_TOOLS`` names a directory of ready binaries
instead. A lock file keeps parallel test processes from building twice; a failed build is
remembered (delete its ``build.log`` beside the tools to retry) so that later tests skip at once.

    src = llama_cpp_source()                  # the extracted vendor/llama.cpp (convert_hf_to_gguf.py, gguf-py)
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from llama_cpp_cmake_args import cmake_args, cpu_flags

TOOLS = ("llama-quantize", "llama-imatrix", "llama-perplexity", "llama-gguf-split", "llama-bench")
_CMAKE_FIXED = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF")


def llama_tool(name: str) -> Path:
    """The path of llama.cpp's tool ``name`` (one of TOOLS), building the tools if needed, or skip."""
    if name not in TOOLS:
        raise ValueError(f"llama_tool: unknown tool {name!r}; known: {', '.join(TOOLS)}")
    given = os.environ.get("GGRAPH_LLAMA_TOOLS")
    if given:
        exe = Path(given) / name
        if not exe.is_file():
            pytest.skip(f"GGRAPH_LLAMA_TOOLS={given} has no {name}")
        return exe
    bin_dir, error = _built()
    if error:
        pytest.skip(error)
    return bin_dir / name


def built_tool(name: str) -> Path | None:
    """The path of llama.cpp's tool ``name`` if it is built already (or in $GGRAPH_LLAMA_TOOLS), else None;
    never builds (for tests that run a tool when it is there and do without it otherwise)."""
    given = os.environ.get("GGRAPH_LLAMA_TOOLS")
    version, _, root = _where()
    exe = Path(given) / name if given else None if version is None else root / "build" / "bin" / name
    return exe if exe is not None and exe.is_file() else None


def llama_cpp_source() -> Path:
    """The llama.cpp source of the installed llama-cpp-python (its sdist's ``vendor/llama.cpp``),
    downloaded and extracted once beside the tools built from it, or skip."""
    version, flags, root = _where()
    if version is None:
        pytest.skip(root)
    src = root / "src"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (src / "convert_hf_to_gguf.py").is_file():
            log = root / "source.log"
            with open(log, "w") as out:
                if not _fetch_source(version, root, out):
                    pytest.skip(f"could not download llama-cpp-python {version}'s source (see {log})")
            log.unlink()
    return src


def _where() -> tuple[str | None, str, Path | str]:
    """(llama-cpp-python version, cmake flags, the cache directory of its source and tools), or
    (None, "", why not)."""
    try:
        version = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return None, "", "llama-cpp-python is not installed: its source is where llama.cpp's tools come from"
    flags = " ".join((cmake_args(cpu_flags(), platform.machine()), *_CMAKE_FIXED))
    root = _cache_dir() / f"{version}-{hashlib.sha256(flags.encode()).hexdigest()[:10]}"
    root.mkdir(parents=True, exist_ok=True)
    return version, flags, root


@lru_cache(maxsize=1)
def _built() -> tuple[Path | None, str | None]:
    """(bin directory, None) once every tool is built, or (None, why not)."""
    version, flags, root = _where()
    if version is None:
        return None, root
    missing = [t for t in ("cmake", "c++") if shutil.which(t) is None]
    if missing:
        return None, f"cannot build llama.cpp's tools: {', '.join(missing)} not found"
    bin_dir, log = root / "build" / "bin", root / "build.log"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one builder; the others wait, then find the binaries
        if all((bin_dir / t).is_file() for t in TOOLS):
            return bin_dir, None
        if log.exists():
            return None, f"llama.cpp's tools failed to build before (see {log}; delete it to retry)"
        with open(log, "w") as out:
            ok = _build(version, flags.split(), root, out)
        if not ok or not all((bin_dir / t).is_file() for t in TOOLS):
            return None, f"llama.cpp's tools failed to build (see {log})"
        log.unlink()
        return bin_dir, None


def _fetch_source(version: str, root: Path, out) -> bool:
    """Download the sdist of llama-cpp-python ``version`` and move its vendor/llama.cpp to ``root/src``."""
    src, dl = root / "src", root / "sdist"
    step = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"llama-cpp-python=={version}", "-d", str(dl)]
    if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode:
        return False
    with tarfile.open(next(dl.glob("llama_cpp_python-*.tar.gz"))) as tar:
        tar.extractall(dl, filter="data")
    vendored = next(dl.glob("llama_cpp_python-*/vendor/llama.cpp"))
    shutil.rmtree(src, ignore_errors=True)
    vendored.rename(src)
    shutil.rmtree(dl)
    return True


def _build(version: str, flags: list[str], root: Path, out) -> bool:
    """Build TOOLS under ``root/build`` from the source of llama-cpp-python ``version`` (fetched if needed)."""
    src = root / "src"
    if not (src / "CMakeLists.txt").is_file() and not _fetch_source(version, root, out):
        return False
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(src), "-B", str(root / "build"), *gen, *flags]
    build = ["cmake", "--build", str(root / "build"), "-j", str(os.cpu_count() or 2), "--target", *TOOLS]
    return all(subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode == 0
               for step in (configure, build))


def _cache_dir() -> Path:
    return Path(os.environ.get("GGRAPH_CACHE") or Path.home() / ".cache" / "ggraph") / "llama-tools"


def run_tool(name: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run llama.cpp's tool ``name`` with ``args``; fail the test with its output if it fails."""
    exe = llama_tool(name)
    proc = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        pytest.fail(f"{name} {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def llama_perplexity(model, text_file, n_ctx: int, chunks: int) -> float:
    """llama-perplexity's estimate after ``chunks`` chunks of ``n_ctx`` tokens of ``text_file`` (2 threads, f16 K
    and V caches), read from the running estimates it prints after each chunk."""
    for _ in range(3):      # llama.cpp's log thread loses its last lines at exit now and then; they are retried
        run = run_tool("llama-perplexity", "-m", model, "-f", text_file, "-c", n_ctx, "--chunks", chunks, "-t", 2,
                       "-ctk", "f16", "-ctv", "f16")
        running = re.findall(r"\[(\d+)\]([\d.]+),", run.stdout)      # the estimate after each chunk
        if running and running[-1][0] == str(chunks):
            return float(running[-1][1])
    pytest.fail(f"llama-perplexity printed no chunk {chunks} in 3 runs: {run.stdout[-500:]}")


def quantizes_as_llama_quantize(src, ftype: str, *args) -> subprocess.CompletedProcess:
    """``ggraph quantize [args] src ours.gguf ftype`` writes, in the current directory, the file that
    ``llama-quantize [args] src ref.gguf ftype 2`` writes, byte for byte (an imatrix path in ``args`` is recorded
    in the file: both run from the same place); on a difference, the first key or tensor (name and type) that
    differs fails the test. Returns llama-quantize's run."""
    from ggraph.cli import main
    from ggraph.gguf import GGUFFile
    run = run_tool("llama-quantize", *args, src, "ref.gguf", ftype, 2)
    assert main(["quantize", *map(str, args), str(src), "ours.gguf", ftype]) == 0
    ref, ours = Path("ref.gguf").resolve(), Path("ours.gguf").resolve()
    if ref.read_bytes() != ours.read_bytes():
        with GGUFFile(ref) as a, GGUFFile(ours) as b:
            assert a.metadata == b.metadata
            for name, t in a.tensors.items():
                assert (b.tensors[name].dtype, b.tensors[name].shape) == (t.dtype, t.shape), name
                assert np.array_equal(b.tensors[name].data, t.data), f"{name} ({t.dtype}) differs"
        pytest.fail("files differ outside metadata and tensor bytes")
    return run
