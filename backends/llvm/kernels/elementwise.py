"""Fused elementwise row loops, and the copy kernels for the shape ops that move data.

    emit_fused(module, target, body, in_avals, out_avals, name)
        void name(ptr in0, ..., ptr out0, ..., i64 rows, i32 ith, i32 nth)
    emit_transpose / emit_slice / emit_concat / emit_broadcast(module, target, ..., name)
        void name(ptr x0, ..., ptr y, i64 <symbol>..., i32 ith, i32 nth)
    emit_cast(module, target, aval, dtype, name)             the fused ABI, one cast

A fused body (a Graph of elementwise primitives and last-axis reductions, composites
inlined) runs as one loop over rows. Its iteration space is the broadcast of every shape
in the body: N is its static last dim and rows the product of the others (at most one of
them symbolic; `fused_rows(body)` gives that count as a dim expression). Each operand reads
a row at the offset its own leading dims give (0 along broadcast dims) and holds either
N values along the row or one value for the whole row (a [rows, 1] column, a scalar).

Inside a row, values that vary along N are computed a vector chunk at a time, with one
narrower chunk for the tail; values that do not (columns, reduction results, constants)
are per-row scalars splatted where needed. A reduction needs the whole row first, so the
row is walked once per level of reductions: pass 0 accumulates the reductions of inputs,
pass 1 those that depend on them, and the last pass computes and stores the outputs
(rms_norm: 2 passes, softmax: 3). Values are recomputed in each pass that needs them; a
row stays in L1. The generic target gets the same loops one element at a time, with libm.

An output may overwrite an input of the same shape (plan_memory's in-place outputs): each
chunk, and each row's per-row outputs, reads everything it needs before it stores, and
fused kernels make no noalias promise. Copy kernels take the value of every symbol their
shapes mention as i64 arguments, in sorted name order (`kernel_args(fn)` lists all
argument names); their pointers are `noalias`, outputs must not overlap inputs.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from llvmlite import ir

from ggraph import dtypes
from ggraph.core import Aval, Graph, Literal, Sym, Var
from ggraph.backends.llvm.kernels import vmath
from ggraph.backends.llvm.kernels.builder import Kernel, f32, i8, i16, i32, vec
from ggraph.backends.llvm.kernels.isa import Isa, mangle, vector_path
from ggraph.backends.llvm.target import Target
from ggraph.prims import broadcast_shapes


def variant(target: Target) -> str:
    """How fused loops run on `target` (for `ggraph target`)."""
    if not vector_path(target):
        return "scalar (generic twin), libm exp/log/tanh/sin/cos"
    return (f"{target.vector_bits // 32} f32 lanes, one narrow tail chunk; "
            f"polynomial exp/log/tanh/sin/cos; one pass per reduction level")


def kernel_args(fn: ir.Function) -> tuple[str, ...]:
    """Names of a kernel's arguments before (ith, nth): pointers, then i64 sizes."""
    return tuple(a.name for a in fn.args[:-2])


def _existing(module: ir.Module, name: str) -> ir.Function | None:
    return module.globals[name] if Kernel.exists(module, name) else None


# ---------------------------------------------------------------------------------------
# dtypes: how each is held in registers and in memory
# ---------------------------------------------------------------------------------------

#  dtype: (register lane type, memory lane type, bytes)    f16 computes in f32, rounded after each op
_TYPES = {dtypes.f32: (f32, f32, 4), dtypes.f16: (f32, i16, 2), dtypes.i32: (i32, i32, 4), dtypes.i8: (i8, i8, 1)}


def _check_dtype(aval: Aval, what: str) -> None:
    if aval.dtype not in _TYPES:
        raise ValueError(f"fused: {what} {aval} has dtype {aval.dtype}; supported: "
                         f"{', '.join(d.name for d in _TYPES)}")


def _typ(elem: ir.Type, width: int) -> ir.Type:
    return elem if width == 1 else vec(elem, width)


def _load(k: Kernel, isa: Isa, dt, base, index, width: int) -> ir.Value:
    """`width` elements of dtype dt at element `index`, as register values."""
    reg, mem, size = _TYPES[dt]
    raw = k.load(_typ(mem, width), base, k.mul(index, size))
    return isa.f16_to_f32(raw) if dt is dtypes.f16 else raw


def _store(k: Kernel, isa: Isa, dt, value: ir.Value, base, index) -> None:
    size = _TYPES[dt][2]
    k.store(isa.f32_to_f16(value) if dt is dtypes.f16 else value, base, k.mul(index, size))


