"""Quantise a GGUF model as ``llama-quantize`` does: the same tensor types, the same bytes.

    quantize_file("model-f16.gguf", "model-q4_k_m.gguf", "Q4_K_M", imatrix=load("imatrix.gguf"))

A *file type* (llama.cpp's ``llama_ftype``: Q4_K_M, Q5_K_S, IQ4_XS, ...) names a default block type
and a *mix*: rules that give some tensors more bits than the default, by their role (attention V,
FFN down, output), their layer and the model's shape. ``plan`` applies the rules in
llama.cpp's order (tensors sorted by layer, then name; the counters of attention-V and FFN tensors
advance as it goes), and a row length that is not a whole number of the chosen type's blocks falls
back to a 32-wide type (Q4_K -> Q5_0, Q6_K -> Q8_0, ...). The block quantisers themselves are
``ggraph.gguf.quants.quantize``, bit-exact with ggml's, with the importance matrix when one is given.

Mixture-of-experts files (``{arch}.expert_count`` > 1) follow llama.cpp's expert rules: the FFN
rules read the layer from the tensor's name (``blk.N.``), not from a counter, so that a layer's
stacked experts ``ffn_*_exps`` [E, N, K] and shared expert ``ffn_*_shexp`` get the same step;
with exactly 8 experts attention K and V are q8_0 and attention output q5_k in the low-bit mixes.
A stacked tensor is quantised as E matrices of N rows, each expert's rows weighted by its own
slice of the importance matrix (an imatrix entry of E·K values). MXFP4_MOE gives the stacked
experts mxfp4 blocks and every other matrix q8_0.

The output keeps the input's metadata in order, with ``general.quantization_version`` and
``general.file_type`` moved to the end (llama.cpp sets them by removing and appending), the split
keys dropped, and llama-quantize's ``quantize.imatrix.*`` keys appended when an imatrix was used.
Tensor infos keep the dims ggml counts (``ggml_n_dims``): a [1, N] tensor (qwen2moe's shared-expert
gate) is written as [N], as llama-quantize writes it.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from ggraph.gguf import Deferred, GGUFFile, Typed, quants, typed_metadata, write
from ggraph.gguf.format import ggml_dims
from ggraph.ir import dtypes
from ggraph.ir.dtypes import DType
from ggraph.progress import Progress

QUANTIZATION_VERSION = 2     # GGML_QNT_VERSION


@dataclass(frozen=True)
class FileType:
    """One of llama.cpp's file types: its name, its ``general.file_type`` id and its default block type."""
    name: str
    id: int
    default: DType
    about: str


def _ft(name, id_, default, about):
    return FileType(name, id_, dtypes.from_name(default), about)


