"""A Hugging Face folder's tokenizer as llama.cpp's ``tokenizer.*`` keys.

One of three kinds, chosen as llama.cpp's converter chooses for these families:

- ``tokenizer.json`` with a byte-level BPE (GPT-2, Llama 3, Qwen2, Phi-4): model ``gpt2``. The
  tokens by id, their types (added tokens are CONTROL when special, else USER_DEFINED), the
  merges, and ``tokenizer.ggml.pre``: the pre-tokenizer, recognised by the regex that splits
  words (``PRE_BY_REGEX``) or named with ``pre=``;
- ``tokenizer.model`` (SentencePiece, read from its protobuf bytes): model ``llama``, pre
  ``default``: every piece with its score and type, then the overrides of ``added_tokens.json``
  and of ``tokenizer_config.json``'s ``added_tokens_decoder``;
- ``tokenizer.json`` with a byte-fallback BPE (a SentencePiece model saved as JSON): model
  ``llama``. llama.cpp's SentencePiece tokenizer merges the adjacent pair whose joined token
  scores highest, so a token made by merge number r (the first that makes it) scores -(r + 1),
  which replays the JSON's merge order (llama.cpp's converter gives every token -1000).

The embedding may have more rows than the tokenizer has tokens: the ids past it become
``[PAD{id}]`` tokens of type UNUSED, so the token list always has one entry per row. Then the
special token ids (``tokenizer_config.json``'s ``bos_token`` etc. looked up among the added
tokens, else ``config.json``'s ``bos_token_id`` etc.), whether BOS/EOS are added (the JSON's
post-processor, else ``add_bos_token``), and the chat template (``tokenizer_config.json``,
``chat_template.jinja`` or ``chat_template.json``).
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from ggraph.gguf.writer import Typed
from ggraph.progress import warn
from ggraph.runtime.pretokenizer import PRE_TOKENIZERS

# llama.cpp's token types (the same numbers as SentencePiece's piece types)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# the regex of a tokenizer.json "Split" pre-tokenizer -> llama.cpp's pre-tokenizer name
PRE_BY_REGEX = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+": "qwen35",
}
GPT2_PRE = "gpt-2"          # a ByteLevel pre-tokenizer that splits with its own (GPT-2's) regex

# special token kind -> its llama.cpp key (sic: "seperator")
SPECIAL_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
                "sep": "seperator_token_id", "pad": "padding_token_id", "cls": "cls_token_id",
                "mask": "mask_token_id"}
PAD_SCORE = -10000.0        # the scores llama.cpp gives a [PAD{id}] filler
ADDED_SCORE = -1000.0       # and an added token


def tokenizer_metadata(folder, n_vocab: int, config: dict, pre: str | None = None) -> dict:
    """The ``tokenizer.*`` keys for the model in ``folder`` whose embedding has ``n_vocab`` rows."""
    folder = Path(folder)
    tj = _json(folder / "tokenizer.json") if (folder / "tokenizer.json").is_file() else None
    tc = _json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    if tj is not None and _is_byte_level(tj):
        md = _byte_level_bpe(tj, n_vocab, pre)
    elif (folder / "tokenizer.model").is_file():
        md = _sentencepiece(folder, n_vocab, tc)
    elif tj is not None:
        md = _byte_fallback_bpe(tj, n_vocab)
    else:
        raise FileNotFoundError(f"{folder}: no tokenizer.json or tokenizer.model")
    if pre is not None:
        _check_pre(pre, md["tokenizer.ggml.model"], folder)
    tokens = md["tokenizer.ggml.tokens"]
    md |= _special_ids(tj, tc, config, tokens)
    md |= _add_special(tj, tc)
    template = _chat_template(folder, tc)
    if template is not None:
        md["tokenizer.chat_template"] = template
    return md


def _check_pre(pre: str, model: str, folder: Path) -> None:
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"--tokenizer-pre {pre!r} is not a pre-tokenizer ggraph knows; known: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    if model != "gpt2":
        raise ValueError(f"--tokenizer-pre {pre!r} names a BPE pre-tokenizer, but {folder} has a SentencePiece "
                         f"tokenizer")


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None


# ---------------------------------------------------------------- byte-level BPE (tokenizer.json)

def _is_byte_level(tj: dict) -> bool:
    """True for a BPE whose pre-tokenizer or decoder maps bytes to printable characters (GPT-2's)."""
    if tj.get("model", {}).get("type") != "BPE":
        return False
    return any(p.get("type") == "ByteLevel" for p in _flat(tj.get("pre_tokenizer")) + _flat(tj.get("decoder")))


def _flat(node) -> list[dict]:
    """A normalizer / pre-tokenizer / decoder and the members of a Sequence of them, as a flat list."""
    if not isinstance(node, dict):
        return []
    members = node.get("pretokenizers") or node.get("normalizers") or node.get("decoders") or []
    return [m for member in members for m in _flat(member)] if node.get("type") == "Sequence" else [node]


def _byte_level_bpe(tj: dict, n_vocab: int, pre: str | None) -> dict:
    """tokenizer.* keys of a GPT-2-style BPE: tokens, their types, merges and the pre-tokenizer."""
    by_id, added = _vocab_by_id(tj, n_vocab)
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        text = by_id[i]
        tokens.append(text)
        types.append(NORMAL if i not in added else CONTROL if added[i] or _looks_special(text) else USER_DEFINED)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre or _pre_tokenizer(tj),
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": Typed(types, "i32"),
            "tokenizer.ggml.merges": _merges(tj)}


