"""A local Ray cluster of two "nodes" on this machine, started and torn down by the tests that need a fleet.

As a module-scoped pytest fixture (import it into the test module; skips when ray is not installed)::

    from ray_cluster import ray_cluster          # noqa: F401  (the fixture)

    def test_rows_from_both_nodes(ray_cluster):
        ray_cluster.address                  # "127.0.0.1:PORT": ray.init(address=...) or --cluster
        ray_cluster.client_address           # "ray://127.0.0.1:PORT", through the Ray Client server
        ray_cluster.dashboard_url            # for the state API: list_tasks(address=ray_cluster.dashboard_url)
        ray_cluster.nodes["node_b"].home     # the HOME that node's processes see (a dir of its own)
        ray_cluster.env()                    # os.environ with RAY_ADDRESS set, so "--cluster auto" (and
                                             # ray.init("auto")) in a subprocess finds this cluster

Outside pytest: ``with local_cluster() as cluster: ...``; ``local_cluster(nodes=...)`` takes other node
names, CPUs and per-node environment variables.

Each node is one ``ray start --block`` process (the head, then a worker joining it) in a session of its
own, with a custom resource of 1 named after it (``{"node_a": 1}``), a label (``zone=a``), its own HOME
(``<tmp>/<name>/home``) and, by default, one CPU. Every port is a free one picked here and Ray's files live in a private temp dir,
so clusters of other tests or other users on this machine are neither reached nor stopped: teardown
signals our ``ray start`` processes' sessions and then any process left in them or whose command line or
environment names the private dir, never ``ray stop``. The kernel cache ($GGRAPH_CACHE) stays the
driver's, so the nodes share compiled kernels.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

START_TIMEOUT = 120.0                  # seconds for both nodes to register on two busy cores
GRACE = 5.0                            # seconds for a node to stop on SIGTERM before SIGKILL (a test cluster
                                       # keeps nothing worth a graceful shutdown of half a minute)
OBJECT_STORE = 100 * 1024 * 1024       # bytes of shared memory per node: the tests pass rows, not tensors


@dataclasses.dataclass
class NodeSpec:
    name: str                          # also the node's custom resource: {"node_a": 1}
    cpus: int = 1
    env: dict = dataclasses.field(default_factory=dict)   # extra environment for the node's processes
    args: tuple = ()                                       # more `ray start` flags, e.g. ("--labels", "cpu=zen4")


@dataclasses.dataclass
class Node:
    name: str
    home: Path
    process: subprocess.Popen
    log: Path


@dataclasses.dataclass
class Cluster:
    address: str                       # "127.0.0.1:PORT" (the head's GCS)
    client_address: str                # "ray://127.0.0.1:PORT"
    dashboard_url: str                 # "http://127.0.0.1:PORT": ray.util.state.list_tasks(address=...)
    root: Path                         # the private dir: Ray's temp dirs, the nodes' HOMEs, logs
    nodes: dict[str, Node]

    def env(self, **extra) -> dict:
        """The environment for a driver subprocess: RAY_ADDRESS is this cluster (so "auto" means it)."""
        return {**os.environ, "RAY_ADDRESS": self.address, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_command() -> list[str]:
    """`ray` beside this interpreter (a pyenv shim would look for its root under the node's HOME)."""
    beside = Path(sys.executable).parent / "ray"
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


def _ports() -> list[str]:
    """Free ports for every listener a node opens; 0/0 lets workers take any port."""
    flags = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"]
    return [a for f in flags for a in (f, str(free_port()))] + ["--min-worker-port", "0", "--max-worker-port", "0"]


def _start(spec: NodeSpec, root: Path, head_args: list[str], base_env: dict) -> Node:
    home = root / spec.name / "home"
    home.mkdir(parents=True)
    log = root / f"{spec.name}.log"
    env = {**base_env, "HOME": str(home), **spec.env}
    cmd = [*_ray_command(), "start", "--block", "--disable-usage-stats", "--num-cpus", str(spec.cpus),
           "--resources", f'{{"{spec.name}": 1}}', "--object-store-memory", str(OBJECT_STORE),
           "--temp-dir", str(root / spec.name / "ray"), *_ports(), *head_args, *spec.args]
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Node(spec.name, home, process, log)


def _wait_for(address: str, nodes: dict[str, Node]) -> None:
    """Until every node is alive in the cluster, asked by one short-lived driver (so this process stays free
    to ray.init elsewhere) that polls; a node whose `ray start` exited fails at once with its log's tail."""
    probe = ("import ray, sys, time; ray.init(address=%r, logging_level='ERROR')\n"
             "while not set(sys.argv[1:]) <= {k for n in ray.nodes() if n['Alive'] for k in n['Resources']}:\n"
             "    time.sleep(0.5)\n" % address)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        driver = subprocess.Popen([sys.executable, "-c", probe, *nodes], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, "RAY_ADDRESS": address})
        while driver.poll() is None and time.monotonic() < deadline:
            dead = [n for n in nodes.values() if n.process.poll() is not None]
            if dead:
                driver.kill()
                raise RuntimeError(f"ray start for {dead[0].name} exited {dead[0].process.returncode}:\n"
                                   + dead[0].log.read_text()[-3000:])
            time.sleep(0.5)
        if driver.poll() is None:
            driver.kill()
        if driver.wait() == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the local Ray cluster at {address} did not show nodes {list(nodes)} within "
                               f"{START_TIMEOUT:.0f} s: {driver.stderr.read()[-2000:]}")
        time.sleep(1)                       # the head was not listening yet: ask again