# llama-quantize's names, in its own order, for the block types ggraph reads
FILE_TYPES: dict[str, FileType] = {ft.name: ft for ft in (
    _ft("Q4_0", 2, "q4_0", "q4_0 (4.5 bpw)"),
    _ft("Q4_1", 3, "q4_1", "q4_1 (5.0 bpw)"),
    _ft("Q5_0", 8, "q5_0", "q5_0 (5.5 bpw)"),
    _ft("Q5_1", 9, "q5_1", "q5_1 (6.0 bpw)"),
    _ft("Q2_K", 10, "q2_k", "q2_k (2.63 bpw); attn_v q3_k/q4_k, ffn_down and attn_output q3_k"),
    _ft("Q2_K_S", 21, "q2_k", "q2_k; attn_v q4_k at GQA >= 4, first ffn_down q4_k; needs an imatrix"),
    _ft("Q3_K_S", 11, "q3_k", "q3_k (3.44 bpw)"),
    _ft("Q3_K_M", 12, "q3_k", "q3_k; attn_v and ffn_down q4_k/q5_k, attn_output q4_k"),
    _ft("Q3_K_L", 13, "q3_k", "q3_k; attn_v, ffn_down and attn_output q5_k"),
    _ft("IQ4_NL", 25, "iq4_nl", "iq4_nl (4.5 bpw, non-linear levels); attn_v q5_k at GQA >= 4"),
    _ft("IQ4_XS", 30, "iq4_xs", "iq4_xs (4.25 bpw, non-linear levels); attn_v q5_k at GQA >= 4"),
    _ft("Q4_K_S", 14, "q4_k", "q4_k (4.5 bpw); first attn_v and ffn_down q5_k"),
    _ft("Q4_K_M", 15, "q4_k", "q4_k; about half of attn_v and ffn_down q6_k (the usual choice)"),
    _ft("Q5_K_S", 16, "q5_k", "q5_k (5.5 bpw)"),
    _ft("Q5_K_M", 17, "q5_k", "q5_k; about half of attn_v and ffn_down q6_k"),
    _ft("Q6_K", 18, "q6_k", "q6_k (6.56 bpw)"),
    _ft("Q8_0", 7, "q8_0", "q8_0 (8.5 bpw)"),
    _ft("MXFP4_MOE", 38, "mxfp4", "stacked experts mxfp4 (4.25 bpw), every other matrix q8_0"),
    _ft("F16", 1, "f16", "f16"),
    _ft("BF16", 32, "bf16", "bf16"),
    _ft("F32", 0, "f32", "f32"),
)}
FILE_TYPE_NAMES = {ft.id: ft.name for ft in FILE_TYPES.values()}    # general.file_type -> name
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
# llama.cpp's file types whose block types ggraph cannot read (so cannot check or run)
FOREIGN = ("Q1_0", "Q2_0", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "TQ1_0",
           "TQ2_0", "IQ3_XXS", "IQ3_S", "IQ3_M", "IQ3_XS", "COPY")


# the types a tensor of a quantised file may be given (--output-tensor-type, --token-embedding-type): every
# file type's default, not the activation-only q8_1 and q8_k nor integer types
TENSOR_TYPES = tuple(dict.fromkeys(ft.default for ft in FILE_TYPES.values()))


def tensor_type(name, what: str = "") -> DType:
    """The TENSOR_TYPES entry called ``name`` (any case); a ValueError (naming ``what``) lists them."""
    t = {t.name: t for t in TENSOR_TYPES}.get(str(getattr(name, "name", name)).lower())
    if t is None:
        where = f"{what}: " if what else ""
        raise ValueError(f"{where}{name!r} is not a type quantize gives a tensor; choose one of "
                         f"{', '.join(t.name for t in TENSOR_TYPES)}")
    return t


def file_type(name: str) -> FileType:
    """The file type called ``name`` (any case, llama.cpp's aliases too); ValueError listing the known ones."""
    key = str(name).upper()
    key = ALIASES.get(key, key)
    if key in FILE_TYPES:
        return FILE_TYPES[key]
    if key in FOREIGN:
        raise ValueError(f"quantize: {key} is a llama.cpp type ggraph does not implement; "
                         f"choose one of {', '.join(FILE_TYPES)}")
    raise ValueError(f"quantize: unknown type {name!r}; choose one of {', '.join(FILE_TYPES)} "
                     f"(aliases: {', '.join(f'{a}={b}' for a, b in ALIASES.items())})")


# ---------------------------------------------------------------- which tensors are quantised

# substrings of names llama.cpp never quantises (norms, gates, position tables, small 2-D weights)
_KEEP = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
         "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
         "indexer.q_proj.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
         "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
         *(f"time_mix_{w}.weight" for w in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2",
                                            "g1", "g2", "decay_w1", "decay_w2", "lerp_fused")))
_EXACT_KEEP = ("position_embd.weight", "token_types.weight")


def _quantizable(name: str, shape: tuple[int, ...], quantize_output: bool) -> bool:
    """llama.cpp's tensor_allows_quantization for a dense model."""
    if len(ggml_dims(shape)) < 2 or not name.endswith("weight") or name in _EXACT_KEEP:
        return False
    if name == "output.weight" and not quantize_output:
        return False
    return not any(k in name for k in _KEEP)


