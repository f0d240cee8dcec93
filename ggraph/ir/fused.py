"""The fused primitives the fusion passes produce, each registered with all its rules (see primitive.py).

- ``qmatmul x w``: x f32[..., K] times a stored weight w [N, K] of any GGUF type -> f32[..., N].
  It stands for a kernel that reads the quantised blocks; the numpy rule dequantises once per
  weight buffer and caches the f32 copy.
- ``qmatmul_experts x w ids``: x f32[T, K] times each token's chosen experts of a stored
  w [E, N, K] (ids i32[T, k]) -> f32[T, k, N], ``out[t, j] = x[t] @ w[ids[t, j]].T``; it reads only
  the chosen experts' blocks (``ops.expert_linear`` fuses into it).
- ``rope_attention q k v k_cache v_cache pos positions [freq_factors] [sinks]``: rope on q and k,
  the KV-cache write at row ``pos``, causal (and window, chunk, mask_mod) softmax of
  score_mod(softcap(q·kᵀ·scale)) with GQA and sink logits, times v -> (out, k_cache, v_cache).
  The caches are donated, as in cache_update.
  Its params are the rope's (``scale`` renamed ``rope_scale``) and the attention's. With
  ``slot_rows=C`` the caches hold a batch of sequences, C rows each, and ``pos`` is i32[T], each
  token's sequence: token t is at position positions[t] of sequence pos[t] (a sequence's tokens
  in a step at consecutive positions), as one step of that sequence alone would be.
- ``fused{ops} xs``: one loop over rows running a flat ``body`` of elementwise ops and
  last-axis reductions, with one or more outputs. A kernel must finish reading row r of every
  input before it writes row r of any output: plan_memory relies on that for in-place outputs.
"""
from __future__ import annotations

import weakref

import numpy as np

from ggraph.ir import composites, dtypes
from ggraph.ir.dtypes import Aval, f32, i32
from ggraph.ir.graph import evaluate
from ggraph.ir.primitive import ShapeError, fusable, register
from ggraph.ir.prims import KV_CACHE_TYPES, Blocks, io_bytes, matmul_cost

WEIGHT_TYPES = frozenset(dtypes.QUANTIZED) | {dtypes.f16, dtypes.bf16, dtypes.f32}


# ---------------------------------------------------------------------------------------
# qmatmul
# ---------------------------------------------------------------------------------------

def _qmatmul_shape(x, w):
    if x.dtype is not f32 or x.ndim < 1:
        raise ShapeError(f"qmatmul: activations must be f32[..., K], got {x}")
    if w.ndim != 2:
        raise ShapeError(f"qmatmul: the weight must be 2-D [N, K], got {w}")
    if w.dtype not in WEIGHT_TYPES:
        raise ShapeError(f"qmatmul: weight type {w.dtype} is not a stored weight type")
    if x.shape[-1] != w.shape[1]:
        raise ShapeError(f"qmatmul: contracted dims differ: {x} · {w}ᵀ (K={x.shape[-1]} vs {w.shape[1]})")
    w.check_blocks()
    return Aval(x.shape[:-1] + (w.shape[0],), f32)


_F32_WEIGHTS: dict[tuple, np.ndarray] = {}     # (id of the weight's buffer, dtype, shape) -> f32 [N, K]


def f32_weight(w) -> np.ndarray:
    """The weight as f32 [N, K], dequantised once per weight buffer; the copy is dropped with the buffer."""
    if isinstance(w, np.ndarray) and w.dtype == np.float32:
        return w
    buf = w.data if isinstance(w, Blocks) else w
    key = (id(buf), str(getattr(w, "dtype", "")), tuple(w.shape))
    hit = _F32_WEIGHTS.get(key)
    if hit is None:
        hit = w.dequantize() if isinstance(w, Blocks) else np.asarray(w, np.float32)
        _F32_WEIGHTS[key] = hit
        weakref.finalize(buf, _F32_WEIGHTS.pop, key, None)
    return hit


def _qmatmul_impl(x, w):
    return np.matmul(x, f32_weight(w).T)                                          # (..., N)


qmatmul_p = register("qmatmul", shape=_qmatmul_shape, impl=_qmatmul_impl, cost=matmul_cost, kind="matmul")


# ---------------------------------------------------------------------------------------
# qmatmul_experts (and the rules ops.expert_linear shares)
# ---------------------------------------------------------------------------------------

