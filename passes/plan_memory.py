"""plan_memory: give activations buffers by liveness, reusing dead buffers and writing in place.

Sizes are polynomials in the symbolic dims ({monomial: bytes}, e.g. 2560·T), so one plan
serves every T and P. A buffer's size is the max of a few polynomials (those of the values
it holds that no other one covers coefficient by coefficient), evaluated when the dims are
known. Rules:
- params and graph inputs are not planned; outputs that alias an operand by the op's meaning
  (cache_update and rope_attention caches, reshape views) share that operand's storage;
- an elementwise or fused output may take the buffer of an operand that dies at that eqn and
  has the same size (in place); any other output takes a free buffer (best fit) or a new one.
The plan goes to ``graph.meta["memory_plan"]``; ``MemoryPlan.check`` proves it safe, from
lifetimes it recomputes itself, and runs on every plan.
"""
from __future__ import annotations

from ggraph.ir.dims import dim_product, poly_str
from ggraph.ir.graph import Eqn, Graph, Var
from ggraph.ir.primitive import aliases
from ggraph.passes.manager import graph_pass, note
from ggraph.units import fmt_bytes

Poly = dict[tuple[str, ...], int]      # bytes as a polynomial: {("T",): 2560, (): 64} = 2560·T + 64
Size = list[Poly]                      # a buffer's bytes: the max of these polynomials

REF_DIMS = (1, 64)                     # best fit weighs symbolic sizes at each of these (decode, prefill)


class PlanError(ValueError):
    """A memory plan is unsafe for its graph; the message names the values involved."""


# ---------------------------------------------------------------------------------------
# symbolic sizes
# ---------------------------------------------------------------------------------------

def size_of(aval) -> Poly:
    """Bytes of a value as a polynomial in its symbolic dims (a block-typed one, a copy of some of a weight's
    rows, has a static shape)."""
    if aval.dtype.is_quantized and all(isinstance(d, int) for d in aval.shape):
        return {(): aval.dtype.nbytes(aval.shape)}
    if aval.dtype.is_quantized or aval.dtype.np_dtype is None:
        raise PlanError(f"cannot plan a buffer for {aval}: activations must be plain types or static block types")
    return {m: c * aval.dtype.type_size for m, c in dim_product(aval.shape).items()}


def evaluate(poly: Poly, dims: dict[str, int]) -> int:
    total = 0
    for mono, c in poly.items():
        for s in mono:
            if s not in dims:
                raise ValueError(f"size {poly_str(poly)} needs a value for {s!r}; given {sorted(dims)}")
            c *= dims[s]
        total += c
    return total


def covers(big: Poly, small: Poly) -> bool:
    """big ≥ small for every non-negative value of the dims (checked coefficient by coefficient)."""
    return all(big.get(m, 0) >= c for m, c in small.items()) and all(c >= 0 for m, c in big.items() if m not in small)


def holds(size: Size, poly: Poly) -> bool:
    """A buffer of ``size`` holds a value of ``poly`` bytes for every value of the dims."""
    return any(covers(p, poly) for p in size)


def grown(size: Size, poly: Poly) -> Size:
    """The size of a buffer that must also hold ``poly``: dominated polynomials drop out."""
    return size if holds(size, poly) else [p for p in size if not covers(poly, p)] + [poly]


def size_bytes(size: Size, dims: dict[str, int]) -> int:
    return max((evaluate(p, dims) for p in size), default=0)


def size_str(size: Size) -> str:
    return poly_str(size[0]) if len(size) == 1 else "max(" + ", ".join(poly_str(p) for p in size) + ")"


def _at_ref(size: Size) -> int:
    """Bytes summed over the reference dims: how best fit ranks symbolic sizes."""
    return sum(size_bytes(size, {s: n for p in size for m in p for s in m}) for n in REF_DIMS)


def in_place_ok(e: Eqn) -> bool:
    """The op's kernel reads row r of every operand before writing row r (the op table's in_place)."""
    return e.prim.in_place


# ---------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------

