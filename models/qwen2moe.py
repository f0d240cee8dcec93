"""qwen2moe: Qwen1.5/Qwen2-MoE. qwen2's attention (q/k/v biases, split-half rope) and in every layer a
mixture of SwiGLU experts beside a shared expert that every token takes, gated per token:

    p = softmax(h Wrouter)                          # (T, E): ffn_gate_inp [E, D]
    w, e = top_k(p, k)                              # the k chosen experts, their weights as they are
    y = sum_j w_j * down[e_j](silu(gate[e_j] h) * up[e_j] h)    # ffn_{gate,up}_exps [E, F, D], down [E, D, F]
    y = y + sigmoid(h Wg) * down_s(silu(gate_s h) * up_s h)     # ffn_gate_inp_shexp [D], ffn_*_shexp

As llama.cpp builds it: the top-k weights are not renormalised (``norm_topk_prob`` is not read), an
expert is ``expert_feed_forward_length`` wide (else ``feed_forward_length / expert_used_count``) and
the shared one ``expert_shared_feed_forward_length`` (else ``feed_forward_length``).
"""
from ggraph.models.registry import register_architecture


def flags(key, names, n_layer) -> dict:
    n_ff = key.int("feed_forward_length", required=True, per_layer=True)
    used = key.int("expert_used_count", required=True)
    return dict(rope_style="neox", act="silu", qkv_bias="blk.0.attn_q.bias" in names,
                n_expert=key.int("expert_count", required=True), n_expert_used=used,
                n_ff_exp=key.int("expert_feed_forward_length", n_ff // used, per_layer=True),
                n_ff_shexp=key.int("expert_shared_feed_forward_length", n_ff))


register_architecture("qwen2moe", flags)
