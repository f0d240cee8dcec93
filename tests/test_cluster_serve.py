"""``ggraph serve --replicas 2 --cluster ADDRESS`` on the local two-node Ray cluster of ray_cluster.py, as
the official ``openai`` client sees it: greedy text equal to one process's (a Session's, in this process)
from both replicas, errors and auth equal to the single-process app's (run here over an Engine of its own),
the endpoint still answering after a replica is killed, and nothing of Serve left on the cluster after
Ctrl-C. Also the flags' one-line errors, a node without the file, and a second endpoint refused."""
import concurrent.futures
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import zoo
from ray_cluster import free_port, ray_cluster  # noqa: F401  (the fixture)

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")   # Ray Serve's own

KEY = "test-key"
MODEL = "zoo"
CTX = 256
PROMPTS = ["Hello world", "Once upon a time", "The capital of France is", "1, 2, 3,"]
N_TOKENS = 24


def model():
    return zoo.cached_model("llama", "f32")


def ggraph(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "ggraph.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd="/tmp")


class ClusterServer:
    """The CLI serving 2 replicas of one slot each (so a request runs alone: ``ggraph run``'s text to the bit)."""

    def __init__(self, cluster):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "ggraph.cli", "serve", str(model()), "--cluster",
                                      cluster.address, "--replicas", "2", "--parallel", "1", "--ctx", str(CTX),
                                      "-t", "1", "--port", str(self.port), "--api-key", KEY, "--alias", MODEL],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/tmp",
                                     env=cluster.env(PYTHONUNBUFFERED="1"))
        self.lines: list[str] = []                           # its output, read as it comes
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 300                     # until every replica runs: it says so
        while not any("Ctrl-C stops" in line for line in self.lines) or not self.answers():
            if self.proc.poll() is not None:
                time.sleep(0.5)
                raise RuntimeError(f"ggraph serve --cluster exited: {''.join(self.lines)}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ggraph serve --cluster did not start in 300 s: {''.join(self.lines)}")
            time.sleep(0.5)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def answers(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def complete(self, prompt: str) -> tuple[str, str]:
        """(greedy text, the replica that answered)."""
        raw = self.client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS,
                                                               temperature=0)
        return raw.parse().choices[0].text, raw.headers["x-ggraph-replica"]

    def stop(self) -> int:
        """Ctrl-C, as a user would; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(ray_cluster):  # noqa: F811
    s = ClusterServer(ray_cluster)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ray_driver(ray_cluster):  # noqa: F811
    """This process connected to the cluster (to find and kill replicas), disconnected after the module."""
    import ray
    ray.init(address=ray_cluster.address, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def solo_texts():
    """Each prompt's greedy text from one process: a Session on the same file, same context and threads."""
    from ggraph.runtime.session import Session
    s = Session(model(), ctx=CTX, threads=1)
    return {p: s.generate(p, max_tokens=N_TOKENS, temperature=0) for p in PROMPTS}


def concurrent_completions(server, rounds_until_both=2, limit=8) -> tuple[list, set]:
    """Every prompt sent at once, in rounds, until ``rounds_until_both`` rounds ran and two replicas have
    answered (at most ``limit`` rounds); ([(prompt, text)], the replicas that answered)."""
    got, replicas = [], set()
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        for i in range(limit):
            for prompt, (text, replica) in zip(PROMPTS, pool.map(server.complete, PROMPTS)):
                got.append((prompt, text))
                replicas.add(replica)
            if i + 1 >= rounds_until_both and len(replicas) == 2:
                break
    return got, replicas


def serve_replicas(ray) -> set[str]:
    """The names of our application's replica actors alive on the cluster."""
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::ggraph#")}


# -- flags: no cluster needed ------------------------------------------------------------------------------
def test_replicas_needs_cluster_and_a_positive_count():
    r = ggraph("serve", model(), "--replicas", "2")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "ggraph serve: error: --replicas needs --cluster ADDRESS: a Ray cluster's (auto, HOST:PORT or "
        "ray://HOST:PORT; 'ray start --head' starts one here)"]
    r = ggraph("serve", model(), "--replicas", "0", "--cluster", "auto")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "ggraph serve: error: --replicas must be at least 1 replica, got 0"]


def test_an_address_without_a_cluster_is_refused_at_once():
    with socket.socket() as s:                             # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = ggraph("serve", model(), "--cluster", f"127.0.0.1:{port}", "--replicas", "2")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"ggraph serve: error: --cluster 127.0.0.1:{port}: cannot connect (Connection refused)"]


def test_without_ray_the_flag_says_how_to_install_it():
    code = ("import sys; sys.modules['ray'] = None; from ggraph.cli import main; "
            f"sys.exit(main(['serve', {str(model())!r}, '--cluster', 'auto', '--replicas', '2']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/tmp", timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "ggraph serve: error: --cluster needs Ray Serve: pip install 'ggraph[cluster]'"]


# -- two replicas on two nodes --------------------------------------------------------------------------------
def test_a_node_without_the_file_is_named(ray_cluster):  # noqa: F811  (before the server: Serve is free)
    r = ggraph("serve", "~/no-such-model.gguf", "--cluster", ray_cluster.address, "--replicas", "1", "--ctx", CTX,
               "--port", free_port(), env=ray_cluster.env())
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("ggraph serve: error: the replicas did not start: "), r.stderr
    assert any(re.search(f"FileNotFoundError: node {name} \\(.*\\) has no file {node.home}/no-such-model.gguf$", last)
               for name, node in ray_cluster.nodes.items()), last


