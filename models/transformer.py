"""The one decoder every shipped architecture runs, written with ggraph.ops.

Weights are looked up by their GGUF tensor names. Architecture differences are the flags
of ModelConfig (models/config.py). Shapes in comments: T tokens in this step, P past
tokens in the cache, D = n_embd, H/Hkv heads, Dh head dim, F = n_ff, V = n_vocab.
"""
from __future__ import annotations

import numpy as np

from ggraph import ops
from ggraph.ir.dims import Sym
from ggraph.ir.fused import rope_attention_slots
from ggraph.models.config import ModelConfig
from ggraph.models.rope import layer_rope
from ggraph.ir.trace import scope


def forward(cfg: ModelConfig, w: dict, tokens, P, k_caches, v_caches, *, last_only=False, rope_factors=None,
            output="logits"):
    """Logits for ``tokens`` (T,) after P cached tokens; returns (logits, k_caches, v_caches). With
    ``output="hidden"`` the first result is the final hidden state (T, D) after the output norm, as
    llama.cpp's embeddings read it, and no logits are computed."""
    T = tokens.shape[0]
    with scope("embd"):
        x = ops.take(w["token_embd.weight"], tokens)                              # (T, D)
        if cfg.embed_scale:
            x = x * cfg.embed_scale
        pos = ops.iota(T) + P                                                      # (T,)
    x, k_out, v_out = layers(cfg, w, x, lambda blk, i, x: attention(cfg, blk, i, x, pos, P, k_caches[i], v_caches[i],
                                                                     rope_factors))
    with scope("output"):
        if last_only:
            x = ops.slice(x, 0, Sym("T") - 1, Sym("T"))                            # (1, D)
        x = ops.rms_norm(x, w["output_norm.weight"], eps=cfg.norm_eps)
        if output == "hidden":
            return x, k_out, v_out
        return head(cfg, w, x), k_out, v_out


def layers(cfg: ModelConfig, w: dict, x, attend):
    """The decoder blocks over x (T, D); ``attend(blk, i, x)`` gives (attention out, k cache, v cache)."""
    k_out, v_out = [], []
    for i in range(cfg.n_layer):
        blk = Layer(w, i)
        with scope(f"blk.{i}"):
            with scope("attn"):
                a, kc, vc = attend(blk, i, x)
            x = x + a
            with scope("ffn"):
                x = x + ffn(cfg, blk, x)
        k_out.append(kc)
        v_out.append(vc)
    return x, k_out, v_out


def head(cfg: ModelConfig, w: dict, x):
    """Logits (rows, V) of normed hidden states, with gemma2's final softcap."""
    out_w = w["token_embd.weight"] if cfg.tied_output else w["output.weight"]      # (V, D)
    logits = ops.linear(x, out_w)
    if cfg.final_softcap:
        logits = ops.tanh(logits * (1.0 / cfg.final_softcap)) * cfg.final_softcap
    return logits


def forward_batch(cfg: ModelConfig, w: dict, tokens, seq, positions, pick, k_caches, v_caches, *, slot_rows: int,
                  rope_factors=None):
    """One step of a batch of sequences over slotted caches (``slot_rows`` rows each): token t is
    at ``positions[t]`` of sequence ``seq[t]``; returns the logits of the rows ``pick`` (i32[R]: the
    last token of each sequence that samples), and the caches."""
    with scope("embd"):
        x = ops.take(w["token_embd.weight"], tokens)                              # (T, D)
        if cfg.embed_scale:
            x = x * cfg.embed_scale
    slots = dict(seq=seq, positions=positions, slot_rows=slot_rows)
    x, k_out, v_out = layers(cfg, w, x, lambda blk, i, x: attention(cfg, blk, i, x, positions, None, k_caches[i],
                                                                     v_caches[i], rope_factors, slots))
    with scope("output"):
        x = ops.take(x, pick)                                                      # (R, D)
        x = ops.rms_norm(x, w["output_norm.weight"], eps=cfg.norm_eps)
        return head(cfg, w, x), k_out, v_out


