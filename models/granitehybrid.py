"""granitehybrid: IBM's Granite 4.0 H (and Bamba). Mamba-2 layers (mamba2.py's mixer) and attention layers
(head_count_kv 0 marks a Mamba-2 layer), each after an RMS norm, then in every layer a mixture of SwiGLU
experts beside an ungated shared expert (or one dense SwiGLU FFN), with granite's multipliers:

    x = embedding_scale · embed(tokens)
    x = x + residual_scale · mixer(rms_norm(x))               # Mamba-2, or attention with scale attention.scale
    x = x + residual_scale · (moe(h) + shared(h)),  h = rms_norm(x)
    logits = (rms_norm(x) Wout) / logit_scale

As llama.cpp builds it (``llama_model_granite_hybrid``): the router's top-k weights are renormalised (a
softmax over the top k logits, as Granite's router computes them), experts are ``feed_forward_length`` wide,
attention rotates interleaved pairs only where ``rope.scaling.finetuned`` is true (the default; Granite 4.0 H
files say false: no position encoding at all), and each multiplier left out or 0 is none.
"""
from ggraph.models.config import MetadataError
from ggraph.models.lfm2 import recurrent_layers
from ggraph.models.mamba2 import mixer, ssm_flags, states
from ggraph.models.registry import register_architecture
from ggraph.models.transformer import hybrid_forward


def flags(key, names, n_layer) -> dict:
    if any(n.endswith(("ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")) for n in names):
        raise MetadataError(f"{key.arch}: FFN biases (blk.N.ffn_*.bias) are not supported")
    n_ff = key.int("feed_forward_length", required=True, per_layer=True)
    experts = key.int("expert_count", 0, minimum=0)
    moe = dict(n_expert=experts, n_expert_used=key.int("expert_used_count", required=True), n_ff_exp=n_ff,
               expert_weights_norm=True,
               n_ff_shexp=key.int("expert_shared_feed_forward_length", 0, minimum=0)) if experts else {}
    scales = {name: key.float(name, 0.0, zero_ok=True) for name in ("embedding_scale", "residual_scale",
                                                                    "logit_scale", "attention.scale")}
    return dict(rope_style="interleaved" if key("rope.scaling.finetuned", True) else "none", act="silu",
                recurrent_layers=recurrent_layers(key, n_layer), embed_scale=scales["embedding_scale"] or None,
                attn_scale=scales["attention.scale"], residual_scale=scales["residual_scale"],
                logit_scale=scales["logit_scale"]) | moe | ssm_flags(key)


def forward(cfg, w, tokens, P, k_caches, v_caches, *, states, last_only=False, rope_factors=None):
    return hybrid_forward(cfg, w, tokens, P, k_caches, v_caches, states=states, mixer=mixer,
                          last_only=last_only, rope_factors=rope_factors)


register_architecture("granitehybrid", flags, forward, states=states)
