"""Programmable attention: ``score_mod`` and ``mask_mod``, plain Python functions over scalars.

    def alibi(score, b, h, q_idx, kv_idx):                 # f32 score, i32 indices -> f32
        return score + ops.exp(ops.cast(h + 1, "f32") * -0.5) * ops.cast(kv_idx - q_idx, "f32")

    def chunked(b, h, q_idx, kv_idx):                      # -> an i8 mask: 1 where the key is seen
        return ops.equal(q_idx // 64, kv_idx // 64)

``ops.attention(..., score_mod=alibi, mask_mod=chunked)`` traces each function once, on scalar
tracers, into a ``Mod``: a small graph of elementwise ops that prints as one s-expression. The
numpy rule evaluates it on broadcast index arrays, the unfused decomposition inlines it on
tensors, and the fused attention kernels emit it inline on the registers holding a block of
scores (b is the sequence slot, 0 without slots; h the query head; q_idx the query's position;
kv_idx the key's). The causal mask always applies; mask_mod can only hide more keys.

Some mods are forms the kernels know better than per-key code, so ``canonical`` turns them into
the attention's structured params: ``c * tanh(score * (1/c))`` is ``softcap=c`` (ggml's order of
operations), ``q_idx - kv_idx < W`` in any of its linear spellings is ``window=W``, and
``q_idx // C == kv_idx // C`` is ``chunk=C``; a window or chunk bounds the range of keys the
kernels walk, where a general mask_mod is evaluated key by key.
"""
from __future__ import annotations

import inspect
import re

import numpy as np

from ggraph.ir import dtypes
from ggraph.ir.dtypes import Aval
from ggraph.ir.graph import Graph, Literal, Var, evaluate, inlined
from ggraph.ir.primitive import ShapeError, get_primitive

ARGS = {"score_mod": ("score", "b", "h", "q_idx", "kv_idx"), "mask_mod": ("b", "h", "q_idx", "kv_idx")}
_SHORT = {"score": "s", "b": "b", "h": "h", "q_idx": "q", "kv_idx": "kv"}     # names in the printed form


class Mod:
    """A traced score_mod or mask_mod: ``graph`` takes scalar (score f32,) b, h, q_idx, kv_idx (i32)
    and gives one scalar (f32 for score_mod, an i8 mask for mask_mod). Equal mods print alike."""

    __slots__ = ("kind", "graph", "text")

    def __init__(self, kind: str, graph: Graph):
        self.kind, self.graph = kind, graph
        self.text = _print(kind, graph)

    def __eq__(self, other):
        return isinstance(other, Mod) and (self.kind, self.text) == (other.kind, other.text)

    def __hash__(self):
        return hash((self.kind, self.text))

    def __str__(self):
        return self.text

    __repr__ = __str__

    def numpy(self, *args) -> np.ndarray:
        """The mod on numpy arrays that broadcast together (scores in any float type, indices int32)."""
        def apply(e, vals):
            return e.prim.impl(*vals, **e.params)
        return evaluate(self.graph, args, apply)[0]

    def inline(self, *args):
        """The mod's ops recorded again on tracers of any broadcasting shapes (the unfused form)."""
        from ggraph.ir.trace import Tracer, bind
        env = dict(zip(self.graph.invars, args))
        read = lambda a: env[a] if isinstance(a, Var) else Tracer(a)                  # noqa: E731
        for e in self.graph.eqns:
            env[e.outputs[0]] = bind(e.prim, *[read(a) for a in e.inputs], **e.params)
        return read(self.graph.outvars[0])


