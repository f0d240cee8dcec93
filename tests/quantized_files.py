"""Tiny llama-architecture GGUF files with random weights, quantised by llama.cpp itself.

``write_llama_f32`` writes an all-f32 model with real GGUF tensor names, and
``quantize_file`` runs llama.cpp's own ``llama_model_quantize`` on it, which gives the
per-tensor type mix that real Q4_K_M (etc.) files have. Tests that need real quantiser
output, not just random block bytes, use these two.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB_DIR = Path("/work/shared/vocab")

# llama.cpp's llama_ftype values for the file types tests use
FTYPES = {
    "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
    "Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18,
    "IQ4_NL": 25, "IQ4_XS": 30,
}


def _copy_tokenizer(writer, vocab_path: Path) -> int:
    """Copy every ``tokenizer.*`` key of ``vocab_path`` into ``writer``; returns the vocab size."""
    import gguf
    reader = gguf.GGUFReader(vocab_path)
    n_vocab = None
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            value = field.contents()
            writer.add_array(name, value)
            if name == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        else:
            writer.add_key_value(name, field.contents(), vtype)
    if n_vocab is None:
        raise ValueError(f"{vocab_path}: no tokenizer.ggml.tokens array")
    return n_vocab


def llama_tensor_shapes(n_vocab: int, n_embd: int, n_ff: int, n_layer: int,
                        n_head: int, n_head_kv: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (out, in) of a llama decoder."""
    kv = n_embd // n_head * n_head_kv
    shapes = {"token_embd.weight": (n_vocab, n_embd)}
    for i in range(n_layer):
        b = f"blk.{i}."
        shapes.update({
            b + "attn_norm.weight": (n_embd,),
            b + "attn_q.weight": (n_embd, n_embd),
            b + "attn_k.weight": (kv, n_embd),
            b + "attn_v.weight": (kv, n_embd),
            b + "attn_output.weight": (n_embd, n_embd),
            b + "ffn_norm.weight": (n_embd,),
            b + "ffn_gate.weight": (n_ff, n_embd),
            b + "ffn_up.weight": (n_ff, n_embd),
            b + "ffn_down.weight": (n_embd, n_ff),
        })
    shapes["output_norm.weight"] = (n_embd,)
    shapes["output.weight"] = (n_vocab, n_embd)
    return shapes


def write_llama_f32(path, *, n_embd: int = 256, n_ff: int = 512, n_layer: int = 2,
                    n_head: int = 4, n_head_kv: int = 2, n_vocab: int = 256,
                    vocab: str | None = None, seed: int = 0) -> Path:
    """Write an f32 llama GGUF with random weights; ``vocab`` names a file in VOCAB_DIR to copy."""
    import gguf
    path = Path(path)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("ggraph-test-llama")
    writer.add_file_type(0)  # ALL_F32
    if vocab is not None:
        n_vocab = _copy_tokenizer(writer, VOCAB_DIR / f"ggml-vocab-{vocab}.gguf")
    writer.add_vocab_size(n_vocab)
    writer.add_context_length(256)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_block_count(n_layer)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(seed)
    shapes = llama_tensor_shapes(n_vocab, n_embd, n_ff, n_layer, n_head, n_head_kv)
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            w = 1 + 0.1 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[-1])
        writer.add_tensor(name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantize_file(src, dst, ftype: str, nthread: int = 1) -> Path:
    """Quantise GGUF ``src`` to ``dst`` with llama.cpp; ``ftype`` is a key of FTYPES."""
    from zoo import llama_quantize
    if ftype not in FTYPES:
        raise ValueError(f"unknown ftype {ftype!r}; known: {', '.join(FTYPES)}")
    return llama_quantize(src, dst, FTYPES[ftype], what=f"{src} -> {ftype}", nthread=nthread)
