"""Tiny random-weight Hugging Face models of the newer families, converted to GGUF by llama.cpp itself.

    path = hf_models.converted("qwen3", "q4_k_m")     # a GGUF file, made once per arguments
    want = hf_models.hf_logits("qwen3", ids)          # transformers' f32 logits of the same weights
    f32 = hf_models.dequantised("qwen3", "q4_k_m")    # that file's weights dequantised, as an f32 file

Each model is made with ``transformers`` (a fixed seed, norm weights moved off 1 so that they
count), saved as a Hugging Face folder with a tokenizer, converted to an f32 GGUF by
``convert_hf_to_gguf.py`` from the llama.cpp source of the installed llama-cpp-python
(``llama_tools.llama_cpp_source()``, run with its own ``gguf-py``), and quantised to q8_0 and
Q4_K_M by llama.cpp's ``llama_model_quantize``. Everything lands in
``$TMPDIR/ggraph-hf-<key>/``, where the key hashes the arguments, this file, the tokenizer code
it borrows from test_convert.py and the versions of every package that decides the bytes.

Tokenizers: llama.cpp's converter names a BPE pre-tokenizer by the hash of a real vocabulary's
output, so a BPE trained here is refused. qwen3 and mixtral take the converter's SentencePiece path
(test_convert's 400-piece model); olmo2, olmoe, qwen3moe, qwen2moe and gpt-oss have no such path and get
GPT-2's real BPE, rebuilt from tests/data/vocab/ggml-vocab-gpt-2.gguf, which the converter recognises as "gpt-2".
So do the recurrent and hybrid families (``RECURRENT``: lfm2, mamba2, granitehybrid; ``DELTA_NET``: qwen3next).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

import llama_tools
import zoo

# llama.cpp ftype per mix (LLAMA_FTYPE_MOSTLY_Q8_0, _Q4_K_M); f32 is the converter's own output
MIXES = {"f32": None, "q8_0": 7, "q4_k_m": 15}

# widths of whole 256-blocks, so that Q4_K_M gives real q4_k/q6_k rows
DIMS = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, max_position_embeddings=512, initializer_range=0.1)

# family -> (transformers config class, model class, config overrides, tokenizer, vocabulary size)
FAMILIES = {
    # Qwen3-0.6B's proportions: heads wider than hidden/heads (n_head x head_dim = 2 x hidden), tied output
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=128, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                   rope_parameters=dict(rope_type="default", rope_theta=20000.0)), "spm", 416),
    # OLMo 2: post-norms only, q/k norms over whole projections, untied; the vocabulary padded past
    # the tokenizer's 50257 to a multiple of 64, as OLMo's is
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM",
              dict(bos_token_id=None, eos_token_id=50256, pad_token_id=50256, rms_norm_eps=1e-6,
                   rope_parameters=dict(rope_type="default", rope_theta=500000.0)), "gpt-2", 50304),
    # Qwen3-30B-A3B's layout, shrunk: qwen3 attention, an MoE FFN in every layer (8 experts, top-2, top-k
    # weights renormalised), untied output
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 dict(head_dim=128, tie_word_embeddings=False, bos_token_id=None, eos_token_id=50256,
                      pad_token_id=50256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      rope_parameters=dict(rope_type="default", rope_theta=20000.0)), "gpt-2", 50304),
    # OLMoE-1B-7B's layout, shrunk: OLMo's whole-projection q/k norms with pre-norms, as many kv heads as heads
    # (llama.cpp's olmoe has no GQA), 8 experts (64 in the real model) of width 256 (whole k-quant blocks), top-2,
    # weights not renormalised; untied
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_key_value_heads=4, intermediate_size=256, bos_token_id=None, eos_token_id=50256,
                   pad_token_id=50256, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, rms_norm_eps=1e-5,
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0)), "gpt-2", 50304),
    # Qwen1.5-MoE-A2.7B's layout, shrunk: qkv biases, 8 experts of width 128, top-2, weights not renormalised,
    # and a shared expert of width 256 under its sigmoid gate; untied
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                 dict(tie_word_embeddings=False, bos_token_id=None, eos_token_id=50256, pad_token_id=50256,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[], use_sliding_window=False,
                      rope_parameters=dict(rope_type="default", rope_theta=20000.0)), "gpt-2", 50304),
    # Mixtral-8x7B's layout, shrunk: llama with 8 experts of width 256, top-2, weights renormalised; llama.cpp
    # converts it to arch "llama" with llama.expert_count; SentencePiece as Mixtral's
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                     pad_token_id=0, num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
                     rope_parameters=dict(rope_type="default", rope_theta=1000000.0)), "spm", 416),
    # gpt-oss-20b's layout, shrunk: attention with biases and sinks, sliding (even) and full (odd) layers with a
    # window of 8 (so that it bites within the tests' 24 tokens), YaRN rope as gpt-oss's (factor 32 over 4096),
    # 8 experts of width 256 with biases, top-2 of the router logits, the clamped SwiGLU; untied
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=64, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                     max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=None,
                     eos_token_id=50256, pad_token_id=50256,
                     rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                          beta_slow=1.0, truncate=False, original_max_position_embeddings=4096)),
                "gpt-2", 50304),
}
# the recurrent and hybrid families (tests/test_recurrent_families.py), in the same form
RECURRENT = {
    # LFM2's layout, shrunk: short-convolution layers (width 3) around an attention layer with per-head q/k
    # norms; its FFN width auto-adjusted as LFM2's (2/3 of 768, a multiple of 256: 512); tied output
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM",
             dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], intermediate_size=768,
                  conv_L_cache=3, tie_word_embeddings=True, bos_token_id=None, eos_token_id=50256,
                  pad_token_id=50256, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
             "gpt-2", 50304),
    # Mamba-2, shrunk: 8 heads of 64 (d_inner 512), 2 groups of B and C with state 64, convolution width 4;
    # untied
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM",
               dict(num_heads=8, head_dim=64, state_size=64, n_groups=2, conv_kernel=4, expand=2,
                    layer_norm_epsilon=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=50256,
                    pad_token_id=50256), "gpt-2", 50304),
    # Granite-4.0-H's layout, shrunk: Mamba-2 layers (8 heads of 64, one group, state 64) around an attention
    # layer without rope (NoPE, as granite-4.0-h), in every layer 8 experts of width 256, top-2, beside a
    # shared expert of 512; granite's multipliers off their defaults; tied. llama.cpp's converter reads the
    # older layer-type names ("mamba"/"attention", CONVERTER_CONFIG)
    "granitehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                      dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                           intermediate_size=256, shared_intermediate_size=512, num_local_experts=8,
                           num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1,
                           mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, position_embedding_type=None,
                           embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.0625,
                           logits_scaling=2.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None,
                           eos_token_id=50256, pad_token_id=50256), "gpt-2", 50304),
}
# the gated delta-net family (tests/test_qwen3next.py), in the same form
DELTA_NET = {
    # Qwen3-Next's layout, shrunk: gated delta-net layers (2 key heads shared by 4 value heads of 64, convolution
    # width 4) around a gated attention layer (4 heads of 64 over 2 kv heads, q/k norms, rope on a quarter of
    # each head), in every layer 8 experts of width 128, top-2 renormalised, beside a shared expert of 256 under
    # its sigmoid gate; untied. No multi-token-prediction layers (the converter's --no-mtp, CONVERTER_ARGS)
    "qwen3next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                  dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                       head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                       linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=128, shared_expert_intermediate_size=256, norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=50256, pad_token_id=50256,
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
                  "gpt-2", 50304),
}
# parameters transformers initialises to zero (or to 1), moved off it for the families whose tests need them to count
OFF_ZERO = {"gpt-oss": ("bias", "sinks"), "mamba2": ("mixer.D",), "granitehybrid": ("mamba.D",)}
# config.json as llama.cpp's converter reads it, where that differs from what transformers saves
CONVERTER_CONFIG = {
    "granitehybrid": lambda c: c | {"layer_types": [{"linear_attention": "mamba", "full_attention": "attention"}[t]
                                                    for t in c["layer_types"]]},
}


# further arguments of llama.cpp's convert_hf_to_gguf.py
CONVERTER_ARGS = {"qwen3next": ("--no-mtp",)}      # its default expects multi-token-prediction layers


def converted(family: str, mix: str = "f32", **overrides) -> Path:
    """The GGUF file of ``family``'s tiny model (config ``overrides`` applied) as ``mix``, made once."""
    if mix not in MIXES:
        raise ValueError(f"hf_models: unknown mix {mix!r}; known: {', '.join(MIXES)}")
    return _made(family, tuple(sorted(overrides.items()))) / f"{family}-{mix}.gguf"


