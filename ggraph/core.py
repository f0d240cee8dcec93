"""The IR: symbolic dims, avals, Var/Literal/Eqn/Graph, Primitive and its rule tables.

A graph is a jaxpr-like straight-line program:

    { lambda ; x:f32[T,256] w:q8_0[512,256]. let
        a:f32[512,256] = dequant w
        b:f32[T,512] = matmul x a
      in (b) }

Rules live in tables keyed by primitive, registered beside each primitive's definition
(``ggraph/prims.py`` for primitives, ``ggraph/ops.py`` for composites):

- ``shape_rules[p](*in_avals, **params) -> Aval | tuple[Aval, ...]``
- ``impl_rules[p](*arrays, **params) -> ndarray | tuple``   (the numpy reference)
- ``cost_rules[p](eqn, dims) -> (flops, bytes)``
- ``print_rules[p](eqn, names) -> str``                    (optional; default form otherwise)
"""
from __future__ import annotations

import itertools
import re
from typing import Callable, Iterable, Sequence

import numpy as np

from ggraph import dtypes
from ggraph.dtypes import DType


# ---------------------------------------------------------------------------------------
# symbolic dims: integer-linear expressions over named symbols, e.g. T, P+T, 2*T
# ---------------------------------------------------------------------------------------

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
    return d.eval(env) if isinstance(d, Sym) else d


def dim_product(dims: Iterable[Dim]) -> dict[tuple[str, ...], int]:
    """Product of dims as a polynomial {monomial: coefficient}, e.g. T*(P+T) = {PT: 1, TT: 1}.

    Two shapes hold the same number of elements exactly when their products are equal.
    """
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


# ---------------------------------------------------------------------------------------
# avals
# ---------------------------------------------------------------------------------------

