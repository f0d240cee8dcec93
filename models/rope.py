"""Rope scaling: how each layer's rotary embedding turns positions into angles, as llama.cpp does it.

A layer rotates pair i of a head by ``theta_i = pos · scale · base^(-2i/dims) / f_i`` and multiplies
cos and sin by ``mscale``. The scaling types a GGUF file names (``<arch>.rope.scaling.type``):

- none: scale 1; linear (llama.cpp's default) and longrope: scale = 1 / ``rope.scaling.factor``;
- yarn: positions are not scaled; instead each pair's frequency mixes the interpolated and the
  extrapolated one by a ramp over the pairs (``original_context_length``, ``yarn_beta_fast``,
  ``yarn_beta_slow``), which becomes a per-pair factor f_i, and mscale grows by YaRN's
  magnitude correction. llama.cpp reads ``yarn_beta_fast``, ``yarn_beta_slow`` and
  ``yarn_log_multiplier`` only for other families (deepseek, grok, mistral3), so for ours they
  keep its defaults (32, 1, none) whatever the file says; an architecture plugin may set them;
- frequency factors from tensors divide f_i too: llama 3.1+'s ``rope_freqs.weight``, phi3's
  ``rope_factors_long/short.weight`` (long past the original context).

``rope.scaling.attn_factor`` multiplies mscale in every case. The formulas are ggml's
(``ggml_rope_yarn_corr_dims``, ``rope_yarn`` in ggml-cpu/ops.cpp) and llama.cpp's
(``llama_context`` for the attention factor).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

SCALING_TYPES = ("none", "linear", "yarn", "longrope")


@dataclasses.dataclass(frozen=True)
class LayerRope:
    """One layer's rope: its base, position scale, cos/sin multiplier, and per-pair factors (or None)."""
    base: float
    scale: float
    mscale: float
    factors: np.ndarray | None = None       # f32[dims/2], dividing each pair's frequency


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_corr_dims(dims: int, orig_ctx: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """The pair range YaRN ramps over: pairs below it extrapolate, pairs above it interpolate."""
    def corr_dim(n_rot):
        return dims * math.log(orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(base))
    start, end = math.floor(corr_dim(beta_fast)), math.ceil(corr_dim(beta_slow))
    return max(0, start), min(dims - 1, end)


def yarn_factors(dims: int, base: float, freq_scale: float, orig_ctx: int, beta_fast: float,
                 beta_slow: float) -> np.ndarray:
    """Per-pair divisors f_i with theta_i = theta_extrap_i / f_i = theta_extrap_i · (freq_scale·(1-r_i) + r_i)."""
    low, high = yarn_corr_dims(dims, orig_ctx, base, beta_fast, beta_slow)
    pairs = np.arange(dims // 2, dtype=np.float64)
    ramp = 1.0 - np.clip((pairs - low) / max(0.001, high - low), 0.0, 1.0)
    return (1.0 / (freq_scale * (1.0 - ramp) + ramp)).astype(np.float32)


def layer_rope(cfg, i: int) -> LayerRope:
    """Layer i's rope from the config, as llama.cpp builds it.

    Sliding-window layers may have a base and a scale of their own (gemma3: base 10000, scale 1);
    without one (gemma2) they take 1/factor whatever the scaling type, as llama.cpp's
    ``rope_freq_scale_train_swa`` does.
    """
    local = cfg.rope_base_local is not None and cfg.is_swa(i)
    base = cfg.rope_base_local if local else cfg.rope_base
    factor = cfg.rope_scaling_factor
    if local:
        freq_scale = cfg.rope_scale_local if cfg.rope_scale_local is not None else 1.0 / factor
    else:
        freq_scale = 1.0 if cfg.rope_scaling_type == "none" else 1.0 / factor
    if cfg.rope_scaling_type != "yarn":
        return LayerRope(base, freq_scale, cfg.rope_attn_factor)
    attn = _get_mscale(factor) / (_get_mscale(factor, cfg.yarn_log_mul) if cfg.yarn_log_mul else 1.0)
    attn /= 1.0 + 0.1 * math.log(factor)                 # llama.cpp cancels what ggml multiplies in below
    mscale = cfg.rope_attn_factor * attn * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    factors = yarn_factors(cfg.rope_dims, base, freq_scale, cfg.n_ctx_orig or cfg.n_ctx_train,
                           cfg.yarn_beta_fast, cfg.yarn_beta_slow)
    return LayerRope(base, 1.0, mscale, factors)
