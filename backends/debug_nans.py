"""``GGRAPH_DEBUG_NANS=1``: stop at the first eqn whose output is not finite, and name it (as JAX_DEBUG_NANS).

Both backends check every eqn's float outputs while it is set: the numpy backend after each numpy
rule, the llvm backend with a check kernel after each call (a program built with the flag is cached
apart from one built without). It is read when a program is built; unset, nothing is checked.

    GGRAPH_DEBUG_NANS=1 ggraph run model.gguf -p "..."
    ggraph: error: GGRAPH_DEBUG_NANS: the output of add at blk.3.ffn is not finite (nan at element 17): ...
"""
from __future__ import annotations

import os

import numpy as np

from ggraph.ir.dtypes import ParamAval
from ggraph.ir.graph import Eqn, Literal, Names, eqn_to_str, subgraphs
from ggraph.ir.prims import Blocks

ENV = "GGRAPH_DEBUG_NANS"


def enabled() -> bool:
    """True if ``$GGRAPH_DEBUG_NANS`` is set to anything but empty or 0."""
    return os.environ.get(ENV, "").strip() not in ("", "0")


class NonFiniteError(FloatingPointError, ValueError):
    """An eqn's output held NaN or an infinity while GGRAPH_DEBUG_NANS was set; the message names the eqn."""


def checked(aval) -> bool:
    """Whether an output of this aval is checked: float values with real storage (f32 activations)."""
    return aval.dtype.name == "f32"


def first_non_finite(value) -> tuple[int, float] | None:
    """(flat index, value) of the first NaN or infinity in an array or weight, or None if all are finite."""
    if isinstance(value, Blocks):
        value = value.dequantize()
    arr = np.asarray(value)
    if arr.dtype.kind != "f":
        return None
    bad = np.flatnonzero(~np.isfinite(arr))
    return (int(bad[0]), float(arr.reshape(-1)[bad[0]])) if bad.size else None


def error(e: Eqn, output: int, where: tuple[int, float] | None, inputs) -> NonFiniteError:
    """The error for eqn ``e`` whose ``output`` holds a non-finite value (at ``where`` if known).
    ``inputs``: (atom, value) for the operands whose values are at hand (graph inputs and weights on
    llvm, where every other operand was checked when it was made; every operand on numpy); the first
    non-finite one is named as the cause."""
    at = e.scope or "top level"
    found = "" if where is None else f" ({_kind(where[1])} at element {where[0]})" if where[1] is not None \
        else f" (first at element {where[0]})"
    cause = "its operands are finite: the op made it"
    names = Names()
    text = " ".join(eqn_to_str(e, names).split())           # one line, however the op prints
    for atom, value in inputs:
        bad = None if isinstance(atom, Literal) or value is None else first_non_finite(value)
        if bad is not None:
            what = f"weight {atom.aval.source!r}" if isinstance(atom.aval, ParamAval) else f"operand {names[atom]}"
            cause = f"its {what} already holds {_kind(bad[1])} (element {bad[0]})"
            break
    fused = " (a fused op: --passes none shows its ops one by one)" if e.prim.kind == "fused" else \
        f" (its {subgraphs(e)[0][0]} runs inside it: the numpy backend names the op there that made it)" \
        if subgraphs(e) else ""
    return NonFiniteError(f"{ENV}: output {output} of {e.prim.name} at {at} is not finite{found}; {cause}: "
                          f"{text}{_operands(e, names)}{fused}")


def _operands(e: Eqn, names: Names) -> str:
    """What the printed eqn's operand names stand for: `` with b:f32[T,64], c = param "blk.1.ffn_up.weight"``."""
    parts = [f"{names[a]} = param {a.aval.source!r}" if isinstance(a.aval, ParamAval) else names.decl(a)
             for a in dict.fromkeys(a for a in e.inputs if not isinstance(a, Literal))]
    return f" with {', '.join(parts)}" if parts else ""


def _kind(x: float) -> str:
    return "nan" if np.isnan(x) else ("+inf" if x > 0 else "-inf")
