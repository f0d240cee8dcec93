"""qwen3next: Qwen3-Next. Gated delta-net layers (linear attention with a state of fixed size) and gated
attention layers, each after an RMS norm (``attn_norm``), then in every layer a mixture of SwiGLU experts
beside a shared expert under a sigmoid gate, after a second norm (``post_attention_norm``):

    qkv, z = h Wqkv, h Wgate                      # attn_qkv [2·Hk·Dk + Hv·Dv, D], attn_gate [Hv·Dv, D]
    b, a = split per key head (h Wba)             # ssm_ba [2·Hv, D]: each key head's Hv/Hk betas, then alphas
    q, k, v = split(silu(causal_conv(qkv)))       # ssm_conv1d [2·Hk·Dk + Hv·Dv, K]
    q, k = l2_norm(q), l2_norm(k)                 # rms_norm(x, eps/Dk) / sqrt(Dk), as llama.cpp's
    o, S = gated_delta_rule(q, k, v, g = softplus(a + dt_bias)·A, beta = sigmoid(b), S)   # ssm_dt.bias, ssm_a
    out = (rms_norm(o) · ssm_norm · silu(z)) Wout # per value head; ssm_out [D, Hv·Dv]

    attention: q|gate = h Wq (per head), qwen3's q/k norms, rope on rope.dimension_count dims (a quarter of
    the head), softmax attention, then o · sigmoid(gate) Wo

The sizes are llama.cpp's ``ssm.*`` keys: state_size Dk (= Dv), group_count Hk, time_step_rank Hv, inner_size
Hv·Dv, conv_kernel K. A delta-net layer carries the convolution's last K-1 inputs and S (Hv, Dv, Dk) from
step to step. As llama.cpp builds it (``llama_model_qwen3next``): the recurrent layers are
``attention.recurrent_layers`` (else every layer but each ``full_attention_interval``-th), the top-k expert
weights are renormalised, and a file's multi-token-prediction layers (``nextn_predict_layers``) are not run.
"""
from ggraph import ops
from ggraph.ir.dims import Sym
from ggraph.ir.dtypes import Aval, f32
from ggraph.ir.recurrent import softplus
from ggraph.ir.trace import scope
from ggraph.models.config import MetadataError
from ggraph.models.registry import register_architecture
from ggraph.models.transformer import Layer, head, moe_ffn, rope_params


def recurrent_layers(key, n_layer) -> tuple[int, ...]:
    """``attention.recurrent_layers`` (a bool per layer), else all but every ``full_attention_interval``-th."""
    flags = key("attention.recurrent_layers")
    if flags is not None:
        if isinstance(flags, (int, float, str, bool)) or len(flags) < n_layer:
            raise MetadataError(f"{key.arch}.attention.recurrent_layers must be a bool per layer ({n_layer})")
        return tuple(i for i in range(n_layer) if flags[i])
    every = key.int("full_attention_interval", 4)
    return tuple(i for i in range(n_layer) if (i + 1) % every)


