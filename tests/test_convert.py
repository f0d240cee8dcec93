"""``ggraph convert`` against transformers.

Tiny random Hugging Face models of each family are made here with ``transformers`` (a fixed
seed, weights wide enough that attention is far from uniform, rope bases and scalings off their
defaults) and saved with a tokenizer built beside them: SentencePiece models trained by
``sentencepiece``, byte-level BPEs trained by ``tokenizers``. Each is converted, and then:

- the logits of a fixed token sequence (longer than the sliding window) in ggraph and in
  llama.cpp equal transformers' float32 logits: max |d| / max |logit| below 1e-5 for f32 files
  (below 1e-3 for the gemmas, whose GELU llama.cpp and ggraph read from an f16 table), and below
  5e-3, 5e-2 and 0.1 for f16, bf16 and q8_0 files (OUTTYPE_TOL);
- llama.cpp and ggraph tokenise text as the source tokenizer does;
- two shards convert to the same bytes as one file, a bf16 checkpoint to its exact values;
- bad folders fail with one line naming the file, tensor or key, and leave no file behind.

Tests that need torch or llama.cpp are marked slow.
"""
from __future__ import annotations

import copy
import io
import json
import re
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

import oracle
from ggraph.cli import main
from ggraph.convert import convert
from ggraph.gguf import GGUFFile
from ggraph.runtime.session import Session
from ggraph.runtime.tokenizer import Tokenizer

CORPUS = """\
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.
A graph compiler reads a model, rewrites its graph with named passes, and emits machine code.
Weights stay in the file; kernels read them straight from the memory map, block by block.
Tokenizers cut text into pieces: words, parts of words, single bytes when nothing else fits.
I've been told it's there, they'll say we're late, and you'd better check what's left.
Numbers such as 3.14159, 2718 and 1000000 appear in text too, as do dates like 2024-05-17.
Sliding windows let a layer see only the last few tokens; global layers see everything.
Rotary embeddings turn positions into angles, pair by pair, with a base of ten thousand.
Softcaps squash large scores with a tanh, so that no logit grows without bound.
Quantised blocks hold a scale and small integers: thirty-two weights in thirty-four bytes.
Ünïcödé text, 日本語のテキスト, and emoji like 🚀 or 🦙 must survive the round trip.
The end of a line is a newline; a tab\tis a tab; two  spaces are two spaces.
"""
SAMPLES = ["Hello world, the graph compiles!", "I've been 'told' he's there, 3.14159 times.",
           "Ünïcödé 日本語 🚀 and a tab\there", "line one\nline two  with two spaces"]
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
IDS = [int(t) for t in np.random.default_rng(0).integers(3, 400, 24)]      # 24 > the sliding window of 8
F32_TOL, GEMMA_TOL = 1e-5, 1e-3

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=512, initializer_range=0.15,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
# family -> (transformers config class, model class, config overrides, tokenizer kind)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=dict(rope_type="default", rope_theta=5000.0)),
              "spm"),
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(rope_parameters=dict(rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=16),
                    tie_word_embeddings=True), "llama3-bpe"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters=dict(rope_type="default", rope_theta=20000.0)),
              "qwen2-bpe"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(original_max_position_embeddings=512, max_position_embeddings=2048,   # short factors: llama.cpp
                  #                                  pads its context of 64 to 256, still below 512
                  rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                                       long_factor=list(np.linspace(1, 4, 6)),
                                       short_factor=list(np.linspace(1, 1.5, 6)))),
             "spm"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=5.0,
                    final_logit_softcapping=10.0), "spm-no-prefix"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=3,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    final_logit_softcapping=10.0,
                    rope_parameters=dict(full_attention=dict(rope_type="linear", factor=2.0, rope_theta=20000.0),
                                         sliding_attention=dict(rope_type="default", rope_theta=500.0))),
               "spm-json"),
}
N_VOCAB = {"spm": 416, "spm-no-prefix": 416, "spm-json": 416, "qwen2-bpe": 512, "llama3-bpe": 512}


# ---------------------------------------------------------------- tokenizers

def _train_sentencepiece(add_dummy_prefix: bool = True):
    """A 400-piece SentencePiece BPE with byte fallback, normalising nothing (as Llama 2's)."""
    spm = pytest.importorskip("sentencepiece")
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS.splitlines()), model_writer=out, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, num_threads=1,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   add_dummy_prefix=add_dummy_prefix, minloglevel=2)
    return out.getvalue(), spm.SentencePieceProcessor(model_proto=out.getvalue())