def _leftovers(root: Path, sessions: set[int]) -> list[int]:
    """Pids of our processes: in one of the nodes' ``sessions``, or naming ``root`` in their command line or
    environment (a process that left its session would still carry the private dir)."""
    mark = str(root).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            session = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3])
            if session in sessions or mark in (entry / "cmdline").read_bytes() or \
                    mark in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except (OSError, ValueError, IndexError):     # gone, or not ours to read
            pass
    return pids


def _stop(nodes: dict[str, Node], root: Path) -> None:
    """SIGTERM each node's process group (``ray start --block`` and what it spawned), then SIGKILL whatever
    is left in the nodes' sessions or still names the private dir."""
    for node in reversed(list(nodes.values())):           # workers leave before the head
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE
    for node in nodes.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
    for node in nodes.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.process.pid, signal.SIGKILL)
        node.process.wait()
    for _ in range(10):
        left = _leftovers(root, {node.process.pid for node in nodes.values()})
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)


@contextlib.contextmanager
def local_cluster(nodes: tuple[NodeSpec, ...] = (NodeSpec("node_a", args=("--labels", "zone=a")),
                                                 NodeSpec("node_b", args=("--labels", "zone=b")))):
    """Start a head node for ``nodes[0]`` and worker nodes for the rest, yield the ``Cluster``, stop them."""
    root = Path(tempfile.mkdtemp(prefix="rayc-", dir="/tmp"))    # short: Ray's socket paths must fit 107 bytes
    from ggraph.demo import cache_dir                                # the real HOME's kernel cache, shared
    base_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
        "GGRAPH_CACHE": str(cache_dir()),
        "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "180"}   # a ray:// client's server starts slowly on busy cores
    port, client_port, dashboard_port = free_port(), free_port(), free_port()
    started: dict[str, Node] = {}
    try:
        head = ["--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--dashboard-host", "127.0.0.1",
                "--dashboard-port", str(dashboard_port), "--ray-client-server-port", str(client_port)]
        started[nodes[0].name] = _start(nodes[0], root, head, base_env)
        address = f"127.0.0.1:{port}"
        for spec in nodes[1:]:                    # `ray start --address` waits for the head's GCS itself
            started[spec.name] = _start(spec, root, ["--address", address, "--node-ip-address", "127.0.0.1"],
                                        base_env)
        _wait_for(address, started)
        yield Cluster(address, f"ray://127.0.0.1:{client_port}", f"http://127.0.0.1:{dashboard_port}", root, started)
    finally:
        _stop(started, root)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """The two-node local cluster (node_a, node_b: one CPU each, labels zone=a and zone=b) for one test
    module."""
    pytest.importorskip("ray", reason="the cluster tests need ray: pip install 'ggraph[cluster]'")
    with local_cluster() as cluster:
        yield cluster
