"""ggraph on AArch64, in an emulated guest (tests/arm/emulator.py: qemu-user 10, Debian's arm64 CPython,
numpy and llvmlite wheels; LLVM runs in this host's Python, the guest generates IR, links and runs): each
emulated CPU gets its best NEON set, a tiny q4_k_m model's logits on neon and neon_i8mm agree with
llama.cpp's (run here, on the host) as closely as on x86, neon_i8mm's smmla gemm gives neon_dotprod's
bits, and the thread team's barrier and futex hold at 2-4 threads. Skipped, saying why, where the guest cannot be built (no network, no apt).
The whole conformance suites run in the guest by hand (tests/arm/README.md)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import zoo
from ggraph.backends.llvm.target import X86_NAMES
from test_models import agreement, prompt_ids

from arm import emulator

ARM = Path(__file__).parent / "arm"

pytestmark = pytest.mark.slow
GUEST_TIMEOUT = 900                              # seconds: everything in the guest runs ~10-50x slower


@pytest.fixture(scope="module")
def guest() -> Path:
    """The emulated environment, built on first use (about a minute, ~350 MB in the cache)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the emulated AArch64 guest is built from Debian packages (Linux only)")
    if os.uname().machine == "aarch64":
        pytest.skip("this host is AArch64: the whole suite runs natively")
    try:
        return emulator.setup(log=lambda *a: None)
    except emulator.Unavailable as e:
        pytest.skip(f"no emulated AArch64 guest: {e}")


def in_guest(root: Path, cpu: str, *args: str, **env) -> str:
    """The guest Python's stdout for ``args`` on emulated CPU ``cpu``; the test fails with its output
    if it exits non-zero."""
    done = subprocess.run(emulator.guest_command(list(args), root), env=emulator.guest_env(cpu, **env),
                          cwd=emulator.REPO, capture_output=True, text=True, timeout=GUEST_TIMEOUT)
    assert done.returncode == 0, f"guest on {cpu} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


T_ORDER = ("neon", "neon_dotprod", "neon_i8mm")
MISSING = {"max": {}, "neoverse-n1": {"neon_i8mm": "i8mm"},
           "cortex-a72": {"neon_dotprod": "dotprod", "neon_i8mm": "dotprod, i8mm"}}
CHOICE = """from ggraph.backends.llvm import target as T
print(T.host_arch(), T.host_target().name, ",".join(t.name for t in T.runnable_targets()))
for name in T.NAMES:                                  # every set the host cannot run, refused by name
    try:
        T.host_target(name)
    except ValueError as e:
        print(e)
"""


@pytest.mark.parametrize("cpu", emulator.CPUS)
def test_each_emulated_cpu_gets_its_best_neon_set(guest, cpu):
    out = in_guest(guest, cpu, "-c", CHOICE)
    first, *refused = out.splitlines()
    arch, best, runs = first.split()
    assert (arch, best) == ("aarch64", emulator.CPUS[cpu])
    runs = runs.split(",")
    assert runs == list(T_ORDER[:T_ORDER.index(best) + 1])
    assert refused == [f"GGRAPH_TARGET={name}: that is x86_64 code and this host is aarch64 (it runs: "
                       f"{', '.join(reversed(runs))})" for name in X86_NAMES] + \
                      [f"GGRAPH_TARGET={name}: this host lacks {lacks}" for name, lacks in MISSING[cpu].items()]


def test_ggraph_target_in_the_guest(guest):
    out = in_guest(guest, "max", "-m", "ggraph.cli", "target")
    assert "features: neon+  dotprod+  i8mm+" in out
    assert "chosen: neon_i8mm (best available" in out
    assert "linked by " + str(guest / "bin" / "aarch64-linux-gnu-ld") in out
    assert "AMX" not in out


@pytest.fixture(scope="module")
def q4_k_m():
    """A tiny llama in llama.cpp's Q4_K_M mix (q4_k, q6_k, q8_0 ... as llama-quantize picks them), the
    prompt, and llama.cpp's logits for it, computed on this host."""
    oracle = pytest.importorskip("oracle")
    path = zoo.cached_model("llama", "q4_k_m", **zoo.K_QUANT_DIMS)
    ids = prompt_ids(40)                              # 32 tokens and more: the gemm as well as the tails
    return path, ids, oracle.llama_logits(path, ids, n_ctx=64)


# neon (smull dots) and neon_i8mm (smmla gemm, sdot gemv: neon_dotprod's bits, test_i8mm_gemm): the
# conformance suites run every set by hand (docs/arm.md), CI this pair
@pytest.mark.parametrize("cpu", ["cortex-a72", "max"])
def test_a_q4_k_m_model_matches_llama_cpp_on_neon_sets(guest, q4_k_m, cpu, tmp_path):
    path, ids, want = q4_k_m
    out = tmp_path / "logits.npy"
    name = in_guest(guest, cpu, str(ARM / "guest_logits.py"), str(path), ",".join(map(str, ids)), str(out), "2")
    assert name.split()[-1] == emulator.CPUS[cpu]
    cos, top1 = agreement(np.load(out), want)
    assert cos > 0.9999 and top1 == 1.0, (cpu, cos, top1)             # the bar x86's feature sets meet


def test_the_smmla_gemm_in_the_guest(guest):
    """q4_k's case of tests/arm/test_i8mm_gemm.py (every type runs by hand): super-blocks, integer
    sub-block scales and mins, 2-row smmla tiles and a 1-row sdot tail."""
    out = in_guest(guest, "max", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ARM / "test_i8mm_gemm.py"),
                   "-k", "q4_k")
    assert "1 passed" in out, out


def test_the_barrier_and_futex_in_the_guest(guest):
    out = in_guest(guest, "max", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   str(ARM / "test_team_barrier.py"))
    assert "4 passed" in out, out