class Aval:
    """An abstract value: a shape of dims and a dtype. ``f32["T", 640]`` builds one."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: Sequence, dtype: DType | str):
        self.shape = tuple(as_dim(d) for d in shape)
        self.dtype = dtypes.from_name(dtype)

    def check_blocks(self) -> None:
        """Raise unless the innermost dim is a whole number of blocks (ops that read blocks call this)."""
        if self.dtype.is_quantized and self.shape and isinstance(self.shape[-1], int) \
                and self.shape[-1] % self.dtype.block_size:
            raise ValueError(f"{self}: innermost dim {self.shape[-1]} is not a multiple of "
                             f"the {self.dtype} block size {self.dtype.block_size}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def symbols(self) -> set[str]:
        return {n for d in self.shape if isinstance(d, Sym) for n in d.names}

    def concrete(self, env: dict[str, int]) -> tuple[int, ...]:
        return tuple(eval_dim(d, env) for d in self.shape)

    def nbytes(self, env: dict[str, int] | None = None) -> int:
        return self.dtype.nbytes(self.concrete(env or {}))

    def update(self, shape=None, dtype=None) -> "Aval":
        return Aval(self.shape if shape is None else shape, self.dtype if dtype is None else dtype)

    def __eq__(self, other):
        return isinstance(other, Aval) and self.shape == other.shape and self.dtype is other.dtype

    def __hash__(self):
        return hash((self.shape, self.dtype.name))

    def __str__(self):
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"

    __repr__ = __str__


class DimAval(Aval):
    """The aval of a scalar i32 input that binds a symbolic dim by its value."""

    __slots__ = ("symbol",)

    def __init__(self, symbol: str):
        super().__init__((), dtypes.i32)
        if not re.fullmatch(r"[A-Za-z_]\w*", symbol):
            raise ValueError(f"bad symbol name {symbol!r}")
        self.symbol = symbol

    def __eq__(self, other):
        return isinstance(other, DimAval) and other.symbol == self.symbol

    def __hash__(self):
        return hash(("dim", self.symbol))


class ParamAval(Aval):
    """The aval of a weight: it carries the name of its source tensor (a GGUF tensor name)."""

    __slots__ = ("source",)

    def __init__(self, source: str, aval: Aval):
        super().__init__(aval.shape, aval.dtype)
        self.source = source

    def __eq__(self, other):
        return isinstance(other, ParamAval) and Aval.__eq__(self, other) and other.source == self.source

    def __hash__(self):
        return hash((self.source, self.shape))


def dim(symbol: str) -> DimAval:
    """Declare a scalar i32 input whose value binds ``symbol``, e.g. ``dim("P")`` for the past length."""
    return DimAval(symbol)


def param(source: str, aval: Aval) -> ParamAval:
    """Declare a weight read from tensor ``source``: ``param("blk.0.attn_q.weight", q4_k[1024, 640])``."""
    return ParamAval(source, aval)


# ---------------------------------------------------------------------------------------
# Var, Literal, Eqn, Graph
# ---------------------------------------------------------------------------------------

_var_ids = itertools.count()


class Var:
    """A value defined once: a graph input, a param, or an eqn output. Identity is the object."""

    __slots__ = ("aval", "id", "hint")

    def __init__(self, aval: Aval, hint: str | None = None):
        self.aval = aval
        self.id = next(_var_ids)
        self.hint = hint      # a preferred printing name (an argument name), or None

    def __repr__(self):
        return f"Var#{self.id}:{self.aval}"


class Literal:
    """A constant operand: a python scalar or a small numpy array, with its aval."""

    __slots__ = ("value", "aval")

    def __init__(self, value, dtype: DType | str | None = None):
        arr = np.asarray(value)
        if dtype is None:
            dtype = dtypes.i32 if arr.dtype.kind in "iub" else dtypes.f32
        dtype = dtypes.from_name(dtype)
        self.value = arr.astype(dtype.np_dtype) if dtype.np_dtype is not None else arr
        self.aval = Aval(arr.shape, dtype)

    def key(self):
        return (self.aval.dtype.name, self.value.shape, self.value.tobytes())

    def __repr__(self):
        return f"Literal({self})"

    def __str__(self):
        if self.value.ndim == 0:
            v = self.value.item()
            return repr(float(v)) if self.aval.dtype.is_float else str(int(v))
        return f"const:{self.aval}"


Atom = Var | Literal


class Eqn:
    """``outs = prim[params] ins`` at a scope; composite and fused eqns carry a ``body`` graph."""

    __slots__ = ("prim", "inputs", "outputs", "params", "scope", "body")

    def __init__(self, prim: "Primitive", inputs: Sequence[Atom], outputs: Sequence[Var],
                 params: dict | None = None, scope: str = "", body: "Graph | None" = None):
        self.prim = prim
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.params = dict(params or {})
        self.scope = scope
        self.body = body

    def replace(self, **kw) -> "Eqn":
        fields = dict(prim=self.prim, inputs=self.inputs, outputs=self.outputs,
                      params=self.params, scope=self.scope, body=self.body)
        fields.update(kw)
        return Eqn(**fields)

    def __repr__(self):
        from ggraph.printing import eqn_to_str
        return eqn_to_str(self)


class Graph:
    """invars and params in, eqns in order, outvars out. Immutable by convention: passes build new ones."""

    __slots__ = ("invars", "params", "eqns", "outvars", "in_tree", "out_tree", "name", "args", "meta")

    def __init__(self, invars: Sequence[Var], params: Sequence[Var], eqns: Sequence[Eqn],
                 outvars: Sequence[Atom], in_tree=None, out_tree=None, name: str = "",
                 args: Sequence[Var] | None = None, meta: dict | None = None):
        self.invars = tuple(invars)
        self.params = tuple(params)
        self.eqns = tuple(eqns)
        self.outvars = tuple(outvars)
        self.in_tree = in_tree      # pytree structure of the traced function's arguments
        self.out_tree = out_tree    # and of its result
        self.name = name
        self.args = tuple(args) if args is not None else self.invars + self.params  # leaf order of in_tree
        self.meta = dict(meta or {})  # annotations passes attach, e.g. "memory_plan"

    def replace(self, **kw) -> "Graph":
        fields = {k: getattr(self, k) for k in self.__slots__}
        fields.update(kw)
        return Graph(**fields)

    # -- views -----------------------------------------------------------------------
    @property
    def symbols(self) -> set[str]:
        return {s for v in self.invars for s in v.aval.symbols}

    def params_by_source(self) -> dict[str, Var]:
        return {v.aval.source: v for v in self.params}

    def users(self) -> dict[Var, list[Eqn]]:
        """Map each var to the eqns that read it (graph outputs are not counted)."""
        out: dict[Var, list[Eqn]] = {}
        for e in self.eqns:
            for a in e.inputs:
                if isinstance(a, Var):
                    out.setdefault(a, []).append(e)
        return out

    def producers(self) -> dict[Var, Eqn]:
        return {o: e for e in self.eqns for o in e.outputs}

    def walk(self, expand: bool = False) -> Iterable[Eqn]:
        """Every eqn; with expand, the eqns inside composite bodies too (not the composite itself)."""
        for e in self.eqns:
            if expand and e.body is not None:
                yield from e.body.walk(expand=True)
            else:
                yield e

    def count(self, prim_name: str, expand: bool = False) -> int:
        return sum(e.prim.name == prim_name for e in self.walk(expand))

    # -- checks ----------------------------------------------------------------------
    def verify(self) -> None:
        """Check SSA order and re-run every shape rule; raise VerifyError naming the eqn."""
        verify(self)

    def cost(self, **dims: int) -> dict[str, dict[str, float]]:
        """Flops and bytes moved per op kind, with symbolic dims bound (defaults T=1, P=0)."""
        from ggraph.cost import graph_cost
        return graph_cost(self, dims)

    # -- printing --------------------------------------------------------------------
    def __str__(self):
        from ggraph.printing import graph_to_str
        return graph_to_str(self)

    def pretty(self, expand: bool = False, layer: int | None = None) -> str:
        from ggraph.printing import graph_to_str
        return graph_to_str(self, expand=expand, layer=layer)

    def to_dot(self, layer: int | None = None, collapse: bool = True) -> str:
        from ggraph.printing import graph_to_dot
        return graph_to_dot(self, layer=layer, collapse=collapse)

    def to_networkx(self, layer: int | None = None, collapse: bool = True):
        from ggraph.printing import graph_to_networkx
        return graph_to_networkx(self, layer=layer, collapse=collapse)

    def __repr__(self):
        return f"<Graph {self.name or ''} {len(self.invars)} in, {len(self.params)} params, {len(self.eqns)} eqns>"


# ---------------------------------------------------------------------------------------
# primitives and their rule tables
# ---------------------------------------------------------------------------------------

class Primitive:
    """An operation kind. ``composite`` ones carry a decomposition body; ``kind`` groups them."""

    __slots__ = ("name", "multiple_results", "composite", "kind")

    def __init__(self, name: str, *, multiple_results: bool = False, composite: bool = False,
                 kind: str = "other"):
        self.name = name
        self.multiple_results = multiple_results
        self.composite = composite
        self.kind = kind        # elementwise | reduce | shape | matmul | memory | composite | fused

    def __repr__(self):
        return self.name


primitives: dict[str, Primitive] = {}
shape_rules: dict[Primitive, Callable] = {}
impl_rules: dict[Primitive, Callable] = {}
cost_rules: dict[Primitive, Callable] = {}
print_rules: dict[Primitive, Callable] = {}


def register(name: str, *, shape: Callable, impl: Callable | None = None, cost: Callable | None = None,
             kind: str = "other", multiple_results: bool = False, composite: bool = False) -> Primitive:
    """Make a primitive and file its rules in the tables, in one place."""
    if name in primitives:
        raise ValueError(f"primitive {name!r} is already registered")
    p = Primitive(name, multiple_results=multiple_results, composite=composite, kind=kind)
    primitives[name] = p
    shape_rules[p] = shape
    if impl is not None:
        impl_rules[p] = impl
    if cost is not None:
        cost_rules[p] = cost
    return p


def get_primitive(name: str) -> Primitive:
    try:
        return primitives[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(sorted(primitives))}") from None


class ShapeError(ValueError):
    """A shape or dtype rule failed; the message names the op and the shapes involved."""


def infer(prim: Primitive, in_avals: Sequence[Aval], params: dict) -> tuple[Aval, ...]:
    """Run ``prim``'s shape rule; wrap failures so they name the op and its operand avals."""
    try:
        rule = shape_rules[prim]
    except KeyError:
        raise ShapeError(f"{prim.name}: no shape rule registered") from None
    try:
        out = rule(*in_avals, **params)
    except ShapeError:
        raise
    except (ValueError, TypeError, IndexError) as e:
        ops = ", ".join(str(a) for a in in_avals)
        raise ShapeError(f"{prim.name}({ops}): {e}") from None
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class VerifyError(ValueError):
    """The graph is malformed; the message names the eqn."""