def _const(value, dt, width: int) -> ir.Constant:
    reg = _TYPES[dt][0]
    v = float(value) if reg is f32 else int(value)
    return ir.Constant(reg, v) if width == 1 else ir.Constant(vec(reg, width), [v] * width)


# ---------------------------------------------------------------------------------------
# the ops a fused body may hold
# ---------------------------------------------------------------------------------------

def _fmax(ev, x, y):
    """numpy's maximum: the larger, and NaN if either is NaN."""
    b = ev.b
    m = b.select(b.fcmp_ordered(">", x, y), x, y)
    return b.select(b.fcmp_unordered("uno", x, x), x, m)


def _imax(ev, x, y):
    return ev.b.select(ev.b.icmp_signed(">", x, y), x, y)


def _less(ev, x, y):
    b = ev.b
    elem = x.type.element if isinstance(x.type, ir.VectorType) else x.type
    c = b.fcmp_ordered("<", x, y) if isinstance(elem, ir.FloatType) else b.icmp_signed("<", x, y)
    return b.zext(c, _typ(i8, ev.width(x)))


def _where(ev, c, x, y):
    return ev.b.select(ev.b.icmp_signed("!=", c, ir.Constant(c.type, None)), x, y)


def _sqrt(ev, x):
    return ev.k.intrinsic(f"llvm.sqrt.{mangle(x.type)}", x.type, [x])


def _rsqrt(ev, x):
    one = ir.Constant(x.type, [1.0] * x.type.count) if isinstance(x.type, ir.VectorType) else ir.Constant(f32, 1.0)
    return ev.b.fdiv(one, _sqrt(ev, x))


def _math(name):
    return lambda ev, x: vmath.unary(ev.isa, name, x, ev.poly)


#  op: (float emitter, int emitter or None)       emitters take (evaluator, *register values)
_OPS = {
    "add": (lambda ev, x, y: ev.b.fadd(x, y), lambda ev, x, y: ev.b.add(x, y)),
    "sub": (lambda ev, x, y: ev.b.fsub(x, y), lambda ev, x, y: ev.b.sub(x, y)),
    "mul": (lambda ev, x, y: ev.b.fmul(x, y), lambda ev, x, y: ev.b.mul(x, y)),
    "div": (lambda ev, x, y: ev.b.fdiv(x, y), None),
    "max": (_fmax, _imax),
    "neg": (lambda ev, x: ev.b.fneg(x), None),
    "sqrt": (_sqrt, None),
    "rsqrt": (_rsqrt, None),
    "exp": (_math("exp"), None),
    "log": (_math("log"), None),
    "tanh": (_math("tanh"), None),
    "sin": (_math("sin"), None),
    "cos": (_math("cos"), None),
    "less": (_less, _less),
    "where": (_where, _where),
}
#  reduction: (identity, combine)
_REDUCE = {"reduce_sum": (0.0, lambda ev, x, y: ev.b.fadd(x, y)), "reduce_max": (-np.inf, _fmax)}


def _cast(ev, x, src, dst):
    """numpy's astype between f32, f16, i32, i8 (float -> int truncates toward zero, saturating)."""
    b, w = ev.b, ev.width(x)
    s_reg, d_reg = _TYPES[src][0], _TYPES[dst][0]
    if s_reg is f32 and d_reg is f32:
        out = x
    elif s_reg is f32:
        wide = ev.k.intrinsic(f"llvm.fptosi.sat.{mangle(_typ(i32, w))}.{mangle(x.type)}", _typ(i32, w), [x])
        out = wide if d_reg is i32 else b.trunc(wide, _typ(i8, w))
    elif d_reg is f32:
        out = b.sitofp(x, _typ(f32, w))
    elif s_reg is d_reg:
        out = x
    else:
        out = b.trunc(x, _typ(i8, w)) if d_reg is i8 else b.sext(x, _typ(i32, w))
    return out


def _check_eqn(e) -> None:
    """Raise before any IR is emitted if the body holds an op or dtype the loop cannot run."""
    name = e.prim.name
    for a in tuple(e.inputs) + tuple(e.outputs):
        _check_dtype(a.aval, f"an operand of {name}")
    if name in _REDUCE:
        if e.inputs[0].aval.dtype is not dtypes.f32:
            raise ValueError(f"fused: {name} over {e.inputs[0].aval} is not supported (f32 only)")
        return
    if name == "cast":
        return
    if name not in _OPS:
        raise ValueError(f"fused: op {name!r} cannot be part of a fused elementwise loop; supported: "
                         f"{', '.join(sorted(set(_OPS) | set(_REDUCE) | {'cast'}))}")
    dt = e.inputs[-1].aval.dtype
    if _TYPES[dt][0] is not f32 and _OPS[name][1] is None:
        raise ValueError(f"fused: {name} on {dt} operands is not supported")


