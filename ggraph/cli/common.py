"""What every ``ggraph`` command shares: the model argument, compile options, pass names, plugins."""
from __future__ import annotations

import argparse


def model_path(args) -> str:
    """The GGUF path a command runs on: the MODEL argument, or the demo model with --demo."""
    if getattr(args, "demo", False):
        from ggraph.demo import demo_model_path
        return str(demo_model_path())
    if not args.model:
        raise ValueError("give a MODEL path (a .gguf file) or --demo")
    return args.model


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="path to a .gguf file (the first file of a split model)")
    p.add_argument("--demo", action="store_true", help="use the demo model, Gemma 3 270M Q4_K_M (needs ggraph[demo])")


def add_pass_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--passes", default="default", help="pipeline: default, none (unfused), or pass,pass,...")
    p.add_argument("--no-pass", action="append", default=[], metavar="NAME", help="switch off one pass (repeatable)")


def add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["numpy", "llvm"], default="llvm",
                   help="llvm: native code for this CPU (default); numpy: the slow reference interpreter")
    p.add_argument("--threads", "-t", type=int, default=None, help="threads for the llvm backend (default: all cores)")
    add_pass_args(p)
    p.add_argument("--ctx", type=int, default=4096, help="context length: KV cache rows (default 4096)")
    add_memory_arg(p)


def add_memory_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-memory", metavar="SIZE", default=None,
                   help="refuse to allocate more than SIZE for KV caches and activations, e.g. 8G (default: the "
                        "memory this machine has available)")


def plugin_parent() -> argparse.ArgumentParser:
    """The options every command takes: --plugin FILE.py, loaded before the command runs."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--plugin", action="append", default=[], metavar="FILE.py",
                   help="load a plugin file first: it may register architectures and ops (repeatable; "
                        "$GGRAPH_PLUGINS and the 'ggraph.architectures' entry points load too)")
    return p


def passes_arg(text: str):
    """'default', 'none', or a comma-separated list of pass names."""
    return text if text in ("default", "none") else [p.strip() for p in text.split(",") if p.strip()]


def pipeline_names(args, passes_text: str | None = None) -> list[str]:
    """The pass names a --passes / --no-pass / --after combination runs, every name checked."""
    from ggraph.passes import PASSES, pipeline
    names = pipeline(passes_arg(passes_text or args.passes), args.no_pass)
    unknown = sorted(set(args.no_pass) - set(PASSES)) + sorted(set(names) - set(PASSES))
    if unknown:
        raise KeyError(f"unknown pass(es) {', '.join(unknown)}; available: {', '.join(PASSES)}")
    after = getattr(args, "after", None)
    if after:
        if after not in names:
            raise ValueError(f"--after {after}: that pass is not in the pipeline ({', '.join(names) or 'empty'})")
        names = names[:names.index(after) + 1]
    return names
