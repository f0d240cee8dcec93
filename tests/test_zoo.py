"""The model zoo: every arch x mix loads in llama.cpp, gives sane logits, has the real type mix,
and each family's distinguishing feature measurably changes llama.cpp's output."""

import numpy as np
import pytest

import oracle
import zoo
from ggraph.ir import dtypes  # noqa: E402

gguf = pytest.importorskip("gguf")

PROMPT = [1] + np.random.default_rng(0).integers(3, 32000, 31).tolist()  # 32 tokens, ids valid in both vocabs
ARCHS = list(zoo.ARCHS)
MIXES = list(zoo.MIXES)


def tensor_types(path) -> dict[str, tuple]:
    """GGUF tensor name -> (ggraph dtype, ne0), from zoo's fast header walk (checked below)."""
    return {name: (dtypes.from_ggml_id(t), ne[0]) for name, (t, ne) in zoo.read_gguf(path)[1].items()}


def field(path, key):
    """One metadata value."""
    return zoo.read_gguf(path)[0][key][0]


def needs_llama_cpp(mix):
    """Quantised mixes are made by llama.cpp itself."""
    if zoo.MIXES[mix] is not None:
        pytest.importorskip("llama_cpp")


# --- files -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, mix", [("llama", "q4_k_m"), ("gemma3", "f16"), ("phi3", "f32")])
def test_header_walk_matches_gguf_py(arch, mix):
    needs_llama_cpp(mix)
    path = zoo.cached_model(arch, mix, **(zoo.K_QUANT_DIMS if mix == "q4_k_m" else {}))
    kv, tensors = zoo.read_gguf(path)
    reader = gguf.GGUFReader(path)
    assert {t.name: (int(t.tensor_type), tuple(int(n) for n in t.shape)) for t in reader.tensors} == tensors
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):  # gguf-py's pseudo-fields for the header
            continue
        assert decoded(kv[key][0]) == f.contents(), key


def decoded(value):
    """GGUF strings (raw bytes from zoo.read_gguf) as str, as gguf-py returns them."""
    if isinstance(value, bytes):
        return value.decode()
    return [decoded(v) for v in value] if isinstance(value, list) else value


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_names_and_types(arch, mix):
    needs_llama_cpp(mix)
    path = zoo.cached_model(arch, mix)
    types = tensor_types(path)
    assert set(types) == set(zoo.tensor_shapes(zoo.config(arch)))
    vectors = {n: t for n, (t, _) in types.items() if len(zoo.tensor_shapes(zoo.config(arch))[n]) == 1}
    matrices = {n: t for n, (t, _) in types.items() if n not in vectors}
    assert set(vectors.values()) == {dtypes.f32}, "norms, biases and rope factors stay f32"
    expected = {"f32": {dtypes.f32}, "f16": {dtypes.f16}, "q8_0": {dtypes.q8_0}, "q4_1": {dtypes.q4_1, dtypes.q8_0},
                # 64/128-wide rows have no whole 256-block: q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0 fallbacks
                "q4_k_m": {dtypes.q5_0, dtypes.q8_0}, "q5_k_m": {dtypes.q5_1, dtypes.q8_0}}[mix]
    assert set(matrices.values()) <= expected
    fallback = {"q4_k_m": dtypes.q5_0, "q5_k_m": dtypes.q5_1}.get(mix)
    assert fallback is None or fallback in set(matrices.values())


@pytest.mark.parametrize("mix,main", [("q4_k_m", dtypes.q4_k), ("q5_k_m", dtypes.q5_k)])
@pytest.mark.parametrize("arch", ARCHS)
def test_k_quant_width_gives_k_quants_and_q6_k(arch, mix, main):
    pytest.importorskip("llama_cpp")
    types = tensor_types(zoo.cached_model(arch, mix, **zoo.K_QUANT_DIMS))
    found = {t for t, _ in types.values()}
    assert {main, dtypes.q6_k} <= found
    for name, (t, ne0) in types.items():
        assert ne0 % t.block_size == 0, f"{name}: {t} rows of {ne0}"


@pytest.mark.parametrize("arch", ARCHS)
def test_odd_width_falls_back_to_32_blocks(arch):
    pytest.importorskip("llama_cpp")
    path = zoo.cached_model(arch, "q4_k_m", **zoo.ODD_WIDTH_DIMS)
    types = tensor_types(path)
    matrices = {t for name, (t, ne0) in types.items() if t is not dtypes.f32}
    assert matrices and matrices <= {dtypes.q5_0, dtypes.q8_0}, "320 is not a multiple of 256"
    logits = oracle.llama_logits(path, PROMPT)
    assert np.isfinite(logits).all()


