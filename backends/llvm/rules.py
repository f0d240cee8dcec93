"""LLVM lowering rules, one per primitive that needs more than the op table says, in LOWERINGS,
and ``lower_eqn``, which picks the rule for an eqn.

A rule looks up where its operands live, gets or aliases memory for its outputs, asks for
its kernels by signature (``lw.kernel``) and appends calls. Views (reshape, leading-axis
slices) emit no call. Elementwise ops, reductions and elementwise composites need no
rule: ``lower_fused`` runs each as one fused loop from the emitters of the op table, and
any other composite lowers as its body (``lower_body``).
"""
from __future__ import annotations

from ggraph.ir import prims as P
from ggraph.ir.dims import Sym, product
from ggraph.ir.dtypes import DimAval, i8
from ggraph.ir.composites import rope_angles_p
from ggraph.ir.fused import qmatmul_experts_p, qmatmul_p, rope_attention_p
from ggraph.ir.recurrent import fused_causal_conv_p, fused_ssm_scan_p
from ggraph.ir.delta_rule import fused_gated_delta_rule_p
from ggraph.ir.graph import Eqn, Graph, Literal, Var
from ggraph.ir.primitive import fusable
from ggraph.ir.scan import scan_p
from ggraph.backends.llvm import kernels as K
from ggraph.backends.llvm.kernels import attention as A
from ggraph.backends.llvm.kernels import copies as C
from ggraph.backends.llvm.kernels import delta_rule as DR
from ggraph.backends.llvm.kernels import elementwise as E
from ggraph.backends.llvm.kernels import plain_ops as G
from ggraph.backends.llvm.kernels import recurrent as RC
from ggraph.backends.llvm.kernels import routing as R
from ggraph.backends.llvm.kernels.plan import experts_plan
from ggraph.backends.llvm.kernels.qmatmul.by_expert import expert_pack, lanes as expert_lanes
from ggraph.backends.llvm.kernels.qmatmul.experts import qmatmul_experts
from ggraph.backends.llvm.lowering import LOWERINGS, ActBytes, AvalBytes, FixedBytes, Lowering, LoweringError, lowering, rows, symbol_args


@lowering(P.reshape_p)
def _reshape(lw, e):
    lw.alias(e.outputs[0], lw.ref(e.inputs[0]))            # row-major data: a reshape is a view


@lowering(P.slice_p)
def _slice(lw, e):
    x, out = e.inputs[0], e.outputs[0]
    if not P.leading_slice(e):
        return _lower_copy(lw, e)
    axis = e.params["axis"] % x.aval.ndim
    lw.alias(out, lw.ref(x).plus(e.params["start"] * stride_bytes(x.aval, axis)))


def stride_bytes(aval, axis: int):
    """Bytes from one index of ``axis`` to the next in a row-major ``aval``; a block type's last axis is
    whole rows of blocks, so the dims after ``axis`` count as rows of blocks, not elements."""
    inner = aval.shape[axis + 1:]
    if aval.dtype.is_quantized:
        return aval.dtype.nbytes(inner)
    return product(inner) * aval.dtype.type_size


def block_bytes(aval):
    """A block-typed aval seen as its bytes: i8[..., row bytes], for the kernels that only move data."""
    return aval.update(shape=aval.shape[:-1] + (aval.dtype.row_bytes(aval.shape[-1]),), dtype=i8)


@lowering(P.take_p)
def _take(lw, e):
    """The gather kernel over entries of D values (a row, or the matrix of a [E, N, K] table: the rows of an
    entry lie one after another, blocks included); an id outside the table sets a status slot that the run
    turns into an error."""
    table, ids = e.inputs
    V, D = table.aval.shape[0], product(table.aval.shape[1:])
    if not isinstance(D, int):
        raise LoweringError(f"llvm backend: take at {e.scope or 'top'}: the table's entries need a static "
                            f"shape, got {table.aval}")
    out = lw.output(e.outputs[0])
    status = lw.status(f"take at {e.scope or 'top'}: id {{id}} is out of range for a table of {V} rows "
                       f"({table.aval})")
    if isinstance(V, int):
        name = lw.kernel(K.get_rows, table.aval.dtype, D, V, lw.target)
        lw.call(name, lw.ref(table), lw.ref(ids), out, status, product(ids.aval.shape), writes=(out, status))
    else:                                                  # rows of this step's activations (T of them)
        name = lw.kernel(K.get_rows, table.aval.dtype, D, None, lw.target)
        lw.call(name, lw.ref(table), lw.ref(ids), out, status, V, product(ids.aval.shape), writes=(out, status))


