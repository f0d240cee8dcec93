"""``ggraph inspect``: a GGUF file's metadata, tensors and per-type totals."""
from __future__ import annotations

import json
import math
import sys
from collections import Counter

from ggraph.cli.common import add_model_arg, model_path
from ggraph.quantize import FILE_TYPE_NAMES
from ggraph.units import fmt_bytes

ARRAY_PREVIEW = 8


def _summary(value, full: bool = False):
    """A JSON-able value (strict JSON: a NaN or infinity becomes its name as a string); arrays longer
    than ARRAY_PREVIEW are summarised unless ``full``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)):
        return value
    seq = list(value) if full or len(value) <= ARRAY_PREVIEW else [value[i] for i in range(ARRAY_PREVIEW)]
    seq = [_summary(x.item() if hasattr(x, "item") else x) for x in seq]
    if full or len(value) <= ARRAY_PREVIEW:
        return seq
    return {"array_length": len(value), "head": seq}


def _fmt_value(value) -> str:
    if isinstance(value, str):
        return repr(value) if len(value) < 80 else repr(value[:77] + "...")
    if isinstance(value, (int, float, bool)):
        return str(value)
    n = len(value)
    head = ", ".join(_fmt_value(value[i].item() if hasattr(value[i], "item") else value[i])
                     for i in range(min(n, 4)))
    return f"[{n} items] {head}{', ...' if n > 4 else ''}"


def cmd_inspect(args) -> int:
    """Show a GGUF file's metadata, tensor table and per-type totals."""
    from ggraph.gguf import GGUFFile
    path = model_path(args)
    with GGUFFile(path) as f:
        tensors = list(f.tensors.values())
        if args.json:
            out = {"path": path, "version": f.version, "alignment": f.alignment,
                   "metadata": {k: _summary(v, args.full) for k, v in f.metadata.items()},
                   "tensors": [{"name": t.name, "shape": list(t.shape), "type": str(t.dtype),
                                "offset": t.offset, "nbytes": t.nbytes} for t in tensors]}
            json.dump(out, sys.stdout, indent=1, allow_nan=False)
            print()
            return 0
        md = f.metadata
        n_params = sum(math.prod(t.shape) for t in tensors)
        total = sum(t.nbytes for t in tensors)
        ft = md.get("general.file_type", "?")
        ftype = FILE_TYPE_NAMES.get(ft, ft) if isinstance(ft, int) else _fmt_value(ft)
        print(f"{path}: GGUF v{f.version}, {len(md)} keys, {len(tensors)} tensors, {fmt_bytes(total)} of weights")
        print(f"architecture {f.architecture or '?'} · {md.get('general.name', '?')} · "
              f"{n_params / 1e6:.1f}M params · {8 * total / max(n_params, 1):.2f} bits/weight · file type {ftype}")
        print("\nmetadata:")
        for k, v in md.items():
            print(f"  {k} = {_fmt_value(v)}")
        print("\ntensors:")
        width = max((len(t.name) for t in tensors), default=4)
        print(f"  {'name':<{width}}  {'shape':<16} {'type':<7} {'bytes':>10}")
        for t in tensors:
            shape = "x".join(map(str, t.shape))
            print(f"  {t.name:<{width}}  {shape:<16} {str(t.dtype):<7} {t.nbytes:>10}")
        print("\ntotals by type:")
        by_type, counts, elems = Counter(), Counter(), Counter()
        for t in tensors:
            by_type[str(t.dtype)] += t.nbytes
            counts[str(t.dtype)] += 1
            elems[str(t.dtype)] += math.prod(t.shape)
        for name, nbytes in by_type.most_common():
            print(f"  {name:<7} {counts[name]:>4} tensors {elems[name] / 1e6:>9.2f}M weights "
                  f"{fmt_bytes(nbytes):>10} {8 * nbytes / max(elems[name], 1):>6.2f} bits/weight")
    return 0


def add_parser(sub, parents) -> None:
    p = sub.add_parser("inspect", help="show a GGUF file's metadata and tensors", description=cmd_inspect.__doc__,
                       parents=parents)
    add_model_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with metadata and tensors")
    p.add_argument("--full", action="store_true", help="with --json, include long arrays in full")
    p.set_defaults(fn=cmd_inspect)
