"""Tiny random-weight GGUF models of each supported architecture, for tests against llama.cpp.

``write_model(path, arch, mix=..., seed=..., **overrides)`` writes one; ``cached_model`` writes it
once into a cache dir keyed by every argument and by this file's source. Quantised mixes are
made by llama.cpp's own ``llama_model_quantize``, so the per-tensor type choice (and its
fallbacks for widths that are not a multiple of 256) is the real one.

What llama.cpp (llama-cpp-python 0.3.36) reads for each arch, and what a faithful model must
mirror. Keys are ``<arch>.<key>``; paths are llama.cpp's ``src/``.

common (llama-model.cpp, llama_model_base::load_hparams)
  required: context_length, embedding_length, block_count; per-arch required
  attention.layer_norm_rms_epsilon. Optional: feed_forward_length, attention.head_count,
  attention.head_count_kv (default head_count), attention.key_length / value_length (default
  n_embd/n_head), rope.dimension_count (n_rot, default key_length), rope.freq_base (default
  10000), rope.scaling.* . rms_norm(x) = x / sqrt(mean(x^2) + eps), then * weight.
  Rope type is fixed per arch (llama_model_rope_type): NORM rotates pairs (2i, 2i+1); NEOX
  rotates (i, i + n_rot/2). Only the first n_rot dims of a head rotate; the rest pass through.
  theta_i = pos * base^(-2i/n_rot) / freq_factor[i]; cos and sin are multiplied by attn_factor
  (= rope.scaling.attn_factor, default 1).
  token_embd has one row per tokenizer.ggml.tokens entry; the tokenizer keys are copied
  from a vocab file in tests/data/vocab.
  Causal mask; a sliding-window layer also masks key p0 for query p1 when p1 - p0 >= n_swa
  (llama-hparams.h is_masked_swa): a query sees n_swa keys, itself included.
  SWA layers (llama-hparams.cpp set_swa_pattern, dense_first=false): layer il is sliding iff
  il % n_pattern < n_pattern - 1; attention.sliding_window_pattern may override n_pattern, or
  be a bool array with one flag per layer. SWA layers use rope base rope_freq_base_train_swa
  (llama-model.cpp get_rope_freq_base).

llama (models/llama.cpp): rope NORM. Separate attn_q/k/v, attn_output, ffn_gate/up/down,
  silu(gate) * up. output.weight optional (tied to token_embd when absent). n_rot must equal
  head_dim (load_hparams throws "invalid n_rot"). kq_scale = 1/sqrt(head_dim).
qwen2 (models/qwen2.cpp): rope NEOX. Like llama plus attn_q/k/v.bias (optional in the
  loader, always written here). attn_q is n_embd x n_embd, so n_head * head_dim == n_embd.
  output.weight optional (tied).
phi3 (models/phi3.cpp): rope NEOX. Fused blk.N.attn_qkv.weight rows = [q | k | v]
  (llama-graph.cpp build_qkv views at offsets 0, n_embd_q, n_embd_q + n_embd_k).
  ffn_up.weight has 2*n_ff rows = [gate | up]; ffn = down(silu(gate) * up) (ggml_swiglu, not
  swapped). Partial rotary is allowed: rope.dimension_count < head_dim (Phi-4-mini style).
  Optional global tensors rope_factors_long.weight / rope_factors_short.weight [n_rot/2]:
  llama-model.cpp get_rope_factors picks long when n_ctx_seq > rope.scaling.
  original_context_length (default context_length), else short. Q is scaled by
  1/sqrt(head_dim) before attention.
rope scaling (llama-context.cpp, ggml-cpu/ops.cpp rope_yarn): rope.scaling.type none | linear
  (default) | yarn | longrope, rope.scaling.factor f (freq_scale 1/f; "none" forces 1). yarn
  mixes interpolated and extrapolated frequencies by a ramp over pairs from
  ggml_rope_yarn_corr_dims(n_rot, original_context_length, base, 32, 1) and scales cos/sin by
  attn_factor * (1 + 0.1 ln f) / (1 + 0.1 ln f) * (1 + 0.1 ln(1/freq_scale_l)). llama only:
  rope_freqs.weight [n_rot/2] divides the frequencies. SWA layers: gemma2 keeps 1/f, gemma3 1. A phi3.attention.sliding_window key is ignored (SWA
  disabled in llama.cpp), so it is never written here. general.name must not contain "phi3"
  or "phi-3": llama-vocab.cpp then sets attributes on Phi-3 special tokens ("<|endoftext|>")
  and loading fails with the llama-spm vocab.
gemma2 (models/gemma2.cpp): rope NEOX. x = embd * sqrt(n_embd) (f32). Pre norm and
  post_attention_norm / post_ffw_norm: h = x + post_norm(attn(norm(x))), same for the ffn.
  ffn = down(gelu_tanh(gate) * up) (ggml's CPU gelu rounds its input to f16 and reads an f16
  table). Q scaled by 1/sqrt(key_length) (1/sqrt(n_embd/n_head) only when block_count == 46,
  the 27B). Attention scores: s = cap * tanh(s / cap) with attn_logit_softcapping (default
  50) before the mask and softmax. Final logits: cap * tanh(l / cap) with
  final_logit_softcapping (default 30; always applied). Sliding window default 4096,
  pattern 2: even layers slide, odd layers are global; SWA rope base = rope.freq_base_swa,
  default rope.freq_base. Output always tied to token_embd (output.weight is not read).
gemma3 (models/gemma3.cpp): rope NEOX. Like gemma2 but no attention softcap; final softcap
  only if final_logit_softcapping is present (default 0 = none); q/k RMS norms
  (attn_q_norm / attn_k_norm, [head_dim], same eps) applied per head before rope. SWA only
  if attention.sliding_window > 0; pattern 6 (layers 0-4 of every 6 slide, 5 is global).
  SWA layers use rope.freq_base_swa, default 10000 (llama-hparams.h; the real 270M file has
  no such key), global layers rope.freq_base. Q scaled by 1/sqrt(key_length) (27B, 62
  layers: 1/sqrt(n_embd/n_head)). output.weight optional (tied when absent, the default).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

VOCAB_DIR = Path(__file__).parent / "data" / "vocab"
VOCABS = {"llama-spm": "ggml-vocab-llama-spm.gguf", "qwen2": "ggml-vocab-qwen2.gguf", "gpt-2": "ggml-vocab-gpt-2.gguf"}

# llama.cpp ftype per mix; None means written directly by gguf-py
MIXES = {"f32": None, "f16": None, "q4_1": 3, "q8_0": 7, "q4_k_m": 15, "q5_k_m": 17}

# width presets for tests: k-quants appear only when rows are whole 256-blocks
K_QUANT_DIMS = dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64)
ODD_WIDTH_DIMS = dict(n_embd=320, n_ff=640, n_head=4, n_head_kv=2, head_dim=80)

_COMMON = dict(
    n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=None, n_ff=128, n_rot=None,
    n_ctx_train=4096, rms_eps=1e-6, rope_base=10000.0, tied=False, vocab="llama-spm",
    rope_scaling=None,   # dict(type=..., factor=..., orig_ctx=..., attn_factor=...): rope.scaling.* keys
)
ROPE_SCALING_KEYS = {"type": ("type", "STRING"), "factor": ("factor", "FLOAT32"),
                     "orig_ctx": ("original_context_length", "UINT32"), "attn_factor": ("attn_factor", "FLOAT32"),
                     "beta_fast": ("yarn_beta_fast", "FLOAT32"), "beta_slow": ("yarn_beta_slow", "FLOAT32")}

# per-arch defaults; a key listed here is an override the arch accepts
ARCHS = {
    "llama": dict(_COMMON, rope_freqs=False),       # llama 3.1+'s rope_freqs.weight
    "qwen2": dict(_COMMON, rope_base=1e6, tied=True, vocab="qwen2"),
    "phi3": dict(_COMMON, rope_factors=False, rope_orig_ctx=256, rope_attn_factor=1.2),
    "gemma2": dict(_COMMON, n_layer=4, head_dim=32, tied=True, sliding_window=8,
                   swa_pattern=None, rope_base_swa=None, attn_softcap=2.0, final_softcap=3.0),
    "gemma3": dict(_COMMON, n_layer=6, head_dim=32, rope_base=1e6, tied=True, sliding_window=8,
                   swa_pattern=None, rope_base_swa=None, final_softcap=None),
}

# Real models' shapes, narrowed: each keeps its model's head dim, GQA ratio, FFN ratio, tied or untied
# output, biases, window pattern and rope scaling, with fewer heads, layers and contexts (windows and
# original contexts shrink with them, so that a 100-token prompt runs past both). Widths that real
# models leave off 256-blocks stay off them, so llama.cpp's q4_k_m picks the same fallbacks.
REAL_SHAPES = {
    # Llama 3.2 1B: GQA 4:1, head 64, tied, a BPE vocab, Llama 3.1's rope_freqs, base 500000
    "llama-3.2": ("llama", dict(n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_ff=2048, n_layer=2, tied=True,
                                vocab="gpt-2", rope_base=500000.0, rope_freqs=True, n_ctx_train=131072)),
    # Qwen2.5 0.5B: GQA 7:1, head 64, q/k/v biases, tied, 896-wide (off 256-blocks), yarn 4x
    "qwen2.5": ("qwen2", dict(n_embd=448, n_head=7, n_head_kv=1, head_dim=64, n_ff=2432, n_layer=2, tied=True,
                              vocab="llama-spm", rope_base=1e6, n_ctx_train=128,
                              rope_scaling=dict(type="yarn", factor=4.0, orig_ctx=32))),
    # Phi-3.5 mini: no GQA, head 96 fully rotated, untied, LongRoPE long/short factors, attn factor 1.19
    "phi-3.5": ("phi3", dict(n_embd=384, n_head=4, n_head_kv=4, head_dim=96, n_rot=96, n_ff=1024, n_layer=2,
                             rope_factors=True, rope_orig_ctx=64, rope_attn_factor=1.19, n_ctx_train=1024)),
    # Gemma 2 2B: GQA 2:1, head 256 (wider than n_embd / n_head), softcaps 50 / 30, window every other layer
    "gemma-2": ("gemma2", dict(n_embd=256, n_head=2, n_head_kv=1, head_dim=256, n_ff=1024, n_layer=4,
                               sliding_window=32, attn_softcap=50.0, final_softcap=30.0, n_ctx_train=8192)),
    # Gemma 3 4B: GQA 2:1, head 256, q/k norms, 5 local : 1 global, local base 10000, global linear 8x
    "gemma-3": ("gemma3", dict(n_embd=256, n_head=2, n_head_kv=1, head_dim=256, n_ff=1024, n_layer=6,
                               sliding_window=32, rope_base=1e6, rope_base_swa=10000.0, n_ctx_train=131072,
                               rope_scaling=dict(type="linear", factor=8.0))),
}

# layer structure per arch: the flags a decoder needs
FEATURES = {
    #          fused_qkv qkv_bias fused_up qk_norm post_norms
    "llama":  (False,    False,   False,   False,  False),
    "qwen2":  (False,    True,    False,   False,  False),
    "phi3":   (True,     False,   True,    False,  False),
    "gemma2": (False,    False,   False,   False,  True),
    "gemma3": (False,    False,   False,   True,   True),
}


def config(arch: str, **overrides) -> dict:
    """The full hyper-parameters of a zoo model: arch defaults, overrides, derived dims."""
    if arch not in ARCHS:
        raise ValueError(f"zoo: unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    hp = dict(ARCHS[arch])
    unknown = sorted(set(overrides) - set(hp))
    if unknown:
        raise ValueError(f"zoo: {arch} has no hyper-parameter {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(sorted(hp))}")
    hp.update(overrides)
    hp["arch"] = arch
    if hp["head_dim"] is None:
        hp["head_dim"] = hp["n_embd"] // hp["n_head"]
    if hp["n_rot"] is None:  # phi3 defaults to partial rotary, like Phi-4-mini
        hp["n_rot"] = hp["head_dim"] * 3 // 4 // 2 * 2 if arch == "phi3" else hp["head_dim"]
    _check(hp)
    return hp


def _check(hp: dict) -> None:
    """Reject hyper-parameters llama.cpp would refuse or misread, naming the field."""
    arch = hp["arch"]
    if hp["vocab"] not in VOCABS:
        raise ValueError(f"zoo: {arch}: vocab {hp['vocab']!r} not in {sorted(VOCABS)}")
    if hp["n_head"] % hp["n_head_kv"]:
        raise ValueError(f"zoo: {arch}: n_head {hp['n_head']} is not a multiple of "
                         f"n_head_kv {hp['n_head_kv']}")
    if hp["n_rot"] % 2 or not 0 < hp["n_rot"] <= hp["head_dim"]:
        raise ValueError(f"zoo: {arch}: n_rot {hp['n_rot']} must be even and in "
                         f"(0, head_dim={hp['head_dim']}]")
    if arch == "llama" and hp["n_rot"] != hp["head_dim"]:
        raise ValueError(f"zoo: llama: n_rot {hp['n_rot']} must equal head_dim {hp['head_dim']}")
    if arch in ("qwen2", "phi3") and hp["n_head"] * hp["head_dim"] != hp["n_embd"]:
        raise ValueError(f"zoo: {arch}: n_head*head_dim = {hp['n_head'] * hp['head_dim']} must equal "
                         f"n_embd {hp['n_embd']}")
    if arch == "qwen2" and hp["n_rot"] != hp["head_dim"]:
        raise ValueError(f"zoo: qwen2: n_rot {hp['n_rot']} must equal head_dim {hp['head_dim']}")
    unknown = sorted(set(hp["rope_scaling"] or {}) - set(ROPE_SCALING_KEYS))
    if unknown:
        raise ValueError(f"zoo: {arch}: rope_scaling has no {', '.join(unknown)}; known: {', '.join(ROPE_SCALING_KEYS)}")
    if arch == "gemma2" and not hp["tied"]:
        raise ValueError("zoo: gemma2: tied=False is not supported "
                         "(llama.cpp never reads output.weight for gemma2)")


# --- metadata ---------------------------------------------------------------------------

def _metadata(hp: dict) -> list[tuple[str, object, str]]:
    """(key, value, gguf type name) for the model's hyper-parameters."""
    a = hp["arch"]
    kv = [
        (f"{a}.context_length", hp["n_ctx_train"], "UINT32"),
        (f"{a}.embedding_length", hp["n_embd"], "UINT32"),
        (f"{a}.block_count", hp["n_layer"], "UINT32"),
        (f"{a}.feed_forward_length", hp["n_ff"], "UINT32"),
        (f"{a}.attention.head_count", hp["n_head"], "UINT32"),
        (f"{a}.attention.head_count_kv", hp["n_head_kv"], "UINT32"),
        (f"{a}.attention.key_length", hp["head_dim"], "UINT32"),
        (f"{a}.attention.value_length", hp["head_dim"], "UINT32"),
        (f"{a}.attention.layer_norm_rms_epsilon", hp["rms_eps"], "FLOAT32"),
        (f"{a}.rope.freq_base", hp["rope_base"], "FLOAT32"),
        (f"{a}.rope.dimension_count", hp["n_rot"], "UINT32"),
    ]
    optional = [  # (hyper-parameter, key, type): written only when set
        ("sliding_window", "attention.sliding_window", "UINT32"),
        ("rope_base_swa", "rope.freq_base_swa", "FLOAT32"),
        ("attn_softcap", "attn_logit_softcapping", "FLOAT32"),
        ("final_softcap", "final_logit_softcapping", "FLOAT32"),
    ]
    kv += [(f"{a}.{key}", hp[name], t) for name, key, t in optional if hp.get(name) is not None]
    pattern = hp.get("swa_pattern")
    if pattern is not None:
        kind = "UINT32" if isinstance(pattern, int) else "ARRAY_BOOL"
        kv.append((f"{a}.attention.sliding_window_pattern", pattern, kind))
    scaling = dict(hp["rope_scaling"] or {})
    if hp.get("rope_factors"):
        scaling = dict(orig_ctx=hp["rope_orig_ctx"], attn_factor=hp["rope_attn_factor"]) | scaling
    for name, value in scaling.items():
        key, kind = ROPE_SCALING_KEYS[name]
        kv.append((f"{a}.rope.scaling.{key}", value, kind))
    return kv


