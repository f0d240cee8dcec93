"""Chat templates: render a GGUF file's Jinja template in a sandbox, or a small built-in one.

``render`` gives what Hugging Face transformers gives (``render_jinja_template``, 5.22.2 on), byte for byte:
the same Jinja options (trim_blocks, lstrip_blocks, loop controls), the same ``{% generation %}`` tag,
globals (``raise_exception``, ``strftime_now``, a ``dict`` without the type behind it, a ``namespace`` that
refuses underscore-prefixed names), the same ``tojson`` (no HTML escaping, non-ASCII kept, its options in
transformers' order), and the same variables: ``messages``, ``tools`` and ``documents`` (None when not given),
``add_generation_prompt`` and every keyword argument, all rebuilt from plain JSON types first, and a
message's reasoning copied under each name templates read it by.

A template read from a GGUF file is untrusted input, so it runs in Jinja's immutable
sandbox, made stricter here: reaching for an unsafe attribute (``__class__``,
``__globals__``, ``list.append`` ...) raises at once instead of quietly rendering as
empty. Every failure, including ``raise_exception`` called by the template itself, is a
ChatTemplateError.

The sandbox keeps templates away from Python; limits bound what a hostile template may
spend, and a render that hits one fails with a ChatTemplateError naming it:

- time (``time_limit=``, TIME_LIMIT_S): the clock is checked at every loop iteration, call,
  filter and intercepted operator, and between output pieces;
- size (``max_output=``, OUTPUT_LIMIT characters): the output is counted as it is made, and
  so is every string, list or dict the template makes (literals, ``~``, ``+``, ``*``, ``%``,
  calls, filters, macro and block output), refused before it is built where its size can
  be worked out first (``'a' * 10**9``, ``'a'.center(10**9)``, ``s.replace(a, b)``);
- numbers (NUMBER_LIMIT digits): ``9 ** 10**8`` is refused before it runs;
- nesting (Python's recursion limit) and memory (MemoryError) are reported as such.

    render(template, [{"role": "user", "content": "hi"}], bos_token="<bos>", enable_thinking=False)

Files without a template get a built-in one by ``general.architecture``: Gemma's turn
format for the gemma family, ChatML (``<|im_start|>role ... <|im_end|>``) for everything
else, as the most common format among the architectures ggraph runs.
"""
from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import json
import math
import re
import string
import sys
import time
from collections.abc import Mapping

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.filters import do_round, sync_do_sum
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, tried to escape the sandbox, raised, or hit a limit."""


TIME_LIMIT_S = 5.0          # seconds a render may take
OUTPUT_LIMIT = 1 << 20      # characters in the output, and in any one string or list the template makes
NUMBER_LIMIT = 4300         # decimal digits of an integer: Python itself refuses to print a longer one


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


# ---------------------------------------------------------------- limits

class _Budget:
    """What one render may spend; the sandbox's hooks check it."""

    __slots__ = ("deadline", "max_output", "time_limit")

    def __init__(self, time_limit: float, max_output: int):
        self.time_limit, self.max_output = time_limit, max_output
        self.deadline = time.monotonic() + time_limit

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template: rendering took more than {self.time_limit} s (the time limit)")

    def fits(self, size: int, what: str) -> None:
        if size > self.max_output:
            raise ChatTemplateError(f"chat template: {what} exceeds {self.max_output} characters (the output limit)")

    def fits_number(self, digits: float, what: str) -> None:
        if digits > NUMBER_LIMIT:
            raise ChatTemplateError(f"chat template: {what} would have more than {NUMBER_LIMIT} digits "
                                    "(the number limit)")


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")   # set by render


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _size(value, seen: dict | None = None) -> int:
    """Characters plus items in ``value``, through nested lists and dicts, an int by its digits. A list
    held twice counts twice, as printing it would, but is walked once. A range is lazy: it counts one."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, int):
        return 1 + value.bit_length() * 3 // 10
    if isinstance(value, dict):
        items = (*value.keys(), *value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        return 1
    seen = {} if seen is None else seen
    if id(value) not in seen:
        seen[id(value)] = len(value) + sum(_size(item, seen) for item in items)
    return seen[id(value)]


def _log10(n: int) -> float:
    return math.log10(abs(n)) if n else 0.0


def _show(value) -> str:
    """An operand as an error message shows it: a small number as itself, anything else by its type."""
    if isinstance(value, (int, float)) and abs(value) < 1e15:
        return repr(value)
    return type(value).__name__


def _name(obj) -> str:
    """What a callable is called, for an error message."""
    if isinstance(obj, Macro):
        return obj.name
    name = getattr(obj, "__name__", None)
    return name if isinstance(name, str) else type(obj).__name__


# -- the size of a result, worked out before it is built, for what can make far more than it is given

_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_NUMBER = re.compile(r"\d+")


def _printf_size(fmt, values) -> int:
    """At most len(fmt % values): the text, the values, and every width and precision asked for."""
    values = values if isinstance(values, tuple) else (values,)
    star = max(filter(_is_int, values), default=0)             # a '*' width takes the next value
    asked = sum(star if n == "*" else int(n) for m in _PRINTF_FIELD.finditer(fmt) for n in m.groups() if n)
    return len(fmt) + _size(values) + asked


def _format_size(fmt, *args, **kwargs) -> int:
    """At most len(fmt.format(*args, **kwargs)), or of format_map, counted the same way."""
    specs = [spec for _, field, spec, _ in string.Formatter().parse(fmt) if field is not None and spec]
    values = [*args, *kwargs.values(), *(v for a in args if isinstance(a, dict) for v in a.values())]
    star = max(filter(_is_int, values), default=0)             # '{:{w}}' takes its width from a value
    asked = sum(int(n) for spec in specs for n in _NUMBER.findall(spec)) + star * sum("{" in s for s in specs)
    return len(fmt) + _size(args) + _size(kwargs) + asked


def _replace_size(s, old, new, count=-1) -> int:
    """len(s.replace(old, new, count))"""
    found = s.count(old) if count is None or count < 0 else min(count, s.count(old))
    return len(s) + found * (len(new) - len(old))


def _padded_size(s, width, *fill) -> int:
    """len(s.center(width)), and of ljust, rjust, zfill"""
    return max(len(s), width)


def _expandtabs_size(s, tabsize=8) -> int:
    """At most len(s.expandtabs(tabsize))"""
    return len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(tabsize, 0)


def _translate_size(s, table) -> int:
    """At most len(s.translate(table)): each character may become the longest string in the table."""
    if isinstance(s, bytes):
        return len(s)                                           # a byte for a byte, or none
    values = table.values() if isinstance(table, dict) else table
    return len(s) * max((len(v) for v in values if isinstance(v, str)), default=1)


def _indent_size(s, width=4, first=False, blank=False) -> int:
    """At most len(s|indent(width)): the text and an indent per line."""
    text = str(s)
    return len(text) + (text.count("\n") + 1) * (width if _is_int(width) else len(str(width)))


def _filled_size(value, count, fill_with=None) -> int:
    """The lists batch(count, fill) or slice(count, fill) make: ``count`` of them, some padded with ``fill``."""
    return _size(value) + count * (1 + (0 if fill_with is None else _size(fill_with)))


_METHOD_SIZE = {        # methods of str, bytes and int, called on their value
    "replace": _replace_size,
    "center": _padded_size, "ljust": _padded_size, "rjust": _padded_size, "zfill": _padded_size,
    "expandtabs": _expandtabs_size,
    "translate": _translate_size,
    "format": _format_size, "format_map": _format_size,     # Jinja < 3.1.5 calls these through call()
    "to_bytes": lambda n, length=1, *args, **kwargs: length,
}

_FILTER_SIZE = {        # Jinja's filters, with their signatures (replace takes the eval context first)
    "replace": lambda _ctx, s, old, new, count=None: _replace_size(str(s), str(old), str(new), count),
    "center": lambda value, width=80: _padded_size(str(value), width),
    "indent": _indent_size,
    "format": lambda value, *args, **kwargs: _printf_size(str(value), kwargs or args),
    "batch": _filled_size,
    "slice": _filled_size,
}


def _checked(name: str, fn, args: tuple, kwargs: dict, predict=None):
    """Run a template's call or filter within the budget: the clock, the size ``predict`` says it will
    make, then the size it made."""
    budget = _BUDGET.get()
    budget.tick()
    if predict is not None:
        budget.fits(predict(*args, **kwargs), f"{name}()")
    result = fn(*args, **kwargs)
    budget.fits(_size(result), f"the result of {name}()")
    return result


def _bounded_filter(name: str, fn):
    """``fn`` run through _checked (functools.wraps keeps Jinja's pass_context-style markers)."""
    predict = _FILTER_SIZE.get(name)

    @functools.wraps(fn)
    def bounded(*args, **kwargs):
        return _checked(name, fn, args, kwargs, predict)
    return bounded


def _in_time(iterable):
    """Iterate ``iterable``, checking the clock before each item."""
    budget = _BUDGET.get()
    for item in iterable:
        budget.tick()
        yield item


def _sized(value, what: str):
    """``value``, once it is known to fit the output limit."""
    budget = _BUDGET.get()
    budget.tick()
    budget.fits(_size(value), what)
    return value


@jinja2.pass_environment
def _sum(environment, iterable, attribute=None, start=0):
    """Jinja's sum, checking the clock at each item: adding up lists one by one is quadratic."""
    return sync_do_sum(environment, _in_time(iterable), attribute, start)


def _round(value, precision=0, method="common"):
    """Jinja's round, refused when ``10 ** precision`` would pass the number limit."""
    _BUDGET.get().fits_number(abs(precision), f"round(precision={_show(precision)})")
    return do_round(value, precision, method)


def _lipsum(n=5, html=True, min=20, max=100):
    """Jinja's lorem ipsum, refused before it starts if it would pass the output limit."""
    _BUDGET.get().fits(n * (max * 16 + 16), f"lipsum(n={_show(n)}, max={_show(max)})")  # words are short
    return generate_lorem_ipsum(n, html, min, max)


class _Bounds(NodeTransformer):
    """Rewrite a parsed template so that loops check the clock and made values check their size."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_in_time", [], [], None, None, lineno=node.lineno)
        return node

    def _sized(self, node, what: str):
        self.generic_visit(node)
        return nodes.Filter(node, "_sized", [nodes.Const(what)], [], None, None, lineno=node.lineno)

    def visit_Concat(self, node):
        return self._sized(node, "a '~' string")

    def visit_List(self, node):
        return self._sized(node, "a list")

    def visit_Dict(self, node):
        return self._sized(node, "a dict")

    def visit_Tuple(self, node):
        return self._sized(node, "a tuple") if node.ctx == "load" else node


# ---------------------------------------------------------------- the sandbox

class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, except that touching an unsafe attribute raises, and every operator,
    call and join that can run long or build something big is checked against the render's budget."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def unsafe_undefined(self, obj, attribute):
        """Refuse at once; the stock sandbox returns an Undefined that renders as ''."""
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            "object is unsafe.")

    def call_binop(self, context, operator, left, right):
        """Refuse ``left <operator> right`` before it runs if its result would pass a limit."""
        budget = _BUDGET.get()
        budget.tick()
        what = f"{_show(left)} {operator} {_show(right)}"
        sequences = (str, bytes, list, tuple)
        if _is_int(left) and _is_int(right):
            if operator == "*":
                budget.fits_number(_log10(left) + _log10(right), what)
            elif operator == "**":
                budget.fits_number(right * _log10(left), what)
        elif operator == "*" and _is_int(right) and isinstance(left, sequences):
            budget.fits(_size(left) * right, what)
        elif operator == "*" and _is_int(left) and isinstance(right, sequences):
            budget.fits(left * _size(right), what)
        elif operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
            budget.fits(_size(left) + _size(right), what)
        elif operator == "%" and isinstance(left, (str, bytes)):
            budget.fits(_printf_size(left, right), what)
        return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs):
        """Every call the template makes runs through _checked; str.replace and its kin are sized first."""
        scopes = {k: kwargs.pop(k) for k in ("_loop_vars", "_block_vars") if k in kwargs}   # Jinja's own
        name = _name(obj)
        owner = getattr(obj, "__self__", None)
        predict = None
        if isinstance(owner, (str, bytes, int)) and name in _METHOD_SIZE:
            predict = functools.partial(_METHOD_SIZE[name], owner)
        return _checked(name, functools.partial(super().call, context, obj, **scopes), args, kwargs, predict)

    def wrap_str_format(self, value):
        """Jinja's sandboxed str.format and format_map (3.1.5 on), refused first if too big."""
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt = value.__self__

        @functools.wraps(wrapper)
        def sized(*args, **kwargs):
            _BUDGET.get().fits(_format_size(fmt, *args, **kwargs), f"{value.__name__}()")
            return wrapper(*args, **kwargs)
        return sized

    def concat(self, parts) -> str:
        """Join a macro's or a block's output, once the pieces are known to fit the output limit."""
        parts = list(parts)
        _BUDGET.get().fits(sum(map(len, parts)), "a macro's or block's output")
        return "".join(parts)


# ---------------------------------------------------------------- what Hugging Face adds to Jinja

def _raise_exception(message: str):
    """Hugging Face templates call this to reject a conversation."""
    raise ChatTemplateError(f"chat template raised: {message}")


def _strftime_now(fmt: str) -> str:
    """Today's date for templates that print it (Llama 3.x)."""
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON as Hugging Face renders it (no HTML escaping, non-ASCII kept; its options in its order), counted as
    it is made."""
    budget = _BUDGET.get()
    if indent is not None:      # one line's indent is at most twice the output counted before it
        budget.fits(indent if _is_int(indent) else len(str(indent)), "tojson()'s indent")
    encoder = json.JSONEncoder(indent=indent, separators=separators, sort_keys=sort_keys,
                               ensure_ascii=ensure_ascii)
    pieces, total = [], 0
    for piece in encoder.iterencode(value):
        total += len(piece)
        budget.fits(total, "the result of tojson()")
        pieces.append(piece)
    return "".join(pieces)


class _Dict:
    """The template's ``dict``: it makes dicts and has ``fromkeys``, but is not the type, whose unbound
    ``dict.update(m, ...)`` would write to a message (Hugging Face's TemplateDict)."""

    __slots__ = ()
    __name__ = "dict"           # what error messages call it

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a namespace may not hold the underscore-prefixed name {name!r}")


class _Namespace(Namespace):
    """The template's ``namespace``: Jinja's, refusing underscore-prefixed names, which could reach Python's
    internals (Hugging Face's TemplateNamespace)."""

    def __init__(*args, **kwargs):      # no named self, as Jinja's, so that namespace(self=1) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks what the assistant says, for Hugging Face's training
    masks. It renders as its body, which runs as a call block's macro, as transformers runs it (a ``set``
    inside does not leak out)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("generation"), [], [], body).set_lineno(lineno)

    def generation(self, caller: Macro) -> str:
        return caller()


