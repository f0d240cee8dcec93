"""The five families ``ggraph convert`` reads: each one's config.json as GGUF ``<arch>.*`` keys, and
its Hugging Face tensors as GGUF tensors, following llama.cpp's ``convert_hf_to_gguf.py``.

Tensor names (the decoder blocks are ``model.layers.N.*`` -> ``blk.N.*``)::

    model.embed_tokens          token_embd         self_attn.q_proj/k_proj/v_proj/o_proj  attn_q/k/v/output
    model.norm                  output_norm        self_attn.qkv_proj (phi3)              attn_qkv
    lm_head                     output             self_attn.q_norm/k_norm (gemma3)       attn_q_norm/k_norm
    input_layernorm             attn_norm          mlp.gate_proj/up_proj/down_proj        ffn_gate/up/down
    post_attention_layernorm    ffn_norm           mlp.gate_up_proj (phi3)                ffn_up
      (gemma: post_attention_norm)                 pre_/post_feedforward_layernorm (gemma) ffn_norm/post_ffw_norm

What changes on the way:

- llama: Hugging Face rotates the two halves of each head (``rotate_half``), llama.cpp's llama
  rotates adjacent pairs, so the rows of q and k are permuted per head from
  [x0..x(d/2-1), y0..] to [x0, y0, x1, y1, ...] (``permute``). Llama 3's ``rope_type: llama3``
  becomes the ``rope_freqs`` tensor of per-pair frequency divisors;
- gemma2/gemma3: their RMSNorm multiplies by ``1 + w``, so every norm weight gets +1; gemma2's
  output is always the embedding (``lm_head`` is never written); attention and final logit
  softcaps, the sliding window and which layers slide (``layer_types``) become keys;
- phi3: q/k/v and gate/up are already fused in both formats; LongRoPE's ``long_factor`` and
  ``short_factor`` become ``rope_factors_long/short`` and its attention factor a key.

Anything the GGUF file cannot say (a q·k scale that llama.cpp would not use, a sliding window
on qwen2 layers, biases the decoder has no place for) is an error naming the config key.
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


# ---------------------------------------------------------------- tensors

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
UNUSED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")


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
    qkv_bias: bool = False                # qwen2
    fused: bool = False                   # phi3: attn_qkv and a gate|up ffn_up
    qk_norm: bool = False                 # gemma3
    post_norms: bool = False              # gemma2, gemma3

    def gguf_name(self, hf: str) -> str:
        """The GGUF name of a Hugging Face tensor; ValueError for one this family does not have."""
        stem, _, suffix = hf.rpartition(".")
        if suffix in ("weight", "bias"):
            if stem in _GLOBAL:
                return f"{_GLOBAL[stem]}.{suffix}"
            m = _LAYER.fullmatch(stem)
            if m:
                part = self.post_attention_layernorm if m[2] == "post_attention_layernorm" else _BLOCK.get(m[2])
                if part is not None:
                    return f"blk.{m[1]}.{part}.{suffix}"
        raise ValueError(f"cannot map tensor {hf!r} of a {self.hf_arch} to a GGUF name")

    def hf_name(self, gguf: str) -> str:
        """The Hugging Face tensor this family reads GGUF tensor ``gguf`` from (``gguf_name`` backwards)."""
        stem, _, suffix = gguf.rpartition(".")
        for hf, name in _GLOBAL.items():
            if stem == name:
                return f"{hf}.{suffix}"
        _, layer, part = stem.split(".", 2)
        if part == self.post_attention_layernorm:
            return f"model.layers.{layer}.post_attention_layernorm.{suffix}"
        fused_up = "mlp.gate_up_proj" if self.fused else "mlp.up_proj"
        hf = next(h for h, p in _BLOCK.items() if p == part and (p != "ffn_up" or h == fused_up))
        return f"model.layers.{layer}.{hf}.{suffix}"

    def transform(self, cfg: HFConfig, name: str, x: np.ndarray) -> np.ndarray:
        """The float32 data of GGUF tensor ``name`` from its Hugging Face data ``x``."""
        if self.permute_qk and re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", name):
            x = permute(x, cfg.n_head if ".attn_q." in name else cfg.n_head_kv)
        if self.norm_shift and name.endswith("norm.weight"):
            x = x + np.float32(self.norm_shift)
        return x

    def expected(self, cfg: HFConfig) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor the GGUF file must have, by GGUF name, with its numpy shape."""
        d, dh, ff, v = cfg.n_embd, cfg.head_dim, cfg.n_ff, cfg.n_vocab
        nq, nkv = cfg.n_head * dh, cfg.n_head_kv * dh
        shapes = {"token_embd.weight": (v, d), "output_norm.weight": (d,)}
        if self.writes_lm_head and cfg.get("tie_word_embeddings") is False:
            shapes["output.weight"] = (v, d)
        for i in range(cfg.n_layer):
            b = f"blk.{i}."
            shapes[b + "attn_norm.weight"] = (d,)
            if self.fused:
                shapes[b + "attn_qkv.weight"] = (nq + 2 * nkv, d)
                shapes[b + "ffn_up.weight"] = (2 * ff, d)
            else:
                shapes |= {b + "attn_q.weight": (nq, d), b + "attn_k.weight": (nkv, d), b + "attn_v.weight": (nkv, d),
                           b + "ffn_gate.weight": (ff, d), b + "ffn_up.weight": (ff, d)}
            if self.qkv_bias:
                shapes |= {b + "attn_q.bias": (nq,), b + "attn_k.bias": (nkv,), b + "attn_v.bias": (nkv,)}
            if self.qk_norm:
                shapes |= {b + "attn_q_norm.weight": (dh,), b + "attn_k_norm.weight": (dh,)}
            if self.post_norms:
                shapes |= {b + "post_attention_norm.weight": (d,), b + "post_ffw_norm.weight": (d,)}
            shapes |= {b + "attn_output.weight": (d, nq), b + "ffn_norm.weight": (d,), b + "ffn_down.weight": (d, ff)}
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
           norm_shift=1.0, qk_norm=True, post_norms=True),
)}


def family(cfg: HFConfig) -> Family:
    """The family config.json's ``architectures`` names; ValueError listing the supported ones."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ValueError(f"{cfg.path}: no architectures list (supported: {', '.join(FAMILIES)})")
    if archs[0] not in FAMILIES:
        raise ValueError(f"{cfg.path}: architecture {archs[0]!r} is not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[archs[0]]
