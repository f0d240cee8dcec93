"""A benchmark sweep across the nodes of a Ray cluster (``ggraph bench --cluster ADDRESS``).

    sweep = Sweep(models=("~/models/llama-1b-q4_k_m.gguf",), threads=(1, 2), pps=(512,), tgs=(32,))
    for event in bench_sweep("auto", sweep, nodes=["node_a", "node_b"]):
        print(event)                   # a list of rows (one per engine) as each run finishes, or a Failure

A *run* is one (node, model, feature set, thread count): a Ray task that holds every CPU of its node, so no
two benchmarks share a node, and measures each (depth, pp, tg) configuration of the sweep there with the
pipelines' (and llama.cpp's) rounds alternating, as ``ggraph bench`` does on one machine. Each node runs its
runs one after another; the nodes run in parallel. The task compiles for the node's own CPU (or the
feature set ``GGRAPH_TARGET`` forces there), and every row records the node, its CPU model, LLVM's name for
the CPU and the feature set chosen.

Model paths are resolved on each node: ``~`` and ``$VARS`` expand in the node's environment (so nodes with
different HOMEs read different model dirs), a relative path is taken from the driver's working directory,
and the demo model is the node's own. A node that lacks a file, cannot run a feature set, or fails a run is
reported by name as a ``Failure``; the other nodes' rows are kept.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
from pathlib import Path

DEMO = ":demo:"                        # the models entry that means the node's own demo model
INSTALL = "pip install 'ggraph[cluster]'"
RAY_RESOURCES = ("CPU", "GPU", "TPU", "memory", "object_store_memory")   # not names a user gave a node


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What each node measures: every model x feature set x thread count x depth x pp x tg, for each
    pipeline (and llama.cpp per flash attention setting with ``vs_llama_cpp``)."""
    models: tuple[str, ...]
    threads: tuple[int, ...] = (1,)
    depths: tuple[int, ...] = (0,)
    pps: tuple[int, ...] = (64,)
    tgs: tuple[int, ...] = (32,)
    pipelines: tuple = ("default",)
    targets: tuple = (None,)           # feature set names for GGRAPH_TARGET; None: the node's best
    repeats: int = 3
    ctx: int | None = None             # None: depth + pp + tg, within the model's trained length
    cache_k: str = "f16"
    cache_v: str = "f16"
    backend: str = "llvm"
    disabled: tuple = ()
    max_memory: str | None = None
    vs_llama_cpp: bool = False
    flash_attn: tuple = (True, False)
    roofline: bool = False


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """An alive node of the cluster as the driver sees it."""
    node_id: str
    name: str                          # its custom resources ("node_a"), else host:id-prefix
    ip: str
    hostname: str
    cpus: int
    resources: tuple[str, ...]         # the custom resources a user gave it
    labels: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class Failure:
    """A node that could not give rows for ``what``: one line, ``node (CPU): what: reason``."""
    node: str
    cpu: str
    what: str
    reason: str

    def __str__(self) -> str:
        return f"{self.node} ({self.cpu}): {self.what}: {self.reason}"


# ---------------------------------------------------------------------------------------
# the driver: connect, pick the nodes, run the sweep
# ---------------------------------------------------------------------------------------

def require_ray():
    """The ray module, or a ValueError saying in one line how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"--cluster needs Ray: {INSTALL}") from None
    return ray


def connect(address: str) -> bool:
    """ray.init the driver to ``address`` ("auto", "host:port" or "ray://host:port"); True when this call
    connected (and the caller should ray.shutdown), False when ray was already initialised."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    if address == "auto" and not os.environ.get("RAY_ADDRESS"):
        _one_local_cluster()
    if address != "auto":
        host, sep, port = address.removeprefix("ray://").rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"--cluster {address!r}: give auto, HOST:PORT or ray://HOST:PORT")
        try:                                              # a quick, clear refusal instead of Ray's minute of retries
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            raise ValueError(f"--cluster {address}: cannot connect ({e.strerror or e})") from None
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError) as e:
        reason = " ".join(str(e).split())                # Ray's may span lines ("...from server:\n<why>")
        raise ValueError(f"--cluster {address}: cannot connect ({reason[:300] or type(e).__name__})") from None
    return True


def _one_local_cluster() -> None:
    """Refuse "auto" when several Ray clusters run on this machine: Ray would pick one of them silently."""
    try:
        from ray._private.services import find_gcs_addresses
    except ImportError:                                   # a Ray without it: let ray.init decide
        return
    running = sorted(find_gcs_addresses())
    if len(running) > 1:
        raise ValueError(f"--cluster auto: {len(running)} Ray clusters run on this machine ({', '.join(running)}); "
                         f"give the address of one")


