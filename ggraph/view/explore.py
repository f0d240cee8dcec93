"""The compiled graph in Model Explorer: the graph after every pass, overlays of cost and profile, served
locally or written to files.

    ex = explore(graph)                                   # any traced graph: pass by pass, in the browser
    ex = explore(fn, f32["T", 64], serve=False)           # a function, traced here
    ex.export("out/")                                     # graphs.json + one node-data file per overlay
    ex.serve(port=8080, open_browser=False)               # http://127.0.0.1:8080/?data=...

``ggraph explore MODEL`` builds the same from a GGUF model (``ggraph.cli.explore``). The adapter that turns
one graph into Model Explorer's JSON is ``ggraph.view.adapter``; Model Explorer itself (PyPI
``ai-edge-model-explorer``, the ``[explore]`` extra) is imported only to serve.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.parse
import urllib.request

from ggraph.ir.graph import Graph
from ggraph.view.adapter import DEFAULT_DIMS, MEGraph, collection, kernel_table, node_data, safe_id, to_me_graph

INSTALL_HINT = 'Model Explorer is not installed: pip install -e ".[explore]" (or pip install ai-edge-model-explorer)'


class Exploration:
    """Graph collections (each a list of MEGraph) and overlays over their nodes, ready to serve or export."""

    def __init__(self):
        self.collections: list[tuple[str, list[MEGraph]]] = []
        self.overlays: list[tuple[str, dict]] = []       # (name, node data JSON: graph id -> results)
        self.url: str | None = None

    def add_collection(self, label: str, graphs: list[MEGraph]) -> None:
        ids = {g.json["id"] for _, gs in self.collections for g in gs}
        clash = ids & {g.json["id"] for g in graphs}
        if clash:
            raise ValueError(f"explore: graph id(s) {', '.join(sorted(clash))} already shown; give another label")
        self.collections.append((label, graphs))

    def add_overlay(self, name: str, values: dict[str, dict[str, float]]) -> None:
        """``values``: graph id -> node id -> number; colour-scaled in the page."""
        if any(values.values()):
            self.overlays.append((name, node_data(name, values)))

    def graphs(self) -> list[MEGraph]:
        return [g for _, gs in self.collections for g in gs]

    def ui_state(self, expand=(), select: str = "") -> dict:
        """Open on the last graph of the first collection; with a second collection, that one's last graph
        in a pane beside it (``--compare``). ``expand``: layers open (``blk.0/attn``), ``select``: a node id of
        the first pane. (Model Explorer lists a served collection's graphs by node count, not in the order
        given: the ids' numbers give the pipeline's order.)"""
        panes = []
        for label, gs in self.collections[:2]:
            panes.append({"deepestExpandedGroupNodeIds": list(expand), "selectedNodeId": "" if panes else select,
                          "selectedGraphId": gs[-1].json["id"], "selectedCollectionLabel": page_label(label),
                          "widthFraction": 1 / min(2, len(self.collections)), "selected": not panes})
        return {"paneStates": panes}

    # -- files ---------------------------------------------------------------------------
    def export(self, folder: str) -> list[str]:
        """Write ``graphs.json`` (every collection, as Model Explorer's JSON loader reads it) and one
        ``<overlay>.nodedata.json`` per overlay into ``folder``; returns the paths written."""
        os.makedirs(folder, exist_ok=True)
        paths = [os.path.join(folder, "graphs.json")]
        with open(paths[0], "w") as f:
            json.dump([{"label": label, "subgraphs": [g.json for g in gs]} for label, gs in self.collections], f)
        for name, data in self.overlays:
            paths.append(os.path.join(folder, f"{safe_id(name)}.nodedata.json"))
            with open(paths[-1], "w") as f:
                json.dump(data, f)
        return paths

    # -- serving -------------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int | None = None, open_browser: bool = True, expand=(),
              select: str = "") -> str:
        """Start Model Explorer's local server in a background thread with these graphs and overlays;
        returns the page's URL (also ``self.url``). ``port`` None takes the first free one from 8080;
        ``expand`` and ``select`` as ui_state takes them."""
        try:
            import model_explorer as me
            from model_explorer import server
        except ImportError:
            raise ImportError(INSTALL_HINT) from None
        if port is None:
            port = free_port(host, 8080)
        elif not 0 < port < 65536:
            raise ValueError(f"--port {port}: not a TCP port (1..65535)")
        elif _in_use(host, port):
            raise ValueError(f"--port {port}: already in use on {host}")
        _quiet(server)
        cfg = me.config()
        for i, (label, gs) in enumerate(self.collections):
            cfg.graphs_list.append(json.dumps({"graphCollections": [collection(label, gs)]}))
            cfg.model_sources.append({"url": f"graphs://{safe_id(label)}/{i}"})     # shown as page_label(label)
        for name, data in self.overlays:
            cfg.add_node_data(name, json.dumps(data))
        threading.Thread(target=server.start, daemon=True,
                         kwargs=dict(host=host, port=port, config=cfg, no_open_in_browser=True)).start()
        base = f"http://{host}:{port}"
        _wait_healthy(base)
        state = {"models": cfg.model_sources, "uiState": self.ui_state([f"{ns}___group___" for ns in expand], select)}
        if cfg.node_data_sources:
            state |= {"nodeData": cfg.node_data_sources, "nodeDataTargets": cfg.node_data_target_models}
        self.url = f"{base}/?data={urllib.parse.quote(json.dumps(state))}"
        if open_browser:
            import webbrowser
            webbrowser.open_new_tab(self.url)
        return self.url

    def _repr_html_(self) -> str:
        """In Jupyter: the served page inline, in an iframe."""
        if self.url is None:
            return f"<pre>{len(self.graphs())} graphs, not served: call .serve()</pre>"
        return f'<iframe src="{self.url}" width="100%" height="800" style="border:1px solid #ccc"></iframe>'


def _quiet(server) -> None:
    """Model Explorer's server module without its console chatter (its own URL, which lacks our page state,
    and its list of adapters) and without its check for a newer release on PyPI and GitHub at every start."""
    server.print = lambda *args, **kw: None
    server._check_new_version = lambda print_msg=True: {"version": "", "runningVersion": "", "releaseUrl": "",
                                                         "desktopAppUrl": ""}


def page_label(label: str) -> str:
    """How Model Explorer's page names a collection served as graphs://<safe_id(label)>/<i>."""
    return f"{safe_id(label)} ({label})"


