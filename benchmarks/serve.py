"""Concurrent greedy streams against a running `ggraph serve` (or any OpenAI-compatible server):
llama-server-style numbers, and whether each stream's text equals its text alone.

    ggraph serve --demo --parallel 8 -t 2 &
    python benchmarks/serve.py --url http://127.0.0.1:8080/v1 --streams 1,8 --tokens 64

For each count N: the N prompts run one at a time first (the "alone" texts), then all at once;
per stream it reports time to first token and decode tok/s, and the total decode tok/s of the N.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import time


def stream(client, model: str, prompt: str, tokens: int) -> dict:
    t0 = time.perf_counter()
    first, text, n = None, "", 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            text += chunk.choices[0].text
        if chunk.usage:
            n = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = first or end
    return {"text": text, "tokens": n, "ttft": first - t0, "decode": (n - 1) / (end - first) if n > 1 and end > first else 0.0}


def measure(client, model: str, n: int, tokens: int) -> dict:
    prompts = [f"Story number {i}: once upon a time" for i in range(n)]
    alone = [stream(client, model, p, tokens) for p in prompts]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        together = list(pool.map(lambda p: stream(client, model, p, tokens), prompts))
    wall = time.perf_counter() - t0
    return {"streams": n, "wall_s": wall, "equal": sum(a["text"] == b["text"] for a, b in zip(alone, together)),
            "alone_decode": sum(r["decode"] for r in alone) / n, "ttft_ms": 1e3 * sum(r["ttft"] for r in together) / n,
            "decode_per_stream": sum(r["decode"] for r in together) / n,
            "decode_total": sum(r["decode"] for r in together), "tokens": sum(r["tokens"] for r in together)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--streams", default="1,8", help="comma list of concurrent stream counts")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    args = ap.parse_args(argv)
    import openai
    client = openai.OpenAI(base_url=args.url, api_key=args.api_key, timeout=600, max_retries=0)
    model = args.model or client.models.list().data[0].id
    print(f"{'streams':>7} {'first token ms':>14} {'decode tok/s per stream':>23} {'total':>8} {'alone':>7} "
          f"{'same text as alone':>18}")
    for n in (int(x) for x in args.streams.split(",")):
        r = measure(client, model, n, args.tokens)
        print(f"{n:>7} {r['ttft_ms']:>14.0f} {r['decode_per_stream']:>23.1f} {r['decode_total']:>8.1f} "
              f"{r['alone_decode']:>7.1f} {r['equal']:>15}/{n}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
