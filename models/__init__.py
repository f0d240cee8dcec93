"""Model architectures: a config read from GGUF metadata, and one shared traced decoder.

Architectures are registered by name (``register_architecture``, see ``registry.py``); the
shipped ones are llama (Mixtral's experts too), qwen2, phi3, gemma2, gemma3, qwen3, qwen3moe, qwen2moe, olmo2,
olmoe, gpt-oss, and the recurrent and hybrid lfm2, mamba2, granitehybrid and qwen3next; plugins add more.

    model = ggraph.models.load("model.gguf")
    graph = model.graph(ctx=4096)            # prefill/decode step: tokens, P, KV caches -> logits

An architecture with recurrent layers (``register_architecture(..., states=...)``) has KV caches
for its other layers only (``kv_layers``), and its step graph takes and returns its recurrent
states (``state_avals()``) after the caches, writing them in place like the caches.
"""
from __future__ import annotations

from pathlib import Path

from ggraph.ir.dtypes import Aval, dim, f32, i32, param
from ggraph.ir.graph import Graph
# the shipped architectures register themselves, in this order
from ggraph.models import (llama, qwen2, phi3, gemma2, gemma3, qwen3, qwen3moe, olmo2, olmoe,  # noqa: F401,I001
                           qwen2moe, gpt_oss, lfm2, mamba2, granitehybrid, qwen3next)
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
    def stateful(self) -> bool:
        """The architecture declares recurrent states (``register_architecture(..., states=...)``)."""
        return architecture(self.config.arch).states is not None

    @property
    def batched(self) -> bool:
        """Steps of several sequences can share one graph (``batch_graph``): the shared decoder's."""
        return architecture(self.config.arch).forward is None

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache: all but ``config.recurrent_layers``."""
        skip = set(self.config.recurrent_layers)
        return tuple(i for i in range(self.config.n_layer) if i not in skip)

    def state_avals(self) -> list[dict[str, Aval]]:
        """Each layer's recurrent state for one sequence, {name: Aval} (empty for a layer without), as the
        architecture declares it; checked once."""
        if getattr(self, "_state_avals", None) is None:
            self._state_avals = checked_states(self.config, architecture(self.config.arch))
        return [dict(d) for d in self._state_avals]

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
        kind = "hidden" if output == "hidden" else "last" if last_only else "all"
        if self.stateful or cfg.recurrent_layers:
            return self._recurrent_graph(forward, k_aval, v_aval, factors, last_only, extra, f"{cfg.arch}_{kind}")

        def step(tokens, P, k, v, w):
            return forward(cfg, w, tokens, P, k, v, last_only=last_only,
                           rope_factors=w[factors] if factors else None, **extra)
        return trace(step, i32["T"], dim("P"), [k_aval] * cfg.n_layer, [v_aval] * cfg.n_layer,
                     self.weights, name=f"{cfg.arch}_{kind}")

    def _recurrent_graph(self, forward, k_aval, v_aval, factors, last_only, extra, name) -> Graph:
        """The step of a model with recurrent layers: (tokens, P, KV caches of ``kv_layers``, states
        flattened layer by layer in declared order, weights) -> (logits, caches, states), each state
        written back over its input (``state_write``)."""
        from ggraph.ir.prims import state_write
        from ggraph.ir.trace import scope, trace
        cfg, kv, declared = self.config, self.kv_layers, self.state_avals()
        flat = [(i, n, a) for i, layer in enumerate(declared) for n, a in layer.items()]
        stateful = self.stateful

        def layers(caches):                  # None for the recurrent layers
            at = dict(zip(kv, caches))
            return [at.get(i) for i in range(cfg.n_layer)]

        def step(tokens, P, k, v, state, w):
            states = [{} for _ in range(cfg.n_layer)]
            for (i, n, _), x in zip(flat, state):
                states[i][n] = x
            kw = dict(states=states) if stateful else {}
            out = forward(cfg, w, tokens, P, layers(k), layers(v), last_only=last_only,
                          rope_factors=w[factors] if factors else None, **kw, **extra)
            want = 4 if stateful else 3
            if not isinstance(out, (tuple, list)) or len(out) != want:
                raise TypeError(f"architecture {cfg.arch!r}: its forward must return (logits, k_caches, v_caches"
                                f"{', states' if stateful else ''}), got {type(out).__name__}"
                                f"{f' of {len(out)}' if isinstance(out, (tuple, list)) else ''}")
            logits, k_out, v_out = out[:3]
            k_out, v_out = (check_caches(cfg, c, what) for c, what in ((k_out, "K"), (v_out, "V")))
            if not stateful:
                return logits, k_out, v_out
            new = check_returned_states(cfg, out[3], declared)
            written = []
            for (i, n, _), x in zip(flat, state):
                with scope(f"blk.{i}"):
                    written.append(state_write(x, new[i][n]))
            return logits, k_out, v_out, written

        n = len(kv)
        return trace(step, i32["T"], dim("P"), [k_aval] * n, [v_aval] * n, [a for _, _, a in flat], self.weights,
                     name=name)

    def batch_graph(self, slots: int, ctx: int, cache_types=(f32, f32)) -> Graph:
        """The step of a batch of sequences: (tokens, seq, positions i32[T], pick i32[R], slotted
        k/v caches of slots*ctx rows, weights) -> (logits (R, V), caches); token t is at
        positions[t] of sequence seq[t], and ``pick`` names the rows to take logits from (each
        sampling sequence's last token)."""
        from ggraph.ir.trace import trace
        from ggraph.models.transformer import forward_batch
        cfg = self.config
        if not self.batched:
            raise ValueError(f"architecture {cfg.arch!r} has a forward of its own: batched steps need the shared "
                             f"decoder (Batch runs such a model one slot at a time)")
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


def checked_states(cfg, arch: Architecture) -> list[dict[str, Aval]]:
    """``arch.states(cfg)`` checked: one dict per layer of name -> Aval (a shape alone is f32) with a
    static shape and a plain element type."""
    if arch.states is None:
        return [{} for _ in range(cfg.n_layer)]
    where = f"architecture {cfg.arch!r} ({arch.origin})"
    got = arch.states(cfg)
    if not isinstance(got, (list, tuple)) or len(got) != cfg.n_layer:
        raise ValueError(f"{where}: states(cfg) must return one dict per layer ({cfg.n_layer}), got "
                         f"{type(got).__name__}" + (f" of {len(got)}" if isinstance(got, (list, tuple)) else ""))
    out = []
    for i, layer in enumerate(got):
        if not isinstance(layer, dict):
            raise TypeError(f"{where}: layer {i}'s states must be a dict of name -> Aval, got {type(layer).__name__}")
        avals = {}
        for name, a in layer.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"{where}: layer {i} has a state named {name!r}: names are non-empty strings")
            if isinstance(a, (tuple, list)):
                a = Aval(a, f32)
            ok = isinstance(a, Aval) and type(a) is Aval and all(
                isinstance(d, int) and d > 0 for d in a.shape) and a.dtype.np_dtype is not None
            if not ok:
                raise ValueError(f"layer {i} state {name!r}: {a!r} must be an Aval of a static positive shape "
                                 f"and a plain type, e.g. f32[4, 64] ({where})")
            avals[name] = a
        out.append(avals)
    return out


