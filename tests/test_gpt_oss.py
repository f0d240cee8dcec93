"""gpt-oss: what is its own beside the oracle tests every family of hf_models runs (test_hf_families.py).

Its flags from metadata, its clamped SwiGLU against ggml's kernel transcribed, its attention as one fused
rope_attention kernel with the sinks in it, its experts as qmatmul_experts kernels, and a file whose
experts are MXFP4 blocks (llama.cpp's MXFP4_MOE mix of the tiny converted model, as real gpt-oss files
store them) against llama.cpp, prefill and decode, on both backends; ggraph's own quantiser writes that
file byte for byte.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import ggraph
import hf_models
import oracle
import zoo
from ggraph import f32
from ggraph.backends.llvm.target import named_target, runnable_targets
from ggraph.compiler import optimize
from ggraph.models import validate
from ggraph.models.config import config_from_gguf
from ggraph.models.transformer import swiglu_oai
from ggraph.runtime.session import Session
from test_hf_families import IDS, NAMES, assert_agrees, metadata
from test_models import EXACT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
MXFP4_MOE = 38                  # llama_ftype LLAMA_FTYPE_MOSTLY_MXFP4_MOE: experts MXFP4, the rest q8_0
GPT_OSS = {"expert_count": 32, "expert_used_count": 4, "expert_feed_forward_length": 2880,
           "attention.sliding_window": 128}


def session(path, backend, ctx=64):
    return Session(path, backend=backend, threads=2, ctx=ctx, **EXACT)


# -- flags, from metadata alone ----------------------------------------------------------------------

def test_gpt_oss_flags():
    names = NAMES | {"output.weight"} | {f"blk.{i}.attn_q.weight" for i in range(4)}
    cfg = config_from_gguf(metadata("gpt-oss", block_count=4, **GPT_OSS), names, 416)
    assert (cfg.rope_style, cfg.act, cfg.qkv_bias, cfg.attn_output_bias, cfg.attn_sinks, cfg.ffn_norm) == \
        ("neox", "swiglu_oai", True, True, True, "post_attention_norm")
    assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.expert_gating, cfg.expert_bias,
            cfg.expert_weights_norm) == (32, 4, 2880, "softmax_weight", True, False)
    assert (cfg.sliding_window, cfg.swa_layers, cfg.rope_base_local) == (128, (True, False, True, False), None)
    local = config_from_gguf(metadata("gpt-oss", **GPT_OSS, **{"rope.freq_base_swa": 1e4}), NAMES, 416)
    assert local.rope_base_local == 1e4


@pytest.mark.parametrize("missing", ["attention.sliding_window", "expert_feed_forward_length", "expert_count"])
def test_gpt_oss_metadata_llama_cpp_requires_is_required_by_name(missing):
    keys = {k: v for k, v in GPT_OSS.items() if k != missing}
    with pytest.raises(ValueError, match=f"gpt-oss model is missing metadata key 'gpt-oss.{missing}'"):
        config_from_gguf(metadata("gpt-oss", **keys), NAMES, 416)


def test_gpt_oss_tensors_are_checked_by_name():
    meta = metadata("gpt-oss", **GPT_OSS)
    cfg = config_from_gguf(meta, NAMES, 416)
    tensors = {name: SimpleNamespace(shape=shape, dtype=f32) for name, (shape, _) in
               validate.expected_shapes(cfg, set()).items()}          # every tensor the decoder reads, as it wants it
    assert "blk.0.ffn_norm.weight" not in tensors and tensors["blk.0.post_attention_norm.weight"].shape == (256,)
    assert (tensors["blk.0.attn_sinks.weight"].shape, tensors["blk.0.ffn_down_exps.bias"].shape) == ((4,), (32, 256))
    validate.check(cfg, tensors, meta)
    del tensors["blk.0.attn_sinks.weight"]
    with pytest.raises(ValueError, match=r"tensor blk.0.attn_sinks.weight is missing \(gpt-oss.attention.head_count "
                                         r"= 4 says the gpt-oss decoder needs \[4\]\)"):
        validate.check(cfg, tensors, meta)


# -- the clamped SwiGLU --------------------------------------------------------------------------------

def swiglu_oai_ggml(g: np.ndarray, u: np.ndarray, alpha=np.float32(1.702), limit=np.float32(7.0)) -> np.ndarray:
    """ggml_compute_forward_swiglu_oai_f32 (ggml-cpu/ops.cpp), element by element in f32."""
    out = np.empty_like(g)
    with np.errstate(over="ignore"):
        for i, (gi, ui) in enumerate(zip(g.reshape(-1), u.reshape(-1))):
            x = min(gi, limit)
            y = min(max(ui, -limit), limit)
            out.reshape(-1)[i] = x / (np.float32(1) + np.exp(alpha * -x)) * (y + np.float32(1))
    return out


def activations(rng, n=512):
    """Gates and ups across both clamps, and gates negative enough that exp(-alpha g) overflows f32."""
    g = (rng.standard_normal(n) * 6).astype(np.float32)
    u = (rng.standard_normal(n) * 6).astype(np.float32)
    g[:4], u[:4] = [7.0, -60.0, -200.0, 1e30], [-7.0, 7.0, 50.0, -1e30]
    return g.reshape(4, -1), u.reshape(4, -1)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")     # the unfused body's exp(-alpha g) = inf
def test_swiglu_oai_is_ggmls_kernel():
    g, u = activations(np.random.default_rng(0))
    want = swiglu_oai_ggml(g, u)
    assert (np.abs(g) > 7).mean() > 0.1 and np.isfinite(want).all() and want[0, 2] == 0
    graph = ggraph.trace(lambda g, u: swiglu_oai(g, u, alpha=1.702, limit=7.0), f32[4, 128], f32[4, 128])
    assert "swiglu_oai[alpha=1.702, limit=7.0]" in str(graph).replace("'", ""), graph
    np.testing.assert_array_equal(ggraph.compile(graph, backend="numpy", passes=[])(g, u), want)
    np.testing.assert_allclose(ggraph.compile(graph, backend="numpy", passes="none")(g, u), want, rtol=2e-7, atol=0)


@pytest.mark.parametrize("target", [t.name for t in runnable_targets()])
def test_swiglu_oai_on_llvm_is_one_fused_loop(target):
    g, u = activations(np.random.default_rng(1))
    graph = ggraph.trace(lambda g, u: swiglu_oai(g, u, alpha=1.702, limit=7.0), f32["T", 128], f32["T", 128])
    assert "fused" in str(optimize(graph))
    got = ggraph.compile(graph, backend="llvm", target=named_target(target))(g, u)
    want = swiglu_oai_ggml(g, u)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# -- the converted tiny model --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mix", list(hf_models.MIXES))
def test_the_attention_is_fused_with_its_sinks_and_the_experts_are_native(mix):
    graph = str(session(hf_models.converted("gpt-oss", mix), "llvm").program(False).graph)
    attn = [line for line in graph.splitlines() if "rope_attention" in line]
    assert len(attn) == 2 and all("sinks=True" in line for line in attn), attn
    assert sum("window=8" in line for line in attn) == 1, attn            # layer 0 slides, layer 1 does not
    assert graph.count("qmatmul_experts") == 3 * 2 and graph.count("top_k") == 2 and "dequant" not in graph, graph


@pytest.fixture(scope="module")
def mxfp4_files(tmp_path_factory):
    """The tiny gpt-oss quantised by llama.cpp with MXFP4_MOE (MXFP4 experts, the other matrices q8_0), and its
    f32 copy with every tensor dequantised (what the numpy backend is compared on: test_hf_families says why)."""
    import gguf_edit
    from ggraph.gguf import GGUFFile, quants
    folder = tmp_path_factory.mktemp("gpt-oss")
    path = zoo.llama_quantize(hf_models.converted("gpt-oss", "f32"), folder / "gpt-oss-mxfp4_moe.gguf", MXFP4_MOE,
                              what="gpt-oss mxfp4_moe")
    with GGUFFile(str(path)) as f:
        weights = {n: np.asarray(quants.dequantize(t.data, t.dtype, t.shape), np.float32).reshape(t.shape)
                   for n, t in f.tensors.items() if t.dtype.name != "f32"}
    return path, gguf_edit.edited(path, folder / "gpt-oss-mxfp4_moe-dequantised.gguf",
                                  keys={"general.file_type": 0}, tensors=weights)


@pytest.mark.slow
def test_the_mxfp4_file_holds_mxfp4_experts(mxfp4_files):
    from ggraph.gguf import GGUFFile
    with GGUFFile(str(mxfp4_files[0])) as f:
        types = {name: t.dtype.name for name, t in f.tensors.items()}
    experts = {n: t for n, t in types.items() if "_exps.weight" in n}
    assert len(experts) == 6 and set(experts.values()) == {"mxfp4"}, types
    assert types["blk.0.attn_q.weight"] == "q8_0" and types["blk.0.attn_sinks.weight"] == "f32", types


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_mxfp4_experts_match_llama_cpp(mxfp4_files, backend):
    """Prefill and token-by-token decode, with the bars of a q8_0 file on llvm; the numpy backend against
    llama.cpp on the dequantised copy, with the f32 bar (as test_hf_families compares files with experts)."""
    path = mxfp4_files[0]
    ref, bar = (path, "q8_0") if backend == "llvm" else (mxfp4_files[1], "f32")
    s = session(path, backend)
    assert_agrees(s.logits(IDS), oracle.llama_logits(ref, IDS, n_ctx=64), bar, backend, f"gpt-oss mxfp4 {backend}")
    s.reset()
    got = np.concatenate([s.step([t], last_only=False) for t in IDS])
    assert_agrees(got, oracle.llama_logits_stepwise(ref, IDS, n_ctx=64), bar, backend,
                  f"gpt-oss mxfp4 {backend} decode")
    if backend == "llvm":
        graph = str(s.program(False).graph)
        assert graph.count("qmatmul_experts") == 6 and "dequant" not in graph, graph


@pytest.mark.slow
def test_ggraph_quantize_writes_llama_quantizes_mxfp4_moe_file(mxfp4_files, tmp_path):
    """MXFP4_MOE by ggraph's own quantiser: the same types and bytes, tensor by tensor, as llama-quantize's."""
    from ggraph.gguf import GGUFFile
    from ggraph.quantize import quantize_file
    quantize_file(hf_models.converted("gpt-oss", "f32"), tmp_path / "ggraph.gguf", "MXFP4_MOE", threads=2)
    with GGUFFile(str(tmp_path / "ggraph.gguf")) as got, GGUFFile(str(mxfp4_files[0])) as want:
        assert list(got.tensors) == list(want.tensors)
        for name, t in want.tensors.items():
            assert (got.tensors[name].dtype.name, bytes(got.tensors[name].data)) == (t.dtype.name, bytes(t.data)), name
