"""Fused elementwise loops (copies.py holds the copy kernels of the shape ops that move data).

    emit_fused(module, target, body, in_avals, out_avals) -> name
        void name(ptr in0, ..., ptr out0, ..., i64 <symbol>..., i32 ith, i32 nth)

Every elementwise op and last-axis reduction the llvm backend runs goes through one loop
form: a fused body (a Graph of elementwise primitives and reductions, composites inlined;
a lone op is a one-eqn body). The code of each op is its ``emit`` rule in the op table
(``ggraph/ir/prims.py``), applied by the evaluator here to registers of any width.

The iteration space is the broadcast of every shape in the body: N is its last dim and the
rows are the product of the others. Any dim may be symbolic; a kernel takes the value of
every symbol its shapes mention as i64 arguments, in sorted name order (``fused_symbols``).
Each operand reads a row at the offset its own leading dims give (0 along broadcast dims)
and holds either N values along the row or one value for the whole row (a [rows, 1]
column, a scalar).

Inside a row, values that vary along N are computed a vector chunk at a time: with a
static N, one narrower chunk takes the tail; with a symbolic N, a scalar loop does. Values
that do not vary (columns, reduction results, constants) are per-row scalars splatted
where needed. A reduction needs the whole row first, so the row is walked once per level
of reductions: pass 0 accumulates the reductions of inputs, pass 1 those that depend on
them, and the last pass computes and stores the outputs (rms_norm: 2 passes, softmax: 3).
Values are recomputed in each pass that needs them; a row stays in L1. The generic target
gets the same loops one element at a time, with libm.

An output may overwrite an input of the same shape (plan_memory's in-place outputs): each
chunk, and each row's per-row outputs, reads everything it needs before it stores, and
fused kernels make no noalias promise.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from llvmlite import ir

from ggraph.ir import dtypes
from ggraph.ir.dims import Sym
from ggraph.ir.dtypes import Aval
from ggraph.ir.graph import Graph, Literal, Var, inlined
from ggraph.ir.prims import broadcast_shapes
from ggraph.backends.llvm.kernels import vmath
from ggraph.backends.llvm.kernels.builder import Kernel, f32, f64, i8, i16, i32, mangle, vec
from ggraph.backends.llvm.kernels.isa import Isa, vector_path
from ggraph.backends.llvm.target import Target


def variant(target: Target) -> str:
    """How fused loops run on `target` (for `ggraph target`)."""
    if not vector_path(target):
        return "scalar (generic twin), libm exp/log/tanh/sin/cos"
    return (f"{target.vector_bits // 32} f32 lanes, one narrow tail chunk; "
            f"polynomial exp/log/tanh/sin/cos; one pass per reduction level")


def kernel_args(fn: ir.Function) -> tuple[str, ...]:
    """Names of a kernel's arguments before (ith, nth): pointers, then i64 sizes."""
    return tuple(a.name for a in fn.args[:-2])


def kernel_name(prefix: str, target: Target, *parts) -> str:
    """A stable name for a kernel of ``parts`` (anything with a stable repr): prefix_<hash>_<target>."""
    return f"{prefix}_{hashlib.sha256(repr(parts).encode()).hexdigest()[:16]}_{target.name}"


# ---------------------------------------------------------------------------------------
# dtypes: how each is held in registers and in memory
# ---------------------------------------------------------------------------------------

#  dtype: (register lane type, memory lane type, bytes)    f16 computes in f32, rounded after each op
_TYPES = {dtypes.f32: (f32, f32, 4), dtypes.f16: (f32, i16, 2), dtypes.i32: (i32, i32, 4), dtypes.i8: (i8, i8, 1)}
_REG_NAMES = {f32: "f32", i32: "i32", i8: "i8"}
_REG_TYPES = {"f32": f32, "i32": i32, "i8": i8, "f64": f64}         # f64: the wide steps of some emitters


def _check_dtype(aval: Aval, what: str) -> None:
    if aval.dtype not in _TYPES:
        raise ValueError(f"fused: {what} {aval} has dtype {aval.dtype}; supported: "
                         f"{', '.join(d.name for d in _TYPES)}")


def _typ(elem: ir.Type, width: int) -> ir.Type:
    return elem if width == 1 else vec(elem, width)


def _width(v: ir.Value) -> int:
    return v.type.count if isinstance(v.type, ir.VectorType) else 1


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