@lowering(qmatmul_p)
def _qmatmul(lw, e):
    """Float weights: one fmatmul. Block weights: quantise x once per format, then qmatmul."""
    x, w = e.inputs
    N, Kdim = w.aval.shape
    R = rows(x.aval)
    out = lw.output(e.outputs[0])
    dt = w.aval.dtype
    if K.float_weight(dt):
        lw.call(lw.kernel(K.fmatmul, dt, Kdim, N, lw.target, lw.rows_only), lw.ref(w), lw.ref(x), out, lw.counter(), R,
                writes=(out,))
        return
    fmt = K.act_format(dt)
    xq = lw.memo(("act_quant", x, fmt))
    if xq is None:
        xq = lw.scratch(ActBytes(fmt, R, Kdim, lw.rows_only), f"xq_{fmt}")
        lw.call(lw.kernel(K.act_quant, fmt, Kdim, lw.target, lw.rows_only), lw.ref(x), xq, R, writes=(xq,))
        lw.memo(("act_quant", x, fmt), xq)
    def qmatmul(layout=None):
        return lw.kernel(K.qmatmul, dt, Kdim, N, lw.target, lw.rows_only, layout)
    # the plan's preferred layout (rows16: 16 rows interleaved), where every call that reads the weights takes it
    best = K.layouts(dt, N, lw.target)[0]
    name = qmatmul() if best is K.Layout.FILE else \
        lw.weight_layout(lw.ref(w), w.aval, best, lambda: qmatmul(best), qmatmul)
    lw.call(name, lw.ref(w), xq, out, lw.counter(), R, writes=(out,))


@lowering(qmatmul_experts_p)
def _qmatmul_experts(lw, e):
    """Block experts: quantise x once, one row per token (act_quant's rows_only layout); where the plan groups
    prefill steps by expert, a pack kernel sorts the pairs by expert and packs each expert's tokens for its
    gemm; then one kernel (decode: each (token, expert) the decode row dot on that expert's rows in the file).
    Float experts take x as it is. An id outside [0, E) sets a status slot that the run turns into an error."""
    x, w, ids = e.inputs
    E, N, Kdim = w.aval.shape
    T, k = ids.aval.shape
    dt = w.aval.dtype
    out = lw.output(e.outputs[0])
    status = lw.status(f"expert_linear ({e.prim.name} at {e.scope or 'top'}): expert id {{id}} is out of range "
                       f"for {E} experts ({w.aval})")
    kernel = lw.kernel(qmatmul_experts, dt, Kdim, N, E, k, lw.target, lw.rows_only)
    if K.float_weight(dt):
        lw.call(kernel, lw.ref(w), lw.ref(x), lw.ref(ids), out, status, T, writes=(out, status))
        return
    fmt = K.act_format(dt)
    key = ("act_quant", x, fmt) if lw.rows_only else ("act_quant_rows", x, fmt)
    xin = lw.memo(key)
    if xin is None:
        xin = lw.scratch(ActBytes(fmt, T, Kdim, True), f"xq_{fmt}_rows")
        lw.call(lw.kernel(K.act_quant, fmt, Kdim, lw.target, True), lw.ref(x), xin, T, writes=(xin,))
        lw.memo(key, xin)
    plan = experts_plan(dt, N, lw.target, lw.rows_only)
    if plan.grouped is None:
        lw.call(kernel, lw.ref(w), xin, lw.ref(ids), out, status, T, writes=(out, status))
        return
    L = expert_lanes(plan.grouped)
    order = lw.scratch(AvalBytes(ids.aval), "expert_order")
    xg = lw.scratch(ActBytes(fmt, T * k + L * E, Kdim), f"xq_{fmt}_by_expert")
    ys = lw.scratch(AvalBytes(e.outputs[0].aval), "y_by_expert")
    lw.call(lw.kernel(expert_pack, fmt, Kdim, N, E, k, L, plan.group_from, lw.target), xin, lw.ref(ids), order, xg,
            out, status, T, writes=(order, xg, out, status))
    lw.call(kernel, lw.ref(w), xin, lw.ref(ids), out, status, order, xg, ys, lw.counter(), T,
            writes=(out, status, ys))


