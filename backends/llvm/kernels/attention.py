"""Causal attention with rope over a KV cache, as three kernels called in turn (the executor
puts a barrier between them):

    rope_kv_store_<tag>_<target>(k, v, k_cache, v_cache, positions, [freq_factors], i64 T, i64 P, ith, nth)
        k_cache[P+t, g] = rope(k[t, g], positions[t]);  v_cache[P+t, g] = v[t, g]
        (converted or quantised to the cache types); threads split T*Hkv rows
    attention_<tag>_<target>(q, k_cache, v_cache, positions, [freq_factors], partial, out, i64 T, i64 P, ith, nth)
        out[t, h] = sum_j softmax_j(s_j) v_cache[j, h // G],  over the keys j visible from P+t,
        s_j = softcap(scale * rope(q[t, h], positions[t]) · k_cache[j, h // G])
    attention_combine_<tag>_<target>(partial, out, i64 T, i64 P, ith, nth)
        the partial results of a step whose keys were split, merged into out

q f32[T,H,D], k f32[T,Hkv,D], v f32[T,Hkv,Dv], caches [C,Hkv,D|Dv] of f32, f16, bf16, q8_0 or
q4_0 (kv_rows.py reads and writes their rows), positions i32[T] (the rope angles; the
model's are P..P+T-1), freq_factors f32[dims/2] (only when Rope.freq_factors), out
f32[T,H,Dv], partial scratch of partial_bytes(). As in rope_attention's numpy rule, the
cache slot and the causal mask use P+t: key j is visible from query t iff j <= P+t and
P+t - j < window. The caller guarantees P + T <= C.

Slotted caches (``Attention.slot_rows`` = C) hold a batch of sequences, C rows each: kernels A
and B then take seq i32[T] after positions, token t belongs to sequence seq[t] at position
positions[t], its row is seq[t]*C + positions[t], and it sees the keys of its own sequence up to
its position (P is unused). Threads then always split the query rows, in equal shares.

Threads split the work one of two ways, decided alike in B and C from T and nth. With at
least as many (token, kv head) pairs as threads, B splits the T*H query rows into
contiguous shares with equal numbers of (query, key) pairs, and C does nothing. With fewer
(decode with one or two kv heads: a split by rows would leave threads idle or reading the
same keys), B cuts every row's visible keys into one range per thread (flash-decoding):
each thread stores, per row, the running max, the sum of exponentials and the unnormalised
sum of values over its range, and C rescales and adds them.

Rope angles are computed in the kernel once per position and shared by its rows, as ggml
computes them (and the numpy rule, ``ops.rope_angles_table``): theta_0 = pos, theta_(i+1) =
theta_i * base^(-2/dims) rounded to f32 at each pair, / freq_factors[i], * scale; then sin
and cos of that f32 angle, reduced by pi/2 in f64, times mscale, and the rotation
x0*c - x1*s, x0*s + x1*c with the first product fused (an FMA), as ggml's C compiles.
The attention scale is folded into the roped query.

Kernel B takes the query heads that share a kv head (GQA) together, so each K and V row
is read once for all of them, and walks the visible keys once in blocks of 16 with an
online softmax: per block the scores, their max m, p = exp(s - m), one rescale of the
accumulators by exp(m_old - m), then p·V. Threads' shares of rows are whole groups. The
generic target gets a scalar twin: one query row at a time, one key at a time, libm exp, scores
summed in PORTABLE_LANES lanes and everything accumulated with FMA rounded once, as llama.cpp's
x86 kernels round.

Steps of several tokens (prefill) go by tiles instead, where the heads fit (`tiles_fit`): the G
heads of one kv head for lanes // G consecutive tokens, a lane per query row. Each block's K and
V rows are converted to f32 once for the tile; the scores take one FMA per head dim (the key's
value broadcast against the column of the tile's queries), summed in the grouped walk's order,
the softmax runs across lanes, and p·V adds p (a vector of rows) times each broadcast value
(1B-shaped prefill of 512: 90 against 55-60 GFLOP/s in the profile). Key blocks start at
multiples of BLOCK in both walks and lanes mask the keys they do not see, so a row's result is
the same bits whatever tile, thread count or step it falls in.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from llvmlite import ir

from ggraph.backends.llvm.kernels import vmath
from ggraph.backends.llvm.kernels.blocks import pack
from ggraph.backends.llvm.kernels.builder import Kernel, f32, f64, i32, i64, splat_const, vec
from ggraph.backends.llvm.kernels.isa import PORTABLE_LANES, Isa, vector_path
from ggraph.backends.llvm.kernels.kv_rows import KVRow, check_cache_type
from ggraph.backends.llvm.target import Target
from ggraph.ops import ROPE_STYLES

BLOCK = 16                       # keys per online-softmax step in the vector kernel
ROW_COST = BLOCK                 # fixed cost of a query row (rope, a softmax block), in key units
SPLIT_T = 4                      # key splitting (flash-decoding) serves steps of at most this many tokens
SPLIT_MAX = 32                   # ... cut into at most this many key ranges, one per thread
PREFETCH_KEYS = BLOCK            # the score loop prefetches the K and V rows this many keys ahead


@dataclass(frozen=True)
class Rope:
    """Rotary embedding parameters, as ops.rope takes them."""

    dims: int                    # leading dims of each head that rotate (even, <= D)
    base: float
    scale: float = 1.0           # multiplies positions
    style: str = "neox"          # "neox": pairs (i, i + dims/2); "interleaved": pairs (2i, 2i+1)
    mscale: float = 1.0          # multiplies cos and sin
    freq_factors: bool = False   # True: the kernels take f32[dims/2] that divides the frequencies

    def __post_init__(self):
        if self.style not in ROPE_STYLES:
            raise ValueError(f"rope: style must be one of {ROPE_STYLES}, got {self.style!r}")
        if self.dims <= 0 or self.dims % 2:
            raise ValueError(f"rope: rotary dims {self.dims} must be even and positive")


@dataclass(frozen=True)
class Attention:
    """Static shape and attention parameters, as ops.attention takes them."""

    H: int
    Hkv: int
    D: int
    Dv: int
    scale: float
    window: int | None = None
    softcap: float | None = None
    k_type: str = "f32"          # the caches' element types (kv_rows.CACHE_TYPES)
    v_type: str = "f32"
    slot_rows: int | None = None  # slotted caches: rows per sequence slot, and a seq i32[T] argument

    def __post_init__(self):
        for t, n in ((self.k_type, self.D), (self.v_type, self.Dv)):
            if check_cache_type(t).block_size > 1 and n % 32:
                raise ValueError(f"attention: a {t} cache needs a head dim that is a multiple of 32, not {n}")
        if min(self.H, self.Hkv, self.D, self.Dv) <= 0 or self.H % self.Hkv:
            raise ValueError(f"attention: {self.H} query heads must be a positive multiple of "
                             f"{self.Hkv} kv heads, and D={self.D}, Dv={self.Dv} positive")
        if self.window is not None and self.window < 1:
            raise ValueError(f"attention: window {self.window} must be at least 1")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention: softcap {self.softcap} must be positive")
        if self.slot_rows is not None and self.slot_rows < 1:
            raise ValueError(f"attention: slot_rows {self.slot_rows} must be at least 1")


def from_rope_attention(eqn) -> tuple[Attention, Rope]:
    """The kernels' static parameters for a `rope_attention` eqn (inputs q k v k_cache v_cache
    pos positions [freq_factors]); shapes other than T must be static."""
    q, k, v = (a.aval for a in eqn.inputs[:3])
    (_, H, D), Hkv, Dv = q.shape, k.shape[1], v.shape[2]
    for name, d in (("H", H), ("D", D), ("Hkv", Hkv), ("Dv", Dv)):
        if not isinstance(d, int):
            raise ValueError(f"rope_attention: {name} = {d} must be static for the llvm kernels")
    p = eqn.params
    kt, vt = (a.aval.dtype.name for a in eqn.inputs[3:5])
    attn = Attention(H, Hkv, D, Dv, float(p["scale"]), p.get("window"), p.get("softcap"), kt, vt, p.get("slot_rows"))
    rope = Rope(int(p["dims"]), float(p["base"]), float(p["rope_scale"]), p["style"], float(p.get("mscale", 1.0)),
                freq_factors=len(eqn.inputs) > 7)
    return attn, rope


def variant(target: Target) -> str:
    """How the attention kernels run on `target` (for `ggraph target`)."""
    if not vector_path(target):
        return f"scalar (generic twin): one query row and one key at a time, libm, {PORTABLE_LANES}-lane scores"
    return (f"{target.vector_bits // 32} f32 lanes: GQA heads together, blocks of {BLOCK} keys, "
            f"online softmax, in-kernel rope; steps of several tokens in tiles with a lane per query row")


def kernel_names(attn: Attention, rope: Rope | None, target: Target) -> tuple[str, str, str]:
    """The three kernels' names: shapes, a hash of every parameter, the target."""
    h = hashlib.sha256(repr((attn, rope)).encode()).hexdigest()[:10]
    tag = f"h{attn.H}x{attn.Hkv}_d{attn.D}x{attn.Dv}_{h}"
    return (f"rope_kv_store_{tag}_{target.name}", f"attention_{tag}_{target.name}",
            f"attention_combine_{tag}_{target.name}")


