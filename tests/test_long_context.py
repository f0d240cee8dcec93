"""Long contexts against llama.cpp: logits at positions up to the trained length (32k), sliding
windows far behind the query, rope at large angles, and the reference backend at depth.

Each case fills one context with random tokens. llama.cpp prefills them in ubatches of 512, with its
small sliding-window cache, and keeps only the compared positions' logits (``oracle.llama_logits_at``:
32k positions x 32k tokens of logits would be 4 GiB). ggraph prefills the same tokens in its own
ubatches into full-size caches: the last position's logits after each spread-out position, then the
tail as one all-positions step and its last few tokens as one-token decode steps. Both keep f32 KV
caches, so the comparison is exact up to rounding (the last test: f16 caches on both sides).

Attention costs heads x T^2, so the models are narrow (one or two query heads of 32, one or six
layers): a 32k prefill then takes llama.cpp 10-20 s on 2 cores, ggraph a few seconds.
"""
from functools import lru_cache

import numpy as np
import pytest

import oracle
import zoo
from ggraph.runtime.session import Session
from test_models import agreement

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

NARROW = dict(n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=128, vocab="llama-spm")
GEMMA3 = dict(NARROW, n_head=1, n_layer=6, sliding_window=512, rope_base=1e6, rope_base_swa=1e4, n_ctx_train=32768,
              rope_scaling=dict(type="linear", factor=8.0))

LONG = {   # name: (arch, overrides, tokens filled)
    # Qwen2.5 0.5B: trained on 32k, rope base 1e6 and no scaling in the file, GQA, q/k/v biases
    "qwen2.5-32k": ("qwen2", dict(NARROW, n_layer=1, rope_base=1e6, n_ctx_train=32768), 32768),
    # Qwen2.5 7B+ past its original context: yarn 4x (here from 4096 to 16k), ramped per-pair factors
    "qwen2.5-yarn-16k": ("qwen2", dict(NARROW, n_layer=1, rope_base=1e6, n_ctx_train=16384,
                                       rope_scaling=dict(type="yarn", factor=4.0, orig_ctx=4096)), 16384),
    # Gemma 3: layers 0-4 slide (window 512, base 1e4, unscaled), layer 5 is global (base 1e6, linear 8x);
    # one head: llama.cpp's 32k prefill costs ~20 s per head of the global layer
    "gemma-3-32k": ("gemma3", GEMMA3, 32768),
    # Llama 3.1: rope_freqs.weight divides the low frequencies by up to 8, base 500000
    "llama-3.1-8k": ("llama", dict(NARROW, n_layer=1, rope_base=500000.0, rope_freqs=True, n_ctx_train=131072),
                     8192),
    # Phi-3.5 mini: LongRoPE's long factors past the original 4096, attn factor 1.19, no GQA
    "phi-3.5-8k": ("phi3", dict(NARROW, n_head_kv=2, n_rot=32, n_layer=1, rope_factors=True, rope_orig_ctx=4096,
                                rope_attn_factor=1.19, n_ctx_train=131072), 8192),
    # Gemma 2 2B: its real window of 4096 (8 ubatches) on even layers, softcaps 50 / 30, trained on 8k
    "gemma-2-8k": ("gemma2", dict(NARROW, n_layer=2, sliding_window=4096, attn_softcap=50.0, final_softcap=30.0,
                                  n_ctx_train=8192), 8192),
}
SPREAD = (511, 512, 4095, 4096, 16383, 16384)   # ubatch edges and powers of two, as far as the context goes
TAIL, DECODE = 64, 4                            # the last 64 positions; of them the last 4 as one-token steps


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 1000, n)]


def positions(n: int) -> list[int]:
    return [p for p in SPREAD if p < n - TAIL] + list(range(n - TAIL, n))