def cluster_nodes() -> list[NodeInfo]:
    """The alive nodes, in the order Ray lists them."""
    out = []
    for n in require_ray().nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        custom = tuple(sorted(k for k in res if k not in RAY_RESOURCES and not k.startswith(
            ("node:", "accelerator_type:"))))
        labels = tuple(sorted((k, str(v)) for k, v in (n.get("Labels") or {}).items()
                              if not k.startswith("ray.io/")))
        host = n.get("NodeManagerHostname", "")
        out.append(NodeInfo(n["NodeID"], "+".join(custom) or f"{host}:{n['NodeID'][:8]}", n["NodeManagerAddress"],
                            host, int(res.get("CPU", 0)), custom, labels))
    return out


def select_nodes(nodes: list[NodeInfo], selectors: list[str] | None) -> list[NodeInfo]:
    """The nodes any selector names: a custom resource (``node_a``), a label ``KEY=VALUE``, an IP address, a
    hostname or a node id prefix; without selectors, every node that offers CPUs (a head started with
    ``--num-cpus 0`` runs no work). An unmatched selector, or a chosen node without CPUs, is an error."""
    if not selectors:
        if not any(n.cpus for n in nodes):
            raise ValueError("--cluster: no alive node offers CPUs to Ray tasks")
        return [n for n in nodes if n.cpus]
    chosen = []
    for sel in selectors:
        key, eq, value = sel.partition("=")
        match = [n for n in nodes if ((key, value) in n.labels if eq else
                                      sel in n.resources or sel in (n.ip, n.hostname)
                                      or (len(sel) >= 6 and n.node_id.startswith(sel)))]
        if not match:
            known = ", ".join(f"{n.name} ({n.ip})" for n in nodes) or "none"
            raise ValueError(f"--nodes {sel}: no alive node has that resource, label, address or id "
                             f"(nodes: {known})")
        idle = [n for n in match if not n.cpus]
        if idle:
            raise ValueError(f"--nodes {sel}: node {idle[0].name} ({idle[0].ip}) offers no CPUs to Ray tasks")
        chosen += [n for n in match if n not in chosen]
    return chosen


def _on(node: NodeInfo, **options):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return dict(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False), **options)


def _reason(ray, err: BaseException) -> str:
    """The one line that says why a task failed: its own exception's message, not Ray's wrapping."""
    cause = getattr(err, "cause", None) if isinstance(err, ray.exceptions.RayTaskError) else None
    err = cause or err
    text = str(err.args[0] if isinstance(err, KeyError) and err.args else err).strip()
    first = (text.splitlines() or [""])[0]
    if isinstance(err, ray.exceptions.RayError):         # Ray's own: its class and first sentence
        return f"{type(err).__name__}: {first.split('. ')[0]}"
    return first or type(err).__name__


def bench_sweep(address: str, sweep: Sweep, nodes: list[str] | None = None):
    """Run ``sweep`` on the selected nodes of the cluster at ``address``; yield each run's rows (a list of
    dicts) as it finishes, and a ``Failure`` for each node, model or run that gave none. Closing the
    generator (Ctrl-C included) force-cancels the tasks still queued or running and waits for them to end."""
    ray = require_ray()
    owned = connect(address)
    pending: dict = {}
    try:
        chosen = select_nodes(cluster_nodes(), nodes)
        models = tuple(map(driver_path, sweep.models))
        probe, run = ray.remote(max_retries=0)(node_facts), ray.remote(max_retries=0, max_calls=1)(_run)
        for node in chosen:
            pending[probe.options(**_on(node, num_cpus=0)).remote(models, sweep.targets)] = (node, None)
        queues: dict[str, list] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)   # a timeout lets Ctrl-C in
            if not done:
                continue
            node, work = pending.pop(done[0])
            try:
                got = ray.get(done[0])
            except (ray.exceptions.RayError, OSError, ValueError) as e:
                facts = queues.get(node.node_id, (None, {"cpu": "?"}))[1]
                what = "probe" if work is None else _describe(*work)
                yield Failure(node.name, facts["cpu"], what, _reason(ray, e))
                got = None
            if work is None:                                          # the probe: plan this node's runs
                facts = got or {"cpu": "?"}
                runs = []
                if got is not None:
                    for model, (path, problem) in zip(models, got["models"]):
                        if problem:
                            yield Failure(node.name, facts["cpu"], _model_name(model), problem)
                            continue
                        for target in sweep.targets:
                            if got["targets"].get(target):
                                yield Failure(node.name, facts["cpu"], f"{_model_name(model)}, {target}",
                                              got["targets"][target])
                                continue
                            runs += [(path, target, t) for t in sweep.threads]
                queues[node.node_id] = (runs, facts)
            else:
                if got is not None:
                    yield [dict(r, node=node.name, node_ip=node.ip, node_id=node.node_id) for r in got]
            runs, facts = queues[node.node_id]
            if runs:                                                  # the node's next run, once it is free
                work = runs.pop(0)
                ref = run.options(**_on(node, num_cpus=node.cpus)).remote(sweep, *work)
                pending[ref] = (node, work)
    finally:
        _cancel(ray, list(pending))
        if owned:
            ray.shutdown()


