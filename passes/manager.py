"""The pass manager: named Graph -> Graph passes, run in a straight list, verified after each.

    passes = resolve("default", disabled=["fuse_elementwise"])    # checked once, at the edge: Pass objects
    graph = run(graph, passes, dump_after={"fold"}, log=RewriteLog())

A pass is a function ``Graph -> Graph`` registered with ``@graph_pass``; its docstring's
first line says what it rewrites and why. While a pass runs, ``note()`` records a rewrite
and ``skip()`` records a candidate left alone with its reason, in the active RewriteLog.
"""
from __future__ import annotations

import contextvars
import dataclasses
from typing import Callable, Iterable

from ggraph.ir.graph import Graph, VerifyError, subgraphs
from ggraph.ir.primitive import definition_site
from ggraph.passes.pipeline import PIPELINES


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable[[Graph], Graph]
    explain: bool = False       # its log entries are decisions worth reading one by one (--explain)
    bodies: bool = True         # it also rewrites the graphs eqns run (scan bodies), which keep their signature

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0] if self.fn.__doc__ else ""

    def __call__(self, graph: Graph) -> Graph:
        graph = self.fn(graph)
        return in_subgraphs(graph, self) if self.bodies and isinstance(graph, Graph) else graph


def in_subgraphs(graph: Graph, p: Callable[[Graph], Graph]) -> Graph:
    """``graph`` with ``p`` applied to every graph its eqns hold in their params (a scan's body, after the
    eqns around it were rewritten: a composite inlined there may bring a scan), at any depth."""
    eqns, changed = [], False
    for e in graph.eqns:
        subs = subgraphs(e)
        if subs:
            e = e.replace(params={**e.params, **{k: p(g) for k, g in subs}})
            changed = True
        eqns.append(e)
    return graph.replace(eqns=eqns) if changed else graph


PASSES: dict[str, Pass] = {}
_pass_origins: dict[str, str] = {}      # pass name -> the module or file that registered it


def graph_pass(name: str, *, explain: bool = False, bodies: bool = True):
    """Register ``fn`` as the pass called ``name``; it must have a one-line docstring.

    ``explain=True`` marks a pass whose every rewrite and skip ``ggraph dump --explain`` lists
    (the fusion passes); the others are summarised as counts. ``bodies=False`` keeps it off the
    graphs eqns run (scan bodies): for a pass that changes a graph's outputs or annotates it whole."""
    def wrap(fn):
        if not (fn.__doc__ or "").strip():
            raise ValueError(f"pass {name!r} needs a docstring saying what it rewrites")
        origin = definition_site()
        if name in PASSES and _pass_origins[name] != origin:
            raise ValueError(f"pass {name!r} is already registered by {_pass_origins[name]}; {origin} registers "
                             f"it again: rename one of them")
        PASSES[name] = Pass(name, fn, explain, bodies)
        _pass_origins[name] = origin
        return fn
    return wrap


@dataclasses.dataclass(frozen=True)
class Entry:
    pass_name: str
    action: str         # "rewrote" or "skipped"
    where: str          # the scope or eqn the entry is about
    detail: str

    def __str__(self):
        mark = "+" if self.action == "rewrote" else "-"
        where = f" {self.where}:" if self.where else ""
        return f"{mark} [{self.pass_name}]{where} {self.detail}"


class RewriteLog:
    """What each pass changed, and why each candidate it declined was left alone."""

    def __init__(self):
        self.entries: list[Entry] = []
        self.ran: list[str] = []

    def rewrites(self, pass_name: str | None = None) -> list[Entry]:
        return [e for e in self.entries if e.action == "rewrote" and pass_name in (None, e.pass_name)]

    def skips(self, pass_name: str | None = None) -> list[Entry]:
        return [e for e in self.entries if e.action == "skipped" and pass_name in (None, e.pass_name)]

    def __str__(self):
        return "\n".join(str(e) for e in self.entries)


_active: contextvars.ContextVar[tuple[RewriteLog, str] | None] = contextvars.ContextVar("ggraph_pass", default=None)


def note(detail: str, where: str = "") -> None:
    """Record a rewrite made by the running pass."""
    _record("rewrote", detail, where)


