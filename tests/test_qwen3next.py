"""qwen3next (Qwen3-Next: gated delta-net layers around a gated attention layer, experts and a shared expert in
every layer) against llama.cpp and transformers, on a tiny model llama.cpp converted itself.

The model (hf_models.DELTA_NET: width 256, 3 layers, the middle one attention) is made with transformers,
converted by llama.cpp's convert_hf_to_gguf.py (--no-mtp) and quantised q8_0 by llama.cpp. On the f32 and q8_0
files, on both backends, ggraph's logits equal llama.cpp's at every position from one prefill, token by token
(each delta-net layer's convolution inputs and state carried from step to step, as llama.cpp carries them), and
after a cut back to a shorter prefix (the state restored from a snapshot), with test_hf_families' bars
(``assert_agrees``; numpy on q8_0 against llama.cpp on the dequantised weights, as for every family with
experts). The flags are read from metadata alone, and bad metadata is refused by name.
"""
import numpy as np
import pytest

import hf_models
import oracle
from family_checks import cut_back_then_new_tokens, on_feature_set, second_turn_reusing_the_prefix, shared_session
from ggraph.backends.llvm.target import X86_NAMES
from ggraph.models.config import config_from_gguf
from test_hf_families import IDS, assert_agrees, reference
from test_models import agreement

FAMILY = "qwen3next"
CTX = 64

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def session(mix, backend):
    return shared_session(hf_models.converted(FAMILY, mix), backend, CTX)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
@pytest.mark.parametrize("mix", ["f32", "q8_0"])
def test_prefill_and_decode_logits_match_llama_cpp(mix, backend):
    s = session(mix, backend)
    ref, bar = reference(FAMILY, mix, backend)
    got = s.logits(IDS)
    assert got.shape == (len(IDS), 50304) and got.dtype == np.float32
    assert_agrees(got, oracle.llama_logits(ref, IDS, n_ctx=CTX), bar, backend, f"{mix} {backend} prefill")
    s.reset()
    got = np.concatenate([s.step([t], last_only=False) for t in IDS])
    assert_agrees(got, oracle.llama_logits_stepwise(ref, IDS, n_ctx=CTX), bar, backend, f"{mix} {backend} decode")


@pytest.mark.slow
@pytest.mark.parametrize("target", X86_NAMES)
def test_every_feature_set_this_host_runs(target, monkeypatch):
    """The q8_0 file through each feature set's kernels (the delta-rule kernel's generic twin on generic),
    prefill and decode."""
    s = on_feature_set(hf_models.converted(FAMILY, "q8_0"), target, monkeypatch, IDS,
                       lambda got, want, what: assert_agrees(got, want, "q8_0", "llvm", f"{target} {what}"), CTX)
    assert s.program(False).graph.count("fused_gated_delta_rule") == 2          # one per delta-net layer


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_a_cut_back_prefix_then_new_tokens_match_llama_cpp(backend):
    """A chat turn that reuses the cached prefix: 16 tokens run (a prefill, then decode steps), the cache cut
    back to 10 (the states restored from the prefill's snapshot, tokens after it run again), then 10 new
    tokens: their logits are llama.cpp's over one prefill of the whole sequence."""
    got, want = cut_back_then_new_tokens(session("f32", backend), hf_models.converted(FAMILY, "f32"), IDS, CTX)
    assert_agrees(got, want, "f32", backend, f"{backend} after truncate")


@pytest.mark.slow
def test_a_second_turn_reusing_the_cached_prefix_equals_a_fresh_prefill():
    """Session.generate(reuse_cache=True): the second prompt shares 10 tokens with the first turn's context, so
    the states go back to a snapshot and the rest runs again; its greedy reply is a fresh session's (whose
    logits the tests above hold to llama.cpp's; llama.cpp's own greedy tokens are near-ties on this random
    model from the first one, so they decide nothing here)."""
    second_turn_reusing_the_prefix(session("f32", "llvm"), hf_models.converted(FAMILY, "f32"), IDS, CTX)


@pytest.mark.slow
def test_transformers_agrees_with_llama_cpp_and_ggraph():
    """The oracle's oracle: the converted f32 file computes what the Hugging Face model does."""
    path = hf_models.converted(FAMILY, "f32")
    hf = hf_models.hf_logits(FAMILY, IDS)
    for name, logits in (("llama.cpp", oracle.llama_logits(path, IDS, n_ctx=CTX)),
                         ("llvm", session("f32", "llvm").logits(IDS))):
        cos, top1 = agreement(logits, hf)
        assert cos >= 0.9999 and top1 == 1.0, (name, cos, top1)


