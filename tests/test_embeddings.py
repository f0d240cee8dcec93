"""Session.embed against llama.cpp's embeddings (llama-cpp-python, embedding=True) on the same file:
the final hidden state after the output norm, pooled mean / last / cls, L2-normalised."""
import numpy as np
import pytest

import zoo
from ggraph.runtime.session import ContextFullError, Session

TEXTS = ["Hello world, this is a test.", "Another sentence entirely", "x"]


@pytest.mark.slow
@pytest.mark.parametrize("arch, mix", [("llama", "f32"), ("gemma3", "f32"), ("qwen2", "q8_0"), ("phi3", "q4_k_m")])
def test_embeddings_match_llama_cpp(arch, mix):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = zoo.cached_model(arch, mix)
    s = Session(path, ctx=128, threads=2)
    for pooling, kind in (("mean", "MEAN"), ("last", "LAST"), ("cls", "CLS")):
        ours = s.embed(TEXTS, pooling=pooling)
        llm = llama_cpp.Llama(str(path), embedding=True, pooling_type=getattr(llama_cpp, f"LLAMA_POOLING_TYPE_{kind}"),
                              n_ctx=128, n_threads=2, verbose=False)
        try:
            theirs = np.array([llm.embed(t, normalize=True) for t in TEXTS], dtype=np.float32)
        finally:
            llm.close()
        cos = (ours * theirs).sum(axis=1)
        assert ours.shape == theirs.shape and (cos > 0.9995).all(), (pooling, cos)


def test_embed_options_and_errors():
    s = Session(zoo.cached_model("llama", "f32"), ctx=16, threads=1)
    e = s.embed("Hello there")
    assert e.shape == (1, s.config.n_embd) and np.isclose(np.linalg.norm(e), 1.0)
    raw = s.embed(["Hello there"], normalize=False)
    np.testing.assert_allclose(raw / np.linalg.norm(raw), e, rtol=1e-6)
    ids = s.tokenizer.encode("Hello there")
    np.testing.assert_array_equal(s.embed([ids]), e)                 # token ids give the same
    s.step(ids)
    s.embed("again")
    assert s.n_past == 0                                              # embedding runs in a fresh context
    with pytest.raises(ValueError, match="pooling"):
        s.embed("x", pooling="max")
    with pytest.raises(ContextFullError, match="ctx=16"):
        s.embed("word " * 40)
