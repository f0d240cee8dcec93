"""Conversations in the KV cache: a turn prefills only what is new and replies as a fresh prefill would;
a full context drops the oldest exchanges; generation until the end of text stops at a full context."""
import pytest

import zoo
from ggraph.runtime.conversation import Conversation
from ggraph.runtime.session import ContextFullError, Session

GREEDY = dict(temperature=0)


@pytest.fixture(scope="module")
def path():
    return zoo.cached_model("qwen2", "f32")          # qwen2's vocab carries a real ChatML template


def fresh_reply(path, messages, ctx, max_tokens):
    """The reply a new session gives the whole conversation at once: the oracle for a cached turn."""
    return Session(path, backend="numpy", ctx=ctx).chat(messages, max_tokens=max_tokens, **GREEDY)


def test_each_turn_prefills_only_what_is_new_and_replies_as_a_fresh_prefill(path):
    s = Session(path, backend="numpy", ctx=512)
    conv = Conversation(s, system="You are terse.", max_tokens=6, **GREEDY)
    questions = ["What is a GGUF file?", "And a tensor?", "Thanks!"]
    for i, q in enumerate(questions):
        before = s.cached_tokens
        reply = "".join(conv.send(q))
        assert conv.turns[-1] == {"role": "assistant", "content": reply}
        assert reply == fresh_reply(path, conv.messages[:-1], 512, 6)
        st = conv.stats
        if i:   # everything up to the last reply's final token (not run through the model) comes from the cache
            assert st["cached_tokens"] >= len(before) - 1 and st["prompt_tokens"] < 30, st
        assert st["cached_tokens"] + st["prompt_tokens"] == len(s.chat_ids(conv.messages[:-1]))
    assert len(conv.turns) == 6 and conv.messages[0]["role"] == "system"


def test_a_full_context_drops_the_oldest_exchanges_and_rebuilds_the_cache(path):
    notes = []
    s = Session(path, backend="numpy", ctx=96)
    conv = Conversation(s, system="Hi.", max_tokens=8, notes=notes.append, **GREEDY)
    dropped = 0
    for i in range(8):
        reply = "".join(conv.send(f"question number {i} about the weather"))
        dropped += conv.stats["dropped_turns"]
        assert reply == fresh_reply(path, conv.messages[:-1], 96, 8)      # the rebuilt cache is right
        assert len(s.chat_ids(conv.messages[:-1])) + 8 <= 96
    assert dropped > 0 and any("dropped the" in n and "oldest exchange" in n for n in notes), notes
    assert conv.messages[0] == {"role": "system", "content": "Hi."}
    assert conv.turns[-2]["content"] == "question number 7 about the weather"


def test_a_message_too_long_for_the_context_changes_nothing(path):
    s = Session(path, backend="numpy", ctx=64)
    conv = Conversation(s, max_tokens=4, **GREEDY)
    "".join(conv.send("hello"))
    turns, cached = list(conv.turns), s.cached_tokens
    with pytest.raises(ContextFullError, match="the message is too long: with the template it is .* tokens, and "
                                               "the context holds 64"):
        "".join(conv.send("word " * 80))
    assert conv.turns == turns and s.cached_tokens == cached


def test_an_uncapped_reply_stops_at_a_full_context_with_a_note(path):
    notes = []
    s = Session(path, backend="numpy", ctx=48)
    conv = Conversation(s, max_tokens=-1, notes=notes.append, **GREEDY)
    reply = "".join(conv.send("Tell me a long story."))
    assert s.stats["stop"] in ("context", "eog")
    if s.stats["stop"] == "context":                 # a random model rarely ends its turn
        assert s.n_past == 48 and any("the reply stopped at" in n for n in notes), notes
    assert conv.turns[-1]["content"] == reply


def test_an_interrupted_reply_stays_as_far_as_it_went(path):
    s = Session(path, backend="numpy", ctx=256)
    conv = Conversation(s, max_tokens=20, **GREEDY)
    pieces = conv.send("Count to ten.")
    first = next(pieces)
    pieces.close()                                   # what Ctrl-C or a reader that stops does
    assert conv.turns == [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": first}]


def test_a_system_message_the_template_refuses_is_not_set(tmp_path):
    from gguf_edit import edited
    from ggraph.runtime.chat_template import ChatTemplateError
    refusing = "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}" \
               "{% for m in messages %}{{ m.content }}{% endfor %}"
    model = edited(zoo.cached_model("llama", "f32"), tmp_path / "m.gguf", keys={"tokenizer.chat_template": refusing})
    conv = Conversation(Session(model, backend="numpy", ctx=64), system=None)
    with pytest.raises(ChatTemplateError, match="no system role"):
        conv.set_system("Be nice.")
    assert conv.system is None and conv.messages == []


def test_generate_until_the_end_of_text_stops_at_a_full_context(path):
    s = Session(path, backend="numpy", ctx=32)
    text = s.generate("Once upon a time", max_tokens=-1, **GREEDY)
    assert s.stats["stop"] in ("context", "eog") and text
    if s.stats["stop"] == "context":
        assert s.n_past == 32 and s.stats["prompt_tokens"] + s.stats["generated_tokens"] == 33
    with pytest.raises(ValueError, match="max_tokens must be a whole number >= -1"):
        s.generate("x", max_tokens=-2)


def test_reuse_cache_keeps_the_shared_prefix(path):
    s = Session(path, backend="numpy", ctx=128)
    ids = s.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    a = s.generate(ids, max_tokens=5, **GREEDY)
    b = s.generate(ids, max_tokens=5, reuse_cache=True, **GREEDY)
    assert a == b and s.stats["cached_tokens"] == len(ids) - 1 and s.stats["prompt_tokens"] == 1
    s.generate(ids[:3] + [ids[5]], max_tokens=2, reuse_cache=True, **GREEDY)
    assert s.stats["cached_tokens"] == 3