def skip(detail: str, where: str = "") -> None:
    """Record a candidate the running pass left alone, with the reason."""
    _record("skipped", detail, where)


def _record(action, detail, where):
    active = _active.get()
    if active is not None:
        log, name = active
        log.entries.append(Entry(name, action, where, detail))


class PassError(RuntimeError):
    """A pass failed or left an invalid graph; names the pass, the eqn and the passes before it."""


class PipelineError(ValueError):
    """A passes spec or a disabled name that names no pipeline or pass; one line naming the flag."""


def resolve(passes="default", disabled: Iterable[str] = (), flags: tuple[str, str] = ("passes", "disabled"),
            ) -> tuple[Pass, ...]:
    """The passes to run, in order: ``passes`` is a pipeline name, pass names (a comma list or a list) or
    Pass objects; the ``disabled`` pass names are left out. ``flags`` name the two in errors."""
    passes_flag, disabled_flag = flags
    if isinstance(passes, str):
        text = passes.strip()
        names = list(PIPELINES[text]) if text in PIPELINES else [n.strip() for n in text.split(",") if n.strip()]
        if "," not in text and names and names[0] not in PASSES:       # one word: a pipeline or a pass
            raise PipelineError(f"{passes_flag}: unknown pipeline or pass {names[0]!r} ({_known()})")
    elif hasattr(passes, "__iter__"):
        names = list(passes)
    else:
        raise PipelineError(f"{passes_flag} must be a pipeline name ({', '.join(PIPELINES)}) or a list of pass "
                            f"names, got {passes!r}"[:300])
    if isinstance(disabled, str) or not hasattr(disabled, "__iter__"):
        raise PipelineError(f"{disabled_flag} must be a list of pass names, got {disabled!r}"[:300])
    disabled = list(disabled)
    for flag, given, known in ((passes_flag, [n for n in names if not isinstance(n, Pass)], _known()),
                               (disabled_flag, disabled, f"passes: {', '.join(PASSES)}")):
        unknown = [str(n) for n in given if not isinstance(n, str) or n not in PASSES]
        if unknown:
            raise PipelineError(f"{flag}: unknown pass(es) {', '.join(unknown)} ({known})"[:2000])
    return tuple(p for p in (n if isinstance(n, Pass) else PASSES[n] for n in names) if p.name not in disabled)


def _known() -> str:
    return f"pipelines: {', '.join(PIPELINES)}; passes: {', '.join(PASSES)}"


def run(graph: Graph, pipeline, *, verify: bool = True,
        dump_after: Iterable[str] | Callable[[str, Graph], None] | None = None,
        log: RewriteLog | None = None) -> Graph:
    """Run ``pipeline`` (passes from ``resolve``, or anything it takes) in order; verify the graph after each.

    ``dump_after`` is a set of pass names (the graph is printed after each, or after every
    pass with "all") or a callable ``(pass_name, graph)`` called after every pass. Anything a
    pass raises comes out as a PassError naming it and the passes run before it.
    """
    log = log if log is not None else RewriteLog()
    for p in resolve(pipeline):
        before = ", ".join(log.ran) or "none"
        if graph.meta:                      # annotations (e.g. a memory plan) describe the graph as it was
            graph = graph.replace(meta={})
        token = _active.set((log, p.name))
        try:
            graph = p(graph)
        except Exception as e:
            raise PassError(f"pass {p.name!r} failed: {type(e).__name__}: {e} (passes run before: {before})") from e
        finally:
            _active.reset(token)
        if not isinstance(graph, Graph):
            raise PassError(f"pass {p.name!r} returned {type(graph).__name__}, not a Graph (passes run before: {before})")
        if verify:
            try:
                graph.verify()
            except VerifyError as e:
                raise PassError(f"pass {p.name!r} left an invalid graph: {e} (passes run before: {before})") from None
        log.ran.append(p.name)
        if callable(dump_after):
            dump_after(p.name, graph)
        elif dump_after is not None and (p.name in dump_after or "all" in dump_after):
            print(f"# after {p.name}\n{graph}")
    return graph
