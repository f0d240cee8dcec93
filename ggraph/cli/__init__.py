"""The ``ggraph`` command line: one module per verb, each with ``add_parser`` and its command.

    inspect   a GGUF file's metadata and tensors         run     generate text
    chat      a conversation in the terminal             serve   an OpenAI-compatible HTTP API
    dump      the graph after the passes, explained      diff    two pipelines compared
    bench     prefill/decode speed, llama.cpp beside     target  the CPU and its kernels
    split     a model as several files (gguf-split)      merge   split files back into one
    imatrix   an importance matrix from text             perplexity  a model's perplexity on a text
    convert   a Hugging Face model folder as a GGUF file  quantize  a model to Q4_K_M, Q8_0, IQ4_XS, ...
    explore   the compiled graph in Model Explorer, pass by pass, with cost and profile overlays

Every verb takes ``--plugin FILE.py``; plugins load before the command runs.
"""
from __future__ import annotations

import argparse
import os
import sys

from ggraph.cli import (bench, chat, convert, diff, dump, explore, imatrix, inspect, perplexity, quantize, run, serve,
                        split, target)
from ggraph.cli.common import plugin_parent

VERBS = (inspect, run, chat, serve, dump, diff, explore, bench, target, convert, imatrix, quantize, split, perplexity)


class Parser(argparse.ArgumentParser):
    """argparse, its usage errors one line on stderr (exit 2) that points at --help instead of the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ggraph",
        description="ggraph: trace, fuse and run LLMs from GGUF files on CPUs.",
        epilog="Run 'ggraph COMMAND --help' for each command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parents = [plugin_parent()]
    for verb in VERBS:
        verb.add_parser(sub, parents)
    return parser


def main(argv=None) -> int:
    from ggraph import plugins
    from ggraph.passes import PassError
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    try:
        if os.environ.get("GGRAPH_TARGET", "").strip():     # a set this host cannot run: refused before any work
            from ggraph.backends.llvm.target import forced_target
            forced_target(os.environ["GGRAPH_TARGET"].strip())
        plugins.load_defaults()
        for path in args.plugin:
            plugins.load_file(path)
        return args.fn(args)
    except BrokenPipeError:                     # `ggraph inspect x | head` is fine
        sys.stdout = open(os.devnull, "w")
        return 0
    except (OSError, ValueError, KeyError, IndexError, TypeError, NotImplementedError, PassError,
            plugins.PluginError) as e:          # the user's input, not our bug
        msg = e.args[0] if isinstance(e, KeyError) and e.args else \
            f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else e
        print(f"ggraph {args.command}: error: {msg}", file=sys.stderr)
        return 1
    except MemoryError as e:                    # an allocation nothing budgeted: one line, not a traceback
        print(f"ggraph {args.command}: error: out of memory{f': {e}' if str(e) else ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