class MemoryPlan:
    """Which buffer each activation lives in, and each buffer's size as polynomials in the dims."""

    def __init__(self, buffer_of: dict[Var, int], sizes: list[Size], owners: list[Var],
                 in_place: dict[Var, Var]):
        self.buffer_of = buffer_of      # every planned value, views and aliases included
        self.sizes = sizes              # buffer id -> bytes, the max of its polynomials
        self.owners = owners            # planned values with storage of their own (not views)
        self.in_place = in_place        # value -> the dying operand whose buffer it took

    def buffer_bytes(self, b: int, dims: dict[str, int]) -> int:
        return size_bytes(self.sizes[b], dims)

    def peak_bytes(self, dims: dict[str, int]) -> int:
        """Bytes of all buffers together: the activation memory this plan needs at ``dims``."""
        return sum(size_bytes(s, dims) for s in self.sizes)

    def naive_bytes(self, dims: dict[str, int]) -> int:
        """Bytes if every value that needs storage of its own had its own buffer."""
        return sum(evaluate(size_of(v.aval), dims) for v in self.owners)

    def offsets(self, dims: dict[str, int], align: int = 64) -> list[int]:
        """Each buffer's byte offset in one arena at ``dims``, every buffer aligned to ``align``."""
        out, at = [], 0
        for s in self.sizes:
            out.append(at)
            at += -(-size_bytes(s, dims) // align) * align
        return out

    def check(self, graph: Graph) -> None:
        """Prove the plan safe for ``graph``: no two values live at once share a buffer, except in place."""
        check_plan(self, graph)

    def __repr__(self):
        return (f"<MemoryPlan {len(self.buffer_of)} values in {len(self.sizes)} buffers, "
                f"{len(self.in_place)} in place>")


# ---------------------------------------------------------------------------------------
# the checker: recomputes storage and lifetimes from the graph, trusts nothing in the plan
# ---------------------------------------------------------------------------------------

def lifetimes(graph: Graph) -> tuple[dict[Var, Var], dict[Var, int], dict[Var, int]]:
    """Storage root of every eqn output, and for each root its first eqn and the last eqn reading it."""
    root: dict[Var, Var] = {}
    start: dict[Var, int] = {}
    end: dict[Var, int] = {}
    for i, e in enumerate(graph.eqns):
        for a in e.inputs:
            if isinstance(a, Var):
                r = root.get(a, a)
                end[r] = max(end.get(r, -1), i)
        alias = aliases(e)
        for k, o in enumerate(e.outputs):
            src = e.inputs[alias[k]] if k in alias else None
            if isinstance(src, Var):
                root[o] = root.get(src, src)
            else:
                root[o], start[o], end[o] = o, i, i
    for o in graph.outvars:                                  # graph outputs live to the end
        if isinstance(o, Var):
            end[root.get(o, o)] = len(graph.eqns)
    return root, start, end


def check_plan(plan: MemoryPlan, graph: Graph) -> None:
    """Raise PlanError unless every activation has a big enough buffer that no other live value holds."""
    root, start, end = lifetimes(graph)
    external = set(graph.invars) | set(graph.params)
    planned = [v for v in root if root[v] not in external]
    name = _namer(graph)
    for v in planned:
        b = plan.buffer_of.get(v)
        if b is None:
            raise PlanError(f"{name(v)} has no buffer")
        if not 0 <= b < len(plan.sizes):
            raise PlanError(f"{name(v)} is in buffer {b}, which does not exist")
        if root[v] is not v and plan.buffer_of.get(root[v]) != b:
            raise PlanError(f"{name(v)} is a view of {name(root[v])} but sits in another buffer")
        if root[v] is v and not holds(plan.sizes[b], size_of(v.aval)):     # a view lies inside its root
            raise PlanError(f"{name(v)} needs {poly_str(size_of(v.aval))} bytes; buffer {b} holds "
                            f"{size_str(plan.sizes[b])}")
    for v in plan.buffer_of:
        if v not in root or root[v] in external:
            raise PlanError(f"{name(v)} is planned but is not an activation of this graph")
    by_buffer: dict[int, list[Var]] = {}
    for v in planned:
        if root[v] is v:
            by_buffer.setdefault(plan.buffer_of[v], []).append(v)
    for b, owners in by_buffer.items():
        owners.sort(key=lambda v: start[v])
        for i, a in enumerate(owners):
            for c in owners[i + 1:]:
                if start[c] > end[a]:
                    break
                if not _hands_over(graph.eqns, start[c], a, c, root, end):
                    raise PlanError(f"buffer {b}: {name(a)} (live over eqns {start[a]}..{end[a]}) and "
                                    f"{name(c)} (written by eqn {start[c]}) are live at the same time")


def _hands_over(eqns, k: int, a: Var, c: Var, root: dict, end: dict) -> bool:
    """True if eqn k writes c in place over a: a dies at k, and k reads a at c's size, elementwise."""
    e = eqns[k]
    return in_place_ok(e) and end[a] == k and any(
        isinstance(x, Var) and root.get(x, x) is a and size_of(x.aval) == size_of(c.aval) for x in e.inputs)


def _namer(graph: Graph):
    """Name values as the printed graph does (built only when an error needs it)."""
    cache = []

    def name(v: Var) -> str:
        if not cache:
            from ggraph.ir.graph import Names, graph_to_str
            cache.append(Names())
            graph_to_str(graph, names=cache[0])
        names = cache[0]
        return f"{names.names[v]}:{v.aval}" if v in names.names else f"{v!r}"
    return name


# ---------------------------------------------------------------------------------------
# the planner: one linear scan, best fit
# ---------------------------------------------------------------------------------------

class _Planner:
    """Walks the eqns once, handing buffers out as values are born and taking them back as they die."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.external = set(graph.invars) | set(graph.params)
        self.root: dict[Var, Var] = {}
        self.last = self._last_reads()
        self.buffer_of: dict[Var, int] = {}
        self.sizes: list[Size] = []
        self.holder: list[Var | None] = []      # buffer -> the root now stored in it
        self.free: list[int] = []
        self.owners: list[Var] = []
        self.in_place: dict[Var, Var] = {}

    def _last_reads(self) -> dict[Var, int]:
        """Index of the last eqn reading each storage root (len(eqns) for graph outputs)."""
        return self.graph.last_reads()[1]

    def run(self) -> MemoryPlan:
        for i, e in enumerate(self.graph.eqns):
            taken: set[int] = set()
            for k, o in enumerate(e.outputs):
                src = aliases(e).get(k)
                if src is not None and isinstance(e.inputs[src], Var):
                    self._alias(o, e.inputs[src])
                else:
                    taken.add(self._place(i, e, o, taken))
            self._release(i, e)
        return MemoryPlan(self.buffer_of, self.sizes, self.owners, self.in_place)

    def _alias(self, o: Var, src: Var) -> None:
        r = self.root.get(src, src)
        self.root[o] = r
        if r not in self.external:
            self.buffer_of[o] = self.buffer_of[r]

    def _place(self, i: int, e: Eqn, o: Var, taken: set[int]) -> int:
        size = size_of(o.aval)
        b = self._in_place(i, e, o, size, taken)
        if b is None:
            b = self._best_fit(size)
        self.sizes[b] = grown(self.sizes[b], size)
        self.holder[b] = o
        self.buffer_of[o] = b
        self.owners.append(o)
        self.root[o] = o
        return b

    def _in_place(self, i: int, e: Eqn, o: Var, size: Poly, taken: set[int]) -> int | None:
        if not in_place_ok(e):
            return None
        for a in e.inputs:
            if not isinstance(a, Var):
                continue
            r = self.root.get(a, a)
            b = self.buffer_of.get(r)
            if b is not None and b not in taken and self.last.get(r) == i and size_of(a.aval) == size \
                    and self.holder[b] is r:
                self.in_place[o] = a
                return b
        return None

    def _best_fit(self, size: Poly) -> int:
        """A free buffer that already holds ``size`` (smallest first), else the one that grows least if that
        costs less than a new buffer, else a new one."""
        fits = [b for b in self.free if holds(self.sizes[b], size)]
        grow = lambda b: _at_ref(grown(self.sizes[b], size)) - _at_ref(self.sizes[b])     # noqa: E731
        if fits:
            b = min(fits, key=lambda b: _at_ref(self.sizes[b]))
        elif self.free and min(map(grow, self.free)) < _at_ref([size]):
            b = min(self.free, key=grow)
        else:
            self.sizes.append([])
            self.holder.append(None)
            return len(self.sizes) - 1
        self.free.remove(b)
        return b

    def _release(self, i: int, e: Eqn) -> None:
        """Free the buffers of roots whose last reader is eqn i (and of outputs nobody reads)."""
        dying = {self.root.get(a, a) for a in e.inputs if isinstance(a, Var)}
        dying |= {self.root.get(o, o) for o in e.outputs}
        for r in sorted(dying, key=lambda v: v.id):         # a set of vars: fix the order, plans must be stable
            b = self.buffer_of.get(r)
            if b is not None and self.holder[b] is r and self.last.get(r, i) == i:
                self.holder[b] = None
                self.free.append(b)


def plan(graph: Graph) -> MemoryPlan:
    """A checked memory plan for ``graph``'s activations."""
    p = _Planner(graph).run()
    p.check(graph)
    return p


@graph_pass("plan_memory", explain=True, bodies=False)
def plan_memory(graph: Graph) -> Graph:
    """Assign activation buffers by liveness, in place where safe; the checked plan goes to graph.meta."""
    p = plan(graph)
    t1, t64 = {s: 1 for s in graph.symbols} | {"T": 1, "P": 0}, {s: 1 for s in graph.symbols} | {"T": 64, "P": 0}
    note(f"{len(p.buffer_of)} values in {len(p.sizes)} buffers ({len(p.in_place)} in place): "
         f"{fmt_bytes(p.peak_bytes(t1))} vs {fmt_bytes(p.naive_bytes(t1))} one per value at T=1, "
         f"{fmt_bytes(p.peak_bytes(t64))} vs {fmt_bytes(p.naive_bytes(t64))} at T=64")
    return graph.replace(meta={**graph.meta, "memory_plan": p})
