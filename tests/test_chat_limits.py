"""Chat templates run within limits: hostile templates fail fast with the limit they hit named,
real templates render as before.

The real templates are the ones llama.cpp keeps in models/templates, copied under
tests/data/chat-templates (see its README.md).
"""
from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest

from ggraph.runtime import chat_template
from ggraph.runtime.chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplateError, render

MESSAGES = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}]
LIMIT_S = 0.5                   # a small time limit keeps the suite fast
STOPPED_S = 10.0                # an attack not stopped runs for minutes; a loaded machine is slow, not wrong
TIME = r"rendering took more than 0\.5 s \(the time limit\)"
OUTPUT = r"exceeds 1048576 characters \(the output limit\)"

BIG = "{% set s = 'a' * 1000000 %}"            # a string just under the output limit
DOUBLE = "{{% set ns = namespace(x={start}) %}}{{% for i in range(64) %}}{{% set ns.x = {step} %}}{{% endfor %}}"

TIME_ATTACKS = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over a string": BIG + "{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "adding up lists": "{{ ([[1]] * 300000) | sum(start=[]) | length }}",
}

SIZE_ATTACKS = {        # each refused before it builds anything big
    "string times a billion": ("{{ 'a' * 10**9 }}", r"str \* 1000000000 " + OUTPUT),
    "list times a billion": ("{{ [0] * 10**9 }}", r"list \* 1000000000 " + OUTPUT),
    "lipsum": ("{{ lipsum(n=10**7) }}", r"lipsum\(n=10000000, max=100\) " + OUTPUT),
    "center": ("{{ 'a'.center(10**9) }}", r"center\(\) " + OUTPUT),
    "center filter": ("{{ 'a' | center(10**9) }}", r"center\(\) " + OUTPUT),
    "replace": (BIG + "{{ s.replace('a', s) }}", r"replace\(\) " + OUTPUT),
    "replace filter": (BIG + "{{ s | replace('a', s) }}", r"replace\(\) " + OUTPUT),
    "indent": ("{{ ('\n' * 1000000) | indent(1000000) }}", r"indent\(\) " + OUTPUT),
    "format width": ("{{ '{:1000000000}'.format(1) }}", r"format\(\) " + OUTPUT),
    "printf width": ("{{ '%1000000000d' % 1 }}", r"str % 1 " + OUTPUT),
    "doubling with ~": (DOUBLE.format(start="'a'", step="ns.x ~ ns.x"), "a '~' string " + OUTPUT),
    "doubling a list of itself": (DOUBLE.format(start="['a']", step="[ns.x, ns.x]") + "{{ ns | string }}",
                                  "a list " + OUTPUT),
    "a block set in a loop": (BIG + "{% set x %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endset %}",
                              "a macro's or block's output " + OUTPUT),
    "output": ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output " + OUTPUT),
}

OTHER_ATTACKS = {
    "a huge power": ("{{ 9 ** 100000000 }}", r"9 \*\* 100000000 would have more than 4300 digits \(the number limit\)"),
    "squaring in a loop": (DOUBLE.format(start="10**1000", step="ns.x * ns.x"),
                           r"int \* int would have more than 4300 digits \(the number limit\)"),
    "recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"\(the recursion limit\)"),
    "deep parentheses": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", r"\(the recursion limit\)"),
    "deeply nested loops": ("{% for a in [1] %}" * 30 + "{% endfor %}" * 30,
                            "does not compile to Python: too many statically nested blocks"),
}


def failing(template: str, **limits):
    """The ChatTemplateError render raises for ``template``, and the seconds it took to."""
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError) as failure:
        render(template, MESSAGES, **limits)
    return failure, time.perf_counter() - start


@pytest.mark.parametrize("template", TIME_ATTACKS.values(), ids=TIME_ATTACKS.keys())
def test_long_renders_stop_at_the_time_limit(template):
    failure, seconds = failing(template, time_limit=LIMIT_S)
    failure.match(TIME)
    assert LIMIT_S <= seconds < STOPPED_S


@pytest.mark.parametrize(("template", "message"), SIZE_ATTACKS.values(), ids=SIZE_ATTACKS.keys())
def test_big_values_are_refused_before_they_are_built(template, message):
    tracemalloc.start()
    try:
        failure, seconds = failing(template)              # the default time limit: size must stop it first
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    failure.match(message)
    assert seconds < STOPPED_S
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB allocated"


@pytest.mark.parametrize(("template", "message"), OTHER_ATTACKS.values(), ids=OTHER_ATTACKS.keys())
def test_numbers_and_nesting_have_limits_too(template, message):
    failure, seconds = failing(template, time_limit=LIMIT_S)
    failure.match(message)
    assert seconds < STOPPED_S


def test_out_of_memory_is_a_chat_template_error(monkeypatch):
    def no_memory(fmt):
        raise MemoryError
    monkeypatch.setattr(chat_template, "_strftime_now", no_memory)
    with pytest.raises(ChatTemplateError, match=r"ran out of memory \(the memory limit\)"):
        render("{{ strftime_now('%Y') }}{# a template of its own, compiled with no_memory #}", MESSAGES)


