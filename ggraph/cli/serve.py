"""``ggraph serve``: an OpenAI-compatible HTTP API for a model."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ggraph.cli.common import add_model_arg, context_length, model_path, resolved_passes

NEEDS = "ggraph serve needs starlette and uvicorn: pip install 'ggraph[serve]'"


def cmd_serve(args) -> int:
    """Serve a GGUF model over HTTP with OpenAI's API: /v1/chat/completions, /v1/completions (both
    streaming or not), /v1/embeddings, /v1/models, /health and /metrics (Prometheus). --parallel N
    slots each hold a context of --ctx tokens, and every step runs all of them at once (continuous
    batching); requests beyond them wait in a queue (then get 503). With --cluster, --replicas N copies of
    the server run on a Ray cluster behind one endpoint (docs/serve.md)."""
    if args.replicas is not None and args.cluster is None:
        raise ValueError("--replicas needs --cluster ADDRESS: a Ray cluster's (auto, HOST:PORT or ray://HOST:PORT; "
                         "'ray start --head' starts one here)")
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1 replica, got {args.replicas}")
    try:
        import uvicorn
        from ggraph.serve.app import create_app
        from ggraph.serve.server import Server
    except ImportError:
        print(f"ggraph serve: error: {NEEDS}", file=sys.stderr)
        return 1
    from ggraph.serve.engine import Engine
    passes = resolved_passes(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.parallel < 1:
        raise ValueError(f"--parallel must be at least 1 slot, got {args.parallel}")
    if args.queue < 0:
        raise ValueError(f"--queue must be >= 0 waiting requests, got {args.queue}")
    if args.cluster is not None:
        return _serve_on_cluster(args, passes)
    _check_port(args.host, args.port)                      # before the slow part
    path = model_path(args)
    engine = Engine(path, parallel=args.parallel, ctx=context_length(args, path), queue=args.queue,
                    backend=args.backend, threads=args.threads, passes=passes,
                    max_memory=args.max_memory, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v)
    model_id = args.alias or Path(path).stem
    app = create_app(engine, model_id, api_key=args.api_key, pooling=args.pooling)
    where = f"http://{args.host}:{args.port}"
    print(f"ggraph serve: {model_id} on {where}/v1 ({args.parallel} slot(s) of {engine.ctx} tokens"
          f"{', API key required' if args.api_key else ''}); Ctrl-C stops", file=sys.stderr, flush=True)
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=2), engine)
    try:
        server.run()
    finally:
        engine.close()
    return 0


def _serve_on_cluster(args, passes) -> int:
    """--cluster: the same server as N Ray Serve replicas, each loading the file on its own node."""
    try:
        from ggraph.cluster.serve import ReplicaSpec, serve_on_cluster
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("ray"):
            raise
        print("ggraph serve: error: --cluster needs Ray Serve: pip install 'ggraph[cluster]'", file=sys.stderr)
        return 1
    from ggraph.cluster.bench import DEMO, driver_path
    if args.demo:
        path = DEMO                                       # each node's own demo model
    elif args.model:
        path = driver_path(args.model)
    else:
        raise ValueError("give a MODEL path (each node reads it as its own) or --demo")
    spec = ReplicaSpec(path, args.alias, parallel=args.parallel, ctx=args.ctx, queue=args.queue,
                       api_key=args.api_key, pooling=args.pooling, backend=args.backend, threads=args.threads,
                       passes=tuple(p.name for p in passes), plugins=tuple(map(os.path.abspath, args.plugin)),
                       max_memory=args.max_memory, cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v)
    try:
        serve_on_cluster(spec, args.replicas or 1, args.cluster, args.host, args.port)
    except RuntimeError as e:                              # Ray's, or a replica's that could not start
        print(f"ggraph serve: error: {e}".splitlines()[0], file=sys.stderr)
        return 1
    return 0


def _check_port(host: str, port: int) -> None:
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: {e.strerror}") from e
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from e


def add_parser(sub, parents) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP with OpenAI's API", description=cmd_serve.__doc__,
                       parents=parents,
                       epilog="example: ggraph serve --demo --port 8080 --parallel 2\n"
                              "         curl http://127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' "
                              "-d '{\"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}'")
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /metrics")
    p.add_argument("--alias", default=None, help="the model name clients use (default: the file name's stem)")
    p.add_argument("--parallel", "-np", type=int, default=1, help="slots: requests served at once (default 1)")
    p.add_argument("--queue", type=int, default=16, help="requests that may wait for a slot before 503 (default 16)")
    p.add_argument("--pooling", default="mean", choices=["mean", "last", "cls"],
                   help="how /v1/embeddings pools a text's final hidden states (default mean)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning; info logs every request)")
    p.add_argument("--cluster", default=None, metavar="ADDRESS",
                   help="serve on the Ray cluster at ADDRESS (auto, HOST:PORT or ray://HOST:PORT), behind one "
                        "endpoint on the head node's --host/--port; needs 'ggraph[cluster]'")
    p.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="with --cluster: N copies of the server, each with its own --parallel slots and weights, "
                        "on the nodes Ray picks (default 1)")
    from ggraph.cli.common import add_compile_args
    add_compile_args(p)
    p.set_defaults(fn=cmd_serve)
