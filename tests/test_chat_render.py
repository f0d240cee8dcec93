"""render() gives what Hugging Face transformers gives, byte for byte, for every real template and every
conversation it takes; where transformers raises, render() raises a ChatTemplateError with its message.

The real templates are the ones llama.cpp keeps in models/templates, copied under
tests/data/chat-templates (see its README.md). Both sides read the same frozen clock.
"""
from __future__ import annotations

import dataclasses
import datetime
import enum
import types
from pathlib import Path

import numpy as np
import pytest

from ggraph.runtime import chat_template
from ggraph.runtime.chat_template import ChatTemplateError, render

pytest.importorskip("transformers", reason="transformers is the reference renderer")
from transformers.utils import chat_template_utils  # noqa: E402

REAL = Path(__file__).parent / "data" / "chat-templates"
TEMPLATES = {path.stem: path.read_text() for path in sorted(REAL.glob("*.jinja"))}
BOS, EOS = "<s>", "</s>"
NOW = datetime.datetime(2026, 7, 14, 9, 30, 5)

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "description": "The weather in a city, in °C or °F <now> & \"later\".",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "Where, e.g. Zürich"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                  "days": {"type": "integer", "description": "How many days ahead"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search",
    "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                    "sites": {"type": "array", "items": {"type": "string"}}},
                   "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
USER = {"role": "user", "content": "What's the weather in Zürich?"}
ANSWER = {"role": "assistant", "content": "Sunny, 24 °C."}
FOLLOW_UP = {"role": "user", "content": "And <tomorrow> & after?"}
ARGS = {"city": "Zürich", "unit": "celsius", "days": 2}


def tool_turns(arguments) -> list:
    """An assistant's tool call, the tool's result, and the assistant's answer."""
    call = {"id": "call12345", "type": "function",         # Mistral's templates want 9 letters or digits
            "function": {"name": "get_weather", "arguments": arguments}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call12345", "name": "get_weather",
             "content": '{"temperature": 24, "sky": "sunny"}'},
            ANSWER]


CONVERSATIONS = {       # name: (messages, add_generation_prompt, keyword arguments)
    "system-user": ([SYSTEM, USER], True, {}),
    "multi-turn": ([USER, ANSWER, FOLLOW_UP], True, {}),
    "ends-on-assistant": ([SYSTEM, USER, ANSWER], False, {}),
    "tools": ([SYSTEM, USER], True, {"tools": TOOLS}),
    "tool-call": ([USER, *tool_turns(ARGS), FOLLOW_UP], True, {"tools": TOOLS}),
    "tool-call-json-arguments": ([USER, *tool_turns('{"city": "Zürich", "days": 2}')], False, {"tools": TOOLS}),
    "reasoning-content": ([USER, {**ANSWER, "reasoning_content": "They asked about Zürich."}, FOLLOW_UP], True,
                          {"enable_thinking": True}),
    "reasoning-field": ([USER, {**ANSWER, "reasoning": "Look it up."}], False, {"enable_thinking": True}),
    "thinking-off": ([SYSTEM, USER], True, {"enable_thinking": False}),
    "reasoning-effort": ([SYSTEM, USER], True, {"reasoning_effort": "high"}),
    "documents": ([USER], True, {"tools": TOOLS,
                                 "documents": [{"title": "Forecast", "text": "Zürich: sunny, 24 °C."}]}),
}

CASES = [(t, c) for t in TEMPLATES for c in CONVERSATIONS]      # template-major: each compiles once


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    """strftime_now reads NOW on both sides."""
    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return NOW
    monkeypatch.setattr(chat_template, "datetime", types.SimpleNamespace(datetime=Frozen))
    monkeypatch.setattr(chat_template_utils, "datetime", Frozen)


def hugging_face(template: str, conversation: str):
    """What transformers renders, or the exception it raises."""
    messages, add_generation_prompt, kwargs = CONVERSATIONS[conversation]
    try:
        rendered, _ = chat_template_utils.render_jinja_template(
            [messages], chat_template=template, add_generation_prompt=add_generation_prompt,
            bos_token=BOS, eos_token=EOS, **kwargs)
    except Exception as e:      # noqa: BLE001 -- whatever it raises, render() must raise too
        return e
    return rendered[0]