def test_concurrent_requests_get_one_process_text_from_both_replicas(server, solo_texts):
    got, replicas = concurrent_completions(server)
    assert len(replicas) == 2, f"only replica {replicas} answered"
    for prompt, text in got:
        assert text == solo_texts[prompt], prompt


def test_streaming_and_chat_through_the_router(server, solo_texts):
    prompt = PROMPTS[0]
    chunks = list(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_TOKENS, temperature=0,
                                                   stream=True))
    assert "".join(c.choices[0].text for c in chunks) == solo_texts[prompt]
    assert chunks[-1].choices[0].finish_reason == "length"
    msgs = [{"role": "user", "content": "Tell me a story"}]
    r = server.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    streamed = list(server.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                                          stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == r.choices[0].message.content
    assert r.usage.completion_tokens == 8


def test_auth_errors_models_and_metrics_as_one_process(server):
    """Each request's status and body from the cluster equal the single-process app's (its ids and dates aside)."""
    from starlette.testclient import TestClient
    from ggraph.serve.app import create_app
    from ggraph.serve.engine import Engine
    engine = Engine(str(model()), parallel=1, ctx=CTX, threads=1)
    try:
        local = TestClient(create_app(engine, MODEL, api_key=KEY))
        auth = {"Authorization": f"Bearer {KEY}"}
        cases = [("POST", "/v1/completions", {"prompt": "Hi"}, {}),                                   # no key: 401
                 ("POST", "/v1/completions", {"prompt": "Hi"}, {"Authorization": "Bearer wrong"}),
                 ("GET", "/metrics", None, {}),
                 ("POST", "/v1/completions", {"prompt": "Hi", "temperature": "hot"}, auth),           # 400 names it
                 ("POST", "/v1/completions", {"prompt": "Hi", "model": "other"}, auth),               # 404 model
                 ("POST", "/v1/completions", {"prompt": "Hi " * 400}, auth),                          # too long
                 ("POST", "/v1/embeddings", {"input": []}, auth),
                 ("GET", "/v1/nowhere", None, auth),                                                  # 404 route
                 ("GET", "/v1/completions", None, auth)]                                              # 405
        for method, path, body, headers in cases:
            there = httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)
            here = local.request(method, path, json=body, headers=headers)
            assert (there.status_code, there.json()) == (here.status_code, here.json()), (method, path, body)
            assert there.status_code >= 400
        width = engine.session.config.n_embd
        models = httpx.get(server.url + "/v1/models", headers=auth).json()["data"]
        assert [(m["id"], m["meta"]) for m in models] == [(MODEL, {"n_ctx": CTX, "slots": 1})]
    finally:
        engine.close()
    metrics = httpx.get(server.url + "/metrics", headers=auth)
    assert "ggraph_slots_total 1\n" in metrics.text and metrics.headers["x-ggraph-replica"]
    vec = server.client.embeddings.create(model=MODEL, input="Hello world").data[0].embedding
    assert len(vec) == width


def test_a_second_endpoint_is_refused_and_ours_keeps_serving(server, ray_cluster, solo_texts):  # noqa: F811
    port = free_port()
    r = ggraph("serve", model(), "--cluster", ray_cluster.address, "--replicas", "1", "--port", port, "-t", "1",
               env=ray_cluster.env())
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        f"ggraph serve: error: --host/--port 127.0.0.1:{port}: Ray Serve already runs on this cluster with its "
        f"endpoint on 127.0.0.1:{server.port}; pass those, or stop it (serve shutdown)")
    assert server.complete(PROMPTS[0])[0] == solo_texts[PROMPTS[0]]


def test_a_killed_replica_is_replaced_and_the_endpoint_keeps_answering(server, ray_driver, solo_texts):
    ray = ray_driver
    before = serve_replicas(ray)
    assert len(before) == 2
    victim = sorted(before)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    for prompt in PROMPTS:                                   # at once: the survivor answers
        assert server.complete(prompt)[0] == solo_texts[prompt]
    from ray import serve
    deadline = time.monotonic() + 240                        # Ray notices, starts one, it loads and compiles
    while True:
        now = serve_replicas(ray)
        states = serve.status().applications["ggraph"].deployments["GgraphServe"].replica_states
        if victim not in now and len(now) == 2 and states == {"RUNNING": 2}:
            break
        assert time.monotonic() < deadline, f"no replacement replica running: {now}, {states}"
        assert server.complete(PROMPTS[1])[0] == solo_texts[PROMPTS[1]]
        time.sleep(1)
    got, replicas = concurrent_completions(server)
    assert len(replicas) == 2 and victim.rsplit("#", 1)[1] not in replicas
    assert all(text == solo_texts[prompt] for prompt, text in got)


def test_ctrl_c_removes_the_application_and_serve(server, ray_driver):
    ray = ray_driver
    assert server.stop() == 0
    assert not server.answers()
    deadline = time.monotonic() + 60                         # the actors' processes exit after the call returns
    while True:
        left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
        cpus = ray.available_resources().get("CPU", 0)
        if not left and cpus == ray.cluster_resources()["CPU"]:
            break
        assert time.monotonic() < deadline, f"left on the cluster: {left}, {cpus} CPUs free"
        time.sleep(1)
    out = "".join(server.lines)
    assert "2 replica(s) of 1 slot(s)" in out and "Traceback" not in out
