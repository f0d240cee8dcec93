"""The OpenAI-compatible HTTP API over an Engine, as a Starlette (ASGI) app.

    POST /v1/chat/completions   POST /v1/completions   POST /v1/embeddings
    GET /v1/models              GET /health            GET /metrics (Prometheus text)

Requests and responses follow OpenAI's shapes, streaming included (server-sent events ending
with ``data: [DONE]``); errors too: ``{"error": {"message", "type", "param", "code"}}`` with
400 for a bad request (the message names the field), 401 for a missing or wrong API key, 404
for an unknown model or route, 503 when every slot is busy and the queue is full.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import time
import uuid

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ggraph.runtime.grammar import Grammar, GrammarError
from ggraph.serve.engine import Engine, Overloaded

DEFAULT_MAX_TOKENS = 16                  # /v1/completions' default, as OpenAI's
SAMPLING = {"temperature": (float, 1.0), "top_p": (float, 1.0), "top_k": (int, 40), "min_p": (float, 0.05),
            "repeat_penalty": (float, 1.0)}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.kind, self.code)


def error_response(status: int, message: str, param=None, kind="invalid_request_error", code=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def create_app(engine: Engine, model_id: str, api_key: str | None = None, pooling: str = "mean") -> Starlette:
    """The ASGI app serving ``engine`` under the name ``model_id``; ``api_key`` guards /v1/*;
    ``pooling`` is how /v1/embeddings pools a text's hidden states (mean, last or cls)."""
    created = int(time.time())

    def check(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def body_of(request: Request) -> dict:
        check(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}")
        except RecursionError:
            raise APIError(400, "the request body nests JSON deeper than Python's recursion limit")
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_id:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {model_id!r}", "model",
                           code="model_not_found")
        return body

    def encode(text: str, param: str) -> list[int]:
        """``text``'s token ids; a text too long for a slot's context is refused before it is encoded."""
        try:
            engine.tokenizer.check_fits(text, engine.ctx, f"the {param}")
        except ValueError as e:
            raise APIError(400, f"{e} (start the server with a larger --ctx)", param, code="context_length_exceeded")
        return engine.tokenizer.encode(text)

    def submit(ids, options: dict, kind: str = "generate"):
        """Queue a job on the engine; (job, the asyncio queue its pieces arrive on). 503 when full."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        emit = lambda what, value: loop.call_soon_threadsafe(queue.put_nowait, (what, value))  # noqa: E731
        try:
            return engine.submit(ids, options, emit, kind=kind), queue
        except Overloaded as e:
            raise APIError(503, str(e), kind="server_error", code="overloaded")

    def failure(message: str) -> APIError:
        """The error of a job the engine ended: 503 when the server is shutting down, else 500."""
        if engine.closed:
            return APIError(503, message, kind="server_error", code="shutting_down")
        return APIError(500, message, kind="server_error")

    async def models(request: Request) -> Response:
        check(request)
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "ggraph",
             "meta": {"n_ctx": engine.ctx, "slots": engine.parallel}}]})

    async def completions(request: Request) -> Response:
        body = await body_of(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = encode(prompt, "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = _token_ids(prompt, engine.tokenizer.n_vocab, "prompt")
        else:
            raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
        return await run(request, body, ids, DEFAULT_MAX_TOKENS, chat=False)

    async def chat_completions(request: Request) -> Response:
        body = await body_of(request)
        messages = _messages(body.get("messages"))
        try:
            ids = engine.session.chat_ids(messages)
        except Exception as e:                            # the template refuses these messages
            raise APIError(400, f"the chat template cannot render these messages: {e}", "messages")
        return await run(request, body, ids, None, chat=True)

    async def run(request: Request, body: dict, ids: list[int], default_max: int | None, chat: bool) -> Response:
        options = _options(body, default_max)
        if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
            raise APIError(400, f"'stream' must be true or false, got {body.get('stream')!r}", "stream")
        constraint = _constraint(body)
        if constraint is not None:
            build, param = constraint
            try:                                          # the first one builds llguidance's vocabulary: ~1 s
                options["grammar"] = await asyncio.to_thread(build, engine.tokenizer)
            except GrammarError as e:
                raise APIError(400, str(e), param)
        if len(ids) > engine.ctx:
            raise APIError(400, f"the prompt is {len(ids)} tokens, more than the context of {engine.ctx} tokens "
                                f"(start the server with a larger --ctx)", "messages" if chat else "prompt",
                           code="context_length_exceeded")
        job, queue = submit(ids, options)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        stamp = int(time.time())
        if body.get("stream"):
            return StreamingResponse(_events(job, queue, rid, stamp, model_id, chat, body), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text = []
        async with watching(request, job, queue):
            while True:
                kind, value = await queue.get()
                if kind == "piece":
                    text.append(value)
                elif kind == "error":
                    raise failure(value)
                elif kind == "gone":
                    return Response(status_code=499)     # no one reads it: nginx's "client closed request"
                else:
                    break
        usage = _usage(value)
        choice = {"index": 0, "finish_reason": value["finish_reason"], "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": stamp,
                             "model": model_id, "choices": [choice], "usage": usage})

    async def embeddings(request: Request) -> Response:
        body = await body_of(request)
        texts = body.get("input")
        if isinstance(texts, str) or (isinstance(texts, list) and texts and all(isinstance(t, int) for t in texts)):
            texts = [texts]
        if not isinstance(texts, list) or not texts or len(texts) > 256:
            raise APIError(400, "'input' must be a string, a list of up to 256 strings, or token ids", "input")
        ids = []
        for i, t in enumerate(texts):
            if isinstance(t, str) and t:
                ids.append(encode(t, "input"))
            elif isinstance(t, list) and t and all(isinstance(x, int) and not isinstance(x, bool) for x in t):
                ids.append(_token_ids(t, engine.tokenizer.n_vocab, "input"))
            else:
                raise APIError(400, f"input[{i}] must be a non-empty string or list of token ids", "input")
            if len(ids[-1]) > engine.ctx:
                raise APIError(400, f"input[{i}] is {len(ids[-1])} tokens, more than the context of {engine.ctx} tokens",
                               "input", code="context_length_exceeded")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise APIError(400, f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", "encoding_format")
        width = engine.session.config.n_embd
        if body.get("dimensions") not in (None, width):
            raise APIError(400, f"'dimensions' must be this model's {width} (no truncation)", "dimensions")
        job, queue = submit(ids, {"pooling": pooling}, kind="embed")
        async with watching(request, job, queue):
            kind, value = await queue.get()
        if kind == "error":
            raise failure(value)
        if kind == "gone":
            return Response(status_code=499)
        data = []
        for i, v in enumerate(value["embeddings"]):
            vec = base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() if fmt == "base64" else \
                [float(x) for x in v]
            data.append({"object": "embedding", "index": i, "embedding": vec})
        n = value["prompt_tokens"]
        return JSONResponse({"object": "list", "data": data, "model": model_id,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def health(request: Request) -> Response:
        st = engine.status()
        return JSONResponse({"status": "ok", "slots_idle": st["slots"] - st["active"], "slots_processing": st["active"],
                             "requests_waiting": st["waiting"]})

    async def metrics(request: Request) -> Response:
        check(request)
        return PlainTextResponse(_prometheus(engine), media_type="text/plain; version=0.0.4")

    async def not_found(request: Request, exc) -> Response:
        return error_response(404, f"no route {request.method} {request.url.path}", code="not_found")

    async def method_not_allowed(request: Request, exc) -> Response:
        return error_response(405, f"{request.method} is not allowed on {request.url.path}")

    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/embeddings", embeddings, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: method_not_allowed, APIError: api_error})


@contextlib.asynccontextmanager
async def watching(request: Request, job, queue: asyncio.Queue):
    """While a non-streamed request waits for ``job``: ("gone", None) on ``queue`` as soon as the client
    disconnects (its body is read, so the next ASGI message is http.disconnect). On the way out the job
    is cancelled, which frees its slot if it still runs (a no-op once it is done)."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        queue.put_nowait(("gone", None))
    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        job.cancel()


async def _events(job, queue, rid, stamp, model_id, chat, body):
    """Server-sent events of one streaming request; the job is cancelled if the client goes away."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(delta: str | None, finish=None, role: bool = False, usage=None) -> str:
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        chunk = {"id": rid, "object": kind, "created": stamp, "model": model_id, "choices": [choice]}
        if usage is not None:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    try:
        if chat:
            yield event(None, role=True)
        while True:
            what, value = await queue.get()
            if what == "piece":
                yield event(value)
            elif what == "error":
                yield f"data: {json.dumps({'error': {'message': value, 'type': 'server_error', 'param': None, 'code': None}})}\n\n"
                break
            else:
                usage = _usage(value) if (body.get("stream_options") or {}).get("include_usage") else None
                yield event(None, value["finish_reason"], usage=usage)
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()


def _usage(info: dict) -> dict:
    return {"prompt_tokens": info["prompt_tokens"], "completion_tokens": info["completion_tokens"],
            "total_tokens": info["prompt_tokens"] + info["completion_tokens"]}


def _messages(messages) -> list[dict]:
    """OpenAI chat messages as the template wants them: role and text content (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role' string", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                                   f"messages[{i}].content")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                           f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    return out


def _options(body: dict, default_max: int | None) -> dict:
    """Session.generate's keywords from an OpenAI request, each field checked and named when wrong."""
    from ggraph.runtime.sampling import Sampler
    opts = {}
    for name, (typ, default) in SAMPLING.items():
        v = body.get(name, default)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v) \
                or (typ is int and not float(v).is_integer()):
            raise APIError(400, f"'{name}' must be {'a whole number' if typ is int else 'a number'}, got {v!r}", name)
        try:
            Sampler(**{name: typ(v)})                      # this field alone: its range
        except ValueError as e:
            raise APIError(400, str(e), name)
        opts[name] = typ(v)
    n = body.get("n", 1)
    if n != 1:
        raise APIError(400, f"'n' must be 1 (one choice per request), got {n!r}", "n")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(field, default_max)
    if max_tokens is None:
        max_tokens = -1                                    # until the end of text or a full context
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise APIError(400, f"'{field}' must be a whole number >= 1, got {max_tokens!r}", field)
    opts["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise APIError(400, "'stop' must be a string or a list of up to 16 non-empty strings", "stop")
    opts["stop"] = stop
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise APIError(400, f"'seed' must be a whole number >= 0, got {seed!r}", "seed")
    opts["seed"] = seed
    return opts


def _constraint(body: dict):
    """(tokenizer -> Grammar, the field it came from) for response_format, json_schema or grammar; or None."""
    fmt = body.get("response_format")
    given = [f for f in ("grammar", "json_schema") if body.get(f) is not None]
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise APIError(400, "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                           "response_format")
        if fmt["type"] != "text":
            given.append("response_format")
    if len(given) > 1:
        raise APIError(400, f"give one of response_format, json_schema and grammar, not {' and '.join(given)}", given[1])
    if not given:
        return None
    if given[0] == "grammar":
        text = body["grammar"]
        if not isinstance(text, str):
            raise APIError(400, "'grammar' must be a GBNF grammar as a string", "grammar")
        return (lambda tok: Grammar.gbnf(tok, text)), "grammar"
    if given[0] == "json_schema":
        schema = body["json_schema"]
        return (lambda tok: Grammar.json_schema(tok, schema)), "json_schema"
    if fmt["type"] == "json_object":
        return Grammar.json_object, "response_format"
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise APIError(400, "'response_format.json_schema' must be {\"name\": ..., \"schema\": {...}}",
                       "response_format.json_schema")
    return (lambda tok: Grammar.json_schema(tok, spec["schema"])), "response_format.json_schema"


def _finite(v) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:                                  # an int beyond a float's range
        return False


def _token_ids(ids: list[int], n_vocab: int, param: str) -> list[int]:
    bad = [t for t in ids if not 0 <= t < n_vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})", param)
    return list(ids)


def _prometheus(engine: Engine) -> str:
    m, st = engine.metrics, engine.status()
    rows = [
        ("requests_total", "counter", "requests accepted", m.requests),
        ("requests_finished_total", "counter", "requests that ran to their end", m.finished),
        ("requests_cancelled_total", "counter", "requests whose client went away", m.cancelled),
        ("requests_failed_total", "counter", "requests that failed while running", m.failed),
        ("prompt_tokens_total", "counter", "prompt tokens prefilled", m.prompt_tokens),
        ("tokens_predicted_total", "counter", "tokens generated", m.generated_tokens),
        ("prompt_seconds_total", "counter", "seconds spent prefilling", m.prompt_seconds),
        ("tokens_predicted_seconds_total", "counter", "seconds spent decoding", m.generate_seconds),
        ("prompt_tokens_seconds", "gauge", "prefill tok/s over all requests",
         m.prompt_tokens / m.prompt_seconds if m.prompt_seconds else 0.0),
        ("predicted_tokens_seconds", "gauge", "decode tok/s of one stream over all requests",
         m.generated_tokens / m.generate_seconds if m.generate_seconds else 0.0),
        ("batch_steps_total", "counter", "native steps run for all busy slots at once", m.steps),
        ("batch_tokens_total", "counter", "tokens those steps ran (per step: the batch)", m.step_tokens),
        ("requests_processing", "gauge", "slots running a request", st["active"]),
        ("requests_deferred", "gauge", "requests waiting for a slot", st["waiting"]),
        ("slots_total", "gauge", "slots", st["slots"]),
        ("kv_cache_tokens", "gauge", "KV cache rows in use by running requests", st["kv_used"]),
        ("kv_cache_capacity_tokens", "gauge", "KV cache rows over all slots", st["kv_capacity"]),
    ]
    lines = []
    for name, kind, help_, value in rows:
        lines += [f"# HELP ggraph_{name} {help_}", f"# TYPE ggraph_{name} {kind}", f"ggraph_{name} {value}"]
    return "\n".join(lines) + "\n"