def _vocab_by_id(tj: dict, n_vocab: int) -> tuple[dict[int, str], dict[int, bool]]:
    """(id -> token text over the model's vocab and the added tokens, id -> special? for added tokens)."""
    vocab = tj.get("model", {}).get("vocab")
    if not isinstance(vocab, dict):
        raise ValueError("tokenizer.json: model.vocab must map token texts to ids")
    by_id = {int(i): text for text, i in vocab.items()}
    added = {}
    for tok in tj.get("added_tokens") or []:
        by_id[int(tok["id"])] = tok["content"]
        added[int(tok["id"])] = bool(tok.get("special"))
    over = sorted(i for i in by_id if not 0 <= i < n_vocab)
    if over:
        raise ValueError(f"tokenizer.json has token id {over[-1]} ({by_id[over[-1]]!r}), but the model's "
                         f"vocabulary (config.json vocab_size, the embedding's rows) is {n_vocab}")
    return by_id, added


def _looks_special(text: str) -> bool:
    """Added tokens some models forget to mark special (llama.cpp's does_token_look_special)."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _pre_tokenizer(tj: dict) -> str:
    """llama.cpp's name for the pre-tokenizer: GPT-2's own regex, or a Split regex PRE_BY_REGEX knows."""
    parts = _flat(tj.get("pre_tokenizer"))
    splits = [p for p in parts if p.get("type") == "Split"]
    if not splits and any(p.get("type") == "ByteLevel" and p.get("use_regex", True) for p in parts):
        return GPT2_PRE
    regexes = [p.get("pattern", {}).get("Regex") for p in splits]
    if len(regexes) == 1 and regexes[0] in PRE_BY_REGEX:
        return PRE_BY_REGEX[regexes[0]]
    raise ValueError(f"tokenizer.json: its pre-tokenizer (split by {regexes or [p.get('type') for p in parts]}) is "
                     f"not one ggraph recognises ({', '.join([GPT2_PRE, *PRE_BY_REGEX.values()])}); name "
                     f"llama.cpp's pre-tokenizer for it with --tokenizer-pre NAME")


def _merge_pairs(tj: dict) -> list[tuple[str, str]]:
    """The merges of a BPE tokenizer.json as (left, right): from "left right" strings, or from the pairs
    newer files write (which allow a space inside a part)."""
    merges = tj["model"].get("merges") or []
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]


def _merges(tj: dict) -> list[str]:
    """The merges as llama.cpp stores them, "left right", a space inside a part written as U+0120
    (the byte-level space)."""
    return [" ".join(part.replace(" ", "\u0120") for part in pair) for pair in _merge_pairs(tj)]


# ---------------------------------------------------------------- SentencePiece (tokenizer.model)

def _sentencepiece(folder: Path, n_vocab: int, tc: dict) -> dict:
    """tokenizer.* keys of a SentencePiece model: its pieces, then the added tokens HF lists."""
    path = folder / "tokenizer.model"
    pieces, add_prefix = read_sentencepiece(path)
    if len(pieces) > n_vocab:
        raise ValueError(f"{path} has {len(pieces)} pieces, but the model's vocabulary (config.json vocab_size, "
                         f"the embedding's rows) is {n_vocab}")
    tokens = [p[0] for p in pieces] + [f"[PAD{i}]" for i in range(len(pieces), n_vocab)]
    scores = [p[1] for p in pieces] + [PAD_SCORE] * (n_vocab - len(pieces))
    types = [p[2] for p in pieces] + [UNUSED] * (n_vocab - len(pieces))
    overrides = []
    if (folder / "added_tokens.json").is_file():
        overrides += [(int(i), text, USER_DEFINED) for text, i in _json(folder / "added_tokens.json").items()]
    for i, tok in (tc.get("added_tokens_decoder") or {}).items():
        text = tok["content"]
        special = tok.get("special") or _looks_special(text)
        if special:
            overrides.append((int(i), text, CONTROL))
        else:                                          # llama.cpp reads user-defined tokens with real spaces
            overrides.append((int(i), text.replace("\u2581", " "), USER_DEFINED))
    for i, text, kind in overrides:
        if not 0 <= i < n_vocab:
            warn(f"convert: added token {text!r} has id {i}, outside the vocabulary of {n_vocab}: skipped")
            continue
        tokens[i], scores[i], types[i] = text, ADDED_SCORE, kind
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": Typed(scores, "f32"), "tokenizer.ggml.token_type": Typed(types, "i32"),
            **_space_prefix(add_prefix)}


def read_sentencepiece(path) -> tuple[list[tuple[str, float, int]], bool]:
    """(pieces as (text, score, type), add_dummy_prefix) from a SentencePiece ``ModelProto`` file.

    The protobuf fields read: ModelProto 1 = repeated SentencePiece {1 piece, 2 score (f32),
    3 type (NORMAL=1 by default)}; ModelProto 3 = NormalizerSpec {3 add_dummy_prefix (true
    by default)}.
    """
    data = Path(path).read_bytes()
    pieces, add_prefix = [], True
    try:
        for field, value in _proto_fields(data):
            if field == 1:
                piece = dict(_proto_fields(value))
                score = struct.unpack("<f", piece[2])[0] if 2 in piece else 0.0
                pieces.append((piece.get(1, b"").decode("utf-8"), score, piece.get(3, NORMAL)))
            elif field == 3:
                add_prefix = bool(dict(_proto_fields(value)).get(3, 1))
    except (IndexError, TypeError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a SentencePiece model: {e}") from None
    if not pieces:
        raise ValueError(f"{path}: not a SentencePiece model (no pieces)")
    return pieces, add_prefix


def _proto_fields(buf: bytes):
    """(field number, value) of each field of one protobuf message: an int for a varint, bytes
    for a length-delimited field or a fixed 32/64-bit one."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {pos}")
        if pos > len(buf):
            raise ValueError(f"field {field} runs past the end of its message")
        yield field, value


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if b < 0x80:
            return value, pos


