"""qwen3moe: Qwen3-MoE. qwen3's attention (an RMS norm of each head's q and k, no biases) and in every
layer a mixture of SwiGLU experts instead of the dense FFN:

    p = softmax(h Wrouter)                          # (T, E): ffn_gate_inp [E, D]
    w, e = top_k(p, k); w = w / sum(w)              # the k chosen experts, their weights renormalised
    y = sum_j w_j * down[e_j](silu(gate[e_j] h) * up[e_j] h)    # ffn_{gate,up}_exps [E, F, D], down [E, D, F]

llama.cpp always renormalises qwen3moe's top-k weights (Qwen3-30B-A3B's ``norm_topk_prob``), so the
flag is not read from the file.
"""
from ggraph.models.registry import register_architecture


def flags(key, names, n_layer) -> dict:
    return dict(rope_style="neox", act="silu", qk_norm="head",
                n_expert=key.int("expert_count", required=True),
                n_expert_used=key.int("expert_used_count", required=True),
                n_ff_exp=key.int("expert_feed_forward_length", required=True, per_layer=True),
                expert_weights_norm=True)


register_architecture("qwen3moe", flags)
