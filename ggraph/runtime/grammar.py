"""Structured output: a JSON schema, "any JSON object", a GBNF grammar (llama.cpp's format) or a
Lark grammar, turned into a mask over the next token's logits.

    g = Grammar.json_schema(session.tokenizer, {"type": "object", "properties": {...}})
    text = session.generate(prompt, grammar=g, max_tokens=256)      # parses and validates

The grammar engine is llguidance (the one llama.cpp links for its ``%llguidance`` grammars):
it computes the set of allowed tokens for a state in tens of microseconds from a token trie,
handles JSON Schema (with string lengths, enums, numbers' ranges, required properties) and
Lark-style context-free grammars, and converts GBNF, so no grammar compiler of our own is
needed. It sees our tokenizer through its wrapper protocol: every token's bytes (control
tokens marked with a 0xff prefix, as its llama.cpp bridge does) and our encoder.
"""
from __future__ import annotations

import json

import numpy as np

from ggraph.runtime.tokenizer import CONTROL, USER_DEFINED

NEEDS = "structured output needs llguidance: pip install llguidance"


class GrammarError(ValueError):
    """A grammar or schema that does not compile, or output that left it."""


def _llguidance():
    try:
        import llguidance
    except ImportError as e:
        raise GrammarError(NEEDS) from e
    return llguidance


class _Vocab:
    """What llguidance's TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids)
        self.bos_token_id = tok.bos_id
        self.tokens = []
        for i in range(tok.n_vocab):
            piece, attr = tok.piece_bytes(i), tok.token_attr(i)
            if attr & CONTROL or attr & USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">"):
                piece = b"\xff" + piece
            self.tokens.append(piece)
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t.startswith(b"\xff")]

    def __call__(self, text: bytes) -> list[int]:
        return self.tok.encode(text.decode("utf-8", errors="replace"), add_special=False, parse_special=False,
                               space_prefix=False)             # its tokens' bytes must be the text's


def _lltokenizer(tok):
    """llguidance's view of ``tok``, built once per tokenizer (about a second for 256k tokens)."""
    cached = getattr(tok, "_llguidance", None)
    if cached is None:
        llg = _llguidance()
        cached = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tok)), n_vocab=tok.n_vocab,
                                 eos_token=sorted(tok.eog_ids) or None)
        tok._llguidance = cached
    return cached


class Grammar:
    """A constraint compiled for one tokenizer; ``matcher()`` starts a generation's state."""

    def __init__(self, tokenizer, grammar: str, what: str):
        llg = _llguidance()
        self.tokenizer, self.what = tokenizer, what
        self._lltok = _lltokenizer(tokenizer)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self._lltok)
        if is_error:
            raise GrammarError(f"{what}: {messages[0]}")
        self._grammar = grammar

    @classmethod
    def json_schema(cls, tokenizer, schema) -> "Grammar":
        """Output that is one JSON value valid under ``schema`` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        llg = _llguidance()
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        except ValueError as e:
            raise GrammarError(f"JSON schema: {e}") from e
        return cls(tokenizer, grammar, "JSON schema")

    @classmethod
    def json_object(cls, tokenizer) -> "Grammar":
        """Output that is one JSON object (OpenAI's response_format json_object)."""
        return cls.json_schema(tokenizer, {"type": "object"})

    @classmethod
    def gbnf(cls, tokenizer, text: str) -> "Grammar":
        """A GBNF grammar, as llama.cpp's --grammar takes (its start rule is ``root``)."""
        llg = _llguidance()
        try:
            from llguidance.gbnf_to_lark import gbnf_to_lark
            lark = gbnf_to_lark(text)
        except Exception as e:                   # its converter raises plain exceptions on bad input
            raise GrammarError(f"GBNF grammar: {e}") from e
        return cls(tokenizer, llg.LLMatcher.grammar_from_lark(lark), "GBNF grammar")

    def matcher(self) -> "Matcher":
        return Matcher(self)


class Matcher:
    """One generation's place in a grammar: masks logits, then takes the sampled token."""

    def __init__(self, grammar: Grammar):
        llg = _llguidance()
        self.grammar = grammar
        self._m = llg.LLMatcher(grammar._lltok, grammar._grammar, log_level=0)
        self._check()
        self._n = grammar.tokenizer.n_vocab

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"{self.grammar.what}: {self._m.get_error()}")

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` (V,) with the tokens the grammar forbids at -inf."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        self._check()
        allowed = np.unpackbits(bits, bitorder="little")[:self._n].astype(bool)
        if not allowed.any():
            raise GrammarError(f"{self.grammar.what}: no token can continue the output")
        out = np.array(logits, dtype=np.float32, copy=True)
        out[~allowed[:out.shape[0]]] = -np.inf
        return out

    def accept(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            self._check()
            raise GrammarError(f"{self.grammar.what}: token {token} does not continue the output")

    @property
    def done(self) -> bool:
        """The grammar is complete: only an end-of-generation token may follow."""
        return self._m.is_stopped()
