"""Tokenizers built from GGUF metadata that give llama.cpp's token ids, token for token.

Three models, chosen by ``tokenizer.ggml.model``:

- ``llama``: SentencePiece-style. Spaces become U+2581, then adjacent symbols are merged by
  token score (llama.cpp's ``llm_tokenizer_spm``); characters no token covers fall back to
  ``<0xXX>`` byte tokens.
- ``gpt2``: BPE (llama.cpp's ``llm_tokenizer_bpe``). A pre-tokenizer chosen by
  ``tokenizer.ggml.pre`` cuts the text into words by a list of regexes (every name llama.cpp
  maps is supported, see ``PRE_TOKENIZERS``), each word's UTF-8 bytes are mapped to printable
  characters (for most pre-tokenizers), and the pairs in ``tokenizer.ggml.merges`` are applied
  lowest rank first.
- ``gemma4``: the same BPE with the ``gemma4`` pre-tokenizer: whole lines of text whose spaces
  became U+2581, merged as raw UTF-8 characters, with ``<0xXX>`` byte fallback.

Before any of them runs, control and user-defined token texts are cut out of the text
(llama.cpp's ``tokenizer_st_partition``). The behaviour follows the llama.cpp built into
llama-cpp-python 0.3.36, which is the oracle the tests compare against. Two known gaps:
code points are classified by Python's ``unicodedata`` plus the Unicode 15.0-15.1 additions
llama.cpp's tables know, so on a Python whose Unicode is newer than 15.1 the code points
assigned later may split differently; and where llama.cpp aborts on a character that has no
token and no byte token, this tokenizer emits the unknown token. (Where llama.cpp aborts on a
BPE word that holds a space, which only the ``whitespace`` pre-tokenizer makes, it raises.)

    tok = Tokenizer.from_gguf("model.gguf")
    ids = tok.encode("Hello")          # [bos, ...]
    text = tok.decode(ids[1:])
"""
from __future__ import annotations

import bisect
import codecs
import functools
import heapq
import re
import unicodedata
from array import array

import numpy as np

# llama.cpp token attribute bits (llama_token_attr)
UNDEFINED, UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 0, 1, 2, 4, 8, 16, 32
LSTRIP, RSTRIP = 128, 256

# tokenizer.ggml.token_type value -> attribute bits; other values are UNDEFINED
_ATTR_OF_TYPE = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}

# texts llama.cpp recognises as special tokens when the file names no id for them
_FOUND_BY_TEXT = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
            "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
            "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}

# token texts that end generation wherever they appear in a vocabulary
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
              "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
              "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
              "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")

# gpt-oss tokens llama.cpp always renders
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# special token -> its tokenizer.ggml.* id key (note llama.cpp's spelling of "seperator")
_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id",
            "eom": "eom_token_id", "unk": "unknown_token_id", "sep": "seperator_token_id",
            "pad": "padding_token_id", "fim_pre": "fim_pre_token_id",
            "fim_suf": "fim_suf_token_id", "fim_mid": "fim_mid_token_id",
            "fim_pad": "fim_pad_token_id", "fim_rep": "fim_rep_token_id",
            "fim_sep": "fim_sep_token_id"}

# each model's special ids when the file names none
_DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}, "gemma4": {}}

_SPACE = "\u2581"                   # SentencePiece's visible space
_C_SPACES = frozenset(" \t\n\v\f\r")  # C isspace(), used to strip around special tokens


# ---------------------------------------------------------------- unicode classes

# llama.cpp's unicode_set_whitespace (Unicode White_Space): \t..\r, space, NEL, NBSP, ...
_WHITESPACE = frozenset(map(chr, [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680,
                                  *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F,
                                  0x3000]))

# Code points that Unicode 15.0 and 15.1 assigned, with their class in llama.cpp's tables (made
# from Unicode 15.1). Python 3.11's unicodedata is Unicode 14.0 and calls them unassigned.
_UNICODE_15 = (
    (0x00CF3, 0x00CF3, "M"), (0x00ECE, 0x00ECE, "M"), (0x02FFC, 0x02FFF, "S"),
    (0x031EF, 0x031EF, "S"), (0x10EFD, 0x10EFF, "M"), (0x1123F, 0x11240, "L"),
    (0x11241, 0x11241, "M"), (0x11B00, 0x11B09, "P"), (0x11F00, 0x11F01, "M"),
    (0x11F02, 0x11F02, "L"), (0x11F03, 0x11F03, "M"), (0x11F04, 0x11F10, "L"),
    (0x11F12, 0x11F33, "L"), (0x11F34, 0x11F3A, "M"), (0x11F3E, 0x11F42, "M"),
    (0x11F43, 0x11F4F, "P"), (0x11F50, 0x11F59, "N"), (0x1342F, 0x1342F, "L"),
    (0x13439, 0x1343F, "C"), (0x13440, 0x13440, "M"), (0x13441, 0x13446, "L"),
    (0x13447, 0x13455, "M"), (0x1B132, 0x1B132, "L"), (0x1B155, 0x1B155, "L"),
    (0x1D2C0, 0x1D2D3, "N"), (0x1DF25, 0x1DF2A, "L"), (0x1E030, 0x1E06D, "L"),
    (0x1E08F, 0x1E08F, "M"), (0x1E4D0, 0x1E4EB, "L"), (0x1E4EC, 0x1E4EF, "M"),
    (0x1E4F0, 0x1E4F9, "N"), (0x1F6DC, 0x1F6DC, "S"), (0x1F774, 0x1F776, "S"),
    (0x1F77B, 0x1F77F, "S"), (0x1F7D9, 0x1F7D9, "S"), (0x1FA75, 0x1FA77, "S"),
    (0x1FA87, 0x1FA88, "S"), (0x1FAAD, 0x1FAAF, "S"), (0x1FABB, 0x1FABD, "S"),
    (0x1FABF, 0x1FABF, "S"), (0x1FACE, 0x1FACF, "S"), (0x1FADA, 0x1FADB, "S"),
    (0x1FAE8, 0x1FAE8, "S"), (0x1FAF7, 0x1FAF8, "S"), (0x2B739, 0x2B739, "L"),
    (0x2EBF0, 0x2EE5D, "L"), (0x31350, 0x323AF, "L"),
)
_UNICODE_15_STARTS = [start for start, _, _ in _UNICODE_15]

