"""The attention kernels' static parameters, as the ops take them (Rope, Attention), their names,
arguments and scratch, and the constants kernels A, B and C share."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ggraph.backends.llvm.kernels.kv_rows import check_cache_type
from ggraph.backends.llvm.target import Target
from ggraph.ir.attention_mods import Mod
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
    chunk: int | None = None     # keys of the query's own chunk of positions only (Llama 4's chunked attention)
    score_mod: Mod | None = None  # traced score and mask functions, emitted inline (ggraph.ir.attention_mods)
    mask_mod: Mod | None = None
    sinks: bool = False          # kernels B and C take sinks f32[H]: one more logit in each head's softmax

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
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"attention: chunk {self.chunk} must be at least 1")
        for name, kind in (("score_mod", "score_mod"), ("mask_mod", "mask_mod")):
            mod = getattr(self, name)
            if mod is not None and (not isinstance(mod, Mod) or mod.kind != kind):
                raise ValueError(f"attention: {name} must be a traced {kind} (attention_mods.trace_mod), got {mod!r}")
        if self.slot_rows is not None and self.slot_rows < 1:
            raise ValueError(f"attention: slot_rows {self.slot_rows} must be at least 1")


def from_rope_attention(eqn) -> tuple[Attention, Rope | None]:
    """The kernels' static parameters for a `rope_attention` eqn (inputs q k v k_cache v_cache
    pos positions [freq_factors]); shapes other than T must be static. Rotary dims 0: no Rope."""
    q, k, v = (a.aval for a in eqn.inputs[:3])
    (_, H, D), Hkv, Dv = q.shape, k.shape[1], v.shape[2]
    for name, d in (("H", H), ("D", D), ("Hkv", Hkv), ("Dv", Dv)):
        if not isinstance(d, int):
            raise ValueError(f"rope_attention: {name} = {d} must be static for the llvm kernels")
    p = eqn.params
    kt, vt = (a.aval.dtype.name for a in eqn.inputs[3:5])
    attn = Attention(H, Hkv, D, Dv, float(p["scale"]), p.get("window"), p.get("softcap"), kt, vt, p.get("slot_rows"),
                     p.get("chunk"), p.get("score_mod"), p.get("mask_mod"), bool(p.get("sinks")))
    if not p["dims"]:
        return attn, None
    rope = Rope(int(p["dims"]), float(p["base"]), float(p["rope_scale"]), p["style"], float(p.get("mscale", 1.0)),
                freq_factors=len(eqn.inputs) - attn.sinks > 7)
    return attn, rope


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
    sinks = ("sinks",) if attn is not None and attn.sinks else ()
    return (("k", "v", "k_cache", "v_cache", "positions") + seq + ff + ("T", "P"),
            ("q", "k_cache", "v_cache", "positions") + seq + ff + sinks + ("partial", "out", "T", "P"),
            sinks + ("partial", "out", "T", "P"))


def partial_bytes(attn: Attention) -> int:
    """Scratch for split-key partial results: SPLIT_MAX ranges x SPLIT_T*H rows x (max, sum, Dv sums)."""
    return 4 * SPLIT_MAX * SPLIT_T * attn.H * (attn.Dv + 2)
