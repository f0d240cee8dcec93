"""``ggraph convert``: a Hugging Face model folder as one GGUF file, the way llama.cpp's
``convert_hf_to_gguf.py`` makes it, so that llama.cpp and ggraph both run the result.

    from ggraph.convert import convert
    convert("path/to/hf-model", "model-f16.gguf", outtype="f16")

The folder holds ``config.json``, whose ``architectures`` entry picks the family
(``families.py``: llama, qwen2, phi3, gemma2, gemma3, qwen3, olmo2, and with experts qwen3moe, olmoe,
qwen2moe and Mixtral), the weights as ``*.safetensors`` (``checkpoint.py``: one file, or shards and
their index) and the tokenizer (``vocab.py``).

A layer's experts become three stacked tensors ``ffn_{gate,up,down}_exps`` [E, rows, cols], as
llama.cpp's converter stacks them: from one matrix per expert (what transformers saves), or from the
fused ``experts.gate_up_proj`` [E, 2F, D] (gate rows first) and ``experts.down_proj`` [E, D, F].

Output types: ``f32``, ``f16``, ``bf16`` and ``q8_0``. Only matrices take it: 1-D tensors (norms,
biases, rope factors), every ``*_norm.weight`` and the routers (``ffn_gate_inp``, ``ffn_gate_inp_shexp``)
stay f32, as llama.cpp keeps them, and a q8_0 matrix whose rows are not whole 32-element blocks falls
back to f16.

Nothing is converted up front: the header is written from the tensors' names, types and
shapes, then each tensor is read from the checkpoint's mmap, changed (families.py says how),
cast and written before the next, into ``OUT.partial``, which becomes ``OUT`` once complete.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Stacked:
    """Experts' matrices (checkpoint tensor names, in expert order) stacked on a new first axis: [E, rows, cols]."""
    names: tuple[str, ...]


@dataclass(frozen=True)
class Half:
    """Half ``half`` (0: gate, 1: up) of the rows of a fused gate_up_proj [E, 2F, D]: [E, F, D]."""
    name: str
    half: int


def tensor_sources(fam: Family, cfg: HFConfig, ck: Checkpoint) -> dict:
    """GGUF name -> its source (a checkpoint tensor name, Stacked experts, a Half of a fused gate_up_proj,
    or an array made from config.json), in GGUF order, after checking that the checkpoint has every
    tensor config.json implies, each of that shape, and no other."""
    found: dict[str, dict] = {}                  # GGUF name -> {Piece: checkpoint name}
    for hf in ck.tensors:
        if hf.endswith(UNUSED_SUFFIXES) or (hf == "lm_head.weight" and not fam.writes_lm_head):
            continue
        for piece in fam.pieces(hf):
            found.setdefault(piece.name, {})[piece] = hf
    expected, optional = fam.expected(cfg), fam.optional(cfg)
    missing = [what for name in expected for what in _missing(fam, name, expected[name], found.get(name, {}))]
    if missing:
        more = ", ..." if len(missing) > 3 else ""
        raise ValueError(f"{ck.folder}: the checkpoint has no {', '.join(missing[:3])}{more} ({len(missing)} "
                         f"missing; config.json implies them)")
    sources = fam.generated(cfg)
    for gguf in [*expected, *optional]:
        if gguf in found:
            sources[gguf] = _source(fam, ck, gguf, expected.get(gguf, optional.get(gguf)), found.pop(gguf))
    for gguf, pieces in found.items():
        hf = next(iter(pieces.values()))
        raise ValueError(f"tensor {hf} ({gguf}) is not part of a {fam.hf_arch} with this config.json")
    return sources


def _missing(fam: Family, gguf: str, shape: tuple[int, ...], pieces: dict) -> list[str]:
    """The checkpoint tensors GGUF tensor ``gguf`` needs and ``pieces`` lacks, named as in the checkpoint."""
    if not pieces:
        if len(shape) == 3:                                   # an expert stack: name its experts
            return [f"{fam.hf_name(gguf, x)} (expert {x} of {gguf})" for x in range(shape[0])]
        return [f"{fam.hf_name(gguf)} ({gguf})"]
    experts = {p.expert for p in pieces if p.expert is not None}
    if not experts:
        return []
    return [f"{fam.hf_name(gguf, x)} (expert {x} of {gguf})" for x in range(shape[0]) if x not in experts]


