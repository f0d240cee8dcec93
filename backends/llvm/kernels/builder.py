"""The kernel ABI and the IR building blocks every emitter uses: loops, byte-offset
loads and stores, accumulators, constants and the thread split.

Every kernel is `void name(ptr..., i64 sizes..., i32 ith, i32 nth)`: pointer arguments
are opaque, then the runtime sizes (usually just T, the token count), this thread's index
and the team size.
"""
from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir

i1, i8, i16, i32, i64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
f16, f32, f64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()
ptr = ir.PointerType()
ROW_CHUNK = 16          # threads split outputs in multiples of 16 (one 64-byte line of f32)


def vec(elem: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elem, n)


def bits(t: ir.Type) -> int:
    """Width in bits of a scalar or vector type."""
    if isinstance(t, ir.VectorType):
        return t.count * bits(t.element)
    return {ir.FloatType: 32, ir.HalfType: 16, ir.DoubleType: 64}.get(type(t)) or t.width


def splat_const(elem: ir.Type, n: int, value) -> ir.Constant:
    """A constant vector with every lane `value`."""
    return ir.Constant(vec(elem, n), [value] * n)


def mangle(t: ir.Type) -> str:
    """LLVM's overload suffix for a type: f32, v16f32, v64i8."""
    if isinstance(t, ir.VectorType):
        return f"v{t.count}{mangle(t.element)}"
    return {ir.FloatType: "f32", ir.HalfType: "f16", ir.DoubleType: "f64"}.get(type(t)) or f"i{t.width}"


def vec_const(elem: ir.Type, values) -> ir.Constant:
    return ir.Constant(vec(elem, len(values)), list(values))