def _check_eqn(e) -> None:
    """Raise before any IR is emitted if the body holds an op or dtype the loop cannot run."""
    p = e.prim
    for a in tuple(e.inputs) + tuple(e.outputs):
        _check_dtype(a.aval, f"an operand of {p.name}")
    if p.kind == "reduce":
        if p.reduce is None or p.reduce[1].emit is None:
            raise ValueError(f"llvm backend: reduction {p.name!r} has no combining op with an llvm emitter")
        if e.inputs[0].aval.dtype is not dtypes.f32:
            raise ValueError(f"fused: {p.name} over {e.inputs[0].aval} is not supported (f32 only)")
        return
    if p.kind != "elementwise":
        raise ValueError(f"fused: op {p.name!r} is not elementwise or a last-axis reduction")
    if p.emit is None:
        raise ValueError(f"llvm backend: op {p.name!r} has no llvm emitter (register it with emit=...)")


# ---------------------------------------------------------------------------------------
# the plan: the iteration space, operand layouts, and reduction levels
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Space:
    """The iteration space: leading dims (the rows) and the row length N; any may be symbolic."""

    lead: tuple
    N: object

    @property
    def symbols(self) -> tuple[str, ...]:
        return tuple(sorted({n for d in self.lead + (self.N,) if isinstance(d, Sym) for n in d.names}))


def _space(avals: list[Aval]) -> Space:
    shape = broadcast_shapes("fused", *[a.shape for a in avals])
    if not shape:
        return Space((), 1)
    return Space(tuple(shape[:-1]), shape[-1])


@dataclass(frozen=True)
class Layout:
    """Where an array's row r starts: element strides per lead axis (0 = broadcast); along the row?"""

    aval: Aval
    strides: tuple            # per lead axis: a tuple of dim factors whose product is the stride, or None
    along: bool               # True: N values along the row; False: one value per row
    contiguous: bool          # True: row r starts at r * (N or 1)


def _layout(aval: Aval, space: Space, what: str) -> Layout:
    full = space.lead + (space.N,)
    own = aval.shape
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