@functools.lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    """Parse a template once, its loops and made values bounded by _Bounds; options, tags, filters and globals
    match Hugging Face's. Call it with a budget set: Jinja folds constants as it compiles."""
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters.update(tojson=_tojson, sum=_sum, round=_round)
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.filters.update(_in_time=_in_time, _sized=_sized)        # for _Bounds; they check themselves
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, lipsum=_lipsum,
                       dict=_Dict(), namespace=_Namespace)
    try:
        return env.from_string(_Bounds().visit(env.parse(template)))
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e.message} (line {e.lineno})") from e
    except SyntaxError as e:        # Python's, compiling the code Jinja made: "too many statically nested blocks"
        raise ChatTemplateError(f"chat template does not compile to Python: {e.msg}") from e


# ---------------------------------------------------------------- what the template sees

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")      # the first is the standard name


def _plain(value):
    """``value`` rebuilt from JSON types, as transformers rebuilds all a template sees: subclasses of str, int
    and float (enums, numpy scalars) become the base type, mappings dicts, dataclasses and pydantic models their
    fields, and anything else a placeholder naming its type (``"<ndarray>"``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.generic):
        return _plain(value.item())         # np.bool_(False) must stay falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(messages) -> list:
    """The messages a template sees: plain dicts, a message's reasoning (under any of _REASONING_FIELDS) also as
    'thinking' (first, for gpt-oss) and 'reasoning_content' (last)."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    aliased = []
    for i, m in enumerate(_plain(messages)):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}] must be a dict, got {messages[i]!r}")
        reasoning = next((m[key] for key in _REASONING_FIELDS if m.get(key) is not None), None)
        aliased.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return aliased


