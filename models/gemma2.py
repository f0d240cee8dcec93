"""gemma2: scaled embeddings, GELU FFN, post-norms, logit softcaps, sliding window on even layers."""
import math

from ggraph.models.registry import register_architecture
from ggraph.models.swa import swa_layers


def flags(key, names, n_layer) -> dict:
    n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    return dict(rope_style="neox", act="gelu_tanh", post_norms=True, embed_scale=math.sqrt(n_embd),
                attn_softcap=key.float("attn_logit_softcapping", 50.0, zero_ok=True),
                final_softcap=key.float("final_logit_softcapping", 30.0, zero_ok=True),
                swa_layers=swa_layers(key, n_layer, 2), tied_output=True,       # output.weight is never read
                rope_base_local=key.float("rope.freq_base_swa", key.float("rope.freq_base", 10000.0)),
                attn_scale=1.0 / math.sqrt(n_embd / n_head) if n_layer == 46 else 0.0)   # 27B: n_embd/n_head


register_architecture("gemma2", flags)
