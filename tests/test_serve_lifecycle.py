"""``ggraph serve`` when a request ends early: a client that goes away, and Ctrl-C with streams open.
Each test starts its own server on a small zoo model with a long context, so that a request
generates for many seconds unless something stops it."""
import json
import signal
import time

import pytest

import zoo
from test_serve import KEY, Server

httpx = pytest.importorskip("httpx")

CTX = 32768                     # ~20 s to fill on the zoo model: a request left alone runs that long


@pytest.fixture
def server():
    s = Server(zoo.cached_model("llama", "f32"), "--ctx", str(CTX))
    yield s
    s.close()


def long_request(stream: bool) -> dict:
    return {"prompt": "Far away", "max_tokens": CTX - 16, "temperature": 0, "stream": stream}


def test_a_client_that_leaves_a_non_streamed_request_frees_its_slot(server):
    """The slot stayed busy until the whole generation finished (only streams watched the client)."""
    before = server.metric("requests_cancelled_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=long_request(False), headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(30, read=1.0))                # the client gives up and disconnects
    deadline = time.monotonic() + 3
    while server.metric("requests_processing") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("requests_processing") == 0
    assert server.metric("requests_cancelled_total") == before + 1
    assert server.metric("requests_finished_total") == 0


def test_ctrl_c_ends_open_streams_with_an_error_and_exits_within_a_second(server):
    """Ctrl-C waited out uvicorn's 5 s graceful shutdown, then cancelled the stream mid-chunk (the client saw
    no end) and printed two tracebacks (CancelledError, and the scheduler's "Event loop is closed")."""
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=long_request(True),
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        lines = r.iter_lines()
        while len(events) < 3:
            line = next(lines)
            if line.startswith("data: "):
                events.append(line)
        server.proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        try:
            events += [line for line in lines if line.startswith("data: ")]
        except httpx.HTTPError as e:                                  # the stream was cut mid-chunk
            events.append(f"cut: {e!r}")
    server.proc.wait(timeout=30)
    took = time.monotonic() - t0
    log = server.proc.stdout.read()
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2][len("data: "):])
    assert error["error"]["message"] == "the server is shutting down", events[-3:]
    assert took < 1.0, f"exit took {took:.1f} s"
    assert "Traceback" not in log and "Error" not in log, log
