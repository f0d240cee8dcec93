"""mamba2: Mamba-2, every layer a state-space mixer after an RMS norm (``attn_norm``), no attention, no FFN:

    z, xBC, dt = split(h Win)                    # ssm_in [2·Di + 2·G·N + H, D]
    xBC = silu(causal_conv(xBC) + b)             # ssm_conv1d [Di + 2·G·N, K], .bias
    x, B, C = split(xBC)                         # x (T, H, Di/H); B, C (T, G, N)
    S_t = exp(softplus(dt_t + b_dt)·A)·S_(t-1) + softplus(dt_t + b_dt)·x_t ⊗ B_t;  y_t = S_t·C_t
    y = rms_norm_per_group((y + D·x) * silu(z)) · w      # ssm_d [H, 1], ssm_norm [G, Di/G]
    out = y Wout                                 # ssm_out [D, Di]

Each layer carries the convolution's last K-1 inputs and the state S (H, Di/H, N) from step to step. The
sizes are llama.cpp's ``ssm.*`` keys: inner_size Di, time_step_rank H (the heads), group_count G,
state_size N, conv_kernel K; ssm_a holds A = -exp(A_log) as the converter writes it.
granitehybrid's Mamba-2 layers are these (``mixer``, ``ssm_flags``, ``ssm_states``).
"""
from ggraph import ops
from ggraph.ir.dtypes import Aval, f32
from ggraph.models.config import MetadataError
from ggraph.models.registry import register_architecture
from ggraph.models.transformer import hybrid_forward


def ssm_flags(key) -> dict:
    """The Mamba-2 mixer's sizes from the ``ssm.*`` keys, checked against each other."""
    a = key.arch
    inner, heads = key.int("ssm.inner_size", required=True), key.int("ssm.time_step_rank", required=True)
    groups, state = key.int("ssm.group_count", required=True), key.int("ssm.state_size", required=True)
    if inner % heads or heads % groups:
        raise MetadataError(f"{a}.ssm.inner_size = {inner} must be a multiple of {a}.ssm.time_step_rank (heads) = "
                            f"{heads}, and that of {a}.ssm.group_count = {groups}")
    return dict(ssm_inner=inner, ssm_heads=heads, ssm_groups=groups, ssm_state=state,
                ssm_conv=key.int("ssm.conv_kernel", required=True, minimum=2))


def flags(key, names, n_layer) -> dict:
    return dict(recurrent_layers=tuple(range(n_layer))) | ssm_flags(key)


def ssm_states(cfg) -> dict:
    """One Mamba-2 layer's state: the convolution's last K-1 inputs and the scan's S (H, Di/H, N)."""
    e = cfg.extra
    channels = e["ssm_inner"] + 2 * e["ssm_groups"] * e["ssm_state"]
    return {"conv": Aval((e["ssm_conv"] - 1, channels), f32),
            "ssm": Aval((e["ssm_heads"], e["ssm_inner"] // e["ssm_heads"], e["ssm_state"]), f32)}


def states(cfg) -> list[dict]:
    return [ssm_states(cfg) if i in cfg.recurrent_layers else {} for i in range(cfg.n_layer)]


def mixer(cfg, blk, h, state):
    """The Mamba-2 mixer of the normed h (T, D), as llama.cpp's build_mamba2_layer: -> (T, D), its new state."""
    e, a, D = cfg.extra, cfg.arch, cfg.n_embd
    Di, H, G, N, K = e["ssm_inner"], e["ssm_heads"], e["ssm_groups"], e["ssm_state"], e["ssm_conv"]
    T, C = h.shape[0], Di + 2 * G * N
    sizes = f"{a}.ssm.inner_size, group_count, state_size, time_step_rank = {Di}, {G}, {N}, {H}"
    zxbcdt = ops.linear(h, blk.expect("ssm_in.weight", (2 * Di + 2 * G * N + H, D),
                                      f"{sizes} by {a}.embedding_length = {D}"))   # (T, 2Di + 2GN + H)
    z, xbc, dt = zxbcdt[:, :Di], zxbcdt[:, Di:Di + C], zxbcdt[:, Di + C:]          # (T, Di), (T, C), (T, H)
    w = blk.expect("ssm_conv1d.weight", (C, K), f"{sizes} by {a}.ssm.conv_kernel = {K}")
    xbc, conv = ops.causal_conv(xbc, state["conv"], w, blk.expect("ssm_conv1d.bias", (C,), sizes))
    xbc = ops.silu(xbc)                                                            # (T, C)
    x = xbc[:, :Di].reshape(T, H, Di // H)                                         # (T, H, Dh)
    B, Cm = xbc[:, Di:Di + G * N].reshape(T, G, N), xbc[:, Di + G * N:].reshape(T, G, N)
    dt = dt + blk.expect("ssm_dt.bias", (H,), sizes)                               # (T, H)
    A = blk.expect("ssm_a", (H, 1), sizes).reshape(H)
    y, ssm = ops.ssm_scan(state["ssm"], x, dt, A, B, Cm)                           # (T, H, Dh), (H, Dh, N)
    y = y + x * blk.expect("ssm_d", (H, 1), sizes)                                 # the skip D·x, per head
    y = ops.swiglu(z, y.reshape(T, Di))                                            # silu(z) · y
    norm = blk.expect("ssm_norm.weight", (G, Di // G), sizes)
    y = ops.rms_norm(y.reshape(T, G, Di // G), norm, eps=cfg.norm_eps).reshape(T, Di)   # per group
    out = ops.linear(y, blk.expect("ssm_out.weight", (D, Di), f"{a}.embedding_length = {D} by {sizes}"))
    return out, {"conv": conv, "ssm": ssm}


def forward(cfg, w, tokens, P, k_caches, v_caches, *, states, last_only=False, rope_factors=None):
    return hybrid_forward(cfg, w, tokens, P, k_caches, v_caches, states=states, mixer=mixer,
                          last_only=last_only, rope_factors=rope_factors)


register_architecture("mamba2", flags, forward, states=states)