def verify(graph: Graph) -> None:
    from ggraph.printing import eqn_to_str
    defined: set[Var] = set()
    for v in graph.invars + graph.params:
        if v in defined:
            raise VerifyError(f"input {v} appears twice")
        defined.add(v)
    for i, e in enumerate(graph.eqns):
        where = f"eqn {i} ({eqn_to_str(e)})" + (f" in {e.scope}" if e.scope else "")
        if e.prim.name not in primitives or primitives[e.prim.name] is not e.prim:
            raise VerifyError(f"{where}: unknown op {e.prim.name!r}")
        for a in e.inputs:
            if isinstance(a, Var) and a not in defined:
                raise VerifyError(f"{where}: operand {a} is used before it is defined")
        try:
            expected = infer(e.prim, [a.aval for a in e.inputs], _shape_params(e))
        except ShapeError as err:
            raise VerifyError(f"{where}: {err}") from None
        got = tuple(o.aval for o in e.outputs)
        if tuple(Aval.__eq__(x, y) for x, y in zip(expected, got)) != (True,) * len(got) or len(expected) != len(got):
            raise VerifyError(f"{where}: declares outputs {', '.join(map(str, got))} but its shape rule "
                              f"gives {', '.join(map(str, expected))}")
        if e.prim.composite and e.body is None:
            raise VerifyError(f"{where}: composite without a body")
        if e.body is not None:
            try:
                verify(e.body)
            except VerifyError as err:
                raise VerifyError(f"{where}: body: {err}") from None
        for o in e.outputs:
            if o in defined:
                raise VerifyError(f"{where}: output {o} is defined twice")
            defined.add(o)
    for o in graph.outvars:
        if isinstance(o, Var) and o not in defined:
            raise VerifyError(f"graph output {o} is never defined")


def _shape_params(e: Eqn) -> dict:
    """Params a shape rule sees: composites and fused eqns also get their body."""
    return dict(e.params, body=e.body) if e.body is not None else e.params
