"""``ggraph perplexity``: a model's perplexity on a text, chunk by chunk, as llama-perplexity computes it."""
from __future__ import annotations

import argparse

from ggraph.cli.common import add_cache_type_args, add_memory_arg, add_model_arg, model_path


def cmd_perplexity(args) -> int:
    """Measure a model's perplexity on a text file, as llama.cpp's llama-perplexity does by default.

    The text (with the model's BOS) is cut into chunks of --ctx tokens; each chunk runs from an empty
    KV cache with BOS as its first token, and the second half of each chunk is scored. The running
    estimate after each chunk prints as [1]x,[2]y,... and the last line is
    'Final estimate: PPL = x +/- err', the error being one standard error. Compare two quantisations
    of a model on the same text and --ctx to see what the smaller one costs.
    """
    from ggraph.perplexity import perplexity
    text = read_text(args.file)
    perplexity(model_path(args), text, n_ctx=args.ctx, n_chunks=args.chunks, threads=args.threads,
               batch=args.batch, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
               max_memory=args.max_memory)
    return 0


def read_text(path: str) -> str:
    """A text file's contents (UTF-8), with an error naming the file if it is not text."""
    import os
    from pathlib import Path
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{path}: not a regular file (give a text file)")   # a FIFO would block forever
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None


def add_chunk_args(p: argparse.ArgumentParser) -> None:
    """The text and chunking options ggraph perplexity and ggraph imatrix share (llama.cpp's names)."""
    p.add_argument("-f", "--file", required=True, help="the text file (UTF-8)")
    p.add_argument("-c", "--ctx", type=int, default=512,
                   help="chunk size in tokens; also the KV cache rows (default 512, as llama.cpp's)")
    p.add_argument("--chunks", type=int, default=None, help="use at most this many chunks (default: all)")
    p.add_argument("-b", "--batch", type=int, default=512,
                   help="tokens per native step; a longer chunk runs in several (default 512)")
    p.add_argument("--threads", "-t", type=int, default=None, help="threads (default: all cores)")
    add_cache_type_args(p)
    add_memory_arg(p)


def add_parser(sub, parents) -> None:
    p = sub.add_parser("perplexity", help="a model's perplexity on a text, as llama-perplexity",
                       description=cmd_perplexity.__doc__, parents=parents,
                       epilog="example: ggraph perplexity --demo -f wiki.test.raw -c 512 --chunks 20")
    add_model_arg(p)
    add_chunk_args(p)
    p.set_defaults(fn=cmd_perplexity)
