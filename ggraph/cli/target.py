"""``ggraph target``: the host CPU as LLVM sees it, the feature sets it runs, the kernel of each op."""
from __future__ import annotations

import json
import sys


FEATURES_THAT_MATTER = {               # by host architecture
    "x86_64": ("sse4.1", "sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
               "avx512vnni", "avxvnni", "gfni", "amx-tile", "amx-int8", "neon", "dotprod"),
    "aarch64": ("neon", "dotprod", "i8mm"),
}


def target_report() -> dict:
    """The host CPU as llvmlite sees it, the feature sets it runs, and the kernels of the chosen one."""
    import os
    import llvmlite
    import llvmlite.binding as llvm
    from ggraph.backends.llvm import jit, kernels
    from ggraph.backends.llvm import target as T
    feats = T.host_features()
    chosen = T.host_target()
    return {
        "cpu": llvm.get_host_cpu_name(),
        "arch": T.host_arch(),
        "llvmlite": llvmlite.__version__,
        "llvm": ".".join(map(str, llvm.llvm_version_info)),
        "features": {f: f in feats for f in FEATURES_THAT_MATTER.get(T.host_arch(), ())},
        "amx_tiles": ("granted" if T.tile_permission() else "refused by the kernel")
                     if {"amx-tile", "amx-int8"} <= feats else "not on this CPU",
        "runnable": [t.name for t in T.runnable_targets()],
        "chosen": chosen.name,
        "forced": bool(os.environ.get("GGRAPH_TARGET")),
        "gemv_prefetch": chosen.gemv_prefetch.value,
        "linker": jit.system_linker(),
        "kernels": kernels.describe(chosen),
    }


def _prefetch_words() -> dict:
    """What each gemv prefetch does, in words (the plan's Prefetch)."""
    from ggraph.backends.llvm.target import Prefetch
    return {Prefetch.ROWS: "each row asks for the lines 2 and 4 KB on at its start",
            Prefetch.SPREAD: "an AMD CPU: q4_k, q5_k and the 32-weight types ask for the lines 8 KB ahead of "
                             "each group of blocks; other types leave it to the hardware prefetcher"}


def cmd_target(args) -> int:
    """Show the host CPU, the features that matter, and which kernel variant each op gets."""
    info = target_report()
    if args.json:
        json.dump(info, sys.stdout, indent=1)
        print()
        return 0
    print(f"host cpu: {info['cpu']}{'' if info['arch'] == 'x86_64' else ' (' + info['arch'] + ')'} "
          "(as LLVM names it; ggraph trusts the feature map below)")
    print(f"llvmlite {info['llvmlite']}, LLVM {info['llvm']}")
    print("features: " + "  ".join(f"{k}{'+' if v else '-'}" for k, v in info["features"].items()))
    tiled = [op for op, variant in info["kernels"].items() if "AMX" in variant]
    if info["arch"] == "x86_64":
        print(f"AMX tile data: {info['amx_tiles']}" + (f"; tiles in {', '.join(tiled)}" if tiled else ""))
    print(f"feature sets this host runs: {', '.join(info['runnable'])}")
    print(f"chosen: {info['chosen']}" + (" (forced by GGRAPH_TARGET)" if info["forced"] else
                                         " (best available; GGRAPH_TARGET=<set> forces one)"))
    from ggraph.backends.llvm.target import Prefetch, host_os
    print(f"gemv weight prefetch: {info['gemv_prefetch']} ({_prefetch_words()[Prefetch(info['gemv_prefetch'])]})")
    why = "no system linker 'ld' found" if host_os() == "linux" else "ggraph links with 'ld' on Linux only"
    print("programs load: " + (f"as one shared object each, linked by {info['linker']} and cached" if info["linker"]
                               else f"through LLVM's JIT linker (JITLink) in the process: {why}"))
    print("kernels:")
    for op, variant in info["kernels"].items():
        print(f"  {op:<20} {variant}")
    return 0


# ---------------------------------------------------------------------------------------


def add_parser(sub, parents) -> None:
    p = sub.add_parser("target", help="show the host CPU features and the chosen kernel set",
                       description=cmd_target.__doc__, parents=parents)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_target)
