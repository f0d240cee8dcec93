"""The families ``ggraph convert`` reads: each one's config.json as GGUF ``<arch>.*`` keys, and its
Hugging Face tensors as GGUF tensors, following llama.cpp's ``convert_hf_to_gguf.py``. Dense: llama,
qwen2, phi3, gemma2, gemma3, qwen3, olmo2; with experts: qwen3moe, olmoe, qwen2moe, and Mixtral
(``MixtralForCausalLM``), which becomes ``llama`` with ``llama.expert_count``.

Tensor names (the decoder blocks are ``model.layers.N.*`` -> ``blk.N.*``)::

    model.embed_tokens          token_embd         self_attn.q_proj/k_proj/v_proj/o_proj  attn_q/k/v/output
    model.norm                  output_norm        self_attn.qkv_proj (phi3)              attn_qkv
    lm_head                     output             self_attn.q_norm/k_norm (gemma3, qwen3, olmo) attn_q/k_norm
    input_layernorm             attn_norm          mlp.gate_proj/up_proj/down_proj        ffn_gate/up/down
    post_attention_layernorm    ffn_norm           mlp.gate_up_proj (phi3)                ffn_up
      (gemma, olmo2: post_attention_norm)          pre_/post_feedforward_layernorm        ffn_norm/post_ffw_norm
    mlp.gate (Mixtral: block_sparse_moe.gate)      ffn_gate_inp           (the router, [E, D])
    mlp.experts.X.gate_proj/up_proj/down_proj      ffn_gate/up/down_exps  (Mixtral: block_sparse_moe.experts.X.w1/w3/w2)
    mlp.shared_expert.gate_proj/up_proj/down_proj  ffn_gate/up/down_shexp (qwen2moe)
    mlp.shared_expert_gate                         ffn_gate_inp_shexp     (qwen2moe, [1, D])

What changes on the way:

- llama (and Mixtral): Hugging Face rotates the two halves of each head (``rotate_half``), llama.cpp's
  llama rotates adjacent pairs, so the rows of q and k are permuted per head from
  [x0..x(d/2-1), y0..] to [x0, y0, x1, y1, ...] (``permute``). Llama 3's ``rope_type: llama3``
  becomes the ``rope_freqs`` tensor of per-pair frequency divisors;
- gemma2/gemma3: their RMSNorm multiplies by ``1 + w``, so every norm weight gets +1; gemma2's
  output is always the embedding (``lm_head`` is never written); attention and final logit
  softcaps, the sliding window and which layers slide (``layer_types``) become keys;
- phi3: q/k/v and gate/up are already fused in both formats; LongRoPE's ``long_factor`` and
  ``short_factor`` become ``rope_factors_long/short`` and its attention factor a key;
- olmo2: no norm before attention or the FFN, norms after both; olmo2 and olmoe norm q and k over
  the whole projection (all heads), qwen3 and qwen3moe per head;
- experts: each layer's E expert matrices are stacked into one [E, rows, cols] tensor per projection
  (``Piece``: where each checkpoint tensor goes); transformers 5's fused ``mlp.experts.gate_up_proj``
  [E, 2F, D] splits into gate (first F rows) and up. Keys: expert_count, expert_used_count, and
  qwen2moe/qwen3moe's expert_feed_forward_length (``moe_intermediate_size``), qwen2moe's
  expert_shared_feed_forward_length.

Anything the GGUF file cannot say (a q·k scale that llama.cpp would not use, a sliding window
on qwen2 or Mixtral layers, biases the decoder has no place for, dense layers among the experts'
ones, a top-k renormalisation other than llama.cpp's) is an error naming the config key.
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Callable

import numpy as np


class HFConfig:
    """config.json, read with errors that name the file and the key."""

    def __init__(self, data: dict, path: Path):
        self.data, self.path = data, path
        self.rope = _rope_parameters(data)

    def get(self, key: str, default=None):
        return self.data.get(key, default) if self.data.get(key) is not None else default

    def int(self, key: str, default: int | None = None) -> int:
        """A positive integer; required unless a default is given."""
        v = self.get(key, default)
        if v is None:
            raise ValueError(f"{self.path}: {key} is missing")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{self.path}: {key} = {v!r} must be a positive integer")
        return v

    def float(self, key: str, default: float | None = None) -> float:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{self.path}: {key} = {v!r} must be a number greater than 0")
        return float(v)

    # the geometry every family shares
    @property
    def n_embd(self) -> int:
        return self.int("hidden_size")

    @property
    def n_layer(self) -> int:
        return self.int("num_hidden_layers")

    @property
    def n_head(self) -> int:
        return self.int("num_attention_heads")

    @property
    def n_head_kv(self) -> int:
        return self.int("num_key_value_heads", self.n_head)

    @property
    def head_dim(self) -> int:
        return self.int("head_dim", self.n_embd // self.n_head)

    @property
    def n_ff(self) -> int:
        return self.int("intermediate_size")

    @property
    def n_vocab(self) -> int:
        return self.int("vocab_size")

    @property
    def n_expert(self) -> int:
        """The routed experts of each layer (Mixtral's and transformers 5's num_local_experts, else num_experts)."""
        key = next((k for k in ("num_local_experts", "num_experts") if self.get(k) is not None), None)
        if key is None:
            raise ValueError(f"{self.path}: num_local_experts (or num_experts) is missing")
        return self.int(key)

    @property
    def n_expert_used(self) -> int:
        return self.int("num_experts_per_tok")

    @property
    def rope_full(self) -> dict:
        """The rope parameters of the global (full-attention) layers."""
        return self.rope.get("full_attention", self.rope)


def _rope_parameters(data: dict) -> dict:
    """transformers 5's ``rope_parameters`` (or 4's ``rope_scaling``), with the top-level rope_theta,
    local theta, type, partial rotary factor and original context folded in, as llama.cpp reads them."""
    params = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
    if "full_attention" in params or "sliding_attention" in params:
        return params
    local = next((data[k] for k in ("local_rope_theta", "rope_local_base_freq") if data.get(k) is not None), None)
    if local is not None:
        params["sliding_attention"] = {"rope_theta": local}
    folded = {"rope_theta": data.get("rope_theta"), "rope_type": params.get("type"),
              "partial_rotary_factor": data.get("partial_rotary_factor"),
              "original_max_position_embeddings": data.get("original_max_position_embeddings")}
    return params | {k: v for k, v in folded.items() if k not in params and v is not None}


# ---------------------------------------------------------------- metadata

def common_keys(cfg: HFConfig) -> dict:
    """The ``<arch>.*`` keys every family writes (llama.cpp's TextModel.set_gguf_parameters)."""
    keys = {"block_count": cfg.n_layer, "context_length": cfg.int("max_position_embeddings"),
            "embedding_length": cfg.n_embd, "feed_forward_length": cfg.n_ff,
            "attention.head_count": cfg.n_head, "attention.head_count_kv": cfg.n_head_kv,
            "attention.layer_norm_rms_epsilon": cfg.float("rms_norm_eps")}
    if cfg.get("head_dim") is not None:
        keys |= {"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim}
    keys |= rope_keys(cfg)
    return keys


def rope_keys(cfg: HFConfig) -> dict:
    """rope.freq_base (and _swa for sliding layers), and the scaling of the global layers."""
    full, keys = cfg.rope_full, {}
    if full.get("rope_theta") is not None:
        keys["rope.freq_base"] = float(full["rope_theta"])
    local = cfg.rope.get("sliding_attention", {}).get("rope_theta")
    if local is not None:
        keys["rope.freq_base_swa"] = float(local)
    kind, factor = full.get("rope_type") or "default", full.get("factor")
    if kind == "linear" and factor is not None:
        keys |= {"rope.scaling.type": "linear", "rope.scaling.factor": float(factor)}
    elif kind == "yarn" and factor is not None:
        orig = full.get("original_max_position_embeddings")
        if orig is None:
            raise ValueError(f"{cfg.path}: yarn rope scaling needs original_max_position_embeddings")
        keys |= {"rope.scaling.type": "yarn", "rope.scaling.factor": float(factor),
                 "rope.scaling.original_context_length": int(orig)}
        for hf, key in (("extrapolation_factor", "yarn_ext_factor"), ("attention_factor", "yarn_attn_factor"),
                        ("attn_factor", "yarn_attn_factor"), ("beta_fast", "yarn_beta_fast"),
                        ("beta_slow", "yarn_beta_slow")):
            if full.get(hf) is not None:
                keys.setdefault(f"rope.scaling.{key}", float(full[hf]))
    elif kind in ("su", "longrope"):
        keys["rope.scaling.type"] = "longrope"
    elif kind not in ("default", "llama3", "linear", "yarn"):
        raise ValueError(f"{cfg.path}: rope_type {kind!r} is not supported (default, linear, yarn, longrope, llama3)")
    return keys


def _check_activation(cfg: HFConfig, allowed: tuple[str, ...]) -> None:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act is not None and act not in allowed:
        raise ValueError(f"{cfg.path}: hidden_act {act!r} is not supported for this family ({', '.join(allowed)})")


def llama_keys(cfg: HFConfig) -> dict:
    _check_activation(cfg, ("silu",))
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"{cfg.path}: {key} = true is not supported (the decoder has no place for those biases)")
    return common_keys(cfg) | {"vocab_size": cfg.n_vocab, "rope.dimension_count": cfg.head_dim}


def qwen2_keys(cfg: HFConfig) -> dict:
    _check_activation(cfg, ("silu",))
    sliding = [i for i, t in enumerate(cfg.get("layer_types") or []) if t == "sliding_attention"]
    if cfg.get("use_sliding_window") and sliding:
        raise ValueError(f"{cfg.path}: use_sliding_window = true (layers {sliding[0]}..{sliding[-1]}) is not "
                         f"supported: llama.cpp's qwen2 attends to the whole context")
    return common_keys(cfg)


def phi3_keys(cfg: HFConfig) -> dict:
    _check_activation(cfg, ("silu",))
    keys = common_keys(cfg)
    keys.pop("attention.key_length", None)
    keys.pop("attention.value_length", None)
    orig = cfg.rope_full.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if orig is None:
        raise ValueError(f"{cfg.path}: phi3 needs original_max_position_embeddings")
    keys |= {"rope.dimension_count": phi3_rope_dims(cfg), "rope.scaling.original_context_length": int(orig),
             "attention.sliding_window": int(cfg.get("sliding_window", 0))}    # llama.cpp ignores it
    if cfg.rope_full.get("long_factor"):
        keys["rope.scaling.attn_factor"] = _longrope_attn_factor(cfg, int(orig))
    return keys


def phi3_rope_dims(cfg: HFConfig) -> int:
    return int(float(cfg.rope_full.get("partial_rotary_factor", 1.0)) * cfg.n_embd) // cfg.n_head


def _longrope_attn_factor(cfg: HFConfig, orig: int) -> float:
    """The cos/sin multiplier of a context stretched ``scale`` times: sqrt(1 + ln scale / ln orig)."""
    scale = cfg.int("max_position_embeddings") / orig
    kind = cfg.rope_full.get("rope_type")
    if kind in ("su", "longrope"):
        return math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    if kind == "yarn":
        return 0.1 * math.log(scale) + 1.0 if scale > 1 else 1.0
    raise ValueError(f"{cfg.path}: long_factor given with rope_type {kind!r} (longrope or yarn expected)")


def gemma_keys(cfg: HFConfig, big_layers: int, default_pattern: int) -> dict:
    """gemma2/gemma3: softcaps, the window and which layers slide, and a check that the q·k scale
    (``query_pre_attn_scalar``) is the one llama.cpp uses: 1/sqrt(head_dim), or 1/sqrt(n_embd/n_head)
    for the 27B (``big_layers`` layers)."""
    _check_activation(cfg, ("gelu_pytorch_tanh", "gelu_tanh"))
    keys = common_keys(cfg) | {"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim}
    scalar = cfg.float("query_pre_attn_scalar", cfg.head_dim)
    used = cfg.n_embd / cfg.n_head if cfg.n_layer == big_layers else cfg.head_dim
    if not math.isclose(scalar, used, rel_tol=1e-6):
        raise ValueError(f"{cfg.path}: query_pre_attn_scalar = {scalar:g} scales q·k by 1/sqrt({scalar:g}), but "
                         f"llama.cpp scales a {cfg.n_layer}-layer model by 1/sqrt({used:g}); no GGUF key says "
                         f"otherwise")
    if cfg.get("final_logit_softcapping"):
        keys["final_logit_softcapping"] = float(cfg.get("final_logit_softcapping"))
    sliding = swa_flags(cfg, default_pattern)
    if any(sliding):
        keys |= {"attention.sliding_window": cfg.int("sliding_window"),
                 "attention.sliding_window_pattern": list(sliding)}
    return keys


def swa_flags(cfg: HFConfig, default_pattern: int) -> tuple[bool, ...]:
    """Per layer, whether it slides: ``layer_types``, else the period ``sliding_window_pattern``
    (layer i slides iff i % n < n - 1)."""
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != cfg.n_layer:
            raise ValueError(f"{cfg.path}: layer_types has {len(types)} entries for {cfg.n_layer} layers")
        return tuple(t == "sliding_attention" for t in types)
    n = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", default_pattern)))
    return tuple(n == 0 or i % n < n - 1 for i in range(cfg.n_layer))


def gemma2_keys(cfg: HFConfig) -> dict:
    if cfg.get("tie_word_embeddings") is False:
        raise ValueError(f"{cfg.path}: tie_word_embeddings = false is not supported for gemma2 (llama.cpp's "
                         f"gemma2 always uses the embedding as the output)")
    keys = gemma_keys(cfg, 46, 2)
    keys["attention.sliding_window"] = cfg.int("sliding_window", 4096)       # gemma2 always has one
    keys["attention.sliding_window_pattern"] = list(swa_flags(cfg, 2))
    keys["attn_logit_softcapping"] = cfg.float("attn_logit_softcapping", 50.0)
    keys["final_logit_softcapping"] = cfg.float("final_logit_softcapping", 30.0)
    return keys


def gemma3_keys(cfg: HFConfig) -> dict:
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{cfg.path}: attn_logit_softcapping is set, which llama.cpp's gemma3 does not apply")
    return gemma_keys(cfg, 62, 6)


def _no_biases(cfg: HFConfig, *keys: str) -> None:
    for key in keys:
        if cfg.get(key):
            raise ValueError(f"{cfg.path}: {key} = true is not supported (the decoder has no place for those biases)")


def qwen3_keys(cfg: HFConfig) -> dict:
    _no_biases(cfg, "attention_bias")
    return qwen2_keys(cfg)


def olmo2_keys(cfg: HFConfig) -> dict:
    """OLMo 2; OLMo 3's sliding-window layers (``sliding_window``) are refused, as ggraph's olmo2 refuses them."""
    _check_activation(cfg, ("silu",))
    _no_biases(cfg, "attention_bias")
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"{cfg.path}: clip_qkv = {cfg.get('clip_qkv')!r} is not supported (no GGUF key of olmo2 "
                         f"clamps q, k and v)")
    if cfg.get("sliding_window") is not None:
        raise ValueError(f"{cfg.path}: sliding_window = {cfg.get('sliding_window')!r} (OLMo 3's sliding-window "
                         f"layers) is not supported yet")
    return common_keys(cfg)


def expert_keys(cfg: HFConfig, arch: str, renormalised: bool | None) -> dict:
    """expert_count and expert_used_count, after checking what the GGUF file cannot say: dense layers among
    the sparse ones, and top-k weights renormalised (``norm_topk_prob``) other than ``arch`` does it in
    llama.cpp (None: transformers always does, as llama.cpp)."""
    n, used = cfg.n_expert, cfg.n_expert_used
    if used > n:
        raise ValueError(f"{cfg.path}: num_experts_per_tok = {used} is more than the {n} experts")
    dense = cfg.get("mlp_only_layers") or []
    if dense or cfg.int("decoder_sparse_step", 1) != 1:
        what = f"mlp_only_layers = {dense}" if dense else f"decoder_sparse_step = {cfg.get('decoder_sparse_step')}"
        raise ValueError(f"{cfg.path}: {what} makes dense layers among the experts' ones, which llama.cpp's {arch} "
                         f"does not have")
    norm = cfg.data.get("norm_topk_prob")
    if renormalised is not None and norm is not None and bool(norm) != renormalised:
        does = "always renormalises" if renormalised else "does not renormalise"
        raise ValueError(f"{cfg.path}: norm_topk_prob = {str(bool(norm)).lower()} is not supported: llama.cpp's "
                         f"{arch} {does} the chosen experts' weights")
    return {"expert_count": n, "expert_used_count": used}


def qwen3moe_keys(cfg: HFConfig) -> dict:
    return (qwen3_keys(cfg) | expert_keys(cfg, "qwen3moe", True)
            | {"expert_feed_forward_length": cfg.int("moe_intermediate_size")})


def olmoe_keys(cfg: HFConfig) -> dict:
    """OLMoE: llama.cpp writes its rms epsilon as 1e-5 (OLMoE's), ggraph the config's."""
    return olmo2_keys(cfg) | expert_keys(cfg, "olmoe", False)


def qwen2moe_keys(cfg: HFConfig) -> dict:
    if cfg.data.get("qkv_bias") is False:
        raise ValueError(f"{cfg.path}: qkv_bias = false is not supported (llama.cpp's qwen2moe has q, k and v biases)")
    return (qwen2_keys(cfg) | expert_keys(cfg, "qwen2moe", False)
            | {"expert_feed_forward_length": cfg.int("moe_intermediate_size"),
               "expert_shared_feed_forward_length": cfg.int("shared_expert_intermediate_size")})


def mixtral_keys(cfg: HFConfig) -> dict:
    """Mixtral is llama with experts (llama.expert_count); transformers renormalises its top-k weights, as
    llama.cpp does."""
    if cfg.get("sliding_window") is not None:
        raise ValueError(f"{cfg.path}: sliding_window = {cfg.get('sliding_window')} is not supported: llama.cpp's "
                         f"llama attends to the whole context")
    return llama_keys(cfg) | expert_keys(cfg, "llama", None)


# ---------------------------------------------------------------- tensors

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# an expert's matrices (model.layers.N.<experts>.experts.X.<name>.weight) -> the stacked GGUF tensor
_EXPERT_WEIGHTS = {"mlp": {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"},
                   "block_sparse_moe": {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
UNUSED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Where one Hugging Face tensor goes: GGUF tensor ``name`` whole, or as expert ``expert`` of a stack
    [E, rows, cols], or as ``half`` 0 (gate) or 1 (up) of a fused gate_up_proj [E, 2F, D]."""
    name: str
    expert: int | None = None
    half: int | None = None


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face architecture and how it becomes a GGUF one."""
    hf_arch: str                          # config.json "architectures"[0]
    arch: str                             # GGUF general.architecture
    keys: Callable[[HFConfig], dict]      # the <arch>.* keys, without the prefix
    post_attention_layernorm: str = "ffn_norm"   # what HF's post_attention_layernorm is here
    norm_shift: float = 0.0               # added to every norm weight (gemma: 1)
    permute_qk: bool = False              # llama: halves -> interleaved pairs in q and k
    writes_lm_head: bool = True           # gemma2: never, the output is the embedding
    qkv_bias: bool = False                # qwen2, qwen2moe
    fused: bool = False                   # phi3: attn_qkv and a gate|up ffn_up
    qk_norm: str | None = None            # "head": a norm of head_dim (gemma3, qwen3); "full": q, k whole (olmo)
    pre_norms: bool = True                # olmo2: no norm before attention and the FFN
    post_norms: bool = False              # gemma2, gemma3, olmo2
    experts: str | None = None            # the MoE block's HF name ("mlp"; Mixtral's "block_sparse_moe"); None: dense
    expert_width: str = "intermediate_size"   # the config key of each expert's FFN width
    shared_expert: bool = False           # qwen2moe: a shared expert under a sigmoid gate

    def _parts(self) -> dict[str, str]:
        """HF block part -> GGUF block part; this family's own come first, which ``hf_name`` takes."""
        own = {"post_attention_layernorm": self.post_attention_layernorm}
        if self.fused:
            own["mlp.gate_up_proj"] = "ffn_up"
        if self.experts:
            own[f"{self.experts}.gate"] = "ffn_gate_inp"
        return own | {k: v for k, v in _BLOCK.items() if k not in own}

    def pieces(self, hf: str) -> list[Piece]:
        """Where Hugging Face tensor ``hf`` goes: one expert's matrix to its place in a stack, a fused
        gate_up_proj to two stacks, anything else whole (``gguf_name``)."""
        m = _LAYER.fullmatch(hf)
        if m and self.experts:
            blk, names = f"blk.{m[1]}.", _EXPERT_WEIGHTS[self.experts]
            one = re.fullmatch(rf"{self.experts}\.experts\.(\d+)\.(\w+)\.weight", m[2])
            if one and one[2] in names:
                return [Piece(f"{blk}{names[one[2]]}.weight", expert=int(one[1]))]
            fused = re.fullmatch(rf"{self.experts}\.experts\.(gate_up_proj|down_proj)(\.weight)?", m[2])
            if fused and fused[1] == "down_proj":
                return [Piece(f"{blk}ffn_down_exps.weight")]
            if fused:
                return [Piece(f"{blk}ffn_gate_exps.weight", half=0), Piece(f"{blk}ffn_up_exps.weight", half=1)]
        return [Piece(self.gguf_name(hf))]

    def gguf_name(self, hf: str) -> str:
        """The GGUF name of a Hugging Face tensor; ValueError for one this family does not have."""
        stem, _, suffix = hf.rpartition(".")
        if suffix in ("weight", "bias"):
            if stem in _GLOBAL:
                return f"{_GLOBAL[stem]}.{suffix}"
            m = _LAYER.fullmatch(stem)
            part = self._parts().get(m[2]) if m else None
            if part is not None:
                return f"blk.{m[1]}.{part}.{suffix}"
        raise ValueError(f"cannot map tensor {hf!r} of a {self.hf_arch} to a GGUF name")

    def hf_name(self, gguf: str, expert: int | None = None) -> str:
        """The Hugging Face tensor this family reads GGUF tensor ``gguf`` (or its expert ``expert``) from."""
        stem, _, suffix = gguf.rpartition(".")
        for hf, name in _GLOBAL.items():
            if stem == name:
                return f"{hf}.{suffix}"
        _, layer, part = stem.split(".", 2)
        if expert is not None:
            weight = next(w for w, p in _EXPERT_WEIGHTS[self.experts].items() if p == part)
            return f"model.layers.{layer}.{self.experts}.experts.{expert}.{weight}.{suffix}"
        hf = next(h for h, p in self._parts().items() if p == part)
        return f"model.layers.{layer}.{hf}.{suffix}"

    def transform(self, cfg: HFConfig, name: str, x: np.ndarray) -> np.ndarray:
        """The float32 data of GGUF tensor ``name`` from its Hugging Face data ``x``."""
        if self.permute_qk and re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", name):
            x = permute(x, cfg.n_head if ".attn_q." in name else cfg.n_head_kv)
        if self.norm_shift and name.endswith("norm.weight"):
            x = x + np.float32(self.norm_shift)
        return x

    def expected(self, cfg: HFConfig) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor the GGUF file must have, by GGUF name, with its numpy shape (an expert
        stack's is [E, rows, cols])."""
        d, dh, ff, v = cfg.n_embd, cfg.head_dim, cfg.n_ff, cfg.n_vocab
        nq, nkv = cfg.n_head * dh, cfg.n_head_kv * dh
        shapes = {"token_embd.weight": (v, d), "output_norm.weight": (d,)}
        if self.writes_lm_head and cfg.get("tie_word_embeddings") is False:
            shapes["output.weight"] = (v, d)
        for i in range(cfg.n_layer):
            b = f"blk.{i}."
            if self.pre_norms:
                shapes[b + "attn_norm.weight"] = (d,)
            if self.fused:
                shapes[b + "attn_qkv.weight"] = (nq + 2 * nkv, d)
            else:
                shapes |= {b + "attn_q.weight": (nq, d), b + "attn_k.weight": (nkv, d), b + "attn_v.weight": (nkv, d)}
            if self.qkv_bias:
                shapes |= {b + "attn_q.bias": (nq,), b + "attn_k.bias": (nkv,), b + "attn_v.bias": (nkv,)}
            if self.qk_norm:
                full = self.qk_norm == "full"
                shapes |= {b + "attn_q_norm.weight": (nq if full else dh,),
                           b + "attn_k_norm.weight": (nkv if full else dh,)}
            shapes[b + "attn_output.weight"] = (d, nq)
            if self.post_norms:
                shapes[b + "post_attention_norm.weight"] = (d,)
            if self.pre_norms:
                shapes[b + "ffn_norm.weight"] = (d,)
            shapes |= self._ffn(cfg, b)
            if self.post_norms:
                shapes[b + "post_ffw_norm.weight"] = (d,)
        return shapes

    def _ffn(self, cfg: HFConfig, b: str) -> dict[str, tuple[int, ...]]:
        """One layer's FFN: gate, up (phi3: gate|up) and down, or a router, expert stacks and a shared expert."""
        d, ff = cfg.n_embd, cfg.n_ff
        if not self.experts:
            if self.fused:
                return {b + "ffn_up.weight": (2 * ff, d), b + "ffn_down.weight": (d, ff)}
            return {b + "ffn_gate.weight": (ff, d), b + "ffn_up.weight": (ff, d), b + "ffn_down.weight": (d, ff)}
        e, fe = cfg.n_expert, cfg.int(self.expert_width)
        shapes = {b + "ffn_gate_inp.weight": (e, d), b + "ffn_gate_exps.weight": (e, fe, d),
                  b + "ffn_up_exps.weight": (e, fe, d), b + "ffn_down_exps.weight": (e, d, fe)}
        if self.shared_expert:
            fs = cfg.int("shared_expert_intermediate_size")
            shapes |= {b + "ffn_gate_inp_shexp.weight": (1, d), b + "ffn_gate_shexp.weight": (fs, d),
                       b + "ffn_up_shexp.weight": (fs, d), b + "ffn_down_shexp.weight": (d, fs)}
        return shapes

    def optional(self, cfg: HFConfig) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensors the file may have: the output of a model whose embedding is tied."""
        if self.writes_lm_head and cfg.get("tie_word_embeddings") is not False:
            return {"output.weight": (cfg.n_vocab, cfg.n_embd)}
        return {}

    def generated(self, cfg: HFConfig) -> dict[str, np.ndarray]:
        """Tensors made from config.json: llama 3's rope_freqs, phi3's LongRoPE factors."""
        full = cfg.rope_full
        if self.arch == "llama" and (full.get("rope_type") or "").lower() == "llama3":
            return {"rope_freqs.weight": llama3_rope_freqs(full, cfg.head_dim)}
        if self.arch == "phi3" and full.get("long_factor"):
            half = phi3_rope_dims(cfg) // 2
            out = {}
            for kind in ("long", "short"):
                f = np.asarray(full.get(f"{kind}_factor") or [], np.float32)
                if f.shape != (half,):
                    raise ValueError(f"{cfg.path}: rope {kind}_factor has {f.size} values; the rotary dims "
                                     f"({phi3_rope_dims(cfg)}) need {half}")
                out[f"rope_factors_{kind}.weight"] = f
            return out
        return {}


def permute(x: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of each head from [first half | second half] to interleaved pairs (llama's rope layout)."""
    return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """Llama 3.1's per-pair divisors: 1 for short wavelengths, ``factor`` for long ones, a smooth
    ramp between (``low_freq_factor``, ``high_freq_factor`` of ``original_max_position_embeddings``)."""
    base, factor = float(rope.get("rope_theta", 10000.0)), float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    orig = float(rope.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    ramp = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, ramp)).astype(np.float32)


FAMILIES = {f.hf_arch: f for f in (
    Family("LlamaForCausalLM", "llama", llama_keys, permute_qk=True),
    Family("Qwen2ForCausalLM", "qwen2", qwen2_keys, qkv_bias=True),
    Family("Phi3ForCausalLM", "phi3", phi3_keys, fused=True),
    Family("Gemma2ForCausalLM", "gemma2", gemma2_keys, post_attention_layernorm="post_attention_norm",
           norm_shift=1.0, writes_lm_head=False, post_norms=True),
    Family("Gemma3ForCausalLM", "gemma3", gemma3_keys, post_attention_layernorm="post_attention_norm",
           norm_shift=1.0, qk_norm="head", post_norms=True),
    Family("Qwen3ForCausalLM", "qwen3", qwen3_keys, qk_norm="head"),
    Family("Olmo2ForCausalLM", "olmo2", olmo2_keys, post_attention_layernorm="post_attention_norm", qk_norm="full",
           pre_norms=False, post_norms=True),
    Family("Qwen3MoeForCausalLM", "qwen3moe", qwen3moe_keys, qk_norm="head", experts="mlp",
           expert_width="moe_intermediate_size"),
    Family("OlmoeForCausalLM", "olmoe", olmoe_keys, qk_norm="full", experts="mlp"),
    Family("Qwen2MoeForCausalLM", "qwen2moe", qwen2moe_keys, qkv_bias=True, experts="mlp",
           expert_width="moe_intermediate_size", shared_expert=True),
    Family("MixtralForCausalLM", "llama", mixtral_keys, permute_qk=True, experts="block_sparse_moe"),
)}


def family(cfg: HFConfig) -> Family:
    """The family config.json's ``architectures`` names; ValueError listing the supported ones."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ValueError(f"{cfg.path}: no architectures list (supported: {', '.join(FAMILIES)})")
    if archs[0] not in FAMILIES:
        raise ValueError(f"{cfg.path}: architecture {archs[0]!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[archs[0]]
