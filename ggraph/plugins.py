"""Plugins: Python files or installed packages that register architectures (and ops) with ggraph.

A plugin is loaded from
- ``--plugin FILE.py`` on any ``ggraph`` command (repeatable),
- ``$GGRAPH_PLUGINS``: plugin files separated by ``:``,
- the ``ggraph.architectures`` entry-point group of installed packages: each entry names a
  module (registration happens on import) or a function taking no arguments.

A plugin usually calls ``ggraph.models.register_architecture(name, flags=..., forward=...)``.
A plugin that fails to load raises ``PluginError`` naming it and what went wrong.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import types
from pathlib import Path

ENTRY_POINT_GROUP = "ggraph.architectures"
ENV = "GGRAPH_PLUGINS"
_loaded: dict[str, types.ModuleType | object] = {}     # resolved path or entry point -> what it loaded
_defaults_done = False


class PluginError(ImportError):
    """A plugin failed to load; the message names the plugin."""


def load_file(path) -> types.ModuleType:
    """Import a plugin file once (loading it again is a no-op)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise PluginError(f"plugin {path}: no such file")
    key = str(p.resolve())
    if key in _loaded:
        return _loaded[key]
    name = f"ggraph_plugin_{p.stem}_{len(_loaded)}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise PluginError(f"plugin {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:       # a plugin's sys.exit() is its failure, not ggraph's exit
        sys.modules.pop(name, None)
        raise PluginError(f"plugin {path} failed to import: {type(e).__name__}: {e}") from e
    _loaded[key] = module
    return module


def load_entry_points() -> list:
    """Load every plugin of the ``ggraph.architectures`` entry-point group (each once)."""
    out = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = f"entry point {ep.name} = {ep.value}"
        if key in _loaded:
            continue
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, types.ModuleType):
                obj()
        except Exception as e:
            raise PluginError(f"plugin {ep.name!r} ({ep.value}, entry point group {ENTRY_POINT_GROUP}) failed to "
                              f"load: {type(e).__name__}: {e}") from e
        _loaded[key] = obj
        out.append(obj)
    return out


def load_env() -> list:
    """Load the plugin files named in $GGRAPH_PLUGINS (separated by ':')."""
    return [load_file(p) for p in os.environ.get(ENV, "").split(os.pathsep) if p.strip()]


def load_defaults() -> None:
    """Load the entry-point and $GGRAPH_PLUGINS plugins, once per process."""
    global _defaults_done
    if _defaults_done:
        return
    _defaults_done = True
    load_entry_points()
    load_env()