def kernel_arg_names(rope: Rope | None, attn: Attention | None = None) -> tuple[tuple[str, ...], ...]:
    """The names of kernel A's, B's and C's arguments before (ith, nth)."""
    ff = ("freq_factors",) if rope is not None and rope.freq_factors else ()
    seq = ("seq",) if attn is not None and attn.slot_rows else ()
    return (("k", "v", "k_cache", "v_cache", "positions") + seq + ff + ("T", "P"),
            ("q", "k_cache", "v_cache", "positions") + seq + ff + ("partial", "out", "T", "P"),
            ("partial", "out", "T", "P"))


def partial_bytes(attn: Attention) -> int:
    """Scratch for split-key partial results: SPLIT_MAX ranges x SPLIT_T*H rows x (max, sum, Dv sums)."""
    return 4 * SPLIT_MAX * SPLIT_T * attn.H * (attn.Dv + 2)


def attention_unit(module: ir.Module, target: Target, attn: Attention, rope: Rope | None) -> tuple[str, ...]:
    """Emit the three kernels into `module`; their names (the llvm backend's kernel-unit form)."""
    return tuple(fn.name for fn, _ in attention_kernels(module, target, attn, rope))


def attention_kernels(module: ir.Module, target: Target, attn: Attention,
                      rope: Rope | None) -> list[tuple[ir.Function, tuple[str, ...]]]:
    """Emit (once) kernels A, B and C; each with the names of its arguments before (ith, nth)."""
    if rope is not None and rope.dims > attn.D:
        raise ValueError(f"rope: rotary dims {rope.dims} exceed the head dim {attn.D}")
    names, args = kernel_names(attn, rope, target), kernel_arg_names(rope, attn)
    for emit, name, arg in zip((_emit_store, _emit_attention, _emit_combine), names, args):
        if not Kernel.exists(module, name):
            emit(module, target, attn, rope, name, arg)
    return [(module.globals[name], arg) for name, arg in zip(names, args)]


# ---------------------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------------------

def _kernel(module, name: str, args: tuple[str, ...]) -> Kernel:
    return Kernel(module, name, args[:-2], args[-2:])


def _buffer(k: Kernel, n: int):
    """A private f32[n] scratch array (an entry-block alloca); returns its address."""
    return k.scratch(f32, n)


def _chunks(n: int, lanes: int) -> list[tuple[int, int]]:
    """(offset, width) pieces covering n: full vectors, then one narrower tail."""
    out = [(o, lanes) for o in range(0, n - n % lanes, lanes)]
    return out + ([(n - n % lanes, n % lanes)] if n % lanes else [])


def _chunked(k: Kernel, n: int, lanes: int, unroll: int, body, name: str = "chunk") -> None:
    """body(offset, widths) over [0, n): a loop taking `unroll` full vectors per step, then the
    remaining vectors and the narrow tail once, statically."""
    step = lanes * unroll
    main = n - n % step
    if main:
        with k.loop(0, main, step=step, name=name) as off:
            body(off, [lanes] * unroll)
    rest = [w for _, w in _chunks(n - main, lanes)]
    if rest:
        body(main, rest)


def _typ(w: int) -> ir.Type:
    return f32 if w == 1 else vec(f32, w)


def _splat(k: Kernel, x: ir.Value, w: int) -> ir.Value:
    return x if w == 1 else k.splat(x, w)


def _zeros(w: int) -> ir.Constant:
    return ir.Constant(f32, 0.0) if w == 1 else splat_const(f32, w, 0.0)


def _width(v: ir.Value) -> int:
    return v.type.count if isinstance(v.type, ir.VectorType) else 1


def _scaled(k: Kernel, x: ir.Value, mult: float | None) -> ir.Value:
    return x if mult is None else k.b.fmul(x, vmath.const(x, mult))


