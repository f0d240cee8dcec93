"""The architectures ggraph can run, by their GGUF ``general.architecture`` name.

    register_architecture("mylm", flags=mylm_flags)                   # the shared decoder, new flags
    register_architecture("mylm", flags=mylm_flags, forward=mylm)     # a decoder of its own
    register_architecture("mylm", flags=mylm_flags, forward=mylm, states=mylm_states)   # recurrent layers

``flags(key, names, n_layer) -> dict`` maps a file's metadata to ``ModelConfig`` fields:
``key("attention.head_count")`` reads ``<arch>.attention.head_count``, ``names`` is the set of
tensor names, ``n_layer`` the block count. With a ``forward`` of its own, keys that are not
ModelConfig fields are kept in ``cfg.extra``. ``forward(cfg, w, tokens, P, k_caches, v_caches,
*, last_only, rope_factors)`` has the signature of ``ggraph.models.transformer.forward``.

Recurrent state. An architecture whose layers carry a state from step to step (a convolution's
last inputs, a state-space or linear-attention state) declares it with ``states(cfg) ->
list[dict[str, Aval]]``: one dict per layer (empty for a layer without), the state of ONE
sequence (no batch axis; ``ggraph.ir.dtypes.f32[4, 256]``, f32 unless it says otherwise). Its
flags set ``recurrent_layers``, the layers that have no KV cache. Its forward is then

    forward(cfg, w, tokens, P, k_caches, v_caches, *, states, last_only=False, rope_factors=None)
        -> (logits, k_caches, v_caches, states)

``k_caches[i]``/``v_caches[i]`` are None for the layers in ``cfg.recurrent_layers`` (only for
them); ``states`` is the list of per-layer dicts of the step's incoming state, and the forward
returns the state after the step's last token in the same structure, shapes and types. The
runtime keeps states beside the KV caches (zeroed for a new sequence, in place, snapshots for
prefix reuse: ``ggraph.runtime.session``); ``Model.graph`` writes them back (``state_write``).
Plugins register architectures the same way (``ggraph.plugins``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from ggraph.ir.primitive import definition_site


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str
    flags: Callable
    forward: Callable | None = None     # None: the shared decoder (models/transformer.py)
    states: Callable | None = None      # cfg -> one {name: Aval} per layer: the recurrent state it carries
    origin: str = ""                    # the module or plugin file that registered it


ARCHITECTURES: dict[str, Architecture] = {}


def register_architecture(name: str, flags: Callable, forward: Callable | None = None, *,
                          states: Callable | None = None, replace: bool = False) -> Architecture:
    """Make ``name`` a runnable ``general.architecture``. Registering a name again from where it was
    registered before (a notebook cell run twice) replaces it; from elsewhere it needs ``replace=True``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_architecture: the name must be a non-empty string, got {name!r}")
    if not callable(flags):
        raise TypeError(f"register_architecture({name!r}): flags must be a function (key, names, n_layer) -> dict")
    if forward is not None and not callable(forward):
        raise TypeError(f"register_architecture({name!r}): forward must be a function or None")
    if states is not None and not callable(states):
        raise TypeError(f"register_architecture({name!r}): states must be a function cfg -> [{{name: Aval}}] per "
                        f"layer, or None")
    if states is not None and forward is None:
        raise ValueError(f"register_architecture({name!r}): states need a forward of its own that takes and "
                         f"returns them (the shared decoder has none)")
    if states is not None and not _takes(forward, "states"):
        raise TypeError(f"register_architecture({name!r}): with states, forward must take them: forward(cfg, w, "
                        f"tokens, P, k_caches, v_caches, *, states, last_only=False, rope_factors=None)")
    origin = definition_site()
    if name in ARCHITECTURES and not replace and ARCHITECTURES[name].origin != origin:
        raise ValueError(f"architecture {name!r} is already registered by {ARCHITECTURES[name].origin}; {origin} "
                         f"registers it again: rename one, or pass replace=True to override it")
    arch = Architecture(name, flags, forward, states, origin)
    ARCHITECTURES[name] = arch
    return arch


def _takes(fn: Callable, keyword: str) -> bool:
    """``fn`` accepts ``keyword=`` (by name, or through **kwargs); True when its signature cannot be read."""
    import inspect
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def architecture(name: str) -> Architecture:
    """The registered architecture ``name``; plugins (entry points, $GGRAPH_PLUGINS) are loaded first."""
    from ggraph import plugins
    plugins.load_defaults()
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)} "
                         f"(add one with ggraph.models.register_architecture, in a --plugin file or the "
                         f"'{plugins.ENTRY_POINT_GROUP}' entry-point group)")
    return ARCHITECTURES[name]