def hf_folder(family: str, **overrides) -> Path:
    """The saved Hugging Face folder (config, safetensors, tokenizer) the GGUF files come from."""
    return _made(family, tuple(sorted(overrides.items()))) / "hf"


def hf_logits(family: str, ids, **overrides) -> np.ndarray:
    """transformers' float32 logits [T, V] of ``ids`` (one sequence, no BOS added) on the saved model."""
    import torch
    model = _hf_model(hf_folder(family, **overrides))
    with torch.no_grad():
        return model(torch.tensor([list(map(int, ids))])).logits[0].float().numpy()


def dequantised(family: str, mix: str, **overrides) -> Path:
    """An f32 copy of ``family``'s ``mix`` file with every tensor dequantised and nothing else changed: the
    same weights for llama.cpp to run with f32 activations, as ggraph's numpy reference runs them (llama.cpp
    rounds a quantised matmul's activations to 8 bits)."""
    import gguf_edit
    from ggraph.gguf import GGUFFile, quants
    src = converted(family, mix, **overrides)
    out = src.with_name(f"{src.stem}-dequantised.gguf")
    if not out.exists():
        with GGUFFile(str(src)) as f:
            weights = {n: np.asarray(quants.dequantize(t.data, t.dtype, t.shape), np.float32).reshape(t.shape)
                       for n, t in f.tensors.items() if t.dtype.name != "f32"}
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        gguf_edit.edited(src, tmp, keys={"general.file_type": 0}, tensors=weights)     # LLAMA_FTYPE_ALL_F32
        tmp.rename(out)                       # atomic: another process may write the same bytes
    return out


