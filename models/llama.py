"""llama: interleaved-pair rope, SwiGLU FFN, GQA; output weight tied when absent."""


def flags(key, names, n_layer) -> dict:
    return dict(rope_style="interleaved", act="silu")
