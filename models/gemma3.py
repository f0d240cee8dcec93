"""gemma3: gemma2's shape with q/k norms, 5 local : 1 global layers, local rope base 10000.

Unlike gemma2 there is no attention softcap, and the final softcap only when the file sets one.
"""
import math

from ggraph.models.registry import register_architecture
from ggraph.models.swa import swa_layers


def flags(key, names, n_layer) -> dict:
    n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    return dict(rope_style="neox", act="gelu_tanh", post_norms=True, qk_norm=True,
                final_softcap=key.float("final_logit_softcapping", 0.0, zero_ok=True) or None,
                embed_scale=math.sqrt(n_embd), rope_scale_local=1.0,
                rope_base_local=key.float("rope.freq_base_swa", 10000.0),
                swa_layers=swa_layers(key, n_layer, 6) if key("attention.sliding_window") else (),
                attn_scale=1.0 / math.sqrt(n_embd / n_head) if n_layer == 62 else 0.0)   # 27B: n_embd/n_head


register_architecture("gemma3", flags)