@pytest.mark.slow
def test_what_the_converter_writes_as_the_flags_read_it():
    from ggraph.models import load
    model = load(hf_models.converted(FAMILY, "q8_0"))
    cfg = model.config
    assert (cfg.recurrent_layers, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rope_dims, cfg.rope_style) == \
        ((0, 2), 4, 2, 64, 16, "neox")
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp, cfg.expert_weights_norm) == \
        (8, 2, 128, 256, True)
    assert {k: cfg.extra[k] for k in ("dn_key_heads", "dn_value_heads", "dn_head", "dn_conv")} == \
        {"dn_key_heads": 2, "dn_value_heads": 4, "dn_head": 64, "dn_conv": 4}
    assert model.kv_layers == (1,)
    graph = str(session("q8_0", "llvm").program(False).graph)
    assert "dequant" not in graph, graph                                  # every q8_0 matmul reads its blocks


@pytest.mark.slow
@pytest.mark.parametrize("mix, ftype", [("q8_0", "q8_0"), ("q4_k_m", "q4_k_m")])
def test_ggraph_quantize_writes_llama_quantizes_tensors(mix, ftype, tmp_path):
    """ggraph's quantiser on the f32 file gives the tensors llama.cpp's llama_model_quantize wrote (hf_models'
    files): the same types (the delta-net tensors' rows that are not whole k-quant blocks taking llama.cpp's
    fallbacks) and the same bytes."""
    from ggraph.gguf import GGUFFile
    from ggraph.quantize import quantize_file
    ours = tmp_path / f"{mix}.gguf"
    quantize_file(hf_models.converted(FAMILY, "f32"), ours, ftype)
    with GGUFFile(str(ours)) as a, GGUFFile(str(hf_models.converted(FAMILY, mix))) as b:
        assert set(a.tensors) == set(b.tensors)
        for name, t in b.tensors.items():
            assert a.tensors[name].dtype is t.dtype, (name, a.tensors[name].dtype, t.dtype)
            assert np.array_equal(np.asarray(a.tensors[name].data), np.asarray(t.data)), name


# -- flags, from metadata alone ----------------------------------------------------------------------

NAMES = {"token_embd.weight", "blk.0.attn_norm.weight", "blk.1.attn_norm.weight", "blk.2.attn_norm.weight",
         "blk.3.attn_norm.weight"}
KEYS = {"embedding_length": 256, "block_count": 4, "attention.head_count": 4, "attention.head_count_kv": 2,
        "attention.key_length": 64, "feed_forward_length": 512, "expert_count": 8, "expert_used_count": 2,
        "expert_feed_forward_length": 128, "expert_shared_feed_forward_length": 256, "rope.dimension_count": 16,
        "ssm.conv_kernel": 4, "ssm.state_size": 64, "ssm.group_count": 2, "ssm.time_step_rank": 4,
        "ssm.inner_size": 256}


def config(**keys):
    keys = {k: v for k, v in (KEYS | keys).items() if v is not None}
    return config_from_gguf({"general.architecture": FAMILY, **{f"{FAMILY}.{k}": v for k, v in keys.items()}},
                            NAMES, 416)


def test_recurrent_layers_from_the_flags_or_the_interval():
    assert config().recurrent_layers == (0, 1, 2)                          # every 4th layer attends (default)
    assert config(full_attention_interval=2).recurrent_layers == (0, 2)
    assert config(**{"attention.recurrent_layers": [True, False, False, True]}).recurrent_layers == (0, 3)


@pytest.mark.parametrize("keys, message", [
    ({"ssm.group_count": None}, "qwen3next model is missing metadata key 'qwen3next.ssm.group_count'"),
    ({"ssm.group_count": 3}, r"qwen3next.ssm.time_step_rank = 4 \(value heads\) must be a multiple of "
                             r"qwen3next.ssm.group_count = 3 \(key heads\)"),
    ({"ssm.inner_size": 512}, r"qwen3next.ssm.inner_size = 512 equal to it times qwen3next.ssm.state_size = 64"),
    ({"ssm.conv_kernel": 1}, r"qwen3next.ssm.conv_kernel = 1: must be an integer of at least 2"),
    ({"nextn_predict_layers": 1}, r"qwen3next.nextn_predict_layers is set: .* \(convert with --no-mtp\)"),
    ({"attention.recurrent_layers": [True, False]}, r"qwen3next.attention.recurrent_layers must be a bool per "
                                                    r"layer \(4\)"),
])
def test_bad_metadata_is_refused_by_name(keys, message):
    with pytest.raises(ValueError, match=message) as e:
        config(**keys)
    assert "\n" not in str(e.value)
