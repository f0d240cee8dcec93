"""Host side: lower and compile programs for an emulated AArch64 CPU into ggraph's cache, natively,
before the guest asks for them. Kernels are cached by emitter and arguments, programs by graph, target
and ggraph's code, the same keys on both sides, so the guest finds them there and generates no IR (which
it does 10-50x slower than this host); it loads the model, traces, links and runs.

    python tests/arm/emulator.py run --host -- tests/arm/precompile.py neon_i8mm MODEL.gguf
    GGRAPH_ARM_PRECOMPILE=neon_i8mm python tests/arm/emulator.py run --host -- \
        -m pytest -p tests.arm.precompile tests/test_llvm_models.py

(``run --host``: the host's Python on this checkout's ggraph, as the guest runs it, so that both sides
compute the same keys.) The first makes the program guest_checks.py's logits check runs.

The process stands in for an AArch64 host with the set's features (the target module's answers
replaced) and stops where a program would be loaded, after the cache holds it. As a pytest plugin, a
test that stops there counts as precompiled (its first program only; what comes after it in the test,
the guest builds itself); a test that fails before it fails as usual.
"""
import dataclasses
import os
import sys


class Cached(Exception):
    """Raised where a program would be loaded: it is in the cache by then."""


def as_aarch64(name: str) -> None:
    """Make this process an AArch64 host with exactly the features of the set ``name`` (QEMU's CPUs
    for the three sets: max, neoverse-n1, cortex-a72), whose programs are cached but never loaded."""
    from ggraph.backends.llvm import jit
    from ggraph.backends.llvm import target as T
    if T.named_target(name).arch != "aarch64":
        raise SystemExit(f"precompile: {name} is not an AArch64 feature set ({', '.join(T.AARCH64_NAMES)})")
    features = frozenset(T._SETS[name][2])
    T.init_llvm(True)                                    # every target's code generator, AArch64's included
    T.host_arch = lambda: "aarch64"
    T.host_features = lambda: features
    T.host_prefetches = lambda: T.Prefetch.ROWS           # an ARM /proc/cpuinfo names no x86 vendor
    assert T.host_target() == dataclasses.replace(T.named_target(name), gemv_prefetch=T.Prefetch.ROWS)

    def cached(*args, **kwargs):
        raise Cached

    jit.link = cached


def precompile(name: str, path: str) -> None:
    """The program of guest_checks.py's logits check for ``path`` on the set ``name``, into the cache."""
    from guest_checks import session
    as_aarch64(name)
    try:
        session(path).program(False)
    except Cached:
        return
    raise SystemExit("precompile: the program was loaded without being linked here")


def pytest_configure(config):
    name = os.environ.get("GGRAPH_ARM_PRECOMPILE")
    if not name:
        raise SystemExit("tests.arm.precompile: set GGRAPH_ARM_PRECOMPILE to the AArch64 set to compile for")
    as_aarch64(name)


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and call.excinfo.errisinstance(Cached):
        call.excinfo = None                              # the program is cached: as far as this host goes


if __name__ == "__main__":
    precompile(*sys.argv[1:])
