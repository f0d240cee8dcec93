"""llama.cpp (through llama-cpp-python) as the reference: logits, greedy tokens, tokenisation.

Every call skips the calling test when llama-cpp-python is not installed. Llama objects are
cached per (file, n_ctx, kv type) within a process, and reset before each use.

The context is built with flash attention off (llama-cpp-python's default) and, unless
``cache=`` names other types (K, V), an f32 KV cache: llama.cpp's own default stores K and V
as f16, which rounds every cached key and value and would blur the comparison with an f32
implementation. Quantised V caches need ``flash_attn=True`` in llama.cpp.
"""
from __future__ import annotations

import atexit
import ctypes
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}
F32 = ("f32", "f32")


def _llama_cpp():
    """The llama_cpp module, or skip the calling test."""
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is the oracle")


def model(path, n_ctx: int = 512, cache: tuple[str, str] = F32, flash_attn: bool = False):
    """A reset ``llama_cpp.Llama`` for ``path`` with logits kept at every position."""
    _llama_cpp()
    p = Path(path).resolve()
    if not p.is_file():
        raise FileNotFoundError(f"oracle: no model file at {p}")
    llm = _load(str(p), p.stat().st_mtime_ns, n_ctx, tuple(cache), flash_attn)
    llm.reset()
    return llm


@lru_cache(maxsize=4)
def _load(path: str, mtime_ns: int, n_ctx: int, cache: tuple[str, str], flash_attn: bool):
    """Load once per file version and context settings (mtime in the key: rewritten files reload)."""
    from llama_cpp import Llama
    return Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                 n_threads=2, n_threads_batch=2, flash_attn=flash_attn, type_k=GGML_TYPES[cache[0]],
                 type_v=GGML_TYPES[cache[1]],
                 verbose=False)


def _close_all() -> None:
    """Free cached Llama objects before interpreter teardown (their __del__ fails after it)."""
    _load.cache_clear()
    _vocab.cache_clear()


def llama_logits(path, tokens, n_ctx: int = 512, cache: tuple[str, str] = F32, flash_attn: bool = False) -> np.ndarray:
    """Logits at every position from one llama.cpp prefill of ``tokens``: f32 [T, n_vocab]."""
    tokens = [int(t) for t in tokens]
    if not 0 < len(tokens) <= n_ctx:
        raise ValueError(f"oracle: {len(tokens)} tokens do not fit one prefill of n_ctx={n_ctx}")
    llm = model(path, n_ctx, cache, flash_attn)
    llm.eval(tokens)
    return np.array(llm.scores[:len(tokens)], dtype=np.float32)  # copy: the buffer is reused


def llama_logits_stepwise(path, tokens, n_ctx: int = 512, cache: tuple[str, str] = F32) -> np.ndarray:
    """Logits at every position from llama.cpp decoding ``tokens`` one at a time against its KV cache
    (its token-by-token run, beside ``llama_logits``' one prefill): f32 [T, n_vocab]."""
    tokens = [int(t) for t in tokens]
    if not 0 < len(tokens) <= n_ctx:
        raise ValueError(f"oracle: {len(tokens)} tokens do not fit n_ctx={n_ctx}")
    llm = model(path, n_ctx, cache)
    rows = []
    for tok in tokens:
        llm.eval([tok])
        rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
    return np.stack(rows)


def llama_greedy(path, prompt_tokens, n: int, n_ctx: int = 512, cache: tuple[str, str] = F32) -> list[int]:
    """``n`` tokens of greedy (temperature 0) decoding after a prefill of ``prompt_tokens``."""
    prompt = [int(t) for t in prompt_tokens]
    if not prompt or len(prompt) + n > n_ctx:
        raise ValueError(f"oracle: prompt of {len(prompt)} + {n} new tokens does not fit n_ctx={n_ctx}")
    llm = model(path, n_ctx, cache)
    llm.eval(prompt)
    out = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # first index on ties
        out.append(tok)
        llm.eval([tok])  # one decode step against the KV cache
    return out


def llama_decided(path, prompt_tokens, greedy: list[int], n_ctx: int = 512, margin: float = 0.25) -> int:
    """How many of llama.cpp's ``greedy`` tokens it is sure of: the length of the prefix before the first
    step where its own prefill over the same tokens puts the runner-up within ``margin`` of the top
    logit, or picks another token than its decode did (llama.cpp's batch and decode kernels round
    differently, so past such a near-tie greedy text is chaos, not a reference). The margin is what
    two correct programs disagree by on Gemma 3 270M's top-2 gap: ggraph's numpy reference and
    llama.cpp differ there by up to 0.23 on the prompts of its tests (and by about 1 at the largest
    logit), and the AVX-512 VNNI kernels by 0.23 too, on a token llama.cpp leads by 0.19."""
    seq = [int(t) for t in prompt_tokens] + [int(t) for t in greedy]
    logits = llama_logits(path, seq, n_ctx)
    for i, tok in enumerate(greedy):
        row = logits[len(prompt_tokens) - 1 + i]
        top2 = np.sort(row)[-2:]
        if int(np.argmax(row)) != tok or top2[1] - top2[0] < margin:
            return i
    return len(greedy)


def decided(logits: np.ndarray, margin: float = 0.25) -> np.ndarray:
    """The rows of llama.cpp's ``logits`` whose top token leads the runner-up by at least ``margin``
    (see ``llama_decided``): where another correct program must pick the same token."""
    top2 = np.sort(logits, axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0] >= margin


