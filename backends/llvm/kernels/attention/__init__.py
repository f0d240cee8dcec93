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

One module per job: params.py (the parameters, kernel names and arguments), rows.py (what the
kernels share: pointers, rope, the causal window, softcap), store.py (kernel A), grouped.py (B's
vector walk: GQA heads together, online softmax), tiles.py (B for prefill: a lane per query row),
scalar.py (B's generic twin), split.py (how threads share B's work; kernel C). kv_rows.py reads
and writes the caches' rows.
"""
from __future__ import annotations

from llvmlite import ir

from ggraph.backends.llvm.kernels.attention.grouped import attention_grouped
from ggraph.backends.llvm.kernels.attention.params import (BLOCK, Attention, Rope, from_rope_attention,
                                                           kernel_arg_names, kernel_names, partial_bytes)
from ggraph.backends.llvm.kernels.attention.rows import Rows, open_kernel
from ggraph.backends.llvm.kernels.attention.scalar import attention_rows
from ggraph.backends.llvm.kernels.attention.split import balanced_share, emit_combine, n_parts, splitting
from ggraph.backends.llvm.kernels.attention.store import emit_store
from ggraph.backends.llvm.kernels.attention.tiles import attention_tiles, tiles_fit
from ggraph.backends.llvm.kernels.builder import Kernel, i64
from ggraph.backends.llvm.kernels.isa import PORTABLE_LANES, vector_path
from ggraph.backends.llvm.target import Target


def variant(target: Target) -> str:
    """How the attention kernels run on `target` (for `ggraph target`)."""
    if not vector_path(target):
        return f"scalar (generic twin): one query row and one key at a time, libm, {PORTABLE_LANES}-lane scores"
    return (f"{target.vector_bits // 32} f32 lanes: GQA heads together, blocks of {BLOCK} keys, "
            f"online softmax, in-kernel rope; steps of several tokens in tiles with a lane per query row")


def attention_unit(module: ir.Module, target: Target, attn: Attention, rope: Rope | None) -> tuple[str, ...]:
    """Emit the three kernels into `module`; their names (the llvm backend's kernel-unit form)."""
    return tuple(fn.name for fn, _ in attention_kernels(module, target, attn, rope))


def attention_kernels(module: ir.Module, target: Target, attn: Attention,
                      rope: Rope | None) -> list[tuple[ir.Function, tuple[str, ...]]]:
    """Emit (once) kernels A, B and C; each with the names of its arguments before (ith, nth)."""
    if rope is not None and rope.dims > attn.D:
        raise ValueError(f"rope: rotary dims {rope.dims} exceed the head dim {attn.D}")
    names, args = kernel_names(attn, rope, target), kernel_arg_names(rope, attn)
    for emit, name, arg in zip((emit_store, _emit_attention, emit_combine), names, args):
        if not Kernel.exists(module, name):
            emit(module, target, attn, rope, name, arg)
    return [(module.globals[name], arg) for name, arg in zip(names, args)]


def _emit_attention(module, target: Target, attn: Attention, rope: Rope | None, name: str, args) -> None:
    """Kernel B: a split step's key ranges, or this thread's rows (in tiles for prefill where they fit)."""
    k = open_kernel(module, name, args)
    rows = Rows(k, target, attn, rope, name)
    walk = attention_grouped if rows.vector else attention_rows
    b = k.b
    with b.if_else(splitting(rows)) as (split, whole):
        with split:                                     # every row, this thread's range of keys
            part = b.sext(k.arg["ith"], i64)
            with k.if_then(b.icmp_signed("<", part, n_parts(rows))):
                walk(rows, (k.i64(0), b.mul(k.arg["T"], k.i64(attn.H))), part)
        with whole:                                     # this thread's rows, all their keys
            if rows.vector and tiles_fit(attn, rows.lanes):
                with b.if_else(b.icmp_signed(">", k.arg["T"], k.i64(1))) as (many, one):
                    with many:
                        attention_tiles(rows)
                    with one:
                        walk(rows, balanced_share(rows), None)
            else:
                walk(rows, balanced_share(rows), None)
    k.finish()


__all__ = ["Attention", "Rope", "attention_kernels", "attention_unit", "from_rope_attention", "kernel_arg_names",
           "kernel_names", "partial_bytes", "tiles_fit", "variant"]