def expert_linear_shape(op: str, x, w, ids) -> Aval:
    """f32[T, k, N] for x f32[T, K], w [E, N, K] of a weight type, ids i32[T, k]."""
    if x.dtype is not f32 or x.ndim != 2:
        raise ShapeError(f"{op}: activations must be f32[T, K], got {x}")
    if w.ndim != 3 or w.dtype not in WEIGHT_TYPES:
        raise ShapeError(f"{op}: the experts must be a stored weight [E, N, K], got {w}")
    if ids.dtype is not i32 or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ShapeError(f"{op}: ids must be i32[{x.shape[0]}, k], each token's experts, got {ids}")
    if x.shape[1] != w.shape[2]:
        raise ShapeError(f"{op}: contracted dims differ: {x} · {w}ᵀ (K={x.shape[1]} vs {w.shape[2]})")
    if not all(isinstance(d, int) for d in w.shape) or not isinstance(ids.shape[1], int):
        raise ShapeError(f"{op}: the experts {w} and the experts per token of {ids} must be static")
    w.check_blocks()
    return Aval((x.shape[0], ids.shape[1], w.shape[1]), f32)


def expert_linear_impl(x, w, ids):
    """out[t, j] = x[t] @ w[ids[t, j]].T, dequantising only the chosen experts (once each)."""
    E = w.shape[0]
    bad = (ids < 0) | (ids >= E)
    if bad.any():
        raise IndexError(f"expert_linear: expert id {int(ids[bad].reshape(-1)[0])} is out of range for {E} "
                         f"experts")
    chosen, which = np.unique(ids, return_inverse=True)
    which = which.reshape(ids.shape)
    if isinstance(w, Blocks):                          # the chosen experts' rows of blocks, then dequantised
        per_expert = w.data.reshape(E, -1)
        mats = Blocks(per_expert[chosen].reshape(-1, w.data.shape[1]), w.dtype,
                      (len(chosen),) + tuple(w.shape[1:])).dequantize()
    else:
        mats = np.asarray(w)[chosen].astype(np.float32, copy=False)
    out = np.zeros(ids.shape + (w.shape[1],), np.float32)
    for i in range(len(chosen)):
        t, j = np.nonzero(which == i)
        out[t, j] = np.matmul(x[t], mats[i].T)                                  # (rows, N)
    return out


def expert_linear_cost(eqn, dims):
    """2·K flops per output element; bytes: x, ids, the output, and the chosen experts only: at most
    min(E, T·k) distinct experts per step."""
    x, w, ids = (a.aval for a in eqn.inputs)
    T, k = ids.concrete(dims)
    E, N, K = w.concrete(dims)
    chosen = w.update(shape=(min(E, T * k), N, K))
    return 2 * T * k * N * K, chosen.nbytes(dims) + x.nbytes(dims) + ids.nbytes(dims) + \
        eqn.outputs[0].aval.nbytes(dims)


qmatmul_experts_p = register("qmatmul_experts", impl=expert_linear_impl, cost=expert_linear_cost, kind="matmul",
                             shape=lambda x, w, ids: expert_linear_shape("qmatmul_experts", x, w, ids),
                             doc="out[t, j] = x[t] @ w[ids[t, j]].T on the stored blocks of the chosen experts")


# ---------------------------------------------------------------------------------------
# rope_attention
# ---------------------------------------------------------------------------------------

def _extras(extra: tuple, sinks) -> tuple:
    """rope_attention's optional trailing operands: (freq_factors or None, sinks or None)."""
    sink = extra[-1] if sinks else None
    rest = extra[:-1] if sinks else extra
    return (rest[0] if rest else None), sink