# llama.cpp's unicode_cpt_is_han: CJK ideographs and their extensions A-F, compatibility ideographs
_HAN = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF), (0xF900, 0xFAFF),
        (0x2F800, 0x2FA1F))


@functools.lru_cache(maxsize=1 << 16)
def _kind(ch: str) -> str:
    """Class of one code point as llama.cpp's tables see it: W(hitespace), L, N, P, M, S or C (the rest)."""
    if ch in _WHITESPACE:
        return "W"
    cat = unicodedata.category(ch)
    if cat == "Cn":
        cp = ord(ch)
        i = bisect.bisect_right(_UNICODE_15_STARTS, cp) - 1
        if i >= 0 and cp <= _UNICODE_15[i][1]:
            return _UNICODE_15[i][2]
    return cat[0]


def _is_han(ch: str) -> bool:
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in _HAN)


# ---------------------------------------------------------------- pre-tokenizers
# llama.cpp's BPE pre-tokenizer (unicode_regex_split) applies a list of regexes in turn: each one
# cuts every piece the ones before it left into its matches and the stretches between them. A
# regex that names a Unicode class (\p{L}, \p{N}, \p{P}, \p{M}, \p{S}, \p{Lu}, ...) runs over a
# "collapsed" text in which each code point >= 128 is one stand-in character for its class, the
# class becomes [stand-in + its ASCII members], and so \p{Lu} is just \p{L}. Any other regex runs
# over the code points themselves, with non-ASCII whitespace turned into \v. Both run std::regex:
# backtracking, leftmost-first ECMAScript with ASCII-only \s and \d, which Python's re with
# re.ASCII matches for these patterns. For GPT-2's, Llama 3's, Qwen2's, Qwen3.5's and the newline
# regex llama.cpp runs hand-written scanners that give what the regex gives; for the three in
# _HAND_WRITTEN it runs code that differs from the regex text, ported below.