# ---------------------------------------------------------------------------------------
# the plan: the iteration space, operand layouts, and reduction levels
# ---------------------------------------------------------------------------------------

def _flatten(graph: Graph, subst: dict) -> list:
    """The body's eqns with nested composites inlined (their outputs renamed to inner atoms)."""
    out = []
    for e in graph.eqns:
        ins = tuple(subst.get(a, a) if isinstance(a, Var) else a for a in e.inputs)
        if e.body is not None:
            inner = dict(zip(e.body.invars, ins))
            out += _flatten(e.body, inner)
            for o, v in zip(e.outputs, e.body.outvars):
                subst[o] = inner.get(v, v) if isinstance(v, Var) else v
        else:
            out.append(e.replace(inputs=ins))
    return out


@dataclass(frozen=True)
class Space:
    """The iteration space: leading dims (rows) and the static row length N."""

    lead: tuple
    N: int
    virtual: bool = False        # True: a symbolic last dim became a lead dim, N = 1

    def shape_of(self, aval: Aval) -> tuple:
        """aval's shape as the loop sees it (with the virtual unit axis appended)."""
        return aval.shape + (1,) if self.virtual else aval.shape

    @property
    def sym_axis(self) -> int | None:
        syms = [j for j, d in enumerate(self.lead) if isinstance(d, Sym)]
        return syms[0] if syms else None

    def rows(self):
        """The product of the lead dims: an int, or a Sym (one symbolic dim times the rest)."""
        n = 1
        for d in self.lead:
            n = d * n if isinstance(d, Sym) else n * d
        return n


def _space(avals: list[Aval], has_reduce: bool) -> Space:
    shape = broadcast_shapes("fused", *[a.shape for a in avals])
    if not shape:
        return Space((), 1)
    lead, N = shape[:-1], shape[-1]
    virtual = False
    if isinstance(N, Sym):
        if has_reduce:
            raise ValueError(f"fused: the row length (last dim {N}) must be static when the body reduces")
        lead, N, virtual = shape, 1, True
    if sum(isinstance(d, Sym) for d in lead) > 1:
        raise ValueError(f"fused: at most one symbolic leading dim, got [{','.join(map(str, shape))}]")
    return Space(tuple(lead), int(N), virtual)


@dataclass(frozen=True)
class Layout:
    """Where an array's row r starts: element strides per lead axis (0 = broadcast); along the row?"""

    aval: Aval
    strides: tuple            # per lead axis: a tuple of dim factors whose product is the stride, or None
    along: bool               # True: N values along the row; False: one value per row
    contiguous: bool          # True: row r starts at r * (N or 1)


def _layout(aval: Aval, space: Space, what: str) -> Layout:
    full = space.lead + (space.N,)
    own = space.shape_of(aval)
    if len(own) > len(full):
        raise ValueError(f"fused: {what} {aval} has more dims than the iteration space")
    shape = (1,) * (len(full) - len(own)) + tuple(own)
    for d, f in zip(shape, full):
        if d != 1 and d != f:
            raise ValueError(f"fused: {what} {aval} does not broadcast to [{','.join(map(str, full))}]")
    strides = tuple(None if shape[j] == 1 else tuple(shape[j + 1:]) for j in range(len(space.lead)))
    along = shape[-1] == space.N and space.N != 1
    contiguous = all(shape[j] == full[j] for j in range(len(space.lead)))
    return Layout(aval, strides, along, contiguous)


