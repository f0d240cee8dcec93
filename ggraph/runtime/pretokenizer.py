"""llama.cpp's BPE pre-tokenizers: the regexes and options for every ``tokenizer.ggml.pre`` name, and the
splitter that cuts a text into words by them (``unicode_regex_split``), Unicode classes as llama.cpp's tables
give them.

    split_words("llama3", "Hello world's 1234")   # ['Hello', ' world', "'s", ' ', '123', '4']
"""
from __future__ import annotations

import bisect
import functools
import re
import unicodedata


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


def split(regexes: tuple, text: str) -> list:
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
BPE_OPTIONS = {"add_bos": False, "add_space_prefix": False, "clean_spaces": True, "ignore_merges": False,
                "always_bos": False, "default_bos": True, "byte_encode": True, "escape_whitespaces": False,
                "whole_newlines": False}
SPM_OPTIONS = {**BPE_OPTIONS, "add_bos": True, "add_space_prefix": True, "clean_spaces": False,
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
    return split(PRE_TOKENIZERS[pre][0], text)