def _spm_as_json(sp):
    """The SentencePiece model as a tokenizer.json: its pieces by id, and for each piece (best score
    first) every split into two pieces as a merge, as transformers' converter writes them."""
    tk = pytest.importorskip("tokenizers")
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for t in sorted(vocab, key=lambda t: -sp.get_score(vocab[t])):
        if sp.is_control(vocab[t]) or sp.is_byte(vocab[t]) or sp.is_unknown(vocab[t]):
            continue
        splits = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
        merges += sorted(splits, key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
    tok = tk.Tokenizer(tk.models.BPE(vocab, merges, byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = tk.decoders.Sequence([tk.decoders.Replace("\u2581", " "), tk.decoders.ByteFallback(),
                                        tk.decoders.Fuse(), tk.decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([tk.AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = tk.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def _train_byte_bpe(regex: str, bos: bool):
    """A 500-token byte-level BPE splitting words by ``regex``, with chat-style special tokens."""
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Split(tk.Regex(regex), behavior="isolated"),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = tk.decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(CORPUS.splitlines(), tk.trainers.BpeTrainer(
        vocab_size=500, special_tokens=specials, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = (tk.processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", 0)])
                          if bos else tk.processors.ByteLevel(trim_offsets=False))
    return tok


def write_tokenizer(folder: Path, kind: str):
    """Save a tokenizer of ``kind`` into ``folder``; returns text -> the ids it gives (with BOS where it adds one)."""
    if kind.startswith("spm"):
        proto, sp = _train_sentencepiece(add_dummy_prefix=kind != "spm-no-prefix")
        if kind == "spm-json":
            _spm_as_json(sp).save(str(folder / "tokenizer.json"))
        else:
            (folder / "tokenizer.model").write_bytes(proto)
        return lambda text: [sp.bos_id()] + sp.encode(text)
    tok = _train_byte_bpe(LLAMA3_REGEX if kind == "llama3-bpe" else QWEN2_REGEX, bos=kind == "llama3-bpe")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    return lambda text: tok.encode(text).ids


CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


# ---------------------------------------------------------------- models

def build_hf_model(root: Path, name: str, dtype: str = "float32", shard: str | None = None, **overrides):
    """(folder, transformers model, tokenise) for a tiny random model of FAMILIES[name] (``overrides``
    changing its config), saved under ``root`` as ``dtype`` (in shards of at most ``shard`` bytes
    when given). The model returned is float32 with the values that were saved."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls, over, kind = FAMILIES[name]
    config = getattr(transformers, config_cls)(**(COMMON | {"vocab_size": N_VOCAB[kind]} | over | overrides))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:                            # away from their initial values (gemma's +1 must show)
                p.add_(torch.randn_like(p) * 0.3)
            p.copy_(p.to(getattr(torch, dtype)).float())
    folder = root / f"{name}-{dtype}-{shard}-{len(overrides)}" / "model"
    folder.mkdir(parents=True)
    saved = copy.deepcopy(model).to(getattr(torch, dtype))     # the reference keeps its rope buffers in f32
    saved.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    tokenise = write_tokenizer(folder, kind)
    return folder, model, tokenise


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """``hf(name, dtype="float32", shard=None)``: build_hf_model, once per arguments in this module."""
    root = tmp_path_factory.mktemp("hf")
    return lru_cache(maxsize=None)(lambda *args, **kw: build_hf_model(root, *args, **kw))


def hf_logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def ggraph_logits(path, ids) -> np.ndarray:
    return Session(path, backend="numpy", ctx=64, cache_type_k="f32", cache_type_v="f32").logits(ids)


# ---------------------------------------------------------------- logits

@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_f32_logits_equal_transformers_in_ggraph_and_llama_cpp(hf, name, tmp_path):
    folder, model, _ = hf(name)
    out = convert(folder, tmp_path / f"{name}.gguf", "f32")
    want = hf_logits(model, IDS)
    tol = GEMMA_TOL if name.startswith("gemma") else F32_TOL
    for who, got in (("llama.cpp", oracle.llama_logits(out, IDS, n_ctx=64)), ("ggraph", ggraph_logits(out, IDS))):
        assert got.shape == want.shape, who
        assert rel_err(got, want) < tol, f"{name} in {who}: max |d| / max |logit| = {rel_err(got, want):.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_tokenizer_tokenises_as_the_original(hf, name, tmp_path):
    """llama.cpp and ggraph tokenise the converted file's vocabulary as SentencePiece / tokenizers do,
    BOS included where the original adds it."""
    folder, _, tokenise = hf(name)
    out = convert(folder, tmp_path / f"{name}.gguf", "f16")
    ours = Tokenizer.from_gguf(out)
    for text in SAMPLES:
        want = tokenise(text)
        assert oracle.llama_tokenize(out, text, add_bos=ours.add_bos, special=False) == want, text
        assert ours.encode(text, parse_special=False) == want, text


# max |d| / max |logit| against transformers' f32 logits for llama's small random model: about 2x the
# error the rounding of the weights (and, in llama.cpp's q8_0 matmul, of the activations) gives,
# measured at 1.6e-3, 1.7e-2 and 5.4e-2; a converter mistake gives errors near 1
OUTTYPE_TOL = {"f16": 5e-3, "bf16": 5e-2, "q8_0": 0.1}


@pytest.mark.slow
@pytest.mark.parametrize("outtype", list(OUTTYPE_TOL))
def test_outtypes(hf, outtype, tmp_path):
    folder, model, _ = hf("llama")
    out = convert(folder, tmp_path / f"llama-{outtype}.gguf", outtype)
    with GGUFFile(out) as f:
        assert f.metadata["general.file_type"] == {"f16": 1, "bf16": 32, "q8_0": 7}[outtype]
        types = {name: str(t.dtype) for name, t in f.tensors.items()}
        assert {types[n] for n in types if n.endswith("norm.weight")} == {"f32"}
        assert {types[n] for n in types if not n.endswith("norm.weight")} == {outtype}
        if outtype == "q8_0":       # byte for byte what llama.cpp's converter (gguf-py) writes
            gguf = pytest.importorskip("gguf")
            w = model.model.layers[0].mlp.down_proj.weight.detach().numpy()
            assert np.array_equal(f.tensors["blk.0.ffn_down.weight"].data.reshape(-1),
                                  gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0).reshape(-1))
    want = hf_logits(model, IDS)
    for who, got in (("llama.cpp", oracle.llama_logits(out, IDS, n_ctx=64)), ("ggraph", ggraph_logits(out, IDS))):
        assert rel_err(got, want) < OUTTYPE_TOL[outtype], f"{outtype} in {who}: {rel_err(got, want):.2e}"


@pytest.mark.slow
def test_q8_0_rows_that_are_not_whole_blocks_stay_f16(hf, tmp_path):
    folder, _, _ = hf("llama")
    ragged = tmp_path / "ragged"
    shutil.copytree(folder, ragged)
    cfg = json.loads((ragged / "config.json").read_text())
    assert cfg["intermediate_size"] % 32 == 0          # rows of ffn_down are n_ff wide: make them ragged
    _rewrite_tensors(ragged, lambda name, x: x[:, :112] if name.endswith("down_proj.weight") else
                     x[:112] if "gate_proj" in name or "up_proj" in name else x)
    (ragged / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 112}))
    with GGUFFile(convert(ragged, tmp_path / "ragged.gguf", "q8_0")) as f:
        assert str(f.tensors["blk.0.ffn_down.weight"].dtype) == "f16"
        assert str(f.tensors["blk.0.ffn_up.weight"].dtype) == "q8_0"


@pytest.mark.slow
def test_two_shards_convert_to_the_same_bytes_as_one_file(hf, tmp_path):
    one, _, _ = hf("qwen2")
    two, _, _ = hf("qwen2", shard="300KB")
    assert (two / "model.safetensors.index.json").is_file() and len(list(two.glob("model-*.safetensors"))) >= 2
    a = convert(one, tmp_path / "one.gguf", "f16", name="tiny")
    b = convert(two, tmp_path / "two.gguf", "f16", name="tiny")
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.slow
def test_bf16_checkpoint(hf, tmp_path):
    """bf16 weights widen exactly: the f32 file gives the logits of the bf16-rounded model, and a bf16
    file keeps the checkpoint's bytes."""
    from safetensors import safe_open
    folder, model, _ = hf("llama", dtype="bfloat16")
    out = convert(folder, tmp_path / "bf16.gguf", "f32")
    assert rel_err(oracle.llama_logits(out, IDS, n_ctx=64), hf_logits(model, IDS)) < F32_TOL
    kept = convert(folder, tmp_path / "bf16-bf16.gguf", "bf16")
    with GGUFFile(kept) as f, safe_open(str(folder / "model.safetensors"), "pt") as st:
        raw = st.get_tensor("model.layers.0.mlp.up_proj.weight").view(dtype=__import__("torch").int16).numpy()
        assert np.array_equal(f.tensors["blk.0.ffn_up.weight"].data.view(np.int16).reshape(raw.shape), raw)


# ---------------------------------------------------------------- metadata

@pytest.mark.slow
def test_metadata_keys(hf, tmp_path):
    """The keys llama.cpp reads, with its names and values: softcaps, windows, rope bases, vocab."""
    with GGUFFile(convert(hf("gemma3")[0], tmp_path / "g3.gguf", "f16")) as f:
        md = f.metadata
        assert md["general.architecture"] == "gemma3" and md["general.name"] == "model"
        assert md["gemma3.attention.sliding_window"] == 8
        assert list(md["gemma3.attention.sliding_window_pattern"]) == [True, False, True]
        assert md["gemma3.rope.freq_base"] == 20000.0 and md["gemma3.rope.freq_base_swa"] == 500.0
        assert md["gemma3.rope.scaling.type"] == "linear" and md["gemma3.rope.scaling.factor"] == 2.0
        assert md["gemma3.final_logit_softcapping"] == 10.0
        assert md["tokenizer.ggml.model"] == "llama" and len(md["tokenizer.ggml.tokens"]) == 416
        assert md["tokenizer.ggml.tokens"][400] == "[PAD400]" and md["tokenizer.ggml.token_type"][400] == 5
        assert "output.weight" not in f.tensors                                   # tied
    with GGUFFile(convert(hf("llama3")[0], tmp_path / "l3.gguf", "f16")) as f:
        md = f.metadata
        assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "llama-bpe"
        assert md["tokenizer.ggml.bos_token_id"] == 0 and md["tokenizer.ggml.eos_token_id"] == 3
        assert md["tokenizer.ggml.add_bos_token"] is True and md["tokenizer.chat_template"] == CHAT_TEMPLATE
        assert md["tokenizer.ggml.token_type"][0] == 3 and md["tokenizer.ggml.tokens"][511] == "[PAD511]"
        assert f.tensors["rope_freqs.weight"].shape == (8,) and str(f.tensors["rope_freqs.weight"].dtype) == "f32"
    with GGUFFile(convert(hf("phi3")[0], tmp_path / "phi3.gguf", "f16")) as f:
        md = f.metadata
        assert md["phi3.rope.dimension_count"] == 12 and md["phi3.rope.scaling.original_context_length"] == 512
        assert md["phi3.rope.scaling.attn_factor"] == pytest.approx(np.sqrt(1 + np.log(4) / np.log(512)))
        assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= set(f.tensors)


def test_real_gpt2_vocabulary_round_trips(tmp_path):
    """llama.cpp's GPT-2 vocab, written as a tokenizer.json, converts back to the same tokens, types and merges."""
    from ggraph.convert.vocab import tokenizer_metadata
    with GGUFFile(Path(__file__).parent / "data" / "vocab" / "ggml-vocab-gpt-2.gguf") as f:
        src = {k: list(v) if not isinstance(v, (str, int, float, bool)) else v
               for k, v in f.metadata.items() if k.startswith("tokenizer.")}
    tokens, types = src["tokenizer.ggml.tokens"], src["tokenizer.ggml.token_type"]
    added = [{"id": i, "content": t, "special": True} for i, t in enumerate(tokens) if types[i] == 3]
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "added_tokens": added, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": src["tokenizer.ggml.merges"]}}))
    md = tokenizer_metadata(tmp_path, len(tokens), {})
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "gpt-2"
    assert md["tokenizer.ggml.tokens"] == tokens and md["tokenizer.ggml.merges"] == src["tokenizer.ggml.merges"]
    assert md["tokenizer.ggml.token_type"].value == types


LLAMA_CONFIG = dict(architectures=["LlamaForCausalLM"], **COMMON, vocab_size=416, rms_norm_eps=1e-6)
GEMMA2_CONFIG = LLAMA_CONFIG | dict(architectures=["Gemma2ForCausalLM"], num_attention_heads=8, head_dim=8,
                                    query_pre_attn_scalar=16)


def test_transformers_4_configs():
    """Configs saved before transformers 5 keep rope_theta, rope_scaling and the local base at the top level."""
    from ggraph.convert.families import FAMILIES as F, HFConfig
    llama31 = HFConfig(dict(LLAMA_CONFIG, rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)), Path("config.json"))
    assert F["LlamaForCausalLM"].keys(llama31)["rope.freq_base"] == 500000.0
    freqs = F["LlamaForCausalLM"].generated(llama31)["rope_freqs.weight"]
    assert freqs.shape == (8,) and freqs[0] == 1.0 and freqs[-1] == 8.0
    gemma3 = HFConfig(dict(GEMMA2_CONFIG, architectures=["Gemma3ForCausalLM"], num_hidden_layers=7, rope_theta=1e6,
                           rope_local_base_freq=10000.0, sliding_window=512, sliding_window_pattern=6,
                           query_pre_attn_scalar=8, rope_scaling=dict(rope_type="linear", factor=8.0)),
                      Path("config.json"))
    keys = F["Gemma3ForCausalLM"].keys(gemma3)
    assert keys["rope.freq_base"] == 1e6 and keys["rope.freq_base_swa"] == 10000.0
    assert keys["rope.scaling.type"] == "linear" and keys["rope.scaling.factor"] == 8.0
    assert keys["attention.sliding_window_pattern"] == [True] * 5 + [False, True]


@pytest.mark.parametrize("hf_arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                                     "Gemma3ForCausalLM"])
def test_tensor_names_round_trip(hf_arch):
    """Every GGUF tensor a family expects comes from one Hugging Face name, and maps back to it."""
    from ggraph.convert.families import FAMILIES as F, HFConfig
    fam = F[hf_arch]
    names = list(fam.expected(HFConfig(LLAMA_CONFIG | {"tie_word_embeddings": False}, Path("config.json"))))
    assert [fam.gguf_name(fam.hf_name(n)) for n in names] == names
    ffn_norm = "pre_feedforward_layernorm" if fam.post_norms else "post_attention_layernorm"
    assert fam.hf_name("blk.1.ffn_norm.weight") == f"model.layers.1.{ffn_norm}.weight"


def _bpe_json(folder: Path, regex: str) -> Path:
    """A two-token byte-level BPE tokenizer.json whose words are split by ``regex``."""
    (folder / "tokenizer.json").write_text(json.dumps({
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}}))
    return folder


def test_bpe_pre_tokenizer_by_regex_or_by_name(tmp_path):
    from ggraph.convert.vocab import tokenizer_metadata
    assert tokenizer_metadata(_bpe_json(tmp_path, QWEN2_REGEX), 3, {})["tokenizer.ggml.pre"] == "qwen2"
    assert tokenizer_metadata(_bpe_json(tmp_path, LLAMA3_REGEX), 3, {})["tokenizer.ggml.pre"] == "llama-bpe"
    _bpe_json(tmp_path, r"\p{N}+|[^\p{N}]+")
    with pytest.raises(ValueError, match="not one ggraph recognises .* name llama.cpp's pre-tokenizer for it with "
                                         "--tokenizer-pre NAME"):
        tokenizer_metadata(tmp_path, 3, {})
    md = tokenizer_metadata(tmp_path, 4, {}, pre="starcoder")
    assert md["tokenizer.ggml.pre"] == "starcoder" and md["tokenizer.ggml.merges"] == ["a b"]
    assert md["tokenizer.ggml.tokens"] == ["a", "b", "ab", "[PAD3]"] and md["tokenizer.ggml.token_type"].value[3] == 5
    with pytest.raises(ValueError, match="--tokenizer-pre 'nonsense' is not a pre-tokenizer ggraph knows"):
        tokenizer_metadata(tmp_path, 3, {}, pre="nonsense")
    with pytest.raises(ValueError, match="tokenizer.json has token id 2 \\('ab'\\), but the model's vocabulary"):
        tokenizer_metadata(tmp_path, 2, {}, pre="starcoder")


# ---------------------------------------------------------------- bad input

def _folder(tmp_path, config: dict | None = None, **files) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)
    return folder


def _rewrite_tensors(folder: Path, edit) -> None:
    """Rewrite model.safetensors with ``edit(name, array) -> array or None`` (None drops it)."""
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(folder / "model.safetensors"))
    kept = {n: edit(n, x) for n, x in tensors.items()}
    save_file({n: np.ascontiguousarray(x) for n, x in kept.items() if x is not None}, str(folder / "model.safetensors"))


@pytest.mark.parametrize("config, message", [
    (None, "no config.json"),
    ({"architectures": ["MistralForCausalLM"]},
     ("architecture 'MistralForCausalLM' is not supported; supported: LlamaForCausalLM, Qwen2ForCausalLM, "
      "Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM")),
    ({"hidden_size": 64}, "no architectures list"),
    (LLAMA_CONFIG | {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({k: v for k, v in LLAMA_CONFIG.items() if k != "intermediate_size"}, "config.json: intermediate_size is missing"),
    (GEMMA2_CONFIG, ("query_pre_attn_scalar = 16 scales q·k by 1/sqrt(16), but llama.cpp scales a 2-layer "
                     "model by 1/sqrt(8)")),
    (LLAMA_CONFIG, "no model*.safetensors weights"),
])
def test_bad_folders_fail_with_one_line(tmp_path, capsys, config, message):
    folder = _folder(tmp_path, config)
    out = tmp_path / "out.gguf"
    assert main(["convert", str(folder), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ggraph convert: error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists() and not out.with_name("out.gguf.partial").exists()


def test_not_a_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere: not a directory"):
        convert(tmp_path / "nowhere", tmp_path / "o.gguf")


def test_unwritable_output_is_refused_first(tmp_path, capsys):
    assert main(["convert", str(tmp_path), str(tmp_path / "no" / "o.gguf")]) == 1
    assert "no such directory" in capsys.readouterr().err
    assert main(["convert", str(tmp_path), str(tmp_path)]) == 1
    assert "is a directory" in capsys.readouterr().err


def test_unknown_outtype(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["convert", str(tmp_path), str(tmp_path / "o.gguf"), "--outtype", "q4_k"])
    assert "invalid choice: 'q4_k'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown output type 'q4_k'; choose one of f32, f16, bf16, q8_0"):
        convert(tmp_path, tmp_path / "o.gguf", "q4_k")


def test_missing_shard(tmp_path):
    folder = _folder(tmp_path, LLAMA_CONFIG, model__safetensors__index__json=json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                        "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json: shards model-00001-of-00002"
                                                ".safetensors, model-00002-of-00002.safetensors missing from"):
        convert(folder, tmp_path / "o.gguf")


@pytest.mark.slow
@pytest.mark.parametrize("edit, message", [
    (lambda n, x: None if n == "model.layers.1.mlp.up_proj.weight" else x,
     "the checkpoint has no model.layers.1.mlp.up_proj.weight (blk.1.ffn_up.weight) (1 missing"),
    (lambda n, x: x[:96] if n == "model.layers.0.mlp.gate_proj.weight" else x,
     "tensor model.layers.0.mlp.gate_proj.weight has shape [96, 64], but config.json"),
    (lambda n, x: x[:, :32] if n == "model.layers.0.self_attn.o_proj.weight" else x,
     "tensor model.layers.0.self_attn.o_proj.weight has shape [64, 32]"),
])
def test_bad_checkpoints_fail_and_leave_no_file(hf, tmp_path, edit, message):
    folder, _, _ = hf("llama")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    _rewrite_tensors(bad, edit)
    with pytest.raises(ValueError, match=re.escape(message)):
        convert(bad, tmp_path / "o.gguf")
    assert not list(tmp_path.glob("o.gguf*"))


@pytest.mark.slow
def test_a_failure_while_writing_leaves_no_file(hf, tmp_path, monkeypatch):
    folder, _, _ = hf("llama")
    calls = []

    def failing(x, dtype):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk full")
        return real(x, dtype)
    from ggraph.gguf import quants
    real = quants.quantize
    monkeypatch.setattr(quants, "quantize", failing)
    with pytest.raises(OSError, match="disk full"):
        convert(folder, tmp_path / "o.gguf")
    assert not list(tmp_path.glob("o.gguf*"))


@pytest.mark.slow
def test_cli_convert_then_run(hf, tmp_path, capsys):
    folder, _, _ = hf("qwen2")
    out = tmp_path / "q.gguf"
    assert main(["convert", str(folder), str(out), "--outtype", "q8_0"]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    run = ["run", str(out), "-p", "Hello world", "-n", "4", "--temp", "0", "--backend", "numpy", "--ctx", "64"]
    assert main(run) == 0
    assert capsys.readouterr().out.startswith("Hello world")