def test_limits_are_arguments():
    ten = "{% for i in range(10) %}x{% endfor %}"
    assert render(ten, MESSAGES, max_output=10) == "x" * 10
    with pytest.raises(ChatTemplateError, match=r"^chat template: output exceeds 9 characters \(the output limit\)$"):
        render(ten, MESSAGES, max_output=9)
    with pytest.raises(ChatTemplateError, match=r"str \* 20 exceeds 10 characters"):
        render("{{ 'a' * 20 }}", MESSAGES, max_output=10)
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"^chat template: rendering took more than 0\.2 s \(the time limit\)$"):
        render(spin, MESSAGES, time_limit=0.2)


def test_limits_default_to_the_module_constants(monkeypatch):
    monkeypatch.setattr(chat_template, "OUTPUT_LIMIT", 5)
    monkeypatch.setattr(chat_template, "TIME_LIMIT_S", 0.2)
    with pytest.raises(ChatTemplateError, match=r"output exceeds 5 characters"):
        render("{{ 'abcdef' }}", MESSAGES)
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{# 2 #}"
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=r"more than 0\.2 s"):
        render(spin, MESSAGES)
    assert time.perf_counter() - start < 0.6


def test_a_compiled_template_serves_every_budget():
    """Jinja folds constants while compiling, under the first render's budget; later renders get their own."""
    template = "{{ 'ab' ~ 'cd' }}{% for x in [1, 2] %}{{ x }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"a '~' string exceeds 3 characters"):
        render(template, MESSAGES, max_output=3)
    assert render(template, MESSAGES) == "abcd12"
    assert render(template, MESSAGES) == "abcd12"          # the loop's iterable is not used up
    with pytest.raises(ChatTemplateError, match=r"^chat template: output exceeds 5 characters"):
        render(template, MESSAGES, max_output=5)


def test_ordinary_templates_render_within_small_limits():
    builtin = render(GEMMA_TEMPLATE, MESSAGES, time_limit=LIMIT_S, max_output=200)
    assert builtin == ("<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\nHi there<end_of_turn>\n"
                       "<start_of_turn>model\n")
    assert render(CHATML_TEMPLATE, MESSAGES, max_output=200).endswith("<|im_start|>assistant\n")
    features = ("{% macro m(a, b=2) %}{{ a }}-{{ b }}{% endmacro %}{{ m(1) }} {{ 'ab' * 2 }} {{ 2 ** 10 }} "
                "{{ '%5d|' % 3 }}{{ '{:>3}'.format(1) }} {{ 'a-b'.replace('-', '+') }} {{ [3, 1] | sort }} "
                "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{% endfor %} {{ {'k': 1} | tojson(indent=1) }}")
    assert render(features, MESSAGES, max_output=200) == (
        '1-2 abab 1024     3|  1 a+b [1, 3] 1/22/2 {\n "k": 1\n}')


# ---------------------------------------------------------------- real templates

REAL = Path(__file__).parent / "data" / "chat-templates"
REAL_TEMPLATES = sorted(REAL.glob("*.jinja"))
# A tool-use template: it loops over ``tools``, which is None without them (in transformers too).
NEEDS_TOOLS = {"NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"}
TOOLS = [{"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {
    "type": "object", "properties": {}}}}]


@pytest.mark.parametrize("path", REAL_TEMPLATES, ids=lambda p: p.stem)
def test_real_templates_render(path):
    tools = TOOLS if path.name in NEEDS_TOOLS else None
    text = render(path.read_text(), MESSAGES, add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
                  tools=tools)                       # the default time limit: 0.5 s is too tight for a loaded machine
    assert "Hello" in text and "Hi there" in text


def test_generation_blocks_render_their_body_within_the_limits():
    """Hugging Face's {% generation %} (LFM2.5, poolside Laguna) is its body, whose output counts like a macro's."""
    tagged = "{% for m in messages %}{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}"
    assert render(tagged, MESSAGES, max_output=20) == "[Hello][Hi there]"
    flood = "{% generation %}{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}{% endgeneration %}"
    with pytest.raises(ChatTemplateError, match="a macro's or block's output " + OUTPUT):
        render(flood, MESSAGES)                      # the default time limit: a loaded clock must not win
    spin = "{% generation %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" \
           "{% endgeneration %}"
    failure, seconds = failing(spin, time_limit=LIMIT_S)
    failure.match(TIME)
    assert seconds < STOPPED_S
    with pytest.raises(ChatTemplateError, match=r"does not compile: Unexpected end of template.*'endgeneration'"):
        render("{% generation %}x", MESSAGES)


def test_real_templates_render_exactly():
    qwen = render((REAL / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), MESSAGES)
    assert qwen == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    gemma = render((REAL / "google-gemma-2-2b-it.jinja").read_text(), MESSAGES, bos_token="<bos>")
    assert gemma == ("<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\nHi there<end_of_turn>\n"
                     "<start_of_turn>model\n")