def lower_eqn(lw: Lowering, e: Eqn) -> None:
    """Lower one eqn by its primitive's rule, or by what the op table says of a primitive without one."""
    lw.current = lw.current or e
    rule = LOWERINGS.get(e.prim)
    if rule is not None:
        return rule(lw, e)
    if fusable(e):
        return lower_fused(lw, e)
    if e.prim.composite:
        return lower_body(lw, e)
    raise LoweringError(f"llvm backend: no lowering for op {e.prim.name!r} (at {e.scope or 'top'}): it is not "
                        f"elementwise, a reduction or a composite, and has no rule; lowered ops: "
                        f"{', '.join(sorted(p.name for p in LOWERINGS))} and any elementwise op with an emitter")


# -- fused loops: elementwise ops, reductions, fused eqns and elementwise composites ----------

def _one_op_body(e: Eqn) -> tuple[Graph, list]:
    """A lone elementwise op or reduction as a body: its variable operands in, scalar constants inline."""
    ins = [Var(a.aval) for a in e.inputs if not _inline_constant(a)]
    it = iter(ins)
    operands = [a if _inline_constant(a) else next(it) for a in e.inputs]
    outs = [Var(o.aval) for o in e.outputs]
    return Graph(ins, (), [Eqn(e.prim, operands, outs, e.params, e.scope)], outs, name=e.prim.name), \
        [a for a in e.inputs if not _inline_constant(a)]


def _inline_constant(a) -> bool:
    return isinstance(a, Literal) and a.value.size == 1


def lower_fused(lw, e: Eqn) -> None:
    """One fused loop kernel for ``e`` (its body, or the op alone)."""
    body, operands = (e.body, list(e.inputs)) if e.body is not None else _one_op_body(e)
    in_avals = [a.aval for a in operands]
    out_avals = [o.aval for o in e.outputs]
    try:
        name = lw.kernel(E.emit_fused, lw.target, body, in_avals, out_avals)
    except ValueError as err:
        raise LoweringError(f"llvm backend: {e.prim.name} at {e.scope or 'top'}: {err}") from None
    outs = [lw.output(o) for o in e.outputs]
    lw.call(name, *[lw.ref(a) for a in operands], *outs, *[Sym(s) for s in E.fused_symbols(body)], writes=outs)


def lower_body(lw, e: Eqn) -> None:
    """A composite with no kernel of its own: lower its body's eqns in its place."""
    for bv, a in zip(e.body.invars, e.inputs):
        lw.alias(bv, lw.ref(a))
    for b in e.body.eqns:
        lower_eqn(lw, b)
    for o, bo in zip(e.outputs, e.body.outvars):
        lw.alias(o, lw.ref(bo))


# -- data movement ----------------------------------------------------------------------------

def _lower_copy(lw, e):
    """Ops that move data into a new layout: one copy kernel each."""
    x, y = e.inputs[0].aval, e.outputs[0].aval
    p = e.params
    if x.dtype.is_quantized:                   # whole rows of blocks move as bytes
        x, y = block_bytes(x), block_bytes(y)
    if e.prim is P.transpose_p:
        name, avals = lw.kernel(C.emit_transpose, lw.target, x, p["perm"]), (x,)
    elif e.prim is P.slice_p:
        name, avals = lw.kernel(C.emit_slice, lw.target, x, p["axis"], p["start"], p["stop"]), (x, y)
    else:
        name, avals = lw.kernel(C.emit_broadcast, lw.target, x, p["shape"]), (x, y)
    out = lw.output(e.outputs[0])
    lw.call(name, lw.ref(e.inputs[0]), out, *symbol_args(*avals), writes=(out,))


lowering(P.transpose_p, P.broadcast_p)(_lower_copy)


@lowering(P.concat_p)
def _concat(lw, e):
    avals = [a.aval for a in e.inputs]
    name = lw.kernel(C.emit_concat, lw.target, avals, e.params["axis"])
    out = lw.output(e.outputs[0])
    lw.call(name, *[lw.ref(a) for a in e.inputs], out, *symbol_args(*avals, e.outputs[0].aval), writes=(out,))


