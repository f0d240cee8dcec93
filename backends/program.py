"""``Program``: the calling convention both backends share, each argument checked (``backends/inputs.py``).

    fn = ggraph.compile(graph, backend="llvm", weights=w)
    y = fn(x)                  # the graph's non-weight arguments; weights come from `w`
    y = fn(x, w0, w1)          # or every argument, as traced (None keeps a bound weight)
    outs = fn.run_inputs([x])  # the graph's inputs in order, flat outputs
"""
from __future__ import annotations

import numpy as np

from ggraph.backends.inputs import as_value, as_written, weight_value, written_inputs
from ggraph.ir.graph import Graph, Var
from ggraph.ir.trace import tree_flatten, tree_unflatten


class Program:
    """The calling convention both backends share; subclasses give ``run(values, first=None)`` (the
    outputs, or only the ``first`` few) and ``bind(var, value)``."""

    graph: Graph
    bound: set                                   # param vars that have a weight

    def __call__(self, *args):
        g = self.graph
        leaves, _ = tree_flatten(list(args))
        plain = [v for v in g.args if v not in g.params]
        if len(leaves) == len(g.args):
            pairs = list(zip(g.args, leaves))
        elif len(leaves) == len(plain) and all(v in self.bound for v in g.params):
            pairs = list(zip(plain, leaves))       # the weights given at compile time stay bound
        else:
            raise TypeError(f"{g.name or 'graph'} takes {len(g.args)} array arguments"
                            + (f" (or {len(plain)} without the weights bound at compile time)" if g.params else "")
                            + f", got {len(leaves)}")
        values = {}
        for v, x in pairs:
            if v in g.params:
                if x is not None:
                    self.bind(v, as_value(v.aval, x, f"weight {v.aval.source!r}"))
                elif v not in self.bound:
                    raise KeyError(f"no value for weight {v.aval.source!r}")
            else:
                values[v] = self._input(v, x, f"input {v.hint or g.invars.index(v)}")
        outs = self.run(values)
        return tree_unflatten(g.out_tree, outs) if g.out_tree is not None else outs

    def run_inputs(self, inputs: list, first: int | None = None) -> list:
        """Run with the graph's non-weight inputs in order; weights come from ``bind_weights``. With
        ``first``, only that many leading outputs come back (a decode step's logits, not the caches
        it updated in place)."""
        g = self.graph
        if len(inputs) != len(g.invars):
            raise TypeError(f"{g.name or 'graph'} has {len(g.invars)} inputs, got {len(inputs)}")
        return self.run({v: self._input(v, x, f"input {v.hint or i}") for i, (v, x) in enumerate(zip(g.invars, inputs))},
                        first)

    def _input(self, v: Var, x, what: str):
        written = self.__dict__.get("_written")
        if written is None:
            written = self.__dict__["_written"] = written_inputs(self.graph)
        if v not in written:
            return as_value(v.aval, x, what)
        # An array the program updates in place (a KV cache) is the caller's own, never a copy, and
        # the same one step after step: it is checked again only when it is another array, or this
        # one with another shape, dtype or flags.
        checked = self.__dict__.setdefault("_checked", {})
        seen = checked.get(v)
        flags = x.flags if isinstance(x, np.ndarray) else None
        key = (x.shape, x.dtype, flags.writeable, flags.c_contiguous) if flags is not None else None
        if seen is not None and seen[0] is x and seen[1] == key:
            return seen[2]
        value = as_written(v.aval, x, what)
        checked[v] = (x, key, value)
        return value

    def bind_weights(self, weights) -> None:
        """Bind every param by its source name from a GGUFFile or a {name: array} mapping."""
        for v in self.graph.params:
            self.bind(v, weight_value(v.aval, weights))
