"""ModelConfig: every number and flag the shared decoder needs, read from GGUF metadata.

Each architecture (llama.py, qwen2.py, ..., or a plugin) registers a ``flags(key, names,
n_layer)`` function that returns the flags that make it different (``models/registry.py``);
everything common is read here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from ggraph.models.registry import architecture


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int                       # key_length
    head_dim_v: int                     # value_length
    n_ff: int
    norm_eps: float
    n_ctx_train: int
    rope_base: float
    rope_dims: int                      # rotary dims per head (partial rotary when < head_dim)
    rope_style: str = "neox"            # "interleaved" (llama) or "neox"
    rope_scale: float = 1.0             # positions are multiplied by this (1 / linear scaling factor)
    rope_base_local: float | None = None   # sliding-window layers' own rope base and scale (gemma3)
    rope_scale_local: float | None = None
    rope_freq_factors: str | None = None   # tensors dividing rope frequencies (phi3's rope_factors_*)
    n_ctx_orig: int = 0                 # phi3: contexts longer than this use rope_factors_long
    rope_mscale: float = 1.0            # rope.scaling.attn_factor: multiplies rope's cos and sin
    act: str = "silu"                   # gated FFN activation: silu or gelu_tanh
    fused_qkv: bool = False             # one attn_qkv weight (phi3)
    fused_gate_up: bool = False         # ffn_up holds gate then up (phi3)
    qkv_bias: bool = False              # q/k/v biases (qwen2)
    post_norms: bool = False            # gemma's post-attention and post-FFN norms
    qk_norm: bool = False               # RMS norm on q and k per head (gemma3)
    embed_scale: float | None = None    # multiply embeddings by this (gemma: sqrt(n_embd))
    attn_scale: float = 0.0             # q·k scale; 0 means 1/sqrt(head_dim)
    attn_softcap: float | None = None   # gemma2
    final_softcap: float | None = None  # gemma2
    sliding_window: int | None = None
    swa_layers: tuple[bool, ...] = ()   # per layer: True where attention is windowed
    tied_output: bool = False           # no output.weight: logits use token_embd
    extra: Mapping = dataclasses.field(default_factory=dict, compare=False, hash=False)
    #                                     flags of an architecture with its own forward that are not fields here

    def layer_rope(self, i: int) -> tuple[float, float]:
        """(base, position scale) of layer i's rope: local layers may have their own."""
        if self.rope_base_local is not None and self.is_swa(i):
            return self.rope_base_local, self.rope_scale_local or 1.0
        return self.rope_base, self.rope_scale

    def is_swa(self, i: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[i]

    @property
    def scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)


def config_from_gguf(metadata: Mapping, tensor_names) -> ModelConfig:
    """Build the config from a GGUF file's metadata and tensor names."""
    arch = metadata.get("general.architecture")
    spec = architecture(arch)
    names = set(tensor_names)

    def key(k, default=None, required=False):
        full = f"{arch}.{k}"
        if full in metadata:
            return metadata[full]
        if required:
            raise ValueError(f"{arch} model is missing metadata key {full!r}")
        return default

    n_embd = int(key("embedding_length", required=True))
    n_head = int(key("attention.head_count", required=True))
    n_head_kv = key("attention.head_count_kv", n_head)
    n_layer = int(key("block_count", required=True))
    if not isinstance(n_head_kv, int):                  # per-layer arrays exist; we need one value
        if len(set(n_head_kv)) != 1:
            raise ValueError(f"{arch}.attention.head_count_kv varies by layer, which is not supported")
        n_head_kv = int(n_head_kv[0])
    head_dim = int(key("attention.key_length", n_embd // n_head))
    if "token_embd.weight" not in names:
        raise ValueError("model has no token_embd.weight tensor")
    tokens = metadata.get("tokenizer.ggml.tokens")
    n_vocab = int(key("vocab_size", len(tokens) if tokens is not None else 0))
    scale_type = key("rope.scaling.type", "linear")          # llama.cpp's default
    scale_factor = float(key("rope.scaling.factor", 1.0) or 1.0)
    common = dict(
        arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_head_kv=int(n_head_kv), head_dim=head_dim,
        head_dim_v=int(key("attention.value_length", head_dim)),
        n_ff=int(_first(key("feed_forward_length", required=True))),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        n_ctx_train=int(key("context_length", 2048)),
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_dims=int(key("rope.dimension_count", head_dim)),
        rope_scale=1.0 / scale_factor if scale_type == "linear" else 1.0,
        sliding_window=key("attention.sliding_window"),
        rope_mscale=float(key("rope.scaling.attn_factor", 1.0)),
        tied_output="output.weight" not in names,
    )
    if scale_type not in ("none", "linear"):
        raise ValueError(f"{arch}.rope.scaling.type {scale_type!r} is not supported (none, linear)")
    try:
        flags = spec.flags(key, names, n_layer)
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        raise ValueError(f"architecture {arch!r} ({spec.origin}): its flags function failed: "
                         f"{type(e).__name__}: {e}") from e
    if not isinstance(flags, Mapping):
        raise TypeError(f"architecture {arch!r} ({spec.origin}): flags must return a dict, got {type(flags).__name__}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(flags) - fields)
    if unknown and spec.forward is None:
        raise ValueError(f"architecture {arch!r} ({spec.origin}): flags {', '.join(unknown)} are not ModelConfig "
                         f"fields, and the shared decoder would ignore them (register a forward of its own, "
                         f"which reads them as cfg.extra)")
    common.update({k: v for k, v in flags.items() if k in fields})
    return ModelConfig(**common, extra={k: flags[k] for k in unknown})


def _first(v):
    return v if isinstance(v, (int, float)) else v[0]
