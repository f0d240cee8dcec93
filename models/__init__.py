"""Model architectures: a config read from GGUF metadata, and one shared traced decoder.

Architectures are registered by name (``register_architecture``, see ``registry.py``); the
shipped ones are llama (Mixtral's experts too), qwen2, phi3, gemma2, gemma3, qwen3, qwen3moe, qwen2moe, olmo2,
olmoe and gpt-oss, and plugins add more.

    model = ggraph.models.load("model.gguf")
    graph = model.graph(ctx=4096)            # prefill/decode step: tokens, P, KV caches -> logits
"""
from __future__ import annotations

from pathlib import Path

from ggraph.ir.dtypes import Aval, dim, f32, i32, param
from ggraph.ir.graph import Graph
# the shipped architectures register themselves, in this order
from ggraph.models import (llama, qwen2, phi3, gemma2, gemma3, qwen3, qwen3moe, olmo2, olmoe,  # noqa: F401,I001
                           qwen2moe, gpt_oss)
from ggraph.models.registry import ARCHITECTURES, Architecture, architecture, register_architecture

__all__ = ["ARCHITECTURES", "Architecture", "Model", "architecture", "load", "register_architecture"]


class Model:
    """A GGUF model: its config, its weights' avals, and the traced step graph."""

    def __init__(self, gguf):
        from ggraph.models import validate
        from ggraph.models.config import config_from_gguf
        self.file = gguf
        emb = gguf.tensors.get("token_embd.weight")
        self.config = config_from_gguf(gguf.metadata, gguf.tensors.keys(), emb.shape[0] if emb is not None else 0)
        validate.check(self.config, gguf.tensors, gguf.metadata,
                       shared_decoder=architecture(self.config.arch).forward is None)

    @property
    def weights(self) -> dict:
        """Every tensor as a param aval named by its GGUF name."""
        return {name: param(name, Aval(t.shape, t.dtype)) for name, t in self.file.tensors.items()}

    def kv_shapes(self, ctx: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        c = self.config
        return (ctx, c.n_head_kv, c.head_dim), (ctx, c.n_head_kv, c.head_dim_v)

    def kv_avals(self, ctx: int, cache_types=(f32, f32)) -> tuple[Aval, Aval]:
        """One layer's K and V cache avals: (ctx, kv heads, head dim) of the cache types (K, V)."""
        (kshape, vshape), (kt, vt) = self.kv_shapes(ctx), cache_types
        for what, t, shape in (("K", kt, kshape), ("V", vt, vshape)):
            if shape[2] % t.block_size:
                raise ValueError(f"a {t} {what} cache needs a head dim that is a multiple of {t.block_size}; "
                                 f"this model's is {shape[2]}")
        return Aval(kshape, kt), Aval(vshape, vt)

    def graph(self, ctx: int = 4096, last_only: bool = False, cache_types=(f32, f32), output: str = "logits") -> Graph:
        """The step graph: (tokens i32[T], P, k_caches, v_caches, weights) -> (logits, k_caches, v_caches).
        The caches hold ``cache_types`` (K, V): f32, f16, bf16, q8_0 or q4_0. ``output="hidden"`` gives
        the final hidden state (T, D) instead of logits (for embeddings)."""
        import inspect
        from ggraph.ir.trace import trace
        from ggraph.models.transformer import forward as shared
        if output not in ("logits", "hidden"):
            raise ValueError(f"output must be 'logits' or 'hidden', got {output!r}")
        cfg = self.config
        forward = architecture(cfg.arch).forward or shared
        extra = {}
        if output == "hidden":
            if "output" not in inspect.signature(forward).parameters:
                raise ValueError(f"architecture {cfg.arch!r}: its forward takes no output='hidden', which "
                                 "embeddings need (see ggraph.models.transformer.forward)")
            extra["output"] = "hidden"
        k_aval, v_aval = self.kv_avals(ctx, cache_types)
        factors = self._rope_factors_name(ctx)

        def step(tokens, P, k, v, w):
            return forward(cfg, w, tokens, P, k, v, last_only=last_only,
                           rope_factors=w[factors] if factors else None, **extra)
        kind = "hidden" if output == "hidden" else "last" if last_only else "all"
        return trace(step, i32["T"], dim("P"), [k_aval] * cfg.n_layer, [v_aval] * cfg.n_layer,
                     self.weights, name=f"{cfg.arch}_{kind}")

    def batch_graph(self, slots: int, ctx: int, cache_types=(f32, f32)) -> Graph:
        """The step of a batch of sequences: (tokens, seq, positions i32[T], pick i32[R], slotted
        k/v caches of slots*ctx rows, weights) -> (logits (R, V), caches); token t is at
        positions[t] of sequence seq[t], and ``pick`` names the rows to take logits from (each
        sampling sequence's last token)."""
        from ggraph.ir.trace import trace
        from ggraph.models.transformer import forward_batch
        cfg = self.config
        if architecture(cfg.arch).forward is not None:
            raise ValueError(f"architecture {cfg.arch!r} has a forward of its own: batched steps need the shared decoder")
        k_aval, v_aval = self.kv_avals(slots * ctx, cache_types)
        factors = self._rope_factors_name(ctx)

        def step(tokens, seq, positions, pick, k, v, w):
            return forward_batch(cfg, w, tokens, seq, positions, pick, k, v, slot_rows=ctx,
                                 rope_factors=w[factors] if factors else None)
        return trace(step, i32["T"], i32["T"], i32["T"], i32["R"], [k_aval] * cfg.n_layer, [v_aval] * cfg.n_layer,
                     self.weights, name=f"{cfg.arch}_batch{slots}")

    def _rope_factors_name(self, ctx: int) -> str | None:
        """The tensor of rope frequency factors: llama 3.1+'s rope_freqs, or phi3's long (past the original
        context) or short factors, as llama.cpp's get_rope_factors picks them."""
        if not self.config.rope_freq_factors:
            return None
        if self.config.rope_freq_factors == "rope_freqs":
            return "rope_freqs.weight"
        long = ctx > (self.config.n_ctx_orig or self.config.n_ctx_train)
        name = f"rope_factors_{'long' if long else 'short'}.weight"
        if name not in self.file.tensors:
            other = f"rope_factors_{'short' if long else 'long'}.weight"
            name = other
        return name


def load(path) -> Model:
    """Open a GGUF model (zero-copy) and read its config."""
    import os
    from ggraph.gguf import GGUFFile
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a model is a GGUF file's path (str or os.PathLike), got {type(path).__name__} {path!r}"[:200])
    return Model(GGUFFile(str(Path(path))))