@lru_cache(maxsize=4)
def _hf_model(folder: Path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()


# -- making them --------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _made(family: str, overrides: tuple) -> Path:
    """The cache folder holding ``hf/`` and ``<family>-<mix>.gguf`` for every mix, built if absent."""
    known = FAMILIES | RECURRENT | DELTA_NET
    if family not in known:
        raise ValueError(f"hf_models: unknown family {family!r}; known: {', '.join(known)}")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("llama_cpp", reason="llama.cpp converts and quantises these models")
    folder = Path(tempfile.gettempdir()) / f"ggraph-hf-{family}-{cache_key(family, dict(overrides))}"
    if (folder / "done").exists():
        return folder
    src = llama_tools.llama_cpp_source()
    tmp = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=folder.parent))
    try:
        build_hf_model(tmp / "hf", family, **dict(overrides))
        f32 = tmp / f"{family}-f32.gguf"
        reads = converter_folder(tmp / "hf", family)
        convert_with_llama_cpp(src, reads, f32, CONVERTER_ARGS.get(family, ()))
        if reads != tmp / "hf":
            shutil.rmtree(reads)
        for mix, ftype in MIXES.items():
            if ftype is not None:
                zoo.llama_quantize(f32, tmp / f"{family}-{mix}.gguf", ftype, what=f"{family} {mix}")
        (tmp / "done").touch()
        try:
            tmp.rename(folder)                # atomic: another process may have won the race
        except OSError:
            if not (folder / "done").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def build_hf_model(folder: Path, family: str, **overrides) -> None:
    """Save a tiny random ``family`` model and its tokenizer into ``folder``."""
    import torch
    import transformers
    config_cls, model_cls, over, tokenizer, n_vocab = (FAMILIES | RECURRENT | DELTA_NET)[family]
    config = getattr(transformers, config_cls)(**(DIMS | {"vocab_size": n_vocab} | over | overrides))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:                # off their initial 1s, so that a missed norm shows
                p.add_(torch.randn_like(p) * 0.3)
            elif any(part in name for part in OFF_ZERO.get(family, ())):
                p.add_(torch.randn_like(p))
    folder.mkdir(parents=True)
    model.save_pretrained(folder)
    if tokenizer == "spm":
        from test_convert import write_tokenizer
        write_tokenizer(folder, "spm")
    else:
        write_gpt2_tokenizer(folder)


def converter_folder(folder: Path, family: str) -> Path:
    """The folder llama.cpp's converter reads: ``folder`` itself, or a sibling with the same files (linked) and
    its config.json rewritten by ``CONVERTER_CONFIG[family]``."""
    if family not in CONVERTER_CONFIG:
        return folder
    out = folder.with_name(folder.name + "-for-llama.cpp")
    out.mkdir()
    for f in folder.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(CONVERTER_CONFIG[family](config), indent=2))
    return out


def write_gpt2_tokenizer(folder: Path) -> None:
    """GPT-2's byte-level BPE (tokens and merges from llama.cpp's vocab file) as a tokenizer.json."""
    import tokenizers as tk
    from ggraph.gguf import GGUFFile
    with GGUFFile(str(zoo.VOCAB_DIR / zoo.VOCABS["gpt-2"])) as f:
        tokens = list(f.metadata["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ")) for m in f.metadata["tokenizer.ggml.merges"]]
    tok = tk.Tokenizer(tk.models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tk.decoders.ByteLevel()
    tok.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([tk.AddedToken("<|endoftext|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))


def convert_with_llama_cpp(src: Path, folder: Path, out: Path, args=()) -> Path:
    """``python convert_hf_to_gguf.py folder --outfile out --outtype f32 [args]`` from llama.cpp's source
    ``src``, importing that source's own gguf-py."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(src / "gguf-py"),
                                                                   os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(out), "--outtype", "f32",
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode or not out.is_file():
        raise RuntimeError(f"hf_models: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return out


def cache_key(family: str, overrides: dict) -> str:
    """Hash of what decides the files' bytes: the arguments, this file, the borrowed tokenizer code,
    GPT-2's vocab file and the versions of the packages that make, convert and quantise them."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(json.dumps([family, sorted(overrides.items())], default=repr).encode())
    import test_convert
    for part in (test_convert.CORPUS, test_convert.write_tokenizer, test_convert._train_sentencepiece):
        h.update((part if isinstance(part, str) else inspect.getsource(part)).encode())
    h.update((zoo.VOCAB_DIR / zoo.VOCABS["gpt-2"]).read_bytes())
    for package in ("llama_cpp_python", "transformers", "torch", "tokenizers", "sentencepiece"):
        h.update(f"{package}={metadata.version(package)}".encode())
    return h.hexdigest()[:16]