class _Rows:
    """What both kernels share: the pointer args, the rope of head rows, the vector width."""

    def __init__(self, k: Kernel, target: Target, attn: Attention, rope: Rope | None, name: str):
        self.k, self.b, self.attn, self.rope = k, k.b, attn, rope
        self.isa = Isa(k, target)
        self.vector = vector_path(target)
        self.lanes = self.isa.vector_bytes // 4 if self.vector else 1
        self._angles = None                                              # scratch: one position's angles
        self.ff = k.arg.get("freq_factors")
        self.keys = KVRow(k, self.isa, attn.k_type, attn.D)             # rows of the caches
        self.values = KVRow(k, self.isa, attn.v_type, attn.Dv)

    def row(self, base, index, width: int):
        """Address of row `index` of `width` floats."""
        return self.k.addr(base, self.k.mul(index, 4 * width))

    def angles(self, pos: ir.Value) -> ir.Value:
        """The rope angles of position ``pos`` (f32) in a private f32[dims/2]: ggml's chain, theta_0 = pos
        and theta_(i+1) = theta_i · base^(-2/dims) rounded to f32 (``ops.rope_angles_table``)."""
        k = self.k
        if self._angles is None:
            self._angles = k.scratch(f32, self.rope.dims // 2)
        with vmath.rope_angles(k, pos, self.rope.dims, self.rope.base) as (i, theta):
            k.store(theta, self._angles, k.mul(i, 4))
        return self._angles

    def position(self, t) -> ir.Value:
        """positions[t] as f32, as ggml's rope takes it ((float)p): the first angle of token t."""
        return self.b.sitofp(self._position(t), f32)

    def _position(self, t) -> ir.Value:
        return self.k.load(i32, self.k.arg["positions"], self.k.mul(t, 4))

    def token(self, t) -> tuple[ir.Value, ir.Value, ir.Value]:
        """(p, k_cache, v_cache) for token t: its position in its sequence, and where that sequence's
        rows start (P + t and the caches; slotted: positions[t] and the rows of slot seq[t])."""
        k, b = self.k, self.b
        if not self.attn.slot_rows:
            return k.add(k.arg["P"], t), k.arg["k_cache"], k.arg["v_cache"]
        seq = b.sext(k.load(i32, k.arg["seq"], k.mul(t, 4)), i64)
        first = k.mul(seq, self.attn.slot_rows * self.attn.Hkv)
        return (b.sext(self._position(t), i64), self.keys.at(k.arg["k_cache"], first),
                self.values.at(k.arg["v_cache"], first))

    def rope_rows(self, pairs: list, pos: ir.Value, mult: float | None) -> None:
        """dst[0:D] = rope(src[0:D]) * mult for each (src, dst), all at position pos: the angles,
        sin and cos are computed once per chunk of pairs and shared by the rows."""
        k, b, rope, lanes = self.k, self.b, self.rope, self.lanes
        start = 0
        if rope is not None:
            half, m = rope.dims // 2, rope.mscale * (1.0 if mult is None else mult)
            angles = self.angles(pos)

            def rotate(off, widths):
                o = 0
                for w in widths:
                    i0 = k.add(off, o)
                    theta = k.load(_typ(w), angles, k.mul(i0, 4))
                    if self.ff is not None:
                        theta = b.fdiv(theta, k.load(_typ(w), self.ff, k.mul(i0, 4)))
                    if rope.scale != 1.0:
                        theta = b.fmul(theta, vmath.const(theta, rope.scale))
                    theta = b.fpext(theta, f64 if w == 1 else vec(f64, w))          # exact: sin, cos to f32
                    if self.vector:
                        s, c = vmath.sincos_f64(self.isa, theta)
                    else:
                        s, c = (b.fptrunc(self.k.intrinsic(f"llvm.{f}.f64", f64, [theta]), f32) for f in ("sin", "cos"))
                    if m != 1.0:
                        s, c = b.fmul(s, vmath.const(s, m)), b.fmul(c, vmath.const(c, m))
                    for src, dst in pairs:                       # ggml's x0·c − x1·s, x0·s + x1·c, contracted
                        x0, x1 = self._pair(src, i0, w)
                        self._store_pair(dst, i0, w, self.isa.fused(x0, c, b.fneg(b.fmul(x1, s))),
                                         self.isa.fused(x0, s, b.fmul(x1, c)))
                    o += w
            _chunked(k, half, lanes, 1, rotate, "pair")
            start = rope.dims

        def copy(off, widths):
            o = 0
            for w in widths:
                i = k.add(off, start + o)
                for src, dst in pairs:
                    k.store(_scaled(k, k.load(_typ(w), src, k.mul(i, 4)), mult), dst, k.mul(i, 4))
                o += w
        if self.attn.D > start:
            _chunked(k, self.attn.D - start, lanes, 1, copy, "keep")

    def _pair(self, src, i0, w: int) -> tuple[ir.Value, ir.Value]:
        """The w rotation pairs from pair index i0: neox (i, i + dims/2), interleaved (2i, 2i+1)."""
        k, half = self.k, self.rope.dims // 2
        if self.rope.style == "neox":
            return k.load(_typ(w), src, k.mul(i0, 4)), k.load(_typ(w), src, k.mul(k.add(i0, half), 4))
        if w == 1:
            return k.load(f32, src, k.mul(i0, 8)), k.load(f32, src, k.add(k.mul(i0, 8), 4))
        x = k.load(vec(f32, 2 * w), src, k.mul(i0, 8))
        return k.shuffle(x, range(0, 2 * w, 2)), k.shuffle(x, range(1, 2 * w, 2))

    def _store_pair(self, dst, i0, w: int, r0: ir.Value, r1: ir.Value) -> None:
        k, half = self.k, self.rope.dims // 2
        if self.rope.style == "neox":
            k.store(r0, dst, k.mul(i0, 4))
            k.store(r1, dst, k.mul(k.add(i0, half), 4))
        elif w == 1:
            k.store(r0, dst, k.mul(i0, 8))
            k.store(r1, dst, k.add(k.mul(i0, 8), 4))
        else:
            k.store(k.shuffle(r0, [j // 2 + (j % 2) * w for j in range(2 * w)], r1), dst, k.mul(i0, 8))


# ---------------------------------------------------------------------------------------
# kernel A: rope the new keys into the cache, copy the new values
# ---------------------------------------------------------------------------------------

def _emit_store(module, target: Target, attn: Attention, rope: Rope | None, name: str, args) -> None:
    k = _kernel(module, name, args)
    rows = _Rows(k, target, attn, rope, name)
    b = k.b
    scratch = _buffer(k, attn.D)
    start, end = k.thread_share(b.mul(k.arg["T"], k.i64(attn.Hkv)))
    with k.loop(start, end, name="row") as r:
        t = b.udiv(r, k.i64(attn.Hkv))
        p, kc, vc = rows.token(t)
        slot = k.add(k.mul(p, attn.Hkv), b.urem(r, k.i64(attn.Hkv)))                      # p*Hkv + g
        key = rows.keys.at(kc, slot)
        roped = key if attn.k_type == "f32" else scratch                  # other types: rope, then convert
        rows.rope_rows([(rows.row(k.arg["k"], r, attn.D), roped)], rows.position(t), None)
        if roped is not key:
            rows.keys.store(roped, key)
        rows.values.store(rows.row(k.arg["v"], r, attn.Dv), rows.values.at(vc, slot))
    k.finish()


# ---------------------------------------------------------------------------------------
# kernel B: query rows against their visible keys, online softmax
# ---------------------------------------------------------------------------------------

def _emit_attention(module, target: Target, attn: Attention, rope: Rope | None, name: str, args) -> None:
    k = _kernel(module, name, args)
    rows = _Rows(k, target, attn, rope, name)
    walk = _attention_grouped if rows.vector else _attention_rows
    b = k.b
    with b.if_else(_splitting(rows)) as (split, whole):
        with split:                                     # every row, this thread's range of keys
            part = b.sext(k.arg["ith"], i64)
            with k.if_then(b.icmp_signed("<", part, _n_parts(rows))):
                walk(rows, (k.i64(0), b.mul(k.arg["T"], k.i64(attn.H))), part)
        with whole:                                     # this thread's rows, all their keys
            if rows.vector and tiles_fit(attn, rows.lanes):
                with b.if_else(b.icmp_signed(">", k.arg["T"], k.i64(1))) as (many, one):
                    with many:
                        _attention_tiles(rows)
                    with one:
                        walk(rows, _balanced_share(rows), None)
            else:
                walk(rows, _balanced_share(rows), None)
    k.finish()


def _splitting(rows: _Rows) -> ir.Value:
    """Whether this step splits keys across threads: fewer (token, kv head) pairs than threads, so
    a split by rows would leave threads idle or reading the same keys (decode with one or two kv
    heads). Kernels B and C decide alike."""
    k, b = rows.k, rows.b
    if rows.attn.slot_rows:                               # a batch of sequences: rows split, keys whole
        return ir.Constant(ir.IntType(1), 0)
    T = k.arg["T"]
    few = b.icmp_signed("<", b.mul(T, k.i64(rows.attn.Hkv)), b.sext(k.arg["nth"], i64))
    return b.and_(few, b.icmp_signed("<=", T, k.i64(SPLIT_T)))


def _n_parts(rows: _Rows) -> ir.Value:
    """Key ranges of a split step: one per thread, at most SPLIT_MAX."""
    k, b = rows.k, rows.b
    nth = b.sext(k.arg["nth"], i64)
    return b.select(b.icmp_signed("<", nth, k.i64(SPLIT_MAX)), nth, k.i64(SPLIT_MAX))


def _part_range(rows: _Rows, lo, hi, part) -> tuple[ir.Value, ir.Value]:
    """Range ``part`` of the n_parts equal cuts of keys [lo, hi)."""
    k, b = rows.k, rows.b
    n, length = _n_parts(rows), b.sub(hi, lo)
    return (k.add(lo, b.sdiv(k.mul(length, part), n)), k.add(lo, b.sdiv(k.mul(length, k.add(part, 1)), n)))


def _partial_row(rows: _Rows, part, r):
    """Where query row r's partial result of key range ``part`` lives: f32 {max, sum, acc[Dv]}."""
    k, attn = rows.k, rows.attn
    slot = k.add(k.mul(part, SPLIT_T * attn.H), r)
    return k.addr(k.arg["partial"], k.mul(slot, 4 * (attn.Dv + 2)))


def _key_range(rows: _Rows, p) -> tuple[ir.Value, ir.Value]:
    """[lo, hi) of the keys visible from position p: causal, and inside the window."""
    k, b, window = rows.k, rows.b, rows.attn.window
    lo = k.i64(0)
    if window is not None:
        lo = k.add(p, 1 - window)
        lo = b.select(b.icmp_signed("<", lo, k.i64(0)), k.i64(0), lo)
    return lo, k.add(p, 1)


def _work_before(rows: _Rows, r) -> ir.Value:
    """Work in rows 0..r-1 of T*H: visible (query row, key) pairs plus ROW_COST per row.

    Token t sees keys(t) = min(P + t + 1, window) keys; the first m = clamp(window - P - 1, 0, t)
    tokens are below the window, the rest see exactly `window`."""
    k, b, attn = rows.k, rows.b, rows.attn
    t, h = b.udiv(r, k.i64(attn.H)), b.urem(r, k.i64(attn.H))
    P1 = k.add(k.arg["P"], 1)

    def clamp(v, lo, hi):
        return b.select(b.icmp_signed("<", v, lo), lo, b.select(b.icmp_signed(">", v, hi), hi, v))
    if attn.window is None:
        m, keys = t, k.add(P1, t)
    else:
        m = clamp(b.sub(k.i64(attn.window), P1), k.i64(0), t)
        keys = clamp(k.add(P1, t), k.i64(0), k.i64(attn.window))
    tri = b.sdiv(k.mul(m, b.sub(m, k.i64(1))), k.i64(2))
    tokens = k.add(k.mul(m, P1), tri, k.mul(b.sub(t, m), attn.window or 0))
    return k.add(k.mul(tokens, attn.H), k.mul(h, keys), k.mul(r, ROW_COST))


def _balanced_share(rows: _Rows) -> tuple[ir.Value, ir.Value]:
    """This thread's [start, end) of the T*H query rows, cut so that every thread gets about
    the same number of visible (query, key) pairs (a contiguous split would give the thread
    holding the last tokens most of the causal triangle). Cuts fall between groups of the G
    heads that share a kv head, so every row is computed the same way whatever the thread
    count. Boundaries come from a binary search on `_work_before`, the same function for
    every thread, so shares tie up exactly."""
    k, b = rows.k, rows.b
    G = rows.attn.H // rows.attn.Hkv
    n = b.mul(k.arg["T"], k.i64(rows.attn.Hkv))                       # groups
    if rows.attn.slot_rows:                                           # positions vary by sequence: equal shares
        start, end = k.thread_share(n)
        return k.mul(start, G), k.mul(end, G)
    total = _work_before(rows, k.mul(n, G))
    ith, nth = b.sext(k.arg["ith"], i64), b.sext(k.arg["nth"], i64)

    def boundary(i):
        goal = b.sdiv(k.mul(total, i), nth)                           # first group whose prefix reaches it
        lo, hi = k.var(i64, k.i64(0)), k.var(i64, n)
        head, body, done = (k.fn.append_basic_block(f"split.{x}") for x in ("head", "body", "done"))
        b.branch(head)
        b.position_at_end(head)
        b.cbranch(b.icmp_signed("<", lo.get(), hi.get()), body, done)
        b.position_at_end(body)
        mid = b.sdiv(k.add(lo.get(), hi.get()), k.i64(2))
        reached = b.icmp_signed(">=", _work_before(rows, k.mul(mid, G)), goal)
        hi.set(b.select(reached, mid, hi.get()))
        lo.set(b.select(reached, lo.get(), k.add(mid, 1)))
        b.branch(head)
        b.position_at_end(done)
        return lo.get()
    start = boundary(ith)
    end = b.select(b.icmp_signed("==", k.add(ith, 1), nth), n, boundary(k.add(ith, 1)))
    return k.mul(start, G), k.mul(end, G)


def _softcap(rows: _Rows, s: ir.Value) -> ir.Value:
    """c * tanh(s / c) (s unchanged without a softcap)."""
    c = rows.attn.softcap
    if c is None:
        return s
    b = rows.b
    th = vmath.unary(rows.isa, "tanh", b.fmul(s, vmath.const(s, 1.0 / c)), rows.vector)
    return b.fmul(th, vmath.const(s, c))


def _attention_grouped(rows: _Rows, share, part) -> None:
    """The G query rows (t, h) that share a kv head walk the keys together, so K and V rows are
    read once for all of them; ``share`` is whole groups. With ``part``, only that range of
    each row's keys is walked and the partial result is stored for kernel C."""
    k, attn = rows.k, rows.attn
    G = attn.H // attn.Hkv
    NP = _pow2(G)
    bufs = {"q": _buffer(k, G * attn.D), "s": _buffer(k, BLOCK * NP), "acc": _buffer(k, G * attn.Dv)}
    start, end = share
    with k.loop(start, end, step=G, name="group") as r:
        _run(rows, bufs, r, G, part)


def tiles_fit(attn: Attention, lanes: int) -> bool:
    """Whether kernel B's query tiles serve ``attn``: one vector of lanes holds whole groups of the G
    query heads of a kv head, the head dims are whole vectors, and the caches are not slotted."""
    G = attn.H // attn.Hkv
    return lanes > 1 and G <= lanes and attn.D % lanes == 0 and attn.Dv % lanes == 0 and not attn.slot_rows


def _attention_tiles(rows: _Rows) -> None:
    """Steps of several tokens (prefill), lanes as query rows: a tile is the G heads of one kv head
    for TQ = lanes // G consecutive tokens. Per block of BLOCK keys the K and V rows are converted
    once for all the tile's rows; the scores are one FMA per (key, dim) with the key's value
    broadcast against the column of the tile's (roped, transposed) queries, the online softmax runs
    lane by lane, and p.V adds p[key] (a vector of rows) times each broadcast value. Key blocks
    start at multiples of BLOCK and each lane masks the keys it does not see, so a row's result
    does not depend on which tokens or threads share its tile. Threads take tiles in turn."""
    k, b, attn, L = rows.k, rows.b, rows.attn, rows.lanes
    G = attn.H // attn.Hkv
    TQ = L // G
    T = k.arg["T"]
    units = b.mul(b.sdiv(k.add(T, TQ - 1), k.i64(TQ)), k.i64(attn.Hkv))
    ith, nth = b.sext(k.arg["ith"], i64), b.sext(k.arg["nth"], i64)
    bufs = {"q": _buffer(k, L * attn.D), "qt": _buffer(k, attn.D * L), "k": _buffer(k, BLOCK * attn.D),
            "v": _buffer(k, BLOCK * attn.Dv), "p": _buffer(k, BLOCK * L), "acc": _buffer(k, attn.Dv * L),
            "part": _buffer(k, BLOCK * L * L)}
    turns = b.sdiv(k.add(units, b.sub(nth, k.i64(1))), nth)
    with k.loop(0, turns, name="turn") as turn:
        unit = k.add(k.mul(turn, nth), ith)
        with k.if_then(b.icmp_signed("<", unit, units)):
            _tile(rows, bufs, b.sdiv(unit, k.i64(attn.Hkv)), b.srem(unit, k.i64(attn.Hkv)), TQ)


def _tile(rows: _Rows, bufs: dict, tb, g, TQ: int) -> None:
    """Tokens TQ*tb.. (those past T repeat the last, unstored) x the query heads of kv head g."""
    k, b, isa, attn, L = rows.k, rows.b, rows.isa, rows.attn, rows.lanes
    G, D, Dv = attn.H // attn.Hkv, attn.D, attn.Dv
    n = TQ * G
    vL = vec(f32, L)
    T = k.arg["T"]
    last = b.sub(T, k.i64(1))
    t0 = k.mul(tb, TQ)
    real = [b.icmp_signed("<", k.add(t0, tq), T) for tq in range(TQ)]
    toks = [b.select(r, k.add(t0, tq), last) for tq, r in enumerate(real)]
    qrow = lambda i: k.addr(bufs["q"], 4 * i * D)                                    # noqa: E731
    _, kc, vc = rows.token(toks[0])
    for tq, tok in enumerate(toks):
        heads = [(rows.row(k.arg["q"], k.add(k.mul(tok, attn.H), k.mul(g, G), gi), D), qrow(tq * G + gi))
                 for gi in range(G)]
        rows.rope_rows(heads, rows.position(tok), attn.scale)
    for i in range(n, L):                                                            # rows no query fills
        for c in range(D // L):
            k.store(_zeros(L), qrow(i), 4 * c * L)
    for c in range(D // L):                                                          # qt[d][lane] = q[lane][d]
        cols = k.transpose([k.load(vL, qrow(i), 4 * c * L) for i in range(L)])
        for j, col in enumerate(cols):
            k.store(col, bufs["qt"], 4 * (c * L + j) * L)
    ranges = [_key_range(rows, k.add(k.arg["P"], tok)) for tok in toks]
    lanes_of = lambda vals, pad: [b.trunc(vals[i // G], i32) if i < n else ir.Constant(i32, pad)  # noqa: E731
                                  for i in range(L)]
    lo_v = pack(k, lanes_of([lo for lo, _ in ranges], 0))
    hi_v = pack(k, lanes_of([hi for _, hi in ranges], 0))
    jhi = ranges[-1][1]
    jlo = b.mul(b.sdiv(ranges[0][0], k.i64(BLOCK)), k.i64(BLOCK))
    with k.loop(0, Dv, name="azero") as d:
        k.store(_zeros(L), bufs["acc"], k.mul(d, 4 * L))
    m = k.var(vL, _splat_const(L, -math.inf))
    total = k.var(vL, _zeros(L))
    with k.loop(jlo, jhi, step=BLOCK, name="kblk") as j0:
        krows, vrows = [], []
        for jj in range(BLOCK):
            j = b.select(b.icmp_signed("<", k.add(j0, jj), jhi), k.add(j0, jj), b.sub(jhi, k.i64(1)))
            krows.append(rows.keys.at(kc, k.add(k.mul(j, attn.Hkv), g)))
            vrows.append(rows.values.at(vc, k.add(k.mul(j, attn.Hkv), g)))
        _rows_to(rows, rows.keys, krows, bufs["k"], D)
        _rows_to(rows, rows.values, vrows, bufs["v"], Dv)
        srows = []
        for jj, score in enumerate(_tile_scores(rows, bufs)):
            j = b.trunc(k.add(j0, jj), i32)
            seen = b.and_(b.icmp_signed(">=", k.splat(j, L), lo_v), b.icmp_signed("<", k.splat(j, L), hi_v))
            srows.append(b.select(seen, _softcap(rows, score), _splat_const(L, -math.inf)))
        corr = _softmax_step(rows, srows, m, total, bufs["p"])
        ps = [k.load(vL, bufs["p"], 4 * jj * L) for jj in range(BLOCK)]
        step = 8 if Dv % 8 == 0 else 1
        with k.loop(0, Dv, step=step, name="pv") as d0:
            accs = [b.fmul(k.load(vL, bufs["acc"], k.mul(k.add(d0, dd), 4 * L)), corr) for dd in range(step)]
            for jj, pj in enumerate(ps):
                for dd in range(step):
                    vv = k.splat(k.load(f32, bufs["v"], k.mul(k.add(d0, jj * Dv + dd), 4)), L)
                    accs[dd] = isa.fma(pj, vv, accs[dd])
            for dd, a in enumerate(accs):
                k.store(a, bufs["acc"], k.mul(k.add(d0, dd), 4 * L))
    inv = b.fdiv(_splat_const(L, 1.0), total.get())
    for c in range(Dv // L):                                                         # out[row][d] = acc[d][lane] / total
        outs = k.transpose([k.load(vL, bufs["acc"], 4 * (c * L + j) * L) for j in range(L)])
        for i in range(n):
            tq, gi = divmod(i, G)
            with k.if_then(real[tq]):
                r = k.add(k.mul(toks[tq], attn.H), k.mul(g, G), gi)
                value = b.fmul(outs[i], k.splat(b.extract_element(inv, ir.Constant(i32, i)), L))
                k.store(value, rows.row(k.arg["out"], r, Dv), 4 * c * L)


def _tile_scores(rows: _Rows, bufs: dict) -> list:
    """The block's BLOCK keys against every lane's query, summed in the order of `_scores`: lane l
    of a D chunk accumulates dims l, l + lanes, ... in turn, and `_lane_sums` folds the lanes in
    halves (l + lanes/2 onto l, then l + lanes/4, ...), so a row gets the bits the one-token path
    gives it. The partial sums of one l go for all keys at once (each query column loaded once for
    BLOCK keys) into a buffer, and are folded key by key."""
    k, b, isa, attn, L = rows.k, rows.b, rows.isa, rows.attn, rows.lanes
    vL = vec(f32, L)
    with k.loop(0, L, name="sl") as lane:
        parts = [k.var(vL, _zeros(L)) for _ in range(BLOCK)]
        with k.loop(0, attn.D, step=L, name="sd") as d0:
            d = k.add(d0, lane)
            qv = k.load(vL, bufs["qt"], k.mul(d, 4 * L))
            for jj, part in enumerate(parts):
                kv = k.splat(k.load(f32, bufs["k"], k.mul(k.add(d, jj * attn.D), 4)), L)
                part.set(isa.fma(kv, qv, part.get()))
        for jj, part in enumerate(parts):
            k.store(part.get(), bufs["part"], k.add(k.mul(lane, 4 * L), 4 * L * L * jj))
    scores = []
    for jj in range(BLOCK):
        sums = [k.load(vL, bufs["part"], 4 * L * (L * jj + lane)) for lane in range(L)]
        while len(sums) > 1:
            half = len(sums) // 2
            sums = [b.fadd(sums[i], sums[i + half]) for i in range(half)]
        scores.append(sums[0])
    return scores


def _rows_to(rows: _Rows, kv: KVRow, addrs: list, dst, n: int) -> None:
    """The f32 values of cache rows ``addrs`` into dst[row][0:n]."""
    k = rows.k

    def copy(off, widths):
        for r, row in enumerate(addrs):
            o = 0
            for piece, w in zip(kv.loads(row, off, widths), widths):
                k.store(piece, dst, k.mul(k.add(off, o + r * n), 4))
                o += w
    _chunked(k, n, rows.lanes, _unroll(kv, rows.lanes, 1), copy, "conv")


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _keys_per_step(rows: _Rows, n: int) -> int:
    """Keys whose scores one step of the score loop computes: enough that (keys x padded queries)
    accumulators fill a vector of sums, which `_lane_sums` then reduces together."""
    return max(1, min(BLOCK, rows.lanes // _pow2(n)))


def _run(rows: _Rows, bufs: dict, r, n: int, part) -> None:
    """Query rows r..r+n-1 (one token, one kv head): rope, then the keys in blocks of BLOCK that
    start at multiples of BLOCK, keys before the window masked, as query tiles take them (with
    ``part``: that range of them, from its start, the unnormalised result stored as a partial).

    A block's scores are kept key-major, s[jj][i] for key jj and query i (queries padded to NP,
    a power of two), so the online softmax runs down the block with NP-lane vectors, one lane
    per query: no horizontal max or sum, and p[jj][i] is where p·V reads it."""
    k, b, attn = rows.k, rows.b, rows.attn
    NP = _pow2(n)
    t, g = b.udiv(r, k.i64(attn.H)), b.udiv(b.urem(r, k.i64(attn.H)), k.i64(attn.H // attn.Hkv))
    p, bufs["kc"], bufs["vc"] = rows.token(t)
    qrow = lambda i: k.addr(bufs["q"], 4 * i * attn.D)                  # noqa: E731
    arow = lambda i: k.addr(bufs["acc"], 4 * i * attn.Dv)               # noqa: E731
    rows.rope_rows([(rows.row(k.arg["q"], k.add(r, i), attn.D), qrow(i)) for i in range(n)],
                   rows.position(t), attn.scale)
    lo, hi = _key_range(rows, p)
    if part is not None:
        lo, hi = _part_range(rows, lo, hi, part)
        first = lo
    else:                                       # blocks at multiples of BLOCK, as query tiles take them
        first = b.mul(b.sdiv(lo, k.i64(BLOCK)), k.i64(BLOCK))

    def zero(off, widths):
        o = 0
        for w in widths:
            for i in range(n):
                k.store(_zeros(w), arow(i), k.mul(k.add(off, o), 4))
            o += w
    _chunked(k, attn.Dv, rows.lanes, 1, zero, "zero")
    vnp = _typ(NP)
    m = k.var(vnp, _splat_const(NP, -math.inf))
    total = k.var(vnp, _zeros(NP))
    KB = _keys_per_step(rows, n)
    with k.loop(first, hi, step=BLOCK, name="blk") as j0:
        nk = b.sub(hi, j0)
        nk = b.select(b.icmp_signed("<", nk, k.i64(BLOCK)), nk, k.i64(BLOCK))
        with k.loop(0, nk, step=KB, name="key") as jj:
            _scores(rows, bufs, qrow, n, j0, jj, hi, g, KB)
        live = [b.and_(b.icmp_signed("<", k.i64(jj), nk), b.icmp_signed(">=", k.add(j0, jj), lo)) for jj in range(BLOCK)]
        srows = []
        for jj in range(BLOCK):                                         # the live keys' scores
            sj = _softcap(rows, k.load(vnp, bufs["s"], 4 * jj * NP))
            srows.append(b.select(live[jj], sj, _splat_const(NP, -math.inf)))
        corr = _softmax_step(rows, srows, m, total, bufs["s"])                # p over s, in place
        _values(rows, bufs, arow, n, j0, nk, g, [_lane(k, corr, i) for i in range(n)])

    ms, totals = [_lane(k, m.get(), i) for i in range(n)], [_lane(k, total.get(), i) for i in range(n)]
    if part is not None:
        for i in range(n):
            dst = _partial_row(rows, part, k.add(r, i))
            k.store(ms[i], dst)
            k.store(totals[i], dst, 4)
            k.intrinsic("llvm.memcpy.p0.p0.i64", ir.VoidType(),
                        [k.addr(dst, 8), arow(i), k.i64(4 * attn.Dv), ir.Constant(ir.IntType(1), 0)])
        return
    invs = [b.fdiv(ir.Constant(f32, 1.0), totals[i]) for i in range(n)]

    def finish(off, widths):
        o = 0
        for w in widths:
            for i in range(n):
                at = k.mul(k.add(off, o), 4)
                out = rows.row(k.arg["out"], k.add(r, i), attn.Dv)
                k.store(b.fmul(k.load(_typ(w), arow(i), at), _splat(k, invs[i], w)), out, at)
            o += w
    _chunked(k, attn.Dv, rows.lanes, 1, finish, "out")


def _softmax_step(rows: _Rows, srows: list, m, total, pbuf) -> ir.Value:
    """One block of the online softmax over its masked scores (one value or vector per key, a lane
    per query row): the running max ``m`` and sum ``total`` move on, p = exp(s - max) goes to
    pbuf key by key, and the factor the accumulators must be rescaled by is returned. A lane that
    has seen no key yet (max -inf) takes p = 0 and a factor of 0 rather than exp(-inf + inf)."""
    b, isa = rows.b, rows.isa
    w = _width(srows[0])
    top = srows[0]
    for sj in srows[1:]:
        top = isa.maxnum(top, sj)
    m_old = m.get()
    m_new = isa.maxnum(m_old, top)
    m_use = b.select(b.fcmp_ordered("==", m_new, _splat_const(w, -math.inf)), _zeros(w), m_new)
    corr = vmath.exp(isa, b.fsub(m_old, m_use))
    block_sum = None
    for jj, sj in enumerate(srows):
        pj = vmath.exp(isa, b.fsub(sj, m_use))
        block_sum = pj if block_sum is None else b.fadd(block_sum, pj)
        rows.k.store(pj, pbuf, 4 * jj * w)
    total.set(isa.fma(total.get(), corr, block_sum))
    m.set(m_new)
    return corr


def _splat_const(w: int, x: float) -> ir.Constant:
    return ir.Constant(f32, x) if w == 1 else splat_const(f32, w, x)


def _lane(k: Kernel, v: ir.Value, i: int) -> ir.Value:
    return v if _width(v) == 1 else k.b.extract_element(v, ir.Constant(i32, i))


def _scores(rows: _Rows, bufs: dict, qrow, n: int, j0, jj, hi, g, KB: int) -> None:
    """s[jj + kk][i] = q_i · k_(j0+jj+kk) for KB keys and the n queries, each chunk of a K row
    loaded once for all queries. Keys past ``hi`` (a partial last step) read row hi-1 and their
    scores are masked by the caller."""
    k, b, isa, attn, lanes = rows.k, rows.b, rows.isa, rows.attn, rows.lanes
    NP = _pow2(n)
    last = b.sub(hi, k.i64(1))
    krows = []
    for kk in range(KB):
        j = k.add(j0, jj, kk)
        ahead = k.add(k.mul(k.add(j, PREFETCH_KEYS), attn.Hkv), g)       # the next block's rows, on their way
        rows.keys.prefetch(rows.keys.at(bufs["kc"], ahead))
        rows.values.prefetch(rows.values.at(bufs["vc"], ahead))
        j = b.select(b.icmp_signed(">", j, last), last, j) if kk else j
        krows.append(rows.keys.at(bufs["kc"], k.add(k.mul(j, attn.Hkv), g)))
    acc = [[k.var(vec(f32, lanes), _zeros(lanes)) for _ in range(n)] for _ in range(KB)]

    def dot(off, widths):
        pieces = [rows.keys.loads(krow, off, widths) for krow in krows]        # a block's pieces share its scale
        o = 0
        for c, w in enumerate(widths):
            at = k.mul(k.add(off, o), 4)
            kvs = [kp[c] for kp in pieces]
            for i in range(n):
                qv = k.load(_typ(w), qrow(i), at)
                for kk in range(KB):
                    a = acc[kk][i]
                    if w == lanes:
                        a.set(isa.fma(kvs[kk], qv, a.get()))
                    else:                                               # a narrow tail, zero-padded
                        prod = b.fmul(kvs[kk], qv)
                        wide = k.shuffle(prod, list(range(w)) + [w] * (lanes - w), _zeros(w)) if w > 1 else \
                            b.insert_element(_zeros(lanes), prod, ir.Constant(i32, 0))
                        a.set(b.fadd(a.get(), wide))
            o += w
    _chunked(k, attn.D, lanes, _unroll(rows.keys, lanes, 1 if KB * n >= 4 else 2), dot, "d")
    sums = [a.get() if i < n else _zeros(lanes) for kk in range(KB) for i, a in
            enumerate(acc[kk] + [None] * (NP - n))]
    per = min(len(sums), lanes)                                         # vectors reduced together
    for c in range(0, len(sums), per):
        k.store(_lane_sums(k, sums[c:c + per]), bufs["s"], k.mul(k.add(k.mul(jj, NP), c), 4))


def _unroll(row: KVRow, lanes: int, want: int, most: bool = False) -> int:
    """Vectors per step of a loop over a row's values: ``want``, adjusted for a block type so that
    each step's pieces lie in one block (they share its scale): a whole block per step, or with
    ``most`` (a register budget) at most ``want`` vectors that divide one."""
    if row.dt.block_size == 1 or lanes >= 32:
        return want
    per_block = 32 // lanes
    if not most:
        return per_block * max(1, want // per_block)
    return max(u for u in range(1, per_block + 1) if per_block % u == 0 and u <= max(want, 1))


def _lane_sums(k: Kernel, vs: list) -> ir.Value:
    """A vector whose lane i is the sum of the lanes of vs[i] (len(vs) a power of two, at most
    the lane count): pairs of vectors fold half of every group of lanes onto the other half and
    merge, so each add serves all the sums at once, then the single vector folds down to len(vs)
    lanes. Where len(vs) == 1 this is the plain halving sum."""
    b = k.b
    W = _width(vs[0])
    if W == 1:
        return vs[0]
    group = W                                                          # lanes per source in each vector
    while len(vs) > 1:
        half, nxt = group // 2, []
        for x, y in zip(vs[0::2], vs[1::2]):
            firsts = [gi * group + l for gi in range(W // group) for l in range(half)]
            lo = firsts + [W + i for i in firsts]
            hi = [i + half for i in firsts] + [W + i + half for i in firsts]
            nxt.append(b.fadd(k.shuffle(x, lo, y), k.shuffle(x, hi, y)))
        vs, group = nxt, half
    v = vs[0]
    while group > 1:
        half = group // 2
        firsts = [gi * group + l for gi in range(_width(v) // group) for l in range(half)]
        v = b.fadd(k.shuffle(v, firsts), k.shuffle(v, [i + half for i in firsts]))
        group = half
    return v if _width(v) > 1 else b.extract_element(v, ir.Constant(i32, 0))


def _values(rows: _Rows, bufs: dict, arow, n: int, j0, nk, g, corr: list) -> None:
    """acc_i = acc_i * corr_i + sum_jj p[jj][i] v_(j0+jj), a group of Dv chunks in registers at a time."""
    k, isa, attn, lanes = rows.k, rows.isa, rows.attn, rows.lanes
    NP = _pow2(n)
    per = _unroll(rows.values, lanes, max(1, (16 if lanes >= 16 else 8) // n), most=True)   # accumulators in registers

    def group(off, widths):
        ats = [k.mul(k.add(off, sum(widths[:c])), 4) for c in range(len(widths))]
        accs = [[k.var(_typ(w), k.b.fmul(k.load(_typ(w), arow(i), at), _splat(k, corr[i], w)))
                 for w, at in zip(widths, ats)] for i in range(n)]
        with k.loop(0, nk, name="val") as jj:
            vrow = rows.values.at(bufs["vc"], k.add(k.mul(k.add(j0, jj), attn.Hkv), g))
            vs = rows.values.loads(vrow, off, widths)
            for i in range(n):
                pij = k.load(f32, bufs["s"], k.mul(k.add(k.mul(jj, NP), i), 4))
                for a, v, w in zip(accs[i], vs, widths):
                    a.set(isa.fma(_splat(k, pij, w), v, a.get()))
        for i in range(n):
            for a, at in zip(accs[i], ats):
                k.store(a.get(), arow(i), at)
    _chunked(k, attn.Dv, lanes, per, group, "vg")


def _attention_rows(rows: _Rows, share, part) -> None:
    """The scalar twin: one query row (t, h) at a time (with ``part``, that range of its keys)."""
    k, b, attn = rows.k, rows.b, rows.attn
    q = _buffer(k, attn.D)                                            # this row's roped, scaled query
    start, end = share
    with k.loop(start, end, name="row") as r:
        t, h = b.udiv(r, k.i64(attn.H)), b.urem(r, k.i64(attn.H))
        p, kc, vc = rows.token(t)
        rows.rope_rows([(rows.row(k.arg["q"], r, attn.D), q)], rows.position(t), attn.scale)
        lo, hi = _key_range(rows, p)
        if part is not None:
            lo, hi = _part_range(rows, lo, hi, part)
        out = rows.row(k.arg["out"], r, attn.Dv) if part is None else _partial_row(rows, part, r)
        _keys_scalar(rows, (kc, vc), q, b.udiv(h, k.i64(attn.H // attn.Hkv)), lo, hi, out, part is not None)


def _dot_scalar(rows: _Rows, q, krow) -> ir.Value:
    """q · k in PORTABLE_LANES partial sums (FMA rounded once), then the tail one at a time: the
    order of llama.cpp's f32 K·Q matmul on AVX-512."""
    k, isa, D, L = rows.k, rows.isa, rows.attn.D, PORTABLE_LANES
    main = D - D % L
    lanes = k.var(vec(f32, L), _zeros(L))
    if main:
        with k.loop(0, main, step=L, name="d") as d:
            lanes.set(isa.fused(k.load(vec(f32, L), q, k.mul(d, 4)), rows.keys.load(krow, d, L), lanes.get()))
    dot = k.var(f32, isa.hsum(lanes.get()))
    if main < D:
        with k.loop(main, D, name="dt") as d:
            dot.set(isa.fused(k.load(f32, q, k.mul(d, 4)), rows.keys.load(krow, d, 1), dot.get()))
    return dot.get()


def _keys_scalar(rows: _Rows, caches, q, g, lo, hi, out, partial: bool) -> None:
    """One key at a time: score, running max and sum, rescale the accumulator (the spec). A
    partial result is stored unnormalised after its max and sum."""
    k, b, isa, attn = rows.k, rows.b, rows.isa, rows.attn
    acc = _buffer(k, attn.Dv)
    with k.loop(0, attn.Dv, name="zero") as d:
        k.store(ir.Constant(f32, 0.0), acc, k.mul(d, 4))
    m = k.var(f32, -math.inf)
    total = k.var(f32, 0.0)
    with k.loop(lo, hi, name="key") as j:
        krow = rows.keys.at(caches[0], k.add(k.mul(j, attn.Hkv), g))
        s = _softcap(rows, _dot_scalar(rows, q, krow))
        m_new = isa.maxnum(m.get(), s)
        corr = vmath.libm(isa, "exp", b.fsub(m.get(), m_new))
        p = vmath.libm(isa, "exp", b.fsub(s, m_new))
        total.set(isa.fused(total.get(), corr, p))
        m.set(m_new)
        vrow = rows.values.at(caches[1], k.add(k.mul(j, attn.Hkv), g))
        with k.loop(0, attn.Dv, name="dv") as d:
            a = k.load(f32, acc, k.mul(d, 4))
            k.store(isa.fused(p, rows.values.load(vrow, d, 1), b.fmul(a, corr)), acc, k.mul(d, 4))
    if partial:
        k.store(m.get(), out)
        k.store(total.get(), out, 4)
        with k.loop(0, attn.Dv, name="out") as d:
            k.store(k.load(f32, acc, k.mul(d, 4)), out, k.add(k.mul(d, 4), 8))
        return
    inv = b.fdiv(ir.Constant(f32, 1.0), total.get())                  # times 1/sum, as ggml scales
    with k.loop(0, attn.Dv, name="out") as d:
        k.store(b.fmul(k.load(f32, acc, k.mul(d, 4)), inv), out, k.mul(d, 4))


# ---------------------------------------------------------------------------------------
# kernel C: combine the partial results of a split step
# ---------------------------------------------------------------------------------------

def _emit_combine(module, target: Target, attn: Attention, rope: Rope | None, name: str, args) -> None:
    """out[r] = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i over the key ranges i of row r
    (M the largest m_i); nothing when the step did not split. Threads split rows."""
    k = _kernel(module, name, args)
    rows = _Rows(k, target, attn, None, name)
    b, isa, lanes = k.b, rows.isa, rows.lanes
    with k.if_then(_splitting(rows)):
        n = _n_parts(rows)
        start, end = k.thread_share(b.mul(k.arg["T"], k.i64(attn.H)))
        with k.loop(start, end, name="row") as r:
            top = k.var(f32, -math.inf)
            with k.loop(0, n, name="max") as i:
                top.set(isa.maxnum(top.get(), k.load(f32, _partial_row(rows, i, r))))
            total = k.var(f32, 0.0)
            with k.loop(0, n, name="sum") as i:
                src = _partial_row(rows, i, r)
                w = vmath.libm(isa, "exp", b.fsub(k.load(f32, src), top.get()))
                total.set(isa.fma(w, k.load(f32, src, 4), total.get()))
            out = rows.row(k.arg["out"], r, attn.Dv)
            inv = b.fdiv(ir.Constant(f32, 1.0), total.get())

            def mix(off, widths):
                o = 0
                for wd in widths:
                    at = k.mul(k.add(off, o), 4)
                    acc = k.var(_typ(wd), _zeros(wd))
                    with k.loop(0, n, name="part") as i:
                        src = _partial_row(rows, i, r)
                        w = vmath.libm(isa, "exp", b.fsub(k.load(f32, src), top.get()))
                        acc.set(isa.fma(_splat(k, b.fmul(w, inv), wd), k.load(_typ(wd), k.addr(src, 8), at), acc.get()))
                    k.store(acc.get(), out, at)
                    o += wd
            _chunked(k, attn.Dv, lanes, 1, mix, "dv")
    k.finish()