def llama_logits_at(path, tokens, at, n_ctx: int, n_ubatch: int = 512, cache: tuple[str, str] = F32,
                    flash_attn: bool = False, swa_full: bool = True) -> np.ndarray:
    """llama.cpp's logits at positions ``at`` only, from one prefill of ``tokens`` in batches of
    ``n_ubatch``: f32 [len(at), n_vocab]. For long contexts, where keeping every position's logits
    (``llama_logits``) would take n_ctx x n_vocab floats and one ubatch of n_ctx tokens a
    n_ctx x n_ctx score matrix per head. ``swa_full=False`` keeps only a window's worth of keys for
    sliding-window layers (llama.cpp's small SWA cache): another code path than ggraph's full-size
    cache, and far cheaper at 32k."""
    llama_cpp = _llama_cpp()
    from llama_cpp import Llama
    tokens, at = [int(t) for t in tokens], [int(p) for p in at]
    if not 0 < len(tokens) <= n_ctx:
        raise ValueError(f"oracle: {len(tokens)} tokens do not fit n_ctx={n_ctx}")
    if not at or not all(0 <= p < len(tokens) for p in at):
        raise ValueError(f"oracle: positions {at} are not all in 0..{len(tokens) - 1}")
    llm = Llama(model_path=str(Path(path).resolve()), n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch,
                logits_all=False, n_threads=2, n_threads_batch=2, flash_attn=flash_attn, swa_full=swa_full,
                type_k=GGML_TYPES[cache[0]], type_v=GGML_TYPES[cache[1]], verbose=False)
    batch = llama_cpp.llama_batch_init(n_ubatch, 0, 1)
    want, rows = set(at), {}
    try:
        for start in range(0, len(tokens), n_ubatch):
            part = tokens[start:start + n_ubatch]
            for j, tok in enumerate(part):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, start + j, 1
                batch.seq_id[j][0], batch.logits[j] = 0, start + j in want
            batch.n_tokens = len(part)
            if (rc := llama_cpp.llama_decode(llm.ctx, batch)) != 0:
                raise RuntimeError(f"oracle: llama_decode returned {rc} at position {start}")
            for j in range(len(part)):
                if start + j in want:
                    row = llama_cpp.llama_get_logits_ith(llm.ctx, j)
                    rows[start + j] = np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy()
    finally:
        llama_cpp.llama_batch_free(batch)
        llm.close()
    return np.stack([rows[p] for p in at]).astype(np.float32)


class _Tensor(ctypes.Structure):
    """The head of ggml's ``struct ggml_tensor`` (ggml.h; GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64,
    GGML_MAX_SRC 10, GGML_MAX_NAME 64), up to its name."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


def llama_tensors(path, tokens, names: set[str], n_ctx: int = 512) -> dict[str, list[np.ndarray]]:
    """llama.cpp's intermediate f32 tensors named ``names`` (as its graph names them: "attn_norm-0",
    "Qcur-0", ...) from one prefill of ``tokens`` with an f32 KV cache and flash attention off, read
    through its eval callback: per name, every tensor of that name in graph order (a name may be
    reused, e.g. Qcur-0 before and after rope), in ggml's axis order reversed (numpy's)."""
    llama_cpp = _llama_cpp()
    tokens = [int(t) for t in tokens]
    got: dict[str, list[np.ndarray]] = {}

    @llama_cpp.ggml_backend_sched_eval_callback
    def record(tensor, ask, _user):
        t = _Tensor.from_address(tensor)
        name = t.name.decode()
        if not ask and name in names and t.type == 0:                       # GGML_TYPE_F32
            ne, nb = list(t.ne), list(t.nb)
            span = sum((n - 1) * b for n, b in zip(ne, nb)) + 4
            flat = np.frombuffer((ctypes.c_char * span).from_address(t.data), np.float32)
            got.setdefault(name, []).append(
                np.lib.stride_tricks.as_strided(flat, shape=ne[::-1], strides=nb[::-1]).copy())
        return True

    mparams = llama_cpp.llama_model_default_params()
    mdl = llama_cpp.llama_model_load_from_file(str(Path(path).resolve()).encode(), mparams)
    if not mdl:
        raise RuntimeError(f"oracle: llama.cpp could not load {path}")
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_ctx
    cparams.n_threads = cparams.n_threads_batch = 2
    cparams.type_k = cparams.type_v = GGML_TYPES["f32"]
    cparams.flash_attn_type = 0                                               # off
    cparams.cb_eval = record
    ctx = llama_cpp.llama_init_from_model(mdl, cparams)
    try:
        ids = (llama_cpp.llama_token * len(tokens))(*tokens)
        if (rc := llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(ids, len(tokens)))) != 0:
            raise RuntimeError(f"oracle: llama_decode returned {rc}")
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(mdl)
    return got


def llama_tokenize(path, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
    """llama.cpp's tokenisation of ``text`` with the model's own tokenizer."""
    p = Path(path).resolve()
    vocab = _vocab(str(p), p.stat().st_mtime_ns)
    return list(vocab.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))


@lru_cache(maxsize=4)
def _vocab(path: str, mtime_ns: int):
    """A vocab-only Llama: tokenises without loading weights (also works on vocab files)."""
    _llama_cpp()
    from llama_cpp import Llama
    return Llama(model_path=path, vocab_only=True, verbose=False)


atexit.register(_close_all)
