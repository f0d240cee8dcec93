"""Random text, tokenized by ggraph and by llama.cpp (llama-cpp-python 0.3.36), must give the same ids,
and the ids must detokenize to the same bytes.

Each string mixes pieces of several scripts (Latin, CJK, Cyrillic, Arabic, Devanagari), emoji with
skin tones and ZWJ joins, runs of digits and of whitespace, punctuation, contractions, the
vocabulary's own special-token texts and random code points from all of Unicode (unassigned,
private use, combining marks; surrogates become U+FFFD). The RNG is seeded per vocabulary, so a
failure names a string that reproduces.
"""
from __future__ import annotations

import ctypes
import random

import pytest

from test_tokenizer import small_vocab, vocab_path

from ggraph.runtime.pretokenizer import PRE_TOKENIZERS, split_words
from ggraph.runtime.tokenizer import CONTROL, UNKNOWN, USER_DEFINED, Tokenizer

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the oracle")
pytestmark = pytest.mark.slow

VOCABS = ("llama-spm", "qwen2", "gpt-2", "deepseek-llm", "falcon", "mpt", "refact", "qwen35", "gemma-4")
N_STRINGS = 2000


def _chars(*ranges) -> str:
    return "".join(chr(c) for lo, hi in ranges for c in range(lo, hi + 1))


SCRIPTS = {
    "latin": _chars((0x61, 0x7A), (0x41, 0x5A)) + "éèàüößñçÉÀøåœƒ",
    "cjk": _chars((0x4E00, 0x4E80), (0x3041, 0x3096), (0x30A1, 0x30FA), (0xAC00, 0xAC40)) + "々〇",
    "cyrillic": _chars((0x0410, 0x044F)) + "ёЁіїєґ",
    "arabic": _chars((0x0621, 0x064A), (0x064B, 0x0652)),          # letters and their vowel marks
    "devanagari": _chars((0x0905, 0x0939), (0x093E, 0x094D)),      # letters and their signs
    "greek": _chars((0x0391, 0x03A9), (0x03B1, 0x03C9)) + "\u0390\u1f7d",
    "unicode 15": _chars((0x11F04, 0x11F10), (0x31350, 0x31360), (0x1E4D0, 0x1E4EB)),   # Kawi, CJK-H, ...
}
DIGITS = "0123456789" * 4 + "٠١٢٣٤٥" + "０１２" + "²³¹½" + "Ⅷ" + "\U0001d2c0\U0001d2c1\U0001e4f0"
SPACES = "     \t\t\n\n\r\v\f" + "\u00a0\u3000\u2009\u0085\u2028\u200b"
PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~" + "…—–«»“”‘’¿¡。，、！？・·•§¶†"
EMOJI = ["😀", "🎉", "🔥", "👍🏽", "👋🏿", "🇫🇷", "🇯🇵", "👨‍👩‍👧‍👦", "🧑‍💻", "❤️", "☕", "1️⃣", "🫨", "🏳️‍🌈"]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'Re", "'x", "n't"]


def random_code_point(rng: random.Random) -> str:
    """Any code point at all, weighted to the planes in use; a surrogate becomes U+FFFD."""
    cp = rng.choice((rng.randrange(0x80, 0x800), rng.randrange(0x800, 0x10000), rng.randrange(0x10000, 0x30000),
                     rng.randrange(0, 0x110000), rng.randrange(0, 0x20)))
    return "\ufffd" if 0xD800 <= cp <= 0xDFFF else chr(cp)


def random_piece(rng: random.Random, specials: list) -> str:
    kind = rng.random()
    if kind < 0.35:
        alphabet = SCRIPTS[rng.choice(list(SCRIPTS))]
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
        return word + (rng.choice(CONTRACTIONS) if rng.random() < 0.1 else "")
    if kind < 0.45:
        digits = DIGITS[:10] if rng.random() < 0.7 else DIGITS
        return "".join(rng.choice(digits) for _ in range(rng.randint(1, 12)))
    if kind < 0.6:
        return "".join(rng.choice(SPACES) for _ in range(rng.randint(1, 6)))
    if kind < 0.72:
        return "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 4)))
    if kind < 0.8:
        return rng.choice(EMOJI)
    if kind < 0.86 and specials:
        return rng.choice(specials)
    if kind < 0.9:
        return rng.choice(CONTRACTIONS)
    if kind < 0.92:                                 # long runs: jais-2's \s{512}, digit grouping, merges
        return rng.choice((" ", "\n", " \t", "7", "a", "ab")) * rng.randint(10, 600)
    return "".join(random_code_point(rng) for _ in range(rng.randint(1, 3)))