class Plan:
    """Everything emit_fused decides before emitting: shapes, layouts, passes; errors name the problem."""

    def __init__(self, body: Graph, in_avals: Sequence[Aval], out_avals: Sequence[Aval]):
        if len(in_avals) != len(body.invars) or len(out_avals) != len(body.outvars):
            raise ValueError(f"fused: the body takes {len(body.invars)} inputs and gives {len(body.outvars)} "
                             f"outputs, got {len(in_avals)} and {len(out_avals)} avals")
        for i, (a, v) in enumerate(zip(in_avals, body.invars)):
            if not Aval.__eq__(a, v.aval):
                raise ValueError(f"fused: input {i} is {a} but the body's input is {v.aval}")
        for i, (a, v) in enumerate(zip(out_avals, body.outvars)):
            if not Aval.__eq__(a, v.aval):
                raise ValueError(f"fused: output {i} is {a} but the body's output is {v.aval}")
        self.body = body
        self.eqns = _needed(_flatten(body, {}), body.outvars)
        for e in self.eqns:
            _check_eqn(e)
        self.producer = {o: e for e in self.eqns for o in e.outputs}
        atoms = list(body.invars) + [a for e in self.eqns for a in e.inputs + e.outputs] + list(body.outvars)
        for a in body.invars:
            _check_dtype(a.aval, "input")
        self.space = _space([a.aval for a in atoms], any(e.prim.name in _REDUCE for e in self.eqns))
        self.inputs = [_layout(v.aval, self.space, f"input {i}") for i, v in enumerate(body.invars)]
        self.outputs = [_layout(o.aval, self.space, f"output {i}") for i, o in enumerate(body.outvars)]
        for i, lay in enumerate(self.outputs):
            if not lay.contiguous:
                raise ValueError(f"fused: output {i} {lay.aval} does not cover the iteration space "
                                 f"[{','.join(map(str, self.space.lead + (self.space.N,)))}]")
        self.arrays = {}              # Literal -> Layout, for constants with more than one element
        for e in self.eqns:
            for a in e.inputs:
                if isinstance(a, Literal) and a.value.size > 1 and a not in self.arrays:
                    self.arrays[a] = _layout(a.aval, self.space, "constant")
        self.level = self._levels()

    def along(self, a) -> bool:
        """True if atom a varies along the row."""
        shape = self.space.shape_of(a.aval)
        return bool(shape) and shape[-1] == self.space.N and self.space.N != 1

    def _levels(self) -> dict:
        level = {}
        for e in self.eqns:
            lv = max((level.get(a, 0) for a in e.inputs if isinstance(a, Var)), default=0)
            if e.prim.name in _REDUCE and self.along(e.inputs[0]):
                lv += 1
            for o in e.outputs:
                level[o] = lv
        return level

    @property
    def passes(self) -> int:
        return 1 + max((self.level.get(o, 0) for o in self.body.outvars if isinstance(o, Var)), default=0)

    def reductions(self, p: int) -> list:
        """The reductions over the row whose input is ready in pass p."""
        return [e for e in self.eqns if e.prim.name in _REDUCE and self.along(e.inputs[0])
                and self.level.get(e.inputs[0], 0) == p]

    def row_deps(self, roots) -> list:
        """Per-row values (not varying along N) that computing `roots` along the row reads."""
        seen, out, stack = set(), [], list(roots)
        while stack:
            a = stack.pop()
            if id(a) in seen:
                continue
            seen.add(id(a))
            if not self.along(a):
                out.append(a)
            elif a in self.producer:
                stack.extend(self.producer[a].inputs)
        return out


def _needed(eqns: list, outvars) -> list:
    """Only the eqns the outputs depend on, in order."""
    live = {o for o in outvars if isinstance(o, Var)}
    keep = []
    for e in reversed(eqns):
        if any(o in live for o in e.outputs):
            keep.append(e)
            live.update(a for a in e.inputs if isinstance(a, Var))
    return keep[::-1]


def fused_rows(body: Graph):
    """The `rows` argument of a fused kernel for `body`: a dim expression (int or Sym)."""
    eqns = _flatten(body, {})
    avals = [v.aval for v in body.invars] + [a.aval for e in eqns for a in e.inputs + e.outputs]
    return _space(avals, any(e.prim.name in _REDUCE for e in eqns)).rows()


def fused_name(body: Graph, in_avals, out_avals, target: Target) -> str:
    """A stable kernel name for a fused body: a hash of its text, constants, avals and target."""
    h = hashlib.sha256(str(body).encode())
    for e in _flatten(body, {}):
        for a in e.inputs:
            if isinstance(a, Literal):
                h.update(a.value.tobytes())
    h.update(" ".join(map(str, list(in_avals) + list(out_avals))).encode())
    return f"fused_{h.hexdigest()[:16]}_{target.name}"


# ---------------------------------------------------------------------------------------
# emission
# ---------------------------------------------------------------------------------------