class Kernel:
    """One function with the kernel ABI under construction, and helpers to fill it."""

    def __init__(self, module: ir.Module, name: str, pointer_args: tuple[str, ...],
                 sizes: tuple[str, ...] = ("T",), noalias: bool = True):
        self.module = module
        fnty = ir.FunctionType(ir.VoidType(), [ptr] * len(pointer_args) + [i64] * len(sizes) + [i32, i32])
        self.fn = ir.Function(module, fnty, name=name)
        self.fn.attributes.add("nounwind")
        names = tuple(pointer_args) + tuple(sizes) + ("ith", "nth")
        for arg, arg_name in zip(self.fn.args, names):
            arg.name = arg_name
        for arg in self.fn.args[:len(pointer_args)] if noalias else ():
            arg.add_attribute("noalias")
        self.arg = dict(zip(names, self.fn.args))
        entry = self.fn.append_basic_block("entry")
        self._allocas = ir.IRBuilder(entry)
        body = self.fn.append_basic_block("body")
        self._allocas.branch(body)
        self._allocas.position_at_start(entry)
        self.b = ir.IRBuilder(body)

    @staticmethod
    def exists(module: ir.Module, name: str) -> bool:
        """True if `module` already holds a kernel called `name` (emitters are idempotent)."""
        return name in module.globals

    def finish(self) -> str:
        self.b.ret_void()
        return self.fn.name

    # -- constants and arithmetic on i64 offsets -------------------------------------
    def i64(self, value) -> ir.Value:
        return ir.Constant(i64, value) if isinstance(value, int) else value

    def add(self, *terms) -> ir.Value:
        """Sum of i64 terms; Python ints fold into one constant."""
        const = sum(t for t in terms if isinstance(t, int))
        values = [t for t in terms if not isinstance(t, int)]
        if not values:
            return ir.Constant(i64, const)
        out = values[0]
        for v in values[1:]:
            out = self.b.add(out, v)
        return self.b.add(out, ir.Constant(i64, const)) if const else out

    def mul(self, a, b) -> ir.Value:
        """a*b for i64 values or ints."""
        if isinstance(a, int) and isinstance(b, int):
            return a * b
        return self.b.mul(self.i64(a), self.i64(b))

    # -- memory ---------------------------------------------------------------------
    def addr(self, base: ir.Value, offset) -> ir.Value:
        """base + offset bytes."""
        if isinstance(offset, int) and offset == 0:
            return base
        return self.b.gep(base, [self.i64(offset)], source_etype=i8)

    def load(self, typ: ir.Type, base: ir.Value, offset=0) -> ir.Value:
        """An unaligned load of `typ` at base + offset bytes."""
        return self.b.load(self.addr(base, offset), typ=typ, align=1)

    def store(self, value: ir.Value, base: ir.Value, offset=0) -> None:
        """An unaligned store at base + offset bytes."""
        self.b.store(value, self.addr(base, offset), align=1)

    def masked_load(self, typ: ir.VectorType, base: ir.Value, offset, mask: ir.Value) -> ir.Value:
        """The lanes of a vector at base + offset bytes where ``mask`` (<n x i1>) is set, others undefined;
        lanes left out are never touched, so they may lie past the end of a buffer."""
        return self.intrinsic(f"llvm.masked.load.{mangle(typ)}.p0", typ,
                              [self.addr(base, offset), ir.Constant(i32, 4), mask, ir.Constant(typ, None)])

    def masked_store(self, value: ir.Value, base: ir.Value, offset, mask: ir.Value) -> None:
        """Store the lanes of ``value`` where ``mask`` is set, leaving the others' memory alone."""
        self.intrinsic(f"llvm.masked.store.{mangle(value.type)}.p0", ir.VoidType(),
                       [value, self.addr(base, offset), ir.Constant(i32, 4), mask])

    def prefetch(self, addr: ir.Value, level: int = 1) -> None:
        """Ask for the cache line at ``addr``, for reading, into cache ``level`` and the ones beyond
        it (1: every level, 2: L2 and L3); a prefetch never faults, so it may point past the end
        of a buffer."""
        self.intrinsic("llvm.prefetch.p0", ir.VoidType(), [addr, ir.Constant(i32, 0), ir.Constant(i32, 4 - level),
                                                            ir.Constant(i32, 1)])

    # -- control flow ---------------------------------------------------------------
    @contextmanager
    def loop(self, start, stop, step: int = 1, name: str = "i"):
        """for i in range(start, stop, step) with i64 bounds; yields i."""
        b = self.b
        start, stop = self.i64(start), self.i64(stop)
        pre = b.block
        head = self.fn.append_basic_block(f"{name}.head")
        body = self.fn.append_basic_block(f"{name}.body")
        done = self.fn.append_basic_block(f"{name}.done")
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(i64, name=name)
        i.add_incoming(start, pre)
        b.cbranch(b.icmp_signed("<", i, stop), body, done)
        b.position_at_end(body)
        yield i
        i.add_incoming(b.add(i, ir.Constant(i64, step)), b.block)
        b.branch(head)
        b.position_at_end(done)

    @contextmanager
    def if_then(self, cond: ir.Value):
        with self.b.if_then(cond):
            yield

    def var(self, typ: ir.Type, init) -> "Var":
        """A mutable accumulator (an entry-block alloca that LLVM promotes to a register)."""
        slot = self._allocas.alloca(typ)
        v = Var(self, slot, typ)
        v.set(init if isinstance(init, ir.Value) else ir.Constant(typ, init))
        return v

    def scratch(self, elem: ir.Type, n: int):
        """A private array of n ``elem`` (an entry-block alloca, 64-byte aligned, undefined at first);
        returns its address as ``ptr``, for the byte-offset loads and stores above."""
        slot = self._allocas.alloca(ir.ArrayType(elem, n))
        slot.align = 64           # a cache line: vector loads of it never split
        slot.type = ptr           # llvmlite types allocas as typed pointers; byte-offset access wants `ptr`
        return slot

    # -- vectors --------------------------------------------------------------------
    def splat(self, value: ir.Value, n: int) -> ir.Value:
        """<n x T> with every lane `value`."""
        b = self.b
        one = b.insert_element(ir.Constant(vec(value.type, 1), None), value, ir.Constant(i32, 0))
        return b.shuffle_vector(one, one, splat_const(i32, n, 0))

    def shuffle(self, v: ir.Value, lanes, other: ir.Value | None = None) -> ir.Value:
        """A shufflevector picking `lanes` from v (and `other`, numbered after v)."""
        return self.b.shuffle_vector(v, other if other is not None else v, vec_const(i32, lanes))

    def concat(self, *parts: ir.Value) -> ir.Value:
        """Join equal-width vectors end to end."""
        parts = list(parts)
        count, width = len(parts), parts[0].type.count
        while len(parts) & (len(parts) - 1):             # pad to a power of two, cut off below
            parts.append(ir.Constant(parts[0].type, [0] * width))
        while len(parts) > 1:
            n = parts[0].type.count
            parts = [self.shuffle(parts[i], range(2 * n), parts[i + 1]) for i in range(0, len(parts), 2)]
        return parts[0] if parts[0].type.count == count * width else self.shuffle(parts[0], range(count * width))

    def split(self, v: ir.Value, pieces: int) -> list[ir.Value]:
        """Cut a vector into `pieces` equal parts."""
        n = v.type.count // pieces
        return [v if pieces == 1 else self.shuffle(v, range(p * n, (p + 1) * n)) for p in range(pieces)]

    def transpose(self, rows: list[ir.Value]) -> list[ir.Value]:
        """Columns of a matrix held as row vectors: ``rows[r][j]`` becomes ``out[j][r]``, for R rows of
        C lanes (R a power of two). Rows are joined in pairs first; then each step trades half of
        a vector's columns for the rows of its partner (the vector with the same columns) in one
        two-source shuffle per output vector, until every vector holds a single column."""
        R, C = len(rows), rows[0].type.count
        if C == 1:
            return [self.concat(*rows)]
        items = [(self.concat(rows[r], rows[r + 1]), [(r, j) for j in range(C)] + [(r + 1, j) for j in range(C)])
                 for r in range(0, R, 2)] if R > 1 else [(rows[0], [(0, j) for j in range(C)])]
        while len({j for _, j in items[0][1]}) > 1:
            groups: dict[tuple, list] = {}
            for item in items:
                groups.setdefault(tuple(sorted({j for _, j in item[1]})), []).append(item)
            items = []
            for cols, group in groups.items():
                pairs = list(zip(group[0::2], group[1::2])) if len(group) > 1 else [(group[0], None)]
                for (a, la), other in pairs:
                    b, lb = other if other is not None else (None, [])
                    lanes = la + lb
                    for part in (cols[:len(cols) // 2], cols[len(cols) // 2:]):
                        want = sorted(((j, r), i) for i, (r, j) in enumerate(lanes) if j in part)
                        items.append((self.shuffle(a, [i for _, i in want], b), [(r, j) for (j, r), _ in want]))
        by_col: dict[int, list] = {}
        for v, labels in sorted(items, key=lambda item: item[1][0][::-1]):
            by_col.setdefault(labels[0][1], []).append((v, [r for r, _ in labels]))
        if any(sum((r for _, r in parts), []) != list(range(R)) for parts in by_col.values()):
            raise ValueError(f"transpose: {R} rows of {C} lanes do not come out in order")
        return [self.concat(*[v for v, _ in by_col[j]]) for j in range(C)]

    def cast_vec(self, v: ir.Value, elem: ir.Type) -> ir.Value:
        """Reinterpret a vector's bits as lanes of `elem` (e.g. <32 x i8> as <8 x i32>)."""
        return self.b.bitcast(v, vec(elem, bits(v.type) // bits(elem)))

    # -- calls ------------------------------------------------------------------------
    def intrinsic(self, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
        """Call LLVM intrinsic `name`, declaring it once per module."""
        fn = self.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(ret, [a.type for a in args]), name=name)
        return self.b.call(fn, args)

    # -- threads --------------------------------------------------------------------
    def thread_share(self, units) -> tuple[ir.Value, ir.Value]:
        """[start, end) of `units` (an i64) owned by thread ith of nth: a static split."""
        b = self.b
        units = self.i64(units)
        ith = b.sext(self.arg["ith"], i64)
        nth = b.sext(self.arg["nth"], i64)
        start = b.sdiv(b.mul(units, ith), nth)
        end = b.sdiv(b.mul(units, b.add(ith, ir.Constant(i64, 1))), nth)
        return start, end

    @contextmanager
    def row_chunks(self, n: int, counter: ir.Value, per_thread: int = 8, quantum: int = ROW_CHUNK, lead: float = 0.0):
        """Chunks of ``n`` output rows (whole multiples of ``quantum`` rows, about ``per_thread`` per
        thread) taken in turn: thread ith does chunk ith first, then the next one nobody has taken
        (``counter``, an i32 that is zero when the call starts, counts them), so a thread that runs
        faster, or is not preempted, does more of them. With ``lead``, that fraction of the rows
        comes first as one chunk per thread. Yields each chunk's [start, end)."""
        b = self.b
        nth = b.sext(self.arg["nth"], i64)
        units = (n + quantum - 1) // quantum
        per = b.sdiv(self.i64(units), b.mul(nth, self.i64(per_thread)))
        small = b.select(b.icmp_signed("<", per, self.i64(1)), self.i64(1), per)
        if lead:
            big = b.sdiv(self.i64(int(units * lead)), nth)
            longer = b.icmp_signed(">", big, small)            # else no lead: every chunk small
            n_big, big = b.select(longer, nth, self.i64(0)), b.select(longer, big, small)
        else:
            big, n_big = small, self.i64(0)
        rest = b.sub(self.i64(units), b.mul(n_big, big))
        chunks = b.add(n_big, b.sdiv(b.add(rest, b.sub(small, self.i64(1))), small))
        first = b.sext(self.arg["ith"], i64)
        pre = b.block
        head = self.fn.append_basic_block("chunk.head")
        body = self.fn.append_basic_block("chunk.body")
        done = self.fn.append_basic_block("chunk.done")
        b.branch(head)
        b.position_at_end(head)
        c = b.phi(i64, name="chunk")
        c.add_incoming(first, pre)
        b.cbranch(b.icmp_signed("<", c, chunks), body, done)
        b.position_at_end(body)
        in_big = b.icmp_signed("<", c, n_big)
        at = b.select(in_big, b.mul(c, big), b.add(b.mul(n_big, big), b.mul(b.sub(c, n_big), small)))
        start = b.mul(at, self.i64(quantum))
        end = b.mul(b.add(at, b.select(in_big, big, small)), self.i64(quantum))
        yield start, b.select(b.icmp_signed("<", end, self.i64(n)), end, self.i64(n))
        taken = b.atomic_rmw("add", counter, ir.Constant(i32, 1), "monotonic")
        c.add_incoming(b.add(nth, b.sext(taken, i64)), b.block)
        b.branch(head)
        b.position_at_end(done)


class Var:
    """A named mutable value inside a kernel."""

    def __init__(self, k: Kernel, slot, typ):
        self.k, self.slot, self.typ = k, slot, typ

    def get(self) -> ir.Value:
        return self.k.b.load(self.slot, typ=self.typ)

    def set(self, value: ir.Value) -> None:
        self.k.b.store(value, self.slot)