def _cancel(ray, refs: list) -> None:
    """Force-cancel ``refs`` and wait until each has ended (cancelled, or finished just before). Runs whose
    results have arrived are left alone: Ray 2.60's driver can abort on a cancel that races a task's completion
    (task_manager.cc: 'Tried to complete task that was not pending')."""
    with contextlib.suppress(Exception):
        finished, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        refs = [r for r in refs if r not in finished]
    for ref in refs:
        with contextlib.suppress(Exception):
            ray.cancel(ref, force=True)
    with contextlib.suppress(Exception):
        ray.wait(refs, num_returns=len(refs), timeout=60)


def _model_name(path: str) -> str:
    return "the demo model" if path == DEMO else path


def _describe(path: str, target, threads: int) -> str:
    return f"{Path(path).name} at {threads} thread{'s' * (threads != 1)}" + (f", {target}" if target else "")


# ---------------------------------------------------------------------------------------
# on the node
# ---------------------------------------------------------------------------------------

def node_facts(models: tuple = (), targets: tuple = ()) -> dict:
    """This node's CPU (as /proc/cpuinfo and LLVM name it) and default feature set; each model's path here
    (with the reason it cannot be read, or None), and each forced feature set's reason it cannot run."""
    import platform

    import llvmlite.binding as llvm

    from ggraph.backends.llvm.target import _cpuinfo_field, _host_cpuinfo, forced_target, host_target
    cpu = _cpuinfo_field(_host_cpuinfo(), ("model name", "Model name", "Hardware")) or platform.processor() or "?"
    checked = []
    for m in models:
        try:
            path = node_path(m)
            checked.append((path, None if os.path.isfile(path) else f"no such file {path}"))
        except (OSError, ValueError, SystemExit) as e:
            checked.append((m, str(e)))
    reasons = {}
    for t in targets:
        try:
            reasons[t] = forced_target(t) if t else None
        except ValueError as e:
            reasons[t] = str(e)
    return dict(hostname=socket.gethostname(), cpu=cpu, llvm_cpu=llvm.get_host_cpu_name(), cpus=os.cpu_count(),
                default_target=host_target("").name, models=checked, targets=reasons)


def driver_path(model: str) -> str:
    """``model`` as the driver sends it to the nodes: a relative path taken from here; the demo model,
    and paths starting with ~ or $VARS, left for each node to read as its own (``node_path``)."""
    return model if model == DEMO or model.startswith(("~", "$", "/")) else os.path.join(os.getcwd(), model)


def node_path(model: str) -> str:
    """``model`` as this node reads it: its own demo model, or ~ and $VARS expanded here."""
    if model == DEMO:
        from ggraph.demo import demo_model_path
        return str(demo_model_path())
    return os.path.expandvars(os.path.expanduser(model))


def _run(sweep: Sweep, path: str, target: str | None, threads: int) -> list[dict]:
    """One run on this node (a worker of its own, ``max_calls=1``, so GGRAPH_TARGET holds for it alone)."""
    from ggraph.backends.llvm.target import host_target
    from ggraph.backends.llvm.team import check_threads
    from ggraph.cli.bench import bench_context, thread_rows
    if target:
        os.environ["GGRAPH_TARGET"] = target
    else:
        os.environ.pop("GGRAPH_TARGET", None)
    check_threads(threads)
    facts = node_facts()
    chosen = host_target().name
    needed = max(sweep.depths) + max(sweep.pps) + max(sweep.tgs)
    ctx = bench_context(sweep.ctx, path, needed)
    rows = []
    for group in thread_rows(path, threads, sweep.depths, sweep.pps, sweep.tgs, sweep.pipelines, ctx, sweep.cache_k,
                             sweep.cache_v, sweep.flash_attn, backend=sweep.backend, disabled=sweep.disabled,
                             max_memory=sweep.max_memory, vs_llama_cpp=sweep.vs_llama_cpp, roofline=sweep.roofline,
                             repeats=sweep.repeats):
        rows += [dict(r, hostname=facts["hostname"], cpu=facts["cpu"], llvm_cpu=facts["llvm_cpu"], target=chosen,
                      model_path=path) for r in group]
    sys.stdout.flush()
    return rows