def _source(fam: Family, ck: Checkpoint, gguf: str, shape: tuple[int, ...], pieces: dict):
    """The source of GGUF tensor ``gguf`` of numpy ``shape`` from its checkpoint ``pieces``, each checked."""
    if len(pieces) > 1 or next(iter(pieces)).expert is not None:       # one expert's matrix each
        names = {p.expert: hf for p, hf in pieces.items() if p.expert is not None}
        whole = [hf for p, hf in pieces.items() if p.expert is None]
        if whole:
            raise ValueError(f"tensor {whole[0]} ({gguf}) and the experts' {names[min(names)]} both give {gguf}")
        extra = [x for x in names if x >= shape[0]]
        if extra:
            raise ValueError(f"tensor {names[extra[0]]} is expert {extra[0]} of {gguf}, but config.json has "
                             f"{shape[0]} experts (num_local_experts or num_experts)")
        for x in range(shape[0]):
            _check_shape(ck, names[x], shape[1:], gguf)
        return Stacked(tuple(names[x] for x in range(shape[0])))
    (piece, hf), = pieces.items()
    if piece.half is not None:
        _check_shape(ck, hf, (shape[0], 2 * shape[1], shape[2]), gguf)
        return Half(hf, piece.half)
    _check_shape(ck, hf, shape, gguf)
    return hf


def _check_shape(ck: Checkpoint, hf: str, shape: tuple[int, ...], gguf: str) -> None:
    if ck.tensors[hf].shape != shape:
        why = ("experts, hidden_size, the experts' intermediate size" if "_exps." in gguf or "_inp" in gguf else
               "hidden_size, heads, head_dim, intermediate_size, vocab_size")
        raise ValueError(f"tensor {hf} has shape {list(ck.tensors[hf].shape)}, but config.json ({why}) implies "
                         f"{list(shape)}")


def source_shape(ck: Checkpoint, source) -> tuple[int, ...]:
    """The numpy shape of the tensor ``source`` gives (see ``tensor_sources``), read from no data."""
    if isinstance(source, np.ndarray):
        return source.shape
    if isinstance(source, Stacked):
        return (len(source.names), *ck.tensors[source.names[0]].shape)
    if isinstance(source, Half):
        e, rows, cols = ck.tensors[source.name].shape
        return (e, rows // 2, cols)
    return ck.tensors[source].shape


def read_source(fam: Family, cfg: HFConfig, ck: Checkpoint, name: str, source) -> np.ndarray:
    """The float32 data of GGUF tensor ``name`` from its ``source`` (see ``tensor_sources``)."""
    if isinstance(source, np.ndarray):
        return source
    if isinstance(source, Stacked):
        return np.stack([ck.read(hf) for hf in source.names])
    if isinstance(source, Half):
        x = ck.read(source.name)
        rows = x.shape[1] // 2
        return x[:, source.half * rows:(source.half + 1) * rows]
    return fam.transform(cfg, name, ck.read(source))


def tensor_type(name: str, shape: tuple[int, ...], matrix_type: dtypes.DType) -> dtypes.DType:
    """llama.cpp's choice: 1-D tensors, norms and routers stay f32; q8_0 falls back to f16 for ragged rows."""
    if len(shape) <= 1 or name.endswith(("_norm.weight", ".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight")):
        return dtypes.f32
    if shape[-1] % matrix_type.block_size:
        warn(f"convert: {name} has rows of {shape[-1]}, not a multiple of {matrix_type.name}'s "
             f"{matrix_type.block_size}: written as f16")
        return dtypes.f16
    return matrix_type


def _deferred(fam: Family, cfg: HFConfig, ck: Checkpoint, name: str, source, matrix_type, bar) -> Deferred:
    """The tensor ``name`` as the writer's Deferred: its type and shape now, its bytes when written."""
    shape = source_shape(ck, source)
    dtype = tensor_type(name, shape, matrix_type)

    def produce() -> np.ndarray:
        x = read_source(fam, cfg, ck, name, source)
        raw = quants.quantize(x, dtype)
        bar.advance()
        return raw
    return Deferred(dtype, shape, produce)