def hybrid_forward(cfg: ModelConfig, w: dict, tokens, P, k_caches, v_caches, *, states, mixer, last_only=False,
                   rope_factors=None):
    """The decoder of a family whose layers attend or recur (``cfg.recurrent_layers``, lfm2, mamba2,
    granitehybrid): a recurrent layer runs ``mixer(cfg, blk, h, state) -> (y, new state)`` on its normed
    input where an attention layer attends; the attention, the FFN (none where ``n_ff`` and ``n_expert`` are
    0, as in mamba2) and the head are the shared decoder's. ``cfg.extra`` may hold granite's
    ``residual_scale`` and ``logit_scale`` and the output norm's tensor (``output_norm``)."""
    T = tokens.shape[0]
    recurrent, scale = set(cfg.recurrent_layers), cfg.extra.get("residual_scale")
    with scope("embd"):
        x = ops.take(w["token_embd.weight"], tokens)                              # (T, D)
        if cfg.embed_scale:
            x = x * cfg.embed_scale
        pos = ops.iota(T) + P                                                      # (T,)
    k_out, v_out, s_out = [], [], []
    for i in range(cfg.n_layer):
        blk = Layer(w, i)
        with scope(f"blk.{i}"):
            if i in recurrent:
                with scope("recurrent"):
                    h = ops.rms_norm(x, blk["attn_norm.weight"], eps=cfg.norm_eps)   # (T, D)
                    a, state = mixer(cfg, blk, h, states[i])
                kc = vc = None
            else:
                with scope("attn"):
                    a, kc, vc = attention(cfg, blk, i, x, pos, P, k_caches[i], v_caches[i], rope_factors)
                state = states[i]
            x = x + (a * scale if scale else a)
            if cfg.n_ff or cfg.n_expert:
                with scope("ffn"):
                    f = ffn(cfg, blk, x)
                    x = x + (f * scale if scale else f)
        k_out.append(kc)
        v_out.append(vc)
        s_out.append(state)
    with scope("output"):
        if last_only:
            x = ops.slice(x, 0, Sym("T") - 1, Sym("T"))                            # (1, D)
        x = ops.rms_norm(x, w[cfg.extra.get("output_norm", "output_norm") + ".weight"], eps=cfg.norm_eps)
        logits = head(cfg, w, x)
        if cfg.extra.get("logit_scale"):
            logits = logits * (1.0 / cfg.extra["logit_scale"])
        return logits, k_out, v_out, s_out


class Layer:
    """Layer i's weights by their short GGUF names: ``blk["attn_q.weight"]``."""

    def __init__(self, w: dict, i: int):
        self.w, self.prefix = w, f"blk.{i}."

    def __getitem__(self, name):
        return self.w[self.prefix + name]

    def get(self, name):
        return self.w.get(self.prefix + name)

    def expect(self, name, shape: tuple, why: str):
        """The weight ``name``, which the metadata ``why`` says is ``shape`` (numpy order; a file may leave
        out its leading 1s, as ggml counts dims): a file that says otherwise is refused here, by name,
        before anything runs."""
        t = self.w.get(self.prefix + name)
        if t is None:
            raise ValueError(f"tensor {self.prefix}{name} is missing ({why} says it is "
                             f"[{','.join(map(str, shape))}])")
        ones = len(shape) - len(t.shape)
        if ones > 0 and tuple(t.shape) == tuple(shape[ones:]) and set(shape[:ones]) == {1}:
            return t.reshape(*shape)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"tensor {self.prefix}{name} is [{','.join(map(str, t.shape))}], but {why} say "
                             f"[{','.join(map(str, shape))}]")
        return t


def rope_params(cfg: ModelConfig, i: int, rope_factors=None) -> dict:
    """ops.rope's parameters for layer i: its base and scaling, and the file's frequency factors times yarn's
    constants (one per pair) when either applies."""
    lr = layer_rope(cfg, i)
    factors = rope_factors
    if lr.factors is not None:
        factors = ops.to_tracer(lr.factors) if factors is None else factors * ops.to_tracer(lr.factors)
    return dict(base=lr.base, scale=lr.scale, dims=cfg.rope_dims, style=cfg.rope_style, freq_factors=factors,
                mscale=lr.mscale)


