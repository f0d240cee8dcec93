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
