"""``ggraph convert``: a Hugging Face model folder as one GGUF file, the way llama.cpp's
``convert_hf_to_gguf.py`` makes it, so that llama.cpp and ggraph both run the result.

    from ggraph.convert import convert
    convert("path/to/hf-model", "model-f16.gguf", outtype="f16")

The folder holds ``config.json``, whose ``architectures`` entry picks the family
(``families.py``: llama, qwen2, phi3, gemma2, gemma3), the weights as ``*.safetensors``
(``checkpoint.py``: one file, or shards and their index) and the tokenizer (``vocab.py``).

Output types: ``f32``, ``f16``, ``bf16`` and ``q8_0``. Only matrices take it: 1-D tensors (norms,
biases, rope factors) and every ``*_norm.weight`` stay f32, as llama.cpp keeps them, and a
q8_0 matrix whose rows are not whole 32-element blocks falls back to f16.

Nothing is converted up front: the header is written from the tensors' names, types and
shapes, then each tensor is read from the checkpoint's mmap, changed (families.py says how),
cast and written before the next, into ``OUT.partial``, which becomes ``OUT`` once complete.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ggraph.convert.checkpoint import Checkpoint
from ggraph.convert.families import FAMILIES, UNUSED_SUFFIXES, Family, HFConfig, family
from ggraph.convert.vocab import tokenizer_metadata
from ggraph.gguf import quants
from ggraph.gguf.writer import Deferred, write
from ggraph.quantize import FILE_TYPES, QUANTIZATION_VERSION
from ggraph.ir import dtypes
from ggraph.progress import Progress, warn

__all__ = ["FAMILIES", "OUTTYPES", "convert", "read_config"]

# --outtype -> (the matrices' type, llama.cpp's general.file_type)
OUTTYPES = {name: FILE_TYPES[name.upper()] for name in ("f32", "f16", "bf16", "q8_0")}   # --outtype -> file type


def convert(folder, out, outtype: str = "f16", *, name: str | None = None, tokenizer_pre: str | None = None) -> Path:
    """Convert the Hugging Face model in ``folder`` to the GGUF file ``out``; returns its path.

    ``name`` is ``general.name`` (default: the folder's name); ``tokenizer_pre`` names llama.cpp's
    BPE pre-tokenizer when the tokenizer.json's is not one convert recognises.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"unknown output type {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    folder, out = Path(folder), Path(out)
    cfg = read_config(folder)
    fam = family(cfg)
    arch_keys = fam.keys(cfg)                    # config.json's own errors first, then the checkpoint's
    with Checkpoint(folder) as ck:
        sources = tensor_sources(fam, cfg, ck)
        metadata = file_metadata(fam, arch_keys, cfg, folder, outtype, name, tokenizer_pre)
        with Progress(len(sources), f"convert {out.name}", " tensors") as bar:
            tensors = {gguf: _deferred(fam, cfg, ck, gguf, src, OUTTYPES[outtype].default, bar)
                       for gguf, src in sources.items()}
            write(out, metadata, tensors)
    return out


def read_config(folder: Path) -> HFConfig:
    """The folder's config.json (a text-model config nested as ``text_config`` is lifted up)."""
    path = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a directory (give a Hugging Face model folder)")
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (give a Hugging Face model folder)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return HFConfig(data | data.get("text_config", {}), path)


def file_metadata(fam: Family, arch_keys: dict, cfg: HFConfig, folder: Path, outtype: str, name: str | None,
                  tokenizer_pre: str | None) -> dict:
    """general.*, the family's <arch>.* keys (``arch_keys``, from ``fam.keys``) and the tokenizer's, in
    llama.cpp's order."""
    md = {"general.architecture": fam.arch, "general.type": "model", "general.name": name or folder.resolve().name}
    md |= {f"{fam.arch}.{k}": v for k, v in arch_keys.items()}
    md |= {"general.file_type": OUTTYPES[outtype].id, "general.quantization_version": QUANTIZATION_VERSION}
    return md | tokenizer_metadata(folder, cfg.n_vocab, cfg.data, tokenizer_pre)


def tensor_sources(fam: Family, cfg: HFConfig, ck: Checkpoint) -> dict:
    """GGUF name -> its source (a checkpoint tensor name, or an array made from config.json), in GGUF
    order, after checking that the checkpoint has every tensor config.json implies, each of that
    shape, and no other."""
    found = {}
    for hf in ck.tensors:
        if hf.endswith(UNUSED_SUFFIXES) or (hf == "lm_head.weight" and not fam.writes_lm_head):
            continue
        found[fam.gguf_name(hf)] = hf
    expected, optional = fam.expected(cfg), fam.optional(cfg)
    missing = [f"{fam.hf_name(n)} ({n})" for n in expected if n not in found]
    if missing:
        more = ", ..." if len(missing) > 3 else ""
        raise ValueError(f"{ck.folder}: the checkpoint has no {', '.join(missing[:3])}{more} ({len(missing)} "
                         f"missing; config.json implies them)")
    for gguf, hf in found.items():
        shape = expected.get(gguf, optional.get(gguf))
        if shape is None:
            raise ValueError(f"tensor {hf} ({gguf}) is not part of a {fam.hf_arch} with this config.json")
        if ck.tensors[hf].shape != shape:
            raise ValueError(f"tensor {hf} has shape {list(ck.tensors[hf].shape)}, but config.json "
                             f"(hidden_size, heads, head_dim, intermediate_size, vocab_size) implies {list(shape)}")
    ordered = fam.generated(cfg)
    return ordered | {n: found[n] for n in [*expected, *optional] if n in found}


def tensor_type(name: str, shape: tuple[int, ...], matrix_type: dtypes.DType) -> dtypes.DType:
    """llama.cpp's choice: 1-D tensors and norms stay f32; q8_0 falls back to f16 for ragged rows."""
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return dtypes.f32
    if shape[-1] % matrix_type.block_size:
        warn(f"convert: {name} has rows of {shape[-1]}, not a multiple of {matrix_type.name}'s "
             f"{matrix_type.block_size}: written as f16")
        return dtypes.f16
    return matrix_type


def _deferred(fam: Family, cfg: HFConfig, ck: Checkpoint, name: str, source, matrix_type, bar) -> Deferred:
    """The tensor ``name`` as the writer's Deferred: its type and shape now, its bytes when written."""
    shape = source.shape if isinstance(source, np.ndarray) else ck.tensors[source].shape
    dtype = tensor_type(name, shape, matrix_type)

    def produce() -> np.ndarray:
        x = source if isinstance(source, np.ndarray) else fam.transform(cfg, name, ck.read(source))
        raw = quants.quantize(x, dtype)
        bar.advance()
        return raw
    return Deferred(dtype, shape, produce)
