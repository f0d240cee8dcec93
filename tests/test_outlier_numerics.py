"""Trained models' outlier activations against llama.cpp, on the weight types whose activations ggml
quantises to q8_1 (q4_1, q5_1): zoo.cached_outlier_model, a SmolLM2-135M-shaped llama whose residual
stream carries three channels 50x the rest, quantised by llama.cpp.

A block of activations holding an outlier has a large s = d * sum(q), which ggml keeps in fp16; ggraph
rounds it as ggml does, so each matmul gives llama.cpp's outputs but for the last bits of its summation
order. The next layer's q8 rounding turns those bits into visible logit differences, as on a trained
model, so the whole-model bars are what every feature set reaches with a margin: llama.cpp's own prefill
and token-by-token runs give the same bits, a spread no independent implementation can match.
"""
import numpy as np
import pytest

import ggraph
import oracle
import zoo
from ggraph import f32, ops
from ggraph.gguf import GGUFFile
from ggraph.runtime.session import Session
from test_models import EXACT

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

T = 32
PROMPT = [1] + np.random.default_rng(0).integers(10, 1000, T - 1).tolist()    # BOS first, as trained models see it
MIN_COSINE = 0.995          # of the logits at each position
MAX_REL_ERR = 0.15          # max |logit error| / max |logit|
MATMUL_REL_ERR = 2e-6       # max |error| / max |output| of one matmul: a few ulps
MATMULS = {"attn_q": ("attn_norm", "Qcur"), "attn_k": ("attn_norm", "Kcur"), "attn_v": ("attn_norm", "Vcur"),
           "attn_output": ("kqv_out", "attn_out"), "ffn_gate": ("ffn_norm", "ffn_gate"),
           "ffn_up": ("ffn_norm", "ffn_up"), "ffn_down": ("ffn_swiglu", "ffn_out")}


@pytest.fixture(scope="module", params=list(zoo.OUTLIER_MIXES))
def model(request):
    return zoo.cached_outlier_model(request.param)


@pytest.fixture(scope="module")
def llama(model):
    """llama.cpp's logits for PROMPT: (one prefill, token by token)."""
    return oracle.llama_logits(model, PROMPT, n_ctx=64), oracle.llama_logits_stepwise(model, PROMPT, n_ctx=64)


def worst(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(minimum cosine over positions, max |got - want| / max |want|)."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    cos = (g * w).sum(1) / np.linalg.norm(g, axis=1) / np.linalg.norm(w, axis=1)
    return float(cos.min()), float(np.abs(g - w).max() / np.abs(w).max())


def test_fixture_has_outlier_activations(model):
    """In llama.cpp's run, the outlier channels of the normed residual and features of the FFN are tens
    of times the typical activation: a q8 block holding one rounds the rest to a few levels."""
    got = oracle.llama_tensors(model, PROMPT, {"attn_norm-1", "ffn_swiglu-1"}, n_ctx=64)
    for name, where in (("attn_norm-1", zoo.OUTLIER_CHANNELS), ("ffn_swiglu-1", zoo.OUTLIER_FEATURES)):
        x = np.abs(got[name][0].reshape(T, -1))
        assert x[:, list(where)].mean() > 20 * np.median(x), name
    with GGUFFile(model) as f:
        assert f.tensors["blk.0.attn_q.weight"].dtype.name in zoo.OUTLIER_MIXES


def test_llama_cpp_prefill_and_token_by_token_give_the_same_logits(llama):
    batch, steps = llama
    np.testing.assert_array_equal(batch, steps)


def test_llvm_prefill_agrees_with_llama_cpp_at_every_position(model, llama):
    got = Session(model, backend="llvm", threads=2, ctx=64, **EXACT).logits(PROMPT)
    cos, err = worst(got, llama[0])
    assert cos >= MIN_COSINE and err <= MAX_REL_ERR, (cos, err)


def test_llvm_token_by_token_agrees_with_llama_cpp_at_every_position(model, llama):
    s = Session(model, backend="llvm", threads=2, ctx=64, **EXACT)
    got = np.concatenate([s.step([t], last_only=False) for t in PROMPT])
    cos, err = worst(got, llama[1])
    assert cos >= MIN_COSINE and err <= MAX_REL_ERR, (cos, err)


def test_llvm_matmuls_fed_llama_cpps_inputs_give_its_outputs_to_the_last_bits(model):
    """Every matmul of the layers whose tensors llama.cpp keeps for all tokens (it drops all but the last
    token's rows in the last layer), as a prefill of T tokens and as decodes of the first four."""
    n_layer = zoo.SMOLLM2_DIMS["n_layer"]
    names = {f"{name}-{i}" for i in range(n_layer - 1) for pair in MATMULS.values() for name in pair}
    got = oracle.llama_tensors(model, PROMPT, names, n_ctx=64)
    with GGUFFile(model) as f:
        for i in range(n_layer - 1):
            for weight, (src, dst) in MATMULS.items():
                w = f.tensors[f"blk.{i}.{weight}.weight"]
                N, K = w.shape
                prog = ggraph.compile(ggraph.trace(ops.linear, f32["T", K], ggraph.param(w.name, w.dtype[N, K])),
                                      backend="llvm", weights=f)
                x, want = got[f"{src}-{i}"][0].reshape(T, K), got[f"{dst}-{i}"][0].reshape(T, N)
                for rows in [slice(0, T)] + [slice(t, t + 1) for t in range(4)]:
                    err = np.abs(prog(x[rows], None) - want[rows]).max() / np.abs(want[rows]).max()
                    assert err < MATMUL_REL_ERR, (w.name, rows, err)