# GGUF value type id -> numpy scalar type (8 = string, 9 = array)
_GGUF_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                 10: "<u8", 11: "<i8", 12: "<f8"}


@lru_cache(maxsize=None)
def tokenizer_kv(vocab: str) -> tuple:
    """The ``tokenizer.*`` keys of a vocab file as (key, value, type, sub_type), strings as raw bytes."""
    kv, _ = read_gguf(VOCAB_DIR / VOCABS[vocab])
    return tuple((k, *v) for k, v in kv.items() if k.startswith("tokenizer."))


def read_gguf(path) -> tuple[dict, dict]:
    """Metadata {key: (value, type, sub_type)} and tensors {name: (ggml type id, ne)} of a GGUF file.

    A direct walk over the header: gguf-py's GGUFReader takes ~10 s on a file holding the
    151k-token qwen2 vocab because it builds one numpy view per string.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"zoo: {path} is not a GGUF file (magic {buf[:4]!r})")
        return _walk_header(buf)


def _walk_header(buf) -> tuple[dict, dict]:
    """The key/value and tensor-info sections of a GGUF buffer (layout of GGUF v2/v3)."""
    from gguf import GGUFValueType
    n_tensors, n_kv = np.frombuffer(buf, "<u8", 2, 8).tolist()
    pos, kv, tensors = 24, {}, {}
    for _ in range(n_kv):
        key, pos = _gguf_string(buf, pos)
        kind = int.from_bytes(buf[pos:pos + 4], "little")
        if kind == 9:  # array: item type u32, count u64, items
            sub = int.from_bytes(buf[pos + 4:pos + 8], "little")
            count = int.from_bytes(buf[pos + 8:pos + 16], "little")
            value, pos = _gguf_array(buf, pos + 16, sub, count)
            kv[key.decode()] = (value, GGUFValueType(kind), GGUFValueType(sub))
        else:
            value, pos = _gguf_scalar(buf, pos + 4, kind)
            kv[key.decode()] = (value, GGUFValueType(kind), None)
    for _ in range(n_tensors):
        name, pos = _gguf_string(buf, pos)
        n_dims = int.from_bytes(buf[pos:pos + 4], "little")
        ne = tuple(np.frombuffer(buf, "<u8", n_dims, pos + 4).tolist())
        pos += 4 + 8 * n_dims
        tensors[name.decode()] = (int.from_bytes(buf[pos:pos + 4], "little"), ne)
        pos += 4 + 8  # type u32, data offset u64
    return kv, tensors


def _gguf_string(buf: bytes, pos: int) -> tuple[bytes, int]:
    """A length-prefixed GGUF string at ``pos`` and the offset after it."""
    n = int.from_bytes(buf[pos:pos + 8], "little")
    return buf[pos + 8:pos + 8 + n], pos + 8 + n


def _gguf_scalar(buf: bytes, pos: int, kind: int):
    """One GGUF value of type id ``kind`` at ``pos`` and the offset after it."""
    if kind == 8:
        return _gguf_string(buf, pos)
    if kind not in _GGUF_SCALARS:
        raise ValueError(f"zoo: unsupported GGUF value type {kind} at offset {pos}")
    dt = np.dtype(_GGUF_SCALARS[kind])
    return np.frombuffer(buf, dt, 1, pos)[0].item(), pos + dt.itemsize


def _gguf_array(buf: bytes, pos: int, sub: int, count: int):
    """A GGUF array of ``count`` values of type id ``sub`` as a list, and the offset after it."""
    if sub == 8:
        items = []
        for _ in range(count):
            s, pos = _gguf_string(buf, pos)
            items.append(s)
        return items, pos
    if sub not in _GGUF_SCALARS:
        raise ValueError(f"zoo: unsupported GGUF array item type {sub} at offset {pos}")
    dt = np.dtype(_GGUF_SCALARS[sub])
    return np.frombuffer(buf, dt, count, pos).tolist(), pos + count * dt.itemsize


def n_vocab(vocab: str) -> int:
    """Number of tokens in a vocab file (the token_embd row count)."""
    for key, value, _, _ in tokenizer_kv(vocab):
        if key == "tokenizer.ggml.tokens":
            return len(value)
    raise ValueError(f"zoo: vocab {vocab!r} has no tokenizer.ggml.tokens")


# --- weights ----------------------------------------------------------------------------

def tensor_shapes(hp: dict) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (out, in) for every tensor the model writes."""
    fused_qkv, qkv_bias, fused_up, qk_norm, post_norms = FEATURES[hp["arch"]]
    d, hd, ff = hp["n_embd"], hp["head_dim"], hp["n_ff"]
    nq, nkv = hp["n_head"] * hd, hp["n_head_kv"] * hd
    shapes = {"token_embd.weight": (n_vocab(hp["vocab"]), d), "output_norm.weight": (d,)}
    if not hp["tied"]:
        shapes["output.weight"] = (n_vocab(hp["vocab"]), d)
    if hp.get("rope_factors"):
        shapes["rope_factors_long.weight"] = (hp["n_rot"] // 2,)
        shapes["rope_factors_short.weight"] = (hp["n_rot"] // 2,)
    if hp.get("rope_freqs"):
        shapes["rope_freqs.weight"] = (hp["n_rot"] // 2,)
    for i in range(hp["n_layer"]):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (d,)
        if fused_qkv:
            shapes[b + "attn_qkv.weight"] = (nq + 2 * nkv, d)
        else:
            shapes.update({b + "attn_q.weight": (nq, d), b + "attn_k.weight": (nkv, d),
                           b + "attn_v.weight": (nkv, d)})
        if qkv_bias:
            shapes.update({b + "attn_q.bias": (nq,), b + "attn_k.bias": (nkv,), b + "attn_v.bias": (nkv,)})
        if qk_norm:
            shapes.update({b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
        shapes[b + "attn_output.weight"] = (d, nq)
        if post_norms:
            shapes[b + "post_attention_norm.weight"] = (d,)
        shapes[b + "ffn_norm.weight"] = (d,)
        if fused_up:
            shapes[b + "ffn_up.weight"] = (2 * ff, d)  # rows: [gate | up]
        else:
            shapes.update({b + "ffn_gate.weight": (ff, d), b + "ffn_up.weight": (ff, d)})
        shapes[b + "ffn_down.weight"] = (d, ff)
        if post_norms:
            shapes[b + "post_ffw_norm.weight"] = (d,)
    return shapes


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random f32 weights: matrices N(0, 1/fan_in), norms near 1, biases small, rope factors >= 1."""
    if name.startswith("rope_factors_long"):
        return np.linspace(1.0, 8.0, shape[0], dtype=np.float32)       # stretch low frequencies
    if name.startswith("rope_factors_short"):
        return np.linspace(1.0, 1.5, shape[0], dtype=np.float32)
    if name.startswith("rope_freqs"):                                    # llama 3.1's shape: 1, a ramp, 8
        return np.clip(np.linspace(-2.0, 11.0, shape[0]), 1.0, 8.0).astype(np.float32)
    x = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith(".bias"):
        return x * np.float32(0.5)
    if len(shape) == 1:                                                  # norm weights
        return np.float32(1.0) + np.float32(0.1) * x
    return x * np.float32(1.0 / np.sqrt(shape[1]))


def weights(hp: dict, seed: int) -> dict[str, np.ndarray]:
    """Every tensor of the model as f32, drawn in a fixed order from ``seed``."""
    rng = np.random.default_rng(seed)
    return {name: _init(name, shape, rng) for name, shape in tensor_shapes(hp).items()}


# --- writing ----------------------------------------------------------------------------

def write_model(path, arch: str, *, mix: str = "f32", seed: int = 0, **overrides) -> Path:
    """Write a tiny random-weight ``arch`` model that llama.cpp loads, in type mix ``mix``."""
    if mix not in MIXES:
        raise ValueError(f"zoo: unknown mix {mix!r}; known: {', '.join(MIXES)}")
    hp = config(arch, **overrides)
    path = Path(path)
    ftype = MIXES[mix]
    if ftype is None:
        _write_gguf(path, hp, seed, np.float16 if mix == "f16" else np.float32)
        return path
    src = path.with_name(path.name + ".f32.gguf")
    try:
        _write_gguf(src, hp, seed, np.float32)
        llama_quantize(src, path, ftype, what=f"{arch} {mix}")
    finally:
        src.unlink(missing_ok=True)
    return path


def _write_gguf(path: Path, hp: dict, seed: int, matrix_dtype, tensors: dict | None = None) -> None:
    """Write metadata, tokenizer and weights (``tensors``, or those of ``seed``); matrices in
    ``matrix_dtype``, 1-D tensors f32."""
    from gguf import GGUFValueType, GGUFWriter
    w = GGUFWriter(str(path), hp["arch"])
    w.add_name("ggraph zoo")  # not the arch: a general.name containing "phi3" makes llama.cpp
    # look up phi-3 special tokens ("<|endoftext|>") that the llama-spm vocab lacks
    w.add_file_type(1 if matrix_dtype == np.float16 else 0)  # LLAMA_FTYPE_MOSTLY_F16 / ALL_F32
    for key, value, kind in _metadata(hp):
        if kind == "ARRAY_BOOL":
            w.add_key_value(key, [bool(v) for v in value], GGUFValueType.ARRAY, GGUFValueType.BOOL)
        else:
            w.add_key_value(key, value, GGUFValueType[kind])
    for key, value, kind, sub in tokenizer_kv(hp["vocab"]):
        w.add_key_value(key, value, kind, sub)
    for name, x in (tensors if tensors is not None else weights(hp, seed)).items():
        w.add_tensor(name, x.astype(matrix_dtype) if x.ndim == 2 else x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_quantize(src, dst, ftype: int, what: str = "", nthread: int = 2) -> Path:
    """Quantise ``src`` into ``dst`` with llama.cpp's own type selection for ``ftype`` (a llama_ftype id)."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = nthread
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"zoo: llama_model_quantize failed for {what or src} (ftype {ftype}) with code {rc}")
    return Path(dst)


# --- outlier activations, as trained models have them ----------------------------------------

# llama.cpp ftypes (LLAMA_FTYPE_MOSTLY_Q4_1, _Q5_1): the types whose activations ggml quantises to q8_1
OUTLIER_MIXES = {"q4_1": 3, "q5_1": 9}
# SmolLM2-135M narrowed to 4 of its 30 layers: width 576 (18 blocks of 32, no 256-blocks), 9 heads of
# 64 over 3 KV heads, FFN 1536, rope base 100000; untied, so that the outlier channels of token_embd
# do not dominate the logits
SMOLLM2_DIMS = dict(n_embd=576, n_head=9, n_head_kv=3, head_dim=64, n_ff=1536, n_layer=4, rope_base=100000.0)
OUTLIER_CHANNELS = (17, 230, 451)        # residual channels: one in each of three blocks of 32
OUTLIER_FEATURES = (5, 700, 1201)        # FFN features


def outlier_weights(hp: dict, seed: int, gain: float = 50.0) -> dict[str, np.ndarray]:
    """``weights`` with the massive activations of trained models: OUTLIER_CHANNELS of the residual
    stream ``gain`` times the others (those columns of token_embd, and the rows of every ffn_down that
    write them), OUTLIER_FEATURES of every FFN gain/5 times the others (rows of ffn_gate and ffn_up),
    and output_norm taking the channels back down, as trained final norms do."""
    w = weights(hp, seed)
    ch, ff = list(OUTLIER_CHANNELS), list(OUTLIER_FEATURES)
    w["token_embd.weight"][:, ch] *= np.float32(gain)
    w["output_norm.weight"][ch] /= np.float32(gain)
    for i in range(hp["n_layer"]):
        w[f"blk.{i}.ffn_down.weight"][ch, :] *= np.float32(gain)
        for name in ("ffn_gate", "ffn_up"):
            w[f"blk.{i}.{name}.weight"][ff, :] *= np.float32(gain / 5)
    return w


def write_outlier_model(path, mix: str, *, seed: int = 0, gain: float = 50.0, **overrides) -> Path:
    """A llama of SMOLLM2_DIMS (and ``overrides``) with ``outlier_weights``, quantised by llama.cpp to
    ``mix`` (an OUTLIER_MIXES key)."""
    if mix not in OUTLIER_MIXES:
        raise ValueError(f"zoo: unknown outlier mix {mix!r}; known: {', '.join(OUTLIER_MIXES)}")
    hp = config("llama", **{**SMOLLM2_DIMS, **overrides})
    path = Path(path)
    src = path.with_name(path.name + ".f32.gguf")
    try:
        _write_gguf(src, hp, seed, np.float32, outlier_weights(hp, seed, gain))
        llama_quantize(src, path, OUTLIER_MIXES[mix], what=f"outlier llama {mix}")
    finally:
        src.unlink(missing_ok=True)
    return path


def cached_outlier_model(mix: str, *, seed: int = 0, gain: float = 50.0, **overrides) -> Path:
    """``write_outlier_model`` once per distinct arguments (as ``cached_model``)."""
    import pytest
    pytest.importorskip("llama_cpp", reason="quantised zoo models need llama-cpp-python")
    key = cache_key("llama", "q4_1", seed, {**SMOLLM2_DIMS, **overrides})        # a llama.cpp mix: its version counts
    folder = Path(tempfile.gettempdir()) / f"ggraph-zoo-outliers-{mix}-gain{gain:g}-{key}"
    return _written_once(folder / f"llama-outliers-{mix}.gguf",
                         lambda tmp: write_outlier_model(tmp, mix, seed=seed, gain=gain, **overrides))


# --- cache ------------------------------------------------------------------------------

def cache_key(arch: str, mix: str, seed: int, overrides: dict) -> str:
    """Hash of everything a cached model depends on: arguments, this file, vocab, llama.cpp."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(json.dumps([arch, mix, seed, sorted(overrides.items())], default=repr).encode())
    vocab = config(arch, **overrides)["vocab"]
    h.update(str((VOCAB_DIR / VOCABS[vocab]).stat().st_size).encode())
    if MIXES.get(mix) is not None:
        import llama_cpp
        h.update(llama_cpp.__version__.encode())
    return h.hexdigest()[:16]


def cached_model(arch: str, mix: str = "f32", *, seed: int = 0, **overrides) -> Path:
    """``write_model`` once per distinct arguments into tempdir/ggraph-zoo-<hash>/, then reuse."""
    if MIXES.get(mix, None) is not None:
        import pytest
        pytest.importorskip("llama_cpp", reason="quantised zoo models need llama-cpp-python")
    folder = Path(tempfile.gettempdir()) / f"ggraph-zoo-{cache_key(arch, mix, seed, overrides)}"
    return _written_once(folder / f"{arch}-{mix}.gguf",
                         lambda tmp: write_model(tmp, arch, mix=mix, seed=seed, **overrides))


def _written_once(path: Path, write) -> Path:
    """``path``, written by ``write(tmp)`` the first time and then reused."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{os.getpid()}-{path.name}"
    write(tmp)
    os.replace(tmp, path)  # atomic: concurrent writers never expose a partial file
    return path
