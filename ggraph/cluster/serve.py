"""``ggraph serve --replicas N --cluster ADDRESS``: the OpenAI-compatible server (``ggraph.serve.app`` over
an ``Engine``) as a Ray Serve application of N replicas behind one HTTP endpoint.

    spec = ReplicaSpec(path, model_id="m", parallel=2, ctx=4096, threads=2)
    serve_on_cluster(spec, replicas=2, address="auto", host="127.0.0.1", port=8080)   # until Ctrl-C

Each replica is a Ray actor that loads the file at ``path`` on its own node, compiles for its own CPU
and holds its own slots; Ray Serve's proxy on the head node routes each request to the replica with
fewest requests in flight, streams included (the app runs as the replica's ASGI app, unchanged), and
its controller replaces a replica that dies or fails its health check. Every response names the
replica that answered in an ``x-ggraph-replica`` header; ``/metrics`` and ``/health`` are that
replica's own.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import signal
import sys
import time
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.context import _get_global_client       # the running Serve's controller and HTTP options
from ray.serve.request_router import RequestRouter

from ggraph.cluster.bench import DEMO, cluster_nodes, connect
from ggraph.cluster.bench import node_path                         # bench's rule: ~, $VARS, the demo model

APP = "ggraph"                         # the Ray Serve application's name; its route prefix is "/"
DEPLOYMENT = "GgraphServe"


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds: ``Engine(path, ...)`` and ``create_app(engine, model_id, ...)``.
    ``ctx`` None is ``ggraph serve``'s default, decided on the replica's node (the model's trained
    context when shorter); ``passes`` are pass names, resolved after ``plugins`` (files) load there."""
    path: str                          # as each node reads it (~ and $VARS expand there), or bench.DEMO
    model_id: str | None = None        # None: the file's stem
    parallel: int = 1
    ctx: int | None = None
    queue: int = 16
    api_key: str | None = None
    pooling: str = "mean"
    backend: str = "llvm"
    threads: int | None = None
    passes: tuple = ()
    plugins: tuple = ()
    max_memory: str | None = None
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"


class ReplicaHeader:
    """ASGI middleware: every HTTP response carries ``x-ggraph-replica: NAME``."""

    def __init__(self, app, name: str):
        self.app, self.header = app, (b"x-ggraph-replica", name.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)
        await self.app(scope, receive, tagged)


class LeastBusy(RequestRouter):
    """Ray Serve's router, told to send each request to the replica with the fewest in flight, wherever it is
    (its default prefers the proxy's own node until that replica is full, leaving the others idle)."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        return [random.sample(candidate_replicas, len(candidate_replicas))]    # one rank; ties at random


@serve.ingress()
class Replica:
    """One replica: an Engine on this node and the app over it, built when Ray Serve starts the actor."""

    def __init__(self, spec: ReplicaSpec):
        from ggraph import plugins
        from ggraph.cli.common import context_length
        from ggraph.passes import resolve
        from ggraph.serve.engine import Engine
        plugins.load_defaults()
        for path in spec.plugins:
            plugins.load_file(path)
        path = node_path(spec.path)
        try:
            ctx = context_length(argparse.Namespace(ctx=spec.ctx), path)
            self.engine = Engine(path, parallel=spec.parallel, ctx=ctx, queue=spec.queue, backend=spec.backend,
                                 threads=spec.threads, passes=resolve(list(spec.passes)), max_memory=spec.max_memory,
                                 cache_type_k=spec.cache_type_k, cache_type_v=spec.cache_type_v)
        except FileNotFoundError as e:                  # each node reads its own copy of the file
            raise FileNotFoundError(f"node {_this_node()} has no file {path}") from e
        self.spec, self.model_id = spec, spec.model_id or Path(path).stem
        self.name = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self):
        from ggraph.serve.app import create_app
        app = create_app(self.engine, self.model_id, api_key=self.spec.api_key, pooling=self.spec.pooling)
        app.add_middleware(ReplicaHeader, name=self.name)
        return app

    def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose scheduler has stopped is replaced."""
        if not self.engine.alive:
            raise RuntimeError(f"replica {self.name}: the engine's scheduler is not running")

    def __del__(self):
        if hasattr(self, "engine"):
            self.engine.close(wait=0)                   # requests still running end with an error now


