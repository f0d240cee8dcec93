"""Chat templates: render a GGUF file's Jinja template in a sandbox, or a small built-in one.

A template read from a GGUF file is untrusted input, so it runs in Jinja's immutable
sandbox, made stricter here: reaching for an unsafe attribute (``__class__``,
``__globals__``, ``list.append`` ...) raises at once instead of quietly rendering as
empty. Every failure, including ``raise_exception`` called by the template itself, is a
ChatTemplateError. The sandbox keeps templates away from Python; it does not bound the
time or memory a hostile template may spend (``'a'.center(10**9)``).

    render_chat(template, [{"role": "user", "content": "hi"}], bos_token="<bos>")

Files without a template get a built-in one by ``general.architecture``: Gemma's turn
format for the gemma family, ChatML (``<|im_start|>role ... <|im_end|>``) for everything
else, as the most common format among the architectures ggraph runs.
"""
from __future__ import annotations

import datetime
import functools
import json

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, tried to escape the sandbox, or raised."""


# Gemma: "model" for the assistant, a system message folded into the first user turn
GEMMA_TEMPLATE = (
    "{%- set ns = namespace(prefix='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.prefix = m['content'] | trim + '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n'"
    " + ns.prefix + m['content'] | trim + '<end_of_turn>\n' }}"
    "{%- set ns.prefix = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif -%}"
)

CHATML_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}"
)

_BUILTIN_BY_ARCH = {"gemma": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE,
                    "gemma3n": GEMMA_TEMPLATE}


def default_template(architecture: str | None) -> str:
    """The built-in template for a file that carries none."""
    return _BUILTIN_BY_ARCH.get(architecture, CHATML_TEMPLATE)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, except that touching an unsafe attribute raises."""

    def unsafe_undefined(self, obj, attribute):
        """Refuse at once; the stock sandbox returns an Undefined that renders as ''."""
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            "object is unsafe")


def _raise_exception(message: str):
    """Hugging Face templates call this to reject a conversation."""
    raise ChatTemplateError(f"chat template raised: {message}")


def _strftime_now(fmt: str) -> str:
    """Today's date for templates that print it (Llama 3.x)."""
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False) -> str:
    """JSON as Hugging Face renders it: no HTML escaping, non-ASCII kept."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Parse a template once; options match Hugging Face's apply_chat_template."""
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e.message} (line {e.lineno})") from e


def _check_messages(messages) -> None:
    """Messages are a list of dicts, each with a string 'role'."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be a dict with a string 'role', got {m!r}")


def render_chat(template: str, messages: list, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **extra) -> str:
    """Render ``messages`` through ``template`` in the sandbox; ``extra`` become template variables."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"template must be a str, got {type(template).__name__}")
    _check_messages(messages)
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **extra)
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateError(f"chat template refused: {e}") from e
    except Exception as e:          # a bad template is bad input: report it as such, with the cause
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