def free_port(host: str, start: int) -> int:
    for port in range(start, start + 100):
        if not _in_use(host, port):
            return port
    raise OSError(f"no free TCP port on {host} in {start}..{start + 99}")


def _in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex((host, port)) == 0


def _wait_healthy(base: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{base}/check_health", timeout=2) as r:
                if r.read() == b"model_explorer_ok":
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise OSError(f"Model Explorer's server did not answer at {base} within {timeout:.0f} s")
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------
# the graphs
# ---------------------------------------------------------------------------------------

def pass_by_pass(graph: Graph, passes, *, prefix: str = "", kernels: dict | None = None, dims: dict | None = None,
                 layer: int | None = None) -> tuple[list[MEGraph], Graph, object]:
    """The graph as traced and after every pass of ``passes`` (resolved passes, or what
    ``ggraph.passes.resolve`` takes), as MEGraphs with ids ``<prefix>00 traced``, ``<prefix>01 <pass>``, ...;
    the final graph, and the RewriteLog."""
    from ggraph.passes import RewriteLog, resolve, run
    log = RewriteLog()
    snaps = [("traced", graph, 0)]
    final = run(graph, resolve(passes), log=log, dump_after=lambda n, g: snaps.append((n, g, len(log.entries))))
    out = [to_me_graph(g, f"{prefix}{i:02d} {name}", log=log, upto=upto, kernels=kernels, dims=dims, layer=layer)
           for i, (name, g, upto) in enumerate(snaps)]
    return out, final, log


def cost_values(graphs: list[MEGraph], dims: dict) -> tuple[dict, dict]:
    """Each op node's (flops, bytes moved) from the op table's cost rules at ``dims``, by graph id and node id."""
    flops, nbytes = {}, {}
    for g in graphs:
        f, b = flops.setdefault(g.json["id"], {}), nbytes.setdefault(g.json["id"], {})
        for nid, e in g.eqn_of.items():
            try:
                f[nid], b[nid] = e.cost(dims)
            except (KeyError, ValueError):              # an op with no cost rule has no value (not a zero)
                pass
    return flops, nbytes


def add_cost_overlays(ex: Exploration, dims: dict) -> None:
    at = ", ".join(f"{k}={v}" for k, v in dims.items())
    flops, nbytes = cost_values(ex.graphs(), dims)
    ex.add_overlay(f"cost: flops at {at}", flops)
    ex.add_overlay(f"cost: bytes moved at {at}", nbytes)


PROFILE_DECODE_STEPS = 5            # decode steps profiled; each op counts its fastest (as bench --profile)


def add_profile_overlays(ex: Exploration, session, shown: MEGraph, pp: int) -> dict:
    """Run ``session`` (profile=True, llvm) on a prompt of ``pp`` tokens and a few decode steps; overlay each
    node of ``shown`` (the MEGraph of ``session.program(last_only=True).graph``) with its time, share of the
    step, bytes moved and fraction of its roofline limit (``bench --profile``'s: weights at DRAM's bandwidth,
    the rest at the cache's that holds it, or flops at the peak, measured now, whichever takes longer).
    Returns the step totals and the roofline measured."""
    from ggraph.bench.measure import eqn_bound, machine_peaks, prompt_tokens
    prog = session.program(last_only=True)
    node_of = {id(e): nid for nid, e in shown.eqn_of.items()}
    peaks = machine_peaks(prog.target, prog.threads)
    bandwidth = peaks["reads"][-1][2]
    ids = prompt_tokens(pp, session.config.n_vocab)
    session.step(ids)                                       # warm: page the weights in
    session.reset()
    session.step(ids)
    last = (pp - 1) // session.ubatch * session.ubatch      # a long prompt runs in ubatches: the last one is timed
    runs = {f"prefill T={pp - last}": ({"T": pp - last, "P": last}, [(prog.last_profile, prog.last_idle)])}
    decode = []
    for _ in range(PROFILE_DECODE_STEPS):
        session.step([ids[0]])
        decode.append((prog.last_profile, prog.last_idle))
    runs[f"decode P={pp}"] = ({"T": 1, "P": pp}, decode)
    gid = shown.json["id"]
    summary = {"bandwidth_gb_s": bandwidth, "peaks": peaks}
    for step, (dims, profiles) in runs.items():
        per_eqn: dict[int, float] = {}                     # each eqn's fastest run of the step, as bench's
        for profile, _ in profiles:
            one: dict[int, float] = {}
            for call, t in profile:
                one[id(call.eqn)] = one.get(id(call.eqn), 0.0) + t
            for k, t in one.items():
                per_eqn[k] = min(t, per_eqn.get(k, t))
        seconds = {node_of[k]: t for k, t in per_eqn.items() if k in node_of}
        total = sum(per_eqn.values()) + min(i for _, i in profiles)      # the waiting at barriers counts too
        share, moved, roof = {}, {}, {}
        for nid, t in seconds.items():
            e = shown.eqn_of[nid]
            share[nid], moved[nid] = t / total, e.cost(dims)[1]
            roof[nid] = eqn_bound(e, dims, bandwidth, peaks) / t if t else 0.0
        ex.add_overlay(f"profile {step}: time (us)", {gid: {n: t * 1e6 for n, t in seconds.items()}})
        ex.add_overlay(f"profile {step}: share of the step", {gid: share})
        ex.add_overlay(f"profile {step}: bytes moved", {gid: moved})
        ex.add_overlay(f"profile {step}: fraction of roofline", {gid: roof})
        summary[step] = {"seconds": total, "on nodes": sum(seconds.values())}
    return summary


def explore(graph, *avals, passes="default", disabled=(), compare: str | None = None, dims: dict | None = None,
            layer: int | None = None, serve: bool = True, port: int | None = None, open_browser: bool = True,
            export: str | None = None, kernels: bool = True) -> Exploration:
    """Show ``graph`` (a Graph, or a function traced here over ``avals``) in Model Explorer: the graph as
    traced and after every pass of ``passes`` (less ``disabled``), cost overlays at ``dims`` (default T=1,
    P=0); ``compare`` a second pipeline (e.g. "none") beside it. ``serve`` starts the local server (in
    Jupyter the returned object shows the page inline); ``export`` writes the files to that folder."""
    from ggraph.passes import resolve
    if not isinstance(graph, Graph):
        if not callable(graph):
            raise TypeError(f"explore: expected a Graph or a function to trace, got {type(graph).__name__}")
        from ggraph.ir.trace import trace
        graph = trace(graph, *avals)
    elif avals:
        raise TypeError("explore: avals are for a function to trace; a Graph takes none")
    dims = dict(DEFAULT_DIMS if dims is None else dims)
    table = kernel_table() if kernels else None
    ex = Exploration()
    main = resolve(passes, disabled)
    graphs, _, _ = pass_by_pass(graph, main, kernels=table, dims=dims, layer=layer)
    ex.add_collection(pipeline_label(passes, main), graphs)
    if compare is not None:
        other = resolve(compare, disabled)
        graphs, _, _ = pass_by_pass(graph, other, prefix=f"{compare} ", kernels=table, dims=dims, layer=layer)
        ex.add_collection(pipeline_label(compare, other), graphs)
    add_cost_overlays(ex, dims)
    if export:
        ex.export(export)
    if serve:
        ex.serve(port=port, open_browser=open_browser)
    return ex


def pipeline_label(spec, passes) -> str:
    """A collection's label: the pipeline's name, saying fused or unfused."""
    names = {p.name for p in passes}
    kind = "fused" if any(n.startswith("fuse_") for n in names) else "unfused"
    return f"{kind} ({spec})" if isinstance(spec, str) and "," not in spec else f"{kind} ({len(passes)} passes)"
