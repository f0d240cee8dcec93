"""qwen3moe against llama.cpp and transformers, on a tiny model llama.cpp converted itself.

The model (hf_models.py: 2 layers, width 256, 8 experts of width 128, top-2, renormalised weights) is
made with transformers, converted by llama.cpp's convert_hf_to_gguf.py and quantised q8_0 and Q4_K_M by
llama.cpp (Q4_K_M's expert down-projections fall back to q5_0 and q8_0: their rows of 128 are no whole
k-quant block). On each file, on both backends, ggraph's logits equal llama.cpp's at every position, from
one prefill and token by token, with the dense families' tolerances: tests/test_hf_families.py runs those
tests over every family of hf_models; this file has what is the MoE families' own.

One allowance, on Q4_K_M only: at one position of the 24 (IDS[21]) llama.cpp's logits differ from ggraph's
(cosine 0.952 numpy, 0.955 llvm; top-1 differs), as if one router picked another expert. ggraph's numpy
backend there equals transformers run on the same file's dequantised weights (cosine 1.0; llvm 0.9996),
and llama.cpp does not (0.952); the router's 2nd-3rd logit gap at that token is 0.10 (layer 1), where
tokens with smaller gaps agree, so the cause inside llama.cpp is not pinned down. So test_hf_families
lets that one position (MISSES) miss the dense tolerance, and it still agrees to 0.9.
"""
import pytest

import hf_models
from ggraph.models.config import config_from_gguf
from ggraph.runtime.session import Session
from test_hf_families import NAMES, metadata
from test_models import EXACT

FAMILIES = ["qwen3moe"]
MIXES = list(hf_models.MIXES)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def session(path, backend, ctx=64):
    return Session(path, backend=backend, threads=2, ctx=ctx, **EXACT)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_experts_are_one_native_kernel_each(family):
    """Each layer's router picks experts with top_k, and its three expert matmuls are qmatmul_experts
    kernels reading the chosen experts' blocks: no expert tensor is dequantised whole."""
    for mix in MIXES:
        graph = str(session(hf_models.converted(family, mix), "llvm").program(False).graph)
        assert graph.count("qmatmul_experts") == 3 * 2 and graph.count("top_k") == 2, (mix, graph)
        assert "dequant" not in graph, (mix, graph)


# -- flags, from metadata alone ----------------------------------------------------------------------

EXPERTS = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 128,
           "attention.key_length": 128}


def test_qwen3moe_flags():
    cfg = config_from_gguf(metadata("qwen3moe", **EXPERTS), NAMES, 416)
    assert (cfg.qk_norm, cfg.rope_style, cfg.head_dim) == ("head", "neox", 128)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.expert_weights_norm) == (8, 2, 128, True)


def test_a_missing_expert_count_is_refused_by_name():
    keys = {k: v for k, v in EXPERTS.items() if k != "expert_used_count"}
    with pytest.raises(ValueError, match="qwen3moe model is missing metadata key 'qwen3moe.expert_used_count'"):
        config_from_gguf(metadata("qwen3moe", **keys), NAMES, 416)


def test_more_experts_used_than_there_are_is_refused_by_name():
    with pytest.raises(ValueError, match=r"qwen3moe: expert_used_count = 9 must be 1..expert_count = 8"):
        config_from_gguf(metadata("qwen3moe", **EXPERTS | {"expert_used_count": 9}), NAMES, 416)


def test_dense_families_have_no_experts():
    cfg = config_from_gguf(metadata("qwen3", **{"attention.key_length": 128}), NAMES, 416)
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.expert_weights_norm) == (0, 0, 0, False)
