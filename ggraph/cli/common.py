"""What every ``ggraph`` command shares: the model argument, compile and sampling options, pass names, plugins."""
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


def check_output(path: str, force: bool, what: str, source: str | None = None) -> None:
    """Refuse an output before any work (not after it): one in a folder that cannot be written, the ``source``
    itself, and one that exists unless --force. A FIFO or a device (/dev/stdout) is written to, not replaced.
    ``what`` names the output as the command line does: '-o', '--plot', 'output'."""
    import os
    import tempfile
    if os.path.isdir(path):
        raise ValueError(f"{what} {path}: is a directory; give the output file's name")
    if os.path.exists(path) and not os.path.isfile(path):
        return
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"{what} {path}: {folder} is not a directory" if os.path.exists(folder) else
                         f"{what} {path}: no such directory {folder}")
    try:                                          # only creating a file says whether one can be created
        tempfile.NamedTemporaryFile(dir=folder, prefix=".ggraph-check-").close()
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot write in {folder} ({e.strerror})") from None
    if source is not None and os.path.exists(path) and os.path.exists(source) and os.path.samefile(path, source):
        raise ValueError(f"{what} {path}: input and output are the same file")
    if os.path.exists(path) and not force:
        raise ValueError(f"{path} already exists: remove it or give --force to overwrite it")


def add_force_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="overwrite an output file that already exists")


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="path to a .gguf file (the first file of a split model)")
    p.add_argument("--demo", action="store_true", help="use the demo model, Gemma 3 270M Q4_K_M (needs ggraph[demo])")


def add_pass_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--passes", default="default",
                   help="pipeline: default, none (unfused), imatrix (default + instrument_imatrix), or pass,pass,...")
    p.add_argument("--no-pass", action="append", default=[], metavar="NAME", help="switch off one pass (repeatable)")


def add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["numpy", "llvm"], default="llvm",
                   help="llvm: native code for this CPU (default); numpy: the slow reference interpreter")
    p.add_argument("--threads", "-t", type=int, default=None, help="threads for the llvm backend (default: all cores)")
    add_pass_args(p)
    add_ctx_arg(p)
    add_cache_type_args(p)
    add_memory_arg(p)


DEFAULT_CTX = 4096


def add_ctx_arg(p: argparse.ArgumentParser) -> None:
    """--ctx / -c, as llama.cpp and ggraph perplexity name it."""
    p.add_argument("--ctx", "-c", type=int, default=None, metavar="N",
                   help=f"context length: KV cache rows (default {DEFAULT_CTX}, or the model's trained context "
                        f"if that is shorter)")


def context_length(args, path: str) -> int:
    """--ctx as given; else DEFAULT_CTX, or the model's trained context when that is shorter (so that a
    length nobody asked for is never past what the model was trained on)."""
    if args.ctx is not None:
        return args.ctx
    from ggraph.models import load
    return min(DEFAULT_CTX, load(path).config.n_ctx_train)


def add_cache_type_args(p: argparse.ArgumentParser) -> None:
    """-ctk / -ctv, as llama.cpp names them."""
    from ggraph.runtime.session import CACHE_TYPES
    for which in ("k", "v"):
        p.add_argument(f"--cache-type-{which}", f"-ct{which}", default="f16", choices=CACHE_TYPES, metavar="TYPE",
                       help=f"KV cache type for {which.upper()}: {', '.join(CACHE_TYPES)} (default f16; q8_0 takes "
                            f"about half of f16's memory, q4_0 about a quarter, at some accuracy)")


def add_sampling_args(p: argparse.ArgumentParser, n_predict: int, n_help: str) -> None:
    p.add_argument("-n", "--n-predict", type=int, default=n_predict, help=n_help)
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens (default 40; 0 = all)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05,
                   help="drop tokens below min-p × the top probability (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalty for recent tokens (default 1.0 = off)")
    p.add_argument("--seed", type=seed, default=None,
                   help="random seed for sampling, >= 0 (default -1: a random seed, as llama.cpp's)")
    p.add_argument("--stop", action="append", default=[], type=nonempty, metavar="TEXT",
                   help="stop at this text (repeatable)")


def seed(text: str) -> int | None:
    """argparse type of --seed: a whole number >= 0, or -1 for a random one (None)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < -1:
        raise argparse.ArgumentTypeError(f"must be >= 0, or -1 for a random seed; got {n}")
    return None if n == -1 else n


def nonempty(text: str) -> str:
    """argparse type of a text that means nothing when empty (--stop, --prompt)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty text")
    return text


def sampling_options(args) -> dict:
    """Session.generate's keywords from the sampling arguments, each checked before anything slow runs."""
    from ggraph.runtime.sampling import Sampler
    Sampler(args.temp, args.top_k, args.top_p, args.min_p, args.repeat_penalty)
    if args.n_predict < -1:
        raise ValueError(f"--n-predict must be >= -1 (-1: until the end of text), got {args.n_predict}")
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop)


def open_session(args, passes):
    """The Session the compile arguments describe, with ``passes`` (resolved_passes(args)), compiled (with its
    progress bar) before it is returned."""
    from ggraph.runtime.session import Session
    path = model_path(args)
    session = Session(path, backend=args.backend, threads=args.threads, passes=passes,
                      ctx=context_length(args, path), max_memory=args.max_memory,
                      cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v)
    session.program(last_only=True)
    return session


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


def resolved_passes(args, text: str | None = None, flag: str = "--passes") -> tuple:
    """The passes ``flag`` (--passes unless ``text`` is another flag's value) and --no-pass name, resolved once
    and every name checked; --after, where the command has it, ends the pipeline at that pass."""
    from ggraph.passes import resolve
    passes = resolve(args.passes if text is None else text, args.no_pass, flags=(flag, "--no-pass"))
    after = getattr(args, "after", None)
    if after:
        names = [p.name for p in passes]
        if after not in names:
            raise ValueError(f"--after {after}: that pass is not in the pipeline ({', '.join(names) or 'empty'})")
        passes = passes[:names.index(after) + 1]
    return passes
