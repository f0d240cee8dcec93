"""gpt-oss: OpenAI's open-weight MoE. Attention with q/k/v and output biases and a learned sink logit per
head, sliding-window (even) and full (odd) layers in turn, YaRN rope; in every layer a mixture of experts
with biases and a clamped SwiGLU:

    o = softmax([q·Kᵀ/√Dh, sink_h]) without the sink's column · V          # attn_sinks [H]
    z = h Wrouter + b; z_e, e = top_k(z, k); w = softmax(z_e)             # top k of the logits, then softmax
    g = gate[e] h + bg[e]; u = up[e] h + bu[e]                           # ffn_{gate,up}_exps [E, F, D], .bias [E, F]
    y = sum_j w_j (down[e_j] swiglu_oai(g, u) + bd[e_j])                # ffn_down_exps [E, D, F], .bias [E, D]
    swiglu_oai(g, u) = min(g, 7) σ(1.702 min(g, 7)) · (clamp(u, ±7) + 1)

As llama.cpp builds it (``llama_model_openai_moe``): the FFN's pre-norm is ``post_attention_norm``, the
window pattern is period 2 unless the file says otherwise, sliding layers share the rope base unless
``rope.freq_base_swa`` is set, and alpha and the limit are constants (not read from the file).
"""
from ggraph.models.registry import register_architecture
from ggraph.models.swa import swa_layers


def flags(key, names, n_layer) -> dict:
    local = {"rope_base_local": key.float("rope.freq_base_swa", 1.0)} if key("rope.freq_base_swa") else {}
    return dict(rope_style="neox", act="swiglu_oai", qkv_bias=True, attn_output_bias=True, attn_sinks=True,
                ffn_norm="post_attention_norm", swa_layers=swa_layers(key, n_layer, 2),
                sliding_window=key.int("attention.sliding_window", required=True),
                n_expert=key.int("expert_count", required=True),
                n_expert_used=key.int("expert_used_count", required=True),
                n_ff_exp=key.int("expert_feed_forward_length", required=True, per_layer=True),
                expert_gating="softmax_weight", expert_bias=True) | local


register_architecture("gpt-oss", flags)