def _rope_attention_shape(q, k, v, k_cache, v_cache, pos, positions, *extra, dims, base, rope_scale, style, scale,
                          mscale=1.0, window=None, softcap=None, chunk=None, score_mod=None, mask_mod=None,
                          sinks=None, slot_rows=None):
    freq_factors, sink = _extras(extra, sinks)
    for name, a in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if a.ndim != 3 or (a.dtype is not f32 and (name[2:] != "cache" or a.dtype.name not in KV_CACHE_TYPES)):
            kinds = f"one of {', '.join(KV_CACHE_TYPES)}" if name[2:] == "cache" else "f32"
            raise ShapeError(f"rope_attention: {name} must be [rows, heads, dim] of {kinds}, got {a}")
        a.check_blocks()
    T, H, D = q.shape
    Hkv = k.shape[1]
    if k.shape != (T, Hkv, D) or v.shape[:2] != (T, Hkv):
        raise ShapeError(f"rope_attention: q {q}, k {k}, v {v} disagree on tokens, kv heads or head dim")
    if isinstance(H, int) and isinstance(Hkv, int) and H % Hkv:
        raise ShapeError(f"rope_attention: {H} query heads are not a multiple of {Hkv} kv heads")
    if k_cache.shape[1:] != k.shape[1:] or v_cache.shape[1:] != v.shape[1:]:
        raise ShapeError(f"rope_attention: caches {k_cache}, {v_cache} do not hold rows of k {k}, v {v}")
    if slot_rows is not None:
        if pos.dtype is not i32 or pos.shape != (T,):
            raise ShapeError(f"rope_attention: with slot_rows, pos is each token's sequence slot, i32[{T}]; got {pos}")
        C = k_cache.shape[0]
        if not isinstance(slot_rows, int) or slot_rows < 1 or (isinstance(C, int) and C % slot_rows):
            raise ShapeError(f"rope_attention: the caches' {C} rows are not whole slots of {slot_rows} rows")
    elif pos.dtype is not i32 or pos.ndim != 0:
        raise ShapeError(f"rope_attention: pos must be a scalar i32, got {pos}")
    if positions.dtype is not i32 or positions.shape != (T,):
        raise ShapeError(f"rope_attention: positions must be i32[{T}], got {positions}")
    if style not in composites.ROPE_STYLES:
        raise ShapeError(f"rope_attention: style must be one of {composites.ROPE_STYLES}, got {style!r}")
    if dims % 2 or not (0 <= dims and (not isinstance(D, int) or dims <= D)):
        raise ShapeError(f"rope_attention: rotary dims {dims} must be even and at most the head dim {D} "
                         f"(0: no rotation)")
    if dims == 0 and freq_factors is not None:
        raise ShapeError("rope_attention: freq_factors with rotary dims 0 (no rotation)")
    if freq_factors is not None and (freq_factors.dtype is not f32 or freq_factors.shape != (dims // 2,)):
        raise ShapeError(f"rope_attention: freq_factors must be f32[{dims // 2}], got {freq_factors}")
    if sinks and (sink is None or sink.dtype is not f32 or sink.shape != (H,)):
        raise ShapeError(f"rope_attention: sinks must be f32[{H}], one logit per query head, got {sink}")
    return Aval((T, H, v.shape[2]), f32), k_cache, v_cache


def _rope_attention_impl(q, k, v, k_cache, v_cache, pos, positions, *extra, dims, base, rope_scale, style, scale,
                         mscale=1.0, slot_rows=None, sinks=None, **attend):
    freq_factors, sink = _extras(extra, sinks)
    rope = dict(dims=dims, base=base, scale=rope_scale, style=style, mscale=mscale)
    qr, kr = q, k                                                                        # dims 0: no rotation
    if dims:
        qr = composites._np_rope(q, positions, freq_factors, **rope)                     # (T, H, D)
        kr = composites._np_rope(k, positions, freq_factors, **rope)                     # (T, Hkv, D)
    attend.update(scale=scale, sinks=sinks)
    sink = () if sink is None else (sink,)
    if slot_rows is None:
        return composites._np_attention(qr, kr, v, k_cache, v_cache, pos, *sink, **attend)
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]), np.float32)
    slots = k_cache.shape[0] // slot_rows
    for s in np.unique(pos):                          # each sequence: its tokens, in order, as one step
        idx = np.nonzero(pos == s)[0]
        p = positions[idx]
        if not 0 <= s < slots or np.any(p != p[0] + np.arange(len(idx))):
            raise ValueError(f"rope_attention: slot {s} (of {slots}) must have consecutive positions, got {p.tolist()}")
        kc, vc = (_slot_rows(c, s, slot_rows) for c in (k_cache, v_cache))
        out[idx] = composites._np_attention(qr[idx], kr[idx], v[idx], kc, vc, int(p[0]), *sink, batch=int(s),
                                            **attend)[0]
    return out, k_cache, v_cache


def _slot_rows(cache, s: int, n: int):
    """Rows s*n..(s+1)*n of a cache, as a view that writes through (arrays, and Blocks by their bytes)."""
    if isinstance(cache, Blocks):
        per = cache.data.shape[0] // cache.shape[0]                 # byte rows per cache row (the heads)
        return Blocks(cache.data[s * n * per:(s + 1) * n * per], cache.dtype, (n,) + tuple(cache.shape[1:]))
    return cache[s * n:(s + 1) * n]


