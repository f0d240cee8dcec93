"""Symbolic dims: integer-linear expressions over named symbols, e.g. T, P+T, 2*T.

A dim is an int or a ``Sym``. Symbols are bound at run time (T: tokens in this step,
P: the past length), so one compiled program serves every prompt length. Products of
dims that are not linear (T·(P+T)) are polynomials: ``dim_product`` gives them, and two
shapes hold the same number of elements exactly when their polynomials are equal.
"""
from __future__ import annotations

import re
from typing import Iterable

import numpy as np


class Sym:
    """A dim known only at run time: a sum of integer multiples of symbols plus a constant."""

    __slots__ = ("terms", "const", "_hash")

    def __init__(self, terms: dict[str, int] | str, const: int = 0):
        if isinstance(terms, str):
            parsed = _parse_sym(terms)
            terms, const = parsed.terms, parsed.const + const
        self.terms = tuple(sorted((n, c) for n, c in dict(terms).items() if c != 0))
        self.const = int(const)
        self._hash = hash((self.terms, self.const))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.terms)

    def eval(self, env: dict[str, int]) -> int:
        try:
            return self.const + sum(c * int(env[n]) for n, c in self.terms)
        except KeyError as e:
            raise ValueError(f"symbolic dim {self} needs a value for {e.args[0]!r}; bound: {sorted(env)}") from None

    def _combine(self, other, sign: int) -> "Dim":
        terms = dict(self.terms)
        if isinstance(other, Sym):
            for n, c in other.terms:
                terms[n] = terms.get(n, 0) + sign * c
            return simplify(Sym(terms, self.const + sign * other.const))
        if isinstance(other, (int, np.integer)):
            return simplify(Sym(terms, self.const + sign * int(other)))
        return NotImplemented

    def __add__(self, other): return self._combine(other, 1)
    def __radd__(self, other): return self._combine(other, 1)
    def __sub__(self, other): return self._combine(other, -1)
    def __rsub__(self, other): return (self * -1) + other

    def __mul__(self, k):
        if isinstance(k, (int, np.integer)):
            return simplify(Sym({n: c * int(k) for n, c in self.terms}, self.const * int(k)))
        return NotImplemented
    __rmul__ = __mul__

    def __eq__(self, other):
        if isinstance(other, Sym):
            return self.terms == other.terms and self.const == other.const
        return False

    def __hash__(self):
        return self._hash

    def __str__(self):
        parts = [(n if c == 1 else f"{c}*{n}") for n, c in self.terms]
        s = "+".join(parts).replace("+-", "-")
        if self.const:
            s += f"{self.const:+d}"
        return s

    __repr__ = __str__


Dim = int | Sym

_SYM_TERM = re.compile(r"\s*([+-]?)\s*(?:(\d+)\s*\*\s*)?([A-Za-z_]\w*|\d+)\s*")


def _parse_sym(text: str) -> Sym:
    """Parse 'T', 'P+T', '2*T-1' into a Sym."""
    terms: dict[str, int] = {}
    const, pos = 0, 0
    while pos < len(text):
        m = _SYM_TERM.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot parse symbolic dim {text!r} at {text[pos:]!r}")
        sign = -1 if m.group(1) == "-" else 1
        coef = int(m.group(2)) if m.group(2) else 1
        atom = m.group(3)
        if atom.isdigit():
            const += sign * coef * int(atom)
        else:
            terms[atom] = terms.get(atom, 0) + sign * coef
        pos = m.end()
    return Sym(terms, const)


def simplify(d) -> Dim:
    """A Sym with no symbols left becomes a plain int."""
    if isinstance(d, Sym) and not d.terms:
        return d.const
    return d


def as_dim(d) -> Dim:
    """Normalise a user-written dim: int, 'T', 'P+T', or Sym."""
    if isinstance(d, (bool, np.bool_)):
        raise TypeError(f"a dim cannot be a bool: {d!r}")
    if isinstance(d, (int, np.integer)):
        if d < 0:
            raise ValueError(f"negative dim {d}")
        return int(d)
    if isinstance(d, str):
        return simplify(_parse_sym(d))
    if isinstance(d, Sym):
        return simplify(d)
    raise TypeError(f"a dim must be an int, a symbol name or a Sym, not {type(d).__name__}: {d!r}")


def eval_dim(d: Dim, env: dict[str, int]) -> int:
    return d.eval(env) if isinstance(d, Sym) else int(d)


def product(dims: Iterable[Dim]) -> Dim:
    """The product of dims that holds at most one symbolic factor (an int or a Sym): rows, elements."""
    out: Dim = 1
    for d in dims:
        if isinstance(d, Sym) and isinstance(out, Sym):
            raise ValueError(f"the product of {out} and {d} is not linear; use dim_product")
        out = d * out if isinstance(d, Sym) else out * int(d)
    return simplify(out) if isinstance(out, Sym) else out


def dim_product(dims: Iterable[Dim]) -> dict[tuple[str, ...], int]:
    """Product of dims as a polynomial {monomial: coefficient}, e.g. T*(P+T) = {PT: 1, TT: 1}."""
    poly: dict[tuple[str, ...], int] = {(): 1}
    for d in dims:
        factor = {(n,): c for n, c in d.terms} | ({(): d.const} if d.const else {}) \
            if isinstance(d, Sym) else {(): int(d)}
        out: dict[tuple[str, ...], int] = {}
        for m1, c1 in poly.items():
            for m2, c2 in factor.items():
                m = tuple(sorted(m1 + m2))
                out[m] = out.get(m, 0) + c1 * c2
        poly = {m: c for m, c in out.items() if c}
    return poly


def poly_str(poly: dict[tuple[str, ...], int]) -> str:
    if not poly:
        return "0"
    return "+".join("*".join(([] if c == 1 and m else [str(c)]) + list(m)) for m, c in sorted(poly.items()))