def random_text(rng: random.Random, specials: list) -> str:
    pieces = [random_piece(rng, specials) for _ in range(rng.randint(1, 12))]
    return "".join(p + (" " if rng.random() < 0.4 else "") for p in pieces)


def special_texts(tok: Tokenizer) -> list:
    """Texts of the vocabulary's control, user-defined and unknown tokens (at most 40, seeded choice)."""
    texts = [tok.token_text(i) for i in range(tok.n_vocab) if tok.token_attr(i) & (CONTROL | USER_DEFINED | UNKNOWN)]
    return random.Random(0).sample(texts, min(40, len(texts)))


# ---------------------------------------------------------------- llama.cpp
# llama_tokenize and llama_detokenize are what Llama.tokenize and llama.cpp's detokenizer run; called
# directly, with a buffer that always fits, each string is tokenized once.

def llama_ids(vocab, text: bytes, add_special: bool, parse_special: bool) -> list:
    buf = (llama_cpp.llama_token * (3 * len(text) + 8))()     # a space can become 3 byte tokens
    n = llama_cpp.llama_tokenize(vocab, text, len(text), buf, len(buf), add_special, parse_special)
    assert n >= 0, text
    return list(buf[:n])


def llama_text(vocab, ids: list, remove_special: bool, unparse_special: bool) -> bytes:
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    buf = ctypes.create_string_buffer(16 * len(ids) + 64)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), remove_special, unparse_special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), remove_special, unparse_special)
    return buf.raw[:n]


def compare(path, texts: list) -> dict:
    """Encode and detokenize every text both ways; fail on the first difference, else count round trips."""
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        tok = Tokenizer.from_gguf(path)
        for what, ours, theirs in (("bos", tok.bos_id, llama_cpp.llama_vocab_bos(vocab)),
                                   ("eos", tok.eos_id, llama_cpp.llama_vocab_eos(vocab)),
                                   ("add_bos", tok.add_bos, llama_cpp.llama_vocab_get_add_bos(vocab))):
            assert ours == (None if theirs == -1 else theirs), (path.name, what, ours, theirs)
        counts = {"strings": 0, "round trips": 0}
        for i, text in enumerate(texts):
            add_special, parse_special = i % 2 == 0, i % 5 != 4
            want = llama_ids(vocab, text.encode(), add_special, parse_special)
            got = tok.encode(text, add_special, parse_special)
            assert got == want, (f"string {i} of {path.name}: {text!r} (add_special={add_special}, "
                                 f"parse_special={parse_special})\n  ggraph:    {got}\n  llama.cpp: {want}")
            for remove_special in (False, True):
                want_text = llama_text(vocab, want, remove_special, parse_special)
                got_text = tok.detokenize(want, remove_special, parse_special)
                assert got_text == want_text, (f"detokenize(remove_special={remove_special}) of string {i} "
                                               f"{text!r}: ggraph {got_text!r}, llama.cpp {want_text!r}")
            counts["strings"] += 1
            counts["round trips"] += want_text == text.encode()
        return counts
    finally:
        llm.close()


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("name", VOCABS)
def test_random_text_matches_llama_cpp(name):
    path = vocab_path(name)
    rng = random.Random(f"vocab {name}")
    specials = special_texts(Tokenizer.from_gguf(path))
    texts = [random_text(rng, specials) for _ in range(N_STRINGS)]
    counts = compare(path, texts)
    print(f"{name}: {counts}")
    assert counts["strings"] == N_STRINGS


# words small_vocab holds as tokens that no merges make: they show whether a pre-tokenizer ignores merges
UNMERGEABLE = ("qqqq", " qqqq", "xqxq")


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_random_text_matches_llama_cpp_for_every_pretokenizer(pre, tmp_path):
    path = small_vocab(tmp_path / f"{pre}.gguf", pre, extra_tokens=UNMERGEABLE)
    rng = random.Random(f"pre {pre}")
    texts = (random_text(rng, ["<|endoftext|>", *UNMERGEABLE]) for _ in range(400))
    if pre == "whitespace":                         # llama.cpp aborts on a word "  " (see test_tokenizer)
        texts = (t for t in texts if not any(len(w) > 1 and " " in w for w in split_words(pre, t)))
    texts = list(texts)[:100]
    counts = compare(path, texts)
    print(f"{pre}: {counts}")
    assert counts["strings"] == 100