def check_caches(cfg, caches, what: str) -> list:
    """The KV caches a forward returned: one per layer, None exactly for ``recurrent_layers``; -> the
    KV layers' caches."""
    if not isinstance(caches, (list, tuple)) or len(caches) != cfg.n_layer:
        raise ValueError(f"architecture {cfg.arch!r}: its forward must return {cfg.n_layer} {what} caches (None for "
                         f"recurrent layers), got {type(caches).__name__}"
                         + (f" of {len(caches)}" if isinstance(caches, (list, tuple)) else ""))
    recurrent = set(cfg.recurrent_layers)
    for i, c in enumerate(caches):
        if i in recurrent and c is not None:
            raise ValueError(f"architecture {cfg.arch!r}: layer {i} is in recurrent_layers (no KV cache) but the "
                             f"forward returned a {what} cache for it")
        if i not in recurrent and c is None:
            raise ValueError(f"architecture {cfg.arch!r}: layer {i} is not in recurrent_layers but the forward "
                             f"returned no {what} cache for it (a layer without attention belongs in "
                             f"recurrent_layers)")
    return [c for i, c in enumerate(caches) if i not in recurrent]


def check_returned_states(cfg, states, declared: list[dict[str, Aval]]) -> list[dict]:
    """The states a forward returned: the declared structure, each with the aval it came in with."""
    from ggraph.ir.trace import Tracer
    if not isinstance(states, (list, tuple)) or len(states) != cfg.n_layer:
        raise ValueError(f"architecture {cfg.arch!r}: its forward must return {cfg.n_layer} layers of states, got "
                         f"{type(states).__name__}"
                         + (f" of {len(states)}" if isinstance(states, (list, tuple)) else ""))
    for i, (got, want) in enumerate(zip(states, declared)):
        if not isinstance(got, dict) or set(got) != set(want):
            names = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise ValueError(f"architecture {cfg.arch!r}: layer {i}'s states came back as {names}, declared "
                             f"{sorted(want)}")
        for name, a in want.items():
            x = got[name]
            aval = x.aval if isinstance(x, Tracer) else None
            if aval is None or aval.shape != a.shape or aval.dtype is not a.dtype:
                raise ValueError(f"architecture {cfg.arch!r}: layer {i} state {name!r} came back as "
                                 f"{aval if aval is not None else type(x).__name__}, declared {a}")
    return states


def load(path) -> Model:
    """Open a GGUF model (zero-copy) and read its config."""
    import os
    from ggraph.gguf import GGUFFile
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a model is a GGUF file's path (str or os.PathLike), got {type(path).__name__} {path!r}"[:200])
    return Model(GGUFFile(str(Path(path))))