def attention(cfg: ModelConfig, blk: Layer, i: int, x, pos, P, k_cache, v_cache, rope_factors, slots=None):
    T = x.shape[0]
    H, Hkv, Dh, Dv = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v
    h = ops.rms_norm(x, blk["attn_norm.weight"], eps=cfg.norm_eps) if cfg.pre_norms else x   # (T, D)
    if cfg.fused_qkv:
        qkv = ops.linear(h, blk["attn_qkv.weight"])                                # (T, (H+2Hkv)Dh)
        q, k, v = qkv[:, :H * Dh], qkv[:, H * Dh:(H + Hkv) * Dh], qkv[:, (H + Hkv) * Dh:]
    else:
        q = ops.linear(h, blk["attn_q.weight"], blk.get("attn_q.bias"))           # (T, H*Dh)
        k = ops.linear(h, blk["attn_k.weight"], blk.get("attn_k.bias"))           # (T, Hkv*Dh)
        v = ops.linear(h, blk["attn_v.weight"], blk.get("attn_v.bias"))           # (T, Hkv*Dv)
    if cfg.qk_norm == "full":                                                      # olmo2: all heads at once
        q = ops.rms_norm(q, blk["attn_q_norm.weight"], eps=cfg.norm_eps)          # (T, H*Dh)
        k = ops.rms_norm(k, blk["attn_k_norm.weight"], eps=cfg.norm_eps)          # (T, Hkv*Dh)
    q, k, v = q.reshape(T, H, Dh), k.reshape(T, Hkv, Dh), v.reshape(T, Hkv, Dv)
    if cfg.qk_norm in (True, "head"):                                              # each head on its own
        q = ops.rms_norm(q, blk["attn_q_norm.weight"], eps=cfg.norm_eps)
        k = ops.rms_norm(k, blk["attn_k_norm.weight"], eps=cfg.norm_eps)
    rope = rope_params(cfg, i, rope_factors)                                       # q and k share these
    mods = {}                                                                      # inlined into the kernels
    if cfg.is_swa(i):
        mods["mask_mod"] = ops.sliding_window(cfg.sliding_window)                  # q_idx - kv_idx < W
    if cfg.attn_softcap:
        mods["score_mod"] = ops.softcap(cfg.attn_softcap)                          # c * tanh(score / c)
    if cfg.attn_sinks:
        mods["sinks"] = blk["attn_sinks.weight"]                                   # (H,): one more logit per row
    if slots is not None:                                                          # a batch of sequences
        o, k_cache, v_cache = rope_attention_slots(
            q, k, v, k_cache, v_cache, slots["seq"], slots["positions"], rope["freq_factors"],
            slot_rows=slots["slot_rows"], dims=rope["dims"] or Dh, base=rope["base"], rope_scale=rope["scale"],
            style=rope["style"], mscale=rope["mscale"], scale=cfg.scale, **mods)
    else:
        if cfg.rope_style != "none":                                               # "none": NoPE (granite-4.0-h)
            q, k = ops.rope(q, pos, **rope), ops.rope(k, pos, **rope)
        o, k_cache, v_cache = ops.attention(q, k, v, k_cache, v_cache, P, scale=cfg.scale, **mods)   # (T, H, Dv)
    o = ops.linear(o.reshape(T, H * Dv), blk["attn_output.weight"], blk.get("attn_output.bias"))   # (T, D)
    if cfg.post_norms:
        o = ops.rms_norm(o, blk["post_attention_norm.weight"], eps=cfg.norm_eps)
    return o, k_cache, v_cache


def ffn(cfg: ModelConfig, blk: Layer, x):
    F = cfg.n_ff
    h = ops.rms_norm(x, blk[cfg.ffn_norm + ".weight"], eps=cfg.norm_eps) if cfg.pre_norms else x   # (T, D)
    if cfg.n_expert:
        y = moe_ffn(cfg, blk, h)
        return y + shared_expert(cfg, blk, h) if cfg.n_ff_shexp else y
    if cfg.fused_gate_up:
        gu = ops.linear(h, blk["ffn_up.weight"])                                   # (T, 2F)
        g, u = gu[:, :F], gu[:, F:]
    else:
        g, u = ops.linear(h, blk["ffn_gate.weight"]), ops.linear(h, blk["ffn_up.weight"])   # (T, F)
    o = ops.linear(glu(cfg, g, u), blk["ffn_down.weight"])                        # (T, D)
    if cfg.post_norms:
        o = ops.rms_norm(o, blk["post_ffw_norm.weight"], eps=cfg.norm_eps)
    return o