_STAND_IN = {"W": "\x0b", "N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}   # else \xd0

# the characters a \p{..} class stands for in a collapsed regex (llama.cpp's k_ucat_cpt + k_ucat_map)
_CLASS_CHARS = {"N": "\xd1" "0-9", "L": "\xd2" "A-Za-z", "M": "\xd4",
                "P": "\xd3" r"!-#%-*,-/:-;?-@\[-\]_\{\}", "S": "\xd5" r"\$\+<->^`\|\~"}
_PROPERTIES = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S",
               "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}


class _Collapse(dict):
    """str.translate table: ASCII stays, any other code point becomes its class's stand-in."""

    def __missing__(self, cp: int) -> str:
        out = self[cp] = _STAND_IN.get(_kind(chr(cp)), "\xd0")
        return out


_COLLAPSE = _Collapse({cp: cp for cp in range(128)})
_WIDE = {ord(ch): "\x0b" for ch in _WHITESPACE if ord(ch) >= 128}    # str.translate table


def _translate(expr: str) -> tuple:
    """(Python pattern, runs on collapsed text) for one llama.cpp pre-tokenizer regex."""
    collapsed = any(f"\\p{{{name}}}" in expr for name in _PROPERTIES)
    if collapsed and not expr.isascii():
        raise ValueError(f"pre-tokenizer regex {expr!r} mixes Unicode classes with non-ASCII text, "
                         "which llama.cpp rejects")
    out, inside, i = [], False, 0
    while i < len(expr):
        if expr.startswith("\\p{", i):
            end = expr.find("}", i)
            name = expr[i + 3:end]
            if end < 0 or name not in _PROPERTIES:
                raise ValueError(f"pre-tokenizer regex {expr!r}: unknown class {expr[i:end + 1]!r}")
            chars = _CLASS_CHARS[_PROPERTIES[name]]
            out.append(chars if inside else f"[{chars}]")
            i = end + 1
            continue
        c = expr[i:i + 2] if expr[i] == "\\" else expr[i]     # an escape is copied whole
        if c == "[":
            inside = True
        elif c == "]":
            inside = False
        out.append(r"\Z" if c == "$" and not inside else c)    # ECMAScript's $ is the very end only
        i += len(c)
    return "".join(out), collapsed


def _cut_kimi_k2(text: str, start: int, end: int):
    r"""Kimi-K2's splitter (llama.cpp unicode_regex_split_custom_kimi_k2, which "\p{Han}+" stands for):
    Han runs; letter runs without Han, after an optional lead-in character, with an optional
    contraction; \p{N}{1,3}; then Llama 3's punctuation and whitespace rules."""
    def kind(j):
        return _kind(text[j]) if j < end else None

    def letter(j):
        return j < end and _kind(text[j]) == "L" and not _is_han(text[j])

    i = start
    while i < end:
        c, k = text[i], _kind(text[i])
        j = i + 1
        if _is_han(c):
            while j < end and _is_han(text[j]):
                j += 1
        elif letter(i) or (c not in "\r\n" and k not in ("L", "N") and letter(i + 1)):
            while letter(j):
                j += 1
            j += _contraction(text, j, end)
        elif k == "N":
            while j < end and j - i < 3 and kind(j) == "N":
                j += 1
        elif (kind(i + 1) if c == " " else k) not in ("W", "L", "N", None):
            j = i + (c == " ")
            while kind(j) not in ("W", "L", "N", None):
                j += 1
            while j < end and text[j] in "\r\n":
                j += 1
        elif k == "W":
            j = _whitespace_end(text, i, end)
        yield i, j
        i = j


def _contraction(text: str, i: int, end: int) -> int:
    """Length of (?i:'s|'t|'m|'d|'re|'ve|'ll) at ``i`` (0 if none)."""
    if text[i:i + 1] != "'" or i + 1 >= end:
        return 0
    if text[i + 1].lower() in "stmd":
        return 2
    return 3 if i + 2 < end and text[i + 1:i + 3].lower() in ("re", "ve", "ll") else 0


def _whitespace_end(text: str, i: int, end: int) -> int:
    r"""End of \s*[\r\n]+, else \s+(?!\S), else \s+ at ``i`` (a whitespace character)."""
    j = i
    while j < end and _kind(text[j]) == "W":
        j += 1
    last_newline = max(text.rfind("\r", i, j), text.rfind("\n", i, j))
    if last_newline >= 0:
        return last_newline + 1
    return j - 1 if j - i > 1 and j < end else j


def _cut_digit_groups(text: str, start: int, end: int):
    r"""AFMoE's digit splitter (llama.cpp unicode_regex_split_custom_afmoe): each run of \p{N} in
    threes counted from its end, the text before the run joined to its first group."""
    prev = i = start
    while i < end:
        if _kind(text[i]) != "N":
            i += 1
            continue
        j = i
        while j < end and _kind(text[j]) == "N":
            j += 1
        first = i + ((j - i) % 3 or 3)
        yield prev, first
        yield from ((g, g + 3) for g in range(first, j, 3))
        prev = i = j
    if prev < end:
        yield prev, end


# regexes for which llama.cpp runs other code than the regex says
_HAND_WRITTEN = {
    r"\p{Han}+": _cut_kimi_k2,
    r"\p{AFMoE_digits}": _cut_digit_groups,
    r"\d{1,3}(?=(?:\d{3})*\b)": _cut_digit_groups,  # tiny_aya's; llama.cpp reuses AFMoE's code
}


@functools.cache
def _compile(expr: str) -> tuple:
    """(view, find) for one regex: find(view_text, start, end) yields the spans it matches."""
    if expr in _HAND_WRITTEN:
        return "text", _HAND_WRITTEN[expr]
    pattern, collapsed = _translate(expr)
    try:
        finditer = re.compile(pattern, re.ASCII).finditer
    except re.error as e:
        raise ValueError(f"pre-tokenizer regex {expr!r} does not compile: {e}") from e
    return ("collapsed" if collapsed else "wide"), lambda s, i, j: (m.span() for m in finditer(s, i, j))


def _split(regexes: tuple, text: str) -> list:
    """Cut ``text`` by each regex in turn, keeping matches and the text between them (unicode_regex_split)."""
    views = {"text": text}
    spans = [(0, len(text))] if text else []
    for expr in regexes:
        view, find = _compile(expr)
        if view not in views:
            views[view] = text.translate(_COLLAPSE if view == "collapsed" else _WIDE)
        out = []
        for start, end in spans:
            at = start
            for a, b in find(views[view], start, end):
                if a > at:
                    out.append((at, a))
                if b > a:                           # an empty match only cuts
                    out.append((a, b))
                at = b
            if at < end:
                out.append((at, end))
        spans = out
    return [text[a:b] for a, b in spans]


# The regexes llm_tokenizer_bpe splits by, named for a family of LLAMA_VOCAB_PRE_TYPE_*s that share
# them; copied from llama.cpp's llama-vocab.cpp (with CR and LF written \r and \n).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CJK = "[一-龥\u3040-ゟ゠-ヿ]+"
_DEEPSEEK3 = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"""
              r" ?[\p{P}\p{S}]+")
_CASED = (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
          r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*")
_CASED_LOOKAHEAD = (r"((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+",
                    r"((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*")
_BLOOM = " ?[^(\\s|.,!?…。，、।۔،)]+"

_PRE_REGEXES = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),                               # also MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING
    "llama3": (_LLAMA3,),                           # also DBRX, SMAUG, CHATGLM4
    "qwen2": (_QWEN2,),                             # also STABLELM2, HUNYUAN, SOLAR_OPEN, GROK_2
    "qwen35": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+",),
    "starcoder": (r"\p{N}", _GPT2),                 # also REFACT, COMMAND_R, SMOLLM, CODESHELL, ...
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "jais-2": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|"
               r"\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",),
    "deepseek-llm": (
        r"[\r\n]",
        ("\\s?[A-Za-z\u00b5À-ÖØ-öø-ƺƼ-ƿ\u01c4-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-\u03f5Ϸ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫ"
         "ᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼ\u2102\u2107\u210a-\u2113"
         "\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
         "ⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿ\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a𐐀-𐑏𐒰-𐓓𐓘-𐓻"
         "𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"),
        "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
        r"\s+$",
        "[一-龥ࠀ-一가-\ud7ff]+",
        r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-\ud7ff]+", r"\p{N}"),
    # also HUNYUAN_DENSE, JOYAI_LLM, HY_V4
    "deepseek-v3": (r"\p{N}{1,3}", _CJK, _DEEPSEEK3 + r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "spark2_5": (r"\p{N}{1,3}", _CJK, _DEEPSEEK3 + r"|[\r\n]|\s+(?!\S)|\s+", r"\p{N}"),
    "youtu": ("[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|" + _CJK,
              r"[^\r\n\p{L}\p{N}]?" + _CASED[0] + _CONTRACTIONS + r"?|[^\r\n\p{L}\p{N}]?" + _CASED[1] +
              _CONTRACTIONS + r"?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "bloom": (_BLOOM,),                             # PORO, BLOOM, GPT3_FINNISH
    "viking": (_BLOOM, r"\p{N}"),
    "tekken": (r"[^\r\n\p{L}\p{N}]?" + _CASED_LOOKAHEAD[0] + r"|[^\r\n\p{L}\p{N}]?" + _CASED_LOOKAHEAD[1] +
               r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "chameleon": ("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
                  r"[\p{P}!-/:-@\[-`{-~]", _GPT2),
    "gpt-4o": (r"[^\r\n\p{L}\p{N}]?" + _CASED_LOOKAHEAD[0] + _CONTRACTIONS + r"?|[^\r\n\p{L}\p{N}]?" +
               _CASED_LOOKAHEAD[1] + _CONTRACTIONS + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+",),                 # also MINIMAX_M2
    "granite-embed-multi": (
        r"[^\r\n\p{L}\p{N}]?" + _CASED_LOOKAHEAD[0].replace(r"\p{L}", r"\p{L}\p{M}") + _CONTRACTIONS +
        r"?|[^\r\n\p{L}\p{N}]?" + _CASED_LOOKAHEAD[1].replace(r"\p{L}", r"\p{L}\p{M}") + _CONTRACTIONS +
        r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "tiny_aya": (r"\d{1,3}(?=(?:\d{3})*\b)",
                 r"[^\r\n\p{L}\p{N}]?" + _CASED[0] + _CONTRACTIONS + r"?|[^\r\n\p{L}\p{N}]?" + _CASED[1] +
                 _CONTRACTIONS + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "kimi-k2": (r"\p{Han}+",),
    "superbpe": (r"\p{N}+", r"(?=(\d{3})+(?!\d))"),
    "bailingmoe": ((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"),),
    "seed-coder": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|"
                   r"\s+(?!\S)|\s+",),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "afmoe": (r"\p{AFMoE_digits}",
              ("[一-鿿㐀-䶿豈-\ufaff\u3040-\u309f゠-\u30ff\uff65-\uff9f\u2f00-\u2fdfเ-\u0e7f\u0e80-\u0eff"
               "ក-\u17ffက-႟ꩠ-ꩿꧠ-\ua9ff가-\ud7afᄀ-ᇿ]+"),
              _DEEPSEEK3 + r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "laguna": (r"[^\n]+|[\n]+", _QWEN2),
    "exaone-moe": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}|"
                   r" ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",),
    "minicpm5": (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+"),
    "newlines": (r"[^\n]+|[\n]+",),                 # GEMMA4, SARVAM_MOE: BPE runs on whole lines
    "whitespace": (r"\S+",),
}

# The flags llama_vocab::impl::load starts a BPE (or SentencePiece) vocabulary with, then sets by
# pre-tokenizer name: add_bos (the default), always_bos (whatever the file says), add_space_prefix,
# clean_spaces (decoding drops the space in " ?", " 's", ...), ignore_merges (a word that is a token
# stays whole), default_bos (False: no default BOS id), byte_encode (False: merge raw UTF-8, fall back
# to <0xXX>), escape_whitespaces (spaces become U+2581), whole_newlines (a newline run that is a token
# stays whole).
_BPE_OPTIONS = {"add_bos": False, "add_space_prefix": False, "clean_spaces": True, "ignore_merges": False,
                "always_bos": False, "default_bos": True, "byte_encode": True, "escape_whitespaces": False,
                "whole_newlines": False}
_SPM_OPTIONS = {**_BPE_OPTIONS, "add_bos": True, "add_space_prefix": True, "clean_spaces": False,
                "escape_whitespaces": True}
_KEEP = {"clean_spaces": False}
_PRE_TABLE = (
    # (tokenizer.ggml.pre names, regexes, options), in about the order llama_vocab::impl::load tests them
    ("default", "default", {}),
    ("minicpm5", "minicpm5", {"ignore_merges": True}),
    ("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", "llama3",
     {"ignore_merges": True, "add_bos": True}),
    ("deepseek-llm", "deepseek-llm", _KEEP),
    ("deepseek-coder", "deepseek-coder", _KEEP),
    ("deepseek-v3", "deepseek-v3", _KEEP),
    ("spark2_5", "spark2_5", _KEEP),
    ("youtu", "youtu", {**_KEEP, "ignore_merges": True}),
    ("falcon", "falcon", {}),
    ("mpt", "gpt2", {}),
    ("starcoder", "starcoder", {}),
    ("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert", "gpt2", {}),
    ("jais-2", "jais-2", {}),
    ("gemma4 granite-embed-multi-311m", "newlines",
     {"escape_whitespaces": True, "byte_encode": False, "whole_newlines": True, "always_bos": True}),
    ("sarvam-moe", "newlines", {**_KEEP, "escape_whitespaces": True, "byte_encode": False}),
    ("jina-v1-en jina-v2-code roberta-bpe", "gpt2", {}),
    ("whitespace", "whitespace", {"byte_encode": False}),
    ("refact", "starcoder", {}),
    ("command-r", "starcoder", _KEEP),
    ("qwen2 deepseek-r1-qwen kormo f2llmv2", "qwen2", _KEEP),
    ("qwen35", "qwen35", _KEEP),
    ("stablelm2", "qwen2", {}),
    ("olmo", "gpt2", {}),
    ("dbrx smaug-bpe", "llama3", {}),
    ("poro-chat", "bloom", _KEEP),
    ("chatglm-bpe", "llama3", {"default_bos": False}),
    ("glm4 glm5", "llama3", {"default_bos": False, "ignore_merges": True}),
    ("viking", "viking", _KEEP),
    ("jais", "gpt2", {}),
    ("tekken", "tekken", {**_KEEP, "ignore_merges": True, "add_bos": True}),
    ("smollm", "starcoder", _KEEP),
    ("codeshell", "starcoder", {}),
    ("bloom gpt3-finnish", "bloom", {}),
    ("exaone", "starcoder", {}),
    ("exaone4", "gpt2", {}),
    ("exaone-moe", "exaone-moe", {}),
    ("chameleon", "chameleon", {**_KEEP, "add_bos": True}),
    ("minerva-7b", "starcoder", {}),
    ("megrez", "qwen2", {}),
    ("gpt-4o llama4 kanana2 talkie", "gpt-4o", _KEEP),
    ("granite-embed-multi-97m", "granite-embed-multi", {**_KEEP, "ignore_merges": True}),
    ("tiny_aya cohere2moe", "tiny_aya", _KEEP),
    ("superbpe", "superbpe", _KEEP),
    ("trillion granite-docling", "gpt2", _KEEP),
    ("bailingmoe bailingmoe2 llada-moe", "bailingmoe", _KEEP),
    ("seed-coder", "seed-coder", _KEEP),
    ("hunyuan", "qwen2", _KEEP),
    ("hunyuan-dense hy_v4 joyai-llm", "deepseek-v3", _KEEP),
    ("kimi-k2", "kimi-k2", _KEEP),
    ("ufakzeka", "ufakzeka", _KEEP),
    ("grok-2", "qwen2", _KEEP),
    ("afmoe", "afmoe", _KEEP),
    ("laguna", "laguna", _KEEP),
    ("minimax-m2", "gpt-4o", _KEEP),
    ("solar-open", "qwen2", _KEEP),
    ("mellum2", "starcoder", {}),
)

# tokenizer.ggml.pre -> (regexes, options)
PRE_TOKENIZERS = {name: (_PRE_REGEXES[regexes], options)
                  for names, regexes, options in _PRE_TABLE for name in names.split()}


def split_words(pre: str, text: str) -> list:
    """The words llama.cpp's pre-tokenizer ``pre`` cuts ``text`` into, before BPE runs on each."""
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported; supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    return _split(PRE_TOKENIZERS[pre][0], text)


# ---------------------------------------------------------------- byte-level encoding

def _byte_chars() -> list:
    """GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to U+0100 onwards."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(0x100, 0x200))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


_BYTE_CHARS = _byte_chars()
_BYTE_TO_CHAR = str.maketrans({chr(b): c for b, c in enumerate(_BYTE_CHARS)})   # latin-1 -> gpt2
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_CHARS)}


def _byte_encode(word: str) -> str:
    """A word's UTF-8 bytes as GPT-2 byte characters."""
    return word.encode("utf-8").decode("latin-1").translate(_BYTE_TO_CHAR)


def _byte_decode(text: str) -> bytes:
    """Inverse of _byte_encode; an unmapped character becomes llama.cpp's [UNK_BYTE_0x..] marker."""
    out = bytearray()
    for ch in text:
        b = _CHAR_TO_BYTE.get(ch)
        if b is None:
            out += b"[UNK_BYTE_0x" + ch.encode().hex().encode() + text.encode() + b"]"
        else:
            out.append(b)
    return bytes(out)


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's clean_up_tokenization_spaces for BPE: ' ?' -> '?', " ' " -> "'", " 's" -> "'s"."""
    t = bytearray(text)
    out = bytearray(t[:1])                      # pass 1: drop a space before ? ! . ,
    for i in range(1, len(t)):
        if t[i - 1] == 0x20 and t[i] in b"?!.,":
            out.pop()
        out.append(t[i])
    t, out, i = out, bytearray(out[:1]), 1      # pass 2: a lone apostrophe between spaces
    while i < len(t):
        x = t[i]
        if x == 0x27 and i + 1 < len(t) and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            out.pop()
            i += 1
            t[i] = 0
        out.append(x)
        i += 1
    t, out = out, bytearray(out[:1])            # pass 3: " 's", " 'm", " 're", " 've"
    for i in range(1, len(t)):
        if t[i - 1] == 0x20 and t[i] == 0x27 and i + 1 < len(t):
            nxt = bytes(t[i + 1:i + 3])
            if nxt[:1] in (b"s", b"m") or (len(nxt) == 2 and nxt in (b"re", b"ve")):
                out.pop()
        out.append(t[i])
    return bytes(out)


# ---------------------------------------------------------------- pair merging

def _merge(syms: list, key) -> list:
    """Join adjacent symbols, the pair with the lowest ``key(left, right)`` first (leftmost on ties), until
    no pair has a key (None): the work queue of llama.cpp's llm_tokenizer_spm and llm_tokenizer_bpe."""
    n = len(syms)
    nxt, prv = [*range(1, n), -1], [*range(-1, n - 1)]
    heap = []

    def push(left: int, right: int) -> None:
        k = key(syms[left], syms[right])
        if k is not None:
            heapq.heappush(heap, (k, left, right, len(syms[left]) + len(syms[right])))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
            continue                                # stale: one side changed since the push
        syms[left] += syms[right]
        syms[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        if prv[left] >= 0:
            push(prv[left], left)
        if nxt[left] >= 0:
            push(left, nxt[left])
    return [s for s in syms if s]


# ---------------------------------------------------------------- metadata helpers

def _get(md: dict, key: str, types: tuple, default=None):
    """``md[key]`` checked against ``types``; ``default`` when absent."""
    if key not in md:
        return default
    value = md[key]
    if isinstance(value, np.generic):
        value = value.item()
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ValueError(f"GGUF metadata {key!r}: expected {'/'.join(t.__name__ for t in types)},"
                         f" got {type(value).__name__} {value!r}")
    return value


def _array(md: dict, key: str, dtype, n: int):
    """A per-token numeric array of at least ``n`` entries, or None when absent."""
    if key not in md:
        return None
    arr = np.asarray(md[key])
    if arr.ndim != 1 or arr.shape[0] < n or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"GGUF metadata {key!r}: expected {n} numbers, got {arr.dtype} array of "
                         f"shape {arr.shape}")
    return arr[:n].astype(dtype)


# ---------------------------------------------------------------- the tokenizer

class Tokenizer:
    """A llama.cpp-compatible tokenizer; build it with from_gguf or from_metadata."""

    MODELS = ("llama", "gpt2", "gemma4")

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """Read the tokenizer keys of a GGUF file (no tensor data is touched)."""
        from ggraph.gguf import GGUFFile
        with GGUFFile(path) as f:                   # from_metadata copies what it keeps
            return cls.from_metadata(f.metadata)

    @classmethod
    def from_metadata(cls, md: dict) -> "Tokenizer":
        """Build from a GGUF metadata dict (keys -> Python values, string arrays as sequences)."""
        tok = cls.__new__(cls)
        tok._load_model(md)
        tok._load_vocab(md)
        tok._load_special(md)
        tok._attrs = tok._attrs.tolist()            # plain ints index faster than numpy
        return tok

    # -- loading

    def _load_model(self, md: dict) -> None:
        """Model kind, pre-tokenizer and the flags whose defaults depend on them (llama_vocab::impl::load)."""
        model = _get(md, "tokenizer.ggml.model", (str,))
        if model is None:
            raise ValueError("GGUF metadata has no 'tokenizer.ggml.model'")
        if model not in self.MODELS:
            raise ValueError(f"tokenizer.ggml.model {model!r} is not supported; supported: "
                             "'llama' (SentencePiece), 'gpt2' (BPE), 'gemma4' (BPE over U+2581-escaped text)")
        self.model = model
        self.architecture = _get(md, "general.architecture", (str,))
        self.chat_template = _get(md, "tokenizer.chat_template", (str,))
        spm = model == "llama"
        opts = dict(_SPM_OPTIONS if spm else _BPE_OPTIONS)
        self.pre, self._regexes = None, ()
        if not spm:                                 # llama.cpp's gemma4 model always uses the gemma4 pre
            self.pre = "gemma4" if model == "gemma4" else _get(md, "tokenizer.ggml.pre", (str,)) or "default"
            if self.pre not in PRE_TOKENIZERS:
                raise ValueError(f"tokenizer.ggml.pre {self.pre!r} is not supported; supported: "
                                 f"{', '.join(sorted(PRE_TOKENIZERS))}")
            self._regexes, extra = PRE_TOKENIZERS[self.pre]
            opts.update(extra)
        self.add_space_prefix = _get(md, "tokenizer.ggml.add_space_prefix", (bool,),
                                     opts["add_space_prefix"])
        self.add_bos = _get(md, "tokenizer.ggml.add_bos_token", (bool,), opts["add_bos"])
        self.add_bos |= opts["always_bos"]
        self.add_eos = _get(md, "tokenizer.ggml.add_eos_token", (bool,), False)
        self._clean = opts["clean_spaces"]
        self._ignore_merges = opts["ignore_merges"]
        self._default_bos = opts["default_bos"]
        self._byte_encode = opts["byte_encode"]
        self._escape = opts["escape_whitespaces"]
        self._whole_newlines = opts["whole_newlines"]

    def _load_vocab(self, md: dict) -> None:
        """Token texts, the text -> id map, scores, attributes and BPE merge ranks."""
        if "tokenizer.ggml.tokens" not in md:
            raise ValueError("GGUF metadata has no 'tokenizer.ggml.tokens'")
        tokens = list(md["tokenizer.ggml.tokens"])         # decodes each string once
        if set(map(type, tokens)) - {str}:
            i = next(i for i, t in enumerate(tokens) if not isinstance(t, str))
            raise ValueError(f"tokenizer.ggml.tokens[{i}]: expected str, got {type(tokens[i]).__name__}")
        if "" in tokens:
            tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]   # as llama.cpp names them
        n = len(tokens)
        self._tokens = tokens
        self._tok2id = dict(zip(tokens, range(n)))
        if len(self._tok2id) != n:
            seen = set()
            dup = next(t for t in tokens if t in seen or seen.add(t))
            raise ValueError(f"tokenizer.ggml.tokens: duplicate token {dup!r}")
        scores = _array(md, "tokenizer.ggml.scores", np.float32, n)
        # f32 in an array: 4 bytes a token where a list of floats takes 32 (8 MiB for a 262k vocabulary)
        self._scores = array("f", scores.astype(np.float32).tobytes() if scores is not None else bytes(4 * n))
        types = _array(md, "tokenizer.ggml.token_type", np.int64, n)
        if types is None:
            self._attrs = np.full(n, NORMAL, np.int64)
        else:
            lut = np.zeros(8, np.int64)
            for ty, attr in _ATTR_OF_TYPE.items():
                lut[ty] = attr
            self._attrs = np.where((types >= 0) & (types < 8), lut[np.clip(types, 0, 7)], UNDEFINED)
        self._ranks = None
        if self.model != "llama":
            if "tokenizer.ggml.merges" not in md and self.pre != "kimi-k2":   # Kimi-K2 may have none
                raise ValueError(f"{self.model} tokenizer: GGUF metadata has no 'tokenizer.ggml.merges'")
            merges = list(md.get("tokenizer.ggml.merges", ()))
            # "left right" -> rank; the first occurrence of a duplicate wins, as in llama.cpp
            self._ranks = {m: r for r, m in zip(range(len(merges) - 1, -1, -1), reversed(merges))}
        # the token of each byte a text falls back to: SPM's <0xXX> (else the byte itself), BPE's
        # byte itself (only ASCII can be a token of byte-encoded text), raw-UTF-8 BPE's <0xXX>
        hex_ids = [self._tok2id.get(f"<0x{b:02X}>") for b in range(256)]
        char_ids = [self._tok2id.get(chr(b)) if b < 128 else None for b in range(256)]
        if self.model == "llama":
            self._byte_ids = [h if h is not None else c for h, c in zip(hex_ids, char_ids)]
        else:
            self._byte_ids = char_ids if self._byte_encode else hex_ids
        self._pieces = {}                                   # id -> bytes, filled lazily
        self._word_cache = {}

    def _load_special(self, md: dict) -> None:
        """Special ids, the end-of-generation set and the special-token cache, as llama.cpp builds them."""
        self._ids = self._special_ids(md)
        for what, on in (("bos", self.add_bos), ("eos", self.add_eos)):
            if on and self._ids[what] is None:
                raise ValueError(f"tokenizer.ggml.add_{what}_token is true but there is no {what} token")
        self._mark_unused()
        self.eog_ids = frozenset(self._eog(md))
        specials = np.nonzero(self._attrs & (CONTROL | USER_DEFINED | UNKNOWN))[0].tolist()
        # longest (in UTF-8 bytes) first, like llama.cpp's cache_special_tokens
        self._specials = sorted(specials, key=lambda i: -len(self._tokens[i].encode()))
        self._mark_strip(md)

    def _special_ids(self, md: dict) -> dict:
        """Ids from tokenizer.ggml.*_token_id, else llama.cpp's model defaults, else found by text."""
        n, tok2id, attrs = len(self._tokens), self._tok2id, self._attrs
        defaults = dict(_DEFAULT_IDS[self.model])
        if not self._default_bos:
            defaults.pop("bos", None)
        ids = {name: defaults.get(name) for name in _ID_KEYS}
        for name, key in _ID_KEYS.items():
            if ids[name] is not None and ids[name] >= n:
                ids[name] = None                        # a default outside a small vocabulary
            value = _get(md, f"tokenizer.ggml.{key}", (int,))
            if value is not None:
                if not 0 <= value < n:
                    raise ValueError(f"tokenizer.ggml.{key} = {value} is outside the vocabulary "
                                     f"of {n} tokens")
                ids[name] = value
        for name, texts in _FOUND_BY_TEXT.items():
            found = [tok2id[t] for t in texts if t in tok2id]
            if ids[name] is None and found:
                ids[name] = found[0]
                attrs[found[0]] |= CONTROL              # llama.cpp retypes it as control
        return ids

    def _mark_unused(self) -> None:
        """Control tokens whose text says 'unused' get the UNUSED attribute too."""
        for i in np.nonzero(self._attrs & CONTROL)[0].tolist():
            if "unused" in self._tokens[i]:
                self._attrs[i] |= UNUSED

    def _eog(self, md: dict) -> set:
        """End-of-generation ids: eos/eot/eom, fim pad/repo/sep, tokens found by text, listed extras."""
        tok2id, attrs, ids = self._tok2id, self._attrs, self._ids
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
        for t in _EOG_TEXTS:
            if t in tok2id:
                eog.add(tok2id[t])
                attrs[tok2id[t]] |= CONTROL
        for t in _ALWAYS_RENDERED:
            if t in tok2id:
                attrs[tok2id[t]] = USER_DEFINED
        eog |= {ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None}
        extra = md.get("tokenizer.ggml.eog_token_ids")
        if extra is not None:
            listed = np.asarray(extra).reshape(-1)
            if listed.dtype.kind not in "iu":
                raise ValueError(f"tokenizer.ggml.eog_token_ids must be integers, got {listed.dtype}")
            bad = [int(i) for i in listed if not 0 <= int(i) < len(self._tokens)]
            if bad:
                raise ValueError(f"tokenizer.ggml.eog_token_ids holds {bad[0]}, outside the vocabulary of "
                                 f"{len(self._tokens)} tokens")
            eog |= {int(i) for i in listed}
        texts = {self._tokens[i]: i for i in eog}
        has_call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
            eog.discard(texts["<|end|>"])               # harmony: <|end|> ends a message, not the reply
            attrs[texts["<|end|>"]] = USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])                  # there </s> is ordinary text
            attrs[texts["</s>"]] = NORMAL
        return eog

    def _mark_strip(self, md: dict) -> None:
        """Per-model strip attributes llama.cpp sets by name (phi-3 eats spaces after special tokens)."""
        name = (_get(md, "general.name", (str,)) or "").lower()
        if "phi-3" in name or "phi3" in name:
            self._attrs[self._specials] |= RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if text in self._tok2id:
                    i = self._tok2id[text]
                    self._attrs[i] = self._attrs[i] | RSTRIP if on else self._attrs[i] & ~RSTRIP

    # -- properties

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (its vocabulary entry is at least as long):
        a text longer than ``ctx * max_token_chars`` cannot fit ``ctx`` tokens, which is known without
        encoding it (a 50 MB prompt is refused at once, not after gigabytes of merges)."""
        return max((len(t) for t in self._tokens), default=1) or 1

    def check_fits(self, text: str, ctx: int, what: str = "the prompt") -> None:
        """Raise ValueError when ``text`` is too long to fit ``ctx`` tokens, whatever it encodes to."""
        if len(text) > ctx * self.max_token_chars:
            raise ValueError(f"context full: {what} is {len(text)} characters, more than {ctx} tokens of at most "
                             f"{self.max_token_chars} characters each can hold (ctx={ctx})")

    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    bos_id = property(lambda self: self._ids["bos"], doc="Beginning-of-sequence id (or None).")
    eos_id = property(lambda self: self._ids["eos"], doc="End-of-sequence id (or None).")
    eot_id = property(lambda self: self._ids["eot"], doc="End-of-turn id, e.g. <end_of_turn> (or None).")
    unk_id = property(lambda self: self._ids["unk"], doc="Unknown-token id (or None).")
    pad_id = property(lambda self: self._ids["pad"], doc="Padding id (or None).")

    def is_eog(self, token_id: int) -> bool:
        """True for tokens that end generation: eos, eot, eom, and the ones llama.cpp finds by text."""
        return token_id in self.eog_ids

    def token_text(self, token_id: int) -> str:
        """The raw vocabulary entry, e.g. '▁Hello' or '<0x0A>'."""
        return self._tokens[self._id(token_id)]

    def _id(self, i) -> int:
        """``i`` as a checked token id: an integer in the vocabulary (Python's negative indexing would give
        the last tokens' text for -1, -2, ...)."""
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"token ids must be integers, got {type(i).__name__} {i!r}")
        if not 0 <= i < self.n_vocab:
            raise ValueError(f"token id {int(i)} is outside the vocabulary (n_vocab={self.n_vocab})")
        return int(i)

    def token_attr(self, token_id: int) -> int:
        """llama.cpp attribute bits of a token (NORMAL, CONTROL, USER_DEFINED, BYTE, ...)."""
        return self._attrs[token_id]

    # -- encoding

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True, *,
               space_prefix: bool = True) -> list:
        """Token ids of ``text``, as llama_tokenize(add_special, parse_special) gives them;
        ``space_prefix=False`` leaves out SentencePiece's leading space (text that continues other text)."""
        if not isinstance(text, str):
            raise TypeError(f"encode: expected str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"encode: text is not valid Unicode at position {e.start} "
                             f"({text[e.start]!r})") from e
        ids = [self.bos_id] if add_special and self.add_bos else []
        prev_special = True                 # SPM: a space prefix goes before the first text
        for frag in self._partition(text, parse_special) if text else []:
            if isinstance(frag, int):
                ids.append(frag)
                prev_special = True
            elif self.model == "llama":
                if self.add_space_prefix and prev_special and space_prefix:
                    frag = " " + frag
                ids += self._spm(frag.replace(" ", _SPACE))
                prev_special = False
            else:
                ids += self._bpe(frag)
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def _partition(self, text: str, parse_special: bool) -> list:
        """Cut special-token texts out of ``text``, longest token first: a list of str and int."""
        frags = [text]
        skip = 0 if parse_special else CONTROL | UNKNOWN     # user-defined tokens always split
        for tid in self._specials:
            t, attr = self._tokens[tid], self._attrs[tid]
            if attr & skip or t not in text:
                continue
            out = []
            for f in frags:
                if isinstance(f, str) and t in f:
                    out += _split_on(f, t, tid, attr & LSTRIP, attr & RSTRIP)
                else:
                    out.append(f)
            frags = out
        return frags

    def _spm(self, text: str) -> list:
        """SentencePiece merge: join the adjacent pair forming the best-scored token, leftmost on ties."""
        tok2id, scores = self._tok2id, self._scores

        def score(left: str, right: str):
            tid = tok2id.get(left + right)
            return None if tid is None else -scores[tid]

        out = []
        for s in _merge(list(text), score):
            tid = tok2id.get(s)
            out += [tid] if tid is not None else [self._byte_token(b) for b in s.encode()]
        return out

    def _byte_token(self, b: int) -> int:
        """The <0xXX> token of one byte; the unknown token if the vocabulary has no byte tokens."""
        tid = self._byte_ids[b]
        if tid is None:
            if self.unk_id is None:
                raise ValueError(f"vocabulary has neither a <0x{b:02X}> byte token nor an unknown token")
            return self.unk_id
        return tid

    def _bpe(self, text: str) -> list:
        """BPE over the pre-tokenizer's words, byte-encoded unless the pre-tokenizer works on raw UTF-8."""
        if self._escape:
            text = text.replace(" ", _SPACE)
        out, cache = [], self._word_cache
        for word in _split(self._regexes, text):
            if self._byte_encode:
                word = _byte_encode(word)
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(word)
                if len(word) <= 64:                 # long words are whole Gemma 4 lines: not worth keeping
                    if len(cache) > 100_000:
                        cache.clear()
                    cache[word] = ids
            out += ids
        return out

    def _bpe_word(self, word: str) -> list:
        """Merge the lowest-ranked adjacent pair (leftmost on ties) until none is left; unknown symbols fall
        back to byte tokens, dropping the bytes that have none (as llama.cpp does)."""
        tok2id, ranks, byte_ids = self._tok2id, self._ranks, self._byte_ids
        whole = self._ignore_merges or (self._whole_newlines and not word.strip("\n"))
        if whole and word in tok2id:
            return [tok2id[word]]
        if " " in word and len(word) > 1:           # only raw UTF-8 that keeps its spaces: 'whitespace'
            raise ValueError(f"BPE word {word!r} holds a space next to another symbol; llama.cpp aborts on it "
                             f"(GGML_ASSERT in find_bpe_rank) with tokenizer.ggml.pre {self.pre!r}")
        out = []
        for s in _merge(list(word), lambda left, right: ranks.get(left + " " + right)):
            tid = tok2id.get(s)
            if tid is not None:
                out.append(tid)
            else:
                out += [byte_ids[b] for b in s.encode() if byte_ids[b] is not None]
        return out

    # -- decoding

    def piece_bytes(self, token_id: int, special: bool = True) -> bytes:
        """Bytes of one token, as llama_token_to_piece; control tokens are empty unless ``special``."""
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {len(self._tokens)}")
        attr = self._attrs[token_id]
        if not special and attr & (UNKNOWN | CONTROL):
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id, attr)
        return piece

    def _piece(self, token_id: int, attr: int) -> bytes:
        """Uncached piece of a token with special tokens rendered."""
        text = self._tokens[token_id]
        if attr & (UNKNOWN | CONTROL | USER_DEFINED):
            return text.encode()
        if attr & NORMAL:
            return text.replace(_SPACE, " ").encode() if self._escape else _byte_decode(text)
        if attr & BYTE:
            if not (len(text) == 6 and text.startswith("<0x") and text.endswith(">")):
                raise ValueError(f"byte token {token_id} has text {text!r}, not <0xXX>")
            return bytes([int(text[3:5], 16)])
        return b""                                  # unused and undefined tokens print nothing

    def token_to_piece(self, token_id: int, special: bool = True) -> str:
        """Text of one token; a lone byte token gives U+FFFD, so stream with Detokenizer instead."""
        return self.piece_bytes(token_id, special).decode("utf-8", errors="replace")

    def detokenize(self, ids, remove_special: bool = False, unparse_special: bool = False) -> bytes:
        """Bytes of ``ids``, as llama_detokenize(remove_special, unparse_special)."""
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"token ids must be a sequence of integers, got {type(ids).__name__}")
        ids = [self._id(i) for i in ids]
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = [self.piece_bytes(i, unparse_special) for i in ids]
        if parts and remove_space and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]                 # the space the SPM prefix added
        text = b"".join(parts)
        return _clean_spaces(text) if self._clean else text

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text of ``ids``; special tokens are rendered unless ``skip_special``."""
        return self.detokenize(ids, unparse_special=not skip_special).decode("utf-8", errors="replace")

    def decode_stream(self, ids, skip_special: bool = False):
        """Yield text as ``ids`` arrive, holding back bytes until they form whole characters."""
        detok = Detokenizer(self, skip_special)
        for i in ids:
            text = detok.push(i)
            if text:
                yield text
        tail = detok.flush()
        if tail:
            yield tail

    # -- chat

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True, **extra) -> str:
        """Render ``messages`` with the file's template (or a built-in one) as transformers would (chat.render;
        ``extra`` are template variables: tools=, enable_thinking= ...); encode() adds the BOS."""
        from ggraph.runtime.chat import default_template, render
        template = self.chat_template or default_template(self.architecture)
        bos = self._tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self._tokens[self.eos_id] if self.eos_id is not None else ""
        text = render(template, messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
                      eos_token=eos, **extra)
        if self.add_bos and bos and text.startswith(bos):
            text = text[len(bos):]                  # encode(add_special=True) puts it back once
        return text

    def __repr__(self) -> str:
        pre = f", pre={self.pre!r}" if self.pre else ""
        return f"Tokenizer(model={self.model!r}{pre}, n_vocab={self.n_vocab})"


def _split_on(frag: str, text: str, tid: int, lstrip: int, rstrip: int) -> list:
    """Split one fragment at every occurrence of a special token's text (tokenizer_st_partition)."""
    out, base, end = [], 0, len(frag)
    while base < end:
        m = frag.find(text, base, end)
        if m < 0:
            out.append(frag[base:end])
            break
        left = m
        while lstrip and left > base and frag[left - 1] in _C_SPACES:
            left -= 1
        if left > base:
            out.append(frag[base:left])
        out.append(tid)
        base = m + len(text)
        while rstrip and base < end and frag[base] in _C_SPACES:
            base += 1
    return out


class Detokenizer:
    """Incremental decoding for streaming: push ids, get back only complete UTF-8 text."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token ('' while a multi-byte character is still open)."""
        return self._utf8.decode(self._tok.piece_bytes(token_id, self._special))

    def flush(self) -> str:
        """Whatever is left, with U+FFFD for an unfinished character."""
        return self._utf8.decode(b"", final=True)
