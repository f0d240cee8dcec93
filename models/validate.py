"""The model validator: a file's metadata checked against its tensors, before anything is allocated.

A GGUF file can lie: a block count that is off by one, a width that does not match the
matrices, a vocabulary longer than the embedding. Each of these would surface later as a
shape error deep in a traced op, an out-of-bounds read, or silently wrong logits. Here
every number the shared decoder uses is checked against the tensor shapes it implies,
and each failure is one line naming the key, the tensor and both numbers:

    llama.block_count = 17 but the file has blk.0..blk.17
    tensor blk.0.attn_q.weight is [1024,640], but llama.attention.head_count × key_length = 16 × 64
      by llama.embedding_length = 512 say [1024,512]

Architectures with a forward of their own get the checks every decoder needs (layers,
embedding, vocabulary); their own tensors are theirs to check.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ggraph.models.config import MAX_ROPE_FREQUENCY, ModelConfig, check_layers


def _fmt(shape) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def check(cfg: ModelConfig, tensors: Mapping, metadata: Mapping, shared_decoder: bool = True) -> None:
    """Raise ValueError naming the key and tensor unless the metadata and the tensors agree."""
    a = cfg.arch
    check_layers(a, cfg.n_layer, tensors, shared_decoder)
    emb = tuple(tensors["token_embd.weight"].shape)
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != emb[0]:
        raise ValueError(f"tokenizer.ggml.tokens has {len(tokens)} entries but token_embd.weight has {emb[0]} rows")
    for k, v in metadata.items():
        if k.startswith("tokenizer.ggml.") and k.endswith("_token_id") and isinstance(v, int) and not 0 <= v < emb[0]:
            raise ValueError(f"{k} = {v} is outside the vocabulary of {emb[0]} tokens (token_embd.weight rows)")
    eog = metadata.get("tokenizer.ggml.eog_token_ids")
    if eog is not None:
        if isinstance(eog, (str, bytes, int, float)) or not hasattr(eog, "__iter__"):
            raise ValueError(f"tokenizer.ggml.eog_token_ids = {eog!r}: must be an array of token ids")
        bad = [i for i in eog if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < emb[0]]
        if bad:
            what = "outside the vocabulary of" if isinstance(bad[0], (int, np.integer)) else "not a token id; the vocabulary has"
            raise ValueError(f"tokenizer.ggml.eog_token_ids holds {bad[0]!r}, {what} {emb[0]} tokens")
    types = metadata.get("tokenizer.ggml.token_type")
    if types is not None and not isinstance(types, (str, bytes, int, float)):
        tt = np.asarray(types if isinstance(types, np.ndarray) else list(types))
        if tt.size and (tt.dtype.kind not in "iu" or tt.min() < 0 or tt.max() > MAX_TOKEN_TYPE):
            first = tt.reshape(-1)[np.flatnonzero(~np.isin(tt, np.arange(MAX_TOKEN_TYPE + 1)))[0]] \
                if tt.dtype.kind in "iu" else tt.reshape(-1)[0]
            first = first.item() if isinstance(first, np.generic) else first
            raise ValueError(f"tokenizer.ggml.token_type holds {first!r}, which is not a token type "
                             f"(0..{MAX_TOKEN_TYPE}: undefined, normal, unknown, control, user-defined, unused, byte)")
    if cfg.n_vocab != emb[0]:
        raise ValueError(f"the vocabulary has {cfg.n_vocab} tokens ({a}.vocab_size or tokenizer.ggml.tokens) but "
                         f"token_embd.weight has {emb[0]} rows")
    if shared_decoder:
        for name, (want, why) in expected_shapes(cfg, set(tensors)).items():
            if name not in tensors:
                raise ValueError(f"tensor {name} is missing ({why} says the {a} decoder needs {_fmt(want)})")
            got = tuple(tensors[name].shape)
            if got != want and not (name.endswith(ONE_ROW_OK) and got == (1, *want)):
                raise ValueError(f"tensor {name} is {_fmt(got)}, but {why} say {_fmt(want)}")
            dt = tensors[name].dtype
            if not (dt.np_dtype is None or dt.is_float):
                raise ValueError(f"tensor {name} is {dt.name}: the {a} decoder reads float or quantised weights")
    for name in ROPE_FACTOR_TENSORS:
        if cfg.rope_freq_factors and name in tensors:
            _check_rope_factors(name, tensors[name])


ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# [N] tensors a file may hold as one row [1, N] (ne [N, 1]), which llama.cpp reads alike (qwen2moe's shared gate)
ONE_ROW_OK = ("ffn_gate_inp_shexp.weight",)
MAX_TOKEN_TYPE = 6             # llama.cpp's llama_token_type: 0 undefined .. 6 byte


def _check_rope_factors(name: str, t) -> None:
    """Rope frequency factors divide each pair's frequency: each must be finite and greater than 0
    (a 0 or a NaN would make every logit NaN), and not so small that a frequency overflows."""
    from ggraph.gguf import quants
    if t.dtype.name != "f32":                            # llama.cpp's rope asserts f32 factors
        raise ValueError(f"tensor {name} is {t.dtype.name}: rope frequency factors must be f32")
    values = np.asarray(quants.dequantize(t.data, t.dtype, t.shape), np.float64).reshape(-1)
    bad = values[~(np.isfinite(values) & (values >= 1.0 / MAX_ROPE_FREQUENCY))]
    if bad.size:
        raise ValueError(f"tensor {name} holds {float(bad[0])!r}: rope frequency factors must be finite and "
                         f"at least {1 / MAX_ROPE_FREQUENCY:g}")


def expected_shapes(cfg: ModelConfig, names: set) -> dict[str, tuple[tuple, str]]:
    """Each tensor the shared decoder reads: its shape (numpy order, out × in) and the keys that say so."""
    a = cfg.arch
    D, V, F = cfg.n_embd, cfg.n_vocab, cfg.n_ff
    H, Hkv, Dh, Dv = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v
    d = f"{a}.embedding_length = {D}"
    q = f"{a}.attention.head_count × key_length = {H} × {Dh}"
    kv = f"{a}.attention.head_count_kv × key_length = {Hkv} × {Dh}"
    vv = f"{a}.attention.head_count_kv × value_length = {Hkv} × {Dv}"
    ff = f"{a}.feed_forward_length = {F}"
    out = {"token_embd.weight": ((V, D), f"the vocabulary of {V} by {d}"),
           "output_norm.weight": ((D,), d)}
    if not cfg.tied_output:
        out["output.weight"] = ((V, D), f"the vocabulary of {V} by {d}")
    for name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        if cfg.rope_freq_factors and name in names:
            out[name] = ((cfg.rope_dims // 2,), f"{a}.rope.dimension_count = {cfg.rope_dims} halved")
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        if cfg.pre_norms:
            out[b + "attn_norm.weight"] = ((D,), d)
        if cfg.fused_qkv:
            out[b + "attn_qkv.weight"] = (((H + 2 * Hkv) * Dh, D), f"({q}) + 2 × ({kv}) by {d}")
        else:
            out[b + "attn_q.weight"] = ((H * Dh, D), f"{q} by {d}")
            out[b + "attn_k.weight"] = ((Hkv * Dh, D), f"{kv} by {d}")
            out[b + "attn_v.weight"] = ((Hkv * Dv, D), f"{vv} by {d}")
        if cfg.qkv_bias:
            out[b + "attn_q.bias"] = ((H * Dh,), q)
            out[b + "attn_k.bias"] = ((Hkv * Dh,), kv)
            out[b + "attn_v.bias"] = ((Hkv * Dv,), vv)
        if cfg.qk_norm == "full":
            out[b + "attn_q_norm.weight"] = ((H * Dh,), q)
            out[b + "attn_k_norm.weight"] = ((Hkv * Dh,), kv)
        elif cfg.qk_norm:
            out[b + "attn_q_norm.weight"] = ((Dh,), f"{a}.attention.key_length = {Dh}")
            out[b + "attn_k_norm.weight"] = ((Dh,), f"{a}.attention.key_length = {Dh}")
        out[b + "attn_output.weight"] = ((D, H * Dv), f"{d} by {a}.attention.head_count × value_length = {H} × {Dv}")
        if cfg.attn_output_bias:
            out[b + "attn_output.bias"] = ((D,), d)
        if cfg.attn_sinks:
            out[b + "attn_sinks.weight"] = ((H,), f"{a}.attention.head_count = {H}")
        if cfg.pre_norms:
            out[b + cfg.ffn_norm + ".weight"] = ((D,), d)
        if cfg.post_norms:
            out[b + "post_attention_norm.weight"] = ((D,), d)
            out[b + "post_ffw_norm.weight"] = ((D,), d)
        if cfg.n_expert:
            E, Fe = cfg.n_expert, cfg.n_ff_exp
            e = f"{a}.expert_count = {E}"
            fe = f"{a}.{'expert_' if Fe != F else ''}feed_forward_length = {Fe}"     # llama, olmoe: n_ff wide
            out[b + "ffn_gate_inp.weight"] = ((E, D), f"{e} by {d}")
            out[b + "ffn_gate_exps.weight"] = ((E, Fe, D), f"{e}, {fe} by {d}")
            out[b + "ffn_up_exps.weight"] = ((E, Fe, D), f"{e}, {fe} by {d}")
            out[b + "ffn_down_exps.weight"] = ((E, D, Fe), f"{e}, {d} by {fe}")
            if cfg.expert_bias:
                out[b + "ffn_gate_inp.bias"] = ((E,), e)
                out[b + "ffn_gate_exps.bias"] = ((E, Fe), f"{e} by {fe}")
                out[b + "ffn_up_exps.bias"] = ((E, Fe), f"{e} by {fe}")
                out[b + "ffn_down_exps.bias"] = ((E, D), f"{e} by {d}")
            if cfg.n_ff_shexp:
                Fs = cfg.n_ff_shexp
                fs = f"{a}.expert_shared_feed_forward_length = {Fs}"
                out[b + "ffn_gate_inp_shexp.weight"] = ((D,), d)
                out[b + "ffn_gate_shexp.weight"] = ((Fs, D), f"{fs} by {d}")
                out[b + "ffn_up_shexp.weight"] = ((Fs, D), f"{fs} by {d}")
                out[b + "ffn_down_shexp.weight"] = ((D, Fs), f"{d} by {fs}")
        elif cfg.fused_gate_up:
            out[b + "ffn_up.weight"] = ((2 * F, D), f"2 × {ff} (gate and up) by {d}")
        else:
            out[b + "ffn_gate.weight"] = ((F, D), f"{ff} by {d}")
            out[b + "ffn_up.weight"] = ((F, D), f"{ff} by {d}")
        if not cfg.n_expert:
            out[b + "ffn_down.weight"] = ((D, F), f"{d} by {ff}")
    return out
