"""Graph text, the other way: read what ``print(graph)`` writes back into a Graph, so pass tests
are text in, text out.

    graph = parse('''
    { lambda ; x:f32[T,4]. let
        a:f32[T,4] = mul x 1.0
      in (a) }''')

Composite eqns need their body, as ``graph.pretty(expand=True)`` prints it; a graph an op holds in its
params (a scan's ``body={ lambda ; ...``) follows its eqn's line.
"""
from __future__ import annotations

import re

import numpy as np

from ggraph.ir import dtypes
from ggraph.ir.dims import as_dim
from ggraph.ir.dtypes import Aval, ParamAval
from ggraph.ir.graph import Eqn, Graph, Literal, Var
from ggraph.ir.primitive import get_primitive

DIM_PARAMS = {"shape", "n", "start", "stop", "num_segments", "length"}   # params whose values are dims (int or Sym)

_DECL = re.compile(r"([A-Za-z_]\w*):(\w+)\[([^\]]*)\]")
_HEADER = re.compile(r"\{\s*lambda\s*;(.*)\.\s*let\s*$")
_EQN = re.compile(r"^(?P<outs>(?:[A-Za-z_]\w*:\w+\[[^\]]*\]\s*)+)=\s*(?P<prim>\w+)(?:\{(?P<ops>[^}]*)\})?"
                  r"(?:\[(?P<params>.*)\])?(?P<ins>.*)$")
_PARAM_LINE = re.compile(r'^([A-Za-z_]\w*):(\w+)\[([^\]]*)\]\s*=\s*param\s+"([^"]*)"$')
_FOOTER = re.compile(r"^in\s*\((.*)\)\s*\}$")
_GRAPH_PARAM = re.compile(r"^([A-Za-z_]\w*)=(\{\s*lambda\b.*)$")        # body={ lambda ; ... (a scan's body)


class ParseError(ValueError):
    """The text is not a graph; the message names the line."""


def _aval(dtype: str, dims: str) -> Aval:
    shape = [as_dim(d.strip()) if not d.strip().isdigit() else int(d) for d in dims.split(",") if d.strip()]
    return Aval(shape, dtypes.from_name(dtype))


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    if cur.strip():
        out.append(cur)
    return [s.strip() for s in out]


def _value(text: str, as_dims: bool):
    text = text.strip()
    if text.startswith("{") and text.endswith("}"):                 # an attention score_mod or mask_mod
        from ggraph.ir.attention_mods import parse_mod
        return parse_mod(text)
    if text in ("True", "False"):
        return text == "True"
    if text.startswith("(") and text.endswith(")"):
        return tuple(_value(t, as_dims) for t in _split_top(text[1:-1]))
    if as_dims:
        return int(text) if re.fullmatch(r"-?\d+", text) else as_dim(text)
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def _params(text: str | None) -> dict:
    if not text:
        return {}
    out = {}
    for item in _split_top(text):
        k, _, v = item.partition("=")
        out[k.strip()] = _value(v, k.strip() in DIM_PARAMS)
    return out


def _literal(tok: str) -> Literal:
    if re.fullmatch(r"-?\d+", tok):
        return Literal(int(tok), dtypes.i32)
    try:
        return Literal(np.float32(float(tok)), dtypes.f32)
    except ValueError:
        raise ParseError(f"unknown operand {tok!r}") from None


class _Lines:
    def __init__(self, text: str):
        self.lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        self.i = 0

    def peek(self) -> str | None:
        return self.lines[self.i] if self.i < len(self.lines) else None

    def next(self) -> str:
        if self.i >= len(self.lines):
            raise ParseError("unexpected end of text: missing 'in (...) }'")
        self.i += 1
        return self.lines[self.i - 1]


def parse(text: str) -> Graph:
    """Parse printed graph text into a verified Graph."""
    lines = _Lines(text)
    graph = _parse_graph(lines, nested=False)
    if lines.peek() is not None:
        raise ParseError(f"text after the graph: {lines.peek()!r}")
    graph.verify()
    return graph


def _parse_graph(lines: _Lines, nested: bool) -> Graph:
    head = lines.next()
    m = _HEADER.match(head)
    if not m:
        raise ParseError(f"expected '{{ lambda ; inputs. let', got {head!r}")
    env: dict[str, Var] = {}
    invars = []
    for name, dt, dims in _DECL.findall(m.group(1)):
        v = Var(_aval(dt, dims), hint=None if nested else name)   # like trace: top-level inputs keep names
        env[name] = v
        invars.append(v)
    params: list[Var] = []
    eqns: list[Eqn] = []
    scope = ""
    while True:
        line = lines.next()
        if line.startswith("#"):
            scope = line[1:].strip()
            scope = "" if scope == "(top)" else scope
            continue
        if (fm := _FOOTER.match(line)):
            outs = [env[n] if n in env else _literal(n) for n in fm.group(1).split()]
            return Graph(invars, params, eqns, outs, name="parsed")
        if (pm := _PARAM_LINE.match(line)):
            v = Var(ParamAval(pm.group(4), _aval(pm.group(2), pm.group(3))))
            env[pm.group(1)] = v
            params.append(v)
            continue
        em = _EQN.match(line)
        if not em:
            raise ParseError(f"cannot parse line {line!r}")
        try:
            prim = get_primitive(em.group("prim"))
        except KeyError as e:
            raise ParseError(f"line {line!r}: {e.args[0]}") from None
        ins = []
        for tok in em.group("ins").split():
            ins.append(env[tok] if tok in env else _literal(tok))
        outs = []
        for name, dt, dims in _DECL.findall(em.group("outs")):
            outs.append(Var(_aval(dt, dims)))
        eqn_params = _params(em.group("params"))
        while (gm := _GRAPH_PARAM.match(lines.peek() or "")):    # graphs the op runs, printed under it
            lines.lines[lines.i] = gm.group(2)
            eqn_params[gm.group(1)] = _parse_graph(lines, nested=True)
        body = None
        nxt = lines.peek()
        if nxt is not None and nxt.startswith("{"):
            body = _parse_graph(lines, nested=True)
        elif prim.composite:
            raise ParseError(f"line {line!r}: composite {prim.name} needs its body (print with expand=True)")
        if em.group("ops") is not None:                     # fused{add,rms_norm}: what it swallowed
            eqn_params["ops"] = tuple(op.strip() for op in em.group("ops").split(",") if op.strip())
        eqns.append(Eqn(prim, ins, outs, eqn_params, scope, body))
        for name, v in zip((d[0] for d in _DECL.findall(em.group("outs"))), outs):
            env[name] = v
