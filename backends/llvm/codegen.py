"""Lower a fused graph to one native program: a straight list of kernel calls.

    program(ptr table, i64 T, i64 P, i32 ith, i32 nth, ptr barrier)

``table`` holds one base address per buffer (graph inputs, weights in the GGUF mmap,
activations, scratch, constants). Each eqn lowers, through the LOWERINGS table keyed by
op name, to zero or more kernel calls whose pointer arguments are (buffer, byte offset)
references; reshapes and leading-axis slices are views and emit nothing. Every thread
walks the same list; a barrier follows each call that writes something a later call
reads. An op without a lowering fails here, naming the op.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
from llvmlite import ir

from ggraph.core import Aval, DimAval, Eqn, Graph, Literal, Sym, Var, eval_dim
from ggraph.backends.llvm.target import Target
from ggraph.backends.llvm.team import emit_barrier

i32, i64, ptr = ir.IntType(32), ir.IntType(64), ir.PointerType()
SYMBOLS = ("T", "P")               # the runtime dims a program takes


@dataclasses.dataclass(frozen=True)
class Bytes:
    """A buffer's size in bytes at given dims: ``kind`` with its arguments (picklable, unlike a lambda).

    "fixed" (n) · "aval" (aval) · "plan" (the memory plan's size polynomials) · "act" (fmt, rows, K)
    """
    kind: str
    args: tuple

    def __call__(self, dims: dict) -> int:
        if self.kind == "fixed":
            return self.args[0]
        if self.kind == "aval":
            return self.args[0].nbytes(dims)
        if self.kind == "plan":
            from ggraph.passes.plan_memory import size_bytes
            return size_bytes(self.args[0], dims)
        if self.kind == "act":
            from ggraph.backends.llvm.kernels import act_bytes
            fmt, R, K = self.args
            return act_bytes(fmt, eval_size(R, dims), K)
        raise ValueError(f"unknown size kind {self.kind!r}")


@dataclasses.dataclass
class Buffer:
    """A memory region: a graph input, a weight, an activation, scratch, or a constant."""
    kind: str                              # "input" | "param" | "act" | "scratch" | "const" | "dim"
    name: str
    size: Bytes                            # bytes, given the dims
    data: np.ndarray | None = None         # constants: their bytes


@dataclasses.dataclass(frozen=True)
class Ref:
    """A pointer argument: buffer ``buf`` plus a byte offset (a dim expression)."""
    buf: int
    offset: object = 0


@dataclasses.dataclass
class Call:
    kernel: str
    args: tuple                            # Refs and dims (int | Sym), then ith/nth are appended
    writes: frozenset                      # buffers this call writes; every other Ref is read
    eqn: Eqn | None = None                 # the eqn it implements (for profiles)

    @property
    def reads(self) -> frozenset:
        return frozenset(a.buf for a in self.args if isinstance(a, Ref)) - self.writes


class LoweringError(NotImplementedError):
    """The llvm backend cannot lower an op; the message names it."""


class Lowering:
    """State while lowering one graph: buffers, where each value lives, and the calls."""

    def __init__(self, graph: Graph, target: Target, module: ir.Module):
        self.graph, self.target, self.module = graph, target, module
        self.buffers: list[Buffer] = []
        self.where: dict[Var, Ref] = {}
        self.calls: list[Call] = []
        self.input_index: dict[Var, int] = {}
        self.param_index: dict[Var, int] = {}
        self._memo: dict = {}
        self.current: Eqn | None = None
        for v in graph.invars:
            if isinstance(v.aval, DimAval):
                if v.aval.symbol not in SYMBOLS:
                    raise LoweringError(f"llvm backend: dim input {v.aval.symbol} (only {SYMBOLS} are runtime dims)")
                self.where[v] = Ref(self._add(Buffer("dim", v.aval.symbol, Bytes("fixed", (4,)))))  # its value, as i32
                continue
            self.input_index[v] = self._add(Buffer("input", v.hint or f"in{len(self.buffers)}", _aval_size(v.aval)))
            self.where[v] = Ref(self.input_index[v])
        for v in graph.params:
            self.param_index[v] = self._add(Buffer("param", v.aval.source, _aval_size(v.aval)))
            self.where[v] = Ref(self.param_index[v])
        self.plan = graph.meta.get("memory_plan")            # plan_memory's buffers, when it ran
        self._plan_buffers: dict[int, int] = {}

    def _add(self, buf: Buffer) -> int:
        self.buffers.append(buf)
        return len(self.buffers) - 1

    # -- what lowering rules use -----------------------------------------------------
    def ref(self, a) -> Ref:
        """Where operand ``a`` lives (constants become const buffers)."""
        if isinstance(a, Literal):
            data = np.ascontiguousarray(a.value)
            return Ref(self._add(Buffer("const", f"const{len(self.buffers)}", Bytes("fixed", (data.nbytes,)),
                                        data.view(np.uint8).reshape(-1))))
        return self.where[a]

    def output(self, v: Var) -> Ref:
        """Memory for ``v``: its buffer in the memory plan, or a buffer of its own without one."""
        if self.plan is None:
            r = Ref(self._add(Buffer("act", f"v{v.id}", _aval_size(v.aval))))
        else:
            if v not in self.plan.buffer_of:
                raise LoweringError(f"the memory plan has no buffer for a value of {v.aval}")
            b = self.plan.buffer_of[v]
            if b not in self._plan_buffers:
                self._plan_buffers[b] = self._add(Buffer("act", f"buf{b}", Bytes("plan", (self.plan.sizes[b],))))
            r = Ref(self._plan_buffers[b])
        self.where[v] = r
        return r

    def alias(self, v: Var, r: Ref) -> None:
        """``v`` is a view of existing memory (reshape, a leading-axis slice, an in-place op)."""
        self.where[v] = r

    def scratch(self, size: Bytes, name: str) -> Ref:
        return Ref(self._add(Buffer("scratch", name, size)))

    def call(self, kernel: str, *args, writes=()) -> None:
        """Append a kernel call; ``writes`` are the Refs it writes (the rest it only reads)."""
        self.calls.append(Call(kernel, tuple(args), frozenset(r.buf for r in writes), self.current))

    def memo(self, key, value=None):
        """Remember a lowering product (e.g. quantised activations) for reuse by later eqns."""
        if value is not None:
            self._memo[key] = value
        return self._memo.get(key)


LOWERINGS: dict[str, Callable[[Lowering, Eqn], None]] = {}


def lowering(*names: str):
    """Register a lowering rule for the ops called ``names``."""
    def wrap(fn):
        for n in names:
            LOWERINGS[n] = fn
        return fn
    return wrap


def _aval_size(aval: Aval) -> Bytes:
    return Bytes("aval", (aval,))


def rows(aval: Aval):
    """The product of all but the last dim (a dim expression)."""
    out = 1
    for d in aval.shape[:-1]:
        out = d * out if isinstance(d, Sym) else out * d
    return out


# ---------------------------------------------------------------------------------------
# building the program
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class ProgramSpec:
    module: ir.Module
    buffers: list[Buffer]
    calls: list[Call]
    outputs: list[Ref | Literal]
    input_index: dict
    param_index: dict
    name: str = "ggraph_program"


def lower(graph: Graph, target: Target, profile: bool = False) -> ProgramSpec:
    """Lower every eqn, then emit the program function that calls the kernels in order."""
    from ggraph.backends.llvm import lowerings  # noqa: F401  (registers the rules)
    module = ir.Module(name=graph.name or "ggraph")
    lw = Lowering(graph, target, module)
    for e in graph.eqns:
        lw.current = e
        rule = LOWERINGS.get(e.prim.name)
        if rule is None:
            raise LoweringError(f"llvm backend: no lowering for op {e.prim.name!r} (at {e.scope or 'top'}); "
                                f"lowered ops: {', '.join(sorted(LOWERINGS))}")
        rule(lw, e)
    outputs = [o if isinstance(o, Literal) else lw.where[o] for o in graph.outvars]
    if profile:                           # one i64 cycle stamp per call, plus the start
        lw.profile_buffer = lw._add(Buffer("profile", "cycles", Bytes("fixed", (8 * (len(lw.calls) + 1),))))
    spec = ProgramSpec(module, lw.buffers, lw.calls, outputs, lw.input_index, lw.param_index)
    emit_program(spec, target, profile)
    return spec


def emit_program(spec: ProgramSpec, target: Target, profile: bool = False) -> None:
    """``void ggraph_program(ptr table, i64 T, i64 P, i32 ith, i32 nth, ptr barrier)``.

    With ``profile``, every call is followed by a barrier and thread 0 stamps the cycle
    counter into the "profile" buffer, so each call's span includes its slowest thread.
    """
    m = spec.module
    barrier = emit_barrier(m, x86=target.arch == "x86_64")
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [ptr, i64, i64, i32, i32, ptr]), name=spec.name)
    table, T, P, ith, nth, bar = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    dims = {"T": T, "P": P}
    bases: dict[int, ir.Value] = {}

    def base(i: int) -> ir.Value:
        if i not in bases:
            slot = b.gep(table, [ir.Constant(i64, i)], source_etype=ptr)
            bases[i] = b.load(slot, typ=ptr)
        return bases[i]

    def value(arg):
        if isinstance(arg, Ref):
            off = dim_value(b, arg.offset, dims)
            p = base(arg.buf)
            return p if isinstance(off, ir.Constant) and off.constant == 0 else b.gep(p, [off], source_etype=ir.IntType(8))
        return dim_value(b, arg, dims)

    stamp = _stamper(m, b, ith, base(len(spec.buffers) - 1)) if profile else None
    if stamp:
        stamp(0)
    waits = [True] * len(spec.calls) if profile else barriers_needed(spec.calls)
    for i, (c, wait) in enumerate(zip(spec.calls, waits)):
        if wait and not (profile and i == 0):
            b.call(barrier, [bar, nth])
        b.call(m.globals[c.kernel], [value(a) for a in c.args] + [ith, nth])
        if stamp:
            b.call(barrier, [bar, nth])
            stamp(i + 1)
    b.ret_void()


def _stamper(m: ir.Module, b: ir.IRBuilder, ith, stamps):
    """A function that makes thread 0 store the cycle counter at stamps[i]."""
    counter = m.globals.get("llvm.readcyclecounter") or ir.Function(m, ir.FunctionType(i64, []), name="llvm.readcyclecounter")

    def stamp(i: int):
        with b.if_then(b.icmp_signed("==", ith, ir.Constant(i32, 0))):
            b.store(b.call(counter, []), b.gep(stamps, [ir.Constant(i64, i)], source_etype=i64))
    return stamp


def barriers_needed(calls: list[Call]) -> list[bool]:
    """Before each call: must all threads wait? Yes when it reads or writes memory another
    thread may have written since the last barrier, or writes what may still be being read."""
    out, written, read = [], set(), set()
    for c in calls:
        wait = bool(c.reads & written or c.writes & (written | read))
        if wait:
            written, read = set(), set()
        out.append(wait)
        written |= c.writes
        read |= c.reads
    return out


def dim_value(b: ir.IRBuilder, d, dims: dict) -> ir.Value:
    """An i64 for a dim expression over the program's runtime dims."""
    if isinstance(d, (int, np.integer)):
        return ir.Constant(i64, int(d))
    if not isinstance(d, Sym):
        raise LoweringError(f"cannot pass {d!r} as a dim")
    out = ir.Constant(i64, d.const)
    for name, coef in d.terms:
        if name not in dims:
            raise LoweringError(f"symbol {name} is not a runtime dim of the program ({', '.join(SYMBOLS)})")
        term = dims[name] if coef == 1 else b.mul(dims[name], ir.Constant(i64, coef))
        out = term if (isinstance(out, ir.Constant) and out.constant == 0) else b.add(out, term)
    return out


def eval_size(d, dims: dict) -> int:
    return eval_dim(d, dims) if isinstance(d, Sym) else int(d)