@pytest.mark.parametrize(("template", "conversation"), CASES, ids=[f"{t}-{c}" for t, c in CASES])
def test_render_matches_transformers(template, conversation):
    text = TEMPLATES[template]
    messages, add_generation_prompt, kwargs = CONVERSATIONS[conversation]
    expected = hugging_face(text, conversation)
    if isinstance(expected, Exception):
        with pytest.raises(ChatTemplateError) as failure:
            render(text, messages, add_generation_prompt=add_generation_prompt, bos_token=BOS, eos_token=EOS,
                   **kwargs)
        assert str(expected) in str(failure.value)
        return
    assert render(text, messages, add_generation_prompt=add_generation_prompt, bos_token=BOS, eos_token=EOS,
                  **kwargs) == expected


# ---------------------------------------------------------------- what transformers adds to Jinja, one at a time

class Colour(str, enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Part:
    type: str
    text: str


PLAIN = [{"role": "user", "content": Colour.RED, "parts": (Part("text", "hi"), np.float32(0.5), np.bool_(False)),
          "image": object()}]

FEATURES = {            # name: (template, messages, keyword arguments)
    "tojson": ("{{ tools | tojson }}|{{ tools[0] | tojson(indent=2, sort_keys=true) }}|"
               "{{ tools[1] | tojson(separators=(',', ':')) }}|{{ messages | tojson(true) }}|{{ '<&>' | tojson }}",
               [USER], {"tools": TOOLS}),
    "tojson's options in transformers' order": ("{{ messages | tojson(false, 1) }}", [USER], {}),
    "variables": ("{{ tools is none }} {{ documents is none }} {{ bos_token }}{{ eos_token }} {{ foo is defined }} "
                  "{{ add_generation_prompt }} {{ enable_thinking }}", [USER], {"enable_thinking": False}),
    "dict": ("{{ dict(a=1, b=[2]) | tojson }} {{ dict.fromkeys(['x', 'y'], 0) }} {{ dict(messages[0]).role }}",
             [USER], {}),
    "dict is not the type": ("{{ dict.update(messages[0], {'role': 'system'}) }}", [USER], {}),
    "namespace": ("{% set ns = namespace(a=1, b='x') %}{% set ns.a = ns.a + 1 %}{{ ns.a }}{{ ns.b }}", [USER], {}),
    "namespace refuses _names": ("{% set ns = namespace(_x=1) %}", [USER], {}),
    "namespace refuses _names set": ("{% set ns = namespace() %}{% set ns._x = 1 %}", [USER], {}),
    "generation": ("{% set x = 1 %}{% for m in messages %}<{% generation %}{% set x = 2 %}{{ m.content }}{{ x }}"
                   "{% endgeneration %}>{% endfor %}{{ x }}", [USER, ANSWER], {}),
    "generation trims": ("a  {%- generation -%}  b  {%- endgeneration -%}  c\n  {% generation %}\nd\n"
                         "  {% endgeneration %}\ne", [USER], {}),
    "loop controls": ("{% for i in range(6) %}{% if i == 4 %}{% break %}{% elif i == 1 %}{% continue %}{% endif %}"
                      "{{ i }}{% endfor %}", [USER], {}),
    "trim_blocks and lstrip_blocks": ("  {% if true %}\nx\n  {% endif %}\n  {{ 'y' }}\n", [USER], {}),
    "strftime_now": ("{{ strftime_now('%Y-%m-%d %H:%M:%S %d %b %Y') }}", [USER], {}),
    "raise_exception": ("{{ raise_exception('roles must alternate') }}", [USER], {}),
    "reasoning aliases": ("{{ messages | tojson }}", [USER, {**ANSWER, "reasoning": "r"}, {**ANSWER, "thinking": "t"},
                                                        {**ANSWER, "reasoning_content": "c", "thinking": None}], {}),
    "plain data": ("{{ messages | tojson }} {{ messages[0].content.upper() }} {{ kind }}", PLAIN, {"kind": Colour.RED}),
    "documents": ("{{ documents | tojson }}", [USER], {"documents": ({"title": "t", "text": "x"},)}),
    "tools as a tuple are a list": ("{{ (tools + [1]) | length }}", [USER], {"tools": (WEATHER,)}),
}


def transformers_renders(template: str, messages: list, kwargs: dict):
    try:
        rendered, _ = chat_template_utils.render_jinja_template(
            [messages], chat_template=template, add_generation_prompt=True, bos_token=BOS, eos_token=EOS, **kwargs)
    except Exception as e:      # noqa: BLE001
        return e
    return rendered[0]


@pytest.mark.parametrize(("template", "messages", "kwargs"), FEATURES.values(), ids=FEATURES.keys())
def test_each_feature_matches_transformers(template, messages, kwargs):
    expected = transformers_renders(template, messages, kwargs)
    if isinstance(expected, Exception):
        with pytest.raises(ChatTemplateError):
            render(template, messages, bos_token=BOS, eos_token=EOS, **kwargs)
        return
    assert render(template, messages, bos_token=BOS, eos_token=EOS, **kwargs) == expected


def test_features_render_as_expected():
    """The spec, spelled out for the cases above that render."""
    def ours(name):
        template, messages, kwargs = FEATURES[name]
        return render(template, messages, bos_token=BOS, eos_token=EOS, **kwargs)
    assert ours("generation") == "<What's the weather in Zürich?2><Sunny, 24 °C.2>1"
    assert ours("generation trims") == "abc\nd\ne"
    assert ours("loop controls") == "023"
    assert ours("strftime_now") == "2026-07-14 09:30:05 14 Jul 2026"
    assert ours("variables") == "True True <s></s> False True False"
    assert ours("tojson's options in transformers' order") == (        # ensure_ascii=False, indent=1
        '[\n {\n  "role": "user",\n  "content": "What\'s the weather in Zürich?"\n }\n]')
    assert ours("plain data") == ('[{"role": "user", "content": "red", "parts": [{"type": "text", "text": "hi"}, 0.5, '
                                  'false], "image": "<object>"}] RED red')
    assert ours("reasoning aliases").count('"reasoning_content"') == 3
    assert "Jul 2026" in render(TEMPLATES["meta-llama-Llama-3.2-3B-Instruct"], [USER])


@pytest.mark.parametrize(("template", "message"), [
    ("{{ dict.update(messages[0], {'role': 'system'}) }}", "UndefinedError"),
    ("{% set ns = namespace(_x=1) %}", r"refused: a namespace may not hold the underscore-prefixed name '_x'"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "refused: a namespace may not hold"),
    ("{{ raise_exception('roles must alternate') }}", "^chat template raised: roles must alternate$"),
])
def test_refusals_name_the_cause(template, message):
    with pytest.raises(ChatTemplateError, match=message):
        render(template, [USER])


def test_unsafe_attributes_raise_where_transformers_renders_nothing():
    """The one deliberate difference: Jinja's sandbox renders an unsafe attribute as an empty Undefined (and
    raises only when it is called); ggraph's refuses it at once."""
    template = "[{{ ''.__class__ }}]{{ messages.append is defined }}"
    assert transformers_renders(template, [USER], {}) == "[]False"
    with pytest.raises(ChatTemplateError, match=r"refused: access to attribute '__class__' of 'str' object is unsafe"):
        render(template, [USER])


def test_tools_and_documents_must_be_lists_of_dicts():
    with pytest.raises(ChatTemplateError, match=r"^tools\[1\] must be a dict, got 'search'$"):
        render("", [USER], tools=[WEATHER, "search"])
    with pytest.raises(ChatTemplateError, match=r"^documents must be a list of dicts, got str$"):
        render("", [USER], documents="doc")
    with pytest.raises(ChatTemplateError, match=r"^messages\[0\] must be a dict, got 'hi'$"):
        render("", ["hi"])
