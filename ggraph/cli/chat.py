"""``ggraph chat``: a conversation with a model in the terminal, its history kept in the KV cache."""
from __future__ import annotations

import argparse
import inspect
import sys

from ggraph.cli.common import (add_compile_args, add_model_arg, add_sampling_args, open_session, resolved_passes,
                               sampling_options)

HELP = """\
commands:
  /system TEXT   set the system message (the turns so far stay); /system alone removes it
  /reset         forget the conversation (the system message stays)
  /exit, /quit   leave (so do Ctrl-D and Ctrl-C at the prompt)
  /help          this list
A line ending in \\ continues on the next line; a line starting with // sends one /.
Ctrl-C while the model replies stops the reply (what it said so far stays in the conversation)."""


def cmd_chat(args) -> int:
    """Hold a conversation with an instruction-tuned model through its chat template.

    Each reply streams as it is made. The conversation stays in the KV cache, so a turn prefills only
    what is new; when the context fills, the oldest exchanges are dropped, the cache is rebuilt, and a
    note says so."""
    from ggraph.runtime.chat_template import ChatTemplateError
    from ggraph.runtime.conversation import Conversation
    from ggraph.runtime.session import ContextFullError
    passes = resolved_passes(args)                        # every argument checked before anything slow
    options = sampling_options(args)
    session = open_session(args, passes)
    conv = Conversation(session, max_tokens=args.n_predict, notes=note, **options)
    if args.system:
        conv.set_system(args.system)
    tty = sys.stdin.isatty()
    if tty:
        _line_editing()
    tok = session.tokenizer
    template = "its chat template" if tok.chat_template else \
        "a built-in chat format (the file has no chat template)"
    print(f"ggraph chat: {session.model.file.metadata.get('general.name', args.model or 'model')} "
          f"({session.config.arch}, ctx {session.ctx}) with {template}. /help lists the commands.",
          file=sys.stderr, flush=True)
    while True:
        text = _read(tty)
        if text is None:
            break
        if text.startswith("/") and not text.startswith("//"):
            verb, _, rest = text.partition(" ")
            if verb in ("/exit", "/quit"):
                break
            if verb == "/help":
                print(HELP, file=sys.stderr)
            elif verb == "/reset":
                conv.reset()
                note("the conversation is forgotten")
            elif verb == "/system":
                try:
                    conv.set_system(rest.strip() or None)
                    note("system message set" if rest.strip() else "system message removed")
                except ChatTemplateError as e:
                    note(f"the template refuses that system message, which is not set: {e}")
            else:
                note(f"unknown command {verb}; /help lists them (start with // to send a line beginning with /)")
            continue
        if text.startswith("//"):
            text = text[1:]
        if not text.strip():
            continue
        try:
            for piece in conv.send(text):
                print(piece, end="", flush=True)
            print(flush=True)
        except KeyboardInterrupt:
            print(flush=True)
            note("reply stopped")
        except (ContextFullError, ChatTemplateError) as e:
            print(flush=True)
            note(str(e))
        else:
            if args.stats:
                _print_stats(conv.stats)
    return 0


def note(text: str) -> None:
    print(f"ggraph chat: note: {text}", file=sys.stderr, flush=True)


def _read(tty: bool) -> str | None:
    """One message (continued over lines ending in a backslash), or None at the end of input."""
    lines = []
    while True:
        try:
            line = input(("> " if not lines else ". ") if tty else "")
        except EOFError:
            if tty:
                print(file=sys.stderr)
            return "\n".join(lines) if lines else None
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return None
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def _line_editing() -> None:
    """Arrow keys and history at the prompt, where the readline module exists."""
    try:
        import readline  # noqa: F401  (importing it is what turns line editing on for input())
    except ImportError:
        pass


def _print_stats(st: dict) -> None:
    pp = st["prompt_tokens"] / st["prompt_s"] if st.get("prompt_s") else 0.0
    tg = st["generated_tokens"] / st["generate_s"] if st.get("generate_s") else 0.0
    print(f"[prefilled {st['prompt_tokens']} tokens ({st['cached_tokens']} reused from the cache), {pp:.1f} tok/s | "
          f"generated {st['generated_tokens']} tokens, {tg:.1f} tok/s]", file=sys.stderr, flush=True)


def add_parser(sub, parents) -> None:
    p = sub.add_parser("chat", help="talk with a model in the terminal", description=inspect.cleandoc(cmd_chat.__doc__),
                       parents=parents, epilog="example: ggraph chat qwen2.5-0.5b-instruct-q4_k_m.gguf "
                                               "--system 'Answer in one sentence.'\n\n" + HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="the system message to start with")
    add_sampling_args(p, -1, "most tokens per reply (default -1: until the end of the turn or a full context)")
    p.add_argument("--stats", action="store_true",
                   help="after each reply, print the tokens prefilled, reused from the cache and generated")
    add_compile_args(p)
    p.set_defaults(fn=cmd_chat)