@lowering(P.cache_update_p)
def _cache_update(lw, e):
    """Write the new rows into the cache at row P, in place: the output is the cache."""
    cache, x, pos = e.inputs
    if not isinstance(pos, Var) or not isinstance(pos.aval, DimAval):
        raise LoweringError("llvm backend: cache_update needs the position to be a dim input such as P")
    row_bytes = product(cache.aval.shape[1:]) * cache.aval.dtype.type_size
    lw.bound(Sym(pos.aval.symbol) + x.aval.shape[0], cache.aval.shape[0],
             f"cache_update at {e.scope or 'top'}: the cache has {cache.aval.shape[0]} rows")
    dst = lw.ref(cache)
    at = dst.plus(Sym(pos.aval.symbol) * row_bytes)
    if cache.aval.dtype is x.aval.dtype:
        lw.call(lw.kernel(G.copy_bytes), lw.ref(x), at, x.aval.shape[0] * row_bytes, writes=(at,))
    else:                                                   # f32 rows into an f16, bf16, q8_0 or q4_0 cache
        n = cache.aval.shape[-1]
        lw.call(lw.kernel(K.kv_store, cache.aval.dtype, n, lw.target), lw.ref(x), at, rows(x.aval), writes=(at,))
    lw.alias(e.outputs[0], dst)


@lowering(P.state_write_p)
def _state_write(lw, e):
    """Copy the step's new recurrent state over the state input, in place: the output is the state."""
    state, value = e.inputs
    dst, src = lw.ref(state), lw.ref(value)
    if src != dst:                                          # a state the step left as it was needs no copy
        lw.call(lw.kernel(G.copy_bytes), src, dst, product(state.aval.shape) * state.aval.dtype.type_size,
                writes=(dst,))
    lw.alias(e.outputs[0], dst)


@lowering(P.iota_p)
def _iota(lw, e):
    out = lw.output(e.outputs[0])
    lw.call(lw.kernel(G.iota, e.params.get("dtype", "i32")), out, e.params["n"], writes=(out,))


@lowering(rope_angles_p)
def _rope_angles(lw, e):
    out = lw.output(e.outputs[0])
    p = e.params
    name = lw.kernel(G.rope_angles, p["dims"], p["base"], p["scale"], len(e.inputs) > 1)
    lw.call(name, *[lw.ref(a) for a in e.inputs], out, rows(e.outputs[0].aval), writes=(out,))


@lowering(P.dequant_p)
def _dequant(lw, e):
    """The unfused baseline's explicit dequant (a weight, or cache rows read by attention): row by row."""
    w = e.inputs[0]
    out = lw.output(e.outputs[0])
    lw.call(lw.kernel(K.dequant_rows, w.aval.dtype, w.aval.shape[-1], lw.target), lw.ref(w), out, rows(w.aval),
            writes=(out,))


@lowering(P.matmul_p)
def _matmul(lw, e):
    """The unfused baseline's f32 matmul, batched, contracting the last axes."""
    a, b = e.inputs
    M, Kd = a.aval.shape[-2], a.aval.shape[-1]
    N = b.aval.shape[-2]
    batch_shape = e.outputs[0].aval.shape[:-2]
    (ra, a_batch), (rb, b_batch) = (_batched(lw, x, batch_shape) for x in (a, b))
    out = lw.output(e.outputs[0])
    lw.call(lw.kernel(G.matmul_f32), ra, rb, out, product(batch_shape), M, N, Kd, a_batch, b_batch, writes=(out,))


def _batched(lw, x, batch_shape) -> tuple:
    """(where operand ``x`` of a batched matmul is, 1 if it has every matrix of ``batch_shape`` else 0): one
    matrix is read for every batch element as it is; a batch broadcast on some axes only ([T, 1] against
    [T, k]) is copied out to the whole batch first, since the kernel steps through whole batches."""
    own = x.aval.shape[:-2]
    if product(own) == 1:
        return lw.ref(x), 0
    full = (1,) * (len(batch_shape) - len(own)) + tuple(own)
    if full == tuple(batch_shape):
        return lw.ref(x), 1
    whole = x.aval.update(shape=tuple(batch_shape) + x.aval.shape[-2:])
    copy = lw.scratch(AvalBytes(whole), "matmul_broadcast")
    lw.call(lw.kernel(C.emit_broadcast, lw.target, x.aval, whole.shape), lw.ref(x), copy,
            *symbol_args(x.aval, whole), writes=(copy,))
    return copy, 1