def emit_fused(module: ir.Module, target: Target, body: Graph, in_avals, out_avals, name: str) -> ir.Function:
    """Emit (once) `body` as one loop over rows: void name(in..., out..., i64 rows, ith, nth)."""
    found = _existing(module, name)
    if found is not None:
        return found
    plan = Plan(body, in_avals, out_avals)
    n_in, n_out = len(body.invars), len(body.outvars)
    k = Kernel(module, name, tuple(f"in{i}" for i in range(n_in)) + tuple(f"out{i}" for i in range(n_out)),
                    ("rows",), noalias=False)                            # an output may overwrite its input
    isa = Isa(k, target)
    vector = vector_path(target)
    lanes = isa.vector_bytes // 4 if vector else 1
    bases = {v: k.arg[f"in{i}"] for i, v in enumerate(body.invars)}
    for j, (lit, lay) in enumerate(plan.arrays.items()):
        bases[lit] = _global_array(module, f"{name}.c{j}", lit)
    layouts = dict(zip(body.invars, plan.inputs)) | plan.arrays
    sym = _sym_value(k, plan.space)
    start, end = k.thread_share(k.arg["rows"])
    with k.loop(start, end, name="row") as r:
        row = _Row(k, isa, plan, r, sym, lanes, vector, bases, layouts)
        row.emit([k.arg[f"out{i}"] for i in range(n_out)])
    k.finish()
    return k.fn


def _global_array(module: ir.Module, name: str, lit: Literal) -> ir.GlobalVariable:
    """A constant array in the module holding a Literal's values (f16 as its bits)."""
    dt = lit.aval.dtype
    mem = _TYPES[dt][1]
    flat = lit.value.reshape(-1)
    values = [int(v) for v in flat.view(np.uint16)] if dt is dtypes.f16 else \
        [float(v) if mem is f32 else int(v) for v in flat]
    g = ir.GlobalVariable(module, ir.ArrayType(mem, len(values)), name=name)
    g.linkage = "internal"
    g.global_constant = True
    g.initializer = ir.Constant(ir.ArrayType(mem, len(values)), values)
    return g


def _sym_value(k: Kernel, space: Space):
    """The runtime size of the one symbolic lead dim: rows / (product of the static ones)."""
    if space.sym_axis is None:
        return None
    static = 1
    for d in space.lead:
        static *= 1 if isinstance(d, Sym) else d
    return k.b.udiv(k.arg["rows"], k.i64(static)) if static != 1 else k.arg["rows"]


