"""Tracer operators and methods, spelled as numpy spells them: ``x + y``, ``x @ w``, ``x[:, :64]``,
``x.reshape(T, H, D)``, ``x.T``, ``x.astype("f16")``, ``x.sum()``, ``x < y`` (an i8 mask; ``==`` stays
Python's identity test, so Tracers still hash: ``ops.equal`` compares values).

Each records the primitives of ``ggraph.ir.prims``; importing this module attaches them to
``Tracer`` (as JAX's array methods attach to its tracers).
"""
from __future__ import annotations

import numpy as np

from ggraph.ir import prims as P
from ggraph.ir.trace import Tracer, to_atom


def dot(a, b):
    """``a @ b`` with numpy meaning: a[..., M, K], b[..., K, N]."""
    b = b if isinstance(b, Tracer) else Tracer(to_atom(b))
    perm = tuple(range(b.ndim - 2)) + (b.ndim - 1, b.ndim - 2)
    return P.matmul(a, P.transpose(b, perm))


def index(x, idx):
    """Basic indexing with ints and step-1 slices, as ``x[:, 0:64]`` or ``x[..., 3]``."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if sum(i is Ellipsis for i in idx) > 1:
        raise IndexError("only one ... is allowed in an index")
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (np.s_[:],) * (x.ndim - len(idx) + 1) + idx[k + 1:]
    if len(idx) > x.ndim:
        raise IndexError(f"too many indices ({len(idx)}) for {x.aval}")
    drop = []
    for axis, i in enumerate(idx):
        d = x.shape[axis]
        if isinstance(i, (int, np.integer)):
            if not isinstance(d, int) or not -d <= i < d:
                raise IndexError(f"index {i} out of range for axis {axis} of {x.aval}")
            i = int(i) % d
            x = P.slice(x, axis, i, i + 1)
            drop.append(axis)
        elif isinstance(i, slice):
            if i.step not in (None, 1):
                raise IndexError(f"only step-1 slices are supported, got {i}")
            start = 0 if i.start is None else i.start
            stop = d if i.stop is None else i.stop
            if isinstance(d, int) and isinstance(start, int) and isinstance(stop, int):
                start, stop, _ = slice(start, stop).indices(d)
            if (start, stop) != (0, d):
                x = P.slice(x, axis, start, stop)
        else:
            raise IndexError(f"unsupported index {i!r}; use ints and slices")
    if drop:
        x = P.reshape(x, [d for a, d in enumerate(x.shape) if a not in drop])
    return x


def _reshape(self, *shape):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return P.reshape(self, shape)


def _transpose(self, *perm):
    perm = perm[0] if len(perm) == 1 and isinstance(perm[0], (tuple, list)) else perm
    return P.transpose(self, perm or tuple(reversed(range(self.ndim))))


def _integers(op: str, x, y):
    """Operands of an integer-only operator: ``//`` floors integers (ops.div); floats have no floor op."""
    for a in (x, y):
        if isinstance(a, Tracer) and a.dtype.is_float or isinstance(a, float):
            raise TypeError(f"{op} is integer division; for {a.aval if isinstance(a, Tracer) else a!r} use /")
    return x, y


def _floats(op: str, x, y):
    """Operands of ``/``, which numpy makes a float division: integer tracers must say which they mean."""
    for a in (x, y):
        if isinstance(a, Tracer) and not a.dtype.is_float:
            raise TypeError(f"/ of {a.aval}: use // for integer (floor) division, or cast to f32 first")
    return x, y


_METHODS = {
    "__add__": P.add, "__radd__": lambda s, o: P.add(o, s),
    "__sub__": P.sub, "__rsub__": lambda s, o: P.sub(o, s),
    "__mul__": P.mul, "__rmul__": lambda s, o: P.mul(o, s),
    "__truediv__": lambda s, o: P.div(*_floats("/", s, o)), "__rtruediv__": lambda s, o: P.div(*_floats("/", o, s)),
    "__floordiv__": lambda s, o: P.div(*_integers("//", s, o)),
    "__rfloordiv__": lambda s, o: P.div(*_integers("//", o, s)),
    "__neg__": P.neg,
    "__matmul__": dot, "__rmatmul__": lambda s, o: dot(o, s),
    "__lt__": P.less, "__gt__": P.greater, "__le__": P.less_equal, "__ge__": P.greater_equal,
    "__getitem__": index,
    "reshape": _reshape,
    "transpose": _transpose,
    "T": property(lambda s: _transpose(s)),
    "astype": P.cast,
    "sum": P.reduce_sum,
    "max": P.reduce_max,
}
for _name, _fn in _METHODS.items():
    setattr(Tracer, _name, _fn)