# -- attention ----------------------------------------------------------------------------------

@lowering(rope_attention_p)
def _rope_attention(lw, e):
    """Three kernels: rope k and store k, v at rows P.. of the caches; attend (rope q inside); merge
    the partial results when the keys were split across threads. Slotted caches (a batch of
    sequences) take each token's slot instead of P; the caller keeps slots and positions in range."""
    attn, rope = A.from_rope_attention(e)
    q, k, v, kc, vc, pos, positions = e.inputs[:7]
    refs = {"q": lw.ref(q), "k": lw.ref(k), "v": lw.ref(v), "k_cache": lw.ref(kc), "v_cache": lw.ref(vc),
            "positions": lw.ref(positions), "T": q.aval.shape[0]}
    if attn.slot_rows:
        refs["seq"], refs["P"] = lw.ref(pos), 0
        slots = kc.aval.shape[0] // attn.slot_rows
        lw.value_range(pos, 0, slots, f"attention at {e.scope or 'top'}: input {pos.hint or 'seq'} holds sequence "
                                      f"slots, 0..{slots - 1}")
        lw.value_range(positions, 0, attn.slot_rows, f"attention at {e.scope or 'top'}: input "
                                                     f"{positions.hint or 'positions'} holds positions in a slot "
                                                     f"of {attn.slot_rows} rows, 0..{attn.slot_rows - 1}")
    elif not isinstance(pos, Var) or not isinstance(pos.aval, DimAval) or pos.aval.symbol != "P":
        raise LoweringError("llvm backend: rope_attention needs the past length as the dim input P")
    else:
        refs["P"] = Sym("P")
        lw.bound(Sym("P") + q.aval.shape[0], kc.aval.shape[0],
                 f"attention at {e.scope or 'top'}: the KV cache has {kc.aval.shape[0]} rows")
    if rope is not None and rope.freq_factors:
        refs["freq_factors"] = lw.ref(e.inputs[7])
    if attn.sinks:
        refs["sinks"] = lw.ref(e.inputs[-1])
    refs["out"] = lw.output(e.outputs[0])
    size = A.partial_bytes(attn)                        # split-key partials: one scratch for every layer
    refs["partial"] = lw.memo(("attention_partial", size)) or \
        lw.memo(("attention_partial", size), lw.scratch(FixedBytes(size), "attention_partial"))
    store, attend, combine = lw.kernel(A.attention_unit, lw.target, attn, rope)
    store_args, attend_args, combine_args = A.kernel_arg_names(rope, attn)
    lw.call(store, *[refs[a] for a in store_args], writes=(refs["k_cache"], refs["v_cache"]))
    lw.call(attend, *[refs[a] for a in attend_args], writes=(refs["out"], refs["partial"]))
    lw.call(combine, *[refs[a] for a in combine_args], writes=(refs["out"],))
    lw.alias(e.outputs[1], refs["k_cache"])
    lw.alias(e.outputs[2], refs["v_cache"])


# -- recurrent layers: causal_conv, ssm_scan ------------------------------------------------------

@lowering(fused_causal_conv_p)
def _causal_conv(lw, e):
    """One kernel: y and new_state in one pass over the tokens, channels split across threads."""
    x, state, w = e.inputs[:3]
    C, K = w.aval.shape
    overwrite = e.params.get("overwrite", False)
    y, new_state = lw.output(e.outputs[0]), _new_state(lw, e, state)
    name = lw.kernel(RC.causal_conv, C, K, len(e.inputs) > 3, lw.target, overwrite)
    lw.call(name, *[lw.ref(a) for a in e.inputs], y, new_state, x.aval.shape[0], writes=(y, new_state))


@lowering(fused_ssm_scan_p)
def _ssm_scan(lw, e):
    """Two kernels: each token's softplus and decay per head, then the scan, (head, rows) split across threads."""
    state, x, dt, A, B, C = e.inputs
    H, D, N = state.aval.shape
    T = x.aval.shape[0]
    decay = lw.scratch(AvalBytes(dt.aval.update(shape=(T, H, 2))), "ssm_decay")
    lw.call(lw.kernel(RC.ssm_decay, H, lw.target), lw.ref(dt), lw.ref(A), decay, T, writes=(decay,))
    y, new_state = lw.output(e.outputs[0]), _new_state(lw, e, state)
    name = lw.kernel(RC.ssm_scan, H, D, N, B.aval.shape[1], lw.target, e.params.get("overwrite", False))
    lw.call(name, lw.ref(state), lw.ref(x), decay, lw.ref(B), lw.ref(C), y, new_state, T, writes=(y, new_state))