def _category(name: str) -> str:
    """The role llama.cpp's mix rules key on, from the tensor name alone."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for cat in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight", "attn_k.weight", "attn_q.weight",
                "attn_output.weight", "ffn_up", "ffn_gate", "ffn_down"):
        if cat in name:
            return cat.removesuffix(".weight")
    return "other"


_ATTN_V = ("attn_v", "attn_qkv", "attn_kv_b")
_LAYER = re.compile(r"blk\.(-?\d+)\.")


def _layer_order(name: str) -> tuple[int, bytes]:
    """llama.cpp's tensor order: by the ``blk.N.`` number (none sorts first), then by name bytes."""
    m = _LAYER.match(name)
    return (int(m[1]) if m else -1), name.encode()


# ---------------------------------------------------------------- the mix rules

@dataclass
class _Model:
    """What llama.cpp's mix rules read off the model, and the counters they advance."""
    arch: str
    n_layer: int
    n_gqa: int
    n_expert: int
    is_70b: bool
    tied: bool
    has_imatrix: bool
    n_attn_v: int
    i_attn_v: int = 0
    i_ffn: dict = field(default_factory=lambda: {"ffn_down": 0, "ffn_gate": 0, "ffn_up": 0})
    fallbacks: list = field(default_factory=list)

    def ffn_layer(self, cat: str, name: str) -> int:
        """The layer an FFN rule sees: the tensor's place among its kind (dense), or with experts the
        ``blk.N.`` of its name (llama.cpp's layer_info: a layer's experts and shared expert are one step);
        advances the kind's counter either way."""
        i = self.i_ffn[cat]
        self.i_ffn[cat] += 1
        if self.n_expert <= 1:
            return i
        m = _LAYER.match(name)
        if m is None:
            raise ValueError(f"quantize: cannot tell the layer of tensor '{name}' (no blk.N. prefix) in a model "
                             f"with {self.n_expert} experts")
        i = int(m[1])
        if not 0 <= i < self.n_layer:
            raise ValueError(f"quantize: tensor '{name}' is in layer {i}, outside the model's {self.n_layer} layers")
        return i


def _model(f: GGUFFile, names, has_imatrix: bool) -> _Model:
    md, arch = f.metadata, f.architecture or ""

    def hparam(key, default=None):
        v = md.get(f"{arch}.{key}", default)
        if v is not None and not isinstance(v, (int, float)):
            v = v[0] if len(v) else default    # per-layer arrays: llama.cpp's n_gqa reads layer 0
        return v

    n_layer = hparam("block_count")
    n_head = hparam("attention.head_count", 0) or 0
    n_head_kv = hparam("attention.head_count_kv", n_head) or 0
    n_expert = hparam("expert_count", 0) or 0
    if not isinstance(n_layer, int) or n_layer <= 0:
        raise ValueError(f"quantize: {f.path}: {arch}.block_count is missing or not a positive integer")
    if not isinstance(n_expert, int) or n_expert < 0:
        raise ValueError(f"quantize: {f.path}: {arch}.expert_count is not a whole number: {n_expert!r}")
    from ggraph.models.config import check_layers
    check_layers(arch, n_layer, names, shared_decoder=False)   # the mix counts layers: a lying count moves it
    # llama.cpp's LLM_TYPE_70B: 80 layers of qwen2, or of a llama with GQA (and not 8 experts: 8x7B, 8x22B)
    is_70b = n_layer == 80 and (arch == "qwen2" or (arch == "llama" and n_head != n_head_kv and n_expert != 8))
    return _Model(arch=arch, n_layer=n_layer, n_gqa=n_head // n_head_kv if n_head_kv else 0, n_expert=n_expert,
                  is_70b=is_70b, tied="output.weight" not in names, has_imatrix=has_imatrix,
                  n_attn_v=sum(_category(n) in _ATTN_V for n in names))