# ---------------------------------------------------------------- byte-fallback BPE (tokenizer.json)

def _byte_fallback_bpe(tj: dict, n_vocab: int) -> dict:
    """tokenizer.* keys of a SentencePiece-style BPE saved as JSON (``byte_fallback``, ``▁`` for spaces)."""
    model = tj.get("model", {})
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        kind = f"{model.get('type')} model" + (" without byte_fallback" if model.get("type") == "BPE" else "")
        raise ValueError(f"tokenizer.json: a {kind} is not supported (byte-level BPE, byte-fallback BPE and "
                         f"tokenizer.model are)")
    by_id, added = _vocab_by_id(tj, n_vocab)
    first_merge = {}                                   # token -> rank of the first merge that makes it
    for r, (left, right) in enumerate(_merge_pairs(tj)):
        first_merge.setdefault(left + right, r)
    tokens, scores, types = [], [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        tokens.append(f"[PAD{i}]" if text is None else text)
        scores.append(PAD_SCORE if text is None else ADDED_SCORE if i in added else
                      -float(first_merge[text] + 1) if text in first_merge else 0.0)
        types.append(_piece_type(text, added.get(i), model.get("unk_token")))
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": Typed(scores, "f32"), "tokenizer.ggml.token_type": Typed(types, "i32"),
            **_space_prefix(_prepends_space(tj))}