def _new_state(lw, e, state):
    """Where a recurrent kernel writes its new state: over the state operand when the op says so."""
    if not e.params.get("overwrite"):
        return lw.output(e.outputs[1])
    lw.alias(e.outputs[1], lw.ref(state))
    return lw.ref(state)


@lowering(fused_gated_delta_rule_p)
def _gated_delta_rule(lw, e):
    """Two kernels: each token's decay per head, then the rule, (value head, rows) units across threads (a
    unit reads its rows of the state before it writes them, so the new state may be the state's storage)."""
    q, k, v, g, beta, state = e.inputs
    Hv, Dv, Dk = state.aval.shape
    T = v.aval.shape[0]
    decay = lw.scratch(AvalBytes(g.aval), "delta_decay")
    lw.call(lw.kernel(DR.delta_decay, Hv, lw.target), lw.ref(g), decay, T, writes=(decay,))
    y, new_state = lw.output(e.outputs[0]), _new_state(lw, e, state)
    name = lw.kernel(DR.gated_delta_rule, q.aval.shape[1], Hv, Dk, Dv, e.params["scale"], lw.target)
    lw.call(name, lw.ref(q), lw.ref(k), lw.ref(v), decay, lw.ref(beta), lw.ref(state), y, new_state, T,
            writes=(y, new_state))


# -- routing: top_k, argmax, take_along_axis, segment_sum ---------------------------------------

@lowering(P.top_k_p)
def _top_k(lw, e):
    x = e.inputs[0]
    values, indices = (lw.output(o) for o in e.outputs)
    lw.call(lw.kernel(R.top_k, e.params["k"], lw.target), lw.ref(x), values, indices, rows(x.aval),
            x.aval.shape[-1], writes=(values, indices))


@lowering(P.argmax_p)
def _argmax(lw, e):
    x = e.inputs[0]
    out = lw.output(e.outputs[0])
    lw.call(lw.kernel(R.argmax, lw.target), lw.ref(x), out, rows(x.aval), x.aval.shape[-1], writes=(out,))


@lowering(P.take_along_axis_p)
def _take_along_axis(lw, e):
    """x as [outer, L, inner] and idx as [outer, J, inner] around the axis; an index outside 0..L-1 sets a
    status slot that the run turns into an error."""
    x, idx = e.inputs
    ax = e.params["axis"] % x.aval.ndim
    L = x.aval.shape[ax]
    out = lw.output(e.outputs[0])
    status = lw.status(f"{e.prim.name} at {e.scope or 'top'}: index {{id}} is out of range for axis {ax} of "
                       f"{x.aval} (length {L})")
    lw.call(lw.kernel(R.take_along_axis, lw.target), lw.ref(x), lw.ref(idx), out, status,
            product(x.aval.shape[:ax]), L, idx.aval.shape[ax], product(x.aval.shape[ax + 1:]),
            writes=(out, status))


@lowering(P.segment_sum_p)
def _segment_sum(lw, e):
    """Threads split the output segments; a segment id outside 0..S-1 sets a status slot."""
    values, ids = e.inputs
    S = e.params["num_segments"]
    out = lw.output(e.outputs[0])
    status = lw.status(f"{e.prim.name} at {e.scope or 'top'}: segment id {{id}} is out of range for {S} "
                       f"segments")
    lw.call(lw.kernel(R.segment_sum, lw.target), lw.ref(values), lw.ref(ids), out, status,
            values.aval.shape[0], S, product(values.aval.shape[1:]), writes=(out, status))


# -- scan: a native loop over the steps ---------------------------------------------------------

def _nbytes(aval):
    """Bytes of a value of ``aval`` as a dim expression."""
    return aval.dtype.nbytes(aval.shape) if aval.dtype.is_quantized else product(aval.shape) * aval.dtype.type_size