def _rope_attention_cost(eqn, dims):
    q, k, v = (a.aval for a in eqn.inputs[:3])
    T, H, D = q.concrete(dims)
    Hkv, Dv = k.concrete(dims)[1], v.concrete(dims)[2]
    S = T + dims.get("P", 0)                                  # keys: the past rows and this step's
    if eqn.params.get("slot_rows"):                           # a batch: each token sees about half its slot
        S = max(eqn.params["slot_rows"] // 2, 1)
    rot = eqn.params["dims"] // 2
    flops = 6 * T * (H + Hkv) * rot                           # rotate pairs
    flops += 2 * H * T * S * (D + Dv) + 5 * H * T * S         # q·kᵀ, p·v and the softmax
    flops += 10 * H * T * S if eqn.params.get("softcap") else 0
    for mod in (eqn.params.get("score_mod"), eqn.params.get("mask_mod")):     # each op once per (query, key)
        flops += H * T * S * sum(e.cost({})[0] for e in mod.graph.eqns) if mod is not None else 0
    kc, vc = eqn.inputs[3].aval.dtype, eqn.inputs[4].aval.dtype
    row = Hkv * (kc.row_bytes(D) + vc.row_bytes(Dv))          # bytes of one k row plus one v row in the caches
    moved = sum(a.aval.nbytes(dims) for a in eqn.inputs[:3] + eqn.inputs[6:]) + eqn.outputs[0].aval.nbytes(dims)
    return flops, moved + S * row + T * row                   # cache rows read, new rows written


def rope_attention_slots(q, k, v, k_cache, v_cache, seq, positions, freq_factors=None, *, slot_rows: int,
                         dims: int, base: float, rope_scale: float = 1.0, style: str = "neox", mscale: float = 1.0,
                         scale: float, window: int | None = None, softcap: float | None = None, score_mod=None,
                         mask_mod=None, sinks=None):
    """Rope and attention for a batch of sequences over slotted caches (``slot_rows`` rows per
    sequence): token t is at ``positions[t]`` of sequence ``seq[t]`` (a mod's b). Born fused: a
    batch has no unfused form (it would need a scatter into the caches); its numpy rule is the
    reference. The attention options are ops.attention's."""
    from ggraph.ir.attention_mods import canonical
    from ggraph.ir.trace import bind
    params = dict(dims=int(dims), base=float(base), rope_scale=float(rope_scale), style=style, scale=float(scale))
    params.update(canonical(score_mod, mask_mod, window=window, softcap=softcap), slot_rows=int(slot_rows))
    if mscale != 1.0:
        params["mscale"] = float(mscale)
    extra = () if freq_factors is None else (freq_factors,)
    if sinks is not None:
        params["sinks"], extra = True, extra + (sinks,)
    params = {k_: v_ for k_, v_ in params.items() if v_ is not None}
    return bind(rope_attention_p, q, k, v, k_cache, v_cache, seq, positions, *extra, **params)


rope_attention_p = register("rope_attention", shape=_rope_attention_shape, impl=_rope_attention_impl,
                            cost=_rope_attention_cost, kind="fused", multiple_results=True, effects=True,
                            aliases={1: 3, 2: 4})


# ---------------------------------------------------------------------------------------
# fused: a body of elementwise ops and last-axis reductions, one loop over rows
# ---------------------------------------------------------------------------------------

def _fused_shape(*in_avals, body, ops):
    for e in body.eqns:
        if not fusable(e):
            raise ShapeError(f"fused: body op {e.prim.name} is not elementwise or a last-axis reduction")
    expected = [v.aval for v in body.invars]
    if len(in_avals) != len(expected) or not all(Aval.__eq__(a, b) for a, b in zip(in_avals, expected)):
        raise ShapeError(f"operands {', '.join(map(str, in_avals))} do not match the body's inputs "
                         f"{', '.join(map(str, expected))}")
    if not body.outvars:
        raise ShapeError("fused: the body has no outputs")
    return tuple(o.aval for o in body.outvars)


def _fused_impl(*xs, body=None, ops=()):
    if body is None:
        raise TypeError("fused: the numpy rule needs the eqn's body (the interpreter passes body=eqn.body)")
    return tuple(evaluate(body, xs, lambda e, vals: e.prim.impl(*vals, **e.params)))


def _fused_cost(eqn, dims):
    return sum(e.cost(dims)[0] for e in eqn.body.eqns), io_bytes(eqn, dims)      # one pass over memory


fused_p = register("fused", shape=_fused_shape, impl=_fused_impl, cost=_fused_cost, kind="fused",
                   multiple_results=True)