def ggraph_logits(path, n: int, backend: str = "llvm", ubatch: int = 512, cache: str = "f32") -> np.ndarray:
    """ggraph's logits at ``positions(n)`` of one pass over ``tokens(n)``, with ``cache`` K and V caches."""
    ids = tokens(n)
    s = Session(path, backend=backend, threads=2, ctx=n, cache_type_k=cache, cache_type_v=cache, ubatch=ubatch)
    rows = [s.step(ids[s.n_past:p + 1]) for p in positions(n)[:-TAIL]]    # prefill through p: its last row
    s.step(ids[s.n_past:n - TAIL])
    rows.append(s.step(ids[n - TAIL:n - DECODE], last_only=False))
    rows += [s.step([t], last_only=False) for t in ids[n - DECODE:]]     # decode steps at depth
    assert s.n_past == n
    return np.concatenate(rows)


@lru_cache(maxsize=None)
def llama_cpp_logits(name: str) -> np.ndarray:
    """llama.cpp's logits at the same positions (once per case; the gemma tests share them)."""
    arch, over, n = LONG[name]
    return oracle.llama_logits_at(zoo.cached_model(arch, "f32", **over), tokens(n), positions(n), n_ctx=n,
                                  swa_full=False)


def check(name, got, want, min_cos=0.9999, min_top1=0.98):
    cos, top1 = agreement(got, want)
    n = LONG[name][2]
    assert cos > min_cos and top1 >= min_top1, \
        f"{name}: at positions {positions(n)[0]}..{n - 1}, min cosine {cos:.6f}, top-1 {top1:.3f}"
    return cos, top1


@pytest.mark.parametrize("name", LONG)
def test_logits_at_long_positions_match_llama_cpp(name):
    """Positions up to the trained length: rope at large angles, each rope scaling, windows far behind."""
    arch, over, n = LONG[name]
    check(name, ggraph_logits(zoo.cached_model(arch, "f32", **over), n), llama_cpp_logits(name))


def test_a_window_one_key_short_is_caught_far_beyond_it():
    """The comparison sees the window's edge: the same weights with a window of 511 on our side and 512
    on llama.cpp's diverge at 32k."""
    got = ggraph_logits(zoo.cached_model("gemma3", "f32", **dict(GEMMA3, sliding_window=511)), 32768)
    cos, top1 = agreement(got, llama_cpp_logits("gemma-3-32k"))
    assert cos < 0.999, f"window 511 against 512: min cosine {cos:.6f}, top-1 {top1:.3f}"


def test_native_matches_the_reference_backend_at_depth():
    """The fused kernels against the numpy reference, 8 windows deep (4k: numpy is slow), the native side in
    ubatches of 300 so that their edges cut the window anywhere."""
    path = zoo.cached_model("gemma3", "f32", **GEMMA3)
    cos, top1 = agreement(ggraph_logits(path, 4096, ubatch=300), ggraph_logits(path, 4096, backend="numpy"))
    assert cos > 0.99999 and top1 == 1.0, f"llvm against numpy at 4k: min cosine {cos:.7f}, top-1 {top1:.3f}"


def test_f16_caches_round_as_llama_cpp_does_at_32k():
    """ggraph's default f16 K and V caches against llama.cpp's f16 caches (flash attention, whose CPU kernel
    reads f16 rows as ggraph's does) at 32k: closer to them than to llama.cpp's f32 run, so the rounding
    is the same one, and not just small."""
    arch, over, n = LONG["qwen2.5-32k"]
    path = zoo.cached_model(arch, "f32", **over)
    got = ggraph_logits(path, n, cache="f16")
    want = oracle.llama_logits_at(path, tokens(n), positions(n), n_ctx=n, cache=("f16", "f16"), flash_attn=True)
    check("qwen2.5-32k", got, want)
    rms = {ref: float(np.sqrt(((got - logits) ** 2).mean())) for ref, logits in
           (("f16", want), ("f32", llama_cpp_logits("qwen2.5-32k")))}
    assert rms["f16"] < rms["f32"] / 2, f"RMS logit difference to llama.cpp's f16 and f32 runs: {rms}"
