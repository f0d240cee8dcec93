"""olmoe: OLMoE. OLMo's q and k norms over the whole projections (all heads at once, before rope), the
usual pre-norms, and in every layer a mixture of SwiGLU experts (64, top-8 in OLMoE-1B-7B):

    p = softmax(h Wrouter)                          # (T, E): ffn_gate_inp [E, D]
    w, e = top_k(p, k)                              # the k chosen experts, their weights as they are
    y = sum_j w_j * down[e_j](silu(gate[e_j] h) * up[e_j] h)    # ffn_{gate,up}_exps [E, F, D], down [E, D, F]

As llama.cpp builds it: the top-k weights are not renormalised (OLMoE's ``norm_topk_prob`` is false,
and llama.cpp does not read it), and each expert is ``olmoe.feed_forward_length`` wide.
"""
from ggraph.models.registry import register_architecture


def flags(key, names, n_layer) -> dict:
    return dict(rope_style="neox", act="silu", qk_norm="full",
                n_expert=key.int("expert_count", required=True),
                n_expert_used=key.int("expert_used_count", required=True),
                n_ff_exp=key.int("feed_forward_length", required=True, per_layer=True))


register_architecture("olmoe", flags)
