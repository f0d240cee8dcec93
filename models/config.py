"""ModelConfig: every number and flag the shared decoder needs, read from GGUF metadata.

Each architecture (llama.py, qwen2.py, ..., or a plugin) registers a ``flags(key, names,
n_layer)`` function that returns the flags that make it different (``models/registry.py``);
everything common is read here.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping

from ggraph.models.registry import architecture
from ggraph.models.rope import SCALING_TYPES

MAX_ROPE_FREQUENCY = 1e28      # radians per position: times any int32 position it stays a finite f32


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
    rope_style: str = "neox"            # "interleaved" (llama), "neox", or "none" (no rope: NoPE)
    rope_scaling_type: str = "linear"   # rope.scaling.type: none, linear, yarn, longrope (models/rope.py)
    rope_scaling_factor: float = 1.0    # rope.scaling.factor: the context is stretched this many times
    rope_attn_factor: float = 1.0       # rope.scaling.attn_factor: multiplies rope's cos and sin
    n_ctx_orig: int = 0                 # rope.scaling.original_context_length (0: context_length)
    yarn_beta_fast: float = 32.0        # yarn: the ramp of pairs between extrapolation and interpolation
    yarn_beta_slow: float = 1.0
    yarn_log_mul: float = 0.0           # YaRN mscale_all_dims (llama.cpp reads these three for other families only)
    rope_base_local: float | None = None   # sliding-window layers' own rope base and scale (gemma3)
    rope_scale_local: float | None = None
    rope_freq_factors: str | None = None   # tensors dividing rope frequencies: "rope_freqs" (llama 3.1+),
    #                                        "rope_factors" (phi3's _long/_short, by context length)
    act: str = "silu"                   # gated FFN activation: silu, gelu_tanh, or swiglu_oai (gpt-oss's
    #                                     clamped SwiGLU, ggml_swiglu_oai with alpha 1.702 and limit 7)
    fused_qkv: bool = False             # one attn_qkv weight (phi3)
    fused_gate_up: bool = False         # ffn_up holds gate then up (phi3)
    qkv_bias: bool = False              # q/k/v biases (qwen2)
    attn_output_bias: bool = False      # attn_output.bias (gpt-oss)
    attn_sinks: bool = False            # attn_sinks [H]: a learned logit per head in every softmax's denominator
    pre_norms: bool = True              # RMS norms before attention and the FFN (OLMo 2 has none)
    post_norms: bool = False            # post-attention and post-FFN norms (gemma, olmo2)
    ffn_norm: str = "ffn_norm"          # the FFN's pre-norm tensor (gpt-oss: post_attention_norm)
    qk_norm: bool | str = False         # RMS norm of q and k: "head" (or True) per head (gemma3, qwen3),
    #                                     "full" over all heads' q and k at once (olmo2)
    embed_scale: float | None = None    # multiply embeddings by this (gemma: sqrt(n_embd))
    attn_scale: float = 0.0             # q·k scale; 0 means 1/sqrt(head_dim)
    attn_softcap: float | None = None   # gemma2
    final_softcap: float | None = None  # gemma2
    sliding_window: int | None = None
    swa_layers: tuple[bool, ...] = ()   # per layer: True where attention is windowed
    tied_output: bool = False           # no output.weight: logits use token_embd
    n_expert: int = 0                   # a mixture of experts in every FFN (0: dense): ffn_*_exps of E experts
    n_expert_used: int = 0              # the top k experts each token's router picks
    n_ff_exp: int = 0                   # each expert's FFN width
    expert_weights_norm: bool = False   # the chosen experts' router weights renormalised to sum to 1
    n_ff_shexp: int = 0                 # a shared expert of this width beside the routed ones (0: none),
    #                                     scaled per token by sigmoid(h · ffn_gate_inp_shexp) (qwen2moe)
    expert_gating: str = "softmax"      # router: "softmax" of all logits, then their top k; "softmax_weight":
    #                                     the top k logits, then softmax over those (gpt-oss)
    expert_bias: bool = False           # biases of the router and of each expert's gate, up and down (gpt-oss)
    recurrent_layers: tuple[int, ...] = ()   # layers that carry no KV cache (a recurrent state instead, declared
    #                                     by the architecture's ``states``; see models/registry.py)
    extra: Mapping = dataclasses.field(default_factory=dict, compare=False, hash=False)
    #                                     flags of an architecture with its own forward that are not fields here

    def is_swa(self, i: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[i]

    @property
    def scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)


def config_from_gguf(metadata: Mapping, tensor_names, embedding_rows: int = 0) -> ModelConfig:
    """Build the config from a GGUF file's metadata and tensor names; every number is checked as read.
    ``embedding_rows`` is the vocabulary size of a file that names none (no tokenizer, no vocab_size)."""
    arch = metadata.get("general.architecture")
    spec = architecture(arch)
    names = set(tensor_names)
    keys = Keys(metadata, arch)
    key = keys.raw

    n_embd = keys.int("embedding_length", required=True)
    # head_count = 0: no attention at all (mamba2), for an architecture whose layers all carry recurrent states
    attention_free = spec.states is not None and key("attention.head_count") == 0
    n_head = 0 if attention_free else keys.int("attention.head_count", required=True)
    n_head_kv = 0 if attention_free else keys.int("attention.head_count_kv", n_head, per_layer=True, zero_layers=True)
    n_layer = keys.int("block_count", required=True)
    check_layers(arch, n_layer, names, shared_decoder=spec.forward is None)   # before flags sized by it
    if not attention_free and n_head % n_head_kv:
        raise ValueError(f"{arch}.attention.head_count = {n_head} is not a multiple of "
                         f"{arch}.attention.head_count_kv = {n_head_kv}")
    if not attention_free and n_embd % n_head and f"{arch}.attention.key_length" not in metadata:
        raise ValueError(f"{arch}.embedding_length = {n_embd} is not a multiple of {arch}.attention.head_count = "
                         f"{n_head}, and there is no {arch}.attention.key_length")
    head_dim = 0 if attention_free else keys.int("attention.key_length", n_embd // n_head)
    if "token_embd.weight" not in names:
        raise ValueError("model has no token_embd.weight tensor")
    tokens = metadata.get("tokenizer.ggml.tokens")
    n_vocab = keys.int("vocab_size", len(tokens) if tokens is not None else embedding_rows, minimum=0)
    scale_type = key("rope.scaling.type", "linear")          # llama.cpp's default
    if scale_type not in SCALING_TYPES:
        raise ValueError(f"{arch}.rope.scaling.type {scale_type!r} is not supported ({', '.join(SCALING_TYPES)})")
    scale_factor = keys.float("rope.scaling.factor", keys.float("rope.scale_linear", 1.0, zero_means_default=True),
                              zero_means_default=True)
    rope_dims = 0 if attention_free else keys.int("rope.dimension_count", head_dim)
    if rope_dims % 2 or rope_dims > head_dim:
        raise ValueError(f"{arch}.rope.dimension_count = {rope_dims} must be even and at most the head dim "
                         f"{head_dim}")
    window = keys.int("attention.sliding_window", None) if key("attention.sliding_window") else None
    common = dict(
        arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim,
        head_dim_v=0 if attention_free else keys.int("attention.value_length", head_dim),
        n_ff=keys.int("feed_forward_length", required=True, per_layer=True,
                      minimum=0 if spec.states is not None else 1),              # 0: no FFN (mamba2)
        norm_eps=keys.float("attention.layer_norm_rms_epsilon", 1e-5),
        n_ctx_train=keys.int("context_length", 2048),
        rope_base=keys.float("rope.freq_base", 10000.0),
        rope_dims=rope_dims,
        rope_scaling_type=scale_type,
        rope_scaling_factor=scale_factor,
        rope_attn_factor=keys.float("rope.scaling.attn_factor", 1.0),
        n_ctx_orig=keys.int("rope.scaling.original_context_length", 0, minimum=0),   # 0: context_length
        sliding_window=window,
        tied_output="output.weight" not in names,
    )
    try:
        flags = spec.flags(keys, names, n_layer)
    except MetadataError:                                  # a key the file got wrong, read through Keys: say so
        raise
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
    cfg = ModelConfig(**common, extra={k: flags[k] for k in unknown})
    _check_flags(cfg)
    if attention_free and len(cfg.recurrent_layers) != n_layer:
        raise ValueError(f"{arch}.attention.head_count = 0 (no attention) but the architecture's recurrent_layers "
                         f"{cfg.recurrent_layers} leave layers with attention")
    kv_per_layer = key("attention.head_count_kv")
    if kv_per_layer is not None and not isinstance(kv_per_layer, (int, float, str, bool)):
        for i, n in enumerate(kv_per_layer):
            if n == 0 and i not in cfg.recurrent_layers:
                raise ValueError(f"{arch}.attention.head_count_kv[{i}] = 0 (no KV cache) but layer {i} is not in "
                                 f"the architecture's recurrent_layers {cfg.recurrent_layers}")
    return cfg


class MetadataError(ValueError):
    """A metadata value that is missing, of the wrong type or out of range; the message names the key."""


class Keys:
    """``<arch>.*`` metadata, read with the checks a lying file needs: ``keys("rope.freq_base", 1e4)``
    returns the raw value (what architecture flag functions call); ``int``/``float`` check it."""

    def __init__(self, metadata: Mapping, arch: str):
        self.metadata, self.arch = metadata, arch

    def raw(self, k: str, default=None, required: bool = False):
        full = f"{self.arch}.{k}"
        if full in self.metadata:
            return self.metadata[full]
        if required:
            raise MetadataError(f"{self.arch} model is missing metadata key {full!r}")
        return default

    __call__ = raw

    def int(self, k: str, default=None, *, required: bool = False, minimum: int = 1, per_layer: bool = False,
            zero_layers: bool = False):
        """A whole number >= ``minimum``; with ``per_layer``, an array of equal values counts as one (with
        ``zero_layers``, its zeros aside: layers without the thing, e.g. no KV heads in a recurrent layer)."""
        v = self.raw(k, default, required)
        if v is None:
            return None
        full = f"{self.arch}.{k}"
        if per_layer and not isinstance(v, (int, float, str, bool)):
            values = set(v) if len(v) else {None}
            if zero_layers and values - {0}:
                values -= {0}
            if len(values) != 1:
                raise MetadataError(f"{full} varies by layer ({len(values)} different values), which is not supported")
            v = values.pop()
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise MetadataError(f"{full} = {v!r}: must be an integer of at least {minimum}")
        return v

    def float(self, k: str, default: float, *, zero_means_default: bool = False, zero_ok: bool = False) -> float:
        """A finite number greater than 0 (a factor, a base, an epsilon); with ``zero_ok``, 0 too (a
        softcap of 0 is none)."""
        v = self.raw(k, default)
        if zero_means_default and v == 0:
            v = default
        full = f"{self.arch}.{k}"
        if zero_ok and not isinstance(v, (bool, str)) and v == 0:
            return 0.0
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise MetadataError(f"{full} = {v!r}: must be a finite number greater than 0")
        return float(v)


def _check_flags(cfg: ModelConfig) -> None:
    """The numbers an architecture's flags set, checked like the ones read above."""
    for name in ("attn_softcap", "final_softcap", "embed_scale", "rope_base_local", "rope_scale_local", "attn_scale"):
        v = getattr(cfg, name)
        none = v is None or (name in ("attn_softcap", "final_softcap", "attn_scale") and not isinstance(v, str)
                             and v == 0)                # 0: no softcap, the default scale; a base of 0 is a lie
        if not none and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            raise ValueError(f"{cfg.arch}: {name} = {v!r} must be a finite number greater than 0")
    for key, base in (("rope.freq_base", cfg.rope_base), ("rope.freq_base_swa", cfg.rope_base_local)):
        if base is None:
            continue
        # theta_i = pos * base^(-2i/n): a base far below 1 makes the top pair's frequency overflow f32 (NaN
        # logits), and yarn's ramp divides by log(base)
        top = math.exp(-math.log(base) * (cfg.rope_dims - 2) / cfg.rope_dims) if cfg.rope_dims > 2 else 1.0
        if top > MAX_ROPE_FREQUENCY:
            raise ValueError(f"{cfg.arch}.{key} = {base!r}: too small, its rope frequencies overflow "
                             f"({top:.3g} radians per position)")
        if cfg.rope_scaling_type == "yarn" and base == 1:
            raise ValueError(f"{cfg.arch}.{key} = {base!r}: yarn scaling needs a rope base other than 1")
    if cfg.swa_layers and len(cfg.swa_layers) != cfg.n_layer:
        raise ValueError(f"{cfg.arch}: {len(cfg.swa_layers)} sliding-window flags for {cfg.n_layer} layers")
    if cfg.rope_style not in ("neox", "interleaved", "none"):
        raise ValueError(f"{cfg.arch}: rope_style {cfg.rope_style!r} must be neox, interleaved or none")
    if cfg.act not in ("silu", "gelu_tanh", "swiglu_oai"):
        raise ValueError(f"{cfg.arch}: act {cfg.act!r} must be silu, gelu_tanh or swiglu_oai")
    if cfg.expert_gating not in ("softmax", "softmax_weight"):
        raise ValueError(f"{cfg.arch}: expert_gating {cfg.expert_gating!r} must be softmax or softmax_weight")
    if cfg.post_norms and cfg.ffn_norm == "post_attention_norm":
        raise ValueError(f"{cfg.arch}: ffn_norm post_attention_norm is the post-attention norm's tensor "
                         f"when post_norms is set")
    if cfg.n_expert and not (0 < cfg.n_expert_used <= cfg.n_expert and cfg.n_ff_exp > 0):
        raise ValueError(f"{cfg.arch}: expert_used_count = {cfg.n_expert_used} must be 1..expert_count = "
                         f"{cfg.n_expert}, and expert_feed_forward_length = {cfg.n_ff_exp} at least 1")
    if isinstance(cfg.n_ff_shexp, bool) or not isinstance(cfg.n_ff_shexp, int) or cfg.n_ff_shexp < 0 \
            or (cfg.n_ff_shexp and not cfg.n_expert):
        raise ValueError(f"{cfg.arch}: expert_shared_feed_forward_length = {cfg.n_ff_shexp!r} must be a whole number "
                         f"of at least 0, and a shared expert needs routed ones (expert_count = {cfg.n_expert})")
    rl = cfg.recurrent_layers
    if not isinstance(rl, tuple) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < cfg.n_layer
                                        for i in rl) or list(rl) != sorted(set(rl)):
        raise ValueError(f"{cfg.arch}: recurrent_layers {rl!r} must be a tuple of increasing layer numbers in "
                         f"0..{cfg.n_layer - 1}")
    if cfg.qk_norm not in (False, True, "head", "full"):
        raise ValueError(f"{cfg.arch}: qk_norm {cfg.qk_norm!r} must be False, \"head\" (or True) or \"full\"")


_BLOCK = re.compile(r"blk\.(\d+)\.")


def check_layers(arch: str, n_layer: int, names, shared_decoder: bool = True) -> None:
    """The block count against the blk.N tensors, before anything sized by it (per-layer flags, caches)
    is made: a lying ``block_count = 2**32 - 1`` is one line, not a tuple of four billion flags."""
    layers = sorted({int(m.group(1)) for n in names if (m := _BLOCK.match(n))})
    if layers and (layers[-1] >= n_layer or len(layers) != n_layer):
        have = f"blk.{layers[0]}..blk.{layers[-1]}" + ("" if len(layers) == layers[-1] - layers[0] + 1
                                                         else f" ({len(layers)} of them)")
        raise ValueError(f"{arch}.block_count = {n_layer} but the file has {have}")
    if not layers and shared_decoder and n_layer:
        raise ValueError(f"{arch}.block_count = {n_layer} but the file has no blk.N tensors")
