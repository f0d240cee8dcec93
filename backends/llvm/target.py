"""Named CPU feature sets, host detection, and the LLVM target machine for each.

A Target is a frozen description: the LLVM triple, cpu and feature string, and the
vector width the kernels are written for. Kernels ask it `has(feature)`; they never
look at the host. LLVM is initialised lazily, the first time a machine is needed.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import os
import platform
import subprocess
import sys
from dataclasses import dataclass

X86 = "x86_64-unknown-linux-gnu"
AARCH64 = "aarch64-unknown-linux-gnu"

_X86_BASE = ("sse", "sse2")
_AVX2 = _X86_BASE + ("ssse3", "sse4.1", "avx", "avx2", "fma", "f16c", "bmi2")
_AVX512 = _AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq")

#  name             triple    cpu          required features                 vector bits
_SETS = {
    "generic":      (X86,     "x86-64",    _X86_BASE,                          128),
    "avx2":         (X86,     "x86-64-v3", _AVX2,                              256),
    "avx512":       (X86,     "x86-64-v4", _AVX512,                            512),
    "avx512_vnni":  (X86,     "x86-64-v4", _AVX512 + ("avx512vnni",),          512),
    "amx":          (X86,     "x86-64-v4", _AVX512 + ("avx512vnni", "amx-tile", "amx-int8"), 512),
    "neon":         (AARCH64, "generic",   ("neon",),                          128),
    "neon_dotprod": (AARCH64, "generic",   ("neon", "dotprod"),                128),
    "neon_i8mm":    (AARCH64, "generic",   ("neon", "dotprod", "i8mm"),        128),
}
NAMES = tuple(_SETS)
X86_NAMES = tuple(n for n, s in _SETS.items() if s[0] == X86)
AARCH64_NAMES = tuple(n for n, s in _SETS.items() if s[0] == AARCH64)
_PREFERENCE = {                               # per architecture, best first
    "x86_64": ("amx", "avx512_vnni", "avx512", "avx2", "generic"),
    "aarch64": ("neon_i8mm", "neon_dotprod", "neon"),
}
# added when the host has them. GFNI: LLVM shifts bytes with one vgf2p8affineqb instead of a word shift
# and a mask (nibble splits; docs/kernels.md has the measurements)
_OPTIONAL = {"avx2": ("gfni",), "avx512": ("gfni",), "avx512_vnni": ("avxvnni", "gfni"), "amx": ("avxvnni", "gfni")}
_TILES = ("amx-tile", "amx-int8")             # usable only once Linux grants the process tile data
# LLVM tuning flags, not CPU features. fast-dpwssd keeps vpdpwssd whole instead of splitting it into
# vpmaddwd + vpaddd (which shortens a chain's latency): the AMX gemm's float steps are bound by
# vector issue, not latency (32 independent tokens a unit), and every AMX CPU runs vpdpwssd as one
# instruction (docs/kernels.md has the measurement).
_TUNING = {"amx": ("fast-dpwssd",)}


class Prefetch(str, enum.Enum):
    """How gemv asks for weight lines ahead of its reads, by CPU vendor (docs/kernels.md has why)."""

    ROWS = "rows"         # Intel: at each row's start, the lines a few KB on
    SPREAD = "spread"     # AMD: with each group of some types' blocks, further ahead; nothing else

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


@dataclass(frozen=True)
class Target:
    """One feature set: what LLVM is told, and what kernels may use."""

    name: str
    triple: str
    cpu: str
    features: str        # LLVM's "+a,+b" string
    vector_bits: int
    gemv_prefetch: Prefetch = Prefetch.ROWS   # how gemv asks for weight lines ahead of its reads

    def __post_init__(self):
        object.__setattr__(self, "gemv_prefetch", Prefetch(self.gemv_prefetch))   # a name such as "spread" too

    @property
    def feature_set(self) -> frozenset:
        return frozenset(f[1:] for f in self.features.split(",") if f.startswith("+"))

    def has(self, feature: str) -> bool:
        """True if kernels for this target may use `feature` (an LLVM feature name)."""
        return feature in self.feature_set

    def require(self, feature: str, what: str) -> None:
        """Raise before any IR is emitted if `what` needs a feature this target lacks."""
        if not self.has(feature):
            raise ValueError(f"{what} needs CPU feature '{feature}', which target "
                             f"'{self.name}' does not have (it has: {self.features or 'baseline'})")

    @property
    def arch(self) -> str:
        return _ARCH_ALIASES.get(self.triple.split("-")[0], self.triple.split("-")[0])

    @property
    def executable(self) -> bool:
        """True if code for this target can run in this process: the host's architecture and, for a set
        with AMX tiles, Linux's permission for tile data (asked for here, once per process)."""
        if self.arch != host_arch():
            return False
        return not any(self.has(f) for f in _TILES) or tile_permission()


_ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}        # Windows' and Apple's names -> LLVM's


def host_arch() -> str:
    machine = platform.machine().lower()
    return _ARCH_ALIASES.get(machine, machine)


def host_os() -> str:
    """``sys.platform``: "linux", "darwin", ... (a function, so that tests can stand in for another OS)."""
    return sys.platform


def host_names() -> tuple[str, ...]:
    """The feature sets of this host's architecture (runnable or not), in NAMES order."""
    return tuple(n for n, s in _SETS.items() if s[0].split("-")[0] == host_arch())


def _os_triple(triple: str) -> str:
    """``triple`` for this host's operating system: Mach-O objects and Apple's ABI on macOS, where no
    ELF object can be loaded."""
    return triple.replace("unknown-linux-gnu", "apple-macosx11.0.0") if host_os() == "darwin" else triple


# LLVM's name for each feature the sets above use -> the flag Linux prints for it in /proc/cpuinfo
_CPUINFO_FLAGS = {
    "sse": "sse", "sse2": "sse2", "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "avx": "avx", "avx2": "avx2",
    "fma": "fma", "f16c": "f16c", "bmi2": "bmi2", "avx512f": "avx512f", "avx512bw": "avx512bw",
    "avx512vl": "avx512vl", "avx512dq": "avx512dq", "avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni",
    "gfni": "gfni",
    "amx-tile": "amx_tile", "amx-int8": "amx_int8",
    "neon": "asimd", "dotprod": "asimddp", "i8mm": "i8mm",
}
# LLVM's name for each AArch64 feature -> the sysctl that says 1 when an Apple CPU has it (macOS has no /proc)
_SYSCTL_FLAGS = {"neon": "hw.optional.AdvSIMD", "dotprod": "hw.optional.arm.FEAT_DotProd",
                 "i8mm": "hw.optional.arm.FEAT_I8MM"}


def _cpuinfo_field(text: str, keys: tuple) -> str | None:
    """The value of the first line of a /proc/cpuinfo text whose key is one of ``keys`` (the first CPU's)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in keys:
            return value.strip()
    return None


@functools.cache
def _host_cpuinfo() -> str:
    """This host's /proc/cpuinfo, or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _cpuinfo_features(text: str) -> frozenset:
    """The features of `_CPUINFO_FLAGS` that a /proc/cpuinfo text lists for its first CPU, by LLVM's names.
    The kernel prints only what it enabled (AVX-512 state saved by XSAVE, say), which is what code may use."""
    value = _cpuinfo_field(text, ("flags", "Features"))              # x86, AArch64
    if value is None:
        raise ValueError("/proc/cpuinfo has no 'flags' or 'Features' line")
    flags = set(value.split())
    return frozenset(name for name, flag in _CPUINFO_FLAGS.items() if flag in flags)


def _sysctl_features(text: str) -> frozenset:
    """The AArch64 features of `_SYSCTL_FLAGS` that ``sysctl hw.optional`` output (``name: value`` lines)
    sets to 1, by LLVM's names."""
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            values[key.strip()] = value.strip()
    if not any(key.startswith("hw.optional.") for key in values):
        raise ValueError("sysctl printed no hw.optional values")
    return frozenset(name for name, key in _SYSCTL_FLAGS.items() if values.get(key) == "1")