def moe_ffn(cfg: ModelConfig, blk: Layer, h):
    """A mixture of gated experts, as llama.cpp's build_moe_ffn: each token's router probabilities pick its
    top k experts, whose outputs are summed weighted by those probabilities (``expert_gating``: a softmax
    over all experts, or over the top k logits only)."""
    T, D, k, F = h.shape[0], cfg.n_embd, cfg.n_expert_used, cfg.n_ff_exp
    logits = ops.linear(h, blk["ffn_gate_inp.weight"], blk.get("ffn_gate_inp.bias"))   # (T, E), router [E, D]
    if cfg.expert_gating == "softmax_weight":                                     # gpt-oss: the top k logits,
        weight, chosen = ops.top_k(logits, k)                                     # then softmax over those
        weight = ops.softmax(weight)                                              # (T, k), i32 (T, k)
    else:
        weight, chosen = ops.top_k(ops.softmax(logits), k)                        # (T, k), i32 (T, k)
    if cfg.expert_weights_norm:                                                   # ggml clamps the sum at f16's
        weight = weight / ops.maximum(ops.reduce_sum(weight), 6.103515625e-5)     # smallest normal
    g = expert_bias(blk, "ffn_gate_exps", chosen, ops.expert_linear(h, blk["ffn_gate_exps.weight"], chosen))
    u = expert_bias(blk, "ffn_up_exps", chosen, ops.expert_linear(h, blk["ffn_up_exps.weight"], chosen))
    a = glu(cfg, g, u).reshape(T * k, F)                                          # (T, k, F) -> a row per
    y = ops.expert_linear(a, blk["ffn_down_exps.weight"], chosen.reshape(T * k, 1))   # (token, expert); [E, D, F]
    y = expert_bias(blk, "ffn_down_exps", chosen, y.reshape(T, k, D)) * weight.reshape(T, k, 1)
    return ops.reduce_sum(ops.transpose(y, (0, 2, 1))).reshape(T, D)              # the k experts summed


def expert_bias(blk: Layer, name: str, chosen, y):
    """y (T, k, N) plus each chosen expert's bias row, where the file has ``<name>.bias`` [E, N] (gpt-oss)."""
    b = blk.get(name + ".bias")
    return y if b is None else y + ops.take(b, chosen)                            # (T, k, N)


def glu(cfg: ModelConfig, g, u):
    """The gated FFN activation of gate g and up u: silu(g)·u, ggml's GELU(g)·u, or gpt-oss's clamped SwiGLU."""
    if cfg.act == "swiglu_oai":
        return swiglu_oai(g, u, alpha=1.702, limit=7.0)
    return ops.swiglu(g, u) if cfg.act == "silu" else ops.gelu_tanh(g, f16_table=True) * u   # ggml's GELU


def _np_swiglu_oai(g, u, *, alpha, limit):
    x, y = np.minimum(g, np.float32(limit)), np.clip(u, np.float32(-limit), np.float32(limit))
    with np.errstate(over="ignore"):                                              # exp(-alpha x) = inf: 0
        return (x / (np.exp(np.float32(alpha) * -x) + np.float32(1)) * (y + np.float32(1))).astype(np.float32)


@ops.composite("swiglu_oai", _np_swiglu_oai)
def swiglu_oai(g, u, *, alpha, limit):
    """gpt-oss's clamped SwiGLU as ggml_swiglu_oai computes it: x·σ(alpha·x)·(y + 1) with x = min(g, limit)
    and y = clamp(u, -limit, limit)."""
    x = -ops.maximum(-g, -limit)                                                  # min(g, limit)
    y = -ops.maximum(-ops.maximum(u, -limit), -limit)                             # clamp(u, -limit, limit)
    return x / (ops.exp(-x * alpha) + 1.0) * (y + 1.0)


def shared_expert(cfg: ModelConfig, blk: Layer, h):
    """A SwiGLU FFN every token takes beside the routed experts; qwen2moe's is scaled by a sigmoid gate of
    its own, as llama.cpp computes it (the sigmoid as silu(z) / z), granite's has none."""
    g, u = ops.linear(h, blk["ffn_gate_shexp.weight"]), ops.linear(h, blk["ffn_up_shexp.weight"])   # (T, Fs)
    y = ops.linear(ops.swiglu(g, u), blk["ffn_down_shexp.weight"])                # (T, D)
    if blk.get("ffn_gate_inp_shexp.weight") is None:                              # granite: ungated
        return y
    z = ops.linear(h, blk["ffn_gate_inp_shexp.weight"].reshape(1, cfg.n_embd))    # (T, 1): the gate [D] (or [1, D])
    return y * (ops.silu(z) / z)
