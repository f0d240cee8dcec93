"""phi3: fused attn_qkv, gate and up fused in ffn_up, split-half partial rope, LongRoPE factors.

llama.cpp disables phi3's sliding window (it ignores phi3.attention.sliding_window), so we do too.
"""
from ggraph.models.registry import register_architecture


def flags(key, names, n_layer) -> dict:
    factors = None
    if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
        factors = "rope_factors"       # the decoder picks _long or _short by context length
    flags = dict(rope_style="neox", act="silu", fused_qkv="blk.0.attn_qkv.weight" in names,
                 fused_gate_up="blk.0.ffn_gate.weight" not in names, sliding_window=None)
    return flags | ({"rope_freq_factors": factors} if factors else {})


register_architecture("phi3", flags)