def _step_stride(aval, what: str, e: Eqn):
    """Bytes from one step's slice of ``aval`` (scanned along axis 0) to the next: a static count."""
    stride = stride_bytes(aval, 0)
    if not isinstance(stride, int):
        raise LoweringError(f"llvm backend: scan at {e.scope or 'top'}: {what} {aval} has a symbolic step slice "
                            f"({stride} bytes); a step's slice needs a static shape")
    return stride


@lowering(scan_p)
def _scan(lw, e):
    """The body's eqns lowered inside a loop over the steps. Carries live in the final carries' buffers:
    the initial values are copied in, each step reads them, and a new carry is written straight over its
    old value where that is safe (``_carries_in_place``), else copied over it at the step's end (through
    scratch when one carry's new value is another's old buffer). x_t is a view of xs at the step's offset;
    y_t is written in place into ys where its kernel makes it, else copied."""
    p, body = e.params, e.params["body"]
    nc, nk = p["consts"], p["carry"]
    operands = [lw.ref(a) for a in e.inputs]                  # once each: a constant gets one buffer
    consts, init, xs = operands[:nc], operands[nc:nc + nk], operands[nc + nk:]
    carries = [lw.output(o) for o in e.outputs[:nk]]
    ys = [lw.output(o) for o in e.outputs[nk:]]
    copy = lw.kernel(G.copy_bytes)
    for src, dst, o in zip(init, carries, e.outputs):
        if src != dst:
            lw.call(copy, src, dst, _nbytes(o.aval), writes=(dst,))
    x_strides = [_step_stride(a.aval, "xs", e) for a in e.inputs[nc + nk:]]
    y_strides = [_step_stride(o.aval, "ys", e) for o in e.outputs[nk:]]
    with lw.loop(p["length"], p["reverse"]) as t:
        ins = consts + carries + [x.plus(t * s) for x, s in zip(xs, x_strides)]
        for v, r in zip(body.invars, ins):
            lw.alias(v, r)
        y_vars = body.outvars[nk:]
        y_at = [y.plus(t * s) for y, s in zip(ys, y_strides)]
        for v, r in zip(y_vars, y_at):
            if isinstance(v, Var) and v not in body.invars and v not in lw.placed:
                lw.placed[v] = r                             # its kernel writes straight into ys
        for v, k in _carries_in_place(body, nc, nk).items():
            lw.placed[v] = carries[k]
        for b in body.eqns:
            lower_eqn(lw, b)
        for v in body.outvars:
            if isinstance(v, Var):
                lw.placed.pop(v, None)
        for v, r in zip(y_vars, y_at):
            src = lw.ref(v)
            if src != r:
                lw.call(copy, src, r, _nbytes(v.aval), writes=(r,))
        news = [lw.ref(v) for v in body.outvars[:nk]]
        bufs = {c.buf for c in carries}
        for k, (src, dst) in enumerate(zip(news, carries)):
            if src != dst and src.buf in bufs:                # another carry's old value: keep it aside first
                tmp = lw.scratch(AvalBytes(e.outputs[k].aval), "scan_carry")
                lw.call(copy, src, tmp, _nbytes(e.outputs[k].aval), writes=(tmp,))
                news[k] = tmp
        for src, dst, o in zip(news, carries, e.outputs):
            if src != dst:
                lw.call(copy, src, dst, _nbytes(o.aval), writes=(dst,))


def _carries_in_place(body: Graph, nc: int, nk: int) -> dict[Var, int]:
    """{new carry: its index} for new carries the body's eqn may write straight over the old value: every
    read of the old carry (views of it included) comes before that eqn, or is by that eqn when its kernel
    reads row r before writing row r (the op table's in_place) over the carry's rows only; the new value is
    no view, no y and no other carry, and the old value is no output of the step."""
    root, last = body.last_reads()                            # the step's outputs are read at its end
    made_by = {o: i for i, e in enumerate(body.eqns) for o in e.outputs}
    out = {}
    for k in range(nk):
        v, old = body.outvars[k], body.invars[nc + k]
        if not isinstance(v, Var) or v not in made_by or v in root or body.outvars.count(v) > 1:
            continue
        i, reads = made_by[v], last.get(old, -1)
        e = body.eqns[i]
        if reads < i or (reads == i and e.prim.in_place and all(o.aval.shape == v.aval.shape for o in e.outputs)):
            out[v] = k                                        # (one row domain: each row read, then written)
    return out
