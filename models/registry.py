"""The architectures ggraph can run, by their GGUF ``general.architecture`` name.

    register_architecture("mylm", flags=mylm_flags)                   # the shared decoder, new flags
    register_architecture("mylm", flags=mylm_flags, forward=mylm)     # a decoder of its own

``flags(key, names, n_layer) -> dict`` maps a file's metadata to ``ModelConfig`` fields:
``key("attention.head_count")`` reads ``<arch>.attention.head_count``, ``names`` is the set of
tensor names, ``n_layer`` the block count. With a ``forward`` of its own, keys that are not
ModelConfig fields are kept in ``cfg.extra``. ``forward(cfg, w, tokens, P, k_caches, v_caches,
*, last_only, rope_factors)`` has the signature of ``ggraph.models.transformer.forward``.
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
    origin: str = ""                    # the module or plugin file that registered it


ARCHITECTURES: dict[str, Architecture] = {}


def register_architecture(name: str, flags: Callable, forward: Callable | None = None, *,
                          replace: bool = False) -> Architecture:
    """Make ``name`` a runnable ``general.architecture``. Registering a name again from where it was
    registered before (a notebook cell run twice) replaces it; from elsewhere it needs ``replace=True``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_architecture: the name must be a non-empty string, got {name!r}")
    if not callable(flags):
        raise TypeError(f"register_architecture({name!r}): flags must be a function (key, names, n_layer) -> dict")
    if forward is not None and not callable(forward):
        raise TypeError(f"register_architecture({name!r}): forward must be a function or None")
    origin = definition_site()
    if name in ARCHITECTURES and not replace and ARCHITECTURES[name].origin != origin:
        raise ValueError(f"architecture {name!r} is already registered by {ARCHITECTURES[name].origin}; {origin} "
                         f"registers it again: rename one, or pass replace=True to override it")
    arch = Architecture(name, flags, forward, origin)
    ARCHITECTURES[name] = arch
    return arch


def architecture(name: str) -> Architecture:
    """The registered architecture ``name``; plugins (entry points, $GGRAPH_PLUGINS) are loaded first."""
    from ggraph import plugins
    plugins.load_defaults()
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)} "
                         f"(add one with ggraph.models.register_architecture, in a --plugin file or the "
                         f"'{plugins.ENTRY_POINT_GROUP}' entry-point group)")
    return ARCHITECTURES[name]