def _dicts(values, what: str, kind=None):
    """``values`` (tools or documents) checked to be a list (or tuple) of dicts, made plain, as ``kind`` if
    given (transformers gives tools as a list, documents as they came); None stays None."""
    if values is None:
        return None
    if not isinstance(values, (list, tuple)):
        raise ChatTemplateError(f"{what} must be a list of dicts, got {type(values).__name__}")
    for i, v in enumerate(values):
        if not isinstance(v, dict):
            raise ChatTemplateError(f"{what}[{i}] must be a dict, got {v!r}")
    return _plain(values if kind is None else kind(values))


# ---------------------------------------------------------------- rendering

def render(template: str, messages: list[dict], *, add_generation_prompt: bool = True, tools: list | None = None,
           bos_token: str = "", eos_token: str = "", time_limit: float | None = None,
           max_output: int | None = None, **kwargs) -> str:
    """Render ``messages`` through ``template`` in the sandbox, as Hugging Face's ``render_jinja_template``
    does: ``tools`` are JSON-schema function dicts, ``documents=`` a list of dicts, and every other keyword
    (``enable_thinking``, ``reasoning_effort`` ...) a template variable.

    ``time_limit`` (seconds) and ``max_output`` (characters) default to TIME_LIMIT_S and OUTPUT_LIMIT."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"template must be a str, got {type(template).__name__}")
    budget = _Budget(TIME_LIMIT_S if time_limit is None else time_limit,
                     OUTPUT_LIMIT if max_output is None else max_output)
    token = _BUDGET.set(budget)
    try:
        variables = dict(messages=_messages(messages), tools=_dicts(tools, "tools", list),
                         documents=_dicts(kwargs.pop("documents", None), "documents"),
                         add_generation_prompt=add_generation_prompt,
                         **_plain(dict(bos_token=bos_token, eos_token=eos_token, **kwargs)))
        pieces, total = [], 0
        for piece in _compile(template).generate(**variables):
            total += len(piece)
            budget.fits(total, "output")
            budget.tick()
            pieces.append(piece)
        return "".join(pieces)
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateError(f"chat template refused: {e}") from e
    except RecursionError as e:
        raise ChatTemplateError(f"chat template: nesting goes deeper than {sys.getrecursionlimit()} Python "
                                "frames (the recursion limit)") from e
    except MemoryError as e:
        raise ChatTemplateError("chat template: ran out of memory (the memory limit)") from e
    except Exception as e:          # a bad template is bad input: report it as such, with the cause
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    finally:
        _BUDGET.reset(token)