def _use_more_bits(i: int, n: int) -> bool:
    """The layers llama.cpp gives an extra step of precision: the first and last eighth, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# the low-bit file types whose attention output llama.cpp raises to q5_k in a model of 8 experts
_ATTN_OUTPUT_8_EXPERTS = ("Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ4_XS")


def _mix(m: _Model, ft: str, cat: str, t: DType, name: str, shape: tuple) -> DType:
    """llama_tensor_get_type_impl: the type of one tensor under file type ``ft``."""
    q, ncols = dtypes, shape[-1]
    if cat == "output" or (m.tied and cat == "token_embd"):
        if ft == "MXFP4_MOE" or m.arch == "falcon" or ncols % t.block_size:
            return q.q8_0
        return t if t is q.q8_0 else q.q6_k
    if ft == "MXFP4_MOE":                           # stacked experts [E > 1, N, K] mxfp4, the rest q8_0
        return q.mxfp4 if len(shape) >= 3 and shape[-3] > 1 else q.q8_0
    if cat == "token_embd":
        return t
    if cat in _ATTN_V:
        i, n = m.i_attn_v, m.n_attn_v
        m.i_attn_v += 1
        if ft == "Q2_K":
            t = q.q4_k if m.n_gqa >= 4 else q.q3_k
        elif ft == "Q2_K_S" and m.n_gqa >= 4:
            t = q.q4_k
        elif ft == "Q3_K_M":
            t = q.q5_k if i < 2 else q.q4_k
        elif ft == "Q3_K_L":
            t = q.q5_k
        elif ft in ("IQ4_NL", "IQ4_XS") and m.n_gqa >= 4:
            t = q.q5_k
        elif ft in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, n):
            t = q.q6_k
        elif ft == "Q4_K_S" and i < 4:
            t = q.q5_k
        if m.is_70b and t in (q.q3_k, q.q4_k):
            t = q.q5_k
        return q.q8_0 if m.n_expert == 8 else t     # "for the 8-expert model, bumping this to Q8_0 trades ~128MB"
    if cat == "attn_k":
        return q.q8_0 if m.n_expert == 8 else t
    if cat == "ffn_down":
        i, n = m.ffn_layer(cat, name), m.n_layer
        falcon = m.arch == "falcon"
        if ft == "Q2_K":
            t = q.q3_k
        elif ft == "Q2_K_S":
            t = q.q4_k if i < n // 8 else t
        elif ft == "Q3_K_M":
            t = q.q5_k if i < n // 16 else q.q4_k if not falcon or _use_more_bits(i, n) else q.q3_k
        elif ft == "Q3_K_L":
            t = q.q4_k if falcon else q.q5_k
        elif ft == "Q4_K_M":
            if falcon:
                t = q.q6_k if i < n // 16 else q.q5_k if _use_more_bits(i, n) else q.q4_k
            elif _use_more_bits(i, n):
                t = q.q6_k
        elif i < n // 8 and ft in ("IQ4_NL", "IQ4_XS") and not m.has_imatrix:
            t = q.q5_k
        elif ft == "Q5_K_M" and _use_more_bits(i, n):
            t = q.q6_k
        elif ft == "Q4_K_S" and not falcon and i < n // 8:
            t = q.q5_k
        elif ft in ("Q4_0", "Q5_0") and m.has_imatrix and i < n // 8:
            t = q.q4_1 if ft == "Q4_0" else q.q5_1
        return t
    if cat == "attn_output":
        if m.arch == "falcon":
            return q.q4_k if ft == "Q3_K_L" else t
        if m.n_expert == 8:
            return q.q5_k if ft in _ATTN_OUTPUT_8_EXPERTS else t
        return {"Q2_K": q.q3_k, "Q3_K_M": q.q4_k, "Q3_K_L": q.q5_k}.get(ft, t)
    if cat in ("ffn_gate", "ffn_up"):
        m.ffn_layer(cat, name)                      # no rule of a type ggraph makes reads it; the name is checked
    return t


# a type whose blocks do not divide the rows falls back to a 32-wide one
_FALLBACK = {"iq4_xs": "iq4_nl", "q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def _fallback(m: _Model, name: str, t: DType, ncols: int) -> DType:
    if ncols % t.block_size == 0:
        return t
    if t.block_size > 32 and t.name not in _FALLBACK:
        raise ValueError(f"quantize: tensor '{name}': no fallback type for {t.name} with rows of {ncols}")
    new = dtypes.from_name(_FALLBACK.get(t.name, t.name))
    if ncols % new.block_size:
        new = dtypes.f16
    m.fallbacks.append((name, t, new))
    return new


@dataclass
class Plan:
    """The type of every tensor in the quantised file (in llama-quantize's order), and the
    tensors whose rows forced a fallback type: (name, wanted, got)."""
    types: dict[str, DType]
    fallbacks: list[tuple[str, DType, DType]]


def plan(f: GGUFFile, ftype: str | FileType, *, has_imatrix: bool = False, pure: bool = False,
         leave_output: bool = False, output_type=None, token_embedding_type=None) -> Plan:
    """Every tensor's type in the quantised file, as llama-quantize chooses it.

    ``pure``: every quantisable tensor gets the default type (no mix; fallbacks still apply).
    ``leave_output``: output.weight keeps its type. ``output_type`` / ``token_embedding_type``:
    those tensors get this type instead of the mix's choice."""
    ft = ftype if isinstance(ftype, FileType) else file_type(ftype)
    out_t = tensor_type(output_type, "output_type") if output_type is not None else None
    emb_t = tensor_type(token_embedding_type, "token_embedding_type") if token_embedding_type is not None else None
    names = sorted(f.tensors, key=_layer_order)
    m = _model(f, names, has_imatrix)
    types = {}
    for name in names:
        info = f.tensors[name]
        ncols, cat = info.shape[-1], _category(name)
        if not _quantizable(name, info.shape, quantize_output=not leave_output):
            types[name] = info.dtype
        elif emb_t is not None and cat == "token_embd":
            types[name] = emb_t
        elif out_t is not None and cat == "output":
            types[name] = out_t
        elif ft.default.block_size == 1:
            types[name] = ft.default
        else:
            t = ft.default
            if m.tied and cat == "token_embd" and out_t is not None and not pure:
                t = out_t
            elif not pure:
                t = _mix(m, ft.name, cat, t, name, info.shape)
            types[name] = _fallback(m, name, t, ncols)
    return Plan(types, m.fallbacks)


# ---------------------------------------------------------------- the file

def _metadata(f: GGUFFile, ft: FileType, imatrix_keys: dict) -> dict:
    """The input's metadata as llama-quantize writes it back (see the module docstring)."""
    md = typed_metadata(f)
    for key in ("general.quantization_version", "general.file_type", "split.no", "split.count",
                "split.tensors.count", "general.alignment"):
        md.pop(key, None)
    md["general.quantization_version"] = Typed(QUANTIZATION_VERSION, "u32")
    md["general.file_type"] = Typed(ft.id, "u32")
    md.update(imatrix_keys)
    return md


def imatrix_keys(path: str, datasets, n_entries: int, n_chunks: int) -> dict:
    """The ``quantize.imatrix.*`` keys llama-quantize records (the file name cut to 127 bytes, as it does)."""
    keys = {"quantize.imatrix.file": Typed(os.fsencode(path)[:127].decode("utf-8", "ignore"), "str")}
    if datasets:
        keys["quantize.imatrix.dataset"] = Typed(os.fsencode(datasets[0])[:127].decode("utf-8", "ignore"), "str")
    keys["quantize.imatrix.entries_count"] = Typed(int(n_entries), "u32")
    if n_chunks > 0:
        keys["quantize.imatrix.chunks_count"] = Typed(int(n_chunks), "u32")
    return keys


def _n_matrices(shape) -> int:
    """The matrices a tensor holds: E for stacked experts [E, N, K], 1 for a matrix [N, K]."""
    return int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 2 else 1


def _row_weights(name: str, info, imatrix: Mapping[str, np.ndarray] | None):
    """The importance vectors for tensor ``name``, f32 (n_mat, K): one per matrix (per expert of stacked
    experts, as llama-quantize slices an imatrix entry of E·K values); None if the imatrix has none."""
    if not imatrix or name not in imatrix:
        return None
    w = np.asarray(imatrix[name], np.float32)
    n_mat, cols = _n_matrices(info.shape), info.shape[-1]
    if w.shape != (n_mat * cols,):
        if _category(name) == "token_embd":
            return None                                 # llama.cpp ignores a mismatched token_embd entry
        rows = f"{cols}" if n_mat == 1 else f"{cols} in each of its {n_mat} experts (so {n_mat * cols} values)"
        raise ValueError(f"quantize: imatrix entry '{name}' has {w.size} values, the tensor's rows have {rows}")
    if not np.isfinite(w).all():
        raise ValueError(f"quantize: imatrix entry '{name}' has non-finite values")
    return w.reshape(n_mat, cols)


def _converter(f: GGUFFile, name: str, new: DType, ft: FileType, imatrix, allow_requantize: bool,
               bar: Progress, pool: ThreadPoolExecutor, workers: int):
    """produce() for one tensor: its bytes as they are, or dequantised and quantised to ``new``
    in slabs of rows on ``pool``'s threads (rows quantise independently: the bytes are the same).
    A slab never crosses from one expert's rows to the next's: each has its own importance."""
    info = f.tensors[name]
    if info.dtype is new:
        def copy():
            bar.advance(info.nbytes)
            return info.data
        return copy
    if info.dtype in dtypes.QUANTIZED and not allow_requantize:
        raise ValueError(f"quantize: tensor '{name}' is already {info.dtype.name}; requantizing loses "
                         f"quality (pass --allow-requantize to do it anyway)")
    if new not in quants.QUANTIZABLE:
        raise ValueError(f"quantize: tensor '{name}': ggraph cannot quantise to {new.name}")
    weights = _row_weights(name, info, imatrix)
    if weights is None and ft.name == "Q2_K_S" and new is dtypes.q2_k and _category(name) not in ("token_embd", "output"):
        raise ValueError(f"quantize: Q2_K_S needs importance data for tensor '{name}' (--imatrix FILE)")

    def convert():
        cols, n_mat = info.shape[-1], _n_matrices(info.shape)
        src = f.dequantize(name).reshape(-1, cols)
        n = src.shape[0]
        per_mat = n // n_mat
        step = max(1, min((1 << 22) // cols, -(-n // workers)))   # <= 16 MiB of f32, a slab per thread
        out = np.empty((n, new.row_bytes(cols)), np.uint8)
        slabs = [(e, i, min(i + step, (e + 1) * per_mat)) for e in range(n_mat)
                 for i in range(e * per_mat, (e + 1) * per_mat, step)]

        def slab(job) -> int:
            e, i, j = job
            out[i:j] = quants.quantize(src[i:j], new, imatrix=None if weights is None else weights[e])
            return j - i
        for done in pool.map(slab, slabs):
            bar.advance(info.nbytes * done / n)
        return out.reshape(-1)
    return convert


def quantize_file(src, dst, ftype, *, imatrix: Mapping[str, np.ndarray] | None = None,
                  imatrix_meta: dict | None = None, pure: bool = False, leave_output: bool = False,
                  output_type=None, token_embedding_type=None, allow_requantize: bool = False,
                  threads: int | None = None) -> Plan:
    """Write ``dst``: the model ``src`` quantised to file type ``ftype``; returns the plan it followed.

    ``imatrix``: tensor name -> per-column importance (as llama-quantize derives it from an imatrix
    file); ``imatrix_meta``: the ``quantize.imatrix.*`` keys to record (see ``imatrix_keys``);
    ``threads``: quantising threads (default: every core; numpy lets go of the GIL in the searches).
    The file is written to ``dst + ".partial"`` and renamed when complete."""
    ft = ftype if isinstance(ftype, FileType) else file_type(ftype)
    from ggraph.backends.llvm.team import check_threads
    workers = check_threads(threads, "the extra threads only wait for a core") or os.cpu_count() or 1
    dst = os.fspath(dst)
    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise ValueError(f"quantize: input and output are the same file: {dst}")
    with GGUFFile(src) as f:
        todo = plan(f, ft, has_imatrix=bool(imatrix), pure=pure, leave_output=leave_output,
                    output_type=output_type, token_embedding_type=token_embedding_type)
        with Progress(f.nbytes, f"quantize {ft.name}", unit="B") as bar, ThreadPoolExecutor(workers) as pool:
            # shapes as ggml's writer stores them: [1, N] as [N] (llama.cpp writes ggml_n_dims dims)
            tensors = {name: Deferred(t, ggml_dims(f.tensors[name].shape),
                                      _converter(f, name, t, ft, imatrix, allow_requantize, bar, pool, workers))
                       for name, t in todo.types.items()}
            write(dst, _metadata(f, ft, imatrix_meta or {}), tensors)
    return todo
