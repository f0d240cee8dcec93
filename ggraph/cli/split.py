"""``ggraph split`` and ``ggraph merge``: a GGUF model as several files and back, as llama.cpp's gguf-split."""
from __future__ import annotations

import argparse
from inspect import cleandoc

from ggraph.units import fmt_bytes

SPLIT_EXAMPLE = """\
examples:
  ggraph split model.gguf out/model --max-size 2G
      out/model-00001-of-00003.gguf ... : at most 2 GB of tensors each
  ggraph split model.gguf out/model --max-tensors 64 --dry-run
      print the files, their tensors and sizes; write nothing
  ggraph run out/model-00001-of-00003.gguf -p "Hello"
      ggraph and llama.cpp load a split model from its first file

The files are those llama-gguf-split --split writes with the same options, byte for byte: the first
carries all the metadata, every file carries split.no, split.count and split.tensors.count.
"""

MERGE_EXAMPLE = """\
example:
  ggraph merge out/model-00001-of-00003.gguf model.gguf

The file is the one llama-gguf-split --merge writes, byte for byte: the first file's metadata
(split.count set to 0) and every file's tensors, in order.
"""


def cmd_split(args) -> int:
    """Split a GGUF model into files of at most --max-size bytes of tensors or --max-tensors tensors each,
    named PREFIX-00001-of-0000N.gguf, as llama.cpp's llama-gguf-split does (its split files and these are
    byte-identical, and either tool merges them)."""
    from ggraph.gguf import GGUFFile
    from ggraph.split import plan_split, write_parts
    max_size = None if args.max_size is None else _max_size(args.max_size)
    with GGUFFile(args.input) as model:
        parts = plan_split(model, args.prefix, max_size=max_size, max_tensors=args.max_tensors,
                           no_tensor_first_split=args.no_tensor_first_split)
        _check_outputs(args, parts)
        _print_plan(f"{args.input}: {len(model.tensors)} tensors into {len(parts)} files", parts)
        if not args.dry_run:
            write_parts(parts, inputs=model.paths, force=args.force, label="splitting")
    return 0


def _max_size(text: str) -> int:
    from ggraph.split import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise ValueError(f"--max-size {e}") from None


def cmd_merge(args) -> int:
    """Merge a split GGUF model, given its first file PREFIX-00001-of-0000N.gguf, into one file, as
    llama.cpp's llama-gguf-split --merge does (byte-identical output); split files of either tool work."""
    from ggraph.gguf import GGUFFile
    from ggraph.split import plan_merge, write_parts
    with GGUFFile(args.input) as model:
        parts = plan_merge(model, args.output)
        _check_outputs(args, parts)
        _print_plan(f"{args.input}: {len(model.paths)} files, {len(model.tensors)} tensors into one", parts)
        if not args.dry_run:
            write_parts(parts, inputs=model.paths, force=args.force, label="merging")
    return 0


def _check_outputs(args, parts) -> None:
    """Every file to write checked before the plan prints: its folder writable, and not there without --force."""
    from ggraph.cli.common import check_output
    if not args.dry_run:
        for part in parts:
            check_output(part.path, args.force, "output")


def _print_plan(title: str, parts) -> None:
    """One line per output file: its path, tensors and size."""
    print(title)
    width = max(len(p.path) for p in parts)
    for p in parts:
        noun = "tensor" if len(p.tensors) == 1 else "tensors"
        print(f"  {p.path:<{width}}  {len(p.tensors):>5} {noun:<7}  {p.nbytes:>15,} bytes ({fmt_bytes(p.nbytes)})")


def add_parser(sub, parents) -> None:
    p = sub.add_parser("split", help="split a GGUF model into several files (llama-gguf-split's format)",
                       description=cleandoc(cmd_split.__doc__), epilog=SPLIT_EXAMPLE, parents=parents,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", metavar="IN.gguf", help="the model to split")
    p.add_argument("prefix", metavar="OUT_PREFIX", help="output path without .gguf: files PREFIX-00001-of-0000N.gguf")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--max-size", metavar="SIZE",
                     help="at most SIZE bytes of tensors a file, in decimal K, M or G as llama-gguf-split reads "
                          "them (200M = 200000000 bytes); headers are not counted, and a larger tensor gets a "
                          "file of its own")
    how.add_argument("--max-tensors", metavar="N", type=int,
                     help="at most N tensors a file (the default: 128, as llama-gguf-split)")
    p.add_argument("--no-tensor-first-split", action="store_true",
                   help="put only the metadata in the first file, the tensors in the others")
    _add_common(p)
    p.set_defaults(fn=cmd_split)

    m = sub.add_parser("merge", help="merge a split GGUF model into one file (llama-gguf-split --merge)",
                       description=cleandoc(cmd_merge.__doc__), epilog=MERGE_EXAMPLE, parents=parents,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("input", metavar="IN-00001-of-0000N.gguf", help="the first file of the split model")
    m.add_argument("output", metavar="OUT.gguf", help="the merged file")
    _add_common(m)
    m.set_defaults(fn=cmd_merge)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="print the files, their tensors and sizes; write nothing")
    p.add_argument("--force", action="store_true",
                   help="overwrite output files that already exist (never the input's own files)")
