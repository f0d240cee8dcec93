"""qwen2: llama with split-half rope and q/k/v biases."""
from ggraph.models.registry import register_architecture


def flags(key, names, n_layer) -> dict:
    return dict(rope_style="neox", act="silu", qkv_bias="blk.0.attn_q.bias" in names)


register_architecture("qwen2", flags)