def _space_prefix(add: bool) -> dict:
    """tokenizer.ggml.add_space_prefix, written only when false: llama.cpp's converter leaves it out of a
    SentencePiece vocabulary and its readers (and ggraph's) take true then."""
    return {} if add else {"tokenizer.ggml.add_space_prefix": False}


def _piece_type(text: str | None, special: bool | None, unk: str | None) -> int:
    """The type of a byte-fallback BPE token; ``special`` is None for one that is not an added token."""
    if text is None:
        return UNUSED
    if special is not None:
        return CONTROL if special else USER_DEFINED
    return UNKNOWN if text == unk else BYTE if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text) else NORMAL


def _prepends_space(tj: dict) -> bool:
    """Whether the JSON puts a ``▁`` before the text: a Prepend normalizer, or a Metaspace pre-tokenizer
    that prepends."""
    if any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581" for n in _flat(tj.get("normalizer"))):
        return True
    return any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
               and p.get("add_prefix_space", True) for p in _flat(tj.get("pre_tokenizer")))


# ---------------------------------------------------------------- special tokens, chat template

def _special_ids(tj: dict | None, tc: dict, config: dict, tokens: list[str]) -> dict:
    """tokenizer.ggml.<kind>_token_id: tokenizer_config.json's token text, found among the added
    tokens (or the vocabulary), else config.json's ``<kind>_token_id``; ids outside the vocabulary
    are dropped with a warning."""
    added = {t["content"]: int(t["id"]) for t in reversed((tj or {}).get("added_tokens") or [])}
    out = {}
    for kind, key in SPECIAL_KEYS.items():
        entry = tc.get(f"{kind}_token")
        text = entry.get("content") if isinstance(entry, dict) else entry
        tid = added.get(text) if isinstance(text, str) else None
        if tid is None and isinstance(text, str) and text in tokens:
            tid = tokens.index(text)
        if tid is None:
            tid = config.get(f"{kind}_token_id")
        if isinstance(tid, bool) or not isinstance(tid, int):
            continue
        if not 0 <= tid < len(tokens):
            warn(f"convert: the {kind} token id {tid} is outside the vocabulary of {len(tokens)}: not written")
            continue
        out[f"tokenizer.ggml.{key}"] = tid
    return out


def _add_special(tj: dict | None, tc: dict) -> dict:
    """tokenizer.ggml.add_bos_token / add_eos_token: what the JSON's post-processor adds around a
    single sequence (a TemplateProcessing's first and last special tokens), else
    tokenizer_config.json's add_bos_token / add_eos_token."""
    out = {}
    for proc in _processors((tj or {}).get("post_processor")):
        if proc.get("type") == "ByteLevel":
            out.setdefault("bos", False)
            out.setdefault("eos", False)
        elif proc.get("type") == "TemplateProcessing":
            single = proc.get("single") or []
            out["bos"] = bool(single) and "SpecialToken" in single[0]
            out["eos"] = len(single) > 1 and "SpecialToken" in single[-1]
    for kind in ("bos", "eos"):
        if kind not in out and isinstance(tc.get(f"add_{kind}_token"), bool):
            out[kind] = tc[f"add_{kind}_token"]
    return {f"tokenizer.ggml.add_{kind}_token": value for kind, value in out.items()}


def _processors(node) -> list[dict]:
    if not isinstance(node, dict):
        return []
    return node.get("processors") or [] if node.get("type") == "Sequence" else [node]


def _chat_template(folder: Path, tc: dict) -> str | None:
    """The chat template: tokenizer_config.json's (a string, or the "default" of a named list), else
    chat_template.jinja, else chat_template.json's."""
    template = tc.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None and (folder / "chat_template.json").is_file():
        template = _json(folder / "chat_template.json").get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder}: the chat template must be a string, got {type(template).__name__}")
    return template