def test_distinguishing_metadata():
    assert field(zoo.cached_model("gemma2"), "gemma2.attention.sliding_window") < len(PROMPT)
    assert field(zoo.cached_model("gemma3"), "gemma3.attention.sliding_window") < len(PROMPT)
    assert field(zoo.cached_model("gemma3"), "gemma3.block_count") >= 6
    hp = zoo.config("phi3")
    assert field(zoo.cached_model("phi3"), "phi3.rope.dimension_count") == hp["n_rot"] < hp["head_dim"]
    gemma3 = tensor_types(zoo.cached_model("gemma3"))
    assert "output.weight" not in gemma3 and "blk.0.attn_q_norm.weight" in gemma3
    assert "blk.0.attn_q.bias" in tensor_types(zoo.cached_model("qwen2"))
    phi3 = tensor_types(zoo.cached_model("phi3", rope_factors=True))
    assert phi3["rope_factors_long.weight"] == (dtypes.f32, hp["n_rot"] // 2)
    assert phi3["blk.0.ffn_up.weight"][0] is dtypes.f32


# --- llama.cpp runs them -------------------------------------------------------------------

@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_logits_are_sane(arch, mix):
    needs_llama_cpp(mix)
    path = zoo.cached_model(arch, mix)
    logits = oracle.llama_logits(path, PROMPT)
    assert logits.shape == (len(PROMPT), zoo.n_vocab(zoo.config(arch)["vocab"]))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    assert (logits.std(axis=1) > 0.1).all(), "a position has near-constant logits"
    assert len(set(logits.argmax(axis=1).tolist())) >= len(PROMPT) // 4, "argmax barely moves"


def test_greedy_agrees_with_prefill():
    path = zoo.cached_model("llama")
    new = oracle.llama_greedy(path, PROMPT[:8], 6)
    logits = oracle.llama_logits(path, PROMPT[:8] + new[:-1])
    assert logits[7:].argmax(axis=1).tolist() == new


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_keys_survive_the_copy(arch):
    vocab = zoo.VOCAB_DIR / zoo.VOCABS[zoo.config(arch)["vocab"]]
    text = "Hello world! The café serves 42 crêpes\n\ttoday."
    ids = oracle.llama_tokenize(zoo.cached_model(arch), text)
    assert ids == oracle.llama_tokenize(vocab, text) and len(ids) > 8


# --- each family's feature bites (A/B against llama.cpp) ---------------------------------

@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_sliding_window_masks_only_past_the_window(arch):
    window = zoo.config(arch)["sliding_window"]
    local = oracle.llama_logits(zoo.cached_model(arch), PROMPT)
    wide = oracle.llama_logits(zoo.cached_model(arch, sliding_window=len(PROMPT) + 1), PROMPT)
    np.testing.assert_allclose(local[:window], wide[:window], atol=1e-5)
    assert np.abs(local[window:] - wide[window:]).max(axis=1).min() > 1e-3


def test_gemma2_softcaps_bind():
    cap = zoo.config("gemma2")["final_softcap"]
    capped = oracle.llama_logits(zoo.cached_model("gemma2"), PROMPT)
    assert np.abs(capped).max() <= cap
    loose = oracle.llama_logits(zoo.cached_model("gemma2", final_softcap=1e4), PROMPT)
    assert np.abs(loose).max() > cap
    no_attn_cap = oracle.llama_logits(zoo.cached_model("gemma2", attn_softcap=1e4), PROMPT)
    assert np.abs(no_attn_cap - capped).max() > 1e-2


def test_gemma3_local_rope_base_defaults_to_10000():
    absent = oracle.llama_logits(zoo.cached_model("gemma3"), PROMPT)
    explicit = oracle.llama_logits(zoo.cached_model("gemma3", rope_base_swa=10000.0), PROMPT)
    other = oracle.llama_logits(zoo.cached_model("gemma3", rope_base_swa=100.0), PROMPT)
    np.testing.assert_array_equal(absent, explicit)
    assert np.abs(other - absent).max() > 1e-2


def test_phi3_rope_factors_long_beyond_original_context():
    path = zoo.cached_model("phi3", rope_factors=True)
    orig = zoo.config("phi3")["rope_orig_ctx"]
    long = oracle.llama_logits(path, PROMPT, n_ctx=2 * orig)
    short = oracle.llama_logits(path, PROMPT, n_ctx=orig)
    plain = oracle.llama_logits(zoo.cached_model("phi3"), PROMPT, n_ctx=orig)
    assert np.abs(long - short).max() > 1e-2
    assert np.abs(short - plain).max() > 1e-2


# --- the zoo's own contract ----------------------------------------------------------------

def test_cache_reuses_and_keys_on_every_argument():
    a = zoo.cached_model("llama")
    mtime = a.stat().st_mtime_ns
    assert zoo.cached_model("llama") == a and a.stat().st_mtime_ns == mtime
    assert zoo.cached_model("llama", seed=1) != a
    assert zoo.cached_model("llama", n_layer=3) != a


def test_same_seed_same_weights_and_overrides_apply(tmp_path):
    a = zoo.write_model(tmp_path / "a.gguf", "llama", n_embd=320, n_layer=1)
    b = zoo.write_model(tmp_path / "b.gguf", "llama", n_embd=320, n_layer=1)
    assert a.read_bytes() == b.read_bytes()
    assert field(a, "llama.embedding_length") == 320
    assert tensor_types(a)["blk.0.ffn_up.weight"] == (dtypes.f32, 320)


@pytest.mark.parametrize("call, message", [
    (lambda: zoo.config("mamba"), "unknown arch 'mamba'"),
    (lambda: zoo.config("llama", sliding_window=8), "llama has no hyper-parameter 'sliding_window'"),
    (lambda: zoo.config("llama", n_rot=8), "n_rot 8 must equal head_dim 16"),
    (lambda: zoo.config("qwen2", head_dim=32), "n_head*head_dim = 128 must equal n_embd 64"),
    (lambda: zoo.config("llama", n_head_kv=3), "n_head 4 is not a multiple of n_head_kv 3"),
    (lambda: zoo.config("gemma2", tied=False), "gemma2: tied=False is not supported"),
    (lambda: zoo.write_model("/nonexistent/x.gguf", "llama", mix="q3_k"), "unknown mix 'q3_k'"),
])
def test_bad_arguments_name_the_field(call, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")):
        call()