def flags(key, names, n_layer) -> dict:
    a = key.arch
    if key.int("nextn_predict_layers", 0, minimum=0):
        raise MetadataError(f"{a}.nextn_predict_layers is set: files with multi-token-prediction layers are not "
                            f"supported (convert with --no-mtp)")
    state, groups = key.int("ssm.state_size", required=True), key.int("ssm.group_count", required=True)
    heads, inner = key.int("ssm.time_step_rank", required=True), key.int("ssm.inner_size", required=True)
    if heads % groups or inner != heads * state:
        raise MetadataError(f"{a}.ssm.time_step_rank = {heads} (value heads) must be a multiple of "
                            f"{a}.ssm.group_count = {groups} (key heads), and {a}.ssm.inner_size = {inner} equal "
                            f"to it times {a}.ssm.state_size = {state}")
    n_ff = key.int("feed_forward_length", required=True, per_layer=True)
    used = key.int("expert_used_count", required=True)
    return dict(rope_style="neox", act="silu", recurrent_layers=recurrent_layers(key, n_layer),
                n_expert=key.int("expert_count", required=True), n_expert_used=used,
                n_ff_exp=key.int("expert_feed_forward_length", n_ff // used, per_layer=True),
                n_ff_shexp=key.int("expert_shared_feed_forward_length", n_ff), expert_weights_norm=True,
                ffn_norm="post_attention_norm", dn_key_heads=groups, dn_value_heads=heads, dn_head=state,
                dn_conv=key.int("ssm.conv_kernel", required=True, minimum=2))


def _sizes(cfg):
    e = cfg.extra
    return e["dn_key_heads"], e["dn_value_heads"], e["dn_head"], e["dn_conv"]


def states(cfg) -> list[dict]:
    """A delta-net layer: the convolution's last K-1 inputs of q, k and v, and S (Hv, Dv, Dk); attention: none."""
    Hk, Hv, Dh, K = _sizes(cfg)
    layer = {"conv": Aval((K - 1, (2 * Hk + Hv) * Dh), f32), "ssm": Aval((Hv, Dh, Dh), f32)}
    return [dict(layer) if i in cfg.recurrent_layers else {} for i in range(cfg.n_layer)]


def sigmoid(x):
    return 1.0 / (ops.exp(-x) + 1.0)                                               # ggml_sigmoid: 1 / (1 + e^-x)


def l2_norm(x, eps):
    """x / sqrt(sum x² + eps) over the last axis, as llama.cpp's build_gdn_l2_norm: rms_norm(eps/n) / sqrt(n)."""
    n = x.shape[-1]
    return ops.rms_norm(x, eps=eps / n) * (1.0 / n ** 0.5)


def delta_net(cfg, blk, h, state):
    """The gated delta-net mixer of the normed h (T, D): -> (T, D), its new state."""
    Hk, Hv, Dh, K = _sizes(cfg)
    T, D, a, r = h.shape[0], cfg.n_embd, cfg.arch, Hv // Hk
    C = (2 * Hk + Hv) * Dh
    sizes = f"{a}.ssm.group_count, time_step_rank, state_size = {Hk}, {Hv}, {Dh}"
    by = f"by {a}.embedding_length = {D}"
    qkv = ops.linear(h, blk.expect("attn_qkv.weight", (C, D), f"{sizes} {by}"))     # (T, C)
    z = ops.linear(h, blk.expect("attn_gate.weight", (Hv * Dh, D), f"{sizes} {by}"))   # (T, Hv·Dv)
    ba = ops.linear(h, blk.expect("ssm_ba.weight", (2 * Hv, D), f"{sizes} {by}")).reshape(T, Hk, 2 * r)
    beta = sigmoid(ba[:, :, :r].reshape(T, Hv))                                     # (T, Hv)
    alpha = ba[:, :, r:].reshape(T, Hv) + blk.expect("ssm_dt.bias", (Hv,), sizes)
    g = softplus(alpha) * blk.expect("ssm_a", (Hv,), sizes)                         # (T, Hv): log-decays <= 0
    w = blk.expect("ssm_conv1d.weight", (C, K), f"{sizes} by {a}.ssm.conv_kernel = {K}")
    qkv, conv = ops.causal_conv(qkv, state["conv"], w)                              # (T, C), (K-1, C)
    qkv = ops.silu(qkv)
    q = l2_norm(qkv[:, :Hk * Dh].reshape(T, Hk, Dh), cfg.norm_eps)                  # (T, Hk, Dk)
    k = l2_norm(qkv[:, Hk * Dh:2 * Hk * Dh].reshape(T, Hk, Dh), cfg.norm_eps)
    v = qkv[:, 2 * Hk * Dh:].reshape(T, Hv, Dh)                                     # (T, Hv, Dv)
    o, ssm = ops.gated_delta_rule(q, k, v, g, beta, state["ssm"])                   # (T, Hv, Dv), (Hv, Dv, Dk)
    o = ops.rms_norm(o, blk.expect("ssm_norm.weight", (Dh,), sizes), eps=cfg.norm_eps)
    o = o * ops.silu(z.reshape(T, Hv, Dh))                                          # gated per value head
    out = ops.linear(o.reshape(T, Hv * Dh), blk.expect("ssm_out.weight", (D, Hv * Dh), f"{sizes} {by}"))
    return out, {"conv": conv, "ssm": ssm}


def gated_attention(cfg, blk, i, h, pos, P, k_cache, v_cache, rope_factors):
    """Attention of the normed h (T, D) whose q projection also gives a gate per head: o · sigmoid(gate)."""
    T, H, Hkv, Dh = h.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
    qg = ops.linear(h, blk["attn_q.weight"]).reshape(T, H, 2 * Dh)                 # (T, H, q | gate)
    q, gate = qg[:, :, :Dh], qg[:, :, Dh:]
    k = ops.linear(h, blk["attn_k.weight"]).reshape(T, Hkv, Dh)
    v = ops.linear(h, blk["attn_v.weight"]).reshape(T, Hkv, Dh)
    q = ops.rms_norm(q, blk["attn_q_norm.weight"], eps=cfg.norm_eps)
    k = ops.rms_norm(k, blk["attn_k_norm.weight"], eps=cfg.norm_eps)
    rope = rope_params(cfg, i, rope_factors)
    q, k = ops.rope(q, pos, **rope), ops.rope(k, pos, **rope)
    o, k_cache, v_cache = ops.attention(q, k, v, k_cache, v_cache, P, scale=cfg.scale)   # (T, H, Dh)
    o = o.reshape(T, H * Dh) * sigmoid(gate.reshape(T, H * Dh))
    return ops.linear(o, blk["attn_output.weight"]), k_cache, v_cache


def ffn(cfg, blk, h):
    """The routed experts plus the shared expert under its sigmoid gate (ggml_sigmoid, as llama.cpp's qwen3next)."""
    g, u = ops.linear(h, blk["ffn_gate_shexp.weight"]), ops.linear(h, blk["ffn_up_shexp.weight"])   # (T, Fs)
    shared = ops.linear(ops.swiglu(g, u), blk["ffn_down_shexp.weight"])           # (T, D)
    gate = ops.linear(h, blk["ffn_gate_inp_shexp.weight"].reshape(1, cfg.n_embd))  # (T, 1)
    return moe_ffn(cfg, blk, h) + shared * sigmoid(gate)


def forward(cfg, w, tokens, P, k_caches, v_caches, *, states, last_only=False, rope_factors=None):
    T = tokens.shape[0]
    recurrent = set(cfg.recurrent_layers)
    with scope("embd"):
        x = ops.take(w["token_embd.weight"], tokens)                              # (T, D)
        pos = ops.iota(T) + P                                                      # (T,)
    k_out, v_out, s_out = [], [], []
    for i in range(cfg.n_layer):
        blk = Layer(w, i)
        with scope(f"blk.{i}"):
            h = ops.rms_norm(x, blk["attn_norm.weight"], eps=cfg.norm_eps)        # (T, D)
            if i in recurrent:
                with scope("recurrent"):
                    a, state = delta_net(cfg, blk, h, states[i])
                kc = vc = None
            else:
                with scope("attn"):
                    a, kc, vc = gated_attention(cfg, blk, i, h, pos, P, k_caches[i], v_caches[i], rope_factors)
                state = states[i]
            x = x + a
            with scope("ffn"):
                x = x + ffn(cfg, blk, ops.rms_norm(x, blk[cfg.ffn_norm + ".weight"], eps=cfg.norm_eps))
        k_out.append(kc)
        v_out.append(vc)
        s_out.append(state)
    with scope("output"):
        if last_only:
            x = ops.slice(x, 0, Sym("T") - 1, Sym("T"))                            # (1, D)
        x = ops.rms_norm(x, w["output_norm.weight"], eps=cfg.norm_eps)
        return head(cfg, w, x), k_out, v_out, s_out


register_architecture("qwen3next", flags, forward, states=states)
