"""qwen3: qwen2 without q/k/v biases, with an RMS norm of each head's q and k before rope (as gemma3).

Heads may be wider than n_embd / n_head (Qwen3-0.6B: 16 heads of 128 over a width of 1024): the
head dim is ``qwen3.attention.key_length``, which the common config reads.
"""
from ggraph.models.registry import register_architecture


def flags(key, names, n_layer) -> dict:
    return dict(rope_style="neox", act="silu", qk_norm="head")


register_architecture("qwen3", flags)
