"""``ggraph run``: generate text from a model, streaming it."""
from __future__ import annotations

import sys

from ggraph.cli.common import (add_compile_args, add_model_arg, add_sampling_args, open_session, resolved_passes,
                               sampling_options)


def cmd_run(args) -> int:
    """Generate text from a GGUF model, streaming it as it comes."""
    from ggraph.runtime.session import ContextFullError
    passes = resolved_passes(args)                        # every argument checked before anything slow or printed
    options = dict(sampling_options(args), max_tokens=args.n_predict, stream=True)
    constraint = _read_constraint(args)
    session = open_session(args, passes)                          # compiled before any text prints
    if constraint is not None:
        options["grammar"] = constraint(session.tokenizer)
    messages = [{"role": "user", "content": args.prompt}]
    try:
        pieces = session.chat(messages, **options) if args.chat else session.generate(args.prompt, **options)
    except ContextFullError:
        raise ValueError(_too_long(session, messages if args.chat else args.prompt)) from None
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
    if st.get("stop") == "context":
        print(f"ggraph run: note: the context is full (--ctx {session.ctx}): generation stopped", file=sys.stderr)
    pp = st["prompt_tokens"] / st["prompt_s"] if st.get("prompt_s") else 0.0
    tg = st["generated_tokens"] / st["generate_s"] if st.get("generate_s") else 0.0
    print(f"[{args.backend}] prompt: {st['prompt_tokens']} tokens, {pp:.1f} tok/s | "
          f"generated: {st['generated_tokens']} tokens, {tg:.1f} tok/s", file=sys.stderr)
    return 0


def _too_long(session, prompt) -> str:
    """The prompt-longer-than-the-context error in the command line's words (the Session's are the API's)."""
    ctx, tok = session.ctx, session.tokenizer
    if isinstance(prompt, str):
        try:
            tok.check_fits(prompt, ctx)
        except ValueError:
            return (f"the prompt is {len(prompt)} characters, more than a context of {ctx} tokens (--ctx/-c) "
                    f"holds: give a larger -c")
    n = len(session.chat_ids(prompt) if isinstance(prompt, list) else tok.encode(prompt))
    return f"the prompt is {n} tokens but the context is {ctx} (--ctx/-c): give a larger -c"


def _read_constraint(args):
    """The --grammar / --json-schema file, read and parsed now; returns tokenizer -> Grammar, or None."""
    import json
    from ggraph.runtime.grammar import Grammar, GrammarError
    if args.grammar and args.json_schema:
        raise ValueError("give --grammar or --json-schema, not both")
    from ggraph.cli.perplexity import read_text           # refuses a FIFO (it would block) and non-UTF-8 bytes
    if args.grammar:
        text = read_text(args.grammar)
        return lambda tok: Grammar.gbnf(tok, text)
    if args.json_schema:
        try:
            schema = json.loads(read_text(args.json_schema))
        except json.JSONDecodeError as e:
            raise GrammarError(f"{args.json_schema}: not valid JSON: {e}") from e
        return lambda tok: Grammar.json_schema(tok, schema)
    return None


def add_parser(sub, parents) -> None:
    p = sub.add_parser("run", help="generate text from a model", description=cmd_run.__doc__, parents=parents,
                       epilog="example: ggraph run --demo -p 'The capital of France is' -n 32 --temp 0")
    add_model_arg(p)
    p.add_argument("-p", "--prompt", required=True, help="the prompt text")
    add_sampling_args(p, 128, "tokens to generate (default 128; -1: until the end of text or a full context)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template (an instruction-tuned "
                        "model's; the demo model is a base model); 'ggraph chat' holds a conversation")
    p.add_argument("--no-echo", action="store_true", help="do not print the prompt before the generated text")
    p.add_argument("--grammar", metavar="FILE", help="constrain the output to a GBNF grammar (llama.cpp's format, "
                                                     "start rule 'root'); needs llguidance")
    p.add_argument("--json-schema", metavar="FILE", help="constrain the output to one JSON value valid under this "
                                                         "JSON schema; needs llguidance")
    add_compile_args(p)
    p.set_defaults(fn=cmd_run)
