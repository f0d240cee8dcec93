"""olmo2: OLMo 2. Norms after attention and after the FFN and none before them; q and k are RMS-normed
over the whole projection (all heads at once) before rope. Split-half rope, SwiGLU, untied output.

    x = x + post_attention_norm(attn(x))        # q = q_norm(x Wq), k = k_norm(x Wk): (T, H*Dh) before heads
    x = x + post_ffw_norm(ffn(x))

Files with ``olmo2.attention.sliding_window`` are OLMo 3 (windowed layers with a rope of their own,
unscaled even under yarn); those are refused until that is built and checked against llama.cpp.
"""
from ggraph.models.registry import register_architecture


def flags(key, names, n_layer) -> dict:
    if key("attention.sliding_window"):
        raise ValueError("olmo2.attention.sliding_window is set: OLMo 3's sliding-window layers are not "
                         "supported yet")
    return dict(rope_style="neox", act="silu", pre_norms=False, post_norms=True, qk_norm="full")


register_architecture("olmo2", flags)