@functools.cache
def _host_sysctl() -> str:
    """``sysctl hw.optional`` on this (macOS) host, or "" where it cannot run."""
    try:
        return subprocess.run(["sysctl", "hw.optional"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.cache
def host_features() -> frozenset:
    """The host's CPU features by LLVM's names: from the kernel's /proc/cpuinfo on Linux, from sysctl on an
    Apple ARM CPU, else from LLVM's feature map (the CPU name can mislead). Reading the OS's word keeps a
    warm process from loading LLVM (its shared library alone is ~35 MiB resident) just to pick a set."""
    try:
        if host_os() == "darwin" and host_arch() == "aarch64":
            return _sysctl_features(_host_sysctl())
        return _cpuinfo_features(_host_cpuinfo())
    except ValueError:
        import llvmlite.binding as llvm
        return frozenset(k for k, v in llvm.get_host_cpu_features().items() if v)


def named_target(name: str, extra: tuple = ()) -> Target:
    """The feature set called `name` (see NAMES), plus any `extra` features."""
    if name not in _SETS:
        raise ValueError(f"unknown target {name!r}; known: {', '.join(NAMES)}")
    triple, cpu, feats, bits = _SETS[name]
    features = feats + tuple(extra) + _TUNING.get(name, ())
    return Target(name, _os_triple(triple), cpu, ",".join("+" + f for f in features), bits)


ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1023, 18, 158


@functools.cache
def tile_permission() -> bool:
    """Ask Linux, once per process, for the AMX tile data state (arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)); True if granted. Without it the first tile instruction kills the process."""
    if host_os() != "linux" or host_arch() != "x86_64":
        return False
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def missing_features(name: str, features: frozenset | None = None) -> list[str]:
    """The features set `name` needs that `features` (default: the host's) lacks. For the host, AMX
    counts as missing unless Linux granted this process the tile data (``tile_permission``)."""
    named_target(name)                                  # validates the name
    host = features is None
    features = host_features() if host else features
    missing = [f for f in _SETS[name][2] if f not in features]
    if host and not missing and any(f in _TILES for f in _SETS[name][2]) and not tile_permission():
        missing.append("AMX tile permission (arch_prctl ARCH_REQ_XCOMP_PERM was refused)")
    return missing


def _with_host_extras(name: str, features: frozenset) -> Target:
    target = named_target(name, tuple(f for f in _OPTIONAL.get(name, ()) if f in features))
    return dataclasses.replace(target, gemv_prefetch=host_prefetches())


def host_prefetches() -> Prefetch:
    """How gemv should prefetch weights on this host: SPREAD on AMD CPUs, where prefetches at a row's
    start cost more than they bring but q4_k, q5_k and the 32-weight types gain from lines asked for
    further ahead, a few at a time; else ROWS."""
    return prefetch_kind(_host_cpuinfo())


def prefetch_kind(cpuinfo: str) -> Prefetch:
    """SPREAD for a /proc/cpuinfo text whose first CPU is AMD's, else ROWS."""
    return Prefetch.SPREAD if _cpuinfo_field(cpuinfo, ("vendor_id",)) == "AuthenticAMD" else Prefetch.ROWS


def host_target(env: str | None = None) -> Target:
    """The best feature set this host runs, or the one forced by $GGRAPH_TARGET (refused, naming what is
    missing, when this host cannot run it: ``named_target`` gives any set for assembly)."""
    forced = (os.environ.get("GGRAPH_TARGET", "") if env is None else env).strip()
    features = host_features()
    if forced:
        forced_target(forced)
        return _with_host_extras(forced, features)
    for name in _preference():
        if not missing_features(name):
            return _with_host_extras(name, features)
    raise ValueError(f"this {host_arch()} host lacks even the baseline feature set "
                     f"{_preference()[-1]} ({', '.join(missing_features(_preference()[-1]))})")


def forced_target(name: str) -> None:
    """Raise unless this host can run the set ``name`` that $GGRAPH_TARGET forces: the error names the
    missing features, or the sets it can run when ``name`` is another architecture's."""
    target = named_target(name)
    if target.arch != host_arch():
        runs = ", ".join(n for n in _preference() if not missing_features(n)) or "none"
        raise ValueError(f"GGRAPH_TARGET={name}: that is {target.arch} code and this host is {host_arch()} "
                         f"(it runs: {runs})")
    missing = missing_features(name)
    if missing:
        raise ValueError(f"GGRAPH_TARGET={name}: this host lacks {', '.join(missing)}")


def _preference() -> tuple[str, ...]:
    """This host architecture's feature sets, best first."""
    if host_arch() not in _PREFERENCE:
        raise ValueError(f"no native feature set for host architecture {host_arch()}; "
                         f"known sets: {', '.join(NAMES)}")
    return _PREFERENCE[host_arch()]


def runnable_targets() -> list[Target]:
    """Every feature set of this host's architecture that it can execute, best last."""
    features = host_features()
    return [_with_host_extras(n, features) for n in reversed(_PREFERENCE.get(host_arch(), ()))
            if not missing_features(n)]


@functools.cache
def init_llvm(cross: bool = False) -> None:
    """Initialise LLVM's native target, and all targets when cross-compiling; once."""
    import llvmlite.binding as llvm
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    if cross:
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()


@functools.cache
def target_machine(target: Target, opt: int = 3):
    """An llvmlite TargetMachine for `target` at codegen level `opt`: PIC, small code model (objects load
    anywhere)."""
    import llvmlite.binding as llvm
    init_llvm(not target.executable)
    return llvm.Target.from_triple(target.triple).create_target_machine(
        cpu=target.cpu, features=target.features, opt=opt, reloc="pic", codemodel="small")
