"""lfm2: Liquid AI's LFM2. Short-convolution layers and attention layers (head_count_kv 0 marks a
convolution layer), each after an RMS norm (``attn_norm``), and a SwiGLU FFN in every layer:

    b, c, x = split3(h Win)                      # shortconv.in_proj [3D, D]
    y = c * causal_conv(b * x)                   # shortconv.conv [D, K]: depthwise over the last K inputs
    out = y Wout                                 # shortconv.out_proj [D, D]

The convolution carries its last K-1 inputs (b * x) from step to step. Attention layers norm each head's q
and k (qwen3's) and rotate split halves. As llama.cpp builds it (``llama_model_lfm2``): the output norm is
``token_embd_norm``, K is ``shortconv.l_cache``, and the convolution has no bias.
"""
from ggraph import ops
from ggraph.ir.dtypes import Aval, f32
from ggraph.models.config import MetadataError
from ggraph.models.registry import register_architecture
from ggraph.models.transformer import hybrid_forward


def recurrent_layers(key, n_layer) -> tuple[int, ...]:
    """The layers whose ``attention.head_count_kv`` is 0: llama.cpp's mark of a recurrent layer."""
    kv = key("attention.head_count_kv")
    if kv is None or isinstance(kv, (int, float, str, bool)):
        return ()
    if len(kv) != n_layer:
        raise MetadataError(f"{key.arch}.attention.head_count_kv has {len(kv)} entries for {n_layer} layers")
    return tuple(i for i, n in enumerate(kv) if n == 0)


def flags(key, names, n_layer) -> dict:
    if key("attention.sliding_window"):
        raise MetadataError(f"{key.arch}.attention.sliding_window is set: LFM2's sliding-window attention is not "
                            f"supported yet")
    if key("attention.causal", True) is False:
        raise MetadataError(f"{key.arch}.attention.causal is false: bidirectional LFM2 (embedding models) is not "
                            f"supported")
    return dict(rope_style="neox", act="silu", qk_norm="head", recurrent_layers=recurrent_layers(key, n_layer),
                conv_width=key.int("shortconv.l_cache", required=True, minimum=2), output_norm="token_embd_norm")


def states(cfg) -> list[dict]:
    """A convolution layer carries its last K-1 inputs (K-1, D); an attention layer its KV cache only."""
    conv = {"conv": Aval((cfg.extra["conv_width"] - 1, cfg.n_embd), f32)}
    return [dict(conv) if i in cfg.recurrent_layers else {} for i in range(cfg.n_layer)]


def shortconv(cfg, blk, h, state):
    """LFM2's gated short convolution of the normed h (T, D): -> (T, D), its new state."""
    D, K = cfg.n_embd, cfg.extra["conv_width"]
    d = f"{cfg.arch}.embedding_length = {D}"
    bcx = ops.linear(h, blk.expect("shortconv.in_proj.weight", (3 * D, D), f"3 × {d} by {d}"))   # (T, 3D)
    b, c, x = bcx[:, :D], bcx[:, D:2 * D], bcx[:, 2 * D:]                          # (T, D) each
    w = blk.expect("shortconv.conv.weight", (D, K), f"{d} by {cfg.arch}.shortconv.l_cache = {K}")
    y, conv = ops.causal_conv(b * x, state["conv"], w)                             # (T, D), (K-1, D)
    return ops.linear(c * y, blk.expect("shortconv.out_proj.weight", (D, D), f"{d} by {d}")), {"conv": conv}


def forward(cfg, w, tokens, P, k_caches, v_caches, *, states, last_only=False, rope_factors=None):
    return hybrid_forward(cfg, w, tokens, P, k_caches, v_caches, states=states, mixer=shortconv,
                          last_only=last_only, rope_factors=rope_factors)


register_architecture("lfm2", flags, forward, states=states)