def _is_reduction(e) -> bool:
    return e.prim.kind == "reduce"


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
        self.eqns = _needed(inlined(body, {}), body.outvars)
        for e in self.eqns:
            _check_eqn(e)
        self.producer = {o: e for e in self.eqns for o in e.outputs}
        atoms = list(body.invars) + [a for e in self.eqns for a in e.inputs + e.outputs] + list(body.outvars)
        for a in body.invars:
            _check_dtype(a.aval, "input")
        self.space = _space([a.aval for a in atoms])
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
        shape = a.aval.shape
        return bool(shape) and shape[-1] == self.space.N and self.space.N != 1

    def _levels(self) -> dict:
        level = {}
        for e in self.eqns:
            lv = max((level.get(a, 0) for a in e.inputs if isinstance(a, Var)), default=0)
            if _is_reduction(e) and self.along(e.inputs[0]):
                lv += 1
            for o in e.outputs:
                level[o] = lv
        return level

    @property
    def passes(self) -> int:
        return 1 + max((self.level.get(o, 0) for o in self.body.outvars if isinstance(o, Var)), default=0)

    def reductions(self, p: int) -> list:
        """The reductions over the row whose input is ready in pass p."""
        return [e for e in self.eqns if _is_reduction(e) and self.along(e.inputs[0])
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


def fused_symbols(body: Graph) -> tuple[str, ...]:
    """The symbols a fused kernel for ``body`` takes as i64 arguments, in order."""
    eqns = inlined(body, {})
    return _space([v.aval for v in body.invars] + [a.aval for e in eqns for a in e.inputs + e.outputs]).symbols


def fused_name(body: Graph, in_avals, out_avals, target: Target) -> str:
    """A stable kernel name for a fused body: its signature (text without scopes, constants), avals, target."""
    return kernel_name("fused", target, body.signature(), tuple(map(str, list(in_avals) + list(out_avals))))


# ---------------------------------------------------------------------------------------
# emission
# ---------------------------------------------------------------------------------------

def emit_fused(module: ir.Module, target: Target, body: Graph, in_avals, out_avals, name: str | None = None) -> str:
    """Emit (once) `body` as one loop over rows: void name(in..., out..., i64 <symbols>..., ith, nth)."""
    name = name or fused_name(body, in_avals, out_avals, target)
    if Kernel.exists(module, name):
        return name
    plan = Plan(body, in_avals, out_avals)
    n_in, n_out = len(body.invars), len(body.outvars)
    k = Kernel(module, name, tuple(f"in{i}" for i in range(n_in)) + tuple(f"out{i}" for i in range(n_out)),
               plan.space.symbols, noalias=False)                        # an output may overwrite its input
    isa = Isa(k, target)
    vector = vector_path(target)
    lanes = isa.vector_bytes // 4 if vector else 1
    bases = {v: k.arg[f"in{i}"] for i, v in enumerate(body.invars)}
    for j, (lit, lay) in enumerate(plan.arrays.items()):
        bases[lit] = _global_array(module, f"{name}.c{j}", lit)
    layouts = dict(zip(body.invars, plan.inputs)) | plan.arrays
    rows = 1
    for d in plan.space.lead:
        rows = k.mul(rows, ir_dim(k, d))
    start, end = k.thread_share(rows)
    with k.loop(start, end, name="row") as r:
        row = _Row(k, isa, plan, r, lanes, vector, bases, layouts)
        row.emit([k.arg[f"out{i}"] for i in range(n_out)])
    return k.finish()


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


def ir_dim(k: Kernel, d):
    """A dim as an int, or as IR computed from the kernel's symbol arguments."""
    if not isinstance(d, Sym):
        return int(d)
    out = d.const
    for n, c in d.terms:
        out = k.add(out, k.mul(k.arg[n], c))
    return out


class Evaluator:
    """What an op's ``emit`` rule sees as ``ev``: the builder, the eqn, and typed helpers that work
    on registers of any width (a scalar or a vector of lanes)."""

    def __init__(self, k: Kernel, isa: Isa, poly: bool):
        self.k, self.b, self.isa, self.poly_ok = k, k.b, isa, poly
        self.eqn = None

    @staticmethod
    def is_float(v: ir.Value) -> bool:
        elem = v.type.element if isinstance(v.type, ir.VectorType) else v.type
        return isinstance(elem, (ir.FloatType, ir.DoubleType, ir.HalfType))

    @staticmethod
    def reg(dt) -> str:
        """The register type ("f32", "i32", "i8") values of dtype ``dt`` are held in."""
        return _REG_NAMES[_TYPES[dt][0]]

    @staticmethod
    def typ(like: ir.Value, elem: str) -> ir.Type:
        """The type of ``like``'s width with lanes of ``elem`` ("f32", "i32", "i8", "f64")."""
        return _typ(_REG_TYPES[elem], _width(like))

    @staticmethod
    def const(like: ir.Value, value) -> ir.Constant:
        """``value`` in every lane of ``like``'s type."""
        elem = like.type.element if isinstance(like.type, ir.VectorType) else like.type
        v = float(value) if isinstance(elem, ir.FloatType) else int(value)
        return ir.Constant(like.type, [v] * like.type.count if isinstance(like.type, ir.VectorType) else v)

    def intrinsic(self, name: str, ret: ir.Type, *args: ir.Value) -> ir.Value:
        """``name.<ret>.<arg>`` with LLVM's overload suffixes, e.g. llvm.fptosi.sat.v8i32.v8f32."""
        return self.k.intrinsic(f"{name}.{mangle(ret)}.{mangle(args[0].type)}", ret, list(args))

    def math(self, name: str, *args: ir.Value) -> ir.Value:
        """``llvm.<name>`` on float registers: libm for exp, log, tanh, sin, cos (one call per lane)."""
        return self.k.intrinsic(f"llvm.{name}.{mangle(args[0].type)}", args[0].type, list(args))

    def poly(self, name: str, x: ir.Value) -> ir.Value:
        """The polynomial form of exp, log, tanh, sin or cos (``vmath``): a whole vector at a time."""
        return vmath.POLY[name](self.isa, x)

    def apply(self, e, vals: list) -> ir.Value:
        """One elementwise eqn on register values by its op's emit rule; f16 results rounded to f16."""
        self.eqn = e
        p = e.prim
        rule = p.emit_vector if p.emit_vector is not None and self.poly_ok and _width(vals[0]) > 1 else p.emit
        v = rule(self, *vals)
        return self.isa.round_f16(v) if e.outputs[0].aval.dtype is dtypes.f16 else v

    def combine(self, e, x: ir.Value, y: ir.Value) -> ir.Value:
        """Reduction ``e``'s combining op on two partial results (its table entry's ``reduce``)."""
        op = e.prim.reduce[1]
        self.eqn = e
        return op.emit(self, x, y)


class _Row(Evaluator):
    """Emits the passes of one row."""

    def __init__(self, k, isa, plan: Plan, r, lanes, vector, bases, layouts):
        super().__init__(k, isa, vector)
        self.plan, self.r, self.lanes = plan, r, lanes
        self.bases, self.layouts = bases, layouts
        self.cols: dict = {}              # atom -> this row's scalar value
        self._idx = None
        self.offsets = {a: self.offset(lay) for a, lay in layouts.items()}   # at the row's start

    # -- offsets ------------------------------------------------------------------------
    def _indices(self) -> list:
        """This row's index along each lead axis (computed once per row, on first need)."""
        if self._idx is None:
            lead, rest, idx = self.plan.space.lead, self.r, []
            for j in range(len(lead) - 1, 0, -1):
                n = self.k.i64(ir_dim(self.k, lead[j]))
                idx.append(self.b.urem(rest, n))
                rest = self.b.udiv(rest, n)
            self._idx = [rest] + idx[::-1] if lead else []
        return self._idx

    def offset(self, lay: Layout):
        """Element offset of this row in an array with layout `lay`."""
        if all(s is None for s in lay.strides):
            return 0
        if lay.contiguous:
            return self.k.mul(self.r, ir_dim(self.k, self.plan.space.N) if lay.along else 1)
        k, total = self.k, 0
        for i, factors in zip(self._indices(), lay.strides):
            if factors is not None:
                stride = 1
                for d in factors:
                    stride = k.mul(stride, ir_dim(k, d))
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
            if _is_reduction(e):                       # over a unit axis: the value itself
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
        """One pass along the row: vector chunks, then the tail; reductions become per-row values."""
        k, N, lanes = self.k, self.plan.space.N, self.lanes
        specs = [e.prim.reduce for e in reds]
        kinds = [f64 if r.f64 else f32 for r in specs]          # the partial results' type per reduction

        def start(w):
            return [_fill(t, r.identity, w) for t, r in zip(kinds, specs)]

        def chunk(c, w, accs):
            memo = {}
            for i, e in enumerate(reds):
                x = self.along(e.inputs[0], c, w, memo)
                x = k.b.fpext(x, _typ(f64, w)) if kinds[i] is f64 else x
                accs[i] = self.combine(e, accs[i], x)
            vals = [(self.along(atom, c, w, memo), lay, base, off) for atom, lay, base, off in stores]
            for v, lay, base, off in vals:                              # every read before any write
                _store(k, self.isa, lay.aval.dtype, v, base, k.add(off, c))
            return accs

        def loop(lo, hi, w):
            """Chunks of w from lo to hi; the reductions' partial results, combined across lanes."""
            accs = [k.var(v.type, v) for v in start(w)]
            with k.loop(lo, hi, step=w, name="chunk") as c:
                for acc, v in zip(accs, chunk(c, w, [a.get() for a in accs])):
                    acc.set(v)
            return [horizontal(k, a.get(), lambda x, y, e=e: self.combine(e, x, y)) for a, e in zip(accs, reds)]

        if isinstance(N, Sym):                          # runtime length: vectors, then one lane at a time
            n = ir_dim(k, N)
            main = k.b.sub(n, k.b.urem(n, k.i64(lanes))) if lanes > 1 else n
            parts = [loop(0, main, lanes)] + ([loop(main, n, 1)] if lanes > 1 else [])
        else:
            main = N - N % lanes
            parts = [loop(0, main, lanes)] if main else []
            if N - main:
                tails = chunk(main, N - main, start(N - main))
                parts.append([horizontal(k, t, lambda x, y, e=e: self.combine(e, x, y)) for t, e in zip(tails, reds)])
        results = parts[0]
        for part in parts[1:]:
            results = [self.combine(e, r, p) for r, p, e in zip(results, part, reds)]
        for e, r, t, v in zip(reds, specs, kinds, results):
            if r.mean:
                n = ir_dim(k, N)
                v = k.b.fdiv(v, ir.Constant(t, float(n)) if isinstance(n, int) else k.b.uitofp(n, t))
            self.cols[e.outputs[0]] = k.b.fptrunc(v, f32) if t is f64 else v


def _fill(t: ir.Type, value: float, width: int) -> ir.Constant:
    """``value`` in ``width`` lanes of float type ``t`` (a scalar when width is 1)."""
    return ir.Constant(t, value) if width == 1 else ir.Constant(vec(t, width), [value] * width)


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
