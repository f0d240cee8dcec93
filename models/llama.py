"""llama: interleaved-pair rope, SwiGLU FFN, GQA; output weight tied when absent.

Llama 3.1+ files carry ``rope_freqs.weight``: per-pair divisors of the rope frequencies (llama.cpp
reads it for this family only; the others would refuse the file for the extra tensor).

Files with ``llama.expert_count`` (Mixtral, as llama.cpp converts it) have a mixture of SwiGLU experts
in every layer instead of the dense FFN: a softmax router, the top ``expert_used_count`` experts, their
weights renormalised to sum to 1 (llama.cpp always does), each expert ``feed_forward_length`` wide.
"""
from ggraph.models.registry import register_architecture


def flags(key, names, n_layer) -> dict:
    freqs = {"rope_freq_factors": "rope_freqs"} if "rope_freqs.weight" in names else {}
    experts = {}
    if key("expert_count", 0):                                 # 0 or absent: dense
        experts = dict(n_expert=key.int("expert_count"), n_expert_used=key.int("expert_used_count", required=True),
                       n_ff_exp=key.int("feed_forward_length", required=True, per_layer=True),
                       expert_weights_norm=True)
    return dict(rope_style="interleaved", act="silu") | freqs | experts


register_architecture("llama", flags)
