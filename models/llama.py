"""llama: interleaved-pair rope, SwiGLU FFN, GQA; output weight tied when absent."""
from ggraph.models.registry import register_architecture


def flags(key, names, n_layer) -> dict:
    return dict(rope_style="interleaved", act="silu")


register_architecture("llama", flags)