class _Row:
    """Emits the passes of one row."""

    def __init__(self, k, isa, plan: Plan, r, sym, lanes, vector, bases, layouts):
        self.k, self.b, self.isa, self.plan = k, k.b, isa, plan
        self.r, self.sym, self.lanes, self.poly = r, sym, lanes, vector
        self.bases, self.layouts = bases, layouts
        self.cols: dict = {}              # atom -> this row's scalar value
        self._idx = None
        self.offsets = {a: self.offset(lay) for a, lay in layouts.items()}   # at the row's start

    @staticmethod
    def width(v: ir.Value) -> int:
        return v.type.count if isinstance(v.type, ir.VectorType) else 1

    # -- offsets ------------------------------------------------------------------------
    def _dim(self, d):
        return self.sym if isinstance(d, Sym) else d

    def _indices(self) -> list:
        """This row's index along each lead axis (computed once per row, on first need)."""
        if self._idx is None:
            lead, rest, idx = self.plan.space.lead, self.r, []
            for j in range(len(lead) - 1, 0, -1):
                n = self.k.i64(self._dim(lead[j]))
                idx.append(self.b.urem(rest, n))
                rest = self.b.udiv(rest, n)
            self._idx = [rest] + idx[::-1] if lead else []
        return self._idx

    def offset(self, lay: Layout):
        """Element offset of this row in an array with layout `lay`."""
        if all(s is None for s in lay.strides):
            return 0
        if lay.contiguous:
            return self.k.mul(self.r, self.plan.space.N if lay.along else 1)
        k, total = self.k, 0
        for i, factors in zip(self._indices(), lay.strides):
            if factors is not None:
                stride = 1
                for d in factors:
                    stride = k.mul(stride, self._dim(d))
                total = k.add(total, k.mul(i, stride))
        return total

    # -- values that are one per row -------------------------------------------------------
    def col(self, a) -> ir.Value:
        """Atom a's scalar value for this row (a must not vary along the row)."""
        if a in self.cols:
            return self.cols[a]
        plan = self.plan
        if isinstance(a, Literal) and a.value.size == 1:
            return _const(a.value.reshape(-1)[0], a.aval.dtype, 1)
        if a in self.layouts:
            v = _load(self.k, self.isa, a.aval.dtype, self.bases[a], self.offsets[a], 1)
        else:
            e = plan.producer[a]
            if e.prim.name in _REDUCE:                 # over a unit axis: the value itself
                if plan.along(e.inputs[0]):
                    raise AssertionError(f"fused: reduction {e} read before its pass ran")
                v = self.col(e.inputs[0])
            else:
                v = self.apply(e, [self.col(x) for x in e.inputs])
        self.cols[a] = v
        return v

    # -- values along the row ---------------------------------------------------------------
    def along(self, a, c, w: int, memo: dict) -> ir.Value:
        """Atom a at row positions c..c+w, as a w-lane vector (a scalar when w == 1)."""
        if a in memo:
            return memo[a]
        plan = self.plan
        if not plan.along(a):
            if a not in self.cols and not (isinstance(a, Literal) and a.value.size == 1):
                raise AssertionError(f"fused: per-row value {a} used before it was computed")
            v = self.col(a)
            v = v if w == 1 else self.k.splat(v, w)
        elif a in self.layouts:
            v = _load(self.k, self.isa, a.aval.dtype, self.bases[a], self.k.add(self.offsets[a], c), w)
        else:
            e = plan.producer[a]
            v = self.apply(e, [self.along(x, c, w, memo) for x in e.inputs])
        memo[a] = v
        return v

    def apply(self, e, vals: list) -> ir.Value:
        """One elementwise eqn on register values; f16 results are rounded to f16."""
        name = e.prim.name
        out_dt = e.outputs[0].aval.dtype
        if name == "cast":
            v = _cast(self, vals[0], e.inputs[0].aval.dtype, out_dt)
        else:
            float_op, int_op = _OPS[name]
            v = (float_op if _TYPES[e.inputs[-1].aval.dtype][0] is f32 else int_op)(self, *vals)
        return self.isa.round_f16(v) if out_dt is dtypes.f16 else v

    # -- the passes ---------------------------------------------------------------------------
    def emit(self, out_ptrs: list) -> None:
        plan = self.plan
        last = plan.passes - 1
        outs = [(atom, lay, base, self.offset(lay))
                for atom, lay, base in zip(plan.body.outvars, plan.outputs, out_ptrs)]
        row_outs = [o for o in outs if o[1].along]
        for p in range(plan.passes):
            reds = plan.reductions(p)
            stores = row_outs if p == last else []
            if reds or stores:
                for a in plan.row_deps([e.inputs[0] for e in reds] + [o[0] for o in stores]):
                    self.col(a)
                self._walk(reds, stores)
        cols = [(self.col(atom), lay, base, off) for atom, lay, base, off in outs if not lay.along]
        for v, lay, base, off in cols:                                  # every read before any write
            _store(self.k, self.isa, lay.aval.dtype, v, base, off)

    def _walk(self, reds: list, stores: list) -> None:
        """One pass along the row: vector chunks, then the tail chunk; reductions become per-row values."""
        k, N, lanes = self.k, self.plan.space.N, self.lanes
        main = N - N % lanes
        ident = [_REDUCE[e.prim.name][0] for e in reds]
        combine = [_REDUCE[e.prim.name][1] for e in reds]
        results = [ir.Constant(f32, v) for v in ident]

        def chunk(c, w, accs):
            memo = {}
            for i, e in enumerate(reds):
                accs[i] = combine[i](self, accs[i], self.along(e.inputs[0], c, w, memo))
            vals = [(self.along(atom, c, w, memo), lay, base, off) for atom, lay, base, off in stores]
            for v, lay, base, off in vals:                              # every read before any write
                _store(k, self.isa, lay.aval.dtype, v, base, k.add(off, c))
            return accs

        if main:
            vars_ = [k.var(_typ(f32, lanes), _const(v, dtypes.f32, lanes)) for v in ident]
            with k.loop(0, main, step=lanes, name="chunk") as c:
                accs = chunk(c, lanes, [v.get() for v in vars_])
                for v, acc in zip(vars_, accs):
                    v.set(acc)
            results = [horizontal(k, v.get(), lambda x, y, f=f: f(self, x, y)) for v, f in zip(vars_, combine)]
        if N - main:
            tails = chunk(main, N - main, [_const(v, dtypes.f32, N - main) for v in ident])
            results = [f(self, r, horizontal(k, t, lambda x, y, f=f: f(self, x, y)))
                       for r, t, f in zip(results, tails, combine)]
        for e, v in zip(reds, results):
            self.cols[e.outputs[0]] = v


