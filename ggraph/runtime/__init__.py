"""Running models: sessions, tokenizers, chat templates and samplers.

    session.py        Session: a model, its KV cache, prefill/decode steps, generate() and chat()
    tokenizer.py      SentencePiece and byte-level BPE from GGUF metadata; Detokenizer for streams
    pretokenizer.py   llama.cpp's BPE pre-tokenizer regexes per tokenizer.ggml.pre, and the word splitter
    chat_template.py  sandboxed Jinja chat templates
    sampling.py       temperature, top-k, top-p, min-p and repeat-penalty sampling
"""
from ggraph.runtime.session import ContextFullError, Session

__all__ = ["ContextFullError", "Session"]
