"""Tokenizers built from GGUF metadata that give llama.cpp's token ids, token for token.

Three models, chosen by ``tokenizer.ggml.model``:

- ``llama``: SentencePiece-style. Spaces become U+2581, then adjacent symbols are merged by
  token score (llama.cpp's ``llm_tokenizer_spm``); characters no token covers fall back to
  ``<0xXX>`` byte tokens.
- ``gpt2``: BPE (llama.cpp's ``llm_tokenizer_bpe``). A pre-tokenizer chosen by
  ``tokenizer.ggml.pre`` cuts the text into words by a list of regexes (every name llama.cpp
  maps is supported, see ``ggraph.runtime.pretokenizer``), each word's UTF-8 bytes are mapped to printable
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

import codecs
import functools
import heapq
from array import array

import numpy as np

from ggraph.runtime.pretokenizer import BPE_OPTIONS, PRE_TOKENIZERS, SPM_OPTIONS, split

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
        opts = dict(SPM_OPTIONS if spm else BPE_OPTIONS)
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
        for word in split(self._regexes, text):
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
        from ggraph.runtime.chat_template import default_template, render
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
