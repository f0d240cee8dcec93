"""The scripts in benchmarks/ still run against the kernels' current ABI (tiny sizes: this checks
that they work, not how fast anything is)."""
import subprocess
import sys
from pathlib import Path

import pytest

from ggraph.backends.llvm.target import host_target

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_attention_benchmark_runs(cache_type):
    out = subprocess.run([sys.executable, str(BENCHMARKS / "attention.py"), "--targets", host_target().name, "--threads", "1,2", "--past", "40",
                          "--prefill", "4", "--cache-type", cache_type], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if "decode T=1 P=40" in line or "prefill T=4" in line]
    assert rows and all(float(r[-4]) > 0 for r in rows), out.stdout        # attention µs of every row
    assert f"{cache_type} caches" in out.stdout


def test_kernel_benchmark_compares_layouts():
    """Each layout a row; rows16 (q4_k on AVX-512 VNNI, with or without tiles) with its gemv ratio to the file's layout from
    alternating rounds, and a line saying so where a layout does not apply (48 rows, another type)."""
    target = host_target().name
    out = subprocess.run([sys.executable, str(BENCHMARKS / "kernels.py"), "--targets", target, "--threads", "1,2",
                          "--shapes", "q4_k:256:64,q4_k:256:48,q8_0:64:32", "--layouts", "file,rows16",
                          "--tokens", "4"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "(no rows16 layout for q4_k, 48 rows" in out.stdout and "(no rows16 layout for q8_0, 32 rows" in out.stdout
    if target in ("avx512_vnni", "amx"):
        rows16 = [line.split() for line in lines if "(rows16: gemv" in line]
        assert len(rows16) == 1 and rows16[0][:3] == ["q4_k", "256", "64"] and float(rows16[0][4]) > 0, out.stdout


def test_tile_benchmark_runs_where_tiles_do():
    """benchmarks/tiles.py: eleven lines of cycles on an amx host; elsewhere it says what it needs."""
    out = subprocess.run([sys.executable, str(BENCHMARKS / "tiles.py"), "--rounds", "1"], capture_output=True, text=True,
                         timeout=600)
    if not host_target().has("amx-int8"):
        assert out.returncode != 0 and "needs the amx feature set" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.rstrip().endswith(("a tdpbssd", "24 FMAs", "a tileloadd", "16 tdpbssd"))]
    assert len(rows) == 11 and all(float(r.split("cycles for")[0].split()[-1]) > 0 for r in rows), out.stdout


def test_hybrid_benchmark_writes_checks_and_runs(tmp_path):
    """benchmarks/hybrid.py: a tiny lfm2 file (two convolution layers, one attention layer) written, quantised
    by llama.cpp and checked against it, then decode and prefill timed at two depths, beside llama-bench when
    tests/llama_tools.py has built it."""
    pytest.importorskip("llama_cpp", reason="llama.cpp quantises and checks the file")
    from llama_tools import built_tool
    path = tmp_path / "lfm2.gguf"
    out = subprocess.run([sys.executable, str(BENCHMARKS / "hybrid.py"), "--write", str(path),
                          "--shape", "layers=3,width=256,ffn=512,heads=4,kv_heads=2"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    cosine = float(out.stdout.split("least cosine")[1])
    assert cosine > 0.999, out.stdout                       # Q4_K_M in both engines, activations as q8_K
    bench = built_tool("llama-bench")
    engines = ["ggraph"] + ["llama.cpp"] * bool(bench)
    out = subprocess.run([sys.executable, str(BENCHMARKS / "hybrid.py"), str(path), "--threads", "1", "--pp", "8",
                          "--tg", "2", "--rounds", "1", "--depth", "0,16",
                          *(["--llama-bench", str(bench)] if bench else [])],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| 1 |")]
    assert [(r[2].strip(), r[3].strip()) for r in rows] == [(d, e) for d in ("0", "16") for e in engines], out.stdout
    assert all(float(r[5]) > 0 for r in rows) and float(rows[0][4]) > 0, out.stdout    # decode everywhere, prefill at 0
    assert "ggraph, 1 thread(s): decode at depth 16 is" in out.stdout
