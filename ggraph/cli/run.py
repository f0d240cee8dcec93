"""``ggraph run``: generate text from a model, streaming it."""
from __future__ import annotations

import sys

from ggraph.cli.common import add_compile_args, add_model_arg, model_path, passes_arg, pipeline_names


def cmd_run(args) -> int:
    """Generate text from a GGUF model, streaming it as it comes."""
    from ggraph.runtime.sampling import Sampler
    from ggraph.runtime.session import Session
    pipeline_names(args)                                  # every argument checked before anything slow or printed
    Sampler(args.temp, args.top_k, args.top_p, args.min_p, args.repeat_penalty)
    if args.n_predict < 0:
        raise ValueError(f"--n-predict must be >= 0, got {args.n_predict}")
    session = Session(model_path(args), backend=args.backend, threads=args.threads, passes=passes_arg(args.passes),
                      ctx=args.ctx, disabled=args.no_pass, max_memory=args.max_memory)
    options = dict(max_tokens=args.n_predict, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                   min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop,
                   stream=True)
    session.program(last_only=True)                       # compile (with its progress bar) before any text prints
    if args.chat:
        pieces = session.chat([{"role": "user", "content": args.prompt}], **options)
    else:
        pieces = session.generate(args.prompt, **options)
    started = False
    try:
        for piece in pieces:
            if not started and not args.chat and not args.no_echo:
                print(args.prompt, end="", flush=True)      # once the prompt has encoded and its step ran
            started = True
            print(piece, end="", flush=True)
    finally:
        if started:
            print(flush=True)                              # an error after text starts on a line of its own
    if not started:
        if not args.chat and not args.no_echo:
            print(args.prompt, end="")
        print(flush=True)
    st = session.stats
    pp = st["prompt_tokens"] / st["prompt_s"] if st.get("prompt_s") else 0.0
    tg = st["generated_tokens"] / st["generate_s"] if st.get("generate_s") else 0.0
    print(f"[{args.backend}] prompt: {st['prompt_tokens']} tokens, {pp:.1f} tok/s | "
          f"generated: {st['generated_tokens']} tokens, {tg:.1f} tok/s", file=sys.stderr)
    return 0


def add_parser(sub, parents) -> None:
    p = sub.add_parser("run", help="generate text from a model", description=cmd_run.__doc__, parents=parents,
                       epilog="example: ggraph run --demo -p 'The capital of France is' -n 32 --temp 0")
    add_model_arg(p)
    p.add_argument("-p", "--prompt", required=True, help="the prompt text")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens (default 40; 0 = all)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min-p × the top probability (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalty for recent tokens (default 1.0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop at this text (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--no-echo", action="store_true", help="do not print the prompt before the generated text")
    add_compile_args(p)
    p.set_defaults(fn=cmd_run)
