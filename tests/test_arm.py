"""ggraph on AArch64, in an emulated guest (tests/arm/emulator.py: qemu-user 10, Debian's arm64 CPython,
numpy and llvmlite wheels; LLVM runs in this host's Python, the guest generates IR, links and runs): each
emulated CPU gets its best NEON set, a tiny q4_k_m model's logits on neon and neon_i8mm agree with
llama.cpp's (run here, on the host) as closely as on x86, neon_i8mm's smmla gemm gives neon_dotprod's
bits, and the thread team's barrier and futex hold at 2-4 threads. Skipped, saying why, where the guest
cannot be built (no network, no apt). The whole conformance suites run in the guest by hand (docs/arm.md).

Every guest start pays for its imports at emulated speed, so each emulated CPU's checks run in one guest
process (tests/arm/guest_checks.py), the three CPUs' at once, and the tests judge their results; the
model's program is lowered and compiled on this host first (tests/arm/precompile.py), so the guest
generates no IR."""
import json
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
GUEST_TIMEOUT = 1500                             # seconds: everything in the guest runs ~10-50x slower
T_ORDER = ("neon", "neon_dotprod", "neon_i8mm")
MISSING = {"max": {}, "neoverse-n1": {"neon_i8mm": "i8mm"},
           "cortex-a72": {"neon_dotprod": "dotprod", "neon_i8mm": "dotprod, i8mm"}}
# neon (smull dots) and neon_i8mm (smmla gemm, sdot gemv: neon_dotprod's bits, test_i8mm_gemm) run the
# model; the conformance suites run every set by hand (docs/arm.md)
MODEL_CPUS = ("cortex-a72", "max")
SMMLA = "tests/arm/test_i8mm_gemm.py::test_smmla_gemm_matches_float64_and_the_sdot_gemm_bit_for_bit[q4_k]"
BARRIER = "tests/arm/test_team_barrier.py"


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


@pytest.fixture(scope="module")
def q4_k_m():
    """A tiny llama in llama.cpp's Q4_K_M mix (q4_k, q6_k, q8_0 ... as llama-quantize picks them) and the
    prompt; None without llama-cpp-python (the model check then skips)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    return zoo.cached_model("llama", "q4_k_m", **zoo.K_QUANT_DIMS), prompt_ids(40)   # 32+ tokens: the gemm


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    """Where the guests write their results, logits and logs."""
    return tmp_path_factory.mktemp("arm")


@pytest.fixture(scope="module")
def reports(guest, q4_k_m, d) -> dict:
    """Each emulated CPU's results (guest_checks.py's JSON), or the text of a guest that failed."""
    plan = {cpu: ["choice"] for cpu in emulator.CPUS}
    plan["max"] += ["target", f"pytest:{SMMLA},{BARRIER}"]
    if q4_k_m is not None:
        path, ids = q4_k_m
        for cpu in MODEL_CPUS:                        # lowered and compiled here, natively, into the cache
            done = subprocess.run([str(guest / "bin" / "host-python"), str(ARM / "precompile.py"),
                                   emulator.CPUS[cpu], str(path)],
                                  capture_output=True, text=True, timeout=GUEST_TIMEOUT)
            assert done.returncode == 0, f"precompile for {cpu}:\n{done.stderr[-3000:]}"
            plan[cpu].append(f"logits:{path}:{','.join(map(str, ids))}:{d / cpu}.npy")
    running = {}
    for cpu, checks in plan.items():                  # at once: each guest is one process, mostly
        log = open(d / f"{cpu}.log", "w")
        running[cpu] = log, subprocess.Popen(
            emulator.guest_command([str(ARM / "guest_checks.py"), str(d / f"{cpu}.json"), *checks], guest),
            env=emulator.guest_env(cpu), cwd=emulator.REPO, stdout=log, stderr=subprocess.STDOUT)
    out = {}
    for cpu, (log, p) in running.items():
        try:
            code = p.wait(timeout=GUEST_TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            code = f"nothing after {GUEST_TIMEOUT} s"
        log.close()
        out[cpu] = json.loads((d / f"{cpu}.json").read_text()) if code == 0 else \
            f"the guest on {cpu} exited {code}:\n{(d / f'{cpu}.log').read_text()[-4000:]}"
    return out


def result(reports: dict, cpu: str, check: str):
    """What the guest on ``cpu`` found for ``check``; the test fails with the guest's error if it failed."""
    report = reports[cpu]
    assert isinstance(report, dict), report
    got = report[check]
    assert not (isinstance(got, dict) and "error" in got), f"{check} on {cpu}: {got['error']}"
    return got


@pytest.mark.parametrize("cpu", emulator.CPUS)
def test_each_emulated_cpu_gets_its_best_neon_set(reports, cpu):
    got = result(reports, cpu, "choice")
    best = emulator.CPUS[cpu]
    assert (got["arch"], got["best"]) == ("aarch64", best)
    runs = list(T_ORDER[:T_ORDER.index(best) + 1])
    assert got["runs"] == runs
    assert got["refused"] == [f"GGRAPH_TARGET={name}: that is x86_64 code and this host is aarch64 (it runs: "
                              f"{', '.join(reversed(runs))})" for name in X86_NAMES] + \
                             [f"GGRAPH_TARGET={name}: this host lacks {lacks}" for name, lacks in MISSING[cpu].items()]


def test_ggraph_target_in_the_guest(reports, guest):
    out = result(reports, "max", "target")
    assert "features: neon+  dotprod+  i8mm+" in out
    assert "chosen: neon_i8mm (best available" in out
    assert "linked by " + str(guest / "bin" / "aarch64-linux-gnu-ld") in out
    assert "AMX" not in out


@pytest.mark.parametrize("cpu", MODEL_CPUS)
def test_a_q4_k_m_model_matches_llama_cpp_on_neon_sets(reports, q4_k_m, d, cpu):
    if q4_k_m is None:
        pytest.skip("llama-cpp-python is the oracle (and makes the q4_k_m model)")
    import oracle
    path, ids = q4_k_m
    got = result(reports, cpu, f"logits:{path}:{','.join(map(str, ids))}:{d / cpu}.npy")
    assert got["target"] == emulator.CPUS[cpu]
    # the host's precompile.py built this program: the guest only traced, linked and ran (else the
    # cache keys of the two sides differ, and the guest lowers it itself, minutes more)
    assert got["from_cache"], "the guest did not find the host's program in the cache"
    cos, top1 = agreement(np.load(d / f"{cpu}.npy"), oracle.llama_logits(path, ids, n_ctx=64))
    assert cos > 0.9999 and top1 == 1.0, (cpu, cos, top1)             # the bar x86's feature sets meet


def test_the_smmla_gemm_and_the_barrier_in_the_guest(reports):
    """q4_k's case of tests/arm/test_i8mm_gemm.py (every type runs by hand: super-blocks, integer
    sub-block scales and mins, 2-row smmla tiles and a 1-row sdot tail) and the barrier and futex
    stress tests of tests/arm/test_team_barrier.py at 2-4 threads."""
    got = result(reports, "max", f"pytest:{SMMLA},{BARRIER}")
    assert got["exit"] == 0, got
    assert sorted(got["outcomes"].values()) == ["passed"] * 5, got
    assert SMMLA in got["outcomes"]