def horizontal(k: Kernel, v: ir.Value, combine) -> ir.Value:
    """Combine a vector's lanes (any count) into a scalar by halving; combine(x, y) -> value."""
    rest = []
    while isinstance(v.type, ir.VectorType) and v.type.count > 1:
        n = v.type.count
        if n % 2:
            rest.append(k.b.extract_element(v, ir.Constant(i32, n - 1)))
            v = k.shuffle(v, range(n - 1))
            continue
        v = combine(k.shuffle(v, range(n // 2)), k.shuffle(v, range(n // 2, n)))
    if isinstance(v.type, ir.VectorType):
        v = k.b.extract_element(v, ir.Constant(i32, 0))
    for x in rest:
        v = combine(v, x)
    return v


# ---------------------------------------------------------------------------------------
# copy kernels: transpose, slice, concat, broadcast; and cast
# ---------------------------------------------------------------------------------------

_INT_OF = {1: i8, 2: i16, 4: i32}


def _symbols(*dim_lists) -> tuple[str, ...]:
    return tuple(sorted({n for dims in dim_lists for d in dims if isinstance(d, Sym) for n in d.names}))


def _plain(aval: Aval, op: str) -> int:
    if aval.dtype.is_quantized or aval.dtype.type_size not in _INT_OF:
        raise ValueError(f"{op}: cannot move elements of {aval} ({aval.dtype})")
    return aval.dtype.type_size


def _ir_dim(k: Kernel, d):
    """A dim as an int, or as IR computed from the kernel's symbol arguments."""
    if not isinstance(d, Sym):
        return int(d)
    out = d.const
    for n, c in d.terms:
        out = k.add(out, k.mul(k.arg[n], c))
    return out


def _strides(k: Kernel, dims) -> list:
    """Contiguous element strides of a shape (ints or IR)."""
    out, s = [], 1
    for d in reversed(dims):
        out.append(s)
        s = k.mul(s, d)
    return out[::-1]


def _copy_kernel(module, name: str, srcs: tuple[str, ...], syms: tuple[str, ...]) -> Kernel:
    return Kernel(module, name, srcs + ("y",), syms)


def _strided_copy(k: Kernel, isa: Isa, esize: int, shape: list, src, s_strides: list, s_off,
                  dst, d_strides: list, d_off) -> None:
    """dst[d_off + idx·d_strides] = src[s_off + idx·s_strides] over `shape`; threads split rows.

    The last axis is contiguous in dst; it is a memcpy when contiguous in src too, else a loop.
    """
    b = k.b
    elem = _INT_OF[esize]
    shape = list(shape) or [1]
    s_strides, d_strides = list(s_strides) or [1], list(d_strides) or [1]
    rows = 1
    for d in shape[:-1]:
        rows = k.mul(rows, d)
    n = shape[-1]
    start, end = k.thread_share(rows)
    with k.loop(start, end, name="r") as r:
        s, d, rest = s_off, d_off, r
        for j in range(len(shape) - 2, -1, -1):
            i = b.urem(rest, k.i64(shape[j])) if j else rest
            rest = b.udiv(rest, k.i64(shape[j])) if j else rest
            s, d = k.add(s, k.mul(i, s_strides[j])), k.add(d, k.mul(i, d_strides[j]))
        src_row, dst_row = k.addr(src, k.mul(s, esize)), k.addr(dst, k.mul(d, esize))
        step = s_strides[-1]
        if isinstance(step, int) and step == 1:
            k.intrinsic("llvm.memcpy.p0.p0.i64", ir.VoidType(),
                        [dst_row, src_row, k.i64(k.mul(n, esize)), ir.Constant(ir.IntType(1), 0)])
        elif isinstance(step, int) and step == 0:
            v = k.load(elem, src_row)
            with k.loop(0, n, name="fill") as j:
                k.store(v, dst_row, k.mul(j, esize))
        else:
            with k.loop(0, n, name="gather") as j:
                k.store(k.load(elem, src_row, k.mul(k.mul(j, step), esize)), dst_row, k.mul(j, esize))


def emit_transpose(module: ir.Module, target: Target, aval: Aval, perm, name: str) -> ir.Function:
    """y = x.transpose(perm): void name(ptr x, ptr y, i64 <symbols of aval>..., ith, nth)."""
    found = _existing(module, name)
    if found is not None:
        return found
    perm = tuple(int(p) for p in perm)
    if sorted(perm) != list(range(aval.ndim)):
        raise ValueError(f"transpose: perm {perm} is not a permutation of the {aval.ndim} axes of {aval}")
    esize = _plain(aval, "transpose")
    k = _copy_kernel(module, name, ("x",), _symbols(aval.shape))
    dims = [_ir_dim(k, d) for d in aval.shape]
    strides = _strides(k, dims)
    out = [dims[p] for p in perm]
    _strided_copy(k, Isa(k, target), esize, out, k.arg["x"], [strides[p] for p in perm], 0,
                  k.arg["y"], _strides(k, out), 0)
    k.finish()
    return k.fn


def emit_slice(module: ir.Module, target: Target, aval: Aval, axis: int, start, stop, name: str) -> ir.Function:
    """y = x[..., start:stop, ...] along `axis` (start/stop may be symbolic):
    void name(ptr x, ptr y, i64 <symbols>..., ith, nth)."""
    found = _existing(module, name)
    if found is not None:
        return found
    if not -aval.ndim <= axis < aval.ndim:
        raise ValueError(f"slice: axis {axis} out of range for {aval}")
    axis %= aval.ndim
    esize = _plain(aval, "slice")
    k = _copy_kernel(module, name, ("x",), _symbols(aval.shape, (start, stop)))
    dims = [_ir_dim(k, d) for d in aval.shape]
    strides = _strides(k, dims)
    lo, hi = _ir_dim(k, start), _ir_dim(k, stop)
    out = dims[:axis] + [hi - lo if isinstance(hi, int) and isinstance(lo, int) else k.b.sub(k.i64(hi), k.i64(lo))] \
        + dims[axis + 1:]
    _strided_copy(k, Isa(k, target), esize, out, k.arg["x"], strides, k.mul(lo, strides[axis]),
                  k.arg["y"], _strides(k, out), 0)
    k.finish()
    return k.fn


def emit_concat(module: ir.Module, target: Target, avals: Sequence[Aval], axis: int, name: str) -> ir.Function:
    """y = concatenate(xs, axis): void name(ptr x0, ..., ptr y, i64 <symbols>..., ith, nth)."""
    found = _existing(module, name)
    if found is not None:
        return found
    if not avals:
        raise ValueError("concat: needs at least one operand")
    nd = avals[0].ndim
    if not -nd <= axis < nd:
        raise ValueError(f"concat: axis {axis} out of range for {avals[0]}")
    axis %= nd
    for a in avals:
        if a.ndim != nd or a.dtype is not avals[0].dtype or \
                any(x != y for j, (x, y) in enumerate(zip(a.shape, avals[0].shape)) if j != axis):
            raise ValueError(f"concat on axis {axis}: operands {', '.join(map(str, avals))} disagree off the axis")
    esize = _plain(avals[0], "concat")
    k = _copy_kernel(module, name, tuple(f"x{i}" for i in range(len(avals))), _symbols(*[a.shape for a in avals]))
    isa = Isa(k, target)
    shapes = [[_ir_dim(k, d) for d in a.shape] for a in avals]
    total = 0
    for s in shapes:
        total = k.add(total, s[axis]) if not (isinstance(total, int) and isinstance(s[axis], int)) \
            else total + s[axis]
    out = shapes[0][:axis] + [total] + shapes[0][axis + 1:]
    out_strides = _strides(k, out)
    offset = 0
    for i, s in enumerate(shapes):
        _strided_copy(k, isa, esize, s, k.arg[f"x{i}"], _strides(k, s), 0,
                      k.arg["y"], out_strides, k.mul(offset, out_strides[axis]))
        offset = offset + s[axis] if isinstance(offset, int) and isinstance(s[axis], int) \
            else k.add(offset, s[axis])
    k.finish()
    return k.fn


def emit_broadcast(module: ir.Module, target: Target, aval: Aval, shape, name: str) -> ir.Function:
    """y = broadcast_to(x, shape), numpy rules: void name(ptr x, ptr y, i64 <symbols>..., ith, nth)."""
    found = _existing(module, name)
    if found is not None:
        return found
    shape = tuple(Aval(shape, aval.dtype).shape)
    if broadcast_shapes("broadcast", aval.shape, shape) != shape:
        raise ValueError(f"broadcast: {aval} cannot broadcast to [{','.join(map(str, shape))}]")
    esize = _plain(aval, "broadcast")
    k = _copy_kernel(module, name, ("x",), _symbols(aval.shape, shape))
    own = (1,) * (len(shape) - aval.ndim) + aval.shape
    dims = [_ir_dim(k, d) for d in own]
    strides = [0 if o == 1 and t != 1 else s for o, t, s in zip(own, shape, _strides(k, dims))]
    out = [_ir_dim(k, d) for d in shape]
    _strided_copy(k, Isa(k, target), esize, out, k.arg["x"], strides, 0, k.arg["y"], _strides(k, out), 0)
    k.finish()
    return k.fn


def emit_cast(module: ir.Module, target: Target, aval: Aval, dtype, name: str) -> ir.Function:
    """y = x.astype(dtype) as a one-op fused loop: void name(ptr in0, ptr out0, i64 rows, ith, nth)."""
    from ggraph import ops, trace
    graph = trace(lambda x: ops.cast(x, dtype), aval)
    return emit_fused(module, target, graph, [aval], [graph.outvars[0].aval], name)
