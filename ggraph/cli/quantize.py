"""``ggraph quantize``: a GGUF model to one of llama.cpp's file types (Q4_K_M, Q8_0, IQ4_XS, ...)."""
from __future__ import annotations

import argparse
import os
from collections import Counter

from ggraph.cli.common import add_force_arg, check_output
from ggraph.units import fmt_bytes

EXAMPLES = """\
examples:
  ggraph quantize model-f16.gguf model-q4_k_m.gguf Q4_K_M
  ggraph imatrix model-f16.gguf -f calibration.txt -o imatrix.gguf
  ggraph quantize model-f16.gguf model-iq4_xs.gguf IQ4_XS --imatrix imatrix.gguf
  ggraph quantize model-f16.gguf - Q5_K_M --dry-run      # the plan only: types and sizes

types (llama.cpp's names and mixes; in every quantised type but Q8_0 and MXFP4_MOE, output.weight, or
token_embd.weight when the output is tied to it, is q6_k; norms, other 1-D tensors and MoE routers stay as
they are; in a model of 8 experts attn_k and attn_v are q8_0 and most k-quant mixes give attn_output q5_k; the
FFN rules read each expert tensor's layer from its name):
"""


def _types_help() -> str:
    from ggraph.quantize import ALIASES, FILE_TYPES
    rows = [f"  {ft.name:<9} {ft.about}" for ft in FILE_TYPES.values()]
    return EXAMPLES + "\n".join(rows) + "\n  aliases: " + ", ".join(f"{a} = {b}" for a, b in ALIASES.items())


def _tensor_type(text: str) -> str:
    """argparse type of --output-tensor-type and --token-embedding-type: one of quantize.TENSOR_TYPES."""
    from ggraph.quantize import tensor_type
    try:
        return tensor_type(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _load_imatrix(path: str):
    """(per-tensor importance vectors, the quantize.imatrix.* keys to record) from an imatrix file."""
    from ggraph import imatrix
    from ggraph.quantize import imatrix_keys
    if not os.path.isfile(path):                  # a FIFO would block the read forever
        raise ValueError(f"--imatrix {path}: no such file" if not os.path.exists(path) else
                         f"--imatrix {path}: not a regular file")
    data = imatrix.read(path)
    return data.vectors(), imatrix_keys(path, data.datasets, len(data.sums), data.chunk_count)


def cmd_quantize(args) -> int:
    """Quantise a GGUF model as llama-quantize does: the same tensor types, bit for bit the same blocks.

    The input is usually an f16/bf16/f32 file (from `ggraph convert`); already quantised tensors
    are requantised only with --allow-requantize. With --imatrix (from `ggraph imatrix` or
    llama-imatrix) the quantisers weight each column's error by its importance."""
    from ggraph import quantize as Q
    from ggraph.gguf import GGUFFile
    ft = Q.file_type(args.type)
    if not os.path.isfile(args.input):            # a FIFO or a folder would get a confusing error later
        raise ValueError(f"{args.input}: no such file" if not os.path.exists(args.input) else
                         f"{args.input}: not a regular file")
    if not args.dry_run:
        check_output(args.output, args.force, "output", source=args.input)
    weights, meta = _load_imatrix(args.imatrix) if args.imatrix else (None, None)
    options = dict(pure=args.pure, leave_output=args.leave_output_tensor, output_type=args.output_tensor_type,
                   token_embedding_type=args.token_embedding_type)
    if args.dry_run:
        with GGUFFile(args.input) as f:
            plan = Q.plan(f, ft, has_imatrix=weights is not None, **options)
            _print_plan(f, plan)
        return 0
    plan = Q.quantize_file(args.input, args.output, ft, imatrix=weights, imatrix_meta=meta,
                           allow_requantize=args.allow_requantize, threads=args.threads, **options)
    _note_fallbacks(plan)
    with GGUFFile(args.output) as g:
        print(f"{args.output}: {ft.name}, {fmt_bytes(g.nbytes)} of weights "
              f"({_type_counts(t.dtype for t in g.tensors.values())})")
    return 0


def _type_counts(types) -> str:
    return ", ".join(f"{n} {t}" for t, n in Counter(str(t) for t in types).most_common())


def _print_plan(f, plan) -> None:
    """One line per tensor: name, shape, type now -> type after, and the sizes."""
    width = max(len(n) for n in plan.types)
    before = after = 0
    for name, t in plan.types.items():
        info = f.tensors[name]
        new = t.nbytes(info.shape)
        before, after = before + info.nbytes, after + new
        shape = "x".join(map(str, info.shape))
        print(f"{name:<{width}}  {shape:<14} {str(info.dtype):>6} -> {str(t):<6} {fmt_bytes(new):>10}")
    print(f"total: {fmt_bytes(before)} -> {fmt_bytes(after)} ({_type_counts(plan.types.values())})")
    _note_fallbacks(plan)


def _note_fallbacks(plan) -> None:
    """One line on the tensors whose rows are not whole blocks of the type the mix chose."""
    if plan.fallbacks:
        swaps = Counter(f"{want} -> {got}" for _, want, got in plan.fallbacks)
        print(f"note: {len(plan.fallbacks)} tensors have rows that are not whole blocks of their type and "
              f"took llama.cpp's fallback ({', '.join(f'{s} x{n}' for s, n in swaps.items())})")


def add_parser(sub, parents) -> None:
    p = sub.add_parser("quantize", help="quantise a GGUF model (Q4_K_M, Q8_0, IQ4_XS, ...)",
                       description=cmd_quantize.__doc__, epilog=_types_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter, parents=parents)
    p.add_argument("input", help="the GGUF model to quantise (f16, bf16 or f32 tensors)")
    p.add_argument("output", help="the quantised file to write ('-' with --dry-run)")
    p.add_argument("type", help="llama.cpp's file type name: Q4_K_M, Q5_K_S, Q6_K, Q8_0, IQ4_XS, ... (see below)")
    p.add_argument("--imatrix", metavar="FILE", help="importance matrix (imatrix.gguf or legacy .dat)")
    output = p.add_mutually_exclusive_group()
    output.add_argument("--leave-output-tensor", action="store_true", help="keep output.weight as it is")
    output.add_argument("--output-tensor-type", metavar="TYPE", type=_tensor_type,
                        help="the type of output.weight (e.g. q8_0)")
    p.add_argument("--pure", action="store_true", help="no mix: every quantisable tensor gets the type's default")
    p.add_argument("--token-embedding-type", metavar="TYPE", type=_tensor_type, help="the type of token_embd.weight")
    p.add_argument("--allow-requantize", action="store_true",
                   help="requantise tensors that are already quantised (loses quality)")
    p.add_argument("--dry-run", action="store_true", help="print each tensor's new type and size; write nothing")
    p.add_argument("--threads", "-t", type=int, default=None, help="quantising threads (default: all cores)")
    add_force_arg(p)
    p.set_defaults(fn=cmd_quantize)
