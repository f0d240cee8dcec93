"""llama: interleaved-pair rope, SwiGLU FFN, GQA; output weight tied when absent.

Llama 3.1+ files carry ``rope_freqs.weight``: per-pair divisors of the rope frequencies (llama.cpp
reads it for this family only; the others would refuse the file for the extra tensor).
"""
from ggraph.models.registry import register_architecture


def flags(key, names, n_layer) -> dict:
    freqs = {"rope_freq_factors": "rope_freqs"} if "rope_freqs.weight" in names else {}
    return dict(rope_style="interleaved", act="silu") | freqs


register_architecture("llama", flags)
