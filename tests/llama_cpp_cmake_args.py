"""Print the CMAKE_ARGS that build llama-cpp-python (the test oracle) for this CPU.

ggml's native build picks AMX kernels, which crash on these machines, so the build names
its x86 features explicitly: AVX2/FMA/F16C always, and AVX-512 and VNNI only when the CPU
has them (a build with AVX-512 dies with SIGILL on an AVX2-only CPU such as AMD Zen 3).

    CMAKE_ARGS="$(python tests/llama_cpp_cmake_args.py)" pip install -e ".[test,demo,oracle]"
"""
from __future__ import annotations

import platform
from pathlib import Path


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args(flags: set[str], machine: str) -> str:
    if machine not in ("x86_64", "AMD64"):
        return "-DGGML_NATIVE=ON"
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        args.append("-DGGML_AVX512=ON")
        if "avx512_vnni" in flags:
            args.append("-DGGML_AVX512_VNNI=ON")
    if "avx_vnni" in flags:
        args.append("-DGGML_AVX_VNNI=ON")
    return " ".join(args)


if __name__ == "__main__":
    print(cmake_args(cpu_flags(), platform.machine()))