def trace_mod(kind: str, fn) -> Mod:
    """Trace ``fn`` (a score_mod or mask_mod) on scalar tracers; errors name the function."""
    from ggraph.ir.trace import trace_body
    names = ARGS[kind]
    what = f"attention: {kind} {getattr(fn, '__name__', repr(fn))}"
    if not callable(fn):
        raise TypeError(f"attention: {kind} must be a function of ({', '.join(names)}), got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(*names)
    except TypeError:
        raise TypeError(f"{what} must take {len(names)} arguments ({', '.join(names)})") from None
    except ValueError:                                       # a builtin without a signature: let the call say
        pass
    avals = [Aval((), dtypes.f32 if n == "score" else dtypes.i32) for n in names]
    try:
        graph = trace_body(fn, [Var(a, _SHORT[n]) for a, n in zip(avals, names)], {})
    except (ShapeError, TypeError, ValueError) as e:
        raise type(e)(f"{what}: {e}") from e
    graph = _flat(graph)
    if len(graph.outvars) != 1:
        raise ValueError(f"{what} must return one value, got {len(graph.outvars)}")
    for e in graph.eqns:
        if e.prim.kind != "elementwise":
            raise ValueError(f"{what}: {e.prim.name} is not an elementwise op (a mod sees one score at a time)")
        if e.outputs[0].aval.shape != ():
            raise ValueError(f"{what}: {e.prim.name} gives {e.outputs[0].aval}, not a scalar")
    out = graph.outvars[0].aval
    want = dtypes.f32 if kind == "score_mod" else dtypes.i8
    if out.shape != () or out.dtype is not want:
        hint = "a score" if kind == "score_mod" else "a mask (a comparison such as q_idx - kv_idx < 128)"
        raise ValueError(f"{what} must return {hint}: {want.name}[], got {out}")
    return Mod(kind, graph)


def _flat(graph: Graph) -> Graph:
    """The graph with composite bodies inlined, so that every eqn is a primitive."""
    subst: dict = {}
    eqns = inlined(graph, subst)
    outs = [subst.get(o, o) if isinstance(o, Var) else o for o in graph.outvars]
    return Graph(graph.invars, (), eqns, outs)


# -- the printed form: {s b h q kv -> (mul (tanh (mul s 0.02)) 50.0)} ---------------------------

def _print(kind: str, graph: Graph) -> str:
    names = {v: _SHORT[n] for v, n in zip(graph.invars, ARGS[kind])}
    made = graph.producers()

    def expr(a) -> str:
        if isinstance(a, Literal):
            v = a.value.item()
            return str(np.float32(v)) if a.aval.dtype.is_float else str(int(v))      # f32: shortest round trip
        if a in names:
            return names[a]
        e = made[a]
        params = "".join(f" :{k}={v}" for k, v in sorted(e.params.items()))
        return f"({e.prim.name}{params} {' '.join(expr(x) for x in e.inputs)})"
    return "{" + " ".join(names[v] for v in graph.invars) + " -> " + expr(graph.outvars[0]) + "}"


_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def parse_mod(text: str) -> Mod:
    """A Mod back from its printed form (graph text's parser calls this for ``{...}`` params)."""
    m = re.fullmatch(r"\{\s*([\w\s]+?)\s*->\s*(.*)\}", text.strip(), re.S)
    if not m:
        raise ValueError(f"attention mod {text!r}: expected {{args -> expression}}")
    short = m.group(1).split()
    kind = next((k for k, names in ARGS.items() if [_SHORT[n] for n in names] == short), None)
    if kind is None:
        raise ValueError(f"attention mod {text!r}: arguments must be 's b h q kv' or 'b h q kv'")
    from ggraph.ir.trace import Tracer, bind, trace_body
    tokens = _TOKEN.findall(m.group(2))

    def read(i: int, env: dict):
        if i >= len(tokens):
            raise ValueError(f"attention mod {text!r}: the expression ends early")
        tok = tokens[i]
        if tok == "(":
            prim, params, args = get_primitive(tokens[i + 1]), {}, []
            i += 2
            while i < len(tokens) and tokens[i] != ")":
                if tokens[i].startswith(":"):
                    k, _, v = tokens[i][1:].partition("=")
                    params[k] = _param_value(v)
                    i += 1
                    continue
                arg, i = read(i, env)
                args.append(arg)
            return bind(prim, *args, **params), i + 1
        if tok in env:
            return env[tok], i + 1
        if re.fullmatch(r"-?\d+", tok):
            return Tracer(Literal(int(tok), dtypes.i32)), i + 1
        return Tracer(Literal(np.float32(float(tok)), dtypes.f32)), i + 1

    def build(*xs):
        out, end = read(0, dict(zip(short, xs)))
        if end != len(tokens):
            raise ValueError(f"attention mod {text!r}: text after the expression")
        return out
    invars = [Var(Aval((), dtypes.f32 if s == "s" else dtypes.i32), s) for s in short]
    return Mod(kind, _flat(trace_body(build, invars, {})))


def _param_value(v: str):
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


# -- the forms the kernels know -----------------------------------------------------------------

def _linear(graph: Graph, a) -> dict | None:
    """An i32 atom as {input name or 1: coefficient}, if it is a sum of constant multiples of inputs."""
    names = {v: n for v, n in zip(graph.invars, ARGS["mask_mod"][-len(graph.invars):])}
    made = graph.producers()
    if isinstance(a, Literal):
        return {1: int(a.value)} if a.aval.dtype is dtypes.i32 and a.value.ndim == 0 else None
    if a in names:
        return {names[a]: 1}
    e = made.get(a)
    if e is None or e.prim.name not in ("add", "sub", "mul", "neg"):
        return None
    parts = [_linear(graph, x) for x in e.inputs]
    if any(p is None for p in parts):
        return None
    if e.prim.name == "neg":
        return {k: -c for k, c in parts[0].items()}
    if e.prim.name == "mul":
        const = [p for p in parts if set(p) <= {1}]
        if not const:
            return None
        c = const[0].get(1, 0)
        other = parts[1] if const[0] is parts[0] else parts[0]
        return {k: c * v for k, v in other.items()}
    sign = -1 if e.prim.name == "sub" else 1
    out = dict(parts[0])
    for k, c in parts[1].items():
        out[k] = out.get(k, 0) + sign * c
    return out


def window_of(mod: Mod) -> int | None:
    """W if the mask is ``q_idx - kv_idx < W`` in some linear spelling (``kv_idx > q_idx - W``, ...)."""
    g = mod.graph
    e = g.producers().get(g.outvars[0])
    ops = {"less": "<", "less_equal": "<=", "greater": ">", "greater_equal": ">="}
    if e is None or e.prim.name not in ops:
        return None
    lhs, rhs = (_linear(g, x) for x in e.inputs)
    if lhs is None or rhs is None:
        return None
    form = dict(lhs)                                          # lhs - rhs  (op)  0
    for k, c in rhs.items():
        form[k] = form.get(k, 0) - c
    q, kv, c = form.pop("q_idx", 0), form.pop("kv_idx", 0), form.pop(1, 0)
    if any(form.values()) or q == 0 or q != -kv or abs(q) != 1:
        return None
    op = ops[e.prim.name]
    if q == -1:                                              # kv - q + c (op) 0  ->  q - kv - c (flipped op) 0
        c, op = -c, {"<": ">", "<=": ">=", ">": "<", ">=": "<="}[op]
    # now q - kv + c (op) 0: keys seen where q - kv < W
    if op == "<":
        return -c
    if op == "<=":
        return -c + 1
    return None                                              # q - kv > ...: a lower bound on distance, not a window


def chunk_of(mod: Mod) -> int | None:
    """C if the mask is ``q_idx // C == kv_idx // C`` (keys of the query's own chunk of C positions)."""
    g = mod.graph
    made = g.producers()
    e = made.get(g.outvars[0])
    if e is None or e.prim.name != "equal":
        return None
    names = {v: n for v, n in zip(g.invars, ARGS["mask_mod"])}
    sides = []
    for a in e.inputs:
        d = made.get(a)
        if d is None or d.prim.name != "div" or d.inputs[0] not in names or not isinstance(d.inputs[1], Literal):
            return None
        sides.append((names[d.inputs[0]], int(d.inputs[1].value)))
    (n0, c0), (n1, c1) = sides
    return c0 if {n0, n1} == {"q_idx", "kv_idx"} and c0 == c1 and c0 >= 1 else None


def softcap_of(mod: Mod) -> float | None:
    """c if the score mod is ``tanh(score * (1/c)) * c`` with 1/c the f32 reciprocal (ggml's order)."""
    g = mod.graph
    made = g.producers()

    def split(e, name):
        if e is None or e.prim.name != name:
            return None
        a, b = e.inputs
        if isinstance(b, Literal) and not isinstance(a, Literal):
            return a, float(b.value)
        if isinstance(a, Literal) and not isinstance(b, Literal):
            return b, float(a.value)
        return None
    outer = split(made.get(g.outvars[0]), "mul")
    if outer is None:
        return None
    th = made.get(outer[0])
    if th is None or th.prim.name != "tanh":
        return None
    inner = split(made.get(th.inputs[0]), "mul")
    c = outer[1]
    if inner is None or inner[0] is not g.invars[0] or c <= 0 or np.float32(inner[1]) != np.float32(1.0 / c):
        return None
    return c


def canonical(score_mod, mask_mod, *, window, softcap) -> dict:
    """The attention params for the given mods and structured options: a known form becomes its
    structured param; what is left stays a Mod. Giving a form twice is an error."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1):
        raise ValueError(f"attention: window {window!r} must be a whole number of positions, at least 1")
    out = dict(window=int(window) if window else None, softcap=float(softcap) if softcap else None, chunk=None,
               score_mod=None, mask_mod=None)
    if score_mod is not None:
        mod = score_mod if isinstance(score_mod, Mod) else trace_mod("score_mod", score_mod)
        c = softcap_of(mod)
        if c is not None and softcap:
            raise ValueError("attention: softcap given twice (softcap= and a score_mod that is a softcap)")
        if c is not None:
            out["softcap"] = c
        else:
            out["score_mod"] = mod
    if mask_mod is not None:
        mod = mask_mod if isinstance(mask_mod, Mod) else trace_mod("mask_mod", mask_mod)
        w, c = window_of(mod), chunk_of(mod)
        if w is not None and w < 1:
            raise ValueError(f"attention: mask_mod {mod} hides every key, the query's own included (window {w})")
        if w is not None and window:
            raise ValueError("attention: a window given twice (window= and a mask_mod that is a window)")
        if w is not None:
            out["window"] = w
        elif c is not None:
            out["chunk"] = c
        else:
            out["mask_mod"] = mod
    return out


# -- ready-made mods -----------------------------------------------------------------------------

def sliding_window(W: int):
    """mask_mod: keys less than W positions back (Mistral's, gemma's local layers)."""
    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < W
    return mask


def chunked(C: int):
    """mask_mod: keys of the query's own chunk of C positions (Llama 4's chunked attention)."""
    from ggraph.ir.prims import equal

    def mask(b, h, q_idx, kv_idx):
        return equal(q_idx // C, kv_idx // C)
    return mask


def softcap(c: float):
    """score_mod: c * tanh(score / c), as ggml computes it (times the f32 reciprocal; gemma2)."""
    from ggraph.ir.prims import tanh

    def mod(score, b, h, q_idx, kv_idx):
        return tanh(score * float(np.float32(1.0 / c))) * float(c)
    return mod


def alibi(n_head: int, max_bias: float = 8.0):
    """score_mod: ALiBi's linear distance penalty, slope m_h = 2^(-max_bias (h+1) / n_head) for a power-of-two
    head count (llama.cpp's m0^(h+1) with m0 = 2^(-max_bias / n_head))."""
    from ggraph.ir.prims import cast, exp
    if n_head & (n_head - 1):
        raise ValueError(f"alibi: {n_head} heads; only a power-of-two head count has the one-slope-series form")
    step = -max_bias / n_head * float(np.log(2.0))

    def mod(score, b, h, q_idx, kv_idx):
        return score + exp(cast(h + 1, "f32") * step) * cast(kv_idx - q_idx, "f32")
    return mod
