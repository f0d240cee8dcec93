"""KV cache types (f32, f16, bf16, q8_0, q4_0, per K and V) against llama.cpp run with the same
types, on both backends, prefill and decode; and what a Session refuses."""
import numpy as np
import pytest
import zoo
import oracle

from ggraph.runtime.session import Session

pytestmark = pytest.mark.slow
FAMILIES = ["qwen2.5", "gemma-3", "phi-3.5"]         # head dims 64, 256, 96: 2, 8 and 3 blocks per row
CTX = 128


def _model(name):
    arch, over = zoo.REAL_SHAPES[name]
    return zoo.cached_model(arch, "f32", **over)


def _ids(n=100):
    return [int(i) for i in np.random.default_rng(0).integers(5, 200, n)]


def cosines(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def _ours(path, backend, kt, vt, ids, split=60):
    """Logits of one prefill of ``ids``, and of a prefill of ``ids[:split]`` then one decode step per token."""
    s = Session(path, backend=backend, ctx=CTX, threads=2, cache_type_k=kt, cache_type_v=vt)
    whole = s.logits(ids)
    s.reset()
    s.step(ids[:split])
    steps = np.concatenate([s.step([t]) for t in ids[split:]])
    return whole, steps


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("kt,vt,least", [("f16", "f16", 0.99999), ("bf16", "bf16", 0.9999), ("q8_0", "q8_0", 0.9995),
                                         ("q8_0", "f16", 0.9995), ("f16", "q8_0", 0.9995)])
def test_cache_types_match_llama_cpp(name, backend, kt, vt, least):
    path, ids = _model(name), _ids()
    want = oracle.llama_logits(path, ids, n_ctx=CTX, cache=(kt, vt), flash_attn=True)
    whole, steps = _ours(path, backend, kt, vt, ids)
    for what, got, ref in (("prefill", whole, want), ("decode", steps, want[60:])):
        c = cosines(got, ref)
        assert c.min() > least, f"{name} {kt}/{vt} {backend} {what}: min cosine {c.min():.6f} at {c.argmin()}"
        assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9          # random weights: near ties


@pytest.mark.parametrize("name", FAMILIES)
def test_q4_0_cache_is_as_close_to_f32_as_llama_cpps(name):
    """q4_0 rounds hard, and llama.cpp's kernels round its queries too, so the two q4_0 runs are
    compared by their distance to the f32 run: ggraph's may not be worse."""
    path, ids = _model(name), _ids()
    exact = oracle.llama_logits(path, ids, n_ctx=CTX, flash_attn=True)
    theirs = oracle.llama_logits(path, ids, n_ctx=CTX, cache=("q4_0", "q4_0"), flash_attn=True)
    ours, _ = _ours(path, "llvm", "q4_0", "q4_0", ids)
    mine, ref = cosines(ours, exact).mean(), cosines(theirs, exact).mean()
    assert mine > ref - 2e-3, f"{name}: ggraph q4_0 mean cosine to f32 {mine:.5f}, llama.cpp's {ref:.5f}"


def test_cache_sizes_and_refusals():
    path = _model("qwen2.5")                                    # 1 kv head of 64
    sizes = {t: Session(path, backend="numpy", ctx=CTX, cache_type_k=t, cache_type_v=t).memory()["kv_cache"]
             for t in ("f32", "f16", "bf16", "q8_0", "q4_0")}
    row = 2 * 2 * CTX                                           # K and V, 2 layers, CTX rows of one kv head
    assert sizes == {"f32": row * 256, "f16": row * 128, "bf16": row * 128, "q8_0": row * 68, "q4_0": row * 36}
    with pytest.raises(ValueError, match="cache_type_k must be one of f32, f16, bf16, q8_0, q4_0, got 'q4_k'"):
        Session(path, backend="numpy", cache_type_k="q4_k")
    small = zoo.cached_model("llama", "f32")                    # head dim 16
    with pytest.raises(ValueError, match="a q8_0 V cache needs a head dim that is a multiple of 32; this model's is 16"):
        Session(small, backend="numpy", cache_type_v="q8_0")