def _this_node() -> str:
    """This node as bench names it (its custom resources, else host:id) and its address."""
    here = ray.get_runtime_context().get_node_id()
    node = next(n for n in cluster_nodes() if n.node_id == here)
    return f"{node.name} ({node.ip})"


def application(spec: ReplicaSpec, replicas: int):
    """The Ray Serve application: ``replicas`` copies of Replica. Each reserves ``threads`` CPUs (1 when
    unset), so Ray places no more replicas on a node than its CPUs hold; each accepts one request more
    than its slots and queue hold, so that request gets the engine's own 503 while Ray's router sends
    the others to a replica with room."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a whole number >= 1, got {replicas!r}")
    deployment = serve.deployment(Replica, name=DEPLOYMENT, num_replicas=replicas,
                                  ray_actor_options={"num_cpus": spec.threads or 1},
                                  max_ongoing_requests=spec.parallel + spec.queue + 1,
                                  graceful_shutdown_timeout_s=2, graceful_shutdown_wait_loop_s=0.5,
                                  health_check_period_s=5, max_constructor_retry_count=replicas,
                                  request_router_config=RequestRouterConfig(request_router_class=LeastBusy))
    return deployment.bind(spec)


def serve_on_cluster(spec: ReplicaSpec, replicas: int, address: str, host: str, port: int) -> None:
    """Deploy on the Ray cluster at ``address`` (``auto``, ``HOST:PORT`` or ``ray://HOST:PORT``) with the
    endpoint on ``host:port`` of the head node, and serve until Ctrl-C or SIGTERM; then delete the
    application, and Ray Serve itself when this call started it, so nothing of ours stays on the cluster."""
    app = application(spec, replicas)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)      # its progress lines; errors still show
    connected = connect(address)                        # False: this process was on a cluster already
    ours = _get_global_client(raise_if_no_controller_running=False) is None    # Serve is ours to stop
    previous = signal.signal(signal.SIGTERM, _interrupt)
    deployed = False
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
        _check_endpoint(host, port)
        deployed = True
        try:
            serve.run(app, name=APP, route_prefix="/")
        except RuntimeError as e:                       # a replica could not start: its error, not Ray's frames
            raise RuntimeError(f"the replicas did not start: {_replica_error(e)}") from e
        where = f"http://{host}:{port}"
        name = spec.model_id or ("the demo model" if spec.path == DEMO else Path(spec.path).stem)
        print(f"ggraph serve: {name} on {where}/v1 ({replicas} replica(s) of {spec.parallel} slot(s) on "
              f"the Ray cluster at {address}{', API key required' if spec.api_key else ''}); Ctrl-C stops",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        try:
            if deployed:
                serve.delete(APP)
            if ours:
                serve.shutdown()
        finally:
            if connected:
                ray.shutdown()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _check_endpoint(host: str, port: int) -> None:
    """Ray Serve keeps the HTTP options it started with: a Serve already running elsewhere is refused."""
    config = _get_global_client().http_config
    if (config.host, config.port) != (host, port):
        raise ValueError(f"--host/--port {host}:{port}: Ray Serve already runs on this cluster with its endpoint "
                         f"on {config.host}:{config.port}; pass those, or stop it (serve shutdown)")


def _replica_error(e: Exception) -> str:
    """The last line naming an exception in the deployment's status message (a replica's traceback)."""
    try:
        text = serve.status().applications[APP].deployments[DEPLOYMENT].message
    except Exception:                                   # no status to read: Ray's own error then
        text = str(e)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if "Error: " in line or "Exception: " in line]
    return (named or lines or [type(e).__name__])[-1]
