"""Lower a graph to one native program: a straight list of kernel calls.

    program(ptr table, i64 T, i64 P, i32 ith, i32 nth, ptr barrier)

``table`` holds one base address per buffer (graph inputs, weights in the GGUF mmap,
activations, scratch, constants). Each eqn lowers through its primitive's rule in
``LOWERINGS`` to zero or more kernel calls; reshapes and leading-axis slices are views and
emit nothing. An eqn whose primitive has no rule lowers by what the op table says of it:
elementwise ops and reductions become one-op fused loops, a composite becomes one fused
loop when its body is elementwise, else its body's eqns are lowered in its place. Anything
else fails here, naming the op. Every thread walks the same list; a barrier follows each
call that writes something a later call reads.

The kernels are units of their own (``jit.unit``), compiled once each and cached; the
program function is a small module of calls that only declares them.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from llvmlite import ir

from ggraph.backends.debug_nans import checked
from ggraph.ir.dims import Sym, product
from ggraph.ir.graph import Graph, Literal
from ggraph.ir.primitive import aliases
from ggraph.backends.llvm import jit
from ggraph.backends.llvm.kernels import plain_ops as G
from ggraph.backends.llvm.rules import lower_eqn
from ggraph.backends.llvm.lowering import SYMBOLS, Buffer, Call, FixedBytes, Lowering, LoweringError, Ref
from ggraph.backends.llvm.target import Target
from ggraph.backends.llvm.team import emit_barrier, emit_team

i32, i64, ptr = ir.IntType(32), ir.IntType(64), ir.PointerType()
PROGRAM_SPEED_LEVEL = 0            # the program is a list of calls: nothing to optimise, and O0 compiles in a blink


@dataclasses.dataclass
class ProgramSpec:
    module: ir.Module | None               # the program function's module (None when loaded from cache)
    buffers: list[Buffer]
    calls: list[Call]
    outputs: list[Ref | Literal]
    input_index: dict
    param_index: dict
    units: list[jit.Unit]
    checks: list                           # what each status slot reports when a kernel sets it: a message,
                                           # or (eqn index, output) for a GGRAPH_DEBUG_NANS check
    bounds: list[tuple]                    # (rows, capacity, what) checked before every run
    name: str = "ggraph_program"
    ranges: list = dataclasses.field(default_factory=list)   # (invar index, lo, hi, what): lo <= x < hi per run


def lower(graph: Graph, target: Target, profile: bool = False, compiler: jit.Compiler | None = None,
          progress=None, rows_only: bool = False, debug_nans: bool = False) -> ProgramSpec:
    """Lower every eqn, then emit the program function that calls the kernels in order; new kernels go
    to ``compiler`` as they are built (without one they keep their IR, uncompiled). ``progress``
    (a ``ggraph.progress.Progress``) advances once per eqn. With ``debug_nans`` a check follows every
    eqn with an f32 output of its own (GGRAPH_DEBUG_NANS)."""
    lw = Lowering(graph, target, compiler, rows_only)
    for i, e in enumerate(graph.eqns):
        lw.current = None
        lower_eqn(lw, e)
        if debug_nans:
            _check_finite(lw, i, e)
        if progress is not None:
            progress.advance()
    lw.settle_layouts()
    outputs = [o if isinstance(o, Literal) else lw.where[o] for o in graph.outvars]
    if profile:                           # i64 cycle stamps, a row of one per call plus the start: row 0
        # as each barrier opens, and (the program binds one more row per thread) as each thread finishes
        lw._add(Buffer("profile", "cycles", FixedBytes(8 * (len(lw.calls) + 1))))
    spec = ProgramSpec(ir.Module(name=graph.name or "ggraph"), lw.buffers, lw.calls, outputs, lw.input_index,
                       lw.param_index, list(lw.units.values()), lw.checks, lw.bounds, ranges=lw.ranges)
    emit_program(spec, target, profile)
    return spec


def _check_finite(lw: Lowering, index: int, e) -> None:
    """A check kernel after eqn ``e`` (number ``index``) for each f32 output it writes itself (a view or a
    cache update aliases memory checked where it was written)."""
    views = aliases(e)
    for j, o in enumerate(e.outputs):
        if j in views or not checked(o.aval) or o not in lw.where:
            continue
        status = lw.status((index, j))
        lw.call(lw.kernel(G.check_finite), lw.where[o], status, product(o.aval.shape), writes=(status,))


def emit_program(spec: ProgramSpec, target: Target, profile: bool = False) -> None:
    """``void ggraph_program(ptr table, i64 T, i64 P, i64 R, i32 ith, i32 nth, ptr barrier)``, and the team's
    ``ggraph_serve`` and ``ggraph_run`` that call it on every thread.

    Calls inside a ``Loop`` (a scan's steps) run in a counted loop whose index their offsets may use; a
    barrier opens each step and follows the loop, and the loop's work counters are zeroed after each step.

    With ``profile``, every call is followed by a barrier. Each thread adds the cycles from its start of a
    call to its finish into its own row of the "profile" buffer, and thread 0 adds the cycles from its
    start to the barrier after the call opening into row 0 (the call's span, its slowest thread included),
    so a call inside a loop sums its steps; row 0's first slot holds the whole run's cycles.
    """
    m = spec.module
    barrier = emit_barrier(m, x86=target.arch == "x86_64")
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [ptr, i64, i64, i64, i32, i32, ptr]), name=spec.name)
    table, T, P, R, ith, nth, bar = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    dims = {"T": T, "P": P, "R": R}
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

    counter = m.globals.get("llvm.readcyclecounter") or \
        ir.Function(m, ir.FunctionType(i64, []), name="llvm.readcyclecounter")
    cycles = base(len(spec.buffers) - 1) if profile else None
    row = len(spec.calls) + 1
    first = ith_is_0 = None
    if profile:
        first = b.call(counter, [])
        ith_is_0 = b.icmp_signed("==", ith, ir.Constant(i32, 0))

    def add_cycles(at, ticks) -> None:
        slot = b.gep(cycles, [at], source_etype=i64)
        b.store(b.add(b.load(slot, typ=i64), ticks), slot)

    open_loops: list[tuple] = []                   # (Loop, step counter slot, head, latch, exit, bases before it)

    def open_loop(lp) -> None:
        count = dim_value(b, lp.count, dims)
        with b.goto_entry_block():
            slot = b.alloca(i64, name=lp.index)
        b.store(ir.Constant(i64, 0), slot)
        head, step, latch, done = (fn.append_basic_block(f"{lp.index}_{n}") for n in ("head", "body", "latch", "exit"))
        b.branch(head)
        b.position_at_end(head)
        i = b.load(slot, typ=i64)
        b.cbranch(b.icmp_signed("<", i, count), step, done)
        b.position_at_end(step)
        dims[lp.index] = b.sub(b.sub(count, ir.Constant(i64, 1)), i) if lp.reverse else i
        open_loops.append((lp, slot, head, latch, done, dict(bases)))
        b.call(barrier, [bar, nth])                 # the step's carries and the last step's writes are in place

    def close_loop() -> None:
        nonlocal bases
        lp, slot, head, latch, done, saved = open_loops.pop()
        if lp.counters:                             # every thread is past the step's calls, then zero them
            b.call(barrier, [bar, nth])
            with b.if_then(b.icmp_signed("==", ith, ir.Constant(i32, 0))):
                for r in lp.counters:
                    b.store(ir.Constant(i32, 0), value(r))
        b.branch(latch)
        b.position_at_end(latch)
        b.store(b.add(b.load(slot, typ=i64), ir.Constant(i64, 1)), slot)
        b.branch(head)
        b.position_at_end(done)
        del dims[lp.index]
        bases = saved                               # values loaded inside the loop do not reach past it
        b.call(barrier, [bar, nth])

    waits = [True] * len(spec.calls) if profile else barriers_needed(spec.calls)
    for i, (c, wait) in enumerate(zip(spec.calls, waits)):
        same = 0
        while same < min(len(open_loops), len(c.loops)) and open_loops[same][0] is c.loops[same]:
            same += 1
        while len(open_loops) > same:
            close_loop()
        for lp in c.loops[same:]:
            open_loop(lp)
        if wait and not (profile and i == 0):
            b.call(barrier, [bar, nth])
        start = b.call(counter, []) if profile else None
        b.call(_declare(m, c), [value(a) for a in c.args] + [ith, nth])
        if profile:
            mine = b.mul(b.add(b.sext(ith, i64), ir.Constant(i64, 1)), ir.Constant(i64, row))     # this thread's row
            add_cycles(b.add(mine, ir.Constant(i64, i + 1)), b.sub(b.call(counter, []), start))
            b.call(barrier, [bar, nth])
            with b.if_then(ith_is_0):
                add_cycles(ir.Constant(i64, i + 1), b.sub(b.call(counter, []), start))
    while open_loops:
        close_loop()
    if profile:
        with b.if_then(ith_is_0):
            add_cycles(ir.Constant(i64, 0), b.sub(b.call(counter, []), first))
    b.ret_void()
    emit_team(m, fn, target.triple)


def _declare(m: ir.Module, c: Call) -> ir.Function:
    """The kernel a call names, declared in the program module (a Ref is a pointer, a dim an i64)."""
    if c.kernel in m.globals:
        return m.globals[c.kernel]
    args = [ptr if isinstance(a, Ref) else i64 for a in c.args] + [i32, i32]
    return ir.Function(m, ir.FunctionType(ir.VoidType(), args), name=c.kernel)


def barriers_needed(calls: list[Call]) -> list[bool]:
    """Before each call: must all threads wait? Yes when it reads or writes memory another
    thread may have written since the last barrier, or writes what may still be being read.
    Where calls enter or leave a loop, the loop's own barriers (one opens each step, one follows
    the loop) have separated them already."""
    out, written, read, loops = [], set(), set(), ()
    for c in calls:
        if c.loops != loops:
            wait, loops = False, c.loops
            written, read = set(), set()
        else:
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
